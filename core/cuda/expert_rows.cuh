#pragma once
// Mixture of experts' row operations (Backend::rows_gather, rows_scatter_add and rows_dot; contracts in
// core/cuda/kernels.cuh): the twins of the host's kernels at the end of core/backend/kernels.hpp, which are
// the semantic reference. An expert's rows of a token table and back: rows [n] int32 names the token row
// of each of the expert's rows, distinct within a call.
//
// Work split, no atomics, so a call repeats bit for bit and gives the host's bits:
//   - gather and scatter_add: grid-stride over the n * C elements, one thread an element; each element
//     is one multiplication (gather: g * src) or one multiply-add written as two roundings (scatter:
//     dst + g * src; nvcc builds with --fmad=false, the host with -ffp-contract=off). The rows are
//     distinct, so no two threads write one element.
//   - dot: half a warp (16 lanes) per row, lane j summing the products of columns j, j + 16, ... in
//     column order, then an xor butterfly over the 16 lanes (8, 4, 2, 1): lane_sum's order exactly
//     (core/backend/kernel_rows.inc: element c into partial c % 16, the partials added pairwise), so the
//     sum is the host's bit for bit. A warp takes two rows; its loop is uniform over the warp, so every
//     lane reaches each shuffle.
//
// The source compiles for the GPU (nvcc, core/cuda/expert_rows.cu) and for the host against the CUDA
// emulator (core/cuda/emu/), whose unit tests run these kernels against the host's; each operation is a
// function template over `launch`, as in core/cuda/layer_kernels.cuh.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "core/cuda/device_portable.hpp"
#include "core/cuda/launch_geometry.hpp"

namespace loom::cuda::experts {

inline constexpr unsigned kThreads = 256;
inline constexpr int kWarp = 32;
inline constexpr int kDotLanes = 16;  // lane_sum's partial sums (core/backend/kernel_rows.inc kLanes)

// ---------------------------------------------------------------------------------------------
// rows_gather: out[i, c] = x[rows[i], c] (any element type: a copy of its bits), or with scale
// g * x[rows[i], c], g = scale[i] (fp32).
template <class T>
LOOM_KERNEL void rows_gather_kernel(T* out, const T* x, const std::int32_t* rows, std::int64_t n, int C) {
  const std::int64_t total = n * C;
  const std::int64_t step = static_cast<std::int64_t>(dev::grid_x()) * dev::block_dim_x();
  for (std::int64_t e = static_cast<std::int64_t>(dev::block_x()) * dev::block_dim_x() + dev::thread_x(); e < total;
       e += step) {
    const std::int64_t i = e / C, c = e % C;
    out[e] = x[static_cast<std::int64_t>(rows[i]) * C + c];
  }
}

LOOM_KERNEL void rows_gather_scaled_kernel(float* out, const float* x, const std::int32_t* rows, const float* scale,
                                           std::int64_t n, int C) {
  const std::int64_t total = n * C;
  const std::int64_t step = static_cast<std::int64_t>(dev::grid_x()) * dev::block_dim_x();
  for (std::int64_t e = static_cast<std::int64_t>(dev::block_x()) * dev::block_dim_x() + dev::thread_x(); e < total;
       e += step) {
    const std::int64_t i = e / C, c = e % C;
    out[e] = scale[i] * x[static_cast<std::int64_t>(rows[i]) * C + c];
  }
}

// ---------------------------------------------------------------------------------------------
// rows_scatter_add: out[rows[i], c] = out[rows[i], c] + g * y[i, c], g = scale[i] (1 without scale).
LOOM_KERNEL void rows_scatter_add_kernel(float* out, const float* y, const std::int32_t* rows, const float* scale,
                                         std::int64_t n, int C) {
  const std::int64_t total = n * C;
  const std::int64_t step = static_cast<std::int64_t>(dev::grid_x()) * dev::block_dim_x();
  for (std::int64_t e = static_cast<std::int64_t>(dev::block_x()) * dev::block_dim_x() + dev::thread_x(); e < total;
       e += step) {
    const std::int64_t i = e / C, c = e % C;
    const float g = scale ? scale[i] : 1.0f;
    float* dst = out + static_cast<std::int64_t>(rows[i]) * C + c;
    *dst = *dst + g * y[e];
  }
}

// ---------------------------------------------------------------------------------------------
// rows_dot: out[i] = sum_c x[rows[i], c] * y[i, c] in lane_sum's order. Warp w takes rows 2p and
// 2p + 1 for p = w, w + warps, ...: lanes 0-15 the first, 16-31 the second (a lane past n sums
// nothing and stores nothing, but shuffles with its half).
LOOM_KERNEL void rows_dot_kernel(float* out, const float* x, const std::int32_t* rows, const float* y, std::int64_t n,
                                 int C) {
  const int lane = dev::thread_x() % kWarp, j = lane % kDotLanes;
  const std::int64_t warps = static_cast<std::int64_t>(dev::grid_x()) * (dev::block_dim_x() / kWarp);
  const std::int64_t pairs = (n + 1) / 2;
  for (std::int64_t p = (static_cast<std::int64_t>(dev::block_x()) * dev::block_dim_x() + dev::thread_x()) / kWarp;
       p < pairs; p += warps) {
    const std::int64_t i = 2 * p + lane / kDotLanes;
    float acc = 0.0f;  // as lane_sum's partials, which start at zero
    if (i < n) {
      const float* a = x + static_cast<std::int64_t>(rows[i]) * C;
      const float* b = y + i * C;
      for (int c = j; c < C; c += kDotLanes) acc += a[c] * b[c];
    }
    for (int w = kDotLanes / 2; w > 0; w /= 2) acc += dev::shfl_xor(acc, w);  // partial j + partial j ^ w
    if (j == 0 && i < n) out[i] = acc;
  }
}

// ---------------------------------------------------------------------------------------------
// The operations: `launch(name, blocks, threads, dynamic_shared_bytes, kernel, args...)`.

inline void check_shape(const char* op, int n, int C) {
  if (n < 0 || C < 0)
    throw std::invalid_argument(std::string(op) + ": n " + std::to_string(n) + ", C " + std::to_string(C) +
                                " (neither negative)");
}

// T: the element type (a scaled gather takes fp32 only; a plain one copies any type's bits).
template <class Launch, class T>
void rows_gather(const Launch& launch, T* out, const T* x, const std::int32_t* rows, const float* scale, int n, int C) {
  check_shape("rows_gather", n, C);
  if (n == 0 || C == 0) return;
  const LaunchGeometry g = elementwise_geometry(static_cast<std::int64_t>(n) * C, kThreads);
  if (scale == nullptr) {
    launch("rows_gather_kernel", g.blocks, g.threads, 0, rows_gather_kernel<T>, out, x, rows,
           static_cast<std::int64_t>(n), C);
    return;
  }
  if constexpr (std::is_same_v<T, float>)
    launch("rows_gather_scaled_kernel", g.blocks, g.threads, 0, rows_gather_scaled_kernel, out, x, rows, scale,
           static_cast<std::int64_t>(n), C);
  else
    throw std::invalid_argument("rows_gather: a gather with scale takes fp32 rows");
}

template <class Launch>
void rows_scatter_add(const Launch& launch, float* out, const float* y, const std::int32_t* rows, const float* scale,
                      int n, int C) {
  check_shape("rows_scatter_add", n, C);
  if (n == 0 || C == 0) return;
  const LaunchGeometry g = elementwise_geometry(static_cast<std::int64_t>(n) * C, kThreads);
  launch("rows_scatter_add_kernel", g.blocks, g.threads, 0, rows_scatter_add_kernel, out, y, rows, scale,
         static_cast<std::int64_t>(n), C);
}

// C = 0 writes zeros (an empty sum), as the host's.
template <class Launch>
void rows_dot(const Launch& launch, float* out, const float* x, const std::int32_t* rows, const float* y, int n,
              int C) {
  check_shape("rows_dot", n, C);
  if (n == 0) return;
  const LaunchGeometry g = rows_per_warp_geometry((static_cast<std::int64_t>(n) + 1) / 2, kThreads);
  launch("rows_dot_kernel", g.blocks, g.threads, 0, rows_dot_kernel, out, x, rows, y, static_cast<std::int64_t>(n), C);
}

}  // namespace loom::cuda::experts
