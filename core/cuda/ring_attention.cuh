#pragma once
// Ring attention's device kernels (context parallelism; Backend::attention_ring_forward, _backward and
// copy_rows; contracts in core/cuda/kernels.cuh): the twins of the host's core/backend/ring_attention_host.hpp,
// which is the semantic reference. One step of the ring: this rank's queries [q_begin, T) of each
// sequence against one block of keys and values [0, kv_rows), merged into the running (out, lse) by the
// online softmax; and that step's backward, the probabilities recomputed from the final lse.
//
// Work split: one warp per row, no atomics, so a call repeats bit for bit. The forward and the dq
// kernel take a query row; the dk/dv kernel a key row and walks the queries, recomputing the same
// scores and score gradients (the same products in the same order: the same bits as the dq kernel's).
// Keys (or queries) go 32 at a time, one per lane: its score is a sequential dot product over the head
// (fixed order); its probability (or score gradient) goes through the warp's shared memory, and then
// each lane adds the 32 keys' terms into the head columns d = lane, lane + 32, ... it owns, in key order.
// A row's sums over lanes (the softmax's denominator, dout . out) are xor butterflies: every lane gets
// the same bits. Any head size: the warp's rows (q, k, v, dout, accumulators) are in shared memory.
// The forward takes two passes over the keys, the maximum first, so that its probabilities are those
// of the block's maximum as the host's (which bf16 rounds).
//
// bf16: q, k, v, dout, the probabilities (for p v and p^T dout only: the denominator sums them
// unrounded) and the score gradients are rounded to bf16 (math::bf16_bits, round to nearest even) before
// their products, as the host's; every product and sum is fp32.
//
// Simple rather than fast (no tiles, no tensor cores): each warp reads its other side's rows from
// device memory through the caches.
//
// The source compiles for the GPU (nvcc, core/cuda/ring_attention.cu) and for the host against the CUDA
// emulator (core/cuda/emu/), whose unit tests run these kernels against the host's; each operation is a
// function template over `launch`, as in core/cuda/layer_kernels.cuh.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "core/cuda/device_portable.hpp"
#include "core/cuda/launch_geometry.hpp"
#include "core/backend/kernel_math.hpp"

namespace loom::cuda::ring {

constexpr int kWarp = 32;
constexpr int kWarps = 4;  // warps (rows at a time) per block
constexpr int kThreads = kWarp * kWarps;
constexpr unsigned kCopyThreads = 256;
constexpr float kEmptyRow = -1e30f;  // lse of a row no block has reached yet (the host's kEmptyRow)

// Shared floats per warp: forward q and out accumulators [hs] each and 32 probabilities; dq: q, dout
// and dq [hs] each and 32 score gradients; dk/dv: k, v, dk and dv [hs] each, 32 score gradients and
// 32 probabilities.
LOOM_HD constexpr int forward_warp_floats(int hs) { return 2 * hs + kWarp; }
LOOM_HD constexpr int backward_q_warp_floats(int hs) { return 3 * hs + kWarp; }
LOOM_HD constexpr int backward_kv_warp_floats(int hs) { return 4 * hs + 2 * kWarp; }
inline std::size_t smem_bytes(int warp_floats) {
  return static_cast<std::size_t>(kWarps) * static_cast<std::size_t>(warp_floats) * sizeof(float);
}

LOOM_DEVICE float operand(float x, bool bf16) { return bf16 ? math::bf16_value(math::bf16_bits(x)) : x; }

LOOM_DEVICE float warp_sum(float v) {
  for (int m = kWarp / 2; m > 0; m >>= 1) v += dev::shfl_xor(v, m);
  return v;
}
LOOM_DEVICE float warp_max(float v) {
  for (int m = kWarp / 2; m > 0; m >>= 1) {
    const float w = dev::shfl_xor(v, m);
    v = v < w ? w : v;
  }
  return v;
}

// A dot product over the head: a (rounded) [hs] row in the warp's shared memory against a row in device
// memory, rounded as loaded, d in order. The forward and the dq kernel hold q and dout and read k and v;
// the dk/dv kernel holds k and v and reads q and dout: the same products (a * b is b * a) in the same
// order, so both kernels see the same scores and score gradients, bit for bit.
LOOM_DEVICE float dot(const float* shared, const float* row, int hs, bool bf16) {
  float acc = 0.0f;
  for (int d = 0; d < hs; ++d) acc += shared[d] * operand(row[d], bf16);
  return acc;
}

// The keys query t sees in the block (the host's visible_keys).
LOOM_DEVICE int visible_keys(int t, int kv_rows, bool causal) {
  return causal ? (kv_rows < t + 1 ? kv_rows : t + 1) : kv_rows;
}

// Where a warp's rows start and step in a grid-stride loop; the warp's shared floats.
struct WarpRows {
  std::int64_t first, step;
  int lane, warp;
};
LOOM_DEVICE WarpRows warp_rows() {
  const int warps = dev::block_dim_x() / kWarp;
  const int warp = dev::thread_x() / kWarp;
  return WarpRows{static_cast<std::int64_t>(dev::block_x()) * warps + warp,
                  static_cast<std::int64_t>(warps) * dev::grid_x(), dev::thread_x() % kWarp, warp};
}

// ---------------------------------------------------------------------------------------------
// Forward: one warp per query row (b, h, t), t in [q_begin, T); rows ordered (b, h, t).
LOOM_KERNEL void attention_ring_forward_kernel(float* out,        // [B,T,C] running output (merged)
                                               float* lse,        // [B,NH,T] running lse (merged)
                                               const float* qkv,  // [B,T,3C]
                                               const float* kv,   // [B,T,2C]
                                               int B, int T, int C, int NH, int q_begin, int kv_rows, bool causal,
                                               bool bf16, float scale) {
  const int hs = C / NH, nq = T - q_begin;
  const std::int64_t C3 = 3 * static_cast<std::int64_t>(C), C2 = 2 * static_cast<std::int64_t>(C);
  const std::int64_t rows = static_cast<std::int64_t>(B) * NH * nq;
  const WarpRows w = warp_rows();
  float* qs = dev::shared_memory<float>() + static_cast<std::size_t>(w.warp) * forward_warp_floats(hs);
  float* os = qs + hs;  // lane-owned: column d by lane d % 32
  float* ps = os + hs;  // [32] the chunk's probabilities, rounded as the product's operands
  for (std::int64_t row = w.first; row < rows; row += w.step) {
    const int t = q_begin + static_cast<int>(row % nq);
    const std::int64_t bh = row / nq, b = bh / NH, h = bh % NH;
    const float* q = qkv + (b * T + t) * C3 + h * hs;
    const float* k = kv + b * T * C2 + h * hs;  // key j at k + j * C2, its value at k + C + j * C2
    const float* v = k + C;
    dev::sync_warp();  // the previous row's reads of qs and ps are done
    for (int d = w.lane; d < hs; d += kWarp) {
      qs[d] = operand(q[d], bf16);
      os[d] = 0.0f;
    }
    dev::sync_warp();
    const int seen = visible_keys(t, kv_rows, causal);
    float mx = kEmptyRow;  // the block's maximum scaled score
    for (int j = w.lane; j < seen; j += kWarp) {
      const float s = dot(qs, k + j * C2, hs, bf16) * scale;
      mx = mx < s ? s : mx;
    }
    mx = warp_max(mx);
    float l = 0.0f;  // the lane's share of the denominator (unrounded probabilities)
    for (int j0 = 0; j0 < seen; j0 += kWarp) {
      const int j = j0 + w.lane;
      const float e = j < seen ? math::exp_k(dot(qs, k + j * C2, hs, bf16) * scale - mx) : 0.0f;
      l += e;
      ps[w.lane] = operand(e, bf16);
      dev::sync_warp();
      const int n = seen - j0 < kWarp ? seen - j0 : kWarp;
      for (int d = w.lane; d < hs; d += kWarp) {
        float acc = os[d];
        for (int i = 0; i < n; ++i) acc += ps[i] * operand(v[(j0 + i) * C2 + d], bf16);
        os[d] = acc;
      }
      dev::sync_warp();  // every lane has read ps before the next chunk writes it
    }
    l = warp_sum(l);
    const float lse_b = mx + dev::log_f(l);
    float* row_lse = lse + bh * T + t;
    const float old = *row_lse;
    const float top = old < lse_b ? lse_b : old;
    const float w_old = math::exp_k(old - top), w_new = math::exp_k(lse_b - top), total = w_old + w_new;
    float* o = out + (b * T + t) * C + h * hs;
    for (int d = w.lane; d < hs; d += kWarp) o[d] = (o[d] * w_old + os[d] / l * w_new) / total;
    dev::sync_warp();  // every lane has read the old lse
    if (w.lane == 0) *row_lse = top + dev::log_f(total);
  }
}

// ---------------------------------------------------------------------------------------------
// Backward, step 1: one warp per query row (b, h, t), t in [q_begin, T): dsum[t] = dout_t . out_t, and
// dq_t += scale * sum_j ds_tj k_j into dqkv's q columns.
template <class OutT>
LOOM_KERNEL void attention_ring_backward_q_kernel(float* dqkv,        // [B,T,3C] q columns (+=)
                                                  float* dsum,        // [B,NH,T] (=, rows [q_begin, T))
                                                  const float* dout,  // [B,T,C]
                                                  const OutT* out,    // [B,T,C] the final output
                                                  const float* qkv,   // [B,T,3C]
                                                  const float* kv,    // [B,T,2C]
                                                  const float* lse,   // [B,NH,T] the final lse
                                                  int B, int T, int C, int NH, int q_begin, int kv_rows, bool causal,
                                                  bool bf16, float scale) {
  const int hs = C / NH, nq = T - q_begin;
  const std::int64_t C3 = 3 * static_cast<std::int64_t>(C), C2 = 2 * static_cast<std::int64_t>(C);
  const std::int64_t rows = static_cast<std::int64_t>(B) * NH * nq;
  const WarpRows w = warp_rows();
  float* qs = dev::shared_memory<float>() + static_cast<std::size_t>(w.warp) * backward_q_warp_floats(hs);
  float* gs = qs + hs;   // dout_t, rounded
  float* dq = gs + hs;   // lane-owned accumulators
  float* dss = dq + hs;  // [32] the chunk's score gradients
  for (std::int64_t row = w.first; row < rows; row += w.step) {
    const int t = q_begin + static_cast<int>(row % nq);
    const std::int64_t bh = row / nq, b = bh / NH, h = bh % NH;
    const float* q = qkv + (b * T + t) * C3 + h * hs;
    const float* g = dout + (b * T + t) * C + h * hs;
    const OutT* o = out + (b * T + t) * C + h * hs;
    const float* k = kv + b * T * C2 + h * hs;
    const float* v = k + C;
    dev::sync_warp();  // the previous row's reads of qs, gs and dss are done
    float part = 0.0f;
    for (int d = w.lane; d < hs; d += kWarp) {
      part += g[d] * dev::as_float(o[d]);
      qs[d] = operand(q[d], bf16);
      gs[d] = operand(g[d], bf16);
      dq[d] = 0.0f;
    }
    const float dsum_t = warp_sum(part);
    if (w.lane == 0) dsum[bh * T + t] = dsum_t;
    dev::sync_warp();
    const float lse_t = lse[bh * T + t];
    const int seen = visible_keys(t, kv_rows, causal);
    for (int j0 = 0; j0 < seen; j0 += kWarp) {
      const int j = j0 + w.lane;
      float ds = 0.0f;
      if (j < seen) {
        const float p = math::exp_k(dot(qs, k + j * C2, hs, bf16) * scale - lse_t);
        const float dp = dot(gs, v + j * C2, hs, bf16);
        ds = operand(math::softmax_backward(p, dp, dsum_t), bf16);
      }
      dss[w.lane] = ds;
      dev::sync_warp();
      const int n = seen - j0 < kWarp ? seen - j0 : kWarp;
      for (int d = w.lane; d < hs; d += kWarp) {
        float acc = dq[d];
        for (int i = 0; i < n; ++i) acc += dss[i] * operand(k[(j0 + i) * C2 + d], bf16);
        dq[d] = acc;
      }
      dev::sync_warp();
    }
    float* dqt = dqkv + (b * T + t) * C3 + h * hs;
    for (int d = w.lane; d < hs; d += kWarp) dqt[d] += scale * dq[d];
  }
}

// Backward, step 2 (after step 1: it reads dsum): one warp per key row (b, h, j), j in [0, kv_rows):
// dk_j += scale * sum_t ds_tj q_t and dv_j += sum_t p_tj dout_t over the queries that see key j.
LOOM_KERNEL void attention_ring_backward_kv_kernel(float* dkv,         // [B,T,2C] rows [0, kv_rows) (+=)
                                                   const float* dsum,  // [B,NH,T]
                                                   const float* dout,  // [B,T,C]
                                                   const float* qkv,   // [B,T,3C]
                                                   const float* kv,    // [B,T,2C]
                                                   const float* lse,   // [B,NH,T]
                                                   int B, int T, int C, int NH, int q_begin, int kv_rows, bool causal,
                                                   bool bf16, float scale) {
  const int hs = C / NH;
  const std::int64_t C3 = 3 * static_cast<std::int64_t>(C), C2 = 2 * static_cast<std::int64_t>(C);
  const std::int64_t rows = static_cast<std::int64_t>(B) * NH * kv_rows;
  const WarpRows w = warp_rows();
  float* ks = dev::shared_memory<float>() + static_cast<std::size_t>(w.warp) * backward_kv_warp_floats(hs);
  float* vs = ks + hs;
  float* dk = vs + hs;  // lane-owned accumulators
  float* dv = dk + hs;
  float* dss = dv + hs;      // [32] the chunk's score gradients (rounded)
  float* pss = dss + kWarp;  // [32] the chunk's probabilities (rounded)
  for (std::int64_t row = w.first; row < rows; row += w.step) {
    const int j = static_cast<int>(row % kv_rows);
    const std::int64_t bh = row / kv_rows, b = bh / NH, h = bh % NH;
    const float* k = kv + (b * T + j) * C2 + h * hs;
    const float* q = qkv + b * T * C3 + h * hs;  // query t at q + t * C3
    const float* g = dout + b * T * C + h * hs;  // its dout at g + t * C
    dev::sync_warp();
    for (int d = w.lane; d < hs; d += kWarp) {
      ks[d] = operand(k[d], bf16);
      vs[d] = operand(k[C + d], bf16);
      dk[d] = 0.0f;
      dv[d] = 0.0f;
    }
    dev::sync_warp();
    // Query t sees key j when j < visible_keys(t): causal, t >= j.
    const int first = causal && j > q_begin ? j : q_begin;
    for (int t0 = first; t0 < T; t0 += kWarp) {
      const int t = t0 + w.lane;
      float ds = 0.0f, p = 0.0f;
      if (t < T) {
        const float pr = math::exp_k(dot(ks, q + t * C3, hs, bf16) * scale - lse[bh * T + t]);
        const float dp = dot(vs, g + t * C, hs, bf16);
        ds = operand(math::softmax_backward(pr, dp, dsum[bh * T + t]), bf16);
        p = operand(pr, bf16);
      }
      dss[w.lane] = ds;
      pss[w.lane] = p;
      dev::sync_warp();
      const int n = T - t0 < kWarp ? T - t0 : kWarp;
      for (int d = w.lane; d < hs; d += kWarp) {
        float a = dk[d], c = dv[d];
        for (int i = 0; i < n; ++i) {
          a += dss[i] * operand(q[(t0 + i) * C3 + d], bf16);
          c += pss[i] * operand(g[(t0 + i) * C + d], bf16);
        }
        dk[d] = a;
        dv[d] = c;
      }
      dev::sync_warp();
    }
    float* dkj = dkv + (b * T + j) * C2 + h * hs;
    for (int d = w.lane; d < hs; d += kWarp) {
      dkj[d] += scale * dk[d];
      dkj[C + d] += dv[d];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// copy_rows: dst[r * dst_ld + c] = src[r * src_ld + c], grid-stride over rows * cols elements.
LOOM_KERNEL void copy_rows_kernel(float* dst, const float* src, std::int64_t rows, std::int64_t cols,
                                  std::int64_t dst_ld, std::int64_t src_ld) {
  const std::int64_t n = rows * cols;
  const std::int64_t step = static_cast<std::int64_t>(dev::grid_x()) * dev::block_dim_x();
  for (std::int64_t i = static_cast<std::int64_t>(dev::block_x()) * dev::block_dim_x() + dev::thread_x(); i < n;
       i += step) {
    const std::int64_t r = i / cols, c = i % cols;
    dst[r * dst_ld + c] = src[r * src_ld + c];
  }
}

// ---------------------------------------------------------------------------------------------
// The operations: `launch(name, blocks, threads, dynamic_shared_bytes, kernel, args...)`.

inline void check_shape(const char* op, int B, int T, int C, int NH, int q_begin, int kv_rows) {
  if (B < 0 || T < 0 || C <= 0 || NH <= 0 || C % NH != 0 || q_begin < 0 || q_begin > T || kv_rows < 0 || kv_rows > T)
    throw std::invalid_argument(std::string(op) + ": B " + std::to_string(B) + ", T " + std::to_string(T) + ", C " +
                                std::to_string(C) + ", NH " + std::to_string(NH) + ", q_begin " +
                                std::to_string(q_begin) + ", kv_rows " + std::to_string(kv_rows) +
                                " (C a multiple of NH, 0 <= q_begin <= T, 0 <= kv_rows <= T)");
}

inline float score_scale(int hs) { return 1.0f / std::sqrt(static_cast<float>(hs)); }

// A block with no keys (kv_rows = 0) changes nothing (the host's would merge 0/0).
template <class Launch>
void attention_ring_forward(const Launch& launch, float* out, float* lse, const float* qkv, const float* kv, int B,
                            int T, int C, int NH, int q_begin, int kv_rows, bool causal, bool bf16) {
  check_shape("attention_ring_forward", B, T, C, NH, q_begin, kv_rows);
  const std::int64_t rows = static_cast<std::int64_t>(B) * NH * (T - q_begin);
  if (rows == 0 || kv_rows == 0) return;
  const int hs = C / NH;
  const LaunchGeometry g = rows_per_warp_geometry(rows, kThreads);
  launch("attention_ring_forward_kernel", g.blocks, g.threads, smem_bytes(forward_warp_floats(hs)),
         attention_ring_forward_kernel, out, lse, qkv, kv, B, T, C, NH, q_begin, kv_rows, causal, bf16,
         score_scale(hs));
}

template <class Launch, class OutT>
void attention_ring_backward(const Launch& launch, float* dqkv, float* dkv, float* dsum, const float* dout,
                             const OutT* out, const float* qkv, const float* kv, const float* lse, int B, int T, int C,
                             int NH, int q_begin, int kv_rows, bool causal, bool bf16) {
  check_shape("attention_ring_backward", B, T, C, NH, q_begin, kv_rows);
  const std::int64_t q_rows = static_cast<std::int64_t>(B) * NH * (T - q_begin),
                     kv_rows_all = static_cast<std::int64_t>(B) * NH * kv_rows;
  if (q_rows == 0) return;  // no queries: no gradient
  const int hs = C / NH;
  const float scale = score_scale(hs);
  const LaunchGeometry gq = rows_per_warp_geometry(q_rows, kThreads);
  launch("attention_ring_backward_q_kernel", gq.blocks, gq.threads, smem_bytes(backward_q_warp_floats(hs)),
         attention_ring_backward_q_kernel<OutT>, dqkv, dsum, dout, out, qkv, kv, lse, B, T, C, NH, q_begin, kv_rows,
         causal, bf16, scale);
  if (kv_rows_all == 0) return;
  const LaunchGeometry gk = rows_per_warp_geometry(kv_rows_all, kThreads);
  launch("attention_ring_backward_kv_kernel", gk.blocks, gk.threads, smem_bytes(backward_kv_warp_floats(hs)),
         attention_ring_backward_kv_kernel, dkv, static_cast<const float*>(dsum), dout, qkv, kv, lse, B, T, C, NH,
         q_begin, kv_rows, causal, bf16, scale);
}

template <class Launch>
void copy_rows(const Launch& launch, float* dst, const float* src, std::int64_t rows, std::int64_t cols,
               std::int64_t dst_ld, std::int64_t src_ld) {
  if (rows <= 0 || cols <= 0) return;
  const LaunchGeometry g = elementwise_geometry(rows * cols, kCopyThreads);
  launch("copy_rows_kernel", g.blocks, g.threads, 0, copy_rows_kernel, dst, src, rows, cols, dst_ld, src_ld);
}

}  // namespace loom::cuda::ring
