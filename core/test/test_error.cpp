// quote_value() and escape_value(): how every message echoes a value the user gave.
#include <gtest/gtest.h>

#include <string>

#include "core/base/error.hpp"

using loom::escape_value;
using loom::quote_value;

TEST(QuoteValue, ShortPrintableValuesAreQuotedAsGiven) {
  EXPECT_EQ(quote_value("text:/data/corpus.txt"), "'text:/data/corpus.txt'");
  EXPECT_EQ(quote_value(""), "''");
  EXPECT_EQ(quote_value("caf\xC3\xA9 \xE2\x82\xAC"), "'caf\xC3\xA9 \xE2\x82\xAC'");  // UTF-8 prints as itself
}

TEST(QuoteValue, NonPrintableBytesAreEscaped) {
  EXPECT_EQ(quote_value("a\nb\tc\rd\\e"), "'a\\nb\\tc\\rd\\\\e'");
  EXPECT_EQ(quote_value(std::string("x\0y", 3)), "'x\\x00y'");  // a NUL no longer ends the message
  EXPECT_EQ(quote_value("\x01\x1b\x7f"), "'\\x01\\x1b\\x7f'");
  EXPECT_EQ(quote_value("\xff\xfe\xC3"), "'\\xff\\xfe\\xc3'");  // not UTF-8 (the last one is cut short)
}

TEST(QuoteValue, LongValuesAreCutWithTheirFullLength) {
  const std::string mb(1048576, 'a');
  EXPECT_EQ(quote_value(mb), "'" + std::string(80, 'a') + "...' (1048576 bytes)");
  EXPECT_EQ(quote_value(std::string(80, 'a')), "'" + std::string(80, 'a') + "'");  // fits: not cut
  // Escapes count by the width they take, so binary values stay as short on the screen.
  const std::string zeros(1000, '\0');
  const std::string q = quote_value(zeros);
  EXPECT_EQ(q.substr(0, 5), "'\\x00");
  EXPECT_LE(q.size(), 80u + 30u) << q;
  EXPECT_NE(q.find("...' (1000 bytes)"), std::string::npos) << q;
  EXPECT_EQ(quote_value("abcdef", 3), "'abc...' (6 bytes)");
}

TEST(EscapeValue, SameEscapesAndCutWithoutQuotes) {
  EXPECT_EQ(escape_value("train.lr=3e-4"), "train.lr=3e-4");
  EXPECT_EQ(escape_value(std::string("a\0b", 3)), "a\\x00b");
  EXPECT_EQ(escape_value(std::string(100, '9'), 4), "9999... (100 bytes)");
}

// "Did you mean": the nearest word within a third of the word's letters (a swap of two neighbours is
// one slip), and no guess for a word near nothing.
TEST(NearestWord, SuggestsOnlyASlipOfTheKeyboard) {
  const std::vector<std::string> commands = {"run", "check", "export", "plan", "keys", "plugins"};
  EXPECT_EQ(loom::nearest_word("rnu", commands), "run");
  EXPECT_EQ(loom::nearest_word("chek", commands), "check");
  EXPECT_EQ(loom::nearest_word("plugin", commands), "plugins");
  EXPECT_EQ(loom::nearest_word("frobnicate", commands), "");
  EXPECT_EQ(loom::nearest_word("x", commands), "");
  EXPECT_EQ(loom::nearest_word(std::string(1000, 'r'), commands), "");
}
