// The plugin loader's refusals: ABI mismatch, no entry point, a name it cannot find (listing the
// ones it can), a combination a plugin declares incompatible; and the happy path for `data`.
#include <gtest/gtest.h>

#include "core/error.hpp"
#include "core/plugin.hpp"

using namespace loom;

namespace {
StrategyRegistry load_all() {
  StrategyRegistry r;
  register_builtin_strategies(r);
  discover_plugins(r, {LOOM_TEST_PLUGIN_DIR, LOOM_PLUGIN_DIR});
  return r;
}
std::string error_of(const StrategyRegistry& r, std::vector<std::pair<std::string, std::string>> want) {
  try {
    resolve_strategies(r, want);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(PluginLoader, LoadsDataPluginAndBuiltins) {
  auto r = load_all();
  ASSERT_NE(r.find("data"), nullptr);
  EXPECT_EQ(r.find("data")->version, "0.1.0");
  EXPECT_NE(r.find("data")->origin.find("libloom_data.so"), std::string::npos);
  ASSERT_NE(r.find("local"), nullptr);
  EXPECT_EQ(r.find("local")->origin, "built-in");
  bool logged = false;
  const std::string abi = "(ABI " + std::to_string(LOOM_PLUGIN_ABI_VERSION) + ")";
  for (const auto& line : r.log) logged |= line.find("plugin data 0.1.0 " + abi) != std::string::npos;
  EXPECT_TRUE(logged);
  // Its deck section is declared like the core's.
  bool has_bucket = false;
  for (const auto& k : r.find("data")->keys) has_bucket |= k.name == "data.bucket_mb";
  EXPECT_TRUE(has_bucket);
  EXPECT_EQ(resolve_strategies(r, {{"data", "parallel.dp = 2"}}).size(), 1u);
}

TEST(PluginLoader, RefusesAbiMismatch) {
  auto r = load_all();
  EXPECT_EQ(r.find("badabi"), nullptr);
  const auto msg = error_of(r, {{"badabi", "run.plugins = badabi"}});
  EXPECT_NE(msg.find("run.plugins = badabi"), std::string::npos) << msg;
  EXPECT_NE(msg.find("ABI " + std::to_string(LOOM_PLUGIN_ABI_VERSION + 98)), std::string::npos) << msg;
  EXPECT_NE(msg.find("this loom speaks ABI " + std::to_string(LOOM_PLUGIN_ABI_VERSION)), std::string::npos) << msg;
}

TEST(PluginLoader, RefusesLibraryWithoutEntryPoint) {
  auto r = load_all();
  const auto msg = error_of(r, {{"noentry", "run.plugins = noentry"}});
  EXPECT_NE(msg.find("no loom_plugin_entry entry point"), std::string::npos) << msg;
}

TEST(PluginLoader, RefusesUnknownNameListingAvailable) {
  auto r = load_all();
  const auto msg = error_of(r, {{"zero", "run.plugins = zero"}});
  EXPECT_NE(msg.find("run.plugins = zero needs strategy plugin 'zero'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("available: data, exclusive, local, pipeline, tensor"), std::string::npos) << msg;
}

TEST(PluginLoader, RefusesIncompatibleCombination) {
  auto r = load_all();
  const auto msg = error_of(r, {{"data", "parallel.dp = 2"}, {"exclusive", "run.plugins = exclusive"}});
  EXPECT_NE(msg.find("'exclusive' (run.plugins = exclusive) cannot be combined with 'data' (parallel.dp = 2)"),
            std::string::npos)
      << msg;
}

TEST(PluginLoader, RefusesDuplicateRegistration) {
  StrategyRegistry r;
  register_builtin_strategies(r);
  EXPECT_THROW(register_builtin_strategies(r), InputError);
}
