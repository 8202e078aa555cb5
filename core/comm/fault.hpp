#pragma once
// Fault injection for the regression cases that prove a failing rank takes the job down cleanly.
// LOOM_INJECT_FAULT="rank=R,step=S,where=W" makes world rank R fail at training step S (0-based) in
// place W: "plugin" (an exception thrown inside the step's work of a strategy plugin: the data and
// zero plugins' gradient sync, the tensor plugin's partition, the pipeline plugin's schedule; the data,
// zero and tensor plugins count S from the first step of this run), "data" (the rank's data read fails as if its file
// were unreadable) "checkpoint" (the rank dies in the middle of writing the checkpoint of step S), "nan" (one weight
// element of the rank is NaN during step S's forward and backward only: a bad batch's non-finite loss
// and gradients) or "nan_weights" (a NaN written into one weight after step S's update, where it
// stays: the state itself diverged) or "overflow" (one element of the gradient the rank updates is
// +inf after step S's gradient sync: an fp16 overflow in that rank's share only), "bad_data" (the
// rank's training rows of the global batches S .. S+3 are garbage, every target token 0: a bad stretch
// of data, the cause of a loss spike; S counts batches, which a rollback skips) or "slow" (from step
// S on, each of the rank's forward passes sleeps M ms, ",ms=M" added to the form, default 20: a slow
// node). Unset: no cost beyond one branch.
#include <cstdint>

#include <functional>
#include <string>

#include "core/comm/comm.hpp"

namespace loom {
bool inject_fault(const char* where, std::int64_t step);
// where=bad_data: whether this rank's rows of global batch `data_step` are to be garbage.
inline constexpr int kBadDataBatches = 4;
bool inject_bad_data(std::int64_t data_step);
// where=slow: sleeps the planned delay on the planned rank from the planned step on (in a forward).
void inject_slowness(std::int64_t step);

// Refuses (DeckError: exit 2 before any work, alike on every rank) a LOOM_INJECT_FAULT that is set
// but is not of the form above or names a rank outside a job of `world` ranks: a fault that would
// silently never fire would make a regression case prove nothing.
void check_fault_injection(int world);

// Writes `text` to stderr in one write (a final newline added if missing), so that the lines of ranks
// failing at once do not interleave.
void write_stderr(const std::string& text);
// "loom: rank R: error: " before every line of `why`, each line ended by a newline.
std::string rank_error_text(int rank, const std::string& why);

// Takes the whole job down from this rank: prints "loom: rank R: error: <why>" and exits with
// `status` through MPI_Abort. For failures in the middle of a collective (a checkpoint write), where
// unwinding would run collective clean-up that the other ranks never join.
[[noreturn]] void abort_job(const std::string& why, int status);

// Collective over `comm` (the grid's world): the ranks agree whether any of them failed (`local_failure`
// non-empty). If one did, each failing rank prints its reason, rank 0 runs `clean_up`, and every rank
// throws AgreedFailure("<consequence>: it failed on K of N rank(s), first on rank R").
void agree_on_failure(Communicator& comm, const std::string& local_failure, const std::function<void()>& clean_up,
                      const std::string& consequence);
}  // namespace loom
