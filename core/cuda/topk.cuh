#pragma once
// Top-k selection for gradient compression (Backend::topk_select; plugins/compression): the k
// elements of x [n] with the largest |x|, ties to the lower index, written in ascending index order,
// the set core/backend/kernels.hpp's topk_select gives. A run repeats bit for bit and equals the host's.
//
// Exact radix selection on the magnitudes' bits (non-negative floats order as their bit patterns,
// as the host compares them; a NaN's bits order above inf's, but a NaN or inf poisons the output
// anyway, below): three digit passes, of bits [20, 31), [9, 20) and [0, 9), each a
// histogram per block of the elements that share the digits found so far (histogram_kernel) and one
// block that sums them and finds the digit of the k-th largest key (pick_digit_kernel). That leaves
// the k-th largest key t and `take`, how many of the elements equal to t are kept (the first ones;
// every element above t is kept). Then each block counts its elements above t and equal to t
// (count_kernel), one block turns the counts into each block's place (offsets_kernel), and each
// block writes its kept elements in index order (write_kernel): no sort, and the only atomics are
// integer counts in a block's shared memory, whose sum does not depend on their order. Where x holds
// a NaN or an inf, poison_kernel writes index j = j and value NaN, as the host does.
//
// Work split: a grid of `blocks` blocks of kThreads threads; block b takes the contiguous range
// [b span, (b + 1) span) of x (span = ceil(n / blocks)): the histogram and count kernels walk it
// with a stride of kThreads, the write kernel in chunks of kThreads * kItems, each thread kItems
// neighbouring elements (so that one scan per chunk orders its places). The scratch (per-block histograms and counts,
// the selection's state) is carved by the function that sizes it.
//
// The source compiles for the GPU (nvcc) and for the host against core/cuda/emu/ (a unit test runs
// these very kernels on the CPU); device facilities through core/cuda/device_portable.hpp.
#include <cstddef>
#include <cstdint>

#include "core/cuda/device_portable.hpp"
#include "core/backend/topk_geometry.hpp"
#include "core/backend/kernel_math.hpp"

namespace loom::cuda::topk {

// The selection's geometry and scratch layout (constants, State, grid_blocks, carve, scratch_count):
// core/backend/topk_geometry.hpp, plain C++ that `loom plan` sizes the scratch with too.

// |x|'s bits: the order of magnitudes (0 and -0 alike; NaN above inf).
LOOM_HD inline std::uint32_t magnitude_key(float x) { return math::float_bits(x) & 0x7fffffffu; }

// Exclusive prefix sums of N values per thread over the block (Hillis-Steele through `s` [N,
// block_dim] shared), in thread order: v[i] becomes the sum of the threads before this one, total[i]
// the block's. Every thread calls it; N sums share the barriers.
template <int N>
LOOM_DEVICE void block_exclusive_scan(std::uint32_t (&v)[N], std::uint32_t* s, std::uint32_t (&total)[N]) {
  const int t = dev::thread_x(), n = dev::block_dim_x();
  for (int i = 0; i < N; ++i) s[i * n + t] = v[i];
  dev::sync_block();
  for (int d = 1; d < n; d <<= 1) {
    std::uint32_t add[N];
    for (int i = 0; i < N; ++i) add[i] = t >= d ? s[i * n + t - d] : 0u;
    dev::sync_block();
    for (int i = 0; i < N; ++i) s[i * n + t] += add[i];
    dev::sync_block();
  }
  for (int i = 0; i < N; ++i) {
    const std::uint32_t inclusive = s[i * n + t];
    total[i] = s[i * n + n - 1];
    v[i] = inclusive - v[i];
  }
  dev::sync_block();  // s may be written again
}

// Shared memory of histogram_kernel: kBins counts.
constexpr std::size_t kHistogramShared = kBins * sizeof(std::uint32_t);

// Block b's histogram of digit d over the elements of its range whose higher digits are the prefix
// found so far (all of them at d = 0).
LOOM_KERNEL void histogram_kernel(std::uint32_t* hist,  // [blocks, kBins]
                                  const float* x,       // [n]
                                  std::int64_t n, int d, const State* state) {
  std::uint32_t* h = dev::shared_memory<std::uint32_t>();  // [kBins]
  const int t = dev::thread_x(), b = dev::block_x();
  const int shift = digit_shift(d), bins = 1 << digit_width(d);
  const std::uint32_t high = d == 0 ? 0u : 0x7fffffffu & ~((1u << (shift + digit_width(d))) - 1u);
  const std::uint32_t prefix = d == 0 ? 0u : state->prefix;
  for (int i = t; i < bins; i += kThreads) h[i] = 0;
  dev::sync_block();
  const std::int64_t span = block_span(n, dev::grid_x()), begin = b * span, end = begin + span < n ? begin + span : n;
  for (std::int64_t i = begin + t; i < end; i += kThreads) {
    const std::uint32_t key = magnitude_key(x[i]);
    if ((key & high) == prefix) dev::atomic_add_shared(&h[(key >> shift) & static_cast<std::uint32_t>(bins - 1)], 1u);
  }
  dev::sync_block();
  for (int i = t; i < bins; i += kThreads) hist[static_cast<std::int64_t>(b) * kBins + i] = h[i];
}

// Shared memory of pick_digit_kernel: a scan's kThreads values.
constexpr std::size_t kPickShared = kThreads * sizeof(std::uint32_t);

// One block of kThreads: the digit d of the k-th largest key among those with the prefix (the bin,
// from the top, where the running count reaches `take`), added to the prefix; `take` becomes how
// many of that bin's elements are still to be kept. At d = 0 the state starts as (0, k).
LOOM_KERNEL void pick_digit_kernel(State* state, const std::uint32_t* hist,  // [1], [blocks, kBins]
                                   int blocks, int d, std::int64_t k) {
  std::uint32_t* s = dev::shared_memory<std::uint32_t>();  // [kThreads]
  const int t = dev::thread_x(), shift = digit_shift(d), bins = 1 << digit_width(d);
  const int per = bins / kThreads;  // bins per thread: 8 or 2, thread t taking them from the top
  const int top = bins - t * per;   // thread t's bins are [top - per, top)
  const std::uint32_t take = d == 0 ? static_cast<std::uint32_t>(k) : state->take;
  const std::uint32_t prefix = d == 0 ? 0u : state->prefix;
  std::uint32_t own = 0;
  for (int i = top - per; i < top; ++i)
    for (int b = 0; b < blocks; ++b) own += hist[static_cast<std::int64_t>(b) * kBins + i];
  std::uint32_t above[1] = {own}, total[1];
  block_exclusive_scan(above, s, total);            // elements in the bins above thread t's
  if (above[0] < take && take <= above[0] + own) {  // the k-th largest is in one of this thread's bins
    std::uint32_t seen = above[0];
    for (int i = top - 1; i >= top - per; --i) {
      std::uint32_t c = 0;
      for (int b = 0; b < blocks; ++b) c += hist[static_cast<std::int64_t>(b) * kBins + i];
      if (seen + c >= take) {
        state->prefix = prefix | (static_cast<std::uint32_t>(i) << shift);
        state->take = take - seen;
        break;
      }
      seen += c;
    }
  }
}

// Shared memory of count_kernel: a scan's 3 kThreads values.
constexpr std::size_t kCountShared = 3 * kThreads * sizeof(std::uint32_t);

// Block b's elements with a key above t, equal to t, and not finite: counts[b, 0..2].
LOOM_KERNEL void count_kernel(std::uint32_t* counts,  // [blocks, 3]
                              const float* x,         // [n]
                              std::int64_t n, const State* state) {
  std::uint32_t* s = dev::shared_memory<std::uint32_t>();  // [3, kThreads]
  const int t = dev::thread_x(), b = dev::block_x();
  const std::uint32_t key_t = state->prefix;
  const std::int64_t span = block_span(n, dev::grid_x()), begin = b * span, end = begin + span < n ? begin + span : n;
  std::uint32_t own[3] = {0, 0, 0}, sum[3];  // above t, equal to t, not finite
  for (std::int64_t i = begin + t; i < end; i += kThreads) {
    const std::uint32_t key = magnitude_key(x[i]);
    own[0] += key > key_t;
    own[1] += key == key_t;
    own[2] += !math::finite_k(x[i]);
  }
  block_exclusive_scan(own, s, sum);
  if (t == 0)
    for (int c = 0; c < 3; ++c) counts[3 * b + c] = sum[c];
}

// Shared memory of offsets_kernel: a scan's 3 kThreads values.
constexpr std::size_t kOffsetsShared = 3 * kThreads * sizeof(std::uint32_t);

// One block of kThreads: counts[b, 0..1] become the elements above t and equal to t in the blocks
// before b (exclusive prefix sums, in block order); state->nonfinite the sum of counts[., 2].
LOOM_KERNEL void offsets_kernel(State* state, std::uint32_t* counts, int blocks) {  // [1], [blocks, 3]
  std::uint32_t* s = dev::shared_memory<std::uint32_t>();                           // [3, kThreads]
  const int t = dev::thread_x();
  const int per = (blocks + kThreads - 1) / kThreads;  // blocks per thread, neighbouring
  const int first = t * per, last = first + per < blocks ? first + per : blocks;
  std::uint32_t before[3] = {0, 0, 0}, total[3];
  for (int b = first; b < last; ++b)
    for (int c = 0; c < 3; ++c) before[c] += counts[3 * b + c];
  block_exclusive_scan(before, s, total);
  if (t == 0) state->nonfinite = total[2];
  for (int b = first; b < last; ++b)
    for (int c = 0; c < 2; ++c) {
      const std::uint32_t mine = counts[3 * b + c];
      counts[3 * b + c] = before[c];
      before[c] += mine;
    }
}

// Shared memory of write_kernel: a scan's kThreads values.
constexpr std::size_t kWriteShared = kThreads * sizeof(std::uint32_t);

// Block b writes its kept elements: an element above t goes to place (elements above t before it) +
// min(elements equal to t before it, take); one equal to t is kept while fewer than `take` came
// before it, at (above before it) + (equal before it). Above-and-equal counts travel packed in one
// scan (each under 2^16 per chunk).
LOOM_KERNEL void write_kernel(std::int32_t* index, float* value,  // [k], [k]
                              const float* x,                     // [n]
                              std::int64_t n, const State* state, const std::uint32_t* counts) {
  static_assert(kThreads * kItems < (1 << 16), "a chunk's counts are packed in 16 bits each");
  std::uint32_t* s = dev::shared_memory<std::uint32_t>();  // [kThreads]
  const int t = dev::thread_x(), b = dev::block_x();
  const std::uint32_t key_t = state->prefix, take = state->take;
  const std::int64_t span = block_span(n, dev::grid_x()), begin = b * span, end = begin + span < n ? begin + span : n;
  std::uint32_t above0 = counts[3 * b], equal0 = counts[3 * b + 1];  // before this chunk
  for (std::int64_t chunk = begin; chunk < end; chunk += static_cast<std::int64_t>(kThreads) * kItems) {
    const std::int64_t first = chunk + static_cast<std::int64_t>(t) * kItems;
    std::int64_t last = first + kItems < end ? first + kItems : end;
    if (last < first) last = first;
    std::uint32_t before[1] = {0}, total[1];
    for (std::int64_t i = first; i < last; ++i) {
      const std::uint32_t key = magnitude_key(x[i]);
      before[0] += key > key_t ? 1u : key == key_t ? (1u << 16) : 0u;
    }
    block_exclusive_scan(before, s, total);
    std::uint32_t above = above0 + (before[0] & 0xffffu), equal = equal0 + (before[0] >> 16);
    for (std::int64_t i = first; i < last; ++i) {
      const float v = x[i];
      const std::uint32_t key = magnitude_key(v);
      if (key > key_t) {
        const std::uint32_t at = above + (equal < take ? equal : take);
        index[at] = static_cast<std::int32_t>(i);
        value[at] = v;
        ++above;
      } else if (key == key_t) {
        if (equal < take) {
          index[above + equal] = static_cast<std::int32_t>(i);
          value[above + equal] = v;
        }
        ++equal;
      }
    }
    above0 += total[0] & 0xffffu;
    equal0 += total[0] >> 16;
  }
}

// Where x held a NaN or an inf: index[j] = j, value[j] = NaN (every rank's sum is then non-finite).
LOOM_KERNEL void poison_kernel(std::int32_t* index, float* value, std::int64_t k, const State* state) {  // [k], [k]
  if (state->nonfinite == 0) return;
  const std::int64_t stride = static_cast<std::int64_t>(dev::grid_x()) * dev::block_dim_x();
  for (std::int64_t j = static_cast<std::int64_t>(dev::block_x()) * dev::block_dim_x() + dev::thread_x(); j < k;
       j += stride) {
    index[j] = static_cast<std::int32_t>(j);
    value[j] = math::bits_as_float(0x7fc00000u);  // quiet NaN
  }
}

// The selection's launches in order, through `launch(name, blocks, threads, shared_bytes, kernel, args...)`
// (a CUDA launch on a stream, or the emulator's). 0 < k <= n < 2^31; `blocks` from 1 to kMaxBlocks
// (grid_blocks(n) on a device; a test takes others) and scratch of scratch_count(blocks).
template <class Launch>
void select(Launch&& launch, std::int32_t* index, float* value, const float* x, std::int64_t n, std::int64_t k,
            std::uint32_t* scratch, int blocks) {
  Scratch s;
  carve(&s, scratch, blocks);
  for (int d = 0; d < kDigits; ++d) {
    launch("topk histogram_kernel", blocks, kThreads, kHistogramShared, histogram_kernel, s.hist, x, n, d,
           static_cast<const State*>(s.state));
    launch("topk pick_digit_kernel", 1, kThreads, kPickShared, pick_digit_kernel, s.state,
           static_cast<const std::uint32_t*>(s.hist), blocks, d, k);
  }
  launch("topk count_kernel", blocks, kThreads, kCountShared, count_kernel, s.counts, x, n,
         static_cast<const State*>(s.state));
  launch("topk offsets_kernel", 1, kThreads, kOffsetsShared, offsets_kernel, s.state, s.counts, blocks);
  launch("topk write_kernel", blocks, kThreads, kWriteShared, write_kernel, index, value, x, n,
         static_cast<const State*>(s.state), static_cast<const std::uint32_t*>(s.counts));
  const std::int64_t poison_blocks = (k + kThreads - 1) / kThreads;
  launch("topk poison_kernel", static_cast<int>(poison_blocks < 1024 ? poison_blocks : 1024), kThreads, 0,
         poison_kernel, index, value, k, static_cast<const State*>(s.state));
}

// x[index[j]] += value[j] (distinct indices: no two threads meet), or = 0 where value is null: the
// compressing reducer's sum of the all-gathered pairs, rank by rank (topk_scatter_add), and error
// feedback's clearing of what was sent (topk_clear).
LOOM_KERNEL void scatter_kernel(float* x,                   // [n]
                                const std::int32_t* index,  // [k]
                                const float* value,         // [k] or null
                                std::int64_t k) {
  const std::int64_t stride = static_cast<std::int64_t>(dev::grid_x()) * dev::block_dim_x();
  for (std::int64_t j = static_cast<std::int64_t>(dev::block_x()) * dev::block_dim_x() + dev::thread_x(); j < k;
       j += stride) {
    if (value)
      x[index[j]] += value[j];
    else
      x[index[j]] = 0.0f;
  }
}

template <class Launch>
void scatter(Launch&& launch, float* x, const std::int32_t* index, const float* value, std::int64_t k) {
  if (k <= 0) return;
  const std::int64_t blocks = (k + kThreads - 1) / kThreads;
  launch("topk scatter_kernel", static_cast<int>(blocks < 65535 * 4 ? blocks : 65535 * 4), kThreads, 0, scatter_kernel,
         x, index, value, k);
}

}  // namespace loom::cuda::topk
