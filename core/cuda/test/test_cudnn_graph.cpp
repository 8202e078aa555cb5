// cuDNN's attention graphs (core/cuda/cudnn_attention.cpp) built on the CPU: every tensor and operation
// descriptor of the forward and backward graphs is created and finalized by cuDNN itself, which checks
// each one's attributes, types and shapes, with no handle and no GPU. What needs a device (the
// operation graph with its handle, the engines, execution) is the gpu tests' (test_cuda_backend.cpp).
// Skipped, saying why, where libcudnn.so.9 cannot be opened.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "core/cuda/cudnn_attention.hpp"

using namespace loom::cuda::cudnn;

#define REQUIRE_CUDNN(api)         \
  std::string why_;                \
  const Api* api = library(&why_); \
  if (!api) GTEST_SKIP() << "no cuDNN here: " << why_;

TEST(CudnnGraph, ForwardAndBackwardGraphsFinalizeWithoutADevice) {
  REQUIRE_CUDNN(api);
  std::printf("[ cudnn   ] cuDNN %zu\n", version(*api));
  // GPT-2 124M's shape (T 1024, 12 heads of 64), head size 128, a long sequence, and one head of 8 rows.
  for (const Shape& s : {Shape{16, 1024, 12, 64}, Shape{4, 1024, 8, 128}, Shape{1, 4096, 12, 64}, Shape{1, 8, 1, 8}}) {
    SCOPED_TRACE("B " + std::to_string(s.B) + " T " + std::to_string(s.T) + " NH " + std::to_string(s.NH) + " hs " +
                 std::to_string(s.hs));
    const Graph fwd(*api, Graph::Kind::forward, s);
    // q k^T, scale, the causal mask (two indices, a comparison, a select), max, subtract, exp, sum, log,
    // add (the statistics), divide, the product with v: the frontend's composite forward.
    EXPECT_EQ(fwd.operations(), 14u);
    EXPECT_EQ(fwd.tensors(), 7u);  // q, k, v, o, stats, scale, fill
    const Graph bwd(*api, Graph::Kind::backward, s);
    EXPECT_EQ(bwd.operations(), 21u);  // the frontend's deterministic dq: straight into dQ, no accumulator
    EXPECT_EQ(bwd.tensors(), 13u);     // + dO, dQ, dK, dV, one, softmax_sum
  }
}

// The checks are cuDNN's (a product whose operands do not chain is refused when its operation is
// finalized, as a planted k without its transpose showed): a shape cuDNN refuses is refused when the
// graph is built, and the error names the graph, its shape, the descriptor and cuDNN's status.
TEST(CudnnGraph, ARefusedShapeNamesTheGraphAndCudnnsReason) {
  REQUIRE_CUDNN(api);
  try {
    const Graph g(*api, Graph::Kind::forward, Shape{2, 64, 2, -8});
    FAIL() << "a negative head size was accepted";
  } catch (const std::runtime_error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("forward graph (B 2, T 64, heads 2, head size -8)"), std::string::npos) << m;
    EXPECT_NE(m.find("CUDNN_STATUS"), std::string::npos) << m;
    std::printf("[ refused ] %s\n", m.c_str());
  }
}

// cuDNN's heuristics (mode A) asked about both graphs for a device described, not present (cuDNN 9.8's
// device properties): an H100 SXM as cuDNN's parser names the fields (its library's own strings), the
// figures the datasheet's or estimates, not read from a device. Its support checks load the CUDA
// driver; with the toolkit's stub standing in for it (LOOM_CUDA_STUB names it: ctest sets it to the
// toolkit's stubs/libcuda.so, loaded here first under its soname libcuda.so.1, which cuDNN then
// finds), they return the engines that take each graph: here engine 2 (and 1) forward, 6
// and 7 backward at GPT-2's shape, and none at head size 12, which cuDNN's attention does not take
// (its generic ranking still lists some: the ranking alone proves nothing). Planted, the forward's
// probabilities kept fp32 before the product with v (the frontend keeps them bf16) left the forward with
// no engine. Without the stub only the ranking is asked.
const char* const kH100 =
    R"({"maxGridSize": [2147483647, 65535, 65535], "maxBlockSize": [1024, 1024, 64], "regsPerBlock": 65536, "multiProcessorCount": 132, "warpSize": 32, "maxSharedMemoryPerBlock": 49152, "maxSharedMemoryPerBlockOptin": 232448, "reservedSharedMemoryPerBlock": 1024, "maxRegistersPerSM": 65536, "maxCtasPerSM": 32, "maxThreadsPerBlock": 1024, "maxThreadsPerSM": 2048, "pciDeviceId": 0, "isTccDriver": 0, "supportCoopLaunch": 1, "totalGlobalMem": 85029158912, "smClockRateKHz": 1980000, "memClockRateKHz": 2619000, "l2CacheSize": 52428800, "cudaDeviceId": 0, "deviceVer": 900, "driverVer": 12080, "deviceName": "NVIDIA H100 80GB HBM3"})";

TEST(CudnnGraph, CudnnsEnginesTakeBothGraphsOnAnH100) {
  REQUIRE_CUDNN(api);
  if (version(*api) < 90800) GTEST_SKIP() << "cuDNN " << version(*api) << " has no device properties (9.8)";
  const char* stub = std::getenv("LOOM_CUDA_STUB");
  const bool checks = stub && *stub && dlopen(stub, RTLD_NOW | RTLD_GLOBAL) != nullptr;
  if (stub && *stub && !checks) ADD_FAILURE() << "LOOM_CUDA_STUB = " << stub << " cannot be loaded: " << dlerror();
  auto list = [](const std::vector<std::int64_t>& e) {
    std::string s;
    for (std::int64_t x : e) s += (s.empty() ? "" : " ") + std::to_string(x);
    return s.empty() ? std::string("none") : s;
  };
  for (const Shape& s : {Shape{16, 1024, 12, 64}, Shape{4, 4096, 6, 128}, Shape{1, 64, 1, 12}}) {
    const Graph fwd(*api, Graph::Kind::forward, s), bwd(*api, Graph::Kind::backward, s);
    const Offer f = offered_engines(*api, fwd, kH100), b = offered_engines(*api, bwd, kH100);
    std::printf(
        "[ engines ] B %d T %d heads %d head size %d: forward %lld ranked, engines %s; backward %lld ranked, "
        "engines %s\n",
        s.B, s.T, s.NH, s.hs, static_cast<long long>(f.ranked), list(f.engines).c_str(),
        static_cast<long long>(b.ranked), list(b.engines).c_str());
    EXPECT_GT(f.ranked, 0);
    EXPECT_GT(b.ranked, 0);
    if (!checks) continue;
    if (s.hs == 12) {  // not a head size cuDNN's attention takes: no engine passes its checks
      EXPECT_TRUE(f.engines.empty()) << "an engine took the forward at head size 12: " << list(f.engines);
      EXPECT_TRUE(b.engines.empty()) << "an engine took the backward at head size 12: " << list(b.engines);
      continue;
    }
    EXPECT_FALSE(f.engines.empty()) << "no engine of cuDNN takes the forward graph";
    EXPECT_FALSE(b.engines.empty()) << "no engine of cuDNN takes the backward graph";
  }
  if (!checks) std::printf("[ engines ] no CUDA driver stub (LOOM_CUDA_STUB): the support checks not run\n");
}

// Without a GPU the handle cannot be made, and says why (this machine's case; on a GPU it is made).
TEST(CudnnGraph, AHandleNeedsADevice) {
  REQUIRE_CUDNN(api);
  try {
    void* h = create_handle(*api, nullptr);
    destroy_handle(*api, h);
    std::printf("[ handle  ] made: this machine has a GPU\n");
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("cudnnCreate"), std::string::npos) << e.what();
    std::printf("[ handle  ] %s\n", e.what());
  }
}
