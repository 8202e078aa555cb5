#pragma once
// Input decks: INI files read with Boost.Program_options ("[section]" then "key = value", '#'
// comments). Every key is declared in a DeckSchema with its type, default, allowed range and one line
// of help; plugins add their own sections to the same schema. A deck is refused before any work,
// naming file:line, the key, the value and what is allowed.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/base/error.hpp"

namespace loom {

enum class KeyType { Int, Float, Bool, String, Choice };

struct KeySpec {
  std::string name;           // "section.key"
  KeyType type = KeyType::String;
  std::string default_value;  // as it would be written in a deck
  double min = -1e300;        // inclusive bounds for Int and Float
  double max = 1e300;
  std::vector<std::string> choices;  // for Choice
  std::string help;
  // Extra check on the textual value (after type/range checks): returns "" when fine, otherwise
  // what is allowed (e.g. "synthetic, text:PATH or tokens:GLOB").
  std::function<std::string(const std::string&)> validate;
};

class DeckSchema {
 public:
  void add(KeySpec spec);  // throws std::logic_error on a duplicate name
  const KeySpec* find(const std::string& name) const;
  const std::vector<KeySpec>& keys() const { return keys_; }  // in declaration order
  std::vector<std::string> sections() const;                  // in declaration order
  // The declared key closest to `name` (edit distance; used for "did you mean").
  std::string nearest_key(const std::string& name) const;
  std::string nearest_section(const std::string& section) const;
  // Human-readable table of every key: name, type, default, range/choices, help.
  std::string describe() const;

 private:
  std::vector<KeySpec> keys_;
};

// The keys of the core (model, data, train, parallel, run, checkpoint).
void add_core_keys(DeckSchema& schema);

// Key declarations, for the core and for plugins alike. Bounds are inclusive.
KeySpec int_key(std::string name, std::string def, double lo, double hi, std::string help);
KeySpec float_key(std::string name, std::string def, double lo, double hi, std::string help);
KeySpec bool_key(std::string name, std::string def, std::string help);
KeySpec string_key(std::string name, std::string def, std::string help,
                   std::function<std::string(const std::string&)> validate = {});
KeySpec choice_key(std::string name, std::string def, std::vector<std::string> choices, std::string help);

class Deck {
 public:
  // Reads `path` (INI), then applies each "section.key=value" of `sets` in order. Throws InputError
  // with a message naming file:line (or "--set") for: a missing/unreadable file, a line that is not
  // INI, an unknown section (nearest valid section), an unknown key (nearest valid key), a key
  // given twice, a value of the wrong type or outside its range (the allowed range or choices).
  static Deck load(const DeckSchema& schema, const std::string& path,
                   const std::vector<std::string>& sets = {});
  // Same, from text in memory; `name` stands in for the file name in messages.
  static Deck parse(const DeckSchema& schema, const std::string& text, const std::string& name,
                    const std::vector<std::string>& sets = {});

  std::int64_t get_int(const std::string& name) const;
  double get_float(const std::string& name) const;
  bool get_bool(const std::string& name) const;
  std::string get_string(const std::string& name) const;  // also for Choice
  bool is_default(const std::string& name) const;
  // "deck.ini:12", "--set", or "default".
  std::string origin(const std::string& name) const;
  const std::string& path() const { return path_; }
  // Every declared key with its resolved value, as a deck that `loom run` would accept; keys left
  // at their default carry a "# default" comment; sections in schema order.
  std::string resolved_text() const;
  // name -> resolved textual value, for every declared key.
  std::map<std::string, std::string> values() const;

 private:
  const DeckSchema* schema_ = nullptr;
  std::string path_;
  std::map<std::string, std::string> values_;   // every declared key
  std::map<std::string, std::string> origins_;  // every declared key
};

}  // namespace loom
