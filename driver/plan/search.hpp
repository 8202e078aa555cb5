#pragma once
// The layout search of `loom plan DECK --devices N` and its memo: every dp x tp x pp of N
// devices with every micro-batch count, recompute, and every value of the search dimensions the
// strategies declare (StrategyInfo::plan, core/engine/plan_terms.hpp: ZeRO's stage, the precision,
// sequence parallelism, ...), each predicted by `predict` (driver/plan/predict.hpp) from the deck with
// the variant's --set overrides, so a rejected variant is refused by the same checks `loom run` makes.
#include <string>
#include <vector>

#include "driver/plan/predict.hpp"

namespace loom {

struct PlanOptions;

// One point of the search: what it sets in the deck.
struct Variant {
  int dp = 1, tp = 1, pp = 1, micro = 1, cp = 1;
  bool cp_searched = false;  // the search varies parallel.cp: sets() then names it even at 1
  // Each search dimension's deck key and value, in the search's nest order (PlanDimension::nest).
  std::vector<std::pair<std::string, std::string>> settings;
  std::vector<std::string> extra;                              // further deck overrides (the memo's what-ifs)
  const std::vector<PlanDimension>* dims = nullptr;            // the search's dimensions, in nest order
  std::string get(const std::string& key) const;               // "" when not set
  void set(const std::string& key, const std::string& value);  // in its nest place
  bool recompute() const { return get(kRecomputeKey) == "true"; }
  std::vector<std::string> sets() const;  // the deck overrides that express it
  std::string layout() const;             // "dp 4 x tp 8 x pp 1" ("dp 2 x cp 2 x tp 8 x pp 1")
  std::string describe() const;           // + micro-batches and each dimension's words, in column order
  PlanPoint point(const Deck* deck) const;
  // Search dimensions set to other than their plain (first) value at this layout.
  int departures = 0;
  // What a user takes on with it: those departures, and model parallelism (tp, pp) beyond dp.
  int strategies() const { return departures + (tp > 1) + (pp > 1) + (cp > 1); }
  static constexpr const char* kRecomputeKey = "model.recompute";
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
  PlanSearch(const StrategyRegistry& registry, const DeckSchema& schema, std::string deck_path,
             std::vector<std::string> deck_sets, ClusterSpec cluster);
  const StrategyRegistry& registry;
  const DeckSchema& schema;
  std::string deck_path;
  std::vector<std::string> deck_sets;  // the user's --set for the deck, before each variant's
  ClusterSpec cluster;
  // The model's recompute and every strategy's search dimensions, in nest order.
  std::vector<PlanDimension> dims;

  // The deck with `v`'s overrides, predicted (every_rank: see predict); a refusal becomes the reason.
  Candidate evaluate(const Variant& v, bool every_rank = false) const;
  // Every variant of `devices` devices: those that fit first, by predicted tokens/s, then the others.
  std::vector<Candidate> run(int devices) const;
  // `v` with each dimension's value one its layout allows (the first where not; none where it has no values).
  Variant normalise(Variant v, const Deck& base) const;
  // The dimensions in column order (the table's, the descriptions', the memo's what-ifs).
  std::vector<const PlanDimension*> columns() const;
  // Every strategy's memo sentences on `topic` about `p`, in registry order.
  std::string memo_text(const std::string& topic, const PlanPoint& p) const;
  // Every strategy's levers against `bottleneck`.
  std::vector<PlanLever> levers(const std::string& bottleneck, const PlanPoint& p) const;
};

// The recommendation among `all` (run's order): the fastest, unless a candidate within kSimplerWithin
// of its predicted tokens/s has fewer strategies on and leaves kSimplerHeadroom of the device free:
// then the first such with fewest. A predicted gap that small is within the prediction's error
// (regression.plan.step_time allows 15%), and each strategy on costs a user something the prediction
// does not count (ZeRO-3 + bf16 is not worth 4% on a model of a million parameters); the headroom
// keeps the simpler choice from trading it for a device filled to the last GiB. -1 when none fits.
inline constexpr double kSimplerWithin = 0.10;
// Sequences of at least this many tokens get context parallelism (parallel.cp) in the search.
inline constexpr int kSearchCpFrom = 8192;
inline constexpr double kSimplerHeadroom = 0.10;
int chosen_index(const std::vector<Candidate>& all, double device_bytes);

std::string describe_search(const PlanSearch& search, const std::vector<Candidate>& all, int devices, int top,
                            bool every);
std::string search_json(const PlanSearch& search, const std::vector<Candidate>& all, int devices);
// The memo of the chosen candidate (chosen_index), written to options.memo (driver/plan/memo.cpp).
void write_memo(const PlanSearch& search, const PlanOptions& options, const std::vector<Candidate>& all);

std::string gib(double bytes);
std::string fixed(double v, int digits);

}  // namespace loom
