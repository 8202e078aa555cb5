#pragma once
// The run directory (DESIGN.md "Runs a user can trust"): one run at a time per directory, and what a
// run writes there goes out whole or not at all.
//
// A run takes an exclusive lock on run.dir (and on checkpoint.dir when that lies elsewhere) before it
// writes anything: flock(2) on the directory itself, so the kernel releases it when the process dies
// however it dies, and `loom.lock` inside names the holder (host, pid, start time) for the refusal
// message of a second run. The lock file is removed when the run ends.
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace loom {

// An I/O failure on a file the run writes: exits with status 1, naming the file and the system's
// reason ("No space left on device", "File too large", ...).
struct WriteError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// "cannot write 'FILE': REASON" with REASON from errno.
[[noreturn]] void throw_write_error(const std::string& path, const std::string& what, int err);

class DirLock {
 public:
  // Creates `dir` if needed (`key` names the deck key for messages), then locks it. Throws InputError
  // naming the holder when another live process holds it.
  DirLock(const std::string& dir, const std::string& key);
  ~DirLock();
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;
  // Unlocks and, when this lock created the directory and it is still empty, removes it: a refused
  // run leaves nothing behind.
  void abandon();

 private:
  std::string dir_, lock_file_;
  int fd_ = -1;
  bool created_ = false;
};

// Refuses (InputError naming `key` and the holder) when another process holds the lock of `dir` or of
// any directory above it that holds a loom.lock (a running loom's run.dir or checkpoint.dir), `mine`
// (a canonical path this run holds itself) excepted: a checkpoint.dir inside another run's directory
// would share its `latest` and its keep rotation. A probe (a shared flock, released at once), for
// directories this run does not lock itself and for `loom check`.
void refuse_if_held(const std::string& dir, const std::string& key, const std::string& mine = "");

// A fresh run (no checkpoint to continue) into a run.dir holding an earlier run's results
// (metrics.jsonl, summary.json, report.json) would replace them: refused naming them, unless
// `overwrite` (run.overwrite, or checkpoint.resume = auto: a job of a chain that found nothing to
// continue), with which the run moves them aside (move_results_aside).
void refuse_fresh_over_results(const std::string& run_dir, bool overwrite);
// Renames each of those files to NAME.earlier (NAME.earlier.2, ... when that exists: nothing is
// replaced); returns the names moved.
std::vector<std::string> move_results_aside(const std::string& run_dir);

// `path` written as `path`.tmp, flushed and synced, then renamed over `path`: readers see the old
// file or the new one, never a part. Throws WriteError.
void write_file_atomic(const std::string& path, const std::string& text);
void write_json_atomic(const std::string& path, const nlohmann::json& value);

// metrics.jsonl: one JSON object per logged step, each line written whole and checked.
class MetricsFile {
 public:
  // A fresh run: starts the file empty.
  void start(const std::string& path);
  // A resumed run: keeps the rows up to `step` and appends after them; rows past it (from a run that
  // went further before it was resumed from an earlier checkpoint) move to `path` with the suffix
  // ".superseded" (appended), so nothing is lost. Returns how many rows were set aside. Also after a
  // rollback (train.on_spike), on the file being written.
  int resume(const std::string& path, std::int64_t step);
  void write(const nlohmann::json& record);
  ~MetricsFile();

 private:
  std::string path_;
  std::FILE* out_ = nullptr;
};

}  // namespace loom
