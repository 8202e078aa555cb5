#include "core/engine/bucketed_sync.hpp"

#include <cstdio>
#include <stdexcept>

namespace loom {

// Buckets in backward order (units in reverse, tensors in reverse), each a run of tensors whose
// gradients are adjacent in the store's memory, closed once it holds at least bucket_mb (or where
// the next tensor is not adjacent: a store that keeps units apart gets buckets per unit). A tensor
// the plan wants whole gets a bucket of its own.
BucketedGradSync::BucketedGradSync(Communicator& dp, BackendFace& backend, GPT& model, double bucket_mb, bool overlap,
                                   BucketPlan plan)
    : dp_(dp), be_(backend), overlap_(overlap), max_in_flight_(plan.max_in_flight) {
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
    cur.data = BufferRef(const_cast<float*>(lo_ptr), cur.elements, be_.space());
    buckets_.push_back(std::move(cur));
    cur = Bucket{};
  };
  for (int p : order) {
    // An expert's tensor held by some replicas only (parallel.ep > 1) is summed over those, by the
    // experts role (ExpertSplit::finish_grads), not here.
    if (params[static_cast<std::size_t>(p)].expert) {
      close();
      lo_ptr = nullptr;
      continue;
    }
    const float* g = model.grad_ref(p).as<float>();
    const std::int64_t n = params[static_cast<std::size_t>(p)].numel();
    const bool whole = plan.whole && plan.whole(p);
    // Backward order walks the flat layout downwards: a tensor joins the bucket if it ends where
    // the bucket starts.
    if (!cur.tensors.empty() && (g + n != lo_ptr || whole)) close();
    lo_ptr = g;
    cur.elements += n;
    cur.tensors.insert(cur.tensors.begin(), {p, params[static_cast<std::size_t>(p)].name,
                                             params[static_cast<std::size_t>(p)].local_shape(), 0, n});
    bucket_of_[static_cast<std::size_t>(p)] = static_cast<int>(buckets_.size());
    if (static_cast<double>(cur.elements) * sizeof(float) >= limit || whole) {
      cur.whole = whole;
      close();
    }
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
    if (plan.rank_counts && !k.whole) k.rank_counts = plan.rank_counts(k);
    plain_.push_back(static_cast<const GradBucket&>(k));
  }
}

void BucketedGradSync::start(Bucket& b) {
  if (max_in_flight_ > 0)
    while (static_cast<int>(in_flight_.size()) >= max_in_flight_) {
      in_flight_.front()->req->wait();
      in_flight_.erase(in_flight_.begin());
    }
  b.req = reducer_->reduce_async(b);
  in_flight_.push_back(&b);
}

std::string BucketedGradSync::name() const {
  return "data-parallel " + (reducer_ ? reducer_->name() : std::string("(no reducer)")) + ", " +
         std::to_string(buckets_.size()) + " bucket" + (buckets_.size() == 1 ? "" : "s") +
         (overlap_ ? ", overlapped with backward" : ", after backward") +
         (max_in_flight_ > 0 ? ", at most " + std::to_string(max_in_flight_) + " in flight" : "");
}

void BucketedGradSync::begin_micro_batch(GPT&, int k, int m) {
  last_micro_ = k == m - 1;
  if (!last_micro_) return;
  for (auto& b : buckets_) {
    b.pending = b.params;
    b.req.reset();
  }
  in_flight_.clear();
  bytes_before_ = dp_.stats().total_bytes();
}

void BucketedGradSync::grads_ready(GPT& model, int unit) {
  if (!last_micro_ || !overlap_ || dp_.size() == 1) return;
  for (int p : model.units()[static_cast<std::size_t>(unit)].params) {
    if (bucket_of_[static_cast<std::size_t>(p)] < 0) continue;  // an expert's (ExpertSplit::finish_grads)
    Bucket& b = buckets_[static_cast<std::size_t>(bucket_of_[static_cast<std::size_t>(p)])];
    if (--b.pending == 0) start(b);
  }
  dp_.progress();
}

void BucketedGradSync::finish(GPT&) {
  if (dp_.size() == 1) return;
  for (auto& b : buckets_)
    if (!b.req) start(b);
  for (auto& b : buckets_) b.req->wait();
  in_flight_.clear();
  gradient_bytes_ = 0;
  for (auto& b : buckets_) {
    be_.scale(b.data, 1.0f / static_cast<float>(dp_.size()));
    gradient_bytes_ += static_cast<double>(b.data.bytes());
  }
  measured_bytes_ = static_cast<double>(dp_.stats().total_bytes() - bytes_before_);
  last_micro_ = false;
}

// Every bucket through the reducer chain; the scratch of the buckets that can be in flight together
// (all of them, or max_in_flight consecutive ones) is taken at once. With overlap every bucket but
// the last runs during backward.
void BucketedGradSync::plan_step(StepPlan& plan) const {
  if (dp_.size() == 1 || !reducer_) return;
  std::vector<Reducer::BucketScratch> per;
  for (const Bucket& b : buckets_) {
    const std::size_t first = plan.comm.size();
    per.push_back(reducer_->plan_bucket(plan, b, "gradient bucket " + std::to_string(b.index)));
    for (std::size_t c = first; c < plan.comm.size(); ++c)
      plan.comm[c].overlapped = overlap_ && b.index + 1 < static_cast<int>(buckets_.size());
  }
  const std::size_t window = max_in_flight_ > 0 ? static_cast<std::size_t>(max_in_flight_) : per.size();
  double held = 0;
  std::vector<std::size_t> first(per.size());
  for (std::size_t j = 0; j < per.size(); ++j) {
    first[j] = j + 1 > window ? j + 1 - window : 0;
    double h = 0;
    for (std::size_t i = first[j]; i <= j; ++i) h += per[i].held;
    held = std::max(held, h);
  }
  plan_ring_in_order(plan, dp_.name(), per, first);
  plan.add_scratch(Mem::comm, held);
}

void BucketedGradSync::append_reducer_report(std::vector<std::pair<std::string, double>>& r) const {
  for (Reducer* k = reducer_; k; k = k->inner())
    for (auto& kv : k->step_report()) r.push_back(kv);
}

void BucketedGradSync::append_reducer_summary(const std::map<std::string, double>& means,
                                              std::vector<std::string>& lines) const {
  for (Reducer* k = reducer_; k; k = k->inner())
    for (auto& line : k->summary_lines(means)) lines.push_back(line);
}

std::vector<std::string> BucketedGradSync::summary_lines(const std::map<std::string, double>& means) const {
  std::vector<std::string> lines;
  if (const auto it = means.find("dp_allreduce_ratio"); it != means.end()) {
    char line[160];
    std::snprintf(line, sizeof line, "dp all-reduce: measured bytes / ring 2(N-1)/N*M = %.4f", it->second);
    lines.push_back(line);
  }
  append_reducer_summary(means, lines);
  return lines;
}

std::vector<std::pair<std::string, double>> BucketedGradSync::step_report() const {
  if (dp_.size() == 1) return {};
  const double ring = ring_all_reduce_bytes(gradient_bytes_, dp_.size());
  std::vector<std::pair<std::string, double>> r = {{"dp_allreduce_bytes", measured_bytes_},
                                                   {"dp_allreduce_ring_bytes", ring},
                                                   {"dp_allreduce_ratio", ring > 0 ? measured_bytes_ / ring : 0.0}};
  append_reducer_report(r);
  return r;
}

}  // namespace loom
