// `loom ckpt verify FILE|DIR`: reads checkpoints whole on one process and says which are intact, before
// a long job is launched to resume from one. For a checkpoint directory it checks every ckpt-*.h5 (and
// the file `latest` names), says whether `latest` names an intact one, and if not which checkpoint
// (the newest intact by its step) to resume from instead.
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "core/base/error.hpp"
#include "driver/checkpointing.hpp"
#include "driver/commands.hpp"
#include "io/checkpoint.hpp"

namespace fs = std::filesystem;

namespace loom {
namespace {

std::string megabytes(std::int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MB", static_cast<double>(bytes) / 1e6);
  return buf;
}

// One line for the file, then a line per problem (without the "checkpoint 'FILE': " each begins with
// when it comes from the reader's own refusal). True when intact.
bool report(const std::string& file, const CheckpointVerdict& v) {
  std::cout << "checkpoint " << quote_path(file) << ": ";
  if (v.step >= 0)
    std::cout << "step " << v.step << ", written at " << v.layout.describe() << ", " << v.tensors << " tensors ("
              << megabytes(v.bytes) << ") read: ";
  if (v.problems.empty()) {
    std::cout << "intact\n";
    return true;
  }
  std::cout << "DAMAGED\n";
  const std::string prefix = "checkpoint " + quote_path(file) + ": ";
  for (const std::string& p : v.problems)
    std::cout << "  " << (p.rfind(prefix, 0) == 0 ? p.substr(prefix.size()) : p) << "\n";
  return false;
}

}  // namespace

int command_ckpt_verify(const std::string& path) {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world != 1) throw InputError("loom ckpt verify runs on one process; launched on " + std::to_string(world));
  std::error_code ec;
  if (!fs::exists(path, ec))
    throw InputError(quote_path(path) + " does not exist: name a checkpoint file or a checkpoint directory");
  // loom's `latest` pointer (a line naming the newest checkpoint) stands for its directory.
  if (!latest_pointer_target(path).empty()) {
    const fs::path given(path);
    const std::string dir = given.parent_path().empty() ? "." : given.parent_path().string();
    std::cout << quote_path(path) << " is the pointer to the newest checkpoint: verifying its directory "
              << quote_path(dir) << "\n";
    return command_ckpt_verify(dir);
  }
  if (!fs::is_directory(path, ec)) return report(path, verify_checkpoint(path)) ? 0 : 1;

  // A directory: its checkpoints, and the writes that never finished (a crash mid-write leaves
  // ckpt-*.h5.tmp; the next save removes it).
  std::vector<std::string> files, unfinished;
  for (fs::directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string f = it->path().filename().string();
    if (is_checkpoint_file(f)) files.push_back(f);
    if (is_unfinished_checkpoint(f)) unfinished.push_back(f);
  }
  if (ec) throw InputError(quote_path(path) + ": cannot be listed (" + ec.message() + ")");
  std::sort(unfinished.begin(), unfinished.end());
  // `latest` may name a file the pattern does not take (a user's own name): verified too.
  std::string latest;
  const bool has_latest = fs::exists(path + "/latest", ec);
  const bool latest_readable = has_latest && fs::is_regular_file(path + "/latest", ec);  // a FIFO would wait
  if (latest_readable) {
    std::ifstream in(path + "/latest");
    std::getline(in, latest);
  }
  if (!latest.empty() && std::find(files.begin(), files.end(), latest) == files.end() &&
      fs::is_regular_file(path + "/" + latest, ec))
    files.push_back(latest);
  if (files.empty())
    throw InputError(quote_path(path) +
                     " holds no checkpoint (ckpt-*.h5): name a checkpoint file or the checkpoint.dir of a run");
  // Oldest first by the step each records (a file whose step cannot be read goes first).
  std::vector<std::pair<std::string, CheckpointVerdict>> checked;
  for (const std::string& f : files) checked.emplace_back(f, verify_checkpoint(path + "/" + f));
  std::stable_sort(checked.begin(), checked.end(),
                   [](const auto& a, const auto& b) { return a.second.step < b.second.step; });
  std::vector<std::string> intact;  // oldest first
  for (const auto& [f, verdict] : checked)
    if (report(path + "/" + f, verdict)) intact.push_back(f);
  for (const std::string& f : unfinished)
    std::cout << quote_path(path + "/" + f) << ": an unfinished write (not a checkpoint; the next save removes it)\n";

  const bool latest_intact = std::find(intact.begin(), intact.end(), latest) != intact.end();
  if (!has_latest)
    std::cout << "latest: none";
  else if (!latest_readable)
    std::cout << "latest: not a regular file (damaged)";
  else if (latest.empty())
    std::cout << "latest: the file is empty (damaged)";
  else if (latest_intact)
    std::cout << "latest: " << latest << ", intact: checkpoint.resume = latest continues from it\n";
  else
    std::cout << "latest: " << latest
              << (std::find(files.begin(), files.end(), latest) != files.end() ? ", which is damaged"
                  : fs::exists(path + "/" + latest, ec)                        ? ", which is not a checkpoint file"
                                                                               : ", which does not exist");
  if (!latest_intact) {
    if (intact.empty())
      std::cout << "; no checkpoint here is intact\n";
    else
      std::cout << "; the newest intact checkpoint is " << intact.back() << ": resume with checkpoint.resume = " << path
                << "/" << intact.back() << "\n";
  }
  std::cout << intact.size() << " of " << files.size() << " checkpoints intact\n";
  return intact.size() == files.size() && latest_intact ? 0 : 1;
}

}  // namespace loom
