#pragma once
// Input decks: INI files read with Boost.Program_options ("[section]" then "key = value", '#'
// comments). Every key is declared in a DeckSchema (core/engine/keys.hpp) with its type, default,
// allowed range and one line of help; plugins add their own sections to the same schema. A deck is
// refused before any work, naming file:line, the key, the value and what is allowed.
#include <string>
#include <vector>

#include "core/engine/keys.hpp"

namespace loom {

// The keys of the core (model, data, train, parallel, run, checkpoint).
void add_core_keys(DeckSchema& schema);

// Reads `path` (INI), then applies each "section.key=value" of `sets` in order. Throws DeckError
// with a message naming file:line (or "--set") for: a missing/unreadable file, a line that is not
// INI, an unknown section (nearest valid section), an unknown key (nearest valid key), a key
// given twice, a value of the wrong type or outside its range (the allowed range or choices).
Deck load_deck(const DeckSchema& schema, const std::string& path, const std::vector<std::string>& sets = {});
// Same, from text in memory; `name` stands in for the file name in messages.
Deck parse_deck(const DeckSchema& schema, const std::string& text, const std::string& name,
                const std::vector<std::string>& sets = {});

}  // namespace loom
