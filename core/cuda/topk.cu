// Launch wrappers of the top-k selection (core/cuda/topk.cuh) and its scatters, declared with their
// contracts in core/cuda/kernels.cuh.
#include "core/cuda/topk.cuh"

#include <stdexcept>
#include <string>

#include "core/cuda/kernels.cuh"
#include "core/cuda/on_stream.cuh"

namespace loom::cuda {

std::int64_t topk_scratch_count(std::int64_t n) { return topk::scratch_count(topk::grid_blocks(n)); }

void topk_select(std::int32_t* index, float* value, const float* x, std::int64_t n, std::int64_t k,
                 std::uint32_t* scratch, cudaStream_t stream) {
  if (k <= 0 || n <= 0) return;
  if (k > n || n > 0x7fffffff)
    throw std::invalid_argument("topk_select: k = " + std::to_string(k) + " of n = " + std::to_string(n));
  topk::select(OnStream{stream}, index, value, x, n, k, scratch, topk::grid_blocks(n));
}

void topk_scatter_add(float* x, const std::int32_t* index, const float* value, std::int64_t k, cudaStream_t stream) {
  topk::scatter(OnStream{stream}, x, index, value, k);
}

void topk_clear(float* x, const std::int32_t* index, std::int64_t k, cudaStream_t stream) {
  topk::scatter(OnStream{stream}, x, index, static_cast<const float*>(nullptr), k);
}

}  // namespace loom::cuda
