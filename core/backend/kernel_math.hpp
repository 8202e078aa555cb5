#pragma once
// The per-element and per-row arithmetic of the model's kernels, written once and compiled for both
// back ends: the host kernels (core/backend/kernels.hpp) and the CUDA kernels (core/cuda/kernels.cu) call
// these functions, so a host unit test of a formula tests the GPU's too. Acc is the compute type
// (float, or double in the finite-difference tests). No loops over rows here: how a row is reduced
// (a sequential loop on the host, a warp on the GPU) is each back end's business; what is computed
// per element once the row's statistics are known is shared.
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define LOOM_HD __host__ __device__
#else
#define LOOM_HD
#endif

namespace loom::math {

LOOM_HD inline float bits_as_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}
LOOM_HD inline std::uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

// fp32 -> bf16 bits, round to nearest even, NaN kept a (quiet) NaN: torch.bfloat16's rounding.
LOOM_HD inline std::uint16_t bf16_bits(float f) {
  std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
LOOM_HD inline float bf16_value(std::uint16_t bits) { return bits_as_float(static_cast<std::uint32_t>(bits) << 16); }

// exp() for float as a branch-free polynomial, so that host loops calling it vectorise (softmax,
// GELU); max relative error ~2e-7, i.e. float rounding. Double uses libm (the finite-difference
// tests see exact math).
LOOM_HD inline float exp_fast(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);  // plain compares vectorise; fmin/fmax do not
  const float t = x * 1.44269504088896341f;           // x / ln 2
  const float n = floorf(t + 0.5f);
  const float f = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;  // x - n ln2, split
  // exp(f) on [-ln2/2, ln2/2], Taylor/minimax degree 6.
  float p = 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  return p * bits_as_float(static_cast<std::uint32_t>((static_cast<std::int32_t>(n) + 127) << 23));
}
LOOM_HD inline float sqrt_k(float x) { return sqrtf(x); }
LOOM_HD inline double sqrt_k(double x) { return sqrt(x); }
LOOM_HD inline float exp_k(float x) { return exp_fast(x); }
LOOM_HD inline double exp_k(double x) { return exp(x); }

LOOM_HD inline float tanh_k(float x) {
  // tanh(x) = 1 - 2 / (exp(2x) + 1) saturates cleanly for large |x| but cancels near 0, so small
  // |x| takes the odd Taylor series instead (both computed: the select vectorises, a branch would not).
  const float big = 1.0f - 2.0f / (exp_fast(2.0f * x) + 1.0f);
  const float x2 = x * x;
  const float small =
      x * (1.0f + x2 * (-1.0f / 3.0f + x2 * (2.0f / 15.0f + x2 * (-17.0f / 315.0f + x2 * (62.0f / 2835.0f)))));
  return (x < 0.125f && x > -0.125f) ? small : big;
}
LOOM_HD inline double tanh_k(double x) { return tanh(x); }

// GELU, tanh approximation (GPT-2): gelu(x) and d gelu(x)/dx * dout.
template <class Acc>
LOOM_HD inline Acc gelu_forward(Acc x) {
  const Acc k = sqrt_k(Acc(2) / Acc(3.14159265358979323846));
  const Acc u = k * (x + Acc(0.044715) * x * x * x);
  return Acc(0.5) * x * (Acc(1) + tanh_k(u));
}
template <class Acc>
LOOM_HD inline Acc gelu_backward(Acc x, Acc dout) {
  const Acc k = sqrt_k(Acc(2) / Acc(3.14159265358979323846));
  const Acc u = k * (x + Acc(0.044715) * x * x * x);
  const Acc th = tanh_k(u);
  const Acc sech2 = Acc(1) - th * th;
  const Acc du = k * (Acc(1) + Acc(3) * Acc(0.044715) * x * x);
  return (Acc(0.5) * (Acc(1) + th) + Acc(0.5) * x * sech2 * du) * dout;
}

// LayerNorm (eps 1e-5, as GPT-2 and torch.nn.LayerNorm). Per row: mean m, variance v (biased), then
// per element. The backward needs the row's two means of dnorm = weight * dout (dnorm_mean) and of
// dnorm * xhat (dnorm_norm_mean).
template <class Acc>
LOOM_HD inline Acc layernorm_rstd(Acc variance) {
  return Acc(1) / sqrt_k(variance + Acc(1e-5));
}
template <class Acc>
LOOM_HD inline Acc layernorm_out(Acc x, Acc mean, Acc rstd, Acc weight, Acc bias) {
  return (x - mean) * rstd * weight + bias;
}
template <class Acc>
LOOM_HD inline Acc layernorm_dinp(Acc x, Acc mean, Acc rstd, Acc weight, Acc dout, Acc dnorm_mean,
                                  Acc dnorm_norm_mean) {
  const Acc xhat = (x - mean) * rstd;
  return (weight * dout - dnorm_mean - xhat * dnorm_norm_mean) * rstd;
}

// RMSNorm (Llama): rstd = 1 / sqrt(mean(x^2) + eps), out = x * rstd * weight. The backward needs the
// row's mean of weight * dout * x (dnorm_x_mean): dx = (weight * dout - x * rstd^2 * dnorm_x_mean) * rstd.
template <class Acc>
LOOM_HD inline Acc rmsnorm_rstd(Acc mean_square, Acc eps) {
  return Acc(1) / sqrt_k(mean_square + eps);
}
template <class Acc>
LOOM_HD inline Acc rmsnorm_out(Acc x, Acc rstd, Acc weight) {
  return x * rstd * weight;
}
template <class Acc>
LOOM_HD inline Acc rmsnorm_dinp(Acc x, Acc rstd, Acc weight, Acc dout, Acc dnorm_x_mean) {
  return (weight * dout - x * rstd * rstd * dnorm_x_mean) * rstd;
}

// SwiGLU (Llama's MLP): out = silu(gate) * up, silu(g) = g * sigmoid(g); and its two gradients.
template <class Acc>
LOOM_HD inline Acc sigmoid_k(Acc g) {
  return Acc(1) / (Acc(1) + exp_k(-g));
}
template <class Acc>
LOOM_HD inline Acc swiglu_forward(Acc gate, Acc up) {
  return gate * sigmoid_k(gate) * up;
}
template <class Acc>
LOOM_HD inline Acc swiglu_dgate(Acc gate, Acc up, Acc dout) {
  const Acc s = sigmoid_k(gate);
  return dout * up * s * (Acc(1) + gate * (Acc(1) - s));
}
template <class Acc>
LOOM_HD inline Acc swiglu_dup(Acc gate, Acc dout) {
  return dout * gate * sigmoid_k(gate);
}

// Rotary position embedding, the interleaved convention of Meta's Llama: pair i of a head (elements 2i
// and 2i + 1) at sequence position t turns by t * theta^(-2i / hs). The angle, its cosine and sine are
// computed in double and rounded once to Acc, so the host and a device take the same values.
template <class Acc>
LOOM_HD inline void rope_cos_sin(int t, int i, int hs, double theta, Acc& c, Acc& s) {
  const double angle = static_cast<double>(t) * pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(hs));
  c = static_cast<Acc>(cos(angle));
  s = static_cast<Acc>(sin(angle));
}
// (a, b) turned forward, and the transpose of that turn (the backward: the same angle, the other way).
template <class Acc>
LOOM_HD inline void rope_turn(Acc& a, Acc& b, Acc c, Acc s) {
  const Acc x = a * c - b * s, y = a * s + b * c;
  a = x;
  b = y;
}
template <class Acc>
LOOM_HD inline void rope_turn_back(Acc& a, Acc& b, Acc c, Acc s) {
  const Acc x = a * c + b * s, y = b * c - a * s;
  a = x;
  b = y;
}

// Softmax backward of one probability a with incoming gradient d, dot = sum_j a_j d_j over the row.
template <class Acc>
LOOM_HD inline Acc softmax_backward(Acc a, Acc d, Acc dot) {
  return a * (d - dot);
}

// The head sizes the fused attention is built for (multiples of the 16-wide tensor-core tile; 128
// fits an A100's shared memory and up): the device kernels and their host twin take the same, so a
// deck with model.attention = flash means one model on every back end.
LOOM_HD constexpr bool flash_head_size_supported(int hs) { return hs == 16 || hs == 32 || hs == 64 || hs == 128; }

// The fused attention's per-element passes: two device lanes per row (a warp's lane takes row
// lane / 2 of the warp's 16), each with half of the row's n columns (n = 64 scores, or the head's
// hs). Step `step` of n / 2 goes to this column: the lane's parity, rows 8-15 of the warp a step
// ahead of rows 0-7, so the warp's 32 lanes touch 32 different shared-memory banks each step. A
// lane's partial row sum adds its columns in this order, which the host twin repeats.
LOOM_HD constexpr int flash_lane_column(int lane, int step, int n) {
  return 2 * ((step + lane / 16) % (n / 2)) + lane % 2;
}

// Cross-entropy after softmax: d loss / d logit = (p - [v is the target]) * dloss.
template <class Acc>
LOOM_HD inline Acc crossentropy_dlogit(Acc p, bool is_target, Acc dloss) {
  return (p - (is_target ? Acc(1) : Acc(0))) * dloss;
}

// AdamW (torch.optim.AdamW): decoupled weight decay, bias-corrected moments; bc1 = 1 - beta1^t and
// bc2 = 1 - beta2^t for the 1-based step t. Updates m and v, returns the new parameter.
template <class Acc>
struct AdamWStep {
  Acc lr, beta1, beta2, eps, weight_decay, bc1, bc2;
};
template <class Acc>
LOOM_HD inline Acc adamw(Acc p, Acc& m, Acc& v, Acc g, const AdamWStep<Acc>& s) {
  const Acc mi = s.beta1 * m + (Acc(1) - s.beta1) * g;
  const Acc vi = s.beta2 * v + (Acc(1) - s.beta2) * g * g;
  m = mi;
  v = vi;
  return p * (Acc(1) - s.lr * s.weight_decay) - s.lr * (mi / s.bc1) / (sqrt_k(vi / s.bc2) + s.eps);
}

// int8 gradient compression (plugins/compression, Backend::int8_*): a chunk's values share the step
// absmax / levels, equal on every rank (absmax is the chunk's largest |x| over the ranks); a value
// is round(x / step) clamped to +-levels, 0 where the step or x is not finite or the step is 0.
LOOM_HD inline bool finite_k(float x) { return (float_bits(x) & 0x7f800000u) != 0x7f800000u; }
LOOM_HD inline float int8_step(float absmax, int levels) { return absmax / static_cast<float>(levels); }
LOOM_HD inline float int8_level(float x, float step, int levels) {
  const float v = step > 0.0f && finite_k(step) && finite_k(x) ? rintf(x / step) : 0.0f;  // rintf: half to even
  const float l = static_cast<float>(levels);
  return v < -l ? -l : v > l ? l : v;  // |x| <= absmax: rounding only
}
// |x| for the chunk maxima; NaN counts as 0 (the finiteness flag reports it), inf as inf.
LOOM_HD inline float int8_magnitude(float x) { return x == x ? fabsf(x) : 0.0f; }

}  // namespace loom::math
