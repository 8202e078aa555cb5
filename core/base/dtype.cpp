#include "core/base/dtype.hpp"

#include <cmath>

namespace loom {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "fp32";
    case DType::f64:
      return "fp64";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "fp16";
    case DType::i8:
      return "int8";
    case DType::u8:
      return "uint8";
    case DType::i32:
      return "int32";
    case DType::i64:
      return "int64";
    case DType::count_:
      break;
  }
  return "?";
}

const char* mem_space_name(MemSpace s) { return s == MemSpace::host ? "host" : "device"; }

float to_float(f16 x) {
  const std::uint32_t sign = (x.bits & 0x8000u) << 16, exp = (x.bits >> 10) & 0x1fu, mant = x.bits & 0x3ffu;
  std::uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);  // inf, NaN
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (mant << 13);  // normal: rebias 15 -> 127
  } else if (mant == 0) {
    u = sign;  // zero
  } else {
    const float f = std::ldexp(static_cast<float>(mant), -24);  // subnormal: mant * 2^-24
    std::memcpy(&u, &f, sizeof u);
    u |= sign;
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

f16 to_f16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return f16{static_cast<std::uint16_t>(sign | 0x7e00u)};   // NaN
  if (a >= 0x477ff000u) return f16{static_cast<std::uint16_t>(sign | 0x7c00u)};  // rounds past 65504: inf
  if (a < 0x38800000u) {  // below 2^-14: subnormal or zero, in units of 2^-24
    float mag;
    std::memcpy(&mag, &a, sizeof mag);
    const float units = std::nearbyint(mag * 16777216.0f);  // round to nearest even
    return f16{static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(units))};
  }
  // normal: drop 13 mantissa bits with round to nearest even, rebias 127 -> 15
  const std::uint32_t rounded = a + 0xfffu + ((a >> 13) & 1u);
  return f16{static_cast<std::uint16_t>(sign | ((rounded - 0x38000000u) >> 13))};
}

}  // namespace loom
