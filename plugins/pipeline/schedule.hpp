// The pipeline's schedules as data: which forwards and backwards each stage runs in what order,
// what that order holds in memory, and how long it takes when every op's time is known and messages
// are free. Plain functions, no MPI, so that the unit tests reach them (plugins/pipeline/test/).
#pragma once

#include <vector>

namespace loom::pipeline {

enum class Kind { gpipe, one_f_one_b };

// One unit of a stage's work: the forward ('F') or backward ('B') of micro-batch k on chunk c.
struct Op {
  char kind;
  int chunk, k;
};

// The order of work on stage i of p with v chunks (virtual stages) per stage and m micro-batches.
//   gpipe: every forward, then every backward (v = 1).
//   1f1b, v = 1: p-i-1 warm-up forwards, then one forward / one backward, then the cool-down.
//   1f1b, v > 1 (Megatron's interleaved schedule; m a multiple of p): forwards go through the
//   chunks in groups of p micro-batches, backwards through the chunks in reverse; warm-up
//   2(p-i-1) + (v-1)p forwards.
std::vector<Op> stage_order(Kind kind, int m, int p, int i, int v);

// The most micro-batches each of the v chunks holds activations for at once under that order.
std::vector<int> activation_slots(const std::vector<Op>& ops, int v);

// The span the stages' orders take when every op lasts what it was measured to last and messages
// arrive the moment they are sent: a replay of the step's dependency graph. op_ms[s][q] is the
// duration of orders[s][q]. Model chunk j = c p + s (chunk c of stage s); F(k, j) needs F(k, j-1),
// B(k, j) needs B(k, j+1), the last chunk's B(k) its own F(k). Throws std::logic_error if the
// orders deadlock.
double replay_span(const std::vector<std::vector<Op>>& orders, const std::vector<std::vector<double>>& op_ms, int m,
                   int v);

}  // namespace loom::pipeline
