// Hugging Face's LlamaForCausalLM files: names, config.json, and the deck keys they answer to.
#include <sstream>

#include "io/hf_arch.hpp"

namespace loom::hf {

std::vector<Tensor> llama_tensors(const GPTConfig& cfg) {
  const std::int64_t C = cfg.d_model, V = cfg.vocab, F = cfg.ffn(), CK = std::int64_t(cfg.kv()) * cfg.head_size();
  using Form = Tensor::Form;
  std::vector<Tensor> t = {{"wte.weight", "model.embed_tokens.weight", {V, C}}};
  const Tensor block[] = {{"ln1.weight", "input_layernorm.weight", {C}},
                          {"attn.q.weight", "self_attn.q_proj.weight", {C, C}, Form::rotary_q},
                          {"attn.k.weight", "self_attn.k_proj.weight", {CK, C}, Form::rotary_k},
                          {"attn.v.weight", "self_attn.v_proj.weight", {CK, C}},
                          {"attn.proj.weight", "self_attn.o_proj.weight", {C, C}},
                          {"ln2.weight", "post_attention_layernorm.weight", {C}},
                          {"mlp.gate.weight", "mlp.gate_proj.weight", {F, C}},
                          {"mlp.up.weight", "mlp.up_proj.weight", {F, C}},
                          {"mlp.down.weight", "mlp.down_proj.weight", {C, F}}};
  for (int l = 0; l < cfg.layers; ++l)
    for (Tensor b : block) {
      b.ours = "blocks." + std::to_string(l) + "." + b.ours;
      b.theirs = "model.layers." + std::to_string(l) + "." + b.theirs;
      t.push_back(b);
    }
  t.push_back({"ln_f.weight", "model.norm.weight", {C}});
  if (!cfg.tied()) t.push_back({"lm_head.weight", "lm_head.weight", {V, C}});
  return t;
}

nlohmann::json llama_config(const GPTConfig& cfg) {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"hidden_size", cfg.d_model},
          {"intermediate_size", cfg.ffn()},
          {"num_hidden_layers", cfg.layers},
          {"num_attention_heads", cfg.heads},
          {"num_key_value_heads", cfg.kv()},
          {"head_dim", cfg.head_size()},
          {"max_position_embeddings", cfg.seq_len},
          {"vocab_size", cfg.vocab},
          {"rms_norm_eps", static_cast<double>(cfg.norm_eps)},
          {"rope_theta", static_cast<double>(cfg.rope_theta)},
          {"rope_scaling", nullptr},
          {"tie_word_embeddings", cfg.tied()},
          {"hidden_act", "silu"},
          {"attention_bias", false},
          {"mlp_bias", false},
          {"torch_dtype", "float32"}};
}

GPTConfig llama_from_config(const ConfigFile& f) {
  if (f.has("rope_scaling"))
    f.fail("rope_scaling = " + f.c["rope_scaling"].dump() + ": loom's rotary embeddings have no scaling");
  GPTConfig g;
  g.arch = GPTConfig::Arch::llama;
  g.d_model = f.integer("hidden_size");
  g.layers = f.integer("num_hidden_layers");
  g.heads = f.integer("num_attention_heads");
  g.kv_heads = f.c.contains("num_key_value_heads") ? f.integer("num_key_value_heads") : g.heads;
  g.ffn_hidden = f.integer("intermediate_size");
  g.vocab = f.integer("vocab_size");
  g.seq_len = f.integer("max_position_embeddings");
  g.norm_eps = static_cast<float>(f.number("rms_norm_eps", 1e-6));
  g.rope_theta = static_cast<float>(f.number("rope_theta", 10000));
  g.tie_embeddings = f.boolean("tie_word_embeddings", false) ? 1 : 0;
  if (g.d_model % g.heads != 0 || g.heads % g.kv() != 0 || g.head_size() % 2 != 0 ||
      (f.has("head_dim") && f.integer("head_dim") != g.head_size()))
    f.fail("hidden_size " + std::to_string(g.d_model) + ", num_attention_heads " + std::to_string(g.heads) +
           ", num_key_value_heads " + std::to_string(g.kv()) +
           ": not a shape loom builds (heads of an even size hidden_size / num_attention_heads, kv heads "
           "dividing the heads)");
  return g;
}

std::string llama_differences(const GPTConfig& deck, const GPTConfig& f) {
  auto s = [](double v) {
    std::ostringstream o;
    o << static_cast<float>(v);
    return o.str();
  };
  std::string bad;
  differ(bad, "model.layers", std::to_string(deck.layers), "num_hidden_layers", std::to_string(f.layers));
  differ(bad, "model.d_model", std::to_string(deck.d_model), "hidden_size", std::to_string(f.d_model));
  differ(bad, "model.heads", std::to_string(deck.heads), "num_attention_heads", std::to_string(f.heads));
  differ(bad, "model.kv_heads", std::to_string(deck.kv()), "num_key_value_heads", std::to_string(f.kv()));
  differ(bad, "model.ffn_hidden", std::to_string(deck.ffn()), "intermediate_size", std::to_string(f.ffn()));
  differ(bad, "model.vocab", std::to_string(deck.vocab), "vocab_size", std::to_string(f.vocab));
  differ(bad, "model.norm_eps", s(deck.norm_eps), "rms_norm_eps", s(f.norm_eps));
  differ(bad, "model.rope_theta", s(deck.rope_theta), "rope_theta", s(f.rope_theta));
  differ(bad, "model.tie_embeddings", deck.tied() ? "true" : "false", "tie_word_embeddings",
         f.tied() ? "true" : "false");
  if (deck.seq_len > f.seq_len)
    bad += std::string(bad.empty() ? "" : "; ") + "model.seq_len = " + std::to_string(deck.seq_len) +
           " in the deck is longer than max_position_embeddings = " + std::to_string(f.seq_len) + " in config.json";
  return bad;
}

}  // namespace loom::hf
