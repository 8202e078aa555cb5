// The compression methods' arithmetic (plugins/compression/compress.hpp), without communication:
// int8 round trips within half a step and sums of N ranks that cannot overflow, top-k keeping exactly
// the k largest magnitudes, PowerSGD at full rank reproducing the matrix, and error feedback making
// the sum of what was sent follow the sum of the true gradients.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include <Kokkos_Core.hpp>

#include "core/backend/kernels.hpp"
#include "core/test/tensors.hpp"
#include "plugins/compression/compress.hpp"

namespace c = loom::compress;
namespace k = loom::kernels;

namespace {
using loom::testing::randn;
double norm(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return std::sqrt(s);
}
}  // namespace

TEST(Int8, RoundTripWithinHalfAStepPerChunk) {
  const std::int64_t n = 1000, chunk = 64;
  auto x = randn(n, 1);
  for (std::int64_t i = 0; i < n; ++i) x[i] *= static_cast<float>(1 + i / chunk);  // chunks of different scales
  for (int ranks : {1, 2, 4, 8}) {
    const int levels = c::int8_levels(ranks);
    std::vector<float> amax(c::chunk_count(n, chunk) + 1), back(n), err(n);  // + the finiteness flag
    std::vector<std::int8_t> q(n);
    k::int8_absmax(amax.data(), x.data(), n, chunk);
    k::int8_quantize(q.data(), err.data(), x.data(), n, chunk, amax.data(), levels);
    k::int8_dequantize(back.data(), q.data(), n, chunk, amax.data(), levels);
    for (std::int64_t i = 0; i < n; ++i) {
      const float step = amax[i / chunk] / levels;
      ASSERT_LE(std::fabs(back[i] - x[i]), 0.5f * step * (1 + 1e-6f)) << "element " << i << ", " << ranks << " ranks";
      ASSERT_LE(std::abs(q[i]), levels);
      // the residual is what rounding dropped (to fp32's rounding: the compiler may fuse x - q s)
      ASSERT_NEAR(err[i], x[i] - back[i], 1e-6f * std::fabs(x[i]) + 1e-7f * step);
    }
  }
  EXPECT_EQ(c::int8_levels(1), 127);
  EXPECT_EQ(c::int8_levels(2), 63);
  EXPECT_EQ(c::int8_levels(128), 0);
}

// The chunk maxima ignore NaN and take inf; the extra element flags either, and a flagged sum comes
// back NaN everywhere (every rank's step is then not finite, as it would be uncompressed).
TEST(Int8, NonFiniteValuesAreFlaggedAndPoisonTheSum) {
  const std::int64_t n = 10, chunk = 4, chunks = 3;
  std::vector<float> x = {1, -2, 0.5f, 0, 3, -1, 2, 1, 0.25f, -0.5f};
  std::vector<float> amax(chunks + 1, -1.0f), back(n);
  std::vector<std::int8_t> q(n);
  k::int8_absmax(amax.data(), x.data(), n, chunk);
  EXPECT_EQ(amax, (std::vector<float>{2, 3, 0.5f, 0}));
  k::int8_quantize(q.data(), nullptr, x.data(), n, chunk, amax.data(), 127);
  EXPECT_EQ(q[1], -127);
  EXPECT_EQ(q[9], -127);
  k::int8_dequantize(back.data(), q.data(), n, chunk, amax.data(), 127);
  for (std::int64_t i = 0; i < n; ++i) EXPECT_NEAR(back[i], x[i], 0.5 * amax[i / chunk] / 127);

  x[5] = std::numeric_limits<float>::quiet_NaN();
  k::int8_absmax(amax.data(), x.data(), n, chunk);
  EXPECT_EQ(amax, (std::vector<float>{2, 3, 0.5f, 1})) << "NaN ignored by its chunk's maximum, flagged";
  x[5] = -std::numeric_limits<float>::infinity();
  k::int8_absmax(amax.data(), x.data(), n, chunk);
  EXPECT_EQ(amax[1], std::numeric_limits<float>::infinity());
  EXPECT_EQ(amax[3], 1.0f);
  k::int8_quantize(q.data(), nullptr, x.data(), n, chunk, amax.data(), 127);
  for (std::int64_t i = 4; i < 8; ++i) EXPECT_EQ(q[i], 0) << "an infinite step sends nothing";
  k::int8_dequantize(back.data(), q.data(), n, chunk, amax.data(), 127);
  for (std::int64_t i = 0; i < n; ++i) EXPECT_TRUE(std::isnan(back[i])) << i;

  float none[1] = {-1.0f};  // an empty bucket: no chunks, and nothing non-finite
  k::int8_absmax(none, x.data(), 0, chunk);
  EXPECT_EQ(none[0], 0.0f);
}

// N ranks quantise with the step from the largest |x| over all of them: the exact sum of their int8
// values never leaves int8's range, so an int8 all-reduce adds them without saturating.
TEST(Int8, SumOfRanksCannotOverflow) {
  const std::int64_t n = 4096, chunk = 256;
  for (int ranks : {2, 3, 4, 8, 16, 127}) {
    std::vector<std::vector<float>> x;
    std::vector<float> amax(c::chunk_count(n, chunk) + 1, 0.0f), mine(amax.size());
    for (int r = 0; r < ranks; ++r) {
      x.push_back(randn(n, 10 + r));
      for (std::int64_t i = 0; i < n; ++i)
        x[r][i] = std::copysign(std::fabs(x[r][i]) + 3.0f, 1.0f);  // same signs: worst case
      k::int8_absmax(mine.data(), x[r].data(), n, chunk);
      for (std::size_t j = 0; j < amax.size(); ++j) amax[j] = std::max(amax[j], mine[j]);
    }
    std::vector<int> sum(n, 0);
    std::vector<std::int8_t> q(n);
    for (int r = 0; r < ranks; ++r) {
      k::int8_quantize(q.data(), nullptr, x[r].data(), n, chunk, amax.data(), c::int8_levels(ranks));
      for (std::int64_t i = 0; i < n; ++i) sum[i] += q[i];
    }
    EXPECT_LE(*std::max_element(sum.begin(), sum.end()), 127) << ranks << " ranks";
    EXPECT_GE(*std::min_element(sum.begin(), sum.end()), -127) << ranks << " ranks";
  }
}

TEST(TopK, KeepsExactlyTheKLargestMagnitudes) {
  const std::int64_t n = 5000;
  auto x = randn(n, 3);
  x[17] = x[4000] = 9.0f;  // a tie: both kept (they are the largest)
  x[18] = -8.5f;
  for (double ratio : {0.0001, 0.01, 0.1, 0.5, 1.0}) {
    const std::int64_t k = c::top_k_count(n, ratio);
    std::vector<std::int32_t> idx(k);
    std::vector<float> val(k);
    loom::kernels::topk_select(idx.data(), val.data(), x.data(), n, k);
    ASSERT_TRUE(std::is_sorted(idx.begin(), idx.end()));
    std::vector<float> mags(n);
    for (std::int64_t i = 0; i < n; ++i) mags[i] = std::fabs(x[i]);
    std::vector<float> sorted = mags;
    std::sort(sorted.begin(), sorted.end(), std::greater<>());
    const float kth = sorted[k - 1];
    float kept_min = 1e30f;
    for (std::int64_t j = 0; j < k; ++j) {
      EXPECT_EQ(val[j], x[idx[j]]);
      kept_min = std::min(kept_min, std::fabs(val[j]));
    }
    EXPECT_EQ(kept_min, kth) << "ratio " << ratio;  // nothing kept is smaller than the k-th largest
    std::int64_t above = 0;                         // and every element larger than it is kept
    for (std::int64_t i = 0; i < n; ++i) above += mags[i] > kth;
    std::int64_t kept_above = 0;
    for (std::int64_t j = 0; j < k; ++j) kept_above += std::fabs(val[j]) > kth;
    EXPECT_EQ(above, kept_above);
  }
  EXPECT_EQ(c::top_k_count(1000, 0.01), 10);
  EXPECT_EQ(c::top_k_count(10, 1e-6), 1);
}

// The set is the first k of the order (magnitude descending, index ascending), as a full sort gives
// it: with ties everywhere (a few magnitudes, both signs, zeros), with ties among larger values in
// one radix bucket (1, 1 + 2^-7, 1 + 2^-6 share their top 12 bits), and with the plain normal
// values of a gradient.
TEST(TopK, IsTheFirstKOfTheFullOrderTiesToTheLowestIndices) {
  std::mt19937 gen(7);
  for (int trial = 0; trial < 9; ++trial) {
    const std::int64_t n = 3001;
    std::vector<float> x = trial % 3 == 1 ? randn(n, 20 + trial) : std::vector<float>(static_cast<std::size_t>(n));
    if (trial % 3 == 0)
      for (auto& v : x) v = static_cast<float>(static_cast<int>(gen() % 7) - 3) * 0.25f;
    if (trial % 3 == 2)
      for (auto& v : x) v = (gen() % 2 ? -1.0f : 1.0f) * (1.0f + static_cast<float>(gen() % 3) / 128.0f);
    std::vector<std::int32_t> order(static_cast<std::size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
      const float fa = std::fabs(x[a]), fb = std::fabs(x[b]);
      return fa > fb || (fa == fb && a < b);
    });
    for (std::int64_t k : {std::int64_t(1), std::int64_t(5), n / 3, n - 1, n}) {
      std::vector<std::int32_t> want(order.begin(), order.begin() + k), idx(static_cast<std::size_t>(k));
      std::sort(want.begin(), want.end());
      std::vector<float> val(static_cast<std::size_t>(k));
      loom::kernels::topk_select(idx.data(), val.data(), x.data(), n, k);
      EXPECT_EQ(idx, want) << "trial " << trial << ", k " << k;
      for (std::int64_t j = 0; j < k; ++j) EXPECT_EQ(val[j], x[idx[j]]);
    }
  }
}

// A NaN or an inf anywhere: NaN values at indices 0..k-1 (every rank's sum is then non-finite); the
// scatters add one rank's pairs and clear the sent entries.
TEST(TopK, NonFiniteValuesSendNaNAndTheScattersTouchOnlyTheIndices) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
    auto x = randn(100, 4);
    x[63] = bad;
    std::vector<std::int32_t> idx(5, -1);
    std::vector<float> val(5, 0.0f);
    loom::kernels::topk_select(idx.data(), val.data(), x.data(), 100, 5);
    for (int j = 0; j < 5; ++j) {
      EXPECT_EQ(idx[j], j);
      EXPECT_TRUE(std::isnan(val[j]));
    }
  }
  std::vector<float> x(10, 1.0f);
  const std::vector<std::int32_t> idx = {2, 5, 9};
  const std::vector<float> val = {0.5f, -2.0f, 4.0f};
  k::topk_scatter_add(x.data(), idx.data(), val.data(), 3);
  EXPECT_EQ(x, (std::vector<float>{1, 1, 1.5f, 1, 1, -1, 1, 1, 1, 5}));
  k::topk_clear(x.data(), idx.data(), 3);
  EXPECT_EQ(x, (std::vector<float>{1, 1, 0, 1, 1, 0, 1, 1, 1, 0}));
}

namespace {
// Row-major a [n,k] b [k,m] in double.
std::vector<double> mm(const std::vector<double>& a, const std::vector<double>& b, int n, int k, int m,
                       bool ta = false) {
  std::vector<double> out(static_cast<std::size_t>(n) * m, 0.0);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < m; ++j) {
      double s = 0;
      for (int t = 0; t < k; ++t) s += (ta ? a[t * n + i] : a[i * k + t]) * b[t * m + j];
      out[i * m + j] = s;
    }
  return out;
}
}  // namespace

TEST(PowerSGD, OrthogonalizeGivesOrthonormalColumns) {
  const int n = 40, r = 6;
  auto p = randn(n * r, 5);
  c::orthogonalize(p.data(), n, r);
  for (int a = 0; a < r; ++a)
    for (int b = 0; b < r; ++b) {
      double dot = 0;
      for (int i = 0; i < n; ++i) dot += double(p[i * r + a]) * p[i * r + b];
      EXPECT_NEAR(dot, a == b ? 1.0 : 0.0, 1e-6) << a << "," << b;
    }
}

// At full rank (r = min(n, m)) one power iteration spans M's column space: P Q^T = M.
TEST(PowerSGD, FullRankReproducesTheMatrix) {
  const int n = 12, m = 20, r = std::min(n, m);
  const auto Mf = randn(n * m, 6), Qf = randn(m * r, 7);
  std::vector<double> M(Mf.begin(), Mf.end()), Q(Qf.begin(), Qf.end());
  auto P = mm(M, Q, n, m, r);
  std::vector<float> Pf(P.begin(), P.end());
  c::orthogonalize(Pf.data(), n, r);
  P.assign(Pf.begin(), Pf.end());
  const auto Q2 = mm(M, P, m, n, r, true);  // M^T P: [m, r]
  std::vector<double> Q2t(static_cast<std::size_t>(r) * m);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < r; ++j) Q2t[j * m + i] = Q2[i * r + j];
  const auto approx = mm(P, Q2t, n, r, m);
  std::vector<double> diff(M.size());
  for (std::size_t i = 0; i < M.size(); ++i) diff[i] = approx[i] - M[i];
  EXPECT_LT(norm(diff) / norm(M), 1e-5);              // fp32 P: ~1e-7 per element
  EXPECT_TRUE(c::worth_compressing(100, 100, 4, 2));  // 10000 / 800 = 12.5
  EXPECT_FALSE(c::worth_compressing(8, 8, 4, 2));     // 64 / 64 = 1
}

// Error feedback: what each step does not send is carried into the next, so the sum of everything
// sent is the sum of the true gradients minus one residual, which stays bounded; without it the
// dropped mass accumulates.
TEST(ErrorFeedback, SumOfSentUpdatesFollowsSumOfGradients) {
  const std::int64_t n = 2000, steps = 300;
  const auto mean = randn(n, 8, 0.05f);
  for (bool feedback : {true, false}) {
    for (int method = 0; method < 2; ++method) {  // 0: top-k 1%, 1: int8 with 4 ranks' levels
      std::vector<double> sum_g(n, 0.0), sum_sent(n, 0.0);
      std::vector<float> e(n, 0.0f), x(n), sent(n);
      for (std::int64_t t = 0; t < steps; ++t) {
        const auto noise = randn(n, 100 + static_cast<unsigned>(t));
        for (std::int64_t i = 0; i < n; ++i) {
          const float g = mean[i] + noise[i];
          sum_g[i] += g;
          x[i] = g + (feedback ? e[i] : 0.0f);
        }
        if (method == 0) {
          const std::int64_t k = c::top_k_count(n, 0.01);
          std::vector<std::int32_t> idx(k);
          std::vector<float> val(k);
          loom::kernels::topk_select(idx.data(), val.data(), x.data(), n, k);
          std::fill(sent.begin(), sent.end(), 0.0f);
          for (std::int64_t j = 0; j < k; ++j) sent[idx[j]] = val[j];
        } else {
          std::vector<float> amax(c::chunk_count(n, 256) + 1);
          std::vector<std::int8_t> q(n);
          k::int8_absmax(amax.data(), x.data(), n, 256);
          k::int8_quantize(q.data(), nullptr, x.data(), n, 256, amax.data(), c::int8_levels(4));
          k::int8_dequantize(sent.data(), q.data(), n, 256, amax.data(), c::int8_levels(4));
        }
        for (std::int64_t i = 0; i < n; ++i) {
          e[i] = x[i] - sent[i];
          sum_sent[i] += sent[i];
        }
      }
      std::vector<double> d(n);
      for (std::int64_t i = 0; i < n; ++i) d[i] = sum_sent[i] - sum_g[i];
      const double rel = norm(d) / norm(sum_g);
      if (feedback) {
        EXPECT_LT(rel, method == 0 ? 0.3 : 0.01) << (method == 0 ? "top-k" : "int8") << " with error feedback";
      } else if (method == 0) {
        EXPECT_GT(rel, 0.8) << "top-k 1% without error feedback loses most of the gradient";
      }
      if (feedback) {  // the gap is exactly the last residual
        std::vector<double> last(e.begin(), e.end());
        EXPECT_NEAR(norm(d), norm(last), 1e-3 * norm(sum_g));
      }
    }
  }
}

int main(int argc, char** argv) {
  Kokkos::ScopeGuard kokkos(argc, argv);  // the int8 kernels are the host back end's (Kokkos)
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
