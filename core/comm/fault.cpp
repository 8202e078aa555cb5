#include "core/comm/fault.hpp"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/base/error.hpp"

namespace loom {

namespace {

const char* const kFaultForm =
    "rank=R,step=S,where=plugin|data|checkpoint|nan|nan_weights|overflow|bad_data|slow[,ms=M]";
const char* const kFaultPlaces[] = {"plugin",      "data",     "checkpoint", "nan",
                                    "nan_weights", "overflow", "bad_data",   "slow"};

struct FaultPlan {
  int rank = -1;
  long long step = -1;
  std::string where;
  long long ms = 20;  // where=slow: the delay per forward pass
};

// The plan LOOM_INJECT_FAULT asks for; nullopt with `why` set when it is malformed.
std::optional<FaultPlan> parse_fault_spec(const std::string& spec, std::string* why) {
  static const std::regex form(R"(rank=(\d{1,9}),step=(\d{1,18}),where=(\w+)(,ms=(\d{1,6}))?)");
  std::smatch m;
  if (!std::regex_match(spec, m, form)) {
    *why = "is not of the form " + std::string(kFaultForm) + " (R a world rank, S a 0-based step)";
    return std::nullopt;
  }
  FaultPlan plan{std::stoi(m[1]), std::stoll(m[2]), m[3]};
  if (m[5].matched) plan.ms = std::stoll(m[5]);
  const bool known = std::any_of(std::begin(kFaultPlaces), std::end(kFaultPlaces),
                                 [&](const char* place) { return plan.where == place; });
  if (known && m[5].matched && plan.where != "slow") {
    *why = "ms= is given only with where=slow";
    return std::nullopt;
  }
  if (known) return plan;
  *why = "where=" + escape_value(plan.where) +
         " is not a place a fault can be injected (valid: plugin, data, checkpoint, nan, nan_weights, overflow, "
         "bad_data, slow)";
  return std::nullopt;
}

const char* fault_env() { return std::getenv("LOOM_INJECT_FAULT"); }

}  // namespace

namespace {
const std::optional<FaultPlan>& fault_plan() {
  static const std::optional<FaultPlan> plan = []() -> std::optional<FaultPlan> {
    std::string why;
    return fault_env() ? parse_fault_spec(fault_env(), &why) : std::nullopt;
  }();
  return plan;
}
bool on_fault_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank == fault_plan()->rank;
}
}  // namespace

bool inject_fault(const char* where, std::int64_t step) {
  const auto& plan = fault_plan();
  if (!plan || plan->step != step || plan->where != where) return false;
  return on_fault_rank();
}

bool inject_bad_data(std::int64_t data_step) {
  const auto& plan = fault_plan();
  if (!plan || plan->where != "bad_data" || data_step < plan->step || data_step >= plan->step + kBadDataBatches)
    return false;
  return on_fault_rank();
}

void inject_slowness(std::int64_t step) {
  const auto& plan = fault_plan();
  if (!plan || plan->where != "slow" || step < plan->step || !on_fault_rank()) return;
  std::this_thread::sleep_for(std::chrono::milliseconds(plan->ms));
}

void check_fault_injection(int world) {
  const char* env = fault_env();
  if (!env) return;
  const std::string what = "LOOM_INJECT_FAULT = " + quote_value(env) + ": ";
  std::string why;
  const std::optional<FaultPlan> plan = parse_fault_spec(env, &why);
  if (!plan) throw DeckError(what + why + "; unset it to run without a fault");
  if (plan->rank >= world)
    throw DeckError(what + "rank=" + std::to_string(plan->rank) + " is not a rank of this job of " +
                    std::to_string(world) + " rank" + (world == 1 ? "" : "s") + ", so the fault would never happen");
}

void write_stderr(const std::string& message) {
  const std::string text = message.empty() || message.back() != '\n' ? message + "\n" : message;
  std::fflush(stderr);  // whatever went before, first
  for (std::size_t at = 0; at < text.size();) {
    const ssize_t n = ::write(STDERR_FILENO, text.data() + at, text.size() - at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    at += static_cast<std::size_t>(n);
  }
}

std::string rank_error_text(int rank, const std::string& why) {
  const std::string prefix = "loom: rank " + std::to_string(rank) + ": error: ";
  std::istringstream lines(why);
  std::string line, out;
  while (std::getline(lines, line)) out += prefix + line + "\n";
  if (out.empty()) out = prefix + "\n";
  return out;
}

void abort_job(const std::string& why, int status) {
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  write_stderr(rank_error_text(rank, why) + "loom: rank " + std::to_string(rank) + ": aborting all " +
               std::to_string(world) + " ranks\n");
  // The launcher forwards stderr through a pipe; give it a moment to carry the message out before
  // the abort tears the job down (otherwise the reason can be lost).
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  MPI_Abort(MPI_COMM_WORLD, status);
  std::abort();
}

void agree_on_failure(Communicator& comm, const std::string& local_failure, const std::function<void()>& clean_up,
                      const std::string& consequence) {
  // Each rank's failure flag in its own slot: the lowest failing rank is the one named.
  const int world = comm.size();
  std::vector<double> failed(static_cast<std::size_t>(world), 0.0);
  failed[comm.rank()] = local_failure.empty() ? 0.0 : 1.0;
  comm.all_reduce(failed.data(), world);
  int first = -1, count = 0;
  for (int r = 0; r < world; ++r)
    if (failed[r] > 0) {
      if (first < 0) first = r;
      ++count;
    }
  if (first < 0) return;
  // The failing ranks say why (their reasons may differ); rank 0 runs the clean-up.
  if (!local_failure.empty()) write_stderr(rank_error_text(comm.rank(), local_failure));
  if (comm.rank() == 0 && clean_up) clean_up();
  throw AgreedFailure(consequence + ": it failed on " + std::to_string(count) + " of " + std::to_string(world) +
                      " rank(s), first on rank " + std::to_string(first));
}

}  // namespace loom
