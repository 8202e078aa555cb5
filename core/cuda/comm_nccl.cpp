// The communicator of a cuda run: device buffers through NCCL, host buffers (the loss, the gradient
// norm, flags and other scalars) through the MPI communicator it wraps. NCCL is opened with dlopen
// the first time a job needs it (libnccl.so.2: a single-GPU node runs without it). Its unique id is
// broadcast over MPI. Every NCCL operation runs on the communicator's own stream after the compute
// stream's work so far (an event), and completes a request that is tested with cudaEventQuery and
// waited on as the MPI requests are: watched, and a wait that sees no completion for
// run.comm_timeout seconds aborts the NCCL communicator and ends the job naming it. Byte counters:
// NCCL moves the bytes itself, so what a rank sends is counted by the ring formulas of core/comm/comm.hpp
// (the textbook volumes the MPI back end measures), in the element type's size.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <type_traits>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/comm/comm.hpp"
#include "core/base/clock.hpp"
#include "core/cuda/comm_nccl.hpp"
#include "core/base/error.hpp"
#include "core/comm/fault.hpp"

namespace loom {
namespace {

// The NCCL entry points loom uses, resolved from libnccl.so.2 once per process.
struct Nccl {
  bool loaded = false;
  std::string why_not;
  int version = 0;
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRank) comm_init_rank = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclCommAbort) comm_abort = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  decltype(&ncclGetVersion) get_version = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclReduceScatter) reduce_scatter = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  decltype(&ncclBroadcast) broadcast = nullptr;
  decltype(&ncclReduce) reduce = nullptr;
  decltype(&ncclSend) send = nullptr;
  decltype(&ncclRecv) recv = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
};

const Nccl& nccl() {
  static Nccl n = [] {
    Nccl r;
    // LOOM_NCCL_LIBRARY names another (an NCCL at a path of its own, or the emulated device's).
    const char* named = std::getenv("LOOM_NCCL_LIBRARY");
    std::string library = named && *named ? named : "libnccl.so.2";
#ifdef LOOM_CUDA_EMULATED
    // The emulated device's NCCL is this library's own: a real NCCL cannot drive an emulated device.
    Dl_info self{};
    if (!(named && *named) && dladdr(reinterpret_cast<void*>(&make_nccl_communicator), &self) && self.dli_fname)
      library = self.dli_fname;
#endif
    const std::string what = named && *named ? "LOOM_NCCL_LIBRARY = " + library : library;
    void* h = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      r.why_not = what + " cannot be loaded (" + dlerror() + "): " +
                  (named && *named ? "name NCCL's library (libnccl.so.2 of NCCL 2.10 or newer), or unset "
                                     "LOOM_NCCL_LIBRARY to take the one on the library path"
                                   : "install NCCL (2.10 or newer), or put its library on LD_LIBRARY_PATH, or name it "
                                     "in LOOM_NCCL_LIBRARY");
      return r;
    }
    bool all = true;
    const auto sym = [&](auto& f, const char* name) {
      f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(dlsym(h, name));
      if (!f) all = false;
    };
    sym(r.get_unique_id, "ncclGetUniqueId");
    sym(r.comm_init_rank, "ncclCommInitRank");
    sym(r.comm_destroy, "ncclCommDestroy");
    sym(r.comm_abort, "ncclCommAbort");
    sym(r.error_string, "ncclGetErrorString");
    sym(r.get_version, "ncclGetVersion");
    sym(r.all_reduce, "ncclAllReduce");
    sym(r.reduce_scatter, "ncclReduceScatter");
    sym(r.all_gather, "ncclAllGather");
    sym(r.broadcast, "ncclBroadcast");
    sym(r.reduce, "ncclReduce");
    sym(r.send, "ncclSend");
    sym(r.recv, "ncclRecv");
    sym(r.group_start, "ncclGroupStart");
    sym(r.group_end, "ncclGroupEnd");
    if (!all) {
      r.why_not = what + " lacks entry points loom needs (NCCL 2.10 or newer is required: bf16, grouped send/recv)";
      return r;
    }
    r.get_version(&r.version);
    r.loaded = true;
    return r;
  }();
  return n;
}

void check_nccl(ncclResult_t e, const std::string& what) {
  if (e != ncclSuccess) throw std::runtime_error("NCCL: " + what + ": " + nccl().error_string(e));
}
void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("CUDA: ") + what + ": " + cudaGetErrorString(e));
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32:
      return ncclFloat32;
    case DType::f64:
      return ncclFloat64;
    case DType::bf16:
      return ncclBfloat16;
    case DType::f16:
      return ncclFloat16;
    case DType::i8:
      return ncclInt8;
    case DType::u8:
      return ncclUint8;
    case DType::i32:
      return ncclInt32;
    case DType::i64:
      return ncclInt64;
    case DType::count_:
      break;
  }
  throw std::logic_error("NCCL: no type for this element type");
}
ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::max ? ncclMax : ncclSum; }

class NcclCommunicator;

// An NCCL operation's completion: an event recorded after it on the communicator's stream.
class NcclRequest final : public CommRequest {
 public:
  NcclRequest(NcclCommunicator* c, CommOp op, cudaEvent_t done) : comm_(c), op_(op), done_(done) {}
  ~NcclRequest() override;
  bool test() override;
  void wait() override;

 private:
  NcclCommunicator* comm_;
  CommOp op_;
  cudaEvent_t done_;
  bool complete_ = false;
};

// A host-buffer operation of the wrapped MPI communicator; its counters reach this one's as it moves.
class HostRequest final : public CommRequest {
 public:
  HostRequest(NcclCommunicator* c, CommRequestPtr inner) : comm_(c), inner_(std::move(inner)) {}
  bool test() override;
  void wait() override;

 private:
  NcclCommunicator* comm_;
  CommRequestPtr inner_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(MPI_Comm comm, const std::string& name, cudaStream_t compute)
      : name_(name), compute_(compute), mpi_(make_mpi_communicator(comm, name)) {
    rank_ = mpi_->rank();
    size_ = mpi_->size();
    // Everything that can fail on one rank happens before the ranks agree: a rank that cannot load
    // NCCL, create its streams or (rank 0) make the id tells the others, and all throw alike,
    // instead of leaving them in MPI_Bcast or ncclCommInitRank.
    const Nccl& n = nccl();
    std::string local_error = n.loaded ? "" : n.why_not;
    ncclUniqueId id{};
    if (local_error.empty()) {
      if (cudaStreamCreateWithFlags(&send_stream_, cudaStreamNonBlocking) != cudaSuccess ||
          cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking) != cudaSuccess ||
          cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming) != cudaSuccess)
        local_error = std::string("cannot create CUDA streams: ") + cudaGetErrorString(cudaGetLastError());
      else if (rank_ == 0 && n.get_unique_id(&id) != ncclSuccess)
        local_error = "ncclGetUniqueId failed";
    }
    MPI_Comm dup;
    MPI_Comm_dup(comm, &dup);
    int failed = local_error.empty() ? 0 : 1;
    MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_SUM, dup);
    if (failed == 0) MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, dup);
    MPI_Comm_free(&dup);
    if (failed > 0) {  // a node without NCCL, or a library misnamed: refused as bad input is
      const std::string why = "communicator " + name + ": device buffers need NCCL on every rank; " +
                              (local_error.empty() ? std::string("another rank could not set it up") : local_error) +
                              "; or run.share_gpu = true (host copies over MPI, for checks) or run.backend = host";
      int world_size = 1;
      MPI_Comm_size(MPI_COMM_WORLD, &world_size);
      // Over the whole job every rank knows and stops here: said once where all failed alike (else by
      // each rank that failed), exit 2, no abort. A smaller group's ranks abort the job, since the
      // ranks outside it would wait for them.
      if (size_ < world_size) throw InputError(why);
      if (failed == size_ ? rank_ == 0 : !local_error.empty())
        write_stderr(failed == size_ ? "loom: error: " + why + "\n" : rank_error_text(rank_, why));
      throw ReportedError(why);
    }
    check_nccl(n.comm_init_rank(&comm_, size_, id, rank_), "ncclCommInitRank for communicator " + name);
  }
  ~NcclCommunicator() override {
    if (comm_) {
      cudaStreamSynchronize(stream_);
      cudaStreamSynchronize(send_stream_);
      nccl().comm_destroy(comm_);
    }
    if (ready_) cudaEventDestroy(ready_);
    if (stream_) cudaStreamDestroy(stream_);
    if (send_stream_) cudaStreamDestroy(send_stream_);
  }

  const std::string& name() const override { return name_; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void progress() override {
    mpi_->progress();
    refresh();
  }
  void barrier() override {
    mpi_->barrier();
    refresh();
  }

  // Adds what the MPI communicator counted since the last look (so reset_stats() keeps working).
  void refresh() { add_counts_since(mpi_->stats(), seen_); }
  void waited(CommOp op, double seconds) { stats_.wait_s[static_cast<int>(op)] += seconds; }
  // The job cannot go on: NCCL's own operations are aborted first, so no rank spins in a kernel.
  [[noreturn]] void stalled(CommOp op, double seconds) {
    nccl().comm_abort(comm_);
    comm_ = nullptr;
    std::ostringstream why;
    why << name_ << ' ' << comm_op_name(op) << " (NCCL, rank " << rank_ << " of " << size_ << ") did not complete in "
        << seconds << " s (run.comm_timeout = " << comm_timeout()
        << "): a rank of this communicator is stalled or dead (or itself waiting on one that is)";
    abort_job(why.str(), 1);
  }

 protected:
  CommRequestPtr start_all_reduce(BufferRef data, ReduceOp op) override {
    if (data.space == MemSpace::host) return host(mpi_->all_reduce_async(data, op));
    const Nccl& n = nccl();
    return issue(CommOp::all_reduce, ring_all_reduce_bytes(static_cast<double>(data.bytes()), size_), [&] {
      check_nccl(n.all_reduce(data.data, data.data, static_cast<std::size_t>(data.count), nccl_type(data.type),
                              nccl_op(op), comm_, stream_),
                 "ncclAllReduce");
    });
  }
  CommRequestPtr start_reduce_scatter(BufferRef send, BufferRef recv, const std::vector<std::int64_t>& counts,
                                      ReduceOp op) override {
    if (send.space == MemSpace::host) return host(mpi_->reduce_scatter_async(send, recv, counts, op));
    const Nccl& n = nccl();
    const std::size_t elem = dtype_size(send.type);
    const bool equal = std::all_of(counts.begin(), counts.end(), [&](std::int64_t c) { return c == counts[0]; });
    return issue(CommOp::reduce_scatter, static_cast<double>(ring_reduce_scatter_bytes(counts, rank_, elem)), [&] {
      if (equal) {
        check_nccl(n.reduce_scatter(send.data, recv.data, static_cast<std::size_t>(counts[0]), nccl_type(send.type),
                                    nccl_op(op), comm_, stream_),
                   "ncclReduceScatter");
        return;
      }
      // Uneven blocks: one reduce per block to its owner, in one group.
      const std::vector<std::int64_t> at = shard_offsets(counts);
      check_nccl(n.group_start(), "ncclGroupStart");
      for (int r = 0; r < size_; ++r) {
        if (counts[static_cast<std::size_t>(r)] == 0) continue;
        const char* block = static_cast<const char*>(send.data) + at[static_cast<std::size_t>(r)] * elem;
        check_nccl(n.reduce(block, r == rank_ ? recv.data : nullptr,
                            static_cast<std::size_t>(counts[static_cast<std::size_t>(r)]), nccl_type(send.type),
                            nccl_op(op), r, comm_, stream_),
                   "ncclReduce");
      }
      check_nccl(n.group_end(), "ncclGroupEnd");
    });
  }
  CommRequestPtr start_all_gather(BufferRef send, BufferRef recv, const std::vector<std::int64_t>& counts) override {
    if (send.space == MemSpace::host) return host(mpi_->all_gather_async(send, recv, counts));
    const Nccl& n = nccl();
    const std::size_t elem = dtype_size(send.type);
    const bool equal = std::all_of(counts.begin(), counts.end(), [&](std::int64_t c) { return c == counts[0]; });
    return issue(CommOp::all_gather, static_cast<double>(ring_all_gather_bytes(counts, rank_, elem)), [&] {
      if (equal) {
        check_nccl(n.all_gather(send.data, recv.data, static_cast<std::size_t>(counts[0]), nccl_type(send.type), comm_,
                                stream_),
                   "ncclAllGather");
        return;
      }
      // Uneven blocks: every rank broadcasts its block into its place, in one group.
      const std::vector<std::int64_t> at = shard_offsets(counts);
      check_nccl(n.group_start(), "ncclGroupStart");
      for (int r = 0; r < size_; ++r) {
        if (counts[static_cast<std::size_t>(r)] == 0) continue;
        char* place = static_cast<char*>(recv.data) + at[static_cast<std::size_t>(r)] * elem;
        check_nccl(n.broadcast(r == rank_ ? send.data : place, place,
                               static_cast<std::size_t>(counts[static_cast<std::size_t>(r)]), nccl_type(send.type), r,
                               comm_, stream_),
                   "ncclBroadcast");
      }
      check_nccl(n.group_end(), "ncclGroupEnd");
    });
  }
  CommRequestPtr start_broadcast(BufferRef data, int root) override {
    if (data.space == MemSpace::host) return host(mpi_->broadcast_async(data, root));
    const Nccl& n = nccl();
    // A ring broadcast: every rank but the one before the root passes the message on.
    const double bytes = size_ > 1 && rank_ != (root + size_ - 1) % size_ ? static_cast<double>(data.bytes()) : 0.0;
    return issue(CommOp::broadcast, bytes, [&] {
      check_nccl(n.broadcast(data.data, data.data, static_cast<std::size_t>(data.count), nccl_type(data.type), root,
                             comm_, stream_),
                 "ncclBroadcast");
    });
  }
  // NCCL matches point-to-point messages between two ranks in the order they are issued (the tag
  // is checked by the interface and otherwise not used: device messages between two ranks must be
  // received in the order they were sent). Sends run on a stream of their own, so that two ranks
  // that each send to the other before receiving cannot block each other's receive.
  CommRequestPtr start_send(BufferRef data, int peer, int tag) override {
    if (data.space == MemSpace::host) return host(mpi_->send_async(data, peer, tag));
    const Nccl& n = nccl();
    return issue(
        CommOp::send, static_cast<double>(data.bytes()),
        [&](cudaStream_t s) {
          check_nccl(n.send(data.data, static_cast<std::size_t>(data.count), nccl_type(data.type), peer, comm_, s),
                     "ncclSend");
        },
        send_stream_);
  }
  CommRequestPtr start_recv(BufferRef data, int peer, int tag) override {
    if (data.space == MemSpace::host) return host(mpi_->recv_async(data, peer, tag));
    const Nccl& n = nccl();
    return issue(CommOp::recv, 0.0, [&] {
      check_nccl(n.recv(data.data, static_cast<std::size_t>(data.count), nccl_type(data.type), peer, comm_, stream_),
                 "ncclRecv");
    });
  }

 private:
  CommRequestPtr host(CommRequestPtr inner) {
    refresh();
    return std::make_unique<HostRequest>(this, std::move(inner));
  }
  // Runs `enqueue` on the communicator's stream after the compute stream's work so far, and returns
  // the request its completion event ends.
  template <class F>
  CommRequestPtr issue(CommOp op, double bytes, F&& enqueue, cudaStream_t on = nullptr) {
    if (!on) on = stream_;
    check_cuda(cudaEventRecord(ready_, compute_), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(on, ready_, 0), "cudaStreamWaitEvent");
    if constexpr (std::is_invocable_v<F, cudaStream_t>)
      enqueue(on);
    else
      enqueue();
    cudaEvent_t done;
    check_cuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventRecord(done, on), "cudaEventRecord");
    stats_.bytes_sent[static_cast<int>(op)] += static_cast<std::uint64_t>(bytes);
    ++stats_.calls[static_cast<int>(op)];
    return std::make_unique<NcclRequest>(this, op, done);
  }

  std::string name_;
  cudaStream_t compute_;
  std::unique_ptr<Communicator> mpi_;
  CommStats seen_;
  int rank_ = 0, size_ = 1;
  cudaStream_t stream_ = nullptr;       // collectives and receives
  cudaStream_t send_stream_ = nullptr;  // sends
  cudaEvent_t ready_ = nullptr;
  ncclComm_t comm_ = nullptr;
};

NcclRequest::~NcclRequest() {
  // An abandoned request still completes before its event goes; nothing here may throw.
  if (!complete_) cudaEventSynchronize(done_);
  cudaEventDestroy(done_);
}
bool NcclRequest::test() {
  if (complete_) return true;
  const cudaError_t e = cudaEventQuery(done_);
  if (e == cudaErrorNotReady) return false;
  check_cuda(e, "NCCL operation");
  complete_ = true;
  return true;
}
void NcclRequest::wait() {
  if (complete_) return;
  const double t0 = now(), timeout = comm_timeout();
  int polls = 0;
  while (!test()) {
    // Flat out for a while (most collectives finish within microseconds of the compute they
    // follow), then sleep between polls so that a waiting rank costs no core.
    if (++polls > 1000) std::this_thread::sleep_for(std::chrono::microseconds(200));
    if (timeout > 0 && now() - t0 > timeout) comm_->stalled(op_, now() - t0);
  }
  comm_->waited(op_, now() - t0);
}

bool HostRequest::test() {
  const bool done = inner_->test();
  comm_->refresh();
  return done;
}
void HostRequest::wait() {
  inner_->wait();
  comm_->refresh();
}

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, const std::string& name, cudaStream_t compute) {
  return std::make_unique<NcclCommunicator>(comm, name, compute);
}

std::string nccl_description() {
  const Nccl& n = nccl();
  if (!n.loaded) return n.why_not;
  std::ostringstream s;
  s << "NCCL " << n.version / 10000 << "." << n.version / 100 % 100 << "." << n.version % 100;
  return s.str();
}

}  // namespace loom
