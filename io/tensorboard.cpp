#include "io/tensorboard.hpp"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "core/base/error.hpp"

namespace loom {

namespace {

std::array<std::uint32_t, 256> crc32c_table() {
  std::array<std::uint32_t, 256> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}

// Protocol buffer wire format, the few pieces an Event needs. Bytes are put in one by one, so the
// file is little-endian whatever the host is.
void put_fixed(std::string& out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void put_varint(std::string& out, std::uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
enum Wire : std::uint32_t { varint = 0, fixed64 = 1, delimited = 2, fixed32 = 5 };
void put_key(std::string& out, std::uint32_t field, Wire wire) { put_varint(out, (field << 3) | wire); }
void put_bytes(std::string& out, std::uint32_t field, const std::string& bytes) {
  put_key(out, field, delimited);
  put_varint(out, bytes.size());
  out += bytes;
}
void put_double(std::string& out, std::uint32_t field, double v) {
  std::uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_key(out, field, fixed64);
  put_fixed(out, bits, 8);
}
void put_float(std::string& out, std::uint32_t field, float v) {
  std::uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_key(out, field, fixed32);
  put_fixed(out, bits, 4);
}

// tensorflow/core/util/event.proto: Event {double wall_time = 1; int64 step = 2; string file_version = 3;
// Summary summary = 5; SessionLog session_log = 6}; SessionLog {SessionStatus status = 1}, START = 1;
// summary.proto: Summary {repeated Value value = 1}; Value {string tag = 1; float simple_value = 2}.
std::string wall_time() {
  std::string e;
  put_double(e, 1, std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  return e;
}

std::string event_head(std::int64_t step) {
  std::string e = wall_time();
  put_key(e, 2, varint);
  put_varint(e, static_cast<std::uint64_t>(step));  // int64: two's complement, as protobuf does
  return e;
}

std::string session_start(std::int64_t step) {
  std::string log;
  put_key(log, 1, varint);
  put_varint(log, 1);  // SessionLog.START
  std::string e = event_head(step);
  put_bytes(e, 6, log);
  return e;
}

void flatten(const std::string& tag, const nlohmann::json& v, std::vector<std::pair<std::string, double>>& out) {
  const std::string prefix = tag.empty() ? "" : tag + "/";
  if (v.is_object()) {
    for (const auto& [k, item] : v.items())
      if (!(tag.empty() && k == "step")) flatten(prefix + k, item, out);
  } else if (v.is_array()) {
    for (std::size_t i = 0; i < v.size(); ++i) flatten(prefix + std::to_string(i), v[i], out);
  } else if (v.is_boolean()) {
    out.emplace_back(tag, v.get<bool>() ? 1.0 : 0.0);
  } else if (v.is_number()) {
    out.emplace_back(tag, v.get<double>());
  }
}

std::string host_name() {
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  std::string h = host;
  for (char& c : h)
    if (c == '/') c = '_';
  return h.empty() ? "localhost" : h;
}

}  // namespace

std::uint32_t crc32c(const void* data, std::size_t size) {
  static const std::array<std::uint32_t, 256> table = crc32c_table();
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint32_t c = 0xffffffffu;
  for (std::size_t i = 0; i < size; ++i) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

std::uint32_t masked_crc32c(const void* data, std::size_t size) {
  const std::uint32_t c = crc32c(data, size);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::vector<std::pair<std::string, double>> tensorboard_scalars(const nlohmann::json& row) {
  std::vector<std::pair<std::string, double>> out;
  flatten("", row, out);
  return out;
}

void TensorBoardWriter::open(const std::string& dir, std::int64_t first_step) {
  const auto secs =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  const std::string base = dir + "/events.out.tfevents." + std::to_string(secs) + "." + host_name();
  // "x": created here or not at all, so a run started in the same second as the last (a quick
  // resume) adds a file beside that run's rather than writing over it.
  path_ = base;
  for (int k = 2; !(out_ = std::fopen(path_.c_str(), "wbx")) && errno == EEXIST; ++k)
    path_ = base + "." + std::to_string(k);
  if (!out_)
    throw TensorBoardError("cannot create " + quote_path(path_) + ": " + std::strerror(errno) +
                           " (run.tensorboard = true writes it beside metrics.jsonl in run.dir)");
  std::string e = wall_time();
  put_bytes(e, 3, "brain.Event:2");
  write_record(e);
  restart_at(first_step);
}

void TensorBoardWriter::restart_at(std::int64_t first_step) { write_record(session_start(first_step)); }

void TensorBoardWriter::write_row(std::int64_t step, const nlohmann::json& row) {
  std::string summary;
  for (const auto& [tag, v] : tensorboard_scalars(row)) {
    std::string value;
    put_bytes(value, 1, tag);
    put_float(value, 2, static_cast<float>(v));
    put_bytes(summary, 1, value);
  }
  std::string e = event_head(step);
  put_bytes(e, 5, summary);
  write_record(e);
}

void TensorBoardWriter::write_record(const std::string& event) {
  std::string rec;
  put_fixed(rec, event.size(), 8);
  put_fixed(rec, masked_crc32c(rec.data(), 8), 4);
  rec += event;
  put_fixed(rec, masked_crc32c(event.data(), event.size()), 4);
  if (std::fwrite(rec.data(), 1, rec.size(), out_) != rec.size() || std::fflush(out_) != 0)
    throw TensorBoardError("cannot write " + quote_path(path_) + ": " + std::strerror(errno) + " (run.tensorboard)");
}

TensorBoardWriter::~TensorBoardWriter() {
  if (out_) std::fclose(out_);
}

}  // namespace loom
