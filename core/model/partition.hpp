#pragma once
// Role "partition" (DESIGN.md): which slice of each weight this rank holds, and the collectives that
// a split layer needs. The core's default keeps every weight whole (one tensor-parallel rank) and
// every operation below is the identity; the `tensor` plugin splits attention heads, the MLP's inner
// dimension and the vocabulary over the tp group (Megatron-style), optionally with sequence
// parallelism.
//
// Shape letters: N rows (B*T) of a micro-batch, Nl rows on this rank (N/tp with sequence
// parallelism, else N), C channels, V vocabulary, Vl = V/tp.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/backend/backend_face.hpp"
#include "core/base/shard.hpp"  // TpSplit
#include "core/comm/step_plan.hpp"

namespace loom {

class GPT;

class Partition {
 public:
  virtual ~Partition() = default;
  virtual std::string name() const { return "none (whole weights on every rank)"; }
  virtual int size() const { return 1; }
  virtual int rank() const { return 0; }
  virtual bool sequence_parallel() const { return false; }

  // Megatron's conjugate operators on activations [rows, C] (each buffer sized for the largest
  // micro-batch; the first rows * C elements, or rows * C * size() of a gathered one, are used):
  // the replicated input of a column-parallel layer, from this rank's rows (SP: all-gather into
  // `full`; otherwise the rows are already whole and `local` is returned).
  virtual BufferRef to_full(const BufferRef& local, const BufferRef& /*full*/, std::int64_t /*rows*/, int /*C*/) {
    return local;
  }
  // the partial output of a row-parallel layer summed over the group, as this rank's rows
  // (all-reduce in place, or SP: reduce-scatter into `local`).
  virtual BufferRef reduce_partial(const BufferRef& partial, const BufferRef& /*local*/, std::int64_t /*rows*/,
                                   int /*C*/) {
    return partial;
  }
  // backward of reduce_partial: this rank's row gradients as the whole gradient (SP: all-gather).
  virtual BufferRef grad_to_full(const BufferRef& dlocal, const BufferRef& /*dfull*/, std::int64_t /*rows*/,
                                 int /*C*/) {
    return dlocal;
  }
  // backward of to_full: a partial gradient of the whole input summed over the group, as this
  // rank's rows (all-reduce in place, or SP: reduce-scatter into `dlocal`).
  virtual BufferRef reduce_partial_grad(const BufferRef& dpartial, const BufferRef& /*dlocal*/, std::int64_t /*rows*/,
                                        int /*C*/) {
    return dpartial;
  }

  // A small fp32 vector each rank holds a partial sum of (an expert row's gate gradient, summed over
  // the experts' split inner dimension), summed over the group in place.
  virtual void sum_over_group(const BufferRef& /*x*/) {}

  // Cross-entropy over logits whose vocabulary is split: this rank holds columns
  // [vocab_begin, vocab_begin + Vl) of every row. losses [N] (every rank gets every row's loss),
  // probs [N, Vl] (this rank's slice of the softmax), targets [N] int32.
  virtual void crossentropy_forward(BackendFace& be, const BufferRef& losses, const BufferRef& probs,
                                    const BufferRef& logits, const BufferRef& targets, int N, int Vl,
                                    int /*vocab_begin*/) {
    be.crossentropy_forward(losses, probs, logits, targets, N, Vl);
  }
  virtual void crossentropy_backward(BackendFace& be, const BufferRef& dlogits, const BufferRef& probs,
                                     const BufferRef& targets, float dloss, int N, int Vl, int vocab_begin) {
    be.crossentropy_backward(dlogits, probs, targets, dloss, N, Vl, vocab_begin);
  }
  // Both in one pass, the loss's gradient known at the forward (training): losses as crossentropy_forward,
  // dlogits [N, Vl] (fp32, may alias logits; or 16-bit) as crossentropy_backward after it, bit for bit,
  // with no probability table.
  virtual void crossentropy_fused(BackendFace& be, const BufferRef& losses, const BufferRef& dlogits,
                                  const BufferRef& logits, const BufferRef& targets, float dloss, int N, int Vl,
                                  int /*vocab_begin*/) {
    be.crossentropy_fused(losses, dlogits, logits, targets, dloss, N, Vl);
  }

  // After the last backward of a step: make the gradients of replicated parameters whole (with
  // sequence parallelism each rank saw only its rows).
  virtual void finish_grads(GPT& /*model*/) {}
  // Numbers for the metrics of the last step.
  virtual std::vector<std::pair<std::string, double>> step_report() const { return {}; }
  // `loom plan`: the scratch a step of `model` takes here and the bytes it moves (core/comm/step_plan.hpp).
  virtual void plan_step(StepPlan& /*plan*/, const GPT& /*model*/) const {}
};

}  // namespace loom
