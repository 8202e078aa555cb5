#include "driver/health.hpp"

#include <cmath>
#include <sstream>

namespace loom {

std::string NonFiniteAt::describe() const {
  std::ostringstream s;
  s << kind << " " << tensor << " (" << value << " on rank " << rank << ": dp " << dp
    << (cps > 1 ? ", cp " + std::to_string(cp) : std::string()) << ", tp " << tp << ", pp " << pp << ")";
  return s.str();
}

namespace {
// Tensor i whole when the store keeps it whole, else this rank's owned slice of it (every element
// is some rank's, so the search over all ranks still sees every one).
template <class Whole, class Slice>
BufferRef whole_or_owned(ParamStore& store, int i, Whole whole, Slice slice) {
  const BufferRef all = whole(i);
  if (!all.empty()) return all;
  for (const OwnedSlice& o : store.owned())
    if (o.param == i) return slice(o);
  return BufferRef();
}
}  // namespace

TensorSource gradients(GPT& model) {
  return {"gradient", [&model](int i) {
            ParamStore& s = model.store();
            return whole_or_owned(
                s, i, [&s](int k) { return s.grad(k); }, [&s](const OwnedSlice& o) { return s.owned_grad(o); });
          }};
}
TensorSource parameters(GPT& model) {
  return {"parameter", [&model](int i) {
            ParamStore& s = model.store();
            return whole_or_owned(
                s, i, [&s](int k) { return s.param(k); }, [&s](const OwnedSlice& o) { return s.owned_param(o); });
          }};
}
std::vector<TensorSource> optimizer_state(Optimizer& optimizer) {
  std::vector<TensorSource> out;
  for (const Optimizer::StateTensor& st : optimizer.state()) {
    out.push_back({st.what, [&optimizer, data = st.data](int i) {
                     const auto& owned = optimizer.owned();
                     for (std::size_t k = 0; k < owned.size(); ++k)
                       if (owned[k].param == i) return data.slice(optimizer.slice_offset(k), owned[k].size());
                     return BufferRef();
                   }});
  }
  return out;
}

namespace {
// The elements of a device tensor, copied to the host; empty for a host tensor (read in place).
std::vector<float> host_copy(BackendFace& backend, const BufferRef& ref) {
  std::vector<float> copy;
  if (ref.space == MemSpace::host || ref.empty()) return copy;
  copy.resize(static_cast<std::size_t>(ref.count));
  backend.copy_to_host(copy.data(), BufferRef(ref.as<float>(), ref.count, ref.space));
  return copy;
}
}  // namespace

std::optional<NonFiniteAt> find_nonfinite(ProcessGrid& grid, const GPT& model,
                                          const std::vector<TensorSource>& buffers) {
  const auto& all = model.all_params();
  // This rank's first hit as one position (kind-major, then model order) and its value.
  double position = -1, value = 0;
  for (std::size_t k = 0; k < buffers.size() && position < 0; ++k) {
    for (std::size_t i = 0; i < all.size() && position < 0; ++i) {
      const int index = model.param_index(all[i].name);
      if (index < 0) continue;
      const BufferRef ref = buffers[k].of(index);
      const std::vector<float> copy = host_copy(model.backend(), ref);
      const float* x = ref.empty() ? nullptr : copy.empty() ? ref.as<float>() : copy.data();
      for (std::int64_t j = 0; j < ref.count; ++j)
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
  at.kind = buffers[pos / all.size()].kind;
  at.tensor = all[pos % all.size()].name;
  at.value = static_cast<float>(found[2 * best + 1]);
  at.rank = best;
  const Layout& l = grid.layout();
  const Layout::Coords c = l.coords_of(best);
  at.tp = c.tp;
  at.dp = c.dp;
  at.pp = c.pp;
  at.cp = c.cp;
  at.cps = l.cp;
  return at;
}

std::optional<std::string> find_nonfinite_contributed(ProcessGrid& grid, BackendFace& backend,
                                                      const std::vector<CheckpointContributor*>& parts) {
  constexpr double kNone = -1e300;
  std::vector<std::string> paths;
  double earliest = kNone;  // -(position + 1) of this rank's first bad tensor: the max over ranks is the earliest
  for (CheckpointContributor* c : parts)
    for (const CheckpointTensor& t : c->checkpoint_tensors()) {
      if (earliest == kNone && t.holds && !t.data.empty()) {
        bool finite = true;
        if (t.data.space != MemSpace::host) {
          finite = backend.sq_norm_check({t.data}).all_finite;  // compression's int8 residuals on a device
        } else {
          const float* x = t.data.as<float>();
          for (std::int64_t j = 0; j < t.data.count && finite; ++j) finite = std::isfinite(x[j]);
        }
        if (!finite) earliest = -static_cast<double>(paths.size() + 1);
      }
      paths.push_back(t.path);
    }
  grid.world().all_reduce(BufferRef(&earliest, 1), ReduceOp::max);
  if (earliest == kNone) return std::nullopt;
  return paths[static_cast<std::size_t>(-earliest) - 1];
}

}  // namespace loom
