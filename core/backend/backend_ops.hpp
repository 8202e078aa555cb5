#pragma once
// The back end's compute operations, declared once, in two lists. Each line is
//   OP(return type, name, (parameters), (arguments))
// LOOM_FACE_OPS are the operations a strategy (a plugin) may call: BackendFace declares them
// (core/backend/backend_face.hpp), and they are part of the plugin ABI, so this list only changes
// with LOOM_PLUGIN_ABI_VERSION. LOOM_BACKEND_OPS are the model's and the optimizer's kernels, which
// only the core calls: Backend declares them (core/backend/backend.hpp) after everything of the face,
// so an operation added there moves no slot a plugin calls through. Both lists are what a
// ForwardingBackend passes on to the back end it wraps (the fenced and sizing back ends,
// core/backend/forwarding_backend.hpp) and what the generated tests walk (core/test/test_backend_ops.cpp).
// Signatures mirror core/backend/kernels.hpp: outputs first, gradients prefixed `d`. Every tensor is a
// typed BufferRef, never a bare pointer (an optional one, such as a bias, may be empty); shapes are the
// int arguments, and an operand must hold at least the elements they name, of the type the operation
// takes (BufferRef::as: std::logic_error for another element type, std::invalid_argument for too few
// elements, each naming what it found and what was needed). What each one
// computes is said beside its declaration group in backend_face.hpp and backend.hpp. Adding an
// operation (DESIGN.md "Adding a back-end operation"): its line in LOOM_BACKEND_OPS, its host kernel
// (kernels.hpp, host_backend.cpp), its device kernel (core/cuda/), its tests; the CUDA back end's ABI
// (LOOM_CUDA_ABI_VERSION) goes up, the plugin ABI does not.
#include <cstdint>
#include <vector>

#include "core/base/dtype.hpp"

// clang-format off: one operation a line, as the lists are read
#define LOOM_FACE_OPS(OP)                                                                                             \
  OP(void, residual_forward, (BufferRef out, BufferRef a, BufferRef b, std::int64_t n), (out, a, b, n))               \
  OP(void, crossentropy_forward,                                                                                      \
     (BufferRef losses, BufferRef probs, BufferRef logits, BufferRef targets, int N, int V),                          \
     (losses, probs, logits, targets, N, V))                                                                          \
  OP(void, crossentropy_backward,                                                                                     \
     (BufferRef dlogits, BufferRef probs, BufferRef targets, float dloss, int N, int V, int vocab_begin),             \
     (dlogits, probs, targets, dloss, N, V, vocab_begin))                                                             \
  OP(void, crossentropy_fused,                                                                                        \
     (BufferRef losses, BufferRef dlogits, BufferRef logits, BufferRef targets, float dloss, int N, int V),           \
     (losses, dlogits, logits, targets, dloss, N, V))                                                                 \
  OP(void, crossentropy_row_max, (BufferRef row_max, BufferRef logits, int N, int V), (row_max, logits, N, V))        \
  OP(void, crossentropy_partial,                                                                                      \
     (BufferRef probs, BufferRef sum_exp, BufferRef target_logit, BufferRef logits, BufferRef row_max,                \
      BufferRef targets, int N, int V, int vocab_begin),                                                              \
     (probs, sum_exp, target_logit, logits, row_max, targets, N, V, vocab_begin))                                     \
  OP(void, crossentropy_finish,                                                                                       \
     (BufferRef losses, BufferRef probs, BufferRef sum_exp, BufferRef row_max, BufferRef target_logit, int N, int V), \
     (losses, probs, sum_exp, row_max, target_logit, N, V))                                                           \
  OP(void, crossentropy_finish_grad,                                                                                  \
     (BufferRef losses, BufferRef dlogits, BufferRef logits, BufferRef sum_exp, BufferRef row_max,                    \
      BufferRef target_logit, BufferRef targets, float dloss, int N, int V, int vocab_begin),                         \
     (losses, dlogits, logits, sum_exp, row_max, target_logit, targets, dloss, N, V, vocab_begin))                    \
  OP(void, copy, (BufferRef dst, BufferRef src, std::int64_t n), (dst, src, n))                                       \
  OP(void, axpy, (BufferRef y, float a, BufferRef x, std::int64_t n), (y, a, x, n))                                   \
  OP(double, sum, (BufferRef x, std::int64_t n), (x, n))                                                              \
  OP(void, cast, (BufferRef dst, BufferRef src), (dst, src))                                                          \
  OP(void, matmul,                                                                                                    \
     (BufferRef out, BufferRef a, BufferRef b, int M, int N, int K, bool transa, bool transb, float alpha,            \
      float beta),                                                                                                    \
     (out, a, b, M, N, K, transa, transb, alpha, beta))                                                               \
  OP(NormCheck, sq_norm_check, (const std::vector<BufferRef>& tensors), (tensors))                                    \
  OP(void, scale, (BufferRef x, double a), (x, a))                                                                    \
  OP(void, fill, (BufferRef x, double value), (x, value))                                                             \
  OP(void, int8_absmax, (BufferRef absmax, BufferRef x, std::int64_t n, std::int64_t chunk), (absmax, x, n, chunk))   \
  OP(void, int8_quantize,                                                                                             \
     (BufferRef q, BufferRef error, BufferRef x, std::int64_t n, std::int64_t chunk, BufferRef absmax, int levels),   \
     (q, error, x, n, chunk, absmax, levels))                                                                         \
  OP(void, int8_dequantize,                                                                                           \
     (BufferRef x, BufferRef q, std::int64_t n, std::int64_t chunk, BufferRef absmax, int levels),                    \
     (x, q, n, chunk, absmax, levels))                                                                                \
  OP(void, topk_select, (BufferRef index, BufferRef value, BufferRef x, std::int64_t n, std::int64_t k),              \
     (index, value, x, n, k))                                                                                         \
  OP(void, topk_scatter_add, (BufferRef x, BufferRef index, BufferRef value, std::int64_t k), (x, index, value, k))   \
  OP(void, topk_clear, (BufferRef x, BufferRef index, std::int64_t k), (x, index, k))                                 \
  OP(void, attention_ring_forward,                                                                                    \
     (BufferRef out, BufferRef lse, BufferRef qkv, BufferRef kv, int B, int T, int C, int NH, int q_begin,            \
      int kv_rows, bool causal, bool bf16),                                                                           \
     (out, lse, qkv, kv, B, T, C, NH, q_begin, kv_rows, causal, bf16))                                                \
  OP(void, attention_ring_backward,                                                                                   \
     (BufferRef dqkv, BufferRef dkv, BufferRef dsum, BufferRef dout, BufferRef out, BufferRef qkv, BufferRef kv,      \
      BufferRef lse, int B, int T, int C, int NH, int q_begin, int kv_rows, bool causal, bool bf16),                  \
     (dqkv, dkv, dsum, dout, out, qkv, kv, lse, B, T, C, NH, q_begin, kv_rows, causal, bf16))                         \
  OP(void, copy_rows,                                                                                                 \
     (BufferRef dst, BufferRef src, std::int64_t rows, std::int64_t cols, std::int64_t dst_ld, std::int64_t src_ld),  \
     (dst, src, rows, cols, dst_ld, src_ld))

#define LOOM_BACKEND_OPS(OP)                                                                                           \
  OP(void, encoder_forward,                                                                                            \
     (BufferRef out, BufferRef inp, BufferRef wte, BufferRef wpe, int B, int T, int C, int vocab_begin, int vocab_end, \
      bool add_pos),                                                                                                   \
     (out, inp, wte, wpe, B, T, C, vocab_begin, vocab_end, add_pos))                                                   \
  OP(void, encoder_backward,                                                                                           \
     (BufferRef dwte, BufferRef dwpe, BufferRef dout, BufferRef inp, int B, int T, int C, int vocab_begin,             \
      int vocab_end),                                                                                                  \
     (dwte, dwpe, dout, inp, B, T, C, vocab_begin, vocab_end))                                                         \
  OP(void, layernorm_forward,                                                                                          \
     (BufferRef out, BufferRef mean, BufferRef rstd, BufferRef inp, BufferRef weight, BufferRef bias, int N, int C),   \
     (out, mean, rstd, inp, weight, bias, N, C))                                                                       \
  OP(void, layernorm_backward,                                                                                         \
     (BufferRef dinp, BufferRef dweight, BufferRef dbias, BufferRef dout, BufferRef inp, BufferRef weight,             \
      BufferRef mean, BufferRef rstd, int N, int C),                                                                   \
     (dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C))                                                      \
  OP(void, residual_layernorm_forward,                                                                                 \
     (BufferRef residual, BufferRef out, BufferRef mean, BufferRef rstd, BufferRef a, BufferRef b, BufferRef weight,   \
      BufferRef bias, int N, int C),                                                                                   \
     (residual, out, mean, rstd, a, b, weight, bias, N, C))                                                            \
  OP(void, matmul_forward, (BufferRef out, BufferRef inp, BufferRef weight, BufferRef bias, int N, int C, int OC),     \
     (out, inp, weight, bias, N, C, OC))                                                                               \
  OP(void, bias_add, (BufferRef out, BufferRef bias, int N, int OC), (out, bias, N, OC))                               \
  OP(void, bias_backward, (BufferRef dbias, BufferRef dout, int N, int OC), (dbias, dout, N, OC))                      \
  OP(void, matmul_backward,                                                                                            \
     (BufferRef dinp, BufferRef dweight, BufferRef dbias, BufferRef dout, BufferRef inp, BufferRef weight, int N,      \
      int C, int OC),                                                                                                  \
     (dinp, dweight, dbias, dout, inp, weight, N, C, OC))                                                              \
  OP(void, attention_forward, (BufferRef out, BufferRef att, BufferRef qkv, int B, int T, int C, int NH),              \
     (out, att, qkv, B, T, C, NH))                                                                                     \
  OP(void, attention_backward,                                                                                         \
     (BufferRef dqkv, BufferRef datt, BufferRef dout, BufferRef qkv, BufferRef att, int B, int T, int C, int NH),      \
     (dqkv, datt, dout, qkv, att, B, T, C, NH))                                                                        \
  OP(void, matmul_forward_gelu,                                                                                        \
     (BufferRef out, BufferRef pre, BufferRef inp, BufferRef weight, BufferRef bias, int N, int C, int OC),            \
     (out, pre, inp, weight, bias, N, C, OC))                                                                          \
  OP(void, gelu_bias_backward, (BufferRef dpre, BufferRef dbias, BufferRef pre, BufferRef dout, int N, int OC),        \
     (dpre, dbias, pre, dout, N, OC))                                                                                  \
  OP(void, gelu_forward, (BufferRef out, BufferRef inp, std::int64_t n), (out, inp, n))                                \
  OP(void, gelu_backward, (BufferRef dinp, BufferRef inp, BufferRef dout, std::int64_t n), (dinp, inp, dout, n))       \
  OP(void, adamw_update,                                                                                               \
     (BufferRef params, BufferRef m, BufferRef v, BufferRef grads, std::int64_t n, float lr, float beta1, float beta2, \
      float eps, float weight_decay, std::int64_t t),                                                                  \
     (params, m, v, grads, n, lr, beta1, beta2, eps, weight_decay, t))                                                 \
  OP(void, rmsnorm_forward, (BufferRef out, BufferRef rstd, BufferRef inp, BufferRef weight, int N, int C, float eps), \
     (out, rstd, inp, weight, N, C, eps))                                                                              \
  OP(void, rmsnorm_backward,                                                                                           \
     (BufferRef dinp, BufferRef dweight, BufferRef dout, BufferRef inp, BufferRef weight, BufferRef rstd, int N,       \
      int C),                                                                                                          \
     (dinp, dweight, dout, inp, weight, rstd, N, C))                                                                   \
  OP(void, rope_gqa_forward,                                                                                           \
     (BufferRef qkv, BufferRef q, BufferRef k, BufferRef v, int N, int T, int NH, int KV, int hs, int head0, int kv0,  \
      int group, float theta),                                                                                         \
     (qkv, q, k, v, N, T, NH, KV, hs, head0, kv0, group, theta))                                                       \
  OP(void, rope_gqa_backward,                                                                                          \
     (BufferRef dq, BufferRef dk, BufferRef dv, BufferRef dqkv, int N, int T, int NH, int KV, int hs, int head0,       \
      int kv0, int group, float theta),                                                                                \
     (dq, dk, dv, dqkv, N, T, NH, KV, hs, head0, kv0, group, theta))                                                   \
  OP(void, swiglu_forward, (BufferRef out, BufferRef gate, BufferRef up, std::int64_t n), (out, gate, up, n))          \
  OP(void, swiglu_backward,                                                                                            \
     (BufferRef dgate, BufferRef dup, BufferRef dout, BufferRef gate, BufferRef up, std::int64_t n),                   \
     (dgate, dup, dout, gate, up, n))

// The same kind of operations with a default body in Backend (a back end overrides them where it can):
// the fused attention (default: refused with flash_attention_refusal); the experts' row operations
// (default: refused with expert_rows_refusal); AdamW over many slices (default: adamw_update per slice).
#define LOOM_BACKEND_DEFAULTED_OPS(OP)                                                                                 \
  OP(void, attention_forward_flash, (BufferRef out, BufferRef lse, BufferRef qkv, int B, int T, int C, int NH),        \
     (out, lse, qkv, B, T, C, NH))                                                                                     \
  OP(void, attention_forward_cudnn, (BufferRef out, BufferRef lse, BufferRef qkv, int B, int T, int C, int NH),        \
     (out, lse, qkv, B, T, C, NH))                                                                                     \
  OP(void, attention_backward_cudnn,                                                                                   \
     (BufferRef dqkv, BufferRef dsum, BufferRef dout, BufferRef out, BufferRef qkv, BufferRef lse, int B, int T,       \
      int C, int NH),                                                                                                  \
     (dqkv, dsum, dout, out, qkv, lse, B, T, C, NH))                                                                   \
  OP(void, attention_backward_flash,                                                                                   \
     (BufferRef dqkv, BufferRef dsum, BufferRef dout, BufferRef out, BufferRef qkv, BufferRef lse, int B, int T,       \
      int C, int NH),                                                                                                  \
     (dqkv, dsum, dout, out, qkv, lse, B, T, C, NH))                                                                   \
  OP(void, rows_gather, (BufferRef out, BufferRef x, BufferRef rows, BufferRef scale, int n, int C),                   \
     (out, x, rows, scale, n, C))                                                                                      \
  OP(void, rows_scatter_add, (BufferRef out, BufferRef y, BufferRef rows, BufferRef scale, int n, int C),              \
     (out, y, rows, scale, n, C))                                                                                      \
  OP(void, rows_dot, (BufferRef out, BufferRef x, BufferRef rows, BufferRef y, int n, int C), (out, x, rows, y, n, C)) \
  OP(void, adamw_update_slices,                                                                                        \
     (const std::vector<AdamWSlice>& slices, float lr, float beta1, float beta2, float eps, std::int64_t t),           \
     (slices, lr, beta1, beta2, eps, t))
// clang-format on

#define LOOM_EXPAND(...) __VA_ARGS__
