#include "driver/checkpointing.hpp"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>
#include <vector>

#include "core/base/clock.hpp"
#include "core/base/error.hpp"
#include "core/comm/fault.hpp"
#include "driver/health.hpp"
#include "driver/run_dir.hpp"
#include "io/util.hpp"

namespace fs = std::filesystem;

namespace loom {
namespace {

volatile std::sig_atomic_t g_stop_signal = 0;

// Whether SIGHUP was ignored when the executable's statics were initialised (after the libraries').
const bool g_hangup_ignored_at_start = [] {
  struct sigaction a {};
  return sigaction(SIGHUP, nullptr, &a) == 0 && a.sa_handler == SIG_IGN;
}();

extern "C" void on_stop_signal(int sig) {
  if (g_stop_signal != 0) {  // the second signal: the user does not want to wait for the save
    static const char msg[] = "loom: second signal: stopping now, without saving a checkpoint\n";
    ssize_t ignored = ::write(2, msg, sizeof msg - 1);
    (void)ignored;
    _exit(128 + sig);
  }
  g_stop_signal = sig;
}

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

std::string checkpoint_name(std::int64_t step) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "ckpt-%08lld.h5", static_cast<long long>(step));
  return buf;
}

// What a fresh run would overwrite: checkpoint files (also half-written .tmp ones) and `latest`.
std::vector<std::string> earlier_checkpoints(const std::string& dir) {
  std::vector<std::string> found;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return found;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string f = e.path().filename().string();
    if (is_checkpoint_file(f) || f == "latest" || is_unfinished_checkpoint(f)) found.push_back(f);
  }
  std::sort(found.begin(), found.end());
  return found;
}

std::string list_names(const std::vector<std::string>& names, std::size_t most = 6) {
  std::string s;
  for (std::size_t i = 0; i < names.size() && i < most; ++i) s += (i ? ", " : "") + names[i];
  if (names.size() > most) s += ", ... (" + std::to_string(names.size()) + " in all)";
  return s;
}

std::string read_latest(const std::string& dir) {
  const std::string name = read_latest_name(dir);  // a regular file naming a file of dir
  if (name.empty())
    throw InputError("checkpoint.resume = latest, but '" + dir +
                     "/latest' does not exist (no checkpoint was completed in checkpoint.dir = " + dir +
                     "; checkpoint.resume = auto starts fresh in that case)");
  return dir + "/" + name;
}

bool same_value(const std::string& a, const std::string& b) {
  if (a == b) return true;
  char *ea = nullptr, *eb = nullptr;
  const double x = std::strtod(a.c_str(), &ea), y = std::strtod(b.c_str(), &eb);
  return ea && eb && *ea == '\0' && *eb == '\0' && !a.empty() && !b.empty() && x == y;
}

}  // namespace

int Checkpointing::stop_signal() { return g_stop_signal; }

void refuse_fresh_over_checkpoints(const std::string& dir, const std::string& resume, bool overwrite) {
  const auto earlier = earlier_checkpoints(dir);
  if (overwrite || earlier.empty()) return;
  // checkpoint.resume = auto found no `latest` to continue from (one lost, or never written).
  if (resume == "auto") {
    std::string newest;
    for (const std::string& f : earlier)
      if (is_checkpoint_file(f)) newest = f;  // sorted: the highest step last
    throw InputError("checkpoint.resume = auto: checkpoint.dir = '" + dir + "' holds " + list_names(earlier) +
                     " but no 'latest' file naming the checkpoint to continue from: " +
                     (newest.empty() ? std::string("")
                                     : "resume one by name (--set checkpoint.resume=" + dir + "/" + newest + "), ") +
                     "or set run.overwrite = true to replace them");
  }
  throw InputError("checkpoint.dir = '" + dir + "' holds an earlier run's checkpoints (" + list_names(earlier) +
                   "), which a fresh run would overwrite: continue it with --set checkpoint.resume=auto, "
                   "choose another run.dir or checkpoint.dir, or set run.overwrite = true to replace them");
}

struct Checkpointing::InFlight {
  std::string path, why;
  CheckpointImage image;  // the step's state, copied to host memory
  std::string failure;    // agreed over writer_comm_: the same on every rank
  double seconds = 0;
  std::thread thread;
};

Checkpointing::~Checkpointing() {
  if (in_flight_ && in_flight_->thread.joinable()) {  // a run ending early: the write still finishes
    in_flight_->thread.join();
    if (!in_flight_->failure.empty() && world_rank() == 0) write_stderr("loom: error: " + in_flight_->failure);
  }
  if (writer_comm_ != MPI_COMM_NULL) MPI_Comm_free(&writer_comm_);
}

Checkpointing::Checkpointing(Session& session) : s_(session) {
  const std::string given_dir = s_.deck.get_string("checkpoint.dir");
  dir_ = given_dir.empty() ? s_.run_dir + "/checkpoints" : given_dir;
  every_ = s_.deck.get_int("checkpoint.every");
  keep_ = s_.deck.get_int("checkpoint.keep");
  resume_ = s_.deck.get_string("checkpoint.resume");
  at_end_ = s_.deck.get_bool("checkpoint.at_end");
  configured_ = every_ > 0 || !given_dir.empty() || !resume_.empty();
  async_ = s_.deck.get_bool("checkpoint.async");
  if (async_) {
    // The writer thread's collectives run beside the training's: MPI must allow calls from any thread,
    // on a communicator of their own.
    int provided = MPI_THREAD_SINGLE;
    MPI_Query_thread(&provided);
    if (provided < MPI_THREAD_MULTIPLE)
      throw InputError(
          "checkpoint.async = true writes from a thread of its own, which needs MPI_THREAD_MULTIPLE; "
          "this MPI provides level " +
          std::to_string(provided) + ": set checkpoint.async = false");
    MPI_Comm_dup(MPI_COMM_WORLD, &writer_comm_);
  }
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  // A hang-up (a closed terminal or session) saves and stops as SIGTERM does, as torchrun treats it,
  // unless the process started ignoring it (nohup) and nothing changed that before main. (UCX, loaded
  // with MPI, puts its debug handler there as the libraries load, so under UCX a nohup's ignore is
  // not seen: detach with setsid there.)
  if (!g_hangup_ignored_at_start) sigaction(SIGHUP, &sa, nullptr);
}

void Checkpointing::prepare() {
  // Every rank resolves the file it will read (the file system is shared: MPI-IO needs it).
  run_agreed([&] {
    if (resume_ == "auto") {
      std::error_code ec;
      if (fs::exists(dir_ + "/latest", ec)) resume_path_ = read_latest(dir_);
    } else if (resume_ == "latest") {
      resume_path_ = read_latest(dir_);
    } else {
      resume_path_ = resume_;
    }
  });
  // Rank 0 alone looks at and changes the directory.
  run_agreed([&] {
    if (world_rank() != 0) return;
    const auto earlier = earlier_checkpoints(dir_);
    if (resume_path_.empty() && !earlier.empty()) {
      refuse_fresh_over_checkpoints(dir_, resume_, s_.deck.get_bool("run.overwrite"));
      std::error_code ec;
      for (const auto& f : earlier)
        if (!fs::remove(dir_ + "/" + f, ec) && ec)
          throw InputError("run.overwrite = true: cannot remove " + dir_ + "/" + f + " (" + ec.message() + ")");
      std::cout << "run.overwrite = true: removed the earlier run's checkpoints in " << dir_ << " ("
                << list_names(earlier) << ")" << std::endl;
    }
    // Created and probed now, so that an unwritable directory is found before any training.
    std::error_code ec;
    fs::create_directories(dir_, ec);
    if (ec) throw InputError("checkpoint.dir = '" + dir_ + "': cannot create the directory (" + ec.message() + ")");
    const std::string probe = dir_ + "/.loom-write-probe-" + std::to_string(getpid());
    try {
      write_file_atomic(probe, "loom checks that checkpoint.dir is writable\n");
    } catch (const WriteError& e) {
      throw InputError("checkpoint.dir = '" + dir_ + "' is not writable: " + e.what());
    }
    fs::remove(probe, ec);
  });
}

std::int64_t Checkpointing::resume() {
  if (resume_path_.empty()) return 0;
  const std::string& path = resume_path_;
  CheckpointState st;
  const double t0 = now();
  run_agreed([&] { st = load_checkpoint(path, *s_.grid, *s_.model, s_.engine->optimizer(), s_.checkpoint_parts); });
  s_.data_offset = st.data_step - st.step;
  last_good_ = path;
  load_seconds_ = now() - t0;
  std::error_code ec;
  load_bytes_ = static_cast<double>(fs::file_size(path, ec));
  if (st.step >= s_.steps)
    throw DeckError("checkpoint " + quote_path(path) + " is at step " + std::to_string(st.step) +
                    ", and train.steps = " + std::to_string(s_.steps) + ": nothing left to train (raise train.steps)");
  if (world_rank() != 0) return st.step;
  std::cout << "resumed from " << path << " at step " << st.step << " (written by " << st.layout.describe() << "; read "
            << load_bytes_ / 1e6 << " MB in " << load_seconds_ << " s)" << std::endl;
  if (s_.data_offset > 0)
    std::cout << "resume: step " << st.step + 1 << " draws global batch " << st.data_step + 1 << " (" << s_.data_offset
              << " batch(es) skipped by rollbacks after loss spikes)" << std::endl;
  // The training keys of the run that wrote it, against this deck's: a change is allowed, and shown.
  const auto before = resolved_deck_values(st.deck);
  const auto after = s_.deck.values();
  std::string diff;
  for (const auto& [key, value] : after) {
    if (key.rfind("train.", 0) != 0 && key.rfind("data.", 0) != 0) continue;
    const auto it = before.find(key);
    if (it == before.end() || same_value(it->second, value)) continue;
    diff += "  " + key + ": " + it->second + " -> " + value + "\n";
  }
  // The data order is a function of (train.seed, data.*, train.batch, step) alone: a resume on
  // another layout continues the sequence of global batches the writer would have drawn.
  std::string order_keys;
  for (const auto& [key, value] : after) {
    if (key != "train.batch" && key != "train.seed" && key.rfind("data.", 0) != 0) continue;
    const auto it = before.find(key);
    if (it != before.end() && !same_value(it->second, value))
      order_keys += (order_keys.empty() ? "" : ", ") + key + " " + it->second + " -> " + value;
  }
  if (order_keys.empty())
    std::cout << "resume: data order: step " << st.step + 1 << " draws global batch " << st.data_step + 1
              << ", the one the run that wrote the checkpoint (" << st.layout.describe()
              << ") would have drawn next: the order does not depend on the layout" << std::endl;
  else
    std::cout << "resume: data order: NOT the run's that wrote the checkpoint: from step " << st.step + 1
              << " on the global batches differ from those it would have drawn (" << order_keys << ")" << std::endl;
  if (!diff.empty()) {
    std::cout << "resume: training keys differ from the run that wrote the checkpoint:\n" << diff;
    const auto old_steps = before.find("train.steps");
    if (old_steps != before.end() && !same_value(old_steps->second, after.at("train.steps"))) {
      OptimizerConfig was = s_.engine_cfg.optimizer;
      was.steps = std::atoll(old_steps->second.c_str());
      std::printf(
          "resume: the learning-rate schedule is a function of the step and train.steps, so it continues on "
          "the curve for %lld steps: at step %lld the rate is %.4e (%.4e on the curve for %lld steps)\n",
          static_cast<long long>(s_.steps), static_cast<long long>(st.step + 1),
          lr_at(s_.engine_cfg.optimizer, st.step), lr_at(was, st.step), static_cast<long long>(was.steps));
    }
    std::cout << std::flush;
  }
  return st.step;
}

bool Checkpointing::after_step(std::int64_t steps_done, nlohmann::json& record) {
  // Any rank signalled: all save (summed over the world communicator, which a stalled rank cannot hang).
  const bool stop = s_.grid->world().sum(g_stop_signal ? 1.0 : 0.0) > 0;
  const bool due = every_ > 0 && steps_done % every_ == 0;
  if (due || stop) save(steps_done, record, stop ? " on a stop signal; stopping" : "");
  if (stop) wait_for_write(&record);  // an interrupted run ends with its checkpoint on disk
  return stop;
}

void Checkpointing::at_end(std::int64_t steps_done, nlohmann::json& record) {
  if (configured_ && at_end_ && last_saved_ != steps_done) save(steps_done, record, " at the end of training");
}

void Checkpointing::save(std::int64_t steps_done, nlohmann::json& record, const char* why) {
  wait_for_write(&record);  // one write at a time: the next save waits for the last
  const bool root = world_rank() == 0;
  // Never save a diverged state: the last good checkpoint (and `latest`) stay as they are.
  std::vector<TensorSource> sources = {parameters(*s_.model)};
  for (TensorSource& t : optimizer_state(s_.engine->optimizer())) sources.push_back(std::move(t));
  auto refuse = [&](const std::string& what) {
    std::string latest = "none yet";
    std::ifstream in(dir_ + "/latest");
    if (in) std::getline(in, latest);
    throw AgreedFailure("not saving the checkpoint of step " + std::to_string(steps_done) + ": " + what +
                        " is not finite; the last good checkpoint stays (" + dir_ + "/latest -> " + latest + ")");
  };
  if (const auto bad = find_nonfinite(*s_.grid, *s_.model, sources)) refuse(bad->describe());
  if (const auto bad = find_nonfinite_contributed(*s_.grid, s_.model->backend(), s_.checkpoint_parts))
    refuse("contributed tensor " + *bad);
  const std::string path = dir_ + "/" + checkpoint_name(steps_done);
  CheckpointState st;
  st.step = steps_done;
  st.optimizer_steps = s_.engine->optimizer().steps_taken();
  st.skipped_steps = st.step - st.optimizer_steps;
  st.seed = s_.seed;
  st.deck = s_.recorded_deck();
  st.layout = s_.layout;
  st.data_step = steps_done + s_.data_offset;
  last_saved_ = steps_done;
  const double t0 = now();
  if (!async_) {
    save_checkpoint(path, *s_.grid, *s_.model, s_.engine->optimizer(), st, s_.checkpoint_parts);
    agree_on_failure(s_.grid->world(), publish(path), {},
                     "checkpoint '" + path + "' was written but `latest` could not be pointed at it");
    last_good_ = path;
    return count_write(path, now() - t0, &record, why);
  }
  // checkpoint.async: the state of this step is copied to host memory now; a thread of its own writes
  // it while training goes on.
  in_flight_ = std::make_unique<InFlight>();
  InFlight& f = *in_flight_;
  f.path = path;
  f.why = why;
  f.image = checkpoint_snapshot(*s_.model, s_.engine->optimizer(), s_.checkpoint_parts);
  const double copied = now() - t0;
  snapshot_seconds_ += copied;
  f.thread = std::thread([this, &f, st, t0] {
    std::string local;  // a failure before the file's collectives (it cannot be created): every rank alike
    try {
      f.failure = write_checkpoint_agreed(f.path, writer_comm_, f.image, st);
    } catch (const std::exception& e) {
      local = e.what();
    }
    if (!local.empty()) f.failure = agree_over(writer_comm_, local, "checkpoint '" + f.path + "' was not written");
    if (f.failure.empty())
      f.failure = agree_over(writer_comm_, publish(f.path),
                             "checkpoint '" + f.path + "' was written but `latest` could not be pointed at it");
    f.seconds = now() - t0;
  });
  record["checkpoint"] = {{"path", path}, {"async", true}, {"snapshot_s", copied}};
  if (root)
    std::cout << "checkpoint: " << path << ": the state copied to host memory in " << copied
              << " s; writing it in the background" << why << std::endl;
}

void Checkpointing::wait_for_write(nlohmann::json* record) {
  if (!in_flight_) return;
  const double t0 = now();
  in_flight_->thread.join();
  const std::unique_ptr<InFlight> f = std::move(in_flight_);
  if (!f->failure.empty()) throw AgreedFailure(f->failure);
  last_good_ = f->path;
  if (record) (*record)["checkpoint_wait_s"] = now() - t0;
  count_write(f->path, f->seconds, record, (" in the background" + f->why).c_str());
}

std::string Checkpointing::publish(const std::string& path) {
  if (world_rank() != 0) return "";
  try {
    // `latest` is replaced atomically, and only now that the file it names is complete.
    write_file_atomic(dir_ + "/latest", fs::path(path).filename().string() + "\n");
  } catch (const WriteError& e) {
    return e.what();
  }
  // Older checkpoints go only after a newer one is complete and named by `latest`.
  std::vector<std::string> all;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir_, ec)) {
    const std::string f = e.path().filename().string();
    if (is_checkpoint_file(f)) all.push_back(f);
  }
  std::sort(all.begin(), all.end());
  for (std::size_t i = 0; i + keep_ < all.size(); ++i) fs::remove(dir_ + "/" + all[i], ec);
  return "";
}

void Checkpointing::count_write(const std::string& path, double seconds, nlohmann::json* record, const char* why) {
  std::error_code ec;
  const double bytes = static_cast<double>(fs::file_size(path, ec));
  save_seconds_ += seconds;
  save_bytes_ += bytes;
  ++saves_;
  if (record)
    (*record)[async_ ? "checkpoint_written" : "checkpoint"] = {
        {"path", path}, {"bytes", bytes}, {"write_s", seconds}, {"mb_per_s", bytes / 1e6 / seconds}};
  if (world_rank() == 0)
    std::cout << "checkpoint: " << path << " (" << bytes / 1e6 << " MB in " << seconds << " s, "
              << bytes / 1e6 / seconds << " MB/s)" << why << std::endl;
}

std::pair<std::int64_t, std::string> Checkpointing::roll_back(std::int64_t steps_done, nlohmann::json* record) {
  wait_for_write(record);  // the last checkpoint may be the one being written
  const std::string path = last_good_;
  CheckpointState st;
  run_agreed([&] { st = load_checkpoint(path, *s_.grid, *s_.model, s_.engine->optimizer(), s_.checkpoint_parts); });
  if (st.step > steps_done)
    throw AgreedFailure("rollback: checkpoint '" + path + "' is at step " + std::to_string(st.step) +
                        ", after the spike at step " + std::to_string(steps_done));
  s_.data_offset = st.data_step - st.step;
  return {st.step, path};
}

nlohmann::json Checkpointing::summary() const {
  nlohmann::json j = {{"dir", dir_}, {"saves", saves_}, {"write_s", save_seconds_}, {"write_bytes", save_bytes_}};
  if (async_) {
    j["async"] = true;
    j["snapshot_s"] = snapshot_seconds_;  // what the training waited for; write_s went on beside it
  }
  if (last_saved_ >= 0) j["last_saved_step"] = last_saved_;
  if (save_seconds_ > 0) j["write_mb_per_s"] = save_bytes_ / 1e6 / save_seconds_;
  if (load_seconds_ > 0) {
    j["resumed_from"] = resume_path_;
    j["read_s"] = load_seconds_;
    j["read_bytes"] = load_bytes_;
    j["read_mb_per_s"] = load_bytes_ / 1e6 / load_seconds_;
  }
  return j;
}

bool is_checkpoint_file(const std::string& f) {
  return f.rfind("ckpt-", 0) == 0 && f.size() > 3 && f.compare(f.size() - 3, 3, ".h5") == 0;
}

bool is_unfinished_checkpoint(const std::string& f) {
  return f.rfind("ckpt-", 0) == 0 && f.size() > 4 && f.compare(f.size() - 4, 4, ".tmp") == 0;
}

}  // namespace loom
