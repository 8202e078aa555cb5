#include "core/engine/engine.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include "core/base/clock.hpp"
#include "core/comm/fault.hpp"

namespace loom {
namespace {}  // namespace

double AccumulateSchedule::run(StepContext& ctx) {
  double total = 0;
  const float dloss = ctx.loss_scale / static_cast<float>(ctx.micro_batches);
  for (int k = 0; k < ctx.micro_batches; ++k) {
    double t0 = now();
    ctx.fetch(ctx.step, static_cast<std::int64_t>(k) * ctx.rows_per_micro, ctx.rows_per_micro, ctx.inputs, ctx.targets);
    double t1 = now();
    inject_slowness(ctx.step);  // LOOM_INJECT_FAULT where=slow: a slow node's forward
    total += ctx.model.forward(ctx.inputs.data(), ctx.targets.data(), ctx.rows_per_micro, dloss);  // fused classifier
    double t2 = now();
    ctx.sync.begin_micro_batch(ctx.model, k, ctx.micro_batches);
    ctx.model.backward(dloss);
    ctx.model.backend().synchronize();  // a device back end's queued backward belongs to its time
    double t3 = now();
    ctx.times.data += t1 - t0;
    ctx.times.forward += t2 - t1;
    ctx.times.backward += t3 - t2;
  }
  return total / ctx.micro_batches;
}

double Schedule::forward_only(StepContext& ctx) {
  double total = 0;
  for (int k = 0; k < ctx.micro_batches; ++k) {
    ctx.fetch(ctx.step, static_cast<std::int64_t>(k) * ctx.rows_per_micro, ctx.rows_per_micro, ctx.inputs, ctx.targets);
    total += ctx.model.forward(ctx.inputs.data(), ctx.targets.data(), ctx.rows_per_micro);
  }
  return total / ctx.micro_batches;
}

const char* step_phase_name(StepPhase p) {
  switch (p) {
    case StepPhase::begin:
      return "begin";
    case StepPhase::micro_batches:
      return "micro_batches";
    case StepPhase::grads_final:
      return "grads_final";
    case StepPhase::unscale_check:
      return "unscale_check";
    case StepPhase::norm:
      return "norm";
    case StepPhase::clip:
      return "clip";
    case StepPhase::optimize:
      return "optimize";
    case StepPhase::refresh:
      return "refresh";
    case StepPhase::count_:
      break;
  }
  return "?";
}

Engine::Engine(const EngineConfig& cfg, GPT& model, Backend& backend, EngineRoles roles)
    : cfg_(cfg),
      model_(model),
      be_(backend),
      optimizer_(roles.optimizer ? std::move(roles.optimizer) : std::make_unique<AdamW>(cfg.optimizer, backend)),
      schedule_(roles.schedule ? std::move(roles.schedule) : std::make_unique<AccumulateSchedule>()),
      sync_(roles.grad_sync ? std::move(roles.grad_sync) : std::make_unique<GradSync>()),
      world_(roles.world) {
  optimizer_->build(model_.params(), model_.store().owned());
  for (PhaseHook& h : roles.hooks) add_hook(std::move(h));
  model_.set_grad_ready_hook([this](int unit) { sync_->grads_ready(model_, unit); });
}

Engine::~Engine() { model_.set_grad_ready_hook({}); }

void Engine::run_hooks(StepPhase p, StepState& s) {
  for (const PhaseHook& h : hooks_[static_cast<std::size_t>(p)]) h.run(s);
}

double Engine::owned_sq_norm() {
  // One fused pass of the back end over the primary slices (a sum of squares per tensor, added in
  // order); a non-finite element makes the sum non-finite, which the step then sees.
  ParamStore& store = model_.store();
  norm_slices_.clear();
  for (const OwnedSlice& o : store.owned())
    if (o.primary) norm_slices_.push_back(store.owned_grad(o));
  return be_.sq_norm_check(norm_slices_).sum_squares;
}

StepStats Engine::train_step(std::int64_t step, const BatchFn& fetch,
                             const std::function<void(const StepStats&)>& before_update) {
  Ledger::global().reset_peaks();
  StepStats st;
  StepState s;
  st.step = s.step = step;
  const double t0 = now();
  run_hooks(StepPhase::begin, s);
  st.loss_scale = s.loss_scale;

  // micro_batches: the schedule's forwards and backwards.
  model_.zero_grad();
  // Regression cases poison one weight element of one rank for this step only (a bad batch's NaN):
  // the first it updates of a tensor the store holds whole (which the forward reads, or casts its
  // 16-bit copy from), else the first it updates (ZeRO-3's shares, gathered from it). A 16-bit
  // ZeRO-1/2 rank's first owned slice may be a matrix's fp32 master share, which no forward reads.
  ParamStore& store = model_.store();
  const auto& owned = store.owned();
  const bool poison = inject_fault("nan", step) && !owned.empty();
  const auto read =
      std::find_if(owned.begin(), owned.end(), [&](const OwnedSlice& o) { return !store.param(o.param).empty(); });
  // Through the back end, so that a device tensor is poisoned alike.
  const BufferRef poisoned =
      poison ? store.owned_param(read != owned.end() ? *read : owned.front()).slice(0, 1) : BufferRef();
  float kept = 0.0f;
  if (poison) {
    be_.copy_to_host(&kept, poisoned);
    be_.fill(poisoned, std::numeric_limits<double>::quiet_NaN());
    store.local_params_written();  // the 16-bit compute copies see it too
  }
  StepContext ctx{model_,   step,   cfg_.micro_batches, cfg_.rows_per_micro, fetch,
                  st.times, *sync_, std::move(inputs_), std::move(targets_), static_cast<float>(s.loss_scale)};
  s.local_loss = schedule_->run(ctx);
  inputs_ = std::move(ctx.inputs);
  targets_ = std::move(ctx.targets);
  if (poison) {
    be_.copy_from_host(poisoned, &kept);
    store.local_params_written();
  }
  run_hooks(StepPhase::micro_batches, s);

  // grads_final. Gradient sync first: its all-reduces may still be in flight on the gradient
  // buffer. Both steps are sums over disjoint groups, so the order does not change the result.
  be_.synchronize();
  double t1 = now();
  sync_->finish(model_);
  model_.experts().finish_grads(model_);  // the experts' gradients, over the ranks holding them (ep > 1)
  model_.partition().finish_grads(model_);
  schedule_->finish_grads(model_);
  s.loss = sync_->mean_over_replicas(s.local_loss);
  run_hooks(StepPhase::grads_final, s);
  // Regression cases make one gradient element of one rank infinite after the sync (an fp16 overflow
  // in that rank's share alone, which only agreement between the ranks can turn into a skip everywhere).
  if (inject_fault("overflow", step) && !store.owned().empty())
    be_.fill(store.owned_grad(store.owned().front()).slice(0, 1), std::numeric_limits<double>::infinity());

  // unscale_check: nothing to unscale in fp32; a loss scaler's hook divides the gradients by the
  // scale here and skips the update when they overflowed.
  run_hooks(StepPhase::unscale_check, s);

  // norm: every element is counted by its one primary owner, summed over the world.
  s.sq_norm = owned_sq_norm();
  if (world_ && world_->size() > 1) s.sq_norm = world_->sum(s.sq_norm);
  run_hooks(StepPhase::norm, s);
  st.local_loss = s.local_loss;
  st.loss = s.loss;
  st.grad_norm = std::sqrt(s.sq_norm);
  double t2 = now();
  st.times.sync = t2 - t1;
  st.lr = s.lr = lr_at(cfg_.optimizer, step);
  if (before_update) before_update(st);

  // Loss and norm are global (reduced over every group), so every rank takes the same branch.
  // A step a hook skipped on purpose (a loss-scale overflow) may hold non-finite values: expected.
  if (s.skip_reason.empty()) s.nonfinite = s.nonfinite || !std::isfinite(st.loss) || !std::isfinite(st.grad_norm);
  st.nonfinite = s.nonfinite;
  st.skip_reason = s.skip_reason;
  st.failure = s.failure;
  if (!s.nonfinite && s.skip_reason.empty()) {
    // clip: the slices this rank updates (replicas scale their copies alike).
    s.clip_coef = clip_coefficient(st.grad_norm, cfg_.optimizer.grad_clip);
    if (s.clip_coef < 1.0) {
      for (const OwnedSlice& o : store.owned())
        be_.scale(store.owned_grad(o).slice(0, o.size()), static_cast<float>(s.clip_coef));
    }
    run_hooks(StepPhase::clip, s);
    st.clip_coef = s.clip_coef;
    // optimize: the optimizer role on the owned slices.
    optimizer_->step(store, st.lr);
    // Regression cases make the weights themselves non-finite (as an overflowing update would): the
    // first element of the last slice this rank updates.
    if (inject_fault("nan_weights", step) && !store.owned().empty())
      be_.fill(store.owned_param(store.owned().back()).slice(0, 1), std::numeric_limits<double>::quiet_NaN());
    run_hooks(StepPhase::optimize, s);
    // refresh: gather updated shards, refresh compute copies.
    store.refresh();
    run_hooks(StepPhase::refresh, s);
  }
  store.end_step();
  be_.synchronize();  // a device back end's queued update belongs to this step's time
  const double t3 = now();
  st.times.optimizer = t3 - t2;
  st.seconds = t3 - t0;
  for (int i = 0; i < kMemCategories; ++i) st.peak_bytes[i] = Ledger::global().peak(static_cast<Mem>(i));
  st.peak_total = Ledger::global().peak_total();
  return st;
}

double Engine::evaluate(int batches, const BatchFn& fetch) {
  // Whole global batches, in micro-batch chunks: the validation loss means the same whatever the
  // micro-batching (and, with data parallelism, whatever the number of ranks).
  double total = 0;
  PhaseTimes times;
  for (int e = 0; e < batches; ++e) {
    StepContext ctx{model_, e,      cfg_.micro_batches, cfg_.rows_per_micro, fetch,
                    times,  *sync_, std::move(inputs_), std::move(targets_)};
    total += schedule_->forward_only(ctx);
    inputs_ = std::move(ctx.inputs);
    targets_ = std::move(ctx.targets);
  }
  return sync_->mean_over_replicas(total / batches);
}

}  // namespace loom
