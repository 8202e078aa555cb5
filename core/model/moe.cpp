// Mixture of experts: the router on the host (its [N,E] logits are small), the experts through the
// back end's row operations and products (DESIGN.md "Mixture of experts").
#include "core/model/moe.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "core/model/gpt.hpp"

namespace loom {
namespace {
// Rows [b, b + n) of a table of rows `width` wide (an expert's rows of the block's tables).
BufferRef rows_of(const BufferRef& table, std::int64_t b, std::int64_t n, std::int64_t width) {
  return table.slice(b * width, n * width);
}
// A scratch table of fp32 slots seen as elements of type t (a 16-bit one holds twice as many).
BufferRef retyped(const BufferRef& floats, DType t) {
  return BufferRef(floats.data, t, floats.count * 4 / static_cast<std::int64_t>(dtype_size(t)), floats.space);
}
}  // namespace

MoeRouting moe_route(const float* logits, int N, int T, int E, int k, double capacity_factor) {
  const std::vector<double> l(logits, logits + static_cast<std::size_t>(N) * E);
  return moe_route(l.data(), N, T, E, k, capacity_factor);
}

MoeRouting moe_route(const double* logits, int N, int T, int E, int k, double capacity_factor) {
  if (N % T != 0 || k < 1 || k > E) throw std::logic_error("moe_route: bad shape");
  MoeRouting r;
  r.N = N, r.T = T, r.E = E, r.k = k;
  const int S = N / T;
  const std::size_t NE = static_cast<std::size_t>(N) * E, Nk = static_cast<std::size_t>(N) * k;
  r.probs.resize(NE);
  r.lse.resize(static_cast<std::size_t>(N));
  r.choice.resize(Nk);
  r.gate.resize(Nk);
  r.kept.assign(Nk, 0);
  r.share.assign(static_cast<std::size_t>(S) * E, 0.0);
  r.routed.assign(static_cast<std::size_t>(E), 0);
  double z = 0;
  for (int t = 0; t < N; ++t) {
    const double* l = logits + static_cast<std::size_t>(t) * E;
    double mx = -std::numeric_limits<double>::infinity();
    for (int e = 0; e < E; ++e) mx = std::max(mx, l[e]);
    double sum = 0;
    for (int e = 0; e < E; ++e) sum += std::exp(l[e] - mx);
    const double lse = mx + std::log(sum);
    r.lse[t] = lse;
    z += lse * lse;
    double* p = &r.probs[static_cast<std::size_t>(t) * E];
    for (int e = 0; e < E; ++e) p[e] = std::exp(l[e] - lse);
    // The k largest, ties to the lower index: a choice every layout makes alike from the same logits.
    int* c = &r.choice[static_cast<std::size_t>(t) * k];
    double Z = 0;
    for (int j = 0; j < k; ++j) {
      int best = -1;
      for (int e = 0; e < E; ++e) {
        if (std::find(c, c + j, e) != c + j) continue;
        if (best < 0 || p[e] > p[best]) best = e;
      }
      c[j] = best;
      Z += p[best];
    }
    for (int j = 0; j < k; ++j) r.gate[static_cast<std::size_t>(t) * k + j] = p[c[j]] / Z;
  }
  r.z = z / N;
  // Capacity per sequence, in token order (each token's choices in the router's order): whether a token
  // keeps an expert depends on the tokens before it only, so routing is causal as attention is, and a
  // forward on a prefix (`loom sample`) routes it as training does.
  const std::int64_t cap = capacity_factor > 0 ? static_cast<std::int64_t>(std::ceil(capacity_factor * T * k / E))
                                               : std::numeric_limits<std::int64_t>::max();
  std::vector<std::int64_t> used(static_cast<std::size_t>(E));
  std::vector<int> count(static_cast<std::size_t>(E), 0);
  double aux = 0;
  for (int s = 0; s < S; ++s) {
    std::fill(used.begin(), used.end(), 0);
    for (int t = s * T; t < (s + 1) * T; ++t)
      for (int j = 0; j < k; ++j) {
        const std::size_t a = static_cast<std::size_t>(t) * k + j;
        const int e = r.choice[a];
        ++r.routed[static_cast<std::size_t>(e)];
        r.share[static_cast<std::size_t>(s) * E + e] += 1.0;
        if (used[static_cast<std::size_t>(e)] < cap) {
          ++used[static_cast<std::size_t>(e)];
          r.kept[a] = 1;
          ++count[static_cast<std::size_t>(e)];
        } else {
          ++r.dropped;
        }
      }
    double seq = 0;
    for (int e = 0; e < E; ++e) {
      double& f = r.share[static_cast<std::size_t>(s) * E + e];
      f /= static_cast<double>(T) * k;
      double P = 0;
      for (int t = s * T; t < (s + 1) * T; ++t) P += r.probs[static_cast<std::size_t>(t) * E + e];
      seq += f * (P / T);
    }
    aux += E * seq;
  }
  r.aux = aux / S;
  r.begin.assign(static_cast<std::size_t>(E) + 1, 0);
  for (int e = 0; e < E; ++e) r.begin[static_cast<std::size_t>(e) + 1] = r.begin[e] + count[e];
  const int A = r.begin.back();
  r.rows.resize(static_cast<std::size_t>(A));
  r.row_gate.resize(static_cast<std::size_t>(A));
  r.slot.resize(static_cast<std::size_t>(A));
  std::vector<int> next(r.begin.begin(), r.begin.end() - 1);
  for (int t = 0; t < N; ++t)
    for (int j = 0; j < k; ++j) {
      const std::size_t a = static_cast<std::size_t>(t) * k + j;
      if (!r.kept[a]) continue;
      const int at = next[static_cast<std::size_t>(r.choice[a])]++;
      r.rows[at] = t;
      r.row_gate[at] = static_cast<float>(r.gate[a]);
      r.slot[at] = static_cast<int>(a);
    }
  return r;
}

void moe_router_backward(float* dlogits, const MoeRouting& r, const float* dgate, double aux_weight, double z_weight,
                         double scale) {
  const int N = r.N, E = r.E, k = r.k, S = N / r.T;
  std::vector<double> dg(static_cast<std::size_t>(N) * k, 0.0), dp(static_cast<std::size_t>(E));
  for (int a = 0; a < r.assignments(); ++a) dg[r.slot[a]] = dgate[a];
  for (int t = 0; t < N; ++t) {
    const std::size_t row = static_cast<std::size_t>(t) * E, s = static_cast<std::size_t>(t / r.T);
    const double* p = &r.probs[row];
    // the load-balancing loss: d(mean_s E sum_e f_se P_se) / dp_te = E f_se / (S T), f held fixed
    for (int e = 0; e < E; ++e) dp[e] = scale * aux_weight * E * r.share[s * E + e] / (static_cast<double>(S) * r.T);
    // the gates p_j / Z over the k chosen: dp_i += (dg_i - sum_j dg_j g_j) / Z
    const int* c = &r.choice[static_cast<std::size_t>(t) * k];
    const double* g = &r.gate[static_cast<std::size_t>(t) * k];
    const double* d = &dg[static_cast<std::size_t>(t) * k];
    double Z = 0, dot = 0;
    for (int j = 0; j < k; ++j) Z += p[c[j]], dot += d[j] * g[j];
    for (int j = 0; j < k; ++j) dp[c[j]] += (d[j] - dot) / Z;
    // the softmax, and the z-loss's 2 lse p / N
    double pdp = 0;
    for (int e = 0; e < E; ++e) pdp += p[e] * dp[e];
    const double zterm = scale * z_weight * 2.0 * r.lse[t] / N;
    for (int e = 0; e < E; ++e) dlogits[row + e] = static_cast<float>(p[e] * (dp[e] - pdp) + zterm * p[e]);
  }
}

std::size_t GPT::routing_index(int chunk, int slot, int layer) const {
  const Stage::Chunk& c = stage_.chunks[chunk];
  return static_cast<std::size_t>(acts0_[chunk] + static_cast<std::int64_t>(slot) * (c.end_layer - c.first_layer) +
                                  layer - c.first_layer);
}

void GPT::reset_moe_stats() {
  moe_stats_ = MoeStats{};
  moe_stats_.routed.assign(static_cast<std::size_t>(cfg_.layers) * std::max(cfg_.experts, 0), 0.0);
}

std::int64_t GPT::Geometry::expert_rows() const {
  const std::int64_t N = static_cast<std::int64_t>(max_rows) * T(), k = cfg.top_k();
  if (cfg.experts <= 0 || ep <= 1) return N * k;
  // each of the group's ep N tokens sends at most min(k, E/ep) of its k distinct experts here
  const std::int64_t El = cfg.experts / ep;
  return std::min(ep * N * std::min(k, El), El * rows_per_expert());
}

std::int64_t GPT::Geometry::rows_per_expert() const {
  const std::int64_t N = static_cast<std::int64_t>(max_rows) * T();
  if (cfg.experts <= 0 || ep <= 1) return N;
  std::int64_t rows = ep * N;  // every token of the group once
  if (cfg.expert_capacity > 0) {
    const std::int64_t cap =
        static_cast<std::int64_t>(std::ceil(cfg.expert_capacity * cfg.seq_len * cfg.top_k() / cfg.experts));
    rows = std::min(rows, cap * max_rows * ep);  // its capacity in each of the group's sequences
  }
  return rows;
}

// The experts of block l on its ln2: route on the host, then expert by expert gather its rows, its MLP
// (fc with GELU, proj; proj's bias added by tp rank 0 alone, as the sum over the group has it once) and
// add its gated output into s.partial [N,C]. Saved: each expert row's GELU input and output (fch,
// fch_gelu), its output (moe_y), its token and gate; the router's probabilities stay on the host.
// With ep > 1 the rows go to the ranks holding their experts and the outputs come back
// (moe_forward_ep).
void GPT::moe_forward(const ParamStore::UnitView& view, const BlockActs& a, const Scratch& s, int chunk, int slot,
                      int l, int N, bool recompute) {
  const int C = cfg_.d_model, E = cfg_.experts, k = cfg_.top_k(), Fl = cfg_.expert_ffn() / tp_;
  const std::vector<int>& h = block_tensors_[static_cast<std::size_t>(l)];
  const BufferRef in = input_of(a.ln2, s.full, N, C);  // [N,C] every token of the micro-batch
  be_.matmul_forward(s.router, in, matmul_operand(view, h[12]), {}, N, C, E);
  std::vector<float> logits(static_cast<std::size_t>(N) * E);
  be_.copy_to_host(logits.data(), s.router.slice(0, static_cast<std::int64_t>(N) * E));
  MoeRouting& r = routing_[routing_index(chunk, slot, l)];
  r = moe_route(logits.data(), N, T_, E, k, cfg_.expert_capacity);
  const int A = r.assignments();
  if (A > 0) {
    be_.copy_from_host(a.moe_rows.slice(0, A), r.rows.data());
    be_.copy_from_host(a.moe_gates.slice(0, A), r.row_gate.data());
  }
  if (training_forward_ && !recompute) {
    MoeStats& st = moe_stats_;
    for (int e = 0; e < E; ++e) st.routed[static_cast<std::size_t>(l) * E + e] += static_cast<double>(r.routed[e]);
    st.dropped += static_cast<double>(r.dropped);
    st.assignments += static_cast<double>(N) * k;
    st.aux += r.aux;
    st.z += r.z;
    st.calls += 1;
  }
  be_.fill(s.partial.slice(0, static_cast<std::int64_t>(N) * C), 0.0);
  if (ep_->size() > 1) {
    moe_dispatch(r, a, s, in);
    experts_forward(view, a, l, r.local, a.moe_x, s.moe_recv);
    moe_return(r, a, s, s.moe_recv, a.moe_y, C);
  } else {
    const BufferRef x = retyped(s.moe_x, in.type);
    for (int e = 0; e < E; ++e) {
      const int b = r.begin[e], n = r.begin[e + 1] - b;
      if (n == 0) continue;
      const int* w = &h[13 + 4 * static_cast<std::size_t>(e)];
      const BufferRef pre = rows_of(a.fch, b, n, Fl);
      const BufferRef act = rows_of(a.fch_gelu, b, n, Fl);
      const BufferRef y = rows_of(a.moe_y, b, n, C);
      be_.rows_gather(x, in, a.moe_rows.slice(b, n), {}, n, C);
      be_.matmul_forward_gelu(act, pre, x, matmul_operand(view, w[0]), tensor(view, w[1]), n, C, Fl);
      be_.matmul_forward(y, act, matmul_operand(view, w[2]), tp_rank_ == 0 ? tensor(view, w[3]) : BufferRef(), n, Fl,
                         C);
    }
  }
  for (int e = 0; e < E; ++e) {  // expert by expert: a token's rows within one call are distinct
    const int b = r.begin[e], n = r.begin[e + 1] - b;
    if (n > 0)
      be_.rows_scatter_add(s.partial, rows_of(a.moe_y, b, n, C), a.moe_rows.slice(b, n), a.moe_gates.slice(b, n), n, C);
  }
}

// ep > 1, forward: every rank's kept rows for every expert (the exchange's counts), this rank's experts'
// rows expert by expert (r.local) and the permutation between that order and the exchange's (rank by
// rank, each rank's rows expert by expert); then this rank's rows of `in` go to their experts' ranks and
// the rows for its experts arrive, saved expert by expert in a.moe_x.
void GPT::moe_dispatch(MoeRouting& r, const BlockActs& a, const Scratch& s, const BufferRef& in) {
  const int P = ep_->size(), E = cfg_.experts, El = E / P, e0 = ep_->first(E), C = cfg_.d_model;
  std::vector<std::int64_t> mine(static_cast<std::size_t>(E));
  for (int e = 0; e < E; ++e) mine[e] = r.begin[e + 1] - r.begin[e];
  ep_->exchange_counts(mine, r.all_counts);
  const auto count = [&](int q, int e) { return r.all_counts[static_cast<std::size_t>(q) * E + e]; };
  r.local.assign(static_cast<std::size_t>(El) + 1, 0);
  for (int i = 0; i < El; ++i) {
    std::int64_t n = 0;
    for (int q = 0; q < P; ++q) n += count(q, e0 + i);
    r.local[i + 1] = r.local[i] + static_cast<int>(n);
  }
  const int R = r.local[El];
  if (R > geom_.expert_rows())
    throw std::logic_error("GPT: " + std::to_string(R) + " rows for this rank's experts, tables for " +
                           std::to_string(geom_.expert_rows()));
  std::vector<std::int32_t> perm(static_cast<std::size_t>(R)), inv(static_cast<std::size_t>(R));
  std::int64_t from = 0;  // the first row from rank q in the exchange's order
  std::vector<std::int64_t> next(r.local.begin(), r.local.end() - 1);
  for (int q = 0; q < P; ++q)
    for (int i = 0; i < El; ++i)
      for (std::int64_t j = 0; j < count(q, e0 + i); ++j, ++from) {
        perm[static_cast<std::size_t>(next[i])] = static_cast<std::int32_t>(from);
        inv[static_cast<std::size_t>(from)] = static_cast<std::int32_t>(next[i]++);
      }
  if (R > 0) {
    be_.copy_from_host(a.moe_perm.slice(0, R), perm.data());
    be_.copy_from_host(a.moe_inv.slice(0, R), inv.data());
  }
  const int A = r.assignments();
  const BufferRef send = retyped(s.moe_send, in.type);
  const BufferRef recv = retyped(s.moe_recv, in.type);
  be_.rows_gather(send, in, a.moe_rows, {}, A, C);
  ep_->exchange(be_, send, send_rows(r), recv, recv_rows(r), C);
  be_.rows_gather(a.moe_x, recv, a.moe_perm, {}, R, C);
}

// ep > 1: rows [R,C] of this rank's experts, expert by expert (fp32, in `rows`), back to the ranks whose
// tokens they are, arriving in `out` [A,C] in this rank's kept order (s.moe_send the staging).
void GPT::moe_return(const MoeRouting& r, const BlockActs& a, const Scratch& s, const BufferRef& rows,
                     const BufferRef& out, int C) {
  const int R = r.local.back();
  be_.rows_gather(s.moe_send, rows, a.moe_inv, {}, R, C);
  ep_->exchange(be_, s.moe_send, recv_rows(r), out, send_rows(r), C);
}

std::vector<std::int64_t> GPT::send_rows(const MoeRouting& r) const {
  const int P = ep_->size(), E = cfg_.experts, El = E / P;
  std::vector<std::int64_t> rows(static_cast<std::size_t>(P), 0);
  for (int e = 0; e < E; ++e) rows[static_cast<std::size_t>(e / El)] += r.begin[e + 1] - r.begin[e];
  return rows;
}

std::vector<std::int64_t> GPT::recv_rows(const MoeRouting& r) const {
  const int P = ep_->size(), E = cfg_.experts, El = E / P, e0 = ep_->first(E);
  std::vector<std::int64_t> rows(static_cast<std::size_t>(P), 0);
  for (int q = 0; q < P; ++q)
    for (int i = 0; i < El; ++i)
      rows[static_cast<std::size_t>(q)] += r.all_counts[static_cast<std::size_t>(q) * E + e0 + i];
  return rows;
}

void GPT::experts_forward(const ParamStore::UnitView& view, const BlockActs& a, int l, const std::vector<int>& begin,
                          const BufferRef& x, const BufferRef& y) {
  const int C = cfg_.d_model, Fl = cfg_.expert_ffn() / tp_, e0 = ep_->first(cfg_.experts);
  const std::vector<int>& h = block_tensors_[static_cast<std::size_t>(l)];
  for (std::size_t i = 0; i + 1 < begin.size(); ++i) {
    const std::int64_t b = begin[i], n = begin[i + 1] - b;
    if (n == 0) continue;
    const int* w = &h[13 + 4 * (static_cast<std::size_t>(e0) + i)];
    const BufferRef act = rows_of(a.fch_gelu, b, n, Fl);
    be_.matmul_forward_gelu(act, rows_of(a.fch, b, n, Fl), rows_of(x, b, n, C), matmul_operand(view, w[0]),
                            tensor(view, w[1]), static_cast<int>(n), C, Fl);
    be_.matmul_forward(rows_of(y, b, n, C), act, matmul_operand(view, w[2]),
                       tp_rank_ == 0 ? tensor(view, w[3]) : BufferRef(), static_cast<int>(n), Fl, C);
  }
}

void GPT::experts_backward(const ParamStore::UnitView& view, const BlockActs& a, const Scratch& s, int l,
                           const std::vector<int>& begin, const BufferRef& x, const BufferRef& dy,
                           const BufferRef& dx) {
  const int C = cfg_.d_model, Fl = cfg_.expert_ffn() / tp_, e0 = ep_->first(cfg_.experts);
  const std::vector<int>& h = block_tensors_[static_cast<std::size_t>(l)];
  for (std::size_t i = 0; i + 1 < begin.size(); ++i) {
    const std::int64_t b = begin[i], n = begin[i + 1] - b;
    if (n == 0) continue;
    const int* w = &h[13 + 4 * (static_cast<std::size_t>(e0) + i)];
    const int rows = static_cast<int>(n);
    be_.matmul_backward(s.dfch_gelu, tensor_grad(view, w[2]), tensor_grad(view, w[3]), rows_of(dy, b, n, C),
                        rows_of(a.fch_gelu, b, n, Fl), matmul_operand(view, w[2]), rows, Fl, C);
    be_.gelu_bias_backward(s.dfch, tensor_grad(view, w[1]), rows_of(a.fch, b, n, Fl), s.dfch_gelu, rows, Fl);
    be_.matmul_backward(rows_of(dx, b, n, C), tensor_grad(view, w[0]), {}, s.dfch, rows_of(x, b, n, C),
                        matmul_operand(view, w[0]), rows, C, Fl);
  }
}

// dy [N,C] the gradient of the experts' summed output (every token's). Expert by expert: its gates'
// gradient (dot of dy with its saved output; a partial sum under tp, summed over the group after), its
// MLP's backward on the gated dy, its input gradient added into s.dpartial; then the router's backward
// on the host and its input gradient (tp rank 0 adds it: every rank computes the same). With ep > 1
// the gated dy goes to the experts' ranks and their input gradient comes back.
void GPT::moe_backward(const ParamStore::UnitView& view, const BlockActs& a, const Scratch& s, const BufferRef& dy,
                       int chunk, int slot, int l, int N) {
  const int C = cfg_.d_model, E = cfg_.experts, Fl = cfg_.expert_ffn() / tp_;
  const std::int64_t NC = static_cast<std::int64_t>(N) * C;
  const std::vector<int>& h = block_tensors_[static_cast<std::size_t>(l)];
  const MoeRouting& r = routing_[routing_index(chunk, slot, l)];
  const BufferRef in = input_of(a.ln2, s.full, N, C);
  be_.fill(s.dpartial.slice(0, NC), 0.0);
  const int A = r.assignments();
  if (ep_->size() > 1) {
    be_.rows_dot(s.dgate, dy, a.moe_rows, a.moe_y, A, C);
    be_.rows_gather(s.moe_send, dy, a.moe_rows, a.moe_gates, A, C);  // d y = gate * dy, to the experts
    ep_->exchange(be_, s.moe_send, send_rows(r), s.moe_recv, recv_rows(r), C);
    be_.rows_gather(s.moe_dy, s.moe_recv, a.moe_perm, {}, r.local.back(), C);
    experts_backward(view, a, s, l, r.local, a.moe_x, s.moe_dy, s.moe_recv);
    moe_return(r, a, s, s.moe_recv, s.moe_dy, C);  // each row's input gradient, home
    for (int e = 0; e < E; ++e) {
      const int b = r.begin[e], n = r.begin[e + 1] - b;
      if (n > 0) be_.rows_scatter_add(s.dpartial, rows_of(s.moe_dy, b, n, C), a.moe_rows.slice(b, n), {}, n, C);
    }
  } else {
    const BufferRef x = retyped(s.moe_x, in.type);
    for (int e = 0; e < E; ++e) {
      const int b = r.begin[e], n = r.begin[e + 1] - b;
      if (n == 0) continue;
      const int* w = &h[13 + 4 * static_cast<std::size_t>(e)];
      const BufferRef rows = a.moe_rows.slice(b, n), gates = a.moe_gates.slice(b, n);
      const BufferRef pre = rows_of(a.fch, b, n, Fl);
      const BufferRef act = rows_of(a.fch_gelu, b, n, Fl);
      const BufferRef y = rows_of(a.moe_y, b, n, C);
      be_.rows_dot(s.dgate.slice(b, n), dy, rows, y, n, C);
      be_.rows_gather(s.moe_dy, dy, rows, gates, n, C);  // d y_e = gate * dy
      be_.matmul_backward(s.dfch_gelu, tensor_grad(view, w[2]), tensor_grad(view, w[3]), s.moe_dy, act,
                          matmul_operand(view, w[2]), n, Fl, C);
      be_.gelu_bias_backward(s.dfch, tensor_grad(view, w[1]), pre, s.dfch_gelu, n, Fl);
      be_.rows_gather(x, in, rows, {}, n, C);
      be_.matmul_backward(s.partial, tensor_grad(view, w[0]), {}, s.dfch, x, matmul_operand(view, w[0]), n, C, Fl);
      be_.rows_scatter_add(s.dpartial, s.partial, rows, {}, n, C);
    }
  }
  std::vector<float> dgate(static_cast<std::size_t>(A)), dlogits(static_cast<std::size_t>(N) * E);
  if (A > 0) {
    part_->sum_over_group(s.dgate.slice(0, A));
    be_.copy_to_host(dgate.data(), s.dgate.slice(0, A));
  }
  moe_router_backward(dlogits.data(), r, dgate.data(), cfg_.moe_aux_loss, cfg_.moe_z_loss, backward_dloss_);
  be_.copy_from_host(s.router.slice(0, static_cast<std::int64_t>(N) * E), dlogits.data());
  be_.matmul_backward(s.dfull, tensor_grad(view, h[12]), {}, s.router, in, matmul_operand(view, h[12]), N, C, E);
  if (tp_rank_ == 0) be_.residual_forward(s.dpartial, s.dpartial, s.dfull, NC);
}

}  // namespace loom
