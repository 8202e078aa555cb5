// The `data` strategy plugin (libloom_data.so): data parallelism. Fills the gradient-sync role with
// the core's BucketedGradSync (core/engine/bucketed_sync.hpp) and the reducer with a ring all-reduce:
// gradients are grouped into buckets of about data_parallel.bucket_mb; a bucket's all-reduce starts as soon
// as backward has finished all its gradients (on the last micro-batch only) and overlaps the rest of
// backward; at the end of backward the remaining buckets are waited on and the sum is turned into a
// mean. Each dp rank reads only its part of every global batch (the core's batch slicing), and the
// loss is averaged over the dp group, so the logged numbers mean the same at any dp.
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "core/engine/bucketed_sync.hpp"
#include "core/comm/fault.hpp"
#include "core/engine/plugin.hpp"

namespace loom {
namespace {

// The core's bucketed sync, with the regression cases' injected fault (LOOM_INJECT_FAULT
// where=plugin) thrown from inside this plugin's work, counting steps from the first of this run.
class DataGradSync final : public BucketedGradSync {
 public:
  using BucketedGradSync::BucketedGradSync;
  void begin_micro_batch(GPT& model, int k, int m) override {
    if (k == 0 && inject_fault("plugin", step_))
      throw std::runtime_error("data plugin: injected fault at step " + std::to_string(step_) + " (LOOM_INJECT_FAULT)");
    if (k == m - 1) ++step_;
    BucketedGradSync::begin_micro_batch(model, k, m);
  }

 private:
  std::int64_t step_ = 0;
};

void register_data(void* p) {
  auto& info = *static_cast<StrategyInfo*>(p);
  // Their own section: [data] is the dataset's (and a resume reports a changed data.* key as a
  // changed training key). The former names are refused with the new ones.
  KeySpec bucket =
      float_key("data_parallel.bucket_mb", "25", 0.001, 1e6,
                "gradient bucket size in MiB; each bucket's all-reduce starts when its gradients are done");
  bucket.former_names = {"data.bucket_mb"};
  KeySpec overlap =
      bool_key("data_parallel.overlap", "true", "start bucket all-reduces during backward (false: all after backward)");
  overlap.former_names = {"data.overlap"};
  info.keys.push_back(bucket);
  info.keys.push_back(overlap);
  info.claims = {{Role::grad_sync, Claim::provides, ""}, {Role::reducer, Claim::provides, ""}};
  info.create = [](StrategyContext& ctx, Roles& roles) {
    roles.reducer = std::make_unique<AllReduceReducer>(ctx.grid.dp());
    roles.grad_sync = std::make_unique<DataGradSync>(ctx.grid.dp(), ctx.backend, ctx.model,
                                                     ctx.deck.get_float("data_parallel.bucket_mb"),
                                                     ctx.deck.get_bool("data_parallel.overlap"));
  };
}

}  // namespace
}  // namespace loom

extern "C" const loom_plugin_v1* loom_plugin_entry(void) {
  static const loom_plugin_v1 plugin = {LOOM_PLUGIN_ABI_VERSION, "data", "0.1.0",
                                        "data parallelism: bucketed gradient all-reduce overlapped with backward",
                                        loom::register_data};
  return &plugin;
}
