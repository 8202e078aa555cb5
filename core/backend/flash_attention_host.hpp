#pragma once
// The host twin of the CUDA back end's fused attention (core/cuda/flash_attention.cuh), behind
// model.attention = flash on the host and fenced back ends: the same arithmetic, so that a flash run
// trains the same model on either back end.
//
//   - the probabilities are never stored: forward saves lse [B,NH,T] = row max + log row sum of the
//     scaled scores, and backward recomputes each probability from it;
//   - q, k, v, dout, the probabilities and the score gradients are rounded to bf16 where the device
//     loads or makes them (the operands of its tensor-core products); products, softmax, lse and every
//     output are fp32;
//   - forward walks the keys in tiles of kTile, as the device does, keeping a running row maximum: each
//     tile's probabilities are exp(score - the maximum so far), rounded to bf16 on that scale, and what
//     earlier tiles accumulated is rescaled when the maximum grows (the row sum adds the unrounded ones);
//   - backward needs no tiles (no running state): dsum[t] = dout[t] . out[t] (the saved, possibly
//     16-bit output), then per (key, query) the probability and its score gradient, once each.
//
// The products are loom::gemm's bf16 ones (oneDNN, or BLAS on fp32 copies; fp32 accumulation), on
// whole blocks where no running state intervenes: a block of 64 queries' scores against every key
// up to its diagonal, a block of 64 keys' against every later query; the device adds a product's
// terms in its own order, so the twin and the device agree to fp32 rounding (and the rare bf16
// rounding it tips), not bit for bit. Scratch per (sequence, head) is a few [64, T] blocks. The
// heads are taken in turn, as the unfused kernels take them: the products use the back end's
// threads (oneDNN's OpenMP, OpenBLAS), which one parallel region over heads would nest or
// oversubscribe under a threaded Kokkos.
//
// Layout as the unfused kernels: qkv [B,T,3C] with head h's q, k, v in columns h*hs, C + h*hs,
// 2C + h*hs; out [B,T,C]; lse and dsum [B,NH,T].
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/base/dtype.hpp"
#include "core/backend/gemm.hpp"
#include "core/backend/kernel_math.hpp"

namespace loom::kernels::flash {

constexpr int kTile = 64;  // keys per forward tile: flash_attention.cuh's kCols (the emulator test holds them equal)
constexpr float kNoScore = -1e30f;  // a masked score, as the device's

inline bool head_size_supported(int hs) { return math::flash_head_size_supported(hs); }

// One (sequence, head)'s rows [T, hs] of a [B,T,ld] tensor, rounded to bf16 once (as each device
// tile load rounds them).
inline void load_bf16(std::vector<bf16>& dst, const float* src, std::int64_t ld, int T, int hs) {
  dst.resize(static_cast<std::size_t>(T) * hs);
  for (int t = 0; t < T; ++t)
    for (int d = 0; d < hs; ++d)
      dst[static_cast<std::size_t>(t) * hs + d] = to_bf16(src[static_cast<std::int64_t>(t) * ld + d]);
}

// out as OutT: fp32, or bf16/fp16 rounded once (the operand of the output projection's product).
template <class OutT>
void attention_forward(OutT* out, float* lse,  // [B,T,C], [B,NH,T]
                       const float* qkv,       // [B,T,3C]
                       int B, int T, int C, int NH) {
  const int hs = C / NH;
  const std::int64_t C3 = 3 * static_cast<std::int64_t>(C);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  for (int bh = 0; bh < B * NH; ++bh) {  // heads in turn: the products inside take the threads (see above)
    const int b = bh / NH, h = bh % NH;
    const float* base = qkv + static_cast<std::int64_t>(b) * T * C3 + static_cast<std::int64_t>(h) * hs;
    std::vector<bf16> q, k, v;  // [T,hs] each
    load_bf16(q, base, C3, T, hs);
    load_bf16(k, base + C, C3, T, hs);
    load_bf16(v, base + 2 * C, C3, T, hs);
    std::vector<float> s(static_cast<std::size_t>(kTile) * T);     // [rows, keys] scores of a block of queries
    std::vector<bf16> p(static_cast<std::size_t>(kTile) * kTile);  // [rows, 64] one tile's probabilities
    std::vector<float> o(static_cast<std::size_t>(kTile) * hs), m(kTile), l(kTile);  // [rows, hs], [rows] x2
    for (int q0 = 0; q0 < T; q0 += kTile) {  // a device block: 64 queries, the key tiles up to its last
      const int rows = std::min(kTile, T - q0), keys = q0 + rows;
      gemm::gemm_bf16(false, true, rows, keys, hs, 1.0f, q.data() + static_cast<std::size_t>(q0) * hs, hs, k.data(), hs,
                      0.0f, s.data(), keys);  // s = q k^T, fp32 accumulation
      std::fill(o.begin(), o.end(), 0.0f);
      std::fill(m.begin(), m.end(), kNoScore);
      std::fill(l.begin(), l.end(), 0.0f);
      for (int k0 = 0; k0 < keys; k0 += kTile) {
        const int cols = std::min(kTile, keys - k0);
        for (int r = 0; r < rows; ++r) {
          const int t = q0 + r;
          float* sr = s.data() + static_cast<std::size_t>(r) * keys + k0;
          bf16* pr = p.data() + static_cast<std::size_t>(r) * kTile;
          // Two device lanes per row, each with half of the tile's columns: a max of each half, and
          // a sum of each half, in the lane's order (math::flash_lane_column), added at the end.
          float mx = kNoScore;
          for (int c = 0; c < cols; ++c) {
            sr[c] = k0 + c <= t ? sr[c] * scale : kNoScore;
            mx = sr[c] > mx ? sr[c] : mx;
          }
          const float m_new = m[r] > mx ? m[r] : mx;
          float half_sum[2] = {0.0f, 0.0f};
          const int lane = 2 * (r % 16);  // the row's first lane in its device warp
          for (int step = 0; step < kTile / 2; ++step)
            for (int half = 0; half < 2; ++half) {
              const int c = math::flash_lane_column(lane + half, step, kTile);
              if (c >= cols) continue;  // past T: the device adds zeros
              const float e = k0 + c <= t ? math::exp_k(sr[c] - m_new) : 0.0f;
              pr[c] = to_bf16(e);
              half_sum[half] += e;
            }
          const float alpha = math::exp_k(m[r] - m_new);  // rescales what earlier tiles accumulated
          float* orow = o.data() + static_cast<std::size_t>(r) * hs;
          for (int d = 0; d < hs; ++d) orow[d] *= alpha;
          m[r] = m_new;
          l[r] = l[r] * alpha + (half_sum[0] + half_sum[1]);
        }
        gemm::gemm_bf16(false, false, rows, hs, cols, 1.0f, p.data(), kTile,
                        v.data() + static_cast<std::size_t>(k0) * hs, hs, 1.0f, o.data(), hs);  // o += p v
      }
      for (int r = 0; r < rows; ++r) {
        const int t = q0 + r;
        OutT* ot = out + (static_cast<std::int64_t>(b) * T + t) * C + static_cast<std::int64_t>(h) * hs;
        for (int d = 0; d < hs; ++d) ot[d] = from_acc<OutT>(o[static_cast<std::size_t>(r) * hs + d] / l[r]);
        lse[static_cast<std::int64_t>(bh) * T + t] = m[r] + std::log(l[r]);
      }
    }
  }
}

// out: the forward's output as saved (fp32, bf16 or fp16); dsum [B,NH,T] is scratch.
template <class OutT>
void attention_backward(float* dqkv, float* dsum,            // [B,T,3C] (=), [B,NH,T] scratch
                        const float* dout, const OutT* out,  // [B,T,C], [B,T,C]
                        const float* qkv, const float* lse,  // [B,T,3C], [B,NH,T]
                        int B, int T, int C, int NH) {
  const int hs = C / NH;
  const std::int64_t C3 = 3 * static_cast<std::int64_t>(C);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  for (int bh = 0; bh < B * NH; ++bh) {
    const int b = bh / NH, h = bh % NH;
    const std::int64_t head = static_cast<std::int64_t>(h) * hs;
    const float* base = qkv + static_cast<std::int64_t>(b) * T * C3 + head;
    const float* dbase = dout + static_cast<std::int64_t>(b) * T * C + head;
    const float* lse_bh = lse + static_cast<std::int64_t>(bh) * T;
    float* dsum_bh = dsum + static_cast<std::int64_t>(bh) * T;
    for (int t = 0; t < T; ++t) {  // dsum = rowsum(dout * out): the probabilities' gradient dotted with them
      const OutT* ot = out + (static_cast<std::int64_t>(b) * T + t) * C + head;
      float acc = 0.0f;
      for (int d = 0; d < hs; ++d) acc += dbase[static_cast<std::int64_t>(t) * C + d] * to_acc<float>(ot[d]);
      dsum_bh[t] = acc;
    }
    std::vector<bf16> q, k, v, g;  // [T,hs] each; g = dout
    load_bf16(q, base, C3, T, hs);
    load_bf16(k, base + C, C3, T, hs);
    load_bf16(v, base + 2 * C, C3, T, hs);
    load_bf16(g, dbase, C, T, hs);
    const std::size_t block = static_cast<std::size_t>(kTile) * T;
    std::vector<float> st(block), dpt(block);  // [keys, queries] of a block of keys: scores^T, dprobs^T
    std::vector<bf16> pt(block), dst(block);   // probabilities^T, score gradients^T
    std::vector<float> dq(static_cast<std::size_t>(T) * hs, 0.0f), dk(static_cast<std::size_t>(kTile) * hs),
        dv(static_cast<std::size_t>(kTile) * hs);
    float* dbase_qkv = dqkv + static_cast<std::int64_t>(b) * T * C3 + head;
    for (int k0 = 0; k0 < T; k0 += kTile) {  // a device block of dk/dv: 64 keys, the queries from its first on
      const int kr = std::min(kTile, T - k0), nq = T - k0;
      const std::size_t at = static_cast<std::size_t>(k0) * hs;
      gemm::gemm_bf16(false, true, kr, nq, hs, 1.0f, k.data() + at, hs, q.data() + at, hs, 0.0f, st.data(),
                      nq);  // k q^T
      gemm::gemm_bf16(false, true, kr, nq, hs, 1.0f, v.data() + at, hs, g.data() + at, hs, 0.0f, dpt.data(),
                      nq);  // v dout^T
      for (int r = 0; r < kr; ++r) {
        const int key = k0 + r;
        const std::size_t row = static_cast<std::size_t>(r) * nq;
        for (int c = 0; c < nq; ++c) {
          const int t = k0 + c;
          if (key <= t) {
            const float pr = math::exp_k(st[row + c] * scale - lse_bh[t]);
            pt[row + c] = to_bf16(pr);
            dst[row + c] = to_bf16(math::softmax_backward(pr, dpt[row + c], dsum_bh[t]));
          } else {
            pt[row + c] = to_bf16(0.0f);
            dst[row + c] = to_bf16(0.0f);
          }
        }
      }
      gemm::gemm_bf16(false, false, kr, hs, nq, 1.0f, pt.data(), nq, g.data() + at, hs, 0.0f, dv.data(),
                      hs);  // p^T dout
      gemm::gemm_bf16(false, false, kr, hs, nq, 1.0f, dst.data(), nq, q.data() + at, hs, 0.0f, dk.data(),
                      hs);  // ds^T q
      gemm::gemm_bf16(true, false, nq, hs, kr, 1.0f, dst.data(), nq, k.data() + at, hs, 1.0f, dq.data() + at,
                      hs);  // dq += ds k
      for (int r = 0; r < kr; ++r)
        for (int d = 0; d < hs; ++d) {
          float* row = dbase_qkv + static_cast<std::int64_t>(k0 + r) * C3 + d;
          row[C] = dk[static_cast<std::size_t>(r) * hs + d] * scale;
          row[2 * static_cast<std::int64_t>(C)] = dv[static_cast<std::size_t>(r) * hs + d];
        }
    }
    for (int t = 0; t < T; ++t)
      for (int d = 0; d < hs; ++d)
        dbase_qkv[static_cast<std::int64_t>(t) * C3 + d] = dq[static_cast<std::size_t>(t) * hs + d] * scale;
  }
}

}  // namespace loom::kernels::flash
