// `loom export DECK OUT.h5`: trains the deck on one process (or on the ranks of a context-parallel
// ring, parallel.cp, whose ranks hold whole weights and gradients) and writes what the PyTorch oracle
// (regression/oracle.py) needs to rebuild the run independently: the initial weights, every batch,
// the losses, the step-0 gradients and the final weights. Rank 0 writes.
#include <mpi.h>

#include <iostream>
#include <optional>
#include <stdexcept>
#include <vector>

#include "driver/commands.hpp"
#include "driver/session.hpp"
#include "io/h5.hpp"
#include "loom/build_info.hpp"

namespace loom {
namespace {
// Every tensor of the model (one process holds them all), parameters or gradients, from the store.
void write_params(h5::File& f, const std::string& group, GPT& model, bool grads) {
  for (std::size_t i = 0; i < model.params().size(); ++i) {
    const ParamInfo& p = model.params()[i];
    const int index = static_cast<int>(i);
    // Through a host copy: on a device back end the store's pointers are device memory.
    std::vector<float> host(static_cast<std::size_t>(p.numel()));
    const BufferRef t = grads ? model.grad_ref(index) : model.param_ref(index);
    if (t.count != p.numel()) throw std::logic_error("loom export: the store does not hold " + p.name + " whole");
    model.backend().copy_to_host(host.data(), t);
    f.write(group + "/" + p.name, host.data(), p.local_shape());
  }
}
// The run's settings, as the oracle reads them.
void write_header(h5::File& f, const Deck& deck, const Session& s) {
  const auto& o = s.engine_cfg.optimizer;
  f.attr("layers", static_cast<std::int64_t>(s.model_cfg.layers));
  f.attr("d_model", static_cast<std::int64_t>(s.model_cfg.d_model));
  f.attr("heads", static_cast<std::int64_t>(s.model_cfg.heads));
  f.attr("seq_len", static_cast<std::int64_t>(s.model_cfg.seq_len));
  f.attr("vocab", static_cast<std::int64_t>(s.model_cfg.vocab));
  f.attr("batch", static_cast<std::int64_t>(s.global_batch));
  f.attr("micro_batches", static_cast<std::int64_t>(s.engine_cfg.micro_batches));
  f.attr("steps", s.steps);
  f.attr("warmup", o.warmup);
  f.attr("lr", o.lr);
  f.attr("lr_min", o.lr_min);
  f.attr("weight_decay", o.weight_decay);
  f.attr("beta1", o.beta1);
  f.attr("beta2", o.beta2);
  f.attr("eps", o.eps);
  f.attr("grad_clip", o.grad_clip);
  f.attr("schedule", o.schedule);
  f.attr("loom_version", std::string(build::version));
  f.attr("deck", deck.resolved_text());
}
}  // namespace

int command_export(const Deck& deck, const StrategyRegistry& registry, const std::string& out) {
  int world = 1, rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const std::int64_t cp = deck.get_int("parallel.cp");
  if (world != cp)
    throw InputError("loom export runs on one process, or on the parallel.cp = " + std::to_string(cp) +
                     " ranks of a context-parallel ring alone; launched on " + std::to_string(world));
  Session s(deck, registry);
  // The oracle rebuilds whole tensors: a store that keeps only shares of them (ZeRO-2 and -3) is
  // refused here, alike on every rank (each holds the same shapes), before any step.
  for (std::size_t i = 0; i < s.model->params().size(); ++i) {
    const ParamInfo& p = s.model->params()[i];
    const int index = static_cast<int>(i);
    if (s.model->param_ref(index).count != p.numel() || s.model->grad_ref(index).count != p.numel())
      throw InputError("loom export: the parameter store keeps only a share of " + p.name +
                       " on each rank (a sharded store); export whole tensors: run it without sharding");
  }
  const int B = s.global_batch, T = s.model_cfg.seq_len;
  std::optional<h5::File> f;
  if (rank == 0) {
    f.emplace(h5::File::create(out));
    write_header(*f, deck, s);
    write_params(*f, "/params/init", *s.model, false);
  }
  std::vector<std::int32_t> inputs(static_cast<std::size_t>(s.steps) * B * T), targets(inputs.size());
  std::vector<double> loss(s.steps), lr(s.steps), norm(s.steps);
  // Record the whole rows each micro-batch reads, where the engine asked for them (a context-parallel
  // rank is handed its own tokens of them: the rows are read again whole).
  BatchFn recording = [&](std::int64_t step, std::int64_t first_row, int rows, std::vector<std::int32_t>& in,
                          std::vector<std::int32_t>& tgt) {
    s.train_batches(step, first_row, rows, in, tgt);
    Batch whole;
    load_batch(*s.train_data, Split::train, step + s.data_offset, first_row, rows, T, whole);
    const std::size_t at = (static_cast<std::size_t>(step) * B + first_row) * T;
    std::copy(whole.inputs.begin(), whole.inputs.end(), inputs.begin() + at);
    std::copy(whole.targets.begin(), whole.targets.end(), targets.begin() + at);
  };
  for (std::int64_t step = 0; step < s.steps; ++step) {
    const StepStats st = s.engine->train_step(step, recording, [&](const StepStats& pre) {
      if (step == 0 && f) write_params(*f, "/grads/step0", *s.model, true);
      norm[step] = pre.grad_norm;
    });
    loss[step] = st.loss;
    lr[step] = st.lr;
    if (rank == 0) std::cout << "export: step " << step + 1 << "/" << s.steps << " loss " << st.loss << "\n";
  }
  if (!f) return 0;
  write_params(*f, "/params/final", *s.model, false);
  f->write("/batches/inputs", inputs.data(), {s.steps, B, T});
  f->write("/batches/targets", targets.data(), {s.steps, B, T});
  f->write("/metrics/loss", loss.data(), {s.steps});
  f->write("/metrics/lr", lr.data(), {s.steps});
  f->write("/metrics/grad_norm", norm.data(), {s.steps});
  std::cout << "export: wrote " << out << "\n";
  return 0;
}

}  // namespace loom
