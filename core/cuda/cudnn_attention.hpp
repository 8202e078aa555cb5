#pragma once
// cuDNN's fused flash attention (model.attention = cudnn) through cuDNN 9's graph API, built from the
// backend descriptors (the header-only frontend is not used): the causal forward with its softmax
// statistics and the backward, as the frontend's composite SDPA graphs spell them (cuDNN's fused
// engines recognise those graphs by their shape). libcudnn.so.9 is opened with dlopen when a run first
// asks for it, so libloom_cuda.so loads and trains without cuDNN.
//
// Plain C++ on the host: no cuDNN type crosses this header, so core/cuda/cuda_backend.cpp includes it
// in the emulated build too (where cuDNN is refused: its kernels need a GPU).
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace loom::cuda::cudnn {

// The shape of one attention call: B sequences of T tokens, NH heads of hs channels (C = NH * hs),
// q, k, v packed per token as [3, NH, hs] (the model's qkv), out and dout [B, T, NH, hs], the
// statistics [B, NH, T].
struct Shape {
  int B = 0, T = 0, NH = 0, hs = 0;
  bool operator<(const Shape& o) const { return std::tie(B, T, NH, hs) < std::tie(o.B, o.T, o.NH, o.hs); }
};

struct Api;  // the functions of libcudnn.so.9 this file calls
// libcudnn.so.9, opened once (LOOM_CUDNN_LIBRARY names another file): null, and why, when it cannot be
// (not found, a symbol missing, older than kMinimumVersion).
const Api* library(std::string* why);
// cudnnGetVersion of the opened library (e.g. 91900 for 9.19.0).
std::size_t version(const Api& api);
// A handle (cudnnHandle_t) on the current device, issuing on `stream` (a cudaStream_t); needs a GPU.
// std::runtime_error with cuDNN's message when it cannot be made.
void* create_handle(const Api& api, void* stream);
void destroy_handle(const Api& api, void* handle);

// One graph's descriptors: its tensors and operations, each finalized, kept alive as long as a plan
// made from them. Building needs no handle and no GPU (what the host tests check).
class Graph {
 public:
  enum class Kind { forward, backward };
  Graph(const Api& api, Kind kind, const Shape& s);  // throws std::runtime_error with cuDNN's message
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  Kind kind() const { return kind_; }
  std::size_t operations() const { return ops_.size(); }
  std::size_t tensors() const { return tensors_.size(); }
  // The descriptors (cudnnBackendDescriptor_t) of the operations, in order.
  const std::vector<void*>& ops() const { return ops_; }

 private:
  friend class Plan;
  void* tensor(std::int64_t uid, int type, const std::int64_t* dims, const std::int64_t* strides, bool is_virtual,
               bool by_value = false);
  void* pointwise(int mode, void* x, void* b, void* t, void* y, int math = -1, std::int64_t axis = -1);
  void* matmul(void* a, void* b, void* c);
  void* reduction(int op, void* x, void* y);
  void* reshape(void* x, void* y);
  void* keep(void* d);  // owned until ~Graph
  void check(int status, const std::string& what) const;
  [[noreturn]] void fail(const std::string& what) const;

  const Api& api_;
  Kind kind_;
  Shape shape_;
  std::vector<void*> owned_;    // every descriptor made, destroyed in reverse
  std::vector<void*> ops_;      // the operations, in the graph's order
  std::vector<void*> tensors_;  // the non-virtual tensors
};

// What cuDNN's heuristics (mode A) offer for `graph` on the device that `device_json` describes (a
// serialized CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR, cuDNN 9.8 or newer), with no handle and no GPU:
// `ranked` engine configurations, of which cuDNN returns those that pass its support checks, by
// engine (global index). Those checks load the CUDA driver: without one none passes (with the
// toolkit's stub libcuda.so.1 standing in, they run). std::runtime_error when cuDNN cannot ask (the
// JSON refused, a cuDNN before 9.8).
struct Offer {
  std::int64_t ranked = 0;
  std::vector<std::int64_t> engines;
};
Offer offered_engines(const Api& api, const Graph& graph, const std::string& device_json);

// A graph made runnable on one device: the operation graph (with the handle), the first engine
// configuration cuDNN's heuristics rank that yields a plan, and the plan's workspace.
class Plan {
 public:
  Plan(const Api& api, void* handle, std::unique_ptr<Graph> graph);
  ~Plan();
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  std::int64_t workspace_bytes() const { return workspace_; }
  const std::string& engine() const { return engine_; }
  // One execution: `ptrs` by tensor uid (device pointers; host pointers for the by-value scalars).
  void execute(void* handle, const std::map<std::int64_t, void*>& ptrs, void* workspace) const;

 private:
  const Api& api_;
  std::unique_ptr<Graph> graph_;
  std::vector<void*> owned_;
  void* plan_ = nullptr;
  std::int64_t workspace_ = 0;
  std::string engine_;
};

// The uids of the non-virtual tensors, which a call's pointers are keyed by.
enum Uid : std::int64_t {
  kQ = 1,
  kK = 2,
  kV = 3,
  kO = 4,
  kStats = 5,
  kScale = 6,  // by value: a host float, 1/sqrt(hs)
  kFill = 7,   // by value: a host float, -inf (the causal mask's fill)
  kDO = 8,
  kDQ = 9,
  kDK = 10,
  kDV = 11,
  kOne = 12,         // by value: a host float, 1
  kSoftmaxSum = 13,  // fp32 [B,NH,T]: row sums of dO * O (the backward's D)
};

// The oldest cuDNN whose graphs these are (9.16.0): cudnn-frontend builds them so from 9.16 on.
constexpr std::size_t kMinimumVersion = 91600;

}  // namespace loom::cuda::cudnn
