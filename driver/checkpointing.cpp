#include "driver/checkpointing.hpp"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <vector>

#include "core/error.hpp"
#include "io/checkpoint.hpp"

namespace fs = std::filesystem;

namespace loom {
namespace {

volatile std::sig_atomic_t g_sigterm = 0;
extern "C" void on_sigterm(int) { g_sigterm = 1; }

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

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

}  // namespace

Checkpointing::Checkpointing(Session& session) : s_(session) {
  dir_ = s_.deck.get_string("checkpoint.dir");
  if (dir_.empty()) dir_ = s_.run_dir + "/checkpoints";
  every_ = s_.deck.get_int("checkpoint.every");
  keep_ = s_.deck.get_int("checkpoint.keep");
  resume_ = s_.deck.get_string("checkpoint.resume");
  std::signal(SIGTERM, on_sigterm);
}

std::int64_t Checkpointing::resume() {
  if (resume_.empty()) return 0;
  std::string path;
  run_agreed([&] {
    if (resume_ != "latest") {
      path = resume_;
      return;
    }
    const std::string pointer = dir_ + "/latest";
    std::ifstream in(pointer);
    if (!in)
      throw InputError("checkpoint.resume = latest, but " + quote_value(pointer) +
                       " does not exist (no checkpoint was completed in checkpoint.dir = " + escape_value(dir_) + ")");
    std::string name;
    std::getline(in, name);
    if (name.empty())
      throw InputError(quote_value(pointer) + " is empty: it should name a checkpoint file in " + escape_value(dir_));
    path = dir_ + "/" + name;
  });
  CheckpointState st;
  const double t0 = now();
  run_agreed([&] { st = load_checkpoint(path, *s_.grid, *s_.model, s_.engine->optimizer()); });
  load_seconds_ = now() - t0;
  std::error_code ec;
  load_bytes_ = static_cast<double>(fs::file_size(path, ec));
  if (st.step >= s_.steps)
    throw DeckError("checkpoint " + quote_value(path) + " is at step " + std::to_string(st.step) + ", and train.steps = " +
                    std::to_string(s_.steps) + ": nothing left to train (raise train.steps)");
  if (world_rank() == 0)
    std::cout << "resumed from " << path << " at step " << st.step << " (written by dp " << st.layout.dp << " x tp "
              << st.layout.tp << " x pp " << st.layout.pp << "; read " << load_bytes_ / 1e6 << " MB in "
              << load_seconds_ << " s)" << std::endl;
  return st.step;
}

bool Checkpointing::after_step(std::int64_t steps_done, nlohmann::json& record) {
  int stop = g_sigterm ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &stop, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);  // any rank signalled: all save
  const bool due = every_ > 0 && steps_done % every_ == 0;
  if (!due && !stop) return false;
  const double t0 = now();
  const std::string path = save(steps_done);
  const double dt = now() - t0;
  std::error_code ec;
  const double bytes = static_cast<double>(fs::file_size(path, ec));
  save_seconds_ += dt;
  save_bytes_ += bytes;
  ++saves_;
  record["checkpoint"] = {{"path", path}, {"bytes", bytes}, {"write_s", dt}, {"mb_per_s", bytes / 1e6 / dt}};
  if (world_rank() == 0) {
    std::cout << "checkpoint: " << path << " (" << bytes / 1e6 << " MB in " << dt << " s, " << bytes / 1e6 / dt
              << " MB/s)" << (stop ? " on SIGTERM; stopping" : "") << std::endl;
  }
  return stop != 0;
}

std::string Checkpointing::save(std::int64_t steps_done) {
  const bool root = world_rank() == 0;
  if (root) {
    std::error_code ec;
    fs::create_directories(dir_, ec);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const std::string name = checkpoint_name(steps_done);
  const std::string path = dir_ + "/" + name;
  CheckpointState st;
  st.step = steps_done;
  st.optimizer_steps = s_.engine->optimizer().steps_taken();
  st.seed = s_.seed;
  st.deck = s_.deck.resolved_text();
  st.layout = s_.layout;
  save_checkpoint(path, *s_.grid, *s_.model, s_.engine->optimizer(), st);
  if (root) {
    // `latest` is replaced atomically, and only now that the file it names is complete.
    const std::string tmp = dir_ + "/latest.tmp";
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << name << "\n";
    }
    std::rename(tmp.c_str(), (dir_ + "/latest").c_str());
    // Older checkpoints go only after a newer one is complete.
    std::vector<std::string> all;
    for (const auto& e : fs::directory_iterator(dir_)) {
      const std::string f = e.path().filename().string();
      if (f.rfind("ckpt-", 0) == 0 && e.path().extension() == ".h5") all.push_back(f);
    }
    std::sort(all.begin(), all.end());
    for (std::size_t i = 0; i + keep_ < all.size(); ++i) fs::remove(dir_ + "/" + all[i]);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  return path;
}

nlohmann::json Checkpointing::summary() const {
  nlohmann::json j = {{"dir", dir_}, {"saves", saves_}, {"write_s", save_seconds_}, {"write_bytes", save_bytes_}};
  if (save_seconds_ > 0) j["write_mb_per_s"] = save_bytes_ / 1e6 / save_seconds_;
  if (load_seconds_ > 0) {
    j["read_s"] = load_seconds_;
    j["read_bytes"] = load_bytes_;
    j["read_mb_per_s"] = load_bytes_ / 1e6 / load_seconds_;
  }
  return j;
}

}  // namespace loom
