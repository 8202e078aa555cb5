#pragma once
// The compute back end: every numerical operation the model and the optimizer perform, on float
// buffers that live in the back end's memory space, plus generic operations on typed buffers
// (BufferRef: cast, matmul, a fused squared norm and finiteness check, scale, fill). `host`
// (Kokkos host execution space + oneDNN/CBLAS, core/backend/gemm.hpp) is built into libloom_core; `cuda`
// (CUDA kernels + cuBLASLt, core/cuda/) is its own library, loaded when a run asks for it
// (core/backend/backend_select.hpp).
// Signatures mirror core/backend/kernels.hpp: outputs first, gradients prefixed `d`, shapes in comments.
#include <mpi.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/base/buffer.hpp"
#include "core/comm/comm.hpp"
#include "core/comm/step_plan.hpp"
#include "core/base/dtype.hpp"
#include "core/backend/backend_ops.hpp"
#include "core/backend/kernel_math.hpp"
#include "core/base/ledger.hpp"

namespace loom {

// The result of Backend::sq_norm_check.
struct NormCheck {
  double sum_squares = 0;    // the tensors' sums of squares, added in list order
  bool all_finite = true;    // no NaN and no inf in any tensor
  int first_nonfinite = -1;  // the list index of the first tensor holding a NaN or an inf; -1 if none
};

// The precision of a run's compute (the `precision` role, filled by the `mixed_precision` strategy;
// DESIGN.md "The parameter store", its 16-bit paragraph). Master weights, gradients, optimizer
// state and every other activation stay fp32; `matmul` names what the model's matrix products
// (matmul_forward/_backward) take as operands: their inputs, weights and output gradients are in
// that type (the store's 16-bit compute copies of the weights, the model's 16-bit saved inputs, or
// fp32 rounded to it), and the products accumulate in fp32 into fp32 outputs (torch.autocast's rule
// for linear layers).
struct Precision {
  DType matmul = DType::f32;  // fp32, bf16 or fp16
  DType reduce = DType::f32;  // the gradient collective's element type (the session's CastReducer)
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;         // "host", "cuda"
  virtual std::string description() const = 0;  // execution space, BLAS, threads
  // Where this back end's tensors live, and a zeroed buffer there, filed in the ledger under
  // `category`. Every tensor of a run (parameters, gradients, optimizer state, activations,
  // communication scratch) is allocated here, so that a device back end places them all.
  virtual MemSpace space() const { return MemSpace::host; }
  // Set once, before the model is built; throws std::invalid_argument for a type it cannot compute in.
  virtual void set_precision(const Precision& p) { precision_ = p; }
  const Precision& precision() const { return precision_; }
  // Frees the scratch the back end keeps between calls (it grows again with the next call that
  // needs it): after a one-off large operation, such as measuring the matrix-product rate.
  virtual void release_scratch() {}
  virtual TypedBuffer allocate(const std::string& label, DType type, std::int64_t count, Mem category) {
    return TypedBuffer(label, type, count, category);
  }
  // Copies between host memory and a buffer of this back end (all of `buffer`'s bytes). Whatever
  // reads or writes tensors on the host (initial weights, token ids, checkpoints, health reports)
  // goes through these, so it works alike on a device back end; on the host they are memcpy.
  virtual void copy_from_host(BufferRef buffer, const void* src) {
    if (buffer.bytes() > 0) std::memcpy(buffer.data, src, buffer.bytes());
  }
  virtual void copy_to_host(void* dst, BufferRef buffer) {
    if (buffer.bytes() > 0) std::memcpy(dst, buffer.data, buffer.bytes());
  }
  // Waits until every operation issued so far has completed (a device back end queues them).
  virtual void synchronize() {}
  // The communicator over `comm` (every rank of it calls this) for this back end's buffers
  // (DESIGN.md "Communicators"): MPI for the host; for a device back end, MPI with device buffers
  // staged through host copies (core/backend/comm_staged.cpp) unless it has a communicator of its own (the
  // CUDA back end's NCCL, where every rank of `comm` drives its own GPU).
  virtual std::unique_ptr<Communicator> make_communicator(MPI_Comm comm, const std::string& name);
  // `loom plan`: the workspace this back end takes for a micro-batch's matrix products, in the order
  // the model runs them (operands: null BufferRefs of their type and count), and for its attention.
  struct MatmulCall {
    bool backward = false;
    BufferRef inp, weight;
    int N = 0, C = 0, OC = 0;
  };
  struct AttentionShape {
    int B = 0, T = 0, NH = 0;  // NH: this rank's heads
    bool flash = false;
  };
  virtual void plan_workspace(StepPlan& /*plan*/, const std::vector<MatmulCall>& /*calls*/,
                              const AttentionShape& /*attention*/) const {}
  // `loom plan`: whether the communicators between ranks it stands for keep loom's ring-scratch pools
  // (MPI, direct or staged: Mem::comm, reserved from the plan); false for a planned cuda run over
  // NCCL, whose buffers are NCCL's own and outside the ledger. (A run reserves the pools it plans on
  // each communicator; NCCL's ignore the reservation.)
  virtual bool ring_scratch_pools() const { return true; }

  // `loom plan`: the workspace topk_select over n elements takes, kept and grown to the largest n
  // (none on the host).
  virtual std::int64_t topk_scratch_bytes(std::int64_t /*n*/) const { return 0; }

  // --- The operations of LOOM_BACKEND_DEFAULTED_OPS, with their default bodies.
  // The products with typed operands: `inp` and `weight` are fp32 (rounded to the precision's
  // matmul type here) or already of that type (a 16-bit compute copy of the weights, a saved 16-bit
  // activation), so a run that keeps them in 16 bits is not rounded twice. Outputs and gradients stay
  // fp32. Throws std::invalid_argument for an operand of another type. The default takes fp32 only.
  virtual void matmul_forward(float* out, BufferRef inp, BufferRef weight, const float* bias, int N, int C, int OC) {
    matmul_forward(out, inp.as<float>(), weight.as<float>(), bias, N, C, OC);
  }
  virtual void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, BufferRef inp,
                               BufferRef weight, int N, int C, int OC) {
    matmul_backward(dinp, dweight, dbias, dout, inp.as<float>(), weight.as<float>(), N, C, OC);
  }
  // Fused (flash-style) causal attention, model.attention = flash: the [B,NH,T,T] probabilities are
  // never stored; forward saves lse [B,NH,T] (each row's max + log sum of exp of the scaled scores) and
  // backward recomputes them. q, k, v, dout, the probabilities and the score gradients are rounded to
  // bf16 as the device's tensor-core operands (fp32 products, softmax and outputs), on every back end
  // alike (core/backend/flash_attention_host.hpp is the host's twin of core/cuda/flash_attention.cuh).
  // `out` is the forward's output as the model saved it (fp32, bf16 or fp16); dsum [B,NH,T] scratch.
  // flash_attention_refusal: why this back end cannot run it for head size hs, empty when it can.
  virtual std::string flash_attention_refusal(int hs) const {
    (void)hs;
    return "the " + name() + " back end has no fused attention";
  }
  virtual void attention_forward_flash(float* out, float* lse, const float* qkv, int B, int T, int C, int NH) {
    (void)out, (void)lse, (void)qkv, (void)B, (void)T, (void)C, (void)NH;
    throw std::logic_error(flash_attention_refusal(C / NH));
  }
  virtual void attention_backward_flash(float* dqkv, float* dsum, const float* dout, BufferRef out, const float* qkv,
                                        const float* lse, int B, int T, int C, int NH) {
    (void)dqkv, (void)dsum, (void)dout, (void)out, (void)qkv, (void)lse, (void)B, (void)T;
    throw std::logic_error(flash_attention_refusal(C / NH));
  }
  // --- The compute operations, declared once in core/backend/backend_ops.hpp (LOOM_BACKEND_OPS), all
  // on this back end's memory. What they compute, by group:
  //
  // encoder_*: wte holds vocabulary rows [vocab_begin, vocab_end) (all of them without tensor
  // parallelism). layernorm_*, matmul_* (out = inp weight^T + bias), bias_*, attention_* (causal, att
  // the [B,NH,T,T] probabilities), gelu_*, residual_forward: the model's layers, as
  // core/backend/kernels.hpp computes them on the host.
  // crossentropy_backward: targets[n] - vocab_begin is the target's column (none outside [0, V):
  // vocabulary-parallel). Vocabulary-parallel cross-entropy (the tensor strategy): this rank holds the
  // logits of vocabulary entries [vocab_begin, vocab_begin + V) of each of N rows. Around the group's
  // reductions:
  //   crossentropy_row_max  row_max[n] = max_v logits[n,v]                          (then: max over the group)
  //   crossentropy_partial  probs[n,v] = exp(logits[n,v] - row_max[n]); sum_exp[n] = their sum (fp64);
  //                         target_logit[n] = logits[n, targets[n] - vocab_begin] where that column is
  //                         here, else 0                                             (then: sums over the group)
  //   crossentropy_finish   probs[n,v] /= sum_exp[n]; losses[n] = log sum_exp[n] + row_max[n] - target_logit[n]
  // adamw_update, sum_squares, scale, fill, copy, sum on fp32; axpy: y += a x, the product rounded, then
  // the sum (no fused multiply-add: the host's and CUDA's alike).
  //
  // Operations on typed buffers of this back end's space. They throw std::invalid_argument for an
  // element type they do not take, a buffer in another memory space or mismatched counts.
  //   cast           dst = src converted, between fp32, fp64, bf16 and fp16, rounded to nearest even (fp64
  //                  to a 16-bit type directly, not through a rounded fp32). Equal counts; the buffers
  //                  must not overlap unless they are the same buffer of the same type.
  //   matmul         row-major out[M,N] = alpha * op(a) op(b) + beta * out, op(a) [M,K] (a is stored
  //                  [K,M] when transa), op(b) [K,N] (b stored [N,K] when transb), all dense. Operands of
  //                  fp32, bf16 or fp16 in any mix, accumulated in fp32 (all fp32: loom::gemm::sgemm
  //                  directly; bf16 x bf16 into fp32 or bf16: loom::gemm::gemm_bf16); all fp64: dgemm.
  //                  With beta == 0 the old contents of out are not read.
  //   sq_norm_check  one pass over the tensors (fp32, bf16, fp16, fp64): the sum of their sums of squares
  //                  and where the first NaN or inf is. Each tensor's sum of squares is reduced as
  //                  sum_squares reduces it (for fp32 bit for bit the same value), and the tensors' sums
  //                  are added in list order.
  //   scale, fill    x *= a and x = value, computed in the element type's compute type (fp64 for fp64,
  //                  else fp32).
  //
  // int8 gradient compression (plugins/compression: core/backend/kernels.hpp int8_absmax, _quantize,
  // _dequantize; the per-element rule is math::int8_level), on this back end's memory, so that a
  // device run compresses where its gradients are. chunks = ceil(n / chunk).
  //   int8_absmax      absmax[c] = max |x| over chunk c (NaN ignored); absmax[chunks] = 1 if x holds
  //                    a NaN or an inf, else 0                                   ([chunks + 1], [n])
  //   int8_quantize    q = x's levels at step absmax[c] / levels; error (may be null) = x - q step
  //   int8_dequantize  x = q step, or NaN everywhere where absmax[chunks] > 0 (a rank's non-finite value)
  // top-k gradient compression (plugins/compression: core/backend/kernels.hpp topk_*, core/cuda/topk.cuh),
  // on this back end's memory. 0 <= k <= n < 2^31.
  //   topk_select       index, value [k] = the k elements of x [n] with the largest |x| (ties to the
  //                     lower index), in ascending index order; where x holds a NaN or an inf, index j
  //                     = j and value NaN (so every rank's sum is non-finite)
  //   topk_scatter_add  x[index[j]] += value[j], j < k (distinct indices: one rank's selection)
  //   topk_clear        x[index[j]] = 0, j < k (error feedback keeps what was not sent)
#define LOOM_DECLARE_OP(ret, name, params, args) virtual ret name params = 0;
  LOOM_BACKEND_OPS(LOOM_DECLARE_OP)
#undef LOOM_DECLARE_OP
  // (Nothing virtual after the list: an operation added at its end takes the last vtable slot, so the
  // slots of everything before it stay where callers built against an older loom expect them.)
  void matmul(BufferRef out, BufferRef a, BufferRef b, int M, int N, int K, bool transa, bool transb) {
    matmul(out, a, b, M, N, K, transa, transb, 1.0f, 0.0f);
  }



 protected:
  Precision precision_;
};

// Every back end's first reason to refuse fused attention: a head size the kernels are not built for
// (core/backend/kernel_math.hpp flash_head_size_supported); empty when hs is one of them.
inline std::string flash_head_size_refusal(int hs) {
  return math::flash_head_size_supported(hs) ? std::string()
                                             : "head size " + std::to_string(hs) + " (the fused kernels take 16, 32, 64 or 128)";
}

// The shape checks of Backend::matmul, for every back end: non-negative dimensions, a [M,K], b
// [K,N] and out [M,N] in element counts; std::invalid_argument naming the operand otherwise.
inline void check_matmul_shapes(const BufferRef& out, const BufferRef& a, const BufferRef& b, int M, int N, int K) {
  if (M < 0 || N < 0 || K < 0) throw std::invalid_argument("matmul: negative dimension");
  const auto expect = [](const BufferRef& x, const char* name, std::int64_t rows, std::int64_t cols) {
    if (x.count != rows * cols)
      throw std::invalid_argument(std::string("matmul: ") + name + " holds " + std::to_string(x.count) +
                                  " elements, expected " + std::to_string(rows) + " x " + std::to_string(cols));
  };
  expect(a, "a", M, K);
  expect(b, "b", K, N);
  expect(out, "out", M, N);
}

// Makes `buffer` hold at least `count` elements of `type` (a new zeroed buffer from the back end when
// it holds fewer; contents are not kept). For scratch that grows with the largest call seen.
inline void ensure_capacity(Backend& backend, TypedBuffer& buffer, const std::string& label, DType type,
                            std::int64_t count, Mem category) {
  if (buffer.type() != type || buffer.count() < count || buffer.empty())
    buffer = backend.allocate(label, type, count, category);
}

// The host back end; `threads` sets the BLAS and oneDNN threads of this rank (gemm::set_threads).
std::unique_ptr<Backend> make_host_backend(int threads);
// run.backend = fenced (core/backend/fenced_backend.cpp): the host kernels on memory marked device at
// addresses the host cannot touch, so that a host access to a tensor outside the back end crashes
// (saying so) as it would on a GPU; for checking strategies' device paths without one.
std::unique_ptr<Backend> make_fenced_backend(int threads);
// `loom plan`'s back end (core/backend/sizing_backend.cpp): allocations filed in the ledger at addresses never
// touched, no kernels; the operand workspace of `like`.
std::unique_ptr<Backend> make_sizing_backend(std::unique_ptr<Backend> like);
// The same for a run on the cuda back end, planned where there is no GPU: its workspace as
// core/backend/workspace_plan.hpp says the CUDA back end takes it (cuBLASLt's, the operands' 16-bit
// copies, the attention's scratch), its communicators NCCL's (no ring-scratch pools: a plan puts one
// rank on each device, so run.share_gpu, which lets ranks share one through host copies and MPI, does
// not arise), and the fused attention refused only for its head sizes (every GPU of the presets runs it).
std::unique_ptr<Backend> make_cuda_sizing_backend();

}  // namespace loom
