#pragma once
// Checkpoint policy of a run (DESIGN.md "Checkpoints"): where it starts (checkpoint.resume = FILE,
// latest or auto), saving every checkpoint.every steps, at the end (checkpoint.at_end) and on SIGTERM
// or SIGINT (as Slurm sends before the time limit, or Ctrl-C), keeping checkpoint.keep files and
// `latest`. Nothing non-finite is ever saved, and the last good checkpoint is never deleted for it.
#include <mpi.h>

#include <csignal>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>

#include "driver/session.hpp"
#include "io/checkpoint.hpp"

namespace loom {

// A run that starts fresh (checkpoint.resume empty, or auto without `latest`) into a checkpoint.dir
// holding checkpoints would overwrite them: refused naming them unless run.overwrite (`loom run` and
// `loom check` alike).
void refuse_fresh_over_checkpoints(const std::string& dir, const std::string& resume, bool overwrite);

// A checkpoint file's name (ckpt-*.h5), and a write of one that never finished (ckpt-*.tmp: a crash
// mid-write leaves it; the next save removes it).
bool is_checkpoint_file(const std::string& name);
bool is_unfinished_checkpoint(const std::string& name);

// Exit status of a run stopped by SIGTERM or SIGINT after saving a checkpoint: not finished, resumable.
inline constexpr int kExitInterrupted = 3;

class Checkpointing {
 public:
  // Installs the SIGTERM/SIGINT handlers: the first signal saves and stops after the current step,
  // a second one stops at once (exit status 128 + signal).
  explicit Checkpointing(Session& session);
  ~Checkpointing();  // waits for a write in flight
  // Before anything is written (collective, errors agreed and reported once): resolves
  // checkpoint.resume (auto: `latest` if it exists, else a fresh start), refuses a fresh run into a
  // checkpoint.dir that holds checkpoints unless run.overwrite (which removes them), and creates
  // checkpoint.dir and probes it for writing.
  void prepare();
  // Loads the checkpoint prepare() chose (collective); returns the step to start from. A checkpoint
  // of another model, with inconsistent steps or non-finite values is refused; training keys that
  // differ from the checkpoint's deck are printed as a diff.
  std::int64_t resume();
  // After `steps_done` steps. Saves when due or when any rank got a stop signal; returns true when the
  // run must stop now (interrupted). Adds what it did to `record` (the step's metrics). Throws
  // AgreedFailure when the state is not finite or the write failed (nothing saved, nothing deleted).
  bool after_step(std::int64_t steps_done, nlohmann::json& record);
  // After the last step: saves a final checkpoint if checkpointing is configured and
  // checkpoint.at_end (unless the last step was just saved).
  void at_end(std::int64_t steps_done, nlohmann::json& record);
  // checkpoint.async: waits for the write in flight, if any, and reports it (collective); throws
  // AgreedFailure when it failed. The run calls it after its last step; a save, a stop signal and a
  // rollback wait alike.
  void wait_for_write(nlohmann::json* record = nullptr);
  // Whether a rollback has a checkpoint to return to: one this run saved (or is writing), or the one
  // it resumed from.
  bool can_roll_back() const { return !last_good_.empty() || in_flight_ != nullptr; }
  // A rollback after a loss spike at `steps_done` (collective; can_roll_back() first): waits for a
  // write in flight (its record into `record`), reloads the last checkpoint this run saved or resumed
  // from (never a later one an earlier run left in checkpoint.dir); returns its step and path. Leaves
  // Session::data_offset at the checkpoint's; the caller moves it past the spike.
  std::pair<std::int64_t, std::string> roll_back(std::int64_t steps_done, nlohmann::json* record);
  nlohmann::json summary() const;
  const std::string& dir() const { return dir_; }
  bool resuming() const { return !resume_path_.empty(); }
  // The signal that stopped the run (0: none).
  static int stop_signal();

 private:
  void save(std::int64_t steps_done, nlohmann::json& record, const char* why);
  // After the file of `path` is complete: `latest` names it (rank 0), older ones beyond
  // checkpoint.keep go. Returns this rank's failure.
  std::string publish(const std::string& path);
  void count_write(const std::string& path, double seconds, nlohmann::json* record, const char* why);
  struct InFlight;  // checkpoint.async: the write on its own thread, over writer_comm_
  std::unique_ptr<InFlight> in_flight_;
  bool async_ = false;
  MPI_Comm writer_comm_ = MPI_COMM_NULL;
  double snapshot_seconds_ = 0;
  Session& s_;
  std::string dir_;
  std::int64_t every_, keep_;
  std::string resume_;       // checkpoint.resume as given
  std::string resume_path_;  // the file prepare() chose ("" = fresh)
  std::string last_good_;    // the last checkpoint this run saved (complete), else resume_path_
  bool configured_ = false;  // checkpoint.every, checkpoint.dir or checkpoint.resume given
  bool at_end_ = true;
  std::int64_t last_saved_ = -1;
  int saves_ = 0;
  double save_seconds_ = 0, save_bytes_ = 0, load_seconds_ = 0, load_bytes_ = 0;
};

}  // namespace loom
