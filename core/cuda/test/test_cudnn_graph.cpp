// cuDNN's attention graphs (core/cuda/cudnn_attention.cpp) built on the CPU: every tensor and operation
// descriptor of the forward and backward graphs is created and finalized by cuDNN itself, which checks
// each one's attributes, types and shapes, with no handle and no GPU. What needs a device (the
// operation graph with its handle, the engines, execution) is the gpu tests' (test_cuda_backend.cpp).
// Skipped, saying why, where libcudnn.so.9 cannot be opened.
#include <gtest/gtest.h>

#include <cstdio>
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
  // GPT-2 124M's shape (T 1024, 12 heads of 64), head size 128, a long sequence, and one head of one row.
  for (const Shape& s : {Shape{16, 1024, 12, 64}, Shape{4, 1024, 8, 128}, Shape{1, 4096, 12, 64}, Shape{1, 8, 1, 8}}) {
    SCOPED_TRACE("B " + std::to_string(s.B) + " T " + std::to_string(s.T) + " NH " + std::to_string(s.NH) + " hs " +
                 std::to_string(s.hs));
    const Graph fwd(*api, Graph::Kind::forward, s);
    // q k^T, scale, the causal mask (two indices, a comparison, a select), max, subtract, exp, sum, log,
    // add (the statistics), divide, the product with v: the frontend's composite forward.
    EXPECT_EQ(fwd.operations(), 14u);
    EXPECT_EQ(fwd.tensors(), 7u);  // q, k, v, o, stats, scale, fill
    const Graph bwd(*api, Graph::Kind::backward, s);
    EXPECT_EQ(bwd.operations(), 22u);
    EXPECT_EQ(bwd.tensors(), 14u);  // + dO, dQ, dK, dV, one, softmax_sum, the dq accumulator
  }
  EXPECT_EQ(Graph::dq_accum_bytes(Shape{16, 1024, 12, 64}), 4ll * 16 * 1024 * 12 * 64);
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
