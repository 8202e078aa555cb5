// `loom export DECK OUT.h5`: trains the deck on one process and writes what the PyTorch oracle
// (regression/oracle.py) needs to rebuild the run independently: the initial weights, every
// batch, the losses, the step-0 gradients and the final weights.
#include <mpi.h>

#include <iostream>
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
}  // namespace

int command_export(const Deck& deck, const StrategyRegistry& registry, const std::string& out) {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world != 1) throw InputError("loom export runs on one process; launched on " + std::to_string(world));
  Session s(deck, registry);
  const int B = s.global_batch, T = s.model_cfg.seq_len;
  const auto& o = s.engine_cfg.optimizer;
  auto f = h5::File::create(out);
  f.attr("layers", static_cast<std::int64_t>(s.model_cfg.layers));
  f.attr("d_model", static_cast<std::int64_t>(s.model_cfg.d_model));
  f.attr("heads", static_cast<std::int64_t>(s.model_cfg.heads));
  f.attr("seq_len", static_cast<std::int64_t>(T));
  f.attr("vocab", static_cast<std::int64_t>(s.model_cfg.vocab));
  f.attr("batch", static_cast<std::int64_t>(B));
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

  write_params(f, "/params/init", *s.model, false);
  std::vector<std::int32_t> inputs(static_cast<std::size_t>(s.steps) * B * T), targets(inputs.size());
  std::vector<double> loss(s.steps), lr(s.steps), norm(s.steps);
  // Record the rows each micro-batch reads, where the engine asked for them.
  BatchFn recording = [&](std::int64_t step, std::int64_t first_row, int rows, std::vector<std::int32_t>& in,
                          std::vector<std::int32_t>& tgt) {
    s.train_batches(step, first_row, rows, in, tgt);
    const std::size_t at = (static_cast<std::size_t>(step) * B + first_row) * T;
    std::copy(in.begin(), in.end(), inputs.begin() + at);
    std::copy(tgt.begin(), tgt.end(), targets.begin() + at);
  };
  for (std::int64_t step = 0; step < s.steps; ++step) {
    const StepStats st = s.engine->train_step(step, recording, [&](const StepStats& pre) {
      if (step == 0) write_params(f, "/grads/step0", *s.model, true);
      norm[step] = pre.grad_norm;
    });
    loss[step] = st.loss;
    lr[step] = st.lr;
    std::cout << "export: step " << step + 1 << "/" << s.steps << " loss " << st.loss << "\n";
  }
  write_params(f, "/params/final", *s.model, false);
  f.write("/batches/inputs", inputs.data(), {s.steps, B, T});
  f.write("/batches/targets", targets.data(), {s.steps, B, T});
  f.write("/metrics/loss", loss.data(), {s.steps});
  f.write("/metrics/lr", lr.data(), {s.steps});
  f.write("/metrics/grad_norm", norm.data(), {s.steps});
  std::cout << "export: wrote " << out << "\n";
  return 0;
}

}  // namespace loom
