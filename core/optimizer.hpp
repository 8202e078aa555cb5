#pragma once
// AdamW with decay on matrices only, the learning-rate schedule, and clipping by global norm.
#include <cstdint>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/buffer.hpp"
#include "core/gpt.hpp"

namespace loom {

struct OptimizerConfig {
  double lr = 3e-4, lr_min = 0.0;
  std::string schedule = "cosine";  // constant | cosine
  std::int64_t warmup = 0, steps = 1;
  double weight_decay = 0.1, beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double grad_clip = 1.0;  // 0: no clipping
};

// Learning rate of step s (0-based): linear warm-up over `warmup` steps to lr, then constant or a
// cosine from lr down to lr_min at the last step.
double lr_at(const OptimizerConfig& cfg, std::int64_t step);

// Multiplier that clips a gradient of global L2 norm `norm` to `grad_clip` (as
// torch.nn.utils.clip_grad_norm_: clip/(norm + 1e-6), at most 1).
double clip_coefficient(double norm, double grad_clip);

class AdamW {
 public:
  // Moments for every parameter in `params` (offsets into the flat buffers).
  AdamW(const OptimizerConfig& cfg, Backend& backend, const std::vector<ParamInfo>& params);
  // One update of every parameter with learning rate `lr`.
  void step(float* params, const float* grads, double lr);
  std::int64_t steps_taken() const { return t_; }
  // The state a checkpoint holds: first and second moments (laid out like the parameters) and the
  // number of updates taken (AdamW's bias correction depends on it).
  float* first_moment() { return m_.data(); }
  float* second_moment() { return v_.data(); }
  void set_steps_taken(std::int64_t t) { t_ = t; }
  const OptimizerConfig& config() const { return cfg_; }

 private:
  OptimizerConfig cfg_;
  Backend& be_;
  std::vector<ParamInfo> params_;
  Buffer<float> m_, v_;
  std::int64_t t_ = 0;
};

}  // namespace loom
