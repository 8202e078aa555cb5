#pragma once
// A training session built from a resolved deck: back end, model, data, engine. `loom run` and
// `loom export` both drive one.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "core/backend/backend.hpp"
#include "core/backend/backend_select.hpp"
#include "core/engine/checkpoint_part.hpp"
#include "core/engine/engine.hpp"
#include "core/backend/gemm.hpp"
#include "core/model/gpt.hpp"
#include "core/comm/grid.hpp"
#include "core/engine/plugin.hpp"
#include "core/comm/step_plan.hpp"
#include "io/data.hpp"
#include "io/deck.hpp"
#include "io/threads.hpp"

namespace loom {

// What a deck asks of the layout, checked without communicating: the model, the layout (against a
// job of `world` ranks; -1: as many as the layout needs), the batch split, and the strategies it
// needs, each of which has checked the layout. Throws InputError naming keys and what would work.
struct LayoutPlan {
  GPTConfig model;
  Layout layout;
  int global_batch = 0, micro_batches = 1, rows_per_rank = 0, rows_per_micro = 0;
  std::vector<const StrategyInfo*> strategies;
  RunTraits traits;  // what the strategies said (StrategyInfo::traits)
};
LayoutPlan plan_layout(const Deck& deck, const StrategyRegistry& registry, int world);

// The datasets a run of the deck trains and validates on, opened (and so checked) as the run opens
// them: data.source, and data.val_source when given (else `val` is null). Throws InputError naming
// the key and the file.
// The tokenizer (data.tokenizer, else the manifest of the validation shards or data.source's) is
// loaded and model.vocab checked against it; `token_bytes` gives each id's bytes of text (bits per
// byte), empty when unknown (synthetic data, shards without a tokenizer).
struct DeckData {
  std::unique_ptr<Dataset> train, val;
  std::string tokenizer;
  std::vector<int> token_bytes;
};
DeckData open_deck_data(const Deck& deck, const GPTConfig& model);

// run.gemm as an implementation of the matrix products (core/backend/gemm.hpp); throws InputError naming
// the key when this build lacks it (onednn without oneDNN).
gemm::Impl gemm_impl_from_deck(const Deck& deck);

// The roles decided before the model (its precision, tp split, layers, store), by the strategies
// whose claims settled each (check_role_claims). Sets the precision on `backend`.
struct PreModelRoles {
  std::unique_ptr<Partition> partition;   // null: whole weights (the core's default)
  std::unique_ptr<ContextSplit> context;  // null: whole sequences (the core's default)
  std::unique_ptr<ExpertSplit> experts;   // null: every expert on every rank (the core's default)
  Stage stage;
  std::unique_ptr<ParamStore> store;  // null: the model's own flat store
};
PreModelRoles make_pre_model_roles(const Deck& deck, const std::vector<const StrategyInfo*>& strategies,
                                   ProcessGrid& grid, Backend& backend, const GPTConfig& model);
// The other roles, once the model exists: each strategy's `create`, installed by the claims, the
// reducer chain composed (the wrappers of the run's reducer innermost, such as the precision
// strategy's cast, then those of a named strategy's) and handed to the gradient sync.
// `agree`: check the filled roles with the other ranks (run_agreed); false for one process alone
// (`loom plan`).
struct AssembledRoles {
  EngineRoles engine;
  std::unique_ptr<Reducer> reducer;
  std::vector<CheckpointContributor*> checkpoint_parts;
  std::vector<std::shared_ptr<CheckpointContributor>> kept_parts;
};
AssembledRoles assemble_roles(const Deck& deck, const std::vector<const StrategyInfo*>& strategies, ProcessGrid& grid,
                              GPT& model, Backend& backend, const EngineConfig& engine, bool agree);
// What a step of these roles takes beyond what they hold once built (scratch per category, the
// communicators' ring-scratch pools, messages, the pipeline's replay): every role's plan_step, pools
// closed. `loom plan` prices it; a run reserves the pools it lists before its first step.
StepPlan plan_rank_step(const EngineConfig& engine_cfg, GPT& model, Engine& engine, Reducer* reducer);
// Each group's communicator of `grid` reserves its pool of `plan` (Communicator::reserve_scratch).
void reserve_comm_scratch(ProcessGrid& grid, const StepPlan& plan);

// Keys that are valid alone but not together (train.lr_min above train.lr, a rollback without
// checkpoints): InputError naming them. `loom run` and `loom check` alike.
void check_training_keys(const Deck& deck);

struct Session {
  // Validates the layout and opens the data; throws InputError naming deck keys or files.
  Session(const Deck& deck, const StrategyRegistry& registry);
  double measure_val_bytes(const std::vector<int>& token_bytes) const;

  const Deck& deck;
  GPTConfig model_cfg;
  EngineConfig engine_cfg;
  std::int64_t steps = 0, eval_every = 0, log_every = 1;
  int global_batch = 0, eval_batches = 0;
  std::uint64_t seed = 0;
  std::string run_dir;
  std::string init_from;  // model.init_from: an llm.c model file to start from (empty: random initialisation)
  ThreadCount threads;    // run.threads resolved, with where the count came from

  Layout layout;
  std::unique_ptr<ProcessGrid> grid;
  std::vector<const StrategyInfo*> strategies;
  const StrategyRegistry& registry;
  int rows_per_rank = 0;  // this dp rank's share of the global batch
  std::unique_ptr<Backend> backend;
  BackendChoice backend_choice;  // run.backend: what was asked for, what this rank got, its device
  std::unique_ptr<Dataset> train_data;
  std::unique_ptr<Dataset> val_owned;  // data.val_source, when given
  const Dataset* val_data = nullptr;   // null when there is no validation split
  std::string tokenizer;               // the data's SentencePiece model, when known (DeckData)
  // Validation tokens per byte of text they stand for, over exactly the samples evaluate() reads
  // (0: unknown): bits per byte = loss * this / ln 2.
  double val_tokens_per_byte = 0;
  Split val_split = Split::val;           // which split of val_data holds the validation tokens
  std::unique_ptr<Partition> partition;   // null: whole weights (the core's default)
  std::unique_ptr<ContextSplit> context;  // null: whole sequences (the core's default)
  std::unique_ptr<ExpertSplit> experts;   // null: every expert on every rank (the core's default)
  std::unique_ptr<ParamStore> store;      // null: the model's own flat store
  std::unique_ptr<GPT> model;
  std::unique_ptr<Reducer> reducer;  // the composed gradient reducer (wrappers outermost), if any
  std::unique_ptr<Engine> engine;
  // Every role object of the run that contributes to checkpoints (the optimizer's state and the
  // model's parameters are written by the checkpoint itself).
  std::vector<CheckpointContributor*> checkpoint_parts;
  std::vector<std::shared_ptr<CheckpointContributor>> kept_parts;  // those Roles::checkpoint_parts handed over
  BatchFn train_batches, val_batches;
  // Training step s draws global batch s + data_offset: a rollback after a loss spike skips batches
  // (train.on_spike), and checkpoints keep the offset (their data_next_step).
  std::int64_t data_offset = 0;
  // Collective: a digest of the global batch the training consumed since the last call, "0x" and 13 hex
  // digits: each row's index in the global batch and its tokens, each row counted once, the same on
  // every layout (the data order does not depend on it). Rows are counted as the loader hands them out.
  std::string batch_digest();
  // Forgets the rows counted since the last digest (a step that logs none).
  void forget_rows() { step_rows_.clear(); }

  std::string data_source;  // data.source, for messages

  void setup_local();
  void setup_collective();
  void set_batch_functions();  // train_batches, val_batches: this rank's rows, and its tokens of them
  // model.attention = auto, resolved by every rank for its device, then agreed (the lowest kind any
  // rank can run: unfused < flash < cudnn), into model_cfg; attention_why says why, for the banner.
  void resolve_attention();
  std::string attention_why;
  // The deck a checkpoint records: the resolved deck, with model.attention as the run resolved it.
  std::string recorded_deck() const;
  // A cuda run without run.memory_limit, once every rank opened its device (collective).
  void check_device_memory();

 private:
  std::map<std::int64_t, std::uint64_t> step_rows_;  // global row -> hash of its tokens
  bool counts_rows_ = false;                         // tp rank 0 of the first pipeline stage

 public:
  // Lines for the start-up banner: modules, model, data, layout.
  std::string banner() const;
};

// The ranks agree whether something failed (a collective: every rank must call it). If any rank
// failed, the error is reported once when all failed alike, otherwise by each failing rank, and
// every rank throws ReportedError (exit status 2), so nobody is left waiting in a collective.
void agree_on_error(const std::string& local_error);
// Runs `fn` (which must not communicate before it could throw), then agrees as above.
void run_agreed(const std::function<void()>& fn);

}  // namespace loom
