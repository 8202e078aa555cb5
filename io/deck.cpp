// Reading input decks: INI (Boost.Program_options) with our own line map and --set overrides, each
// value checked against its KeySpec (core/engine/keys.cpp holds the schema, the checks and the table).
//
// Boost.Program_options does the INI syntax (sections, "key = value", '#' comments, trimming) but
// reports no line numbers, so the text is also scanned here with the same rules: every line is
// mapped to its section.key, and lines Boost would refuse, keys outside a section, unknown sections
// and keys and keys given twice are refused naming file:line before Boost sees the text.
#include "io/deck.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <set>
#include <sstream>
#include <stdexcept>

#include <boost/program_options/errors.hpp>
#include <boost/program_options/options_description.hpp>
#include <boost/program_options/parsers.hpp>
#include <boost/program_options/value_semantic.hpp>
#include <boost/program_options/variables_map.hpp>

#include "io/util.hpp"

namespace loom {

namespace {

namespace po = boost::program_options;

using deck_text::check_value;
using deck_text::join;
using deck_text::kSpace;
using deck_text::split_name;
using deck_text::trim;

// Where a line of the deck put a key.
struct Entry {
  std::string name;  // section.key
  int line = 0;
};

std::string at(const std::string& file, int line) { return file + ":" + std::to_string(line); }

// The line map: every key of `text` with its line, in order. Refuses (naming file:line) what
// Boost would refuse, keys outside a section, unknown sections and keys, and keys given twice.
std::vector<Entry> scan(const DeckSchema& schema, const std::string& text, const std::string& file) {
  std::vector<Entry> entries;
  std::map<std::string, int> seen;
  const std::vector<std::string> sections = schema.sections();
  const std::string valid_sections = join(sections, ", ");
  std::string section;
  std::istringstream in(text);
  std::string raw;
  int line = 0;
  while (std::getline(in, raw)) {
    ++line;
    const std::string where = at(file, line) + ": ";
    std::string s = raw;
    const auto hash = s.find('#');
    if (hash != std::string::npos) s.resize(hash);
    s = trim(s);
    if (s.empty()) continue;
    if (s.front() == '[' && s.back() == ']') {
      const std::string name = s.substr(1, s.size() - 2);
      if (trim(name).empty())
        throw DeckError(where + "empty section name " + quote_value(s) + " (valid sections: " + valid_sections + ")");
      if (name.find_first_of(kSpace) != std::string::npos)
        throw DeckError(where + "section header '" + escape_value(s) + "' contains spaces; write [" +
                        escape_value(trim(name)) + "] (valid sections: " + valid_sections + ")");
      if (std::find(sections.begin(), sections.end(), name) == sections.end())
        throw DeckError(where + "unknown section [" + escape_value(name) + "]; did you mean [" +
                        schema.nearest_section(name) + "]? (valid sections: " + valid_sections + ")");
      section = name;
      continue;
    }
    const auto eq = s.find('=');
    if (eq == std::string::npos || trim(s.substr(0, eq)).empty())
      throw DeckError(where + "cannot read line " + quote_value(trim(raw)) +
                      " (expected [section], key = value, a # comment or a blank line)");
    const std::string key = trim(s.substr(0, eq));
    if (section.empty()) {
      std::vector<std::string> homes;
      for (const auto& spec : schema.keys())
        if (split_name(spec.name).second == key) homes.push_back("[" + split_name(spec.name).first + "]");
      std::string hint = homes.empty() ? "" : " (" + quote_value(key) + " belongs in " + join(homes, " or ") + ")";
      throw DeckError(where + "key " + quote_value(key) + " is outside any section; put it under a [section] header" +
                      hint + " (valid sections: " + valid_sections + ")");
    }
    const std::string name = section + "." + key;
    if (!schema.find(name) && schema.renamed(name)) throw DeckError(where + schema.renamed_message(name));
    if (!schema.find(name)) {
      std::vector<std::string> valid;
      for (const auto& spec : schema.keys())
        if (split_name(spec.name).first == section) valid.push_back(split_name(spec.name).second);
      throw DeckError(where + "unknown key " + quote_value(name) + " in section [" + section + "]; did you mean '" +
                      schema.nearest_key(name) + "'? (valid keys: " + join(valid, ", ") + ")");
    }
    const auto [it, fresh] = seen.emplace(name, line);
    if (!fresh)
      throw DeckError(where + "key '" + name + "' given twice (first at " + at(file, it->second) + ", again at " +
                      at(file, line) + ")");
    entries.push_back({name, line});
  }
  return entries;
}

}  // namespace

Deck load_deck(const DeckSchema& schema, const std::string& path, const std::vector<std::string>& sets) {
  std::string text;
  try {
    text = read_file(path, "deck");
  } catch (const InputError& e) {
    throw DeckError(e.what());
  }
  Deck deck = parse_deck(schema, text, path, sets);
  // A deck file that sets nothing would train the defaults in silence: almost certainly the wrong file.
  bool sets_something = false;
  for (const auto& [key, value] : deck.values()) {
    const std::string origin = deck.origin(key);
    if (origin != "default" && origin != "--set") sets_something = true;
  }
  if (!sets_something) {
    const std::string what = "deck " + quote_path(path) + ": ";
    if (text.empty())
      throw DeckError(what + "is empty (0 bytes); a deck sets at least one key (build/loom keys lists them)");
    throw DeckError(what +
                    "has no settings (only comments, blank lines or section headers); a deck sets at least "
                    "one key as 'key = value' under a [section] (build/loom keys lists them)");
  }
  return deck;
}

Deck parse_deck(const DeckSchema& schema, const std::string& text_in, const std::string& name,
                const std::vector<std::string>& sets) {
  std::map<std::string, std::string> values, origins;

  std::string text = text_in;
  if (text.compare(0, 3, "\xEF\xBB\xBF") == 0) text.erase(0, 3);  // UTF-8 byte order mark

  // Our line map first: it refuses structural problems naming file:line.
  const std::vector<Entry> entries = scan(schema, text, name);

  // Boost does the INI reading; every declared key is registered as a string.
  po::options_description desc;
  for (const auto& k : schema.keys()) desc.add_options()(k.name.c_str(), po::value<std::string>());
  po::variables_map vm;
  try {
    std::istringstream in(text);
    po::store(po::parse_config_file(in, desc, /*allow_unregistered=*/true), vm);
  } catch (const po::error& e) {
    throw DeckError(name + ": " + e.what());
  }

  for (const Entry& e : entries) {
    const KeySpec& spec = *schema.find(e.name);
    if (!vm.count(e.name))  // cannot happen: the scan and Boost read the same lines
      throw std::logic_error("deck: Boost did not read '" + e.name + "' of " + at(name, e.line));
    std::string value;
    const std::string err = check_value(spec, vm[e.name].as<std::string>(), &value);
    if (!err.empty()) throw DeckError(at(name, e.line) + ": " + err);
    values[e.name] = value;
    origins[e.name] = at(name, e.line);
  }

  for (const std::string& set : sets) {
    const std::string where = "--set " + escape_value(set) + ": ";
    const auto eq = set.find('=');
    if (eq == std::string::npos)
      throw DeckError(where + "expected section.key=value (no '='); nearest key: '" + schema.nearest_key(trim(set)) +
                      "'");
    const std::string key = trim(set.substr(0, eq));
    const std::string text_value = trim(set.substr(eq + 1));
    const KeySpec* spec = schema.find(key);
    if (!spec && schema.renamed(key)) throw DeckError(where + schema.renamed_message(key));
    if (!spec) {
      const auto [section, short_key] = split_name(key);
      const auto sections = schema.sections();
      std::string msg = "unknown key " + quote_value(key);
      if (std::find(sections.begin(), sections.end(), section) != sections.end()) {
        std::vector<std::string> valid;
        for (const auto& k : schema.keys())
          if (split_name(k.name).first == section) valid.push_back(split_name(k.name).second);
        msg += " in section [" + section + "]; did you mean '" + schema.nearest_key(key) +
               "'? (valid keys: " + join(valid, ", ") + ")";
      } else {
        msg += "; did you mean '" + schema.nearest_key(key) + "'? (valid sections: " + join(sections, ", ") + ")";
      }
      throw DeckError(where + msg);
    }
    if (text_value.find_first_of("#\n\r") != std::string::npos)
      throw DeckError(where + key + " = " + quote_value(text_value) +
                      " holds a '#' or a line break, which a deck cannot hold");
    std::string value;
    const std::string err = check_value(*spec, text_value, &value);
    if (!err.empty()) throw DeckError(where + err);
    values[key] = value;
    origins[key] = "--set";
  }

  for (const auto& k : schema.keys()) {
    if (values.count(k.name)) continue;
    values[k.name] = k.default_value;
    origins[k.name] = "default";
  }
  return Deck(schema, name, std::move(values), std::move(origins));
}

}  // namespace loom
