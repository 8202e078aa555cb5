#pragma once
// The host kernels' fp32 inner loops (core/backend/kernel_rows.inc) compiled for three instruction sets
// in one library, and the set this CPU runs, chosen once at run time: AVX-512 (avx512f/bw/vl/dq), AVX2,
// or the build's baseline (x86-64, or the building CPU's with LOOM_NATIVE). Every set gives the same
// bits (kernel_rows.inc's fixed orders; HostIsa.EverySetGivesTheBaselinesBits checks), so the choice
// changes the speed only. LOOM_HOST_ISA=avx512|avx2|baseline asks for one; a set this CPU lacks, or an
// unknown name, is refused (std::invalid_argument) when the kernels are first used.
#include <cstdint>
#include <string>
#include <vector>

#include "core/backend/kernel_math.hpp"
#include "core/base/dtype.hpp"

namespace loom::isa {

struct RowKernels {
  const char* name;  // "avx512", "avx2", "baseline"
  void (*layernorm_row)(float* o, float& mean, float& rstd, const float* x, const float* w, const float* b, int C);
  void (*residual_layernorm_row)(float* r, float* o, float& mean, float& rstd, const float* a, const float* b,
                                 const float* w, const float* bias, int C);
  void (*layernorm_dinp_row)(float* dx, const float* d, const float* x, const float* w, float m, float s, int C);
  void (*layernorm_param_cols)(float* dw, float* db, const float* dout, const float* inp, const float* mean,
                               const float* rstd, int N, int C, int c0, int c1);
  void (*bias_cols)(float* dbias, const float* dout, int N, int OC, int c0, int c1);
  void (*bias_gelu_row)(float* o, float* p, const float* bias, int OC);
  void (*gelu_bias_cols)(float* dpre, float* dbias, const float* pre, const float* dout, int N, int OC, int c0, int c1);
  void (*gelu_span)(float* out, const float* inp, std::int64_t begin, std::int64_t end);
  void (*gelu_backward_span)(float* dinp, const float* inp, const float* dout, std::int64_t begin, std::int64_t end);
  void (*adamw_span)(float* p, float* m, float* v, const float* g, std::int64_t begin, std::int64_t end,
                     const math::AdamWStep<float>& step);
  void (*softmax_causal_row)(float* row, int t, int T);
  void (*softmax_causal_backward_row)(float* dr, const float* ar, int t, int T);
  // fp32 arithmetic, a bf16 output (the operand of the next bf16 product), rounded once on store.
  void (*layernorm_row_bf16)(bf16* o, float& mean, float& rstd, const float* x, const float* w, const float* b, int C);
  void (*residual_layernorm_row_bf16)(float* r, bf16* o, float& mean, float& rstd, const float* a, const float* b,
                                      const float* w, const float* bias, int C);
  void (*bias_gelu_row_bf16)(bf16* o, float* p, const float* bias, int OC);
  void (*gelu_bias_cols_bf16)(bf16* dpre, float* dbias, const float* pre, const float* dout, int N, int OC, int c0,
                              int c1);
  void (*cast_bf16_span)(bf16* out, const float* inp, std::int64_t begin, std::int64_t end);
  void (*bias_cast_cols_bf16)(float* dbias, bf16* copy, const float* dout, int N, int OC, int c0, int c1);
};

// The set the kernels run: LOOM_HOST_ISA's, else the best this CPU has.
const RowKernels& active();
// A set by name, null when this CPU lacks it; throws std::invalid_argument for an unknown name.
const RowKernels* find(const std::string& name);
// The sets this CPU runs, best first.
std::vector<std::string> available();

}  // namespace loom::isa
