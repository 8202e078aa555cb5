#pragma once
// Addresses that stand for device memory where there is none: the fenced back end's and the emulated
// device's (host memory moved by 2^47, past x86-64's user address space, so a host access through one
// faults), and the sizing back end's (never mapped at all, from 2^48 up). One definition for all three.
#include <cstdint>

namespace loom::device_address {

inline constexpr std::uintptr_t kOffset = std::uintptr_t(1) << 47;      // host address + kOffset
inline constexpr std::uintptr_t kSizingBase = std::uintptr_t(1) << 48;  // the sizing back end's first

template <class T>
T* away(T* p) {  // host -> device address (null stays null)
  return p ? reinterpret_cast<T*>(reinterpret_cast<std::uintptr_t>(p) + kOffset) : nullptr;
}
template <class T>
T* back(T* p) {  // device -> host address (null stays null)
  return p ? reinterpret_cast<T*>(reinterpret_cast<std::uintptr_t>(p) - kOffset) : nullptr;
}
// Whether `p` is a moved host address (the fenced back end's or the emulated device's).
inline bool is_moved(const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  return a >= kOffset && a < 2 * kOffset;
}

}  // namespace loom::device_address
