// The `mixed_precision` strategy plugin (libloom_mixed_precision.so). A deck asks for it with
// `precision.dtype = bf16 | fp16` (no run.plugins line).
//
// What it decides (the `precision` role, set on the back end before the model is built): the model's
// matrix products take 16-bit operands (inputs, weights and output gradients rounded to nearest even)
// and accumulate in fp32. Everything else stays fp32: master weights, gradients and their
// accumulation over micro-batches, AdamW's moments, activations, LayerNorm, softmax, the loss and the
// gradient norm (DESIGN.md "The parameter store", its 16-bit paragraph).
//
// fp16 adds dynamic loss scaling (Megatron's DynamicGradScaler, DeepSpeed's keys): backward starts
// from the loss times the scale (the `begin` hook), so that small gradients survive fp16's range;
// in `unscale_check` the gradients every rank updates are checked for inf/NaN (one world sum of a
// flag, so every rank decides alike): an overflow skips the update and, once `hysteresis` overflows
// have been seen, multiplies the scale by `backoff_factor`; otherwise the gradients are divided by
// the scale before the norm and clipping, and after `loss_scale_window` clean steps in a row the
// scale grows by `growth_factor`. The scale and its counters are saved with checkpoints.
#include <cmath>
#include <map>
#include <memory>
#include <sstream>
#include <string>

#include "core/comm/comm.hpp"
#include "core/base/error.hpp"
#include "core/comm/grid.hpp"
#include "core/engine/plugin.hpp"

namespace loom {
namespace {

const char* const kScalingKeys[] = {
    "precision.loss_scale",     "precision.initial_scale_power", "precision.loss_scale_window", "precision.hysteresis",
    "precision.min_loss_scale", "precision.backoff_factor",      "precision.growth_factor"};

struct ScalerConfig {
  double fixed = 0;        // > 0: a constant scale
  double initial = 65536;  // 2^initial_scale_power
  std::int64_t window = 1000, hysteresis = 2, max_skipped = 10;
  double min_scale = 1, backoff = 0.5, growth = 2;
};

std::string number(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

// fp16's loss scale, shared by the strategy's hooks and saved with checkpoints.
class LossScaler final : public CheckpointContributor {
 public:
  LossScaler(const ScalerConfig& cfg, GPT& model, BackendFace& backend, Communicator& world)
      : cfg_(cfg),
        model_(model),
        be_(backend),
        world_(world),
        scale_(cfg.fixed > 0 ? cfg.fixed : cfg.initial),
        hysteresis_left_(cfg.hysteresis) {}

  double scale() const { return scale_; }

  // unscale_check: skip an overflowed step (every rank alike), else divide the gradients by the scale.
  void unscale_check(StepState& s) {
    ParamStore& store = model_.store();
    grads_.clear();
    for (const OwnedSlice& o : store.owned()) grads_.push_back(store.owned_grad(o));
    const bool finite_here = be_.sq_norm_check(grads_).all_finite;
    const bool overflow = world_.size() > 1 ? world_.sum(finite_here ? 0.0 : 1.0) > 0 : !finite_here;
    if (!overflow) {
      for (const BufferRef& g : grads_) be_.scale(g, 1.0 / scale_);
      overflows_in_row_ = 0;
      if (cfg_.fixed <= 0 && ++growth_tracker_ == cfg_.window) {  // a window of clean steps: grow
        growth_tracker_ = 0;
        hysteresis_left_ = cfg_.hysteresis;
        scale_ *= cfg_.growth;
      }
      return;
    }
    ++overflows_in_row_;
    const std::string at = "fp16 gradient overflow (inf/NaN) at loss scale " + number(scale_);
    if (cfg_.fixed > 0) {
      s.skip_reason = at + " (fixed: precision.loss_scale)";
      if (overflows_in_row_ > cfg_.max_skipped)
        s.failure = at + ": " + std::to_string(overflows_in_row_) +
                    " steps in a row overflowed (train.max_skipped = " + std::to_string(cfg_.max_skipped) +
                    "); lower precision.loss_scale, or set it to 0 for dynamic "
                    "loss scaling";
      return;
    }
    growth_tracker_ = 0;
    if (--hysteresis_left_ > 0) {
      s.skip_reason = at + "; scale kept (" + std::to_string(hysteresis_left_) + " more overflow" +
                      (hysteresis_left_ == 1 ? "" : "s") + " before backing off, precision.hysteresis)";
      return;
    }
    hysteresis_left_ = 0;
    if (scale_ <= cfg_.min_scale) {
      s.skip_reason = at;
      s.failure = at + ", which is precision.min_loss_scale = " + number(cfg_.min_scale) +
                  ": the gradients overflow fp16 without scaling (lower train.lr, use precision.dtype = bf16, or "
                  "lower precision.min_loss_scale)";
      return;
    }
    const double next = std::max(scale_ * cfg_.backoff, cfg_.min_scale);
    s.skip_reason = at + "; scale -> " + number(next);
    scale_ = next;
  }

  std::string checkpoint_name() const override { return "fp16 loss scaler"; }
  std::vector<CheckpointTensor> checkpoint_tensors() override { return {}; }
  std::map<std::string, double> checkpoint_attributes() const override {
    return {{"loss_scale", scale_},
            {"loss_scale_growth_tracker", static_cast<double>(growth_tracker_)},
            {"loss_scale_hysteresis_left", static_cast<double>(hysteresis_left_)}};
  }
  // A file written without loss scaling (fp32, bf16: loss_scale 1 and no counters) leaves the
  // configured initial scale; a fixed scale is the deck's, whatever the file says.
  void restore_attributes(const std::map<std::string, double>& found) override {
    const auto growth = found.find("loss_scale_growth_tracker");
    const auto hyst = found.find("loss_scale_hysteresis_left");
    const auto scale = found.find("loss_scale");
    if (growth == found.end() || hyst == found.end() || scale == found.end() || cfg_.fixed > 0) return;
    scale_ = scale->second;
    growth_tracker_ = static_cast<std::int64_t>(growth->second);
    hysteresis_left_ = static_cast<std::int64_t>(hyst->second);
  }

 private:
  ScalerConfig cfg_;
  GPT& model_;
  BackendFace& be_;
  Communicator& world_;
  double scale_;
  std::int64_t growth_tracker_ = 0;  // clean steps since the last overflow or growth
  std::int64_t hysteresis_left_;     // overflows still tolerated before the scale backs off
  std::int64_t overflows_in_row_ = 0;
  std::vector<BufferRef> grads_;
};

DType dtype_of_deck(const Deck& deck) {
  const std::string d = deck.get_string("precision.dtype");
  return d == "bf16" ? DType::bf16 : d == "fp16" ? DType::f16 : DType::f32;
}

// `loom plan`: fp32 against the deck's 16-bit type (bf16 unless the deck asks for fp16), the memo's
// sentences on the gradient collective and loss scaling, and the narrower collective as a lever.
PlanTerms precision_plan_terms() {
  PlanTerms t;
  PlanDimension d("precision.dtype", "precision", "prec", 6, "precision", PlanDimension::Json::text, "", 40, 50);
  d.sets_precision = true;
  const auto half = [](const PlanPoint& p) {
    return p.deck && p.deck->get_string("precision.dtype") == "fp16" ? std::string("fp16") : std::string("bf16");
  };
  d.values = [half](const PlanPoint& p) -> std::vector<std::string> { return {"fp32", half(p)}; };
  d.lean = [half](const PlanPoint& p) {
    const std::string v = p.setting("precision.dtype");
    return v == "fp32" || v.empty() ? half(p) : v;
  };
  d.describe = [](const std::string& v) { return v; };
  d.what_if = [](const PlanPoint& p) -> std::vector<std::pair<std::string, std::string>> {
    const std::string other = p.setting("precision.dtype") == "fp32" ? "bf16" : "fp32";
    return {{other, other}};
  };
  t.dimensions.push_back(d);
  t.memo = [](const std::string& topic, const PlanPoint& p) -> std::string {
    if (topic == "precision_stays")
      return "- the **gradient collective** stays fp32 unless `precision.reduce_dtype = bf16` halves its bytes.\n";
    if (topic == "precision_scaling")
      return p.precision == "fp16"
                 ? "fp16 has 5 exponent bits: small gradients underflow, so loom scales the loss (dynamic loss "
                   "scaling: "
                   "`precision.initial_scale_power`, `loss_scale_window`, `hysteresis`, as Megatron) and skips a step "
                   "whose gradients overflow.\n\n"
                 : "bf16 has fp32's 8 exponent bits, so gradients do not underflow and no loss scaling is needed (fp16 "
                   "would need it: `precision.dtype = fp16` brings dynamic loss scaling).\n\n";
    return "";
  };
  t.levers = [](const std::string& bottleneck, const PlanPoint& p) -> std::vector<PlanLever> {
    const std::string v = p.setting("precision.dtype");
    if (bottleneck != "dp" || v.empty() || v == "fp32") return {};
    return {{v + " gradient collectives (precision.reduce_dtype = " + v + "), half the bytes",
             {"precision.reduce_dtype=" + v}}};
  };
  return t;
}

void register_mixed_precision(void* p) {
  auto& info = *static_cast<StrategyInfo*>(p);
  info.keys.push_back(choice_key("precision.dtype", "fp32", {"fp32", "bf16", "fp16"},
                                 "the matrix products' operand type: fp32, or bf16/fp16 operands with fp32 "
                                 "accumulation (fp32 master weights, gradients and optimizer state; fp16 adds loss "
                                 "scaling)"));
  info.keys.push_back(
      choice_key("precision.reduce_dtype", "fp32", {"fp32", "bf16", "fp16"},
                 "the element type of the data-parallel gradient collective: fp32, or a 16-bit copy "
                 "of each bucket (half the bytes; each sum rounded) cast back into the fp32 gradients"));
  info.keys.push_back(float_key("precision.loss_scale", "0", 0, 1e38,
                                "fp16: 0 dynamic loss scaling; > 0 a fixed scale (DeepSpeed fp16.loss_scale)"));
  info.keys.push_back(int_key("precision.initial_scale_power", "16", 0, 100,
                              "fp16, dynamic: the first scale is 2^this (DeepSpeed initial_scale_power)"));
  info.keys.push_back(int_key("precision.loss_scale_window", "1000", 1, 1e12,
                              "fp16, dynamic: clean steps in a row before the scale grows (DeepSpeed "
                              "loss_scale_window, Megatron --loss-scale-window)"));
  info.keys.push_back(int_key("precision.hysteresis", "2", 1, 1e9,
                              "fp16, dynamic: overflows tolerated before the scale backs off (DeepSpeed, Megatron "
                              "hysteresis); reset when the scale grows"));
  info.keys.push_back(float_key("precision.min_loss_scale", "1", 1e-30, 1e38,
                                "fp16, dynamic: the scale never backs off below this; an overflow at it stops the "
                                "run (DeepSpeed min_loss_scale)"));
  info.keys.push_back(float_key("precision.backoff_factor", "0.5", 1e-6, 0.999999,
                                "fp16, dynamic: the scale is multiplied by this on a back-off (torch GradScaler)"));
  info.keys.push_back(float_key("precision.growth_factor", "2", 1.000001, 1e6,
                                "fp16, dynamic: the scale is multiplied by this after a window of clean steps"));
  info.claims = {{Role::precision, Claim::provides, ""},
                 {Role::reducer, Claim::wraps, ""},  // precision.reduce_dtype: the run's collective in 16 bits
                 {Role::phase_hooks, Claim::provides, ""},
                 {Role::checkpoint, Claim::provides, ""}};
  info.requested_by = [](const Deck& deck, const Layout&) -> std::string {
    const std::string dtype = deck.get_string("precision.dtype");
    // Loss scaling is for fp16 only: bf16 has fp32's exponent range. A scaling key set for another
    // dtype is refused rather than ignored, so that a deck never says what the run does not do.
    const auto values = deck.values();  // each key's text as given
    if (dtype != "fp16")
      for (const char* key : kScalingKeys)
        if (!deck.is_default(key))
          throw InputError(std::string(key) + " = " + values.at(key) +
                           " is a loss-scaling key, and loss scaling "
                           "applies to precision.dtype = fp16 only (here " +
                           dtype +
                           (dtype == "bf16" ? ", which has "
                                              "fp32's exponent range and needs none"
                                            : "") +
                           "): remove it, or set precision.dtype = fp16");
    if (dtype == "fp16" && !deck.is_default("precision.loss_scale")) {
      for (const char* key : kScalingKeys)
        if (std::string(key) != "precision.loss_scale" && !deck.is_default(key))
          throw InputError(std::string(key) + " is for dynamic loss scaling, but precision.loss_scale = " +
                           values.at("precision.loss_scale") + " fixes the scale: remove one of them");
    }
    if (dtype == "fp32" && !deck.is_default("precision.reduce_dtype"))
      throw InputError("precision.reduce_dtype = " + values.at("precision.reduce_dtype") +
                       " needs precision.dtype = bf16 "
                       "or fp16 (here fp32): set one, or remove precision.reduce_dtype");
    return dtype == "fp32" ? "" : "precision.dtype = " + dtype;
  };
  info.traits = [](const Deck& deck, RunTraits& traits) {
    if (deck.get_string("precision.dtype") == "fp16" && deck.get_float("precision.loss_scale") <= 0)
      traits.dynamic_loss_scale_by = "precision.dtype = fp16 with dynamic loss scaling";
    if (deck.get_string("precision.dtype") == "fp16" && deck.get_float("precision.loss_scale") != 1)
      traits.loss_scaled_by = "precision.dtype = fp16 with its loss scaling";
    if (deck.get_string("precision.reduce_dtype") != "fp32")
      traits.reduce_dtype_by = "precision.reduce_dtype = " + deck.get_string("precision.reduce_dtype");
  };
  info.make_precision = [](PartitionContext& ctx) {
    Precision p;
    p.matmul = dtype_of_deck(ctx.deck);
    const std::string reduce = ctx.deck.get_string("precision.reduce_dtype");
    p.reduce = reduce == "bf16" ? DType::bf16 : reduce == "fp16" ? DType::f16 : DType::f32;
    return p;
  };
  info.plan = precision_plan_terms();
  info.create = [](StrategyContext& ctx, Roles& roles) {
    // A narrower gradient collective: each bucket cast to reduce_dtype around the run's reducer, the
    // sums cast back into the fp32 gradients.
    const DType reduce = ctx.backend.precision().reduce;
    if (reduce != DType::f32) {
      BackendFace& be = ctx.backend;
      roles.wrap_reducer = [&be, reduce](std::unique_ptr<Reducer> inner) -> std::unique_ptr<Reducer> {
        return std::make_unique<CastReducer>(std::move(inner), be, reduce);
      };
    }
    if (dtype_of_deck(ctx.deck) != DType::f16) return;  // bf16: nothing to scale
    ScalerConfig cfg;
    cfg.fixed = ctx.deck.get_float("precision.loss_scale");
    cfg.initial = std::ldexp(1.0, static_cast<int>(ctx.deck.get_int("precision.initial_scale_power")));
    cfg.window = ctx.deck.get_int("precision.loss_scale_window");
    cfg.hysteresis = ctx.deck.get_int("precision.hysteresis");
    cfg.min_scale = ctx.deck.get_float("precision.min_loss_scale");
    cfg.backoff = ctx.deck.get_float("precision.backoff_factor");
    cfg.growth = ctx.deck.get_float("precision.growth_factor");
    cfg.max_skipped = ctx.deck.get_int("train.max_skipped");
    auto scaler = std::make_shared<LossScaler>(cfg, ctx.model, ctx.backend, ctx.grid.world());
    roles.hooks.push_back({StepPhase::begin, "", [scaler](StepState& s) { s.loss_scale = scaler->scale(); }});
    roles.hooks.push_back({StepPhase::unscale_check, "", [scaler](StepState& s) { scaler->unscale_check(s); }});
    roles.checkpoint_parts.push_back(scaler);
  };
}

}  // namespace
}  // namespace loom

extern "C" const loom_plugin_v1* loom_plugin_entry(void) {
  static const loom_plugin_v1 plugin = {LOOM_PLUGIN_ABI_VERSION, "mixed_precision", "0.1.0",
                                        "bf16/fp16 matrix products with fp32 accumulation and fp32 master weights; "
                                        "fp16 dynamic loss scaling",
                                        loom::register_mixed_precision};
  return &plugin;
}
