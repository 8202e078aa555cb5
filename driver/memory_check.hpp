#pragma once
// Memory checked before the first allocation (`loom run`, `loom export`, `loom check`): the plan's
// largest rank (driver/plan/predict.hpp predict_memory, the sizing the allocators use) against what a
// rank may use here: run.memory_limit when set, else this node's memory (the least of MemTotal and the
// cgroup's limit) shared by its ranks.
#include <string>

#include "core/engine/plugin.hpp"
#include "io/deck.hpp"

namespace loom {

struct MemoryVerdict {
  bool checked = false;  // false: nothing to compare with (a GPU run without run.memory_limit)
  bool fits = true;
  double need = 0, limit = 0;  // bytes: the largest rank's peak, what a rank may use
  std::string text;            // one line: the verdict, both numbers and where the limit came from
};

// What this node gives each of its ranks: MemTotal, or the cgroup's memory.max / memory.limit_in_bytes
// where lower, divided by ranks_on_node; `source` says which.
double node_memory_per_rank(int ranks_on_node, std::string* source);

// The verdict for `deck`, its job having ranks_on_node ranks on this node. Throws InputError for a
// deck that cannot run at all (as plan_layout does).
MemoryVerdict memory_verdict(const Deck& deck, const StrategyRegistry& registry, int ranks_on_node);

// Throws InputError (exit 2) when the verdict does not fit: both numbers, the largest categories, and
// the `loom plan` command that finds a layout that fits.
void refuse_if_out_of_memory(const Deck& deck, const StrategyRegistry& registry, int ranks_on_node);

// The ranks of MPI_COMM_WORLD on this node (collective).
int ranks_on_this_node();

}  // namespace loom
