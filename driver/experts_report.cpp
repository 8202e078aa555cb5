#include "driver/experts_report.hpp"

#include <algorithm>
#include <cstdio>
#include <map>

namespace loom {

ExpertsStep gather_experts_step(Communicator& world, GPT& model) {
  ExpertsStep out;
  const GPTConfig& cfg = model.config();
  if (cfg.experts <= 0) return out;
  const GPT::MoeStats& st = model.moe_stats();
  std::vector<double> v = st.routed;
  v.insert(v.end(), {st.dropped, st.assignments, st.aux, st.z, st.calls});
  world.all_reduce(v.data(), static_cast<std::int64_t>(v.size()));
  model.reset_moe_stats();
  const std::size_t LE = st.routed.size(), E = static_cast<std::size_t>(cfg.experts);
  const double calls = v[LE + 4];
  if (calls <= 0) return out;  // a pipeline's stages all report, but a step with no training forward has none
  double max_share = 0;
  out.load = nlohmann::json::array();
  for (int l = 0; l < cfg.layers; ++l) {
    if (!cfg.moe_layer(l)) continue;
    double total = 0;
    for (std::size_t e = 0; e < E; ++e) total += v[static_cast<std::size_t>(l) * E + e];
    nlohmann::json row = nlohmann::json::array();
    for (std::size_t e = 0; e < E; ++e) {
      const double share = total > 0 ? v[static_cast<std::size_t>(l) * E + e] / total : 0.0;
      row.push_back(share);
      max_share = std::max(max_share, share);
    }
    out.load.push_back(row);
  }
  out.scalars = {{"moe_aux", v[LE + 2] / calls},
                 {"moe_z", v[LE + 3] / calls},
                 {"moe_dropped", v[LE + 1] > 0 ? v[LE] / v[LE + 1] : 0.0},
                 {"moe_load_max", max_share * static_cast<double>(E)}};
  return out;
}

std::string experts_step_line(const ExpertsStep& e) {
  if (!e.on()) return "";
  std::map<std::string, double> m(e.scalars.begin(), e.scalars.end());
  char line[160];
  std::snprintf(line, sizeof line, " | moe aux %.3f z %.3g drop %.1f%% max load %.2fx", m["moe_aux"], m["moe_z"],
                100.0 * m["moe_dropped"], m["moe_load_max"]);
  return line;
}

std::vector<std::string> experts_summary_lines(const GPTConfig& cfg, const ExpertSplit& experts,
                                               const std::map<std::string, double>& means,
                                               const nlohmann::json& last_load, double step_s) {
  std::vector<std::string> lines;
  if (cfg.experts <= 0 || !means.count("moe_aux")) return lines;
  char line[320];
  std::snprintf(line, sizeof line,
                "experts: %d per block in %d of %d blocks, top-%d, %s; mean over steps: load-balancing loss %.4f "
                "(1 = balanced), z-loss %.4g, %.2f%% of assignments dropped, busiest expert %.2fx its fair share",
                cfg.experts, cfg.moe_layers(), cfg.layers, cfg.top_k(),
                cfg.expert_capacity > 0
                    ? ("capacity factor " + std::to_string(cfg.expert_capacity).substr(0, 4)).c_str()
                    : "dropless",
                means.at("moe_aux"), means.at("moe_z"), 100.0 * means.at("moe_dropped"), means.at("moe_load_max"));
  lines.push_back(line);
  for (const std::string& l : experts.summary_lines(means, step_s)) lines.push_back(l);
  int b = 0;
  for (int l = 0; l < cfg.layers && b < static_cast<int>(last_load.size()); ++l) {
    if (!cfg.moe_layer(l)) continue;
    std::string row = "  block " + std::to_string(l) + " load (last step, share of assignments):";
    for (const auto& s : last_load[static_cast<std::size_t>(b)]) {
      std::snprintf(line, sizeof line, " %.3f", s.get<double>());
      row += line;
    }
    lines.push_back(row);
    ++b;
  }
  return lines;
}

}  // namespace loom
