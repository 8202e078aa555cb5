// The `data` strategy plugin (libloom_data.so): data parallelism. Fills the gradient-sync role:
// gradients are grouped into buckets of about data.bucket_mb; a bucket's all-reduce starts as soon
// as backward has finished all its gradients (on the last micro-batch only) and overlaps the rest of
// backward; at the end of backward the remaining buckets are waited on and the sum is turned into a
// mean. Each dp rank reads only its part of every global batch (the core's batch slicing), and the
// loss is averaged over the dp group, so the logged numbers mean the same at any dp.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "core/comm.hpp"
#include "core/fault.hpp"
#include "core/grid.hpp"
#include "core/plugin.hpp"

namespace loom {
namespace {

class DataParallelSync final : public GradSync {
 public:
  DataParallelSync(Communicator& dp, Backend& backend, GPT& model, double bucket_mb, bool overlap)
      : dp_(dp), be_(backend), overlap_(overlap) {
    // Buckets in backward order (parameters in reverse), each a contiguous range of the flat
    // gradient buffer, closed once it holds at least bucket_mb.
    const auto& params = model.params();
    const double limit = bucket_mb * 1024.0 * 1024.0;
    bucket_of_.assign(params.size(), -1);
    Bucket cur;
    for (int p = static_cast<int>(params.size()) - 1; p >= 0; --p) {
      if (cur.params == 0) {
        cur.hi = params[p].offset + params[p].numel;
      }
      cur.lo = params[p].offset;
      ++cur.params;
      bucket_of_[p] = static_cast<int>(buckets_.size());
      if (static_cast<double>(cur.hi - cur.lo) * sizeof(float) >= limit || p == 0) {
        buckets_.push_back(std::move(cur));
        cur = Bucket{};
      }
    }
  }

  std::string name() const override {
    return "data-parallel all-reduce over dp " + std::to_string(dp_.size()) + ", " + std::to_string(buckets_.size()) +
           " bucket" + (buckets_.size() == 1 ? "" : "s") + (overlap_ ? ", overlapped with backward" : ", after backward");
  }

  void begin_micro_batch(GPT&, int k, int m) override {
    if (k == 0 && inject_fault("plugin", step_))
      throw std::runtime_error("data plugin: injected fault at step " + std::to_string(step_) + " (LOOM_INJECT_FAULT)");
    if (k == m - 1) ++step_;
    last_micro_ = k == m - 1;
    if (!last_micro_) return;
    for (auto& b : buckets_) {
      b.pending = b.params;
      b.req.reset();
    }
    bytes_before_ = dp_.stats().bytes_sent[static_cast<int>(CommOp::all_reduce)];
  }

  void grads_ready(GPT& model, int first, int end) override {
    if (!last_micro_ || !overlap_ || dp_.size() == 1) return;
    for (int p = first; p < end; ++p) {
      Bucket& b = buckets_[bucket_of_[p]];
      if (--b.pending == 0) start(model, b);
    }
    dp_.progress();
  }

  void finish(GPT& model) override {
    if (dp_.size() == 1) return;
    for (auto& b : buckets_)
      if (!b.req) start(model, b);
    for (auto& b : buckets_) b.req->wait();
    be_.scale(model.grad_data(), 1.0f / static_cast<float>(dp_.size()), model.num_params());
    const auto after = dp_.stats().bytes_sent[static_cast<int>(CommOp::all_reduce)];
    measured_bytes_ = static_cast<double>(after - bytes_before_);
    gradient_bytes_ = static_cast<double>(model.num_params()) * sizeof(float);
    last_micro_ = false;
  }

  double mean_over_replicas(double local) override { return dp_.size() == 1 ? local : dp_.sum(local) / dp_.size(); }
  double grad_sq_norm(double local) override { return local; }  // gradients are replicated after finish()

  std::vector<std::pair<std::string, double>> step_report() const override {
    if (dp_.size() == 1) return {};
    const double ring = ring_all_reduce_bytes(gradient_bytes_, dp_.size());
    return {{"dp_allreduce_bytes", measured_bytes_},
            {"dp_allreduce_ring_bytes", ring},
            {"dp_allreduce_ratio", ring > 0 ? measured_bytes_ / ring : 0.0}};
  }

 private:
  struct Bucket {
    std::int64_t lo = 0, hi = 0;
    int params = 0, pending = 0;
    CommRequestPtr req;
  };
  void start(GPT& model, Bucket& b) { b.req = dp_.all_reduce_async(model.grad_data() + b.lo, b.hi - b.lo); }

  Communicator& dp_;
  Backend& be_;
  bool overlap_;
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_;
  bool last_micro_ = false;
  std::int64_t step_ = 0;
  std::uint64_t bytes_before_ = 0;
  double measured_bytes_ = 0, gradient_bytes_ = 0;
};

void register_data(void* p) {
  auto& info = *static_cast<StrategyInfo*>(p);
  info.keys.push_back(float_key("data.bucket_mb", "25", 0.001, 1e6,
                                "data parallel: gradient bucket size in MiB; each bucket's all-reduce starts "
                                "when its gradients are done"));
  info.keys.push_back(bool_key("data.overlap", "true",
                               "data parallel: start bucket all-reduces during backward (false: all after backward)"));
  info.create = [](StrategyContext& ctx, Roles& roles) {
    roles.grad_sync = std::make_unique<DataParallelSync>(ctx.grid.dp(), ctx.backend, ctx.model,
                                                         ctx.deck.get_float("data.bucket_mb"),
                                                         ctx.deck.get_bool("data.overlap"));
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
