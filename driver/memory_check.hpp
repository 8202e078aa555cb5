#pragma once
// Memory checked before the first allocation (`loom run`, `loom export`, `loom check`): the plan's
// prediction (driver/plan/predict.hpp predict_memory, the sizing the allocators use) of the ranks
// placed on this node against what they may use here: run.memory_limit per rank when set, else this
// node's memory (the least of MemTotal and the cgroup's limits), shared by them. A cuda run without
// run.memory_limit is checked as soon as each rank has opened its device, before the first allocation:
// the ranks on a device against its free memory (device_memory_verdict).
#include <string>
#include <vector>

#include "core/engine/plugin.hpp"
#include "io/deck.hpp"

namespace loom {

struct MemoryVerdict {
  bool checked = false;  // false: nothing to compare with (a GPU run without run.memory_limit)
  bool fits = true;
  double need = 0, limit = 0;  // bytes: what the node's ranks (or, with run.memory_limit, the largest) need, have
  double per_rank = 0;         // bytes one rank may use: loom plan's device memory for a layout that fits
  std::string text;            // one line: the verdict, both numbers and where the limit came from
};

// /proc/meminfo's MemTotal in bytes (0 when unreadable).
double meminfo_total();

// This node's memory: MemTotal, or the least cgroup limit above this process where lower; `source` says
// which.
double node_memory(std::string* source);

// The verdict for `deck` with the job's ranks `node_ranks` (world ranks, ascending) on this node.
// Throws InputError for a deck that cannot run at all (as plan_layout does).
MemoryVerdict memory_verdict(const Deck& deck, const StrategyRegistry& registry, const std::vector<int>& node_ranks);

// Throws InputError (exit 2) for a verdict that does not fit: both numbers, the largest categories,
// and the `loom plan` command that searches for a layout that fits.
void throw_if_out_of_memory(const Deck& deck, const StrategyRegistry& registry, const MemoryVerdict& verdict);

// The world ranks on this node, ascending (collective over MPI_COMM_WORLD).
std::vector<int> ranks_on_this_node();
// The world ranks of this node on CUDA device `device` (this rank's), ascending (collective).
std::vector<int> ranks_on_device(int device);
// The predicted peak of `device_ranks` (those on this rank's device, `device` of `free` free bytes out
// of `total`) against its free memory.
MemoryVerdict device_memory_verdict(const Deck& deck, const StrategyRegistry& registry, int device, double free,
                                    double total, const std::vector<int>& device_ranks);

}  // namespace loom
