#include "core/base/search_path.hpp"

#include <cstdlib>
#include <filesystem>
#include <sstream>

namespace fs = std::filesystem;

namespace loom {

std::vector<std::string> plugin_search_path() {
  std::vector<std::string> dirs;
  if (const char* env = std::getenv("LOOM_PLUGIN_PATH")) {
    std::stringstream ss(env);
    std::string d;
    while (std::getline(ss, d, ':'))
      if (!d.empty()) dirs.push_back(d);
  }
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    dirs.push_back((exe.parent_path() / "lib").string());  // build tree: build/loom, build/lib/
    dirs.push_back((exe.parent_path() / ".." / "lib" / "loom").lexically_normal().string());  // install prefix
  }
  return dirs;
}

}  // namespace loom
