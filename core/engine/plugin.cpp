#include "core/engine/plugin.hpp"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <sstream>

#include "core/base/error.hpp"

namespace fs = std::filesystem;

namespace loom {

void StrategyRegistry::add(const loom_plugin_v1& plugin, const std::string& origin) {
  const std::string name = plugin.name ? plugin.name : "";
  if (plugin.abi_version != LOOM_PLUGIN_ABI_VERSION)
    throw InputError("plugin '" + name + "' (" + origin + ") was built for plugin ABI " +
                     std::to_string(plugin.abi_version) + ", this loom speaks ABI " +
                     std::to_string(LOOM_PLUGIN_ABI_VERSION) + "; rebuild the plugin against this loom");
  if (name.empty() || !plugin.register_strategy)
    throw InputError("plugin at " + origin + " has no name or no register_strategy function");
  if (strategies_.count(name))
    throw InputError("strategy '" + name + "' registered twice: " + strategies_.at(name).origin + " and " + origin);
  StrategyInfo info;
  info.name = name;
  info.version = plugin.version ? plugin.version : "?";
  info.description = plugin.description ? plugin.description : "";
  info.origin = origin;
  plugin.register_strategy(&info);
  if (!info.create) throw InputError("plugin '" + name + "' (" + origin + ") registered no factory");
  std::vector<Role> factories;
  if (info.make_partition) factories.push_back(Role::partition);
  if (info.assign_stage) factories.push_back(Role::stage);
  if (info.make_store) factories.push_back(Role::store);
  if (info.make_precision) factories.push_back(Role::precision);
  if (info.make_context) factories.push_back(Role::context);
  if (info.make_experts) factories.push_back(Role::experts);
  check_filled_roles(info, factories);
  strategies_.emplace(name, std::move(info));
}

const StrategyInfo* StrategyRegistry::find(const std::string& name) const {
  auto it = strategies_.find(name);
  return it == strategies_.end() ? nullptr : &it->second;
}

std::vector<std::string> StrategyRegistry::names() const {
  std::vector<std::string> n;
  for (const auto& [k, v] : strategies_) n.push_back(k);
  return n;
}

// loom's own libraries beside the plugins: the core, I/O, and the CUDA back ends (the real one and
// the emulated device), which a run opens by run.backend, never as strategies.
const std::set<std::string> kNotPlugins = {"libloom_core.so", "libloom_io.so", "libloom_cuda.so",
                                           "libloom_cuda_emu.so"};

void discover_plugins(StrategyRegistry& registry, const std::vector<std::string>& dirs) {
  std::set<std::string> seen;
  for (const auto& dir : dirs) {
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) continue;
    std::vector<fs::path> libs;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      const std::string f = e.path().filename().string();
      if (f.rfind("libloom_", 0) == 0 && e.path().extension() == ".so" && !kNotPlugins.count(f))
        libs.push_back(e.path());
    }
    std::sort(libs.begin(), libs.end());
    for (const auto& lib : libs) {
      const std::string stem = lib.stem().string().substr(8);  // libloom_<name>
      if (!seen.insert(stem).second) continue;                 // an earlier directory wins
      void* handle = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (!handle) {
        registry.unusable[stem] = lib.string() + ": cannot be loaded (" + dlerror() + ")";
        registry.log.push_back("plugin " + stem + ": " + registry.unusable[stem]);
        continue;
      }
      auto entry = reinterpret_cast<loom_plugin_entry_fn>(dlsym(handle, LOOM_PLUGIN_ENTRY_SYMBOL));
      if (!entry) {
        registry.unusable[stem] = lib.string() + ": no " LOOM_PLUGIN_ENTRY_SYMBOL " entry point";
        registry.log.push_back("plugin " + stem + ": " + registry.unusable[stem]);
        dlclose(handle);
        continue;
      }
      const loom_plugin_v1* p = entry();
      const std::string name = p && p->name ? p->name : stem;
      try {
        if (!p) throw InputError(lib.string() + ": entry point returned nothing");
        registry.add(*p, lib.string());
        registry.log.push_back("plugin " + name + " " + (p->version ? p->version : "?") + " (ABI " +
                               std::to_string(p->abi_version) + ") from " + lib.string());
        // The library stays loaded for the life of the process: its code backs the registered factory.
      } catch (const InputError& e) {
        registry.unusable[name] = e.what();
        registry.log.push_back("plugin " + name + ": refused: " + e.what());
      }
    }
  }
}

std::vector<std::pair<std::string, std::string>> layout_strategies(const Layout& l) {
  std::vector<std::pair<std::string, std::string>> wanted;
  // Gradients are summed over dp x cp: context-parallel ranks need the data strategy's sync too.
  if (l.replicas() > 1)
    wanted.push_back({"data", l.dp > 1 ? "parallel.dp = " + std::to_string(l.dp)
                                       : "parallel.cp = " + std::to_string(l.cp) + " (gradients summed over cp)"});
  if (l.tp > 1) wanted.push_back({"tensor", "parallel.tp = " + std::to_string(l.tp)});
  if (l.pp > 1) wanted.push_back({"pipeline", "parallel.pp = " + std::to_string(l.pp)});
  if (l.cp > 1) wanted.push_back({"context", "parallel.cp = " + std::to_string(l.cp)});
  if (l.ep > 1) wanted.push_back({"expert", "parallel.ep = " + std::to_string(l.ep)});
  return wanted;
}

std::vector<const StrategyInfo*> resolve_strategies(const StrategyRegistry& registry,
                                                    const std::vector<std::pair<std::string, std::string>>& requested) {
  std::vector<const StrategyInfo*> out;
  std::vector<std::string> reasons;
  for (const auto& [name, reason] : requested) {
    if (std::any_of(out.begin(), out.end(), [&](const StrategyInfo* s) { return s->name == name; })) continue;
    const StrategyInfo* s = registry.find(name);
    if (!s) {
      auto bad = registry.unusable.find(name);
      if (bad != registry.unusable.end())
        throw InputError(reason + " needs strategy plugin " + quote_value(name) +
                         ", which cannot be used: " + bad->second);
      std::string avail;
      for (const auto& n : registry.names()) avail += (avail.empty() ? "" : ", ") + n;
      std::string where;
      for (const auto& d : plugin_search_path()) where += (where.empty() ? "" : ":") + d;
      throw InputError(reason + " needs strategy plugin " + quote_value(name) + " (libloom_" + escape_value(name) +
                       ".so), which was not found; available: " + avail + " (searched LOOM_PLUGIN_PATH, then " + where +
                       ")");
    }
    out.push_back(s);
    reasons.push_back(reason);
  }
  for (std::size_t i = 0; i < out.size(); ++i)
    for (std::size_t j = 0; j < out.size(); ++j)
      if (i != j && std::count(out[i]->incompatible.begin(), out[i]->incompatible.end(), out[j]->name))
        throw InputError("strategy '" + out[i]->name + "' (" + reasons[i] + ") cannot be combined with '" +
                         out[j]->name + "' (" + reasons[j] + "): plugin " + out[i]->name +
                         " declares them incompatible");
  check_role_claims(out, reasons);
  return out;
}

const char* role_name(Role r) {
  switch (r) {
    case Role::partition:
      return "partition";
    case Role::stage:
      return "stage";
    case Role::store:
      return "parameter store";
    case Role::schedule:
      return "schedule";
    case Role::grad_sync:
      return "gradient sync";
    case Role::reducer:
      return "reducer";
    case Role::optimizer:
      return "optimizer";
    case Role::phase_hooks:
      return "phase hooks";
    case Role::precision:
      return "precision";
    case Role::checkpoint:
      return "checkpoint state";
    case Role::progress:
      return "progress hook";
    case Role::context:
      return "context";
    case Role::experts:
      return "experts";
    case Role::count_:
      break;
  }
  return "?";
}

namespace {
// The roles any number of strategies may add to (phase hooks, checkpoint state): no one provides them.
bool shared_role(Role r) { return r == Role::phase_hooks || r == Role::checkpoint; }

const char* claim_word(Claim c) {
  return c == Claim::provides ? "provides" : c == Claim::replaces ? "replaces" : "wraps";
}
}  // namespace

void check_role_claims(const std::vector<const StrategyInfo*>& strategies, const std::vector<std::string>& reasons) {
  auto in_run = [&](const std::string& name) -> int {
    for (std::size_t i = 0; i < strategies.size(); ++i)
      if (strategies[i]->name == name) return static_cast<int>(i);
    return -1;
  };
  auto claim_of = [&](const StrategyInfo& s, Role role) -> const RoleClaim* {
    for (const RoleClaim& c : s.claims)
      if (c.role == role) return &c;
    return nullptr;
  };
  auto who = [&](std::size_t i) { return "'" + strategies[i]->name + "' (" + reasons[i] + ")"; };
  for (int r = 0; r < kRoles; ++r) {
    const Role role = static_cast<Role>(r);
    if (shared_role(role)) continue;
    // The strategies that fill this role for the run: providers, minus those replaced.
    std::vector<std::size_t> fillers;
    for (std::size_t i = 0; i < strategies.size(); ++i) {
      const RoleClaim* c = claim_of(*strategies[i], role);
      if (!c) continue;
      if (c->claim == Claim::provides) {
        fillers.push_back(i);
        continue;
      }
      const int t = in_run(c->target);
      const RoleClaim* tc = t >= 0 ? claim_of(*strategies[static_cast<std::size_t>(t)], role) : nullptr;
      if (c->claim == Claim::wraps && role != Role::reducer)
        throw InputError("strategy " + who(i) + " declares that it wraps the " + role_name(role) + " of '" + c->target +
                         "', but only the reducer can be wrapped; declare that it replaces it instead");
      if (c->claim == Claim::wraps && c->target.empty()) continue;  // the run's reducer, if it has one
      if (t < 0)
        throw InputError("strategy " + who(i) + " " + claim_word(c->claim) + " the " + role_name(role) + " of '" +
                         c->target + "', which is not in this run");
      if (!tc)
        throw InputError("strategy " + who(i) + " " + claim_word(c->claim) + " the " + role_name(role) + " of '" +
                         c->target + "', which does not fill that role");
      if (c->claim == Claim::replaces) fillers.push_back(i);
    }
    // Drop the strategies another one replaces.
    std::vector<std::size_t> effective;
    for (std::size_t i : fillers) {
      bool replaced = false;
      for (std::size_t j : fillers) {
        const RoleClaim* c = claim_of(*strategies[j], role);
        if (j != i && c->claim == Claim::replaces && c->target == strategies[i]->name) replaced = true;
      }
      if (!replaced) effective.push_back(i);
    }
    if (effective.size() > 1)
      throw InputError("strategies " + who(effective[0]) + " and " + who(effective[1]) + " both fill the " +
                       role_name(role) +
                       " role, and neither declares that it replaces or wraps the other; a strategy "
                       "that takes a role over declares {" +
                       role_name(role) + ", replaces, \"" + strategies[effective[0]]->name + "\"} in its claims");
  }
}

bool fills_role(const std::vector<const StrategyInfo*>& run, const StrategyInfo& strategy, Role role) {
  if (shared_role(role)) return true;
  for (const StrategyInfo* other : run)
    for (const RoleClaim& c : other->claims)
      if (c.role == role && c.claim == Claim::replaces && c.target == strategy.name) return false;
  return true;
}

std::vector<Role> filled_roles(const Roles& roles) {
  std::vector<Role> r;
  if (roles.schedule) r.push_back(Role::schedule);
  if (roles.grad_sync) r.push_back(Role::grad_sync);
  if (roles.reducer || roles.wrap_reducer) r.push_back(Role::reducer);
  if (roles.optimizer) r.push_back(Role::optimizer);
  if (!roles.hooks.empty()) r.push_back(Role::phase_hooks);
  if (!roles.checkpoint_parts.empty()) r.push_back(Role::checkpoint);
  if (roles.progress) r.push_back(Role::progress);
  return r;
}

void check_filled_roles(const StrategyInfo& strategy, const std::vector<Role>& filled) {
  for (Role role : filled) {
    bool declared = false;
    for (const RoleClaim& c : strategy.claims) declared = declared || c.role == role;
    if (!declared)
      throw InputError("strategy '" + strategy.name + "' (" + strategy.origin + ") fills the " + role_name(role) +
                       " role without declaring it; add {" + role_name(role) +
                       ", provides | replaces | wraps, ...} to its StrategyInfo::claims");
  }
}

void check_filled_roles(const StrategyInfo& strategy, const Roles& roles) {
  check_filled_roles(strategy, filled_roles(roles));
  const RoleClaim* claim = nullptr;
  for (const RoleClaim& c : strategy.claims)
    if (c.role == Role::reducer) claim = &c;
  if (!claim) return;  // (a reducer filled without a claim was refused above)
  const std::string who = "strategy '" + strategy.name + "' (" + strategy.origin + ")";
  if (roles.reducer && claim->claim == Claim::wraps)
    throw InputError(who + " declares that it wraps the reducer of '" + claim->target +
                     "' but sets Roles::reducer, "
                     "which would replace it; a wrapper sets Roles::wrap_reducer");
  if (roles.wrap_reducer && claim->claim != Claim::wraps)
    throw InputError(who + " sets Roles::wrap_reducer but declares that it " +
                     (claim->claim == Claim::provides ? std::string("provides") : "replaces") +
                     " the reducer; a wrapper declares {reducer, wraps, \"<strategy it wraps>\"}");
}

}  // namespace loom
