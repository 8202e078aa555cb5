#pragma once
// Small helpers shared by io/: file reading.
#include <string>
#include <vector>

namespace loom {
// Whole file as bytes; throws InputError("<what> '<path>': cannot be read (<reason>)"), or "...: is a
// directory, not a file".
std::string read_file(const std::string& path, const std::string& what);
// An input path (a deck, a data file, weights, a tokenizer) that exists must be a regular file: a FIFO
// would block the read forever, a device such as /dev/zero never end it. Throws InputError("<what>
// '<path>': is a FIFO, not a regular file ..."); a missing path is left to the reader to report.
void require_regular_file(const std::string& path, const std::string& what);
// The checkpoint file name that `dir/latest` holds, or "" when there is no `latest`. Throws InputError
// for a `latest` that is not a regular file, is empty, or names anything but a file of `dir` itself
// (a path that leaves it, such as ../../outside/ckpt-00000004.h5).
std::string read_latest_name(const std::string& dir);
// Writes `bytes` to path.tmp, then renames it over `path`, so a reader never sees half a file and an
// earlier `path` survives a failed write (a full disk). Throws InputError naming `what`, the path and
// the reason.
void write_file_atomically(const std::string& path, const std::string& bytes, const std::string& what);
}  // namespace loom
