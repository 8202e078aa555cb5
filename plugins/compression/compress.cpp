#include "plugins/compression/compress.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <vector>

namespace loom::compress {

std::int64_t chunk_count(std::int64_t n, std::int64_t chunk) { return (n + chunk - 1) / chunk; }

int int8_levels(int ranks) { return ranks > 0 ? 127 / ranks : 0; }

bool all_finite(const float* x, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return false;
  return true;
}

std::int64_t top_k_count(std::int64_t n, double ratio) {
  const auto k = static_cast<std::int64_t>(std::ceil(ratio * static_cast<double>(n)));
  return std::clamp<std::int64_t>(k, n > 0 ? 1 : 0, n);
}

void top_k(std::int32_t* index, float* value, const float* x, std::int64_t n, std::int64_t k) {
  if (k <= 0) return;
  // The k-th largest magnitude t, by radix selection: non-negative floats order as their bit
  // patterns, so one pass counts the magnitudes per top 12 bits (2048 buckets), the bucket holding
  // the k-th largest is found from the top, and only its members are selected among (a few times
  // faster than a comparison selection, whose branches a CPU cannot predict). Then one pass in index
  // order takes every element above t and, of those equal to t, the first ones until k: the same set
  // as ordering by (magnitude descending, index ascending), in ascending index order.
  const auto bits = [](float v) {
    std::uint32_t u;
    std::memcpy(&u, &v, sizeof u);
    return u & 0x7fffffffu;  // |v|
  };
  constexpr int kShift = 20;
  std::vector<std::int64_t> count(std::size_t(1) << (31 - kShift), 0);
  for (std::int64_t i = 0; i < n; ++i) ++count[bits(x[i]) >> kShift];
  std::size_t bucket = count.size();
  std::int64_t above = 0;  // elements in buckets above the k-th largest's
  while (bucket-- > 0 && above + count[bucket] < k) above += count[bucket];
  std::vector<float> members;
  members.reserve(static_cast<std::size_t>(count[bucket]));
  for (std::int64_t i = 0; i < n; ++i)
    if ((bits(x[i]) >> kShift) == bucket) members.push_back(std::fabs(x[i]));
  const std::int64_t r = k - above;  // the k-th largest is the r-th largest member
  std::nth_element(members.begin(), members.begin() + (r - 1), members.end(), std::greater<float>());
  const float t = members[static_cast<std::size_t>(r - 1)];
  std::int64_t ties = r;  // members equal to t that are taken, the lowest indices first
  for (std::int64_t i = 0; i < r - 1; ++i) ties -= members[static_cast<std::size_t>(i)] > t;
  for (std::int64_t i = 0, j = 0; i < n && j < k; ++i) {
    const float a = std::fabs(x[i]);
    if (a > t || (a == t && ties-- > 0)) {
      index[j] = static_cast<std::int32_t>(i);
      value[j++] = x[i];
    }
  }
}

void orthogonalize(float* p, int n, int r, double eps) {
  std::vector<double> col(static_cast<std::size_t>(n));
  for (int j = 0; j < r; ++j) {
    for (int i = 0; i < n; ++i) col[static_cast<std::size_t>(i)] = p[static_cast<std::int64_t>(i) * r + j];
    for (int k = 0; k < j; ++k) {  // remove the earlier (orthonormal) columns' components
      double dot = 0;
      for (int i = 0; i < n; ++i) dot += col[static_cast<std::size_t>(i)] * p[static_cast<std::int64_t>(i) * r + k];
      for (int i = 0; i < n; ++i) col[static_cast<std::size_t>(i)] -= dot * p[static_cast<std::int64_t>(i) * r + k];
    }
    double norm = 0;
    for (double v : col) norm += v * v;
    norm = std::max(std::sqrt(norm), eps);
    for (int i = 0; i < n; ++i) p[static_cast<std::int64_t>(i) * r + j] = static_cast<float>(col[static_cast<std::size_t>(i)] / norm);
  }
}

bool worth_compressing(std::int64_t n, std::int64_t m, int r, double min_rate) {
  return static_cast<double>(n) * static_cast<double>(m) >= min_rate * static_cast<double>(n + m) * r;
}

}  // namespace loom::compress
