// The CUDA back end: every Backend operation on device memory of one GPU, on one stream. Kernels
// are in kernels.cu (their per-element arithmetic shared with the host kernels through
// core/backend/kernel_math.hpp); matrix products go through cuBLASLt: fp32 (TF32 when run.tf32 allows it),
// bf16 and fp16 operands with fp32 accumulation, the bias fused into the forward product's
// epilogue. Every buffer, the cuBLASLt workspace and the back end's own scratch are allocated here
// and filed in the memory ledger. Built into libloom_cuda.so and opened by core/backend/backend_select.cpp.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/backend/backend_select.hpp"
#include "core/cuda/kernels.cuh"
#include "core/backend/workspace_plan.hpp"
#ifdef LOOM_CUDA_NCCL
#include "core/cuda/comm_nccl.hpp"
#endif
#ifdef LOOM_CUDA_CUDNN
#include "core/cuda/cudnn_attention.hpp"
namespace cudnn = loom::cuda::cudnn;
#endif

namespace loom {
namespace {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("CUDA: ") + what + ": " + cudaGetErrorString(e));
}
void check_lt(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("cuBLASLt: ") + what + ": status " + std::to_string(static_cast<int>(s)));
}
[[noreturn]] void refuse(const std::string& what) { throw std::invalid_argument(what); }

void require_device(const BufferRef& b, const char* op, const char* name) {
  if (b.space != MemSpace::device && b.count > 0)
    refuse(std::string(op) + ": " + name + " is in " + mem_space_name(b.space) +
           " memory; the cuda back end takes device buffers");
}

cudaDataType cuda_type(DType t, const char* op) {
  switch (t) {
    case DType::f32:
      return CUDA_R_32F;
    case DType::f64:
      return CUDA_R_64F;
    case DType::bf16:
      return CUDA_R_16BF;
    case DType::f16:
      return CUDA_R_16F;
    default:
      refuse(std::string(op) + ": element type " + dtype_name(t) + " is not fp32, fp64, bf16 or fp16");
  }
}

// The largest power of two (at most 256) that divides the address: cuBLASLt's algorithms state the
// alignment they need, and slices into qkv are only as aligned as the head size makes them.
std::uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t align = 256;
  while (align > 1 && (a % align) != 0) align /= 2;
  return align;
}

// One matrix product, row-major: C[M,N] = alpha op(A) op(B) + beta C, `batch` times with the given
// element strides, optionally + bias[N] on every row (epilogue). The row-major product is the
// column-major product C^T = op(B)^T op(A)^T, which is what cuBLASLt is asked for.
struct Gemm {
  bool ta = false, tb = false;
  int M = 0, N = 0, K = 0;
  const void* A = nullptr;
  DType a_type = DType::f32;
  int lda = 0;
  const void* B = nullptr;
  DType b_type = DType::f32;
  int ldb = 0;
  void* C = nullptr;
  DType c_type = DType::f32;
  int ldc = 0;
  float alpha = 1.0f, beta = 0.0f;
  const float* bias = nullptr;
  int batch = 1;
  long long stride_a = 0, stride_b = 0, stride_c = 0;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, int tf32) : device_(device), tf32_mode_(tf32) {
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    check_cuda(cudaGetDeviceProperties(&props_, device_), "cudaGetDeviceProperties");
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    check_lt(cublasLtCreate(&lt_), "cublasLtCreate");
    const char* profile = std::getenv("LOOM_CUDA_PROFILE");
    profile_ = profile && *profile && std::string(profile) != "0";
    // What it takes as workspace is planned in core/backend/workspace_plan.hpp (`loom plan` reads it).
    workspace_ = allocate("cuda.cublaslt_workspace", DType::u8, cuda_plan::kCublasLtWorkspaceBytes, Mem::workspace);
  }
  ~CudaBackend() override {
    cudaStreamSynchronize(stream_);
    if (profile_) report_times();
#ifdef LOOM_CUDA_CUDNN
    cudnn_plans_.clear();  // before their handle
    if (cudnn_handle_) cudnn::destroy_handle(*cudnn::library(nullptr), cudnn_handle_);
#endif
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
    for (auto& [key, algo] : algos_) (void)algo;
    cublasLtDestroy(lt_);
    cudaStreamDestroy(stream_);
  }

  // LOOM_CUDA_PROFILE=1: each operation between two events on the stream, summed per operation
  // (matrix products and attention per shape) and printed to stderr when the back end ends. The
  // events are read when the stream is synchronised anyway, so timing adds no synchronisation.
  class Timed {
   public:
    Timed(CudaBackend* be, const char* op, int a = 0, int b = 0, int c = 0) : be_(be->profile_ ? be : nullptr) {
      if (!be_) return;
      key_ = op;
      if (a || b || c) key_ += " " + std::to_string(a) + "x" + std::to_string(b) + "x" + std::to_string(c);
      start_ = be_->event();
    }
    ~Timed() {
      if (be_) be_->pending_.push_back({key_, start_, be_->event()});
    }

   private:
    CudaBackend* be_;
    std::string key_;
    cudaEvent_t start_ = nullptr;
  };
  std::string name() const override { return "cuda"; }
  std::string description() const override {
    std::ostringstream s;
    int runtime = 0, driver = 0;
    cudaRuntimeGetVersion(&runtime);
    cudaDriverGetVersion(&driver);
    s << "cuda (device " << device_ << ": " << props_.name << ", " << props_.multiProcessorCount << " SMs, "
      << (props_.totalGlobalMem >> 20) << " MiB, compute capability " << props_.major << "." << props_.minor
      << "; CUDA runtime " << runtime / 1000 << "." << (runtime % 1000) / 10 << ", driver " << driver / 1000 << "."
      << (driver % 1000) / 10 << "; cuBLASLt " << cublasLtGetVersion() << ", fp32 products "
      << (tf32() ? "TF32" : "full fp32") << (tf32_mode_ == 2 ? " (run.tf32 = auto)" : "") << ")";
    // Each group's way (NCCL, or host copies where its ranks share a GPU); one phrase when all agree.
    std::map<std::string, std::vector<std::string>> groups_by_note;
    for (const auto& [group, note] : comm_notes_) groups_by_note[note].push_back(group);
    if (groups_by_note.size() == 1) s << "; device buffers between ranks: " << groups_by_note.begin()->first;
    for (std::size_t i = 0; groups_by_note.size() > 1 && i < comm_order_.size(); ++i) {
      const std::string& note = comm_notes_.at(comm_order_[i]);
      if (groups_by_note.count(note) == 0) continue;  // already said with its first group
      s << (i == 0 ? "; device buffers between ranks: " : "; ");
      const std::vector<std::string>& gs = groups_by_note[note];
      for (std::size_t g = 0; g < gs.size(); ++g) s << (g ? ", " : "") << gs[g];
      s << ": " << note;
      groups_by_note.erase(note);
    }
    return s.str();
  }
  MemSpace space() const override { return MemSpace::device; }
  // NCCL where every rank of the group drives a GPU of its own; a group whose ranks share a GPU
  // (run.share_gpu; NCCL refuses it) or a one-rank group (nothing to move: no need for NCCL on a
  // one-GPU node) stages device buffers through host copies and MPI.
  std::unique_ptr<Communicator> make_communicator(MPI_Comm comm, const std::string& name) override {
    int size = 1;
    MPI_Comm_size(comm, &size);
    if (size == 1) return Backend::make_communicator(comm, name);
    std::vector<cudaUUID_t> uuids(static_cast<std::size_t>(size));
    MPI_Allgather(&props_.uuid, sizeof(cudaUUID_t), MPI_BYTE, uuids.data(), sizeof(cudaUUID_t), MPI_BYTE, comm);
    bool shared = false;
    for (int a = 0; a < size; ++a)
      for (int b = a + 1; b < size; ++b)
        shared = shared || std::memcmp(&uuids[static_cast<std::size_t>(a)], &uuids[static_cast<std::size_t>(b)],
                                       sizeof(cudaUUID_t)) == 0;
#ifdef LOOM_CUDA_NCCL
    if (!shared) {
      note_comm(name, nccl_description());
      return make_nccl_communicator(comm, name, stream_);
    }
#endif
    note_comm(name, shared ? "host copies over MPI (ranks share a GPU)"
                           : "host copies over MPI (this loom was built without NCCL)");
    return Backend::make_communicator(comm, name);
  }
  void set_precision(const Precision& p) override {
    if (p.matmul != DType::f32 && p.matmul != DType::bf16 && p.matmul != DType::f16)
      refuse(std::string("precision: matrix products in ") + dtype_name(p.matmul) +
             "; the cuda back end takes fp32, bf16 or fp16");
    precision_ = p;
  }
  void release_scratch() override {
    synchronize();
    for (TypedBuffer& b : operands_) b = TypedBuffer();
    att_scratch_ = TypedBuffer();
    for (TypedBuffer& b : cudnn_stage_) b = TypedBuffer();
  }
  TypedBuffer allocate(const std::string& label, DType type, std::int64_t count, Mem category) override {
    const std::size_t bytes = static_cast<std::size_t>(count) * dtype_size(type);
    void* p = nullptr;
    if (bytes > 0) {
      const cudaError_t e = cudaMalloc(&p, bytes);
      if (e != cudaSuccess) {
        std::size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        throw std::runtime_error("cuda: cannot allocate " + label + " (" + std::to_string(bytes >> 20) +
                                 " MiB) on device " + std::to_string(device_) + ": " + cudaGetErrorString(e) + "; " +
                                 std::to_string(free_b >> 20) + " of " + std::to_string(total_b >> 20) + " MiB free");
      }
      check_cuda(cudaMemsetAsync(p, 0, bytes, stream_), "cudaMemsetAsync");
    }
    return TypedBuffer(BufferRef(p, type, count, MemSpace::device), category, [](void* q) { cudaFree(q); });
  }
  void copy_from_host(BufferRef buffer, const void* src) override {
    require_device(buffer, "copy_from_host", "buffer");
    if (buffer.bytes() == 0) return;
    check_cuda(cudaMemcpyAsync(buffer.data, src, buffer.bytes(), cudaMemcpyHostToDevice, stream_), "copy to device");
    synchronize();  // the caller may reuse its host memory at once
  }
  void copy_to_host(void* dst, BufferRef buffer) override {
    require_device(buffer, "copy_to_host", "buffer");
    if (buffer.bytes() == 0) return;
    check_cuda(cudaMemcpyAsync(dst, buffer.data, buffer.bytes(), cudaMemcpyDeviceToHost, stream_), "copy to host");
    synchronize();
  }
  void synchronize() override {
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    settle();
  }

  // ---- the model's kernels -------------------------------------------------------------------
  // Each operation unpacks its operands with dev<T>(buffer, need): device memory, the element type
  // the kernel takes and at least the elements the shapes name, or std::invalid_argument.
  void encoder_forward(BufferRef out, BufferRef inp, BufferRef wte, BufferRef wpe, int B, int T, int C, int vocab_begin,
                       int vocab_end, bool add_pos) override {
    Timed timed(this, "encoder_forward");
    const std::int64_t N = std::int64_t(B) * T;
    cuda::encoder_forward(dev<float>(out, N * C), dev<const std::int32_t>(inp, N),
                          dev<const float>(wte, std::int64_t(vocab_end - vocab_begin) * C),
                          dev_optional<const float>(wpe, std::int64_t(T) * C), B, T, C, vocab_begin, vocab_end, add_pos,
                          stream_);
  }
  void encoder_backward(BufferRef dwte, BufferRef dwpe, BufferRef dout, BufferRef inp, int B, int T, int C,
                        int vocab_begin, int vocab_end) override {
    Timed timed(this, "encoder_backward");
    const std::int64_t N = std::int64_t(B) * T;
    cuda::encoder_backward(dev<float>(dwte, std::int64_t(vocab_end - vocab_begin) * C),
                           dev_optional<float>(dwpe, std::int64_t(T) * C), dev<const float>(dout, N * C),
                           dev<const std::int32_t>(inp, N), B, T, C, vocab_begin, vocab_end, stream_);
  }
  void layernorm_forward(BufferRef out, BufferRef mean, BufferRef rstd, BufferRef inp, BufferRef weight, BufferRef bias,
                         int N, int C) override {
    Timed timed(this, "layernorm_forward");
    const std::int64_t NC = std::int64_t(N) * C;
    const BufferRef o = output(out, NC, "layernorm_forward");
    cuda::layernorm_forward(o.data, o.type, dev<float>(mean, N), dev<float>(rstd, N), dev<const float>(inp, NC),
                            dev<const float>(weight, C), dev<const float>(bias, C), N, C, stream_);
  }
  void residual_layernorm_forward(BufferRef residual, BufferRef out, BufferRef mean, BufferRef rstd, BufferRef a,
                                  BufferRef b, BufferRef weight, BufferRef bias, int N, int C) override {
    Timed timed(this, "residual_layernorm_forward");
    const std::int64_t NC = std::int64_t(N) * C;
    const BufferRef o = output(out, NC, "residual_layernorm_forward");
    cuda::residual_layernorm_forward(dev<float>(residual, NC), o.data, o.type, dev<float>(mean, N), dev<float>(rstd, N),
                                     dev<const float>(a, NC), dev<const float>(b, NC), dev<const float>(weight, C),
                                     dev<const float>(bias, C), N, C, stream_);
  }
  void layernorm_backward(BufferRef dinp, BufferRef dweight, BufferRef dbias, BufferRef dout, BufferRef inp,
                          BufferRef weight, BufferRef mean, BufferRef rstd, int N, int C) override {
    Timed timed(this, "layernorm_backward");
    const std::int64_t NC = std::int64_t(N) * C;
    cuda::layernorm_backward(dev<float>(dinp, NC), dev<float>(dweight, C), dev<float>(dbias, C),
                             dev<const float>(dout, NC), dev<const float>(inp, NC), dev<const float>(weight, C),
                             dev<const float>(mean, N), dev<const float>(rstd, N), N, C, workspace_scratch<float>(),
                             workspace_scratch_count<float>(), stream_);
  }
  void rmsnorm_forward(BufferRef out, BufferRef rstd, BufferRef inp, BufferRef weight, int N, int C,
                       float eps) override {
    Timed timed(this, "rmsnorm_forward");
    const std::int64_t NC = std::int64_t(N) * C;
    const BufferRef o = output(out, NC, "rmsnorm_forward");
    cuda::rmsnorm_forward(o.data, o.type, dev<float>(rstd, N), dev<const float>(inp, NC), dev<const float>(weight, C),
                          N, C, eps, stream_);
  }
  void rmsnorm_backward(BufferRef dinp, BufferRef dweight, BufferRef dout, BufferRef inp, BufferRef weight,
                        BufferRef rstd, int N, int C) override {
    Timed timed(this, "rmsnorm_backward");
    const std::int64_t NC = std::int64_t(N) * C;
    cuda::rmsnorm_backward(dev<float>(dinp, NC), dev<float>(dweight, C), dev<const float>(dout, NC),
                           dev<const float>(inp, NC), dev<const float>(weight, C), dev<const float>(rstd, N), N, C,
                           workspace_scratch<float>(), workspace_scratch_count<float>(), stream_);
  }
  void rope_gqa_forward(BufferRef qkv, BufferRef q, BufferRef k, BufferRef v, int N, int T, int NH, int KV, int hs,
                        int head0, int kv0, int group, float theta) override {
    Timed timed(this, "rope_gqa_forward");
    const std::int64_t C = std::int64_t(NH) * hs, CK = std::int64_t(KV) * hs;
    cuda::rope_gqa_forward(dev<float>(qkv, 3 * N * C), dev<const float>(q, N * C), dev<const float>(k, N * CK),
                           dev<const float>(v, N * CK), N, T, NH, KV, hs, head0, kv0, group, theta, stream_);
  }
  void rope_gqa_backward(BufferRef dq, BufferRef dk, BufferRef dv, BufferRef dqkv, int N, int T, int NH, int KV, int hs,
                         int head0, int kv0, int group, float theta) override {
    Timed timed(this, "rope_gqa_backward");
    const std::int64_t C = std::int64_t(NH) * hs, CK = std::int64_t(KV) * hs;
    cuda::rope_gqa_backward(dev<float>(dq, N * C), dev<float>(dk, N * CK), dev<float>(dv, N * CK),
                            dev<const float>(dqkv, 3 * N * C), N, T, NH, KV, hs, head0, kv0, group, theta, stream_);
  }
  void swiglu_forward(BufferRef out, BufferRef gate, BufferRef up, std::int64_t n) override {
    Timed timed(this, "swiglu_forward");
    const BufferRef o = output(out, n, "swiglu_forward");
    cuda::swiglu_forward(o.data, o.type, dev<const float>(gate, n), dev<const float>(up, n), n, stream_);
  }
  void swiglu_backward(BufferRef dgate, BufferRef dup, BufferRef dout, BufferRef gate, BufferRef up,
                       std::int64_t n) override {
    Timed timed(this, "swiglu_backward");
    const BufferRef g = output(dgate, n, "swiglu_backward"), u = output(dup, n, "swiglu_backward");
    if (g.type != u.type) throw std::invalid_argument("swiglu_backward: dgate and dup of one type");
    cuda::swiglu_backward(g.data, u.data, g.type, dev<const float>(dout, n), dev<const float>(gate, n),
                          dev<const float>(up, n), n, stream_);
  }
  void bias_add(BufferRef out, BufferRef bias, int N, int OC) override {
    Timed timed(this, "bias_add");
    cuda::bias_add(dev<float>(out, std::int64_t(N) * OC), dev<const float>(bias, OC), N, OC, stream_);
  }
  void bias_backward(BufferRef dbias, BufferRef dout, int N, int OC) override {
    Timed timed(this, "bias_backward");
    cuda::bias_backward(dev<float>(dbias, OC), dev<const float>(dout, std::int64_t(N) * OC), N, OC,
                        workspace_scratch<float>(), workspace_scratch_count<float>(), stream_);
  }
  void matmul_forward(BufferRef out, BufferRef inp, BufferRef weight, BufferRef bias, int N, int C, int OC) override {
    Timed timed(this, "matmul_forward", N, C, OC);
    float* o = dev<float>(out, std::int64_t(N) * OC);
    const BufferRef x = operand(cuda_plan::kInp, inp, static_cast<std::int64_t>(N) * C);         // [N,C]
    const BufferRef w = operand(cuda_plan::kWeight, weight, static_cast<std::int64_t>(OC) * C);  // [OC,C]
    Gemm g;                                                                                      // out = x W^T (+ bias)
    g.ta = false, g.tb = true, g.M = N, g.N = OC, g.K = C;
    g.A = x.data, g.a_type = x.type, g.lda = C;
    g.B = w.data, g.b_type = w.type, g.ldb = C;
    g.C = o, g.ldc = OC;
    g.bias = dev_optional<const float>(bias, OC);
    gemm(g);
  }
  // pre through matmul_forward (cuBLASLt's bias epilogue), then the GELU kernel. cuBLASLt's
  // GELU_AUX_BIAS epilogue would save the kernel's read of pre; it awaits a GPU to be measured and
  // checked against loom's GELU (the emulator does not model it).
  void matmul_forward_gelu(BufferRef out, BufferRef pre, BufferRef inp, BufferRef weight, BufferRef bias, int N, int C,
                           int OC) override {
    matmul_forward(pre, inp, weight, bias, N, C, OC);
    Timed timed(this, "gelu_forward", N, OC);
    const std::int64_t n = std::int64_t(N) * OC;
    const BufferRef o = output(out, n, "matmul_forward_gelu");
    cuda::gelu_forward(o.data, o.type, dev<const float>(pre, n), n, stream_);
  }
  void gelu_bias_backward(BufferRef dpre, BufferRef dbias, BufferRef pre, BufferRef dout, int N, int OC) override {
    Timed timed(this, "gelu_bias_backward", N, OC);
    const std::int64_t n = std::int64_t(N) * OC;
    const BufferRef o = output(dpre, n, "gelu_bias_backward");
    cuda::gelu_bias_backward(o.data, o.type, dev_optional<float>(dbias, OC), dev<const float>(pre, n),
                             dev<const float>(dout, n), N, OC, workspace_scratch<float>(),
                             workspace_scratch_count<float>(), stream_);
  }
  void matmul_backward(BufferRef dinp, BufferRef dweight, BufferRef dbias, BufferRef dout, BufferRef inp,
                       BufferRef weight, int N, int C, int OC) override {
    Timed timed(this, "matmul_backward", N, C, OC);
    float* di = dev<float>(dinp, std::int64_t(N) * C);
    float* dw = dev<float>(dweight, std::int64_t(OC) * C);
    float* db = dev_optional<float>(dbias, OC);
    // dout may be 16-bit already (its producer rounded it: gelu_bias_backward, crossentropy_backward),
    // then without a bias.
    if (db && dout.type != DType::f32)
      refuse(std::string("matmul_backward: a ") + dtype_name(dout.type) +
             " dout with a bias gradient (the bias sums fp32 gradients: pass dout in fp32)");
    const float* dout32 = db ? dev<const float>(dout, std::int64_t(N) * OC) : nullptr;
    // A 16-bit run with a bias: the bias's column sums and dout's rounded copy in one pass over dout.
    const bool fused = db && precision_.matmul != DType::f32;
    const BufferRef d = fused ? slot(cuda_plan::kDout, precision_.matmul, static_cast<std::int64_t>(N) * OC)
                              : operand(cuda_plan::kDout, dout, static_cast<std::int64_t>(N) * OC);  // [N,OC]
    if (fused)
      cuda::bias_backward_cast(db, d.data, d.type, dout32, N, OC, workspace_scratch<float>(),
                               workspace_scratch_count<float>(), stream_);
    const BufferRef w = operand(cuda_plan::kWeight, weight, static_cast<std::int64_t>(OC) * C);  // [OC,C]
    const BufferRef x = operand(cuda_plan::kInp, inp, static_cast<std::int64_t>(N) * C);         // [N,C]
    Gemm g;                                                                                      // dinp = dout W
    g.M = N, g.N = C, g.K = OC;
    g.A = d.data, g.a_type = d.type, g.lda = OC;
    g.B = w.data, g.b_type = w.type, g.ldb = C;
    g.C = di, g.ldc = C;
    gemm(g);
    Gemm h;  // dW += dout^T x
    h.ta = true, h.M = OC, h.N = C, h.K = N;
    h.A = d.data, h.a_type = d.type, h.lda = OC;
    h.B = x.data, h.b_type = x.type, h.ldb = C;
    h.C = dw, h.ldc = C, h.beta = 1.0f;
    gemm(h);
    if (db && !fused)  // a sum, not a product: fp32
      cuda::bias_backward(db, dout32, N, OC, workspace_scratch<float>(), workspace_scratch_count<float>(), stream_);
  }
  void attention_forward(BufferRef out_ref, BufferRef att_ref, BufferRef qkv_ref, int B, int T, int C,
                         int NH) override {
    Timed timed(this, "attention_forward", B * T, C, NH);
    const std::int64_t NC = std::int64_t(B) * T * C;
    float* out = dev<float>(out_ref, NC);
    float* att = dev<float>(att_ref, std::int64_t(B) * NH * T * T);
    const float* qkv = dev<const float>(qkv_ref, 3 * NC);
    const int hs = C / NH, C3 = 3 * C;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
    for (int b = 0; b < B; ++b) {  // per sequence, every head in one batched product
      const float* q = qkv + static_cast<std::int64_t>(b) * T * C3;
      float* a = att + static_cast<std::int64_t>(b) * NH * T * T;
      Gemm g;  // scores_h = q_h k_h^T / sqrt(hs)
      g.tb = true, g.M = T, g.N = T, g.K = hs;
      g.A = q, g.lda = C3, g.B = q + C, g.ldb = C3, g.C = a, g.ldc = T, g.alpha = scale;
      g.batch = NH, g.stride_a = hs, g.stride_b = hs, g.stride_c = static_cast<long long>(T) * T;
      gemm(g);
    }
    cuda::softmax_causal_forward(att, B * NH * T, T, stream_);
    for (int b = 0; b < B; ++b) {
      const float* v = qkv + static_cast<std::int64_t>(b) * T * C3 + 2 * C;
      Gemm g;  // out_h = att_h v_h
      g.M = T, g.N = hs, g.K = T;
      g.A = att + static_cast<std::int64_t>(b) * NH * T * T, g.lda = T, g.B = v, g.ldb = C3;
      g.C = out + static_cast<std::int64_t>(b) * T * C, g.ldc = C;
      g.batch = NH, g.stride_a = static_cast<long long>(T) * T, g.stride_b = hs, g.stride_c = hs;
      gemm(g);
    }
  }
  // datt ([T,T] on the host, one head at a time) is not used: the heads of a sequence run batched
  // in the back end's own [NH,T,T] scratch.
  void attention_backward(BufferRef dqkv_ref, BufferRef /*datt*/, BufferRef dout_ref, BufferRef qkv_ref,
                          BufferRef att_ref, int B, int T, int C, int NH) override {
    Timed timed(this, "attention_backward", B * T, C, NH);
    const std::int64_t NC = std::int64_t(B) * T * C;
    float* dqkv = dev<float>(dqkv_ref, 3 * NC);
    const float* dout = dev<const float>(dout_ref, NC);
    const float* qkv = dev<const float>(qkv_ref, 3 * NC);
    const float* att = dev<const float>(att_ref, std::int64_t(B) * NH * T * T);
    const int hs = C / NH, C3 = 3 * C;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
    const long long TT = static_cast<long long>(T) * T;
    ensure_capacity(*this, att_scratch_, "cuda.attention_datt", DType::f32, cuda_plan::attention_scratch_floats(NH, T),
                    Mem::workspace);
    float* datt = att_scratch_.data<float>();  // [NH,T,T]
    for (int b = 0; b < B; ++b) {
      const std::int64_t base = static_cast<std::int64_t>(b) * T * C3;
      const float* q = qkv + base;
      const float* k = q + C;
      const float* v = q + 2 * C;
      float* dq = dqkv + base;
      float* dk = dq + C;
      float* dv = dq + 2 * C;
      const float* a = att + static_cast<std::int64_t>(b) * NH * TT;
      const float* d = dout + static_cast<std::int64_t>(b) * T * C;
      Gemm g1;  // dv_h = att_h^T dout_h
      g1.ta = true, g1.M = T, g1.N = hs, g1.K = T;
      g1.A = a, g1.lda = T, g1.B = d, g1.ldb = C, g1.C = dv, g1.ldc = C3;
      g1.batch = NH, g1.stride_a = TT, g1.stride_b = hs, g1.stride_c = hs;
      gemm(g1);
      Gemm g2;  // datt_h = dout_h v_h^T
      g2.tb = true, g2.M = T, g2.N = T, g2.K = hs;
      g2.A = d, g2.lda = C, g2.B = v, g2.ldb = C3, g2.C = datt, g2.ldc = T;
      g2.batch = NH, g2.stride_a = hs, g2.stride_b = hs, g2.stride_c = TT;
      gemm(g2);
      cuda::softmax_causal_backward(datt, a, NH * T, T, stream_);
      Gemm g3;  // dq_h = dscores_h k_h / sqrt(hs)
      g3.M = T, g3.N = hs, g3.K = T, g3.alpha = scale;
      g3.A = datt, g3.lda = T, g3.B = k, g3.ldb = C3, g3.C = dq, g3.ldc = C3;
      g3.batch = NH, g3.stride_a = TT, g3.stride_b = hs, g3.stride_c = hs;
      gemm(g3);
      Gemm g4;  // dk_h = dscores_h^T q_h / sqrt(hs)
      g4.ta = true, g4.M = T, g4.N = hs, g4.K = T, g4.alpha = scale;
      g4.A = datt, g4.lda = T, g4.B = q, g4.ldb = C3, g4.C = dk, g4.ldc = C3;
      g4.batch = NH, g4.stride_a = TT, g4.stride_b = hs, g4.stride_c = hs;
      gemm(g4);
    }
  }
  std::string flash_attention_refusal(int hs) const override {
    if (props_.major < 8)
      return "device " + std::to_string(device_) + " has compute capability " + std::to_string(props_.major) + "." +
             std::to_string(props_.minor) + "; the fused kernels' bf16 tensor-core products need 8.0 or newer";
    const int built = cuda::flash_attention_built_arch();
    if (built < 80)
      return "libloom_cuda.so's fused kernels run here as compiled for compute capability " +
             std::to_string(built / 10) + "." + std::to_string(built % 10) +
             " (CMAKE_CUDA_ARCHITECTURES), without bf16 tensor-core products; rebuild with "
             "-DCMAKE_CUDA_ARCHITECTURES covering 80 or newer (the default: 80;90)";
    if (std::string why = flash_head_size_refusal(hs); !why.empty()) return why;
    const std::size_t need = cuda::flash_attention_shared_bytes(hs);
    if (need > props_.sharedMemPerBlockOptin)
      return "head size " + std::to_string(hs) + " needs " + std::to_string(need) +
             " bytes of shared memory per block; device " + std::to_string(device_) + " (" + props_.name + ") has " +
             std::to_string(props_.sharedMemPerBlockOptin);
    return {};
  }
  // Ring attention (context parallelism): core/cuda/ring_attention.cuh, the host's
  // core/backend/ring_attention_host.hpp on the device (one warp per row, no atomics; any head size).
  std::string ring_attention_refusal() const override { return ""; }
  void attention_ring_forward(BufferRef out, BufferRef lse, BufferRef qkv, BufferRef kv, int B, int T, int C, int NH,
                              int q_begin, int kv_rows, bool causal, bool bf16) override {
    Timed timed(this, "attention_ring_forward", B * T, C, NH);
    const std::int64_t NC = std::int64_t(B) * T * C;
    cuda::attention_ring_forward(dev<float>(out, NC), dev<float>(lse, std::int64_t(B) * NH * T),
                                 dev<const float>(qkv, 3 * NC), dev<const float>(kv, 2 * NC), B, T, C, NH, q_begin,
                                 kv_rows, causal, bf16, stream_);
  }
  void attention_ring_backward(BufferRef dqkv, BufferRef dkv, BufferRef dsum, BufferRef dout, BufferRef out,
                               BufferRef qkv, BufferRef kv, BufferRef lse, int B, int T, int C, int NH, int q_begin,
                               int kv_rows, bool causal, bool bf16) override {
    Timed timed(this, "attention_ring_backward", B * T, C, NH);
    const std::int64_t NC = std::int64_t(B) * T * C, rows = std::int64_t(B) * NH * T;
    require_device(out, "attention_ring_backward", "out");
    if (out.count < NC) refuse("attention_ring_backward: out holds " + std::to_string(out.count) + " elements");
    cuda::attention_ring_backward(dev<float>(dqkv, 3 * NC), dev<float>(dkv, 2 * NC), dev<float>(dsum, rows),
                                  dev<const float>(dout, NC), out, dev<const float>(qkv, 3 * NC),
                                  dev<const float>(kv, 2 * NC), dev<const float>(lse, rows), B, T, C, NH, q_begin,
                                  kv_rows, causal, bf16, stream_);
  }
  void copy_rows(BufferRef dst, BufferRef src, std::int64_t rows, std::int64_t cols, std::int64_t dst_ld,
                 std::int64_t src_ld) override {
    Timed timed(this, "copy_rows");
    if (rows <= 0) return;
    cuda::copy_rows(dev<float>(dst, (rows - 1) * dst_ld + cols), dev<const float>(src, (rows - 1) * src_ld + cols),
                    rows, cols, dst_ld, src_ld, stream_);
  }
  // Mixture of experts' row operations: core/cuda/expert_rows.cuh, the host's kernels bit for bit (one
  // thread an element; rows_dot half a warp a row, in lane_sum's order; no atomics).
  std::string expert_rows_refusal() const override { return ""; }
  void rows_gather(BufferRef out, BufferRef x, BufferRef rows, BufferRef scale, int n, int C) override {
    Timed timed(this, "rows_gather", n, C);
    if (n <= 0) return;
    const std::int32_t* r = dev<const std::int32_t>(rows, n);
    const std::int64_t nC = std::int64_t(n) * C;
    if (!scale.empty()) {
      cuda::rows_gather(dev<float>(out, nC), dev<const float>(x, C), DType::f32, r, dev<const float>(scale, n), n, C,
                        stream_);
      return;
    }
    if (out.type != x.type)
      refuse(std::string("rows_gather: out is ") + dtype_name(out.type) + ", x " + dtype_name(x.type) +
             " (a gather without scale keeps the type)");
    const BufferRef o = output(out, nC, "rows_gather");
    require_device(x, "rows_gather", "x");
    if (x.count < C)
      refuse("rows_gather: x holds " + std::to_string(x.count) + " elements, a row of " + std::to_string(C) +
             " needed");
    cuda::rows_gather(o.data, x.data, o.type, r, nullptr, n, C, stream_);
  }
  void rows_scatter_add(BufferRef out, BufferRef y, BufferRef rows, BufferRef scale, int n, int C) override {
    Timed timed(this, "rows_scatter_add", n, C);
    if (n <= 0) return;
    cuda::rows_scatter_add(dev<float>(out, C), dev<const float>(y, std::int64_t(n) * C),
                           dev<const std::int32_t>(rows, n), dev_optional<const float>(scale, n), n, C, stream_);
  }
  void rows_dot(BufferRef out, BufferRef x, BufferRef rows, BufferRef y, int n, int C) override {
    Timed timed(this, "rows_dot", n, C);
    if (n <= 0) return;
    cuda::rows_dot(dev<float>(out, n), dev<const float>(x, C), dev<const std::int32_t>(rows, n),
                   dev<const float>(y, std::int64_t(n) * C), n, C, stream_);
  }
  void attention_forward_flash(BufferRef out, BufferRef lse, BufferRef qkv, int B, int T, int C, int NH) override {
    Timed timed(this, "attention_forward_flash", B * T, C, NH);
    const std::int64_t NC = std::int64_t(B) * T * C;
    cuda::attention_forward_flash(output(out, NC, "attention_forward_flash"), dev<float>(lse, std::int64_t(B) * NH * T),
                                  dev<const float>(qkv, 3 * NC), B, T, C, NH, stream_);
  }
  // cuDNN's fused attention (core/cuda/cudnn_attention.hpp). Its graphs take bf16 q, k, v, out and dout
  // and store bf16 gradients: the model's fp32 qkv, dout and dqkv go through bf16 staging (a cast each
  // way, as the flash kernel rounds its operands), out too unless the model saved it in bf16. The
  // statistics are the model's lse; the backward's row sums of dout * out its dsum.
  std::string cudnn_attention_refusal(int T, int hs) const override {
    if (std::string why = cudnn_shape_refusal(T, hs); !why.empty()) return why;
#ifdef LOOM_CUDA_CUDNN
    if (props_.major < 8)
      return "device " + std::to_string(device_) + " has compute capability " + std::to_string(props_.major) + "." +
             std::to_string(props_.minor) + "; cuDNN's fused attention needs 8.0 or newer";
    const auto verdict = cudnn_verdicts_.find({T, hs});
    if (verdict != cudnn_verdicts_.end()) return verdict->second;
    std::string why;
    if (cudnn::library(&why)) {
      try {  // cuDNN's own answer for this device and shape: both plans for one sequence of one head
        cudnn_plan(cudnn::Graph::Kind::forward, {1, T, 1, hs});
        cudnn_plan(cudnn::Graph::Kind::backward, {1, T, 1, hs});
      } catch (const std::exception& e) {
        why = e.what();
      }
    }
    cudnn_verdicts_[{T, hs}] = why;
    return why;
#elif defined(LOOM_CUDA_EMULATED)
    return "the emulated device runs no cuDNN (cuDNN's kernels need a GPU; its fused path here is model.attention "
           "= flash)";
#else
    return "libloom_cuda.so was built without cuDNN's headers (cudnn_graph.h: install cuDNN 9 and rebuild)";
#endif
  }
  void attention_forward_cudnn(BufferRef out, BufferRef lse, BufferRef qkv, int B, int T, int C, int NH) override {
    if (std::string why = cudnn_attention_refusal(T, C / NH); !why.empty()) throw std::logic_error(why);
#ifdef LOOM_CUDA_CUDNN
    Timed timed(this, "attention_forward_cudnn", B * T, C, NH);
    const int hs = C / NH;
    const std::int64_t NC = std::int64_t(B) * T * C, rows = std::int64_t(B) * NH * T;
    const BufferRef o = output(out, NC, "attention_forward_cudnn");
    float* lse_d = dev<float>(lse, rows);
    // Every tensor of the graphs is declared 16-byte aligned: a model buffer that is not (a carved table
    // at an odd offset) goes through aligned staging.
    float* stats = aligned16(lse_d) ? lse_d : cudnn_stage(kStageStats, DType::f32, rows).as<float>();
    std::uint16_t* q = cudnn_qkv16(qkv, NC);
    const BufferRef o16 = o.type == DType::bf16 && aligned16(o.data) ? o : cudnn_stage(kStageOut, DType::bf16, NC);
    const cudnn::Plan& plan = cudnn_plan(cudnn::Graph::Kind::forward, {B, T, NH, hs});
    float scale = 1.0f / std::sqrt(static_cast<float>(hs)), fill = -INFINITY;
    std::map<std::int64_t, void*> ptrs{{cudnn::kQ, q},        {cudnn::kK, q + C},     {cudnn::kV, q + 2 * C},
                                       {cudnn::kO, o16.data}, {cudnn::kStats, stats}, { cudnn::kScale, &scale }};
    ptrs[cudnn::kFill] = &fill;
    plan.execute(cudnn_handle_, ptrs, cudnn_workspace(plan));
    if (o16.data != o.data) cuda::cast(o.data, o.type, o16.data, DType::bf16, NC, stream_);
    if (stats != lse_d) copy_device(lse_d, stats, rows * 4);
#else
    (void)out, (void)lse, (void)qkv, (void)B;
#endif
  }
  void attention_backward_cudnn(BufferRef dqkv, BufferRef dsum, BufferRef dout, BufferRef out, BufferRef qkv,
                                BufferRef lse, int B, int T, int C, int NH) override {
    if (std::string why = cudnn_attention_refusal(T, C / NH); !why.empty()) throw std::logic_error(why);
#ifdef LOOM_CUDA_CUDNN
    Timed timed(this, "attention_backward_cudnn", B * T, C, NH);
    const int hs = C / NH;
    const std::int64_t NC = std::int64_t(B) * T * C, rows = std::int64_t(B) * NH * T;
    require_device(out, "attention_backward_cudnn", "out");
    if (out.count < NC) refuse("attention_backward_cudnn: out holds " + std::to_string(out.count) + " elements");
    float* dq32 = dev<float>(dqkv, 3 * NC);
    float* dsum_d = dev<float>(dsum, rows);
    float* lse_d = dev<float>(lse, rows);
    float* softmax_sum = aligned16(dsum_d) ? dsum_d : cudnn_stage(kStageSum, DType::f32, rows).as<float>();
    float* stats = lse_d;
    if (!aligned16(lse_d)) {
      stats = cudnn_stage(kStageStats, DType::f32, rows).as<float>();
      copy_device(stats, lse_d, rows * 4);
    }
    std::uint16_t* q = cudnn_qkv16(qkv, NC);
    const BufferRef do16 = cudnn_stage(kStageDout, DType::bf16, NC);
    cuda::cast(do16.data, DType::bf16, dev<const float>(dout, NC), DType::f32, NC, stream_);
    BufferRef o16 = out;
    if (out.type != DType::bf16 || !aligned16(out.data)) {
      cuda_type(out.type, "attention_backward_cudnn");
      o16 = cudnn_stage(kStageOut, DType::bf16, NC);
      cuda::cast(o16.data, DType::bf16, out.data, out.type, NC, stream_);
    }
    const BufferRef dq16 = cudnn_stage(kStageDqkv, DType::bf16, 3 * NC);
    const cudnn::Plan& plan = cudnn_plan(cudnn::Graph::Kind::backward, {B, T, NH, hs});
    float scale = 1.0f / std::sqrt(static_cast<float>(hs)), fill = -INFINITY, one = 1.0f;
    auto* dq = static_cast<std::uint16_t*>(dq16.data);
    std::map<std::int64_t, void*> ptrs{{cudnn::kQ, q},          {cudnn::kK, q + C},     {cudnn::kV, q + 2 * C},
                                       {cudnn::kO, o16.data},   {cudnn::kStats, stats}, {cudnn::kDO, do16.data},
                                       {cudnn::kDQ, dq},        {cudnn::kDK, dq + C},   {cudnn::kDV, dq + 2 * C},
                                       {cudnn::kScale, &scale}, {cudnn::kOne, &one},    { cudnn::kFill, &fill }};
    ptrs[cudnn::kSoftmaxSum] = softmax_sum;
    plan.execute(cudnn_handle_, ptrs, cudnn_workspace(plan));
    cuda::cast(dq32, DType::f32, dq16.data, DType::bf16, 3 * NC, stream_);
#else
    (void)dqkv, (void)dsum, (void)dout, (void)out, (void)qkv, (void)lse, (void)B;
#endif
  }
  void attention_backward_flash(BufferRef dqkv, BufferRef dsum, BufferRef dout, BufferRef out, BufferRef qkv,
                                BufferRef lse, int B, int T, int C, int NH) override {
    Timed timed(this, "attention_backward_flash", B * T, C, NH);
    const std::int64_t NC = std::int64_t(B) * T * C, rows = std::int64_t(B) * NH * T;
    require_device(out, "attention_backward_flash", "out");
    if (out.count < NC) refuse("attention_backward_flash: out holds " + std::to_string(out.count) + " elements");
    cuda::attention_backward_flash(dev<float>(dqkv, 3 * NC), dev<float>(dsum, rows), dev<const float>(dout, NC), out,
                                   dev<const float>(qkv, 3 * NC), dev<const float>(lse, rows), B, T, C, NH, stream_);
  }
  void gelu_forward(BufferRef out, BufferRef inp, std::int64_t n) override {
    Timed timed(this, "gelu_forward");
    cuda::gelu_forward(dev<float>(out, n), DType::f32, dev<const float>(inp, n), n, stream_);
  }
  void gelu_backward(BufferRef dinp, BufferRef inp, BufferRef dout, std::int64_t n) override {
    Timed timed(this, "gelu_backward");
    cuda::gelu_backward(dev<float>(dinp, n), dev<const float>(inp, n), dev<const float>(dout, n), n, stream_);
  }
  void residual_forward(BufferRef out, BufferRef a, BufferRef b, std::int64_t n) override {
    Timed timed(this, "residual_forward");
    cuda::residual_forward(dev<float>(out, n), dev<const float>(a, n), dev<const float>(b, n), n, stream_);
  }
  void crossentropy_forward(BufferRef losses, BufferRef probs, BufferRef logits, BufferRef targets, int N,
                            int V) override {
    Timed timed(this, "crossentropy_forward");
    const std::int64_t NV = std::int64_t(N) * V;
    cuda::crossentropy_forward(dev<float>(losses, N), dev<float>(probs, NV), dev<const float>(logits, NV),
                               dev<const std::int32_t>(targets, N), N, V, stream_);
  }
  void crossentropy_fused(BufferRef losses, BufferRef dlogits, BufferRef logits, BufferRef targets, float dloss, int N,
                          int V) override {
    Timed timed(this, "crossentropy_fused");
    const std::int64_t NV = std::int64_t(N) * V;
    const BufferRef d = output(dlogits, NV, "crossentropy_fused");
    cuda::crossentropy_fused(dev<float>(losses, N), d.data, d.type, dev<const float>(logits, NV),
                             dev<const std::int32_t>(targets, N), dloss, N, V, stream_);
  }
  void crossentropy_backward(BufferRef dlogits, BufferRef probs, BufferRef targets, float dloss, int N, int V,
                             int vocab_begin) override {
    Timed timed(this, "crossentropy_backward");
    const std::int64_t NV = std::int64_t(N) * V;
    const BufferRef d = output(dlogits, NV, "crossentropy_backward");
    cuda::crossentropy_backward(d.data, d.type, dev<const float>(probs, NV), dev<const std::int32_t>(targets, N), dloss,
                                N, V, vocab_begin, stream_);
  }
  void crossentropy_row_max(BufferRef row_max, BufferRef logits, int N, int V) override {
    Timed timed(this, "crossentropy_row_max");
    cuda::crossentropy_row_max(dev<float>(row_max, N), dev<const float>(logits, std::int64_t(N) * V), N, V, stream_);
  }
  void crossentropy_partial(BufferRef probs, BufferRef sum_exp, BufferRef target_logit, BufferRef logits,
                            BufferRef row_max, BufferRef targets, int N, int V, int vocab_begin) override {
    Timed timed(this, "crossentropy_partial");
    const std::int64_t NV = std::int64_t(N) * V;
    cuda::crossentropy_partial(probs.empty() ? nullptr : dev<float>(probs, NV), dev<double>(sum_exp, N),
                               dev<double>(target_logit, N), dev<const float>(logits, NV), dev<const float>(row_max, N),
                               dev<const std::int32_t>(targets, N), N, V, vocab_begin, stream_);
  }
  void crossentropy_finish(BufferRef losses, BufferRef probs, BufferRef sum_exp, BufferRef row_max,
                           BufferRef target_logit, int N, int V) override {
    Timed timed(this, "crossentropy_finish");
    cuda::crossentropy_finish(dev<float>(losses, N), dev<float>(probs, std::int64_t(N) * V),
                              dev<const double>(sum_exp, N), dev<const float>(row_max, N),
                              dev<const double>(target_logit, N), N, V, stream_);
  }
  void crossentropy_finish_grad(BufferRef losses, BufferRef dlogits, BufferRef logits, BufferRef sum_exp,
                                BufferRef row_max, BufferRef target_logit, BufferRef targets, float dloss, int N, int V,
                                int vocab_begin) override {
    Timed timed(this, "crossentropy_finish_grad");
    const std::int64_t NV = std::int64_t(N) * V;
    const BufferRef d = output(dlogits, NV, "crossentropy_finish_grad");
    cuda::crossentropy_finish_grad(dev<float>(losses, N), d.data, d.type, dev<const float>(logits, NV),
                                   dev<const double>(sum_exp, N), dev<const float>(row_max, N),
                                   dev<const double>(target_logit, N), dev<const std::int32_t>(targets, N), dloss, N, V,
                                   vocab_begin, stream_);
  }
  void adamw_update(BufferRef params, BufferRef m, BufferRef v, BufferRef grads, std::int64_t n, float lr, float beta1,
                    float beta2, float eps, float weight_decay, std::int64_t t) override {
    Timed timed(this, "adamw_update");
    cuda::adamw_update(dev<float>(params, n), dev<float>(m, n), dev<float>(v, n), dev<const float>(grads, n), n, lr,
                       beta1, beta2, eps, weight_decay, t, stream_);
  }
  void adamw_update_slices(const std::vector<AdamWSlice>& slices, float lr, float beta1, float beta2, float eps,
                           std::int64_t t) override {
    Timed timed(this, "adamw_update_slices");
    std::vector<float*> p, m, v;
    std::vector<const float*> g;
    std::vector<std::int64_t> n;
    std::vector<float> wd;
    for (const AdamWSlice& s : slices) {
      p.push_back(dev<float>(s.params, s.n));
      m.push_back(dev<float>(s.m, s.n));
      v.push_back(dev<float>(s.v, s.n));
      g.push_back(dev<const float>(s.grads, s.n));
      n.push_back(s.n);
      wd.push_back(s.weight_decay);
    }
    cuda::adamw_update_slices(p.data(), m.data(), v.data(), g.data(), n.data(), wd.data(),
                              static_cast<int>(slices.size()), lr, beta1, beta2, eps, t, stream_);
  }
  double sum(BufferRef x, std::int64_t n) override {
    Timed timed(this, "sum");
    dev<const float>(x, n);
    return reduce_one(&cuda::sum, x.slice(0, n));
  }
  void copy(BufferRef dst, BufferRef src, std::int64_t n) override {
    Timed timed(this, "copy");
    float* d = dev<float>(dst, n);
    const float* s = dev<const float>(src, n);
    if (n > 0 && d != s)
      check_cuda(cudaMemcpyAsync(d, s, static_cast<std::size_t>(n) * sizeof(float), cudaMemcpyDeviceToDevice, stream_),
                 "copy");
  }

  void axpy(BufferRef y, float a, BufferRef x, std::int64_t n) override {
    Timed timed(this, "axpy");
    cuda::axpy(dev<float>(y, n), a, dev<const float>(x, n), n, stream_);
  }

  // ---- typed operations ----------------------------------------------------------------------
  void cast(BufferRef dst, BufferRef src) override {
    Timed timed(this, "cast");
    require_device(dst, "cast", "dst");
    require_device(src, "cast", "src");
    if (dst.count != src.count)
      refuse("cast: dst holds " + std::to_string(dst.count) + " elements, src " + std::to_string(src.count));
    cuda_type(dst.type, "cast");
    cuda_type(src.type, "cast");
    cuda::cast(dst.data, dst.type, src.data, src.type, dst.count, stream_);
  }
  void matmul(BufferRef out, BufferRef a, BufferRef b, int M, int N, int K, bool transa, bool transb, float alpha,
              float beta) override {
    Timed timed(this, "matmul", M, N, K);
    require_device(out, "matmul", "out");
    require_device(a, "matmul", "a");
    require_device(b, "matmul", "b");
    check_matmul_shapes(out, a, b, M, N, K);
    const bool f64 = a.type == DType::f64 || b.type == DType::f64 || out.type == DType::f64;
    if (f64 && !(a.type == DType::f64 && b.type == DType::f64 && out.type == DType::f64))
      refuse(std::string("matmul: operands of ") + dtype_name(out.type) + " = " + dtype_name(a.type) + " x " +
             dtype_name(b.type) + "; mixed operands are fp32, bf16 or fp16 (fp64 only with fp64)");
    for (const BufferRef* x : {&out, &a, &b}) cuda_type(x->type, "matmul");
    // cuBLASLt takes A and B of one type: a mixed pair goes through an fp32 copy of the 16-bit one.
    BufferRef pa = a, pb = b;
    if (!f64 && a.type != b.type) {
      if (a.type != DType::f32) pa = widened(0, a);
      if (b.type != DType::f32) pb = widened(1, b);
    }
    // fp32 operands into a 16-bit out: cuBLASLt has no such product, so through an fp32 copy of out,
    // rounded once (as the host does).
    BufferRef pc = out;
    if (!f64 && pa.type == DType::f32 && out.type != DType::f32) {
      TypedBuffer& buf = operands_[2];
      ensure_capacity(*this, buf, "cuda.matmul_operand2", DType::f32, out.count, Mem::workspace);
      pc = BufferRef(buf.ref().data, DType::f32, out.count, MemSpace::device);
      if (beta != 0.0f) cuda::cast(pc.data, DType::f32, out.data, out.type, out.count, stream_);
    }
    Gemm g;
    g.ta = transa, g.tb = transb, g.M = M, g.N = N, g.K = K;
    g.A = pa.data, g.a_type = pa.type, g.lda = std::max(1, transa ? M : K);
    g.B = pb.data, g.b_type = pb.type, g.ldb = std::max(1, transb ? K : N);
    g.C = pc.data, g.c_type = pc.type, g.ldc = std::max(1, N);
    g.alpha = alpha, g.beta = beta;
    gemm(g);
    if (pc.data != out.data) cuda::cast(out.data, out.type, pc.data, DType::f32, out.count, stream_);
  }
  NormCheck sq_norm_check(const std::vector<BufferRef>& tensors) override {
    Timed timed(this, "sq_norm_check");
    NormCheck r;
    if (tensors.empty()) return r;
    // Both reductions of a run of tensors of one type in two launches (cuda::norm_check), into a
    // device array, one copy back for all of them.
    const std::int64_t k = static_cast<std::int64_t>(tensors.size());
    ensure_capacity(*this, norm_out_, "cuda.norm_results", DType::f64, 2 * k, Mem::workspace);
    double* out = norm_out_.data<double>();
    std::vector<const void*> ptrs;
    std::vector<std::int64_t> counts;
    for (std::int64_t r0 = 0; r0 < k;) {
      const DType type = tensors[static_cast<std::size_t>(r0)].type;
      ptrs.clear();
      counts.clear();
      std::int64_t r1 = r0;
      for (; r1 < k && tensors[static_cast<std::size_t>(r1)].type == type; ++r1) {
        const BufferRef& t = tensors[static_cast<std::size_t>(r1)];
        require_device(t, "sq_norm_check", "a tensor");
        cuda_type(t.type, "sq_norm_check");
        ptrs.push_back(t.data);
        counts.push_back(t.count);
      }
      const int run = static_cast<int>(r1 - r0);
      // The partials in the workspace (norm_check_scratch_count: 2 x 1024 doubles per tensor at most,
      // 1 MiB a launch).
      if (cuda::norm_check_scratch_count(counts.data(), run) > workspace_scratch_count<double>())
        refuse("sq_norm_check: the partial sums outgrow the workspace");
      cuda::norm_check(out + r0, out + k + r0, ptrs.data(), counts.data(), run, type, workspace_scratch<double>(),
                       stream_);
      r0 = r1;
    }
    std::vector<double> host(static_cast<std::size_t>(2 * k));
    copy_to_host(host.data(), BufferRef(out, 2 * k, MemSpace::device));
    for (std::int64_t i = 0; i < k; ++i) {
      r.sum_squares += host[static_cast<std::size_t>(i)];
      if (host[static_cast<std::size_t>(k + i)] != 0 && r.all_finite) {
        r.all_finite = false;
        r.first_nonfinite = static_cast<int>(i);
      }
    }
    return r;
  }
  void scale(BufferRef x, double a) override {
    Timed timed(this, "scale");
    require_device(x, "scale", "x");
    cuda_type(x.type, "scale");
    cuda::scale(x.data, x.type, a, x.count, stream_);
  }
  void fill(BufferRef x, double value) override {
    Timed timed(this, "fill");
    require_device(x, "fill", "x");
    cuda_type(x.type, "fill");
    cuda::fill(x.data, x.type, value, x.count, stream_);
  }
  void int8_absmax(BufferRef absmax, BufferRef x, std::int64_t n, std::int64_t chunk) override {
    Timed timed(this, "int8_absmax");
    ensure_capacity(*this, norm_out_, "cuda.norm_results", DType::f64, 2, Mem::workspace);
    cuda::int8_absmax(dev<float>(absmax, chunks(n, chunk) + 1), dev<const float>(x, n), n, chunk,
                      norm_out_.data<double>(), reduce_scratch(n), stream_);
  }
  void int8_quantize(BufferRef q, BufferRef error, BufferRef x, std::int64_t n, std::int64_t chunk, BufferRef absmax,
                     int levels) override {
    Timed timed(this, "int8_quantize");
    cuda::int8_quantize(dev<std::int8_t>(q, n), dev_optional<float>(error, n), dev<const float>(x, n), n, chunk,
                        dev<const float>(absmax, chunks(n, chunk) + 1), levels, stream_);
  }
  void int8_dequantize(BufferRef x, BufferRef q, std::int64_t n, std::int64_t chunk, BufferRef absmax,
                       int levels) override {
    Timed timed(this, "int8_dequantize");
    cuda::int8_dequantize(dev<float>(x, n), dev<const std::int8_t>(q, n), n, chunk,
                          dev<const float>(absmax, chunks(n, chunk) + 1), levels, stream_);
  }
  void topk_select(BufferRef index, BufferRef value, BufferRef x, std::int64_t n, std::int64_t k) override {
    Timed timed(this, "topk_select");
    ensure_capacity(*this, topk_scratch_, "cuda.topk_scratch", DType::i32, cuda_plan::topk_scratch_bytes(n) / 4,
                    Mem::workspace);
    cuda::topk_select(dev<std::int32_t>(index, k), dev<float>(value, k), dev<const float>(x, n), n, k,
                      reinterpret_cast<std::uint32_t*>(topk_scratch_.data<std::int32_t>()), stream_);
  }
  std::int64_t topk_scratch_bytes(std::int64_t n) const override { return cuda_plan::topk_scratch_bytes(n); }
  void topk_scatter_add(BufferRef x, BufferRef index, BufferRef value, std::int64_t k) override {
    Timed timed(this, "topk_scatter_add");
    cuda::topk_scatter_add(dev<float>(x, 0), dev<const std::int32_t>(index, k), dev<const float>(value, k), k, stream_);
  }
  void topk_clear(BufferRef x, BufferRef index, std::int64_t k) override {
    Timed timed(this, "topk_clear");
    cuda::topk_clear(dev<float>(x, 0), dev<const std::int32_t>(index, k), k, stream_);
  }

 private:
  // An operand of an operation: device memory of element type T, at least `need` elements.
  template <class T>
  static T* dev(const BufferRef& b, std::int64_t need) {
    if (b.space != MemSpace::device && b.count > 0)
      refuse(std::string("a ") + mem_space_name(b.space) +
             " buffer reached the cuda back end, which takes device buffers");
    return b.as<T>(need);
  }
  template <class T>
  static T* dev_optional(const BufferRef& b, std::int64_t need) {
    return b.data == nullptr || b.count == 0 ? nullptr : dev<T>(b, need);
  }
  static std::int64_t chunks(std::int64_t n, std::int64_t chunk) { return chunk > 0 ? (n + chunk - 1) / chunk : 0; }
  using Reduction = void (*)(double*, const void*, DType, std::int64_t, double*, cudaStream_t);
  double* reduce_scratch(std::int64_t n) {
    ensure_capacity(*this, reduce_scratch_, "cuda.reduce_partials", DType::f64,
                    std::max<std::int64_t>(1, cuda::reduce_scratch_count(n)), Mem::workspace);
    return reduce_scratch_.data<double>();
  }
  double reduce_one(Reduction f, BufferRef x) {
    ensure_capacity(*this, norm_out_, "cuda.norm_results", DType::f64, 2, Mem::workspace);
    f(norm_out_.data<double>(), x.data, x.type, x.count, reduce_scratch(x.count), stream_);
    double v = 0;
    copy_to_host(&v, BufferRef(norm_out_.data<double>(), 1, MemSpace::device));
    return v;
  }

  // An fp32 kernel's output of n elements, stored as fp32, bf16 or fp16 (rounded once on store; the
  // kernels' wrappers refuse any other type, naming the operation).
  BufferRef output(BufferRef out, std::int64_t n, const char* op) {
    require_device(out, op, "out");
    if (out.count < n)
      refuse(std::string(op) + ": the output holds " + std::to_string(out.count) + " elements, " + std::to_string(n) +
             " needed");
    return BufferRef(out.data, out.type, n, MemSpace::device);
  }

  // The first n elements of `src` as a matrix-product operand in the run's precision: fp32 as it is
  // in an fp32 run; in a 16-bit run an operand of that type as it is, an fp32 one rounded into
  // operand slot `slot` (cuBLASLt reads 16-bit operands natively, accumulating in fp32).
  BufferRef operand(int slot, BufferRef src, std::int64_t n) {
    if (src.count < n)
      refuse("Backend::matmul: an operand of " + std::to_string(src.count) + " elements, " + std::to_string(n) +
             " needed");
    require_device(src, "matmul", "operand");
    const DType want = precision_.matmul;
    if (src.type == want) return BufferRef(src.data, src.type, n, MemSpace::device);
    if (src.type != DType::f32)
      refuse(std::string("Backend::matmul: a ") + dtype_name(src.type) + " operand in a " + dtype_name(want) +
             " run (fp32 or " + dtype_name(want) + " expected)");
    const BufferRef buf = this->slot(slot, want, n);
    cuda::cast(buf.data, want, src.data, DType::f32, n, stream_);
    return buf;
  }
  // Operand slot `slot` holding n elements of `type` (grown as needed), its first n.
  BufferRef slot(int slot, DType type, std::int64_t n) {
    TypedBuffer& buf = operands_[static_cast<std::size_t>(slot)];
    ensure_capacity(*this, buf, "cuda.matmul_operand" + std::to_string(slot), type, n, Mem::workspace);
    return BufferRef(buf.ref().data, type, n, MemSpace::device);
  }
  BufferRef widened(int slot, BufferRef x) {
    TypedBuffer& buf = operands_[static_cast<std::size_t>(slot)];
    ensure_capacity(*this, buf, "cuda.matmul_operand" + std::to_string(slot), DType::f32, x.count, Mem::workspace);
    cuda::cast(buf.ref().data, DType::f32, x.data, x.type, x.count, stream_);
    return BufferRef(buf.ref().data, DType::f32, x.count, MemSpace::device);
  }

  void gemm(const Gemm& g) {
    if (g.M == 0 || g.N == 0) return;
    if (g.K == 0) {  // no products: C = beta C (+ bias)
      if (g.beta != 1.0f) cuda::scale(g.C, g.c_type, g.beta, static_cast<std::int64_t>(g.M) * g.N, stream_);
      return;
    }
    if (g.a_type != g.b_type) refuse("matmul: operands of two types");
    const bool f64 = g.a_type == DType::f64;
    const cublasComputeType_t compute =
        f64 ? CUBLAS_COMPUTE_64F
            : (g.a_type == DType::f32 && tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F);
    const cudaDataType scale_type = f64 ? CUDA_R_64F : CUDA_R_32F;
    cublasLtMatmulDesc_t desc = nullptr;
    check_lt(cublasLtMatmulDescCreate(&desc, compute, scale_type), "MatmulDescCreate");
    // Column-major: D^T[N,M] = op(B)^T[N,K] op(A)^T[K,M]; the first operand is B, the second A.
    const cublasOperation_t op1 = g.tb ? CUBLAS_OP_T : CUBLAS_OP_N, op2 = g.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    check_lt(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op1, sizeof op1), "TRANSA");
    check_lt(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op2, sizeof op2), "TRANSB");
    if (g.bias) {
      const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
      check_lt(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi), "EPILOGUE");
      check_lt(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof g.bias), "BIAS");
      const cudaDataType bias_type = CUDA_R_32F;
      check_lt(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof bias_type),
               "BIAS_DATA_TYPE");
    }
    const auto layout = [&](DType t, int rows, int cols, int ld, long long stride) {
      cublasLtMatrixLayout_t l = nullptr;
      check_lt(cublasLtMatrixLayoutCreate(&l, cuda_type(t, "matmul"), rows, cols, ld), "MatrixLayoutCreate");
      if (g.batch > 1) {
        check_lt(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &g.batch, sizeof g.batch),
                 "BATCH");
        check_lt(
            cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride),
            "STRIDE");
      }
      return l;
    };
    // A row-major [r,c] matrix with leading dimension ld is a column-major [c,r] one.
    cublasLtMatrixLayout_t l1 = layout(g.b_type, g.tb ? g.K : g.N, g.tb ? g.N : g.K, g.ldb, g.stride_b);
    cublasLtMatrixLayout_t l2 = layout(g.a_type, g.ta ? g.M : g.K, g.ta ? g.K : g.M, g.lda, g.stride_a);
    cublasLtMatrixLayout_t lc = layout(g.c_type, g.N, g.M, g.ldc, g.stride_c);

    // Each operand's alignment: its address's, and with batches also its stride's in bytes (every
    // matrix of the batch must be as aligned as the algorithm assumes).
    const auto operand_alignment = [&](const void* p, long long stride, DType t) {
      std::uint32_t a = alignment_of(p);
      if (g.batch > 1)
        a = std::min(a,
                     alignment_of(reinterpret_cast<const void*>(static_cast<std::uintptr_t>(stride) * dtype_size(t))));
      return a;
    };
    const std::uint32_t al1 = operand_alignment(g.B, g.stride_b, g.b_type),
                        al2 = operand_alignment(g.A, g.stride_a, g.a_type),
                        alc = operand_alignment(g.C, g.stride_c, g.c_type);
    const auto key = std::make_tuple(g.ta, g.tb, g.M, g.N, g.K, g.lda, g.ldb, g.ldc, static_cast<int>(g.a_type),
                                     static_cast<int>(g.c_type), g.batch, g.bias != nullptr,
                                     std::array<std::uint32_t, 3>{al1, al2, alc}, g.beta != 0.0f, g.stride_a,
                                     g.stride_b, g.stride_c, static_cast<int>(compute));
    auto it = algos_.find(key);
    if (it == algos_.end()) {
      cublasLtMatmulPreference_t pref = nullptr;
      check_lt(cublasLtMatmulPreferenceCreate(&pref), "PreferenceCreate");
      const std::size_t ws = workspace_.bytes();
      check_lt(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws),
               "WS");
      const std::uint32_t align_c = alc;
      check_lt(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al1, sizeof al1),
               "ALIGN_A");
      check_lt(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al2, sizeof al2),
               "ALIGN_B");
      check_lt(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c,
                                                    sizeof align_c),
               "ALIGN_C");
      check_lt(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c,
                                                    sizeof align_c),
               "ALIGN_D");
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt_, desc, l1, l2, lc, lc, pref, 1, &result, &found);
      cublasLtMatmulPreferenceDestroy(pref);
      if (st != CUBLAS_STATUS_SUCCESS || found == 0)
        throw std::runtime_error("cuBLASLt: no algorithm for a " + std::to_string(g.M) + " x " + std::to_string(g.N) +
                                 " x " + std::to_string(g.K) + " product of " + dtype_name(g.a_type) + " into " +
                                 dtype_name(g.c_type) + (g.bias ? " with bias" : "") + " (status " +
                                 std::to_string(static_cast<int>(st)) + ")");
      it = algos_.emplace(key, result.algo).first;
    }
    const double alpha64 = g.alpha, beta64 = g.beta;
    const void* alpha = f64 ? static_cast<const void*>(&alpha64) : static_cast<const void*>(&g.alpha);
    const void* beta = f64 ? static_cast<const void*>(&beta64) : static_cast<const void*>(&g.beta);
    const cublasStatus_t st = cublasLtMatmul(lt_, desc, alpha, g.B, l1, g.A, l2, beta, g.C, lc, g.C, lc, &it->second,
                                             workspace_.ref().data, workspace_.bytes(), stream_);
    cublasLtMatrixLayoutDestroy(l1);
    cublasLtMatrixLayoutDestroy(l2);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(desc);
    check_lt(st, "cublasLtMatmul");
  }

  // LOOM_CUDA_PROFILE: operations timed but not yet read, the events to reuse, the sums.
  struct Pending {
    std::string key;
    cudaEvent_t start, end;
  };
  struct OpTime {
    std::int64_t calls = 0;
    double ms = 0;
  };
  cudaEvent_t event() {
    cudaEvent_t e = nullptr;
    if (!free_events_.empty()) {
      e = free_events_.back();
      free_events_.pop_back();
    } else {
      check_cuda(cudaEventCreate(&e), "cudaEventCreate");
    }
    check_cuda(cudaEventRecord(e, stream_), "cudaEventRecord");
    return e;
  }
  void settle() {
    for (const Pending& p : pending_) {
      float ms = 0;
      if (cudaEventSynchronize(p.end) == cudaSuccess && cudaEventElapsedTime(&ms, p.start, p.end) == cudaSuccess) {
        OpTime& t = op_times_[p.key];
        ++t.calls;
        t.ms += ms;
      }
      free_events_.push_back(p.start);
      free_events_.push_back(p.end);
    }
    pending_.clear();
  }
  void report_times() {
    settle();
    double total = 0;
    for (const auto& [k, t] : op_times_) total += t.ms;
    std::vector<std::pair<std::string, OpTime>> by_time(op_times_.begin(), op_times_.end());
    std::sort(by_time.begin(), by_time.end(), [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
    std::fprintf(stderr, "loom: CUDA operation times on device %d (LOOM_CUDA_PROFILE), %.1f ms in all:\n", device_,
                 total);
    std::fprintf(stderr, "  %-44s %8s %11s %6s\n", "operation", "calls", "ms", "share");
    for (const auto& [k, t] : by_time)
      std::fprintf(stderr, "  %-44s %8lld %11.2f %5.1f%%\n", k.c_str(), static_cast<long long>(t.calls), t.ms,
                   total > 0 ? 100.0 * t.ms / total : 0.0);
  }
  bool profile_ = false;
  std::vector<Pending> pending_;
  std::vector<cudaEvent_t> free_events_;
  std::map<std::string, OpTime> op_times_;
  // How device buffers move between ranks, per group that has several (in the order made).
  void note_comm(const std::string& group, const std::string& note) {
    if (comm_notes_.emplace(group, note).second)
      comm_order_.push_back(group);
    else
      comm_notes_[group] = note;
  }
  std::map<std::string, std::string> comm_notes_;
  std::vector<std::string> comm_order_;
  int device_;
  int tf32_mode_;  // run.tf32: 0 false, 1 true, 2 auto (TF32 in a run of 16-bit products)
  bool tf32() const { return tf32_mode_ == 1 || (tf32_mode_ == 2 && precision_.matmul != DType::f32); }
  cudaDeviceProp props_{};
  cudaStream_t stream_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  TypedBuffer workspace_;
  // Kernels' partial sums (the column sums of the bias and LayerNorm gradients, sq_norm_check's) live
  // in cuBLASLt's workspace: no product runs while a kernel does on the same stream, and its fixed
  // size keeps the column sums' partition, and so their bits, the same from call to call.
  template <class T>
  T* workspace_scratch() {
    return static_cast<T*>(workspace_.ref().data);
  }
  template <class T>
  std::int64_t workspace_scratch_count() const {
    return static_cast<std::int64_t>(workspace_.bytes() / sizeof(T));
  }
  std::array<TypedBuffer, cuda_plan::kSlots>
      operands_;             // 16-bit (or widened) operands of one product: input, weight, gradient
  TypedBuffer att_scratch_;  // [NH,T,T] attention-score gradients of one sequence
  // cuDNN's attention: bf16 staging of qkv, out, dout and dqkv, and cuDNN's workspace
  // (cuda_plan::cudnn_attention_bytes plans the staging).
  // (Stats and Sum: the statistics and row sums where the model's own are not 16-byte aligned.)
  enum CudnnStage {
    kStageQkv,
    kStageOut,
    kStageDout,
    kStageDqkv,
    kStageStats,
    kStageSum,
    kStageWorkspace,
    kCudnnStages
  };
  std::array<TypedBuffer, kCudnnStages> cudnn_stage_;
  BufferRef cudnn_stage(CudnnStage which, DType type, std::int64_t n) {
    static const char* const labels[] = {"cuda.cudnn_qkv",   "cuda.cudnn_out", "cuda.cudnn_dout",     "cuda.cudnn_dqkv",
                                         "cuda.cudnn_stats", "cuda.cudnn_sum", "cuda.cudnn_workspace"};
    TypedBuffer& buf = cudnn_stage_[static_cast<std::size_t>(which)];
    ensure_capacity(*this, buf, labels[which], type, n, Mem::workspace);
    return buf.ref().slice(0, n);
  }
#ifdef LOOM_CUDA_CUDNN
  // Plans per (forward or backward, shape), made once on first use with the back end's handle.
  const cudnn::Plan& cudnn_plan(cudnn::Graph::Kind kind, const cudnn::Shape& s) const {
    auto key = std::make_pair(kind == cudnn::Graph::Kind::forward ? 0 : 1, s);
    auto it = cudnn_plans_.find(key);
    if (it != cudnn_plans_.end()) return *it->second;
    std::string why;
    const cudnn::Api* api = cudnn::library(&why);
    if (!api) throw std::runtime_error(why);
    if (!cudnn_handle_) {
      check_cuda(cudaSetDevice(device_), "cudaSetDevice");
      cudnn_handle_ = cudnn::create_handle(*api, stream_);
    }
    auto plan = std::make_unique<cudnn::Plan>(*api, cudnn_handle_, std::make_unique<cudnn::Graph>(*api, kind, s));
    return *cudnn_plans_.emplace(key, std::move(plan)).first->second;
  }
  // The model's fp32 qkv [N,3C] as cuDNN's bf16 q, k and v (one staging buffer, rounded as flash rounds it).
  std::uint16_t* cudnn_qkv16(const BufferRef& qkv, std::int64_t NC) {
    const BufferRef q16 = cudnn_stage(kStageQkv, DType::bf16, 3 * NC);
    cuda::cast(q16.data, DType::bf16, dev<const float>(qkv, 3 * NC), DType::f32, 3 * NC, stream_);
    return static_cast<std::uint16_t*>(q16.data);
  }
  static bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }
  void copy_device(void* dst, const void* src, std::int64_t bytes) {
    check_cuda(cudaMemcpyAsync(dst, src, static_cast<std::size_t>(bytes), cudaMemcpyDeviceToDevice, stream_),
               "cudaMemcpyAsync");
  }
  void* cudnn_workspace(const cudnn::Plan& plan) {
    if (plan.workspace_bytes() == 0) return nullptr;
    return cudnn_stage(kStageWorkspace, DType::u8, plan.workspace_bytes()).data;
  }
  mutable void* cudnn_handle_ = nullptr;
  mutable std::map<std::pair<int, cudnn::Shape>, std::unique_ptr<cudnn::Plan>> cudnn_plans_;
  mutable std::map<std::pair<int, int>, std::string> cudnn_verdicts_;  // per (T, hs): why not, or ""
#endif
  TypedBuffer reduce_scratch_;  // per-block partial sums of a reduction
  TypedBuffer topk_scratch_;    // top-k's histograms and counts (cuda_plan::topk_scratch_bytes)
  TypedBuffer norm_out_;        // reduction results on the device, copied back together
  std::map<std::tuple<bool, bool, int, int, int, int, int, int, int, int, int, bool, std::array<std::uint32_t, 3>, bool,
                      long long, long long, long long, int>,
           cublasLtMatmulAlgo_t>
      algos_;  // cuBLASLt's choice per product shape, asked once
};

}  // namespace
}  // namespace loom

extern "C" {
int loom_cuda_abi() { return LOOM_CUDA_ABI_VERSION; }
int loom_cuda_device_count(char* why, int why_len) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    if (why && why_len > 0) {
      std::strncpy(why, cudaGetErrorString(e), static_cast<std::size_t>(why_len) - 1);
      why[why_len - 1] = 0;
    }
    cudaGetLastError();  // clear it
    return 0;
  }
  return n;
}
int loom_cuda_device_uuids(unsigned char* uuids, int max) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear it
    return 0;
  }
  for (int d = 0; d < n && d < max; ++d) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, d) != cudaSuccess) {
      cudaGetLastError();
      return 0;  // no identities: the caller takes the ordinals
    }
    static_assert(sizeof p.uuid.bytes == 16, "a device's UUID is 16 bytes");
    std::memcpy(uuids + 16 * d, p.uuid.bytes, 16);
  }
  return n;
}
loom::Backend* loom_cuda_create(int device, int tf32) { return new loom::CudaBackend(device, tf32); }
int loom_cuda_device_memory(int device, std::size_t* free_bytes, std::size_t* total_bytes) {
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess || (current != device && cudaSetDevice(device) != cudaSuccess) ||
      cudaMemGetInfo(free_bytes, total_bytes) != cudaSuccess) {
    cudaGetLastError();  // clear it
    return 1;
  }
  return 0;
}
}
