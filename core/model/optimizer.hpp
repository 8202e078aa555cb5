#pragma once
// The optimizer role and its default, AdamW with decay on matrices only; the learning-rate
// schedule; clipping by global norm.
#include <cstdint>
#include <string>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/base/buffer.hpp"
#include "core/model/param_store.hpp"

namespace loom {

struct OptimizerConfig {
  double lr = 3e-4, lr_min = 0.0;
  std::string schedule = "cosine";  // constant | cosine
  std::int64_t warmup = 0, steps = 1;
  double weight_decay = 0.1, beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double grad_clip = 1.0;           // 0: no clipping
  std::string first_moment_off_by;  // the setting that set beta1 to 0 over train.beta1 (said in the name)
};

// Learning rate of step s (0-based): linear warm-up over `warmup` steps to lr, then constant or a
// cosine from lr down to lr_min at the last step.
double lr_at(const OptimizerConfig& cfg, std::int64_t step);

// Multiplier that clips a gradient of global L2 norm `norm` to `grad_clip` (as
// torch.nn.utils.clip_grad_norm_: clip/(norm + 1e-6), at most 1).
double clip_coefficient(double norm, double grad_clip);

// Role "optimizer": updates the slices of parameters this rank owns (ParamStore::owned()) from
// their gradients, keeping its state compactly, one entry per owned element (ZeRO-1 shrinks that
// state by owning less, nothing else). The core's default is AdamW.
class Optimizer {
 public:
  virtual ~Optimizer() = default;
  virtual std::string name() const = 0;
  // Allocates the state of the owned slices (called once, after the store is built).
  virtual void build(const std::vector<ParamInfo>& params, const std::vector<OwnedSlice>& owned) = 0;
  // One update of every owned slice, parameters and gradients read through the store.
  virtual void step(ParamStore& store, double lr) = 0;
  virtual std::int64_t steps_taken() const = 0;
  virtual void set_steps_taken(std::int64_t t) = 0;
  // The state a checkpoint holds, per kind ("m", "v"): element k of owned slice s is at
  // slice_offset(s) + k of each tensor.
  struct StateTensor {
    std::string kind;  // dataset group: /optimizer/<kind>/<parameter name>
    std::string what;  // for messages: "AdamW first moment"
    BufferRef data;
  };
  virtual std::vector<StateTensor> state() = 0;
  const std::vector<OwnedSlice>& owned() const { return owned_; }
  std::int64_t slice_offset(std::size_t s) const { return slice_offset_[s]; }

 protected:
  // Records the slices and their offsets into compact state; returns the state's length.
  std::int64_t layout_slices(const std::vector<OwnedSlice>& owned);
  std::vector<OwnedSlice> owned_;
  std::vector<std::int64_t> slice_offset_;
};

class AdamW final : public Optimizer {
 public:
  AdamW(const OptimizerConfig& cfg, Backend& backend) : cfg_(cfg), be_(backend) {}
  // Built at once for these slices.
  AdamW(const OptimizerConfig& cfg, Backend& backend, const std::vector<ParamInfo>& params,
        const std::vector<OwnedSlice>& owned)
      : AdamW(cfg, backend) {
    build(params, owned);
  }
  std::string name() const override {
    return cfg_.first_moment_off_by.empty()
               ? "AdamW"
               : "AdamW without its first moment (beta1 = 0: " + cfg_.first_moment_off_by + ")";
  }
  void build(const std::vector<ParamInfo>& params, const std::vector<OwnedSlice>& owned) override;
  void step(ParamStore& store, double lr) override;
  std::int64_t steps_taken() const override { return t_; }
  void set_steps_taken(std::int64_t t) override { t_ = t; }
  std::vector<StateTensor> state() override {
    return {{"m", "AdamW first moment", m_.ref()}, {"v", "AdamW second moment", v_.ref()}};
  }
  const OptimizerConfig& config() const { return cfg_; }

 private:
  OptimizerConfig cfg_;
  Backend& be_;
  std::vector<bool> decay_;  // per owned slice
  TypedBuffer m_, v_;
  std::int64_t t_ = 0;
};

}  // namespace loom
