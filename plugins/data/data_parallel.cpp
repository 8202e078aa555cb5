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
  // Buckets in backward order (units in reverse, tensors in reverse), each a run of tensors whose
  // gradients are adjacent in the store's memory, closed once it holds at least bucket_mb (or where
  // the next tensor is not adjacent: a store that keeps units apart gets buckets per unit).
  DataParallelSync(Communicator& dp, Backend& backend, GPT& model, double bucket_mb, bool overlap)
      : dp_(dp), be_(backend), overlap_(overlap) {
    const auto& params = model.params();
    const double limit = bucket_mb * 1024.0 * 1024.0;
    bucket_of_.assign(params.size(), -1);
    std::vector<int> order;  // backward order
    for (auto u = model.units().rbegin(); u != model.units().rend(); ++u)
      for (auto i = u->params.rbegin(); i != u->params.rend(); ++i) order.push_back(*i);
    Bucket cur;
    const float* lo_ptr = nullptr;
    auto close = [&] {
      if (cur.tensors.empty()) return;
      cur.data = BufferRef(const_cast<float*>(lo_ptr), cur.elements);
      buckets_.push_back(std::move(cur));
      cur = Bucket{};
    };
    for (int p : order) {
      const float* g = model.grad_ptr(p);
      const std::int64_t n = params[static_cast<std::size_t>(p)].numel;
      // Backward order walks the flat layout downwards: a tensor joins the bucket if it ends where
      // the bucket starts.
      if (!cur.tensors.empty() && g + n != lo_ptr) close();
      lo_ptr = g;
      cur.elements += n;
      cur.tensors.insert(cur.tensors.begin(), {p, params[static_cast<std::size_t>(p)].name,
                                                params[static_cast<std::size_t>(p)].local_shape, 0, n});
      bucket_of_[static_cast<std::size_t>(p)] = static_cast<int>(buckets_.size());
      if (static_cast<double>(cur.elements) * sizeof(float) >= limit) close();
    }
    close();
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      Bucket& k = buckets_[b];
      k.index = static_cast<int>(b);
      std::int64_t at = 0;
      for (auto& t : k.tensors) {
        t.offset = at;
        at += t.count;
      }
      k.params = static_cast<int>(k.tensors.size());
    }
  }

  std::string name() const override {
    return "data-parallel " + (reducer_ ? reducer_->name() : std::string("(no reducer)")) + ", " +
           std::to_string(buckets_.size()) + " bucket" + (buckets_.size() == 1 ? "" : "s") +
           (overlap_ ? ", overlapped with backward" : ", after backward");
  }

  void use_reducer(Reducer* reducer) override { reducer_ = reducer; }

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
    bytes_before_ = dp_.stats().total_bytes();
  }

  void grads_ready(GPT& model, int unit) override {
    if (!last_micro_ || !overlap_ || dp_.size() == 1) return;
    for (int p : model.units()[static_cast<std::size_t>(unit)].params) {
      Bucket& b = buckets_[static_cast<std::size_t>(bucket_of_[static_cast<std::size_t>(p)])];
      if (--b.pending == 0) start(b);
    }
    dp_.progress();
  }

  void finish(GPT&) override {
    if (dp_.size() == 1) return;
    for (auto& b : buckets_)
      if (!b.req) start(b);
    for (auto& b : buckets_) b.req->wait();
    gradient_bytes_ = 0;
    for (auto& b : buckets_) {
      be_.scale(b.data.as<float>(), 1.0f / static_cast<float>(dp_.size()), b.data.count);
      gradient_bytes_ += static_cast<double>(b.data.bytes());
    }
    measured_bytes_ = static_cast<double>(dp_.stats().total_bytes() - bytes_before_);
    last_micro_ = false;
  }

  double mean_over_replicas(double local) override { return dp_.size() == 1 ? local : dp_.sum(local) / dp_.size(); }

  std::vector<std::pair<std::string, double>> step_report() const override {
    if (dp_.size() == 1) return {};
    const double ring = ring_all_reduce_bytes(gradient_bytes_, dp_.size());
    std::vector<std::pair<std::string, double>> r = {{"dp_allreduce_bytes", measured_bytes_},
                                                     {"dp_allreduce_ring_bytes", ring},
                                                     {"dp_allreduce_ratio", ring > 0 ? measured_bytes_ / ring : 0.0}};
    for (Reducer* k = reducer_; k; k = k->inner())
      for (auto& kv : k->step_report()) r.push_back(kv);
    return r;
  }

 private:
  struct Bucket : GradBucket {
    std::int64_t elements = 0;  // while the bucket is built
    int params = 0, pending = 0;
    CommRequestPtr req;
  };
  void start(Bucket& b) { b.req = reducer_->reduce_async(b); }

  Communicator& dp_;
  Backend& be_;
  bool overlap_;
  Reducer* reducer_ = nullptr;
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
  info.claims = {{Role::grad_sync, Claim::provides, ""}, {Role::reducer, Claim::provides, ""}};
  info.create = [](StrategyContext& ctx, Roles& roles) {
    roles.reducer = std::make_unique<AllReduceReducer>(ctx.grid.dp());
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
