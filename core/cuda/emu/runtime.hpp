#pragma once
// The emulated device behind core/cuda/emu/include/ (cuda_runtime.h, cublasLt.h): what the stand-in
// runtime and cuBLASLt share, and what the launch wrappers (core/cuda/on_stream.cuh) call in an
// emulated build.
//
// Device memory is host memory at addresses moved by 2^47, out of the process's address space (as
// run.backend = fenced's): host code that dereferences a device pointer crashes, as on a GPU. Every
// allocation is recorded, so a kernel argument, a copy or a matrix operand is checked to lie inside
// a live allocation (a host pointer handed to a kernel, a freed buffer, a product that reads past
// its operand: each an error naming it).
//
// Work is asynchronous as on the device: a launch, fill, product or device-to-device copy is queued
// on its stream and runs when the host waits (a stream or event synchronised, an event queried),
// every stream then advancing as far as it can, as a GPU's streams do on their own: in issue order
// each, an item blocked (a cudaStreamWaitEvent not yet reached, an NCCL operation whose peers have
// not joined) holding up only its own stream. Copies with pageable host memory (loom has no pinned
// buffers) behave as the runtime's: to the device, the source is staged before the call returns;
// to the host, the call returns once the copy and its stream's work before it are done. A failed
// kernel makes the error sticky, as a GPU's launch failure: every later call that waits returns
// cudaErrorLaunchFailure, and the cause is printed to stderr; so does a wait that sees nothing move
// for LOOM_CUDA_EMU_WAIT_TIMEOUT seconds (default 300), naming what each stream is blocked on.
// Unlike a GPU's, the streams move only inside runtime calls: an NCCL operation queued behind work
// is posted when the host next waits or queries, not while it sits in a host MPI call.
#include <cuda_runtime.h>

#include <cstddef>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>

namespace loom::cuda_emu::rt {

// The host address of device address p, checked to lie in a live allocation with `bytes` from it
// (bytes 0: p may be the allocation's end); throws std::invalid_argument naming `what` otherwise.
void* host_address(const void* p, std::size_t bytes, const std::string& what);
bool is_device_address(const void* p);

// Queues `work` on stream s (null: the default stream); throws nothing.
void enqueue(cudaStream_t s, const char* what, std::function<void()> work);
// Queues a step that may block: step() is called as the streams advance, until it returns true.
void enqueue_step(cudaStream_t s, const char* what, std::function<bool()> step);
// Sets the calling thread's last error (cudaGetLastError), printing `why` to stderr.
void set_error(cudaError_t e, const std::string& why);

// A kernel launch: checks the grid against the device's limits and the dynamic shared memory
// against the kernel's opt-in (cudaFuncSetAttribute beyond 48 KiB), then queues body.
void launch(cudaStream_t s, const char* name, dim3 grid, dim3 block, std::size_t shared, const void* kernel,
            std::function<void()> body);

// An argument passed by value that holds device pointers (a table of tensors) says so with
// `template <class F> void for_each_device_pointer(F f)`, calling f(p) on each pointer p by reference.
template <class T, class = void>
struct holds_device_pointers : std::false_type {};
template <class T>
struct holds_device_pointers<
    T, std::void_t<decltype(std::declval<T&>().for_each_device_pointer(std::declval<void (*)(const void*&)>()))>>
    : std::true_type {};

// A kernel's argument as the emulated kernel sees it: a device pointer becomes its host address (so
// do those of an argument that holds device pointers); a non-null host pointer is an error (a GPU
// kernel cannot read host memory); other values pass.
template <class T>
T kernel_argument(const char* kernel, int index, T v) {
  if constexpr (holds_device_pointers<T>::value) {
    int k = 0;
    v.for_each_device_pointer([&](const void*& p) {
      if (p != nullptr)
        p = host_address(
            p, 0, std::string(kernel) + "'s argument " + std::to_string(index) + ", pointer " + std::to_string(k));
      ++k;
    });
    return v;
  } else if constexpr (std::is_pointer_v<T>) {
    if (v == nullptr) return v;
    using Pointee = std::remove_cv_t<std::remove_pointer_t<T>>;
    void* h = host_address(v, 0, std::string(kernel) + "'s argument " + std::to_string(index));
    return static_cast<T>(static_cast<Pointee*>(h));
  } else {
    return v;
  }
}

}  // namespace loom::cuda_emu::rt
