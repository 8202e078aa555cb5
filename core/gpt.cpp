#include "core/gpt.hpp"

#include <cmath>
#include <stdexcept>

#include "core/error.hpp"
#include "core/rng.hpp"

namespace loom {

void GPTConfig::validate() const {
  if (d_model % heads != 0)
    throw InputError("model.d_model = " + std::to_string(d_model) + " is not divisible by model.heads = " +
                     std::to_string(heads) + " (each head needs d_model/heads channels)");
}

GPT::GPT(const GPTConfig& cfg, Backend& backend, int max_rows) : cfg_(cfg), be_(backend), max_rows_(max_rows) {
  cfg_.validate();
  const std::int64_t L = cfg.layers, C = cfg.d_model, T = cfg.seq_len, V = cfg.vocab;
  const double resid_std = 0.02 / std::sqrt(2.0 * L);
  auto add = [&](std::string name, std::vector<std::int64_t> shape, ParamInfo::Init init, double std) {
    ParamInfo p;
    p.name = std::move(name);
    p.numel = 1;
    for (auto s : shape) p.numel *= s;
    p.shape = std::move(shape);
    p.offset = num_params_;
    p.decay = p.shape.size() >= 2;
    p.init = init;
    p.init_std = std;
    num_params_ += p.numel;
    params_.push_back(std::move(p));
  };
  using I = ParamInfo::Init;
  add("wte.weight", {V, C}, I::normal, 0.02);
  add("wpe.weight", {T, C}, I::normal, 0.02);
  for (int l = 0; l < L; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".";
    add(b + "ln1.weight", {C}, I::ones, 0);
    add(b + "ln1.bias", {C}, I::zeros, 0);
    add(b + "attn.qkv.weight", {3 * C, C}, I::normal, 0.02);
    add(b + "attn.qkv.bias", {3 * C}, I::zeros, 0);
    add(b + "attn.proj.weight", {C, C}, I::normal, resid_std);
    add(b + "attn.proj.bias", {C}, I::zeros, 0);
    add(b + "ln2.weight", {C}, I::ones, 0);
    add(b + "ln2.bias", {C}, I::zeros, 0);
    add(b + "mlp.fc.weight", {4 * C, C}, I::normal, 0.02);
    add(b + "mlp.fc.bias", {4 * C}, I::zeros, 0);
    add(b + "mlp.proj.weight", {C, 4 * C}, I::normal, resid_std);
    add(b + "mlp.proj.bias", {C}, I::zeros, 0);
  }
  add("ln_f.weight", {C}, I::ones, 0);
  add("ln_f.bias", {C}, I::zeros, 0);

  params_buf_ = Buffer<float>("GPT::params", num_params_, Mem::params);
  grads_buf_ = Buffer<float>("GPT::grads", num_params_, Mem::grads);

  const std::int64_t N = static_cast<std::int64_t>(max_rows) * T, NH = cfg.heads;
  block_act_floats_ = N * C * 4 + N * 4 + N * 3 * C + static_cast<std::int64_t>(max_rows) * NH * T * T + N * 8 * C;
  const int saved_blocks = cfg.recompute ? 1 : cfg.layers;
  residual_buf_ = Buffer<float>("GPT::residual", (L + 1) * N * C, Mem::activations);
  block_buf_ = Buffer<float>("GPT::block_activations", saved_blocks * block_act_floats_, Mem::activations);
  head_buf_ = Buffer<float>("GPT::head_activations", N * C + 2 * N + 2 * N * V + N, Mem::activations);
  // forward: tmp [N,C]; backward: dres, dres2, dln [N,C] each, dqkv [N,3C], datt [T,T], datty [N,C],
  // dfch, dfch_gelu [N,4C] each
  scratch_buf_ = Buffer<float>("GPT::scratch", N * C * 5 + N * 3 * C + T * T + N * 8 * C, Mem::activations);
  tokens_buf_ = Buffer<std::int32_t>("GPT::tokens", 2 * N, Mem::workspace);
}

const ParamInfo& GPT::param(const std::string& name) const {
  for (const auto& p : params_)
    if (p.name == name) return p;
  throw std::out_of_range("GPT: no parameter named '" + name + "'");
}

void GPT::init_weights(std::uint64_t seed) {
  float* base = params_buf_.data();
  for (const auto& p : params_) {
    float* w = base + p.offset;
    const std::uint64_t stream = rng::hash_name(p.name);
    switch (p.init) {
      case ParamInfo::Init::normal:
        for (std::int64_t i = 0; i < p.numel; ++i)
          w[i] = static_cast<float>(p.init_std * rng::normal(seed, stream, static_cast<std::uint64_t>(i)));
        break;
      case ParamInfo::Init::ones: be_.fill(w, 1.0f, p.numel); break;
      case ParamInfo::Init::zeros: be_.fill(w, 0.0f, p.numel); break;
    }
  }
}

GPT::BlockParams GPT::block_params(float* base, int layer) const {
  // The 12 tensors of a block are consecutive in params_, after wte and wpe.
  const ParamInfo* p = &params_[2 + 12 * static_cast<std::size_t>(layer)];
  float* q[12];
  for (int i = 0; i < 12; ++i) q[i] = base + p[i].offset;
  return {q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7], q[8], q[9], q[10], q[11]};
}

GPT::BlockActs GPT::block_acts(int layer) const {
  const std::int64_t N = static_cast<std::int64_t>(max_rows_) * cfg_.seq_len, C = cfg_.d_model;
  const std::int64_t T = cfg_.seq_len, NH = cfg_.heads;
  float* p = block_buf_.data() + (cfg_.recompute ? 0 : layer) * block_act_floats_;
  BlockActs a;
  a.ln1 = p;            p += N * C;
  a.ln1_mean = p;       p += N;
  a.ln1_rstd = p;       p += N;
  a.qkv = p;            p += N * 3 * C;
  a.att = p;            p += static_cast<std::int64_t>(max_rows_) * NH * T * T;
  a.atty = p;           p += N * C;
  a.xmid = p;           p += N * C;
  a.ln2 = p;            p += N * C;
  a.ln2_mean = p;       p += N;
  a.ln2_rstd = p;       p += N;
  a.fch = p;            p += N * 4 * C;
  a.fch_gelu = p;
  return a;
}

float* GPT::residual(int layer) const {
  return residual_buf_.data() + static_cast<std::int64_t>(layer) * max_rows_ * cfg_.seq_len * cfg_.d_model;
}

void GPT::block_forward(int l, int B) {
  const int T = cfg_.seq_len, C = cfg_.d_model, NH = cfg_.heads, N = B * T;
  const BlockParams w = block_params(params_buf_.data(), l);
  const BlockActs a = block_acts(l);
  float* x = residual(l);        // [N,C] block input
  float* xout = residual(l + 1); // [N,C] block output
  float* tmp = scratch_buf_.data();  // [N,C]
  be_.layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, x, w.ln1w, w.ln1b, N, C);
  be_.matmul_forward(a.qkv, a.ln1, w.qkvw, w.qkvb, N, C, 3 * C);
  be_.attention_forward(a.atty, a.att, a.qkv, B, T, C, NH);
  be_.matmul_forward(tmp, a.atty, w.projw, w.projb, N, C, C);
  be_.residual_forward(a.xmid, x, tmp, static_cast<std::int64_t>(N) * C);
  be_.layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.xmid, w.ln2w, w.ln2b, N, C);
  be_.matmul_forward(a.fch, a.ln2, w.fcw, w.fcb, N, C, 4 * C);
  be_.gelu_forward(a.fch_gelu, a.fch, static_cast<std::int64_t>(N) * 4 * C);
  be_.matmul_forward(tmp, a.fch_gelu, w.fcprojw, w.fcprojb, N, 4 * C, C);
  be_.residual_forward(xout, a.xmid, tmp, static_cast<std::int64_t>(N) * C);
}

// dres [N,C]: gradient of the block's output on entry, of its input on return. dother: [N,C] scratch.
void GPT::block_backward(int l, int B, float* dres, float* dother) {
  const int T = cfg_.seq_len, C = cfg_.d_model, NH = cfg_.heads, N = B * T;
  const std::int64_t NC = static_cast<std::int64_t>(N) * C;
  if (cfg_.recompute) block_forward(l, B);  // rebuild this block's activations from its saved input
  const BlockParams w = block_params(params_buf_.data(), l);
  const BlockParams dw = block_params(grads_buf_.data(), l);
  const BlockActs a = block_acts(l);
  const std::int64_t Nmax = static_cast<std::int64_t>(max_rows_) * T;
  float* s = scratch_buf_.data() + Nmax * C * 3;  // past tmp, dres, dres2
  float* dln = s;                 s += Nmax * C;      // [N,C]
  float* dqkv = s;                s += Nmax * 3 * C;  // [N,3C]
  float* datt = s;                s += static_cast<std::int64_t>(T) * T;  // [T,T]
  float* datty = s;               s += Nmax * C;      // [N,C]
  float* dfch = s;                s += Nmax * 4 * C;  // [N,4C]
  float* dfch_gelu = s;                               // [N,4C]
  float* dxmid = dother;

  // MLP, in reverse: x_out = xmid + fcproj(gelu(fc(ln2(xmid))))
  be_.matmul_backward(dfch_gelu, dw.fcprojw, dw.fcprojb, dres, a.fch_gelu, w.fcprojw, N, 4 * C, C);
  be_.gelu_backward(dfch, a.fch, dfch_gelu, static_cast<std::int64_t>(N) * 4 * C);
  be_.matmul_backward(dln, dw.fcw, dw.fcb, dfch, a.ln2, w.fcw, N, C, 4 * C);
  be_.copy(dxmid, dres, NC);  // the residual branch
  be_.layernorm_backward(dxmid, dw.ln2w, dw.ln2b, dln, a.xmid, w.ln2w, a.ln2_mean, a.ln2_rstd, N, C);
  // attention, in reverse: xmid = x + proj(attention(qkv(ln1(x))))
  be_.matmul_backward(datty, dw.projw, dw.projb, dxmid, a.atty, w.projw, N, C, C);
  be_.attention_backward(dqkv, datt, datty, a.qkv, a.att, B, T, C, NH);
  be_.matmul_backward(dln, dw.qkvw, dw.qkvb, dqkv, a.ln1, w.qkvw, N, C, 3 * C);
  be_.copy(dres, dxmid, NC);  // the residual branch
  be_.layernorm_backward(dres, dw.ln1w, dw.ln1b, dln, residual(l), w.ln1w, a.ln1_mean, a.ln1_rstd, N, C);
}

double GPT::forward(const std::int32_t* inputs, const std::int32_t* targets, int B) {
  if (B < 1 || B > max_rows_)
    throw std::logic_error("GPT::forward: " + std::to_string(B) + " rows, allocated for " + std::to_string(max_rows_));
  rows_ = B;
  const int T = cfg_.seq_len, C = cfg_.d_model, V = cfg_.vocab, L = cfg_.layers, N = B * T;
  std::int32_t* inp = tokens_buf_.data();
  std::int32_t* tgt = inp + static_cast<std::int64_t>(max_rows_) * T;
  for (int i = 0; i < N; ++i) {
    inp[i] = inputs[i];
    tgt[i] = targets[i];
  }
  const float* wte = params_buf_.data() + params_[0].offset;
  const float* wpe = params_buf_.data() + params_[1].offset;
  const float* lnfw = params_buf_.data() + params_[params_.size() - 2].offset;
  const float* lnfb = params_buf_.data() + params_[params_.size() - 1].offset;

  be_.encoder_forward(residual(0), inp, wte, wpe, B, T, C);
  for (int l = 0; l < L; ++l) block_forward(l, B);

  const std::int64_t Nmax = static_cast<std::int64_t>(max_rows_) * T;
  float* lnf = head_buf_.data();                 // [N,C]
  float* lnf_mean = lnf + Nmax * C;              // [N]
  float* lnf_rstd = lnf_mean + Nmax;             // [N]
  float* logits = lnf_rstd + Nmax;               // [N,V]
  float* probs = logits + Nmax * V;              // [N,V]
  float* losses = probs + Nmax * V;              // [N]
  be_.layernorm_forward(lnf, lnf_mean, lnf_rstd, residual(L), lnfw, lnfb, N, C);
  be_.matmul_forward(logits, lnf, wte, nullptr, N, C, V);  // tied head
  be_.crossentropy_forward(losses, probs, logits, tgt, N, V);
  return be_.sum(losses, N) / N;
}

void GPT::backward(float dloss) {
  const int B = rows_, T = cfg_.seq_len, C = cfg_.d_model, V = cfg_.vocab, L = cfg_.layers, N = B * T;
  if (B == 0) throw std::logic_error("GPT::backward without a forward");
  const std::int64_t Nmax = static_cast<std::int64_t>(max_rows_) * T;
  const std::int32_t* inp = tokens_buf_.data();
  const std::int32_t* tgt = inp + Nmax;
  const float* wte = params_buf_.data() + params_[0].offset;
  const float* lnfw = params_buf_.data() + params_[params_.size() - 2].offset;
  float* dwte = grads_buf_.data() + params_[0].offset;
  float* dwpe = grads_buf_.data() + params_[1].offset;
  float* dlnfw = grads_buf_.data() + params_[params_.size() - 2].offset;
  float* dlnfb = grads_buf_.data() + params_[params_.size() - 1].offset;
  float* lnf = head_buf_.data();
  float* lnf_mean = lnf + Nmax * C;
  float* lnf_rstd = lnf_mean + Nmax;
  float* probs = lnf_rstd + Nmax + Nmax * V;
  float* dres = scratch_buf_.data() + Nmax * C;       // [N,C]
  float* dother = dres + Nmax * C;                     // [N,C]
  float* dlnf = dother + Nmax * C;                     // [N,C] (the blocks' dln scratch, free here)

  float* dlogits = probs;  // in place
  be_.crossentropy_backward(dlogits, probs, tgt, dloss / static_cast<float>(N), N, V);
  be_.matmul_backward(dlnf, dwte, nullptr, dlogits, lnf, wte, N, C, V);
  be_.fill(dres, 0.0f, static_cast<std::int64_t>(N) * C);
  be_.layernorm_backward(dres, dlnfw, dlnfb, dlnf, residual(L), lnfw, lnf_mean, lnf_rstd, N, C);
  const int n_params = static_cast<int>(params_.size());
  if (grad_ready_) grad_ready_(n_params - 2, n_params);  // ln_f
  for (int l = L - 1; l >= 0; --l) {
    block_backward(l, B, dres, dother);
    if (grad_ready_) grad_ready_(2 + 12 * l, 2 + 12 * (l + 1));
  }
  be_.encoder_backward(dwte, dwpe, dres, inp, B, T, C);
  if (grad_ready_) grad_ready_(0, 2);  // wte (tied head included), wpe
  rows_ = 0;
}

void GPT::zero_grad() { be_.fill(grads_buf_.data(), 0.0f, num_params_); }

double GPT::flops_per_token() const {
  const double L = cfg_.layers, C = cfg_.d_model, T = cfg_.seq_len, V = cfg_.vocab;
  const double matmul_weights = L * 12.0 * C * C + V * C;
  return 6.0 * matmul_weights + 12.0 * L * T * C;
}

}  // namespace loom
