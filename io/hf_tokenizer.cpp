// `loom ckpt hf --tokenizer FILE.model`: a SentencePiece model beside Hugging Face's files.
//
// The file is copied as it is; loom does not link SentencePiece here, so it only reads enough of the
// protobuf (ModelProto: field 1, the pieces, each a SentencePiece {1: piece, 2: score, 3: type}) to
// know it is one, count its pieces against the model's vocabulary and name its special pieces.
//
// tokenizer_config.json names LlamaTokenizer: transformers' plain SentencePiece tokenizer, which with
// add_bos_token and add_eos_token false and legacy true encodes exactly as the model's own
// EncodeAsIds. T5Tokenizer would append </s> to every text and add 100 <extra_id_*> tokens past the
// model's pieces. unk, bos and eos name pieces the model holds (or null): a special token outside it
// would be added as a new id past the vocabulary.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "core/base/error.hpp"
#include "io/hf.hpp"
#include "io/hf_arch.hpp"

namespace loom {
namespace {

struct Piece {
  std::string text;
  int type = 1;  // NORMAL; 2 UNKNOWN, 3 CONTROL, 4 USER_DEFINED, 5 UNUSED, 6 BYTE
};

bool varint(const unsigned char*& p, const unsigned char* end, std::uint64_t& v) {
  v = 0;
  for (int shift = 0; p < end && shift < 64; shift += 7) {
    const unsigned char b = *p++;
    v |= std::uint64_t(b & 0x7f) << shift;
    if (!(b & 0x80)) return true;
  }
  return false;
}

// Each field of one protobuf message in [p, end): f(field, wire, value, bytes of a length-delimited
// one). False where the bytes are not a message.
template <class F>
bool fields(const unsigned char* p, const unsigned char* end, F f) {
  while (p < end) {
    std::uint64_t tag = 0, v = 0;
    if (!varint(p, end, tag) || (tag >> 3) == 0) return false;
    const int wire = static_cast<int>(tag & 7);
    const unsigned char* at = p;
    if (wire == 0) {
      if (!varint(p, end, v)) return false;
    } else if (wire == 1 || wire == 5) {
      if (end - p < (wire == 1 ? 8 : 4)) return false;
      p += wire == 1 ? 8 : 4;
    } else if (wire == 2) {
      if (!varint(p, end, v) || v > static_cast<std::uint64_t>(end - p)) return false;
      at = p;
      p += v;
    } else {
      return false;
    }
    f(static_cast<int>(tag >> 3), wire, v, at);
  }
  return true;
}

std::vector<Piece> pieces_of(const std::string& path, const std::vector<unsigned char>& bytes) {
  const std::string what = "--tokenizer " + quote_path(path);
  // A serialised ModelProto starts with its first piece: field 1, length-delimited (0x0a).
  if (bytes.empty()) throw InputError(what + " is empty (a SentencePiece model file, *.model, is expected)");
  std::vector<Piece> pieces;
  bool inner_ok = true;
  const bool ok = fields(
      bytes.data(), bytes.data() + bytes.size(), [&](int field, int wire, std::uint64_t len, const unsigned char* at) {
        if (field != 1 || wire != 2) return;
        Piece piece;
        inner_ok = inner_ok && fields(at, at + len, [&](int f, int w, std::uint64_t v, const unsigned char* a) {
                     if (f == 1 && w == 2) piece.text.assign(reinterpret_cast<const char*>(a), v);
                     if (f == 3 && w == 0) piece.type = static_cast<int>(v);
                   });
        pieces.push_back(piece);
      });
  if (bytes[0] != 0x0a || !ok || !inner_ok || pieces.empty())
    throw InputError(what + " is not a SentencePiece model (a protobuf whose first field is its pieces); " +
                     "name the *.model file spm_train wrote, not its *.vocab");
  return pieces;
}

}  // namespace

std::string write_hf_tokenizer(const std::string& dir, const std::string& model_file, const GPTConfig& cfg) {
  std::ifstream in(model_file, std::ios::binary);
  if (!in) throw InputError("--tokenizer " + quote_path(model_file) + " cannot be read (missing or unreadable)");
  const std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::vector<Piece> pieces = pieces_of(model_file, bytes);
  if (static_cast<std::int64_t>(pieces.size()) > cfg.vocab)
    throw InputError("--tokenizer " + quote_path(model_file) + " holds " + std::to_string(pieces.size()) +
                     " pieces, more than the model's vocabulary of " + std::to_string(cfg.vocab) +
                     " (model.vocab): its higher ids have no embedding; name the tokenizer the data was made with");
  nlohmann::json unk = nullptr, bos = nullptr, eos = nullptr;
  for (const Piece& p : pieces) {
    if (p.type == 2 && unk.is_null()) unk = p.text;
    if (p.type == 3 && p.text == "<s>") bos = p.text;
    if (p.type == 3 && p.text == "</s>") eos = p.text;
  }
  const nlohmann::json config = {{"tokenizer_class", "LlamaTokenizer"},
                                 {"add_bos_token", false},
                                 {"add_eos_token", false},
                                 {"legacy", true},
                                 {"clean_up_tokenization_spaces", false},
                                 {"model_max_length", cfg.seq_len},
                                 {"unk_token", unk},
                                 {"bos_token", bos},
                                 {"eos_token", eos},
                                 {"pad_token", nullptr},
                                 {"sp_model_kwargs", nlohmann::json::object()}};
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (!std::filesystem::is_directory(dir, ec)) throw InputError("cannot make the folder " + quote_path(dir));
  hf::write_atomic(dir + "/tokenizer.model", [&](std::ofstream& out) {
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  });
  hf::write_atomic(dir + "/tokenizer_config.json", [&](std::ofstream& out) { out << config.dump(2) << "\n"; });
  auto name = [](const nlohmann::json& j) { return j.is_null() ? std::string("none") : j.get<std::string>(); };
  return "tokenizer.model (" + std::to_string(pieces.size()) + " pieces; unk " + name(unk) + ", bos " + name(bos) +
         ", eos " + name(eos) + ") and tokenizer_config.json (LlamaTokenizer, adding no tokens)";
}

}  // namespace loom
