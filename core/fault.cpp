#include "core/fault.hpp"

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

}  // namespace loom
