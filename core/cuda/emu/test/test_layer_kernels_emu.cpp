// The CUDA layer kernels' own source (core/cuda/layer_kernels.cuh), with the launch geometry the
// device uses, run on the CPU through the CUDA emulator against their host twins (core/backend/kernels.hpp):
// label unit, no GPU or CUDA toolkit needed. Each operation runs under every emulator schedule and
// must give the same bits in each (a missing barrier or a warp-order dependence shows), and then
// match the host as loom_cuda_tests holds the device to it (bit for bit where the arithmetic is the
// shared per-element code; within a stated relative error, against the tensor's norm, where a row or
// column is summed in a tree instead of a loop). Small shapes: the emulator runs every thread.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "core/cuda/emu/cuda_emu.hpp"
#include "core/cuda/emu/test/emulated_launch.hpp"
#include "core/cuda/layer_kernels.cuh"
#include "core/backend/kernels.hpp"
#include "core/test/tensors.hpp"

namespace {

namespace emu = loom::cuda_emu;
namespace layer = loom::cuda::layer;
using loom::DType;

using loom::cuda_emu::testing::OnEmulator;

using loom::testing::randn;
using loom::testing::rel_err;

// The four storage types, as tags.
struct F64 {
  using type = double;
};
struct F32 {
  using type = float;
};
struct BF16 {
  using type = loom::bf16;
};
struct F16 {
  using type = loom::f16;
};

template <class T>
std::vector<unsigned char> bits_of(const std::vector<T>& v) {
  std::vector<unsigned char> b(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// The emulated operation's outputs' bits under every schedule and on one block (emulated_launch.hpp).
using Bits = std::vector<std::vector<unsigned char>>;
Bits in_every_schedule(const std::function<Bits(const OnEmulator&)>& run) {
  return loom::cuda_emu::testing::in_every_schedule(run, std::equal_to<Bits>());
}

template <class T>
std::vector<T> from_bits(const std::vector<unsigned char>& b) {
  std::vector<T> v(b.size() / sizeof(T));
  if (!v.empty()) std::memcpy(v.data(), b.data(), b.size());
  return v;
}

TEST(LayerKernelsEmu, EncoderForwardAndBackwardAreTheHostsBitForBit) {
  const int B = 2, T = 17, C = 40, V = 50, vb = 10, ve = 35, N = B * T;  // a tensor-parallel shard of the vocabulary
  std::vector<std::int32_t> tok(N);
  std::mt19937 g(1);
  for (auto& t : tok) t = std::int32_t(g() % V);  // repeats, and tokens on both sides of the shard
  const auto wte = randn(std::size_t(ve - vb) * C, 2), wpe = randn(std::size_t(T) * C, 3);
  const auto dout = randn(std::size_t(N) * C, 4), dwte0 = randn(wte.size(), 5), dwpe0 = randn(wpe.size(), 6);
  for (bool pos : {true, false}) {
    const Bits got = in_every_schedule([&](const OnEmulator& launch) {
      std::vector<float> out(std::size_t(N) * C, -1.0f);
      layer::encoder_forward(launch, out.data(), tok.data(), wte.data(), wpe.data(), B, T, C, vb, ve, pos);
      return Bits{bits_of(out)};
    });
    std::vector<float> want(std::size_t(N) * C);
    loom::kernels::encoder_forward(want.data(), tok.data(), wte.data(), wpe.data(), B, T, C, vb, ve, pos);
    EXPECT_EQ(from_bits<float>(got[0]), want) << "add_pos " << pos;
  }
  const Bits got = in_every_schedule([&](const OnEmulator& launch) {
    std::vector<float> dwte = dwte0, dwpe = dwpe0;
    layer::encoder_backward(launch, dwte.data(), dwpe.data(), dout.data(), tok.data(), B, T, C, vb, ve);
    return Bits{bits_of(dwte), bits_of(dwpe)};
  });
  std::vector<float> dwte = dwte0, dwpe = dwpe0;
  loom::kernels::encoder_backward(dwte.data(), dwpe.data(), dout.data(), tok.data(), B, T, C, vb, ve);
  EXPECT_EQ(from_bits<float>(got[0]), dwte) << "a token's rows added in row order, as the host";
  EXPECT_EQ(from_bits<float>(got[1]), dwpe);
}

// The fused residual add + LayerNorm kernel: the residual and LayerNorm kernels it replaces, bit
// for bit, in every schedule the emulator runs.
TEST(LayerKernelsEmu, ResidualLayerNormIsTheTwoKernelsBitForBit) {
  const int N = 19, C = 37;  // C: lanes with two columns, lanes with one
  const auto a = randn(std::size_t(N) * C, 11, 2.0f), b = randn(std::size_t(N) * C, 12), w = randn(C, 13),
             bias = randn(C, 14);
  const Bits fused = in_every_schedule([&](const OnEmulator& launch) {
    std::vector<float> r(a.size()), o(a.size()), m(N), s(N);
    layer::residual_layernorm_forward(launch, r.data(), o.data(), m.data(), s.data(), a.data(), b.data(), w.data(),
                                      bias.data(), N, C);
    return Bits{bits_of(r), bits_of(o), bits_of(m), bits_of(s)};
  });
  const Bits apart = in_every_schedule([&](const OnEmulator& launch) {
    std::vector<float> r(a.size()), o(a.size()), m(N), s(N);
    layer::residual_forward(launch, r.data(), a.data(), b.data(), std::int64_t(a.size()));
    layer::layernorm_forward(launch, o.data(), m.data(), s.data(), r.data(), w.data(), bias.data(), N, C);
    return Bits{bits_of(r), bits_of(o), bits_of(m), bits_of(s)};
  });
  EXPECT_EQ(fused, apart);
}

TEST(LayerKernelsEmu, LayerNormForwardAndBackward) {
  const int N = 19, C = 37;  // C: a partial last tile of columns, and lanes without a column
  const auto inp = randn(std::size_t(N) * C, 1, 2.0f), w = randn(C, 2), b = randn(C, 3),
             dout = randn(std::size_t(N) * C, 4);
  const auto dinp0 = randn(std::size_t(N) * C, 5), dw0 = randn(C, 6), db0 = randn(C, 7);  // accumulated into
  std::vector<float> out(std::size_t(N) * C), mean(N), rstd(N);
  loom::kernels::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), N, C);
  std::vector<float> dinp = dinp0, dw = dw0, db = db0;
  loom::kernels::layernorm_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(), mean.data(),
                                    rstd.data(), N, C);
  const Bits fwd = in_every_schedule([&](const OnEmulator& launch) {
    std::vector<float> o(out.size()), m(N), r(N);
    layer::layernorm_forward(launch, o.data(), m.data(), r.data(), inp.data(), w.data(), b.data(), N, C);
    return Bits{bits_of(o), bits_of(m), bits_of(r)};
  });
  // A row's sums in a warp's tree, not a loop: the GPU test's bound.
  EXPECT_LT(rel_err(from_bits<float>(fwd[0]), out), 1e-5);
  EXPECT_LT(rel_err(from_bits<float>(fwd[1]), mean), 1e-5);
  EXPECT_LT(rel_err(from_bits<float>(fwd[2]), rstd), 1e-5);
  const Bits bwd = in_every_schedule([&](const OnEmulator& launch) {
    std::vector<float> di = dinp0, dwk = dw0, dbk = db0, scratch(std::size_t(layer::column_scratch_floats(N, C, 2)));
    layer::layernorm_backward(launch, di.data(), dwk.data(), dbk.data(), dout.data(), inp.data(), w.data(), mean.data(),
                              rstd.data(), N, C, scratch.data(), std::int64_t(scratch.size()));
    return Bits{bits_of(di), bits_of(dwk), bits_of(dbk)};
  });
  EXPECT_LT(rel_err(from_bits<float>(bwd[0]), dinp), 1e-5);
  EXPECT_LT(rel_err(from_bits<float>(bwd[1]), dw), 1e-5);
  EXPECT_LT(rel_err(from_bits<float>(bwd[2]), db), 1e-5);
}

TEST(LayerKernelsEmu, BiasAddAndBackward) {
  const int N = 300, OC = 21;  // two chunks of rows, the last partial; a partial column tile
  const auto bias = randn(OC, 1), rows0 = randn(std::size_t(N) * OC, 2), db0 = randn(OC, 3);
  std::vector<float> rows = rows0, db = db0;
  loom::kernels::bias_add(rows.data(), bias.data(), N, OC);
  loom::kernels::bias_backward(db.data(), rows.data(), N, OC);
  const Bits got = in_every_schedule([&](const OnEmulator& launch) {
    std::vector<float> r = rows0, d = db0, scratch(std::size_t(layer::column_scratch_floats(N, OC, 1)));
    layer::bias_add(launch, r.data(), bias.data(), N, OC);
    layer::bias_backward(launch, d.data(), r.data(), N, OC, scratch.data(), std::int64_t(scratch.size()));
    return Bits{bits_of(r), bits_of(d)};
  });
  EXPECT_EQ(from_bits<float>(got[0]), rows) << "bias_add";
  EXPECT_LT(rel_err(from_bits<float>(got[1]), db), 1e-5) << "bias_backward: column sums in a tree";
}

// The MLP's fused backward: dpre = gelu'(pre) dout is the host's bit for bit (the same per-element
// math); the bias sums in a tree, as bias_backward's. Without a bias, gelu_backward alone.
TEST(LayerKernelsEmu, GeluBiasBackward) {
  const int N = 300, OC = 21;  // two chunks of rows, the last partial; a partial column tile
  const auto pre = randn(std::size_t(N) * OC, 4, 2.0f), dout = randn(std::size_t(N) * OC, 5), db0 = randn(OC, 6);
  std::vector<float> dpre(pre.size()), db = db0;
  loom::kernels::gelu_bias_backward(dpre.data(), db.data(), pre.data(), dout.data(), N, OC);
  const Bits got = in_every_schedule([&](const OnEmulator& launch) {
    std::vector<float> dp(pre.size()), d = db0, dp_only(pre.size()),
                                       scratch(std::size_t(layer::column_scratch_floats(N, OC, 1)));
    layer::gelu_bias_backward(launch, dp.data(), d.data(), pre.data(), dout.data(), N, OC, scratch.data(),
                              std::int64_t(scratch.size()));
    layer::gelu_bias_backward(launch, dp_only.data(), nullptr, pre.data(), dout.data(), N, OC, scratch.data(),
                              std::int64_t(scratch.size()));
    return Bits{bits_of(dp), bits_of(d), bits_of(dp_only)};
  });
  EXPECT_EQ(from_bits<float>(got[0]), dpre) << "dpre";
  EXPECT_LT(rel_err(from_bits<float>(got[1]), db), 1e-5) << "dbias: column sums in a tree";
  EXPECT_EQ(from_bits<float>(got[2]), dpre) << "dpre without a bias";
}

// The host's causal softmax is inside its attention: the reference here is its float branch.
TEST(LayerKernelsEmu, CausalSoftmaxForwardAndBackward) {
  const int T = 45, rows = 2 * T;  // rows longer than a warp: lanes loop
  auto scores = randn(std::size_t(rows) * T, 1, 3.0f);
  const auto dprobs = randn(std::size_t(rows) * T, 2);
  // A score 100 above the rest in every other row: exp overflows (NaN) unless the row's maximum is
  // found right, which the result's value alone would not show.
  for (int r = 1; r < rows; r += 2) scores[std::size_t(r) * T + std::size_t(r % T) / 2] += 100.0f;
  std::vector<float> probs = scores, dscores = dprobs;
  for (int r = 0; r < rows; ++r) {
    const int t = r % T;
    float* row = probs.data() + std::size_t(r) * T;
    float mx = row[0];
    for (int j = 1; j <= t; ++j) mx = row[j] > mx ? row[j] : mx;
    float sum = 0;
    for (int j = 0; j <= t; ++j) sum += row[j] = loom::math::exp_fast(row[j] - mx);
    for (int j = 0; j < T; ++j) row[j] = j <= t ? row[j] * (1.0f / sum) : 0.0f;
    float* d = dscores.data() + std::size_t(r) * T;
    float dot = 0;
    for (int j = 0; j <= t; ++j) dot += row[j] * d[j];
    for (int j = 0; j < T; ++j) d[j] = j <= t ? loom::math::softmax_backward(row[j], d[j], dot) : 0.0f;
  }
  const Bits got = in_every_schedule([&](const OnEmulator& launch) {
    std::vector<float> att = scores, datt = dprobs;
    layer::softmax_causal_forward(launch, att.data(), rows, T);
    layer::softmax_causal_backward(launch, datt.data(), att.data(), rows, T);
    return Bits{bits_of(att), bits_of(datt)};
  });
  const auto att = from_bits<float>(got[0]), datt = from_bits<float>(got[1]);
  EXPECT_LT(rel_err(att, probs), 1e-6);
  EXPECT_LT(rel_err(datt, dscores), 1e-5);
  for (int r = 0; r < rows; ++r)
    for (int j = r % T + 1; j < T; ++j) {
      ASSERT_EQ(att[std::size_t(r) * T + j], 0.0f) << "masked probability, row " << r << " column " << j;
      ASSERT_EQ(datt[std::size_t(r) * T + j], 0.0f) << "masked score gradient, row " << r << " column " << j;
    }
}

TEST(LayerKernelsEmu, ElementwiseKernelsAreTheHostsBitForBit) {
  const std::int64_t n = 1000;  // not a multiple of the block
  const auto x = randn(std::size_t(n), 1, 3.0f), y = randn(std::size_t(n), 2);
  std::vector<float> gelu(n), dgelu(n), res(n), axpy = y, scaled = y, filled(n);
  loom::kernels::gelu_forward(gelu.data(), x.data(), n);
  loom::kernels::gelu_backward(dgelu.data(), x.data(), y.data(), n);
  loom::kernels::residual_forward(res.data(), x.data(), y.data(), n);
  loom::kernels::axpy(axpy.data(), -0.37f, x.data(), n);
  loom::kernels::scale(scaled.data(), 0.37f, n);
  loom::kernels::fill(filled.data(), -2.5f, n);
  const Bits got = in_every_schedule([&](const OnEmulator& launch) {
    std::vector<float> g(n), dg(n), r(n), a = y, s = y, f(n, 1.0f);
    layer::gelu_forward(launch, g.data(), x.data(), n);
    layer::gelu_backward(launch, dg.data(), x.data(), y.data(), n);
    layer::residual_forward(launch, r.data(), x.data(), y.data(), n);
    layer::axpy(launch, a.data(), -0.37f, x.data(), n);
    layer::scale<DType::f32>(launch, s.data(), 0.37f, n);
    layer::fill<DType::f32>(launch, f.data(), -2.5f, n);
    return Bits{bits_of(g), bits_of(dg), bits_of(r), bits_of(a), bits_of(s), bits_of(f)};
  });
  EXPECT_EQ(from_bits<float>(got[0]), gelu) << "gelu forward";
  EXPECT_EQ(from_bits<float>(got[1]), dgelu) << "gelu backward";
  EXPECT_EQ(from_bits<float>(got[2]), res) << "residual";
  EXPECT_EQ(from_bits<float>(got[3]), axpy) << "axpy";
  EXPECT_EQ(from_bits<float>(got[4]), scaled) << "scale";
  EXPECT_EQ(from_bits<float>(got[5]), filled) << "fill";
}

// The elementwise kernels and the fp32 -> 16-bit casts take four elements at a time where every
// pointer is aligned (float4 loads) and one at a time where one is not: the same bits either way,
// the n % 4 last elements included. Offset 1 puts every pointer off 16-byte alignment.
TEST(LayerKernelsEmu, ElementwiseKernelsTakeFourAtATimeOrOneWithTheSameBits) {
  const std::int64_t n = 1003;
  const auto xs = randn(std::size_t(n) + 4, 1, 3.0f), ys = randn(std::size_t(n) + 4, 2);
  for (std::size_t offset : {0, 1}) {
    const float* x = xs.data() + offset;
    const float* y = ys.data() + offset;
    std::vector<float> gelu(n), dgelu(n), res(n);
    std::vector<loom::bf16> b16(n);
    std::vector<loom::f16> h16(n);
    loom::kernels::gelu_forward(gelu.data(), x, n);
    loom::kernels::gelu_backward(dgelu.data(), x, y, n);
    loom::kernels::residual_forward(res.data(), x, y, n);
    loom::kernels::cast(b16.data(), x, n);
    loom::kernels::cast(h16.data(), x, n);
    const Bits got = in_every_schedule([&](const OnEmulator& launch) {
      // outputs at the same offset as the inputs, so that either all are aligned or none
      std::vector<float> g(n + 4), dg(n + 4), r(n + 4);
      std::vector<std::uint16_t> b(n + 4), h(n + 4);
      layer::gelu_forward(launch, g.data() + offset, x, n);
      layer::gelu_backward(launch, dg.data() + offset, x, y, n);
      layer::residual_forward(launch, r.data() + offset, x, y, n);
      layer::cast<DType::bf16, DType::f32>(launch, b.data() + offset, x, n);
      layer::cast<DType::f16, DType::f32>(launch, h.data() + offset, x, n);
      const auto part = [&](const auto& v) { return bits_of(std::vector(v.begin() + offset, v.begin() + offset + n)); };
      return Bits{part(g), part(dg), part(r), part(b), part(h)};
    });
    EXPECT_EQ(got[0], bits_of(gelu)) << "gelu forward, offset " << offset;
    EXPECT_EQ(got[1], bits_of(dgelu)) << "gelu backward, offset " << offset;
    EXPECT_EQ(got[2], bits_of(res)) << "residual, offset " << offset;
    EXPECT_EQ(got[3], bits_of(b16)) << "fp32 -> bf16, offset " << offset;
    EXPECT_EQ(got[4], bits_of(h16)) << "fp32 -> fp16, offset " << offset;
  }
}

// Casts fused into the producers: LayerNorm (alone and after the residual add), GELU forward and
// backward, and the fused GELU + bias backward store a 16-bit output that is, bit for bit, their fp32
// output then cast (the residual and dbias unchanged), in every schedule, four at a time or one.
template <DType O>
void check_16bit_outputs() {
  using S = layer::storage_t<O>;
  const int N = 300, C = 37, OC = 44;  // two chunks of column-sum rows; OC: whole float4s
  const std::int64_t NC = std::int64_t(N) * C, NO = std::int64_t(N) * OC;
  const auto x = randn(std::size_t(NC), 1, 2.0f), y = randn(std::size_t(NC), 2), w = randn(C, 3), b = randn(C, 4),
             pre = randn(std::size_t(NO) + 1, 5, 2.0f), d = randn(std::size_t(NO) + 1, 6), db0 = randn(OC, 7);
  std::vector<float> probs(std::size_t(NO), 0.0f);
  for (std::int64_t i = 0; i < NO; ++i) probs[std::size_t(i)] = std::fabs(d[std::size_t(i)]) / 40.0f;
  std::vector<std::int32_t> targets(N);
  for (int n = 0; n < N; ++n) targets[std::size_t(n)] = (n * 37) % (OC + 20);  // some outside this rank's columns
  const auto run = [&](auto o_tag, std::size_t offset) {
    constexpr DType D = decltype(o_tag)::value;
    using E = layer::storage_t<D>;
    return in_every_schedule([&](const OnEmulator& launch) {
      std::vector<E> o(NC), o2(NC), g(NO + 1), dg(NO + 1), dp(NO + 1), dp_only(NO + 1), dl(NO);
      std::vector<float> m(N), s(N), m2(N), s2(N), r(NC), db = db0,
                                                          scratch(std::size_t(layer::column_scratch_floats(N, OC, 1)));
      layer::layernorm_forward<D>(launch, o.data(), m.data(), s.data(), x.data(), w.data(), b.data(), N, C);
      layer::residual_layernorm_forward<D>(launch, r.data(), o2.data(), m2.data(), s2.data(), x.data(), y.data(),
                                           w.data(), b.data(), N, C);
      layer::gelu_forward<D>(launch, g.data() + offset, pre.data() + offset, NO);
      layer::gelu_backward<D>(launch, dg.data() + offset, pre.data() + offset, d.data() + offset, NO);
      layer::gelu_bias_backward<D>(launch, dp.data(), db.data(), pre.data(), d.data(), N, OC, scratch.data(),
                                   std::int64_t(scratch.size()));
      layer::gelu_bias_backward<D>(launch, dp_only.data(), nullptr, pre.data(), d.data(), N, OC, scratch.data(),
                                   std::int64_t(scratch.size()));
      layer::crossentropy_backward<D>(launch, dl.data(), probs.data(), targets.data(), 0.37f, N, OC, 3);
      std::vector<E> copy(NO);
      std::vector<float> dbc = db0;
      layer::bias_backward_cast<D>(launch, dbc.data(), copy.data(), d.data(), N, OC, scratch.data(),
                                   std::int64_t(scratch.size()));
      return Bits{bits_of(o),  bits_of(m),  bits_of(s),       bits_of(r),  bits_of(o2),   bits_of(g),  bits_of(dg),
                  bits_of(dp), bits_of(db), bits_of(dp_only), bits_of(dl), bits_of(copy), bits_of(dbc)};
    });
  };
  const char* what[] = {"layernorm out",
                        "mean",
                        "rstd",
                        "residual",
                        "residual_layernorm out",
                        "gelu forward",
                        "gelu backward",
                        "gelu_bias_backward dpre",
                        "dbias",
                        "dpre without a bias",
                        "crossentropy_backward dlogits",
                        "bias_backward_cast copy",
                        "bias_backward_cast dbias"};
  for (std::size_t offset : {0, 1}) {
    const Bits f = run(std::integral_constant<DType, DType::f32>{}, offset),
               h = run(std::integral_constant<DType, O>{}, offset);
    for (std::size_t i = 0; i < f.size(); ++i) {
      if (i == 1 || i == 2 || i == 3 || i == 8 || i == 12) {  // fp32 either way
        EXPECT_EQ(h[i], f[i]) << what[i];
        continue;
      }
      const std::vector<float> full = from_bits<float>(f[i]);
      std::vector<S> cast(full.size());
      for (std::size_t k = 0; k < full.size(); ++k)  // the host's conversion: an independent rounding
        cast[k] = O == DType::bf16 ? loom::to_bf16(full[k]).bits : loom::to_f16(full[k]).bits;
      EXPECT_EQ(h[i], bits_of(cast)) << what[i] << " (" << loom::dtype_name(O) << "), offset " << offset;
    }
  }
}

// bias_backward_cast's sums are bias_backward's, bit for bit (the same column tiles and chunks), and its
// copy is dout rounded by the host's conversion.
TEST(LayerKernelsEmu, BiasBackwardWithItsCastIsBiasBackward) {
  const int N = 300, OC = 21;
  const auto dout = randn(std::size_t(N) * OC, 2), db0 = randn(OC, 3);
  const Bits got = in_every_schedule([&](const OnEmulator& launch) {
    std::vector<float> a = db0, b = db0, scratch(std::size_t(layer::column_scratch_floats(N, OC, 1)));
    std::vector<std::uint16_t> copy(dout.size());
    layer::bias_backward(launch, a.data(), dout.data(), N, OC, scratch.data(), std::int64_t(scratch.size()));
    layer::bias_backward_cast<DType::bf16>(launch, b.data(), copy.data(), dout.data(), N, OC, scratch.data(),
                                           std::int64_t(scratch.size()));
    return Bits{bits_of(a), bits_of(b), bits_of(copy)};
  });
  EXPECT_EQ(got[0], got[1]);
  std::vector<std::uint16_t> want(dout.size());
  for (std::size_t i = 0; i < dout.size(); ++i) want[i] = loom::to_bf16(dout[i]).bits;
  EXPECT_EQ(got[2], bits_of(want)) << "the copy is dout rounded to bf16";
}

TEST(LayerKernelsEmu, ProducersStoreBf16AsTheirFp32OutputsCast) { check_16bit_outputs<DType::bf16>(); }
TEST(LayerKernelsEmu, ProducersStoreFp16AsTheirFp32OutputsCast) { check_16bit_outputs<DType::f16>(); }

// The column sums over many chunks of rows, from an uncapped scratch and from one that holds fewer
// chunks (then longer ones): each the host's sums within float rounding, each the same in every
// schedule; a scratch short of one chunk's partials is refused.
TEST(LayerKernelsEmu, ColumnSumsOverChunksOfRows) {
  const int N = 1100, OC = 45;  // five chunks of 256 rows, the last partial; two column tiles
  const auto dout = randn(std::size_t(N) * OC, 1), inp = randn(std::size_t(N) * OC, 2, 2.0f);
  std::vector<float> mean(N), rstd(N);
  for (int n = 0; n < N; ++n)
    mean[std::size_t(n)] = 0.01f * float(n % 7), rstd[std::size_t(n)] = 1.0f + 0.1f * float(n % 5);
  std::vector<float> db(OC, 0.5f), dw(OC, -0.25f), db2 = db;
  loom::kernels::bias_backward(db.data(), dout.data(), N, OC);
  for (int j = 0; j < OC; ++j) {  // LayerNorm's parameter gradients, in double
    double w = 0, b = 0;
    for (int n = 0; n < N; ++n) {
      const double d = dout[std::size_t(n) * OC + j];
      b += d;
      w += (double(inp[std::size_t(n) * OC + j]) - mean[std::size_t(n)]) * rstd[std::size_t(n)] * d;
    }
    dw[std::size_t(j)] += float(w);
    db2[std::size_t(j)] += float(b);
  }
  for (std::int64_t scratch_floats : {layer::column_scratch_floats(N, OC, 2), std::int64_t(2 * OC) * 2}) {
    const Bits got = in_every_schedule([&](const OnEmulator& launch) {
      std::vector<float> s(static_cast<std::size_t>(scratch_floats)), b(OC, 0.5f), w(OC, -0.25f), b2(OC, 0.5f);
      layer::bias_backward(launch, b.data(), dout.data(), N, OC, s.data(), scratch_floats);
      layer::column_sums<layer::ColumnSum::layernorm>(launch, "layernorm_backward_params_kernel", b2.data(), w.data(),
                                                      nullptr, dout.data(), inp.data(), mean.data(), rstd.data(), N, OC,
                                                      s.data(), scratch_floats);
      return Bits{bits_of(b), bits_of(w), bits_of(b2)};
    });
    EXPECT_LT(rel_err(from_bits<float>(got[0]), db), 1e-5) << "bias, scratch " << scratch_floats;
    EXPECT_LT(rel_err(from_bits<float>(got[1]), dw), 1e-5) << "LayerNorm weight, scratch " << scratch_floats;
    EXPECT_LT(rel_err(from_bits<float>(got[2]), db2), 1e-5) << "LayerNorm bias, scratch " << scratch_floats;
  }
  EXPECT_EQ(layer::column_chunks(N, OC, 2, layer::column_scratch_floats(N, OC, 2)).chunks, 5);
  EXPECT_EQ(layer::column_chunks(N, OC, 2, 4 * OC).chunks, 2);
  std::vector<float> s(OC), b(OC);
  EXPECT_THROW(layer::bias_backward(OnEmulator{}, b.data(), dout.data(), N, OC, s.data(), OC - 1),
               std::invalid_argument);
}

// Every pair of fp64, fp32, bf16 and fp16: the host's conversion, bit for bit (signed zeros too; NaN
// as NaN), on the geometry's grid and on one looping block. (The emulator converts to fp16 with the
// host's own function and rounds toward zero as the host's round-to-odd does: what this checks is the
// kernel's choice of path per pair; the device's conversions are held to the host's by loom_cuda_tests.)
TEST(LayerKernelsEmu, CastsAreTheHostsBitForBit) {
  const std::int64_t n = 300;
  std::vector<double> src(static_cast<std::size_t>(n));
  std::mt19937_64 gen(9);
  std::normal_distribution<double> d(0.0, 100.0);
  for (auto& x : src) x = d(gen);
  src[0] = std::numeric_limits<double>::quiet_NaN();
  src[1] = std::numeric_limits<double>::infinity();
  src[2] = 1e6;                                               // overflows fp16
  src[3] = 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30);  // rounds up in bf16 only when rounded once
  src[4] = -(std::ldexp(1.0, -140) + std::ldexp(1.0, -160));  // between two fp32 subnormals: inexact
  src[5] = std::ldexp(1.0, 128) - std::ldexp(1.0, 98);  // past fp32's largest: inf to nearest, the largest toward zero
  src[6] = -0.0;
  src[7] = 0.0;
  const auto in_type = [&](auto tag) {  // the source values as `from` holds them
    using S = typename decltype(tag)::type;
    std::vector<S> v(src.size());
    loom::kernels::cast(v.data(), src.data(), n);
    return v;
  };
  const auto check = [&](auto to, auto from) {
    using D = typename decltype(to)::type;
    using S = typename decltype(from)::type;
    constexpr DType Dt = loom::dtype_of<D>::value, St = loom::dtype_of<S>::value;
    const std::vector<S> s = in_type(from);
    std::vector<D> want(s.size());
    loom::kernels::cast(want.data(), s.data(), n);
    for (const OnEmulator launch : {OnEmulator{}, OnEmulator{1}}) {
      std::vector<D> got(s.size());
      layer::cast<Dt, St>(launch, reinterpret_cast<layer::storage_t<Dt>*>(got.data()),
                          reinterpret_cast<const layer::storage_t<St>*>(s.data()), n);
      std::vector<double> g64(s.size()), w64(s.size());
      loom::kernels::cast(g64.data(), got.data(), n);
      loom::kernels::cast(w64.data(), want.data(), n);
      int mismatches = 0;
      for (std::size_t i = 0; i < s.size(); ++i)
        if (!(std::isnan(g64[i]) && std::isnan(w64[i])) && std::memcmp(&got[i], &want[i], sizeof(D)) != 0) ++mismatches;
      EXPECT_EQ(mismatches, 0) << loom::dtype_name(St) << " -> " << loom::dtype_name(Dt) << ", max_blocks "
                               << launch.max_blocks;
    }
  };
  const auto for_each = [&](auto to) {
    check(to, F64{});
    check(to, F32{});
    check(to, BF16{});
    check(to, F16{});
  };
  for_each(F64{});
  for_each(F32{});
  for_each(BF16{});
  for_each(F16{});
}

// Held, as the device is, to a double-precision reference: at least as close to it as the host
// (which adds a row's exponentials one after another), or within 1e-6.
TEST(LayerKernelsEmu, CrossEntropyForwardAndBackward) {
  struct Case {
    int N, V;
    std::size_t shared_limit;  // the device's opt-in shared memory: 0 never stages the row
    const char* what;
  };
  for (const Case& c : {Case{3, 1500, 0, "row from memory, float4"}, Case{3, 1500, 1 << 20, "row staged, float4"},
                        Case{3, 1001, 0, "row from memory, floats"}, Case{3, 1001, 1 << 20, "row staged, floats"},
                        Case{2, 3, 1 << 20, "fewer columns than a warp"}}) {
    SCOPED_TRACE(c.what);
    const int N = c.N, V = c.V;
    auto logits = randn(std::size_t(N) * V, 1, 4.0f);
    for (int n = 0; n < N; ++n) logits[std::size_t(n) * V + std::size_t(n * 31 % V)] += 100.0f;  // as the softmax's
    std::vector<std::int32_t> tgt(N);
    for (int i = 0; i < N; ++i) tgt[std::size_t(i)] = (i * 7919) % V;
    std::vector<float> ref_probs(std::size_t(N) * V), ref_losses(N), ref_dlogits(ref_probs.size());
    for (int n = 0; n < N; ++n) {
      const float* l = logits.data() + std::size_t(n) * V;
      double mx = l[0], sum = 0;
      for (int v = 1; v < V; ++v) mx = std::max(mx, double(l[v]));
      for (int v = 0; v < V; ++v) sum += std::exp(double(l[v]) - mx);
      for (int v = 0; v < V; ++v) {
        const double p = std::exp(double(l[v]) - mx) / sum;
        ref_probs[std::size_t(n) * V + v] = float(p);
        ref_dlogits[std::size_t(n) * V + v] = float((p - (v == tgt[std::size_t(n)] ? 1.0 : 0.0)) * 0.125);
      }
      ref_losses[std::size_t(n)] = float(std::log(sum) + mx - l[tgt[std::size_t(n)]]);
    }
    std::vector<float> losses(N), probs(ref_probs.size());
    loom::kernels::crossentropy_forward(losses.data(), probs.data(), logits.data(), tgt.data(), N, V);
    std::vector<float> dlogits = probs;
    loom::kernels::crossentropy_backward(dlogits.data(), dlogits.data(), tgt.data(), 0.125f, N, V);
    const Bits got = in_every_schedule([&](const OnEmulator& launch) {
      std::vector<float> l(N), p = logits;  // in place, as the model's head calls it
      layer::crossentropy_forward(launch, c.shared_limit, l.data(), p.data(), p.data(), tgt.data(), N, V);
      std::vector<float> pr = p;
      layer::crossentropy_backward(launch, p.data(), p.data(), tgt.data(), 0.125f, N, V, 0);
      return Bits{bits_of(l), bits_of(pr), bits_of(p)};
    });
    const auto as_close_as_host = [&](const std::vector<float>& emulated, const std::vector<float>& host,
                                      const std::vector<float>& ref, const char* what) {
      const double e = rel_err(emulated, ref), h = rel_err(host, ref);
      EXPECT_LT(e, std::max(2 * h, 1e-6)) << what << ": emulated " << e << ", host " << h << " from fp64";
    };
    as_close_as_host(from_bits<float>(got[0]), losses, ref_losses, "losses");
    as_close_as_host(from_bits<float>(got[1]), probs, ref_probs, "probs");
    as_close_as_host(from_bits<float>(got[2]), dlogits, ref_dlogits, "dlogits");
  }
}

// The tensor strategy's three passes, on a middle shard of the vocabulary: targets below, in and
// above this rank's columns.
TEST(LayerKernelsEmu, VocabularyParallelCrossEntropy) {
  const int N = 7, V = 700, vb = 700;  // this rank: entries [700, 1400) of a vocabulary of 2100
  const auto logits = randn(std::size_t(N) * V, 6, 4.0f);
  std::vector<std::int32_t> tgt(N);
  for (int i = 0; i < N; ++i) tgt[std::size_t(i)] = (i * 7919) % (3 * V);
  std::vector<float> row_max(N), probs = logits, losses(N);
  std::vector<double> sum_exp(N), target_logit(N);
  loom::kernels::crossentropy_row_max(row_max.data(), logits.data(), N, V);
  loom::kernels::crossentropy_partial(probs.data(), sum_exp.data(), target_logit.data(), probs.data(), row_max.data(),
                                      tgt.data(), N, V, vb);
  const std::vector<float> exps = probs;
  loom::kernels::crossentropy_finish(losses.data(), probs.data(), sum_exp.data(), row_max.data(), target_logit.data(),
                                     N, V);
  loom::kernels::crossentropy_backward(probs.data(), probs.data(), tgt.data(), 0.25f, N, V, vb);
  const Bits got = in_every_schedule([&](const OnEmulator& launch) {
    std::vector<float> m(N), p = logits, l(N);
    std::vector<double> s(N, -1.0), t(N, -1.0);
    layer::crossentropy_row_max(launch, m.data(), p.data(), N, V);
    layer::crossentropy_partial(launch, p.data(), s.data(), t.data(), p.data(), m.data(), tgt.data(), N, V, vb);
    const std::vector<float> e = p;
    layer::crossentropy_finish(launch, l.data(), p.data(), s.data(), m.data(), t.data(), N, V);
    layer::crossentropy_backward(launch, p.data(), p.data(), tgt.data(), 0.25f, N, V, vb);
    return Bits{bits_of(m), bits_of(e), bits_of(s), bits_of(t), bits_of(l), bits_of(p)};
  });
  EXPECT_EQ(from_bits<float>(got[0]), row_max) << "row maxima";
  EXPECT_EQ(from_bits<float>(got[1]), exps) << "exponentials (the shared exp)";
  const auto s = from_bits<double>(got[2]), t = from_bits<double>(got[3]);
  for (int n = 0; n < N; ++n) {
    EXPECT_NEAR(s[std::size_t(n)], sum_exp[std::size_t(n)], 1e-12 * sum_exp[std::size_t(n)])
        << "sum of exponentials, row " << n;
    EXPECT_EQ(t[std::size_t(n)], target_logit[std::size_t(n)]) << "target logit, row " << n;
  }
  EXPECT_LT(rel_err(from_bits<float>(got[4]), losses), 1e-6) << "losses";
  EXPECT_LT(rel_err(from_bits<float>(got[5]), probs), 1e-6) << "dlogits";
}

// The fused classifier (crossentropy_fused; crossentropy_finish_grad after the vocabulary-parallel
// reductions) is the device's forward then backward with the arithmetic unchanged: the same bits in every
// schedule, with the row staged or not, four at a time or one, in place over the logits (fp32) or stored
// as bf16/fp16.
template <DType O>
void check_fused_classifier() {
  using E = layer::storage_t<O>;
  struct Case {
    int N, V;
    std::size_t shared_limit;
    const char* what;
  };
  for (const Case& c : {Case{3, 1500, 0, "row from memory, float4"}, Case{3, 1500, 1 << 20, "row staged, float4"},
                        Case{3, 1001, 0, "row from memory, floats"}, Case{3, 1001, 1 << 20, "row staged, floats"}}) {
    SCOPED_TRACE(std::string(c.what) + ", " + loom::dtype_name(O));
    const int N = c.N, V = c.V, vb = V;  // vocabulary-parallel: this rank holds [V, 2V) of 3V
    auto logits = randn(std::size_t(N) * V, 9, 4.0f);
    for (int n = 0; n < N; ++n) logits[std::size_t(n) * V + std::size_t(n * 31 % V)] += 30.0f;
    std::vector<std::int32_t> tgt(N), wide(N);
    for (int i = 0; i < N; ++i) {
      tgt[std::size_t(i)] = (i * 7919) % V;
      wide[std::size_t(i)] = (i * 7919) % (3 * V);
    }
    const float dloss = 0.37f;
    const Bits got = in_every_schedule([&](const OnEmulator& launch) {
      std::vector<float> l(N), lf(N), p = logits, probs(logits.size());
      std::vector<E> d(logits.size()), fused(logits.size());
      layer::crossentropy_forward(launch, c.shared_limit, l.data(), probs.data(), logits.data(), tgt.data(), N, V);
      layer::crossentropy_backward<O>(launch, d.data(), probs.data(), tgt.data(), dloss, N, V, 0);
      layer::crossentropy_fused<O>(launch, c.shared_limit, lf.data(), fused.data(), logits.data(), tgt.data(), dloss, N,
                                   V);
      std::vector<float> lp(N), in_place = logits;  // fp32 in place over the logits, as the model's head
      if constexpr (O == DType::f32)
        layer::crossentropy_fused<O>(launch, c.shared_limit, lp.data(), in_place.data(), in_place.data(), tgt.data(),
                                     dloss, N, V);
      // vocabulary-parallel: _partial with and without the exponentials, then _finish + _backward or _finish_grad
      std::vector<float> m(N), e = logits, lt(N), lg(N);
      std::vector<double> s(N), t(N), s0(N), t0(N);
      std::vector<E> dt(logits.size()), dg(logits.size());
      layer::crossentropy_row_max(launch, m.data(), logits.data(), N, V);
      layer::crossentropy_partial(launch, e.data(), s.data(), t.data(), logits.data(), m.data(), wide.data(), N, V, vb);
      layer::crossentropy_finish(launch, lt.data(), e.data(), s.data(), m.data(), t.data(), N, V);
      layer::crossentropy_backward<O>(launch, dt.data(), e.data(), wide.data(), dloss, N, V, vb);
      layer::crossentropy_partial(launch, static_cast<float*>(nullptr), s0.data(), t0.data(), logits.data(), m.data(),
                                  wide.data(), N, V, vb);
      layer::crossentropy_finish_grad<O>(launch, lg.data(), dg.data(), logits.data(), s0.data(), m.data(), t0.data(),
                                         wide.data(), dloss, N, V, vb);
      return Bits{bits_of(l),  bits_of(lf), bits_of(d),  bits_of(fused), bits_of(lp), bits_of(in_place),
                  bits_of(lt), bits_of(lg), bits_of(dt), bits_of(dg),    bits_of(s),  bits_of(s0)};
    });
    EXPECT_EQ(got[1], got[0]) << "fused losses";
    EXPECT_EQ(got[3], got[2]) << "fused dlogits";
    if (O == DType::f32) {
      EXPECT_EQ(got[4], got[0]) << "fused losses, in place";
      EXPECT_EQ(got[5], got[2]) << "fused dlogits, in place over the logits";
    }
    EXPECT_EQ(got[11], got[10]) << "the partial sums without the exponentials";
    EXPECT_EQ(got[7], got[6]) << "vocabulary-parallel losses";
    EXPECT_EQ(got[9], got[8]) << "vocabulary-parallel dlogits";
  }
}
TEST(LayerKernelsEmu, FusedClassifierIsForwardThenBackwardBitForBit_f32) { check_fused_classifier<DType::f32>(); }
TEST(LayerKernelsEmu, FusedClassifierIsForwardThenBackwardBitForBit_bf16) { check_fused_classifier<DType::bf16>(); }
TEST(LayerKernelsEmu, FusedClassifierIsForwardThenBackwardBitForBit_f16) { check_fused_classifier<DType::f16>(); }

TEST(LayerKernelsEmu, AdamWIsTheHostsBitForBit) {
  const std::int64_t n = 700;
  const auto p0 = randn(std::size_t(n), 1), m0 = randn(std::size_t(n), 2, 0.1f), g = randn(std::size_t(n), 4);
  std::vector<float> v0 = randn(std::size_t(n), 3, 0.1f);
  for (float& x : v0) x = x * x;
  std::vector<float> p = p0, m = m0, v = v0;
  for (std::int64_t t = 1; t <= 3; ++t)
    loom::kernels::adamw_update(p.data(), m.data(), v.data(), g.data(), n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, t);
  const Bits got = in_every_schedule([&](const OnEmulator& launch) {
    std::vector<float> pe = p0, me = m0, ve = v0;
    for (std::int64_t t = 1; t <= 3; ++t) {  // the bias corrections as core/cuda/kernels.cu makes them
      const loom::math::AdamWStep<float> step{
          1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f - std::pow(0.9f, float(t)), 1.0f - std::pow(0.95f, float(t))};
      layer::adamw_update(launch, pe.data(), me.data(), ve.data(), g.data(), n, step);
    }
    return Bits{bits_of(pe), bits_of(me), bits_of(ve)};
  });
  EXPECT_EQ(from_bits<float>(got[0]), p) << "parameters";
  EXPECT_EQ(from_bits<float>(got[1]), m) << "first moments";
  EXPECT_EQ(from_bits<float>(got[2]), v) << "second moments";
}

// Sums, sums of squares and non-finite counts over several blocks (a grid-stride tail), in every
// storage type, against long double; n = 0 gives 0.
TEST(LayerKernelsEmu, Reductions) {
  const std::int64_t n = 2 * 256 * 3 + 77;  // several blocks, a partial last one
  std::vector<double> x64(static_cast<std::size_t>(n));
  std::mt19937_64 gen(5);
  std::normal_distribution<double> d(0.0, 3.0);
  for (auto& x : x64) x = d(gen);
  const auto check = [&](auto tag, std::int64_t count, const std::vector<double>& src) {
    using T = typename decltype(tag)::type;
    constexpr DType D = loom::dtype_of<T>::value;
    std::vector<T> x(src.size());
    loom::kernels::cast(x.data(), src.data(), std::int64_t(src.size()));
    std::vector<double> held(src.size());  // the values as T holds them
    loom::kernels::cast(held.data(), x.data(), std::int64_t(src.size()));
    long double want_sum = 0, want_sq = 0;
    double want_bad = 0;
    for (std::int64_t i = 0; i < count; ++i) {
      const double v = held[std::size_t(i)];
      if (!std::isfinite(v))
        ++want_bad;
      else
        want_sum += v, want_sq += static_cast<long double>(v) * v;
    }
    const auto* xs = reinterpret_cast<const layer::storage_t<D>*>(x.data());
    const Bits got = in_every_schedule([&](const OnEmulator& launch) {
      std::vector<double> scratch(std::size_t(layer::reduce_geometry(count).blocks), -1.0);  // as a device's: stale
      double s = -1, q = -1, bad = -1;
      layer::reduce<D, layer::ReduceOp::sum>(launch, &s, xs, count, scratch.data());
      layer::reduce<D, layer::ReduceOp::sum_squares>(launch, &q, xs, count, scratch.data());
      layer::reduce<D, layer::ReduceOp::nonfinite>(launch, &bad, xs, count, scratch.data());
      return Bits{bits_of(std::vector<double>{s, q, bad})};
    });
    const auto r = from_bits<double>(got[0]);
    const char* name = loom::dtype_name(D);
    EXPECT_EQ(r[2], want_bad) << name << ": non-finite count";
    if (want_bad == 0) {
      EXPECT_NEAR(r[0], double(want_sum), 1e-12 * double(want_sq) + 1e-300) << name << ": sum";
      EXPECT_NEAR(r[1], double(want_sq), 1e-12 * double(want_sq)) << name << ": sum of squares";
    }
    if (count == 0) return;
    // The grid-stride loops the geometry's grid does not reach here (a device's does past 2^18
    // elements): two blocks of partials over all the elements, then the finishing block over them.
    std::vector<double> partials(2, -1.0);
    double looped = -1;
    emu::launch(emu::dim3(2), emu::dim3(layer::kReduceThreads), 0,
                [&] { layer::reduce_partials_kernel<D, layer::ReduceOp::sum_squares>(partials.data(), xs, count); });
    emu::launch(emu::dim3(1), emu::dim3(layer::kReduceThreads), 0,
                [&] { layer::reduce_finish_kernel(&looped, static_cast<const double*>(partials.data()), 2); });
    if (want_bad == 0) {
      EXPECT_NEAR(looped, double(want_sq), 1e-12 * double(want_sq)) << name << ": sum of squares, 2 blocks";
    }
  };
  {  // the finishing block's own loop: more partials than threads (a device's grid has up to 1024)
    std::vector<double> partials(700);
    long double want = 0;
    for (std::size_t i = 0; i < partials.size(); ++i) want += partials[i] = x64[i];
    double got = -1;
    emu::launch(emu::dim3(1), emu::dim3(layer::kReduceThreads), 0,
                [&] { layer::reduce_finish_kernel(&got, static_cast<const double*>(partials.data()), 700); });
    EXPECT_NEAR(got, double(want), 1e-12 * 700 * 3.0) << "700 partials";
  }
  for (std::int64_t count : {n, std::int64_t(0)}) {
    check(F64{}, count, x64);
    check(F32{}, count, x64);
    check(BF16{}, count, x64);
    check(F16{}, count, x64);
  }
  std::vector<double> bad = x64;
  bad[3] = std::numeric_limits<double>::quiet_NaN();
  bad[900] = -std::numeric_limits<double>::infinity();
  bad[n - 1] = 1e6;  // inf in fp16 only
  check(F64{}, n, bad);
  check(F16{}, n, bad);
}

// int8 compression's kernels, bit for bit the host's: the chunk maxima and the flag, the levels and
// the residual, the sum scaled back; a NaN or an inf poisons it; no elements give a clear flag.
// AdamW over many slices at once (Backend::adamw_update_slices): more slices than a launch takes,
// empty ones, weight decays that differ; each slice the per-slice adamw_kernel's bits.
TEST(LayerKernelsEmu, AdamWOverManySlicesIsOneUpdatePerSliceBitForBit) {
  const int k = layer::kAdamWSlices + 5;
  std::vector<std::vector<float>> p0, m0, v0, g;
  std::vector<std::int64_t> n;
  std::vector<float> wd;
  for (int t = 0; t < k; ++t) {
    const std::size_t count = t == 4 ? 0 : std::size_t(1 + (t * 53) % 700);
    p0.push_back(randn(count, std::uint32_t(200 + t)));
    m0.push_back(randn(count, std::uint32_t(300 + t), 0.1f));
    auto vv = randn(count, std::uint32_t(400 + t), 0.1f);
    for (float& x : vv) x = x * x;
    v0.push_back(vv);
    g.push_back(randn(count, std::uint32_t(500 + t)));
    n.push_back(std::int64_t(count));
    wd.push_back(t % 3 == 0 ? 0.0f : 0.1f);
  }
  const float bc1 = 1.0f - std::pow(0.9f, 3.0f), bc2 = 1.0f - std::pow(0.95f, 3.0f);
  std::vector<unsigned char> want;
  for (int t = 0; t < k; ++t) {
    std::vector<float> p = p0[std::size_t(t)], m = m0[std::size_t(t)], v = v0[std::size_t(t)];
    const loom::math::AdamWStep<float> step{1e-3f, 0.9f, 0.95f, 1e-8f, wd[std::size_t(t)], bc1, bc2};
    layer::adamw_update(OnEmulator{}, p.data(), m.data(), v.data(), g[std::size_t(t)].data(), n[std::size_t(t)], step);
    for (const auto* x : {&p, &m, &v}) {
      const auto b = bits_of(*x);
      want.insert(want.end(), b.begin(), b.end());
    }
  }
  const Bits got = in_every_schedule([&](const OnEmulator& launch) {
    std::vector<std::vector<float>> p = p0, m = m0, v = v0;
    std::vector<float*> pp, mp, vp;
    std::vector<const float*> gp;
    for (int t = 0; t < k; ++t) {
      pp.push_back(p[std::size_t(t)].data()), mp.push_back(m[std::size_t(t)].data());
      vp.push_back(v[std::size_t(t)].data()), gp.push_back(g[std::size_t(t)].data());
    }
    const loom::math::AdamWStep<float> step{1e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, bc1, bc2};
    layer::adamw_update_slices(launch, pp.data(), mp.data(), vp.data(), gp.data(), n.data(), wd.data(), k, step);
    std::vector<unsigned char> all;
    for (int t = 0; t < k; ++t)
      for (const auto* x : {&p[std::size_t(t)], &m[std::size_t(t)], &v[std::size_t(t)]}) {
        const auto b = bits_of(*x);
        all.insert(all.end(), b.begin(), b.end());
      }
    return Bits{all};
  });
  EXPECT_EQ(got[0], want);
}

// Backend::sq_norm_check's reductions over many tensors at once: each tensor's sum of squares and
// non-finite count the per-tensor reductions' bit for bit, over more tensors than one launch takes
// (kMultiTensors), empty ones, multi-block ones and ones holding NaN or inf, in fp32 and bf16.
TEST(LayerKernelsEmu, NormCheckOfManyTensorsIsTheReductionsBitForBit) {
  const auto check = [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr DType D = loom::dtype_of<T>::value;
    std::vector<std::vector<T>> tensors;
    std::vector<std::int64_t> n;
    for (int t = 0; t < layer::kMultiTensors + 6; ++t) {
      const std::int64_t count = t == 3 ? 0 : t == 5 ? 2 * 256 * 3 + 77 : 1 + (t * 37) % 300;
      auto v = randn(std::size_t(count), std::uint32_t(100 + t), 2.0f);
      if (t % 9 == 4) v[0] = std::numeric_limits<float>::quiet_NaN();
      if (t % 11 == 2) v[v.size() - 1] = -std::numeric_limits<float>::infinity();
      std::vector<T> x(v.size());
      loom::kernels::cast(x.data(), v.data(), count);
      tensors.push_back(std::move(x));
      n.push_back(count);
    }
    const int k = int(tensors.size());
    std::vector<const layer::storage_t<D>*> xs;
    for (const auto& x : tensors) xs.push_back(reinterpret_cast<const layer::storage_t<D>*>(x.data()));
    std::vector<double> want(2 * std::size_t(k));
    for (int t = 0; t < k; ++t) {
      std::vector<double> scratch(std::size_t(layer::reduce_geometry(n[std::size_t(t)]).blocks));
      layer::reduce<D, layer::ReduceOp::sum_squares>(OnEmulator{}, &want[std::size_t(t)], xs[std::size_t(t)],
                                                     n[std::size_t(t)], scratch.data());
      layer::reduce<D, layer::ReduceOp::nonfinite>(OnEmulator{}, &want[std::size_t(k + t)], xs[std::size_t(t)],
                                                   n[std::size_t(t)], scratch.data());
    }
    const Bits got = in_every_schedule([&](const OnEmulator& launch) {
      std::vector<double> out(2 * std::size_t(k), -1.0),
          scratch(std::size_t(layer::norm_check_scratch_count(n.data(), k)), -1.0);
      layer::norm_check<D>(launch, out.data(), out.data() + k, xs.data(), n.data(), k, scratch.data());
      return Bits{bits_of(out)};
    });
    EXPECT_EQ(got[0], bits_of(want)) << loom::dtype_name(D);
    EXPECT_GT(want[std::size_t(k + 4)], 0.0) << "a NaN counted";
  };
  check(F32{});
  check(BF16{});
}

TEST(LayerKernelsEmu, Int8CompressionIsTheHostsBitForBit) {
  const std::int64_t n = 3001, chunk = 300, chunks = (n + chunk - 1) / chunk;  // a short last chunk
  std::vector<float> x = randn(std::size_t(n), 6, 2.0f);
  for (std::int64_t i = 0; i < n; ++i) x[std::size_t(i)] *= float(1 + i / chunk % 7);  // chunks of different scales
  x[5] = 0.0f;
  x[6] = -0.0f;
  const auto emulated = [&](const std::vector<float>& in, int levels) {
    return in_every_schedule([&](const OnEmulator& launch) {
      std::vector<float> amax(std::size_t(chunks) + 1, -1.0f), err(in.size(), -1.0f), back(in.size(), -1.0f);
      std::vector<std::int8_t> q(in.size(), 99);
      std::vector<double> nonfinite(1, -1.0), scratch(std::size_t(layer::reduce_geometry(n).blocks), -1.0);
      layer::int8_absmax(launch, amax.data(), in.data(), n, chunk, nonfinite.data(), scratch.data());
      layer::int8_quantize(launch, q.data(), err.data(), in.data(), n, chunk, amax.data(), levels);
      layer::int8_dequantize(launch, back.data(), q.data(), n, chunk, amax.data(), levels);
      return Bits{bits_of(amax), bits_of(q), bits_of(err), bits_of(back)};
    });
  };
  for (const int levels : {127, 31}) {
    SCOPED_TRACE("levels " + std::to_string(levels));
    std::vector<float> amax(std::size_t(chunks) + 1), err(x.size()), back(x.size());
    std::vector<std::int8_t> q(x.size());
    loom::kernels::int8_absmax(amax.data(), x.data(), n, chunk);
    loom::kernels::int8_quantize(q.data(), err.data(), x.data(), n, chunk, amax.data(), levels);
    loom::kernels::int8_dequantize(back.data(), q.data(), n, chunk, amax.data(), levels);
    const Bits got = emulated(x, levels);
    EXPECT_EQ(from_bits<float>(got[0]), amax) << "int8_absmax and the flag";
    EXPECT_EQ(from_bits<std::int8_t>(got[1]), q) << "int8_quantize";
    EXPECT_EQ(from_bits<float>(got[2]), err) << "int8_quantize's residual";
    EXPECT_EQ(from_bits<float>(got[3]), back) << "int8_dequantize";
  }
  for (const float poison : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    std::vector<float> bad = x;
    bad[1234] = poison;
    const Bits got = emulated(bad, 127);
    EXPECT_EQ(from_bits<float>(got[0])[std::size_t(chunks)], 1.0f) << "the finiteness flag, for " << poison;
    for (float v : from_bits<float>(got[3]))
      ASSERT_TRUE(std::isnan(v)) << "a flagged sum is NaN everywhere (" << poison << ")";
  }
  float flag = -1.0f;
  std::vector<double> nonfinite(1, -1.0), scratch(1, -1.0);
  layer::int8_absmax(OnEmulator{}, &flag, x.data(), 0, chunk, nonfinite.data(), scratch.data());
  EXPECT_EQ(flag, 0.0f) << "no elements: no chunk, a clear flag";
}

}  // namespace

// Llama's block: RMSNorm (a warp's tree per row: within the GPU test's bound), the rotary GQA gather
// and its backward (per element and summed in query-head order, as the host: bit for bit), SwiGLU
// (the shared per-element code: bit for bit, and rounded once to a 16-bit output).
TEST(LayerKernelsEmu, RmsNormForwardAndBackward) {
  const int N = 19, C = 37;
  const auto inp = randn(std::size_t(N) * C, 11, 2.0f), w = randn(C, 12), dout = randn(std::size_t(N) * C, 13);
  const auto dinp0 = randn(std::size_t(N) * C, 14), dw0 = randn(C, 15);
  std::vector<float> out(std::size_t(N) * C), rstd(N);
  loom::kernels::rmsnorm_forward(out.data(), rstd.data(), inp.data(), w.data(), N, C, 1e-5f);
  std::vector<float> dinp = dinp0, dw = dw0;
  loom::kernels::rmsnorm_backward(dinp.data(), dw.data(), dout.data(), inp.data(), w.data(), rstd.data(), N, C);
  const Bits fwd = in_every_schedule([&](const OnEmulator& launch) {
    std::vector<float> o(out.size()), r(N);
    layer::rmsnorm_forward(launch, o.data(), r.data(), inp.data(), w.data(), N, C, 1e-5f);
    return Bits{bits_of(o), bits_of(r)};
  });
  EXPECT_LT(rel_err(from_bits<float>(fwd[0]), out), 1e-5);
  EXPECT_LT(rel_err(from_bits<float>(fwd[1]), rstd), 1e-5);
  const Bits bwd = in_every_schedule([&](const OnEmulator& launch) {
    std::vector<float> di = dinp0, dwk = dw0, scratch(std::size_t(layer::column_scratch_floats(N, C, 1)));
    layer::rmsnorm_backward(launch, di.data(), dwk.data(), dout.data(), inp.data(), w.data(), rstd.data(), N, C,
                            scratch.data(), std::int64_t(scratch.size()));
    return Bits{bits_of(di), bits_of(dwk)};
  });
  EXPECT_LT(rel_err(from_bits<float>(bwd[0]), dinp), 1e-5);
  EXPECT_LT(rel_err(from_bits<float>(bwd[1]), dw), 1e-5);
}

TEST(LayerKernelsEmu, RopeGqaIsTheHostsBitForBit) {
  const int T = 7, N = 2 * T, hs = 8;
  // (query heads, kv heads held, first query head, first kv head, group): one rank's whole model,
  // grouped and multi-query; a tp rank's share with its kv heads split, and with them replicated.
  const int cases[][5] = {{4, 2, 0, 0, 2}, {4, 1, 0, 0, 4}, {2, 1, 2, 1, 2}, {2, 2, 2, 0, 2}};
  for (const auto& c : cases) {
    const int NH = c[0], KV = c[1], head0 = c[2], kv0 = c[3], group = c[4];
    const auto q = randn(std::size_t(N) * NH * hs, 21), k = randn(std::size_t(N) * KV * hs, 22),
               v = randn(std::size_t(N) * KV * hs, 23), g = randn(std::size_t(N) * 3 * NH * hs, 24);
    std::vector<float> qkv(g.size()), dq(q.size()), dk(k.size()), dv(v.size());
    loom::kernels::rope_gqa_forward(qkv.data(), q.data(), k.data(), v.data(), N, T, NH, KV, hs, head0, kv0, group,
                                    500.0);
    loom::kernels::rope_gqa_backward(dq.data(), dk.data(), dv.data(), g.data(), N, T, NH, KV, hs, head0, kv0, group,
                                     500.0);
    const Bits got = in_every_schedule([&](const OnEmulator& launch) {
      std::vector<float> o(qkv.size(), 9.0f), a(dq.size(), 9.0f), b(dk.size(), 9.0f), e(dv.size(), 9.0f);
      layer::rope_gqa_forward(launch, o.data(), q.data(), k.data(), v.data(), N, T, NH, KV, hs, head0, kv0, group,
                              500.0f);
      layer::rope_gqa_backward(launch, a.data(), b.data(), e.data(), g.data(), N, T, NH, KV, hs, head0, kv0, group,
                               500.0f);
      return Bits{bits_of(o), bits_of(a), bits_of(b), bits_of(e)};
    });
    EXPECT_EQ(got[0], bits_of(qkv)) << "NH " << NH << " KV " << KV;
    EXPECT_EQ(got[1], bits_of(dq)) << "NH " << NH << " KV " << KV;
    EXPECT_EQ(got[2], bits_of(dk)) << "NH " << NH << " KV " << KV;
    EXPECT_EQ(got[3], bits_of(dv)) << "NH " << NH << " KV " << KV;
  }
}

TEST(LayerKernelsEmu, SwigluIsTheHostsBitForBit) {
  const std::int64_t n = 1001;
  const auto gate = randn(n, 31, 3.0f), up = randn(n, 32), dout = randn(n, 33);
  std::vector<float> out(n), dg(n), du(n);
  loom::kernels::swiglu_forward(out.data(), gate.data(), up.data(), n);
  loom::kernels::swiglu_backward(dg.data(), du.data(), dout.data(), gate.data(), up.data(), n);
  const Bits got = in_every_schedule([&](const OnEmulator& launch) {
    std::vector<float> o(n), a(n), b(n);
    std::vector<std::uint16_t> o16(n), a16(n), b16(n);
    layer::swiglu_forward(launch, o.data(), gate.data(), up.data(), n);
    layer::swiglu_backward(launch, a.data(), b.data(), dout.data(), gate.data(), up.data(), n);
    layer::swiglu_forward<DType::bf16>(launch, o16.data(), gate.data(), up.data(), n);
    layer::swiglu_backward<DType::bf16>(launch, a16.data(), b16.data(), dout.data(), gate.data(), up.data(), n);
    return Bits{bits_of(o), bits_of(a), bits_of(b), bits_of(o16), bits_of(a16), bits_of(b16)};
  });
  EXPECT_EQ(got[0], bits_of(out));
  EXPECT_EQ(got[1], bits_of(dg));
  EXPECT_EQ(got[2], bits_of(du));
  std::vector<std::uint16_t> o16(n), a16(n), b16(n);
  for (std::int64_t i = 0; i < n; ++i) {
    o16[i] = loom::math::bf16_bits(out[i]);
    a16[i] = loom::math::bf16_bits(dg[i]);
    b16[i] = loom::math::bf16_bits(du[i]);
  }
  EXPECT_EQ(got[3], bits_of(o16));
  EXPECT_EQ(got[4], bits_of(a16));
  EXPECT_EQ(got[5], bits_of(b16));
}
