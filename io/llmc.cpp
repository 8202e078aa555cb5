#include "io/llmc.hpp"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/base/error.hpp"
#include "io/hf.hpp"
#include "io/util.hpp"

namespace loom {
namespace {

// The file's tensors in order: loom's name pattern ("%d" for the layer), and the shape of one
// (per layer for the block tensors).
struct FileTensor {
  const char* name;
  bool per_layer;
};
const FileTensor kOrder[] = {
    {"wte.weight", false},
    {"wpe.weight", false},
    {"blocks.%d.ln1.weight", true},
    {"blocks.%d.ln1.bias", true},
    {"blocks.%d.attn.qkv.weight", true},
    {"blocks.%d.attn.qkv.bias", true},
    {"blocks.%d.attn.proj.weight", true},
    {"blocks.%d.attn.proj.bias", true},
    {"blocks.%d.ln2.weight", true},
    {"blocks.%d.ln2.bias", true},
    {"blocks.%d.mlp.fc.weight", true},
    {"blocks.%d.mlp.fc.bias", true},
    {"blocks.%d.mlp.proj.weight", true},
    {"blocks.%d.mlp.proj.bias", true},
    {"ln_f.weight", false},
    {"ln_f.bias", false},
};

// Elements of one tensor (one layer's, for block tensors) as the file stores it.
std::int64_t file_numel(const std::string& pattern, std::int64_t Vp, std::int64_t maxT, std::int64_t C) {
  if (pattern == "wte.weight") return Vp * C;
  if (pattern == "wpe.weight") return maxT * C;
  if (pattern.find("qkv.weight") != std::string::npos) return 3 * C * C;
  if (pattern.find("qkv.bias") != std::string::npos) return 3 * C;
  if (pattern.find("attn.proj.weight") != std::string::npos) return C * C;
  if (pattern.find("mlp.fc.weight") != std::string::npos || pattern.find("mlp.proj.weight") != std::string::npos)
    return 4 * C * C;
  if (pattern.find("mlp.fc.bias") != std::string::npos) return 4 * C;
  return C;  // LayerNorm weights and biases, the projections' biases
}

std::string layer_name(const char* pattern, int l) {
  char buf[64];
  std::snprintf(buf, sizeof buf, pattern, l);
  return buf;
}

float bf16_to_float(std::uint16_t h) {
  const std::uint32_t bits = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace

LlmcModel read_llmc_model(const std::string& path) {
  const std::string what = "llm.c model file " + quote_path(path);
  require_regular_file(path, "llm.c model file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(what + " cannot be opened (missing or unreadable)");
  std::int32_t h[256] = {};
  if (!in.read(reinterpret_cast<char*>(h), sizeof h))
    throw InputError(what + " is shorter than its 1024-byte header (truncated, or not an llm.c model file)");
  if (h[0] != kLlmcModelMagic)
    throw InputError(what + " has magic " + std::to_string(h[0]) + ", not " + std::to_string(kLlmcModelMagic) +
                     " (not an llm.c model file" + (h[0] == kLlmcTokenizerMagic ? ": it is a tokenizer file)" : ")"));
  LlmcModel m;
  m.version = h[1];
  m.max_seq_len = h[2];
  m.vocab = h[3];
  m.layers = h[4];
  m.heads = h[5];
  m.channels = h[6];
  m.padded_vocab = h[7];
  if (m.version != 3 && m.version != 5)
    throw InputError(what + " has version " + std::to_string(m.version) +
                     "; loom reads versions 3 (fp32) and 5 (bf16), the ones llm.c writes with a padded vocabulary");
  // Bounds as the deck's model.* keys have, before any size is multiplied out.
  if (m.max_seq_len <= 0 || m.vocab <= 0 || m.layers <= 0 || m.heads <= 0 || m.channels <= 0 ||
      m.padded_vocab < m.vocab || m.channels % m.heads != 0 || m.max_seq_len > 1048576 || m.padded_vocab > 1048576 ||
      m.layers > 1024 || m.heads > 1024 || m.channels > 65536)
    throw InputError(what + " has an impossible header: max_seq_len " + std::to_string(m.max_seq_len) +
                     ", vocab_size " + std::to_string(m.vocab) + ", padded_vocab_size " +
                     std::to_string(m.padded_vocab) + ", num_layers " + std::to_string(m.layers) + ", num_heads " +
                     std::to_string(m.heads) + ", channels " + std::to_string(m.channels) + " (corrupt)");
  const std::int64_t C = m.channels, L = m.layers;
  std::int64_t total = 0;
  for (const FileTensor& t : kOrder)
    total += file_numel(t.name, m.padded_vocab, m.max_seq_len, C) * (t.per_layer ? L : 1);
  const std::int64_t elem = m.version == 3 ? 4 : 2;
  std::error_code ec;
  const auto size = static_cast<std::int64_t>(std::filesystem::file_size(path, ec));
  if (ec || size != 1024 + total * elem)
    throw InputError(what + " is " + std::to_string(size) + " bytes; its header (" + std::to_string(m.layers) +
                     " layers, " + std::to_string(C) + " channels, vocabulary " + std::to_string(m.padded_vocab) +
                     " padded, " + std::to_string(m.max_seq_len) + " positions) needs " +
                     std::to_string(1024 + total * elem) + " (truncated or corrupt)");
  std::vector<std::uint16_t> half;
  auto read = [&](float* out, std::int64_t n) {
    if (m.version == 3) {
      in.read(reinterpret_cast<char*>(out), n * 4);
    } else {
      half.resize(static_cast<std::size_t>(n));
      in.read(reinterpret_cast<char*>(half.data()), n * 2);
      for (std::int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(half[static_cast<std::size_t>(i)]);
    }
    if (!in) throw InputError(what + ": read failed (truncated)");
  };
  for (const FileTensor& t : kOrder) {
    const std::int64_t n = file_numel(t.name, m.padded_vocab, m.max_seq_len, C);
    for (int l = 0; l < (t.per_layer ? m.layers : 1); ++l) {
      std::vector<float> v(static_cast<std::size_t>(n));
      read(v.data(), n);
      if (std::string(t.name) == "wte.weight")
        v.resize(static_cast<std::size_t>(m.vocab * C));  // drop the padding rows
      for (float x : v)
        if (!std::isfinite(x))
          throw InputError(what + ": tensor " + layer_name(t.name, l) + " holds non-finite values");
      m.tensors[t.per_layer ? layer_name(t.name, l) : t.name] = std::move(v);
    }
  }
  return m;
}

void check_llmc_model(const LlmcModel& m, const GPTConfig& cfg, const std::string& path) {
  if (cfg.llama())
    throw InputError("model.init_from = " + quote_path(path) +
                     ": an llm.c model file holds GPT-2's block, and this deck's model.arch = llama");
  if (cfg.experts > 0)
    throw InputError("model.init_from = " + quote_path(path) +
                     ": an llm.c model file holds a dense GPT-2, and this "
                     "deck's model.experts = " +
                     std::to_string(cfg.experts));
  std::string bad;
  auto differ = [&](const char* key, int deck, const char* field, int file) {
    if (deck != file)
      bad += std::string(bad.empty() ? "" : "; ") + key + " = " + std::to_string(deck) + " in the deck, " + field +
             " = " + std::to_string(file) + " in the file";
  };
  differ("model.layers", cfg.layers, "num_layers", m.layers);
  differ("model.d_model", cfg.d_model, "channels", m.channels);
  differ("model.heads", cfg.heads, "num_heads", m.heads);
  differ("model.vocab", cfg.vocab, "vocab_size", m.vocab);
  if (cfg.seq_len > m.max_seq_len)
    bad += std::string(bad.empty() ? "" : "; ") + "model.seq_len = " + std::to_string(cfg.seq_len) +
           " in the deck is longer than max_seq_len = " + std::to_string(m.max_seq_len) + " in the file";
  if (!bad.empty())
    throw InputError("model.init_from = " + quote_path(path) + " holds another model: " + bad +
                     " (set the deck's model.* keys to the file's)");
}

LlmcModel read_init_from(const std::string& path, const GPTConfig& cfg) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {  // Hugging Face's files (io/hf.hpp)
    HfModel hf;
    try {
      hf = read_hf_model(path);
    } catch (const InputError& e) {
      throw InputError(std::string("model.init_from: ") + e.what());
    }
    check_hf_model(hf, cfg, path);
    LlmcModel m;
    m.tensors = std::move(hf.tensors);
    return m;
  }
  LlmcModel m;
  try {
    m = read_llmc_model(path);
  } catch (const InputError& e) {
    throw InputError(std::string("model.init_from: ") + e.what());
  }
  check_llmc_model(m, cfg, path);
  return m;
}

void write_llmc_model(const std::string& path, const GPTConfig& cfg,
                      const std::function<const std::vector<float>&(const std::string& name)>& tensor) {
  if (cfg.experts > 0)
    throw InputError(quote_path(path) + ": llm.c's model file holds a dense GPT-2; this checkpoint's model.experts = " +
                     std::to_string(cfg.experts) + " has no llm.c layout");
  if (cfg.llama())
    throw InputError(
        quote_path(path) +
        ": llm.c's model file holds GPT-2's block only; this checkpoint's model.arch = " + "llama has no llm.c layout");
  const std::int64_t C = cfg.d_model, V = cfg.vocab, T = cfg.seq_len;
  const std::int64_t Vp = (V + 127) / 128 * 128;
  std::int32_t h[256] = {};
  h[0] = kLlmcModelMagic;
  h[1] = 3;
  h[2] = cfg.seq_len;
  h[3] = cfg.vocab;
  h[4] = cfg.layers;
  h[5] = cfg.heads;
  h[6] = cfg.d_model;
  h[7] = static_cast<std::int32_t>(Vp);
  const std::string tmp = path + ".tmp";
  std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
  if (!out) throw InputError("cannot write " + quote_path(path) + " (its folder is missing or not writable)");
  struct RemoveUnlessRenamed {  // a write that stops half-way leaves no .tmp behind
    const std::string& file;
    bool done = false;
    ~RemoveUnlessRenamed() {
      if (!done) std::remove(file.c_str());
    }
  } guard{tmp};
  out.write(reinterpret_cast<const char*>(h), sizeof h);
  for (const FileTensor& t : kOrder) {
    const std::int64_t n = file_numel(t.name, Vp, T, C);
    for (int l = 0; l < (t.per_layer ? cfg.layers : 1); ++l) {
      const std::string name = t.per_layer ? layer_name(t.name, l) : t.name;
      const std::vector<float>& v = tensor(name);
      const std::int64_t have = std::string(t.name) == "wte.weight" ? V * C : n;
      if (static_cast<std::int64_t>(v.size()) != have)
        throw std::logic_error("write_llmc_model: " + name + " has " + std::to_string(v.size()) +
                               " elements, expected " + std::to_string(have));
      out.write(reinterpret_cast<const char*>(v.data()), have * 4);
      if (have < n) {
        const std::vector<float> zeros(static_cast<std::size_t>(n - have), 0.0f);
        out.write(reinterpret_cast<const char*>(zeros.data()), (n - have) * 4);
      }
    }
  }
  out.close();
  if (!out) throw InputError("cannot write " + quote_path(path) + " (disk full or write error)");
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    throw InputError("cannot rename " + quote_path(tmp) + " to " + quote_path(path) + ": " + std::strerror(errno));
  guard.done = true;
}

std::vector<std::string> read_llmc_tokenizer(const std::string& path) {
  const std::string what = "llm.c tokenizer file " + quote_path(path);
  require_regular_file(path, "llm.c tokenizer file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(what + " cannot be opened (missing or unreadable)");
  std::uint32_t h[256] = {};
  if (!in.read(reinterpret_cast<char*>(h), sizeof h)) throw InputError(what + " is shorter than its 1024-byte header");
  if (h[0] != static_cast<std::uint32_t>(kLlmcTokenizerMagic))
    throw InputError(what + " has magic " + std::to_string(h[0]) + ", not " + std::to_string(kLlmcTokenizerMagic) +
                     " (not an llm.c tokenizer file)");
  if (h[1] != 1 && h[1] != 2) throw InputError(what + " has version " + std::to_string(h[1]) + "; loom reads 1 and 2");
  if (h[2] == 0 || h[2] > 1048576)
    throw InputError(what + " says it holds " + std::to_string(h[2]) + " tokens (corrupt)");
  std::vector<std::string> tokens(h[2]);
  for (std::uint32_t i = 0; i < h[2]; ++i) {
    unsigned char len = 0;
    if (!in.read(reinterpret_cast<char*>(&len), 1))
      throw InputError(what + " ends at token " + std::to_string(i) + " of " + std::to_string(h[2]));
    tokens[i].resize(len);
    if (len && !in.read(&tokens[i][0], len)) throw InputError(what + " ends inside token " + std::to_string(i));
  }
  return tokens;
}

}  // namespace loom
