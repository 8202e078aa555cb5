#pragma once
// The compute back end: every numerical operation the model and the optimizer perform, on float
// buffers that live in the back end's memory space. `host` (Kokkos host execution space + CBLAS) is
// the one built here; a `cuda` back end (CUDA kernels + cuBLAS) fills the same interface.
// Signatures mirror core/kernels.hpp: outputs first, gradients prefixed `d`, shapes in comments.
#include <cstdint>
#include <memory>
#include <string>

#include "core/buffer.hpp"
#include "core/dtype.hpp"
#include "core/ledger.hpp"

namespace loom {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;         // "host"
  virtual std::string description() const = 0;  // execution space, BLAS, threads
  // Where this back end's tensors live, and a zeroed buffer there, filed in the ledger under
  // `category`. Every tensor of a run (parameters, gradients, optimizer state, activations,
  // communication scratch) is allocated here, so that a device back end places them all.
  virtual MemSpace space() const { return MemSpace::host; }
  virtual TypedBuffer allocate(const std::string& label, DType type, std::int64_t count, Mem category) {
    return TypedBuffer(label, type, count, category);
  }

  // wte holds vocabulary rows [vocab_begin, vocab_end) (all of them without tensor parallelism).
  virtual void encoder_forward(float* out, const std::int32_t* inp, const float* wte, const float* wpe,
                               int B, int T, int C, int vocab_begin, int vocab_end, bool add_pos) = 0;
  virtual void encoder_backward(float* dwte, float* dwpe, const float* dout, const std::int32_t* inp,
                                int B, int T, int C, int vocab_begin, int vocab_end) = 0;
  virtual void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                                 const float* weight, const float* bias, int N, int C) = 0;
  virtual void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                                  const float* inp, const float* weight, const float* mean,
                                  const float* rstd, int N, int C) = 0;
  virtual void matmul_forward(float* out, const float* inp, const float* weight, const float* bias,
                              int N, int C, int OC) = 0;
  virtual void bias_add(float* out, const float* bias, int N, int OC) = 0;
  virtual void bias_backward(float* dbias, const float* dout, int N, int OC) = 0;
  virtual void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                               const float* inp, const float* weight, int N, int C, int OC) = 0;
  virtual void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH) = 0;
  virtual void attention_backward(float* dqkv, float* datt, const float* dout, const float* qkv,
                                  const float* att, int B, int T, int C, int NH) = 0;
  virtual void gelu_forward(float* out, const float* inp, std::int64_t n) = 0;
  virtual void gelu_backward(float* dinp, const float* inp, const float* dout, std::int64_t n) = 0;
  virtual void residual_forward(float* out, const float* a, const float* b, std::int64_t n) = 0;
  virtual void crossentropy_forward(float* losses, float* probs, const float* logits,
                                    const std::int32_t* targets, int N, int V) = 0;
  virtual void crossentropy_backward(float* dlogits, const float* probs, const std::int32_t* targets,
                                     float dloss, int N, int V) = 0;
  virtual void adamw_update(float* params, float* m, float* v, const float* grads, std::int64_t n,
                            float lr, float beta1, float beta2, float eps, float weight_decay,
                            std::int64_t t) = 0;
  virtual double sum_squares(const float* x, std::int64_t n) = 0;
  virtual void scale(float* x, float a, std::int64_t n) = 0;
  virtual void fill(float* x, float value, std::int64_t n) = 0;
  virtual void copy(float* dst, const float* src, std::int64_t n) = 0;
  virtual double sum(const float* x, std::int64_t n) = 0;
};

// Makes `buffer` hold at least `count` elements of `type` (a new zeroed buffer from the back end when
// it holds fewer; contents are not kept). For scratch that grows with the largest call seen.
inline void ensure_capacity(Backend& backend, TypedBuffer& buffer, const std::string& label, DType type,
                            std::int64_t count, Mem category) {
  if (buffer.type() != type || buffer.count() < count || buffer.empty())
    buffer = backend.allocate(label, type, count, category);
}

// The host back end; `threads` sets the BLAS threads of this rank.
std::unique_ptr<Backend> make_host_backend(int threads);

}  // namespace loom
