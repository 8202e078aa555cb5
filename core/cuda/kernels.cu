// Launch wrappers of the CUDA layer kernels (core/cuda/layer_kernels.cuh, where the kernels and
// their launch geometry are; contracts in core/cuda/kernels.cuh): each runs the operation on a
// stream and throws, naming the kernel, when a launch fails.
#include "core/cuda/kernels.cuh"

#include <cmath>
#include <stdexcept>
#include <string>

#include "core/cuda/layer_kernels.cuh"
#include "core/cuda/on_stream.cuh"

namespace loom::cuda {
namespace {

template <DType D>
struct TypeTag {
  static constexpr DType value = D;
};

// Calls f(TypeTag<t>{}) for the four floating-point types; throws for any other.
template <class F>
void with_float_type(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::f32:
      f(TypeTag<DType::f32>{});
      return;
    case DType::f64:
      f(TypeTag<DType::f64>{});
      return;
    case DType::bf16:
      f(TypeTag<DType::bf16>{});
      return;
    case DType::f16:
      f(TypeTag<DType::f16>{});
      return;
    default:
      break;
  }
  throw std::invalid_argument(std::string("loom::cuda::") + op + ": unsupported dtype " + dtype_name(t));
}

// Calls f(TypeTag<t>{}) for the types an fp32 kernel's output may be stored as: fp32, bf16, fp16.
template <class F>
void with_output_type(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::f32:
      return f(TypeTag<DType::f32>{});
    case DType::bf16:
      return f(TypeTag<DType::bf16>{});
    case DType::f16:
      return f(TypeTag<DType::f16>{});
    default:
      break;
  }
  throw std::invalid_argument(std::string("loom::cuda::") + op + ": the output is " + dtype_name(t) +
                              "; fp32, bf16 or fp16 expected");
}

template <layer::ReduceOp Op>
void reduce(const char* op, double* out, const void* x, DType type, std::int64_t n, double* scratch,
            cudaStream_t stream) {
  with_float_type(type, op, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    layer::reduce<D, Op>(OnStream{stream}, out, static_cast<const layer::storage_t<D>*>(x), n, scratch);
  });
}

}  // namespace

void encoder_forward(float* out, const std::int32_t* inp, const float* wte, const float* wpe, int B, int T, int C,
                     int vocab_begin, int vocab_end, bool add_pos, cudaStream_t stream) {
  layer::encoder_forward(OnStream{stream}, out, inp, wte, wpe, B, T, C, vocab_begin, vocab_end, add_pos);
}

void encoder_backward(float* dwte, float* dwpe, const float* dout, const std::int32_t* inp, int B, int T, int C,
                      int vocab_begin, int vocab_end, cudaStream_t stream) {
  layer::encoder_backward(OnStream{stream}, dwte, dwpe, dout, inp, B, T, C, vocab_begin, vocab_end);
}

void layernorm_forward(void* out, DType out_type, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int N, int C, cudaStream_t stream) {
  with_output_type(out_type, "layernorm_forward", [&](auto tag) {
    constexpr DType O = decltype(tag)::value;
    layer::layernorm_forward<O>(OnStream{stream}, static_cast<layer::storage_t<O>*>(out), mean, rstd, inp, weight, bias,
                                N, C);
  });
}

void residual_layernorm_forward(float* residual, void* out, DType out_type, float* mean, float* rstd, const float* a,
                                const float* b, const float* weight, const float* bias, int N, int C,
                                cudaStream_t stream) {
  with_output_type(out_type, "residual_layernorm_forward", [&](auto tag) {
    constexpr DType O = decltype(tag)::value;
    layer::residual_layernorm_forward<O>(OnStream{stream}, residual, static_cast<layer::storage_t<O>*>(out), mean, rstd,
                                         a, b, weight, bias, N, C);
  });
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int N, int C, float* scratch,
                        std::int64_t scratch_floats, cudaStream_t stream) {
  layer::layernorm_backward(OnStream{stream}, dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, scratch,
                            scratch_floats);
}

void bias_add(float* out, const float* bias, int N, int OC, cudaStream_t stream) {
  layer::bias_add(OnStream{stream}, out, bias, N, OC);
}

void bias_backward(float* dbias, const float* dout, int N, int OC, float* scratch, std::int64_t scratch_floats,
                   cudaStream_t stream) {
  layer::bias_backward(OnStream{stream}, dbias, dout, N, OC, scratch, scratch_floats);
}

void softmax_causal_forward(float* att, int rows, int T, cudaStream_t stream) {
  layer::softmax_causal_forward(OnStream{stream}, att, rows, T);
}

void softmax_causal_backward(float* datt, const float* att, int rows, int T, cudaStream_t stream) {
  layer::softmax_causal_backward(OnStream{stream}, datt, att, rows, T);
}

void bias_backward_cast(float* dbias, void* copy, DType copy_type, const float* dout, int N, int OC, float* scratch,
                        std::int64_t scratch_floats, cudaStream_t stream) {
  with_output_type(copy_type, "bias_backward_cast", [&](auto tag) {
    constexpr DType O = decltype(tag)::value;
    layer::bias_backward_cast<O>(OnStream{stream}, dbias, static_cast<layer::storage_t<O>*>(copy), dout, N, OC, scratch,
                                 scratch_floats);
  });
}

void rmsnorm_forward(void* out, DType out_type, float* rstd, const float* inp, const float* weight, int N, int C,
                     float eps, cudaStream_t stream) {
  with_output_type(out_type, "rmsnorm_forward", [&](auto tag) {
    constexpr DType O = decltype(tag)::value;
    layer::rmsnorm_forward<O>(OnStream{stream}, static_cast<layer::storage_t<O>*>(out), rstd, inp, weight, N, C, eps);
  });
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int N, int C, float* scratch, std::int64_t scratch_floats,
                      cudaStream_t stream) {
  layer::rmsnorm_backward(OnStream{stream}, dinp, dweight, dout, inp, weight, rstd, N, C, scratch, scratch_floats);
}

void rope_gqa_forward(float* qkv, const float* q, const float* k, const float* v, int N, int T, int NH, int KV, int hs,
                      int head0, int kv0, int group, float theta, cudaStream_t stream) {
  layer::rope_gqa_forward(OnStream{stream}, qkv, q, k, v, N, T, NH, KV, hs, head0, kv0, group, theta);
}

void rope_gqa_backward(float* dq, float* dk, float* dv, const float* dqkv, int N, int T, int NH, int KV, int hs,
                       int head0, int kv0, int group, float theta, cudaStream_t stream) {
  layer::rope_gqa_backward(OnStream{stream}, dq, dk, dv, dqkv, N, T, NH, KV, hs, head0, kv0, group, theta);
}

void swiglu_forward(void* out, DType out_type, const float* gate, const float* up, std::int64_t n,
                    cudaStream_t stream) {
  with_output_type(out_type, "swiglu_forward", [&](auto tag) {
    constexpr DType O = decltype(tag)::value;
    layer::swiglu_forward<O>(OnStream{stream}, static_cast<layer::storage_t<O>*>(out), gate, up, n);
  });
}

void swiglu_backward(void* dgate, void* dup, DType type, const float* dout, const float* gate, const float* up,
                     std::int64_t n, cudaStream_t stream) {
  with_output_type(type, "swiglu_backward", [&](auto tag) {
    constexpr DType O = decltype(tag)::value;
    layer::swiglu_backward<O>(OnStream{stream}, static_cast<layer::storage_t<O>*>(dgate),
                              static_cast<layer::storage_t<O>*>(dup), dout, gate, up, n);
  });
}

void gelu_forward(void* out, DType out_type, const float* inp, std::int64_t n, cudaStream_t stream) {
  with_output_type(out_type, "gelu_forward", [&](auto tag) {
    constexpr DType O = decltype(tag)::value;
    layer::gelu_forward<O>(OnStream{stream}, static_cast<layer::storage_t<O>*>(out), inp, n);
  });
}

void gelu_backward(float* dinp, const float* inp, const float* dout, std::int64_t n, cudaStream_t stream) {
  layer::gelu_backward(OnStream{stream}, dinp, inp, dout, n);
}

void gelu_bias_backward(void* dpre, DType dpre_type, float* dbias, const float* pre, const float* dout, int N, int OC,
                        float* scratch, std::int64_t scratch_floats, cudaStream_t stream) {
  with_output_type(dpre_type, "gelu_bias_backward", [&](auto tag) {
    constexpr DType O = decltype(tag)::value;
    layer::gelu_bias_backward<O>(OnStream{stream}, static_cast<layer::storage_t<O>*>(dpre), dbias, pre, dout, N, OC,
                                 scratch, scratch_floats);
  });
}

void residual_forward(float* out, const float* a, const float* b, std::int64_t n, cudaStream_t stream) {
  layer::residual_forward(OnStream{stream}, out, a, b, n);
}

void crossentropy_forward(float* losses, float* probs, const float* logits, const std::int32_t* targets, int N, int V,
                          cudaStream_t stream) {
  if (N <= 0 || V <= 0) return;
  // Stage the row in shared memory when it fits this device's per-block limit (opt-in beyond 48 kB).
  int device = 0, optin = 0;
  check_call(cudaGetDevice(&device), "cudaGetDevice");
  check_call(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "cudaDeviceGetAttribute");
  layer::crossentropy_forward(OnStream{stream}, static_cast<std::size_t>(optin), losses, probs, logits, targets, N, V);
}

void crossentropy_fused(float* losses, void* dlogits, DType dlogits_type, const float* logits,
                        const std::int32_t* targets, float dloss, int N, int V, cudaStream_t stream) {
  if (N <= 0 || V <= 0) return;
  int device = 0, optin = 0;
  check_call(cudaGetDevice(&device), "cudaGetDevice");
  check_call(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "cudaDeviceGetAttribute");
  with_output_type(dlogits_type, "crossentropy_fused", [&](auto tag) {
    constexpr DType O = decltype(tag)::value;
    layer::crossentropy_fused<O>(OnStream{stream}, static_cast<std::size_t>(optin), losses,
                                 static_cast<layer::storage_t<O>*>(dlogits), logits, targets, dloss, N, V);
  });
}

void crossentropy_backward(void* dlogits, DType dlogits_type, const float* probs, const std::int32_t* targets,
                           float dloss, int N, int V, int vocab_begin, cudaStream_t stream) {
  with_output_type(dlogits_type, "crossentropy_backward", [&](auto tag) {
    constexpr DType O = decltype(tag)::value;
    layer::crossentropy_backward<O>(OnStream{stream}, static_cast<layer::storage_t<O>*>(dlogits), probs, targets, dloss,
                                    N, V, vocab_begin);
  });
}

void crossentropy_row_max(float* row_max, const float* logits, int N, int V, cudaStream_t stream) {
  layer::crossentropy_row_max(OnStream{stream}, row_max, logits, N, V);
}

void crossentropy_partial(float* probs, double* sum_exp, double* target_logit, const float* logits,
                          const float* row_max, const std::int32_t* targets, int N, int V, int vocab_begin,
                          cudaStream_t stream) {
  layer::crossentropy_partial(OnStream{stream}, probs, sum_exp, target_logit, logits, row_max, targets, N, V,
                              vocab_begin);
}

void crossentropy_finish(float* losses, float* probs, const double* sum_exp, const float* row_max,
                         const double* target_logit, int N, int V, cudaStream_t stream) {
  layer::crossentropy_finish(OnStream{stream}, losses, probs, sum_exp, row_max, target_logit, N, V);
}

void crossentropy_finish_grad(float* losses, void* dlogits, DType dlogits_type, const float* logits,
                              const double* sum_exp, const float* row_max, const double* target_logit,
                              const std::int32_t* targets, float dloss, int N, int V, int vocab_begin,
                              cudaStream_t stream) {
  with_output_type(dlogits_type, "crossentropy_finish_grad", [&](auto tag) {
    constexpr DType O = decltype(tag)::value;
    layer::crossentropy_finish_grad<O>(OnStream{stream}, losses, static_cast<layer::storage_t<O>*>(dlogits), logits,
                                       sum_exp, row_max, target_logit, targets, dloss, N, V, vocab_begin);
  });
}

namespace {
// AdamW's step at 1-based step t, its bias corrections as core/backend/kernels.hpp makes them:
// std::pow(float, float), in float, on the host.
loom::math::AdamWStep<float> adamw_step(float lr, float beta1, float beta2, float eps, float weight_decay,
                                        std::int64_t t) {
  const float bc1 = 1.0f - std::pow(beta1, static_cast<float>(t));
  const float bc2 = 1.0f - std::pow(beta2, static_cast<float>(t));
  return loom::math::AdamWStep<float>{lr, beta1, beta2, eps, weight_decay, bc1, bc2};
}
}  // namespace

void adamw_update(float* params, float* m, float* v, const float* grads, std::int64_t n, float lr, float beta1,
                  float beta2, float eps, float weight_decay, std::int64_t t, cudaStream_t stream) {
  layer::adamw_update(OnStream{stream}, params, m, v, grads, n, adamw_step(lr, beta1, beta2, eps, weight_decay, t));
}

void adamw_update_slices(float* const* params, float* const* m, float* const* v, const float* const* grads,
                         const std::int64_t* n, const float* wd, int count, float lr, float beta1, float beta2,
                         float eps, std::int64_t t, cudaStream_t stream) {
  // each slice's weight decay comes with it
  layer::adamw_update_slices(OnStream{stream}, params, m, v, grads, n, wd, count,
                             adamw_step(lr, beta1, beta2, eps, 0.0f, t));
}

void cast(void* dst, DType dst_type, const void* src, DType src_type, std::int64_t n, cudaStream_t stream) {
  with_float_type(dst_type, "cast", [&](auto dtag) {
    with_float_type(src_type, "cast", [&](auto stag) {
      constexpr DType D = decltype(dtag)::value;
      constexpr DType S = decltype(stag)::value;
      layer::cast<D, S>(OnStream{stream}, static_cast<layer::storage_t<D>*>(dst),
                        static_cast<const layer::storage_t<S>*>(src), n);
    });
  });
}

void scale(void* x, DType type, double a, std::int64_t n, cudaStream_t stream) {
  with_float_type(type, "scale", [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    layer::scale<D>(OnStream{stream}, static_cast<layer::storage_t<D>*>(x), static_cast<layer::compute_t<D>>(a), n);
  });
}

void fill(void* x, DType type, double value, std::int64_t n, cudaStream_t stream) {
  with_float_type(type, "fill", [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    layer::fill<D>(OnStream{stream}, static_cast<layer::storage_t<D>*>(x), static_cast<layer::compute_t<D>>(value), n);
  });
}

std::int64_t reduce_scratch_count(std::int64_t n) { return layer::reduce_geometry(n).blocks; }

void sum(double* out, const void* x, DType type, std::int64_t n, double* scratch, cudaStream_t stream) {
  reduce<layer::ReduceOp::sum>("sum", out, x, type, n, scratch, stream);
}

std::int64_t norm_check_scratch_count(const std::int64_t* n, int count) {
  return layer::norm_check_scratch_count(n, count);
}

void norm_check(double* sq, double* bad, const void* const* x, const std::int64_t* n, int count, DType type,
                double* scratch, cudaStream_t stream) {
  with_float_type(type, "norm_check", [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    layer::norm_check<D>(OnStream{stream}, sq, bad, reinterpret_cast<const layer::storage_t<D>* const*>(x), n, count,
                         scratch);
  });
}

void axpy(float* y, float a, const float* x, std::int64_t n, cudaStream_t stream) {
  layer::axpy(OnStream{stream}, y, a, x, n);
}

void int8_absmax(float* absmax, const float* x, std::int64_t n, std::int64_t chunk, double* nonfinite, double* scratch,
                 cudaStream_t stream) {
  layer::int8_absmax(OnStream{stream}, absmax, x, n, chunk, nonfinite, scratch);
}

void int8_quantize(std::int8_t* q, float* error, const float* x, std::int64_t n, std::int64_t chunk,
                   const float* absmax, int levels, cudaStream_t stream) {
  layer::int8_quantize(OnStream{stream}, q, error, x, n, chunk, absmax, levels);
}

void int8_dequantize(float* x, const std::int8_t* q, std::int64_t n, std::int64_t chunk, const float* absmax,
                     int levels, cudaStream_t stream) {
  layer::int8_dequantize(OnStream{stream}, x, q, n, chunk, absmax, levels);
}

}  // namespace loom::cuda
