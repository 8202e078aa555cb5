#pragma once
// What `loom plan` asks of a run's role objects (DESIGN.md "Planning"). The planner builds a rank's
// roles for real, on a back end that only counts (make_sizing_backend) and a grid whose
// communicators only answer their size and rank (ProcessGrid::planned), so everything a rank
// allocates when it is built is in the ledger by the code that allocates it. What a role takes only
// while a step runs (collective scratch, operand workspaces, gathered shards) and the bytes it moves,
// each role adds here through its `plan_step`, next to the code that allocates and sends them.
#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/base/dtype.hpp"
#include "core/base/ledger.hpp"

namespace loom {

// One kind of message a rank takes part in during a step, for the step-time model.
struct CommCost {
  std::string group;        // the communicator: "dp", "tp", "pp", "world"
  std::string what;         // "gradient all-reduce (bucket 3)", ...
  double bytes = 0;         // bytes this rank sends per step (the ring formulas)
  double messages = 0;      // messages this rank sends per step (the latency term)
  bool overlapped = false;  // runs while the step computes (backward), so it hides behind it
  // The rank waits on it between its kernels (a tensor-parallel collective, a pipeline receive,
  // ZeRO-3's gather of the next layer), not only at the step's end: each such wait also waits for the
  // slowest rank of the group to get there (ClusterSpec::sync_wait_share).
  bool in_step = false;
};

struct StepPlan {
  int micro_batches = 1, rows_per_micro = 1;
  // The largest bytes taken during a step beyond what the roles hold from construction, per category.
  std::array<double, kMemCategories> scratch{};
  std::vector<CommCost> comm;
  // A pipeline's schedule, for the planner to replay with its predicted times: stage_units[s] is
  // stage s's work per step in units (forward 1 and backward 2 per layer, the head by its FLOPs:
  // GPTConfig::head_in_blocks), and pipeline_span(seconds_per_unit) the step's span when every op of
  // stage s costs its units x seconds_per_unit[s]. Empty without a pipeline.
  std::vector<double> stage_units;
  std::function<double(const std::vector<double>& seconds_per_unit)> pipeline_span;
  // The strategies' own host passes per step, beyond the model's kernels (compression's error
  // feedback, quantising, top-k selection, PowerSGD's skinny products and packing, replica hashes):
  // bytes read and written; `loom plan` prices them at the cluster's host_gbs.
  double host_bytes = 0;
  // Of a device back end, the bytes those passes copy between the device and the host per step (each
  // bucket there and back, the parameters a replica hash reads); `loom plan` prices them over the
  // cluster's host link (host_link_gbs: none where the devices are the host's cores).
  double host_copy_bytes = 0;
  // The strategies' passes through the back end's kernels, where the tensors are (int8 compression's
  // chunk maxima, quantising, error feedback): bytes read and written, priced as the model's
  // element-wise kernels (memory_gbs).
  double backend_bytes = 0;

  void add_scratch(Mem m, double bytes) { scratch[static_cast<int>(m)] += bytes; }
  void add_comm(CommCost c) { comm.push_back(std::move(c)); }
  // A communicator's ring scratch pool (Mem::comm; see ScratchPool in core/comm/comm_mpi.cpp): it keeps,
  // per size class (scratch_class), as many buffers as operations of that class were ever in flight
  // at once, so its peak is the sum over classes of the class size times the most operations of it
  // in any one call. `concurrent` operations of one call (their bytes) overlap one another.
  void ring_scratch(const std::string& group, const std::vector<double>& concurrent);
  // Adds the pools' peaks to scratch[comm], once (after every role's plan_step), unless price_pools
  // is false (the back end's communicators are NCCL's: Backend::ring_scratch_pools).
  void close_pools();
  bool price_pools = true;
  // Per group ("dp", "tp", "pp", "world"): size class -> the most buffers of it in flight at once,
  // what the run reserves (Communicator::reserve_scratch) and close_pools prices.
  const std::map<std::string, std::map<std::size_t, int>>& pools() const { return pools_; }

 private:
  std::map<std::string, std::map<std::size_t, int>> pools_;
  bool pools_closed_ = false;
};

}  // namespace loom
