// The emulated device's runtime and cuBLASLt themselves (core/cuda/emu/runtime.cpp, cublaslt.cpp):
// the stream and event semantics the back end relies on, and the refusals that stand for a GPU's
// faults. Linked with libloom_cuda_emu.so, built against core/cuda/emu/include.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "core/cuda/device_portable.hpp"
#include "core/cuda/emu/runtime.hpp"
#include "core/cuda/on_stream.cuh"

namespace {

LOOM_KERNEL void write_kernel(float* out, float value) { out[loom::dev::thread_x()] = value; }
LOOM_KERNEL void never_opted_in_kernel() {}

struct Streams {
  cudaStream_t a = nullptr, b = nullptr;
  Streams() {
    cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking);
  }
  ~Streams() {
    cudaStreamDestroy(a);
    cudaStreamDestroy(b);
  }
};

// A stream told to wait for an event waits for the record it was given, even when the event is
// recorded again before that record is reached (comm_nccl.cpp records its ready event once per
// operation: a later record must not release an earlier wait).
TEST(EmulatedRuntime, AStreamWaitsForTheRecordItWasGiven) {
  Streams s;
  bool open = false;
  loom::cuda_emu::rt::enqueue_step(s.a, "a gate", [&open] { return open; });
  cudaEvent_t ready, after;
  ASSERT_EQ(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&after, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(ready, s.a), cudaSuccess);  // behind the gate
  ASSERT_EQ(cudaStreamWaitEvent(s.b, ready, 0), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(ready, s.a), cudaSuccess);  // recorded again, still behind the gate
  ASSERT_EQ(cudaEventRecord(after, s.b), cudaSuccess);
  EXPECT_EQ(cudaEventQuery(after), cudaErrorNotReady) << "stream b went past its wait while a is blocked";
  EXPECT_EQ(cudaEventQuery(ready), cudaErrorNotReady);
  open = true;
  EXPECT_EQ(cudaEventQuery(after), cudaSuccess) << "once a moves, b follows";
  EXPECT_EQ(cudaEventQuery(ready), cudaSuccess);
  cudaEventDestroy(ready);
  cudaEventDestroy(after);
}

// Work is queued, not run at the call; a copy into pageable host memory returns once its stream's
// work before it is done, as the runtime's.
TEST(EmulatedRuntime, WorkRunsWhenTheHostWaits) {
  Streams s;
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d), 32 * sizeof(float)), cudaSuccess);
  loom::cuda::OnStream{s.a}("write_kernel", 1u, 32u, 0, write_kernel, d, 2.5f);
  std::vector<float> h(32, 0.0f);
  ASSERT_EQ(cudaMemcpyAsync(h.data(), d, 32 * sizeof(float), cudaMemcpyDeviceToHost, s.a), cudaSuccess);
  EXPECT_EQ(h, std::vector<float>(32, 2.5f));
  cudaFree(d);
}

// What a GPU faults on, refused with an error naming it.
TEST(EmulatedRuntime, RefusesWhatAGpuFaultsOn) {
  Streams s;
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d), 64 * sizeof(float)), cudaSuccess);
  std::vector<float> h(32);
  EXPECT_THROW(loom::cuda::OnStream{s.a}("write_kernel", 1u, 32u, 0, write_kernel, h.data(), 1.0f), std::runtime_error)
      << "a host pointer as a kernel argument";
  loom::cuda_emu::rt::launch(s.a, "never_opted_in_kernel", dim3(1), dim3(32), 64 * 1024,
                             reinterpret_cast<const void*>(&never_opted_in_kernel), [] { never_opted_in_kernel(); });
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue) << "64 KiB of dynamic shared memory without the opt-in";
  cudaStreamSynchronize(s.a);
  EXPECT_EQ(cudaMemcpyAsync(d + 8, d, 32 * sizeof(float), cudaMemcpyDeviceToDevice, s.a), cudaErrorInvalidValue)
      << "overlapping device ranges";
  cudaGetLastError();
  EXPECT_EQ(cudaMemcpyAsync(d, h.data(), 128 * sizeof(float), cudaMemcpyHostToDevice, s.a), cudaErrorInvalidValue)
      << "a copy past the allocation's end";
  cudaGetLastError();
  EXPECT_EQ(cudaMemcpyAsync(h.data(), d, 32 * sizeof(float), cudaMemcpyHostToDevice, s.a), cudaErrorInvalidValue)
      << "a copy whose kind does not match its pointers";
  cudaGetLastError();
  cudaFree(d);
  EXPECT_EQ(cudaMemsetAsync(d, 0, 4, s.a), cudaErrorInvalidValue) << "a freed buffer";
  cudaGetLastError();
}

// cuBLASLt: an algorithm serves only the product it was chosen for, and an attribute takes only its
// type's size.
TEST(EmulatedRuntime, CublasLtHoldsAnAlgorithmToItsProduct) {
  cublasLtHandle_t lt;
  ASSERT_EQ(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);
  float *a = nullptr, *b = nullptr, *c = nullptr, *ws = nullptr;
  for (float** p : {&a, &b, &c, &ws})
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(p), 64 * sizeof(float)), cudaSuccess);
  cublasLtMatmulDesc_t desc;
  ASSERT_EQ(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), CUBLAS_STATUS_SUCCESS);
  const std::int64_t wrong_size = CUBLAS_OP_T;
  EXPECT_EQ(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &wrong_size, sizeof wrong_size),
            CUBLAS_STATUS_INVALID_VALUE);
  cublasLtMatrixLayout_t l4, l8;
  cublasLtMatrixLayoutCreate(&l4, CUDA_R_32F, 4, 4, 4);
  cublasLtMatrixLayoutCreate(&l8, CUDA_R_32F, 8, 8, 8);
  cublasLtMatmulPreference_t pref;
  cublasLtMatmulPreferenceCreate(&pref);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  ASSERT_EQ(cublasLtMatmulAlgoGetHeuristic(lt, desc, l4, l4, l4, l4, pref, 1, &result, &found), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(found, 1);
  const float one = 1.0f, zero = 0.0f;
  EXPECT_EQ(cublasLtMatmul(lt, desc, &one, a, l4, b, l4, &zero, c, l4, c, l4, &result.algo, ws, 0, nullptr),
            CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasLtMatmul(lt, desc, &one, a, l8, b, l8, &zero, c, l8, c, l8, &result.algo, ws, 0, nullptr),
            CUBLAS_STATUS_INVALID_VALUE)
      << "the 4x4 product's algorithm used for an 8x8 one";
  EXPECT_EQ(cublasLtMatmulAlgoGetHeuristic(lt, desc, l4, l8, l4, l4, pref, 1, &result, &found),
            CUBLAS_STATUS_NOT_SUPPORTED)
      << "op(A) 4x4 times op(B) 8x8";
  cudaDeviceSynchronize();
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(l4);
  cublasLtMatrixLayoutDestroy(l8);
  cublasLtMatmulDescDestroy(desc);
  cublasLtDestroy(lt);
  for (float* p : {a, b, c, ws}) cudaFree(p);
}

}  // namespace
