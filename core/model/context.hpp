#pragma once
// Role "context" (DESIGN.md "Context parallelism"): which tokens of each sequence this rank holds and
// how its attention sees the others'. The core's default holds whole sequences (one context rank) and
// never calls the attention below; the `context` plugin splits every sequence over parallel.cp ranks
// and runs ring attention.
//
// The split is the core's contract, since data loading, positions and the loss must agree with it:
// a sequence of T tokens is cut into 2 x cp chunks of T / (2 cp), and context rank i holds chunks i and
// 2cp - 1 - i, in that order (causal load balancing: every rank then has the same share of the causal
// triangle). Local token t of Tl = T / cp is global position position(t, T). The local order follows
// the global one, so a causal mask by local index is right within a rank's own tokens.
//
// Shape letters: B rows of a micro-batch, Tl local tokens, Cl = C/tp channels, NHl = NH/tp heads.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/backend/backend_face.hpp"
#include "core/comm/step_plan.hpp"

namespace loom {

// Local token t's global position, of T, on context rank `rank` of `size`.
inline int context_position(int t, int T, int size, int rank) {
  if (size == 1) return t;
  const int chunk = T / (2 * size);
  return t < chunk ? rank * chunk + t : (2 * size - 1 - rank) * chunk + (t - chunk);
}

class ContextSplit {
 public:
  virtual ~ContextSplit() = default;
  virtual std::string name() const { return "none (whole sequences on every rank)"; }
  virtual int size() const { return 1; }
  virtual int rank() const { return 0; }
  int local_tokens(int T) const { return T / size(); }
  int position(int t, int T) const { return context_position(t, T, size(), rank()); }

  // Called once by the model before any step, with its largest shapes, so the ring's buffers are
  // allocated (and priced by `loom plan`) at set-up: `bf16` the operands' rounding (flash); `out16`
  // whether the attention's output is saved 16-bit (then the ring merges into fp32 scratch first).
  virtual void prepare(BackendFace& /*be*/, int /*max_rows*/, int /*Tl*/, int /*Cl*/, int /*NHl*/, bool /*bf16*/,
                       bool /*out16*/) {}
  // Attention over the whole sequence for this rank's queries (size() > 1 only): out [B,Tl,Cl] (fp32,
  // bf16 or fp16), lse [B,NHl,Tl] (saved for the backward), from qkv [B,Tl,3Cl]; causal by global
  // position. The backward writes dqkv [B,Tl,3Cl] (=), out being the forward's.
  virtual void attention_forward(BackendFace& /*be*/, const BufferRef& /*out*/, const BufferRef& /*lse*/,
                                 const BufferRef& /*qkv*/, int /*B*/, int /*Tl*/, int /*Cl*/, int /*NHl*/) {}
  virtual void attention_backward(BackendFace& /*be*/, const BufferRef& /*dqkv*/, const BufferRef& /*dout*/,
                                  const BufferRef& /*out*/, const BufferRef& /*qkv*/, const BufferRef& /*lse*/,
                                  int /*B*/, int /*Tl*/, int /*Cl*/, int /*NHl*/) {}
  // Called by the run before each training step (after its evaluation), so step_report covers the step.
  virtual void begin_step() {}
  // Numbers for the metrics of the last step (the ring's bytes, its waits).
  virtual std::vector<std::pair<std::string, double>> step_report() { return {}; }
  // `loom plan`: what a step of the ring moves per rank (core/comm/step_plan.hpp).
  virtual void plan_step(StepPlan& /*plan*/, int /*layers*/, int /*micro_batches*/, bool /*recompute*/) const {}
};

}  // namespace loom
