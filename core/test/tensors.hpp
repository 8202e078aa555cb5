#pragma once
// What the kernel tests share: seeded normal tensors, and the relative error against a tensor's norm
// (the form every tolerance takes: it holds on any CPU and BLAS kernel set, an element-wise 1e-5
// does not).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "core/base/dtype.hpp"

namespace loom::testing {

inline std::vector<float> randn(std::size_t n, std::uint32_t seed, float stddev = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = d(gen);
  return v;
}

// A host vector as the typed buffer a back-end operation takes (all of its elements).
template <class T>
BufferRef buf(const std::vector<T>& v) {
  return BufferRef(v.data(), static_cast<std::int64_t>(v.size()));
}

// ||got - want|| / ||want|| (1e-300 at least: a zero tensor is matched absolutely).
template <class T>
double rel_err(const std::vector<T>& got, const std::vector<T>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double e = double(got[i]) - double(want[i]);
    num += e * e;
    den += double(want[i]) * double(want[i]);
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}

}  // namespace loom::testing
