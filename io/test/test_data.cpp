// Datasets and the batch loader: determinism, splits, the synthetic chain's entropy, llm.c shards
// and every bad-data refusal.
#include <gtest/gtest.h>

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/base/error.hpp"
#include "core/base/rng.hpp"
#include "io/data.hpp"

using namespace loom;
namespace fs = std::filesystem;

namespace {

fs::path tmp_dir(const std::string& name) {
  fs::path d = fs::path(LOOM_TEST_TMP) / "data" / name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << p;
}

void put_le32(std::string& s, std::size_t at, std::int32_t v) {
  const auto u = static_cast<std::uint32_t>(v);
  for (int b = 0; b < 4; ++b) s[at + static_cast<std::size_t>(b)] = static_cast<char>((u >> (8 * b)) & 0xff);
}

// An llm.c shard: 256 int32 header (magic, version, count) then uint16 tokens, little-endian.
std::string shard_bytes(const std::vector<std::uint16_t>& toks, std::int32_t magic = 20240520, std::int32_t version = 1,
                        std::int64_t count = -1) {
  std::string s(1024 + 2 * toks.size(), '\0');
  put_le32(s, 0, magic);
  put_le32(s, 4, version);
  put_le32(s, 8, static_cast<std::int32_t>(count < 0 ? static_cast<std::int64_t>(toks.size()) : count));
  for (std::size_t i = 0; i < toks.size(); ++i) {
    s[1024 + 2 * i] = static_cast<char>(toks[i] & 0xff);
    s[1024 + 2 * i + 1] = static_cast<char>(toks[i] >> 8);
  }
  return s;
}

// Printable pseudo-random text, so windows at different offsets differ.
std::string random_text(std::size_t n, std::uint64_t seed) {
  std::string s(n, ' ');
  for (std::size_t i = 0; i < n; ++i) s[i] = static_cast<char>('a' + rng::bits(seed, 7, i) % 26);
  return s;
}

std::vector<std::int32_t> draw(const Dataset& ds, Split split, std::int64_t step, std::int64_t index, int T) {
  std::vector<std::int32_t> v(static_cast<std::size_t>(T) + 1);
  ds.sample(split, step, index, v.data());
  return v;
}

// Runs f, expects an InputError, returns its message.
template <class F>
std::string input_error(F f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected InputError, got another exception: " << e.what();
    return {};
  }
  ADD_FAILURE() << "expected InputError, nothing was thrown";
  return {};
}

#define EXPECT_HAS(msg, part) \
  EXPECT_NE((msg).find(part), std::string::npos) << "message: " << (msg) << "\nmissing: " << (part)

DataConfig text_cfg(const fs::path& p, int T = 16, double val = 0.1) {
  DataConfig c;
  c.source = "text:" + p.string();
  c.vocab = 256;
  c.seq_len = T;
  c.val_fraction = val;
  return c;
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Determinism and the loader.

TEST(DataDeterminism, SyntheticSamplesArePureFunctionsOfStepAndIndex) {
  DataConfig c;
  c.vocab = 256;
  c.seq_len = 64;
  auto a = open_dataset(c);
  auto b = open_dataset(c);
  const auto first = draw(*a, Split::train, 3, 5, c.seq_len);
  // Other draws in between, in another order, on another object: same tokens.
  for (int i = 20; i >= 0; --i) draw(*a, Split::train, i, 2 * i, c.seq_len);
  EXPECT_EQ(draw(*a, Split::train, 3, 5, c.seq_len), first);
  EXPECT_EQ(draw(*b, Split::train, 3, 5, c.seq_len), first);
  // Different index, step, split or seed: different tokens.
  EXPECT_NE(draw(*a, Split::train, 3, 6, c.seq_len), first);
  EXPECT_NE(draw(*a, Split::train, 4, 5, c.seq_len), first);
  EXPECT_NE(draw(*a, Split::val, 3, 5, c.seq_len), first);
  DataConfig c2 = c;
  c2.seed = c.seed + 1;
  EXPECT_NE(draw(*open_dataset(c2), Split::train, 3, 5, c.seq_len), first);
  for (auto t : first) {
    EXPECT_GE(t, 0);
    EXPECT_LT(t, c.vocab);
  }
}

TEST(DataDeterminism, TextSamplesArePureFunctionsOfStepAndIndex) {
  const auto dir = tmp_dir("det_text");
  write_bytes(dir / "t.txt", random_text(5000, 1));
  const auto c = text_cfg(dir / "t.txt", 32);
  auto a = open_dataset(c);
  auto b = open_dataset(c);
  for (Split s : {Split::train, Split::val}) {
    const auto first = draw(*a, s, 7, 11, c.seq_len);
    for (int i = 0; i < 50; ++i) draw(*a, s, i % 9, 50 - i, c.seq_len);
    EXPECT_EQ(draw(*a, s, 7, 11, c.seq_len), first);
    EXPECT_EQ(draw(*b, s, 7, 11, c.seq_len), first);
    EXPECT_NE(draw(*a, s, 7, 12, c.seq_len), first);
  }
}

TEST(DataLoader, RowsEqualSamplesAndSplitBatchesEqualTheWhole) {
  DataConfig c;
  c.vocab = 100;
  c.seq_len = 24;
  auto ds = open_dataset(c);
  const int T = c.seq_len, rows = 8;
  Batch whole;
  load_batch(*ds, Split::train, 9, 0, rows, T, whole);
  ASSERT_EQ(whole.rows, rows);
  ASSERT_EQ(whole.seq_len, T);
  ASSERT_EQ(whole.inputs.size(), static_cast<std::size_t>(rows * T));
  ASSERT_EQ(whole.targets.size(), static_cast<std::size_t>(rows * T));
  for (int r = 0; r < rows; ++r) {
    const auto s = draw(*ds, Split::train, 9, r, T);
    for (int t = 0; t < T; ++t) {
      EXPECT_EQ(whole.inputs[static_cast<std::size_t>(r * T + t)], s[static_cast<std::size_t>(t)]);
      EXPECT_EQ(whole.targets[static_cast<std::size_t>(r * T + t)], s[static_cast<std::size_t>(t) + 1]);
    }
  }
  // Two halves (as two dp ranks or two micro-batches would load them) make up the whole.
  Batch lo, hi;
  load_batch(*ds, Split::train, 9, 0, rows / 2, T, lo);
  load_batch(*ds, Split::train, 9, rows / 2, rows / 2, T, hi);
  std::vector<std::int32_t> in(lo.inputs), tg(lo.targets);
  in.insert(in.end(), hi.inputs.begin(), hi.inputs.end());
  tg.insert(tg.end(), hi.targets.begin(), hi.targets.end());
  EXPECT_EQ(in, whole.inputs);
  EXPECT_EQ(tg, whole.targets);
  // Reusing a batch of another shape resizes it.
  load_batch(*ds, Split::val, 0, 3, 2, T, lo);
  EXPECT_EQ(lo.inputs.size(), static_cast<std::size_t>(2 * T));
  EXPECT_EQ(lo.rows, 2);
}

// ------------------------------------------------------------------------------------------------
// synthetic

TEST(DataSynthetic, BestLossMatchesHandCheckedValues) {
  auto best = [](int V, double noise) {
    DataConfig c;
    c.vocab = V;
    c.synthetic_noise = noise;
    return *open_dataset(c)->best_loss();
  };
  // V = 2, noise 0.5: q = 0.75, p = 0.25: -0.75 ln 0.75 - 0.25 ln 0.25.
  EXPECT_NEAR(best(2, 0.5), 0.5623351446188083, 1e-12);
  // V = 4, noise 0.2: q = 0.85, p = 0.05: 0.138141 + 3 * 0.05 * 2.995732.
  EXPECT_NEAR(best(4, 0.2), 0.5875009311062073, 1e-12);
  EXPECT_NEAR(best(256, 0.1), 0.876185632290844, 1e-12);
  EXPECT_EQ(best(256, 0.0), 0.0);
  EXPECT_NEAR(best(256, 1.0), std::log(256.0), 1e-12);
  DataConfig c;
  EXPECT_EQ(open_dataset(c)->describe(), "synthetic (vocab 256, noise 0.1, best loss 0.8762 nats/token)");
}

TEST(DataSynthetic, EmpiricalConditionalEntropyIsBestLoss) {
  for (Split split : {Split::train, Split::val}) {
    DataConfig c;
    c.vocab = 8;
    c.seq_len = 64;
    c.synthetic_noise = 0.3;
    auto ds = open_dataset(c);
    std::map<std::pair<int, int>, double> pair;
    std::map<int, double> prev;
    std::vector<std::int32_t> buf(static_cast<std::size_t>(c.seq_len) + 1);
    double n = 0;
    for (int step = 0; step < 100; ++step) {
      for (int i = 0; i < 64; ++i) {
        ds->sample(split, step, i, buf.data());
        for (int t = 1; t <= c.seq_len; ++t) {
          pair[{buf[static_cast<std::size_t>(t) - 1], buf[static_cast<std::size_t>(t)]}] += 1;
          prev[buf[static_cast<std::size_t>(t) - 1]] += 1;
          n += 1;
        }
      }
    }
    double h = 0;
    for (const auto& [k, cnt] : pair) h -= cnt / n * std::log(cnt / prev[k.first]);
    EXPECT_NEAR(h, *ds->best_loss(), 0.01) << (split == Split::train ? "train" : "val");
    // Every token has exactly one dominant successor: the chain, not noise.
    for (const auto& [k, cnt] : pair) {
      const double share = cnt / prev[k.first];
      EXPECT_TRUE(std::abs(share - (0.7 + 0.3 / 8)) < 0.02 || std::abs(share - 0.3 / 8) < 0.02) << share;
    }
  }
}

TEST(DataSynthetic, TrainAndValShareTheChain) {
  // With no noise every sample follows the successor map: the same map on both splits.
  DataConfig c;
  c.vocab = 50;
  c.seq_len = 200;
  c.synthetic_noise = 0.0;
  auto ds = open_dataset(c);
  std::map<int, int> succ;
  for (Split s : {Split::train, Split::val}) {
    for (int i = 0; i < 20; ++i) {
      const auto v = draw(*ds, s, 1, i, c.seq_len);
      for (std::size_t t = 1; t < v.size(); ++t) {
        auto [it, fresh] = succ.emplace(v[t - 1], v[t]);
        if (!fresh) {
          EXPECT_EQ(it->second, v[t]);
        }
      }
    }
  }
  EXPECT_GT(ds->tokens(Split::val), 0);
}

TEST(DataSynthetic, RefusesNoiseOutsideZeroOne) {
  DataConfig c;
  c.synthetic_noise = 1.5;
  const auto msg = input_error([&] { open_dataset(c); });
  EXPECT_HAS(msg, "data.synthetic_noise");
}

// ------------------------------------------------------------------------------------------------
// text:PATH

TEST(DataText, SplitSizesAndSamplesAreSubstrings) {
  const auto dir = tmp_dir("text_split");
  const std::string text = random_text(35149, 2);
  write_bytes(dir / "t.txt", text);
  const auto c = text_cfg(dir / "t.txt", 20);
  auto ds = open_dataset(c);
  EXPECT_EQ(ds->tokens(Split::train), 31634);
  EXPECT_EQ(ds->tokens(Split::val), 3515);
  EXPECT_FALSE(ds->best_loss().has_value());
  EXPECT_EQ(ds->describe(), "text:" + (dir / "t.txt").string() + " (35149 bytes; train 31634, val 3515 tokens)");
  const std::string train = text.substr(0, 31634), val = text.substr(31634);
  for (int i = 0; i < 200; ++i) {
    for (Split s : {Split::train, Split::val}) {
      const auto v = draw(*ds, s, i / 10, i, c.seq_len);
      std::string w;
      for (auto t : v) {
        ASSERT_GE(t, 0);
        ASSERT_LT(t, 256);
        w.push_back(static_cast<char>(t));
      }
      EXPECT_NE((s == Split::train ? train : val).find(w), std::string::npos) << w;
    }
  }
}

TEST(DataText, WindowsReachBothEndsOfTheSplit) {
  // A split of exactly T + 2 tokens has two windows: both are drawn.
  const auto dir = tmp_dir("text_ends");
  write_bytes(dir / "t.txt", "abcdefghij");
  auto ds = open_dataset(text_cfg(dir / "t.txt", 8, 0.0));
  EXPECT_EQ(ds->tokens(Split::train), 10);
  bool first = false, second = false;
  for (int i = 0; i < 100; ++i) {
    const auto v = draw(*ds, Split::train, 0, i, 8);
    if (v[0] == 'a') first = true;
    if (v[0] == 'b') second = true;
    EXPECT_TRUE(v[0] == 'a' || v[0] == 'b');
  }
  EXPECT_TRUE(first && second);
}

TEST(DataText, NoValSplitWhenValFractionIsZero) {
  const auto dir = tmp_dir("text_noval");
  write_bytes(dir / "t.txt", random_text(1000, 3));
  auto ds = open_dataset(text_cfg(dir / "t.txt", 16, 0.0));
  EXPECT_EQ(ds->tokens(Split::train), 1000);
  EXPECT_EQ(ds->tokens(Split::val), 0);
  std::vector<std::int32_t> buf(17);
  EXPECT_THROW(ds->sample(Split::val, 0, 0, buf.data()), std::logic_error);
}

TEST(DataText, RefusesSmallVocab) {
  const auto dir = tmp_dir("text_vocab");
  write_bytes(dir / "t.txt", random_text(1000, 4));
  auto c = text_cfg(dir / "t.txt");
  c.vocab = 100;
  const auto msg = input_error([&] { open_dataset(c); });
  EXPECT_HAS(msg, (dir / "t.txt").string());
  EXPECT_HAS(msg, "data.source text needs model.vocab >= 256");
}

TEST(DataText, RefusesMissingFile) {
  const auto dir = tmp_dir("text_missing");
  const auto msg = input_error([&] { open_dataset(text_cfg(dir / "nope.txt")); });
  EXPECT_HAS(msg, (dir / "nope.txt").string());
  EXPECT_HAS(msg, std::strerror(ENOENT));
}

TEST(DataText, RefusesEmptyFile) {
  const auto dir = tmp_dir("text_empty");
  write_bytes(dir / "t.txt", "");
  const auto msg = input_error([&] { open_dataset(text_cfg(dir / "t.txt")); });
  EXPECT_HAS(msg, (dir / "t.txt").string());
  EXPECT_HAS(msg, "empty");
}

TEST(DataText, RefusesADirectory) {
  const auto dir = tmp_dir("text_directory");
  const auto msg = input_error([&] { open_dataset(text_cfg(dir)); });
  EXPECT_HAS(msg, "'" + dir.string() + "'");
  EXPECT_HAS(msg, "is a directory");
  EXPECT_EQ(msg.find("empty"), std::string::npos) << msg;
}

TEST(DataText, RefusesSplitShorterThanOneSequence) {
  const auto dir = tmp_dir("text_short");
  write_bytes(dir / "t.txt", random_text(100, 5));
  // val = 10 tokens < seq_len + 1 = 17.
  auto msg = input_error([&] { open_dataset(text_cfg(dir / "t.txt", 16, 0.1)); });
  EXPECT_HAS(msg, (dir / "t.txt").string());
  EXPECT_HAS(msg, "val split holds 10 tokens");
  EXPECT_HAS(msg, "17");
  EXPECT_HAS(msg, "data.val_fraction");
  EXPECT_HAS(msg, "model.seq_len");
  // train = 90 < 101.
  msg = input_error([&] { open_dataset(text_cfg(dir / "t.txt", 100, 0.1)); });
  EXPECT_HAS(msg, "train split holds 90 tokens");
  EXPECT_HAS(msg, "101");
  // Exactly seq_len + 1 is enough.
  EXPECT_NO_THROW(open_dataset(text_cfg(dir / "t.txt", 9, 0.1)));
}

TEST(DataSource, RefusesUnknownKind) {
  for (const char* src : {"foo:bar", "text:", "tokens", "Synthetic"}) {
    DataConfig c;
    c.source = src;
    const auto msg = input_error([&] { open_dataset(c); });
    EXPECT_HAS(msg, src);
    EXPECT_HAS(msg, "synthetic");
    EXPECT_HAS(msg, "text:PATH");
    EXPECT_HAS(msg, "tokens:GLOB");
  }
}

// ------------------------------------------------------------------------------------------------
// tokens:GLOB

namespace {
DataConfig tokens_cfg(const std::string& glob, int vocab = 1000, int T = 8, double val = 0.2) {
  DataConfig c;
  c.source = "tokens:" + glob;
  c.vocab = vocab;
  c.seq_len = T;
  c.val_fraction = val;
  return c;
}
std::vector<std::uint16_t> iota16(int from, int n) {
  std::vector<std::uint16_t> v(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = static_cast<std::uint16_t>(from + i);
  return v;
}
}  // namespace

TEST(DataTokens, TwoShardsInSortedOrder) {
  const auto dir = tmp_dir("tokens_ok");
  // Written in reverse order: the glob's sorted order decides.
  write_bytes(dir / "shard_001.bin", shard_bytes(iota16(300, 200)));
  write_bytes(dir / "shard_000.bin", shard_bytes(iota16(0, 300)));
  write_bytes(dir / "other.bin", shard_bytes(iota16(900, 50)));  // not matched
  const std::string pattern = (dir / "shard_*.bin").string();
  const int T = 8;
  auto ds = open_dataset(tokens_cfg(pattern, 1000, T, 0.2));
  EXPECT_EQ(ds->tokens(Split::train), 400);
  EXPECT_EQ(ds->tokens(Split::val), 100);
  EXPECT_EQ(ds->describe(), "tokens:" + pattern + " (2 files, 500 tokens; train 400, val 100 tokens)");
  bool crosses = false;
  for (int i = 0; i < 500; ++i) {
    for (Split s : {Split::train, Split::val}) {
      const auto v = draw(*ds, s, i % 7, i, T);
      for (int t = 1; t <= T; ++t) ASSERT_EQ(v[static_cast<std::size_t>(t)], v[0] + t);  // contiguous
      if (s == Split::train) {
        EXPECT_GE(v[0], 0);
        EXPECT_LE(v[0] + T, 399);
        if (v[0] < 300 && v[0] + T >= 300) crosses = true;  // spans the two files
      } else {
        EXPECT_GE(v[0], 400);
        EXPECT_LE(v[0] + T, 499);
      }
    }
  }
  EXPECT_TRUE(crosses);
  // Deterministic across objects.
  auto again = open_dataset(tokens_cfg(pattern, 1000, T, 0.2));
  EXPECT_EQ(draw(*again, Split::train, 4, 17, T), draw(*ds, Split::train, 4, 17, T));
}

TEST(DataTokens, RefusesGlobMatchingNothing) {
  const auto dir = tmp_dir("tokens_none");
  const std::string pattern = (dir / "nothing_*.bin").string();
  const auto msg = input_error([&] { open_dataset(tokens_cfg(pattern)); });
  EXPECT_HAS(msg, pattern);
  EXPECT_HAS(msg, "matches no file");
}

TEST(DataTokens, RefusesTruncatedHeader) {
  const auto dir = tmp_dir("tokens_short_header");
  const auto p = dir / "a.bin";
  write_bytes(p, shard_bytes(iota16(0, 100)).substr(0, 1000));
  const auto msg = input_error([&] { open_dataset(tokens_cfg(p.string())); });
  EXPECT_HAS(msg, p.string());
  EXPECT_HAS(msg, "truncated header");
  EXPECT_HAS(msg, "offset 1000");
  EXPECT_HAS(msg, "1024");
}

TEST(DataTokens, RefusesWrongMagic) {
  const auto dir = tmp_dir("tokens_magic");
  const auto p = dir / "a.bin";
  write_bytes(p, shard_bytes(iota16(0, 100), 12345));
  const auto msg = input_error([&] { open_dataset(tokens_cfg(p.string())); });
  EXPECT_HAS(msg, p.string());
  EXPECT_HAS(msg, "offset 0");
  EXPECT_HAS(msg, "expected 20240520, found 12345");
}

TEST(DataTokens, RefusesWrongVersion) {
  const auto dir = tmp_dir("tokens_version");
  const auto p = dir / "a.bin";
  write_bytes(p, shard_bytes(iota16(0, 100), 20240520, 7));
  const auto msg = input_error([&] { open_dataset(tokens_cfg(p.string())); });
  EXPECT_HAS(msg, p.string());
  EXPECT_HAS(msg, "offset 4");
  EXPECT_HAS(msg, "expected 1 (uint16 tokens, llm.c's) or 2 (uint32 tokens, loom's), found 7");
}

TEST(DataTokens, RefusesTruncatedTokens) {
  const auto dir = tmp_dir("tokens_truncated");
  const auto p = dir / "a.bin";
  write_bytes(p, shard_bytes(iota16(0, 50), 20240520, 1, 100));  // promises 100, holds 50
  const auto msg = input_error([&] { open_dataset(tokens_cfg(p.string())); });
  EXPECT_HAS(msg, p.string());
  EXPECT_HAS(msg, "truncated");
  EXPECT_HAS(msg, "offset 1124");
  EXPECT_HAS(msg, "promises 100 tokens");
  EXPECT_HAS(msg, "holds 50");
}

// llm.c refuses a shard whose size is not the header's 1024 bytes plus 2 per token it counts; a
// longer file is as suspect as a shorter one (two shards run together, a wrong count).
TEST(DataTokens, RefusesShardLongerThanItsHeaderSays) {
  const auto dir = tmp_dir("tokens_longer");
  const auto p = dir / "a.bin";
  write_bytes(p, shard_bytes(iota16(0, 150), 20240520, 1, 100));  // says 100, holds 150
  auto msg = input_error([&] { open_dataset(tokens_cfg(p.string())); });
  EXPECT_HAS(msg, "'" + p.string() + "'");
  EXPECT_HAS(msg, "promises 100 tokens (1224 bytes)");
  EXPECT_HAS(msg, "1324 bytes, which hold 150 tokens");
  EXPECT_HAS(msg, "offset 8");
  write_bytes(p, shard_bytes(iota16(0, 100), 20240520, 1, 100) + "x");  // one stray byte
  msg = input_error([&] { open_dataset(tokens_cfg(p.string())); });
  EXPECT_HAS(msg, "1225 bytes, which hold 100.5 tokens");
}

TEST(DataTokens, RefusesEmptyShard) {
  const auto dir = tmp_dir("tokens_empty");
  const auto p = dir / "a.bin";
  write_bytes(p, shard_bytes({}));
  const auto msg = input_error([&] { open_dataset(tokens_cfg(p.string())); });
  EXPECT_HAS(msg, p.string());
  EXPECT_HAS(msg, "empty");
  EXPECT_HAS(msg, "offset 8");
}

TEST(DataTokens, RefusesTokenOutsideVocab) {
  const auto dir = tmp_dir("tokens_vocab");
  auto toks = iota16(0, 100);
  toks[5] = 777;
  // The bad token is in the second file: the message names that file and its offset there.
  write_bytes(dir / "s0.bin", shard_bytes(iota16(0, 100)));
  write_bytes(dir / "s1.bin", shard_bytes(toks));
  const auto msg = input_error([&] { open_dataset(tokens_cfg((dir / "s*.bin").string(), 500)); });
  EXPECT_HAS(msg, (dir / "s1.bin").string());
  EXPECT_HAS(msg, "offset 1034");
  EXPECT_HAS(msg, "id 777");
  EXPECT_HAS(msg, "model.vocab = 500");
}

TEST(DataTokens, RefusesSplitShorterThanOneSequence) {
  const auto dir = tmp_dir("tokens_split");
  const auto p = dir / "a.bin";
  write_bytes(p, shard_bytes(iota16(0, 40)));
  // val = 8 tokens < seq_len + 1 = 9.
  const auto msg = input_error([&] { open_dataset(tokens_cfg(p.string(), 1000, 8, 0.2)); });
  EXPECT_HAS(msg, p.string());
  EXPECT_HAS(msg, "val split holds 8 tokens");
  EXPECT_HAS(msg, "seq_len + 1 = 9");
}

// data.val_source is opened with the same code: its errors name data.val_source, not data.source.
TEST(DataSource, ErrorsNameTheKeyTheSourceCameFrom) {
  const auto dir = tmp_dir("val_source_key");
  DataConfig c = text_cfg(dir / "nope.txt");
  c.key = "data.val_source";
  auto msg = input_error([&] { open_dataset(c); });
  EXPECT_HAS(msg, "data.val_source text file '" + (dir / "nope.txt").string() + "'");
  EXPECT_EQ(msg.find("data.source"), std::string::npos) << msg;
  c = tokens_cfg((dir / "*.bin").string());
  c.key = "data.val_source";
  msg = input_error([&] { open_dataset(c); });
  EXPECT_HAS(msg, "data.val_source tokens:");
  EXPECT_EQ(msg.find("data.source"), std::string::npos) << msg;
  c.source = "nonsense";
  msg = input_error([&] { open_dataset(c); });
  EXPECT_HAS(msg, "data.val_source = 'nonsense'");
}
