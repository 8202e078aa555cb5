// The pipeline's schedules as data (see schedule.hpp).
#include "plugins/pipeline/schedule.hpp"

#include <algorithm>
#include <stdexcept>

namespace loom::pipeline {

std::vector<Op> stage_order(Kind kind, int m, int p, int i, int v) {
  std::vector<Op> ops;
  if (kind == Kind::gpipe) {
    for (int k = 0; k < m; ++k) ops.push_back({'F', 0, k});
    for (int k = 0; k < m; ++k) ops.push_back({'B', 0, k});
    return ops;
  }
  const int total = m * v;
  auto forward = [&](int j) { return Op{'F', (j % (p * v)) / p, (j / (p * v)) * p + j % p}; };
  auto backward = [&](int j) { return Op{'B', v - 1 - (j % (p * v)) / p, (j / (p * v)) * p + j % p}; };
  const int warm = std::min(v == 1 ? p - i - 1 : 2 * (p - i - 1) + (v - 1) * p, total);
  for (int j = 0; j < warm; ++j) ops.push_back(forward(j));
  for (int j = 0; j < total - warm; ++j) {
    ops.push_back(forward(warm + j));
    ops.push_back(backward(j));
  }
  for (int j = total - warm; j < total; ++j) ops.push_back(backward(j));
  return ops;
}

std::vector<int> activation_slots(const std::vector<Op>& ops, int v) {
  std::vector<int> held(v, 0), most(v, 1);
  for (const Op& op : ops) {
    held[op.chunk] += op.kind == 'F' ? 1 : -1;
    most[op.chunk] = std::max(most[op.chunk], held[op.chunk]);
  }
  return most;
}

double replay_span(const std::vector<std::vector<Op>>& orders, const std::vector<std::vector<double>>& op_ms, int m,
                   int v) {
  const int p = static_cast<int>(orders.size()), chunks = p * v;
  std::vector<double> f_end(static_cast<std::size_t>(m * chunks), -1), b_end(f_end);
  std::vector<std::size_t> next(p, 0);
  std::vector<double> clock(p, 0.0);
  for (bool moved = true; moved;) {
    moved = false;
    for (int s = 0; s < p; ++s)
      for (; next[s] < orders[s].size(); ++next[s]) {
        const Op& op = orders[s][next[s]];
        const int j = op.chunk * p + s;
        const double need = op.kind == 'F' ? (j > 0 ? f_end[op.k * chunks + j - 1] : 0.0)
                                           : (j + 1 < chunks ? b_end[op.k * chunks + j + 1] : f_end[op.k * chunks + j]);
        if (need < 0) break;  // its input is not produced yet: another stage moves first
        clock[s] = std::max(clock[s], need) + op_ms[s][next[s]];
        (op.kind == 'F' ? f_end : b_end)[op.k * chunks + j] = clock[s];
        moved = true;
      }
  }
  for (int s = 0; s < p; ++s)
    if (next[s] < orders[s].size()) throw std::logic_error("pipeline: the schedule's orders deadlock");
  return *std::max_element(clock.begin(), clock.end());
}

}  // namespace loom::pipeline
