#pragma once
// The gradient reducer (DESIGN.md "Declared composition"): the collective that data parallelism runs
// on each bucket of gradients. The `data` strategy provides one (a ring all-reduce over the dp
// group); another strategy may wrap it (gradient compression) and then sees every bucket, with the
// tensors and shapes it holds, before the collective does.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/base/buffer.hpp"
#include "core/comm/comm.hpp"
#include "core/base/dtype.hpp"
#include "core/comm/step_plan.hpp"

namespace loom {

// A bucket: contiguous gradient storage holding whole tensors (or, with a sharded store, slices).
struct GradBucket {
  struct Tensor {
    int param = -1;                      // index into the model's params()
    std::string name;                    // "blocks.3.mlp.fc.weight"
    std::vector<std::int64_t> shape;     // this rank's local shape of it
    std::int64_t offset = 0, count = 0;  // where it lies in `data`
    std::int64_t begin = 0;              // its first element's index in the tensor's local elements (0 when whole)
  };
  int index = 0;   // 0 is the first bucket backward completes
  BufferRef data;  // the gradients, reduced in place
  std::vector<Tensor> tensors;
  // Empty: every rank needs the whole sum (an all-reduce). Else rank r of the group owns elements
  // [sum of counts before r, + rank_counts[r]) of the bucket and needs only their sum there (ZeRO's
  // reduce-scatter); the other elements are left undefined.
  std::vector<std::int64_t> rank_counts;
  bool whole = false;  // the strategy asked for this tensor whole (rank_counts stays empty)
};

class Reducer {
 public:
  virtual ~Reducer() = default;
  virtual std::string name() const = 0;
  // Starts the sum of `bucket` over the group, in place; the request completes it. Buckets of a
  // step are started in order, each once, and all are waited on before the step's gradients are used.
  virtual CommRequestPtr reduce_async(const GradBucket& bucket) = 0;
  // The reducer this one wraps (null: none), so the run can find every layer of a chain.
  virtual Reducer* inner() { return nullptr; }
  // Numbers for the metrics of the last step.
  virtual std::vector<std::pair<std::string, double>> step_report() const { return {}; }
  // The run summary's lines about this reducer (GradSync::summary_lines, which asks each of its chain).
  virtual std::vector<std::string> summary_lines(const std::map<std::string, double>& /*means*/) const { return {}; }
  // `loom plan`: adds the bytes reducing `bucket` moves to `plan` (CommCost::what names it) and says
  // the scratch it takes: from the communicator's pool, `ring` for each collective it leaves in
  // flight (asynchronous) and `blocking` for each it completes before returning (int8's chunk maxima,
  // PowerSGD's all-reduces), one entry per collective as the pool keeps buffers per size class;
  // `held` its own while in flight.
  struct BucketScratch {
    std::vector<double> ring, blocking;
    double held = 0;
  };
  virtual BucketScratch plan_bucket(StepPlan& /*plan*/, const GradBucket& /*bucket*/,
                                    const std::string& /*what*/) const {
    return {};
  }
  // `loom plan`: what this reducer does once a step beyond its buckets (a compressing reducer's
  // replica hash); the planner calls it for every reducer of the chain.
  virtual void plan_step(StepPlan& /*plan*/) const {}
};

// `loom plan`: the pool scratch of buckets reduced in order, bucket j starting while the asynchronous
// collectives of buckets [first[j], j) are still in flight: each of j's blocking collectives beside
// those, then j's asynchronous ones with them (StepPlan::ring_scratch on `group`).
void plan_ring_in_order(StepPlan& plan, const std::string& group, const std::vector<Reducer::BucketScratch>& buckets,
                        const std::vector<std::size_t>& first);

// The plain one: a sum all-reduce on `comm`.
class AllReduceReducer final : public Reducer {
 public:
  explicit AllReduceReducer(Communicator& comm) : comm_(comm) {}
  std::string name() const override { return "all-reduce over " + comm_.name() + " " + std::to_string(comm_.size()); }
  CommRequestPtr reduce_async(const GradBucket& b) override { return comm_.all_reduce_async(b.data, ReduceOp::sum); }
  BucketScratch plan_bucket(StepPlan& plan, const GradBucket& bucket, const std::string& what) const override;

 private:
  Communicator& comm_;
};

class BackendFace;

// The gradient collective in a narrower type (precision.reduce_dtype): each bucket is cast from fp32
// into a scratch buffer of `type` (a pool with one buffer per bucket in flight, filed under
// Mem::comm), reduced there by the
// inner reducer (16-bit sums are added in fp32 and rounded once per ring step), and cast back into
// the fp32 bucket when the request completes. Half the bytes on the wire, and every element of the
// sum rounded to the type. The session puts it directly around the providing strategy's reducer,
// inside any wrapper, so that a wrapping strategy still sees fp32 gradients.
class CastReducer final : public Reducer {
 public:
  CastReducer(std::unique_ptr<Reducer> inner, BackendFace& backend, DType type);
  std::string name() const override;
  CommRequestPtr reduce_async(const GradBucket& bucket) override;
  Reducer* inner() override { return inner_.get(); }
  BucketScratch plan_bucket(StepPlan& plan, const GradBucket& bucket, const std::string& what) const override;

 private:
  std::unique_ptr<Reducer> inner_;
  BackendFace& be_;
  DType type_;
  struct Slot {
    TypedBuffer buffer;
    bool busy = false;  // a reduction in flight uses it
  };
  std::vector<std::unique_ptr<Slot>> slots_;
};

// What a wrapping strategy supplies: given the reducer it wraps, the one that replaces it.
using ReducerWrapper = std::function<std::unique_ptr<Reducer>(std::unique_ptr<Reducer> inner)>;

}  // namespace loom
