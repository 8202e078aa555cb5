#pragma once
// Strategy plugins (DESIGN.md "Declared composition", LAMMPS-style).
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

#include "core/engine/checkpoint_part.hpp"
#include "core/engine/engine.hpp"
#include "core/comm/grid.hpp"
#include "core/model/param_store.hpp"
#include "core/model/partition.hpp"
#include "core/engine/reducer.hpp"
#include "core/base/search_path.hpp"  // plugin_search_path
#include "core/engine/keys.hpp"       // KeySpec: a plugin declares its deck keys like the core does
#include "core/engine/plan_terms.hpp"

// Bump when anything a plugin sees changes: this struct, StrategyInfo, StrategyContext, Roles, the
// role interfaces (core/engine/engine.hpp, partition.hpp, param_store.hpp, optimizer.hpp, reducer.hpp,
// checkpoint_part.hpp), or the back end's face (core/backend/backend_face.hpp, LOOM_FACE_OPS). An
// operation added to the whole back end (LOOM_BACKEND_OPS) is not a change of the face: a plugin
// built before it keeps loading (regression/abi_old_plugin.sh shows it). ABI 4: declared role claims, the parameter
// store, step phases, the reducer. ABI 5: the precision role, the `begin` phase, StepState::loss_scale. ABI 6: the
// roles' plan_step
// (`loom plan`, core/comm/step_plan.hpp) and Backend::plan_matmuls. ABI 7: CommCost::in_step. ABI 8:
// StepPlan::stage_units, pipeline_span and host_copy_bytes. ABI 9: Communicator::reserve_scratch,
// StepPlan::pools. ABI 10: Backend's fused attention (attention_forward_flash, _backward_flash,
// flash_attention_refusal), GPTConfig::flash_attention. ABI 11: Backend::int8_absmax, _quantize,
// _dequantize, axpy; StepPlan::backend_bytes. ABI 12: Backend::topk_select, _scatter_add, _clear;
// GradBucket::Tensor::begin. ABI 13: Backend::plan_workspace (plan_matmuls with the attention's shape),
// ring_scratch_pools, topk_scratch_bytes; StepPlan::price_pools. ABI 14: the core in layer folders
// (core/engine/plugin.hpp), deck keys in core/engine/keys.hpp (files read by io's load_deck), agree_on_failure over a
// communicator, check_layout in core/model, BucketedGradSync without a step counter; Backend's
// operations from one list (core/backend/backend_ops.hpp), reordered in its vtable; the roles'
// summary_lines and Schedule::step_line. ABI 15: the plugin face: strategies see the back end as
// BackendFace (allocation, host copies, LOOM_FACE_OPS), first in Backend's vtable. ABI 16:
// KeySpec::former_names, GradSync::state_sharding; the checkpoint and progress roles; RunTraits.
// ABI 17: StrategyInfo::plan (core/engine/plan_terms.hpp), what a strategy adds to `loom plan`;
// ParamInfo's shape, local_shape, split and numel read from its ShardDesc (accessors, not fields).
// ABI 18: every tensor of LOOM_FACE_OPS a typed BufferRef (no bare pointers; sum_squares and the float
// overloads of scale and fill gone); Partition's operators on BufferRefs. ABI 19: the fused classifier
// (LOOM_FACE_OPS crossentropy_fused and crossentropy_finish_grad, Partition::crossentropy_fused).
// ABI 20: GPTConfig's architecture (model.arch = llama and its keys), GPT's Llama handles.
// ABI 21: the context axis (Layout::cp, ProcessGrid::cp, the dp communicator over dp x cp), the context
// role (ContextSplit, StrategyInfo::make_context), ring attention in LOOM_FACE_OPS.
// ABI 22: mixture of experts: GPTConfig's experts, moe_every, experts_per_token, expert_capacity and the
// auxiliary losses' weights; GPT's routing state; Partition::sum_over_group.
// ABI 23: RunTraits::first_moment_off_by and OptimizerConfig::first_moment_off_by (top-k compression's
// momentum masking turns AdamW's first moment off); RunTraits::loss_scaled_by.
#define LOOM_PLUGIN_ABI_VERSION 23

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
  BackendFace& backend;
  const EngineConfig& engine;
};

// The roles of a run. Every one a strategy fills it must declare (StrategyInfo::claims).
enum class Role : int {
  partition = 0,  // StrategyInfo::make_partition: the tp split of every weight, the activation collectives
  stage,          // StrategyInfo::assign_stage: which layers this rank's pipeline stage holds
  store,          // StrategyInfo::make_store: where parameters, gradients (and master weights) live
  schedule,       // Roles::schedule: the order of micro-batch forwards and backwards
  grad_sync,      // Roles::grad_sync: what happens to gradients during and after backward
  reducer,        // Roles::reducer (provides) or Roles::wrap_reducer (wraps): the gradient collective
  optimizer,      // Roles::optimizer: the update of the owned slices
  phase_hooks,    // Roles::hooks: work in a phase of the step (unscale, refresh, ...); any number may add
  precision,      // StrategyInfo::make_precision: the element type of the matrix products' operands
  checkpoint,     // Roles::checkpoint_parts: state kept outside the role objects, saved with checkpoints; any number
  progress,       // Roles::progress: what the model calls between kernels so that messages in flight advance
  context,        // StrategyInfo::make_context: which tokens of each sequence a rank holds, its ring attention
  experts,        // StrategyInfo::make_experts: which experts a rank holds, how tokens reach them
  count_
};
inline constexpr int kRoles = static_cast<int>(Role::count_);
const char* role_name(Role r);  // "gradient sync", ...

// How a strategy fills a role: it provides it (no other strategy of the run may), it replaces the
// named strategy's (which must be in the run and provide it), or it wraps the named strategy's
// (only the reducer can be wrapped). A second filler that declared neither is refused before any
// work, naming both. A wrap with no target wraps the run's reducer whichever strategy provides it,
// right around the collective (inside the wrappers of a named strategy's), and is not used in a run
// that has none (the precision strategy's cast of the gradient collective).
enum class Claim { provides, replaces, wraps };
struct RoleClaim {
  Role role;
  Claim claim = Claim::provides;
  std::string target;  // the strategy replaced or wrapped (a wrap: empty for the run's reducer)
};

// The roles a strategy fills once the model exists; null members keep the core's default (or another
// strategy's).
struct Roles {
  std::unique_ptr<GradSync> grad_sync;
  std::unique_ptr<Schedule> schedule;
  std::unique_ptr<Reducer> reducer;
  ReducerWrapper wrap_reducer;
  std::unique_ptr<Optimizer> optimizer;
  std::vector<PhaseHook> hooks;
  // State the strategy keeps outside its role objects (e.g. a loss scaler its hooks share), saved
  // and restored with checkpoints. Role objects that implement CheckpointContributor are found
  // without being listed here.
  std::vector<std::shared_ptr<CheckpointContributor>> checkpoint_parts;
  // Called by the model between its layers' kernels (GPT::set_progress_hook), so that the strategy's
  // messages in flight advance while it computes (a pipeline's sends and receives).
  std::function<void()> progress;
};

// What the strategies of a run tell each other about it (StrategyInfo::traits), so that one checks
// what another's settings do through these fields, never by reading its keys. Each names the
// setting that does it, for messages ("zero.stage = 2"); empty when no strategy of the run does.
struct RunTraits {
  std::string grads_scattered_by;     // gradients reduce-scattered in pieces every micro-batch (ZeRO-2 and -3)
  std::string dynamic_loss_scale_by;  // a loss scale that moves during the run (fp16's dynamic scaling)
  std::string reduce_dtype_by;        // the gradient collective in a type narrower than fp32
  std::string first_moment_off_by;    // AdamW runs without its first moment (beta1 = 0): the setting that asks
  std::string loss_scaled_by;         // gradients reach the reducer multiplied by a loss scale (fp16)
};

// What a strategy may check before any work (every rank alike, no communication).
struct LayoutContext {
  const Deck& deck;
  const Layout& layout;
  const GPTConfig& model;
  int rows_per_micro;       // sequences per micro-batch on one rank
  const RunTraits& traits;  // what the run's strategies said (all of them, this one included)
};

// What the partition, stage and store factories see: the model is not built yet (they decide its
// shards, its layers and where its tensors live).
struct PartitionContext {
  const Deck& deck;
  ProcessGrid& grid;
  BackendFace& backend;
  const GPTConfig& model;
};

struct StrategyInfo {
  std::string name, version, description, origin;  // origin: "built-in" or the library path
  std::vector<KeySpec> keys;                       // the deck keys it declares
  std::vector<std::string> incompatible;           // strategies it cannot be combined with
  std::vector<RoleClaim> claims;                   // the roles it fills, and how
  // Optional: whether a deck asks for this strategy by its own keys, without run.plugins: the setting
  // that does ("zero.stage = 1"), or empty. May throw InputError for a setting that cannot work.
  std::function<std::string(const Deck&, const Layout&)> requested_by;
  // Optional: what this strategy's settings do that others may need to know (RunTraits), from the
  // deck; asked of every strategy of the run before any `check`.
  std::function<void(const Deck&, RunTraits&)> traits;
  // Optional: refuse a layout this strategy cannot run (throw InputError naming keys and what works).
  std::function<void(const LayoutContext&)> check;
  // Optional: the partition role (at most one strategy of a run fills it).
  std::function<std::unique_ptr<Partition>(PartitionContext&)> make_partition;
  // Optional: the layer half of the partition role: which layers this rank's pipeline stage holds
  // and how many micro-batches' activations it keeps (at most one strategy fills it).
  std::function<Stage(PartitionContext&)> assign_stage;
  // Optional: the parameter store, created before the model (at most one strategy fills it).
  std::function<std::unique_ptr<ParamStore>(PartitionContext&)> make_store;
  // Optional: the precision of the run's compute, set on the back end before the model is built (at
  // most one strategy fills it).
  std::function<Precision(PartitionContext&)> make_precision;
  // Optional: the context role (core/model/context.hpp), created before the model (at most one
  // strategy fills it): the split of each sequence over parallel.cp ranks and its attention.
  std::function<std::unique_ptr<ContextSplit>(PartitionContext&)> make_context;
  // Optional: the experts role (core/model/experts.hpp), created before the model (at most one strategy
  // fills it): the split of the experts over parallel.ep ranks and the exchange of tokens.
  std::function<std::unique_ptr<ExpertSplit>(PartitionContext&)> make_experts;
  // The other roles, once the model exists.
  std::function<void(StrategyContext&, Roles&)> create;
  // Optional: what it adds to `loom plan`'s layout search and memo (its keys worth searching, its
  // sentences and levers); the planner names no strategy.
  PlanTerms plan;
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

// dlopens every libloom_<name>.so in `dirs` (the first found of each name wins), looks up the one
// entry point and registers what it returns. Unusable libraries are recorded, not fatal: they
// become an error only when a deck asks for them.
void discover_plugins(StrategyRegistry& registry, const std::vector<std::string>& dirs);

// The strategy each axis of the layout needs where it has more than one rank, with the setting that
// asks for it: dp the data-parallel strategy, tp the tensor one, pp the pipeline one. The core names
// them, so that the driver knows no strategy.
std::vector<std::pair<std::string, std::string>> layout_strategies(const Layout& layout);

// The strategies a run needs: each requested name with the reason it is needed (e.g. "parallel.dp
// = 2"). Throws InputError naming the reason for: a name not found (listing those that are), an
// unusable library (why), a pair that one of them declares incompatible, and role claims that do
// not compose (check_role_claims).
std::vector<const StrategyInfo*> resolve_strategies(const StrategyRegistry& registry,
                                                    const std::vector<std::pair<std::string, std::string>>& requested);

// Refuses (InputError naming both strategies and the role) a role filled by two strategies where
// neither declared that it replaces or wraps the other, a replace or wrap of a strategy that is not
// in the run or does not fill that role, and a wrap of a role that cannot be wrapped. `reasons[i]`
// says why strategies[i] is in the run.
void check_role_claims(const std::vector<const StrategyInfo*>& strategies, const std::vector<std::string>& reasons);

// Refuses (InputError) a strategy whose factories filled a role it did not declare: after
// StrategyInfo::create, `filled` lists the roles its Roles came back with.
void check_filled_roles(const StrategyInfo& strategy, const std::vector<Role>& filled);
// The same, and a reducer filled as its claim does not say: Roles::reducer from a strategy that
// declared it wraps the reducer (it would replace it), or Roles::wrap_reducer from one that declared
// it provides or replaces it.
void check_filled_roles(const StrategyInfo& strategy, const Roles& roles);
// The roles a Roles holds.
std::vector<Role> filled_roles(const Roles& roles);
// Whether `strategy`'s object for `role` is the one the run uses: it provides or replaces the role
// and no strategy of the run replaces it (a replaced strategy's objects are dropped). Wrappers and
// phase hooks are always used.
bool fills_role(const std::vector<const StrategyInfo*>& run, const StrategyInfo& strategy, Role role);

}  // namespace loom
