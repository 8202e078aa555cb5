#pragma once
// Fault injection for the regression cases that prove a failing rank takes the job down cleanly.
// LOOM_INJECT_FAULT="rank=R,step=S,where=W" makes world rank R fail at training step S (0-based) in
// place W: "plugin" (an exception thrown inside the gradient-sync role) or "data" (the rank's data
// read fails as if its file were unreadable). Unset: no cost beyond one branch.
#include <cstdint>

#include <functional>
#include <string>

#include "core/grid.hpp"

namespace loom {
bool inject_fault(const char* where, std::int64_t step);

// Takes the whole job down from this rank: prints "loom: rank R: error: <why>" and exits with
// `status` through MPI_Abort. For failures in the middle of a collective (a checkpoint write), where
// unwinding would run collective clean-up that the other ranks never join.
[[noreturn]] void abort_job(const std::string& why, int status);

// Writes `text` (one or more whole lines) to stderr with one write(2), so that lines from several
// ranks sharing the launcher's stderr do not interleave mid-line.
void write_stderr(const std::string& text);

// Collective over the grid's world: the ranks agree whether any of them failed (`local_failure`
// non-empty). If one did, each failing rank prints its reason, rank 0 runs `clean_up`, and every rank
// throws AgreedFailure("<consequence>: it failed on K of N rank(s), first on rank R").
void agree_on_failure(ProcessGrid& grid, const std::string& local_failure, const std::function<void()>& clean_up,
                      const std::string& consequence);
}  // namespace loom
