#pragma once
#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace loom {
// Input the user can fix (deck, data file, layout): reported without a stack of context and
// exits with status 2 before any training starts.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Input read alike on every rank before any work, so reported once, by rank 0.
struct AlikeOnEveryRank : InputError {
  using InputError::InputError;
};
// A deck (its file, a key, a value, a --set) that cannot be used.
struct DeckError : AlikeOnEveryRank {
  using AlikeOnEveryRank::AlikeOnEveryRank;
};
// A command line (a command, an option, an argument) that cannot be used.
struct UsageError : AlikeOnEveryRank {
  using AlikeOnEveryRank::AlikeOnEveryRank;
};

// A failure that every rank knows about alike (the ranks agreed on it, e.g. a checkpoint write that
// failed on one rank): rank 0 reports it once and every rank exits with status 1, without aborting.
struct AgreedFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Bad input that has already been reported on the ranks that found it (after the ranks agreed that
// setup failed): the driver exits with status 2 without printing it again.
struct ReportedError : InputError {
  using InputError::InputError;
};

// A value the user gave (deck value or key, --set text, file name), as every message echoes it:
// bytes that would not print as themselves escaped (\n, \t, \r, \\ and \xNN: control bytes, a NUL
// that would end the message early, bytes that are not UTF-8), cut after `max_chars` characters
// with "..." and its full length. quote_value: 'aaaa...' (1048576 bytes); escape_value, where the
// message's own syntax delimits the value (--set X: ..., [section], a number): aaaa... (1048576 bytes).
std::string quote_value(std::string_view value, std::size_t max_chars = 80);
// A file or directory name: escaped like any value, but never cut short (a cut path names no file).
inline std::string quote_path(std::string_view path) { return quote_value(path, 4096); }
std::string escape_value(std::string_view value, std::size_t max_chars = 80);
// Levenshtein distance, for "did you mean".
int edit_distance(const std::string& a, const std::string& b);
// The word of `candidates` closest to `word`, when close enough to be a slip of the keyboard (at most
// a third of its letters edited, at least one); "" when none is.
std::string nearest_word(const std::string& word, const std::vector<std::string>& candidates);
}  // namespace loom
