#pragma once
// Small helpers shared by io/: file reading and name matching.
#include <string>
#include <vector>

namespace loom {
// Whole file as bytes; throws InputError("<what> '<path>': cannot be read (<reason>)"), or "...: is a
// directory, not a file".
std::string read_file(const std::string& path, const std::string& what);
// Levenshtein distance, for "did you mean".
int edit_distance(const std::string& a, const std::string& b);
}  // namespace loom
