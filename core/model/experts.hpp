#pragma once
// Role "experts" (DESIGN.md "Mixture of experts"): which of a block's experts this rank holds and how
// tokens reach the ranks that hold theirs. The core's default holds every expert (one expert-parallel
// rank) and never exchanges; the `expert` plugin splits the experts over parallel.ep ranks of the
// gradient group (rank q of an ep group holds experts [q E/ep, (q+1) E/ep)) and exchanges token rows
// between them (all-to-all, uneven counts) through the grid's ep communicator.
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/backend/backend_face.hpp"
#include "core/comm/step_plan.hpp"

namespace loom {

class GPT;

class ExpertSplit {
 public:
  virtual ~ExpertSplit() = default;
  virtual std::string name() const { return "none (every expert on every rank)"; }
  virtual int size() const { return 1; }
  virtual int rank() const { return 0; }
  // Experts [first, end) of E are this rank's.
  int first(int E) const { return rank() * (E / size()); }
  int end(int E) const { return (rank() + 1) * (E / size()); }

  // (size() > 1 only) Every rank's `counts` (E values: the rows it sends to each expert) to every rank
  // of the group: all [size, E], rank-major.
  virtual void exchange_counts(const std::vector<std::int64_t>& /*counts*/, std::vector<std::int64_t>& /*all*/) {}
  // (size() > 1 only) All-to-all of rows of `cols` values of send's type (fp32, or the products' 16-bit
  // type for the forward's inputs): send_rows[q] rows of `send`, in rank order, go to rank q;
  // recv_rows[q] rows arrive from rank q into `recv`, in rank order. A rank's own rows are copied.
  virtual void exchange(BackendFace& /*be*/, const BufferRef& /*send*/, const std::vector<std::int64_t>& /*send_rows*/,
                        const BufferRef& /*recv*/, const std::vector<std::int64_t>& /*recv_rows*/, int /*cols*/) {}
  // After the step's backward (the engine's grads_final, after gradient sync): the experts' gradients
  // summed over the ranks that hold the same experts and made the mean over every replica, as the
  // gradient sync does for the rest.
  virtual void finish_grads(GPT& /*model*/) {}
  // Called by the run before each training step, so step_report covers the step.
  virtual void begin_step() {}
  virtual std::vector<std::pair<std::string, double>> step_report() { return {}; }
  // The summary's lines from the run's means of every role's step_report values and the mean step time.
  virtual std::vector<std::string> summary_lines(const std::map<std::string, double>& /*means*/,
                                                 double /*step_s*/) const {
    return {};
  }
  // `loom plan`: the scratch and bytes of a step (core/comm/step_plan.hpp).
  virtual void plan_step(StepPlan& /*plan*/, const GPT& /*model*/) const {}
};

}  // namespace loom
