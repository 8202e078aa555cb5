#include "io/util.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/base/error.hpp"

namespace loom {

std::string read_file(const std::string& path, const std::string& what) {
  // A directory opens as a stream that reads nothing: it would pass for an empty file.
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw InputError(what + " " + quote_path(path) + ": is a directory, not a file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(what + " " + quote_path(path) + ": cannot be read (" + std::strerror(errno) + ")");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace loom
