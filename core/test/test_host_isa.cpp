// core/backend/host_isa.hpp: the host kernels' fp32 loops compiled per instruction set give the
// baseline's bits, each of them, on shapes with partial lanes and partial column blocks, so that the
// run-time choice changes only the speed.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/backend/host_isa.hpp"
#include "core/base/dtype.hpp"

namespace {

using loom::isa::RowKernels;
using V = std::vector<float>;

V randn(std::size_t n, unsigned seed, float scale = 1.0f, float shift = 0.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(shift, scale);
  V v(n);
  for (float& x : v) x = d(g);
  return v;
}

bool same_bits(const V& a, const V& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Every loop of one set on the same inputs; the outputs in one list, in a fixed order.
std::vector<V> run_all(const RowKernels& k) {
  const int N = 37, C = 150, T = 45;  // C: 9 lanes of 16 and 6 left over; 2 column blocks and a partial one
  const V x = randn(std::size_t(N) * C, 1, 2.0f, 0.3f), y = randn(std::size_t(N) * C, 2), w = randn(C, 3, 0.5f, 1.0f),
          b = randn(C, 4), d = randn(std::size_t(N) * C, 5);
  std::vector<V> out;
  V o(std::size_t(N) * C), r(std::size_t(N) * C), mean(N), rstd(N), mean2(N), rstd2(N);
  for (int n = 0; n < N; ++n) {
    const std::size_t at = std::size_t(n) * C;
    k.layernorm_row(o.data() + at, mean[n], rstd[n], x.data() + at, w.data(), b.data(), C);
  }
  out.insert(out.end(), {o, mean, rstd});
  V o2(o.size());
  for (int n = 0; n < N; ++n) {
    const std::size_t at = std::size_t(n) * C;
    k.residual_layernorm_row(r.data() + at, o2.data() + at, mean2[n], rstd2[n], x.data() + at, y.data() + at, w.data(),
                             b.data(), C);
  }
  out.insert(out.end(), {r, o2, mean2, rstd2});
  V dx = randn(std::size_t(N) * C, 6), dw = randn(C, 7), db = randn(C, 8), dbias = randn(C, 9);
  for (int n = 0; n < N; ++n) {
    const std::size_t at = std::size_t(n) * C;
    k.layernorm_dinp_row(dx.data() + at, d.data() + at, x.data() + at, w.data(), mean[n], rstd[n], C);
  }
  for (int c0 = 0; c0 < C; c0 += 64) {
    k.layernorm_param_cols(dw.data(), db.data(), d.data(), x.data(), mean.data(), rstd.data(), N, C, c0,
                           std::min(C, c0 + 64));
    k.bias_cols(dbias.data(), d.data(), N, C, c0, std::min(C, c0 + 64));
  }
  out.insert(out.end(), {dx, dw, db, dbias});
  V pre = y, act(pre.size()), dpre(pre.size()), dbg = randn(C, 10);
  for (int n = 0; n < N; ++n)
    k.bias_gelu_row(act.data() + std::size_t(n) * C, pre.data() + std::size_t(n) * C, b.data(), C);
  for (int c0 = 0; c0 < C; c0 += 64)
    k.gelu_bias_cols(dpre.data(), dbg.data(), pre.data(), d.data(), N, C, c0, std::min(C, c0 + 64));
  out.insert(out.end(), {pre, act, dpre, dbg});
  V g(x.size()), dg(x.size());
  k.gelu_span(g.data(), x.data(), 3, std::int64_t(x.size()));
  k.gelu_backward_span(dg.data(), x.data(), d.data(), 0, std::int64_t(x.size()) - 5);
  out.insert(out.end(), {g, dg});
  V p = randn(1000, 11), m = randn(1000, 12, 0.1f), v = randn(1000, 13, 0.1f), grad = randn(1000, 14);
  for (float& e : v) e = e * e;
  const loom::math::AdamWStep<float> step{3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.271f, 0.0975f};
  k.adamw_span(p.data(), m.data(), v.data(), grad.data(), 7, 1000, step);
  out.insert(out.end(), {p, m, v});
  V att = randn(std::size_t(T) * T, 15, 3.0f), datt = randn(std::size_t(T) * T, 16);
  for (int t = 0; t < T; ++t) k.softmax_causal_row(att.data() + std::size_t(t) * T, t, T);
  for (int t = 0; t < T; ++t)
    k.softmax_causal_backward_row(datt.data() + std::size_t(t) * T, att.data() + std::size_t(t) * T, t, T);
  out.insert(out.end(), {att, datt});
  // The loops that store a bf16 output (widened here, exactly, to compare as floats).
  const auto widen = [](const std::vector<loom::bf16>& h) {
    V f(h.size());
    for (std::size_t i = 0; i < h.size(); ++i) f[i] = loom::to_float(h[i]);
    return f;
  };
  std::vector<loom::bf16> o16(std::size_t(N) * C), r16(o16.size()), a16(o16.size()), d16(o16.size()), c16(x.size() + 3);
  V m16(N), s16(N), rr(o16.size()), pre16 = y, dbg16 = randn(C, 10);
  for (int n = 0; n < N; ++n) {
    const std::size_t at = std::size_t(n) * C;
    k.layernorm_row_bf16(o16.data() + at, m16[n], s16[n], x.data() + at, w.data(), b.data(), C);
    k.residual_layernorm_row_bf16(rr.data() + at, r16.data() + at, m16[n], s16[n], x.data() + at, y.data() + at,
                                  w.data(), b.data(), C);
    k.bias_gelu_row_bf16(a16.data() + at, pre16.data() + at, b.data(), C);
  }
  for (int c0 = 0; c0 < C; c0 += 64)
    k.gelu_bias_cols_bf16(d16.data(), dbg16.data(), pre16.data(), d.data(), N, C, c0, std::min(C, c0 + 64));
  k.cast_bf16_span(c16.data(), x.data(), 2, std::int64_t(x.size()));
  std::vector<loom::bf16> bc16(x.size());
  V dbc = randn(C, 9);
  for (int c0 = 0; c0 < C; c0 += 64)
    k.bias_cast_cols_bf16(dbc.data(), bc16.data(), d.data(), N, C, c0, std::min(C, c0 + 64));
  out.insert(out.end(), {widen(o16), m16, s16, rr, widen(r16), pre16, widen(a16), widen(d16), dbg16, widen(c16), dbc,
                         widen(bc16)});
  return out;
}

// fp32 values whose rounding to bf16 is delicate: ties both ways, the largest finite values, infinities,
// NaNs (quiet, signalling, negative), subnormals; then ordinary ones.
V hard_values() {
  const std::uint32_t bits[] = {0x3f808000u, 0x3f818000u, 0x3f80c000u, 0x3f807fffu, 0x7f7fffffu, 0xff7fffffu,
                                0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u, 0xffc00001u, 0x00000001u,
                                0x80008000u, 0x00018000u, 0x007fffffu, 0x00000000u, 0x80000000u};
  V v;
  for (std::uint32_t u : bits) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    v.push_back(f);
  }
  const V more = randn(1000, 17, 1e3f);
  v.insert(v.end(), more.begin(), more.end());
  return v;
}

// A loop storing bf16 gives its fp32 twin's output rounded once (to_bf16), in every set: the cast fused
// into the producer changes no bit of what the product then reads.
TEST(HostIsa, Bf16OutputsAreTheFp32OutputsRounded) {
  const int N = 19, C = 150;
  const V x = randn(std::size_t(N) * C, 21, 2.0f, 0.3f), y = randn(x.size(), 22), w = randn(C, 23, 0.5f, 1.0f),
          b = randn(C, 24), d = randn(x.size(), 25);
  const auto rounded = [](const V& f) {
    std::vector<std::uint16_t> r(f.size());
    for (std::size_t i = 0; i < f.size(); ++i) r[i] = loom::to_bf16(f[i]).bits;
    return r;
  };
  const auto bits = [](const std::vector<loom::bf16>& h) {
    std::vector<std::uint16_t> r(h.size());
    for (std::size_t i = 0; i < h.size(); ++i) r[i] = h[i].bits;
    return r;
  };
  for (const std::string& set : loom::isa::available()) {
    const RowKernels& k = *loom::isa::find(set);
    V o(x.size()), r(x.size()), r2(x.size()), mean(N), rstd(N), mean2(N), rstd2(N);
    std::vector<loom::bf16> o16(x.size()), r16(x.size());
    V pre = y, pre2 = y, act(x.size()), dpre(x.size()), db = randn(C, 26), db2 = db;
    std::vector<loom::bf16> a16(x.size()), d16(x.size());
    for (int n = 0; n < N; ++n) {
      const std::size_t at = std::size_t(n) * C;
      k.layernorm_row(o.data() + at, mean[n], rstd[n], x.data() + at, w.data(), b.data(), C);
      k.layernorm_row_bf16(o16.data() + at, mean2[n], rstd2[n], x.data() + at, w.data(), b.data(), C);
    }
    EXPECT_EQ(bits(o16), rounded(o)) << set << ": layernorm_row_bf16";
    EXPECT_TRUE(same_bits(mean, mean2) && same_bits(rstd, rstd2)) << set;
    for (int n = 0; n < N; ++n) {
      const std::size_t at = std::size_t(n) * C;
      k.residual_layernorm_row(r.data() + at, o.data() + at, mean[n], rstd[n], x.data() + at, y.data() + at, w.data(),
                               b.data(), C);
      k.residual_layernorm_row_bf16(r2.data() + at, r16.data() + at, mean2[n], rstd2[n], x.data() + at, y.data() + at,
                                    w.data(), b.data(), C);
      k.bias_gelu_row(act.data() + at, pre.data() + at, b.data(), C);
      k.bias_gelu_row_bf16(a16.data() + at, pre2.data() + at, b.data(), C);
    }
    EXPECT_EQ(bits(r16), rounded(o)) << set << ": residual_layernorm_row_bf16";
    EXPECT_TRUE(same_bits(r, r2)) << set << ": the residual stays fp32";
    EXPECT_EQ(bits(a16), rounded(act)) << set << ": bias_gelu_row_bf16";
    EXPECT_TRUE(same_bits(pre, pre2)) << set;
    for (int c0 = 0; c0 < C; c0 += 64) {
      k.gelu_bias_cols(dpre.data(), db.data(), pre.data(), d.data(), N, C, c0, std::min(C, c0 + 64));
      k.gelu_bias_cols_bf16(d16.data(), db2.data(), pre.data(), d.data(), N, C, c0, std::min(C, c0 + 64));
    }
    EXPECT_EQ(bits(d16), rounded(dpre)) << set << ": gelu_bias_cols_bf16";
    EXPECT_TRUE(same_bits(db, db2)) << set << ": dbias sums the fp32 values";
    V dbias = randn(C, 27), dbias2 = dbias;
    std::vector<loom::bf16> copy(x.size());
    for (int c0 = 0; c0 < C; c0 += 64) {
      k.bias_cols(dbias.data(), d.data(), N, C, c0, std::min(C, c0 + 64));
      k.bias_cast_cols_bf16(dbias2.data(), copy.data(), d.data(), N, C, c0, std::min(C, c0 + 64));
    }
    EXPECT_TRUE(same_bits(dbias, dbias2)) << set << ": bias_cast_cols_bf16's sums are bias_cols'";
    EXPECT_EQ(bits(copy), rounded(d)) << set << ": bias_cast_cols_bf16's copy";
    const V h = hard_values();
    std::vector<loom::bf16> c16(h.size());
    k.cast_bf16_span(c16.data(), h.data(), 0, std::int64_t(h.size()));
    EXPECT_EQ(bits(c16), rounded(h)) << set << ": cast_bf16_span";
  }
}

TEST(HostIsa, EverySetGivesTheBaselinesBits) {
  const std::vector<std::string> sets = loom::isa::available();
  ASSERT_FALSE(sets.empty());
  EXPECT_EQ(sets.back(), "baseline");
  const std::vector<V> want = run_all(*loom::isa::find("baseline"));
  for (const std::string& s : sets) {
    const RowKernels* k = loom::isa::find(s);
    ASSERT_NE(k, nullptr) << s;
    EXPECT_EQ(std::string(k->name), s);
    const std::vector<V> got = run_all(*k);
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(same_bits(got[i], want[i])) << s << ", output " << i;
  }
  std::printf("instruction sets this CPU runs: ");
  for (const std::string& s : sets) std::printf("%s ", s.c_str());
  std::printf("(active: %s)\n", loom::isa::active().name);
}

TEST(HostIsa, TheBestSetIsActiveAndNamesAreChecked) {
  EXPECT_EQ(std::string(loom::isa::active().name), loom::isa::available().front());
  EXPECT_THROW(loom::isa::find("sse9"), std::invalid_argument);
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  EXPECT_EQ(loom::isa::find("avx512") != nullptr, avx512) << "a set this CPU lacks is not offered";
}

}  // namespace
