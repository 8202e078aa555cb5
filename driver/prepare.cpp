// `loom data prepare`: from text files to token shards. Stages, each resumable:
//   scan      (rank 0) list the inputs, check each is UTF-8 (the first bad byte named by file and
//             offset), hash them, cut them into chunks at line ends; every rank gets the table;
//   tokenizer (rank 0) train a SentencePiece model on the training chunks' lines, or copy the given
//             one, to OUT/tokenizer.model (kept, with the spec it was trained for, so a resumed run
//             does not train it again);
//   encode    (every rank, threads within) each rank its share of the chunks, each chunk's tokens
//             cached as OUT/.prepare/chunk-NNNNNN.tok (written whole, then renamed): a killed run
//             resumes at the first chunk not cached;
//   assemble  (rank 0) the chunks in order into llm.c-format shards of each split, then
//             manifest.json, written last: a folder with a manifest is complete.
// The output is a function of the inputs and options alone, not of the ranks or threads, and a run
// whose manifest already records the same inputs and options does nothing.
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/program_options.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <glob.h>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "core/base/error.hpp"
#include "core/base/rng.hpp"
#include "driver/commands.hpp"
#include "io/data.hpp"
#include "io/report.hpp"
#include "io/tokenizer.hpp"
#include "io/util.hpp"
#include "loom/build_info.hpp"

namespace loom {
namespace {

namespace fs = std::filesystem;
namespace po = boost::program_options;
using json = nlohmann::json;

constexpr const char* kFormat = "loom data prepare 1";
constexpr char kChunkMagic[8] = {'L', 'O', 'O', 'M', 'C', 'H', 'N', 'K'};

struct Options {
  std::vector<std::string> inputs;  // globs
  std::string input_list;           // a file naming one input per line
  std::string out, tokenizer, model_type = "bpe";
  int vocab = 8192, threads = 0;
  double val_fraction = 0.01;
  std::int64_t shard_tokens = 100000000, chunk_bytes = 1 << 20;
  std::uint64_t max_sentences = 2000000;
  unsigned seed = 1;
  bool overwrite = false, verify = false;
};

struct Input {
  std::string path;
  std::int64_t bytes = 0;
  std::uint64_t hash = 0;
};
struct Chunk {
  int file = 0;
  std::int64_t offset = 0, length = 0;
  std::uint64_t hash = 0;
  bool ends_file = false, val = false;
};

std::string now_utc() {
  const std::time_t t = std::time(nullptr);
  char b[32];
  std::strftime(b, sizeof b, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return b;
}

std::string hex(std::uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

// A 64-bit content hash (8 bytes a step through splitmix64's mixer): checksums for the manifest and
// the chunk cache, not a cryptographic digest.
std::uint64_t hash_bytes(const char* p, std::size_t n, std::uint64_t h = 0x6c6f6f6d64617461ull) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    std::uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = rng::mix64(h ^ w);
  }
  std::uint64_t tail = 0;
  std::memcpy(&tail, p + i, n - i);
  return rng::mix64(h ^ tail ^ (static_cast<std::uint64_t>(n) << 56));
}

// Offset of the first byte that breaks UTF-8 (overlong forms, surrogates and code points past
// U+10FFFF included), or -1.
std::int64_t first_bad_utf8(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  std::size_t i = 0;
  while (i < n) {
    const unsigned c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    int len = 0;
    unsigned lo = 0x80, hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf)
      len = 2;
    else if (c >= 0xe0 && c <= 0xef)
      len = 3, lo = c == 0xe0 ? 0xa0 : 0x80, hi = c == 0xed ? 0x9f : 0xbf;
    else if (c >= 0xf0 && c <= 0xf4)
      len = 4, lo = c == 0xf0 ? 0x90 : 0x80, hi = c == 0xf4 ? 0x8f : 0xbf;
    else
      return static_cast<std::int64_t>(i);
    if (i + static_cast<std::size_t>(len) > n) return static_cast<std::int64_t>(i);
    if (p[i + 1] < lo || p[i + 1] > hi) return static_cast<std::int64_t>(i);
    for (int k = 2; k < len; ++k)
      if ((p[i + static_cast<std::size_t>(k)] & 0xc0) != 0x80) return static_cast<std::int64_t>(i);
    i += static_cast<std::size_t>(len);
  }
  return -1;
}

Options parse(const std::vector<std::string>& rest) {
  Options o;
  po::options_description opts("loom data prepare options");
  opts.add_options()("input,i", po::value(&o.inputs)->composing(), "text files: a path or glob (repeatable)")(
      "input-list", po::value(&o.input_list), "a file naming one input path per line")(
      "out,o", po::value(&o.out), "output folder: shards, tokenizer.model, manifest.json")(
      "tokenizer", po::value(&o.tokenizer), "use this SentencePiece .model instead of training one")(
      "vocab", po::value(&o.vocab)->default_value(o.vocab), "vocabulary of the tokenizer to train")(
      "model-type", po::value(&o.model_type)->default_value(o.model_type), "bpe | unigram")(
      "val-fraction", po::value(&o.val_fraction)->default_value(o.val_fraction), "share of chunks held out")(
      "shard-tokens", po::value(&o.shard_tokens)->default_value(o.shard_tokens), "tokens per shard at most")(
      "chunk-bytes", po::value(&o.chunk_bytes)->default_value(o.chunk_bytes), "bytes per unit of work")(
      "max-sentences", po::value(&o.max_sentences)->default_value(o.max_sentences),
      "lines the tokenizer trains on at most (a uniform sample)")("seed", po::value(&o.seed)->default_value(o.seed),
                                                                  "seed of the tokenizer's sample and the split")(
      "threads", po::value(&o.threads)->default_value(o.threads), "encoding threads per rank (0: cores / ranks)")(
      "verify", po::bool_switch(&o.verify), "decode every chunk again and require the text back byte for byte")(
      "overwrite", po::bool_switch(&o.overwrite), "replace a finished preparation of other inputs or options");
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(rest).options(opts).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    throw UsageError(std::string("loom data prepare: ") + e.what() + "\n" + [&] {
      std::ostringstream s;
      s << opts;
      return s.str();
    }());
  }
  auto bad = [](const std::string& m) { throw UsageError("loom data prepare: " + m); };
  if (o.inputs.empty() && o.input_list.empty()) bad("needs --input GLOB (repeatable) or --input-list FILE");
  if (o.out.empty()) bad("needs --out DIR (the folder the shards and manifest.json go to)");
  if (o.vocab < 260 || o.vocab > 1000000)
    bad("--vocab " + std::to_string(o.vocab) +
        " is not in 260 .. 1000000 (256 byte pieces and 3 control pieces "
        "come first)");
  if (!(o.val_fraction >= 0 && o.val_fraction < 0.5))
    bad("--val-fraction " + std::to_string(o.val_fraction) + " is not in [0, 0.5)");
  if (o.shard_tokens < 1024 || o.shard_tokens > 2000000000)
    bad("--shard-tokens " + std::to_string(o.shard_tokens) + " is not in 1024 .. 2000000000");
  if (o.chunk_bytes < 4096) bad("--chunk-bytes " + std::to_string(o.chunk_bytes) + " is below 4096");
  if (o.threads < 0 || o.threads > 1024)
    bad("--threads " + std::to_string(o.threads) + " is not in 0 .. 1024 (0: the node's cores over its ranks)");
  if (o.model_type != "bpe" && o.model_type != "unigram")
    bad("--model-type " + quote_value(o.model_type) + ": valid values are bpe, unigram");
  return o;
}

std::vector<std::string> list_inputs(const Options& o) {
  std::vector<std::string> files;
  for (const std::string& pattern : o.inputs) {
    glob_t g{};
    const int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
    const std::size_t before = files.size();
    if (rc == 0)
      for (std::size_t i = 0; i < g.gl_pathc; ++i) files.emplace_back(g.gl_pathv[i]);
    globfree(&g);
    if (files.size() == before) throw InputError("--input " + quote_path(pattern) + " matches no file");
  }
  if (!o.input_list.empty()) {
    std::istringstream in(read_file(o.input_list, "--input-list"));
    std::string line;
    for (int n = 1; std::getline(in, line); ++n) {
      if (line.empty() || line[0] == '#') continue;
      std::error_code ec;
      if (!fs::exists(line, ec))
        throw InputError("--input-list " + quote_path(o.input_list) + " line " + std::to_string(n) + ": " +
                         quote_path(line) + " does not exist");
      files.push_back(line);
    }
  }
  std::sort(files.begin(), files.end());
  files.erase(std::unique(files.begin(), files.end()), files.end());
  if (files.empty()) throw InputError("--input-list " + quote_path(o.input_list) + " names no file");
  return files;
}

// Where to cut `text` after `from`: at a line end near `want` bytes on, else at a character boundary.
std::size_t next_cut(const std::string& text, std::size_t from, std::size_t want) {
  if (text.size() - from <= want) return text.size();
  const std::size_t nl = text.find('\n', from + want);
  if (nl != std::string::npos && nl - from < 2 * want) return nl + 1;
  std::size_t cut = from + want;
  while (cut < text.size() && (static_cast<unsigned char>(text[cut]) & 0xc0) == 0x80) ++cut;
  return cut;
}

void scan_file(const Options& o, int index, Input& input, std::vector<Chunk>& chunks) {
  require_regular_file(input.path, "--input");
  const std::string text = read_file(input.path, "--input");
  const std::int64_t bad = first_bad_utf8(text);
  if (bad >= 0) {
    char b[8];
    std::snprintf(b, sizeof b, "0x%02x", static_cast<unsigned char>(text[static_cast<std::size_t>(bad)]));
    throw InputError("--input " + quote_path(input.path) + ": not UTF-8: byte " + b + " at byte offset " +
                     std::to_string(bad) + " (convert the file, e.g. iconv -f latin1 -t utf-8, or leave it out)");
  }
  input.bytes = static_cast<std::int64_t>(text.size());
  input.hash = hash_bytes(text.data(), text.size());
  for (std::size_t at = 0; at < text.size();) {
    const std::size_t end = next_cut(text, at, static_cast<std::size_t>(o.chunk_bytes));
    Chunk c;
    c.file = index;
    c.offset = static_cast<std::int64_t>(at);
    c.length = static_cast<std::int64_t>(end - at);
    c.hash = hash_bytes(text.data() + at, end - at);
    c.ends_file = end == text.size();
    // The split by content, not position: adding a file moves no other chunk between the splits.
    c.val = static_cast<double>(rng::mix64(c.hash ^ o.seed) % 1000000) < o.val_fraction * 1e6;
    chunks.push_back(c);
    at = end;
  }
}

struct Scan {
  std::vector<Input> inputs;
  std::vector<Chunk> chunks;
};

Scan scan(const Options& o) {
  Scan s;
  for (const std::string& f : list_inputs(o)) s.inputs.push_back({f, 0, 0});
  for (std::size_t i = 0; i < s.inputs.size(); ++i) scan_file(o, static_cast<int>(i), s.inputs[i], s.chunks);
  if (s.chunks.empty()) throw InputError("--input: every input file is empty; there is no text to prepare");
  const auto val = std::count_if(s.chunks.begin(), s.chunks.end(), [](const Chunk& c) { return c.val; });
  // Each split needs a chunk: too few chunks for the hash to pick any, the last one is held out.
  if (o.val_fraction > 0 && val == 0) s.chunks.back().val = true;
  if (static_cast<std::size_t>(val) == s.chunks.size()) s.chunks.front().val = false;
  if (s.chunks.size() < 2 && o.val_fraction > 0)
    throw InputError("--input: " + std::to_string(s.inputs[0].bytes) +
                     " bytes make one chunk, too few for a train and a validation split; lower --chunk-bytes or "
                     "give --val-fraction 0");
  return s;
}

json scan_json(const Scan& s) {
  json j = json::object();
  j["inputs"] = json::array();
  for (const Input& i : s.inputs)
    j["inputs"].push_back({{"path", i.path}, {"bytes", i.bytes}, {"hash64", hex(i.hash)}});
  j["chunks"] = json::array();
  for (const Chunk& c : s.chunks) j["chunks"].push_back({c.file, c.offset, c.length, hex(c.hash), c.ends_file, c.val});
  return j;
}

Scan scan_from_json(const json& j) {
  Scan s;
  for (const auto& i : j["inputs"])
    s.inputs.push_back({i["path"], i["bytes"], std::stoull(i["hash64"].get<std::string>(), nullptr, 16)});
  for (const auto& c : j["chunks"])
    s.chunks.push_back({c[0], c[1], c[2], std::stoull(c[3].get<std::string>(), nullptr, 16), c[4], c[5]});
  return s;
}

// What decides the output (not the ranks, threads or chunk of work).
json options_json(const Options& o, const std::string& given_hash) {
  json t = o.tokenizer.empty()
               ? json{{"train", {{"model_type", o.model_type}, {"vocab", o.vocab}, {"max_sentences", o.max_sentences}}}}
               : json{{"given", {{"path", o.tokenizer}, {"hash64", given_hash}}}};
  return {{"tokenizer", t},
          {"val_fraction", o.val_fraction},
          {"seed", o.seed},
          {"chunk_bytes", o.chunk_bytes},
          {"shard_tokens", o.shard_tokens},
          {"document_separator", "eos"}};
}

std::string read_range(const std::string& path, std::int64_t offset, std::int64_t length) {
  std::ifstream in(path, std::ios::binary);
  std::string s(static_cast<std::size_t>(length), '\0');
  in.seekg(offset);
  if (!in.read(s.data(), length))
    throw InputError("--input " + quote_path(path) + ": cannot read bytes " + std::to_string(offset) + " .. " +
                     std::to_string(offset + length) + " (changed since it was scanned?)");
  return s;
}

void bcast_string(std::string& s) {
  long long n = static_cast<long long>(s.size());
  MPI_Bcast(&n, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
  s.resize(static_cast<std::size_t>(n));
  MPI_Bcast(s.data(), static_cast<int>(n), MPI_CHAR, 0, MPI_COMM_WORLD);
}

// Runs `f` on rank 0; every rank throws the same InputError if it failed (no rank waits forever for
// one that stopped).
void on_rank0(int rank, const std::function<void()>& f) {
  std::string err;
  if (rank == 0) {
    try {
      f();
    } catch (const std::exception& e) {
      err = e.what();
      if (err.empty()) err = "rank 0 failed";
    }
  }
  bcast_string(err);
  if (!err.empty()) throw AlikeOnEveryRank(err);  // every rank has it: printed once, status 2
}

// Progress of the encoding, on rank 0: a bar redrawn in place on a terminal, a line per tenth
// otherwise (a batch job's log). Rank 0 encodes about 1/ranks of the bytes, so its share stands for all.
class Progress {
 public:
  Progress(std::int64_t total, bool on) : total_(total), on_(on), tty_(isatty(2) != 0), t0_(now()) {}
  void add(std::int64_t bytes) {
    if (!on_) return;
    std::lock_guard<std::mutex> lock(m_);
    done_ += bytes;
    const double f = total_ > 0 ? static_cast<double>(done_) / static_cast<double>(total_) : 1.0;
    const double el = now() - t0_, rate = static_cast<double>(done_) / std::max(el, 1e-9);
    const double eta = rate > 0 ? static_cast<double>(total_ - done_) / rate : 0;
    char line[200];
    if (tty_) {
      const int w = 30, fill = static_cast<int>(f * w);
      std::snprintf(line, sizeof line, "\rencoding [%s%s] %3.0f%%  %.1f/%.1f MB  %.1f MB/s  ETA %.0f s ",
                    std::string(static_cast<std::size_t>(fill), '#').c_str(),
                    std::string(static_cast<std::size_t>(w - fill), '.').c_str(), 100 * f, done_ / 1e6, total_ / 1e6,
                    rate / 1e6, eta);
      std::fputs(line, stderr);
      if (done_ == total_) std::fputs("\n", stderr);
    } else if (static_cast<int>(f * 10) > tenths_ || done_ == total_) {
      tenths_ = static_cast<int>(f * 10);
      std::snprintf(line, sizeof line, "encoding: %3.0f%% (%.1f of %.1f MB on rank 0), %.1f MB/s, ETA %.0f s\n",
                    100 * f, done_ / 1e6, total_ / 1e6, rate / 1e6, eta);
      std::fputs(line, stderr);
    }
  }
  static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }

 private:
  std::mutex m_;
  std::int64_t total_, done_ = 0;
  bool on_, tty_;
  int tenths_ = 0;
  double t0_;
};

// What a cached chunk's tokens depend on: its text, and whether it ends its file (the eos).
std::uint64_t cache_key(const Chunk& c) { return c.ends_file ? rng::mix64(c.hash ^ 0xe05) : c.hash; }

std::string chunk_path(const std::string& out, std::size_t i) {
  char b[32];
  std::snprintf(b, sizeof b, "chunk-%06zu.tok", i);
  return out + "/.prepare/" + b;
}

// A cached chunk: magic, the chunk's hash, the tokenizer's hash, the count, then int32 tokens. It
// is reused only when both hashes match (same text, same tokenizer).
bool read_chunk_cache(const std::string& path, std::uint64_t chunk_hash, std::uint64_t tok_hash,
                      std::vector<std::int32_t>* tokens) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  char magic[8];
  std::uint64_t h[3];
  if (!in.read(magic, 8) || std::memcmp(magic, kChunkMagic, 8) != 0) return false;
  if (!in.read(reinterpret_cast<char*>(h), sizeof h) || h[0] != chunk_hash || h[1] != tok_hash) return false;
  std::error_code ec;
  if (fs::file_size(path, ec) != 32 + 4 * h[2]) return false;
  if (!tokens) return true;
  tokens->resize(static_cast<std::size_t>(h[2]));
  return static_cast<bool>(in.read(reinterpret_cast<char*>(tokens->data()), static_cast<std::streamsize>(4 * h[2])));
}

void write_chunk_cache(const std::string& path, std::uint64_t chunk_hash, std::uint64_t tok_hash,
                       const std::vector<std::int32_t>& tokens) {
  std::string bytes(32 + 4 * tokens.size(), '\0');
  const std::uint64_t h[3] = {chunk_hash, tok_hash, tokens.size()};
  std::memcpy(bytes.data(), kChunkMagic, 8);
  std::memcpy(bytes.data() + 8, h, sizeof h);
  std::memcpy(bytes.data() + 32, tokens.data(), 4 * tokens.size());
  write_file_atomically(path, bytes, "loom data prepare chunk");
}

// The training lines: every line of the training chunks, in order.
std::function<bool(std::string&)> training_lines(const Scan& s) {
  struct State {
    std::size_t chunk = 0, at = 0;
    std::string text;
  };
  auto st = std::make_shared<State>();
  return [&s, st](std::string& line) {
    for (;;) {
      if (st->at >= st->text.size()) {
        while (st->chunk < s.chunks.size() && s.chunks[st->chunk].val) ++st->chunk;
        if (st->chunk == s.chunks.size()) return false;
        const Chunk& c = s.chunks[st->chunk++];
        st->text = read_range(s.inputs[static_cast<std::size_t>(c.file)].path, c.offset, c.length);
        st->at = 0;
      }
      std::size_t nl = st->text.find('\n', st->at);
      if (nl == std::string::npos) nl = st->text.size();
      // SentencePiece skips lines over its max_sentence_length (4192 bytes): long ones go in pieces.
      std::size_t end = std::min(nl, st->at + 4000);
      while (end < nl && (static_cast<unsigned char>(st->text[end]) & 0xc0) == 0x80) --end;
      line.assign(st->text, st->at, end - st->at);
      st->at = end == nl ? nl + 1 : end;
      if (!line.empty()) return true;
    }
  };
}

// OUT/tokenizer.model: trained (unless OUT/.prepare/tokenizer.json records it was, for this very
// spec), or the given model copied. Rank 0.
void make_tokenizer(const Options& o, const Scan& s, const json& spec, int threads) {
  const std::string model = o.out + "/tokenizer.model", record = o.out + "/.prepare/tokenizer.json";
  std::error_code ec;
  if (!o.tokenizer.empty()) {
    const std::string bytes = read_file(o.tokenizer, "--tokenizer");
    Tokenizer::load(o.tokenizer, "--tokenizer");  // refuses what is not a model, naming the option
    write_file_atomically(model, bytes, "loom data prepare tokenizer");
    return;
  }
  if (fs::exists(model, ec) && fs::exists(record, ec)) {
    try {
      if (json::parse(read_file(record, "tokenizer record")) == spec) {
        std::cout << "tokenizer: " << model << " was trained for these inputs and options already: kept\n";
        return;
      }
    } catch (const std::exception&) {
    }
  }
  TokenizerTraining t;
  t.model_type = o.model_type;
  t.vocab = o.vocab;
  t.threads = threads;
  t.max_sentences = o.max_sentences;
  t.seed = o.seed;
  const double t0 = Progress::now();
  std::cout << "tokenizer: training a SentencePiece " << o.model_type << " model of " << o.vocab
            << " tokens on the training chunks' lines (at most " << o.max_sentences << ")" << std::endl;
  const std::string bytes = train_tokenizer(t, training_lines(s));
  write_file_atomically(model, bytes, "loom data prepare tokenizer");
  write_file_atomically(record, spec.dump(), "loom data prepare tokenizer record");
  std::printf("tokenizer: trained in %.1f s, written to %s\n", Progress::now() - t0, model.c_str());
}

struct EncodeStats {
  std::int64_t chunks = 0, cached = 0, bytes = 0, mismatched = 0;
  double seconds = 0;
};

// This rank's chunks (i % ranks == rank), `threads` at a time; cached chunks are skipped.
EncodeStats encode(const Options& o, const Scan& s, const Tokenizer& tok, std::uint64_t tok_hash, int rank, int ranks,
                   int threads) {
  std::vector<std::size_t> pending;
  EncodeStats st;
  std::int64_t pending_bytes = 0;
  for (std::size_t i = static_cast<std::size_t>(rank); i < s.chunks.size(); i += static_cast<std::size_t>(ranks)) {
    ++st.chunks;
    if (read_chunk_cache(chunk_path(o.out, i), cache_key(s.chunks[i]), tok_hash, nullptr)) {
      ++st.cached;
      continue;
    }
    pending.push_back(i);
    pending_bytes += s.chunks[i].length;
  }
  const char* stop_env = std::getenv("LOOM_PREPARE_STOP_AFTER");  // tests: a run killed after N chunks
  const long stop_after = stop_env ? std::atol(stop_env) : -1;
  Progress progress(pending_bytes, rank == 0);
  std::atomic<std::size_t> next{0};
  std::atomic<std::int64_t> mismatched{0}, done{0};
  std::string error;
  std::mutex error_m;
  const double t0 = Progress::now();
  auto work = [&] {
    Tokenizer::LineCache cache;
    for (std::size_t k; (k = next++) < pending.size();) {
      try {
        const Chunk& c = s.chunks[pending[k]];
        const std::string& path = s.inputs[static_cast<std::size_t>(c.file)].path;
        const std::string text = read_range(path, c.offset, c.length);
        if (hash_bytes(text.data(), text.size()) != c.hash)
          throw InputError("--input " + quote_path(path) + " changed while it was prepared (bytes " +
                           std::to_string(c.offset) + " .. " + std::to_string(c.offset + c.length) +
                           " differ from the scan); run again on a file that stays as it is");
        std::vector<std::int32_t> ids = tok.encode(text, &cache);
        if (o.verify && tok.decode(ids) != text) ++mismatched;
        if (c.ends_file && tok.eos_id() >= 0) ids.push_back(tok.eos_id());
        write_chunk_cache(chunk_path(o.out, pending[k]), cache_key(c), tok_hash, ids);
        progress.add(c.length);
        if (stop_after >= 0 && ++done >= stop_after) std::_Exit(137);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(error_m);
        if (error.empty()) error = e.what();
        next = pending.size();
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (!error.empty()) throw InputError("rank " + std::to_string(rank) + ": " + error);
  st.seconds = Progress::now() - t0;
  st.bytes = pending_bytes;
  st.mismatched = mismatched;
  return st;
}

// Every rank throws the same InputError when any rank failed: the lowest failing rank's message.
void agree(const std::string& error, int rank, int ranks) {
  int first = error.empty() ? ranks : rank;
  MPI_Allreduce(MPI_IN_PLACE, &first, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (first == ranks) return;
  std::string msg = error;
  long long n = static_cast<long long>(msg.size());
  MPI_Bcast(&n, 1, MPI_LONG_LONG, first, MPI_COMM_WORLD);
  msg.resize(static_cast<std::size_t>(n));
  MPI_Bcast(msg.data(), static_cast<int>(n), MPI_CHAR, first, MPI_COMM_WORLD);
  throw AlikeOnEveryRank(msg);
}

struct SplitOut {
  json shards = json::array();
  std::int64_t tokens = 0, text_bytes = 0, chunks = 0;
};

// The chunks of one split, in order, into shards of at most o.shard_tokens. Rank 0.
SplitOut assemble(const Options& o, const Scan& s, bool val, std::uint64_t tok_hash, int vocab) {
  SplitOut out;
  std::vector<std::int32_t> shard, ids;
  auto flush = [&] {
    if (shard.empty()) return;
    char name[40];
    std::snprintf(name, sizeof name, "%s_%06zu.bin", val ? "val" : "train", out.shards.size());
    write_token_shard(o.out + "/" + name, shard, vocab);
    std::error_code ec;
    out.shards.push_back({{"file", name},
                          {"tokens", shard.size()},
                          {"bytes", fs::file_size(o.out + "/" + name, ec)},
                          {"hash64", hex(hash_bytes(reinterpret_cast<const char*>(shard.data()), 4 * shard.size()))}});
    shard.clear();
  };
  for (std::size_t i = 0; i < s.chunks.size(); ++i) {
    const Chunk& c = s.chunks[i];
    if (c.val != val) continue;
    if (!read_chunk_cache(chunk_path(o.out, i), cache_key(c), tok_hash, &ids))
      throw InputError("loom data prepare: the encoded chunk " + chunk_path(o.out, i) +
                       " is missing or damaged; run the command again (it encodes what is missing)");
    ++out.chunks;
    out.text_bytes += c.length;
    out.tokens += static_cast<std::int64_t>(ids.size());
    for (std::size_t at = 0; at < ids.size();) {
      const std::size_t take =
          std::min<std::size_t>(ids.size() - at, static_cast<std::size_t>(o.shard_tokens) - shard.size());
      shard.insert(shard.end(), ids.begin() + static_cast<std::ptrdiff_t>(at),
                   ids.begin() + static_cast<std::ptrdiff_t>(at + take));
      at += take;
      if (static_cast<std::int64_t>(shard.size()) == o.shard_tokens) flush();
    }
  }
  flush();
  return out;
}

// A finished preparation of the same inputs and options: its shards all there at their sizes.
bool up_to_date(const Options& o, const json& scan_j, const json& opts) {
  const std::string path = o.out + "/manifest.json";
  std::error_code ec;
  if (!fs::exists(path, ec)) return false;
  json m;
  try {
    m = json::parse(read_file(path, "manifest"));
  } catch (const std::exception& e) {
    throw InputError("--out " + quote_path(o.out) + ": its manifest.json cannot be read (" + e.what() +
                     "); remove it or give --overwrite");
  }
  // What differs, named: the format, the inputs (their number, or the first that differs), an option.
  std::string diff;
  if (m.value("format", "") != kFormat) diff = "format " + m.value("format", std::string("(none)"));
  const json& was = m.contains("inputs") ? m["inputs"] : json::array();
  const json& now = scan_j["inputs"];
  if (diff.empty() && was.size() != now.size())
    diff = std::to_string(was.size()) + " input file(s) then, " + std::to_string(now.size()) + " now";
  for (std::size_t i = 0; diff.empty() && i < now.size(); ++i)
    if (was[i] != now[i]) diff = "input " + now[i]["path"].get<std::string>() + " (then " + was[i].dump() + ")";
  if (diff.empty() && m.contains("options") && m["options"] != opts)
    for (const auto& [k, v] : opts.items())
      if (diff.empty() && (!m["options"].contains(k) || m["options"][k] != v))
        diff = "option " + k + " = " + v.dump() + " (then " +
               (m["options"].contains(k) ? m["options"][k].dump() : "unset") + ")";
  if (!diff.empty()) {
    if (o.overwrite) return false;
    throw InputError("--out " + quote_path(o.out) +
                     " holds a finished preparation of other inputs or options (its manifest.json; first difference: " +
                     diff + "); give --overwrite to replace it, or another --out");
  }
  for (const char* split : {"train", "val"})
    for (const auto& sh : m["splits"][split]["shards"])
      if (fs::file_size(o.out + "/" + sh["file"].get<std::string>(), ec) != sh["bytes"].get<std::uintmax_t>() || ec)
        return false;
  return true;
}

// Every train_*.bin and val_*.bin in OUT, and the manifest: the deck's globs must see this
// preparation's shards alone.
void remove_earlier(const Options& o) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(o.out, ec)) {
    const std::string n = e.path().filename().string();
    if ((n.rfind("train_", 0) == 0 || n.rfind("val_", 0) == 0) && e.path().extension() == ".bin")
      fs::remove(e.path(), ec);
  }
  fs::remove(o.out + "/manifest.json", ec);
}

json manifest(const Options& o, const json& scan_j, const json& opts, const Tokenizer& tok, std::uint64_t tok_hash,
              const SplitOut& train, const SplitOut& val, bool verified) {
  auto split = [](const SplitOut& x) {
    return json{{"shards", x.shards}, {"tokens", x.tokens}, {"text_bytes", x.text_bytes}, {"chunks", x.chunks}};
  };
  const std::string dir = o.out;
  return {
      {"format", kFormat},
      {"created", now_utc()},
      {"loom", std::string(build::version) + " (" + build::git_commit + ")"},
      {"inputs", scan_j["inputs"]},
      {"options", opts},
      {"tokenizer",
       {{"file", "tokenizer.model"}, {"vocab", tok.vocab()}, {"eos_id", tok.eos_id()}, {"hash64", hex(tok_hash)}}},
      {"shard_format",
       "llm.c token shard: 256 int32 header (magic 20240520, version 1: uint16 tokens, 2: uint32; "
       "token count), then the tokens; a document ends with the tokenizer's eos"},
      {"splits", {{"train", split(train)}, {"val", split(val)}}},
      {"round_trip", verified ? "checked (--verify): decode(encode(chunk)) == chunk for every chunk" : "not checked"},
      {"deck",
       {{"data.source", "tokens:" + dir + "/train_*.bin"},
        {"data.val_source", "tokens:" + dir + "/val_*.bin"},
        {"data.tokenizer", dir + "/tokenizer.model"},
        {"model.vocab", tok.vocab()}}}};
}

int default_threads() {
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  int local = 1;
  MPI_Comm_size(node, &local);
  MPI_Comm_free(&node);
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / local);
}

// Scan on rank 0; true (on every rank) when OUT is already up to date.
bool scan_stage(const Options& o, int rank, Scan& s, json& scan_j, json& opts) {
  std::string blob;
  on_rank0(rank, [&] {
    std::string given_hash;
    if (!o.tokenizer.empty()) {
      const std::string b = read_file(o.tokenizer, "--tokenizer");
      given_hash = hex(hash_bytes(b.data(), b.size()));
    }
    std::error_code ec;  // a bad --out is said before the inputs are read
    fs::create_directories(o.out + "/.prepare", ec);
    if (ec) throw InputError("--out " + quote_path(o.out) + ": cannot be created (" + ec.message() + ")");
    const double t0 = Progress::now();
    s = scan(o);
    scan_j = scan_json(s);
    opts = options_json(o, given_hash);
    std::int64_t bytes = 0;
    for (const Input& i : s.inputs) bytes += i.bytes;
    std::printf(
        "scan: %zu file(s), %.1f MB of UTF-8 text, %zu chunks (%zu held out), in %.1f s\n", s.inputs.size(),
        bytes / 1e6, s.chunks.size(),
        static_cast<std::size_t>(std::count_if(s.chunks.begin(), s.chunks.end(), [](auto& c) { return c.val; })),
        Progress::now() - t0);
    const bool done = up_to_date(o, scan_j, opts);
    blob = json{{"scan", scan_j}, {"opts", opts}, {"done", done}}.dump();
  });
  bcast_string(blob);
  const json j = json::parse(blob);
  if (rank != 0) {
    scan_j = j["scan"];
    opts = j["opts"];
    s = scan_from_json(scan_j);
  }
  return j["done"].get<bool>();
}

int prepare(const Options& o) {
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const int threads = o.threads > 0 ? o.threads : default_threads();
  Scan s;
  json scan_j, opts;
  if (scan_stage(o, rank, s, scan_j, opts)) {
    if (rank == 0)
      std::cout << "loom data prepare: " << o.out << " is up to date (its manifest.json records these inputs and "
                << "options): nothing to do\n";
    return 0;
  }
  // The tokenizer is kept for these options and these training chunks only.
  std::uint64_t train_digest = 0;
  for (const Chunk& c : s.chunks)
    if (!c.val) train_digest = rng::mix64(train_digest ^ c.hash);
  const json spec = {{"options", opts}, {"training_chunks", hex(train_digest)}};
  std::string model_bytes;
  on_rank0(rank, [&] {
    make_tokenizer(o, s, spec, threads);
    model_bytes = read_file(o.out + "/tokenizer.model", "tokenizer");
  });
  bcast_string(model_bytes);  // every rank the same model, whatever its view of the file system
  const auto tok = Tokenizer::from_bytes(model_bytes, "tokenizer");
  const std::uint64_t tok_hash = hash_bytes(model_bytes.data(), model_bytes.size());
  EncodeStats st;
  std::string err;
  try {
    st = encode(o, s, *tok, tok_hash, rank, ranks, threads);
  } catch (const std::exception& e) {
    err = e.what();
  }
  agree(err, rank, ranks);
  std::int64_t sums[4] = {st.bytes, st.cached, st.mismatched, st.chunks};
  MPI_Allreduce(MPI_IN_PLACE, sums, 4, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  double slowest = st.seconds;
  MPI_Allreduce(MPI_IN_PLACE, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  if (sums[2] > 0)  // the sums are every rank's: each throws the same error
    throw AlikeOnEveryRank(
        "--verify: " + std::to_string(sums[2]) +
        " chunk(s) do not decode to their text: the tokenizer is not byte-exact on this text (a given "
        "--tokenizer that normalises, or text holding U+2581)");
  on_rank0(rank, [&] {
    if (sums[1] > 0)
      std::printf("encode: resumed: %lld of %lld chunks were encoded already\n", static_cast<long long>(sums[1]),
                  static_cast<long long>(sums[3]));
    std::printf("encode: %.1f MB in %.2f s: %.2f MB/s on %d rank(s) x %d thread(s)%s\n", sums[0] / 1e6, slowest,
                slowest > 0 ? sums[0] / 1e6 / slowest : 0.0, ranks, threads, o.verify ? ", each chunk verified" : "");
    remove_earlier(o);  // an earlier preparation's shards (--overwrite, a crash): only now that this one is encoded
    const SplitOut train = assemble(o, s, false, tok_hash, tok->vocab());
    const SplitOut val = assemble(o, s, true, tok_hash, tok->vocab());
    const json m = manifest(o, scan_j, opts, *tok, tok_hash, train, val, o.verify);
    write_file_atomically(o.out + "/manifest.json", m.dump(2) + "\n", "loom data prepare manifest");
    std::error_code ec;
    fs::remove_all(o.out + "/.prepare", ec);  // the manifest marks the folder complete
    std::printf(
        "wrote %s: train %lld tokens in %zu shard(s), val %lld tokens in %zu; %.3f bytes of text per token\n",
        o.out.c_str(), static_cast<long long>(train.tokens), train.shards.size(), static_cast<long long>(val.tokens),
        val.shards.size(),
        static_cast<double>(train.text_bytes + val.text_bytes) / static_cast<double>(train.tokens + val.tokens));
    std::cout << "deck:  data.source = " << m["deck"]["data.source"].get<std::string>() << "\n";
    if (m["deck"].contains("data.val_source"))
      std::cout << "       data.val_source = " << m["deck"]["data.val_source"].get<std::string>() << "\n";
    std::cout << "       data.tokenizer = " << m["deck"]["data.tokenizer"].get<std::string>()
              << "\n       model.vocab = " << tok->vocab() << "\n";
  });
  return 0;
}

}  // namespace
}  // namespace loom

namespace loom {
int command_data(const std::vector<std::string>& rest) {
  if (rest.empty() || rest[0] != "prepare")
    throw UsageError("loom data: expects `prepare` (loom data prepare --input GLOB --out DIR [options]; --help)");
  return prepare(parse(std::vector<std::string>(rest.begin() + 1, rest.end())));
}
}  // namespace loom
