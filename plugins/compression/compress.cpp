#include "plugins/compression/compress.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

namespace loom::compress {

std::int64_t chunk_count(std::int64_t n, std::int64_t chunk) { return (n + chunk - 1) / chunk; }

int int8_levels(int ranks) { return ranks > 0 ? 127 / ranks : 0; }

std::int64_t top_k_count(std::int64_t n, double ratio) {
  const auto k = static_cast<std::int64_t>(std::ceil(ratio * static_cast<double>(n)));
  return std::clamp<std::int64_t>(k, n > 0 ? 1 : 0, n);
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
    for (int i = 0; i < n; ++i)
      p[static_cast<std::int64_t>(i) * r + j] = static_cast<float>(col[static_cast<std::size_t>(i)] / norm);
  }
}

bool worth_compressing(std::int64_t n, std::int64_t m, int r, double min_rate) {
  return static_cast<double>(n) * static_cast<double>(m) >= min_rate * static_cast<double>(n + m) * r;
}

}  // namespace loom::compress
