#pragma once
// The CUDA emulator's stand-in for the runtime API (core/cuda/emu/runtime.cpp): the subset loom's
// CUDA back end calls, with the toolkit's names, so that core/cuda/cuda_backend.cpp and the launch
// wrappers compile with the host compiler into libloom_cuda_emu.so and run on the CPU. Only the
// emulated back end's build puts this directory on the include path; the real build uses the toolkit.
#include <cstddef>
#include <cstdint>

#include "core/cuda/emu/cuda_emu.hpp"
#include "cuda_bf16.h"
#include "cuda_fp16.h"

using dim3 = loom::cuda_emu::dim3;

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevicePointer = 17,
  cudaErrorInvalidMemcpyDirection = 21,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  cudaErrorLaunchFailure = 719,
};
using cudaError = cudaError_t;

enum cudaDataType { CUDA_R_32F = 0, CUDA_R_64F = 1, CUDA_R_16F = 2, CUDA_R_16BF = 14 };
using cudaDataType_t = cudaDataType;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaDeviceAttr { cudaDevAttrMaxSharedMemoryPerBlockOptin = 97 };
constexpr unsigned cudaStreamDefault = 0, cudaStreamNonBlocking = 1;
constexpr unsigned cudaEventDefault = 0, cudaEventDisableTiming = 2;

struct CUstream_st;
struct CUevent_st;
using cudaStream_t = CUstream_st*;
using cudaEvent_t = CUevent_st*;

struct cudaUUID_t {
  char bytes[16];
};
struct cudaDeviceProp {
  char name[256];
  cudaUUID_t uuid;
  std::size_t totalGlobalMem;
  std::size_t sharedMemPerBlock;
  std::size_t sharedMemPerBlockOptin;
  int multiProcessorCount;
  int major;
  int minor;
};
struct cudaFuncAttributes {
  std::size_t sharedSizeBytes;
  int maxThreadsPerBlock;
  int maxDynamicSharedSizeBytes;
  int ptxVersion;
  int binaryVersion;
};

const char* cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetLastError();
cudaError_t cudaGetDeviceCount(int* n);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaRuntimeGetVersion(int* v);
cudaError_t cudaDriverGetVersion(int* v);
cudaError_t cudaMalloc(void** p, std::size_t bytes);
cudaError_t cudaFree(void* p);
cudaError_t cudaMemGetInfo(std::size_t* free_bytes, std::size_t* total_bytes);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t s = nullptr);
cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemsetAsync(void* p, int value, std::size_t bytes, cudaStream_t s = nullptr);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaStreamCreate(cudaStream_t* s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags = 0);
cudaError_t cudaEventCreate(cudaEvent_t* e);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = nullptr);
cudaError_t cudaEventQuery(cudaEvent_t e);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end);
cudaError_t cudaFuncSetAttribute(const void* kernel, cudaFuncAttribute attr, int value);
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* a, const void* kernel);
template <class Kernel>
cudaError_t cudaFuncSetAttribute(Kernel* kernel, cudaFuncAttribute attr, int value) {
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), attr, value);
}
template <class Kernel>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* a, Kernel* kernel) {
  return cudaFuncGetAttributes(a, reinterpret_cast<const void*>(kernel));
}
