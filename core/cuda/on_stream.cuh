#pragma once
// The launch wrappers' shared pieces: a CUDA call checked, and `OnStream`, the `launch` callable of
// layer_kernels.cuh, topk.cuh and flash_attention.cu that runs kernel<<<grid, threads, shared,
// stream>>> with nvcc, and queues the kernel's source on the emulated device (core/cuda/emu/runtime.hpp)
// when the host compiler builds the emulated back end, libloom_cuda_emu.so.
#include <cuda_runtime.h>

#include <cstddef>
#include <stdexcept>
#include <string>

#if !defined(__CUDACC__)
#include <tuple>
#include <utility>

#include "core/cuda/emu/runtime.hpp"
#endif

namespace loom::cuda {

// Throws std::runtime_error naming `what` when err is not cudaSuccess.
inline void check_call(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("loom::cuda: ") + what + " failed: " + cudaGetErrorString(err));
}

// A kernel whose dynamic and static shared memory together pass the default 48 KiB must say so, per
// device: set before every launch with dynamic shared memory (cheap; the static part is the kernel's
// business, so it is set whatever the size), so a second device or thread needs no bookkeeping. A
// failed launch throws naming the kernel.
struct OnStream {
  cudaStream_t stream;
  template <class Kernel, class... Args>
  void operator()(const char* name, dim3 grid, unsigned threads, std::size_t shared, Kernel kernel,
                  Args... args) const {
    if (shared > 0)
      check_call(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared)),
                 (std::string("cudaFuncSetAttribute(") + name + ")").c_str());
#if defined(__CUDACC__)
    kernel<<<grid, threads, shared, stream>>>(args...);
#else
    emulated(name, grid, threads, shared, kernel, std::index_sequence_for<Args...>{}, args...);
#endif
    check_call(cudaGetLastError(), (std::string("launching ") + name).c_str());
  }
  template <class Kernel, class... Args>
  void operator()(const char* name, unsigned blocks, unsigned threads, std::size_t shared, Kernel kernel,
                  Args... args) const {
    (*this)(name, dim3(blocks), threads, shared, kernel, args...);
  }
#if !defined(__CUDACC__)
  // Queues the kernel on the emulated device, each argument as the kernel sees it there (checked now).
  template <class Kernel, class... Args, std::size_t... I>
  void emulated(const char* name, dim3 grid, unsigned threads, std::size_t shared, Kernel kernel,
                std::index_sequence<I...>, Args... args) const {
    try {
      const std::tuple<Args...> device_args{cuda_emu::rt::kernel_argument(name, static_cast<int>(I), args)...};
      cuda_emu::rt::launch(stream, name, grid, dim3(threads), shared, reinterpret_cast<const void*>(kernel),
                           [kernel, device_args] { std::apply(kernel, device_args); });
    } catch (const std::invalid_argument& e) {
      cuda_emu::rt::set_error(cudaErrorInvalidValue, std::string("launching ") + name + ": " + e.what());
    }
  }
#endif
};

}  // namespace loom::cuda
