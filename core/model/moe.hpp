#pragma once
// Mixture of experts: the router's arithmetic, on the host (DESIGN.md "Mixture of experts"). A block
// with experts replaces its MLP by E expert MLPs and a router, logits = x Wr^T [N,E]; each token goes to
// the k experts of highest softmax probability, weighted by those probabilities renormalised over the k.
// Everything that groups tokens is per sequence (T tokens), so it is the same whichever rank holds which
// sequences: the capacity an expert has (ceil(capacity_factor * T * k / E) assignments of a sequence,
// taken in token order, each token's choices in the router's order, so that routing is causal; 0:
// dropless), and the load-balancing loss (Switch/GShard's
// E * sum_e f_e P_e, f_e the share of the sequence's assignments routed to e, P_e its mean probability,
// averaged over sequences: DeepSeek-V3's sequence-wise form). The router z-loss is the mean over tokens
// of logsumexp(logits)^2 (ST-MoE).
#include <cstdint>
#include <vector>

namespace loom {

struct MoeRouting {
  int N = 0, T = 0, E = 0, k = 0;  // tokens, tokens a sequence, experts, experts a token
  std::vector<double> probs;       // [N,E] softmax of the logits
  std::vector<double> lse;         // [N] log-sum-exp of the logits
  std::vector<int> choice;         // [N,k] each token's experts, by falling probability (ties: lower index)
  std::vector<double> gate;        // [N,k] their probabilities over the k's sum
  std::vector<char> kept;          // [N,k] within the expert's capacity
  std::vector<double> share;       // [N/T, E] f: share of each sequence's N*k assignments routed to e
  // The kept assignments, by expert: expert e's are [begin[e], begin[e+1]), in token order.
  std::vector<int> begin;            // [E+1]
  std::vector<std::int32_t> rows;    // [kept] the token row
  std::vector<float> row_gate;       // [kept] its gate
  std::vector<int> slot;             // [kept] its place t*k + j in choice/gate
  std::vector<std::int64_t> routed;  // [E] assignments routed to e, kept or not
  std::int64_t dropped = 0;          // assignments over capacity
  double aux = 0, z = 0;             // the load-balancing loss and the z-loss of these tokens
  // Expert parallelism: every rank's kept rows for every expert [ep, E] (ExpertSplit::exchange_counts),
  // and this rank's experts' rows, expert by expert: local expert i's are [local[i], local[i+1]).
  std::vector<std::int64_t> all_counts;
  std::vector<int> local;
  int assignments() const { return begin.empty() ? 0 : begin.back(); }
};

// Routes N tokens (N/T sequences of T) given the router's logits [N,E]; capacity_factor 0: dropless.
MoeRouting moe_route(const float* logits, int N, int T, int E, int k, double capacity_factor);
MoeRouting moe_route(const double* logits, int N, int T, int E, int k, double capacity_factor);

// The gradient of the router's logits, dlogits [N,E], from the gradient of each kept assignment's gate
// (dgate [assignments], in `rows` order) and the auxiliary losses' weights: the objective is
// (what gave dgate) + scale * (aux_weight * aux + z_weight * z), scale the backward's dloss.
void moe_router_backward(float* dlogits, const MoeRouting& r, const float* dgate, double aux_weight, double z_weight,
                         double scale);

}  // namespace loom
