// The engine's step phases (core/engine/engine.hpp): hooks run once each step, in phase order and,
// within a phase, in registration order; what a phase hands the next is what the contract says (the
// loss after micro_batches, the squared norm after norm, the clip coefficient and rate after clip);
// a skip set in unscale_check leaves parameters and AdamW state exactly as they were and runs no
// clip, optimize or refresh; a non-finite loss does the same; a loss scale set in begin scales
// backward; a failure set by a hook reaches the step's stats. One process, the host back end.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/engine/engine.hpp"
#include "core/model/gpt.hpp"
#include "core/test/batches.hpp"

namespace loom {
namespace {

GPTConfig config() {
  GPTConfig c;
  c.layers = 2;
  c.d_model = 16;
  c.heads = 2;
  c.seq_len = 8;
  c.vocab = 23;
  return c;
}

BatchFn batches(const GPTConfig& c) { return testing::random_batches(c); }

std::vector<float> params_of(GPT& m) {
  std::vector<float> out;
  for (int i = 0; i < static_cast<int>(m.params().size()); ++i) {
    const float* p = m.store().param(i).as<float>();
    out.insert(out.end(), p, p + m.params()[static_cast<std::size_t>(i)].numel());
  }
  return out;
}

std::vector<float> state_of(Optimizer& o) {
  std::vector<float> out;
  for (const auto& t : o.state()) out.insert(out.end(), t.data.as<float>(), t.data.as<float>() + t.data.count);
  return out;
}

struct Fixture {
  std::unique_ptr<Backend> be = make_host_backend(1);
  GPTConfig cfg = config();
  EngineConfig ec;
  std::unique_ptr<GPT> model;
  Fixture() {
    ec.micro_batches = 3;
    ec.rows_per_micro = 2;
    ec.optimizer.lr = 1e-3;
    ec.optimizer.steps = 10;
    ec.optimizer.schedule = "constant";
    model = std::make_unique<GPT>(cfg, *be, ec.rows_per_micro);
    model->init_weights(4);
  }
};

TEST(EnginePhases, HooksRunOnceEachInPhaseOrderThenRegistrationOrder) {
  Fixture f;
  std::vector<std::string> ran;
  EngineRoles roles;
  // Registered out of phase order, two in one phase: the order they run in is the phases', then
  // registration within a phase.
  for (StepPhase p : {StepPhase::refresh, StepPhase::norm, StepPhase::begin, StepPhase::optimize, StepPhase::clip,
                      StepPhase::grads_final, StepPhase::unscale_check, StepPhase::micro_batches})
    roles.hooks.push_back({p, "test", [&ran, p](StepState&) { ran.push_back(step_phase_name(p)); }});
  roles.hooks.push_back({StepPhase::norm, "second", [&ran](StepState&) { ran.push_back("norm (second)"); }});
  Engine e(f.ec, *f.model, *f.be, std::move(roles));
  e.train_step(0, batches(f.cfg));
  const std::vector<std::string> want = {"begin",         "micro_batches", "grads_final", "unscale_check", "norm",
                                         "norm (second)", "clip",          "optimize",    "refresh"};
  EXPECT_EQ(ran, want);
  ran.clear();
  e.train_step(1, batches(f.cfg));
  EXPECT_EQ(ran, want) << "the second step";
}

TEST(EnginePhases, EachPhaseSeesWhatTheOneBeforeItProduced) {
  Fixture f;
  StepState after_micro, after_final, after_norm, after_clip;
  EngineRoles roles;
  roles.hooks.push_back({StepPhase::micro_batches, "t", [&](StepState& s) { after_micro = s; }});
  roles.hooks.push_back({StepPhase::grads_final, "t", [&](StepState& s) { after_final = s; }});
  roles.hooks.push_back({StepPhase::norm, "t", [&](StepState& s) { after_norm = s; }});
  roles.hooks.push_back({StepPhase::clip, "t", [&](StepState& s) { after_clip = s; }});
  f.ec.optimizer.grad_clip = 1e-3;  // far under the norm: clipping active
  Engine e(f.ec, *f.model, *f.be, std::move(roles));
  const StepStats st = e.train_step(0, batches(f.cfg));
  // This rank's loss after the micro-batches; the mean over the replicas (one here) after grads_final.
  EXPECT_TRUE(std::isfinite(after_micro.local_loss));
  EXPECT_GT(after_micro.local_loss, 0.0);
  EXPECT_EQ(after_final.loss, after_micro.local_loss);
  EXPECT_EQ(after_final.loss, st.loss);
  EXPECT_GT(after_norm.sq_norm, 0.0);
  EXPECT_NEAR(std::sqrt(after_norm.sq_norm), st.grad_norm, 1e-12 * st.grad_norm);
  EXPECT_NEAR(after_clip.clip_coef, 1e-3 / (st.grad_norm + 1e-6), 1e-9);
  EXPECT_EQ(after_clip.clip_coef, st.clip_coef);
  EXPECT_EQ(after_clip.lr, 1e-3);
  EXPECT_EQ(st.lr, 1e-3);
}

// Skipped in unscale_check (as a loss scaler skips an overflow): no clip, optimize or refresh; the
// parameters and AdamW state bit for bit as before; the next step is an ordinary one.
TEST(EnginePhases, ASkipInUnscaleCheckLeavesTheModelAsItWas) {
  Fixture f;
  std::vector<std::string> ran;
  bool skip = true;
  EngineRoles roles;
  roles.hooks.push_back({StepPhase::unscale_check, "t", [&](StepState& s) {
                           if (skip) s.skip_reason = "test overflow";
                         }});
  for (StepPhase p : {StepPhase::clip, StepPhase::optimize, StepPhase::refresh})
    roles.hooks.push_back({p, "t", [&ran, p](StepState&) { ran.push_back(step_phase_name(p)); }});
  Engine e(f.ec, *f.model, *f.be, std::move(roles));
  e.train_step(0, batches(f.cfg));  // an ordinary step first: AdamW state not zero
  ran.clear();
  const std::vector<float> p0 = params_of(*f.model), m0 = state_of(e.optimizer());
  const std::int64_t t0 = e.optimizer().steps_taken();
  const StepStats st = e.train_step(1, batches(f.cfg));
  EXPECT_EQ(st.skip_reason, "test overflow");
  EXPECT_TRUE(ran.empty()) << ran.front() << " ran after a skip";
  EXPECT_TRUE(params_of(*f.model) == p0) << "parameters changed in a skipped step";
  EXPECT_TRUE(state_of(e.optimizer()) == m0) << "AdamW state changed in a skipped step";
  EXPECT_EQ(e.optimizer().steps_taken(), t0);
  skip = false;
  const StepStats next = e.train_step(2, batches(f.cfg));
  EXPECT_EQ(next.skip_reason, "");
  EXPECT_EQ(ran.size(), 3u);
  EXPECT_FALSE(params_of(*f.model) == p0);
  EXPECT_EQ(e.optimizer().steps_taken(), t0 + 1);
}

TEST(EnginePhases, ANonFiniteLossAppliesNoUpdate) {
  Fixture f;
  Engine e(f.ec, *f.model, *f.be);
  e.train_step(0, batches(f.cfg));
  const std::vector<float> p0 = params_of(*f.model), m0 = state_of(e.optimizer());
  // A NaN in the positions table: every forward is NaN.
  const int wpe = f.model->param_index("wpe.weight");
  ASSERT_GE(wpe, 0);
  float* w = f.model->store().param(wpe).as<float>();
  const float keep = w[0];
  w[0] = std::nanf("");
  const StepStats st = e.train_step(1, batches(f.cfg));
  EXPECT_TRUE(st.nonfinite);
  w[0] = keep;
  EXPECT_TRUE(params_of(*f.model) == p0) << "a non-finite step changed the parameters";
  EXPECT_TRUE(state_of(e.optimizer()) == m0) << "a non-finite step changed AdamW state";
}

// A loss scale set in begin multiplies backward's seed: the gradient norm the norm phase sees is
// the scale times the unscaled one (to rounding), the loss is not scaled.
TEST(EnginePhases, ALossScaleSetInBeginScalesTheGradients) {
  double sq[2] = {0, 0}, loss[2] = {0, 0};
  for (int k = 0; k < 2; ++k) {
    Fixture f;
    EngineRoles roles;
    const double scale = k == 0 ? 1.0 : 1024.0;
    roles.hooks.push_back({StepPhase::begin, "t", [scale](StepState& s) { s.loss_scale = scale; }});
    roles.hooks.push_back({StepPhase::norm, "t", [&sq, k](StepState& s) {
                             sq[k] = s.sq_norm;
                             s.sq_norm = 1.0;  // keep the update finite and comparable
                           }});
    Engine e(f.ec, *f.model, *f.be, std::move(roles));
    loss[k] = e.train_step(0, batches(f.cfg)).loss;
  }
  EXPECT_EQ(loss[0], loss[1]);
  EXPECT_NEAR(std::sqrt(sq[1]) / std::sqrt(sq[0]), 1024.0, 1024.0 * 1e-5);
}

TEST(EnginePhases, AFailureSetByAHookReachesTheStepStats) {
  Fixture f;
  EngineRoles roles;
  roles.hooks.push_back({StepPhase::unscale_check, "t", [](StepState& s) {
                           s.skip_reason = "overflow";
                           s.failure = "the loss scale cannot back off further";
                         }});
  Engine e(f.ec, *f.model, *f.be, std::move(roles));
  const StepStats st = e.train_step(0, batches(f.cfg));
  EXPECT_EQ(st.failure, "the loss scale cannot back off further");
}

}  // namespace
}  // namespace loom
