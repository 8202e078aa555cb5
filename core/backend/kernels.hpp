#pragma once
// The GPT-2 layer kernels of the host back end: Kokkos kernels on the host execution space, matrix
// products through core/backend/gemm (oneDNN or CBLAS, run.gemm). Each layer's _forward is immediately
// followed by its _backward, with mirrored signatures: outputs first, then inputs; gradients carry
// a `d` prefix.
//
// Storage and compute types. Each kernel is `template <class T, class Acc = acc_type_t<T>>`: T is
// what the tensors hold, Acc what the kernel adds, multiplies and reduces in (core/base/dtype.hpp:
// float -> float, double -> double, bf16 -> float, fp16 -> float). Every stored value is loaded with
// to_acc and stored with from_acc (the identity when T == Acc, so the float and double
// instantiations are the plain code, operation for operation); statistics and sums stay in Acc:
// LayerNorm mean and rstd (stored as Acc), the backward's two row sums, the softmax max and sum,
// the attention backward's row dot products, the cross-entropy loss (stored as Acc), and the sums
// of parameter gradients over rows (dbias, dweight of LayerNorm, the embedding rows), which for
// 16-bit storage are summed in an Acc copy and rounded once at the end. AdamW keeps its moments in
// Acc; parameters and gradients may each be another type. The unit tests run the double
// instantiation against finite differences and the bf16/fp16 ones against float; the trainer
// instantiates float.
//
// Matrix products with bf16/fp16 storage accumulate in float and round the result once: bf16
// operands go to loom::gemm::gemm_bf16 as they are, fp16 ones through float copies and sgemm.
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
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <cstring>
#include <functional>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/base/dtype.hpp"
#include "core/backend/gemm.hpp"
#include "core/backend/host_isa.hpp"
#include "core/backend/kernel_math.hpp"

namespace loom::kernels {

using Exec = Kokkos::DefaultHostExecutionSpace;
using Range = Kokkos::RangePolicy<Exec>;
using Range64 = Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>;

// A parameter that takes no part in template argument deduction: scalar arguments (dloss, the
// learning rate, a fill value) are of the compute type Acc, which follows from the tensors' types.
template <class T>
struct non_deduced {
  using type = T;
};
template <class T>
using nd = typename non_deduced<T>::type;

template <class T>
inline constexpr bool is_16bit_v = std::is_same_v<T, bf16> || std::is_same_v<T, f16>;

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

// The inner loops (one row, one span, one block of columns) of the kernels below, for every element
// type (core/backend/kernel_rows.inc). The fp32 instances run through isa::active() instead: the same
// loops compiled for this CPU's instruction set, chosen at run time (core/backend/host_isa.hpp), the
// same bits.
namespace rows {
#include "core/backend/kernel_rows.inc"
}  // namespace rows
using rows::kColumnQuantum;
using rows::kColumns;
using rows::lane_max;
using rows::lane_sum;
template <class T, class Acc>
inline constexpr bool fp32_v = std::is_same_v<T, float>&& std::is_same_v<Acc, float>;
// One inner loop: for fp32, this CPU's copy in `rk` (the member `fp32` of isa::RowKernels); for every
// other type, the template `generic` instantiated for it. The arguments go through unchanged
// (references stay references: LayerNorm's mean and rstd are written through them).
template <class T, class Acc, class F, class G, class... A>
inline void row_loop(const isa::RowKernels* rk, F isa::RowKernels::*fp32, G generic, A&&... a) {
  if constexpr (fp32_v<T, Acc>)
    (rk->*fp32)(std::forward<A>(a)...);
  else
    generic(std::forward<A>(a)...);
}
// The same for a loop whose output is stored as O: an fp32 loop storing fp32 or bf16 runs this CPU's
// copy (`fp32` or `fp32_bf16`); every other combination (an fp16 output among them) the template.
template <class T, class Acc, class O, class F, class F16, class G, class... A>
inline void row_loop_out(const isa::RowKernels* rk, F isa::RowKernels::*fp32, F16 isa::RowKernels::*fp32_bf16,
                         G generic, A&&... a) {
  if constexpr (fp32_v<T, Acc> && std::is_same_v<O, float>)
    (rk->*fp32)(std::forward<A>(a)...);
  else if constexpr (fp32_v<T, Acc> && std::is_same_v<O, bf16>)
    (rk->*fp32_bf16)(std::forward<A>(a)...);
  else
    generic(std::forward<A>(a)...);
}

// Sums over rows of a [rows, C] table into C parameter gradients (dbias, LayerNorm's dweight,
// embedding rows): the columns are cut into blocks, one block a task, so no two tasks write one
// element, and each column adds its rows in row order, the same bits whatever the threads and the
// blocks. A block is C / threads wide, rounded up to kColumnQuantum, at most kColumns: one thread
// reads whole rows. body(c0, c1) handles columns [c0, c1).
inline int column_block_width(int C, int threads) {
  const int t = threads > 0 ? threads : 1;
  int w = (C + t - 1) / t;
  w = (w + kColumnQuantum - 1) / kColumnQuantum * kColumnQuantum;
  return w < kColumnQuantum ? kColumnQuantum : w > kColumns ? kColumns : w;
}
template <class Body>
void for_column_blocks(const char* label, int C, Body body) {
  const int w = column_block_width(C, Kokkos::DefaultExecutionSpace().concurrency());
  Kokkos::parallel_for(label, Range(0, (C + w - 1) / w), [=](int blk) {
    const int c0 = blk * w;
    body(c0, c0 + w < C ? c0 + w : C);
  });
}

// ---------------------------------------------------------------------------------------------
// Math helpers: shared with the CUDA kernels (core/backend/kernel_math.hpp).

using math::exp_fast;
using math::exp_k;
using math::tanh_k;

// ---------------------------------------------------------------------------------------------
// Matrix products: row-major C[M,N] = alpha * op(A) op(B) + beta * C. float through core/backend/gemm
// (oneDNN or OpenBLAS, run.gemm), double through cblas_dgemm.

inline void gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
                 float beta, float* C, int ldc) {
  loom::gemm::sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
inline void gemm(bool ta, bool tb, int M, int N, int K, double alpha, const double* A, int lda, const double* B,
                 int ldb, double beta, double* C, int ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda, B,
              ldb, beta, C, ldc);
}
// bf16/fp16 storage, float accumulation, the result rounded back into C once. bf16: A and B as they
// are (loom::gemm::gemm_bf16), C through a float copy. fp16: op(A) and op(B) converted to float, one
// sgemm. Correct; only the bf16 operands avoid the copies.
template <class T, std::enable_if_t<is_16bit_v<T>, int> = 0>
void gemm(bool ta, bool tb, int M, int N, int K, float alpha, const T* A, int lda, const T* B, int ldb, float beta,
          T* C, int ldc) {
  const auto to_dense = [](const T* X, int rows, int cols, int ld) {
    std::vector<float> d(static_cast<std::size_t>(rows) * cols);
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c)
        d[static_cast<std::size_t>(r) * cols + c] = to_float(X[static_cast<std::int64_t>(r) * ld + c]);
    return d;
  };
  std::vector<float> c = beta != 0.0f ? to_dense(C, M, N, ldc) : std::vector<float>(static_cast<std::size_t>(M) * N);
  if constexpr (std::is_same_v<T, bf16>) {
    loom::gemm::gemm_bf16(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, c.data(), std::max(1, N));
  } else {
    const int ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
    const std::vector<float> a = to_dense(A, ar, ac, lda), b = to_dense(B, br, bc, ldb);
    gemm(ta, tb, M, N, K, alpha, a.data(), std::max(1, ac), b.data(), std::max(1, bc), beta, c.data(), std::max(1, N));
  }
  for (int r = 0; r < M; ++r)
    for (int j = 0; j < N; ++j)
      C[static_cast<std::int64_t>(r) * ldc + j] = from_acc<T>(c[static_cast<std::size_t>(r) * N + j]);
}

// ---------------------------------------------------------------------------------------------
// Token + position embedding.

// With tensor parallelism the token table is split by vocabulary: this rank holds rows
// [vocab_begin, vocab_end) and contributes zeros for other tokens (the tp all-reduce completes the
// sum); the position embedding is added by one rank only (add_pos).
template <class T, class Acc = acc_type_t<T>>
void encoder_forward(T* out,                      // [B,T,C]
                     const std::int32_t* inp,     // [B,T]
                     const T* wte, const T* wpe,  // [V or V/tp, C], [T,C]
                     int B, int Tn, int C, int vocab_begin = 0, int vocab_end = 1 << 30, bool add_pos = true) {
  Kokkos::parallel_for("Encoder::forward", Range(0, B * Tn), [=](int bt) {
    const int t = bt % Tn, tok = inp[bt];
    const bool mine = tok >= vocab_begin && tok < vocab_end;
    const T* te = wte + static_cast<std::int64_t>(mine ? tok - vocab_begin : 0) * C;
    const T* pe = wpe + static_cast<std::int64_t>(t) * C;
    T* o = out + static_cast<std::int64_t>(bt) * C;
    for (int c = 0; c < C; ++c)
      o[c] = from_acc<T>((mine ? to_acc<Acc>(te[c]) : Acc(0)) + (add_pos ? to_acc<Acc>(pe[c]) : Acc(0)));
  });
}

template <class T, class Acc = acc_type_t<T>>
void encoder_backward(T* dwte, T* dwpe,         // [V or V/tp, C] (+=), [T,C] (+=)
                      const T* dout,            // [B,T,C]
                      const std::int32_t* inp,  // [B,T]
                      int B, int Tn, int C, int vocab_begin = 0, int vocab_end = 1 << 30) {
  const int N = B * Tn;
  if constexpr (std::is_same_v<T, Acc>) {
    // Two rows may hit the same token: the columns are split instead (for_column_blocks), and
    // each gradient row gets its rows of dout in row order.
    for_column_blocks("Encoder::backward", C, [=](int c0, int c1) {
      for (int bt = 0; bt < N; ++bt) {
        const T* d = dout + static_cast<std::int64_t>(bt) * C;
        const int tok = inp[bt];
        if (dwpe) {
          T* pe = dwpe + static_cast<std::int64_t>(bt % Tn) * C;
          for (int c = c0; c < c1; ++c) pe[c] += d[c];
        }
        if (tok < vocab_begin || tok >= vocab_end) continue;
        T* te = dwte + static_cast<std::int64_t>(tok - vocab_begin) * C;
        for (int c = c0; c < c1; ++c) te[c] += d[c];
      }
    });
  } else {
    // 16-bit storage: each gradient row's sum is accumulated in Acc and rounded once. A row of dwpe
    // (dwte) gets the rows of dout at its position (of its token) in row order, as above.
    std::vector<int> order(static_cast<std::size_t>(N));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return inp[x] < inp[y]; });
    const int* by_token = order.data();
    for_column_blocks("Encoder::backward", C, [=](int c0, int c1) {
      Acc acc[kColumns];
      const auto add_rows = [&](T* g, auto row_of, int count) {
        for (int c = c0; c < c1; ++c) acc[c - c0] = to_acc<Acc>(g[c]);
        for (int i = 0; i < count; ++i) {
          const T* d = dout + static_cast<std::int64_t>(row_of(i)) * C;
          for (int c = c0; c < c1; ++c) acc[c - c0] += to_acc<Acc>(d[c]);
        }
        for (int c = c0; c < c1; ++c) g[c] = from_acc<T>(acc[c - c0]);
      };
      if (dwpe)
        for (int t = 0; t < Tn; ++t)
          add_rows(
              dwpe + static_cast<std::int64_t>(t) * C, [=](int b) { return b * Tn + t; }, B);
      for (int i = 0; i < N;) {
        const int tok = inp[by_token[i]];
        int j = i;
        while (j < N && inp[by_token[j]] == tok) ++j;
        if (tok >= vocab_begin && tok < vocab_end)
          add_rows(
              dwte + static_cast<std::int64_t>(tok - vocab_begin) * C, [=](int r) { return by_token[i + r]; }, j - i);
        i = j;
      }
    });
  }
}

// ---------------------------------------------------------------------------------------------
// LayerNorm over the last dimension, eps 1e-5 (as GPT-2 and torch.nn.LayerNorm).

// out is stored as O: T, or a 16-bit type (the operand of the next product), rounded once, the bits
// of an output of T then cast (the same holds for every O below).
template <class T, class Acc = acc_type_t<T>, class O = T>
void layernorm_forward(O* out, Acc* mean, Acc* rstd,                  // [N,C], [N], [N]
                       const T* inp, const T* weight, const T* bias,  // [N,C], [C], [C]
                       int N, int C) {
  static_assert(std::is_floating_point_v<Acc>, "LayerNorm statistics are float or double");
  const isa::RowKernels* rk = &isa::active();
  Kokkos::parallel_for("LayerNorm::forward", Range(0, N), [=](int n) {
    const std::int64_t at = static_cast<std::int64_t>(n) * C;
    row_loop_out<T, Acc, O>(rk, &isa::RowKernels::layernorm_row, &isa::RowKernels::layernorm_row_bf16,
                            rows::layernorm_row<T, Acc, O>, out + at, mean[n], rstd[n], inp + at, weight, bias, C);
  });
}

// residual = a + b, then out = LayerNorm(residual), row by row: the sum is normalised while its row
// is in cache, where residual_forward and layernorm_forward pass over it twice. The same values as
// the two, bit for bit (the same arithmetic in the same order).
template <class T, class Acc = acc_type_t<T>, class O = T>
void residual_layernorm_forward(T* residual, O* out, Acc* mean, Acc* rstd,  // [N,C], [N,C], [N], [N]
                                const T* a, const T* b,                     // [N,C], [N,C]
                                const T* weight, const T* bias,             // [C], [C]
                                int N, int C) {
  static_assert(std::is_floating_point_v<Acc>, "LayerNorm statistics are float or double");
  const isa::RowKernels* rk = &isa::active();
  Kokkos::parallel_for("ResidualLayerNorm::forward", Range(0, N), [=](int n) {
    const std::int64_t at = static_cast<std::int64_t>(n) * C;
    row_loop_out<T, Acc, O>(rk, &isa::RowKernels::residual_layernorm_row, &isa::RowKernels::residual_layernorm_row_bf16,
                            rows::residual_layernorm_row<T, Acc, O>, residual + at, out + at, mean[n], rstd[n], a + at,
                            b + at, weight, bias, C);
  });
}

template <class T, class Acc = acc_type_t<T>>
void layernorm_backward(T* dinp, T* dweight, T* dbias,                 // [N,C] (+=), [C] (+=), [C] (+=)
                        const T* dout, const T* inp, const T* weight,  // [N,C], [N,C], [C]
                        const Acc* mean, const Acc* rstd,              // [N], [N]
                        int N, int C) {
  static_assert(std::is_floating_point_v<Acc>, "LayerNorm statistics are float or double");
  // dinp: row by row, each row's two means first; dweight, dbias: sums over rows, by column blocks.
  const isa::RowKernels* rk = &isa::active();
  Kokkos::parallel_for("LayerNorm::backward", Range(0, N), [=](int n) {
    const std::int64_t at = static_cast<std::int64_t>(n) * C;
    row_loop<T, Acc>(rk, &isa::RowKernels::layernorm_dinp_row, rows::layernorm_dinp_row<T, Acc>, dinp + at, dout + at,
                     inp + at, weight, mean[n], rstd[n], C);
  });
  for_column_blocks("LayerNorm::backward_dweight", C, [=](int c0, int c1) {
    row_loop<T, Acc>(rk, &isa::RowKernels::layernorm_param_cols, rows::layernorm_param_cols<T, Acc>, dweight, dbias,
                     dout, inp, mean, rstd, N, C, c0, c1);
  });
}

// ---------------------------------------------------------------------------------------------
// Linear layer y = x W^T + b, weights [OC, C] as torch.nn.Linear. bias may be null.

// out[n, :] += bias: the bias of a row-parallel layer is added once, after the tp reduction.
template <class T, class Acc = acc_type_t<T>>
void bias_add(T* out, const T* bias, int N, int OC) {  // [N,OC], [OC]
  Kokkos::parallel_for("Matmul::bias", Range(0, N), [=](int n) {
    T* o = out + static_cast<std::int64_t>(n) * OC;
    for (int j = 0; j < OC; ++j) o[j] = from_acc<T>(to_acc<Acc>(o[j]) + to_acc<Acc>(bias[j]));
  });
}

// dbias += sum over rows of dout: the backward of bias_add.
template <class T, class Acc = acc_type_t<T>>
void bias_backward(T* dbias, const T* dout, int N, int OC) {  // [OC] (+=), [N,OC]
  const isa::RowKernels* rk = &isa::active();
  for_column_blocks("Matmul::backward_bias", OC, [=](int c0, int c1) {
    row_loop<T, Acc>(rk, &isa::RowKernels::bias_cols, rows::bias_cols<T, Acc>, dbias, dout, N, OC, c0, c1);
  });
}

// bias_backward, and `copy` = dout stored as O (the product's 16-bit operand) in the same pass over dout.
template <class T, class Acc = acc_type_t<T>, class O = T>
void bias_backward_cast(T* dbias, O* copy, const T* dout, int N, int OC) {  // [OC] (+=), [N,OC], [N,OC]
  const isa::RowKernels* rk = &isa::active();
  for_column_blocks("Matmul::backward_bias_cast", OC, [=](int c0, int c1) {
    if constexpr (fp32_v<T, Acc> && std::is_same_v<O, bf16>)
      rk->bias_cast_cols_bf16(dbias, copy, dout, N, OC, c0, c1);
    else
      rows::bias_cast_cols<T, Acc, O>(dbias, copy, dout, N, OC, c0, c1);
  });
}

template <class T, class Acc = acc_type_t<T>>
void matmul_forward(T* out,                                        // [N,OC]
                    const T* inp, const T* weight, const T* bias,  // [N,C], [OC,C], [OC] or null
                    int N, int C, int OC) {
  gemm(false, true, N, OC, C, Acc(1), inp, C, weight, C, Acc(0), out, OC);
  if (bias) bias_add<T, Acc>(out, bias, N, OC);
}

template <class T, class Acc = acc_type_t<T>>
void matmul_backward(T* dinp, T* dweight, T* dbias,                 // [N,C] (=), [OC,C] (+=), [OC] (+=) or null
                     const T* dout, const T* inp, const T* weight,  // [N,OC], [N,C], [OC,C]
                     int N, int C, int OC) {
  gemm(false, false, N, C, OC, Acc(1), dout, OC, weight, C, Acc(0), dinp, C);  // dinp = dout W
  gemm(true, false, OC, C, N, Acc(1), dout, OC, inp, C, Acc(1), dweight, C);   // dW += dout^T x
  if (dbias) bias_backward<T, Acc>(dbias, dout, N, OC);
}

// ---------------------------------------------------------------------------------------------
// Causal multi-head self-attention on a fused qkv activation. Per (b, h) the products are
// strided BLAS calls straight into qkv (leading dimension 3C), so q, k, v are never copied.

template <class T, class Acc = acc_type_t<T>>
void attention_forward(T* out, T* att,  // [B,T,C], [B,NH,T,T] (softmax probs)
                       const T* qkv,    // [B,T,3C]
                       int B, int Tn, int C, int NH) {
  const int hs = C / NH, C3 = 3 * C;
  const Acc scale = Acc(1) / std::sqrt(static_cast<Acc>(hs));
  const isa::RowKernels* rk = &isa::active();
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < NH; ++h) {
      const T* q = qkv + static_cast<std::int64_t>(b) * Tn * C3 + h * hs;
      const T* k = q + C;
      const T* v = q + 2 * C;
      T* a = att + (static_cast<std::int64_t>(b) * NH + h) * Tn * Tn;
      gemm(false, true, Tn, Tn, hs, scale, q, C3, k, C3, Acc(0), a, Tn);  // scores = q k^T / sqrt(hs)
      Kokkos::parallel_for("Attention::softmax_forward", Range(0, Tn), [=](int t) {
        T* row = a + static_cast<std::int64_t>(t) * Tn;
        row_loop<T, Acc>(rk, &isa::RowKernels::softmax_causal_row, rows::softmax_causal_row<T, Acc>, row, t, Tn);
      });
      gemm(false, false, Tn, hs, Tn, Acc(1), a, Tn, v, C3, Acc(0), out + static_cast<std::int64_t>(b) * Tn * C + h * hs,
           C);  // out_h = att v
    }
  }
}

template <class T, class Acc = acc_type_t<T>>
void attention_backward(T* dqkv, T* datt,            // [B,T,3C] (=), [T,T] scratch
                        const T* dout,               // [B,T,C]
                        const T* qkv, const T* att,  // [B,T,3C], [B,NH,T,T]
                        int B, int Tn, int C, int NH) {
  const int hs = C / NH, C3 = 3 * C;
  const Acc scale = Acc(1) / std::sqrt(static_cast<Acc>(hs));
  const isa::RowKernels* rk = &isa::active();
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
      gemm(true, false, Tn, hs, Tn, Acc(1), a, Tn, d, C, Acc(0), dv, C3);    // dv = att^T dout
      gemm(false, true, Tn, Tn, hs, Acc(1), d, C, v, C3, Acc(0), datt, Tn);  // datt = dout v^T
      // softmax backward in place: dscores = att * (datt - sum_j att*datt), masked entries 0
      Kokkos::parallel_for("Attention::softmax_backward", Range(0, Tn), [=](int t) {
        T* dr = datt + static_cast<std::int64_t>(t) * Tn;
        const T* ar = a + static_cast<std::int64_t>(t) * Tn;
        row_loop<T, Acc>(rk, &isa::RowKernels::softmax_causal_backward_row, rows::softmax_causal_backward_row<T, Acc>,
                         dr, ar, t, Tn);
      });
      gemm(false, false, Tn, hs, Tn, scale, datt, Tn, k, C3, Acc(0), dq, C3);  // dq = ds k / sqrt(hs)
      gemm(true, false, Tn, hs, Tn, scale, datt, Tn, q, C3, Acc(0), dk, C3);   // dk = ds^T q / sqrt(hs)
    }
  }
}

// ---------------------------------------------------------------------------------------------
// GELU, tanh approximation (GPT-2).

template <class T, class Acc = acc_type_t<T>>
void gelu_forward(T* out, const T* inp, std::int64_t n) {  // [n], [n]
  const isa::RowKernels* rk = &isa::active();
  for_chunks("GELU::forward", n, [=](std::int64_t begin, std::int64_t end) {
    row_loop<T, Acc>(rk, &isa::RowKernels::gelu_span, rows::gelu_span<T, Acc>, out, inp, begin, end);
  });
}

template <class T, class Acc = acc_type_t<T>>
void gelu_backward(T* dinp, const T* inp, const T* dout, std::int64_t n) {  // [n] (=), [n], [n]
  const isa::RowKernels* rk = &isa::active();
  for_chunks("GELU::backward", n, [=](std::int64_t begin, std::int64_t end) {
    row_loop<T, Acc>(rk, &isa::RowKernels::gelu_backward_span, rows::gelu_backward_span<T, Acc>, dinp, inp, dout, begin,
                     end);
  });
}

// The MLP's fused operations (Backend::matmul_forward_gelu, gelu_bias_backward): one pass over the
// [N, OC] activation where the unfused ones take two, the same values.

// pre[n, :] += bias, out = gelu(pre), after the product wrote pre (bias may be null).
template <class T, class Acc = acc_type_t<T>, class O = T>
void bias_gelu_forward(O* out, T* pre, const T* bias, int N, int OC) {  // [N,OC], [N,OC] (+= bias), [OC]
  const isa::RowKernels* rk = &isa::active();
  Kokkos::parallel_for("MatmulGELU::bias_gelu", Range(0, N), [=](int n) {
    const std::int64_t at = static_cast<std::int64_t>(n) * OC;
    row_loop_out<T, Acc, O>(rk, &isa::RowKernels::bias_gelu_row, &isa::RowKernels::bias_gelu_row_bf16,
                            rows::bias_gelu_row<T, Acc, O>, out + at, pre + at, bias, OC);
  });
}

template <class T, class Acc = acc_type_t<T>, class O = T>
void matmul_forward_gelu(O* out, T* pre,                                // [N,OC], [N,OC]
                         const T* inp, const T* weight, const T* bias,  // [N,C], [OC,C], [OC] or null
                         int N, int C, int OC) {
  gemm(false, true, N, OC, C, Acc(1), inp, C, weight, C, Acc(0), pre, OC);
  bias_gelu_forward<T, Acc, O>(out, pre, bias, N, OC);
}

// dpre = gelu'(pre) dout, stored as O; dbias += its sums over rows as T (null: none), by column
// blocks, rows in order.
template <class T, class Acc = acc_type_t<T>, class O = T>
void gelu_bias_backward(O* dpre, T* dbias,            // [N,OC] (=), [OC] (+=) or null
                        const T* pre, const T* dout,  // [N,OC], [N,OC]
                        int N, int OC) {
  const isa::RowKernels* rk = &isa::active();
  for_column_blocks("MatmulGELU::backward", OC, [=](int c0, int c1) {
    row_loop_out<T, Acc, O>(rk, &isa::RowKernels::gelu_bias_cols, &isa::RowKernels::gelu_bias_cols_bf16,
                            rows::gelu_bias_cols<T, Acc, O>, dpre, dbias, pre, dout, N, OC, c0, c1);
  });
}

// ---------------------------------------------------------------------------------------------
// Residual add.

template <class T, class Acc = acc_type_t<T>>
void residual_forward(T* out, const T* a, const T* b, std::int64_t n) {  // [n], [n], [n]; out may be a (x += y)
  for_chunks("Residual::forward", n, [=](std::int64_t begin, std::int64_t end) {
    T* o = out;
    const T* x = a;
    const T* __restrict y = b;
    for (std::int64_t i = begin; i < end; ++i) o[i] = from_acc<T>(to_acc<Acc>(x[i]) + to_acc<Acc>(y[i]));
  });
}
// The residual's backward is the identity on both branches: callers copy the incoming gradient.

// ---------------------------------------------------------------------------------------------
// Softmax + cross-entropy, fused. losses[n] = -log softmax(logits[n])[target[n]], kept in Acc.

template <class T, class Acc = acc_type_t<T>>
void crossentropy_forward(Acc* losses, T* probs,                         // [N], [N,V]; probs may alias logits
                          const T* logits, const std::int32_t* targets,  // [N,V], [N]
                          int N, int V) {
  static_assert(std::is_floating_point_v<Acc>, "losses are float or double");
  Kokkos::parallel_for("CrossEntropy::forward", Range(0, N), [=](int n) {
    const T* l = logits + static_cast<std::int64_t>(n) * V;
    T* p = probs + static_cast<std::int64_t>(n) * V;
    const Acc target_logit = to_acc<Acc>(l[targets[n]]);  // before p overwrites l (the model's in-place head)
    if constexpr (std::is_same_v<T, Acc>) {
      // The plain loops, as before the types were split (the form the compiler vectorises best).
      const T mx = lane_max<T>(V, [&](int v) { return l[v]; });
      for (int v = 0; v < V; ++v) p[v] = exp_k(l[v] - mx);
      const T sum = lane_sum<T>(V, [&](int v) { return p[v]; });
      const T inv = T(1) / sum;
      for (int v = 0; v < V; ++v) p[v] *= inv;
      // log-sum-exp form: exact even when the target's probability underflows
      losses[n] = std::log(sum) + mx - target_logit;
    } else {  // the sum of the unrounded exponentials; each probability rounded once
      const Acc mx = lane_max<Acc>(V, [&](int v) { return to_acc<Acc>(l[v]); });
      const Acc sum = lane_sum<Acc>(V, [&](int v) { return exp_k(to_acc<Acc>(l[v]) - mx); });
      const Acc inv = Acc(1) / sum;
      for (int v = 0; v < V; ++v) p[v] = from_acc<T>(exp_k(to_acc<Acc>(l[v]) - mx) * inv);
      losses[n] = std::log(sum) + mx - target_logit;
    }
  });
}

// The classifier's forward and backward in one pass (the loss's gradient known at the forward, as in
// training): losses as crossentropy_forward, dlogits as crossentropy_backward after it, bit for bit, and
// no probability table. dlogits may alias logits (fp32: the exponentials are staged in it, as the
// forward stages them in probs) or be 16-bit (then each exponential is recomputed for its store: the
// same function of the same float, so the same bits).
template <class T, class Acc = acc_type_t<T>, class O = T>
void crossentropy_fused(Acc* losses, O* dlogits,                       // [N], [N,V]; dlogits may alias logits
                        const T* logits, const std::int32_t* targets,  // [N,V], [N]
                        nd<Acc> dloss,                                 // d(total loss)/d(loss of one row)
                        int N, int V) {
  static_assert(std::is_same_v<T, Acc>, "the fused classifier computes in its logits' type");
  Kokkos::parallel_for("CrossEntropy::fused", Range(0, N), [=](int n) {
    const T* l = logits + static_cast<std::int64_t>(n) * V;
    O* d = dlogits + static_cast<std::int64_t>(n) * V;
    const int tgt = targets[n];
    const Acc target_logit = l[tgt];  // before d overwrites l
    const T mx = lane_max<T>(V, [&](int v) { return l[v]; });
    if constexpr (std::is_same_v<O, T>) {
      for (int v = 0; v < V; ++v) d[v] = exp_k(l[v] - mx);
      const T sum = lane_sum<T>(V, [&](int v) { return d[v]; });
      const T inv = T(1) / sum;
      for (int v = 0; v < V; ++v) d[v] = math::crossentropy_dlogit(d[v] * inv, v == tgt, Acc(dloss));
      losses[n] = std::log(sum) + mx - target_logit;
    } else {
      const T sum = lane_sum<T>(V, [&](int v) { return exp_k(l[v] - mx); });
      const T inv = T(1) / sum;
      for (int v = 0; v < V; ++v)
        d[v] = from_acc<O>(math::crossentropy_dlogit(exp_k(l[v] - mx) * inv, v == tgt, Acc(dloss)));
      losses[n] = std::log(sum) + mx - target_logit;
    }
  });
}

// targets[n] - vocab_begin is the target's column here (none when it lies outside [0, V): the
// vocabulary-parallel cross-entropy, where a rank holds vocabulary entries [vocab_begin, +V)).
// dlogits stored as O: T, or a 16-bit type (the classifier product's operand, rounded once; it then
// never aliases probs).
template <class T, class Acc = acc_type_t<T>, class O = T>
void crossentropy_backward(O* dlogits,                                   // [N,V] (=); may alias probs
                           const T* probs, const std::int32_t* targets,  // [N,V], [N]
                           nd<Acc> dloss,                                // d(total loss)/d(loss of one row)
                           int N, int V, int vocab_begin = 0) {
  Kokkos::parallel_for("CrossEntropy::backward", Range(0, N), [=](int n) {
    const T* p = probs + static_cast<std::int64_t>(n) * V;
    O* d = dlogits + static_cast<std::int64_t>(n) * V;
    const int tgt = targets[n] - vocab_begin;
    for (int v = 0; v < V; ++v) d[v] = from_acc<O>(math::crossentropy_dlogit(to_acc<Acc>(p[v]), v == tgt, Acc(dloss)));
  });
}

// Vocabulary-parallel cross-entropy (Backend::crossentropy_row_max / _partial / _finish): the three
// passes around the tensor-parallel group's reductions of the row maxima, the sums of exponentials
// and the target logits; the [N, V] logits never travel.
inline void crossentropy_row_max(float* row_max,       // [N]
                                 const float* logits,  // [N,V]
                                 int N, int V) {
  Kokkos::parallel_for("CrossEntropy::row_max", Range(0, N), [=](int n) {
    const float* l = logits + static_cast<std::int64_t>(n) * V;
    row_max[n] = lane_max<float>(V, [&](int v) { return l[v]; });
  });
}
// probs null: only the sums (crossentropy_finish_grad recomputes each exponential, the same float).
inline void crossentropy_partial(float* probs, double* sum_exp, double* target_logit,  // [N,V] or null, [N], [N]
                                 const float* logits, const float* row_max,            // [N,V], [N]
                                 const std::int32_t* targets, int N, int V, int vocab_begin) {
  Kokkos::parallel_for("CrossEntropy::partial", Range(0, N), [=](int n) {
    const float* l = logits + static_cast<std::int64_t>(n) * V;
    const int t = targets[n] - vocab_begin;
    target_logit[n] = (t >= 0 && t < V) ? l[t] : 0.0;  // before p overwrites l (the model's in-place head)
    if (probs == nullptr) {
      sum_exp[n] = lane_sum<double>(V, [&](int v) { return static_cast<double>(exp_k(l[v] - row_max[n])); });
      return;
    }
    float* p = probs + static_cast<std::int64_t>(n) * V;
    for (int v = 0; v < V; ++v) p[v] = exp_k(l[v] - row_max[n]);
    sum_exp[n] = lane_sum<double>(V, [&](int v) { return static_cast<double>(p[v]); });
  });
}
inline void crossentropy_finish(float* losses, float* probs,                  // [N], [N,V]
                                const double* sum_exp, const float* row_max,  // [N], [N]
                                const double* target_logit, int N, int V) {   // [N]
  Kokkos::parallel_for("CrossEntropy::finish", Range(0, N), [=](int n) {
    const float inv = static_cast<float>(1.0 / sum_exp[n]);
    float* p = probs + static_cast<std::int64_t>(n) * V;
    for (int v = 0; v < V; ++v) p[v] *= inv;
    losses[n] = static_cast<float>(std::log(sum_exp[n]) + row_max[n] - target_logit[n]);
  });
}
// crossentropy_finish then crossentropy_backward, fused (the loss's gradient known at the forward):
// dlogits = (exp(logits - row_max) / sum_exp - [target]) * dloss, the bits of the two passes, with no
// probability table; dlogits may alias logits (fp32) or be 16-bit.
template <class O>
void crossentropy_finish_grad(float* losses, O* dlogits,                    // [N], [N,V]
                              const float* logits,                          // [N,V]
                              const double* sum_exp, const float* row_max,  // [N], [N]
                              const double* target_logit,                   // [N]
                              const std::int32_t* targets, float dloss, int N, int V, int vocab_begin) {
  Kokkos::parallel_for("CrossEntropy::finish_grad", Range(0, N), [=](int n) {
    const float inv = static_cast<float>(1.0 / sum_exp[n]);
    const float* l = logits + static_cast<std::int64_t>(n) * V;
    O* d = dlogits + static_cast<std::int64_t>(n) * V;
    const int tgt = targets[n] - vocab_begin;
    for (int v = 0; v < V; ++v)
      d[v] = from_acc<O>(math::crossentropy_dlogit(exp_k(l[v] - row_max[n]) * inv, v == tgt, dloss));
    losses[n] = static_cast<float>(std::log(sum_exp[n]) + row_max[n] - target_logit[n]);
  });
}

// ---------------------------------------------------------------------------------------------
// AdamW (torch.optim.AdamW semantics): decoupled weight decay, bias-corrected moments. The moments
// and the arithmetic are in Acc (float or double); the parameters P (fp32 master weights, or the
// storage type itself) and the gradients G may each be another type.

template <class P, class Acc, class G>
void adamw_update(P* params, Acc* m, Acc* v,       // [n] each, updated
                  const G* grads, std::int64_t n,  // [n]
                  nd<Acc> lr, nd<Acc> beta1, nd<Acc> beta2, nd<Acc> eps, nd<Acc> weight_decay,
                  std::int64_t t /* 1-based */) {
  static_assert(std::is_floating_point_v<Acc>, "AdamW moments are float or double");
  const math::AdamWStep<Acc> step{lr,
                                  beta1,
                                  beta2,
                                  eps,
                                  weight_decay,
                                  Acc(1) - std::pow(beta1, static_cast<Acc>(t)),
                                  Acc(1) - std::pow(beta2, static_cast<Acc>(t))};
  const isa::RowKernels* rk = &isa::active();
  for_chunks("AdamW::update", n, [=](std::int64_t begin, std::int64_t end) {
    if constexpr (std::is_same_v<P, float> && std::is_same_v<Acc, float> && std::is_same_v<G, float>)
      rk->adamw_span(params, m, v, grads, begin, end, step);
    else
      rows::adamw_span<P, Acc, G>(params, m, v, grads, begin, end, step);
  });
}

// y += a x (PowerSGD's residual, plugins/compression): a product rounded, then a sum.
inline void axpy(float* y, float a, const float* x, std::int64_t n) {  // [n], [n]
  for_chunks("Axpy", n, [=](std::int64_t begin, std::int64_t end) {
    float* __restrict yy = y;
    const float* __restrict xx = x;
    for (std::int64_t i = begin; i < end; ++i) yy[i] += a * xx[i];
  });
}

// ---------------------------------------------------------------------------------------------
// int8 gradient compression (Backend::int8_*; plugins/compression): x is cut into chunks of `chunk`
// elements (the last one shorter), each chunk quantised with its own step (math::int8_step), the
// chunk maxima being the largest over the ranks. One pass per chunk.

// absmax[c] = max |x| over chunk c (NaN ignored), c < chunks; absmax[chunks] = 1 if x holds a NaN
// or an inf, else 0 (an all-reduce max of the chunks + 1 values tells every rank).
inline void int8_absmax(float* absmax, const float* x, std::int64_t n, std::int64_t chunk) {  // [chunks + 1], [n]
  const std::int64_t chunks = (n + chunk - 1) / chunk;
  int bad = 0;
  Kokkos::parallel_reduce(
      "Int8::absmax", Range64(0, chunks),
      [=](std::int64_t c, int& any) {
        const std::int64_t begin = c * chunk, end = begin + chunk < n ? begin + chunk : n;
        float m = 0.0f;
        int nonfinite = 0;
        for (std::int64_t i = begin; i < end; ++i) {
          const float a = math::int8_magnitude(x[i]);
          m = a > m ? a : m;
          nonfinite |= !math::finite_k(x[i]);
        }
        absmax[c] = m;
        any = nonfinite > any ? nonfinite : any;
      },
      Kokkos::Max<int>(bad));
  absmax[chunks] = bad > 0 ? 1.0f : 0.0f;  // (no chunks: the reducer's identity, INT_MIN)
}
// q = the levels of x (math::int8_level); error (may be null) = x - q step, what error feedback keeps.
inline void int8_quantize(std::int8_t* q, float* error, const float* x,  // [n], [n], [n]
                          std::int64_t n, std::int64_t chunk, const float* absmax, int levels) {
  const std::int64_t chunks = (n + chunk - 1) / chunk;
  Kokkos::parallel_for("Int8::quantize", Range64(0, chunks), [=](std::int64_t c) {
    const float step = math::int8_step(absmax[c], levels);
    const std::int64_t begin = c * chunk, end = begin + chunk < n ? begin + chunk : n;
    for (std::int64_t i = begin; i < end; ++i) {
      const float v = math::int8_level(x[i], step, levels);
      q[i] = static_cast<std::int8_t>(v);
      if (error) error[i] = x[i] - v * step;
    }
  });
}
// x = q step; NaN everywhere when absmax[chunks] (the all-reduced flag) says a rank held a NaN or inf.
inline void int8_dequantize(float* x, const std::int8_t* q,  // [n], [n]
                            std::int64_t n, std::int64_t chunk, const float* absmax, int levels) {
  const std::int64_t chunks = (n + chunk - 1) / chunk;
  const bool poisoned = absmax[chunks] > 0.0f;
  Kokkos::parallel_for("Int8::dequantize", Range64(0, chunks), [=](std::int64_t c) {
    const float step = math::int8_step(absmax[c], levels);
    const std::int64_t begin = c * chunk, end = begin + chunk < n ? begin + chunk : n;
    for (std::int64_t i = begin; i < end; ++i)
      x[i] = poisoned ? std::numeric_limits<float>::quiet_NaN() : static_cast<float>(q[i]) * step;
  });
}

// ---------------------------------------------------------------------------------------------
// Top-k gradient compression (Backend::topk_*; plugins/compression). core/cuda/topk.cuh is the
// device's selection, which gives the same set in the same order.

// index[k], value[k]: the k elements of x with the largest |x| (ties to the lower index), in
// ascending index order. Where x holds a NaN or an inf (which have no order): index[j] = j and
// value[j] = NaN, so that every rank's sum is non-finite. 0 <= k <= n.
inline void topk_select(std::int32_t* index, float* value, const float* x, std::int64_t n, std::int64_t k) {
  if (k <= 0) return;
  bool finite = true;
  for (std::int64_t i = 0; i < n && finite; ++i) finite = math::finite_k(x[i]);
  if (!finite) {
    for (std::int64_t j = 0; j < k; ++j) {
      index[j] = static_cast<std::int32_t>(j);
      value[j] = std::numeric_limits<float>::quiet_NaN();
    }
    return;
  }
  // The k-th largest magnitude t, by radix selection: non-negative floats order as their bit
  // patterns, so one pass counts the magnitudes per top 11 bits (2048 buckets), the bucket holding
  // the k-th largest is found from the top, and only its members are selected among (a few times
  // faster than a comparison selection, whose branches a CPU cannot predict). Then one pass in index
  // order takes every element above t and, of those equal to t, the first ones until k: the same set
  // as ordering by (magnitude descending, index ascending), in ascending index order. Magnitudes
  // are compared as bits throughout, as the device does (a float comparison would differ where
  // denormals are flushed to zero).
  const auto bits = [](float v) { return math::float_bits(v) & 0x7fffffffu; };  // |v|
  constexpr int kShift = 20;
  std::vector<std::int64_t> count(std::size_t(1) << (31 - kShift), 0);
  for (std::int64_t i = 0; i < n; ++i) ++count[bits(x[i]) >> kShift];
  std::size_t bucket = count.size();
  std::int64_t above = 0;  // elements in buckets above the k-th largest's
  while (bucket-- > 0 && above + count[bucket] < k) above += count[bucket];
  std::vector<std::uint32_t> members;
  members.reserve(static_cast<std::size_t>(count[bucket]));
  for (std::int64_t i = 0; i < n; ++i)
    if ((bits(x[i]) >> kShift) == bucket) members.push_back(bits(x[i]));
  const std::int64_t r = k - above;  // the k-th largest is the r-th largest member
  std::nth_element(members.begin(), members.begin() + (r - 1), members.end(), std::greater<std::uint32_t>());
  const std::uint32_t t = members[static_cast<std::size_t>(r - 1)];
  std::int64_t ties = r;  // members equal to t that are taken, the lowest indices first
  for (std::int64_t i = 0; i < r - 1; ++i) ties -= members[static_cast<std::size_t>(i)] > t;
  for (std::int64_t i = 0, j = 0; i < n && j < k; ++i) {
    const std::uint32_t a = bits(x[i]);
    if (a > t || (a == t && ties-- > 0)) {
      index[j] = static_cast<std::int32_t>(i);
      value[j++] = x[i];
    }
  }
}
// x[index[j]] += value[j], j < k; the k indices are distinct (one rank's selection).
inline void topk_scatter_add(float* x, const std::int32_t* index, const float* value,
                             std::int64_t k) {  // [n], [k], [k]
  Kokkos::parallel_for("TopK::scatter_add", Range64(0, k), [=](std::int64_t j) { x[index[j]] += value[j]; });
}
// x[index[j]] = 0, j < k: what error feedback keeps is everything but the sent elements.
inline void topk_clear(float* x, const std::int32_t* index, std::int64_t k) {  // [n], [k]
  Kokkos::parallel_for("TopK::clear", Range64(0, k), [=](std::int64_t j) { x[index[j]] = 0.0f; });
}

// ---------------------------------------------------------------------------------------------
// Reductions and fills used by the engine.

// Sum of f(x[i]) over [0, n): partial sums per chunk in `Partial`, accumulated in double.
template <class Partial, class T, class F>
double reduce_chunks(const char* label, const T* x, std::int64_t n, F f) {
  double s = 0;
  const std::int64_t chunks = (n + kChunk - 1) / kChunk;
  Kokkos::parallel_reduce(
      label, Range64(0, chunks),
      [=](std::int64_t c, double& acc) {
        const T* __restrict in = x;
        const std::int64_t begin = c * kChunk, end = begin + kChunk < n ? begin + kChunk : n;
        const Partial part = lane_sum<Partial>(static_cast<int>(end - begin), [&](int i) { return f(in[begin + i]); });
        acc += static_cast<double>(part);
      },
      s);
  return s;
}

// Partial sums per chunk in Acc (float for float, bf16 and fp16), chunks added in double.
template <class T, class Acc = acc_type_t<T>>
double sum_squares(const T* x, std::int64_t n) {
  return reduce_chunks<Acc>("Reduce::sum_squares", x, n, [](T v) {
    const Acc a = to_acc<Acc>(v);
    return a * a;
  });
}

template <class T>
double sum(const T* x, std::int64_t n) {
  return reduce_chunks<double>("Reduce::sum", x, n, [](T v) { return to_acc<double>(v); });
}

// Whether every element is finite (no NaN, no inf).
template <class T>
bool all_finite(const T* x, std::int64_t n) {
  return reduce_chunks<double>("Reduce::all_finite", x, n,
                               [](T v) { return std::isfinite(to_acc<acc_type_t<T>>(v)) ? 0.0 : 1.0; }) == 0.0;
}

template <class T, class Acc = acc_type_t<T>>
void scale(T* x, nd<Acc> a, std::int64_t n) {
  for_chunks("Scale", n, [=](std::int64_t begin, std::int64_t end) {
    T* __restrict o = x;
    for (std::int64_t i = begin; i < end; ++i) o[i] = from_acc<T>(to_acc<Acc>(o[i]) * a);
  });
}

template <class T, class Acc = acc_type_t<T>>
void fill(T* x, nd<Acc> value, std::int64_t n) {
  const T stored = from_acc<T>(value);
  for_chunks("Fill", n, [=](std::int64_t begin, std::int64_t end) {
    T* __restrict o = x;
    for (std::int64_t i = begin; i < end; ++i) o[i] = stored;
  });
}

// dst[i] = src[i] converted between float, double, bf16 and fp16, rounded to nearest even (double
// to bf16/fp16 directly, not through a rounded float). dst and src must not overlap.
template <class D, class S>
inline D convert(S x) {
  if constexpr (std::is_same_v<D, S>)
    return x;
  else if constexpr (std::is_same_v<S, double>)
    return from_acc<D>(x);
  else
    return from_acc<D>(to_acc<float>(x));
}
template <class D, class S>
void cast(D* dst, const S* src, std::int64_t n) {
  if constexpr (std::is_same_v<D, bf16> && std::is_same_v<S, float>) {  // this CPU's copy of the loop
    const isa::RowKernels* rk = &isa::active();
    return for_chunks("Cast", n,
                      [=](std::int64_t begin, std::int64_t end) { rk->cast_bf16_span(dst, src, begin, end); });
  }
  for_chunks("Cast", n, [=](std::int64_t begin, std::int64_t end) {
    D* __restrict o = dst;
    const S* __restrict in = src;
    std::int64_t i = begin;
#if defined(__F16C__)
    // fp32 <-> fp16 with the CPU's conversion, 8 at a time: round to nearest even, inf on overflow,
    // NaN kept, the same values as to_f16 / to_float (test_backend checks them bit for bit).
    if constexpr (std::is_same_v<D, f16> && std::is_same_v<S, float>) {
      for (; i + 8 <= end; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
    } else if constexpr (std::is_same_v<D, float> && std::is_same_v<S, f16>) {
      for (; i + 8 <= end; i += 8)
        _mm256_storeu_ps(o + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
    }
#endif
    for (; i < end; ++i) o[i] = convert<D>(in[i]);
  });
}

// The same attention with bf16 products (fp32 accumulation) for a run whose matrix products are bf16:
// q, k, v, the probabilities, dout and the score gradients rounded to bf16 as the products' operands,
// as PyTorch's autocast and the device's fused kernels round them; scores, softmax and its backward,
// the saved probabilities and every output in fp32. qkv16 [B,T,3C], dout16 [B,T,C] and p16 [2,T,T]
// are the caller's scratch.
inline void attention_forward_bf16(float* out, float* att,                    // [B,T,C], [B,NH,T,T]
                                   const float* qkv, bf16* qkv16, bf16* p16,  // [B,T,3C], [B,T,3C], [T,T]
                                   int B, int Tn, int C, int NH) {
  const int hs = C / NH, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const isa::RowKernels* rk = &isa::active();
  const std::int64_t TT = static_cast<std::int64_t>(Tn) * Tn;
  cast(qkv16, qkv, static_cast<std::int64_t>(B) * Tn * C3);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < NH; ++h) {
      const bf16* q = qkv16 + static_cast<std::int64_t>(b) * Tn * C3 + h * hs;
      float* a = att + (static_cast<std::int64_t>(b) * NH + h) * TT;
      gemm::gemm_bf16(false, true, Tn, Tn, hs, scale, q, C3, q + C, C3, 0.0f, a, Tn);  // scores = q k^T / sqrt(hs)
      Kokkos::parallel_for("Attention::softmax_forward", Range(0, Tn), [=](int t) {
        float* row = a + static_cast<std::int64_t>(t) * Tn;
        row_loop<float, float>(rk, &isa::RowKernels::softmax_causal_row, rows::softmax_causal_row<float, float>, row, t,
                               Tn);
        rk->cast_bf16_span(p16 + static_cast<std::int64_t>(t) * Tn, row, 0, Tn);  // rounded while the row is in cache
      });
      gemm::gemm_bf16(false, false, Tn, hs, Tn, 1.0f, p16, Tn, q + 2 * C, C3, 0.0f,
                      out + static_cast<std::int64_t>(b) * Tn * C + h * hs, C);  // out_h = att v
    }
  }
}

inline void attention_backward_bf16(float* dqkv, float* datt,              // [B,T,3C] (=), [T,T] scratch
                                    const float* dout, const float* qkv,   // [B,T,C], [B,T,3C]
                                    const float* att,                      // [B,NH,T,T]
                                    bf16* qkv16, bf16* dout16, bf16* p16,  // [B,T,3C], [B,T,C], [2,T,T]
                                    int B, int Tn, int C, int NH) {
  const int hs = C / NH, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const isa::RowKernels* rk = &isa::active();
  const std::int64_t TT = static_cast<std::int64_t>(Tn) * Tn;
  cast(qkv16, qkv, static_cast<std::int64_t>(B) * Tn * C3);
  cast(dout16, dout, static_cast<std::int64_t>(B) * Tn * C);
  bf16* ds16 = p16 + TT;
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < NH; ++h) {
      const std::int64_t base = static_cast<std::int64_t>(b) * Tn * C3 + h * hs;
      const bf16* q = qkv16 + base;
      const bf16* k = q + C;
      const bf16* v = q + 2 * C;
      float* dq = dqkv + base;
      const float* a = att + (static_cast<std::int64_t>(b) * NH + h) * TT;
      const bf16* d = dout16 + static_cast<std::int64_t>(b) * Tn * C + h * hs;
      gemm::gemm_bf16(false, true, Tn, Tn, hs, 1.0f, d, C, v, C3, 0.0f, datt, Tn);  // datt = dout v^T
      // the softmax backward in place, each row's probabilities and score gradients rounded beside it
      Kokkos::parallel_for("Attention::softmax_backward", Range(0, Tn), [=](int t) {
        const std::int64_t at = static_cast<std::int64_t>(t) * Tn;
        row_loop<float, float>(rk, &isa::RowKernels::softmax_causal_backward_row,
                               rows::softmax_causal_backward_row<float, float>, datt + at, a + at, t, Tn);
        rk->cast_bf16_span(p16 + at, a + at, 0, Tn);
        rk->cast_bf16_span(ds16 + at, datt + at, 0, Tn);
      });
      gemm::gemm_bf16(true, false, Tn, hs, Tn, 1.0f, p16, Tn, d, C, 0.0f, dq + 2 * C, C3);  // dv = att^T dout
      gemm::gemm_bf16(false, false, Tn, hs, Tn, scale, ds16, Tn, k, C3, 0.0f, dq, C3);      // dq = ds k / sqrt(hs)
      gemm::gemm_bf16(true, false, Tn, hs, Tn, scale, ds16, Tn, q, C3, 0.0f, dq + C, C3);   // dk = ds^T q / sqrt(hs)
    }
  }
}

template <class T>
void copy(T* dst, const T* src, std::int64_t n) {
  for_chunks("Copy", n, [=](std::int64_t begin, std::int64_t end) {
    T* __restrict o = dst;
    const T* __restrict in = src;
    for (std::int64_t i = begin; i < end; ++i) o[i] = in[i];
  });
}

// ---------------------------------------------------------------------------------------------
// Llama's block (model.arch = llama): RMSNorm, rotary positions with grouped-query heads, SwiGLU.

// RMSNorm over the last dimension: out = x / sqrt(mean(x^2) + eps) * weight, out stored as O (a 16-bit
// O rounded once), rstd kept for the backward. A row's sum is lane_sum, as LayerNorm's.
template <class T, class Acc = acc_type_t<T>, class O = T>
void rmsnorm_forward(O* out, Acc* rstd,              // [N,C], [N]
                     const T* inp, const T* weight,  // [N,C], [C]
                     int N, int C, nd<Acc> eps) {
  Kokkos::parallel_for("RMSNorm::forward", Range(0, N), [=](int n) {
    const T* x = inp + static_cast<std::int64_t>(n) * C;
    O* o = out + static_cast<std::int64_t>(n) * C;
    const Acc ms = rows::lane_sum<Acc>(C,
                                       [&](int c) {
                                         const Acc xc = to_acc<Acc>(x[c]);
                                         return xc * xc;
                                       }) /
                   C;
    const Acc r = math::rmsnorm_rstd(ms, eps);
    for (int c = 0; c < C; ++c) o[c] = from_acc<O>(math::rmsnorm_out(to_acc<Acc>(x[c]), r, to_acc<Acc>(weight[c])));
    rstd[n] = r;
  });
}

// dinp += (it sits on the residual stream, as layernorm_backward's); dweight += sum over rows of
// dout * x * rstd, by column blocks (each column adds its rows in row order).
template <class T, class Acc = acc_type_t<T>>
void rmsnorm_backward(T* dinp, T* dweight,                           // [N,C] (+=), [C] (+=)
                      const T* dout, const T* inp, const T* weight,  // [N,C], [N,C], [C]
                      const Acc* rstd,                               // [N]
                      int N, int C) {
  Kokkos::parallel_for("RMSNorm::backward", Range(0, N), [=](int n) {
    const std::int64_t at = static_cast<std::int64_t>(n) * C;
    const T *d = dout + at, *x = inp + at;
    T* dx = dinp + at;
    const Acc r = rstd[n];
    const Acc dot =
        rows::lane_sum<Acc>(C, [&](int c) { return to_acc<Acc>(weight[c]) * to_acc<Acc>(d[c]) * to_acc<Acc>(x[c]); }) /
        C;
    for (int c = 0; c < C; ++c)
      dx[c] = from_acc<T>(to_acc<Acc>(dx[c]) +
                          math::rmsnorm_dinp(to_acc<Acc>(x[c]), r, to_acc<Acc>(weight[c]), to_acc<Acc>(d[c]), dot));
  });
  for_column_blocks("RMSNorm::backward_dweight", C, [=](int c0, int c1) {
    Acc acc[kColumns];
    for (int c = c0; c < c1; ++c) acc[c - c0] = to_acc<Acc>(dweight[c]);
    for (int n = 0; n < N; ++n) {
      const std::int64_t at = static_cast<std::int64_t>(n) * C;
      const Acc r = rstd[n];
      for (int c = c0; c < c1; ++c) acc[c - c0] += to_acc<Acc>(dout[at + c]) * to_acc<Acc>(inp[at + c]) * r;
    }
    for (int c = c0; c < c1; ++c) dweight[c] = from_acc<T>(acc[c - c0]);
  });
}

// GCC's vectoriser recognises a turn's (a c - b s, a s + b c) as a complex product and emits fused
// multiply-adds for it whatever -ffp-contract says: a turn then rounds once, where the device (and
// the source) round each product. Not in these kernels: they round as written.
#pragma GCC push_options
#pragma GCC optimize("no-tree-slp-vectorize", "no-tree-loop-vectorize")

// The rotary turns of a [T, hs/2] table (math::rope_cos_sin), made once a call.
template <class Acc>
std::vector<Acc> rope_table(int Tn, int hs, double theta) {
  std::vector<Acc> cs(static_cast<std::size_t>(Tn) * hs);
  for (int t = 0; t < Tn; ++t)
    for (int i = 0; i < hs / 2; ++i)
      math::rope_cos_sin(t, i, hs, theta, cs[(static_cast<std::size_t>(t) * hs / 2 + i) * 2],
                         cs[(static_cast<std::size_t>(t) * hs / 2 + i) * 2 + 1]);
  return cs;
}

// Grouped-query attention's operands: q [N, NH*hs] (this rank's NH query heads), k and v [N, KV*hs]
// (the KV kv heads it holds), rows of sequences of Tn tokens (position n % Tn). Out: qkv [N, 3*NH*hs]
// as the attention kernels take it, q and k turned by their position (rope_turn) and each query
// head's k and v copied in beside it: query head h (global head0 + h) reads kv head
// (head0 + h) / group - kv0 of those held. Every element is written.
template <class T, class Acc = acc_type_t<T>>
void rope_gqa_forward(T* qkv,                              // [N, 3*NH*hs]
                      const T* q, const T* k, const T* v,  // [N, NH*hs], [N, KV*hs], [N, KV*hs]
                      int N, int Tn, int NH, int KV, int hs, int head0, int kv0, int group, double theta) {
  const std::vector<Acc> table = rope_table<Acc>(Tn, hs, theta);
  const Acc* cs = table.data();
  const std::int64_t C = static_cast<std::int64_t>(NH) * hs, CK = static_cast<std::int64_t>(KV) * hs;
  Kokkos::parallel_for("RoPE::forward", Range(0, N), [=](int n) {
    const Acc* turn = cs + static_cast<std::int64_t>(n % Tn) * hs;
    T* o = qkv + n * 3 * C;
    for (int h = 0; h < NH; ++h) {
      const int j = (head0 + h) / group - kv0;
      const T* qh = q + n * C + static_cast<std::int64_t>(h) * hs;
      const T* kh = k + n * CK + static_cast<std::int64_t>(j) * hs;
      const T* vh = v + n * CK + static_cast<std::int64_t>(j) * hs;
      T *oq = o + static_cast<std::int64_t>(h) * hs, *ok = oq + C, *ov = oq + 2 * C;
      for (int i = 0; i < hs / 2; ++i) {
        Acc a = to_acc<Acc>(qh[2 * i]), b = to_acc<Acc>(qh[2 * i + 1]);
        math::rope_turn(a, b, turn[2 * i], turn[2 * i + 1]);
        oq[2 * i] = from_acc<T>(a);
        oq[2 * i + 1] = from_acc<T>(b);
        a = to_acc<Acc>(kh[2 * i]);
        b = to_acc<Acc>(kh[2 * i + 1]);
        math::rope_turn(a, b, turn[2 * i], turn[2 * i + 1]);
        ok[2 * i] = from_acc<T>(a);
        ok[2 * i + 1] = from_acc<T>(b);
      }
      for (int e = 0; e < hs; ++e) ov[e] = vh[e];
    }
  });
}

// The backward: dq turned back; dk and dv of kv head j the sums, in query-head order, of the
// gradients of the query heads that read it (turned back for k); zero for a held kv head none reads.
template <class T, class Acc = acc_type_t<T>>
void rope_gqa_backward(T* dq, T* dk, T* dv,  // [N, NH*hs], [N, KV*hs], [N, KV*hs] (=)
                       const T* dqkv,        // [N, 3*NH*hs]
                       int N, int Tn, int NH, int KV, int hs, int head0, int kv0, int group, double theta) {
  const std::vector<Acc> table = rope_table<Acc>(Tn, hs, theta);
  const Acc* cs = table.data();
  const std::int64_t C = static_cast<std::int64_t>(NH) * hs, CK = static_cast<std::int64_t>(KV) * hs;
  Kokkos::parallel_for("RoPE::backward", Range(0, N), [=](int n) {
    const Acc* turn = cs + static_cast<std::int64_t>(n % Tn) * hs;
    const T* g = dqkv + n * 3 * C;
    for (std::int64_t e = 0; e < CK; ++e) dk[n * CK + e] = dv[n * CK + e] = from_acc<T>(Acc(0));
    for (int h = 0; h < NH; ++h) {
      const int j = (head0 + h) / group - kv0;
      const T *gq = g + static_cast<std::int64_t>(h) * hs, *gk = gq + C, *gv = gq + 2 * C;
      T* qh = dq + n * C + static_cast<std::int64_t>(h) * hs;
      T* kh = dk + n * CK + static_cast<std::int64_t>(j) * hs;
      T* vh = dv + n * CK + static_cast<std::int64_t>(j) * hs;
      for (int i = 0; i < hs / 2; ++i) {
        Acc a = to_acc<Acc>(gq[2 * i]), b = to_acc<Acc>(gq[2 * i + 1]);
        math::rope_turn_back(a, b, turn[2 * i], turn[2 * i + 1]);
        qh[2 * i] = from_acc<T>(a);
        qh[2 * i + 1] = from_acc<T>(b);
        a = to_acc<Acc>(gk[2 * i]);
        b = to_acc<Acc>(gk[2 * i + 1]);
        math::rope_turn_back(a, b, turn[2 * i], turn[2 * i + 1]);
        kh[2 * i] = from_acc<T>(to_acc<Acc>(kh[2 * i]) + a);
        kh[2 * i + 1] = from_acc<T>(to_acc<Acc>(kh[2 * i + 1]) + b);
      }
      for (int e = 0; e < hs; ++e) vh[e] = from_acc<T>(to_acc<Acc>(vh[e]) + to_acc<Acc>(gv[e]));
    }
  });
}

#pragma GCC pop_options

// out = silu(gate) * up, stored as O (the down product's operand: 16-bit under mixed precision).
template <class T, class Acc = acc_type_t<T>, class O = T>
void swiglu_forward(O* out, const T* gate, const T* up, std::int64_t n) {  // [n], [n], [n]
  for_chunks("SwiGLU::forward", n, [=](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i)
      out[i] = from_acc<O>(math::swiglu_forward(to_acc<Acc>(gate[i]), to_acc<Acc>(up[i])));
  });
}

// dgate, dup (=), stored as O (the gate and up products' dout: 16-bit under mixed precision).
template <class T, class Acc = acc_type_t<T>, class O = T>
void swiglu_backward(O* dgate, O* dup, const T* dout, const T* gate, const T* up, std::int64_t n) {
  for_chunks("SwiGLU::backward", n, [=](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      const Acc g = to_acc<Acc>(gate[i]), u = to_acc<Acc>(up[i]), d = to_acc<Acc>(dout[i]);
      dgate[i] = from_acc<O>(math::swiglu_dgate(g, u, d));
      dup[i] = from_acc<O>(math::swiglu_dup(g, d));
    }
  });
}

// Mixture of experts (Backend::rows_gather and its pair): an expert's rows of a token table and back,
// one row a task; rows distinct within a call, so no two tasks write one element.
template <class T>
void rows_gather(T* out, const T* x, const std::int32_t* rows, const float* scale, int n, int C) {
  Kokkos::parallel_for("Experts::gather", Range(0, n), [=](int i) {
    const T* src = x + static_cast<std::int64_t>(rows[i]) * C;
    T* dst = out + static_cast<std::int64_t>(i) * C;
    if constexpr (std::is_same_v<T, float>) {
      if (scale) {
        const float g = scale[i];
        for (int c = 0; c < C; ++c) dst[c] = g * src[c];
        return;
      }
    }
    for (int c = 0; c < C; ++c) dst[c] = src[c];
  });
}

inline void rows_scatter_add(float* out, const float* y, const std::int32_t* rows, const float* scale, int n, int C) {
  Kokkos::parallel_for("Experts::scatter_add", Range(0, n), [=](int i) {
    float* dst = out + static_cast<std::int64_t>(rows[i]) * C;
    const float* src = y + static_cast<std::int64_t>(i) * C;
    const float g = scale ? scale[i] : 1.0f;
    for (int c = 0; c < C; ++c) dst[c] = dst[c] + g * src[c];
  });
}

inline void rows_dot(float* out, const float* x, const std::int32_t* rows, const float* y, int n, int C) {
  Kokkos::parallel_for("Experts::dot", Range(0, n), [=](int i) {
    const float* a = x + static_cast<std::int64_t>(rows[i]) * C;
    const float* b = y + static_cast<std::int64_t>(i) * C;
    out[i] = lane_sum<float>(C, [&](int c) { return a[c] * b[c]; });
  });
}

}  // namespace loom::kernels
