#pragma once
// The one clock loom times with: seconds of the steady clock, shared by every process on a node
// (the pipeline's trace takes one rank's origin for all of them).
#include <chrono>

namespace loom {

inline double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace loom
