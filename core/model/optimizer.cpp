#include "core/model/optimizer.hpp"

#include <algorithm>
#include <cmath>

namespace loom {

double lr_at(const OptimizerConfig& cfg, std::int64_t step) {
  if (step < cfg.warmup) return cfg.lr * static_cast<double>(step + 1) / static_cast<double>(cfg.warmup);
  if (cfg.schedule == "constant") return cfg.lr;
  const double ratio =
      static_cast<double>(step - cfg.warmup) / static_cast<double>(std::max<std::int64_t>(1, cfg.steps - cfg.warmup));
  const double coeff = 0.5 * (1.0 + std::cos(M_PI * std::min(1.0, ratio)));
  return cfg.lr_min + coeff * (cfg.lr - cfg.lr_min);
}

double clip_coefficient(double norm, double grad_clip) {
  if (grad_clip <= 0.0) return 1.0;
  return std::min(1.0, grad_clip / (norm + 1e-6));
}

std::int64_t Optimizer::layout_slices(const std::vector<OwnedSlice>& owned) {
  owned_ = owned;
  slice_offset_.clear();
  std::int64_t n = 0;
  for (const OwnedSlice& s : owned_) {
    slice_offset_.push_back(n);
    n += s.size();
  }
  return n;
}

void AdamW::build(const std::vector<ParamInfo>& params, const std::vector<OwnedSlice>& owned) {
  const std::int64_t n = layout_slices(owned);
  decay_.clear();
  for (const OwnedSlice& s : owned_) decay_.push_back(params[static_cast<std::size_t>(s.param)].decay);
  m_ = be_.allocate("AdamW::m", DType::f32, n, Mem::optimizer);
  v_ = be_.allocate("AdamW::v", DType::f32, n, Mem::optimizer);
}

void AdamW::step(ParamStore& store, double lr) {
  ++t_;
  // Every owned slice in one call (a device updates them in a few launches; a default back end slice
  // by slice): the bits of one adamw_update per slice.
  std::vector<AdamWSlice> slices;
  slices.reserve(owned_.size());
  for (std::size_t s = 0; s < owned_.size(); ++s) {
    const OwnedSlice& o = owned_[s];
    slices.push_back({store.owned_param(o), m_.ref().slice(slice_offset_[s], o.size()),
                      v_.ref().slice(slice_offset_[s], o.size()), store.owned_grad(o), o.size(),
                      static_cast<float>(decay_[s] ? cfg_.weight_decay : 0.0)});
  }
  be_.adamw_update_slices(slices, static_cast<float>(lr), static_cast<float>(cfg_.beta1),
                          static_cast<float>(cfg_.beta2), static_cast<float>(cfg_.eps), t_);
}

}  // namespace loom
