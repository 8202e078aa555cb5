#include "core/comm/step_plan.hpp"

#include <algorithm>
#include <stdexcept>

#include "core/comm/comm.hpp"

namespace loom {

void StepPlan::ring_scratch(const std::string& group, const std::vector<double>& concurrent) {
  if (pools_closed_) throw std::logic_error("StepPlan::ring_scratch after close_pools");
  std::map<std::size_t, int> count;  // operations of each size class in flight together
  for (double bytes : concurrent)
    if (bytes > 0) ++count[scratch_class(static_cast<std::size_t>(bytes))];
  std::map<std::size_t, int>& most = pools_[group];
  for (const auto& [c, k] : count) most[c] = std::max(most[c], k);
}

void StepPlan::close_pools() {
  if (pools_closed_) return;
  pools_closed_ = true;
  if (!price_pools) return;
  for (const auto& [group, classes] : pools_)
    for (const auto& [c, k] : classes) add_scratch(Mem::comm, static_cast<double>(c) * k);
}

}  // namespace loom
