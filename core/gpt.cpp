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

GPT::GPT(const GPTConfig& cfg, Backend& backend, int max_rows, Partition* partition)
    : cfg_(cfg), be_(backend), part_(partition ? partition : &default_partition_), max_rows_(max_rows) {
  cfg_.validate();
  tp_ = part_->size();
  tp_rank_ = part_->rank();
  sp_ = part_->sequence_parallel();
  const std::int64_t L = cfg.layers, C = cfg.d_model, T = cfg.seq_len, V = cfg.vocab, tp = tp_;
  const std::int64_t Cl = C / tp, Fl = 4 * C / tp, Vl = V / tp;  // this rank's channels, MLP width, vocabulary
  vocab_local_ = static_cast<int>(Vl);
  vocab_begin_ = static_cast<int>(tp_rank_ * Vl);
  const double resid_std = 0.02 / std::sqrt(2.0 * L);
  auto add = [&](std::string name, std::vector<std::int64_t> shape, std::vector<std::int64_t> local, TpSplit split,
                 ParamInfo::Init init, double std) {
    ParamInfo p;
    p.name = std::move(name);
    p.numel = 1;
    for (auto s : local) p.numel *= s;
    p.decay = shape.size() >= 2;
    p.shape = std::move(shape);
    p.local_shape = std::move(local);
    p.split = tp > 1 ? split : TpSplit::none;
    p.sp_partial = sp_ && split == TpSplit::none && p.name != "wpe.weight";
    p.offset = num_params_;
    p.init = init;
    p.init_std = std;
    num_params_ += p.numel;
    params_.push_back(std::move(p));
  };
  using I = ParamInfo::Init;
  add("wte.weight", {V, C}, {Vl, C}, TpSplit::rows, I::normal, 0.02);
  add("wpe.weight", {T, C}, {T, C}, TpSplit::none, I::normal, 0.02);
  for (int l = 0; l < L; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".";
    add(b + "ln1.weight", {C}, {C}, TpSplit::none, I::ones, 0);
    add(b + "ln1.bias", {C}, {C}, TpSplit::none, I::zeros, 0);
    add(b + "attn.qkv.weight", {3 * C, C}, {3 * Cl, C}, TpSplit::qkv_rows, I::normal, 0.02);
    add(b + "attn.qkv.bias", {3 * C}, {3 * Cl}, TpSplit::qkv_rows, I::zeros, 0);
    add(b + "attn.proj.weight", {C, C}, {C, Cl}, TpSplit::cols, I::normal, resid_std);
    add(b + "attn.proj.bias", {C}, {C}, TpSplit::none, I::zeros, 0);
    add(b + "ln2.weight", {C}, {C}, TpSplit::none, I::ones, 0);
    add(b + "ln2.bias", {C}, {C}, TpSplit::none, I::zeros, 0);
    add(b + "mlp.fc.weight", {4 * C, C}, {Fl, C}, TpSplit::rows, I::normal, 0.02);
    add(b + "mlp.fc.bias", {4 * C}, {Fl}, TpSplit::rows, I::zeros, 0);
    add(b + "mlp.proj.weight", {C, 4 * C}, {C, Fl}, TpSplit::cols, I::normal, resid_std);
    add(b + "mlp.proj.bias", {C}, {C}, TpSplit::none, I::zeros, 0);
  }
  add("ln_f.weight", {C}, {C}, TpSplit::none, I::ones, 0);
  add("ln_f.bias", {C}, {C}, TpSplit::none, I::zeros, 0);

  params_buf_ = Buffer<float>("GPT::params", num_params_, Mem::params);
  grads_buf_ = Buffer<float>("GPT::grads", num_params_, Mem::grads);

  // Activations. Rows: N of a micro-batch, Nl on this rank (N/tp with sequence parallelism).
  const std::int64_t N = static_cast<std::int64_t>(max_rows) * T, Nl = sp_ ? N / tp : N, NHl = cfg.heads / tp;
  block_act_floats_ = Nl * C * 3 + Nl * 4 + N * 3 * Cl + static_cast<std::int64_t>(max_rows) * NHl * T * T + N * Cl +
                      N * 2 * Fl;
  const int saved_blocks = cfg.recompute ? 1 : cfg.layers;
  residual_buf_ = Buffer<float>("GPT::residual", (L + 1) * Nl * C, Mem::activations);
  block_buf_ = Buffer<float>("GPT::block_activations", saved_blocks * block_act_floats_, Mem::activations);
  head_buf_ = Buffer<float>("GPT::head_activations", Nl * C + 2 * Nl + 2 * N * Vl + N, Mem::activations);
  // forward: full, partial [N,C], local [Nl,C]; backward: dres, dother, dlocal [Nl,C], dfull, dpartial
  // [N,C], dqkv [N,3Cl], datt [T,T], datty [N,Cl], dfch, dfch_gelu [N,Fl]
  scratch_buf_ = Buffer<float>("GPT::scratch", N * C * 4 + Nl * C * 4 + N * 3 * Cl + T * T + N * Cl + N * 2 * Fl,
                               Mem::activations);
  tokens_buf_ = Buffer<std::int32_t>("GPT::tokens", 2 * N, Mem::workspace);
}

std::int64_t GPT::global_index(const ParamInfo& p, std::int64_t i) const {
  if (p.split == TpSplit::none) return i;
  const std::int64_t rows_l = p.local_shape[0], cols_l = p.local_shape.size() > 1 ? p.local_shape[1] : 1;
  const std::int64_t r = i / cols_l, c = i % cols_l;
  switch (p.split) {
    case TpSplit::rows: return (tp_rank_ * rows_l + r) * cols_l + c;
    case TpSplit::qkv_rows: {
      const std::int64_t Cl = rows_l / 3, part = r / Cl, within = r % Cl;
      return (part * (Cl * tp_) + tp_rank_ * Cl + within) * cols_l + c;
    }
    case TpSplit::cols: return r * (cols_l * tp_) + tp_rank_ * cols_l + c;
    case TpSplit::none: break;
  }
  return i;
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
        // Each rank draws exactly its own elements, by their index in the full tensor.
        for (std::int64_t i = 0; i < p.numel; ++i)
          w[i] = static_cast<float>(p.init_std * rng::normal(seed, stream, static_cast<std::uint64_t>(global_index(p, i))));
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
  const std::int64_t N = static_cast<std::int64_t>(max_rows_) * cfg_.seq_len, Nl = sp_ ? N / tp_ : N;
  const std::int64_t C = cfg_.d_model, T = cfg_.seq_len, NHl = cfg_.heads / tp_, Cl = C / tp_, Fl = 4 * C / tp_;
  float* p = block_buf_.data() + (cfg_.recompute ? 0 : layer) * block_act_floats_;
  BlockActs a;
  a.ln1 = p;            p += Nl * C;
  a.ln1_mean = p;       p += Nl;
  a.ln1_rstd = p;       p += Nl;
  a.qkv = p;            p += N * 3 * Cl;
  a.att = p;            p += static_cast<std::int64_t>(max_rows_) * NHl * T * T;
  a.atty = p;           p += N * Cl;
  a.xmid = p;           p += Nl * C;
  a.ln2 = p;            p += Nl * C;
  a.ln2_mean = p;       p += Nl;
  a.ln2_rstd = p;       p += Nl;
  a.fch = p;            p += N * Fl;
  a.fch_gelu = p;
  return a;
}

float* GPT::residual(int layer) const {
  const std::int64_t N = static_cast<std::int64_t>(max_rows_) * cfg_.seq_len, Nl = sp_ ? N / tp_ : N;
  return residual_buf_.data() + layer * Nl * cfg_.d_model;
}

GPT::Scratch GPT::scratch() const {
  const std::int64_t N = static_cast<std::int64_t>(max_rows_) * cfg_.seq_len, Nl = sp_ ? N / tp_ : N;
  const std::int64_t C = cfg_.d_model, T = cfg_.seq_len, Cl = C / tp_, Fl = 4 * C / tp_;
  float* p = scratch_buf_.data();
  Scratch s;
  s.full = p;       p += N * C;
  s.partial = p;    p += N * C;
  s.local = p;      p += Nl * C;
  s.dres = p;       p += Nl * C;
  s.dother = p;     p += Nl * C;
  s.dlocal = p;     p += Nl * C;
  s.dfull = p;      p += N * C;
  s.dpartial = p;   p += N * C;
  s.dqkv = p;       p += N * 3 * Cl;
  s.datt = p;       p += T * T;
  s.datty = p;      p += N * Cl;
  s.dfch = p;       p += N * Fl;
  s.dfch_gelu = p;
  return s;
}

void GPT::block_forward(int l, int B) {
  const int T = cfg_.seq_len, C = cfg_.d_model, N = B * T, Nl = sp_ ? N / tp_ : N;
  const int Cl = C / tp_, Fl = 4 * C / tp_, NHl = cfg_.heads / tp_;
  const BlockParams w = block_params(params_buf_.data(), l);
  const BlockActs a = block_acts(l);
  const Scratch s = scratch();
  float* x = residual(l);         // [Nl,C] block input
  float* xout = residual(l + 1);  // [Nl,C] block output
  // attention: column-parallel qkv (this rank's heads), row-parallel output projection
  be_.layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, x, w.ln1w, w.ln1b, Nl, C);
  const float* ln1 = part_->to_full(a.ln1, s.full, N, C);                     // [N,C]
  be_.matmul_forward(a.qkv, ln1, w.qkvw, w.qkvb, N, C, 3 * Cl);               // [N,3Cl]
  be_.attention_forward(a.atty, a.att, a.qkv, B, T, Cl, NHl);                 // [N,Cl]
  be_.matmul_forward(s.partial, a.atty, w.projw, nullptr, N, Cl, C);          // [N,C] partial sum
  float* y = part_->reduce_partial(s.partial, s.local, N, C);                 // [Nl,C]
  be_.bias_add(y, w.projb, Nl, C);
  be_.residual_forward(a.xmid, x, y, static_cast<std::int64_t>(Nl) * C);
  // MLP: column-parallel fc (this rank's share of 4C), row-parallel projection
  be_.layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.xmid, w.ln2w, w.ln2b, Nl, C);
  const float* ln2 = part_->to_full(a.ln2, s.full, N, C);                     // [N,C]
  be_.matmul_forward(a.fch, ln2, w.fcw, w.fcb, N, C, Fl);                     // [N,Fl]
  be_.gelu_forward(a.fch_gelu, a.fch, static_cast<std::int64_t>(N) * Fl);
  be_.matmul_forward(s.partial, a.fch_gelu, w.fcprojw, nullptr, N, Fl, C);    // [N,C] partial sum
  y = part_->reduce_partial(s.partial, s.local, N, C);                        // [Nl,C]
  be_.bias_add(y, w.fcprojb, Nl, C);
  be_.residual_forward(xout, a.xmid, y, static_cast<std::int64_t>(Nl) * C);
}

// s.dres [Nl,C]: gradient of the block's output on entry, of its input on return.
void GPT::block_backward(int l, int B) {
  const int T = cfg_.seq_len, C = cfg_.d_model, N = B * T, Nl = sp_ ? N / tp_ : N;
  const int Cl = C / tp_, Fl = 4 * C / tp_, NHl = cfg_.heads / tp_;
  const std::int64_t NlC = static_cast<std::int64_t>(Nl) * C;
  if (cfg_.recompute) block_forward(l, B);  // rebuild this block's activations from its saved input
  const BlockParams w = block_params(params_buf_.data(), l);
  const BlockParams dw = block_params(grads_buf_.data(), l);
  const BlockActs a = block_acts(l);
  const Scratch s = scratch();
  float* dres = s.dres;
  float* dxmid = s.dother;

  // MLP, in reverse: x_out = xmid + fcproj(gelu(fc(ln2(xmid))))
  const float* dy = part_->grad_to_full(dres, s.dfull, N, C);                 // [N,C]
  be_.matmul_backward(s.dfch_gelu, dw.fcprojw, nullptr, dy, a.fch_gelu, w.fcprojw, N, Fl, C);
  be_.bias_backward(dw.fcprojb, dres, Nl, C);
  be_.gelu_backward(s.dfch, a.fch, s.dfch_gelu, static_cast<std::int64_t>(N) * Fl);
  const float* ln2 = part_->to_full(a.ln2, s.full, N, C);
  be_.matmul_backward(s.dpartial, dw.fcw, dw.fcb, s.dfch, ln2, w.fcw, N, C, Fl);
  const float* dln2 = part_->reduce_partial_grad(s.dpartial, s.dlocal, N, C);  // [Nl,C]
  be_.copy(dxmid, dres, NlC);  // the residual branch
  be_.layernorm_backward(dxmid, dw.ln2w, dw.ln2b, dln2, a.xmid, w.ln2w, a.ln2_mean, a.ln2_rstd, Nl, C);
  // attention, in reverse: xmid = x + proj(attention(qkv(ln1(x))))
  dy = part_->grad_to_full(dxmid, s.dfull, N, C);
  be_.matmul_backward(s.datty, dw.projw, nullptr, dy, a.atty, w.projw, N, Cl, C);
  be_.bias_backward(dw.projb, dxmid, Nl, C);
  be_.attention_backward(s.dqkv, s.datt, s.datty, a.qkv, a.att, B, T, Cl, NHl);
  const float* ln1 = part_->to_full(a.ln1, s.full, N, C);
  be_.matmul_backward(s.dpartial, dw.qkvw, dw.qkvb, s.dqkv, ln1, w.qkvw, N, C, 3 * Cl);
  const float* dln1 = part_->reduce_partial_grad(s.dpartial, s.dlocal, N, C);
  be_.copy(dres, dxmid, NlC);  // the residual branch
  be_.layernorm_backward(dres, dw.ln1w, dw.ln1b, dln1, residual(l), w.ln1w, a.ln1_mean, a.ln1_rstd, Nl, C);
}

double GPT::forward(const std::int32_t* inputs, const std::int32_t* targets, int B) {
  if (B < 1 || B > max_rows_)
    throw std::logic_error("GPT::forward: " + std::to_string(B) + " rows, allocated for " + std::to_string(max_rows_));
  rows_ = B;
  const int T = cfg_.seq_len, C = cfg_.d_model, L = cfg_.layers, N = B * T, Nl = sp_ ? N / tp_ : N;
  std::int32_t* inp = tokens_buf_.data();
  std::int32_t* tgt = inp + static_cast<std::int64_t>(max_rows_) * T;
  for (int i = 0; i < N; ++i) {
    inp[i] = inputs[i];
    tgt[i] = targets[i];
  }
  const float* wte = params_buf_.data() + params_[0].offset;  // [Vl,C] this rank's vocabulary rows
  const float* wpe = params_buf_.data() + params_[1].offset;
  const float* lnfw = params_buf_.data() + params_[params_.size() - 2].offset;
  const float* lnfb = params_buf_.data() + params_[params_.size() - 1].offset;
  const Scratch s = scratch();

  // Embedding: each rank looks up its vocabulary rows (zeros elsewhere); rank 0 adds positions.
  be_.encoder_forward(s.partial, inp, wte, wpe, B, T, C, vocab_begin_, vocab_begin_ + vocab_local_, tp_rank_ == 0);
  be_.copy(residual(0), part_->reduce_partial(s.partial, s.local, N, C), static_cast<std::int64_t>(Nl) * C);
  for (int l = 0; l < L; ++l) block_forward(l, B);

  const Head h = head();
  be_.layernorm_forward(h.lnf, h.lnf_mean, h.lnf_rstd, residual(L), lnfw, lnfb, Nl, C);
  const float* lnf = part_->to_full(h.lnf, s.full, N, C);                       // [N,C]
  be_.matmul_forward(h.logits, lnf, wte, nullptr, N, C, vocab_local_);          // tied head: [N,Vl]
  part_->crossentropy_forward(be_, h.losses, h.probs, h.logits, tgt, N, vocab_local_, vocab_begin_);
  return be_.sum(h.losses, N) / N;
}

void GPT::backward(float dloss) {
  const int B = rows_, T = cfg_.seq_len, C = cfg_.d_model, L = cfg_.layers, N = B * T, Nl = sp_ ? N / tp_ : N;
  if (B == 0) throw std::logic_error("GPT::backward without a forward");
  const std::int32_t* inp = tokens_buf_.data();
  const std::int32_t* tgt = inp + static_cast<std::int64_t>(max_rows_) * T;
  const float* wte = params_buf_.data() + params_[0].offset;
  const float* lnfw = params_buf_.data() + params_[params_.size() - 2].offset;
  float* dwte = grads_buf_.data() + params_[0].offset;
  float* dwpe = grads_buf_.data() + params_[1].offset;
  float* dlnfw = grads_buf_.data() + params_[params_.size() - 2].offset;
  float* dlnfb = grads_buf_.data() + params_[params_.size() - 1].offset;
  const Scratch s = scratch();
  const Head h = head();

  float* dlogits = h.probs;  // in place
  part_->crossentropy_backward(be_, dlogits, h.probs, tgt, dloss / static_cast<float>(N), N, vocab_local_, vocab_begin_);
  const float* lnf = part_->to_full(h.lnf, s.full, N, C);
  be_.matmul_backward(s.dpartial, dwte, nullptr, dlogits, lnf, wte, N, C, vocab_local_);
  const float* dlnf = part_->reduce_partial_grad(s.dpartial, s.dlocal, N, C);  // [Nl,C]
  be_.fill(s.dres, 0.0f, static_cast<std::int64_t>(Nl) * C);
  be_.layernorm_backward(s.dres, dlnfw, dlnfb, dlnf, residual(L), lnfw, h.lnf_mean, h.lnf_rstd, Nl, C);
  const int n_params = static_cast<int>(params_.size());
  if (grad_ready_) grad_ready_(n_params - 2, n_params);  // ln_f
  for (int l = L - 1; l >= 0; --l) {
    block_backward(l, B);
    if (grad_ready_) grad_ready_(2 + 12 * l, 2 + 12 * (l + 1));
  }
  const float* demb = part_->grad_to_full(s.dres, s.dfull, N, C);  // [N,C]
  be_.encoder_backward(dwte, dwpe, demb, inp, B, T, C, vocab_begin_, vocab_begin_ + vocab_local_);
  if (grad_ready_) grad_ready_(0, 2);  // wte (tied head included), wpe
  rows_ = 0;
}

GPT::Head GPT::head() const {
  const std::int64_t N = static_cast<std::int64_t>(max_rows_) * cfg_.seq_len, Nl = sp_ ? N / tp_ : N;
  Head h;
  h.lnf = head_buf_.data();                   // [Nl,C]
  h.lnf_mean = h.lnf + Nl * cfg_.d_model;     // [Nl]
  h.lnf_rstd = h.lnf_mean + Nl;               // [Nl]
  h.logits = h.lnf_rstd + Nl;                 // [N,Vl]
  h.probs = h.logits + N * vocab_local_;      // [N,Vl]
  h.losses = h.probs + N * vocab_local_;      // [N]
  return h;
}

void GPT::zero_grad() { be_.fill(grads_buf_.data(), 0.0f, num_params_); }

double GPT::flops_per_token() const {
  const double L = cfg_.layers, C = cfg_.d_model, T = cfg_.seq_len, V = cfg_.vocab;
  const double matmul_weights = L * 12.0 * C * C + V * C;
  return 6.0 * matmul_weights + 12.0 * L * T * C;
}

}  // namespace loom
