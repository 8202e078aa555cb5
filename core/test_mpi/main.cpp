// MPI unit tests: every rank runs every test; rank 0 prints gtest's report, the other ranks print
// only their failures (prefixed with the rank); the exit status is non-zero if any rank failed.
// Kokkos is initialised: the communicators' ring scratch buffers are host Views filed in the ledger.
#include <Kokkos_Core.hpp>
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <string>

#include "core/backend/blas_core.hpp"

namespace {

// On ranks other than 0, replaces the default printer: reports failed assertions only.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  // (UnitTest::current_test_info() would deadlock inside OnTestPartResult: gtest holds its lock.)
  void OnTestStart(const ::testing::TestInfo& t) override { test_ = std::string(t.test_suite_name()) + "." + t.name(); }
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s: %s:%d: failure\n%s\n", rank_, test_.c_str(),
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.message());
  }
  void OnTestEnd(const ::testing::TestInfo& t) override {
    if (t.result()->Failed()) std::fprintf(stderr, "[rank %d] FAILED %s\n", rank_, test_.c_str());
  }

 private:
  int rank_;
  std::string test_;
};

}  // namespace

int main(int argc, char** argv) {
  loom::select_openblas_core(argv);  // the driver's kernel-set rule: the tests check what loom runs
  MPI_Init(&argc, &argv);
  int failed = 0, rank = 0;
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    ::testing::InitGoogleTest(&argc, argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank != 0) {
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new RankFailurePrinter(rank));
    }
    failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  }
  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && any_failed && !failed) std::fprintf(stderr, "some rank other than 0 failed (see above)\n");
  MPI_Finalize();
  return any_failed;
}
