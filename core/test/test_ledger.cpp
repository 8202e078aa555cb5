#include <gtest/gtest.h>

#include "core/base/buffer.hpp"
#include "core/base/ledger.hpp"

using namespace loom;

TEST(Ledger, TracksCurrentAndPeakPerCategory) {
  Ledger l;
  l.allocate(Mem::params, 100);
  l.allocate(Mem::activations, 50);
  EXPECT_EQ(l.current(Mem::params), 100u);
  EXPECT_EQ(l.current_total(), 150u);
  l.release(Mem::activations, 50);
  l.allocate(Mem::activations, 20);
  EXPECT_EQ(l.current(Mem::activations), 20u);
  EXPECT_EQ(l.peak(Mem::activations), 50u);
  EXPECT_EQ(l.peak_total(), 150u);
  l.reset_peaks();
  EXPECT_EQ(l.peak(Mem::activations), 20u);
  EXPECT_EQ(l.peak_total(), 120u);
}

TEST(Ledger, RefusesReleasingMoreThanAllocated) {
  Ledger l;
  l.allocate(Mem::grads, 8);
  EXPECT_THROW(l.release(Mem::grads, 9), std::logic_error);
}

TEST(Ledger, BuffersFileTheirBytesForTheirLifetime) {
  auto& g = Ledger::global();
  const auto before = g.current(Mem::optimizer);
  {
    TypedBuffer a("test.a", DType::f32, 1000, Mem::optimizer);
    EXPECT_EQ(g.current(Mem::optimizer), before + 4000);
    TypedBuffer b = std::move(a);  // a move does not double-count
    EXPECT_EQ(g.current(Mem::optimizer), before + 4000);
    EXPECT_EQ(b.count(), 1000);
    EXPECT_EQ(b.data<float>()[999], 0.0f);  // zero-initialised
  }
  EXPECT_EQ(g.current(Mem::optimizer), before);
}

TEST(Ledger, FormatsBytes) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1536), "1.5 KiB");
  EXPECT_EQ(format_bytes(3.0 * 1024 * 1024), "3.0 MiB");
}
