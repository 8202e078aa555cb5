#include "core/model/param_store.hpp"

namespace loom {

bool tp_primary(const ParamInfo& p, const StoreContext& ctx) {
  return !p.shadow && (p.split() != TpSplit::none || ctx.tp_rank == 0);
}

bool default_primary(const ParamInfo& p, const StoreContext& ctx) {
  // An expert's tensor is held by every ep-th replica: the first of them (edp rank 0) owns it.
  return (p.expert ? ctx.dp_rank < ctx.ep : ctx.dp_rank == 0) && tp_primary(p, ctx);
}

void ComputeCopies::build(BackendFace& backend, const std::vector<ParamInfo>& params, const std::vector<Unit>& units,
                          bool resident) {
  be_ = &backend;
  type_ = backend.precision().matmul;
  resident_ = resident;
  at_.assign(units.size(), {});
  count_.assign(units.size(), 0);
  copy_.clear();
  copy_.resize(units.size());
  stale_.assign(units.size(), true);
  if (!active()) return;
  for (std::size_t u = 0; u < units.size(); ++u) {
    for (int i : units[u].params) {
      const ParamInfo& p = params[static_cast<std::size_t>(i)];
      at_[u].push_back(p.matmul_weight ? count_[u] : -1);
      if (p.matmul_weight) count_[u] += p.numel();
    }
    if (resident_ && count_[u] > 0)
      copy_[u] = backend.allocate("ParamStore::compute_copy." + units[u].name, type_, count_[u], Mem::params);
  }
}

void ComputeCopies::attach(int unit, ParamStore::UnitView& view) {
  if (!active()) return;
  const std::size_t u = static_cast<std::size_t>(unit);
  if (count_[u] == 0) {
    view.compute.assign(view.params.size(), BufferRef());
    return;
  }
  TypedBuffer& c = copy_[u];
  if (c.empty()) {
    c = be_->allocate("ParamStore::compute_copy", type_, count_[u], Mem::params);
    stale_[u] = true;
  }
  view.compute.assign(view.params.size(), BufferRef());
  for (std::size_t k = 0; k < view.params.size(); ++k) {
    if (at_[u][k] < 0) continue;
    view.compute[k] = c.ref().slice(at_[u][k], view.params[k].count);
    if (stale_[u]) be_->cast(view.compute[k], view.params[k]);
  }
  stale_[u] = false;
}

void ComputeCopies::drop(int unit) {
  const std::size_t u = static_cast<std::size_t>(unit);
  if (!active() || resident_) return;
  copy_[u] = TypedBuffer();
  stale_[u] = true;
}

void FlatParamStore::build(const StoreContext& ctx, const std::vector<ParamInfo>& params,
                           const std::vector<Unit>& units) {
  be_ = &ctx.backend;
  info_ = params;
  std::int64_t n = 0;
  for (const ParamInfo& p : params) n = std::max(n, p.offset + p.numel());
  // With 16-bit compute copies the fp32 parameters are the master weights.
  copies_.build(*be_, params, units, true);
  params_ = be_->allocate("GPT::params", DType::f32, n, copies_.active() ? Mem::master : Mem::params);
  grads_ = be_->allocate("GPT::grads", DType::f32, n, Mem::grads);
  forward_.assign(units.size(), {});
  backward_.assign(units.size(), {});
  for (std::size_t u = 0; u < units.size(); ++u)
    for (int i : units[u].params) {
      forward_[u].params.push_back(param(i));
      backward_[u].params.push_back(param(i));
      backward_[u].grads.push_back(grad(i));
    }
  owned_.clear();
  for (int i = 0; i < static_cast<int>(params.size()); ++i)
    owned_.push_back({i, 0, params[i].numel(), default_primary(params[i], ctx)});
}

void FlatParamStore::zero_grads() { be_->fill(grads_.ref(), 0.0); }

}  // namespace loom
