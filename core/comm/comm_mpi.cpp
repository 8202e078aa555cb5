// The MPI back end of the communicator interface (core/comm/comm.hpp).
//
// Every collective is a ring (or, for broadcast, a pipelined chain) of nonblocking point-to-point
// messages that this file posts itself, so the per-operation byte counters are measurements.
//
// Requests are state machines. An operation is a sequence of steps; a step posts a few
// MPI_Irecv/MPI_Isend (receives first), and once all of them have completed the request does the
// step's local work (e.g. reduces the received chunk into the data) and posts the next step. A request
// advances only when it is tested, waited on, or when progress() is called on its communicator; a
// rank that blocks in wait() on one request keeps advancing the other outstanding requests of the
// same communicator, so ranks may wait on their outstanding operations in different orders.
// (Requests of *different* communicators do not drive each other: wait on those in the same order on
// every rank, or call progress().) A request destroyed before it completes waits for completion in
// its destructor, and a communicator destroyed with live requests completes them first, so no MPI
// request is ever left dangling.
//
// Every wait is watched (Pacer, MpiRequest::wait). MPI moves a large message only while it is polled,
// so a wait polls flat out for kSpinSeconds after its last progress, plus the time its step's bytes
// take on a slow link; past that it sleeps between polls (kFirstSleep doubling to kLongestSleep), so
// a rank waiting on a busy or stalled peer costs no core and a wait ends at most ~1 ms after its
// message lands. When none of its messages has completed for comm_timeout() seconds, the wait ends
// the job through abort_job, naming the operation, the communicator, and the peers (world rank and
// rank here) whose messages never arrived or that never took ours. It never throws: requests wait
// again in their destructors while an exception unwinds, which would hang.
//
// Algorithms and per-rank send volumes (M = payload bytes, in the element type's size, N = ranks,
// r = this rank):
//   all_reduce      ring reduce-scatter then ring all-gather over N chunks whose sizes differ by at
//                   most one element (chunk i has count/N elements, +1 for i < count % N; chunks are
//                   empty when count < N). Reduce-scatter step s (0..N-2) sends chunk (r-s) and
//                   reduces the incoming chunk (r-s-1) into the data (data = data op incoming);
//                   afterwards rank r owns the reduced chunk (r+1): chunk c is
//                   ((v[c] op v[c+1]) op v[c+2]) ... op v[c-1], v[q] being rank q's elements, each
//                   step's result rounded to the element type. All-gather step s (0..N-2) sends chunk
//                   (r+1-s) and receives chunk (r-s) straight into the data. 2(N-1) messages: every
//                   chunk except (r+1) and every chunk except (r+2) once each, i.e. 2(N-1)/N * M up
//                   to chunk rounding. Each chunk is reduced on exactly one rank and then copied, so
//                   all ranks end with bitwise identical results.
//   reduce_scatter  ring over the blocks (counts[b] elements for rank b, in rank order). Step s
//                   (0..N-2) sends the partial result of block (r-s-1) (at step 0 this rank's own
//                   elements) and combines the incoming partial result of block (r-s-2) with this
//                   rank's elements (result = incoming op own): block b is
//                   ((v[b+1] op v[b+2]) op ...) op v[b], ending on rank b. N-1 messages: every block
//                   but its own, sum(counts) - counts[r] elements; (N-1)/N * M with equal counts
//                   (M = the whole input).
//   all_gather      ring: this rank's block is copied into place at issue; step s (0..N-2) sends
//                   block (r-s) and receives block (r-s-1). N-1 messages: every block but that of
//                   rank r+1, sum(counts) - counts[r+1] elements; (N-1)/N * M with equal counts
//                   (M = the whole output).
//   broadcast       pipelined chain root -> root+1 -> ... -> root+N-1 (mod N) in segments of
//                   kBroadcastSegment bytes: every rank but the last in the chain sends M once, the
//                   last sends nothing ((N-1) M in total, the minimum). A chain rather than a tree:
//                   the volume per rank is at most M and, pipelined, the time is ~ M/bandwidth +
//                   N * segment latency, which suits the large parameter broadcasts loom does.
//   send / recv     one message; recv sends no bytes but counts its calls and wait time.
// Operations with zero elements in all (all ranks agree on the counts) and every collective on one
// rank send no messages and complete at once; send/recv always exchange a (possibly empty) message,
// and so do the ring steps of an empty block of a variable-count operation.
//
// Reductions (Reducer): fp32 and fp64 in their own arithmetic (max propagates NaN); bf16 and fp16
// converted to float, combined, and rounded back to storage (round to nearest even) once per step;
// int8 and uint8 sums in int32, saturated to the type's range once per step; int32 and int64 sums
// wrap (two's complement); integer max exactly. The operands of the fp32 sum are in the order this
// file always used (data + incoming in the all-reduce, incoming + own in the reduce-scatter): the
// regression suite's bit-for-bit restarts and golden values rest on the ring's order of additions.
//
// Scratch: the rings receive partial results into scratch buffers that the communicator keeps
// (ScratchPool): filed in the memory ledger under Mem::comm, taken by an operation at issue and
// handed back when it completes, so that later operations reuse them. Buffers come in size classes
// (scratch_class: rounded up to an eighth of the power of two), and the pool keeps of each class as
// many buffers as operations of that class were ever in flight together; an operation takes one of
// its own class. So the pool's peak is the sum over classes of the class size times the most
// operations of it in flight together, which `loom plan` prices from the operations that can be in
// flight together; it does not depend on the order operations complete in, and a step that repeats
// allocates nothing. (Reusing any free buffer that fit let a small operation hold a large buffer
// while a large one in flight allocated another, and made the peak depend on completion order:
// regression.plan.memory_vs_ledger failed now and then. Freeing other classes' buffers to stay
// within the most ever in flight instead made tensor parallelism allocate ten buffers a step.)
//
// Tags: collectives use kCollectiveTagBase + (seq % kCollectiveTagRange), with seq a per-communicator
// sequence number of collectives. All ranks issue the collectives of a communicator in the same
// order, so they agree on the tag, and up to kCollectiveTagRange outstanding collectives on one
// communicator never match each other's messages (messages of one operation between one pair of
// ranks are matched in order, as MPI does not overtake). send/recv use the caller's tag, which must
// lie in [0, kCollectiveTagBase), a range the collectives never use. The highest tag, 30999, is below
// the 32767 that MPI guarantees for MPI_TAG_UB. The communicator is an MPI_Comm_dup of the one it was
// made from, so nothing else shares its message space.
//
// Messages go out as MPI_BYTE in pieces of at most kMessagePieceBytes (both sides split the same
// way): element counts beyond INT_MAX work, and a wait sees a large transfer move piece by piece.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <limits>
#include <map>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <vector>

#include "core/base/buffer.hpp"
#include "core/base/clock.hpp"
#include "core/comm/comm.hpp"
#include "core/comm/fault.hpp"

namespace loom {
namespace {

constexpr int kCollectiveTagBase = 1000;
constexpr int kCollectiveTagRange = 30000;
// Small enough that a transfer which starts while its wait is sleeping completes a piece within a few
// sleeps, which puts the wait back to polling flat out.
constexpr std::size_t kMessagePieceBytes = std::size_t{4} << 20;
constexpr std::size_t kBroadcastSegment = std::size_t{1} << 20;  // bytes

// Pacing of waits (see Pacer). Polled once a millisecond, a 256 MiB shared-memory transfer takes
// ~12x as long as polled flat out (MPICH 4 over UCX), hence the spin while bytes may be moving.
constexpr double kSpinSeconds = 0.02;
constexpr double kSlowLinkBytesPerSecond = 1e9;
constexpr std::chrono::microseconds kFirstSleep{20};
constexpr std::chrono::microseconds kLongestSleep{1000};

inline int ring_mod(std::int64_t a, int n) { return static_cast<int>(((a % n) + n) % n); }

bool mpi_finalized() {
  int f = 0;
  MPI_Finalized(&f);
  return f != 0;
}

double g_link_free_at = 0;  // the emulated link (set_link_model) is busy until then

// Paces a wait's polling loop: flat out until `spin` seconds after the last progress, then sleeps
// growing from kFirstSleep to kLongestSleep.
class Pacer {
 public:
  explicit Pacer(std::size_t bytes_in_flight) { restart(bytes_in_flight); }
  // Something moved: poll flat out again for as long as `bytes_in_flight` may take to arrive.
  void restart(std::size_t bytes_in_flight) {
    since_ = now();
    spin_ = kSpinSeconds + static_cast<double>(bytes_in_flight) / kSlowLinkBytesPerSecond;
    sleep_ = kFirstSleep;
  }
  void pause() {
    if (now() - since_ < spin_) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(sleep_);
    sleep_ = std::min(2 * sleep_, kLongestSleep);
  }

 private:
  double since_ = 0, spin_ = 0;
  std::chrono::microseconds sleep_ = kFirstSleep;
};

// out[i] = a[i] op b[i] for n elements; out may be a or b (see "Reductions" above).
using Reducer = void (*)(void* out, const void* a, const void* b, std::int64_t n);

template <class T>
T saturate(std::int32_t v) {
  return static_cast<T>(
      std::min<std::int32_t>(std::max<std::int32_t>(v, std::numeric_limits<T>::min()), std::numeric_limits<T>::max()));
}
template <class T>
T wrapping_add(T a, T b) {
  using U = std::make_unsigned_t<T>;
  return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
}
template <class F>
F nan_max(F a, F b) {
  return std::isnan(a) ? a : std::isnan(b) ? b : (a < b ? b : a);
}
template <class H>
H half_nan_max(H a, H b) {
  const float x = to_float(a), y = to_float(b);
  return std::isnan(x) ? a : std::isnan(y) ? b : (x < y ? b : a);
}

struct Sum {
  static float apply(float a, float b) { return a + b; }
  static double apply(double a, double b) { return a + b; }
  static bf16 apply(bf16 a, bf16 b) { return to_bf16(to_float(a) + to_float(b)); }
  static f16 apply(f16 a, f16 b) { return to_f16(to_float(a) + to_float(b)); }
  static std::int8_t apply(std::int8_t a, std::int8_t b) { return saturate<std::int8_t>(std::int32_t{a} + b); }
  static std::uint8_t apply(std::uint8_t a, std::uint8_t b) { return saturate<std::uint8_t>(std::int32_t{a} + b); }
  static std::int32_t apply(std::int32_t a, std::int32_t b) { return wrapping_add(a, b); }
  static std::int64_t apply(std::int64_t a, std::int64_t b) { return wrapping_add(a, b); }
};
struct Max {
  static float apply(float a, float b) { return nan_max(a, b); }
  static double apply(double a, double b) { return nan_max(a, b); }
  static bf16 apply(bf16 a, bf16 b) { return half_nan_max(a, b); }
  static f16 apply(f16 a, f16 b) { return half_nan_max(a, b); }
  template <class I>
  static I apply(I a, I b) {
    return a < b ? b : a;
  }
};

template <class T, class Op>
void reduce_elements(void* out, const void* a, const void* b, std::int64_t n) {
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (std::int64_t i = 0; i < n; ++i) o[i] = Op::apply(x[i], y[i]);
}

template <class Op>
Reducer reducer_for(DType t) {
  switch (t) {
    case DType::f32:
      return reduce_elements<float, Op>;
    case DType::f64:
      return reduce_elements<double, Op>;
    case DType::bf16:
      return reduce_elements<bf16, Op>;
    case DType::f16:
      return reduce_elements<f16, Op>;
    case DType::i8:
      return reduce_elements<std::int8_t, Op>;
    case DType::u8:
      return reduce_elements<std::uint8_t, Op>;
    case DType::i32:
      return reduce_elements<std::int32_t, Op>;
    case DType::i64:
      return reduce_elements<std::int64_t, Op>;
    case DType::count_:
      break;
  }
  return nullptr;
}

Reducer reducer(DType t, ReduceOp op) {
  Reducer f = nullptr;
  switch (op) {
    case ReduceOp::sum:
      f = reducer_for<Sum>(t);
      break;
    case ReduceOp::max:
      f = reducer_for<Max>(t);
      break;
  }
  if (!f)
    throw std::logic_error(std::string("no ") + reduce_op_name(op) + " reduction of element type " +
                           std::to_string(static_cast<int>(t)));
  return f;
}

// The ring scratch of one communicator (see "Scratch" above): host buffers filed under Mem::comm,
// 8-byte aligned, one free list per size class.
class ScratchPool {
 public:
  explicit ScratchPool(std::string label) : label_(std::move(label)) {}
  // A free buffer of the class of `bytes`, else a new one of that class.
  TypedBuffer take(std::size_t bytes) {
    const std::size_t c = scratch_class(bytes);
    if (c > 0) most_taken_[c] = std::max(most_taken_[c], ++taken_[c]);
    std::vector<TypedBuffer>& f = free_[c];
    if (f.empty()) return TypedBuffer(label_, DType::u8, static_cast<std::int64_t>(c), Mem::comm);
    TypedBuffer b = std::move(f.back());
    f.pop_back();
    return b;
  }
  void give_back(TypedBuffer b) {
    if (b.empty()) return;
    --taken_[b.bytes()];
    free_[b.bytes()].push_back(std::move(b));
  }
  // At least `count` free buffers of class `c` (before any is taken: Communicator::reserve_scratch).
  void reserve(std::size_t c, int count) {
    if (c == 0 || count <= 0) return;
    std::vector<TypedBuffer>& f = free_[c];
    while (static_cast<int>(f.size()) < count)
      f.emplace_back(label_, DType::u8, static_cast<std::int64_t>(c), Mem::comm);
    reserved_[c] = std::max(reserved_[c], count);
  }
  Communicator::ScratchUse use() const {
    Communicator::ScratchUse u;
    for (const auto& [c, k] : reserved_) u.reserved += c * static_cast<std::size_t>(k);
    for (const auto& [c, k] : most_taken_) u.needed += c * static_cast<std::size_t>(k);
    return u;
  }

 private:
  std::string label_;
  std::map<std::size_t, std::vector<TypedBuffer>> free_;      // by class (a buffer's size is its class)
  std::map<std::size_t, int> taken_, most_taken_, reserved_;  // by class: out now, most out at once, reserved
};

class MpiRequest;

}  // namespace

std::size_t scratch_class(std::size_t bytes) {
  if (bytes == 0) return 0;
  std::size_t top = 1;
  while (top <= bytes / 2) top *= 2;  // the largest power of two <= bytes
  const std::size_t step = std::max<std::size_t>(8, top / 8);
  return (bytes + step - 1) / step * step;
}

std::size_t ring_all_reduce_scratch(std::int64_t count, int ranks, std::size_t elem) {
  if (ranks <= 1 || count <= 0) return 0;
  return static_cast<std::size_t>(count / ranks + (count % ranks > 0 ? 1 : 0)) * elem;
}

// Two block-sized halves, the second 8-byte aligned (the partial result and the incoming one); one
// with two ranks or in place.
std::size_t ring_reduce_scatter_scratch(std::int64_t most, int ranks, std::size_t elem, bool in_place) {
  if (ranks <= 1 || most <= 0) return 0;
  const std::size_t half = (static_cast<std::size_t>(most) * elem + 7) / 8 * 8;
  return ranks == 2 || in_place ? half : 2 * half;
}

namespace {

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, std::string name) : name_(std::move(name)), scratch_("loom.comm." + name_) {
    MPI_Comm_dup(comm, &comm_);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiCommunicator() override;

  const std::string& name() const override { return name_; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void progress() override;
  void reserve_scratch(const std::map<std::size_t, int>& buffers_per_class) override {
    for (const auto& [c, count] : buffers_per_class) scratch_.reserve(c, count);
  }
  ScratchUse scratch_use() const override { return scratch_.use(); }
  // A one-element all-reduce completes on no rank before every rank has joined it: a barrier that is
  // watched like any wait (it counts as an all_reduce).
  void barrier() override {
    double token = 0;
    all_reduce(&token, 1);
  }

  // For the requests.
  MPI_Comm comm() const { return comm_; }
  CommStats& counters() { return stats_; }
  int next_collective_tag() {
    const int tag = kCollectiveTagBase + static_cast<int>(seq_ % kCollectiveTagRange);
    ++seq_;
    return tag;
  }
  void enroll(MpiRequest* r) { live_.push_back(r); }
  void withdraw(MpiRequest* r) { live_.erase(std::remove(live_.begin(), live_.end(), r), live_.end()); }
  bool advance_others(const MpiRequest* except);  // true if any other request moved
  int world_rank(int rank) const;                 // a rank of this communicator in MPI_COMM_WORLD
  ScratchPool& scratch() { return scratch_; }

 protected:
  CommRequestPtr start_all_reduce(BufferRef data, ReduceOp op) override;
  CommRequestPtr start_reduce_scatter(BufferRef send, BufferRef recv, const std::vector<std::int64_t>& counts,
                                      ReduceOp op) override;
  CommRequestPtr start_all_gather(BufferRef send, BufferRef recv, const std::vector<std::int64_t>& counts) override;
  CommRequestPtr start_broadcast(BufferRef data, int root) override;
  CommRequestPtr start_send(BufferRef data, int peer, int tag) override;
  CommRequestPtr start_recv(BufferRef data, int peer, int tag) override;

 private:
  CommRequestPtr start(CommOp op, std::unique_ptr<MpiRequest> r);
  void check_host(const char* op, const char* what, const BufferRef& b) const;
  void check_tag(const char* op, int tag) const;

  std::string name_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::uint64_t seq_ = 0;
  std::vector<MpiRequest*> live_;
  ScratchPool scratch_;  // requests hand theirs back as they complete, which ~MpiCommunicator sees to
};

// The step machine shared by every operation.
class MpiRequest : public CommRequest {
 public:
  MpiRequest(MpiCommunicator* c, CommOp op, int tag) : comm_(c), op_(op), tag_(tag) {}
  // Completion happens in ~Finishing (below), while the operation's virtual steps still exist.
  ~MpiRequest() override {
    if (comm_) comm_->withdraw(this);
  }
  MpiRequest(const MpiRequest&) = delete;
  MpiRequest& operator=(const MpiRequest&) = delete;

  bool test() override { return advance(); }

  void wait() override {
    if (done_ || !comm_) return;
    const double t0 = now();
    double last_arrival = t0;  // the timeout counts from here
    Pacer pacer(step_bytes_);
    // Poll this request and keep the communicator's other requests moving, so that ranks waiting
    // on outstanding operations in different orders cannot deadlock each other.
    for (std::uint64_t seen = messages_done_; !advance();) {
      const bool others = comm_->advance_others(this);
      if (on_link()) {  // every message is through; only the emulated link's time is left: no stall
        last_arrival = now();
        pacer.pause();
        continue;
      }
      if (messages_done_ != seen) {
        seen = messages_done_;
        last_arrival = now();
        pacer.restart(step_bytes_);
      } else if (others) {
        pacer.restart(step_bytes_);
      } else {
        const double still = now() - last_arrival, timeout = comm_timeout();
        if (timeout > 0 && still > timeout) stalled(still, timeout);
        pacer.pause();
      }
    }
    comm_->counters().wait_s[static_cast<int>(op_)] += now() - t0;
  }

  // Posts the first step (called once the object is fully constructed).
  void begin() { advance(); }

  // Completes the current step if its messages are done, then posts the next; true once every step
  // is done.
  bool advance() {
    while (!done_) {
      if (!reqs_.empty()) {
        // Testsome rather than Testall: each message that completes counts as progress for wait(),
        // and is set to MPI_REQUEST_NULL, so what stays pending is known.
        int completed = 0;
        completed_.resize(reqs_.size());
        MPI_Testsome(static_cast<int>(reqs_.size()), reqs_.data(), &completed, completed_.data(), MPI_STATUSES_IGNORE);
        if (completed != MPI_UNDEFINED) {
          messages_done_ += static_cast<std::uint64_t>(completed);
          pending_ -= completed;
        }
        if (pending_ > 0) return false;
        if (step_ready_at_ > 0 && now() < step_ready_at_) return false;  // still on the emulated link
        step_ready_at_ = 0;
        reqs_.clear();
        peers_.clear();
        step_bytes_ = 0;
      }
      if (step_ >= 0) complete(step_);
      ++step_;
      if (step_ >= steps()) {
        done_ = true;
        comm_->scratch().give_back(std::move(scratch_));
        break;
      }
      post(step_);
    }
    return true;
  }

  bool done() const { return done_; }
  // Every message of the current step has completed and it waits only for the emulated link.
  bool on_link() const { return !done_ && pending_ == 0 && step_ready_at_ > 0; }
  std::uint64_t messages_done() const { return messages_done_; }
  void detach() { comm_ = nullptr; }  // the communicator is going away (after completing us)

  // For destructors: a request dropped before it completed waits (keeping the communicator's other
  // requests moving, as wait() does) so that no MPI request is left dangling.
  void finish() {
    if (comm_ && !done_ && !mpi_finalized()) wait();
  }

 protected:
  virtual int steps() const = 0;
  virtual void post(int step) = 0;
  virtual void complete(int /*step*/) {}

  void isend(const void* buf, std::size_t bytes, int peer) {
    comm_->counters().bytes_sent[static_cast<int>(op_)] += bytes;
    step_bytes_ += bytes;
    if (link_gbit_per_s() > 0) {  // the emulated link (set_link_model): this send queues behind the last
      const double start = std::max(now(), g_link_free_at);
      g_link_free_at = start + link_latency_s() + 8.0 * static_cast<double>(bytes) / (link_gbit_per_s() * 1e9);
      step_ready_at_ = std::max(step_ready_at_, g_link_free_at);
    }
    const char* p = static_cast<const char*>(buf);
    do {
      const std::size_t n = std::min(bytes, kMessagePieceBytes);
      reqs_.emplace_back();
      peers_.push_back({peer, false});
      ++pending_;
      MPI_Isend(p, static_cast<int>(n), MPI_BYTE, peer, tag_, comm_->comm(), &reqs_.back());
      p += n;
      bytes -= n;
    } while (bytes > 0);
  }
  void irecv(void* buf, std::size_t bytes, int peer) {
    step_bytes_ += bytes;
    char* p = static_cast<char*>(buf);
    do {
      const std::size_t n = std::min(bytes, kMessagePieceBytes);
      reqs_.emplace_back();
      peers_.push_back({peer, true});
      ++pending_;
      MPI_Irecv(p, static_cast<int>(n), MPI_BYTE, peer, tag_, comm_->comm(), &reqs_.back());
      p += n;
      bytes -= n;
    } while (bytes > 0);
  }

  int rank() const { return comm_->rank(); }
  int size() const { return comm_->size(); }
  int left() const { return ring_mod(rank() - 1, size()); }
  int right() const { return ring_mod(rank() + 1, size()); }

  // `bytes` of scratch (8-byte aligned) from the communicator's pool, held until the operation completes.
  char* scratch(std::size_t bytes) {
    scratch_ = comm_->scratch().take(bytes);
    return static_cast<char*>(scratch_.ref().data);
  }

 private:
  struct Peer {
    int rank;        // in this communicator
    bool receiving;  // an MPI_Irecv from it (else an MPI_Isend to it)
  };

  // Ends the job: nothing of this step has completed for `still` seconds. Names the peers whose
  // messages are still outstanding; those we receive from are the likelier culprits, so they are
  // named when there are any, else those that never took what we sent.
  [[noreturn]] void stalled(double still, double timeout) {
    std::vector<int> silent, deaf;
    for (std::size_t i = 0; i < reqs_.size(); ++i) {
      std::vector<int>& culprits = peers_[i].receiving ? silent : deaf;
      if (reqs_[i] != MPI_REQUEST_NULL && std::find(culprits.begin(), culprits.end(), peers_[i].rank) == culprits.end())
        culprits.push_back(peers_[i].rank);
    }
    const bool receiving = !silent.empty();
    const std::vector<int>& culprits = receiving ? silent : deaf;
    const bool one = culprits.size() == 1;
    std::ostringstream why;
    why << comm_->name() << ' ' << comm_op_name(op_) << " waited " << std::fixed << std::setprecision(1) << still
        << " s (run.comm_timeout = " << std::defaultfloat << timeout << ") for world rank" << (one ? "" : "s");
    const bool in_world = comm_->name() == "world";
    for (std::size_t i = 0; i < culprits.size(); ++i) {
      why << (i ? ", " : " ") << comm_->world_rank(culprits[i]);
      if (!in_world) why << " (" << comm_->name() << " rank " << culprits[i] << ")";
    }
    if (receiving)
      why << (one ? ": its message never arrived" : ": their messages never arrived");
    else
      why << (one ? ": it never took the message sent to it" : ": they never took the messages sent to them");
    why << (one ? "; that rank is stalled or dead (or itself waiting on one that is)"
                : "; those ranks are stalled or dead (or themselves waiting on ones that are)");
    abort_job(why.str(), 1);
  }

  MpiCommunicator* comm_;
  CommOp op_;
  int tag_;
  int step_ = -1;
  bool done_ = false;
  std::vector<MPI_Request> reqs_;  // the current step's messages (MPI_REQUEST_NULL once complete)
  std::vector<Peer> peers_;        // ... and whom each is with
  std::size_t step_bytes_ = 0;     // ... and their payload, sent and received
  int pending_ = 0;                // ... and how many are not complete yet
  std::vector<int> completed_;     // MPI_Testsome's indices
  double step_ready_at_ = 0;       // with an emulated link: when this step's sends have crossed it
  std::uint64_t messages_done_ = 0;
  TypedBuffer scratch_;
};

class RingAllReduce : public MpiRequest {
 public:
  RingAllReduce(MpiCommunicator* c, int tag, BufferRef data, Reducer reduce)
      : MpiRequest(c, CommOp::all_reduce, tag),
        data_(static_cast<char*>(data.data)),
        elem_(dtype_size(data.type)),
        count_(data.count),
        n_(c->size()),
        reduce_(reduce) {
    base_ = count_ / n_;
    rem_ = count_ % n_;
    if (n_ > 1 && count_ > 0) tmp_ = scratch(ring_all_reduce_scratch(count_, n_, elem_));
  }

 protected:
  int steps() const override { return (n_ == 1 || count_ == 0) ? 0 : 2 * (n_ - 1); }
  void post(int s) override {
    const int r = rank();
    if (s < n_ - 1) {  // reduce-scatter
      const int out = ring_mod(r - s, n_), in = ring_mod(r - s - 1, n_);
      irecv(tmp_, bytes(in), left());
      isend(chunk(out), bytes(out), right());
    } else {  // all-gather
      const int g = s - (n_ - 1);
      const int out = ring_mod(r + 1 - g, n_), in = ring_mod(r - g, n_);
      irecv(chunk(in), bytes(in), left());
      isend(chunk(out), bytes(out), right());
    }
  }
  void complete(int s) override {
    if (s >= n_ - 1) return;
    const int in = ring_mod(rank() - s - 1, n_);
    reduce_(chunk(in), chunk(in), tmp_, elems(in));  // data = data op incoming
  }

 private:
  std::int64_t elems(int c) const { return base_ + (c < rem_ ? 1 : 0); }
  char* chunk(int c) const {
    return data_ + static_cast<std::size_t>(c * base_ + std::min<std::int64_t>(c, rem_)) * elem_;
  }
  std::size_t bytes(int c) const { return static_cast<std::size_t>(elems(c)) * elem_; }

  char* data_;
  std::size_t elem_;
  std::int64_t count_;
  int n_;
  Reducer reduce_;
  std::int64_t base_ = 0, rem_ = 0;
  char* tmp_ = nullptr;
};

// Blocks of counts[b] elements, in rank order. Step s: send the partial result of block (r-s-1) to
// the right, receive the partial result of block (r-s-2) from the left and combine this rank's block
// with it; the last step's block is r itself, combined straight into `recv`.
class RingReduceScatter : public MpiRequest {
 public:
  RingReduceScatter(MpiCommunicator* c, int tag, BufferRef send, BufferRef recv,
                    const std::vector<std::int64_t>& counts, Reducer reduce)
      : MpiRequest(c, CommOp::reduce_scatter, tag),
        send_(static_cast<const char*>(send.data)),
        recv_(static_cast<char*>(recv.data)),
        elem_(dtype_size(send.type)),
        counts_(counts),
        offsets_(shard_offsets(counts)),
        n_(c->size()),
        reduce_(reduce) {
    if (n_ == 1) {
      if (bytes(0) > 0 && recv_ != send_) std::memmove(recv_, send_, bytes(0));
    } else if (total() > 0) {
      // Two block-sized halves, the second 8-byte aligned: the partial result and the incoming one.
      // Only the incoming one when there is no partial result to keep apart: with two ranks (the one
      // step combines straight into `recv`), or in place (`recv` is this rank's block of `send`, so
      // the caller gives up the rest of `send`: each block's partial result overwrites this rank's
      // elements of it, which are read once, just before).
      const std::int64_t most = *std::max_element(counts_.begin(), counts_.end());
      const std::size_t half = ring_reduce_scatter_scratch(most, 2, elem_, true);
      in_place_ = recv_ == own(rank());
      if (n_ == 2 || in_place_) {
        tmp_ = scratch(half);
      } else {
        acc_ = scratch(ring_reduce_scatter_scratch(most, n_, elem_, false));
        tmp_ = acc_ + half;
      }
    }
  }

 protected:
  int steps() const override { return (n_ == 1 || total() == 0) ? 0 : n_ - 1; }
  void post(int s) override {
    const int out = ring_mod(rank() - s - 1, n_), in = ring_mod(rank() - s - 2, n_);
    irecv(tmp_, bytes(in), left());
    isend(s == 0 || in_place_ ? own(out) : acc_, bytes(out), right());
  }
  void complete(int s) override {
    const int block = ring_mod(rank() - s - 2, n_);
    char* d = s == n_ - 2 ? recv_ : in_place_ ? const_cast<char*>(own(block)) : acc_;
    reduce_(d, tmp_, own(block), counts_[static_cast<std::size_t>(block)]);  // incoming op own
  }

 private:
  std::int64_t total() const { return offsets_.back(); }
  const char* own(int b) const {
    return send_ + static_cast<std::size_t>(offsets_[static_cast<std::size_t>(b)]) * elem_;
  }
  std::size_t bytes(int b) const { return static_cast<std::size_t>(counts_[static_cast<std::size_t>(b)]) * elem_; }

  const char* send_;
  char* recv_;
  std::size_t elem_;
  std::vector<std::int64_t> counts_, offsets_;
  int n_;
  Reducer reduce_;
  char *acc_ = nullptr, *tmp_ = nullptr;
  bool in_place_ = false;
};

// Blocks of counts[b] elements, in rank order. Own block copied into place at issue; step s sends
// block (r-s), receives block (r-s-1).
class RingAllGather : public MpiRequest {
 public:
  RingAllGather(MpiCommunicator* c, int tag, BufferRef send, BufferRef recv, const std::vector<std::int64_t>& counts)
      : MpiRequest(c, CommOp::all_gather, tag),
        recv_(static_cast<char*>(recv.data)),
        elem_(dtype_size(recv.type)),
        counts_(counts),
        offsets_(shard_offsets(counts)),
        n_(c->size()) {
    char* own = block(c->rank());
    if (bytes(c->rank()) > 0 && own != send.data) std::memmove(own, send.data, bytes(c->rank()));
  }

 protected:
  int steps() const override { return (n_ == 1 || offsets_.back() == 0) ? 0 : n_ - 1; }
  void post(int s) override {
    const int in = ring_mod(rank() - s - 1, n_), out = ring_mod(rank() - s, n_);
    irecv(block(in), bytes(in), left());
    isend(block(out), bytes(out), right());
  }

 private:
  char* block(int b) const { return recv_ + static_cast<std::size_t>(offsets_[static_cast<std::size_t>(b)]) * elem_; }
  std::size_t bytes(int b) const { return static_cast<std::size_t>(counts_[static_cast<std::size_t>(b)]) * elem_; }

  char* recv_;
  std::size_t elem_;
  std::vector<std::int64_t> counts_, offsets_;
  int n_;
};

// Pipelined chain in virtual ranks v = (r - root) mod N: the root sends segment t at step t; a middle
// rank receives segment t and forwards segment t-1 at step t; the last rank only receives. Segments
// are kBroadcastSegment bytes, whatever the element type.
class ChainBroadcast : public MpiRequest {
 public:
  ChainBroadcast(MpiCommunicator* c, int tag, BufferRef data, int root)
      : MpiRequest(c, CommOp::broadcast, tag),
        data_(static_cast<char*>(data.data)),
        bytes_(data.bytes()),
        n_(c->size()) {
    v_ = ring_mod(c->rank() - root, n_);
    segments_ = static_cast<int>((bytes_ + kBroadcastSegment - 1) / kBroadcastSegment);
  }

 protected:
  int steps() const override {
    if (n_ == 1 || segments_ == 0) return 0;
    const bool middle = v_ > 0 && v_ < n_ - 1;
    return middle ? segments_ + 1 : segments_;
  }
  void post(int t) override {
    if (v_ > 0 && t < segments_) irecv(seg(t), seg_bytes(t), left());
    if (v_ == 0)
      isend(seg(t), seg_bytes(t), right());
    else if (v_ < n_ - 1 && t >= 1)
      isend(seg(t - 1), seg_bytes(t - 1), right());
  }

 private:
  char* seg(int t) const { return data_ + static_cast<std::size_t>(t) * kBroadcastSegment; }
  std::size_t seg_bytes(int t) const {
    return std::min(kBroadcastSegment, bytes_ - static_cast<std::size_t>(t) * kBroadcastSegment);
  }

  char* data_;
  std::size_t bytes_;
  int n_;
  int v_ = 0;
  int segments_ = 0;
};

class PointToPoint : public MpiRequest {
 public:
  PointToPoint(MpiCommunicator* c, CommOp op, int tag, BufferRef data, int peer)
      : MpiRequest(c, op, tag), op_(op), data_(data.data), bytes_(data.bytes()), peer_(peer) {}

 protected:
  int steps() const override { return 1; }
  void post(int) override {
    if (op_ == CommOp::send)
      isend(data_, bytes_, peer_);
    else
      irecv(data_, bytes_, peer_);
  }

 private:
  CommOp op_;
  void* data_;  // only read when sending (MPI_Isend)
  std::size_t bytes_;
  int peer_;
};

// Every request is created as Finishing<Operation>: its destructor runs first, while the operation's
// steps are still alive, and completes the operation if it is outstanding.
template <class Op>
class Finishing final : public Op {
 public:
  using Op::Op;
  ~Finishing() override { this->finish(); }
};

MpiCommunicator::~MpiCommunicator() {
  const bool finalized = mpi_finalized();
  // Complete what is still outstanding (the requests outlive us only as empty shells); each wait
  // keeps the others moving, so the order does not matter.
  if (!finalized)
    for (MpiRequest* r : std::vector<MpiRequest*>(live_)) r->wait();
  for (MpiRequest* r : live_) r->detach();
  live_.clear();
  if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

bool MpiCommunicator::advance_others(const MpiRequest* except) {
  bool moved = false;
  const std::vector<MpiRequest*> live = live_;
  for (MpiRequest* r : live)
    if (r != except && !r->done()) {
      const std::uint64_t before = r->messages_done();
      r->test();
      moved |= r->messages_done() != before;
    }
  return moved;
}

int MpiCommunicator::world_rank(int rank) const {
  MPI_Group mine, world;
  MPI_Comm_group(comm_, &mine);
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  int in_world = MPI_UNDEFINED;
  MPI_Group_translate_ranks(mine, 1, &rank, world, &in_world);
  MPI_Group_free(&mine);
  MPI_Group_free(&world);
  return in_world;
}

void MpiCommunicator::progress() {
  const std::vector<MpiRequest*> live = live_;
  for (MpiRequest* r : live)
    if (!r->done()) r->test();
}

CommRequestPtr MpiCommunicator::start(CommOp op, std::unique_ptr<MpiRequest> r) {
  ++stats_.calls[static_cast<int>(op)];
  enroll(r.get());
  r->begin();
  return r;
}

void MpiCommunicator::check_host(const char* op, const char* what, const BufferRef& b) const {
  if (b.space != MemSpace::host)
    throw std::logic_error("communicator " + name_ + ": " + op + ": " + what + " is a " + mem_space_name(b.space) +
                           " buffer (" + std::to_string(b.count) + " " + dtype_name(b.type) +
                           " elements), and the MPI back end moves host buffers only; device buffers go through "
                           "the NCCL back end");
}

void MpiCommunicator::check_tag(const char* op, int tag) const {
  if (tag < 0 || tag >= kCollectiveTagBase)
    throw std::invalid_argument(std::string(op) + ": tag " + std::to_string(tag) + " outside [0, " +
                                std::to_string(kCollectiveTagBase) + ")");
}

CommRequestPtr MpiCommunicator::start_all_reduce(BufferRef data, ReduceOp op) {
  check_host("all_reduce", "data", data);
  const Reducer reduce = reducer(data.type, op);
  return start(CommOp::all_reduce,
               std::make_unique<Finishing<RingAllReduce>>(this, next_collective_tag(), data, reduce));
}

CommRequestPtr MpiCommunicator::start_reduce_scatter(BufferRef send, BufferRef recv,
                                                     const std::vector<std::int64_t>& counts, ReduceOp op) {
  check_host("reduce_scatter", "send", send);
  check_host("reduce_scatter", "recv", recv);
  const Reducer reduce = reducer(send.type, op);
  return start(CommOp::reduce_scatter,
               std::make_unique<Finishing<RingReduceScatter>>(this, next_collective_tag(), send, recv, counts, reduce));
}

CommRequestPtr MpiCommunicator::start_all_gather(BufferRef send, BufferRef recv,
                                                 const std::vector<std::int64_t>& counts) {
  check_host("all_gather", "send", send);
  check_host("all_gather", "recv", recv);
  return start(CommOp::all_gather,
               std::make_unique<Finishing<RingAllGather>>(this, next_collective_tag(), send, recv, counts));
}

CommRequestPtr MpiCommunicator::start_broadcast(BufferRef data, int root) {
  check_host("broadcast", "data", data);
  return start(CommOp::broadcast, std::make_unique<Finishing<ChainBroadcast>>(this, next_collective_tag(), data, root));
}

CommRequestPtr MpiCommunicator::start_send(BufferRef data, int peer, int tag) {
  check_host("send", "data", data);
  check_tag("send", tag);
  return start(CommOp::send, std::make_unique<Finishing<PointToPoint>>(this, CommOp::send, tag, data, peer));
}

CommRequestPtr MpiCommunicator::start_recv(BufferRef data, int peer, int tag) {
  check_host("recv", "data", data);
  check_tag("recv", tag);
  return start(CommOp::recv, std::make_unique<Finishing<PointToPoint>>(this, CommOp::recv, tag, data, peer));
}

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm, const std::string& name) {
  return std::make_unique<MpiCommunicator>(comm, name);
}

}  // namespace loom
