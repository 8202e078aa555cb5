// sgemm_peak: single-thread fp32 GEMM throughput of the BLAS loom links, on the GEMM shapes of the
// bench model (bench/bench.deck: B*T = 1024 rows, d_model 256, 4*d_model 1024, 3*d_model 768).
// Prints one JSON line: {"sgemm_gflops": best over shapes, "shapes": [per shape and layout]}.
// bench/gpt_vs_torch.py divides loom's achieved GFLOP/s by sgemm_gflops.
//
// OpenBLAS built with DYNAMIC_ARCH picks its kernels from the CPU model id, and on virtual machines
// often falls back to Prescott (SSE3) on an AVX-512 CPU. loom then re-executes itself with
// OPENBLAS_CORETYPE set (core/blas_core.cpp); this program applies that very code, so that the
// peak is measured with the kernels loom uses, and reports the core in the JSON line.
#include <cblas.h>

#include "core/blas_core.hpp"  // the same kernel-set rule as loom itself
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

extern "C" char* openblas_get_corename(void) __attribute__((weak));

namespace {

struct Shape {
  int m, n, k;
  bool trans_b;  // false: C = A B (B is [k,n]); true: C = A B^T (B is [n,k]), like y = x W^T
};

double time_once(const Shape& s, const std::vector<float>& a, const std::vector<float>& b,
                 std::vector<float>& c) {
  const auto t0 = std::chrono::steady_clock::now();
  cblas_sgemm(CblasRowMajor, CblasNoTrans, s.trans_b ? CblasTrans : CblasNoTrans, s.m, s.n, s.k,
              1.0f, a.data(), s.k, b.data(), s.trans_b ? s.k : s.n, 0.0f, c.data(), s.n);
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double>(t1 - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  loom::select_openblas_core(argv);
  const std::string core = openblas_get_corename ? openblas_get_corename() : "unknown";
#ifdef OPENBLAS_VERSION
  openblas_set_num_threads(1);
  const char* threads_note = "openblas_set_num_threads(1)";
#else
  const char* threads_note = "not OpenBLAS: threads follow OMP_NUM_THREADS/OPENBLAS_NUM_THREADS";
#endif
  int reps = 10;
  if (argc > 1) reps = std::max(1, std::atoi(argv[1]));

  const std::vector<Shape> shapes = {
      {1024, 768, 256, true},  {1024, 768, 256, false},  {1024, 1024, 256, true},
      {1024, 1024, 256, false}, {1024, 256, 1024, true}, {1024, 256, 1024, false},
      {512, 512, 512, true},   {512, 512, 512, false},
  };

  double peak = 0.0;
  std::string rows;
  for (const Shape& s : shapes) {
    std::vector<float> a(static_cast<size_t>(s.m) * s.k), b(static_cast<size_t>(s.k) * s.n),
        c(static_cast<size_t>(s.m) * s.n);
    for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>((i * 7919u) % 1000u) * 1e-3f - 0.5f;
    for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>((i * 104729u) % 1000u) * 1e-3f - 0.5f;
    const double flops = 2.0 * s.m * s.n * s.k;
    // Warm up (page-in, OpenBLAS buffers), then run enough calls per repetition for ~20 ms.
    double t = time_once(s, a, b, c);
    const int calls = std::max(1, static_cast<int>(0.02 / std::max(t, 1e-6)));
    double best = 1e30;
    for (int r = 0; r < reps; ++r) {
      double sum = 0.0;
      for (int i = 0; i < calls; ++i) sum += time_once(s, a, b, c);
      best = std::min(best, sum / calls);
    }
    const double gflops = flops / best / 1e9;
    peak = std::max(peak, gflops);
    char buf[256];
    std::snprintf(buf, sizeof buf, "%s{\"m\": %d, \"n\": %d, \"k\": %d, \"b\": \"%s\", \"gflops\": %.3f}",
                  rows.empty() ? "" : ", ", s.m, s.n, s.k, s.trans_b ? "T" : "N", gflops);
    rows += buf;
  }
  std::printf("{\"sgemm_gflops\": %.3f, \"core\": \"%s\", \"threads\": \"%s\", \"reps\": %d, \"shapes\": [%s]}\n",
              peak, core.c_str(), threads_note, reps, rows.c_str());
  return 0;
}
