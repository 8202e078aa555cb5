#include "driver/plan/predict.hpp"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>

#include <mpi.h>

#include <nlohmann/json.hpp>

#include "core/base/error.hpp"
#include "core/model/gpt.hpp"
#include "core/comm/grid.hpp"
#include "driver/commands.hpp"

namespace loom {
namespace {

std::array<double, kMemCategories> ledger_now() {
  std::array<double, kMemCategories> b{};
  for (int i = 0; i < kMemCategories; ++i)
    b[static_cast<std::size_t>(i)] = static_cast<double>(Ledger::global().current(static_cast<Mem>(i)));
  return b;
}

// Rank `rank` of the deck's layout, built as `loom run` builds it (make_pre_model_roles, the GPT,
// assemble_roles, the engine) on the sizing back end and a planned grid: what it allocates is the
// ledger's difference; then each role adds what its step takes.
RankPrediction predict_rank(const Deck& deck, const LayoutPlan& plan, const std::string& backend, int rank,
                            int per_node, EngineConfig ec, double& flops_per_token) {
  RankPrediction r;
  r.rank = rank;
  const std::array<double, kMemCategories> before = ledger_now();
  {
    std::unique_ptr<Backend> be =
        backend == "cuda" ? make_cuda_sizing_backend() : make_sizing_backend(make_host_backend(1));
    std::unique_ptr<ProcessGrid> grid = ProcessGrid::planned(plan.layout, rank, per_node);
    r.dp_rank = grid->dp_rank();
    r.tp_rank = grid->tp_rank();
    r.pp_rank = grid->pp_rank();
    r.cp_rank = grid->cp_rank();
    PreModelRoles pre = make_pre_model_roles(deck, plan.strategies, *grid, *be, plan.model);
    GPT model(plan.model, *be, plan.rows_per_micro, pre.partition.get(), pre.stage, pre.store.get(),
              plan.layout.replicas(), grid->replica_rank(), pre.context.get(), pre.experts.get());
    AssembledRoles roles = assemble_roles(deck, plan.strategies, *grid, model, *be, ec, false);
    Engine engine(ec, model, *be, std::move(roles.engine));
    const std::array<double, kMemCategories> built = ledger_now();
    for (int i = 0; i < kMemCategories; ++i)
      r.built[static_cast<std::size_t>(i)] = built[static_cast<std::size_t>(i)] - before[static_cast<std::size_t>(i)];
    r.params_held = model.num_params();
    r.layers = 0;
    for (const Stage::Chunk& c : model.stage().chunks) r.layers += c.end_layer - c.first_layer;
    r.first = model.stage().first();
    r.last = model.stage().last();
    r.sequence_parallel = model.partition().sequence_parallel();
    r.precision = dtype_name(be->precision().matmul);
    const StateSharding sh = engine.grad_sync().state_sharding();
    r.state_parts_split = (sh.weights ? 1 : 0) + (sh.grads ? 1 : 0) + (sh.optimizer ? 1 : 0);
    flops_per_token = model.flops_per_token();
    r.step = plan_rank_step(ec, model, engine, roles.reducer.get());
    r.scratch = r.step.scratch;
  }
  for (int i = 0; i < kMemCategories; ++i) {
    r.peak[static_cast<std::size_t>(i)] = r.built[static_cast<std::size_t>(i)] + r.scratch[static_cast<std::size_t>(i)];
    r.total += r.peak[static_cast<std::size_t>(i)];
  }
  return r;
}

double matmul_peak(const ClusterSpec& c, const std::string& precision) { return c.matmul_peak(precision); }

// Compute per step of rank `r` (see DESIGN.md "Planning"), counted by the functions of driver/plan/cost_model.hpp
// that `loom plan --calibrate` measured the rates with: a block's products (block_counts: FLOPs at the
// precision's rate at the block's width, d_model / sqrt(tp) on a rank holding 1/tp of it, the head's
// product at the same rate; plus matmul_call_us per GEMM), attention (attention_flops at
// attention_tflops plus attention_head_us per sequence and head; with model.attention = flash the
// cluster's flash_attention_ figures where it has them), element-wise kernels as bytes over
// memory_gbs, the optimizer's pass as bytes over optimizer_gbs, the strategies' own host passes
// (StepPlan::host_bytes: compression, replica hashes) over host_gbs and, where the devices are not the
// host, their copies between device and host (host_copy_bytes) over host_link_gbs; their passes through the
// back end's kernels (backend_bytes: int8 and PowerSGD compression) over memory_gbs. Recompute runs the blocks' forward
// again. Fills the compute fields of `t`.
void predict_compute(const Prediction& p, const RankPrediction& r, const ClusterSpec& c, TimePrediction& t) {
  const GPTConfig& m = p.plan.model;
  const Layout& l = p.plan.layout;
  const double tp = l.tp, C = m.d_model, T = m.seq_len, V = m.vocab, cp = l.cp;
  // Context parallelism: each rank holds T / cp tokens of a row, and 1/cp of its causal attention.
  const double rows = p.plan.rows_per_micro, N = rows * T / cp, mb = p.plan.micro_batches;
  const double layers_here = r.layers;
  const bool last = r.last, first = r.first, sp = r.sequence_parallel;
  const double Nl = sp ? N / tp : N;
  const double recompute = m.recompute ? 1.0 : 0.0;
  const double kv_held = m.kv() % l.tp == 0 ? m.kv() / tp : m.kv();  // Llama's kv heads on a rank
  const BlockCounts b =
      m.llama() ? llama_block_counts(N, Nl, C, tp, kv_held * m.head_size(), m.ffn()) : block_counts(N, Nl, C, tp);
  // Products: 2 flops per multiply-add, backward twice the forward; the head's [N,C]x[C,V/tp] once
  // forward (one GEMM), twice backward (two).
  const double head_mm = last ? 2.0 * N * V * C / tp : 0.0;
  const double mm_flops =
      mb * (layers_here * (b.matmul_flops_fwd * (1.0 + recompute) + b.matmul_flops_bwd) + 3.0 * head_mm);
  const double gemms = mb * (layers_here * (b.gemms_fwd * (1.0 + recompute) + b.gemms_bwd) + (last ? 3.0 : 0.0));
  // Attention: forward + backward over this rank's heads (heads / tp), the forward a third of it
  // (FLOPs and fixed cost alike), again with recompute; the fused attention's forward 2 of its 7
  // products (its backward makes the scores again: 5), at its own rate where the cluster measured it.
  const bool flash = priced_as_flash(m, c);
  const double att_share = 1.0 + recompute * (flash ? 2.0 / 7.0 : 1.0 / 3.0);
  const double att_flops = mb * layers_here * attention_flops(rows, T, C / tp) * att_share / cp;
  const double att_heads = mb * layers_here * rows * (m.heads / tp) * att_share;
  // Element-wise: the blocks' (block_counts), the head's LayerNorm and cross-entropy over its logits,
  // the embedding's lookup and gradient.
  using KB = KernelBytes;
  const double head_bytes =
      last ? KB::crossentropy * N * V / tp + (KB::layernorm_fwd + KB::layernorm_bwd) * Nl * C : 0.0;
  const double emb_bytes = first ? KB::embedding * N * C : 0.0;
  const double ew_bytes = mb * (layers_here * (b.elementwise_bytes_fwd * (1.0 + recompute) + b.elementwise_bytes_bwd) +
                                head_bytes + emb_bytes);
  // The optimizer's pass: the gradients this rank holds zeroed, the elements it updates (AdamW's two
  // moments are the optimizer category's 8 bytes per element) normed, clipped and updated.
  const double grads = r.built[static_cast<int>(Mem::grads)] / 4.0;
  const double owned = r.built[static_cast<int>(Mem::optimizer)] / 8.0;
  t.matmul_s = mm_flops / c.matmul_rate(p.precision, C / std::sqrt(tp)) + gemms * c.matmul_call_s;
  t.attention_s = flash ? att_flops / c.flash_attention_flops + att_heads * c.flash_attention_head_s
                        : att_flops / c.attention_flops + att_heads * c.attention_head_s;
  t.elementwise_s = ew_bytes / c.memory_bytes_per_s;
  t.optimizer_s = optimizer_bytes(grads, owned) / c.optimizer_bytes_per_s;
  t.strategies_s = r.step.host_bytes / c.host_bytes_per_s + r.step.backend_bytes / c.memory_bytes_per_s +
                   (c.host_link_bytes_per_s > 0 ? r.step.host_copy_bytes / c.host_link_bytes_per_s : 0.0);
  t.compute_s = t.matmul_s + t.attention_s + t.elementwise_s + t.optimizer_s + t.strategies_s;
}

// Each pipeline stage's busy time: the slowest of its ranks' forward + backward compute (empty
// without a pipeline). Once per prediction: every rank's replay takes the same stages' times.
std::vector<double> stage_busy(const Prediction& p, const ClusterSpec& c) {
  if (p.plan.layout.pp <= 1) return {};
  std::vector<double> busy(static_cast<std::size_t>(p.plan.layout.pp), 0.0);
  for (const RankPrediction& q : p.ranks) {
    TimePrediction tq;
    predict_compute(p, q, c, tq);
    double& seconds = busy.at(static_cast<std::size_t>(q.pp_rank));
    seconds = std::max(seconds, tq.compute_s - tq.optimizer_s);
  }
  return busy;
}

// The step of rank `r`: its compute (predict_compute), its messages over the links, and with a
// pipeline the schedule's bubble (the stages' busy times: stage_busy).
void predict_time(Prediction& p, const RankPrediction& r, const ClusterSpec& c, double flops_per_token,
                  const std::vector<double>& stages_busy) {
  const Layout& l = p.plan.layout;
  const double T = p.plan.model.seq_len, mb = p.plan.micro_batches;
  TimePrediction& t = p.time;
  t = TimePrediction();
  predict_compute(p, r, c, t);
  // Messages: ring volume over the group's link, plus its latency per message.
  double overlapped = 0, exposed = 0, ring = 0;
  std::map<std::string, double> by_group, exposed_by, overlapped_by, bytes_by;
  bool syncs_in_step = false;
  for (const CommCost& k : r.step.comm) {
    syncs_in_step = syncs_in_step || k.in_step;
    const bool in_node = group_in_node(k.group, l, c.devices_per_node);
    const double bw = in_node ? c.intra_bytes_per_s : c.inter_bytes_per_s;
    const double lat = in_node ? c.intra_latency_s : c.inter_latency_s;
    const double s = k.bytes / bw + k.messages * lat;
    const bool hides = comm_hides(k, l, c);
    by_group[k.group] += s;
    bytes_by[k.group] += k.bytes;
    if (k.overlapped && k.group == "cp") ring += s;  // the ring's blocks: travelling while a hop computes
    if (hides && k.group == "cp") continue;          // priced against the attention below
    (hides ? overlapped : exposed) += s;
    (hides ? overlapped_by : exposed_by)[k.group] += s;
  }
  // cp - 1 of the cp hops' attention (the last has nothing more to receive) hide the block transfers,
  // where the links move them without the cores (comm_hides); otherwise they are exposed, above.
  t.ring_s = ring;
  const bool ring_hides = ring > 0 && comm_hides(CommCost{"cp", "", 0, 0, true, true}, l, c);
  t.ring_hidden_behind_s = ring_hides ? t.attention_s * (l.cp - 1) / l.cp : 0.0;
  const double ring_exposed = ring_hides ? std::max(0.0, ring - t.ring_hidden_behind_s) : 0.0;
  exposed += ring_exposed;
  if (ring > 0) exposed_by["cp"] += ring_exposed;
  // Overlapped messages hide behind the last micro-batch's backward (about 2/3 of its compute).
  const double backward_last = (t.compute_s - t.optimizer_s) / mb * 2.0 / 3.0;
  const double unhidden = std::max(0.0, overlapped - backward_last);
  t.comm_s = overlapped + exposed + (ring_hides ? ring - ring_exposed : 0.0);
  t.comm_exposed_s = exposed + unhidden;
  t.comm_by_group.assign(by_group.begin(), by_group.end());
  t.comm_bytes_by_group.assign(bytes_by.begin(), bytes_by.end());
  // Each group's exposed part: its messages that do not overlap, and its share of what overlap leaves.
  for (const auto& [g, sec] : overlapped_by) exposed_by[g] += sec / overlapped * unhidden;
  t.comm_exposed_by_group.assign(exposed_by.begin(), exposed_by.end());
  // The pipeline's span: the schedule's own replay (StepPlan::pipeline_span) with each stage's ops
  // at that stage's predicted time per unit (its busy time, the slowest of its ranks, over its
  // StepPlan::stage_units: forward 1, backward 2 per layer (3 with recompute), the head by its FLOPs), so that a
  // stage's warm-up and cool-down ops cost what that stage's work is predicted to cost.
  double busy = t.compute_s - t.optimizer_s;
  t.bubble = 0;
  if (l.pp > 1 && r.step.pipeline_span) {
    t.stage_busy_s = stages_busy;
    t.stage_units = r.step.stage_units;
    std::vector<double> per_unit(t.stage_busy_s.size());
    for (std::size_t s = 0; s < per_unit.size(); ++s) per_unit[s] = t.stage_busy_s[s] / r.step.stage_units.at(s);
    const double span = t.pipeline_span_s = r.step.pipeline_span(per_unit);
    t.bubble = busy < span ? 1.0 - busy / span : 0.0;  // this rank's idle share of the span
    busy = std::max(span, busy);
  }
  // A rank that synchronises with its group between kernels waits, at each synchronisation, for the
  // group's slowest rank: where ranks run the same kernels in varying times (shared cores, a virtual
  // machine's neighbours) that is a share of its compute (measured by --calibrate in groups of 2,
  // ~1 ms apart; assumed the same for every group size and spacing, DESIGN.md "Planning"); 0 on
  // devices that run a kernel in the same time every time.
  t.sync_wait_s = syncs_in_step ? c.sync_wait_share * (t.compute_s - t.optimizer_s) : 0.0;
  t.step_s = busy + t.optimizer_s + t.comm_exposed_s + t.sync_wait_s;
  t.tokens_per_s = p.plan.global_batch * T / t.step_s;
  t.mfu = t.tokens_per_s * flops_per_token / (l.ranks() * matmul_peak(c, p.precision));
}

std::string mib_or_gib(double b) { return format_bytes(b, ByteStyle::mib_gib); }

// A rate readable at any size: 989.0 TFLOP/s, 47.3 GFLOP/s (a CPU's figure is not rounded to 0.0).
std::string flops_text(double flops) {
  char buf[48];
  if (flops >= 1e12)
    std::snprintf(buf, sizeof buf, "%.1f TFLOP/s", flops / 1e12);
  else
    std::snprintf(buf, sizeof buf, "%.1f GFLOP/s", flops / 1e9);
  return buf;
}

// A span of time in the unit that reads best: 84.2 ms, 12.5 s, 7.3 min, 2.4 h.
std::string span_text(double s) {
  char buf[48];
  if (s < 0.01)
    std::snprintf(buf, sizeof buf, "%.3f ms", s * 1e3);
  else if (s < 1)
    std::snprintf(buf, sizeof buf, "%.1f ms", s * 1e3);
  else if (s < 120)
    std::snprintf(buf, sizeof buf, "%.1f s", s);
  else if (s < 7200)
    std::snprintf(buf, sizeof buf, "%.1f min", s / 60);
  else
    std::snprintf(buf, sizeof buf, "%.1f h", s / 3600);
  return buf;
}

}  // namespace

bool comm_hides(const CommCost& k, const Layout& l, const ClusterSpec& c) {
  return k.overlapped && !(c.host_link_bytes_per_s <= 0 && group_in_node(k.group, l, c.devices_per_node));
}

bool group_in_node(const std::string& group, const Layout& l, int per_node) {
  int span = l.ranks();
  if (group == "tp")
    span = l.tp;
  else if (group == "cp")
    span = l.tp * l.cp;
  else if (group == "dp")  // the gradient group: dp x cp
    span = l.tp * l.cp * l.dp;
  return span <= per_node;
}

std::string planned_backend(const Deck& deck, const ClusterSpec& cluster) {
  const std::string b = deck.get_string("run.backend");
  return b == "cuda" || (b == "auto" && cluster.host_link_bytes_per_s > 0) ? "cuda" : "host";
}

namespace {
// Memory: each rank of the layout built on the sizing back end (every_rank = false: the first and last
// of each tp and dp group on every stage); the largest per category and in total. Returns the
// model's FLOPs per token for the time prediction.
// The ranks to build: all, or the search's shortcut. The ranks of a tp or dp group build the same
// shapes (tp divides the model exactly, ZeRO pads its shares to equal size); where anything differs
// it is at a group's end (tp-replicated tensors' owned slices on tp rank 0), so the first and last of
// each group on every stage stand for the rest. regression/plan_search_checks.py holds it to every
// rank built.
std::vector<int> ranks_to_build(const Layout& l, bool every_rank) {
  std::vector<int> ranks;
  for (int rank = 0; rank < l.ranks(); ++rank) {
    const Layout::Coords at = l.coords_of(rank);
    if (!every_rank && at.tp != 0 && at.tp != l.tp - 1) continue;
    if (!every_rank && at.dp != 0 && at.dp != l.dp - 1) continue;
    if (!every_rank && at.cp != 0 && at.cp != l.cp - 1) continue;
    ranks.push_back(rank);
  }
  return ranks;
}

double predict_ranks(Prediction& p, const Deck& deck, int devices_per_node, const std::vector<int>& ranks) {
  p.steps = deck.get_int("train.steps");
  EngineConfig ec;
  ec.micro_batches = p.plan.micro_batches;
  ec.rows_per_micro = p.plan.rows_per_micro;
  double fpt = 0;
  for (int rank : ranks) {
    if (rank < 0 || rank >= p.plan.layout.ranks()) continue;
    p.ranks.push_back(predict_rank(deck, p.plan, p.backend, rank, devices_per_node, ec, fpt));
    const RankPrediction& r = p.ranks.back();
    p.zero_stage = r.state_parts_split;
    p.precision = r.precision == "f32" ? "fp32" : r.precision == "f16" ? "fp16" : r.precision;
    for (int i = 0; i < kMemCategories; ++i)
      p.peak[static_cast<std::size_t>(i)] =
          std::max(p.peak[static_cast<std::size_t>(i)], r.peak[static_cast<std::size_t>(i)]);
    if (r.total > p.peak_total) {
      p.peak_total = r.total;
      p.worst_rank = rank;
    }
  }
  return fpt;
}
}  // namespace

// model.attention = auto as a run of `backend` resolves it (GPT::resolve_attention): a planned cuda
// run is assumed to have cuDNN, so cudnn where its shape rules allow, else flash, else unfused; on the
// host, unfused.
static void resolve_planned_attention(GPTConfig& m, const std::string& backend, int cp) {
  if (m.attention != "auto") return;
  const int hs = m.d_model / m.heads;
  if (backend != "cuda")
    m.set_attention("unfused");
  else if (cp == 1 && cudnn_shape_refusal(m.seq_len, hs).empty())  // cuDNN's cannot ring
    m.set_attention("cudnn");
  else
    m.set_attention(math::flash_head_size_supported(hs) ? "flash" : "unfused");
}

Prediction predict_memory(const Deck& deck, const StrategyRegistry& registry, const std::string& backend,
                          int devices_per_node, const std::vector<int>& ranks) {
  Prediction p;
  p.plan = plan_layout(deck, registry, -1);
  p.backend = backend;
  resolve_planned_attention(p.plan.model, p.backend, p.plan.layout.cp);
  predict_ranks(p, deck, devices_per_node, ranks.empty() ? ranks_to_build(p.plan.layout, false) : ranks);
  return p;
}

Prediction predict(const Deck& deck, const StrategyRegistry& registry, const ClusterSpec& cluster, bool every_rank) {
  Prediction p;
  p.plan = plan_layout(deck, registry, -1);
  p.backend = planned_backend(deck, cluster);
  resolve_planned_attention(p.plan.model, p.backend, p.plan.layout.cp);
  const double fpt = predict_ranks(p, deck, cluster.devices_per_node, ranks_to_build(p.plan.layout, every_rank));
  // The step waits for its slowest rank.
  TimePrediction slowest;
  const std::vector<double> stages_busy = stage_busy(p, cluster);
  for (const RankPrediction& r : p.ranks) {
    predict_time(p, r, cluster, fpt, stages_busy);
    if (p.time.step_s > slowest.step_s) slowest = p.time;
  }
  p.time = slowest;
  return p;
}

bool priced_as_flash(const GPTConfig& model, const ClusterSpec& cluster) {
  return model.flash_attention && cluster.flash_attention_flops > 0;
}

std::string prediction_json(const Prediction& p, const ClusterSpec& cluster) {
  auto mem = [](const std::array<double, kMemCategories>& b, double total) {
    nlohmann::json j;
    for (int i = 0; i < kMemCategories; ++i)
      j[mem_name(static_cast<Mem>(i))] = static_cast<std::int64_t>(b[static_cast<std::size_t>(i)]);
    j["total"] = static_cast<std::int64_t>(total);
    return j;
  };
  nlohmann::json by_rank = nlohmann::json::array();
  for (const RankPrediction& r : p.ranks) by_rank.push_back(mem(r.peak, r.total));
  nlohmann::json comm_bytes = nlohmann::json::object();
  for (const auto& [g, bytes] : p.time.comm_bytes_by_group) comm_bytes[g] = bytes;
  nlohmann::json stage_ms = nlohmann::json::array();
  for (double sec : p.time.stage_busy_s) stage_ms.push_back(sec * 1e3);
  const Layout& l = p.plan.layout;
  nlohmann::json j = {{"layout", {{"dp", l.dp}, {"tp", l.tp}, {"pp", l.pp}, {"cp", l.cp}}},
                      {"micro_batches", p.plan.micro_batches},
                      {"precision", p.precision},
                      {"backend", p.backend},
                      {"zero_stage", p.zero_stage},
                      {"recompute", p.plan.model.recompute},
                      {"cluster", cluster.name},
                      {"mem_peak_bytes", mem(p.worst().peak, p.peak_total)},
                      {"mem_peak_bytes_by_rank", by_rank},
                      {"device_memory_bytes", cluster.device_memory_bytes},
                      {"fits", p.peak_total <= cluster.device_memory_bytes},
                      {"step_ms", p.time.step_s * 1e3},
                      {"steps", p.steps},
                      {"run_s", p.time.step_s * static_cast<double>(p.steps)},
                      {"compute_ms", p.time.compute_s * 1e3},
                      {"attention_ms", p.time.attention_s * 1e3},
                      {"attention", p.plan.model.attention},
                      {"attention_priced_as", priced_as_flash(p.plan.model, cluster) ? "flash" : "unfused"},
                      {"comm_ms", p.time.comm_s * 1e3},
                      {"comm_exposed_ms", p.time.comm_exposed_s * 1e3},
                      {"comm_bytes_by_group", comm_bytes},
                      {"sync_wait_ms", p.time.sync_wait_s * 1e3},
                      {"ring_ms", p.time.ring_s * 1e3},
                      {"ring_hidden_behind_ms", p.time.ring_hidden_behind_s * 1e3},
                      {"bubble", p.time.bubble},
                      {"stage_busy_ms", stage_ms},
                      {"stage_units", p.time.stage_units},
                      {"pipeline_span_ms", p.time.pipeline_span_s * 1e3},
                      {"tokens_per_s", p.time.tokens_per_s},
                      {"mfu", p.time.mfu}};
  return j.dump(2) + "\n";
}

std::string describe_prediction(const Prediction& p, const ClusterSpec& cluster) {
  std::ostringstream s;
  const Layout& l = p.plan.layout;
  s << "plan: " << l.describe() << " = " << l.ranks() << " device(s), " << p.plan.micro_batches
    << " micro-batch(es) of " << p.plan.rows_per_micro << " sequence(s), " << p.precision
    << (p.zero_stage ? ", ZeRO stage " + std::to_string(p.zero_stage) : std::string())
    << (p.plan.model.recompute ? ", recompute" : "") << ", " << p.backend << " back end\n  on " << cluster.name << "\n";
  s << "memory per rank (the ledger's categories; built = allocated when the run is set up, step = taken during a "
       "step):\n";
  s << (l.cp > 1 ? "  rank  coords(dp,cp,tp,pp)" : "  rank  coords(dp,tp,pp)");
  for (int i = 0; i < kMemCategories; ++i) s << std::setw(13) << mem_name(static_cast<Mem>(i));
  s << std::setw(13) << "total"
    << "\n";
  for (const RankPrediction& r : p.ranks) {
    s << "  " << std::setw(4) << r.rank << "  (" << r.dp_rank << ","
      << (l.cp > 1 ? std::to_string(r.cp_rank) + "," : std::string()) << r.tp_rank << "," << r.pp_rank << ")          ";
    for (int i = 0; i < kMemCategories; ++i) s << std::setw(13) << mib_or_gib(r.peak[static_cast<std::size_t>(i)]);
    s << std::setw(13) << mib_or_gib(r.total) << "\n";
  }
  const double cap = cluster.device_memory_bytes;
  s << "  largest rank " << p.worst_rank << ": " << mib_or_gib(p.peak_total) << " of " << mib_or_gib(cap) << " ("
    << (p.peak_total <= cap ? "fits" : "out of memory by " + mib_or_gib(p.peak_total - cap)) << ")\n";
  const TimePrediction& t = p.time;
  s << std::fixed << std::setprecision(3);
  s << "step time (slowest rank): " << t.step_s * 1e3 << " ms = compute " << t.compute_s * 1e3 << " ms (products "
    << t.matmul_s * 1e3 << ", attention " << t.attention_s * 1e3 << ", element-wise " << t.elementwise_s * 1e3
    << ", AdamW " << t.optimizer_s * 1e3;
  if (t.strategies_s > 0) s << ", strategies' host passes and copies " << t.strategies_s * 1e3;
  s << ")";
  if (t.bubble > 0) s << " / (1 - bubble " << std::setprecision(3) << t.bubble << ")";
  s << " + exposed communication " << t.comm_exposed_s * 1e3 << " ms (of " << t.comm_s * 1e3 << " ms";
  for (const auto& [g, sec] : t.comm_by_group) s << "; " << g << " " << sec * 1e3;
  s << ")";
  if (t.sync_wait_s > 0) s << " + waits for the group's slowest rank " << t.sync_wait_s * 1e3 << " ms";
  s << "\n";
  if (p.plan.model.flash_attention)
    s << (priced_as_flash(p.plan.model, cluster) ? "  attention fused (model.attention = " + p.plan.model.attention +
                                                       "), at the cluster's flash_attention_tflops\n"
                                                 : "  attention fused (model.attention = " + p.plan.model.attention +
                                                       "), priced as the unfused kernels: the cluster gives no "
                                                       "flash_attention_tflops (loom plan --calibrate measures it)\n");
  if (l.cp > 1)
    s << "  context parallel: a ring of " << l.cp << " ranks; its key/value blocks take " << t.ring_s * 1e3
      << " ms a step on the links, ";
  if (l.cp > 1 && t.ring_hidden_behind_s > 0)
    s << "against " << t.ring_hidden_behind_s * 1e3 << " ms of attention they travel behind ("
      << (t.ring_s <= t.ring_hidden_behind_s ? "hidden" : "not all hidden") << ")";
  else if (l.cp > 1)
    s << "exposed (on this cluster in-node messages are copied by the cores that compute)";
  if (l.cp > 1)
    s << "; each rank holds " << p.plan.model.seq_len / l.cp << " of " << p.plan.model.seq_len
      << " tokens of a sequence\n";
  const GPTConfig& m = p.plan.model;
  if (m.experts > 0) {
    const double all = m.moe_layers() * m.experts * m.expert_params(), active = all * m.top_k() / m.experts;
    s << std::setprecision(3) << "  experts: " << m.experts << " per block in " << m.moe_layers() << " of " << m.layers
      << " blocks, top-" << m.top_k() << ": of their " << all / 1e6 << " M parameters " << active / 1e6
      << " M reach a token; MFU counts what a token's experts compute: " << m.flops_per_token(true) / 1e6
      << " MFLOP a token (all experts: " << m.flops_per_token(false) / 1e6 << ")\n";
  }
  if (t.stage_busy_s.size() > 1) {
    s << "  pipeline stages' forward + backward (each the slowest of its ranks):";
    for (std::size_t i = 0; i < t.stage_busy_s.size(); ++i) s << (i ? ", " : " ") << t.stage_busy_s[i] * 1e3 << " ms";
    s << "\n";
  }
  s << std::setprecision(0) << "  " << t.tokens_per_s << " tokens/s, MFU " << std::setprecision(1) << 100.0 * t.mfu
    << "% of " << l.ranks() << " x " << flops_text(matmul_peak(cluster, p.precision)) << " (" << p.precision << ")\n";
  s << "  the run: " << p.steps << " steps (train.steps) x " << span_text(t.step_s) << " = "
    << span_text(t.step_s * static_cast<double>(p.steps))
    << " of training steps (evaluation, checkpoints and start-up not counted)\n";
  if (p.backend == "host" && cluster.host_link_bytes_per_s > 0)
    s << "  NOTE: this deck runs on the host back end (run.backend), but " << cluster.name << " is a cluster of GPUs: "
      << "the figures above price its devices, not this host; `loom plan --calibrate` measures this machine\n";
  return s.str();
}

}  // namespace loom
