#include "driver/run_dir.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/base/error.hpp"

namespace fs = std::filesystem;

namespace loom {

void throw_write_error(const std::string& path, const std::string& what, int err) {
  throw WriteError("cannot " + what + " '" + path + "': " + std::strerror(err));
}

namespace {

std::string read_small_file(const std::string& path) {
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  return text.size() > 200 ? text.substr(0, 200) + "..." : text;
}

std::string holder_line() {
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  const std::time_t t = std::time(nullptr);
  char when[32];
  std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return "host " + std::string(host) + " pid " + std::to_string(getpid()) + " since " + when;
}

// Writes all of `text` to `fd`; returns 0 or errno.
int write_all(int fd, const std::string& text) {
  const char* p = text.data();
  std::size_t left = text.size();
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    p += n;
    left -= static_cast<std::size_t>(n);
  }
  return 0;
}

}  // namespace

DirLock::DirLock(const std::string& dir, const std::string& key) : dir_(dir), lock_file_(dir + "/loom.lock") {
  std::error_code ec;
  if (!fs::exists(dir_, ec)) {
    fs::create_directories(dir_, ec);
    if (ec) throw InputError(key + " = '" + dir_ + "': cannot create the directory (" + ec.message() + ")");
    created_ = true;
  }
  if (!fs::is_directory(dir_, ec)) throw InputError(key + " = '" + dir_ + "' exists and is not a directory");
  fd_ = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd_ < 0) throw InputError(key + " = '" + dir_ + "': cannot open the directory (" + std::strerror(errno) + ")");
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    if (err == EWOULDBLOCK) {
      const std::string holder = read_small_file(lock_file_);
      throw InputError(key + " = '" + dir_ + "' is in use by another loom run (" +
                       (holder.empty() ? std::string("its lock file is not written yet") : holder) +
                       "); one run at a time per directory: wait for it, or choose another " + key);
    }
    throw InputError(key + " = '" + dir_ + "': cannot lock the directory (" + std::strerror(err) + ")");
  }
  // Only the holder writes the lock file, so a refused run never touches it.
  const int lf = ::open(lock_file_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const int err = lf < 0 ? errno : write_all(lf, holder_line() + "\n");
  if (lf >= 0) ::close(lf);
  if (err != 0) {
    abandon();
    throw InputError(key + " = '" + dir_ + "' is not writable: cannot write " + lock_file_ + " (" + std::strerror(err) +
                     ")");
  }
}

void refuse_if_held(const std::string& dir, const std::string& key, const std::string& mine) {
  std::error_code ec;
  for (fs::path p = fs::weakly_canonical(dir, ec); !p.empty(); p = p.parent_path()) {
    if (p.string() != mine && fs::exists(p / "loom.lock", ec)) {
      const int fd = ::open(p.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      if (fd >= 0) {
        const bool held = ::flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
        ::close(fd);  // releases the probe
        if (held) {
          const std::string holder = read_small_file((p / "loom.lock").string());
          throw InputError(
              key + " = '" + dir + "' " +
              (p == fs::weakly_canonical(dir, ec) ? std::string("is") : "lies inside '" + p.string() + "', which is") +
              " in use by another loom run (" + (holder.empty() ? "its lock file is not written yet" : holder) +
              "); one run at a time per directory: wait for it, or choose another " + key);
        }
      }
    }
    if (p == p.parent_path()) break;
  }
}

void DirLock::abandon() {
  if (fd_ < 0) return;
  ::unlink(lock_file_.c_str());
  ::close(fd_);  // releases the flock
  fd_ = -1;
  std::error_code ec;
  if (created_ && fs::is_empty(dir_, ec)) fs::remove(dir_, ec);
}

DirLock::~DirLock() {
  if (fd_ < 0) return;
  ::unlink(lock_file_.c_str());
  ::close(fd_);
}

void write_file_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw_write_error(tmp, "create", errno);
  int err = write_all(fd, text);
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err != 0) {
    ::unlink(tmp.c_str());
    throw_write_error(tmp, "write", err);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    err = errno;
    ::unlink(tmp.c_str());
    throw_write_error(path, "rename " + tmp + " to", err);
  }
}

void write_json_atomic(const std::string& path, const nlohmann::json& value) {
  write_file_atomic(path, value.dump(2) + "\n");
}

namespace {
std::vector<std::string> earlier_results(const std::string& run_dir) {
  std::vector<std::string> found;
  std::error_code ec;
  for (const char* name : {"metrics.jsonl", "summary.json", "report.json"})
    if (std::filesystem::exists(run_dir + "/" + name, ec)) found.push_back(name);
  // run.tensorboard's event files go aside with the rows they repeat.
  std::vector<std::string> events;
  for (const auto& e : std::filesystem::directory_iterator(run_dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("events.out.tfevents.", 0) == 0 && n.find(".earlier") == std::string::npos) events.push_back(n);
  }
  std::sort(events.begin(), events.end());
  found.insert(found.end(), events.begin(), events.end());
  return found;
}
std::string joined(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}
}  // namespace

void refuse_fresh_over_results(const std::string& run_dir, bool overwrite) {
  const auto earlier = earlier_results(run_dir);
  if (overwrite || earlier.empty()) return;
  throw InputError(
      "run.dir = '" + run_dir + "' holds an earlier run's results (" + joined(earlier) +
      ") and no checkpoint to continue it from: a fresh run would replace them. Choose another "
      "run.dir, or set run.overwrite = true (or checkpoint.resume = auto) to move them aside (to *.earlier)");
}

std::vector<std::string> move_results_aside(const std::string& run_dir) {
  const auto earlier = earlier_results(run_dir);
  for (const auto& name : earlier) {
    // NAME.earlier, or NAME.earlier.2, .3, ... when earlier runs were moved aside before: none is replaced.
    const std::string from = run_dir + "/" + name;
    std::string to = from + ".earlier";
    std::error_code ec;
    for (int k = 2; std::filesystem::exists(to, ec); ++k) to = from + ".earlier." + std::to_string(k);
    if (std::rename(from.c_str(), to.c_str()) != 0)
      throw_write_error(to, "move the earlier run's " + name + " to", errno);
  }
  return earlier;
}

void MetricsFile::start(const std::string& path) {
  path_ = path;
  out_ = std::fopen(path.c_str(), "w");
  if (!out_) throw_write_error(path, "create", errno);
}

int MetricsFile::resume(const std::string& path, std::int64_t step) {
  if (out_) std::fclose(out_);  // a rollback continues the file it was writing
  out_ = nullptr;
  path_ = path;
  std::ifstream in(path);
  std::string kept, later, line;
  int set_aside = 0;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    std::int64_t row_step = -1;
    try {
      row_step = nlohmann::json::parse(line).value("step", std::int64_t{-1});
    } catch (const nlohmann::json::exception&) {
      // A row cut by an earlier crash: keep it out of the continued file, but do not lose it.
      row_step = step + 1;
    }
    if (row_step <= step) {
      kept += line + "\n";
    } else {
      later += line + "\n";
      ++set_aside;
    }
  }
  in.close();
  if (set_aside > 0) {
    const std::string aside = path + ".superseded";
    std::FILE* f = std::fopen(aside.c_str(), "a");
    if (!f) throw_write_error(aside, "create", errno);
    const bool ok = std::fwrite(later.data(), 1, later.size(), f) == later.size() && std::fflush(f) == 0;
    const int err = errno;
    std::fclose(f);
    if (!ok) throw_write_error(aside, "write", err);
    write_file_atomic(path, kept);
  }
  out_ = std::fopen(path.c_str(), "a");
  if (!out_) throw_write_error(path, "open for appending", errno);
  return set_aside;
}

void MetricsFile::write(const nlohmann::json& record) {
  const std::string line = record.dump() + "\n";
  if (std::fwrite(line.data(), 1, line.size(), out_) != line.size() || std::fflush(out_) != 0)
    throw_write_error(path_, "write", errno);
}

MetricsFile::~MetricsFile() {
  if (out_) std::fclose(out_);
}

}  // namespace loom
