// core/backend/kernel_rows.inc's fp32 loops, once per instruction set (core/backend/host_isa.hpp). Each
// copy lives in its own namespace, compiled under `#pragma GCC target`, so no two copies share a symbol
// and a CPU only ever runs the one it was chosen for.
#include "core/backend/host_isa.hpp"

#include <cstdlib>
#include <stdexcept>
#include <type_traits>

#include "core/base/dtype.hpp"

namespace loom::isa {
namespace {

// The table of one copy: every fp32 instance of the loops.
#define LOOM_ROW_TABLE(NAME)                                             \
  const RowKernels table = {NAME,                                        \
                            &layernorm_row<float, float>,                \
                            &residual_layernorm_row<float, float>,       \
                            &layernorm_dinp_row<float, float>,           \
                            &layernorm_param_cols<float, float>,         \
                            &bias_cols<float, float>,                    \
                            &bias_gelu_row<float, float>,                \
                            &gelu_bias_cols<float, float>,               \
                            &gelu_span<float, float>,                    \
                            &gelu_backward_span<float, float>,           \
                            &adamw_span<float, float, float>,            \
                            &softmax_causal_row<float, float>,           \
                            &softmax_causal_backward_row<float, float>,  \
                            &layernorm_row<float, float, bf16>,          \
                            &residual_layernorm_row<float, float, bf16>, \
                            &bias_gelu_row<float, float, bf16>,          \
                            &gelu_bias_cols<float, float, bf16>,         \
                            &cast_bf16_span<float>,                      \
                            &bias_cast_cols<float, float, bf16>};

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c")
namespace avx512 {
#include "core/backend/kernel_rows.inc"
LOOM_ROW_TABLE("avx512")
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,f16c")
namespace avx2 {
#include "core/backend/kernel_rows.inc"
LOOM_ROW_TABLE("avx2")
}  // namespace avx2
#pragma GCC pop_options
#define LOOM_HAVE_ISA_COPIES 1
#endif

namespace baseline {
#include "core/backend/kernel_rows.inc"
LOOM_ROW_TABLE("baseline")
}  // namespace baseline

bool cpu_has(const std::string& name) {
#ifdef LOOM_HAVE_ISA_COPIES
  if (name == "avx512")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("f16c");
  if (name == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#endif
  return name == "baseline";
}

const RowKernels* choose() {
  const char* want = std::getenv("LOOM_HOST_ISA");
  if (want && *want) {
    const RowKernels* k = nullptr;
    try {
      k = find(want);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("LOOM_HOST_ISA=") + want + ": " + e.what());
    }
    if (!k)
      throw std::invalid_argument(std::string("LOOM_HOST_ISA=") + want + ": this CPU lacks it (it runs: " + [] {
        std::string s;
        for (const std::string& n : available()) s += (s.empty() ? "" : ", ") + n;
        return s;
      }() + ")");
    return k;
  }
  return find(available().front());
}

}  // namespace

const RowKernels* find(const std::string& name) {
  if (name != "avx512" && name != "avx2" && name != "baseline")
    throw std::invalid_argument("host kernels '" + name + "': valid are avx512, avx2, baseline");
  if (!cpu_has(name)) return nullptr;
#ifdef LOOM_HAVE_ISA_COPIES
  if (name == "avx512") return &avx512::table;
  if (name == "avx2") return &avx2::table;
#endif
  return &baseline::table;
}

std::vector<std::string> available() {
  std::vector<std::string> out;
  for (const char* n : {"avx512", "avx2", "baseline"})
    if (cpu_has(n)) out.push_back(n);
  return out;
}

const RowKernels& active() {
  static const RowKernels* chosen = choose();
  return *chosen;
}

}  // namespace loom::isa
