// The planner's arithmetic (`loom plan`, driver/plan/predict.hpp and cost_model.hpp) against formulas
// written out by hand here from the textbook: a GPT's parameter count, ZeRO's model state per stage
// (16P, 4P + 4P + 8P/N, 4P + 4P/N + 8P/N, 16P/N with loom's shares, shard_counts), activations
// against the rows of a micro-batch, a step's time as FLOPs over a rate plus bytes over a bandwidth,
// the ring all-reduce's 2(N-1)/N M, ZeRO's traffic, the pipeline bubble (p-1)/(m+p-1), and the
// refusals of layouts that cannot run. Every rank is built on the counting back end as `loom plan`
// builds it; the cluster is made up here so that each term can be isolated (rates of 1e30 make a
// term vanish). Integers are compared exactly, seconds within a relative 1e-12 unless said.
#include <gtest/gtest.h>

#include <Kokkos_Core.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "core/backend/blas_core.hpp"
#include "core/base/error.hpp"
#include "core/engine/plugin.hpp"
#include "driver/plan/cost_model.hpp"
#include "driver/plan/predict.hpp"
#include "io/deck.hpp"

using namespace loom;

namespace {

// The registry and schema `loom` loads: the built-in strategy and the plugins of this build.
struct Loaded {
  StrategyRegistry registry;
  DeckSchema schema;
};
const Loaded& loaded() {
  static const std::unique_ptr<Loaded> l = [] {
    auto x = std::make_unique<Loaded>();
    register_builtin_strategies(x->registry);
    discover_plugins(x->registry, {LOOM_PLUGIN_DIR});
    add_core_keys(x->schema);
    for (const auto& [name, info] : x->registry.all())
      for (const auto& key : info.keys) x->schema.add(key);
    return x;
  }();
  return *l;
}

// A tiny GPT: L 2, C 64, 4 heads, T 32, V 64, batch 16 (the synthetic deck's model).
const char* const kDeck = R"([model]
layers = 2
d_model = 64
heads = 4
seq_len = 32
vocab = 64
[data]
source = synthetic
[train]
steps = 10
batch = 16
[run]
backend = host
)";

Deck deck(const std::vector<std::string>& sets, const std::string& text = kDeck) {
  return parse_deck(loaded().schema, text, "test_plan_arithmetic", sets);
}

// A made-up cluster: one node of 8 host devices (no host link: the devices are the host's cores, so
// no message hides behind compute), every fixed cost and latency 0, efficiency 1 at every width.
ClusterSpec cluster() {
  ClusterSpec c;
  c.name = "unit-test cluster";
  c.nodes = 1;
  c.devices_per_node = 8;
  c.device_memory_bytes = 80.0 * (1 << 30);
  c.peak_flops_fp32 = 2e12;
  c.peak_flops_bf16 = 8e12;
  c.peak_flops_fp16 = 8e12;
  c.matmul_call_s = 0;
  c.attention_flops = 5e11;
  c.attention_head_s = 0;
  c.memory_bytes_per_s = 1e11;
  c.optimizer_bytes_per_s = 5e10;
  c.sync_wait_share = 0;
  c.host_bytes_per_s = 1e10;
  c.host_link_bytes_per_s = 0;
  c.intra_bytes_per_s = 1e10;
  c.inter_bytes_per_s = 1e9;
  return c;
}

Prediction plan(const std::vector<std::string>& sets, const ClusterSpec& c = cluster(), bool every_rank = true) {
  return predict(deck(sets), loaded().registry, c, every_rank);
}

double built(const RankPrediction& r, Mem m) { return r.built[static_cast<std::size_t>(m)]; }

// GPT-2's parameters with a tied head: per block 12 C^2 (the four matrices) + 13 C (their biases, 3C +
// C + 4C + C, and two LayerNorms' 4C); the token and position embeddings (V + T) C; ln_f 2C.
std::int64_t gpt_params(std::int64_t L, std::int64_t C, std::int64_t T, std::int64_t V) {
  return 12 * L * C * C + 13 * L * C + (V + T) * C + 2 * C;
}

// ZeRO's share of rank r: P / N elements, one more on the first P % N ranks.
std::int64_t share(std::int64_t P, int N, int r) { return P / N + (r < P % N ? 1 : 0); }

void expect_rel(double got, double want, double rel, const std::string& what) {
  EXPECT_LE(std::fabs(got - want), rel * std::fabs(want))
      << what << ": got " << got << ", want " << want << " (relative " << (got - want) / want << ")";
}
constexpr double kRel = 1e-12;

}  // namespace

// ---------------------------------------------------------------------------------------------
// Memory

TEST(PlanMemory, ParameterCountIsGptTwos) {
  const Prediction p = plan({});
  ASSERT_EQ(p.ranks.size(), 1u);
  const std::int64_t P = gpt_params(2, 64, 32, 64);
  EXPECT_EQ(P, 106240);  // 12*2*64^2 + 13*2*64 + (64+32)*64 + 2*64
  const RankPrediction& r = p.ranks[0];
  EXPECT_EQ(r.params_held, P);
  EXPECT_EQ(r.layers, 2);
  // fp32 AdamW, no sharding: weights 4P, gradients 4P, two moments 8P; no master copy.
  EXPECT_EQ(built(r, Mem::params), 4.0 * P);
  EXPECT_EQ(built(r, Mem::grads), 4.0 * P);
  EXPECT_EQ(built(r, Mem::optimizer), 8.0 * P);
  EXPECT_EQ(built(r, Mem::master), 0.0);
  EXPECT_EQ(p.zero_stage, 0);
  EXPECT_EQ(p.precision, "fp32");

  // Another shape, widths and vocabulary that are no power of two.
  const Prediction q = plan({"model.d_model=62", "model.heads=2", "model.vocab=65", "model.layers=3"});
  EXPECT_EQ(q.ranks[0].params_held, gpt_params(3, 62, 32, 65));
  EXPECT_EQ(built(q.ranks[0], Mem::params), 4.0 * gpt_params(3, 62, 32, 65));
}

// ZeRO over N = 4 ranks of a model whose P = 100006 does not divide by 4: shares 25002, 25002, 25001,
// 25001. Stage 0: 4P + 4P + 8P; 1: 4P + 4P + 8s; 2: 4P + 4s + 8s; 3: 4s + 4s + 8s (s the rank's share).
TEST(PlanMemory, ZeroStagesModelStateBytes) {
  const std::int64_t P = gpt_params(2, 62, 32, 65);
  ASSERT_EQ(P, 100006);
  const int N = 4;
  ASSERT_NE(P % N, 0);
  std::int64_t shares = 0;
  for (int r = 0; r < N; ++r) shares += share(P, N, r);
  ASSERT_EQ(shares, P);
  for (int stage = 0; stage <= 3; ++stage) {
    SCOPED_TRACE("zero.stage = " + std::to_string(stage));
    const Prediction p = plan({"model.d_model=62", "model.heads=2", "model.vocab=65", "parallel.dp=4",
                               "zero.stage=" + std::to_string(stage)});
    ASSERT_EQ(p.ranks.size(), 4u);
    EXPECT_EQ(p.zero_stage, stage);
    for (const RankPrediction& r : p.ranks) {
      SCOPED_TRACE("rank " + std::to_string(r.rank));
      EXPECT_EQ(r.dp_rank, r.rank);  // dp only: rank r is dp rank r
      const double s = static_cast<double>(share(P, N, r.rank));
      const double params = stage >= 3 ? 4 * s : 4.0 * P;
      const double grads = stage >= 2 ? 4 * s : 4.0 * P;
      const double optimizer = stage >= 1 ? 8 * s : 8.0 * P;
      EXPECT_EQ(built(r, Mem::params), params);
      EXPECT_EQ(built(r, Mem::grads), grads);
      EXPECT_EQ(built(r, Mem::optimizer), optimizer);
      EXPECT_EQ(built(r, Mem::master), 0.0);
      EXPECT_EQ(r.state_parts_split, stage);
      // Against the textbook's 16P, 4P + 4P + 8P/N, 4P + 4P/N + 8P/N, 16P/N: at most a share's rounding over it.
      const double textbook = stage == 0   ? 16.0 * P
                              : stage == 1 ? 8.0 * P + 8.0 * P / N
                              : stage == 2 ? 4.0 * P + 12.0 * P / N
                                           : 16.0 * P / N;
      const double state = built(r, Mem::params) + built(r, Mem::grads) + built(r, Mem::optimizer);
      EXPECT_LT(std::fabs(state - textbook), 16.0) << "state " << state << " textbook " << textbook;
    }
  }
}

// bf16 without ZeRO: the fp32 weights become the master copy (4P), the products read a 16-bit copy
// of the matrices (2 bytes per element of the blocks' four matrices and the tied wte/head),
// gradients and AdamW stay fp32.
TEST(PlanMemory, Bf16KeepsFp32MastersAndSixteenBitMatrixCopies) {
  const Prediction p = plan({"precision.dtype=bf16"});
  const std::int64_t P = gpt_params(2, 64, 32, 64);
  const std::int64_t matrices = 12 * 2 * 64 * 64 + 64 * 64;
  const RankPrediction& r = p.ranks[0];
  EXPECT_EQ(p.precision, "bf16");
  EXPECT_EQ(built(r, Mem::master), 4.0 * P);
  EXPECT_EQ(built(r, Mem::params), 2.0 * matrices);
  EXPECT_EQ(built(r, Mem::grads), 4.0 * P);
  EXPECT_EQ(built(r, Mem::optimizer), 8.0 * P);
}

// Activations are held for one micro-batch: with m micro-batches of B/m rows they are an affine
// function of the rows, a*rows + b, so A(16) - A(8) = 2 (A(8) - A(4)); the model state does not move;
// and a micro-batch of 8 rows holds the same whether it is B 16 over 2 micro-batches or over dp 2.
TEST(PlanMemory, ActivationsScaleWithRowsPerMicroBatch) {
  double act[3], state[3];
  const int micro[3] = {1, 2, 4};
  for (int i = 0; i < 3; ++i) {
    const Prediction p = plan({"train.micro_batches=" + std::to_string(micro[i])});
    EXPECT_EQ(p.plan.rows_per_micro, 16 / micro[i]);
    act[i] = built(p.ranks[0], Mem::activations);
    state[i] = built(p.ranks[0], Mem::params) + built(p.ranks[0], Mem::grads) + built(p.ranks[0], Mem::optimizer);
  }
  EXPECT_GT(act[0], act[1]);
  EXPECT_GT(act[1], act[2]);
  EXPECT_EQ(act[0] - act[1], 2 * (act[1] - act[2]));
  const double per_row = (act[1] - act[2]) / 4, fixed = act[2] - 4 * per_row;
  EXPECT_GE(fixed, 0);
  EXPECT_LT(fixed, 0.01 * act[2]) << "the part that does not scale with rows";
  // At least the [T, 4C] MLP activations and [NH, T, T] attention probabilities of every layer, per row.
  EXPECT_GE(per_row, 4.0 * 2 * (32 * 4 * 64 + 4 * 32 * 32));
  EXPECT_EQ(state[0], state[1]);
  EXPECT_EQ(state[0], state[2]);
  const Prediction dp2 = plan({"parallel.dp=2"});
  EXPECT_EQ(built(dp2.ranks[0], Mem::activations), act[1]);
}

// The layout search builds only the ends of each tp and dp group (every_rank = false): its peak and step
// time equal those of every rank built, also where ZeRO's shares are uneven.
TEST(PlanMemory, SearchShortcutMatchesEveryRank) {
  for (int stage = 0; stage <= 3; ++stage) {
    SCOPED_TRACE("zero.stage = " + std::to_string(stage));
    const std::vector<std::string> sets = {"model.d_model=62", "model.heads=2", "model.vocab=65", "parallel.dp=4",
                                           "zero.stage=" + std::to_string(stage)};
    const Prediction all = plan(sets, cluster(), true), ends = plan(sets, cluster(), false);
    EXPECT_EQ(ends.ranks.size(), 2u);
    EXPECT_EQ(ends.peak_total, all.peak_total);
    EXPECT_EQ(ends.time.step_s, all.time.step_s);
  }
}

// ---------------------------------------------------------------------------------------------
// Time

namespace {
// One rank of the tiny GPT: B sequences of T tokens per step. FLOPs of the products: 6 per token and
// matrix element (forward 2, backward 4) over the blocks' 12 L C^2 and the tied head's V C; with
// recompute the blocks' forward runs twice (8). Attention 12 B T^2 C per layer (forward QK^T and AV
// 4 B T^2 C, backward twice that), another third with recompute. Element-wise bytes per token: a
// block's forward LayerNorms 2 x 8C, GELU 8 x 4C, residual adds 2 x 12C; backward LayerNorms 2 x 12C,
// GELU 12 x 4C, residual copies 2 x 8C (160 C); the head's LayerNorm 20 C and cross-entropy 20 V, the
// embedding 20 C. AdamW: 4 B to zero each gradient, 40 B per element updated (norm 4, clip 8, AdamW 28).
struct Hand {
  double L = 2, C = 64, T = 32, V = 64, B = 16, NH = 4;
  double tokens() const { return B * T; }
  double matmul_flops(bool recompute = false) const {
    return tokens() * ((recompute ? 8 : 6) * 12 * L * C * C + 6 * V * C);
  }
  double attention_flops(bool recompute = false) const {
    return L * 12 * B * T * T * C * (recompute ? 4.0 / 3.0 : 1.0);
  }
  double elementwise_bytes(bool recompute = false) const {
    return tokens() * ((recompute ? 232 : 160) * L * C + 20 * V + 40 * C);
  }
  double optimizer_bytes(double P) const { return 44 * P; }
};
}  // namespace

TEST(PlanTime, StepIsCountsOverRates) {
  const ClusterSpec c = cluster();
  const Prediction p = plan({}, c);
  const Hand h;
  const double P = static_cast<double>(gpt_params(2, 64, 32, 64));
  const TimePrediction& t = p.time;
  expect_rel(t.matmul_s, h.matmul_flops() / c.peak_flops_fp32, kRel, "products");
  expect_rel(t.attention_s, h.attention_flops() / c.attention_flops, kRel, "attention");
  expect_rel(t.elementwise_s, h.elementwise_bytes() / c.memory_bytes_per_s, kRel, "element-wise");
  expect_rel(t.optimizer_s, h.optimizer_bytes(P) / c.optimizer_bytes_per_s, kRel, "AdamW");
  EXPECT_EQ(t.strategies_s, 0.0);
  const double compute = h.matmul_flops() / c.peak_flops_fp32 + h.attention_flops() / c.attention_flops +
                         h.elementwise_bytes() / c.memory_bytes_per_s + h.optimizer_bytes(P) / c.optimizer_bytes_per_s;
  expect_rel(t.compute_s, compute, kRel, "compute");
  // One rank: no messages, no bubble, no waits; the step is its compute.
  EXPECT_EQ(t.comm_s, 0.0);
  EXPECT_EQ(t.bubble, 0.0);
  EXPECT_EQ(t.sync_wait_s, 0.0);
  expect_rel(t.step_s, compute, kRel, "step");
  expect_rel(t.tokens_per_s, h.tokens() / compute, kRel, "tokens/s");
  // MFU: the model's FLOPs per token (6 x matrix elements + 12 L T C of attention) at the peak.
  const double fpt = 6 * (12 * h.L * h.C * h.C + h.V * h.C) + 12 * h.L * h.T * h.C;
  expect_rel(t.mfu, h.tokens() / compute * fpt / c.peak_flops_fp32, kRel, "MFU");
}

// Recompute runs the blocks' forward again: products 8/6 of the blocks', attention 4/3, the blocks'
// forward element-wise bytes twice; the head and the optimizer as before.
TEST(PlanTime, RecomputeAddsOneForward) {
  const ClusterSpec c = cluster();
  const Prediction p = plan({"model.recompute=true"}, c);
  const Hand h;
  expect_rel(p.time.matmul_s, h.matmul_flops(true) / c.peak_flops_fp32, kRel, "products");
  expect_rel(p.time.attention_s, h.attention_flops(true) / c.attention_flops, kRel, "attention");
  expect_rel(p.time.elementwise_s, h.elementwise_bytes(true) / c.memory_bytes_per_s, kRel, "element-wise");
}

// The fixed costs are per call, so they grow with the micro-batches while the FLOPs do not: per
// micro-batch a block makes 4 GEMMs forward and 8 backward, the head 1 and 2; attention costs
// attention_head_us per sequence and head of every layer.
TEST(PlanTime, FixedCostsScaleWithMicroBatches) {
  ClusterSpec c = cluster();
  c.matmul_call_s = 4e-6;
  c.attention_head_s = 2e-6;
  const Hand h;
  for (int m : {1, 2, 4}) {
    SCOPED_TRACE("micro_batches = " + std::to_string(m));
    const Prediction p = plan({"train.micro_batches=" + std::to_string(m)}, c);
    const double gemms = m * (12 * h.L + 3);
    expect_rel(p.time.matmul_s, h.matmul_flops() / c.peak_flops_fp32 + gemms * c.matmul_call_s, kRel, "products");
    expect_rel(p.time.attention_s, h.attention_flops() / c.attention_flops + h.L * h.B * h.NH * c.attention_head_s,
               kRel, "attention");
  }
}

// The products' rate: the precision's peak times its efficiency at the block's width (C / sqrt(tp)).
TEST(PlanTime, ProductsAtPrecisionPeakAndWidthEfficiency) {
  ClusterSpec c = cluster();
  const Hand h;
  const Prediction bf16 = plan({"precision.dtype=bf16"}, c);
  expect_rel(bf16.time.matmul_s, h.matmul_flops() / c.peak_flops_bf16, kRel, "bf16 products");
  ASSERT_EQ(MatmulEfficiency::parse("32:0.25 128:1", &c.efficiency_fp32), "");
  // Width 64 lies halfway between 32 and 128 in log width: 0.625 of the peak.
  EXPECT_NEAR(c.efficiency_fp32.at(64), 0.625, 1e-15);
  const Prediction fp32 = plan({}, c);
  expect_rel(fp32.time.matmul_s, h.matmul_flops() / (0.625 * c.peak_flops_fp32), kRel, "fp32 products at 64 wide");
}

TEST(PlanTime, MatmulEfficiencyInterpolatesInLogWidth) {
  MatmulEfficiency e;
  ASSERT_EQ(MatmulEfficiency::parse("64:0.5 512:1", &e), "");
  EXPECT_DOUBLE_EQ(e.at(16), 0.5);  // held below the first point
  EXPECT_DOUBLE_EQ(e.at(64), 0.5);
  EXPECT_DOUBLE_EQ(e.at(128), 0.5 + 0.5 / 3);  // a third of the way in log2: 6 -> 7 of 6 -> 9
  EXPECT_DOUBLE_EQ(e.at(512), 1.0);
  EXPECT_DOUBLE_EQ(e.at(4096), 1.0);  // held above the last
  MatmulEfficiency one;
  ASSERT_EQ(MatmulEfficiency::parse("0.8", &one), "");
  EXPECT_DOUBLE_EQ(one.at(7), 0.8);
  EXPECT_DOUBLE_EQ(one.at(7000), 0.8);
  ClusterSpec c;
  c.peak_flops_bf16 = 1e15;
  c.efficiency_bf16 = e;
  EXPECT_DOUBLE_EQ(c.matmul_rate("bf16", 64), 0.5e15);
  // Refused: widths out of order, a share above 1, trailing words after a lone share.
  EXPECT_NE(MatmulEfficiency::parse("512:0.5 64:1", nullptr), "");
  EXPECT_NE(MatmulEfficiency::parse("1.5", nullptr), "");
  EXPECT_NE(MatmulEfficiency::parse("0.5 0.6", nullptr), "");
}

// Data parallelism over N ranks: the gradients' ring all-reduce sends 2 (N-1)/N M bytes per rank,
// M = 4P; on the host's own cores inside a node nothing hides, so the step is compute + that over
// the link. Inside a node at intra_node_gbs; with one device per node at inter_node_gbs.
TEST(PlanTime, DataParallelRingAllReduce) {
  const double P = static_cast<double>(gpt_params(2, 64, 32, 64));
  for (int N : {2, 4}) {
    for (bool across : {false, true}) {
      SCOPED_TRACE("dp " + std::to_string(N) + (across ? ", one device per node" : ", one node"));
      ClusterSpec c = cluster();
      if (across) c.nodes = 8, c.devices_per_node = 1;
      const Prediction p = plan({"parallel.dp=" + std::to_string(N)}, c);
      const double bw = across ? c.inter_bytes_per_s : c.intra_bytes_per_s;
      const double comm = 2.0 * (N - 1) / N * 4 * P / bw;
      expect_rel(p.time.comm_s, comm, 1e-9, "comm");
      expect_rel(p.time.comm_exposed_s, comm, 1e-9, "exposed comm");
      expect_rel(p.time.step_s, p.time.compute_s + comm, 1e-9, "step");
      // Each rank computes B/N sequences: the products' FLOPs are 1/N of one rank's.
      Hand h;
      h.B = 16.0 / N;
      expect_rel(p.time.matmul_s, h.matmul_flops() / c.peak_flops_fp32, kRel, "products");
    }
  }
}

// The latency term: every message costs the link's latency on top of its bytes; a ring all-reduce
// over N ranks sends 2(N-1) messages per bucket.
TEST(PlanTime, LatencyPerRingMessage) {
  ClusterSpec c = cluster();
  const Prediction base = plan({"parallel.dp=4"}, c);
  c.intra_latency_s = 1e-5;
  const Prediction slow = plan({"parallel.dp=4"}, c);
  const double messages = (slow.time.comm_s - base.time.comm_s) / c.intra_latency_s;
  EXPECT_NEAR(messages, std::round(messages), 1e-6);
  EXPECT_GE(std::round(messages), 2 * 3);
  EXPECT_EQ(std::fmod(std::round(messages), 6.0), 0.0) << messages << " messages: not 2(N-1) per bucket";
}

// ZeRO's traffic per rank, M = 4P, one micro-batch: stage 1 reduce-scatter + all-gather, 2(N-1)/N M;
// stage 2 the same; stage 3 gathers the weights for forward and again for backward, 3(N-1)/N M.
TEST(PlanTime, ZeroTraffic) {
  const double P = static_cast<double>(gpt_params(2, 64, 32, 64));
  const int N = 4;
  ASSERT_EQ(static_cast<std::int64_t>(P) % N, 0);
  const ClusterSpec c = cluster();
  for (int stage = 1; stage <= 3; ++stage) {
    SCOPED_TRACE("zero.stage = " + std::to_string(stage));
    const Prediction p = plan({"parallel.dp=4", "zero.stage=" + std::to_string(stage)}, c);
    const double volumes = stage == 3 ? 3 : 2;
    expect_rel(p.time.comm_s * c.intra_bytes_per_s, volumes * (N - 1) / N * 4 * P, 1e-9, "bytes");
  }
}

namespace {
// A cluster where only attention takes time (the products, element-wise kernels and links at 1e30):
// every layer costs the same, so pipeline stages of equal layer counts are equally busy.
ClusterSpec attention_only() {
  ClusterSpec c = cluster();
  c.peak_flops_fp32 = c.peak_flops_bf16 = c.peak_flops_fp16 = 1e30;
  c.memory_bytes_per_s = 1e30;
  c.intra_bytes_per_s = c.inter_bytes_per_s = 1e30;
  return c;
}
}  // namespace

// With m micro-batches: stage 1 accumulates whole gradients and reduces once (2(N-1)/N M); stage 2
// reduce-scatters every micro-batch into the shares ((m+1)(N-1)/N M); stage 3 also gathers each
// micro-batch's weights, forward and backward ((3m)(N-1)/N M).
TEST(PlanTime, ZeroTrafficWithMicroBatches) {
  const double P = static_cast<double>(gpt_params(2, 64, 32, 64));
  const int N = 4, m = 2;
  const ClusterSpec c = cluster();
  for (int stage = 1; stage <= 3; ++stage) {
    SCOPED_TRACE("zero.stage = " + std::to_string(stage));
    const Prediction p = plan({"parallel.dp=4", "train.micro_batches=2", "zero.stage=" + std::to_string(stage)}, c);
    const double volumes = stage == 1 ? 2 : stage == 2 ? m + 1 : 3 * m;
    expect_rel(p.time.comm_s * c.intra_bytes_per_s, volumes * (N - 1) / N * 4 * P, 1e-9, "bytes");
  }
}

// Interleaving v = 2 chunks per stage shrinks the bubble towards (p-1)/(vm+p-1). Not exactly: the head (here
// 0.08 of a block's FLOPs, in units of the replay) makes the last chunk of the last stage longer than the
// others, so within 5% of the textbook figure, and below the bubble of the same layers without interleaving.
TEST(PlanTime, InterleavedPipelineBubble) {
  const ClusterSpec c = attention_only();
  for (int m : {4, 8}) {
    SCOPED_TRACE(std::to_string(m) + " micro-batches");
    const std::vector<std::string> sets = {"model.layers=8", "parallel.pp=2",
                                           "train.micro_batches=" + std::to_string(m)};
    std::vector<std::string> interleaved = sets;
    interleaved.push_back("pipeline.virtual_stages=2");
    const double plain = plan(sets, c).time.bubble, v2 = plan(interleaved, c).time.bubble;
    expect_rel(plain, 1.0 / (m + 1.0), 1e-9, "bubble, 1 chunk per stage");
    expect_rel(v2, 1.0 / (2 * m + 1.0), 0.05, "bubble, 2 chunks per stage");
    EXPECT_LT(v2, plain);
  }
}

// p equal stages, m micro-batches (GPipe and 1F1B alike): the span is (m + p - 1) micro-batches' worth
// of one stage's work, the idle share (p-1)/(m+p-1), and the step that span plus the optimizer.
TEST(PlanTime, PipelineBubble) {
  const ClusterSpec c = attention_only();
  for (const char* schedule : {"1f1b", "gpipe"})
    for (int pp : {2, 4})
      for (int m : {4, 8}) {
        SCOPED_TRACE(std::string(schedule) + ", pp " + std::to_string(pp) + ", " + std::to_string(m) +
                     " micro-batches");
        const Prediction p =
            plan({"model.layers=4", "parallel.pp=" + std::to_string(pp), "train.micro_batches=" + std::to_string(m),
                  std::string("pipeline.schedule=") + schedule},
                 c);
        const TimePrediction& t = p.time;
        ASSERT_EQ(t.stage_busy_s.size(), static_cast<std::size_t>(pp));
        Hand h;
        h.L = 4.0 / pp;  // a stage's layers
        const double busy = h.attention_flops() / c.attention_flops;
        for (double b : t.stage_busy_s) expect_rel(b, busy, 1e-9, "stage busy");
        expect_rel(t.bubble, (pp - 1.0) / (m + pp - 1.0), 1e-9, "bubble");
        expect_rel(t.pipeline_span_s, busy * (m + pp - 1.0) / m, 1e-9, "span");
        expect_rel(t.step_s, t.pipeline_span_s + t.optimizer_s, 1e-9, "step");
      }
}

// Two stages whose last (a heavy head, V 8192 at C 128) is the slower: m micro-batches keep it busy but
// for the first stage's first forward and last backward, span = busy1 + busy0 / m.
TEST(PlanTime, PipelineSpanWithUnequalStages) {
  // On the host's sizing back end, and on the CUDA one that a GPU cluster plans for (no GPU needed), whose
  // cluster has fixed costs per call and a host link (so some messages hide behind compute).
  ClusterSpec gpu = cluster();
  gpu.matmul_call_s = 4e-6;
  gpu.attention_head_s = 2e-6;
  gpu.host_link_bytes_per_s = 25e9;
  gpu.intra_latency_s = 2e-6;
  for (const auto& [backend, c] :
       {std::make_pair(std::string("host"), cluster()), std::make_pair(std::string("cuda"), gpu)})
    for (const char* schedule : {"1f1b", "gpipe"})
      for (int m : {1, 4, 8}) {
        SCOPED_TRACE(backend + ", " + schedule + ", " + std::to_string(m) + " micro-batches");
        const Prediction p = plan({"model.layers=4", "model.d_model=128", "model.vocab=8192", "parallel.pp=2",
                                   "train.micro_batches=" + std::to_string(m), "run.backend=" + backend,
                                   std::string("pipeline.schedule=") + schedule},
                                  c);
        EXPECT_EQ(p.backend, backend);
        const TimePrediction& t = p.time;
        ASSERT_EQ(t.stage_busy_s.size(), 2u);
        const double b0 = t.stage_busy_s[0], b1 = t.stage_busy_s[1];
        EXPECT_GT(b1, b0);
        const double span = m == 1 ? b0 + b1 : b1 + b0 / m;
        expect_rel(t.pipeline_span_s, span, 1e-9, "span");
      }
}

// The replay's units per stage: a layer's forward 1, backward 2, and with recompute 3 (its forward again);
// the head by its FLOPs, h = 2CV / (24C^2 + 4TC) blocks, forward 1 and backward 2, never recomputed.
TEST(PlanTime, PipelineReplayUnits) {
  const ClusterSpec c = cluster();
  const double C = 128, V = 8192, T = 32, m = 4, h = 2 * C * V / (24 * C * C + 4 * T * C);
  for (bool recompute : {false, true}) {
    SCOPED_TRACE(recompute ? "recompute" : "no recompute");
    const Prediction p =
        plan({"model.layers=4", "model.d_model=128", "model.vocab=8192", "parallel.pp=2", "train.micro_batches=4",
              std::string("model.recompute=") + (recompute ? "true" : "false")},
             c);
    ASSERT_EQ(p.time.stage_units.size(), 2u);
    const double per_layer = recompute ? 4 : 3;
    expect_rel(p.time.stage_units[0], m * 2 * per_layer, 1e-12, "first stage");
    expect_rel(p.time.stage_units[1], m * (2 * per_layer + 3 * h), 1e-12, "last stage");
  }
}

// Tensor parallelism over t ranks (Megatron's split): a rank holds 1/t of every block matrix, of the
// column-parallel biases (qkv 3C, fc 4C) and of the vocabulary-parallel wte, and all of the row-parallel
// biases (2C), the LayerNorms (4C), wpe and ln_f. Its products are 1/t of the FLOPs, at the efficiency of
// width C / sqrt(t); its attention 1/t of the FLOPs.
TEST(PlanTime, TensorParallelSplit) {
  ClusterSpec c = cluster();
  ASSERT_EQ(MatmulEfficiency::parse("32:0.25 128:1", &c.efficiency_fp32), "");
  const double C = 64, t = 2;
  const Prediction p = plan({"parallel.tp=2"}, c);
  ASSERT_EQ(p.ranks.size(), 2u);
  const std::int64_t held = 2 * (12 * 64 * 64 / 2 + 7 * 64 / 2 + 6 * 64) + 64 * 64 / 2 + 32 * 64 + 2 * 64;
  for (const RankPrediction& r : p.ranks) EXPECT_EQ(r.params_held, held);
  const Hand h;
  const double eff = 0.25 + 0.75 * 0.25;  // log(64 / sqrt(2) / 32) / log(128 / 32) = 1/4 of the way
  EXPECT_NEAR(c.efficiency_fp32.at(C / std::sqrt(t)), eff, 1e-12);
  expect_rel(p.time.matmul_s, h.matmul_flops() / t / (eff * c.peak_flops_fp32), kRel, "products");
  expect_rel(p.time.attention_s, h.attention_flops() / t / c.attention_flops, kRel, "attention");
}

// The tp group's bytes per step, as a run measures them (summary.json comm.tp, 13 all-reduces of 1320960
// bytes per step for this deck at tp 2): per micro-batch 4 all-reduces of [B T, C] fp32 per layer (attention
// and MLP, forward and backward), the vocabulary-parallel embedding's partial sums (forward), the head's input
// gradient (backward), and the cross-entropy's three [B T] collectives (one fp32, two fp64), each 2(t-1)/t
// of its bytes.
TEST(PlanTime, TensorParallelActivationAllReduces) {
  const ClusterSpec c = cluster();
  const double L = 2, C = 64, T = 32, t = 2;
  const Prediction p = plan({"parallel.tp=2"}, c);
  const Hand h;
  double tp_s = 0;
  for (const auto& [group, sec] : p.time.comm_by_group)
    if (group == "tp") tp_s = sec;
  const double N = h.B * T, ring = 2 * (t - 1) / t;
  const double bytes = (4 * L + 2) * ring * 4 * N * C + ring * (4 * N + 2 * 8 * N);
  EXPECT_EQ(bytes, 1320960.0);
  expect_rel(tp_s * c.intra_bytes_per_s, bytes, 1e-9, "tp bytes");
}

// ---------------------------------------------------------------------------------------------
// Refusals and edges

namespace {
std::string refusal(const std::vector<std::string>& sets) {
  try {
    plan(sets);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(PlanRefusals, LayoutsThatCannotRun) {
  // dp 3 does not split a batch of 16; tp 3 does not split 4 heads; pp 3 does not split 2 layers;
  // 3 micro-batches do not split 16 rows.
  const auto says = [](const std::string& text, const std::string& a, const std::string& b) {
    return text.find(a) != std::string::npos && text.find(b) != std::string::npos;
  };
  const std::string dp = refusal({"parallel.dp=3"});
  EXPECT_TRUE(says(dp, "train.batch = 16", "parallel.dp = 3")) << dp;
  const std::string tp = refusal({"parallel.tp=3"});
  EXPECT_TRUE(says(tp, "parallel.tp = 3", "model.heads = 4")) << tp;
  const std::string pp = refusal({"parallel.pp=3"});
  EXPECT_TRUE(says(pp, "parallel.pp = 3", "model.layers = 2")) << pp;
  const std::string mb = refusal({"train.micro_batches=3"});
  EXPECT_TRUE(says(mb, "train.batch = 16", "train.micro_batches = 3")) << mb;
}

TEST(PlanRefusals, GroupsInsideANode) {
  // Ranks are placed tp fastest, then dp, then pp: a tp group spans tp ranks, a dp group tp x dp.
  const Layout l{2, 4, 2};  // dp 2, tp 4, pp 2
  EXPECT_TRUE(group_in_node("tp", l, 4));
  EXPECT_FALSE(group_in_node("dp", l, 4));
  EXPECT_TRUE(group_in_node("dp", l, 8));
  EXPECT_FALSE(group_in_node("pp", l, 8));
  EXPECT_TRUE(group_in_node("pp", l, 16));
}

int main(int argc, char** argv) {
  select_openblas_core(argv);
  ::testing::InitGoogleTest(&argc, argv);
  Kokkos::ScopeGuard kokkos(argc, argv);
  return RUN_ALL_TESTS();
}
