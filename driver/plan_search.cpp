// `loom plan DECK`: the deck's own layout (driver/plan_predict.hpp), or with --devices N the search
// over the layouts of N devices, and --memo the memo for the one chosen.
#include <mpi.h>

#include <iostream>

#include "core/error.hpp"
#include "driver/commands.hpp"
#include "driver/plan_predict.hpp"

namespace loom {

int command_plan_deck(const PlanOptions& o, const StrategyRegistry& registry, const DeckSchema& schema,
                      const ClusterSpec& cluster) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (o.devices > 0 || !o.memo.empty())
    throw InputError("loom plan: --devices and --memo (the layout search and the memo) are not built yet; "
                     "loom plan DECK [--json] predicts the deck's own layout");
  if (rank != 0) return 0;  // a plan is one process's arithmetic
  const Deck deck = Deck::load(schema, o.deck, o.sets);
  const Prediction p = predict(deck, registry, cluster);
  if (o.json)
    std::cout << prediction_json(p, cluster);
  else
    std::cout << describe_prediction(p, cluster);
  return 0;
}

}  // namespace loom
