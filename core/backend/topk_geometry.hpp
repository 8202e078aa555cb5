#pragma once
// Top-k selection's geometry (core/cuda/topk.cuh): its blocks and the scratch it carves, plain C++
// (LOOM_HD functions) so that `loom plan`, which has no CUDA, sizes the CUDA back end's selection
// scratch by the same code (core/backend/workspace_plan.hpp).
#include <cstdint>

#include "core/backend/kernel_math.hpp"  // LOOM_HD

namespace loom::cuda::topk {

constexpr int kThreads = 256;
constexpr int kItems = 8;        // neighbouring elements per thread in write_kernel's chunks
constexpr int kMaxBlocks = 256;  // histograms: 2048 counts of 4 bytes per block, 2 MiB at most
constexpr int kBins = 2048;      // the widest digit's
constexpr int kDigits = 3;
LOOM_HD constexpr int digit_shift(int d) { return d == 0 ? 20 : d == 1 ? 9 : 0; }
LOOM_HD constexpr int digit_width(int d) { return d == 2 ? 9 : 11; }

// The selection's state, in scratch: the key bits found so far (then t) and how many elements with
// those bits are still to be kept (then `take`); nonfinite: how many NaN or inf x holds.
struct State {
  std::uint32_t prefix, take, nonfinite, pad;
};

// The blocks of a selection over n elements: about one per 16 chunks of kThreads * kItems elements,
// at most kMaxBlocks, at least 1.
LOOM_HD inline int grid_blocks(std::int64_t n) {
  const std::int64_t per = static_cast<std::int64_t>(kThreads) * kItems * 16;
  const std::int64_t want = (n + per - 1) / per;
  return want < 1 ? 1 : want > kMaxBlocks ? kMaxBlocks : static_cast<int>(want);
}
LOOM_HD inline std::int64_t block_span(std::int64_t n, int blocks) { return (n + blocks - 1) / blocks; }

// Scratch, carved from a base by the function that sizes it (a null base only counts, in uint32s).
struct Scratch {
  State* state;           // [1]
  std::uint32_t* hist;    // [blocks, kBins] each block's digit histogram
  std::uint32_t* counts;  // [blocks, 3] each block's elements above t, equal to t, not finite; then places
};
LOOM_HD inline std::int64_t carve(Scratch* s, std::uint32_t* base, int blocks) {
  std::int64_t at = 0;
  const auto take = [&](std::int64_t n) {
    std::uint32_t* p = base ? base + at : nullptr;
    at += (n + 3) / 4 * 4;  // 16-byte steps
    return p;
  };
  std::uint32_t* st = take(4);
  s->state = reinterpret_cast<State*>(st);
  s->hist = take(static_cast<std::int64_t>(blocks) * kBins);
  s->counts = take(static_cast<std::int64_t>(blocks) * 3);
  return at;
}
// The scratch a selection over `blocks` blocks takes, in uint32s (grid_blocks(n) for n elements).
LOOM_HD inline std::int64_t scratch_count(int blocks) {
  Scratch s;
  return carve(&s, nullptr, blocks);
}

}  // namespace loom::cuda::topk
