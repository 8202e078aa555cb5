#pragma once
// The launch wrappers' shared pieces (nvcc only): a CUDA call checked, and `OnStream`, the `launch`
// callable of layer_kernels.cuh and topk.cuh that runs kernel<<<blocks, threads, shared, stream>>>.
#include <cuda_runtime.h>

#include <cstddef>
#include <stdexcept>
#include <string>

namespace loom::cuda {

// Throws std::runtime_error naming `what` when err is not cudaSuccess.
inline void check_call(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("loom::cuda: ") + what + " failed: " + cudaGetErrorString(err));
}

// A kernel whose dynamic and static shared memory together pass the default 48 KiB must say so, per
// device: set before every launch with dynamic shared memory (cheap; the static part is the kernel's
// business, so it is set whatever the size), so a second device or thread needs no bookkeeping. A
// failed launch throws naming the kernel.
struct OnStream {
  cudaStream_t stream;
  template <class Kernel, class... Args>
  void operator()(const char* name, unsigned blocks, unsigned threads, std::size_t shared, Kernel kernel,
                  Args... args) const {
    if (shared > 0)
      check_call(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)),
                 (std::string("cudaFuncSetAttribute(") + name + ")").c_str());
    kernel<<<blocks, threads, shared, stream>>>(args...);
    check_call(cudaGetLastError(), (std::string("launching ") + name).c_str());
  }
};

}  // namespace loom::cuda
