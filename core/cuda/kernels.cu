// The CUDA layer kernels and their launch wrappers (declared, with their contracts, in
// core/cuda/kernels.cuh). Semantics follow core/kernels.hpp; per-element arithmetic comes from
// core/kernel_math.hpp. No atomics anywhere: every sum is reduced in an order fixed by the shapes.
#include "core/cuda/kernels.cuh"

#include <cuda_fp16.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "core/kernel_math.hpp"

namespace loom::cuda {
namespace {

constexpr unsigned kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr unsigned kThreads = 256;            // elementwise and warp-per-row kernels
constexpr unsigned kRowBlockThreads = 512;    // block-per-row kernels along V ~ 50k (cross-entropy backward)
// The cross-entropy forward keeps a whole row (GPT-2: 50304 floats, 201 kB) in shared memory, so
// one block fills an SM: it gets the most threads a block can have.
constexpr unsigned kCrossEntropyForwardThreads = 1024;
constexpr unsigned kMaxRowBlocks = 65535u * 4;
// Column sums (bias and LayerNorm parameter gradients): a block owns kColTile columns over all
// rows, so no two blocks add into the same gradient (no atomics, fixed order). 8 floats are one
// 32-byte sector, so a warp (8 columns x 4 rows) reads whole sectors; the 128 threads along the
// rows keep enough loads in flight for the few blocks that C / 8 gives.
constexpr unsigned kColTile = 8;
constexpr unsigned kColRowLanes = 128;
constexpr unsigned kColThreads = kColTile * kColRowLanes;  // 1024
// Reductions: the block count depends on n only (never on the device), so the partition, and with
// it the result, is the same everywhere; 1024 partials are cheap for the one finishing block.
constexpr unsigned kReduceThreads = 256;
constexpr unsigned kReduceMaxBlocks = 1024;

void check_launch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("loom::cuda: launching ") + kernel + " failed: " + cudaGetErrorString(err));
}

void check_call(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("loom::cuda: ") + what + " failed: " + cudaGetErrorString(err));
}

// One block per row, the blocks looping when the rows outnumber the grid.
LaunchGeometry rows_per_block_geometry(std::int64_t rows, unsigned threads) {
  const std::int64_t want = rows > 0 ? rows : 1;
  return LaunchGeometry{static_cast<unsigned>(want < kMaxRowBlocks ? want : kMaxRowBlocks), threads};
}

// ---------------------------------------------------------------------------------------------
// Device helpers.

__device__ __forceinline__ std::int64_t global_thread() {
  return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ std::int64_t grid_threads() { return static_cast<std::int64_t>(gridDim.x) * blockDim.x; }
__device__ __forceinline__ std::int64_t global_warp() { return global_thread() / kWarp; }
__device__ __forceinline__ std::int64_t grid_warps() { return grid_threads() / kWarp; }
__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x % kWarp); }

struct SumOp {
  template <class A>
  __device__ A operator()(A a, A b) const { return a + b; }
};
struct MaxOp {  // the host's `x > mx ? x : mx`
  template <class A>
  __device__ A operator()(A a, A b) const { return b > a ? b : a; }
};

// Butterfly reduction: every lane ends with the same value (each level adds the same two operands
// in both lanes, and + and the max are commutative), so the result is deterministic.
template <class A, class Op>
__device__ __forceinline__ A warp_reduce(A v, Op op) {
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Reduces v over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the
// result. `shared` holds one value per warp; the leading barrier lets consecutive calls reuse it.
template <class A, class Op>
__device__ A block_reduce(A v, A identity, Op op, A* shared) {
  const int lane = lane_id(), warp = static_cast<int>(threadIdx.x / kWarp);
  const int warps = static_cast<int>(blockDim.x / kWarp);
  v = warp_reduce(v, op);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : identity;
  return warp_reduce(v, op);
}

// ---------------------------------------------------------------------------------------------
// Token + position embedding.

// One block per row (b,t), threads along C.
__global__ void encoder_forward_kernel(float* out,               // [B,T,C]
                                       const std::int32_t* inp,  // [B,T]
                                       const float* wte,         // [V_local,C]
                                       const float* wpe,         // [T,C]
                                       int N, int T, int C, int vocab_begin, int vocab_end, bool add_pos) {
  for (int bt = blockIdx.x; bt < N; bt += gridDim.x) {
    const int tok = inp[bt];
    const bool mine = tok >= vocab_begin && tok < vocab_end;
    const float* te = mine ? wte + static_cast<std::int64_t>(tok - vocab_begin) * C : nullptr;
    const float* pe = add_pos ? wpe + static_cast<std::int64_t>(bt % T) * C : nullptr;
    float* o = out + static_cast<std::int64_t>(bt) * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) o[c] = (mine ? te[c] : 0.0f) + (add_pos ? pe[c] : 0.0f);
  }
}

// dwpe: one block per position t, threads along C; each element adds its B rows in order b = 0..B-1
// (the host's order), so no two threads touch one element.
__global__ void encoder_backward_wpe_kernel(float* dwpe,        // [T,C] (+=)
                                            const float* dout,  // [B,T,C]
                                            int B, int T, int C) {
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    float* g = dwpe + static_cast<std::int64_t>(t) * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
      float acc = g[c];
      for (int b = 0; b < B; ++b) acc += dout[(static_cast<std::int64_t>(b) * T + t) * C + c];
      g[c] = acc;
    }
  }
}

// dwte without atomics: one warp per row; the warp of the *first* row holding a token owns that
// token's gradient row and adds every row holding the token, in row order (the host's order). The
// cost is the scans of inp (32 tokens per step): a repeated token stops at its first earlier
// occurrence, a token's owner scans the rows after it, so ~ (distinct tokens) * N / 32 steps.
__global__ void encoder_backward_wte_kernel(float* dwte,              // [V_local,C] (+=)
                                            const float* dout,        // [B,T,C]
                                            const std::int32_t* inp,  // [B,T]
                                            int N, int C, int vocab_begin, int vocab_end) {
  const int lane = lane_id();
  for (std::int64_t row = global_warp(); row < N; row += grid_warps()) {  // warp-uniform
    const int tok = inp[row];
    if (tok < vocab_begin || tok >= vocab_end) continue;
    bool earlier = false;  // does a row before `row` hold tok? (warp-uniform: from __any_sync)
    for (std::int64_t r0 = 0; r0 < row && !earlier; r0 += kWarp) {
      const std::int64_t r = r0 + lane;
      earlier = __any_sync(kFullMask, r < row && inp[r] == tok);
    }
    if (earlier) continue;
    float* g = dwte + static_cast<std::int64_t>(tok - vocab_begin) * C;
    for (std::int64_t r0 = row; r0 < N; r0 += kWarp) {
      const std::int64_t r = r0 + lane;
      unsigned match = __ballot_sync(kFullMask, r < N && inp[r] == tok);
      while (match) {  // the matching rows of this step, lowest first
        const int k = __ffs(static_cast<int>(match)) - 1;
        match &= match - 1;
        const float* d = dout + (r0 + k) * C;
        for (int c = lane; c < C; c += kWarp) g[c] += d[c];  // each lane owns its columns of g
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// LayerNorm.

// One warp per row: mean, then the sum of squared deviations (two passes, as the host), then the
// normalised output. The row is re-read from L1/L2 rather than held in registers (C is runtime).
__global__ void layernorm_forward_kernel(float* out,           // [N,C]
                                         float* mean,          // [N]
                                         float* rstd,          // [N]
                                         const float* inp,     // [N,C]
                                         const float* weight,  // [C]
                                         const float* bias,    // [C]
                                         int N, int C) {
  const int lane = lane_id();
  for (std::int64_t n = global_warp(); n < N; n += grid_warps()) {
    const float* x = inp + n * C;
    float s = 0.0f;
    for (int c = lane; c < C; c += kWarp) s += x[c];
    const float m = warp_reduce(s, SumOp{}) / static_cast<float>(C);
    float v = 0.0f;
    for (int c = lane; c < C; c += kWarp) {
      const float xc = x[c] - m;
      v += xc * xc;
    }
    const float r = loom::math::layernorm_rstd(warp_reduce(v, SumOp{}) / static_cast<float>(C));
    float* o = out + n * C;
    for (int c = lane; c < C; c += kWarp) o[c] = loom::math::layernorm_out(x[c], m, r, weight[c], bias[c]);
    if (lane == 0) {
      mean[n] = m;
      rstd[n] = r;
    }
  }
}

// dinp, one warp per row: the row's means of dnorm = weight*dout and of dnorm*xhat, then
// dinp += layernorm_dinp per element (each lane reads and writes only its own columns).
__global__ void layernorm_backward_dinp_kernel(float* dinp,          // [N,C] (+=)
                                               const float* dout,    // [N,C]
                                               const float* inp,     // [N,C]
                                               const float* weight,  // [C]
                                               const float* mean,    // [N]
                                               const float* rstd,    // [N]
                                               int N, int C) {
  const int lane = lane_id();
  for (std::int64_t n = global_warp(); n < N; n += grid_warps()) {
    const float* d = dout + n * C;
    const float* x = inp + n * C;
    float* dx = dinp + n * C;
    const float m = mean[n], r = rstd[n];
    float dnorm_sum = 0.0f, dnorm_norm_sum = 0.0f;
    for (int c = lane; c < C; c += kWarp) {
      const float xhat = (x[c] - m) * r;
      const float dnorm = weight[c] * d[c];
      dnorm_sum += dnorm;
      dnorm_norm_sum += dnorm * xhat;
    }
    const float dnorm_mean = warp_reduce(dnorm_sum, SumOp{}) / static_cast<float>(C);
    const float dnorm_norm_mean = warp_reduce(dnorm_norm_sum, SumOp{}) / static_cast<float>(C);
    for (int c = lane; c < C; c += kWarp)
      dx[c] += loom::math::layernorm_dinp(x[c], m, r, weight[c], d[c], dnorm_mean, dnorm_norm_mean);
  }
}

// Adds, for each of the block's kColTile columns, the kColRowLanes partial sums in s (indexed by
// threadIdx.x = row_lane * kColTile + column) in a fixed tree; the column's total ends in s[column].
__device__ __forceinline__ void column_tree_sum(float* s0, float* s1) {
  const unsigned row_lane = threadIdx.x / kColTile;
  __syncthreads();
  for (unsigned stride = kColRowLanes / 2; stride > 0; stride >>= 1) {
    if (row_lane < stride) {
      s0[threadIdx.x] += s0[threadIdx.x + stride * kColTile];
      if (s1) s1[threadIdx.x] += s1[threadIdx.x + stride * kColTile];
    }
    __syncthreads();
  }
}

// dweight and dbias, coalesced column sums: a block owns kColTile columns over all N rows; its
// threads take every kColRowLanes-th row, then a fixed tree adds their partials.
__global__ void __launch_bounds__(kColThreads)
    layernorm_backward_params_kernel(float* dweight,      // [C] (+=)
                                     float* dbias,        // [C] (+=)
                                     const float* dout,   // [N,C]
                                     const float* inp,    // [N,C]
                                     const float* mean,   // [N]
                                     const float* rstd,   // [N]
                                     int N, int C) {
  __shared__ float s_dw[kColThreads];
  __shared__ float s_db[kColThreads];
  const int col = static_cast<int>(threadIdx.x % kColTile), row_lane = static_cast<int>(threadIdx.x / kColTile);
  for (std::int64_t c0 = static_cast<std::int64_t>(blockIdx.x) * kColTile; c0 < C;
       c0 += static_cast<std::int64_t>(gridDim.x) * kColTile) {  // block-uniform
    const std::int64_t c = c0 + col;
    float dw = 0.0f, db = 0.0f;
    if (c < C) {
#pragma unroll 4
      for (int n = row_lane; n < N; n += kColRowLanes) {
        const std::int64_t i = static_cast<std::int64_t>(n) * C + c;
        const float dc = dout[i];
        db += dc;
        dw += (inp[i] - mean[n]) * rstd[n] * dc;
      }
    }
    s_dw[threadIdx.x] = dw;
    s_db[threadIdx.x] = db;
    column_tree_sum(s_dw, s_db);
    if (row_lane == 0 && c < C) {
      dweight[c] += s_dw[col];
      dbias[c] += s_db[col];
    }
    __syncthreads();  // the next tile overwrites s_dw, s_db
  }
}

// ---------------------------------------------------------------------------------------------
// Linear-layer bias.

// One block per row, threads along OC: no index division.
__global__ void bias_add_kernel(float* out,         // [N,OC]
                                const float* bias,  // [OC]
                                int N, int OC) {
  for (int n = blockIdx.x; n < N; n += gridDim.x) {
    float* o = out + static_cast<std::int64_t>(n) * OC;
    for (int j = threadIdx.x; j < OC; j += blockDim.x) o[j] += bias[j];
  }
}

// As layernorm_backward_params_kernel, dout's column sums only.
__global__ void __launch_bounds__(kColThreads)
    bias_backward_kernel(float* dbias,       // [OC] (+=)
                         const float* dout,  // [N,OC]
                         int N, int OC) {
  __shared__ float s_db[kColThreads];
  const int col = static_cast<int>(threadIdx.x % kColTile), row_lane = static_cast<int>(threadIdx.x / kColTile);
  for (std::int64_t j0 = static_cast<std::int64_t>(blockIdx.x) * kColTile; j0 < OC;
       j0 += static_cast<std::int64_t>(gridDim.x) * kColTile) {  // block-uniform
    const std::int64_t j = j0 + col;
    float db = 0.0f;
    if (j < OC) {
#pragma unroll 4
      for (int n = row_lane; n < N; n += kColRowLanes) db += dout[static_cast<std::int64_t>(n) * OC + j];
    }
    s_db[threadIdx.x] = db;
    column_tree_sum(s_db, nullptr);
    if (row_lane == 0 && j < OC) dbias[j] += s_db[col];
    __syncthreads();  // the next tile overwrites s_db
  }
}

// ---------------------------------------------------------------------------------------------
// Causal softmax, one warp per row.

// The host's float branch: max over j <= t, sum of exp_fast(x - max), each probability
// exp_fast(x - max) * (1 / sum). The exponential is recomputed in the last pass rather than stored
// and re-read: same function of the same input, so the same value, for less memory traffic.
__global__ void softmax_causal_forward_kernel(float* att,  // [rows,T]
                                              int rows, int T) {
  const int lane = lane_id();
  for (std::int64_t r = global_warp(); r < rows; r += grid_warps()) {
    const int t = static_cast<int>(r % T);
    float* row = att + r * T;
    float mx = -INFINITY;
    for (int j = lane; j <= t; j += kWarp) mx = MaxOp{}(mx, row[j]);
    mx = warp_reduce(mx, MaxOp{});
    float s = 0.0f;
    for (int j = lane; j <= t; j += kWarp) s += loom::math::exp_fast(row[j] - mx);
    const float inv = 1.0f / warp_reduce(s, SumOp{});
    for (int j = lane; j < T; j += kWarp) row[j] = j <= t ? loom::math::exp_fast(row[j] - mx) * inv : 0.0f;  // causal mask
  }
}

// In place on datt; each lane reads and writes only its own entries, so no hazard.
__global__ void softmax_causal_backward_kernel(float* datt,       // [rows,T]
                                               const float* att,  // [rows,T]
                                               int rows, int T) {
  const int lane = lane_id();
  for (std::int64_t r = global_warp(); r < rows; r += grid_warps()) {
    const int t = static_cast<int>(r % T);
    float* dr = datt + r * T;
    const float* ar = att + r * T;
    float dot = 0.0f;
    for (int j = lane; j <= t; j += kWarp) dot += ar[j] * dr[j];
    dot = warp_reduce(dot, SumOp{});
    for (int j = lane; j < T; j += kWarp) dr[j] = j <= t ? loom::math::softmax_backward(ar[j], dr[j], dot) : 0.0f;
  }
}

// ---------------------------------------------------------------------------------------------
// Elementwise: GELU, residual. No __restrict__: callers may run them in place.

__global__ void gelu_forward_kernel(float* out,        // [n]
                                    const float* inp,  // [n]
                                    std::int64_t n) {
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) out[i] = loom::math::gelu_forward(inp[i]);
}

__global__ void gelu_backward_kernel(float* dinp,        // [n] (=)
                                     const float* inp,   // [n]
                                     const float* dout,  // [n]
                                     std::int64_t n) {
  for (std::int64_t i = global_thread(); i < n; i += grid_threads())
    dinp[i] = loom::math::gelu_backward(inp[i], dout[i]);
}

__global__ void residual_forward_kernel(float* out,      // [n]
                                        const float* a,  // [n]
                                        const float* b,  // [n]
                                        std::int64_t n) {
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) out[i] = a[i] + b[i];
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy, one block per row.

// A row is read and written one float at a time, or four (float4: a quarter of the load and store
// instructions) when V is a multiple of 4 and the rows are 16-byte aligned.
template <bool Vec4>
struct RowAccess {
  using type = float;
  static constexpr int width = 1;
};
template <>
struct RowAccess<true> {
  using type = float4;
  static constexpr int width = 4;
};
__device__ __forceinline__ float max_into(float m, float a) { return MaxOp{}(m, a); }
__device__ __forceinline__ float max_into(float m, float4 a) { return max_into(max_into(max_into(max_into(m, a.x), a.y), a.z), a.w); }
__device__ __forceinline__ float sum_into(float s, float a) { return s + a; }
__device__ __forceinline__ float sum_into(float s, float4 a) { return s + a.x + a.y + a.z + a.w; }
__device__ __forceinline__ float exp_shifted(float a, float mx) { return loom::math::exp_fast(a - mx); }
__device__ __forceinline__ float4 exp_shifted(float4 a, float mx) {
  return make_float4(exp_shifted(a.x, mx), exp_shifted(a.y, mx), exp_shifted(a.z, mx), exp_shifted(a.w, mx));
}
__device__ __forceinline__ float scaled(float a, float k) { return a * k; }
__device__ __forceinline__ float4 scaled(float4 a, float k) { return make_float4(a.x * k, a.y * k, a.z * k, a.w * k); }

// The host's float branch: max, sum of exp_fast(l - max), probs = exp_fast(l - max) * (1 / sum),
// loss = log(sum) + max - l[target]. Three passes over the row. With Cached the row lives in
// dynamic shared memory ([V] floats): the first pass copies the logits there, the second replaces
// them by their exponentials, the third scales those; the logits come from HBM once instead of three
// times and each exponential is computed once (the host's float branch too stores the exponential
// and then scales it). Each thread reads back only the entries it wrote itself, so the copy needs no
// barrier. The target's logit is read before the barriers that precede the writes, so probs may even
// alias logits.
template <bool Cached, bool Vec4>
__global__ void __launch_bounds__(kCrossEntropyForwardThreads)
    crossentropy_forward_kernel(float* losses,                // [N]
                                float* probs,                 // [N,V]
                                const float* logits,          // [N,V]
                                const std::int32_t* targets,  // [N]
                                int N, int V) {
  using Vec = typename RowAccess<Vec4>::type;
  extern __shared__ float4 row_copy_storage[];  // [V] floats if Cached (float4: 16-byte aligned)
  Vec* row_copy = reinterpret_cast<Vec*>(row_copy_storage);
  __shared__ float shared[kWarp];
  const int Q = V / RowAccess<Vec4>::width;  // accesses per row
  for (int n = blockIdx.x; n < N; n += gridDim.x) {
    const Vec* l = reinterpret_cast<const Vec*>(logits + static_cast<std::int64_t>(n) * V);
    Vec* p = reinterpret_cast<Vec*>(probs + static_cast<std::int64_t>(n) * V);
    const float target_logit = threadIdx.x == 0 ? logits[static_cast<std::int64_t>(n) * V + targets[n]] : 0.0f;
    float mx = -INFINITY;
    for (int q = threadIdx.x; q < Q; q += blockDim.x) {
      const Vec lq = l[q];
      if constexpr (Cached) row_copy[q] = lq;
      mx = max_into(mx, lq);
    }
    mx = block_reduce(mx, -INFINITY, MaxOp{}, shared);
    float s = 0.0f;
    for (int q = threadIdx.x; q < Q; q += blockDim.x) {
      if constexpr (Cached) {
        const Vec e = exp_shifted(row_copy[q], mx);
        row_copy[q] = e;
        s = sum_into(s, e);
      } else {
        s = sum_into(s, exp_shifted(l[q], mx));
      }
    }
    s = block_reduce(s, 0.0f, SumOp{}, shared);
    const float inv = 1.0f / s;
    for (int q = threadIdx.x; q < Q; q += blockDim.x) {
      if constexpr (Cached) p[q] = scaled(row_copy[q], inv);
      else p[q] = scaled(exp_shifted(l[q], mx), inv);
    }
    if (threadIdx.x == 0) losses[n] = logf(s) + mx - target_logit;  // log-sum-exp: exact when p underflows
  }
}

template <bool Cached, bool Vec4>
void launch_crossentropy_forward(LaunchGeometry g, std::size_t shared_bytes, float* losses, float* probs,
                                 const float* logits, const std::int32_t* targets, int N, int V, cudaStream_t stream) {
  if constexpr (Cached)
    check_call(cudaFuncSetAttribute(crossentropy_forward_kernel<Cached, Vec4>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(shared_bytes)),
               "cudaFuncSetAttribute(crossentropy_forward_kernel)");
  crossentropy_forward_kernel<Cached, Vec4><<<g.blocks, g.threads, shared_bytes, stream>>>(losses, probs, logits, targets, N, V);
  check_launch("crossentropy_forward_kernel");
}

// One block per row (no index division); each element is read, then written, by one thread, so
// dlogits may alias probs.
__global__ void crossentropy_backward_kernel(float* dlogits,                // [N,V] (=)
                                             const float* probs,            // [N,V]
                                             const std::int32_t* targets,   // [N]
                                             float dloss, int N, int V, int vocab_begin) {
  for (int n = blockIdx.x; n < N; n += gridDim.x) {
    const float* p = probs + static_cast<std::int64_t>(n) * V;
    float* d = dlogits + static_cast<std::int64_t>(n) * V;
    const int target = targets[n] - vocab_begin;  // outside [0, V): another rank's vocabulary
    for (int v = threadIdx.x; v < V; v += blockDim.x) d[v] = loom::math::crossentropy_dlogit(p[v], v == target, dloss);
  }
}

// Vocabulary-parallel cross-entropy (core/kernels.hpp's crossentropy_row_max / _partial / _finish):
// one block per row; the sum of exponentials is a block reduction in fp64 (the host's row sum is
// sequential: the two agree to rounding).
__global__ void crossentropy_row_max_kernel(float* row_max,       // [N]
                                            const float* logits,  // [N,V]
                                            int N, int V) {
  __shared__ float shared[kWarp];
  for (int n = blockIdx.x; n < N; n += gridDim.x) {
    const float* l = logits + static_cast<std::int64_t>(n) * V;
    float mx = -INFINITY;
    for (int v = threadIdx.x; v < V; v += blockDim.x) mx = MaxOp{}(mx, l[v]);
    mx = block_reduce(mx, -INFINITY, MaxOp{}, shared);
    if (threadIdx.x == 0) row_max[n] = mx;
  }
}

__global__ void crossentropy_partial_kernel(float* probs,                 // [N,V]
                                            double* sum_exp,              // [N]
                                            double* target_logit,         // [N]
                                            const float* logits,          // [N,V]
                                            const float* row_max,         // [N]
                                            const std::int32_t* targets,  // [N]
                                            int N, int V, int vocab_begin) {
  __shared__ double shared[kWarp];
  for (int n = blockIdx.x; n < N; n += gridDim.x) {
    const float* l = logits + static_cast<std::int64_t>(n) * V;
    float* p = probs + static_cast<std::int64_t>(n) * V;
    const float mx = row_max[n];
    const int t = targets[n] - vocab_begin;
    // p may alias l (the model's head overwrites its logits): the target's logit is read before
    // the barrier that every write of p follows.
    const double tl = threadIdx.x == 0 && t >= 0 && t < V ? l[t] : 0.0;
    __syncthreads();
    double s = 0.0;
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
      const float e = loom::math::exp_fast(l[v] - mx);
      p[v] = e;
      s += e;
    }
    s = block_reduce(s, 0.0, SumOp{}, shared);
    if (threadIdx.x == 0) {
      sum_exp[n] = s;
      target_logit[n] = tl;
    }
  }
}

__global__ void crossentropy_finish_kernel(float* losses,               // [N]
                                           float* probs,                // [N,V]
                                           const double* sum_exp,       // [N]
                                           const float* row_max,        // [N]
                                           const double* target_logit,  // [N]
                                           int N, int V) {
  for (int n = blockIdx.x; n < N; n += gridDim.x) {
    float* p = probs + static_cast<std::int64_t>(n) * V;
    const float inv = static_cast<float>(1.0 / sum_exp[n]);
    for (int v = threadIdx.x; v < V; v += blockDim.x) p[v] *= inv;
    if (threadIdx.x == 0) losses[n] = static_cast<float>(log(sum_exp[n]) + row_max[n] - target_logit[n]);
  }
}

// ---------------------------------------------------------------------------------------------
// AdamW.

__global__ void adamw_kernel(float* params,       // [n]
                             float* m,            // [n]
                             float* v,            // [n]
                             const float* grads,  // [n]
                             std::int64_t n, loom::math::AdamWStep<float> step) {
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) {
    float mi = m[i], vi = v[i];
    params[i] = loom::math::adamw(params[i], mi, vi, grads[i], step);
    m[i] = mi;
    v[i] = vi;
  }
}

// ---------------------------------------------------------------------------------------------
// Typed storage: what a DType holds on the device, its compute type, and the exact load / rounded
// store between them (the device side of to_acc / from_acc in core/dtype.hpp).

template <DType D>
struct Storage;
template <>
struct Storage<DType::f32> {
  using type = float;
  using compute = float;
  __device__ static float load(float x) { return x; }
  __device__ static float store(float x) { return x; }
};
template <>
struct Storage<DType::f64> {
  using type = double;
  using compute = double;
  __device__ static double load(double x) { return x; }
  __device__ static double store(double x) { return x; }
};
template <>
struct Storage<DType::bf16> {
  using type = std::uint16_t;
  using compute = float;
  __device__ static float load(std::uint16_t bits) { return loom::math::bf16_value(bits); }
  __device__ static std::uint16_t store(float x) { return loom::math::bf16_bits(x); }  // RNE, NaN kept
};
template <>
struct Storage<DType::f16> {
  using type = std::uint16_t;
  using compute = float;
  __device__ static float load(std::uint16_t bits) { return __half2float(__ushort_as_half(bits)); }
  __device__ static std::uint16_t store(float x) { return __half_as_ushort(__float2half_rn(x)); }  // RNE, inf on overflow
};

template <DType D>
using storage_t = typename Storage<D>::type;
template <DType D>
using compute_t = typename Storage<D>::compute;

// double -> float rounded to odd (core/dtype.hpp's to_float_round_odd): truncated toward zero, the
// last mantissa bit set when inexact, so a following round to nearest even at bf16/fp16 precision
// equals rounding the double directly.
__device__ __forceinline__ float double_to_float_round_odd(double d) {
  if (d != d) return static_cast<float>(d);  // NaN
  const float f = __double2float_rz(d);
  if (static_cast<double>(f) == d) return f;  // exact, inf included
  return __uint_as_float(__float_as_uint(f) | 1u);
}

// core/kernels.hpp's convert<D>(S): same type as is; from fp64 directly; otherwise through float.
template <DType Dst, DType Src>
__device__ __forceinline__ storage_t<Dst> convert(storage_t<Src> x) {
  if constexpr (Dst == Src) {
    return x;
  } else if constexpr (Src == DType::f64 && Dst == DType::f32) {
    return static_cast<float>(x);  // round to nearest even
  } else if constexpr (Src == DType::f64) {
    return Storage<Dst>::store(double_to_float_round_odd(x));
  } else {
    return Storage<Dst>::store(static_cast<compute_t<Dst>>(Storage<Src>::load(x)));
  }
}

template <DType Dst, DType Src>
__global__ void cast_kernel(storage_t<Dst>* dst,        // [n]
                            const storage_t<Src>* src,  // [n]
                            std::int64_t n) {
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) dst[i] = convert<Dst, Src>(src[i]);
}

template <DType D>
__global__ void scale_kernel(storage_t<D>* x,  // [n]
                             compute_t<D> a, std::int64_t n) {
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) x[i] = Storage<D>::store(Storage<D>::load(x[i]) * a);
}

template <DType D>
__global__ void fill_kernel(storage_t<D>* x,  // [n]
                            compute_t<D> value, std::int64_t n) {
  const storage_t<D> stored = Storage<D>::store(value);
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) x[i] = stored;
}

__global__ void axpy_kernel(float* y, float a, const float* x, std::int64_t n) {  // [n], [n]
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) y[i] += a * x[i];  // --fmad=false: two roundings
}

// int8 gradient compression (core/kernels.hpp's int8_*; the per-element rule is math::int8_level).
// The chunk maxima: one block per chunk (a maximum is the same in any order, so the block's tree
// gives the host's value bit for bit).
__global__ void int8_absmax_kernel(float* absmax,   // [chunks] (the finiteness flag: int8_flag_kernel)
                                   const float* x,  // [n]
                                   std::int64_t n, std::int64_t chunk, std::int64_t chunks) {
  __shared__ float shared[kWarp];
  for (std::int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const std::int64_t begin = c * chunk, end = begin + chunk < n ? begin + chunk : n;
    float m = 0.0f;
    for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) m = MaxOp{}(m, loom::math::int8_magnitude(x[i]));
    m = block_reduce(m, 0.0f, MaxOp{}, shared);
    if (threadIdx.x == 0) absmax[c] = m;
  }
}
// flag = 1 if the count of non-finite values is not 0, else 0.
__global__ void int8_flag_kernel(float* flag, const double* nonfinite) {
  if (threadIdx.x == 0 && blockIdx.x == 0) *flag = *nonfinite != 0.0 ? 1.0f : 0.0f;
}
__global__ void int8_quantize_kernel(std::int8_t* q,   // [n]
                                     float* error,     // [n] or null
                                     const float* x,   // [n]
                                     std::int64_t n, std::int64_t chunk,
                                     const float* absmax,  // [chunks + 1]
                                     int levels) {
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) {
    const float step = loom::math::int8_step(absmax[i / chunk], levels);
    const float v = loom::math::int8_level(x[i], step, levels);
    q[i] = static_cast<std::int8_t>(v);
    if (error) error[i] = x[i] - v * step;
  }
}
__global__ void int8_dequantize_kernel(float* x,              // [n]
                                       const std::int8_t* q,  // [n]
                                       std::int64_t n, std::int64_t chunk,
                                       const float* absmax,   // [chunks + 1]: absmax[chunks] > 0 poisons x
                                       std::int64_t chunks, int levels) {
  const bool poisoned = absmax[chunks] > 0.0f;
  for (std::int64_t i = global_thread(); i < n; i += grid_threads())
    x[i] = poisoned ? __int_as_float(0x7fc00000) : static_cast<float>(q[i]) * loom::math::int8_step(absmax[i / chunk], levels);
}

// Reductions. Each thread adds f(x[i]) over its grid-stride elements in double (the square of a
// float is exact in double), the block reduces in a fixed tree, block b writes partials[b].
enum class ReduceOp { sum, sum_squares, nonfinite };

__device__ __forceinline__ bool is_finite(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }
__device__ __forceinline__ bool is_finite(double x) {
  return (static_cast<unsigned long long>(__double_as_longlong(x)) & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
}

template <DType D, ReduceOp Op>
__global__ void reduce_partials_kernel(double* partials,         // [gridDim.x]
                                       const storage_t<D>* x,    // [n]
                                       std::int64_t n) {
  __shared__ double shared[kWarp];
  double acc = 0.0;
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) {
    const compute_t<D> v = Storage<D>::load(x[i]);
    if constexpr (Op == ReduceOp::sum) {
      acc += static_cast<double>(v);
    } else if constexpr (Op == ReduceOp::sum_squares) {
      const double a = static_cast<double>(v);
      acc += a * a;
    } else {
      acc += is_finite(v) ? 0.0 : 1.0;
    }
  }
  acc = block_reduce(acc, 0.0, SumOp{}, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// One block: thread k adds partials k, k + blockDim.x, ... in order, then a fixed tree.
__global__ void reduce_finish_kernel(double* out,              // [1]
                                     const double* partials,   // [count]
                                     int count) {
  __shared__ double shared[kWarp];
  double acc = 0.0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
  acc = block_reduce(acc, 0.0, SumOp{}, shared);
  if (threadIdx.x == 0) *out = acc;
}

template <DType D>
struct TypeTag {
  static constexpr DType value = D;
};

// Calls f(TypeTag<t>{}) for the four floating-point types; throws for any other.
template <class F>
void with_float_type(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::f32: f(TypeTag<DType::f32>{}); return;
    case DType::f64: f(TypeTag<DType::f64>{}); return;
    case DType::bf16: f(TypeTag<DType::bf16>{}); return;
    case DType::f16: f(TypeTag<DType::f16>{}); return;
    default: break;
  }
  throw std::invalid_argument(std::string("loom::cuda::") + op + ": unsupported dtype " + dtype_name(t));
}

template <ReduceOp Op>
void reduce(const char* op, double* out, const void* x, DType type, std::int64_t n, double* scratch,
            cudaStream_t stream) {
  with_float_type(type, op, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    if (n <= 0) {  // the empty sum
      check_call(cudaMemsetAsync(out, 0, sizeof(double), stream), "cudaMemsetAsync (empty reduction)");
      return;
    }
    const LaunchGeometry g = elementwise_geometry(n, kReduceThreads, kReduceMaxBlocks);
    reduce_partials_kernel<D, Op><<<g.blocks, g.threads, 0, stream>>>(scratch, static_cast<const storage_t<D>*>(x), n);
    check_launch("reduce_partials_kernel");
    reduce_finish_kernel<<<1, kReduceThreads, 0, stream>>>(out, scratch, static_cast<int>(g.blocks));
    check_launch("reduce_finish_kernel");
  });
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Launch wrappers.

void encoder_forward(float* out, const std::int32_t* inp, const float* wte, const float* wpe, int B, int T, int C,
                     int vocab_begin, int vocab_end, bool add_pos, cudaStream_t stream) {
  const std::int64_t N = static_cast<std::int64_t>(B) * T;
  if (N <= 0 || C <= 0) return;
  const LaunchGeometry g = rows_per_block_geometry(N, kThreads);
  encoder_forward_kernel<<<g.blocks, g.threads, 0, stream>>>(out, inp, wte, wpe, static_cast<int>(N), T, C, vocab_begin,
                                                             vocab_end, add_pos);
  check_launch("encoder_forward_kernel");
}

void encoder_backward(float* dwte, float* dwpe, const float* dout, const std::int32_t* inp, int B, int T, int C,
                      int vocab_begin, int vocab_end, cudaStream_t stream) {
  const std::int64_t N = static_cast<std::int64_t>(B) * T;
  if (N <= 0 || C <= 0) return;
  const LaunchGeometry gp = rows_per_block_geometry(T, kThreads);
  encoder_backward_wpe_kernel<<<gp.blocks, gp.threads, 0, stream>>>(dwpe, dout, B, T, C);
  check_launch("encoder_backward_wpe_kernel");
  const LaunchGeometry gt = rows_per_warp_geometry(N, kThreads);
  encoder_backward_wte_kernel<<<gt.blocks, gt.threads, 0, stream>>>(dwte, dout, inp, static_cast<int>(N), C, vocab_begin,
                                                                    vocab_end);
  check_launch("encoder_backward_wte_kernel");
}

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int N, int C, cudaStream_t stream) {
  if (N <= 0) return;
  const LaunchGeometry g = rows_per_warp_geometry(N, kThreads);
  layernorm_forward_kernel<<<g.blocks, g.threads, 0, stream>>>(out, mean, rstd, inp, weight, bias, N, C);
  check_launch("layernorm_forward_kernel");
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int N, int C, cudaStream_t stream) {
  if (N <= 0 || C <= 0) return;
  const LaunchGeometry g = rows_per_warp_geometry(N, kThreads);
  layernorm_backward_dinp_kernel<<<g.blocks, g.threads, 0, stream>>>(dinp, dout, inp, weight, mean, rstd, N, C);
  check_launch("layernorm_backward_dinp_kernel");
  const LaunchGeometry gc = rows_per_block_geometry((static_cast<std::int64_t>(C) + kColTile - 1) / kColTile, kColThreads);
  layernorm_backward_params_kernel<<<gc.blocks, gc.threads, 0, stream>>>(dweight, dbias, dout, inp, mean, rstd, N, C);
  check_launch("layernorm_backward_params_kernel");
}

void bias_add(float* out, const float* bias, int N, int OC, cudaStream_t stream) {
  if (N <= 0 || OC <= 0) return;
  const LaunchGeometry g = rows_per_block_geometry(N, kThreads);
  bias_add_kernel<<<g.blocks, g.threads, 0, stream>>>(out, bias, N, OC);
  check_launch("bias_add_kernel");
}

void bias_backward(float* dbias, const float* dout, int N, int OC, cudaStream_t stream) {
  if (N <= 0 || OC <= 0) return;
  const LaunchGeometry g = rows_per_block_geometry((static_cast<std::int64_t>(OC) + kColTile - 1) / kColTile, kColThreads);
  bias_backward_kernel<<<g.blocks, g.threads, 0, stream>>>(dbias, dout, N, OC);
  check_launch("bias_backward_kernel");
}

void softmax_causal_forward(float* att, int rows, int T, cudaStream_t stream) {
  if (rows <= 0 || T <= 0) return;
  const LaunchGeometry g = rows_per_warp_geometry(rows, kThreads);
  softmax_causal_forward_kernel<<<g.blocks, g.threads, 0, stream>>>(att, rows, T);
  check_launch("softmax_causal_forward_kernel");
}

void softmax_causal_backward(float* datt, const float* att, int rows, int T, cudaStream_t stream) {
  if (rows <= 0 || T <= 0) return;
  const LaunchGeometry g = rows_per_warp_geometry(rows, kThreads);
  softmax_causal_backward_kernel<<<g.blocks, g.threads, 0, stream>>>(datt, att, rows, T);
  check_launch("softmax_causal_backward_kernel");
}

void gelu_forward(float* out, const float* inp, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const LaunchGeometry g = elementwise_geometry(n, kThreads);
  gelu_forward_kernel<<<g.blocks, g.threads, 0, stream>>>(out, inp, n);
  check_launch("gelu_forward_kernel");
}

void gelu_backward(float* dinp, const float* inp, const float* dout, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const LaunchGeometry g = elementwise_geometry(n, kThreads);
  gelu_backward_kernel<<<g.blocks, g.threads, 0, stream>>>(dinp, inp, dout, n);
  check_launch("gelu_backward_kernel");
}

void residual_forward(float* out, const float* a, const float* b, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const LaunchGeometry g = elementwise_geometry(n, kThreads);
  residual_forward_kernel<<<g.blocks, g.threads, 0, stream>>>(out, a, b, n);
  check_launch("residual_forward_kernel");
}

void crossentropy_forward(float* losses, float* probs, const float* logits, const std::int32_t* targets, int N, int V,
                          cudaStream_t stream) {
  if (N <= 0 || V <= 0) return;
  const LaunchGeometry g = rows_per_block_geometry(N, kCrossEntropyForwardThreads);
  const bool vec4 = V % 4 == 0 && reinterpret_cast<std::uintptr_t>(logits) % 16 == 0 &&
                    reinterpret_cast<std::uintptr_t>(probs) % 16 == 0;
  // Stage the row in shared memory when it fits this device's per-block limit (opt-in beyond 48 kB).
  int device = 0, optin = 0;
  check_call(cudaGetDevice(&device), "cudaGetDevice");
  check_call(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "cudaDeviceGetAttribute");
  const std::size_t row_bytes = static_cast<std::size_t>(V) * sizeof(float);
  const bool cached = row_bytes + kWarp * sizeof(float) <= static_cast<std::size_t>(optin);
  if (cached && vec4) launch_crossentropy_forward<true, true>(g, row_bytes, losses, probs, logits, targets, N, V, stream);
  else if (cached) launch_crossentropy_forward<true, false>(g, row_bytes, losses, probs, logits, targets, N, V, stream);
  else if (vec4) launch_crossentropy_forward<false, true>(g, 0, losses, probs, logits, targets, N, V, stream);
  else launch_crossentropy_forward<false, false>(g, 0, losses, probs, logits, targets, N, V, stream);
}

void crossentropy_backward(float* dlogits, const float* probs, const std::int32_t* targets, float dloss, int N, int V,
                           int vocab_begin, cudaStream_t stream) {
  if (N <= 0 || V <= 0) return;
  const LaunchGeometry g = rows_per_block_geometry(N, kRowBlockThreads);
  crossentropy_backward_kernel<<<g.blocks, g.threads, 0, stream>>>(dlogits, probs, targets, dloss, N, V, vocab_begin);
  check_launch("crossentropy_backward_kernel");
}

void crossentropy_row_max(float* row_max, const float* logits, int N, int V, cudaStream_t stream) {
  if (N <= 0 || V <= 0) return;
  const LaunchGeometry g = rows_per_block_geometry(N, kRowBlockThreads);
  crossentropy_row_max_kernel<<<g.blocks, g.threads, 0, stream>>>(row_max, logits, N, V);
  check_launch("crossentropy_row_max_kernel");
}

void crossentropy_partial(float* probs, double* sum_exp, double* target_logit, const float* logits,
                          const float* row_max, const std::int32_t* targets, int N, int V, int vocab_begin,
                          cudaStream_t stream) {
  if (N <= 0 || V <= 0) return;
  const LaunchGeometry g = rows_per_block_geometry(N, kRowBlockThreads);
  crossentropy_partial_kernel<<<g.blocks, g.threads, 0, stream>>>(probs, sum_exp, target_logit, logits, row_max,
                                                                   targets, N, V, vocab_begin);
  check_launch("crossentropy_partial_kernel");
}

void crossentropy_finish(float* losses, float* probs, const double* sum_exp, const float* row_max,
                         const double* target_logit, int N, int V, cudaStream_t stream) {
  if (N <= 0 || V <= 0) return;
  const LaunchGeometry g = rows_per_block_geometry(N, kRowBlockThreads);
  crossentropy_finish_kernel<<<g.blocks, g.threads, 0, stream>>>(losses, probs, sum_exp, row_max, target_logit, N, V);
  check_launch("crossentropy_finish_kernel");
}

void adamw_update(float* params, float* m, float* v, const float* grads, std::int64_t n, float lr, float beta1,
                  float beta2, float eps, float weight_decay, std::int64_t t, cudaStream_t stream) {
  if (n <= 0) return;
  // As core/kernels.hpp: std::pow(float, float), in float, on the host.
  const float bc1 = 1.0f - std::pow(beta1, static_cast<float>(t));
  const float bc2 = 1.0f - std::pow(beta2, static_cast<float>(t));
  const loom::math::AdamWStep<float> step{lr, beta1, beta2, eps, weight_decay, bc1, bc2};
  const LaunchGeometry g = elementwise_geometry(n, kThreads);
  adamw_kernel<<<g.blocks, g.threads, 0, stream>>>(params, m, v, grads, n, step);
  check_launch("adamw_kernel");
}

void cast(void* dst, DType dst_type, const void* src, DType src_type, std::int64_t n, cudaStream_t stream) {
  with_float_type(dst_type, "cast", [&](auto dtag) {
    with_float_type(src_type, "cast", [&](auto stag) {
      constexpr DType D = decltype(dtag)::value;
      constexpr DType S = decltype(stag)::value;
      if (n <= 0) return;
      if (D == S && dst == src) return;  // nothing to convert
      const LaunchGeometry g = elementwise_geometry(n, kThreads);
      cast_kernel<D, S><<<g.blocks, g.threads, 0, stream>>>(static_cast<storage_t<D>*>(dst),
                                                            static_cast<const storage_t<S>*>(src), n);
      check_launch("cast_kernel");
    });
  });
}

void scale(void* x, DType type, double a, std::int64_t n, cudaStream_t stream) {
  with_float_type(type, "scale", [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    if (n <= 0) return;
    const LaunchGeometry g = elementwise_geometry(n, kThreads);
    scale_kernel<D><<<g.blocks, g.threads, 0, stream>>>(static_cast<storage_t<D>*>(x), static_cast<compute_t<D>>(a), n);
    check_launch("scale_kernel");
  });
}

void fill(void* x, DType type, double value, std::int64_t n, cudaStream_t stream) {
  with_float_type(type, "fill", [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    if (n <= 0) return;
    const LaunchGeometry g = elementwise_geometry(n, kThreads);
    fill_kernel<D><<<g.blocks, g.threads, 0, stream>>>(static_cast<storage_t<D>*>(x), static_cast<compute_t<D>>(value), n);
    check_launch("fill_kernel");
  });
}

std::int64_t reduce_scratch_count(std::int64_t n) {
  return elementwise_geometry(n, kReduceThreads, kReduceMaxBlocks).blocks;
}

void sum_squares(double* out, const void* x, DType type, std::int64_t n, double* scratch, cudaStream_t stream) {
  reduce<ReduceOp::sum_squares>("sum_squares", out, x, type, n, scratch, stream);
}

void sum(double* out, const void* x, DType type, std::int64_t n, double* scratch, cudaStream_t stream) {
  reduce<ReduceOp::sum>("sum", out, x, type, n, scratch, stream);
}

void count_nonfinite(double* out, const void* x, DType type, std::int64_t n, double* scratch, cudaStream_t stream) {
  reduce<ReduceOp::nonfinite>("count_nonfinite", out, x, type, n, scratch, stream);
}

void axpy(float* y, float a, const float* x, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const LaunchGeometry g = elementwise_geometry(n, kThreads);
  axpy_kernel<<<g.blocks, g.threads, 0, stream>>>(y, a, x, n);
  check_launch("axpy_kernel");
}

void int8_absmax(float* absmax, const float* x, std::int64_t n, std::int64_t chunk, double* nonfinite, double* scratch,
                 cudaStream_t stream) {
  const std::int64_t chunks = (n + chunk - 1) / chunk;
  if (chunks > 0) {
    const LaunchGeometry g = rows_per_block_geometry(chunks, kThreads);
    int8_absmax_kernel<<<g.blocks, g.threads, 0, stream>>>(absmax, x, n, chunk, chunks);
    check_launch("int8_absmax_kernel");
  }
  count_nonfinite(nonfinite, x, DType::f32, n, scratch, stream);
  int8_flag_kernel<<<1, kWarp, 0, stream>>>(absmax + chunks, nonfinite);
  check_launch("int8_flag_kernel");
}

void int8_quantize(std::int8_t* q, float* error, const float* x, std::int64_t n, std::int64_t chunk, const float* absmax,
                   int levels, cudaStream_t stream) {
  if (n <= 0) return;
  const LaunchGeometry g = elementwise_geometry(n, kThreads);
  int8_quantize_kernel<<<g.blocks, g.threads, 0, stream>>>(q, error, x, n, chunk, absmax, levels);
  check_launch("int8_quantize_kernel");
}

void int8_dequantize(float* x, const std::int8_t* q, std::int64_t n, std::int64_t chunk, const float* absmax, int levels,
                     cudaStream_t stream) {
  if (n <= 0) return;
  const LaunchGeometry g = elementwise_geometry(n, kThreads);
  int8_dequantize_kernel<<<g.blocks, g.threads, 0, stream>>>(x, q, n, chunk, absmax, (n + chunk - 1) / chunk, levels);
  check_launch("int8_dequantize_kernel");
}

}  // namespace loom::cuda
