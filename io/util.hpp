#pragma once
// Small helpers shared by io/: file reading.
#include <string>
#include <vector>

namespace loom {
// Whole file as bytes; throws InputError("<what> '<path>': cannot be read (<reason>)"), or "...: is a
// directory, not a file".
std::string read_file(const std::string& path, const std::string& what);
}  // namespace loom
