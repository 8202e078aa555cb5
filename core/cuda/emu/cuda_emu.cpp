// The emulator's scheduler: a block's threads are fibers on the calling thread, run in turn until
// each reaches a barrier or ends; a barrier opens when every live thread of its group (the block, or
// the warp) has reached it.
#include "core/cuda/emu/cuda_emu.hpp"

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <utility>
#include <vector>

namespace loom::cuda_emu {
namespace {

enum class Wait { none, block, warp, done };

// Switching between fibers. On x86-64 a few instructions that keep the callee-saved registers and
// the floating-point control words on the fiber's stack: glibc's swapcontext also saves the signal
// mask, a system call per switch, which made an emulated training step spend most of its time in
// the kernel. Elsewhere, ucontext.
#if defined(__x86_64__)
extern "C" void loom_cuda_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .pushsection .text
  .globl loom_cuda_emu_switch
  .hidden loom_cuda_emu_switch
  .type loom_cuda_emu_switch, @function
loom_cuda_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size loom_cuda_emu_switch, .-loom_cuda_emu_switch
  .popsection
)");
struct Context {
  void* sp = nullptr;
};
inline void switch_context(Context& from, Context& to) { loom_cuda_emu_switch(&from.sp, to.sp); }
// A context that starts `entry` (which never returns) on the stack [stack, stack + bytes).
inline void make_context(Context& c, unsigned char* stack, std::size_t bytes, void (*entry)()) {
  auto top = (reinterpret_cast<std::uintptr_t>(stack) + bytes) & ~std::uintptr_t{15};
  auto* slot = reinterpret_cast<std::uint64_t*>(top - 16);  // entry's "return address": 16-aligned
  slot[1] = 0;
  slot[0] = reinterpret_cast<std::uint64_t>(entry);
  for (int r = 1; r <= 6; ++r) slot[-r] = 0;  // rbp, rbx, r12..r15
  std::uint32_t mxcsr = 0;
  std::uint16_t fpcw = 0;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpcw));
  auto* controls = reinterpret_cast<unsigned char*>(slot - 7);
  std::memcpy(controls, &mxcsr, 4);
  std::memcpy(controls + 4, &fpcw, 2);
  c.sp = slot - 7;
}
#else
struct Context {
  ucontext_t ctx{};
};
inline void switch_context(Context& from, Context& to) { swapcontext(&from.ctx, &to.ctx); }
inline void make_context(Context& c, unsigned char* stack, std::size_t bytes, void (*entry)()) {
  getcontext(&c.ctx);
  c.ctx.uc_stack.ss_sp = stack;
  c.ctx.uc_stack.ss_size = bytes;
  c.ctx.uc_link = nullptr;
  makecontext(&c.ctx, entry, 0);
}
#endif

struct Fiber {
  Context ctx;
  unsigned char* stack = nullptr;  // kStackBytes, from stack_pool
  dim3 idx;
  Wait wait = Wait::none;
  unsigned long ballots = 0;  // the votes this thread has cast in its block
};

struct Launch {
  dim3 grid, block, block_idx;
  std::vector<unsigned char> shared;
  std::vector<Fiber> fibers;
  std::vector<unsigned char> exchange;                                      // per thread, one shuffle's value
  std::vector<std::pair<const void*, std::vector<unsigned char>>> statics;  // the block's static shared arrays
  std::size_t dynamic_bytes = 0;
  Context scheduler;
  std::size_t current = 0;
  const std::function<void()>* body = nullptr;
  std::string failure;
};

thread_local Launch* active = nullptr;
thread_local Schedule schedule = Schedule::sweep;
thread_local std::mt19937 random_order;  // warps_random's draws, seeded by set_schedule

constexpr std::size_t kStackBytes = 256 * 1024;
// The fibers' stacks, kept from launch to launch on this thread (allocating and freeing up to 1024
// of them per launch made tests spend most of their time in the kernel's page faults).
thread_local std::vector<std::unique_ptr<unsigned char[]>> stack_pool;
constexpr std::size_t kExchangeBytes = 16;

Launch& need_launch(const char* what) {
  if (!active) throw std::logic_error(std::string("cuda_emu::") + what + " called outside a launch");
  return *active;
}

void yield(Wait w) {
  Launch& l = *active;
  Fiber& f = l.fibers[l.current];
  f.wait = w;
  switch_context(f.ctx, l.scheduler);
}

// A thread's life: the kernel's body, then back to the scheduler for good. An exception that
// escapes the body (a fiber's stack has no frame to unwind into) fails the launch instead.
[[noreturn]] void fiber_main() {
  Launch& l = *active;
  try {
    (*l.body)();
  } catch (const std::exception& e) {
    if (l.failure.empty()) l.failure = std::string("a thread threw: ") + e.what();
  } catch (...) {
    if (l.failure.empty()) l.failure = "a thread threw";
  }
  Fiber& f = l.fibers[l.current];
  f.wait = Wait::done;
  switch_context(f.ctx, l.scheduler);
  __builtin_trap();  // a finished thread is never resumed
}

// Runs the threads of [first, end) that are not waiting, from `first` up or from `end` down, each
// until it waits or ends; true if any ran.
bool run_ready(Launch& l, std::size_t first, std::size_t end, bool descending) {
  bool ran = false;
  for (std::size_t k = first; k < end; ++k) {
    const std::size_t i = descending ? end - 1 - (k - first) : k;
    if (l.fibers[i].wait != Wait::none) continue;
    l.current = i;
    switch_context(l.scheduler, l.fibers[i].ctx);
    if (!l.failure.empty()) throw std::runtime_error("cuda_emu: " + l.failure);
    ran = true;
  }
  return ran;
}

// Whether the warp starting at thread w has live lanes and they all wait at its warp barrier.
bool warp_barrier_full(const Launch& l, std::size_t w) {
  const std::size_t end = std::min(l.fibers.size(), w + 32);
  bool any = false;
  for (std::size_t i = w; i < end; ++i) {
    const Wait s = l.fibers[i].wait;
    if (s == Wait::done) continue;
    if (s != Wait::warp) return false;
    any = true;
  }
  return any;
}

// Opens the warp barrier of the warp starting at thread w if its live lanes all wait at it.
bool open_warp(Launch& l, std::size_t w) {
  if (!warp_barrier_full(l, w)) return false;
  for (std::size_t i = w; i < std::min(l.fibers.size(), w + 32); ++i)
    if (l.fibers[i].wait == Wait::warp) l.fibers[i].wait = Wait::none;
  return true;
}

// Whether a lane of the warp starting at thread w can run, or its warp barrier open.
bool can_progress(const Launch& l, std::size_t w) {
  for (std::size_t i = w; i < std::min(l.fibers.size(), w + 32); ++i)
    if (l.fibers[i].wait == Wait::none) return true;
  return warp_barrier_full(l, w);
}

// Runs one block to its end, its threads in the order `schedule` names.
void run_block(Launch& l) {
  const std::size_t n = l.fibers.size(), warps = (n + 31) / 32;
  for (std::size_t i = 0; i < n; ++i) {
    Fiber& f = l.fibers[i];
    f.wait = Wait::none;
    f.ballots = 0;
    make_context(f.ctx, f.stack, kStackBytes, fiber_main);
  }
  const bool descending = schedule == Schedule::warps_descending;
  for (;;) {
    bool progressed = false;
    if (schedule == Schedule::sweep) {
      progressed = run_ready(l, 0, n, false);
      if (progressed) continue;
      for (std::size_t w = 0; w < n; w += 32) progressed = open_warp(l, w) || progressed;
    } else if (schedule == Schedule::warps_random) {
      // One phase (to its next barrier) of a warp drawn at random among those that can go on, so
      // warps drift phases apart, as far as the block barriers let them.
      std::vector<std::size_t> can;
      for (std::size_t w = 0; w < n; w += 32)
        if (can_progress(l, w)) can.push_back(w);
      if (!can.empty()) {
        const std::size_t w = can[std::uniform_int_distribution<std::size_t>(0, can.size() - 1)(random_order)];
        progressed = run_ready(l, w, std::min(n, w + 32), false);
        progressed = open_warp(l, w) || progressed;
      }
    } else {
      // One warp at a time, as far as it goes before a block barrier.
      for (std::size_t k = 0; k < warps; ++k) {
        const std::size_t w = 32 * (descending ? warps - 1 - k : k);
        for (;;) {
          const bool ran = run_ready(l, w, std::min(n, w + 32), descending);
          const bool opened = open_warp(l, w);
          if (!ran && !opened) break;
          progressed = true;
        }
      }
    }
    if (progressed) continue;
    // Every live thread waits, and no warp barrier can open: the block barrier opens when every
    // live thread of the block waits at it.
    bool live = false, at_block = true;
    for (const Fiber& f : l.fibers) {
      if (f.wait == Wait::done) continue;
      live = true;
      if (f.wait != Wait::block) at_block = false;
    }
    if (!live) return;
    if (at_block) {
      for (Fiber& f : l.fibers)
        if (f.wait == Wait::block) f.wait = Wait::none;
      continue;
    }
    throw std::runtime_error("cuda_emu: deadlock in block (" + std::to_string(l.block_idx.x) + "," +
                             std::to_string(l.block_idx.y) + "): threads wait at different barriers");
  }
}

}  // namespace

namespace {

// Past the launch's dynamic shared memory: a guard, checked after each block (a write past the
// size the launch asked for is a silent corruption on the device, and the heap's here).
constexpr std::size_t kSharedGuard = 256;
constexpr unsigned char kGuardByte = 0xa5;

// 128-byte aligned, as the device's dynamic shared memory is at least.
unsigned char* dynamic_shared_of(Launch& l) {
  const auto base = reinterpret_cast<std::uintptr_t>(l.shared.data());
  return l.shared.data() + ((128 - base % 128) % 128);
}

}  // namespace

void launch(dim3 grid, dim3 block, std::size_t shared_bytes, const std::function<void()>& body) {
  if (active) throw std::logic_error("cuda_emu::launch inside a launch");
  const auto refuse = [&](const std::string& why) {
    throw std::runtime_error("cuda_emu: launch of grid (" + std::to_string(grid.x) + "," + std::to_string(grid.y) +
                             "," + std::to_string(grid.z) + "), block (" + std::to_string(block.x) + "," +
                             std::to_string(block.y) + "," + std::to_string(block.z) + "), " +
                             std::to_string(shared_bytes) + " bytes of dynamic shared memory: " + why);
  };
  const std::size_t block_threads = static_cast<std::size_t>(block.x) * block.y * block.z;
  if (block_threads == 0 || block_threads > 1024 || block.z > 64)
    refuse("a block has 1 to 1024 threads (z at most 64)");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535)
    refuse("a grid has 1 to 2^31 - 1 blocks on x, 1 to 65535 on y and z");
  if (shared_bytes > kMaxSharedPerBlock) refuse("more than the 232448 bytes a block may have");
  auto l = std::make_unique<Launch>();
  l->dynamic_bytes = shared_bytes;
  l->grid = grid;
  l->block = block;
  l->body = &body;
  const std::size_t threads = static_cast<std::size_t>(block.x) * block.y * block.z;
  l->fibers.resize(threads);
  while (stack_pool.size() < threads) stack_pool.emplace_back(new unsigned char[kStackBytes]);
  for (std::size_t i = 0; i < threads; ++i) l->fibers[i].stack = stack_pool[i].get();
  l->exchange.assign(threads * kExchangeBytes, 0);
  for (std::size_t i = 0; i < threads; ++i)
    l->fibers[i].idx = dim3(static_cast<unsigned>(i % block.x), static_cast<unsigned>(i / block.x % block.y),
                            static_cast<unsigned>(i / (static_cast<std::size_t>(block.x) * block.y)));
  active = l.get();
  try {
    for (unsigned z = 0; z < grid.z; ++z)
      for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x) {
          l->block_idx = dim3(x, y, z);
          // NaN bytes, 128 bytes of alignment slack, then a guard the block must leave alone.
          l->shared.assign(shared_bytes + 128 + kSharedGuard, 0xff);
          unsigned char* end = dynamic_shared_of(*l) + shared_bytes;
          std::memset(end, kGuardByte, kSharedGuard);
          l->statics.clear();
          run_block(*l);
          const std::string block_name =
              "cuda_emu: block (" + std::to_string(x) + "," + std::to_string(y) + "," + std::to_string(z) + ")";
          for (std::size_t i = 0; i < kSharedGuard; ++i)
            if (end[i] != kGuardByte)
              throw std::runtime_error(block_name + " wrote byte " + std::to_string(shared_bytes + i) + " of its " +
                                       std::to_string(shared_bytes) + " bytes of dynamic shared memory");
          for (const auto& [site, memory] : l->statics) {
            const std::size_t bytes = memory.size() - kSharedGuard;
            for (std::size_t i = 0; i < kSharedGuard; ++i)
              if (memory[bytes + i] != kGuardByte)
                throw std::runtime_error(block_name + " wrote byte " + std::to_string(bytes + i) +
                                         " of a static shared array of " + std::to_string(bytes) + " bytes");
          }
        }
  } catch (...) {
    active = nullptr;
    throw;
  }
  active = nullptr;
}

const char* schedule_name(Schedule s) {
  switch (s) {
    case Schedule::sweep:
      return "sweep";
    case Schedule::warps_ascending:
      return "warps_ascending";
    case Schedule::warps_descending:
      return "warps_descending";
    case Schedule::warps_random:
      return "warps_random";
  }
  return "?";
}
void set_schedule(Schedule s, unsigned seed) {
  schedule = s;
  random_order.seed(seed);
}

const dim3& thread_idx() {
  Launch& l = need_launch("thread_idx");
  return l.fibers[l.current].idx;
}
const dim3& block_idx() { return need_launch("block_idx").block_idx; }
const dim3& block_dim() { return need_launch("block_dim").block; }
const dim3& grid_dim() { return need_launch("grid_dim").grid; }
unsigned lane() { return static_cast<unsigned>(need_launch("lane").current % 32); }
unsigned char* dynamic_shared() { return dynamic_shared_of(need_launch("dynamic_shared")); }
void sync_block() {
  need_launch("sync_block");
  yield(Wait::block);
}
void sync_warp() {
  need_launch("sync_warp");
  yield(Wait::warp);
}
void warp_exchange(const void* mine, void* theirs, unsigned lane_mask, std::size_t bytes) {
  Launch& l = need_launch("shfl_xor");
  if (bytes > kExchangeBytes) fail("shuffle of more than 16 bytes");
  if (l.fibers.size() % 32 != 0) fail("shuffle in a block that is not whole warps");
  const std::size_t me = l.current, partner = (me & ~std::size_t{31}) | ((me & 31) ^ (lane_mask & 31));
  yield(Wait::warp);  // every lane has read its partner's previous value before this one is written
  std::memcpy(&l.exchange[me * kExchangeBytes], mine, bytes);
  yield(Wait::warp);
  std::memcpy(theirs, &l.exchange[partner * kExchangeBytes], bytes);
}
unsigned ballot(bool p) {
  Launch& l = need_launch("ballot");
  if (l.fibers.size() % 32 != 0) fail("ballot in a block that is not whole warps");
  const std::size_t me = l.current, warp = me & ~std::size_t{31};
  yield(Wait::warp);  // every lane has read the previous exchange before this one is written
  l.exchange[me * kExchangeBytes] = p ? 1 : 0;
  ++l.fibers[me].ballots;
  yield(Wait::warp);
  // A lane that returned instead of voting let the barrier open without it: its count is behind.
  // (None can be ahead: its next vote waits at the first barrier until this lane has read.)
  unsigned mask = 0;
  for (std::size_t k = 0; k < 32; ++k) {
    if (l.fibers[warp + k].ballots != l.fibers[me].ballots)
      fail("ballot without lane " + std::to_string(k) + " of the warp (it returned): the device leaves that undefined");
    if (l.exchange[(warp + k) * kExchangeBytes] != 0) mask |= 1u << k;
  }
  return mask;
}
void* static_shared(const void* site, std::size_t bytes) {
  Launch& l = need_launch("static_shared");
  std::size_t total = 0;
  for (auto& [key, memory] : l.statics) {
    if (key == site) return memory.data();
    total += memory.size() - kSharedGuard;
  }
  constexpr std::size_t kStaticLimit = 48 * 1024;
  if (total + bytes > kStaticLimit)
    fail("static shared arrays of " + std::to_string(total + bytes) + " bytes (the device allows 49152)");
  if (total + bytes + l.dynamic_bytes > kMaxSharedPerBlock)
    fail("static shared arrays of " + std::to_string(total + bytes) + " bytes and " + std::to_string(l.dynamic_bytes) +
         " of dynamic shared memory: more than the 232448 bytes a block may have");
  // NaN bytes, then a guard the block must leave alone (checked when it ends).
  std::vector<unsigned char> memory(bytes + kSharedGuard, 0xff);
  std::memset(memory.data() + bytes, kGuardByte, kSharedGuard);
  l.statics.emplace_back(site, std::move(memory));
  return l.statics.back().second.data();
}
void fail(const std::string& what) {
  Launch& l = need_launch("fail");
  l.failure = what;
  l.fibers[l.current].wait = Wait::done;
  switch_context(l.fibers[l.current].ctx, l.scheduler);
  throw std::logic_error("cuda_emu: a failed thread was resumed");  // never reached
}

}  // namespace loom::cuda_emu
