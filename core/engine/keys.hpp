#pragma once
// Deck keys, as the core and every strategy declare and read them: a key's type, default, range and
// help (KeySpec), the schema of all of them, and the resolved deck a run reads (Deck). Reading a
// deck file is io's (io/deck.hpp: load_deck, parse_deck), so that nothing here knows INI or Boost.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/base/error.hpp"

namespace loom {

enum class KeyType { Int, Float, Bool, String, Choice };

struct KeySpec {
  std::string name;  // "section.key"
  KeyType type = KeyType::String;
  std::string default_value;  // as it would be written in a deck
  double min = -1e300;        // inclusive bounds for Int and Float
  double max = 1e300;
  std::vector<std::string> choices;  // for Choice
  std::string help;
  // Extra check on the textual value (after type/range checks): returns "" when fine, otherwise
  // what is allowed (e.g. "synthetic, text:PATH or tokens:GLOB").
  std::function<std::string(const std::string&)> validate;
  // Names this key had before (a deck that uses one is refused with a message naming this one).
  std::vector<std::string> former_names;
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
  // The key that was called `name` before (KeySpec::former_names), or null.
  const KeySpec* renamed(const std::string& name) const;
  // What a deck that uses the former name `name` is told (empty when `name` is no former name).
  std::string renamed_message(const std::string& name) const;
  // Human-readable table of every key: name, type, default, range/choices, help.
  std::string describe() const;

 private:
  std::vector<KeySpec> keys_;
};

// Key declarations, for the core and for plugins alike. Bounds are inclusive.
KeySpec int_key(std::string name, std::string def, double lo, double hi, std::string help);
KeySpec float_key(std::string name, std::string def, double lo, double hi, std::string help);
KeySpec bool_key(std::string name, std::string def, std::string help);
KeySpec string_key(std::string name, std::string def, std::string help,
                   std::function<std::string(const std::string&)> validate = {});
KeySpec choice_key(std::string name, std::string def, std::vector<std::string> choices, std::string help);

class Deck {
 public:
  Deck() = default;
  // A resolved deck: every key of `schema` with its value and where it came from (io/deck.hpp's
  // load_deck and parse_deck make one from a file; they have checked every value against `schema`).
  Deck(const DeckSchema& schema, std::string path, std::map<std::string, std::string> values,
       std::map<std::string, std::string> origins);

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
  // A choice the run made for the deck (model.attention = auto -> the kind it runs): `value` replaces
  // the key's, checked against the schema, and `origin` says why; what resolved_text then records.
  void resolve(const std::string& name, const std::string& value, const std::string& origin);

 private:
  const DeckSchema* schema_ = nullptr;
  std::string path_;
  std::map<std::string, std::string> values_;   // every declared key
  std::map<std::string, std::string> origins_;  // every declared key
};

// The text rules a deck reader shares with the schema.
namespace deck_text {
extern const char* const kSpace;  // what is trimmed around names and values
std::string trim(const std::string& s);
// "model.layers" -> {"model", "layers"} (the section is everything before the last '.').
std::pair<std::string, std::string> split_name(const std::string& name);
std::string join(const std::vector<std::string>& parts, const std::string& sep);
// Checks `text` against `spec`. Returns "" and the normalized value (integers in plain decimal,
// booleans as true/false, everything else as given) or the reason it is refused, e.g.
// "train.lr = 'abc' is not a number (float, allowed range [0, 10])".
std::string check_value(const KeySpec& spec, const std::string& text, std::string* normalized);
}  // namespace deck_text

}  // namespace loom
