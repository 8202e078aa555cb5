#include "driver/session.hpp"

#include <mpi.h>

#include <sstream>

#include "core/error.hpp"
#include "driver/blas_core.hpp"
#include "io/report.hpp"
#include "loom/build_info.hpp"

namespace loom {
namespace {

std::string divisors_of(std::int64_t n) {
  std::ostringstream s;
  bool first = true;
  for (std::int64_t d = 1; d <= n; ++d)
    if (n % d == 0) {
      s << (first ? "" : ", ") << d;
      first = false;
    }
  return s.str();
}

}  // namespace

Session::Session(const Deck& d) : deck(d) {
  model_cfg.layers = static_cast<int>(d.get_int("model.layers"));
  model_cfg.d_model = static_cast<int>(d.get_int("model.d_model"));
  model_cfg.heads = static_cast<int>(d.get_int("model.heads"));
  model_cfg.seq_len = static_cast<int>(d.get_int("model.seq_len"));
  model_cfg.vocab = static_cast<int>(d.get_int("model.vocab"));
  model_cfg.recompute = d.get_bool("model.recompute");
  model_cfg.validate();

  // The process grid: until the strategy plugins land, the only layout is one process.
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const auto dp = d.get_int("parallel.dp"), tp = d.get_int("parallel.tp"), pp = d.get_int("parallel.pp");
  for (auto [key, value] : {std::pair{"parallel.dp", dp}, {"parallel.tp", tp}, {"parallel.pp", pp}})
    if (value != 1)
      throw InputError(std::string(key) + " = " + std::to_string(value) +
                       ": this build trains on one process only (the data, tensor and pipeline plugins are not "
                       "built yet); allowed: 1");
  if (world != dp * tp * pp)
    throw InputError("launched on " + std::to_string(world) + " MPI ranks, but parallel.dp x parallel.tp x parallel.pp = " +
                     std::to_string(dp * tp * pp) + "; launch with mpirun -n " + std::to_string(dp * tp * pp));

  steps = d.get_int("train.steps");
  global_batch = static_cast<int>(d.get_int("train.batch"));
  const int micro = static_cast<int>(d.get_int("train.micro_batches"));
  if (global_batch % micro != 0)
    throw InputError("train.batch = " + std::to_string(global_batch) + " is not divisible by train.micro_batches = " +
                     std::to_string(micro) + "; micro_batches that divide it: " + divisors_of(global_batch));
  engine_cfg.micro_batches = micro;
  engine_cfg.rows_per_micro = global_batch / micro;
  auto& o = engine_cfg.optimizer;
  o.lr = d.get_float("train.lr");
  o.lr_min = d.get_float("train.lr_min");
  o.schedule = d.get_string("train.schedule");
  o.warmup = d.get_int("train.warmup");
  o.steps = steps;
  o.weight_decay = d.get_float("train.weight_decay");
  o.beta1 = d.get_float("train.beta1");
  o.beta2 = d.get_float("train.beta2");
  o.eps = d.get_float("train.eps");
  o.grad_clip = d.get_float("train.grad_clip");
  if (o.lr_min > o.lr)
    throw InputError("train.lr_min = " + std::to_string(o.lr_min) + " is above train.lr = " + std::to_string(o.lr) +
                     "; the cosine floor must be at most the peak learning rate");
  seed = static_cast<std::uint64_t>(d.get_int("train.seed"));
  eval_every = d.get_int("train.eval_every");
  eval_batches = static_cast<int>(d.get_int("train.eval_batches"));
  log_every = d.get_int("train.log_every");
  run_dir = d.get_string("run.dir");

  DataConfig dc;
  dc.source = d.get_string("data.source");
  dc.vocab = model_cfg.vocab;
  dc.seq_len = model_cfg.seq_len;
  dc.seed = seed;
  dc.val_fraction = d.get_float("data.val_fraction");
  dc.synthetic_noise = d.get_float("data.synthetic_noise");
  const std::string val_source = d.get_string("data.val_source");
  if (!val_source.empty()) dc.val_fraction = 0.0;  // all of data.source trains
  train_data = open_dataset(dc);
  if (!val_source.empty()) {
    DataConfig vc = dc;
    vc.source = val_source;
    vc.seed = seed ^ 0x5eed5eedULL;
    val_owned = open_dataset(vc);
    val_data = val_owned.get();
    val_split = Split::train;
  } else if (dc.val_fraction > 0.0) {
    val_data = train_data.get();
    val_split = Split::val;
  }

  backend = make_host_backend(static_cast<int>(d.get_int("run.threads")));
  model = std::make_unique<GPT>(model_cfg, *backend, engine_cfg.rows_per_micro);
  model->init_weights(seed);
  engine = std::make_unique<Engine>(engine_cfg, *model, *backend);

  const int T = model_cfg.seq_len;
  train_batches = [this, T](std::int64_t step, std::int64_t first_row, int rows, std::vector<std::int32_t>& in,
                            std::vector<std::int32_t>& tgt) {
    Batch b;
    load_batch(*train_data, Split::train, step, first_row, rows, T, b);
    in = std::move(b.inputs);
    tgt = std::move(b.targets);
  };
  if (val_data) {
    val_batches = [this, T](std::int64_t step, std::int64_t first_row, int rows, std::vector<std::int32_t>& in,
                            std::vector<std::int32_t>& tgt) {
      Batch b;
      load_batch(*val_data, val_split, step, first_row, rows, T, b);
      in = std::move(b.inputs);
      tgt = std::move(b.targets);
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
  s << "            HDF5 " << build::hdf5_version << "; backend " << backend->description() << "\n";
  if (*openblas_core_note()) s << "            " << openblas_core_note() << "\n";
  s << "  deck    : " << deck.path() << "\n";
  s << "  model   : GPT-2, " << model_cfg.layers << " layers, d_model " << model_cfg.d_model << ", " << model_cfg.heads
    << " heads, seq_len " << model_cfg.seq_len << ", vocab " << model_cfg.vocab << ", " << model->num_params()
    << " parameters" << (model_cfg.recompute ? ", recompute" : "") << "\n";
  s << "  data    : " << train_data->describe() << "\n";
  if (val_owned) s << "  val     : " << val_owned->describe() << "\n";
  if (auto best = train_data->best_loss()) s << "  best possible loss: " << *best << " nats/token\n";
  s << "  layout  : 1 rank (dp 1 x tp 1 x pp 1); batch " << global_batch << " = " << engine_cfg.micro_batches
    << " micro-batch" << (engine_cfg.micro_batches == 1 ? "" : "es") << " of " << engine_cfg.rows_per_micro
    << " sequences; schedule " << engine->schedule().name() << "\n";
  s << "  run.dir : " << run_dir << "\n";
  return s.str();
}

}  // namespace loom
