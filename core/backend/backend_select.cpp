// run.backend: the host back end, or the CUDA back end loaded from libloom_cuda.so.
#include "core/backend/backend_select.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include <filesystem>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/base/error.hpp"
#include "core/base/search_path.hpp"
#include "loom/build_info.hpp"

namespace loom {
namespace fs = std::filesystem;

bool cuda_built() { return build::cuda; }

namespace {

// The devices of a node, each counted once however many of its ranks see it.
int distinct_devices(const std::vector<DeviceIds>& seen) {
  std::set<std::string> all;
  for (const DeviceIds& ids : seen) all.insert(ids.begin(), ids.end());
  return static_cast<int>(all.size());
}

// A device for every rank where one exists (a maximum matching of ranks to the devices they see):
// each rank, in local-rank order, takes the first free device it sees, and where none is free, one
// that an earlier rank can give up for another it sees (an augmenting path). Where every rank sees
// every device, rank i takes device i. Per rank, the device's ordinal in that rank's list; -1: none.
struct DeviceMatching {
  const std::vector<DeviceIds>& seen;
  std::map<std::string, int> owner;  // device -> local rank
  std::set<std::string> visited;
  bool place(int q) {
    for (const std::string& d : seen[static_cast<std::size_t>(q)])
      if (!owner.count(d)) return owner[d] = q, true;
    for (const std::string& d : seen[static_cast<std::size_t>(q)]) {
      if (!visited.insert(d).second) continue;
      if (place(owner[d])) return owner[d] = q, true;
    }
    return false;
  }
  std::vector<int> ordinals() {
    for (int q = 0; q < static_cast<int>(seen.size()); ++q) {
      visited.clear();
      place(q);
    }
    std::vector<int> ordinal(seen.size(), -1);
    for (const auto& [d, q] : owner) {
      const DeviceIds& mine = seen[static_cast<std::size_t>(q)];
      ordinal[static_cast<std::size_t>(q)] = static_cast<int>(std::find(mine.begin(), mine.end(), d) - mine.begin());
    }
    return ordinal;
  }
};

}  // namespace

int device_for_local_rank(int local_rank, const std::vector<DeviceIds>& seen, const std::string& why_none, bool share) {
  const int ranks = static_cast<int>(seen.size());
  if (local_rank < 0 || local_rank >= ranks)
    throw std::logic_error("device_for_local_rank: local rank " + std::to_string(local_rank) + " of " +
                           std::to_string(ranks));
  if (seen[static_cast<std::size_t>(local_rank)].empty())
    throw InputError("run.backend = cuda: no CUDA device is visible on this node" +
                     (why_none.empty() ? std::string() : " (" + why_none + ")") +
                     "; valid here: run.backend = host (or auto, which takes the host when there is no GPU)");
  // Every rank computes the whole node's assignment from the same lists, so all agree on a refusal.
  const std::vector<int> ordinal = DeviceMatching{seen, {}, {}}.ordinals();
  const int without = static_cast<int>(std::find(ordinal.begin(), ordinal.end(), -1) - ordinal.begin());
  const int devices = distinct_devices(seen);
  if (without < ranks && !share) {
    if (devices < ranks)
      throw InputError("run.backend = cuda: " + std::to_string(ranks) + " ranks on this node but " +
                       std::to_string(devices) + " CUDA device" + (devices == 1 ? "" : "s") +
                       " (one device per rank); start at most " + std::to_string(devices) +
                       " ranks per node, or run.backend = host (run.share_gpu = true lets ranks share a GPU, "
                       "through host copies: for checks, not speed)");
    throw InputError(
        "run.backend = cuda: the " + std::to_string(ranks) + " ranks of this node see " + std::to_string(devices) +
        " CUDA devices in all, but not so that each can drive one of its "
        "own (local rank " +
        std::to_string(without) + " sees " + std::to_string(seen[static_cast<std::size_t>(without)].size()) +
        "); let every rank see every device, or give each rank its own (the scheduler's one GPU per "
        "task), or run.share_gpu = true");
  }
  const int mine = ordinal[static_cast<std::size_t>(local_rank)];
  if (mine >= 0) return mine;
  return local_rank % static_cast<int>(seen[static_cast<std::size_t>(local_rank)].size());  // run.share_gpu
}

int device_for_local_rank(int local_rank, int ranks_per_node, int device_count, const std::string& why_none,
                          bool share) {
  DeviceIds all;
  for (int d = 0; d < device_count; ++d) all.push_back(std::to_string(d));
  return device_for_local_rank(
      local_rank, std::vector<DeviceIds>(static_cast<std::size_t>(std::max(ranks_per_node, 0)), all), why_none, share);
}

namespace {

// libloom_cuda.so, opened once per process.
struct CudaLibrary {
  bool loaded = false;
  std::string path;
  std::string why_not;  // why it is not loaded
  loom_cuda_device_count_fn device_count = nullptr;
  loom_cuda_device_uuids_fn device_uuids = nullptr;
  loom_cuda_create_fn create = nullptr;
  loom_cuda_device_memory_fn device_memory = nullptr;
};

const CudaLibrary& cuda_library() {
  static CudaLibrary lib;
  static std::once_flag once;
  std::call_once(once, [] {
    // Opens the library at p and checks its entry points and ABI; false (why_not set) if not.
    // `named`: p came from LOOM_CUDA_BACKEND_LIBRARY, so the messages name that variable.
    const auto open = [](const std::string& p, bool named) {
      const std::string what = named ? "LOOM_CUDA_BACKEND_LIBRARY = " + p : p;
      std::error_code ec;
      if (fs::is_directory(p, ec)) {
        lib.why_not = what + " is a directory (name the back end's library file: " LOOM_CUDA_LIBRARY
                             ", or the emulated device's libloom_cuda_emu.so)";
        return false;
      }
      void* h = dlopen(p.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (!h) {
        lib.why_not =
            what + " cannot be loaded: " + dlerror() +
            (named ? std::string(" (it should name " LOOM_CUDA_LIBRARY " or libloom_cuda_emu.so of this loom's "
                                 "build; " LOOM_CUDA_LIBRARY " also needs the CUDA runtime libraries, cuBLAS "
                                 "and cuBLASLt)")
                   : std::string(" (the CUDA runtime libraries, cuBLAS and cuBLASLt, must be installed on this "
                                 "node)"));
        return false;
      }
      const auto abi = reinterpret_cast<loom_cuda_abi_fn>(dlsym(h, "loom_cuda_abi"));
      lib.device_count = reinterpret_cast<loom_cuda_device_count_fn>(dlsym(h, "loom_cuda_device_count"));
      lib.device_uuids = reinterpret_cast<loom_cuda_device_uuids_fn>(dlsym(h, "loom_cuda_device_uuids"));
      lib.create = reinterpret_cast<loom_cuda_create_fn>(dlsym(h, "loom_cuda_create"));
      lib.device_memory = reinterpret_cast<loom_cuda_device_memory_fn>(dlsym(h, "loom_cuda_device_memory"));
      if (!abi || !lib.device_count || !lib.create) {
        lib.why_not =
            what + " lacks the entry points loom_cuda_abi, loom_cuda_device_count, loom_cuda_create" +
            (named ? " (it is not a loom CUDA back end: name " LOOM_CUDA_LIBRARY " or libloom_cuda_emu.so)" : "");
        return false;
      }
      if (abi() != LOOM_CUDA_ABI_VERSION) {
        lib.why_not = what + " was built for CUDA back-end ABI " + std::to_string(abi()) + ", this loom has " +
                      std::to_string(LOOM_CUDA_ABI_VERSION) + ": rebuild it with this loom";
        return false;
      }
      if (!lib.device_uuids || !lib.device_memory) {
        lib.why_not = what +
                      " lacks the entry points loom_cuda_device_uuids and loom_cuda_device_memory of its ABI: "
                      "rebuild it with this loom";
        return false;
      }
      lib.loaded = true;
      lib.path = p;
      return true;
    };
    // A named back-end library (the emulated device's, libloom_cuda_emu.so, for checks without a
    // GPU) in place of the one beside the plugins, whether or not this loom was built with CUDA.
    if (const char* named = std::getenv("LOOM_CUDA_BACKEND_LIBRARY"); named && *named) {
      std::error_code ec;
      if (!fs::exists(named, ec))
        lib.why_not = std::string("LOOM_CUDA_BACKEND_LIBRARY = ") + named + " does not exist";
      else
        open(fs::absolute(named).string(), true);  // dlopen searches the library path for a bare name
      return;
    }
    if (!build::cuda) {
      lib.why_not =
          "this loom was built without the CUDA back end (LOOM_ENABLE_CUDA=OFF, or nvcc was not found "
          "when it was configured)";
      return;
    }
    std::string tried;
    for (const std::string& dir : plugin_search_path()) {
      const fs::path p = fs::path(dir) / LOOM_CUDA_LIBRARY;
      std::error_code ec;
      if (!fs::exists(p, ec)) continue;
      open(p.string(), false);
      return;
    }
    for (const std::string& dir : plugin_search_path()) tried += (tried.empty() ? "" : ":") + dir;
    lib.why_not = std::string(LOOM_CUDA_LIBRARY) + " was not found (searched LOOM_PLUGIN_PATH, then " + tried + ")";
  });
  return lib;
}

}  // namespace

namespace {
bool lib_device_memory(int device, std::size_t* free_b, std::size_t* total_b) {
  const CudaLibrary& lib = cuda_library();
  return lib.loaded && lib.device_memory && lib.device_memory(device, free_b, total_b) == 0;
}
}  // namespace

int tf32_mode(const std::string& setting) {
  if (setting == "false") return 0;
  if (setting == "true") return 1;
  if (setting == "auto") return 2;
  throw InputError("run.tf32 = '" + setting + "': valid values are auto, true, false");
}

namespace {

// Every rank of `node` learns the devices each sees, by identity (the UUIDs from the back end's
// library; the ordinals where it gives none), in the order of that rank's ordinals. Collective over
// `node`, whether or not this rank's library loaded.
std::vector<DeviceIds> node_devices(MPI_Comm node, loom_cuda_device_uuids_fn uuids, int visible) {
  constexpr int kMaxDevices = 64, kIdBytes = 16;
  std::vector<unsigned char> mine(static_cast<std::size_t>(kMaxDevices) * kIdBytes, 0);
  int count = uuids ? std::min(uuids(mine.data(), kMaxDevices), kMaxDevices) : 0;
  const bool by_ordinal = count <= 0 && visible > 0;  // no identities: the ordinals stand for them
  if (by_ordinal) count = std::min(visible, kMaxDevices);
  int size = 1;
  MPI_Comm_size(node, &size);
  std::vector<int> counts(static_cast<std::size_t>(size)), ordinal_flags(static_cast<std::size_t>(size));
  int flag = by_ordinal ? 1 : 0;
  MPI_Allgather(&count, 1, MPI_INT, counts.data(), 1, MPI_INT, node);
  MPI_Allgather(&flag, 1, MPI_INT, ordinal_flags.data(), 1, MPI_INT, node);
  std::vector<unsigned char> all(mine.size() * static_cast<std::size_t>(size));
  MPI_Allgather(mine.data(), static_cast<int>(mine.size()), MPI_BYTE, all.data(), static_cast<int>(mine.size()),
                MPI_BYTE, node);
  // Where one rank has no identities, no rank's count: a GPU named by UUID on one rank and by its
  // ordinal on another would pass for two.
  const bool by_ordinals = std::find(ordinal_flags.begin(), ordinal_flags.end(), 1) != ordinal_flags.end();
  std::vector<DeviceIds> seen(static_cast<std::size_t>(size));
  for (int q = 0; q < size; ++q)
    for (int d = 0; d < counts[static_cast<std::size_t>(q)]; ++d) {
      if (by_ordinals) {
        seen[static_cast<std::size_t>(q)].push_back("ordinal " + std::to_string(d));
        continue;
      }
      const unsigned char* id =
          all.data() + mine.size() * static_cast<std::size_t>(q) + static_cast<std::size_t>(d) * kIdBytes;
      char hex[2 * kIdBytes + 1];
      for (int i = 0; i < kIdBytes; ++i) std::snprintf(hex + 2 * i, 3, "%02x", id[i]);
      seen[static_cast<std::size_t>(q)].emplace_back(hex);
    }
  return seen;
}

}  // namespace

std::unique_ptr<Backend> make_backend(const std::string& requested, int threads, const std::string& tf32,
                                      bool share_gpu, MPI_Comm world, BackendChoice* choice) {
  BackendChoice c;
  c.requested = requested;
  if (requested != "host" && requested != "cuda" && requested != "auto" && requested != "fenced")
    throw InputError("run.backend = '" + requested + "': valid values are host, cuda, auto, fenced");
  int local_rank = 0, local_size = 1;
  MPI_Comm node;
  MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  MPI_Comm_rank(node, &local_rank);
  MPI_Comm_size(node, &local_size);
  struct FreeComm {
    MPI_Comm& c;
    ~FreeComm() { MPI_Comm_free(&c); }
  } free_node{node};

  std::unique_ptr<Backend> backend;
  if (requested == "fenced") backend = make_fenced_backend(threads);
  if (requested == "cuda" || requested == "auto") {
    const CudaLibrary& lib = cuda_library();
    char why[512] = {0};
    const int visible = lib.loaded ? lib.device_count(why, sizeof why) : 0;
    const std::string why_none = lib.loaded ? std::string(why) : lib.why_not;
    const std::vector<DeviceIds> seen = node_devices(node, lib.loaded ? lib.device_uuids : nullptr, visible);
    const int devices = distinct_devices(seen);  // on this node, whatever each rank sees of them
    if (requested == "cuda") {
      if (!lib.loaded) throw InputError("run.backend = cuda: " + lib.why_not + "; valid here: run.backend = host");
      c.device = device_for_local_rank(local_rank, seen, why_none, share_gpu);
      backend.reset(lib.create(c.device, tf32_mode(tf32)));
      if (local_size > devices)
        c.reason = std::to_string(local_size) + " ranks share " + std::to_string(devices) + " GPU" +
                   (devices == 1 ? "" : "s") + " (run.share_gpu)";
    } else if (visible > 0 && (local_size <= devices || share_gpu)) {
      // auto takes the GPU when it can, and the host when the GPU cannot be used after all.
      try {
        c.device = device_for_local_rank(local_rank, seen, why_none, share_gpu);
        backend.reset(lib.create(c.device, tf32_mode(tf32)));
        c.reason = "auto: " + std::to_string(visible) + " CUDA device" + (visible == 1 ? "" : "s") + " visible";
      } catch (const std::exception& e) {
        c.device = -1;
        c.reason = std::string("auto: the CUDA device cannot be used (") + e.what() + ")";
      }
    }
    if (requested == "auto") {
      // Every rank computes on one kind of back end: the host for all when one rank cannot use its GPU.
      int all_cuda = backend ? 1 : 0;
      MPI_Allreduce(MPI_IN_PLACE, &all_cuda, 1, MPI_INT, MPI_MIN, world);
      if (!all_cuda && backend) {
        backend.reset();
        c.device = -1;
        c.reason = "auto: another rank cannot use a CUDA device";
      }
    }
    if (requested == "auto" && !backend && c.reason.empty()) {
      c.reason = visible <= 0 ? "auto: no CUDA device (" + why_none + ")"
                              : "auto: " + std::to_string(local_size) + " ranks on this node, " +
                                    std::to_string(devices) + " CUDA device" + (devices == 1 ? "" : "s");
    }
    // A back-end library the user named and that cannot serve is a mistake to say aloud, even where
    // auto goes on on the host (once, from world rank 0).
    const char* named = std::getenv("LOOM_CUDA_BACKEND_LIBRARY");
    int world_rank = 0;
    MPI_Comm_rank(world, &world_rank);
    if (requested == "auto" && !backend && named && *named && world_rank == 0)
      std::cerr << "loom: warning: run.backend = auto trains on the host: " << c.reason.substr(6)
                << " (LOOM_CUDA_BACKEND_LIBRARY is set)" << std::endl;
  }
  if (!backend) backend = make_host_backend(threads);
  c.name = backend->name();
  std::size_t free_b = 0, total_b = 0;
  if (c.name == "cuda" && lib_device_memory(c.device, &free_b, &total_b)) {
    c.device_free = static_cast<double>(free_b);
    c.device_total = static_cast<double>(total_b);
  }
  if (choice) *choice = c;
  return backend;
}

}  // namespace loom
