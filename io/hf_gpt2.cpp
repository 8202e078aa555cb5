// Hugging Face's GPT2LMHeadModel files: names, config.json, and the deck keys they answer to.
//
// transformers' GPT-2 keeps its products as Conv1D, y = x W + b with W [in, out]: the transpose of
// loom's torch.nn.Linear layout [out, in]. c_attn's out is q, k, v one after another, each head's
// channels together ([q_0 .. q_NH-1, k_0 .., v_0 ..]): loom's qkv rows in the same order, so the
// transpose is the whole mapping. Both scale scores by 1/sqrt(head size), use the tanh GELU
// ("gelu_new"), LayerNorm eps 1e-5 and no bias in the head (the token table, tied).
#include "io/hf_arch.hpp"

namespace loom::hf {

std::vector<Tensor> gpt2_tensors(const GPTConfig& cfg) {
  const std::int64_t C = cfg.d_model, V = cfg.vocab, T = cfg.seq_len, F = cfg.ffn();
  const Tensor::Form conv1d = Tensor::Form::transposed;
  std::vector<Tensor> t = {{"wte.weight", "transformer.wte.weight", {V, C}},
                           {"wpe.weight", "transformer.wpe.weight", {T, C}}};
  const Tensor block[] = {{"ln1.weight", "ln_1.weight", {C}},
                          {"ln1.bias", "ln_1.bias", {C}},
                          {"attn.qkv.weight", "attn.c_attn.weight", {3 * C, C}, conv1d},
                          {"attn.qkv.bias", "attn.c_attn.bias", {3 * C}},
                          {"attn.proj.weight", "attn.c_proj.weight", {C, C}, conv1d},
                          {"attn.proj.bias", "attn.c_proj.bias", {C}},
                          {"ln2.weight", "ln_2.weight", {C}},
                          {"ln2.bias", "ln_2.bias", {C}},
                          {"mlp.fc.weight", "mlp.c_fc.weight", {F, C}, conv1d},
                          {"mlp.fc.bias", "mlp.c_fc.bias", {F}},
                          {"mlp.proj.weight", "mlp.c_proj.weight", {C, F}, conv1d},
                          {"mlp.proj.bias", "mlp.c_proj.bias", {C}}};
  for (int l = 0; l < cfg.layers; ++l)
    for (Tensor b : block) {
      b.ours = "blocks." + std::to_string(l) + "." + b.ours;
      b.theirs = "transformer.h." + std::to_string(l) + "." + b.theirs;
      t.push_back(b);
    }
  t.push_back({"ln_f.weight", "transformer.ln_f.weight", {C}});
  t.push_back({"ln_f.bias", "transformer.ln_f.bias", {C}});
  // OpenAI's GPT-2 on the Hub was saved from GPT2Model: the same names without "transformer.".
  for (Tensor& x : t) x.alias = x.theirs.substr(std::string("transformer.").size());
  // save_pretrained leaves the tied head out; a file written from a state_dict may repeat it.
  Tensor head{"", "lm_head.weight", {V, C}};
  head.equals = "wte.weight";
  t.push_back(head);
  return t;
}

nlohmann::json gpt2_config(const GPTConfig& cfg) {
  // GPT2Config defaults bos and eos to 50256 (<|endoftext|> of GPT-2's tokenizer): kept for that
  // vocabulary (50257, or llm.c's 50304 padded), null otherwise, where 50256 would name no token.
  const bool gpt2_vocab = cfg.vocab == 50257 || cfg.vocab == 50304;
  const nlohmann::json eot = gpt2_vocab ? nlohmann::json(50256) : nlohmann::json(nullptr);
  return {{"architectures", {"GPT2LMHeadModel"}},
          {"model_type", "gpt2"},
          {"n_embd", cfg.d_model},
          {"n_layer", cfg.layers},
          {"n_head", cfg.heads},
          {"n_inner", nullptr},  // 4 x n_embd, loom's MLP
          {"n_positions", cfg.seq_len},
          {"n_ctx", cfg.seq_len},
          {"vocab_size", cfg.vocab},
          {"layer_norm_epsilon", 1e-5},
          {"activation_function", "gelu_new"},
          {"resid_pdrop", 0.0},
          {"embd_pdrop", 0.0},
          {"attn_pdrop", 0.0},
          {"scale_attn_weights", true},
          {"scale_attn_by_inverse_layer_idx", false},
          {"reorder_and_upcast_attn", false},
          {"initializer_range", 0.02},
          {"tie_word_embeddings", true},
          {"bos_token_id", eot},
          {"eos_token_id", eot},
          {"torch_dtype", "float32"}};
}

GPTConfig gpt2_from_config(const ConfigFile& f) {
  GPTConfig g;
  g.arch = GPTConfig::Arch::gpt2;
  g.d_model = f.integer("n_embd");
  g.layers = f.integer("n_layer");
  g.heads = f.integer("n_head");
  g.seq_len = f.integer("n_positions");
  g.vocab = f.integer("vocab_size");
  if (g.d_model % g.heads != 0)
    f.fail("n_embd " + std::to_string(g.d_model) + " is not a multiple of n_head " + std::to_string(g.heads));
  // What GPT2LMHeadModel can be that loom's GPT-2 block is not: refused by field, never approximated.
  if (f.has("n_inner") && f.integer("n_inner") != 4 * g.d_model)
    f.fail("n_inner = " + f.c["n_inner"].dump() +
           ": loom's GPT-2 MLP is 4 x n_embd = " + std::to_string(4 * g.d_model) + " wide (null)");
  const std::string act = f.string("activation_function", "gelu_new");
  if (act != "gelu_new" && act != "gelu_pytorch_tanh" && act != "gelu_fast")
    f.fail("activation_function = \"" + act +
           "\": loom's GPT-2 uses the tanh approximation of GELU (gelu_new, gelu_pytorch_tanh or gelu_fast)");
  const double eps = f.number("layer_norm_epsilon", 1e-5);
  if (static_cast<float>(eps) != 1e-5f)
    f.fail("layer_norm_epsilon = " + f.c["layer_norm_epsilon"].dump() + ": loom's GPT-2 LayerNorm uses 1e-5");
  if (!f.boolean("scale_attn_weights", true))
    f.fail("scale_attn_weights = false: loom scales attention scores by 1/sqrt(n_embd / n_head)");
  if (f.boolean("scale_attn_by_inverse_layer_idx", false))
    f.fail("scale_attn_by_inverse_layer_idx = true: loom does not scale scores by layer");
  if (f.boolean("add_cross_attention", false)) f.fail("add_cross_attention = true: loom's GPT-2 is decoder-only");
  if (!f.boolean("tie_word_embeddings", true))
    f.fail("tie_word_embeddings = false: loom's GPT-2 head is its token table (transformer.wte.weight)");
  return g;
}

std::string gpt2_differences(const GPTConfig& deck, const GPTConfig& f) {
  std::string bad;
  differ(bad, "model.layers", std::to_string(deck.layers), "n_layer", std::to_string(f.layers));
  differ(bad, "model.d_model", std::to_string(deck.d_model), "n_embd", std::to_string(f.d_model));
  differ(bad, "model.heads", std::to_string(deck.heads), "n_head", std::to_string(f.heads));
  differ(bad, "model.vocab", std::to_string(deck.vocab), "vocab_size", std::to_string(f.vocab));
  if (deck.seq_len > f.seq_len)
    bad += std::string(bad.empty() ? "" : "; ") + "model.seq_len = " + std::to_string(deck.seq_len) +
           " in the deck is longer than n_positions = " + std::to_string(f.seq_len) + " in config.json";
  return bad;
}

}  // namespace loom::hf
