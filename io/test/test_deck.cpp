// Decks: schema, INI reading, typed checks, --set, messages naming file:line, resolved text.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "core/base/error.hpp"
#include "io/deck.hpp"
#include "io/threads.hpp"

namespace loom {
namespace {

DeckSchema core_schema() {
  DeckSchema s;
  add_core_keys(s);
  return s;
}

// The message of the InputError thrown by parsing `text` (fails the test when none is thrown).
std::string error_of(const std::string& text, const std::vector<std::string>& sets = {}) {
  static const DeckSchema schema = core_schema();
  try {
    parse_deck(schema, text, "deck.ini", sets);
  } catch (const InputError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no InputError for deck:\n" << text;
  return "";
}

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "message: " << (haystack)

TEST(DeckSchema, CoreKeysAndSections) {
  const DeckSchema s = core_schema();
  EXPECT_EQ(s.sections(), (std::vector<std::string>{"model", "data", "train", "parallel", "run", "checkpoint"}));
  ASSERT_NE(s.find("train.lr"), nullptr);
  EXPECT_EQ(s.find("train.lr")->type, KeyType::Float);
  EXPECT_EQ(s.find("train.schedule")->type, KeyType::Choice);
  EXPECT_EQ(s.find("nope.key"), nullptr);
  EXPECT_EQ(s.keys().front().name, "model.layers");
  EXPECT_EQ(s.keys().back().name, "run.plugins");
}

TEST(DeckSchema, AddRefusesDuplicatesAndBadDefaults) {
  DeckSchema s = core_schema();
  KeySpec dup;
  dup.name = "train.lr";
  EXPECT_THROW(s.add(dup), std::logic_error);
  KeySpec nosection;
  nosection.name = "lr";
  EXPECT_THROW(s.add(nosection), std::logic_error);
  KeySpec bad;
  bad.name = "plugin.k";
  bad.type = KeyType::Int;
  bad.default_value = "0";
  bad.min = 1;
  bad.max = 2;
  EXPECT_THROW(s.add(bad), std::logic_error);
  KeySpec ok;
  ok.name = "plugin.k";
  ok.type = KeyType::Int;
  ok.default_value = "2";
  ok.min = 1;
  ok.max = 2;
  ok.help = "a plugin key";
  s.add(ok);
  EXPECT_EQ(s.sections().back(), "plugin");
  const Deck d = parse_deck(s, "[plugin]\nk = 1\n", "deck.ini");
  EXPECT_EQ(d.get_int("plugin.k"), 1);
}

TEST(DeckSchema, NearestNames) {
  const DeckSchema s = core_schema();
  EXPECT_EQ(s.nearest_key("train.learning_rate"), "train.lr");
  EXPECT_EQ(s.nearest_key("train.stesp"), "train.steps");
  EXPECT_EQ(s.nearest_key("model.lr"), "train.lr");
  EXPECT_EQ(s.nearest_key("trian.lr"), "train.lr");
  EXPECT_EQ(s.nearest_key("train.sched"), "train.schedule");
  EXPECT_EQ(s.nearest_section("modle"), "model");
  EXPECT_EQ(s.nearest_section("paralel"), "parallel");
}

TEST(DeckSchema, DescribeListsEveryKey) {
  const DeckSchema s = core_schema();
  const std::string t = s.describe();
  for (const auto& k : s.keys()) EXPECT_HAS(t, k.name);
  EXPECT_HAS(t, "1 .. 1024");
  EXPECT_HAS(t, "[0, 10]");
  EXPECT_HAS(t, "constant | cosine");
  EXPECT_HAS(t, "BLAS threads per rank");
  EXPECT_HAS(t, "1.5 and 1e-3 are refused");
}

TEST(Deck, DefaultsWhenEmpty) {
  const DeckSchema s = core_schema();
  const Deck d = parse_deck(s, "", "deck.ini");
  EXPECT_EQ(d.get_int("model.layers"), 4);
  EXPECT_EQ(d.get_int("model.d_model"), 128);
  EXPECT_FALSE(d.get_bool("model.recompute"));
  EXPECT_EQ(d.get_string("data.source"), "synthetic");
  EXPECT_EQ(d.get_string("data.val_source"), "");
  EXPECT_DOUBLE_EQ(d.get_float("train.lr"), 3e-4);
  EXPECT_DOUBLE_EQ(d.get_float("train.eps"), 1e-8);
  EXPECT_EQ(d.get_string("train.schedule"), "cosine");
  EXPECT_EQ(d.get_int("train.seed"), 1337);
  EXPECT_EQ(d.get_string("run.dir"), "runs/loom");
  EXPECT_EQ(d.get_string("run.threads"), "auto");
  EXPECT_TRUE(d.is_default("train.lr"));
  EXPECT_EQ(d.origin("train.lr"), "default");
  EXPECT_EQ(d.path(), "deck.ini");
  EXPECT_EQ(d.values().size(), s.keys().size());
  EXPECT_EQ(d.values().at("model.layers"), "4");
}

TEST(Deck, ReadsValuesWithLinesAndComments) {
  const DeckSchema s = core_schema();
  const std::string text =
      "# a deck\n"                    // 1
      "\n"                            // 2
      "[model]\n"                     // 3
      "layers = 8   # deeper\n"       // 4
      "  d_model=256\n"               // 5
      "   # indented comment\n"       // 6
      "[train]\n"                     // 7
      "lr = 1e-3\n"                   // 8
      "schedule = constant\n"         // 9
      "[data]\n"                      // 10
      "source = text:corpus.txt\r\n"  // 11
      "[model]\n"                     // 12
      "recompute = yes\n";            // 13
  const Deck d = parse_deck(s, text, "deck.ini");
  EXPECT_EQ(d.get_int("model.layers"), 8);
  EXPECT_EQ(d.get_int("model.d_model"), 256);
  EXPECT_DOUBLE_EQ(d.get_float("train.lr"), 1e-3);
  EXPECT_EQ(d.get_string("train.schedule"), "constant");
  EXPECT_EQ(d.get_string("data.source"), "text:corpus.txt");
  EXPECT_TRUE(d.get_bool("model.recompute"));
  EXPECT_EQ(d.origin("model.layers"), "deck.ini:4");
  EXPECT_EQ(d.origin("model.d_model"), "deck.ini:5");
  EXPECT_EQ(d.origin("train.lr"), "deck.ini:8");
  EXPECT_EQ(d.origin("data.source"), "deck.ini:11");
  EXPECT_EQ(d.origin("model.recompute"), "deck.ini:13");
  EXPECT_FALSE(d.is_default("model.layers"));
  EXPECT_TRUE(d.is_default("model.heads"));
}

TEST(Deck, Booleans) {
  const DeckSchema s = core_schema();
  for (const char* t : {"true", "1", "yes", "on", "True", "YES"})
    EXPECT_TRUE(parse_deck(s, std::string("[model]\nrecompute = ") + t + "\n", "d").get_bool("model.recompute")) << t;
  for (const char* f : {"false", "0", "no", "off", "OFF"})
    EXPECT_FALSE(parse_deck(s, std::string("[model]\nrecompute = ") + f + "\n", "d").get_bool("model.recompute")) << f;
  const Deck d = parse_deck(s, "[model]\nrecompute = on\n", "d");
  EXPECT_EQ(d.values().at("model.recompute"), "true");  // normalized
  const std::string e = error_of("[model]\nrecompute = maybe\n");
  EXPECT_HAS(e, "deck.ini:2: model.recompute = 'maybe' is not a boolean");
  EXPECT_HAS(e, "yes/no");
}

TEST(Deck, IntegerParsing) {
  const DeckSchema s = core_schema();
  auto steps = [&](const std::string& v) {
    return parse_deck(s, "[train]\nsteps = " + v + "\n", "d").get_int("train.steps");
  };
  EXPECT_EQ(steps("4096"), 4096);
  EXPECT_EQ(steps("+12"), 12);
  EXPECT_EQ(steps("007"), 7);
  EXPECT_EQ(steps("1e3"), 1000);
  EXPECT_EQ(steps("2.5e3"), 2500);
  EXPECT_EQ(steps("1e12"), 1000000000000LL);
  EXPECT_EQ(steps("10.0"), 10);
  EXPECT_EQ(parse_deck(s, "[train]\nsteps = 1e3\n", "d").values().at("train.steps"), "1000");
  const Deck seed = parse_deck(s, "[train]\nseed = 9200000000000000000\n", "d");
  EXPECT_EQ(seed.get_int("train.seed"), 9200000000000000000LL);

  std::string e = error_of("[train]\nsteps = 1.5\n");
  EXPECT_HAS(e, "deck.ini:2: train.steps = '1.5' is not an integer (integer, allowed 1 .. 1000000000000)");
  e = error_of("[train]\nsteps = 1e-3\n");
  EXPECT_HAS(e, "deck.ini:2: train.steps = '1e-3' is not an integer");
  e = error_of("[train]\nsteps = ten\n");
  EXPECT_HAS(e, "'ten' is not an integer");
  e = error_of("[train]\nsteps = 0x10\n");
  EXPECT_HAS(e, "'0x10' is not an integer");
  e = error_of("[train]\nsteps =\n");
  EXPECT_HAS(e, "deck.ini:2: train.steps = '' is not an integer");
  e = error_of("[train]\nseed = 9200000000000000001\n");
  EXPECT_HAS(e, "train.seed = 9200000000000000001 is out of range (integer, allowed 0 .. 9200000000000000000)");
  e = error_of("[train]\nseed = 99999999999999999999999\n");
  EXPECT_HAS(e, "is out of range");
  e = error_of("[train]\nsteps = 1e400\n");
  EXPECT_HAS(e, "train.steps = 1e400 is out of range");
}

TEST(Deck, IntegerOutOfRange) {
  const std::string text = "[train]\nsteps = 10\n\n[model]\n\n\n\n\nlayers = 0\n";
  const std::string e = error_of(text);
  EXPECT_HAS(e, "deck.ini:9: model.layers = 0 is out of range (integer, allowed 1 .. 1024)");
  EXPECT_HAS(error_of("[model]\nlayers = 1025\n"), "deck.ini:2: model.layers = 1025 is out of range");
  EXPECT_HAS(error_of("[model]\nlayers = -1\n"), "model.layers = -1 is out of range");
}

TEST(Deck, FloatParsing) {
  const DeckSchema s = core_schema();
  auto lr = [&](const std::string& v) { return parse_deck(s, "[train]\nlr = " + v + "\n", "d").get_float("train.lr"); };
  EXPECT_DOUBLE_EQ(lr("1e-3"), 1e-3);
  EXPECT_DOUBLE_EQ(lr("0.5"), 0.5);
  EXPECT_DOUBLE_EQ(lr(".25"), 0.25);
  EXPECT_DOUBLE_EQ(lr("2"), 2.0);
  EXPECT_DOUBLE_EQ(lr("6E-4"), 6e-4);
  EXPECT_DOUBLE_EQ(lr("0"), 0.0);
  EXPECT_DOUBLE_EQ(lr("10"), 10.0);

  std::string e = error_of("[train]\n\n\n\n\n\n\n\nlr = abc\n");
  EXPECT_HAS(e, "deck.ini:9: train.lr = 'abc' is not a number (float, allowed range [0, 10])");
  for (const char* bad : {"nan", "inf", "1e", "--1", "1.2.3", "0x1p3", "3e-4x"})
    EXPECT_HAS(error_of(std::string("[train]\nlr = ") + bad + "\n"), "is not a number") << bad;
  e = error_of("[train]\nlr = 10.5\n");
  EXPECT_HAS(e, "deck.ini:2: train.lr = 10.5 is out of range (float, allowed range [0, 10])");
  e = error_of("[train]\neps = -1e-9\n");
  EXPECT_HAS(e, "train.eps = -1e-9 is out of range (float, allowed range [0, 1])");
  e = error_of("[train]\nbeta2 = 1\n");
  EXPECT_HAS(e, "train.beta2 = 1 is out of range (float, allowed range [0, 0.999999])");
  e = error_of("[train]\ngrad_clip = 1e7\n");
  EXPECT_HAS(e, "allowed range [0, 1e6]");
  e = error_of("[train]\nlr = 1e999\n");
  EXPECT_HAS(e, "train.lr = 1e999 is out of range");
}

TEST(Deck, ChoiceAndValidate) {
  const DeckSchema s = core_schema();
  std::string e = error_of("[train]\n\n\nschedule = linear\n");
  EXPECT_HAS(e, "deck.ini:4: train.schedule = 'linear' is not one of: constant, cosine");

  EXPECT_EQ(parse_deck(s, "[data]\nsource = tokens:data/*.bin\n", "d").get_string("data.source"), "tokens:data/*.bin");
  e = error_of("[data]\nsource = text:\n");
  EXPECT_HAS(e, "deck.ini:2: data.source = 'text:' is not allowed (allowed: synthetic, text:PATH or tokens:GLOB");
  e = error_of("[data]\nsource = wiki\n");
  EXPECT_HAS(e, "data.source = 'wiki' is not allowed");
  EXPECT_EQ(parse_deck(s, "[data]\nval_source = text:val.txt\n", "d").get_string("data.val_source"), "text:val.txt");
  EXPECT_EQ(parse_deck(s, "[data]\nval_source =\n", "d").get_string("data.val_source"), "");
  e = error_of("[data]\nval_source = tokens:\n");
  EXPECT_HAS(e, "deck.ini:2: data.val_source = 'tokens:' is not allowed");
  e = error_of("[data]\nval_fraction = 0.95\n");
  EXPECT_HAS(e, "data.val_fraction = 0.95 is out of range (float, allowed range [0, 0.9])");
}

TEST(Deck, ThreadsAutoOrCount) {
  const DeckSchema s = core_schema();
  EXPECT_EQ(parse_deck(s, "[run]\nthreads = auto\n", "d").get_string("run.threads"), "auto");
  EXPECT_EQ(parse_deck(s, "[run]\nthreads = 8\n", "d").get_string("run.threads"), "8");
  EXPECT_EQ(parse_deck(s, "", "d", {"run.threads=1024"}).get_string("run.threads"), "1024");
  for (const char* bad : {"0", "-2", "1025", "2.5", "Auto", "four", "8 threads"}) {
    const std::string e = error_of(std::string("[run]\nthreads = ") + bad + "\n");
    EXPECT_HAS(e, std::string("deck.ini:2: run.threads = '") + bad +
                      "' is not allowed (allowed: auto, or an integer in [1, 1024])");
  }
}

TEST(Threads, CountIgnoresTheEnvironment) {
  const ThreadCount t = resolve_threads("6", "2", "3");
  EXPECT_EQ(t.threads, 6);
  EXPECT_EQ(t.origin, "run.threads = 6");
}

TEST(Threads, AutoPrefersOmpThenSlurmThenOne) {
  ThreadCount t = resolve_threads("auto", "4", "8");
  EXPECT_EQ(t.threads, 4);
  EXPECT_EQ(t.origin, "run.threads = auto: OMP_NUM_THREADS = 4");
  t = resolve_threads("auto", "3,2", nullptr);  // a nesting list: the outer level counts
  EXPECT_EQ(t.threads, 3);
  t = resolve_threads("auto", nullptr, "8");
  EXPECT_EQ(t.threads, 8);
  EXPECT_EQ(t.origin, "run.threads = auto: SLURM_CPUS_PER_TASK = 8");
  t = resolve_threads("auto", "", "5");  // an empty variable counts as unset
  EXPECT_EQ(t.threads, 5);
  t = resolve_threads("auto", nullptr, nullptr);
  EXPECT_EQ(t.threads, 1);
  EXPECT_HAS(t.origin, "neither OMP_NUM_THREADS nor SLURM_CPUS_PER_TASK is set");
}

TEST(Threads, AutoRefusesABadVariableNamingIt) {
  for (const auto& [omp, slurm, named] : std::vector<std::tuple<const char*, const char*, std::string>>{
           {"many", "4", "OMP_NUM_THREADS = 'many'"},
           {"0", nullptr, "OMP_NUM_THREADS = '0'"},
           {nullptr, "2(x3)", "SLURM_CPUS_PER_TASK = '2(x3)'"},
           {nullptr, "5000", "SLURM_CPUS_PER_TASK = '5000'"}}) {
    try {
      resolve_threads("auto", omp, slurm);
      ADD_FAILURE() << "no InputError for " << named;
    } catch (const InputError& e) {
      EXPECT_HAS(e.what(), "run.threads = auto: " + named + " is not a thread count in [1, 1024]");
    }
  }
}

TEST(Deck, UnknownKey) {
  const std::string e = error_of("[model]\nlayers = 2\n[train]\nsteps = 5\n\n\nlearning_rate = 1e-3\n");
  EXPECT_HAS(e, "deck.ini:7: unknown key 'train.learning_rate' in section [train]; did you mean 'train.lr'?");
  EXPECT_HAS(e, "(valid keys: steps, batch, micro_batches, lr,");
  EXPECT_HAS(error_of("[model]\nlayer = 2\n"),
             "deck.ini:2: unknown key 'model.layer' in section [model]; did you mean 'model.layers'?");
  // A key of another section is pointed there.
  EXPECT_HAS(error_of("[model]\nlr = 2\n"),
             "deck.ini:2: unknown key 'model.lr' in section [model]; did you mean 'train.lr'?");
}

TEST(Deck, UnknownSection) {
  const std::string e = error_of("# x\n\n[modle]\nlayers = 2\n");
  EXPECT_HAS(e,
             "deck.ini:3: unknown section [modle]; did you mean [model]? (valid sections: model, data, train, "
             "parallel, run, checkpoint)");
  EXPECT_HAS(error_of("[Train]\n"), "deck.ini:1: unknown section [Train]; did you mean [train]?");
  EXPECT_HAS(error_of("[ model ]\n"), "deck.ini:1: section header '[ model ]' contains spaces; write [model]");
  EXPECT_HAS(error_of("[]\n"), "deck.ini:1: empty section name");
}

TEST(Deck, KeyOutsideSection) {
  const std::string e = error_of("# top\nlayers = 3\n[model]\n");
  EXPECT_HAS(e, "deck.ini:2: key 'layers' is outside any section");
  EXPECT_HAS(e, "belongs in [model]");
}

TEST(Deck, LinesThatAreNotIni) {
  std::string e = error_of("[model]\nlayers 4\n");
  EXPECT_HAS(e, "deck.ini:2: cannot read line 'layers 4'");
  EXPECT_HAS(e, "expected [section], key = value");
  EXPECT_HAS(error_of("[model\n"), "deck.ini:1: cannot read line '[model'");
  EXPECT_HAS(error_of("[model]\n= 4\n"), "deck.ini:2: cannot read line '= 4'");
  EXPECT_HAS(error_of("[train]\nsteps = 3\n; ini comment\n"), "deck.ini:3: cannot read line '; ini comment'");
}

TEST(Deck, DuplicateKeyNamesBothLines) {
  const std::string e = error_of("[train]\nlr = 1e-3\n[model]\nlayers = 2\n[train]\nsteps = 3\nlr = 2e-3\n");
  EXPECT_HAS(e, "deck.ini:7: key 'train.lr' given twice");
  EXPECT_HAS(e, "first at deck.ini:2");
  EXPECT_HAS(e, "again at deck.ini:7");
}

TEST(Deck, FirstErrorInFileOrder) {
  EXPECT_HAS(error_of("[train]\nlr = x\nsteps = y\n"), "deck.ini:2: train.lr");
  EXPECT_HAS(error_of("[train]\nsteps = 0\nlr = 99\n"), "deck.ini:2: train.steps");
}

TEST(Deck, SetOverrides) {
  const DeckSchema s = core_schema();
  const Deck d = parse_deck(s, "[train]\nlr = 1e-3\nsteps = 10\n", "deck.ini",
                            {"train.lr=2e-3", "model.layers = 6", "train.lr=5e-3", "data.val_source=text:v.txt"});
  EXPECT_DOUBLE_EQ(d.get_float("train.lr"), 5e-3);  // the later --set wins
  EXPECT_EQ(d.origin("train.lr"), "--set");
  EXPECT_EQ(d.get_int("model.layers"), 6);
  EXPECT_EQ(d.origin("model.layers"), "--set");
  EXPECT_FALSE(d.is_default("model.layers"));
  EXPECT_EQ(d.get_int("train.steps"), 10);
  EXPECT_EQ(d.origin("train.steps"), "deck.ini:3");
  EXPECT_EQ(d.get_string("data.val_source"), "text:v.txt");
  // A --set with an empty value is allowed where the key allows it.
  EXPECT_EQ(parse_deck(s, "[data]\nval_source = text:a\n", "d", {"data.val_source="}).get_string("data.val_source"),
            "");
}

TEST(Deck, SetErrors) {
  std::string e = error_of("", {"train.lr=abc"});
  EXPECT_HAS(e, "--set train.lr=abc: train.lr = 'abc' is not a number (float, allowed range [0, 10])");
  e = error_of("", {"model.layers=2000"});
  EXPECT_HAS(e, "--set model.layers=2000: model.layers = 2000 is out of range (integer, allowed 1 .. 1024)");
  e = error_of("", {"train.schedule=linear"});
  EXPECT_HAS(e, "--set train.schedule=linear: train.schedule = 'linear' is not one of: constant, cosine");
  e = error_of("", {"train.lr"});
  EXPECT_HAS(e, "--set train.lr: expected section.key=value");
  EXPECT_HAS(e, "nearest key: 'train.lr'");
  e = error_of("", {"train.learning_rate=1e-3"});
  EXPECT_HAS(
      e,
      "--set train.learning_rate=1e-3: unknown key 'train.learning_rate' in section [train]; did you mean 'train.lr'?");
  e = error_of("", {"trian.steps=3"});
  EXPECT_HAS(e, "--set trian.steps=3: unknown key 'trian.steps'; did you mean 'train.steps'?");
  e = error_of("", {"run.dir=a#b"});
  EXPECT_HAS(e, "--set run.dir=a#b: run.dir = 'a#b' holds a '#'");
  // The first bad --set is reported even when a later one would fix it.
  e = error_of("", {"model.layers=0", "model.layers=2"});
  EXPECT_HAS(e, "--set model.layers=0:");
}

TEST(Deck, ResolvedTextRoundTrips) {
  const DeckSchema s = core_schema();
  const Deck d = parse_deck(s, "[model]\nlayers = 1e1\nrecompute = on\n[train]\nlr = 6e-4\nschedule = constant\n",
                            "deck.ini", {"run.dir=runs/x y", "train.seed=42"});
  const std::string t = d.resolved_text();
  EXPECT_EQ(t.rfind("#", 0), 0u);  // header comment
  EXPECT_HAS(t, "[model]\nlayers = 10\n");
  EXPECT_HAS(t, "recompute = true\n");
  EXPECT_HAS(t, "heads = 4  # default\n");
  EXPECT_HAS(t, "lr = 6e-4\n");
  EXPECT_HAS(t, "dir = runs/x y\n");
  EXPECT_HAS(t, "seed = 42\n");
  EXPECT_HAS(t, "val_source =   # default\n");
  // Sections in schema order.
  const auto pm = t.find("[model]"), pd = t.find("[data]"), pt = t.find("[train]"), pp = t.find("[parallel]"),
             pr = t.find("[run]");
  ASSERT_NE(pr, std::string::npos);
  EXPECT_LT(pm, pd);
  EXPECT_LT(pd, pt);
  EXPECT_LT(pt, pp);
  EXPECT_LT(pp, pr);

  const Deck again = parse_deck(s, t, "resolved.ini");
  EXPECT_EQ(again.values(), d.values());
  // The resolved file gives every key, so nothing is left at its default any more.
  EXPECT_EQ(again.origin("model.heads"), "resolved.ini:7");  // 2 header lines, blank, [model], layers, d_model
  EXPECT_EQ(again.resolved_text().find("# default\n"), std::string::npos);
  EXPECT_EQ(parse_deck(s, again.resolved_text(), "again.ini").values(), d.values());

  // The defaults alone round-trip too.
  const Deck defaults = parse_deck(s, "", "empty.ini");
  EXPECT_EQ(parse_deck(s, defaults.resolved_text(), "r.ini").values(), defaults.values());
}

TEST(Deck, GettersRefuseWrongUse) {
  const DeckSchema s = core_schema();
  const Deck d = parse_deck(s, "", "deck.ini");
  EXPECT_THROW(d.get_int("train.nope"), std::logic_error);
  EXPECT_THROW(d.get_int("train.lr"), std::logic_error);
  EXPECT_THROW(d.get_float("train.steps"), std::logic_error);
  EXPECT_THROW(d.get_bool("train.lr"), std::logic_error);
  EXPECT_THROW(d.get_string("model.layers"), std::logic_error);
  EXPECT_THROW(d.origin("nope.key"), std::logic_error);
  EXPECT_THROW(d.is_default("nope.key"), std::logic_error);
  EXPECT_NO_THROW(d.get_string("train.schedule"));
}

TEST(Deck, LoadMissingFile) {
  const DeckSchema s = core_schema();
  try {
    load_deck(s, "x.deck");
    FAIL() << "no InputError";
  } catch (const InputError& e) {
    EXPECT_EQ(std::string(e.what()), "deck 'x.deck': cannot be read (No such file or directory)");
  }
}

// The DeckError thrown by loading the deck file `path` (fails the test when none is thrown).
std::string load_error(const std::string& path) {
  static const DeckSchema schema = core_schema();
  try {
    load_deck(schema, path);
  } catch (const DeckError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no DeckError for deck file " << path;
  return "";
}

std::string deck_file(const std::string& name, const std::string& text) {
  const auto dir = std::filesystem::path(LOOM_TEST_TMP) / "deck";
  std::filesystem::create_directories(dir);
  const auto path = (dir / name).string();
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

// A deck file that sets nothing would silently train the defaults: it is refused, naming the file.
TEST(Deck, LoadRefusesAnEmptyFile) {
  const std::string path = deck_file("empty.deck", "");
  const std::string e = load_error(path);
  EXPECT_HAS(e, "deck '" + path + "'");
  EXPECT_HAS(e, "is empty (0 bytes)");
}

TEST(Deck, LoadRefusesOnlyCommentsAndBlankLines) {
  const std::string path = deck_file("comments.deck", "# nothing here\n\n   # still nothing\n[model]\n");
  const std::string e = load_error(path);
  EXPECT_HAS(e, "deck '" + path + "'");
  EXPECT_HAS(e, "no settings");
}

TEST(Deck, LoadRefusesADirectory) {
  const auto dir = std::filesystem::path(LOOM_TEST_TMP) / "deck" / "a_directory.deck";
  std::filesystem::create_directories(dir);
  const std::string e = load_error(dir.string());
  EXPECT_HAS(e, "deck '" + dir.string() + "'");
  EXPECT_HAS(e, "is a directory");
}

// Values are echoed escaped and cut: a megabyte value does not flood the terminal, binary bytes do
// not reach it, and a NUL does not end the message before its reason.
TEST(Deck, LongAndBinaryValuesAreEchoedShortAndEscaped) {
  const std::string mb(1 << 20, '7');
  std::string e = error_of("[train]\nlr = " + mb + "x\n");
  EXPECT_HAS(e, "deck.ini:2: train.lr = '" + std::string(80, '7') + "...' (1048577 bytes) is not a number");
  EXPECT_LT(e.size(), 400u);
  e = error_of(std::string("[train]\nlr = 1\x01\xff") + "\n");
  EXPECT_HAS(e, "train.lr = '1\\x01\\xff' is not a number");
  const char nul_value[] = "[train]\nschedule = cos\0ine\n";
  e = error_of(std::string(nul_value, sizeof nul_value - 1));
  EXPECT_HAS(e, "train.schedule = 'cos\\x00ine' is not one of: constant, cosine");
  e = error_of("", {"train.lr=" + mb});
  EXPECT_HAS(e, "--set train.lr=" + std::string(71, '7') + "... (1048585 bytes): ");
  EXPECT_HAS(e, "train.lr = " + std::string(80, '7') + "... (1048576 bytes) is out of range");
  EXPECT_LT(e.size(), 600u);
  e = error_of(std::string("[train]\n") + mb + "\n");
  EXPECT_HAS(e, "cannot read line '777");
  EXPECT_LT(e.size(), 400u);
  e = error_of(std::string("[train]\nl\x02r = 1\n"));
  EXPECT_HAS(e, "unknown key 'train.l\\x02r'");
}

}  // namespace
}  // namespace loom
