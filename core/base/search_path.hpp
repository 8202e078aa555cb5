#pragma once
// Where loom looks for its shared libraries: strategy plugins and the CUDA back ends alike.
#include <string>
#include <vector>

namespace loom {

// Directories searched for libloom_<name>.so, in order: every entry of LOOM_PLUGIN_PATH
// (colon-separated), the build tree's lib/ and the install prefix's lib/loom/ (both found relative
// to the running executable).
std::vector<std::string> plugin_search_path();

}  // namespace loom
