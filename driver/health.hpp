#pragma once
// Finding non-finite values across the ranks (DESIGN.md "Runs a user can trust"): which tensor holds
// the first one, in model order, and which rank found it. Used when a step's loss or gradient norm
// is not finite, before a checkpoint is written, and at the end of a run.
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/model/gpt.hpp"
#include "core/engine/checkpoint_part.hpp"
#include "core/comm/grid.hpp"
#include "core/model/optimizer.hpp"

namespace loom {

struct NonFiniteAt {
  std::string kind;                             // "gradient", "parameter", "AdamW first moment", ...
  std::string tensor;                           // the parameter's global name
  float value = 0;                              // the first non-finite value (nan, inf or -inf)
  int rank = -1;                                // the world rank that holds it (the lowest one, if several do)
  int dp = 0, tp = 0, pp = 0, cp = 0, cps = 1;  // cps: parallel.cp (the cp coordinate is named where > 1)
  std::string describe() const;                 // "gradient blocks.0.attn.qkv.weight (nan on rank 1: dp 1, tp 0, pp 0)"
};

// A kind of per-tensor data to search: `of(i)` is this rank's part of tensor i of the model's
// params() (empty when it holds none), e.g. the store's gradient of it.
struct TensorSource {
  std::string kind;  // "gradient", "parameter", "AdamW first moment", ...
  std::function<BufferRef(int)> of;
};
TensorSource gradients(GPT& model);
TensorSource parameters(GPT& model);
// Each kind of optimizer state, over the slices this rank owns.
std::vector<TensorSource> optimizer_state(Optimizer& optimizer);

// Collective over the grid's world: the first non-finite element, searched kind by kind, tensor by
// tensor in the model's order. The same answer on every rank.
std::optional<NonFiniteAt> find_nonfinite(ProcessGrid& grid, const GPT& model,
                                          const std::vector<TensorSource>& sources);

// Collective over the grid's world: the path of the first contributed checkpoint tensor (in the
// order `parts` list them) holding a non-finite value on any rank, or nothing. A tensor in the back
// end's device memory is checked there (Backend::sq_norm_check).
std::optional<std::string> find_nonfinite_contributed(ProcessGrid& grid, BackendFace& backend,
                                                      const std::vector<CheckpointContributor*>& parts);

}  // namespace loom
