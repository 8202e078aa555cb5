#pragma once
// The machine a plan is for (`loom plan`, issue 16): a cluster description, an INI file read like a
// deck (unknown keys, types and ranges refused naming file:line and key), or a preset built in.
//
//   [cluster]                       [network]
//   name, source                    intra_node_gbs, intra_node_latency_us   (per device, one direction)
//   nodes, devices_per_node         inter_node_gbs, inter_node_latency_us
//   device_memory_gib
//   peak_tflops_fp32, peak_tflops_bf16, peak_tflops_fp16   (per device, dense: the matrix products)
//   attention_tflops   (per device: the attention kernels, QK^T, softmax, AV and their backward, fp32)
//   memory_gbs         (per device: memory bandwidth, what the element-wise kernels are bound by)
//
// A step's time is predicted as its matrix products at peak_tflops_<dtype>, its attention at
// attention_tflops (FLOPs counted by attention_flops below) and its other kernels (LayerNorm, GELU,
// residual adds, bias, cross-entropy, AdamW) as bytes moved (KernelBytes below) over memory_gbs.
// `loom plan --calibrate` measures these with the same counts, so the prediction uses the very
// figures the rates were taken with.
// Every key must be given (a plan from a half-described machine would be a guess): a missing one is
// refused naming it. `loom plan --calibrate` measures this machine and writes such a file.
#include <string>
#include <vector>

#include "io/deck.hpp"

namespace loom {

struct ClusterSpec {
  std::string name, source, origin;  // origin: the file or "preset NAME"
  int nodes = 1, devices_per_node = 1;
  double device_memory_bytes = 0;
  double peak_flops_fp32 = 0, peak_flops_bf16 = 0, peak_flops_fp16 = 0;  // FLOP/s per device
  double attention_flops = 0;     // FLOP/s per device of the attention kernels (attention_flops below)
  double memory_bytes_per_s = 0;  // B/s per device, element-wise kernels (KernelBytes below)
  double intra_bytes_per_s = 0, intra_latency_s = 0, inter_bytes_per_s = 0, inter_latency_s = 0;
  int devices() const { return nodes * devices_per_node; }
};

// The FLOPs of one attention forward + backward over [B, T] tokens of width C (all heads): forward
// 4*B*T*T*C (QK^T and AV, 2 FLOPs per multiply-add), backward twice that (dV, dP, dQ, dK). The full
// T x T is counted although attention is causal: loom's kernels compute the full products (only the
// softmax skips the masked half), and the calibration counts the same way, so it cancels.
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
};

void add_cluster_keys(DeckSchema& schema);
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
