// sgemm_peak: single-thread GEMM throughput of loom's matrix-product implementations (core/backend/gemm.hpp)
// on the GEMM shapes of the bench model (bench/bench.deck: B*T = 1024 rows, d_model 256,
// 4*d_model 1024, 3*d_model 768, seq_len 128, head size 32): OpenBLAS cblas_sgemm (run.gemm = blas),
// oneDNN fp32 and oneDNN bf16 operands with fp32 accumulation (run.gemm = onednn), each through
// loom::gemm as loom calls it (oneDNN's primitive cache included). Prints a table, GFLOP/s per
// implementation and its ratio to OpenBLAS, then one JSON line:
//   {"sgemm_gflops": OpenBLAS best over shapes, "onednn_f32_gflops": ..., "onednn_bf16_gflops": ...,
//    "onednn_f32_over_openblas": ..., "onednn_bf16_over_openblas": ..., "shapes": [per shape]}
// bench/gpt_vs_torch.py divides loom's achieved GFLOP/s by sgemm_gflops (OpenBLAS's peak).
//
// OpenBLAS built with DYNAMIC_ARCH picks its kernels from the CPU model id, and on virtual machines
// often falls back to Prescott (SSE3) on an AVX-512 CPU. loom then re-executes itself with
// OPENBLAS_CORETYPE set (core/backend/blas_core.cpp); this program applies that very code, so that the
// peak is measured with the kernels loom uses, and reports the core in the JSON line.
#include <cblas.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/backend/blas_core.hpp"  // the same kernel-set rule as loom itself
#include "core/base/dtype.hpp"
#include "core/backend/gemm.hpp"

extern "C" char* openblas_get_corename(void) __attribute__((weak));

namespace {

namespace gemm = loom::gemm;

struct Shape {
  int m, n, k;
  bool ta, tb;        // op(A) = A^T (A stored [k,m]); op(B) = B^T (B stored [n,k]), like y = x W^T
  int lda, ldb, ldc;  // 0: dense
  const char* what;
};

enum class Kind { openblas, onednn_f32, onednn_bf16 };
const char* kind_name(Kind k) {
  return k == Kind::openblas ? "OpenBLAS" : k == Kind::onednn_f32 ? "oneDNN fp32" : "oneDNN bf16";
}

struct Operands {
  std::vector<float> a, b, c;
  std::vector<loom::bf16> ab, bb;
};

double time_once(Kind kind, const Shape& s, Operands& o) {
  const int lda = s.lda ? s.lda : (s.ta ? s.m : s.k), ldb = s.ldb ? s.ldb : (s.tb ? s.k : s.n),
            ldc = s.ldc ? s.ldc : s.n;
  const auto t0 = std::chrono::steady_clock::now();
  if (kind == Kind::onednn_bf16)
    gemm::gemm_bf16(s.ta, s.tb, s.m, s.n, s.k, 1.0f, o.ab.data(), lda, o.bb.data(), ldb, 0.0f, o.c.data(), ldc);
  else
    gemm::sgemm(s.ta, s.tb, s.m, s.n, s.k, 1.0f, o.a.data(), lda, o.b.data(), ldb, 0.0f, o.c.data(), ldc);
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(t1 - t0).count();
}

// Best mean time per call over `reps` repetitions of ~20 ms each, after a warm-up call.
double gflops(Kind kind, const Shape& s, Operands& o, int reps) {
  gemm::set_impl(kind == Kind::openblas ? gemm::Impl::blas : gemm::Impl::onednn);
  const double t = time_once(kind, s, o);
  const int calls = std::max(1, static_cast<int>(0.02 / std::max(t, 1e-6)));
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    double sum = 0.0;
    for (int i = 0; i < calls; ++i) sum += time_once(kind, s, o);
    best = std::min(best, sum / calls);
  }
  return 2.0 * s.m * s.n * s.k / best / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  loom::select_openblas_core(argv);
  const std::string core = openblas_get_corename ? openblas_get_corename() : "unknown";
  gemm::set_threads(1);  // openblas_set_num_threads(1) and, for oneDNN's OpenMP runtime, omp_set_num_threads(1)
  int reps = 10;
  if (argc > 1) reps = std::max(1, std::atoi(argv[1]));

  // The bench model's products (N = B*T = 1024, C = 256, hs = 32, T = 128): forward x W^T, the
  // backward's dinp = dout W and dW += dout^T x, and one attention head's q k^T and att v, strided
  // in the qkv activation as loom runs them.
  const std::vector<Shape> shapes = {
      {1024, 768, 256, false, true, 0, 0, 0, "qkv fwd"},   {1024, 768, 256, false, false, 0, 0, 0, "NN"},
      {1024, 1024, 256, false, true, 0, 0, 0, "fc fwd"},   {1024, 1024, 256, false, false, 0, 0, 0, "NN"},
      {1024, 256, 1024, false, true, 0, 0, 0, "proj fwd"}, {1024, 256, 1024, false, false, 0, 0, 0, "fc dinp"},
      {1024, 256, 768, false, false, 0, 0, 0, "qkv dinp"}, {768, 256, 1024, true, false, 0, 0, 0, "qkv dW"},
      {1024, 256, 1024, true, false, 0, 0, 0, "fc dW"},    {512, 512, 512, false, true, 0, 0, 0, "MFU probe"},
      {512, 512, 512, false, false, 0, 0, 0, "NN"},        {128, 128, 32, false, true, 768, 768, 0, "att q k^T"},
      {128, 32, 128, false, false, 0, 768, 256, "att v"},
  };
  const Kind kinds[] = {Kind::openblas, Kind::onednn_f32, Kind::onednn_bf16};
  const int nkinds = gemm::have_onednn() ? 3 : 1;

  std::printf("single-thread GFLOP/s (best of %d), OpenBLAS core %s; ratio to OpenBLAS in brackets\n", reps,
              core.c_str());
  std::printf("%-11s %5s %5s %5s %3s %10s %18s %18s\n", "product", "m", "n", "k", "op", "OpenBLAS", "oneDNN fp32",
              "oneDNN bf16");
  double peak[3] = {0, 0, 0};
  std::string rows;
  for (const Shape& s : shapes) {
    const int lda = s.lda ? s.lda : (s.ta ? s.m : s.k), ldb = s.ldb ? s.ldb : (s.tb ? s.k : s.n),
              ldc = s.ldc ? s.ldc : s.n;
    Operands o;
    o.a.resize(static_cast<size_t>(lda) * (s.ta ? s.k : s.m));
    o.b.resize(static_cast<size_t>(ldb) * (s.tb ? s.n : s.k));
    o.c.resize(static_cast<size_t>(ldc) * s.m);
    for (size_t i = 0; i < o.a.size(); ++i) o.a[i] = static_cast<float>((i * 7919u) % 1000u) * 1e-3f - 0.5f;
    for (size_t i = 0; i < o.b.size(); ++i) o.b[i] = static_cast<float>((i * 104729u) % 1000u) * 1e-3f - 0.5f;
    for (float x : o.a) o.ab.push_back(loom::to_bf16(x));
    for (float x : o.b) o.bb.push_back(loom::to_bf16(x));
    double g[3] = {0, 0, 0};
    for (int k = 0; k < nkinds; ++k) {
      g[k] = gflops(kinds[k], s, o, reps);
      peak[k] = std::max(peak[k], g[k]);
    }
    const std::string op = std::string(s.ta ? "T" : "N") + (s.tb ? "T" : "N");
    char cell[2][64] = {"-", "-"};
    for (int k = 1; k < nkinds; ++k) std::snprintf(cell[k - 1], sizeof cell[0], "%.1f (%.2fx)", g[k], g[k] / g[0]);
    std::printf("%-11s %5d %5d %5d %3s %10.1f %18s %18s\n", s.what, s.m, s.n, s.k, op.c_str(), g[0], cell[0], cell[1]);
    char buf[384];
    std::snprintf(buf, sizeof buf,
                  "%s{\"m\": %d, \"n\": %d, \"k\": %d, \"op\": \"%s\", \"lda\": %d, \"ldb\": %d, \"ldc\": %d, "
                  "\"openblas_gflops\": %.3f, \"onednn_f32_gflops\": %.3f, \"onednn_bf16_gflops\": %.3f}",
                  rows.empty() ? "" : ", ", s.m, s.n, s.k, op.c_str(), lda, ldb, ldc, g[0], g[1], g[2]);
    rows += buf;
  }
  std::printf("best over shapes:");
  for (int k = 0; k < nkinds; ++k) {
    std::printf(" %s %.1f GFLOP/s", kind_name(kinds[k]), peak[k]);
    if (k > 0) std::printf(" (%.2fx)", peak[k] / peak[0]);
  }
  std::printf("\n");
  if (nkinds > 1) {
    gemm::set_impl(gemm::Impl::onednn);
    std::printf("kernels: %s\n", gemm::describe().c_str());
  }
  std::printf(
      "{\"sgemm_gflops\": %.3f, \"onednn_f32_gflops\": %.3f, \"onednn_bf16_gflops\": %.3f, "
      "\"onednn_f32_over_openblas\": %.3f, \"onednn_bf16_over_openblas\": %.3f, \"core\": \"%s\", "
      "\"threads\": \"gemm::set_threads(1)\", \"reps\": %d, \"shapes\": [%s]}\n",
      peak[0], peak[1], peak[2], peak[1] / peak[0], peak[2] / peak[0], core.c_str(), reps, rows.c_str());
  return 0;
}
