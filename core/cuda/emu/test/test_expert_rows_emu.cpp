// Mixture of experts' row operations (core/cuda/expert_rows.cuh), their own source compiled for the host
// and run through the CUDA emulator (core/cuda/emu/), against the host's kernels (core/backend/kernels.hpp
// rows_gather, rows_scatter_add, rows_dot): label unit, no GPU or CUDA toolkit needed. Every operation runs
// under every emulator schedule and on a grid of one block, with the same bits each time, and then gives
// the host's bits: gather and scatter_add are one rounding an element, and rows_dot sums each row in
// lane_sum's order (16 partial sums, added pairwise), which half a warp's butterfly reproduces. The shapes
// cover rows of fewer than 16 columns, a multiple of 16 and a ragged tail, and an odd number of rows (a
// warp's second half-warp without a row). The same kernels on a device are held to the host by
// loom_cuda_tests (CudaBackend.ExpertRowsAreTheHosts).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/backend/kernels.hpp"
#include "core/cuda/emu/cuda_emu.hpp"
#include "core/cuda/emu/test/emulated_launch.hpp"
#include "core/cuda/expert_rows.cuh"
#include "core/test/tensors.hpp"

namespace {

namespace experts = loom::cuda::experts;
namespace host = loom::kernels;
using loom::cuda_emu::testing::OnEmulator;
using loom::testing::randn;

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <class T>
std::vector<T> in_every_schedule(const std::function<std::vector<T>(const OnEmulator&)>& run, const std::string& what) {
  return loom::cuda_emu::testing::in_every_schedule(run, same_bits<T>, what);
}

// n distinct rows of a table of `table` rows, in a shuffled order.
std::vector<std::int32_t> distinct_rows(int n, int table, unsigned seed) {
  std::vector<std::int32_t> all(static_cast<std::size_t>(table));
  std::iota(all.begin(), all.end(), 0);
  std::mt19937 g(seed);
  std::shuffle(all.begin(), all.end(), g);
  all.resize(static_cast<std::size_t>(n));
  return all;
}

struct Shape {
  int n, table, C;
};
// C: under one lane group, exactly one, a ragged tail, several; n odd and even.
const Shape kShapes[] = {{1, 3, 5}, {5, 9, 16}, {8, 11, 37}, {13, 20, 100}, {6, 6, 257}};

std::string name(const char* op, const Shape& s) {
  return std::string(op) + " n " + std::to_string(s.n) + " table " + std::to_string(s.table) + " C " +
         std::to_string(s.C);
}

// A plain gather copies any type's bits: fp32, fp64 and 16 bits (the wrapper's bf16 and fp16).
template <class T>
void expect_plain_gather_is_the_hosts(const Shape& s, unsigned seed) {
  const std::int64_t rowsC = std::int64_t(s.table) * s.C, nC = std::int64_t(s.n) * s.C;
  std::vector<T> x(static_cast<std::size_t>(rowsC));
  const std::vector<float> v = randn(x.size(), seed);
  for (std::size_t i = 0; i < x.size(); ++i) {
    if constexpr (std::is_same_v<T, std::uint16_t>)
      x[i] = loom::to_bf16(v[i]).bits;
    else
      x[i] = static_cast<T>(v[i]);
  }
  const std::vector<std::int32_t> rows = distinct_rows(s.n, s.table, seed + 1);
  std::vector<T> want(static_cast<std::size_t>(nC));
  host::rows_gather(want.data(), x.data(), rows.data(), nullptr, s.n, s.C);
  const std::vector<T> got = in_every_schedule<T>(
      [&](const OnEmulator& launch) {
        std::vector<T> out(static_cast<std::size_t>(nC), T(7));
        experts::rows_gather(launch, out.data(), x.data(), rows.data(), nullptr, s.n, s.C);
        return out;
      },
      name("rows_gather", s));
  EXPECT_TRUE(same_bits(got, want)) << name("rows_gather", s) << ", element size " << sizeof(T);
}

TEST(ExpertRowsEmu, PlainGatherCopiesTheRowsOfAnyType) {
  unsigned seed = 1;
  for (const Shape& s : kShapes) {
    expect_plain_gather_is_the_hosts<float>(s, seed);
    expect_plain_gather_is_the_hosts<double>(s, seed + 10);
    expect_plain_gather_is_the_hosts<std::uint16_t>(s, seed + 20);
    seed += 100;
  }
}

TEST(ExpertRowsEmu, ScaledGatherIsTheHosts) {
  unsigned seed = 200;
  for (const Shape& s : kShapes) {
    const std::vector<float> x = randn(std::size_t(s.table) * s.C, seed), scale = randn(std::size_t(s.n), seed + 1);
    const std::vector<std::int32_t> rows = distinct_rows(s.n, s.table, seed + 2);
    std::vector<float> want(std::size_t(s.n) * s.C);
    host::rows_gather(want.data(), x.data(), rows.data(), scale.data(), s.n, s.C);
    const std::vector<float> got = in_every_schedule<float>(
        [&](const OnEmulator& launch) {
          std::vector<float> out(want.size(), 7.0f);
          experts::rows_gather(launch, out.data(), x.data(), rows.data(), scale.data(), s.n, s.C);
          return out;
        },
        name("rows_gather scaled", s));
    EXPECT_TRUE(same_bits(got, want)) << name("rows_gather scaled", s);
    seed += 10;
  }
}

// Only the named rows of out change, each by dst + g * src rounded as the host's.
TEST(ExpertRowsEmu, ScatterAddIsTheHostsAndTouchesOnlyTheRows) {
  unsigned seed = 300;
  for (const Shape& s : kShapes) {
    for (const bool scaled : {true, false}) {
      const std::vector<float> out0 = randn(std::size_t(s.table) * s.C, seed),
                               y = randn(std::size_t(s.n) * s.C, seed + 1), scale = randn(std::size_t(s.n), seed + 2);
      const std::vector<std::int32_t> rows = distinct_rows(s.n, s.table, seed + 3);
      const float* g = scaled ? scale.data() : nullptr;
      std::vector<float> want = out0;
      host::rows_scatter_add(want.data(), y.data(), rows.data(), g, s.n, s.C);
      const std::string what = name(scaled ? "rows_scatter_add scaled" : "rows_scatter_add", s);
      const std::vector<float> got = in_every_schedule<float>(
          [&](const OnEmulator& launch) {
            std::vector<float> out = out0;
            experts::rows_scatter_add(launch, out.data(), y.data(), rows.data(), g, s.n, s.C);
            return out;
          },
          what);
      EXPECT_TRUE(same_bits(got, want)) << what;
      std::vector<bool> named(std::size_t(s.table), false);
      for (const std::int32_t r : rows) named[std::size_t(r)] = true;
      for (int r = 0; r < s.table; ++r) {
        if (named[std::size_t(r)]) continue;
        EXPECT_EQ(0, std::memcmp(got.data() + std::size_t(r) * s.C, out0.data() + std::size_t(r) * s.C,
                                 std::size_t(s.C) * sizeof(float)))
            << what << ": row " << r << " is no expert's, yet changed";
      }
      seed += 10;
    }
  }
}

// Each row's sum in lane_sum's order: the host's bits. A plain left-to-right sum differs from it on
// these inputs (shown once, so the check could fail).
TEST(ExpertRowsEmu, DotSumsInLaneSumOrderBitForBit) {
  unsigned seed = 400;
  bool order_shows = false;
  for (const Shape& s : kShapes) {
    const std::vector<float> x = randn(std::size_t(s.table) * s.C, seed), y = randn(std::size_t(s.n) * s.C, seed + 1);
    const std::vector<std::int32_t> rows = distinct_rows(s.n, s.table, seed + 2);
    std::vector<float> want(std::size_t(s.n));
    host::rows_dot(want.data(), x.data(), rows.data(), y.data(), s.n, s.C);
    const std::vector<float> got = in_every_schedule<float>(
        [&](const OnEmulator& launch) {
          std::vector<float> out(want.size(), 7.0f);
          experts::rows_dot(launch, out.data(), x.data(), rows.data(), y.data(), s.n, s.C);
          return out;
        },
        name("rows_dot", s));
    EXPECT_TRUE(same_bits(got, want)) << name("rows_dot", s);
    for (int i = 0; i < s.n; ++i) {
      float serial = 0.0f;
      for (int c = 0; c < s.C; ++c)
        serial += x[std::size_t(rows[std::size_t(i)]) * s.C + c] * y[std::size_t(i) * s.C + c];
      order_shows = order_shows || std::memcmp(&serial, &want[std::size_t(i)], sizeof(float)) != 0;
    }
    seed += 10;
  }
  EXPECT_TRUE(order_shows) << "no row's lane_sum differs from a serial sum: the check would not see the order";
  // Many rows on a one-block grid: each warp loops over its pairs of rows.
  const Shape big{301, 400, 19};
  const std::vector<float> x = randn(std::size_t(big.table) * big.C, 31), y = randn(std::size_t(big.n) * big.C, 32);
  const std::vector<std::int32_t> rows = distinct_rows(big.n, big.table, 33);
  std::vector<float> want(std::size_t(big.n)), got(std::size_t(big.n), 7.0f);
  host::rows_dot(want.data(), x.data(), rows.data(), y.data(), big.n, big.C);
  experts::rows_dot(OnEmulator{1}, got.data(), x.data(), rows.data(), y.data(), big.n, big.C);
  EXPECT_TRUE(same_bits(got, want)) << name("rows_dot, one block", big);
}

// No rows: nothing launched, nothing written; C = 0: empty sums (zeros) as the host's; refusals.
TEST(ExpertRowsEmu, EmptyCallsAndRefusals) {
  std::vector<float> out(4, 7.0f), x(8, 1.0f), y(8, 2.0f);
  const std::vector<std::int32_t> rows{1, 0};
  experts::rows_gather(OnEmulator{}, out.data(), x.data(), rows.data(), nullptr, 0, 4);
  experts::rows_scatter_add(OnEmulator{}, out.data(), y.data(), rows.data(), nullptr, 0, 4);
  experts::rows_dot(OnEmulator{}, out.data(), x.data(), rows.data(), y.data(), 0, 4);
  EXPECT_EQ(out, std::vector<float>(4, 7.0f));
  experts::rows_dot(OnEmulator{}, out.data(), x.data(), rows.data(), y.data(), 2, 0);
  EXPECT_EQ(out, (std::vector<float>{0.0f, 0.0f, 7.0f, 7.0f}));
  const std::vector<float> scale{1.0f, 2.0f};
  std::vector<double> out64(8), x64(8);
  EXPECT_THROW(experts::rows_gather(OnEmulator{}, out64.data(), x64.data(), rows.data(), scale.data(), 2, 4),
               std::invalid_argument)
      << "a scaled gather takes fp32";
  EXPECT_THROW(experts::rows_gather(OnEmulator{}, out.data(), x.data(), rows.data(), nullptr, -1, 4),
               std::invalid_argument);
  EXPECT_THROW(experts::rows_scatter_add(OnEmulator{}, out.data(), y.data(), rows.data(), nullptr, 2, -4),
               std::invalid_argument);
  EXPECT_THROW(experts::rows_dot(OnEmulator{}, out.data(), x.data(), rows.data(), y.data(), -2, 4),
               std::invalid_argument);
}

}  // namespace
