#pragma once
// How the CUDA kernels cut their work into blocks: plain C++ (no CUDA toolkit), so the launch
// wrappers (nvcc), the emulator's tests and the geometry's own unit tests share one definition.
#include <cstdint>

namespace loom::cuda {

struct LaunchGeometry {
  unsigned blocks;
  unsigned threads;
};

// Grid-stride loops over n elements: blocks = min(ceil(n / threads), max_blocks), at least 1
// (threads > 0). The kernels loop, so a capped grid still covers every element.
inline LaunchGeometry elementwise_geometry(std::int64_t n, unsigned threads = 256, unsigned max_blocks = 65535u * 4) {
  const std::int64_t t = threads;
  const std::int64_t want = n > 0 ? (n + t - 1) / t : 1;
  const std::int64_t cap = max_blocks > 0 ? static_cast<std::int64_t>(max_blocks) : 1;
  return LaunchGeometry{static_cast<unsigned>(want < cap ? want : cap), threads};
}

// One warp (32 threads) per row: blocks = ceil(rows * 32 / threads), at least 1, at most the grid's
// x limit 2^31 - 1 (the kernels loop over rows, so the cap only changes how many rows a warp does).
// threads is a multiple of 32.
inline LaunchGeometry rows_per_warp_geometry(std::int64_t rows, unsigned threads = 256) {
  const std::int64_t t = threads;
  const std::int64_t want = rows > 0 ? (rows * 32 + t - 1) / t : 1;
  const std::int64_t cap = 0x7fffffff;
  return LaunchGeometry{static_cast<unsigned>(want < cap ? want : cap), threads};
}

// One block per row, at least 1 and at most 65535 * 4 blocks (the blocks loop when the rows
// outnumber the grid).
inline LaunchGeometry rows_per_block_geometry(std::int64_t rows, unsigned threads) {
  constexpr std::int64_t kMaxRowBlocks = 65535 * 4;
  const std::int64_t want = rows > 0 ? rows : 1;
  return LaunchGeometry{static_cast<unsigned>(want < kMaxRowBlocks ? want : kMaxRowBlocks), threads};
}

}  // namespace loom::cuda
