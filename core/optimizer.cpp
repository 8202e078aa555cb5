#include "core/optimizer.hpp"

#include <algorithm>
#include <cmath>

namespace loom {

double lr_at(const OptimizerConfig& cfg, std::int64_t step) {
  if (step < cfg.warmup) return cfg.lr * static_cast<double>(step + 1) / static_cast<double>(cfg.warmup);
  if (cfg.schedule == "constant") return cfg.lr;
  const double ratio = static_cast<double>(step - cfg.warmup) / static_cast<double>(std::max<std::int64_t>(1, cfg.steps - cfg.warmup));
  const double coeff = 0.5 * (1.0 + std::cos(M_PI * std::min(1.0, ratio)));
  return cfg.lr_min + coeff * (cfg.lr - cfg.lr_min);
}

double clip_coefficient(double norm, double grad_clip) {
  if (grad_clip <= 0.0) return 1.0;
  return std::min(1.0, grad_clip / (norm + 1e-6));
}

AdamW::AdamW(const OptimizerConfig& cfg, Backend& backend, const std::vector<ParamInfo>& params)
    : cfg_(cfg), be_(backend), params_(params) {
  std::int64_t n = 0;
  for (const auto& p : params_) n = std::max(n, p.offset + p.numel);
  m_ = Buffer<float>("AdamW::m", n, Mem::optimizer);
  v_ = Buffer<float>("AdamW::v", n, Mem::optimizer);
}

void AdamW::step(float* params, const float* grads, double lr) {
  ++t_;
  for (const auto& p : params_) {
    const double wd = p.decay ? cfg_.weight_decay : 0.0;
    be_.adamw_update(params + p.offset, m_.data() + p.offset, v_.data() + p.offset, grads + p.offset, p.numel,
                     static_cast<float>(lr), static_cast<float>(cfg_.beta1), static_cast<float>(cfg_.beta2),
                     static_cast<float>(cfg_.eps), static_cast<float>(wd), t_);
  }
}

}  // namespace loom
