// The plugin loader's refusals: ABI mismatch, no entry point, a name it cannot find (listing the
// ones it can), a combination a plugin declares incompatible; and the happy path for `data`.
#include <gtest/gtest.h>

#include "core/base/error.hpp"
#include "core/engine/plugin.hpp"

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
  for (const auto& k : r.find("data")->keys) has_bucket |= k.name == "data_parallel.bucket_mb";
  EXPECT_TRUE(has_bucket);
  EXPECT_EQ(resolve_strategies(r, {{"data", "parallel.dp = 2"}}).size(), 1u);
}

// loom's own libraries sit beside the plugins in build/lib (core, I/O, the CUDA back end and the
// emulated device): the loader passes them by, so no run's banner reports them as broken plugins.
TEST(PluginLoader, PassesByLoomsOwnLibraries) {
  auto r = load_all();
  for (const char* own : {"core", "io", "cuda", "cuda_emu"}) {
    EXPECT_EQ(r.unusable.count(own), 0u) << own << ": " << r.unusable[own];
    for (const auto& line : r.log) EXPECT_NE(line.rfind(std::string("plugin ") + own + ":", 0), 0u) << line;
  }
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
  const auto msg = error_of(r, {{"nosuch", "run.plugins = nosuch"}});
  EXPECT_NE(msg.find("run.plugins = nosuch needs strategy plugin 'nosuch'"), std::string::npos) << msg;
  EXPECT_NE(
      msg.find(
          "available: compression, context, countreducer, data, exclusive, expert, local, mixed_precision, pipeline, "
          "syncclash, tensor, undeclared, zero"),
      std::string::npos)
      << msg;
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

// Declared composition (core/engine/plugin.cpp check_role_claims), on strategies described in place.
namespace {
StrategyInfo strategy(const std::string& name, std::vector<RoleClaim> claims) {
  StrategyInfo s;
  s.name = name;
  s.origin = "test";
  s.claims = std::move(claims);
  return s;
}
std::string claims_error(const std::vector<const StrategyInfo*>& run) {
  std::vector<std::string> reasons;
  for (const StrategyInfo* s : run) reasons.push_back("run.plugins = " + s->name);
  try {
    check_role_claims(run, reasons);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(RoleClaims, SecondProviderIsRefusedNamingBoth) {
  const StrategyInfo data =
      strategy("data", {{Role::grad_sync, Claim::provides, ""}, {Role::reducer, Claim::provides, ""}});
  const StrategyInfo other = strategy("other", {{Role::grad_sync, Claim::provides, ""}});
  const std::string msg = claims_error({&data, &other});
  EXPECT_NE(msg.find("'data' (run.plugins = data) and 'other' (run.plugins = other) both fill the gradient sync role"),
            std::string::npos)
      << msg;
}

TEST(RoleClaims, ReplacingAndWrappingComposeAndAreCheckedAgainstTheRun) {
  const StrategyInfo data =
      strategy("data", {{Role::grad_sync, Claim::provides, ""}, {Role::reducer, Claim::provides, ""}});
  const StrategyInfo zero =
      strategy("zero", {{Role::grad_sync, Claim::replaces, "data"}, {Role::reducer, Claim::replaces, "data"}});
  const StrategyInfo wrap = strategy("compress", {{Role::reducer, Claim::wraps, "data"}});
  const StrategyInfo hooks1 = strategy("h1", {{Role::phase_hooks, Claim::provides, ""}});
  const StrategyInfo hooks2 = strategy("h2", {{Role::phase_hooks, Claim::provides, ""}});
  EXPECT_EQ(claims_error({&data, &zero}), "");
  EXPECT_EQ(claims_error({&data, &wrap}), "");
  EXPECT_EQ(claims_error({&data, &zero, &wrap}), "");
  EXPECT_EQ(claims_error({&hooks1, &hooks2}), "") << "any number of strategies may add phase hooks";
  // a replace or wrap of a strategy that is not in the run
  EXPECT_NE(claims_error({&zero}).find("replaces the gradient sync of 'data', which is not in this run"),
            std::string::npos)
      << claims_error({&zero});
  EXPECT_NE(claims_error({&wrap}).find("wraps the reducer of 'data', which is not in this run"), std::string::npos);
  // a wrap of the run's reducer, whichever strategy provides it (the precision strategy's cast): no
  // target to check, and a run without a reducer is no error (the wrapper is then not used)
  const StrategyInfo cast = strategy("cast", {{Role::reducer, Claim::wraps, ""}});
  EXPECT_EQ(claims_error({&cast}), "");
  EXPECT_EQ(claims_error({&data, &zero, &cast, &wrap}), "");
  // a wrap of a role that cannot be wrapped
  const StrategyInfo bad = strategy("bad", {{Role::optimizer, Claim::wraps, "data"}});
  EXPECT_NE(claims_error({&data, &bad}).find("only the reducer can be wrapped"), std::string::npos);
  // a replace of a strategy that does not fill the role
  const StrategyInfo opt = strategy("opt", {{Role::optimizer, Claim::replaces, "data"}});
  EXPECT_NE(claims_error({&data, &opt}).find("which does not fill that role"), std::string::npos);
}

TEST(RoleClaims, FillingAnUndeclaredRoleIsRefused) {
  const StrategyInfo s = strategy("quiet", {{Role::schedule, Claim::provides, ""}});
  Roles roles;
  roles.grad_sync = std::make_unique<GradSync>();
  try {
    check_filled_roles(s, filled_roles(roles));
    FAIL() << "accepted a gradient sync the strategy did not claim";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("'quiet' (test) fills the gradient sync role without declaring it"),
              std::string::npos)
        << e.what();
  }
  Roles declared;
  declared.schedule = std::make_unique<AccumulateSchedule>();
  EXPECT_NO_THROW(check_filled_roles(s, filled_roles(declared)));
}

// A reducer filled as its claim does not say: a wrapper that sets Roles::reducer would replace the
// reducer it declared it wraps, and a provider that sets Roles::wrap_reducer would wrap one.
TEST(RoleClaims, AReducerIsFilledAsItsClaimSays) {
  const auto error = [](const StrategyInfo& s, const Roles& roles) -> std::string {
    try {
      check_filled_roles(s, roles);
    } catch (const InputError& e) {
      return e.what();
    }
    return "";
  };
  const StrategyInfo wrapper = strategy("compress", {{Role::reducer, Claim::wraps, "data"}});
  const StrategyInfo provider = strategy("data", {{Role::reducer, Claim::provides, ""}});
  Roles sets_reducer;
  struct NoReducer final : Reducer {  // never asked to reduce
    std::string name() const override { return "none"; }
    CommRequestPtr reduce_async(const GradBucket&) override { return nullptr; }
  };
  sets_reducer.reducer = std::make_unique<NoReducer>();
  Roles sets_wrapper;
  sets_wrapper.wrap_reducer = [](std::unique_ptr<Reducer> inner) { return inner; };
  EXPECT_NE(error(wrapper, sets_reducer).find("declares that it wraps the reducer of 'data' but sets Roles::reducer"),
            std::string::npos)
      << error(wrapper, sets_reducer);
  EXPECT_NE(error(provider, sets_wrapper).find("sets Roles::wrap_reducer but declares that it provides the reducer"),
            std::string::npos)
      << error(provider, sets_wrapper);
  EXPECT_EQ(error(wrapper, sets_wrapper), "");
  EXPECT_EQ(error(provider, sets_reducer), "");
}

// Checkpoint state and the model's progress hook are roles too: filled only when declared.
TEST(RoleClaims, CheckpointStateAndTheProgressHookMustBeClaimed) {
  const StrategyInfo quiet = strategy("quiet", {{Role::phase_hooks, Claim::provides, ""}});
  Roles parts;
  parts.checkpoint_parts.push_back(nullptr);
  Roles progress;
  progress.progress = [] {};
  for (const Roles* r : {&parts, &progress}) {
    try {
      check_filled_roles(quiet, *r);
      ADD_FAILURE() << "accepted an undeclared role";
    } catch (const InputError& e) {
      EXPECT_TRUE(std::string(e.what()).find("fills the checkpoint state role without declaring it") !=
                      std::string::npos ||
                  std::string(e.what()).find("fills the progress hook role without declaring it") != std::string::npos)
          << e.what();
    }
  }
  const StrategyInfo a =
      strategy("a", {{Role::checkpoint, Claim::provides, ""}, {Role::progress, Claim::provides, ""}});
  const StrategyInfo b =
      strategy("b", {{Role::checkpoint, Claim::provides, ""}, {Role::progress, Claim::provides, ""}});
  EXPECT_NO_THROW(check_filled_roles(a, parts));
  EXPECT_NO_THROW(check_filled_roles(a, progress));
  // any number of strategies may keep checkpoint state; one progress hook per run
  const StrategyInfo c = strategy("c", {{Role::checkpoint, Claim::provides, ""}});
  EXPECT_EQ(claims_error({&a, &c}), "");
  EXPECT_NE(claims_error({&a, &b}).find("both fill the progress hook role"), std::string::npos)
      << claims_error({&a, &b});
}

TEST(RoleClaims, ARegisteredPartitionFactoryMustBeClaimed) {
  static const auto reg = [](void* p) {
    auto& info = *static_cast<StrategyInfo*>(p);
    info.make_partition = [](PartitionContext&) { return std::make_unique<Partition>(); };
    info.create = [](StrategyContext&, Roles&) {};
  };
  const loom_plugin_v1 plugin = {LOOM_PLUGIN_ABI_VERSION, "sneaky", "0", "fills the partition unclaimed", reg};
  StrategyRegistry r;
  try {
    r.add(plugin, "test");
    FAIL() << "registered a partition factory without a claim";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("fills the partition role without declaring it"), std::string::npos)
        << e.what();
  }
}
