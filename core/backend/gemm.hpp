#pragma once
// The host back end's matrix products: oneDNN matmul primitives (fp32, and bf16 operands with fp32
// accumulation), OpenBLAS as the fallback. core/backend/kernels.hpp's float gemm and the host back end's
// typed matmul call these; fp64 stays on cblas_dgemm.
//
// Conventions of every product: row-major C[M,N] = alpha * op(A) op(B) + beta * C, op(A) is [M,K]
// (A stored [K,M] when ta), op(B) is [K,N] (B stored [N,K] when tb); lda, ldb, ldc are the row
// strides of A, B, C as stored. With beta == 0 the old contents of C are never read (C may hold
// NaN). M, N or K may be 0 (K == 0: C = beta * C).
//
// oneDNN: one cpu engine and one stream for the process; a matmul primitive per (types, transposes,
// M, N, K, lda, ldb, ldc, alpha, beta), created on first use and cached. Transposes and leading
// dimensions are the memory descriptors' strides (no copies), alpha an output scale, beta a sum
// post-op (none when beta == 0). The Debian build of oneDNN uses the OpenMP runtime, so the thread
// count it runs with is omp_get_max_threads() of the calling thread; set_threads sets it (and
// OpenBLAS's) from make_host_backend(threads).
#include <string>
#include <vector>

#include "core/base/dtype.hpp"

namespace loom::gemm {

enum class Impl { automatic, onednn, blas };

// "auto" | "onednn" | "blas"; anything else throws std::invalid_argument naming the valid values.
Impl parse_impl(const std::string& s);
const char* impl_name(Impl i);  // "auto", "onednn", "blas"
// Whether this build has oneDNN (the CMake option LOOM_ONEDNN).
bool have_onednn();
// The process-wide choice (the driver sets it from run.gemm). Impl::onednn in a build without
// oneDNN throws std::invalid_argument.
void set_impl(Impl);
// The effective one: automatic -> onednn when built with oneDNN, else blas.
Impl impl();
// The threads of both libraries: openblas_set_num_threads and omp_set_num_threads (the calling
// thread's OpenMP ICV, which oneDNN's OpenMP runtime reads at each execution). threads() is what
// oneDNN would use now (omp_get_max_threads), 0 without oneDNN.
void set_threads(int n);
int threads();
// The effective implementation in words, with the kernels oneDNN picked for the shapes used so far:
// "oneDNN 2.6.3 (OpenMP, 1 thread; fp32 gemm:jit, bf16 gemm:jit)", "OpenBLAS 0.3.21 ... (1 thread)".
std::string describe();
// The distinct kernels used so far, each prefixed with its operand type: "fp32 gemm:jit",
// "bf16 gemm:jit", "fp32 cblas_sgemm", "bf16 cblas_sgemm on fp32 copies".
std::vector<std::string> impls_used();

void sgemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb,
           float beta, float* C, int ldc);
// bf16 operands, fp32 accumulation and fp32 C; same conventions. With blas: operands converted to
// fp32 copies, one sgemm (correct, not fast).
void gemm_bf16(bool ta, bool tb, int M, int N, int K, float alpha, const bf16* A, int lda, const bf16* B, int ldb,
               float beta, float* C, int ldc);

}  // namespace loom::gemm
