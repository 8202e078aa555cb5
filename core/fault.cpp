#include "core/fault.hpp"

#include <unistd.h>

#include <cerrno>
#include <vector>

#include "core/error.hpp"

#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <iostream>
#include <string>
#include <thread>

namespace loom {

bool inject_fault(const char* where, std::int64_t step) {
  struct Plan {
    bool active = false;
    int rank = -1;
    long long step = -1;
    char where[32] = {0};
  };
  static const Plan plan = [] {
    Plan p;
    const char* env = std::getenv("LOOM_INJECT_FAULT");
    if (env && std::sscanf(env, "rank=%d,step=%lld,where=%31s", &p.rank, &p.step, p.where) == 3) p.active = true;
    return p;
  }();
  if (!plan.active || plan.step != step || std::strcmp(plan.where, where) != 0) return false;
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank == plan.rank;
}

void abort_job(const std::string& why, int status) {
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  std::cerr << "loom: rank " << rank << ": error: " << why << std::endl;
  std::cerr << "loom: rank " << rank << ": aborting all " << world << " ranks" << std::endl;
  // The launcher forwards stderr through a pipe; give it a moment to carry the message out before
  // the abort tears the job down (otherwise the reason can be lost).
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  MPI_Abort(MPI_COMM_WORLD, status);
  std::abort();
}

void write_stderr(const std::string& text) {
  std::string line = text;
  if (line.empty() || line.back() != '\n') line += '\n';
  std::fflush(stderr);
  std::cerr.flush();
  const char* p = line.data();
  std::size_t left = line.size();
  while (left > 0) {
    const ssize_t n = ::write(2, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

void agree_on_failure(ProcessGrid& grid, const std::string& local_failure, const std::function<void()>& clean_up,
                      const std::string& consequence) {
  // Each rank's failure flag in its own slot: the lowest failing rank is the one named.
  const int world = grid.layout().ranks();
  std::vector<double> failed(static_cast<std::size_t>(world), 0.0);
  failed[grid.rank()] = local_failure.empty() ? 0.0 : 1.0;
  grid.world().all_reduce(failed.data(), world);
  int first = -1, count = 0;
  for (int r = 0; r < world; ++r)
    if (failed[r] > 0) {
      if (first < 0) first = r;
      ++count;
    }
  if (first < 0) return;
  // The failing ranks say why (their reasons may differ); rank 0 runs the clean-up.
  if (!local_failure.empty()) write_stderr("loom: rank " + std::to_string(grid.rank()) + ": error: " + local_failure);
  if (grid.rank() == 0 && clean_up) clean_up();
  throw AgreedFailure(consequence + ": it failed on " + std::to_string(count) + " of " + std::to_string(world) +
                      " rank(s), first on rank " + std::to_string(first));
}

}  // namespace loom
