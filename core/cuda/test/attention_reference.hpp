#pragma once
// Causal multi-head attention in fp64 on fp32 inputs, forward and backward, written for clarity:
// the reference the fused (flash-style) kernels are held to, on the GPU and through the emulator.
// Layout as core/backend/kernels.hpp: qkv [B,T,3C] (head h's q, k, v at columns h*hs, C + h*hs, 2C + h*hs),
// out and dout [B,T,C], lse [B,NH,T] = log of the softmax's denominator with the row max included.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace loom::test {

struct AttentionReference {
  std::vector<double> out;   // [B,T,C]
  std::vector<double> lse;   // [B,NH,T]
  std::vector<double> dqkv;  // [B,T,3C], the gradient of sum(out * dout)
};

inline AttentionReference attention_reference(const std::vector<float>& qkv, const std::vector<float>& dout, int B,
                                              int T, int C, int NH) {
  const int hs = C / NH;
  const std::int64_t C3 = 3 * static_cast<std::int64_t>(C);
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  AttentionReference r;
  r.out.assign(static_cast<std::size_t>(B) * T * C, 0.0);
  r.lse.assign(static_cast<std::size_t>(B) * NH * T, 0.0);
  r.dqkv.assign(static_cast<std::size_t>(B) * T * C3, 0.0);
  std::vector<double> p(static_cast<std::size_t>(T) * T), dp(static_cast<std::size_t>(T) * T);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h) {
      auto q = [&](int t, int d) {
        return static_cast<double>(qkv[(static_cast<std::int64_t>(b) * T + t) * C3 + h * hs + d]);
      };
      auto k = [&](int t, int d) {
        return static_cast<double>(qkv[(static_cast<std::int64_t>(b) * T + t) * C3 + C + h * hs + d]);
      };
      auto v = [&](int t, int d) {
        return static_cast<double>(qkv[(static_cast<std::int64_t>(b) * T + t) * C3 + 2 * C + h * hs + d]);
      };
      auto g = [&](int t, int d) {
        return static_cast<double>(dout[(static_cast<std::int64_t>(b) * T + t) * C + h * hs + d]);
      };
      auto at = [&](int t, int d) { return (static_cast<std::int64_t>(b) * T + t) * C3 + h * hs + d; };
      for (int t = 0; t < T; ++t) {
        double mx = -1e300;
        for (int j = 0; j <= t; ++j) {
          double s = 0;
          for (int d = 0; d < hs; ++d) s += q(t, d) * k(j, d);
          p[static_cast<std::size_t>(t) * T + j] = s * scale;
          mx = std::max(mx, s * scale);
        }
        double sum = 0;
        for (int j = 0; j <= t; ++j) sum += std::exp(p[static_cast<std::size_t>(t) * T + j] - mx);
        for (int j = 0; j <= t; ++j)
          p[static_cast<std::size_t>(t) * T + j] = std::exp(p[static_cast<std::size_t>(t) * T + j] - mx) / sum;
        r.lse[(static_cast<std::size_t>(b) * NH + h) * T + t] = mx + std::log(sum);
        for (int d = 0; d < hs; ++d) {
          double o = 0;
          for (int j = 0; j <= t; ++j) o += p[static_cast<std::size_t>(t) * T + j] * v(j, d);
          r.out[(static_cast<std::size_t>(b) * T + t) * C + h * hs + d] = o;
        }
      }
      for (int t = 0; t < T; ++t) {  // dprobs, then dscores in place
        double dot = 0;
        for (int j = 0; j <= t; ++j) {
          double s = 0;
          for (int d = 0; d < hs; ++d) s += g(t, d) * v(j, d);
          dp[static_cast<std::size_t>(t) * T + j] = s;
          dot += p[static_cast<std::size_t>(t) * T + j] * s;
        }
        for (int j = 0; j <= t; ++j) {
          double& x = dp[static_cast<std::size_t>(t) * T + j];
          x = p[static_cast<std::size_t>(t) * T + j] * (x - dot);
        }
      }
      for (int t = 0; t < T; ++t)
        for (int j = 0; j <= t; ++j) {
          const double pr = p[static_cast<std::size_t>(t) * T + j], ds = dp[static_cast<std::size_t>(t) * T + j];
          for (int d = 0; d < hs; ++d) {
            r.dqkv[static_cast<std::size_t>(at(t, d))] += scale * ds * k(j, d);      // dq
            r.dqkv[static_cast<std::size_t>(at(j, d) + C)] += scale * ds * q(t, d);  // dk
            r.dqkv[static_cast<std::size_t>(at(j, d) + 2 * C)] += pr * g(t, d);      // dv
          }
        }
    }
  return r;
}

// The inputs as the fused kernels take them: every value rounded to bf16 (nearest even).
inline std::vector<float> bf16_rounded(std::vector<float> v) {
  for (float& x : v) {
    std::uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    std::memcpy(&x, &u, sizeof x);
  }
  return v;
}

// |x - ref| / |ref| in the 2-norm, over the elements where mask is true (all when empty).
template <class X>
double relative_gap(const std::vector<X>& x, const std::vector<double>& ref, const std::vector<bool>& mask = {}) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (!mask.empty() && !mask[i]) continue;
    const double e = static_cast<double>(x[i]) - ref[i];
    num += e * e;
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1));
}

}  // namespace loom::test
