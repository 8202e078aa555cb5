#pragma once
// The few device facilities loom's tiled kernels use, under names that compile two ways: with nvcc
// for the GPU (CUDA's intrinsics and nvcuda::wmma), and with the host compiler against the CUDA
// emulator (core/cuda/emu/), so that a CPU unit test runs the kernels' own source. A kernel written
// against these names reads as CUDA: LOOM_KERNEL is __global__, dev::sync_block() __syncthreads(),
// dev::atomic_add_shared atomicAdd, dev::thread_x() threadIdx.x, dev::wmma nvcuda::wmma, dev::bf16_t
// __nv_bfloat16.
#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#define LOOM_KERNEL __global__
#define LOOM_DEVICE __device__ __forceinline__

namespace loom::dev {
namespace wmma = nvcuda::wmma;
using bf16_t = __nv_bfloat16;
using f16_t = __half;
LOOM_DEVICE bf16_t to_bf16(float f) { return __float2bfloat16_rn(f); }  // round to nearest even
LOOM_DEVICE float to_float(bf16_t b) { return __bfloat162float(b); }
LOOM_DEVICE int thread_x() { return static_cast<int>(threadIdx.x); }
LOOM_DEVICE int block_x() { return static_cast<int>(blockIdx.x); }
LOOM_DEVICE int block_y() { return static_cast<int>(blockIdx.y); }
LOOM_DEVICE int block_dim_x() { return static_cast<int>(blockDim.x); }
LOOM_DEVICE int grid_x() { return static_cast<int>(gridDim.x); }
LOOM_DEVICE float as_float(float f) { return f; }
LOOM_DEVICE float as_float(bf16_t b) { return __bfloat162float(b); }
LOOM_DEVICE float as_float(f16_t h) { return __half2float(h); }
LOOM_DEVICE void sync_block() { __syncthreads(); }
LOOM_DEVICE void sync_warp() { __syncwarp(); }
template <class T>
LOOM_DEVICE T shfl_xor(T v, int lane_mask) { return __shfl_xor_sync(0xffffffffu, v, lane_mask); }
template <class T>
LOOM_DEVICE T* shared_memory() {
  extern __shared__ __align__(128) unsigned char loom_dynamic_shared[];
  return reinterpret_cast<T*>(loom_dynamic_shared);
}
// *p += v for a count in shared memory, atomically (integer: the sum does not depend on the order).
LOOM_DEVICE void atomic_add_shared(unsigned* p, unsigned v) { atomicAdd(p, v); }
}  // namespace loom::dev

#else  // the host emulator
#include "core/cuda/emu/cuda_emu.hpp"

#define LOOM_KERNEL
#define LOOM_DEVICE inline

namespace loom::dev {
namespace wmma = loom::cuda_emu::wmma;
using bf16_t = loom::bf16;
using f16_t = loom::f16;
inline bf16_t to_bf16(float f) { return loom::to_bf16(f); }  // round to nearest even, as the device
inline float to_float(bf16_t b) { return loom::to_float(b); }
inline int thread_x() { return static_cast<int>(cuda_emu::thread_idx().x); }
inline int block_x() { return static_cast<int>(cuda_emu::block_idx().x); }
inline int block_y() { return static_cast<int>(cuda_emu::block_idx().y); }
inline int block_dim_x() { return static_cast<int>(cuda_emu::block_dim().x); }
inline int grid_x() { return static_cast<int>(cuda_emu::grid_dim().x); }
inline float as_float(float f) { return f; }
inline float as_float(bf16_t b) { return loom::to_float(b); }
inline float as_float(f16_t h) { return loom::to_float(h); }
inline void sync_block() { cuda_emu::sync_block(); }
inline void sync_warp() { cuda_emu::sync_warp(); }
template <class T>
T shfl_xor(T v, int lane_mask) { return cuda_emu::shfl_xor(v, static_cast<unsigned>(lane_mask)); }
template <class T>
T* shared_memory() { return reinterpret_cast<T*>(cuda_emu::dynamic_shared()); }
// The emulator's threads switch only at barriers, so a read-modify-write is never interleaved.
inline void atomic_add_shared(unsigned* p, unsigned v) { *p += v; }
}  // namespace loom::dev
#endif
