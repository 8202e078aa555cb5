// MPI unit tests: every rank runs every test; rank 0 prints gtest's report, the other ranks print
// only their failures (prefixed with the rank); the exit status is non-zero if any rank failed.
// Kokkos is not initialised: the communicators work on plain host pointers.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>

namespace {

// On ranks other than 0, replaces the default printer: reports failed assertions only.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    const ::testing::TestInfo* t = ::testing::UnitTest::GetInstance()->current_test_info();
    std::fprintf(stderr, "[rank %d] %s.%s: %s:%d: failure\n%s\n", rank_, t ? t->test_suite_name() : "?",
                 t ? t->name() : "?", r.file_name() ? r.file_name() : "?", r.line_number(), r.message());
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && any_failed && !failed) std::fprintf(stderr, "some rank other than 0 failed (see above)\n");
  MPI_Finalize();
  return any_failed;
}
