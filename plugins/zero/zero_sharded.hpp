#pragma once
// ZeRO stages 2 and 3 (DESIGN.md "The parameter store" and "The roles as filled today"): the store that keeps only this
// rank's share of the gradients (stage 2) and of the parameters too (stage 3), and the gradient sync that
// reduce-scatters each unit's gradients into the shares as backward finishes the unit.
//
// Layout. The tensors a stage-3 run keeps whole (fewer elements than zero.param_persistence_threshold,
// and any tied or shadow tensor) lie in a small "whole" buffer, every rank holding all of them as at
// stage 0 (parameters, gradients all-reduced, AdamW state). Stage 2 under 16-bit precision keeps the
// tensors the model reads in fp32 there (LayerNorm, biases, positions, wte): every rank holds their
// fp32 values and gradients whole, but updates only its share of them (AdamW state of that share),
// the gradients reduce-scattered after the last backward and the updated values all-gathered.
// Every other tensor lies, in model order, in one flat "sharded" range of S elements cut into dp
// shares (shard_counts); rank r owns share r:
// the optimizer updates the owned slices (the intersections of tensors with the share). A unit's
// sharded tensors are one contiguous run [unit_lo, unit_hi) of that range.
//
// Gradients (stages 2, 3). The full gradient buffer is never allocated. When backward first touches
// a unit in a micro-batch the store hands it a staging slot of the unit's size (zeroed); when the
// unit's backward is done the sync reduce-scatters the slot (in bucket_mb pieces, through the run's
// Reducer) and, once that completes, the store adds this rank's part into its gradient share and the
// slot is free again. That happens on every micro-batch: accumulation is in the share, and the
// reduce-scatter traffic is m x (N-1)/N M for m micro-batches (stage 1 accumulates in full, then
// reduces once). At most one unit's reduction is in flight while the next unit's backward runs, so
// the slots alive are: the embeddings' (the tied head writes it first, the embedding last), the unit
// being written and the one in flight.
//
// Parameters. Stage 2 keeps them whole (4P) and all-gathers the updated shares in the refresh phase.
// Stage 3 keeps only the share; acquire(unit) all-gathers the unit's run into a slot (every rank
// contributes its intersection), release frees it unless the unit is used again within the prefetch
// window. Prefetch: during the first step the store records the order in which units are acquired;
// from then on, acquiring the unit at position i starts the gathers of the units at positions
// i+1..i+prefetch_depth, so they travel while the current one computes (before the order is known,
// or if a step departs from it, the model's next-unit hint is fetched instead).
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/comm/comm.hpp"
#include "core/engine/engine.hpp"
#include "core/model/param_store.hpp"

namespace loom {

// The metrics every stage reports: the bytes this rank sent since `before` by kind of collective
// against the textbook volume (stage 1 and 2: 2(N-1)/N M, stage 3: 3(N-1)/N M, M = 4P bytes), the
// ledger's model state (parameters + gradients + AdamW) against the textbook (4P + 4P + 8P/N,
// 4P + 4P/N + 8P/N, 16P/N), and the collectives' scratch.
// Stage 1 with parallel.ep > 1: `experts` of the P elements are experts' tensors, sharded over the
// `expert_group` ranks holding them (Ne), whose refresh all-gather sent `expert_gather_bytes`; the
// textbooks become 2(N-1)/N Md + (Ne-1)/Ne Me (the experts' gradients are the experts role's) and
// 8P + 8Pd/N + 8Pe/Ne.
struct ZeroExperts {
  double elements = 0;
  int group = 1;
  double gather_bytes = 0;
};
std::vector<std::pair<std::string, double>> zero_step_report(int stage, const Communicator& dp, const CommStats& before,
                                                             double params, const ZeroExperts& experts = {});
// The summary's line from those reports' means: the bytes and the model state against the textbook,
// and what loom adds to it.
std::string zero_summary_line(const std::map<std::string, double>& means);

class ShardedStore final : public ParamStore {
 public:
  ShardedStore(Communicator& dp, int stage, std::int64_t persist_below, int prefetch_depth);
  std::string name() const override;
  void build(const StoreContext& ctx, const std::vector<ParamInfo>& params, const std::vector<Unit>& units) override;
  const UnitView& acquire(int unit, Use use, int next_unit) override;
  void release(int unit, Use use) override;
  BufferRef param(int i) override;
  BufferRef grad(int i) override;
  BufferRef owned_param(const OwnedSlice& o) override;
  BufferRef owned_grad(const OwnedSlice& o) override;
  void zero_grads() override;
  const std::vector<OwnedSlice>& owned() const override { return owned_; }
  void refresh() override;
  void end_step() override;
  void local_params_written() override { copies_.mark_stale(); }
  void params_written() override {
    copies_.mark_stale();
    dirty16_ = masters16_;
  }
  std::int64_t local_numel() const override { return sharded_ + whole_; }
  // `loom plan`: the staging slots (the embeddings' and two of the largest unit: the one written and
  // the one in flight), stage 3's gathered slots (the embeddings' and 1 + prefetch depth of the
  // largest unit), and the parameter all-gathers (stage 3: every unit gathered for forward and again
  // for backward, each micro-batch; stage 2: the refresh).
  void plan_step(StepPlan& plan) const override;

  // For the gradient sync.
  int stage() const { return stage_; }
  // Backward is done with unit u for this micro-batch: its gradient staging slot (its sharded run),
  // handed to the caller until accumulate(); the unit's next backward gets a fresh one. Slot -1 when
  // the unit has no sharded tensor.
  struct Staged {
    int unit = -1, slot = -1;
    BufferRef grads;
  };
  Staged detach_grads(int u);
  // Where unit u's run lies in the sharded range.
  std::int64_t unit_lo(int u) const { return unit_lo_[static_cast<std::size_t>(u)]; }
  std::int64_t unit_hi(int u) const { return unit_hi_[static_cast<std::size_t>(u)]; }
  // How many of the elements [a, b) of the sharded range each rank owns.
  std::vector<std::int64_t> rank_counts(std::int64_t a, std::int64_t b) const;
  // After a detached slot is reduced: add this rank's part into its gradient share, free the slot.
  void accumulate(const Staged& s);
  // The whole tensors' gradients (reduced by the sync), empty when there are none; tensor i, when
  // kept whole, lies at whole_offset(i) in them.
  BufferRef whole_grads() { return wgrads_.ref(); }
  bool kept_whole(int i) const { return whole_of_[static_cast<std::size_t>(i)]; }
  std::int64_t whole_offset(int i) const { return at_[static_cast<std::size_t>(i)]; }
  // How many of the whole tensors' elements each rank updates: under 16-bit precision at stage 2 the
  // whole range is cut into dp shares like the sharded one (its gradients reduce-scattered, its
  // updated elements all-gathered in refresh); empty when every rank updates all of it.
  const std::vector<std::int64_t>& whole_rank_counts() const { return wcounts_; }
  BufferRef grad_share() { return gshard_.ref(); }
  // Named buffers loom adds to the textbook's model state, in bytes: the gradient staging slots, the
  // gathered-parameter slots (stage 3), and the whole tensors' parameters, gradients and AdamW state
  // (of the elements this rank updates).
  double staging_bytes() const;
  double gathered_bytes() const;
  double whole_bytes() const {
    return 8.0 * static_cast<double>(whole_) + 8.0 * static_cast<double>(wcounts_.empty() ? whole_ : whi_ - wlo_);
  }
  std::int64_t share() const { return hi_ - lo_; }
  std::int64_t whole_count() const { return whole_; }
  // This rank's bytes sent by kind of collective since the step began (zero_grads).
  const CommStats& stats_at_step_start() const { return step_start_; }
  int gathers_this_step() const { return gathers_; }

 private:
  struct Slot {
    TypedBuffer buf;
    int unit = -1;       // -1: free
    int users = 0;       // acquires not yet released (parameter slots)
    CommRequestPtr req;  // the gather filling it (parameter slots)
  };
  Slot* take(std::vector<std::unique_ptr<Slot>>& pool, int unit, const char* label, Mem category);
  void gather(int unit);
  bool wanted_soon(int unit) const;  // used again within the prefetch window
  void prefetch(int next_unit);
  float* tensor_in(const std::vector<Slot*>& slots, const TypedBuffer& whole, int i) const;

  Communicator& dp_;
  int stage_;
  std::int64_t persist_below_;
  int depth_;
  BackendFace* be_ = nullptr;
  std::vector<ParamInfo> info_;
  std::vector<Unit> units_;
  std::vector<bool> whole_of_;    // per tensor: kept whole
  std::vector<std::int64_t> at_;  // per tensor: offset in the sharded range, or in the whole buffer
  std::vector<std::int64_t> unit_lo_, unit_hi_;
  std::int64_t sharded_ = 0, whole_ = 0, lo_ = 0, hi_ = 0;
  std::vector<std::int64_t> counts_, offsets_;
  std::vector<std::int64_t> wcounts_;  // see whole_rank_counts(); [wlo_, whi_): this rank's run of them
  std::int64_t wlo_ = 0, whi_ = 0;
  TypedBuffer params_;  // stage 2: the whole sharded range; stage 3: this rank's share of it
  TypedBuffer gshard_;  // this rank's share of the gradients
  TypedBuffer wparams_, wgrads_;
  std::vector<OwnedSlice> owned_;
  std::vector<std::unique_ptr<Slot>> pslots_, gslots_;
  std::vector<Slot*> gathered_, staged_;  // per unit: its parameter slot (stage 3), its gradient slot
  std::vector<UnitView> views_;
  ComputeCopies copies_;  // 16-bit copies of the matrix weights (stage 3: of the gathered units only)
  // Stage 2 under 16-bit precision: fp32 masters of the sharded matrices for this rank's share only
  // (params_), and their whole 16-bit copy (params16_), refreshed by an all-gather after each update.
  bool masters16_ = false, dirty16_ = false;
  TypedBuffer params16_;
  void refresh16();
  // The order units are acquired in during a step: recorded in the first, followed after.
  std::vector<int> trace_;
  bool tracing_ = true, on_trace_ = false;
  std::size_t pos_ = 0;
  CommStats step_start_;
  int gathers_ = 0;
};

// Stages 2 and 3's gradient sync: each unit's staging slot is reduce-scattered when backward is done
// with it (every micro-batch), in pieces of at most bucket_mb, through the run's Reducer; the whole
// tensors' gradients are reduced after the last backward (whole_buckets, pieces of bucket_mb too).
class ShardedSync final : public GradSync {
 public:
  ShardedSync(Communicator& dp, BackendFace& be, GPT& model, ShardedStore& store, double bucket_mb, bool overlap);
  std::string name() const override;
  void use_reducer(Reducer* reducer) override { reducer_ = reducer; }
  void begin_micro_batch(GPT& model, int k, int m) override;
  void grads_ready(GPT& model, int unit) override;
  void finish(GPT& model) override;
  double mean_over_replicas(double local) override { return dp_.sum(local) / dp_.size(); }
  std::vector<std::pair<std::string, double>> step_report() const override;
  std::vector<std::string> summary_lines(const std::map<std::string, double>& means) const override;
  StateSharding state_sharding() const override { return {dp_.size(), store_.stage() == 3, true, true}; }
  // `loom plan`: each unit's pieces through the reducer every micro-batch (one unit in flight), the
  // whole tensors' reduction at the end.
  void plan_step(StepPlan& plan) const override;

 private:
  std::int64_t step_ = 0;  // steps of this run, for LOOM_INJECT_FAULT where=plugin
  struct InFlight {
    ShardedStore::Staged staged;
    std::vector<GradBucket> buckets;
    std::vector<CommRequestPtr> reqs;
  };
  void complete_oldest();
  std::vector<GradBucket> whole_buckets() const;
  // Lists in k the parts of the unit's sharded tensors that the piece [a, b) of its range holds
  // (the run's pieces and `loom plan`'s alike, so a reducer sizes the same scratch for both).
  void list_unit_part(GradBucket& k, int unit, std::int64_t a, std::int64_t b) const;

  Communicator& dp_;
  BackendFace& be_;
  GPT& model_;
  ShardedStore& store_;
  std::int64_t piece_;  // elements per bucket
  bool overlap_;
  Reducer* reducer_ = nullptr;
  std::vector<InFlight> in_flight_;
  int buckets_per_step_ = 0, counted_ = 0;
};

}  // namespace loom
