#include "io/cluster.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <sstream>

#include "core/base/error.hpp"

namespace loom {
namespace {

// Published figures, per device. Link bandwidths per direction; memory_gbs and optimizer_gbs the HBM
// bandwidth (a GPU's element-wise kernels and AdamW are bound by it). attention_tflops and
// flash_attention_tflops measured on an H100 SXM and an H200 (README "On a GPU", LOOM_CUDA_PROFILE
// for bench/gpu.deck, 10 steps: B 16, T 1024, d 768, 12 heads, a bf16 run whose unfused attention
// products are TF32), 12 B T^2 C = 1.546e11 FLOPs per layer over the time per layer: unfused, less
// 192 x attention_head_us, H100 (240.41 + 329.30) ms / 120 -> 35.4 TFLOP/s, H200 (201.95 + 273.50)
// / 120 -> 43.2; fused, whose four launches per layer carry no per-head cost, H100 (90.32 + 263.79)
// / 120 -> 52.4, H200 (89.68 + 260.92) / 120 -> 52.9. The unfused kernels write and read the
// [B, heads, T, T] matrices, so the A100's is the H100's scaled by HBM bandwidth (assumed); the
// fused kernels are bound by their instructions, not memory (Nsight Compute on the H200), and have
// not run on an A100: its preset prices flash as unfused.
// Not published, assumed (and said
// so in `source`): latencies, the order of a small NCCL message on such links; matmul_efficiency, the
// peak at every width (narrow models reach less of it: a calibrated cluster knows); matmul_call_us, one
// kernel launch (a few microseconds); attention_head_us, loom's CUDA attention launching six batched
// products per sequence (its heads together) at a launch each, over a GPT's ~12 heads.
const std::map<std::string, std::string>& presets() {
  static const std::map<std::string, std::string> p = {
      {"a100-80gb", R"([cluster]
name = NVIDIA DGX A100 80GB nodes (8 x A100-SXM4-80GB per node)
source = NVIDIA A100 Tensor Core GPU datasheet (FP32 19.5 TFLOPS, BF16/FP16 312 TFLOPS dense, 80 GB HBM2e at 2039 GB/s, NVLink 600 GB/s bidirectional); attention_tflops scaled by HBM bandwidth from loom's unfused attention measured on an H100 SXM (35.4 TFLOP/s x 2039/3350; a bf16 run, attention's products in TF32); no flash_attention_tflops (the fused kernels have not run on an A100: a flash run is priced as unfused); DGX A100 user guide (one 200 Gb/s HDR InfiniBand NIC per GPU); latencies assumed (typical NCCL small message); matmul_efficiency 1 at every width assumed (no per-width figures published: small models will run below it); matmul_call_us assumed (one kernel launch, ~4 us); attention_head_us assumed (6 launches per sequence shared by ~12 heads); memory_gbs and optimizer_gbs at the HBM bandwidth (element-wise kernels and AdamW are memory-bound on a GPU); sync_wait_share 0 assumed (a GPU runs a kernel in the same time on every device); host_link_gbs the datasheet's PCIe Gen4 x16 (64 GB/s both directions; a peak, which loom's copies from pageable host memory will not reach); host_gbs assumed (one host core streaming, which loom's host passes run on)
nodes = 4
devices_per_node = 8
device_memory_gib = 80
peak_tflops_fp32 = 19.5
peak_tflops_bf16 = 312
peak_tflops_fp16 = 312
matmul_efficiency_fp32 = 1
matmul_efficiency_bf16 = 1
matmul_efficiency_fp16 = 1
matmul_call_us = 4
attention_tflops = 21.5
attention_head_us = 2
memory_gbs = 2039
optimizer_gbs = 2039
sync_wait_share = 0
host_gbs = 10
host_link_gbs = 32
[network]
intra_node_gbs = 300
intra_node_latency_us = 3
inter_node_gbs = 25
inter_node_latency_us = 8
)"},
      {"h100-sxm", R"([cluster]
name = NVIDIA DGX H100 nodes (8 x H100-SXM5-80GB per node)
source = NVIDIA H100 Tensor Core GPU datasheet (SXM5: FP32 67 TFLOPS, BF16/FP16 989 TFLOPS dense, 80 GB HBM3 at 3350 GB/s, NVLink 900 GB/s bidirectional); attention_tflops and flash_attention_tflops measured: loom's attention on an H100 SXM (bench/gpu.deck, LOOM_CUDA_PROFILE: forward + backward per layer at B 16, T 1024, d 768, 12 heads, a bf16 run: unfused 4.75 ms, its products in TF32; fused 2.95 ms, bf16 products); DGX H100 user guide (one 400 Gb/s NDR InfiniBand NIC per GPU); latencies assumed (typical NCCL small message); matmul_efficiency 1 at every width assumed (no per-width figures published: small models will run below it); matmul_call_us assumed (one kernel launch, ~4 us); attention_head_us assumed (6 launches per sequence shared by ~12 heads); memory_gbs and optimizer_gbs at the HBM bandwidth (element-wise kernels and AdamW are memory-bound on a GPU); sync_wait_share 0 assumed (a GPU runs a kernel in the same time on every device); host_link_gbs the datasheet's PCIe Gen5 x16 (128 GB/s both directions; a peak, which loom's copies from pageable host memory will not reach); host_gbs assumed (one host core streaming, which loom's host passes run on)
nodes = 4
devices_per_node = 8
device_memory_gib = 80
peak_tflops_fp32 = 67
peak_tflops_bf16 = 989
peak_tflops_fp16 = 989
matmul_efficiency_fp32 = 1
matmul_efficiency_bf16 = 1
matmul_efficiency_fp16 = 1
matmul_call_us = 4
attention_tflops = 35.4
attention_head_us = 2
flash_attention_tflops = 52.4
flash_attention_head_us = 0
memory_gbs = 3350
optimizer_gbs = 3350
sync_wait_share = 0
host_gbs = 10
host_link_gbs = 64
[network]
intra_node_gbs = 450
intra_node_latency_us = 3
inter_node_gbs = 50
inter_node_latency_us = 8
)"},
      {"h200", R"([cluster]
name = NVIDIA DGX H200 nodes (8 x H200-SXM-141GB per node)
source = NVIDIA H200 Tensor Core GPU datasheet (SXM: FP32 67 TFLOPS, BF16/FP16 989 TFLOPS dense, 141 GB HBM3e at 4800 GB/s, NVLink 900 GB/s bidirectional); attention_tflops and flash_attention_tflops measured: loom's attention on an H200 (bench/gpu.deck, LOOM_CUDA_PROFILE: forward + backward per layer at B 16, T 1024, d 768, 12 heads, a bf16 run: unfused 3.96 ms, its products in TF32; fused 2.92 ms, bf16 products); DGX H200 (one 400 Gb/s NDR InfiniBand NIC per GPU); latencies assumed (typical NCCL small message); matmul_efficiency 1 at every width assumed (no per-width figures published: small models will run below it); matmul_call_us assumed (one kernel launch, ~4 us); attention_head_us assumed (6 launches per sequence shared by ~12 heads); memory_gbs and optimizer_gbs at the HBM bandwidth (element-wise kernels and AdamW are memory-bound on a GPU); sync_wait_share 0 assumed (a GPU runs a kernel in the same time on every device); host_link_gbs the datasheet's PCIe Gen5 x16 (128 GB/s both directions; a peak, which loom's copies from pageable host memory will not reach); host_gbs assumed (one host core streaming, which loom's host passes run on)
nodes = 4
devices_per_node = 8
device_memory_gib = 141
peak_tflops_fp32 = 67
peak_tflops_bf16 = 989
peak_tflops_fp16 = 989
matmul_efficiency_fp32 = 1
matmul_efficiency_bf16 = 1
matmul_efficiency_fp16 = 1
matmul_call_us = 4
attention_tflops = 43.2
attention_head_us = 2
flash_attention_tflops = 52.9
flash_attention_head_us = 0
memory_gbs = 4800
optimizer_gbs = 4800
sync_wait_share = 0
host_gbs = 10
host_link_gbs = 64
[network]
intra_node_gbs = 450
intra_node_latency_us = 3
inter_node_gbs = 50
inter_node_latency_us = 8
)"},
  };
  return p;
}

const char* const kRequired[] = {"cluster.nodes", "cluster.devices_per_node", "cluster.device_memory_gib",
                                 "cluster.peak_tflops_fp32", "cluster.peak_tflops_bf16", "cluster.peak_tflops_fp16",
                                 "cluster.matmul_efficiency_fp32", "cluster.matmul_efficiency_bf16",
                                 "cluster.matmul_efficiency_fp16", "cluster.matmul_call_us", "cluster.attention_tflops", "cluster.attention_head_us",
                                 "cluster.memory_gbs", "cluster.optimizer_gbs", "cluster.sync_wait_share",
                                 "cluster.host_gbs", "cluster.host_link_gbs",
                                 "network.intra_node_gbs", "network.intra_node_latency_us", "network.inter_node_gbs",
                                 "network.inter_node_latency_us"};

}  // namespace

// Defaults exist only because a schema needs them: every key must be given (load_cluster refuses a
// file that leaves one out) but the fused attention's two, whose 0 means not measured.
void add_cluster_keys(DeckSchema& schema) {
  schema.add(string_key("cluster.name", "", "what the machine is"));
  schema.add(string_key("cluster.source", "", "where the figures come from (datasheet, or loom plan --calibrate)"));
  schema.add(int_key("cluster.nodes", "1", 1, 1e6, "nodes"));
  schema.add(int_key("cluster.devices_per_node", "1", 1, 1024, "devices (GPUs, or ranks on a CPU) per node"));
  schema.add(float_key("cluster.device_memory_gib", "1", 0.001, 1e6, "memory per device, GiB"));
  schema.add(float_key("cluster.peak_tflops_fp32", "1", 1e-6, 1e6, "fp32 matrix-product rate per device, TFLOP/s"));
  schema.add(float_key("cluster.peak_tflops_bf16", "1", 1e-6, 1e6, "bf16 matrix-product rate per device, TFLOP/s"));
  schema.add(float_key("cluster.peak_tflops_fp16", "1", 1e-6, 1e6, "fp16 matrix-product rate per device, TFLOP/s"));
  const auto efficiency = [](const std::string& v) { return MatmulEfficiency::parse(v, nullptr); };
  for (const char* t : {"fp32", "bf16", "fp16"})
    schema.add(string_key(std::string("cluster.matmul_efficiency_") + t, "1",
                          std::string("the ") + t + " products' rate as a share of peak_tflops_" + t +
                              " by model width: W:E pairs in increasing width (interpolated in log width), or one "
                              "share for every width",
                          efficiency));
  schema.add(float_key("cluster.matmul_call_us", "0", 0, 1e6,
                       "fixed cost of one matrix product (a GEMM's launch or library dispatch), microseconds"));
  schema.add(float_key("cluster.attention_tflops", "1", 1e-6, 1e6,
                       "attention kernels' rate per device (QK^T, softmax, AV and their backward, as loom runs them), TFLOP/s"));
  schema.add(float_key("cluster.attention_head_us", "0", 0, 1e6,
                       "fixed cost of attention forward + backward per sequence and head, microseconds"));
  schema.add(float_key("cluster.flash_attention_tflops", "0", 0, 1e6,
                       "the fused attention's rate per device (model.attention = flash), TFLOP/s counted as "
                       "attention_tflops counts them; optional: 0 where not measured (a flash run is then priced "
                       "at attention_tflops)"));
  schema.add(float_key("cluster.flash_attention_head_us", "0", 0, 1e6,
                       "the fused attention's fixed cost per sequence and head, microseconds; optional"));
  schema.add(float_key("cluster.memory_gbs", "1", 1e-6, 1e6,
                       "what a block's element-wise kernels (LayerNorm, GELU, residual adds) run at per device, GB/s"));
  schema.add(float_key("cluster.optimizer_gbs", "1", 1e-6, 1e6,
                       "what the optimizer's pass (gradient zeroing, norm, clip, AdamW) runs at per device, GB/s"));
  schema.add(float_key("cluster.sync_wait_share", "0", 0, 10,
                       "a rank's wait for the slowest of its group at the synchronisations between its kernels "
                       "(tensor-parallel collectives, pipeline sends, ZeRO-3's gathers), as a share of its compute: "
                       "0 where devices run a kernel in the same time every time"));
  schema.add(float_key("cluster.host_gbs", "1", 1e-6, 1e6,
                       "what the strategies' host passes (compression's error feedback, quantising, top-k, "
                       "PowerSGD; replica hashes) run at per device's rank, GB/s: one host core"));
  schema.add(float_key("cluster.host_link_gbs", "0", 0, 1e6,
                       "copies between a device and its host (PCIe), GB/s per direction; 0 where the devices are "
                       "the host's own cores (nothing is copied, and those cores copy the messages inside a node "
                       "themselves: none hides behind compute)"));
  schema.add(float_key("network.intra_node_gbs", "1", 1e-6, 1e6, "bandwidth between devices of a node, GB/s per device and direction"));
  schema.add(float_key("network.intra_node_latency_us", "0", 0, 1e6, "latency of a message inside a node, microseconds"));
  schema.add(float_key("network.inter_node_gbs", "1", 1e-6, 1e6, "bandwidth between nodes, GB/s per device and direction"));
  schema.add(float_key("network.inter_node_latency_us", "0", 0, 1e6, "latency of a message between nodes, microseconds"));
}

double MatmulEfficiency::at(double width) const {
  if (points.empty()) return 1.0;
  if (width <= points.front().first) return points.front().second;
  if (width >= points.back().first) return points.back().second;
  for (std::size_t i = 1; i < points.size(); ++i)
    if (width <= points[i].first) {
      const auto& [w0, e0] = points[i - 1];
      const auto& [w1, e1] = points[i];
      const double f = std::log(width / w0) / std::log(w1 / w0);
      return e0 + f * (e1 - e0);
    }
  return points.back().second;
}

std::string MatmulEfficiency::text() const {
  std::ostringstream o;
  o << std::setprecision(4);
  if (points.size() == 1 && points[0].first == 1.0) {
    o << points[0].second;
    return o.str();
  }
  for (std::size_t i = 0; i < points.size(); ++i) o << (i ? " " : "") << points[i].first << ":" << points[i].second;
  return o.str();
}

std::string MatmulEfficiency::parse(const std::string& text, MatmulEfficiency* out) {
  const std::string allowed = "one share in (0, 1], or WIDTH:SHARE pairs, widths increasing, shares in (0, 1]";
  MatmulEfficiency e;
  e.points.clear();
  std::istringstream in(text);
  std::string word;
  while (in >> word) {
    const std::size_t colon = word.find(':');
    double w = 1.0, share = 0;
    try {
      std::size_t used = 0;
      if (colon == std::string::npos) {
        share = std::stod(word, &used);
        if (used != word.size()) return allowed;
      } else {
        w = std::stod(word.substr(0, colon), &used);
        if (used != colon) return allowed;
        const std::string rest = word.substr(colon + 1);
        share = std::stod(rest, &used);
        if (used != rest.size()) return allowed;
      }
    } catch (const std::exception&) {
      return allowed;
    }
    if ((colon == std::string::npos && !e.points.empty()) || !(share > 0 && share <= 1) || !(w > 0 && std::isfinite(w)))
      return allowed;
    if (colon == std::string::npos) {
      e.points.push_back({1.0, share});
      if (in >> word) return allowed;  // one share stands alone
      break;
    }
    if (!e.points.empty() && w <= e.points.back().first) return allowed;
    e.points.push_back({w, share});
  }
  if (e.points.empty()) return allowed;
  if (out) *out = e;
  return "";
}

double ClusterSpec::matmul_peak(const std::string& precision) const {
  if (precision == "bf16") return peak_flops_bf16;
  if (precision == "fp16") return peak_flops_fp16;
  return peak_flops_fp32;
}

double ClusterSpec::matmul_rate(const std::string& precision, double width) const {
  const MatmulEfficiency& e = precision == "bf16" ? efficiency_bf16 : precision == "fp16" ? efficiency_fp16 : efficiency_fp32;
  return matmul_peak(precision) * e.at(width);
}

std::vector<std::string> cluster_presets() {
  std::vector<std::string> n;
  for (const auto& [k, v] : presets()) n.push_back(k);
  return n;
}

std::string cluster_preset_text(const std::string& name) {
  const auto it = presets().find(name);
  return it == presets().end() ? "" : it->second;
}

void check_cluster_values(const Deck& d, const std::string& where) {
  // 0 says "not measured"; a measured rate has attention_tflops' range (a rate of 1e-320 would price
  // a step at infinity).
  if (const double t = d.get_float("cluster.flash_attention_tflops"); t != 0 && t < 1e-6)
    throw InputError(where + ": cluster.flash_attention_tflops = " + d.values().at("cluster.flash_attention_tflops") +
                     " (valid: 0, not measured, or 1e-06 to 1e+06 TFLOP/s)");
}

ClusterSpec load_cluster(const std::string& what, const std::vector<std::string>& sets) {
  DeckSchema schema;
  add_cluster_keys(schema);
  const std::string preset = cluster_preset_text(what);
  std::error_code ec;
  if (preset.empty() && !std::filesystem::exists(what, ec)) {
    std::string names;
    for (const auto& n : cluster_presets()) names += (names.empty() ? "" : ", ") + n;
    throw InputError("--cluster " + quote_path(what) + ": no such file, and not a preset (presets: " + names + ")");
  }
  // What the deck reader would call a deck: said as the cluster file it is.
  if (preset.empty() && std::filesystem::is_directory(what, ec))
    throw InputError("--cluster " + quote_path(what) + ": is a directory, not a cluster file (or a preset)");
  if (preset.empty() && std::filesystem::is_regular_file(what, ec) && std::filesystem::file_size(what, ec) == 0)
    throw InputError("cluster file " + quote_path(what) + ": is empty (0 bytes); a cluster description gives every key "
                     "(loom plan --cluster-keys lists them)");
  const Deck d = preset.empty() ? load_deck(schema, what, sets) : parse_deck(schema, preset, "preset " + what, sets);
  const std::string where = preset.empty() ? "cluster file " + quote_path(what) : "cluster preset " + what;
  for (const char* key : kRequired)
    if (d.is_default(key))
      throw InputError(where + ": " + key + " is missing (every key of a cluster description must be given; `loom plan "
                       "--cluster-keys` lists them)");
  ClusterSpec c;
  c.origin = preset.empty() ? what : "preset " + what;
  c.name = d.get_string("cluster.name");
  c.source = d.get_string("cluster.source");
  c.nodes = static_cast<int>(d.get_int("cluster.nodes"));
  c.devices_per_node = static_cast<int>(d.get_int("cluster.devices_per_node"));
  c.device_memory_bytes = d.get_float("cluster.device_memory_gib") * 1073741824.0;
  c.peak_flops_fp32 = d.get_float("cluster.peak_tflops_fp32") * 1e12;
  c.peak_flops_bf16 = d.get_float("cluster.peak_tflops_bf16") * 1e12;
  c.peak_flops_fp16 = d.get_float("cluster.peak_tflops_fp16") * 1e12;
  MatmulEfficiency::parse(d.get_string("cluster.matmul_efficiency_fp32"), &c.efficiency_fp32);
  MatmulEfficiency::parse(d.get_string("cluster.matmul_efficiency_bf16"), &c.efficiency_bf16);
  MatmulEfficiency::parse(d.get_string("cluster.matmul_efficiency_fp16"), &c.efficiency_fp16);
  c.matmul_call_s = d.get_float("cluster.matmul_call_us") * 1e-6;
  c.attention_flops = d.get_float("cluster.attention_tflops") * 1e12;
  c.attention_head_s = d.get_float("cluster.attention_head_us") * 1e-6;
  c.flash_attention_flops = d.get_float("cluster.flash_attention_tflops") * 1e12;
  c.flash_attention_head_s = d.get_float("cluster.flash_attention_head_us") * 1e-6;
  c.memory_bytes_per_s = d.get_float("cluster.memory_gbs") * 1e9;
  c.optimizer_bytes_per_s = d.get_float("cluster.optimizer_gbs") * 1e9;
  c.sync_wait_share = d.get_float("cluster.sync_wait_share");
  c.host_bytes_per_s = d.get_float("cluster.host_gbs") * 1e9;
  c.host_link_bytes_per_s = d.get_float("cluster.host_link_gbs") * 1e9;
  c.intra_bytes_per_s = d.get_float("network.intra_node_gbs") * 1e9;
  c.intra_latency_s = d.get_float("network.intra_node_latency_us") * 1e-6;
  c.inter_bytes_per_s = d.get_float("network.inter_node_gbs") * 1e9;
  c.inter_latency_s = d.get_float("network.inter_node_latency_us") * 1e-6;
  check_cluster_values(d, where);
  if (c.flash_attention_head_s > 0 && c.flash_attention_flops <= 0)
    throw InputError(where + ": cluster.flash_attention_head_us = " + d.values().at("cluster.flash_attention_head_us") +
                     " without cluster.flash_attention_tflops (give both, or neither: a flash run is then priced as "
                     "the unfused attention)");
  // Impossible together, though each is in range: a node's own links slower than the ones between nodes.
  if (c.nodes > 1 && c.intra_bytes_per_s < c.inter_bytes_per_s)
    throw InputError(where + ": network.intra_node_gbs = " + d.values().at("network.intra_node_gbs") +
                     " is below network.inter_node_gbs = " + d.values().at("network.inter_node_gbs") +
                     " (links inside a node are the faster ones; swapped?)");
  return c;
}

std::string cluster_text(const ClusterSpec& c) {
  std::ostringstream o;
  o << std::setprecision(6);
  o << "[cluster]\nname = " << c.name << "\nsource = " << c.source << "\nnodes = " << c.nodes
    << "\ndevices_per_node = " << c.devices_per_node << "\ndevice_memory_gib = " << c.device_memory_bytes / 1073741824.0
    << "\npeak_tflops_fp32 = " << c.peak_flops_fp32 / 1e12 << "\npeak_tflops_bf16 = " << c.peak_flops_bf16 / 1e12
    << "\npeak_tflops_fp16 = " << c.peak_flops_fp16 / 1e12 << "\nmatmul_efficiency_fp32 = " << c.efficiency_fp32.text()
    << "\nmatmul_efficiency_bf16 = " << c.efficiency_bf16.text() << "\nmatmul_efficiency_fp16 = " << c.efficiency_fp16.text()
    << "\nmatmul_call_us = " << c.matmul_call_s * 1e6
    << "\nattention_tflops = " << c.attention_flops / 1e12 << "\nattention_head_us = " << c.attention_head_s * 1e6
    << "\nflash_attention_tflops = " << c.flash_attention_flops / 1e12
    << "\nflash_attention_head_us = " << c.flash_attention_head_s * 1e6
    << "\nmemory_gbs = " << c.memory_bytes_per_s / 1e9 << "\noptimizer_gbs = " << c.optimizer_bytes_per_s / 1e9
    << "\nsync_wait_share = " << c.sync_wait_share << "\nhost_gbs = " << c.host_bytes_per_s / 1e9
    << "\nhost_link_gbs = " << c.host_link_bytes_per_s / 1e9
    << "\n[network]\nintra_node_gbs = " << c.intra_bytes_per_s / 1e9
    << "\nintra_node_latency_us = " << c.intra_latency_s * 1e6 << "\ninter_node_gbs = " << c.inter_bytes_per_s / 1e9
    << "\ninter_node_latency_us = " << c.inter_latency_s * 1e6 << "\n";
  return o.str();
}

std::string calibration_path() {
  const char* xdg = std::getenv("XDG_CONFIG_HOME");
  const char* home = std::getenv("HOME");
  const std::string base = xdg && *xdg ? xdg : std::string(home && *home ? home : ".") + "/.config";
  return base + "/loom/cluster.ini";
}

std::string default_cluster_file() {
  const char* env = std::getenv("LOOM_CLUSTER_FILE");
  if (env && *env) return env;
  std::error_code ec;
  const std::string cal = calibration_path();
  return std::filesystem::exists(cal, ec) ? cal : "";
}

std::string describe_cluster(const ClusterSpec& c) {
  std::ostringstream o;
  o << std::setprecision(4);
  o << "cluster: " << c.name << " (" << c.origin << ")\n"
    << "  " << c.nodes << " node(s) x " << c.devices_per_node << " device(s) = " << c.devices() << " devices, "
    << c.device_memory_bytes / 1073741824.0 << " GiB each\n"
    << "  peak per device: fp32 " << c.peak_flops_fp32 / 1e12 << ", bf16 " << c.peak_flops_bf16 / 1e12 << ", fp16 "
    << c.peak_flops_fp16 / 1e12 << " TFLOP/s (matrix products), " << c.matmul_call_s * 1e6 << " us per product call\n"
    << "  share of the peak by model width: fp32 " << c.efficiency_fp32.text() << "; bf16 " << c.efficiency_bf16.text()
    << "; fp16 " << c.efficiency_fp16.text() << "\n"
    << "  attention " << c.attention_flops / 1e12 << " TFLOP/s + " << c.attention_head_s * 1e6
    << " us per sequence and head; fused attention (model.attention = flash) ";
  if (c.flash_attention_flops > 0)
    o << c.flash_attention_flops / 1e12 << " TFLOP/s + " << c.flash_attention_head_s * 1e6 << " us per sequence and head";
  else
    o << "not measured (priced as the unfused)";
  o << "; memory " << c.memory_bytes_per_s / 1e9 << " GB/s (element-wise kernels), optimizer "
    << c.optimizer_bytes_per_s / 1e9 << " GB/s, per device; waits at synchronisations "
    << 100.0 * c.sync_wait_share << "% of compute\n"
    << "  strategies' host passes " << c.host_bytes_per_s / 1e9 << " GB/s; device <-> host copies ";
  if (c.host_link_bytes_per_s > 0)
    o << c.host_link_bytes_per_s / 1e9 << " GB/s per direction\n";
  else
    o << "none (the devices are the host)\n";
  o << "  inside a node: " << c.intra_bytes_per_s / 1e9 << " GB/s, " << c.intra_latency_s * 1e6 << " us; between nodes: "
    << c.inter_bytes_per_s / 1e9 << " GB/s, " << c.inter_latency_s * 1e6 << " us\n"
    << "  source: " << c.source << "\n";
  return o.str();
}

}  // namespace loom
