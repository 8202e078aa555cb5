// The NCCL communicator at one rank (label gpu; skipped, saying why, without a GPU or NCCL): NCCL
// initialised through the unique id broadcast over MPI, every operation kind on device buffers of
// several element types (a collective over one rank leaves its data as it was, or copies it where
// it belongs), asynchronous requests that complete, host buffers routed through MPI, and the
// counters. Several ranks need several GPUs (NCCL refuses two ranks on one device).
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/comm/comm.hpp"
#include "core/cuda/comm_nccl.hpp"

namespace {

using loom::BufferRef;
using loom::CommOp;
using loom::DType;
using loom::MemSpace;
using loom::ReduceOp;

std::string why_skip() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return "no CUDA device visible";
  }
  const std::string d = loom::nccl_description();
  return d.rfind("NCCL ", 0) == 0 ? "" : d;
}

template <class T>
T* device_copy(const std::vector<T>& v) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, v.size() * sizeof(T) + 1), cudaSuccess);
  cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  return static_cast<T*>(p);
}
template <class T>
std::vector<T> host_copy(const T* d, std::size_t n) {
  std::vector<T> v(n);
  cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost);
  return v;
}

TEST(NcclCommunicator, EveryOperationAtOneRank) {
  const std::string skip = why_skip();
  if (!skip.empty()) GTEST_SKIP() << skip;
  auto c = loom::make_nccl_communicator(MPI_COMM_WORLD, "world", nullptr);
  ASSERT_EQ(c->size(), 1);
  const std::vector<float> x = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f};
  float* d = device_copy(x);
  auto r = c->all_reduce_async(BufferRef(d, 5, MemSpace::device));
  r->wait();
  EXPECT_TRUE(r->test());
  EXPECT_EQ(host_copy(d, 5), x) << "sum over one rank";
  c->all_reduce(BufferRef(d, 5, MemSpace::device), ReduceOp::max);
  EXPECT_EQ(host_copy(d, 5), x) << "max over one rank";
  const std::vector<std::int64_t> ints = {1, -5, 1ll << 40};
  std::int64_t* di = device_copy(ints);
  c->all_reduce(BufferRef(di, 3, MemSpace::device));
  EXPECT_EQ(host_copy(di, 3), ints) << "int64";
  float* out = device_copy(std::vector<float>(5, 0.0f));
  c->reduce_scatter(BufferRef(d, 5, MemSpace::device), BufferRef(out, 5, MemSpace::device));
  EXPECT_EQ(host_copy(out, 5), x) << "reduce-scatter: the one block";
  float* gathered = device_copy(std::vector<float>(5, 0.0f));
  c->all_gather(BufferRef(d, 5, MemSpace::device), BufferRef(gathered, 5, MemSpace::device),
                std::vector<std::int64_t>{5});
  EXPECT_EQ(host_copy(gathered, 5), x) << "all-gather";
  c->broadcast(BufferRef(d, 5, MemSpace::device), 0);
  EXPECT_EQ(host_copy(d, 5), x) << "broadcast";
  // Host scalars go through MPI.
  double s = 2.5;
  c->all_reduce(BufferRef(&s, 1));
  EXPECT_EQ(s, 2.5);
  const loom::CommStats& st = c->stats();
  EXPECT_EQ(st.calls[static_cast<int>(CommOp::all_reduce)], 4u) << "three device all-reduces and one host one";
  EXPECT_EQ(st.calls[static_cast<int>(CommOp::reduce_scatter)], 1u);
  EXPECT_EQ(st.calls[static_cast<int>(CommOp::all_gather)], 1u);
  EXPECT_EQ(st.total_bytes(), 0u) << "a ring over one rank sends nothing";
  std::vector<float> h(5);
  EXPECT_THROW(c->reduce_scatter(BufferRef(d, 5, MemSpace::device), BufferRef(h.data(), 5)), std::logic_error)
      << "a device send with a host recv is refused before anything moves";
  cudaFree(d);
  cudaFree(di);
  cudaFree(out);
  cudaFree(gathered);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  const int status = RUN_ALL_TESTS();
  MPI_Finalize();
  return status;
}
