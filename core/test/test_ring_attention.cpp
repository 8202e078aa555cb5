// Ring attention's kernels (core/backend/ring_attention_host.hpp) against whole-sequence attention:
// the cp ranks of one sequence simulated in one process, each hop as the context plugin takes it
// (plugins/context/context_parallel.cpp), must give the unfused kernels' output and gradients (fp32)
// or flash's (bf16 operands) in every rank's local order; and one block's backward against finite
// differences.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/backend/flash_attention_host.hpp"
#include "core/backend/kernels.hpp"
#include "core/backend/ring_attention_host.hpp"
#include "core/base/rng.hpp"
#include "core/model/context.hpp"

namespace loom {
namespace {

std::vector<float> randoms(std::size_t n, std::uint64_t seed, float scale = 1.0f) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = scale * static_cast<float>(rng::normal(seed, rng::hash_name("ring"), i));
  return v;
}

double rel_err(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(got[i]) - want[i]));
    norm = std::max(norm, std::fabs(static_cast<double>(want[i])));
  }
  return diff / norm;
}

// The whole sequence's rows [B,T,W] -> rank `r`'s local rows [B,Tl,W] (and back).
std::vector<float> local_rows(const std::vector<float>& whole, int B, int T, int W, int n, int r) {
  const int Tl = T / n;
  std::vector<float> out(static_cast<std::size_t>(B) * Tl * W);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < Tl; ++t) {
      const int g = context_position(t, T, n, r);
      for (int w = 0; w < W; ++w)
        out[(static_cast<std::size_t>(b) * Tl + t) * W + w] = whole[(static_cast<std::size_t>(b) * T + g) * W + w];
    }
  return out;
}

std::vector<float> pack_kv(const std::vector<float>& qkv, int N, int C) {
  std::vector<float> kv(static_cast<std::size_t>(N) * 2 * C);
  for (int i = 0; i < N; ++i)
    for (int c = 0; c < 2 * C; ++c)
      kv[static_cast<std::size_t>(i) * 2 * C + c] = qkv[static_cast<std::size_t>(i) * 3 * C + C + c];
  return kv;
}

struct Hop {
  int q_begin, kv_rows;
  bool causal;
};
Hop hop_shape(int r, int src, int Tl) {
  if (src == r) return {0, Tl, true};
  if (src < r) return {0, Tl / 2, false};
  return {Tl / 2, Tl, false};
}

// Every rank's ring forward and backward, in one process; returns out and dqkv in whole order.
void ring(const std::vector<float>& qkv, const std::vector<float>& dout, int B, int T, int C, int NH, int n, bool bf16,
          std::vector<float>& out_whole, std::vector<float>& dqkv_whole) {
  const int Tl = T / n, N = B * Tl;
  std::vector<std::vector<float>> q(n), kv(n), out(n), lse(n), dq(n), dkv(n), g(n);
  for (int r = 0; r < n; ++r) {
    q[r] = local_rows(qkv, B, T, 3 * C, n, r);
    g[r] = local_rows(dout, B, T, C, n, r);
    kv[r] = pack_kv(q[r], N, C);
    out[r].assign(static_cast<std::size_t>(N) * C, 0.0f);
    lse[r].assign(static_cast<std::size_t>(B) * NH * Tl, kernels::ring::kEmptyRow);
    dq[r].assign(static_cast<std::size_t>(N) * 3 * C, 0.0f);
    dkv[r].assign(static_cast<std::size_t>(N) * 2 * C, 0.0f);
  }
  for (int r = 0; r < n; ++r)
    for (int j = 0; j < n; ++j) {
      const int src = (r - j + n) % n;
      const Hop h = hop_shape(r, src, Tl);
      kernels::ring::forward(out[r].data(), lse[r].data(), q[r].data(), kv[src].data(), B, Tl, C, NH, h.q_begin,
                             h.kv_rows, h.causal, bf16);
    }
  std::vector<float> dsum(static_cast<std::size_t>(B) * NH * Tl);
  for (int r = 0; r < n; ++r)
    for (int j = 0; j < n; ++j) {
      const int src = (r - j + n) % n;
      const Hop h = hop_shape(r, src, Tl);
      kernels::ring::backward(dq[r].data(), dkv[src].data(), dsum.data(), g[r].data(), out[r].data(), q[r].data(),
                              kv[src].data(), lse[r].data(), B, Tl, C, NH, h.q_begin, h.kv_rows, h.causal, bf16);
    }
  out_whole.assign(static_cast<std::size_t>(B) * T * C, 0.0f);
  dqkv_whole.assign(static_cast<std::size_t>(B) * T * 3 * C, 0.0f);
  for (int r = 0; r < n; ++r)
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < Tl; ++t) {
        const std::size_t at = static_cast<std::size_t>(b) * T + context_position(t, T, n, r);
        const std::size_t lt = static_cast<std::size_t>(b) * Tl + t;
        for (int c = 0; c < C; ++c) out_whole[at * C + c] = out[r][lt * C + c];
        for (int c = 0; c < C; ++c) dqkv_whole[at * 3 * C + c] = dq[r][lt * 3 * C + c];
        for (int c = 0; c < 2 * C; ++c) dqkv_whole[at * 3 * C + C + c] = dkv[r][lt * 2 * C + c];
      }
}

TEST(RingAttention, EveryCpGivesTheWholeSequencesAttention) {
  const int B = 2, T = 24, C = 16, NH = 2;
  const std::vector<float> qkv = randoms(static_cast<std::size_t>(B) * T * 3 * C, 1);
  const std::vector<float> dout = randoms(static_cast<std::size_t>(B) * T * C, 2);
  std::vector<float> want_out(static_cast<std::size_t>(B) * T * C), att(static_cast<std::size_t>(B) * NH * T * T);
  std::vector<float> want_dqkv(qkv.size()), datt(static_cast<std::size_t>(T) * T);
  kernels::attention_forward(want_out.data(), att.data(), qkv.data(), B, T, C, NH);
  kernels::attention_backward(want_dqkv.data(), datt.data(), dout.data(), qkv.data(), att.data(), B, T, C, NH);
  for (int n : {1, 2, 3, 4}) {
    std::vector<float> out, dqkv;
    ring(qkv, dout, B, T, C, NH, n, false, out, dqkv);
    // fp32 throughout: the sums differ from the unfused kernels' in order only.
    EXPECT_LT(rel_err(out, want_out), 1e-5) << "cp " << n;
    EXPECT_LT(rel_err(dqkv, want_dqkv), 1e-5) << "cp " << n;
  }
}

TEST(RingAttention, Bf16OperandsGiveFlashAttentionWithinBf16Roundoff) {
  const int B = 1, T = 32, C = 32, NH = 2;
  const std::vector<float> qkv = randoms(static_cast<std::size_t>(B) * T * 3 * C, 3);
  const std::vector<float> dout = randoms(static_cast<std::size_t>(B) * T * C, 4);
  std::vector<float> want_out(static_cast<std::size_t>(B) * T * C), lse(static_cast<std::size_t>(B) * NH * T);
  std::vector<float> want_dqkv(qkv.size(), 0.0f), dsum(lse.size());
  kernels::flash::attention_forward(want_out.data(), lse.data(), qkv.data(), B, T, C, NH);
  kernels::flash::attention_backward(want_dqkv.data(), dsum.data(), dout.data(), want_out.data(), qkv.data(),
                                     lse.data(), B, T, C, NH);
  for (int n : {2, 4}) {
    std::vector<float> out, dqkv;
    ring(qkv, dout, B, T, C, NH, n, true, out, dqkv);
    // Both round their operands to bf16 (2^-8 relative), the probabilities on different scales.
    EXPECT_LT(rel_err(out, want_out), 2e-2) << "cp " << n;
    EXPECT_LT(rel_err(dqkv, want_dqkv), 3e-2) << "cp " << n;
  }
}

// One block's backward (not causal, queries from q_begin, a part of the keys) against central
// differences of L = sum(out * w) through the forward from an empty running state.
TEST(RingAttention, BlockBackwardMatchesFiniteDifferences) {
  const int B = 1, T = 8, C = 8, NH = 2, q_begin = 3, kv_rows = 5;
  std::vector<float> qkv = randoms(static_cast<std::size_t>(B) * T * 3 * C, 5, 0.5f);
  std::vector<float> kv = randoms(static_cast<std::size_t>(B) * T * 2 * C, 6, 0.5f);
  const std::vector<float> w = randoms(static_cast<std::size_t>(B) * T * C, 7);
  auto loss = [&](const std::vector<float>& x, const std::vector<float>& y) {
    std::vector<float> out(w.size(), 0.0f), lse(static_cast<std::size_t>(B) * NH * T, kernels::ring::kEmptyRow);
    kernels::ring::forward(out.data(), lse.data(), x.data(), y.data(), B, T, C, NH, q_begin, kv_rows, false, false);
    double l = 0;
    for (std::size_t i = 0; i < w.size(); ++i) l += static_cast<double>(out[i]) * w[i];
    return l;
  };
  std::vector<float> out(w.size(), 0.0f), lse(static_cast<std::size_t>(B) * NH * T, kernels::ring::kEmptyRow);
  kernels::ring::forward(out.data(), lse.data(), qkv.data(), kv.data(), B, T, C, NH, q_begin, kv_rows, false, false);
  std::vector<float> dqkv(qkv.size(), 0.0f), dkv(kv.size(), 0.0f), dsum(lse.size());
  kernels::ring::backward(dqkv.data(), dkv.data(), dsum.data(), w.data(), out.data(), qkv.data(), kv.data(), lse.data(),
                          B, T, C, NH, q_begin, kv_rows, false, false);
  const float h = 1e-2f;
  double worst = 0, scale = 0;
  auto check = [&](std::vector<float>& x, const std::vector<float>& grad, bool is_q) {
    for (std::size_t i = 0; i < x.size(); ++i) {
      const float keep = x[i];
      x[i] = keep + h;
      const double up = is_q ? loss(x, kv) : loss(qkv, x);
      x[i] = keep - h;
      const double down = is_q ? loss(x, kv) : loss(qkv, x);
      x[i] = keep;
      const double fd = (up - down) / (2 * h);
      worst = std::max(worst, std::fabs(fd - grad[i]));
      scale = std::max(scale, std::fabs(fd));
    }
  };
  check(qkv, dqkv, true);
  check(kv, dkv, false);
  EXPECT_GT(scale, 1e-2);
  EXPECT_LT(worst, 2e-3 * scale + 1e-4);
}

}  // namespace
}  // namespace loom
