// Unit tests of the matrix-product seam (core/backend/gemm.hpp) for each implementation: every transpose
// combination, leading dimensions larger than the rows (padding holds NaN that must never be read,
// and C's padding must stay untouched), alpha != 1, beta 0 (over NaN in C), 1 and 0.5, odd shapes,
// against an fp64 reference from the same operands (bf16: from the rounded operands).
//
// Error bound per element (fp32 accumulation of K products):
//   |C - ref| <= K * 2^-23 * 4 * (|alpha| * sum_k |a||b| + |beta| |c|)
// a mixed bound from the operand magnitudes: it follows the size of what was added, not of the
// result, so cancellation does not make a correct product fail, and it is far below any real defect
// (a missing beta term, a wrong stride, a transposed operand).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/base/dtype.hpp"
#include "core/backend/gemm.hpp"

namespace gemm = loom::gemm;

namespace loom::gemm {
void PrintTo(Impl i, std::ostream* os) { *os << impl_name(i); }  // test names and messages say "blas", "onednn"
}  // namespace loom::gemm
using gemm::Impl;
using loom::bf16;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// A stored matrix: rows x cols with leading dimension ld >= cols; the padding holds NaN.
template <class T>
struct Stored {
  int rows, cols, ld;
  std::vector<T> data;
  double at(int r, int c) const {
    if constexpr (std::is_same_v<T, bf16>)
      return loom::to_float(data[static_cast<std::size_t>(r) * ld + c]);
    else
      return data[static_cast<std::size_t>(r) * ld + c];
  }
};

template <class T>
Stored<T> random_stored(int rows, int cols, int pad, std::uint64_t seed) {
  Stored<T> s{rows, cols, cols + pad, {}};
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> dist(0.0, 1.0);
  const T nan = [] {
    if constexpr (std::is_same_v<T, bf16>)
      return loom::to_bf16(kNaN);
    else
      return kNaN;
  }();
  s.data.assign(static_cast<std::size_t>(rows) * s.ld, nan);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      const float v = static_cast<float>(dist(gen));
      if constexpr (std::is_same_v<T, bf16>)
        s.data[static_cast<std::size_t>(r) * s.ld + c] = loom::to_bf16(v);
      else
        s.data[static_cast<std::size_t>(r) * s.ld + c] = v;
    }
  return s;
}

struct Case {
  bool ta, tb;
  int M, N, K;
  float alpha, beta;
};
std::string describe(const Case& c) {
  return "ta " + std::to_string(c.ta) + " tb " + std::to_string(c.tb) + " M " + std::to_string(c.M) + " N " +
         std::to_string(c.N) + " K " + std::to_string(c.K) + " alpha " + std::to_string(c.alpha) + " beta " +
         std::to_string(c.beta);
}

// Runs one product through gemm::sgemm (T = float) or gemm::gemm_bf16 (T = bf16) and checks every
// element against the fp64 reference with the mixed bound, C's padding, and finiteness.
template <class T>
void check_product(const Case& c, std::uint64_t seed) {
  SCOPED_TRACE(describe(c));
  const int pad_a = 3, pad_b = 5, pad_c = 2;
  const Stored<T> A = random_stored<T>(c.ta ? c.K : c.M, c.ta ? c.M : c.K, pad_a, seed);
  const Stored<T> B = random_stored<T>(c.tb ? c.N : c.K, c.tb ? c.K : c.N, pad_b, seed + 1);
  Stored<float> C = random_stored<float>(c.M, c.N, pad_c, seed + 2);
  const float sentinel = 12345.0f;  // C's padding: must come back as it was
  for (int r = 0; r < c.M; ++r)
    for (int j = c.N; j < C.ld; ++j) C.data[static_cast<std::size_t>(r) * C.ld + j] = sentinel;
  if (c.beta == 0.0f)  // beta == 0 must never read C
    for (int r = 0; r < c.M; ++r)
      for (int j = 0; j < c.N; ++j) C.data[static_cast<std::size_t>(r) * C.ld + j] = kNaN;
  const Stored<float> C0 = C;

  if constexpr (std::is_same_v<T, bf16>)
    gemm::gemm_bf16(c.ta, c.tb, c.M, c.N, c.K, c.alpha, A.data.data(), A.ld, B.data.data(), B.ld, c.beta, C.data.data(),
                    C.ld);
  else
    gemm::sgemm(c.ta, c.tb, c.M, c.N, c.K, c.alpha, A.data.data(), A.ld, B.data.data(), B.ld, c.beta, C.data.data(),
                C.ld);

  const double u = std::ldexp(1.0, -23);
  int bad = 0;
  double worst = 0;  // largest |C - ref| / bound
  for (int i = 0; i < c.M; ++i) {
    for (int j = 0; j < c.N; ++j) {
      double dot = 0, mag = 0;
      for (int p = 0; p < c.K; ++p) {
        const double a = c.ta ? A.at(p, i) : A.at(i, p);
        const double b = c.tb ? B.at(j, p) : B.at(p, j);
        dot += a * b;
        mag += std::fabs(a) * std::fabs(b);
      }
      const double c0 = c.beta == 0.0f ? 0.0 : C0.at(i, j);
      const double ref = double(c.alpha) * dot + double(c.beta) * c0;
      const double bound = c.K * u * 4 * (std::fabs(c.alpha) * mag + std::fabs(c.beta) * std::fabs(c0));
      const double got = C.at(i, j);
      const double err = std::fabs(got - ref);
      if (!std::isfinite(got) || !(err <= bound)) {
        if (++bad <= 3)
          ADD_FAILURE() << "C[" << i << "," << j << "] = " << got << ", reference " << ref << ", |error| " << err
                        << " > bound " << bound;
      } else if (bound > 0) {
        worst = std::max(worst, err / bound);
      }
    }
    for (int j = c.N; j < C.ld; ++j)
      EXPECT_EQ(C.at(i, j), sentinel) << "C's padding written at [" << i << "," << j << "]";
  }
  EXPECT_EQ(bad, 0) << bad << " of " << c.M * c.N << " elements out of bound";
}

std::vector<Case> cases() {
  std::vector<Case> v;
  const int shapes[][3] = {{1, 1, 1}, {17, 33, 65}, {5, 3, 7}, {64, 48, 96}};
  for (const auto& s : shapes)
    for (int t = 0; t < 4; ++t)
      for (float alpha : {1.0f, -0.75f})
        for (float beta : {0.0f, 1.0f, 0.5f}) v.push_back({bool(t & 1), bool(t & 2), s[0], s[1], s[2], alpha, beta});
  return v;
}

// Runs the tests once per implementation; the process-wide choice is restored afterwards.
class GemmImpl : public ::testing::TestWithParam<Impl> {
 protected:
  void SetUp() override {
    if (GetParam() == Impl::onednn && !gemm::have_onednn()) GTEST_SKIP() << "built without oneDNN";
    gemm::set_impl(GetParam());
  }
  void TearDown() override { gemm::set_impl(Impl::automatic); }
};

}  // namespace

TEST(Gemm, ParsesImplementations) {
  EXPECT_EQ(gemm::parse_impl("auto"), Impl::automatic);
  EXPECT_EQ(gemm::parse_impl("onednn"), Impl::onednn);
  EXPECT_EQ(gemm::parse_impl("blas"), Impl::blas);
  for (const char* bad : {"", "oneDNN", "cublas", "auto "}) {
    try {
      gemm::parse_impl(bad);
      ADD_FAILURE() << "'" << bad << "' accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("auto, onednn, blas"), std::string::npos) << e.what();
    }
  }
}

TEST(Gemm, AutomaticIsOnednnWhenBuilt) {
  gemm::set_impl(Impl::automatic);
  EXPECT_EQ(gemm::impl(), gemm::have_onednn() ? Impl::onednn : Impl::blas);
  gemm::set_impl(Impl::blas);
  EXPECT_EQ(gemm::impl(), Impl::blas);
  if (gemm::have_onednn()) {
    gemm::set_impl(Impl::onednn);
    EXPECT_EQ(gemm::impl(), Impl::onednn);
  } else {
    EXPECT_THROW(gemm::set_impl(Impl::onednn), std::invalid_argument);
  }
  gemm::set_impl(Impl::automatic);
}

TEST_P(GemmImpl, SgemmWithinMixedBoundOfFp64) {
  std::uint64_t seed = 100;
  for (const Case& c : cases()) check_product<float>(c, seed += 3);
}

TEST_P(GemmImpl, Bf16WithinMixedBoundOfFp64FromRoundedOperands) {
  std::uint64_t seed = 900;
  for (const Case& c : cases()) check_product<bf16>(c, seed += 3);
}

// K == 0: C = beta * C, zeros for beta == 0 (over NaN); M or N == 0: nothing touched.
TEST_P(GemmImpl, EmptyProducts) {
  std::vector<float> c(6, kNaN);
  const float a = 1, b = 1;
  gemm::sgemm(false, false, 2, 3, 0, 1.0f, &a, 1, &b, 3, 0.0f, c.data(), 3);
  for (float x : c) EXPECT_EQ(x, 0.0f);
  std::vector<float> d(6, 2.0f);
  const bf16 ab = loom::to_bf16(1.0f);
  gemm::gemm_bf16(false, false, 2, 3, 0, 1.0f, &ab, 1, &ab, 3, 0.5f, d.data(), 3);
  for (float x : d) EXPECT_EQ(x, 1.0f);
  gemm::sgemm(false, false, 0, 3, 4, 1.0f, &a, 4, &b, 3, 0.0f, nullptr, 3);
}

// The same product twice (the second from the primitive cache) gives the same bits.
TEST_P(GemmImpl, RepeatedProductIsBitwiseEqual) {
  const Stored<float> A = random_stored<float>(31, 40, 0, 7), B = random_stored<float>(40, 23, 0, 8);
  std::vector<float> c1(31 * 23), c2(31 * 23);
  gemm::sgemm(false, false, 31, 23, 40, 0.5f, A.data.data(), 40, B.data.data(), 23, 0.0f, c1.data(), 23);
  gemm::sgemm(false, false, 31, 23, 40, 0.5f, A.data.data(), 40, B.data.data(), 23, 0.0f, c2.data(), 23);
  EXPECT_EQ(c1, c2);
}

// The kernels used are named, by operand type and, for oneDNN, by the implementation it picked.
TEST_P(GemmImpl, NamesTheKernelsUsed) {
  const Stored<float> A = random_stored<float>(8, 8, 0, 1);
  std::vector<float> c(64);
  gemm::sgemm(false, false, 8, 8, 8, 1.0f, A.data.data(), 8, A.data.data(), 8, 0.0f, c.data(), 8);
  const std::vector<bf16> ab(64, loom::to_bf16(1.0f));
  gemm::gemm_bf16(false, false, 8, 8, 8, 1.0f, ab.data(), 8, ab.data(), 8, 0.0f, c.data(), 8);
  const std::vector<std::string> used = gemm::impls_used();
  // oneDNN 2.6 has bf16 matmul kernels only for AVX-512 (avx512_core and up); on a CPU without it
  // (AVX2 only) it refuses the primitive and the product runs on fp32 copies through cblas, which
  // the kernel's name must then say.
  const bool onednn_bf16 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  bool fp32 = false, bf = false;
  for (const std::string& k : used) {
    const bool blas = k.find("cblas_sgemm") != std::string::npos;
    const bool is_bf16 = k.rfind("bf16 ", 0) == 0;
    const bool want_blas = GetParam() == Impl::blas || (is_bf16 && !onednn_bf16);
    if (blas == want_blas) {
      fp32 |= k.rfind("fp32 ", 0) == 0;
      bf |= is_bf16 && (GetParam() == Impl::blas || onednn_bf16 || k.find("oneDNN refused") != std::string::npos);
    }
  }
  EXPECT_TRUE(fp32 && bf) << ::testing::PrintToString(used) << (onednn_bf16 ? "" : " (no AVX-512: bf16 through cblas)");
  const std::string d = gemm::describe();
  EXPECT_NE(d.find(GetParam() == Impl::blas ? "BLAS" : "oneDNN"), std::string::npos) << d;
  if (GetParam() == Impl::onednn) {
    for (const std::string& k : used) {
      if (k.find("cblas") == std::string::npos) {
        EXPECT_NE(d.find(k.substr(5)), std::string::npos) << d << " / " << k;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Impls, GemmImpl, ::testing::Values(Impl::blas, Impl::onednn),
                         [](const ::testing::TestParamInfo<Impl>& i) { return std::string(gemm::impl_name(i.param)); });

// make_host_backend(threads) sets the thread count oneDNN runs with (its OpenMP runtime's).
TEST(Gemm, OnednnThreadsFollowTheBackend) {
  if (!gemm::have_onednn()) GTEST_SKIP() << "built without oneDNN";
  for (int n : {3, 1}) {
    auto be = loom::make_host_backend(n);
    EXPECT_EQ(gemm::threads(), n);
  }
}

// run.gemm = auto takes a CPU-and-shape rule, not a timing: an fp32 product of a transposed A (the
// weight gradients) runs on OpenBLAS where the CPU lacks AVX-512, every other on oneDNN. The same
// bits as the implementation the rule names, so every rank and every restart agree.
TEST(Gemm, AutomaticRuleForTransposedA) {
  if (!gemm::have_onednn()) GTEST_SKIP() << "built without oneDNN: auto is OpenBLAS throughout";
  const int M = 96, N = 40, K = 256;
  const Stored<float> A = random_stored<float>(K, M, 0, 11), B = random_stored<float>(K, N, 0, 12);
  const auto product = [&](Impl i, bool ta) {
    gemm::set_impl(i);
    std::vector<float> c(static_cast<std::size_t>(M) * N);
    if (ta)
      gemm::sgemm(true, false, M, N, K, 1.0f, A.data.data(), M, B.data.data(), N, 0.0f, c.data(), N);
    else  // A's storage read as [M, K] (the same bytes), untransposed
      gemm::sgemm(false, false, M, N, K, 1.0f, A.data.data(), K, B.data.data(), N, 0.0f, c.data(), N);
    return c;
  };
  const bool avx512 = __builtin_cpu_supports("avx512f");
  gemm::set_threads(1);
  const std::vector<float> tn_auto = product(Impl::automatic, true), tn_blas = product(Impl::blas, true),
                           tn_dnn = product(Impl::onednn, true);
  EXPECT_EQ(tn_auto, avx512 ? tn_dnn : tn_blas) << (avx512 ? "AVX-512: oneDNN expected" : "no AVX-512: OpenBLAS");
  gemm::set_threads(2);  // two thread pools would spin against each other: oneDNN alone
  EXPECT_EQ(product(Impl::automatic, true), product(Impl::onednn, true)) << "2 threads: oneDNN";
  gemm::set_threads(1);
  EXPECT_EQ(product(Impl::automatic, false), product(Impl::onednn, false)) << "an untransposed A stays on oneDNN";
  bool named = false;
  for (const std::string& k : gemm::impls_used()) named |= k.find("for transposed A") != std::string::npos;
  EXPECT_EQ(named, !avx512) << ::testing::PrintToString(gemm::impls_used());
  gemm::set_impl(Impl::automatic);
}
