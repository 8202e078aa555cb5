#pragma once
// The machine a plan is for (`loom plan`, issue 16): a cluster description, an INI file read like a
// deck (unknown keys, types and ranges refused naming file:line and key), or a preset built in.
//
//   [cluster]                       [network]
//   name, source                    intra_node_gbs, intra_node_latency_us   (per device, one direction)
//   nodes, devices_per_node         inter_node_gbs, inter_node_latency_us
//   device_memory_gib
//   peak_tflops_fp32, peak_tflops_bf16, peak_tflops_fp16   (per device, dense)
//
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
  double intra_bytes_per_s = 0, intra_latency_s = 0, inter_bytes_per_s = 0, inter_latency_s = 0;
  int devices() const { return nodes * devices_per_node; }
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
