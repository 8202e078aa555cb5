// The MPI communicator (core/comm_mpi.cpp) under 1, 2 and 4 ranks: results of every operation on
// every rank, bitwise-identical all-reduce results, several outstanding operations completing out of
// order, and byte counters equal to what the ring (chain) algorithms send.
//
// Every rank runs every test and issues the same collectives in the same order; checks are EXPECTs
// (not ASSERTs) around collectives so that a failing rank does not leave the others hanging.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <set>
#include <stdexcept>
#include <vector>

#include "core/comm.hpp"

namespace loom {
namespace {

constexpr int kAR = static_cast<int>(CommOp::all_reduce);
constexpr int kRS = static_cast<int>(CommOp::reduce_scatter);
constexpr int kAG = static_cast<int>(CommOp::all_gather);
constexpr int kBC = static_cast<int>(CommOp::broadcast);
constexpr int kSend = static_cast<int>(CommOp::send);
constexpr int kRecv = static_cast<int>(CommOp::recv);

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}
int mod(std::int64_t a, int n) { return static_cast<int>(((a % n) + n) % n); }

// The counts every operation is tried with: 0, 1, N-1, N, a few more, and a large odd one.
std::vector<std::int64_t> test_counts() {
  const int n = world_size();
  std::set<std::int64_t> s{0, 1, n - 1, n, 2 * n + 1, 4 * n * 1000, 100003};
  return {s.begin(), s.end()};
}

// Small integers: sums over a few ranks are exact in float, so results can be compared exactly.
float ival(int rank, std::int64_t i) { return static_cast<float>((i * 131 + rank * 977) % 201 - 100); }

// Uniform in [-1, 1), a hash of (rank, i): sums depend on the order of addition.
double rval(int rank, std::int64_t i) {
  std::uint64_t z = (static_cast<std::uint64_t>(rank) << 40) ^ static_cast<std::uint64_t>(i);
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * (2.0 / 9007199254740992.0) - 1.0;
}

// What this rank's ring all-reduce sends for `count` elements: chunk c has count/N elements, +1 for
// c < count % N; the reduce-scatter phase sends chunks r, r-1, ..., r-N+2 and the all-gather phase
// chunks r+1, r, ..., r-N+3 (mod N).
std::uint64_t expected_all_reduce_bytes(std::int64_t count, int n, int r, std::size_t elem) {
  if (n == 1 || count == 0) return 0;
  auto sz = [&](int c) { return count / n + (c < count % n ? 1 : 0); };
  std::int64_t e = 0;
  for (int s = 0; s < n - 1; ++s) e += sz(mod(r - s, n));
  for (int g = 0; g < n - 1; ++g) e += sz(mod(r + 1 - g, n));
  return static_cast<std::uint64_t>(e) * elem;
}

std::uint64_t sum_over_ranks(std::uint64_t v) {
  std::uint64_t t = 0;
  MPI_Allreduce(&v, &t, 1, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD);
  return t;
}

// Rank 0's copy of v, compared byte for byte on every rank.
template <class T>
void expect_bitwise_same_on_all_ranks(const std::vector<T>& v) {
  if (v.empty()) return;  // every rank has the same count
  std::vector<T> root(v);
  MPI_Bcast(root.data(), static_cast<int>(root.size() * sizeof(T)), MPI_BYTE, 0, MPI_COMM_WORLD);
  EXPECT_EQ(0, std::memcmp(root.data(), v.data(), v.size() * sizeof(T))) << "differs from rank 0";
}

// Counts of mismatching elements, so that a failure prints one line rather than 100003.
template <class T, class F>
std::int64_t mismatches(const std::vector<T>& got, F expected) {
  std::int64_t bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (got[i] != expected(static_cast<std::int64_t>(i))) ++bad;
  return bad;
}

std::unique_ptr<Communicator> world_comm() { return make_mpi_communicator(MPI_COMM_WORLD, "world"); }

void expect_only(const CommStats& s, int op, std::uint64_t bytes) {
  for (int k = 0; k < kCommOps; ++k) {
    EXPECT_EQ(s.calls[k], k == op ? 1u : 0u) << comm_op_name(static_cast<CommOp>(k));
    EXPECT_GE(s.wait_s[k], 0.0);
    if (k != op) {
      EXPECT_EQ(s.bytes_sent[k], 0u) << comm_op_name(static_cast<CommOp>(k));
    }
  }
  EXPECT_EQ(s.bytes_sent[op], bytes) << comm_op_name(static_cast<CommOp>(op));
  EXPECT_EQ(s.total_bytes(), bytes);
  EXPECT_GE(s.total_wait(), 0.0);
}

TEST(Comm, Basics) {
  auto c = world_comm();
  EXPECT_EQ(c->name(), "world");
  EXPECT_EQ(c->rank(), world_rank());
  EXPECT_EQ(c->size(), world_size());
  EXPECT_STREQ(comm_op_name(CommOp::all_reduce), "all_reduce");
  EXPECT_STREQ(comm_op_name(CommOp::reduce_scatter), "reduce_scatter");
  EXPECT_STREQ(comm_op_name(CommOp::all_gather), "all_gather");
  EXPECT_STREQ(comm_op_name(CommOp::broadcast), "broadcast");
  EXPECT_STREQ(comm_op_name(CommOp::send), "send");
  EXPECT_STREQ(comm_op_name(CommOp::recv), "recv");
  EXPECT_DOUBLE_EQ(ring_all_reduce_bytes(1000, 4), 1500);
  EXPECT_DOUBLE_EQ(ring_reduce_scatter_bytes(1000, 4), 750);
  EXPECT_DOUBLE_EQ(ring_all_gather_bytes(1000, 4), 750);
  EXPECT_DOUBLE_EQ(ring_all_reduce_bytes(1000, 2), 1000);
  EXPECT_DOUBLE_EQ(ring_all_reduce_bytes(1000, 1), 0);
  EXPECT_DOUBLE_EQ(ring_reduce_scatter_bytes(1000, 1), 0);
  EXPECT_DOUBLE_EQ(ring_all_gather_bytes(1000, 1), 0);
  EXPECT_EQ(c->stats().total_bytes(), 0u);
  EXPECT_EQ(c->stats().total_wait(), 0.0);
  CommStats s;
  s.bytes_sent = {1, 2, 3, 4, 5, 6};
  s.wait_s = {0.5, 0.25, 0, 0, 0, 0.25};
  EXPECT_EQ(s.total_bytes(), 21u);
  EXPECT_DOUBLE_EQ(s.total_wait(), 1.0);
  c->barrier();
}

TEST(Comm, InvalidArgumentsThrow) {
  auto c = world_comm();
  float x = 0;
  EXPECT_THROW(c->send_async(&x, 1, 0, 1000), std::invalid_argument);  // collective tag range
  EXPECT_THROW(c->recv_async(&x, 1, 0, -1), std::invalid_argument);
  EXPECT_THROW(c->send_async(&x, 1, world_size(), 0), std::invalid_argument);
  EXPECT_THROW(c->recv_async(&x, 1, -1, 0), std::invalid_argument);
  EXPECT_THROW(c->broadcast_async(&x, 1, world_size()), std::invalid_argument);
  EXPECT_EQ(c->stats().total_bytes(), 0u);
}

template <class T>
void check_all_reduce_exact() {
  auto c = world_comm();
  const int n = c->size(), r = c->rank();
  for (std::int64_t count : test_counts()) {
    SCOPED_TRACE("count " + std::to_string(count));
    std::vector<T> v(static_cast<std::size_t>(count));
    for (std::int64_t i = 0; i < count; ++i) v[i] = static_cast<T>(ival(r, i));
    c->reset_stats();
    c->all_reduce(v.data(), count);
    EXPECT_EQ(0, mismatches(v, [&](std::int64_t i) {
                T s = 0;
                for (int q = 0; q < n; ++q) s += static_cast<T>(ival(q, i));
                return s;
              }));
    const std::uint64_t expect = expected_all_reduce_bytes(count, n, r, sizeof(T));
    expect_only(c->stats(), kAR, expect);
    // Over all ranks: 2(N-1) chunk messages per rank, each chunk sent 2(N-1) times in all.
    EXPECT_EQ(sum_over_ranks(c->stats().bytes_sent[kAR]),
              static_cast<std::uint64_t>(2 * (n - 1) * count) * sizeof(T));
    if (count % n == 0) {
      EXPECT_DOUBLE_EQ(static_cast<double>(c->stats().bytes_sent[kAR]),
                       ring_all_reduce_bytes(static_cast<double>(count * sizeof(T)), n));
    }
    expect_bitwise_same_on_all_ranks(v);
  }
}

TEST(Comm, AllReduceFloat) { check_all_reduce_exact<float>(); }
TEST(Comm, AllReduceDouble) { check_all_reduce_exact<double>(); }

// Values whose sums depend on the order of addition: close to the exact sum, and bitwise the same on
// every rank.
template <class T>
void check_all_reduce_bitwise(double tol) {
  auto c = world_comm();
  const int n = c->size(), r = c->rank();
  for (std::int64_t count : test_counts()) {
    SCOPED_TRACE("count " + std::to_string(count));
    std::vector<T> v(static_cast<std::size_t>(count));
    for (std::int64_t i = 0; i < count; ++i) v[i] = static_cast<T>(rval(r, i));
    c->all_reduce(v.data(), count);
    std::int64_t bad = 0;
    for (std::int64_t i = 0; i < count; ++i) {
      double s = 0;
      for (int q = 0; q < n; ++q) s += static_cast<double>(static_cast<T>(rval(q, i)));
      if (std::abs(static_cast<double>(v[i]) - s) > tol) ++bad;
    }
    EXPECT_EQ(bad, 0);
    expect_bitwise_same_on_all_ranks(v);
  }
}

TEST(Comm, AllReduceFloatBitwiseIdenticalAcrossRanks) { check_all_reduce_bitwise<float>(1e-5); }
TEST(Comm, AllReduceDoubleBitwiseIdenticalAcrossRanks) { check_all_reduce_bitwise<double>(1e-13); }

TEST(Comm, ReduceScatter) {
  auto c = world_comm();
  const int n = c->size(), r = c->rank();
  for (std::int64_t rc : test_counts()) {
    SCOPED_TRACE("recv_count " + std::to_string(rc));
    std::vector<float> send(static_cast<std::size_t>(n * rc)), recv(static_cast<std::size_t>(rc), -1e9f);
    for (std::int64_t i = 0; i < n * rc; ++i) send[i] = ival(r, i);
    c->reset_stats();
    c->reduce_scatter(send.data(), recv.data(), rc);
    EXPECT_EQ(0, mismatches(recv, [&](std::int64_t i) {
                float s = 0;
                for (int q = 0; q < n; ++q) s += ival(q, r * rc + i);
                return s;
              }));
    const std::uint64_t bytes = static_cast<std::uint64_t>((n - 1) * rc) * sizeof(float);
    expect_only(c->stats(), kRS, bytes);
    EXPECT_DOUBLE_EQ(static_cast<double>(bytes), ring_reduce_scatter_bytes(double(n * rc * sizeof(float)), n));
  }
}

TEST(Comm, AllGather) {
  auto c = world_comm();
  const int n = c->size(), r = c->rank();
  for (std::int64_t sc : test_counts()) {
    SCOPED_TRACE("send_count " + std::to_string(sc));
    std::vector<float> send(static_cast<std::size_t>(sc)), recv(static_cast<std::size_t>(n * sc), -1e9f);
    for (std::int64_t i = 0; i < sc; ++i) send[i] = ival(r, i);
    c->reset_stats();
    c->all_gather(send.data(), recv.data(), sc);
    EXPECT_EQ(0, mismatches(recv, [&](std::int64_t i) { return ival(static_cast<int>(i / sc), i % sc); }));
    const std::uint64_t bytes = static_cast<std::uint64_t>((n - 1) * sc) * sizeof(float);
    expect_only(c->stats(), kAG, bytes);
    EXPECT_DOUBLE_EQ(static_cast<double>(bytes), ring_all_gather_bytes(double(n * sc * sizeof(float)), n));
  }
}

void check_broadcast(int root) {
  auto c = world_comm();
  const int n = c->size(), r = c->rank();
  std::vector<std::int64_t> counts = test_counts();
  counts.push_back(600007);  // several pipeline segments
  for (std::int64_t count : counts) {
    SCOPED_TRACE("count " + std::to_string(count) + " root " + std::to_string(root));
    std::vector<float> v(static_cast<std::size_t>(count), -1e9f);
    if (r == root)
      for (std::int64_t i = 0; i < count; ++i) v[i] = ival(root, i);
    c->reset_stats();
    c->broadcast(v.data(), count, root);
    EXPECT_EQ(0, mismatches(v, [&](std::int64_t i) { return ival(root, i); }));
    // Chain root -> root+1 -> ...: every rank but the last in the chain sends M once.
    const bool last = mod(r - root, n) == n - 1;
    const std::uint64_t bytes = last ? 0 : static_cast<std::uint64_t>(count) * sizeof(float);
    expect_only(c->stats(), kBC, bytes);
    EXPECT_EQ(sum_over_ranks(bytes), static_cast<std::uint64_t>((n - 1) * count) * sizeof(float));
  }
}

TEST(Comm, BroadcastFromRoot0) { check_broadcast(0); }
TEST(Comm, BroadcastFromLastRank) { check_broadcast(world_size() - 1); }

TEST(Comm, SendRecvRing) {
  auto c = world_comm();
  const int n = c->size(), r = c->rank();
  const int right = mod(r + 1, n), left = mod(r - 1, n);
  for (std::int64_t count : test_counts()) {
    SCOPED_TRACE("count " + std::to_string(count));
    std::vector<float> out(static_cast<std::size_t>(count)), in(static_cast<std::size_t>(count), -1e9f);
    for (std::int64_t i = 0; i < count; ++i) out[i] = ival(r, i);
    c->reset_stats();
    auto rq = c->recv_async(in.data(), count, left, 7);
    auto sq = c->send_async(out.data(), count, right, 7);
    rq->wait();
    sq->wait();
    EXPECT_TRUE(rq->test());
    EXPECT_TRUE(sq->test());
    EXPECT_EQ(0, mismatches(in, [&](std::int64_t i) { return ival(left, i); }));
    const CommStats& s = c->stats();
    EXPECT_EQ(s.calls[kSend], 1u);
    EXPECT_EQ(s.calls[kRecv], 1u);
    EXPECT_EQ(s.bytes_sent[kSend], static_cast<std::uint64_t>(count) * sizeof(float));
    EXPECT_EQ(s.bytes_sent[kRecv], 0u);
    EXPECT_GE(s.wait_s[kSend], 0.0);
    EXPECT_GE(s.wait_s[kRecv], 0.0);
    EXPECT_EQ(s.total_bytes(), s.bytes_sent[kSend]);
  }
}

// Blocking forms between pairs (0,1), (2,3), ...: even ranks send first, odd ranks receive first.
TEST(Comm, SendRecvBlockingPairs) {
  auto c = world_comm();
  const int n = c->size(), r = c->rank();
  const int peer = r ^ 1;
  if (peer >= n) return;
  const std::int64_t count = 100003;
  std::vector<float> out(count), in(count, -1e9f);
  for (std::int64_t i = 0; i < count; ++i) out[i] = ival(r, i);
  if (r % 2 == 0) {
    c->send(out.data(), count, peer, 3);
    c->recv(in.data(), count, peer, 4);
  } else {
    c->recv(in.data(), count, peer, 3);
    c->send(out.data(), count, peer, 4);
  }
  EXPECT_EQ(0, mismatches(in, [&](std::int64_t i) { return ival(peer, i); }));
  EXPECT_EQ(c->stats().bytes_sent[kSend], count * sizeof(float));
  EXPECT_EQ(c->stats().bytes_sent[kRecv], 0u);
  EXPECT_EQ(c->stats().calls[kRecv], 1u);
}

// Several outstanding operations of different kinds on one communicator.
struct Batch {
  int n, r;
  std::int64_t na = 100003, nb = 5, nc = 777, nd = 1001;
  std::vector<float> a, cs, cr, ds, dr;
  std::vector<double> b;
  explicit Batch(const Communicator& c) : n(c.size()), r(c.rank()) {
    a.resize(na);
    b.resize(nb);
    cs.resize(nc);
    cr.assign(n * nc, -1e9f);
    ds.resize(n * nd);
    dr.assign(nd, -1e9f);
    for (std::int64_t i = 0; i < na; ++i) a[i] = ival(r, i);
    for (std::int64_t i = 0; i < nb; ++i) b[i] = ival(r, i + 17);
    for (std::int64_t i = 0; i < nc; ++i) cs[i] = ival(r, i + 3);
    for (std::int64_t i = 0; i < n * nd; ++i) ds[i] = ival(r, i + 5);
  }
  // All four in flight at once, started in this order on every rank (a braced list is evaluated
  // left to right): two all-reduces (float, double), an all-gather, a reduce-scatter.
  std::array<CommRequestPtr, 4> start(Communicator& c) {
    return {c.all_reduce_async(a.data(), na), c.all_reduce_async(b.data(), nb),
            c.all_gather_async(cs.data(), cr.data(), nc), c.reduce_scatter_async(ds.data(), dr.data(), nd)};
  }
  void check(const CommStats& s) const {
    EXPECT_EQ(0, mismatches(a, [&](std::int64_t i) {
                float t = 0;
                for (int q = 0; q < n; ++q) t += ival(q, i);
                return t;
              }));
    EXPECT_EQ(0, mismatches(b, [&](std::int64_t i) {
                double t = 0;
                for (int q = 0; q < n; ++q) t += ival(q, i + 17);
                return t;
              }));
    EXPECT_EQ(0, mismatches(cr, [&](std::int64_t i) { return ival(static_cast<int>(i / nc), i % nc + 3); }));
    EXPECT_EQ(0, mismatches(dr, [&](std::int64_t i) {
                float t = 0;
                for (int q = 0; q < n; ++q) t += ival(q, r * nd + i + 5);
                return t;
              }));
    EXPECT_EQ(s.calls[kAR], 2u);
    EXPECT_EQ(s.calls[kAG], 1u);
    EXPECT_EQ(s.calls[kRS], 1u);
    EXPECT_EQ(s.bytes_sent[kAR],
              expected_all_reduce_bytes(na, n, r, sizeof(float)) + expected_all_reduce_bytes(nb, n, r, sizeof(double)));
    EXPECT_EQ(s.bytes_sent[kAG], static_cast<std::uint64_t>((n - 1) * nc) * sizeof(float));
    EXPECT_EQ(s.bytes_sent[kRS], static_cast<std::uint64_t>((n - 1) * nd) * sizeof(float));
    for (int k = 0; k < kCommOps; ++k) EXPECT_GE(s.wait_s[k], 0.0);
  }
};

TEST(Comm, AsyncOutOfOrderCompletion) {
  auto c = world_comm();
  Batch t(*c);
  auto [A, B, C, D] = t.start(*c);
  D->wait();
  B->wait();
  EXPECT_TRUE(B->test());
  C->wait();
  A->wait();
  EXPECT_TRUE(A->test());
  t.check(c->stats());
}

// Ranks wait on their outstanding operations in different orders: a rank blocked on one request
// keeps the communicator's others moving.
TEST(Comm, AsyncDifferentWaitOrderPerRank) {
  auto c = world_comm();
  Batch t(*c);
  auto [A, B, C, D] = t.start(*c);
  if (c->rank() % 2 == 0) {
    A->wait();
    B->wait();
    C->wait();
    D->wait();
  } else {
    D->wait();
    C->wait();
    B->wait();
    A->wait();
  }
  t.check(c->stats());
}

TEST(Comm, AsyncProgressAndTestLoops) {
  auto c = world_comm();
  Batch t(*c);
  auto [A, B, C, D] = t.start(*c);
  long spins = 0;
  for (;;) {
    c->progress();
    const bool a = A->test(), b = B->test(), cc = C->test(), d = D->test();
    if (a && b && cc && d) break;
    ++spins;
  }
  // progress() alone, then test(): B is tiny and long done.
  EXPECT_TRUE(B->test());
  t.check(c->stats());
  const CommStats& s = c->stats();
  for (int k = 0; k < kCommOps; ++k) EXPECT_EQ(s.wait_s[k], 0.0);  // nobody waited
  EXPECT_GE(spins, 0);
}

TEST(Comm, ProgressOnlyCompletesRequests) {
  auto c = world_comm();
  const int n = c->size(), r = c->rank();
  std::vector<float> v(4097);
  for (std::int64_t i = 0; i < 4097; ++i) v[i] = ival(r, i);
  auto A = c->all_reduce_async(v.data(), 4097);
  // Drive it with progress() only, on every rank, until every rank sees it complete.
  int mine = 0, all = 0;
  while (!all) {
    c->progress();
    mine = A->test() ? 1 : 0;
    MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  }
  EXPECT_EQ(0, mismatches(v, [&](std::int64_t i) {
              float t = 0;
              for (int q = 0; q < n; ++q) t += ival(q, i);
              return t;
            }));
}

// Many small outstanding collectives, waited in reverse: the per-operation tags keep them apart.
TEST(Comm, ManyOutstandingWaitedInReverse) {
  auto c = world_comm();
  const int n = c->size(), r = c->rank();
  const int k = 64;
  std::vector<std::vector<float>> v(k);
  std::vector<CommRequestPtr> req;
  for (int j = 0; j < k; ++j) {
    v[j].resize(j + 1);
    for (int i = 0; i <= j; ++i) v[j][i] = ival(r, i * 100 + j);
    req.push_back(c->all_reduce_async(v[j].data(), j + 1));
  }
  for (int j = k - 1; j >= 0; --j) req[j]->wait();
  for (int j = 0; j < k; ++j)
    EXPECT_EQ(0, mismatches(v[j], [&](std::int64_t i) {
                float t = 0;
                for (int q = 0; q < n; ++q) t += ival(q, i * 100 + j);
                return t;
              })) << "operation " << j;
  EXPECT_EQ(c->stats().calls[kAR], static_cast<std::uint64_t>(k));
}

// A request dropped before completion completes in its destructor.
TEST(Comm, RequestDestroyedBeforeCompletionCompletes) {
  auto c = world_comm();
  const int n = c->size(), r = c->rank();
  std::vector<float> v(100003), g(n * 33, -1e9f), s(33);
  for (std::int64_t i = 0; i < 100003; ++i) v[i] = ival(r, i);
  for (int i = 0; i < 33; ++i) s[i] = ival(r, i);
  {
    auto A = c->all_reduce_async(v.data(), 100003);
    auto B = c->all_gather_async(s.data(), g.data(), 33);
  }
  EXPECT_EQ(0, mismatches(v, [&](std::int64_t i) {
              float t = 0;
              for (int q = 0; q < n; ++q) t += ival(q, i);
              return t;
            }));
  EXPECT_EQ(0, mismatches(g, [&](std::int64_t i) { return ival(static_cast<int>(i / 33), i % 33); }));
}

// A communicator destroyed with a request still outstanding completes it first.
TEST(Comm, CommunicatorDestroyedBeforeRequest) {
  const int n = world_size(), r = world_rank();
  std::vector<float> v(1000);
  for (int i = 0; i < 1000; ++i) v[i] = ival(r, i);
  CommRequestPtr A;
  {
    auto c = world_comm();
    A = c->all_reduce_async(v.data(), 1000);
  }
  EXPECT_TRUE(A->test());
  A->wait();
  EXPECT_EQ(0, mismatches(v, [&](std::int64_t i) {
              float t = 0;
              for (int q = 0; q < n; ++q) t += ival(q, i);
              return t;
            }));
}

TEST(Comm, SumAndSubCommunicators) {
  auto c = world_comm();
  const int n = c->size(), r = c->rank();
  c->reset_stats();
  EXPECT_EQ(c->sum(r + 1.0), n * (n + 1) / 2.0);
  EXPECT_EQ(c->stats().calls[kAR], 1u);
  EXPECT_EQ(c->stats().bytes_sent[kAR], expected_all_reduce_bytes(1, n, r, sizeof(double)));

  // Even and odd ranks, each its own communicator, used interleaved with the world one.
  MPI_Comm split;
  MPI_Comm_split(MPI_COMM_WORLD, r % 2, r, &split);
  auto sub = make_mpi_communicator(split, r % 2 ? "odd" : "even");
  MPI_Comm_free(&split);  // the communicator holds its own duplicate
  const int sn = (n + 1 - r % 2) / 2;
  EXPECT_EQ(sub->size(), sn);
  EXPECT_EQ(sub->rank(), r / 2);
  std::vector<float> a(301), b(301);
  for (int i = 0; i < 301; ++i) a[i] = b[i] = ival(r, i);
  auto A = sub->all_reduce_async(a.data(), 301);
  auto B = c->all_reduce_async(b.data(), 301);
  A->wait();
  B->wait();
  EXPECT_EQ(0, mismatches(a, [&](std::int64_t i) {
              float t = 0;
              for (int q = r % 2; q < n; q += 2) t += ival(q, i);
              return t;
            }));
  EXPECT_EQ(0, mismatches(b, [&](std::int64_t i) {
              float t = 0;
              for (int q = 0; q < n; ++q) t += ival(q, i);
              return t;
            }));
  EXPECT_EQ(sub->stats().bytes_sent[kAR], expected_all_reduce_bytes(301, sn, r / 2, sizeof(float)));
}

}  // namespace
}  // namespace loom
