#include "core/backend/wait_policy.hpp"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <string>

namespace loom {
namespace {

std::string g_note;

// The first of the variables that parses as a positive integer, else 0.
int first_count(std::initializer_list<const char*> names) {
  for (const char* name : names) {
    const char* v = std::getenv(name);
    if (!v || !*v) continue;
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (end != v && n > 0) return static_cast<int>(n);  // "2(x3)" (SLURM_TASKS_PER_NODE's form) reads as 2
  }
  return 0;
}

}  // namespace

void select_wait_policy(char** argv) {
  if (const char* set = std::getenv("LOOM_WAIT_POLICY_NOTE")) {  // after our own re-exec
    g_note = set;
    return;
  }
  for (const char* name : {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"}) {
    if (const char* v = std::getenv(name)) {
      g_note = std::string(name) + "=" + v + " (set by the caller)";
      return;
    }
  }
  const int ranks = first_count({"MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"});
  const int threads = first_count({"OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK"});
  cpu_set_t mask;
  CPU_ZERO(&mask);
  const int cpus = sched_getaffinity(0, sizeof mask, &mask) == 0 ? CPU_COUNT(&mask) : 0;
  if (threads <= 1 || cpus <= 0 || std::max(ranks, 1) * threads <= cpus) return;
  const std::string note = "OMP_WAIT_POLICY=PASSIVE set by loom (" + std::to_string(std::max(ranks, 1)) +
                           " rank(s) on this node x " + std::to_string(threads) + " threads > " + std::to_string(cpus) +
                           " CPUs: idle threads sleep rather than spin; set OMP_WAIT_POLICY " + "yourself to choose)";
  setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
  setenv("LOOM_WAIT_POLICY_NOTE", note.c_str(), 1);
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) {
    self[n] = '\0';
    execv(self, argv);  // returns only on failure: carry on spinning
  }
  g_note = "OMP_WAIT_POLICY unset (the re-exec to set PASSIVE failed)";
}

const char* wait_policy_note() { return g_note.c_str(); }

}  // namespace loom
