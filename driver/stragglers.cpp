#include "driver/stragglers.hpp"

#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <map>

namespace loom {
namespace {
const char* const kPhaseNames[] = {"data", "forward", "backward", "sync", "optimizer"};

// The median of `sorted` without one element of value `x` (that rank's own): the others' median.
double others_median(const std::vector<double>& sorted, double x) {
  const std::size_t p = static_cast<std::size_t>(std::lower_bound(sorted.begin(), sorted.end(), x) - sorted.begin());
  const std::size_t m = sorted.size() - 1;
  const auto other = [&](std::size_t k) { return sorted[k < p ? k : k + 1]; };
  return m % 2 ? other(m / 2) : 0.5 * (other(m / 2 - 1) + other(m / 2));
}
}  // namespace

StragglerWatch::StragglerWatch(Communicator& world, double factor, std::int64_t every, int peer_group)
    : world_(world), factor_(factor), every_(every) {
  if (factor_ > 0 && world_.size() == 1) idle_ = "one rank: nothing to compare";
  if (!on()) return;
  // The host names, once (MPI_COMM_WORLD: the grid's world is every rank of it).
  char mine[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MPI_Get_processor_name(mine, &len);
  std::vector<char> all(static_cast<std::size_t>(MPI_MAX_PROCESSOR_NAME) * world_.size());
  MPI_Allgather(mine, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, all.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR, MPI_COMM_WORLD);
  for (int r = 0; r < world_.size(); ++r)
    hosts_.emplace_back(all.data() + static_cast<std::size_t>(r) * MPI_MAX_PROCESSOR_NAME);
  groups_.resize(static_cast<std::size_t>(world_.size()));
  MPI_Allgather(&peer_group, 1, MPI_INT, groups_.data(), 1, MPI_INT, MPI_COMM_WORLD);
  std::map<int, int> size;
  for (int g : groups_) ++size[g];
  if (std::none_of(size.begin(), size.end(), [](const auto& kv) { return kv.second > 1; }))
    idle_ = "no two ranks do the same work (one rank per pipeline stage): nothing to compare";
}

void StragglerWatch::add(const StepStats& st, double wait) {
  if (!on()) return;
  const PhaseTimes& t = st.times;
  const double phases[kPhases] = {t.data, t.forward, t.backward, t.sync, t.optimizer};
  sums_[0] += 1;
  sums_[1] += std::max(0.0, st.seconds - wait);
  for (int i = 0; i < kPhases; ++i) sums_[2 + i] += phases[i];
}

nlohmann::json StragglerWatch::check(std::int64_t steps_done) {
  nlohmann::json slow = nlohmann::json::array();
  if (!on() || steps_done % every_ != 0 || sums_[0] == 0) return slow;
  const int n = world_.size();
  std::vector<double> all(static_cast<std::size_t>(kValues) * n);
  world_.all_gather(BufferRef(sums_.data(), kValues), BufferRef(all.data(), static_cast<std::int64_t>(all.size())));
  const auto at = [&](int r, int i) {
    return all[static_cast<std::size_t>(r) * kValues + i] / all[static_cast<std::size_t>(r) * kValues];
  };
  // Per peer group, sorted per value (busy, then each phase), to take every rank against the median of
  // the others of its group.
  std::map<int, std::vector<std::vector<double>>> sorted_by;
  for (int r = 0; r < n; ++r) {
    auto& sorted = sorted_by[groups_[r]];
    sorted.resize(1 + kPhases);
    for (int i = 0; i <= kPhases; ++i) sorted[i].push_back(at(r, 1 + i));
  }
  for (auto& [g, sorted] : sorted_by)
    for (auto& v : sorted) std::sort(v.begin(), v.end());
  for (int r = 0; r < n; ++r) {
    const auto& sorted = sorted_by[groups_[r]];
    if (sorted[0].size() < 2) continue;  // no peer
    const double busy = at(r, 1), others = others_median(sorted[0], busy);
    if (!(others > 0) || busy <= factor_ * others) continue;
    int worst = 0;  // the phase this rank spent the most time in beyond the others' median
    double worst_excess = -1e300;
    for (int i = 0; i < kPhases; ++i) {
      const double excess = at(r, 2 + i) - others_median(sorted[1 + i], at(r, 2 + i));
      if (excess > worst_excess) worst = i, worst_excess = excess;
    }
    nlohmann::json s = {{"rank", r},
                        {"host", hosts_[r]},
                        {"factor", busy / others},
                        {"busy_ms", busy * 1e3},
                        {"median_busy_ms", others * 1e3},
                        {"phase", kPhaseNames[worst]},
                        {"phase_excess_ms", worst_excess * 1e3},
                        {"steps", {window_first_, steps_done}},
                        {"factor_limit", factor_}};
    nlohmann::json& named = named_[std::to_string(r)];
    const int windows = named.is_null() ? 0 : named["windows"].get<int>();
    if (named.is_null() || s["factor"].get<double>() > named["factor"].get<double>())
      named = {{"rank", r}, {"host", hosts_[r]}, {"factor", s["factor"]}, {"phase", s["phase"]}};
    named["windows"] = windows + 1;
    slow.push_back(s);
  }
  std::fill(sums_.begin(), sums_.end(), 0.0);
  window_first_ = steps_done + 1;
  return slow;
}

nlohmann::json StragglerWatch::summary() const {
  nlohmann::json list = nlohmann::json::array();
  for (const auto& [rank, named] : named_.items()) list.push_back(named);
  std::sort(list.begin(), list.end(),
            [](const nlohmann::json& a, const nlohmann::json& b) { return a["rank"] < b["rank"]; });
  return list;
}

std::string StragglerWatch::describe(const nlohmann::json& s) {
  char buf[400];
  std::snprintf(
      buf, sizeof buf,
      "rank %d (host %s) was %.2fx the other ranks' median busy time over steps %lld..%lld (%.1f against %.1f "
      "ms per step, waits at collectives excluded; run.straggler_factor = %g), most of it in %s (+%.1f ms "
      "per step)",
      s["rank"].get<int>(), s["host"].get<std::string>().c_str(), s["factor"].get<double>(),
      static_cast<long long>(s["steps"][0].get<std::int64_t>()),
      static_cast<long long>(s["steps"][1].get<std::int64_t>()), s["busy_ms"].get<double>(),
      s["median_busy_ms"].get<double>(), s["factor_limit"].get<double>(), s["phase"].get<std::string>().c_str(),
      s["phase_excess_ms"].get<double>());
  return buf;
}

}  // namespace loom
