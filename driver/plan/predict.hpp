#pragma once
// `loom plan DECK`: a deck's memory per rank and step time on a described machine, before
// the job runs. Memory: every rank of the layout is built for real on a back end that only counts
// (core/comm/step_plan.hpp); step time: the rates of the cluster description (driver/plan/cost_model.hpp).
#include <array>
#include <string>
#include <vector>

#include "core/base/ledger.hpp"
#include "core/engine/plugin.hpp"
#include "core/comm/step_plan.hpp"
#include "driver/session.hpp"
#include "driver/plan/cost_model.hpp"

namespace loom {

struct RankPrediction {
  int rank = 0, dp_rank = 0, tp_rank = 0, pp_rank = 0, cp_rank = 0;
  std::array<double, kMemCategories> built{}, scratch{}, peak{};  // bytes; peak = built + scratch
  double total = 0;
  std::int64_t params_held = 0;  // parameter elements on this rank
  int layers = 0;                // blocks on this rank's pipeline stage
  bool first = true, last = true, sequence_parallel = false;
  std::string precision;  // the products' operand type
  int state_parts_split =
      0;          // how many of weights, gradients, optimizer state the dp ranks split (GradSync::state_sharding)
  StepPlan step;  // its step's scratch, messages, pipeline replay (stage_units, pipeline_span)
};

struct TimePrediction {
  double compute_s = 0, matmul_s = 0, attention_s = 0, elementwise_s = 0, optimizer_s = 0;
  double strategies_s = 0;  // the strategies' own host passes (StepPlan::host_bytes), their copies (host_copy_bytes),
                            // their back-end passes (backend_bytes)
  double comm_s = 0, comm_exposed_s = 0;  // all of it, and what does not hide behind compute
  // Context parallelism: the ring's key/value block transfers, and the attention compute they hide behind.
  double ring_s = 0, ring_hidden_behind_s = 0;
  double sync_wait_s = 0;  // waits for the slowest rank of a group at in-step synchronisations
  double bubble = 0, step_s = 0, tokens_per_s = 0, mfu = 0;
  std::vector<double> stage_busy_s;  // per pipeline stage, its slowest rank's forward + backward compute
  std::vector<double> stage_units;   // per stage, its work in the replay's units (StepPlan::stage_units)
  double pipeline_span_s = 0;        // the schedule's replay at those times (0 without a pipeline)
  std::vector<std::pair<std::string, double>> comm_by_group;          // seconds per group
  std::vector<std::pair<std::string, double>> comm_exposed_by_group;  // of which not hidden, per group
  std::vector<std::pair<std::string, double>> comm_bytes_by_group;    // bytes the rank sends a step, per group
};

struct Prediction {
  LayoutPlan plan;
  std::string backend = "host";  // the back end whose memory is planned (planned_backend)
  std::string precision = "fp32";
  int zero_stage =
      0;  // the parts of the model state the dp ranks split: ZeRO's stage (RankPrediction::state_parts_split)
  std::int64_t steps = 0;  // the deck's train.steps: the run's time is steps x step
  std::vector<RankPrediction> ranks;
  std::array<double, kMemCategories> peak{};  // the largest over ranks, per category
  double peak_total = 0;                      // the largest rank's total
  int worst_rank = 0;
  const RankPrediction& worst() const {
    for (const RankPrediction& r : ranks)
      if (r.rank == worst_rank) return r;
    return ranks.front();
  }
  TimePrediction time;
};

// Whether a group's ring stays inside a node: ranks are placed tp fastest, then dp, then pp,
// per_node consecutive ranks to a node, so a group spanning at most per_node ranks does.
bool group_in_node(const std::string& group, const Layout& layout, int per_node);
// Whether a message hides behind compute: it overlaps (CommCost::overlapped), unless the devices are
// the host's cores (host_link_gbs 0, a calibrated host) and it stays inside a node, where those cores
// copy it through shared memory themselves, inside loom's communication calls.
bool comm_hides(const CommCost& k, const Layout& layout, const ClusterSpec& cluster);

// The back end a run of `deck` on `cluster` takes, whose workspace and communicators' memory the plan
// counts: run.backend = cuda, or auto on a cluster of GPUs (host_link_gbs > 0), is "cuda"; else "host".
std::string planned_backend(const Deck& deck, const ClusterSpec& cluster);
// Predicts `deck` (its own layout) on `cluster`. Throws InputError for a layout that cannot run.
// every_rank = false (the layout search): only the first and last rank of each tp and dp group on
// every pipeline stage are built, the others being alike.
Prediction predict(const Deck& deck, const StrategyRegistry& registry, const ClusterSpec& cluster,
                   bool every_rank = true);

// Memory only (no time), on `backend` ("host" or "cuda"), devices_per_node ranks to a node: the ranks
// listed (each built), or without a list those the search builds (first and last of each tp and dp
// group on every stage). What `loom run` and `loom check` compare with the memory here
// (driver/memory_check.cpp).
Prediction predict_memory(const Deck& deck, const StrategyRegistry& registry, const std::string& backend,
                          int devices_per_node, const std::vector<int>& ranks = {});

// Whether a run of `model` is priced at the cluster's fused-attention rate: model.attention = flash
// on a cluster that measured it (else as the unfused kernels).
bool priced_as_flash(const GPTConfig& model, const ClusterSpec& cluster);

// The JSON of `--json`: mem_peak_bytes keyed like summary.json (the largest rank's), by rank, step_ms.
std::string prediction_json(const Prediction& p, const ClusterSpec& cluster);
// The human table of one prediction.
std::string describe_prediction(const Prediction& p, const ClusterSpec& cluster);

}  // namespace loom
