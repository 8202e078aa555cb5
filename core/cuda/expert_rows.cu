// Launch wrappers of mixture of experts' row operations (core/cuda/expert_rows.cuh), declared with their
// contracts in core/cuda/kernels.cuh.
#include "core/cuda/expert_rows.cuh"

#include <cstdint>
#include <stdexcept>
#include <string>

#include "core/cuda/kernels.cuh"
#include "core/cuda/on_stream.cuh"

namespace loom::cuda {

void rows_gather(void* out, const void* x, DType type, const std::int32_t* rows, const float* scale, int n, int C,
                 cudaStream_t stream) {
  const OnStream launch{stream};
  switch (type) {
    case DType::f32:
      experts::rows_gather(launch, static_cast<float*>(out), static_cast<const float*>(x), rows, scale, n, C);
      return;
    case DType::f64:
      experts::rows_gather(launch, static_cast<double*>(out), static_cast<const double*>(x), rows, scale, n, C);
      return;
    case DType::bf16:
    case DType::f16:  // a copy of the 16 bits
      experts::rows_gather(launch, static_cast<std::uint16_t*>(out), static_cast<const std::uint16_t*>(x), rows, scale,
                           n, C);
      return;
    default:
      throw std::invalid_argument(std::string("rows_gather: element type ") + dtype_name(type) +
                                  " is not fp32, fp64, bf16 or fp16");
  }
}

void rows_scatter_add(float* out, const float* y, const std::int32_t* rows, const float* scale, int n, int C,
                      cudaStream_t stream) {
  experts::rows_scatter_add(OnStream{stream}, out, y, rows, scale, n, C);
}

void rows_dot(float* out, const float* x, const std::int32_t* rows, const float* y, int n, int C, cudaStream_t stream) {
  experts::rows_dot(OnStream{stream}, out, x, rows, y, n, C);
}

}  // namespace loom::cuda
