#pragma once
// The GPT-2 layer kernels of the host back end: Kokkos kernels on the host execution space, matrix
// products through CBLAS. Each layer's _forward is immediately followed by its _backward, with
// mirrored signatures: outputs first, then inputs; gradients carry a `d` prefix. Templated on the
// scalar so the unit tests can run the very same code in double precision against finite
// differences; the trainer instantiates float.
//
// Shape letters, used in every comment below:
//   B  batch (sequences in this micro-batch)   T  sequence length     C  channels (d_model)
//   NH attention heads                         hs head size = C / NH  V  vocabulary
//   N  rows = B * T                            OC output channels of a linear layer
//
// Accumulation rules (why: residual connections and micro-batches add gradients):
//   - parameter gradients (dweight, dbias, dwte, dwpe) are always accumulated (+=);
//   - layernorm_backward accumulates into dinp (it sits on the residual stream);
//   - every other dinp is overwritten.
#include <cblas.h>

#include <Kokkos_Core.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace loom::kernels {

using Exec = Kokkos::DefaultHostExecutionSpace;
using Range = Kokkos::RangePolicy<Exec>;
using Range64 = Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>;

// Elementwise kernels run over chunks: the body sees a plain [begin, end) loop on local restrict
// pointers, which the compiler vectorises (a per-element functor reads its captured pointers
// through the closure and is not vectorised).
inline constexpr std::int64_t kChunk = 4096;
template <class Body>
void for_chunks(const char* label, std::int64_t n, Body body) {
  const std::int64_t chunks = (n + kChunk - 1) / kChunk;
  Kokkos::parallel_for(label, Range64(0, chunks), [=](std::int64_t c) {
    const std::int64_t begin = c * kChunk;
    body(begin, begin + kChunk < n ? begin + kChunk : n);
  });
}

// ---------------------------------------------------------------------------------------------
// Math helpers. exp() for float is a branch-free polynomial so the compiler vectorises the loops
// that call it (softmax, GELU); max relative error ~2e-7, i.e. float rounding. Double uses libm,
// so the finite-difference tests see exact math.

inline float exp_fast(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);  // plain compares vectorise; fmin/fmax do not
  const float t = x * 1.44269504088896341f;            // x / ln 2
  const float n = std::floor(t + 0.5f);
  const float f = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;  // x - n ln2, split
  // exp(f) on [-ln2/2, ln2/2], Taylor/minimax degree 6.
  float p = 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const std::int32_t bits = (static_cast<std::int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

template <class T>
inline T exp_k(T x) {
  if constexpr (std::is_same_v<T, float>) return exp_fast(x);
  else return std::exp(x);
}

template <class T>
inline T tanh_k(T x) {
  if constexpr (std::is_same_v<T, float>) {
    // tanh(x) = 1 - 2 / (exp(2x) + 1) saturates cleanly for large |x| but cancels near 0, so small
    // |x| takes the odd Taylor series instead (both computed: the select vectorises, a branch would not).
    const float big = 1.0f - 2.0f / (exp_fast(2.0f * x) + 1.0f);
    const float x2 = x * x;
    const float small = x * (1.0f + x2 * (-1.0f / 3.0f + x2 * (2.0f / 15.0f + x2 * (-17.0f / 315.0f + x2 * (62.0f / 2835.0f)))));
    return (x < 0.125f && x > -0.125f) ? small : big;
  } else {
    return std::tanh(x);
  }
}

// ---------------------------------------------------------------------------------------------
// BLAS: row-major C[M,N] = alpha * op(A) op(B) + beta * C.

inline void gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                 const float* B, int ldb, float beta, float* C, int ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K,
              alpha, A, lda, B, ldb, beta, C, ldc);
}
inline void gemm(bool ta, bool tb, int M, int N, int K, double alpha, const double* A, int lda,
                 const double* B, int ldb, double beta, double* C, int ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K,
              alpha, A, lda, B, ldb, beta, C, ldc);
}

// ---------------------------------------------------------------------------------------------
// Token + position embedding.

// With tensor parallelism the token table is split by vocabulary: this rank holds rows
// [vocab_begin, vocab_end) and contributes zeros for other tokens (the tp all-reduce completes the
// sum); the position embedding is added by one rank only (add_pos).
template <class T>
void encoder_forward(T* out,                                        // [B,T,C]
                     const std::int32_t* inp,                       // [B,T]
                     const T* wte, const T* wpe,                    // [V or V/tp, C], [T,C]
                     int B, int Tn, int C,
                     int vocab_begin = 0, int vocab_end = 1 << 30, bool add_pos = true) {
  Kokkos::parallel_for("Encoder::forward", Range(0, B * Tn), [=](int bt) {
    const int t = bt % Tn, tok = inp[bt];
    const bool mine = tok >= vocab_begin && tok < vocab_end;
    const T* te = wte + static_cast<std::int64_t>(mine ? tok - vocab_begin : 0) * C;
    const T* pe = wpe + static_cast<std::int64_t>(t) * C;
    T* o = out + static_cast<std::int64_t>(bt) * C;
    for (int c = 0; c < C; ++c) o[c] = (mine ? te[c] : T(0)) + (add_pos ? pe[c] : T(0));
  });
}

template <class T>
void encoder_backward(T* dwte, T* dwpe,                             // [V or V/tp, C] (+=), [T,C] (+=)
                      const T* dout,                                // [B,T,C]
                      const std::int32_t* inp,                      // [B,T]
                      int B, int Tn, int C,
                      int vocab_begin = 0, int vocab_end = 1 << 30) {
  // Serial over rows: two rows may hit the same token, so rows must not race.
  Kokkos::parallel_for("Encoder::backward", Kokkos::RangePolicy<Exec>(0, 1), [=](int) {
    for (int bt = 0; bt < B * Tn; ++bt) {
      const T* d = dout + static_cast<std::int64_t>(bt) * C;
      const int tok = inp[bt];
      T* pe = dwpe + static_cast<std::int64_t>(bt % Tn) * C;
      for (int c = 0; c < C; ++c) pe[c] += d[c];
      if (tok < vocab_begin || tok >= vocab_end) continue;
      T* te = dwte + static_cast<std::int64_t>(tok - vocab_begin) * C;
      for (int c = 0; c < C; ++c) te[c] += d[c];
    }
  });
}

// ---------------------------------------------------------------------------------------------
// LayerNorm over the last dimension, eps 1e-5 (as GPT-2 and torch.nn.LayerNorm).

template <class T>
void layernorm_forward(T* out, T* mean, T* rstd,                    // [N,C], [N], [N]
                       const T* inp, const T* weight, const T* bias,  // [N,C], [C], [C]
                       int N, int C) {
  Kokkos::parallel_for("LayerNorm::forward", Range(0, N), [=](int n) {
    const T* x = inp + static_cast<std::int64_t>(n) * C;
    T m = 0;
    for (int c = 0; c < C; ++c) m += x[c];
    m /= C;
    T v = 0;
    for (int c = 0; c < C; ++c) v += (x[c] - m) * (x[c] - m);
    v /= C;
    const T s = T(1) / std::sqrt(v + T(1e-5));
    T* o = out + static_cast<std::int64_t>(n) * C;
    for (int c = 0; c < C; ++c) o[c] = (x[c] - m) * s * weight[c] + bias[c];
    mean[n] = m;
    rstd[n] = s;
  });
}

template <class T>
void layernorm_backward(T* dinp, T* dweight, T* dbias,              // [N,C] (+=), [C] (+=), [C] (+=)
                        const T* dout, const T* inp, const T* weight,  // [N,C], [N,C], [C]
                        const T* mean, const T* rstd,               // [N], [N]
                        int N, int C) {
  // dweight/dbias sum over rows: serial in rows so they do not race; vectorised along C.
  Kokkos::parallel_for("LayerNorm::backward", Kokkos::RangePolicy<Exec>(0, 1), [=](int) {
    for (int n = 0; n < N; ++n) {
      const T* d = dout + static_cast<std::int64_t>(n) * C;
      const T* x = inp + static_cast<std::int64_t>(n) * C;
      T* dx = dinp + static_cast<std::int64_t>(n) * C;
      const T m = mean[n], s = rstd[n];
      T dnorm_mean = 0, dnorm_norm_mean = 0;
      for (int c = 0; c < C; ++c) {
        const T xhat = (x[c] - m) * s;
        const T dnorm = weight[c] * d[c];
        dnorm_mean += dnorm;
        dnorm_norm_mean += dnorm * xhat;
      }
      dnorm_mean /= C;
      dnorm_norm_mean /= C;
      for (int c = 0; c < C; ++c) {
        const T xhat = (x[c] - m) * s;
        dbias[c] += d[c];
        dweight[c] += xhat * d[c];
        dx[c] += (weight[c] * d[c] - dnorm_mean - xhat * dnorm_norm_mean) * s;
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Linear layer y = x W^T + b, weights [OC, C] as torch.nn.Linear. bias may be null.

// out[n, :] += bias: the bias of a row-parallel layer is added once, after the tp reduction.
template <class T>
void bias_add(T* out, const T* bias, int N, int OC) {  // [N,OC], [OC]
  Kokkos::parallel_for("Matmul::bias", Range(0, N), [=](int n) {
    T* o = out + static_cast<std::int64_t>(n) * OC;
    for (int j = 0; j < OC; ++j) o[j] += bias[j];
  });
}

// dbias += sum over rows of dout: the backward of bias_add.
template <class T>
void bias_backward(T* dbias, const T* dout, int N, int OC) {  // [OC] (+=), [N,OC]
  Kokkos::parallel_for("Matmul::backward_bias", Kokkos::RangePolicy<Exec>(0, 1), [=](int) {
    for (int n = 0; n < N; ++n) {
      const T* d = dout + static_cast<std::int64_t>(n) * OC;
      for (int j = 0; j < OC; ++j) dbias[j] += d[j];
    }
  });
}

template <class T>
void matmul_forward(T* out,                                          // [N,OC]
                    const T* inp, const T* weight, const T* bias,    // [N,C], [OC,C], [OC] or null
                    int N, int C, int OC) {
  gemm(false, true, N, OC, C, T(1), inp, C, weight, C, T(0), out, OC);
  if (bias) bias_add(out, bias, N, OC);
}

template <class T>
void matmul_backward(T* dinp, T* dweight, T* dbias,                  // [N,C] (=), [OC,C] (+=), [OC] (+=) or null
                     const T* dout, const T* inp, const T* weight,   // [N,OC], [N,C], [OC,C]
                     int N, int C, int OC) {
  gemm(false, false, N, C, OC, T(1), dout, OC, weight, C, T(0), dinp, C);       // dinp = dout W
  gemm(true, false, OC, C, N, T(1), dout, OC, inp, C, T(1), dweight, C);        // dW += dout^T x
  if (dbias) bias_backward(dbias, dout, N, OC);
}

// ---------------------------------------------------------------------------------------------
// Causal multi-head self-attention on a fused qkv activation. Per (b, h) the products are
// strided BLAS calls straight into qkv (leading dimension 3C), so q, k, v are never copied.

template <class T>
void attention_forward(T* out, T* att,                               // [B,T,C], [B,NH,T,T] (softmax probs)
                       const T* qkv,                                 // [B,T,3C]
                       int B, int Tn, int C, int NH) {
  const int hs = C / NH, C3 = 3 * C;
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < NH; ++h) {
      const T* q = qkv + static_cast<std::int64_t>(b) * Tn * C3 + h * hs;
      const T* k = q + C;
      const T* v = q + 2 * C;
      T* a = att + (static_cast<std::int64_t>(b) * NH + h) * Tn * Tn;
      gemm(false, true, Tn, Tn, hs, scale, q, C3, k, C3, T(0), a, Tn);  // scores = q k^T / sqrt(hs)
      Kokkos::parallel_for("Attention::softmax_forward", Range(0, Tn), [=](int t) {
        T* row = a + static_cast<std::int64_t>(t) * Tn;
        T mx = row[0];
        for (int j = 1; j <= t; ++j) mx = row[j] > mx ? row[j] : mx;
        T sum = 0;
        for (int j = 0; j <= t; ++j) {
          row[j] = exp_k(row[j] - mx);
          sum += row[j];
        }
        const T inv = T(1) / sum;
        for (int j = 0; j <= t; ++j) row[j] *= inv;
        for (int j = t + 1; j < Tn; ++j) row[j] = 0;  // causal mask
      });
      gemm(false, false, Tn, hs, Tn, T(1), a, Tn, v, C3, T(0),
           out + static_cast<std::int64_t>(b) * Tn * C + h * hs, C);    // out_h = att v
    }
  }
}

template <class T>
void attention_backward(T* dqkv, T* datt,                            // [B,T,3C] (=), [T,T] scratch
                        const T* dout,                               // [B,T,C]
                        const T* qkv, const T* att,                  // [B,T,3C], [B,NH,T,T]
                        int B, int Tn, int C, int NH) {
  const int hs = C / NH, C3 = 3 * C;
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < NH; ++h) {
      const std::int64_t base = static_cast<std::int64_t>(b) * Tn * C3 + h * hs;
      const T* q = qkv + base;
      const T* k = q + C;
      const T* v = q + 2 * C;
      T* dq = dqkv + base;
      T* dk = dq + C;
      T* dv = dq + 2 * C;
      const T* a = att + (static_cast<std::int64_t>(b) * NH + h) * Tn * Tn;
      const T* d = dout + static_cast<std::int64_t>(b) * Tn * C + h * hs;
      gemm(true, false, Tn, hs, Tn, T(1), a, Tn, d, C, T(0), dv, C3);   // dv = att^T dout
      gemm(false, true, Tn, Tn, hs, T(1), d, C, v, C3, T(0), datt, Tn);  // datt = dout v^T
      // softmax backward in place: dscores = att * (datt - sum_j att*datt), masked entries 0
      Kokkos::parallel_for("Attention::softmax_backward", Range(0, Tn), [=](int t) {
        T* dr = datt + static_cast<std::int64_t>(t) * Tn;
        const T* ar = a + static_cast<std::int64_t>(t) * Tn;
        T dot = 0;
        for (int j = 0; j <= t; ++j) dot += ar[j] * dr[j];
        for (int j = 0; j <= t; ++j) dr[j] = ar[j] * (dr[j] - dot);
        for (int j = t + 1; j < Tn; ++j) dr[j] = 0;
      });
      gemm(false, false, Tn, hs, Tn, scale, datt, Tn, k, C3, T(0), dq, C3);  // dq = ds k / sqrt(hs)
      gemm(true, false, Tn, hs, Tn, scale, datt, Tn, q, C3, T(0), dk, C3);   // dk = ds^T q / sqrt(hs)
    }
  }
}

// ---------------------------------------------------------------------------------------------
// GELU, tanh approximation (GPT-2).

template <class T>
void gelu_forward(T* out, const T* inp, std::int64_t n) {  // [n], [n]
  const T k = std::sqrt(T(2) / T(M_PI));
  for_chunks("GELU::forward", n, [=](std::int64_t begin, std::int64_t end) {
    T* __restrict o = out;
    const T* __restrict in = inp;
    for (std::int64_t i = begin; i < end; ++i) {
      const T x = in[i];
      const T u = k * (x + T(0.044715) * x * x * x);
      o[i] = T(0.5) * x * (T(1) + tanh_k(u));
    }
  });
}

template <class T>
void gelu_backward(T* dinp, const T* inp, const T* dout, std::int64_t n) {  // [n] (=), [n], [n]
  const T k = std::sqrt(T(2) / T(M_PI));
  for_chunks("GELU::backward", n, [=](std::int64_t begin, std::int64_t end) {
    T* __restrict di = dinp;
    const T* __restrict in = inp;
    const T* __restrict d = dout;
    for (std::int64_t i = begin; i < end; ++i) {
      const T x = in[i];
      const T u = k * (x + T(0.044715) * x * x * x);
      const T th = tanh_k(u);
      const T sech2 = T(1) - th * th;
      const T du = k * (T(1) + T(3) * T(0.044715) * x * x);
      di[i] = (T(0.5) * (T(1) + th) + T(0.5) * x * sech2 * du) * d[i];
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Residual add.

template <class T>
void residual_forward(T* out, const T* a, const T* b, std::int64_t n) {  // [n], [n], [n]
  for_chunks("Residual::forward", n, [=](std::int64_t begin, std::int64_t end) {
    T* __restrict o = out;
    const T* __restrict x = a;
    const T* __restrict y = b;
    for (std::int64_t i = begin; i < end; ++i) o[i] = x[i] + y[i];
  });
}
// The residual's backward is the identity on both branches: callers copy the incoming gradient.

// ---------------------------------------------------------------------------------------------
// Softmax + cross-entropy, fused. losses[n] = -log softmax(logits[n])[target[n]].

template <class T>
void crossentropy_forward(T* losses, T* probs,                       // [N], [N,V]
                          const T* logits, const std::int32_t* targets,  // [N,V], [N]
                          int N, int V) {
  Kokkos::parallel_for("CrossEntropy::forward", Range(0, N), [=](int n) {
    const T* l = logits + static_cast<std::int64_t>(n) * V;
    T* p = probs + static_cast<std::int64_t>(n) * V;
    T mx = l[0];
    for (int v = 1; v < V; ++v) mx = l[v] > mx ? l[v] : mx;
    T sum = 0;
    for (int v = 0; v < V; ++v) {
      p[v] = exp_k(l[v] - mx);
      sum += p[v];
    }
    const T inv = T(1) / sum;
    for (int v = 0; v < V; ++v) p[v] *= inv;
    // log-sum-exp form: exact even when the target's probability underflows
    losses[n] = std::log(sum) + mx - l[targets[n]];
  });
}

template <class T>
void crossentropy_backward(T* dlogits,                               // [N,V] (=); may alias probs
                           const T* probs, const std::int32_t* targets,  // [N,V], [N]
                           T dloss,                                  // d(total loss)/d(loss of one row)
                           int N, int V) {
  Kokkos::parallel_for("CrossEntropy::backward", Range(0, N), [=](int n) {
    const T* p = probs + static_cast<std::int64_t>(n) * V;
    T* d = dlogits + static_cast<std::int64_t>(n) * V;
    const int tgt = targets[n];
    for (int v = 0; v < V; ++v) d[v] = (p[v] - (v == tgt ? T(1) : T(0))) * dloss;
  });
}

// ---------------------------------------------------------------------------------------------
// AdamW (torch.optim.AdamW semantics): decoupled weight decay, bias-corrected moments.

template <class T>
void adamw_update(T* params, T* m, T* v,                              // [n] each, updated
                  const T* grads, std::int64_t n,                     // [n]
                  T lr, T beta1, T beta2, T eps, T weight_decay, std::int64_t t /* 1-based */) {
  const T bc1 = T(1) - std::pow(beta1, static_cast<T>(t));
  const T bc2 = T(1) - std::pow(beta2, static_cast<T>(t));
  for_chunks("AdamW::update", n, [=](std::int64_t begin, std::int64_t end) {
    T* __restrict p = params;
    T* __restrict mm = m;
    T* __restrict vv = v;
    const T* __restrict gg = grads;
    for (std::int64_t i = begin; i < end; ++i) {
      const T g = gg[i];
      const T mi = beta1 * mm[i] + (T(1) - beta1) * g;
      const T vi = beta2 * vv[i] + (T(1) - beta2) * g * g;
      mm[i] = mi;
      vv[i] = vi;
      p[i] = p[i] * (T(1) - lr * weight_decay) - lr * (mi / bc1) / (std::sqrt(vi / bc2) + eps);
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Reductions and fills used by the engine.

// Sum of f(x[i]) over [0, n): partial sums per chunk in `Partial`, accumulated in double.
template <class Partial, class T, class F>
double reduce_chunks(const char* label, const T* x, std::int64_t n, F f) {
  double s = 0;
  const std::int64_t chunks = (n + kChunk - 1) / kChunk;
  Kokkos::parallel_reduce(label, Range64(0, chunks), [=](std::int64_t c, double& acc) {
    const T* __restrict in = x;
    const std::int64_t begin = c * kChunk, end = begin + kChunk < n ? begin + kChunk : n;
    Partial part = 0;
    for (std::int64_t i = begin; i < end; ++i) part += f(in[i]);
    acc += static_cast<double>(part);
  }, s);
  return s;
}

template <class T>
double sum_squares(const T* x, std::int64_t n) {
  return reduce_chunks<T>("Reduce::sum_squares", x, n, [](T v) { return v * v; });
}

template <class T>
double sum(const T* x, std::int64_t n) {
  return reduce_chunks<double>("Reduce::sum", x, n, [](T v) { return static_cast<double>(v); });
}

template <class T>
void scale(T* x, T a, std::int64_t n) {
  for_chunks("Scale", n, [=](std::int64_t begin, std::int64_t end) {
    T* __restrict o = x;
    for (std::int64_t i = begin; i < end; ++i) o[i] *= a;
  });
}

template <class T>
void fill(T* x, T value, std::int64_t n) {
  for_chunks("Fill", n, [=](std::int64_t begin, std::int64_t end) {
    T* __restrict o = x;
    for (std::int64_t i = begin; i < end; ++i) o[i] = value;
  });
}

template <class T>
void copy(T* dst, const T* src, std::int64_t n) {
  for_chunks("Copy", n, [=](std::int64_t begin, std::int64_t end) {
    T* __restrict o = dst;
    const T* __restrict in = src;
    for (std::int64_t i = begin; i < end; ++i) o[i] = in[i];
  });
}

}  // namespace loom::kernels
