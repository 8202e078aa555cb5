#pragma once
// The subcommands of the driver. Each returns the process exit status.
#include <string>

#include "core/plugin.hpp"
#include "io/deck.hpp"

namespace loom {
int command_check(const Deck& deck, const StrategyRegistry& registry, int rank);                  // loom check DECK
int command_run(const Deck& deck, const StrategyRegistry& registry);                             // loom run DECK
int command_export(const Deck& deck, const StrategyRegistry& registry, const std::string& out);  // loom export DECK OUT.h5
}  // namespace loom
