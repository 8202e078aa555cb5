#pragma once
// Subword tokenizers: SentencePiece models (BPE or unigram), trained by `loom data prepare` or given
// as a `.model` file, loaded by decks (data.tokenizer), `loom sample` and `loom eval`.
//
// Models trained here are byte-exact: identity normalisation, no dummy prefix, whitespace kept as it
// is, and byte fallback (a byte no piece covers becomes one of 256 byte pieces), so decode(encode(t))
// == t for any UTF-8 text t that does not itself contain U+2581, SentencePiece's space mark.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace loom {

class Tokenizer {
 public:
  // Loads a SentencePiece model file. InputError naming `what` (a deck key or option) and the path
  // for a missing, unreadable or malformed file.
  static std::unique_ptr<Tokenizer> load(const std::string& path, const std::string& what);
  // From the bytes of a model file (what training returns).
  static std::unique_ptr<Tokenizer> from_bytes(const std::string& model, const std::string& what);
  ~Tokenizer();

  int vocab() const;   // pieces, ids 0 .. vocab()-1
  int eos_id() const;  // -1 when the model has none
  // Lines seen before, with their ids, for one thread: text repeats whole lines (markup, code, blank
  // lines; 10% of the bytes of Python's documentation), and a line's ids do not depend on its
  // neighbours, since encode() takes text line by line.
  struct LineCache {
    std::unordered_map<std::string, std::vector<std::int32_t>> ids;
    std::size_t bytes = 0;
  };
  // Thread-safe (the model is read only); `cache`, if given, is the calling thread's own.
  std::vector<std::int32_t> encode(std::string_view text, LineCache* cache = nullptr) const;
  std::string decode(const std::vector<std::int32_t>& ids) const;
  // The bytes of text each id stands for: a byte piece 1, a control or unknown piece 0, any other
  // piece its UTF-8 length with SentencePiece's space mark counted as the one byte of a space.
  // Bits per byte divide by their sum.
  std::vector<int> token_bytes() const;

 private:
  Tokenizer();
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
  bool dummy_prefix_ = false;  // the model puts a space mark before its input (add_dummy_prefix)
};

struct TokenizerTraining {
  std::string model_type = "bpe";  // bpe | unigram
  int vocab = 8192;
  int threads = 1;
  std::uint64_t max_sentences = 2000000;  // a uniform sample of this many lines when there are more
  unsigned seed = 1;
};
// Trains a byte-exact model (see above) on the lines `next_line` yields (it returns false at the
// end) and returns the model file's bytes. InputError with SentencePiece's reason on failure (a
// vocabulary larger than the text supports, say).
std::string train_tokenizer(const TokenizerTraining& opts, const std::function<bool(std::string& line)>& next_line);

}  // namespace loom
