#include "io/hf.hpp"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "core/base/dtype.hpp"
#include "core/base/error.hpp"
#include "io/hf_arch.hpp"

namespace loom {

namespace hf {

void ConfigFile::fail(const std::string& what) const { throw InputError(quote_path(path) + ": " + what); }

int ConfigFile::integer(const char* key) const {
  if (!has(key)) fail(std::string("has no ") + key);
  if (!c[key].is_number_integer() || c[key].get<std::int64_t>() < 1 || c[key].get<std::int64_t>() > (1 << 30))
    fail(std::string(key) + " = " + c[key].dump() + " is not a size");
  return c[key].get<int>();
}

double ConfigFile::number(const char* key, double fallback) const {
  if (!has(key)) return fallback;
  if (!c[key].is_number()) fail(std::string(key) + " = " + c[key].dump() + " is not a number");
  return c[key].get<double>();
}

std::string ConfigFile::string(const char* key, const std::string& fallback) const {
  if (!has(key)) return fallback;
  if (!c[key].is_string()) fail(std::string(key) + " = " + c[key].dump() + " is not a string");
  return c[key].get<std::string>();
}

bool ConfigFile::boolean(const char* key, bool fallback) const {
  if (!has(key)) return fallback;
  if (!c[key].is_boolean()) fail(std::string(key) + " = " + c[key].dump() + " is not true or false");
  return c[key].get<bool>();
}

void differ(std::string& bad, const std::string& key, const std::string& ours, const char* field,
            const std::string& theirs) {
  if (ours != theirs)
    bad += std::string(bad.empty() ? "" : "; ") + key + " = " + ours + " in the deck, " + field + " = " + theirs +
           " in config.json";
}

// The file's bytes from .tmp, renamed into place once whole.
void write_atomic(const std::string& path, const std::function<void(std::ofstream&)>& body) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw InputError("cannot write " + quote_path(path) + " (its folder is not writable)");
    body(out);
    out.close();
    if (!out) {
      std::remove(tmp.c_str());
      throw InputError("writing " + quote_path(path) + " failed (disk full?); nothing was replaced");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw InputError("cannot rename " + quote_path(tmp) + " to " + quote_path(path));
  }
}

}  // namespace hf

namespace {

using json = nlohmann::json;
using hf::Tensor;

[[noreturn]] void fail(const std::string& file, const std::string& what) {
  throw InputError(quote_path(file) + ": " + what);
}

float element(const unsigned char* p, const std::string& dtype) {
  if (dtype == "F32") {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  std::uint16_t b;
  std::memcpy(&b, p, 2);
  return dtype == "BF16" ? to_float(bf16{b}) : to_float(f16{b});
}

std::int64_t numel(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::ostringstream s;
  s << "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  return s.str() + "]";
}

std::vector<std::int64_t> file_shape(const Tensor& t) {
  return t.form == Tensor::Form::transposed ? std::vector<std::int64_t>{t.shape[1], t.shape[0]} : t.shape;
}

std::vector<float> transpose(const std::vector<float>& v, std::int64_t rows, std::int64_t cols) {
  std::vector<float> out(v.size());
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c)
      out[static_cast<std::size_t>(c * rows + r)] = v[static_cast<std::size_t>(r * cols + c)];
  return out;
}

// loom's layout to the file's (to_hf) or back.
std::vector<float> convert(const Tensor& t, const GPTConfig& cfg, std::vector<float> v, bool to_hf) {
  switch (t.form) {
    case Tensor::Form::same:
      return v;
    case Tensor::Form::transposed:
      return to_hf ? transpose(v, t.shape[0], t.shape[1]) : transpose(v, t.shape[1], t.shape[0]);
    case Tensor::Form::rotary_q:
      return permute_rotary_rows(v, cfg.heads, cfg.head_size(), cfg.d_model, to_hf);
    case Tensor::Form::rotary_k:
      return permute_rotary_rows(v, cfg.kv(), cfg.head_size(), cfg.d_model, to_hf);
  }
  return v;
}

std::vector<Tensor> tensors_of(const GPTConfig& cfg) {
  return cfg.llama() ? hf::llama_tensors(cfg) : hf::gpt2_tensors(cfg);
}

const char* family(const GPTConfig& cfg) { return cfg.llama() ? "Llama" : "GPT-2"; }

hf::ConfigFile read_config(const std::string& path) {
  hf::ConfigFile f{path, {}};
  std::ifstream in(path);
  if (!in) f.fail("cannot be read (model.init_from = DIR needs DIR/config.json and DIR/model.safetensors)");
  try {
    f.c = json::parse(in);
  } catch (const json::exception& e) {
    f.fail(std::string("is not JSON: ") + e.what());
  }
  if (!f.c.is_object()) f.fail("is not a JSON object");
  return f;
}

// A safetensors file: an 8-byte little-endian header length, a JSON header, the tensors' bytes.
class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::string& path) : path_(path), in_(path, std::ios::binary | std::ios::ate) {
    if (!in_) fail(path_, "cannot be read");
    size_ = in_.tellg();
    in_.seekg(0);
    unsigned char le[8] = {};
    if (size_ < 8 || !in_.read(reinterpret_cast<char*>(le), 8)) fail(path_, "is shorter than a safetensors header");
    std::uint64_t len = 0;
    for (int b = 7; b >= 0; --b) len = len << 8 | le[b];
    if (len > static_cast<std::uint64_t>(size_ - 8) || len > (std::uint64_t(1) << 30))
      fail(path_, "its header length " + std::to_string(len) + " is past the file's " + std::to_string(size_) +
                      " bytes: not a safetensors file, or truncated");
    std::string text(len, '\0');
    in_.read(text.data(), static_cast<std::streamsize>(len));
    try {
      header_ = json::parse(text);
    } catch (const json::exception& e) {
      fail(path_, std::string("its header is not JSON: ") + e.what());
    }
    data0_ = 8 + static_cast<std::int64_t>(len);
  }
  // The name `t` is stored under (its own, else its alias); "" when neither.
  std::string find(const Tensor& t) const {
    if (header_.contains(t.theirs)) return t.theirs;
    if (!t.alias.empty() && header_.contains(t.alias)) return t.alias;
    return "";
  }
  // Tensor `name` as fp32 in the file's layout, checked to be `want` in shape and inside the file.
  std::vector<float> read(const std::string& name, const std::vector<std::int64_t>& want) {
    const json& t = header_[name];
    const std::string dtype = t.value("dtype", std::string());
    const int width = dtype == "F32" ? 4 : (dtype == "BF16" || dtype == "F16") ? 2 : 0;
    if (width == 0) fail(path_, name + " is " + dtype + "; loom reads F32, BF16 and F16");
    std::vector<std::int64_t> shape;
    std::int64_t begin = -1, end = -1;
    try {
      shape = t.at("shape").get<std::vector<std::int64_t>>();
      begin = t.at("data_offsets").at(0).get<std::int64_t>();
      end = t.at("data_offsets").at(1).get<std::int64_t>();
    } catch (const json::exception&) {
      fail(path_, name + "'s shape or data_offsets are malformed");
    }
    if (shape != want)
      fail(path_, name + " is " + shape_text(shape) + ", config.json's model needs " + shape_text(want));
    const std::int64_t n = numel(want);
    if (begin < 0 || end - begin != n * width || data0_ + end > size_)
      fail(path_, name + "'s data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + ") are not its " +
                      std::to_string(n * width) + " bytes inside the file (truncated?)");
    std::vector<unsigned char> bytes(static_cast<std::size_t>(n * width));
    in_.seekg(data0_ + begin);
    if (!in_.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size())))
      fail(path_, "cannot read " + name);
    std::vector<float> v(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i)
      v[static_cast<std::size_t>(i)] = element(&bytes[static_cast<std::size_t>(i * width)], dtype);
    return v;
  }

 private:
  std::string path_;
  std::ifstream in_;
  std::int64_t size_ = 0, data0_ = 0;
  json header_;
};

}  // namespace

std::vector<float> permute_rotary_rows(const std::vector<float>& w, int heads, int hs, int C, bool to_hf) {
  std::vector<float> out(w.size());
  for (int h = 0; h < heads; ++h)
    for (int i = 0; i < hs / 2; ++i)
      for (int p = 0; p < 2; ++p) {
        const std::int64_t ours = std::int64_t(h) * hs + 2 * i + p, theirs = std::int64_t(h) * hs + p * (hs / 2) + i;
        const std::int64_t from = to_hf ? ours : theirs, to = to_hf ? theirs : ours;
        std::memcpy(&out[static_cast<std::size_t>(to * C)], &w[static_cast<std::size_t>(from * C)], sizeof(float) * C);
      }
  return out;
}

void write_hf_model(const std::string& dir, const GPTConfig& cfg,
                    const std::function<const std::vector<float>&(const std::string& name)>& tensor) {
  if (cfg.experts > 0)
    throw InputError(quote_path(dir) + ": this checkpoint's model.experts = " + std::to_string(cfg.experts) +
                     ": no Hugging Face class holds GPT-2 blocks with experts (GPT2LMHeadModel's MLP is dense); "
                     "the checkpoint itself is loom's file of them");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (!std::filesystem::is_directory(dir, ec)) throw InputError("cannot make the folder " + quote_path(dir));
  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}, {"written_by", "loom"}};
  std::vector<std::vector<float>> data;
  std::int64_t at = 0;
  for (const Tensor& t : tensors_of(cfg)) {
    if (!t.equals.empty()) continue;  // a repeat transformers leaves out (the tied head)
    const std::vector<float>& v = tensor(t.ours);
    const std::int64_t n = numel(t.shape);
    if (static_cast<std::int64_t>(v.size()) != n)
      throw std::logic_error("write_hf_model: " + t.ours + " has " + std::to_string(v.size()) + " elements");
    header[t.theirs] = {{"dtype", "F32"}, {"shape", file_shape(t)}, {"data_offsets", {at, at + 4 * n}}};
    at += 4 * n;
    data.push_back(convert(t, cfg, v, true));
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data 8-byte aligned, as transformers writes it
  hf::write_atomic(dir + "/model.safetensors", [&](std::ofstream& out) {
    const std::uint64_t len = text.size();
    unsigned char le[8];
    for (int b = 0; b < 8; ++b) le[b] = static_cast<unsigned char>(len >> (8 * b));
    out.write(reinterpret_cast<const char*>(le), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const auto& d : data) out.write(reinterpret_cast<const char*>(d.data()), 4 * std::streamsize(d.size()));
  });
  const json config = cfg.llama() ? hf::llama_config(cfg) : hf::gpt2_config(cfg);
  hf::write_atomic(dir + "/config.json", [&](std::ofstream& out) { out << config.dump(2) << "\n"; });
}

HfModel read_hf_model(const std::string& dir) {
  const std::string st_path = dir + "/model.safetensors";
  const hf::ConfigFile f = read_config(dir + "/config.json");
  const std::string type = f.string("model_type", "");
  HfModel m;
  if (type == "llama")
    m.cfg = hf::llama_from_config(f);
  else if (type == "gpt2")
    m.cfg = hf::gpt2_from_config(f);
  else
    f.fail("model_type = \"" + type + "\": loom reads Hugging Face's Llama (\"llama\") and GPT-2 (\"gpt2\") files");
  SafetensorsReader st(st_path);
  std::map<std::string, std::string> stored_as;  // loom's name -> the file's
  for (const Tensor& t : tensors_of(m.cfg)) {
    const std::string name = st.find(t);
    if (name.empty() && !t.equals.empty()) continue;  // the tied head, left out as save_pretrained does
    if (name.empty()) fail(st_path, "has no tensor " + t.theirs + " (config.json's model needs it)");
    std::vector<float> v = convert(t, m.cfg, st.read(name, file_shape(t)), false);
    if (t.equals.empty()) {
      m.tensors[t.ours] = std::move(v);
      stored_as[t.ours] = name;
      continue;
    }
    const std::vector<float>& same = m.tensors.at(t.equals);
    if (std::memcmp(v.data(), same.data(), sizeof(float) * v.size()) != 0)
      fail(st_path, name + " differs from " + stored_as.at(t.equals) + ": loom's " + family(m.cfg) +
                        " head is the token table, and a head of its own has no loom model (leave " + name + " out)");
  }
  return m;
}

void check_hf_model(const HfModel& m, const GPTConfig& deck, const std::string& dir) {
  if (deck.experts > 0)
    throw InputError("model.init_from = " + quote_path(dir) + " with model.experts = " + std::to_string(deck.experts) +
                     ": Hugging Face's " + family(deck) +
                     " files hold a dense MLP, not experts (start from a loom "
                     "checkpoint, or model.experts = 0)");
  if (deck.arch != m.cfg.arch)
    throw InputError("model.init_from = " + quote_path(dir) + " holds a Hugging Face " + family(m.cfg) +
                     " (model_type " + GPTConfig::arch_name(m.cfg.arch) + "); this deck's model.arch = " +
                     GPTConfig::arch_name(deck.arch) + " (set model.arch = " + GPTConfig::arch_name(m.cfg.arch) + ")");
  const std::string bad = deck.llama() ? hf::llama_differences(deck, m.cfg) : hf::gpt2_differences(deck, m.cfg);
  if (!bad.empty())
    throw InputError("model.init_from = " + quote_path(dir) + " holds another model: " + bad +
                     " (set the deck's model.* keys to the file's)");
}

}  // namespace loom
