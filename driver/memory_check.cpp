// Memory checked before the first allocation (driver/memory_check.hpp).
#include "driver/memory_check.hpp"

#include <mpi.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "core/base/error.hpp"
#include "core/base/ledger.hpp"
#include "driver/plan/predict.hpp"

namespace loom {
namespace {

constexpr double kGiB = 1073741824.0;

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

// This process's cgroup memory limit (v2: its own group's memory.max, from /proc/self/cgroup; v1:
// memory.limit_in_bytes), 0 when there is none.
double cgroup_limit(std::string* where) {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("0::", 0) != 0) continue;
    const std::string path = "/sys/fs/cgroup" + line.substr(3) + "/memory.max";
    if (const double b = limit_file(path)) {
      *where = path;
      return b;
    }
  }
  for (const std::string path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"})
    if (const double b = limit_file(path)) {
      *where = path;
      return b;
    }
  return 0;
}

std::string bytes(double b) { return format_bytes(b, ByteStyle::mib_gib); }

// The largest categories of a rank's peak, largest first: "act 3.1 GiB, opt 2.0 GiB, ...".
std::string largest_categories(const std::array<double, kMemCategories>& peak, int count) {
  std::vector<std::pair<double, int>> order;
  for (int i = 0; i < kMemCategories; ++i) order.push_back({peak[static_cast<std::size_t>(i)], i});
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::string s;
  for (int k = 0; k < count && k < static_cast<int>(order.size()) && order[k].first > 0; ++k)
    s += (k ? ", " : "") + std::string(mem_name(static_cast<Mem>(order[k].second))) + " " + bytes(order[k].first);
  return s;
}

}  // namespace

double node_memory_per_rank(int ranks_on_node, std::string* source) {
  const double total = meminfo_total();
  std::string where;
  const double cgroup = cgroup_limit(&where);
  const bool by_cgroup = cgroup > 0 && (total <= 0 || cgroup < total);
  const double node = by_cgroup ? cgroup : total;
  const int ranks = std::max(1, ranks_on_node);
  *source = (by_cgroup ? "the cgroup's limit " + bytes(node) + " (" + where + ")" : "MemTotal " + bytes(node)) +
            (ranks > 1 ? " shared by " + std::to_string(ranks) + " ranks on this node" : " on this node");
  return node / ranks;
}

MemoryVerdict memory_verdict(const Deck& deck, const StrategyRegistry& registry, int ranks_on_node) {
  MemoryVerdict v;
  const std::string backend = deck.get_string("run.backend");
  const double set = deck.get_float("run.memory_limit");
  std::string source;
  if (set > 0) {
    v.limit = set * kGiB;
    source = "run.memory_limit = " + deck.values().at("run.memory_limit") + " GiB";
  } else if (backend == "host" || backend == "fenced") {
    v.limit = node_memory_per_rank(ranks_on_node, &source);
  } else {
    v.text = "memory: not checked before the run (run.backend = " + backend +
             ": a GPU's memory is not known before it is opened; set run.memory_limit to check it)";
    return v;
  }
  const Prediction p = predict_memory(deck, registry, backend == "cuda" ? "cuda" : "host", std::max(1, ranks_on_node));
  v.checked = true;
  v.need = p.peak_total;
  v.fits = v.need <= v.limit;
  v.text = "memory: the largest rank (" + std::to_string(p.worst_rank) + ") needs " + bytes(v.need) + " (" +
           largest_categories(p.peak, 3) + ") of the " + bytes(v.limit) + " a rank may use (" + source +
           "): " + (v.fits ? "fits" : "out of memory by " + bytes(v.need - v.limit));
  return v;
}

void refuse_if_out_of_memory(const Deck& deck, const StrategyRegistry& registry, int ranks_on_node) {
  const MemoryVerdict v = memory_verdict(deck, registry, ranks_on_node);
  if (v.fits) return;
  const int devices = plan_layout(deck, registry, -1).layout.ranks();
  char gib[32];
  std::snprintf(gib, sizeof gib, "%.2f", v.limit / kGiB);
  throw InputError(v.text + ". `loom plan " + deck.path() + " --devices " + std::to_string(devices) +
                   " --set cluster.device_memory_gib=" + gib +
                   "` (with this run's other --set options) searches the layouts of " + std::to_string(devices) +
                   (devices == 1 ? " device" : " devices") +
                   " for one that fits; run.memory_limit (GiB) sets the limit");
}

int ranks_on_this_node() {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm local;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local);
  MPI_Comm_size(local, &size);
  MPI_Comm_free(&local);
  return size;
}

}  // namespace loom
