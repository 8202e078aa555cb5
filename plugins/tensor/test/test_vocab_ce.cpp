// The vocabulary-parallel cross-entropy of the tensor plugin against the plain one: every rank holds
// V/tp columns of the logits; losses (on every rank) and each rank's slice of the softmax and of the
// gradient must match the single-rank kernel on the whole logits, and the fused classifier the two
// passes. Runs at 1, 2 and 4 ranks.
#include <gtest/gtest.h>
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <cmath>
#include <random>

#include "core/backend/backend.hpp"
#include "core/backend/blas_core.hpp"
#include "core/base/error.hpp"
#include "core/comm/grid.hpp"
#include "core/engine/plugin.hpp"
#include "io/deck.hpp"

using namespace loom;

namespace {
int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}
}  // namespace

// A host vector as the typed buffer a back-end operation takes.
template <class T>
loom::BufferRef buf(const std::vector<T>& v) {
  return loom::BufferRef(v.data(), static_cast<std::int64_t>(v.size()));
}

TEST(VocabParallelCrossEntropy, MatchesPlainCrossEntropy) {
  const int tp = world_size();
  const int N = 37, V = 192;  // V divisible by 1, 2 and 4
  ASSERT_EQ(V % tp, 0);
  StrategyRegistry registry;
  register_builtin_strategies(registry);
  discover_plugins(registry, {LOOM_PLUGIN_DIR});
  const StrategyInfo* tensor = registry.find("tensor");
  ASSERT_NE(tensor, nullptr) << "libloom_tensor.so not found in " << LOOM_PLUGIN_DIR;
  DeckSchema schema;
  add_core_keys(schema);
  for (const auto& k : tensor->keys) schema.add(k);
  for (const bool sp : {false, true}) {
    const Deck deck =
        parse_deck(schema, std::string("[tensor]\nsequence_parallel = ") + (sp ? "true" : "false"), "test");
    Layout layout;
    layout.tp = tp;
    ProcessGrid grid(MPI_COMM_WORLD, layout);
    auto backend = make_host_backend(1);
    GPTConfig model;
    PartitionContext ctx{deck, grid, *backend, model};
    auto part = tensor->make_partition(ctx);
    ASSERT_EQ(part->size(), tp);

    // The same logits and targets on every rank (same seed), spread so the softmax is not flat.
    std::mt19937 gen(1234);
    std::normal_distribution<float> dist(0.0f, 3.0f);
    std::vector<float> logits(static_cast<std::size_t>(N) * V);
    for (auto& x : logits) x = dist(gen);
    std::vector<std::int32_t> targets(N);
    for (int r = 0; r < N; ++r) targets[r] = static_cast<std::int32_t>(gen() % V);
    targets[0] = V - 1;  // the last rank's slice
    targets[1] = 0;      // the first rank's slice

    std::vector<float> losses_ref(N), probs_ref(logits.size()), dref(logits.size());
    backend->crossentropy_forward(buf(losses_ref), buf(probs_ref), buf(logits), buf(targets), N, V);
    backend->crossentropy_backward(buf(dref), buf(probs_ref), buf(targets), 0.5f, N, V, 0);

    const int Vl = V / tp, begin = part->rank() * Vl;
    std::vector<float> local(static_cast<std::size_t>(N) * Vl), losses(N), probs(local.size()), dlocal(local.size());
    for (int r = 0; r < N; ++r)
      for (int v = 0; v < Vl; ++v)
        local[static_cast<std::size_t>(r) * Vl + v] = logits[static_cast<std::size_t>(r) * V + begin + v];
    part->crossentropy_forward(*backend, buf(losses), buf(probs), buf(local), buf(targets), N, Vl, begin);
    part->crossentropy_backward(*backend, buf(dlocal), buf(probs), buf(targets), 0.5f, N, Vl, begin);
    for (int r = 0; r < N; ++r) {
      EXPECT_NEAR(losses[r], losses_ref[r], 2e-6 * std::max(1.0f, std::abs(losses_ref[r]))) << "row " << r;
      for (int v = 0; v < Vl; ++v) {
        const std::size_t g = static_cast<std::size_t>(r) * V + begin + v, l = static_cast<std::size_t>(r) * Vl + v;
        EXPECT_NEAR(probs[l], probs_ref[g], 1e-6) << "row " << r << " col " << begin + v;
        EXPECT_NEAR(dlocal[l], dref[g], 1e-6) << "row " << r << " col " << begin + v;
      }
    }
    // The fused classifier over the group: the same losses and this rank's gradient bit for bit, in
    // place over this rank's logits.
    std::vector<float> fused_losses(N), table = local;
    part->crossentropy_fused(*backend, buf(fused_losses), buf(table), buf(table), buf(targets), 0.5f, N, Vl, begin);
    EXPECT_EQ(fused_losses, losses);
    EXPECT_EQ(table, dlocal);
  }
}

int main(int argc, char** argv) {
  loom::select_openblas_core(argv);  // the driver's kernel-set rule: the tests check what loom runs
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int failed = 0;
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    ::testing::InitGoogleTest(&argc, argv);
    if (rank != 0) {
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
    }
    failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  }
  MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return failed;
}
