#pragma once
// Checkpoint policy of a run: resume at start, save every checkpoint.every steps and on SIGTERM
// (as Slurm sends before the time limit), keep checkpoint.keep files, maintain `latest`.
#include <csignal>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "driver/session.hpp"

namespace loom {

class Checkpointing {
 public:
  explicit Checkpointing(Session& session);  // installs the SIGTERM handler
  // Loads checkpoint.resume if set (collective); returns the step to start from. Errors (a missing
  // `latest`, a bad file, another model) are agreed over the ranks and reported once.
  std::int64_t resume();
  // After `steps_done` steps. Saves when due or when any rank got SIGTERM; returns true when the
  // run must stop now (SIGTERM). Adds what it did to `record` (the step's metrics).
  bool after_step(std::int64_t steps_done, nlohmann::json& record);
  nlohmann::json summary() const;
  const std::string& dir() const { return dir_; }

 private:
  std::string save(std::int64_t steps_done);
  Session& s_;
  std::string dir_;
  std::int64_t every_, keep_;
  std::string resume_;
  int saves_ = 0;
  double save_seconds_ = 0, save_bytes_ = 0, load_seconds_ = 0, load_bytes_ = 0;
};

}  // namespace loom
