#pragma once
// run.threads: BLAS threads per rank, a positive integer or `auto`, the thread count the job was
// given (OMP_NUM_THREADS, else Slurm's --cpus-per-task, else 1), so that a batch script's
// --cpus-per-task reaches loom without a --set.
#include <string>

namespace loom {

constexpr int kMaxThreads = 1024;

// The deck check of run.threads: "" when `value` is `auto` or an integer in [1, kMaxThreads],
// otherwise what is allowed.
std::string check_threads_setting(const std::string& value);

struct ThreadCount {
  int threads = 1;
  std::string origin;  // for the banner: "run.threads = 4", "run.threads = auto: OMP_NUM_THREADS = 4", ...
};

// Resolves a checked run.threads value; the environment values are passed in (null or empty:
// unset). OMP_NUM_THREADS may be a nesting list ("4,2"): its first level counts. Throws InputError
// naming the variable when the one that decides is not a count in [1, kMaxThreads].
ThreadCount resolve_threads(const std::string& setting, const char* omp_num_threads, const char* slurm_cpus_per_task);

}  // namespace loom
