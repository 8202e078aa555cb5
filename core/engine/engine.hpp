#pragma once
// The engine runs one training step (DESIGN.md "The step") as explicit phases:
//   begin (hooks only: a loss scaler sets the step's scale) -> micro_batches (schedule) -> grads_final (gradient sync,
//   the partition's and the schedule's finish_grads) -> unscale_check -> norm (over the elements each rank owns, summed
//   over the world)
//   -> clip -> optimize (the optimizer role on the owned slices) -> refresh (the store's refresh).
// Each phase runs the core's built-in work, then the hooks strategies registered for it (mixed
// precision sets the loss scale in begin, unscales in unscale_check and may skip the update). ZeRO's
// gather after the update is its store's refresh, a role, not a hook.
// This header declares the roles the engine calls and the core's single-process default of each.
#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/model/gpt.hpp"
#include "core/base/ledger.hpp"
#include "core/model/optimizer.hpp"
#include "core/engine/reducer.hpp"
#include "core/comm/step_plan.hpp"

namespace loom {

// Fills `rows` rows of global step `step` starting at row `first_row`: inputs and targets [rows, T].
using BatchFn = std::function<void(std::int64_t step, std::int64_t first_row, int rows,
                                   std::vector<std::int32_t>& inputs, std::vector<std::int32_t>& targets)>;

struct PhaseTimes {  // seconds, per step
  double data = 0, forward = 0, backward = 0, sync = 0, optimizer = 0;
};

// Which parts of the model state the data-parallel ranks split among themselves (ZeRO: the optimizer
// state from stage 1, the gradients from 2, the weights at 3), for the run summary's textbook of the
// state per rank (core/engine/engine.hpp GradSync::state_sharding); none by default.
struct StateSharding {
  int ranks = 1;  // how many ranks share a split part (the dp group)
  bool weights = false, grads = false, optimizer = false;
};

// Role "gradient sync": what happens to a gradient when backward has produced it and at the end of
// backward, and how per-rank scalars become global ones. Default: one process, nothing to do.
class GradSync {
 public:
  virtual ~GradSync() = default;
  virtual std::string name() const { return "none (one replica)"; }
  // Before the backward of micro-batch k of m.
  virtual void begin_micro_batch(GPT& /*model*/, int /*k*/, int /*m*/) {}
  // During backward: the gradients of unit `unit` (model.units()) are complete for this micro-batch.
  virtual void grads_ready(GPT& /*model*/, int /*unit*/) {}
  // After the last backward of the step: gradients must be final (synchronised, averaged) on return.
  virtual void finish(GPT& /*model*/) {}
  // The loss of the whole global batch from this rank's share (the mean over replicas).
  virtual double mean_over_replicas(double local) { return local; }
  // The reducer its buckets go through, once the run has composed it (wrappers included).
  virtual void use_reducer(Reducer* /*reducer*/) {}
  // Numbers for the metrics of the last step (name -> value), e.g. measured vs textbook volume.
  virtual std::vector<std::pair<std::string, double>> step_report() const { return {}; }
  // The run summary's lines about this role (and the reducers it holds), from the means over the
  // steady steps of every role's step_report values by name; the driver prints them, indented, under
  // "summary:", so that it does not restate a strategy's formulas.
  virtual std::vector<std::string> summary_lines(const std::map<std::string, double>& /*means*/) const { return {}; }
  // `loom plan`: the scratch a step takes and the bytes it moves (core/comm/step_plan.hpp).
  virtual void plan_step(StepPlan& /*plan*/) const {}
  // Which parts of the model state this sync's strategy splits over the ranks.
  virtual StateSharding state_sharding() const { return {}; }
};

struct StepContext {
  GPT& model;
  std::int64_t step;
  int micro_batches;
  int rows_per_micro;  // rows of one micro-batch on this rank
  const BatchFn& fetch;
  PhaseTimes& times;
  GradSync& sync;
  std::vector<std::int32_t> inputs, targets;  // reused batch storage
  // The factor the training objective is multiplied by before backward (a loss scaler's; 1 without
  // one): each micro-batch's backward starts from dloss = loss_scale / micro_batches.
  float loss_scale = 1.0f;
};

// Role "schedule": in what order the micro-batch forwards and backwards of a step run, and what
// travels between pipeline stages. Default: gradient accumulation over the micro-batches.
class Schedule {
 public:
  virtual ~Schedule() = default;
  virtual std::string name() const = 0;
  // Forward and backward of every micro-batch of step ctx.step; returns the step's mean loss (the
  // same on every rank of a replica).
  virtual double run(StepContext& ctx) = 0;
  // Forward only over the micro-batches of global batch ctx.step (evaluation); returns the mean loss.
  virtual double forward_only(StepContext& ctx);
  // After gradient sync and the partition's finish_grads: e.g. sum the tied embedding's gradient
  // between the first and last pipeline stage.
  virtual void finish_grads(GPT& /*model*/) {}
  // Numbers for the metrics of the last step.
  virtual std::vector<std::pair<std::string, double>> step_report() const { return {}; }
  // What the step line adds from this step's step_report values (" | name value ..."), and the
  // summary's lines from their means (GradSync::summary_lines).
  virtual std::string step_line(const std::vector<std::pair<std::string, double>>& /*values*/) const { return {}; }
  virtual std::vector<std::string> summary_lines(const std::map<std::string, double>& /*means*/) const { return {}; }
  // `loom plan`: the scratch a step takes, the bytes it moves and the idle share (core/comm/step_plan.hpp).
  virtual void plan_step(StepPlan& /*plan*/) const {}
};

class AccumulateSchedule final : public Schedule {
 public:
  std::string name() const override { return "accumulate"; }
  double run(StepContext& ctx) override;
};

struct StepStats {
  std::int64_t step = 0;  // from 0: the steps done before this one (messages say step + 1, as the step lines do)
  double loss = 0, lr = 0, grad_norm = 0, clip_coef = 1;
  double loss_scale = 1;  // the factor backward started from (StepState::loss_scale)
  // The loss or the gradient norm was not finite: the update was not applied (on every rank alike,
  // since both are global values); the driver reports it and stops or skips (train.on_nonfinite).
  bool nonfinite = false;
  // A phase hook skipped the update on purpose (e.g. a loss-scale overflow): why; empty otherwise.
  std::string skip_reason;
  std::string failure;    // StepState::failure
  double local_loss = 0;  // this rank's own share of the loss, before the mean over replicas
  double seconds = 0;
  PhaseTimes times;
  std::array<std::size_t, kMemCategories> peak_bytes{};  // ledger peaks during the step
  std::size_t peak_total = 0;
};

// The phases of a step, in order.
enum class StepPhase : int {
  begin = 0,
  micro_batches,
  grads_final,
  unscale_check,
  norm,
  clip,
  optimize,
  refresh,
  count_
};
inline constexpr int kStepPhases = static_cast<int>(StepPhase::count_);
const char* step_phase_name(StepPhase p);  // "micro_batches", ...

// What the phases of one step share. Hooks may read everything and change what their phase owns:
// unscale_check may set skip_reason (no clip, optimize or refresh follows; a gradient that is not
// finite is then no failure) or mark `nonfinite`; begin may set loss_scale.
struct StepState {
  std::int64_t step = 0;  // from 0: the steps done before this one (messages say step + 1, as the step lines do)
  double loss_scale = 1;  // set in begin: backward starts from loss_scale / micro_batches
  double local_loss = 0, loss = 0;  // this rank's share; the mean over the global batch
  double sq_norm = 0;               // the squared global gradient norm (after norm)
  double clip_coef = 1, lr = 0;
  bool nonfinite = false;
  std::string skip_reason;
  // A hook found that the run cannot go on (the same on every rank, e.g. a loss scale that cannot
  // back off further): why. The driver stops the run with it.
  std::string failure;
};

struct PhaseHook {
  StepPhase phase;
  std::string owner;  // the strategy that registered it, for messages
  std::function<void(StepState&)> run;
};

struct EngineConfig {
  int micro_batches = 1;
  int rows_per_micro = 1;
  OptimizerConfig optimizer;
};

// The roles an engine runs with; null members take the core's defaults (accumulation over
// micro-batches, no gradient sync, AdamW over the store's owned slices, no world to sum over).
struct EngineRoles {
  std::unique_ptr<Schedule> schedule;
  std::unique_ptr<GradSync> grad_sync;
  std::unique_ptr<Optimizer> optimizer;
  std::vector<PhaseHook> hooks;
  // Sums the gradient norm's owned parts over every rank (the grid's world); null: one process.
  Communicator* world = nullptr;
};

class Engine {
 public:
  Engine(const EngineConfig& cfg, GPT& model, Backend& backend, EngineRoles roles = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  // One training step. `before_update`, when given, runs after the norm phase and before clipping
  // and the optimizer (the exporter reads the raw gradients there). A step whose loss or gradient
  // norm is not finite leaves parameters and optimizer state as they were.
  StepStats train_step(std::int64_t step, const BatchFn& fetch,
                       const std::function<void(const StepStats&)>& before_update = {});
  // Mean loss over `batches` global batches drawn by `fetch` (step = batch number), forward only.
  double evaluate(int batches, const BatchFn& fetch);
  GPT& model() { return model_; }
  Backend& backend() { return be_; }
  Optimizer& optimizer() { return *optimizer_; }
  const Schedule& schedule() const { return *schedule_; }
  Schedule& schedule() { return *schedule_; }
  const GradSync& grad_sync() const { return *sync_; }
  GradSync& grad_sync() { return *sync_; }
  // Registers `hook` to run after the built-in work of its phase (in registration order).
  void add_hook(PhaseHook hook) { hooks_[static_cast<std::size_t>(hook.phase)].push_back(std::move(hook)); }
  // Registers `hook` to run before the phase's other hooks: one that may skip the update (the driver's
  // loss-spike detector) comes before those that react to a skip (compression's residual reset).
  void add_first_hook(PhaseHook hook) {
    auto& list = hooks_[static_cast<std::size_t>(hook.phase)];
    list.insert(list.begin(), std::move(hook));
  }
  const std::vector<PhaseHook>& hooks(StepPhase p) const { return hooks_[static_cast<std::size_t>(p)]; }

 private:
  void run_hooks(StepPhase p, StepState& s);
  // The squared norm of the gradient elements this rank is the primary owner of.
  double owned_sq_norm();

  EngineConfig cfg_;
  GPT& model_;
  Backend& be_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<Schedule> schedule_;
  std::unique_ptr<GradSync> sync_;
  Communicator* world_ = nullptr;
  std::array<std::vector<PhaseHook>, kStepPhases> hooks_;
  std::vector<std::int32_t> inputs_, targets_;
  std::vector<BufferRef> norm_slices_;
};

}  // namespace loom
