// Ring attention's kernels (core/cuda/ring_attention.cuh), their own source compiled for the host and
// run through the CUDA emulator (core/cuda/emu/), against the host's twin (core/backend/ring_attention_host.hpp):
// label unit, no GPU or CUDA toolkit needed. Each case is one rank's two ring steps: the forward
// merges two blocks of keys and values into a running (out, lse) that starts empty, the backward adds
// both blocks' gradients; queries from q_begin, blocks of kv_rows keys, causal or not, bf16 operands or
// fp32, the saved output in fp32, bf16 or fp16. Every operation runs under every emulator schedule and
// on a grid of one block, with the same bits each time (a missing barrier, or a result that depends on
// which warp takes which row, shows), and then matches the host within
//   max |device - host| <= tol * max |host| + 1e-6 (per tensor; lse and dsum over the rows reached),
// tol = 1e-5 with fp32 operands (the same arithmetic, sums in another order; measured up to 1.3e-6).
// With bf16 operands both round the same values at the same points, but a sum in another order now and
// then tips a rounding of a probability or a score gradient by 2^-8 of it: tol = 1e-4 for the forward
// and 5e-4 for the backward, whose score gradients cancel (measured over 72 runs of these shapes with
// other seeds: up to 6.6e-7 and 1e-4). Probabilities left unrounded in the forward's p v, or score
// gradients in dk, miss them (4e-4 to 1.1e-3 in out, 1.2e-3 to 2e-3 in dk: tried). The same
// kernels on a device are held to the host by loom_cuda_tests (CudaBackend.RingAttentionMatchesTheHost).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/backend/ring_attention_host.hpp"
#include "core/cuda/emu/cuda_emu.hpp"
#include "core/cuda/emu/test/emulated_launch.hpp"
#include "core/cuda/ring_attention.cuh"
#include "core/test/tensors.hpp"

namespace {

namespace emu = loom::cuda_emu;
namespace ring = loom::cuda::ring;
namespace host = loom::kernels::ring;
using loom::testing::randn;

using loom::cuda_emu::testing::OnEmulator;

using Tensors = std::vector<std::vector<float>>;

bool same_bits(const Tensors& a, const Tensors& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0)
      return false;
  return true;
}

// The operations' outputs under every schedule and on one block, bit for bit (emulated_launch.hpp).
Tensors in_every_schedule(const std::function<Tensors(const OnEmulator&)>& run, const std::string& what) {
  return loom::cuda_emu::testing::in_every_schedule(run, same_bits, what);
}

// max |got - want| / max |want| (the gap the bounds above state), and whether it holds.
double gap(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0.0, top = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, std::fabs(double(got[i]) - double(want[i])));
    top = std::max(top, std::fabs(double(want[i])));
  }
  return top > 0.0 ? diff / top : diff;
}
::testing::AssertionResult close(const std::vector<float>& got, const std::vector<float>& want, double tol) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "sizes differ";
  double diff = 0.0, top = 0.0;
  std::size_t worst = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double d = std::fabs(double(got[i]) - double(want[i]));
    if (!(d <= diff)) diff = d, worst = i;  // a NaN is the worst
    top = std::max(top, std::fabs(double(want[i])));
  }
  if (diff <= tol * top + 1e-6) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "max |device - host| = " << diff << " at element " << worst << " (device "
                                       << got[worst] << ", host " << want[worst] << "), over " << tol
                                       << " * max |host| " << top << " + 1e-6";
}

struct Case {
  int B, T, C, NH;
  int q_begin;   // this rank's queries [q_begin, T)
  int kv_rows1;  // the first block's keys (its own: causal if `causal`)
  int kv_rows2;  // the second block's (another rank's: never causal)
  bool causal, bf16;
  loom::DType saved;  // the final output as the backward takes it
  std::string name() const {
    char s[200];
    std::snprintf(s, sizeof s, "B %d T %d C %d NH %d q_begin %d kv_rows %d,%d %s %s saved %s", B, T, C, NH, q_begin,
                  kv_rows1, kv_rows2, causal ? "causal" : "full", bf16 ? "bf16" : "fp32", loom::dtype_name(saved));
    return s;
  }
};

struct Inputs {
  std::vector<float> qkv, kv1, kv2, out0, lse0, dout, dqkv0, dkv0;
};

Inputs inputs(const Case& c, unsigned seed) {
  const std::size_t n = std::size_t(c.B) * c.T * c.C, nr = std::size_t(c.B) * c.NH * c.T;
  Inputs in;
  in.qkv = randn(3 * n, seed, 1.5f);  // scores of a few units: the maximum matters
  in.kv1 = randn(2 * n, seed + 1, 1.5f);
  in.kv2 = randn(2 * n, seed + 2, 1.5f);
  in.out0 = randn(n, seed + 3);  // a finite output under the empty rows, as the model's zeroed one
  in.lse0.assign(nr, host::kEmptyRow);
  in.dout = randn(n, seed + 4);
  in.dqkv0 = randn(3 * n, seed + 5);  // the gradients accumulate
  in.dkv0 = randn(2 * n, seed + 6);
  return in;
}

template <class Saved>
std::vector<Saved> saved_as(const std::vector<float>& out) {
  std::vector<Saved> s(out.size());
  for (std::size_t i = 0; i < out.size(); ++i) s[i] = loom::from_acc<Saved>(out[i]);
  return s;
}

// The two steps' forward (out, lse after the first block, and after both), on the host twin or on the
// emulated device through `launch`.
Tensors forward_host(const Case& c, const Inputs& in) {
  std::vector<float> out = in.out0, lse = in.lse0;
  host::forward(out.data(), lse.data(), in.qkv.data(), in.kv1.data(), c.B, c.T, c.C, c.NH, c.q_begin, c.kv_rows1,
                c.causal, c.bf16);
  const std::vector<float> out1 = out, lse1 = lse;
  host::forward(out.data(), lse.data(), in.qkv.data(), in.kv2.data(), c.B, c.T, c.C, c.NH, c.q_begin, c.kv_rows2, false,
                c.bf16);
  return {out1, lse1, out, lse};
}
Tensors forward_device(const OnEmulator& launch, const Case& c, const Inputs& in) {
  std::vector<float> out = in.out0, lse = in.lse0;
  ring::attention_ring_forward(launch, out.data(), lse.data(), in.qkv.data(), in.kv1.data(), c.B, c.T, c.C, c.NH,
                               c.q_begin, c.kv_rows1, c.causal, c.bf16);
  const std::vector<float> out1 = out, lse1 = lse;
  ring::attention_ring_forward(launch, out.data(), lse.data(), in.qkv.data(), in.kv2.data(), c.B, c.T, c.C, c.NH,
                               c.q_begin, c.kv_rows2, false, c.bf16);
  return {out1, lse1, out, lse};
}

// The two steps' backward (dqkv; dkv of each block; dsum) from one final (out, lse), the host's, so
// that each side's backward takes the same inputs (a saved 16-bit output rounded from two forwards
// would differ where a rounding tips).
template <class Saved>
Tensors backward_host(const Case& c, const Inputs& in, const std::vector<Saved>& saved, const std::vector<float>& lse) {
  std::vector<float> dqkv = in.dqkv0, dkv1 = in.dkv0, dkv2 = in.dkv0, dsum(lse.size(), 0.0f);
  host::backward(dqkv.data(), dkv1.data(), dsum.data(), in.dout.data(), saved.data(), in.qkv.data(), in.kv1.data(),
                 lse.data(), c.B, c.T, c.C, c.NH, c.q_begin, c.kv_rows1, c.causal, c.bf16);
  host::backward(dqkv.data(), dkv2.data(), dsum.data(), in.dout.data(), saved.data(), in.qkv.data(), in.kv2.data(),
                 lse.data(), c.B, c.T, c.C, c.NH, c.q_begin, c.kv_rows2, false, c.bf16);
  return {dqkv, dkv1, dkv2, dsum};
}
template <class Saved>
Tensors backward_device(const OnEmulator& launch, const Case& c, const Inputs& in, const std::vector<Saved>& saved,
                        const std::vector<float>& lse) {
  std::vector<float> dqkv = in.dqkv0, dkv1 = in.dkv0, dkv2 = in.dkv0, dsum(lse.size(), 0.0f);
  ring::attention_ring_backward(launch, dqkv.data(), dkv1.data(), dsum.data(), in.dout.data(), saved.data(),
                                in.qkv.data(), in.kv1.data(), lse.data(), c.B, c.T, c.C, c.NH, c.q_begin, c.kv_rows1,
                                c.causal, c.bf16);
  ring::attention_ring_backward(launch, dqkv.data(), dkv2.data(), dsum.data(), in.dout.data(), saved.data(),
                                in.qkv.data(), in.kv2.data(), lse.data(), c.B, c.T, c.C, c.NH, c.q_begin, c.kv_rows2,
                                false, c.bf16);
  return {dqkv, dkv1, dkv2, dsum};
}

// Rows [q_begin, T) of a [B,NH,T] tensor: the rows a call reaches (the others hold -1e30 in lse, which
// no relative bound may take as its scale).
std::vector<float> reached(const Case& c, const std::vector<float>& x) {
  std::vector<float> r;
  for (int bh = 0; bh < c.B * c.NH; ++bh)
    for (int t = c.q_begin; t < c.T; ++t) r.push_back(x[std::size_t(bh) * c.T + t]);
  return r;
}

constexpr double kFp32Tolerance = 1e-5, kBf16ForwardTolerance = 1e-4, kBf16BackwardTolerance = 5e-4;

template <class Saved>
void check_case(const Case& c, unsigned seed) {
  const std::string what = c.name();
  const Inputs in = inputs(c, seed);
  Tensors got =
      in_every_schedule([&](const OnEmulator& launch) { return forward_device(launch, c, in); }, what + ", forward");
  Tensors want = forward_host(c, in);
  const std::vector<Saved> saved = saved_as<Saved>(want[2]);
  const std::vector<float> lse = want[3];
  const Tensors got_b = in_every_schedule(
      [&](const OnEmulator& launch) { return backward_device<Saved>(launch, c, in, saved, lse); }, what + ", backward");
  const Tensors want_b = backward_host<Saved>(c, in, saved, lse);
  got.insert(got.end(), got_b.begin(), got_b.end());
  want.insert(want.end(), want_b.begin(), want_b.end());
  const char* names[] = {"out (one block)",   "lse (one block)",    "out", "lse", "dqkv",
                         "dkv (first block)", "dkv (second block)", "dsum"};
  std::printf("%s: max gaps", what.c_str());
  for (std::size_t i = 0; i < want.size(); ++i) {
    for (float x : got[i]) ASSERT_TRUE(std::isfinite(x)) << what << ": " << names[i] << " not finite";
    const double tol = !c.bf16 ? kFp32Tolerance : i < 4 ? kBf16ForwardTolerance : kBf16BackwardTolerance;
    const bool rows = i == 1 || i == 3 || i == 7;  // [B,NH,T]: the reached rows
    const std::vector<float> a = rows ? reached(c, got[i]) : got[i], b = rows ? reached(c, want[i]) : want[i];
    EXPECT_TRUE(close(a, b, tol)) << what << ": " << names[i];
    std::printf(" %s %.1e", names[i], gap(a, b));
  }
  std::printf("\n");
  // What the operations must not touch, bit for bit: rows before q_begin of out, lse and dqkv; dqkv's
  // k and v columns; dkv's rows from kv_rows on.
  const int T = c.T, C = c.C, NH = c.NH;
  for (int b = 0; b < c.B; ++b)
    for (int t = 0; t < T; ++t) {
      const std::size_t r = std::size_t(b) * T + t;
      for (int x = 0; x < 3 * C; ++x)
        if (t < c.q_begin || x >= C) {
          ASSERT_EQ(got[4][r * 3 * C + x], in.dqkv0[r * 3 * C + x]) << what << ": dqkv row " << t << " column " << x;
        }
      for (int x = 0; x < 2 * C; ++x) {
        if (t >= c.kv_rows1) {
          ASSERT_EQ(got[5][r * 2 * C + x], in.dkv0[r * 2 * C + x]) << what << ": first block's dkv row " << t;
        }
        if (t >= c.kv_rows2) {
          ASSERT_EQ(got[6][r * 2 * C + x], in.dkv0[r * 2 * C + x]) << what << ": second block's dkv row " << t;
        }
      }
      if (t >= c.q_begin) continue;
      for (int x = 0; x < C; ++x) ASSERT_EQ(got[2][r * C + x], in.out0[r * C + x]) << what << ": out row " << t;
      for (int h = 0; h < NH; ++h)
        ASSERT_EQ(got[3][(std::size_t(b) * NH + h) * T + t], host::kEmptyRow) << what << ": lse row " << t;
    }
}

void check(const Case& c, unsigned seed) {
  switch (c.saved) {
    case loom::DType::f32:
      return check_case<float>(c, seed);
    case loom::DType::bf16:
      return check_case<loom::bf16>(c, seed);
    case loom::DType::f16:
      return check_case<loom::f16>(c, seed);
    default:
      FAIL() << "saved output type";
  }
}

using loom::DType;

// fp32 operands: head sizes of 32, 48 (lanes with two columns and with one) and 4 (lanes with none);
// T neither a multiple of 32 nor of the host's 64-row blocks; the own block causal or not.
TEST(RingAttentionEmu, Fp32MatchesTheHost) {
  check({2, 70, 64, 2, 0, 70, 45, true, false, DType::f32}, 1);
  check({1, 67, 96, 2, 13, 50, 67, false, false, DType::f32}, 2);
  check({2, 33, 16, 4, 5, 33, 20, true, false, DType::bf16}, 3);
  check({1, 130, 32, 2, 70, 130, 64, true, false, DType::f16}, 4);
}

TEST(RingAttentionEmu, Bf16OperandsMatchTheHost) {
  check({2, 70, 64, 2, 0, 70, 45, true, true, DType::bf16}, 5);
  check({1, 67, 96, 2, 13, 50, 67, false, true, DType::f32}, 6);
  check({2, 33, 16, 4, 5, 33, 20, true, true, DType::f16}, 7);
  check({1, 130, 32, 2, 70, 130, 64, false, true, DType::bf16}, 8);
}

TEST(RingAttentionEmu, HeadSize128) {
  check({1, 40, 256, 2, 0, 40, 17, true, false, DType::f32}, 9);
  check({1, 40, 256, 2, 9, 40, 40, true, true, DType::bf16}, 10);
}

// A block of no keys changes nothing; shapes outside the contract are refused before any launch.
TEST(RingAttentionEmu, EmptyBlocksAndBadShapes) {
  const int B = 1, T = 9, C = 8, NH = 2;
  const Case c{B, T, C, NH, 0, 0, 0, false, false, DType::f32};
  const Inputs in = inputs(c, 11);
  std::vector<float> out = in.out0, lse = in.lse0;
  ring::attention_ring_forward(OnEmulator{}, out.data(), lse.data(), in.qkv.data(), in.kv1.data(), B, T, C, NH, 0, 0,
                               false, false);
  EXPECT_EQ(out, in.out0);
  EXPECT_EQ(lse, in.lse0);
  EXPECT_THROW(ring::attention_ring_forward(OnEmulator{}, out.data(), lse.data(), in.qkv.data(), in.kv1.data(), B, T, C,
                                            NH, T + 1, T, false, false),
               std::invalid_argument);
  EXPECT_THROW(ring::attention_ring_forward(OnEmulator{}, out.data(), lse.data(), in.qkv.data(), in.kv1.data(), B, T, C,
                                            NH, 0, T + 1, false, false),
               std::invalid_argument);
  EXPECT_THROW(ring::attention_ring_forward(OnEmulator{}, out.data(), lse.data(), in.qkv.data(), in.kv1.data(), B, T, C,
                                            3, 0, T, false, false),
               std::invalid_argument);
}

// copy_rows: a strided block of rows into another, nothing else of dst touched; on a grid of one
// block too (the grid-stride loop).
TEST(RingAttentionEmu, CopyRowsCopiesTheBlockOnly) {
  const std::int64_t rows = 7, cols = 13, dst_ld = 20, src_ld = 17;
  const auto src = randn(std::size_t(rows * src_ld), 21), dst0 = randn(std::size_t(rows * dst_ld), 22);
  std::vector<float> want = dst0;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) want[std::size_t(r * dst_ld + c)] = src[std::size_t(r * src_ld + c)];
  const Tensors got = in_every_schedule(
      [&](const OnEmulator& launch) {
        std::vector<float> dst = dst0;
        ring::copy_rows(launch, dst.data(), src.data(), rows, cols, dst_ld, src_ld);
        return Tensors{dst};
      },
      "copy_rows");
  EXPECT_EQ(got[0], want);
  std::vector<float> dst = dst0;
  ring::copy_rows(OnEmulator{}, dst.data(), src.data(), 0, cols, dst_ld, src_ld);
  EXPECT_EQ(dst, dst0) << "no rows";
}

}  // namespace
