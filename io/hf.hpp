#pragma once
// Hugging Face's files: a folder with model.safetensors and config.json as transformers saves and
// loads LlamaForCausalLM (model.arch = llama) and GPT2LMHeadModel (gpt2), so a model trained here opens
// in transformers (`loom ckpt hf`) and one from there starts a run (model.init_from = DIR).
//
// safetensors: an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
// data_offsets [begin, end)} ..., "__metadata__": {...}}, then the tensors' bytes, row-major. Names
// (io/hf_llama.cpp, io/hf_gpt2.cpp; io/hf_arch.hpp is what the two parts fill):
//   Llama                                            loom
//   model.embed_tokens.weight                        wte.weight
//   model.layers.<l>.input_layernorm.weight          blocks.<l>.ln1.weight
//   model.layers.<l>.self_attn.{q,k,v,o}_proj.weight blocks.<l>.attn.{q,k,v,proj}.weight
//   model.layers.<l>.post_attention_layernorm.weight blocks.<l>.ln2.weight
//   model.layers.<l>.mlp.{gate,up,down}_proj.weight  blocks.<l>.mlp.{gate,up,down}.weight
//   model.norm.weight                                ln_f.weight
//   lm_head.weight                                   lm_head.weight (absent when tied)
//   GPT-2 (Conv1D weights [in, out]: loom's transposed)
//   transformer.{wte,wpe}.weight                     {wte,wpe}.weight
//   transformer.h.<l>.ln_{1,2}.{weight,bias}         blocks.<l>.ln{1,2}.{weight,bias}
//   transformer.h.<l>.attn.c_attn.{weight,bias}      blocks.<l>.attn.qkv.{weight,bias} (q, k, v in order)
//   transformer.h.<l>.attn.c_proj.{weight,bias}      blocks.<l>.attn.proj.{weight,bias}
//   transformer.h.<l>.mlp.c_{fc,proj}.{weight,bias}  blocks.<l>.mlp.{fc,proj}.{weight,bias}
//   transformer.ln_f.{weight,bias}                   ln_f.{weight,bias}
//   (lm_head.weight: never written, as save_pretrained leaves the tied head out; read if it equals wte)
// Rotary convention (Llama): loom turns each head's channel pairs (2i, 2i + 1) (Meta's); transformers
// turns (i, i + hs/2) (rotate_half). The q and k rows are permuted between the two on the way out and
// back, as transformers' own convert_llama_weights_to_hf does: HF row h*hs + p*hs/2 + i = loom row
// h*hs + 2i + p.
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

// Writes DIR/model.safetensors (fp32) and DIR/config.json for `cfg`'s model (DIR is made if missing;
// each file written to .tmp, then renamed). `tensor(name)` gives each whole tensor in loom's shape.
// InputError for an unwritable DIR.
void write_hf_model(const std::string& dir, const GPTConfig& cfg,
                    const std::function<const std::vector<float>&(const std::string& name)>& tensor);
// Reads and checks DIR (config.json: a llama with no rope scaling, or a gpt2 that loom's GPT-2 block
// computes; model.safetensors: F32, BF16 or F16 tensors, every one the config needs, each of its
// shape, inside the file). InputError naming the file and what is wrong.
HfModel read_hf_model(const std::string& dir);
// Refuses a model that is not the deck's (another model.arch, or sizes), naming the deck key and the
// config.json field of each difference.
void check_hf_model(const HfModel& m, const GPTConfig& deck, const std::string& dir);
// `loom ckpt hf --tokenizer FILE`: the SentencePiece model FILE copied to DIR/tokenizer.model beside a
// tokenizer_config.json that transformers loads it by (io/hf_tokenizer.cpp); returns what it wrote, for
// the command to print. InputError naming FILE when it is missing, empty, not a SentencePiece model
// (a protobuf of pieces) or holds more pieces than cfg.vocab.
std::string write_hf_tokenizer(const std::string& dir, const std::string& model_file, const GPTConfig& cfg);
// The permutation of one [heads * hs, C] q or k weight between loom's and transformers' rotary order.
std::vector<float> permute_rotary_rows(const std::vector<float>& w, int heads, int hs, int C, bool to_hf);

}  // namespace loom
