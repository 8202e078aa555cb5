#pragma once
// Bucketed gradient synchronisation over the data-parallel group (DESIGN.md "The roles as filled
// today"): gradients are grouped into buckets of about `bucket_mb`, in backward order; a bucket's
// reduction starts through the run's Reducer as soon as backward has finished all its tensors (on
// the last micro-batch only) and overlaps the rest of backward; `finish` waits for the rest and turns
// the sums into means. The `data` strategy runs it with an all-reduce; `zero` with a reduce-scatter
// that leaves each rank the sum of the elements it owns (BucketPlan::rank_counts).
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/comm/comm.hpp"
#include "core/engine/engine.hpp"
#include "core/engine/reducer.hpp"

namespace loom {

// How a strategy shapes the buckets: which tensors go in buckets of their own (`whole`: reduced in
// full, e.g. a tied embedding another stage adds to), and for the others how many of a bucket's
// elements each rank of the group owns (`rank_counts`, empty: every rank gets the whole sum).
struct BucketPlan {
  std::function<bool(int param)> whole;
  std::function<std::vector<std::int64_t>(const GradBucket&)> rank_counts;
  // At most this many buckets in flight (0: no limit): starting one more first waits for the oldest,
  // which bounds the collectives' scratch (DeepSpeed's double-buffered buckets: 2).
  int max_in_flight = 0;
};

class BucketedGradSync : public GradSync {
 public:
  BucketedGradSync(Communicator& dp, BackendFace& backend, GPT& model, double bucket_mb, bool overlap,
                   BucketPlan plan = {});
  std::string name() const override;
  void use_reducer(Reducer* reducer) override { reducer_ = reducer; }
  void begin_micro_batch(GPT& model, int k, int m) override;
  void grads_ready(GPT& model, int unit) override;
  void finish(GPT& model) override;
  double mean_over_replicas(double local) override { return dp_.size() == 1 ? local : dp_.sum(local) / dp_.size(); }
  // dp_allreduce_bytes (measured), dp_allreduce_ring_bytes (2(N-1)/N M) and their ratio, then the
  // reducers' own numbers.
  std::vector<std::pair<std::string, double>> step_report() const override;
  // The ring all-reduce's measured bytes against 2(N-1)/N M, then the reducers' lines.
  std::vector<std::string> summary_lines(const std::map<std::string, double>& means) const override;
  const std::vector<GradBucket>& buckets() const { return plain_; }
  void plan_step(StepPlan& plan) const override;

 protected:
  // Reducers' numbers and summary lines, outermost first.
  void append_reducer_report(std::vector<std::pair<std::string, double>>& r) const;
  void append_reducer_summary(const std::map<std::string, double>& means, std::vector<std::string>& lines) const;
  Communicator& dp_;
  BackendFace& be_;
  bool overlap_;
  Reducer* reducer_ = nullptr;
  double measured_bytes_ = 0, gradient_bytes_ = 0;  // of the last step's reduction
  std::uint64_t bytes_before_ = 0;

 private:
  struct Bucket : GradBucket {
    std::int64_t elements = 0;  // while the bucket is built
    int params = 0, pending = 0;
    CommRequestPtr req;
  };
  void start(Bucket& b);

  std::vector<Bucket> buckets_;
  std::vector<GradBucket> plain_;  // the buckets' descriptions, for reports and tests
  std::vector<int> bucket_of_;
  std::vector<Bucket*> in_flight_;  // started and not yet waited on, oldest first
  int max_in_flight_ = 0;
  bool last_micro_ = false;
};

}  // namespace loom
