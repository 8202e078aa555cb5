// The built-in strategy: one replica, gradient accumulation over micro-batches. It describes itself
// with the same loom_plugin_v1 struct as a shared-library plugin and registers into the same map.
#include "core/engine/plugin.hpp"

namespace loom {
namespace {

void register_local(void* p) {
  auto& info = *static_cast<StrategyInfo*>(p);
  // The engine's defaults are this strategy's roles: AccumulateSchedule and the no-op GradSync.
  info.create = [](StrategyContext&, Roles&) {};
}

const loom_plugin_v1 kLocal = {LOOM_PLUGIN_ABI_VERSION, "local", "0.1.0",
                               "one replica: gradient accumulation over train.micro_batches, no gradient sync "
                               "(the core's defaults)",
                               register_local};

}  // namespace

void register_builtin_strategies(StrategyRegistry& registry) { registry.add(kLocal, "built-in"); }

}  // namespace loom
