// The host back end: Kokkos kernels on the default host execution space, CBLAS matrix products.
#include <Kokkos_Core.hpp>
#include <sstream>

#include "core/backend.hpp"
#include "core/kernels.hpp"

extern "C" void openblas_set_num_threads(int) __attribute__((weak));
extern "C" char* openblas_get_config(void) __attribute__((weak));

namespace loom {
namespace {

namespace k = kernels;

class HostBackend final : public Backend {
 public:
  explicit HostBackend(int threads) : threads_(threads) {
    if (openblas_set_num_threads) openblas_set_num_threads(threads);
  }
  std::string name() const override { return "host"; }
  std::string description() const override {
    std::ostringstream s;
    s << "host (Kokkos " << Kokkos::DefaultHostExecutionSpace::name() << ", BLAS "
      << (openblas_get_config ? openblas_get_config() : "cblas") << ", " << threads_ << " BLAS thread"
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

 private:
  int threads_;
};

}  // namespace

std::unique_ptr<Backend> make_host_backend(int threads) { return std::make_unique<HostBackend>(threads); }

}  // namespace loom
