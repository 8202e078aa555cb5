#pragma once
// The layout search of `loom plan DECK --devices N` and its memo (issue 16): every dp x tp x pp of N
// devices with every micro-batch count, ZeRO stage, recompute, sequence parallelism and precision,
// each predicted by `predict` (driver/plan/predict.hpp) from the deck with the variant's --set
// overrides, so a rejected variant is refused by the same checks `loom run` makes.
#include <string>
#include <vector>

#include "driver/plan/predict.hpp"

namespace loom {

struct PlanOptions;

// One point of the search: what it sets in the deck.
struct Variant {
  int dp = 1, tp = 1, pp = 1, micro = 1, zero = 0;
  bool recompute = false, sp = false;
  std::string precision = "fp32";
  std::vector<std::string> extra;         // further deck overrides (the memo's what-ifs)
  std::vector<std::string> sets() const;  // the deck overrides that express it
  std::string layout() const;             // "dp 4 x tp 8 x pp 1"
  std::string describe() const;           // + micro-batches, ZeRO, recompute, sp, precision
};

struct Candidate {
  Variant v;
  bool built = false;  // the deck's checks accepted it and it was predicted
  bool fits = false;   // and its largest rank fits the device
  double over = 0;     // bytes beyond the device's memory (negative: headroom)
  std::string reason;  // why it is rejected: a refusal's first clause, or out of memory by how much
  Prediction p;
};

struct PlanSearch {
  const StrategyRegistry& registry;
  const DeckSchema& schema;
  std::string deck_path;
  std::vector<std::string> deck_sets;  // the user's --set for the deck, before each variant's
  ClusterSpec cluster;

  // The deck with `v`'s overrides, predicted (every_rank: see predict); a refusal becomes the reason.
  Candidate evaluate(const Variant& v, bool every_rank = false) const;
  // Every variant of `devices` devices: those that fit first, by predicted tokens/s, then the others.
  std::vector<Candidate> run(int devices) const;
};

std::string describe_search(const std::vector<Candidate>& all, int devices, const ClusterSpec& cluster, int top,
                            bool every);
std::string search_json(const std::vector<Candidate>& all, int devices, const ClusterSpec& cluster);
// The memo of the chosen (first) candidate, written to options.memo (driver/plan/memo.cpp).
void write_memo(const PlanSearch& search, const PlanOptions& options, const std::vector<Candidate>& all);

std::string gib(double bytes);
std::string fixed(double v, int digits);

}  // namespace loom
