#include "driver/health.hpp"

#include <cmath>
#include <sstream>

namespace loom {

std::string NonFiniteAt::describe() const {
  std::ostringstream s;
  s << kind << " " << tensor << " (" << value << " on rank " << rank << ": dp " << dp << ", tp " << tp << ", pp " << pp
    << ")";
  return s.str();
}

std::optional<NonFiniteAt> find_nonfinite(ProcessGrid& grid, const GPT& model,
                                          const std::vector<std::pair<std::string, const float*>>& buffers) {
  const auto& all = model.all_params();
  // This rank's first hit as one position (kind-major, then model order) and its value.
  double position = -1, value = 0;
  for (std::size_t k = 0; k < buffers.size() && position < 0; ++k) {
    for (std::size_t i = 0; i < all.size() && position < 0; ++i) {
      const ParamInfo* p = model.find_param(all[i].name);
      if (!p) continue;
      const float* x = buffers[k].second + p->offset;
      for (std::int64_t j = 0; j < p->numel; ++j)
        if (!std::isfinite(x[j])) {
          position = static_cast<double>(k * all.size() + i);
          value = x[j];
          break;
        }
    }
  }
  // Every rank's answer in its own slot of one sum: the earliest position wins, then the lowest rank.
  const int world = grid.layout().ranks();
  std::vector<double> found(2 * static_cast<std::size_t>(world), 0.0);
  found[2 * grid.rank()] = position + 1;  // 0: nothing found
  found[2 * grid.rank() + 1] = position >= 0 ? value : 0.0;
  grid.world().all_reduce(found.data(), static_cast<std::int64_t>(found.size()));
  int best = -1;
  for (int r = 0; r < world; ++r)
    if (found[2 * r] > 0 && (best < 0 || found[2 * r] < found[2 * best])) best = r;
  if (best < 0) return std::nullopt;
  const auto pos = static_cast<std::size_t>(found[2 * best] - 1);
  NonFiniteAt at;
  at.kind = buffers[pos / all.size()].first;
  at.tensor = all[pos % all.size()].name;
  at.value = static_cast<float>(found[2 * best + 1]);
  at.rank = best;
  const Layout& l = grid.layout();
  at.tp = best % l.tp;
  at.dp = best / l.tp % l.dp;
  at.pp = best / (l.tp * l.dp);
  return at;
}

}  // namespace loom
