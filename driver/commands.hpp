#pragma once
// The subcommands of the driver. Each returns the process exit status.
#include <cstdint>
#include <string>
#include <vector>

#include "core/engine/plugin.hpp"
#include "driver/plan/cost_model.hpp"
#include "io/deck.hpp"

namespace loom {
int command_check(const Deck& deck, const StrategyRegistry& registry, int rank);  // loom check DECK
int command_run(const Deck& deck, const StrategyRegistry& registry);              // loom run DECK
int command_export(const Deck& deck, const StrategyRegistry& registry,
                   const std::string& out);  // loom export DECK OUT.h5

struct SampleOptions {  // loom sample CKPT [options]
  std::string checkpoint, prompt, tokens, tokenizer;
  int steps = 256;
  double temperature = 1.0;  // 0: always the most likely token
  int top_k = 0;             // 0: the whole vocabulary
  std::uint64_t seed = 1337;
};
int command_sample(const SampleOptions& options);
struct PlanOptions {  // loom plan [DECK] [options]
  std::string deck, cluster, output, memo;
  std::vector<std::string> sets;  // cluster.* and network.* go to the cluster, the rest to the deck
  bool calibrate = false, show = false, cluster_keys = false, json = false;
  int devices = 0;      // > 0: search the layouts of this many devices
  int top = 10;         // how many of the fitting layouts the search's table lists
  bool all = false;     // list every candidate of the search too
  std::string command;  // the command line, for the memo's first line
};
int command_plan(const PlanOptions& options, const StrategyRegistry& registry, const DeckSchema& schema);
// The part of it that predicts a deck (driver/plan/predict.cpp); `cluster` is resolved.
int command_plan_deck(const PlanOptions& options, const StrategyRegistry& registry, const DeckSchema& schema,
                      const ClusterSpec& cluster);
int command_ckpt_llmc(const std::string& checkpoint, const std::string& out);  // loom ckpt llmc CKPT OUT.bin
// loom ckpt hf CKPT DIR [--tokenizer FILE.model] (tokenizer: "" for none)
int command_ckpt_hf(const std::string& checkpoint, const std::string& dir, const std::string& tokenizer);
// A checkpoint file, or a checkpoint directory's `latest` (InputError when it has none).
std::string checkpoint_file(const std::string& path);
// loom eval CKPT [--data SOURCE] [--batches N] [--set k=v] [--json]
int command_eval(const std::vector<std::string>& rest, const StrategyRegistry& registry, const DeckSchema& schema);
int command_data(const std::vector<std::string>& rest);  // loom data prepare [options]
int command_ckpt_verify(const std::string& path);        // loom ckpt verify FILE|DIR
}  // namespace loom
