// Unit tests of io.
#include <gtest/gtest.h>

#include "core/backend/blas_core.hpp"

int main(int argc, char** argv) {
  loom::select_openblas_core(argv);  // the driver's kernel-set rule: the tests check what loom runs
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
