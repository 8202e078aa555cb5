#include "core/param_store.hpp"

namespace loom {

bool tp_primary(const ParamInfo& p, const StoreContext& ctx) {
  return !p.shadow && (p.split != TpSplit::none || ctx.tp_rank == 0);
}

bool default_primary(const ParamInfo& p, const StoreContext& ctx) { return ctx.dp_rank == 0 && tp_primary(p, ctx); }

void FlatParamStore::build(const StoreContext& ctx, const std::vector<ParamInfo>& params, const std::vector<Unit>& units) {
  be_ = &ctx.backend;
  info_ = params;
  std::int64_t n = 0;
  for (const ParamInfo& p : params) n = std::max(n, p.offset + p.numel);
  params_ = be_->allocate("GPT::params", DType::f32, n, Mem::params);
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
    owned_.push_back({i, 0, params[i].numel, default_primary(params[i], ctx)});
}

void FlatParamStore::zero_grads() { be_->fill(grads_.data<float>(), 0.0f, grads_.count()); }

}  // namespace loom
