#include "plugins/compression/compress.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace loom::compress {

std::int64_t chunk_count(std::int64_t n, std::int64_t chunk) { return (n + chunk - 1) / chunk; }

int int8_levels(int ranks) { return ranks > 0 ? 127 / ranks : 0; }

bool all_finite(const float* x, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return false;
  return true;
}

void chunk_absmax(float* out, const float* x, std::int64_t n, std::int64_t chunk) {
  for (std::int64_t c = 0, b = 0; b < n; ++c, b += chunk) {
    float m = 0.0f;
    for (std::int64_t i = b, e = std::min(n, b + chunk); i < e; ++i) m = std::max(m, std::fabs(x[i]));
    out[c] = m;
  }
}

void quantize_int8(std::int8_t* q, float* error, const float* x, std::int64_t n, std::int64_t chunk,
                   const float* absmax, int levels) {
  for (std::int64_t c = 0, b = 0; b < n; ++c, b += chunk) {
    const float step = absmax[c] / static_cast<float>(levels);
    for (std::int64_t i = b, e = std::min(n, b + chunk); i < e; ++i) {
      float v = step > 0.0f && std::isfinite(step) && std::isfinite(x[i]) ? std::nearbyint(x[i] / step) : 0.0f;
      v = std::clamp(v, -static_cast<float>(levels), static_cast<float>(levels));  // |x| <= absmax: rounding only
      q[i] = static_cast<std::int8_t>(v);
      if (error) error[i] = x[i] - v * step;
    }
  }
}

void dequantize_int8(float* x, const std::int8_t* q, std::int64_t n, std::int64_t chunk, const float* absmax,
                     int levels) {
  for (std::int64_t c = 0, b = 0; b < n; ++c, b += chunk) {
    const float step = absmax[c] / static_cast<float>(levels);
    for (std::int64_t i = b, e = std::min(n, b + chunk); i < e; ++i) x[i] = static_cast<float>(q[i]) * step;
  }
}

std::int64_t top_k_count(std::int64_t n, double ratio) {
  const auto k = static_cast<std::int64_t>(std::ceil(ratio * static_cast<double>(n)));
  return std::clamp<std::int64_t>(k, n > 0 ? 1 : 0, n);
}

void top_k(std::int32_t* index, float* value, const float* x, std::int64_t n, std::int64_t k) {
  std::vector<std::int32_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  auto larger = [x](std::int32_t a, std::int32_t b) {
    const float fa = std::fabs(x[a]), fb = std::fabs(x[b]);
    return fa > fb || (fa == fb && a < b);
  };
  std::nth_element(order.begin(), order.begin() + k, order.end(), larger);
  std::sort(order.begin(), order.begin() + k);
  for (std::int64_t j = 0; j < k; ++j) {
    index[j] = order[static_cast<std::size_t>(j)];
    value[j] = x[index[j]];
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
