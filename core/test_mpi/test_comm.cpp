// The MPI communicator (core/comm/comm_mpi.cpp) under 1, 2 and 4 ranks: results of every operation on
// every rank, bitwise-identical all-reduce results, several outstanding operations completing out of
// order, and byte counters equal to what the ring (chain) algorithms send. The typed operations for
// every element type: sums and maxima (exact on small integers), reduce-scatter and all-gather with
// equal and variable counts, broadcast and send/recv moving every bit, the documented rounding,
// saturation and wrapping, the argument checks, and the ring scratch in the memory ledger.
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
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "core/comm/comm.hpp"
#include "core/base/dtype.hpp"
#include "core/base/ledger.hpp"
#include "core/test_mpi/ranks.hpp"

namespace loom {
namespace {

constexpr int kAR = static_cast<int>(CommOp::all_reduce);
constexpr int kRS = static_cast<int>(CommOp::reduce_scatter);
constexpr int kAG = static_cast<int>(CommOp::all_gather);
constexpr int kBC = static_cast<int>(CommOp::broadcast);
constexpr int kSend = static_cast<int>(CommOp::send);
constexpr int kRecv = static_cast<int>(CommOp::recv);

using testing::world_rank;
using testing::world_size;
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
    EXPECT_EQ(sum_over_ranks(c->stats().bytes_sent[kAR]), static_cast<std::uint64_t>(2 * (n - 1) * count) * sizeof(T));
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
    EXPECT_EQ(0, mismatches(v[j],
                            [&](std::int64_t i) {
                              float t = 0;
                              for (int q = 0; q < n; ++q) t += ival(q, i * 100 + j);
                              return t;
                            }))
        << "operation " << j;
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

// ---------------------------------------------------------------------------------------------------
// Typed operations.

constexpr std::initializer_list<ReduceOp> kReduceOps = {ReduceOp::sum, ReduceOp::max};

template <class T>
constexpr bool is_half_v = std::is_same_v<T, bf16> || std::is_same_v<T, f16>;

// An integer as T (exact for the small values the reductions are tested with).
template <class T>
T from_int(std::int64_t v) {
  if constexpr (std::is_same_v<T, bf16>)
    return to_bf16(static_cast<float>(v));
  else if constexpr (std::is_same_v<T, f16>)
    return to_f16(static_cast<float>(v));
  else
    return static_cast<T>(v);
}
template <class T>
T from_double(double v) {
  if constexpr (std::is_same_v<T, bf16>)
    return to_bf16(static_cast<float>(v));
  else if constexpr (std::is_same_v<T, f16>)
    return to_f16(static_cast<float>(v));
  else
    return static_cast<T>(v);
}
template <class T>
float as_float(T x) {
  if constexpr (is_half_v<T>)
    return to_float(x);
  else
    return static_cast<float>(x);
}

// Small integers for (rank, i): in [-30, 30], in [0, 60] for unsigned types. Every partial sum over
// four ranks (|s| <= 120, or <= 240) is exact in every element type, int8 and bf16 included.
template <class T>
std::int64_t small(int rank, std::int64_t i) {
  const std::int64_t v = (i * 131 + rank * 977 + 7) % 61;
  return std::is_unsigned_v<T> ? v : v - 30;
}

// The sum or maximum over the n ranks of value(q), as T.
template <class T, class F>
T reduce_ints(ReduceOp op, int n, F value) {
  std::int64_t acc = value(0);
  for (int q = 1; q < n; ++q) acc = op == ReduceOp::sum ? acc + value(q) : std::max(acc, value(q));
  return from_int<T>(acc);
}

// Arbitrary bit patterns for (rank, i), NaNs included: moving operations must carry every bit.
template <class T>
T random_bits(int rank, std::int64_t i) {
  std::uint64_t z = (static_cast<std::uint64_t>(rank + 1) << 40) ^ static_cast<std::uint64_t>(i) ^ (sizeof(T) << 56);
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  T x;
  std::memcpy(static_cast<void*>(&x), &z, sizeof(T));
  return x;
}

// Elements whose bits differ from expected(i) (bf16 and fp16 have no operator==; NaNs compare).
template <class T, class F>
std::int64_t bit_mismatches(const std::vector<T>& got, F expected) {
  std::int64_t bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const T want = expected(static_cast<std::int64_t>(i));
    if (std::memcmp(&got[i], &want, sizeof(T)) != 0) ++bad;
  }
  return bad;
}

template <class T>
BufferRef ref(std::vector<T>& v) {
  return BufferRef(v.data(), static_cast<std::int64_t>(v.size()));
}

// Variable counts to try, for n ranks: the even split, zeros on some ranks, one rank with all, all
// different, all zero.
std::vector<std::vector<std::int64_t>> count_patterns(int n) {
  std::vector<std::vector<std::int64_t>> p{shard_counts(1001, n), shard_counts(n - 1, n)};
  std::vector<std::int64_t> zeros_on_even(n), one_has_all(n), all_different(n);
  for (int r = 0; r < n; ++r) {
    zeros_on_even[r] = r % 2 == 0 ? 0 : 3 + 5 * r;
    one_has_all[r] = r == n - 1 ? 4097 : 0;
    all_different[r] = 7 * r * r + 1;
  }
  p.push_back(zeros_on_even);
  p.push_back(one_has_all);
  p.push_back(all_different);
  p.push_back(std::vector<std::int64_t>(n, 0));
  return p;
}

std::string show(const std::vector<std::int64_t>& v) {
  std::string s = "{";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "}";
}

// The block of global element g under counts (offsets = shard_offsets(counts)).
int block_of(const std::vector<std::int64_t>& offsets, std::int64_t g) {
  int b = 0;
  while (offsets[b + 1] <= g) ++b;
  return b;
}

using ElementTypes = ::testing::Types<float, double, bf16, f16, std::int8_t, std::uint8_t, std::int32_t, std::int64_t>;
struct ElementTypeNames {
  template <class T>
  static std::string GetName(int) {
    return dtype_name(dtype_v<T>);
  }
};
template <class T>
class CommTyped : public ::testing::Test {};
TYPED_TEST_SUITE(CommTyped, ElementTypes, ElementTypeNames);

TYPED_TEST(CommTyped, AllReduceSumAndMax) {
  using T = TypeParam;
  auto c = world_comm();
  const int n = c->size(), r = c->rank();
  for (ReduceOp op : kReduceOps) {
    for (std::int64_t count : test_counts()) {
      SCOPED_TRACE(std::string(reduce_op_name(op)) + " count " + std::to_string(count));
      std::vector<T> v(static_cast<std::size_t>(count));
      for (std::int64_t i = 0; i < count; ++i) v[i] = from_int<T>(small<T>(r, i));
      c->reset_stats();
      c->all_reduce_async(ref(v), op)->wait();
      auto expected = [&](std::int64_t i) { return reduce_ints<T>(op, n, [&](int q) { return small<T>(q, i); }); };
      EXPECT_EQ(0, bit_mismatches(v, expected));
      expect_only(c->stats(), kAR, expected_all_reduce_bytes(count, n, r, sizeof(T)));
      if (count % n == 0) {
        EXPECT_DOUBLE_EQ(static_cast<double>(c->stats().bytes_sent[kAR]),
                         ring_all_reduce_bytes(static_cast<double>(count * sizeof(T)), n));
      }
      if (n > 1 && count > 1000) {  // the test tells sum from max
        std::vector<T> other(1);
        const ReduceOp o = op == ReduceOp::sum ? ReduceOp::max : ReduceOp::sum;
        EXPECT_GT(bit_mismatches(
                      v, [&](std::int64_t i) { return reduce_ints<T>(o, n, [&](int q) { return small<T>(q, i); }); }),
                  count / 2);
      }
    }
  }
}

TYPED_TEST(CommTyped, ReduceScatterEqualCounts) {
  using T = TypeParam;
  auto c = world_comm();
  const int n = c->size(), r = c->rank();
  for (ReduceOp op : kReduceOps) {
    for (std::int64_t rc : test_counts()) {
      SCOPED_TRACE(std::string(reduce_op_name(op)) + " recv_count " + std::to_string(rc));
      std::vector<T> send(static_cast<std::size_t>(n * rc)), recv(static_cast<std::size_t>(rc), random_bits<T>(r, -1));
      for (std::int64_t i = 0; i < n * rc; ++i) send[i] = from_int<T>(small<T>(r, i));
      c->reset_stats();
      c->reduce_scatter(ref(send), ref(recv), op);
      EXPECT_EQ(0, bit_mismatches(recv, [&](std::int64_t i) {
                  return reduce_ints<T>(op, n, [&](int q) { return small<T>(q, r * rc + i); });
                }));
      const std::uint64_t bytes = static_cast<std::uint64_t>((n - 1) * rc) * sizeof(T);
      expect_only(c->stats(), kRS, bytes);
      EXPECT_EQ(bytes, ring_reduce_scatter_bytes(std::vector<std::int64_t>(n, rc), r, sizeof(T)));
      EXPECT_DOUBLE_EQ(static_cast<double>(bytes), ring_reduce_scatter_bytes(double(n * rc * sizeof(T)), n));
    }
  }
}

TYPED_TEST(CommTyped, ReduceScatterVariableCounts) {
  using T = TypeParam;
  auto c = world_comm();
  const int n = c->size(), r = c->rank();
  for (ReduceOp op : kReduceOps) {
    for (const auto& counts : count_patterns(n)) {
      for (bool in_place : {false, true}) {
        SCOPED_TRACE(std::string(reduce_op_name(op)) + " counts " + show(counts) + (in_place ? " in place" : ""));
        const std::vector<std::int64_t> off = shard_offsets(counts);
        const std::int64_t total = off.back();
        std::vector<T> send(static_cast<std::size_t>(total)),
            recv(static_cast<std::size_t>(counts[r]), random_bits<T>(r, -1));
        for (std::int64_t i = 0; i < total; ++i) send[i] = from_int<T>(small<T>(r, i));
        c->reset_stats();
        // In place the result lands in this rank's block of `send` (the ring keeps its partial sums in
        // the other blocks).
        const BufferRef into = in_place ? ref(send).slice(off[r], counts[r]) : ref(recv);
        c->reduce_scatter_async(ref(send), into, counts, op)->wait();
        if (in_place) std::copy(send.begin() + off[r], send.begin() + off[r] + counts[r], recv.begin());
        EXPECT_EQ(0, bit_mismatches(recv, [&](std::int64_t i) {
                    return reduce_ints<T>(op, n, [&](int q) { return small<T>(q, off[r] + i); });
                  }));
        // Every block but its own, once, in T's size.
        const std::uint64_t bytes = n == 1 ? 0 : static_cast<std::uint64_t>(total - counts[r]) * sizeof(T);
        expect_only(c->stats(), kRS, bytes);
        EXPECT_EQ(bytes, ring_reduce_scatter_bytes(counts, r, sizeof(T)));
        EXPECT_EQ(sum_over_ranks(bytes), static_cast<std::uint64_t>((n - 1) * total) * sizeof(T));
      }
    }
  }
}

TYPED_TEST(CommTyped, AllGatherEqualCounts) {
  using T = TypeParam;
  auto c = world_comm();
  const int n = c->size(), r = c->rank();
  for (std::int64_t sc : test_counts()) {
    SCOPED_TRACE("send_count " + std::to_string(sc));
    std::vector<T> send(static_cast<std::size_t>(sc)), recv(static_cast<std::size_t>(n * sc), random_bits<T>(r, -1));
    for (std::int64_t i = 0; i < sc; ++i) send[i] = random_bits<T>(r, i);
    c->reset_stats();
    c->all_gather(ref(send), ref(recv));
    EXPECT_EQ(0,
              bit_mismatches(recv, [&](std::int64_t i) { return random_bits<T>(static_cast<int>(i / sc), i % sc); }));
    const std::uint64_t bytes = static_cast<std::uint64_t>((n - 1) * sc) * sizeof(T);
    expect_only(c->stats(), kAG, bytes);
    EXPECT_EQ(bytes, ring_all_gather_bytes(std::vector<std::int64_t>(n, sc), r, sizeof(T)));
    EXPECT_DOUBLE_EQ(static_cast<double>(bytes), ring_all_gather_bytes(double(n * sc * sizeof(T)), n));
  }
}

TYPED_TEST(CommTyped, AllGatherVariableCounts) {
  using T = TypeParam;
  auto c = world_comm();
  const int n = c->size(), r = c->rank();
  for (const auto& counts : count_patterns(n)) {
    for (bool in_place : {false, true}) {
      SCOPED_TRACE("counts " + show(counts) + (in_place ? " in place" : ""));
      const std::vector<std::int64_t> off = shard_offsets(counts);
      const std::int64_t total = off.back();
      std::vector<T> send(static_cast<std::size_t>(counts[r])),
          recv(static_cast<std::size_t>(total), random_bits<T>(r, -1));
      for (std::int64_t i = 0; i < counts[r]; ++i) send[i] = random_bits<T>(r, i);
      BufferRef from = ref(send);
      if (in_place) {  // this rank's block already in place
        std::copy(send.begin(), send.end(), recv.begin() + off[r]);
        from = ref(recv).slice(off[r], counts[r]);
      }
      c->reset_stats();
      c->all_gather_async(from, ref(recv), counts)->wait();
      EXPECT_EQ(0, bit_mismatches(recv, [&](std::int64_t g) {
                  const int b = block_of(off, g);
                  return random_bits<T>(b, g - off[b]);
                }));
      // Every block but the right neighbour's, once, in T's size.
      const std::uint64_t bytes = n == 1 ? 0 : static_cast<std::uint64_t>(total - counts[(r + 1) % n]) * sizeof(T);
      expect_only(c->stats(), kAG, bytes);
      EXPECT_EQ(bytes, ring_all_gather_bytes(counts, r, sizeof(T)));
      EXPECT_EQ(sum_over_ranks(bytes), static_cast<std::uint64_t>((n - 1) * total) * sizeof(T));
    }
  }
}

TYPED_TEST(CommTyped, Broadcast) {
  using T = TypeParam;
  auto c = world_comm();
  const int n = c->size(), r = c->rank();
  // 3 MiB and a bit: four pipeline segments of 1 MiB, whatever the element size.
  for (std::int64_t count :
       {std::int64_t{0}, std::int64_t{1}, std::int64_t{100003}, static_cast<std::int64_t>((3 << 20) / sizeof(T) + 7)}) {
    for (int root : {0, n - 1}) {
      SCOPED_TRACE("count " + std::to_string(count) + " root " + std::to_string(root));
      std::vector<T> v(static_cast<std::size_t>(count), random_bits<T>(r, -1));
      if (r == root)
        for (std::int64_t i = 0; i < count; ++i) v[i] = random_bits<T>(root, i);
      c->reset_stats();
      c->broadcast(ref(v), root);
      EXPECT_EQ(0, bit_mismatches(v, [&](std::int64_t i) { return random_bits<T>(root, i); }));
      const bool last = mod(r - root, n) == n - 1;
      expect_only(c->stats(), kBC, last ? 0 : static_cast<std::uint64_t>(count) * sizeof(T));
    }
  }
}

TYPED_TEST(CommTyped, SendRecvRing) {
  using T = TypeParam;
  auto c = world_comm();
  const int n = c->size(), r = c->rank();
  const int right = mod(r + 1, n), left = mod(r - 1, n);
  for (std::int64_t count : {std::int64_t{0}, std::int64_t{1}, std::int64_t{100003}}) {
    SCOPED_TRACE("count " + std::to_string(count));
    std::vector<T> out(static_cast<std::size_t>(count)), in(static_cast<std::size_t>(count), random_bits<T>(r, -1));
    for (std::int64_t i = 0; i < count; ++i) out[i] = random_bits<T>(r, i);
    c->reset_stats();
    auto rq = c->recv_async(ref(in), left, 7);
    auto sq = c->send_async(ref(out), right, 7);
    rq->wait();
    sq->wait();
    EXPECT_EQ(0, bit_mismatches(in, [&](std::int64_t i) { return random_bits<T>(left, i); }));
    const CommStats& s = c->stats();
    EXPECT_EQ(s.calls[kSend], 1u);
    EXPECT_EQ(s.calls[kRecv], 1u);
    EXPECT_EQ(s.bytes_sent[kSend], static_cast<std::uint64_t>(count) * sizeof(T));
    EXPECT_EQ(s.bytes_sent[kRecv], 0u);
    EXPECT_EQ(s.total_bytes(), s.bytes_sent[kSend]);
  }
}

// The fp32 sum adds in the ring's order (comm_mpi.cpp): chunk c of an all-reduce is
// ((v[c] + v[c+1]) + v[c+2]) ... + v[c-1], block b of a reduce-scatter ((v[b+1] + v[b+2]) ...) + v[b],
// the same through the float* and the typed forms. Bit-for-bit restarts and the golden values rest
// on that order.
TEST(Comm, Fp32SumsAddInRingOrder) {
  auto c = world_comm();
  const int n = c->size(), r = c->rank();
  const std::int64_t count = 100003;
  auto v = [](int q, std::int64_t i) { return static_cast<float>(rval(q, i)); };
  std::vector<float> a(count), b(count);
  for (std::int64_t i = 0; i < count; ++i) a[i] = b[i] = v(r, i);
  c->all_reduce(a.data(), count);
  c->all_reduce(ref(b));
  const std::int64_t base = count / n, rem = count % n;
  auto chunk_of = [&](std::int64_t i) {
    return i < rem * (base + 1) ? static_cast<int>(i / (base + 1))
                                : static_cast<int>(rem + (i - rem * (base + 1)) / base);
  };
  auto ring = [&](std::int64_t i) {
    const int ch = chunk_of(i);
    float acc = v(ch, i);
    for (int k = 1; k < n; ++k) acc = v(mod(ch + k, n), i) + acc;
    return acc;
  };
  EXPECT_EQ(0, bit_mismatches(a, ring));
  EXPECT_EQ(0, bit_mismatches(b, ring));
  if (n >= 3) {  // the order shows: summing in rank order differs somewhere
    EXPECT_GT(bit_mismatches(a,
                             [&](std::int64_t i) {
                               float s = 0;
                               for (int q = 0; q < n; ++q) s += v(q, i);
                               return s;
                             }),
              0);
  }

  const std::int64_t rc = 33337;
  std::vector<float> send(static_cast<std::size_t>(n * rc)), got(rc), typed(rc);
  for (std::int64_t i = 0; i < n * rc; ++i) send[i] = v(r, i);
  c->reduce_scatter(send.data(), got.data(), rc);
  c->reduce_scatter(ref(send), ref(typed));
  auto block = [&](std::int64_t i) {
    const std::int64_t g = r * rc + i;
    float acc = v(mod(r + 1, n), g);
    for (int k = 2; k <= n; ++k) acc = acc + v(mod(r + k, n), g);
    return acc;
  };
  EXPECT_EQ(0, bit_mismatches(got, block));
  EXPECT_EQ(0, bit_mismatches(typed, block));
}

// bf16 and fp16 sums: each ring step converts to float, adds, and rounds once back to storage.
template <class T>
void check_half_sums_round_per_step() {
  auto c = world_comm();
  const int n = c->size(), r = c->rank();
  const std::int64_t count = 100003;
  auto v = [](int q, std::int64_t i) { return from_double<T>(rval(q, i) * 3); };
  auto add = [](T a, T b) { return from_double<T>(static_cast<double>(as_float(a) + as_float(b))); };
  std::vector<T> a(count);
  for (std::int64_t i = 0; i < count; ++i) a[i] = v(r, i);
  c->reset_stats();
  c->all_reduce(ref(a));
  const std::int64_t base = count / n, rem = count % n;
  auto ring = [&](std::int64_t i) {
    const int ch =
        i < rem * (base + 1) ? static_cast<int>(i / (base + 1)) : static_cast<int>(rem + (i - rem * (base + 1)) / base);
    T acc = v(ch, i);
    for (int k = 1; k < n; ++k) acc = add(v(mod(ch + k, n), i), acc);
    return acc;
  };
  EXPECT_EQ(0, bit_mismatches(a, ring));
  expect_bitwise_same_on_all_ranks(a);
  // Half the bytes of fp32.
  EXPECT_EQ(c->stats().bytes_sent[kAR] * 2, expected_all_reduce_bytes(count, n, r, sizeof(float)));
  if (n >= 3) {  // rounding once at the end instead differs somewhere
    EXPECT_GT(bit_mismatches(a,
                             [&](std::int64_t i) {
                               float s = 0;
                               for (int q = 0; q < n; ++q) s += as_float(v(q, i));
                               return from_double<T>(s);
                             }),
              0);
  }

  // Reduce-scatter with variable counts: ((v[b+1] + v[b+2]) ...) + v[b], rounded at every step.
  const std::vector<std::int64_t> counts = shard_counts(70001, n), off = shard_offsets(counts);
  std::vector<T> send(static_cast<std::size_t>(off.back())), recv(static_cast<std::size_t>(counts[r]));
  for (std::int64_t i = 0; i < off.back(); ++i) send[i] = v(r, i);
  c->reduce_scatter(ref(send), ref(recv), counts);
  EXPECT_EQ(0, bit_mismatches(recv, [&](std::int64_t i) {
              const std::int64_t g = off[r] + i;
              T acc = v(mod(r + 1, n), g);
              for (int k = 2; k <= n; ++k) acc = add(acc, v(mod(r + k, n), g));
              return acc;
            }));
}

TEST(Comm, Bf16SumsRoundOncePerRingStep) { check_half_sums_round_per_step<bf16>(); }
TEST(Comm, Fp16SumsRoundOncePerRingStep) { check_half_sums_round_per_step<f16>(); }

// int8 and uint8 sums saturate (in int32, at every step) rather than wrap.
TEST(Comm, Int8SumsSaturate) {
  auto c = world_comm();
  const int n = c->size(), r = c->rank();
  const std::int64_t count = 1001;
  std::vector<std::int8_t> s(count);
  std::vector<std::uint8_t> u(count);
  for (std::int64_t i = 0; i < count; ++i) {
    s[i] = static_cast<std::int8_t>(i % 3 == 0 ? 100 : i % 3 == 1 ? -100 : 5 * r - 7);
    u[i] = static_cast<std::uint8_t>(i % 2 == 0 ? 200 : r + 1);
  }
  c->all_reduce(ref(s));
  c->all_reduce(ref(u));
  EXPECT_EQ(0, bit_mismatches(s, [&](std::int64_t i) {
              const std::int64_t t = i % 3 == 0 ? 100 * n : i % 3 == 1 ? -100 * n : 5 * n * (n - 1) / 2 - 7 * n;
              return static_cast<std::int8_t>(std::clamp<std::int64_t>(t, -128, 127));
            }));
  EXPECT_EQ(0, bit_mismatches(u, [&](std::int64_t i) {
              const std::int64_t t = i % 2 == 0 ? 200 * n : n * (n + 1) / 2;
              return static_cast<std::uint8_t>(std::min<std::int64_t>(t, 255));
            }));
  if (n > 1) {
    EXPECT_EQ(s[0], 127);  // wrapping would give 100 n mod 256
    EXPECT_EQ(s[1], -128);
    EXPECT_EQ(u[0], 255);
  }
}

// int32 and int64 sums wrap (two's complement).
TEST(Comm, Int32And64SumsWrap) {
  auto c = world_comm();
  const int n = c->size();
  std::vector<std::int32_t> a(5, std::numeric_limits<std::int32_t>::max());
  std::vector<std::int64_t> b(5, std::numeric_limits<std::int64_t>::max());
  c->all_reduce(ref(a));
  c->all_reduce(ref(b));
  const auto wa = static_cast<std::int32_t>(static_cast<std::uint32_t>(std::numeric_limits<std::int32_t>::max()) *
                                            static_cast<std::uint32_t>(n));
  const auto wb = static_cast<std::int64_t>(static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) *
                                            static_cast<std::uint64_t>(n));
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(a[i], wa);
    EXPECT_EQ(b[i], wb);
  }
}

// A NaN on any rank makes the maximum NaN (as it makes the sum NaN).
template <class T>
void check_max_propagates_nan() {
  auto c = world_comm();
  const int n = c->size(), r = c->rank();
  const std::int64_t count = 64;
  const T nan = from_double<T>(std::numeric_limits<double>::quiet_NaN());
  std::vector<T> v(count);
  for (std::int64_t i = 0; i < count; ++i) v[i] = from_int<T>(small<T>(r, i));
  if (r == n - 1) v[5] = nan;
  if (r == 0) v[9] = nan;
  c->all_reduce(ref(v), ReduceOp::max);
  for (std::int64_t i = 0; i < count; ++i) {
    if (i == 5 || i == 9) {
      EXPECT_TRUE(std::isnan(as_float(v[i]))) << "element " << i;
    } else {
      const T want = reduce_ints<T>(ReduceOp::max, n, [&](int q) { return small<T>(q, i); });
      EXPECT_EQ(0, std::memcmp(&v[i], &want, sizeof(T))) << "element " << i;
    }
  }
}

TEST(Comm, MaxPropagatesNaN) {
  check_max_propagates_nan<float>();
  check_max_propagates_nan<double>();
  check_max_propagates_nan<bf16>();
  check_max_propagates_nan<f16>();
}

// Expects fn() to throw a std::logic_error whose message names every one of `words`.
void expect_logic_error(const std::function<void()>& fn, std::initializer_list<const char*> words, bool invalid) {
  try {
    fn();
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_TRUE(invalid) << "std::invalid_argument: " << e.what();
    for (const char* w : words) EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what();
  } catch (const std::logic_error& e) {
    EXPECT_FALSE(invalid) << "std::logic_error: " << e.what();
    for (const char* w : words) EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what();
  }
}

TEST(Comm, TypedArgumentsAreChecked) {
  auto c = world_comm();
  const int n = c->size(), r = c->rank();
  std::vector<float> f(4 * n);
  std::vector<bf16> h(4 * n);
  std::vector<std::int32_t> i32(4 * n);
  std::vector<std::int64_t> i64(4 * n);
  const BufferRef dev(f.data(), DType::f32, 4, MemSpace::device);  // never touched
  // Mismatched element types, both named.
  expect_logic_error([&] { c->reduce_scatter_async(BufferRef(f.data(), 4 * n), BufferRef(h.data(), 4)); },
                     {"fp32", "bf16"}, false);
  expect_logic_error(
      [&] {
        c->reduce_scatter_async(BufferRef(f.data(), 4 * n), BufferRef(h.data(), 4), std::vector<std::int64_t>(n, 4));
      },
      {"fp32", "bf16"}, false);
  expect_logic_error([&] { c->all_gather_async(BufferRef(i32.data(), 4), BufferRef(i64.data(), 4 * n)); },
                     {"int32", "int64"}, false);
  expect_logic_error(
      [&] {
        c->all_gather_async(BufferRef(i64.data(), 4), BufferRef(i32.data(), 4 * n), std::vector<std::int64_t>(n, 4));
      },
      {"int64", "int32"}, false);
  // Device buffers: the MPI back end moves host memory only.
  expect_logic_error([&] { c->all_reduce_async(dev); }, {"device", "NCCL"}, false);
  expect_logic_error([&] { c->all_reduce_async(dev, ReduceOp::max); }, {"device", "NCCL"}, false);
  expect_logic_error([&] { c->broadcast_async(dev, 0); }, {"device", "NCCL"}, false);
  expect_logic_error([&] { c->send_async(dev, 0, 1); }, {"device", "NCCL"}, false);
  expect_logic_error([&] { c->recv_async(dev, 0, 1); }, {"device", "NCCL"}, false);
  const BufferRef dev_all(f.data(), DType::f32, 4 * n, MemSpace::device);
  expect_logic_error([&] { c->reduce_scatter_async(dev_all, dev); }, {"device", "NCCL"}, false);
  expect_logic_error([&] { c->all_gather_async(dev, dev_all); }, {"device", "NCCL"}, false);
  expect_logic_error([&] { c->all_gather_async(BufferRef(f.data(), 4), dev_all); }, {"host", "device"}, false);
  // Counts.
  expect_logic_error([&] { c->all_reduce_async(BufferRef(f.data(), -1)); }, {"negative"}, true);
  expect_logic_error([&] { c->reduce_scatter_async(BufferRef(f.data(), 4 * n - 1), BufferRef(f.data(), 4)); }, {"send"},
                     true);
  expect_logic_error([&] { c->all_gather_async(BufferRef(f.data(), 4), BufferRef(f.data(), 4 * n + 1)); }, {"recv"},
                     true);
  expect_logic_error(
      [&] { c->reduce_scatter_async(ref(f), BufferRef(f.data(), 4), std::vector<std::int64_t>(n + 1, 4)); }, {"counts"},
      true);
  std::vector<std::int64_t> bad(n, 4);
  bad[n - 1] = -4;
  expect_logic_error([&] { c->all_gather_async(BufferRef(f.data(), 4), BufferRef(f.data(), 4 * n - 8), bad); },
                     {"negative"}, true);
  std::vector<std::int64_t> counts(n, 1);
  counts[0] = 4 * n - (n - 1);  // sums to 4n
  expect_logic_error([&] { c->reduce_scatter_async(ref(f), BufferRef(f.data(), counts[r] + 1), counts); }, {"recv"},
                     true);
  expect_logic_error(
      [&] { c->reduce_scatter_async(BufferRef(f.data(), 4 * n - 1), BufferRef(f.data(), counts[r]), counts); },
      {"send"}, true);
  expect_logic_error([&] { c->all_gather_async(BufferRef(f.data(), counts[r] + 1), ref(f), counts); }, {"send"}, true);
  expect_logic_error(
      [&] { c->all_gather_async(BufferRef(f.data(), counts[r]), BufferRef(f.data(), 4 * n + 1), counts); }, {"recv"},
      true);
  expect_logic_error([&] { c->broadcast_async(ref(h), n); }, {"root"}, true);
  expect_logic_error([&] { c->send_async(ref(h), 0, 1000); }, {"tag"}, true);
  // Nothing was issued or counted, and the communicator still works.
  EXPECT_EQ(c->stats().total_bytes(), 0u);
  for (int k = 0; k < kCommOps; ++k) EXPECT_EQ(c->stats().calls[k], 0u);
  EXPECT_EQ(c->sum(1.0), static_cast<double>(n));
}

TEST(Comm, ShardCountsAndVolumes) {
  using V = std::vector<std::int64_t>;
  // Compared as text: GCC 12.2 at -O2/-O3 with -march=native on this AVX-512 machine builds the
  // literal std::vector<std::int64_t>{1, 1, 0, 0} as {1, 1, 1, 1}.
  EXPECT_EQ(show(shard_counts(10, 4)), "{3, 3, 2, 2}");
  EXPECT_EQ(show(shard_counts(2, 4)), "{1, 1, 0, 0}");
  EXPECT_EQ(show(shard_counts(0, 3)), "{0, 0, 0}");
  EXPECT_EQ(show(shard_counts(7, 1)), "{7}");
  EXPECT_EQ(show(shard_offsets(shard_counts(10, 4))), "{0, 3, 6, 8, 10}");
  EXPECT_EQ(show(shard_offsets(V{})), "{0}");
  EXPECT_EQ(padded_shard(10, 4), 3);
  EXPECT_EQ(padded_shard(8, 4), 2);
  EXPECT_EQ(padded_shard(1, 4), 1);
  EXPECT_EQ(padded_shard(0, 4), 0);
  EXPECT_THROW(shard_counts(10, 0), std::invalid_argument);
  EXPECT_THROW(shard_counts(-1, 2), std::invalid_argument);
  EXPECT_THROW(padded_shard(10, 0), std::invalid_argument);
  static const std::int64_t raw[] = {3, 0, 5, 2};
  const V counts(raw, raw + 4);  // total 10
  ASSERT_EQ(show(counts), "{3, 0, 5, 2}");
  EXPECT_EQ(ring_reduce_scatter_bytes(counts, 2, 2), (10u - 5u) * 2u);  // all but its own
  EXPECT_EQ(ring_reduce_scatter_bytes(counts, 1, 4), 10u * 4u);
  EXPECT_EQ(ring_all_gather_bytes(counts, 1, 4), (10u - 5u) * 4u);  // all but rank 2's
  EXPECT_EQ(ring_all_gather_bytes(counts, 3, 8), (10u - 3u) * 8u);  // all but rank 0's
  EXPECT_EQ(ring_reduce_scatter_bytes(V{7}, 0, 4), 0u);
  EXPECT_EQ(ring_all_gather_bytes(V{7}, 0, 4), 0u);
  for (int r = 0; r < 4; ++r) {
    EXPECT_DOUBLE_EQ(static_cast<double>(ring_reduce_scatter_bytes(V(4, 250), r, 4)),
                     ring_reduce_scatter_bytes(4000.0, 4));
    EXPECT_DOUBLE_EQ(static_cast<double>(ring_all_gather_bytes(V(4, 250), r, 4)), ring_all_gather_bytes(4000.0, 4));
  }
  EXPECT_STREQ(reduce_op_name(ReduceOp::sum), "sum");
  EXPECT_STREQ(reduce_op_name(ReduceOp::max), "max");
}

// The ring scratch is filed under Mem::comm, kept across operations by size class (as many buffers
// of a class as its operations were ever in flight together), reused only within a class, and goes
// with the communicator.
TEST(Comm, ScratchIsFiledInTheLedgerAndReused) {
  Ledger& ledger = Ledger::global();
  const std::size_t before = ledger.current(Mem::comm);
  ledger.reset_peaks();  // this test's own peak window
  {
    auto c = world_comm();
    const int n = c->size(), r = c->rank();
    EXPECT_EQ(ledger.current(Mem::comm), before);
    // The class of the largest chunk of an all-reduce of `count` elements of `elem` bytes (none on
    // one rank).
    auto chunk = [&](std::int64_t count, std::size_t elem) -> std::size_t {
      return n == 1 ? 0 : scratch_class(static_cast<std::size_t>(count / n + (count % n ? 1 : 0)) * elem);
    };
    const std::int64_t count = 100003;
    std::vector<float> a(count), b(count);
    for (std::int64_t i = 0; i < count; ++i) a[i] = b[i] = ival(r, i);
    c->all_reduce(a.data(), count);
    const std::size_t one = chunk(count, sizeof(float));
    EXPECT_EQ(ledger.current(Mem::comm), before + one);
    c->all_reduce(a.data(), count - 5);  // reused: the same class
    EXPECT_EQ(ledger.current(Mem::comm), before + one);
    {  // two at once: a second buffer
      auto A = c->all_reduce_async(a.data(), count);
      auto B = c->all_reduce_async(b.data(), count);
      A->wait();
      B->wait();
    }
    EXPECT_EQ(ledger.current(Mem::comm), before + 2 * one);
    // A small operation does not take a large buffer (a large operation in flight beside it would
    // then need another): it gets one of its own class, twice in flight with a large one.
    std::vector<bf16> h(1000);
    for (int k = 0; k < 2; ++k) {
      auto A = c->all_reduce_async(a.data(), count);
      auto H = c->all_reduce_async(ref(h));
      auto B = c->all_reduce_async(b.data(), count);
      A->wait();
      H->wait();
      B->wait();
    }
    EXPECT_EQ(ledger.current(Mem::comm), before + 2 * one + chunk(1000, sizeof(bf16)));
    EXPECT_EQ(ledger.peak(Mem::comm), before + 2 * one + chunk(1000, sizeof(bf16)));
    std::vector<double> big(4 * count);  // another class: a buffer of its own
    c->all_reduce(big.data(), 4 * count);
    EXPECT_EQ(ledger.current(Mem::comm),
              before + 2 * one + chunk(1000, sizeof(bf16)) + chunk(4 * count, sizeof(double)));
  }
  EXPECT_EQ(ledger.current(Mem::comm), before);
  // Classes: an eighth of the power of two, at least 8 bytes; never smaller than asked.
  EXPECT_EQ(scratch_class(0), 0u);
  EXPECT_EQ(scratch_class(1), 8u);
  EXPECT_EQ(scratch_class(64), 64u);
  EXPECT_EQ(scratch_class(65), 72u);
  EXPECT_EQ(scratch_class(524288), 524288u);
  EXPECT_EQ(scratch_class(524289), 589824u);
  EXPECT_EQ(scratch_class(529408), 589824u);
  for (std::size_t x = 1; x < 5000000; x = x * 3 + 1) {
    EXPECT_GE(scratch_class(x), x);
    EXPECT_LE(scratch_class(x), x + x / 8 + 8);
  }
}

// A reservation (what a run makes from its step plan at start-up) puts the buffers in the pool at
// once; operations within it allocate nothing more, and one of a class it lacks still gets its own.
TEST(Comm, ReservedScratchIsAllocatedOnceAndUsed) {
  Ledger& ledger = Ledger::global();
  const std::size_t before = ledger.current(Mem::comm);
  {
    auto c = world_comm();
    const int n = c->size();
    const std::int64_t count = 100003;
    const std::size_t one = ring_all_reduce_scratch(count, n, sizeof(float));
    c->reserve_scratch(n == 1 ? std::map<std::size_t, int>{} : std::map<std::size_t, int>{{scratch_class(one), 2}});
    const std::size_t reserved = n == 1 ? 0 : 2 * scratch_class(one);
    EXPECT_EQ(ledger.current(Mem::comm), before + reserved);
    std::vector<float> a(count, 1.0f), b(count, 2.0f);
    for (int k = 0; k < 3; ++k) {  // two in flight, as reserved
      auto A = c->all_reduce_async(a.data(), count);
      auto B = c->all_reduce_async(b.data(), count);
      A->wait();
      B->wait();
    }
    EXPECT_EQ(ledger.current(Mem::comm), before + reserved);
    EXPECT_EQ(c->scratch_use().reserved, reserved);
    EXPECT_EQ(c->scratch_use().needed, reserved);  // two were out at once
    EXPECT_FLOAT_EQ(b[count - 1], 2.0f * static_cast<float>(std::pow(n, 3)));
    c->reserve_scratch({{scratch_class(one), 1}});  // already held: nothing more
    EXPECT_EQ(ledger.current(Mem::comm), before + reserved);
    std::vector<float> small(1000, 1.0f);  // a class not reserved
    c->all_reduce(small.data(), 1000);
    const std::size_t small_class = n == 1 ? 0 : scratch_class(ring_all_reduce_scratch(1000, n, 4));
    EXPECT_EQ(ledger.current(Mem::comm), before + reserved + small_class);
    EXPECT_EQ(c->scratch_use().reserved, reserved);
    EXPECT_EQ(c->scratch_use().needed, reserved + small_class);
  }
  EXPECT_EQ(ledger.current(Mem::comm), before);
}

// Typed operations of every kind outstanding together, waited on in a different order on odd and
// even ranks.
TEST(Comm, TypedAsyncOperationsOutstandingTogether) {
  auto c = world_comm();
  const int n = c->size(), r = c->rank();
  const int right = mod(r + 1, n), left = mod(r - 1, n);
  const std::int64_t na = 5003, ni = 777, nb = (3 << 19) + 5;  // 1.5 MiB of uint8: two segments
  const std::vector<std::int64_t> gcounts = count_patterns(n)[4], scounts = count_patterns(n)[2];
  const std::vector<std::int64_t> goff = shard_offsets(gcounts), soff = shard_offsets(scounts);
  std::vector<bf16> a(na);
  std::vector<std::int8_t> i8(ni);
  std::vector<std::int64_t> gs(gcounts[r]), gr(goff.back(), -1);
  std::vector<std::uint8_t> bc(nb, 0);
  std::vector<f16> ss(soff.back()), sr(scounts[r]);
  std::vector<std::int32_t> out(99), in(99, -1);
  for (std::int64_t i = 0; i < na; ++i) a[i] = from_int<bf16>(small<bf16>(r, i));
  for (std::int64_t i = 0; i < ni; ++i) i8[i] = from_int<std::int8_t>(small<std::int8_t>(r, i));
  for (std::int64_t i = 0; i < gcounts[r]; ++i) gs[i] = random_bits<std::int64_t>(r, i);
  if (r == n - 1)
    for (std::int64_t i = 0; i < nb; ++i) bc[i] = random_bits<std::uint8_t>(r, i);
  for (std::int64_t i = 0; i < soff.back(); ++i) ss[i] = from_int<f16>(small<f16>(r, i));
  for (int i = 0; i < 99; ++i) out[i] = random_bits<std::int32_t>(r, i);
  c->reset_stats();
  std::vector<CommRequestPtr> q;
  q.push_back(c->all_reduce_async(ref(a), ReduceOp::max));
  q.push_back(c->recv_async(ref(in), left, 9));
  q.push_back(c->all_gather_async(ref(gs), ref(gr), gcounts));
  q.push_back(c->broadcast_async(ref(bc), n - 1));
  q.push_back(c->reduce_scatter_async(ref(ss), ref(sr), scounts));
  q.push_back(c->all_reduce_async(ref(i8)));
  q.push_back(c->send_async(ref(out), right, 9));
  if (r % 2 == 0) {
    for (auto& x : q) x->wait();
  } else {
    for (auto it = q.rbegin(); it != q.rend(); ++it) (*it)->wait();
  }
  EXPECT_EQ(0, bit_mismatches(a, [&](std::int64_t i) {
              return reduce_ints<bf16>(ReduceOp::max, n, [&](int p) { return small<bf16>(p, i); });
            }));
  EXPECT_EQ(0, bit_mismatches(i8, [&](std::int64_t i) {
              return reduce_ints<std::int8_t>(ReduceOp::sum, n, [&](int p) { return small<std::int8_t>(p, i); });
            }));
  EXPECT_EQ(0, bit_mismatches(gr, [&](std::int64_t g) {
              const int b = block_of(goff, g);
              return random_bits<std::int64_t>(b, g - goff[b]);
            }));
  EXPECT_EQ(0, bit_mismatches(bc, [&](std::int64_t i) { return random_bits<std::uint8_t>(n - 1, i); }));
  EXPECT_EQ(0, bit_mismatches(sr, [&](std::int64_t i) {
              return reduce_ints<f16>(ReduceOp::sum, n, [&](int p) { return small<f16>(p, soff[r] + i); });
            }));
  EXPECT_EQ(0, bit_mismatches(in, [&](std::int64_t i) { return random_bits<std::int32_t>(left, i); }));
  const CommStats& s = c->stats();
  EXPECT_EQ(s.calls[kAR], 2u);
  EXPECT_EQ(s.bytes_sent[kAR], expected_all_reduce_bytes(na, n, r, 2) + expected_all_reduce_bytes(ni, n, r, 1));
  EXPECT_EQ(s.bytes_sent[kAG], ring_all_gather_bytes(gcounts, r, 8));
  EXPECT_EQ(s.bytes_sent[kBC], mod(r - (n - 1), n) == n - 1 ? 0u : static_cast<std::uint64_t>(nb));
  EXPECT_EQ(s.bytes_sent[kRS], ring_reduce_scatter_bytes(scounts, r, 2));
  EXPECT_EQ(s.bytes_sent[kSend], 99u * 4u);
  EXPECT_EQ(s.bytes_sent[kRecv], 0u);
}

}  // namespace
}  // namespace loom
