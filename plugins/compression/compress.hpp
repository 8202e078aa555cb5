#pragma once
// The arithmetic of gradient compression (plugins/compression/), free of communication so that unit
// tests can hold each method to its bounds: int8 quantisation with per-chunk steps, top-k selection,
// and PowerSGD's orthogonalisation. Buffers are host fp32 unless named otherwise.
#include <cstdint>
#include <vector>

namespace loom::compress {

// --- int8 -------------------------------------------------------------------------------------------
// A bucket of n elements is cut into chunks of `chunk` elements (the last one shorter). Every rank
// quantises its chunk c with the same step s_c = A_c / L, A_c the largest |x| of chunk c over all
// ranks (an all-reduce max) and L = floor(127 / N) levels for N ranks, so |q| <= L and the sum of N
// ranks' values stays within int8 (|sum| <= N L <= 127): the int8 all-reduce (or reduce-scatter)
// adds them exactly, never saturating. The price is resolution: L levels each side instead of 127.
std::int64_t chunk_count(std::int64_t n, std::int64_t chunk);
int int8_levels(int ranks);  // floor(127 / ranks); 0 when int8 cannot hold the sum of that many ranks
// The chunk maxima, quantising and scaling back run on the back end, where the gradients are:
// BackendFace::int8_absmax, _quantize, _dequantize (core/backend/kernels.hpp on the host, core/cuda/kernels.cu on a
// GPU; per element math::int8_level).

// --- top-k ------------------------------------------------------------------------------------------
// The selection (the k largest |x|, ties to the lower index) and the scatters of the received pairs
// run on the back end: BackendFace::topk_select, _scatter_add, _clear (core/backend/kernels.hpp on the host,
// core/cuda/topk.cuh on a GPU).
// k = max(1, ceil(ratio n)), at most n.
std::int64_t top_k_count(std::int64_t n, double ratio);

// --- PowerSGD ---------------------------------------------------------------------------------------
// Makes the r columns of the row-major n x r matrix p orthonormal, in place (modified Gram-Schmidt in
// double; a column whose norm falls below eps after projection is divided by eps, as PyTorch's hook
// does, so a rank-deficient P stays finite).
void orthogonalize(float* p, int n, int r, double eps = 1e-8);
// Whether PowerSGD compresses an n x m matrix at rank r: the uncompressed size over the factors' size,
// n m / ((n + m) r), is at least min_rate (PyTorch's min_compression_rate).
bool worth_compressing(std::int64_t n, std::int64_t m, int r, double min_rate);

}  // namespace loom::compress
