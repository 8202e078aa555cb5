#pragma once
// The subcommands of the driver. Each returns the process exit status.
#include <string>

#include "io/deck.hpp"

namespace loom {
int command_run(const Deck& deck);                                // loom run DECK
int command_export(const Deck& deck, const std::string& out);     // loom export DECK OUT.h5
}  // namespace loom
