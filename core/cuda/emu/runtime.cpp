// The emulated device's runtime (core/cuda/emu/runtime.hpp; the API in include/cuda_runtime.h):
// allocations, the work queue, streams and events, launches and errors.
#include "core/cuda/emu/runtime.hpp"

#include "core/backend/device_address.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>
#include <memory>

namespace loom::cuda_emu::rt {
namespace {
struct Work {
  std::string what;
  std::function<bool()> step;  // true when done; false: blocked (tried again as the host waits)
};
// One cudaEventRecord: reached when its stream gets there. Shared by the event (its latest record),
// the marker queued for it, and any stream told to wait for it, each of which may outlive the others.
struct Record {
  bool reached = false;
  std::chrono::steady_clock::time_point at;
};
}  // namespace
}  // namespace loom::cuda_emu::rt

struct CUstream_st {
  int device = 0;
  std::deque<loom::cuda_emu::rt::Work> work;  // in issue order; the front runs first
};
struct CUevent_st {
  unsigned flags = 0;
  std::shared_ptr<loom::cuda_emu::rt::Record> latest;  // null until first recorded
  bool pending() const { return latest && !latest->reached; }
};

namespace loom::cuda_emu::rt {
namespace {

constexpr std::size_t kDeviceBytes = std::size_t(80) << 30;  // an H100's, for cudaMemGetInfo and refusals
constexpr std::size_t kDefaultShared = 48 * 1024;            // without cudaFuncSetAttribute

struct Allocation {
  std::size_t bytes;
  unsigned char* host;
};

// Everything below, and the work while it runs (one device: its work runs one item at a time).
std::recursive_mutex mu;
std::map<std::uintptr_t, Allocation> allocations;  // by device address
std::size_t allocated = 0;
CUstream_st default_stream;  // the null stream's work
std::set<CUstream_st*> streams;
std::set<CUevent_st*> events;
std::map<const void*, int> dynamic_shared_optin;  // per kernel
std::string sticky;  // the first failed work: the device's context is lost, as a GPU's after a fault
thread_local cudaError_t last_error = cudaSuccess;
thread_local int current_device = 0;

using Lock = std::lock_guard<std::recursive_mutex>;

// LOOM_CUDA_EMU_DEVICES: devices per node, 1 when unset; a value that is not a whole number from 0
// to kMaxDevices gives none, and cudaGetErrorString(cudaErrorNoDevice) says why. CUDA_VISIBLE_DEVICES,
// as the CUDA runtime reads it (a scheduler's binding of GPUs to ranks): the node's devices this
// process sees, by index, as its ordinals 0, 1, ...; an entry that is not one of them ends the list;
// empty, none. Read once.
constexpr long kMaxDevices = 1024;
// A whole number from 0 to `max` (digits only, no sign or blank), into `out`; false otherwise.
bool whole_number(const std::string& text, long max, long& out) {
  char* end = nullptr;
  errno = 0;
  out = std::strtol(text.c_str(), &end, 10);
  return !text.empty() && std::isdigit(static_cast<unsigned char>(text[0])) && *end == '\0' && errno == 0 && out <= max;
}
struct Devices {
  std::vector<int> node_index{0};  // per ordinal, the device of the node it is
  std::string none_why = "no CUDA-capable device is detected (LOOM_CUDA_EMU_DEVICES = 0)";
};
const Devices& devices() {
  static const Devices d = [] {
    Devices r;
    int on_node = 1;
    if (const char* env = std::getenv("LOOM_CUDA_EMU_DEVICES"); env && *env) {
      long n = 0;
      if (!whole_number(env, kMaxDevices, n)) {
        r.node_index.clear();
        r.none_why = std::string("LOOM_CUDA_EMU_DEVICES = '") + env +
                     "' is not a number of emulated devices (a whole number from 0 to " + std::to_string(kMaxDevices) +
                     "; unset: 1)";
        return r;
      }
      on_node = static_cast<int>(n);
    }
    r.node_index.clear();
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    if (!visible) {
      for (int i = 0; i < on_node; ++i) r.node_index.push_back(i);
    } else {
      std::string entry;
      std::istringstream list(visible);
      long i = 0;
      while (std::getline(list, entry, ',') && whole_number(entry, on_node - 1L, i))
        r.node_index.push_back(static_cast<int>(i));
      if (r.node_index.empty() && on_node > 0)
        r.none_why = std::string("no CUDA-capable device is detected (CUDA_VISIBLE_DEVICES = '") + visible +
                     "' names none of the node's " + std::to_string(on_node) + " emulated devices)";
    }
    return r;
  }();
  return d;
}
int device_count() { return static_cast<int>(devices().node_index.size()); }

Schedule schedule_from_environment() {
  const char* env = std::getenv("LOOM_CUDA_EMU_SCHEDULE");
  const std::string s = env ? env : "";
  if (s == "warps_ascending") return Schedule::warps_ascending;
  if (s == "warps_descending") return Schedule::warps_descending;
  if (s == "warps_random") return Schedule::warps_random;
  return Schedule::sweep;
}

cudaError_t state() { return sticky.empty() ? cudaSuccess : cudaErrorLaunchFailure; }

cudaError_t fail(cudaError_t e, const std::string& why) {
  set_error(e, why);
  return e;
}

void lose_context(const std::string& why) {
  if (!sticky.empty()) return;
  sticky = why;
  std::fprintf(stderr, "loom cuda emulator: %s (the device's context is lost: every later wait fails)\n", why.c_str());
}

CUstream_st* stream_of(cudaStream_t s) { return s ? s : &default_stream; }

// Runs the stream's front item; true if it finished (and is gone).
bool step_front(CUstream_st* s) {
  if (s->work.empty()) return false;
  bool done = true;
  if (sticky.empty()) {  // a lost context runs nothing more
    try {
      done = s->work.front().step();
    } catch (const std::exception& e) {
      lose_context(s->work.front().what + ": " + e.what());
    }
  }
  if (done) s->work.pop_front();
  return done;
}
// Every stream as far as it goes without blocking, as a GPU's streams advance on their own; true
// if anything ran.
bool progress_all() {
  bool any = false;
  for (bool again = true; again;) {
    again = false;
    while (step_front(&default_stream)) again = any = true;
    for (CUstream_st* s : streams)
      while (step_front(s)) again = any = true;
  }
  return any;
}
bool all_idle() {
  if (!default_stream.work.empty()) return false;
  for (CUstream_st* s : streams)
    if (!s->work.empty()) return false;
  return true;
}
double wait_timeout_s() {
  const char* env = std::getenv("LOOM_CUDA_EMU_WAIT_TIMEOUT");
  return env && *env ? std::atof(env) : 300.0;
}
// A host wait: the streams advance until `done`; work blocked for LOOM_CUDA_EMU_WAIT_TIMEOUT seconds
// (default 300: a peer that never issues its side of an NCCL operation) loses the context, naming
// what waited, instead of hanging.
template <class Done>
void wait_until(Done done, const char* what) {
  auto t0 = std::chrono::steady_clock::now();  // the last time anything moved
  int idle = 0;
  while (!done() && sticky.empty()) {
    if (progress_all()) {
      idle = 0;
      t0 = std::chrono::steady_clock::now();
      continue;
    }
    if (done()) break;
    if (++idle > 1000) std::this_thread::sleep_for(std::chrono::microseconds(100));
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (waited > wait_timeout_s()) {
      std::string blocked;
      for (CUstream_st* s : streams)
        if (!s->work.empty()) blocked += (blocked.empty() ? "" : ", ") + s->work.front().what;
      lose_context(std::string(what) + " waited " + std::to_string(waited) + " s (LOOM_CUDA_EMU_WAIT_TIMEOUT) on " +
                   (blocked.empty() ? std::string("nothing") : blocked));
    }
  }
}
void run_all() { wait_until(all_idle, "a wait for the device"); }
// A host wait for one stream's work so far.
void drain(CUstream_st* on, const char* what) {
  wait_until([on] { return on->work.empty(); }, what);
}

// Streams and events: handles the runtime hands out and recognises until they are destroyed.
template <class Handle>
cudaError_t make_handle(Handle** out, std::set<Handle*>& live) {
  Lock lock(mu);
  *out = new Handle;
  live.insert(*out);
  return cudaSuccess;
}
template <class Handle>
cudaError_t drop_handle(Handle* h, std::set<Handle*>& live, const char* what) {
  Lock lock(mu);
  if (!h || !live.count(h)) return fail(cudaErrorInvalidResourceHandle, std::string(what) + " of no such handle");
  live.erase(h);
  delete h;
  return state();
}

bool live_stream(cudaStream_t s) { return s == nullptr || streams.count(s) != 0; }

const Allocation* allocation_of(std::uintptr_t a, std::uintptr_t* start) {
  auto it = allocations.upper_bound(a);
  if (it == allocations.begin()) return nullptr;
  --it;
  if (a > it->first + it->second.bytes) return nullptr;
  *start = it->first;
  return &it->second;
}

}  // namespace

bool is_device_address(const void* p) { return loom::device_address::is_moved(p); }

void* host_address(const void* p, std::size_t bytes, const std::string& what) {
  Lock lock(mu);
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  if (!is_device_address(p))
    throw std::invalid_argument(what + " is a host address (" + std::to_string(a) + "), not device memory");
  std::uintptr_t start = 0;
  const Allocation* al = allocation_of(a, &start);
  if (!al) throw std::invalid_argument(what + " is not in device memory allocated and not yet freed");
  if (a - start + bytes > al->bytes)
    throw std::invalid_argument(what + ": " + std::to_string(bytes) + " bytes from offset " +
                                std::to_string(a - start) + " pass the end of its allocation of " +
                                std::to_string(al->bytes) + " bytes");
  return al->host + (a - start);
}

void enqueue(cudaStream_t s, const char* what, std::function<void()> work) {
  enqueue_step(s, what, [work = std::move(work)] {
    work();
    return true;
  });
}

void enqueue_step(cudaStream_t s, const char* what, std::function<bool()> step) {
  Lock lock(mu);
  stream_of(s)->work.push_back({what, std::move(step)});
}

void set_error(cudaError_t e, const std::string& why) {
  last_error = e;
  std::fprintf(stderr, "loom cuda emulator: %s\n", why.c_str());
}

void launch(cudaStream_t s, const char* name, dim3 grid, dim3 block, std::size_t shared, const void* kernel,
            std::function<void()> body) {
  Lock lock(mu);
  const std::size_t threads = std::size_t(block.x) * block.y * block.z;
  if (!live_stream(s))
    return (void)fail(cudaErrorInvalidResourceHandle, std::string(name) + ": launched on a destroyed stream");
  if (threads == 0 || threads > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu ||
      grid.y > 65535 || grid.z > 65535)
    return (void)fail(cudaErrorInvalidConfiguration, std::string(name) + ": grid (" + std::to_string(grid.x) + "," +
                                                         std::to_string(grid.y) + "," + std::to_string(grid.z) +
                                                         ") of blocks of " + std::to_string(threads) + " threads");
  const auto optin = dynamic_shared_optin.find(kernel);
  const std::size_t allowed = optin == dynamic_shared_optin.end() ? kDefaultShared : std::size_t(optin->second);
  if (shared > allowed)
    return (void)fail(cudaErrorInvalidValue, std::string(name) + ": " + std::to_string(shared) +
                                                 " bytes of dynamic shared memory, but the kernel allows " +
                                                 std::to_string(allowed) +
                                                 " (cudaFuncSetAttribute(MaxDynamicSharedMemorySize) raises it)");
  const Schedule order = schedule_from_environment();
  stream_of(s)->work.push_back({std::string("kernel ") + name, [=, body = std::move(body)] {
                                  set_schedule(order, 1);
                                  cuda_emu::launch(grid, block, shared, body);
                                  return true;
                                }});
}

}  // namespace loom::cuda_emu::rt

using namespace loom::cuda_emu::rt;

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer:
      return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection:
      return "invalid copy direction for memcpy";
    case cudaErrorNoDevice:
      return devices().none_why.c_str();
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorNotReady:
      return "device not ready";
    case cudaErrorLaunchFailure:
      return "unspecified launch failure";
  }
  return "unknown error";
}

cudaError_t cudaGetLastError() {
  Lock lock(mu);
  const cudaError_t e = last_error;
  last_error = cudaSuccess;
  return e != cudaSuccess ? e : state();
}

cudaError_t cudaGetDeviceCount(int* n) {
  *n = device_count();
  return *n > 0 ? cudaSuccess : cudaErrorNoDevice;
}
cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= device_count()) return last_error = cudaErrorInvalidDevice;
  current_device = device;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = current_device;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int device) {
  if (device < 0 || device >= device_count()) return cudaErrorInvalidDevice;
  *p = cudaDeviceProp{};
  std::snprintf(p->name, sizeof p->name, "loom CUDA emulator (H100-like, on the CPU)");
  // The same device of the node, the same UUID in every process, whatever its ordinal there: ranks
  // that share an emulated GPU see so.
  char uuid[32];
  std::snprintf(uuid, sizeof uuid, "loom-emu-%07d", devices().node_index[static_cast<std::size_t>(device)] % 10000000);
  std::memcpy(p->uuid.bytes, uuid, sizeof p->uuid.bytes);
  p->totalGlobalMem = kDeviceBytes;
  p->sharedMemPerBlock = kDefaultShared;
  p->sharedMemPerBlockOptin = loom::cuda_emu::kMaxSharedPerBlock;
  p->multiProcessorCount = 132;
  p->major = 9;
  p->minor = 0;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device < 0 || device >= device_count()) return cudaErrorInvalidDevice;
  if (attr != cudaDevAttrMaxSharedMemoryPerBlockOptin) return cudaErrorInvalidValue;
  *value = static_cast<int>(loom::cuda_emu::kMaxSharedPerBlock);
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int* v) {
  *v = 13000;
  return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int* v) {
  *v = 13000;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** p, std::size_t bytes) {
  Lock lock(mu);
  *p = nullptr;
  if (bytes == 0) return cudaSuccess;
  // A failed call sets the last error, as the runtime's do (a later launch's check reports it).
  if (allocated + bytes > kDeviceBytes) return last_error = cudaErrorMemoryAllocation;
  const std::size_t rounded = (bytes + 255) / 256 * 256;  // 256-byte aligned, as cudaMalloc's
  auto* host = static_cast<unsigned char*>(std::aligned_alloc(256, rounded));
  if (!host) return last_error = cudaErrorMemoryAllocation;
  std::memset(host, 0xff, rounded);  // NaN in every float: a read of memory never written shows
  const auto device = reinterpret_cast<std::uintptr_t>(loom::device_address::away(host));
  allocations[device] = {bytes, host};
  allocated += bytes;
  *p = reinterpret_cast<void*>(device);
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  Lock lock(mu);
  if (!p) return cudaSuccess;
  run_all();  // cudaFree waits for the device, as the runtime's does
  const auto it = allocations.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == allocations.end())
    return fail(cudaErrorInvalidValue, "cudaFree of an address that is not an allocation's start");
  std::free(it->second.host);
  allocated -= it->second.bytes;
  allocations.erase(it);
  return state();
}
cudaError_t cudaMemGetInfo(std::size_t* free_bytes, std::size_t* total_bytes) {
  Lock lock(mu);
  *total_bytes = kDeviceBytes;
  *free_bytes = kDeviceBytes - allocated;
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind, cudaStream_t s) {
  Lock lock(mu);
  if (!live_stream(s)) return fail(cudaErrorInvalidResourceHandle, "cudaMemcpyAsync on a destroyed stream");
  if (bytes == 0) return state();
  const bool dst_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool src_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (kind != cudaMemcpyHostToDevice && kind != cudaMemcpyDeviceToHost && kind != cudaMemcpyDeviceToDevice)
    return fail(cudaErrorInvalidMemcpyDirection,
                "cudaMemcpyAsync: only host-to-device, device-to-host and device-to-device");
  void* d = dst;
  const void* h = src;
  try {
    if (dst_device)
      d = host_address(dst, bytes, "cudaMemcpyAsync's destination");
    else if (is_device_address(dst))
      throw std::invalid_argument("cudaMemcpyAsync's destination is device memory, the kind says host");
    if (src_device)
      h = host_address(src, bytes, "cudaMemcpyAsync's source");
    else if (is_device_address(src))
      throw std::invalid_argument("cudaMemcpyAsync's source is device memory, the kind says host");
    const auto d0 = reinterpret_cast<std::uintptr_t>(d), h0 = reinterpret_cast<std::uintptr_t>(h);
    if (kind == cudaMemcpyDeviceToDevice && d0 != h0 && d0 < h0 + bytes && h0 < d0 + bytes)
      throw std::invalid_argument("cudaMemcpyAsync between overlapping device ranges (undefined on the device)");
  } catch (const std::invalid_argument& e) {
    return fail(cudaErrorInvalidValue, e.what());
  }
  if (kind == cudaMemcpyHostToDevice) {
    // From pageable host memory (loom has no pinned buffers): the runtime stages the source before
    // it returns, so the caller may reuse it at once.
    std::vector<unsigned char> staged(static_cast<const unsigned char*>(h),
                                      static_cast<const unsigned char*>(h) + bytes);
    enqueue(s, "cudaMemcpyAsync", [d, staged = std::move(staged)] { std::memcpy(d, staged.data(), staged.size()); });
    return state();
  }
  enqueue(s, "cudaMemcpyAsync", [d, h, bytes] { std::memcpy(d, h, bytes); });
  // Into pageable host memory the runtime returns only once the copy (and the stream's work before
  // it) is done.
  if (kind == cudaMemcpyDeviceToHost) drain(stream_of(s), "cudaMemcpyAsync to pageable host memory");
  return state();
}
cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
  Lock lock(mu);
  const cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, nullptr);
  if (e != cudaSuccess) return e;
  run_all();  // synchronous: after the work issued before it, and done when it returns
  return state();
}
cudaError_t cudaMemsetAsync(void* p, int value, std::size_t bytes, cudaStream_t s) {
  Lock lock(mu);
  if (!live_stream(s)) return fail(cudaErrorInvalidResourceHandle, "cudaMemsetAsync on a destroyed stream");
  if (bytes == 0) return state();
  void* h = nullptr;
  try {
    h = host_address(p, bytes, "cudaMemsetAsync's destination");
  } catch (const std::invalid_argument& e) {
    return fail(cudaErrorInvalidValue, e.what());
  }
  enqueue(s, "cudaMemsetAsync", [h, value, bytes] { std::memset(h, value, bytes); });
  return state();
}

cudaError_t cudaDeviceSynchronize() {
  Lock lock(mu);
  run_all();
  return state();
}
cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, cudaStreamDefault); }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  const cudaError_t e = make_handle(s, streams);
  (*s)->device = current_device;
  return e;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  Lock lock(mu);
  if (s && streams.count(s)) drain(s, "cudaStreamDestroy");  // its work finishes first
  return drop_handle(s, streams, "cudaStreamDestroy");
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  Lock lock(mu);
  if (!live_stream(s)) return fail(cudaErrorInvalidResourceHandle, "cudaStreamSynchronize of a destroyed stream");
  drain(stream_of(s), "cudaStreamSynchronize");
  return state();
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
  Lock lock(mu);
  if (!live_stream(s) || !events.count(e))
    return fail(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent: no such stream or event");
  // The stream's later work waits until the event's latest record (as of now) is reached.
  if (e->pending()) enqueue_step(s, "cudaStreamWaitEvent", [record = e->latest] { return record->reached; });
  return state();
}

cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, cudaEventDefault); }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags) {
  const cudaError_t r = make_handle(e, events);
  (*e)->flags = flags;
  return r;
}
// A marker still queued for the event keeps its record.
cudaError_t cudaEventDestroy(cudaEvent_t e) { return drop_handle(e, events, "cudaEventDestroy"); }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  Lock lock(mu);
  if (!events.count(e) || !live_stream(s))
    return fail(cudaErrorInvalidResourceHandle, "cudaEventRecord: no such event or stream");
  e->latest = std::make_shared<Record>();  // a stream already waiting keeps the record it was given
  enqueue(s, "cudaEventRecord", [record = e->latest] {
    record->reached = true;
    record->at = std::chrono::steady_clock::now();
  });
  return state();
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
  Lock lock(mu);
  if (!events.count(e)) return fail(cudaErrorInvalidResourceHandle, "cudaEventQuery of no event");
  progress_all();  // the streams advance as far as they can without the host waiting
  if (!sticky.empty()) return state();
  return e->pending() ? cudaErrorNotReady : cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  Lock lock(mu);
  if (!events.count(e)) return fail(cudaErrorInvalidResourceHandle, "cudaEventSynchronize of no event");
  const std::shared_ptr<Record> record = e->latest;
  if (record) wait_until([&record] { return record->reached; }, "cudaEventSynchronize");
  return state();
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  Lock lock(mu);
  if (!events.count(start) || !events.count(end)) return cudaErrorInvalidResourceHandle;
  if ((start->flags | end->flags) & cudaEventDisableTiming) return cudaErrorInvalidResourceHandle;
  if (!start->latest || !end->latest) return cudaErrorInvalidResourceHandle;
  if (start->pending() || end->pending()) return cudaErrorNotReady;
  *ms = std::chrono::duration<float, std::milli>(end->latest->at - start->latest->at).count();
  return state();
}

cudaError_t cudaFuncSetAttribute(const void* kernel, cudaFuncAttribute attr, int value) {
  Lock lock(mu);
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      std::size_t(value) > loom::cuda_emu::kMaxSharedPerBlock)
    return fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: " + std::to_string(value) +
                                           " bytes of dynamic shared memory (the device allows " +
                                           std::to_string(loom::cuda_emu::kMaxSharedPerBlock) + ")");
  dynamic_shared_optin[kernel] = value;
  return cudaSuccess;
}
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* a, const void* kernel) {
  Lock lock(mu);
  *a = cudaFuncAttributes{};
  a->maxThreadsPerBlock = 1024;
  const auto it = dynamic_shared_optin.find(kernel);
  a->maxDynamicSharedSizeBytes = it == dynamic_shared_optin.end() ? int(48 * 1024) : it->second;
  a->ptxVersion = 90;
  a->binaryVersion = 90;  // the emulator runs the kernels' source as sm_90 would: wmma and all
  return cudaSuccess;
}
