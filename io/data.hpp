#pragma once
// Datasets and the batch loader. The order of the data is a function of the seed alone: sample
// `index` of global step `step` is the same token sequence whatever the layout, so every layout
// trains the same model (DESIGN.md).
//
// Sources (deck key data.source):
//   synthetic    a first-order Markov chain over the vocabulary with a known conditional entropy,
//                so the best achievable loss is known (best_loss()).
//   text:PATH    the bytes of a file (vocabulary 256).
//   tokens:GLOB  binary shards in llm.c's layout: 256 int32 header (magic 20240520, version, token
//                count), then the tokens: version 1 uint16 (llm.c's), version 2 uint32 (loom's, for a
//                vocabulary above 65,536); files in sorted glob order, concatenated. A manifest.json
//                beside them (`loom data prepare`) has its tokenizer's vocabulary checked (check_vocab).
// A held-out split (the last data.val_fraction of the token stream) gives the validation loss.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/base/error.hpp"

namespace loom {

enum class Split { train, val };

struct DataConfig {
  std::string key = "data.source";  // the deck key that names the source, for messages
  std::string source = "synthetic";
  int vocab = 256;
  int seq_len = 64;
  std::uint64_t seed = 1337;
  double val_fraction = 0.1;     // held-out share of the token stream (text/tokens)
  double synthetic_noise = 0.1;  // synthetic: probability that the next token is uniform instead of the chain's
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  // One line for the start-up banner: kind, file(s), token counts of each split.
  virtual std::string describe() const = 0;
  // Writes the seq_len + 1 tokens of sample `index` of global step `step` of `split` into `out`.
  // inputs are out[0..T-1], targets out[1..T]. Pure function of (seed, split, step, index).
  virtual void sample(Split split, std::int64_t step, std::int64_t index, std::int32_t* out) const = 0;
  // The lowest achievable mean cross-entropy (nats/token), when the source knows it (synthetic).
  virtual std::optional<double> best_loss() const { return std::nullopt; }
  virtual std::int64_t tokens(Split split) const = 0;
};

// Opens the source named by cfg.source. Throws InputError naming cfg.key, the file and, for bad
// contents, the byte offset: missing or unreadable file, a directory, empty file, a glob that matches
// nothing, a file shorter than its header, a size other than its header's token count implies
// (truncated or longer), a wrong magic or version,
// a token id >= cfg.vocab, too few tokens for one sequence of seq_len + 1 in either split, an
// unknown source kind.
std::unique_ptr<Dataset> open_dataset(const DataConfig& cfg);

// model.vocab must hold every id of a tokenizer of `tokenizer_vocab` tokens and not be larger than
// that padded to a multiple of 128 (Megatron's padding); else InputError naming `what` and the
// valid values.
void check_vocab(int model_vocab, int tokenizer_vocab, const std::string& what);
// The tokenizer a source's shards come with: for tokens:GLOB whose first file has a manifest.json
// beside it, the manifest's tokenizer file (resolved against that folder); else "".
std::string manifest_tokenizer(const std::string& source);
// Writes a shard (version 1 when vocab <= 65,536, else version 2) through path.tmp and a rename.
void write_token_shard(const std::string& path, const std::vector<std::int32_t>& tokens, int vocab);

// A batch of `rows` samples of a step: inputs[r*T + t] and targets[r*T + t], int32.
struct Batch {
  int rows = 0, seq_len = 0;
  std::vector<std::int32_t> inputs, targets;
};
// Fills rows first_row .. first_row+rows-1 of global step `step` (so a micro-batch, or a dp rank's
// part of the global batch, reads only its own rows).
void load_batch(const Dataset& ds, Split split, std::int64_t step, std::int64_t first_row, int rows, int seq_len,
                Batch& batch);

}  // namespace loom
