// Launch wrappers of ring attention's kernels (core/cuda/ring_attention.cuh), declared with their
// contracts in core/cuda/kernels.cuh.
#include "core/cuda/ring_attention.cuh"

#include <stdexcept>

#include "core/cuda/kernels.cuh"
#include "core/cuda/on_stream.cuh"

namespace loom::cuda {

void attention_ring_forward(float* out, float* lse, const float* qkv, const float* kv, int B, int T, int C, int NH,
                            int q_begin, int kv_rows, bool causal, bool bf16, cudaStream_t stream) {
  ring::attention_ring_forward(OnStream{stream}, out, lse, qkv, kv, B, T, C, NH, q_begin, kv_rows, causal, bf16);
}

void attention_ring_backward(float* dqkv, float* dkv, float* dsum, const float* dout, BufferRef out, const float* qkv,
                             const float* kv, const float* lse, int B, int T, int C, int NH, int q_begin, int kv_rows,
                             bool causal, bool bf16, cudaStream_t stream) {
  const OnStream launch{stream};
  if (out.type == DType::f32)
    ring::attention_ring_backward(launch, dqkv, dkv, dsum, dout, out.as<float>(), qkv, kv, lse, B, T, C, NH, q_begin,
                                  kv_rows, causal, bf16);
  else if (out.type == DType::bf16)
    ring::attention_ring_backward(launch, dqkv, dkv, dsum, dout, reinterpret_cast<const __nv_bfloat16*>(out.data), qkv,
                                  kv, lse, B, T, C, NH, q_begin, kv_rows, causal, bf16);
  else if (out.type == DType::f16)
    ring::attention_ring_backward(launch, dqkv, dkv, dsum, dout, reinterpret_cast<const __half*>(out.data), qkv, kv,
                                  lse, B, T, C, NH, q_begin, kv_rows, causal, bf16);
  else
    throw std::invalid_argument("attention_ring_backward: the saved output must be fp32, bf16 or fp16");
}

void copy_rows(float* dst, const float* src, std::int64_t rows, std::int64_t cols, std::int64_t dst_ld,
               std::int64_t src_ld, cudaStream_t stream) {
  ring::copy_rows(OnStream{stream}, dst, src, rows, cols, dst_ld, src_ld);
}

}  // namespace loom::cuda
