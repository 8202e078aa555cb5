#pragma once
// A host emulator of the small CUDA subset loom's tiled kernels use (core/cuda/device_portable.hpp),
// so that the kernels' own source runs in CPU unit tests: indexing, tiling, masking and the
// arithmetic are checked without a GPU. Not a performance path, and not the hardware's memory
// model: each block runs alone, its threads as cooperative fibers that switch only at barriers
// (sync_block, sync_warp, a shuffle). A missing barrier before a shuffle, or a deadlock, fails at
// once; a missing barrier between a write and another thread's read shows as a result that
// depends on the order the threads run in (Schedule, below), which a test compares.
//
// What it gives a kernel: its thread and block indices, the block's dynamic shared memory and its
// static shared arrays (filled with 0xff bytes, a NaN in every float and bf16, so a read of a value
// never written shows), block and warp barriers, xor shuffles, warp votes, and the warp
// matrix-multiply-accumulate API (wmma: 16x16x16
// tiles of bf16 operands with fp32 accumulators), whose loads and stores check the hardware's rules:
// a 32-byte aligned pointer and a leading dimension that is a multiple of 16 bytes.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "core/base/dtype.hpp"

namespace loom::cuda_emu {

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3() = default;
  constexpr dim3(unsigned x_, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

// The order in which a block's threads run between barriers. A correct kernel gives the same bits
// in every order (CUDA promises none); one that reads what another warp or lane writes without a
// barrier between gives different ones, or wrong ones, in some order. `sweep` runs every thread in
// turn to its next barrier, so the warps keep step; `warps_ascending` runs warp 0 alone until it
// waits at a block barrier or ends, then warp 1, ...; `warps_descending` runs the last warp first
// and each warp's lanes from the last; `warps_random` runs one warp, drawn at random (seeded), to
// its next barrier at a time, so warps drift apart by several warp barriers, as far as the block
// barriers let them. A test of a kernel runs it in several and compares.
enum class Schedule { sweep, warps_ascending, warps_descending, warps_random };
const char* schedule_name(Schedule s);
// For the launches that follow on the calling thread (default sweep); `seed` starts warps_random's draws.
void set_schedule(Schedule s, unsigned seed = 0);

// Runs body once per thread of every block of `grid`, blocks one after another; `shared_bytes` of
// dynamic shared memory per block. Throws std::runtime_error on a deadlock (threads of a block at
// different barriers) or a broken wmma rule, naming it, and on a launch the device refuses: a block
// of 0 or more than 1024 threads, a grid of 0 blocks or beyond 2^31 - 1 on x and 65535 on y and z,
// more shared memory per block (dynamic and static) than an H100's or H200's 227 KiB.
constexpr std::size_t kMaxSharedPerBlock = 232448;
void launch(dim3 grid, dim3 block, std::size_t shared_bytes, const std::function<void()>& body);

// Inside a launch only.
const dim3& thread_idx();
const dim3& block_idx();
const dim3& block_dim();
const dim3& grid_dim();
unsigned char* dynamic_shared();
unsigned lane();    // the thread's lane in its warp (its index in the block, modulo 32)
void sync_block();  // __syncthreads
void sync_warp();   // __syncwarp (all 32 lanes)
// __shfl_xor_sync over the whole warp: every lane gives `bytes` at `mine` and gets lane
// (lane ^ lane_mask)'s into `theirs`.
void warp_exchange(const void* mine, void* theirs, unsigned lane_mask, std::size_t bytes);
// __ballot_sync over the whole warp: bit k set where lane k's p is true. Every lane of the warp must
// take part (a lane that has returned fails the launch: the device leaves that undefined).
unsigned ballot(bool p);
// A kernel's static __shared__ array (LOOM_SHARED_ARRAY): one per `site` and block, `bytes` long,
// filled with NaN bytes when the block's first thread asks; the block's static arrays together may
// take 48 KiB, the device's limit.
void* static_shared(const void* site, std::size_t bytes);
[[noreturn]] void fail(const std::string& what);  // ends the launch with that message

template <class T>
T shfl_xor(T v, unsigned lane_mask) {
  T out;
  warp_exchange(&v, &out, lane_mask, sizeof(T));
  return out;
}

// nvcuda::wmma, 16x16x16 only. Every lane holds the whole tile (the hardware spreads it over the
// warp in an unspecified way, so a kernel may only touch fragment elements uniformly, which a
// whole copy per lane computes alike).
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the emulator has 16x16x16 tiles only");
  static constexpr int num_elements = 256;
  T x[256];
};

// The hardware spreads a tile's elements over the warp's lanes in an unspecified way, each lane
// reading and writing its share when it reaches the call, with no ordering against other lanes'
// writes: a write to shared memory is there for a wmma load of the tile only after a barrier
// (sync_warp or sync_block) between, which a kernel must have. The emulator is stricter, and so
// finds a missing barrier in some Schedule: each lane loads the whole tile when it reaches the
// call (so it may read before any lane has written), and stores its own share, the elements e with
// e % 32 == its lane (so another lane may read before it has written). A load, mma and store of one
// accumulator tile then adds once, as on the device: a lane's share of the sum depends only on
// the same elements it loaded, which no other lane stores.
inline void check_operand(const void* p, unsigned ldm, std::size_t elem_bytes, const char* what) {
  if (reinterpret_cast<std::uintptr_t>(p) % 32 != 0)
    fail(std::string("wmma ") + what + ": pointer not 32-byte aligned");
  if ((ldm * elem_bytes) % 16 != 0)
    fail(std::string("wmma ") + what + ": leading dimension not a multiple of 16 bytes");
}

// A 16x16 operand tile: x[i][j] = p[i * ldm + j], or p[j * ldm + i] where the memory is the transpose.
template <class T>
void load_tile(T* x, const T* p, unsigned ldm, bool transposed, const char* what) {
  check_operand(p, ldm, sizeof(T), what);
  for (std::size_t i = 0; i < 16; ++i)
    for (std::size_t j = 0; j < 16; ++j) x[i * 16 + j] = transposed ? p[j * ldm + i] : p[i * ldm + j];
}
// matrix_a (m, k) and matrix_b (k, n) alike: element (i, j) at i * ldm + j in row_major, at
// j * ldm + i in col_major.
template <class Use, class T, class Layout>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm) {
  static_assert(std::is_same_v<Layout, row_major> || std::is_same_v<Layout, col_major>,
                "an accumulator is loaded with a layout_t argument");
  load_tile(f.x, p, ldm, std::is_same_v<Layout, col_major>, "load operand");
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ldm, layout_t l) {
  load_tile(f.x, p, ldm, l == mem_col_major, "load accumulator");
}
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm, layout_t l) {
  check_operand(p, ldm, sizeof(float), "store accumulator");
  for (unsigned e = lane(); e < 256; e += 32) {
    const std::size_t m = e / 16, n = e % 16;
    (l == mem_row_major ? p[m * ldm + n] : p[n * ldm + m]) = f.x[e];
  }
}
inline void fill_fragment(fragment<accumulator, 16, 16, 16, float>& f, float v) {
  for (float& e : f.x) e = v;
}

inline float as_float(float v) { return v; }
inline float as_float(bf16 v) { return to_float(v); }

// d = a b + c, products exact in fp32 (as bf16 x bf16 are), summed in fp32.
template <class T, class LA, class LB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, T, LA>& a,
              const fragment<matrix_b, 16, 16, 16, T, LB>& b, const fragment<accumulator, 16, 16, 16, float>& c) {
  float r[256];
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 16; ++n) {
      float s = c.x[m * 16 + n];
      for (int k = 0; k < 16; ++k) s += as_float(a.x[m * 16 + k]) * as_float(b.x[k * 16 + n]);
      r[m * 16 + n] = s;
    }
  std::memcpy(d.x, r, sizeof r);
}

}  // namespace wmma
}  // namespace loom::cuda_emu
