// The parameter store seam (core/model/param_store.hpp) and the shard descriptor (core/base/shard.hpp).
//
// PieceStore keeps each unit's parameters and gradients in its own allocation and hands the model
// a compute copy of a unit's parameters only between acquire and release, poisoned with NaN
// otherwise (as a store that gathers and frees shards would): a model that touched a unit it had
// not acquired would train on NaN. Trained through the engine, it must give the flat store's model
// bit for bit, and the model must have named a correct next unit at every acquire. Under 16-bit
// precision the same comparison checks the flat store's 16-bit compute copies (see below).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <set>

#include "core/engine/engine.hpp"
#include "core/model/gpt.hpp"
#include "core/model/param_store.hpp"
#include "core/test/batches.hpp"
#include "core/base/shard.hpp"

namespace loom {
namespace {

class PieceStore final : public ParamStore {
 public:
  std::string name() const override { return "pieces (one allocation per unit, compute copies while acquired)"; }
  void build(const StoreContext& ctx, const std::vector<ParamInfo>& params, const std::vector<Unit>& units) override {
    be_ = &ctx.backend;
    info_ = params;
    units_ = units;
    for (const Unit& u : units) {
      std::int64_t n = 0;
      for (int i : u.params) n += params[static_cast<std::size_t>(i)].numel();
      Piece p;
      p.master = be_->allocate(u.name + ".params", DType::f32, n, Mem::params);
      p.compute = be_->allocate(u.name + ".compute", DType::f32, n, Mem::workspace);
      p.grads = be_->allocate(u.name + ".grads", DType::f32, n, Mem::grads);
      std::int64_t at = 0;
      for (int i : u.params) {
        const std::int64_t k = params[static_cast<std::size_t>(i)].numel();
        where_[i] = {static_cast<int>(pieces_.size()), at};
        p.view.params.push_back(p.compute.ref().slice(at, k));
        p.view.grads.push_back(p.grads.ref().slice(at, k));
        at += k;
      }
      poison(p);
      pieces_.push_back(std::move(p));
    }
    for (int i = 0; i < static_cast<int>(params.size()); ++i)
      owned_.push_back({i, 0, params[i].numel(), !params[i].shadow});
  }
  const UnitView& acquire(int unit, Use, int next_unit) override {
    Piece& p = pieces_[static_cast<std::size_t>(unit)];
    EXPECT_FALSE(p.held) << units_[unit].name << " acquired twice";
    p.held = true;
    std::memcpy(p.compute.data<float>(), p.master.data<float>(), p.master.bytes());
    acquires.push_back(unit);
    hints.push_back(next_unit);
    return p.view;
  }
  void release(int unit, Use) override {
    Piece& p = pieces_[static_cast<std::size_t>(unit)];
    EXPECT_TRUE(p.held) << units_[unit].name << " released without being acquired";
    p.held = false;
    poison(p);
  }
  BufferRef param(int i) override { return piece_of(i).master.ref().slice(where_[i].second, info_[i].numel()); }
  BufferRef grad(int i) override { return piece_of(i).grads.ref().slice(where_[i].second, info_[i].numel()); }
  void zero_grads() override {
    for (Piece& p : pieces_) be_->fill(p.grads.ref(), 0.0);
  }
  const std::vector<OwnedSlice>& owned() const override { return owned_; }
  std::int64_t local_numel() const override {
    std::int64_t n = 0;
    for (const Piece& p : pieces_) n += p.master.count();
    return n;
  }
  std::vector<int> acquires, hints;  // every acquire's unit and the next unit it named

 private:
  struct Piece {
    TypedBuffer master, compute, grads;
    UnitView view;
    bool held = false;
  };
  Piece& piece_of(int i) { return pieces_[static_cast<std::size_t>(where_[i].first)]; }
  void poison(Piece& p) { be_->fill(p.compute.ref(), std::numeric_limits<double>::quiet_NaN()); }
  BackendFace* be_ = nullptr;
  std::vector<ParamInfo> info_;
  std::vector<Unit> units_;
  std::vector<Piece> pieces_;
  std::map<int, std::pair<int, std::int64_t>> where_;  // tensor -> (piece, offset)
  std::vector<OwnedSlice> owned_;
};

GPTConfig config(bool recompute) {
  GPTConfig c;
  c.layers = 3;
  c.d_model = 32;
  c.heads = 4;
  c.seq_len = 16;
  c.vocab = 29;
  c.recompute = recompute;
  return c;
}

BatchFn batches(const GPTConfig& c) { return testing::random_batches(c); }

std::vector<float> all_params(GPT& m) {
  std::vector<float> out;
  for (int i = 0; i < static_cast<int>(m.params().size()); ++i) {
    const float* p = m.param_ref(i).as<float>();
    out.insert(out.end(), p, p + m.params()[static_cast<std::size_t>(i)].numel());
  }
  return out;
}

// With 16-bit precision the flat store hands out compute copies of the matrix weights (cast once per
// step, after the update) and the model saves the products' inputs in 16 bits; PieceStore has no
// copies, so there each product rounds the fp32 weight itself: the same values, hence the same model
// bit for bit, unless a copy goes stale or a saved input is rounded differently.
void trains_like_flat_store(bool recompute, DType precision = DType::f32) {
  auto be = make_host_backend(1);
  be->set_precision({precision});
  const GPTConfig cfg = config(recompute);
  EngineConfig ec;
  ec.micro_batches = 2;
  ec.rows_per_micro = 2;
  ec.optimizer.lr = 3e-3;
  ec.optimizer.steps = 4;
  ec.optimizer.grad_clip = 0.5;  // clipping active: the norm phase reads every owned gradient
  GPT flat(cfg, *be, ec.rows_per_micro);
  PieceStore pieces;
  GPT split(cfg, *be, ec.rows_per_micro, nullptr, {}, &pieces);
  flat.init_weights(7);
  split.init_weights(7);
  Engine ef(ec, flat, *be), es(ec, split, *be);
  const BatchFn fetch = batches(cfg);
  for (int step = 0; step < 4; ++step) {
    const StepStats a = ef.train_step(step, fetch), b = es.train_step(step, fetch);
    ASSERT_TRUE(std::isfinite(b.loss)) << "step " << step << ": a unit was used without being acquired";
    EXPECT_EQ(a.loss, b.loss) << "step " << step;
    EXPECT_EQ(a.grad_norm, b.grad_norm) << "step " << step;
  }
  const std::vector<float> pa = all_params(flat), pb = all_params(split);
  ASSERT_EQ(pa.size(), pb.size());
  EXPECT_EQ(std::memcmp(pa.data(), pb.data(), pa.size() * sizeof(float)), 0) << "the stores trained different models";
  // Every acquire named as next the unit acquired right after it (or none at a pass's end).
  const auto& u = pieces.acquires;
  const auto& h = pieces.hints;
  int named = 0;
  for (std::size_t k = 0; k + 1 < u.size(); ++k)
    if (h[k] >= 0) {
      ++named;
      EXPECT_EQ(h[k], u[k + 1]) << "acquire " << k << " of " << split.units()[u[k]].name << " named "
                                << split.units()[h[k]].name << " next";
    }
  EXPECT_GT(named, 0);
}

TEST(ParamStore, PerUnitPiecesTrainTheSameModelAsTheFlatStore) { trains_like_flat_store(false); }
TEST(ParamStore, PerUnitPiecesTrainTheSameModelWithRecompute) { trains_like_flat_store(true); }
TEST(ParamStore, Bf16ComputeCopiesTrainTheModelOfRoundingEachProduct) { trains_like_flat_store(false, DType::bf16); }
TEST(ParamStore, Bf16ComputeCopiesWithRecompute) { trains_like_flat_store(true, DType::bf16); }
TEST(ParamStore, Fp16ComputeCopiesTrainTheModelOfRoundingEachProduct) { trains_like_flat_store(false, DType::f16); }

TEST(ParamStore, UnitsHaveNamesAndCoverEveryTensorOnce) {
  auto be = make_host_backend(1);
  GPT m(config(false), *be, 1);
  std::set<int> seen;
  std::vector<std::string> names;
  for (const Unit& u : m.units()) {
    names.push_back(u.name);
    for (int i : u.params) EXPECT_TRUE(seen.insert(i).second) << m.params()[i].name << " in two units";
  }
  EXPECT_EQ(seen.size(), m.params().size());
  EXPECT_EQ(names, (std::vector<std::string>{"embeddings", "blocks.0", "blocks.1", "blocks.2", "head"}));
}

// The shard descriptor against brute force: every split at tp 1, 2, 4, and cut ranges.
TEST(ShardDesc, GlobalIndexRunsAndBoxesAgree) {
  struct Case {
    std::vector<std::int64_t> shape;
    TpSplit split;
  };
  const Case cases[] = {{{12, 8}, TpSplit::none},     {{12, 8}, TpSplit::rows},  {{8, 12}, TpSplit::cols},
                        {{24, 8}, TpSplit::qkv_rows}, {{24}, TpSplit::qkv_rows}, {{16}, TpSplit::rows},
                        {{10}, TpSplit::none}};
  for (const Case& c : cases)
    for (int tp : {1, 2, 4}) {
      std::vector<int> hits(static_cast<std::size_t>(ShardDesc::make(c.shape, c.split, tp, 0).full_numel()), 0);
      for (int r = 0; r < tp; ++r) {
        const ShardDesc whole = ShardDesc::make(c.shape, c.split, tp, r);
        const std::int64_t n = whole.numel();
        const std::vector<std::pair<std::int64_t, std::int64_t>> ranges{
            {0, n}, {0, n / 3}, {n / 3, n}, {n / 5, n - n / 7}};
        for (std::size_t which = 0; which < ranges.size(); ++which) {
          const auto [b, e] = ranges[which];
          const ShardDesc d = whole.cut(b, e);
          SCOPED_TRACE(d.describe());
          // global_index is increasing (what HDF5's selection order needs) and matches the tp piece's
          std::vector<std::int64_t> g;
          for (std::int64_t i = 0; i < d.numel(); ++i) {
            g.push_back(d.global_index(i));
            EXPECT_EQ(g.back(), whole.global_index(b + i));
            if (i > 0) {
              EXPECT_GT(g[i], g[i - 1]);
            }
          }
          // runs list exactly those indices, in order
          std::vector<std::int64_t> from_runs;
          d.for_each_run([&](std::int64_t local, std::int64_t global, std::int64_t count) {
            EXPECT_EQ(local, static_cast<std::int64_t>(from_runs.size()));
            for (std::int64_t k = 0; k < count; ++k) from_runs.push_back(global + k);
          });
          EXPECT_EQ(from_runs, g);
          // boxes, traversed row-major, list them too
          std::vector<std::int64_t> from_boxes;
          const std::int64_t K = c.shape.size() > 1 ? c.shape[1] : 1;
          for (const auto& box : d.boxes()) {
            if (c.shape.size() == 1) {
              for (std::int64_t k = 0; k < box.count[0]; ++k) from_boxes.push_back(box.start[0] + k);
            } else {
              for (std::int64_t rr = 0; rr < box.count[0]; ++rr)
                for (std::int64_t cc = 0; cc < box.count[1]; ++cc)
                  from_boxes.push_back((box.start[0] + rr) * K + box.start[1] + cc);
            }
          }
          EXPECT_EQ(from_boxes, g);
          if (which == 0)
            for (auto x : g) ++hits[static_cast<std::size_t>(x)];
        }
        if (c.split == TpSplit::cols && tp > 1) {
          EXPECT_EQ(whole.boxes().size(), 1u) << "a column split is one box";
        }
        if (c.split == TpSplit::qkv_rows && tp > 1) {
          EXPECT_EQ(whole.boxes().size(), 3u) << "q, k, v: three boxes";
        }
      }
      // the tp pieces cover the full tensor exactly once (a replicated tensor once per tp rank)
      for (int h : hits) EXPECT_EQ(h, c.split == TpSplit::none ? tp : 1);
    }
}

}  // namespace
}  // namespace loom
