// ZeRO stages 2 and 3's parameter store (plugins/zero/zero_sharded.hpp) under 1, 2 and 4 ranks:
// ownership (every element of every tensor has exactly one primary owner in the job, and the shares
// are shard_counts of the sharded range), slices (what a rank owns holds the values one process
// draws there), gathers (a stage-3 unit acquired on any rank is the whole tensor, bit for bit, and
// after an update to the shares it is the updated one; stage 2's refresh does the same for its whole
// copy), and gradient shares (a unit's staged gradients, reduce-scattered, land in their owners'
// shares). Kept-whole tensors (tied, or under zero.param_persistence_threshold at stage 3) are on
// every rank whole. Every rank runs every test.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/comm/comm.hpp"
#include "core/comm/grid.hpp"
#include "core/model/gpt.hpp"
#include "core/test_mpi/ranks.hpp"
#include "plugins/zero/zero_sharded.hpp"

namespace loom {
namespace {

using testing::world_rank;
using testing::world_size;

GPTConfig small_config() {
  GPTConfig c;
  c.layers = 3;
  c.d_model = 32;
  c.heads = 4;
  c.seq_len = 8;
  c.vocab = 37;
  return c;
}

// One store on the data-parallel grid of the whole world, and the same model on one process (the
// flat store) as the reference.
struct Sharded {
  std::unique_ptr<Backend> be = make_host_backend(1);
  ProcessGrid grid{MPI_COMM_WORLD, Layout{world_size(), 1, 1}};
  ShardedStore store;
  std::unique_ptr<GPT> model, whole;
  Sharded(int stage, std::int64_t persist_below) : store(grid.dp(), stage, persist_below, 1) {
    model = std::make_unique<GPT>(small_config(), *be, 2, nullptr, Stage{}, &store, world_size(), world_rank());
    whole = std::make_unique<GPT>(small_config(), *be, 2);
    model->init_weights(3);
    whole->init_weights(3);
  }
  const float* reference(int i) { return whole->store().param(i).as<float>(); }
  std::int64_t numel(int i) const { return model->params()[static_cast<std::size_t>(i)].numel(); }
  int tensors() const { return static_cast<int>(model->params().size()); }
};

// Each rank's owned slices, gathered on every rank: (rank, param, begin, end, primary).
std::vector<std::tuple<int, int, std::int64_t, std::int64_t, bool>> all_owned(const ParamStore& store) {
  std::vector<std::int64_t> mine;
  for (const OwnedSlice& o : store.owned()) mine.insert(mine.end(), {o.param, o.begin, o.end, o.primary ? 1 : 0});
  int n = static_cast<int>(mine.size());
  std::vector<int> counts(static_cast<std::size_t>(world_size())), displs(counts.size());
  MPI_Allgather(&n, 1, MPI_INT, counts.data(), 1, MPI_INT, MPI_COMM_WORLD);
  int total = 0;
  for (std::size_t q = 0; q < counts.size(); ++q) {
    displs[q] = total;
    total += counts[q];
  }
  std::vector<std::int64_t> all(static_cast<std::size_t>(total));
  MPI_Allgatherv(mine.data(), n, MPI_INT64_T, all.data(), counts.data(), displs.data(), MPI_INT64_T, MPI_COMM_WORLD);
  std::vector<std::tuple<int, int, std::int64_t, std::int64_t, bool>> out;
  for (std::size_t q = 0; q < counts.size(); ++q)
    for (int k = displs[q]; k < displs[q] + counts[q]; k += 4)
      out.emplace_back(static_cast<int>(q), static_cast<int>(all[k]), all[k + 1], all[k + 2], all[k + 3] != 0);
  return out;
}

class ZeroShardedStore : public ::testing::TestWithParam<std::tuple<int, std::int64_t>> {};

TEST_P(ZeroShardedStore, EveryElementHasOnePrimaryOwnerAndTheSharesAreShardCounts) {
  const auto [stage, persist] = GetParam();
  Sharded s(stage, persist);
  std::vector<std::vector<int>> primary(static_cast<std::size_t>(s.tensors()));
  for (int i = 0; i < s.tensors(); ++i) primary[static_cast<std::size_t>(i)].assign(s.numel(i), 0);
  for (const auto& [rank, param, begin, end, is_primary] : all_owned(s.store)) {
    ASSERT_GE(param, 0);
    ASSERT_LT(param, s.tensors());
    ASSERT_LE(0, begin);
    ASSERT_LT(begin, end);
    ASSERT_LE(end, s.numel(param));
    if (is_primary)
      for (std::int64_t k = begin; k < end; ++k) ++primary[static_cast<std::size_t>(param)][k];
  }
  for (int i = 0; i < s.tensors(); ++i) {
    int wrong = 0;
    for (int c : primary[static_cast<std::size_t>(i)]) wrong += c != 1;
    EXPECT_EQ(wrong, 0) << s.model->params()[static_cast<std::size_t>(i)].name
                        << ": elements without exactly one primary owner";
  }
  // The sharded range is cut as shard_counts cuts it; each rank's share is its count.
  std::int64_t sharded = 0;
  for (int i = 0; i < s.tensors(); ++i)
    if (!s.store.kept_whole(i)) sharded += s.numel(i);
  const std::vector<std::int64_t> want = shard_counts(sharded, world_size());
  EXPECT_EQ(s.store.rank_counts(0, sharded), want);
  EXPECT_EQ(s.store.share(), want[static_cast<std::size_t>(world_rank())]);
  // Kept whole: tied tensors always, and at stage 3 those under the threshold.
  for (int i = 0; i < s.tensors(); ++i) {
    const ParamInfo& p = s.model->params()[static_cast<std::size_t>(i)];
    const bool whole = p.tied || (stage == 3 && p.numel() < persist);
    EXPECT_EQ(s.store.kept_whole(i), whole) << p.name;
  }
  // local_numel: the parameter count P of this rank's tensors (the textbook's P), not the share held.
  std::int64_t all = 0;
  for (int i = 0; i < s.tensors(); ++i) all += s.numel(i);
  EXPECT_EQ(s.store.local_numel(), all);
}

TEST_P(ZeroShardedStore, OwnedSlicesHoldTheValuesOneProcessDraws) {
  const auto [stage, persist] = GetParam();
  Sharded s(stage, persist);
  for (const OwnedSlice& o : s.store.owned()) {
    const BufferRef got = s.store.owned_param(o);
    ASSERT_EQ(got.count, o.size());
    EXPECT_EQ(std::memcmp(got.as<float>(), s.reference(o.param) + o.begin, static_cast<std::size_t>(o.size()) * 4), 0)
        << s.model->params()[static_cast<std::size_t>(o.param)].name << " [" << o.begin << ", " << o.end << ")";
  }
}

// Every unit acquired (forward) on every rank is the whole tensors: stage 3 gathers them, stage 2 keeps
// them. Then each rank adds its rank+1 to the elements it owns (as its optimizer would update them)
// and, after refresh, every unit acquired is the reference plus the owner's number everywhere.
TEST_P(ZeroShardedStore, AUnitAcquiredIsTheWholeTensorsBeforeAndAfterAnUpdate) {
  const auto [stage, persist] = GetParam();
  Sharded s(stage, persist);
  auto check_units = [&](const std::vector<std::vector<float>>& want, const char* when) {
    s.store.zero_grads();
    for (int u = 0; u < static_cast<int>(s.model->units().size()); ++u) {
      const ParamStore::UnitView& v = s.store.acquire(u, ParamStore::Use::forward, -1);
      const Unit& unit = s.model->units()[static_cast<std::size_t>(u)];
      ASSERT_EQ(v.params.size(), unit.params.size());
      for (std::size_t j = 0; j < unit.params.size(); ++j) {
        const int i = unit.params[j];
        ASSERT_EQ(v.params[j].count, s.numel(i));
        EXPECT_EQ(std::memcmp(v.params[j].as<float>(), want[static_cast<std::size_t>(i)].data(),
                              static_cast<std::size_t>(s.numel(i)) * 4),
                  0)
            << when << ": " << s.model->params()[static_cast<std::size_t>(i)].name << " in unit " << unit.name;
      }
      s.store.release(u, ParamStore::Use::forward);
    }
    s.store.end_step();
  };
  std::vector<std::vector<float>> want(static_cast<std::size_t>(s.tensors()));
  for (int i = 0; i < s.tensors(); ++i)
    want[static_cast<std::size_t>(i)].assign(s.reference(i), s.reference(i) + s.numel(i));
  check_units(want, "as drawn");
  // The update: the primary owner's number on its elements (a replica of a kept-whole tensor updates
  // it alike, as every rank's AdamW does with the all-reduced gradient).
  for (const auto& [rank, param, begin, end, is_primary] : all_owned(s.store))
    if (is_primary)
      for (std::int64_t k = begin; k < end; ++k)
        want[static_cast<std::size_t>(param)][k] += static_cast<float>(s.store.kept_whole(param) ? 1 : rank + 1);
  for (const OwnedSlice& o : s.store.owned()) {
    float* p = s.store.owned_param(o).as<float>();
    const float add = static_cast<float>(s.store.kept_whole(o.param) ? 1 : world_rank() + 1);
    for (std::int64_t k = 0; k < o.size(); ++k) p[k] += add;
  }
  s.store.params_written();
  s.store.refresh();
  check_units(want, "after an update");
}

// A unit's staged gradients (each rank writes rank+1 times a value of the element), reduce-scattered
// over the ranks with the counts the store gives, land in the owners' gradient shares as the sum
// over the ranks: (1 + ... + N) times the value.
TEST_P(ZeroShardedStore, StagedGradientsReduceScatteredLandInTheOwnersShares) {
  const auto [stage, persist] = GetParam();
  Sharded s(stage, persist);
  const int n = world_size();
  s.store.zero_grads();
  auto value = [](int i, std::int64_t k) { return 0.25f * static_cast<float>(i + 1) + static_cast<float>(k % 7); };
  for (int u = 0; u < static_cast<int>(s.model->units().size()); ++u) {
    const ParamStore::UnitView& v = s.store.acquire(u, ParamStore::Use::backward, -1);
    const Unit& unit = s.model->units()[static_cast<std::size_t>(u)];
    for (std::size_t j = 0; j < unit.params.size(); ++j) {
      const int i = unit.params[j];
      if (s.store.kept_whole(i)) continue;  // reduced whole by the sync, not through a share
      float* g = v.grads[j].as<float>();
      for (std::int64_t k = 0; k < s.numel(i); ++k) g[k] = static_cast<float>(world_rank() + 1) * value(i, k);
    }
    s.store.release(u, ParamStore::Use::backward);
    const ShardedStore::Staged st = s.store.detach_grads(u);
    if (st.slot < 0) continue;
    const std::vector<std::int64_t> counts = s.store.rank_counts(s.store.unit_lo(u), s.store.unit_hi(u));
    const std::vector<std::int64_t> off = shard_offsets(counts);
    const std::size_t r = static_cast<std::size_t>(world_rank());
    s.grid.dp().reduce_scatter_async(st.grads, st.grads.slice(off[r], counts[r]), counts, ReduceOp::sum)->wait();
    s.store.accumulate(st);
  }
  const float sum = static_cast<float>(n * (n + 1) / 2);
  int wrong = 0, checked = 0;
  for (const OwnedSlice& o : s.store.owned()) {
    if (s.store.kept_whole(o.param)) continue;
    const float* g = s.store.owned_grad(o).as<float>();
    for (std::int64_t k = o.begin; k < o.end; ++k, ++checked) wrong += g[k - o.begin] != sum * value(o.param, k);
  }
  EXPECT_EQ(wrong, 0) << "of " << checked << " owned gradient elements";
  s.store.end_step();
}

// Stage 2 and stage 3, the latter with no tensor kept whole for its size and with the small ones
// (LayerNorm, biases: under 100 elements) kept whole.
INSTANTIATE_TEST_SUITE_P(Stages, ZeroShardedStore,
                         ::testing::Values(std::make_tuple(2, std::int64_t(0)), std::make_tuple(3, std::int64_t(0)),
                                           std::make_tuple(3, std::int64_t(100))),
                         [](const ::testing::TestParamInfo<ZeroShardedStore::ParamType>& p) {
                           return "stage" + std::to_string(std::get<0>(p.param)) + "_persist" +
                                  std::to_string(std::get<1>(p.param));
                         });

}  // namespace
}  // namespace loom
