#pragma once
// Fault injection for the regression cases that prove a failing rank takes the job down cleanly.
// LOOM_INJECT_FAULT="rank=R,step=S,where=W" makes world rank R fail at training step S (0-based) in
// place W: "plugin" (an exception thrown inside the gradient-sync role) or "data" (the rank's data
// read fails as if its file were unreadable). Unset: no cost beyond one branch.
#include <cstdint>

#include <string>

namespace loom {
bool inject_fault(const char* where, std::int64_t step);

// Takes the whole job down from this rank: prints "loom: rank R: error: <why>" and exits with
// `status` through MPI_Abort. For failures in the middle of a collective (a checkpoint write), where
// unwinding would run collective clean-up that the other ranks never join.
[[noreturn]] void abort_job(const std::string& why, int status);
}  // namespace loom
