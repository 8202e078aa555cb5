// Plugins that exist only to be refused by the loader tests. Built into build/test-plugins/, never
// on the default plugin path. Which one is compiled is chosen by a macro.
#include "core/engine/plugin.hpp"

#ifndef LOOM_TEST_NO_ENTRY
namespace {
void register_nothing(void* p) {
  auto& info = *static_cast<loom::StrategyInfo*>(p);
#ifdef LOOM_TEST_EXCLUSIVE
  info.incompatible = {"data"};
#endif
  info.create = [](loom::StrategyContext&, loom::Roles&) {};
}
}  // namespace

extern "C" const loom_plugin_v1* loom_plugin_entry(void) {
#if defined(LOOM_TEST_BAD_ABI)
  static const loom_plugin_v1 p = {LOOM_PLUGIN_ABI_VERSION + 98, "badabi", "9.9.9", "built for another ABI",
                                   register_nothing};
#else
  static const loom_plugin_v1 p = {LOOM_PLUGIN_ABI_VERSION, "exclusive", "0.0.1",
                                   "a test strategy that declares itself incompatible with data", register_nothing};
#endif
  return &p;
}
#else
extern "C" int loom_not_the_entry_point(void) { return 0; }
#endif
