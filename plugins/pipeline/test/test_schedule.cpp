// The pipeline's schedules as data: the orders' shapes, what they hold, and the replay that turns
// measured op times into the bubble the schedule would leave with free communication. With equal
// stages and equal op times the replay must give the textbook span (m + (p-1)/v)(f+b).
#include <gtest/gtest.h>

#include <stdexcept>
#include <vector>

#include "plugins/pipeline/schedule.hpp"

namespace loom::pipeline {
namespace {

struct Layout {
  Kind kind;
  int p, m, v;
};

std::vector<std::vector<Op>> all_orders(const Layout& l) {
  std::vector<std::vector<Op>> orders;
  for (int s = 0; s < l.p; ++s) orders.push_back(stage_order(l.kind, l.m, l.p, s, l.v));
  return orders;
}

// Every op of stage s lasts f_s / v (forward) or b_s / v (backward): a chunk is 1/v of a stage.
std::vector<std::vector<double>> op_times(const std::vector<std::vector<Op>>& orders, const std::vector<double>& f,
                                          const std::vector<double>& b, int v) {
  std::vector<std::vector<double>> ms(orders.size());
  for (std::size_t s = 0; s < orders.size(); ++s)
    for (const Op& op : orders[s]) ms[s].push_back((op.kind == 'F' ? f[s] : b[s]) / v);
  return ms;
}

TEST(PipelineSchedule, EveryOrderRunsEachForwardAndBackwardOnce) {
  for (Layout l : {Layout{Kind::gpipe, 4, 8, 1}, Layout{Kind::one_f_one_b, 4, 8, 1}, Layout{Kind::one_f_one_b, 4, 8, 2},
                   Layout{Kind::one_f_one_b, 2, 4, 3}})
    for (int s = 0; s < l.p; ++s) {
      std::vector<int> fwd(l.m * l.v, 0), bwd(l.m * l.v, 0);
      for (const Op& op : stage_order(l.kind, l.m, l.p, s, l.v)) {
        auto& seen = op.kind == 'F' ? fwd : bwd;
        ++seen[op.k * l.v + op.chunk];
        if (op.kind == 'B') {
          EXPECT_EQ(fwd[op.k * l.v + op.chunk], 1) << "backward before its forward, stage " << s;
        }
      }
      for (int n : fwd) EXPECT_EQ(n, 1);
      for (int n : bwd) EXPECT_EQ(n, 1);
    }
}

TEST(PipelineSchedule, GPipeHoldsAllMicroBatchesOneFOneBAtMostPMinusStage) {
  const int p = 4, m = 8;
  for (int s = 0; s < p; ++s) {
    EXPECT_EQ(activation_slots(stage_order(Kind::gpipe, m, p, s, 1), 1)[0], m);
    EXPECT_EQ(activation_slots(stage_order(Kind::one_f_one_b, m, p, s, 1), 1)[0], p - s);
  }
}

TEST(PipelineSchedule, ReplayOfEqualStagesGivesTheTextbookSpan) {
  const double f = 1.0, b = 2.0;
  for (Layout l :
       {Layout{Kind::gpipe, 2, 1, 1}, Layout{Kind::gpipe, 2, 8, 1}, Layout{Kind::gpipe, 4, 4, 1},
        Layout{Kind::one_f_one_b, 2, 1, 1}, Layout{Kind::one_f_one_b, 2, 8, 1}, Layout{Kind::one_f_one_b, 4, 8, 1},
        Layout{Kind::one_f_one_b, 4, 3, 1}, Layout{Kind::one_f_one_b, 2, 4, 2}, Layout{Kind::one_f_one_b, 4, 8, 2},
        Layout{Kind::one_f_one_b, 2, 8, 4}}) {
    const auto orders = all_orders(l);
    const double span =
        replay_span(orders, op_times(orders, std::vector<double>(l.p, f), std::vector<double>(l.p, b), l.v), l.m, l.v);
    // (m + (p-1)/v)(f+b): each stage computes m(f+b), so the bubble is (p-1)/(vm+p-1).
    EXPECT_NEAR(span, (l.m + (l.p - 1.0) / l.v) * (f + b), 1e-9)
        << (l.kind == Kind::gpipe ? "gpipe" : "1f1b") << " p " << l.p << " m " << l.m << " v " << l.v;
  }
}

TEST(PipelineSchedule, ReplayFollowsTheSlowestStage) {
  // Stage 1 twice as slow. GPipe, m = 2, worked by hand: stage 0 F0 [0,1] F1 [1,2]; stage 1 F0 [1,3]
  // F1 [3,5] B0 [5,7] B1 [7,9]; stage 0 B0 [7,8] B1 [9,10].
  {
    const auto orders = all_orders({Kind::gpipe, 2, 2, 1});
    EXPECT_DOUBLE_EQ(replay_span(orders, op_times(orders, {1, 2}, {1, 2}, 1), 2, 1), 10.0);
  }
  // 1F1B at m micro-batches: the slow stage runs back to back once the first forward reaches it,
  // span = f0 + m (f1 + b1) + b0.
  {
    const int m = 6;
    const auto orders = all_orders({Kind::one_f_one_b, 2, m, 1});
    EXPECT_DOUBLE_EQ(replay_span(orders, op_times(orders, {1, 3}, {2, 5}, 1), m, 1), 1 + m * (3 + 5) + 2);
  }
}

TEST(PipelineSchedule, ReplayRefusesOrdersThatDeadlock) {
  // Stage 1 wants micro-batch 1 before 0 while stage 0 waits for micro-batch 0's gradient first.
  std::vector<std::vector<Op>> orders = {{{'F', 0, 0}, {'B', 0, 0}, {'F', 0, 1}, {'B', 0, 1}},
                                         {{'F', 0, 1}, {'B', 0, 1}, {'F', 0, 0}, {'B', 0, 0}}};
  const std::vector<std::vector<double>> ms(2, std::vector<double>(4, 1.0));
  EXPECT_THROW(replay_span(orders, ms, 2, 1), std::logic_error);
}

}  // namespace
}  // namespace loom::pipeline
