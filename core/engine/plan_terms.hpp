#pragma once
// What a strategy adds to `loom plan DECK --devices N` (driver/plan/search.cpp, memo.cpp): the search
// dimensions its own keys span, the memo's sentences about them, and the levers it offers against a
// bottleneck. The planner gathers these from every registered strategy (StrategyInfo::plan) and names
// none of them, so a plugin with a key worth searching adds it here and the driver does not change.
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/comm/grid.hpp"  // Layout

namespace loom {

class Deck;

// One variant of the search, as a strategy sees it.
struct PlanPoint {
  Layout layout;
  int micro = 1;                                // micro-batches
  std::map<std::string, std::string> settings;  // deck key -> value: every search dimension's that applies
  const Deck* deck = nullptr;                   // the deck the search starts from (with the user's --set)
  // The memo's points only: the products' operand type the prediction found (fp32, bf16, fp16).
  std::string precision;
  std::string setting(const std::string& key) const {
    const auto it = settings.find(key);
    return it == settings.end() ? std::string() : it->second;
  }
};

// One deck key the layout search varies (zero.stage, precision.dtype, ...).
struct PlanDimension {
  enum class Json { integer, boolean, text };
  PlanDimension() = default;
  // Where it shows, in one call (its behaviour, values to what_if, is set after):
  //   PlanDimension d("zero.stage", "ZeRO stage", "zero", 5, "zero_stage", PlanDimension::Json::integer, "", 20, 20);
  PlanDimension(std::string key_, std::string what_, std::string column_, int width_, std::string json_,
                Json json_type_, std::string unset_, int nest_, int column_order_)
      : key(std::move(key_)),
        what(std::move(what_)),
        column(std::move(column_)),
        width(width_),
        json(std::move(json_)),
        json_type(json_type_),
        unset(std::move(unset_)),
        nest(nest_),
        column_order(column_order_) {}
  std::string key;     // the deck key it sets
  std::string what;    // its words in the search's first line ("ZeRO stage")
  std::string column;  // its heading in the candidate table ("zero")
  int width = 5;       // that column's width
  std::string json;    // its field in `loom plan --json` ("zero_stage")
  Json json_type = Json::text;
  std::string unset;      // the --json value where it does not apply (no setting at this layout)
  int nest = 50;          // its place in the search's loops (outer first) and in a variant's --set list
  int column_order = 50;  // its place in the table, a variant's description and the memo's what-ifs
  // It sets the products' operand type: the memo's mixed-precision section compares its what-if.
  bool sets_precision = false;
  // The values worth searching at `p`'s layout, the plain one-device choice first; none: the deck's own stays.
  std::function<std::vector<std::string>(const PlanPoint& p)> values;
  // Optional: the value that needs least memory on one device (the memo's lean baseline).
  std::function<std::string(const PlanPoint& p)> lean;
  // How a value reads in a variant's description ("ZeRO 1"); empty says nothing.
  std::function<std::string(const std::string& value)> describe;
  // The memo's "what each choice buys" rows from the chosen `p`: each row's words and the value tried.
  std::function<std::vector<std::pair<std::string, std::string>>(const PlanPoint& p)> what_if;
};

// Something to try against a bottleneck, as deck overrides.
struct PlanLever {
  std::string what;               // the memo's words for it
  std::vector<std::string> sets;  // "key=value" overrides
};

struct PlanTerms {
  std::vector<PlanDimension> dimensions;
  // Optional: the memo's sentences about the chosen `p` on `topic`, empty when it has none:
  //   "split"              a bullet of "What the chosen layout splits"
  //   "dp_sync"            how the data-parallel replicas' gradients are summed (default: all-reduced)
  //   "schedule"           the pipeline schedule's name; "schedule_note" what it does to a stage's memory
  //   "precision_stays"    a bullet of what stays fp32 under mixed precision
  //   "precision_scaling"  whether 16-bit gradients need loss scaling (p.precision: the 16-bit type)
  std::function<std::string(const std::string& topic, const PlanPoint& p)> memo;
  // Optional: levers against the bottleneck the memo found: "bubble" (the pipeline's), "optimizer"
  // (the replicated optimizer step), "dp" (the data-parallel gradient synchronisation).
  std::function<std::vector<PlanLever>(const std::string& bottleneck, const PlanPoint& p)> levers;
};

}  // namespace loom
