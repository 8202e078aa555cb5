// run.backend = fenced: the host kernels on memory marked device, for checking without a GPU that
// every access to a tensor goes through the back end (DESIGN.md "The GPU path"). Its buffers are
// host memory underneath, but the addresses it hands out are moved by 2^47, out of the process's
// address space: code outside the back end that reads or writes a tensor through a pointer crashes
// (the handler below names the cause), as it would read device memory on a GPU. It refuses every
// typed buffer marked host memory, as the CUDA back end does. Its communicators are the staged
// ones of a device back end without NCCL (Backend::make_communicator). Results are the host back
// end's bit for bit: the kernels are the same.
#include <signal.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/backend/backend.hpp"

namespace loom {
namespace {

// The addresses the fenced back end hands out: its host memory moved out of the address space.
constexpr std::uintptr_t kAway = std::uintptr_t(1) << 47;
template <class T>
T* away(T* p) {
  return p ? reinterpret_cast<T*>(reinterpret_cast<std::uintptr_t>(p) + kAway) : nullptr;
}
template <class T>
T* back(T* p) {
  return p ? reinterpret_cast<T*>(reinterpret_cast<std::uintptr_t>(p) - kAway) : nullptr;
}
#define H(p) back(p)

class FencedBackend final : public Backend {
 public:
  explicit FencedBackend(int threads) : h_(make_host_backend(threads)) {}
  std::string name() const override { return "fenced"; }
  std::string description() const override {
    return "fenced: the host kernels (" + h_->description() +
           ") on memory marked device, at addresses the host cannot touch";
  }
  MemSpace space() const override { return MemSpace::device; }
  void set_precision(const Precision& p) override {
    h_->set_precision(p);
    precision_ = p;
  }
  void release_scratch() override { h_->release_scratch(); }
  TypedBuffer allocate(const std::string& label, DType type, std::int64_t count, Mem category) override {
    auto* owned = new TypedBuffer(h_->allocate(label, type, count, Mem::workspace));
    // The ledger files the device buffer under its category; the host one underneath is workspace
    // counted twice, which this test does not read.
    return TypedBuffer(BufferRef(away(owned->ref().data), type, count, MemSpace::device), category,
                       [owned](void*) { delete owned; });
  }
  void copy_from_host(BufferRef b, const void* src) override {
    if (b.bytes()) std::memcpy(fenced(b, "copy_from_host").data, src, b.bytes());
  }
  void copy_to_host(void* dst, BufferRef b) override {
    if (b.bytes()) std::memcpy(dst, fenced(b, "copy_to_host").data, b.bytes());
  }

  void encoder_forward(float* out, const std::int32_t* inp, const float* wte, const float* wpe, int B, int T, int C,
                       int vb, int ve, bool add_pos) override {
    h_->encoder_forward(H(out), H(inp), H(wte), H(wpe), B, T, C, vb, ve, add_pos);
  }
  void encoder_backward(float* dwte, float* dwpe, const float* dout, const std::int32_t* inp, int B, int T, int C,
                        int vb, int ve) override {
    h_->encoder_backward(H(dwte), H(dwpe), H(dout), H(inp), B, T, C, vb, ve);
  }
  void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* w, const float* b, int N,
                         int C) override {
    h_->layernorm_forward(H(out), H(mean), H(rstd), H(inp), H(w), H(b), N, C);
  }
  void layernorm_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp, const float* w,
                          const float* mean, const float* rstd, int N, int C) override {
    h_->layernorm_backward(H(dinp), H(dw), H(db), H(dout), H(inp), H(w), H(mean), H(rstd), N, C);
  }
  void matmul_forward(float* out, const float* inp, const float* w, const float* b, int N, int C, int OC) override {
    h_->matmul_forward(H(out), H(inp), H(w), H(b), N, C, OC);
  }
  void bias_add(float* out, const float* b, int N, int OC) override { h_->bias_add(H(out), H(b), N, OC); }
  void bias_backward(float* db, const float* dout, int N, int OC) override { h_->bias_backward(H(db), H(dout), N, OC); }
  void matmul_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp, const float* w, int N,
                       int C, int OC) override {
    h_->matmul_backward(H(dinp), H(dw), H(db), H(dout), H(inp), H(w), N, C, OC);
  }
  void matmul_forward(float* out, BufferRef inp, BufferRef w, const float* b, int N, int C, int OC) override {
    h_->matmul_forward(H(out), fenced(inp, "matmul_forward"), fenced(w, "matmul_forward"), H(b), N, C, OC);
  }
  void matmul_backward(float* dinp, float* dw, float* db, const float* dout, BufferRef inp, BufferRef w, int N, int C,
                       int OC) override {
    h_->matmul_backward(H(dinp), H(dw), H(db), H(dout), fenced(inp, "matmul_backward"), fenced(w, "matmul_backward"), N, C, OC);
  }
  void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH) override {
    h_->attention_forward(H(out), H(att), H(qkv), B, T, C, NH);
  }
  void attention_backward(float* dqkv, float* datt, const float* dout, const float* qkv, const float* att, int B, int T,
                          int C, int NH) override {
    h_->attention_backward(H(dqkv), H(datt), H(dout), H(qkv), H(att), B, T, C, NH);
  }
  std::string flash_attention_refusal(int hs) const override { return h_->flash_attention_refusal(hs); }
  void attention_forward_flash(float* out, float* lse, const float* qkv, int B, int T, int C, int NH) override {
    h_->attention_forward_flash(H(out), H(lse), H(qkv), B, T, C, NH);
  }
  void attention_backward_flash(float* dqkv, float* dsum, const float* dout, BufferRef out, const float* qkv,
                                const float* lse, int B, int T, int C, int NH) override {
    h_->attention_backward_flash(H(dqkv), H(dsum), H(dout), fenced(out, "attention_backward_flash"), H(qkv), H(lse), B,
                                 T, C, NH);
  }
  void gelu_forward(float* out, const float* inp, std::int64_t n) override { h_->gelu_forward(H(out), H(inp), n); }
  void gelu_backward(float* dinp, const float* inp, const float* dout, std::int64_t n) override {
    h_->gelu_backward(H(dinp), H(inp), H(dout), n);
  }
  void residual_forward(float* out, const float* a, const float* b, std::int64_t n) override {
    h_->residual_forward(H(out), H(a), H(b), n);
  }
  void crossentropy_forward(float* losses, float* probs, const float* logits, const std::int32_t* t, int N, int V) override {
    h_->crossentropy_forward(H(losses), H(probs), H(logits), H(t), N, V);
  }
  void crossentropy_backward(float* dl, const float* probs, const std::int32_t* t, float dloss, int N, int V,
                             int vb) override {
    h_->crossentropy_backward(H(dl), H(probs), H(t), dloss, N, V, vb);
  }
  void crossentropy_row_max(float* row_max, const float* logits, int N, int V) override {
    h_->crossentropy_row_max(H(row_max), H(logits), N, V);
  }
  void crossentropy_partial(float* probs, double* sum_exp, double* target_logit, const float* logits,
                            const float* row_max, const std::int32_t* t, int N, int V, int vb) override {
    h_->crossentropy_partial(H(probs), H(sum_exp), H(target_logit), H(logits), H(row_max), H(t), N, V, vb);
  }
  void crossentropy_finish(float* losses, float* probs, const double* sum_exp, const float* row_max,
                           const double* target_logit, int N, int V) override {
    h_->crossentropy_finish(H(losses), H(probs), H(sum_exp), H(row_max), H(target_logit), N, V);
  }
  void adamw_update(float* p, float* m, float* v, const float* g, std::int64_t n, float lr, float b1, float b2, float eps,
                    float wd, std::int64_t t) override {
    h_->adamw_update(H(p), H(m), H(v), H(g), n, lr, b1, b2, eps, wd, t);
  }
  double sum_squares(const float* x, std::int64_t n) override { return h_->sum_squares(H(x), n); }
  void scale(float* x, float a, std::int64_t n) override { h_->scale(H(x), a, n); }
  void fill(float* x, float v, std::int64_t n) override { h_->fill(H(x), v, n); }
  void copy(float* d, const float* s, std::int64_t n) override { h_->copy(H(d), H(s), n); }
  void axpy(float* y, float a, const float* x, std::int64_t n) override { h_->axpy(H(y), a, H(x), n); }
  double sum(const float* x, std::int64_t n) override { return h_->sum(H(x), n); }
  void cast(BufferRef d, BufferRef s) override { h_->cast(fenced(d, "cast"), fenced(s, "cast")); }
  void matmul(BufferRef out, BufferRef a, BufferRef b, int M, int N, int K, bool ta, bool tb, float alpha,
              float beta) override {
    h_->matmul(fenced(out, "matmul"), fenced(a, "matmul"), fenced(b, "matmul"), M, N, K, ta, tb, alpha, beta);
  }
  NormCheck sq_norm_check(const std::vector<BufferRef>& ts) override {
    std::vector<BufferRef> h;
    for (const BufferRef& t : ts) h.push_back(fenced(t, "sq_norm_check"));
    return h_->sq_norm_check(h);
  }
  void scale(BufferRef x, double a) override { h_->scale(fenced(x, "scale"), a); }
  void fill(BufferRef x, double v) override { h_->fill(fenced(x, "fill"), v); }
  void int8_absmax(float* a, const float* x, std::int64_t n, std::int64_t chunk) override {
    h_->int8_absmax(H(a), H(x), n, chunk);
  }
  void int8_quantize(std::int8_t* q, float* e, const float* x, std::int64_t n, std::int64_t chunk, const float* a,
                     int levels) override {
    h_->int8_quantize(H(q), H(e), H(x), n, chunk, H(a), levels);
  }
  void int8_dequantize(float* x, const std::int8_t* q, std::int64_t n, std::int64_t chunk, const float* a,
                       int levels) override {
    h_->int8_dequantize(H(x), H(q), n, chunk, H(a), levels);
  }
  void topk_select(std::int32_t* i, float* v, const float* x, std::int64_t n, std::int64_t k) override {
    h_->topk_select(H(i), H(v), H(x), n, k);
  }
  void topk_scatter_add(float* x, const std::int32_t* i, const float* v, std::int64_t k) override {
    h_->topk_scatter_add(H(x), H(i), H(v), k);
  }
  void topk_clear(float* x, const std::int32_t* i, std::int64_t k) override { h_->topk_clear(H(x), H(i), k); }


 private:
  // A device buffer as the host kernels take it; a host one is refused as the CUDA back end refuses it.
  static BufferRef fenced(BufferRef b, const char* op) {
    if (b.space != MemSpace::device && b.count > 0)
      throw std::invalid_argument(std::string(op) + ": a buffer marked host memory reached a device back end");
    b.space = MemSpace::host;
    b.data = back(b.data);
    return b;
  }
  std::unique_ptr<Backend> h_;
};

void on_segfault(int) {
  static const char msg[] =
      "loom: run.backend = fenced: segmentation fault, most likely a host read or write of a device tensor "
      "(code outside the back end used a tensor's address; use Backend::copy_to_host / copy_from_host or a "
      "back-end operation)\n";
  ssize_t ignored = write(2, msg, sizeof msg - 1);
  (void)ignored;
  signal(SIGSEGV, SIG_DFL);
  raise(SIGSEGV);
}

}  // namespace

std::unique_ptr<Backend> make_fenced_backend(int threads) {
  signal(SIGSEGV, on_segfault);
  return std::make_unique<FencedBackend>(threads);
}

}  // namespace loom
