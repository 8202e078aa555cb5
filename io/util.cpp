#include "io/util.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/base/error.hpp"

namespace loom {

namespace {
const char* file_kind(const std::filesystem::file_status& st) {
  using std::filesystem::file_type;
  switch (st.type()) {
    case file_type::directory:
      return "a directory";
    case file_type::fifo:
      return "a FIFO (named pipe)";
    case file_type::character:
      return "a character device";
    case file_type::block:
      return "a block device";
    case file_type::socket:
      return "a socket";
    default:
      return "not a regular file";
  }
}
}  // namespace

void require_regular_file(const std::string& path, const std::string& what) {
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::status(path, ec);  // follows symbolic links
  if (ec || !std::filesystem::exists(st) || std::filesystem::is_regular_file(st)) return;
  throw InputError(what + " " + quote_path(path) + ": is " + file_kind(st) +
                   ", not a regular file (loom reads its inputs from regular files only)");
}

std::string read_latest_name(const std::string& dir) {
  const std::string pointer = dir + "/latest";
  std::error_code ec;
  if (!std::filesystem::exists(std::filesystem::symlink_status(pointer, ec))) return "";
  require_regular_file(pointer, "checkpoint pointer");
  std::ifstream in(pointer);
  if (!in) throw InputError(quote_path(pointer) + ": cannot be read (" + std::strerror(errno) + ")");
  std::string name;
  std::getline(in, name);  // an empty file leaves it empty
  if (name.empty()) throw InputError(quote_path(pointer) + " is empty: it should name a checkpoint file in " + dir);
  if (name.find('/') != std::string::npos || name == "." || name == "..")
    throw InputError(quote_path(pointer) + " names " + quote_path(name) +
                     ", which is not a file of that directory: `latest` may name only a checkpoint in " + dir);
  return name;
}

std::string read_file(const std::string& path, const std::string& what) {
  // A directory opens as a stream that reads nothing: it would pass for an empty file.
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw InputError(what + " " + quote_path(path) + ": is a directory, not a file");
  require_regular_file(path, what);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(what + " " + quote_path(path) + ": cannot be read (" + std::strerror(errno) + ")");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_file_atomically(const std::string& path, const std::string& bytes, const std::string& what) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw InputError(what + " " + quote_path(tmp) + ": cannot be created (" + std::strerror(errno) + ")");
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.close();  // a full disk may show only here
    if (out.fail()) {
      const std::string reason = std::strerror(errno);
      std::error_code ec;
      std::filesystem::remove(tmp, ec);
      throw InputError(what + " " + quote_path(tmp) + ": writing " + std::to_string(bytes.size()) + " bytes failed (" +
                       reason + "); " + quote_path(path) + " is left as it was");
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec)
    throw InputError(what + " " + quote_path(path) + ": cannot be replaced by " + quote_path(tmp) + " (" +
                     ec.message() + ")");
}

}  // namespace loom
