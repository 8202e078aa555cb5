// cuDNN's fused flash attention from backend descriptors (core/cuda/cudnn_attention.hpp). The graphs
// are cudnn-frontend's composite SDPA graphs for a causal, bf16, training call on cuDNN 9.x (its
// node/scaled_dot_product_flash_attention.h, node/softmax.h and node/diagonal_band_mask.h; llm.c's
// llmc/cudnn_att.cpp drives the same through the frontend): every tensor 16-byte aligned, every virtual
// intermediate fp32 except the probabilities that feed a product (bf16), compute in fp32.
#include "core/cuda/cudnn_attention.hpp"

#include <cudnn_graph.h>
#include <dlfcn.h>

#include <cmath>
#include <functional>
#include <cstdlib>
#include <mutex>
#include <stdexcept>

namespace loom::cuda::cudnn {

struct Api {
  std::size_t (*get_version)();
  const char* (*error_string)(cudnnStatus_t);
  void (*last_error)(char*, std::size_t);
  cudnnStatus_t (*create)(cudnnBackendDescriptorType_t, cudnnBackendDescriptor_t*);
  cudnnStatus_t (*destroy)(cudnnBackendDescriptor_t);
  cudnnStatus_t (*set)(cudnnBackendDescriptor_t, cudnnBackendAttributeName_t, cudnnBackendAttributeType_t, std::int64_t,
                       const void*);
  cudnnStatus_t (*get)(cudnnBackendDescriptor_t, cudnnBackendAttributeName_t, cudnnBackendAttributeType_t, std::int64_t,
                       std::int64_t*, void*);
  cudnnStatus_t (*finalize)(cudnnBackendDescriptor_t);
  cudnnStatus_t (*execute)(cudnnHandle_t, cudnnBackendDescriptor_t, cudnnBackendDescriptor_t);
  cudnnStatus_t (*create_handle)(cudnnHandle_t*);
  cudnnStatus_t (*destroy_handle)(cudnnHandle_t);
  cudnnStatus_t (*set_stream)(cudnnHandle_t, cudaStream_t);
};

namespace {
std::string message(const Api& api, cudnnStatus_t status) {
  char last[1024] = "";
  api.last_error(last, sizeof last);
  std::string m = api.error_string(status);
  if (last[0] != '\0') m += std::string(": ") + last;
  return m;
}

void check_status(const Api& api, cudnnStatus_t s, const std::string& what) {
  if (s != CUDNN_STATUS_SUCCESS) throw std::runtime_error("cuDNN: " + what + ": " + message(api, s));
}

template <class F>
bool resolve(void* lib, const char* name, F& f, std::string* why) {
  f = reinterpret_cast<F>(dlsym(lib, name));
  if (!f && why) *why = std::string("libcudnn has no ") + name;
  return f != nullptr;
}
}  // namespace

const Api* library(std::string* why) {
  static std::once_flag once;
  static Api api{};
  static const Api* loaded = nullptr;
  static std::string failure;
  std::call_once(once, [] {
    const char* env = std::getenv("LOOM_CUDNN_LIBRARY");
    const std::string file = env && *env ? env : "libcudnn.so.9";
    void* lib = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* e = dlerror();
      failure = "cuDNN 9 is not installed here (dlopen " + file + ": " + (e ? e : "failed") +
                "; install cuDNN 9, or point LOOM_CUDNN_LIBRARY at libcudnn.so.9)";
      return;
    }
    Api a{};
    std::string missing;
    if (!resolve(lib, "cudnnGetVersion", a.get_version, &missing) ||
        !resolve(lib, "cudnnGetErrorString", a.error_string, &missing) ||
        !resolve(lib, "cudnnGetLastErrorString", a.last_error, &missing) ||
        !resolve(lib, "cudnnBackendCreateDescriptor", a.create, &missing) ||
        !resolve(lib, "cudnnBackendDestroyDescriptor", a.destroy, &missing) ||
        !resolve(lib, "cudnnBackendSetAttribute", a.set, &missing) ||
        !resolve(lib, "cudnnBackendGetAttribute", a.get, &missing) ||
        !resolve(lib, "cudnnBackendFinalize", a.finalize, &missing) ||
        !resolve(lib, "cudnnBackendExecute", a.execute, &missing) ||
        !resolve(lib, "cudnnCreate", a.create_handle, &missing) ||
        !resolve(lib, "cudnnDestroy", a.destroy_handle, &missing) ||
        !resolve(lib, "cudnnSetStream", a.set_stream, &missing)) {
      failure = file + ": " + missing + " (not cuDNN 9)";
      return;
    }
    // The graphs are spelled as cudnn-frontend spells them for cuDNN 9.16 and newer; before, it adds a
    // padding mask to the backward where T is not a multiple of 128 (9.15 and older), fills the mask
    // with the lowest float instead of -inf (before 9.10) and zeroes dq's accumulator (before 9.6).
    const std::size_t v = a.get_version();
    if (v < kMinimumVersion) {
      failure = file + " is cuDNN " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
                std::to_string(v % 100) +
                "; loom builds cuDNN's attention graphs as cuDNN 9.16 and newer take them (point "
                "LOOM_CUDNN_LIBRARY at a newer libcudnn.so.9)";
      return;
    }
    api = a;
    loaded = &api;
  });
  if (!loaded && why) *why = failure;
  return loaded;
}

std::size_t version(const Api& api) { return api.get_version(); }

void* create_handle(const Api& api, void* stream) {
  cudnnHandle_t h = nullptr;
  check_status(api, api.create_handle(&h), "cudnnCreate");
  const cudnnStatus_t s = api.set_stream(h, static_cast<cudaStream_t>(stream));
  if (s != CUDNN_STATUS_SUCCESS) {
    api.destroy_handle(h);
    check_status(api, s, "cudnnSetStream");
  }
  return h;
}

void destroy_handle(const Api& api, void* handle) {
  if (handle) api.destroy_handle(static_cast<cudnnHandle_t>(handle));
}

// ---------------------------------------------------------------------------------------------
// Graph

void Graph::fail(const std::string& what) const {
  throw std::runtime_error("cuDNN attention " + std::string(kind_ == Kind::forward ? "forward" : "backward") +
                           " graph (B " + std::to_string(shape_.B) + ", T " + std::to_string(shape_.T) + ", heads " +
                           std::to_string(shape_.NH) + ", head size " + std::to_string(shape_.hs) + "): " + what);
}

void Graph::check(int status, const std::string& what) const {
  const auto st = static_cast<cudnnStatus_t>(status);
  if (st != CUDNN_STATUS_SUCCESS) fail(what + ": " + message(api_, st));
}

void* Graph::keep(void* d) {
  owned_.push_back(d);
  return d;
}

namespace {
using Desc = cudnnBackendDescriptor_t;
struct Setter {
  const Api& api;
  Desc d;
  const char* what;
  std::string* error;
  void operator()(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, std::int64_t n,
                  const void* v) const {
    if (!error->empty()) return;
    const cudnnStatus_t s = api.set(d, name, type, n, v);
    if (s != CUDNN_STATUS_SUCCESS)
      *error = std::string(what) + " attribute " + std::to_string(static_cast<int>(name)) + ": " + message(api, s);
  }
};
}  // namespace

// Each descriptor: created, its attributes set, finalized; the first failure names where it happened.
#define LOOM_CUDNN_MAKE(var, type, what)                             \
  Desc var = nullptr;                                                \
  check(api_.create(type, &var), std::string("creating ") + (what)); \
  keep(var);                                                         \
  std::string var##_error;                                           \
  const Setter var##_set{api_, var, what, &var##_error};
#define LOOM_CUDNN_FINALIZE(var, what)                      \
  if (!var##_error.empty()) fail("setting " + var##_error); \
  check(api_.finalize(var), std::string("finalizing ") + (what));

void* Graph::tensor(std::int64_t uid, int type, const std::int64_t* dims, const std::int64_t* strides, bool is_virtual,
                    bool by_value) {
  const std::string what = "tensor " + std::to_string(uid);
  LOOM_CUDNN_MAKE(t, CUDNN_BACKEND_TENSOR_DESCRIPTOR, what.c_str())
  const auto dt = static_cast<cudnnDataType_t>(type);
  const std::int64_t alignment = 16;
  const bool yes = true;
  t_set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt);
  t_set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims);
  t_set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides);
  t_set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
  t_set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
  if (is_virtual) t_set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &yes);
  if (by_value) t_set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &yes);
  LOOM_CUDNN_FINALIZE(t, what.c_str())
  if (!is_virtual) tensors_.push_back(t);
  return t;
}

// y = mode(x[, b[, t]]); math: the pointwise descriptor's precision (default fp32); axis: GEN_INDEX's.
void* Graph::pointwise(int mode, void* x, void* b, void* t, void* y, int math, std::int64_t axis) {
  const std::string what = "pointwise " + std::to_string(mode);
  LOOM_CUDNN_MAKE(pw, CUDNN_BACKEND_POINTWISE_DESCRIPTOR, what.c_str())
  const auto m = static_cast<cudnnPointwiseMode_t>(mode);
  const auto prec = static_cast<cudnnDataType_t>(math < 0 ? CUDNN_DATA_FLOAT : math);
  pw_set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &m);
  pw_set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec);
  if (axis >= 0) pw_set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
  LOOM_CUDNN_FINALIZE(pw, what.c_str())
  LOOM_CUDNN_MAKE(op, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, what.c_str())
  const float one = 1.0f;
  op_set(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw);
  op_set(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
  if (b) op_set(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
  if (t) op_set(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t);
  op_set(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
  op_set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one);
  op_set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one);
  LOOM_CUDNN_FINALIZE(op, what.c_str())
  ops_.push_back(op);
  return op;
}

void* Graph::matmul(void* a, void* b, void* c) {
  LOOM_CUDNN_MAKE(mm, CUDNN_BACKEND_MATMUL_DESCRIPTOR, "matmul")
  const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
  mm_set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
  LOOM_CUDNN_FINALIZE(mm, "matmul")
  LOOM_CUDNN_MAKE(op, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, "matmul operation")
  op_set(CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a);
  op_set(CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
  op_set(CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c);
  op_set(CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &mm);
  LOOM_CUDNN_FINALIZE(op, "matmul operation")
  ops_.push_back(op);
  return op;
}

void* Graph::reduction(int reduce, void* x, void* y) {
  LOOM_CUDNN_MAKE(r, CUDNN_BACKEND_REDUCTION_DESCRIPTOR, "reduction")
  const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
  const auto mode = static_cast<cudnnReduceTensorOp_t>(reduce);
  r_set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
  r_set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode);
  const bool deterministic = false;  // as the frontend sets it from cuDNN 9.11 on
  if (api_.get_version() >= 91100) r_set(CUDNN_ATTR_REDUCTION_IS_DETERMINISTIC, CUDNN_TYPE_BOOLEAN, 1, &deterministic);
  LOOM_CUDNN_FINALIZE(r, "reduction")
  LOOM_CUDNN_MAKE(op, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, "reduction operation")
  op_set(CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &r);
  op_set(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
  op_set(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
  LOOM_CUDNN_FINALIZE(op, "reduction operation")
  ops_.push_back(op);
  return op;
}

void* Graph::reshape(void* x, void* y) {
  LOOM_CUDNN_MAKE(op, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, "reshape operation")
  op_set(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
  op_set(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
  LOOM_CUDNN_FINALIZE(op, "reshape operation")
  ops_.push_back(op);
  return op;
}

Graph::Graph(const Api& api, Kind kind, const Shape& s) : api_(api), kind_(kind), shape_(s) {
  try {
    const std::int64_t B = s.B, H = s.NH, T = s.T, D = s.hs, C = H * D;
    // The model's layouts: qkv [B,T,3,H,D] (q, k, v each a strided [B,H,T,D] view of it), out, dout
    // [B,T,H,D], the statistics [B,H,T]; the scores [B,H,T,T] and per-row values [B,H,T,1] virtual.
    const std::int64_t qkv_dims[4] = {B, H, T, D}, qkv_str[4] = {3 * C * T, D, 3 * C, 1};
    const std::int64_t qkv_t_dims[4] = {B, H, D, T}, qkv_t_str[4] = {3 * C * T, D, 1, 3 * C};  // k^T, v^T views
    const std::int64_t o_dims[4] = {B, H, T, D}, o_str[4] = {C * T, D, C, 1};
    const std::int64_t ss[4] = {B, H, T, T}, ss_str[4] = {H * T * T, T * T, T, 1},
                       sst_str[4] = {H * T * T, T * T, 1, T};
    const std::int64_t rr[4] = {B, H, T, 1}, rr_str[4] = {H * T, T, 1, 1};
    const std::int64_t one[4] = {1, 1, 1, 1};
    const int bf16 = CUDNN_DATA_BFLOAT16, f32 = CUDNN_DATA_FLOAT, i32 = CUDNN_DATA_INT32, boolean = CUDNN_DATA_BOOLEAN;
    std::int64_t next_virtual = 100;
    auto v = [&](int type, const std::int64_t* dims, const std::int64_t* str) {
      return tensor(++next_virtual, type, dims, str, true);
    };
    // An operation on the scores and its output, a virtual fp32 [B,H,T,T]; the bf16 transpose of scores.
    auto scores_of = [&](int mode, void* x, void* b) {
      void* y = v(f32, ss, ss_str);
      pointwise(mode, x, b, nullptr, y);
      return y;
    };
    auto product = [&](void* a, void* b) {
      void* y = v(f32, ss, ss_str);
      matmul(a, b, y);
      return y;
    };
    auto transposed = [&](void* x) {
      void* y = v(bf16, ss, sst_str);
      reshape(x, y);
      return y;
    };
    // The causal mask as the frontend spells it before cuDNN 9.21: keep score (t, j) where t >= j, else
    // the fill (-inf).
    auto causal = [&](void* scores, void* fill) {
      void* row = v(i32, ss, ss_str);
      void* col = v(i32, ss, ss_str);
      void* keep_mask = v(boolean, ss, ss_str);
      void* masked = v(f32, ss, ss_str);
      pointwise(CUDNN_POINTWISE_GEN_INDEX, scores, nullptr, nullptr, row, -1, 2);
      pointwise(CUDNN_POINTWISE_GEN_INDEX, scores, nullptr, nullptr, col, -1, 3);
      pointwise(CUDNN_POINTWISE_CMP_GE, row, col, nullptr, keep_mask, boolean);
      pointwise(CUDNN_POINTWISE_BINARY_SELECT, scores, fill, keep_mask, masked);
      return masked;
    };
    if (kind == Kind::forward) {
      void* q = tensor(kQ, bf16, qkv_dims, qkv_str, false);
      void* kt = tensor(kK, bf16, qkv_t_dims, qkv_t_str, false);
      void* val = tensor(kV, bf16, qkv_dims, qkv_str, false);
      void* o = tensor(kO, bf16, o_dims, o_str, false);
      void* stats = tensor(kStats, f32, rr, rr_str, false);
      void* scale = tensor(kScale, f32, one, one, false, true);
      void* fill = tensor(kFill, f32, one, one, false, true);
      void* s1 = product(q, kt);  // q k^T
      void* s2 = scores_of(CUDNN_POINTWISE_MUL, s1, scale);
      void* s3 = causal(s2, fill);
      void* mx = v(f32, rr, rr_str);
      reduction(CUDNN_REDUCE_TENSOR_MAX, s3, mx);
      void* shifted = scores_of(CUDNN_POINTWISE_SUB, s3, mx);
      void* e = scores_of(CUDNN_POINTWISE_EXP, shifted, nullptr);
      void* z = v(f32, rr, rr_str);
      reduction(CUDNN_REDUCE_TENSOR_ADD, e, z);
      void* logz = v(f32, rr, rr_str);
      pointwise(CUDNN_POINTWISE_LOG, z, nullptr, nullptr, logz);
      pointwise(CUDNN_POINTWISE_ADD, mx, logz, nullptr, stats);  // max + ln sum: the flash path's lse
      void* p = v(bf16, ss, ss_str);
      pointwise(CUDNN_POINTWISE_DIV, e, z, nullptr, p);
      matmul(p, val, o);
    } else {
      void* q = tensor(kQ, bf16, qkv_dims, qkv_str, false);
      void* kt = tensor(kK, bf16, qkv_t_dims, qkv_t_str, false);
      void* vt = tensor(kV, bf16, qkv_t_dims, qkv_t_str, false);
      void* o = tensor(kO, bf16, o_dims, o_str, false);
      void* stats = tensor(kStats, f32, rr, rr_str, false);
      void* d_o = tensor(kDO, bf16, o_dims, o_str, false);
      void* dq = tensor(kDQ, bf16, qkv_dims, qkv_str, false);
      void* dk = tensor(kDK, bf16, qkv_dims, qkv_str, false);
      void* dv = tensor(kDV, bf16, qkv_dims, qkv_str, false);
      void* scale = tensor(kScale, f32, one, one, false, true);
      void* unit = tensor(kOne, f32, one, one, false, true);
      void* fill = tensor(kFill, f32, one, one, false, true);
      void* softmax_sum = tensor(kSoftmaxSum, f32, rr, rr_str, false);
      // D = rowsum(dO * O), through the statistics' scratch
      const std::int64_t do_o_str[4] = {H * T * D, T * D, H * D, 1};
      void* do_o = v(f32, o_dims, do_o_str);
      pointwise(CUDNN_POINTWISE_MUL, d_o, o, nullptr, do_o);
      void* rowsum = v(f32, rr, rr_str);
      reduction(CUDNN_REDUCE_TENSOR_ADD, do_o, rowsum);
      pointwise(CUDNN_POINTWISE_MUL, rowsum, unit, nullptr, softmax_sum);
      // P, recomputed from the statistics
      void* s1 = product(q, kt);
      void* s2 = scores_of(CUDNN_POINTWISE_MUL, s1, scale);
      void* s3 = scores_of(CUDNN_POINTWISE_SUB, s2, stats);
      void* masked = causal(s3, fill);
      void* p = scores_of(CUDNN_POINTWISE_EXP, masked, nullptr);
      // dV = P^T dO
      matmul(transposed(p), d_o, dv);
      // dS = P * (dO V^T - D) * scale
      void* dp = product(d_o, vt);
      void* dp_d = scores_of(CUDNN_POINTWISE_SUB, dp, softmax_sum);
      void* pds = scores_of(CUDNN_POINTWISE_MUL, dp_d, p);
      void* ds = scores_of(CUDNN_POINTWISE_MUL, pds, scale);
      // dK = dS^T Q; dQ = dS K straight into dQ: the frontend's deterministic variant (llm.c's choice),
      // with no fp32 accumulator that blocks would add into in any order, so a run repeats bit for bit
      matmul(transposed(ds), q, dk);
      void* k = v(f32, qkv_dims, qkv_str);
      reshape(kt, k);
      matmul(ds, k, dq);
    }
  } catch (...) {
    for (auto it = owned_.rbegin(); it != owned_.rend(); ++it) api_.destroy(static_cast<Desc>(*it));
    throw;
  }
}

Graph::~Graph() {
  for (auto it = owned_.rbegin(); it != owned_.rend(); ++it) api_.destroy(static_cast<Desc>(*it));
}

#undef LOOM_CUDNN_MAKE
#undef LOOM_CUDNN_FINALIZE

// ---------------------------------------------------------------------------------------------
// Plan

namespace {
void check_plan(const Api& api, cudnnStatus_t s, const std::string& what) {
  if (s != CUDNN_STATUS_SUCCESS) throw std::runtime_error("cuDNN attention: " + what + ": " + message(api, s));
}
}  // namespace

namespace {
// The operation graph of `graph` and cuDNN's heuristics (mode A) for it, finalized (`make` creates and
// keeps each descriptor): on the device of `handle`, or, with no handle, on the one `device` describes.
Desc heuristics(const Api& api, const Graph& graph, void* handle, Desc device,
                const std::function<Desc(cudnnBackendDescriptorType_t, const char*)>& make) {
  const char* kind = graph.kind() == Graph::Kind::forward ? "forward" : "backward";
  Desc op_graph = make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "the operation graph");
  const std::vector<void*>& ops = graph.ops();
  check_plan(api,
             api.set(op_graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                     static_cast<std::int64_t>(ops.size()), ops.data()),
             "the operation graph's operations");
  cudnnHandle_t h = static_cast<cudnnHandle_t>(handle);
  if (h)
    check_plan(api, api.set(op_graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h),
               "the operation graph's handle");
  check_plan(api, api.finalize(op_graph), std::string("the ") + kind + " operation graph");
  Desc heur = make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "the engine heuristics");
  const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
  check_plan(api, api.set(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &op_graph),
             "the heuristics' graph");
  check_plan(api, api.set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode), "the heuristics' mode");
  if (device)
    check_plan(api, api.set(heur, CUDNN_ATTR_ENGINEHEUR_DEVICEPROP, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &device),
               "the heuristics' device");
  check_plan(api, api.finalize(heur), std::string("the heuristics of the ") + kind + " graph");
  return heur;
}
}  // namespace

Offer offered_engines(const Api& api, const Graph& graph, const std::string& device_json) {
  if (api.get_version() < 90800)
    throw std::runtime_error("cuDNN " + std::to_string(api.get_version()) +
                             " cannot describe a device without one (device properties need 9.8)");
  std::vector<Desc> owned;
  struct Drop {
    const Api& api;
    std::vector<Desc>& d;
    ~Drop() {
      for (auto it = d.rbegin(); it != d.rend(); ++it) api.destroy(*it);
    }
  } drop{api, owned};
  auto make = [&](cudnnBackendDescriptorType_t type, const char* what) {
    Desc d = nullptr;
    check_plan(api, api.create(type, &d), std::string("creating ") + what);
    owned.push_back(d);
    return d;
  };
  Desc device = make(CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR, "device properties");
  check_plan(api,
             api.set(device, CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION, CUDNN_TYPE_CHAR,
                     static_cast<std::int64_t>(device_json.size()), device_json.data()),
             "the device properties' JSON");
  check_plan(api, api.finalize(device), "the device properties");
  Desc heur = heuristics(api, graph, nullptr, device, make);
  Offer offer;
  check_plan(api,
             api.get(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &offer.ranked, nullptr),
             "counting the heuristics' engines");
  std::vector<Desc> configs(static_cast<std::size_t>(offer.ranked));
  for (Desc& c : configs) c = make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "an engine configuration");
  std::int64_t returned = 0;
  // Fails (and returns none) where the support checks cannot load the CUDA driver.
  if (offer.ranked > 0 && api.get(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, offer.ranked,
                                  &returned, configs.data()) != CUDNN_STATUS_SUCCESS)
    returned = 0;
  for (std::int64_t i = 0; i < returned; ++i) {
    Desc engine = make(CUDNN_BACKEND_ENGINE_DESCRIPTOR, "an engine");
    std::int64_t n = 0, index = -1;
    check_plan(api,
               api.get(configs[static_cast<std::size_t>(i)], CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                       1, &n, &engine),
               "an engine configuration's engine");
    check_plan(api, api.get(engine, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, &index),
               "an engine's index");
    offer.engines.push_back(index);
  }
  return offer;
}

Plan::Plan(const Api& api, void* handle, std::unique_ptr<Graph> graph) : api_(api), graph_(std::move(graph)) {
  auto make = [&](cudnnBackendDescriptorType_t type, const char* what) {
    Desc d = nullptr;
    check_plan(api_, api_.create(type, &d), std::string("creating ") + what);
    owned_.push_back(d);
    return d;
  };
  auto destroy_all = [&] {
    for (auto it = owned_.rbegin(); it != owned_.rend(); ++it) api_.destroy(static_cast<Desc>(*it));
    owned_.clear();
  };
  const char* kind = graph_->kind() == Graph::Kind::forward ? "forward" : "backward";
  try {
    cudnnHandle_t h = static_cast<cudnnHandle_t>(handle);
    Desc heur = heuristics(api_, *graph_, handle, nullptr, make);
    std::int64_t count = 0;
    check_plan(api_, api_.get(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr),
               "counting the heuristics' engines");
    if (count <= 0)
      throw std::runtime_error(std::string("cuDNN attention: no engine runs the ") + kind +
                               " graph on this device (heuristics mode A found none)");
    std::vector<Desc> configs(static_cast<std::size_t>(count));
    for (Desc& c : configs) c = make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "an engine configuration");
    std::int64_t returned = 0;
    check_plan(
        api_,
        api_.get(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &returned, configs.data()),
        "the heuristics' engines");
    std::string refusals;
    for (std::int64_t i = 0; i < returned && !plan_; ++i) {
      Desc plan = nullptr;
      check_plan(api_, api_.create(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &plan), "creating an execution plan");
      cudnnStatus_t s = api_.set(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                                 &configs[static_cast<std::size_t>(i)]);
      if (s == CUDNN_STATUS_SUCCESS) s = api_.set(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &h);
      if (s == CUDNN_STATUS_SUCCESS) s = api_.finalize(plan);
      if (s != CUDNN_STATUS_SUCCESS) {
        refusals += "; engine " + std::to_string(i) + ": " + message(api_, s);
        api_.destroy(plan);
        continue;
      }
      owned_.push_back(plan);
      plan_ = plan;
      engine_ = "heuristics' choice " + std::to_string(i) + " of " + std::to_string(returned);
    }
    if (!plan_)
      throw std::runtime_error(std::string("cuDNN attention: no engine of the ") + kind + " graph finalized a plan" +
                               refusals);
    std::int64_t got = 0;
    check_plan(api_,
               api_.get(static_cast<Desc>(plan_), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &got,
                        &workspace_),
               "the plan's workspace size");
  } catch (...) {
    destroy_all();
    throw;
  }
}

Plan::~Plan() {
  for (auto it = owned_.rbegin(); it != owned_.rend(); ++it) api_.destroy(static_cast<Desc>(*it));
}

void Plan::execute(void* handle, const std::map<std::int64_t, void*>& ptrs, void* workspace) const {
  std::vector<std::int64_t> uids;
  std::vector<void*> data;
  for (const auto& [uid, p] : ptrs) {
    uids.push_back(uid);
    data.push_back(p);
  }
  Desc pack = nullptr;
  check_plan(api_, api_.create(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &pack), "creating a variant pack");
  struct Drop {
    const Api& api;
    Desc d;
    ~Drop() { api.destroy(d); }
  } drop{api_, pack};
  check_plan(api_,
             api_.set(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64,
                      static_cast<std::int64_t>(uids.size()), uids.data()),
             "the variant pack's uids");
  check_plan(api_,
             api_.set(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR,
                      static_cast<std::int64_t>(data.size()), data.data()),
             "the variant pack's pointers");
  check_plan(api_, api_.set(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace),
             "the variant pack's workspace");
  check_plan(api_, api_.finalize(pack), "the variant pack");
  check_plan(api_, api_.execute(static_cast<cudnnHandle_t>(handle), static_cast<Desc>(plan_), pack),
             std::string("executing the ") + (graph_->kind() == Graph::Kind::forward ? "forward" : "backward"));
}

}  // namespace loom::cuda::cudnn
