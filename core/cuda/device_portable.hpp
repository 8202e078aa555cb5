#pragma once
// The few device facilities loom's tiled kernels use, under names that compile two ways: with nvcc
// for the GPU (CUDA's intrinsics and nvcuda::wmma), and with the host compiler against the CUDA
// emulator (core/cuda/emu/), so that a CPU unit test runs the kernels' own source. A kernel written
// against these names reads as CUDA: LOOM_KERNEL is __global__, dev::sync_block() __syncthreads(),
// dev::atomic_add_shared atomicAdd, dev::thread_x() threadIdx.x, dev::wmma nvcuda::wmma, dev::bf16_t
// __nv_bfloat16, dev::ballot __ballot_sync, LOOM_SHARED_ARRAY(T, s, n) __shared__ T s[n].
#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <cstdint>

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
LOOM_DEVICE int grid_y() { return static_cast<int>(gridDim.y); }
LOOM_DEVICE float as_float(float f) { return f; }
LOOM_DEVICE float as_float(bf16_t b) { return __bfloat162float(b); }
LOOM_DEVICE float as_float(f16_t h) { return __half2float(h); }
// *p = v in p's type (16 bits: rounded to nearest even).
LOOM_DEVICE void store_as(float* p, float v) { *p = v; }
LOOM_DEVICE void store_as(bf16_t* p, float v) { *p = __float2bfloat16_rn(v); }
LOOM_DEVICE void store_as(f16_t* p, float v) { *p = __float2half_rn(v); }
LOOM_DEVICE void sync_block() { __syncthreads(); }
LOOM_DEVICE void sync_warp() { __syncwarp(); }
template <class T>
LOOM_DEVICE T shfl_xor(T v, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}
template <class T>
LOOM_DEVICE T* shared_memory() {
  extern __shared__ __align__(128) unsigned char loom_dynamic_shared[];
  return reinterpret_cast<T*>(loom_dynamic_shared);
}
// *p += v for a count in shared memory, atomically (integer: the sum does not depend on the order).
LOOM_DEVICE void atomic_add_shared(unsigned* p, unsigned v) { atomicAdd(p, v); }
// Warp votes over all 32 lanes (__ballot_sync, __any_sync with the full mask), and __ffs.
LOOM_DEVICE unsigned ballot(bool p) { return __ballot_sync(0xffffffffu, p); }
LOOM_DEVICE bool any(bool p) { return __any_sync(0xffffffffu, p) != 0; }
LOOM_DEVICE int first_set(unsigned mask) { return __ffs(static_cast<int>(mask)); }  // 1 + the lowest set bit; 0: none
// fp64 -> fp32 rounded toward zero; fp16 bits <-> float (round to nearest even, inf on overflow).
LOOM_DEVICE float double_to_float_rz(double d) { return __double2float_rz(d); }
LOOM_DEVICE unsigned long long double_bits(double d) {
  return static_cast<unsigned long long>(__double_as_longlong(d));
}
LOOM_DEVICE float f16_bits_to_float(std::uint16_t bits) { return __half2float(__ushort_as_half(bits)); }
LOOM_DEVICE std::uint16_t float_to_f16_bits(float x) { return __half_as_ushort(__float2half_rn(x)); }
LOOM_DEVICE float log_f(float x) { return logf(x); }
LOOM_DEVICE double log_d(double x) { return log(x); }
using float4 = ::float4;
LOOM_DEVICE float4 make_float4(float x, float y, float z, float w) { return ::make_float4(x, y, z, w); }
// Four floats from a 16-byte-aligned address in one load; four bf16 (each rounded as to_bf16) to an
// 8-byte-aligned address in one store.
LOOM_DEVICE float4 load_float4(const float* p) { return *reinterpret_cast<const float4*>(p); }
LOOM_DEVICE void store_float4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
// Four 16-bit values (bf16 or fp16 bits) to an 8-byte-aligned address in one store.
struct alignas(8) U16x4 {
  std::uint16_t v[4];
};
LOOM_DEVICE void store_u16x4(std::uint16_t* p, std::uint16_t a, std::uint16_t b, std::uint16_t c, std::uint16_t d) {
  *reinterpret_cast<U16x4*>(p) = U16x4{{a, b, c, d}};
}
struct alignas(8) Bf16x4 {
  bf16_t v[4];
};
LOOM_DEVICE void store_bf16x4(bf16_t* p, float4 f) {
  *reinterpret_cast<Bf16x4*>(p) = Bf16x4{{to_bf16(f.x), to_bf16(f.y), to_bf16(f.z), to_bf16(f.w)}};
}
}  // namespace loom::dev
// A kernel's static shared array (__shared__ T name[n]), __launch_bounds__, and an unroll hint.
#define LOOM_SHARED_ARRAY(T, name, n) __shared__ T name[n]
#define LOOM_LAUNCH_BOUNDS(n) __launch_bounds__(n)
#define LOOM_PRAGMA(x) _Pragma(#x)
#define LOOM_UNROLL(n) LOOM_PRAGMA(unroll n)

#else  // the host emulator
#include <cmath>
#include <cstdint>
#include <cstring>

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
inline int grid_y() { return static_cast<int>(cuda_emu::grid_dim().y); }
inline float as_float(float f) { return f; }
inline float as_float(bf16_t b) { return loom::to_float(b); }
inline float as_float(f16_t h) { return loom::to_float(h); }
inline void store_as(float* p, float v) { *p = v; }
inline void store_as(bf16_t* p, float v) { *p = loom::to_bf16(v); }
inline void store_as(f16_t* p, float v) { *p = loom::to_f16(v); }
inline void sync_block() { cuda_emu::sync_block(); }
inline void sync_warp() { cuda_emu::sync_warp(); }
template <class T>
T shfl_xor(T v, int lane_mask) {
  return cuda_emu::shfl_xor(v, static_cast<unsigned>(lane_mask));
}
template <class T>
T* shared_memory() {
  return reinterpret_cast<T*>(cuda_emu::dynamic_shared());
}
// The emulator's threads switch only at barriers, so a read-modify-write is never interleaved.
inline void atomic_add_shared(unsigned* p, unsigned v) { *p += v; }
inline unsigned ballot(bool p) { return cuda_emu::ballot(p); }
inline bool any(bool p) { return cuda_emu::ballot(p) != 0; }
inline int first_set(unsigned mask) { return __builtin_ffs(static_cast<int>(mask)); }
inline float double_to_float_rz(double d) {
  float f = static_cast<float>(d);  // to nearest; one step toward zero where that rounded away
  if (std::isfinite(d) && std::fabs(static_cast<double>(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);
  return f;
}
inline unsigned long long double_bits(double d) {
  unsigned long long u;
  std::memcpy(&u, &d, sizeof u);
  return u;
}
inline float f16_bits_to_float(std::uint16_t bits) { return loom::to_float(loom::f16{bits}); }
inline std::uint16_t float_to_f16_bits(float x) { return loom::to_f16(x).bits; }
inline float log_f(float x) { return std::log(x); }
inline double log_d(double x) { return std::log(x); }
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
// As the device's, which faults on a misaligned address: so does the emulator.
inline float4 load_float4(const float* p) {
  if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0) cuda_emu::fail("load_float4: address not 16-byte aligned");
  float4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store_float4(float* p, float4 v) {
  if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0) cuda_emu::fail("store_float4: address not 16-byte aligned");
  std::memcpy(p, &v, sizeof v);
}
inline void store_u16x4(std::uint16_t* p, std::uint16_t a, std::uint16_t b, std::uint16_t c, std::uint16_t d) {
  if (reinterpret_cast<std::uintptr_t>(p) % 8 != 0) cuda_emu::fail("store_u16x4: address not 8-byte aligned");
  const std::uint16_t v[4] = {a, b, c, d};
  std::memcpy(p, v, sizeof v);
}
inline void store_bf16x4(bf16_t* p, float4 f) {
  if (reinterpret_cast<std::uintptr_t>(p) % 8 != 0) cuda_emu::fail("store_bf16x4: address not 8-byte aligned");
  const bf16_t v[4] = {to_bf16(f.x), to_bf16(f.y), to_bf16(f.z), to_bf16(f.w)};
  std::memcpy(p, v, sizeof v);
}
}  // namespace loom::dev
   // One array per block, filled with NaN bytes at the block's start, as the dynamic shared memory.
#define LOOM_SHARED_ARRAY(T, name, n)                                                               \
  static char name##_site; /* its address names the array (not const: never merged with another) */ \
  T* const name = static_cast<T*>(::loom::cuda_emu::static_shared(&name##_site, sizeof(T) * (n)))
#define LOOM_LAUNCH_BOUNDS(n)
#define LOOM_UNROLL(n)
#endif
