// The host back end: Kokkos kernels on the default host execution space, matrix products through
// core/backend/gemm (oneDNN or CBLAS, run.gemm).
#include <Kokkos_Core.hpp>
#if defined(__F16C__)
#include <immintrin.h>
#endif
#include <algorithm>
#include <array>
#include <cmath>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/backend/gemm.hpp"
#include "core/backend/host_isa.hpp"
#include "core/backend/flash_attention_host.hpp"
#include "core/backend/kernels.hpp"
#include "core/backend/ring_attention_host.hpp"

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
    case DType::f32:
      f(float{});
      return;
    case DType::f64:
      f(double{});
      return;
    case DType::bf16:
      f(bf16{});
      return;
    case DType::f16:
      f(f16{});
      return;
    default:
      refuse(std::string(op) + ": element type " + dtype_name(t) + " is not fp32, fp64, bf16 or fp16");
  }
}

// Calls f with a value of the C++ type an fp32 kernel's output may be stored as: fp32, or a 16-bit
// type (rounded once on store), named by `out`'s DType.
template <class F>
void with_output_type(const BufferRef& out, const char* op, F&& f) {
  switch (out.type) {
    case DType::f32:
      return f(float{});
    case DType::bf16:
      return f(bf16{});
    case DType::f16:
      return f(f16{});
    default:
      refuse(std::string(op) + ": the output is " + dtype_name(out.type) + "; fp32, bf16 or fp16 expected");
  }
}

class HostBackend final : public Backend {
 public:
  // The threads of OpenBLAS and of oneDNN's OpenMP runtime (core/backend/gemm.hpp).
  // isa::active() first: a LOOM_HOST_ISA this CPU lacks is refused before anything runs.
  explicit HostBackend(int threads) : threads_(threads) {
    isa::active();
    gemm::set_threads(threads);
  }
  std::string name() const override { return "host"; }
  std::string description() const override {
    std::ostringstream s;
    s << "host (Kokkos " << Kokkos::DefaultHostExecutionSpace::name() << ", BLAS "
      << (openblas_get_config ? openblas_get_config() : "cblas") << ", matrix products "
      << (gemm::impl() == gemm::Impl::onednn ? "oneDNN" : "BLAS") << ", " << threads_ << " BLAS thread"
      << (threads_ == 1 ? "" : "s") << ", " << isa::active().name << " kernels)";
    return s.str();
  }
  // Each operation unpacks its operands with BufferRef::as<T>(need): the element type the kernel
  // takes and at least the elements the shapes name, or std::invalid_argument.
  void encoder_forward(BufferRef out, BufferRef inp, BufferRef wte, BufferRef wpe, int B, int T, int C, int vocab_begin,
                       int vocab_end, bool add_pos) override {
    const std::int64_t N = std::int64_t(B) * T;
    k::encoder_forward(out.as<float>(N * C), inp.as<const std::int32_t>(N),
                       wte.as<const float>(std::int64_t(vocab_end - vocab_begin) * C),
                       wpe.as_optional<const float>(std::int64_t(T) * C), B, T, C, vocab_begin, vocab_end, add_pos);
  }
  void encoder_backward(BufferRef dwte, BufferRef dwpe, BufferRef dout, BufferRef inp, int B, int T, int C,
                        int vocab_begin, int vocab_end) override {
    const std::int64_t N = std::int64_t(B) * T;
    k::encoder_backward(dwte.as<float>(std::int64_t(vocab_end - vocab_begin) * C),
                        dwpe.as_optional<float>(std::int64_t(T) * C), dout.as<const float>(N * C),
                        inp.as<const std::int32_t>(N), B, T, C, vocab_begin, vocab_end);
  }
  void bias_add(BufferRef out, BufferRef bias, int N, int OC) override {
    k::bias_add(out.as<float>(std::int64_t(N) * OC), bias.as<const float>(OC), N, OC);
  }
  void bias_backward(BufferRef dbias, BufferRef dout, int N, int OC) override {
    k::bias_backward(dbias.as<float>(OC), dout.as<const float>(std::int64_t(N) * OC), N, OC);
  }
  void rmsnorm_forward(BufferRef out, BufferRef rstd, BufferRef inp, BufferRef weight, int N, int C,
                       float eps) override {
    const std::int64_t NC = std::int64_t(N) * C;
    with_output_type(out, "rmsnorm_forward", [&](auto o) {
      k::rmsnorm_forward<float, float, decltype(o)>(out.as<decltype(o)>(NC), rstd.as<float>(N), inp.as<const float>(NC),
                                                    weight.as<const float>(C), N, C, eps);
    });
  }
  void rmsnorm_backward(BufferRef dinp, BufferRef dweight, BufferRef dout, BufferRef inp, BufferRef weight,
                        BufferRef rstd, int N, int C) override {
    const std::int64_t NC = std::int64_t(N) * C;
    k::rmsnorm_backward(dinp.as<float>(NC), dweight.as<float>(C), dout.as<const float>(NC), inp.as<const float>(NC),
                        weight.as<const float>(C), rstd.as<const float>(N), N, C);
  }
  void rope_gqa_forward(BufferRef qkv, BufferRef q, BufferRef k, BufferRef v, int N, int T, int NH, int KV, int hs,
                        int head0, int kv0, int group, float theta) override {
    const std::int64_t C = std::int64_t(NH) * hs, CK = std::int64_t(KV) * hs;
    k::rope_gqa_forward(qkv.as<float>(3 * N * C), q.as<const float>(N * C), k.as<const float>(N * CK),
                        v.as<const float>(N * CK), N, T, NH, KV, hs, head0, kv0, group, theta);
  }
  void rope_gqa_backward(BufferRef dq, BufferRef dk, BufferRef dv, BufferRef dqkv, int N, int T, int NH, int KV, int hs,
                         int head0, int kv0, int group, float theta) override {
    const std::int64_t C = std::int64_t(NH) * hs, CK = std::int64_t(KV) * hs;
    k::rope_gqa_backward(dq.as<float>(N * C), dk.as<float>(N * CK), dv.as<float>(N * CK),
                         dqkv.as<const float>(3 * N * C), N, T, NH, KV, hs, head0, kv0, group, theta);
  }
  void swiglu_forward(BufferRef out, BufferRef gate, BufferRef up, std::int64_t n) override {
    with_output_type(out, "swiglu_forward", [&](auto o) {
      k::swiglu_forward<float, float, decltype(o)>(out.as<decltype(o)>(n), gate.as<const float>(n),
                                                   up.as<const float>(n), n);
    });
  }
  void swiglu_backward(BufferRef dgate, BufferRef dup, BufferRef dout, BufferRef gate, BufferRef up,
                       std::int64_t n) override {
    if (dgate.type != dup.type) refuse("swiglu_backward: dgate and dup of one type");
    with_output_type(dgate, "swiglu_backward", [&](auto o) {
      k::swiglu_backward<float, float, decltype(o)>(dgate.as<decltype(o)>(n), dup.as<decltype(o)>(n),
                                                    dout.as<const float>(n), gate.as<const float>(n),
                                                    up.as<const float>(n), n);
    });
  }
  void layernorm_forward(BufferRef out, BufferRef mean, BufferRef rstd, BufferRef inp, BufferRef weight, BufferRef bias,
                         int N, int C) override {
    const std::int64_t NC = std::int64_t(N) * C;
    with_output_type(out, "layernorm_forward", [&](auto o) {
      k::layernorm_forward(out.as<decltype(o)>(NC), mean.as<float>(N), rstd.as<float>(N), inp.as<const float>(NC),
                           weight.as<const float>(C), bias.as<const float>(C), N, C);
    });
  }
  void residual_layernorm_forward(BufferRef residual, BufferRef out, BufferRef mean, BufferRef rstd, BufferRef a,
                                  BufferRef b, BufferRef weight, BufferRef bias, int N, int C) override {
    const std::int64_t NC = std::int64_t(N) * C;
    with_output_type(out, "residual_layernorm_forward", [&](auto o) {
      k::residual_layernorm_forward(residual.as<float>(NC), out.as<decltype(o)>(NC), mean.as<float>(N),
                                    rstd.as<float>(N), a.as<const float>(NC), b.as<const float>(NC),
                                    weight.as<const float>(C), bias.as<const float>(C), N, C);
    });
  }
  void layernorm_backward(BufferRef dinp, BufferRef dweight, BufferRef dbias, BufferRef dout, BufferRef inp,
                          BufferRef weight, BufferRef mean, BufferRef rstd, int N, int C) override {
    const std::int64_t NC = std::int64_t(N) * C;
    k::layernorm_backward(dinp.as<float>(NC), dweight.as<float>(C), dbias.as<float>(C), dout.as<const float>(NC),
                          inp.as<const float>(NC), weight.as<const float>(C), mean.as<const float>(N),
                          rstd.as<const float>(N), N, C);
  }
  void set_precision(const Precision& p) override {
    if (p.matmul != DType::f32 && p.matmul != DType::bf16 && p.matmul != DType::f16)
      refuse(std::string("precision: matrix products in ") + dtype_name(p.matmul) +
             "; the host back end takes fp32, bf16 or fp16");
    precision_ = p;
  }
  void release_scratch() override {
    for (TypedBuffer& b : operands_) b = TypedBuffer();
  }
  void matmul_forward(BufferRef out, BufferRef inp, BufferRef weight, BufferRef bias, int N, int C, int OC) override {
    const std::int64_t NC = std::int64_t(N) * C, WC = std::int64_t(OC) * C, NO = std::int64_t(N) * OC;
    float* o = out.as<float>(NO);
    const float* b = bias.as_optional<const float>(OC);
    if (precision_.matmul == DType::f32)
      return k::matmul_forward(o, inp.as<const float>(NC), weight.as<const float>(WC), b, N, C, OC);
    const void* x = operand16(0, inp, NC);                   // [N,C]
    const void* w = operand16(1, weight, WC);                // [OC,C]
    gemm16(false, true, N, OC, C, x, C, w, C, 0.0f, o, OC);  // out = x W^T
    if (b) k::bias_add(o, b, N, OC);
  }
  void matmul_forward_gelu(BufferRef out, BufferRef pre, BufferRef inp, BufferRef weight, BufferRef bias, int N, int C,
                           int OC) override {
    const std::int64_t NC = std::int64_t(N) * C, WC = std::int64_t(OC) * C, NO = std::int64_t(N) * OC;
    float* p = pre.as<float>(NO);
    const float* b = bias.as_optional<const float>(OC);
    with_output_type(out, "matmul_forward_gelu", [&](auto type) {
      using O = decltype(type);
      O* o = out.as<O>(NO);
      if (precision_.matmul == DType::f32)
        return k::matmul_forward_gelu<float, float, O>(o, p, inp.as<const float>(NC), weight.as<const float>(WC), b, N,
                                                       C, OC);
      const void* x = operand16(0, inp, NC);                   // [N,C]
      const void* w = operand16(1, weight, WC);                // [OC,C]
      gemm16(false, true, N, OC, C, x, C, w, C, 0.0f, p, OC);  // pre = x W^T
      k::bias_gelu_forward<float, float, O>(o, p, b, N, OC);
    });
  }
  void gelu_bias_backward(BufferRef dpre, BufferRef dbias, BufferRef pre, BufferRef dout, int N, int OC) override {
    const std::int64_t NO = std::int64_t(N) * OC;
    with_output_type(dpre, "gelu_bias_backward", [&](auto o) {
      k::gelu_bias_backward<float, float, decltype(o)>(dpre.as<decltype(o)>(NO), dbias.as_optional<float>(OC),
                                                       pre.as<const float>(NO), dout.as<const float>(NO), N, OC);
    });
  }
  void matmul_backward(BufferRef dinp, BufferRef dweight, BufferRef dbias, BufferRef dout, BufferRef inp,
                       BufferRef weight, int N, int C, int OC) override {
    const std::int64_t NC = std::int64_t(N) * C, WC = std::int64_t(OC) * C, NO = std::int64_t(N) * OC;
    float* di = dinp.as<float>(NC);
    float* dw = dweight.as<float>(WC);
    float* db = dbias.as_optional<float>(OC);
    if (precision_.matmul == DType::f32)
      return k::matmul_backward(di, dw, db, dout.as<const float>(NO), inp.as<const float>(NC),
                                weight.as<const float>(WC), N, C, OC);
    // dout may be 16-bit already (its producer rounded it: gelu_bias_backward, crossentropy_backward),
    // then without a bias.
    if (db && dout.type != DType::f32)
      refuse(std::string("matmul_backward: a ") + dtype_name(dout.type) +
             " dout with a bias gradient (the bias sums fp32 gradients: pass dout in fp32)");
    const float* d = db ? dout.as<const float>(NO) : nullptr;
    // bf16 with a bias: the bias's column sums (fp32) and dout's rounded copy in one pass.
    const bool fused = db && precision_.matmul == DType::bf16;
    const void* d16 = fused ? bias_and_operand(db, d, N, OC) : operand16(0, dout, NO);
    const void* w = operand16(1, weight, WC);                    // [OC,C]
    const void* x = operand16(2, inp, NC);                       // [N,C]
    gemm16(false, false, N, C, OC, d16, OC, w, C, 0.0f, di, C);  // dinp = dout W
    gemm16(true, false, OC, C, N, d16, OC, x, C, 1.0f, dw, C);   // dW += dout^T x
    if (db && !fused) k::bias_backward(db, d, N, OC);            // a sum, not a product: fp32
  }
  void attention_forward(BufferRef out, BufferRef att, BufferRef qkv, int B, int T, int C, int NH) override {
    const std::int64_t NC = std::int64_t(B) * T * C;
    if (precision_.matmul == DType::bf16)  // bf16 products, as every other product of the run
      return k::attention_forward_bf16(out.as<float>(NC), att.as<float>(std::int64_t(B) * NH * T * T),
                                       qkv.as<const float>(3 * NC), slot16(0, 3 * NC),
                                       slot16(1, 2 * std::int64_t(T) * T), B, T, C, NH);
    k::attention_forward(out.as<float>(NC), att.as<float>(std::int64_t(B) * NH * T * T), qkv.as<const float>(3 * NC), B,
                         T, C, NH);
  }
  void attention_backward(BufferRef dqkv, BufferRef datt, BufferRef dout, BufferRef qkv, BufferRef att, int B, int T,
                          int C, int NH) override {
    const std::int64_t NC = std::int64_t(B) * T * C;
    if (precision_.matmul == DType::bf16)
      return k::attention_backward_bf16(dqkv.as<float>(3 * NC), datt.as<float>(std::int64_t(T) * T),
                                        dout.as<const float>(NC), qkv.as<const float>(3 * NC),
                                        att.as<const float>(std::int64_t(B) * NH * T * T), slot16(0, 3 * NC),
                                        slot16(2, NC), slot16(1, 2 * std::int64_t(T) * T), B, T, C, NH);
    // datt: one head's [T,T] at a time
    k::attention_backward(dqkv.as<float>(3 * NC), datt.as<float>(std::int64_t(T) * T), dout.as<const float>(NC),
                          qkv.as<const float>(3 * NC), att.as<const float>(std::int64_t(B) * NH * T * T), B, T, C, NH);
  }
  std::string flash_attention_refusal(int hs) const override { return flash_head_size_refusal(hs); }
  void attention_forward_flash(BufferRef out, BufferRef lse, BufferRef qkv, int B, int T, int C, int NH) override {
    require_flash(C / NH);
    const std::int64_t NC = std::int64_t(B) * T * C;
    with_output_type(out, "attention_forward_flash", [&](auto o) {
      k::flash::attention_forward(out.as<decltype(o)>(NC), lse.as<float>(std::int64_t(B) * NH * T),
                                  qkv.as<const float>(3 * NC), B, T, C, NH);
    });
  }
  void attention_backward_flash(BufferRef dqkv, BufferRef dsum, BufferRef dout, BufferRef out, BufferRef qkv,
                                BufferRef lse, int B, int T, int C, int NH) override {
    require_flash(C / NH);
    require_host(out, "attention_backward_flash", "out");
    const std::int64_t NC = std::int64_t(B) * T * C, rows = std::int64_t(B) * NH * T;
    if (out.count < NC) refuse("attention_backward_flash: out holds " + std::to_string(out.count) + " elements");
    float* dq = dqkv.as<float>(3 * NC);
    float* ds = dsum.as<float>(rows);
    const float* d = dout.as<const float>(NC);
    const float* x = qkv.as<const float>(3 * NC);
    const float* l = lse.as<const float>(rows);
    with_float_type(out.type, "attention_backward_flash", [&](auto t) {
      using OutT = decltype(t);
      if constexpr (std::is_same_v<OutT, double>)
        refuse("attention_backward_flash: the saved output must be fp32, bf16 or fp16");
      else
        k::flash::attention_backward(dq, ds, d, static_cast<const OutT*>(out.data), x, l, B, T, C, NH);
    });
  }
  std::string ring_attention_refusal() const override { return ""; }
  std::string expert_rows_refusal() const override { return ""; }
  void rows_gather(BufferRef out, BufferRef x, BufferRef rows, BufferRef scale, int n, int C) override {
    if (n <= 0) return;
    const std::int32_t* r = rows.as<const std::int32_t>(n);
    const std::int64_t nC = std::int64_t(n) * C;
    if (!scale.empty()) {
      k::rows_gather(out.as<float>(nC), x.as<const float>(), r, scale.as<const float>(n), n, C);
      return;
    }
    if (out.type != x.type)
      refuse(std::string("rows_gather: out is ") + dtype_name(out.type) + ", x " + dtype_name(x.type) +
             " (a gather without scale keeps the type)");
    with_float_type(x.type, "rows_gather", [&](auto t) {
      using T = decltype(t);
      k::rows_gather(out.as<T>(nC), x.as<const T>(), r, nullptr, n, C);
    });
  }
  void rows_scatter_add(BufferRef out, BufferRef y, BufferRef rows, BufferRef scale, int n, int C) override {
    if (n <= 0) return;
    k::rows_scatter_add(out.as<float>(), y.as<const float>(std::int64_t(n) * C), rows.as<const std::int32_t>(n),
                        scale.empty() ? nullptr : scale.as<const float>(n), n, C);
  }
  void rows_dot(BufferRef out, BufferRef x, BufferRef rows, BufferRef y, int n, int C) override {
    if (n <= 0) return;
    k::rows_dot(out.as<float>(n), x.as<const float>(), rows.as<const std::int32_t>(n),
                y.as<const float>(std::int64_t(n) * C), n, C);
  }
  void attention_ring_forward(BufferRef out, BufferRef lse, BufferRef qkv, BufferRef kv, int B, int T, int C, int NH,
                              int q_begin, int kv_rows, bool causal, bool bf16) override {
    const std::int64_t NC = std::int64_t(B) * T * C;
    k::ring::forward(out.as<float>(NC), lse.as<float>(std::int64_t(B) * NH * T), qkv.as<const float>(3 * NC),
                     kv.as<const float>(2 * NC), B, T, C, NH, q_begin, kv_rows, causal, bf16);
  }
  void attention_ring_backward(BufferRef dqkv, BufferRef dkv, BufferRef dsum, BufferRef dout, BufferRef out,
                               BufferRef qkv, BufferRef kv, BufferRef lse, int B, int T, int C, int NH, int q_begin,
                               int kv_rows, bool causal, bool bf16) override {
    require_host(out, "attention_ring_backward", "out");
    const std::int64_t NC = std::int64_t(B) * T * C, rows = std::int64_t(B) * NH * T;
    if (out.count < NC) refuse("attention_ring_backward: out holds " + std::to_string(out.count) + " elements");
    with_float_type(out.type, "attention_ring_backward", [&](auto t) {
      using OutT = decltype(t);
      if constexpr (std::is_same_v<OutT, double>)
        refuse("attention_ring_backward: the saved output must be fp32, bf16 or fp16");
      else
        k::ring::backward(dqkv.as<float>(3 * NC), dkv.as<float>(2 * NC), dsum.as<float>(rows), dout.as<const float>(NC),
                          static_cast<const OutT*>(out.data), qkv.as<const float>(3 * NC), kv.as<const float>(2 * NC),
                          lse.as<const float>(rows), B, T, C, NH, q_begin, kv_rows, causal, bf16);
    });
  }
  void copy_rows(BufferRef dst, BufferRef src, std::int64_t rows, std::int64_t cols, std::int64_t dst_ld,
                 std::int64_t src_ld) override {
    if (rows <= 0) return;
    float* d = dst.as<float>((rows - 1) * dst_ld + cols);
    const float* s = src.as<const float>((rows - 1) * src_ld + cols);
    for (std::int64_t r = 0; r < rows; ++r) std::copy(s + r * src_ld, s + r * src_ld + cols, d + r * dst_ld);
  }
  void gelu_forward(BufferRef out, BufferRef inp, std::int64_t n) override {
    k::gelu_forward(out.as<float>(n), inp.as<const float>(n), n);
  }
  void gelu_backward(BufferRef dinp, BufferRef inp, BufferRef dout, std::int64_t n) override {
    k::gelu_backward(dinp.as<float>(n), inp.as<const float>(n), dout.as<const float>(n), n);
  }
  void residual_forward(BufferRef out, BufferRef a, BufferRef b, std::int64_t n) override {
    k::residual_forward(out.as<float>(n), a.as<const float>(n), b.as<const float>(n), n);
  }
  void crossentropy_forward(BufferRef losses, BufferRef probs, BufferRef logits, BufferRef targets, int N,
                            int V) override {
    const std::int64_t NV = std::int64_t(N) * V;
    k::crossentropy_forward(losses.as<float>(N), probs.as<float>(NV), logits.as<const float>(NV),
                            targets.as<const std::int32_t>(N), N, V);
  }
  void crossentropy_backward(BufferRef dlogits, BufferRef probs, BufferRef targets, float dloss, int N, int V,
                             int vocab_begin) override {
    const std::int64_t NV = std::int64_t(N) * V;
    with_output_type(dlogits, "crossentropy_backward", [&](auto o) {
      k::crossentropy_backward<float, float, decltype(o)>(dlogits.as<decltype(o)>(NV), probs.as<const float>(NV),
                                                          targets.as<const std::int32_t>(N), dloss, N, V, vocab_begin);
    });
  }
  void crossentropy_fused(BufferRef losses, BufferRef dlogits, BufferRef logits, BufferRef targets, float dloss, int N,
                          int V) override {
    const std::int64_t NV = std::int64_t(N) * V;
    with_output_type(dlogits, "crossentropy_fused", [&](auto o) {
      k::crossentropy_fused<float, float, decltype(o)>(losses.as<float>(N), dlogits.as<decltype(o)>(NV),
                                                       logits.as<const float>(NV), targets.as<const std::int32_t>(N),
                                                       dloss, N, V);
    });
  }
  void crossentropy_row_max(BufferRef row_max, BufferRef logits, int N, int V) override {
    k::crossentropy_row_max(row_max.as<float>(N), logits.as<const float>(std::int64_t(N) * V), N, V);
  }
  void crossentropy_partial(BufferRef probs, BufferRef sum_exp, BufferRef target_logit, BufferRef logits,
                            BufferRef row_max, BufferRef targets, int N, int V, int vocab_begin) override {
    const std::int64_t NV = std::int64_t(N) * V;
    k::crossentropy_partial(probs.as_optional<float>(NV), sum_exp.as<double>(N), target_logit.as<double>(N),
                            logits.as<const float>(NV), row_max.as<const float>(N), targets.as<const std::int32_t>(N),
                            N, V, vocab_begin);
  }
  void crossentropy_finish(BufferRef losses, BufferRef probs, BufferRef sum_exp, BufferRef row_max,
                           BufferRef target_logit, int N, int V) override {
    k::crossentropy_finish(losses.as<float>(N), probs.as<float>(std::int64_t(N) * V), sum_exp.as<const double>(N),
                           row_max.as<const float>(N), target_logit.as<const double>(N), N, V);
  }
  void crossentropy_finish_grad(BufferRef losses, BufferRef dlogits, BufferRef logits, BufferRef sum_exp,
                                BufferRef row_max, BufferRef target_logit, BufferRef targets, float dloss, int N, int V,
                                int vocab_begin) override {
    const std::int64_t NV = std::int64_t(N) * V;
    with_output_type(dlogits, "crossentropy_finish_grad", [&](auto o) {
      k::crossentropy_finish_grad<decltype(o)>(losses.as<float>(N), dlogits.as<decltype(o)>(NV),
                                               logits.as<const float>(NV), sum_exp.as<const double>(N),
                                               row_max.as<const float>(N), target_logit.as<const double>(N),
                                               targets.as<const std::int32_t>(N), dloss, N, V, vocab_begin);
    });
  }
  void adamw_update(BufferRef params, BufferRef m, BufferRef v, BufferRef grads, std::int64_t n, float lr, float beta1,
                    float beta2, float eps, float weight_decay, std::int64_t t) override {
    k::adamw_update(params.as<float>(n), m.as<float>(n), v.as<float>(n), grads.as<const float>(n), n, lr, beta1, beta2,
                    eps, weight_decay, t);
  }
  void copy(BufferRef dst, BufferRef src, std::int64_t n) override {
    k::copy(dst.as<float>(n), src.as<const float>(n), n);
  }
  void axpy(BufferRef y, float a, BufferRef x, std::int64_t n) override {
    k::axpy(y.as<float>(n), a, x.as<const float>(n), n);
  }
  double sum(BufferRef x, std::int64_t n) override { return k::sum(x.as<const float>(n), n); }

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
    check_matmul_shapes(out, a, b, M, N, K);
    const int lda = std::max(1, transa ? M : K), ldb = std::max(1, transb ? K : N), ldc = std::max(1, N);
    const auto all = [&](DType t) { return a.type == t && b.type == t && out.type == t; };
    if (all(DType::f32)) {
      k::gemm(transa, transb, M, N, K, alpha, a.as<const float>(), lda, b.as<const float>(), ldb, beta, out.as<float>(),
              ldc);
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
  void int8_absmax(BufferRef absmax, BufferRef x, std::int64_t n, std::int64_t chunk) override {
    k::int8_absmax(absmax.as<float>(chunks(n, chunk) + 1), x.as<const float>(n), n, chunk);
  }
  void int8_quantize(BufferRef q, BufferRef error, BufferRef x, std::int64_t n, std::int64_t chunk, BufferRef absmax,
                     int levels) override {
    k::int8_quantize(q.as<std::int8_t>(n), error.as_optional<float>(n), x.as<const float>(n), n, chunk,
                     absmax.as<const float>(chunks(n, chunk) + 1), levels);
  }
  void int8_dequantize(BufferRef x, BufferRef q, std::int64_t n, std::int64_t chunk, BufferRef absmax,
                       int levels) override {
    k::int8_dequantize(x.as<float>(n), q.as<const std::int8_t>(n), n, chunk,
                       absmax.as<const float>(chunks(n, chunk) + 1), levels);
  }
  void topk_select(BufferRef index, BufferRef value, BufferRef x, std::int64_t n, std::int64_t k) override {
    k::topk_select(index.as<std::int32_t>(k), value.as<float>(k), x.as<const float>(n), n, k);
  }
  void topk_scatter_add(BufferRef x, BufferRef index, BufferRef value, std::int64_t k) override {
    k::topk_scatter_add(x.as<float>(), index.as<const std::int32_t>(k), value.as<const float>(k), k);
  }
  void topk_clear(BufferRef x, BufferRef index, std::int64_t k) override {
    k::topk_clear(x.as<float>(), index.as<const std::int32_t>(k), k);
  }

  // The operand slots a micro-batch's products grow, as operand16 grows them: a bf16 operand needs
  // none; ensure_capacity makes the larger buffer before it frees the smaller.
  void plan_workspace(StepPlan& plan, const std::vector<MatmulCall>& calls,
                      const AttentionShape& attention) const override {
    if (precision_.matmul == DType::f32) return;
    const double elem = precision_.matmul == DType::bf16 ? 2.0 : 4.0;
    std::array<double, 3> have{};
    double peak = 0;
    auto need = [&](int slot, DType type, double n) {
      if (type == DType::bf16 || n * elem <= have[static_cast<std::size_t>(slot)]) return;
      peak = std::max(peak, have[0] + have[1] + have[2] + n * elem);
      have[static_cast<std::size_t>(slot)] = n * elem;
    };
    // The unfused attention of a bf16 run rounds its operands into the same slots, after the q, k, v
    // products' forward and before their backward: qkv [rows, 3 NH hs] in 0, a head's probabilities and
    // score gradients [2, T, T] in 1, dout [rows, NH hs] in 2.
    const bool att16 = precision_.matmul == DType::bf16 && !attention.flash && attention.NH > 0;
    const double rows = double(attention.B) * attention.T, width = double(attention.NH) * attention.hs,
                 TT = double(attention.T) * attention.T;
    for (const MatmulCall& c : calls) {
      const double NC = double(c.N) * c.C, WC = double(c.OC) * c.C;
      if (att16 && c.after_attention && c.backward) {
        need(0, DType::f32, rows * 3 * width);
        need(1, DType::f32, 2 * TT);
        need(2, DType::f32, rows * width);
      }
      if (!c.backward) {
        need(0, c.inp.type, NC);
        need(1, c.weight.type, WC);
        if (att16 && c.after_attention) {
          need(0, DType::f32, rows * 3 * width);
          need(1, DType::f32, 2 * TT);
        }
      } else {
        need(0, c.dout, double(c.N) * c.OC);
        need(1, c.weight.type, WC);
        need(2, c.inp.type, NC);
      }
    }
    plan.add_scratch(Mem::workspace, peak);
  }

 private:
  static std::int64_t chunks(std::int64_t n, std::int64_t chunk) { return chunk > 0 ? (n + chunk - 1) / chunk : 0; }
  void require_flash(int hs) const {
    const std::string why = flash_attention_refusal(hs);
    if (!why.empty()) refuse("fused attention: " + why);
  }
  // The first n elements of `src` as an operand of the matrix products' 16-bit type, for gemm16:
  // fp32 rounded (nearest even) into workspace operand slot `slot`; a 16-bit buffer of that type as it
  // is (bf16: read in place by gemm_bf16, oneDNN's bf16 kernels with fp32 accumulation; fp16: widened
  // into the slot, exactly). fp16 operands reach the fp32 product widened: this CPU has no fp16
  // arithmetic, so the product is the fp16 operands' product accumulated in fp32, honest, not faster.
  const void* operand16(int slot, BufferRef src, std::int64_t n) {
    if (src.count < n)
      throw std::invalid_argument("Backend::matmul: an operand of " + std::to_string(src.count) + " elements, " +
                                  std::to_string(n) + " needed");
    if (src.type != DType::f32 && src.type != precision_.matmul)
      throw std::invalid_argument(std::string("Backend::matmul: a ") + dtype_name(src.type) + " operand in a " +
                                  dtype_name(precision_.matmul) + " run (fp32 or " + dtype_name(precision_.matmul) +
                                  " expected)");
    require_host(src, "matmul", "operand");
    if (src.type == DType::bf16) return src.data;
    TypedBuffer& buf = operands_[static_cast<std::size_t>(slot)];
    const DType slot_type = precision_.matmul == DType::bf16 ? DType::bf16 : DType::f32;
    ensure_capacity(*this, buf, "Backend::matmul_operand" + std::to_string(slot), slot_type, n, Mem::workspace);
    if (src.type == DType::f16) {  // a stored fp16 copy, widened exactly
      k::cast(buf.data<float>(), static_cast<const f16*>(src.data), n);
      return buf.data<float>();
    }
    const float* in = src.as<float>();
    if (precision_.matmul == DType::bf16) {
      k::cast(buf.data<bf16>(), in, n);
      return buf.data<bf16>();
    }
    round_fp16(buf.data<float>(), in, n);
    return buf.data<float>();
  }
  // Operand slot `slot` as n bf16 elements (the unfused attention's rounded operands in a bf16 run).
  bf16* slot16(int slot, std::int64_t n) {
    TypedBuffer& buf = operands_[static_cast<std::size_t>(slot)];
    ensure_capacity(*this, buf, "Backend::matmul_operand" + std::to_string(slot), DType::bf16, n, Mem::workspace);
    return buf.data<bf16>();
  }
  // dbias += dout's column sums, and dout [N,OC] rounded to bf16 into operand slot 0 (what operand16
  // would make of it), in one pass; the slot's data.
  const void* bias_and_operand(float* dbias, const float* dout, int N, int OC) {
    TypedBuffer& buf = operands_[0];
    ensure_capacity(*this, buf, "Backend::matmul_operand0", DType::bf16, std::int64_t(N) * OC, Mem::workspace);
    k::bias_backward_cast(dbias, buf.data<bf16>(), dout, N, OC);
    return buf.data<bf16>();
  }
  // dst = src rounded to fp16 and widened back (the values an fp16 operand holds).
  static void round_fp16(float* dst, const float* src, std::int64_t n) {
    k::for_chunks("Matmul::round_fp16", n, [=](std::int64_t b, std::int64_t e) {
      std::int64_t i = b;
#if defined(__F16C__)
      // The CPU's conversion (F16C: round to nearest even, inf on overflow, NaN kept), 8 at a time;
      // the same values as to_f16, about 10x faster.
      for (; i + 8 <= e; i += 8)
        _mm256_storeu_ps(dst + i,
                         _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT)));
#endif
      for (; i < e; ++i) dst[i] = to_float(to_f16(src[i]));
    });
  }
  // C[M,N] = op(A) op(B) + beta C on two operand16 results, fp32 accumulation.
  void gemm16(bool ta, bool tb, int M, int N, int K, const void* A, int lda, const void* B, int ldb, float beta,
              float* C, int ldc) {
    if (precision_.matmul == DType::bf16)
      gemm::gemm_bf16(ta, tb, M, N, K, 1.0f, static_cast<const bf16*>(A), lda, static_cast<const bf16*>(B), ldb, beta,
                      C, ldc);
    else
      gemm::sgemm(ta, tb, M, N, K, 1.0f, static_cast<const float*>(A), lda, static_cast<const float*>(B), ldb, beta, C,
                  ldc);
  }

  int threads_;
  std::array<TypedBuffer, 3> operands_;  // the 16-bit operands of one matrix product (input, weight, gradient)
};

}  // namespace

std::unique_ptr<Backend> make_host_backend(int threads) { return std::make_unique<HostBackend>(threads); }

}  // namespace loom
