// Using a trained model: `loom sample CKPT` generates text (or token ids) from a checkpoint, and
// `loom ckpt llmc CKPT OUT.bin` writes its weights as an llm.c model file. Both build the whole model
// on one process from the shape the checkpoint records and fill it with load_checkpoint, which checks
// the file as a resume does (checksums, shapes, finite values).
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <sstream>

#include "core/base/error.hpp"
#include "core/comm/grid.hpp"
#include "core/model/optimizer.hpp"
#include "driver/commands.hpp"
#include "io/util.hpp"
#include "io/checkpoint.hpp"
#include "io/hf.hpp"
#include "io/data.hpp"
#include "io/llmc.hpp"
#include "io/tokenizer.hpp"

namespace loom {
namespace {

// The whole model of a checkpoint on this one process.
struct LoadedModel {
  CheckpointState header;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<ProcessGrid> grid;
  std::unique_ptr<GPT> model;
  std::unique_ptr<AdamW> optimizer;  // load_checkpoint reads the optimizer state too (and checks it)
};

}  // namespace

std::string checkpoint_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_directory(path, ec)) return path;
  const std::string name = read_latest_name(path);
  if (name.empty())
    throw InputError(quote_path(path) +
                     " is a directory without a `latest` checkpoint: name a checkpoint file (ckpt-*.h5)");
  return path + "/" + name;
}

namespace {

LoadedModel load_whole(const std::string& path, const char* command, int rows) {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world != 1)
    throw InputError(std::string("loom ") + command + " runs on one process; launched on " + std::to_string(world));
  const std::string file = checkpoint_file(path);
  LoadedModel m;
  m.header = checkpoint_header(file);
  m.backend = make_host_backend(1);
  // cuDNN's attention has the flash contract (bf16 operands, fp32 softmax): on the host, its twin.
  if (m.header.model.attention == "cudnn") m.header.model.set_attention("flash");
  m.grid = std::make_unique<ProcessGrid>(MPI_COMM_WORLD, Layout{});
  m.model = std::make_unique<GPT>(m.header.model, *m.backend, rows);
  m.optimizer = std::make_unique<AdamW>(OptimizerConfig{}, *m.backend, m.model->params(), m.model->store().owned());
  m.header = load_checkpoint(file, *m.grid, *m.model, *m.optimizer);
  return m;
}

std::vector<std::int32_t> parse_ids(const std::string& text, int vocab) {
  std::vector<std::int32_t> ids;
  std::string t = text;
  std::replace(t.begin(), t.end(), ',', ' ');
  std::istringstream in(t);
  std::string word;
  while (in >> word) {
    char* end = nullptr;
    const long v = std::strtol(word.c_str(), &end, 10);
    if (*end != '\0' || v < 0 || v >= vocab)
      throw InputError("--tokens: " + quote_value(word) + " is not a token id in [0, " + std::to_string(vocab - 1) +
                       "] (the checkpoint's model.vocab = " + std::to_string(vocab) + ")");
    ids.push_back(static_cast<std::int32_t>(v));
  }
  if (ids.empty()) throw InputError("--tokens: no token ids given (e.g. --tokens 464,3290)");
  return ids;
}

// Text to ids and back for `loom sample`: the bytes of a byte vocabulary, a SentencePiece model
// (--tokenizer FILE.model, else the one the checkpoint's run trained with: data.tokenizer or its
// shards' manifest), llm.c's tokenizer file (decoding only), or the ids themselves.
class TextCodec {
 public:
  TextCodec(const std::string& option, const CheckpointState& header, int V) : V_(V) {
    std::string path = option, what = "--tokenizer";
    if (path.empty()) {  // the run's own, if its files are still there
      const auto deck = resolved_deck_values(header.deck);
      const auto get = [&deck](const char* k) { return deck.count(k) ? deck.at(k) : std::string(); };
      path = get("data.tokenizer");
      if (path.empty()) path = manifest_tokenizer(get("data.source"));
      what = "the run's data.tokenizer";
      std::error_code ec;
      if (!path.empty() && !std::filesystem::exists(path, ec)) path.clear();
    }
    if (path.empty()) return;
    if (is_llmc_tokenizer(path)) {
      llmc_ = read_llmc_tokenizer(path);
      if (static_cast<int>(llmc_.size()) < V)
        throw InputError(what + " " + quote_path(path) + " has " + std::to_string(llmc_.size()) +
                         " tokens; the checkpoint's model.vocab is " + std::to_string(V));
      return;
    }
    spm_ = Tokenizer::load(path, what);
    check_vocab(V, spm_->vocab(), what + " " + quote_path(path) + " (the checkpoint's model.vocab)");
  }
  std::vector<std::int32_t> encode(const std::string& text) const {
    if (spm_) return spm_->encode(text);
    if (V_ == 256 && llmc_.empty()) {
      std::vector<std::int32_t> ids;
      for (unsigned char c : text) ids.push_back(c);  // bytes 0..255, never a negative char
      return ids;
    }
    throw InputError(
        "--prompt needs a tokenizer to encode the text: the byte vocabulary (model.vocab = 256) or a "
        "SentencePiece model (--tokenizer FILE.model); this checkpoint's model.vocab is " +
        std::to_string(V_) + " and no SentencePiece model is known: give one, or token ids with --tokens");
  }
  std::string decode(const std::vector<std::int32_t>& ids, std::size_t prompt_len) const {
    std::string out;
    if (spm_) {
      std::vector<std::int32_t> known;  // ids past the tokenizer's (a padded vocabulary) are dropped
      for (std::int32_t id : ids)
        if (id < spm_->vocab()) known.push_back(id);
      return spm_->decode(known);
    }
    if (!llmc_.empty()) {
      for (std::int32_t id : ids) out += llmc_[static_cast<std::size_t>(id)];
      return out;
    }
    if (V_ == 256) return std::string(ids.begin(), ids.end());
    for (std::size_t i = 0; i < ids.size(); ++i)
      out += (i ? (i == prompt_len ? " | " : " ") : "") + std::to_string(ids[i]);
    return out;
  }
  int eos() const { return spm_ ? spm_->eos_id() : -1; }

 private:
  static bool is_llmc_tokenizer(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::uint32_t magic = 0;
    return in.read(reinterpret_cast<char*>(&magic), 4) && magic == static_cast<std::uint32_t>(kLlmcTokenizerMagic);
  }
  int V_;
  std::unique_ptr<Tokenizer> spm_;
  std::vector<std::string> llmc_;
};

}  // namespace

int command_sample(const SampleOptions& o) {
  LoadedModel m = load_whole(o.checkpoint, "sample", 1);
  GPT& model = *m.model;
  const GPTConfig& cfg = model.config();
  const int T = cfg.seq_len, V = cfg.vocab;
  const TextCodec codec(o.tokenizer, m.header, V);
  if (!o.prompt.empty() && !o.tokens.empty()) throw InputError("loom sample: give --prompt or --tokens, not both");
  std::vector<std::int32_t> ids;
  if (!o.tokens.empty()) {
    ids = parse_ids(o.tokens, V);
  } else if (!o.prompt.empty()) {
    ids = codec.encode(o.prompt);
  } else {
    // A newline for bytes; GPT-2's end-of-text token (llm.c starts there) for its vocabulary; else
    // the tokenizer's end of document (what a prepared document follows), else token 0.
    ids.push_back(V == 256 ? '\n' : V == 50257 ? 50256 : codec.eos() >= 0 ? codec.eos() : 0);
  }
  const std::size_t prompt_len = ids.size();
  std::mt19937_64 gen(o.seed);
  std::vector<std::int32_t> in(static_cast<std::size_t>(T), 0);
  std::vector<double> p(static_cast<std::size_t>(V));
  std::vector<int> order(static_cast<std::size_t>(V));
  for (int s = 0; s < o.steps; ++s) {
    // The last T tokens; positions after them are padding that causal attention never lets them see.
    const std::size_t n = std::min<std::size_t>(ids.size(), static_cast<std::size_t>(T));
    std::copy(ids.end() - static_cast<std::ptrdiff_t>(n), ids.end(), in.begin());
    model.forward(in.data(), nullptr, 1);                                         // no targets: the logits stay logits
    const float* logits = model.logits() + static_cast<std::int64_t>(n - 1) * V;  // [V] at the last real position
    int next = 0;
    if (o.temperature <= 0) {
      next = static_cast<int>(std::max_element(logits, logits + V) - logits);
    } else {
      // Softmax of logits / temperature over the top-k (all when k = 0), then one draw.
      for (int v = 0; v < V; ++v) order[static_cast<std::size_t>(v)] = v;
      const int k = o.top_k > 0 && o.top_k < V ? o.top_k : V;
      std::partial_sort(order.begin(), order.begin() + k, order.end(),
                        [&](int a, int b) { return logits[a] > logits[b]; });
      const double top = logits[order[0]];
      for (int j = 0; j < k; ++j)
        p[static_cast<std::size_t>(j)] = std::exp((logits[order[static_cast<std::size_t>(j)]] - top) / o.temperature);
      std::discrete_distribution<int> draw(p.begin(), p.begin() + k);  // weights need not sum to 1
      next = order[static_cast<std::size_t>(draw(gen))];
    }
    ids.push_back(next);
  }
  std::cerr << "loom sample: " << o.steps << " tokens from " << checkpoint_file(o.checkpoint) << " (step "
            << m.header.step << "; " << cfg.layers << " layers, d_model " << cfg.d_model << ", vocab " << V
            << (cfg.flash_attention ? ", " + cfg.attention + " attention" : std::string()) << "), temperature "
            << o.temperature << ", top-k " << o.top_k << ", seed " << o.seed << "\n";
  std::cout << codec.decode(ids, prompt_len) << "\n";
  return 0;
}

// ckpt llmc's OUT may replace an llm.c file, never the checkpoint it reads nor any other checkpoint.
static void refuse_output_over_checkpoint(const std::string& checkpoint, const std::string& out) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(out, ec)) return;
  if (fs::equivalent(out, checkpoint_file(checkpoint), ec))
    throw InputError("ckpt llmc: OUT " + quote_path(out) +
                     " is the checkpoint it reads: writing it would destroy the checkpoint; name another file (.bin)");
  if (fs::is_directory(out, ec)) throw InputError("ckpt llmc: OUT " + quote_path(out) + " is a directory; name a file");
  if (!fs::is_regular_file(out, ec)) return;  // a FIFO or a device: written as before, never opened to read
  char magic[8] = {};
  std::ifstream in(out, std::ios::binary);
  if (in.read(magic, 8) && std::memcmp(magic, "\x89HDF\r\n\x1a\n", 8) == 0)
    throw InputError("ckpt llmc: OUT " + quote_path(out) +
                     " is a checkpoint (an HDF5 file): ckpt llmc writes an llm.c model file and never over a "
                     "checkpoint; name another file (.bin)");
}

int command_ckpt_llmc(const std::string& checkpoint, const std::string& out) {
  refuse_output_over_checkpoint(checkpoint, out);
  LoadedModel m = load_whole(checkpoint, "ckpt llmc", 1);
  GPT& model = *m.model;
  std::map<std::string, std::vector<float>> whole;
  for (std::size_t i = 0; i < model.params().size(); ++i) {
    const ParamInfo& p = model.params()[i];
    const float* w = model.param_ref(static_cast<int>(i)).as<float>();
    whole[p.name].assign(w, w + p.numel());
  }
  write_llmc_model(out, model.config(),
                   [&](const std::string& name) -> const std::vector<float>& { return whole.at(name); });
  std::cout << "wrote " << out << ": llm.c model file version 3 (fp32), " << model.config().layers
            << " layers, d_model " << model.config().d_model << ", " << model.config().heads << " heads, vocab "
            << model.config().vocab << " (padded to " << (model.config().vocab + 127) / 128 * 128 << "), max_seq_len "
            << model.config().seq_len << ", from step " << m.header.step << " of " << checkpoint_file(checkpoint)
            << "\n";
  return 0;
}

// loom ckpt hf CKPT DIR [--tokenizer FILE.model]: Hugging Face's files (io/hf.hpp) from a checkpoint.
int command_ckpt_hf(const std::string& checkpoint, const std::string& dir, const std::string& tokenizer) {
  std::error_code ec;
  if (std::filesystem::exists(dir, ec) && !std::filesystem::is_directory(dir, ec))
    throw InputError("ckpt hf: DIR " + quote_path(dir) +
                     " is a file; name a folder (made if missing) for model.safetensors and config.json");
  LoadedModel m = load_whole(checkpoint, "ckpt hf", 1);
  GPT& model = *m.model;
  const GPTConfig& c = model.config();
  // The tokenizer first: a file that is not one stops the command before anything is written.
  const std::string tokenizer_line = tokenizer.empty() ? "" : write_hf_tokenizer(dir, tokenizer, c);
  std::map<std::string, std::vector<float>> whole;
  for (std::size_t i = 0; i < model.params().size(); ++i) {
    const ParamInfo& p = model.params()[i];
    const float* w = model.param_ref(static_cast<int>(i)).as<float>();
    whole[p.name].assign(w, w + p.numel());
  }
  write_hf_model(dir, c, [&](const std::string& name) -> const std::vector<float>& { return whole.at(name); });
  std::cout << "wrote " << dir << "/{model.safetensors,config.json}: ";
  if (c.llama())
    std::cout << "LlamaForCausalLM (fp32), " << c.layers << " layers, hidden_size " << c.d_model << ", " << c.heads
              << " heads, " << c.kv() << " kv heads, intermediate_size " << c.ffn() << ", vocab " << c.vocab
              << (c.tied() ? ", tied" : "");
  else
    std::cout << "GPT2LMHeadModel (fp32), " << c.layers << " layers, n_embd " << c.d_model << ", " << c.heads
              << " heads, n_positions " << c.seq_len << ", vocab " << c.vocab << ", tied";
  std::cout << ", from step " << m.header.step << " of " << checkpoint_file(checkpoint) << "\n";
  if (!tokenizer_line.empty()) std::cout << "wrote " << dir << "/" << tokenizer_line << "\n";
  return 0;
}

}  // namespace loom
