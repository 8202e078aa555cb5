// The top-k selection's kernels (core/cuda/topk.cuh), their own source compiled for the host and run
// through the CUDA emulator, against the host's selection (core/backend/kernels.hpp topk_select) and the
// full order it defines: label unit, no GPU or CUDA toolkit needed. On a GPU the same kernels are
// held to the host's bits by loom_cuda_tests (CudaBackend.TopKIsBitForBitTheHosts).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/cuda/emu/cuda_emu.hpp"
#include "core/cuda/topk.cuh"
#include "core/backend/kernels.hpp"

namespace {

namespace emu = loom::cuda_emu;
namespace topk = loom::cuda::topk;

struct Selection {
  std::vector<std::int32_t> index;
  std::vector<float> value;
};

Selection run_kernels(const std::vector<float>& x, std::int64_t k, int blocks,
                      emu::Schedule schedule = emu::Schedule::sweep, unsigned seed = 0) {
  struct Restore {
    ~Restore() { emu::set_schedule(emu::Schedule::sweep); }
  } restore;
  emu::set_schedule(schedule, seed);
  // Outputs with a guard past the k entries: a write beyond them shows.
  constexpr std::size_t kGuard = 16;
  Selection s{std::vector<std::int32_t>(static_cast<std::size_t>(k) + kGuard, -7),
              std::vector<float>(static_cast<std::size_t>(k) + kGuard, -7.0f)};
  // Scratch as the device's: never zeroed between uses, so every kernel must write what it reads.
  std::vector<std::uint32_t> scratch(static_cast<std::size_t>(topk::scratch_count(blocks)), 0xdeadbeefu);
  const auto launch = [](const char*, int grid, int threads, std::size_t shared, auto kernel, auto... args) {
    emu::launch(emu::dim3(static_cast<unsigned>(grid)), emu::dim3(static_cast<unsigned>(threads)), shared,
                [&] { kernel(args...); });
  };
  topk::select(launch, s.index.data(), s.value.data(), x.data(), static_cast<std::int64_t>(x.size()), k, scratch.data(),
               blocks);
  for (std::size_t j = static_cast<std::size_t>(k); j < s.index.size(); ++j) {
    EXPECT_EQ(s.index[j], -7) << "index written past k = " << k;
    EXPECT_EQ(s.value[j], -7.0f) << "value written past k = " << k;
  }
  s.index.resize(static_cast<std::size_t>(k));
  s.value.resize(static_cast<std::size_t>(k));
  return s;
}

Selection run_host(const std::vector<float>& x, std::int64_t k) {
  Selection s{std::vector<std::int32_t>(static_cast<std::size_t>(k)), std::vector<float>(static_cast<std::size_t>(k))};
  loom::kernels::topk_select(s.index.data(), s.value.data(), x.data(), static_cast<std::int64_t>(x.size()), k);
  return s;
}

// The first k of (magnitude descending, index ascending), in index order: the definition.
std::vector<std::int32_t> by_full_order(const std::vector<float>& x, std::int64_t k) {
  std::vector<std::int32_t> order(x.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](std::int32_t a, std::int32_t b) { return std::fabs(x[a]) > std::fabs(x[b]); });
  order.resize(static_cast<std::size_t>(k));
  std::sort(order.begin(), order.end());
  return order;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](float p, float q) {
           return loom::math::float_bits(p) == loom::math::float_bits(q);
         });
}

// Inputs that reach each digit: gradient-like normals; few magnitudes (ties everywhere, both signs,
// zeros and -0); values that share their top 11 and 22 bits (the second and third digits decide);
// one repeated value; a spread of exponents with subnormals.
std::vector<float> input(int kind, std::int64_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::vector<float> x(static_cast<std::size_t>(n));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::int64_t i = 0; i < n; ++i) {
    float& v = x[static_cast<std::size_t>(i)];
    switch (kind) {
      case 0:
        v = normal(gen);
        break;
      case 1:
        v = static_cast<float>(static_cast<int>(gen() % 7) - 3) * 0.25f;
        if (v == 0.0f && gen() % 2) v = -0.0f;
        break;
      case 2:
        v = loom::math::bits_as_float(0x3f800000u + (gen() % 5) * 1024u + gen() % 3) * (gen() % 2 ? -1.0f : 1.0f);
        break;
      case 3:
        v = 0.5f;
        break;
      default:
        v = std::ldexp(normal(gen), static_cast<int>(gen() % 250) - 150);
        break;  // subnormals to 2^100, no inf
    }
  }
  return x;
}

}  // namespace

// The kernels give the host's selection, bit for bit, which is the full order's first k: over the
// inputs above, k from 1 to n, on one block of two chunks (the second partial) and on three blocks
// of one partial chunk (and, for n = 1 and 2, empty blocks). (The emulator switches threads with
// swapcontext, a system call each: the 40 runs of the selection here take about a second.)
TEST(TopKEmu, KernelsSelectWhatTheHostSelects) {
  struct Run {
    std::int64_t n;
    std::vector<std::int64_t> ks;
    int blocks;
  };
  const std::vector<Run> runs = {
      {1, {1}, 3}, {2, {1}, 3}, {37, {13, 37}, 1}, {3001, {1, 1001, 3000}, 1}, {3001, {300}, 3}};
  int cases = 0;
  for (int kind = 0; kind < 5; ++kind) {
    for (const Run& run : runs) {
      const std::int64_t n = run.n;
      const std::vector<float> x = input(kind, n, 100u + static_cast<unsigned>(kind) * 7u + static_cast<unsigned>(n));
      for (const std::int64_t k : run.ks) {
        const Selection host = run_host(x, k);
        ASSERT_EQ(host.index, by_full_order(x, k)) << "kind " << kind << ", n " << n << ", k " << k;
        for (int blocks : {run.blocks}) {
          const Selection dev = run_kernels(x, k, blocks);
          EXPECT_EQ(dev.index, host.index) << "kind " << kind << ", n " << n << ", k " << k << ", blocks " << blocks;
          EXPECT_TRUE(same_bits(dev.value, host.value)) << "kind " << kind << ", n " << n << ", k " << k;
          ++cases;
        }
      }
    }
  }
  EXPECT_EQ(cases, 5 * 8);
}

// Two blocks of three chunks each (the write kernel's running counts over chunks, the offsets over
// blocks), in every schedule: the same bits.
TEST(TopKEmu, EveryScheduleGivesTheSameSelection) {
  const std::int64_t n = 10001, k = 101;  // spans of 5001: chunks of 2048, 2048, 905
  for (int kind : {1, 2}) {
    const std::vector<float> x = input(kind, n, 9u + static_cast<unsigned>(kind));
    const Selection host = run_host(x, k);
    for (emu::Schedule s : {emu::Schedule::sweep, emu::Schedule::warps_ascending, emu::Schedule::warps_descending,
                            emu::Schedule::warps_random}) {
      const Selection dev = run_kernels(x, k, 2, s, 3u);
      EXPECT_EQ(dev.index, host.index) << "kind " << kind << ", schedule " << emu::schedule_name(s);
      EXPECT_TRUE(same_bits(dev.value, host.value)) << "kind " << kind << ", schedule " << emu::schedule_name(s);
    }
  }
}

// A NaN or an inf anywhere gives NaN values at indices 0..k-1, as on the host.
TEST(TopKEmu, NonFiniteValuesSendNaN) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    std::vector<float> x = input(0, 5000, 4u);
    x[4321] = bad;
    const Selection dev = run_kernels(x, 50, 3);
    for (int j = 0; j < 50; ++j) {
      EXPECT_EQ(dev.index[static_cast<std::size_t>(j)], j);
      EXPECT_TRUE(std::isnan(dev.value[static_cast<std::size_t>(j)]));
    }
    const Selection host = run_host(x, 50);
    EXPECT_EQ(dev.index, host.index);
  }
}

// The scatters as the compressing reducer uses them: three ranks' pairs added in rank order into a
// zeroed bucket (indices distinct within a rank, shared across ranks), and error feedback's clear of
// what was sent; the host's bits, over more pairs than a block has threads, on the geometry's grid
// and on one block that loops.
TEST(TopKEmu, ScattersAreTheHosts) {
  const std::int64_t n = 3001, k = 700;
  for (const int max_blocks : {0, 1}) {
    std::vector<float> host(static_cast<std::size_t>(n), 0.0f), dev = host;
    const auto launch = [max_blocks](const char*, int grid, int threads, std::size_t shared, auto kernel,
                                     auto... args) {
      if (max_blocks > 0 && grid > max_blocks) grid = max_blocks;
      emu::launch(emu::dim3(static_cast<unsigned>(grid)), emu::dim3(static_cast<unsigned>(threads)), shared,
                  [&] { kernel(args...); });
    };
    for (int rank = 0; rank < 3; ++rank) {
      const std::vector<float> x = input(0, n, 40u + static_cast<unsigned>(rank));
      const Selection s = run_host(x, k);
      loom::kernels::topk_scatter_add(host.data(), s.index.data(), s.value.data(), k);
      topk::scatter(launch, dev.data(), s.index.data(), s.value.data(), k);
    }
    EXPECT_TRUE(same_bits(dev, host)) << "topk_scatter_add, max_blocks " << max_blocks;
    EXPECT_GT(std::count_if(host.begin(), host.end(), [](float v) { return v != 0.0f; }), k)
        << "the ranks' pairs overlap only in part";
    const Selection sent = run_host(host, k);
    loom::kernels::topk_clear(host.data(), sent.index.data(), k);
    topk::scatter(launch, dev.data(), sent.index.data(), static_cast<const float*>(nullptr), k);
    EXPECT_TRUE(same_bits(dev, host)) << "topk_clear, max_blocks " << max_blocks;
    for (const std::int32_t i : sent.index)
      ASSERT_EQ(dev[static_cast<std::size_t>(i)], 0.0f) << "cleared element " << i;
  }
}
