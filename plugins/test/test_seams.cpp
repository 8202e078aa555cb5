// Strategies that exist to test the core's seams (built into build/test-plugins/, never on the
// default plugin path). Which one is compiled is chosen by a macro:
//   LOOM_TEST_SYNC_CLASH  "syncclash": provides the gradient-sync role, as the data strategy does,
//                         without declaring that it replaces it: a run with parallel.dp > 1 must be
//                         refused before any work, naming both.
//   LOOM_TEST_UNDECLARED  "undeclared": fills the gradient-sync role without claiming it: refused.
//   LOOM_TEST_COUNT       "countreducer": wraps the data strategy's reducer and counts what passes
//                         through it (every bucket, its tensors and elements), keeps a per-element
//                         count of reductions as checkpoint state of its own (a tensor per
//                         parameter and an attribute), and registers a hook in every step phase to
//                         check their order. Its numbers go into the step's metrics.
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/engine/checkpoint_part.hpp"
#include "core/engine/plugin.hpp"

namespace loom {
namespace {

#if defined(LOOM_TEST_COUNT)
class CountingReducer final : public Reducer, public CheckpointContributor {
 public:
  CountingReducer(std::unique_ptr<Reducer> inner, GPT& model, BackendFace& be)
      : inner_(std::move(inner)), model_(model) {
    for (std::size_t i = 0; i < model.params().size(); ++i) {
      const ParamInfo& p = model.params()[i];
      seen_.push_back(be.allocate("countreducer::seen." + p.name, DType::f32, p.numel(), Mem::workspace));
    }
  }
  std::string name() const override { return "counted " + inner_->name(); }
  Reducer* inner() override { return inner_.get(); }
  CommRequestPtr reduce_async(const GradBucket& b) override {
    ++buckets_;
    ++buckets_total_;
    tensors_ += static_cast<double>(b.tensors.size());
    std::int64_t covered = 0;
    for (const GradBucket::Tensor& t : b.tensors) {
      // The tensor's gradient (its part from t.begin) is where the bucket says it is.
      if (b.data.as<float>() + t.offset != model_.grad_ref(t.param).as<float>() + t.begin) misplaced_ += 1;
      covered += t.count;
      float* s = seen_[static_cast<std::size_t>(t.param)].data<float>() + t.begin;
      for (std::int64_t k = 0; k < t.count; ++k) s[k] += 1.0f;
    }
    if (covered != b.data.count) misplaced_ += 1;
    elements_ += static_cast<double>(b.data.count);
    return inner_->reduce_async(b);
  }
  std::vector<std::pair<std::string, double>> step_report() const override {
    double seen_sum = 0;
    for (const TypedBuffer& s : seen_)
      for (std::int64_t k = 0; k < s.count(); ++k) seen_sum += s.data<float>()[k];
    auto r = std::vector<std::pair<std::string, double>>{{"countreducer_buckets", buckets_},
                                                         {"countreducer_tensors", tensors_},
                                                         {"countreducer_elements", elements_},
                                                         {"countreducer_misplaced", misplaced_},
                                                         {"countreducer_buckets_total", buckets_total_},
                                                         {"countreducer_seen_sum", seen_sum},
                                                         {"countreducer_phase_order_ok", phases_ok_ ? 1.0 : 0.0}};
    buckets_ = tensors_ = elements_ = 0;
    return r;
  }
  // Checkpoint state of its own: the counts, laid out like the parameters, and the bucket total.
  std::string checkpoint_name() const override { return "countreducer"; }
  std::vector<CheckpointTensor> checkpoint_tensors() override {
    std::vector<CheckpointTensor> out;
    for (const ParamInfo& whole : model_.all_params()) {
      CheckpointTensor t;
      t.path = "/plugins/countreducer/seen/" + whole.name;
      const int i = model_.param_index(whole.name);
      if (i < 0) {
        t.shard = ShardDesc::make(whole.shape(), TpSplit::none, 1, 0);
      } else {
        const ParamInfo& p = model_.params()[static_cast<std::size_t>(i)];
        t.shard = p.shard;
        t.data = seen_[static_cast<std::size_t>(i)].ref();
        t.holds = true;
        for (const OwnedSlice& o : model_.store().owned())
          if (o.param == i && o.primary) {
            t.primary_begin = o.begin;
            t.primary_end = o.end;
          }
      }
      t.required = false;  // a checkpoint of a run without this strategy still loads
      out.push_back(std::move(t));
    }
    return out;
  }
  std::map<std::string, double> checkpoint_attributes() const override {
    return {{"countreducer.buckets_total", buckets_total_}};
  }
  void restore_attributes(const std::map<std::string, double>& found) override {
    auto it = found.find("countreducer.buckets_total");
    if (it != found.end()) buckets_total_ = it->second;
  }
  // Phase hooks: each phase must come after the one before it, once per step.
  void phase(StepPhase p) {
    const int k = static_cast<int>(p);
    if (k != (last_phase_ + 1) % kStepPhases) phases_ok_ = false;
    last_phase_ = k;
  }

 private:
  std::unique_ptr<Reducer> inner_;
  GPT& model_;
  std::vector<TypedBuffer> seen_;
  mutable double buckets_ = 0, tensors_ = 0, elements_ = 0;
  double misplaced_ = 0, buckets_total_ = 0;
  int last_phase_ = kStepPhases - 1;
  bool phases_ok_ = true;
};
#endif

void register_test(void* p) {
  auto& info = *static_cast<StrategyInfo*>(p);
#if defined(LOOM_TEST_SYNC_CLASH)
  info.claims = {{Role::grad_sync, Claim::provides, ""}};
  info.create = [](StrategyContext&, Roles& roles) { roles.grad_sync = std::make_unique<GradSync>(); };
#elif defined(LOOM_TEST_UNDECLARED)
  info.create = [](StrategyContext&, Roles& roles) { roles.grad_sync = std::make_unique<GradSync>(); };
#elif defined(LOOM_TEST_COUNT)
  info.claims = {{Role::reducer, Claim::wraps, "data"}, {Role::phase_hooks, Claim::provides, ""}};
  info.create = [](StrategyContext& ctx, Roles& roles) {
    auto counter = std::make_shared<CountingReducer*>(nullptr);
    GPT& model = ctx.model;
    BackendFace& be = ctx.backend;
    roles.wrap_reducer = [counter, &model, &be](std::unique_ptr<Reducer> inner) -> std::unique_ptr<Reducer> {
      auto r = std::make_unique<CountingReducer>(std::move(inner), model, be);
      *counter = r.get();
      return r;
    };
    for (int k = 0; k < kStepPhases; ++k) {
      const StepPhase phase = static_cast<StepPhase>(k);
      roles.hooks.push_back({phase, "", [counter, phase](StepState&) {
                               if (*counter) (*counter)->phase(phase);
                             }});
    }
  };
#endif
}

}  // namespace
}  // namespace loom

extern "C" const loom_plugin_v1* loom_plugin_entry(void) {
#if defined(LOOM_TEST_SYNC_CLASH)
  static const loom_plugin_v1 p = {LOOM_PLUGIN_ABI_VERSION, "syncclash", "0.0.1",
                                   "a test strategy that provides gradient sync without replacing data",
                                   loom::register_test};
#elif defined(LOOM_TEST_UNDECLARED)
  static const loom_plugin_v1 p = {LOOM_PLUGIN_ABI_VERSION, "undeclared", "0.0.1",
                                   "a test strategy that fills gradient sync without claiming it", loom::register_test};
#else
  static const loom_plugin_v1 p = {LOOM_PLUGIN_ABI_VERSION, "countreducer", "0.0.1",
                                   "a test strategy that wraps data's reducer and counts every bucket",
                                   loom::register_test};
#endif
  return &p;
}
