#pragma once
// Counter-based random numbers: a value is a pure function of (seed, stream, counter), so any rank
// can draw exactly the elements it owns and get the same numbers as one process drawing them all
// (DESIGN.md: "Shards and ownership", its determinism paragraph).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace loom::rng {

// splitmix64 finaliser: a bijective 64-bit mixer with good avalanche.
inline constexpr std::uint64_t mix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// FNV-1a of a name: the stream id of a parameter ("blocks.3.attn.qkv.weight").
inline constexpr std::uint64_t hash_name(std::string_view s) {
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (char c : s) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ULL;
  }
  return h;
}

// FNV-1a over 8-byte words, then the tail bytes, continuing from h: a fingerprint of a tensor's bytes
// that ranks compare to check that replicas agree (a word per multiply: 8 times fewer than bytes).
inline std::uint64_t hash_bytes(const void* data, std::size_t n, std::uint64_t h = 0xcbf29ce484222325ULL) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    std::uint64_t w;
    std::memcpy(&w, p + i, sizeof w);
    h = (h ^ w) * 0x100000001b3ULL;
  }
  for (; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ULL;
  return h;
}

inline constexpr std::uint64_t bits(std::uint64_t seed, std::uint64_t stream, std::uint64_t counter) {
  return mix64(mix64(mix64(seed) ^ stream) ^ counter);
}

// Uniform in (0, 1]: never 0, so log() is safe.
inline double uniform(std::uint64_t seed, std::uint64_t stream, std::uint64_t counter) {
  return (static_cast<double>(bits(seed, stream, counter) >> 11) + 1.0) * 0x1.0p-53;
}

// Standard normal for element `index` of `stream` (Box-Muller on two counters of its own).
inline double normal(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  const double u1 = uniform(seed, stream, 2 * index);
  const double u2 = uniform(seed, stream, 2 * index + 1);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586476925 * u2);
}

}  // namespace loom::rng
