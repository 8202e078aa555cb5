// The host back end: Kokkos kernels on the default host execution space, matrix products through
// core/gemm (oneDNN or CBLAS, run.gemm).
#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "core/backend.hpp"
#include "core/gemm.hpp"
#include "core/kernels.hpp"

extern "C" char* openblas_get_config(void) __attribute__((weak));

namespace loom {
namespace {

namespace k = kernels;

[[noreturn]] void refuse(const std::string& what) { throw std::invalid_argument(what); }

void require_host(const BufferRef& b, const char* op, const char* name) {
  if (b.space != MemSpace::host)
    refuse(std::string(op) + ": " + name + " is in " + mem_space_name(b.space) +
           " memory; the host back end takes host buffers");
}

// Calls f with a value of the C++ element type of a floating-point DType.
template <class F>
void with_float_type(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::f32: f(float{}); return;
    case DType::f64: f(double{}); return;
    case DType::bf16: f(bf16{}); return;
    case DType::f16: f(f16{}); return;
    default: refuse(std::string(op) + ": element type " + dtype_name(t) + " is not fp32, fp64, bf16 or fp16");
  }
}

class HostBackend final : public Backend {
 public:
  // The threads of OpenBLAS and of oneDNN's OpenMP runtime (core/gemm.hpp).
  explicit HostBackend(int threads) : threads_(threads) { gemm::set_threads(threads); }
  std::string name() const override { return "host"; }
  std::string description() const override {
    std::ostringstream s;
    s << "host (Kokkos " << Kokkos::DefaultHostExecutionSpace::name() << ", BLAS "
      << (openblas_get_config ? openblas_get_config() : "cblas") << ", matrix products "
      << (gemm::impl() == gemm::Impl::onednn ? "oneDNN" : "BLAS") << ", " << threads_ << " BLAS thread"
      << (threads_ == 1 ? "" : "s") << ")";
    return s.str();
  }
  void encoder_forward(float* out, const std::int32_t* inp, const float* wte, const float* wpe, int B, int T,
                       int C, int vocab_begin, int vocab_end, bool add_pos) override {
    k::encoder_forward(out, inp, wte, wpe, B, T, C, vocab_begin, vocab_end, add_pos);
  }
  void encoder_backward(float* dwte, float* dwpe, const float* dout, const std::int32_t* inp, int B, int T,
                        int C, int vocab_begin, int vocab_end) override {
    k::encoder_backward(dwte, dwpe, dout, inp, B, T, C, vocab_begin, vocab_end);
  }
  void bias_add(float* out, const float* bias, int N, int OC) override { k::bias_add(out, bias, N, OC); }
  void bias_backward(float* dbias, const float* dout, int N, int OC) override { k::bias_backward(dbias, dout, N, OC); }
  void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                         const float* bias, int N, int C) override {
    k::layernorm_forward(out, mean, rstd, inp, weight, bias, N, C);
  }
  void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                          const float* weight, const float* mean, const float* rstd, int N,
                          int C) override {
    k::layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
  }
  void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int N, int C,
                      int OC) override {
    k::matmul_forward(out, inp, weight, bias, N, C, OC);
  }
  void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                       const float* weight, int N, int C, int OC) override {
    k::matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, C, OC);
  }
  void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH) override {
    k::attention_forward(out, att, qkv, B, T, C, NH);
  }
  void attention_backward(float* dqkv, float* datt, const float* dout, const float* qkv, const float* att,
                          int B, int T, int C, int NH) override {
    k::attention_backward(dqkv, datt, dout, qkv, att, B, T, C, NH);
  }
  void gelu_forward(float* out, const float* inp, std::int64_t n) override { k::gelu_forward(out, inp, n); }
  void gelu_backward(float* dinp, const float* inp, const float* dout, std::int64_t n) override {
    k::gelu_backward(dinp, inp, dout, n);
  }
  void residual_forward(float* out, const float* a, const float* b, std::int64_t n) override {
    k::residual_forward(out, a, b, n);
  }
  void crossentropy_forward(float* losses, float* probs, const float* logits, const std::int32_t* targets,
                            int N, int V) override {
    k::crossentropy_forward(losses, probs, logits, targets, N, V);
  }
  void crossentropy_backward(float* dlogits, const float* probs, const std::int32_t* targets, float dloss,
                             int N, int V) override {
    k::crossentropy_backward(dlogits, probs, targets, dloss, N, V);
  }
  void adamw_update(float* params, float* m, float* v, const float* grads, std::int64_t n, float lr,
                    float beta1, float beta2, float eps, float weight_decay, std::int64_t t) override {
    k::adamw_update(params, m, v, grads, n, lr, beta1, beta2, eps, weight_decay, t);
  }
  double sum_squares(const float* x, std::int64_t n) override { return k::sum_squares(x, n); }
  void scale(float* x, float a, std::int64_t n) override { k::scale(x, a, n); }
  void fill(float* x, float value, std::int64_t n) override { k::fill(x, value, n); }
  void copy(float* dst, const float* src, std::int64_t n) override { k::copy(dst, src, n); }
  double sum(const float* x, std::int64_t n) override { return k::sum(x, n); }

  void cast(BufferRef dst, BufferRef src) override {
    require_host(dst, "cast", "dst");
    require_host(src, "cast", "src");
    if (dst.count != src.count)
      refuse("cast: dst holds " + std::to_string(dst.count) + " elements, src " + std::to_string(src.count));
    with_float_type(dst.type, "cast", [&](auto d) {
      with_float_type(src.type, "cast", [&](auto s) {
        using D = decltype(d);
        using S = decltype(s);
        if constexpr (std::is_same_v<D, S>)
          if (dst.data == src.data) return;
        k::cast(static_cast<D*>(dst.data), static_cast<const S*>(src.data), dst.count);
      });
    });
  }

  void matmul(BufferRef out, BufferRef a, BufferRef b, int M, int N, int K, bool transa, bool transb, float alpha,
              float beta) override {
    require_host(out, "matmul", "out");
    require_host(a, "matmul", "a");
    require_host(b, "matmul", "b");
    if (M < 0 || N < 0 || K < 0) refuse("matmul: negative dimension");
    const auto expect = [](const BufferRef& x, const char* name, std::int64_t rows, std::int64_t cols) {
      if (x.count != rows * cols)
        refuse(std::string("matmul: ") + name + " holds " + std::to_string(x.count) + " elements, expected " +
               std::to_string(rows) + " x " + std::to_string(cols));
    };
    expect(a, "a", M, K);
    expect(b, "b", K, N);
    expect(out, "out", M, N);
    const int lda = std::max(1, transa ? M : K), ldb = std::max(1, transb ? K : N), ldc = std::max(1, N);
    const auto all = [&](DType t) { return a.type == t && b.type == t && out.type == t; };
    if (all(DType::f32)) {
      k::gemm(transa, transb, M, N, K, alpha, a.as<const float>(), lda, b.as<const float>(), ldb, beta,
              out.as<float>(), ldc);
      return;
    }
    if (all(DType::f64)) {
      k::gemm(transa, transb, M, N, K, double(alpha), a.as<const double>(), lda, b.as<const double>(), ldb,
              double(beta), out.as<double>(), ldc);
      return;
    }
    // bf16 operands: straight into loom::gemm::gemm_bf16 (fp32 accumulation); a bf16 out through an
    // fp32 copy, rounded once.
    if (a.type == DType::bf16 && b.type == DType::bf16 && (out.type == DType::f32 || out.type == DType::bf16)) {
      std::vector<float> fc;
      float* pc = out.type == DType::f32 ? out.as<float>() : nullptr;
      if (!pc) {
        fc.resize(static_cast<std::size_t>(out.count));
        if (beta != 0.0f) cast(BufferRef(fc.data(), out.count), out);
        pc = fc.data();
      }
      gemm::gemm_bf16(transa, transb, M, N, K, alpha, a.as<const bf16>(), lda, b.as<const bf16>(), ldb, beta, pc, ldc);
      if (!fc.empty()) cast(out, BufferRef(pc, out.count));
      return;
    }
    for (const BufferRef* x : {&out, &a, &b})
      if (x->type != DType::f32 && x->type != DType::bf16 && x->type != DType::f16)
        refuse(std::string("matmul: operands of ") + dtype_name(out.type) + " = " + dtype_name(a.type) + " x " +
               dtype_name(b.type) + "; mixed operands are fp32, bf16 or fp16 (fp64 only with fp64)");
    // Other 16-bit operands (fp16, or a mix) go through fp32 copies and one sgemm.
    std::vector<float> fa, fb, fc;
    const auto as_f32 = [&](const BufferRef& x, std::vector<float>& copy) -> float* {
      if (x.type == DType::f32) return static_cast<float*>(x.data);
      copy.resize(static_cast<std::size_t>(x.count));
      if (&x != &out || beta != 0.0f) cast(BufferRef(copy.data(), x.count), x);
      return copy.data();
    };
    const float* pa = as_f32(a, fa);
    const float* pb = as_f32(b, fb);
    float* pc = as_f32(out, fc);
    k::gemm(transa, transb, M, N, K, alpha, pa, lda, pb, ldb, beta, pc, ldc);
    if (out.type != DType::f32) cast(out, BufferRef(pc, out.count));
  }

  NormCheck sq_norm_check(const std::vector<BufferRef>& tensors) override {
    NormCheck r;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const BufferRef& t = tensors[i];
      require_host(t, "sq_norm_check", "a tensor");
      double sq = 0;
      bool finite = true;
      with_float_type(t.type, "sq_norm_check", [&](auto tag) {
        using T = decltype(tag);
        const T* x = static_cast<const T*>(t.data);
        sq = k::sum_squares(x, t.count);
        // A NaN or an inf makes its chunk's partial sum, and so the total, non-finite: a finite sum
        // proves the tensor finite without a second look. A non-finite one (a NaN, an inf, or
        // finite values whose squares overflow the partial sums' type) is looked at again.
        if (!std::isfinite(sq)) finite = k::all_finite(x, t.count);
      });
      r.sum_squares += sq;
      if (!finite && r.all_finite) {
        r.all_finite = false;
        r.first_nonfinite = static_cast<int>(i);
      }
    }
    return r;
  }

  void scale(BufferRef x, double a) override {
    require_host(x, "scale", "x");
    with_float_type(x.type, "scale", [&](auto tag) {
      using T = decltype(tag);
      k::scale(static_cast<T*>(x.data), static_cast<acc_type_t<T>>(a), x.count);
    });
  }
  void fill(BufferRef x, double value) override {
    require_host(x, "fill", "x");
    with_float_type(x.type, "fill", [&](auto tag) {
      using T = decltype(tag);
      k::fill(static_cast<T*>(x.data), static_cast<acc_type_t<T>>(value), x.count);
    });
  }

 private:
  int threads_;
};

}  // namespace

std::unique_ptr<Backend> make_host_backend(int threads) { return std::make_unique<HostBackend>(threads); }

}  // namespace loom
