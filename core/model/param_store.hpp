#pragma once
// The parameter store (DESIGN.md "The parameter store"): who owns the storage of parameters and
// their gradients (and, with mixed precision, master weights). It is created before the model; the
// model declares its tensors grouped into units (the embeddings, each block, the head) and asks the
// store for a unit's tensors before it uses them and hands them back after, naming the unit it will
// use next so that a store can fetch ahead (ZeRO-3 gathers a block's parameters there). The core's
// default is one flat buffer of parameters and one of gradients, every unit always resident.
//
// The store also says which slices of which tensors this rank updates (the optimizer's work) and of
// which it is the one owner (counted in the gradient norm, written to checkpoints).
#include <cstdint>
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/base/dtype.hpp"
#include "core/base/shard.hpp"
#include "core/comm/step_plan.hpp"

namespace loom {

struct ParamInfo {
  enum class Init { normal, ones, zeros };
  std::string name;  // "blocks.3.attn.qkv.weight"
  // Which elements of the full tensor this rank holds: its shape, its tp piece and the range of
  // that piece held (empty where this rank's pipeline stage does not hold the tensor). The
  // accessors below read it; nothing about the shape is kept twice.
  ShardDesc shard;
  const std::vector<std::int64_t>& shape() const { return shard.shape; }           // full logical shape
  const std::vector<std::int64_t>& local_shape() const { return shard.tp_shape; }  // this rank's tp piece
  TpSplit split() const { return shard.split; }                                    // how the tp group splits it
  std::int64_t numel() const { return shard.numel(); }                             // elements held here
  int unit = -1;               // the unit it belongs to (index into GPT::units()), -1 when not held
  bool sp_partial = false;     // replicated, but with sequence parallelism each rank's gradient is partial
  bool shadow = false;         // a copy of a tensor another stage owns (the tied head's wte on the
                               // last stage): kept equal to it, not counted in norms or checkpoints
  bool tied = false;           // its gradient is added to a copy's on another pipeline stage after
                               // gradient sync (wte with pp > 1): a sharding sync reduces it whole
  std::int64_t offset = 0;     // position among this rank's parameter elements (the flat store's layout)
  bool decay = false;          // AdamW weight decay applies (matrices)
  bool matmul_weight = false;  // a weight of the model's matrix products: under 16-bit precision
                               // the store hands out a 16-bit compute copy of it (UnitView::compute)
  bool expert = false;         // an expert's, held by the ranks of one expert-parallel rank (parallel.ep > 1): its
                               // replicas are the edp group, which sums its gradient (ExpertSplit::finish_grads)
  Init init = Init::zeros;
  double init_std = 0.0;  // for Init::normal
};

// A group of tensors used together: "embeddings", "blocks.3", "head".
struct Unit {
  std::string name;
  std::vector<int> params;  // indices into the model's params(), in the order the model uses them
};

// Elements [begin, end) of a tensor's local shard that this rank updates with the optimizer.
// `primary`: this rank is the one owner of those elements in the whole job (counted in the gradient
// norm, written to checkpoints); replicas of a tensor update it too but are not primary.
struct OwnedSlice {
  int param = -1;
  std::int64_t begin = 0, end = 0;
  bool primary = false;
  std::int64_t size() const { return end - begin; }
};

// What a store knows of the run when it is built.
struct StoreContext {
  BackendFace& backend;
  int dp = 1, dp_rank = 0;  // the data-parallel group
  int tp_rank = 0;          // a tensor replicated over the tp group is owned by tp rank 0
  int ep = 1;               // an expert's tensor (ParamInfo::expert) is owned by the first ep replicas' holder
};

class ParamStore {
 public:
  enum class Use { forward, backward };
  // A unit's tensors, in Unit::params order; `grads` only for Use::backward. `compute`: with 16-bit
  // matrix products, the 16-bit compute copy of each ParamInfo::matmul_weight tensor (an empty ref
  // for the others, or empty altogether: a store without copies, whose products round `params`).
  struct UnitView {
    std::vector<BufferRef> params, grads, compute;
  };
  virtual ~ParamStore() = default;
  virtual std::string name() const = 0;
  // Called once by the model, with this rank's tensors and its units.
  virtual void build(const StoreContext& ctx, const std::vector<ParamInfo>& params, const std::vector<Unit>& units) = 0;
  // The tensors of `unit` until release(unit, use). `next_unit` (-1: none) is the unit the model
  // will acquire next, so a store may start fetching it.
  virtual const UnitView& acquire(int unit, Use use, int next_unit) = 0;
  virtual void release(int /*unit*/, Use /*use*/) {}
  // Tensor i's parameter or gradient (its whole local shard), for roles that work per tensor between
  // the micro-batches and the refresh phase; an empty ref when this store keeps only the owned slices
  // of it (ZeRO-2 gradients, ZeRO-3 parameters): use owned_param / owned_grad then.
  virtual BufferRef param(int i) = 0;
  virtual BufferRef grad(int i) = 0;
  virtual void zero_grads() = 0;
  // The slices this rank updates, each with whether it is their primary owner.
  virtual const std::vector<OwnedSlice>& owned() const = 0;
  // An owned slice's parameters and gradients (the optimizer's, the norm's and the checkpoint's view);
  // every store has them, whatever it keeps of the rest.
  virtual BufferRef owned_param(const OwnedSlice& o) { return param(o.param).slice(o.begin, o.size()); }
  virtual BufferRef owned_grad(const OwnedSlice& o) { return grad(o.param).slice(o.begin, o.size()); }
  // The refresh phase, after the optimizer (gather updated shards, refresh compute copies).
  virtual void refresh() {}
  // The training step is over (called whether or not it updated): what is acquired after it until
  // the next zero_grads is evaluation.
  virtual void end_step() {}
  // The parameter count of this rank's tensors (the P of ZeRO's textbook figures): all of a tensor
  // counts though a sharding store holds only its share.
  virtual std::int64_t local_numel() const = 0;
  // The parameters were written from outside the store (initialisation, a checkpoint): compute
  // copies made from them before are stale.
  virtual void params_written() {}
  // This rank alone wrote some of the parameters it holds whole (a fault injection's poison): the
  // compute copies made from them are stale. Not collective, unlike params_written.
  virtual void local_params_written() {}
  // `loom plan`: what a step takes beyond what build() allocated (gathered shards, staging) and the
  // bytes it moves (core/comm/step_plan.hpp).
  virtual void plan_step(StepPlan& /*plan*/) const {}
};

// The 16-bit compute copies of a store's matrix weights (ParamInfo::matmul_weight) when the back
// end's matrix products are 16-bit (Precision::matmul): per unit one buffer of the precision's type
// (Mem::params; the fp32 parameters are then the master weights, Mem::master), cast from the fp32
// parameters the first time the unit is acquired after an update (`mark_stale`, which a store calls
// in refresh and params_written), so each weight is rounded once per step however often it is used.
// `resident`: every unit's copy lives for the whole run (stores that keep whole parameters);
// otherwise a unit's copy exists while the store holds the unit's parameters (`drop` frees it).
class ComputeCopies {
 public:
  void build(BackendFace& backend, const std::vector<ParamInfo>& params, const std::vector<Unit>& units, bool resident);
  bool active() const { return type_ != DType::f32; }
  // view.compute for unit u, from view.params (cast when stale). Nothing when inactive.
  void attach(int u, ParamStore::UnitView& view);
  void mark_stale() { stale_.assign(stale_.size(), true); }
  void drop(int u);
  std::int64_t elements(int u) const { return count_[static_cast<std::size_t>(u)]; }

 private:
  BackendFace* be_ = nullptr;
  DType type_ = DType::f32;
  bool resident_ = true;
  std::vector<std::vector<std::int64_t>> at_;  // per unit, per tensor of it: offset in its copy, -1: none
  std::vector<std::int64_t> count_;            // per unit: its matmul weights' elements
  std::vector<TypedBuffer> copy_;              // per unit
  std::vector<bool> stale_;
};

// The default: one flat buffer of parameters and one of gradients (ParamInfo::offset into both),
// every tensor updated whole by the ranks that hold it.
class FlatParamStore : public ParamStore {
 public:
  std::string name() const override { return "flat (one buffer of parameters, one of gradients)"; }
  void build(const StoreContext& ctx, const std::vector<ParamInfo>& params, const std::vector<Unit>& units) override;
  const UnitView& acquire(int unit, Use use, int) override {
    UnitView& v =
        use == Use::forward ? forward_[static_cast<std::size_t>(unit)] : backward_[static_cast<std::size_t>(unit)];
    copies_.attach(unit, v);
    return v;
  }
  BufferRef param(int i) override { return params_.ref().slice(info_[i].offset, info_[i].numel()); }
  BufferRef grad(int i) override { return grads_.ref().slice(info_[i].offset, info_[i].numel()); }
  void zero_grads() override;
  const std::vector<OwnedSlice>& owned() const override { return owned_; }
  std::int64_t local_numel() const override { return params_.count(); }
  void refresh() override { copies_.mark_stale(); }
  void params_written() override { copies_.mark_stale(); }
  void local_params_written() override { copies_.mark_stale(); }
  // The flat buffers themselves (for tests and tools that read a layout's whole state).
  BufferRef flat_params() const { return params_.ref(); }
  BufferRef flat_grads() const { return grads_.ref(); }

 protected:
  BackendFace* be_ = nullptr;
  std::vector<ParamInfo> info_;
  TypedBuffer params_, grads_;
  std::vector<UnitView> forward_, backward_;
  std::vector<OwnedSlice> owned_;
  ComputeCopies copies_;
};

// Whether this rank owns its elements of `p` among its tp group and pipeline stages: not a pipeline
// shadow, and for a tensor replicated over tp, tp rank 0. A store adds its own dp rule.
bool tp_primary(const ParamInfo& p, const StoreContext& ctx);
// The default rule for a tensor held whole on every dp rank: tp_primary, and data-parallel replica 0.
bool default_primary(const ParamInfo& p, const StoreContext& ctx);

}  // namespace loom
