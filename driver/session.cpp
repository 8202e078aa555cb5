#include "driver/session.hpp"

#include <filesystem>
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <stdexcept>

#include "core/base/error.hpp"
#include "core/comm/fault.hpp"
#include "core/model/layout_check.hpp"
#include "core/backend/blas_core.hpp"
#include "core/backend/wait_policy.hpp"
#include "driver/memory_check.hpp"
#include "io/data.hpp"
#include "io/llmc.hpp"
#include "io/tokenizer.hpp"
#include "io/report.hpp"
#include "io/threads.hpp"
#include "loom/build_info.hpp"

namespace loom {

Session::Session(const Deck& d, const StrategyRegistry& reg) : deck(d), registry(reg) {
  // Phase 1 checks everything on every rank without communicating; then the ranks agree, so that a
  // rank that alone cannot read its data never leaves the others waiting in a collective.
  const std::vector<int> on_node = ranks_on_this_node();
  run_agreed([this, &on_node] {
    setup_local();
    throw_if_out_of_memory(deck, registry, memory_verdict(deck, registry, on_node));  // before the first allocation
  });
  setup_collective();
}

void agree_on_error(const std::string& local_error) {
  int rank = 0, world = 1, failed = local_error.empty() ? 0 : 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  int failures = failed;
  MPI_Allreduce(MPI_IN_PLACE, &failures, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (failures == 0) return;
  if (failures == world) {  // the same deck fails alike everywhere: say it once
    if (rank == 0) write_stderr("loom: error: " + local_error + "\n");
  } else if (failed) {
    write_stderr(rank_error_text(rank, local_error));
  }
  throw ReportedError(local_error.empty() ? "failed on another rank" : local_error);
}

void run_agreed(const std::function<void()>& fn) {
  std::string local_error;
  try {
    fn();
  } catch (const InputError& e) {
    local_error = e.what();
  }
  agree_on_error(local_error);
}

LayoutPlan plan_layout(const Deck& d, const StrategyRegistry& registry, int world) {
  LayoutPlan plan;
  GPTConfig& m = plan.model;
  m.layers = static_cast<int>(d.get_int("model.layers"));
  m.d_model = static_cast<int>(d.get_int("model.d_model"));
  m.heads = static_cast<int>(d.get_int("model.heads"));
  m.seq_len = static_cast<int>(d.get_int("model.seq_len"));
  m.vocab = static_cast<int>(d.get_int("model.vocab"));
  m.recompute = d.get_bool("model.recompute");
  m.set_attention(d.get_string("model.attention"));  // auto: resolved once the back end is made
  m.read_architecture(d.values());
  m.moe_aux_loss = d.get_float("train.moe_aux_loss");
  m.moe_z_loss = d.get_float("train.moe_z_loss");
  m.validate();

  plan.global_batch = static_cast<int>(d.get_int("train.batch"));
  plan.micro_batches = static_cast<int>(d.get_int("train.micro_batches"));
  plan.layout.dp = static_cast<int>(d.get_int("parallel.dp"));
  plan.layout.tp = static_cast<int>(d.get_int("parallel.tp"));
  plan.layout.pp = static_cast<int>(d.get_int("parallel.pp"));
  plan.layout.cp = static_cast<int>(d.get_int("parallel.cp"));
  plan.layout.ep = static_cast<int>(d.get_int("parallel.ep"));
  check_layout(plan.layout, world < 0 ? plan.layout.ranks() : world, m, plan.global_batch, plan.micro_batches);
  plan.rows_per_rank = plan.global_batch / plan.layout.dp;
  plan.rows_per_micro = plan.rows_per_rank / plan.micro_batches;

  // The strategies this run needs, each with the deck setting that asks for it.
  const Layout& l = plan.layout;
  std::vector<std::pair<std::string, std::string>> wanted = layout_strategies(l);
  {
    std::stringstream list(d.get_string("run.plugins"));
    std::string name;
    while (std::getline(list, name, ',')) {
      name.erase(0, name.find_first_not_of(" \t"));
      name.erase(name.find_last_not_of(" \t") + 1);
      if (!name.empty()) wanted.push_back({name, "run.plugins = " + escape_value(d.get_string("run.plugins"))});
    }
  }
  // Strategies a deck asks for by their own keys (zero.stage > 0 asks for zero).
  for (const auto& [name, info] : registry.all())
    if (info.requested_by) {
      const std::string reason = info.requested_by(d, l);
      if (!reason.empty()) wanted.push_back({name, reason});
    }
  if (wanted.empty()) wanted.push_back({"local", "one replica"});
  plan.strategies = resolve_strategies(registry, wanted);
  for (const StrategyInfo* strategy : plan.strategies)
    if (strategy->traits) strategy->traits(d, plan.traits);
  for (const StrategyInfo* strategy : plan.strategies)
    if (strategy->check) strategy->check(LayoutContext{d, l, m, plan.rows_per_micro, plan.traits});
  return plan;
}

gemm::Impl gemm_impl_from_deck(const Deck& d) {
  const std::string value = d.get_string("run.gemm");
  try {
    const gemm::Impl impl = gemm::parse_impl(value);
    if (impl == gemm::Impl::onednn && !gemm::have_onednn())
      throw std::invalid_argument("this loom was built without oneDNN (LOOM_ONEDNN=OFF); use auto or blas");
    return impl;
  } catch (const std::invalid_argument& e) {
    throw InputError("run.gemm = " + escape_value(value) + ": " + e.what());
  }
}

namespace {
void open_tokenizer(const Deck& d, const GPTConfig& model, DeckData& data) {
  const std::string key = d.get_string("data.tokenizer");
  const std::string val_source = d.get_string("data.val_source"), source = d.get_string("data.source");
  std::string path = key, what = "data.tokenizer " + quote_path(key);
  if (path.empty()) path = manifest_tokenizer(val_source.empty() ? source : val_source);
  if (path.empty() && !val_source.empty()) path = manifest_tokenizer(source);
  if (key.empty() && !path.empty()) what = "the tokenizer " + quote_path(path) + " its manifest.json names";
  const std::string& validated = val_source.empty() ? source : val_source;
  if (!key.empty() && validated.rfind("tokens:", 0) != 0)
    throw InputError("data.tokenizer = " + quote_path(key) +
                     " names the tokenizer of tokens: shards, but the data is " + quote_value(validated) + " (" +
                     (val_source.empty() ? "data.source" : "data.val_source") +
                     "); leave data.tokenizer empty, or train on tokens:GLOB (loom data prepare writes them)");
  if (!path.empty()) {
    const auto tok = Tokenizer::load(path, key.empty() ? "the manifest's tokenizer" : "data.tokenizer");
    check_vocab(model.vocab, tok->vocab(), what);
    data.tokenizer = path;
    data.token_bytes = tok->token_bytes();
    data.token_bytes.resize(static_cast<std::size_t>(model.vocab), 0);  // padded ids stand for no text
    return;
  }
  // Bytes as tokens (text:PATH): every id a byte.
  if ((val_source.empty() ? source : val_source).rfind("text:", 0) == 0)
    data.token_bytes.assign(static_cast<std::size_t>(model.vocab), 1);
}
}  // namespace

DeckData open_deck_data(const Deck& d, const GPTConfig& model) {
  DataConfig dc;
  dc.source = d.get_string("data.source");
  dc.vocab = model.vocab;
  dc.seq_len = model.seq_len;
  dc.seed = static_cast<std::uint64_t>(d.get_int("train.seed"));
  dc.val_fraction = d.get_float("data.val_fraction");
  dc.synthetic_noise = d.get_float("data.synthetic_noise");
  const std::string val_source = d.get_string("data.val_source");
  if (!val_source.empty()) dc.val_fraction = 0.0;  // all of data.source trains
  DeckData data;
  data.train = open_dataset(dc);
  if (!val_source.empty()) {
    DataConfig vc = dc;
    vc.key = "data.val_source";
    vc.source = val_source;
    vc.seed = dc.seed ^ 0x5eed5eedULL;
    data.val = open_dataset(vc);
  }
  open_tokenizer(d, model, data);
  return data;
}

void Session::setup_local() {
  const Deck& d = deck;
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  LayoutPlan plan = plan_layout(d, registry, world);
  model_cfg = plan.model;
  layout = plan.layout;
  global_batch = plan.global_batch;
  rows_per_rank = plan.rows_per_rank;
  engine_cfg.micro_batches = plan.micro_batches;
  engine_cfg.rows_per_micro = plan.rows_per_micro;
  strategies = std::move(plan.strategies);
  steps = d.get_int("train.steps");
  auto& o = engine_cfg.optimizer;
  o.lr = d.get_float("train.lr");
  o.lr_min = d.get_float("train.lr_min");
  o.schedule = d.get_string("train.schedule");
  o.warmup = d.get_int("train.warmup");
  o.steps = steps;
  o.weight_decay = d.get_float("train.weight_decay");
  o.beta1 = d.get_float("train.beta1");
  if (!plan.traits.first_moment_off_by.empty()) {  // a strategy applies the momentum itself, or masks it
    o.beta1 = 0;
    o.first_moment_off_by = plan.traits.first_moment_off_by;
  }
  o.beta2 = d.get_float("train.beta2");
  o.eps = d.get_float("train.eps");
  o.grad_clip = d.get_float("train.grad_clip");
  check_training_keys(d);
  seed = static_cast<std::uint64_t>(d.get_int("train.seed"));
  eval_every = d.get_int("train.eval_every");
  eval_batches = static_cast<int>(d.get_int("train.eval_batches"));
  log_every = d.get_int("train.log_every");
  run_dir = d.get_string("run.dir");
  init_from = d.get_string("model.init_from");
  threads =
      resolve_threads(d.get_string("run.threads"), std::getenv("OMP_NUM_THREADS"), std::getenv("SLURM_CPUS_PER_TASK"));
  gemm::set_impl(gemm_impl_from_deck(d));

  data_source = d.get_string("data.source");
  DeckData data = open_deck_data(d, model_cfg);
  tokenizer = data.tokenizer;
  train_data = std::move(data.train);
  val_owned = std::move(data.val);
  if (val_owned) {
    val_data = val_owned.get();
    val_split = Split::train;
  } else if (d.get_float("data.val_fraction") > 0.0) {
    val_data = train_data.get();
    val_split = Split::val;
  }
  if (val_data && !data.token_bytes.empty()) val_tokens_per_byte = measure_val_bytes(data.token_bytes);
}

// The targets of evaluate()'s samples: batches 0 .. eval_batches-1, rows 0 .. global_batch-1 of each.
double Session::measure_val_bytes(const std::vector<int>& token_bytes) const {
  const int T = model_cfg.seq_len;
  std::vector<std::int32_t> buf(static_cast<std::size_t>(T) + 1);
  double bytes = 0, tokens = 0;
  for (int e = 0; e < eval_batches; ++e)
    for (int r = 0; r < global_batch; ++r) {
      val_data->sample(val_split, e, r, buf.data());
      for (int t = 1; t <= T; ++t) bytes += token_bytes[static_cast<std::size_t>(buf[static_cast<std::size_t>(t)])];
      tokens += T;
    }
  return bytes > 0 ? tokens / bytes : 0;
}

PreModelRoles make_pre_model_roles(const Deck& deck, const std::vector<const StrategyInfo*>& strategies,
                                   ProcessGrid& grid, Backend& backend, const GPTConfig& model) {
  PartitionContext pctx{deck, grid, backend, model};
  PreModelRoles r;
  // Each role from the strategy that fills it for this run (check_role_claims settled that there is
  // at most one): a strategy another one replaces is not asked, whatever the order of the strategies.
  for (const StrategyInfo* strategy : strategies) {
    auto used = [&](Role role) { return fills_role(strategies, *strategy, role); };
    if (strategy->make_precision && used(Role::precision)) backend.set_precision(strategy->make_precision(pctx));
    if (strategy->make_partition && used(Role::partition)) r.partition = strategy->make_partition(pctx);
    if (strategy->make_context && used(Role::context)) r.context = strategy->make_context(pctx);
    if (strategy->make_experts && used(Role::experts)) r.experts = strategy->make_experts(pctx);
    if (strategy->assign_stage && used(Role::stage)) r.stage = strategy->assign_stage(pctx);
    if (strategy->make_store && used(Role::store)) r.store = strategy->make_store(pctx);
  }
  return r;
}

std::string Session::batch_digest() {
  // Two 26-bit halves of each row's hash, summed: exact in a double for up to 2^27 rows.
  double sums[2] = {0, 0};
  for (const auto& [row, h] : step_rows_) {
    sums[0] += static_cast<double>(h & 0x3ffffffu);
    sums[1] += static_cast<double>((h >> 26) & 0x3ffffffu);
  }
  step_rows_.clear();
  if (grid->world().size() > 1) grid->world().all_reduce(sums, 2);
  const std::uint64_t d =
      (static_cast<std::uint64_t>(sums[0]) & 0x3ffffffu) | ((static_cast<std::uint64_t>(sums[1]) & 0x3ffffffu) << 26);
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%013llx", static_cast<unsigned long long>(d));
  return buf;
}

void Session::check_device_memory() {
  if (backend_choice.name != "cuda" || deck.get_float("run.memory_limit") > 0) return;
  // The device is open, nothing of the model is allocated on it yet: the ranks on it against its free memory.
  const std::vector<int> sharing = ranks_on_device(backend_choice.device);  // collective
  run_agreed([&] {
    throw_if_out_of_memory(deck, registry,
                           device_memory_verdict(deck, registry, backend_choice.device, backend_choice.device_free,
                                                 backend_choice.device_total, sharing));
  });
}

void check_training_keys(const Deck& deck) {
  if (deck.get_float("train.lr_min") > deck.get_float("train.lr"))
    throw InputError("train.lr_min = " + deck.values().at("train.lr_min") + " is above train.lr = " +
                     deck.values().at("train.lr") + "; the cosine floor must be at most the peak learning rate");
  if (deck.get_string("train.on_spike") != "none" && deck.get_float("train.spike_loss_z") == 0 &&
      deck.get_float("train.spike_norm_z") == 0)
    throw InputError("train.on_spike = " + deck.get_string("train.on_spike") +
                     " with train.spike_loss_z = 0 and train.spike_norm_z = 0 watches nothing: give one a threshold "
                     "(e.g. 6), or set train.on_spike = none");
  if (deck.get_string("train.on_spike") == "rollback" && deck.get_int("checkpoint.every") <= 0)
    throw InputError("train.on_spike = rollback returns to the last checkpoint, but checkpoint.every = " +
                     deck.values().at("checkpoint.every") +
                     " writes none during training: set checkpoint.every (e.g. 100), or train.on_spike = skip");
}

AssembledRoles assemble_roles(const Deck& deck, const std::vector<const StrategyInfo*>& strategies, ProcessGrid& grid,
                              GPT& model, Backend& backend, const EngineConfig& engine_cfg, bool agree) {
  AssembledRoles out;
  EngineRoles& engine_roles = out.engine;
  std::unique_ptr<Reducer>& reducer = out.reducer;
  // The other roles, strategy by strategy: each may fill only what it declared. Wrappers of the run's
  // reducer (a wrap claim with no target) go right around the collective, the others around them.
  std::vector<std::pair<std::string, ReducerWrapper>> wrappers, inner_wrappers;
  for (const StrategyInfo* strategy : strategies) {
    Roles roles;
    StrategyContext ctx{deck, grid, model, backend, engine_cfg};
    strategy->create(ctx, roles);
    // The same on every rank: said once, exit 2, before any training.
    if (agree)
      run_agreed([&] { check_filled_roles(*strategy, roles); });
    else
      check_filled_roles(*strategy, roles);
    // A strategy another one replaces (by its claims) built its objects, but the run uses the
    // replacement's, whatever the order of the strategies.
    auto used = [&](Role role) { return fills_role(strategies, *strategy, role); };
    if (roles.schedule && used(Role::schedule)) engine_roles.schedule = std::move(roles.schedule);
    if (roles.grad_sync && used(Role::grad_sync)) engine_roles.grad_sync = std::move(roles.grad_sync);
    if (roles.optimizer && used(Role::optimizer)) engine_roles.optimizer = std::move(roles.optimizer);
    if (roles.reducer && used(Role::reducer)) reducer = std::move(roles.reducer);
    if (roles.progress && used(Role::progress)) model.set_progress_hook(std::move(roles.progress));
    for (auto& part : roles.checkpoint_parts) {
      out.checkpoint_parts.push_back(part.get());
      out.kept_parts.push_back(std::move(part));
    }
    if (roles.wrap_reducer) {
      const bool of_any = std::any_of(strategy->claims.begin(), strategy->claims.end(), [](const RoleClaim& c) {
        return c.role == Role::reducer && c.claim == Claim::wraps && c.target.empty();
      });
      (of_any ? inner_wrappers : wrappers).push_back({strategy->name, std::move(roles.wrap_reducer)});
    }
    for (PhaseHook& h : roles.hooks) {
      if (h.owner.empty()) h.owner = strategy->name;
      engine_roles.hooks.push_back(std::move(h));
    }
  }
  if (reducer)
    for (auto& [name, wrap] : inner_wrappers) reducer = wrap(std::move(reducer));
  for (auto& [name, wrap] : wrappers) {
    if (!reducer)
      throw InputError("strategy '" + name + "' wraps the gradient reducer, but no strategy of this run provides one");
    reducer = wrap(std::move(reducer));
  }
  if (reducer && engine_roles.grad_sync) engine_roles.grad_sync->use_reducer(reducer.get());
  engine_roles.world = &grid.world();
  return out;
}

StepPlan plan_rank_step(const EngineConfig& engine_cfg, GPT& model, Engine& engine, Reducer* reducer) {
  StepPlan s;
  s.micro_batches = engine_cfg.micro_batches;
  s.rows_per_micro = engine_cfg.rows_per_micro;
  s.price_pools = engine.backend().ring_scratch_pools();
  model.plan_step(s);
  model.store().plan_step(s);
  engine.schedule().plan_step(s);
  engine.grad_sync().plan_step(s);
  for (Reducer* red = reducer; red; red = red->inner()) red->plan_step(s);
  s.close_pools();
  return s;
}

void reserve_comm_scratch(ProcessGrid& grid, const StepPlan& plan) {
  for (const auto& [group, classes] : plan.pools()) {
    // A group the grid does not have (a strategy's own communicator) is not reserved: its
    // collectives take their scratch as they run.
    Communicator* c = group == "world" ? &grid.world()
                      : group == "dp"  ? &grid.dp()
                      : group == "tp"  ? &grid.tp()
                      : group == "pp"  ? &grid.pp()
                      : group == "cp"  ? &grid.cp()
                      : group == "ep"  ? &grid.ep()
                      : group == "edp" ? &grid.edp()
                                       : nullptr;
    if (c && c->name() == group) c->reserve_scratch(classes);
  }
}

void Session::resolve_attention() {
  if (model_cfg.attention != "auto") return;
  static const char* const kinds[] = {"unfused", "flash", "cudnn"};
  attention_why = GPT::resolve_attention(model_cfg, *backend);
  if (layout.cp > 1 && model_cfg.attention == "cudnn") {  // cuDNN's kernels cannot take part in the ring
    const bool flash = backend->flash_attention_refusal(model_cfg.head_size()).empty();
    model_cfg.set_attention(flash ? "flash" : "unfused");
    attention_why = std::string(flash ? "flash" : "unfused") +
                    ": cuDNN's attention cannot ring (parallel.cp = " + std::to_string(layout.cp) + ")";
  }
  int mine = 0;
  for (int k = 0; k < 3; ++k)
    if (model_cfg.attention == kinds[k]) mine = k;
  int agreed = mine;
  MPI_Allreduce(&mine, &agreed, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (agreed != mine) {
    model_cfg.set_attention(kinds[agreed]);
    attention_why = std::string("another rank's device runs no faster kind than ") + kinds[agreed];
  }
}

std::string Session::recorded_deck() const {
  Deck d = deck;
  if (deck.get_string("model.attention") != model_cfg.attention)
    d.resolve("model.attention", model_cfg.attention, "auto: " + attention_why);
  return d.resolved_text();
}

void Session::setup_collective() {
  backend = make_backend(deck.get_string("run.backend"), threads.threads, deck.get_string("run.tf32"),
                         deck.get_bool("run.share_gpu"), MPI_COMM_WORLD, &backend_choice);
  resolve_attention();
  run_agreed([&] { GPT::check_attention(model_cfg, *backend); });  // a device may lack what another has
  check_device_memory();
  set_comm_timeout(deck.get_float("run.comm_timeout"));
  set_link_model(deck.get_float("run.emulate_link_gbps"), 1e-6 * deck.get_float("run.emulate_link_latency_us"));
  grid = std::make_unique<ProcessGrid>(MPI_COMM_WORLD, layout, [this](MPI_Comm c, const std::string& name) {
    return backend->make_communicator(c, name);
  });
  PreModelRoles pre = make_pre_model_roles(deck, strategies, *grid, *backend, model_cfg);
  partition = std::move(pre.partition);
  context = std::move(pre.context);
  experts = std::move(pre.experts);
  store = std::move(pre.store);
  model = std::make_unique<GPT>(model_cfg, *backend, engine_cfg.rows_per_micro, partition.get(), pre.stage, store.get(),
                                layout.replicas(), grid->replica_rank(), context.get(), experts.get());
  model->init_weights(seed);
  if (!init_from.empty()) {
    // Every rank reads the file and takes its own elements; a bad file is refused alike everywhere.
    LlmcModel weights;
    run_agreed([&] { weights = read_init_from(init_from, model_cfg); });
    model->load_weights([&](const std::string& name) { return weights.tensors.at(name).data(); });
  }
  AssembledRoles roles = assemble_roles(deck, strategies, *grid, *model, *backend, engine_cfg, true);
  reducer = std::move(roles.reducer);
  checkpoint_parts = std::move(roles.checkpoint_parts);
  kept_parts = std::move(roles.kept_parts);
  engine = std::make_unique<Engine>(engine_cfg, *model, *backend, std::move(roles.engine));
  // The collectives' scratch, reserved now as `loom plan` prices it: no step allocates it, and an
  // out-of-memory shows at set-up rather than steps into the run.
  reserve_comm_scratch(*grid, plan_rank_step(engine_cfg, *model, *engine, reducer.get()));
  // Role objects that keep state of their own for checkpoints (after the strategies' listed parts).
  auto contributes = [this](auto* role) {
    if (auto* c = dynamic_cast<CheckpointContributor*>(role)) checkpoint_parts.push_back(c);
  };
  contributes(&model->partition());
  contributes(&model->store());
  contributes(&engine->schedule());
  contributes(&engine->grad_sync());
  for (Reducer* r = reducer.get(); r; r = r->inner()) contributes(r);

  set_batch_functions();
}

void Session::set_batch_functions() {
  // Each dp rank reads only its rows of every global batch: rows [dp_i * rows_per_rank, ...); each
  // context rank keeps its tokens of them (model->context()).
  const int T = model_cfg.seq_len;
  const std::int64_t row0 = static_cast<std::int64_t>(grid->dp_rank()) * rows_per_rank;
  const ContextSplit& ctx = model->context();
  auto local = [&ctx, T](std::vector<std::int32_t>& v, int rows) {
    if (ctx.size() == 1) return;
    const int Tl = ctx.local_tokens(T);
    std::vector<std::int32_t> mine(static_cast<std::size_t>(rows) * Tl);
    for (int r = 0; r < rows; ++r)
      for (int t = 0; t < Tl; ++t)
        mine[static_cast<std::size_t>(r) * Tl + t] = v[static_cast<std::size_t>(r) * T + ctx.position(t, T)];
    v = std::move(mine);
  };
  train_batches = [this, T, row0, local](std::int64_t step, std::int64_t first_row, int rows,
                                         std::vector<std::int32_t>& in, std::vector<std::int32_t>& tgt) {
    if (inject_fault("data", step))
      throw InputError("data.source = " + quote_path(data_source) +
                       ": cannot be read on this rank (injected by LOOM_INJECT_FAULT)");
    Batch b;
    const std::int64_t batch = step + data_offset;
    load_batch(*train_data, Split::train, batch, row0 + first_row, rows, T, b);
    in = std::move(b.inputs);
    tgt = std::move(b.targets);
    if (inject_bad_data(batch)) std::fill(tgt.begin(), tgt.end(), 0);  // LOOM_INJECT_FAULT where=bad_data
    if (counts_rows_)
      for (int r = 0; r < rows; ++r) {  // FNV-1a over the row's inputs and its last target
        std::uint64_t h = 1469598103934665603ull;
        const auto mix = [&h](std::uint32_t v) { h = (h ^ v) * 1099511628211ull; };
        for (int t = 0; t < T; ++t) mix(static_cast<std::uint32_t>(in[static_cast<std::size_t>(r) * T + t]));
        mix(static_cast<std::uint32_t>(tgt[static_cast<std::size_t>(r) * T + T - 1]));
        step_rows_[row0 + first_row + r] = h ^ static_cast<std::uint64_t>(row0 + first_row + r) * 0x9e3779b97f4a7c15ull;
      }
    local(in, rows);
    local(tgt, rows);
  };
  counts_rows_ = grid->tp_rank() == 0 && grid->pp_rank() == 0 && grid->cp_rank() == 0;
  if (val_data) {
    val_batches = [this, T, row0, local](std::int64_t step, std::int64_t first_row, int rows,
                                         std::vector<std::int32_t>& in, std::vector<std::int32_t>& tgt) {
      Batch b;
      load_batch(*val_data, val_split, step, row0 + first_row, rows, T, b);
      in = std::move(b.inputs);
      tgt = std::move(b.targets);
      local(in, rows);
      local(tgt, rows);
    };
  }
}

std::string Session::banner() const {
  std::ostringstream s;
  s << "loom " << build::version << " (" << build::git_commit << ", " << build::build_type << ", " << build::compiler
    << ")\n";
  s << "  modules : MPI " << mpi_library() << "\n";
  s << "            Kokkos " << KOKKOS_VERSION / 10000 << "." << KOKKOS_VERSION / 100 % 100 << "."
    << KOKKOS_VERSION % 100 << " [" << Kokkos::DefaultHostExecutionSpace::name() << "] via " << build::kokkos_origin
    << "\n";
  s << "            HDF5 " << build::hdf5_version << "; CUDA back end "
    << (build::cuda
            ? std::string("built (CUDA ") + build::cuda_version + ", architectures " + build::cuda_architectures + ")"
            : std::string("not built"))
    << "\n";
  s << "  backend : run.backend = " << backend_choice.requested << ": " << backend->description()
    << (backend_choice.reason.empty() ? "" : "; " + backend_choice.reason) << "\n";
  if (*openblas_core_note()) s << "            " << openblas_core_note() << "\n";
  s << "  threads : " << threads.origin << "\n";
  if (*wait_policy_note()) s << "            " << wait_policy_note() << "\n";
  const DType mm = backend->precision().matmul;
  if (mm == DType::f32)
    s << "  precision: fp32\n";
  else
    s << "  precision: " << dtype_name(mm) << " matrix products (operands rounded to " << dtype_name(mm)
      << ", fp32 accumulation); fp32 master weights, gradients, AdamW state, activations, LayerNorm, softmax, loss; "
      << "gradient collective in " << dtype_name(backend->precision().reduce) << "\n";
  s << "  gemm    : run.gemm = " << deck.get_string("run.gemm") << ": " << gemm::describe() << "\n";
  s << "  deck    : " << deck.path() << "\n";
  s << "  model   : GPT-2, " << model_cfg.layers << " layers, d_model " << model_cfg.d_model << ", " << model_cfg.heads
    << " heads, seq_len " << model_cfg.seq_len << ", vocab " << model_cfg.vocab << ", " << model->num_params()
    << " parameters" << (model_cfg.recompute ? ", recompute" : "")
    << (model_cfg.flash_attention ? std::string(", ") + model_cfg.attention + " attention (bf16 operands, lse saved)"
                                  : std::string())
    << "\n";
  if (!attention_why.empty())
    s << "  attention: model.attention = auto -> " << model_cfg.attention << " (" << attention_why << ")\n";
  s << "  weights : "
    << (init_from.empty() ? "random (train.seed = " + std::to_string(seed) + ")"
                          : "model.init_from = " + init_from +
                                (!std::filesystem::is_directory(init_from) ? " (llm.c model file)"
                                 : model_cfg.llama()                       ? " (Hugging Face Llama files)"
                                                                           : " (Hugging Face GPT-2 files)"))
    << (deck.get_string("checkpoint.resume").empty() ? "" : ", unless checkpoint.resume loads a checkpoint") << "\n";
  s << "  data    : " << train_data->describe() << "\n";
  if (val_owned) s << "  val     : " << val_owned->describe() << "\n";
  if (!tokenizer.empty())
    s << "  tokens  : SentencePiece " << tokenizer
      << " (validation reports bits per byte: " << (val_tokens_per_byte > 0 ? 1 / val_tokens_per_byte : 0)
      << " bytes of text per token)\n";
  if (auto best = train_data->best_loss()) s << "  best possible loss: " << *best << " nats/token\n";
  s << "  batch   : " << global_batch << " sequences = dp " << layout.dp << " x " << engine_cfg.micro_batches
    << " micro-batch" << (engine_cfg.micro_batches == 1 ? "" : "es") << " x " << engine_cfg.rows_per_micro
    << " sequences per rank"
    << (layout.cp > 1 ? ", each split over cp " + std::to_string(layout.cp) + " ranks (" +
                            std::to_string(model_cfg.seq_len / layout.cp) + " tokens a rank)"
                      : std::string())
    << "\n";
  for (const auto& line : registry.log) s << "  " << line << "\n";
  for (const StrategyInfo* st : strategies)
    s << "  strategy: " << st->name << " " << st->version << " (" << st->origin << "): " << st->description << "\n";
  s << "  roles   : partition " << model->partition().name() << "; store " << model->store().name() << "; schedule "
    << engine->schedule().name() << "; gradient sync " << engine->grad_sync().name() << "; optimizer "
    << engine->optimizer().name() << "\n";
  s << "  " << grid->describe();
  s << "  run.dir : " << run_dir << "\n";
  return s.str();
}

}  // namespace loom
