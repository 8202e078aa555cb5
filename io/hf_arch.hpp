#pragma once
// What differs between Hugging Face's files of loom's two blocks (io/hf.hpp): each architecture's
// tensor names and layouts (hf_llama.cpp, hf_gpt2.cpp), its config.json written and read, and the
// deck keys its config.json fields answer to. io/hf.cpp holds what they share: safetensors in and out.
#include <cstdint>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "core/model/gpt.hpp"

namespace loom::hf {

// One tensor of the file. `shape` is loom's; the file's is the same but for `transposed` (GPT-2's
// Conv1D keeps [in, out] where loom keeps torch.nn.Linear's [out, in]). `equals` names a loom tensor
// the file may repeat (an untied-looking lm_head that is the token table): read, compared, not kept.
struct Tensor {
  enum class Form { same, transposed, rotary_q, rotary_k };
  Tensor(std::string o, std::string t, std::vector<std::int64_t> s, Form f = Form::same)
      : ours(std::move(o)), theirs(std::move(t)), shape(std::move(s)), form(f) {}
  std::string ours, theirs;
  std::vector<std::int64_t> shape;
  Form form = Form::same;
  std::string alias;   // another name transformers has written it under ("" if none)
  std::string equals;  // non-empty: optional, and must equal this loom tensor
};

// config.json read with errors naming the file and the field.
struct ConfigFile {
  std::string path;
  nlohmann::json c;
  [[noreturn]] void fail(const std::string& what) const;
  bool has(const char* key) const { return c.contains(key) && !c[key].is_null(); }
  int integer(const char* key) const;  // a size in [1, 2^30]; InputError if absent
  double number(const char* key, double fallback) const;
  std::string string(const char* key, const std::string& fallback) const;
  bool boolean(const char* key, bool fallback) const;
};

// Writes `path` through path.tmp, renamed into place once whole (a reader never sees half a file).
void write_atomic(const std::string& path, const std::function<void(std::ofstream&)>& body);

// Appends "KEY = OURS in the deck, FIELD = THEIRS in config.json" to `bad` when the two differ.
void differ(std::string& bad, const std::string& key, const std::string& ours, const char* field,
            const std::string& theirs);

std::vector<Tensor> llama_tensors(const GPTConfig& cfg);
nlohmann::json llama_config(const GPTConfig& cfg);
GPTConfig llama_from_config(const ConfigFile& f);  // model_type "llama"
std::string llama_differences(const GPTConfig& deck, const GPTConfig& file);

std::vector<Tensor> gpt2_tensors(const GPTConfig& cfg);
nlohmann::json gpt2_config(const GPTConfig& cfg);
GPTConfig gpt2_from_config(const ConfigFile& f);  // model_type "gpt2"
std::string gpt2_differences(const GPTConfig& deck, const GPTConfig& file);

}  // namespace loom::hf
