// The `expert` strategy plugin (libloom_expert.so): expert parallelism. Asked for by parallel.ep > 1.
// The gradient group's replicas form groups of ep consecutive ones (the grid's ep communicator); rank q
// of a group holds experts [q E/ep, (q+1) E/ep) of every block with experts, and the replicas with the
// same ep rank (the grid's edp communicator, dp/ep ranks) hold the same experts (core/model/experts.hpp).
// Each rank routes its own tokens (the router is a dense weight, on every rank), then per block:
//
//   forward   each rank's kept rows go to the ranks of their experts and come back as the experts'
//             outputs: two all-to-alls of uneven counts (the counts first: an all-gather of E numbers);
//   backward  the gated output gradients go to the experts, their input gradients come back: two more.
//
// The exchange is pairwise sends and receives through the ep communicator (typed buffers, watched
// waits, bytes counted); a rank's own rows are copied. The experts' gradients are summed over the edp
// group after the step's backward and divided by the replicas, as the gradient sync does for the dense
// weights (which it reduces over dp as before, leaving the experts' to this role).
// Bytes a rank sends per block and micro-batch: the rows it sends to other ranks and those it returns,
// each C values (fp32; the forward's input in the products' 16-bit type when ln2 is saved so), twice.
// Each step every rank compares what its communicator counted with that formula for its routed counts
// (ep_alltoall_bytes, ep_alltoall_formula_bytes, ep_ranks_off_formula: regression/ep_checks.py).
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/base/clock.hpp"
#include "core/base/error.hpp"
#include "core/engine/plan_terms.hpp"
#include "core/engine/plugin.hpp"
#include "core/model/experts.hpp"

namespace loom {
namespace {

constexpr int kTagRows = 330;

class ExpertParallel final : public ExpertSplit {
 public:
  ExpertParallel(Communicator& ep, Communicator& edp, int replicas) : ep_(ep), edp_(edp), replicas_(replicas) {}
  std::string name() const override {
    return "expert parallel over ep " + std::to_string(size()) + " (each rank 1/" + std::to_string(size()) +
           " of the experts; tokens exchanged all-to-all; expert gradients summed over " + std::to_string(edp_.size()) +
           " rank" + (edp_.size() == 1 ? "" : "s") + ")";
  }
  int size() const override { return ep_.size(); }
  int rank() const override { return ep_.rank(); }

  void exchange_counts(const std::vector<std::int64_t>& counts, std::vector<std::int64_t>& all) override {
    all.assign(counts.size() * static_cast<std::size_t>(size()), 0);
    ep_.all_gather(BufferRef(counts.data(), static_cast<std::int64_t>(counts.size())),
                   BufferRef(all.data(), static_cast<std::int64_t>(all.size())));
  }

  void exchange(BackendFace& be, const BufferRef& send, const std::vector<std::int64_t>& send_rows,
                const BufferRef& recv, const std::vector<std::int64_t>& recv_rows, int cols) override {
    const int n = size(), me = rank();
    std::vector<std::int64_t> so(static_cast<std::size_t>(n) + 1, 0), ro(static_cast<std::size_t>(n) + 1, 0);
    for (int q = 0; q < n; ++q) {
      so[q + 1] = so[q] + send_rows[q] * cols;
      ro[q + 1] = ro[q] + recv_rows[q] * cols;
    }
    std::vector<CommRequestPtr> reqs;
    for (int q = 0; q < n; ++q)
      if (q != me && recv_rows[q] > 0)
        reqs.push_back(ep_.recv_async(recv.slice(ro[q], ro[q + 1] - ro[q]), q, kTagRows));
    for (int q = 0; q < n; ++q)
      if (q != me && send_rows[q] > 0) {
        reqs.push_back(ep_.send_async(send.slice(so[q], so[q + 1] - so[q]), q, kTagRows));
        formula_bytes_ += static_cast<double>(so[q + 1] - so[q]) * static_cast<double>(dtype_size(send.type));
      }
    if (send_rows[me] != recv_rows[me])
      throw std::logic_error("expert plugin: " + std::to_string(send_rows[me]) + " rows to itself, " +
                             std::to_string(recv_rows[me]) + " expected");
    if (send_rows[me] > 0) be.cast(recv.slice(ro[me], ro[me + 1] - ro[me]), send.slice(so[me], so[me + 1] - so[me]));
    for (auto& r : reqs) r->wait();
    ++exchanges_;
  }

  void finish_grads(GPT& model) override {
    const double t0 = now();
    for (std::size_t i = 0; i < model.params().size(); ++i) {
      const ParamInfo& p = model.params()[i];
      if (!p.expert || p.numel() == 0) continue;
      const BufferRef g = model.grad_ref(static_cast<int>(i));
      if (edp_.size() > 1) edp_.all_reduce(g);
      model.backend().scale(g, 1.0 / replicas_);
    }
    grad_s_ += now() - t0;
  }

  void begin_step() override { formula_bytes_ = 0, exchanges_ = 0, grad_s_ = 0; }
  // Collective over the ep group (every rank reports every step): how many of its ranks sent other
  // than the formula for their routed counts says.
  std::vector<std::pair<std::string, double>> step_report() override {
    const CommStats& cs = ep_.stats();
    const int send = static_cast<int>(CommOp::send), gather = static_cast<int>(CommOp::all_gather);
    double off = static_cast<double>(cs.bytes_sent[send]) != formula_bytes_ ? 1.0 : 0.0;
    ep_.all_reduce(&off, 1);
    return {{"ep_alltoall_bytes", static_cast<double>(cs.bytes_sent[send])},
            {"ep_ranks_off_formula", off},
            {"ep_alltoall_formula_bytes", formula_bytes_},
            {"ep_count_bytes", static_cast<double>(cs.bytes_sent[gather])},
            {"ep_alltoall_wait_ms", 1e3 * cs.total_wait()},
            {"ep_expert_grads_ms", 1e3 * grad_s_},
            {"ep_exchanges", static_cast<double>(exchanges_)}};
  }

  std::vector<std::string> summary_lines(const std::map<std::string, double>& means, double step_s) const override {
    if (!means.count("ep_alltoall_bytes") || step_s <= 0) return {};
    const double wait = 1e-3 * means.at("ep_alltoall_wait_ms");
    char line[320];
    std::snprintf(line, sizeof line,
                  "expert parallel: the all-to-all sends %.3g MB a step per rank and waits %.1f ms of a %.1f ms step "
                  "(%.1f%%); the experts' gradient sum %.1f ms",
                  means.at("ep_alltoall_bytes") / 1e6, 1e3 * wait, 1e3 * step_s, 100.0 * wait / step_s,
                  means.at("ep_expert_grads_ms"));
    return {line};
  }

  // Per block with experts and micro-batch, priced at balanced routing: each exchange sends (ep-1)/ep of
  // N k rows of C values; four exchanges (two with a recomputed forward's more), and the counts.
  void plan_step(StepPlan& plan, const GPT& model) const override {
    const GPTConfig& m = model.config();
    int blocks = 0;
    for (const Stage::Chunk& c : model.stage().chunks)
      for (int l = c.first_layer; l < c.end_layer; ++l) blocks += m.moe_layer(l) ? 1 : 0;
    const int n = size();
    if (blocks == 0 || n == 1) return;
    const double rows = static_cast<double>(model.max_rows()) * model.local_tokens() * m.top_k() * (n - 1) / n;
    const double forwards = plan.micro_batches * blocks * (m.recompute ? 2.0 : 1.0);
    // The forward's inputs travel in their saved type (the products' 16-bit one unless sequence
    // parallelism gathers them in fp32); outputs and gradients in fp32.
    const DType mm = model.backend().precision().matmul;
    const double in_bytes = mm != DType::f32 && !model.partition().sequence_parallel() ? dtype_size(mm) : 4.0;
    const double bytes =
        forwards * rows * m.d_model * (in_bytes + 4.0) + plan.micro_batches * blocks * 2.0 * rows * m.d_model * 4.0;
    const double exchanges = forwards * 2.0 + plan.micro_batches * blocks * 2.0;
    plan.add_comm({ep_.name(), "experts' all-to-all (balanced routing)", bytes, exchanges * (n - 1), false, true});
    plan.add_comm(
        {ep_.name(), "experts' row counts",
         plan.micro_batches * blocks * (m.recompute ? 2.0 : 1.0) * ring_all_gather_bytes(8.0 * m.experts * n, n),
         plan.micro_batches * blocks * (n - 1.0), false, true});
    std::int64_t all = 0;
    for (const ParamInfo& p : model.params())
      if (p.expert) all += p.numel();
    const int g = edp_.size();
    if (g > 1) {
      // One tensor's all-reduce at a time, but the pool keeps a buffer of each size class used.
      for (const ParamInfo& p : model.params())
        if (p.expert)
          plan.ring_scratch(edp_.name(), {static_cast<double>(ring_all_reduce_scratch(p.numel(), g, sizeof(float)))});
      plan.add_comm(
          {edp_.name(), "experts' gradient all-reduce", ring_all_reduce_bytes(4.0 * all, g), 2.0 * (g - 1), false});
    }
  }

 private:
  Communicator& ep_;
  Communicator& edp_;
  int replicas_;
  double formula_bytes_ = 0, grad_s_ = 0;
  int exchanges_ = 0;
};

// `loom plan`: parallel.ep searched where the model has experts (each divisor of dp that divides them),
// and the memo's sentence about the split.
PlanTerms expert_plan_terms() {
  PlanTerms t;
  PlanDimension d("parallel.ep", "expert parallelism", "ep", 4, "ep", PlanDimension::Json::integer, "1", 10, 10);
  d.values = [](const PlanPoint& p) -> std::vector<std::string> {
    const std::int64_t E = p.deck ? p.deck->get_int("model.experts") : 0;
    if (E <= 0) return {};
    std::vector<std::string> v;
    for (int n = 1; n <= p.layout.replicas(); ++n)
      if (p.layout.replicas() % n == 0 && E % n == 0) v.push_back(std::to_string(n));
    return v;
  };
  d.describe = [](const std::string& v) { return v == "1" ? std::string() : "experts over ep " + v; };
  t.dimensions.push_back(d);
  t.memo = [](const std::string& topic, const PlanPoint& p) -> std::string {
    const std::string ep = p.setting("parallel.ep");
    if (topic != "split" || ep.empty() || ep == "1" || !p.deck) return "";
    const std::int64_t E = p.deck->get_int("model.experts"), n = std::stoll(ep);
    return "- **Expert parallelism over " + ep + " ranks** keeps " + std::to_string(E / n) + " of the " +
           std::to_string(E) + " experts of every block on each rank; tokens travel to their experts' ranks and " +
           "back by all-to-all (four exchanges a block and micro-batch), and each expert's gradient is summed " +
           "over the " + std::to_string(p.layout.replicas() / n) + " rank(s) holding it.\n";
  };
  return t;
}

void register_expert(void* p) {
  auto& info = *static_cast<StrategyInfo*>(p);
  info.claims = {{Role::experts, Claim::provides, ""}};
  info.make_experts = [](PartitionContext& ctx) -> std::unique_ptr<ExpertSplit> {
    return std::make_unique<ExpertParallel>(ctx.grid.ep(), ctx.grid.edp(), ctx.grid.layout().replicas());
  };
  info.create = [](StrategyContext&, Roles&) {};
  info.plan = expert_plan_terms();
}

}  // namespace
}  // namespace loom

extern "C" const loom_plugin_v1* loom_plugin_entry(void) {
  static const loom_plugin_v1 plugin = {LOOM_PLUGIN_ABI_VERSION, "expert", "0.1.0",
                                        "expert parallelism: a block's experts split over ranks, tokens exchanged",
                                        loom::register_expert};
  return &plugin;
}
