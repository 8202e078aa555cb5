// The `zero` strategy plugin (libloom_zero.so): ZeRO over the data-parallel group. A deck asks for
// it with `zero.stage` > 0 (with parallel.dp > 1), no run.plugins line: its claims replace the `data`
// strategy's gradient sync and reducer and provide the parameter store.
//
// Stage 1 (this file): the store keeps loom's flat parameter and gradient buffers whole on every rank
// but cuts the flat range into dp contiguous shares (shard_counts); rank r owns share r, so the
// optimizer (AdamW over ParamStore::owned()) keeps 1/dp of its state. Gradients are reduce-scattered
// bucket by bucket during backward: a bucket's elements that fall in rank r's share are summed on
// rank r only (uneven counts: a bucket meets one share or a few). The norm counts each element once,
// on its owner; each rank steps its share, and the refresh phase all-gathers the updated shares
// (uneven counts) into every rank's parameters. Traffic: reduce-scatter (N-1)/N M + all-gather
// (N-1)/N M, the 2(N-1)/N M of an all-reduce. A tied embedding (wte with pp > 1), whose gradient
// another stage adds to after sync, is all-reduced whole. With parallel.ep > 1 an expert's tensors
// are sharded over the ranks holding that expert (edp) instead, and refreshed over them; their
// gradients are summed by the experts role (ExpertSplit::finish_grads), which stage 1 keeps whole.
// Stages 2 and 3 (gradients, then parameters too, kept only as shares): zero_sharded.hpp.
#include <map>
#include <algorithm>
#include <memory>
#include <string>

#include "core/engine/bucketed_sync.hpp"
#include "core/comm/comm.hpp"
#include "core/base/error.hpp"
#include "core/comm/fault.hpp"
#include "core/comm/grid.hpp"
#include "core/base/ledger.hpp"
#include "core/engine/plugin.hpp"
#include "plugins/zero/zero_sharded.hpp"

namespace loom {
namespace {

// Stage 1's store: the flat buffers, each rank owning one contiguous share of each run of them. Under
// 16-bit precision the fp32 masters are sharded too (DeepSpeed's bf16 ZeRO-1, Megatron's distributed
// optimizer): the block matrices' fp32 values exist only for this rank's shares (master_), beside one
// whole 16-bit copy of the flat range (params16_, all-gathered in refresh); the tensors the model
// reads in fp32 (LayerNorm, biases, positions, wte) stay whole on every rank (wparams_), but each
// rank updates only their elements in its shares of the flat range, as it does the matrices', so
// their AdamW state is sharded too, and refresh all-gathers the updated fp32 elements (per run, each
// rank's elements of them are one run of wparams_). Gradients stay whole, as stage 1 keeps them.
// Runs: with parallel.ep > 1 an expert's tensors are held by the ranks of one edp group only (the
// other ep ranks hold other experts in the same places), so the flat range is cut into runs of dense
// tensors, sharded over dp, and runs of experts' tensors, sharded over edp; with ep = 1, one run.
class ZeroStore final : public FlatParamStore {
 public:
  ZeroStore(Communicator& dp, Communicator& edp) : dp_(dp), edp_(edp) {}
  std::string name() const override {
    const std::string n = std::to_string(dp_.size());
    const std::string experts =
        expert_elements_ > 0 ? " (the experts' 1/" + std::to_string(edp_.size()) + ", over the ranks holding them)"
                             : "";
    return "ZeRO stage 1 (flat parameters and gradients; optimizer state of 1/" + n + " of them per rank" + experts +
           (masters16_ ? "; fp32 masters 1/" + n + ", a whole 16-bit copy all-gathered" : std::string()) + ")";
  }
  void build(const StoreContext& ctx, const std::vector<ParamInfo>& params, const std::vector<Unit>& units) override {
    masters16_ = ctx.backend.precision().matmul != DType::f32;
    if (!masters16_) {
      FlatParamStore::build(ctx, params, units);
    } else {
      be_ = &ctx.backend;
      info_ = params;
      std::int64_t n = 0;
      for (const ParamInfo& p : params) n = std::max(n, p.offset + p.numel());
      flat_ = n;
      whole_of_.assign(params.size(), false);
      wat_.assign(params.size(), -1);
      std::int64_t w = 0;
      std::vector<ParamInfo> copied = params;  // ComputeCopies for the whole matrices (wte) only
      for (std::size_t i = 0; i < params.size(); ++i) {
        const ParamInfo& p = params[i];
        whole_of_[i] = !p.matmul_weight || p.name == "wte.weight" || p.tied || p.shadow;
        if (whole_of_[i]) wat_[i] = w, w += p.numel();
        copied[i].matmul_weight = p.matmul_weight && whole_of_[i];
      }
      grads_ = be_->allocate("GPT::grads", DType::f32, n, Mem::grads);
      wparams_ = be_->allocate("ZeroStore::whole_params", DType::f32, w, Mem::master);
      params16_ = be_->allocate("ZeroStore::params16", ctx.backend.precision().matmul, n, Mem::params);
      copies_.build(*be_, copied, units, true);
      units_of_.clear();
      for (const Unit& un : units) units_of_.push_back(un.params);
      forward_.assign(units.size(), {});
      backward_.assign(units.size(), {});
      for (std::size_t u = 0; u < units.size(); ++u)
        for (int i : units[u].params) {
          forward_[u].params.push_back(param(i));  // empty for a sharded matrix: its operand is 16-bit
          backward_[u].params.push_back(param(i));
          backward_[u].grads.push_back(grad(i));
        }
      dirty16_ = true;
    }
    cut_runs(params);
    owned_.clear();
    for (int i = 0; i < static_cast<int>(params.size()); ++i) {
      const ParamInfo& p = params[static_cast<std::size_t>(i)];
      if (run_of_[static_cast<std::size_t>(i)] < 0) continue;
      const Run& r = runs_[static_cast<std::size_t>(run_of_[static_cast<std::size_t>(i)])];
      const std::int64_t a = std::max(p.offset, r.lo), b = std::min(p.offset + p.numel(), r.hi);
      // Primary: this rank alone owns these elements in its group (within its tp group and stage,
      // tp_primary); an expert's group is the only one holding it.
      if (a < b) owned_.push_back({i, a - p.offset, b - p.offset, tp_primary(p, ctx)});
    }
  }
  std::int64_t local_numel() const override { return masters16_ ? flat_ : FlatParamStore::local_numel(); }
  std::int64_t expert_elements() const { return expert_elements_; }
  int expert_group() const { return edp_.size(); }
  double expert_gather_bytes() const { return expert_gather_bytes_; }
  BufferRef param(int i) override {
    if (!masters16_) return FlatParamStore::param(i);
    const std::size_t k = static_cast<std::size_t>(i);
    return whole_of_[k] ? wparams_.ref().slice(wat_[k], info_[k].numel()) : BufferRef();
  }
  BufferRef owned_param(const OwnedSlice& o) override {
    if (!masters16_) return FlatParamStore::owned_param(o);
    const std::size_t k = static_cast<std::size_t>(o.param);
    if (whole_of_[k]) return wparams_.ref().slice(wat_[k] + o.begin, o.size());
    const Run& r = runs_[static_cast<std::size_t>(run_of_[k])];
    return master_.ref().slice(r.master_at + info_[k].offset + o.begin - r.lo, o.size());
  }
  const UnitView& acquire(int unit, Use use, int next) override {
    if (!masters16_) return FlatParamStore::acquire(unit, use, next);
    if (dirty16_) refresh16();  // after initialisation or a load: every rank gets here alike
    const std::size_t u = static_cast<std::size_t>(unit);
    UnitView& v = use == Use::forward ? forward_[u] : backward_[u];
    copies_.attach(unit, v);
    v.compute.resize(v.params.size());
    const std::vector<int>& ps = unit_params(unit);
    for (std::size_t k = 0; k < ps.size(); ++k)
      if (!whole_of_[static_cast<std::size_t>(ps[k])])
        v.compute[k] = params16_.ref().slice(info_[static_cast<std::size_t>(ps[k])].offset,
                                             info_[static_cast<std::size_t>(ps[k])].numel());
    return v;
  }
  void params_written() override {
    FlatParamStore::params_written();
    dirty16_ = masters16_;
  }
  // Every rank's updated shares into every rank's parameters (16-bit copies with sharded masters, and
  // the fp32 whole tensors' elements), run by run over its group. `loom plan`: the refresh phase's
  // all-gathers (no scratch).
  void plan_step(StepPlan& plan) const override {
    const double elem = masters16_ ? dtype_size(be_->precision().matmul) : sizeof(float);
    for (const bool experts : {false, true}) {
      Communicator& g = experts ? edp_ : dp_;
      const int n = g.size();
      double flat = 0, whole = 0, runs = 0;
      for (const Run& r : runs_)
        if (r.expert == experts && n > 1) {
          flat += static_cast<double>(r.end - r.begin);
          for (std::int64_t c : r.wcounts) whole += static_cast<double>(c);
          runs += 1;
        }
      if (runs == 0) continue;
      const std::string what = experts ? "experts' parameter all-gather (refresh)" : "parameter all-gather (refresh)";
      plan.add_comm({g.name(), what, ring_all_gather_bytes(flat * elem, n), runs * (n - 1.0), false});
      if (masters16_ && whole > 0)
        plan.add_comm(
            {g.name(),
             experts ? "experts' fp32 whole tensors' all-gather (refresh)" : "fp32 whole tensors' all-gather (refresh)",
             ring_all_gather_bytes(whole * sizeof(float), n), runs * (n - 1.0), false});
    }
  }
  void refresh() override {
    const CommStats edp_before = edp_.stats();
    if (masters16_) {
      refresh16();
      for (const Run& r : runs_) {
        if (r.group->size() < 2) continue;
        const std::vector<std::int64_t> at = shard_offsets(r.wcounts);
        const std::size_t q = static_cast<std::size_t>(r.group->rank());
        r.group->all_gather(wparams_.ref().slice(r.wbegin + at[q], r.wcounts[q]),
                            wparams_.ref().slice(r.wbegin, at.back()), r.wcounts);
      }
    } else {
      gather_runs(params_.ref());
    }
    const int k = static_cast<int>(CommOp::all_gather);
    expert_gather_bytes_ = static_cast<double>(edp_.stats().bytes_sent[k] - edp_before.bytes_sent[k]);
    FlatParamStore::refresh();  // compute copies are stale
  }
  // The elements of `b` (a run of the flat gradient buffer, found by its first tensor's offset in
  // it; dense tensors only, as the buckets stop at experts') in each dp rank's share.
  std::vector<std::int64_t> rank_counts(const GradBucket& b) const {
    const GradBucket::Tensor& first = b.tensors.front();
    const std::int64_t s = info_[static_cast<std::size_t>(first.param)].offset + first.begin - first.offset;
    const std::int64_t e = s + b.data.count;
    const Run& r = runs_.at(static_cast<std::size_t>(run_of_.at(static_cast<std::size_t>(first.param))));
    if (r.expert || e > r.end) throw std::logic_error("ZeRO store: a gradient bucket outside one dense run");
    std::vector<std::int64_t> c(r.counts.size());
    for (std::size_t q = 0; q < r.counts.size(); ++q)
      c[q] = std::max<std::int64_t>(0, std::min(e, r.begin + r.offsets[q + 1]) - std::max(s, r.begin + r.offsets[q]));
    return c;
  }

 private:
  // A run of the flat range (dense tensors or experts') and its shares over its group.
  struct Run {
    std::int64_t begin = 0, end = 0;
    bool expert = false;
    Communicator* group = nullptr;
    std::vector<std::int64_t> counts, offsets;  // per rank of group; offsets from begin
    std::int64_t lo = 0, hi = 0;                // this rank's share, in the flat range
    std::int64_t master_at = 0;                 // (16-bit) where that share starts in master_
    std::int64_t wbegin = 0;                    // (16-bit) the run's whole tensors' first element in wparams_
    std::vector<std::int64_t> wcounts;          // (16-bit) per rank of group: its elements of them
  };

  void cut_runs(const std::vector<ParamInfo>& params) {
    runs_.clear();
    run_of_.assign(params.size(), -1);
    expert_elements_ = 0;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const ParamInfo& p = params[i];
      if (p.numel() == 0) continue;
      if (!runs_.empty() && p.offset != runs_.back().end)
        throw std::logic_error("ZeRO store: tensors not contiguous in model order");
      if (runs_.empty() || runs_.back().expert != p.expert) {
        runs_.emplace_back();
        runs_.back().begin = runs_.back().end = p.offset;
        runs_.back().expert = p.expert;
        runs_.back().group = p.expert ? &edp_ : &dp_;
      }
      runs_.back().end += p.numel();
      run_of_[i] = static_cast<int>(runs_.size()) - 1;
      if (p.expert) expert_elements_ += p.numel();
    }
    std::int64_t master = 0, whole = 0;
    for (Run& r : runs_) {
      r.counts = shard_counts(r.end - r.begin, r.group->size());
      r.offsets = shard_offsets(r.counts);
      const std::size_t q = static_cast<std::size_t>(r.group->rank());
      r.lo = r.begin + r.offsets[q];
      r.hi = r.begin + r.offsets[q + 1];
      r.master_at = master;
      master += r.hi - r.lo;
      if (!masters16_) continue;
      // Each rank's elements of the run's whole tensors: one run of wparams_, as both follow model order.
      r.wbegin = whole;
      r.wcounts.assign(r.counts.size(), 0);
      for (std::size_t i = 0; i < params.size(); ++i) {
        const ParamInfo& p = params[i];
        if (!whole_of_[i] || p.numel() == 0 || p.offset < r.begin || p.offset >= r.end) continue;
        if (wat_[i] != whole) throw std::logic_error("ZeRO store: whole tensors out of model order");
        whole += p.numel();
        for (std::size_t k = 0; k < r.counts.size(); ++k)
          r.wcounts[k] += std::max<std::int64_t>(0, std::min(p.offset + p.numel(), r.begin + r.offsets[k + 1]) -
                                                        std::max(p.offset, r.begin + r.offsets[k]));
      }
    }
    if (masters16_) master_ = be_->allocate("ZeroStore::master_share", DType::f32, master, Mem::master);
  }
  // Each run's shares into every rank of its group, in place in `flat` (a buffer of the flat range).
  void gather_runs(const BufferRef& flat) {
    for (const Run& r : runs_)
      if (r.group->size() > 1)
        r.group->all_gather(flat.slice(r.lo, r.hi - r.lo), flat.slice(r.begin, r.end - r.begin), r.counts);
  }
  // The owned matrices' masters rounded into their place in the 16-bit copy, then a 16-bit
  // all-gather of the shares (the positions of whole tensors in it are never read).
  void refresh16() {
    for (const OwnedSlice& o : owned_)
      if (!whole_of_[static_cast<std::size_t>(o.param)])
        be_->cast(params16_.ref().slice(info_[static_cast<std::size_t>(o.param)].offset + o.begin, o.size()),
                  owned_param(o));
    gather_runs(params16_.ref());
    dirty16_ = false;
  }
  const std::vector<int>& unit_params(int unit) const { return units_of_.at(static_cast<std::size_t>(unit)); }

  Communicator &dp_, &edp_;
  std::vector<Run> runs_;
  std::vector<int> run_of_;  // per tensor: its run, -1 for an empty one
  std::int64_t expert_elements_ = 0;
  double expert_gather_bytes_ = 0;  // the last refresh's, on the edp group
  bool masters16_ = false, dirty16_ = false;
  std::int64_t flat_ = 0;
  std::vector<bool> whole_of_;
  std::vector<std::int64_t> wat_;  // per tensor kept whole: its offset in wparams_
  TypedBuffer wparams_, master_, params16_;
  std::vector<std::vector<int>> units_of_;
};

// The reduce-scatter: rank r's part of a bucket summed in place (its block of the send buffer is
// read only in the ring's last step, which writes it element by element); a bucket without counts
// (a tensor wanted whole) is all-reduced.
class ReduceScatterReducer final : public Reducer {
 public:
  explicit ReduceScatterReducer(Communicator& dp) : dp_(dp) {}
  std::string name() const override { return "reduce-scatter over dp " + std::to_string(dp_.size()); }
  CommRequestPtr reduce_async(const GradBucket& b) override {
    if (b.rank_counts.empty()) return dp_.all_reduce_async(b.data, ReduceOp::sum);
    const std::vector<std::int64_t> off = shard_offsets(b.rank_counts);
    const std::size_t r = static_cast<std::size_t>(dp_.rank());
    return dp_.reduce_scatter_async(b.data, b.data.slice(off[r], b.rank_counts[r]), b.rank_counts, ReduceOp::sum);
  }
  // In place (the share is the bucket's own block), or an all-reduce for a bucket kept whole.
  BucketScratch plan_bucket(StepPlan& plan, const GradBucket& b, const std::string& what) const override {
    const int n = dp_.size();
    const double bytes = static_cast<double>(b.data.bytes());
    if (b.rank_counts.empty()) {
      plan.add_comm({dp_.name(), what + " all-reduce", ring_all_reduce_bytes(bytes, n), 2.0 * (n - 1), false});
      return {{static_cast<double>(ring_all_reduce_scratch(b.data.count, n, dtype_size(b.data.type)))}, {}, 0};
    }
    plan.add_comm({dp_.name(), what + " reduce-scatter", ring_reduce_scatter_bytes(bytes, n), n - 1.0, false});
    const std::int64_t most = *std::max_element(b.rank_counts.begin(), b.rank_counts.end());
    return {{static_cast<double>(ring_reduce_scatter_scratch(most, n, dtype_size(b.data.type), true))}, {}, 0};
  }

 private:
  Communicator& dp_;
};

// The bucketed sync with ZeRO's buckets, and the step's traffic against the textbook.
class ZeroSync final : public BucketedGradSync {
 public:
  ZeroSync(Communicator& dp, BackendFace& be, GPT& model, double bucket_mb, bool overlap, const ZeroStore& store)
      : BucketedGradSync(dp, be, model, bucket_mb, overlap,
                         BucketPlan{[&model](int p) { return model.params()[static_cast<std::size_t>(p)].tied; },
                                    [&store](const GradBucket& b) { return store.rank_counts(b); }, 2}),
        store_(store),
        params_bytes_(static_cast<double>(model.store().local_numel()) * sizeof(float)) {}
  std::string name() const override { return "ZeRO stage 1: " + BucketedGradSync::name(); }
  void begin_micro_batch(GPT& model, int k, int m) override {
    if (k == 0 && inject_fault("plugin", step_))
      throw std::runtime_error("zero plugin: injected fault at step " + std::to_string(step_) + " (LOOM_INJECT_FAULT)");
    if (k == m - 1) ++step_;
    BucketedGradSync::begin_micro_batch(model, k, m);
    if (k == m - 1) before_ = dp_.stats();
  }
  // Measured per step: bytes this rank sent to reduce the gradients (reduce-scatter, and all-reduce
  // of tensors kept whole) and to gather the parameters, and the model state, against the textbook.
  std::vector<std::pair<std::string, double>> step_report() const override {
    auto r = zero_step_report(
        1, dp_, before_, params_bytes_ / sizeof(float),
        {static_cast<double>(store_.expert_elements()), store_.expert_group(), store_.expert_gather_bytes()});
    append_reducer_report(r);
    return r;
  }
  StateSharding state_sharding() const override { return {dp_.size(), false, false, true}; }
  std::vector<std::string> summary_lines(const std::map<std::string, double>& means) const override {
    std::vector<std::string> lines;
    if (means.count("zero_ratio")) lines.push_back(zero_summary_line(means));
    append_reducer_summary(means, lines);
    return lines;
  }

 private:
  const ZeroStore& store_;
  double params_bytes_;
  CommStats before_;
  std::int64_t step_ = 0;  // steps of this run, for LOOM_INJECT_FAULT where=plugin
};

// `loom plan`: the stages worth searching (2 and 3 are refused with a pipeline, as requested_by says),
// what a stage shards, and the lever against a replicated optimizer step.
PlanTerms zero_plan_terms() {
  PlanTerms t;
  PlanDimension d("zero.stage", "ZeRO stage", "zero", 5, "zero_stage", PlanDimension::Json::integer, "", 20, 20);
  d.values = [](const PlanPoint& p) -> std::vector<std::string> {
    if (p.layout.replicas() < 2) return {"0"};
    const std::string ep = p.setting("parallel.ep");  // ZeRO-2 and -3 do not yet shard experts split over ep
    if (p.layout.pp > 1 || (!ep.empty() && ep != "1")) return {"0", "1"};
    return {"0", "1", "2", "3"};
  };
  d.describe = [](const std::string& v) { return v == "0" ? std::string() : "ZeRO " + v; };
  d.what_if = [](const PlanPoint& p) {
    std::vector<std::pair<std::string, std::string>> rows;
    const int stage = std::stoi(p.setting("zero.stage").empty() ? "0" : p.setting("zero.stage"));
    if (stage) rows.push_back({"no ZeRO", "0"});
    const std::string ep = p.setting("parallel.ep");
    if (p.layout.replicas() > 1 && stage < (p.layout.pp > 1 || (!ep.empty() && ep != "1") ? 1 : 3))
      rows.push_back({"ZeRO stage " + std::to_string(stage + 1), std::to_string(stage + 1)});
    return rows;
  };
  t.dimensions.push_back(d);
  t.memo = [](const std::string& topic, const PlanPoint& p) -> std::string {
    const std::string stage = p.setting("zero.stage");
    if (stage.empty() || stage == "0") return "";
    const std::string dp = std::to_string(p.layout.replicas());
    if (topic == "split")
      return "- **ZeRO stage " + stage + " over the " + dp + " data-parallel ranks" +
             (p.layout.cp > 1 ? std::string(" (dp x cp)") : std::string()) + "** shards " +
             (stage == "1"   ? "the optimizer state (AdamW's m and v"
              : stage == "2" ? "the optimizer state and the gradients (m, v, gradients"
                             : "the optimizer state, gradients and parameters (m, v, gradients, weights") +
             (p.precision != "fp32" ? " and the fp32 masters" : "") + "): each rank keeps 1/" + dp + ".\n";
    if (topic == "dp_sync")
      return std::string(
                 "ZeRO reduce-scatters each bucket so each rank receives the sum of the range it owns, updates "
                 "it, and all-gathers the updated parameters") +
             (stage == "1" ? " (stage 1 reduce-scatters after the last micro-batch's backward)" : "");
    return "";
  };
  t.levers = [](const std::string& bottleneck, const PlanPoint&) -> std::vector<PlanLever> {
    if (bottleneck != "optimizer") return {};
    return {{"ZeRO stage 1 (zero.stage = 1), which shards AdamW over dp", {"zero.stage=1"}}};
  };
  return t;
}

void register_zero(void* p) {
  auto& info = *static_cast<StrategyInfo*>(p);
  info.keys.push_back(int_key("zero.stage", "0", 0, 3,
                              "ZeRO: 0 plain data parallelism; 1 optimizer state sharded over the dp ranks; 2 + "
                              "gradients; 3 + parameters (gathered unit by unit for forward and backward)"));
  info.keys.push_back(float_key("zero.bucket_mb", "25", 0.001, 1e6,
                                "ZeRO: gradient bucket size in MiB (DeepSpeed's reduce_bucket_size); each bucket's "
                                "reduce-scatter starts when its gradients are done"));
  info.keys.push_back(bool_key("zero.overlap_comm", "true",
                               "ZeRO: start bucket reduce-scatters during backward (false: all after backward at "
                               "stage 1, each waited at once at stages 2 and 3)"));
  info.keys.push_back(int_key("zero.prefetch_depth", "1", 0, 64,
                              "ZeRO-3: how many units (embeddings, blocks, head) are gathered ahead of the one "
                              "computing, in the order recorded in the first step (0: each gathered when used)"));
  info.keys.push_back(int_key("zero.param_persistence_threshold", "0", 0, 1000000000000LL,
                              "ZeRO-3: tensors with fewer elements than this stay whole on every rank (as at "
                              "stage 0) instead of being gathered (DeepSpeed's stage3_param_persistence_threshold)"));
  info.claims = {{Role::store, Claim::provides, ""},
                 {Role::grad_sync, Claim::replaces, "data"},
                 {Role::reducer, Claim::replaces, "data"}};
  info.requested_by = [](const Deck& deck, const Layout& layout) -> std::string {
    const std::int64_t stage = deck.get_int("zero.stage");
    if (stage == 0) return "";
    const std::string setting = "zero.stage = " + std::to_string(stage);
    if (layout.replicas() < 2)
      throw InputError(setting + " shards model state over the data-parallel ranks (dp x cp), but parallel.dp = " +
                       std::to_string(layout.dp) + " and parallel.cp = " + std::to_string(layout.cp) +
                       "; set parallel.dp > 1 (or parallel.cp > 1), or zero.stage = 0");
    if (stage > 1 && layout.ep > 1)
      throw InputError(setting + " with parallel.ep = " + std::to_string(layout.ep) +
                       " is refused: ZeRO-2 and -3 do not yet shard the experts' gradients and parameters within "
                       "the ranks that hold them (the experts differ between ep ranks). Valid with parallel.ep > 1: "
                       "zero.stage = 0 or 1 (stage 1 shards the optimizer state and fp32 masters, the dense "
                       "tensors' over dp and each expert's over the ranks holding it)");
    if (stage > 1 && layout.pp > 1)
      throw InputError(setting + " with parallel.pp = " + std::to_string(layout.pp) +
                       " is refused (as DeepSpeed refuses ZeRO-2 and -3 with pipeline parallelism): every "
                       "micro-batch a pipeline runs would reduce-scatter its gradients again (and, at stage 3, "
                       "gather its parameters again), and the tied embedding's gradient is summed between the "
                       "first and last stage in full. Valid with pp > 1: zero.stage = 0 or 1 (the distributed "
                       "optimizer)");
    return setting;
  };
  info.traits = [](const Deck& deck, RunTraits& traits) {
    const std::int64_t stage = deck.get_int("zero.stage");
    if (stage > 1) traits.grads_scattered_by = "zero.stage = " + std::to_string(stage);
  };
  info.make_store = [](PartitionContext& ctx) -> std::unique_ptr<ParamStore> {
    const std::int64_t stage = ctx.deck.get_int("zero.stage");
    if (stage == 1) return std::make_unique<ZeroStore>(ctx.grid.dp(), ctx.grid.edp());
    return std::make_unique<ShardedStore>(ctx.grid.dp(), static_cast<int>(stage),
                                          ctx.deck.get_int("zero.param_persistence_threshold"),
                                          static_cast<int>(ctx.deck.get_int("zero.prefetch_depth")));
  };
  info.plan = zero_plan_terms();
  info.create = [](StrategyContext& ctx, Roles& roles) {
    roles.reducer = std::make_unique<ReduceScatterReducer>(ctx.grid.dp());
    const double bucket_mb = ctx.deck.get_float("zero.bucket_mb");
    const bool overlap = ctx.deck.get_bool("zero.overlap_comm");
    if (auto* sharded = dynamic_cast<ShardedStore*>(&ctx.model.store())) {
      roles.grad_sync =
          std::make_unique<ShardedSync>(ctx.grid.dp(), ctx.backend, ctx.model, *sharded, bucket_mb, overlap);
      return;
    }
    // Another strategy's store in the run (one that replaced zero's): refused by name, never bad_cast.
    const auto* store = dynamic_cast<const ZeroStore*>(&ctx.model.store());
    if (!store)
      throw InputError("zero.stage = " + std::to_string(ctx.deck.get_int("zero.stage")) +
                       ": ZeRO's gradient sync needs ZeRO's parameter store, but the run's store is " +
                       quote_value(ctx.model.store().name()) +
                       " (another strategy supplies it); set zero.stage = 0, or leave the store to zero");
    roles.grad_sync = std::make_unique<ZeroSync>(ctx.grid.dp(), ctx.backend, ctx.model, bucket_mb, overlap, *store);
  };
}

}  // namespace
}  // namespace loom

extern "C" const loom_plugin_v1* loom_plugin_entry(void) {
  static const loom_plugin_v1 plugin = {LOOM_PLUGIN_ABI_VERSION, "zero", "0.1.0",
                                        "ZeRO over the data-parallel ranks: stages 1-3 (optimizer state, gradients, "
                                        "parameters sharded)",
                                        loom::register_zero};
  return &plugin;
}
