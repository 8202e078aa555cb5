#pragma once
// Fault injection for the regression cases that prove a failing rank takes the job down cleanly.
// LOOM_INJECT_FAULT="rank=R,step=S,where=W" makes world rank R fail at training step S (0-based) in
// place W: "plugin" (an exception thrown inside the gradient-sync role) or "data" (the rank's data
// read fails as if its file were unreadable). Unset: no cost beyond one branch.
#include <cstdint>

namespace loom {
bool inject_fault(const char* where, std::int64_t step);
}  // namespace loom
