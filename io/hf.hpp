#pragma once
// Hugging Face's files for a Llama (model.arch = llama): a folder with model.safetensors and
// config.json as transformers' LlamaForCausalLM saves and loads them, so a model trained here opens in
// transformers (`loom ckpt hf`) and one from there starts a run (model.init_from = DIR).
//
// safetensors: an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
// data_offsets [begin, end)} ..., "__metadata__": {...}}, then the tensors' bytes, row-major. Names:
//   model.embed_tokens.weight                       wte.weight
//   model.layers.<l>.input_layernorm.weight         blocks.<l>.ln1.weight
//   model.layers.<l>.self_attn.{q,k,v,o}_proj.weight blocks.<l>.attn.{q,k,v,proj}.weight
//   model.layers.<l>.post_attention_layernorm.weight blocks.<l>.ln2.weight
//   model.layers.<l>.mlp.{gate,up,down}_proj.weight  blocks.<l>.mlp.{gate,up,down}.weight
//   model.norm.weight                               ln_f.weight
//   lm_head.weight                                  lm_head.weight (absent when tied)
// Rotary convention: loom turns each head's channel pairs (2i, 2i + 1) (Meta's); transformers turns
// (i, i + hs/2) (rotate_half). The q and k rows are permuted between the two on the way out and back,
// as transformers' own convert_llama_weights_to_hf does: HF row h*hs + p*hs/2 + i = loom row h*hs + 2i + p.
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/model/gpt.hpp"

namespace loom {

struct HfModel {
  GPTConfig cfg;  // from config.json
  // Every tensor under loom's name, in loom's layout (q and k rows in loom's rotary order), as fp32.
  std::map<std::string, std::vector<float>> tensors;
};

// Writes DIR/model.safetensors (fp32) and DIR/config.json for `cfg`'s Llama (DIR is made if missing;
// each file written to .tmp, then renamed). `tensor(name)` gives each whole tensor in loom's shape.
// InputError for a GPT-2 model or an unwritable DIR.
void write_hf_llama(const std::string& dir, const GPTConfig& cfg,
                    const std::function<const std::vector<float>&(const std::string& name)>& tensor);
// Reads and checks DIR (config.json: a llama with no rope scaling; model.safetensors: F32, BF16 or F16
// tensors, every one the config needs, each of its shape, inside the file). InputError naming the file
// and what is wrong.
HfModel read_hf_llama(const std::string& dir);
// Refuses a model that is not the deck's, naming the deck key and the config.json field of each
// difference.
void check_hf_model(const HfModel& m, const GPTConfig& deck, const std::string& dir);
// The permutation of one [heads * hs, C] q or k weight between loom's and transformers' rotary order.
std::vector<float> permute_rotary_rows(const std::vector<float>& w, int heads, int hs, int C, bool to_hf);

}  // namespace loom
