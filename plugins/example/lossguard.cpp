// The template for a strategy plugin built outside loom's tree: copy this folder, rename, build with
//   cmake -S . -B build -DCMAKE_PREFIX_PATH=P && cmake --build build && cmake --install build
// (P: where loom is installed), and use it with `--set run.plugins=lossguard`. See CMakeLists.txt.
//
// `lossguard`: stops a run whose training loss spikes, before the spike is written into a checkpoint
// of its own: a phase hook at `norm` (the loss is the mean over the global batch there, the same on
// every rank, so every rank takes the same decision) compares the step's loss with the lowest loss
// seen so far and fails the run when it is more than lossguard.max_ratio times that, after
// lossguard.after steps. The driver then stops with the reason, exit status 1, as for a non-finite
// step; the last checkpoint is the last good one.
#include <algorithm>
#include <limits>
#include <memory>
#include <sstream>
#include <string>

#include "core/engine/plugin.hpp"

namespace {

// What the hook remembers between steps (per process; every rank sees the same losses).
struct LossGuard {
  double max_ratio = 2;
  long after = 10;
  double lowest = std::numeric_limits<double>::infinity();
  long seen = 0;

  void check(loom::StepState& s) {
    ++seen;
    if (seen > after && s.loss > max_ratio * lowest) {
      std::ostringstream why;
      why << "lossguard: step " << s.step + 1 << " loss " << s.loss  // s.step counts from 0
          << " is more than lossguard.max_ratio = " << max_ratio << " times the lowest loss so far (" << lowest
          << "); stopped (raise lossguard.max_ratio, or lower train.lr)";
      s.failure = why.str();
    }
    lowest = std::min(lowest, s.loss);
  }
};

void register_lossguard(void* p) {
  auto& info = *static_cast<loom::StrategyInfo*>(p);
  // Its deck keys, checked like the core's (`loom keys` lists them; a typo is refused with a suggestion).
  info.keys.push_back(loom::float_key("lossguard.max_ratio", "2", 1.0, 1e9,
                                      "lossguard: stop when the loss exceeds this multiple of the lowest loss so far"));
  info.keys.push_back(
      loom::int_key("lossguard.after", "10", 0, 1e12, "lossguard: steps before the guard starts comparing"));
  // Every role a strategy fills is declared; this one only adds a phase hook.
  info.claims = {{loom::Role::phase_hooks, loom::Claim::provides, ""}};
  info.create = [](loom::StrategyContext& ctx, loom::Roles& roles) {
    auto guard = std::make_shared<LossGuard>();
    guard->max_ratio = ctx.deck.get_float("lossguard.max_ratio");
    guard->after = static_cast<long>(ctx.deck.get_int("lossguard.after"));
    roles.hooks.push_back({loom::StepPhase::norm, "lossguard", [guard](loom::StepState& s) { guard->check(s); }});
  };
}

}  // namespace

// The one entry point loom looks for: the ABI version it was built against (a mismatch is refused
// when loading), its name, version and one line for `loom plugins`, and the function that registers it.
extern "C" const loom_plugin_v1* loom_plugin_entry(void) {
  static const loom_plugin_v1 plugin = {LOOM_PLUGIN_ABI_VERSION, "lossguard", "1.0.0",
                                        "example plugin: stops a run whose loss spikes above a multiple of its lowest",
                                        register_lossguard};
  return &plugin;
}
