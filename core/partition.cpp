#include "core/partition.hpp"

#include "core/gpt.hpp"

namespace loom {

double Partition::grad_sq_norm(GPT& model, Backend& be) {
  double sq = 0;
  for (const auto& p : model.params())
    if (!p.shadow) sq += be.sum_squares(model.grad_data() + p.offset, p.numel);
  return sq;
}

}  // namespace loom
