#pragma once
// Communicators (DESIGN.md "Communicators"): one interface, an MPI back end for host buffers (an
// NCCL back end for device buffers fills the same interface). Every operation can be issued
// asynchronously and waited on, so gradient traffic overlaps backward compute. Every communicator
// counts the bytes it sends and the time it waits, per operation kind, so the metrics can compare
// measured traffic with the textbook volumes (a ring all-reduce sends 2(N-1)/N * M bytes per rank).
//
// Operations are typed: they take BufferRefs (core/base/dtype.hpp: element type, count, memory space).
//   all_reduce, reduce_scatter   sum or max (ReduceOp) of every element type:
//                                fp32, fp64  native arithmetic; max propagates NaN.
//                                bf16, fp16  each ring step converts both operands to float, adds
//                                            (or compares) there, and rounds the result to storage
//                                            once: a sum over N ranks is rounded N-1 times, in the
//                                            ring's order (see comm_mpi.cpp). max propagates NaN.
//                                int8, uint8 sums add in int32 and saturate to the type's range at
//                                            every step (exact while every partial sum fits;
//                                            otherwise the result depends on the ring's order).
//                                int32, int64 sums wrap modulo 2^32 / 2^64 (two's complement).
//                                Every element is reduced on one rank and copied to the others,
//                                so all ranks get bitwise identical results.
//   all_gather, broadcast,       any element type: the bytes are moved unchanged.
//   send, recv
// reduce_scatter and all_gather come in an equal-count form and a variable-count form (counts[r]
// elements for rank r, blocks in rank order, every rank passing the same counts; zeros allowed);
// shard_counts / padded_shard below split a tensor for them. send and recv buffers must hold the
// same element type and lie in the same memory space (std::logic_error, naming both, otherwise).
// The float* / double* signatures are the typed operations on fp32 / fp64 buffers.
//
// The MPI back end moves host buffers only: it refuses device buffers (std::logic_error; those go
// through the NCCL back end). It runs its collectives as ring algorithms over point-to-point
// messages that it sends itself; that is what makes the byte counts measurements rather than
// formulas, in the element type's size (a bf16 all-reduce sends half the bytes of an fp32 one).
// Requests advance when they are tested or waited on, or when progress() is called (the engine
// calls it between backward kernels). Its ring scratch buffers are filed in the memory ledger under
// Mem::comm and kept for later operations of the same communicator.
//
// Waiting is watched: a wait polls flat out only while messages may be moving, then sleeps between
// polls (an idle rank costs no core), and when none of its messages has completed for
// comm_timeout() seconds it ends the whole job (abort_job), naming the operation, the communicator
// and the ranks whose messages never came: a stalled or dead rank never leaves the others spinning.
#include <mpi.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/base/dtype.hpp"

namespace loom {

enum class CommOp : int { all_reduce = 0, reduce_scatter, all_gather, broadcast, send, recv, count_ };
inline constexpr int kCommOps = static_cast<int>(CommOp::count_);
const char* comm_op_name(CommOp op);  // "all_reduce", ...

enum class ReduceOp : int { sum = 0, max };
const char* reduce_op_name(ReduceOp op);  // "sum", "max"

struct CommStats {
  std::array<std::uint64_t, kCommOps> bytes_sent{};  // payload bytes this rank handed to the network
  std::array<double, kCommOps> wait_s{};             // seconds spent blocked in wait()/blocking calls
  std::array<std::uint64_t, kCommOps> calls{};       // operations issued
  std::uint64_t total_bytes() const;
  double total_wait() const;
};

class CommRequest {
 public:
  virtual ~CommRequest() = default;
  virtual bool test() = 0;  // advances the operation; true once it is complete
  virtual void wait() = 0;  // blocks until complete; the time is counted as waiting
};
using CommRequestPtr = std::unique_ptr<CommRequest>;

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual const std::string& name() const = 0;  // "world", "dp", "tp", "pp"
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // --- Typed operations. Arguments are checked here, for every back end (std::invalid_argument for
  // counts, peers and roots; std::logic_error for mismatched element types or memory spaces), before
  // anything is sent or counted.

  // All-reduce in place over data.count elements.
  CommRequestPtr all_reduce_async(BufferRef data, ReduceOp op = ReduceOp::sum);
  // Reduce-scatter, equal counts: `send` holds size() * recv.count elements; rank r receives block r.
  CommRequestPtr reduce_scatter_async(BufferRef send, BufferRef recv, ReduceOp op = ReduceOp::sum);
  // Reduce-scatter, variable counts: rank r receives counts[r] elements (recv.count == counts[rank()]);
  // `send` holds their sum, the blocks in rank order. In place (`recv` is this rank's block of
  // `send`), the other blocks of `send` are left undefined: the ring keeps its partial sums there
  // and needs scratch for one incoming block only.
  CommRequestPtr reduce_scatter_async(BufferRef send, BufferRef recv, const std::vector<std::int64_t>& counts,
                                      ReduceOp op = ReduceOp::sum);
  // All-gather, equal counts: every rank contributes send.count elements; `recv` gets size() * send.count,
  // block r from rank r.
  CommRequestPtr all_gather_async(BufferRef send, BufferRef recv);
  // All-gather, variable counts (all-gatherv): rank r contributes counts[r] elements (send.count ==
  // counts[rank()]); `recv` holds their sum, the blocks in rank order.
  CommRequestPtr all_gather_async(BufferRef send, BufferRef recv, const std::vector<std::int64_t>& counts);
  CommRequestPtr broadcast_async(BufferRef data, int root);
  // Point to point; tags lie in [0, 1000) (higher ones are the collectives').
  CommRequestPtr send_async(BufferRef data, int peer, int tag);
  CommRequestPtr recv_async(BufferRef data, int peer, int tag);

  // --- The fp32 / fp64 forms (sums), the typed operations on those buffers.
  CommRequestPtr all_reduce_async(float* data, std::int64_t count) { return all_reduce_async(BufferRef(data, count)); }
  CommRequestPtr all_reduce_async(double* data, std::int64_t count) { return all_reduce_async(BufferRef(data, count)); }
  // Sum reduce-scatter: `send` holds size() * recv_count elements; rank r receives block r.
  CommRequestPtr reduce_scatter_async(const float* send, float* recv, std::int64_t recv_count) {
    return reduce_scatter_async(BufferRef(send, recv_count * size()), BufferRef(recv, recv_count));
  }
  // All-gather: every rank contributes send_count elements; `recv` gets size() * send_count, block r from rank r.
  CommRequestPtr all_gather_async(const float* send, float* recv, std::int64_t send_count) {
    return all_gather_async(BufferRef(send, send_count), BufferRef(recv, send_count * size()));
  }
  CommRequestPtr broadcast_async(float* data, std::int64_t count, int root) {
    return broadcast_async(BufferRef(data, count), root);
  }
  CommRequestPtr send_async(const float* data, std::int64_t count, int peer, int tag) {
    return send_async(BufferRef(data, count), peer, tag);
  }
  CommRequestPtr recv_async(float* data, std::int64_t count, int peer, int tag) {
    return recv_async(BufferRef(data, count), peer, tag);
  }

  // Advances every outstanding request of this communicator without blocking.
  virtual void progress() = 0;
  // Makes the ring-scratch pool hold, per size class (scratch_class), at least that many buffers,
  // so that a step whose collectives stay within them allocates nothing: the run reserves at start-up
  // what `loom plan` prices (StepPlan::pools), and its ledger's comm peak is the plan's. A back end
  // whose collectives take no ring scratch (NCCL's device collectives) ignores it.
  virtual void reserve_scratch(const std::map<std::size_t, int>& /*buffers_per_class*/) {}
  // The pool's bytes reserved, and those its collectives needed: per size class, the class times the
  // most buffers of it out at once (what an unreserved pool would have kept), so a reservation far
  // above the need shows.
  struct ScratchUse {
    std::size_t reserved = 0, needed = 0;
  };
  virtual ScratchUse scratch_use() const { return {}; }
  virtual void barrier() = 0;

  // Blocking forms: issue, then wait.
  void all_reduce(BufferRef data, ReduceOp op = ReduceOp::sum) { all_reduce_async(data, op)->wait(); }
  void reduce_scatter(BufferRef send, BufferRef recv, ReduceOp op = ReduceOp::sum) {
    reduce_scatter_async(send, recv, op)->wait();
  }
  void reduce_scatter(BufferRef send, BufferRef recv, const std::vector<std::int64_t>& counts,
                      ReduceOp op = ReduceOp::sum) {
    reduce_scatter_async(send, recv, counts, op)->wait();
  }
  void all_gather(BufferRef send, BufferRef recv) { all_gather_async(send, recv)->wait(); }
  void all_gather(BufferRef send, BufferRef recv, const std::vector<std::int64_t>& counts) {
    all_gather_async(send, recv, counts)->wait();
  }
  void broadcast(BufferRef data, int root) { broadcast_async(data, root)->wait(); }
  void send(BufferRef data, int peer, int tag) { send_async(data, peer, tag)->wait(); }
  void recv(BufferRef data, int peer, int tag) { recv_async(data, peer, tag)->wait(); }

  void all_reduce(float* data, std::int64_t count) { all_reduce_async(data, count)->wait(); }
  void all_reduce(double* data, std::int64_t count) { all_reduce_async(data, count)->wait(); }
  void reduce_scatter(const float* send, float* recv, std::int64_t n) { reduce_scatter_async(send, recv, n)->wait(); }
  void all_gather(const float* send, float* recv, std::int64_t n) { all_gather_async(send, recv, n)->wait(); }
  void broadcast(float* data, std::int64_t count, int root) { broadcast_async(data, count, root)->wait(); }
  void send(const float* data, std::int64_t count, int peer, int tag) { send_async(data, count, peer, tag)->wait(); }
  void recv(float* data, std::int64_t count, int peer, int tag) { recv_async(data, count, peer, tag)->wait(); }
  double sum(double value) {
    all_reduce(&value, 1);
    return value;
  }

  const CommStats& stats() const { return stats_; }
  void reset_stats() { stats_ = CommStats{}; }

 protected:
  // What a back end implements, called with checked arguments: counts has size() entries, each >= 0,
  // send and recv have one element type and memory space and the counts the operation needs;
  // peers and roots are ranks of this communicator. The back end checks what only it knows (memory
  // spaces it can move, its tag range).
  virtual CommRequestPtr start_all_reduce(BufferRef data, ReduceOp op) = 0;
  virtual CommRequestPtr start_reduce_scatter(BufferRef send, BufferRef recv, const std::vector<std::int64_t>& counts,
                                              ReduceOp op) = 0;
  virtual CommRequestPtr start_all_gather(BufferRef send, BufferRef recv, const std::vector<std::int64_t>& counts) = 0;
  virtual CommRequestPtr start_broadcast(BufferRef data, int root) = 0;
  virtual CommRequestPtr start_send(BufferRef data, int peer, int tag) = 0;
  virtual CommRequestPtr start_recv(BufferRef data, int peer, int tag) = 0;

  CommStats stats_;
  // Adds what `inner` (a communicator this one moves some operations through) counted since `seen`
  // to this one's counters, and updates `seen`: deltas, so that reset_stats() keeps working.
  void add_counts_since(const CommStats& inner, CommStats& seen);

 private:
  void check_count(const char* op, const char* what, const BufferRef& b) const;
  void check_pair(const char* op, const BufferRef& send, const BufferRef& recv) const;
  void check_counts(const char* op, const std::vector<std::int64_t>& counts) const;
  void check_rank(const char* op, const char* what, int rank) const;
};

// The ring scratch an MPI collective takes from its communicator's pool while it runs (Mem::comm),
// in bytes: what the requests allocate and what `loom plan` counts. `most`: the largest rank's block.
std::size_t ring_all_reduce_scratch(std::int64_t count, int ranks, std::size_t elem);
std::size_t ring_reduce_scatter_scratch(std::int64_t most, int ranks, std::size_t elem, bool in_place);
// The size class a scratch buffer of `bytes` is made in (rounded up to an eighth of its power of
// two, at least 8 bytes): a pool reuses a buffer only for operations of its class, and keeps of
// each class as many buffers as operations of it were ever in flight together.
std::size_t scratch_class(std::size_t bytes);

// How long a wait may see none of its messages complete before it ends the job, in seconds (0: wait
// forever). Process-wide, for every communicator; the driver sets it from run.comm_timeout.
void set_comm_timeout(double seconds);
double comm_timeout();

// An emulated slower link, for benchmarks on one node (the driver sets it from run.emulate_link_gbps
// and run.emulate_link_latency_us; 0 Gbit/s: off). Every send a rank posts, on any of its
// communicators, occupies one shared link: a message of n bytes takes latency + 8n / (Gbit/s * 1e9)
// seconds after the link is free, and the step that posted it completes no earlier. Process-wide.
void set_link_model(double gbit_per_s, double latency_s);
double link_gbit_per_s();
double link_latency_s();

// A communicator over `comm` (duplicated, so loom's traffic never mixes with anyone else's).
std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm, const std::string& name);

// `inner` (an MPI communicator) for a device back end's buffers (core/backend/comm_staged.cpp): a device
// buffer is copied to host memory through backend.copy_to_host when the operation starts, moved by
// `inner`, and copied back through copy_from_host when its request completes (test or wait); a
// buffer that lies inside the other (in-place reduce-scatter and all-gather) shares its copy. Host
// buffers pass straight through. Byte counts and waits are `inner`'s. What a device back end uses
// where its ranks cannot use NCCL (none loaded, or ranks sharing one GPU); no overlap of copies
// with compute, so it is for correctness, not speed.
class Backend;
std::unique_ptr<Communicator> make_staged_communicator(std::unique_ptr<Communicator> inner, Backend& backend);

// Splitting `total` elements over `n` ranks (ZeRO shards; the counts of the variable-count
// reduce-scatter and all-gather):
//   shard_counts   total/n each, one more on the first total % n ranks (the chunks of the ring
//                  all-reduce); e.g. shard_counts(10, 4) = {3, 3, 2, 2}, shard_counts(2, 4) = {1, 1, 0, 0}.
//   shard_offsets  where each block starts: n + 1 prefix sums of counts, the last one their total.
//   padded_shard   ceil(total / n): the count per rank of the equal-count forms when the tensor is
//                  padded to n * padded_shard(total, n) elements.
std::vector<std::int64_t> shard_counts(std::int64_t total, int n);
std::vector<std::int64_t> shard_offsets(const std::vector<std::int64_t>& counts);
std::int64_t padded_shard(std::int64_t total, int n);

// Textbook per-rank send volumes, in bytes, for an operation on M bytes over N ranks.
double ring_all_reduce_bytes(double M, int N);      // 2 (N-1)/N M
double ring_reduce_scatter_bytes(double M, int N);  // (N-1)/N M   (M = the whole input)
double ring_all_gather_bytes(double M, int N);      // (N-1)/N M   (M = the whole output)
// With variable counts (counts[r] elements of elem_bytes for rank r), what rank `rank` sends in the
// rings: a reduce-scatter sends every block but its own once, an all-gather every block but its
// right neighbour's ((rank + 1) mod N). Summed over the ranks, each is (N-1) times the whole payload.
std::uint64_t ring_reduce_scatter_bytes(const std::vector<std::int64_t>& counts, int rank, std::size_t elem_bytes);
std::uint64_t ring_all_gather_bytes(const std::vector<std::int64_t>& counts, int rank, std::size_t elem_bytes);

}  // namespace loom
