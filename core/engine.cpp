#include "core/engine.hpp"

#include <chrono>
#include <cmath>
#include <limits>

#include "core/fault.hpp"

namespace loom {
namespace {
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
}  // namespace

double AccumulateSchedule::run(StepContext& ctx) {
  double total = 0;
  const float dloss = 1.0f / static_cast<float>(ctx.micro_batches);
  for (int k = 0; k < ctx.micro_batches; ++k) {
    double t0 = now();
    ctx.fetch(ctx.step, static_cast<std::int64_t>(k) * ctx.rows_per_micro, ctx.rows_per_micro, ctx.inputs, ctx.targets);
    double t1 = now();
    total += ctx.model.forward(ctx.inputs.data(), ctx.targets.data(), ctx.rows_per_micro);
    double t2 = now();
    ctx.sync.begin_micro_batch(ctx.model, k, ctx.micro_batches);
    ctx.model.backward(dloss);
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

Engine::Engine(const EngineConfig& cfg, GPT& model, Backend& backend, std::unique_ptr<Schedule> schedule,
               std::unique_ptr<GradSync> sync)
    : cfg_(cfg),
      model_(model),
      be_(backend),
      optimizer_(cfg.optimizer, backend, model.params()),
      schedule_(schedule ? std::move(schedule) : std::make_unique<AccumulateSchedule>()),
      sync_(sync ? std::move(sync) : std::make_unique<GradSync>()) {
  model_.set_grad_ready_hook([this](int first, int end) { sync_->grads_ready(model_, first, end); });
}

Engine::~Engine() { model_.set_grad_ready_hook({}); }

StepStats Engine::train_step(std::int64_t step, const BatchFn& fetch,
                            const std::function<void(const StepStats&)>& before_update) {
  Ledger::global().reset_peaks();
  StepStats st;
  st.step = step;
  const double t0 = now();
  model_.zero_grad();
  // Regression cases poison one weight element of one rank for this step only (a bad batch's NaN).
  const bool poison = inject_fault("nan", step) && !model_.params().empty();
  float* poisoned = poison ? model_.param_data() + model_.params().front().offset : nullptr;
  const float kept = poison ? *poisoned : 0.0f;
  if (poison) *poisoned = std::numeric_limits<float>::quiet_NaN();
  StepContext ctx{model_, step, cfg_.micro_batches, cfg_.rows_per_micro, fetch, st.times, *sync_, std::move(inputs_), std::move(targets_)};
  const double local_loss = schedule_->run(ctx);
  inputs_ = std::move(ctx.inputs);
  targets_ = std::move(ctx.targets);

  if (poison) *poisoned = kept;

  double t1 = now();
  // Gradient sync first: its all-reduces may still be in flight on the gradient buffer. Both steps
  // are sums over disjoint groups, so the order does not change the result.
  sync_->finish(model_);
  model_.partition().finish_grads(model_);
  schedule_->finish_grads(model_);
  st.local_loss = local_loss;
  st.loss = sync_->mean_over_replicas(local_loss);
  const double sq = schedule_->grad_sq_norm(sync_->grad_sq_norm(model_.partition().grad_sq_norm(model_, be_)));
  st.grad_norm = std::sqrt(sq);
  double t2 = now();
  st.times.sync = t2 - t1;
  st.lr = lr_at(cfg_.optimizer, step);
  if (before_update) before_update(st);

  // Loss and norm are global (reduced over every group), so every rank takes the same branch.
  st.nonfinite = !std::isfinite(st.loss) || !std::isfinite(st.grad_norm);
  if (!st.nonfinite) {
    st.clip_coef = clip_coefficient(st.grad_norm, cfg_.optimizer.grad_clip);
    if (st.clip_coef < 1.0) be_.scale(model_.grad_data(), static_cast<float>(st.clip_coef), model_.num_params());
    optimizer_.step(model_.param_data(), model_.grad_data(), st.lr);
    // Regression cases make the weights themselves non-finite (as an overflowing update would).
    if (inject_fault("nan_weights", step) && !model_.params().empty())
      model_.param_data()[model_.params().back().offset] = std::numeric_limits<float>::quiet_NaN();
  }
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
    StepContext ctx{model_, e, cfg_.micro_batches, cfg_.rows_per_micro, fetch, times, *sync_, std::move(inputs_), std::move(targets_)};
    total += schedule_->forward_only(ctx);
    inputs_ = std::move(ctx.inputs);
    targets_ = std::move(ctx.targets);
  }
  return sync_->mean_over_replicas(total / batches);
}

}  // namespace loom
