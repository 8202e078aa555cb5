#pragma once
// What the engine and store tests share: a fixed pseudo-random batch per (step, first row), tokens and
// targets uniform over the vocabulary.
#include <cstdint>
#include <random>
#include <vector>

#include "core/engine/engine.hpp"
#include "core/model/gpt.hpp"

namespace loom::testing {

inline BatchFn random_batches(const GPTConfig& c) {
  return [c](std::int64_t step, std::int64_t first_row, int rows, std::vector<std::int32_t>& in,
             std::vector<std::int32_t>& tgt) {
    std::mt19937_64 gen(static_cast<std::uint64_t>(step * 1000 + first_row));
    std::uniform_int_distribution<int> d(0, c.vocab - 1);
    in.resize(static_cast<std::size_t>(rows) * c.seq_len);
    tgt.resize(in.size());
    for (auto& x : in) x = d(gen);
    for (auto& x : tgt) x = d(gen);
  };
}

}  // namespace loom::testing
