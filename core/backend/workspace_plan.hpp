#pragma once
// The workspace the CUDA back end (core/cuda/cuda_backend.cpp) takes beyond the model's own buffers,
// written once for it and for `loom plan`, which plans GPU runs where there is no GPU
// (make_cuda_sizing_backend). Plain C++: built into loom_core, which has no CUDA. regression.gpu.emulated
// holds the two together: `loom plan` of cuda decks against the CUDA back end's own ledger, run on the
// emulated device.
#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/backend/topk_geometry.hpp"

namespace loom::cuda_plan {

// cuBLASLt's workspace, allocated with the back end: it covers cuBLASLt's choices for every product
// of GPT-2-sized models (llm.c uses the same).
inline constexpr std::int64_t kCublasLtWorkspaceBytes = 32ll << 20;

// The operand slots of the products: matmul_forward casts inp [N,C] into slot kInp and weight [OC,C]
// into kWeight; matmul_backward dout [N,OC] (fp32, unless its producer stored it 16-bit) into kDout, then
// weight and inp. Only an operand not
// already of the products' type (precision.matmul) is cast; a slot grows with the largest call
// (ensure_capacity makes the larger buffer before it frees the smaller). The generic Backend::matmul
// uses the slots too, as fp32 copies of 16-bit operands or of a 16-bit out: during a step only
// PowerSGD calls it, with fp32 operands and out, which take none (a mixed call would change a slot's
// type and reallocate it, which this plan does not count).
enum Slot { kInp = 0, kWeight = 1, kDout = 2, kSlots = 3 };

// The unfused attention's backward: the scores' gradient of one sequence's heads at once, [NH,T,T]
// fp32 (the fused attention needs none).
inline std::int64_t attention_scratch_floats(int NH, int T) { return static_cast<std::int64_t>(NH) * T * T; }

// cuDNN's attention (model.attention = cudnn, core/cuda/cuda_backend.cpp): bf16 staging of qkv [N,3C],
// dout [N,C] and dqkv [N,3C], and of out [N,C] unless the products' type is bf16 (the model then saves
// it in bf16); made at the first attention and kept. N C = B T NH hs of this rank. cuDNN's own plan
// workspace is asked of cuDNN on the device and is not in this sum (nor the staging of statistics that
// a model buffer at an odd offset would need: the model's tables are aligned for every deck of inputs/).
inline double cudnn_attention_bytes(DType matmul, const Backend::AttentionShape& a) {
  const double NC = double(a.B) * a.T * a.NH * a.hs;
  return 2.0 * (3 + 1 + 3) * NC + (matmul == DType::bf16 ? 0.0 : 2.0 * NC);
}

// The peak of the above together, in bytes, for a micro-batch's products in the order the model runs
// them. The attention's scratch is made at the first attention backward, just before the first call
// marked after_attention (the query-key-value product's backward), and stays: it adds to the slots
// from there on (a plan without such a mark adds it to the slots' final sizes).
// Not counted: the reductions' partial sums and results (a few KiB: norms, clipping, int8 maxima);
// top-k compression's selection scratch is topk_scratch_bytes, which the compression plugin plans.
inline double workspace_bytes(DType matmul, const std::vector<Backend::MatmulCall>& calls,
                              const Backend::AttentionShape& attention) {
  const double elem = static_cast<double>(dtype_size(matmul));
  const double att =
      attention.flash ? 0.0 : 4.0 * static_cast<double>(attention_scratch_floats(attention.NH, attention.T));
  std::array<double, kSlots> have{};
  double peak = 0, made = 0;  // made: the attention's scratch, once it exists
  auto need = [&](Slot slot, DType type, double n) {
    if (type == matmul || n * elem <= have[slot]) return;
    peak = std::max(peak, have[0] + have[1] + have[2] + made + n * elem);
    have[slot] = n * elem;
  };
  for (const Backend::MatmulCall& c : calls) {
    const double NC = double(c.N) * c.C, WC = double(c.OC) * c.C;
    if (c.backward && c.after_attention) made = att;
    if (c.backward) need(kDout, c.dout, double(c.N) * c.OC);
    if (!c.backward) need(kInp, c.inp.type, NC);
    need(kWeight, c.weight.type, WC);
    if (c.backward) need(kInp, c.inp.type, NC);
  }
  peak = std::max(peak, have[0] + have[1] + have[2] + att);
  // The slots only grow, so the staging cuDNN's attention keeps from the first forward adds to the peak.
  const double cudnn = attention.cudnn ? cudnn_attention_bytes(matmul, attention) : 0.0;
  return static_cast<double>(kCublasLtWorkspaceBytes) + peak + cudnn;
}

// Top-k selection's scratch over n elements (per block a histogram and counts: 2 MiB at most),
// Backend::topk_scratch_bytes of the CUDA back end.
inline std::int64_t topk_scratch_bytes(std::int64_t n) {
  return 4 * cuda::topk::scratch_count(cuda::topk::grid_blocks(n));
}

}  // namespace loom::cuda_plan
