#include "io/data.hpp"

#include <glob.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "core/base/rng.hpp"
#include "io/util.hpp"

namespace loom {

namespace {

constexpr std::int32_t kShardMagic = 20240520;
constexpr std::int32_t kShardVersion = 1;    // uint16 tokens (llm.c's)
constexpr std::int32_t kShardVersion32 = 2;  // uint32 tokens (loom's, for vocabularies above 65,536)
constexpr std::int64_t kHeaderInts = 256;
constexpr std::int64_t kHeaderBytes = kHeaderInts * 4;

// Stream ids: train and val draw from different streams; the synthetic chain's successor map has
// its own. The step is folded into the stream, the index is the counter, so the key of a sample is
// a pure function of (seed, split, step, index).
const std::uint64_t kTrainStream = rng::hash_name("data.train");
const std::uint64_t kValStream = rng::hash_name("data.val");
const std::uint64_t kSuccStream = rng::hash_name("data.synthetic.successor");

const char* split_name(Split s) { return s == Split::train ? "train" : "val"; }

std::uint64_t sample_key(std::uint64_t seed, Split split, std::int64_t step, std::int64_t index) {
  const std::uint64_t stream =
      (split == Split::train ? kTrainStream : kValStream) ^ rng::mix64(static_cast<std::uint64_t>(step));
  return rng::bits(seed, stream, static_cast<std::uint64_t>(index));
}

std::string fmt_double(double v, int precision) {
  std::ostringstream s;
  s.precision(precision);
  s << v;
  return s.str();
}

// ---------------------------------------------------------------------------------------------
// synthetic: a first-order Markov chain.

class SyntheticDataset final : public Dataset {
 public:
  explicit SyntheticDataset(const DataConfig& cfg)
      : seed_(cfg.seed), vocab_(cfg.vocab), seq_len_(cfg.seq_len), noise_(cfg.synthetic_noise) {
    // Successor map: a permutation of [0, V) by Fisher-Yates on the counter-based generator.
    succ_.resize(static_cast<std::size_t>(vocab_));
    for (int i = 0; i < vocab_; ++i) succ_[static_cast<std::size_t>(i)] = i;
    for (int i = vocab_ - 1; i > 0; --i) {
      const auto j = static_cast<int>(rng::bits(seed_, kSuccStream, static_cast<std::uint64_t>(i)) %
                                      static_cast<std::uint64_t>(i + 1));
      std::swap(succ_[static_cast<std::size_t>(i)], succ_[static_cast<std::size_t>(j)]);
    }
    // H = -(q ln q) - (V-1) p ln p, q = 1 - noise + noise/V, p = noise/V; 0 ln 0 = 0.
    const double V = static_cast<double>(vocab_);
    const double p = noise_ / V;
    const double q = 1.0 - noise_ + p;
    double h = 0.0;
    if (q > 0.0 && q < 1.0) h -= q * std::log(q);
    if (p > 0.0) h -= (V - 1.0) * p * std::log(p);
    best_ = h < 0.0 ? 0.0 : h;
  }

  std::string describe() const override {
    std::ostringstream s;
    s << "synthetic (vocab " << vocab_ << ", noise " << fmt_double(noise_, 6) << ", best loss " << fmt_double(best_, 4)
      << " nats/token)";
    return s.str();
  }

  void sample(Split split, std::int64_t step, std::int64_t index, std::int32_t* out) const override {
    const std::uint64_t key = sample_key(seed_, split, step, index);
    const auto V = static_cast<std::uint64_t>(vocab_);
    // Counter 2t: the coin of token t; counter 2t+1: the uniform draw of token t.
    std::int32_t prev = static_cast<std::int32_t>(rng::bits(seed_, key, 1) % V);
    out[0] = prev;
    for (int t = 1; t <= seq_len_; ++t) {
      const auto c = static_cast<std::uint64_t>(t);
      // uniform() is in (0, 1], so P(u <= noise) = noise exactly at 0 and 1.
      if (rng::uniform(seed_, key, 2 * c) <= noise_)
        prev = static_cast<std::int32_t>(rng::bits(seed_, key, 2 * c + 1) % V);
      else
        prev = succ_[static_cast<std::size_t>(prev)];
      out[t] = prev;
    }
  }

  std::optional<double> best_loss() const override { return best_; }

  // The chain is unbounded: both splits always exist.
  std::int64_t tokens(Split) const override { return std::numeric_limits<std::int64_t>::max(); }

 private:
  std::uint64_t seed_;
  int vocab_, seq_len_;
  double noise_;
  double best_ = 0.0;
  std::vector<std::int32_t> succ_;
};

// ---------------------------------------------------------------------------------------------
// A finite token stream (text bytes or uint16 shards), split into train | val.

template <class Tok>
class StreamDataset final : public Dataset {
 public:
  StreamDataset(const DataConfig& cfg, std::vector<Tok> toks, std::string what, std::string header)
      : seed_(cfg.seed), seq_len_(cfg.seq_len), toks_(std::move(toks)), header_(std::move(header)) {
    const auto n = static_cast<std::int64_t>(toks_.size());
    // Train is the first floor(n * (1 - val_fraction)) tokens (with a guard against 8.9999999).
    n_train_ = static_cast<std::int64_t>(std::floor(static_cast<double>(n) * (1.0 - cfg.val_fraction) + 1e-6));
    n_train_ = std::clamp<std::int64_t>(n_train_, 0, n);
    if (cfg.val_fraction <= 0.0) n_train_ = n;
    n_val_ = n - n_train_;
    const std::int64_t need = static_cast<std::int64_t>(seq_len_) + 1;
    auto check = [&](Split s, std::int64_t have) {
      if (have >= need) return;
      std::ostringstream m;
      m << what << ": the " << split_name(s) << " split holds " << have << " tokens (of " << n
        << " in all, data.val_fraction " << cfg.val_fraction << "), fewer than the seq_len + 1 = " << need
        << " one sample needs; use more data, change data.val_fraction or lower model.seq_len";
      throw InputError(m.str());
    };
    check(Split::train, n_train_);
    if (cfg.val_fraction > 0.0) check(Split::val, n_val_);
  }

  std::string describe() const override {
    std::ostringstream s;
    s << header_ << "; train " << n_train_ << ", val " << n_val_ << " tokens)";
    return s.str();
  }

  void sample(Split split, std::int64_t step, std::int64_t index, std::int32_t* out) const override {
    const std::int64_t begin = split == Split::train ? 0 : n_train_;
    const std::int64_t n = split == Split::train ? n_train_ : n_val_;
    if (n == 0)
      throw std::logic_error(std::string("Dataset::sample: the ") + split_name(split) +
                             " split is empty (data.val_fraction = 0)");
    const auto span = static_cast<std::uint64_t>(n - seq_len_);
    const auto off = static_cast<std::int64_t>(sample_key(seed_, split, step, index) % span);
    const Tok* src = toks_.data() + begin + off;
    for (int t = 0; t <= seq_len_; ++t) out[t] = static_cast<std::int32_t>(src[t]);
  }

  std::int64_t tokens(Split split) const override { return split == Split::train ? n_train_ : n_val_; }

 private:
  std::uint64_t seed_;
  int seq_len_;
  std::vector<Tok> toks_;
  std::string header_;
  std::int64_t n_train_ = 0, n_val_ = 0;
};

std::unique_ptr<Dataset> open_text(const DataConfig& cfg, const std::string& path) {
  const std::string what = cfg.key + " text file " + quote_path(path);
  if (cfg.vocab < 256) {
    throw InputError(
        what + ": " + cfg.key +
        " text needs model.vocab >= 256 (bytes are tokens 0..255), but model.vocab = " + std::to_string(cfg.vocab));
  }
  const std::string bytes = read_file(path, cfg.key + " text file");
  if (bytes.empty()) throw InputError(what + ": the file is empty (0 bytes)");
  std::vector<std::uint8_t> toks(bytes.begin(), bytes.end());
  const std::string header = "text:" + escape_value(path) + " (" + std::to_string(bytes.size()) + " bytes";
  return std::make_unique<StreamDataset<std::uint8_t>>(cfg, std::move(toks), what, header);
}

std::int32_t le32(const unsigned char* p) {
  return static_cast<std::int32_t>(static_cast<std::uint32_t>(p[0]) | (static_cast<std::uint32_t>(p[1]) << 8) |
                                   (static_cast<std::uint32_t>(p[2]) << 16) | (static_cast<std::uint32_t>(p[3]) << 24));
}

// Appends the tokens of one shard (version 1: uint16, llm.c's; version 2: uint32, loom's) to `toks`.
template <class Tok>
void read_shard(const DataConfig& cfg, const std::string& path, std::vector<Tok>& toks) {
  const std::string what = cfg.key + " tokens file " + quote_path(path);
  require_regular_file(path, cfg.key + " tokens file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(what + ": cannot be read (" + std::strerror(errno) + ")");
  in.seekg(0, std::ios::end);
  const auto size = static_cast<std::int64_t>(in.tellg());
  in.seekg(0, std::ios::beg);
  if (size < 0) throw InputError(what + ": cannot be read (cannot tell its size)");
  if (size < kHeaderBytes) {
    throw InputError(what + ": truncated header at byte offset " + std::to_string(size) + ": the file holds " +
                     std::to_string(size) + " bytes, the header needs " + std::to_string(kHeaderBytes));
  }
  unsigned char hdr[kHeaderBytes];
  if (!in.read(reinterpret_cast<char*>(hdr), kHeaderBytes))
    throw InputError(what + ": cannot read the header (" + std::strerror(errno) + ")");
  const std::int32_t magic = le32(hdr), version = le32(hdr + 4), count = le32(hdr + 8);
  if (magic != kShardMagic) {
    throw InputError(what + ": bad magic at byte offset 0: expected " + std::to_string(kShardMagic) + ", found " +
                     std::to_string(magic) + " (not an llm.c token shard?)");
  }
  if (version != kShardVersion && version != kShardVersion32) {
    throw InputError(what + ": unsupported version at byte offset 4: expected " + std::to_string(kShardVersion) +
                     " (uint16 tokens, llm.c's) or " + std::to_string(kShardVersion32) +
                     " (uint32 tokens, loom's), found " + std::to_string(version));
  }
  const std::int64_t width = version == kShardVersion ? 2 : 4;
  if (count < 0) {
    throw InputError(what + ": bad token count at byte offset 8: " + std::to_string(count));
  }
  if (count == 0) throw InputError(what + ": empty: the header at byte offset 8 promises 0 tokens");
  const std::int64_t n = count;
  const std::int64_t held = (size - kHeaderBytes) / width;
  if (held < n) {
    throw InputError(what + ": truncated at byte offset " + std::to_string(size) + ": the header promises " +
                     std::to_string(n) + " tokens (" + std::to_string(kHeaderBytes + width * n) +
                     " bytes), the file holds " + std::to_string(held) + " (" + std::to_string(size) + " bytes)");
  }
  // Like llm.c, refuse any size other than the header's: extra bytes mean a wrong count or two
  // shards run together, and reading only the counted tokens would hide it.
  if (size != kHeaderBytes + width * n) {
    const std::int64_t part = (size - kHeaderBytes) % width;  // bytes of a token cut short
    const std::string frac = part == 0 ? "" : width == 2 ? ".5" : part == 1 ? ".25" : part == 2 ? ".5" : ".75";
    throw InputError(what + ": longer than its header says: the token count at byte offset 8 promises " +
                     std::to_string(n) + " tokens (" + std::to_string(kHeaderBytes + width * n) +
                     " bytes), the file has " + std::to_string(size) + " bytes, which hold " + std::to_string(held) +
                     frac + " tokens");
  }
  std::vector<unsigned char> raw(static_cast<std::size_t>(width * n));
  if (!in.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(raw.size())))
    throw InputError(what + ": cannot read the tokens (" + std::strerror(errno) + ")");
  const std::size_t base = toks.size();
  toks.resize(base + static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    const unsigned char* p = raw.data() + width * i;
    const std::uint32_t id =
        width == 2 ? static_cast<std::uint32_t>(p[0] | (p[1] << 8)) : static_cast<std::uint32_t>(le32(p));
    if (id >= static_cast<std::uint32_t>(cfg.vocab)) {
      throw InputError(what + ": token " + std::to_string(i) + " at byte offset " +
                       std::to_string(kHeaderBytes + width * i) + " has id " + std::to_string(id) +
                       ", not below model.vocab = " + std::to_string(cfg.vocab));
    }
    toks[base + static_cast<std::size_t>(i)] = static_cast<Tok>(id);
  }
}

// The manifest.json beside a shard, parsed, or null when there is none.
nlohmann::json read_manifest(const std::string& shard, const std::string& key) {
  namespace fs = std::filesystem;
  const fs::path manifest = fs::path(shard).parent_path() / "manifest.json";
  std::error_code ec;
  if (!fs::is_regular_file(manifest, ec)) return nullptr;
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(read_file(manifest.string(), key + " manifest"));
  } catch (const nlohmann::json::exception& e) {
    throw InputError(key + " manifest " + quote_path(manifest.string()) + ": not valid JSON (" + e.what() + ")");
  }
  const auto format = m.is_object() ? m.find("format") : m.end();
  if (format == m.end() || !format->is_string() || format->get<std::string>().rfind("loom data prepare", 0) != 0)
    return nullptr;  // another tool's manifest: not loom's to read
  const auto tok = m.find("tokenizer");
  if (tok == m.end() || !tok->is_object() || !tok->contains("vocab") || !(*tok)["vocab"].is_number_integer() ||
      !tok->contains("file") || !(*tok)["file"].is_string())
    throw InputError(key + " manifest " + quote_path(manifest.string()) +
                     ": has no tokenizer.vocab and tokenizer.file (damaged? run loom data prepare again)");
  m["path"] = manifest.string();
  return m;
}

// A manifest.json beside the shards (`loom data prepare` writes one) names their tokenizer: its
// vocabulary must fit model.vocab before step 1, not as an index error later.
void check_manifest_vocab(const DataConfig& cfg, const std::string& shard) {
  const nlohmann::json m = read_manifest(shard, cfg.key);
  if (m.is_null()) return;
  check_vocab(cfg.vocab, m["tokenizer"]["vocab"].get<int>(),
              "the tokenizer of " + quote_path(m["path"].get<std::string>()) + " (" + cfg.key + "'s manifest)");
}

std::vector<std::string> glob_files(const std::string& pattern) {
  glob_t g{};
  std::vector<std::string> files;
  if (::glob(pattern.c_str(), 0, nullptr, &g) == 0)
    for (std::size_t i = 0; i < g.gl_pathc; ++i) files.emplace_back(g.gl_pathv[i]);
  globfree(&g);
  std::sort(files.begin(), files.end());
  return files;
}

std::unique_ptr<Dataset> open_tokens(const DataConfig& cfg, const std::string& pattern) {
  const std::string what = cfg.key + " tokens:" + escape_value(pattern);
  glob_t g{};
  const int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
  std::vector<std::string> files;
  if (rc == 0) {
    for (std::size_t i = 0; i < g.gl_pathc; ++i) files.emplace_back(g.gl_pathv[i]);
  }
  globfree(&g);
  if (rc == GLOB_NOMATCH || (rc == 0 && files.empty()))
    throw InputError(what + ": the pattern " + quote_path(pattern) + " matches no file");
  if (rc != 0)
    throw InputError(what + ": the pattern " + quote_path(pattern) + " cannot be expanded (glob error " +
                     std::to_string(rc) + ")");
  std::sort(files.begin(), files.end());
  check_manifest_vocab(cfg, files[0]);
  std::string desc_what = what;
  if (files.size() == 1) desc_what = cfg.key + " tokens file " + quote_path(files[0]);
  std::ostringstream header;
  header << "tokens:" << escape_value(pattern) << " (" << files.size() << (files.size() == 1 ? " file, " : " files, ");
  // 16-bit storage whenever the vocabulary allows: the loader's memory is the tokens'.
  if (cfg.vocab <= 65536) {
    std::vector<std::uint16_t> toks;
    for (const auto& f : files) read_shard(cfg, f, toks);
    header << toks.size() << " tokens";
    return std::make_unique<StreamDataset<std::uint16_t>>(cfg, std::move(toks), desc_what, header.str());
  }
  std::vector<std::uint32_t> toks;
  for (const auto& f : files) read_shard(cfg, f, toks);
  header << toks.size() << " tokens";
  return std::make_unique<StreamDataset<std::uint32_t>>(cfg, std::move(toks), desc_what, header.str());
}

}  // namespace

std::unique_ptr<Dataset> open_dataset(const DataConfig& cfg) {
  if (cfg.vocab < 1) throw InputError("model.vocab = " + std::to_string(cfg.vocab) + ": must be at least 1");
  if (cfg.seq_len < 1) throw InputError("model.seq_len = " + std::to_string(cfg.seq_len) + ": must be at least 1");
  if (!(cfg.val_fraction >= 0.0 && cfg.val_fraction < 1.0))
    throw InputError("data.val_fraction = " + fmt_double(cfg.val_fraction, 6) + ": must be in [0, 1)");
  const std::string& src = cfg.source;
  if (src == "synthetic") {
    if (!(cfg.synthetic_noise >= 0.0 && cfg.synthetic_noise <= 1.0))
      throw InputError("data.synthetic_noise = " + fmt_double(cfg.synthetic_noise, 6) + ": must be in [0, 1]");
    return std::make_unique<SyntheticDataset>(cfg);
  }
  const auto colon = src.find(':');
  const std::string kind = colon == std::string::npos ? src : src.substr(0, colon);
  const std::string arg = colon == std::string::npos ? std::string() : src.substr(colon + 1);
  if (colon != std::string::npos && !arg.empty()) {
    if (kind == "text") return open_text(cfg, arg);
    if (kind == "tokens") return open_tokens(cfg, arg);
  }
  throw InputError(cfg.key + " = " + quote_path(src) +
                   ": unknown source; valid forms are synthetic, text:PATH, tokens:GLOB");
}

std::string manifest_tokenizer(const std::string& source) {
  if (source.rfind("tokens:", 0) != 0) return "";
  const auto files = glob_files(source.substr(7));
  if (files.empty()) return "";
  const nlohmann::json m = read_manifest(files[0], "data.source");
  if (m.is_null()) return "";
  return (std::filesystem::path(files[0]).parent_path() / m["tokenizer"]["file"].get<std::string>()).string();
}

void check_vocab(int model_vocab, int tokenizer_vocab, const std::string& what) {
  const int padded = (tokenizer_vocab + 127) / 128 * 128;
  if (model_vocab >= tokenizer_vocab && model_vocab <= padded) return;
  throw InputError("model.vocab = " + std::to_string(model_vocab) + " does not match " + what + ", which has " +
                   std::to_string(tokenizer_vocab) + " tokens: the model's vocabulary must be the tokenizer's " +
                   std::to_string(tokenizer_vocab) +
                   (padded != tokenizer_vocab
                        ? " (or up to " + std::to_string(padded) + ", padded to a multiple of 128)"
                        : std::string()) +
                   "; set model.vocab so, or use data and a tokenizer of the model's vocabulary");
}

void write_token_shard(const std::string& path, const std::vector<std::int32_t>& tokens, int vocab) {
  const bool wide = vocab > 65536;
  std::vector<std::int32_t> header(kHeaderInts, 0);
  header[0] = kShardMagic;
  header[1] = wide ? kShardVersion32 : kShardVersion;
  header[2] = static_cast<std::int32_t>(tokens.size());
  std::string bytes(static_cast<std::size_t>(kHeaderBytes) + tokens.size() * (wide ? 4 : 2), '\0');
  auto put = [&bytes](std::size_t at, std::uint32_t v, int width) {
    for (int b = 0; b < width; ++b) bytes[at + static_cast<std::size_t>(b)] = static_cast<char>((v >> (8 * b)) & 0xff);
  };
  for (std::size_t i = 0; i < header.size(); ++i) put(4 * i, static_cast<std::uint32_t>(header[i]), 4);
  const int width = wide ? 4 : 2;
  for (std::size_t i = 0; i < tokens.size(); ++i)
    put(static_cast<std::size_t>(kHeaderBytes) + static_cast<std::size_t>(width) * i,
        static_cast<std::uint32_t>(tokens[i]), width);
  write_file_atomically(path, bytes, "token shard");
}

void load_batch(const Dataset& ds, Split split, std::int64_t step, std::int64_t first_row, int rows, int seq_len,
                Batch& batch) {
  batch.rows = rows;
  batch.seq_len = seq_len;
  const auto T = static_cast<std::size_t>(seq_len);
  batch.inputs.resize(static_cast<std::size_t>(rows) * T);
  batch.targets.resize(static_cast<std::size_t>(rows) * T);
  std::vector<std::int32_t> buf(T + 1);
  for (int r = 0; r < rows; ++r) {
    ds.sample(split, step, first_row + r, buf.data());
    std::copy(buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(T),
              batch.inputs.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r) * T));
    std::copy(buf.begin() + 1, buf.end(),
              batch.targets.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r) * T));
  }
}

}  // namespace loom
