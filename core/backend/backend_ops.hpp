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
// Signatures mirror core/backend/kernels.hpp: outputs first, gradients prefixed `d`. What each one
// computes is said beside its declaration group in backend_face.hpp and backend.hpp. Adding an
// operation (DESIGN.md "Adding a back-end operation"): its line in LOOM_BACKEND_OPS, its host kernel
// (kernels.hpp, host_backend.cpp), its device kernel (core/cuda/), its tests; the CUDA back end's ABI
// (LOOM_CUDA_ABI_VERSION) goes up, the plugin ABI does not.
#include <cstdint>
#include <vector>

#include "core/base/dtype.hpp"

// clang-format off: one operation a line, as the lists are read
#define LOOM_FACE_OPS(OP)                                                                                           \
  OP(void, residual_forward, (float* out, const float* a, const float* b, std::int64_t n), (out, a, b, n))          \
  OP(void, crossentropy_forward,                                                                                    \
     (float* losses, float* probs, const float* logits, const std::int32_t* targets, int N, int V),                 \
     (losses, probs, logits, targets, N, V))                                                                        \
  OP(void, crossentropy_backward,                                                                                   \
     (float* dlogits, const float* probs, const std::int32_t* targets, float dloss, int N, int V, int vocab_begin), \
     (dlogits, probs, targets, dloss, N, V, vocab_begin))                                                           \
  OP(void, crossentropy_row_max, (float* row_max, const float* logits, int N, int V), (row_max, logits, N, V))      \
  OP(void, crossentropy_partial,                                                                                    \
     (float* probs, double* sum_exp, double* target_logit, const float* logits, const float* row_max,               \
      const std::int32_t* targets, int N, int V, int vocab_begin),                                                  \
     (probs, sum_exp, target_logit, logits, row_max, targets, N, V, vocab_begin))                                   \
  OP(void, crossentropy_finish,                                                                                     \
     (float* losses, float* probs, const double* sum_exp, const float* row_max, const double* target_logit, int N,  \
      int V),                                                                                                       \
     (losses, probs, sum_exp, row_max, target_logit, N, V))                                                         \
  OP(double, sum_squares, (const float* x, std::int64_t n), (x, n))                                                 \
  OP(void, scale, (float* x, float a, std::int64_t n), (x, a, n))                                                   \
  OP(void, fill, (float* x, float value, std::int64_t n), (x, value, n))                                            \
  OP(void, copy, (float* dst, const float* src, std::int64_t n), (dst, src, n))                                     \
  OP(void, axpy, (float* y, float a, const float* x, std::int64_t n), (y, a, x, n))                                 \
  OP(double, sum, (const float* x, std::int64_t n), (x, n))                                                         \
  OP(void, cast, (BufferRef dst, BufferRef src), (dst, src))                                                        \
  OP(void, matmul,                                                                                                  \
     (BufferRef out, BufferRef a, BufferRef b, int M, int N, int K, bool transa, bool transb, float alpha,          \
      float beta),                                                                                                  \
     (out, a, b, M, N, K, transa, transb, alpha, beta))                                                             \
  OP(NormCheck, sq_norm_check, (const std::vector<BufferRef>& tensors), (tensors))                                  \
  OP(void, scale, (BufferRef x, double a), (x, a))                                                                  \
  OP(void, fill, (BufferRef x, double value), (x, value))                                                           \
  OP(void, int8_absmax, (float* absmax, const float* x, std::int64_t n, std::int64_t chunk), (absmax, x, n, chunk)) \
  OP(void, int8_quantize,                                                                                           \
     (std::int8_t * q, float* error, const float* x, std::int64_t n, std::int64_t chunk, const float* absmax,       \
      int levels),                                                                                                  \
     (q, error, x, n, chunk, absmax, levels))                                                                       \
  OP(void, int8_dequantize,                                                                                         \
     (float* x, const std::int8_t* q, std::int64_t n, std::int64_t chunk, const float* absmax, int levels),         \
     (x, q, n, chunk, absmax, levels))                                                                              \
  OP(void, topk_select, (std::int32_t * index, float* value, const float* x, std::int64_t n, std::int64_t k),       \
     (index, value, x, n, k))                                                                                       \
  OP(void, topk_scatter_add, (float* x, const std::int32_t* index, const float* value, std::int64_t k),             \
     (x, index, value, k))                                                                                          \
  OP(void, topk_clear, (float* x, const std::int32_t* index, std::int64_t k), (x, index, k))

#define LOOM_BACKEND_OPS(OP)                                                                                         \
  OP(void, encoder_forward,                                                                                          \
     (float* out, const std::int32_t* inp, const float* wte, const float* wpe, int B, int T, int C, int vocab_begin, \
      int vocab_end, bool add_pos),                                                                                  \
     (out, inp, wte, wpe, B, T, C, vocab_begin, vocab_end, add_pos))                                                 \
  OP(void, encoder_backward,                                                                                         \
     (float* dwte, float* dwpe, const float* dout, const std::int32_t* inp, int B, int T, int C, int vocab_begin,    \
      int vocab_end),                                                                                                \
     (dwte, dwpe, dout, inp, B, T, C, vocab_begin, vocab_end))                                                       \
  OP(void, layernorm_forward,                                                                                        \
     (float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias, int N, int C), \
     (out, mean, rstd, inp, weight, bias, N, C))                                                                     \
  OP(void, layernorm_backward,                                                                                       \
     (float* dinp, float* dweight, float* dbias, const float* dout, const float* inp, const float* weight,           \
      const float* mean, const float* rstd, int N, int C),                                                           \
     (dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C))                                                    \
  OP(void, matmul_forward,                                                                                           \
     (float* out, const float* inp, const float* weight, const float* bias, int N, int C, int OC),                   \
     (out, inp, weight, bias, N, C, OC))                                                                             \
  OP(void, bias_add, (float* out, const float* bias, int N, int OC), (out, bias, N, OC))                             \
  OP(void, bias_backward, (float* dbias, const float* dout, int N, int OC), (dbias, dout, N, OC))                    \
  OP(void, matmul_backward,                                                                                          \
     (float* dinp, float* dweight, float* dbias, const float* dout, const float* inp, const float* weight, int N,    \
      int C, int OC),                                                                                                \
     (dinp, dweight, dbias, dout, inp, weight, N, C, OC))                                                            \
  OP(void, attention_forward, (float* out, float* att, const float* qkv, int B, int T, int C, int NH),               \
     (out, att, qkv, B, T, C, NH))                                                                                   \
  OP(void, attention_backward,                                                                                       \
     (float* dqkv, float* datt, const float* dout, const float* qkv, const float* att, int B, int T, int C, int NH), \
     (dqkv, datt, dout, qkv, att, B, T, C, NH))                                                                      \
  OP(void, gelu_forward, (float* out, const float* inp, std::int64_t n), (out, inp, n))                              \
  OP(void, gelu_backward, (float* dinp, const float* inp, const float* dout, std::int64_t n), (dinp, inp, dout, n))  \
  OP(void, adamw_update,                                                                                             \
     (float* params, float* m, float* v, const float* grads, std::int64_t n, float lr, float beta1, float beta2,     \
      float eps, float weight_decay, std::int64_t t),                                                                \
     (params, m, v, grads, n, lr, beta1, beta2, eps, weight_decay, t))

// The same operations with a default body in Backend (a back end overrides them where it can do
// better or more): the typed-operand products (default: fp32 operands only) and the fused attention
// (default: refused with flash_attention_refusal).
#define LOOM_BACKEND_DEFAULTED_OPS(OP)                                                                              \
  OP(void, matmul_forward, (float* out, BufferRef inp, BufferRef weight, const float* bias, int N, int C, int OC),  \
     (out, inp, weight, bias, N, C, OC))                                                                            \
  OP(void, matmul_backward,                                                                                         \
     (float* dinp, float* dweight, float* dbias, const float* dout, BufferRef inp, BufferRef weight, int N, int C,  \
      int OC),                                                                                                      \
     (dinp, dweight, dbias, dout, inp, weight, N, C, OC))                                                           \
  OP(void, attention_forward_flash, (float* out, float* lse, const float* qkv, int B, int T, int C, int NH),        \
     (out, lse, qkv, B, T, C, NH))                                                                                  \
  OP(void, attention_backward_flash,                                                                                \
     (float* dqkv, float* dsum, const float* dout, BufferRef out, const float* qkv, const float* lse, int B, int T, \
      int C, int NH),                                                                                               \
     (dqkv, dsum, dout, out, qkv, lse, B, T, C, NH))
// clang-format on

#define LOOM_EXPAND(...) __VA_ARGS__
