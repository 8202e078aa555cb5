#pragma once
// One step of ring attention (context parallelism, DESIGN.md "Context parallelism") on the host:
// this rank's queries against one block of keys and values (its own, or another cp rank's that came
// round the ring), merged into a running output by the online softmax, and that step's backward.
//
//   forward:  s = q k^T / sqrt(hs) over queries [q_begin, T) and keys [0, kv_rows) of each sequence
//             (causal: key j only for query t >= j, local indices, used on the own block where the
//             local order is the global one); the block's (out_b, lse_b) merged into the running
//             (out, lse): lse' = log(e^lse + e^lse_b), out' = out e^(lse - lse') + out_b e^(lse_b - lse').
//             A row not yet seen holds lse = kEmptyRow, whose weight is 0.
//   backward: the final (out, lse) known, each probability is recomputed from lse, as flash's
//             backward does: dsum = rowsum(dout * out), ds = p (dout . v - dsum); dq += ds k / sqrt(hs)
//             into the q columns of dqkv, dk += ds^T q / sqrt(hs), dv += p^T dout into the block's dkv.
//
// `bf16`: the operands of the products (q, k, v, dout, the probabilities, the score gradients) are
// rounded to bf16 first, as flash attention's are (model.attention = flash); products, softmax, lse
// and every output fp32 (loom::gemm's bf16 products then, as flash's host twin takes them).
// Layout: qkv [B,T,3C] (head h's q in columns h*hs), the block kv [B,T,2C] (k then v), out and dout
// [B,T,C], lse and dsum [B,NH,T]. Queries are taken 64 at a time, each block against the keys it can
// see (causal: up to its last query): scratch is a few [64, kv_rows].
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/base/dtype.hpp"
#include "core/backend/gemm.hpp"
#include "core/backend/kernel_math.hpp"

namespace loom::kernels::ring {

constexpr int kRows = 64;
constexpr float kEmptyRow = -1e30f;  // lse of a row no block has reached yet

// The products' operand type: fp32 (sgemm), or bf16 (gemm_bf16: bf16 operands, fp32 accumulation).
template <class Op>
Op operand(float x) {
  if constexpr (std::is_same_v<Op, bf16>)
    return to_bf16(x);
  else
    return x;
}
inline void mm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
               float beta, float* C, int ldc) {
  gemm::sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
inline void mm(bool ta, bool tb, int M, int N, int K, float alpha, const bf16* A, int lda, const bf16* B, int ldb,
               float beta, float* C, int ldc) {
  gemm::gemm_bf16(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

// rows [first, first + n) of one head's [T, hs] columns of a [B,T,ld] tensor, as operands.
template <class Op>
void load_rows(std::vector<Op>& dst, const float* src, std::int64_t ld, int first, int n, int hs) {
  dst.resize(static_cast<std::size_t>(n) * hs);
  for (int t = 0; t < n; ++t)
    for (int d = 0; d < hs; ++d)
      dst[static_cast<std::size_t>(t) * hs + d] = operand<Op>(src[static_cast<std::int64_t>(first + t) * ld + d]);
}

// The number of keys query t sees in the block.
inline int visible_keys(int t, int kv_rows, bool causal) { return causal ? std::min(kv_rows, t + 1) : kv_rows; }

// The keys a block of queries [t0, t0 + rows) reads: all of them, or (causal) up to its last query.
inline int block_keys(int t0, int rows, int kv_rows, bool causal) {
  return causal ? std::min(kv_rows, t0 + rows) : kv_rows;
}

template <class Op>
void forward_as(float* out, float* lse, const float* qkv, const float* kv, int B, int T, int C, int NH, int q_begin,
                int kv_rows, bool causal) {
  const int hs = C / NH, nq = T - q_begin;
  const std::int64_t C3 = 3 * static_cast<std::int64_t>(C), C2 = 2 * static_cast<std::int64_t>(C);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  std::vector<Op> q, k, v, p(static_cast<std::size_t>(kRows) * kv_rows);
  std::vector<float> s(static_cast<std::size_t>(kRows) * kv_rows), o(static_cast<std::size_t>(kRows) * hs);
  std::vector<float> m(kRows), l(kRows);
  for (int bh = 0; bh < B * NH; ++bh) {
    const int b = bh / NH, h = bh % NH;
    const std::int64_t head = static_cast<std::int64_t>(h) * hs;
    load_rows(q, qkv + static_cast<std::int64_t>(b) * T * C3 + head, C3, q_begin, nq, hs);
    load_rows(k, kv + static_cast<std::int64_t>(b) * T * C2 + head, C2, 0, kv_rows, hs);
    load_rows(v, kv + static_cast<std::int64_t>(b) * T * C2 + C + head, C2, 0, kv_rows, hs);
    for (int q0 = 0; q0 < nq; q0 += kRows) {
      const int rows = std::min(kRows, nq - q0), keys = block_keys(q_begin + q0, rows, kv_rows, causal);
      mm(false, true, rows, keys, hs, scale, q.data() + static_cast<std::size_t>(q0) * hs, hs, k.data(), hs, 0.0f,
         s.data(), keys);  // scaled scores
      for (int r = 0; r < rows; ++r) {
        float* sr = s.data() + static_cast<std::size_t>(r) * keys;
        Op* pr = p.data() + static_cast<std::size_t>(r) * keys;
        const int seen = visible_keys(q_begin + q0 + r, keys, causal);
        float mx = kEmptyRow;
        for (int j = 0; j < seen; ++j) mx = std::max(mx, sr[j]);
        float sum = 0.0f;
        for (int j = 0; j < keys; ++j) {
          const float e = j < seen ? math::exp_k(sr[j] - mx) : 0.0f;
          sum += e;
          pr[j] = operand<Op>(e);
        }
        m[r] = mx;
        l[r] = sum;
      }
      mm(false, false, rows, hs, keys, 1.0f, p.data(), keys, v.data(), hs, 0.0f, o.data(), hs);
      for (int r = 0; r < rows; ++r) {
        const int t = q_begin + q0 + r;
        float& row_lse = lse[static_cast<std::int64_t>(bh) * T + t];
        const float lse_b = m[r] + std::log(l[r]);
        const float top = std::max(row_lse, lse_b);
        const float w_old = math::exp_k(row_lse - top), w_new = math::exp_k(lse_b - top), total = w_old + w_new;
        float* ot = out + (static_cast<std::int64_t>(b) * T + t) * C + head;
        const float* ob = o.data() + static_cast<std::size_t>(r) * hs;
        for (int d = 0; d < hs; ++d) ot[d] = (ot[d] * w_old + ob[d] / l[r] * w_new) / total;
        row_lse = top + std::log(total);
      }
    }
  }
}

inline void forward(float* out, float* lse, const float* qkv, const float* kv, int B, int T, int C, int NH, int q_begin,
                    int kv_rows, bool causal, bool bf16) {
  if (bf16)
    forward_as<loom::bf16>(out, lse, qkv, kv, B, T, C, NH, q_begin, kv_rows, causal);
  else
    forward_as<float>(out, lse, qkv, kv, B, T, C, NH, q_begin, kv_rows, causal);
}

// out: the saved final output (fp32, bf16 or fp16).
template <class Op, class OutT>
void backward_as(float* dqkv, float* dkv, float* dsum, const float* dout, const OutT* out, const float* qkv,
                 const float* kv, const float* lse, int B, int T, int C, int NH, int q_begin, int kv_rows,
                 bool causal) {
  const int hs = C / NH, nq = T - q_begin;
  const std::int64_t C3 = 3 * static_cast<std::int64_t>(C), C2 = 2 * static_cast<std::int64_t>(C);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const std::size_t block = static_cast<std::size_t>(kRows) * kv_rows;
  std::vector<Op> q, k, v, g, p(block), ds(block);
  std::vector<float> s(block), dp(block), dq(static_cast<std::size_t>(kRows) * hs);
  std::vector<float> dk(static_cast<std::size_t>(kv_rows) * hs), dv(dk.size());
  for (int bh = 0; bh < B * NH; ++bh) {
    const int b = bh / NH, h = bh % NH;
    const std::int64_t head = static_cast<std::int64_t>(h) * hs;
    const float* dbase = dout + static_cast<std::int64_t>(b) * T * C + head;
    float* dsum_bh = dsum + static_cast<std::int64_t>(bh) * T;
    for (int t = q_begin; t < T; ++t) {
      const OutT* ot = out + (static_cast<std::int64_t>(b) * T + t) * C + head;
      float acc = 0.0f;
      for (int d = 0; d < hs; ++d) acc += dbase[static_cast<std::int64_t>(t) * C + d] * to_acc<float>(ot[d]);
      dsum_bh[t] = acc;
    }
    load_rows(q, qkv + static_cast<std::int64_t>(b) * T * C3 + head, C3, q_begin, nq, hs);
    load_rows(g, dbase, C, q_begin, nq, hs);
    load_rows(k, kv + static_cast<std::int64_t>(b) * T * C2 + head, C2, 0, kv_rows, hs);
    load_rows(v, kv + static_cast<std::int64_t>(b) * T * C2 + C + head, C2, 0, kv_rows, hs);
    std::fill(dk.begin(), dk.end(), 0.0f);
    std::fill(dv.begin(), dv.end(), 0.0f);
    for (int q0 = 0; q0 < nq; q0 += kRows) {
      const int rows = std::min(kRows, nq - q0), keys = block_keys(q_begin + q0, rows, kv_rows, causal);
      const Op* qb = q.data() + static_cast<std::size_t>(q0) * hs;
      const Op* gb = g.data() + static_cast<std::size_t>(q0) * hs;
      mm(false, true, rows, keys, hs, scale, qb, hs, k.data(), hs, 0.0f, s.data(), keys);
      mm(false, true, rows, keys, hs, 1.0f, gb, hs, v.data(), hs, 0.0f, dp.data(), keys);
      for (int r = 0; r < rows; ++r) {
        const int t = q_begin + q0 + r, seen = visible_keys(t, keys, causal);
        const float row_lse = lse[static_cast<std::int64_t>(bh) * T + t];
        const std::size_t row = static_cast<std::size_t>(r) * keys;
        for (int j = 0; j < keys; ++j) {
          const float pr = j < seen ? math::exp_k(s[row + j] - row_lse) : 0.0f;
          p[row + j] = operand<Op>(pr);
          ds[row + j] = operand<Op>(math::softmax_backward(pr, dp[row + j], dsum_bh[t]));  // the score gradient
        }
      }
      mm(false, false, rows, hs, keys, scale, ds.data(), keys, k.data(), hs, 0.0f, dq.data(), hs);
      mm(true, false, keys, hs, rows, scale, ds.data(), keys, qb, hs, 1.0f, dk.data(), hs);
      mm(true, false, keys, hs, rows, 1.0f, p.data(), keys, gb, hs, 1.0f, dv.data(), hs);
      for (int r = 0; r < rows; ++r) {
        float* dqt = dqkv + (static_cast<std::int64_t>(b) * T + q_begin + q0 + r) * C3 + head;
        for (int d = 0; d < hs; ++d) dqt[d] += dq[static_cast<std::size_t>(r) * hs + d];
      }
    }
    float* dkb = dkv + static_cast<std::int64_t>(b) * T * C2 + head;
    for (int j = 0; j < kv_rows; ++j)
      for (int d = 0; d < hs; ++d) {
        dkb[static_cast<std::int64_t>(j) * C2 + d] += dk[static_cast<std::size_t>(j) * hs + d];
        dkb[static_cast<std::int64_t>(j) * C2 + C + d] += dv[static_cast<std::size_t>(j) * hs + d];
      }
  }
}

template <class OutT>
void backward(float* dqkv, float* dkv, float* dsum, const float* dout, const OutT* out, const float* qkv,
              const float* kv, const float* lse, int B, int T, int C, int NH, int q_begin, int kv_rows, bool causal,
              bool bf16) {
  if (bf16)
    backward_as<loom::bf16>(dqkv, dkv, dsum, dout, out, qkv, kv, lse, B, T, C, NH, q_begin, kv_rows, causal);
  else
    backward_as<float>(dqkv, dkv, dsum, dout, out, qkv, kv, lse, B, T, C, NH, q_begin, kv_rows, causal);
}

}  // namespace loom::kernels::ring
