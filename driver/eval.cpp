// `loom eval CKPT --data SOURCE`: a checkpoint's loss, perplexity and bits per byte on held-out
// data, at any layout (data parallel over the job's ranks unless --set parallel.* says otherwise). The run is rebuilt
// from the deck the checkpoint records, with --data as its validation source (and data source, so the training files
// need not exist), then the checkpoint is loaded as a resume loads it and Engine::evaluate runs: the same samples and
// the same figure as the run's own periodic validation on that data.
#include <mpi.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/base/error.hpp"
#include "driver/commands.hpp"
#include "driver/session.hpp"
#include "io/checkpoint.hpp"
#include "io/deck.hpp"

namespace loom {
namespace {

struct EvalOptions {
  std::string checkpoint, data;
  int batches = 0;  // 0: the checkpoint deck's train.eval_batches
  std::vector<std::string> sets;
  bool json = false;
};

EvalOptions parse_eval(const std::vector<std::string>& rest) {
  namespace po = boost::program_options;
  EvalOptions o;
  po::options_description opts("loom eval options");
  opts.add_options()("data", po::value(&o.data), "held-out data: text:PATH or tokens:GLOB (default: the run's)")(
      "batches", po::value(&o.batches), "global batches to evaluate (default: the deck's train.eval_batches)")(
      "set", po::value(&o.sets)->composing(), "override section.key=value (a layout: parallel.dp, ...)")(
      "json", po::bool_switch(&o.json), "print the figures as one JSON object")("checkpoint", po::value(&o.checkpoint),
                                                                                "");
  po::positional_options_description pos;
  pos.add("checkpoint", 1);
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(rest).options(opts).positional(pos).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    std::ostringstream s;
    s << opts;
    throw UsageError(std::string("loom eval: ") + e.what() + "\n" + s.str());
  }
  if (o.checkpoint.empty()) throw UsageError("loom eval: expects CKPT (a checkpoint file or directory)");
  if (vm.count("batches") && o.batches < 1)
    throw UsageError("loom eval: --batches " + std::to_string(o.batches) + " must be at least 1");
  return o;
}

// The checkpoint's own deck, made an evaluation: no training, no checkpoints, no init file.
Deck eval_deck(const EvalOptions& o, const std::string& file, const CheckpointState& header, const DeckSchema& schema) {
  std::vector<std::string> sets = {"checkpoint.resume=", "model.init_from="};
  // The layout is this job's: data parallel over its ranks, unless --set gives one.
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (std::none_of(o.sets.begin(), o.sets.end(), [](const std::string& kv) { return kv.rfind("parallel.", 0) == 0; }))
    sets.insert(sets.end(),
                {"parallel.dp=" + std::to_string(world), "parallel.tp=1", "parallel.pp=1", "parallel.cp=1"});
  if (!o.data.empty()) {
    sets.push_back("data.source=" + o.data);
    sets.push_back("data.val_source=" + o.data);
  }
  if (o.batches > 0) sets.push_back("train.eval_batches=" + std::to_string(o.batches));
  sets.insert(sets.end(), o.sets.begin(), o.sets.end());
  // The recorded deck marks the keys its run did not give ("# default"): left out, they stay
  // defaults, and keys that may only be given together (fp16's loss scaling) stay valid.
  std::istringstream in(header.deck);
  std::string line, given;
  while (std::getline(in, line))
    if (line.size() < 9 || line.compare(line.size() - 9, 9, "# default") != 0) given += line + "\n";
  return parse_deck(schema, given, file + " (the deck it records)", sets);
}

}  // namespace

int command_eval(const std::vector<std::string>& rest, const StrategyRegistry& registry, const DeckSchema& schema) {
  const EvalOptions o = parse_eval(rest);
  const std::string file = checkpoint_file(o.checkpoint);
  const CheckpointState header = checkpoint_header(file);
  const Deck deck = eval_deck(o, file, header, schema);
  Session s(deck, registry);
  if (!s.val_data)
    throw InputError("loom eval: " + quote_path(file) +
                     "'s deck has no validation data (data.val_fraction = 0, no data.val_source): give --data SOURCE");
  run_agreed([&] { load_checkpoint(file, *s.grid, *s.model, s.engine->optimizer(), s.checkpoint_parts); });
  const double loss = s.engine->evaluate(s.eval_batches, s.val_batches);
  if (s.grid->rank() != 0) return 0;
  const double tokens = static_cast<double>(s.eval_batches) * s.global_batch * s.model_cfg.seq_len;
  const double bpb = s.val_tokens_per_byte > 0 ? loss * s.val_tokens_per_byte / std::log(2.0) : -1;
  const std::string source =
      deck.get_string(deck.get_string("data.val_source").empty() ? "data.source" : "data.val_source");
  if (o.json) {
    nlohmann::json j = {
        {"checkpoint", file},
        {"step", header.step},
        {"data", source},
        {"loss", loss},
        {"perplexity", std::exp(loss)},
        {"tokens", tokens},
        {"batches", s.eval_batches},
        {"layout", {{"dp", s.layout.dp}, {"tp", s.layout.tp}, {"pp", s.layout.pp}, {"cp", s.layout.cp}}}};
    if (bpb >= 0) j["bits_per_byte"] = bpb;
    std::cout << j.dump() << "\n";
    return 0;
  }
  std::printf("eval: %s (step %lld) on %s%s\n", file.c_str(), static_cast<long long>(header.step), source.c_str(),
              deck.get_string("data.val_source").empty() ? " (its held-out split)" : "");
  std::printf("      loss %.6f nats/token | perplexity %.3f | ", loss, std::exp(loss));
  if (bpb >= 0)
    std::printf("%.6f bits/byte", bpb);
  else
    std::printf("bits/byte unknown (no tokenizer: set data.tokenizer)");
  std::printf(" | %.0f tokens (%d batch%s of %d x %d) | %s\n", tokens, s.eval_batches, s.eval_batches == 1 ? "" : "es",
              s.global_batch, s.model_cfg.seq_len, s.layout.describe().c_str());
  return 0;
}

}  // namespace loom
