// The CUDA kernels' launch geometry, checked on the CPU (label unit: no GPU needed). A grid-stride
// kernel covers element i when some thread index t < blocks * threads has t == i mod (blocks *
// threads); a warp-per-row kernel covers row r with warp r mod (blocks * threads / 32).
#include <gtest/gtest.h>

#include <cstdint>

#include "core/cuda/kernels.cuh"

namespace {

using loom::cuda::elementwise_geometry;
using loom::cuda::rows_per_warp_geometry;

TEST(LaunchGeometry, ElementwiseCoversEveryElementWithAtMostOneBlockTooMany) {
  for (std::int64_t n : {1ll, 255ll, 256ll, 257ll, 100003ll, 1ll << 20}) {
    const auto g = elementwise_geometry(n);
    EXPECT_EQ(g.threads, 256u);
    EXPECT_GE(static_cast<std::int64_t>(g.blocks) * g.threads, n) << n;
    EXPECT_LT(static_cast<std::int64_t>(g.blocks - 1) * g.threads, n) << n << ": a whole block with nothing to do";
  }
}

TEST(LaunchGeometry, ElementwiseCapsTheGridAndStillLaunchesForNothing) {
  const auto big = elementwise_geometry(std::int64_t(1) << 40);  // more blocks than a grid may have: loop
  EXPECT_EQ(big.blocks, 65535u * 4);
  EXPECT_EQ(elementwise_geometry(0).blocks, 1u);
  EXPECT_EQ(elementwise_geometry(1000, 128, 3).blocks, 3u);
  EXPECT_EQ(elementwise_geometry(1000, 128, 3).threads, 128u);
}

TEST(LaunchGeometry, OneWarpPerRow) {
  for (std::int64_t rows : {1ll, 7ll, 8ll, 9ll, 8192ll, 12ll * 1024 * 16}) {
    const auto g = rows_per_warp_geometry(rows);
    const std::int64_t warps = static_cast<std::int64_t>(g.blocks) * g.threads / 32;
    EXPECT_GE(warps, rows) << rows;
    EXPECT_LT(warps - rows, g.threads / 32) << rows << ": at most one partly idle block";
  }
  // B * NH * T rows of attention at T 1024, B 1024, NH 64: more warps than a grid holds; the kernels loop.
  EXPECT_EQ(rows_per_warp_geometry(std::int64_t(1) << 40).blocks, 0x7fffffffu);
}

}  // namespace
