// Memory checked before the first allocation (driver/memory_check.hpp).
#include "driver/memory_check.hpp"

#include <fcntl.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "core/base/error.hpp"
#include "core/base/ledger.hpp"
#include "driver/plan/predict.hpp"

namespace loom {
namespace {

constexpr double kGiB = 1073741824.0;

}  // namespace

double meminfo_total() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  double kib = 0;
  while (in >> key) {
    if (key == "MemTotal:") {
      in >> kib;
      break;
    }
    std::getline(in, key);
  }
  return kib * 1024.0;
}

namespace {

// A cgroup memory limit file: bytes, or 0 for none ("max", unreadable, or v1's "no limit", 2^63 rounded
// to pages).
double limit_file(const std::string& path) {
  std::ifstream in(path);
  std::string v;
  if (!(in >> v) || v == "max") return 0;
  try {
    const double b = std::stod(v);
    return b > 0 && b < 1e18 ? b : 0;
  } catch (const std::exception&) {
    return 0;
  }
}

// The least limit of `file` in the group `group` (a path under `root`) and every group above it: a
// batch system sets it on the job's group, while the task runs in a group below without one.
double least_limit_upwards(const std::string& root, std::string group, const std::string& file, std::string* where) {
  double least = 0;
  while (true) {
    const std::string path = root + (group == "/" ? "" : group) + "/" + file;
    const double b = limit_file(path);
    if (b > 0 && (least == 0 || b < least)) {
      least = b;
      *where = path;
    }
    if (group.empty() || group == "/") break;
    const std::size_t slash = group.rfind('/');
    group = slash == 0 || slash == std::string::npos ? "/" : group.substr(0, slash);
  }
  return least;
}

// This process's cgroup memory limit, 0 when there is none: v2, the least memory.max from its own
// group up (/proc/self/cgroup's "0::PATH"); v1, the least memory.limit_in_bytes of the memory
// controller's group up.
double cgroup_limit(std::string* where) {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  double least = 0;
  while (std::getline(in, line)) {
    const std::size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), group = line.substr(b + 1);
    std::string at;
    double found = 0;
    if (controllers.empty())  // v2
      found = least_limit_upwards("/sys/fs/cgroup", group, "memory.max", &at);
    else if (("," + controllers + ",").find(",memory,") != std::string::npos)  // v1
      found = least_limit_upwards("/sys/fs/cgroup/memory", group, "memory.limit_in_bytes", &at);
    if (found > 0 && (least == 0 || found < least)) {
      least = found;
      *where = at;
    }
  }
  return least;
}

std::string bytes(double b) { return format_bytes(b, ByteStyle::mib_gib); }

// The largest categories of a rank's peak, largest first: "activations 3.1 GiB, optimizer 2.0 GiB".
std::string largest_categories(const std::array<double, kMemCategories>& peak, int count) {
  std::vector<std::pair<double, int>> order;
  for (int i = 0; i < kMemCategories; ++i) order.push_back({peak[static_cast<std::size_t>(i)], i});
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::string s;
  for (int k = 0; k < count && k < static_cast<int>(order.size()) && order[k].first > 0; ++k)
    s += (k ? ", " : "") + std::string(mem_name(static_cast<Mem>(order[k].second))) + " " + bytes(order[k].first);
  return s;
}

// Standard output closed while the strategies are built for the prediction: what they print as a run
// starts (a notice about ignored keys) belongs to the run's own set-up, said once.
class QuietStdout {
 public:
  QuietStdout() {
    std::cout.flush();
    std::fflush(stdout);
    saved_ = ::dup(1);
    const int null = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (saved_ >= 0 && null >= 0) ::dup2(null, 1);
    if (null >= 0) ::close(null);
  }
  ~QuietStdout() {
    std::cout.flush();
    std::fflush(stdout);
    if (saved_ >= 0) {
      ::dup2(saved_, 1);
      ::close(saved_);
    }
  }
  QuietStdout(const QuietStdout&) = delete;
  QuietStdout& operator=(const QuietStdout&) = delete;

 private:
  int saved_ = -1;
};

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (std::size_t i = 0; i < ranks.size() && i < 8; ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return ranks.size() > 8 ? s + ", ..." : s;
}

}  // namespace

double node_memory(std::string* source) {
  const double total = meminfo_total();
  std::string where;
  const double cgroup = cgroup_limit(&where);
  const bool by_cgroup = cgroup > 0 && (total <= 0 || cgroup < total);
  const double node = by_cgroup ? cgroup : total;
  *source = by_cgroup ? "the cgroup's limit, " + where : "MemTotal";
  return node;
}

MemoryVerdict memory_verdict(const Deck& deck, const StrategyRegistry& registry, const std::vector<int>& node_ranks) {
  MemoryVerdict v;
  const std::string backend = deck.get_string("run.backend");
  const double set = deck.get_float("run.memory_limit");
  const bool host = backend == "host" || backend == "fenced";
  if (set <= 0 && !host) {
    v.text = "memory: not checked here (run.backend = " + backend +
             ": a GPU's memory is known once the run opens it, and the run checks it then, before its first "
             "allocation; set run.memory_limit to check it here)";
    return v;
  }
  std::string source;
  const double node = set > 0 ? 0 : node_memory(&source);
  if (set <= 0 && node <= 0) {
    v.text = "memory: not checked before the run (this node's memory could not be read; set run.memory_limit)";
    return v;
  }
  const std::vector<int> ranks = node_ranks.empty() ? std::vector<int>{0} : node_ranks;
  Prediction p;
  {
    QuietStdout quiet;
    p = predict_memory(deck, registry, backend == "cuda" ? "cuda" : "host", static_cast<int>(ranks.size()), ranks);
  }
  if (p.ranks.empty()) return v;
  v.checked = true;
  const std::string sized = backend == "auto" ? ", sized as a host run" : "";
  const std::string largest =
      "rank " + std::to_string(p.worst_rank) + " " + bytes(p.peak_total) + ": " + largest_categories(p.worst().peak, 3);
  if (set > 0) {  // per rank
    v.need = p.peak_total;
    v.limit = v.per_rank = set * kGiB;
    v.text = "memory: the largest rank here (" + largest + ") of the " + bytes(v.limit) +
             " a rank may use (run.memory_limit = " + deck.values().at("run.memory_limit") + " GiB" + sized + ")";
  } else {  // the ranks placed on this node share it
    for (const RankPrediction& r : p.ranks) v.need += r.total;
    v.limit = node;
    v.per_rank = node / static_cast<double>(ranks.size());
    v.text =
        "memory: " +
        (p.ranks.size() == 1 ? "rank " + std::to_string(p.ranks.front().rank) + " needs " + bytes(v.need) + " (" +
                                   largest_categories(p.worst().peak, 3) + ")"
                             : "the " + std::to_string(p.ranks.size()) + " ranks on this node (" + rank_list(ranks) +
                                   ") need " + bytes(v.need) + " (the largest, " + largest + ")") +
        " of the " + bytes(v.limit) + " this node has (" + source + ")";
  }
  v.fits = v.need <= v.limit;
  v.text += v.fits ? ": fits" : ": out of memory by " + bytes(v.need - v.limit);
  return v;
}

void throw_if_out_of_memory(const Deck& deck, const StrategyRegistry& registry, const MemoryVerdict& v) {
  if (v.fits) return;
  const int devices = plan_layout(deck, registry, -1).layout.ranks();
  // What one device may hold, for loom plan's search: rounded down, so that the plan does not promise more.
  char gib[32];
  std::snprintf(gib, sizeof gib, "%.3f", std::max(0.001, std::floor(v.per_rank / kGiB * 1000) / 1000));
  throw InputError(v.text + ". `loom plan " + deck.path() + " --devices " + std::to_string(devices) +
                   " --set cluster.device_memory_gib=" + gib + "` (with this run's other --set options) searches the " +
                   "layouts of " + std::to_string(devices) + (devices == 1 ? " device" : " devices") +
                   " for one that fits; run.memory_limit (GiB per rank) sets the limit");
}

std::vector<int> ranks_on_this_node() {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm local;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local);
  MPI_Comm_size(local, &size);
  std::vector<int> ranks(static_cast<std::size_t>(size));
  MPI_Allgather(&rank, 1, MPI_INT, ranks.data(), 1, MPI_INT, local);
  MPI_Comm_free(&local);
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}

std::vector<int> ranks_on_device(int device) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm local, same;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local);
  MPI_Comm_split(local, device < 0 ? MPI_UNDEFINED : device, rank, &same);
  std::vector<int> ranks;
  if (same != MPI_COMM_NULL) {
    MPI_Comm_size(same, &size);
    ranks.resize(static_cast<std::size_t>(size));
    MPI_Allgather(&rank, 1, MPI_INT, ranks.data(), 1, MPI_INT, same);
    MPI_Comm_free(&same);
  }
  MPI_Comm_free(&local);
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}

MemoryVerdict device_memory_verdict(const Deck& deck, const StrategyRegistry& registry, int device, double free,
                                    double total, const std::vector<int>& device_ranks) {
  MemoryVerdict v;
  const std::string where = "CUDA device " + std::to_string(device);
  if (free <= 0 || device_ranks.empty()) {
    v.text = "memory: not checked (" + where + " did not say how much memory it has; set run.memory_limit)";
    return v;
  }
  Prediction p;
  {
    QuietStdout quiet;
    p = predict_memory(deck, registry, "cuda", static_cast<int>(device_ranks.size()), device_ranks);
  }
  if (p.ranks.empty()) return v;
  v.checked = true;
  for (const RankPrediction& r : p.ranks) v.need += r.total;
  v.limit = free;
  v.per_rank = free / static_cast<double>(device_ranks.size());
  const std::string largest =
      "rank " + std::to_string(p.worst_rank) + " " + bytes(p.peak_total) + ": " + largest_categories(p.worst().peak, 3);
  v.text = "memory: " +
           (p.ranks.size() == 1
                ? "rank " + std::to_string(p.ranks.front().rank) + " needs " + bytes(v.need) + " (" +
                      largest_categories(p.worst().peak, 3) + ")"
                : "the " + std::to_string(p.ranks.size()) + " ranks on " + where + " (" + rank_list(device_ranks) +
                      ") need " + bytes(v.need) + " (the largest, " + largest + ")") +
           " of the " + bytes(free) + " free on " + where + " (of " + bytes(total) + ")";
  v.fits = v.need <= v.limit;
  v.text += v.fits ? ": fits" : ": out of memory by " + bytes(v.need - v.limit);
  return v;
}

}  // namespace loom
