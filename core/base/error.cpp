#include "core/base/error.hpp"

#include <algorithm>
#include <vector>

namespace loom {

namespace {

// Length of the well-formed UTF-8 sequence at s[i] (2 to 4 bytes), or 0 if there is none.
std::size_t utf8_sequence(std::string_view s, std::size_t i) {
  const auto lead = static_cast<unsigned char>(s[i]);
  const std::size_t n = lead >= 0xC2 && lead <= 0xDF   ? 2
                        : lead >= 0xE0 && lead <= 0xEF ? 3
                        : lead >= 0xF0 && lead <= 0xF4 ? 4
                                                       : 0;
  if (n == 0 || i + n > s.size()) return 0;
  for (std::size_t k = 1; k < n; ++k)
    if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return 0;
  return n;
}

// The value escaped and cut to `max_chars` shown characters; `cut` says whether it was.
std::string escaped(std::string_view value, std::size_t max_chars, bool* cut) {
  static const char hex[] = "0123456789abcdef";
  std::string out;
  std::size_t width = 0, i = 0;  // characters shown so far: an escape counts its length
  while (i < value.size() && width < max_chars) {
    const auto c = static_cast<unsigned char>(value[i]);
    if (const std::size_t n = c >= 0x80 ? utf8_sequence(value, i) : 0) {  // one printable character
      out.append(value.substr(i, n));
      i += n;
      ++width;
      continue;
    }
    std::string shown(1, static_cast<char>(c));
    if (c == '\n')
      shown = "\\n";
    else if (c == '\t')
      shown = "\\t";
    else if (c == '\r')
      shown = "\\r";
    else if (c == '\\')
      shown = "\\\\";
    else if (c < 0x20 || c >= 0x7F)
      shown = std::string("\\x") + hex[c >> 4] + hex[c & 0xF];
    out += shown;
    width += shown.size();
    ++i;
  }
  *cut = i < value.size();
  return out;
}

std::string full_length(std::string_view value) { return " (" + std::to_string(value.size()) + " bytes)"; }

}  // namespace

std::string quote_value(std::string_view value, std::size_t max_chars) {
  bool cut = false;
  const std::string shown = escaped(value, max_chars, &cut);
  return cut ? "'" + shown + "...'" + full_length(value) : "'" + shown + "'";
}

std::string escape_value(std::string_view value, std::size_t max_chars) {
  bool cut = false;
  const std::string shown = escaped(value, max_chars, &cut);
  return cut ? shown + "..." + full_length(value) : shown;
}

namespace {

// Edits between a and b, two swapped neighbours counting as one ("rnu" is one slip from "run").
int slip_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<int>> d(a.size() + 1, std::vector<int>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = static_cast<int>(i);
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = static_cast<int>(j);
  for (std::size_t i = 1; i <= a.size(); ++i)
    for (std::size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

}  // namespace

std::string nearest_word(const std::string& word, const std::vector<std::string>& candidates) {
  if (word.size() > 64) return "";  // a pasted blob is no slip
  std::string best;
  int best_d = std::max<int>(1, static_cast<int>(word.size()) / 3) + 1;
  for (const std::string& c : candidates) {
    const int d = slip_distance(word, c);
    if (d < best_d) best_d = d, best = c;
  }
  return best;
}

int edit_distance(const std::string& a, const std::string& b) {
  std::vector<int> prev(b.size() + 1), cur(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) prev[j] = static_cast<int>(j);
  for (std::size_t i = 1; i <= a.size(); ++i) {
    cur[0] = static_cast<int>(i);
    for (std::size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

}  // namespace loom
