#pragma once
// The layout against the job and the model, before any work: the grid (core/comm/grid.hpp) knows
// ranks, not models, so what a layout must divide in the model is checked here.
#include "core/comm/grid.hpp"
#include "core/model/gpt.hpp"

namespace loom {

// Throws InputError naming the deck keys and the values that would work.
// parallel.cp against the model alone: seq_len splits into 2 x cp chunks; an attention that can ring.
void check_context_layout(const Layout& layout, const GPTConfig& model);
void check_layout(const Layout& layout, int world_size, const GPTConfig& model, int batch, int micro_batches);

}  // namespace loom
