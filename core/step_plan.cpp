#include "core/step_plan.hpp"

#include <algorithm>
#include <numeric>

namespace loom {

void StepPlan::ring_scratch(const std::string& group, const std::vector<double>& concurrent) {
  const double together = std::accumulate(concurrent.begin(), concurrent.end(), 0.0);
  double& peak = pools_[group];
  peak = std::max(peak, together);
}

void StepPlan::close_pools() {
  for (auto& [group, bytes] : pools_) add_scratch(Mem::comm, bytes);
  pools_.clear();
}

}  // namespace loom
