#pragma once
// llm.c's files (github.com/karpathy/llm.c): the model file its train_gpt2.py writes and
// train_gpt2.c reads (gpt2_124M.bin), and its tokenizer file (gpt2_tokenizer.bin), so that weights
// come into loom from elsewhere (model.init_from) and go back out (`loom ckpt llmc`).
//
// Model file: 256 int32 header [magic 20240326, version (3: fp32, 5: bf16), max_seq_len, vocab_size,
// num_layers, num_heads, channels, padded_vocab_size, 0...], then the tensors in this order, each
// layer-stacked, weights in torch.nn.Linear's [out, in] layout (loom's too):
//   wte [Vp,C] (rows past vocab_size are padding)  wpe [maxT,C]
//   ln1w [L,C] ln1b [L,C] qkvw [L,3C,C] qkvb [L,3C] attprojw [L,C,C] attprojb [L,C]
//   ln2w [L,C] ln2b [L,C] fcw [L,4C,C] fcb [L,4C] fcprojw [L,C,4C] fcprojb [L,C]  lnfw [C] lnfb [C]
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/model/gpt.hpp"

namespace loom {

inline constexpr std::int32_t kLlmcModelMagic = 20240326;
inline constexpr std::int32_t kLlmcTokenizerMagic = 20240328;

struct LlmcModel {
  int version = 3, max_seq_len = 0, vocab = 0, padded_vocab = 0, layers = 0, heads = 0, channels = 0;
  // Every tensor under loom's name and in loom's shape ("wte.weight" [vocab, C] without the padding,
  // "wpe.weight" [max_seq_len, C], "blocks.<l>.attn.qkv.weight" [3C, C], ...), as fp32.
  std::map<std::string, std::vector<float>> tensors;
};

// Reads and checks a model file (magic, version, sizes, the file's length); InputError naming the
// file and what is wrong.
LlmcModel read_llmc_model(const std::string& path);
// Refuses a file whose model is not the deck's, naming both: layers, d_model, heads and vocab must be
// equal; the deck's seq_len at most the file's max_seq_len (the first seq_len positions are used, as
// llm.c does for a shorter sequence).
void check_llmc_model(const LlmcModel& m, const GPTConfig& cfg, const std::string& path);
// model.init_from: the file read and checked against the deck's model, errors naming the key. A
// directory is Hugging Face's files (io/hf.hpp: config.json, model.safetensors), read the same way.
LlmcModel read_init_from(const std::string& path, const GPTConfig& cfg);
// Writes `cfg`'s model as a version-3 (fp32) file: max_seq_len = seq_len, the vocabulary padded to a
// multiple of 128 with zero rows (as llm.c's train_gpt2.py does). `tensor(name)` gives each whole
// tensor in loom's shape. Written to path.tmp, then renamed.
void write_llmc_model(const std::string& path, const GPTConfig& cfg,
                      const std::function<const std::vector<float>&(const std::string& name)>& tensor);
// The tokenizer file: token id -> its bytes.
std::vector<std::string> read_llmc_tokenizer(const std::string& path);

}  // namespace loom
