// Unit tests of the GPT model (core/model/gpt.hpp) on the host back end: whole-model gradient check in
// float, activation recompute, initialisation, micro-batch equivalence, training, FLOP count, and
// the model split into pipeline stages against the whole.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/model/gpt.hpp"
#include "core/base/ledger.hpp"
#include "core/model/optimizer.hpp"
#include "core/base/rng.hpp"

using namespace loom;

namespace {

// The flat store's buffers (every GPT here keeps the default store): this rank's parameters and
// gradients, tensor p at p.offset.
float* flat_params(const GPT& m) { return dynamic_cast<const FlatParamStore&>(m.store()).flat_params().as<float>(); }
float* flat_grads(const GPT& m) { return dynamic_cast<const FlatParamStore&>(m.store()).flat_grads().as<float>(); }

GPTConfig tiny_config() {
  GPTConfig c;
  c.layers = 2;
  c.d_model = 16;
  c.heads = 2;
  c.seq_len = 8;
  c.vocab = 13;
  return c;
}

std::vector<std::int32_t> tokens(int n, int V, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> d(0, V - 1);
  std::vector<std::int32_t> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

struct Batch {
  std::vector<std::int32_t> inputs, targets;  // [rows, T] each
  Batch(const GPTConfig& c, int rows, std::uint64_t seed)
      : inputs(tokens(rows * c.seq_len, c.vocab, seed)), targets(tokens(rows * c.seq_len, c.vocab, seed + 1)) {}
};

// Forward on rows [first, first + rows) of a batch.
double forward_rows(GPT& m, const Batch& b, int first, int rows) {
  const std::size_t off = static_cast<std::size_t>(first) * m.config().seq_len;
  return m.forward(b.inputs.data() + off, b.targets.data() + off, rows);
}

std::vector<float> grads_of(const GPT& m) { return {flat_grads(m), flat_grads(m) + m.num_params()}; }
std::vector<float> params_of(const GPT& m) { return {flat_params(m), flat_params(m) + m.num_params()}; }

// max_i |a_i - b_i| / max_i |b_i| over one parameter's gradient: two float computations that differ
// only in summation order (or in BLAS kernel set: SSE3, Haswell, SkylakeX block their sums
// differently) differ by rounding relative to the operands' magnitudes, not to each element's,
// which can cancel to ~0; so the bound is relative to the tensor's largest gradient.
double tensor_rel_diff(const std::vector<float>& a, const std::vector<float>& b, const ParamInfo& p) {
  double diff = 0, scale = 0;
  for (std::int64_t i = p.offset; i < p.offset + p.numel(); ++i) {
    diff = std::max(diff, std::abs(double(a[i]) - double(b[i])));
    scale = std::max(scale, std::abs(double(b[i])));
  }
  EXPECT_GT(scale, 0.0) << p.name << ": the gradient is identically zero, the comparison would be vacuous";
  return scale > 0 ? diff / scale : diff;
}

// Moves the model away from GPT-2's initialisation so that every gradient path carries
// non-trivial values: matrices x5 (std 0.1: attention is no longer near-uniform), LayerNorm
// weights 1 + N(0, 0.1), every bias N(0, 0.1).
void perturb(GPT& m, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> d(0.0f, 0.1f);
  float* w = flat_params(m);
  for (const auto& p : m.params())
    for (std::int64_t i = 0; i < p.numel(); ++i) {
      float& x = w[p.offset + i];
      x = p.init == ParamInfo::Init::normal ? 5.0f * x : x + d(gen);
    }
}

// The standard deviation GPT-2 prescribes for a parameter, from its name alone.
double expected_std(const std::string& name, int layers) {
  auto ends_with = [&](const std::string& s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  if (ends_with("attn.proj.weight") || ends_with("mlp.proj.weight")) return 0.02 / std::sqrt(2.0 * layers);
  return 0.02;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// 1. Whole-model gradient check, in float.
//
// The model runs in float, so finite differences of its loss are noisy: the loss (a double mean
// of float per-token losses) moves by ~5e-8 under float rounding alone (measured: central
// differences at step 3e-4 are off by ~1e-4). Truncation, on the other hand, is large at the
// steps where that noise is small (1e-3 relative at step 1e-2). Richardson extrapolation of two
// central differences, D = (4 D(h/2) - D(h)) / 3, cancels the h^2 term, so a large step h = 1e-2
// can be used: truncation O(h^4) and noise ~5 * 5e-8 / 1e-2 ~ 2.5e-5. Tolerances below are
// |fd - analytic| <= 1e-3 |analytic| + 1e-4 (directional derivatives, |analytic| ~ 1e-3 .. 1.6;
// observed worst 3.5e-5 per tensor, 7.8e-5 for all parameters at once) and <= 1e-2 |analytic| +
// 2e-5 (single elements, whose own gradients are ~1e-2 .. 1e-4; observed worst 1.4e-5). A wrong
// gradient (missing term, wrong factor or sign) is off by O(|analytic|) and fails clearly.

namespace {
struct GradCheckFixture {
  std::unique_ptr<Backend> be = make_host_backend(1);
  GPTConfig cfg = tiny_config();
  int rows = 2;
  GPT m{cfg, *be, rows};
  Batch b{cfg, rows, 5};
  std::vector<float> p0, g;
  GradCheckFixture() {
    m.init_weights(1234);
    perturb(m, 99);
    p0 = params_of(m);
    m.zero_grad();
    forward_rows(m, b, 0, rows);
    m.backward(1.0f);
    g = grads_of(m);
  }
  // Loss at p0 + s * u, moving only the elements [first, end). (Rounding p0 + s u to float
  // changes the step by < 1e-5 relative at s = 1e-2: negligible here.)
  double loss_along(const std::vector<double>& u, std::int64_t first, std::int64_t end, double s) {
    std::copy(p0.begin(), p0.end(), flat_params(m));
    for (std::int64_t i = first; i < end; ++i) flat_params(m)[i] = static_cast<float>(p0[i] + s * u[i]);
    return forward_rows(m, b, 0, rows);
  }
  double richardson(const std::vector<double>& u, std::int64_t first, std::int64_t end, double h) {
    const double d1 = (loss_along(u, first, end, h) - loss_along(u, first, end, -h)) / (2 * h);
    const double d2 = (loss_along(u, first, end, h / 2) - loss_along(u, first, end, -h / 2)) / h;
    return (4 * d2 - d1) / 3;
  }
};
}  // namespace

TEST(GPT, DirectionalDerivativesMatchBackwardForEveryTensor) {
  GradCheckFixture f;
  std::mt19937_64 gen(7);
  std::normal_distribution<double> nd;
  std::vector<double> u(f.m.num_params());
  for (auto& x : u) x = nd(gen);
  double worst_abs = 0, worst_rel = 0;
  auto check = [&](const std::string& what, std::int64_t first, std::int64_t end, double h) {
    double D = 0;
    for (std::int64_t i = first; i < end; ++i) D += u[i] * f.g[i];
    const double fd = f.richardson(u, first, end, h);
    const double err = std::abs(fd - D);
    worst_abs = std::max(worst_abs, err);
    worst_rel = std::max(worst_rel, err / std::max(std::abs(D), 1e-12));
    EXPECT_LE(err, 1e-3 * std::abs(D) + 1e-4) << what << ": backward " << D << ", finite differences " << fd;
  };
  // Each tensor in full, with h = 1e-2 (a step of norm <= 0.32, the largest tensor having 1024
  // elements); then all parameters at once, with h = 2e-3 to keep the step's norm (0.17 for
  // 6928 elements) in the same range, where the O(h^4) truncation is negligible.
  for (const auto& p : f.m.params()) check(p.name, p.offset, p.offset + p.numel(), 1e-2);
  check("all parameters", 0, f.m.num_params(), 2e-3);
  std::printf("[ gradchk ] GPT directional derivatives (%zu tensors + all): worst abs err %.2e, worst rel err %.2e\n",
              f.m.params().size(), worst_abs, worst_rel);
}

TEST(GPT, SingleElementGradientsMatchFiniteDifferences) {
  GradCheckFixture f;
  std::mt19937_64 gen(11);
  const double h = 1e-2;
  double worst_abs = 0;
  int checked = 0;
  for (const auto& p : f.m.params()) {  // one random element of every tensor (28 here)
    const std::int64_t i = p.offset + std::uniform_int_distribution<std::int64_t>(0, p.numel() - 1)(gen);
    std::vector<double> e(f.m.num_params(), 0.0);
    e[i] = 1.0;
    const double fd = f.richardson(e, i, i + 1, h);
    const double err = std::abs(fd - f.g[i]);
    worst_abs = std::max(worst_abs, err);
    EXPECT_LE(err, 1e-2 * std::abs(f.g[i]) + 2e-5)
        << p.name << "[" << i - p.offset << "]: backward " << f.g[i] << ", finite differences " << fd;
    ++checked;
  }
  std::printf("[ gradchk ] GPT single elements (%d): worst abs err %.2e\n", checked, worst_abs);
}

// ---------------------------------------------------------------------------------------------
// 2. Recompute: same gradients, fewer activation bytes.

TEST(GPT, RecomputeGivesTheSameGradientsWithFewerActivations) {
  auto be = make_host_backend(1);
  GPTConfig cfg = tiny_config();
  const int max_rows = 4, rows = 3;  // fewer rows than allocated: offsets use max_rows
  auto& ledger = Ledger::global();

  const std::size_t a0 = ledger.current(Mem::activations);
  GPT full(cfg, *be, max_rows);
  const std::size_t full_bytes = ledger.current(Mem::activations) - a0;
  cfg.recompute = true;
  const std::size_t a1 = ledger.current(Mem::activations);
  GPT rc(cfg, *be, max_rows);
  const std::size_t rc_bytes = ledger.current(Mem::activations) - a1;
  std::printf("[ memory  ] activations: %zu B without recompute, %zu B with\n", full_bytes, rc_bytes);
  EXPECT_GT(rc_bytes, 0u);
  EXPECT_LT(rc_bytes, full_bytes);

  Batch b(tiny_config(), max_rows, 21);
  double loss[2];
  std::vector<float> g[2];
  GPT* models[2] = {&full, &rc};
  for (int k = 0; k < 2; ++k) {
    GPT& m = *models[k];
    m.init_weights(42);
    perturb(m, 43);
    m.zero_grad();
    // two micro-batches, so the recomputed activations of one do not leak into the next
    loss[k] = forward_rows(m, b, 0, rows);
    m.backward(0.5f);
    loss[k] += forward_rows(m, b, 1, rows);
    m.backward(0.5f);
    g[k] = grads_of(m);
  }
  EXPECT_EQ(loss[0], loss[1]);
  std::int64_t differ = 0;
  for (std::size_t i = 0; i < g[0].size(); ++i) differ += g[0][i] != g[1][i];
  // Recomputation repeats the same operations on the same inputs; 1e-6 of each tensor's largest
  // gradient leaves room for a BLAS that blocks a recomputed product differently.
  double worst = 0;
  for (const auto& p : full.params()) {
    const double err = tensor_rel_diff(g[1], g[0], p);
    worst = std::max(worst, err);
    EXPECT_LE(err, 1e-6) << p.name;
  }
  std::printf("[ recomp  ] %lld of %zu gradients differ from the non-recompute ones (worst max|diff| / max|g| %.2e)\n",
              static_cast<long long>(differ), g[0].size(), worst);
  // The recompute model's block activations must not be stale after backward: a fresh forward
  // gives the same loss in both.
  EXPECT_EQ(forward_rows(full, b, 0, max_rows), forward_rows(rc, b, 0, max_rows));
}

// ---------------------------------------------------------------------------------------------
// 3. Initialisation.

TEST(GPT, InitialisationIsDeterministicPerSeed) {
  auto be = make_host_backend(1);
  const GPTConfig cfg = tiny_config();
  GPT a(cfg, *be, 1), b(cfg, *be, 3), c(cfg, *be, 1);  // max_rows does not matter
  a.init_weights(7);
  b.init_weights(7);
  c.init_weights(8);
  EXPECT_EQ(std::memcmp(flat_params(a), flat_params(b), sizeof(float) * a.num_params()), 0);
  for (const auto& p : a.params()) {
    if (p.init != ParamInfo::Init::normal) continue;
    std::int64_t same = 0;
    for (std::int64_t i = 0; i < p.numel(); ++i) same += flat_params(a)[p.offset + i] == flat_params(c)[p.offset + i];
    EXPECT_EQ(same, 0) << p.name << ": another seed gives equal elements";
  }
  // Re-initialising overwrites whatever was there (e.g. after training).
  perturb(b, 1);
  b.init_weights(7);
  EXPECT_EQ(std::memcmp(flat_params(a), flat_params(b), sizeof(float) * a.num_params()), 0);
}

TEST(GPT, InitialisationFollowsGPT2AndTheCounterBasedGenerator) {
  auto be = make_host_backend(1);
  const GPTConfig cfg = tiny_config();
  GPT m(cfg, *be, 1);
  const std::uint64_t seed = 2024;
  m.init_weights(seed);
  const float* w = flat_params(m);
  int normals = 0;
  for (const auto& p : m.params()) {
    const float* x = w + p.offset;
    const bool is_ln_weight = p.name.find("ln") != std::string::npos && p.name.size() > 7 &&
                              p.name.compare(p.name.size() - 7, 7, ".weight") == 0;
    const bool is_bias = p.name.size() > 5 && p.name.compare(p.name.size() - 5, 5, ".bias") == 0;
    if (is_ln_weight) {
      for (std::int64_t i = 0; i < p.numel(); ++i) ASSERT_EQ(x[i], 1.0f) << p.name << "[" << i << "]";
    } else if (is_bias) {
      for (std::int64_t i = 0; i < p.numel(); ++i) ASSERT_EQ(x[i], 0.0f) << p.name << "[" << i << "]";
    } else {
      ++normals;
      const double sd = expected_std(p.name, cfg.layers);
      EXPECT_DOUBLE_EQ(p.init_std, sd) << p.name;
      // Element i is a pure function of (seed, name, i): the same whatever the buffer layout.
      for (std::int64_t i = 0; i < p.numel(); ++i)
        ASSERT_EQ(x[i],
                  static_cast<float>(sd * rng::normal(seed, rng::hash_name(p.name), static_cast<std::uint64_t>(i))))
            << p.name << "[" << i << "]";
    }
  }
  EXPECT_EQ(normals, 2 + 4 * cfg.layers);  // wte, wpe; qkv, proj, fc, mlp.proj per block
}

TEST(GPT, InitialisationIsLayoutIndependent) {
  // A deeper model with a longer context lays every tensor but wte out at another offset of the
  // flat buffer; a tensor of the same name still gets the same values element for element
  // (residual projections differ only by their depth-dependent scale 1/sqrt(2L); wpe, now longer,
  // starts with the same rows).
  auto be = make_host_backend(1);
  GPTConfig c2 = tiny_config(), c3 = tiny_config();
  c3.layers = 3;
  c3.seq_len = 16;
  GPT m2(c2, *be, 1), m3(c3, *be, 2);
  m2.init_weights(5);
  m3.init_weights(5);
  for (const auto& p : m2.params()) {
    const ParamInfo& q = m3.param(p.name);
    if (p.name == "wpe.weight") {
      EXPECT_EQ(q.numel(), 2 * p.numel());
    } else {
      EXPECT_EQ(p.shape(), q.shape()) << p.name;
    }
    // wte first, then wpe at the same place; everything after wpe moves
    if (p.name != "wte.weight" && p.name != "wpe.weight") {
      EXPECT_NE(p.offset, q.offset) << p.name;
    }
    const double ratio = expected_std(p.name, 3) / expected_std(p.name, 2);
    for (std::int64_t i = 0; i < p.numel(); ++i) {
      const float a = flat_params(m2)[p.offset + i], b = flat_params(m3)[q.offset + i];
      if (ratio == 1.0) {
        ASSERT_EQ(a, b) << p.name << "[" << i << "]";
      } else {
        ASSERT_NEAR(b, a * ratio, 1e-6 * std::abs(a)) << p.name << "[" << i << "]";
      }
    }
  }
}

TEST(GPT, InitialisationHasGPT2Statistics) {
  // A larger model for the statistics: ~120k elements of std 0.02, ~80k of 0.02/sqrt(2L). The
  // sample std of n normals has relative standard error 1/sqrt(2n) (< 0.6% for the single
  // 16k-element tensor below, ~0.25% pooled): the 3% / 5% tolerances are > 8 standard errors.
  auto be = make_host_backend(1);
  GPTConfig cfg;
  cfg.layers = 4;
  cfg.d_model = 64;
  cfg.heads = 4;
  cfg.seq_len = 16;
  cfg.vocab = 64;
  GPT m(cfg, *be, 1);
  m.init_weights(31337);
  struct Acc {
    double n = 0, s = 0, ss = 0, within1 = 0;
  };
  Acc base, resid;
  for (const auto& p : m.params()) {
    if (p.init != ParamInfo::Init::normal) continue;
    const double sd = expected_std(p.name, cfg.layers);
    Acc& a = sd == 0.02 ? base : resid;
    for (std::int64_t i = 0; i < p.numel(); ++i) {
      const double x = flat_params(m)[p.offset + i];
      a.n += 1;
      a.s += x / sd;  // standardised, so both pools are N(0,1) if the scales are right
      a.ss += (x / sd) * (x / sd);
      a.within1 += std::abs(x) < sd;
    }
  }
  for (const Acc* a : {&base, &resid}) {
    const double mean = a->s / a->n, sd = std::sqrt(a->ss / a->n - mean * mean);
    std::printf("[ init    ] %s: n=%.0f mean %.4f sd %.4f (standardised), P(|x|<1 sd) %.4f\n",
                a == &base ? "std 0.02       " : "std 0.02/sqrt(2L)", a->n, mean, sd, a->within1 / a->n);
    EXPECT_LT(std::abs(mean), 5.0 / std::sqrt(a->n));
    EXPECT_NEAR(sd, 1.0, 0.03);
    EXPECT_NEAR(a->within1 / a->n, 0.6827, 0.01);  // normal, not uniform (0.577 at matching std)
  }
  // One large weight on its own, in absolute terms.
  for (const std::string name : {"blocks.2.mlp.fc.weight", "blocks.2.mlp.proj.weight"}) {
    const ParamInfo& p = m.param(name);
    double s = 0, ss = 0;
    for (std::int64_t i = 0; i < p.numel(); ++i) {
      const double x = flat_params(m)[p.offset + i];
      s += x;
      ss += x * x;
    }
    const double mean = s / p.numel(), sd = std::sqrt(ss / p.numel() - mean * mean);
    const double want = name == "blocks.2.mlp.fc.weight" ? 0.02 : 0.02 / std::sqrt(2.0 * cfg.layers);
    std::printf("[ init    ] %s: n=%lld sd %.5f (want %.5f)\n", name.c_str(), static_cast<long long>(p.numel()), sd,
                want);
    EXPECT_NEAR(sd, want, 0.05 * want) << name;
  }
}

// ---------------------------------------------------------------------------------------------
// 4. Micro-batch equivalence.
//
// One forward/backward of 4 rows with dloss = 1 against two of 2 rows with dloss = 0.5 each,
// accumulated. Only the float summation order differs (parameter gradients sum 32 rows at once
// vs 16 + 16), so per tensor the difference is ~N * eps * max|g| ~ 1e-6 of the tensor's largest
// gradient. Asserted per tensor: max|a - b| <= 1e-5 * max|b| (an element-wise relative bound failed
// on an AMD EPYC with OpenBLAS's Haswell kernels: 1.06e-5 on one element near zero).

TEST(GPT, MicroBatchesAccumulateToTheFullBatchGradient) {
  auto be = make_host_backend(1);
  const GPTConfig cfg = tiny_config();
  GPT m(cfg, *be, 4);
  m.init_weights(77);
  perturb(m, 78);
  Batch b(cfg, 4, 79);

  m.zero_grad();
  const double l4 = forward_rows(m, b, 0, 4);
  m.backward(1.0f);
  const std::vector<float> g4 = grads_of(m);

  m.zero_grad();
  double l22 = 0.5 * forward_rows(m, b, 0, 2);
  m.backward(0.5f);
  l22 += 0.5 * forward_rows(m, b, 2, 2);
  m.backward(0.5f);
  const std::vector<float> g22 = grads_of(m);

  EXPECT_NEAR(l22, l4, 1e-6 * l4);
  double worst = 0;
  for (const auto& p : m.params()) {
    const double err = tensor_rel_diff(g22, g4, p);
    worst = std::max(worst, err);
    EXPECT_LE(err, 1e-5) << p.name;
  }
  std::printf("[ ubatch  ] losses %.7f vs %.7f; worst max|diff| / max|g| over tensors %.2e\n", l4, l22, worst);
}

// ---------------------------------------------------------------------------------------------
// 5. Training reduces the loss.

TEST(GPT, AdamWStepsOnAFixedBatchReduceTheLoss) {
  auto be = make_host_backend(1);
  const GPTConfig cfg = tiny_config();
  GPT m(cfg, *be, 2);
  m.init_weights(3);
  Batch b(cfg, 2, 4);
  OptimizerConfig oc;
  oc.lr = 1e-2;
  oc.schedule = "constant";
  oc.steps = 30;
  oc.weight_decay = 0.1;
  AdamW opt(oc, *be, m.params(), m.store().owned());
  std::vector<double> losses;
  for (int s = 0; s < oc.steps; ++s) {
    m.zero_grad();
    losses.push_back(forward_rows(m, b, 0, 2));
    m.backward(1.0f);
    opt.step(m.store(), lr_at(oc, s));
  }
  losses.push_back(forward_rows(m, b, 0, 2));
  std::printf("[ train   ] loss %.4f -> %.4f -> %.4f -> %.4f (steps 0, 1, 10, %lld)\n", losses[0], losses[1],
              losses[10], losses.back(), static_cast<long long>(oc.steps));
  EXPECT_NEAR(losses[0], std::log(cfg.vocab), 0.1);  // GPT-2 init: near-uniform predictions
  EXPECT_LT(losses[1], losses[0]);
  EXPECT_LT(losses.back(), 0.5 * losses[0]);
  EXPECT_EQ(opt.steps_taken(), oc.steps);
}

// ---------------------------------------------------------------------------------------------
// 6. FLOPs per token.

TEST(GPT, FlopsPerTokenFollowsTheDocumentedFormula) {
  auto be = make_host_backend(1);
  const GPTConfig cfg = tiny_config();
  GPT m(cfg, *be, 1);
  // By hand for L=2, C=16, T=8, V=13: matrix weights per block qkv 3*16*16 = 768, proj 256,
  // fc 1024, mlp.proj 1024 -> 3072; x2 layers = 6144; tied head 13*16 = 208 -> 6352.
  // 6 * 6352 = 38112; attention 12 * L * T * C = 12 * 2 * 8 * 16 = 3072. Total 41184.
  EXPECT_DOUBLE_EQ(m.flops_per_token(), 41184.0);
  // The same count from the parameter list: every 2-D weight except wpe (a lookup, not a product).
  double matrix_weights = 0;
  for (const auto& p : m.params())
    if (p.shape().size() == 2 && p.name != "wpe.weight") matrix_weights += static_cast<double>(p.numel());
  EXPECT_DOUBLE_EQ(matrix_weights, 6352.0);
  EXPECT_DOUBLE_EQ(m.flops_per_token(), 6 * matrix_weights + 12.0 * cfg.layers * cfg.seq_len * cfg.d_model);
}

// ---------------------------------------------------------------------------------------------
// Pipeline stages in one process.
//
// The model split into stages (the pipeline plugin's layer half of the partition role), run
// stage after stage by hand, computes what the whole model computes: the stage boundary is the
// residual stream, so the loss and every gradient are the same bits; the tied embedding's gradient
// is the sum of the first stage's wte (lookup) and the last stage's shadow of it (head). Also an
// interleaved split (rank 0 holds chunks {0}, {2}, rank 1 {1}, {3}) and two slots in flight.

namespace {

Stage stage_of(int index, int count, std::vector<std::pair<int, int>> chunks, int slots = 1) {
  Stage s;
  s.index = index;
  s.count = count;
  for (auto [a, b] : chunks) s.chunks.push_back({a, b, slots});
  return s;
}

std::vector<float> grad_of(const GPT& m, const std::string& name) {
  const ParamInfo& p = m.param(name);
  return {flat_grads(m) + p.offset, flat_grads(m) + p.offset + p.numel()};
}

}  // namespace

TEST(GPT, PipelineStagesComputeTheWholeModel) {
  auto be = make_host_backend(1);
  GPTConfig cfg = tiny_config();
  cfg.layers = 4;
  const int rows = 2;
  Batch b(cfg, rows, 91);
  GPT whole(cfg, *be, rows);
  whole.init_weights(5);
  whole.zero_grad();
  const double loss = whole.forward(b.inputs.data(), b.targets.data(), rows);
  whole.backward(1.0f);

  for (bool interleaved : {false, true}) {
    SCOPED_TRACE(interleaved ? "interleaved: stage 0 holds layers 0, 2; stage 1 layers 1, 3" : "stages 0-1 | 2-3");
    GPT s0(cfg, *be, rows, nullptr, interleaved ? stage_of(0, 2, {{0, 1}, {2, 3}}, 2) : stage_of(0, 2, {{0, 2}}, 2));
    GPT s1(cfg, *be, rows, nullptr, interleaved ? stage_of(1, 2, {{1, 2}, {3, 4}}, 2) : stage_of(1, 2, {{2, 4}}, 2));
    for (GPT* m : {&s0, &s1}) {
      m->init_weights(5);
      m->zero_grad();
    }
    EXPECT_TRUE(s1.param("wte.weight").shadow);
    EXPECT_FALSE(s0.param("wte.weight").shadow);
    EXPECT_EQ(s0.find_param("ln_f.weight"), nullptr);
    EXPECT_EQ(s1.find_param("wpe.weight"), nullptr);
    EXPECT_EQ(s0.all_params().size(), whole.params().size());
    EXPECT_EQ(s0.num_params() + s1.num_params(), whole.num_params() + s1.param("wte.weight").numel());

    // Two micro-batches in flight (slots 0 and 1), the second the same rows with dloss 0. Model
    // chunk j runs on stage j % 2 as its chunk j / 2.
    double got = 0;
    const int chunks = interleaved ? 2 : 1;
    GPT* stage[2] = {&s0, &s1};
    for (int slot = 0; slot < 2; ++slot) {
      const float* x = nullptr;
      for (int j = 0; j < 2 * chunks; ++j) {
        GPT& m = *stage[j % 2];
        const double l = m.forward_stage(slot, b.inputs.data(), x, b.targets.data(), rows, j / 2);
        if (j + 1 < 2 * chunks)
          x = m.stage_output(slot, j / 2);
        else if (slot == 0)
          got = l;
      }
    }
    EXPECT_EQ(got, loss);
    for (int slot = 1; slot >= 0; --slot) {
      std::vector<float> d;
      for (int j = 2 * chunks - 1; j >= 0; --j) {
        const float* dx =
            stage[j % 2]->backward_stage(slot, slot == 0 ? 1.0f : 0.0f, j + 1 < 2 * chunks ? d.data() : nullptr, j / 2);
        if (j == 0)
          EXPECT_EQ(dx, nullptr);
        else
          d.assign(dx, dx + s0.stage_boundary_floats(rows));
      }
    }
    for (const ParamInfo& p : whole.params()) {
      if (p.name == "wte.weight") continue;
      const GPT& holder = s0.find_param(p.name) ? s0 : s1;
      EXPECT_EQ(grad_of(holder, p.name), grad_of(whole, p.name)) << p.name;
    }
    // The tied embedding: lookup gradient on stage 0 plus head gradient on stage 1, as the
    // pipeline plugin sums them (the whole model adds them in the other order: within rounding).
    const std::vector<float> g0 = grad_of(s0, "wte.weight"), g1 = grad_of(s1, "wte.weight"),
                             g = grad_of(whole, "wte.weight");
    double worst = 0, scale = 0;
    for (std::size_t i = 0; i < g.size(); ++i) {
      worst = std::max(worst, static_cast<double>(std::abs(g0[i] + g1[i] - g[i])));
      scale = std::max(scale, static_cast<double>(std::abs(g[i])));
    }
    EXPECT_LE(worst, 1e-6 * scale);
  }
}

// The head keeps one [N,V] table: a forward without targets leaves the logits there (sampling), a
// forward with targets overwrites them with the probabilities. The loss of a forward with targets is
// the log-softmax of the logits a forward without them left.
TEST(GPT, ForwardWithoutTargetsKeepsTheLogits) {
  auto be = make_host_backend(1);
  const GPTConfig cfg = tiny_config();
  const int rows = 2, N = rows * cfg.seq_len, V = cfg.vocab;
  GPT m(cfg, *be, rows);
  m.init_weights(7);
  perturb(m, 8);
  const Batch b(cfg, rows, 9);
  EXPECT_EQ(m.forward(b.inputs.data(), nullptr, rows), 0.0);
  EXPECT_THROW(m.backward(1.0f), std::logic_error);  // no targets, no loss to differentiate
  const std::vector<float> logits(m.logits(), m.logits() + static_cast<std::int64_t>(N) * V);
  double want = 0;
  for (int n = 0; n < N; ++n) {
    const float* l = &logits[static_cast<std::size_t>(n) * V];
    const double mx = *std::max_element(l, l + V);
    double z = 0;
    for (int v = 0; v < V; ++v) z += std::exp(l[v] - mx);
    want += (mx + std::log(z) - l[b.targets[static_cast<std::size_t>(n)]]) / N;
  }
  const double loss = m.forward(b.inputs.data(), b.targets.data(), rows);
  EXPECT_NEAR(loss, want, 1e-6 * want);        // float kernels against a double log-softmax of the same logits
  EXPECT_THROW(m.logits(), std::logic_error);  // they are probabilities now
  m.zero_grad();
  m.backward(1.0f);
}

// The fused classifier (forward given the backward's dloss) leaves the loss and every gradient as the
// forward then the backward make them, bit for bit, in fp32 (in place over the logits) and in bf16 (the
// slot's 16-bit dlogits from the shared fp32 logits); the backward refuses another dloss. Under mixed
// precision the slots share one logits table, so an unfused forward's probabilities last only until
// the next forward: a backward after that is refused, and the fused forward makes it unnecessary.
TEST(GPT, FusedClassifierGivesTheUnfusedLossAndGradientsBitForBit) {
  for (DType mm : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(mm));
    auto be = make_host_backend(1);
    Precision prec;
    prec.matmul = mm;
    be->set_precision(prec);
    const GPTConfig cfg = tiny_config();
    const int rows = 2;
    Stage two_slots;
    two_slots.chunks = {{0, cfg.layers, 2}};
    GPT m(cfg, *be, rows, nullptr, two_slots);
    m.init_weights(81);
    perturb(m, 82);
    const Batch a(cfg, rows, 83), b(cfg, rows, 84);
    const float dloss = 0.375f;
    m.zero_grad();
    const double l_unfused = m.forward(a.inputs.data(), a.targets.data(), rows);
    m.backward(dloss);
    const std::vector<float> g_unfused = grads_of(m);
    m.zero_grad();
    const double l_fused = m.forward(a.inputs.data(), a.targets.data(), rows, dloss);
    m.backward(dloss);
    EXPECT_EQ(l_fused, l_unfused);
    EXPECT_EQ(grads_of(m), g_unfused);

    m.forward(a.inputs.data(), a.targets.data(), rows, dloss);
    EXPECT_THROW(m.backward(0.5f), std::logic_error);  // made for 0.375

    // Two micro-batches in flight (a pipeline's slots): fused, both backwards give the sum of the two.
    m.zero_grad();
    m.forward(b.inputs.data(), b.targets.data(), rows);
    m.backward(dloss);
    m.forward(a.inputs.data(), a.targets.data(), rows);
    m.backward(dloss);
    const std::vector<float> g_sum = grads_of(m);
    m.zero_grad();
    m.forward_stage(0, a.inputs.data(), nullptr, a.targets.data(), rows, 0, dloss);
    m.forward_stage(1, b.inputs.data(), nullptr, b.targets.data(), rows, 0, dloss);
    m.backward_stage(1, dloss, nullptr);
    m.backward_stage(0, dloss, nullptr);
    EXPECT_EQ(grads_of(m), g_sum);
    m.forward_stage(0, a.inputs.data(), nullptr, a.targets.data(), rows);
    m.forward_stage(1, b.inputs.data(), nullptr, b.targets.data(), rows);
    m.backward_stage(1, dloss, nullptr);
    if (mm == DType::f32) {
      m.backward_stage(0, dloss, nullptr);  // each slot keeps its own probabilities
    } else {
      EXPECT_THROW(m.backward_stage(0, dloss, nullptr), std::logic_error);  // slot 1's forward overwrote them
    }
  }
}

// What `loom plan` predicts activation memory with (GPT::activation_sizes) is what the constructor
// allocates, for the default stage and for chunks holding several micro-batches, with and without
// recompute, in fp32 and bf16, with unfused and flash attention; and, for the plain fp32 model, the
// textbook count written out here.
TEST(GPT, ActivationSizesAreWhatTheConstructorAllocates) {
  auto& ledger = Ledger::global();
  GPTConfig base = tiny_config();
  base.heads = 1;  // head size 16: one the fused kernels take
  Stage two_chunks;
  two_chunks.index = 1;
  two_chunks.count = 2;
  two_chunks.chunks = {{0, 1, 3}, {1, 2, 2}};  // layers [0,1) with 3 micro-batches held, [1,2) with 2
  for (DType mm : {DType::f32, DType::bf16})
    for (bool recompute : {false, true})
      for (bool flash : {false, true})
        for (const Stage* stage : {static_cast<const Stage*>(nullptr), static_cast<const Stage*>(&two_chunks)}) {
          auto be = make_host_backend(1);
          Precision p;
          p.matmul = mm;
          be->set_precision(p);
          GPTConfig cfg = base;
          cfg.recompute = recompute;
          cfg.flash_attention = flash;
          const int rows = 3;
          const Stage st = stage ? *stage : Stage{};
          const GPT::ActivationSizes want = GPT::activation_sizes(cfg, 1, false, st, rows, mm);
          const std::size_t a0 = ledger.current(Mem::activations), w0 = ledger.current(Mem::workspace);
          GPT model(cfg, *be, rows, nullptr, st);
          EXPECT_EQ(ledger.current(Mem::activations) - a0, static_cast<std::size_t>(want.activation_bytes()))
              << dtype_name(mm) << " recompute " << recompute << " flash " << flash
              << (stage ? " two chunks" : " one stage");
          EXPECT_EQ(ledger.current(Mem::workspace) - w0, static_cast<std::size_t>(want.workspace_bytes()));
        }
  // fp32, one stage, no recompute: residual streams (L + 1) N C; per block 15 N C + 4 N + B NH T^2;
  // head N C + 2 N + N V + N (the probabilities overwrite the logits); scratch below.
  const std::int64_t L = base.layers, C = base.d_model, T = base.seq_len, V = base.vocab, NH = base.heads, B = 3;
  const std::int64_t N = B * T;
  const std::int64_t block = 15 * N * C + 4 * N + B * NH * T * T;
  const std::int64_t head = N * C + 2 * N + N * V + N;
  // scratch: full, partial, local, dres, dlocal, dfull, dpartial (7 N C), dqkv 3 N C, datt T^2,
  // datty N C, dfch, dfch_gelu 8 N C
  const std::int64_t scratch = 7 * N * C + 3 * N * C + T * T + N * C + 8 * N * C;
  const GPT::ActivationSizes a = GPT::activation_sizes(base, 1, false, Stage{}, B, DType::f32);
  EXPECT_EQ(a.activation_bytes(), 4 * ((L + 1) * N * C + L * block + head + scratch));
  EXPECT_EQ(a.workspace_bytes(), 4 * 2 * N);
  // flash: each block keeps lse B NH T instead of the probabilities B NH T^2; the scratch dsum
  // B NH T instead of datt T^2.
  GPTConfig flash = base;
  flash.flash_attention = true;
  const std::int64_t flash_block = 15 * N * C + 4 * N + B * NH * T;
  const std::int64_t flash_scratch = 7 * N * C + 3 * N * C + B * NH * T + N * C + 8 * N * C;
  const GPT::ActivationSizes f = GPT::activation_sizes(flash, 1, false, Stage{}, B, DType::f32);
  EXPECT_EQ(f.activation_bytes(), 4 * ((L + 1) * N * C + L * flash_block + head + flash_scratch));
}
