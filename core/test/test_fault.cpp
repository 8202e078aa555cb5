// How a rank's error reaches stderr: every line carries the rank, so that lines of ranks failing at
// once can be told apart (each message also goes out in one write, which this cannot observe).
#include <gtest/gtest.h>

#include "core/comm/fault.hpp"

TEST(RankErrorText, EveryLineNamesTheRank) {
  EXPECT_EQ(loom::rank_error_text(3, "data plugin: injected fault at step 3"),
            "loom: rank 3: error: data plugin: injected fault at step 3\n");
  EXPECT_EQ(loom::rank_error_text(1, "first line\nsecond line\n"),
            "loom: rank 1: error: first line\nloom: rank 1: error: second line\n");
  EXPECT_EQ(loom::rank_error_text(0, ""), "loom: rank 0: error: \n");
}
