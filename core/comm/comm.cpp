// The back-end-neutral part of the communicator interface (core/comm/comm.hpp): names, counters, the
// argument checks every back end shares, shard arithmetic and textbook volumes.
#include <cmath>
#include <stdexcept>
#include <string>

#include "core/comm/comm.hpp"

namespace loom {

void Communicator::add_counts_since(const CommStats& inner, CommStats& seen) {
  for (int i = 0; i < kCommOps; ++i) {
    stats_.bytes_sent[i] += inner.bytes_sent[i] - seen.bytes_sent[i];
    stats_.wait_s[i] += inner.wait_s[i] - seen.wait_s[i];
    stats_.calls[i] += inner.calls[i] - seen.calls[i];
  }
  seen = inner;
}

const char* comm_op_name(CommOp op) {
  switch (op) {
    case CommOp::all_reduce:
      return "all_reduce";
    case CommOp::reduce_scatter:
      return "reduce_scatter";
    case CommOp::all_gather:
      return "all_gather";
    case CommOp::broadcast:
      return "broadcast";
    case CommOp::send:
      return "send";
    case CommOp::recv:
      return "recv";
    case CommOp::count_:
      break;
  }
  return "unknown";
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::max:
      return "max";
  }
  return "unknown";
}

std::uint64_t CommStats::total_bytes() const {
  std::uint64_t t = 0;
  for (auto b : bytes_sent) t += b;
  return t;
}

double CommStats::total_wait() const {
  double t = 0;
  for (auto w : wait_s) t += w;
  return t;
}

namespace {
double g_comm_timeout = 300;  // seconds; the default of run.comm_timeout
}  // namespace

void set_comm_timeout(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0)
    throw std::invalid_argument("communicator timeout must be >= 0 seconds (0: off), got " + std::to_string(seconds));
  g_comm_timeout = seconds;
}

double comm_timeout() { return g_comm_timeout; }

namespace {
double g_link_gbit = 0, g_link_latency = 0;
}  // namespace

void set_link_model(double gbit_per_s, double latency_s) {
  if (!std::isfinite(gbit_per_s) || gbit_per_s < 0 || !std::isfinite(latency_s) || latency_s < 0)
    throw std::invalid_argument("the emulated link needs a bandwidth >= 0 Gbit/s (0: off) and a latency >= 0 s");
  g_link_gbit = gbit_per_s;
  g_link_latency = latency_s;
}
double link_gbit_per_s() { return g_link_gbit; }
double link_latency_s() { return g_link_latency; }

// --- Argument checks.

void Communicator::check_count(const char* op, const char* what, const BufferRef& b) const {
  if (b.count < 0)
    throw std::invalid_argument(std::string(op) + ": negative count (" + what + " holds " + std::to_string(b.count) +
                                " elements)");
}

void Communicator::check_pair(const char* op, const BufferRef& send, const BufferRef& recv) const {
  check_count(op, "send", send);
  check_count(op, "recv", recv);
  if (send.type != recv.type)
    throw std::logic_error("communicator " + name() + ": " + op + ": send holds " + dtype_name(send.type) +
                           " but recv holds " + dtype_name(recv.type) + "; both must have one element type");
  if (send.space != recv.space)
    throw std::logic_error("communicator " + name() + ": " + op + ": send is in " + mem_space_name(send.space) +
                           " memory but recv in " + mem_space_name(recv.space) + " memory; both must be in one space");
}

void Communicator::check_counts(const char* op, const std::vector<std::int64_t>& counts) const {
  if (static_cast<int>(counts.size()) != size())
    throw std::invalid_argument(std::string(op) + ": " + std::to_string(counts.size()) +
                                " counts for a communicator of size " + std::to_string(size()));
  for (std::size_t r = 0; r < counts.size(); ++r)
    if (counts[r] < 0)
      throw std::invalid_argument(std::string(op) + ": negative count " + std::to_string(counts[r]) + " for rank " +
                                  std::to_string(r));
}

void Communicator::check_rank(const char* op, const char* what, int rank) const {
  if (rank < 0 || rank >= size())
    throw std::invalid_argument("communicator " + name() + ": " + op + " " + what + " " + std::to_string(rank) +
                                " is not a rank of a communicator of size " + std::to_string(size()));
}

namespace {
std::int64_t total_of(const std::vector<std::int64_t>& counts) {
  std::int64_t t = 0;
  for (std::int64_t c : counts) t += c;
  return t;
}
}  // namespace

// --- The typed operations: check, then hand to the back end.

CommRequestPtr Communicator::all_reduce_async(BufferRef data, ReduceOp op) {
  check_count("all_reduce", "data", data);
  return start_all_reduce(data, op);
}

CommRequestPtr Communicator::reduce_scatter_async(BufferRef send, BufferRef recv, ReduceOp op) {
  check_pair("reduce_scatter", send, recv);
  if (send.count != recv.count * size())
    throw std::invalid_argument("reduce_scatter: send holds " + std::to_string(send.count) + " elements, not " +
                                std::to_string(size()) + " x recv's " + std::to_string(recv.count));
  return start_reduce_scatter(send, recv, std::vector<std::int64_t>(static_cast<std::size_t>(size()), recv.count), op);
}

CommRequestPtr Communicator::reduce_scatter_async(BufferRef send, BufferRef recv,
                                                  const std::vector<std::int64_t>& counts, ReduceOp op) {
  check_pair("reduce_scatter", send, recv);
  check_counts("reduce_scatter", counts);
  if (send.count != total_of(counts))
    throw std::invalid_argument("reduce_scatter: send holds " + std::to_string(send.count) +
                                " elements, the counts sum to " + std::to_string(total_of(counts)));
  if (recv.count != counts[static_cast<std::size_t>(rank())])
    throw std::invalid_argument("reduce_scatter: recv holds " + std::to_string(recv.count) + " elements, rank " +
                                std::to_string(rank()) + "'s count is " +
                                std::to_string(counts[static_cast<std::size_t>(rank())]));
  return start_reduce_scatter(send, recv, counts, op);
}

CommRequestPtr Communicator::all_gather_async(BufferRef send, BufferRef recv) {
  check_pair("all_gather", send, recv);
  if (recv.count != send.count * size())
    throw std::invalid_argument("all_gather: recv holds " + std::to_string(recv.count) + " elements, not " +
                                std::to_string(size()) + " x send's " + std::to_string(send.count));
  return start_all_gather(send, recv, std::vector<std::int64_t>(static_cast<std::size_t>(size()), send.count));
}

CommRequestPtr Communicator::all_gather_async(BufferRef send, BufferRef recv, const std::vector<std::int64_t>& counts) {
  check_pair("all_gather", send, recv);
  check_counts("all_gather", counts);
  if (send.count != counts[static_cast<std::size_t>(rank())])
    throw std::invalid_argument("all_gather: send holds " + std::to_string(send.count) + " elements, rank " +
                                std::to_string(rank()) + "'s count is " +
                                std::to_string(counts[static_cast<std::size_t>(rank())]));
  if (recv.count != total_of(counts))
    throw std::invalid_argument("all_gather: recv holds " + std::to_string(recv.count) +
                                " elements, the counts sum to " + std::to_string(total_of(counts)));
  return start_all_gather(send, recv, counts);
}

CommRequestPtr Communicator::broadcast_async(BufferRef data, int root) {
  check_count("broadcast", "data", data);
  check_rank("broadcast", "root", root);
  return start_broadcast(data, root);
}

CommRequestPtr Communicator::send_async(BufferRef data, int peer, int tag) {
  check_count("send", "data", data);
  check_rank("send", "peer", peer);
  return start_send(data, peer, tag);
}

CommRequestPtr Communicator::recv_async(BufferRef data, int peer, int tag) {
  check_count("recv", "data", data);
  check_rank("recv", "peer", peer);
  return start_recv(data, peer, tag);
}

// --- Shards and volumes.

std::vector<std::int64_t> shard_counts(std::int64_t total, int n) {
  if (total < 0 || n < 1)
    throw std::invalid_argument("shard_counts: " + std::to_string(total) + " elements over " + std::to_string(n) +
                                " ranks");
  std::vector<std::int64_t> counts(static_cast<std::size_t>(n), total / n);
  for (std::int64_t r = 0; r < total % n; ++r) ++counts[static_cast<std::size_t>(r)];
  return counts;
}

std::vector<std::int64_t> shard_offsets(const std::vector<std::int64_t>& counts) {
  std::vector<std::int64_t> offsets(counts.size() + 1, 0);
  for (std::size_t r = 0; r < counts.size(); ++r) offsets[r + 1] = offsets[r] + counts[r];
  return offsets;
}

std::int64_t padded_shard(std::int64_t total, int n) {
  if (total < 0 || n < 1)
    throw std::invalid_argument("padded_shard: " + std::to_string(total) + " elements over " + std::to_string(n) +
                                " ranks");
  return (total + n - 1) / n;
}

double ring_all_reduce_bytes(double M, int N) { return N <= 1 ? 0.0 : 2.0 * (N - 1) * M / N; }
double ring_reduce_scatter_bytes(double M, int N) { return N <= 1 ? 0.0 : (N - 1) * M / N; }
double ring_all_gather_bytes(double M, int N) { return N <= 1 ? 0.0 : (N - 1) * M / N; }

std::uint64_t ring_reduce_scatter_bytes(const std::vector<std::int64_t>& counts, int rank, std::size_t elem_bytes) {
  const std::size_t n = counts.size();
  if (n <= 1) return 0;
  return static_cast<std::uint64_t>(total_of(counts) - counts[static_cast<std::size_t>(rank) % n]) * elem_bytes;
}

std::uint64_t ring_all_gather_bytes(const std::vector<std::int64_t>& counts, int rank, std::size_t elem_bytes) {
  const std::size_t n = counts.size();
  if (n <= 1) return 0;
  return static_cast<std::uint64_t>(total_of(counts) - counts[(static_cast<std::size_t>(rank) + 1) % n]) * elem_bytes;
}

}  // namespace loom
