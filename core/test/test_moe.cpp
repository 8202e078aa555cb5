// Mixture of experts: the router's arithmetic (core/model/moe.cpp) against finite differences and its
// contract (top-k ties, capacity order, the auxiliary losses' values), and the experts' row operations
// (Backend::rows_gather, rows_scatter_add, rows_dot) against plain loops.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/backend/backend_select.hpp"
#include "core/base/rng.hpp"
#include "core/model/moe.hpp"

namespace loom {
namespace {

std::vector<double> randoms(std::size_t n, std::uint64_t seed, double scale = 1.0) {
  std::vector<double> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = scale * rng::normal(seed, rng::hash_name("moe"), i);
  return v;
}

// The objective whose logits-gradient moe_router_backward gives: sum over kept assignments of w_a x
// its gate, plus scale x (aux_w x aux + z_w x z).
double objective(const MoeRouting& r, const std::vector<double>& w_slot, double aux_w, double z_w, double scale) {
  double L = 0;
  for (int a = 0; a < r.assignments(); ++a) L += w_slot[static_cast<std::size_t>(r.slot[a])] * r.gate[r.slot[a]];
  return L + scale * (aux_w * r.aux + z_w * r.z);
}

void check_router_gradient(int N, int T, int E, int k, double capacity) {
  std::vector<double> logits = randoms(static_cast<std::size_t>(N) * E, 11 + E + k);
  const std::vector<double> w_slot = randoms(static_cast<std::size_t>(N) * k, 5);
  const double aux_w = 0.3, z_w = 0.05, scale = 0.7;
  const MoeRouting r = moe_route(logits.data(), N, T, E, k, capacity);
  std::vector<float> dgate(static_cast<std::size_t>(r.assignments()));
  for (int a = 0; a < r.assignments(); ++a) dgate[a] = static_cast<float>(w_slot[r.slot[a]]);
  std::vector<float> dlogits(logits.size());
  moe_router_backward(dlogits.data(), r, dgate.data(), aux_w, z_w, scale);
  // Central differences; routing (the choices and what capacity keeps) is held fixed by random logits.
  const double h = 1e-6;
  double worst = 0, gmax = 0;
  for (float g : dlogits) gmax = std::max(gmax, std::fabs(static_cast<double>(g)));
  for (std::size_t i = 0; i < logits.size(); ++i) {
    const double keep = logits[i];
    logits[i] = keep + h;
    const MoeRouting rp = moe_route(logits.data(), N, T, E, k, capacity);
    logits[i] = keep - h;
    const MoeRouting rm = moe_route(logits.data(), N, T, E, k, capacity);
    logits[i] = keep;
    ASSERT_EQ(rp.choice, r.choice);
    ASSERT_EQ(rm.kept, r.kept);
    const double num = (objective(rp, w_slot, aux_w, z_w, scale) - objective(rm, w_slot, aux_w, z_w, scale)) / (2 * h);
    worst = std::max(worst, std::fabs(num - dlogits[i]));
  }
  // dlogits are stored as fp32: 6e-8 of the largest, plus the differences' ~1e-9 noise
  EXPECT_LT(worst, 1e-6 * gmax + 1e-8) << "E " << E << " k " << k << " capacity " << capacity;
  EXPECT_GT(gmax, 1e-3);
  std::printf("[ gradchk ] router E=%d k=%d capacity %.2f: max|g| %.3g, max |analytic - numeric| %.2e (%lld dropped)\n",
              E, k, capacity, gmax, worst, static_cast<long long>(r.dropped));
}

TEST(Moe, RouterBackwardMatchesFiniteDifferences) {
  check_router_gradient(16, 8, 4, 2, 0.0);   // dropless, top-2
  check_router_gradient(16, 8, 4, 1, 0.0);   // top-1: the gate is 1, the gradient the auxiliary losses'
  check_router_gradient(24, 12, 6, 3, 1.0);  // capacity: dropped assignments get no gate gradient
}

TEST(Moe, RoutingFollowsItsContract) {
  // Two sequences of 4 tokens, 4 experts, top-2, capacity factor 0.5: ceil(0.5 * 4 * 2 / 4) = 1 a sequence.
  const int N = 8, T = 4, E = 4, k = 2;
  std::vector<double> logits(static_cast<std::size_t>(N) * E, 0.0);
  for (int t = 0; t < N; ++t) {
    logits[t * E + 2] = 1.0;              // every token's first choice is 2; the rest tie, so the second is 0
    if (t == 5) logits[t * E + 3] = 0.5;  // but token 5's second is 3
  }
  logits[1 * E + 0] = 2.0;  // and token 1's first is 0, its second 2
  const MoeRouting r = moe_route(logits.data(), N, T, E, k, 0.5);
  for (int t = 0; t < N; ++t) {
    EXPECT_EQ(r.choice[t * k], t == 1 ? 0 : 2);
    EXPECT_EQ(r.choice[t * k + 1], t == 5 ? 3 : t == 1 ? 2 : 0) << "ties go to the lower index";
    EXPECT_NEAR(r.gate[t * k] + r.gate[t * k + 1], 1.0, 1e-15);
  }
  // Capacity 1 per expert and sequence, in token order: token 0 keeps both its experts (2, then 0), so
  // token 1's first choice, 0, is full although it is a first choice (causal: what token 1 keeps depends
  // on token 0, never on token 2); in sequence 1 token 4 keeps 2 and 0, token 5 its second, 3.
  for (int t = 0; t < N; ++t) {
    EXPECT_EQ(r.kept[t * k], t % T == 0) << "token " << t;
    EXPECT_EQ(r.kept[t * k + 1], t == 0 || t == 4 || t == 5) << "token " << t;
  }
  EXPECT_EQ(r.dropped, N * k - 5);
  EXPECT_EQ(r.routed[2], N);
  EXPECT_EQ(r.routed[0], N - 1);
  // The kept assignments by expert, in token order.
  EXPECT_EQ(r.begin, (std::vector<int>{0, 2, 2, 4, 5}));
  EXPECT_EQ(r.rows, (std::vector<std::int32_t>{0, 4, 0, 4, 5}));
  // Dropless keeps everything.
  const MoeRouting all = moe_route(logits.data(), N, T, E, k, 0.0);
  EXPECT_EQ(all.dropped, 0);
  EXPECT_EQ(all.assignments(), N * k);
}

TEST(Moe, AuxiliaryLossesHaveTheirTextbookValues) {
  // Equal logits: every P_e = 1/E; top-k of ties picks experts 0..k-1 for every token, so f = 1/k for
  // those: aux = E * k * (1/k) * (1/E) = 1, the balanced value whatever the choice; z = log(E)^2.
  const int N = 6, T = 3, E = 8, k = 2;
  const std::vector<double> logits(static_cast<std::size_t>(N) * E, 0.25);
  const MoeRouting r = moe_route(logits.data(), N, T, E, k, 0.0);
  EXPECT_NEAR(r.aux, 1.0, 1e-12);
  EXPECT_NEAR(r.z, std::pow(0.25 + std::log(8.0), 2), 1e-12);
  // All of a sequence's choices on one expert with probability near 1: aux -> E.
  std::vector<double> skew(static_cast<std::size_t>(N) * E, 0.0);
  for (int t = 0; t < N; ++t) skew[t * E + 5] = 40.0, skew[t * E + 1] = 20.0;
  const MoeRouting s = moe_route(skew.data(), N, T, E, 1, 0.0);
  EXPECT_NEAR(s.aux, E, 1e-6);
}

TEST(Moe, RowOperationsAreTheirLoops) {
  auto be = make_host_backend(1);
  const int N = 7, C = 37, n = 4;
  const std::vector<double> xd = randoms(static_cast<std::size_t>(N) * C, 1),
                            yd = randoms(static_cast<std::size_t>(n) * C, 2);
  std::vector<float> x(xd.begin(), xd.end()), y(yd.begin(), yd.end());
  const std::vector<std::int32_t> rows = {5, 0, 3, 6};
  const std::vector<float> gate = {0.5f, -1.25f, 2.0f, 0.375f};
  std::vector<float> out(static_cast<std::size_t>(n) * C), acc(x), dot(n);
  const BufferRef R(rows.data(), n), G(gate.data(), n);
  be->rows_gather(BufferRef(out.data(), n * C), BufferRef(x.data(), N * C), R, G, n, C);
  be->rows_scatter_add(BufferRef(acc.data(), N * C), BufferRef(y.data(), n * C), R, G, n, C);
  be->rows_dot(BufferRef(dot.data(), n), BufferRef(x.data(), N * C), R, BufferRef(y.data(), n * C), n, C);
  for (int i = 0; i < n; ++i) {
    double d = 0;
    for (int c = 0; c < C; ++c) {
      EXPECT_EQ(out[i * C + c], gate[i] * x[rows[i] * C + c]);
      EXPECT_EQ(acc[rows[i] * C + c], x[rows[i] * C + c] + gate[i] * y[i * C + c]);
      d += static_cast<double>(x[rows[i] * C + c]) * y[i * C + c];
    }
    EXPECT_NEAR(dot[i], d, 1e-5 * std::fabs(d) + 1e-6);
  }
  for (int r : {1, 2, 4}) EXPECT_EQ(acc[r * C], x[r * C]) << "row " << r << " is no expert row: untouched";
  // Without a scale the gather is a copy in any type.
  std::vector<std::uint16_t> h16(static_cast<std::size_t>(N) * C), o16(static_cast<std::size_t>(n) * C);
  for (std::size_t i = 0; i < h16.size(); ++i) h16[i] = static_cast<std::uint16_t>(i * 7919);
  be->rows_gather(BufferRef(o16.data(), DType::bf16, n * C), BufferRef(h16.data(), DType::bf16, N * C), R, {}, n, C);
  for (int i = 0; i < n; ++i)
    for (int c = 0; c < C; ++c) EXPECT_EQ(o16[i * C + c], h16[rows[i] * C + c]);
}

}  // namespace
}  // namespace loom
