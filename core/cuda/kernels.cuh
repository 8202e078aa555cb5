#pragma once
// The CUDA twins of the host layer kernels (core/backend/kernels.hpp, the semantic reference: shapes,
// accumulation rules, the tensor-parallel vocabulary range, the causal mask). The per-element
// arithmetic comes from core/backend/kernel_math.hpp, compiled for host and device alike, so both back ends
// compute the same function of each element; only how rows and columns are reduced differs.
//
// As in core/backend/kernels.hpp (and llm.c's train_gpt2.cu): each layer's _forward is followed by its
// _backward, outputs first, then inputs; gradients carry a `d` prefix.
//
// Shape letters: B batch, T sequence length, C channels, NH heads, N = B*T rows, V vocabulary,
// OC output channels.
//
// Accumulation rules (as the host): parameter gradients (dwte, dwpe, dweight, dbias) are
// accumulated (+=); layernorm_backward accumulates into dinp (the residual stream); every other
// output is overwritten.
//
// Every pointer is a device pointer. Every function launches on `stream` and returns without
// synchronising; none allocates. A failed launch throws std::runtime_error naming the kernel.
// Determinism: no floating-point sum here uses atomics (top-k's selection counts integers with them,
// which any order sums alike); every sum is reduced in a fixed order that depends only on the shapes
// (never on the device), so the same inputs give the same bits on every run.
//
// This header is plain C++ (g++ can include it with the CUDA include directory on its path). The
// kernels themselves are in core/cuda/layer_kernels.cuh, core/cuda/flash_attention.cuh,
// core/cuda/ring_attention.cuh, core/cuda/expert_rows.cuh and core/cuda/topk.cuh, which a CPU unit test
// also runs through the CUDA emulator (core/cuda/emu/).
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda/launch_geometry.hpp"
#include "core/base/dtype.hpp"

namespace loom::cuda {

// ---------------------------------------------------------------------------------------------
// Token + position embedding. With tensor parallelism the token table is split by vocabulary: this
// rank holds rows [vocab_begin, vocab_end) and contributes zeros for other tokens; the position
// embedding is added by one rank only (add_pos).

void encoder_forward(float* out,               // [B,T,C]
                     const std::int32_t* inp,  // [B,T]
                     const float* wte,         // [V_local,C], V_local = vocab_end - vocab_begin
                     const float* wpe,         // [T,C] (read only if add_pos)
                     int B, int T, int C, int vocab_begin, int vocab_end, bool add_pos, cudaStream_t stream);

// dwpe[t] += sum_b dout[b,t]; dwte[tok - vocab_begin] += dout[b,t] for the rows holding a token of
// this rank. Deterministic, no atomics: each gradient row gets its rows of dout added in row order,
// the host's order, so fp32 results equal the host's bit for bit.
void encoder_backward(float* dwte,              // [V_local,C] (+=)
                      float* dwpe,              // [T,C] (+=)
                      const float* dout,        // [B,T,C]
                      const std::int32_t* inp,  // [B,T]
                      int B, int T, int C, int vocab_begin, int vocab_end, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// LayerNorm over the last dimension, eps 1e-5. One warp per row; two-pass mean and (biased)
// variance in float. The output is stored as out_type: fp32, or bf16 or fp16 (the next product's
// operand under mixed precision), rounded once: the bits of an fp32 output then cast.

void layernorm_forward(void* out,            // [N,C] of out_type
                       DType out_type,       //
                       float* mean,          // [N]
                       float* rstd,          // [N]
                       const float* inp,     // [N,C]
                       const float* weight,  // [C]
                       const float* bias,    // [C]
                       int N, int C, cudaStream_t stream);

// residual = a + b, then out = LayerNorm(residual): residual_forward then layernorm_forward, bit for
// bit, in one kernel.
void residual_layernorm_forward(float* residual,      // [N,C]
                                void* out,            // [N,C] of out_type
                                DType out_type,       //
                                float* mean,          // [N]
                                float* rstd,          // [N]
                                const float* a,       // [N,C]
                                const float* b,       // [N,C]
                                const float* weight,  // [C]
                                const float* bias,    // [C]
                                int N, int C, cudaStream_t stream);

void layernorm_backward(float* dinp,          // [N,C] (+=)
                        float* dweight,       // [C] (+=)
                        float* dbias,         // [C] (+=)
                        const float* dout,    // [N,C]
                        const float* inp,     // [N,C]
                        const float* weight,  // [C]
                        const float* mean,    // [N]
                        const float* rstd,    // [N]
                        int N, int C,
                        float* scratch,  // [scratch_floats] the parameters' partial sums, 2 C floats at least
                        std::int64_t scratch_floats, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Linear-layer bias (the matrix product itself is a cuBLAS call in the back end).

// out[n,j] += bias[j]
void bias_add(float* out,         // [N,OC]
              const float* bias,  // [OC]
              int N, int OC, cudaStream_t stream);

// dbias[j] += sum_n dout[n,j]: coalesced column sums in two passes, fixed order (the rows' chunks
// depend on the shape and scratch_floats only; a caller passes the same scratch size every time).
void bias_backward(float* dbias,       // [OC] (+=)
                   const float* dout,  // [N,OC]
                   int N, int OC,
                   float* scratch,  // [scratch_floats] partial sums, OC floats at least
                   std::int64_t scratch_floats, cudaStream_t stream);

// bias_backward, and copy = dout stored as copy_type (fp32, bf16 or fp16: the product's operand,
// rounded once) in the same pass over dout.
void bias_backward_cast(float* dbias,       // [OC] (+=)
                        void* copy,         // [N,OC] of copy_type
                        DType copy_type,    //
                        const float* dout,  // [N,OC]
                        int N, int OC,
                        float* scratch,  // [scratch_floats] partial sums, OC floats at least
                        std::int64_t scratch_floats, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Causal softmax of attention scores, in place. Row r (rows = B*NH*T) is query position t = r % T:
// entries j <= t become the softmax over j <= t, entries j > t become 0. One warp per row.

void softmax_causal_forward(float* att,  // [rows,T]: scaled scores in, probabilities out
                            int rows, int T, cudaStream_t stream);

// datt[j] = att[j] * (datt[j] - sum_{k<=t} att[k] datt[k]) for j <= t, 0 for j > t; in place.
void softmax_causal_backward(float* datt,       // [rows,T]: d probabilities in, d scores out
                             const float* att,  // [rows,T]
                             int rows, int T, cudaStream_t stream);

// Fused causal attention (flash-style; core/cuda/flash_attention.cuh): the scores are made tile by
// tile in shared memory, never in device memory; forward saves lse[b,h,t], the log of row t's
// softmax denominator (its max included), and backward recomputes the probabilities from it. q, k,
// v, the probabilities, dout and the score gradients are bf16 operands of tensor-core products
// with fp32 accumulation; softmax, lse and every output are fp32. Head sizes 16, 32, 64, 128, where
// flash_attention_shared_bytes(hs) fits the device's opt-in shared memory per block.
std::size_t flash_attention_shared_bytes(int hs);  // the most any of the kernels takes; 0: unsupported
bool flash_attention_supported(int hs, std::size_t max_shared_bytes);
// The compute capability (major * 10 + minor) the fused kernels this device runs were compiled for:
// below 80 (CMAKE_CUDA_ARCHITECTURES without 80 or newer) their tensor-core products trap.
int flash_attention_built_arch();

// out: fp32, or bf16 or fp16 (the output projection's operand under mixed precision), rounded once.
void attention_forward_flash(BufferRef out,     // [B,T,C]
                             float* lse,        // [B,NH,T]
                             const float* qkv,  // [B,T,3C]
                             int B, int T, int C, int NH, cudaStream_t stream);

// dqkv is overwritten; dsum [B,NH,T] is scratch (sum over a head's columns of dout * out); out is
// the forward's output as saved (fp32, or bf16 or fp16 under mixed precision).
void attention_backward_flash(float* dqkv,        // [B,T,3C] (=)
                              float* dsum,        // [B,NH,T] scratch
                              const float* dout,  // [B,T,C]
                              BufferRef out,      // [B,T,C]
                              const float* qkv,   // [B,T,3C]
                              const float* lse,   // [B,NH,T]
                              int B, int T, int C, int NH, cudaStream_t stream);

// Ring attention (context parallelism; core/cuda/ring_attention.cuh, the twin of
// core/backend/ring_attention_host.hpp): Backend::attention_ring_forward merges the attention of queries
// [q_begin, T) to the block's keys and values [0, kv_rows) (causal: key j hidden from query t < j) into
// the running out and lse (a row not yet reached holds lse = -1e30); attention_ring_backward, given the
// final out and lse, adds the block's gradients into dqkv's q columns (rows [q_begin, T)) and dkv's rows
// [0, kv_rows). bf16: the products' operands rounded to bf16 first. One warp per row, no atomics; any
// head size. Throws std::invalid_argument unless C % NH == 0, 0 <= q_begin <= T, 0 <= kv_rows <= T.
void attention_ring_forward(float* out,        // [B,T,C] (merged)
                            float* lse,        // [B,NH,T] (merged)
                            const float* qkv,  // [B,T,3C]
                            const float* kv,   // [B,T,2C]: k, then v
                            int B, int T, int C, int NH, int q_begin, int kv_rows, bool causal, bool bf16,
                            cudaStream_t stream);
void attention_ring_backward(float* dqkv,        // [B,T,3C] q columns (+=)
                             float* dkv,         // [B,T,2C] (+=)
                             float* dsum,        // [B,NH,T] scratch
                             const float* dout,  // [B,T,C]
                             BufferRef out,      // [B,T,C] fp32, bf16 or fp16
                             const float* qkv,   // [B,T,3C]
                             const float* kv,    // [B,T,2C]
                             const float* lse,   // [B,NH,T]
                             int B, int T, int C, int NH, int q_begin, int kv_rows, bool causal, bool bf16,
                             cudaStream_t stream);
// dst[r * dst_ld + c] = src[r * src_ld + c] for r < rows, c < cols (fp32).
void copy_rows(float* dst, const float* src, std::int64_t rows, std::int64_t cols, std::int64_t dst_ld,
               std::int64_t src_ld, cudaStream_t stream);

// Mixture of experts (core/cuda/expert_rows.cuh, the twins of the host's rows_* kernels in
// core/backend/kernels.hpp): an expert's rows of a token table and back. rows [n] names the token row of
// each of the expert's rows, distinct within a call (so no two threads write one element: no atomics);
// scale [n] is each row's gate, nullptr for none. Each gives the host's bits: gather and scatter_add one
// thread an element; rows_dot half a warp a row, summed in lane_sum's order. Throws std::invalid_argument
// for a negative n or C, and (rows_gather) for a scale with rows other than fp32, or a type other than
// fp32, fp64, bf16 or fp16.
void rows_gather(void* out,                 // [n,C] of type (=)
                 const void* x,             // [.., C] of type
                 DType type,                // out's and x's
                 const std::int32_t* rows,  // [n]
                 const float* scale,        // [n] or nullptr (then any type; with it fp32)
                 int n, int C, cudaStream_t stream);
void rows_scatter_add(float* out,                // [.., C] rows[i] (+= scale[i] * y[i])
                      const float* y,            // [n,C]
                      const std::int32_t* rows,  // [n]
                      const float* scale,        // [n] or nullptr (1)
                      int n, int C, cudaStream_t stream);
void rows_dot(float* out,                // [n] (=)
              const float* x,            // [.., C]
              const std::int32_t* rows,  // [n]
              const float* y,            // [n,C]
              int n, int C, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// GELU (tanh approximation) and the residual add, elementwise.

// out stored as out_type (fp32, bf16 or fp16; rounded once).
void gelu_forward(void* out,         // [n] of out_type
                  DType out_type,    //
                  const float* inp,  // [n]
                  std::int64_t n, cudaStream_t stream);

void gelu_backward(float* dinp,        // [n] (=)
                   const float* inp,   // [n]
                   const float* dout,  // [n]
                   std::int64_t n, cudaStream_t stream);

// dpre = gelu'(pre) dout, stored as dpre_type (fp32, bf16 or fp16: the next product's operand);
// dbias[j] += sum_n dpre[n,j] over the fp32 values (dbias may be null): one pass, fixed order.
void gelu_bias_backward(void* dpre,         // [N,OC] (=) of dpre_type
                        DType dpre_type,    //
                        float* dbias,       // [OC] (+=) or null
                        const float* pre,   // [N,OC]
                        const float* dout,  // [N,OC]
                        int N, int OC,
                        float* scratch,  // [scratch_floats] partial sums, OC floats at least (as bias_backward)
                        std::int64_t scratch_floats, cudaStream_t stream);

// out = a + b (out may alias a or b)
void residual_forward(float* out,      // [n]
                      const float* a,  // [n]
                      const float* b,  // [n]
                      std::int64_t n, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Llama's block (core/backend/backend.hpp says what each computes). out, dgate and dup stored as their
// type (fp32, bf16 or fp16; rounded once).

void rmsnorm_forward(void* out, DType out_type, float* rstd, const float* inp, const float* weight, int N, int C,
                     float eps, cudaStream_t stream);
// scratch: column sums' partials, C floats at least.
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int N, int C, float* scratch, std::int64_t scratch_floats,
                      cudaStream_t stream);
void rope_gqa_forward(float* qkv, const float* q, const float* k, const float* v, int N, int T, int NH, int KV, int hs,
                      int head0, int kv0, int group, float theta, cudaStream_t stream);
void rope_gqa_backward(float* dq, float* dk, float* dv, const float* dqkv, int N, int T, int NH, int KV, int hs,
                       int head0, int kv0, int group, float theta, cudaStream_t stream);
void swiglu_forward(void* out, DType out_type, const float* gate, const float* up, std::int64_t n, cudaStream_t stream);
void swiglu_backward(void* dgate, void* dup, DType type, const float* dout, const float* gate, const float* up,
                     std::int64_t n, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Softmax + cross-entropy, fused. One block per row.

// losses[n] = log(sum) + max - logits[n, target] (log-sum-exp form), probs = softmax(logits).
void crossentropy_forward(float* losses,                // [N]
                          float* probs,                 // [N,V]
                          const float* logits,          // [N,V]
                          const std::int32_t* targets,  // [N]
                          int N, int V, cudaStream_t stream);

// The two above in one kernel (the loss's gradient known at the forward): losses, and dlogits =
// (softmax(logits) - onehot(target)) * dloss stored as dlogits_type (fp32, which may alias logits; or
// bf16/fp16), the bits of crossentropy_forward then crossentropy_backward, with no probability table.
void crossentropy_fused(float* losses,                // [N]
                        void* dlogits,                // [N,V] of dlogits_type
                        DType dlogits_type,           //
                        const float* logits,          // [N,V]
                        const std::int32_t* targets,  // [N]
                        float dloss, int N, int V, cudaStream_t stream);

// dlogits = (probs - onehot(target)) * dloss, stored as dlogits_type (fp32, which may alias probs; or
// bf16/fp16, the classifier product's operand, rounded once).
void crossentropy_backward(void* dlogits,                // [N,V] (=) of dlogits_type
                           DType dlogits_type,           //
                           const float* probs,           // [N,V]
                           const std::int32_t* targets,  // [N]
                           float dloss,                  // d(total loss) / d(loss of one row)
                           int N, int V,
                           int vocab_begin,  // targets[n] - vocab_begin is the column here
                           cudaStream_t stream);

// Vocabulary-parallel cross-entropy (Backend::crossentropy_row_max / _partial / _finish): this rank
// holds vocabulary entries [vocab_begin, vocab_begin + V). One block per row.
void crossentropy_row_max(float* row_max,       // [N]
                          const float* logits,  // [N,V]
                          int N, int V, cudaStream_t stream);
void crossentropy_partial(float* probs,                 // [N,V] exp(logits - row_max), or null: only the sums
                          double* sum_exp,              // [N]
                          double* target_logit,         // [N] 0 where the target is another rank's
                          const float* logits,          // [N,V]
                          const float* row_max,         // [N]
                          const std::int32_t* targets,  // [N]
                          int N, int V, int vocab_begin, cudaStream_t stream);
void crossentropy_finish(float* losses,               // [N]
                         float* probs,                // [N,V] (=) divided by sum_exp
                         const double* sum_exp,       // [N]
                         const float* row_max,        // [N]
                         const double* target_logit,  // [N]
                         int N, int V, cudaStream_t stream);
// crossentropy_finish then crossentropy_backward, in one pass from the logits (after a _partial
// that may have skipped its probs): dlogits of dlogits_type (fp32 may alias logits).
void crossentropy_finish_grad(float* losses,                // [N]
                              void* dlogits,                // [N,V] of dlogits_type
                              DType dlogits_type,           //
                              const float* logits,          // [N,V]
                              const double* sum_exp,        // [N]
                              const float* row_max,         // [N]
                              const double* target_logit,   // [N]
                              const std::int32_t* targets,  // [N]
                              float dloss, int N, int V, int vocab_begin, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// AdamW (torch.optim.AdamW): t is the 1-based step; the bias corrections are computed on the host
// in float as core/backend/kernels.hpp does.

void adamw_update(float* params,       // [n] (updated)
                  float* m,            // [n] (updated)
                  float* v,            // [n] (updated)
                  const float* grads,  // [n]
                  std::int64_t n, float lr, float beta1, float beta2, float eps, float weight_decay, std::int64_t t,
                  cudaStream_t stream);

// AdamW over `count` slices in few launches (32 slices each): slice k is params[k], m[k], v[k],
// grads[k] of n[k] elements (device pointers; the arrays are the host's) with weight decay wd[k];
// the same bits as adamw_update per slice.
void adamw_update_slices(float* const* params, float* const* m, float* const* v, const float* const* grads,
                         const std::int64_t* n, const float* wd, int count, float lr, float beta1, float beta2,
                         float eps, std::int64_t t, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Typed operations on fp32, fp64, bf16 and fp16 buffers (16-bit types stored as their bits). Any
// other DType throws std::invalid_argument naming the operation and the type.

// dst[i] = src[i] converted, rounded to nearest even (fp64 to bf16/fp16 directly, through a float
// rounded to odd); NaN stays NaN. Same type and same pointer: nothing to do. dst and src must not
// otherwise overlap.
void cast(void* dst,  // [n] of dst_type
          DType dst_type,
          const void* src,  // [n] of src_type
          DType src_type, std::int64_t n, cudaStream_t stream);

// x *= a in the compute type (double for fp64, float otherwise).
void scale(void* x,  // [n] of type
           DType type, double a, std::int64_t n, cudaStream_t stream);

// x = value, converted to the compute type first, then stored.
void fill(void* x,  // [n] of type
          DType type, double value, std::int64_t n, cudaStream_t stream);

// Deterministic reductions into *out (a device double, overwritten): each block's threads
// accumulate their grid-stride elements in double and reduce them in a fixed tree into
// scratch[block]; one block then adds the partials in a fixed order. The partition depends only
// on n, so the same input gives the same bits on every run and every device. n == 0 gives 0.
std::int64_t reduce_scratch_count(std::int64_t n);  // how many doubles `scratch` must hold (>= 1)

void sum(double* out,    // [1]
         const void* x,  // [n] of type
         DType type, std::int64_t n,
         double* scratch,  // [reduce_scratch_count(n)]
         cudaStream_t stream);

// Backend::sq_norm_check's two reductions over `count` tensors of one type at once, as `sum` above
// reduces (each tensor keeps its own partition): sq[t] the sum of squares of x[t], bad[t] its number
// of NaN and inf elements; two launches per 64 tensors.
std::int64_t norm_check_scratch_count(const std::int64_t* n, int count);  // doubles `scratch` must hold
void norm_check(double* sq,                                               // [count]
                double* bad,                                              // [count]
                const void* const* x,                                     // [count] device pointers to [n[t]] of type
                const std::int64_t* n,                                    // [count] (host)
                int count, DType type,
                double* scratch,  // [norm_check_scratch_count(n, count)]
                cudaStream_t stream);

// y += a x: core/backend/kernels.hpp's axpy (Backend::axpy), bit for bit.
void axpy(float* y,  // [n]
          float a,
          const float* x,  // [n]
          std::int64_t n, cudaStream_t stream);

// int8 gradient compression: core/backend/kernels.hpp's int8_absmax, _quantize and _dequantize (Backend::int8_*),
// bit for bit. int8_absmax writes [chunks + 1] floats, the last the finiteness flag, through a
// count of the non-finite values into *nonfinite (a device double; scratch as sum's).
void int8_absmax(float* absmax,   // [chunks + 1]
                 const float* x,  // [n]
                 std::int64_t n, std::int64_t chunk,
                 double* nonfinite,  // [1]
                 double* scratch,    // [reduce_scratch_count(n)]
                 cudaStream_t stream);
void int8_quantize(std::int8_t* q,  // [n]
                   float* error,    // [n] or null
                   const float* x,  // [n]
                   std::int64_t n, std::int64_t chunk,
                   const float* absmax,  // [chunks + 1]
                   int levels, cudaStream_t stream);
void int8_dequantize(float* x,              // [n]
                     const std::int8_t* q,  // [n]
                     std::int64_t n, std::int64_t chunk,
                     const float* absmax,  // [chunks + 1]
                     int levels, cudaStream_t stream);

// top-k gradient compression: core/backend/kernels.hpp's topk_select, _scatter_add and _clear
// (Backend::topk_*), the same set in the same order (core/cuda/topk.cuh: an exact radix selection
// whose only atomics are integer counts in shared memory). 0 <= k <= n < 2^31.
std::int64_t topk_scratch_count(std::int64_t n);  // uint32s of topk_select's scratch for n elements
void topk_select(std::int32_t* index,             // [k]
                 float* value,                    // [k]
                 const float* x,                  // [n]
                 std::int64_t n, std::int64_t k,
                 std::uint32_t* scratch,  // [topk_scratch_count(n)]
                 cudaStream_t stream);
void topk_scatter_add(float* x,                   // [n] (+=)
                      const std::int32_t* index,  // [k] distinct
                      const float* value,         // [k]
                      std::int64_t k, cudaStream_t stream);
void topk_clear(float* x,                   // [n]
                const std::int32_t* index,  // [k]
                std::int64_t k, cudaStream_t stream);

}  // namespace loom::cuda
