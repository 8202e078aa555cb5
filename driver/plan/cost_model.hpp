#pragma once
// The machine a plan is for (`loom plan`): a cluster description, an INI file read like a
// deck (unknown keys, types and ranges refused naming file:line and key), or a preset built in.
//
//   [cluster]                       [network]
//   name, source                    intra_node_gbs, intra_node_latency_us   (per device, one direction)
//   nodes, devices_per_node         inter_node_gbs, inter_node_latency_us
//   device_memory_gib
//   peak_tflops_fp32, peak_tflops_bf16, peak_tflops_fp16   (per device, dense: the matrix products)
//   matmul_efficiency_fp32, _bf16, _fp16   (the products' rate by model width, a share of the peak:
//                      "W:E W:E ..." or one E for every width; MatmulEfficiency below)
//   matmul_call_us     (the fixed cost of one matrix product, a GEMM: its launch or library dispatch)
//   attention_tflops   (per device: the attention kernels, QK^T, softmax, AV and their backward, as loom
//                      runs them: fp32 on the host, TF32 products in a GPU's 16-bit run)
//   attention_head_us  (the fixed cost of attention forward + backward per sequence and head)
//   flash_attention_tflops, flash_attention_head_us   (the same for the fused attention, model.attention
//                      = flash, counted with the same attention_flops; optional: 0 or absent where it was
//                      never measured, and a flash run is then priced at the unfused figures, saying so)
//   memory_gbs         (per device: what a block's element-wise kernels run at, BlockCounts below)
//   optimizer_gbs      (per device: what the optimizer's pass runs at, optimizer_bytes below)
//   sync_wait_share    (a rank's waits for the slowest of its group at synchronisations between its
//                      kernels, as a share of its compute: ranks on shared or noisy cores finish the
//                      same kernels at different times; 0 for dedicated devices)
//   host_gbs           (per device's rank: what the strategies' host passes run at, one host core:
//                      compression's error feedback, quantising, top-k and PowerSGD, replica hashes)
//   host_link_gbs      (per device and direction: copies between the device and its host, PCIe; 0 where
//                      the devices are the host's own cores and nothing is copied)
//
// A step's time is predicted from the counts below, which `loom plan --calibrate` measures the rates
// with, so the prediction uses the very figures the rates were taken with: a block's products
// (block_counts: FLOPs at peak_tflops_<dtype> x matmul_efficiency_<dtype> at the block's width, plus
// matmul_call_us per GEMM), its attention (attention_flops at attention_tflops plus attention_head_us
// per sequence and head), its element-wise kernels (LayerNorm, GELU, residual adds, the backward's
// residual copies: bytes over memory_gbs) and the optimizer's pass over the parameters
// (optimizer_bytes over optimizer_gbs).
// Every key must be given (a plan from a half-described machine would be a guess): a missing one is
// refused naming it; only the fused attention's two are optional (a machine described before it, or
// a GPU whose fused kernels were never timed). `loom plan --calibrate` measures this machine and writes such a file.
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "io/deck.hpp"

namespace loom {

// The presets, name -> text, from driver/plan/presets/<name>.cluster (generated at configure time).
const std::map<std::string, std::string>& cluster_preset_files();

// The matrix products' rate as a share of the peak, by model width (d_model, or d_model / sqrt(tp) for
// a rank's share of a tensor-parallel block, whose products are that much smaller): points (width,
// share) in increasing width, interpolated linearly in log width, the end values held beyond them.
// Text: "64:0.9 128:0.8 512:1" (widths > 0 increasing, shares in (0, 1]) or one share for every width.
struct MatmulEfficiency {
  std::vector<std::pair<double, double>> points = std::vector<std::pair<double, double>>(1, std::make_pair(1.0, 1.0));
  double at(double width) const;
  std::string text() const;
  // "" when `text` is well formed (then *out holds it), else what is allowed.
  static std::string parse(const std::string& text, MatmulEfficiency* out);
};

struct ClusterSpec {
  std::string name, source, origin;  // origin: the file or "preset NAME"
  int nodes = 1, devices_per_node = 1;
  double device_memory_bytes = 0;
  double peak_flops_fp32 = 0, peak_flops_bf16 = 0, peak_flops_fp16 = 0;  // FLOP/s per device
  MatmulEfficiency efficiency_fp32, efficiency_bf16, efficiency_fp16;    // the products' share of it by width
  double matmul_call_s = 0;          // seconds per GEMM call, on top of its FLOPs at the peak
  double attention_flops = 0;        // FLOP/s per device of the attention kernels (attention_flops below)
  double attention_head_s = 0;       // seconds per sequence and head of attention forward + backward
  double flash_attention_flops = 0;  // the same for model.attention = flash; 0: not measured
  double flash_attention_head_s = 0;
  double memory_bytes_per_s = 0;     // B/s per device, a block's element-wise kernels (BlockCounts below)
  double optimizer_bytes_per_s = 0;  // B/s per device, the optimizer's pass (optimizer_bytes below)
  double sync_wait_share = 0;        // waits at in-step synchronisations, a share of the rank's compute
  double host_bytes_per_s = 0;       // B/s, the strategies' host passes (StepPlan::host_bytes)
  double host_link_bytes_per_s = 0;  // B/s per direction, device <-> host copies (0: none, the host is the device)
  double intra_bytes_per_s = 0, intra_latency_s = 0, inter_bytes_per_s = 0, inter_latency_s = 0;
  int devices() const { return nodes * devices_per_node; }
  // FLOP/s of the products of a block `width` wide with `precision` ("fp32", "bf16", "fp16") operands:
  // the peak times its efficiency at that width.
  double matmul_peak(const std::string& precision) const;
  double matmul_rate(const std::string& precision, double width) const;
};

// The FLOPs of one attention forward + backward over [B, T] tokens of width C (all heads): forward
// 4*B*T*T*C (QK^T and AV, 2 FLOPs per multiply-add), backward twice that (dV, dP, dQ, dK). The full
// T x T is counted although attention is causal: loom's unfused kernels compute the full products
// (only the softmax skips the masked half), and the calibration counts the same way, so it cancels
// (model.attention = flash skips the masked tiles and recomputes the scores in its backward: its own
// rate, flash_attention_tflops, is measured with this same count, so that cancels too).
inline double attention_flops(double B, double T, double C) { return 12.0 * B * T * T * C; }

// Bytes moved per element by the element-wise kernels (fp32), for the calibration of memory_gbs and
// the prediction alike. LayerNorm per element of its [N, C] input (the per-row statistics and the
// [C] weights are not counted); the backward counted as read dout and x, write dx (it accumulates
// into dx, a read it does not count: the calibration measures it with the same count).
struct KernelBytes {
  static constexpr double layernorm_fwd = 8;   // read x, write y
  static constexpr double layernorm_bwd = 12;  // read dout and x, write dx
  static constexpr double gelu_fwd = 8;        // read x, write y
  static constexpr double gelu_bwd = 12;       // read x and dout, write dx
  static constexpr double residual = 12;       // read a and b, write out
  static constexpr double copy = 8;            // read, write (the backward's residual branch)
  static constexpr double crossentropy = 20;   // per logit: softmax forward 8, backward 12
  static constexpr double embedding = 20;      // per [N, C] element: forward 8, backward 12
};

// What one transformer block costs per micro-batch of N token rows, C wide, on a rank holding 1/tp of
// it (Nl rows of the element-wise work: N / tp with sequence parallelism, else N), as GPT's
// block_forward / block_backward run it: four products [N,C]x[C,3C/tp], [N,C/tp]x[C/tp,C],
// [N,C]x[C,4C/tp], [N,4C/tp]x[4C/tp,C] (forward one GEMM each, backward two: dinp and dW); two
// LayerNorms and two residual adds forward, GELU over [N, 4C/tp]; backward the LayerNorms', GELU's
// and two copies of the residual branch. Biases are added and summed by kernels that run from cache at
// a multiple of these rates and are not counted (nor by the calibration). `loom plan --calibrate`
// measures peak_tflops_<dtype>, matmul_call_us and memory_gbs by running these very calls.
struct BlockCounts {
  double matmul_flops_fwd = 0, matmul_flops_bwd = 0;  // 2 FLOPs per multiply-add
  double gemms_fwd = 0, gemms_bwd = 0;                // GEMM calls
  double elementwise_bytes_fwd = 0, elementwise_bytes_bwd = 0;
};
inline BlockCounts block_counts(double N, double Nl, double C, double tp) {
  BlockCounts b;
  b.matmul_flops_fwd = 2.0 * N * 12.0 * C * C / tp;
  b.matmul_flops_bwd = 2.0 * b.matmul_flops_fwd;
  b.gemms_fwd = 4;
  b.gemms_bwd = 8;
  using KB = KernelBytes;
  b.elementwise_bytes_fwd = 2 * KB::layernorm_fwd * Nl * C + KB::gelu_fwd * N * 4 * C / tp + 2 * KB::residual * Nl * C;
  b.elementwise_bytes_bwd = 2 * KB::layernorm_bwd * Nl * C + KB::gelu_bwd * N * 4 * C / tp + 2 * KB::copy * Nl * C;
  return b;
}

// Llama's block (model.arch = llama), as GPT::llama_block_forward / _backward run it: seven products
// (q [C,C/tp], k and v [C,CK] with CK the kv width this rank holds, the projection, gate and up
// [C,F/tp], down) forward, fourteen backward; RMSNorm counted as LayerNorm; the rotary gather reads q, k
// and v and writes qkv (8 B per [N,3C/tp] element each way); SwiGLU reads gate and up and writes
// out (12 B per [N,F/tp] element), its backward reads three and writes two (20 B); three adds of
// input gradients of products [N,C] backward.
inline BlockCounts llama_block_counts(double N, double Nl, double C, double tp, double CK, double F) {
  BlockCounts b;
  b.matmul_flops_fwd = 2.0 * N * (2.0 * C * C / tp + 2.0 * C * CK + 3.0 * C * F / tp);
  b.matmul_flops_bwd = 2.0 * b.matmul_flops_fwd;
  b.gemms_fwd = 7;
  b.gemms_bwd = 14;
  using KB = KernelBytes;
  b.elementwise_bytes_fwd =
      2 * KB::layernorm_fwd * Nl * C + 8 * N * 3 * C / tp + 12 * N * F / tp + 2 * KB::residual * Nl * C;
  b.elementwise_bytes_bwd = 2 * KB::layernorm_bwd * Nl * C + 8 * N * 3 * C / tp + 20 * N * F / tp +
                            3 * KB::residual * N * C + 2 * KB::copy * Nl * C;
  return b;
}

// The optimizer's pass per step, as the engine runs it: the gradients zeroed (4 B per gradient element
// held), then per element this rank updates: their squared norm (read 4 B), the clip's scale (read and
// write 4 B each; counted, as the early steps clip) and AdamW (read p, g, m, v; write p, m, v: 28 B).
struct OptimizerBytes {
  static constexpr double zero_grad = 4;  // per gradient element held
  static constexpr double per_owned = 4 + 8 + 28;
};
inline double optimizer_bytes(double grad_elements, double owned_elements) {
  return OptimizerBytes::zero_grad * grad_elements + OptimizerBytes::per_owned * owned_elements;
}

void add_cluster_keys(DeckSchema& schema);
// The rules on one key's value that its range cannot say (a fused-attention rate: 0, not measured, or
// at least 1e-6), refused naming `where`; load_cluster applies them, and --calibrate to its --set.
void check_cluster_values(const Deck& d, const std::string& where);
// The presets' names, and the text of one ("" when there is none of that name).
std::vector<std::string> cluster_presets();
std::string cluster_preset_text(const std::string& name);
// `what`: a file, or a preset's name. `sets`: section.key=value overrides (`--set`).
ClusterSpec load_cluster(const std::string& what, const std::vector<std::string>& sets = {});
// The file that describes `c` (what --calibrate writes; load_cluster reads it back to the same values).
std::string cluster_text(const ClusterSpec& c);
// The machine loom runs on: $LOOM_CLUSTER_FILE, else the calibration file (see calibration_path),
// else "" (no calibration: callers fall back to a preset and say so).
std::string default_cluster_file();
std::string calibration_path();  // $XDG_CONFIG_HOME/loom/cluster.ini, or ~/.config/loom/cluster.ini
std::string describe_cluster(const ClusterSpec& c);

}  // namespace loom
