// attention_gpu: the CUDA back end's fused attention alone, forward + backward, as the model calls it
// under bf16 (out saved in bf16): loom's flash kernels (model.attention = flash) and cuDNN's
// (model.attention = cudnn), per shape, in one run on one GPU. bench/attention_gpu.py runs it beside
// PyTorch's scaled_dot_product_attention and prints the ratios.
//   build/bench/attention_gpu [--iters N] [B T NH hs]...   (default: GPT-2 124M's and head size 128's)
// One JSON line per shape and kernel: milliseconds per forward + backward (median of N timed
// iterations after 3 warm-ups, each synchronised), and TFLOP/s counted as `loom plan` counts attention
// (12 B T^2 C per forward + backward: the whole T x T, of which the causal kernels compute half). A
// kernel the device refuses prints its reason instead. Never a test: a benchmark.
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/backend/backend_select.hpp"

namespace {
std::string quoted(const std::string& s) {
  std::string q = "\"";
  for (char c : s) q += c == '"' || c == '\\' ? std::string("\\") + c : std::string(1, c);
  return q + "\"";
}
}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int status = 0;
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    int iters = 20;
    struct Shape {
      int B, T, NH, hs;
    };
    std::vector<Shape> shapes;
    for (int i = 1; i < argc; ++i) {
      if (std::string(argv[i]) == "--iters" && i + 1 < argc) {
        iters = std::max(1, std::atoi(argv[++i]));
      } else if (i + 3 < argc) {
        shapes.push_back({std::atoi(argv[i]), std::atoi(argv[i + 1]), std::atoi(argv[i + 2]), std::atoi(argv[i + 3])});
        i += 3;
      }
    }
    if (shapes.empty()) shapes = {{16, 1024, 12, 64}, {4, 4096, 12, 64}, {16, 1024, 6, 128}, {4, 4096, 6, 128}};
    loom::BackendChoice choice;
    std::unique_ptr<loom::Backend> be;
    try {
      be = loom::make_backend("cuda", 1, "false", false, MPI_COMM_WORLD, &choice);
    } catch (const std::exception& e) {
      std::printf("{\"error\": %s}\n", quoted(e.what()).c_str());
      MPI_Finalize();
      return 2;
    }
    std::fprintf(stderr, "attention_gpu: %s\n", be->description().c_str());
    for (const Shape& s : shapes) {
      const int C = s.NH * s.hs;
      const std::int64_t n = std::int64_t(s.B) * s.T * C, rows = std::int64_t(s.B) * s.NH * s.T;
      std::mt19937 gen(1);
      std::normal_distribution<float> dist(0.0f, 1.0f);
      std::vector<float> host(static_cast<std::size_t>(3 * n));
      for (float& x : host) x = dist(gen);
      auto qkv = be->allocate("bench.qkv", loom::DType::f32, 3 * n, loom::Mem::workspace);
      auto dout = be->allocate("bench.dout", loom::DType::f32, n, loom::Mem::workspace);
      auto out = be->allocate("bench.out", loom::DType::bf16, n, loom::Mem::workspace);
      auto lse = be->allocate("bench.lse", loom::DType::f32, rows, loom::Mem::workspace);
      auto dsum = be->allocate("bench.dsum", loom::DType::f32, rows, loom::Mem::workspace);
      auto dqkv = be->allocate("bench.dqkv", loom::DType::f32, 3 * n, loom::Mem::workspace);
      be->copy_from_host(qkv.ref(), host.data());
      be->copy_from_host(dout.ref(), host.data());
      const double flops = 12.0 * s.B * double(s.T) * s.T * C;
      for (const std::string kernel : {"flash", "cudnn"}) {
        const bool cudnn = kernel == "cudnn";
        const std::string why = cudnn ? be->cudnn_attention_refusal(s.T, s.hs) : be->flash_attention_refusal(s.hs);
        std::printf("{\"B\": %d, \"T\": %d, \"heads\": %d, \"head_size\": %d, \"kernel\": \"%s\"", s.B, s.T, s.NH, s.hs,
                    kernel.c_str());
        if (!why.empty()) {
          std::printf(", \"refused\": %s}\n", quoted(why).c_str());
          std::fflush(stdout);
          continue;
        }
        auto once = [&] {
          if (cudnn) {
            be->attention_forward_cudnn(out.ref(), lse.ref(), qkv.ref(), s.B, s.T, C, s.NH);
            be->attention_backward_cudnn(dqkv.ref(), dsum.ref(), dout.ref(), out.ref(), qkv.ref(), lse.ref(), s.B, s.T,
                                         C, s.NH);
          } else {
            be->attention_forward_flash(out.ref(), lse.ref(), qkv.ref(), s.B, s.T, C, s.NH);
            be->attention_backward_flash(dqkv.ref(), dsum.ref(), dout.ref(), out.ref(), qkv.ref(), lse.ref(), s.B, s.T,
                                         C, s.NH);
          }
          be->synchronize();
        };
        try {
          for (int w = 0; w < 3; ++w) once();
          std::vector<double> ms;
          for (int i = 0; i < iters; ++i) {
            const auto t0 = std::chrono::steady_clock::now();
            once();
            ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
          }
          std::sort(ms.begin(), ms.end());
          const double med = ms[ms.size() / 2];
          std::printf(", \"ms\": %.4f, \"tflops\": %.2f, \"iters\": %d}\n", med, flops / (med * 1e-3) / 1e12, iters);
        } catch (const std::exception& e) {
          std::printf(", \"error\": %s}\n", quoted(e.what()).c_str());
          status = 1;
        }
        std::fflush(stdout);
      }
    }
  }
  MPI_Finalize();
  return status;
}
