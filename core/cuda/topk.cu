// Launch wrappers of the top-k selection (core/cuda/topk.cuh) and its scatters, declared with their
// contracts in core/cuda/kernels.cuh.
#include "core/cuda/topk.cuh"

#include <stdexcept>
#include <string>

#include "core/cuda/kernels.cuh"

namespace loom::cuda {
namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("loom::cuda: ") + what + " failed: " + cudaGetErrorString(err));
}

// x[index[j]] += value[j] (distinct indices: no two threads meet), or = 0 where value is null.
__global__ void topk_scatter_kernel(float* x,                  // [n]
                                    const std::int32_t* index, // [k]
                                    const float* value,        // [k] or null
                                    std::int64_t k) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < k; j += stride) {
    if (value)
      x[index[j]] += value[j];
    else
      x[index[j]] = 0.0f;
  }
}

void scatter(float* x, const std::int32_t* index, const float* value, std::int64_t k, cudaStream_t stream) {
  if (k <= 0) return;
  const LaunchGeometry g = elementwise_geometry(k, topk::kThreads);
  topk_scatter_kernel<<<g.blocks, g.threads, 0, stream>>>(x, index, value, k);
  check(cudaGetLastError(), "launching topk_scatter_kernel");
}

}  // namespace

std::int64_t topk_scratch_count(std::int64_t n) { return topk::scratch_count(topk::grid_blocks(n)); }

void topk_select(std::int32_t* index, float* value, const float* x, std::int64_t n, std::int64_t k,
                 std::uint32_t* scratch, cudaStream_t stream) {
  if (k <= 0 || n <= 0) return;
  if (k > n || n > 0x7fffffff) throw std::invalid_argument("topk_select: k = " + std::to_string(k) + " of n = " + std::to_string(n));
  const auto launch = [stream](const char* name, int blocks, int threads, std::size_t shared, auto kernel, auto... args) {
    kernel<<<blocks, threads, shared, stream>>>(args...);
    check(cudaGetLastError(), (std::string("launching ") + name).c_str());
  };
  topk::select(launch, index, value, x, n, k, scratch, topk::grid_blocks(n));
}

void topk_scatter_add(float* x, const std::int32_t* index, const float* value, std::int64_t k, cudaStream_t stream) {
  scatter(x, index, value, k, stream);
}

void topk_clear(float* x, const std::int32_t* index, std::int64_t k, cudaStream_t stream) {
  scatter(x, index, nullptr, k, stream);
}

}  // namespace loom::cuda
