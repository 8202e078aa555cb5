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

namespace loom {
namespace {

using json = nlohmann::json;

[[noreturn]] void fail(const std::string& file, const std::string& what) {
  throw InputError(quote_path(file) + ": " + what);
}

// loom's name of each tensor of layer l (or of the model: l = -1) and transformers' name of it.
std::vector<std::pair<std::string, std::string>> names(const GPTConfig& cfg) {
  std::vector<std::pair<std::string, std::string>> n = {{"wte.weight", "model.embed_tokens.weight"}};
  const std::pair<const char*, const char*> block[] = {
      {"ln1.weight", "input_layernorm.weight"},        {"attn.q.weight", "self_attn.q_proj.weight"},
      {"attn.k.weight", "self_attn.k_proj.weight"},    {"attn.v.weight", "self_attn.v_proj.weight"},
      {"attn.proj.weight", "self_attn.o_proj.weight"}, {"ln2.weight", "post_attention_layernorm.weight"},
      {"mlp.gate.weight", "mlp.gate_proj.weight"},     {"mlp.up.weight", "mlp.up_proj.weight"},
      {"mlp.down.weight", "mlp.down_proj.weight"}};
  for (int l = 0; l < cfg.layers; ++l)
    for (const auto& [ours, theirs] : block)
      n.push_back({"blocks." + std::to_string(l) + "." + ours, "model.layers." + std::to_string(l) + "." + theirs});
  n.push_back({"ln_f.weight", "model.norm.weight"});
  if (!cfg.tied()) n.push_back({"lm_head.weight", "lm_head.weight"});
  return n;
}

std::vector<std::int64_t> shape_of(const GPTConfig& cfg, const std::string& name) {
  const std::int64_t C = cfg.d_model, V = cfg.vocab, F = cfg.ffn(), CK = std::int64_t(cfg.kv()) * cfg.head_size();
  auto ends = [&](const char* s) {
    return name.size() >= std::strlen(s) && name.rfind(s) == name.size() - std::strlen(s);
  };
  if (name == "wte.weight" || name == "lm_head.weight") return {V, C};
  if (ends("ln1.weight") || ends("ln2.weight") || name == "ln_f.weight") return {C};
  if (ends("attn.q.weight") || ends("attn.proj.weight")) return {C, C};
  if (ends("attn.k.weight") || ends("attn.v.weight")) return {CK, C};
  if (ends("mlp.gate.weight") || ends("mlp.up.weight")) return {F, C};
  if (ends("mlp.down.weight")) return {C, F};
  throw std::logic_error("hf: no shape for " + name);
}

bool is_q(const std::string& n) { return n.find(".attn.q.weight") != std::string::npos; }
bool is_k(const std::string& n) { return n.find(".attn.k.weight") != std::string::npos; }

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

void write_hf_llama(const std::string& dir, const GPTConfig& cfg,
                    const std::function<const std::vector<float>&(const std::string& name)>& tensor) {
  if (!cfg.llama())
    throw InputError(quote_path(dir) + ": `loom ckpt hf` writes Hugging Face's Llama files, and this checkpoint's " +
                     "model.arch = gpt2");
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (!std::filesystem::is_directory(dir, ec)) throw InputError("cannot make the folder " + quote_path(dir));
  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}, {"written_by", "loom"}};
  std::vector<std::pair<std::string, std::vector<float>>> data;
  std::int64_t at = 0;
  for (const auto& [ours, theirs] : names(cfg)) {
    std::vector<float> v = tensor(ours);
    const std::vector<std::int64_t> shape = shape_of(cfg, ours);
    std::int64_t n = 1;
    for (std::int64_t d : shape) n *= d;
    if (static_cast<std::int64_t>(v.size()) != n)
      throw std::logic_error("write_hf_llama: " + ours + " has " + std::to_string(v.size()) + " elements");
    if (is_q(ours)) v = permute_rotary_rows(v, cfg.heads, cfg.head_size(), cfg.d_model, true);
    if (is_k(ours)) v = permute_rotary_rows(v, cfg.kv(), cfg.head_size(), cfg.d_model, true);
    header[theirs] = {{"dtype", "F32"}, {"shape", shape}, {"data_offsets", {at, at + 4 * n}}};
    at += 4 * n;
    data.emplace_back(theirs, std::move(v));
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data 8-byte aligned, as transformers writes it
  write_atomic(dir + "/model.safetensors", [&](std::ofstream& out) {
    const std::uint64_t len = text.size();
    unsigned char le[8];
    for (int b = 0; b < 8; ++b) le[b] = static_cast<unsigned char>(len >> (8 * b));
    out.write(reinterpret_cast<const char*>(le), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const auto& d : data)
      out.write(reinterpret_cast<const char*>(d.second.data()), 4 * std::streamsize(d.second.size()));
  });
  const json config = {{"architectures", {"LlamaForCausalLM"}},
                       {"model_type", "llama"},
                       {"hidden_size", cfg.d_model},
                       {"intermediate_size", cfg.ffn()},
                       {"num_hidden_layers", cfg.layers},
                       {"num_attention_heads", cfg.heads},
                       {"num_key_value_heads", cfg.kv()},
                       {"head_dim", cfg.head_size()},
                       {"max_position_embeddings", cfg.seq_len},
                       {"vocab_size", cfg.vocab},
                       {"rms_norm_eps", static_cast<double>(cfg.norm_eps)},
                       {"rope_theta", static_cast<double>(cfg.rope_theta)},
                       {"rope_scaling", nullptr},
                       {"tie_word_embeddings", cfg.tied()},
                       {"hidden_act", "silu"},
                       {"attention_bias", false},
                       {"mlp_bias", false},
                       {"torch_dtype", "float32"}};
  write_atomic(dir + "/config.json", [&](std::ofstream& out) { out << config.dump(2) << "\n"; });
}

HfModel read_hf_llama(const std::string& dir) {
  const std::string cfg_path = dir + "/config.json", st_path = dir + "/model.safetensors";
  HfModel m;
  json c;
  {
    std::ifstream in(cfg_path);
    if (!in) fail(cfg_path, "cannot be read (model.init_from = DIR needs DIR/config.json and DIR/model.safetensors)");
    try {
      c = json::parse(in);
    } catch (const json::exception& e) {
      fail(cfg_path, std::string("is not JSON: ") + e.what());
    }
  }
  auto integer = [&](const char* key, bool required = true) -> int {
    if (!c.contains(key) || c[key].is_null()) {
      if (required) fail(cfg_path, std::string("has no ") + key);
      return 0;
    }
    if (!c[key].is_number_integer() || c[key].get<std::int64_t>() < 1 || c[key].get<std::int64_t>() > (1 << 30))
      fail(cfg_path, std::string(key) + " = " + c[key].dump() + " is not a size");
    return c[key].get<int>();
  };
  auto number = [&](const char* key, double fallback) {
    if (!c.contains(key) || c[key].is_null()) return fallback;
    if (!c[key].is_number()) fail(cfg_path, std::string(key) + " = " + c[key].dump() + " is not a number");
    return c[key].get<double>();
  };
  const std::string type = c.value("model_type", std::string());
  if (type != "llama")
    fail(cfg_path, "model_type = \"" + type + "\": loom reads Hugging Face's Llama files (model_type \"llama\")");
  if (c.contains("rope_scaling") && !c["rope_scaling"].is_null())
    fail(cfg_path, "rope_scaling = " + c["rope_scaling"].dump() + ": loom's rotary embeddings have no scaling");
  GPTConfig& g = m.cfg;
  g.arch = GPTConfig::Arch::llama;
  g.d_model = integer("hidden_size");
  g.layers = integer("num_hidden_layers");
  g.heads = integer("num_attention_heads");
  g.kv_heads = c.contains("num_key_value_heads") ? integer("num_key_value_heads") : g.heads;
  g.ffn_hidden = integer("intermediate_size");
  g.vocab = integer("vocab_size");
  g.seq_len = integer("max_position_embeddings");
  g.norm_eps = static_cast<float>(number("rms_norm_eps", 1e-6));
  g.rope_theta = static_cast<float>(number("rope_theta", 10000));
  g.tie_embeddings = c.value("tie_word_embeddings", false) ? 1 : 0;
  if (g.d_model % g.heads != 0 || g.heads % g.kv() != 0 || g.head_size() % 2 != 0 ||
      (c.contains("head_dim") && !c["head_dim"].is_null() && integer("head_dim") != g.head_size()))
    fail(cfg_path, "hidden_size " + std::to_string(g.d_model) + ", num_attention_heads " + std::to_string(g.heads) +
                       ", num_key_value_heads " + std::to_string(g.kv()) +
                       ": not a shape loom builds (heads of an even size hidden_size / num_attention_heads, kv heads "
                       "dividing the heads)");

  std::ifstream in(st_path, std::ios::binary | std::ios::ate);
  if (!in) fail(st_path, "cannot be read");
  const std::int64_t size = in.tellg();
  in.seekg(0);
  unsigned char le[8] = {};
  if (size < 8 || !in.read(reinterpret_cast<char*>(le), 8)) fail(st_path, "is shorter than a safetensors header");
  std::uint64_t len = 0;
  for (int b = 7; b >= 0; --b) len = len << 8 | le[b];
  if (len > static_cast<std::uint64_t>(size - 8) || len > (std::uint64_t(1) << 30))
    fail(st_path, "its header length " + std::to_string(len) + " is past the file's " + std::to_string(size) +
                      " bytes: not a safetensors file, or truncated");
  std::string text(len, '\0');
  in.read(text.data(), static_cast<std::streamsize>(len));
  json header;
  try {
    header = json::parse(text);
  } catch (const json::exception& e) {
    fail(st_path, std::string("its header is not JSON: ") + e.what());
  }
  const std::int64_t data0 = 8 + static_cast<std::int64_t>(len);
  for (const auto& [ours, theirs] : names(g)) {
    if (!header.contains(theirs)) fail(st_path, "has no tensor " + theirs + " (config.json's model needs it)");
    const json& t = header[theirs];
    const std::string dtype = t.value("dtype", std::string());
    const int width = dtype == "F32" ? 4 : (dtype == "BF16" || dtype == "F16") ? 2 : 0;
    if (width == 0) fail(st_path, theirs + " is " + dtype + "; loom reads F32, BF16 and F16");
    const std::vector<std::int64_t> want = shape_of(g, ours);
    std::vector<std::int64_t> shape;
    std::int64_t begin = -1, end = -1;
    try {
      shape = t.at("shape").get<std::vector<std::int64_t>>();
      begin = t.at("data_offsets").at(0).get<std::int64_t>();
      end = t.at("data_offsets").at(1).get<std::int64_t>();
    } catch (const json::exception&) {
      fail(st_path, theirs + "'s shape or data_offsets are malformed");
    }
    if (shape != want) {
      std::ostringstream s;
      s << theirs << " is [";
      for (std::size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
      s << "], config.json's model needs [";
      for (std::size_t i = 0; i < want.size(); ++i) s << (i ? ", " : "") << want[i];
      fail(st_path, s.str() + "]");
    }
    std::int64_t n = 1;
    for (std::int64_t d : want) n *= d;
    if (begin < 0 || end - begin != n * width || data0 + end > size)
      fail(st_path, theirs + "'s data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                        ") are not its " + std::to_string(n * width) + " bytes inside the file (truncated?)");
    std::vector<unsigned char> bytes(static_cast<std::size_t>(n * width));
    in.seekg(data0 + begin);
    if (!in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size())))
      fail(st_path, "cannot read " + theirs);
    std::vector<float> v(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i)
      v[static_cast<std::size_t>(i)] = element(&bytes[static_cast<std::size_t>(i * width)], dtype);
    if (is_q(ours)) v = permute_rotary_rows(v, g.heads, g.head_size(), g.d_model, false);
    if (is_k(ours)) v = permute_rotary_rows(v, g.kv(), g.head_size(), g.d_model, false);
    m.tensors[ours] = std::move(v);
  }
  return m;
}

void check_hf_model(const HfModel& m, const GPTConfig& deck, const std::string& dir) {
  if (!deck.llama())
    throw InputError("model.init_from = " + quote_path(dir) +
                     " holds a Hugging Face Llama; this deck's model.arch = gpt2 "
                     "(set model.arch = llama)");
  std::string bad;
  auto differ = [&](const char* key, const std::string& ours, const char* field, const std::string& theirs) {
    if (ours != theirs)
      bad += std::string(bad.empty() ? "" : "; ") + key + " = " + ours + " in the deck, " + field + " = " + theirs +
             " in config.json";
  };
  const GPTConfig& f = m.cfg;
  auto s = [](double v) {
    std::ostringstream o;
    o << static_cast<float>(v);
    return o.str();
  };
  differ("model.layers", std::to_string(deck.layers), "num_hidden_layers", std::to_string(f.layers));
  differ("model.d_model", std::to_string(deck.d_model), "hidden_size", std::to_string(f.d_model));
  differ("model.heads", std::to_string(deck.heads), "num_attention_heads", std::to_string(f.heads));
  differ("model.kv_heads", std::to_string(deck.kv()), "num_key_value_heads", std::to_string(f.kv()));
  differ("model.ffn_hidden", std::to_string(deck.ffn()), "intermediate_size", std::to_string(f.ffn()));
  differ("model.vocab", std::to_string(deck.vocab), "vocab_size", std::to_string(f.vocab));
  differ("model.norm_eps", s(deck.norm_eps), "rms_norm_eps", s(f.norm_eps));
  differ("model.rope_theta", s(deck.rope_theta), "rope_theta", s(f.rope_theta));
  differ("model.tie_embeddings", deck.tied() ? "true" : "false", "tie_word_embeddings", f.tied() ? "true" : "false");
  if (deck.seq_len > f.seq_len)
    bad += std::string(bad.empty() ? "" : "; ") + "model.seq_len = " + std::to_string(deck.seq_len) +
           " in the deck is longer than max_position_embeddings = " + std::to_string(f.seq_len) + " in config.json";
  if (!bad.empty())
    throw InputError("model.init_from = " + quote_path(dir) + " holds another model: " + bad +
                     " (set the deck's model.* keys to the file's)");
}

}  // namespace loom
