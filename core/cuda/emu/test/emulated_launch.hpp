#pragma once
// What the emulator tests of device kernels share: a launcher that runs a kernel source's `launch`
// through the CUDA emulator, and the check that its results do not depend on the thread schedule or
// the grid's size.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <utility>

#include "core/cuda/emu/cuda_emu.hpp"

namespace loom::cuda_emu::testing {

// A kernel source's `launch`, through the emulator. With max_blocks, a grid of at most that many
// blocks: every kernel loops over its rows, columns or elements (grid-stride), so it must give the
// same bits from a grid too small for its work, as on a device where the work outgrows the grid's
// cap. Not the reductions' (kernels named reduce_*): their grid is their partition, which the
// finishing kernel reads whole.
struct OnEmulator {
  unsigned max_blocks = 0;  // 0: the grid the geometry asks for
  template <class Kernel, class... Args>
  void operator()(const char* name, unsigned blocks, unsigned threads, std::size_t shared, Kernel kernel,
                  Args... args) const {
    const bool partition = std::string(name).rfind("reduce_", 0) == 0;
    if (max_blocks > 0 && !partition && blocks > max_blocks) blocks = max_blocks;
    launch(dim3(blocks), dim3(threads), shared, [&] { kernel(args...); });
  }
};

// Runs `run` (the emulated operations through the launcher it is given, from fresh inputs) under
// every schedule, and once more on a grid of one block; expects `same` results from each (their
// bits) and returns the first's. `what` names the case in a failure.
template <class Result, class Same>
Result in_every_schedule(const std::function<Result(const OnEmulator&)>& run, Same same, const std::string& what = "") {
  struct Restore {
    ~Restore() { set_schedule(Schedule::sweep); }
  } restore;
  const std::pair<Schedule, unsigned> schedules[] = {{Schedule::sweep, 0},
                                                     {Schedule::warps_ascending, 0},
                                                     {Schedule::warps_descending, 0},
                                                     {Schedule::warps_random, 7}};
  const std::string prefix = what.empty() ? "" : what + ": ";
  Result first;
  bool have = false;
  for (const auto& [schedule, seed] : schedules) {
    set_schedule(schedule, seed);
    Result got = run(OnEmulator{});
    if (!have) {
      first = std::move(got);
      have = true;
    } else {
      EXPECT_TRUE(same(got, first)) << prefix << "the result depends on the order of the threads ("
                                    << schedule_name(schedule) << ")";
    }
  }
  set_schedule(Schedule::sweep);
  EXPECT_TRUE(same(run(OnEmulator{1}), first))
      << prefix << "the result depends on the grid's size (one block, looping)";
  return first;
}

}  // namespace loom::cuda_emu::testing
