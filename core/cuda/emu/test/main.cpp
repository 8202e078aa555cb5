// The emulator's tests. The host twin of the fused attention runs loom's products: Kokkos is
// initialised around them and OpenBLAS takes the kernel set loom takes.
#include <gtest/gtest.h>

#include <Kokkos_Core.hpp>

#include "core/backend/blas_core.hpp"

int main(int argc, char** argv) {
  loom::select_openblas_core(argv);  // the driver's kernel-set rule: the twin's products are loom's
  ::testing::InitGoogleTest(&argc, argv);
  Kokkos::ScopeGuard kokkos(argc, argv);
  return RUN_ALL_TESTS();
}
