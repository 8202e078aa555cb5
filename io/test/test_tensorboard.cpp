// run.tensorboard's event file: the CRC32C against published vectors, the scalars a metrics row
// gives, the TFRecord framing read back, and a write failure naming the file.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "io/tensorboard.hpp"

namespace loom {
namespace {

namespace fs = std::filesystem;

std::uint32_t crc_of(const std::string& s) { return crc32c(s.data(), s.size()); }

// RFC 3720 (iSCSI), B.4, and the check value of the CRC-32C catalogue entry.
TEST(TensorBoard, Crc32cKnownVectors) {
  EXPECT_EQ(crc_of("123456789"), 0xE3069283u);
  EXPECT_EQ(crc_of(""), 0u);
  EXPECT_EQ(crc_of(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(crc_of(std::string(32, '\xff')), 0x62A8AB43u);
  std::string up, down;
  for (int i = 0; i < 32; ++i) {
    up.push_back(static_cast<char>(i));
    down.push_back(static_cast<char>(31 - i));
  }
  EXPECT_EQ(crc_of(up), 0x46DD794Eu);
  EXPECT_EQ(crc_of(down), 0x113FDB5Cu);
}

TEST(TensorBoard, MaskedCrcRotatesAndAdds) {
  const std::string s = "123456789";
  // 0xE3069283 rotated right by 15 is 0x2507C60D; plus 0xa282ead8.
  EXPECT_EQ(masked_crc32c(s.data(), s.size()), 0x2507C60Du + 0xa282ead8u);
  // Every event file TensorFlow writes starts with the same 12 bytes: the length of its 24-byte
  // file_version event, then a3 7f 4b 22, that length's masked CRC.
  const unsigned char length24[8] = {24, 0, 0, 0, 0, 0, 0, 0};
  EXPECT_EQ(masked_crc32c(length24, 8), 0x224B7FA3u);
}

TEST(TensorBoard, ScalarsFlattenTheRow) {
  const nlohmann::json row = {{"step", 7},
                              {"loss", 2.5},
                              {"time", "2024-01-01T00:00:00Z"},
                              {"skipped", true},
                              {"times_ms", {{"forward", 1.5}, {"backward", 3}}},
                              {"spike", {{"batches_skipped", {4, 9}}, {"action", "rollback"}}},
                              {"missing", nullptr}};
  std::map<std::string, double> got;
  for (const auto& [tag, v] : tensorboard_scalars(row)) got[tag] = v;
  const std::map<std::string, double> want = {{"loss", 2.5},
                                              {"skipped", 1},
                                              {"times_ms/forward", 1.5},
                                              {"times_ms/backward", 3},
                                              {"spike/batches_skipped/0", 4},
                                              {"spike/batches_skipped/1", 9}};
  EXPECT_EQ(got, want);
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::uint32_t le32(const std::string& s, std::size_t at) {
  std::uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s[at + i]);
  return v;
}

TEST(TensorBoard, RecordsFramedWithMaskedCrcs) {
  const fs::path dir = fs::path(LOOM_TEST_TMP) / "tensorboard" / "framing";
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::string first;
  {
    TensorBoardWriter w;
    w.open(dir.string(), 1);
    first = w.path();
    EXPECT_NE(fs::path(first).filename().string().find("events.out.tfevents."), std::string::npos);
    w.write_row(1, {{"step", 1}, {"loss", 3.25}});
  }
  const std::string bytes = slurp(first);
  std::size_t at = 0;
  int records = 0;
  while (at < bytes.size()) {
    ASSERT_LE(at + 12, bytes.size());
    std::uint64_t len = 0;
    for (int i = 7; i >= 0; --i) len = (len << 8) | static_cast<unsigned char>(bytes[at + i]);
    EXPECT_EQ(le32(bytes, at + 8), masked_crc32c(bytes.data() + at, 8));
    ASSERT_LE(at + 12 + len + 4, bytes.size());
    EXPECT_EQ(le32(bytes, at + 12 + len), masked_crc32c(bytes.data() + at + 12, len));
    at += 12 + len + 4;
    ++records;
  }
  EXPECT_EQ(records, 3);  // file_version, SessionLog START, one row
  EXPECT_NE(bytes.find("brain.Event:2"), std::string::npos);
  float loss = 3.25f;
  EXPECT_NE(bytes.find(std::string("\x15", 1) + std::string(reinterpret_cast<char*>(&loss), 4)), std::string::npos);
  // A second writer in the same second adds a file beside the first, never over it.
  TensorBoardWriter again;
  again.open(dir.string(), 2);
  EXPECT_NE(again.path(), first);
  EXPECT_EQ(slurp(first), bytes);
}

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "message: " << (haystack)

TEST(TensorBoard, OpenFailureNamesTheFile) {
  const fs::path dir = fs::path(LOOM_TEST_TMP) / "tensorboard" / "no" / "such" / "dir";
  TensorBoardWriter w;
  try {
    w.open(dir.string(), 1);
    ADD_FAILURE() << "no TensorBoardError";
  } catch (const TensorBoardError& e) {
    EXPECT_HAS(e.what(), "cannot create '" + dir.string() + "/events.out.tfevents.");
    EXPECT_HAS(e.what(), "No such file or directory");
  }
}

// A file-size limit (ulimit -f) crossed by a row: the error names the file and the reason, and the
// records before it stay whole.
TEST(TensorBoard, WriteFailureNamesTheFile) {
  const fs::path dir = fs::path(LOOM_TEST_TMP) / "tensorboard" / "too_large";
  fs::remove_all(dir);
  fs::create_directories(dir);
  TensorBoardWriter w;
  w.open(dir.string(), 1);
  const auto size = fs::file_size(w.path());
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit old{};
  getrlimit(RLIMIT_FSIZE, &old);
  rlimit lim = old;
  lim.rlim_cur = size + 40;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &lim), 0);
  std::string message;
  try {
    for (int step = 1; step < 100; ++step) w.write_row(step, {{"loss", 1.0}, {"lr", 0.1}, {"grad_norm", 2.0}});
  } catch (const TensorBoardError& e) {
    message = e.what();
  }
  setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_HAS(message, "cannot write '" + w.path() + "': File too large");
}

}  // namespace
}  // namespace loom
