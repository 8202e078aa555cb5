// Unit tests of core: Kokkos must be initialised around them.
#include <gtest/gtest.h>

#include <Kokkos_Core.hpp>

#include "core/backend/blas_core.hpp"

int main(int argc, char** argv) {
  loom::select_openblas_core(argv);  // the driver's kernel-set rule: the tests check what loom runs
  ::testing::InitGoogleTest(&argc, argv);
  Kokkos::ScopeGuard kokkos(argc, argv);
  return RUN_ALL_TESTS();
}
