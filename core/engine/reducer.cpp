#include "core/engine/reducer.hpp"

#include "core/backend/backend.hpp"

namespace loom {
namespace {

// Completes the inner reduction, then casts the reduced 16-bit copy back into the fp32 bucket.
class CastBackRequest final : public CommRequest {
 public:
  CastBackRequest(CommRequestPtr inner, BackendFace& be, BufferRef fp32, BufferRef narrow, bool* busy)
      : inner_(std::move(inner)), be_(be), fp32_(fp32), narrow_(narrow), busy_(busy) {}
  bool test() override {
    if (done_) return true;
    if (!inner_->test()) return false;
    finish();
    return true;
  }
  void wait() override {
    if (done_) return;
    inner_->wait();
    finish();
  }

 private:
  void finish() {
    be_.cast(fp32_, narrow_);
    *busy_ = false;  // the scratch is free for the next bucket
    done_ = true;
  }
  CommRequestPtr inner_;
  BackendFace& be_;
  BufferRef fp32_, narrow_;
  bool* busy_;
  bool done_ = false;
};

}  // namespace

CastReducer::CastReducer(std::unique_ptr<Reducer> inner, BackendFace& backend, DType type)
    : inner_(std::move(inner)), be_(backend), type_(type) {}

void plan_ring_in_order(StepPlan& plan, const std::string& group, const std::vector<Reducer::BucketScratch>& buckets,
                        const std::vector<std::size_t>& first) {
  for (std::size_t j = 0; j < buckets.size(); ++j) {
    std::vector<double> in_flight;
    for (std::size_t i = first.at(j); i < j; ++i)
      in_flight.insert(in_flight.end(), buckets[i].ring.begin(), buckets[i].ring.end());
    for (double b : buckets[j].blocking) {
      std::vector<double> with = in_flight;
      with.push_back(b);
      plan.ring_scratch(group, with);
    }
    in_flight.insert(in_flight.end(), buckets[j].ring.begin(), buckets[j].ring.end());
    plan.ring_scratch(group, in_flight);
  }
}

Reducer::BucketScratch AllReduceReducer::plan_bucket(StepPlan& plan, const GradBucket& b,
                                                     const std::string& what) const {
  const int n = comm_.size();
  if (n == 1) return {};
  plan.add_comm({comm_.name(), what + " all-reduce", ring_all_reduce_bytes(static_cast<double>(b.data.bytes()), n),
                 2.0 * (n - 1), false});
  return {{static_cast<double>(ring_all_reduce_scratch(b.data.count, n, dtype_size(b.data.type)))}, {}, 0};
}

// The inner reducer on the narrow copy, and the copy itself while it is in flight.
Reducer::BucketScratch CastReducer::plan_bucket(StepPlan& plan, const GradBucket& b, const std::string& what) const {
  GradBucket narrow = b;
  narrow.data = BufferRef(nullptr, type_, b.data.count, b.data.space);
  BucketScratch s = inner_->plan_bucket(plan, narrow, what + " in " + dtype_name(type_));
  s.held += static_cast<double>(narrow.data.bytes());
  return s;
}

std::string CastReducer::name() const { return inner_->name() + " in " + dtype_name(type_); }

CommRequestPtr CastReducer::reduce_async(const GradBucket& bucket) {
  Slot* slot = nullptr;
  for (auto& s : slots_)
    if (!s->busy) slot = s.get();
  if (!slot) {
    slots_.push_back(std::make_unique<Slot>());
    slot = slots_.back().get();
  }
  ensure_capacity(be_, slot->buffer, "CastReducer::bucket", type_, bucket.data.count, Mem::comm);
  slot->busy = true;
  const BufferRef narrow = slot->buffer.ref().slice(0, bucket.data.count);
  be_.cast(narrow, bucket.data);
  GradBucket b = bucket;
  b.data = narrow;
  return std::make_unique<CastBackRequest>(inner_->reduce_async(b), be_, bucket.data, narrow, &slot->busy);
}

}  // namespace loom
