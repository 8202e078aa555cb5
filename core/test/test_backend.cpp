// Unit tests of the back end's generic operations on typed buffers (core/backend/backend.hpp): cast,
// matmul, sq_norm_check, scale and fill, on the host back end.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/base/dtype.hpp"
#include "core/backend/gemm.hpp"
#include "core/backend/kernels.hpp"
#include "core/test/tensors.hpp"

using loom::bf16;
using loom::BufferRef;
using loom::DType;
using loom::f16;
using loom::MemSpace;
using loom::testing::buf;

namespace {

std::unique_ptr<loom::Backend> host() { return loom::make_host_backend(1); }

std::vector<double> randn(std::size_t n, std::uint64_t seed, double stddev = 1.0, double mean = 0.0) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> dist(mean, stddev);
  std::vector<double> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}
template <class T>
std::vector<T> as(const std::vector<double>& v) {
  std::vector<T> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = loom::from_acc<T>(v[i]);
  return r;
}
template <class T>
std::vector<double> widen(const std::vector<T>& v) {
  std::vector<double> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = loom::to_acc<double>(v[i]);
  return r;
}

// x rounded to nearest even with p significant bits, exponents down to emin (below: subnormal
// quantum 2^(emin - p + 1)), overflowing to inf above max_finite: an independent reference for
// bf16 (p 8, emin -126) and fp16 (p 11, emin -14), computed in double (exact for these inputs).
double round_to_format(double x, int p, int emin, double max_finite) {
  if (x == 0 || !std::isfinite(x)) return x;
  int e;
  std::frexp(x, &e);  // |x| in [2^(e-1), 2^e)
  const int q = std::max(e - 1, emin) - (p - 1);
  const double r = std::ldexp(std::nearbyint(std::ldexp(x, -q)), q);
  if (std::abs(r) > max_finite) return std::copysign(std::numeric_limits<double>::infinity(), x);
  return r;
}
double round_bf16(double x) { return round_to_format(x, 8, -126, 0x1.fep127); }
double round_f16(double x) { return round_to_format(x, 11, -14, 65504.0); }

// Values over the whole range of both 16-bit types, ties, subnormals, overflow and specials.
std::vector<double> cast_inputs() {
  std::vector<double> v = {0.0,
                           -0.0,
                           1.0,
                           -1.0,
                           1 + 0x1p-8,             // bf16 tie: to even (1)
                           1 + 3 * 0x1p-8,         // bf16 tie: to even (1 + 2^-6)
                           1 + 0x1p-11,            // fp16 tie: to even (1)
                           1 + 0x1p-8 + 0x1p-30,   // double -> float -> bf16 would make it a tie
                           1 + 0x1p-11 + 0x1p-40,  // the same for fp16
                           65504.0,
                           65519.0,
                           65520.0,
                           -70000.0,  // fp16 max, below / at the overflow threshold
                           0x1p-24,
                           0x1p-25,
                           0x1.8p-24,
                           3e-8,
                           6e-5,  // fp16 subnormals and their ties
                           0x1p-133,
                           1e-40,
                           3.3e38,
                           3.4e38,
                           1e300,
                           -1e-300,
                           std::numeric_limits<double>::infinity(),
                           -std::numeric_limits<double>::infinity()};
  std::mt19937_64 gen(7);
  std::uniform_real_distribution<double> mant(-2, 2);
  std::uniform_int_distribution<int> ex(-30, 20);
  for (int i = 0; i < 4000; ++i) v.push_back(std::ldexp(mant(gen), ex(gen)));
  return v;
}

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

}  // namespace

// ---------------------------------------------------------------------------------------------
// cast

TEST(Backend, CastRoundsToNearestEvenBetweenAllFloatTypes) {
  auto be = host();
  const std::vector<double> x = cast_inputs();
  const std::int64_t n = static_cast<std::int64_t>(x.size());
  std::vector<float> xf(x.begin(), x.end());
  std::vector<bf16> b(n);
  std::vector<f16> h(n);
  std::vector<float> f(n);
  std::vector<double> d(n);

  // fp64 -> bf16 / fp16 round directly (no double rounding through float)
  be->cast(BufferRef(b.data(), n), BufferRef(x.data(), n));
  be->cast(BufferRef(h.data(), n), BufferRef(x.data(), n));
  for (std::int64_t i = 0; i < n; ++i) {
    EXPECT_TRUE(same_bits(loom::to_acc<double>(b[i]), round_bf16(x[i]))) << "fp64 -> bf16 of " << x[i];
    EXPECT_TRUE(same_bits(loom::to_acc<double>(h[i]), round_f16(x[i]))) << "fp64 -> fp16 of " << x[i];
  }
  EXPECT_EQ(loom::to_float(b[7]), 1.0f + 0x1p-7f);  // 1 + 2^-8 + 2^-30: above the tie, rounds up
  EXPECT_EQ(loom::to_float(h[8]), 1.0f + 0x1p-10f);
  EXPECT_EQ(loom::to_float(b[4]), 1.0f);                                                  // the tie itself: to even
  EXPECT_TRUE(std::signbit(loom::to_float(b[1])) && std::signbit(loom::to_float(h[1])));  // -0 stays -0

  // fp32 -> bf16 / fp16 / fp64
  be->cast(BufferRef(b.data(), n), BufferRef(xf.data(), n));
  be->cast(BufferRef(h.data(), n), BufferRef(xf.data(), n));
  be->cast(BufferRef(d.data(), n), BufferRef(xf.data(), n));
  for (std::int64_t i = 0; i < n; ++i) {
    EXPECT_TRUE(same_bits(loom::to_acc<double>(b[i]), round_bf16(xf[i]))) << "fp32 -> bf16 of " << xf[i];
    EXPECT_TRUE(same_bits(loom::to_acc<double>(h[i]), round_f16(xf[i]))) << "fp32 -> fp16 of " << xf[i];
    EXPECT_TRUE(same_bits(d[i], static_cast<double>(xf[i])));
  }
  // fp16 -> fp32 exact (the vectorised conversion where the CPU has F16C, 8 at a time, and the tail)
  be->cast(BufferRef(f.data(), n), BufferRef(h.data(), n));
  for (std::int64_t i = 0; i < n; ++i)
    EXPECT_TRUE(same_bits(f[i], loom::to_acc<double>(h[i]))) << "fp16 -> fp32 of " << xf[i];
  // fp64 -> fp32
  be->cast(BufferRef(f.data(), n), BufferRef(x.data(), n));
  for (std::int64_t i = 0; i < n; ++i) EXPECT_EQ(f[i], static_cast<float>(x[i])) << x[i];

  // bf16 <-> fp16 (rounded once from the exact value), 16-bit -> fp32 / fp64 exact
  std::vector<f16> h2(n);
  std::vector<bf16> b2(n);
  be->cast(BufferRef(h2.data(), n), BufferRef(b.data(), n));
  be->cast(BufferRef(b2.data(), n), BufferRef(h.data(), n));
  be->cast(BufferRef(f.data(), n), BufferRef(b.data(), n));
  be->cast(BufferRef(d.data(), n), BufferRef(h.data(), n));
  for (std::int64_t i = 0; i < n; ++i) {
    EXPECT_TRUE(same_bits(loom::to_acc<double>(h2[i]), round_f16(loom::to_float(b[i])))) << "bf16 -> fp16 " << x[i];
    EXPECT_TRUE(same_bits(loom::to_acc<double>(b2[i]), round_bf16(loom::to_float(h[i])))) << "fp16 -> bf16 " << x[i];
    EXPECT_EQ(f[i], loom::to_float(b[i]));
    EXPECT_TRUE(same_bits(d[i], static_cast<double>(loom::to_float(h[i]))));
  }

  // NaN stays NaN through every conversion
  const double nan = std::numeric_limits<double>::quiet_NaN();
  bf16 bn;
  f16 hn;
  float fn;
  be->cast(BufferRef(&bn, 1), BufferRef(&nan, 1));
  be->cast(BufferRef(&hn, 1), BufferRef(&bn, 1));
  be->cast(BufferRef(&fn, 1), BufferRef(&hn, 1));
  EXPECT_TRUE(std::isnan(loom::to_float(bn)));
  EXPECT_TRUE(std::isnan(loom::to_float(hn)));
  EXPECT_TRUE(std::isnan(fn));

  // the same buffer, same type: nothing to do
  be->cast(BufferRef(f.data(), n), BufferRef(f.data(), n));
  EXPECT_EQ(f[2], 1.0f);
}

TEST(Backend, CastRefusesMismatchedBuffers) {
  auto be = host();
  std::vector<float> f(4);
  std::vector<bf16> b(3);
  std::vector<std::int32_t> i(4);
  EXPECT_THROW(be->cast(BufferRef(b.data(), 3), BufferRef(f.data(), 4)), std::invalid_argument);
  EXPECT_THROW(be->cast(BufferRef(i.data(), 4), BufferRef(f.data(), 4)), std::invalid_argument);
  EXPECT_THROW(be->cast(BufferRef(f.data(), 4), BufferRef(f.data(), 4, MemSpace::device)), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// matmul

namespace {
// Row-major reference in long double: out = alpha op(a) op(b) + beta out.
std::vector<double> ref_matmul(const std::vector<double>& out, const std::vector<double>& a,
                               const std::vector<double>& b, int M, int N, int K, bool ta, bool tb, double alpha,
                               double beta) {
  std::vector<double> r(static_cast<std::size_t>(M) * N);
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      long double s = 0;
      for (int p = 0; p < K; ++p)
        s += static_cast<long double>(ta ? a[p * M + i] : a[i * K + p]) * (tb ? b[j * K + p] : b[p * N + j]);
      r[i * N + j] = static_cast<double>(alpha * static_cast<double>(s) + (beta != 0 ? beta * out[i * N + j] : 0.0));
    }
  return r;
}
double norm_err(const std::vector<double>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) num += (got[i] - ref[i]) * (got[i] - ref[i]), den += ref[i] * ref[i];
  return std::sqrt(num / den);
}
}  // namespace

TEST(Backend, MatmulFloatIsGemmSgemm) {  // all fp32: straight to loom::gemm::sgemm (run.gemm's choice)
  auto be = host();
  const int M = 7, N = 5, K = 33;
  for (int t = 0; t < 4; ++t) {
    const bool ta = t & 1, tb = t & 2;
    const std::vector<float> a = as<float>(randn(M * K, 10 + t)), b = as<float>(randn(K * N, 20 + t)),
                             c0 = as<float>(randn(M * N, 30 + t));
    std::vector<float> got = c0, want = c0;
    be->matmul(BufferRef(got.data(), M * N), BufferRef(a.data(), M * K), BufferRef(b.data(), K * N), M, N, K, ta, tb,
               0.5f, 0.25f);
    loom::gemm::sgemm(ta, tb, M, N, K, 0.5f, a.data(), ta ? M : K, b.data(), tb ? K : N, 0.25f, want.data(), N);
    EXPECT_EQ(got, want) << "transa " << ta << " transb " << tb;
    const double e = norm_err(widen(got), ref_matmul(widen(c0), widen(a), widen(b), M, N, K, ta, tb, 0.5, 0.25));
    EXPECT_LT(e, 1e-6);  // K = 33 float products: ~1e-7
  }
}

TEST(Backend, MatmulDoubleAnd16BitOperands) {
  auto be = host();
  const int M = 6, N = 9, K = 40;
  const double ubf = 0x1p-8, uh = 0x1p-11;
  for (int t = 0; t < 4; ++t) {
    const bool ta = t & 1, tb = t & 2;
    const std::vector<double> a = randn(M * K, 40 + t), b = randn(K * N, 50 + t), c0 = randn(M * N, 60 + t);
    {  // fp64: dgemm
      std::vector<double> out = c0;
      be->matmul(BufferRef(out.data(), M * N), BufferRef(a.data(), M * K), BufferRef(b.data(), K * N), M, N, K, ta, tb,
                 2.0f, -1.0f);
      EXPECT_LT(norm_err(out, ref_matmul(c0, a, b, M, N, K, ta, tb, 2.0, -1.0)), 1e-14);
    }
    {  // bf16 x bf16 -> bf16, beta = 0 over NaN garbage (not read): float accumulation, rounded once
      const std::vector<bf16> ab = as<bf16>(a), bb = as<bf16>(b);
      std::vector<bf16> out(M * N, loom::to_bf16(std::numeric_limits<float>::quiet_NaN()));
      be->matmul(BufferRef(out.data(), M * N), BufferRef(ab.data(), M * K), BufferRef(bb.data(), K * N), M, N, K, ta,
                 tb);
      const double e = norm_err(widen(out), ref_matmul(c0, widen(ab), widen(bb), M, N, K, ta, tb, 1.0, 0.0));
      EXPECT_LE(e, 1.01 * ubf + 1e-6) << "bf16 transa " << ta << " transb " << tb;
    }
    {  // fp16 a, fp32 b, bf16 out with beta: one rounding into fp16 inputs, one of the output
      const std::vector<f16> ah = as<f16>(a);
      const std::vector<float> bf = as<float>(b);
      const std::vector<bf16> cb = as<bf16>(c0);
      std::vector<bf16> out = cb;
      be->matmul(BufferRef(out.data(), M * N), BufferRef(ah.data(), M * K), BufferRef(bf.data(), K * N), M, N, K, ta,
                 tb, 0.5f, 2.0f);
      const double e = norm_err(widen(out), ref_matmul(widen(cb), widen(ah), widen(bf), M, N, K, ta, tb, 0.5, 2.0));
      EXPECT_LE(e, 1.01 * ubf + 1e-6) << "mixed transa " << ta << " transb " << tb;
    }
    {  // fp16 x fp16 -> fp32: float accumulation only
      const std::vector<f16> ah = as<f16>(a), bh = as<f16>(b);
      std::vector<float> out = as<float>(c0);
      be->matmul(BufferRef(out.data(), M * N), BufferRef(ah.data(), M * K), BufferRef(bh.data(), K * N), M, N, K, ta,
                 tb, 1.0f, 1.0f);
      const double e =
          norm_err(widen(out), ref_matmul(widen(as<float>(c0)), widen(ah), widen(bh), M, N, K, ta, tb, 1.0, 1.0));
      EXPECT_LT(e, 1e-6);
      EXPECT_LT(e, uh);
    }
  }
}

TEST(Backend, MatmulRefusesMismatchedShapesAndTypes) {
  auto be = host();
  std::vector<float> a(6), b(6), c(4);
  std::vector<double> d(6);
  std::vector<std::int8_t> q(6);
  EXPECT_NO_THROW(
      be->matmul(BufferRef(c.data(), 4), BufferRef(a.data(), 6), BufferRef(b.data(), 6), 2, 2, 3, false, false));
  EXPECT_THROW(
      be->matmul(BufferRef(c.data(), 4), BufferRef(a.data(), 6), BufferRef(b.data(), 6), 2, 2, 4, false, false),
      std::invalid_argument);
  EXPECT_THROW(
      be->matmul(BufferRef(c.data(), 4), BufferRef(d.data(), 6), BufferRef(b.data(), 6), 2, 2, 3, false, false),
      std::invalid_argument);
  EXPECT_THROW(
      be->matmul(BufferRef(c.data(), 4), BufferRef(q.data(), 6), BufferRef(b.data(), 6), 2, 2, 3, false, false),
      std::invalid_argument);
  EXPECT_THROW(be->matmul(BufferRef(c.data(), 4, MemSpace::device), BufferRef(a.data(), 6), BufferRef(b.data(), 6), 2,
                          2, 3, false, false),
               std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// sq_norm_check

namespace {
// Eight fp32 tensors: multi-chunk, single element, empty, odd sizes. Each tensor's sum of squares
// is a sum of a few float partials, which double holds exactly, so sums of ordinary tensors add up
// the same in any order; the last two make the order visible: 2^52 + 0.5 + 0.5 rounds to 2^52 (a
// tie, to even) twice, while 0.5 + 0.5 + 2^52 is 2^52 + 1.
std::vector<std::vector<float>> float_tensors() {
  const std::size_t chunk = static_cast<std::size_t>(loom::kernels::kChunk);
  return {as<float>(randn(3 * chunk + 17, 71)),
          as<float>(randn(1, 72, 0.1)),
          as<float>(randn(1000, 73, 5.0)),
          {},
          as<float>(randn(2 * chunk, 74, 0.01)),
          {0x1p26f},
          {0.5f, 0.5f},
          {0.5f, 0.5f}};
}
std::vector<BufferRef> refs(std::vector<std::vector<float>>& ts) {
  std::vector<BufferRef> r;
  for (auto& t : ts) r.emplace_back(t.data(), static_cast<std::int64_t>(t.size()));
  return r;
}
}  // namespace

// The engine's gradient norm is the sum over parameters of sum_squares, in order: the fused check
// must give that very double, so that golden loss curves do not move when it is switched to.
TEST(Backend, SqNormCheckEqualsSumSquaresInListOrderBitForBit) {
  auto be = host();
  auto ts = float_tensors();
  double expect = 0, reversed = 0;
  for (auto& t : ts) expect += loom::kernels::sum_squares(t.data(), static_cast<std::int64_t>(t.size()));
  for (auto t = ts.rbegin(); t != ts.rend(); ++t)
    reversed += loom::kernels::sum_squares(t->data(), static_cast<std::int64_t>(t->size()));
  ASSERT_FALSE(same_bits(expect, reversed)) << "these tensors do not tell one order of addition from another";
  const loom::NormCheck r = be->sq_norm_check(refs(ts));
  EXPECT_TRUE(same_bits(r.sum_squares, expect)) << r.sum_squares << " vs " << expect;
  EXPECT_TRUE(r.all_finite);
  EXPECT_EQ(r.first_nonfinite, -1);
  const loom::NormCheck none = be->sq_norm_check({});
  EXPECT_EQ(none.sum_squares, 0.0);
  EXPECT_TRUE(none.all_finite);
  EXPECT_EQ(none.first_nonfinite, -1);
}

TEST(Backend, SqNormCheckFindsTheFirstTensorWithANaNOrAnInf) {
  auto be = host();
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (float bad : {nan, inf, -inf}) {
    auto ts = float_tensors();
    ts[2][517] = bad;  // the third tensor
    loom::NormCheck r = be->sq_norm_check(refs(ts));
    EXPECT_FALSE(r.all_finite) << bad;
    EXPECT_EQ(r.first_nonfinite, 2) << bad;
    EXPECT_FALSE(std::isfinite(r.sum_squares));
    ts[4][8000] = nan;  // a later one as well: still the third is named
    r = be->sq_norm_check(refs(ts));
    EXPECT_EQ(r.first_nonfinite, 2) << bad;
  }
  // NaN in the third, inf in the first chunk of the fifth and nothing else: each found alone
  auto ts = float_tensors();
  ts[4][0] = inf;
  EXPECT_EQ(be->sq_norm_check(refs(ts)).first_nonfinite, 4);
  ts[2].back() = nan;
  EXPECT_EQ(be->sq_norm_check(refs(ts)).first_nonfinite, 2);
}

// Finite values whose squares overflow float: the sum is inf, but every tensor is finite.
TEST(Backend, SqNormCheckTellsOverflowFromNonFinite) {
  auto be = host();
  auto ts = float_tensors();
  ts[1][0] = 1e30f;
  const loom::NormCheck r = be->sq_norm_check(refs(ts));
  EXPECT_TRUE(std::isinf(r.sum_squares));
  EXPECT_TRUE(r.all_finite);
  EXPECT_EQ(r.first_nonfinite, -1);
}

TEST(Backend, SqNormCheckOn16BitAndMixedTensors) {
  auto be = host();
  const std::int64_t n = 2 * loom::kernels::kChunk + 3;
  // near 1: a 16-bit partial sum would stall far below the true sum of squares (~2n)
  std::vector<bf16> b = as<bf16>(randn(n, 81, 0.5, 1.0));
  std::vector<f16> h = as<f16>(randn(n, 82, 0.5, 1.0));
  std::vector<float> f = as<float>(randn(n, 83));
  std::vector<bf16> b2 = as<bf16>(randn(100, 84));
  long double ss = 0;
  for (double v : widen(b)) ss += static_cast<long double>(v) * v;
  for (double v : widen(h)) ss += static_cast<long double>(v) * v;
  for (double v : widen(f)) ss += static_cast<long double>(v) * v;
  for (double v : widen(b2)) ss += static_cast<long double>(v) * v;
  std::vector<BufferRef> list = {BufferRef(b.data(), n), BufferRef(h.data(), n), BufferRef(f.data(), n),
                                 BufferRef(b2.data(), 100)};
  loom::NormCheck r = be->sq_norm_check(list);
  // float partial sums of 4096 squares: ~sqrt(4096) * 2^-24 relative, <= 2.4e-4 at worst
  EXPECT_NEAR(r.sum_squares, static_cast<double>(ss), 1e-4 * static_cast<double>(ss));
  EXPECT_TRUE(r.all_finite);
  EXPECT_EQ(r.first_nonfinite, -1);
  // each tensor's share is its own sum_squares kernel, added in list order
  const double expect = loom::kernels::sum_squares(b.data(), n) + loom::kernels::sum_squares(h.data(), n) +
                        loom::kernels::sum_squares(f.data(), n) + loom::kernels::sum_squares(b2.data(), 100);
  EXPECT_TRUE(same_bits(r.sum_squares, expect));

  // a bf16 NaN in the third tensor (made bf16 for this), an fp16 inf in the fourth (fp16)
  std::vector<bf16> b3 = as<bf16>(randn(n, 85));
  std::vector<f16> h4 = as<f16>(randn(100, 86));
  b3[n - 1].bits = 0x7fc0;  // NaN
  h4[5].bits = 0x7c00;      // +inf
  list = {BufferRef(b.data(), n), BufferRef(h.data(), n), BufferRef(b3.data(), n), BufferRef(h4.data(), 100)};
  r = be->sq_norm_check(list);
  EXPECT_FALSE(r.all_finite);
  EXPECT_EQ(r.first_nonfinite, 2);
  b3[n - 1].bits = 0x3f80;  // 1.0: now the fp16 inf in the fourth is the first
  r = be->sq_norm_check(list);
  EXPECT_EQ(r.first_nonfinite, 3);
  // the largest bf16 squared overflows float: finite all the same
  b3[0].bits = 0x7f7f;
  h4[5].bits = 0x3c00;
  r = be->sq_norm_check(list);
  EXPECT_TRUE(std::isinf(r.sum_squares));
  EXPECT_TRUE(r.all_finite);
}

TEST(Backend, SqNormCheckRefusesOtherTypesAndSpaces) {
  auto be = host();
  std::vector<std::int32_t> i(3);
  std::vector<float> f(3);
  EXPECT_THROW(be->sq_norm_check({BufferRef(f.data(), 3), BufferRef(i.data(), 3)}), std::invalid_argument);
  EXPECT_THROW(be->sq_norm_check({BufferRef(f.data(), 3, MemSpace::device)}), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// scale and fill

TEST(Backend, TypedScaleAndFill) {
  auto be = host();
  const std::int64_t n = loom::kernels::kChunk + 9;
  const std::vector<double> x = randn(n, 91);
  {  // fp32: the same as the host kernels on float
    std::vector<float> a = as<float>(x), b = a;
    be->scale(BufferRef(a.data(), n), 0.3);
    loom::kernels::scale(b.data(), 0.3f, n);
    EXPECT_EQ(a, b);
    be->fill(BufferRef(a.data(), n), 0.1);
    loom::kernels::fill(b.data(), 0.1f, n);
    EXPECT_EQ(a, b);
  }
  {  // bf16 / fp16: computed in float, rounded once
    std::vector<bf16> b = as<bf16>(x);
    std::vector<f16> h = as<f16>(x);
    const std::vector<bf16> b0 = b;
    const std::vector<f16> h0 = h;
    be->scale(BufferRef(b.data(), n), 0.3);
    be->scale(BufferRef(h.data(), n), 0.3);
    for (std::int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(b[i].bits, loom::to_bf16(loom::to_float(b0[i]) * 0.3f).bits) << i;
      ASSERT_EQ(h[i].bits, loom::to_f16(loom::to_float(h0[i]) * 0.3f).bits) << i;
    }
    be->fill(BufferRef(b.data(), n), 0.1);
    be->fill(BufferRef(h.data(), n), -2.5);
    for (std::int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(b[i].bits, loom::to_bf16(0.1f).bits);
      ASSERT_EQ(loom::to_float(h[i]), -2.5f);
    }
  }
  {  // fp64: in double
    std::vector<double> d = x;
    be->scale(BufferRef(d.data(), n), 0.3);
    for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(d[i], x[i] * 0.3);
    be->fill(BufferRef(d.data(), n), 0.1);
    for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(d[i], 0.1);
  }
  std::vector<std::int8_t> q(4);
  EXPECT_THROW(be->fill(BufferRef(q.data(), 4), 1.0), std::invalid_argument);
  EXPECT_THROW(be->scale(BufferRef(q.data(), 4), 1.0), std::invalid_argument);
}

// y += a x rounds the product, then the sum (PowerSGD's residual y - P Q^T / N, as it was written on
// the host before it moved to the back end): no fused multiply-add, on every element.
TEST(Backend, AxpyRoundsTheProductThenTheSum) {
  auto be = host();
  const std::int64_t n = loom::kernels::kChunk + 9;
  const std::vector<float> x = as<float>(randn(n, 92)), y0 = as<float>(randn(n, 93));
  std::vector<float> y = y0;
  const float a = -1.0f / 3.0f;
  be->axpy(buf(y), a, buf(x), n);
  std::int64_t fused_would_differ = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const float product = a * x[i];
    ASSERT_EQ(y[i], y0[i] + product) << i;
    fused_would_differ += std::fma(a, x[i], y0[i]) != y[i];
  }
  EXPECT_GT(fused_would_differ, 0) << "the inputs never tell a fused multiply-add apart";
}

// ---------------------------------------------------------------------------------------------
// The precision role: with Precision::matmul = bf16 or fp16, the model's matrix products
// (matmul_forward/_backward) multiply operands rounded to that type, nearest even, and accumulate in
// fp32 into fp32 outputs.

namespace {
template <class T>
double round16(float x) {
  if constexpr (std::is_same_v<T, bf16>)
    return loom::to_float(loom::to_bf16(x));
  else
    return loom::to_float(loom::to_f16(x));
}

// out[N,OC] = x W^T (+ bias), dinp = dout W, dW += dout^T x, from operands rounded to T, in fp64.
template <class T>
void check_16bit_linear(DType type) {
  const int N = 37, C = 48, OC = 29;
  const auto x = as<float>(randn(N * C, 11)), w = as<float>(randn(OC * C, 12, 0.3)), b = as<float>(randn(OC, 13)),
             dout = as<float>(randn(N * OC, 14));
  auto be = host();
  be->set_precision({type});
  std::vector<float> out(N * OC), dinp(N * C), dw(OC * C, 0.5f), db(OC, 0.0f);
  be->matmul_forward(buf(out), buf(x), buf(w), buf(b), N, C, OC);
  be->matmul_backward(buf(dinp), buf(dw), buf(db), buf(dout), buf(x), buf(w), N, C, OC);
  // fp32 accumulation of K exact products: |error| <= K * 2^-24 * sum |a b| (plus the bias add).
  const auto bound = [](int K, double mag) { return (K + 2) * std::ldexp(1.0, -24) * mag; };
  double worst_rounded = 0, worst_unrounded = 0;
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < OC; ++o) {
      double ref = b[o], exact = b[o], mag = std::fabs(b[o]);
      for (int c = 0; c < C; ++c) {
        ref += round16<T>(x[n * C + c]) * round16<T>(w[o * C + c]);
        exact += double(x[n * C + c]) * w[o * C + c];
        mag += std::fabs(round16<T>(x[n * C + c]) * round16<T>(w[o * C + c]));
      }
      const double got = out[n * OC + o];
      EXPECT_LE(std::fabs(got - ref), bound(C, mag)) << "out[" << n << "," << o << "]";
      worst_rounded = std::max(worst_rounded, std::fabs(got - ref) / bound(C, mag));
      worst_unrounded = std::max(worst_unrounded, std::fabs(got - exact) / bound(C, mag));
    }
  // The rounding happened: against the unrounded operands the error is far above fp32's bound.
  EXPECT_GT(worst_unrounded, 10.0) << "the operands were not rounded to " << loom::dtype_name(type);
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < C; ++c) {
      double ref = 0, mag = 0;
      for (int o = 0; o < OC; ++o) {
        ref += round16<T>(dout[n * OC + o]) * round16<T>(w[o * C + c]);
        mag += std::fabs(round16<T>(dout[n * OC + o]) * round16<T>(w[o * C + c]));
      }
      EXPECT_LE(std::fabs(dinp[n * C + c] - ref), bound(OC, mag)) << "dinp[" << n << "," << c << "]";
    }
  for (int o = 0; o < OC; ++o)
    for (int c = 0; c < C; ++c) {
      double ref = 0.5, mag = 0.5;
      for (int n = 0; n < N; ++n) {
        ref += round16<T>(dout[n * OC + o]) * round16<T>(x[n * C + c]);
        mag += std::fabs(round16<T>(dout[n * OC + o]) * round16<T>(x[n * C + c]));
      }
      EXPECT_LE(std::fabs(dw[o * C + c] - ref), bound(N, mag)) << "dweight[" << o << "," << c << "]";
    }
  for (int o = 0; o < OC; ++o) {  // the bias gradient is a sum of the fp32 gradient, not a product
    double ref = 0, mag = 0;
    for (int n = 0; n < N; ++n) ref += dout[n * OC + o], mag += std::fabs(dout[n * OC + o]);
    EXPECT_LE(std::fabs(db[o] - ref), bound(N, mag)) << "dbias[" << o << "]";
  }
}
}  // namespace

TEST(Backend, Bf16MatmulsMultiplyRoundedOperandsInFp32) { check_16bit_linear<bf16>(DType::bf16); }
TEST(Backend, Fp16MatmulsMultiplyRoundedOperandsInFp32) { check_16bit_linear<f16>(DType::f16); }

// The fp16 rounding (vectorised where the CPU converts) equals to_f16, bit for bit: ties, subnormals,
// the largest finite values; a value beyond fp16's range overflows to a non-finite product.
TEST(Backend, Fp16OperandRoundingIsNearestEvenWithOverflow) {
  std::vector<float> v = {1.0f,
                          1.0f + 0x1p-11f,
                          1.0f + 3 * 0x1p-11f,
                          -1.0f - 0x1p-11f,
                          65504.0f,
                          65519.0f,
                          -65519.0f,
                          0x1p-24f,
                          0x1p-25f,
                          0x1.8p-25f,
                          3e-8f,
                          6.1e-5f,
                          0.1f,
                          1e-3f,
                          2049.0f,
                          2051.0f};
  const auto r = randn(100, 15, 30.0);
  v.insert(v.end(), r.begin(), r.end());
  const int C = 8;  // each value times the identity: out = round(x) exactly
  while (v.size() % C) v.push_back(0.0f);
  const int N = static_cast<int>(v.size()) / C;
  std::vector<float> eye(C * C, 0.0f), out(v.size());
  for (int i = 0; i < C; ++i) eye[i * C + i] = 1.0f;
  auto be = host();
  be->set_precision({DType::f16});
  be->matmul_forward(buf(out), buf(v), buf(eye), {}, N, C, C);
  for (std::size_t i = 0; i < v.size(); ++i) {
    const float want = loom::to_float(loom::to_f16(v[i]));
    EXPECT_EQ(std::memcmp(&out[i], &want, 4), 0) << v[i] << " rounded to " << out[i] << ", expected " << want;
  }
  EXPECT_EQ(loom::to_float(loom::to_f16(65519.0f)), 65504.0f);  // below the midpoint to 65536: rounds down
  std::vector<float> big(C, 0.0f);
  big[0] = 65520.0f;  // the midpoint to 65536 rounds to even: beyond fp16's range, inf
  std::vector<float> o(C);
  be->matmul_forward(buf(o), buf(big), buf(eye), {}, 1, C, C);
  EXPECT_FALSE(std::isfinite(o[0]));
}

// Typed operands: an operand already of the precision's type (a store's compute copy, a saved 16-bit
// activation) gives, bit for bit, the product of the fp32 operand the back end rounds itself, in
// forward and both backward products; an fp32 operand is still rounded; another 16-bit type is refused.
template <class T>
void check_typed_operands(DType type) {
  const int N = 19, C = 24, OC = 13;
  const auto x = as<float>(randn(N * C, 21)), w = as<float>(randn(OC * C, 22, 0.3)),
             dout = as<float>(randn(N * OC, 23));
  std::vector<T> x16(x.size()), w16(w.size());
  const auto round = [](float f) {
    if constexpr (std::is_same_v<T, bf16>)
      return loom::to_bf16(f);
    else
      return loom::to_f16(f);
  };
  for (std::size_t i = 0; i < x.size(); ++i) x16[i] = round(x[i]);
  for (std::size_t i = 0; i < w.size(); ++i) w16[i] = round(w[i]);
  auto be = host();
  be->set_precision({type});
  std::vector<float> out(N * OC), out16(N * OC), dinp(N * C), dinp16(N * C), dw(OC * C, 0.0f), dw16(OC * C, 0.0f);
  be->matmul_forward(buf(out), buf(x), buf(w), {}, N, C, OC);
  be->matmul_backward(buf(dinp), buf(dw), {}, buf(dout), buf(x), buf(w), N, C, OC);
  be->matmul_forward(buf(out16), BufferRef(x16.data(), N * C), BufferRef(w16.data(), OC * C), {}, N, C, OC);
  be->matmul_backward(buf(dinp16), buf(dw16), {}, buf(dout), BufferRef(x16.data(), N * C),
                      BufferRef(w16.data(), OC * C), N, C, OC);
  EXPECT_EQ(std::memcmp(out.data(), out16.data(), out.size() * 4), 0);
  EXPECT_EQ(std::memcmp(dinp.data(), dinp16.data(), dinp.size() * 4), 0);
  EXPECT_EQ(std::memcmp(dw.data(), dw16.data(), dw.size() * 4), 0);
  // a mixed pair: the fp32 input rounded here, the weight as stored
  std::vector<float> mixed(N * OC);
  be->matmul_forward(buf(mixed), BufferRef(x.data(), N * C), BufferRef(w16.data(), OC * C), {}, N, C, OC);
  EXPECT_EQ(std::memcmp(out.data(), mixed.data(), out.size() * 4), 0);
}

TEST(Backend, Bf16TypedOperandsEqualRoundedFp32Operands) { check_typed_operands<bf16>(DType::bf16); }
TEST(Backend, Fp16TypedOperandsEqualRoundedFp32Operands) { check_typed_operands<f16>(DType::f16); }

TEST(Backend, TypedOperandsOfAnotherTypeAreRefused) {
  auto be = host();
  be->set_precision({DType::bf16});
  std::vector<f16> h(16);
  std::vector<float> x(16), out(16);
  EXPECT_THROW(be->matmul_forward(buf(out), BufferRef(x.data(), 16), BufferRef(h.data(), 16), {}, 4, 4, 4),
               std::invalid_argument);
  EXPECT_THROW(be->matmul_forward(buf(out), BufferRef(x.data(), 8), BufferRef(x.data(), 16), {}, 4, 4, 4),
               std::invalid_argument);  // too few elements
  auto fp32 = host();
  std::vector<bf16> b(16);
  EXPECT_THROW(fp32->matmul_forward(buf(out), BufferRef(b.data(), 16), BufferRef(x.data(), 16), {}, 4, 4, 4),
               std::logic_error);  // an fp32 run takes fp32 operands only
}

// Casts fused into the producers: each operation whose output is the next product's operand writes a
// 16-bit output that is, bit for bit, its fp32 output then cast; dbias of gelu_bias_backward and the
// residual stay those of the fp32 call; a 16-bit dout feeds matmul_backward as the fp32 one rounded.
template <class H>
void check_fused_casts(DType type) {
  const int B = 2, T = 64, C = 64, NH = 2, N = B * T, OC = 96;
  const std::int64_t NC = std::int64_t(N) * C, NO = std::int64_t(N) * OC;
  const auto x = as<float>(randn(NC, 31, 2.0, 0.3)), y = as<float>(randn(NC, 32)), w = as<float>(randn(C, 33, 0.5, 1)),
             b = as<float>(randn(C, 34)), W = as<float>(randn(std::size_t(OC) * C, 35, 0.2)),
             bias = as<float>(randn(OC, 36)), d = as<float>(randn(NO, 37)), qkv = as<float>(randn(3 * NC, 38));
  auto be = host();
  be->set_precision({type});
  const auto cast_of = [](const std::vector<float>& f) {  // dtype.hpp's rounding, not the back end's cast
    std::vector<H> r(f.size());
    for (std::size_t i = 0; i < f.size(); ++i) r[i] = loom::from_acc<H>(f[i]);
    return r;
  };
  const auto same = [](const std::vector<H>& a, const std::vector<H>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(H)) == 0;
  };
  const auto bref = [](std::vector<H>& v) { return BufferRef(v.data(), std::int64_t(v.size())); };
  std::vector<float> o(NC), mean(N), rstd(N), mean16(N), rstd16(N), r(NC), r16(NC);
  std::vector<H> o16(NC);
  be->layernorm_forward(buf(o), buf(mean), buf(rstd), buf(x), buf(w), buf(b), N, C);
  be->layernorm_forward(bref(o16), buf(mean16), buf(rstd16), buf(x), buf(w), buf(b), N, C);
  EXPECT_TRUE(same(o16, cast_of(o))) << "layernorm_forward";
  EXPECT_EQ(std::memcmp(mean.data(), mean16.data(), 4 * N), 0);
  be->residual_layernorm_forward(buf(r), buf(o), buf(mean), buf(rstd), buf(x), buf(y), buf(w), buf(b), N, C);
  be->residual_layernorm_forward(buf(r16), bref(o16), buf(mean16), buf(rstd16), buf(x), buf(y), buf(w), buf(b), N, C);
  EXPECT_TRUE(same(o16, cast_of(o))) << "residual_layernorm_forward";
  EXPECT_EQ(std::memcmp(r.data(), r16.data(), 4 * NC), 0) << "the residual stays fp32";
  std::vector<float> act(NO), pre(NO), pre16(NO);
  std::vector<H> act16(NO);
  be->matmul_forward_gelu(buf(act), buf(pre), buf(x), buf(W), buf(bias), N, C, OC);
  be->matmul_forward_gelu(bref(act16), buf(pre16), buf(x), buf(W), buf(bias), N, C, OC);
  EXPECT_TRUE(same(act16, cast_of(act))) << "matmul_forward_gelu";
  EXPECT_EQ(std::memcmp(pre.data(), pre16.data(), 4 * NO), 0);
  std::vector<float> dpre(NO), db(OC, 0.5f), db16(OC, 0.5f);
  std::vector<H> dpre16(NO);
  be->gelu_bias_backward(buf(dpre), buf(db), buf(pre), buf(d), N, OC);
  be->gelu_bias_backward(bref(dpre16), buf(db16), buf(pre), buf(d), N, OC);
  EXPECT_TRUE(same(dpre16, cast_of(dpre))) << "gelu_bias_backward";
  EXPECT_EQ(std::memcmp(db.data(), db16.data(), 4 * OC), 0) << "dbias sums the fp32 values";
  std::vector<float> di(NC), di16(NC), dw(std::size_t(OC) * C, 0.0f), dw16(dw.size(), 0.0f), dbb(OC);
  be->matmul_backward(buf(di), buf(dw), {}, buf(dpre), buf(x), buf(W), N, C, OC);
  be->matmul_backward(buf(di16), buf(dw16), {}, bref(dpre16), buf(x), buf(W), N, C, OC);
  EXPECT_EQ(std::memcmp(di.data(), di16.data(), 4 * NC), 0) << "a 16-bit dout is the fp32 one rounded";
  EXPECT_EQ(std::memcmp(dw.data(), dw16.data(), 4 * dw.size()), 0);
  // With a bias: its column sums and dout's rounded copy in one pass (bf16), the same bits as the
  // product without a bias and bias_backward apart.
  std::vector<float> dib(NC), dwb(dw.size(), 0.0f), dbs(OC, 0.25f), dba(OC, 0.25f);
  be->matmul_backward(buf(dib), buf(dwb), buf(dbs), buf(dpre), buf(x), buf(W), N, C, OC);
  be->bias_backward(buf(dba), buf(dpre), N, OC);
  EXPECT_EQ(std::memcmp(dib.data(), di.data(), 4 * NC), 0) << "matmul_backward with a bias: dinp";
  EXPECT_EQ(std::memcmp(dwb.data(), dw.data(), 4 * dw.size()), 0) << "matmul_backward with a bias: dweight";
  EXPECT_EQ(std::memcmp(dbs.data(), dba.data(), 4 * OC), 0) << "matmul_backward's bias: bias_backward's sums";
  EXPECT_THROW(be->matmul_backward(buf(di16), buf(dw16), buf(dbb), bref(dpre16), buf(x), buf(W), N, C, OC),
               std::invalid_argument)
      << "a 16-bit dout has no fp32 values for a bias gradient";
  std::vector<float> ao(NC), lse(std::size_t(B) * NH * T), lse16(lse.size());
  std::vector<H> ao16(NC);
  be->attention_forward_flash(buf(ao), buf(lse), buf(qkv), B, T, C, NH);
  be->attention_forward_flash(bref(ao16), buf(lse16), buf(qkv), B, T, C, NH);
  EXPECT_TRUE(same(ao16, cast_of(ao))) << "attention_forward_flash";
  EXPECT_EQ(std::memcmp(lse.data(), lse16.data(), 4 * lse.size()), 0);
  // The classifier's gradient: probabilities of OC columns, targets inside and outside them.
  std::vector<float> probs(NO), dl(NO);
  for (std::int64_t i = 0; i < NO; ++i) probs[i] = std::fabs(d[i]) / 40.0f;
  std::vector<std::int32_t> tg(N);
  for (int n = 0; n < N; ++n) tg[n] = (n * 37) % (OC + 20);
  std::vector<H> dl16(NO);
  be->crossentropy_backward(buf(dl), buf(probs), buf(tg), 0.37f, N, OC, 0);
  be->crossentropy_backward(bref(dl16), buf(probs), buf(tg), 0.37f, N, OC, 0);
  EXPECT_TRUE(same(dl16, cast_of(dl))) << "crossentropy_backward";
  std::vector<std::int32_t> ints(NC);
  EXPECT_THROW(be->layernorm_forward(buf(ints), buf(mean), buf(rstd), buf(x), buf(w), buf(b), N, C),
               std::invalid_argument);
}

TEST(Backend, Bf16OutputsOfFusedProducersAreTheirFp32OutputsCast) { check_fused_casts<bf16>(DType::bf16); }
TEST(Backend, Fp16OutputsOfFusedProducersAreTheirFp32OutputsCast) { check_fused_casts<f16>(DType::f16); }

// A bf16 run's unfused attention through the back end is kernels::attention_*_bf16 bit for bit (its
// operands rounded in the back end's slots), an fp32 run's the fp32 kernels', and fp16 keeps fp32.
TEST(Backend, UnfusedAttentionTakesBf16OperandsInABf16Run) {
  const int B = 2, T = 24, C = 32, NH = 2;
  const std::int64_t NC = std::int64_t(B) * T * C, BTT = std::int64_t(B) * NH * T * T, TT = std::int64_t(T) * T;
  const auto qkv = as<float>(randn(3 * NC, 61, 1.5)), dout = as<float>(randn(NC, 62));
  auto run = [&](DType precision, std::vector<float>& out, std::vector<float>& dqkv) {
    auto be = host();
    if (precision != DType::f32) be->set_precision({precision});
    std::vector<float> att(BTT), datt(TT);
    out.assign(NC, 0.0f);
    dqkv.assign(3 * NC, 0.0f);
    be->attention_forward(buf(out), buf(att), buf(qkv), B, T, C, NH);
    be->attention_backward(buf(dqkv), buf(datt), buf(dout), buf(qkv), buf(att), B, T, C, NH);
  };
  std::vector<float> out16, dqkv16, out32, dqkv32, outh, dqkvh;
  run(DType::bf16, out16, dqkv16);
  run(DType::f32, out32, dqkv32);
  run(DType::f16, outh, dqkvh);
  std::vector<float> att(BTT), datt(TT), want_out(NC), want_dqkv(3 * NC);
  std::vector<bf16> qkv16(3 * NC), dout16(NC), p16(2 * TT);
  loom::kernels::attention_forward_bf16(want_out.data(), att.data(), qkv.data(), qkv16.data(), p16.data(), B, T, C, NH);
  loom::kernels::attention_backward_bf16(want_dqkv.data(), datt.data(), dout.data(), qkv.data(), att.data(),
                                         qkv16.data(), dout16.data(), p16.data(), B, T, C, NH);
  EXPECT_EQ(0, std::memcmp(out16.data(), want_out.data(), NC * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(dqkv16.data(), want_dqkv.data(), 3 * NC * sizeof(float)));
  EXPECT_NE(0, std::memcmp(out16.data(), out32.data(), NC * sizeof(float)));  // the rounding shows
  EXPECT_EQ(0, std::memcmp(outh.data(), out32.data(), NC * sizeof(float)));   // fp16: fp32 attention
  EXPECT_EQ(0, std::memcmp(dqkvh.data(), dqkv32.data(), 3 * NC * sizeof(float)));
}

TEST(Backend, PrecisionRefusesNon16BitTypes) {
  auto be = host();
  EXPECT_THROW(be->set_precision({DType::i8}), std::invalid_argument);
  EXPECT_THROW(be->set_precision({DType::f64}), std::invalid_argument);
}
