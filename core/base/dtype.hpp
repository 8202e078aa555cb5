#pragma once
// Element types and memory spaces (DESIGN.md "Typed buffers and memory spaces"): what a buffer holds and where it
// lives. A BufferRef is the typed, non-owning view that back ends, collectives, the parameter store
// and the checkpoint pass around instead of a bare float*; a TypedBuffer (core/base/buffer.hpp) owns one.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace loom {

enum class DType : std::uint8_t { f32 = 0, f64, bf16, f16, i8, u8, i32, i64, count_ };
inline constexpr int kDTypes = static_cast<int>(DType::count_);

enum class MemSpace : std::uint8_t { host = 0, device };

constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32:
      return 4;
    case DType::f64:
      return 8;
    case DType::bf16:
      return 2;
    case DType::f16:
      return 2;
    case DType::i8:
      return 1;
    case DType::u8:
      return 1;
    case DType::i32:
      return 4;
    case DType::i64:
      return 8;
    case DType::count_:
      break;
  }
  return 0;
}
const char* dtype_name(DType t);         // "fp32", "fp64", "bf16", "fp16", "int8", "uint8", "int32", "int64"
const char* mem_space_name(MemSpace s);  // "host", "device"

// 16-bit floating-point storage types. Arithmetic happens in float: convert, compute, convert back
// (round to nearest even). The bit patterns are those of torch.bfloat16 and IEEE binary16.
struct bf16 {
  std::uint16_t bits = 0;
};
struct f16 {
  std::uint16_t bits = 0;
};

inline float to_float(bf16 x) {
  const std::uint32_t u = static_cast<std::uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline bf16 to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  // Both results computed, one selected: no branch, so a loop of conversions vectorises.
  const std::uint32_t nan = (u >> 16) | 0x40u;                           // NaN stays NaN
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // round to nearest even
  return bf16{static_cast<std::uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded)};
}
float to_float(f16 x);
f16 to_f16(float f);  // round to nearest even; overflow gives inf, as a GPU's conversion does

// double -> float rounded to odd: truncated toward zero, with the last mantissa bit set when the
// conversion was inexact. A value rounded to odd at 24 bits and then to nearest even at 8 (bf16) or
// 11 (fp16) bits is the value rounded to nearest even directly (the odd bit keeps a tie from being
// invented), which plain double -> float -> bf16 is not: 1 + 2^-8 + 2^-30 would become the tie
// 1 + 2^-8 and round down.
inline float to_float_round_odd(double d) {
  float f = static_cast<float>(d);
  if (d != d || static_cast<double>(f) == d) return f;                                // NaN, or exact (inf included)
  if (std::fabs(static_cast<double>(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);  // toward zero
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u |= 1u;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline bf16 to_bf16(double d) { return to_bf16(to_float_round_odd(d)); }
inline f16 to_f16(double d) { return to_f16(to_float_round_odd(d)); }

// The accumulation (compute) type of a storage type: what kernels add, multiply and reduce in.
// float -> float, double -> double, bf16 -> float, fp16 -> float.
template <class T>
struct acc_type {
  using type = T;
};
template <>
struct acc_type<bf16> {
  using type = float;
};
template <>
struct acc_type<f16> {
  using type = float;
};
template <class T>
using acc_type_t = typename acc_type<T>::type;

// Load a stored value into the compute type (exact: every bf16/fp16 is a float), and store a
// computed value back (rounded to nearest even). For T == Acc both are the identity.
template <class Acc, class T>
inline Acc to_acc(T x) {
  if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, f16>)
    return static_cast<Acc>(to_float(x));
  else
    return static_cast<Acc>(x);
}
template <class T, class Acc>
inline T from_acc(Acc x) {
  if constexpr (std::is_same_v<T, bf16>)
    return to_bf16(x);
  else if constexpr (std::is_same_v<T, f16>)
    return to_f16(x);
  else
    return static_cast<T>(x);
}

template <class T>
struct dtype_of;
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::f32;
};
template <>
struct dtype_of<double> {
  static constexpr DType value = DType::f64;
};
template <>
struct dtype_of<bf16> {
  static constexpr DType value = DType::bf16;
};
template <>
struct dtype_of<f16> {
  static constexpr DType value = DType::f16;
};
template <>
struct dtype_of<std::int8_t> {
  static constexpr DType value = DType::i8;
};
template <>
struct dtype_of<std::uint8_t> {
  static constexpr DType value = DType::u8;
};
template <>
struct dtype_of<std::int32_t> {
  static constexpr DType value = DType::i32;
};
template <>
struct dtype_of<std::int64_t> {
  static constexpr DType value = DType::i64;
};
template <class T>
inline constexpr DType dtype_v = dtype_of<T>::value;

// A typed, non-owning reference to `count` elements of type `type` in memory space `space`.
struct BufferRef {
  void* data = nullptr;
  DType type = DType::f32;
  std::int64_t count = 0;
  MemSpace space = MemSpace::host;

  BufferRef() = default;
  BufferRef(void* d, DType t, std::int64_t n, MemSpace s = MemSpace::host) : data(d), type(t), count(n), space(s) {}
  template <class T>
  BufferRef(T* d, std::int64_t n, MemSpace s = MemSpace::host)
      : data(const_cast<void*>(static_cast<const void*>(d))),
        type(dtype_v<std::remove_const_t<T>>),
        count(n),
        space(s) {}

  std::size_t bytes() const { return static_cast<std::size_t>(count) * dtype_size(type); }
  bool empty() const { return count == 0; }
  // The elements as T*; throws std::logic_error when T is not the element type.
  template <class T>
  T* as() const {
    if (dtype_v<std::remove_const_t<T>> != type)
      throw std::logic_error(std::string("BufferRef: holds ") + dtype_name(type) + ", read as " +
                             dtype_name(dtype_v<std::remove_const_t<T>>));
    return static_cast<T*>(data);
  }
  // The same, for an operation that reads or writes the first `need` elements: throws
  // std::invalid_argument when the buffer holds fewer (a back-end operation's operand check).
  template <class T>
  T* as(std::int64_t need) const {
    if (count < need)
      throw std::invalid_argument(std::string("BufferRef: a buffer of ") + std::to_string(count) + " " +
                                  dtype_name(type) + " elements where " + std::to_string(need) + " are needed");
    return as<T>();
  }
  // An optional operand (a bias, an error-feedback buffer): null when the buffer is empty.
  template <class T>
  T* as_optional(std::int64_t need) const {
    return data == nullptr || count == 0 ? nullptr : as<T>(need);
  }
  // Elements [begin, begin + n) of this buffer.
  BufferRef slice(std::int64_t begin, std::int64_t n) const {
    return BufferRef(static_cast<char*>(data) + static_cast<std::size_t>(begin) * dtype_size(type), type, n, space);
  }
};

}  // namespace loom
