#pragma once
// Slow ranks named (run.straggler_factor, DESIGN.md "Runs a user can trust"). Each rank adds up its
// own step times, its waits at collectives and its phase times; every run.straggler_every steps the
// ranks gather those sums (one all-gather of a few numbers per rank), and a rank whose busy time (its
// step time less its waits: what it computed) is more than the factor times the median of the other
// ranks doing the same work (its peers: the ranks of its pipeline stage, whose layers are its own) is
// named with its host, how much slower it was, and the phase it lost the time in.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/comm/comm.hpp"
#include "core/engine/engine.hpp"

namespace loom {

class StragglerWatch {
 public:
  // Collective (gathers the host names and peer groups once). `factor` 0: off, nothing gathered.
  // `peer_group`: this rank's (its pipeline stage).
  StragglerWatch(Communicator& world, double factor, std::int64_t every, int peer_group);
  bool on() const { return factor_ > 0 && world_.size() > 1; }
  // Why nothing is compared although run.straggler_factor asks (one rank, or no rank has a peer), else "".
  const std::string& idle_reason() const { return idle_; }
  // This rank's step (`wait`: its seconds waiting at collectives in it).
  void add(const StepStats& st, double wait);
  // Collective when due (after every `every` steps, counted by `steps_done`): the slow ranks of the
  // window just ended, as metrics rows list them (empty when none, or not due); also remembered for
  // the summary.
  nlohmann::json check(std::int64_t steps_done);
  // Each rank named at least once: how often, the worst factor and the phase then.
  nlohmann::json summary() const;
  // "rank 1 (host h) was 1.93x the other ranks' median busy time over steps 11..20 (41.2 against 21.3 ms per
  // step, waits excluded), most of it in forward (+19.8 ms per step)"
  static std::string describe(const nlohmann::json& slow);

 private:
  static constexpr int kPhases = 5;            // data, forward, backward, sync, optimizer
  static constexpr int kValues = 2 + kPhases;  // steps, busy seconds, phase seconds
  Communicator& world_;
  double factor_;
  std::int64_t every_;
  std::vector<std::string> hosts_;
  std::vector<int> groups_;  // each rank's peer group
  std::string idle_;
  std::vector<double> sums_ = std::vector<double>(kValues, 0.0);
  std::int64_t window_first_ = 1;
  nlohmann::json named_ = nlohmann::json::object();  // by rank
};

}  // namespace loom
