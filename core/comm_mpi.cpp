// The MPI back end of the communicator interface (core/comm.hpp).
//
// Every collective is a ring (or, for broadcast, a pipelined chain) of nonblocking point-to-point
// messages that this file posts itself, so the per-operation byte counters are measurements.
//
// Requests are state machines. An operation is a sequence of steps; a step posts a few
// MPI_Irecv/MPI_Isend (receives first), and once all of them have completed the request does the
// step's local work (e.g. adds the received chunk into the data) and posts the next step. A request
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
// Algorithms and per-rank send volumes (M = payload bytes, N = ranks, r = this rank):
//   all_reduce      ring reduce-scatter then ring all-gather over N chunks whose sizes differ by at
//                   most one element (chunk i has count/N elements, +1 for i < count % N; chunks are
//                   empty when count < N). Reduce-scatter step s (0..N-2) sends chunk (r-s) and adds
//                   the incoming chunk (r-s-1) into the data; afterwards rank r owns the reduced chunk
//                   (r+1). All-gather step s (0..N-2) sends chunk (r+1-s) and receives chunk (r-s)
//                   straight into the data. 2(N-1) messages: every chunk except (r+1) and every
//                   chunk except (r+2) once each, i.e. 2(N-1)/N * M up to chunk rounding. Each chunk
//                   is reduced on exactly one rank and then copied, so all ranks end with bitwise
//                   identical results.
//   reduce_scatter  ring, N-1 messages of recv_count elements: (N-1)/N * M (M = the whole input).
//   all_gather      ring, N-1 messages of send_count elements: (N-1)/N * M (M = the whole output).
//   broadcast       pipelined chain root -> root+1 -> ... -> root+N-1 (mod N) in segments of
//                   kBroadcastSegment floats: every rank but the last in the chain sends M once, the
//                   last sends nothing ((N-1) M in total, the minimum). A chain rather than a tree:
//                   the volume per rank is at most M and, pipelined, the time is ~ M/bandwidth +
//                   N * segment latency, which suits the large parameter broadcasts loom does.
//   send / recv     one message; recv sends no bytes but counts its calls and wait time.
// Operations with zero elements (all ranks agree on the count) and every collective on one rank
// send no messages and complete at once; send/recv always exchange a (possibly empty) message.
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
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

#include "core/comm.hpp"
#include "core/fault.hpp"

namespace loom {

const char* comm_op_name(CommOp op) {
  switch (op) {
    case CommOp::all_reduce: return "all_reduce";
    case CommOp::reduce_scatter: return "reduce_scatter";
    case CommOp::all_gather: return "all_gather";
    case CommOp::broadcast: return "broadcast";
    case CommOp::send: return "send";
    case CommOp::recv: return "recv";
    case CommOp::count_: break;
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

double ring_all_reduce_bytes(double M, int N) { return N <= 1 ? 0.0 : 2.0 * (N - 1) * M / N; }
double ring_reduce_scatter_bytes(double M, int N) { return N <= 1 ? 0.0 : (N - 1) * M / N; }
double ring_all_gather_bytes(double M, int N) { return N <= 1 ? 0.0 : (N - 1) * M / N; }

namespace {

constexpr int kCollectiveTagBase = 1000;
constexpr int kCollectiveTagRange = 30000;
// Small enough that a transfer which starts while its wait is sleeping completes a piece within a few
// sleeps, which puts the wait back to polling flat out.
constexpr std::size_t kMessagePieceBytes = std::size_t{4} << 20;
constexpr std::int64_t kBroadcastSegment = std::int64_t{1} << 18;  // floats: 1 MiB

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

double now() { return MPI_Wtime(); }

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

class MpiRequest;

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, std::string name) : name_(std::move(name)) {
    MPI_Comm_dup(comm, &comm_);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiCommunicator() override;

  const std::string& name() const override { return name_; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  CommRequestPtr all_reduce_async(float* data, std::int64_t count) override;
  CommRequestPtr all_reduce_async(double* data, std::int64_t count) override;
  CommRequestPtr reduce_scatter_async(const float* send, float* recv, std::int64_t recv_count) override;
  CommRequestPtr all_gather_async(const float* send, float* recv, std::int64_t send_count) override;
  CommRequestPtr broadcast_async(float* data, std::int64_t count, int root) override;
  CommRequestPtr send_async(const float* data, std::int64_t count, int peer, int tag) override;
  CommRequestPtr recv_async(float* data, std::int64_t count, int peer, int tag) override;
  void progress() override;
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

 private:
  template <class T>
  CommRequestPtr all_reduce_impl(T* data, std::int64_t count);
  CommRequestPtr start(std::unique_ptr<MpiRequest> r);
  void check_peer(int peer, const char* what) const;

  std::string name_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::uint64_t seq_ = 0;
  std::vector<MpiRequest*> live_;
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
        reqs_.clear();
        peers_.clear();
        step_bytes_ = 0;
      }
      if (step_ >= 0) complete(step_);
      ++step_;
      if (step_ >= steps()) {
        done_ = true;
        break;
      }
      post(step_);
    }
    return true;
  }

  bool done() const { return done_; }
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
    if (receiving) why << (one ? ": its message never arrived" : ": their messages never arrived");
    else why << (one ? ": it never took the message sent to it" : ": they never took the messages sent to them");
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
  std::uint64_t messages_done_ = 0;
};

template <class T>
class RingAllReduce : public MpiRequest {
 public:
  RingAllReduce(MpiCommunicator* c, int tag, T* data, std::int64_t count)
      : MpiRequest(c, CommOp::all_reduce, tag), data_(data), count_(count), n_(c->size()) {
    base_ = count / n_;
    rem_ = count % n_;
    if (n_ > 1 && count > 0) tmp_.resize(static_cast<std::size_t>(base_ + (rem_ > 0 ? 1 : 0)));
  }

 protected:
  int steps() const override { return (n_ == 1 || count_ == 0) ? 0 : 2 * (n_ - 1); }
  void post(int s) override {
    const int r = rank();
    if (s < n_ - 1) {  // reduce-scatter
      const int out = ring_mod(r - s, n_), in = ring_mod(r - s - 1, n_);
      irecv(tmp_.data(), bytes(in), left());
      isend(data_ + offset(out), bytes(out), right());
    } else {  // all-gather
      const int g = s - (n_ - 1);
      const int out = ring_mod(r + 1 - g, n_), in = ring_mod(r - g, n_);
      irecv(data_ + offset(in), bytes(in), left());
      isend(data_ + offset(out), bytes(out), right());
    }
  }
  void complete(int s) override {
    if (s >= n_ - 1) return;
    const int in = ring_mod(rank() - s - 1, n_);
    T* d = data_ + offset(in);
    const T* t = tmp_.data();
    const std::int64_t n = elems(in);
    for (std::int64_t i = 0; i < n; ++i) d[i] += t[i];
  }

 private:
  std::int64_t elems(int chunk) const { return base_ + (chunk < rem_ ? 1 : 0); }
  std::int64_t offset(int chunk) const { return chunk * base_ + std::min<std::int64_t>(chunk, rem_); }
  std::size_t bytes(int chunk) const { return static_cast<std::size_t>(elems(chunk)) * sizeof(T); }

  T* data_;
  std::int64_t count_;
  int n_;
  std::int64_t base_ = 0, rem_ = 0;
  std::vector<T> tmp_;
};

// Step s: send the partial sum of block (r-s-1) to the right, receive the partial sum of block
// (r-s-2) from the left and add this rank's block to it; the last step's block is r itself.
class RingReduceScatter : public MpiRequest {
 public:
  RingReduceScatter(MpiCommunicator* c, int tag, const float* send, float* recv, std::int64_t count)
      : MpiRequest(c, CommOp::reduce_scatter, tag), send_(send), recv_(recv), count_(count), n_(c->size()) {
    if (n_ == 1) {
      if (count > 0 && recv != send) std::memmove(recv, send, bytes());
    } else if (count > 0) {
      acc_.resize(static_cast<std::size_t>(count));
      tmp_.resize(static_cast<std::size_t>(count));
    }
  }

 protected:
  int steps() const override { return (n_ == 1 || count_ == 0) ? 0 : n_ - 1; }
  void post(int s) override {
    irecv(tmp_.data(), bytes(), left());
    const float* out = s == 0 ? send_ + ring_mod(rank() - 1, n_) * count_ : acc_.data();
    isend(out, bytes(), right());
  }
  void complete(int s) override {
    const int block = ring_mod(rank() - s - 2, n_);
    const float* own = send_ + block * count_;
    const float* t = tmp_.data();
    float* d = s == n_ - 2 ? recv_ : acc_.data();
    for (std::int64_t i = 0; i < count_; ++i) d[i] = t[i] + own[i];
  }

 private:
  std::size_t bytes() const { return static_cast<std::size_t>(count_) * sizeof(float); }

  const float* send_;
  float* recv_;
  std::int64_t count_;
  int n_;
  std::vector<float> acc_, tmp_;
};

// Own block copied into place at issue; step s sends block (r-s), receives block (r-s-1).
class RingAllGather : public MpiRequest {
 public:
  RingAllGather(MpiCommunicator* c, int tag, const float* send, float* recv, std::int64_t count)
      : MpiRequest(c, CommOp::all_gather, tag), recv_(recv), count_(count), n_(c->size()) {
    float* own = recv + c->rank() * count;
    if (count > 0 && own != send) std::memmove(own, send, bytes());
  }

 protected:
  int steps() const override { return (n_ == 1 || count_ == 0) ? 0 : n_ - 1; }
  void post(int s) override {
    irecv(recv_ + ring_mod(rank() - s - 1, n_) * count_, bytes(), left());
    isend(recv_ + ring_mod(rank() - s, n_) * count_, bytes(), right());
  }

 private:
  std::size_t bytes() const { return static_cast<std::size_t>(count_) * sizeof(float); }

  float* recv_;
  std::int64_t count_;
  int n_;
};

// Pipelined chain in virtual ranks v = (r - root) mod N: the root sends segment t at step t; a middle
// rank receives segment t and forwards segment t-1 at step t; the last rank only receives.
class ChainBroadcast : public MpiRequest {
 public:
  ChainBroadcast(MpiCommunicator* c, int tag, float* data, std::int64_t count, int root)
      : MpiRequest(c, CommOp::broadcast, tag), data_(data), count_(count), n_(c->size()) {
    v_ = ring_mod(c->rank() - root, n_);
    segments_ = static_cast<int>((count + kBroadcastSegment - 1) / kBroadcastSegment);
  }

 protected:
  int steps() const override {
    if (n_ == 1 || segments_ == 0) return 0;
    const bool middle = v_ > 0 && v_ < n_ - 1;
    return middle ? segments_ + 1 : segments_;
  }
  void post(int t) override {
    if (v_ > 0 && t < segments_) irecv(seg(t), seg_bytes(t), left());
    if (v_ == 0) isend(seg(t), seg_bytes(t), right());
    else if (v_ < n_ - 1 && t >= 1) isend(seg(t - 1), seg_bytes(t - 1), right());
  }

 private:
  float* seg(int t) const { return data_ + t * kBroadcastSegment; }
  std::size_t seg_bytes(int t) const {
    const std::int64_t lo = t * kBroadcastSegment;
    return static_cast<std::size_t>(std::min(kBroadcastSegment, count_ - lo)) * sizeof(float);
  }

  float* data_;
  std::int64_t count_;
  int n_;
  int v_ = 0;
  int segments_ = 0;
};

class PointToPoint : public MpiRequest {
 public:
  PointToPoint(MpiCommunicator* c, CommOp op, int tag, float* data, std::int64_t count, int peer)
      : MpiRequest(c, op, tag), op_(op), data_(data), count_(count), peer_(peer) {}

 protected:
  int steps() const override { return 1; }
  void post(int) override {
    const std::size_t bytes = static_cast<std::size_t>(count_) * sizeof(float);
    if (op_ == CommOp::send) isend(data_, bytes, peer_);
    else irecv(data_, bytes, peer_);
  }

 private:
  CommOp op_;
  float* data_;
  std::int64_t count_;
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

CommRequestPtr MpiCommunicator::start(std::unique_ptr<MpiRequest> r) {
  enroll(r.get());
  r->begin();
  return r;
}

void MpiCommunicator::check_peer(int peer, const char* what) const {
  if (peer < 0 || peer >= size_)
    throw std::invalid_argument(std::string("communicator ") + name_ + ": " + what + " " + std::to_string(peer) +
                                " is not a rank of a communicator of size " + std::to_string(size_));
}

template <class T>
CommRequestPtr MpiCommunicator::all_reduce_impl(T* data, std::int64_t count) {
  if (count < 0) throw std::invalid_argument("all_reduce: negative count");
  ++stats_.calls[static_cast<int>(CommOp::all_reduce)];
  return start(std::make_unique<Finishing<RingAllReduce<T>>>(this, next_collective_tag(), data, count));
}

CommRequestPtr MpiCommunicator::all_reduce_async(float* data, std::int64_t count) {
  return all_reduce_impl(data, count);
}
CommRequestPtr MpiCommunicator::all_reduce_async(double* data, std::int64_t count) {
  return all_reduce_impl(data, count);
}

CommRequestPtr MpiCommunicator::reduce_scatter_async(const float* send, float* recv, std::int64_t recv_count) {
  if (recv_count < 0) throw std::invalid_argument("reduce_scatter: negative count");
  ++stats_.calls[static_cast<int>(CommOp::reduce_scatter)];
  return start(std::make_unique<Finishing<RingReduceScatter>>(this, next_collective_tag(), send, recv, recv_count));
}

CommRequestPtr MpiCommunicator::all_gather_async(const float* send, float* recv, std::int64_t send_count) {
  if (send_count < 0) throw std::invalid_argument("all_gather: negative count");
  ++stats_.calls[static_cast<int>(CommOp::all_gather)];
  return start(std::make_unique<Finishing<RingAllGather>>(this, next_collective_tag(), send, recv, send_count));
}

CommRequestPtr MpiCommunicator::broadcast_async(float* data, std::int64_t count, int root) {
  if (count < 0) throw std::invalid_argument("broadcast: negative count");
  check_peer(root, "broadcast root");
  ++stats_.calls[static_cast<int>(CommOp::broadcast)];
  return start(std::make_unique<Finishing<ChainBroadcast>>(this, next_collective_tag(), data, count, root));
}

CommRequestPtr MpiCommunicator::send_async(const float* data, std::int64_t count, int peer, int tag) {
  if (count < 0) throw std::invalid_argument("send: negative count");
  check_peer(peer, "send peer");
  if (tag < 0 || tag >= kCollectiveTagBase)
    throw std::invalid_argument("send: tag " + std::to_string(tag) + " outside [0, " +
                                std::to_string(kCollectiveTagBase) + ")");
  ++stats_.calls[static_cast<int>(CommOp::send)];
  // The buffer is only read (MPI_Isend); PointToPoint stores one pointer type for both directions.
  return start(std::make_unique<Finishing<PointToPoint>>(this, CommOp::send, tag, const_cast<float*>(data), count, peer));
}

CommRequestPtr MpiCommunicator::recv_async(float* data, std::int64_t count, int peer, int tag) {
  if (count < 0) throw std::invalid_argument("recv: negative count");
  check_peer(peer, "recv peer");
  if (tag < 0 || tag >= kCollectiveTagBase)
    throw std::invalid_argument("recv: tag " + std::to_string(tag) + " outside [0, " +
                                std::to_string(kCollectiveTagBase) + ")");
  ++stats_.calls[static_cast<int>(CommOp::recv)];
  return start(std::make_unique<Finishing<PointToPoint>>(this, CommOp::recv, tag, data, count, peer));
}

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm, const std::string& name) {
  return std::make_unique<MpiCommunicator>(comm, name);
}

}  // namespace loom
