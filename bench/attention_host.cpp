// attention_host: the host back end's attention, fused (model.attention = flash: the twin of the CUDA
// kernels, core/backend/flash_attention_host.hpp) against unfused (core/backend/kernels.hpp: the [T,T] probabilities
// through BLAS or oneDNN products), in the same run, on one thread, through the Backend interface as
// the model calls it. Per shape: forward and backward milliseconds of each, the ratio flash/unfused,
// and the bytes each saves for backward (unfused: B*NH*T*T probabilities; flash: B*NH*T lse).
//   build/bench/attention_host [B T C NH]...   (default: the long_context deck's and GPT-2's head size)
// Prints a table, then one JSON line per shape. Never a test: the machine is shared and noisy.
#include <unistd.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/backend/blas_core.hpp"

namespace {

double ms_best(int reps, const std::function<void()>& f) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  loom::select_openblas_core(argv);
  Kokkos::ScopeGuard kokkos(argc, argv);
  struct Shape {
    int B, T, C, NH;
  };
  std::vector<Shape> shapes;
  for (int i = 1; i + 3 < argc; i += 4)
    shapes.push_back({std::atoi(argv[i]), std::atoi(argv[i + 1]), std::atoi(argv[i + 2]), std::atoi(argv[i + 3])});
  if (shapes.empty()) shapes = {{8, 512, 128, 2}, {4, 1024, 128, 2}, {16, 128, 128, 4}};
  auto be = loom::make_host_backend(1);
  std::printf("%-22s %12s %12s %12s %12s %8s %8s %14s %14s\n", "shape B,T,C,NH", "unfused fwd", "flash fwd",
              "unfused bwd", "flash bwd", "fwd x", "bwd x", "saved unfused", "saved flash");
  for (const Shape& s : shapes) {
    const std::size_t n3 = std::size_t(s.B) * s.T * 3 * s.C, n = std::size_t(s.B) * s.T * s.C;
    const std::size_t att = std::size_t(s.B) * s.NH * s.T * s.T, rows = std::size_t(s.B) * s.NH * s.T;
    std::mt19937 gen(1);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<float> qkv(n3), dout(n), out(n), dqkv(n3), probs(att), datt(std::size_t(s.T) * s.T), lse(rows),
        dsum(rows);
    for (float& x : qkv) x = dist(gen);
    for (float& x : dout) x = dist(gen);
    const int reps = 3;
    const auto r = [](std::vector<float>& v) { return loom::BufferRef(v.data(), std::int64_t(v.size())); };
    const double uf = ms_best(reps, [&] { be->attention_forward(r(out), r(probs), r(qkv), s.B, s.T, s.C, s.NH); });
    const double ub = ms_best(
        reps, [&] { be->attention_backward(r(dqkv), r(datt), r(dout), r(qkv), r(probs), s.B, s.T, s.C, s.NH); });
    const double ff = ms_best(reps, [&] { be->attention_forward_flash(r(out), r(lse), r(qkv), s.B, s.T, s.C, s.NH); });
    const double fb = ms_best(reps, [&] {
      be->attention_backward_flash(r(dqkv), r(dsum), r(dout), r(out), r(qkv), r(lse), s.B, s.T, s.C, s.NH);
    });
    char name[64];
    std::snprintf(name, sizeof name, "%d,%d,%d,%d (hs %d)", s.B, s.T, s.C, s.NH, s.C / s.NH);
    std::printf("%-22s %10.2f ms %10.2f ms %10.2f ms %10.2f ms %7.2fx %7.2fx %11.1f MiB %11.3f MiB\n", name, uf, ff, ub,
                fb, ff / uf, fb / ub, att * 4.0 / (1 << 20), rows * 4.0 / (1 << 20));
    std::printf(
        "{\"B\": %d, \"T\": %d, \"C\": %d, \"NH\": %d, \"unfused_fwd_ms\": %.3f, \"flash_fwd_ms\": %.3f, "
        "\"unfused_bwd_ms\": %.3f, \"flash_bwd_ms\": %.3f, \"flash_over_unfused_fwd\": %.3f, "
        "\"flash_over_unfused_bwd\": %.3f, \"saved_bytes_unfused\": %zu, \"saved_bytes_flash\": %zu}\n",
        s.B, s.T, s.C, s.NH, uf, ff, ub, fb, ff / uf, fb / ub, att * 4, rows * 4);
  }
  return 0;
}
