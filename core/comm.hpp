#pragma once
// Communicators (DESIGN.md "Communicators"): one interface, an MPI back end for host buffers (an
// NCCL back end for device buffers fills the same interface). Every operation can be issued
// asynchronously and waited on, so gradient traffic overlaps backward compute. Every communicator
// counts the bytes it sends and the time it waits, per operation kind, so the metrics can compare
// measured traffic with the textbook volumes (a ring all-reduce sends 2(N-1)/N * M bytes per rank).
//
// The MPI back end runs its collectives as ring algorithms over point-to-point messages that it
// sends itself; that is what makes the byte counts measurements rather than formulas. Requests
// advance when they are tested or waited on, or when progress() is called (the engine calls it
// between backward kernels).
//
// Waiting is watched: a wait polls flat out only while messages may be moving, then sleeps between
// polls (an idle rank costs no core), and when none of its messages has completed for
// comm_timeout() seconds it ends the whole job (abort_job), naming the operation, the communicator
// and the ranks whose messages never came: a stalled or dead rank never leaves the others spinning.
#include <mpi.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>

namespace loom {

enum class CommOp : int { all_reduce = 0, reduce_scatter, all_gather, broadcast, send, recv, count_ };
inline constexpr int kCommOps = static_cast<int>(CommOp::count_);
const char* comm_op_name(CommOp op);  // "all_reduce", ...

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

  // Sum all-reduce in place over `count` elements.
  virtual CommRequestPtr all_reduce_async(float* data, std::int64_t count) = 0;
  virtual CommRequestPtr all_reduce_async(double* data, std::int64_t count) = 0;
  // Sum reduce-scatter: `send` holds size() * recv_count elements; rank r receives block r.
  virtual CommRequestPtr reduce_scatter_async(const float* send, float* recv, std::int64_t recv_count) = 0;
  // All-gather: every rank contributes send_count elements; `recv` gets size() * send_count, block r from rank r.
  virtual CommRequestPtr all_gather_async(const float* send, float* recv, std::int64_t send_count) = 0;
  virtual CommRequestPtr broadcast_async(float* data, std::int64_t count, int root) = 0;
  virtual CommRequestPtr send_async(const float* data, std::int64_t count, int peer, int tag) = 0;
  virtual CommRequestPtr recv_async(float* data, std::int64_t count, int peer, int tag) = 0;
  // Advances every outstanding request of this communicator without blocking.
  virtual void progress() = 0;
  virtual void barrier() = 0;

  // Blocking forms: issue, then wait.
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
  CommStats stats_;
};

// How long a wait may see none of its messages complete before it ends the job, in seconds (0: wait
// forever). Process-wide, for every communicator; the driver sets it from run.comm_timeout.
void set_comm_timeout(double seconds);
double comm_timeout();

// A communicator over `comm` (duplicated, so loom's traffic never mixes with anyone else's).
std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm, const std::string& name);

// Textbook per-rank send volumes, in bytes, for an operation on M bytes over N ranks.
double ring_all_reduce_bytes(double M, int N);       // 2 (N-1)/N M
double ring_reduce_scatter_bytes(double M, int N);   // (N-1)/N M   (M = the whole input)
double ring_all_gather_bytes(double M, int N);       // (N-1)/N M   (M = the whole output)

}  // namespace loom
