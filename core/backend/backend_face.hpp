#pragma once
// What a strategy (a plugin) sees of the compute back end: where its tensors live, allocation and
// host copies, and the operations of LOOM_FACE_OPS (core/backend/backend_ops.hpp). Backend
// (core/backend/backend.hpp) derives from it and adds the model's kernels and the core's planning
// hooks after it, so that the virtual slots declared here stay where a plugin built against an older
// loom calls them: adding a back-end operation does not move the plugin ABI (DESIGN.md "The plugin
// face"). Changing anything in this file does: it goes with LOOM_PLUGIN_ABI_VERSION.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/backend/backend_ops.hpp"
#include "core/base/buffer.hpp"
#include "core/base/dtype.hpp"
#include "core/base/ledger.hpp"

namespace loom {

// The result of sq_norm_check.
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
  DType reduce = DType::f32;  // the gradient collective's element type (the precision strategy's CastReducer)
};

class BackendFace {
 public:
  virtual ~BackendFace() = default;
  virtual std::string name() const = 0;         // "host", "cuda"
  virtual std::string description() const = 0;  // execution space, BLAS, threads
  // Where this back end's tensors live, and a zeroed buffer there, filed in the ledger under
  // `category`. Every tensor of a run (parameters, gradients, optimizer state, activations,
  // communication scratch) is allocated here, so that a device back end places them all.
  virtual MemSpace space() const { return MemSpace::host; }
  const Precision& precision() const { return precision_; }
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
  // `loom plan`: the workspace topk_select over n elements takes, kept and grown to the largest n
  // (none on the host).
  virtual std::int64_t topk_scratch_bytes(std::int64_t /*n*/) const { return 0; }

  // --- The operations of LOOM_FACE_OPS, all on this back end's memory. What they compute, by group:
  //
  // residual_forward: out = a + b. crossentropy_forward/_backward: the loss and its gradient over
  // whole rows (the partition role's default); crossentropy_backward: targets[n] - vocab_begin is the
  // target's column (none outside [0, V): vocabulary-parallel); dlogits fp32 (may alias probs) or, under
  // mixed precision, 16-bit (the classifier product's operand, rounded once on store). crossentropy_fused:
  // both in one pass when dloss is known at the forward (training), bit for bit the two operations, with no
  // probability table (dlogits may alias logits in fp32, or be 16-bit). Vocabulary-parallel
  // cross-entropy (the tensor strategy): this rank holds the logits of vocabulary entries [vocab_begin, vocab_begin +
  // V) of each of N rows. Around the group's reductions:
  //   crossentropy_row_max  row_max[n] = max_v logits[n,v]                          (then: max over the group)
  //   crossentropy_partial  probs[n,v] = exp(logits[n,v] - row_max[n]); sum_exp[n] = their sum (fp64);
  //                         target_logit[n] = logits[n, targets[n] - vocab_begin] where that column is
  //                         here, else 0                                             (then: sums over the group)
  //   crossentropy_finish   probs[n,v] /= sum_exp[n]; losses[n] = log sum_exp[n] + row_max[n] - target_logit[n]
  //   crossentropy_finish_grad  losses as _finish; dlogits[n,v] = the gradient crossentropy_backward would
  //                         write after _finish, recomputed from the logits (then _partial's probs may be
  //                         empty: only the sums are written), fp32 (may alias logits) or 16-bit
  // copy, sum on the first n fp32 elements; axpy: y += a x, the product rounded, then the sum (no
  // fused multiply-add: the host's and CUDA's alike).
  //
  // Every tensor argument is a BufferRef of the operation's element type holding at least the
  // elements its shape arguments name (an optional one, such as int8_quantize's error, may be empty);
  // an operation throws otherwise (BufferRef::as: std::logic_error for the type, std::invalid_argument
  // for the count).
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
  //                  the host kernels' sum_squares reduces it, and the tensors' sums are added in list order.
  //   scale, fill    all of x: x *= a and x = value, computed in the element type's compute type (fp64 for fp64,
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
  // Ring attention (plugins/context, DESIGN.md "Context parallelism"; core/backend/ring_attention_host.hpp):
  //   attention_ring_forward   merges the attention of queries [q_begin, T) of each sequence of qkv
  //                     [B,T,3C] to keys and values [0, kv_rows) of the block kv [B,T,2C] (k then v) into
  //                     the running out [B,T,C] and lse [B,NH,T] (fp32) by the online softmax; a row
  //                     not yet reached holds lse = -1e30 and a finite out; causal: key j hidden from
  //                     query t < j (local indices)
  //   attention_ring_backward  given the final out (fp32, bf16 or fp16) and lse, adds the block's
  //                     gradients into the q columns of dqkv's rows [q_begin, T) and into dkv's rows
  //                     [0, kv_rows); dsum [B,NH,T] scratch
  //   bf16: the products' operands rounded to bf16 first, as flash attention's.
  //   copy_rows         fp32 rows: dst[r * dst_ld + c] = src[r * src_ld + c], r < rows, c < cols
  // ring_attention_refusal: why this back end cannot run them, empty when it can.
  virtual std::string ring_attention_refusal() const {
    return "the " + name() + " back end has no ring attention (context parallelism)";
  }
#define LOOM_DECLARE_OP(ret, name, params, args) virtual ret name params = 0;
  LOOM_FACE_OPS(LOOM_DECLARE_OP)
#undef LOOM_DECLARE_OP
  void matmul(BufferRef out, BufferRef a, BufferRef b, int M, int N, int K, bool transa, bool transb) {
    matmul(out, a, b, M, N, K, transa, transb, 1.0f, 0.0f);
  }

 protected:
  Precision precision_;
};

// Makes `buffer` hold at least `count` elements of `type` (a new zeroed buffer from the back end when
// it holds fewer; contents are not kept). For scratch that grows with the largest call seen.
inline void ensure_capacity(BackendFace& backend, TypedBuffer& buffer, const std::string& label, DType type,
                            std::int64_t count, Mem category) {
  if (buffer.type() != type || buffer.count() < count || buffer.empty())
    buffer = backend.allocate(label, type, count, category);
}

}  // namespace loom
