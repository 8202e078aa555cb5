#pragma once
// What the experts did in a step (model.experts; DESIGN.md "Mixture of experts"): every rank's routed
// counts and auxiliary losses summed over the world, as shares and means (tp ranks route the same
// tokens: counted tp times over, which ratios cancel), for the step line, metrics.jsonl and the summary.
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/comm/comm.hpp"
#include "core/model/gpt.hpp"

namespace loom {

struct ExpertsStep {
  std::vector<std::pair<std::string, double>> scalars;  // moe_aux, moe_z, moe_dropped, moe_load_max
  nlohmann::json load;  // [expert blocks][experts]: each expert's share of its block's assignments
  bool on() const { return !scalars.empty(); }
};

// Collective over `world` when the model has experts (else returns nothing, communicating nothing);
// resets the model's counts.
ExpertsStep gather_experts_step(Communicator& world, GPT& model);
// " | moe aux 1.003 z 0.41 drop 1.2% max load 1.35x"
std::string experts_step_line(const ExpertsStep& e);
// The summary's lines from the run's means of the scalars and the last step's load, with the experts
// role's own (ExpertSplit::summary_lines: expert parallelism's all-to-all against a step of `step_s`).
std::vector<std::string> experts_summary_lines(const GPTConfig& cfg, const ExpertSplit& experts,
                                               const std::map<std::string, double>& means,
                                               const nlohmann::json& last_load, double step_s);

}  // namespace loom
