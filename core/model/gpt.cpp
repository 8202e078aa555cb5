#include "core/model/gpt.hpp"

#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "core/base/error.hpp"
#include "core/backend/kernel_math.hpp"
#include "core/base/rng.hpp"

#include <algorithm>
#include <vector>

namespace loom {
namespace {
// A block's tensors as GPT::BlockParams lists them, by their names after "blocks.<l>.".
constexpr const char* kBlockTensors[12] = {"ln1.weight",       "ln1.bias",       "attn.qkv.weight", "attn.qkv.bias",
                                           "attn.proj.weight", "attn.proj.bias", "ln2.weight",      "ln2.bias",
                                           "mlp.fc.weight",    "mlp.fc.bias",    "mlp.proj.weight", "mlp.proj.bias"};
// Llama's, as GPT::LlamaParams lists them.
constexpr const char* kLlamaTensors[9] = {"ln1.weight",      "attn.q.weight",    "attn.k.weight",
                                          "attn.v.weight",   "attn.proj.weight", "ln2.weight",
                                          "mlp.gate.weight", "mlp.up.weight",    "mlp.down.weight"};
// A block with experts: the router at 12, expert e's four tensors from 13 + 4e (core/model/moe.cpp).
constexpr const char* kExpertTensors[4] = {"fc.weight", "fc.bias", "proj.weight", "proj.bias"};
std::size_t block_tensor_index(const std::string& name, bool llama) {
  const std::size_t n = llama ? 9 : 12;
  for (std::size_t i = 0; i < n; ++i)
    if (name == (llama ? kLlamaTensors[i] : kBlockTensors[i])) return i;
  if (name == "mlp.router.weight") return 12;
  const std::string experts = "mlp.experts.";
  if (name.compare(0, experts.size(), experts) == 0) {
    const std::size_t dot = name.find('.', experts.size());
    const std::size_t e = std::stoul(name.substr(experts.size(), dot - experts.size()));
    for (std::size_t j = 0; j < 4; ++j)
      if (name.compare(dot + 1, std::string::npos, kExpertTensors[j]) == 0) return 13 + 4 * e + j;
  }
  throw std::logic_error("GPT: no block tensor named " + name);
}
}  // namespace

void GPTConfig::validate() const {
  if (d_model % heads != 0)
    throw InputError("model.d_model = " + std::to_string(d_model) + " is not divisible by model.heads = " +
                     std::to_string(heads) + " (each head needs d_model/heads channels)");
  const auto n = [](double v) {
    std::ostringstream o;
    o << v;
    return o.str();
  };
  if (!llama()) {  // GPT-2's block has none of Llama's choices: a key set otherwise is a mistake
    if (kv_heads != 0 && kv_heads != heads)
      throw InputError("model.kv_heads = " + std::to_string(kv_heads) +
                       " needs model.arch = llama (GPT-2's heads each have their own k and v: leave it 0)");
    if (ffn_hidden != 0 && ffn_hidden != 4 * d_model)
      throw InputError("model.ffn_hidden = " + std::to_string(ffn_hidden) +
                       " needs model.arch = llama (GPT-2's MLP is 4 x model.d_model = " + std::to_string(4 * d_model) +
                       " wide: leave it 0)");
    if (tie_embeddings == 0)
      throw InputError("model.tie_embeddings = false needs model.arch = llama (GPT-2's head is its token table)");
    if (norm_eps != 1e-5f)
      throw InputError("model.norm_eps = " + n(norm_eps) +
                       " needs model.arch = llama (GPT-2's LayerNorm keeps eps 1e-5: leave it 1e-5)");
  } else {
    if (heads % kv() != 0)
      throw InputError("model.kv_heads = " + std::to_string(kv()) + " does not divide model.heads = " +
                       std::to_string(heads) + " (each kv head serves heads / kv_heads query heads; 1 is multi-query)");
    if (head_size() % 2 != 0)
      throw InputError("model.d_model / model.heads = " + std::to_string(head_size()) +
                       " is odd: rotary embeddings (model.arch = llama) turn pairs of a head's channels");
    if (!(norm_eps > 0.0f)) throw InputError("model.norm_eps = " + n(norm_eps) + ": RMSNorm's eps must be above 0");
    if (!(rope_theta > 1.0f))
      throw InputError("model.rope_theta = " + n(rope_theta) + ": the rotary base must be above 1 (Llama: 10000)");
  }
  if (experts > 0) {
    const std::string E = std::to_string(experts);
    if (llama())
      throw InputError("model.experts = " + E +
                       " with model.arch = llama: experts replace GPT-2's GELU MLP only (use model.arch = gpt2)");
    if (experts_per_token < 1 || experts_per_token > experts)
      throw InputError("model.experts_per_token = " + std::to_string(experts_per_token) +
                       " is not between 1 and model.experts = " + E + " (a token goes to that many distinct experts)");
    if (moe_ffn_hidden < 0)
      throw InputError("model.moe_ffn_hidden = " + std::to_string(moe_ffn_hidden) +
                       " is negative (0: the dense MLP's width)");
    if (moe_every < 1 || moe_every > layers)
      throw InputError("model.moe_every = " + std::to_string(moe_every) + " is not between 1 and model.layers = " +
                       std::to_string(layers) + " (every moe_every-th block has experts)");
  }
  if (attention == "flash" && !math::flash_head_size_supported(d_model / heads))
    throw InputError(
        "model.attention = flash: head size model.d_model / model.heads = " + std::to_string(d_model / heads) +
        " is not one the fused kernels take (16, 32, 64 or 128); use model.attention = unfused");
}

void GPTConfig::read_architecture(const std::map<std::string, std::string>& v) {
  const auto get = [&](const char* key) {
    const auto it = v.find(key);
    return it == v.end() ? std::string() : it->second;
  };
  const auto number = [&](const char* key, double fallback) {
    const std::string text = get(key);
    if (text.empty()) return fallback;
    char* end = nullptr;
    const double x = std::strtod(text.c_str(), &end);
    if (end == text.c_str() || *end != '\0' || !std::isfinite(x))
      throw InputError(std::string(key) + " = " + text + " is not a number");
    return x;
  };
  const std::string a = get("model.arch");
  if (a.empty() || a == "gpt2")
    arch = Arch::gpt2;
  else if (a == "llama")
    arch = Arch::llama;
  else
    throw InputError("model.arch = " + a + " is not gpt2 or llama");
  kv_heads = static_cast<int>(number("model.kv_heads", 0));
  ffn_hidden = static_cast<int>(number("model.ffn_hidden", 0));
  norm_eps = static_cast<float>(number("model.norm_eps", 1e-5));
  rope_theta = static_cast<float>(number("model.rope_theta", 10000));
  experts = static_cast<int>(number("model.experts", 0));
  moe_every = static_cast<int>(number("model.moe_every", 1));
  experts_per_token = static_cast<int>(number("model.experts_per_token", 2));
  moe_ffn_hidden = static_cast<int>(number("model.moe_ffn_hidden", 0));
  expert_capacity = number("model.expert_capacity", 0);
  const std::string tie = get("model.tie_embeddings");
  if (tie.empty() || tie == "auto")
    tie_embeddings = -1;
  else if (tie == "true" || tie == "false")
    tie_embeddings = tie == "true" ? 1 : 0;
  else
    throw InputError("model.tie_embeddings = " + tie + " is not auto, true or false");
}

std::map<std::string, std::string> GPTConfig::architecture_values() const {
  std::ostringstream eps, theta;
  eps << norm_eps;
  theta << rope_theta;
  return {{"model.arch", arch_name(arch)},
          {"model.kv_heads", std::to_string(kv())},
          {"model.ffn_hidden", std::to_string(ffn())},
          {"model.norm_eps", eps.str()},
          {"model.rope_theta", theta.str()},
          {"model.tie_embeddings", tied() ? "true" : "false"},
          {"model.experts", std::to_string(experts)},
          {"model.moe_every", std::to_string(experts > 0 ? moe_every : 1)},
          {"model.experts_per_token", std::to_string(experts > 0 ? experts_per_token : 2)},
          {"model.moe_ffn_hidden", std::to_string(experts > 0 ? expert_ffn() : 0)}};
}

void GPTConfig::set_attention(const std::string& kind) {
  attention = kind;
  flash_attention = kind == "flash" || kind == "cudnn";
  attention_engine = kind == "cudnn" ? AttentionEngine::cudnn : AttentionEngine::loom;
}

void GPT::check_attention(const GPTConfig& cfg, const Backend& backend) {
  if (cfg.attention == "auto")
    throw std::logic_error("GPT: model.attention = auto not resolved (GPT::resolve_attention)");
  if (!cfg.flash_attention) return;
  const int hs = cfg.d_model / cfg.heads;
  if (cfg.attention_engine == GPTConfig::AttentionEngine::cudnn) {
    const std::string why = backend.cudnn_attention_refusal(cfg.seq_len, hs);
    if (!why.empty())
      throw InputError("model.attention = cudnn: " + why + "; use model.attention = flash, unfused or auto");
    return;
  }
  const std::string why = backend.flash_attention_refusal(hs);
  if (!why.empty()) throw InputError("model.attention = flash: " + why + "; use model.attention = unfused");
}

std::string GPT::resolve_attention(GPTConfig& cfg, const Backend& backend) {
  if (cfg.attention != "auto") return "";
  const int hs = cfg.d_model / cfg.heads;
  const std::string no_cudnn = backend.cudnn_attention_refusal(cfg.seq_len, hs);
  if (no_cudnn.empty()) {
    cfg.set_attention("cudnn");
    return "cuDNN's fused attention takes this device and shape";
  }
  if (backend.space() == MemSpace::host) {
    // The host's fused path is the device kernel's twin: it rounds q, k, v to bf16 whatever the run's
    // precision. auto keeps the run's arithmetic; flash stays one key away (faster at long sequences).
    cfg.set_attention("unfused");
    return "the host back end: auto keeps attention in the run's precision; its flash path is the GPU kernel's "
           "bf16 twin (model.attention = flash)";
  }
  const std::string no_flash = math::flash_head_size_supported(hs)
                                   ? backend.flash_attention_refusal(hs)
                                   : "head size " + std::to_string(hs) + " is not one loom's fused kernels take";
  if (no_flash.empty()) {
    cfg.set_attention("flash");
    return "not cudnn: " + no_cudnn;
  }
  cfg.set_attention("unfused");
  return "not cudnn: " + no_cudnn + "; not flash: " + no_flash;
}

GPT::GPT(const GPTConfig& cfg, Backend& backend, int max_rows, Partition* partition, const Stage& stage,
         ParamStore* store, int dp, int dp_rank, ContextSplit* context, ExpertSplit* experts)
    : cfg_(cfg),
      be_(backend),
      part_(partition ? partition : &default_partition_),
      max_rows_(max_rows),
      mm16_(backend.precision().matmul),
      stage_(stage),
      store_(store ? store : &own_store_) {
  cfg_.validate();
  if (context) ctx_ = context;
  if (experts) ep_ = experts;
  if (ep_->size() > 1 && (cfg_.experts <= 0 || cfg_.experts % ep_->size() != 0))
    throw std::logic_error("GPT: " + std::to_string(cfg_.experts) + " experts over " + std::to_string(ep_->size()) +
                           " expert-parallel ranks (check_layout refuses this)");
  T_ = ctx_->local_tokens(cfg_.seq_len);
  if (ctx_->size() > 1) {
    if (std::string why = be_.ring_attention_refusal(); !why.empty())
      throw InputError("parallel.cp = " + std::to_string(ctx_->size()) + ": " + why);
  }
  check_attention(cfg_, be_);
  if (cfg_.experts > 0) {
    if (std::string why = be_.expert_rows_refusal(); !why.empty())
      throw InputError("model.experts = " + std::to_string(cfg_.experts) + ": " + why);
  }
  if (stage_.chunks.empty()) stage_.chunks.push_back({0, cfg.layers, 1});
  layer_pos_.assign(static_cast<std::size_t>(cfg.layers), -1);
  int held = 0, prev_end = 0;
  for (const Stage::Chunk& c : stage_.chunks) {
    if (c.first_layer < prev_end || c.first_layer >= c.end_layer || c.end_layer > cfg.layers || c.activation_slots < 1)
      throw std::logic_error("GPT: stage " + std::to_string(stage_.index) + " chunk [" + std::to_string(c.first_layer) +
                             ", " + std::to_string(c.end_layer) + ") of " + std::to_string(cfg.layers) + " layers");
    for (int l = c.first_layer; l < c.end_layer; ++l) layer_pos_[l] = held++;
    prev_end = c.end_layer;
  }
  tp_ = part_->size();
  tp_rank_ = part_->rank();
  sp_ = part_->sequence_parallel();
  const std::int64_t L = cfg.layers, C = cfg.d_model, T = cfg.seq_len, V = cfg.vocab, tp = tp_;
  const std::int64_t Vl = V / tp;  // this rank's vocabulary rows
  vocab_local_ = static_cast<int>(Vl);
  vocab_begin_ = static_cast<int>(tp_rank_ * Vl);
  const double resid_std = 0.02 / std::sqrt(2.0 * L);
  // Every tensor of the whole model, then this stage's share of them. The tp piece (local shape,
  // element count) comes from the shard descriptor alone.
  auto add = [&](std::string name, std::vector<std::int64_t> shape, TpSplit split, ParamInfo::Init init, double std) {
    ParamInfo p;
    p.name = std::move(name);
    p.decay = shape.size() >= 2;
    // wte: the tied head's weight (an untied one only feeds the embedding lookup)
    p.matmul_weight = p.decay && p.name != "wpe.weight" && (p.name != "wte.weight" || cfg.tied());
    p.shard = ShardDesc::make(std::move(shape), split, static_cast<int>(tp), tp_rank_);
    // A replicated tensor whose gradient each tp rank has only in part, summed over the group
    // (Partition::finish_grads): with sequence parallelism those seeing only this rank's rows; Llama's
    // k and v replicated over a tp that does not divide the kv heads (each rank's query heads' share).
    const bool kv = p.name.find(".attn.k.") != std::string::npos || p.name.find(".attn.v.") != std::string::npos;
    // The router and the experts' proj biases are not: every tp rank computes them from every token.
    const bool expert =
        p.name.find(".mlp.router.") != std::string::npos || p.name.find(".mlp.experts.") != std::string::npos;
    p.sp_partial = (sp_ && split == TpSplit::none && p.name != "wpe.weight" && !expert) ||
                   (kv && split == TpSplit::none && tp > 1);
    p.init = init;
    p.init_std = std;
    p.expert = ep_->size() > 1 && p.name.find(".mlp.experts.") != std::string::npos;
    all_params_.push_back(std::move(p));
  };
  using I = ParamInfo::Init;
  add("wte.weight", {V, C}, TpSplit::rows, I::normal, 0.02);
  if (cfg.llama()) {
    // Llama: no positions table, no biases; kv heads split over tp where it divides them, else whole
    // on every rank (their gradients summed over the group, sp_partial).
    const std::int64_t CK = static_cast<std::int64_t>(cfg.kv()) * cfg.head_size(), F = cfg.ffn();
    const TpSplit kv_split = cfg.kv() % tp == 0 ? TpSplit::rows : TpSplit::none;
    for (int l = 0; l < L; ++l) {
      const std::string b = "blocks." + std::to_string(l) + ".";
      add(b + "ln1.weight", {C}, TpSplit::none, I::ones, 0);
      add(b + "attn.q.weight", {C, C}, TpSplit::rows, I::normal, 0.02);
      add(b + "attn.k.weight", {CK, C}, kv_split, I::normal, 0.02);
      add(b + "attn.v.weight", {CK, C}, kv_split, I::normal, 0.02);
      add(b + "attn.proj.weight", {C, C}, TpSplit::cols, I::normal, resid_std);
      add(b + "ln2.weight", {C}, TpSplit::none, I::ones, 0);
      add(b + "mlp.gate.weight", {F, C}, TpSplit::rows, I::normal, 0.02);
      add(b + "mlp.up.weight", {F, C}, TpSplit::rows, I::normal, 0.02);
      add(b + "mlp.down.weight", {C, F}, TpSplit::cols, I::normal, resid_std);
    }
    add("ln_f.weight", {C}, TpSplit::none, I::ones, 0);
    if (!cfg.tied()) add("lm_head.weight", {V, C}, TpSplit::rows, I::normal, 0.02);
  } else {
    add("wpe.weight", {T, C}, TpSplit::none, I::normal, 0.02);
    for (int l = 0; l < L; ++l) {
      const std::string b = "blocks." + std::to_string(l) + ".";
      add(b + "ln1.weight", {C}, TpSplit::none, I::ones, 0);
      add(b + "ln1.bias", {C}, TpSplit::none, I::zeros, 0);
      add(b + "attn.qkv.weight", {3 * C, C}, TpSplit::qkv_rows, I::normal, 0.02);
      add(b + "attn.qkv.bias", {3 * C}, TpSplit::qkv_rows, I::zeros, 0);
      add(b + "attn.proj.weight", {C, C}, TpSplit::cols, I::normal, resid_std);
      add(b + "attn.proj.bias", {C}, TpSplit::none, I::zeros, 0);
      add(b + "ln2.weight", {C}, TpSplit::none, I::ones, 0);
      add(b + "ln2.bias", {C}, TpSplit::none, I::zeros, 0);
      if (cfg.moe_layer(l)) {  // the router, then each expert's MLP as the dense one, by global index
        add(b + "mlp.router.weight", {cfg.experts, C}, TpSplit::none, I::normal, 0.02);
        for (int e = 0; e < cfg.experts; ++e) {
          const std::string x = b + "mlp.experts." + std::to_string(e) + ".";
          const std::int64_t FE = cfg.expert_ffn();
          add(x + "fc.weight", {FE, C}, TpSplit::rows, I::normal, 0.02);
          add(x + "fc.bias", {FE}, TpSplit::rows, I::zeros, 0);
          add(x + "proj.weight", {C, FE}, TpSplit::cols, I::normal, resid_std);
          add(x + "proj.bias", {C}, TpSplit::none, I::zeros, 0);
        }
        continue;
      }
      add(b + "mlp.fc.weight", {4 * C, C}, TpSplit::rows, I::normal, 0.02);
      add(b + "mlp.fc.bias", {4 * C}, TpSplit::rows, I::zeros, 0);
      add(b + "mlp.proj.weight", {C, 4 * C}, TpSplit::cols, I::normal, resid_std);
      add(b + "mlp.proj.bias", {C}, TpSplit::none, I::zeros, 0);
    }
    add("ln_f.weight", {C}, TpSplit::none, I::ones, 0);
    add("ln_f.bias", {C}, TpSplit::none, I::zeros, 0);
  }
  // The first stage holds the embeddings, the last ln_f and the head, whose weight is wte (tied):
  // a last stage that is not also the first holds a shadow copy of wte, in its head unit.
  block_unit_.assign(static_cast<std::size_t>(L), -1);
  block_tensors_.assign(static_cast<std::size_t>(L),
                        std::vector<int>(13 + 4 * static_cast<std::size_t>(std::max(cfg.experts, 0)), -1));
  auto unit_of = [&](const std::string& name) -> int {
    for (std::size_t u = 0; u < units_.size(); ++u)
      if (units_[u].name == name) return static_cast<int>(u);
    units_.push_back({name, {}});
    return static_cast<int>(units_.size()) - 1;
  };
  auto hold = [&](const ParamInfo& whole, const std::string& unit, bool shadow) {
    ParamInfo local = whole;
    local.shadow = shadow;
    local.offset = num_params_;
    local.unit = unit_of(unit);
    num_params_ += local.numel();
    const int index = static_cast<int>(params_.size());
    units_[static_cast<std::size_t>(local.unit)].params.push_back(index);
    pos_in_unit_.push_back(static_cast<int>(units_[static_cast<std::size_t>(local.unit)].params.size()) - 1);
    params_.push_back(std::move(local));
    return index;
  };
  const std::string block_prefix = "blocks.";
  for (ParamInfo& p : all_params_) {
    const std::string& n = p.name;
    int held = -1;
    if (n == "wte.weight") {
      if (stage_.first())
        held = wte_ = hold(p, "embeddings", false);
      else if (stage_.last())
        held = wte_ = -2;  // added to the head unit below, after ln_f
    } else if (n == "wpe.weight") {
      if (stage_.first()) held = wpe_ = hold(p, "embeddings", false);
    } else if (n.compare(0, block_prefix.size(), block_prefix) == 0) {
      const int layer = std::stoi(n.substr(block_prefix.size()));
      // An expert of another expert-parallel rank is not held here.
      const std::size_t ex = n.find(".mlp.experts.");
      const int expert = ex == std::string::npos ? -1 : std::stoi(n.substr(ex + 13));
      const bool mine = expert < 0 || (expert >= ep_->first(cfg.experts) && expert < ep_->end(cfg.experts));
      if (layer_pos_[static_cast<std::size_t>(layer)] >= 0 && mine) {
        held = hold(p, "blocks." + std::to_string(layer), false);
        block_unit_[static_cast<std::size_t>(layer)] = params_[static_cast<std::size_t>(held)].unit;
        block_tensors_[static_cast<std::size_t>(layer)]
                      [block_tensor_index(n.substr(n.find('.', block_prefix.size()) + 1), cfg.llama())] = held;
      }
    } else if (stage_.last()) {
      held = hold(p, "head", false);
      (n == "ln_f.weight" ? lnfw_ : n == "ln_f.bias" ? lnfb_ : head_w_) = held;  // head_w_: lm_head
    }
    if (held == -1) {
      p.offset = -1;
      p.shard = p.shard.cut(0, 0);  // the shape stays; no element of it is held here
    }
  }
  // Untied (Llama's lm_head): a last stage that is not the first holds no wte.
  if (wte_ == -2) wte_ = cfg.tied() ? hold(all_params_.front(), "head", true) : -1;
  if (cfg.tied()) head_w_ = wte_;
  if (wte_ >= 0) params_[static_cast<std::size_t>(wte_)].tied = stage_.count > 1 && cfg.tied();
  // The first stage's wte feeds only the embedding lookup (fp32) when another stage holds the head.
  if (wte_ >= 0 && !stage_.last()) params_[static_cast<std::size_t>(wte_)].matmul_weight = false;
  emb_unit_ = stage_.first() ? params_[static_cast<std::size_t>(wte_)].unit : -1;
  head_unit_ = stage_.last() ? params_[static_cast<std::size_t>(lnfw_)].unit : -1;
  StoreContext sctx{backend, dp, dp_rank, tp_rank_, ep_->size()};
  store_->build(sctx, params_, units_);

  // Activations, sized by activation_sizes (what `loom plan` predicts with, too).
  geom_ = {cfg_, tp_, sp_, max_rows_, mm16_, be_.space(), ctx_->size(), ep_->size()};
  const ActivationSizes a = activation_sizes(cfg_, tp_, sp_, stage_, max_rows_, mm16_, ctx_->size(), ep_->size());
  // The ring rounds its blocks' operands to bf16 for flash, and for unfused in a bf16 run (as the host's
  // unfused kernels do at one rank).
  if (ctx_->size() > 1)
    ctx_->prepare(be_, max_rows_, T_, cfg_.d_model / tp_, cfg_.heads / tp_,
                  cfg_.flash_attention || mm16_ == DType::bf16, mm16_ != DType::f32);
  residual0_ = a.residual_first;
  acts0_ = a.block_first;
  if (cfg_.experts > 0) {
    std::size_t routings = 0;
    for (const Stage::Chunk& c : stage_.chunks)
      routings += static_cast<std::size_t>(c.activation_slots) * static_cast<std::size_t>(c.end_layer - c.first_layer);
    routing_.resize(routings);
  }
  reset_moe_stats();
  for (const Stage::Chunk& c : stage_.chunks) {
    slot_rows_.emplace_back(static_cast<std::size_t>(c.activation_slots), 0);
    slot_scored_.emplace_back(static_cast<std::size_t>(c.activation_slots), false);
  }
  slot_dloss_.assign(static_cast<std::size_t>(stage_.chunks.back().activation_slots),
                     std::numeric_limits<float>::quiet_NaN());
  block_act_floats_ = a.block_table_floats;
  head_floats_ = a.head_table_floats;
  head_logits_at_ = a.head_floats - (a.head_floats > 0 ? head_logits_floats(geom_) : 0);
  residual_buf_ = be_.allocate("GPT::residual", DType::f32, a.residual_floats, Mem::activations);
  block_buf_ = be_.allocate("GPT::block_activations", DType::f32, a.block_floats, Mem::activations);
  head_buf_ = be_.allocate("GPT::head_activations", DType::f32, a.head_floats, Mem::activations);
  // forward: full, partial [N,C], local [Nl,C]; backward: dres, dlocal [Nl,C], dfull, dpartial
  // [N,C], dqkv [N,3Cl], datt [T,T] (flash: dsum [B,NHl,T]), datty [N,Cl], dfch, dfch_gelu [N,Fl]
  scratch_buf_ = be_.allocate("GPT::scratch", DType::f32, a.scratch_floats, Mem::activations);
  tokens_buf_ = be_.allocate("GPT::tokens", DType::i32, a.token_ints, Mem::workspace);
}

void GPT::plan_step(StepPlan& plan) const {
  // The saved inputs' types, as the tables are carved (a null base only types and counts them).
  const BlockActs a = carve_block(geom_, nullptr);
  const Scratch s = carve_scratch(geom_, nullptr);
  const Head h = carve_head(geom_, nullptr);
  const int N = max_rows_ * T_, C = cfg_.d_model, Cl = C / tp_, Fl = cfg_.ffn() / tp_;
  const int CKl = kv_local() * cfg_.head_size();
  auto full = [&](const BufferRef& saved, int cols) {  // input_of: gathered fp32 unless saved 16-bit
    return BufferRef(nullptr, saved.type, static_cast<std::int64_t>(N) * cols, be_.space());
  };
  auto weight = [&](std::int64_t n) { return BufferRef(nullptr, mm16_, n, be_.space()); };
  using Call = Backend::MatmulCall;
  std::vector<Call> fwd;
  for (const Stage::Chunk& c : stage_.chunks)
    for (int l = c.first_layer; l < c.end_layer; ++l) {
      if (cfg_.llama()) {  // q, k, v; the projection; gate, up; down (every dout fp32 but gate's and up's)
        fwd.push_back({false, full(a.ln1, C), weight(static_cast<std::int64_t>(Cl) * C), N, C, Cl, DType::f32, true});
        fwd.push_back({false, full(a.ln1, C), weight(static_cast<std::int64_t>(CKl) * C), N, C, CKl});
        fwd.push_back({false, full(a.ln1, C), weight(static_cast<std::int64_t>(CKl) * C), N, C, CKl});
        fwd.push_back({false, full(a.atty, Cl), weight(static_cast<std::int64_t>(C) * Cl), N, Cl, C});
        fwd.push_back({false, full(a.ln2, C), weight(static_cast<std::int64_t>(Fl) * C), N, C, Fl, s.dfch.type});
        fwd.push_back({false, full(a.ln2, C), weight(static_cast<std::int64_t>(Fl) * C), N, C, Fl, s.dfcu.type});
        fwd.push_back({false, full(a.fch_gelu, Fl), weight(static_cast<std::int64_t>(C) * Fl), N, Fl, C});
        continue;
      }
      fwd.push_back({false, full(a.ln1, C), weight(3ll * Cl * C), N, C, 3 * Cl, DType::f32, true});
      fwd.push_back({false, full(a.atty, Cl), weight(static_cast<std::int64_t>(C) * Cl), N, Cl, C});
      // Experts: the router's product, then the experts' N*k rows, priced as k products of N rows (an
      // expert takes at most every token once, so none is larger).
      const int mlps = cfg_.moe_layer(l) ? cfg_.top_k() : 1;
      if (cfg_.moe_layer(l))
        fwd.push_back({false, full(a.ln2, C), weight(static_cast<std::int64_t>(cfg_.experts) * C), N, C, cfg_.experts});
      const int F = cfg_.moe_layer(l) ? cfg_.expert_ffn() / tp_ : Fl;
      for (int e = 0; e < mlps; ++e) {
        fwd.push_back({false, full(a.ln2, C), weight(static_cast<std::int64_t>(F) * C), N, C, F, s.dfch.type});
        fwd.push_back({false, full(a.fch_gelu, F), weight(static_cast<std::int64_t>(C) * F), N, F, C});
      }
    }
  if (stage_.last())
    fwd.push_back(
        {false, full(h.lnf, C), weight(static_cast<std::int64_t>(vocab_local_) * C), N, C, vocab_local_, mm16_});
  std::vector<Call> calls = fwd;
  for (auto it = fwd.rbegin(); it != fwd.rend(); ++it) {
    calls.push_back(*it);
    calls.back().backward = true;
  }
  be_.plan_workspace(plan, calls,
                     {max_rows_, T_, cfg_.heads / tp_, cfg_.flash_attention,
                      cfg_.attention_engine == GPTConfig::AttentionEngine::cudnn, cfg_.d_model / cfg_.heads});
  part_->plan_step(plan, *this);
  ep_->plan_step(plan, *this);  // the experts' all-to-all and their gradients' sum (parallel.ep > 1)
  int layers = 0;
  for (const Stage::Chunk& c : stage_.chunks) layers += c.end_layer - c.first_layer;
  ctx_->plan_step(plan, layers, plan.micro_batches, cfg_.recompute);
}

GPT::ActivationSizes GPT::activation_sizes(const GPTConfig& cfg, int tp, bool sp, const Stage& stage_in, int max_rows,
                                           DType mm16, int cp, int ep) {
  // Rows: N of a micro-batch, Nl on this rank (N/tp with sequence parallelism); one set per slot
  // (in-flight micro-batch) of each chunk.
  Stage stage = stage_in;
  if (stage.chunks.empty()) stage.chunks.push_back({0, cfg.layers, 1});
  const Geometry g{cfg, tp, sp, max_rows, mm16, MemSpace::host, cp, ep};
  const std::int64_t N = static_cast<std::int64_t>(max_rows) * g.T(), Nl = sp ? N / tp : N, C = cfg.d_model;
  ActivationSizes a;
  a.block_table_floats = carve_block(g, nullptr).floats;
  a.head_table_floats = carve_head(g, nullptr).floats;
  std::int64_t residuals = 0, acts = 0;
  int max_slots = 1;
  for (const Stage::Chunk& c : stage.chunks) {
    a.residual_first.push_back(residuals);
    a.block_first.push_back(acts);
    residuals += static_cast<std::int64_t>(c.activation_slots) * (c.end_layer - c.first_layer + 1);
    acts += static_cast<std::int64_t>(c.activation_slots) * (c.end_layer - c.first_layer);
    max_slots = std::max(max_slots, c.activation_slots);
  }
  const std::int64_t saved_blocks = cfg.recompute ? 1 : acts;
  const std::int64_t head_slots = stage.last() ? stage.chunks.back().activation_slots : 0;
  a.residual_floats = residuals * Nl * C;
  a.block_floats = saved_blocks * a.block_table_floats;
  a.head_floats = head_slots * a.head_table_floats + (head_slots > 0 ? head_logits_floats(g) : 0);
  a.scratch_floats = carve_scratch(g, nullptr).floats;
  a.token_ints = static_cast<std::int64_t>(max_slots) * 2 * N;
  return a;
}

const ParamInfo* GPT::find_param(const std::string& name) const {
  for (const auto& p : params_)
    if (p.name == name) return &p;
  return nullptr;
}

int GPT::param_index(const std::string& name) const {
  for (std::size_t i = 0; i < params_.size(); ++i)
    if (params_[i].name == name) return static_cast<int>(i);
  return -1;
}

const ParamInfo& GPT::param(const std::string& name) const {
  if (const ParamInfo* p = find_param(name)) return *p;
  throw std::out_of_range("GPT: no parameter named '" + name + "' on this rank");
}

void GPT::init_weights(std::uint64_t seed) {
  // Each rank draws exactly its own elements, by their index in the full tensor: tensors the store
  // keeps whole, and the owned slices of those it keeps only in part (ZeRO-3).
  auto fill = [&](const ParamInfo& p, float* w, std::int64_t begin, std::int64_t end) {
    const std::uint64_t stream = rng::hash_name(p.name);
    switch (p.init) {
      case ParamInfo::Init::normal:
        for (std::int64_t i = begin; i < end; ++i)
          w[i - begin] = static_cast<float>(
              p.init_std * rng::normal(seed, stream, static_cast<std::uint64_t>(p.shard.global_index(i))));
        break;
      case ParamInfo::Init::ones:
        std::fill(w, w + (end - begin), 1.0f);
        break;  // host memory (write_held)
      case ParamInfo::Init::zeros:
        std::fill(w, w + (end - begin), 0.0f);
        break;
    }
  };
  write_held(fill);
}

void GPT::write_held(const std::function<void(const ParamInfo&, float*, std::int64_t, std::int64_t)>& write) {
  // `write` fills host memory: the store's own buffers on the host back end, a host copy that goes
  // to the device afterwards on a device back end.
  std::vector<float> staging;
  const auto held = [&](const ParamInfo& p, BufferRef w, std::int64_t begin, std::int64_t end) {
    if (w.space == MemSpace::host) return write(p, w.as<float>(), begin, end);
    staging.assign(static_cast<std::size_t>(end - begin), 0.0f);
    write(p, staging.data(), begin, end);
    be_.copy_from_host(BufferRef(w.as<float>(), end - begin, w.space), staging.data());
  };
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const BufferRef w = store_->param(static_cast<int>(i));
    if (!w.empty()) held(params_[i], w, 0, params_[i].numel());
  }
  for (const OwnedSlice& o : store_->owned())
    if (store_->param(o.param).empty())
      held(params_[static_cast<std::size_t>(o.param)], store_->owned_param(o), o.begin, o.end);
  store_->params_written();
}

void GPT::load_weights(const std::function<const float*(const std::string& name)>& whole) {
  auto take = [&](const ParamInfo& p, float* w, std::int64_t begin, std::int64_t end) {
    const float* src = whole(p.name);
    for (std::int64_t i = begin; i < end; ++i) w[i - begin] = src[p.shard.global_index(i)];
  };
  write_held(take);
}

const float* GPT::logits() const {
  if (!holds_head(0) || stage_.chunks.size() != 1)
    throw std::logic_error("GPT::logits: this rank does not hold the whole model");
  if (slot_rows_[0][0] == 0)
    throw std::logic_error(
        "GPT::logits: no forward held (backward consumed it, or none ran); forward with targets = null");
  if (slot_scored_[0][0])
    throw std::logic_error(
        "GPT::logits: the last forward had targets, so its logits became probabilities; forward with targets = null");
  return head(0).logits.as<const float>();
}

GPT::BlockParams GPT::block_params(const ParamStore::UnitView& view, int l, bool grads) const {
  const std::vector<int>& h = block_tensors_[static_cast<std::size_t>(l)];
  const std::vector<BufferRef>& t = grads ? view.grads : view.params;
  BufferRef q[12];  // a block with experts has no mlp.* tensors (-1): empty
  for (std::size_t i = 0; i < 12; ++i)
    if (h[i] >= 0) q[i] = t[static_cast<std::size_t>(pos_in_unit_[static_cast<std::size_t>(h[i])])];
  BlockParams w{q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7], q[8], q[9], q[10], q[11], {}, {}, {}, {}};
  if (!grads) {
    w.mqkvw = matmul_operand(view, h[2]);
    w.mprojw = matmul_operand(view, h[4]);
    if (h[8] >= 0) w.mfcw = matmul_operand(view, h[8]);
    if (h[10] >= 0) w.mfcprojw = matmul_operand(view, h[10]);
  }
  return w;
}

GPT::LlamaParams GPT::llama_params(const ParamStore::UnitView& view, int l, bool grads) const {
  const std::vector<int>& h = block_tensors_[static_cast<std::size_t>(l)];
  const std::vector<BufferRef>& t = grads ? view.grads : view.params;
  BufferRef q[9];
  for (std::size_t i = 0; i < 9; ++i) q[i] = t[static_cast<std::size_t>(pos_in_unit_[static_cast<std::size_t>(h[i])])];
  LlamaParams w{q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7], q[8], {}, {}, {}, {}, {}, {}, {}};
  if (!grads) {
    w.mqw = matmul_operand(view, h[1]);
    w.mkw = matmul_operand(view, h[2]);
    w.mvw = matmul_operand(view, h[3]);
    w.mprojw = matmul_operand(view, h[4]);
    w.mgatew = matmul_operand(view, h[6]);
    w.mupw = matmul_operand(view, h[7]);
    w.mdownw = matmul_operand(view, h[8]);
  }
  return w;
}

int GPT::kv_local() const { return cfg_.kv() % tp_ == 0 ? cfg_.kv() / tp_ : cfg_.kv(); }
int GPT::kv_head0() const { return cfg_.kv() % tp_ == 0 ? tp_rank_ * kv_local() : 0; }

BufferRef GPT::matmul_operand(const ParamStore::UnitView& view, int param) const {
  const std::size_t k = static_cast<std::size_t>(pos_in_unit_[static_cast<std::size_t>(param)]);
  return k < view.compute.size() && !view.compute[k].empty() ? view.compute[k] : view.params[k];
}

BufferRef GPT::input_of(const BufferRef& saved, const BufferRef& full, int N, int C) {
  const std::int64_t n = static_cast<std::int64_t>(N) * C;
  if (saved.type != DType::f32) return saved.slice(0, n);  // never gathered: saved 16-bit only without sp
  return part_->to_full(saved, full, N, C).slice(0, n);
}

// Activation tables (llm.c's habit): each group's tensors are carved from one run of floats by one
// function, which also sizes the group (carving from a null base only counts).
namespace {
struct Carver {
  float* base;
  MemSpace space = MemSpace::host;
  std::int64_t used = 0;
  // n elements of `type` (fp32 or 16-bit), in whole floats.
  BufferRef take(DType type, std::int64_t n) {
    const std::int64_t floats = (n * static_cast<std::int64_t>(dtype_size(type)) + 3) / 4;
    float* p = base ? base + used : nullptr;
    used += floats;
    return BufferRef(p, type, n, space);
  }
  BufferRef take(std::int64_t n) { return take(DType::f32, n); }
};
}  // namespace

GPT::BlockActs GPT::carve_block(const Geometry& g, float* base) {
  const std::int64_t N = static_cast<std::int64_t>(g.max_rows) * g.T(), Nl = g.sp ? N / g.tp : N;
  const std::int64_t C = g.cfg.d_model, T = g.T(), NHl = g.cfg.heads / g.tp, Cl = C / g.tp, Fl = g.cfg.ffn() / g.tp;
  const bool llama = g.cfg.llama();
  Carver c{base, g.space};
  BlockActs a;
  // 16-bit copies of the products' inputs under mixed precision; ln1 and ln2 stay fp32 with
  // sequence parallelism, where their [Nl,C] pieces are gathered (in fp32) before each product.
  const DType mm = g.mm16, ln = g.sp ? DType::f32 : g.mm16;
  a.ln1 = c.take(ln, Nl * C);
  if (!llama) a.ln1_mean = c.take(Nl);  // RMSNorm keeps only rstd
  a.ln1_rstd = c.take(Nl);
  a.qkv = c.take(N * 3 * Cl);
  // Unfused attention saves the probabilities, flash only each row's log-sum-exp.
  if (g.cfg.flash_attention || g.cp > 1)  // the ring keeps each row's log-sum-exp too
    a.lse = c.take(static_cast<std::int64_t>(g.max_rows) * NHl * T);
  else
    a.att = c.take(static_cast<std::int64_t>(g.max_rows) * NHl * T * T);
  a.atty = c.take(mm, N * Cl);
  a.xmid = c.take(Nl * C);
  a.ln2 = c.take(ln, Nl * C);
  if (!llama) a.ln2_mean = c.take(Nl);
  a.ln2_rstd = c.take(Nl);
  // with experts: every expert row (k a token; with ep, what this rank's experts receive), as wide as an expert
  const std::int64_t hidden = std::max(N * Fl, g.expert_rows() * (g.cfg.expert_ffn() / g.tp));
  a.fch = c.take(hidden);
  if (llama) a.fcu = c.take(N * Fl);
  a.fch_gelu = c.take(mm, hidden);
  if (g.cfg.experts > 0) {
    const std::int64_t Nk = N * g.cfg.top_k();
    a.moe_y = c.take(Nk * C);
    a.moe_rows = c.take(DType::i32, Nk);
    a.moe_gates = c.take(Nk);
    if (g.ep > 1) {
      a.moe_x = c.take(ln, g.expert_rows() * C);
      a.moe_perm = c.take(DType::i32, g.expert_rows());
      a.moe_inv = c.take(DType::i32, g.expert_rows());
    }
  }
  a.floats = c.used;
  return a;
}

GPT::Scratch GPT::carve_scratch(const Geometry& g, float* base) {
  const std::int64_t N = static_cast<std::int64_t>(g.max_rows) * g.T(), Nl = g.sp ? N / g.tp : N;
  const std::int64_t C = g.cfg.d_model, T = g.T(), NHl = g.cfg.heads / g.tp, Cl = C / g.tp, Fl = g.cfg.ffn() / g.tp;
  Carver c{base, g.space};
  Scratch s;
  s.full = c.take(N * C);
  s.partial = c.take(N * C);
  s.local = c.take(Nl * C);
  s.dres = c.take(Nl * C);
  s.dlocal = c.take(Nl * C);
  s.dfull = c.take(N * C);
  s.dpartial = c.take(N * C);
  s.dqkv = c.take(N * 3 * Cl);
  if (g.cp > 1) {  // the ring's own scratch is the context role's; the positions of this rank's tokens
    s.pos = c.take(T * C);
    s.dpos = c.take(T * C);
  } else if (g.cfg.flash_attention) {
    s.dsum = c.take(static_cast<std::int64_t>(g.max_rows) * NHl * T);
  } else {
    s.datt = c.take(T * T);
  }
  s.datty = c.take(N * Cl);
  // (an expert's rows are at most N, each as wide as an expert)
  const std::int64_t hidden =
      std::max(N * Fl, g.cfg.experts > 0 ? g.rows_per_expert() * (g.cfg.expert_ffn() / g.tp) : 0);
  s.dfch = c.take(g.mm16, hidden);  // the fc product's dout only: in its type (gelu_bias_backward rounds it)
  s.dfch_gelu = c.take(hidden);
  if (g.cfg.llama()) {
    const std::int64_t CKl =
        static_cast<std::int64_t>(g.cfg.kv() % g.tp == 0 ? g.cfg.kv() / g.tp : g.cfg.kv()) * g.cfg.head_size();
    s.q = c.take(N * Cl);
    s.k = c.take(N * CKl);
    s.v = c.take(N * CKl);
    s.dfcu = c.take(g.mm16, N * Fl);
  }
  if (g.cfg.experts > 0) {
    s.moe_x = c.take(N * C);
    s.moe_dy = c.take(std::max(N, g.ep > 1 ? g.expert_rows() : N) * C);
    s.router = c.take(N * g.cfg.experts);
    s.dgate = c.take(N * g.cfg.top_k());
    if (g.ep > 1) {
      const std::int64_t rows = std::max(N * g.cfg.top_k(), g.expert_rows());
      s.moe_send = c.take(rows * C);
      s.moe_recv = c.take(rows * C);
    }
  }
  s.floats = c.used;
  return s;
}

GPT::Head GPT::carve_head(const Geometry& g, float* base) {
  const std::int64_t N = static_cast<std::int64_t>(g.max_rows) * g.T(), Nl = g.sp ? N / g.tp : N;
  const std::int64_t Vl = g.cfg.vocab / g.tp;
  Carver c{base, g.space};
  Head h;
  h.lnf = c.take(g.sp ? DType::f32 : g.mm16, Nl * g.cfg.d_model);
  h.lnf_mean = c.take(Nl);
  h.lnf_rstd = c.take(Nl);
  // The classifier's gradient, the head product's dout, in the products' type. In fp32 the logits, the
  // probabilities and it are one [N,Vl] table, overwritten in place; under mixed precision the slot keeps
  // only its 16-bit dlogits and GPT::head points logits and probs at one fp32 table for every slot.
  h.dlogits = c.take(g.mm16, N * Vl);
  h.logits = h.probs = h.dlogits;
  h.losses = c.take(N);
  h.floats = c.used;
  return h;
}

// Under mixed precision: one fp32 [N,Vl] table after the slots' heads for the logits the head product
// writes, which the fused classifier turns into the slot's 16-bit dlogits (or the unfused forward into
// probabilities, which that slot's backward reads); none in fp32.
std::int64_t GPT::head_logits_floats(const Geometry& g) {
  const std::int64_t N = static_cast<std::int64_t>(g.max_rows) * g.T(), Vl = g.cfg.vocab / g.tp;
  return g.mm16 == DType::f32 ? 0 : N * Vl;
}

GPT::BlockActs GPT::block_acts(int chunk, int slot, int layer) const {
  const Stage::Chunk& c = stage_.chunks[chunk];
  const std::int64_t index =
      cfg_.recompute
          ? 0
          : acts0_[chunk] + static_cast<std::int64_t>(slot) * (c.end_layer - c.first_layer) + layer - c.first_layer;
  return carve_block(geom_, block_buf_.data<float>() + index * block_act_floats_);
}

BufferRef GPT::residual(int chunk, int slot, int layer) const {
  const std::int64_t N = static_cast<std::int64_t>(max_rows_) * T_, Nl = sp_ ? N / tp_ : N;
  const Stage::Chunk& c = stage_.chunks[chunk];
  const std::int64_t index =
      residual0_[chunk] + static_cast<std::int64_t>(slot) * (c.end_layer - c.first_layer + 1) + layer - c.first_layer;
  return residual_buf_.ref().slice(index * Nl * cfg_.d_model, Nl * cfg_.d_model);
}

std::int64_t GPT::stage_boundary_floats(int B) const {
  const std::int64_t N = static_cast<std::int64_t>(B) * T_;
  return (sp_ ? N / tp_ : N) * cfg_.d_model;
}

const float* GPT::stage_output(int slot, int chunk) const {
  return residual(chunk, slot, stage_.chunks[chunk].end_layer).as<const float>();
}

void GPT::check_slot(int chunk, int slot, const char* what) const {
  if (chunk < 0 || chunk >= static_cast<int>(stage_.chunks.size()) || slot < 0 ||
      slot >= stage_.chunks[chunk].activation_slots)
    throw std::logic_error(std::string("GPT::") + what + ": no slot " + std::to_string(slot) + " in chunk " +
                           std::to_string(chunk));
}

GPT::Scratch GPT::scratch() const { return carve_scratch(geom_, scratch_buf_.data<float>()); }

// The block's attention on its saved qkv, by the configured kind: a.atty (and a.att or a.lse) from a.qkv.
// The unfused kernel's output, a product's, goes through fp32 scratch (s.full, free once the gathered
// ln1 has been read by the q, k, v products) when atty is saved 16-bit.
void GPT::attention(const BlockActs& a, const Scratch& s, int B, int T, int Cl, int NHl) {
  if (ctx_->size() > 1) return ctx_->attention_forward(be_, a.atty, a.lse, a.qkv, B, T, Cl, NHl);
  if (cfg_.flash_attention) {
    if (cfg_.attention_engine == GPTConfig::AttentionEngine::cudnn)
      be_.attention_forward_cudnn(a.atty, a.lse, a.qkv, B, T, Cl, NHl);
    else
      be_.attention_forward_flash(a.atty, a.lse, a.qkv, B, T, Cl, NHl);
    return;
  }
  const std::int64_t NCl = static_cast<std::int64_t>(B) * T * Cl;
  const BufferRef out = a.atty.type == DType::f32 ? a.atty : s.full;
  be_.attention_forward(out, a.att, a.qkv, B, T, Cl, NHl);
  if (out.data != a.atty.data) be_.cast(a.atty.slice(0, NCl), out.slice(0, NCl));
}

// s.dqkv from s.datty, the gradient of the attention's output.
void GPT::attention_backward(const BlockActs& a, const Scratch& s, int B, int T, int Cl, int NHl) {
  if (ctx_->size() > 1)
    ctx_->attention_backward(be_, s.dqkv, s.datty, a.atty, a.qkv, a.lse, B, T, Cl, NHl);
  else if (!cfg_.flash_attention)
    be_.attention_backward(s.dqkv, s.datt, s.datty, a.qkv, a.att, B, T, Cl, NHl);
  else if (cfg_.attention_engine == GPTConfig::AttentionEngine::cudnn)
    be_.attention_backward_cudnn(s.dqkv, s.dsum, s.datty, a.atty, a.qkv, a.lse, B, T, Cl, NHl);
  else
    be_.attention_backward_flash(s.dqkv, s.dsum, s.datty, a.atty, a.qkv, a.lse, B, T, Cl, NHl);
}

void GPT::block_forward(int chunk, int slot, int l, int B, bool recompute) {
  const int T = T_, C = cfg_.d_model, N = B * T, Nl = sp_ ? N / tp_ : N;
  const int Cl = C / tp_, Fl = 4 * C / tp_, NHl = cfg_.heads / tp_;
  const int unit = block_unit_[static_cast<std::size_t>(l)];
  // Next: the following block's forward, or (recomputing in backward) this block's backward.
  const int next = recompute                                ? unit
                   : l + 1 < stage_.chunks[chunk].end_layer ? block_unit_[static_cast<std::size_t>(l + 1)]
                   : holds_head(chunk)                      ? head_unit_
                                                            : -1;
  if (cfg_.llama()) return llama_block_forward(chunk, slot, l, B, next);
  const ParamStore::UnitView& view = store_->acquire(unit, ParamStore::Use::forward, next);
  const BlockParams w = block_params(view, l, false);
  const BlockActs a = block_acts(chunk, slot, l);
  const Scratch s = scratch();
  const BufferRef x = residual(chunk, slot, l);         // [Nl,C] block input
  const BufferRef xout = residual(chunk, slot, l + 1);  // [Nl,C] block output
  // attention: column-parallel qkv (this rank's heads), row-parallel output projection. The saved
  // inputs of the products (ln1, atty, ln2, fch_gelu) are written in their saved type by the kernels
  // that make them (a 16-bit save rounded on store), except the unfused attention's output, a
  // product's, which goes through fp32 scratch (s.full, free once the gathered ln1 is used).
  be_.layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, x, w.ln1w, w.ln1b, Nl, C);
  be_.matmul_forward(a.qkv, input_of(a.ln1, s.full, N, C), w.mqkvw, w.qkvb, N, C, 3 * Cl);  // [N,3Cl]
  attention(a, s, B, T, Cl, NHl);                                                           // [N,Cl]
  // Without tensor parallelism the row-parallel layers' sums are whole at once: their biases go into
  // the product (cuBLASLt's epilogue on a GPU; the host adds them after it, as bias_add would).
  const bool whole = part_->size() == 1;
  be_.matmul_forward(s.partial, a.atty, w.mprojw, whole ? w.projb : BufferRef(), N, Cl, C);  // [N,C] partial sum
  BufferRef y = part_->reduce_partial(s.partial, s.local, N, C);                             // [Nl,C]
  if (!whole) be_.bias_add(y, w.projb, Nl, C);
  // MLP: column-parallel fc (this rank's share of 4C), row-parallel projection, on ln2(xmid = x + y)
  be_.residual_layernorm_forward(a.xmid, a.ln2, a.ln2_mean, a.ln2_rstd, x, y, w.ln2w, w.ln2b, Nl, C);
  if (cfg_.moe_layer(l)) {  // the experts' gated sum (biases inside), in s.partial
    moe_forward(view, a, s, chunk, slot, l, N, recompute);
    be_.residual_forward(xout, a.xmid, part_->reduce_partial(s.partial, s.local, N, C),
                         static_cast<std::int64_t>(Nl) * C);
    store_->release(unit, ParamStore::Use::forward);
    return;
  }
  be_.matmul_forward_gelu(a.fch_gelu, a.fch, input_of(a.ln2, s.full, N, C), w.mfcw, w.fcb, N, C,
                          Fl);  // [N,Fl] gelu(fch), fch
  be_.matmul_forward(s.partial, a.fch_gelu, w.mfcprojw, whole ? w.fcprojb : BufferRef(), N, Fl, C);  // [N,C]
  y = part_->reduce_partial(s.partial, s.local, N, C);                                               // [Nl,C]
  if (!whole) be_.bias_add(y, w.fcprojb, Nl, C);
  be_.residual_forward(xout, a.xmid, y, static_cast<std::int64_t>(Nl) * C);
  store_->release(unit, ParamStore::Use::forward);
}

// s.dres [Nl,C]: gradient of the block's output on entry, of its input on return.
void GPT::block_backward(int chunk, int slot, int l, int B) {
  const int T = T_, C = cfg_.d_model, N = B * T, Nl = sp_ ? N / tp_ : N;
  const int Cl = C / tp_, Fl = 4 * C / tp_, NHl = cfg_.heads / tp_;
  if (cfg_.recompute) block_forward(chunk, slot, l, B, true);  // rebuild this block's activations from its saved input
  const int unit = block_unit_[static_cast<std::size_t>(l)];
  const int next = l > stage_.chunks[chunk].first_layer ? block_unit_[static_cast<std::size_t>(l - 1)]
                   : holds_embeddings(chunk)            ? emb_unit_
                                                        : -1;
  if (cfg_.llama()) return llama_block_backward(chunk, slot, l, B, next);
  const ParamStore::UnitView& view = store_->acquire(unit, ParamStore::Use::backward, next);
  const BlockParams w = block_params(view, l, false);
  const BlockParams dw = block_params(view, l, true);
  const BlockActs a = block_acts(chunk, slot, l);
  const Scratch s = scratch();
  // dres holds the gradient of the block's output, then of xmid, then of its input: each residual
  // add's backward is LayerNorm's backward accumulating into it in place (layernorm_backward's dinp is
  // +=), once every reader of the earlier gradient has run; no copy of the residual branch.
  const BufferRef& dres = s.dres;

  // MLP, in reverse: x_out = xmid + fcproj(gelu(fc(ln2(xmid))))
  // Without tensor parallelism dy is dres itself: the row-parallel biases' gradients come with the
  // product's backward (with the rounded copy of dy on the same pass); with it, from this rank's rows.
  const bool whole = part_->size() == 1;
  BufferRef dy = part_->grad_to_full(dres, s.dfull, N, C);  // [N,C]
  if (cfg_.moe_layer(l)) {
    moe_backward(view, a, s, dy, chunk, slot, l, N);
  } else {
    be_.matmul_backward(s.dfch_gelu, dw.fcprojw, whole ? dw.fcprojb : BufferRef(), dy, a.fch_gelu, w.mfcprojw, N, Fl,
                        C);
    if (!whole) be_.bias_backward(dw.fcprojb, dres, Nl, C);
    be_.gelu_bias_backward(s.dfch, dw.fcb, a.fch, s.dfch_gelu, N, Fl);
    be_.matmul_backward(s.dpartial, dw.fcw, {}, s.dfch, input_of(a.ln2, s.full, N, C), w.mfcw, N, C, Fl);
  }
  const BufferRef dln2 = part_->reduce_partial_grad(s.dpartial, s.dlocal, N, C);                        // [Nl,C]
  be_.layernorm_backward(dres, dw.ln2w, dw.ln2b, dln2, a.xmid, w.ln2w, a.ln2_mean, a.ln2_rstd, Nl, C);  // d xmid
  // attention, in reverse: xmid = x + proj(attention(qkv(ln1(x))))
  dy = part_->grad_to_full(dres, s.dfull, N, C);
  be_.matmul_backward(s.datty, dw.projw, whole ? dw.projb : BufferRef(), dy, a.atty, w.mprojw, N, Cl, C);
  if (!whole) be_.bias_backward(dw.projb, dres, Nl, C);
  attention_backward(a, s, B, T, Cl, NHl);
  be_.matmul_backward(s.dpartial, dw.qkvw, dw.qkvb, s.dqkv, input_of(a.ln1, s.full, N, C), w.mqkvw, N, C, 3 * Cl);
  const BufferRef dln1 = part_->reduce_partial_grad(s.dpartial, s.dlocal, N, C);
  be_.layernorm_backward(dres, dw.ln1w, dw.ln1b, dln1, residual(chunk, slot, l), w.ln1w, a.ln1_mean, a.ln1_rstd, Nl,
                         C);  // d x
  store_->release(unit, ParamStore::Use::backward);
}

// Llama's block: x + proj(attention(rope(q, k, v)(rmsnorm(x)))), then + down(silu(gate) * up)(rmsnorm(.)).
// Column-parallel q, k, v, gate and up (k and v whole on every rank where tp does not divide the kv
// heads), row-parallel proj and down, as GPT-2's block; no biases.
void GPT::llama_block_forward(int chunk, int slot, int l, int B, int next) {
  const int T = T_, C = cfg_.d_model, N = B * T, Nl = sp_ ? N / tp_ : N, hs = cfg_.head_size();
  const int Cl = C / tp_, Fl = cfg_.ffn() / tp_, NHl = cfg_.heads / tp_, KVl = kv_local(), CKl = KVl * hs;
  const std::int64_t NlC = static_cast<std::int64_t>(Nl) * C;
  const int unit = block_unit_[static_cast<std::size_t>(l)];
  const LlamaParams w = llama_params(store_->acquire(unit, ParamStore::Use::forward, next), l, false);
  const BlockActs a = block_acts(chunk, slot, l);
  const Scratch s = scratch();
  const BufferRef x = residual(chunk, slot, l);
  const BufferRef xout = residual(chunk, slot, l + 1);
  be_.rmsnorm_forward(a.ln1, a.ln1_rstd, x, w.ln1w, Nl, C, cfg_.norm_eps);
  const BufferRef in = input_of(a.ln1, s.full, N, C);
  be_.matmul_forward(s.q, in, w.mqw, {}, N, C, Cl);
  be_.matmul_forward(s.k, in, w.mkw, {}, N, C, CKl);
  be_.matmul_forward(s.v, in, w.mvw, {}, N, C, CKl);
  be_.rope_gqa_forward(a.qkv, s.q, s.k, s.v, N, T, NHl, KVl, hs, tp_rank_ * NHl, kv_head0(), cfg_.heads / cfg_.kv(),
                       cfg_.rope_theta);
  attention(a, s, B, T, Cl, NHl);
  be_.matmul_forward(s.partial, a.atty, w.mprojw, {}, N, Cl, C);
  be_.residual_forward(a.xmid, x, part_->reduce_partial(s.partial, s.local, N, C), NlC);
  be_.rmsnorm_forward(a.ln2, a.ln2_rstd, a.xmid, w.ln2w, Nl, C, cfg_.norm_eps);
  const BufferRef in2 = input_of(a.ln2, s.full, N, C);
  be_.matmul_forward(a.fch, in2, w.mgatew, {}, N, C, Fl);
  be_.matmul_forward(a.fcu, in2, w.mupw, {}, N, C, Fl);
  be_.swiglu_forward(a.fch_gelu, a.fch, a.fcu, static_cast<std::int64_t>(N) * Fl);
  be_.matmul_forward(s.partial, a.fch_gelu, w.mdownw, {}, N, Fl, C);
  be_.residual_forward(xout, a.xmid, part_->reduce_partial(s.partial, s.local, N, C), NlC);
  store_->release(unit, ParamStore::Use::forward);
}

// s.dres: the gradient of the block's output on entry, of its input on return (RMSNorm's backward adds
// into it, as LayerNorm's does). A sum of input gradients of several products (q, k, v; gate, up)
// goes through s.dfull, free once the output projection's backward has read dy.
void GPT::llama_block_backward(int chunk, int slot, int l, int B, int next) {
  const int T = T_, C = cfg_.d_model, N = B * T, Nl = sp_ ? N / tp_ : N, hs = cfg_.head_size();
  const int Cl = C / tp_, Fl = cfg_.ffn() / tp_, NHl = cfg_.heads / tp_, KVl = kv_local(), CKl = KVl * hs;
  const std::int64_t NC = static_cast<std::int64_t>(N) * C;
  const int unit = block_unit_[static_cast<std::size_t>(l)];
  const ParamStore::UnitView& view = store_->acquire(unit, ParamStore::Use::backward, next);
  const LlamaParams w = llama_params(view, l, false);
  const LlamaParams dw = llama_params(view, l, true);
  const BlockActs a = block_acts(chunk, slot, l);
  const Scratch s = scratch();
  const BufferRef& dres = s.dres;
  // MLP
  BufferRef dy = part_->grad_to_full(dres, s.dfull, N, C);
  be_.matmul_backward(s.dfch_gelu, dw.downw, {}, dy, a.fch_gelu, w.mdownw, N, Fl, C);
  be_.swiglu_backward(s.dfch, s.dfcu, s.dfch_gelu, a.fch, a.fcu, static_cast<std::int64_t>(N) * Fl);
  const BufferRef in2 = input_of(a.ln2, s.full, N, C);
  be_.matmul_backward(s.dpartial, dw.gatew, {}, s.dfch, in2, w.mgatew, N, C, Fl);
  be_.matmul_backward(s.dfull, dw.upw, {}, s.dfcu, in2, w.mupw, N, C, Fl);
  be_.residual_forward(s.dpartial, s.dpartial, s.dfull, NC);
  const BufferRef dln2 = part_->reduce_partial_grad(s.dpartial, s.dlocal, N, C);
  be_.rmsnorm_backward(dres, dw.ln2w, dln2, a.xmid, w.ln2w, a.ln2_rstd, Nl, C);  // d xmid
  // attention
  dy = part_->grad_to_full(dres, s.dfull, N, C);
  be_.matmul_backward(s.datty, dw.projw, {}, dy, a.atty, w.mprojw, N, Cl, C);
  attention_backward(a, s, B, T, Cl, NHl);
  be_.rope_gqa_backward(s.q, s.k, s.v, s.dqkv, N, T, NHl, KVl, hs, tp_rank_ * NHl, kv_head0(), cfg_.heads / cfg_.kv(),
                        cfg_.rope_theta);
  const BufferRef in = input_of(a.ln1, s.full, N, C);
  be_.matmul_backward(s.dpartial, dw.qw, {}, s.q, in, w.mqw, N, C, Cl);
  be_.matmul_backward(s.dfull, dw.kw, {}, s.k, in, w.mkw, N, C, CKl);
  be_.residual_forward(s.dpartial, s.dpartial, s.dfull, NC);
  be_.matmul_backward(s.dfull, dw.vw, {}, s.v, in, w.mvw, N, C, CKl);
  be_.residual_forward(s.dpartial, s.dpartial, s.dfull, NC);
  const BufferRef dln1 = part_->reduce_partial_grad(s.dpartial, s.dlocal, N, C);
  be_.rmsnorm_backward(dres, dw.ln1w, dln1, residual(chunk, slot, l), w.ln1w, a.ln1_rstd, Nl, C);  // d x
  store_->release(unit, ParamStore::Use::backward);
}

double GPT::forward(const std::int32_t* inputs, const std::int32_t* targets, int B, std::optional<float> dloss) {
  if (!stage_.first() || !stage_.last()) throw std::logic_error("GPT::forward on a pipeline stage: use forward_stage");
  return forward_stage(0, inputs, nullptr, targets, B, 0, dloss);
}

void GPT::backward(float dloss) { backward_stage(0, dloss, nullptr); }

double GPT::forward_stage(int slot, const std::int32_t* inputs, const float* x_in, const std::int32_t* targets, int B,
                          int chunk, std::optional<float> dloss) {
  if (B < 1 || B > max_rows_)
    throw std::logic_error("GPT::forward: " + std::to_string(B) + " rows, allocated for " + std::to_string(max_rows_));
  check_slot(chunk, slot, "forward");
  slot_rows_[chunk][slot] = B;
  slot_scored_[chunk][slot] = targets != nullptr;
  training_forward_ = dloss.has_value();
  const int T = T_, C = cfg_.d_model, N = B * T, Nl = sp_ ? N / tp_ : N;
  const int l0 = stage_.chunks[chunk].first_layer, l1 = stage_.chunks[chunk].end_layer;
  const std::int64_t rows = static_cast<std::int64_t>(max_rows_) * T;
  const BufferRef inp = tokens_buf_.ref().slice(static_cast<std::int64_t>(slot) * 2 * rows, N);
  const BufferRef tgt = tokens_buf_.ref().slice(static_cast<std::int64_t>(slot) * 2 * rows + rows, N);
  const Scratch s = scratch();

  if (holds_embeddings(chunk)) {
    // Embedding: each rank looks up its vocabulary rows (zeros elsewhere); rank 0 adds positions.
    be_.copy_from_host(inp, inputs);
    const ParamStore::UnitView& e =
        store_->acquire(emb_unit_, ParamStore::Use::forward, block_unit_[static_cast<std::size_t>(l0)]);
    const BufferRef& wte = tensor(e, wte_);                     // [Vl,C] this rank's vocabulary rows
    BufferRef wpe = wpe_ >= 0 ? tensor(e, wpe_) : BufferRef();  // [T,C] (Llama: none)
    if (wpe_ >= 0 && ctx_->size() > 1) {  // this rank's two chunks of positions, in its local order
      for (int half = 0; half < 2; ++half) {
        const std::int64_t rows = T / 2, first = ctx_->position(half * T / 2, cfg_.seq_len);
        be_.copy(s.pos.slice(half * rows * C, rows * C), wpe.slice(first * C, rows * C), rows * C);
      }
      wpe = s.pos;
    }
    be_.encoder_forward(s.partial, inp, wte, wpe, B, T, C, vocab_begin_, vocab_begin_ + vocab_local_,
                        tp_rank_ == 0 && wpe_ >= 0);
    store_->release(emb_unit_, ParamStore::Use::forward);
    be_.copy(residual(chunk, slot, l0), part_->reduce_partial(s.partial, s.local, N, C),
             static_cast<std::int64_t>(Nl) * C);
  } else {
    const std::int64_t n = static_cast<std::int64_t>(Nl) * C;
    be_.copy(residual(chunk, slot, l0), here(x_in, n), n);  // the previous chunk's output
  }
  for (int l = l0; l < l1; ++l) {
    block_forward(chunk, slot, l, B);
    if (progress_) progress_();
  }
  if (!holds_head(chunk)) return 0.0;

  if (targets) be_.copy_from_host(tgt, targets);
  const bool wte_apart = head_weight_unit() != head_unit_;  // the tied weight sits in the embeddings unit
  const ParamStore::UnitView& hv = store_->acquire(head_unit_, ParamStore::Use::forward, wte_apart ? emb_unit_ : -1);
  const BufferRef wte =
      matmul_operand(wte_apart ? store_->acquire(emb_unit_, ParamStore::Use::forward, -1) : hv, head_w_);
  const BufferRef& lnfw = tensor(hv, lnfw_);
  const Head h = head(slot);
  if (cfg_.llama())
    be_.rmsnorm_forward(h.lnf, h.lnf_rstd, residual(chunk, slot, l1), lnfw, Nl, C, cfg_.norm_eps);
  else
    be_.layernorm_forward(h.lnf, h.lnf_mean, h.lnf_rstd, residual(chunk, slot, l1), lnfw, tensor(hv, lnfb_), Nl, C);
  be_.matmul_forward(h.logits, input_of(h.lnf, s.full, N, C), wte, {}, N, C, vocab_local_);  // tied head: [N,Vl]
  slot_dloss_[static_cast<std::size_t>(slot)] = std::numeric_limits<float>::quiet_NaN();
  if (targets && dloss) {  // the fused classifier: the loss and its gradient, no probabilities
    part_->crossentropy_fused(be_, h.losses, h.dlogits, h.logits, tgt, *dloss / static_cast<float>(N), N, vocab_local_,
                              vocab_begin_);
    slot_dloss_[static_cast<std::size_t>(slot)] = *dloss;
  } else if (targets) {
    part_->crossentropy_forward(be_, h.losses, h.probs, h.logits, tgt, N, vocab_local_, vocab_begin_);
  }
  probs_slot_ = slot;  // (what the shared logits table holds under mixed precision)
  if (wte_apart) store_->release(emb_unit_, ParamStore::Use::forward);
  store_->release(head_unit_, ParamStore::Use::forward);
  return targets ? be_.sum(h.losses, N) / N : 0.0;  // without targets the logits stay (sampling)
}

const float* GPT::backward_stage(int slot, float dloss, const float* dout, int chunk) {
  check_slot(chunk, slot, "backward");
  if (slot_rows_[chunk][slot] == 0)
    throw std::logic_error("GPT::backward: no forward held in slot " + std::to_string(slot) + " of chunk " +
                           std::to_string(chunk));
  const int B = slot_rows_[chunk][slot], T = T_, C = cfg_.d_model, N = B * T, Nl = sp_ ? N / tp_ : N;
  const int l0 = stage_.chunks[chunk].first_layer, l1 = stage_.chunks[chunk].end_layer;
  const std::int64_t rows = static_cast<std::int64_t>(max_rows_) * T;
  const BufferRef inp = tokens_buf_.ref().slice(static_cast<std::int64_t>(slot) * 2 * rows, N);
  const BufferRef tgt = tokens_buf_.ref().slice(static_cast<std::int64_t>(slot) * 2 * rows + rows, N);
  const Scratch s = scratch();
  backward_dloss_ = dloss;    // the experts' auxiliary losses are scaled as the loss is
  training_forward_ = false;  // a recomputed forward is not counted again

  if (holds_head(chunk)) {
    if (!slot_scored_[chunk][slot])
      throw std::logic_error("GPT::backward: the forward held in slot " + std::to_string(slot) +
                             " had no targets, so no loss");
    const int next = l1 > l0 ? block_unit_[static_cast<std::size_t>(l1 - 1)] : -1;
    const bool wte_apart = head_weight_unit() != head_unit_;
    const ParamStore::UnitView& hv =
        store_->acquire(head_unit_, ParamStore::Use::backward, wte_apart ? emb_unit_ : next);
    const ParamStore::UnitView& wv = wte_apart ? store_->acquire(emb_unit_, ParamStore::Use::backward, next) : hv;
    const BufferRef wte = matmul_operand(wv, head_w_);
    const BufferRef& lnfw = tensor(hv, lnfw_);
    const BufferRef& dwte = tensor_grad(wv, head_w_);
    const BufferRef& dlnfw = tensor_grad(hv, lnfw_);
    const Head h = head(slot);
    const float fused = slot_dloss_[static_cast<std::size_t>(slot)];
    if (!std::isnan(fused)) {  // the forward made dlogits: it must have been told this backward's dloss
      if (fused != dloss)
        throw std::logic_error("GPT::backward: the forward held in slot " + std::to_string(slot) +
                               " made the classifier's gradient for dloss " + std::to_string(fused) + ", not " +
                               std::to_string(dloss));
    } else {
      if (mm16_ != DType::f32 && probs_slot_ != slot)
        throw std::logic_error("GPT::backward: slot " + std::to_string(slot) +
                               "'s probabilities were overwritten by a later forward (under mixed precision the "
                               "slots share one logits table: forward with dloss)");
      part_->crossentropy_backward(be_, h.dlogits, h.probs, tgt, dloss / static_cast<float>(N), N, vocab_local_,
                                   vocab_begin_);
    }
    be_.matmul_backward(s.dpartial, dwte, {}, h.dlogits, input_of(h.lnf, s.full, N, C), wte, N, C, vocab_local_);
    const BufferRef dlnf = part_->reduce_partial_grad(s.dpartial, s.dlocal, N, C);  // [Nl,C]
    be_.fill(s.dres.slice(0, static_cast<std::int64_t>(Nl) * C), 0.0);
    if (cfg_.llama())
      be_.rmsnorm_backward(s.dres, dlnfw, dlnf, residual(chunk, slot, l1), lnfw, h.lnf_rstd, Nl, C);
    else
      be_.layernorm_backward(s.dres, dlnfw, tensor_grad(hv, lnfb_), dlnf, residual(chunk, slot, l1), lnfw, h.lnf_mean,
                             h.lnf_rstd, Nl, C);
    if (wte_apart) store_->release(emb_unit_, ParamStore::Use::backward);
    store_->release(head_unit_, ParamStore::Use::backward);
    if (grad_ready_) grad_ready_(head_unit_);  // ln_f, and the shadow of wte on a last stage
  } else {
    const std::int64_t n = static_cast<std::int64_t>(Nl) * C;
    be_.copy(s.dres, here(dout, n), n);  // from the next chunk
  }
  for (int l = l1 - 1; l >= l0; --l) {
    block_backward(chunk, slot, l, B);
    if (grad_ready_) grad_ready_(block_unit_[static_cast<std::size_t>(l)]);
    if (progress_) progress_();
  }
  slot_rows_[chunk][slot] = 0;
  if (!holds_embeddings(chunk)) return s.dres.as<const float>();  // to the previous chunk

  const ParamStore::UnitView& e = store_->acquire(emb_unit_, ParamStore::Use::backward, -1);
  const BufferRef& dwte = tensor_grad(e, wte_);
  const BufferRef dwpe = wpe_ >= 0 ? tensor_grad(e, wpe_) : BufferRef();
  const BufferRef demb = part_->grad_to_full(s.dres, s.dfull, N, C);  // [N,C]
  if (dwpe.data && ctx_->size() > 1) {  // the local positions' gradient, added into their rows of dwpe
    be_.fill(s.dpos, 0.0);
    be_.encoder_backward(dwte, s.dpos, demb, inp, B, T, C, vocab_begin_, vocab_begin_ + vocab_local_);
    for (int half = 0; half < 2; ++half) {
      const std::int64_t rows = T / 2, first = ctx_->position(half * T / 2, cfg_.seq_len);
      be_.axpy(dwpe.slice(first * C, rows * C), 1.0f, s.dpos.slice(half * rows * C, rows * C), rows * C);
    }
  } else {
    be_.encoder_backward(dwte, dwpe, demb, inp, B, T, C, vocab_begin_, vocab_begin_ + vocab_local_);
  }
  store_->release(emb_unit_, ParamStore::Use::backward);
  if (grad_ready_) grad_ready_(emb_unit_);  // wte (tied head included), wpe
  return nullptr;
}

GPT::Head GPT::head(int slot) const {
  Head h = carve_head(geom_, head_buf_.data<float>() + slot * head_floats_);
  if (mm16_ != DType::f32)
    h.logits = h.probs = BufferRef(head_buf_.data<float>() + head_logits_at_, DType::f32, h.dlogits.count, be_.space());
  return h;
}

void GPT::zero_grad() { store_->zero_grads(); }

double GPT::flops_per_token() const { return cfg_.flops_per_token(); }

}  // namespace loom
