// Deck keys: the schema a deck is checked against, each key's typed check and its help, the
// did-you-mean for names, the key table, and the resolved deck a run reads. Reading a deck's text
// (INI through Boost.Program_options) is io's (io/deck.cpp); strategies see only this.
#include "core/engine/keys.hpp"
#include "core/engine/keys_reference.hpp"

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

namespace loom {

namespace deck_text {

// The characters Boost's config parser trims around names and values.
const char* const kSpace = " \t\r\n";

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(kSpace);
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(kSpace);
  return s.substr(b, e - b + 1);
}

// "model.layers" -> {"model", "layers"} (the section is everything before the last '.').
std::pair<std::string, std::string> split_name(const std::string& name) {
  const auto dot = name.rfind('.');
  if (dot == std::string::npos) return {"", name};
  return {name.substr(0, dot), name.substr(dot + 1)};
}

std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    if (i) out += sep;
    out += parts[i];
  }
  return out;
}

}  // namespace deck_text

using namespace deck_text;

namespace {

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Shortest text that reads back as `x`, exponent without '+' or leading zeros ("1e-8", "1e12").
std::string format_double(double x) {
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  if (x == std::floor(x) && std::fabs(x) < 1e6) {  // small whole numbers in plain digits: 10, not 1e1
    std::snprintf(buf, sizeof buf, "%.0f", x);
    return buf;
  }
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  std::string s = buf;
  const auto e = s.find('e');
  if (e == std::string::npos) return s;
  std::string mant = s.substr(0, e), exp = s.substr(e + 1);
  std::string sign;
  if (!exp.empty() && (exp[0] == '+' || exp[0] == '-')) {
    if (exp[0] == '-') sign = "-";
    exp = exp.substr(1);
  }
  const auto nz = exp.find_first_not_of('0');
  exp = nz == std::string::npos ? "0" : exp.substr(nz);
  return mant + "e" + sign + exp;
}

// Inclusive integer bounds of an Int key, clamped to int64.
std::pair<std::int64_t, std::int64_t> int_bounds(const KeySpec& spec) {
  constexpr double two63 = 9223372036854775808.0;
  const std::int64_t lo =
      spec.min <= -two63 ? std::numeric_limits<std::int64_t>::min() : static_cast<std::int64_t>(std::ceil(spec.min));
  const std::int64_t hi =
      spec.max >= two63 ? std::numeric_limits<std::int64_t>::max() : static_cast<std::int64_t>(std::floor(spec.max));
  return {lo, hi};
}

const char* type_name(KeyType t) {
  switch (t) {
    case KeyType::Int:
      return "integer";
    case KeyType::Float:
      return "float";
    case KeyType::Bool:
      return "bool";
    case KeyType::String:
      return "string";
    case KeyType::Choice:
      return "choice";
  }
  return "?";
}

// What is allowed, as shown in messages and in describe(): "1 .. 1024", "[0, 10]", "a | b".
std::string allowed_text(const KeySpec& spec) {
  switch (spec.type) {
    case KeyType::Int: {
      const auto [lo, hi] = int_bounds(spec);
      return std::to_string(lo) + " .. " + std::to_string(hi);
    }
    case KeyType::Float:
      return "[" + format_double(spec.min) + ", " + format_double(spec.max) + "]";
    case KeyType::Bool:
      return "true/false, 1/0, yes/no, on/off";
    case KeyType::Choice:
      return join(spec.choices, " | ");
    case KeyType::String:
      return "";
  }
  return "";
}

// The decimal number syntax accepted for Int and Float: [+-] digits [. digits] [e [+-] digits]
// (at least one digit in the mantissa). No hex, inf or nan.
struct NumberParts {
  bool negative = false;
  std::string int_digits, frac_digits;
  long long exponent = 0;  // saturated at +-1e9
};

bool split_number(const std::string& s, NumberParts* out) {
  std::size_t i = 0;
  NumberParts p;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) p.negative = s[i++] == '-';
  while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) p.int_digits += s[i++];
  if (i < s.size() && s[i] == '.') {
    ++i;
    while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) p.frac_digits += s[i++];
  }
  if (p.int_digits.empty() && p.frac_digits.empty()) return false;
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    bool eneg = false;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) eneg = s[i++] == '-';
    const std::size_t start = i;
    long long e = 0;
    while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) {
      e = std::min<long long>(e * 10 + (s[i] - '0'), 1000000000LL);
      ++i;
    }
    if (i == start) return false;
    p.exponent = eneg ? -e : e;
  }
  if (i != s.size()) return false;
  *out = p;
  return true;
}

enum class IntResult { ok, not_integer, out_of_range };

// Exact: "4096", "-3", "1e6", "2.5e3", "1.0" are integers; "1.5" and "1e-3" are not.
IntResult parse_int(const std::string& s, std::int64_t* out) {
  NumberParts p;
  if (!split_number(s, &p)) return IntResult::not_integer;
  std::string digits = p.int_digits + p.frac_digits;
  long long shift = p.exponent - static_cast<long long>(p.frac_digits.size());
  const auto nz = digits.find_first_not_of('0');
  if (nz == std::string::npos) {
    *out = 0;
    return IntResult::ok;
  }
  digits = digits.substr(nz);
  if (shift < 0) {
    const auto drop = static_cast<std::size_t>(-shift);
    if (drop >= digits.size()) return IntResult::not_integer;  // nonzero digits after the point
    if (digits.find_first_not_of('0', digits.size() - drop) != std::string::npos) return IntResult::not_integer;
    digits.resize(digits.size() - drop);
  } else {
    if (static_cast<long long>(digits.size()) + shift > 19) return IntResult::out_of_range;
    digits.append(static_cast<std::size_t>(shift), '0');
  }
  if (digits.size() > 19) return IntResult::out_of_range;
  errno = 0;
  const long long v = std::strtoll(((p.negative ? "-" : "") + digits).c_str(), nullptr, 10);
  if (errno == ERANGE) return IntResult::out_of_range;
  *out = v;
  return IntResult::ok;
}

enum class FloatResult { ok, not_number, out_of_range };

FloatResult parse_float(const std::string& s, double* out) {
  NumberParts p;
  if (!split_number(s, &p)) return FloatResult::not_number;
  const double v = std::strtod(s.c_str(), nullptr);
  if (!std::isfinite(v)) return FloatResult::out_of_range;
  *out = v;
  return FloatResult::ok;
}

bool parse_bool(const std::string& s, bool* out) {
  const std::string l = lower(s);
  if (l == "true" || l == "1" || l == "yes" || l == "on") {
    *out = true;
    return true;
  }
  if (l == "false" || l == "0" || l == "no" || l == "off") {
    *out = false;
    return true;
  }
  return false;
}

}  // namespace

std::string deck_text::check_value(const KeySpec& spec, const std::string& text, std::string* normalized) {
  const std::string& n = spec.name;
  std::string value = text;
  switch (spec.type) {
    case KeyType::Int: {
      const std::string what = " (integer, allowed " + allowed_text(spec) + ")";
      std::int64_t v = 0;
      const IntResult r = parse_int(text, &v);
      if (r == IntResult::not_integer) return n + " = " + quote_value(text) + " is not an integer" + what;
      const auto [lo, hi] = int_bounds(spec);
      if (r == IntResult::out_of_range || v < lo || v > hi)
        return n + " = " + escape_value(text) + " is out of range" + what;
      value = std::to_string(v);
      break;
    }
    case KeyType::Float: {
      const std::string what = " (float, allowed range " + allowed_text(spec) + ")";
      double v = 0;
      const FloatResult r = parse_float(text, &v);
      if (r == FloatResult::not_number) return n + " = " + quote_value(text) + " is not a number" + what;
      if (r == FloatResult::out_of_range || v < spec.min || v > spec.max)
        return n + " = " + escape_value(text) + " is out of range" + what;
      break;
    }
    case KeyType::Bool: {
      bool b = false;
      if (!parse_bool(text, &b))
        return n + " = " + quote_value(text) + " is not a boolean (allowed: " + allowed_text(spec) + ")";
      value = b ? "true" : "false";
      break;
    }
    case KeyType::Choice:
      if (std::find(spec.choices.begin(), spec.choices.end(), text) == spec.choices.end())
        return n + " = " + quote_value(text) + " is not one of: " + join(spec.choices, ", ");
      break;
    case KeyType::String:
      break;
  }
  if (spec.validate) {
    const std::string allowed = spec.validate(value);
    if (!allowed.empty()) return n + " = " + quote_value(text) + " is not allowed (allowed: " + allowed + ")";
  }
  *normalized = value;
  return "";
}

namespace {

// Initials of the '_'-separated words: "learning_rate" -> "lr".
std::string initials(const std::string& s) {
  std::string out;
  bool start = true;
  for (char c : s) {
    if (c == '_' || c == '-') {
      start = true;
    } else {
      if (start) out += c;
      start = false;
    }
  }
  return out;
}

// How far a mistyped name is from a declared one: 0 for the same (ignoring case), 1 for an
// abbreviation by initials ("learning_rate" for "lr") or a prefix of at least 3 characters
// ("sched" for "schedule"), otherwise the edit distance.
int name_distance(const std::string& given, const std::string& declared) {
  // A name far longer than any key (a megabyte pasted by mistake) is no near miss; the length
  // difference bounds the edit distance, which would cost length x key length to compute.
  if (given.size() > declared.size() + 16)
    return static_cast<int>(std::min<std::size_t>(given.size() - declared.size(), 1 << 20));
  const std::string a = lower(given), b = lower(declared);
  if (a == b) return 0;
  const int d = edit_distance(a, b);
  if (d <= 1) return d;
  if ((a.find('_') != std::string::npos && initials(a) == b) || (b.find('_') != std::string::npos && initials(b) == a))
    return 1;
  const std::size_t m = std::min(a.size(), b.size());
  if (m >= 3 && a.compare(0, m, b, 0, m) == 0) return 1;
  return d;
}

const KeySpec& spec_of(const DeckSchema* schema, const std::string& name) {
  if (!schema) throw std::logic_error("deck: no schema (default-constructed Deck), asked for '" + name + "'");
  const KeySpec* spec = schema->find(name);
  if (!spec) throw std::logic_error("deck: '" + name + "' is not a declared key");
  return *spec;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// DeckSchema

void DeckSchema::add(KeySpec spec) {
  const auto [section, key] = split_name(spec.name);
  if (section.empty() || key.empty())
    throw std::logic_error("deck schema: key '" + spec.name + "' is not of the form section.key");
  for (char c : spec.name)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.'))
      throw std::logic_error("deck schema: key '" + spec.name + "' has a character other than [A-Za-z0-9_.-]");
  if (section.front() == '.' || section.back() == '.' || section.find("..") != std::string::npos)
    throw std::logic_error("deck schema: key '" + spec.name + "' has an empty name part");
  if (find(spec.name)) throw std::logic_error("deck schema: key '" + spec.name + "' declared twice");
  if ((spec.type == KeyType::Int || spec.type == KeyType::Float) && !(spec.min <= spec.max))
    throw std::logic_error("deck schema: key '" + spec.name + "' has min > max");
  if (spec.type == KeyType::Choice && spec.choices.empty())
    throw std::logic_error("deck schema: choice key '" + spec.name + "' has no choices");
  std::string normalized;
  const std::string err = check_value(spec, spec.default_value, &normalized);
  if (!err.empty()) throw std::logic_error("deck schema: bad default: " + err);
  spec.default_value = normalized;
  keys_.push_back(std::move(spec));
}

const KeySpec* DeckSchema::find(const std::string& name) const {
  for (const auto& k : keys_)
    if (k.name == name) return &k;
  return nullptr;
}

std::vector<std::string> DeckSchema::sections() const {
  std::vector<std::string> out;
  for (const auto& k : keys_) {
    const std::string s = split_name(k.name).first;
    if (std::find(out.begin(), out.end(), s) == out.end()) out.push_back(s);
  }
  return out;
}

const KeySpec* DeckSchema::renamed(const std::string& name) const {
  for (const KeySpec& k : keys_)
    for (const std::string& former : k.former_names)
      if (former == name) return &k;
  return nullptr;
}

std::string DeckSchema::renamed_message(const std::string& name) const {
  const KeySpec* k = renamed(name);
  if (!k) return "";
  const std::string section = k->name.substr(0, k->name.find('.'));
  return "key '" + name + "' is now '" + k->name + "' (section [" + section + "]); rename it in the deck or --set";
}

std::string DeckSchema::nearest_key(const std::string& name) const {
  const auto [section, key] = split_name(name);
  std::string best;
  int best_score = std::numeric_limits<int>::max();
  for (const auto& k : keys_) {
    const auto [ks, kk] = split_name(k.name);
    // A key in the right section wins over the same key elsewhere, which wins over a poor match.
    const int score = name_distance(key, kk) + (lower(section) == lower(ks) ? 0 : 2);
    if (score < best_score) {
      best_score = score;
      best = k.name;
    }
  }
  return best;
}

std::string DeckSchema::nearest_section(const std::string& section) const {
  std::string best;
  int best_score = std::numeric_limits<int>::max();
  for (const auto& s : sections()) {
    const int score = name_distance(section, s);
    if (score < best_score) {
      best_score = score;
      best = s;
    }
  }
  return best;
}

std::string DeckSchema::describe() const {
  struct Row {
    std::string name, type, def, allowed, help;
  };
  std::vector<Row> rows;
  Row head{"key", "type", "default", "allowed", "help"};
  std::size_t w[4] = {head.name.size(), head.type.size(), head.def.size(), head.allowed.size()};
  for (const auto& k : keys_) {
    Row r{k.name, type_name(k.type), k.default_value.empty() ? "\"\"" : k.default_value,
          k.type == KeyType::Bool ? "true | false" : allowed_text(k), k.help};
    if (r.allowed.empty()) r.allowed = "-";
    w[0] = std::max(w[0], r.name.size());
    w[1] = std::max(w[1], r.type.size());
    w[2] = std::max(w[2], r.def.size());
    w[3] = std::max(w[3], r.allowed.size());
    rows.push_back(std::move(r));
  }
  auto pad = [](const std::string& s, std::size_t n) { return s + std::string(n - s.size() + 2, ' '); };
  std::ostringstream out;
  out << "Deck keys. A deck is an INI file: [section] headers, then 'key = value' lines; '#' starts a\n"
         "comment (a whole line, or the rest of a line after a value, so values cannot hold '#').\n"
         "Each key may be given once; --set section.key=value overrides it (later --set wins).\n"
         "  integer  a whole number: 4096, -3, or exponent form when the value is exactly whole\n"
         "           (1e6, 2.5e3); 1.5 and 1e-3 are refused\n"
         "  float    decimal or exponent form: 0.1, 3e-4 (no inf or nan)\n"
         "  bool     true/false, 1/0, yes/no, on/off (any case)\n"
         "  choice   exactly one of the listed words\n\n";
  out << pad(head.name, w[0]) << pad(head.type, w[1]) << pad(head.def, w[2]) << pad(head.allowed, w[3]) << head.help
      << "\n";
  std::string last_section;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const std::string section = split_name(keys_[i].name).first;
    if (section != last_section) {
      out << "[" << section << "]\n";
      last_section = section;
    }
    const Row& r = rows[i];
    out << pad(r.name, w[0]) << pad(r.type, w[1]) << pad(r.def, w[2]) << pad(r.allowed, w[3]) << r.help << "\n";
  }
  return out.str();
}

std::string keys_markdown(const DeckSchema& schema) {
  const auto cell = [](std::string s) {  // a table cell: | escaped, no line breaks
    std::string out;
    for (char c : s) {
      if (c == '|')
        out += "\\|";
      else if (c == '\n')
        out += ' ';
      else
        out += c;
    }
    return out;
  };
  std::ostringstream out;
  out << "# Deck keys\n\n"
         "Every key a deck may set, by section: the core's and those of the strategies shipped with loom.\n"
         "Generated by `loom keys --markdown > docs/keys.md`; `regression.docs.keys` fails when this page and\n"
         "the command differ. The same table, for plain terminals: `loom keys`. Syntax of values:\n\n"
         "- integer: a whole number (4096, -3, or 1e6 when exactly whole)\n"
         "- float: decimal or exponent form (0.1, 3e-4; no inf or nan)\n"
         "- bool: true/false, 1/0, yes/no, on/off (any case)\n"
         "- choice: exactly one of the listed words\n";
  for (const std::string& section : schema.sections()) {
    out << "\n## [" << section
        << "]\n\n| key | type | default | allowed | what it does |\n| --- | --- | --- | --- | --- |\n";
    for (const KeySpec& k : schema.keys()) {
      if (k.name.compare(0, section.size() + 1, section + ".") != 0) continue;
      std::string allowed = k.type == KeyType::Bool ? "true \\| false" : cell(allowed_text(k));
      if (allowed.empty()) allowed = "-";
      out << "| `" << k.name << "` | " << type_name(k.type) << " | "
          << (k.default_value.empty() ? "\"\"" : cell(k.default_value)) << " | " << allowed << " | " << cell(k.help)
          << " |\n";
    }
  }
  return out.str();
}

// ---------------------------------------------------------------------------------------------
// Deck

Deck::Deck(const DeckSchema& schema, std::string path, std::map<std::string, std::string> values,
           std::map<std::string, std::string> origins)
    : schema_(&schema), path_(std::move(path)), values_(std::move(values)), origins_(std::move(origins)) {}

std::int64_t Deck::get_int(const std::string& name) const {
  const KeySpec& spec = spec_of(schema_, name);
  if (spec.type != KeyType::Int)
    throw std::logic_error("deck: get_int on '" + name + "', a " + type_name(spec.type) + " key");
  std::int64_t v = 0;
  if (parse_int(values_.at(name), &v) != IntResult::ok)
    throw std::logic_error("deck: stored value of '" + name + "' is not an integer");
  return v;
}

double Deck::get_float(const std::string& name) const {
  const KeySpec& spec = spec_of(schema_, name);
  if (spec.type != KeyType::Float)
    throw std::logic_error("deck: get_float on '" + name + "', a " + type_name(spec.type) + " key");
  return std::strtod(values_.at(name).c_str(), nullptr);
}

bool Deck::get_bool(const std::string& name) const {
  const KeySpec& spec = spec_of(schema_, name);
  if (spec.type != KeyType::Bool)
    throw std::logic_error("deck: get_bool on '" + name + "', a " + type_name(spec.type) + " key");
  return values_.at(name) == "true";
}

std::string Deck::get_string(const std::string& name) const {
  const KeySpec& spec = spec_of(schema_, name);
  if (spec.type != KeyType::String && spec.type != KeyType::Choice)
    throw std::logic_error("deck: get_string on '" + name + "', a " + type_name(spec.type) + " key");
  return values_.at(name);
}

bool Deck::is_default(const std::string& name) const { return origin(name) == "default"; }

void Deck::resolve(const std::string& name, const std::string& value, const std::string& origin) {
  const KeySpec& spec = spec_of(schema_, name);
  std::string normalized;
  const std::string why = deck_text::check_value(spec, value, &normalized);
  if (!why.empty()) throw std::logic_error("deck: resolve: " + why);
  values_[name] = normalized;
  origins_[name] = origin;
}

std::string Deck::origin(const std::string& name) const {
  spec_of(schema_, name);
  return origins_.at(name);
}

std::string Deck::resolved_text() const {
  if (!schema_) throw std::logic_error("deck: resolved_text on a default-constructed Deck");
  std::size_t nsets = 0;
  for (const auto& [k, o] : origins_)
    if (o == "--set") ++nsets;
  std::ostringstream out;
  out << "# loom deck, resolved: every declared key with the value in effect.\n"
      << "# Read from " << (path_.empty() ? "(nothing)" : path_);
  if (nsets) out << ", then " << nsets << " key(s) set by --set";
  out << ". Keys marked '# default' were not given.\n";
  // Grouped by section (a plugin's keys join the section they name), sections in schema order.
  for (const auto& section : schema_->sections()) {
    out << "\n[" << section << "]\n";
    for (const auto& k : schema_->keys()) {
      const auto [s, key] = split_name(k.name);
      if (s != section) continue;
      out << key << " = " << values_.at(k.name);
      if (origins_.at(k.name) == "default") out << "  # default";
      out << "\n";
    }
  }
  return out.str();
}

std::map<std::string, std::string> Deck::values() const { return values_; }

// ---------------------------------------------------------------------------------------------
// Key declarations

KeySpec int_key(std::string name, std::string def, double lo, double hi, std::string help) {
  KeySpec k;
  k.name = std::move(name);
  k.type = KeyType::Int;
  k.default_value = std::move(def);
  k.min = lo;
  k.max = hi;
  k.help = std::move(help);
  return k;
}

KeySpec float_key(std::string name, std::string def, double lo, double hi, std::string help) {
  KeySpec k = int_key(std::move(name), std::move(def), lo, hi, std::move(help));
  k.type = KeyType::Float;
  return k;
}

KeySpec bool_key(std::string name, std::string def, std::string help) {
  KeySpec k;
  k.name = std::move(name);
  k.type = KeyType::Bool;
  k.default_value = std::move(def);
  k.help = std::move(help);
  return k;
}

KeySpec string_key(std::string name, std::string def, std::string help,
                   std::function<std::string(const std::string&)> validate) {
  KeySpec k;
  k.name = std::move(name);
  k.type = KeyType::String;
  k.default_value = std::move(def);
  k.help = std::move(help);
  k.validate = std::move(validate);
  return k;
}

KeySpec choice_key(std::string name, std::string def, std::vector<std::string> choices, std::string help) {
  KeySpec k;
  k.name = std::move(name);
  k.type = KeyType::Choice;
  k.default_value = std::move(def);
  k.choices = std::move(choices);
  k.help = std::move(help);
  return k;
}

}  // namespace loom
