// Launch wrappers of the fused attention kernels (core/cuda/flash_attention.cuh), declared with
// their contracts in core/cuda/kernels.cuh.
#include "core/cuda/flash_attention.cuh"

#include <cmath>
#include <stdexcept>
#include <string>

#include "core/cuda/kernels.cuh"
#include "core/cuda/on_stream.cuh"

namespace loom::cuda {
namespace {

// (sequence, head) on x, tiles of 64 rows on y: x takes 2^31 - 1 blocks, y 65535 (T up to 4 million).
dim3 tile_grid(int B, int T, int NH) {
  const long long heads = static_cast<long long>(B) * NH,
                  tiles = (static_cast<long long>(T) + flash::kRows - 1) / flash::kRows;
  if (tiles > 65535)
    throw std::invalid_argument("fused attention: T = " + std::to_string(T) +
                                " makes more than 65535 tiles of 64 rows");
  return dim3(static_cast<unsigned>(heads), static_cast<unsigned>(tiles));
}

template <int HS, class OutT>
void forward(OutT* out, float* lse, const float* qkv, int B, int T, int C, int NH, cudaStream_t stream) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  OnStream{stream}("attention_forward_kernel", tile_grid(B, T, NH), flash::kThreads, flash::forward_smem_bytes<HS>(),
                   flash::attention_forward_kernel<HS, OutT>, out, lse, qkv, T, C, NH, scale);
}

template <class OutT>
void forward_typed(OutT* out, float* lse, const float* qkv, int B, int T, int C, int NH, cudaStream_t stream) {
  switch (C / NH) {
    case 16:
      return forward<16>(out, lse, qkv, B, T, C, NH, stream);
    case 32:
      return forward<32>(out, lse, qkv, B, T, C, NH, stream);
    case 64:
      return forward<64>(out, lse, qkv, B, T, C, NH, stream);
    case 128:
      return forward<128>(out, lse, qkv, B, T, C, NH, stream);
    default:
      throw std::invalid_argument("fused attention: head size " + std::to_string(C / NH) + " is not 16, 32, 64 or 128");
  }
}

template <int HS>
void backward(float* dqkv, const float* dsum, const float* dout, const float* qkv, const float* lse, int B, int T,
              int C, int NH, cudaStream_t stream) {
  const std::size_t bytes = flash::backward_smem_bytes<HS>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  const dim3 grid = tile_grid(B, T, NH);
  const OnStream launch{stream};
  launch("attention_backward_kv_kernel", grid, flash::kThreads, bytes, flash::attention_backward_kv_kernel<HS>, dqkv,
         dout, qkv, lse, dsum, T, C, NH, scale);
  launch("attention_backward_q_kernel", grid, flash::kThreads, bytes, flash::attention_backward_q_kernel<HS>, dqkv,
         dout, qkv, lse, dsum, T, C, NH, scale);
}

template <class OutT>
void dsum_rows(float* dsum, const float* dout, const OutT* out, int B, int T, int C, int NH, cudaStream_t stream) {
  const LaunchGeometry g = rows_per_warp_geometry(static_cast<std::int64_t>(B) * NH * T);
  OnStream{stream}("attention_backward_dsum_kernel", g.blocks, g.threads, 0,
                   flash::attention_backward_dsum_kernel<OutT>, dsum, dout, out, B, T, C, NH, C / NH);
}

}  // namespace

template <int HS>
std::size_t largest_smem_bytes() {
  const std::size_t f = flash::forward_smem_bytes<HS>(), b = flash::backward_smem_bytes<HS>();
  return f > b ? f : b;
}

std::size_t flash_attention_shared_bytes(int hs) {
  switch (hs) {
    case 16:
      return largest_smem_bytes<16>();
    case 32:
      return largest_smem_bytes<32>();
    case 64:
      return largest_smem_bytes<64>();
    case 128:
      return largest_smem_bytes<128>();
    default:
      return 0;
  }
}

int flash_attention_built_arch() {
  cudaFuncAttributes a{};
  check_call(cudaFuncGetAttributes(&a, flash::attention_forward_kernel<64>),
             "cudaFuncGetAttributes(attention_forward_kernel)");
  return a.binaryVersion;  // of the code this device runs: its SASS, or the PTX it was JIT-compiled from
}

bool flash_attention_supported(int hs, std::size_t max_shared_bytes) {
  return flash::head_size_supported(hs) && flash_attention_shared_bytes(hs) <= max_shared_bytes;
}

void attention_forward_flash(BufferRef out, float* lse, const float* qkv, int B, int T, int C, int NH,
                             cudaStream_t stream) {
  if (B <= 0 || T <= 0 || NH <= 0) return;  // nothing to attend to (an empty grid would fail to launch)
  if (out.type == DType::f32)
    forward_typed(out.as<float>(), lse, qkv, B, T, C, NH, stream);
  else if (out.type == DType::bf16)
    forward_typed(reinterpret_cast<__nv_bfloat16*>(out.data), lse, qkv, B, T, C, NH, stream);
  else if (out.type == DType::f16)
    forward_typed(reinterpret_cast<__half*>(out.data), lse, qkv, B, T, C, NH, stream);
  else
    throw std::invalid_argument("fused attention forward: the output must be fp32, bf16 or fp16");
}

void attention_backward_flash(float* dqkv, float* dsum, const float* dout, BufferRef out, const float* qkv,
                              const float* lse, int B, int T, int C, int NH, cudaStream_t stream) {
  if (B <= 0 || T <= 0 || NH <= 0) return;
  if (out.type == DType::f32)
    dsum_rows(dsum, dout, out.as<float>(), B, T, C, NH, stream);
  else if (out.type == DType::bf16)
    dsum_rows(dsum, dout, reinterpret_cast<const __nv_bfloat16*>(out.data), B, T, C, NH, stream);
  else if (out.type == DType::f16)
    dsum_rows(dsum, dout, reinterpret_cast<const __half*>(out.data), B, T, C, NH, stream);
  else
    throw std::invalid_argument("fused attention backward: the saved output must be fp32, bf16 or fp16");
  switch (C / NH) {
    case 16:
      return backward<16>(dqkv, dsum, dout, qkv, lse, B, T, C, NH, stream);
    case 32:
      return backward<32>(dqkv, dsum, dout, qkv, lse, B, T, C, NH, stream);
    case 64:
      return backward<64>(dqkv, dsum, dout, qkv, lse, B, T, C, NH, stream);
    case 128:
      return backward<128>(dqkv, dsum, dout, qkv, lse, B, T, C, NH, stream);
    default:
      throw std::invalid_argument("fused attention: head size " + std::to_string(C / NH) + " is not 16, 32, 64 or 128");
  }
}

}  // namespace loom::cuda
