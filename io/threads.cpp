#include "io/threads.hpp"

#include <cctype>

#include "core/base/error.hpp"

namespace loom {
namespace {

// A decimal count in [1, kMaxThreads], or 0 when `text` is not one.
int parse_count(const std::string& text) {
  if (text.empty() || text.size() > 6) return 0;
  int v = 0;
  for (char c : text) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return 0;
    v = v * 10 + (c - '0');
  }
  return v >= 1 && v <= kMaxThreads ? v : 0;
}

}  // namespace

std::string check_threads_setting(const std::string& value) {
  if (value == "auto" || parse_count(value) > 0) return "";
  return "auto, or an integer in [1, " + std::to_string(kMaxThreads) + "]";
}

ThreadCount resolve_threads(const std::string& setting, const char* omp_num_threads, const char* slurm_cpus_per_task) {
  if (setting != "auto") return {parse_count(setting), "run.threads = " + setting};
  const auto from = [](const std::string& variable, const std::string& value) {
    const int n = parse_count(value);
    if (n == 0)
      throw InputError("run.threads = auto: " + variable + " = '" + value + "' is not a thread count in [1, " +
                       std::to_string(kMaxThreads) + "]; set run.threads to a number to ignore it");
    return ThreadCount{n, "run.threads = auto: " + variable + " = " + std::to_string(n)};
  };
  if (omp_num_threads && *omp_num_threads) {
    const std::string list = omp_num_threads;
    return from("OMP_NUM_THREADS", list.substr(0, list.find(',')));
  }
  if (slurm_cpus_per_task && *slurm_cpus_per_task) return from("SLURM_CPUS_PER_TASK", slurm_cpus_per_task);
  return {1, "run.threads = auto: 1 (neither OMP_NUM_THREADS nor SLURM_CPUS_PER_TASK is set)"};
}

}  // namespace loom
