#pragma once
// The compute back end: every numerical operation the model and the optimizer perform, on float
// buffers that live in the back end's memory space (BackendFace, core/backend/backend_face.hpp, holds
// the part strategies call: allocation, copies and the generic operations on typed buffers). `host`
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

#include "core/backend/backend_face.hpp"
#include "core/base/buffer.hpp"
#include "core/comm/comm.hpp"
#include "core/comm/step_plan.hpp"
#include "core/base/dtype.hpp"
#include "core/backend/backend_ops.hpp"
#include "core/backend/kernel_math.hpp"
#include "core/base/ledger.hpp"

namespace loom {

// One slice of Backend::adamw_update_slices: n fp32 parameters, moments and gradients, and the
// slice's weight decay.
struct AdamWSlice {
  BufferRef params, m, v, grads;
  std::int64_t n = 0;
  float weight_decay = 0.0f;
};

// Everything of the plugin face (core/backend/backend_face.hpp) comes first, then what only the core
// calls: setting the precision, scratch, communicators, `loom plan`'s workspace, and the model's
// kernels (LOOM_BACKEND_OPS).
class Backend : public BackendFace {
 public:
  // Set once, before the model is built; throws std::invalid_argument for a type it cannot compute in.
  virtual void set_precision(const Precision& p) { precision_ = p; }
  // Frees the scratch the back end keeps between calls (it grows again with the next call that
  // needs it): after a one-off large operation, such as measuring the matrix-product rate.
  virtual void release_scratch() {}
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
    DType dout = DType::f32;       // the backward's incoming gradient, as its producer stored it
    bool after_attention = false;  // its backward comes right after an attention backward (q, k, v's product)
  };
  struct AttentionShape {
    int B = 0, T = 0, NH = 0;  // NH: this rank's heads
    bool flash = false;
    bool cudnn = false;  // the fused attention is cuDNN's (flash too)
    int hs = 0;          // head size
  };
  virtual void plan_workspace(StepPlan& /*plan*/, const std::vector<MatmulCall>& /*calls*/,
                              const AttentionShape& /*attention*/) const {}
  // `loom plan`: whether the communicators between ranks it stands for keep loom's ring-scratch pools
  // (MPI, direct or staged: Mem::comm, reserved from the plan); false for a planned cuda run over
  // NCCL, whose buffers are NCCL's own and outside the ledger. (A run reserves the pools it plans on
  // each communicator; NCCL's ignore the reservation.)
  virtual bool ring_scratch_pools() const { return true; }

  // --- The operations of LOOM_BACKEND_DEFAULTED_OPS, with their default bodies.
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
  // model.attention = cudnn: cuDNN's fused flash attention, the same contract as the flash operations
  // (out, lse [B,NH,T] each row's max + log sum of exp of the scaled scores, dqkv, dsum scratch), its
  // kernels cuDNN's. cudnn_attention_refusal: why this back end cannot run it for sequence length T and
  // head size hs (cuDNN missing, too old, no device, or it refuses the shape), empty when it can.
  virtual std::string cudnn_attention_refusal(int T, int hs) const {
    (void)T, (void)hs;
    return "the " + name() + " back end has no cuDNN (cuDNN's attention runs on the cuda back end)";
  }
  virtual void attention_forward_flash(BufferRef out, BufferRef lse, BufferRef qkv, int B, int T, int C, int NH) {
    (void)out, (void)lse, (void)qkv, (void)B, (void)T, (void)C, (void)NH;
    throw std::logic_error(flash_attention_refusal(C / NH));
  }
  virtual void attention_backward_flash(BufferRef dqkv, BufferRef dsum, BufferRef dout, BufferRef out, BufferRef qkv,
                                        BufferRef lse, int B, int T, int C, int NH) {
    (void)dqkv, (void)dsum, (void)dout, (void)out, (void)qkv, (void)lse, (void)B, (void)T;
    throw std::logic_error(flash_attention_refusal(C / NH));
  }
  virtual void attention_forward_cudnn(BufferRef out, BufferRef lse, BufferRef qkv, int B, int T, int C, int NH) {
    (void)out, (void)lse, (void)qkv, (void)B;
    throw std::logic_error(cudnn_attention_refusal(T, C / NH));
  }
  virtual void attention_backward_cudnn(BufferRef dqkv, BufferRef dsum, BufferRef dout, BufferRef out, BufferRef qkv,
                                        BufferRef lse, int B, int T, int C, int NH) {
    (void)dqkv, (void)dsum, (void)dout, (void)out, (void)qkv, (void)lse, (void)B;
    throw std::logic_error(cudnn_attention_refusal(T, C / NH));
  }
  // Mixture of experts (core/model/moe.cpp): an expert's rows of a token table and back. rows [n] int32
  // names the token row of each of the expert's rows, distinct within a call; scale [n] fp32 (may be
  // empty) each row's gate. x, y, out [.., C].
  //   rows_gather       out[i,:] = scale[i] * x[rows[i],:] (x and out fp32; without scale any one type)
  //   rows_scatter_add  out[rows[i],:] += scale[i] * y[i,:] (fp32)
  //   rows_dot          out[i] = sum_c x[rows[i],c] * y[i,c] (fp32; the sum in lane_sum's order)
  // expert_rows_refusal: why this back end cannot run them, empty when it can.
  virtual std::string expert_rows_refusal() const {
    return "the " + name() + " back end has no expert row operations (mixture of experts)";
  }
  virtual void rows_gather(BufferRef out, BufferRef x, BufferRef rows, BufferRef scale, int n, int C) {
    (void)out, (void)x, (void)rows, (void)scale, (void)n, (void)C;
    throw std::logic_error(expert_rows_refusal());
  }
  virtual void rows_scatter_add(BufferRef out, BufferRef y, BufferRef rows, BufferRef scale, int n, int C) {
    (void)out, (void)y, (void)rows, (void)scale, (void)n, (void)C;
    throw std::logic_error(expert_rows_refusal());
  }
  virtual void rows_dot(BufferRef out, BufferRef x, BufferRef rows, BufferRef y, int n, int C) {
    (void)out, (void)x, (void)rows, (void)y, (void)n, (void)C;
    throw std::logic_error(expert_rows_refusal());
  }
  // AdamW over many slices in one call (the optimizer's owned slices; a device updates them in a few
  // launches): each slice exactly as adamw_update with its own weight decay. The default calls
  // adamw_update slice by slice.
  virtual void adamw_update_slices(const std::vector<AdamWSlice>& slices, float lr, float beta1, float beta2, float eps,
                                   std::int64_t t) {
    for (const AdamWSlice& s : slices)
      adamw_update(s.params, s.m, s.v, s.grads, s.n, lr, beta1, beta2, eps, s.weight_decay, t);
  }
  // --- The compute operations, declared once in core/backend/backend_ops.hpp (LOOM_BACKEND_OPS), all
  // on this back end's memory. What they compute, by group:
  //
  // encoder_*: wte holds vocabulary rows [vocab_begin, vocab_end) (all of them without tensor
  // parallelism). layernorm_* (residual_layernorm_forward: residual = a + b, then out = LayerNorm(residual),
  // bit for bit residual_forward then layernorm_forward), matmul_* (out = inp weight^T + bias; bias and dbias may be
  // empty), bias_*, attention_* (causal, att the [B,NH,T,T] probabilities), gelu_*: the model's layers, as
  // core/backend/kernels.hpp computes them on the host. adamw_update on fp32.
  // The fused MLP operations, each the same values as the unfused ones it replaces:
  //   matmul_forward_gelu  pre = inp weight^T + bias, out = gelu(pre)      (matmul_forward, gelu_forward)
  //   gelu_bias_backward   dpre = gelu'(pre) dout; dbias += sum over rows of dpre (may be empty)
  //                                                                        (gelu_backward, bias_backward)
  // The products take typed operands: `inp` and `weight` are fp32, rounded to the precision's matmul
  // type here, or already of that type (a 16-bit compute copy of the weights, a saved 16-bit
  // activation), so a run that keeps them in 16 bits is not rounded twice; the gradient `dout` is fp32
  // (rounded here), or 16-bit when matmul_backward has no dbias to sum. Throws std::invalid_argument for
  // an operand of another type.
  // Casts fused into the producers: the outputs that are the next product's operand (out of
  // layernorm_forward, residual_layernorm_forward, matmul_forward_gelu and attention_forward_flash;
  // dpre of gelu_bias_backward; dlogits of crossentropy_backward) may be fp32, bf16 or fp16: the kernel computes in
  // fp32 and rounds once on store, the bits of an fp32 output then cast (and gelu_bias_backward's dbias sums the fp32
  // values). Every other output and gradient is fp32.
  // Llama's block (model.arch = llama): rmsnorm_* (out = inp / sqrt(mean(inp^2) + eps) * weight, rstd
  // kept; the backward adds into dinp and dweight), rope_gqa_* (q [N,NH*hs], k and v [N,KV*hs] to the
  // attention's qkv [N,3*NH*hs]: q and k turned by position n % T, query head h reading kv head
  // (head0 + h) / group - kv0; the backward sums each kv head's readers, zero where none reads),
  // swiglu_* (out = silu(gate) * up). rmsnorm_forward's out and swiglu's out, dgate and dup, products'
  // operands, may be 16-bit, rounded once on store.
#define LOOM_DECLARE_OP(ret, name, params, args) virtual ret name params = 0;
  LOOM_BACKEND_OPS(LOOM_DECLARE_OP)
#undef LOOM_DECLARE_OP
};

// Every back end's first reason to refuse fused attention: a head size the kernels are not built for
// (core/backend/kernel_math.hpp flash_head_size_supported); empty when hs is one of them.
inline std::string flash_head_size_refusal(int hs) {
  return math::flash_head_size_supported(hs)
             ? std::string()
             : "head size " + std::to_string(hs) + " (the fused kernels take 16, 32, 64 or 128)";
}

// cuDNN's fused attention's shape rules for loom's use of it (bf16, causal, packed q, k, v): a head
// size that is a multiple of 8 up to 128; empty when cuDNN takes the shape (it may still refuse it on a
// device: the CUDA back end asks cuDNN itself).
inline std::string cudnn_shape_refusal(int T, int hs) {
  if (hs % 8 != 0 || hs > 128)
    return "head size " + std::to_string(hs) + " (cuDNN's fused attention takes multiples of 8 up to 128)";
  if (T < 2) return "sequence length " + std::to_string(T) + " (cuDNN's fused backward takes 2 or more)";
  return "";
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
