// Unit tests of core/backend/kernels.hpp: every backward against central finite differences of a scalar
// objective, in double precision; the accumulation rules; the attention forward against a naive
// reference; the float math helpers; AdamW against a scalar reference; float vs double forwards;
// the bf16 and fp16 instantiations against float, and sums sized so that 16-bit accumulation fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/backend/kernels.hpp"

namespace k = loom::kernels;

namespace {

using Vec = std::vector<double>;
using FVec = std::vector<float>;
using IVec = std::vector<std::int32_t>;

// Problem sizes shared by the tests (small so every element can be finite-differenced).
constexpr int kB = 2, kT = 5, kC = 8, kNH = 2, kV = 11, kN = kB * kT;

Vec randn(std::size_t n, std::uint64_t seed, double stddev = 1.0, double mean = 0.0) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> dist(mean, stddev);
  Vec v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

IVec rand_tokens(std::size_t n, int V, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int> dist(0, V - 1);
  IVec v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

double dot(const Vec& a, const Vec& b) {
  long double s = 0;  // the objective's own summation adds no noise worth mentioning
  for (std::size_t i = 0; i < a.size(); ++i) s += static_cast<long double>(a[i]) * b[i];
  return static_cast<double>(s);
}

FVec to_float(const Vec& v) { return FVec(v.begin(), v.end()); }
// The double values of a float copy: float and double forwards then see identical inputs.
Vec rounded(const Vec& v) {
  Vec r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = static_cast<double>(static_cast<float>(v[i]));
  return r;
}

// Finite-difference gradient check.
//
// Central differences with h = 1e-6 in double have a truncation error ~h^2 f'''/6 ~ 1e-12 and a
// rounding error ~eps * |L| / h: the objectives here sum ~100 terms of size ~1 (|L| ~ 10), so the
// numeric derivative carries an absolute noise of ~1e-16 * 10 / 1e-6 = 1e-9 (observed: <= 1.3e-9).
// The brief's per-element error |a-n| / max(1e-8, |a|+|n|) is then ~1e-9/|g| for an element of
// gradient g: < 1e-6 only for |g| > 1e-3, and a random problem has a few elements smaller than
// that by chance (crossentropy's gradient p - onehot has many, p ~ 1e-3). So the denominator's
// floor is raised to the noise level of the tensor's own gradient scale:
//     err_i = |a_i - n_i| / max(1e-8, |a_i| + |n_i|, kFloor * max_j |a_j|),   kFloor = 1e-2,
// asserted < kGradTol = 1e-6. Elements above 1% of the largest gradient are held to a plain 1e-6
// relative error; the tiny ones to an absolute 1e-8 * max|g| (~10x the noise). A wrong gradient
// (a missing term, a wrong sign or factor) is off by O(|g|) and fails by many orders of magnitude.
// The report also prints the brief's metric with the 1e-8 floor, over all elements.
constexpr double kH = 1e-6;
constexpr double kGradTol = 1e-6;
constexpr double kFloor = 1e-2;

struct GradReport {
  double max_err = 0;      // worst err_i (the asserted metric)
  double max_rel_raw = 0;  // worst |a-n| / max(1e-8, |a|+|n|), for the report
  double max_abs = 0;      // worst |a-n|
  double scale = 0;        // max |a|
};

GradReport check_grad(const char* what, Vec& x, const Vec& analytic, const std::function<double()>& loss) {
  EXPECT_EQ(x.size(), analytic.size()) << what;
  GradReport r;
  for (double a : analytic) r.scale = std::max(r.scale, std::abs(a));
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double save = x[i];
    x[i] = save + kH;
    const double lp = loss();
    x[i] = save - kH;
    const double lm = loss();
    x[i] = save;
    const double num = (lp - lm) / (2 * kH);
    const double a = analytic[i];
    const double abs_err = std::abs(a - num);
    const double err = abs_err / std::max({1e-8, std::abs(a) + std::abs(num), kFloor * r.scale});
    r.max_abs = std::max(r.max_abs, abs_err);
    r.max_rel_raw = std::max(r.max_rel_raw, abs_err / std::max(1e-8, std::abs(a) + std::abs(num)));
    r.max_err = std::max(r.max_err, err);
    EXPECT_LT(err, kGradTol) << what << " element " << i << ": analytic " << a << ", numeric " << num;
  }
  EXPECT_GT(r.scale, 0.0) << what << ": the gradient is identically zero, the check would be vacuous";
  std::printf("[ gradchk ] %-30s n=%4zu max|g|=%-6.3g err=%.2e (raw rel %.2e, abs %.2e)\n", what, x.size(), r.scale,
              r.max_err, r.max_rel_raw, r.max_abs);
  return r;
}

// max_i |a_i - b_i| / max_i |b_i|: the comparison of a float computation with its double twin.
// Float rounding errors are relative to the operands' magnitudes, not to each result's (which can
// cancel to ~0), so the error is normalised by the tensor's largest magnitude.
double tensor_rel_err(const FVec& f, const Vec& d) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < d.size(); ++i) {
    num = std::max(num, std::abs(static_cast<double>(f[i]) - d[i]));
    den = std::max(den, std::abs(d[i]));
  }
  return den > 0 ? num / den : num;
}

void expect_float_close(const char* what, const FVec& f, const Vec& d, double tol = 1e-5) {
  ASSERT_EQ(f.size(), d.size());
  const double e = tensor_rel_err(f, d);
  std::printf("[ f32/f64 ] %-28s max err / max|x| = %.2e\n", what, e);
  EXPECT_LT(e, tol) << what;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Encoder

namespace {
struct EncoderProblem {
  IVec inp = rand_tokens(kN, kV, 11);
  Vec wte = randn(static_cast<std::size_t>(kV) * kC, 12);
  Vec wpe = randn(static_cast<std::size_t>(kT) * kC, 13);
  Vec R = randn(static_cast<std::size_t>(kN) * kC, 14);
  EncoderProblem() {
    inp[7] = inp[2];  // a repeated token: its gradient rows must add up
    inp[9] = inp[2];
  }
  double loss() {
    Vec out(static_cast<std::size_t>(kN) * kC);
    k::encoder_forward(out.data(), inp.data(), wte.data(), wpe.data(), kB, kT, kC);
    return dot(out, R);
  }
};
}  // namespace

TEST(Kernels, EncoderBackwardMatchesFiniteDifferences) {
  EncoderProblem p;
  Vec dwte(p.wte.size(), 0.0), dwpe(p.wpe.size(), 0.0);
  k::encoder_backward(dwte.data(), dwpe.data(), p.R.data(), p.inp.data(), kB, kT, kC);
  check_grad("encoder dwte", p.wte, dwte, [&] { return p.loss(); });
  check_grad("encoder dwpe", p.wpe, dwpe, [&] { return p.loss(); });
}

TEST(Kernels, EncoderBackwardAccumulates) {
  EncoderProblem p;
  Vec dwte(p.wte.size(), 0.0), dwpe(p.wpe.size(), 0.0);
  k::encoder_backward(dwte.data(), dwpe.data(), p.R.data(), p.inp.data(), kB, kT, kC);
  const Vec g0te = randn(dwte.size(), 15), g0pe = randn(dwpe.size(), 16);
  Vec acc_te = g0te, acc_pe = g0pe;
  k::encoder_backward(acc_te.data(), acc_pe.data(), p.R.data(), p.inp.data(), kB, kT, kC);
  for (std::size_t i = 0; i < dwte.size(); ++i) EXPECT_NEAR(acc_te[i], g0te[i] + dwte[i], 1e-14) << i;
  for (std::size_t i = 0; i < dwpe.size(); ++i) EXPECT_NEAR(acc_pe[i], g0pe[i] + dwpe[i], 1e-14) << i;
}

// ---------------------------------------------------------------------------------------------
// LayerNorm

namespace {
struct LayerNormProblem {
  Vec inp = randn(static_cast<std::size_t>(kN) * kC, 21, 1.5, 0.7);
  Vec weight = randn(kC, 22, 0.5, 1.0);
  Vec bias = randn(kC, 23, 0.5);
  Vec R = randn(static_cast<std::size_t>(kN) * kC, 24);
  Vec out = Vec(static_cast<std::size_t>(kN) * kC), mean = Vec(kN), rstd = Vec(kN);
  double loss() {
    k::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(), bias.data(), kN, kC);
    return dot(out, R);
  }
  // Gradients from zero.
  void grads(Vec& dinp, Vec& dw, Vec& db) {
    loss();
    dinp.assign(inp.size(), 0.0);
    dw.assign(kC, 0.0);
    db.assign(kC, 0.0);
    k::layernorm_backward(dinp.data(), dw.data(), db.data(), R.data(), inp.data(), weight.data(), mean.data(),
                          rstd.data(), kN, kC);
  }
};
}  // namespace

// The fused residual add + LayerNorm (the model's xmid = x + y, ln2(xmid)) gives the sum and the
// normalised rows of the two kernels it replaces, bit for bit, in fp32 and in fp64.
template <class T>
void check_residual_layernorm() {
  const Vec a = randn(static_cast<std::size_t>(kN) * kC, 25, 1.5, 0.7), b = randn(a.size(), 26),
            w = randn(kC, 27, 0.5, 1.0), bias = randn(kC, 28, 0.5);
  const std::vector<T> at(a.begin(), a.end()), bt(b.begin(), b.end()), wt(w.begin(), w.end()),
      biast(bias.begin(), bias.end());
  std::vector<T> sum(a.size()), out(a.size()), mean(kN), rstd(kN), fsum(a.size()), fout(a.size()), fmean(kN), frstd(kN);
  k::residual_forward(sum.data(), at.data(), bt.data(), static_cast<std::int64_t>(a.size()));
  k::layernorm_forward(out.data(), mean.data(), rstd.data(), sum.data(), wt.data(), biast.data(), kN, kC);
  k::residual_layernorm_forward(fsum.data(), fout.data(), fmean.data(), frstd.data(), at.data(), bt.data(), wt.data(),
                                biast.data(), kN, kC);
  EXPECT_EQ(std::memcmp(sum.data(), fsum.data(), sum.size() * sizeof(T)), 0) << "the residual";
  EXPECT_EQ(std::memcmp(out.data(), fout.data(), out.size() * sizeof(T)), 0) << "the normalised rows";
  EXPECT_EQ(std::memcmp(mean.data(), fmean.data(), mean.size() * sizeof(T)), 0) << "the means";
  EXPECT_EQ(std::memcmp(rstd.data(), frstd.data(), rstd.size() * sizeof(T)), 0) << "the reciprocal deviations";
}
TEST(Kernels, ResidualLayerNormIsResidualThenLayerNormBitForBit) {
  check_residual_layernorm<float>();
  check_residual_layernorm<double>();
}

TEST(Kernels, LayerNormForwardNormalises) {
  LayerNormProblem p;
  p.loss();
  for (int n = 0; n < kN; ++n) {
    double m = 0, v = 0;
    for (int c = 0; c < kC; ++c) m += p.inp[n * kC + c];
    m /= kC;
    for (int c = 0; c < kC; ++c) v += (p.inp[n * kC + c] - m) * (p.inp[n * kC + c] - m);
    v /= kC;  // biased variance, as torch.nn.LayerNorm
    EXPECT_NEAR(p.mean[n], m, 1e-14);
    EXPECT_NEAR(p.rstd[n], 1.0 / std::sqrt(v + 1e-5), 1e-12);
    for (int c = 0; c < kC; ++c)
      EXPECT_NEAR(p.out[n * kC + c], (p.inp[n * kC + c] - m) / std::sqrt(v + 1e-5) * p.weight[c] + p.bias[c], 1e-12);
  }
}

TEST(Kernels, LayerNormBackwardMatchesFiniteDifferences) {
  LayerNormProblem p;
  Vec dinp, dw, db;
  p.grads(dinp, dw, db);
  check_grad("layernorm dinp", p.inp, dinp, [&] { return p.loss(); });
  check_grad("layernorm dweight", p.weight, dw, [&] { return p.loss(); });
  check_grad("layernorm dbias", p.bias, db, [&] { return p.loss(); });
}

TEST(Kernels, LayerNormBackwardAccumulatesIntoDinpAndParameters) {
  LayerNormProblem p;
  Vec dinp, dw, db;
  p.grads(dinp, dw, db);
  const Vec g0x = randn(dinp.size(), 25), g0w = randn(kC, 26), g0b = randn(kC, 27);
  Vec ax = g0x, aw = g0w, ab = g0b;
  k::layernorm_backward(ax.data(), aw.data(), ab.data(), p.R.data(), p.inp.data(), p.weight.data(), p.mean.data(),
                        p.rstd.data(), kN, kC);
  for (std::size_t i = 0; i < ax.size(); ++i) EXPECT_NEAR(ax[i], g0x[i] + dinp[i], 1e-13) << "dinp " << i;
  for (int c = 0; c < kC; ++c) {
    EXPECT_NEAR(aw[c], g0w[c] + dw[c], 1e-13) << "dweight " << c;
    EXPECT_NEAR(ab[c], g0b[c] + db[c], 1e-13) << "dbias " << c;
  }
}

// ---------------------------------------------------------------------------------------------
// Matmul

namespace {
constexpr int kOC = 12;
struct MatmulProblem {
  bool with_bias;
  Vec inp = randn(static_cast<std::size_t>(kN) * kC, 31);
  Vec weight = randn(static_cast<std::size_t>(kOC) * kC, 32, 0.5);
  Vec bias = randn(kOC, 33);
  Vec R = randn(static_cast<std::size_t>(kN) * kOC, 34);
  explicit MatmulProblem(bool b) : with_bias(b) {}
  double loss() {
    Vec out(static_cast<std::size_t>(kN) * kOC);
    k::matmul_forward(out.data(), inp.data(), weight.data(), with_bias ? bias.data() : nullptr, kN, kC, kOC);
    return dot(out, R);
  }
  // dinp is pre-filled with garbage (it must be overwritten); dweight/dbias start from g0w/g0b.
  void backward(Vec& dinp, Vec& dw, Vec& db) {
    dinp.assign(inp.size(), 1e3);
    k::matmul_backward(dinp.data(), dw.data(), with_bias ? db.data() : nullptr, R.data(), inp.data(), weight.data(), kN,
                       kC, kOC);
  }
};

void matmul_gradcheck(bool with_bias) {
  MatmulProblem p(with_bias);
  Vec dinp, dw(p.weight.size(), 0.0), db(kOC, 0.0);
  p.backward(dinp, dw, db);
  check_grad(with_bias ? "matmul+bias dinp" : "matmul dinp", p.inp, dinp, [&] { return p.loss(); });
  check_grad(with_bias ? "matmul+bias dweight" : "matmul dweight", p.weight, dw, [&] { return p.loss(); });
  if (with_bias)
    check_grad("matmul+bias dbias", p.bias, db, [&] { return p.loss(); });
  else
    for (double x : db) EXPECT_EQ(x, 0.0);  // null dbias: nothing written anywhere

  // Accumulation: parameter gradients add to what is there; dinp is overwritten (the garbage
  // pre-fill is gone, so a second call gives the same dinp).
  const Vec g0w = randn(dw.size(), 35), g0b = randn(kOC, 36);
  Vec aw = g0w, ab = g0b, dinp2;
  p.backward(dinp2, aw, ab);
  for (std::size_t i = 0; i < dinp.size(); ++i) EXPECT_EQ(dinp2[i], dinp[i]) << "dinp " << i;
  for (std::size_t i = 0; i < dw.size(); ++i) EXPECT_NEAR(aw[i], g0w[i] + dw[i], 1e-13) << "dweight " << i;
  for (int j = 0; j < kOC; ++j) EXPECT_NEAR(ab[j], g0b[j] + (with_bias ? db[j] : 0.0), 1e-13) << "dbias " << j;
}
}  // namespace

TEST(Kernels, MatmulBackwardMatchesFiniteDifferences) { matmul_gradcheck(false); }
TEST(Kernels, MatmulWithBiasBackwardMatchesFiniteDifferences) { matmul_gradcheck(true); }

// ---------------------------------------------------------------------------------------------
// Attention

namespace {
struct AttentionProblem {
  Vec qkv = randn(static_cast<std::size_t>(kN) * 3 * kC, 41);
  Vec R = randn(static_cast<std::size_t>(kN) * kC, 42);
  Vec out = Vec(static_cast<std::size_t>(kN) * kC);
  Vec att = Vec(static_cast<std::size_t>(kB) * kNH * kT * kT, 42.0);  // garbage: the forward must overwrite all
  double loss() {
    k::attention_forward(out.data(), att.data(), qkv.data(), kB, kT, kC, kNH);
    return dot(out, R);
  }
};

// out[b,t,h*hs+d] = sum_{j<=t} softmax_j(q_t . k_j / sqrt(hs)) v_j[d], explicit loops.
void naive_attention(Vec& out, Vec& att, const Vec& qkv, int B, int T, int C, int NH) {
  const int hs = C / NH;
  out.assign(static_cast<std::size_t>(B) * T * C, 0.0);
  att.assign(static_cast<std::size_t>(B) * NH * T * T, 0.0);
  auto at = [&](int b, int t, int part, int h, int d) { return qkv[(b * T + t) * 3 * C + part * C + h * hs + d]; };
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int t = 0; t < T; ++t) {
        std::vector<double> s(t + 1);
        double mx = -1e300;
        for (int j = 0; j <= t; ++j) {
          double d = 0;
          for (int x = 0; x < hs; ++x) d += at(b, t, 0, h, x) * at(b, j, 1, h, x);
          s[j] = d / std::sqrt(static_cast<double>(hs));
          mx = std::max(mx, s[j]);
        }
        double z = 0;
        for (int j = 0; j <= t; ++j) z += std::exp(s[j] - mx);
        for (int j = 0; j <= t; ++j) {
          const double p = std::exp(s[j] - mx) / z;
          att[((b * NH + h) * T + t) * T + j] = p;
          for (int x = 0; x < hs; ++x) out[(b * T + t) * C + h * hs + x] += p * at(b, j, 2, h, x);
        }
      }
}
}  // namespace

TEST(Kernels, AttentionForwardMatchesNaiveReferenceAndMasksExactly) {
  AttentionProblem p;
  p.loss();
  Vec ref_out, ref_att;
  naive_attention(ref_out, ref_att, p.qkv, kB, kT, kC, kNH);
  double worst = 0;
  for (std::size_t i = 0; i < ref_out.size(); ++i) worst = std::max(worst, std::abs(p.out[i] - ref_out[i]));
  for (std::size_t i = 0; i < ref_att.size(); ++i) worst = std::max(worst, std::abs(p.att[i] - ref_att[i]));
  std::printf("[ naive   ] attention forward max abs err = %.2e\n", worst);
  EXPECT_LT(worst, 1e-12);
  for (int bh = 0; bh < kB * kNH; ++bh)
    for (int t = 0; t < kT; ++t) {
      double rowsum = 0;
      for (int j = 0; j < kT; ++j) {
        const double a = p.att[(static_cast<std::size_t>(bh) * kT + t) * kT + j];
        if (j > t)
          EXPECT_EQ(a, 0.0) << "masked probability (bh " << bh << ", t " << t << ", j " << j << ")";
        else
          EXPECT_GT(a, 0.0);
        rowsum += a;
      }
      EXPECT_NEAR(rowsum, 1.0, 1e-14);
    }
}

TEST(Kernels, AttentionBackwardMatchesFiniteDifferences) {
  AttentionProblem p;
  p.loss();
  Vec dqkv(p.qkv.size(), 1e3);  // garbage: dqkv is overwritten
  Vec datt(static_cast<std::size_t>(kT) * kT, -7.0);
  k::attention_backward(dqkv.data(), datt.data(), p.R.data(), p.qkv.data(), p.att.data(), kB, kT, kC, kNH);
  check_grad("attention dqkv", p.qkv, dqkv, [&] { return p.loss(); });
  // The same again over a different garbage pre-fill: fully overwritten.
  Vec dqkv2(p.qkv.size(), -3.0);
  p.loss();
  k::attention_backward(dqkv2.data(), datt.data(), p.R.data(), p.qkv.data(), p.att.data(), kB, kT, kC, kNH);
  for (std::size_t i = 0; i < dqkv.size(); ++i) EXPECT_EQ(dqkv2[i], dqkv[i]) << i;
}

// The unfused attention of a bf16 run (attention_forward_bf16 / attention_backward_bf16): the two
// products of each direction take bf16-rounded operands (q, k, v; the probabilities; dout; the score
// gradients) and accumulate in fp32, the softmax and its backward in fp32. Held to a float64 replay of
// exactly those roundings (tight: only an operand whose fp32 value sits on a rounding boundary may tip),
// and shown to differ from the unrounded attention by the bf16 effect, many times that bound.
namespace {
double rel_gap(const FVec& a, const Vec& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / den);
}
double r16(double x) { return loom::to_float(loom::to_bf16(static_cast<float>(x))); }
}  // namespace

TEST(Kernels, Bf16AttentionRoundsItsProductsOperands) {
  const int B = 2, T = 37, C = 64, NH = 2, hs = C / NH, C3 = 3 * C;
  const std::size_t NC = std::size_t(B) * T * C, TT = std::size_t(T) * T;
  const FVec qkv = to_float(randn(3 * NC, 501, 1.5)), dout = to_float(randn(NC, 502));
  FVec out(NC), att(std::size_t(B) * NH * TT), dqkv(3 * NC, 1e3f), datt(TT, -7.0f);
  std::vector<loom::bf16> qkv16(3 * NC), dout16(NC), p16(2 * TT);
  k::attention_forward_bf16(out.data(), att.data(), qkv.data(), qkv16.data(), p16.data(), B, T, C, NH);
  k::attention_backward_bf16(dqkv.data(), datt.data(), dout.data(), qkv.data(), att.data(), qkv16.data(), dout16.data(),
                             p16.data(), B, T, C, NH);
  // float64 replays: `round` true rounds the products' operands as the kernels do, false is plain.
  for (bool round : {true, false}) {
    auto r = [&](double x) { return round ? r16(x) : x; };
    Vec eo(NC, 0.0), edqkv(3 * NC, 0.0);
    const double scale = 1.0 / std::sqrt(double(hs));
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < NH; ++h) {
        auto at = [&](int t, int part, int d) { return std::size_t(b * T + t) * C3 + part * C + h * hs + d; };
        std::vector<Vec> P(T, Vec(T, 0.0)), dS(T, Vec(T, 0.0));
        for (int t = 0; t < T; ++t) {
          double mx = -1e300, z = 0;
          for (int j = 0; j <= t; ++j) {
            double d = 0;
            for (int x = 0; x < hs; ++x) d += r(qkv[at(t, 0, x)]) * r(qkv[at(j, 1, x)]);
            P[t][j] = d * scale;
            mx = std::max(mx, P[t][j]);
          }
          for (int j = 0; j <= t; ++j) z += (P[t][j] = std::exp(P[t][j] - mx));
          for (int j = 0; j <= t; ++j) P[t][j] /= z;
          for (int x = 0; x < hs; ++x) {
            double o = 0;
            for (int j = 0; j <= t; ++j) o += r(P[t][j]) * r(qkv[at(j, 2, x)]);
            eo[std::size_t(b * T + t) * C + h * hs + x] = o;
          }
        }
        auto dout_at = [&](int t, int x) { return r(dout[std::size_t(b * T + t) * C + h * hs + x]); };
        for (int t = 0; t < T; ++t) {
          Vec dp(t + 1, 0.0);
          double dot = 0;
          for (int j = 0; j <= t; ++j) {
            for (int x = 0; x < hs; ++x) dp[j] += dout_at(t, x) * r(qkv[at(j, 2, x)]);
            dot += P[t][j] * dp[j];
          }
          for (int j = 0; j <= t; ++j) dS[t][j] = P[t][j] * (dp[j] - dot);
        }
        for (int t = 0; t < T; ++t)
          for (int x = 0; x < hs; ++x)
            for (int j = 0; j <= t; ++j) {
              edqkv[at(t, 0, x)] += scale * r(dS[t][j]) * r(qkv[at(j, 1, x)]);  // dq
              edqkv[at(j, 1, x)] += scale * r(dS[t][j]) * r(qkv[at(t, 0, x)]);  // dk
              edqkv[at(j, 2, x)] += r(P[t][j]) * dout_at(t, x);                 // dv
            }
      }
    const double go = rel_gap(out, eo), gd = rel_gap(dqkv, edqkv);
    std::printf("bf16 attention against the float64 replay %s: out %.3g, dqkv %.3g\n",
                round ? "with its roundings" : "without roundings", go, gd);
    if (round) {
      EXPECT_LT(go, 1e-4);
      EXPECT_LT(gd, 1e-4);
    } else {  // the bf16 effect: what the rounded replay explains
      EXPECT_GT(go, 1e-3);
      EXPECT_GT(gd, 1e-3);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// GELU

namespace {
Vec gelu_inputs() {
  Vec x = randn(37, 51, 2.0);
  x[0] = 0.0;
  x[1] = -6.0;
  x[2] = 6.0;
  x[3] = -2.5;
  return x;
}
}  // namespace

TEST(Kernels, GeluBackwardMatchesFiniteDifferences) {
  Vec x = gelu_inputs();
  const Vec R = randn(x.size(), 52);
  auto loss = [&] {
    Vec out(x.size());
    k::gelu_forward(out.data(), x.data(), static_cast<std::int64_t>(x.size()));
    return dot(out, R);
  };
  Vec dx(x.size(), 1e3);  // overwritten
  k::gelu_backward(dx.data(), x.data(), R.data(), static_cast<std::int64_t>(x.size()));
  check_grad("gelu dinp", x, dx, loss);
  // GELU(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), pointwise
  Vec out(x.size());
  k::gelu_forward(out.data(), x.data(), static_cast<std::int64_t>(x.size()));
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double u = std::sqrt(2.0 / M_PI) * (x[i] + 0.044715 * x[i] * x[i] * x[i]);
    EXPECT_NEAR(out[i], 0.5 * x[i] * (1.0 + std::tanh(u)), 1e-15) << x[i];
  }
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy

namespace {
struct CrossEntropyProblem {
  Vec logits = randn(static_cast<std::size_t>(kN) * kV, 61, 2.0);
  IVec targets = rand_tokens(kN, kV, 62);
  Vec w = randn(kN, 63);  // per-row weights of the objective
  Vec losses = Vec(kN), probs = Vec(static_cast<std::size_t>(kN) * kV);
  void forward() { k::crossentropy_forward(losses.data(), probs.data(), logits.data(), targets.data(), kN, kV); }
  double loss() {
    forward();
    return dot(losses, w);
  }
};
}  // namespace

TEST(Kernels, CrossEntropyForwardIsLogSoftmax) {
  CrossEntropyProblem p;
  p.logits[3 * kV + 4] = 800.0;  // exp() of it overflows unless shifted by the max
  p.logits[5 * kV + 0] = -800.0;
  p.targets[6] = 0;
  p.logits[6 * kV + 0] = -900.0;  // target probability underflows to 0; the loss must stay exact
  p.forward();
  for (int n = 0; n < kN; ++n) {
    const double* l = &p.logits[static_cast<std::size_t>(n) * kV];
    const double mx = *std::max_element(l, l + kV);
    double z = 0;
    for (int v = 0; v < kV; ++v) z += std::exp(l[v] - mx);
    const double lse = mx + std::log(z);
    EXPECT_NEAR(p.losses[n], lse - l[p.targets[n]], 1e-12 * std::max(1.0, std::abs(lse - l[p.targets[n]])));
    double s = 0;
    for (int v = 0; v < kV; ++v) {
      EXPECT_NEAR(p.probs[n * kV + v], std::exp(l[v] - lse), 1e-15);
      s += p.probs[n * kV + v];
    }
    EXPECT_NEAR(s, 1.0, 1e-14);
  }
  EXPECT_TRUE(std::isfinite(p.losses[3]));
  EXPECT_GT(p.losses[6], 800.0);  // ~ mx + 900
}

TEST(Kernels, CrossEntropyBackwardMatchesFiniteDifferences) {
  CrossEntropyProblem p;
  p.forward();
  // Per-row weights: one call per row (the kernel takes one scalar dloss per call).
  Vec dlogits(p.logits.size(), 1e3);
  for (int n = 0; n < kN; ++n)
    k::crossentropy_backward(dlogits.data() + n * kV, p.probs.data() + n * kV, p.targets.data() + n, p.w[n], 1, kV);
  check_grad("crossentropy dlogits (w_n)", p.logits, dlogits, [&] { return p.loss(); });

  // One call with a uniform weight, written in place over probs (dlogits may alias probs).
  const double wu = 0.37;
  p.w.assign(kN, wu);
  p.forward();
  Vec dl_inplace = p.probs;
  k::crossentropy_backward(dl_inplace.data(), dl_inplace.data(), p.targets.data(), wu, kN, kV);
  check_grad("crossentropy dlogits (uniform)", p.logits, dl_inplace, [&] { return p.loss(); });
}

// The model's head overwrites its logits with the probabilities (one [N,V] table): the kernels must
// give, in place, exactly what they give into a separate table.
template <class T, class Acc>
void expect_crossentropy_in_place_exact() {
  const Vec l64 = randn(static_cast<std::size_t>(kN) * kV, 64, 3.0);
  const IVec targets = rand_tokens(kN, kV, 65);
  std::vector<T> logits(l64.size());
  for (std::size_t i = 0; i < l64.size(); ++i) logits[i] = static_cast<T>(l64[i]);
  std::vector<T> probs(logits.size());
  std::vector<Acc> losses(kN), losses_in_place(kN);
  k::crossentropy_forward<T, Acc>(losses.data(), probs.data(), logits.data(), targets.data(), kN, kV);
  std::vector<T> table = logits;
  k::crossentropy_forward<T, Acc>(losses_in_place.data(), table.data(), table.data(), targets.data(), kN, kV);
  EXPECT_EQ(losses_in_place, losses);
  EXPECT_EQ(table, probs);
}

TEST(Kernels, CrossEntropyInPlaceOverTheLogitsIsExact) {
  expect_crossentropy_in_place_exact<double, double>();
  expect_crossentropy_in_place_exact<float, float>();
  expect_crossentropy_in_place_exact<float, double>();

  // The vocabulary-parallel passes (one rank's slice [vocab_begin, vocab_begin + V) of the targets' range).
  const Vec l64 = randn(static_cast<std::size_t>(kN) * kV, 66, 3.0);
  const int vocab_begin = kV / 2;
  const IVec targets = rand_tokens(kN, 2 * kV, 67);  // some rows' targets fall on other ranks
  std::vector<float> logits(l64.begin(), l64.end()), probs(logits.size()), row_max(kN), losses(kN), losses_in_place(kN);
  std::vector<double> sum_exp(kN), target_logit(kN), sum_exp_in_place(kN), target_logit_in_place(kN);
  k::crossentropy_row_max(row_max.data(), logits.data(), kN, kV);
  k::crossentropy_partial(probs.data(), sum_exp.data(), target_logit.data(), logits.data(), row_max.data(),
                          targets.data(), kN, kV, vocab_begin);
  k::crossentropy_finish(losses.data(), probs.data(), sum_exp.data(), row_max.data(), target_logit.data(), kN, kV);
  std::vector<float> table = logits;
  k::crossentropy_partial(table.data(), sum_exp_in_place.data(), target_logit_in_place.data(), table.data(),
                          row_max.data(), targets.data(), kN, kV, vocab_begin);
  k::crossentropy_finish(losses_in_place.data(), table.data(), sum_exp_in_place.data(), row_max.data(),
                         target_logit_in_place.data(), kN, kV);
  EXPECT_EQ(target_logit_in_place, target_logit);
  EXPECT_EQ(losses_in_place, losses);
  EXPECT_EQ(table, probs);
}

// The fused classifier (crossentropy_fused, and crossentropy_finish_grad after the vocabulary-parallel
// reductions) is the forward then the backward with the arithmetic unchanged: the same bits, into a
// separate table, in place over the logits, or rounded to 16 bits on store.
template <class O>
void expect_fused_crossentropy_exact(const std::vector<float>& logits, const IVec& targets, float dloss) {
  const std::size_t NV = logits.size();
  std::vector<float> probs(NV), losses(kN), fused_losses(kN);
  std::vector<O> dlogits(NV), fused(NV);
  k::crossentropy_forward(losses.data(), probs.data(), logits.data(), targets.data(), kN, kV);
  k::crossentropy_backward<float, float, O>(dlogits.data(), probs.data(), targets.data(), dloss, kN, kV);
  k::crossentropy_fused<float, float, O>(fused_losses.data(), fused.data(), logits.data(), targets.data(), dloss, kN,
                                         kV);
  EXPECT_EQ(fused_losses, losses);
  EXPECT_EQ(0, std::memcmp(fused.data(), dlogits.data(), NV * sizeof(O))) << "dlogits of " << sizeof(O) << " bytes";
  if constexpr (std::is_same_v<O, float>) {  // in place over the logits, as the model's fp32 head
    std::vector<float> table = logits;
    k::crossentropy_fused(fused_losses.data(), table.data(), table.data(), targets.data(), dloss, kN, kV);
    EXPECT_EQ(fused_losses, losses);
    EXPECT_EQ(table, dlogits);
  }

  // Vocabulary-parallel: this rank's half [kV/2, kV) of a 2kV vocabulary (some targets elsewhere).
  const int vocab_begin = kV / 2;
  IVec wide = targets;
  for (std::size_t n = 0; n < wide.size(); ++n) wide[n] = (targets[n] * 7 + static_cast<int>(n)) % (2 * kV);
  std::vector<float> row_max(kN), losses_tp(kN), fused_tp(kN);
  std::vector<double> sum_exp(kN), target_logit(kN), sums_only(kN), target_only(kN);
  k::crossentropy_row_max(row_max.data(), logits.data(), kN, kV);
  k::crossentropy_partial(probs.data(), sum_exp.data(), target_logit.data(), logits.data(), row_max.data(), wide.data(),
                          kN, kV, vocab_begin);
  k::crossentropy_finish(losses_tp.data(), probs.data(), sum_exp.data(), row_max.data(), target_logit.data(), kN, kV);
  k::crossentropy_backward<float, float, O>(dlogits.data(), probs.data(), wide.data(), dloss, kN, kV, vocab_begin);
  k::crossentropy_partial(nullptr, sums_only.data(), target_only.data(), logits.data(), row_max.data(), wide.data(), kN,
                          kV, vocab_begin);  // the fused flow's partial writes no exponentials
  EXPECT_EQ(sums_only, sum_exp);
  EXPECT_EQ(target_only, target_logit);
  k::crossentropy_finish_grad<O>(fused_tp.data(), fused.data(), logits.data(), sums_only.data(), row_max.data(),
                                 target_only.data(), wide.data(), dloss, kN, kV, vocab_begin);
  EXPECT_EQ(fused_tp, losses_tp);
  EXPECT_EQ(0, std::memcmp(fused.data(), dlogits.data(), NV * sizeof(O))) << "vocabulary-parallel dlogits";
}

TEST(Kernels, FusedCrossEntropyIsForwardThenBackwardBitForBit) {
  const Vec l64 = randn(static_cast<std::size_t>(kN) * kV, 68, 3.0);
  std::vector<float> logits(l64.begin(), l64.end());
  logits[2 * kV + 1] = 80.0f;  // one dominant logit: a probability near 1, the rest near 0
  const IVec targets = rand_tokens(kN, kV, 69);
  for (float dloss : {0.37f, 1.0f / 4096.0f, 65536.0f}) {  // 65536: a loss scale's product
    expect_fused_crossentropy_exact<float>(logits, targets, dloss);
    expect_fused_crossentropy_exact<loom::bf16>(logits, targets, dloss);
    expect_fused_crossentropy_exact<loom::f16>(logits, targets, dloss);
  }
}

// ---------------------------------------------------------------------------------------------
// Float math helpers

TEST(Kernels, ExpFastMatchesStdExpOverItsRange) {
  // Dense over the whole non-clamped range [-87, 88] (step 1e-3, ~175k points), compared with the
  // double exp of the same float argument; results below FLT_MIN (denormal, i.e. underflowing)
  // would lose relative precision by design and are skipped.
  double worst = 0, worst_x = 0;
  for (int i = 0; i <= 175000; ++i) {
    const float x = static_cast<float>(-87.0 + 1e-3 * i);
    const double ref = std::exp(static_cast<double>(x));
    if (ref < FLT_MIN) continue;
    const double rel = std::abs(static_cast<double>(k::exp_fast(x)) - ref) / ref;
    if (rel > worst) worst = rel, worst_x = x;
  }
  // Also a dense sweep of the range that softmax uses most, [-20, 0], at step 1e-5.
  for (int i = 0; i <= 2000000; ++i) {
    const float x = static_cast<float>(-1e-5 * i);
    const double ref = std::exp(static_cast<double>(x));
    const double rel = std::abs(static_cast<double>(k::exp_fast(x)) - ref) / ref;
    if (rel > worst) worst = rel, worst_x = x;
  }
  std::printf("[ exp     ] exp_fast max rel err = %.2e at x = %.6g\n", worst, worst_x);
  EXPECT_LT(worst, 1e-6);
  EXPECT_EQ(k::exp_fast(0.0f), 1.0f);  // softmax's max element is exactly 1
  // Clamped outside the range: finite, positive, no inf/nan into softmax sums.
  EXPECT_TRUE(std::isfinite(k::exp_fast(1000.0f)));
  EXPECT_GE(k::exp_fast(-1000.0f), 0.0f);
  EXPECT_LT(k::exp_fast(-1000.0f), 1e-37f);
  EXPECT_EQ(k::exp_k(0.5), std::exp(0.5));  // double: libm
}

TEST(Kernels, TanhFloatMatchesStdTanh) {
  // Dense over [-20, 20] at step 1e-4 (400k points), against the double tanh of the same argument.
  //
  // tanh_k<float> = 1 - 2 / (exp(2x) + 1). Its ABSOLUTE error is at float rounding of 1 (~1e-7)
  // everywhere, which is what GELU needs (it uses 1 + tanh(u)). Its RELATIVE error is not < 1e-6
  // near x = 0: the subtraction from 1 cancels, so for |x| << 1 the result carries an absolute
  // error ~6e-8 and a relative one ~6e-8/|x| (e.g. ~1e-3 at x = 1e-4). See the finding reported
  // with these tests; here the relative bound is asserted for |x| >= 0.25 only, where the
  // cancellation costs at most a factor 1/tanh(0.25) ~ 4 and the sweep measures < 1e-6.
  double worst_abs = 0, worst_rel = 0, worst_rel_small = 0, x_rel = 0, x_small = 0;
  for (int i = -200000; i <= 200000; ++i) {
    const float x = static_cast<float>(1e-4 * i);
    const double ref = std::tanh(static_cast<double>(x));
    const double got = static_cast<double>(k::tanh_k(x));
    const double abs_err = std::abs(got - ref);
    worst_abs = std::max(worst_abs, abs_err);
    if (ref == 0.0) {
      EXPECT_EQ(got, 0.0);
      continue;
    }
    const double rel = abs_err / std::abs(ref);
    if (std::abs(x) >= 0.25f) {
      if (rel > worst_rel) worst_rel = rel, x_rel = x;
    } else if (rel > worst_rel_small) {
      worst_rel_small = rel, x_small = x;
    }
  }
  std::printf(
      "[ tanh    ] tanh_k<float> max abs err = %.2e; max rel err %.2e (|x|>=0.25, at %.4g), %.2e (|x|<0.25, at %.4g)\n",
      worst_abs, worst_rel, x_rel, worst_rel_small, x_small);
  EXPECT_LT(worst_abs, 3e-7);
  EXPECT_LT(worst_rel, 1e-6);
  EXPECT_EQ(k::tanh_k(100.0f), 1.0f);
  EXPECT_EQ(k::tanh_k(-100.0f), -1.0f);
  EXPECT_EQ(k::tanh_k(0.7), std::tanh(0.7));  // double: libm
}

// Near zero, float tanh uses its Taylor series: 1 - 2/(exp(2x)+1) alone would cancel there.
TEST(Kernels, TanhFloatRelativeErrorNearZero) {
  for (float x = -0.5f; x <= 0.5f; x += 1.0f / 4096) {
    if (x == 0.0f) continue;
    const double ref = std::tanh(static_cast<double>(x));
    EXPECT_LT(std::abs(static_cast<double>(k::tanh_k(x)) - ref) / std::abs(ref), 1e-6) << "x = " << x;
  }
  for (float x : {1e-30f, 1e-8f, 1e-4f, -1e-3f, 1e-2f, 0.1f}) {
    const double ref = std::tanh(static_cast<double>(x));
    EXPECT_LT(std::abs(static_cast<double>(k::tanh_k(x)) - ref) / std::abs(ref), 1e-6) << "x = " << x;
  }
}

// ---------------------------------------------------------------------------------------------
// AdamW

namespace {
// torch.optim.AdamW, one scalar at a time.
struct ScalarAdamW {
  double p, m = 0, v = 0;
  void step(double g, double lr, double b1, double b2, double eps, double wd, int t) {
    m = b1 * m + (1 - b1) * g;
    v = b2 * v + (1 - b2) * g * g;
    const double mhat = m / (1 - std::pow(b1, t));
    const double vhat = v / (1 - std::pow(b2, t));
    p -= lr * wd * p;  // decoupled decay, on the pre-update value
    p -= lr * mhat / (std::sqrt(vhat) + eps);
  }
};

template <class T>
void adamw_against_reference(double wd, double tol) {
  const std::int64_t n = k::kChunk + 17;  // more than one chunk
  const double lr = 1e-2, b1 = 0.9, b2 = 0.95, eps = 1e-8;
  const Vec p0 = randn(n, 71);
  std::vector<T> p(p0.begin(), p0.end()), m(n, T(0)), v(n, T(0));
  std::vector<ScalarAdamW> ref(n);
  for (std::int64_t i = 0; i < n; ++i) ref[i].p = static_cast<double>(p[i]);
  // Each error relative to the quantity's own magnitude, floored at its natural scale so that a
  // value crossing zero keeps the absolute rounding error of a quantity of that scale: p moves by
  // ~lr per step (floor lr), m ~ (1-beta1)|g| ~ 3e-2 (floor 1e-2), v ~ (1-beta2) g^2 ~ 5e-3
  // (floor 1e-4). (The float kernel also sees beta1, beta2 rounded to float: 1 - float(0.9) is
  // 2.4e-7 off 0.1, relative.)
  double wp = 0, wm = 0, wv = 0;
  for (int t = 1; t <= 5; ++t) {
    const Vec g = randn(n, 100 + t, 0.3);
    const std::vector<T> gt(g.begin(), g.end());
    k::adamw_update(p.data(), m.data(), v.data(), gt.data(), n, T(lr), T(b1), T(b2), T(eps), T(wd),
                    static_cast<std::int64_t>(t));
    for (std::int64_t i = 0; i < n; ++i) {
      ref[i].step(static_cast<double>(gt[i]), lr, b1, b2, eps, wd, t);
      wp = std::max(wp, std::abs(static_cast<double>(p[i]) - ref[i].p) / std::max(lr, std::abs(ref[i].p)));
      wm = std::max(wm, std::abs(static_cast<double>(m[i]) - ref[i].m) / std::max(1e-2, std::abs(ref[i].m)));
      wv = std::max(wv, std::abs(static_cast<double>(v[i]) - ref[i].v) / std::max(1e-4, std::abs(ref[i].v)));
    }
  }
  const double worst = std::max({wp, wm, wv});
  std::printf("[ adamw   ] %s wd=%.2g: 5 steps vs scalar reference, max rel err p %.2e, m %.2e, v %.2e\n",
              std::is_same_v<T, float> ? "float " : "double", wd, wp, wm, wv);
  EXPECT_LT(worst, tol);
}
}  // namespace

// Double: the same formula in the same order, differences are last-bit (1e-12 is generous).
// Float: each step rounds p, m, v and the hyper-parameters to float (~6e-8 relative each); after
// five steps the error stays ~1e-6 relative (bound 1e-5).
TEST(Kernels, AdamWMatchesScalarReference) {
  adamw_against_reference<double>(0.0, 1e-12);
  adamw_against_reference<double>(0.1, 1e-12);
  adamw_against_reference<float>(0.0, 1e-5);
  adamw_against_reference<float>(0.1, 1e-5);
}

TEST(Kernels, AdamWDecayIsDecoupled) {
  // Zero gradient: Adam's step is 0/(0+eps) = 0, so only the decay moves the parameter.
  double p = 2.0, m = 0, v = 0;
  const double g = 0;
  k::adamw_update(&p, &m, &v, &g, 1, 0.1, 0.9, 0.95, 1e-8, 0.5, std::int64_t{1});
  EXPECT_DOUBLE_EQ(p, 2.0 * (1 - 0.1 * 0.5));
  k::adamw_update(&p, &m, &v, &g, 1, 0.1, 0.9, 0.95, 1e-8, 0.0, std::int64_t{2});
  EXPECT_DOUBLE_EQ(p, 2.0 * (1 - 0.1 * 0.5));  // no decay, no gradient: unchanged
}

// ---------------------------------------------------------------------------------------------
// Reductions and fills

TEST(Kernels, ReductionsAndFills) {
  const std::int64_t n = 3 * k::kChunk + 5;
  const Vec x = rounded(randn(n, 81));
  const FVec xf = to_float(x);
  double s = 0, ss = 0;
  for (double a : x) s += a, ss += a * a;
  EXPECT_NEAR(k::sum(xf.data(), n), s, 1e-9 * n);            // double accumulation
  EXPECT_NEAR(k::sum_squares(xf.data(), n), ss, 1e-5 * ss);  // float partial sums per chunk
  EXPECT_NEAR(k::sum_squares(x.data(), n), ss, 1e-12 * ss);
  FVec y(n, 5.0f);
  k::copy(y.data(), xf.data(), n);
  EXPECT_EQ(y, xf);
  k::scale(y.data(), 0.5f, n);
  for (std::int64_t i = 0; i < n; ++i) EXPECT_EQ(y[i], 0.5f * xf[i]);
  k::fill(y.data(), -2.0f, n);
  for (std::int64_t i = 0; i < n; ++i) EXPECT_EQ(y[i], -2.0f);
  FVec z(n);
  k::residual_forward(z.data(), xf.data(), y.data(), n);
  for (std::int64_t i = 0; i < n; ++i) EXPECT_EQ(z[i], xf[i] + y[i]);
}

// ---------------------------------------------------------------------------------------------
// The float instantiation of every forward agrees with the double one on identical inputs.
// Tolerance 1e-5 relative to the tensor's largest magnitude: each output is a short chain (at
// most a C- or T-term accumulation plus exp/tanh) of float operations, each ~6e-8 relative.

TEST(Kernels, FloatForwardsAgreeWithDouble) {
  const std::size_t NC = static_cast<std::size_t>(kN) * kC;
  {  // encoder
    const IVec inp = rand_tokens(kN, kV, 91);
    const Vec wte = rounded(randn(static_cast<std::size_t>(kV) * kC, 92)),
              wpe = rounded(randn(static_cast<std::size_t>(kT) * kC, 93));
    Vec od(NC);
    FVec of(NC);
    k::encoder_forward(od.data(), inp.data(), wte.data(), wpe.data(), kB, kT, kC);
    k::encoder_forward(of.data(), inp.data(), to_float(wte).data(), to_float(wpe).data(), kB, kT, kC);
    expect_float_close("encoder out", of, od);
  }
  {  // layernorm
    const Vec x = rounded(randn(NC, 94, 1.5, 0.7)), w = rounded(randn(kC, 95, 0.5, 1.0)), b = rounded(randn(kC, 96));
    Vec od(NC), md(kN), rd(kN);
    FVec of(NC), mf(kN), rf(kN);
    k::layernorm_forward(od.data(), md.data(), rd.data(), x.data(), w.data(), b.data(), kN, kC);
    k::layernorm_forward(of.data(), mf.data(), rf.data(), to_float(x).data(), to_float(w).data(), to_float(b).data(),
                         kN, kC);
    expect_float_close("layernorm out", of, od);
    expect_float_close("layernorm mean", mf, md);
    expect_float_close("layernorm rstd", rf, rd);
  }
  for (bool with_bias : {false, true}) {  // matmul
    const Vec x = rounded(randn(NC, 97)), w = rounded(randn(static_cast<std::size_t>(kOC) * kC, 98)),
              b = rounded(randn(kOC, 99));
    const FVec bf = to_float(b);
    Vec od(static_cast<std::size_t>(kN) * kOC);
    FVec of(od.size());
    k::matmul_forward(od.data(), x.data(), w.data(), with_bias ? b.data() : nullptr, kN, kC, kOC);
    k::matmul_forward(of.data(), to_float(x).data(), to_float(w).data(), with_bias ? bf.data() : nullptr, kN, kC, kOC);
    expect_float_close(with_bias ? "matmul+bias out" : "matmul out", of, od);
  }
  {  // attention
    const Vec qkv = rounded(randn(3 * NC, 100, 1.5));
    Vec od(NC), ad(static_cast<std::size_t>(kB) * kNH * kT * kT);
    FVec of(NC), af(ad.size());
    k::attention_forward(od.data(), ad.data(), qkv.data(), kB, kT, kC, kNH);
    k::attention_forward(of.data(), af.data(), to_float(qkv).data(), kB, kT, kC, kNH);
    expect_float_close("attention out", of, od);
    expect_float_close("attention probs", af, ad);
  }
  {  // gelu, over more than one chunk
    const std::int64_t n = 2 * k::kChunk + 3;
    const Vec x = rounded(randn(n, 101, 3.0));
    Vec od(n);
    FVec of(n);
    k::gelu_forward(od.data(), x.data(), n);
    k::gelu_forward(of.data(), to_float(x).data(), n);
    expect_float_close("gelu out", of, od);
    // and the float backward against the double one
    const Vec d = rounded(randn(n, 102));
    Vec gd(n);
    FVec gf(n);
    k::gelu_backward(gd.data(), x.data(), d.data(), n);
    k::gelu_backward(gf.data(), to_float(x).data(), to_float(d).data(), n);
    expect_float_close("gelu dinp", gf, gd);
  }
  {  // crossentropy
    const Vec l = rounded(randn(static_cast<std::size_t>(kN) * kV, 103, 3.0));
    const IVec tg = rand_tokens(kN, kV, 104);
    Vec lossd(kN), pd(l.size());
    FVec lossf(kN), pf(l.size());
    k::crossentropy_forward(lossd.data(), pd.data(), l.data(), tg.data(), kN, kV);
    k::crossentropy_forward(lossf.data(), pf.data(), to_float(l).data(), tg.data(), kN, kV);
    expect_float_close("crossentropy losses", lossf, lossd);
    expect_float_close("crossentropy probs", pf, pd);
  }
}

// ---------------------------------------------------------------------------------------------
// bf16 and fp16 storage (compute in float).
//
// Each 16-bit instantiation runs on inputs rounded to the 16-bit type, against the float
// instantiation on the very same values (every bf16/fp16 value is a float). The error is measured
// as |x_16 - x_f32|_2 / |x_f32|_2 over the whole tensor and bounded in units of the type's unit
// roundoff u (2^-8 for bf16, 2^-11 for fp16):
//   - a result that the 16-bit kernel computes in float exactly as the float kernel does and
//     rounds once when it stores it is within u of it, element by element, so within u in norm;
//     the bound is 1.01 u (the float arithmetic of the two instantiations may differ in the last
//     float bit: contraction to FMA, a BLAS kernel choice);
//   - a result rounded k times on the way (a stored intermediate rounded, then used) gets k u;
//   - a result kept in the compute type (LayerNorm mean and rstd, the losses, sums of squares, the
//     AdamW moments) agrees with float to float rounding: kAccTol = 1e-5, 50x below fp16's u.
// The tests named *AccumulatesInFloat size a sum so that a 16-bit running sum cannot hold it (a
// bf16 sum of values near 1 stops growing at 512) and would miss these bounds by orders of
// magnitude; each says which sum, and three show it with an emulated 16-bit accumulation that
// misses the very bound asserted on the kernel.

namespace {
using loom::bf16;
using loom::f16;

template <class H>
constexpr double unit_roundoff = std::is_same_v<H, bf16> ? 0x1p-8 : 0x1p-11;
template <class H>
const char* half_name = std::is_same_v<H, bf16> ? "bf16" : "fp16";
constexpr double kAccTol = 1e-5;

template <class H>
std::vector<H> to_half(const Vec& v) {
  std::vector<H> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = loom::from_acc<H>(v[i]);
  return r;
}
template <class X>
Vec widen(const std::vector<X>& v) {
  Vec r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = loom::to_acc<double>(v[i]);
  return r;
}
// v rounded to H, as doubles (exact): the inputs that both instantiations see.
template <class H>
Vec rounded_to(const Vec& v) {
  return widen(to_half<H>(v));
}

double norm_err(const Vec& got, const Vec& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Asserts |got - ref| / |ref| <= bound; the bound is given in units of u when `in_u`.
template <class H, class X, class Y>
void expect_half_close(const char* what, const std::vector<X>& got, const std::vector<Y>& ref, double bound) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  const double e = norm_err(widen(got), widen(ref));
  std::printf("[ %s    ] %-34s |x - x_f32| / |x_f32| = %.2e = %6.3f u (bound %.2e = %.2f u)\n", half_name<H>, what, e,
              e / unit_roundoff<H>, bound, bound / unit_roundoff<H>);
  EXPECT_LE(e, bound) << half_name<H> << " " << what;
}

// LayerNorm forward and backward of the same (rounded) inputs in float and in H, N rows of C.
template <class H>
struct LayerNormPair {
  FVec of, mf, rf, mh, rh, dxf, dwf, dbf;  // float out, mean, rstd (float and H runs), float gradients
  std::vector<H> oh, dxh, dwh, dbh;        // H out and gradients
};
template <class H>
LayerNormPair<H> layernorm_pair(const Vec& x, const Vec& w, const Vec& b, const Vec& d, int N, int C) {
  const std::size_t NC = static_cast<std::size_t>(N) * C;
  LayerNormPair<H> r{FVec(NC),
                     FVec(N),
                     FVec(N),
                     FVec(N),
                     FVec(N),
                     FVec(NC, 0.0f),
                     FVec(C, 0.0f),
                     FVec(C, 0.0f),
                     std::vector<H>(NC),
                     std::vector<H>(NC),
                     std::vector<H>(C),
                     std::vector<H>(C)};
  k::layernorm_forward(r.of.data(), r.mf.data(), r.rf.data(), to_float(x).data(), to_float(w).data(),
                       to_float(b).data(), N, C);
  k::layernorm_forward(r.oh.data(), r.mh.data(), r.rh.data(), to_half<H>(x).data(), to_half<H>(w).data(),
                       to_half<H>(b).data(), N, C);
  k::layernorm_backward(r.dxf.data(), r.dwf.data(), r.dbf.data(), to_float(d).data(), to_float(x).data(),
                        to_float(w).data(), r.mf.data(), r.rf.data(), N, C);
  k::layernorm_backward(r.dxh.data(), r.dwh.data(), r.dbh.data(), to_half<H>(d).data(), to_half<H>(x).data(),
                        to_half<H>(w).data(), r.mh.data(), r.rh.data(), N, C);
  return r;
}

template <class H>
void half_forwards_and_backwards() {
  const double u = unit_roundoff<H>, once = 1.01 * u;
  const std::size_t NC = static_cast<std::size_t>(kN) * kC;
  {  // encoder, with repeated tokens
    IVec inp = rand_tokens(kN, kV, 201);
    inp[7] = inp[2];
    inp[9] = inp[2];
    const Vec wte = rounded_to<H>(randn(static_cast<std::size_t>(kV) * kC, 202)),
              wpe = rounded_to<H>(randn(static_cast<std::size_t>(kT) * kC, 203)), d = rounded_to<H>(randn(NC, 204)),
              g0te = rounded_to<H>(randn(wte.size(), 205)), g0pe = rounded_to<H>(randn(wpe.size(), 206));
    FVec of(NC);
    std::vector<H> oh(NC);
    k::encoder_forward(of.data(), inp.data(), to_float(wte).data(), to_float(wpe).data(), kB, kT, kC);
    k::encoder_forward(oh.data(), inp.data(), to_half<H>(wte).data(), to_half<H>(wpe).data(), kB, kT, kC);
    expect_half_close<H>("encoder out", oh, of, once);
    FVec tef = to_float(g0te), pef = to_float(g0pe);
    std::vector<H> teh = to_half<H>(g0te), peh = to_half<H>(g0pe);
    k::encoder_backward(tef.data(), pef.data(), to_float(d).data(), inp.data(), kB, kT, kC);
    k::encoder_backward(teh.data(), peh.data(), to_half<H>(d).data(), inp.data(), kB, kT, kC);
    expect_half_close<H>("encoder dwte (+=)", teh, tef, once);
    expect_half_close<H>("encoder dwpe (+=)", peh, pef, once);
  }
  {  // layernorm
    const Vec x = rounded_to<H>(randn(NC, 211, 1.5, 0.7)), w = rounded_to<H>(randn(kC, 212, 0.5, 1.0)),
              b = rounded_to<H>(randn(kC, 213, 0.5)), d = rounded_to<H>(randn(NC, 214));
    const LayerNormPair<H> r = layernorm_pair<H>(x, w, b, d, kN, kC);
    expect_half_close<H>("layernorm out", r.oh, r.of, once);
    expect_half_close<H>("layernorm mean (float)", r.mh, r.mf, kAccTol);
    expect_half_close<H>("layernorm rstd (float)", r.rh, r.rf, kAccTol);
    expect_half_close<H>("layernorm dinp", r.dxh, r.dxf, once);
    expect_half_close<H>("layernorm dweight", r.dwh, r.dwf, once);
    expect_half_close<H>("layernorm dbias", r.dbh, r.dbf, once);
  }
  {  // matmul + bias: the product is rounded, then the bias added and rounded again (2 u)
    const Vec x = rounded_to<H>(randn(NC, 221)), w = rounded_to<H>(randn(static_cast<std::size_t>(kOC) * kC, 222, 0.5)),
              b = rounded_to<H>(randn(kOC, 223)), d = rounded_to<H>(randn(static_cast<std::size_t>(kN) * kOC, 224)),
              g0w = rounded_to<H>(randn(w.size(), 225)), g0b = rounded_to<H>(randn(kOC, 226));
    FVec of(static_cast<std::size_t>(kN) * kOC);
    std::vector<H> oh(of.size());
    k::matmul_forward(of.data(), to_float(x).data(), to_float(w).data(), to_float(b).data(), kN, kC, kOC);
    k::matmul_forward(oh.data(), to_half<H>(x).data(), to_half<H>(w).data(), to_half<H>(b).data(), kN, kC, kOC);
    expect_half_close<H>("matmul+bias out", oh, of, 2.02 * u);
    FVec dxf(NC), dwf = to_float(g0w), dbf = to_float(g0b);
    std::vector<H> dxh(NC), dwh = to_half<H>(g0w), dbh = to_half<H>(g0b);
    k::matmul_backward(dxf.data(), dwf.data(), dbf.data(), to_float(d).data(), to_float(x).data(), to_float(w).data(),
                       kN, kC, kOC);
    k::matmul_backward(dxh.data(), dwh.data(), dbh.data(), to_half<H>(d).data(), to_half<H>(x).data(),
                       to_half<H>(w).data(), kN, kC, kOC);
    expect_half_close<H>("matmul dinp", dxh, dxf, once);
    expect_half_close<H>("matmul dweight (+=)", dwh, dwf, once);
    expect_half_close<H>("matmul dbias (+=)", dbh, dbf, once);
  }
  {  // attention. Stored intermediates are rounded: the scores s (an absolute error u|s| in a
     // softmax argument moves a probability by up to 2 u max|s| relative), the probabilities, the
     // output. qkv ~ N(0,1), hs = 4: |s| < 4 here (checked), so the probabilities are within
     // (2 * 4 + 1) u and the output within 10 u. The backward rounds datt and dscores on top and
     // subtracts (datt - dot) with cancellation: bound 16 u (measured: ~1 u).
    const Vec qkv = rounded_to<H>(randn(3 * NC, 231)), d = rounded_to<H>(randn(NC, 232));
    double smax = 0;
    for (int b = 0; b < kB; ++b)
      for (int h = 0; h < kNH; ++h)
        for (int t = 0; t < kT; ++t)
          for (int j = 0; j < kT; ++j) {
            double sc = 0;
            for (int x = 0; x < kC / kNH; ++x)
              sc += qkv[(b * kT + t) * 3 * kC + h * (kC / kNH) + x] *
                    qkv[(b * kT + j) * 3 * kC + kC + h * (kC / kNH) + x];
            smax = std::max(smax, std::abs(sc) / std::sqrt(kC / kNH));
          }
    ASSERT_LT(smax, 4.0);
    FVec of(NC), af(static_cast<std::size_t>(kB) * kNH * kT * kT);
    std::vector<H> oh(NC), ah(af.size());
    k::attention_forward(of.data(), af.data(), to_float(qkv).data(), kB, kT, kC, kNH);
    k::attention_forward(oh.data(), ah.data(), to_half<H>(qkv).data(), kB, kT, kC, kNH);
    expect_half_close<H>("attention probs", ah, af, 9 * u);
    expect_half_close<H>("attention out", oh, of, 10 * u);
    FVec dqf(3 * NC), sf(static_cast<std::size_t>(kT) * kT);
    std::vector<H> dqh(3 * NC), sh(sf.size());
    k::attention_backward(dqf.data(), sf.data(), to_float(d).data(), to_float(qkv).data(), af.data(), kB, kT, kC, kNH);
    k::attention_backward(dqh.data(), sh.data(), to_half<H>(d).data(), to_half<H>(qkv).data(), ah.data(), kB, kT, kC,
                          kNH);
    expect_half_close<H>("attention dqkv", dqh, dqf, 16 * u);
  }
  {  // gelu and residual, over more than one chunk
    const std::int64_t n = 2 * k::kChunk + 3;
    const Vec x = rounded_to<H>(randn(n, 241, 3.0)), d = rounded_to<H>(randn(n, 242));
    FVec of(n), gf(n), rf(n);
    std::vector<H> oh(n), gh(n), rh(n);
    k::gelu_forward(of.data(), to_float(x).data(), n);
    k::gelu_forward(oh.data(), to_half<H>(x).data(), n);
    expect_half_close<H>("gelu out", oh, of, once);
    k::gelu_backward(gf.data(), to_float(x).data(), to_float(d).data(), n);
    k::gelu_backward(gh.data(), to_half<H>(x).data(), to_half<H>(d).data(), n);
    expect_half_close<H>("gelu dinp", gh, gf, once);
    k::residual_forward(rf.data(), to_float(x).data(), to_float(d).data(), n);
    k::residual_forward(rh.data(), to_half<H>(x).data(), to_half<H>(d).data(), n);
    expect_half_close<H>("residual out", rh, rf, once);
  }
  {  // crossentropy: losses in float; probabilities rounded once; dlogits = (p - onehot) dloss
     // from the rounded p, rounded again (2 u)
    const Vec l = rounded_to<H>(randn(static_cast<std::size_t>(kN) * kV, 251, 3.0));
    const IVec tg = rand_tokens(kN, kV, 252);
    FVec lossf(kN), lossh(kN), pf(l.size());
    std::vector<H> ph(l.size());
    k::crossentropy_forward(lossf.data(), pf.data(), to_float(l).data(), tg.data(), kN, kV);
    k::crossentropy_forward(lossh.data(), ph.data(), to_half<H>(l).data(), tg.data(), kN, kV);
    expect_half_close<H>("crossentropy losses (float)", lossh, lossf, kAccTol);
    expect_half_close<H>("crossentropy probs", ph, pf, once);
    FVec df(l.size());
    std::vector<H> dh(l.size());
    k::crossentropy_backward(df.data(), pf.data(), tg.data(), 0.37f, kN, kV);
    k::crossentropy_backward(dh.data(), ph.data(), tg.data(), 0.37f, kN, kV);
    expect_half_close<H>("crossentropy dlogits", dh, df, 2.02 * u);
  }
  {  // sums (float partials per chunk, double across chunks), scale, fill
    const std::int64_t n = 3 * k::kChunk + 5;
    const Vec x = rounded_to<H>(randn(n, 261, 0.1, 1.0));  // near 1: a 16-bit partial sum would stall
    const std::vector<H> xh = to_half<H>(x);
    long double ss = 0, s = 0;
    for (double a : x) ss += static_cast<long double>(a) * a, s += a;
    // Recursive float summation of 4096 positive terms: error <= 4096 * 2^-24 = 2.4e-4 relative at
    // worst, ~sqrt(4096) * 2^-24 = 4e-6 typically; 1e-4, still 39x below bf16's u (a bf16 partial
    // sum of ~4096 values near 1 stops near 512: -87%).
    const double e_ss = std::abs(k::sum_squares(xh.data(), n) - static_cast<double>(ss)) / static_cast<double>(ss);
    const double e_s = std::abs(k::sum(xh.data(), n) - static_cast<double>(s)) / static_cast<double>(s);
    std::printf("[ %s    ] sum_squares rel err %.2e, sum rel err %.2e\n", half_name<H>, e_ss, e_s);
    EXPECT_LT(e_ss, 1e-4);
    EXPECT_LT(e_s, 1e-12);  // double accumulation of exact values
    std::vector<H> y = xh;
    FVec yf = to_float(x);
    k::scale(y.data(), 0.3f, n);
    k::scale(yf.data(), 0.3f, n);
    expect_half_close<H>("scale", y, yf, once);
    k::fill(y.data(), 0.1f, n);
    for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(y[i].bits, loom::from_acc<H>(0.1f).bits) << i;
  }
}

// AdamW: moments and arithmetic in float. With bf16/fp16 gradients and float parameters it is the
// float kernel on the gradients' values (kAccTol); with 16-bit parameters as well, each of the 5
// steps rounds the parameters once more (5 u; the moments do not see the parameters).
template <class H>
void half_adamw() {
  const double u = unit_roundoff<H>;
  const std::int64_t n = k::kChunk + 17;
  const Vec p0 = rounded_to<H>(randn(n, 271));
  FVec pf = to_float(p0), mf(n, 0.0f), vf(n, 0.0f);
  FVec pm = pf, mm(n, 0.0f), vm(n, 0.0f);  // float master weights, 16-bit gradients
  std::vector<H> ph = to_half<H>(p0);
  FVec mh(n, 0.0f), vh(n, 0.0f);  // 16-bit parameters and gradients
  for (int t = 1; t <= 5; ++t) {
    const Vec g = rounded_to<H>(randn(n, 280 + t, 0.3));
    const std::vector<H> gh = to_half<H>(g);
    k::adamw_update(pf.data(), mf.data(), vf.data(), to_float(g).data(), n, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, t);
    k::adamw_update(pm.data(), mm.data(), vm.data(), gh.data(), n, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, t);
    k::adamw_update(ph.data(), mh.data(), vh.data(), gh.data(), n, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, t);
  }
  expect_half_close<H>("adamw fp32 params, 16-bit grads", pm, pf, kAccTol);
  expect_half_close<H>("adamw m (16-bit grads)", mm, mf, kAccTol);
  expect_half_close<H>("adamw v (16-bit grads)", vm, vf, kAccTol);
  expect_half_close<H>("adamw 16-bit params, 5 steps", ph, pf, 5.05 * u);
  expect_half_close<H>("adamw m (16-bit params)", mh, mf, kAccTol);
}
}  // namespace

TEST(Kernels, Bf16AgreesWithFloat) { half_forwards_and_backwards<bf16>(); }
TEST(Kernels, Fp16AgreesWithFloat) { half_forwards_and_backwards<f16>(); }
TEST(Kernels, Bf16AdamWKeepsFloatMoments) { half_adamw<bf16>(); }
TEST(Kernels, Fp16AdamWKeepsFloatMoments) { half_adamw<f16>(); }

// ---------------------------------------------------------------------------------------------
// Accumulation in float, shown on sums that a 16-bit running sum cannot hold. Near S a bf16 value
// has spacing ~S/128 (fp16: ~S/1024), and each addition to a running sum is rounded by up to half
// of that: a bf16 sum of terms near 1 stops growing at 512 (spacing 4), so a sum of thousands of
// them comes out near 512; an fp16 one drifts by up to 1 per addition beyond 2048 and stops at
// 4096. The bounds are those above; the emulated 16-bit accumulations show that they would fail
// (for bf16 by orders of magnitude, for fp16 by 20-200x).

namespace {
// The sum of x[0], x[stride], ... kept in H after every addition: what a kernel accumulating in
// its storage type computes.
template <class H>
double storage_type_sum(const double* x, std::int64_t n, std::int64_t stride = 1) {
  H s = loom::from_acc<H>(0.0f);
  for (std::int64_t i = 0; i < n; ++i)
    s = loom::from_acc<H>(loom::to_acc<float>(s) + static_cast<float>(x[i * stride]));
  return loom::to_acc<double>(s);
}

template <class H>
void layernorm_accumulates_in_float() {
  const double once = 1.01 * unit_roundoff<H>;
  {  // the row statistics and the backward's row sums: C = 4096 channels near 1
    const int N = 8, C = 4096;
    const std::size_t NC = static_cast<std::size_t>(N) * C;
    const Vec x = rounded_to<H>(randn(NC, 301, 0.05, 1.0)), w = rounded_to<H>(randn(C, 302, 0.1, 1.0)),
              b = rounded_to<H>(randn(C, 303, 0.1)), d = rounded_to<H>(randn(NC, 304, 0.05, 1.0));
    const LayerNormPair<H> r = layernorm_pair<H>(x, w, b, d, N, C);
    const FVec& of = r.of;
    const FVec& mf = r.mf;
    expect_half_close<H>("C=4096 layernorm mean", r.mh, r.mf, kAccTol);
    expect_half_close<H>("C=4096 layernorm rstd", r.rh, r.rf, kAccTol);
    expect_half_close<H>("C=4096 layernorm out", r.oh, r.of, once);
    expect_half_close<H>("C=4096 layernorm dinp", r.dxh, r.dxf, once);

    // The same forward with the mean and variance summed in H: misses both bounds.
    Vec me(N), oe(NC);
    for (int n = 0; n < N; ++n) {
      const double* xr = &x[static_cast<std::size_t>(n) * C];
      me[n] = storage_type_sum<H>(xr, C) / C;
      Vec sq(C);
      for (int c = 0; c < C; ++c) sq[c] = (xr[c] - me[n]) * (xr[c] - me[n]);
      const double s = 1.0 / std::sqrt(storage_type_sum<H>(sq.data(), C) / C + 1e-5);
      for (int c = 0; c < C; ++c) oe[static_cast<std::size_t>(n) * C + c] = (xr[c] - me[n]) * s * w[c] + b[c];
    }
    const double e_mean = norm_err(me, widen(mf)), e_out = norm_err(oe, widen(of));
    std::printf(
        "[ %s    ] C=4096 layernorm with %s sums: mean err %.2e (bound %.0e), out err %.2e = %.0f u (bound %.2f u)\n",
        half_name<H>, half_name<H>, e_mean, kAccTol, e_out, e_out / unit_roundoff<H>, once / unit_roundoff<H>);
    if (std::is_same_v<H, bf16>) {  // an fp16 sum of 4096 values near 1 stalls at 2048: out is also far off
      EXPECT_GT(e_mean, 100 * kAccTol);
      EXPECT_GT(e_out, 100 * once);
    }
  }
  {  // dweight and dbias: sums over N = 2048 rows of a gradient near 1
    const int N = 2048, C = 16;
    const std::size_t NC = static_cast<std::size_t>(N) * C;
    const Vec x = rounded_to<H>(randn(NC, 311)), w = rounded_to<H>(randn(C, 312, 0.1, 1.0)),
              b = rounded_to<H>(randn(C, 313, 0.1)), d = rounded_to<H>(randn(NC, 314, 0.05, 1.0));
    FVec of(NC), mf(N), rf(N), mh(N), rh(N);
    std::vector<H> oh(NC);
    k::layernorm_forward(of.data(), mf.data(), rf.data(), to_float(x).data(), to_float(w).data(), to_float(b).data(), N,
                         C);
    k::layernorm_forward(oh.data(), mh.data(), rh.data(), to_half<H>(x).data(), to_half<H>(w).data(),
                         to_half<H>(b).data(), N, C);
    FVec dxf(NC, 0.0f), dwf(C, 0.0f), dbf(C, 0.0f);
    std::vector<H> dxh(NC), dwh(C), dbh(C);
    k::layernorm_backward(dxf.data(), dwf.data(), dbf.data(), to_float(d).data(), to_float(x).data(),
                          to_float(w).data(), mf.data(), rf.data(), N, C);
    k::layernorm_backward(dxh.data(), dwh.data(), dbh.data(), to_half<H>(d).data(), to_half<H>(x).data(),
                          to_half<H>(w).data(), mh.data(), rh.data(), N, C);
    expect_half_close<H>("N=2048 layernorm dweight", dwh, dwf, once);
    expect_half_close<H>("N=2048 layernorm dbias", dbh, dbf, once);
  }
}

template <class H>
void bias_backward_accumulates_in_float() {
  const int N = 4096, OC = 8;
  const double once = 1.01 * unit_roundoff<H>;
  const Vec d = rounded_to<H>(randn(static_cast<std::size_t>(N) * OC, 321, 0.05, 1.0));
  FVec df(OC, 0.0f);
  std::vector<H> dh(OC);
  k::bias_backward(df.data(), to_float(d).data(), N, OC);
  k::bias_backward(dh.data(), to_half<H>(d).data(), N, OC);
  expect_half_close<H>("N=4096 bias_backward dbias", dh, df, once);
  Vec de(OC);
  for (int j = 0; j < OC; ++j) de[j] = storage_type_sum<H>(d.data() + j, N, OC);
  const double e = norm_err(de, widen(df));
  std::printf("[ %s    ] N=4096 dbias summed in %s: err %.2e = %.0f u (bound %.2f u)\n", half_name<H>, half_name<H>, e,
              e / unit_roundoff<H>, once / unit_roundoff<H>);
  EXPECT_GT(e, 10 * once);
}

template <class H>
void crossentropy_accumulates_in_float() {
  const int N = 4, V = 8192;
  const double once = 1.01 * unit_roundoff<H>;
  const Vec l = rounded_to<H>(randn(static_cast<std::size_t>(N) * V, 331, 0.02));  // softmax sum ~ V
  const IVec tg = rand_tokens(N, V, 332);
  FVec lossf(N), lossh(N), pf(l.size());
  std::vector<H> ph(l.size());
  k::crossentropy_forward(lossf.data(), pf.data(), to_float(l).data(), tg.data(), N, V);
  k::crossentropy_forward(lossh.data(), ph.data(), to_half<H>(l).data(), tg.data(), N, V);
  expect_half_close<H>("V=8192 crossentropy losses", lossh, lossf, kAccTol);
  expect_half_close<H>("V=8192 crossentropy probs", ph, pf, once);
  Vec le(N);
  for (int n = 0; n < N; ++n) {
    const double* lr = &l[static_cast<std::size_t>(n) * V];
    const double mx = *std::max_element(lr, lr + V);
    Vec e(V);
    for (int v = 0; v < V; ++v) e[v] = std::exp(lr[v] - mx);
    le[n] = std::log(storage_type_sum<H>(e.data(), V)) + mx - lr[tg[n]];
  }
  const double e = norm_err(le, widen(lossf));
  std::printf("[ %s    ] V=8192 crossentropy with the softmax sum in %s: loss err %.2e (bound %.0e)\n", half_name<H>,
              half_name<H>, e, kAccTol);
  EXPECT_GT(e, 100 * kAccTol);
}

// T = 1024 keys with scores near 0: the softmax sum of row t is ~t + 1 (a bf16 sum stops at 512).
// The backward's row dot products: dout = 1 and v = 1/8 + noise make datt ~ 1 + N(0, 0.25^2), so
// dot_t = sum_j att_tj datt_tj ~ 1 is a sum of ~t terms ~1/t (a bf16 sum stops near 1/2). dscores =
// att (datt - dot) cancels to the noise, so dq and dk (compared on their own, since dv's norm is
// far larger than theirs) carry datt's rounding (u * 1 against 0.25, ~4 u at most): bound 8 u.
template <class H>
void attention_accumulates_in_float() {
  const int B = 1, T = 1024, C = 8, NH = 1;
  const double u = unit_roundoff<H>;
  Vec qkv = randn(static_cast<std::size_t>(T) * 3 * C, 341, 0.05);
  const Vec vnoise = randn(static_cast<std::size_t>(T) * C, 342, 0.09, 0.125);
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c)
      qkv[static_cast<std::size_t>(t) * 3 * C + 2 * C + c] = vnoise[static_cast<std::size_t>(t) * C + c];
  qkv = rounded_to<H>(qkv);
  const Vec d(static_cast<std::size_t>(T) * C, 1.0);
  FVec of(static_cast<std::size_t>(T) * C), af(static_cast<std::size_t>(T) * T);
  std::vector<H> oh(of.size()), ah(af.size());
  k::attention_forward(of.data(), af.data(), to_float(qkv).data(), B, T, C, NH);
  k::attention_forward(oh.data(), ah.data(), to_half<H>(qkv).data(), B, T, C, NH);
  expect_half_close<H>("T=1024 attention probs", ah, af, 1.1 * u);
  expect_half_close<H>("T=1024 attention out", oh, of, 2.02 * u);
  FVec dqf(qkv.size()), sf(af.size());
  std::vector<H> dqh(qkv.size()), sh(af.size());
  k::attention_backward(dqf.data(), sf.data(), to_float(d).data(), to_float(qkv).data(), af.data(), B, T, C, NH);
  k::attention_backward(dqh.data(), sh.data(), to_half<H>(d).data(), to_half<H>(qkv).data(), ah.data(), B, T, C, NH);
  for (int part = 0; part < 3; ++part) {
    FVec pf;
    std::vector<H> ph;
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < C; ++c) {
        pf.push_back(dqf[static_cast<std::size_t>(t) * 3 * C + part * C + c]);
        ph.push_back(dqh[static_cast<std::size_t>(t) * 3 * C + part * C + c]);
      }
    expect_half_close<H>(part == 0   ? "T=1024 attention dq"
                         : part == 1 ? "T=1024 attention dk"
                                     : "T=1024 attention dv",
                         ph, pf, 8 * u);
  }
}

// All 2048 rows hold one token: its dwte row is a sum of 2048 rows near 1.
template <class H>
void encoder_accumulates_in_float() {
  const int B = 64, T = 32, C = 16, V = 8;
  const double once = 1.01 * unit_roundoff<H>;
  const IVec inp(static_cast<std::size_t>(B) * T, 3);
  const Vec d = rounded_to<H>(randn(static_cast<std::size_t>(B) * T * C, 351, 0.05, 1.0));
  FVec tef(static_cast<std::size_t>(V) * C, 0.0f), pef(static_cast<std::size_t>(T) * C, 0.0f);
  std::vector<H> teh(tef.size()), peh(pef.size());
  k::encoder_backward(tef.data(), pef.data(), to_float(d).data(), inp.data(), B, T, C);
  k::encoder_backward(teh.data(), peh.data(), to_half<H>(d).data(), inp.data(), B, T, C);
  expect_half_close<H>("2048 rows encoder dwte", teh, tef, once);
  expect_half_close<H>("2048 rows encoder dwpe", peh, pef, once);
}
}  // namespace

TEST(Kernels, Bf16LayerNormAccumulatesInFloat) { layernorm_accumulates_in_float<bf16>(); }
TEST(Kernels, Fp16LayerNormAccumulatesInFloat) { layernorm_accumulates_in_float<f16>(); }
TEST(Kernels, Bf16BiasBackwardAccumulatesInFloat) { bias_backward_accumulates_in_float<bf16>(); }
TEST(Kernels, Fp16BiasBackwardAccumulatesInFloat) { bias_backward_accumulates_in_float<f16>(); }
TEST(Kernels, Bf16CrossEntropyAccumulatesInFloat) { crossentropy_accumulates_in_float<bf16>(); }
TEST(Kernels, Fp16CrossEntropyAccumulatesInFloat) { crossentropy_accumulates_in_float<f16>(); }
TEST(Kernels, Bf16AttentionAccumulatesInFloat) { attention_accumulates_in_float<bf16>(); }
TEST(Kernels, Fp16AttentionAccumulatesInFloat) { attention_accumulates_in_float<f16>(); }
TEST(Kernels, Bf16EncoderBackwardAccumulatesInFloat) { encoder_accumulates_in_float<bf16>(); }
TEST(Kernels, Fp16EncoderBackwardAccumulatesInFloat) { encoder_accumulates_in_float<f16>(); }

// ---------------------------------------------------------------------------------------------
// The fused MLP operations against the unfused ones they replace (Backend::matmul_forward_gelu,
// gelu_bias_backward), bit for bit: the same arithmetic in the same order, one pass fewer. Shapes
// wider than the narrowest column block (k::kColumnQuantum) and not a multiple of it.
namespace {
template <class T>
std::vector<T> cast_vec(const Vec& v) {
  std::vector<T> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = loom::from_acc<T>(static_cast<float>(v[i]));
  return out;
}
template <class T>
void expect_bits_equal(const std::vector<T>& got, const std::vector<T>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(T))) << what;
}

template <class T>
void fused_mlp_equals_unfused() {
  const int N = 37, C = 24, OC = 150;
  const std::vector<T> x = cast_vec<T>(randn(std::size_t(N) * C, 301)),
                       w = cast_vec<T>(randn(std::size_t(OC) * C, 302)), b = cast_vec<T>(randn(OC, 303, 0.5));
  for (bool with_bias : {false, true}) {
    std::vector<T> pre(std::size_t(N) * OC), out(pre.size()), pre_ref(pre.size()), out_ref(pre.size());
    k::matmul_forward_gelu(out.data(), pre.data(), x.data(), w.data(), with_bias ? b.data() : nullptr, N, C, OC);
    k::matmul_forward(pre_ref.data(), x.data(), w.data(), with_bias ? b.data() : nullptr, N, C, OC);
    k::gelu_forward(out_ref.data(), pre_ref.data(), std::int64_t(pre.size()));
    expect_bits_equal(pre, pre_ref, with_bias ? "pre (bias)" : "pre");
    expect_bits_equal(out, out_ref, with_bias ? "gelu out (bias)" : "gelu out");
  }
  const std::vector<T> pre = cast_vec<T>(randn(std::size_t(N) * OC, 304, 2.0)),
                       dout = cast_vec<T>(randn(std::size_t(N) * OC, 305));
  std::vector<T> dpre(pre.size()), dpre_ref(pre.size()), db = cast_vec<T>(randn(OC, 306)), db_ref = db;
  k::gelu_bias_backward(dpre.data(), db.data(), pre.data(), dout.data(), N, OC);
  k::gelu_backward(dpre_ref.data(), pre.data(), dout.data(), std::int64_t(pre.size()));
  k::bias_backward(db_ref.data(), dpre_ref.data(), N, OC);
  expect_bits_equal(dpre, dpre_ref, "dpre");
  expect_bits_equal(db, db_ref, "dbias (+=)");
  std::vector<T> dpre_only(pre.size());
  k::gelu_bias_backward(dpre_only.data(), static_cast<T*>(nullptr), pre.data(), dout.data(), N, OC);
  expect_bits_equal(dpre_only, dpre_ref, "dpre without a bias");
}
}  // namespace

TEST(FusedKernels, MatmulGeluEqualsMatmulThenGelu_f32) { fused_mlp_equals_unfused<float>(); }
TEST(FusedKernels, MatmulGeluEqualsMatmulThenGelu_bf16) { fused_mlp_equals_unfused<loom::bf16>(); }

// A row's maximum (the causal softmax, the cross-entropy's rows) by lane_max: the serial loop's value
// and NaN rule, bit for bit, at every length around the lanes' width, for all-negative rows, a NaN
// first or later, infinities.
TEST(Kernels, RowMaximaAreTheSerialLoops) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  int rows = 0;
  for (int n = 1; n <= 70; ++n)
    for (int pattern = 0; pattern < 6; ++pattern) {
      FVec x = to_float(randn(std::size_t(n), 400 + n * 7 + pattern, 3.0, pattern == 1 ? -20.0 : 0.0));
      const std::size_t at = std::size_t(n * 5 + pattern) % x.size();
      if (pattern == 2) x[0] = nan;
      if (pattern == 3) x[at] = nan;
      if (pattern == 4) x[at] = inf;
      if (pattern == 5) x[at] = -inf;
      float serial = x[0];
      for (int i = 1; i < n; ++i) serial = x[i] > serial ? x[i] : serial;
      const float lanes = k::lane_max<float>(n, [&](int i) { return x[i]; });
      EXPECT_EQ(0, std::memcmp(&serial, &lanes, sizeof serial))
          << "n " << n << " pattern " << pattern << ": serial " << serial << ", lanes " << lanes;
      const double wide = k::lane_max<double>(n, [&](int i) { return static_cast<double>(x[i]); });
      if (!std::isnan(serial)) {
        EXPECT_EQ(static_cast<double>(serial), wide) << "n " << n;
      }
      ++rows;
    }
  EXPECT_EQ(rows, 420);
}

// The parameter gradients summed over rows (LayerNorm's dweight and dbias, dbias, the embedding
// rows) run by column blocks, rows in order: the same bits as one row after the other into the
// gradient, which is what a serial loop gives, whatever the threads.
TEST(FusedKernels, ColumnBlockSumsAreRowOrderSums) {
  const int N = 53, C = 150;  // more than two column blocks, the last partial
  const Vec d = randn(std::size_t(N) * C, 311), x = randn(std::size_t(N) * C, 312, 1.5, 0.3),
            w = randn(C, 313, 0.5, 1.0);
  FVec df = to_float(d), xf = to_float(x), wf = to_float(w), mean(N), rstd(N), out(std::size_t(N) * C);
  FVec bf(C, 0.25f);
  k::layernorm_forward(out.data(), mean.data(), rstd.data(), xf.data(), wf.data(), bf.data(), N, C);
  FVec dinp(std::size_t(N) * C, 0.0f), dw = to_float(randn(C, 314)), db = to_float(randn(C, 315));
  FVec dw_ref = dw, db_ref = db, dbias = db, dbias_ref = db;
  k::layernorm_backward(dinp.data(), dw.data(), db.data(), df.data(), xf.data(), wf.data(), mean.data(), rstd.data(), N,
                        C);
  k::bias_backward(dbias.data(), df.data(), N, C);
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < C; ++c) {
      const std::size_t i = std::size_t(n) * C + c;
      const float xhat = (xf[i] - mean[n]) * rstd[n];
      db_ref[c] += df[i];
      dw_ref[c] += xhat * df[i];
      dbias_ref[c] += df[i];
    }
  expect_bits_equal(dw, dw_ref, "layernorm dweight");
  expect_bits_equal(db, db_ref, "layernorm dbias");
  expect_bits_equal(dbias, dbias_ref, "dbias");
  // embedding rows: tokens repeat, so rows of one token meet in one gradient row
  const int B = 3, T = N / B, V = 7;
  const IVec tok = rand_tokens(std::size_t(B) * T, V, 316);
  FVec dwte(std::size_t(V) * C, 0.5f), dwpe(std::size_t(T) * C, -0.5f), dwte_ref = dwte, dwpe_ref = dwpe;
  k::encoder_backward(dwte.data(), dwpe.data(), df.data(), tok.data(), B, T, C);
  for (int r = 0; r < B * T; ++r)
    for (int c = 0; c < C; ++c) {
      dwpe_ref[std::size_t(r % T) * C + c] += df[std::size_t(r) * C + c];
      dwte_ref[std::size_t(tok[r]) * C + c] += df[std::size_t(r) * C + c];
    }
  expect_bits_equal(dwte, dwte_ref, "dwte");
  expect_bits_equal(dwpe, dwpe_ref, "dwpe");
}

// The sums over rows into parameter gradients give the same bits whatever the width of the column
// blocks for_column_blocks cuts (it follows the thread count): each column adds its rows in row order.
TEST(Kernels, ColumnSumsAreTheSameBitsInAnyBlockWidth) {
  const int N = 70, C = 1000;
  const Vec dout = randn(std::size_t(N) * C, 401), x = randn(std::size_t(N) * C, 402, 2.0), d0 = randn(C, 403);
  std::vector<float> df(dout.begin(), dout.end()), xf(x.begin(), x.end()), mean(N), rstd(N);
  for (int n = 0; n < N; ++n)
    mean[std::size_t(n)] = 0.1f * float(n % 3), rstd[std::size_t(n)] = 1.0f + 0.05f * float(n % 4);
  const auto run = [&](int width) {
    std::vector<float> db(d0.begin(), d0.end()), dw(d0.begin(), d0.end()), lb(d0.begin(), d0.end()),
        gb(d0.begin(), d0.end()), dpre(df.size());
    for (int c0 = 0; c0 < C; c0 += width) {
      const int c1 = std::min(C, c0 + width);
      k::rows::bias_cols<float, float>(db.data(), df.data(), N, C, c0, c1);
      k::rows::layernorm_param_cols<float, float>(dw.data(), lb.data(), df.data(), xf.data(), mean.data(), rstd.data(),
                                                  N, C, c0, c1);
      k::rows::gelu_bias_cols<float, float>(dpre.data(), gb.data(), xf.data(), df.data(), N, C, c0, c1);
    }
    return std::vector<std::vector<float>>{db, dw, lb, gb, dpre};
  };
  const auto narrow = run(k::kColumnQuantum), wide = run(k::kColumns), one = run(C);
  for (std::size_t i = 0; i < narrow.size(); ++i) {
    expect_bits_equal(wide[i], narrow[i], "blocks of kColumns against kColumnQuantum");
    expect_bits_equal(one[i], narrow[i], "one block against kColumnQuantum");
  }
  EXPECT_EQ(k::column_block_width(1024, 1), k::kColumns);
  EXPECT_EQ(k::column_block_width(1024, 2), 512);
  EXPECT_EQ(k::column_block_width(150, 1), 192);
  EXPECT_EQ(k::column_block_width(100, 8), k::kColumnQuantum);
  EXPECT_EQ(k::column_block_width(5000, 1), k::kColumns);
}

// ---------------------------------------------------------------------------------------------
// Llama's block: RMSNorm, rotary positions with grouped-query heads, SwiGLU (finite differences in
// double; the float kernels against their double twins).

namespace {
struct RmsNormProblem {
  Vec inp = randn(static_cast<std::size_t>(kN) * kC, 31, 1.5, 0.4);
  Vec weight = randn(kC, 32, 0.5, 1.0);
  Vec R = randn(static_cast<std::size_t>(kN) * kC, 33);
  Vec out = Vec(static_cast<std::size_t>(kN) * kC), rstd = Vec(kN);
  double loss() {
    k::rmsnorm_forward(out.data(), rstd.data(), inp.data(), weight.data(), kN, kC, 1e-5);
    return dot(out, R);
  }
  void grads(Vec& dinp, Vec& dw) {
    loss();
    dinp.assign(inp.size(), 0.0);
    dw.assign(kC, 0.0);
    k::rmsnorm_backward(dinp.data(), dw.data(), R.data(), inp.data(), weight.data(), rstd.data(), kN, kC);
  }
};

// GQA shapes: 4 query heads of size 6 reading 2 kv heads (group 2), sequences of kT tokens.
constexpr int kQH = 4, kKV = 2, kHS = 6;
struct RopeProblem {
  int NH = kQH, KV = kKV, head0 = 0, kv0 = 0, group = kQH / kKV;
  Vec q = randn(static_cast<std::size_t>(kN) * kQH * kHS, 41);
  Vec kk = randn(static_cast<std::size_t>(kN) * kKV * kHS, 42);
  Vec v = randn(static_cast<std::size_t>(kN) * kKV * kHS, 43);
  Vec R = randn(static_cast<std::size_t>(kN) * 3 * kQH * kHS, 44);
  Vec qkv = Vec(static_cast<std::size_t>(kN) * 3 * kQH * kHS);
  double loss() {
    k::rope_gqa_forward(qkv.data(), q.data(), kk.data(), v.data(), kN, kT, NH, KV, kHS, head0, kv0, group, 50.0);
    return dot(qkv, R);
  }
  void grads(Vec& dq, Vec& dk, Vec& dv) {
    dq.assign(q.size(), 7.0);  // overwritten, not accumulated
    dk.assign(kk.size(), 7.0);
    dv.assign(v.size(), 7.0);
    k::rope_gqa_backward(dq.data(), dk.data(), dv.data(), R.data(), kN, kT, NH, KV, kHS, head0, kv0, group, 50.0);
  }
};
}  // namespace

TEST(Kernels, RmsNormBackwardMatchesFiniteDifferences) {
  RmsNormProblem p;
  Vec dinp, dw;
  p.grads(dinp, dw);
  check_grad("rmsnorm dinp", p.inp, dinp, [&] { return p.loss(); });
  check_grad("rmsnorm dweight", p.weight, dw, [&] { return p.loss(); });
}

TEST(Kernels, RmsNormNormalisesAndItsFloatKernelMatchesDouble) {
  RmsNormProblem p;
  p.loss();
  for (int n = 0; n < kN; ++n) {  // out / weight has mean square 1 / (1 + eps / ms)
    double ms = 0, ms_in = 0;
    for (int c = 0; c < kC; ++c) {
      const double y = p.out[n * kC + c] / p.weight[c], x = p.inp[n * kC + c];
      ms += y * y / kC;
      ms_in += x * x / kC;
    }
    EXPECT_NEAR(ms, ms_in / (ms_in + 1e-5), 1e-12) << "row " << n;
  }
  const FVec in = to_float(p.inp), w = to_float(p.weight);
  FVec out(in.size()), rstd(kN);
  k::rmsnorm_forward(out.data(), rstd.data(), in.data(), w.data(), kN, kC, 1e-5f);
  RmsNormProblem d;
  d.inp = rounded(p.inp);
  d.weight = rounded(p.weight);
  d.loss();
  expect_float_close("rmsnorm out", out, d.out);
}

TEST(Kernels, RopeGqaBackwardMatchesFiniteDifferences) {
  for (int KV : {kKV, 1, kQH}) {  // grouped, multi-query, one kv head per query head
    RopeProblem p;
    p.KV = KV;
    p.group = kQH / KV;
    p.kk = randn(static_cast<std::size_t>(kN) * KV * kHS, 42);
    p.v = randn(static_cast<std::size_t>(kN) * KV * kHS, 43);
    Vec dq, dk, dv;
    p.grads(dq, dk, dv);
    check_grad("rope_gqa dq", p.q, dq, [&] { return p.loss(); });
    check_grad("rope_gqa dk", p.kk, dk, [&] { return p.loss(); });
    check_grad("rope_gqa dv", p.v, dv, [&] { return p.loss(); });
  }
}

// A tp rank's share: query heads 2-3 of 4 (head0 2) reading kv heads of 2 held whole (kv0 0, the
// replicated case): kv head 0 has no reader here, so its gradient is zero; held split (one kv head,
// kv0 1), the same rows as the whole problem's.
TEST(Kernels, RopeGqaPlacesARanksHeads) {
  RopeProblem whole;
  whole.loss();
  Vec dq, dk, dv;
  whole.grads(dq, dk, dv);
  const int hs = kHS, C = kQH * hs;
  RopeProblem rep;  // replicated kv
  rep.NH = 2;
  rep.head0 = 2;
  rep.q = Vec(static_cast<std::size_t>(kN) * 2 * hs);
  for (int n = 0; n < kN; ++n)
    for (int e = 0; e < 2 * hs; ++e) rep.q[n * 2 * hs + e] = whole.q[n * C + 2 * hs + e];
  rep.qkv.assign(static_cast<std::size_t>(kN) * 3 * 2 * hs, 0.0);
  k::rope_gqa_forward(rep.qkv.data(), rep.q.data(), rep.kk.data(), rep.v.data(), kN, kT, 2, kKV, hs, 2, 0, 2, 50.0);
  for (int n = 0; n < kN; ++n)
    for (int part = 0; part < 3; ++part)
      for (int e = 0; e < 2 * hs; ++e)
        EXPECT_EQ(rep.qkv[(n * 3 + part) * 2 * hs + e], whole.qkv[n * 3 * C + part * C + 2 * hs + e]);
  Vec g(static_cast<std::size_t>(kN) * 3 * 2 * hs, 0.0);
  for (int n = 0; n < kN; ++n)
    for (int part = 0; part < 3; ++part)
      for (int e = 0; e < 2 * hs; ++e) g[(n * 3 + part) * 2 * hs + e] = whole.R[n * 3 * C + part * C + 2 * hs + e];
  Vec rq(static_cast<std::size_t>(kN) * 2 * hs), rk(rep.kk.size()), rv(rep.v.size());
  k::rope_gqa_backward(rq.data(), rk.data(), rv.data(), g.data(), kN, kT, 2, kKV, hs, 2, 0, 2, 50.0);
  for (int n = 0; n < kN; ++n)
    for (int e = 0; e < hs; ++e) {
      EXPECT_EQ(rk[n * 2 * hs + e], 0.0);  // kv head 0: read by query heads 0-1, not held here
      EXPECT_EQ(rv[n * 2 * hs + e], 0.0);
      EXPECT_EQ(rk[n * 2 * hs + hs + e], dk[n * 2 * hs + hs + e]);
      EXPECT_EQ(rv[n * 2 * hs + hs + e], dv[n * 2 * hs + hs + e]);
    }
  // Split: this rank holds kv head 1 only (kv0 1).
  Vec k1(static_cast<std::size_t>(kN) * hs), v1(k1.size()), qkv1(rep.qkv.size());
  for (int n = 0; n < kN; ++n)
    for (int e = 0; e < hs; ++e) {
      k1[n * hs + e] = whole.kk[n * 2 * hs + hs + e];
      v1[n * hs + e] = whole.v[n * 2 * hs + hs + e];
    }
  k::rope_gqa_forward(qkv1.data(), rep.q.data(), k1.data(), v1.data(), kN, kT, 2, 1, hs, 2, 1, 2, 50.0);
  EXPECT_EQ(qkv1, rep.qkv);
}

TEST(Kernels, RopeAtPositionZeroIsTheIdentityAndKeepsNorms) {
  RopeProblem p;
  p.loss();
  const int C = kQH * kHS;
  for (int n = 0; n < kN; ++n)
    for (int h = 0; h < kQH; ++h)
      for (int i = 0; i < kHS / 2; ++i) {
        const double a = p.q[n * C + h * kHS + 2 * i], b = p.q[n * C + h * kHS + 2 * i + 1];
        const double x = p.qkv[n * 3 * C + h * kHS + 2 * i], y = p.qkv[n * 3 * C + h * kHS + 2 * i + 1];
        if (n % kT == 0) {
          EXPECT_EQ(x, a);
          EXPECT_EQ(y, b);
        }
        EXPECT_NEAR(x * x + y * y, a * a + b * b, 1e-12 * (1 + a * a + b * b));
      }
}

TEST(Kernels, SwigluBackwardMatchesFiniteDifferences) {
  Vec gate = randn(40, 51, 2.0), up = randn(40, 52), R = randn(40, 53), out(40);
  const auto loss = [&] {
    k::swiglu_forward(out.data(), gate.data(), up.data(), 40);
    return dot(out, R);
  };
  Vec dg(40, 7.0), du(40, 7.0);
  k::swiglu_backward(dg.data(), du.data(), R.data(), gate.data(), up.data(), 40);
  check_grad("swiglu dgate", gate, dg, loss);
  check_grad("swiglu dup", up, du, loss);
  loss();  // the checks above left their last perturbed evaluation in out
  for (int i = 0; i < 40; ++i) EXPECT_NEAR(out[i], gate[i] / (1 + std::exp(-gate[i])) * up[i], 1e-14);
}
