#include "plugins/zero/zero_sharded.hpp"

#include <algorithm>
#include <cstdio>
#include <stdexcept>

#include "core/base/ledger.hpp"
#include "core/comm/fault.hpp"

namespace loom {

ShardedStore::ShardedStore(Communicator& dp, int stage, std::int64_t persist_below, int prefetch_depth)
    : dp_(dp), stage_(stage), persist_below_(persist_below), depth_(prefetch_depth) {}

std::string ShardedStore::name() const {
  const std::string n = std::to_string(dp_.size());
  std::string s = "ZeRO stage " + std::to_string(stage_) + " (gradients" + (stage_ == 3 ? ", parameters" : "") +
                  " and optimizer state: 1/" + n + " per rank";
  if (masters16_) s += "; fp32 masters 1/" + n + ", whole 16-bit copies of the matrices all-gathered";
  if (stage_ == 3)
    s += "; units gathered " + (depth_ > 0 ? std::to_string(depth_) + " ahead" : std::string("on demand")) + ", " +
         std::to_string(whole_) + " elements kept whole";
  return s + ")";
}

void ShardedStore::build(const StoreContext& ctx, const std::vector<ParamInfo>& params,
                         const std::vector<Unit>& units) {
  be_ = &ctx.backend;
  info_ = params;
  units_ = units;
  const std::size_t n = params.size();
  // Stage 2 under 16-bit precision keeps only the share of the matrices' fp32 masters, as stage 3
  // does, and a whole 16-bit copy of them (DeepSpeed's bf16 ZeRO-2): the tensors the model reads in
  // fp32 (LayerNorm, biases, positions, and wte, the embedding table) stay whole on every rank.
  masters16_ = stage_ == 2 && ctx.backend.precision().matmul != DType::f32;
  whole_of_.assign(n, false);
  at_.assign(n, 0);
  for (std::size_t i = 0; i < n; ++i) {
    const ParamInfo& p = params[i];
    // Kept whole: small tensors at stage 3 (DeepSpeed's param persistence), and tensors another
    // stage keeps a copy of (never with stages 2 and 3 today: pipeline parallelism is refused).
    whole_of_[i] = p.tied || p.shadow || (stage_ == 3 && p.numel() < persist_below_) ||
                   (masters16_ && (!p.matmul_weight || p.name == "wte.weight"));
    at_[i] = whole_of_[i] ? whole_ : sharded_;
    (whole_of_[i] ? whole_ : sharded_) += p.numel();
  }
  counts_ = shard_counts(sharded_, dp_.size());
  offsets_ = shard_offsets(counts_);
  lo_ = offsets_[static_cast<std::size_t>(dp_.rank())];
  hi_ = offsets_[static_cast<std::size_t>(dp_.rank()) + 1];
  wcounts_.clear();
  wlo_ = 0;
  whi_ = whole_;
  if (masters16_) {  // the whole tensors are all read in fp32 (stage 2 has no tied or shadow tensor)
    wcounts_ = shard_counts(whole_, dp_.size());
    const std::vector<std::int64_t> w = shard_offsets(wcounts_);
    wlo_ = w[static_cast<std::size_t>(dp_.rank())];
    whi_ = w[static_cast<std::size_t>(dp_.rank()) + 1];
  }
  // A unit's sharded tensors must be one run of the range (the model declares units in order).
  unit_lo_.assign(units.size(), 0);
  unit_hi_.assign(units.size(), 0);
  for (std::size_t u = 0; u < units.size(); ++u) {
    bool first = true;
    for (int i : units[u].params) {
      if (whole_of_[static_cast<std::size_t>(i)]) continue;
      const std::int64_t a = at_[static_cast<std::size_t>(i)], b = a + params[static_cast<std::size_t>(i)].numel();
      if (!first && a != unit_hi_[u])
        throw std::logic_error("ZeRO store: unit " + units[u].name + " is not contiguous in model order");
      if (first) unit_lo_[u] = a;
      unit_hi_[u] = b;
      first = false;
    }
  }
  // With 16-bit compute copies the fp32 parameters are the master weights.
  // (With sharded masters the sharded matrices' 16-bit copy is params16_, not ComputeCopies'.)
  std::vector<ParamInfo> copied = params;
  if (masters16_)
    for (std::size_t i = 0; i < n; ++i) copied[i].matmul_weight = copied[i].matmul_weight && whole_of_[i];
  copies_.build(*be_, copied, units, stage_ != 3);
  const Mem fp32_params = copies_.active() ? Mem::master : Mem::params;
  const bool share_only = stage_ == 3 || masters16_;
  params_ = be_->allocate(share_only ? "ZeroStore::param_share" : "ZeroStore::params", DType::f32,
                          share_only ? hi_ - lo_ : sharded_, fp32_params);
  if (masters16_) {
    params16_ = be_->allocate("ZeroStore::params16", ctx.backend.precision().matmul, sharded_, Mem::params);
    dirty16_ = true;
  }
  gshard_ = be_->allocate("ZeroStore::grad_share", DType::f32, hi_ - lo_, Mem::grads);
  wparams_ = be_->allocate("ZeroStore::whole_params", DType::f32, whole_, fp32_params);
  wgrads_ = be_->allocate("ZeroStore::whole_grads", DType::f32, whole_, Mem::grads);
  owned_.clear();
  for (std::size_t i = 0; i < n; ++i) {
    const ParamInfo& p = params[i];
    if (whole_of_[i] && wcounts_.empty()) {
      owned_.push_back({static_cast<int>(i), 0, p.numel(), default_primary(p, ctx)});
      continue;
    }
    if (whole_of_[i]) {  // its elements in this rank's run of the whole range
      const std::int64_t a = std::max(at_[i], wlo_), b = std::min(at_[i] + p.numel(), whi_);
      if (a < b) owned_.push_back({static_cast<int>(i), a - at_[i], b - at_[i], tp_primary(p, ctx)});
      continue;
    }
    const std::int64_t a = std::max(at_[i], lo_), b = std::min(at_[i] + p.numel(), hi_);
    if (a < b) owned_.push_back({static_cast<int>(i), a - at_[i], b - at_[i], tp_primary(p, ctx)});
  }
  gathered_.assign(units.size(), nullptr);
  staged_.assign(units.size(), nullptr);
  views_.assign(units.size(), {});
}

std::vector<std::int64_t> ShardedStore::rank_counts(std::int64_t a, std::int64_t b) const {
  std::vector<std::int64_t> c(counts_.size());
  for (std::size_t q = 0; q < counts_.size(); ++q)
    c[q] = std::max<std::int64_t>(0, std::min(b, offsets_[q + 1]) - std::max(a, offsets_[q]));
  return c;
}

ShardedStore::Slot* ShardedStore::take(std::vector<std::unique_ptr<Slot>>& pool, int unit, const char* label,
                                       Mem category) {
  const std::int64_t need = unit_hi_[static_cast<std::size_t>(unit)] - unit_lo_[static_cast<std::size_t>(unit)];
  // The smallest free slot that fits and is not more than twice the need (a small unit, the
  // embeddings, does not take a block's slot away from the next block).
  Slot* best = nullptr;
  for (auto& s : pool)
    if (s->unit < 0 && s->buf.count() >= need && s->buf.count() <= 2 * need &&
        (!best || s->buf.count() < best->buf.count()))
      best = s.get();
  if (!best) {
    pool.push_back(std::make_unique<Slot>());
    best = pool.back().get();
    best->buf = be_->allocate(label, DType::f32, need, category);
  }
  best->unit = unit;
  best->users = 0;
  return best;
}

void ShardedStore::gather(int unit) {
  const std::size_t u = static_cast<std::size_t>(unit);
  Slot* s = take(pslots_, unit, "ZeroStore::gathered_params", Mem::params);
  gathered_[u] = s;
  const std::int64_t a = std::max(unit_lo_[u], lo_), b = std::min(unit_hi_[u], hi_);
  const BufferRef mine = a < b ? params_.ref().slice(a - lo_, b - a) : params_.ref().slice(0, 0);
  s->req = dp_.all_gather_async(mine, s->buf.ref().slice(0, unit_hi_[u] - unit_lo_[u]),
                                rank_counts(unit_lo_[u], unit_hi_[u]));
  ++gathers_;
}

bool ShardedStore::wanted_soon(int unit) const {
  // Kept when the unit is acquired again within the prefetch window (and the one acquire after it):
  // the head's forward and backward, a recomputed block's forward and its backward.
  if (!on_trace_) return false;
  for (std::size_t k = pos_; k < trace_.size() && k <= pos_ + static_cast<std::size_t>(depth_); ++k)
    if (trace_[k] == unit) return true;
  return false;
}

void ShardedStore::prefetch(int next_unit) {
  if (depth_ == 0) return;
  auto fetch = [&](int w) {
    const std::size_t k = static_cast<std::size_t>(w);
    if (w >= 0 && unit_hi_[k] > unit_lo_[k] && !gathered_[k]) gather(w);
  };
  if (on_trace_) {
    for (std::size_t k = pos_; k < trace_.size() && k < pos_ + static_cast<std::size_t>(depth_); ++k) fetch(trace_[k]);
  } else {
    fetch(next_unit);
  }
}

float* ShardedStore::tensor_in(const std::vector<Slot*>& slots, const TypedBuffer& whole, int i) const {
  const std::size_t k = static_cast<std::size_t>(i);
  if (whole_of_[k]) return whole.data<float>() + at_[k];
  const std::size_t u = static_cast<std::size_t>(info_[k].unit);
  return slots[u]->buf.data<float>() + (at_[k] - unit_lo_[u]);
}

const ParamStore::UnitView& ShardedStore::acquire(int unit, Use use, int next_unit) {
  const std::size_t u = static_cast<std::size_t>(unit);
  // Follow (or, in the first step, record) the order of acquires; pos_ ends one past this one.
  if (tracing_) {
    trace_.push_back(unit);
  } else if (on_trace_) {
    if (pos_ < trace_.size() && trace_[pos_] == unit)
      ++pos_;
    else
      on_trace_ = false;
  }
  const bool run = unit_hi_[u] > unit_lo_[u];
  if (stage_ == 3 && run) {
    if (!gathered_[u]) gather(unit);
    prefetch(next_unit);
    Slot* s = gathered_[u];
    if (s->req) {
      s->req->wait();
      s->req.reset();
    }
    ++s->users;
  }
  if (use == Use::backward && run && !staged_[u]) {
    staged_[u] = take(gslots_, unit, "ZeroStore::grad_staging", Mem::grads);
    be_->fill(staged_[u]->buf.ref().slice(0, unit_hi_[u] - unit_lo_[u]), 0.0);
  }
  if (dirty16_) refresh16();  // after initialisation or a load: every rank gets here alike
  UnitView& v = views_[u];
  v.params.clear();
  v.grads.clear();
  for (int i : units_[u].params) {
    const std::int64_t count = info_[static_cast<std::size_t>(i)].numel();
    const bool whole = whole_of_[static_cast<std::size_t>(i)];
    if (masters16_ && !whole) {
      v.params.emplace_back();  // no fp32 copy of a sharded matrix: its operand is the 16-bit one below
    } else {
      float* p = whole         ? wparams_.data<float>() + at_[static_cast<std::size_t>(i)]
                 : stage_ == 3 ? tensor_in(gathered_, wparams_, i)
                               : params_.data<float>() + at_[static_cast<std::size_t>(i)];
      v.params.emplace_back(p, count, be_->space());
    }
    if (use == Use::backward) v.grads.emplace_back(tensor_in(staged_, wgrads_, i), count, be_->space());
  }
  copies_.attach(unit, v);
  if (masters16_) {
    v.compute.resize(v.params.size());
    for (std::size_t k = 0; k < v.params.size(); ++k) {
      const int i = units_[u].params[k];
      if (!whole_of_[static_cast<std::size_t>(i)])
        v.compute[k] =
            params16_.ref().slice(at_[static_cast<std::size_t>(i)], info_[static_cast<std::size_t>(i)].numel());
    }
  }
  dp_.progress();
  return v;
}

void ShardedStore::release(int unit, Use) {
  const std::size_t u = static_cast<std::size_t>(unit);
  Slot* s = stage_ == 3 ? gathered_[u] : nullptr;
  if (s && --s->users == 0 && !wanted_soon(unit)) {
    s->unit = -1;
    gathered_[u] = nullptr;
    copies_.drop(unit);
  }
  dp_.progress();
}

ShardedStore::Staged ShardedStore::detach_grads(int unit) {
  const std::size_t u = static_cast<std::size_t>(unit);
  Slot* s = staged_[u];
  if (!s) return {};
  staged_[u] = nullptr;
  for (std::size_t k = 0; k < gslots_.size(); ++k)
    if (gslots_[k].get() == s) return {unit, static_cast<int>(k), s->buf.ref().slice(0, unit_hi_[u] - unit_lo_[u])};
  throw std::logic_error("ZeRO store: a staging slot not in its pool");
}

void ShardedStore::accumulate(const Staged& st) {
  if (st.slot < 0) return;
  const std::size_t u = static_cast<std::size_t>(st.unit);
  Slot* s = gslots_[static_cast<std::size_t>(st.slot)].get();
  // The reduce-scatter left this rank's sum at its natural place in the slot.
  const std::int64_t a = std::max(unit_lo_[u], lo_), b = std::min(unit_hi_[u], hi_);
  if (a < b) {
    const BufferRef g = gshard_.ref().slice(a - lo_, b - a);
    be_->residual_forward(g, g, s->buf.ref().slice(a - unit_lo_[u], b - a), b - a);  // g += part
  }
  s->unit = -1;
}

BufferRef ShardedStore::param(int i) {
  const std::size_t k = static_cast<std::size_t>(i);
  if (whole_of_[k]) return wparams_.ref().slice(at_[k], info_[k].numel());
  return stage_ == 3 || masters16_ ? BufferRef() : params_.ref().slice(at_[k], info_[k].numel());
}

BufferRef ShardedStore::grad(int i) {
  const std::size_t k = static_cast<std::size_t>(i);
  return whole_of_[k] ? wgrads_.ref().slice(at_[k], info_[k].numel()) : BufferRef();
}

BufferRef ShardedStore::owned_param(const OwnedSlice& o) {
  const std::size_t k = static_cast<std::size_t>(o.param);
  if (whole_of_[k]) return wparams_.ref().slice(at_[k] + o.begin, o.size());
  return params_.ref().slice(at_[k] + o.begin - (stage_ == 3 || masters16_ ? lo_ : 0), o.size());
}

BufferRef ShardedStore::owned_grad(const OwnedSlice& o) {
  const std::size_t k = static_cast<std::size_t>(o.param);
  if (whole_of_[k]) return wgrads_.ref().slice(at_[k] + o.begin, o.size());
  return gshard_.ref().slice(at_[k] + o.begin - lo_, o.size());
}

void ShardedStore::zero_grads() {
  be_->fill(gshard_.ref(), 0.0);
  be_->fill(wgrads_.ref(), 0.0);
  if (tracing_) trace_.clear();
  on_trace_ = !tracing_ && !trace_.empty();
  pos_ = 0;
  step_start_ = dp_.stats();
  gathers_ = 0;
}

// The whole 16-bit copy of the sharded matrices from every rank's fp32 master share: this rank's
// share rounded into its place, then a 16-bit all-gather (half the bytes of an fp32 one).
void ShardedStore::refresh16() {
  const std::size_t r = static_cast<std::size_t>(dp_.rank());
  be_->cast(params16_.ref().slice(lo_, hi_ - lo_), params_.ref().slice(0, hi_ - lo_));
  dp_.all_gather(params16_.ref().slice(offsets_[r], counts_[r]), params16_.ref(), counts_);
  dirty16_ = false;
}

void ShardedStore::refresh() {
  if (masters16_) {
    refresh16();
    dp_.all_gather(wparams_.ref().slice(wlo_, whi_ - wlo_), wparams_.ref(), wcounts_);
  } else if (stage_ == 2) {  // every rank's updated share into every rank's parameters
    const std::size_t r = static_cast<std::size_t>(dp_.rank());
    dp_.all_gather(params_.ref().slice(offsets_[r], counts_[r]), params_.ref(), counts_);
  }
  copies_.mark_stale();
  end_step();  // stage 3: gathered copies are stale now
}

void ShardedStore::end_step() {
  tracing_ = tracing_ && trace_.empty();
  on_trace_ = false;
  for (std::size_t u = 0; u < gathered_.size(); ++u)
    if (Slot* s = gathered_[u]) {
      if (s->req) s->req->wait();
      s->req.reset();
      s->unit = -1;
      gathered_[u] = nullptr;
      copies_.drop(static_cast<int>(u));
    }
}

double ShardedStore::staging_bytes() const {
  double b = 0;
  for (const auto& s : gslots_) b += static_cast<double>(s->buf.count()) * sizeof(float);
  return b;
}

double ShardedStore::gathered_bytes() const {
  double b = 0;
  for (const auto& s : pslots_) b += static_cast<double>(s->buf.count()) * sizeof(float);
  return b;
}

// ---------------------------------------------------------------------------------------------

void ShardedStore::plan_step(StepPlan& plan) const {
  const int n = dp_.size();
  std::int64_t emb = 0, most = 0, emb16 = 0, most16 = 0;  // elements; 16: the units' compute copies
  std::vector<std::int64_t> sizes;                        // the other units', in model order
  for (std::size_t u = 0; u < units_.size(); ++u) {
    const std::int64_t size = unit_hi_[u] - unit_lo_[u];
    const std::int64_t copy = copies_.active() ? copies_.elements(static_cast<int>(u)) : 0;
    if (units_[u].name == "embeddings") {
      emb = size;
      emb16 = copy;
    } else {
      most = std::max(most, size);
      most16 = std::max(most16, copy);
      sizes.push_back(size);
    }
  }
  // Units held at once are neighbours in model order (the one in use and those fetched ahead); a slot
  // serves units of up to twice its size, so units of one size share slots and a small unit beside a
  // large one (a dense block beside one with experts) takes a small slot: the largest sum of `k`
  // neighbours, which is k x most when the units are alike.
  const auto window = [&](std::size_t k) {
    std::int64_t best = 0;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      std::int64_t sum = 0;
      for (std::size_t j = i; j < std::min(sizes.size(), i + k); ++j) sum += sizes[j];
      best = std::max(best, sum);
    }
    return best;
  };
  // Stage 3 makes a unit's compute copy when the model acquires it and drops it at release
  // (ComputeCopies, not resident): one unit's at a time.
  if (stage_ == 3 && copies_.active())
    plan.add_scratch(Mem::params, static_cast<double>(dtype_size(be_->precision().matmul)) *
                                      static_cast<double>(std::max(emb16, most16)));
  plan.add_scratch(Mem::grads, 4.0 * static_cast<double>(emb + window(2)));
  const double m = plan.micro_batches;
  if (stage_ == 3) {
    plan.add_scratch(Mem::params, 4.0 * static_cast<double>(emb + window(1 + static_cast<std::size_t>(depth_))));
    plan.add_comm({dp_.name(), "parameter all-gathers (forward and backward, every micro-batch)",
                   2.0 * m * ring_all_gather_bytes(4.0 * static_cast<double>(sharded_), n),
                   2.0 * m * static_cast<double>(units_.size()) * (n - 1), true, true});
  } else {
    const double elem = masters16_ ? dtype_size(be_->precision().matmul) : sizeof(float);
    plan.add_comm({dp_.name(), "parameter all-gather (refresh)",
                   ring_all_gather_bytes(elem * static_cast<double>(sharded_), n), n - 1.0, false});
    if (!wcounts_.empty() && whole_ > 0)
      plan.add_comm({dp_.name(), "fp32 whole tensors' all-gather (refresh)",
                     ring_all_gather_bytes(4.0 * static_cast<double>(whole_), n), n - 1.0, false});
  }
}

void ShardedSync::plan_step(StepPlan& plan) const {
  if (!reducer_) return;
  const double m = plan.micro_batches;
  // Per unit in backward order: its pieces' scratch. A unit's reductions start before the previous
  // unit's complete (grads_ready pushes, then completes the oldest), so two units overlap.
  std::vector<std::vector<Reducer::BucketScratch>> units;
  for (std::size_t u = model_.units().size(); u-- > 0;) {
    const std::int64_t lo = store_.unit_lo(static_cast<int>(u)), count = store_.unit_hi(static_cast<int>(u)) - lo;
    units.emplace_back();
    for (std::int64_t a = 0; a < count; a += piece_) {
      GradBucket k;
      k.data = BufferRef(nullptr, DType::f32, std::min(count, a + piece_) - a, be_.space());
      k.rank_counts = store_.rank_counts(lo + a, lo + a + k.data.count);
      list_unit_part(k, static_cast<int>(u), a, a + k.data.count);
      const std::size_t first = plan.comm.size();
      const double host_before = plan.host_bytes, copies_before = plan.host_copy_bytes,
                   backend_before = plan.backend_bytes;
      units.back().push_back(reducer_->plan_bucket(plan, k, "unit " + model_.units()[u].name + " gradients"));
      plan.host_bytes = host_before + (plan.host_bytes - host_before) * m;  // every micro-batch reduces its pieces
      plan.host_copy_bytes = copies_before + (plan.host_copy_bytes - copies_before) * m;
      plan.backend_bytes = backend_before + (plan.backend_bytes - backend_before) * m;
      for (std::size_t c = first; c < plan.comm.size(); ++c) {
        plan.comm[c].bytes *= m;
        plan.comm[c].messages *= m;
        plan.comm[c].overlapped = overlap_;
      }
    }
  }
  // The pieces in the order they start: a piece starts while its unit's earlier pieces and, with
  // overlap, the previous unit's are in flight.
  const std::size_t window = overlap_ ? 2 : 1;
  std::vector<Reducer::BucketScratch> pieces;
  std::vector<std::size_t> unit_start, first;
  for (std::size_t u = 0; u < units.size(); ++u) {
    unit_start.push_back(pieces.size());
    for (const Reducer::BucketScratch& s : units[u]) {
      first.push_back(unit_start[u + 1 > window ? u + 1 - window : 0]);
      pieces.push_back(s);
    }
  }
  plan_ring_in_order(plan, dp_.name(), pieces, first);
  double held = 0;
  for (std::size_t u = 0; u < units.size(); ++u) {
    double h = 0;
    for (std::size_t i = u + 1 > window ? u + 1 - window : 0; i <= u; ++i)
      for (const Reducer::BucketScratch& s : units[i]) h += s.held;
    held = std::max(held, h);
  }
  // The whole tensors' gradients, once after the last backward, two pieces in flight at a time.
  std::vector<Reducer::BucketScratch> whole;
  for (const GradBucket& k : whole_buckets())
    whole.push_back(reducer_->plan_bucket(plan, k, "whole tensors' gradients"));
  std::vector<std::size_t> whole_first;
  for (std::size_t j = 0; j < whole.size(); ++j) {
    whole_first.push_back(j > 0 ? j - 1 : 0);
    held = std::max(held, whole[j].held + (j > 0 ? whole[j - 1].held : 0.0));
  }
  plan_ring_in_order(plan, dp_.name(), whole, whole_first);
  plan.add_scratch(Mem::comm, held);
}

// Lists in k the part of tensor i (at [at, at + numel) of its range) that the piece [a, b) of the same
// range holds, if any: for a reducer that looks at the tensors (compression's per-tensor residuals).
static void list_part(GradBucket& k, int i, const ParamInfo& p, std::int64_t at, std::int64_t a, std::int64_t b) {
  const std::int64_t s = std::max(at, a), e = std::min(at + p.numel(), b);
  if (s < e) k.tensors.push_back({i, p.name, p.local_shape(), s - a, e - s, s - at});
}

void ShardedSync::list_unit_part(GradBucket& k, int unit, std::int64_t a, std::int64_t b) const {
  std::int64_t at = 0;
  for (int i : model_.units()[static_cast<std::size_t>(unit)].params) {
    const ParamInfo& p = model_.params()[static_cast<std::size_t>(i)];
    if (store_.kept_whole(i)) continue;  // reduced in finish, with the whole tensors
    list_part(k, i, p, at, a, b);
    at += p.numel();
  }
}

// The whole tensors' gradients in pieces of at most bucket_mb (wte alone is V x C): reduce-scattered
// into the ranks' runs where the store shards their update, else all-reduced.
std::vector<GradBucket> ShardedSync::whole_buckets() const {
  const BufferRef g = store_.whole_grads();
  const std::vector<std::int64_t>& counts = store_.whole_rank_counts();
  const std::vector<std::int64_t> at = shard_offsets(counts);
  std::vector<GradBucket> out;
  for (std::int64_t a = 0; a < g.count; a += piece_) {
    const std::int64_t n = std::min(g.count - a, piece_);
    GradBucket k;
    k.data = g.data ? g.slice(a, n) : BufferRef(nullptr, g.type, n, g.space);  // loom plan: nothing allocated
    for (std::size_t q = 0; q < counts.size(); ++q)
      k.rank_counts.push_back(std::max<std::int64_t>(0, std::min(a + n, at[q + 1]) - std::max(a, at[q])));
    k.whole = k.rank_counts.empty();
    for (std::size_t i = 0; i < model_.params().size(); ++i) {
      const int t = static_cast<int>(i);
      if (store_.kept_whole(t)) list_part(k, t, model_.params()[i], store_.whole_offset(t), a, a + n);
    }
    out.push_back(std::move(k));
  }
  return out;
}

ShardedSync::ShardedSync(Communicator& dp, BackendFace& be, GPT& model, ShardedStore& store, double bucket_mb,
                         bool overlap)
    : dp_(dp),
      be_(be),
      model_(model),
      store_(store),
      piece_(std::max<std::int64_t>(1, static_cast<std::int64_t>(bucket_mb * 1024.0 * 1024.0 / sizeof(float)))),
      overlap_(overlap) {}

std::string ShardedSync::name() const {
  return "ZeRO stage " + std::to_string(store_.stage()) + ": " +
         (reducer_ ? reducer_->name() : std::string("(no reducer)")) +
         " of each unit's gradients as its backward ends, every micro-batch, in buckets of at most " +
         std::to_string(piece_ * sizeof(float) / 1024) + " KiB" +
         (overlap_ ? ", overlapped with backward" : ", waited at once");
}

void ShardedSync::begin_micro_batch(GPT&, int k, int m) {
  if (k == 0 && inject_fault("plugin", step_))
    throw std::runtime_error("zero plugin: injected fault at step " + std::to_string(step_) + " (LOOM_INJECT_FAULT)");
  if (k == m - 1) ++step_;
  // The previous micro-batch's last reduction had this one's forward to finish in: its slot (the
  // embeddings') is free again before the head's backward asks for one.
  while (!in_flight_.empty()) complete_oldest();
}

void ShardedSync::grads_ready(GPT&, int unit) {
  InFlight f{store_.detach_grads(unit), {}, {}};
  const BufferRef g = f.staged.grads;
  if (g.empty()) return;
  const std::int64_t lo = store_.unit_lo(unit);
  for (std::int64_t a = 0; a < g.count; a += piece_) {
    const std::int64_t b = std::min(g.count, a + piece_);
    GradBucket k;
    k.index = counted_++;
    k.data = g.slice(a, b - a);
    k.rank_counts = store_.rank_counts(lo + a, lo + b);
    list_unit_part(k, unit, a, b);
    f.buckets.push_back(std::move(k));
  }
  for (const GradBucket& k : f.buckets) f.reqs.push_back(reducer_->reduce_async(k));
  in_flight_.push_back(std::move(f));
  // One unit's reduction in flight while the next unit's backward runs (or none: overlap off).
  while (in_flight_.size() > (overlap_ ? 1u : 0u)) complete_oldest();
  dp_.progress();
}

void ShardedSync::complete_oldest() {
  InFlight f = std::move(in_flight_.front());
  in_flight_.erase(in_flight_.begin());
  for (auto& r : f.reqs) r->wait();
  store_.accumulate(f.staged);
}

void ShardedSync::finish(GPT&) {
  while (!in_flight_.empty()) complete_oldest();
  BufferRef whole = store_.whole_grads();
  if (!whole.empty()) {
    std::vector<GradBucket> pieces = whole_buckets();  // outlive their requests
    std::vector<CommRequestPtr> reqs;
    for (GradBucket& k : pieces) {
      k.index = counted_++;
      if (reqs.size() == 2) {  // two in flight, as the units' pieces
        reqs.front()->wait();
        reqs.erase(reqs.begin());
      }
      reqs.push_back(reducer_->reduce_async(k));
    }
    for (auto& r : reqs) r->wait();
    be_.scale(whole, 1.0f / static_cast<float>(dp_.size()));
  }
  BufferRef share = store_.grad_share();
  be_.scale(share, 1.0f / static_cast<float>(dp_.size()));
  buckets_per_step_ = counted_;
  counted_ = 0;
}

std::vector<std::pair<std::string, double>> zero_step_report(int stage, const Communicator& dp, const CommStats& before,
                                                             double P, const ZeroExperts& experts) {
  const CommStats& now = dp.stats();
  auto sent = [&](CommOp op) {
    const int k = static_cast<int>(op);
    return static_cast<double>(now.bytes_sent[k] - before.bytes_sent[k]);
  };
  const double rs = sent(CommOp::reduce_scatter), ag = sent(CommOp::all_gather), ar = sent(CommOp::all_reduce);
  const double N = dp.size(), Pe = experts.elements, Pd = P - Pe, Ne = experts.group;
  const double textbook = (stage == 3 ? 3.0 : 2.0) * (N - 1) / N * 4 * Pd + (Ne - 1) / Ne * 4 * Pe;
  const double textbook_state = stage == 3   ? 16 * P / N
                                : stage == 2 ? 4 * P + 12 * P / N
                                             : 8 * P + 8 * Pd / N + 8 * Pe / Ne;
  const Ledger& ledger = Ledger::global();
  // Mixed precision files the fp32 parameters as master weights and their 16-bit copies as params.
  const double state = static_cast<double>(ledger.current(Mem::params) + ledger.current(Mem::master) +
                                           ledger.current(Mem::grads) + ledger.current(Mem::optimizer));
  return {{"zero_stage", stage},
          {"zero_reduce_scatter_bytes", rs},
          {"zero_all_gather_bytes", ag},
          {"zero_all_reduce_bytes", ar},
          {"zero_textbook_bytes", textbook},
          {"zero_ratio", textbook > 0 ? (rs + ag + ar + experts.gather_bytes) / textbook : 0.0},
          {"zero_expert_elements", Pe},
          {"zero_expert_group", Ne},
          {"zero_expert_all_gather_bytes", experts.gather_bytes},
          {"zero_state_bytes", state},
          {"zero_state_textbook_bytes", textbook_state},
          {"zero_comm_scratch_bytes", static_cast<double>(ledger.peak(Mem::comm))}};
}

std::string zero_summary_line(const std::map<std::string, double>& means) {
  const auto mean = [&](const char* key) {
    const auto it = means.find(key);
    return it == means.end() ? 0.0 : it->second;
  };
  const int stage = static_cast<int>(mean("zero_stage"));
  const bool experts = mean("zero_expert_elements") > 0;  // stage 1 with parallel.ep > 1
  const char* bytes_formula = stage == 3 ? "3(N-1)/N*M" : experts ? "2(N-1)/N*Md + (Ne-1)/Ne*Me" : "2(N-1)/N*M";
  const char* state_formula = stage == 3   ? "16P/N"
                              : stage == 2 ? "4P + 4P/N + 8P/N"
                              : experts    ? "4P + 4P + 8Pd/N + 8Pe/Ne"
                                           : "4P + 4P + 8P/N";
  std::string added = "the collectives' scratch, " + format_bytes(mean("zero_comm_scratch_bytes"));
  if (mean("zero_grad_staging_bytes") > 0)
    added += "; gradient staging, " + format_bytes(mean("zero_grad_staging_bytes"));
  if (mean("zero_param_gather_bytes") > 0)
    added += "; gathered parameters, " + format_bytes(mean("zero_param_gather_bytes"));
  if (mean("zero_whole_bytes") > 0) added += "; tensors kept whole, " + format_bytes(mean("zero_whole_bytes"));
  char line[1024];
  std::snprintf(line, sizeof line,
                "ZeRO stage %d: bytes sent / textbook %s = %.4f; model state per rank %s (parameters,\n"
                "         gradients, AdamW) against the textbook %s = %s; loom adds %s",
                stage, bytes_formula, mean("zero_ratio"), format_bytes(mean("zero_state_bytes")).c_str(), state_formula,
                format_bytes(mean("zero_state_textbook_bytes")).c_str(), added.c_str());
  return line;
}

std::vector<std::string> ShardedSync::summary_lines(const std::map<std::string, double>& means) const {
  std::vector<std::string> lines;
  if (means.count("zero_ratio")) lines.push_back(zero_summary_line(means));
  for (Reducer* k = reducer_; k; k = k->inner())
    for (auto& line : k->summary_lines(means)) lines.push_back(line);
  return lines;
}

std::vector<std::pair<std::string, double>> ShardedSync::step_report() const {
  auto r =
      zero_step_report(store_.stage(), dp_, store_.stats_at_step_start(), static_cast<double>(store_.local_numel()));
  // The buffers loom adds to the textbook's model state, and what the step did.
  r.insert(r.end(), {{"zero_grad_staging_bytes", store_.staging_bytes()},
                     {"zero_param_gather_bytes", store_.gathered_bytes()},
                     {"zero_whole_bytes", store_.whole_bytes()},
                     {"zero_share_elements", static_cast<double>(store_.share())},
                     {"zero_unit_gathers", static_cast<double>(store_.gathers_this_step())},
                     {"zero_buckets", static_cast<double>(buckets_per_step_)}});
  for (Reducer* k = reducer_; k; k = k->inner())
    for (auto& kv : k->step_report()) r.push_back(kv);
  return r;
}

}  // namespace loom
