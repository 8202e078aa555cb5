#pragma once
// Strategy plugins (DESIGN.md "The training step and the strategy roles", LAMMPS-style).
//
// A plugin is a shared library libloom_<name>.so exporting ONE C entry point,
//     extern "C" const loom_plugin_v1* loom_plugin_entry(void);
// that returns a small versioned C struct. Everything else travels through that struct: the ABI
// version, the name and version, and a `register_strategy` function that fills a StrategyInfo (its
// deck keys, the strategies it cannot be combined with, and the factory of its roles). Built-in
// strategies describe themselves with the very same struct and register into the same map.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/engine.hpp"
#include "core/grid.hpp"
#include "core/partition.hpp"
#include "io/deck.hpp"  // KeySpec: a plugin declares its deck keys like the core does

// Bump when anything a plugin sees changes: this struct, StrategyInfo, StrategyContext, Roles, or
// the role interfaces in core/engine.hpp.
#define LOOM_PLUGIN_ABI_VERSION 3

extern "C" {
struct loom_plugin_v1 {
  std::uint32_t abi_version;  // LOOM_PLUGIN_ABI_VERSION of the loom it was built against
  const char* name;           // "data": the strategy's name (and its library libloom_data.so)
  const char* version;        // the plugin's own version, logged at load
  const char* description;    // one line
  // Fills the StrategyInfo that `info` points to (a loom::StrategyInfo*).
  void (*register_strategy)(void* info);
};
typedef const loom_plugin_v1* (*loom_plugin_entry_fn)(void);
}
#define LOOM_PLUGIN_ENTRY_SYMBOL "loom_plugin_entry"

namespace loom {

class ProcessGrid;

// What a strategy's factory sees when the run is set up.
struct StrategyContext {
  const Deck& deck;
  ProcessGrid& grid;
  GPT& model;
  Backend& backend;
  const EngineConfig& engine;
};

// The roles a strategy fills; null members keep the core's default (or another strategy's).
struct Roles {
  std::unique_ptr<GradSync> grad_sync;
  std::unique_ptr<Schedule> schedule;
};

// What a strategy may check before any work (every rank alike, no communication).
struct LayoutContext {
  const Deck& deck;
  const Layout& layout;
  const GPTConfig& model;
  int rows_per_micro;  // sequences per micro-batch on one rank
};

// What the partition factory sees: the model is not built yet (the partition decides its shards).
struct PartitionContext {
  const Deck& deck;
  ProcessGrid& grid;
  Backend& backend;
  const GPTConfig& model;
};

struct StrategyInfo {
  std::string name, version, description, origin;  // origin: "built-in" or the library path
  std::vector<KeySpec> keys;                        // the deck keys it declares
  std::vector<std::string> incompatible;            // strategies it cannot be combined with
  // Optional: refuse a layout this strategy cannot run (throw InputError naming keys and what works).
  std::function<void(const LayoutContext&)> check;
  // Optional: the partition role (at most one strategy of a run fills it).
  std::function<std::unique_ptr<Partition>(PartitionContext&)> make_partition;
  // Optional: the layer half of the partition role: which layers this rank's pipeline stage holds
  // and how many micro-batches' activations it keeps (at most one strategy fills it).
  std::function<Stage(PartitionContext&)> assign_stage;
  // The other roles, once the model exists.
  std::function<void(StrategyContext&, Roles&)> create;
};

// The creator map: built-ins and loaded plugins alike.
class StrategyRegistry {
 public:
  // Registers what a plugin struct describes; throws InputError on an ABI mismatch or a name
  // registered twice. `origin` names where it came from.
  void add(const loom_plugin_v1& plugin, const std::string& origin);
  const StrategyInfo* find(const std::string& name) const;
  std::vector<std::string> names() const;
  const std::map<std::string, StrategyInfo>& all() const { return strategies_; }
  // Libraries that were found but cannot be used (ABI mismatch, no entry point): name -> why.
  std::map<std::string, std::string> unusable;
  // One line per plugin library examined, for the start-up log.
  std::vector<std::string> log;

 private:
  std::map<std::string, StrategyInfo> strategies_;
};

// The built-in strategies (the core's single-process defaults).
void register_builtin_strategies(StrategyRegistry& registry);

// Directories searched for libloom_<name>.so, in order: every entry of LOOM_PLUGIN_PATH
// (colon-separated), the build tree's lib/ and the install prefix's lib/loom/ (both found relative
// to the running executable).
std::vector<std::string> plugin_search_path();

// dlopens every libloom_<name>.so in `dirs` (the first found of each name wins), looks up the one
// entry point and registers what it returns. Unusable libraries are recorded, not fatal: they
// become an error only when a deck asks for them.
void discover_plugins(StrategyRegistry& registry, const std::vector<std::string>& dirs);

// The strategies a run needs: each requested name with the reason it is needed (e.g. "parallel.dp
// = 2"). Throws InputError naming the reason for: a name not found (listing those that are), an
// unusable library (why), and a pair that one of them declares incompatible.
std::vector<const StrategyInfo*> resolve_strategies(const StrategyRegistry& registry,
                                                    const std::vector<std::pair<std::string, std::string>>& requested);

}  // namespace loom
