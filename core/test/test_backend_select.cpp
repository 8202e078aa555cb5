// Unit tests of what the GPU path shares with the host and decides without a GPU: the device a rank
// drives (core/backend/backend_select.hpp) and the per-element arithmetic both back ends compile
// (core/backend/kernel_math.hpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/backend/backend_select.hpp"
#include "core/base/dtype.hpp"
#include "core/base/error.hpp"
#include "core/backend/kernel_math.hpp"

namespace {

std::string refusal(int local_rank, int ranks_per_node, int devices, const std::string& why = "") {
  try {
    loom::device_for_local_rank(local_rank, ranks_per_node, devices, why);
  } catch (const loom::InputError& e) {
    return e.what();
  }
  return "";
}

TEST(BackendSelect, DeviceIsTheRanksIndexWithinItsNode) {
  for (int r = 0; r < 4; ++r) EXPECT_EQ(loom::device_for_local_rank(r, 4, 4), r);
  EXPECT_EQ(loom::device_for_local_rank(1, 2, 8), 1);  // fewer ranks than devices: the first ones
  EXPECT_EQ(loom::device_for_local_rank(0, 1, 1), 0);
}

TEST(BackendSelect, SharedDevicesGoRoundRobinOnlyWhenAsked) {
  // run.share_gpu: four ranks on two GPUs drive 0, 1, 0, 1; without it the same node is refused.
  for (int r = 0; r < 4; ++r) EXPECT_EQ(loom::device_for_local_rank(r, 4, 2, "", true), r % 2);
  EXPECT_EQ(loom::device_for_local_rank(1, 2, 1, "", true), 0);
  EXPECT_THROW(loom::device_for_local_rank(1, 2, 1), loom::InputError);
  EXPECT_THROW(loom::device_for_local_rank(0, 1, 0, "", true), loom::InputError) << "sharing needs a GPU";
}

// The node's ranks, each with the devices it sees (identities, in the order of its ordinals).
std::vector<int> devices_of(const std::vector<loom::DeviceIds>& seen, bool share = false) {
  std::vector<int> d;
  for (int r = 0; r < static_cast<int>(seen.size()); ++r) d.push_back(loom::device_for_local_rank(r, seen, "", share));
  return d;
}
std::string node_refusal(const std::vector<loom::DeviceIds>& seen) {
  try {
    devices_of(seen);
  } catch (const loom::InputError& e) {
    return e.what();
  }
  return "";
}

TEST(BackendSelect, EachRankDrivesADeviceOfItsOwnWhateverItSees) {
  // Every rank sees the node's four GPUs: rank i drives device i.
  const loom::DeviceIds all{"a", "b", "c", "d"};
  EXPECT_EQ(devices_of({all, all, all, all}), (std::vector<int>{0, 1, 2, 3}));
  // The scheduler gives each rank one GPU (Slurm --gpus-per-task=1 or --gpu-bind, a cgroup per task,
  // CUDA_VISIBLE_DEVICES per rank): each sees one device, its ordinal 0, and drives it. This node was
  // refused before ("4 ranks on this node but 1 CUDA device").
  EXPECT_EQ(devices_of({{"a"}, {"b"}, {"c"}, {"d"}}), (std::vector<int>{0, 0, 0, 0}));
  // Two GPUs per rank, in their own order: each rank its first.
  EXPECT_EQ(devices_of({{"b", "a"}, {"d", "c"}}), (std::vector<int>{0, 0}));
  // An earlier rank gives up its first choice for a later rank that sees only that one.
  EXPECT_EQ(devices_of({{"a", "b"}, {"a"}, {"c"}}), (std::vector<int>{1, 0, 0}));
}

TEST(BackendSelect, RanksThatCannotEachHaveADeviceAreRefused) {
  // Two ranks given the same GPU: one device for two ranks, said as before; shared when asked.
  std::string e = node_refusal({{"a"}, {"a"}});
  EXPECT_NE(e.find("2 ranks on this node but 1 CUDA device (one device per rank)"), std::string::npos) << e;
  EXPECT_EQ(devices_of({{"a"}, {"a"}}, true), (std::vector<int>{0, 0}));
  // As many devices as ranks in all, but two ranks see only the same one.
  e = node_refusal({{"a"}, {"a"}, {"b", "c"}});
  EXPECT_NE(e.find("the 3 ranks of this node see 3 CUDA devices in all, but not so that each can drive one of "
                   "its own (local rank 1 sees 1)"),
            std::string::npos)
      << e;
  // Every rank refuses alike: it is the node's assignment, not the rank's own, that fails.
  for (int r = 0; r < 3; ++r)
    EXPECT_THROW(loom::device_for_local_rank(r, {{"a"}, {"a"}, {"b", "c"}}), loom::InputError) << "rank " << r;
}

TEST(BackendSelect, ANodeWithoutDevicesIsRefusedSayingWhy) {
  const std::string e = refusal(0, 1, 0, "CUDA driver version is insufficient for CUDA runtime version");
  EXPECT_NE(e.find("no CUDA device is visible"), std::string::npos) << e;
  EXPECT_NE(e.find("CUDA driver version is insufficient"), std::string::npos) << e;
  EXPECT_NE(e.find("run.backend = host"), std::string::npos) << e;
}

TEST(BackendSelect, MoreRanksThanDevicesOnANodeIsRefused) {
  const std::string e = refusal(3, 4, 2);
  EXPECT_NE(e.find("4 ranks on this node but 2 CUDA devices"), std::string::npos) << e;
  EXPECT_NE(e.find("at most 2 ranks per node"), std::string::npos) << e;
  EXPECT_NE(e.find("run.share_gpu = true"), std::string::npos) << e;
  EXPECT_EQ(refusal(0, 4, 2), e) << "every rank of an over-full node is refused alike, the first too";
}

// ---- the shared arithmetic ----------------------------------------------------------------------

TEST(KernelMath, Bf16RoundingIsTheHostConversionBitForBit) {
  std::mt19937 gen(7);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    const std::uint32_t u = bits(gen);
    float f;
    std::memcpy(&f, &u, sizeof f);
    ASSERT_EQ(loom::math::bf16_bits(f), loom::to_bf16(f).bits) << std::hex << u;
    const std::uint16_t b = static_cast<std::uint16_t>(u);
    const float back = loom::math::bf16_value(b), host = loom::to_float(loom::bf16{b});
    ASSERT_EQ(std::memcmp(&back, &host, sizeof back), 0) << std::hex << b;
  }
  // Ties go to even, NaN stays NaN.
  EXPECT_EQ(loom::math::bf16_bits(1.0f + 1.0f / 256), 0x3f80);  // tie between 1 and 1 + 2^-7: even
  EXPECT_EQ(loom::math::bf16_bits(1.0f + 3.0f / 256), 0x3f82);  // tie: up to the even neighbour
  EXPECT_TRUE(std::isnan(loom::math::bf16_value(loom::math::bf16_bits(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(KernelMath, GeluBackwardIsTheDerivativeOfGeluForward) {
  for (double x = -6.0; x <= 6.0; x += 0.37) {
    const double h = 1e-6;
    const double fd = (loom::math::gelu_forward(x + h) - loom::math::gelu_forward(x - h)) / (2 * h);
    EXPECT_NEAR(loom::math::gelu_backward(x, 1.0), fd, 1e-8 * (1 + std::fabs(fd))) << x;
    EXPECT_NEAR(loom::math::gelu_backward(x, -2.5), -2.5 * fd, 3e-8 * (1 + std::fabs(fd))) << x;
  }
  // float agrees with double to float rounding (the polynomial exp/tanh of the float path).
  for (float x = -8.0f; x <= 8.0f; x += 0.173f) {
    const double ref = loom::math::gelu_forward(static_cast<double>(x));
    EXPECT_NEAR(loom::math::gelu_forward(x), ref, 4e-7 * (1 + std::fabs(ref))) << x;
  }
}

TEST(KernelMath, LayerNormDinpIsTheDerivativeOfTheNormalisedRow) {
  // One row of C values: d/dx_c of sum_j g_j * layernorm_out(x)_j, by central differences.
  const int C = 7;
  double x[C] = {0.3, -1.2, 2.0, 0.7, -0.4, 1.1, -2.2}, w[C] = {1.0, 0.5, -0.7, 2.0, 1.3, -0.2, 0.9};
  const double b[C] = {0.1, 0.0, -0.3, 0.2, 0.0, 0.5, -0.1}, g[C] = {0.7, -1.0, 0.4, 0.2, -0.6, 1.5, 0.3};
  const auto objective = [&](const double* v) {
    double m = 0, var = 0, sum = 0;
    for (int c = 0; c < C; ++c) m += v[c] / C;
    for (int c = 0; c < C; ++c) var += (v[c] - m) * (v[c] - m) / C;
    const double s = loom::math::layernorm_rstd(var);
    for (int c = 0; c < C; ++c) sum += g[c] * loom::math::layernorm_out(v[c], m, s, w[c], b[c]);
    return sum;
  };
  double m = 0, var = 0;
  for (int c = 0; c < C; ++c) m += x[c] / C;
  for (int c = 0; c < C; ++c) var += (x[c] - m) * (x[c] - m) / C;
  const double s = loom::math::layernorm_rstd(var);
  double dnorm_mean = 0, dnorm_norm_mean = 0;
  for (int c = 0; c < C; ++c) {
    dnorm_mean += w[c] * g[c] / C;
    dnorm_norm_mean += w[c] * g[c] * (x[c] - m) * s / C;
  }
  for (int c = 0; c < C; ++c) {
    const double h = 1e-6, keep = x[c];
    x[c] = keep + h;
    const double up = objective(x);
    x[c] = keep - h;
    const double down = objective(x);
    x[c] = keep;
    const double fd = (up - down) / (2 * h);
    EXPECT_NEAR(loom::math::layernorm_dinp(x[c], m, s, w[c], g[c], dnorm_mean, dnorm_norm_mean), fd, 1e-7) << c;
  }
}

TEST(KernelMath, CrossEntropyAndSoftmaxGradients) {
  EXPECT_DOUBLE_EQ(loom::math::crossentropy_dlogit(0.25, true, 2.0), -1.5);
  EXPECT_DOUBLE_EQ(loom::math::crossentropy_dlogit(0.25, false, 2.0), 0.5);
  EXPECT_DOUBLE_EQ(loom::math::softmax_backward(0.5, 3.0, 1.0), 1.0);
}

}  // namespace
