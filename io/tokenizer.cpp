#include "io/tokenizer.hpp"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <map>
#include <unordered_map>

#include "core/base/error.hpp"
#include "io/util.hpp"

namespace loom {

namespace {

// SentencePiece pulls training lines through this; a line longer than max_sentence_length is
// skipped by SentencePiece itself.
class LineSource final : public sentencepiece::SentenceIterator {
 public:
  explicit LineSource(const std::function<bool(std::string&)>& next) : next_(next) { Next(); }
  bool done() const override { return done_; }
  void Next() override { done_ = !next_(line_); }
  const std::string& value() const override { return line_; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  const std::function<bool(std::string&)>& next_;
  std::string line_;
  bool done_ = false;
};

constexpr const char* kSpaceMark = "\xe2\x96\x81";  // U+2581, SentencePiece's stand-in for a space

}  // namespace

Tokenizer::Tokenizer() : sp_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {}
Tokenizer::~Tokenizer() = default;

std::unique_ptr<Tokenizer> Tokenizer::load(const std::string& path, const std::string& what) {
  require_regular_file(path, what);
  const std::string bytes = read_file(path, what);
  try {
    return from_bytes(bytes, what);
  } catch (const InputError& e) {
    throw InputError(what + " " + quote_path(path) + ": " + e.what());
  }
}

std::unique_ptr<Tokenizer> Tokenizer::from_bytes(const std::string& model, const std::string& what) {
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  if (model.empty()) throw InputError("the file is empty; a SentencePiece model (.model) was expected");
  const auto st = t->sp_->LoadFromSerializedProto(model);
  if (!st.ok())
    throw InputError("not a SentencePiece model (.model) file: " + st.ToString() + " (" + what +
                     " takes the .model file `loom data prepare` or spm_train writes)");
  // add_dummy_prefix (not readable without the model's protobuf schema): "x" encodes with a space mark.
  std::vector<std::string> pieces;
  t->dummy_prefix_ = t->sp_->Encode("x", &pieces).ok() && !pieces.empty() && pieces[0].rfind(kSpaceMark, 0) == 0;
  return t;
}

int Tokenizer::vocab() const { return sp_->GetPieceSize(); }
int Tokenizer::eos_id() const { return sp_->eos_id(); }

std::vector<std::int32_t> Tokenizer::encode(std::string_view text, LineCache* cache) const {
  std::vector<std::int32_t> out;
  std::vector<int> ids;
  auto piece = [&](std::string_view t) {
    const auto st = sp_->Encode(t, &ids);
    if (!st.ok()) throw InputError("SentencePiece could not encode the text: " + st.ToString());
    out.insert(out.end(), ids.begin(), ids.end());
  };
  // Line by line, each newline its byte piece: SentencePiece's encoder slows down on long inputs
  // (3x on 1 MB), and the model was trained on lines. A model without byte pieces, or one that adds
  // a leading space mark to each input (Llama's), takes it whole: per line it would add one a line.
  const int newline = sp_->PieceToId("<0x0A>");
  if (newline == sp_->unk_id() || !sp_->IsByte(newline) || dummy_prefix_) {
    piece(text);
    return out;
  }
  out.reserve(text.size() / 3);
  for (std::size_t at = 0; at < text.size();) {
    std::size_t nl = text.find('\n', at);
    if (nl == std::string_view::npos) nl = text.size();
    const std::string_view line = text.substr(at, nl - at);
    // Short lines are the ones that repeat; the cache stops growing at 64 MiB of keys.
    if (cache && !line.empty() && line.size() <= 128) {
      const auto hit = cache->ids.find(std::string(line));
      if (hit != cache->ids.end()) {
        out.insert(out.end(), hit->second.begin(), hit->second.end());
      } else {
        const std::size_t before = out.size();
        piece(line);
        if (cache->bytes < (64u << 20)) {
          cache->ids.emplace(std::string(line),
                             std::vector<std::int32_t>(out.begin() + static_cast<std::ptrdiff_t>(before), out.end()));
          cache->bytes += line.size() + 4 * (out.size() - before) + 64;
        }
      }
    } else if (!line.empty()) {
      piece(line);
    }
    if (nl < text.size()) out.push_back(newline);
    at = nl + 1;
  }
  return out;
}

std::string Tokenizer::decode(const std::vector<std::int32_t>& ids) const {
  const int V = vocab();
  for (std::int32_t id : ids)
    if (id < 0 || id >= V)
      throw InputError("token id " + std::to_string(id) + " is outside the tokenizer's vocabulary [0, " +
                       std::to_string(V - 1) + "]");
  std::string out;
  const auto st = sp_->Decode(std::vector<int>(ids.begin(), ids.end()), &out);
  if (!st.ok()) throw InputError("SentencePiece could not decode the ids: " + st.ToString());
  return out;
}

std::vector<int> Tokenizer::token_bytes() const {
  std::vector<int> bytes(static_cast<std::size_t>(vocab()), 0);
  for (int id = 0; id < vocab(); ++id) {
    if (sp_->IsControl(id) || sp_->IsUnknown(id) || sp_->IsUnused(id)) continue;
    if (sp_->IsByte(id)) {
      bytes[static_cast<std::size_t>(id)] = 1;
      continue;
    }
    const std::string& piece = sp_->IdToPiece(id);
    int n = 0;
    for (std::size_t i = 0; i < piece.size();) {
      if (piece.compare(i, 3, kSpaceMark) == 0) {
        n += 1;
        i += 3;
      } else {
        n += 1;
        i += 1;
      }
    }
    bytes[static_cast<std::size_t>(id)] = n;
  }
  return bytes;
}

std::string train_tokenizer(const TokenizerTraining& o, const std::function<bool(std::string&)>& next_line) {
  if (o.model_type != "bpe" && o.model_type != "unigram")
    throw InputError("--model-type " + quote_value(o.model_type) + ": valid values are bpe, unigram");
  // Byte-exact settings (the header says why); split_digits as Llama's tokenizer does.
  const std::unordered_map<std::string, std::string> args = {{"model_type", o.model_type},
                                                             {"vocab_size", std::to_string(o.vocab)},
                                                             {"byte_fallback", "true"},
                                                             {"normalization_rule_name", "identity"},
                                                             {"add_dummy_prefix", "false"},
                                                             {"remove_extra_whitespaces", "false"},
                                                             {"allow_whitespace_only_pieces", "true"},
                                                             {"split_digits", "true"},
                                                             {"character_coverage", "0.9995"},
                                                             {"input_sentence_size", std::to_string(o.max_sentences)},
                                                             {"shuffle_input_sentence", "true"},
                                                             {"num_threads", std::to_string(o.threads)},
                                                             {"minloglevel", "1"}};
  sentencepiece::SetRandomGeneratorSeed(o.seed);
  std::uint64_t count = 0;
  const std::function<bool(std::string&)> counted = [&](std::string& line) { return next_line(line) && ++count; };
  LineSource lines(counted);
  std::string model;
  const auto st = sentencepiece::SentencePieceTrainer::Train(args, &lines, &model);
  if (count == 0) throw InputError("--input: the training chunks hold no line of text to train a tokenizer on");
  if (!st.ok())
    throw InputError("training the SentencePiece " + o.model_type + " model of vocabulary " + std::to_string(o.vocab) +
                     " failed: " + st.ToString() +
                     " (loom trains with character_coverage 0.9995 and byte fallback: give another --vocab)");
  return model;
}

}  // namespace loom
