// The seams a device back end relies on, checked without a GPU: run.backend = fenced
// (core/backend/fenced_backend.cpp), the host kernels on memory whose addresses the host cannot touch. A
// model trained through it must train the same model as the plain host back end, bit for bit:
// tokens, initial weights and everything else reach its tensors through copy_from_host /
// copy_to_host, and code that touches a tensor through a pointer crashes the test.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/engine/engine.hpp"
#include "core/model/gpt.hpp"

namespace loom {
namespace {

BatchFn batches(int vocab, int T) {
  return [=](std::int64_t step, std::int64_t first_row, int rows, std::vector<std::int32_t>& in,
             std::vector<std::int32_t>& tgt) {
    std::mt19937_64 gen(static_cast<std::uint64_t>(step * 1000 + first_row));
    std::uniform_int_distribution<int> d(0, vocab - 1);
    in.resize(static_cast<std::size_t>(rows) * T);
    tgt.resize(in.size());
    for (auto& x : in) x = d(gen);
    for (auto& x : tgt) x = d(gen);
  };
}

void trains_like_the_host(DType precision, bool recompute) {
  GPTConfig cfg;
  cfg.layers = 2;
  cfg.d_model = 32;
  cfg.heads = 4;
  cfg.seq_len = 16;
  cfg.vocab = 29;
  cfg.recompute = recompute;
  EngineConfig ec;
  ec.micro_batches = 2;
  ec.rows_per_micro = 2;
  ec.optimizer.lr = 3e-3;
  ec.optimizer.steps = 4;
  ec.optimizer.grad_clip = 0.5;
  auto host = make_host_backend(1);
  auto fenced_owner = make_fenced_backend(1);
  Backend& fenced = *fenced_owner;
  host->set_precision({precision});
  fenced.set_precision({precision});
  GPT a(cfg, *host, ec.rows_per_micro), b(cfg, fenced, ec.rows_per_micro);
  a.init_weights(7);
  b.init_weights(7);
  Engine ea(ec, a, *host), eb(ec, b, fenced);
  const BatchFn fetch = batches(cfg.vocab, cfg.seq_len);
  for (int step = 0; step < 4; ++step) {
    StepStats sa = ea.train_step(step, fetch), sb;
    ASSERT_NO_THROW(sb = eb.train_step(step, fetch)) << "step " << step;
    EXPECT_EQ(sa.loss, sb.loss) << "step " << step;
    EXPECT_EQ(sa.grad_norm, sb.grad_norm) << "step " << step;
  }
  for (int i = 0; i < static_cast<int>(a.params().size()); ++i) {
    const std::int64_t n = a.params()[static_cast<std::size_t>(i)].numel();
    std::vector<float> pb(static_cast<std::size_t>(n));
    fenced.copy_to_host(pb.data(), b.store().param(i).slice(0, n));
    EXPECT_EQ(std::memcmp(a.param_ref(i).as<float>(), pb.data(), pb.size() * sizeof(float)), 0)
        << a.params()[static_cast<std::size_t>(i)].name;
  }
}

TEST(DeviceSeams, Fp32TrainsTheHostsModelThroughDeviceMarkedMemory) { trains_like_the_host(DType::f32, false); }
TEST(DeviceSeams, Bf16WithRecomputeTrainsTheHostsModelThroughDeviceMarkedMemory) {
  trains_like_the_host(DType::bf16, true);
}

}  // namespace
}  // namespace loom
