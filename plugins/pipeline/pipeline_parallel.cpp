// The `pipeline` strategy plugin (libloom_pipeline.so): pipeline parallelism. Fills the layer half
// of the partition role (which contiguous blocks each of the parallel.pp stages holds; the first
// stage also the embeddings, the last ln_f, the tied head and the loss) and the schedule role (in
// what order each stage runs the forwards and backwards of the step's micro-batches):
//   gpipe  all forwards, then all backwards: a stage holds the activations of all m micro-batches;
//   1f1b   warm-up forwards, then one forward / one backward, then cool-down backwards
//          (PipeDream-flush): stage i holds at most p - i micro-batches.
// Activations travel to the next stage and their gradients back by asynchronous send/recv on the pp
// communicator: the receive of micro-batch k+1 is posted before micro-batch k is computed, sends do
// not block. The tied embedding's gradient is summed between the first and last stage. Every
// stage times its forward, backward, send, receive-wait and data intervals; the measured bubble
// (the share of the pipeline's span, its longest stage's, that a stage spends not computing,
// averaged over stages) goes in the metrics next to the textbook (p-1)/(m+p-1) and next to the
// bubble the schedule leaves with the step's measured op times and free communication (a replay),
// and pipeline.trace writes the intervals of every rank as a Chrome-trace timeline.

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "core/base/buffer.hpp"
#include "core/base/clock.hpp"
#include "core/comm/comm.hpp"
#include "core/base/error.hpp"
#include "core/comm/fault.hpp"
#include "core/comm/grid.hpp"
#include "core/base/ledger.hpp"
#include "core/engine/plugin.hpp"
#include "plugins/pipeline/schedule.hpp"

namespace loom {
namespace {

using pipeline::activation_slots;
using pipeline::Kind;
using pipeline::Op;
using pipeline::replay_span;
using pipeline::stage_order;

// ---- layers to stages ---------------------------------------------------------------------------

std::string example_list(int L, int pp) {
  std::string s;
  for (int i = 0; i < pp; ++i) s += (i ? "," : "") + std::to_string(L / pp + (i < L % pp ? 1 : 0));
  return s;
}

// Layer counts per model chunk for pipeline.partition = uniform | balanced | "n0,n1,...": pp chunks,
// or pp x v with v virtual stages (chunk j of stage i is model chunk j pp + i). Throws InputError
// naming the keys and what would work.
std::vector<int> stage_layers(const std::string& spec, const GPTConfig& m, int stages, int v) {
  const int L = m.layers, pp = stages * v;
  const std::string what = v == 1 ? "parallel.pp = " + std::to_string(stages) + " stages"
                                  : "parallel.pp x pipeline.virtual_stages = " + std::to_string(stages) + " x " +
                                        std::to_string(v) + " = " + std::to_string(pp) + " model chunks";
  if (pp > L)
    throw InputError(what + " is more than model.layers = " + std::to_string(L) +
                     " (every chunk needs a layer); virtual_stages that work with this pp: 1 .. " +
                     std::to_string(std::max(1, L / stages)));
  std::vector<int> counts;
  if (spec == "uniform") {
    // Equal counts; a remainder goes to the earliest stages (the last one carries the head).
    for (int i = 0; i < pp; ++i) counts.push_back(L / pp + (i < L % pp ? 1 : 0));
    return counts;
  }
  if (spec == "balanced") {
    // Contiguous blocks minimising the most expensive stage, the head counted on the last one
    // (dynamic programme over (stages, layers); ties keep more layers on earlier stages).
    const double b = m.block_flops(), h = m.head_flops(), inf = std::numeric_limits<double>::infinity();
    std::vector<std::vector<double>> best(pp + 1, std::vector<double>(L + 1, inf));
    std::vector<std::vector<int>> take(pp + 1, std::vector<int>(L + 1, 0));
    best[0][0] = 0;
    for (int s = 1; s <= pp; ++s)
      for (int l = s; l <= L; ++l)
        for (int k = 1; k <= l - (s - 1); ++k) {
          const double cost = std::max(best[s - 1][l - k], k * b + (s == pp ? h : 0.0));
          if (cost < best[s][l] - 1e-9 * std::abs(cost)) {
            best[s][l] = cost;
            take[s][l] = k;
          }
        }
    counts.assign(pp, 0);
    for (int s = pp, l = L; s >= 1; --s) {
      counts[s - 1] = take[s][l];
      l -= take[s][l];
    }
    return counts;
  }
  std::stringstream list(spec);
  std::string item;
  int sum = 0;
  while (std::getline(list, item, ',')) {
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    while (end && (*end == ' ' || *end == '\t')) ++end;
    if (item.find_first_not_of(" \t") == std::string::npos || !end || *end != '\0' || v < 1)
      throw InputError("pipeline.partition = " + spec + ": '" + item + "' is not a positive layer count; give " +
                       "uniform, balanced, or one count per stage adding up to model.layers, e.g. " +
                       example_list(L, pp));
    counts.push_back(static_cast<int>(v));
    sum += static_cast<int>(v);
  }
  if (static_cast<int>(counts.size()) != pp || sum != L)
    throw InputError("pipeline.partition = " + spec + " gives " + std::to_string(counts.size()) + " stage" +
                     (counts.size() == 1 ? "" : "s") + " with " + std::to_string(sum) + " layers, but " + what +
                     " must hold model.layers = " + std::to_string(L) + ": give " + std::to_string(pp) +
                     " positive counts that add up to " + std::to_string(L) + " (e.g. " + example_list(L, pp) +
                     "), or uniform, or balanced");
  return counts;
}

std::string validate_partition_syntax(const std::string& v) {
  if (v == "uniform" || v == "balanced") return {};
  if (v.empty() || v.find_first_not_of("0123456789, \t") != std::string::npos)
    return "expected uniform, balanced, or a comma-separated list of layer counts per stage (e.g. 3,2,2,1)";
  return {};
}

// ---- the schedule --------------------------------------------------------------------------------

struct Interval {
  const char* kind;  // "forward", "backward", "send", "recv", "data"
  int micro;         // micro-batch, -1 for none
  int chunk;         // virtual stage
  double t0, t1;     // seconds (steady clock)
};

// Per-stage numbers of one step, gathered over the pp group by one all-reduce.
enum Stat {
  kBubble = 0,
  kInflight,
  kActBytes,
  kForwardMs,
  kBackwardMs,
  kRecvMs,
  kSendMs,
  kDataMs,
  kIdleMs,
  kSpanMs,
  kStats
};

class PipelineSchedule final : public Schedule {
 public:
  PipelineSchedule(ProcessGrid& grid, BackendFace& backend, GPT& model, Kind kind, int micro_batches, int rows,
                   bool trace, int trace_steps, std::int64_t total_steps, std::string run_dir, std::vector<int> layers)
      : grid_(grid),
        be_(backend),
        pp_(grid.pp()),
        kind_(kind),
        m_(micro_batches),
        p_(pp_.size()),
        i_(pp_.rank()),
        v_(static_cast<int>(model.stage().chunks.size())),
        first_(i_ == 0),
        last_(i_ == p_ - 1),
        boundary_(model.stage_boundary_floats(rows)),
        trace_(trace),
        trace_steps_(trace_steps),
        total_steps_(total_steps),
        run_dir_(std::move(run_dir)),
        layers_(std::move(layers)) {
    const Stage& st = model.stage();
    if (p_ > 1 && (first_ || last_) && model.config().tied())
      tied_numel_ = model.params()[static_cast<std::size_t>(model.param_index("wte.weight"))].numel();
    bool takes_input = false, takes_gradient = false;
    for (int c = 0; c < v_; ++c) {
      slots_.push_back(st.chunks[c].activation_slots);
      takes_input |= !model.holds_embeddings(c);
      takes_gradient |= !model.holds_head(c);
    }
    // Two buffers each way: the next receive lands in one while the current one is read from the other.
    act_in_ = be_.allocate("Pipeline::activations_in", DType::f32, takes_input ? 2 * boundary_ : 0, Mem::comm);
    grad_in_ = be_.allocate("Pipeline::gradients_in", DType::f32, takes_gradient ? 2 * boundary_ : 0, Mem::comm);
    grad_out_ = be_.allocate("Pipeline::gradients_out", DType::f32, takes_input ? 2 * boundary_ : 0, Mem::comm);
    describe_ = std::string(kind_ == Kind::gpipe ? "gpipe"
                            : v_ > 1             ? "interleaved 1f1b"
                                                 : "1f1b") +
                " over pp " + std::to_string(p_) + (v_ > 1 ? " x " + std::to_string(v_) + " virtual stages" : "") +
                ", " + std::to_string(m_) + " micro-batches; stage " + std::to_string(i_) + " holds layers ";
    for (int c = 0; c < v_; ++c)
      describe_ += (c ? ", " : "") + std::to_string(st.chunks[c].first_layer) + ".." +
                   std::to_string(st.chunks[c].end_layer - 1);
    describe_ += std::string(first_ ? " + embeddings" : "") + (last_ ? " + head" : "") + ", activations of ";
    for (int c = 0; c < v_; ++c) describe_ += (c ? "+" : "") + std::to_string(slots_[c]);
    describe_ += " micro-batch(es); layers per " + std::string(v_ > 1 ? "virtual stage " : "stage ");
    for (std::size_t s = 0; s < layers_.size(); ++s) describe_ += (s ? "," : "") + std::to_string(layers_[s]);
    model_ = &model;
    for (int s = 0; s < p_; ++s) orders_.push_back(stage_order(kind_, m_, p_, s, v_));
    order_ = orders_[i_];
    // The receives this stage makes, in the order it needs them: activations for each forward that
    // does not start at the embeddings, gradients for each backward that does not start at the loss.
    for (const Op& op : order_) {
      if (op.kind == 'F' && !model.holds_embeddings(op.chunk)) act_needs_.push_back(op);
      if (op.kind == 'B' && !model.holds_head(op.chunk)) grad_needs_.push_back(op);
    }
  }
  std::string name() const override { return "pipeline " + describe_; }

  double run(StepContext& ctx) override {
    if (trace_ && traced_ == 0 && !trace_origin_set_) {
      // One time origin for every rank's timeline: on one node the steady clock is shared, so rank
      // 0's reading is exact for all; across nodes, each rank's reading as it leaves a barrier.
      // Through the world communicator, so that a stalled rank meets run.comm_timeout here too.
      grid_.world().barrier();
      trace_origin_ = now();
      double origin0 = trace_origin_;
      grid_.world().broadcast(BufferRef(&origin0, 1), 0);
      if (grid_.nodes() == 1) trace_origin_ = origin0;
      trace_origin_set_ = true;
    }
    // Before micro-batch 0's first op, when the other stages may already wait on this one.
    if (inject_fault("plugin", ctx.step))
      throw std::runtime_error("pipeline plugin: injected fault at step " + std::to_string(ctx.step) +
                               " (LOOM_INJECT_FAULT)");
    events_.clear();
    const double t_start = now();
    begin(true);
    double loss_sum = 0;
    int inflight = 0, inflight_max = 0;
    int backwards = 0;
    // What each op takes on this stage, waits for its input excluded: the replay's durations.
    const std::size_t ops = order_.size();
    std::vector<double> gathered(1 + (kStats + ops) * p_, 0.0);
    double* op_ms = gathered.data() + 1 + kStats * p_ + ops * i_;
    for (std::size_t q = 0; q < ops; ++q) {
      const Op& op = order_[q];
      const std::size_t first_event = events_.size();
      const double t_op = now();
      if (op.kind == 'F') {
        loss_sum += forward(ctx, op.chunk, op.k, true);
        inflight_max = std::max(inflight_max, ++inflight);
      } else {
        backward(ctx, op.chunk, op.k, backwards++);
        --inflight;
      }
      double waited = 0;
      for (std::size_t e = first_event; e < events_.size(); ++e)
        if (events_[e].kind[0] == 'r') waited += events_[e].t1 - events_[e].t0;
      op_ms[q] = (now() - t_op - waited) * 1e3;
      pp_.progress();
    }
    finish_sends();
    const double span = now() - t_start;

    // One all-reduce carries the loss (from the last stage) and every stage's numbers and op times.
    if (last_) gathered[0] = loss_sum / m_;
    double* mine = gathered.data() + 1 + kStats * i_;
    double fwd = 0, bwd = 0, recv = 0, send = 0, data = 0;
    for (const Interval& e : events_) {
      const double d = e.t1 - e.t0;
      if (e.kind[0] == 'f')
        fwd += d;
      else if (e.kind[0] == 'b')
        bwd += d;
      else if (e.kind[0] == 'r')
        recv += d;
      else if (e.kind[0] == 's')
        send += d;
      else if (e.kind[0] == 'd')
        data += d;
    }
    mine[kInflight] = inflight_max;
    mine[kActBytes] = static_cast<double>(Ledger::global().peak(Mem::activations));
    mine[kForwardMs] = fwd * 1e3;
    mine[kBackwardMs] = bwd * 1e3;
    mine[kRecvMs] = recv * 1e3;
    mine[kSendMs] = send * 1e3;
    mine[kDataMs] = data * 1e3;
    mine[kSpanMs] = span * 1e3;
    if (p_ > 1) pp_.all_reduce(gathered.data(), static_cast<std::int64_t>(gathered.size()));
    stats_.assign(gathered.begin() + 1, gathered.begin() + 1 + kStats * p_);
    std::vector<std::vector<double>> all_op_ms(p_);
    for (int s = 0; s < p_; ++s) {
      const double* from = gathered.data() + 1 + kStats * p_ + ops * s;
      all_op_ms[s].assign(from, from + ops);
    }
    bubbles(replay_span(orders_, all_op_ms, m_, v_));
    if (trace_) record_trace(ctx.step);
    return gathered[0];
  }

  double forward_only(StepContext& ctx) override {
    begin(false);
    double loss_sum = 0;
    for (const Op& op : order_) {
      if (op.kind != 'F') continue;  // the training order's forwards, in order
      // Without backwards a slot is free again once the activations it sent have left.
      const int older = op.k - slots_[op.chunk];
      if (older >= 0 && act_send_[op.chunk * m_ + older]) act_send_[op.chunk * m_ + older]->wait();
      loss_sum += forward(ctx, op.chunk, op.k);
      pp_.progress();
    }
    finish_sends();
    double loss = last_ ? loss_sum / m_ : 0.0;
    if (p_ > 1) loss = pp_.sum(loss);
    return loss;
  }

  // The tied embedding: the first stage's wte and the last stage's shadow of it (the head) each
  // hold part of the gradient. Both get first + last (the same sum, bit for bit, on both).
  void finish_grads(GPT& model) override {
    if (p_ == 1 || (!first_ && !last_) || !model.config().tied()) return;  // an untied head: nothing shared
    const int index = model.param_index("wte.weight");  // the first stage's, or the last stage's shadow
    const ParamInfo& wte = model.params()[static_cast<std::size_t>(index)];
    const BufferRef g = model.grad_ref(index).slice(0, wte.numel());
    ensure_capacity(be_, tied_, "Pipeline::tied_wte_gradient", DType::f32, wte.numel(), Mem::comm);
    const BufferRef tied = tied_.ref().slice(0, wte.numel());
    const int peer = first_ ? p_ - 1 : 0;
    auto r = pp_.recv_async(tied, peer, kTiedTag);
    auto s = pp_.send_async(g, peer, kTiedTag);
    s->wait();
    r->wait();
    be_.residual_forward(g, g, tied, wte.numel());  // g += tied, by the back end (g may be device memory)
  }

  // `loom plan`: the tied gradient's buffer (finish_grads), the stage-boundary messages (each
  // micro-batch's activations forward, its gradient back: one [Nl,C] message per chunk edge), the
  // step's one all-reduce of stage numbers, and this schedule's replay for the planner to time with
  // its stages' predicted times: forward ops costing 1 unit and backward ops 2 per layer of their
  // chunk, 3 with model.recompute (a block's forward again first), plus the head on the last chunk
  // (in layers by its FLOPs, GPTConfig::head_in_blocks: 1 forward, 2 backward, never recomputed).
  void plan_step(StepPlan& plan) const override {
    if (p_ == 1) return;
    const std::size_t ops = order_.size();
    plan.ring_scratch(pp_.name(), {static_cast<double>(ring_all_reduce_scratch(
                                      static_cast<std::int64_t>(1 + (kStats + ops) * p_), p_, sizeof(double)))});
    if (tied_numel_ > 0) plan.add_scratch(Mem::comm, static_cast<double>(tied_numel_) * sizeof(float));
    double sends = 0;
    for (int c = 0; c < v_; ++c) sends += (c + 1 < v_ || !last_ ? 1 : 0) + (c > 0 || !first_ ? 1 : 0);
    plan.add_comm({pp_.name(), "stage-boundary activations and gradients", sends * m_ * boundary_ * 4.0, sends * m_,
                   false, true});
    if (tied_numel_ > 0) plan.add_comm({pp_.name(), "tied wte gradient", tied_numel_ * 4.0, 1, false});
    std::vector<std::vector<double>> op_units(static_cast<std::size_t>(p_));
    plan.stage_units.assign(static_cast<std::size_t>(p_), 0.0);
    for (int s = 0; s < p_; ++s)
      for (const Op& op : orders_[static_cast<std::size_t>(s)]) {
        const std::size_t vs = static_cast<std::size_t>(op.chunk * p_ + s);  // the virtual stage
        const double blocks = vs < layers_.size() ? layers_[vs] : 1;
        const double head = s == p_ - 1 && op.chunk == v_ - 1 ? model_->config().head_in_blocks() : 0;
        const double block_backward = model_->config().recompute ? 3.0 : 2.0;
        op_units[static_cast<std::size_t>(s)].push_back(op.kind == 'F' ? blocks + head
                                                                       : block_backward * blocks + 2.0 * head);
        plan.stage_units[static_cast<std::size_t>(s)] += op_units[static_cast<std::size_t>(s)].back();
      }
    // The replay outlives this role (the planner keeps the StepPlan): it holds its own copies.
    plan.pipeline_span = [orders = orders_, op_units, m = m_, v = v_](const std::vector<double>& seconds_per_unit) {
      std::vector<std::vector<double>> op_s = op_units;
      for (std::size_t s = 0; s < op_s.size(); ++s)
        for (double& t : op_s[s]) t *= seconds_per_unit.at(s);
      return replay_span(orders, op_s, m, v);
    };
  }

  std::string step_line(const std::vector<std::pair<std::string, double>>& values) const override {
    std::optional<double> bubble;
    double textbook = 0;
    for (const auto& [k, v] : values) {
      if (k == "pp_bubble") bubble = v;
      if (k == "pp_bubble_textbook") textbook = v;
    }
    if (!bubble) return {};
    char s[96];
    std::snprintf(s, sizeof s, " | bubble %.2f (textbook %.2f)", *bubble, textbook);
    return s;
  }
  std::vector<std::string> summary_lines(const std::map<std::string, double>& means) const override {
    if (!means.count("pp_bubble")) return {};
    char line[512];
    std::snprintf(line, sizeof line,
                  "pipeline bubble: measured %.3f (mean over stages and steady steps); the schedule replayed\n"
                  "         with the measured op times and free communication %.3f; textbook (p-1)/(vm+p-1) %.3f",
                  means.at("pp_bubble"), means.at("pp_bubble_expected"), means.at("pp_bubble_textbook"));
    return {line};
  }

  std::vector<std::pair<std::string, double>> step_report() const override {
    std::vector<std::pair<std::string, double>> r;
    if (stats_.empty()) return r;
    r.push_back({"pp_bubble", bubble_mean_});
    r.push_back({"pp_bubble_max", bubble_max_});
    r.push_back({"pp_bubble_textbook", static_cast<double>(p_ - 1) / (v_ * m_ + p_ - 1)});
    r.push_back({"pp_bubble_expected", bubble_expected_});
    const char* names[kStats] = {"bubble",       "inflight_max", "activation_bytes", "forward_ms", "backward_ms",
                                 "recv_wait_ms", "send_ms",      "data_ms",          "idle_ms",    "span_ms"};
    for (int s = 0; s < p_; ++s)
      for (int q = 0; q < kStats; ++q)
        r.push_back({"pp_stage" + std::to_string(s) + "_" + names[q], stats_[kStats * s + q]});
    return r;
  }

 private:
  static constexpr int kTiedTag = 999;  // below the communicator's collective tags (1000+)
  // Activations of micro-batch k for chunk c of the receiving stage travel with tag
  // 2((k v + c) mod 499), their gradients with that + 1; a tag reused after 499 messages is still
  // matched in order (MPI does not overtake).
  int tag(int k, int chunk, int direction) const { return 2 * ((k * v_ + chunk) % 499) + direction; }
  int next_rank() const { return (i_ + 1) % p_; }
  int prev_rank() const { return (i_ + p_ - 1) % p_; }

  // Receives are posted one ahead, in the order the stage will need them (gradients only when the
  // step has backwards).
  void begin(bool backward) {
    act_send_.clear();
    act_send_.resize(static_cast<std::size_t>(m_ * v_));
    act_next_ = grad_next_ = 0;
    post_act_recv();
    if (backward) post_grad_recv();
  }
  // n floats at p in the back end's memory (device memory on a device back end), for the communicator.
  BufferRef mine(const float* p, std::int64_t n) const { return BufferRef(p, n, be_.space()); }
  void post_act_recv() {
    if (act_next_ >= act_needs_.size()) return;
    const Op& op = act_needs_[act_next_];
    act_recv_ = pp_.recv_async(act_in_.ref().slice((act_next_ % 2) * boundary_, boundary_), prev_rank(),
                               tag(op.k, op.chunk, 0));
  }
  void post_grad_recv() {
    if (grad_next_ >= grad_needs_.size()) return;
    const Op& op = grad_needs_[grad_next_];
    grad_recv_ = pp_.recv_async(grad_in_.ref().slice((grad_next_ % 2) * boundary_, boundary_), next_rank(),
                                tag(op.k, op.chunk, 1));
  }

  // The pipeline's span is the longest stage's (the stages start together: the previous step ended
  // in collectives); a stage's bubble is the share of that span it spent not computing. The
  // textbook (p-1)/(vm+p-1) assumes equal stages, equal micro-batches and free communication;
  // `expected` is the bubble of the replayed span (`replay_ms`: this step's schedule with every
  // op's measured time, messages free), so measured - expected is what communication and overheads
  // cost, and expected - textbook what unequal stages and uneven op times cost.
  void bubbles(double replay_ms) {
    double span = 0, compute_sum = 0;
    bubble_mean_ = bubble_max_ = 0;
    for (int s = 0; s < p_; ++s) {
      const double* st = &stats_[kStats * s];
      span = std::max(span, st[kSpanMs]);
      compute_sum += st[kForwardMs] + st[kBackwardMs];
    }
    for (int s = 0; s < p_; ++s) {
      double* st = &stats_[kStats * s];
      // Idle: the pipeline's span less everything this stage was seen doing (receive waits are
      // reported on their own).
      st[kIdleMs] = span - st[kForwardMs] - st[kBackwardMs] - st[kRecvMs] - st[kSendMs] - st[kDataMs];
      const double compute = stats_[kStats * s + kForwardMs] + stats_[kStats * s + kBackwardMs];
      const double bubble = span > 0 ? 1.0 - compute / span : 0.0;
      stats_[kStats * s + kBubble] = bubble;
      bubble_mean_ += bubble / p_;
      bubble_max_ = std::max(bubble_max_, bubble);
    }
    bubble_expected_ = replay_ms > 0 ? 1.0 - compute_sum / (p_ * replay_ms) : 0.0;
  }

  // d(step objective)/d(a micro-batch's mean loss)
  float dloss(const StepContext& ctx) const { return ctx.loss_scale / static_cast<float>(m_); }

  void timed(const char* kind, int k, int chunk, double t0) { events_.push_back({kind, k, chunk, t0, now()}); }

  // `train`: a backward follows (the head's classifier makes its gradient with the loss).
  double forward(StepContext& ctx, int c, int k, bool train = false) {
    GPT& model = ctx.model;
    const int slot = k % slots_[c];
    double t0 = now();
    if (model.holds_embeddings(c) || model.holds_head(c)) {
      ctx.fetch(ctx.step, static_cast<std::int64_t>(k) * ctx.rows_per_micro, ctx.rows_per_micro, ctx.inputs,
                ctx.targets);
      ctx.times.data += now() - t0;
      timed("data", k, c, t0);
    }
    const float* x_in = nullptr;
    if (!model.holds_embeddings(c)) {
      t0 = now();
      act_recv_->wait();
      timed("recv", k, c, t0);
      x_in = act_in_.data<float>() + (act_next_ % 2) * boundary_;
      ++act_next_;
      post_act_recv();  // the next activations arrive while this micro-batch computes
    }
    t0 = now();
    inject_slowness(ctx.step);  // LOOM_INJECT_FAULT where=slow: a slow node's forward
    const double loss = model.forward_stage(slot, model.holds_embeddings(c) ? ctx.inputs.data() : nullptr, x_in,
                                            model.holds_head(c) ? ctx.targets.data() : nullptr, ctx.rows_per_micro, c,
                                            train ? std::optional<float>(dloss(ctx)) : std::nullopt);
    ctx.times.forward += now() - t0;
    timed("forward", k, c, t0);
    if (!model.holds_head(c)) {
      t0 = now();
      const int to_chunk = i_ + 1 < p_ ? c : c + 1;  // the last stage feeds the first stage's next chunk
      act_send_[c * m_ + k] =
          pp_.send_async(mine(model.stage_output(slot, c), boundary_), next_rank(), tag(k, to_chunk, 0));
      timed("send", k, c, t0);
    }
    return loss;
  }

  // `j`: this backward's place among the stage's m x v backwards (the gradient sync's micro-batch).
  void backward(StepContext& ctx, int c, int k, int j) {
    GPT& model = ctx.model;
    const int slot = k % slots_[c];
    const float* dout = nullptr;
    double t0 = now();
    if (!model.holds_head(c)) {
      grad_recv_->wait();
      timed("recv", k, c, t0);
      dout = grad_in_.data<float>() + (grad_next_ % 2) * boundary_;
      ++grad_next_;
      post_grad_recv();
      // The next stage has the activations (it sent their gradient): the slot's send is done.
      act_send_[c * m_ + k]->wait();
    }
    ctx.sync.begin_micro_batch(model, j, m_ * v_);
    t0 = now();
    const float* dx = model.backward_stage(slot, dloss(ctx), dout, c);
    ctx.times.backward += now() - t0;
    timed("backward", k, c, t0);
    if (!model.holds_embeddings(c)) {
      t0 = now();
      CommRequestPtr& older = grad_send_[j % 2];
      if (older) older->wait();
      const BufferRef out = grad_out_.ref().slice((j % 2) * boundary_, boundary_);
      be_.copy(out, mine(dx, boundary_), boundary_);
      const int to_chunk = i_ > 0 ? c : c - 1;  // the first stage sends back to the last stage's previous chunk
      older = pp_.send_async(out, prev_rank(), tag(k, to_chunk, 1));
      timed("send", k, c, t0);
    }
  }

  void finish_sends() {
    const double t0 = now();
    for (auto& r : act_send_)
      if (r) r->wait();
    for (auto& r : grad_send_)
      if (r) r->wait();
    for (auto& r : act_send_) r.reset();
    grad_send_[0].reset();
    grad_send_[1].reset();
    timed("send", -1, 0, t0);
  }

  // Keeps this step's intervals; after pipeline.trace_steps steps (or the run's last step) every
  // rank's intervals go to world rank 0, which writes <run.dir>/pipeline_trace.json.
  void record_trace(std::int64_t step) {
    if (traced_ >= trace_steps_) return;
    std::ostringstream out;
    const int rank = grid_.rank();
    for (const Interval& e : events_) {
      out << (trace_text_.empty() && out.tellp() == 0 ? "" : ",\n") << "{\"name\":\"";
      if (e.micro < 0)
        out << e.kind;
      else
        out << static_cast<char>(std::toupper(e.kind[0])) << e.micro;  // "F3": forward of micro-batch 3
      if (e.micro >= 0 && v_ > 1) out << "." << e.chunk;               // "F3.1": on chunk 1
      out << "\",\"cat\":\"" << e.kind << "\",\"ph\":\"X\",\"pid\":" << rank
          << ",\"tid\":0,\"ts\":" << (e.t0 - trace_origin_) * 1e6 << ",\"dur\":" << (e.t1 - e.t0) * 1e6
          << ",\"args\":{\"step\":" << step + 1 << ",\"micro_batch\":" << e.micro << ",\"chunk\":" << e.chunk << "}}";
    }
    trace_text_ += out.str();
    ++traced_;
    if (traced_ == trace_steps_ || step + 1 == total_steps_) write_trace();
  }

  void write_trace() {
    const int rank = grid_.rank();
    std::ostringstream meta;
    meta << (trace_text_.empty() ? "" : ",\n") << "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << rank
         << ",\"args\":{\"name\":\"rank " << rank << ": stage " << i_ << " (dp " << grid_.dp_rank()
         << (grid_.layout().cp > 1 ? ", cp " + std::to_string(grid_.cp_rank()) : std::string()) << ", tp "
         << grid_.tp_rank() << ")\"}},\n{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":" << rank
         << ",\"args\":{\"sort_index\":" << rank << "}}";
    const std::string mine = trace_text_ + meta.str();
    // Every rank's text to every rank (an all-gather: the communicators have no gather), through the
    // world communicator and so under run.comm_timeout; only rank 0 writes it.
    Communicator& world_comm = grid_.world();
    const int world = world_comm.size();
    std::int64_t len = static_cast<std::int64_t>(mine.size());
    std::vector<std::int64_t> lens(static_cast<std::size_t>(world)), displs(static_cast<std::size_t>(world), 0);
    world_comm.all_gather(BufferRef(&len, 1), BufferRef(lens.data(), world));
    for (int r = 1; r < world; ++r) displs[r] = displs[r - 1] + lens[r - 1];
    std::string all(static_cast<std::size_t>(displs[world - 1] + lens[world - 1]), '\0');
    world_comm.all_gather(BufferRef(reinterpret_cast<const std::uint8_t*>(mine.data()), len),
                          BufferRef(reinterpret_cast<std::uint8_t*>(all.data()), static_cast<std::int64_t>(all.size())),
                          lens);
    trace_text_.clear();
    trace_steps_ = traced_;  // written once
    if (rank != 0) return;
    std::string body;
    for (int r = 0; r < world; ++r) {
      if (lens[r] == 0) continue;
      if (!body.empty()) body += ",\n";
      body.append(all, static_cast<std::size_t>(displs[r]), static_cast<std::size_t>(lens[r]));
    }
    const std::string path = run_dir_ + "/pipeline_trace.json";
    std::ofstream f(path);
    f << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n" << body << "\n]}\n";
    if (!f) throw InputError("pipeline.trace: cannot write " + path + " (check run.dir)");
    std::cout << "pipeline: wrote " << path << " (" << traced_ << " step" << (traced_ == 1 ? "" : "s")
              << "; open it in https://ui.perfetto.dev or chrome://tracing)" << std::endl;
  }

  ProcessGrid& grid_;
  BackendFace& be_;
  Communicator& pp_;
  GPT* model_ = nullptr;
  Kind kind_;
  int m_, p_, i_, v_;
  bool first_, last_;
  std::vector<int> slots_;  // per chunk
  std::int64_t boundary_;   // floats of one micro-batch's stage-boundary activations on this rank
  bool trace_;
  int trace_steps_;
  std::int64_t total_steps_;
  std::string run_dir_;
  std::vector<int> layers_;
  std::int64_t tied_numel_ = 0;  // the tied wte's local elements (first and last stage)
  std::string describe_;
  TypedBuffer act_in_, grad_in_, grad_out_;
  std::vector<std::vector<Op>> orders_;  // every stage's, for the replay
  std::vector<Op> order_, act_needs_, grad_needs_;
  std::size_t act_next_ = 0, grad_next_ = 0;  // the receive in flight in each direction
  CommRequestPtr act_recv_, grad_recv_;
  std::vector<CommRequestPtr> act_send_;  // per (chunk, micro-batch)
  CommRequestPtr grad_send_[2];
  TypedBuffer tied_;
  std::vector<Interval> events_;
  std::vector<double> stats_;  // per stage, Stat order
  double bubble_mean_ = 0, bubble_max_ = 0, bubble_expected_ = 0;
  int traced_ = 0;
  bool trace_origin_set_ = false;
  double trace_origin_ = 0;
  std::string trace_text_;
};

Kind kind_of(const Deck& deck) {
  return deck.get_string("pipeline.schedule") == "gpipe" ? Kind::gpipe : Kind::one_f_one_b;
}

// `loom plan`: the memo's words on the deck's schedule, and the interleaved schedule as a lever against
// the bubble (where the layers split into 2 chunks per stage).
PlanTerms pipeline_plan_terms() {
  PlanTerms t;
  t.memo = [](const std::string& topic, const PlanPoint& p) -> std::string {
    if (!p.deck) return "";
    const std::string schedule = p.deck->get_string("pipeline.schedule");
    if (topic == "schedule") return schedule;
    if (topic == "schedule_note" && kind_of(*p.deck) == Kind::one_f_one_b)
      return " 1F1B runs each micro-batch's backward as soon as it can, so a stage holds at most pp micro-batches' "
             "activations instead of all m (GPipe).";
    return "";
  };
  t.levers = [](const std::string& bottleneck, const PlanPoint& p) -> std::vector<PlanLever> {
    if (bottleneck != "bubble" || !p.deck) return {};
    const std::int64_t layers = p.deck->get_int("model.layers");
    if (layers % (2 * p.layout.pp) != 0 || kind_of(*p.deck) != Kind::one_f_one_b) return {};
    return {{"the interleaved schedule (pipeline.virtual_stages = 2)", {"pipeline.virtual_stages=2"}},
            {"the interleaved schedule with recompute", {"pipeline.virtual_stages=2", "model.recompute=true"}}};
  };
  return t;
}

void register_pipeline(void* p) {
  auto& info = *static_cast<StrategyInfo*>(p);
  info.keys.push_back(choice_key("pipeline.schedule", "1f1b", {"1f1b", "gpipe"},
                                 "pipeline parallel: gpipe (all forwards, then all backwards) or 1f1b (warm-up, "
                                 "one forward one backward, cool-down: at most pp micro-batches in flight)"));
  info.keys.push_back(string_key("pipeline.partition", "uniform",
                                 "pipeline parallel: layers per stage: uniform, balanced (by compute, the head "
                                 "counted on the last stage) or a list of counts, e.g. 3,3,2",
                                 validate_partition_syntax));
  info.keys.push_back(bool_key("pipeline.trace", "false",
                               "pipeline parallel: write <run.dir>/pipeline_trace.json, a Chrome-trace timeline of "
                               "every rank's forward, backward, send and receive intervals"));
  info.keys.push_back(int_key("pipeline.trace_steps", "3", 1, 1000,
                              "pipeline parallel: steps recorded in the trace (from the first step run)"));
  info.keys.push_back(int_key("pipeline.virtual_stages", "1", 1, 64,
                              "pipeline parallel: model chunks per stage (interleaved 1F1B, Megatron): stage i "
                              "holds chunks i, i+pp, ...; the bubble shrinks by this factor; needs schedule = 1f1b "
                              "and train.micro_batches a multiple of parallel.pp"));
  info.check = [](const LayoutContext& ctx) {
    const int v = static_cast<int>(ctx.deck.get_int("pipeline.virtual_stages"));
    const int m = static_cast<int>(ctx.deck.get_int("train.micro_batches")), pp = ctx.layout.pp;
    if (v > 1 && kind_of(ctx.deck) == Kind::gpipe)
      throw InputError(
          "pipeline.virtual_stages = " + std::to_string(v) +
          " interleaves the 1F1B schedule; set pipeline.schedule = 1f1b (or virtual_stages = 1 for gpipe)");
    if (v > 1 && m % pp != 0)
      throw InputError("pipeline.virtual_stages = " + std::to_string(v) +
                       " (interleaved 1F1B) runs micro-batches in "
                       "groups of parallel.pp = " +
                       std::to_string(pp) + ", but train.micro_batches = " + std::to_string(m) +
                       " is not a multiple of it; micro_batches that work: " + std::to_string(pp) + ", " +
                       std::to_string(2 * pp) + ", ... (dividing the batch per dp rank)");
    stage_layers(ctx.deck.get_string("pipeline.partition"), ctx.model, pp, v);  // throws if it cannot
  };
  info.claims = {
      {Role::stage, Claim::provides, ""}, {Role::schedule, Claim::provides, ""}, {Role::progress, Claim::provides, ""}};
  info.assign_stage = [](PartitionContext& ctx) {
    const int pp = ctx.grid.layout().pp, i = ctx.grid.pp_rank();
    const int v = static_cast<int>(ctx.deck.get_int("pipeline.virtual_stages"));
    const int m = static_cast<int>(ctx.deck.get_int("train.micro_batches"));
    const std::vector<int> counts = stage_layers(ctx.deck.get_string("pipeline.partition"), ctx.model, pp, v);
    const std::vector<int> slots = activation_slots(stage_order(kind_of(ctx.deck), m, pp, i, v), v);
    Stage st;
    st.index = i;
    st.count = pp;
    for (int c = 0; c < v; ++c) {
      const int chunk = c * pp + i;  // in model order
      Stage::Chunk ch;
      for (int s = 0; s < chunk; ++s) ch.first_layer += counts[s];
      ch.end_layer = ch.first_layer + counts[chunk];
      ch.activation_slots = slots[c];
      st.chunks.push_back(ch);
    }
    return st;
  };
  info.plan = pipeline_plan_terms();
  info.create = [](StrategyContext& ctx, Roles& roles) {
    const std::vector<int> counts =
        stage_layers(ctx.deck.get_string("pipeline.partition"), ctx.model.config(), ctx.grid.layout().pp,
                     static_cast<int>(ctx.deck.get_int("pipeline.virtual_stages")));
    roles.schedule = std::make_unique<PipelineSchedule>(
        ctx.grid, ctx.backend, ctx.model, kind_of(ctx.deck), ctx.engine.micro_batches, ctx.engine.rows_per_micro,
        ctx.deck.get_bool("pipeline.trace"), static_cast<int>(ctx.deck.get_int("pipeline.trace_steps")),
        ctx.engine.optimizer.steps, ctx.deck.get_string("run.dir"), counts);
    // Between blocks, move the stage-boundary messages in flight: a large message travels only
    // while one of its ends is inside MPI, and the neighbour stage is waiting for it.
    roles.progress = [pp = &ctx.grid.pp()] { pp->progress(); };
  };
}

}  // namespace
}  // namespace loom

extern "C" const loom_plugin_v1* loom_plugin_entry(void) {
  static const loom_plugin_v1 plugin = {LOOM_PLUGIN_ABI_VERSION, "pipeline", "0.1.0",
                                        "pipeline parallelism: layer stages, GPipe, 1F1B and interleaved 1F1B "
                                        "micro-batch schedules, asynchronous stage-to-stage send/recv, measured bubble",
                                        loom::register_pipeline};
  return &plugin;
}
