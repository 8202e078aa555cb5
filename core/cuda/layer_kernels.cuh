#pragma once
// The CUDA layer kernels (the twins of core/backend/kernels.hpp; contracts in core/cuda/kernels.cuh) and how
// each operation launches them. Semantics follow core/backend/kernels.hpp; per-element arithmetic comes from
// core/backend/kernel_math.hpp. No atomics anywhere: every sum is reduced in an order fixed by the shapes.
//
// The source compiles for the GPU (nvcc, core/cuda/kernels.cu) and for the host against the CUDA
// emulator (core/cuda/emu/), so a CPU unit test runs these very kernels, with the launch geometry
// below, against their host twins; device facilities come through core/cuda/device_portable.hpp.
// Each operation is a function template over `launch`, a callable
//   launch(name, blocks, threads, dynamic_shared_bytes, kernel, args...)
// that runs kernel<<<blocks, threads, dynamic_shared_bytes, stream>>>(args...) on a device, or
// through the emulator in a test.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "core/cuda/device_portable.hpp"
#include "core/cuda/launch_geometry.hpp"
#include "core/base/dtype.hpp"
#include "core/backend/kernel_math.hpp"

namespace loom::cuda::layer {

constexpr unsigned kWarp = 32;
constexpr unsigned kThreads = 256;          // elementwise and warp-per-row kernels
constexpr unsigned kRowBlockThreads = 512;  // block-per-row kernels along V ~ 50k (cross-entropy backward)
// The cross-entropy forward keeps a whole row (GPT-2: 50304 floats, 201 kB) in shared memory, so
// one block fills an SM: it gets the most threads a block can have.
constexpr unsigned kCrossEntropyForwardThreads = 1024;
// Column sums (bias and LayerNorm parameter gradients), in two passes and without atomics: the
// rows are cut into chunks (column_chunks: a function of the shape and the scratch's size only), a
// block of the first pass owns kColTile = 32 columns of one chunk (a warp reads a row's 32 columns
// as one 128-byte line) and its kColWarps warps take every kColWarps-th row of the chunk; a fixed
// tree over the warps writes the chunk's partial sums to scratch, and the second pass adds each
// column's partials in chunk order. Thousands of blocks for GPT-2's shapes, where one block per
// column tile over all the rows gave C / 8 = 96.
constexpr unsigned kColTile = 32;
constexpr unsigned kColWarps = 8;
constexpr unsigned kColThreads = kColTile * kColWarps;  // 256
constexpr int kColChunkRows = 256;
// Reductions: the block count depends on n only (never on the device), so the partition, and with
// it the result, is the same everywhere; 1024 partials are cheap for the one finishing block.
constexpr unsigned kReduceThreads = 256;
constexpr unsigned kReduceMaxBlocks = 1024;

// ---------------------------------------------------------------------------------------------
// Typed storage: what a DType holds on the device, its compute type, and the exact load / rounded
// store between them (the device side of to_acc / from_acc in core/base/dtype.hpp).

template <DType D>
struct Storage;
// A type that is its own compute type: load and store are the identity.
template <class T>
struct PlainStorage {
  using type = T;
  using compute = T;
  LOOM_DEVICE static T load(T x) { return x; }
  LOOM_DEVICE static T store(T x) { return x; }
};
template <>
struct Storage<DType::f32> : PlainStorage<float> {};
template <>
struct Storage<DType::f64> : PlainStorage<double> {};
template <>
struct Storage<DType::bf16> {
  using type = std::uint16_t;
  using compute = float;
  LOOM_DEVICE static float load(std::uint16_t bits) { return math::bf16_value(bits); }
  LOOM_DEVICE static std::uint16_t store(float x) { return math::bf16_bits(x); }  // RNE, NaN kept
};
template <>
struct Storage<DType::f16> {
  using type = std::uint16_t;
  using compute = float;
  LOOM_DEVICE static float load(std::uint16_t bits) { return dev::f16_bits_to_float(bits); }
  LOOM_DEVICE static std::uint16_t store(float x) { return dev::float_to_f16_bits(x); }  // RNE, inf on overflow
};

template <DType D>
using storage_t = typename Storage<D>::type;
template <DType D>
using compute_t = typename Storage<D>::compute;

// Four computed values stored as D at p (16-byte aligned for fp32, 8-byte for 16 bits): one store
// instruction, each value rounded as Storage<D>::store singly.
template <DType D>
LOOM_DEVICE void store4(storage_t<D>* p, dev::float4 v) {
  if constexpr (D == DType::f32)
    dev::store_float4(p, v);
  else
    dev::store_u16x4(p, Storage<D>::store(v.x), Storage<D>::store(v.y), Storage<D>::store(v.z), Storage<D>::store(v.w));
}

// ---------------------------------------------------------------------------------------------
// Device helpers.

// threadIdx.x, blockDim.x, blockIdx.x and gridDim.x, unsigned as CUDA's are: a loop written
// `for (int i = tid(); i < n; i += threads_per_block())` then compiles as with the built-ins (the
// kernels' register use, measured on the device with them, stays), and divisions and remainders by
// powers of two stay shifts and masks.
LOOM_DEVICE unsigned tid() { return static_cast<unsigned>(dev::thread_x()); }
LOOM_DEVICE unsigned threads_per_block() { return static_cast<unsigned>(dev::block_dim_x()); }
LOOM_DEVICE unsigned block() { return static_cast<unsigned>(dev::block_x()); }
LOOM_DEVICE unsigned blocks() { return static_cast<unsigned>(dev::grid_x()); }
LOOM_DEVICE std::int64_t global_thread() { return static_cast<std::int64_t>(block()) * threads_per_block() + tid(); }
LOOM_DEVICE std::int64_t grid_threads() { return static_cast<std::int64_t>(blocks()) * threads_per_block(); }
LOOM_DEVICE std::int64_t global_warp() { return global_thread() / kWarp; }
LOOM_DEVICE std::int64_t grid_warps() { return grid_threads() / kWarp; }
LOOM_DEVICE int lane_id() { return static_cast<int>(tid() % kWarp); }

struct SumOp {
  template <class A>
  LOOM_DEVICE A operator()(A a, A b) const {
    return a + b;
  }
};
struct MaxOp {  // the host's `x > mx ? x : mx`
  template <class A>
  LOOM_DEVICE A operator()(A a, A b) const {
    return b > a ? b : a;
  }
};

// Butterfly reduction: every lane ends with the same value (each level adds the same two operands
// in both lanes, and + and the max are commutative), so the result is deterministic.
template <class A, class Op>
LOOM_DEVICE A warp_reduce(A v, Op op) {
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) v = op(v, dev::shfl_xor(v, offset));
  return v;
}

// Reduces v over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the
// result. `shared` holds one value per warp; the leading barrier lets consecutive calls reuse it.
template <class A, class Op>
LOOM_DEVICE A block_reduce(A v, A identity, Op op, A* shared) {
  const int lane = lane_id(), warp = static_cast<int>(tid() / kWarp);
  const int warps = static_cast<int>(threads_per_block() / kWarp);
  v = warp_reduce(v, op);
  dev::sync_block();
  if (lane == 0) shared[warp] = v;
  dev::sync_block();
  v = lane < warps ? shared[lane] : identity;
  return warp_reduce(v, op);
}

// ---------------------------------------------------------------------------------------------
// Token + position embedding.

// One block per row (b,t), threads along C.
LOOM_KERNEL void encoder_forward_kernel(float* out,               // [B,T,C]
                                        const std::int32_t* inp,  // [B,T]
                                        const float* wte,         // [V_local,C]
                                        const float* wpe,         // [T,C]
                                        int N, int T, int C, int vocab_begin, int vocab_end, bool add_pos) {
  for (int bt = block(); bt < N; bt += blocks()) {
    const int tok = inp[bt];
    const bool mine = tok >= vocab_begin && tok < vocab_end;
    const float* te = mine ? wte + static_cast<std::int64_t>(tok - vocab_begin) * C : nullptr;
    const float* pe = add_pos ? wpe + static_cast<std::int64_t>(bt % T) * C : nullptr;
    float* o = out + static_cast<std::int64_t>(bt) * C;
    for (int c = tid(); c < C; c += threads_per_block()) o[c] = (mine ? te[c] : 0.0f) + (add_pos ? pe[c] : 0.0f);
  }
}

// dwpe: one block per position t, threads along C; each element adds its B rows in order b = 0..B-1
// (the host's order), so no two threads touch one element.
LOOM_KERNEL void encoder_backward_wpe_kernel(float* dwpe,        // [T,C] (+=)
                                             const float* dout,  // [B,T,C]
                                             int B, int T, int C) {
  for (int t = block(); t < T; t += blocks()) {
    float* g = dwpe + static_cast<std::int64_t>(t) * C;
    for (int c = tid(); c < C; c += threads_per_block()) {
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
LOOM_KERNEL void encoder_backward_wte_kernel(float* dwte,              // [V_local,C] (+=)
                                             const float* dout,        // [B,T,C]
                                             const std::int32_t* inp,  // [B,T]
                                             int N, int C, int vocab_begin, int vocab_end) {
  const int lane = lane_id();
  for (std::int64_t row = global_warp(); row < N; row += grid_warps()) {  // warp-uniform
    const int tok = inp[row];
    if (tok < vocab_begin || tok >= vocab_end) continue;
    bool earlier = false;  // does a row before `row` hold tok? (warp-uniform: a vote)
    for (std::int64_t r0 = 0; r0 < row && !earlier; r0 += kWarp) {
      const std::int64_t r = r0 + lane;
      earlier = dev::any(r < row && inp[r] == tok);
    }
    if (earlier) continue;
    float* g = dwte + static_cast<std::int64_t>(tok - vocab_begin) * C;
    for (std::int64_t r0 = row; r0 < N; r0 += kWarp) {
      const std::int64_t r = r0 + lane;
      unsigned match = dev::ballot(r < N && inp[r] == tok);
      while (match) {  // the matching rows of this step, lowest first
        const int k = dev::first_set(match) - 1;
        match &= match - 1;
        const float* d = dout + (r0 + k) * C;
        for (int c = lane; c < C; c += kWarp) g[c] += d[c];  // each lane owns its columns of g
      }
    }
  }
}

template <class Launch>
void encoder_forward(Launch&& launch, float* out, const std::int32_t* inp, const float* wte, const float* wpe, int B,
                     int T, int C, int vocab_begin, int vocab_end, bool add_pos) {
  const std::int64_t N = static_cast<std::int64_t>(B) * T;
  if (N <= 0 || C <= 0) return;
  const LaunchGeometry g = rows_per_block_geometry(N, kThreads);
  launch("encoder_forward_kernel", g.blocks, g.threads, 0, encoder_forward_kernel, out, inp, wte, wpe,
         static_cast<int>(N), T, C, vocab_begin, vocab_end, add_pos);
}

template <class Launch>
void encoder_backward(Launch&& launch, float* dwte, float* dwpe, const float* dout, const std::int32_t* inp, int B,
                      int T, int C, int vocab_begin, int vocab_end) {
  const std::int64_t N = static_cast<std::int64_t>(B) * T;
  if (N <= 0 || C <= 0) return;
  const LaunchGeometry gp = rows_per_block_geometry(T, kThreads);
  if (dwpe)  // none without learned positions (model.arch = llama)
    launch("encoder_backward_wpe_kernel", gp.blocks, gp.threads, 0, encoder_backward_wpe_kernel, dwpe, dout, B, T, C);
  const LaunchGeometry gt = rows_per_warp_geometry(N, kThreads);
  launch("encoder_backward_wte_kernel", gt.blocks, gt.threads, 0, encoder_backward_wte_kernel, dwte, dout, inp,
         static_cast<int>(N), C, vocab_begin, vocab_end);
}

// ---------------------------------------------------------------------------------------------
// LayerNorm.

// One warp per row: mean, then the sum of squared deviations (two passes, as the host), then the
// normalised output. The row is re-read from L1/L2 rather than held in registers (C is runtime).
// Each lane reads columns lane, lane + 32, ...: the ones it wrote, where a fused kernel wrote x. The
// output is stored as O (a 16-bit O rounded once: the bits of an fp32 output then cast).
template <DType O>
LOOM_DEVICE void layernorm_row(storage_t<O>* o, float* mean, float* rstd, const float* x, const float* weight,
                               const float* bias, int C, int lane) {
  float s = 0.0f;
  for (int c = lane; c < C; c += kWarp) s += x[c];
  const float m = warp_reduce(s, SumOp{}) / static_cast<float>(C);
  float v = 0.0f;
  for (int c = lane; c < C; c += kWarp) {
    const float xc = x[c] - m;
    v += xc * xc;
  }
  const float r = math::layernorm_rstd(warp_reduce(v, SumOp{}) / static_cast<float>(C));
  for (int c = lane; c < C; c += kWarp) o[c] = Storage<O>::store(math::layernorm_out(x[c], m, r, weight[c], bias[c]));
  if (lane == 0) {
    *mean = m;
    *rstd = r;
  }
}

template <DType O>
LOOM_KERNEL void layernorm_forward_kernel(storage_t<O>* out,    // [N,C]
                                          float* mean,          // [N]
                                          float* rstd,          // [N]
                                          const float* inp,     // [N,C]
                                          const float* weight,  // [C]
                                          const float* bias,    // [C]
                                          int N, int C) {
  const int lane = lane_id();
  for (std::int64_t n = global_warp(); n < N; n += grid_warps())
    layernorm_row<O>(out + n * C, mean + n, rstd + n, inp + n * C, weight, bias, C, lane);
}

// residual = a + b, then LayerNorm of it, one warp per row: each lane writes its columns of the sum
// and reads them back in layernorm_row (its own writes: no synchronisation), so the values are those
// of residual_forward_kernel then layernorm_forward_kernel, bit for bit, in one pass fewer.
template <DType O>
LOOM_KERNEL void residual_layernorm_forward_kernel(float* residual,      // [N,C]
                                                   storage_t<O>* out,    // [N,C]
                                                   float* mean,          // [N]
                                                   float* rstd,          // [N]
                                                   const float* a,       // [N,C]
                                                   const float* b,       // [N,C]
                                                   const float* weight,  // [C]
                                                   const float* bias,    // [C]
                                                   int N, int C) {
  const int lane = lane_id();
  for (std::int64_t n = global_warp(); n < N; n += grid_warps()) {
    float* r = residual + n * C;
    const float* x = a + n * C;
    const float* y = b + n * C;
    for (int c = lane; c < C; c += kWarp) r[c] = x[c] + y[c];
    layernorm_row<O>(out + n * C, mean + n, rstd + n, r, weight, bias, C, lane);
  }
}

// dinp, one warp per row: the row's means of dnorm = weight*dout and of dnorm*xhat, then
// dinp += layernorm_dinp per element (each lane reads and writes only its own columns).
LOOM_KERNEL void layernorm_backward_dinp_kernel(float* dinp,          // [N,C] (+=)
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
      dx[c] += math::layernorm_dinp(x[c], m, r, weight[c], d[c], dnorm_mean, dnorm_norm_mean);
  }
}

// The column sums' partition: chunks of `rows` rows, `chunks` of them (at least 1), as many as
// kColChunkRows-row chunks give, fewer where the scratch (sums x OC floats per chunk) holds fewer.
struct ColumnChunks {
  int rows;
  int chunks;
};
inline ColumnChunks column_chunks(int N, int OC, int sums, std::int64_t scratch_floats) {
  std::int64_t chunks = (static_cast<std::int64_t>(N) + kColChunkRows - 1) / kColChunkRows;
  const std::int64_t fit = scratch_floats / (static_cast<std::int64_t>(sums) * OC);
  if (chunks > fit) chunks = fit;
  if (chunks < 1) chunks = 1;
  const std::int64_t rows = (N + chunks - 1) / chunks;
  return ColumnChunks{static_cast<int>(rows), static_cast<int>((N + rows - 1) / rows)};
}
// The scratch that holds every chunk's partials uncapped (what a caller without a fixed workspace
// allocates): sums x OC floats per kColChunkRows-row chunk.
inline std::int64_t column_scratch_floats(int N, int OC, int sums) {
  const std::int64_t chunks = (static_cast<std::int64_t>(N) + kColChunkRows - 1) / kColChunkRows;
  return (chunks < 1 ? 1 : chunks) * sums * static_cast<std::int64_t>(OC);
}

// What a row element adds: dout's own (bias: Backend::bias_backward; bias_cast: the same, with dout's
// copy in the products' 16-bit type written on the way, for matmul_backward); dpre = gelu'(pre) dout, each
// written on the way (gelu_bias: Backend::gelu_bias_backward; pre and dout read once, where
// gelu_backward then bias_backward read dpre back); dout and xhat * dout (layernorm: the bias's
// and the weight's gradients of Backend::layernorm_backward).
// x * rstd * dout (rmsnorm: the weight's gradient of Backend::rmsnorm_backward).
enum class ColumnSum { bias, bias_cast, gelu_bias, layernorm, rmsnorm };

// partials[chunk][s][OC]: s = 0 the sums of dout (or dpre), s = 1 (layernorm) those of xhat * dout.
// dpre is stored as O; the sums add the fp32 values.
template <ColumnSum Mode, DType O = DType::f32>
LOOM_KERNEL void LOOM_LAUNCH_BOUNDS(kColThreads) column_partials_kernel(float* partials,     // [chunks, sums, OC]
                                                                        storage_t<O>* dpre,  // [N,OC] (=), gelu_bias
                                                                        const float* dout,   // [N,OC]
                                                                        const float* x,      // [N,OC] pre or inp
                                                                        const float* mean,   // [N], layernorm
                                                                        const float* rstd,   // [N], layernorm
                                                                        int N, int OC, int chunk_rows, int chunks) {
  constexpr int sums = Mode == ColumnSum::layernorm ? 2 : 1;
  LOOM_SHARED_ARRAY(float, s0, kColThreads);
  LOOM_SHARED_ARRAY(float, s1, kColThreads);
  const int lane = lane_id(), warp = static_cast<int>(tid() / kWarp);
  const int tiles = static_cast<int>((static_cast<unsigned>(OC) + kColTile - 1) / kColTile);
  const std::int64_t work = static_cast<std::int64_t>(tiles) * chunks;
  for (std::int64_t w = block(); w < work; w += blocks()) {  // block-uniform
    const int chunk = static_cast<int>(w / tiles);
    const std::int64_t j = static_cast<std::int64_t>(w % tiles) * kColTile + lane;
    const int r0 = chunk * chunk_rows, r1 = r0 + chunk_rows < N ? r0 + chunk_rows : N;
    float a0 = 0.0f, a1 = 0.0f;
    if (j < OC) {
      LOOM_UNROLL(4)
      for (int n = r0 + warp; n < r1; n += static_cast<int>(kColWarps)) {
        const std::int64_t i = static_cast<std::int64_t>(n) * OC + j;
        float v = dout[i];
        if constexpr (Mode == ColumnSum::gelu_bias) {
          v = math::gelu_backward(x[i], v);
          dpre[i] = Storage<O>::store(v);
        }
        if constexpr (Mode == ColumnSum::bias_cast) dpre[i] = Storage<O>::store(v);
        if constexpr (Mode == ColumnSum::rmsnorm) v = x[i] * rstd[n] * v;
        a0 += v;
        if constexpr (Mode == ColumnSum::layernorm) a1 += (x[i] - mean[n]) * rstd[n] * v;
      }
    }
    s0[tid()] = a0;
    if constexpr (sums == 2) s1[tid()] = a1;
    dev::sync_block();
    if (warp == 0 && j < OC) {
      float t0 = s0[lane], t1 = sums == 2 ? s1[lane] : 0.0f;
      for (unsigned k = 1; k < kColWarps; ++k) {
        t0 += s0[k * kWarp + static_cast<unsigned>(lane)];
        if constexpr (sums == 2) t1 += s1[k * kWarp + static_cast<unsigned>(lane)];
      }
      float* p = partials + static_cast<std::int64_t>(chunk) * sums * OC;
      p[j] = t0;
      if constexpr (sums == 2) p[OC + j] = t1;
    }
    dev::sync_block();  // the next work item overwrites s0, s1
  }
}

// out0[j] += the partials' sums s = 0, out1[j] += those of s = 1 (sums 2), chunk by chunk in order.
LOOM_KERNEL void column_finish_kernel(float* out0,            // [OC] (+=)
                                      float* out1,            // [OC] (+=), sums 2
                                      const float* partials,  // [chunks, sums, OC]
                                      int OC, int sums, int chunks) {
  const std::int64_t stride = static_cast<std::int64_t>(sums) * OC;
  for (std::int64_t j = global_thread(); j < OC; j += grid_threads()) {
    float a0 = 0.0f, a1 = 0.0f;
    LOOM_UNROLL(8)
    for (int c = 0; c < chunks; ++c) {
      a0 += partials[c * stride + j];
      if (sums == 2) a1 += partials[c * stride + OC + j];
    }
    out0[j] += a0;
    if (sums == 2) out1[j] += a1;
  }
}

// The two passes; scratch holds scratch_floats floats, at least sums x OC (one chunk).
template <ColumnSum Mode, DType O = DType::f32, class Launch>
void column_sums(Launch&& launch, const char* name, float* out0, float* out1, storage_t<O>* dpre, const float* dout,
                 const float* x, const float* mean, const float* rstd, int N, int OC, float* scratch,
                 std::int64_t scratch_floats) {
  constexpr int sums = Mode == ColumnSum::layernorm ? 2 : 1;
  if (scratch_floats < static_cast<std::int64_t>(sums) * OC)
    throw std::invalid_argument(std::string(name) + ": the column sums' scratch holds " +
                                std::to_string(scratch_floats) + " floats, fewer than " +
                                std::to_string(static_cast<std::int64_t>(sums) * OC) + " (one chunk's partials)");
  const ColumnChunks cc = column_chunks(N, OC, sums, scratch_floats);
  const std::int64_t tiles = (static_cast<std::int64_t>(OC) + kColTile - 1) / kColTile;
  const LaunchGeometry g = rows_per_block_geometry(tiles * cc.chunks, kColThreads);
  launch(name, g.blocks, g.threads, 0, column_partials_kernel<Mode, O>, scratch, dpre, dout, x, mean, rstd, N, OC,
         cc.rows, cc.chunks);
  const LaunchGeometry f = elementwise_geometry(OC, kThreads);
  launch("column_finish_kernel", f.blocks, f.threads, 0, column_finish_kernel, out0, out1,
         static_cast<const float*>(scratch), OC, sums, cc.chunks);
}

// out stored as O (fp32 by default; bf16 or fp16, the next product's operand, rounded once).
template <DType O = DType::f32, class Launch>
void layernorm_forward(Launch&& launch, storage_t<O>* out, float* mean, float* rstd, const float* inp,
                       const float* weight, const float* bias, int N, int C) {
  if (N <= 0) return;
  const LaunchGeometry g = rows_per_warp_geometry(N, kThreads);
  launch("layernorm_forward_kernel", g.blocks, g.threads, 0, layernorm_forward_kernel<O>, out, mean, rstd, inp, weight,
         bias, N, C);
}

template <DType O = DType::f32, class Launch>
void residual_layernorm_forward(Launch&& launch, float* residual, storage_t<O>* out, float* mean, float* rstd,
                                const float* a, const float* b, const float* weight, const float* bias, int N, int C) {
  if (N <= 0) return;
  const LaunchGeometry g = rows_per_warp_geometry(N, kThreads);
  launch("residual_layernorm_forward_kernel", g.blocks, g.threads, 0, residual_layernorm_forward_kernel<O>, residual,
         out, mean, rstd, a, b, weight, bias, N, C);
}

// scratch: column_sums' (the parameters' partial sums), 2 x C floats at least.
template <class Launch>
void layernorm_backward(Launch&& launch, float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int N, int C, float* scratch,
                        std::int64_t scratch_floats) {
  if (N <= 0 || C <= 0) return;
  const LaunchGeometry g = rows_per_warp_geometry(N, kThreads);
  launch("layernorm_backward_dinp_kernel", g.blocks, g.threads, 0, layernorm_backward_dinp_kernel, dinp, dout, inp,
         weight, mean, rstd, N, C);
  column_sums<ColumnSum::layernorm>(launch, "layernorm_backward_params_kernel", dbias, dweight, nullptr, dout, inp,
                                    mean, rstd, N, C, scratch, scratch_floats);
}

// ---------------------------------------------------------------------------------------------
// Linear-layer bias.

// One block per row, threads along OC: no index division.
LOOM_KERNEL void bias_add_kernel(float* out,         // [N,OC]
                                 const float* bias,  // [OC]
                                 int N, int OC) {
  for (int n = block(); n < N; n += blocks()) {
    float* o = out + static_cast<std::int64_t>(n) * OC;
    for (int j = tid(); j < OC; j += threads_per_block()) o[j] += bias[j];
  }
}

template <class Launch>
void bias_add(Launch&& launch, float* out, const float* bias, int N, int OC) {
  if (N <= 0 || OC <= 0) return;
  const LaunchGeometry g = rows_per_block_geometry(N, kThreads);
  launch("bias_add_kernel", g.blocks, g.threads, 0, bias_add_kernel, out, bias, N, OC);
}

// scratch: column_sums' (OC floats at least).
template <class Launch>
void bias_backward(Launch&& launch, float* dbias, const float* dout, int N, int OC, float* scratch,
                   std::int64_t scratch_floats) {
  if (N <= 0 || OC <= 0) return;
  column_sums<ColumnSum::bias>(launch, "bias_backward_kernel", dbias, nullptr, nullptr, dout, nullptr, nullptr, nullptr,
                               N, OC, scratch, scratch_floats);
}

// ---------------------------------------------------------------------------------------------
// Causal softmax, one warp per row.

// The host's float branch: max over j <= t, sum of exp_fast(x - max), each probability
// exp_fast(x - max) * (1 / sum). The exponential is recomputed in the last pass rather than stored
// and re-read: same function of the same input, so the same value, for less memory traffic.
LOOM_KERNEL void softmax_causal_forward_kernel(float* att,  // [rows,T]
                                               int rows, int T) {
  const int lane = lane_id();
  for (std::int64_t r = global_warp(); r < rows; r += grid_warps()) {
    const int t = static_cast<int>(r % T);
    float* row = att + r * T;
    float mx = -INFINITY;
    for (int j = lane; j <= t; j += kWarp) mx = MaxOp{}(mx, row[j]);
    mx = warp_reduce(mx, MaxOp{});
    float s = 0.0f;
    for (int j = lane; j <= t; j += kWarp) s += math::exp_fast(row[j] - mx);
    const float inv = 1.0f / warp_reduce(s, SumOp{});
    for (int j = lane; j < T; j += kWarp) row[j] = j <= t ? math::exp_fast(row[j] - mx) * inv : 0.0f;  // causal mask
  }
}

// In place on datt; each lane reads and writes only its own entries, so no hazard.
LOOM_KERNEL void softmax_causal_backward_kernel(float* datt,       // [rows,T]
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
    for (int j = lane; j < T; j += kWarp) dr[j] = j <= t ? math::softmax_backward(ar[j], dr[j], dot) : 0.0f;
  }
}

template <class Launch>
void softmax_causal_forward(Launch&& launch, float* att, int rows, int T) {
  if (rows <= 0 || T <= 0) return;
  const LaunchGeometry g = rows_per_warp_geometry(rows, kThreads);
  launch("softmax_causal_forward_kernel", g.blocks, g.threads, 0, softmax_causal_forward_kernel, att, rows, T);
}

template <class Launch>
void softmax_causal_backward(Launch&& launch, float* datt, const float* att, int rows, int T) {
  if (rows <= 0 || T <= 0) return;
  const LaunchGeometry g = rows_per_warp_geometry(rows, kThreads);
  launch("softmax_causal_backward_kernel", g.blocks, g.threads, 0, softmax_causal_backward_kernel, datt, att, rows, T);
}

// ---------------------------------------------------------------------------------------------
// Elementwise: GELU, residual. No __restrict__: callers may run them in place (each thread reads its
// elements before it writes them). With Vec4 (every fp32 pointer 16-byte aligned, a 16-bit output
// 8-byte aligned) a thread takes four elements at a time, one 16-byte load per operand and one
// store: a quarter of the memory instructions, the same per-element arithmetic and so the same bits;
// the n % 4 last ones singly. GELU's output may be stored as O (bf16 or fp16: the next product's
// operand, rounded once).

inline bool aligned16(const void* p) {  // host side: picks the kernel
  return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0;
}
// Whether four elements of type D at p can be stored at once (store4).
template <DType D>
inline bool aligned_store4(const void* p) {
  return (reinterpret_cast<std::uintptr_t>(p) & (D == DType::f32 ? 15u : 7u)) == 0;
}

template <DType O, bool Vec4>
LOOM_KERNEL void gelu_forward_kernel(storage_t<O>* out,  // [n]
                                     const float* inp,   // [n]
                                     std::int64_t n) {
  std::int64_t begin = 0;
  if constexpr (Vec4) {
    const std::int64_t n4 = n / 4;
    for (std::int64_t i = global_thread(); i < n4; i += grid_threads()) {
      const dev::float4 x = dev::load_float4(inp + 4 * i);
      store4<O>(out + 4 * i, dev::make_float4(math::gelu_forward(x.x), math::gelu_forward(x.y), math::gelu_forward(x.z),
                                              math::gelu_forward(x.w)));
    }
    begin = 4 * n4;
  }
  for (std::int64_t i = begin + global_thread(); i < n; i += grid_threads())
    out[i] = Storage<O>::store(math::gelu_forward(inp[i]));
}

template <DType O, bool Vec4>
LOOM_KERNEL void gelu_backward_kernel(storage_t<O>* dinp,  // [n] (=)
                                      const float* inp,    // [n]
                                      const float* dout,   // [n]
                                      std::int64_t n) {
  std::int64_t begin = 0;
  if constexpr (Vec4) {
    const std::int64_t n4 = n / 4;
    for (std::int64_t i = global_thread(); i < n4; i += grid_threads()) {
      const dev::float4 x = dev::load_float4(inp + 4 * i), d = dev::load_float4(dout + 4 * i);
      store4<O>(dinp + 4 * i, dev::make_float4(math::gelu_backward(x.x, d.x), math::gelu_backward(x.y, d.y),
                                               math::gelu_backward(x.z, d.z), math::gelu_backward(x.w, d.w)));
    }
    begin = 4 * n4;
  }
  for (std::int64_t i = begin + global_thread(); i < n; i += grid_threads())
    dinp[i] = Storage<O>::store(math::gelu_backward(inp[i], dout[i]));
}

template <bool Vec4>
LOOM_KERNEL void residual_forward_kernel(float* out,      // [n]
                                         const float* a,  // [n]
                                         const float* b,  // [n]
                                         std::int64_t n) {
  std::int64_t begin = 0;
  if constexpr (Vec4) {
    const std::int64_t n4 = n / 4;
    for (std::int64_t i = global_thread(); i < n4; i += grid_threads()) {
      const dev::float4 x = dev::load_float4(a + 4 * i), y = dev::load_float4(b + 4 * i);
      dev::store_float4(out + 4 * i, dev::make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w));
    }
    begin = 4 * n4;
  }
  for (std::int64_t i = begin + global_thread(); i < n; i += grid_threads()) out[i] = a[i] + b[i];
}

// The grid of an elementwise kernel: over n / 4 float4s with Vec4, else over n.
inline LaunchGeometry elementwise_vec_geometry(std::int64_t n, bool vec4) {
  return elementwise_geometry(vec4 ? (n + 3) / 4 : n, kThreads);
}

// Launches kernel4 (the Vec4 instance) on the grid of n / 4 float4s where vec4, else kernel1 over n.
template <class Launch, class Kernel4, class Kernel1, class... Args>
void launch_elementwise(Launch&& launch, const char* name, std::int64_t n, bool vec4, Kernel4 kernel4, Kernel1 kernel1,
                        Args... args) {
  const LaunchGeometry g = elementwise_vec_geometry(n, vec4);
  if (vec4)
    launch(name, g.blocks, g.threads, 0, kernel4, args...);
  else
    launch(name, g.blocks, g.threads, 0, kernel1, args...);
}

template <DType O = DType::f32, class Launch>
void gelu_forward(Launch&& launch, storage_t<O>* out, const float* inp, std::int64_t n) {
  if (n <= 0) return;
  launch_elementwise(launch, "gelu_forward_kernel", n, aligned_store4<O>(out) && aligned16(inp),
                     gelu_forward_kernel<O, true>, gelu_forward_kernel<O, false>, out, inp, n);
}

template <DType O = DType::f32, class Launch>
void gelu_backward(Launch&& launch, storage_t<O>* dinp, const float* inp, const float* dout, std::int64_t n) {
  if (n <= 0) return;
  launch_elementwise(launch, "gelu_backward_kernel", n, aligned_store4<O>(dinp) && aligned16(inp) && aligned16(dout),
                     gelu_backward_kernel<O, true>, gelu_backward_kernel<O, false>, dinp, inp, dout, n);
}

// dbias null: gelu_backward over the N * OC elements; else dpre and the bias's column sums in one
// pass (scratch: column_sums', OC floats at least).
// dbias[j] += sum_n dout[n,j], as bias_backward, and copy = dout stored as O (the product's 16-bit
// operand), in the same pass over dout.
template <DType O, class Launch>
void bias_backward_cast(Launch&& launch, float* dbias, storage_t<O>* copy, const float* dout, int N, int OC,
                        float* scratch, std::int64_t scratch_floats) {
  if (N <= 0 || OC <= 0) return;
  column_sums<ColumnSum::bias_cast, O>(launch, "bias_backward_cast_kernel", dbias, nullptr, copy, dout, nullptr,
                                       nullptr, nullptr, N, OC, scratch, scratch_floats);
}

// dpre stored as O; dbias sums the fp32 values (a 16-bit dpre, the next product's operand, changes
// nothing in dbias).
template <DType O = DType::f32, class Launch>
void gelu_bias_backward(Launch&& launch, storage_t<O>* dpre, float* dbias, const float* pre, const float* dout, int N,
                        int OC, float* scratch, std::int64_t scratch_floats) {
  if (N <= 0 || OC <= 0) return;
  if (!dbias) return gelu_backward<O>(launch, dpre, pre, dout, static_cast<std::int64_t>(N) * OC);
  column_sums<ColumnSum::gelu_bias, O>(launch, "gelu_bias_backward_kernel", dbias, nullptr, dpre, dout, pre, nullptr,
                                       nullptr, N, OC, scratch, scratch_floats);
}

template <class Launch>
void residual_forward(Launch&& launch, float* out, const float* a, const float* b, std::int64_t n) {
  if (n <= 0) return;
  launch_elementwise(launch, "residual_forward_kernel", n, aligned16(out) && aligned16(a) && aligned16(b),
                     residual_forward_kernel<true>, residual_forward_kernel<false>, out, a, b, n);
}

// ---------------------------------------------------------------------------------------------
// Llama's block: RMSNorm (one warp per row, as LayerNorm), rotary positions with grouped-query heads
// (one thread per (row, query head)), SwiGLU (elementwise).

template <DType O>
LOOM_KERNEL void rmsnorm_forward_kernel(storage_t<O>* out,    // [N,C]
                                        float* rstd,          // [N]
                                        const float* inp,     // [N,C]
                                        const float* weight,  // [C]
                                        int N, int C, float eps) {
  const int lane = lane_id();
  for (std::int64_t n = global_warp(); n < N; n += grid_warps()) {
    const float* x = inp + n * C;
    float s = 0.0f;
    for (int c = lane; c < C; c += kWarp) s += x[c] * x[c];
    const float r = math::rmsnorm_rstd(warp_reduce(s, SumOp{}) / static_cast<float>(C), eps);
    storage_t<O>* o = out + n * C;
    for (int c = lane; c < C; c += kWarp) o[c] = Storage<O>::store(math::rmsnorm_out(x[c], r, weight[c]));
    if (lane == 0) rstd[n] = r;
  }
}

LOOM_KERNEL void rmsnorm_backward_dinp_kernel(float* dinp,          // [N,C] (+=)
                                              const float* dout,    // [N,C]
                                              const float* inp,     // [N,C]
                                              const float* weight,  // [C]
                                              const float* rstd,    // [N]
                                              int N, int C) {
  const int lane = lane_id();
  for (std::int64_t n = global_warp(); n < N; n += grid_warps()) {
    const float *d = dout + n * C, *x = inp + n * C;
    float* dx = dinp + n * C;
    float s = 0.0f;
    for (int c = lane; c < C; c += kWarp) s += weight[c] * d[c] * x[c];
    const float dot = warp_reduce(s, SumOp{}) / static_cast<float>(C), r = rstd[n];
    for (int c = lane; c < C; c += kWarp) dx[c] += math::rmsnorm_dinp(x[c], r, weight[c], d[c], dot);
  }
}

// One thread per (row n, query head h): its q and k turned, its kv head's k and v copied beside it.
LOOM_KERNEL void rope_gqa_forward_kernel(float* qkv, const float* q, const float* k, const float* v, int N, int T,
                                         int NH, int KV, int hs, int head0, int kv0, int group, float theta) {
  const std::int64_t C = static_cast<std::int64_t>(NH) * hs, CK = static_cast<std::int64_t>(KV) * hs;
  for (std::int64_t w = global_thread(); w < static_cast<std::int64_t>(N) * NH; w += grid_threads()) {
    const std::int64_t n = w / NH;
    const int h = static_cast<int>(w % NH), t = static_cast<int>(n % T), j = (head0 + h) / group - kv0;
    const float* qh = q + n * C + static_cast<std::int64_t>(h) * hs;
    const float* kh = k + n * CK + static_cast<std::int64_t>(j) * hs;
    const float* vh = v + n * CK + static_cast<std::int64_t>(j) * hs;
    float* oq = qkv + n * 3 * C + static_cast<std::int64_t>(h) * hs;
    float *ok = oq + C, *ov = oq + 2 * C;
    for (int i = 0; i < hs / 2; ++i) {
      float c, s;
      math::rope_cos_sin(t, i, hs, static_cast<double>(theta), c, s);
      float a = qh[2 * i], b = qh[2 * i + 1];
      math::rope_turn(a, b, c, s);
      oq[2 * i] = a;
      oq[2 * i + 1] = b;
      a = kh[2 * i];
      b = kh[2 * i + 1];
      math::rope_turn(a, b, c, s);
      ok[2 * i] = a;
      ok[2 * i + 1] = b;
    }
    for (int e = 0; e < hs; ++e) ov[e] = vh[e];
  }
}

// One thread per (row n, held kv head j): dk and dv of j summed over its readers in query-head order
// (the host's order); one per (row, query head) for dq.
LOOM_KERNEL void rope_gqa_backward_kernel(float* dq, float* dk, float* dv, const float* dqkv, int N, int T, int NH,
                                          int KV, int hs, int head0, int kv0, int group, float theta) {
  const std::int64_t C = static_cast<std::int64_t>(NH) * hs, CK = static_cast<std::int64_t>(KV) * hs;
  const std::int64_t work_q = static_cast<std::int64_t>(N) * NH, work = work_q + static_cast<std::int64_t>(N) * KV;
  for (std::int64_t w = global_thread(); w < work; w += grid_threads()) {
    if (w < work_q) {
      const std::int64_t n = w / NH;
      const int h = static_cast<int>(w % NH), t = static_cast<int>(n % T);
      const float* g = dqkv + n * 3 * C + static_cast<std::int64_t>(h) * hs;
      float* o = dq + n * C + static_cast<std::int64_t>(h) * hs;
      for (int i = 0; i < hs / 2; ++i) {
        float c, s;
        math::rope_cos_sin(t, i, hs, static_cast<double>(theta), c, s);
        float a = g[2 * i], b = g[2 * i + 1];
        math::rope_turn_back(a, b, c, s);
        o[2 * i] = a;
        o[2 * i + 1] = b;
      }
      continue;
    }
    const std::int64_t n = (w - work_q) / KV;
    const int j = static_cast<int>((w - work_q) % KV), t = static_cast<int>(n % T);
    float* ok = dk + n * CK + static_cast<std::int64_t>(j) * hs;
    float* ov = dv + n * CK + static_cast<std::int64_t>(j) * hs;
    for (int e = 0; e < hs; ++e) ok[e] = ov[e] = 0.0f;
    for (int h = 0; h < NH; ++h) {
      if ((head0 + h) / group - kv0 != j) continue;
      const float* gk = dqkv + n * 3 * C + C + static_cast<std::int64_t>(h) * hs;
      const float* gv = gk + C;
      for (int i = 0; i < hs / 2; ++i) {
        float c, s;
        math::rope_cos_sin(t, i, hs, static_cast<double>(theta), c, s);
        float a = gk[2 * i], b = gk[2 * i + 1];
        math::rope_turn_back(a, b, c, s);
        ok[2 * i] += a;
        ok[2 * i + 1] += b;
      }
      for (int e = 0; e < hs; ++e) ov[e] += gv[e];
    }
  }
}

template <DType O>
LOOM_KERNEL void swiglu_forward_kernel(storage_t<O>* out, const float* gate, const float* up, std::int64_t n) {
  for (std::int64_t i = global_thread(); i < n; i += grid_threads())
    out[i] = Storage<O>::store(math::swiglu_forward(gate[i], up[i]));
}

template <DType O>
LOOM_KERNEL void swiglu_backward_kernel(storage_t<O>* dgate, storage_t<O>* dup, const float* dout, const float* gate,
                                        const float* up, std::int64_t n) {
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) {
    dgate[i] = Storage<O>::store(math::swiglu_dgate(gate[i], up[i], dout[i]));
    dup[i] = Storage<O>::store(math::swiglu_dup(gate[i], dout[i]));
  }
}

template <DType O = DType::f32, class Launch>
void rmsnorm_forward(Launch&& launch, storage_t<O>* out, float* rstd, const float* inp, const float* weight, int N,
                     int C, float eps) {
  if (N <= 0) return;
  const LaunchGeometry g = rows_per_warp_geometry(N, kThreads);
  launch("rmsnorm_forward_kernel", g.blocks, g.threads, 0, rmsnorm_forward_kernel<O>, out, rstd, inp, weight, N, C,
         eps);
}

// scratch: column_sums' (the weight's partial sums), C floats at least.
template <class Launch>
void rmsnorm_backward(Launch&& launch, float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int N, int C, float* scratch,
                      std::int64_t scratch_floats) {
  if (N <= 0 || C <= 0) return;
  const LaunchGeometry g = rows_per_warp_geometry(N, kThreads);
  launch("rmsnorm_backward_dinp_kernel", g.blocks, g.threads, 0, rmsnorm_backward_dinp_kernel, dinp, dout, inp, weight,
         rstd, N, C);
  column_sums<ColumnSum::rmsnorm>(launch, "rmsnorm_backward_weight_kernel", dweight, nullptr, nullptr, dout, inp,
                                  nullptr, rstd, N, C, scratch, scratch_floats);
}

template <class Launch>
void rope_gqa_forward(Launch&& launch, float* qkv, const float* q, const float* k, const float* v, int N, int T, int NH,
                      int KV, int hs, int head0, int kv0, int group, float theta) {
  if (N <= 0 || NH <= 0) return;
  const LaunchGeometry g = elementwise_geometry(static_cast<std::int64_t>(N) * NH, kThreads);
  launch("rope_gqa_forward_kernel", g.blocks, g.threads, 0, rope_gqa_forward_kernel, qkv, q, k, v, N, T, NH, KV, hs,
         head0, kv0, group, theta);
}

template <class Launch>
void rope_gqa_backward(Launch&& launch, float* dq, float* dk, float* dv, const float* dqkv, int N, int T, int NH,
                       int KV, int hs, int head0, int kv0, int group, float theta) {
  if (N <= 0 || NH <= 0) return;
  const LaunchGeometry g = elementwise_geometry(static_cast<std::int64_t>(N) * (NH + KV), kThreads);
  launch("rope_gqa_backward_kernel", g.blocks, g.threads, 0, rope_gqa_backward_kernel, dq, dk, dv, dqkv, N, T, NH, KV,
         hs, head0, kv0, group, theta);
}

template <DType O = DType::f32, class Launch>
void swiglu_forward(Launch&& launch, storage_t<O>* out, const float* gate, const float* up, std::int64_t n) {
  if (n <= 0) return;
  const LaunchGeometry g = elementwise_geometry(n, kThreads);
  launch("swiglu_forward_kernel", g.blocks, g.threads, 0, swiglu_forward_kernel<O>, out, gate, up, n);
}

template <DType O = DType::f32, class Launch>
void swiglu_backward(Launch&& launch, storage_t<O>* dgate, storage_t<O>* dup, const float* dout, const float* gate,
                     const float* up, std::int64_t n) {
  if (n <= 0) return;
  const LaunchGeometry g = elementwise_geometry(n, kThreads);
  launch("swiglu_backward_kernel", g.blocks, g.threads, 0, swiglu_backward_kernel<O>, dgate, dup, dout, gate, up, n);
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
  using type = dev::float4;
  static constexpr int width = 4;
};
LOOM_DEVICE float max_into(float m, float a) { return MaxOp{}(m, a); }
LOOM_DEVICE float max_into(float m, dev::float4 a) {
  return max_into(max_into(max_into(max_into(m, a.x), a.y), a.z), a.w);
}
LOOM_DEVICE float sum_into(float s, float a) { return s + a; }
LOOM_DEVICE float sum_into(float s, dev::float4 a) { return s + a.x + a.y + a.z + a.w; }
LOOM_DEVICE float exp_shifted(float a, float mx) { return math::exp_fast(a - mx); }
LOOM_DEVICE dev::float4 exp_shifted(dev::float4 a, float mx) {
  return dev::make_float4(exp_shifted(a.x, mx), exp_shifted(a.y, mx), exp_shifted(a.z, mx), exp_shifted(a.w, mx));
}
LOOM_DEVICE float scaled(float a, float k) { return a * k; }
LOOM_DEVICE dev::float4 scaled(dev::float4 a, float k) { return dev::make_float4(a.x * k, a.y * k, a.z * k, a.w * k); }

// One computed value (or four, at column 4q) stored as O at column q of a row.
template <DType O>
LOOM_DEVICE void put_row(storage_t<O>* row, int q, float x) {
  row[q] = Storage<O>::store(x);
}
template <DType O>
LOOM_DEVICE void put_row(storage_t<O>* row, int q, dev::float4 x) {
  store4<O>(row + 4 * q, x);
}
// The classifier's gradient of a probability at column `col` (four at col..col+3).
LOOM_DEVICE float dlogit_at(float p, int col, int target, float dloss) {
  return math::crossentropy_dlogit(p, col == target, dloss);
}
LOOM_DEVICE dev::float4 dlogit_at(dev::float4 p, int col, int target, float dloss) {
  return dev::make_float4(dlogit_at(p.x, col, target, dloss), dlogit_at(p.y, col + 1, target, dloss),
                          dlogit_at(p.z, col + 2, target, dloss), dlogit_at(p.w, col + 3, target, dloss));
}

// The host's float branch: max, sum of exp_fast(l - max), probs = exp_fast(l - max) * (1 / sum),
// loss = log(sum) + max - l[target]. Three passes over the row. With Cached the row lives in
// dynamic shared memory ([V] floats): the first pass copies the logits there, the second replaces
// them by their exponentials, the third scales those; the logits come from HBM once instead of three
// times and each exponential is computed once (the host's float branch too stores the exponential
// and then scales it). Each thread reads back only the entries it wrote itself, so the copy needs no
// barrier. The target's logit is read before the barriers that precede the writes, so probs may even
// alias logits. Grad (the fused classifier, crossentropy_fused): the third pass stores each
// probability's gradient, (p - [target]) * dloss, as O instead of p: the bits of crossentropy_backward
// after this kernel, with no probability table.
template <bool Cached, bool Vec4, bool Grad = false, DType O = DType::f32>
LOOM_KERNEL void LOOM_LAUNCH_BOUNDS(kCrossEntropyForwardThreads)
    crossentropy_forward_kernel(float* losses,                // [N]
                                storage_t<O>* probs,          // [N,V] the probabilities, or with Grad dlogits
                                const float* logits,          // [N,V]
                                const std::int32_t* targets,  // [N]
                                float dloss, int N, int V) {
  static_assert(Grad || O == DType::f32, "the probabilities are fp32");
  using Vec = typename RowAccess<Vec4>::type;
  constexpr int width = RowAccess<Vec4>::width;
  Vec* row_copy = dev::shared_memory<Vec>();  // [V] floats if Cached (16-byte aligned)
  LOOM_SHARED_ARRAY(float, shared, kWarp);
  const int Q = V / width;  // accesses per row
  for (int n = block(); n < N; n += blocks()) {
    const Vec* l = reinterpret_cast<const Vec*>(logits + static_cast<std::int64_t>(n) * V);
    storage_t<O>* p = probs + static_cast<std::int64_t>(n) * V;
    const int target = targets[n];
    const float target_logit = tid() == 0 ? logits[static_cast<std::int64_t>(n) * V + targets[n]] : 0.0f;
    float mx = -INFINITY;
    for (int q = tid(); q < Q; q += threads_per_block()) {
      const Vec lq = l[q];
      if constexpr (Cached) row_copy[q] = lq;
      mx = max_into(mx, lq);
    }
    mx = block_reduce(mx, -INFINITY, MaxOp{}, shared);
    float s = 0.0f;
    for (int q = tid(); q < Q; q += threads_per_block()) {
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
    for (int q = tid(); q < Q; q += threads_per_block()) {
      Vec pq;
      if constexpr (Cached)
        pq = scaled(row_copy[q], inv);
      else
        pq = scaled(exp_shifted(l[q], mx), inv);
      if constexpr (Grad)
        put_row<O>(p, q, dlogit_at(pq, q * width, target, dloss));
      else
        put_row<O>(p, q, pq);
    }
    if (tid() == 0) losses[n] = dev::log_f(s) + mx - target_logit;  // log-sum-exp: exact when p underflows
  }
}

// One block per row (no index division); each element is read, then written, by one thread, so
// dlogits may alias probs (an fp32 one; a 16-bit one, the classifier product's operand, is its own).
template <DType O>
LOOM_KERNEL void crossentropy_backward_kernel(storage_t<O>* dlogits,        // [N,V] (=)
                                              const float* probs,           // [N,V]
                                              const std::int32_t* targets,  // [N]
                                              float dloss, int N, int V, int vocab_begin) {
  for (int n = block(); n < N; n += blocks()) {
    const float* p = probs + static_cast<std::int64_t>(n) * V;
    storage_t<O>* d = dlogits + static_cast<std::int64_t>(n) * V;
    const int target = targets[n] - vocab_begin;  // outside [0, V): another rank's vocabulary
    for (int v = tid(); v < V; v += threads_per_block())
      d[v] = Storage<O>::store(math::crossentropy_dlogit(p[v], v == target, dloss));
  }
}

// Vocabulary-parallel cross-entropy (core/backend/kernels.hpp's crossentropy_row_max / _partial / _finish):
// one block per row; the sum of exponentials is a block reduction in fp64 (the host's row sum is
// sequential: the two agree to rounding).
LOOM_KERNEL void crossentropy_row_max_kernel(float* row_max,       // [N]
                                             const float* logits,  // [N,V]
                                             int N, int V) {
  LOOM_SHARED_ARRAY(float, shared, kWarp);
  for (int n = block(); n < N; n += blocks()) {
    const float* l = logits + static_cast<std::int64_t>(n) * V;
    float mx = -INFINITY;
    for (int v = tid(); v < V; v += threads_per_block()) mx = MaxOp{}(mx, l[v]);
    mx = block_reduce(mx, -INFINITY, MaxOp{}, shared);
    if (tid() == 0) row_max[n] = mx;
  }
}

LOOM_KERNEL void crossentropy_partial_kernel(float* probs,                 // [N,V]
                                             double* sum_exp,              // [N]
                                             double* target_logit,         // [N]
                                             const float* logits,          // [N,V]
                                             const float* row_max,         // [N]
                                             const std::int32_t* targets,  // [N]
                                             int N, int V, int vocab_begin) {
  LOOM_SHARED_ARRAY(double, shared, kWarp);
  for (int n = block(); n < N; n += blocks()) {
    const float* l = logits + static_cast<std::int64_t>(n) * V;
    float* p = probs == nullptr ? nullptr : probs + static_cast<std::int64_t>(n) * V;  // null: only the sums
    const float mx = row_max[n];
    const int t = targets[n] - vocab_begin;
    // p may alias l (the model's head overwrites its logits): the target's logit is read before
    // the barrier that every write of p follows.
    const double tl = tid() == 0 && t >= 0 && t < V ? l[t] : 0.0;
    dev::sync_block();
    double s = 0.0;
    for (int v = tid(); v < V; v += threads_per_block()) {
      const float e = math::exp_fast(l[v] - mx);
      if (p != nullptr) p[v] = e;
      s += e;
    }
    s = block_reduce(s, 0.0, SumOp{}, shared);
    if (tid() == 0) {
      sum_exp[n] = s;
      target_logit[n] = tl;
    }
  }
}

LOOM_KERNEL void crossentropy_finish_kernel(float* losses,               // [N]
                                            float* probs,                // [N,V]
                                            const double* sum_exp,       // [N]
                                            const float* row_max,        // [N]
                                            const double* target_logit,  // [N]
                                            int N, int V) {
  for (int n = block(); n < N; n += blocks()) {
    float* p = probs + static_cast<std::int64_t>(n) * V;
    const float inv = static_cast<float>(1.0 / sum_exp[n]);
    for (int v = tid(); v < V; v += threads_per_block()) p[v] *= inv;
    if (tid() == 0) losses[n] = static_cast<float>(dev::log_d(sum_exp[n]) + row_max[n] - target_logit[n]);
  }
}

// crossentropy_finish then crossentropy_backward in one pass: each exponential recomputed from the
// logits (exp_fast of the same float, the bits _partial would have stored), scaled as _finish scales
// it, its gradient stored as O (fp32 may alias logits: each element is read, then written, by one thread).
template <DType O>
LOOM_KERNEL void crossentropy_finish_grad_kernel(float* losses,                // [N]
                                                 storage_t<O>* dlogits,        // [N,V]
                                                 const float* logits,          // [N,V]
                                                 const double* sum_exp,        // [N]
                                                 const float* row_max,         // [N]
                                                 const double* target_logit,   // [N]
                                                 const std::int32_t* targets,  // [N]
                                                 float dloss, int N, int V, int vocab_begin) {
  for (int n = block(); n < N; n += blocks()) {
    const float* l = logits + static_cast<std::int64_t>(n) * V;
    storage_t<O>* d = dlogits + static_cast<std::int64_t>(n) * V;
    const float inv = static_cast<float>(1.0 / sum_exp[n]);
    const float mx = row_max[n];
    const int target = targets[n] - vocab_begin;
    for (int v = tid(); v < V; v += threads_per_block())
      d[v] = Storage<O>::store(math::crossentropy_dlogit(math::exp_fast(l[v] - mx) * inv, v == target, dloss));
    if (tid() == 0) losses[n] = static_cast<float>(dev::log_d(sum_exp[n]) + row_max[n] - target_logit[n]);
  }
}

// `shared_limit`: the device's dynamic shared memory per block (opt-in); the row is staged in it
// when it fits, with the kernel's static reduction scratch. Grad: crossentropy_fused (out = dlogits
// as O, dloss); otherwise out = the fp32 probabilities.
template <bool Grad = false, DType O = DType::f32, class Launch>
void crossentropy_rows(Launch&& launch, const char* name, std::size_t shared_limit, float* losses, storage_t<O>* out,
                       const float* logits, const std::int32_t* targets, float dloss, int N, int V) {
  if (N <= 0 || V <= 0) return;
  const LaunchGeometry g = rows_per_block_geometry(N, kCrossEntropyForwardThreads);
  // Every row of out starts 4 elements apart, so the first row's alignment is every row's.
  const bool vec4 = V % 4 == 0 && aligned16(logits) && aligned_store4<O>(out);
  const std::size_t row_bytes = static_cast<std::size_t>(V) * sizeof(float);
  const bool cached = row_bytes + kWarp * sizeof(float) <= shared_limit;
  if (cached && vec4)
    launch(name, g.blocks, g.threads, row_bytes, crossentropy_forward_kernel<true, true, Grad, O>, losses, out, logits,
           targets, dloss, N, V);
  else if (cached)
    launch(name, g.blocks, g.threads, row_bytes, crossentropy_forward_kernel<true, false, Grad, O>, losses, out, logits,
           targets, dloss, N, V);
  else if (vec4)
    launch(name, g.blocks, g.threads, 0, crossentropy_forward_kernel<false, true, Grad, O>, losses, out, logits,
           targets, dloss, N, V);
  else
    launch(name, g.blocks, g.threads, 0, crossentropy_forward_kernel<false, false, Grad, O>, losses, out, logits,
           targets, dloss, N, V);
}
template <class Launch>
void crossentropy_forward(Launch&& launch, std::size_t shared_limit, float* losses, float* probs, const float* logits,
                          const std::int32_t* targets, int N, int V) {
  crossentropy_rows(launch, "crossentropy_forward_kernel", shared_limit, losses, probs, logits, targets, 0.0f, N, V);
}
// The fused classifier: losses and dlogits (may alias logits when O is fp32) in one kernel.
template <DType O, class Launch>
void crossentropy_fused(Launch&& launch, std::size_t shared_limit, float* losses, storage_t<O>* dlogits,
                        const float* logits, const std::int32_t* targets, float dloss, int N, int V) {
  crossentropy_rows<true, O>(launch, "crossentropy_fused_kernel", shared_limit, losses, dlogits, logits, targets, dloss,
                             N, V);
}

template <DType O = DType::f32, class Launch>
void crossentropy_backward(Launch&& launch, storage_t<O>* dlogits, const float* probs, const std::int32_t* targets,
                           float dloss, int N, int V, int vocab_begin) {
  if (N <= 0 || V <= 0) return;
  const LaunchGeometry g = rows_per_block_geometry(N, kRowBlockThreads);
  launch("crossentropy_backward_kernel", g.blocks, g.threads, 0, crossentropy_backward_kernel<O>, dlogits, probs,
         targets, dloss, N, V, vocab_begin);
}

template <class Launch>
void crossentropy_row_max(Launch&& launch, float* row_max, const float* logits, int N, int V) {
  if (N <= 0 || V <= 0) return;
  const LaunchGeometry g = rows_per_block_geometry(N, kRowBlockThreads);
  launch("crossentropy_row_max_kernel", g.blocks, g.threads, 0, crossentropy_row_max_kernel, row_max, logits, N, V);
}

template <class Launch>
void crossentropy_partial(Launch&& launch, float* probs, double* sum_exp, double* target_logit, const float* logits,
                          const float* row_max, const std::int32_t* targets, int N, int V, int vocab_begin) {
  if (N <= 0 || V <= 0) return;
  const LaunchGeometry g = rows_per_block_geometry(N, kRowBlockThreads);
  launch("crossentropy_partial_kernel", g.blocks, g.threads, 0, crossentropy_partial_kernel, probs, sum_exp,
         target_logit, logits, row_max, targets, N, V, vocab_begin);
}

template <class Launch>
void crossentropy_finish(Launch&& launch, float* losses, float* probs, const double* sum_exp, const float* row_max,
                         const double* target_logit, int N, int V) {
  if (N <= 0 || V <= 0) return;
  const LaunchGeometry g = rows_per_block_geometry(N, kRowBlockThreads);
  launch("crossentropy_finish_kernel", g.blocks, g.threads, 0, crossentropy_finish_kernel, losses, probs, sum_exp,
         row_max, target_logit, N, V);
}

template <DType O, class Launch>
void crossentropy_finish_grad(Launch&& launch, float* losses, storage_t<O>* dlogits, const float* logits,
                              const double* sum_exp, const float* row_max, const double* target_logit,
                              const std::int32_t* targets, float dloss, int N, int V, int vocab_begin) {
  if (N <= 0 || V <= 0) return;
  const LaunchGeometry g = rows_per_block_geometry(N, kRowBlockThreads);
  launch("crossentropy_finish_grad_kernel", g.blocks, g.threads, 0, crossentropy_finish_grad_kernel<O>, losses, dlogits,
         logits, sum_exp, row_max, target_logit, targets, dloss, N, V, vocab_begin);
}

// ---------------------------------------------------------------------------------------------
// AdamW.

LOOM_KERNEL void adamw_kernel(float* params,       // [n]
                              float* m,            // [n]
                              float* v,            // [n]
                              const float* grads,  // [n]
                              std::int64_t n, math::AdamWStep<float> step) {
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) {
    float mi = m[i], vi = v[i];
    params[i] = math::adamw(params[i], mi, vi, grads[i], step);
    m[i] = mi;
    v[i] = vi;
  }
}

// `step` holds the bias corrections, computed on the host as core/backend/kernels.hpp does.
template <class Launch>
void adamw_update(Launch&& launch, float* params, float* m, float* v, const float* grads, std::int64_t n,
                  const math::AdamWStep<float>& step) {
  if (n <= 0) return;
  const LaunchGeometry g = elementwise_geometry(n, kThreads);
  launch("adamw_kernel", g.blocks, g.threads, 0, adamw_kernel, params, m, v, grads, n, step);
}

// Backend::adamw_update_slices: up to kAdamWSlices slices a launch, the table by value (1.5 KiB, within
// a kernel's 4 KiB of parameters). Slice t owns blocks [first_block[t], first_block[t + 1]) and
// updates its elements with adamw_kernel's arithmetic and its own weight decay: the same bits as one
// adamw_update per slice, in one launch instead of kAdamWSlices.
constexpr int kAdamWSlices = 32;
struct AdamWTable {
  float* p[kAdamWSlices];
  float* m[kAdamWSlices];
  float* v[kAdamWSlices];
  const float* g[kAdamWSlices];
  std::int64_t n[kAdamWSlices];
  float weight_decay[kAdamWSlices];
  unsigned first_block[kAdamWSlices + 1];
  int count;
  // Host side: the emulator maps each device pointer to the memory behind it (core/cuda/emu/runtime.hpp).
  template <class F>
  void for_each_device_pointer(F f) {
    for (int t = 0; t < count; ++t) {
      for (float** q : {&p[t], &m[t], &v[t]}) {
        const void* a = *q;
        f(a);
        *q = static_cast<float*>(const_cast<void*>(a));
      }
      const void* a = g[t];
      f(a);
      g[t] = static_cast<const float*>(a);
    }
  }
};

LOOM_KERNEL void adamw_slices_kernel(AdamWTable table, math::AdamWStep<float> step) {
  const unsigned total = table.first_block[table.count];
  for (unsigned b = block(); b < total; b += blocks()) {  // block-uniform
    int t = 0;
    while (b >= table.first_block[t + 1]) ++t;
    const unsigned local = b - table.first_block[t], slice_blocks = table.first_block[t + 1] - table.first_block[t];
    math::AdamWStep<float> s = step;
    s.weight_decay = table.weight_decay[t];
    float* p = table.p[t];
    float* m = table.m[t];
    float* v = table.v[t];
    const float* g = table.g[t];
    const std::int64_t n = table.n[t], stride = static_cast<std::int64_t>(slice_blocks) * threads_per_block();
    for (std::int64_t i = static_cast<std::int64_t>(local) * threads_per_block() + tid(); i < n; i += stride) {
      float mi = m[i], vi = v[i];
      p[i] = math::adamw(p[i], mi, vi, g[i], s);
      m[i] = mi;
      v[i] = vi;
    }
  }
}

// Slice t: p[t], m[t], v[t], g[t] of n[t] elements, weight decay wd[t]; `step`'s weight_decay unused.
template <class Launch>
void adamw_update_slices(Launch&& launch, float* const* p, float* const* m, float* const* v, const float* const* g,
                         const std::int64_t* n, const float* wd, int count, const math::AdamWStep<float>& step) {
  for (int t0 = 0; t0 < count; t0 += kAdamWSlices) {
    AdamWTable table{};
    table.count = count - t0 < kAdamWSlices ? count - t0 : kAdamWSlices;
    for (int t = 0; t < table.count; ++t) {
      table.p[t] = p[t0 + t], table.m[t] = m[t0 + t], table.v[t] = v[t0 + t], table.g[t] = g[t0 + t];
      table.n[t] = n[t0 + t] > 0 ? n[t0 + t] : 0;
      table.weight_decay[t] = wd[t0 + t];
      table.first_block[t + 1] =
          table.first_block[t] + (table.n[t] > 0 ? elementwise_geometry(table.n[t], kThreads).blocks : 0u);
    }
    const unsigned total = table.first_block[table.count];
    if (total > 0) launch("adamw_slices_kernel", total, kThreads, 0, adamw_slices_kernel, table, step);
  }
}

// double -> float rounded to odd (core/base/dtype.hpp's to_float_round_odd): truncated toward zero, the
// last mantissa bit set when inexact, so a following round to nearest even at bf16/fp16 precision
// equals rounding the double directly.
LOOM_DEVICE float double_to_float_round_odd(double d) {
  if (d != d) return static_cast<float>(d);  // NaN
  const float f = dev::double_to_float_rz(d);
  if (static_cast<double>(f) == d) return f;  // exact, inf included
  return math::bits_as_float(math::float_bits(f) | 1u);
}

// core/backend/kernels.hpp's convert<D>(S): same type as is; from fp64 directly; otherwise through float.
template <DType Dst, DType Src>
LOOM_DEVICE storage_t<Dst> convert(storage_t<Src> x) {
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

// Vec4 (fp32 into bf16 or fp16 only, src 16-byte and dst 8-byte aligned): four elements a thread,
// one load and one store, each rounded by convert as singly.
template <DType Dst, DType Src, bool Vec4>
LOOM_KERNEL void cast_kernel(storage_t<Dst>* dst,        // [n]
                             const storage_t<Src>* src,  // [n]
                             std::int64_t n) {
  std::int64_t begin = 0;
  if constexpr (Vec4) {
    static_assert(Src == DType::f32 && (Dst == DType::bf16 || Dst == DType::f16), "Vec4 casts: fp32 into 16 bits");
    const std::int64_t n4 = n / 4;
    for (std::int64_t i = global_thread(); i < n4; i += grid_threads()) {
      const dev::float4 v = dev::load_float4(src + 4 * i);
      dev::store_u16x4(dst + 4 * i, convert<Dst, Src>(v.x), convert<Dst, Src>(v.y), convert<Dst, Src>(v.z),
                       convert<Dst, Src>(v.w));
    }
    begin = 4 * n4;
  }
  for (std::int64_t i = begin + global_thread(); i < n; i += grid_threads()) dst[i] = convert<Dst, Src>(src[i]);
}

template <DType D>
LOOM_KERNEL void scale_kernel(storage_t<D>* x,  // [n]
                              compute_t<D> a, std::int64_t n) {
  for (std::int64_t i = global_thread(); i < n; i += grid_threads())
    x[i] = Storage<D>::store(Storage<D>::load(x[i]) * a);
}

template <DType D>
LOOM_KERNEL void fill_kernel(storage_t<D>* x,  // [n]
                             compute_t<D> value, std::int64_t n) {
  const storage_t<D> stored = Storage<D>::store(value);
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) x[i] = stored;
}

LOOM_KERNEL void axpy_kernel(float* y, float a, const float* x, std::int64_t n) {       // [n], [n]
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) y[i] += a * x[i];  // --fmad=false: two roundings
}

template <DType Dst, DType Src, class Launch>
void cast(Launch&& launch, storage_t<Dst>* dst, const storage_t<Src>* src, std::int64_t n) {
  if (n <= 0) return;
  if (Dst == Src && static_cast<const void*>(dst) == static_cast<const void*>(src)) return;  // nothing to convert
  if constexpr (Src == DType::f32 && (Dst == DType::bf16 || Dst == DType::f16)) {
    if (aligned16(src) && (reinterpret_cast<std::uintptr_t>(dst) & 7u) == 0) {
      const LaunchGeometry g = elementwise_vec_geometry(n, true);
      return launch("cast_kernel", g.blocks, g.threads, 0, cast_kernel<Dst, Src, true>, dst, src, n);
    }
  }
  const LaunchGeometry g = elementwise_geometry(n, kThreads);
  launch("cast_kernel", g.blocks, g.threads, 0, cast_kernel<Dst, Src, false>, dst, src, n);
}

template <DType D, class Launch>
void scale(Launch&& launch, storage_t<D>* x, compute_t<D> a, std::int64_t n) {
  if (n <= 0) return;
  const LaunchGeometry g = elementwise_geometry(n, kThreads);
  launch("scale_kernel", g.blocks, g.threads, 0, scale_kernel<D>, x, a, n);
}

template <DType D, class Launch>
void fill(Launch&& launch, storage_t<D>* x, compute_t<D> value, std::int64_t n) {
  if (n <= 0) return;
  const LaunchGeometry g = elementwise_geometry(n, kThreads);
  launch("fill_kernel", g.blocks, g.threads, 0, fill_kernel<D>, x, value, n);
}

template <class Launch>
void axpy(Launch&& launch, float* y, float a, const float* x, std::int64_t n) {
  if (n <= 0) return;
  const LaunchGeometry g = elementwise_geometry(n, kThreads);
  launch("axpy_kernel", g.blocks, g.threads, 0, axpy_kernel, y, a, x, n);
}

// ---------------------------------------------------------------------------------------------
// Reductions. Each thread adds f(x[i]) over its grid-stride elements in double (the square of a
// float is exact in double), the block reduces in a fixed tree, block b writes partials[b]; one
// block then adds the partials.
enum class ReduceOp { sum, sum_squares, nonfinite };

LOOM_DEVICE bool is_finite(float x) { return (math::float_bits(x) & 0x7f800000u) != 0x7f800000u; }
LOOM_DEVICE bool is_finite(double x) { return (dev::double_bits(x) & 0x7ff0000000000000ull) != 0x7ff0000000000000ull; }

template <DType D, ReduceOp Op>
LOOM_KERNEL void reduce_partials_kernel(double* partials,       // [gridDim.x]
                                        const storage_t<D>* x,  // [n]
                                        std::int64_t n) {
  LOOM_SHARED_ARRAY(double, shared, kWarp);
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
  if (tid() == 0) partials[block()] = acc;
}

// One block: thread k adds partials k, k + blockDim.x, ... in order, then a fixed tree.
LOOM_KERNEL void reduce_finish_kernel(double* out,             // [1]
                                      const double* partials,  // [count]
                                      int count) {
  LOOM_SHARED_ARRAY(double, shared, kWarp);
  double acc = 0.0;
  for (int i = tid(); i < count; i += threads_per_block()) acc += partials[i];
  acc = block_reduce(acc, 0.0, SumOp{}, shared);
  if (tid() == 0) *out = acc;
}

inline LaunchGeometry reduce_geometry(std::int64_t n) {
  return elementwise_geometry(n, kReduceThreads, kReduceMaxBlocks);
}

// scratch holds reduce_geometry(n).blocks doubles; n <= 0 gives the empty sum, 0.
template <DType D, ReduceOp Op, class Launch>
void reduce(Launch&& launch, double* out, const storage_t<D>* x, std::int64_t n, double* scratch) {
  if (n <= 0) return fill<DType::f64>(launch, out, 0.0, 1);
  const LaunchGeometry g = reduce_geometry(n);
  launch("reduce_partials_kernel", g.blocks, g.threads, 0, reduce_partials_kernel<D, Op>, scratch, x, n);
  launch("reduce_finish_kernel", 1u, kReduceThreads, 0, reduce_finish_kernel, out, static_cast<const double*>(scratch),
         static_cast<int>(g.blocks));
}

// Backend::sq_norm_check over many tensors in two launches instead of four per tensor: tensor t
// keeps its own partition (reduce_geometry(n_t).blocks blocks, the grid stride of those), each block
// adds both the squares and the non-finite count, and one finishing block per tensor adds its
// partials as reduce_finish_kernel does: each result is sum_squares' and count_nonfinite's, bit for
// bit. At most kMultiTensors tensors a launch (the table goes by value, within the 4 KiB of a
// kernel's parameters).
constexpr int kMultiTensors = 64;
template <DType D>
struct TensorTable {
  const storage_t<D>* x[kMultiTensors];
  std::int64_t n[kMultiTensors];
  unsigned first_block[kMultiTensors + 1];  // tensor t's blocks: [first_block[t], first_block[t + 1])
  int count;
  // Host side: the emulator maps each device pointer to the memory behind it (core/cuda/emu/runtime.hpp).
  template <class F>
  void for_each_device_pointer(F f) {
    for (int t = 0; t < count; ++t) {
      const void* p = x[t];
      f(p);
      x[t] = static_cast<const storage_t<D>*>(p);
    }
  }
};

template <DType D>
LOOM_KERNEL void reduce_norm_check_partials_kernel(double* partials,  // [2, first_block[count]]
                                                   TensorTable<D> table) {
  LOOM_SHARED_ARRAY(double, shared, kWarp);
  const unsigned total = table.first_block[table.count];
  for (unsigned b = block(); b < total; b += blocks()) {  // block-uniform
    int t = 0;
    while (b >= table.first_block[t + 1]) ++t;
    const unsigned local = b - table.first_block[t], tensor_blocks = table.first_block[t + 1] - table.first_block[t];
    const storage_t<D>* x = table.x[t];
    const std::int64_t n = table.n[t];
    const std::int64_t stride = static_cast<std::int64_t>(tensor_blocks) * threads_per_block();
    double sq = 0.0, bad = 0.0;
    for (std::int64_t i = static_cast<std::int64_t>(local) * threads_per_block() + tid(); i < n; i += stride) {
      const compute_t<D> v = Storage<D>::load(x[i]);
      const double a = static_cast<double>(v);
      sq += a * a;
      bad += is_finite(v) ? 0.0 : 1.0;
    }
    sq = block_reduce(sq, 0.0, SumOp{}, shared);
    bad = block_reduce(bad, 0.0, SumOp{}, shared);
    if (tid() == 0) {
      partials[b] = sq;
      partials[total + b] = bad;
    }
  }
}

// sq[t] = tensor t's sum of squares, bad[t] its non-finite count.
template <DType D>
LOOM_KERNEL void reduce_norm_check_finish_kernel(double* sq,              // [count]
                                                 double* bad,             // [count]
                                                 const double* partials,  // [2, first_block[count]]
                                                 TensorTable<D> table) {
  LOOM_SHARED_ARRAY(double, shared, kWarp);
  const unsigned total = table.first_block[table.count];
  for (int t = static_cast<int>(block()); t < table.count; t += static_cast<int>(blocks())) {  // block-uniform
    for (int which = 0; which < 2; ++which) {
      const double* p = partials + static_cast<std::int64_t>(which) * total + table.first_block[t];
      const int count = static_cast<int>(table.first_block[t + 1] - table.first_block[t]);
      double acc = 0.0;
      for (int i = tid(); i < count; i += threads_per_block()) acc += p[i];
      acc = block_reduce(acc, 0.0, SumOp{}, shared);
      if (tid() == 0) (which == 0 ? sq : bad)[t] = acc;
    }
  }
}

// How many doubles norm_check's scratch needs for these sizes, in launches of kMultiTensors.
inline std::int64_t norm_check_scratch_count(const std::int64_t* n, int count) {
  std::int64_t most = 1;
  for (int t0 = 0; t0 < count; t0 += kMultiTensors) {
    std::int64_t blocks = 0;
    for (int t = t0; t < count && t < t0 + kMultiTensors; ++t) blocks += reduce_geometry(n[t]).blocks;
    most = blocks * 2 > most ? blocks * 2 : most;
  }
  return most;
}

// sq[t] (t < count): the sum of squares of x[t]; bad[t]: its count of NaN and inf. scratch:
// norm_check_scratch_count(n, count) doubles.
template <DType D, class Launch>
void norm_check(Launch&& launch, double* sq, double* bad, const storage_t<D>* const* x, const std::int64_t* n,
                int count, double* scratch) {
  for (int t0 = 0; t0 < count; t0 += kMultiTensors) {
    TensorTable<D> table{};
    table.count = count - t0 < kMultiTensors ? count - t0 : kMultiTensors;
    table.first_block[0] = 0;
    for (int t = 0; t < table.count; ++t) {
      table.x[t] = x[t0 + t];
      table.n[t] = n[t0 + t] > 0 ? n[t0 + t] : 0;
      table.first_block[t + 1] = table.first_block[t] + reduce_geometry(table.n[t]).blocks;
    }
    const unsigned total = table.first_block[table.count];
    launch("reduce_norm_check_partials_kernel", total, kReduceThreads, 0, reduce_norm_check_partials_kernel<D>, scratch,
           table);
    // The results of this launch's tensors: sums of squares at out[t0 + t], counts at out[count + t0 + t].
    launch("reduce_norm_check_finish_kernel", static_cast<unsigned>(table.count), kReduceThreads, 0,
           reduce_norm_check_finish_kernel<D>, sq + t0, bad + t0, static_cast<const double*>(scratch), table);
  }
}

// ---------------------------------------------------------------------------------------------
// int8 gradient compression (core/backend/kernels.hpp's int8_*; the per-element rule is math::int8_level).

// The chunk maxima: one block per chunk (a maximum is the same in any order, so the block's tree
// gives the host's value bit for bit).
LOOM_KERNEL void int8_absmax_kernel(float* absmax,   // [chunks] (the finiteness flag: int8_flag_kernel)
                                    const float* x,  // [n]
                                    std::int64_t n, std::int64_t chunk, std::int64_t chunks) {
  LOOM_SHARED_ARRAY(float, shared, kWarp);
  for (std::int64_t c = block(); c < chunks; c += blocks()) {
    const std::int64_t begin = c * chunk, end = begin + chunk < n ? begin + chunk : n;
    float m = 0.0f;
    for (std::int64_t i = begin + tid(); i < end; i += threads_per_block()) m = MaxOp{}(m, math::int8_magnitude(x[i]));
    m = block_reduce(m, 0.0f, MaxOp{}, shared);
    if (tid() == 0) absmax[c] = m;
  }
}
// flag = 1 if the count of non-finite values is not 0, else 0.
LOOM_KERNEL void int8_flag_kernel(float* flag, const double* nonfinite) {
  if (tid() == 0 && block() == 0) *flag = *nonfinite != 0.0 ? 1.0f : 0.0f;
}
LOOM_KERNEL void int8_quantize_kernel(std::int8_t* q,  // [n]
                                      float* error,    // [n] or null
                                      const float* x,  // [n]
                                      std::int64_t n, std::int64_t chunk,
                                      const float* absmax,  // [chunks + 1]
                                      int levels) {
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) {
    const float step = math::int8_step(absmax[i / chunk], levels);
    const float v = math::int8_level(x[i], step, levels);
    q[i] = static_cast<std::int8_t>(v);
    if (error) error[i] = x[i] - v * step;
  }
}
LOOM_KERNEL void int8_dequantize_kernel(float* x,              // [n]
                                        const std::int8_t* q,  // [n]
                                        std::int64_t n, std::int64_t chunk,
                                        const float* absmax,  // [chunks + 1]: absmax[chunks] > 0 poisons x
                                        std::int64_t chunks, int levels) {
  const bool poisoned = absmax[chunks] > 0.0f;
  for (std::int64_t i = global_thread(); i < n; i += grid_threads())
    x[i] = poisoned ? math::bits_as_float(0x7fc00000u)
                    : static_cast<float>(q[i]) * math::int8_step(absmax[i / chunk], levels);
}

// The chunk maxima and, through count_nonfinite into *nonfinite, the flag at absmax[chunks].
template <class Launch>
void int8_absmax(Launch&& launch, float* absmax, const float* x, std::int64_t n, std::int64_t chunk, double* nonfinite,
                 double* scratch) {
  const std::int64_t chunks = (n + chunk - 1) / chunk;
  if (chunks > 0) {
    const LaunchGeometry g = rows_per_block_geometry(chunks, kThreads);
    launch("int8_absmax_kernel", g.blocks, g.threads, 0, int8_absmax_kernel, absmax, x, n, chunk, chunks);
  }
  reduce<DType::f32, ReduceOp::nonfinite>(launch, nonfinite, x, n, scratch);
  launch("int8_flag_kernel", 1u, kWarp, 0, int8_flag_kernel, absmax + chunks, static_cast<const double*>(nonfinite));
}

template <class Launch>
void int8_quantize(Launch&& launch, std::int8_t* q, float* error, const float* x, std::int64_t n, std::int64_t chunk,
                   const float* absmax, int levels) {
  if (n <= 0) return;
  const LaunchGeometry g = elementwise_geometry(n, kThreads);
  launch("int8_quantize_kernel", g.blocks, g.threads, 0, int8_quantize_kernel, q, error, x, n, chunk, absmax, levels);
}

template <class Launch>
void int8_dequantize(Launch&& launch, float* x, const std::int8_t* q, std::int64_t n, std::int64_t chunk,
                     const float* absmax, int levels) {
  if (n <= 0) return;
  const LaunchGeometry g = elementwise_geometry(n, kThreads);
  launch("int8_dequantize_kernel", g.blocks, g.threads, 0, int8_dequantize_kernel, x, q, n, chunk, absmax,
         (n + chunk - 1) / chunk, levels);
}

}  // namespace loom::cuda::layer
