#include "core/partition.hpp"

#include "core/gpt.hpp"

namespace loom {

double Partition::grad_sq_norm(GPT& model, Backend& be) { return be.sum_squares(model.grad_data(), model.num_params()); }

}  // namespace loom
