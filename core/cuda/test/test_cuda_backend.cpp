// Every operation of the CUDA back end against its host twin, on the same random inputs: the
// outputs agree to a relative error of the whole tensor's norm (||dev - host|| / ||host||), 1e-5
// for fp32 kernels (the order of the sums differs), and bit for
// bit where the arithmetic has no order: casts, fills, and the elementwise kernels whose arithmetic
// is core/backend/kernel_math.hpp (GELU, AdamW: compiled without fused multiply-adds on both sides). Labelled
// `gpu`: without a visible GPU every test is skipped and says why.
#include <gtest/gtest.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/backend/backend_select.hpp"
#include "core/backend/blas_core.hpp"
#include "core/cuda/kernels.cuh"
#include "core/cuda/test/attention_reference.hpp"
#include "core/test/tensors.hpp"

extern "C" int loom_cuda_device_count(char* why, int why_len);
extern "C" loom::Backend* loom_cuda_create(int device, int tf32);

namespace {

using loom::Backend;
using loom::BufferRef;
using loom::DType;
using loom::Mem;
using loom::MemSpace;
using loom::TypedBuffer;

std::string no_gpu_reason() {
  char why[256] = {0};
  const int n = loom_cuda_device_count(why, sizeof why);
  return n > 0 ? "" : std::string("no CUDA device visible: ") + why;
}

#define REQUIRE_GPU()                            \
  do {                                           \
    const std::string reason = no_gpu_reason();  \
    if (!reason.empty()) GTEST_SKIP() << reason; \
  } while (0)

using loom::testing::randn;
using loom::testing::rel_err;

// The two back ends and tensors held in both: `h` on the host, `d` on the device, same contents.
struct Twins {
  std::unique_ptr<Backend> host = loom::make_host_backend(1);
  std::unique_ptr<Backend> dev{loom_cuda_create(0, 0)};
  std::vector<std::unique_ptr<TypedBuffer>> keep;

  struct T {
    BufferRef h, d;  // host and device memory
    std::int64_t n;
  };
  template <class E = float>
  std::pair<BufferRef, BufferRef> both(const std::vector<E>& v) {
    keep.push_back(
        std::make_unique<TypedBuffer>(host->allocate("h", loom::dtype_v<E>, std::int64_t(v.size()), Mem::workspace)));
    const BufferRef h = keep.back()->ref();
    std::memcpy(h.data, v.data(), v.size() * sizeof(E));
    keep.push_back(
        std::make_unique<TypedBuffer>(dev->allocate("d", loom::dtype_v<E>, std::int64_t(v.size()), Mem::workspace)));
    const BufferRef d = keep.back()->ref();
    dev->copy_from_host(d, v.data());
    return {h, d};
  }
  T make(const std::vector<float>& v) {
    auto [h, d] = both(v);
    return {h, d, std::int64_t(v.size())};
  }
  T zeros(std::int64_t n) { return make(std::vector<float>(std::size_t(n), 0.0f)); }
  // A host buffer's elements.
  template <class E>
  static std::vector<E> vec(const BufferRef& h) {
    const E* p = h.as<const E>();
    return std::vector<E>(p, p + h.count);
  }
  std::vector<float> host_of(const T& t) const { return vec<float>(t.h); }
  std::vector<float> dev_of(const T& t) const {
    std::vector<float> v(std::size_t(t.n));
    dev->copy_to_host(v.data(), t.d);
    return v;
  }
  double err(const T& t) const { return rel_err(dev_of(t), host_of(t)); }
};

constexpr double kTol = 1e-5;

TEST(CudaBackend, EncoderForwardAndBackward) {
  REQUIRE_GPU();
  Twins tw;
  const int B = 3, T = 17, C = 40, V = 50, vb = 10, ve = 35;  // a tp shard of the vocabulary
  std::vector<std::int32_t> tok(B * T);
  std::mt19937 g(1);
  for (auto& t : tok) t = std::int32_t(g() % V);
  auto [th, td] = tw.both(tok);
  auto wte = tw.make(randn(std::size_t(ve - vb) * C, 2)), wpe = tw.make(randn(std::size_t(T) * C, 3));
  auto out = tw.zeros(std::int64_t(B) * T * C);
  for (bool pos : {true, false}) {
    tw.host->encoder_forward(out.h, th, wte.h, wpe.h, B, T, C, vb, ve, pos);
    tw.dev->encoder_forward(out.d, td, wte.d, wpe.d, B, T, C, vb, ve, pos);
    EXPECT_LT(tw.err(out), 1e-7) << "add_pos " << pos;
  }
  auto dout = tw.make(randn(std::size_t(B) * T * C, 4));
  auto dwte = tw.make(randn(std::size_t(ve - vb) * C, 5)), dwpe = tw.make(randn(std::size_t(T) * C, 6));
  tw.host->encoder_backward(dwte.h, dwpe.h, dout.h, th, B, T, C, vb, ve);
  tw.dev->encoder_backward(dwte.d, dwpe.d, dout.d, td, B, T, C, vb, ve);
  EXPECT_EQ(tw.dev_of(dwte), tw.host_of(dwte)) << "a token's rows added in row order, as the host";
  EXPECT_EQ(tw.dev_of(dwpe), tw.host_of(dwpe));
}

// The fused residual add + LayerNorm against the host's: the sum exactly, the rows as LayerNorm's.
TEST(CudaBackend, ResidualLayerNormForward) {
  REQUIRE_GPU();
  Twins tw;
  const int N = 75, C = 96;
  auto a = tw.make(randn(std::size_t(N) * C, 11, 2.0f)), b = tw.make(randn(std::size_t(N) * C, 12));
  auto w = tw.make(randn(C, 13)), bias = tw.make(randn(C, 14));
  auto sum = tw.zeros(std::int64_t(N) * C), out = tw.zeros(std::int64_t(N) * C), mean = tw.zeros(N), rstd = tw.zeros(N);
  tw.host->residual_layernorm_forward(sum.h, out.h, mean.h, rstd.h, a.h, b.h, w.h, bias.h, N, C);
  tw.dev->residual_layernorm_forward(sum.d, out.d, mean.d, rstd.d, a.d, b.d, w.d, bias.d, N, C);
  EXPECT_EQ(tw.dev_of(sum), tw.host_of(sum)) << "the residual";
  EXPECT_LT(tw.err(out), kTol);
  EXPECT_LT(tw.err(mean), kTol);
  EXPECT_LT(tw.err(rstd), kTol);
}

TEST(CudaBackend, LayerNormForwardAndBackward) {
  REQUIRE_GPU();
  Twins tw;
  const int N = 75, C = 96;
  auto inp = tw.make(randn(std::size_t(N) * C, 1, 2.0f)), w = tw.make(randn(C, 2)), b = tw.make(randn(C, 3));
  auto out = tw.zeros(std::int64_t(N) * C), mean = tw.zeros(N), rstd = tw.zeros(N);
  tw.host->layernorm_forward(out.h, mean.h, rstd.h, inp.h, w.h, b.h, N, C);
  tw.dev->layernorm_forward(out.d, mean.d, rstd.d, inp.d, w.d, b.d, N, C);
  EXPECT_LT(tw.err(out), kTol);
  EXPECT_LT(tw.err(mean), kTol);
  EXPECT_LT(tw.err(rstd), kTol);
  auto dout = tw.make(randn(std::size_t(N) * C, 4));
  auto dinp = tw.make(randn(std::size_t(N) * C, 5)), dw = tw.make(randn(C, 6)), db = tw.make(randn(C, 7));  // +=
  tw.host->layernorm_backward(dinp.h, dw.h, db.h, dout.h, inp.h, w.h, mean.h, rstd.h, N, C);
  tw.dev->layernorm_backward(dinp.d, dw.d, db.d, dout.d, inp.d, w.d, mean.d, rstd.d, N, C);
  EXPECT_LT(tw.err(dinp), kTol);
  EXPECT_LT(tw.err(dw), kTol);
  EXPECT_LT(tw.err(db), kTol);
}

// The fused MLP operations against the host back end's: pre as matmul_forward's, gelu of it, and
// the fused backward's dpre bit for bit, its bias sums to float rounding.
TEST(CudaBackend, FusedMatmulGeluAndGeluBiasBackward) {
  REQUIRE_GPU();
  Twins tw;
  const int N = 64, C = 48, OC = 80;
  auto inp = tw.make(randn(std::size_t(N) * C, 1)), w = tw.make(randn(std::size_t(OC) * C, 2)),
       b = tw.make(randn(OC, 3));
  auto out = tw.zeros(std::int64_t(N) * OC), pre = tw.zeros(std::int64_t(N) * OC);
  tw.host->matmul_forward_gelu(out.h, pre.h, inp.h, w.h, b.h, N, C, OC);
  tw.dev->matmul_forward_gelu(out.d, pre.d, inp.d, w.d, b.d, N, C, OC);
  EXPECT_LT(tw.err(pre), kTol);
  EXPECT_LT(tw.err(out), kTol);
  auto dout = tw.make(randn(std::size_t(N) * OC, 4)), dpre = tw.zeros(std::int64_t(N) * OC), db = tw.make(randn(OC, 5));
  auto pre2 = tw.make(randn(std::size_t(N) * OC, 6, 2.0f));
  tw.host->gelu_bias_backward(dpre.h, db.h, pre2.h, dout.h, N, OC);
  tw.dev->gelu_bias_backward(dpre.d, db.d, pre2.d, dout.d, N, OC);
  EXPECT_EQ(tw.dev_of(dpre), tw.host_of(dpre));
  EXPECT_LT(tw.err(db), kTol);
}

// The producers storing bf16 through the back end (its type dispatch): each the device's own fp32 output
// rounded by the host's conversion, bit for bit; matmul_backward's bias with its dout copy in one pass
// gives the bits of the product without a bias and bias_backward apart.
TEST(CudaBackend, ProducersStoreBf16AsTheirFp32OutputsRounded) {
  REQUIRE_GPU();
  Twins tw;
  tw.dev->set_precision({DType::bf16, DType::f32});
  const int N = 64, C = 48, OC = 80;
  const std::int64_t NC = std::int64_t(N) * C, NO = std::int64_t(N) * OC;
  auto x = tw.make(randn(std::size_t(NC), 1, 2.0f)), y = tw.make(randn(std::size_t(NC), 2)), w = tw.make(randn(C, 3)),
       b = tw.make(randn(C, 4)), W = tw.make(randn(std::size_t(OC) * C, 5)), bias = tw.make(randn(OC, 6)),
       d = tw.make(randn(std::size_t(NO), 7));
  const auto b16 = [&](std::int64_t n) { return tw.both(std::vector<loom::bf16>(std::size_t(n))).second; };
  const auto bits16 = [&](const BufferRef& dev16) {
    std::vector<std::uint16_t> v(std::size_t(dev16.count));
    tw.dev->copy_to_host(v.data(), dev16);
    return v;
  };
  const auto rounded = [&](const Twins::T& t) {
    std::vector<std::uint16_t> v;
    for (float f : tw.dev_of(t)) v.push_back(loom::to_bf16(f).bits);
    return v;
  };
  auto o = tw.zeros(NC), m = tw.zeros(N), s = tw.zeros(N), r = tw.zeros(NC);
  BufferRef o16 = b16(NC);
  tw.dev->layernorm_forward(o.d, m.d, s.d, x.d, w.d, b.d, N, C);
  tw.dev->layernorm_forward(o16, m.d, s.d, x.d, w.d, b.d, N, C);
  EXPECT_EQ(bits16(o16), rounded(o)) << "layernorm_forward";
  tw.dev->residual_layernorm_forward(r.d, o.d, m.d, s.d, x.d, y.d, w.d, b.d, N, C);
  tw.dev->residual_layernorm_forward(r.d, o16, m.d, s.d, x.d, y.d, w.d, b.d, N, C);
  EXPECT_EQ(bits16(o16), rounded(o)) << "residual_layernorm_forward";
  auto act = tw.zeros(NO), pre = tw.zeros(NO), dpre = tw.zeros(NO), db = tw.make(randn(OC, 8));
  BufferRef act16 = b16(NO), dpre16 = b16(NO);
  tw.dev->matmul_forward_gelu(act.d, pre.d, x.d, W.d, bias.d, N, C, OC);
  tw.dev->matmul_forward_gelu(act16, pre.d, x.d, W.d, bias.d, N, C, OC);
  EXPECT_EQ(bits16(act16), rounded(act)) << "matmul_forward_gelu";
  tw.dev->gelu_bias_backward(dpre.d, db.d, pre.d, d.d, N, OC);
  tw.dev->gelu_bias_backward(dpre16, db.d, pre.d, d.d, N, OC);
  EXPECT_EQ(bits16(dpre16), rounded(dpre)) << "gelu_bias_backward";
  std::vector<float> pv = tw.dev_of(d);
  for (float& p : pv) p = std::fabs(p) / 40.0f;
  auto probs = tw.make(pv), dl = tw.zeros(NO);
  std::vector<std::int32_t> tg(N);
  for (int n = 0; n < N; ++n) tg[std::size_t(n)] = (n * 37) % (OC + 20);
  const BufferRef targets = tw.both(tg).second, dl16 = b16(NO);
  tw.dev->crossentropy_backward(dl.d, probs.d, targets, 0.37f, N, OC, 0);
  tw.dev->crossentropy_backward(dl16, probs.d, targets, 0.37f, N, OC, 0);
  EXPECT_EQ(bits16(dl16), rounded(dl)) << "crossentropy_backward";
  auto di = tw.zeros(NC), dw = tw.zeros(std::int64_t(OC) * C), di2 = tw.zeros(NC), dw2 = tw.zeros(std::int64_t(OC) * C);
  auto db1 = tw.make(randn(OC, 9)), db2 = tw.make(randn(OC, 9));
  tw.dev->matmul_backward(di.d, dw.d, db1.d, d.d, x.d, W.d, N, C, OC);
  tw.dev->matmul_backward(di2.d, dw2.d, {}, d.d, x.d, W.d, N, C, OC);
  tw.dev->bias_backward(db2.d, d.d, N, OC);
  EXPECT_EQ(tw.dev_of(di), tw.dev_of(di2)) << "matmul_backward with a bias: dinp";
  EXPECT_EQ(tw.dev_of(dw), tw.dev_of(dw2)) << "matmul_backward with a bias: dweight";
  EXPECT_EQ(tw.dev_of(db1), tw.dev_of(db2)) << "matmul_backward's bias: bias_backward's sums";
}

TEST(CudaBackend, MatmulForwardAndBackwardWithBias) {
  REQUIRE_GPU();
  for (DType precision : {DType::f32, DType::bf16}) {
    Twins tw;
    tw.host->set_precision({precision, DType::f32});
    tw.dev->set_precision({precision, DType::f32});
    const int N = 64, C = 48, OC = 80;
    auto inp = tw.make(randn(std::size_t(N) * C, 1)), w = tw.make(randn(std::size_t(OC) * C, 2)),
         b = tw.make(randn(OC, 3));
    auto out = tw.zeros(std::int64_t(N) * OC);
    tw.host->matmul_forward(out.h, inp.h, w.h, b.h, N, C, OC);
    tw.dev->matmul_forward(out.d, inp.d, w.d, b.d, N, C, OC);
    EXPECT_LT(tw.err(out), kTol) << loom::dtype_name(precision);
    auto dout = tw.make(randn(std::size_t(N) * OC, 4));
    auto dinp = tw.zeros(std::int64_t(N) * C), dw = tw.make(randn(std::size_t(OC) * C, 5)), db = tw.make(randn(OC, 6));
    tw.host->matmul_backward(dinp.h, dw.h, db.h, dout.h, inp.h, w.h, N, C, OC);
    tw.dev->matmul_backward(dinp.d, dw.d, db.d, dout.d, inp.d, w.d, N, C, OC);
    EXPECT_LT(tw.err(dinp), kTol) << loom::dtype_name(precision);
    EXPECT_LT(tw.err(dw), kTol) << loom::dtype_name(precision);
    EXPECT_LT(tw.err(db), kTol) << loom::dtype_name(precision);
  }
}

TEST(CudaBackend, AttentionForwardAndBackward) {
  REQUIRE_GPU();
  Twins tw;
  const int B = 2, T = 33, NH = 4, C = 32;  // head size 8: slices of qkv aligned to 32 bytes only
  auto qkv = tw.make(randn(std::size_t(B) * T * 3 * C, 1));
  auto out = tw.zeros(std::int64_t(B) * T * C), att = tw.zeros(std::int64_t(B) * NH * T * T);
  tw.host->attention_forward(out.h, att.h, qkv.h, B, T, C, NH);
  tw.dev->attention_forward(out.d, att.d, qkv.d, B, T, C, NH);
  EXPECT_LT(tw.err(att), kTol);
  EXPECT_LT(tw.err(out), kTol);
  auto dout = tw.make(randn(std::size_t(B) * T * C, 2));
  auto dqkv = tw.zeros(std::int64_t(B) * T * 3 * C), datt = tw.zeros(std::int64_t(T) * T);
  tw.host->attention_backward(dqkv.h, datt.h, dout.h, qkv.h, att.h, B, T, C, NH);
  tw.dev->attention_backward(dqkv.d, datt.d, dout.d, qkv.d, att.d, B, T, C, NH);
  EXPECT_LT(tw.err(dqkv), kTol);
}

TEST(CudaBackend, ElementwiseKernels) {
  REQUIRE_GPU();
  Twins tw;
  const std::int64_t n = 100003;  // not a multiple of any block size
  auto x = tw.make(randn(std::size_t(n), 1, 3.0f)), y = tw.make(randn(std::size_t(n), 2)), out = tw.zeros(n);
  tw.host->gelu_forward(out.h, x.h, n);
  tw.dev->gelu_forward(out.d, x.d, n);
  EXPECT_EQ(tw.dev_of(out), tw.host_of(out)) << "gelu forward";
  tw.host->gelu_backward(out.h, x.h, y.h, n);
  tw.dev->gelu_backward(out.d, x.d, y.d, n);
  EXPECT_EQ(tw.dev_of(out), tw.host_of(out)) << "gelu backward";
  tw.host->residual_forward(out.h, x.h, y.h, n);
  tw.dev->residual_forward(out.d, x.d, y.d, n);
  EXPECT_EQ(tw.dev_of(out), tw.host_of(out)) << "residual";
  tw.host->scale(out.h, 0.37f);
  tw.dev->scale(out.d, 0.37f);
  EXPECT_EQ(tw.dev_of(out), tw.host_of(out)) << "scale";
  tw.host->copy(out.h, y.h, n);
  tw.dev->copy(out.d, y.d, n);
  EXPECT_EQ(tw.dev_of(out), tw.host_of(out)) << "copy";
  tw.host->axpy(out.h, -0.37f, x.h, n);
  tw.dev->axpy(out.d, -0.37f, x.d, n);
  EXPECT_EQ(tw.dev_of(out), tw.host_of(out)) << "axpy";
  tw.host->fill(out.h, -2.5f);
  tw.dev->fill(out.d, -2.5f);
  EXPECT_EQ(tw.dev_of(out), tw.host_of(out)) << "fill";
  auto b = tw.make(randn(257, 3)), rows = tw.make(randn(std::size_t(300) * 257, 4)), db = tw.make(randn(257, 5));
  tw.host->bias_add(rows.h, b.h, 300, 257);
  tw.dev->bias_add(rows.d, b.d, 300, 257);
  EXPECT_EQ(tw.dev_of(rows), tw.host_of(rows)) << "bias_add";
  tw.host->bias_backward(db.h, rows.h, 300, 257);
  tw.dev->bias_backward(db.d, rows.d, 300, 257);
  EXPECT_LT(tw.err(db), kTol) << "bias_backward";
}

// int8 compression's kernels, bit for bit the host's: the chunk maxima and the flag, the levels and
// the residual, the sum scaled back, and a NaN poisoning it.
TEST(CudaBackend, Int8CompressionIsBitForBitTheHosts) {
  REQUIRE_GPU();
  Twins tw;
  const std::int64_t n = 100003, chunk = 1000, chunks = (n + chunk - 1) / chunk;  // a short last chunk
  std::vector<float> xv = randn(std::size_t(n), 6, 2.0f);
  for (std::int64_t i = 0; i < n; ++i) xv[std::size_t(i)] *= float(1 + i / chunk % 7);  // chunks of different scales
  auto x = tw.make(xv), amax = tw.zeros(chunks + 1), err = tw.zeros(n), back = tw.zeros(n);
  auto [qh, qd] = tw.both(std::vector<std::int8_t>(std::size_t(n), 0));
  for (const int levels : {127, 31}) {
    tw.host->int8_absmax(amax.h, x.h, n, chunk);
    tw.dev->int8_absmax(amax.d, x.d, n, chunk);
    EXPECT_EQ(tw.dev_of(amax), tw.host_of(amax)) << "int8_absmax";
    tw.host->int8_quantize(qh, err.h, x.h, n, chunk, amax.h, levels);
    tw.dev->int8_quantize(qd, err.d, x.d, n, chunk, amax.d, levels);
    std::vector<std::int8_t> q(static_cast<std::size_t>(n));
    tw.dev->copy_to_host(q.data(), qd.slice(0, n));
    EXPECT_EQ(q, Twins::vec<std::int8_t>(qh)) << "int8_quantize levels " << levels;
    EXPECT_EQ(tw.dev_of(err), tw.host_of(err)) << "int8_quantize's residual";
    tw.host->int8_dequantize(back.h, qh, n, chunk, amax.h, levels);
    tw.dev->int8_dequantize(back.d, qd, n, chunk, amax.d, levels);
    EXPECT_EQ(tw.dev_of(back), tw.host_of(back)) << "int8_dequantize";
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  tw.dev->copy_from_host(x.d.slice(4321, 1), &nan);
  tw.dev->int8_absmax(amax.d, x.d, n, chunk);
  EXPECT_EQ(tw.dev_of(amax)[std::size_t(chunks)], 1.0f) << "the finiteness flag";
  tw.dev->int8_dequantize(back.d, qd, n, chunk, amax.d, 127);
  for (float v : tw.dev_of(back)) ASSERT_TRUE(std::isnan(v)) << "a flagged sum is NaN everywhere";
}

// Top-k compression: the device's radix selection (core/cuda/topk.cuh) keeps the host's set in the
// host's order, bit for bit, over several blocks (a gradient-like bucket, one with ties everywhere)
// and at the block cap (9M elements, kMaxBlocks blocks); the scatters as the compressing reducer
// uses them; a NaN sends NaNs.
TEST(CudaBackend, TopKIsBitForBitTheHosts) {
  REQUIRE_GPU();
  Twins tw;
  const std::int64_t n = 1000003;
  const std::vector<float> normal = randn(std::size_t(n), 8, 1.0f);
  std::vector<float> ties(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) ties[std::size_t(i)] = float(int(i * 7919 % 9) - 4) * 0.125f;
  for (const std::vector<float>* xv : {&normal, static_cast<const std::vector<float>*>(&ties)}) {
    auto x = tw.make(*xv), e = tw.make(*xv), sum = tw.zeros(n);
    for (const std::int64_t k : {std::int64_t(1), n / 100, n / 3, n}) {
      auto [ih, id] = tw.both(std::vector<std::int32_t>(std::size_t(k), -1));
      auto val = tw.zeros(k);
      tw.host->topk_select(ih, val.h, x.h, n, k);
      tw.dev->topk_select(id, val.d, x.d, n, k);
      std::vector<std::int32_t> idx(static_cast<std::size_t>(k));
      tw.dev->copy_to_host(idx.data(), id.slice(0, k));
      ASSERT_EQ(idx, Twins::vec<std::int32_t>(ih)) << "topk_select k " << k;
      EXPECT_EQ(tw.dev_of(val), tw.host_of(val)) << "topk_select's values, k " << k;
      tw.host->topk_clear(e.h, ih, k);
      tw.dev->topk_clear(e.d, id, k);
      EXPECT_EQ(tw.dev_of(e), tw.host_of(e)) << "topk_clear";
      tw.host->topk_scatter_add(sum.h, ih, val.h, k);
      tw.dev->topk_scatter_add(sum.d, id, val.d, k);
      EXPECT_EQ(tw.dev_of(sum), tw.host_of(sum)) << "topk_scatter_add";
    }
  }
  auto x = tw.make(normal), val = tw.zeros(10);
  auto [ih, id] = tw.both(std::vector<std::int32_t>(10, -1));
  (void)ih;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  tw.dev->copy_from_host(x.d.slice(654321, 1), &nan);
  tw.dev->topk_select(id, val.d, x.d, n, 10);
  std::vector<std::int32_t> idx(10);
  tw.dev->copy_to_host(idx.data(), id.slice(0, 10));
  for (int j = 0; j < 10; ++j) EXPECT_EQ(idx[std::size_t(j)], j) << "a NaN sends indices 0..k-1";
  for (float v : tw.dev_of(val)) EXPECT_TRUE(std::isnan(v)) << "and NaN values";
  const std::int64_t big = 9000000, kb = big / 100;  // 25 MB buckets (data_parallel.bucket_mb = 25 is 6.5M elements)
  auto xb = tw.make(randn(std::size_t(big), 9, 1.0f)), vb = tw.zeros(kb);
  auto [ibh, ibd] = tw.both(std::vector<std::int32_t>(std::size_t(kb), -1));
  tw.host->topk_select(ibh, vb.h, xb.h, big, kb);
  tw.dev->topk_select(ibd, vb.d, xb.d, big, kb);
  std::vector<std::int32_t> ib(static_cast<std::size_t>(kb));
  tw.dev->copy_to_host(ib.data(), ibd.slice(0, kb));
  EXPECT_EQ(ib, Twins::vec<std::int32_t>(ibh)) << "topk_select at the block cap";
  EXPECT_EQ(tw.dev_of(vb), tw.host_of(vb));
}

void crossentropy_against_fp64(int N, int V);
TEST(CudaBackend, CrossEntropyForwardAndBackward) {
  REQUIRE_GPU();
  crossentropy_against_fp64(37, 50304);  // GPT-2's padded vocabulary: more columns than a block's threads
  crossentropy_against_fp64(19, 1001);   // a row not a multiple of 4 floats: no vector loads
  crossentropy_against_fp64(5, 3);
}
void crossentropy_against_fp64(int N, int V) {
  SCOPED_TRACE("V = " + std::to_string(V));
  Twins tw;
  auto logits = tw.make(randn(std::size_t(N) * V, 1, 4.0f)), losses = tw.zeros(N),
       probs = tw.zeros(std::int64_t(N) * V);
  std::vector<std::int32_t> tgt(N);
  for (int i = 0; i < N; ++i) tgt[std::size_t(i)] = (i * 7919) % V;
  auto [th, td] = tw.both(tgt);
  tw.host->crossentropy_forward(losses.h, probs.h, logits.h, th, N, V);
  tw.dev->crossentropy_forward(losses.d, probs.d, logits.d, td, N, V);
  // The host adds a row's 50304 exponentials one after another in fp32 (relative error up to
  // V 2^-24 = 3e-3, typically ~1e-4); the GPU adds them in a tree. So both are held to a
  // double-precision reference, and the GPU must be at least as close to it as the host (or 1e-6).
  std::vector<float> ref_probs(std::size_t(N) * V), ref_losses(N);
  const std::vector<float> lg = tw.host_of(logits);
  for (int n = 0; n < N; ++n) {
    const float* l = lg.data() + std::size_t(n) * V;
    double mx = l[0], sum = 0;
    for (int v = 1; v < V; ++v) mx = std::max(mx, double(l[v]));
    for (int v = 0; v < V; ++v) sum += std::exp(double(l[v]) - mx);
    for (int v = 0; v < V; ++v) ref_probs[std::size_t(n) * V + v] = float(std::exp(double(l[v]) - mx) / sum);
    ref_losses[std::size_t(n)] = float(std::log(sum) + mx - l[tgt[std::size_t(n)]]);
  }
  const auto as_close_as_host = [&](const Twins::T& t, const std::vector<float>& ref, const char* what) {
    const double dev = rel_err(tw.dev_of(t), ref), host = rel_err(tw.host_of(t), ref);
    EXPECT_LT(dev, std::max(2 * host, 1e-6)) << what << ": cuda " << dev << ", host " << host << " from fp64";
  };
  as_close_as_host(losses, ref_losses, "losses");
  as_close_as_host(probs, ref_probs, "probs");
  tw.host->crossentropy_backward(probs.h, probs.h, th, 0.125f, N, V, 0);  // in place, as the model calls it
  tw.dev->crossentropy_backward(probs.d, probs.d, td, 0.125f, N, V, 0);
  for (int n = 0; n < N; ++n) ref_probs[std::size_t(n) * V + tgt[std::size_t(n)]] -= 1.0f;
  for (float& x : ref_probs) x *= 0.125f;
  as_close_as_host(probs, ref_probs, "dlogits");
}

// The vocabulary-parallel cross-entropy's three passes and the backward with vocab_begin (the
// tensor strategy's), against the host's, on a middle shard of the vocabulary: targets below, in
// and above this rank's columns.
TEST(CudaBackend, VocabularyParallelCrossEntropy) {
  REQUIRE_GPU();
  Twins tw;
  const int N = 29, V = 1000, vb = 1000;  // this rank: entries [1000, 2000) of a vocabulary of 3000
  auto logits = tw.make(randn(std::size_t(N) * V, 6, 4.0f)), row_max = tw.zeros(N),
       probs = tw.zeros(std::int64_t(N) * V), losses = tw.zeros(N);
  std::vector<std::int32_t> tgt(N);
  for (int i = 0; i < N; ++i) tgt[std::size_t(i)] = (i * 7919) % (3 * V);
  auto [th, td] = tw.both(tgt);
  auto [sh, sd] = tw.both(std::vector<double>(std::size_t(N), 0.0));
  auto [gh, gd] = tw.both(std::vector<double>(std::size_t(N), 0.0));
  tw.host->crossentropy_row_max(row_max.h, logits.h, N, V);
  tw.dev->crossentropy_row_max(row_max.d, logits.d, N, V);
  EXPECT_EQ(tw.dev_of(row_max), tw.host_of(row_max)) << "row maxima";
  tw.host->crossentropy_partial(probs.h, sh, gh, logits.h, row_max.h, th, N, V, vb);
  tw.dev->crossentropy_partial(probs.d, sd, gd, logits.d, row_max.d, td, N, V, vb);
  EXPECT_EQ(tw.dev_of(probs), tw.host_of(probs)) << "exponentials (the shared exp)";
  std::vector<double> sum_dev(static_cast<std::size_t>(N)), tl_dev(static_cast<std::size_t>(N));
  tw.dev->copy_to_host(sum_dev.data(), sd.slice(0, N));
  tw.dev->copy_to_host(tl_dev.data(), gd.slice(0, N));
  for (int n = 0; n < N; ++n) {
    EXPECT_NEAR(sum_dev[std::size_t(n)], sh.as<double>()[n], 1e-12 * sh.as<double>()[n])
        << "sum of exponentials, row " << n;
    EXPECT_EQ(tl_dev[std::size_t(n)], gh.as<double>()[n]) << "target logit, row " << n;
    const int t = tgt[std::size_t(n)] - vb;
    EXPECT_EQ(gh.as<double>()[n],
              t >= 0 && t < V ? double(logits.h.as<float>()[std::size_t(n) * V + std::size_t(t)]) : 0.0)
        << "row " << n;
  }
  tw.host->crossentropy_finish(losses.h, probs.h, sh, row_max.h, gh, N, V);
  tw.dev->crossentropy_finish(losses.d, probs.d, sd, row_max.d, gd, N, V);
  EXPECT_LT(tw.err(losses), 1e-6) << "losses";
  EXPECT_LT(tw.err(probs), 1e-6) << "probabilities";
  tw.host->crossentropy_backward(probs.h, probs.h, th, 0.25f, N, V, vb);
  tw.dev->crossentropy_backward(probs.d, probs.d, td, 0.25f, N, V, vb);
  EXPECT_LT(tw.err(probs), 1e-6) << "dlogits";
}

// The fused classifier through the back end: crossentropy_fused (in place over fp32 logits, or into a
// bf16 table) and, vocabulary-parallel, crossentropy_partial without exponentials then
// crossentropy_finish_grad, each the device's forward then backward bit for bit, and the host's to 1e-6.
TEST(CudaBackend, FusedClassifierIsForwardThenBackward) {
  REQUIRE_GPU();
  Twins tw;
  const int N = 29, V = 1000, vb = 1000;
  const std::vector<float> lv = randn(std::size_t(N) * V, 10, 4.0f);
  std::vector<std::int32_t> tgt(N), wide(N);
  for (int i = 0; i < N; ++i) {
    tgt[std::size_t(i)] = (i * 7919) % V;
    wide[std::size_t(i)] = (i * 7919) % (3 * V);
  }
  const BufferRef targets_d = tw.both(tgt).second, wide_d = tw.both(wide).second;
  const BufferRef targets_h = tw.both(tgt).first;
  const auto bits16 = [&](const BufferRef& dev16) {
    std::vector<std::uint16_t> v(std::size_t(dev16.count));
    tw.dev->copy_to_host(v.data(), dev16);
    return v;
  };
  const auto b16 = [&](std::int64_t n) { return tw.both(std::vector<loom::bf16>(std::size_t(n))).second; };
  const float dloss = 0.37f;
  // unfused on the device: forward in place, then the backward in place (fp32) and into bf16
  auto probs = tw.make(lv), losses = tw.zeros(N);
  tw.dev->crossentropy_forward(losses.d, probs.d, probs.d, targets_d, N, V);
  const BufferRef dl16 = b16(std::int64_t(N) * V);
  tw.dev->crossentropy_backward(dl16, probs.d, targets_d, dloss, N, V, 0);
  tw.dev->crossentropy_backward(probs.d, probs.d, targets_d, dloss, N, V, 0);
  // fused
  auto table = tw.make(lv), logits = tw.make(lv), fl = tw.zeros(N), fl16 = tw.zeros(N);
  tw.host->crossentropy_fused(fl.h, table.h, table.h, targets_h, dloss, N, V);
  tw.dev->crossentropy_fused(fl.d, table.d, table.d, targets_d, dloss, N, V);
  const BufferRef f16 = b16(std::int64_t(N) * V);
  tw.dev->crossentropy_fused(fl16.d, f16, logits.d, targets_d, dloss, N, V);
  EXPECT_EQ(tw.dev_of(fl), tw.dev_of(losses)) << "losses";
  EXPECT_EQ(tw.dev_of(fl16), tw.dev_of(losses)) << "losses (bf16 dlogits)";
  EXPECT_EQ(tw.dev_of(table), tw.dev_of(probs)) << "dlogits in place";
  EXPECT_EQ(bits16(f16), bits16(dl16)) << "bf16 dlogits";
  EXPECT_LT(tw.err(fl), 1e-6) << "losses against the host";
  EXPECT_LT(tw.err(table), 1e-6) << "dlogits against the host";

  // vocabulary-parallel
  auto row_max = tw.zeros(N), e = tw.zeros(std::int64_t(N) * V), lt = tw.zeros(N), lg = tw.zeros(N);
  auto [sh, sd] = tw.both(std::vector<double>(std::size_t(N), 0.0));
  auto [gh, gd] = tw.both(std::vector<double>(std::size_t(N), 0.0));
  auto [sh0, sd0] = tw.both(std::vector<double>(std::size_t(N), 0.0));
  auto [gh0, gd0] = tw.both(std::vector<double>(std::size_t(N), 0.0));
  tw.dev->crossentropy_row_max(row_max.d, logits.d, N, V);
  tw.dev->crossentropy_partial(e.d, sd, gd, logits.d, row_max.d, wide_d, N, V, vb);
  tw.dev->crossentropy_finish(lt.d, e.d, sd, row_max.d, gd, N, V);
  tw.dev->crossentropy_backward(e.d, e.d, wide_d, dloss, N, V, vb);
  tw.dev->crossentropy_partial({}, sd0, gd0, logits.d, row_max.d, wide_d, N, V, vb);
  auto dg = tw.zeros(std::int64_t(N) * V);
  tw.dev->crossentropy_finish_grad(lg.d, dg.d, logits.d, sd0, row_max.d, gd0, wide_d, dloss, N, V, vb);
  EXPECT_EQ(tw.dev_of(lg), tw.dev_of(lt)) << "vocabulary-parallel losses";
  EXPECT_EQ(tw.dev_of(dg), tw.dev_of(e)) << "vocabulary-parallel dlogits";
}

TEST(CudaBackend, AdamWAndReductions) {
  REQUIRE_GPU();
  Twins tw;
  const std::int64_t n = 70001;
  auto p = tw.make(randn(std::size_t(n), 1)), m = tw.make(randn(std::size_t(n), 2, 0.1f)),
       g = tw.make(randn(std::size_t(n), 4));
  std::vector<float> v0 = randn(std::size_t(n), 3, 0.1f);
  for (float& x : v0) x = x * x;
  auto v = tw.make(v0);
  for (std::int64_t t = 1; t <= 3; ++t) {
    tw.host->adamw_update(p.h, m.h, v.h, g.h, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, t);
    tw.dev->adamw_update(p.d, m.d, v.d, g.d, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, t);
  }
  EXPECT_EQ(tw.dev_of(p), tw.host_of(p)) << "AdamW parameters";
  EXPECT_EQ(tw.dev_of(m), tw.host_of(m)) << "AdamW first moments";
  EXPECT_EQ(tw.dev_of(v), tw.host_of(v)) << "AdamW second moments";
  const double sh = tw.host->sq_norm_check({g.h}).sum_squares, sd = tw.dev->sq_norm_check({g.d}).sum_squares;
  EXPECT_NEAR(sd, sh, 1e-6 * sh);
  const double uh = tw.host->sum(g.h, n), ud = tw.dev->sum(g.d, n);
  EXPECT_NEAR(ud, uh, 1e-6 * sh);
  EXPECT_EQ(tw.dev->sq_norm_check({g.d}).sum_squares, sd) << "the device reduction is deterministic";
}

TEST(CudaBackend, TypedCastsAreBitForBitTheHosts) {
  REQUIRE_GPU();
  Twins tw;
  const std::int64_t n = 4099;
  std::vector<double> src64(static_cast<std::size_t>(n));
  std::mt19937_64 gen(9);
  std::normal_distribution<double> d(0.0, 100.0);
  for (auto& x : src64) x = d(gen);
  src64[0] = std::numeric_limits<double>::quiet_NaN();
  src64[1] = std::numeric_limits<double>::infinity();
  src64[2] = 1e6;                                               // overflows fp16
  src64[3] = 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30);  // rounds up in bf16 only when rounded once
  const DType types[] = {DType::f64, DType::f32, DType::bf16, DType::f16};
  for (DType to : types)
    for (DType from : types) {
      const std::size_t fb = loom::dtype_size(from), tb = loom::dtype_size(to);
      TypedBuffer hs = tw.host->allocate("hs", from, n, Mem::workspace),
                  ht = tw.host->allocate("ht", to, n, Mem::workspace);
      TypedBuffer ds = tw.dev->allocate("ds", from, n, Mem::workspace),
                  dt = tw.dev->allocate("dt", to, n, Mem::workspace);
      TypedBuffer h64 = tw.host->allocate("h64", DType::f64, n, Mem::workspace);
      std::memcpy(h64.data<double>(), src64.data(), std::size_t(n) * 8);
      tw.host->cast(hs.ref(), h64.ref());  // the source values, as `from` holds them
      tw.dev->copy_from_host(ds.ref(), hs.ref().data);
      tw.host->cast(ht.ref(), hs.ref());
      tw.dev->cast(dt.ref(), ds.ref());
      std::vector<unsigned char> got(std::size_t(n) * tb);
      tw.dev->copy_to_host(got.data(), dt.ref());
      // NaN payloads may differ: compare NaN-ness through fp64, the rest bit for bit.
      TypedBuffer back = tw.host->allocate("back", to, n, Mem::workspace),
                  g64 = tw.host->allocate("g64", DType::f64, n, Mem::workspace),
                  w64 = tw.host->allocate("w64", DType::f64, n, Mem::workspace);
      std::memcpy(back.ref().data, got.data(), got.size());
      tw.host->cast(g64.ref(), back.ref());
      tw.host->cast(w64.ref(), ht.ref());
      int mismatches = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        const double a = g64.data<double>()[i], b = w64.data<double>()[i];
        if (!(a == b || (std::isnan(a) && std::isnan(b)))) ++mismatches;
      }
      EXPECT_EQ(mismatches, 0) << loom::dtype_name(from) << " -> " << loom::dtype_name(to) << " (" << fb << " -> " << tb
                               << " bytes)";
    }
}

TEST(CudaBackend, TypedMatmulNormCheckScaleFill) {
  REQUIRE_GPU();
  Twins tw;
  const int M = 33, N = 65, K = 47;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      auto a = tw.make(randn(std::size_t(M) * K, 1)), b = tw.make(randn(std::size_t(K) * N, 2)),
           c = tw.make(randn(std::size_t(M) * N, 3));
      tw.host->matmul(c.h, a.h, b.h, M, N, K, ta, tb, 0.5f, 2.0f);
      tw.dev->matmul(c.d, a.d, b.d, M, N, K, ta, tb, 0.5f, 2.0f);
      EXPECT_LT(tw.err(c), kTol) << "transa " << ta << " transb " << tb;
    }
  // fp64, fp16 and bf16 operands, fp32 operands into a bf16 out, and TF32.
  {
    std::vector<double> a64(std::size_t(M) * K), b64(std::size_t(K) * N);
    std::mt19937_64 gen(3);
    std::normal_distribution<double> nd;
    for (auto& x : a64) x = nd(gen);
    for (auto& x : b64) x = nd(gen);
    for (DType t : {DType::f64, DType::f16, DType::bf16}) {
      TypedBuffer h64a = tw.host->allocate("a", DType::f64, a64.size(), Mem::workspace),
                  h64b = tw.host->allocate("b", DType::f64, b64.size(), Mem::workspace);
      std::memcpy(h64a.ref().data, a64.data(), a64.size() * 8);
      std::memcpy(h64b.ref().data, b64.data(), b64.size() * 8);
      TypedBuffer ha = tw.host->allocate("ha", t, a64.size(), Mem::workspace),
                  hb = tw.host->allocate("hb", t, b64.size(), Mem::workspace);
      tw.host->cast(ha.ref(), h64a.ref());
      tw.host->cast(hb.ref(), h64b.ref());
      TypedBuffer da = tw.dev->allocate("da", t, a64.size(), Mem::workspace),
                  db = tw.dev->allocate("db", t, b64.size(), Mem::workspace);
      tw.dev->copy_from_host(da.ref(), ha.ref().data);
      tw.dev->copy_from_host(db.ref(), hb.ref().data);
      const DType out_t = t == DType::f64 ? DType::f64 : DType::f32;
      TypedBuffer hc = tw.host->allocate("hc", out_t, std::int64_t(M) * N, Mem::workspace),
                  dc = tw.dev->allocate("dc", out_t, std::int64_t(M) * N, Mem::workspace);
      tw.host->matmul(hc.ref(), ha.ref(), hb.ref(), M, N, K, false, false);
      tw.dev->matmul(dc.ref(), da.ref(), db.ref(), M, N, K, false, false);
      TypedBuffer got = tw.host->allocate("got", out_t, std::int64_t(M) * N, Mem::workspace);
      tw.dev->copy_to_host(got.ref().data, dc.ref());
      TypedBuffer g32 = tw.host->allocate("g32", DType::f32, std::int64_t(M) * N, Mem::workspace),
                  w32 = tw.host->allocate("w32", DType::f32, std::int64_t(M) * N, Mem::workspace);
      tw.host->cast(g32.ref(), got.ref());
      tw.host->cast(w32.ref(), hc.ref());
      EXPECT_LT(rel_err(std::vector<float>(g32.data<float>(), g32.data<float>() + M * N),
                        std::vector<float>(w32.data<float>(), w32.data<float>() + M * N)),
                kTol)
          << loom::dtype_name(t) << " operands";
    }
    auto a = tw.make(randn(std::size_t(M) * K, 11)), b = tw.make(randn(std::size_t(K) * N, 12));
    TypedBuffer hc = tw.host->allocate("hc", DType::bf16, std::int64_t(M) * N, Mem::workspace),
                dc = tw.dev->allocate("dc", DType::bf16, std::int64_t(M) * N, Mem::workspace);
    tw.host->matmul(hc.ref(), a.h, b.h, M, N, K, false, false);
    tw.dev->matmul(dc.ref(), a.d, b.d, M, N, K, false, false);
    std::vector<std::uint16_t> hb(std::size_t(M) * N), db(hb.size());
    std::memcpy(hb.data(), hc.ref().data, hb.size() * 2);
    tw.dev->copy_to_host(db.data(), dc.ref());
    int far = 0;  // fp32 sums in another order may round to the neighbouring bf16 value, no further
    for (std::size_t i = 0; i < hb.size(); ++i) far += std::abs(int(hb[i]) - int(db[i])) > 1;
    EXPECT_EQ(far, 0) << "fp32 operands into a bf16 out";
    std::unique_ptr<Backend> tf32{loom_cuda_create(0, 1)};
    auto c = tw.make(std::vector<float>(std::size_t(M) * N, 0.0f));
    tw.host->matmul(c.h, a.h, b.h, M, N, K, false, false);
    tf32->matmul(c.d, a.d, b.d, M, N, K, false, false);
    tf32->synchronize();
    const double e = tw.err(c);
    EXPECT_LT(e, 3e-3) << "TF32: 10-bit mantissa products";
    EXPECT_GT(e, 1e-6) << "run.tf32 = true is not TF32 (the products are as exact as fp32)";
    // run.tf32 = auto: full fp32 in an fp32 run; TF32 in a bf16 run, whose fp32 products are attention's.
    for (const DType precision : {DType::f32, DType::bf16}) {
      std::unique_ptr<Backend> autod{loom_cuda_create(0, 2)};
      autod->set_precision({precision});
      autod->matmul(c.d, a.d, b.d, M, N, K, false, false);
      autod->synchronize();
      const double ea = tw.err(c);
      if (precision == DType::f32)
        EXPECT_LT(ea, 1e-5) << "run.tf32 = auto in an fp32 run: full fp32 products";
      else
        EXPECT_GT(ea, 1e-6) << "run.tf32 = auto in a bf16 run: TF32 for the fp32 products";
    }
  }
  std::vector<float> with_nan = randn(1000, 4);
  with_nan[517] = std::numeric_limits<float>::quiet_NaN();
  auto t0 = tw.make(randn(5000, 5)), t1 = tw.make(with_nan);
  const loom::NormCheck h = tw.host->sq_norm_check({t0.h});
  const loom::NormCheck d = tw.dev->sq_norm_check({t0.d});
  EXPECT_NEAR(d.sum_squares, h.sum_squares, 1e-6 * h.sum_squares);
  EXPECT_TRUE(d.all_finite);
  const loom::NormCheck bad = tw.dev->sq_norm_check({t0.d, t1.d});
  EXPECT_FALSE(bad.all_finite);
  EXPECT_EQ(bad.first_nonfinite, 1);
  tw.host->scale(t0.h, 0.25);
  tw.dev->scale(t0.d, 0.25);
  EXPECT_EQ(tw.dev_of(t0), tw.host_of(t0));
  EXPECT_THROW(tw.dev->cast(t0.h, t0.d), std::invalid_argument)
      << "a host buffer given to the cuda back end is refused";
}

// adamw_update_slices (two launches on the device for 40 slices) against the host's default, one
// adamw_update per slice: bit for bit, as adamw_update is.
TEST(CudaBackend, AdamWOverManySlicesIsBitForBitTheHosts) {
  REQUIRE_GPU();
  Twins tw;
  std::vector<Twins::T> p, m, v, g;
  std::vector<loom::AdamWSlice> hs, ds;
  for (int t = 0; t < 40; ++t) {
    const std::size_t count = std::size_t(1 + (t * 131) % 2000);
    auto vv = randn(count, std::uint32_t(700 + t), 0.1f);
    for (float& x : vv) x = x * x;
    p.push_back(tw.make(randn(count, std::uint32_t(600 + t))));
    m.push_back(tw.make(randn(count, std::uint32_t(800 + t), 0.1f)));
    v.push_back(tw.make(vv));
    g.push_back(tw.make(randn(count, std::uint32_t(900 + t))));
    const float wd = t % 2 ? 0.1f : 0.0f;
    hs.push_back({p.back().h, m.back().h, v.back().h, g.back().h, std::int64_t(count), wd});
    ds.push_back({p.back().d, m.back().d, v.back().d, g.back().d, std::int64_t(count), wd});
  }
  for (std::int64_t step = 1; step <= 2; ++step) {
    tw.host->adamw_update_slices(hs, 1e-3f, 0.9f, 0.95f, 1e-8f, step);
    tw.dev->adamw_update_slices(ds, 1e-3f, 0.9f, 0.95f, 1e-8f, step);
  }
  for (std::size_t t = 0; t < p.size(); ++t) {
    ASSERT_EQ(tw.dev_of(p[t]), tw.host_of(p[t])) << "parameters of slice " << t;
    ASSERT_EQ(tw.dev_of(m[t]), tw.host_of(m[t])) << "first moments of slice " << t;
    ASSERT_EQ(tw.dev_of(v[t]), tw.host_of(v[t])) << "second moments of slice " << t;
  }
}

// Backend::sq_norm_check over more tensors than one launch takes (64), in runs of one type (fp32,
// bf16, fp32), against the host's; and the two-pass column sums (their partials in cuBLASLt's
// workspace) over several chunks of rows against the host's.
TEST(CudaBackend, ManyTensorNormCheckAndChunkedColumnSums) {
  REQUIRE_GPU();
  Twins tw;
  std::vector<BufferRef> hs, ds;
  for (int t = 0; t < 75; ++t) {
    const auto v = randn(std::size_t(1 + (t * 97) % 3000), std::uint32_t(50 + t));
    if (t == 70 || t == 71) {  // a run of bf16 tensors
      std::vector<loom::bf16> b(v.size());
      for (std::size_t i = 0; i < v.size(); ++i) b[i] = loom::to_bf16(v[i]);
      auto [h, d] = tw.both(b);
      hs.push_back(h), ds.push_back(d);
    } else {
      auto [h, d] = tw.both(v);
      hs.push_back(h), ds.push_back(d);
    }
  }
  const loom::NormCheck h = tw.host->sq_norm_check(hs), d = tw.dev->sq_norm_check(ds);
  EXPECT_TRUE(d.all_finite);
  EXPECT_NEAR(d.sum_squares, h.sum_squares, 1e-6 * h.sum_squares);  // the host sums chunks in float
  std::vector<float> with_nan = randn(300, 7);
  with_nan[123] = std::numeric_limits<float>::infinity();
  auto bad = tw.make(with_nan);
  ds[72] = bad.d;
  const loom::NormCheck nd = tw.dev->sq_norm_check(ds);
  EXPECT_FALSE(nd.all_finite);
  EXPECT_EQ(nd.first_nonfinite, 72) << "the tensor after the bf16 run";

  const int N = 1100, OC = 45, C = 70;  // five chunks of 256 rows; partial column tiles
  auto dout = tw.make(randn(std::size_t(N) * OC, 8)), db = tw.make(randn(OC, 9));
  tw.host->bias_backward(db.h, dout.h, N, OC);
  tw.dev->bias_backward(db.d, dout.d, N, OC);
  EXPECT_LT(tw.err(db), kTol) << "bias_backward";
  auto pre = tw.make(randn(std::size_t(N) * OC, 10, 2.0f)), dpre = tw.zeros(std::int64_t(N) * OC),
       db2 = tw.make(randn(OC, 11));
  tw.host->gelu_bias_backward(dpre.h, db2.h, pre.h, dout.h, N, OC);
  tw.dev->gelu_bias_backward(dpre.d, db2.d, pre.d, dout.d, N, OC);
  EXPECT_EQ(tw.dev_of(dpre), tw.host_of(dpre)) << "gelu_bias_backward's dpre";
  EXPECT_LT(tw.err(db2), kTol) << "gelu_bias_backward's bias";
  auto inp = tw.make(randn(std::size_t(N) * C, 12, 2.0f)), w = tw.make(randn(C, 13)), b = tw.make(randn(C, 14));
  auto out = tw.zeros(std::int64_t(N) * C), mean = tw.zeros(N), rstd = tw.zeros(N);
  tw.host->layernorm_forward(out.h, mean.h, rstd.h, inp.h, w.h, b.h, N, C);
  tw.dev->layernorm_forward(out.d, mean.d, rstd.d, inp.d, w.d, b.d, N, C);
  auto ldout = tw.make(randn(std::size_t(N) * C, 15)), dinp = tw.make(randn(std::size_t(N) * C, 16)),
       dw = tw.make(randn(C, 17)), dlb = tw.make(randn(C, 18));
  tw.host->layernorm_backward(dinp.h, dw.h, dlb.h, ldout.h, inp.h, w.h, mean.h, rstd.h, N, C);
  tw.dev->layernorm_backward(dinp.d, dw.d, dlb.d, ldout.d, inp.d, w.d, mean.d, rstd.d, N, C);
  EXPECT_LT(tw.err(dinp), kTol) << "layernorm_backward's dinp";
  EXPECT_LT(tw.err(dw), kTol) << "layernorm_backward's weight";
  EXPECT_LT(tw.err(dlb), kTol) << "layernorm_backward's bias";
}

}  // namespace

int main(int argc, char** argv) {
  loom::select_openblas_core(argv);
  ::testing::InitGoogleTest(&argc, argv);
  Kokkos::ScopeGuard kokkos(argc, argv);
  return RUN_ALL_TESTS();
}

// The fused attention kernels on the device against the fp64 reference, as the emulator runs them
// on the CPU (core/cuda/emu/test/test_flash_attention_emu.cpp): its cases, one more for the bf16
// saved output, and its bounds against the reference on bf16-rounded inputs (5e-3 of the norm;
// 1e-2 for dq and dk, which sum score gradients that cancel). The saved output passes as fp32 and as bf16 (mixed
// precision saves it so).
namespace flash_check {

std::vector<float> device_to_host(Twins& tw, const float* d, std::size_t n) {
  std::vector<float> v(n);
  tw.dev->copy_to_host(v.data(), BufferRef(const_cast<float*>(d), std::int64_t(n), MemSpace::device));
  return v;
}

void run(int B, int T, int C, int NH, float spread, bool bf16_out) {
  Twins tw;
  const std::size_t n3 = std::size_t(B) * T * 3 * C, n = std::size_t(B) * T * C, nr = std::size_t(B) * NH * T;
  const auto qkv_v = randn(n3, 7u + unsigned(T), spread), dout_v = randn(n, 11u + unsigned(T));
  auto qkv = tw.make(qkv_v), dout = tw.make(dout_v);
  auto out = tw.zeros(std::int64_t(n)), lse = tw.zeros(std::int64_t(nr)), dsum = tw.zeros(std::int64_t(nr));
  auto dqkv = tw.make(std::vector<float>(n3, std::nanf("")));
  int optin = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0), cudaSuccess);
  if (!loom::cuda::flash_attention_supported(C / NH, std::size_t(optin))) {
    std::printf(
        "fused attention, head size %d: needs %zu bytes of shared memory per block, the device has %d: not run\n",
        C / NH, loom::cuda::flash_attention_shared_bytes(C / NH), optin);
    return;
  }
  loom::cuda::attention_forward_flash(out.d, lse.d.as<float>(), qkv.d.as<float>(), B, T, C, NH, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> out_v = device_to_host(tw, out.d.as<float>(), n);
  BufferRef saved = out.d;
  std::vector<loom::bf16> out16(n);
  if (bf16_out) {
    for (std::size_t i = 0; i < n; ++i) out16[i] = loom::to_bf16(out_v[i]);
    // The forward storing bf16 itself: its fp32 output rounded once, bit for bit.
    auto [h16, d16] = tw.both(std::vector<loom::bf16>(n));
    loom::cuda::attention_forward_flash(d16, lse.d.as<float>(), qkv.d.as<float>(), B, T, C, NH, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    tw.dev->copy_to_host(h16.data, d16);
    for (std::size_t i = 0; i < n; ++i)
      ASSERT_EQ(h16.as<loom::bf16>()[i].bits, out16[i].bits) << "bf16 out, element " << i;
    saved = d16;
  }
  loom::cuda::attention_backward_flash(dqkv.d.as<float>(), dsum.d.as<float>(), dout.d.as<float>(), saved,
                                       qkv.d.as<float>(), lse.d.as<float>(), B, T, C, NH, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto ref =
      loom::test::attention_reference(loom::test::bf16_rounded(qkv_v), loom::test::bf16_rounded(dout_v), B, T, C, NH);
  const auto dqkv_v = device_to_host(tw, dqkv.d.as<float>(), n3);
  for (float x : dqkv_v) ASSERT_TRUE(std::isfinite(x)) << "an element of dqkv not written or not finite";
  const std::string what = "hs " + std::to_string(C / NH) + " T " + std::to_string(T) + (bf16_out ? " (bf16 out)" : "");
  EXPECT_LT(loom::test::relative_gap(out_v, ref.out), 5e-3) << what;
  EXPECT_LT(loom::test::relative_gap(device_to_host(tw, lse.d.as<float>(), nr), ref.lse), 5e-3) << what;
  std::vector<bool> part(n3);  // q, k, v gradients apart, with the emulator test's bounds
  const double bound[3] = {1e-2, 1e-2, 5e-3};
  const char* name[3] = {"dq", "dk", "dv"};
  for (int p = 0; p < 3; ++p) {
    for (std::size_t i = 0; i < n3; ++i) part[i] = int(i % (3 * std::size_t(C))) / C == p;
    EXPECT_LT(loom::test::relative_gap(dqkv_v, ref.dqkv, part), bound[p]) << what << ": " << name[p];
  }
}

}  // namespace flash_check

TEST(CudaBackend, FusedAttentionMatchesTheReference) {
  REQUIRE_GPU();
  flash_check::run(2, 80, 32, 2, 1.0f, false);
  flash_check::run(1, 130, 64, 2, 1.0f, true);
  flash_check::run(1, 64, 128, 2, 1.0f, false);
  flash_check::run(1, 192, 64, 2, 3.0f, false);
  flash_check::run(2, 5, 128, 2, 1.0f, false);
  flash_check::run(1, 70, 128, 1, 1.0f, true);
}

// model.attention = flash through the Backend interface on both back ends: the device's kernels
// against the host's twin (core/backend/flash_attention_host.hpp), which rounds the same values to bf16 at
// the same points. What remains is the order the tensor cores add a product's terms in (fp32,
// ~1e-6 relative), and the bf16 roundings of probabilities and score gradients that order tips
// (2^-8 of the few elements it tips): estimated at a few 1e-5 of the norm, not yet measured on a
// device; the bound is 2e-4, still ten times under the twin's distance to the fp64 reference.
TEST(CudaBackend, FusedAttentionMatchesTheHostTwin) {
  REQUIRE_GPU();
  for (const auto& [B, T, C, NH, saved_type] : std::vector<std::tuple<int, int, int, int, DType>>{
           {2, 80, 32, 2, DType::f32}, {1, 200, 128, 2, DType::bf16}, {2, 64, 64, 4, DType::f16}}) {
    Twins tw;
    const std::string why = tw.dev->flash_attention_refusal(C / NH);
    if (!why.empty()) {
      std::printf("fused attention, head size %d: %s: not run\n", C / NH, why.c_str());
      continue;
    }
    const std::size_t n3 = std::size_t(B) * T * 3 * C, n = std::size_t(B) * T * C, nr = std::size_t(B) * NH * T;
    auto qkv = tw.make(randn(n3, 21u + unsigned(T))), dout = tw.make(randn(n, 22u + unsigned(T)));
    auto out = tw.zeros(std::int64_t(n)), lse = tw.zeros(std::int64_t(nr)), dsum = tw.zeros(std::int64_t(nr));
    auto dqkv = tw.make(std::vector<float>(n3, std::nanf("")));
    tw.host->attention_forward_flash(out.h, lse.h, qkv.h, B, T, C, NH);
    tw.dev->attention_forward_flash(out.d, lse.d, qkv.d, B, T, C, NH);
    auto saved_h = tw.host->allocate("saved", saved_type, std::int64_t(n), Mem::workspace);
    auto saved_d = tw.dev->allocate("saved", saved_type, std::int64_t(n), Mem::workspace);
    tw.host->cast(saved_h.ref(), out.h);
    tw.dev->cast(saved_d.ref(), out.d);
    tw.host->attention_backward_flash(dqkv.h, dsum.h, dout.h, saved_h.ref(), qkv.h, lse.h, B, T, C, NH);
    tw.dev->attention_backward_flash(dqkv.d, dsum.d, dout.d, saved_d.ref(), qkv.d, lse.d, B, T, C, NH);
    tw.dev->synchronize();
    const std::string what =
        "hs " + std::to_string(C / NH) + " T " + std::to_string(T) + " saved " + loom::dtype_name(saved_type);
    EXPECT_LT(tw.err(out), 2e-4) << what << ": out";
    EXPECT_LT(tw.err(lse), 2e-4) << what << ": lse";
    EXPECT_LT(tw.err(dqkv), 2e-4) << what << ": dqkv";
    std::printf("%s: device against the host twin: out %.2e lse %.2e dqkv %.2e\n", what.c_str(), tw.err(out),
                tw.err(lse), tw.err(dqkv));
  }
}

// model.attention = cudnn: cuDNN's fused attention through the back end, held to the fp64 reference with
// the flash path's bounds (out and lse 5e-3, dq and dk 1e-2, dv 5e-3 of the norm, on bf16-rounded
// inputs), and to the host's flash twin with the same bounds (the two round at different points: cuDNN
// its normalised probabilities, the twin its tiles'); the gaps are printed for the GPU logbook. fp32 and
// bf16 and fp16 saved outputs, head sizes 16, 64 and 128, T from 5 to 1024, GPT-2's 12 heads of 64; each
// run twice on the same back end (its cached plans), the same bits both times (the deterministic dq).
// Where cuDNN's attention is refused, calling it throws the refusal; on the emulated device that is
// expected, on a GPU it fails the test (LOOM_CUDNN_OPTIONAL=1: a GPU without cuDNN 9.16 passes).
TEST(CudaBackend, CudnnAttentionMatchesTheReferenceAndTheFlashTwin) {
  REQUIRE_GPU();
  for (const auto& [B, T, C, NH, saved_type] :
       std::vector<std::tuple<int, int, int, int, DType>>{{2, 80, 32, 2, DType::f32},
                                                          {1, 130, 128, 2, DType::bf16},
                                                          {1, 64, 256, 2, DType::f32},
                                                          {2, 5, 128, 2, DType::f16},
                                                          {1, 1024, 128, 2, DType::bf16},
                                                          {2, 256, 768, 12, DType::bf16}}) {
    Twins tw;
    const std::string what =
        "hs " + std::to_string(C / NH) + " T " + std::to_string(T) + " saved " + loom::dtype_name(saved_type);
    const std::size_t n3 = std::size_t(B) * T * 3 * C, n = std::size_t(B) * T * C, nr = std::size_t(B) * NH * T;
    const auto qkv_v = randn(n3, 41u + unsigned(T)), dout_v = randn(n, 42u + unsigned(T));
    auto qkv = tw.make(qkv_v), dout = tw.make(dout_v);
    auto out = tw.zeros(std::int64_t(n)), lse = tw.zeros(std::int64_t(nr)), dsum = tw.zeros(std::int64_t(nr));
    auto dqkv = tw.make(std::vector<float>(n3, std::nanf("")));
    const std::string why = tw.dev->cudnn_attention_refusal(T, C / NH);
    if (!why.empty()) {
      std::printf("cuDNN attention, %s: refused: %s\n", what.c_str(), why.c_str());
      const char* optional = std::getenv("LOOM_CUDNN_OPTIONAL");
      if (why.find("emulated device") == std::string::npos && !(optional && std::string(optional) == "1"))
        ADD_FAILURE() << "cuDNN's attention is refused on this GPU: " << why;
      try {
        tw.dev->attention_forward_cudnn(out.d, lse.d, qkv.d, B, T, C, NH);
        ADD_FAILURE() << "a refused cuDNN attention ran";
      } catch (const std::logic_error& e) {
        EXPECT_EQ(std::string(e.what()), why);
      }
      continue;
    }
    auto saved_d = tw.dev->allocate("saved", saved_type, std::int64_t(n), Mem::workspace);
    auto saved_h = tw.host->allocate("saved", saved_type, std::int64_t(n), Mem::workspace);
    std::vector<float> first;
    for (int round = 0; round < 2; ++round) {  // the second with the plans cached
      tw.dev->attention_forward_cudnn(saved_d.ref(), lse.d, qkv.d, B, T, C, NH);
      tw.dev->cast(out.d, saved_d.ref());
      tw.dev->attention_backward_cudnn(dqkv.d, dsum.d, dout.d, saved_d.ref(), qkv.d, lse.d, B, T, C, NH);
      tw.dev->synchronize();
      std::vector<float> got = tw.dev_of(out), l = tw.dev_of(lse), g = tw.dev_of(dqkv);
      got.insert(got.end(), l.begin(), l.end());
      got.insert(got.end(), g.begin(), g.end());
      if (round == 0)
        first = got;
      else
        EXPECT_EQ(0, std::memcmp(got.data(), first.data(), got.size() * sizeof(float)))
            << what << ": a second call gave other bits";
    }
    // the host's flash twin on the same inputs
    tw.host->attention_forward_flash(out.h, lse.h, qkv.h, B, T, C, NH);
    tw.host->cast(saved_h.ref(), out.h);
    tw.host->attention_backward_flash(dqkv.h, dsum.h, dout.h, saved_h.ref(), qkv.h, lse.h, B, T, C, NH);
    const auto ref =
        loom::test::attention_reference(loom::test::bf16_rounded(qkv_v), loom::test::bf16_rounded(dout_v), B, T, C, NH);
    const std::vector<float> out_d = tw.dev_of(out), lse_d = tw.dev_of(lse), dqkv_d = tw.dev_of(dqkv);
    for (float x : dqkv_d) ASSERT_TRUE(std::isfinite(x)) << what << ": an element of dqkv not written or not finite";
    const double bound[3] = {1e-2, 1e-2, 5e-3};
    const char* name[3] = {"dq", "dk", "dv"};
    double gap_ref[5] = {loom::test::relative_gap(out_d, ref.out), loom::test::relative_gap(lse_d, ref.lse), 0, 0, 0};
    double gap_twin[5] = {tw.err(out), tw.err(lse), 0, 0, 0};
    std::vector<bool> part(n3);
    const std::vector<float> twin_f = tw.host_of(dqkv);
    const std::vector<double> twin(twin_f.begin(), twin_f.end());
    for (int p = 0; p < 3; ++p) {
      for (std::size_t i = 0; i < n3; ++i) part[i] = int(i % (3 * std::size_t(C))) / C == p;
      gap_ref[2 + p] = loom::test::relative_gap(dqkv_d, ref.dqkv, part);
      gap_twin[2 + p] = loom::test::relative_gap(dqkv_d, twin, part);
      EXPECT_LT(gap_ref[2 + p], bound[p]) << what << ": " << name[p] << " against the fp64 reference";
      EXPECT_LT(gap_twin[2 + p], bound[p]) << what << ": " << name[p] << " against the host's flash twin";
    }
    EXPECT_LT(gap_ref[0], 5e-3) << what << ": out against the fp64 reference";
    EXPECT_LT(gap_ref[1], 5e-3) << what << ": lse against the fp64 reference";
    EXPECT_LT(gap_twin[0], 5e-3) << what << ": out against the host's flash twin";
    EXPECT_LT(gap_twin[1], 5e-3) << what << ": lse against the host's flash twin";
    std::printf(
        "cuDNN attention, %s: from fp64 out %.2e lse %.2e dq %.2e dk %.2e dv %.2e; from the flash twin "
        "out %.2e lse %.2e dq %.2e dk %.2e dv %.2e\n",
        what.c_str(), gap_ref[0], gap_ref[1], gap_ref[2], gap_ref[3], gap_ref[4], gap_twin[0], gap_twin[1], gap_twin[2],
        gap_twin[3], gap_twin[4]);
  }
}

// The fused kernels load their tiles 4 floats at a time where qkv and dout are 16-byte aligned and
// one at a time elsewhere (a slice of a buffer may be either): the same bits both ways.
TEST(CudaBackend, FusedAttentionFromUnalignedInputsGivesTheSameBits) {
  REQUIRE_GPU();
  Twins tw;
  const int B = 2, T = 130, C = 128, NH = 2;  // head size 64; two whole tiles of 64 rows and a tail of 2
  const std::string why = tw.dev->flash_attention_refusal(C / NH);
  if (!why.empty()) GTEST_SKIP() << "fused attention, head size " << C / NH << ": " << why;
  const std::size_t n3 = std::size_t(B) * T * 3 * C, n = std::size_t(B) * T * C, nr = std::size_t(B) * NH * T;
  const auto qkv_values = randn(n3, 31u), dout_values = randn(n, 32u);
  const auto run = [&](std::size_t offset) {  // floats before qkv and dout in their buffers
    std::vector<float> q(offset, 0.0f), g(offset, 0.0f);
    q.insert(q.end(), qkv_values.begin(), qkv_values.end());
    g.insert(g.end(), dout_values.begin(), dout_values.end());
    auto qkv = tw.make(q), dout = tw.make(g);
    auto out = tw.zeros(std::int64_t(n)), lse = tw.zeros(std::int64_t(nr)), dsum = tw.zeros(std::int64_t(nr));
    auto dqkv = tw.make(std::vector<float>(n3, std::nanf("")));
    const std::int64_t at = std::int64_t(offset);
    tw.dev->attention_forward_flash(out.d, lse.d, qkv.d.slice(at, std::int64_t(n3)), B, T, C, NH);
    tw.dev->attention_backward_flash(dqkv.d, dsum.d, dout.d.slice(at, std::int64_t(n)), out.d,
                                     qkv.d.slice(at, std::int64_t(n3)), lse.d, B, T, C, NH);
    tw.dev->synchronize();
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(qkv.d.slice(at, 1).data) % 16 == 0, offset == 0)
        << "the buffers' alignment";
    std::vector<float> all = tw.dev_of(out), more = tw.dev_of(lse), grads = tw.dev_of(dqkv);
    all.insert(all.end(), more.begin(), more.end());
    all.insert(all.end(), grads.begin(), grads.end());
    return all;
  };
  const std::vector<float> aligned = run(0), unaligned = run(1);
  ASSERT_EQ(aligned.size(), unaligned.size());
  for (float x : aligned) ASSERT_TRUE(std::isfinite(x)) << "an output not written or not finite";
  EXPECT_EQ(std::memcmp(aligned.data(), unaligned.data(), aligned.size() * sizeof(float)), 0)
      << "the fused attention from inputs one float off 16-byte alignment differs from the aligned run";
}

// Ring attention (context parallelism) through the Backend interface on both back ends: one rank's two
// ring steps, the forward merging two blocks of keys and values into a running (out, lse) that starts
// empty, the backward adding both blocks' gradients from the host's final (out, lse) on both sides (a
// saved 16-bit output rounded from two forwards would differ where a rounding tips); queries from
// q_begin, blocks of kv_rows keys, causal or not, bf16 operands or fp32, the saved output fp32, bf16 or
// fp16, head sizes 4 to 128. The device's kernels (core/cuda/ring_attention.cuh) against the host's twin
// (core/backend/ring_attention_host.hpp): the same arithmetic with sums in another order, within kTol of
// the norm with fp32 operands; with bf16 operands a sum's order now and then tips a rounding of a
// probability or a score gradient by 2^-8 of it: 1e-4 (the emulator's test, RingAttentionEmu, measures
// a few 1e-6 of the norm and holds the largest element to 5e-4 of the largest).
TEST(CudaBackend, RingAttentionMatchesTheHost) {
  REQUIRE_GPU();
  struct Case {
    int B, T, C, NH, q_begin, kv1, kv2;
    bool causal, bf16;
    DType saved;
  };
  for (const Case& c : std::vector<Case>{{2, 70, 64, 2, 0, 70, 45, true, false, DType::f32},
                                         {1, 67, 96, 2, 13, 50, 67, false, true, DType::bf16},
                                         {2, 33, 16, 4, 5, 33, 20, true, true, DType::f16},
                                         {1, 130, 256, 2, 70, 130, 64, true, false, DType::bf16}}) {
    Twins tw;
    ASSERT_EQ(tw.dev->ring_attention_refusal(), "");
    const int B = c.B, T = c.T, C = c.C, NH = c.NH;
    const std::size_t n = std::size_t(B) * T * C, nr = std::size_t(B) * NH * T;
    const std::string what = "B " + std::to_string(B) + " T " + std::to_string(T) + " hs " + std::to_string(C / NH) +
                             " q_begin " + std::to_string(c.q_begin) + (c.causal ? " causal" : " full") +
                             (c.bf16 ? " bf16" : " fp32") + " saved " + loom::dtype_name(c.saved);
    const unsigned seed = 51u + unsigned(T);
    auto qkv = tw.make(randn(3 * n, seed, 1.5f)), kv1 = tw.make(randn(2 * n, seed + 1, 1.5f)),
         kv2 = tw.make(randn(2 * n, seed + 2, 1.5f));
    auto out = tw.make(randn(n, seed + 3)), lse = tw.make(std::vector<float>(nr, -1e30f));
    tw.host->attention_ring_forward(out.h, lse.h, qkv.h, kv1.h, B, T, C, NH, c.q_begin, c.kv1, c.causal, c.bf16);
    tw.dev->attention_ring_forward(out.d, lse.d, qkv.d, kv1.d, B, T, C, NH, c.q_begin, c.kv1, c.causal, c.bf16);
    // lse over the rows reached, [q_begin, T) (the others hold -1e30, on the device too).
    const auto lse_err = [&] {
      const std::vector<float> on_dev = tw.dev_of(lse), on_host = tw.host_of(lse);
      std::vector<float> d, h;
      for (std::size_t r = 0; r < nr; ++r)
        if (int(r % std::size_t(T)) >= c.q_begin) {
          d.push_back(on_dev[r]);
          h.push_back(on_host[r]);
        } else {
          EXPECT_EQ(on_dev[r], -1e30f) << what << ": lse row " << r << " is not reached";
        }
      return rel_err(d, h);
    };
    EXPECT_LT(tw.err(out), c.bf16 ? 1e-4 : kTol) << what << ": out after one block";
    EXPECT_LT(lse_err(), kTol) << what << ": lse after one block";
    tw.host->attention_ring_forward(out.h, lse.h, qkv.h, kv2.h, B, T, C, NH, c.q_begin, c.kv2, false, c.bf16);
    tw.dev->attention_ring_forward(out.d, lse.d, qkv.d, kv2.d, B, T, C, NH, c.q_begin, c.kv2, false, c.bf16);
    const double out_err = tw.err(out), lse_gap = lse_err();
    EXPECT_LT(out_err, c.bf16 ? 1e-4 : kTol) << what << ": out";
    EXPECT_LT(lse_gap, kTol) << what << ": lse";
    // The backward from the host's final output and lse on both sides.
    auto out_f = tw.make(tw.host_of(out)), lse_f = tw.make(tw.host_of(lse));
    auto saved_h = tw.host->allocate("saved", c.saved, std::int64_t(n), Mem::workspace);
    auto saved_d = tw.dev->allocate("saved", c.saved, std::int64_t(n), Mem::workspace);
    tw.host->cast(saved_h.ref(), out_f.h);
    tw.dev->cast(saved_d.ref(), out_f.d);
    auto dout = tw.make(randn(n, seed + 4)), dqkv = tw.make(randn(3 * n, seed + 5));
    auto dkv1 = tw.make(randn(2 * n, seed + 6)), dkv2 = tw.make(randn(2 * n, seed + 7)), dsum = tw.zeros(nr);
    tw.host->attention_ring_backward(dqkv.h, dkv1.h, dsum.h, dout.h, saved_h.ref(), qkv.h, kv1.h, lse_f.h, B, T, C, NH,
                                     c.q_begin, c.kv1, c.causal, c.bf16);
    tw.dev->attention_ring_backward(dqkv.d, dkv1.d, dsum.d, dout.d, saved_d.ref(), qkv.d, kv1.d, lse_f.d, B, T, C, NH,
                                    c.q_begin, c.kv1, c.causal, c.bf16);
    tw.host->attention_ring_backward(dqkv.h, dkv2.h, dsum.h, dout.h, saved_h.ref(), qkv.h, kv2.h, lse_f.h, B, T, C, NH,
                                     c.q_begin, c.kv2, false, c.bf16);
    tw.dev->attention_ring_backward(dqkv.d, dkv2.d, dsum.d, dout.d, saved_d.ref(), qkv.d, kv2.d, lse_f.d, B, T, C, NH,
                                    c.q_begin, c.kv2, false, c.bf16);
    tw.dev->synchronize();
    const double bound = c.bf16 ? 1e-4 : kTol;
    EXPECT_LT(tw.err(dqkv), bound) << what << ": dqkv";
    EXPECT_LT(tw.err(dkv1), bound) << what << ": dkv of the first block";
    EXPECT_LT(tw.err(dkv2), bound) << what << ": dkv of the second block";
    EXPECT_LT(tw.err(dsum), kTol) << what << ": dsum";
    std::printf("ring attention, %s: device against the host: out %.2e lse %.2e dqkv %.2e dkv %.2e %.2e dsum %.2e\n",
                what.c_str(), out_err, lse_gap, tw.err(dqkv), tw.err(dkv1), tw.err(dkv2), tw.err(dsum));
  }
}

// copy_rows: a strided block of fp32 rows, bit for bit, nothing else of dst touched.
TEST(CudaBackend, CopyRowsIsTheHosts) {
  REQUIRE_GPU();
  Twins tw;
  const std::int64_t rows = 37, cols = 45, dst_ld = 64, src_ld = 50;
  auto src = tw.make(randn(std::size_t(rows * src_ld), 61)), dst = tw.make(randn(std::size_t(rows * dst_ld), 62));
  tw.host->copy_rows(dst.h, src.h, rows, cols, dst_ld, src_ld);
  tw.dev->copy_rows(dst.d, src.d, rows, cols, dst_ld, src_ld);
  EXPECT_EQ(tw.dev_of(dst), tw.host_of(dst));
  // a slice: the last row ends at the buffer's end
  tw.host->copy_rows(dst.h.slice(3, dst.n - 3), src.h.slice(1, src.n - 1), rows - 1, cols, dst_ld, src_ld);
  tw.dev->copy_rows(dst.d.slice(3, dst.n - 3), src.d.slice(1, src.n - 1), rows - 1, cols, dst_ld, src_ld);
  EXPECT_EQ(tw.dev_of(dst), tw.host_of(dst));
}

// Mixture of experts' row operations (core/cuda/expert_rows.cuh), bit for bit the host's: the gathers (a
// plain one of every type, a scaled one of fp32), the scatter-add with and without gates, and rows_dot,
// whose sums follow lane_sum's order; a gather that would change the type is refused.
TEST(CudaBackend, ExpertRowsAreTheHosts) {
  REQUIRE_GPU();
  Twins tw;
  EXPECT_EQ(tw.dev->expert_rows_refusal(), "");
  const int table = 150, n = 67, C = 83;  // an odd n: a warp's second half-warp without a row
  std::vector<std::int32_t> rows(table);
  for (int i = 0; i < table; ++i) rows[std::size_t(i)] = i;
  std::shuffle(rows.begin(), rows.end(), std::mt19937(71));
  rows.resize(std::size_t(n));
  auto [rh, rd] = tw.both(rows);
  auto x = tw.make(randn(std::size_t(table) * C, 72)), y = tw.make(randn(std::size_t(n) * C, 73));
  auto gate = tw.make(randn(std::size_t(n), 74));
  const BufferRef none;
  // A plain gather of each type (its values rounded from the same fp32 ones on both sides).
  for (DType t : {DType::f32, DType::f64, DType::bf16, DType::f16}) {
    TypedBuffer hx = tw.host->allocate("hx", t, x.n, Mem::workspace),
                dx = tw.dev->allocate("dx", t, x.n, Mem::workspace);
    TypedBuffer ho = tw.host->allocate("ho", t, std::int64_t(n) * C, Mem::workspace),
                dout = tw.dev->allocate("do", t, std::int64_t(n) * C, Mem::workspace);
    tw.host->cast(hx.ref(), x.h);
    tw.dev->copy_from_host(dx.ref(), hx.ref().data);
    tw.host->rows_gather(ho.ref(), hx.ref(), rh, none, n, C);
    tw.dev->rows_gather(dout.ref(), dx.ref(), rd, none, n, C);
    std::vector<unsigned char> got(ho.ref().bytes());
    tw.dev->copy_to_host(got.data(), dout.ref());
    EXPECT_EQ(std::memcmp(got.data(), ho.ref().data, got.size()), 0) << "plain gather of " << loom::dtype_name(t);
    if (t != DType::f32) {
      TypedBuffer o32 = tw.dev->allocate("o32", DType::f32, std::int64_t(n) * C, Mem::workspace);
      EXPECT_THROW(tw.dev->rows_gather(o32.ref(), dx.ref(), rd, none, n, C), std::invalid_argument)
          << "a gather without scale keeps the type: " << loom::dtype_name(t) << " into fp32";
    }
  }
  auto out = tw.zeros(std::int64_t(n) * C);
  tw.host->rows_gather(out.h, x.h, rh, gate.h, n, C);
  tw.dev->rows_gather(out.d, x.d, rd, gate.d, n, C);
  EXPECT_EQ(tw.dev_of(out), tw.host_of(out)) << "scaled gather";
  for (const bool scaled : {true, false}) {
    auto acc = tw.make(randn(std::size_t(table) * C, scaled ? 75 : 76));
    tw.host->rows_scatter_add(acc.h, y.h, rh, scaled ? gate.h : none, n, C);
    tw.dev->rows_scatter_add(acc.d, y.d, rd, scaled ? gate.d : none, n, C);
    EXPECT_EQ(tw.dev_of(acc), tw.host_of(acc)) << "scatter_add, " << (scaled ? "gated" : "no gates");
  }
  auto dot = tw.make(std::vector<float>(std::size_t(n), 7.0f));
  tw.host->rows_dot(dot.h, x.h, rh, y.h, n, C);
  tw.dev->rows_dot(dot.d, x.d, rd, y.d, n, C);
  EXPECT_EQ(tw.dev_of(dot), tw.host_of(dot)) << "rows_dot: lane_sum's order";
}
