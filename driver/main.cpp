// loom: the driver. Command line (Boost.Program_options), MPI and Kokkos start-up, subcommands.
#include <mpi.h>

#include <Kokkos_Core.hpp>
#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <cstdio>
#include <unistd.h>
#include <boost/program_options.hpp>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "core/base/error.hpp"
#include "core/comm/fault.hpp"
#include "core/engine/keys_reference.hpp"
#include "core/engine/plugin.hpp"
#include "core/backend/blas_core.hpp"
#include "core/backend/wait_policy.hpp"
#include "driver/commands.hpp"
#include "driver/session.hpp"
#include "io/checkpoint.hpp"
#include "io/deck.hpp"
#include "io/report.hpp"
#include "loom/build_info.hpp"

namespace po = boost::program_options;
using namespace loom;

namespace {

const char* kUsage =
    "usage: loom [--help] [--version] COMMAND [ARGS]\n"
    "\n"
    "commands:\n"
    "  run DECK [--set section.key=value ...] [--help-deck]\n"
    "                 train the model the deck describes; writes run.dir/{metrics.jsonl,summary.json,report.json}\n"
    "  check DECK [--set section.key=value ...]\n"
    "                 validate the deck, its layout (for as many ranks as it needs), its data files, the\n"
    "                 checkpoint directory and checkpoint.resume, and print the deck resolved, with every default\n"
    "  export DECK OUT.h5 [--set section.key=value ...]\n"
    "                 train on one process and write weights, batches, losses and gradients for the PyTorch\n"
    "                 oracle (regression/oracle.py)\n"
    "  ckpt info FILE print a checkpoint's step, layout, deck, and every tensor with its shape and dtype\n"
    "  ckpt verify FILE|DIR\n"
    "                 read checkpoints whole: every tensor against its checksum, finite, and present for the\n"
    "                 model recorded; for a checkpoint.dir (or its `latest`) each ckpt-*.h5 and `latest` (exit 1\n"
    "                 if any is damaged, or if `latest` names no intact checkpoint)\n"
    "  ckpt llmc CKPT OUT.bin\n"
    "                 write a checkpoint's weights as an llm.c model file (train_gpt2.c reads it; a deck's\n"
    "                 model.init_from reads it back)\n"
    "  ckpt hf CKPT DIR [--tokenizer FILE.model]\n"
    "                 write a checkpoint as Hugging Face's files, DIR/model.safetensors and DIR/config.json\n"
    "                 (GPT2LMHeadModel, or LlamaForCausalLM for model.arch = llama; model.init_from = DIR\n"
    "                 reads them back); --tokenizer copies a SentencePiece model to DIR/tokenizer.model\n"
    "  data prepare --input GLOB [--input GLOB ...] | --input-list FILE --out DIR [--vocab N]\n"
    "               [--model-type bpe|unigram] [--tokenizer FILE.model] [--val-fraction F] [--shard-tokens N]\n"
    "               [--threads N] [--verify] [--overwrite]\n"
    "                 text files (UTF-8) to token shards: train a SentencePiece tokenizer (or use the given one),\n"
    "                 encode in parallel (ranks x threads), write train/val shards in llm.c's format and\n"
    "                 DIR/manifest.json; a rerun on the same inputs does nothing, an interrupted one resumes\n"
    "  eval CKPT [--data SOURCE] [--batches N] [--set section.key=value ...] [--json]\n"
    "                 a checkpoint's loss, perplexity and bits per byte on held-out data (default: its run's),\n"
    "                 at any layout (mpirun -n 4 loom eval CKPT --set parallel.dp=4): the run's validation figure\n"
    "  sample CKPT [--prompt TEXT | --tokens IDS] [--steps N] [--temperature T] [--top-k K] [--seed S]\n"
    "              [--tokenizer FILE]\n"
    "                 generate from a checkpoint (file, or checkpoint directory: its latest): text for the byte\n"
    "                 vocabulary or with a SentencePiece model (--tokenizer, else the run's data.tokenizer),\n"
    "                 else token ids (decoded with an llm.c tokenizer file when given)\n"
    "  plan DECK [--cluster FILE|PRESET] [--set section.key=value ...] [--json]\n"
    "                 predict the deck's memory per rank (by the ledger's categories) and step time on a\n"
    "                 machine before the job runs\n"
    "  plan DECK --devices N [--cluster ...] [--set ...] [--top K] [--all] [--json] [--memo FILE.md]\n"
    "                 search the layouts of N devices (dp x tp x pp, micro-batches, ZeRO stage, recompute,\n"
    "                 sequence parallelism, precision): those that fit ranked by predicted tokens/s, why each\n"
    "                 layout that does not fit fails; --memo writes the chosen layout's memo (Markdown)\n"
    "  plan --cluster FILE|PRESET [--set section.key=value ...] --show | plan --calibrate [-o FILE] [--set "
    "network.*=...]\n"
    "  plan --cluster-keys\n"
    "                 the machine a plan is for: a cluster description (presets a100-80gb, h100-sxm, h200), or\n"
    "                 this machine measured (on 2 ranks or more, or on 1 with the network.* figures given by\n"
    "                 --set) and written to FILE (default\n"
    "                 ~/.config/loom/cluster.ini); without --cluster, this machine's file, else h100-sxm\n"
    "  plot RUN_DIR... [-o OUTDIR] | plot --sweep RESULT.csv --x KEY [-o OUTDIR]\n"
    "                 draw loss curves of runs, or a sweep's table against a swept key, as PNGs\n"
    "  keys [--markdown]\n"
    "                 list every deck key with its type, default, range and help (--markdown: docs/keys.md)\n"
    "  plugins        list the strategies found (built-in and libloom_<name>.so on the plugin path) with\n"
    "                 their versions and deck options\n"
    "\n"
    "Launch with mpirun/srun for more ranks (mpirun -n 1 build/loom run inputs/quickstart.deck), or directly.\n"
    "--set may be repeated; later values win. Exit status: 0 done, 2 bad input (deck, data, layout), 1 failure,\n"
    "3 stopped by SIGTERM, SIGINT or SIGHUP after saving a checkpoint (continue with --set checkpoint.resume=auto).\n";

// The lines of kUsage for one command: each line "  COMMAND ..." and the lines indented under it.
std::string command_usage(const std::string& command) {
  std::istringstream in(kUsage);
  std::string line, out;
  bool inside = false;
  while (std::getline(in, line)) {
    if (line.rfind("  " + command + " ", 0) == 0)
      inside = true;
    else if (line.rfind("  ", 0) != 0 || line[2] != ' ')
      inside = false;  // another command, or the end
    if (inside) out += line + "\n";
  }
  return out;
}

// Where to read more about each command, for its --help.
std::string read_more(const std::string& command) {
  static const std::map<std::string, std::string> pages = {
      {"run",
       "docs/parallel.md (layouts), docs/checkpoints.md (restart), docs/clusters.md, loom keys (every deck key)"},
      {"check", "loom keys (every deck key), docs/troubleshooting.md"},
      {"export", "docs/tests.md (the PyTorch oracle)"},
      {"ckpt", "docs/checkpoints.md, docs/trained-model.md"},
      {"sample", "docs/trained-model.md"},
      {"data", "docs/data.md"},
      {"eval", "docs/data.md"},
      {"plan", "docs/planning.md"},
      {"keys", "README.md \"Decks\""},
      {"plugins", "docs/install-and-plugins.md"}};
  const auto it = pages.find(command);
  return it == pages.end() ? "README.md" : it->second;
}

// `loom COMMAND --help`: its lines of the usage, then where to read more.
std::string command_help(const std::string& command) {
  std::string s = "usage:\n" + command_usage(command);
  if (command == "run" || command == "check" || command == "export")
    s += "  --set section.key=value   override a deck key (repeatable; the later value wins)\n";
  if (command == "run") s += "  --help-deck               print every deck key (as loom keys)\n";
  return s + "more: " + read_more(command) + "\n";
}

// One line for a mistyped command line: what was wrong, the nearest word when one is close, and where
// the usage is (never the whole usage).
[[noreturn]] void usage_error(const std::string& command, const std::string& what) {
  throw UsageError("loom " + command + ": " + what + " (loom " + command + " --help shows its usage)");
}

// Boost's refusal of an option, with the option of `opts` nearest to the one given.
[[noreturn]] void option_error(const std::string& command, const po::error& e, const po::options_description& opts) {
  std::string what = e.what();
  if (const auto* u = dynamic_cast<const po::unknown_option*>(&e)) {
    std::vector<std::string> names;
    for (const auto& o : opts.options())
      if (!o->long_name().empty() && !o->description().empty()) names.push_back("--" + o->long_name());
    const std::string near = nearest_word(u->get_option_name(), names);
    if (!near.empty()) what += "; did you mean " + near + "?";
  }
  usage_error(command, what);
}

struct Args {
  std::string command;
  std::vector<std::string> positional, sets;
  bool help_deck = false;
};

Args parse_subcommand(const std::string& command, const std::vector<std::string>& rest) {
  po::options_description opts("options");
  opts.add_options()("set", po::value<std::vector<std::string>>()->composing(), "override section.key=value")(
      "help-deck", po::bool_switch(), "print every deck key")("positional", po::value<std::vector<std::string>>(), "");
  po::positional_options_description pos;
  pos.add("positional", -1);
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(rest).options(opts).positional(pos).run(), vm);
  } catch (const po::error& e) {
    option_error(command, e, opts);
  }
  Args a;
  a.command = command;
  if (vm.count("positional")) a.positional = vm["positional"].as<std::vector<std::string>>();
  if (vm.count("set")) a.sets = vm["set"].as<std::vector<std::string>>();
  a.help_deck = vm["help-deck"].as<bool>();
  return a;
}

void need_positional(const Args& a, std::size_t n, const char* what) {
  if (a.positional.size() != n)
    usage_error(a.command,
                std::string("expects ") + what + " (got " + std::to_string(a.positional.size()) + " arguments)");
}

SampleOptions parse_sample(const std::vector<std::string>& rest) {
  SampleOptions o;
  po::options_description opts("loom sample options");
  opts.add_options()("prompt", po::value(&o.prompt), "text to continue (byte vocabulary, or encoded by the tokenizer)")(
      "tokens", po::value(&o.tokens), "token ids to continue, comma-separated")(
      "steps", po::value(&o.steps)->default_value(o.steps), "tokens to generate")(
      "temperature", po::value(&o.temperature)->default_value(o.temperature), "0: greedy")(
      "top-k", po::value(&o.top_k)->default_value(o.top_k), "sample among the k most likely (0: all)")(
      "seed", po::value(&o.seed)->default_value(o.seed), "random seed")(
      "tokenizer", po::value(&o.tokenizer),
      "SentencePiece .model (encodes --prompt, decodes) or llm.c tokenizer file (decodes)")(
      "checkpoint", po::value(&o.checkpoint), "");
  po::positional_options_description pos;
  pos.add("checkpoint", 1);
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(rest).options(opts).positional(pos).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    option_error("sample", e, opts);
  }
  if (o.checkpoint.empty()) usage_error("sample", "expects CKPT (a checkpoint file or directory)");
  if (o.steps < 1 || o.steps > 1000000)
    throw UsageError("loom sample: --steps " + std::to_string(o.steps) + " is not in 1 .. 1000000");
  if (!(o.temperature >= 0) || o.temperature > 100)
    throw UsageError("loom sample: --temperature " + std::to_string(o.temperature) + " is not in [0, 100]");
  if (o.top_k < 0) throw UsageError("loom sample: --top-k " + std::to_string(o.top_k) + " is negative (0: all tokens)");
  return o;
}

PlanOptions parse_plan(const std::vector<std::string>& rest) {
  PlanOptions o;
  po::options_description opts("loom plan options");
  opts.add_options()("deck", po::value(&o.deck), "the deck to plan")("devices", po::value(&o.devices),
                                                                     "search the layouts of this many devices")(
      "json", po::bool_switch(&o.json), "print the deck's prediction as JSON")(
      "memo", po::value(&o.memo), "write a Markdown memo for the chosen layout")(
      "top", po::value(&o.top), "how many fitting layouts the search lists")(
      "all", po::bool_switch(&o.all), "list every candidate of the search")("cluster", po::value(&o.cluster),
                                                                            "cluster file or preset")(
      "set", po::value(&o.sets)->composing(), "override section.key=value of the cluster description")(
      "show", po::bool_switch(&o.show), "print the cluster description resolved")(
      "calibrate", po::bool_switch(&o.calibrate), "measure this machine and write a cluster file")(
      "cluster-keys", po::bool_switch(&o.cluster_keys), "list the keys of a cluster description")(
      "output,o", po::value(&o.output), "where --calibrate writes");
  po::variables_map vm;
  try {
    po::positional_options_description pos;
    pos.add("deck", 1);
    po::store(po::command_line_parser(rest).options(opts).positional(pos).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    option_error("plan", e, opts);
  }
  if (vm.count("devices") && o.devices < 1)
    throw UsageError("loom plan: --devices " + std::to_string(o.devices) +
                     " must be at least 1 (the devices to search the layouts of)");
  if (o.top < 1) throw UsageError("loom plan: --top " + std::to_string(o.top) + " must be at least 1");
  if ((o.all || vm.count("top")) && o.devices == 0)
    throw UsageError("loom plan: --top and --all list the layout search's candidates: give --devices N");
  o.command = "loom plan";
  for (const std::string& a : rest) o.command += " " + a;
  if ((o.devices > 0 || o.json || !o.memo.empty()) && o.deck.empty())
    throw UsageError("loom plan: --devices, --json and --memo plan a deck: loom plan DECK [--cluster FILE|PRESET] ...");
  if (o.calibrate && (!o.cluster.empty() || o.show))
    throw UsageError("loom plan: --calibrate measures this machine; it takes no --cluster or --show");
  if (vm.count("cluster") && o.cluster.empty())
    throw UsageError(
        "loom plan: --cluster is empty: give a cluster file or a preset (loom plan --cluster-keys lists the "
        "keys; without --cluster loom plan reads the calibration file, else the preset h100-sxm)");
  if (vm.count("output") && !o.calibrate)
    throw UsageError("loom plan: -o/--output names the file --calibrate writes: loom plan --calibrate -o FILE");
  return o;
}

// What every command but `sample` reads first: the strategies (built-ins and every plugin on the
// search path) and the schema of every deck key they and the core declare.
struct Loaded {
  StrategyRegistry registry;
  DeckSchema schema;
};

std::unique_ptr<Loaded> load_strategies() {
  auto l = std::make_unique<Loaded>();
  register_builtin_strategies(l->registry);
  discover_plugins(l->registry, plugin_search_path());
  add_core_keys(l->schema);
  for (const auto& [name, info] : l->registry.all())
    for (const auto& key : info.keys) l->schema.add(key);
  return l;
}

int list_plugins(const StrategyRegistry& registry, int rank) {
  if (rank != 0) return 0;
  std::cout << "plugin search path:";
  for (const auto& d : plugin_search_path()) std::cout << " " << d;
  std::cout << "\nplugin ABI " << LOOM_PLUGIN_ABI_VERSION << "\n";
  for (const auto& line : registry.log) std::cout << "  " << line << "\n";
  for (const auto& [name, info] : registry.all()) {
    std::cout << "\n" << name << " " << info.version << " (" << info.origin << ")\n  " << info.description << "\n";
    if (!info.incompatible.empty()) {
      std::cout << "  cannot be combined with:";
      for (const auto& other : info.incompatible) std::cout << " " << other;
      std::cout << "\n";
    }
    DeckSchema own;
    for (const auto& key : info.keys) own.add(key);
    if (!info.keys.empty()) std::cout << own.describe();
  }
  for (const auto& [name, why] : registry.unusable) std::cout << "\n" << name << ": unusable: " << why << "\n";
  return 0;
}

int ckpt(const Args& a, int rank) {
  if (a.positional.size() == 3 && a.positional[0] == "llmc") return command_ckpt_llmc(a.positional[1], a.positional[2]);
  if (a.positional.size() == 2 && a.positional[0] == "verify") return command_ckpt_verify(a.positional[1]);
  if (a.positional.size() != 2 || a.positional[0] != "info")
    usage_error("ckpt", "expects info FILE, verify FILE|DIR, llmc CKPT OUT.bin or hf CKPT DIR");
  if (rank == 0) std::cout << checkpoint_info(a.positional[1]);
  return 0;
}

// loom ckpt hf CKPT DIR [--tokenizer FILE.model]: its own option (the other ckpt commands take none).
int ckpt_hf(const std::vector<std::string>& rest) {
  std::vector<std::string> operands;
  std::string tokenizer;
  po::options_description opts("loom ckpt hf options");
  opts.add_options()("tokenizer", po::value(&tokenizer), "SentencePiece model (*.model) to copy beside the files")(
      "operands", po::value(&operands), "");
  po::positional_options_description pos;
  pos.add("operands", -1);
  po::variables_map vm;
  try {
    const std::vector<std::string> args(rest.begin() + 1, rest.end());
    po::store(po::command_line_parser(args).options(opts).positional(pos).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    option_error("ckpt", e, opts);
  }
  if (operands.size() != 2)
    usage_error("ckpt",
                "hf expects CKPT DIR [--tokenizer FILE.model] (got " + std::to_string(operands.size()) + " operands)");
  return command_ckpt_hf(operands[0], operands[1], tokenizer);
}

// A job that trains checks LOOM_INJECT_FAULT first: a fault that would never fire proves nothing.
void check_injection() {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  check_fault_injection(world);
}

// The commands, one entry each: the words after the command go to `run` as they are (sample, plan:
// their own options) or parsed as DECK/operands with --set (the rest). COMMAND --help prints its
// usage and where to read more (command_help); the key table is `loom keys` (or run --help-deck).
struct Command {
  const char* name;
  std::function<int(const std::vector<std::string>& rest, int rank)> run;
};

// Commands of DECK/operands and --set; --help-deck prints the key table for those that read a deck
// (`keys_on_help`).
std::function<int(const std::vector<std::string>&, int)> with_args(const char* name,
                                                                   std::function<int(const Args&, Loaded&, int)> f,
                                                                   bool keys_on_help = true) {
  return [name, f, keys_on_help](const std::vector<std::string>& rest, int rank) {
    auto l = load_strategies();
    const Args a = parse_subcommand(name, rest);
    if (a.help_deck && keys_on_help) {
      if (rank == 0) std::cout << l->schema.describe();
      return 0;
    }
    return f(a, *l, rank);
  };
}

const std::vector<Command>& commands() {
  static const std::vector<Command> table = {
      {"sample", [](const std::vector<std::string>& rest, int) { return command_sample(parse_sample(rest)); }},
      {"data", [](const std::vector<std::string>& rest, int) { return command_data(rest); }},
      {"eval",
       [](const std::vector<std::string>& rest, int) {
         auto l = load_strategies();
         return command_eval(rest, l->registry, l->schema);
       }},
      {"plan",
       [](const std::vector<std::string>& rest, int) {
         auto l = load_strategies();
         return command_plan(parse_plan(rest), l->registry, l->schema);
       }},
      {"plugins",
       with_args(
           "plugins", [](const Args&, Loaded& l, int rank) { return list_plugins(l.registry, rank); }, false)},
      {"ckpt",
       [](const std::vector<std::string>& rest, int rank) {
         if (!rest.empty() && rest[0] == "hf") return ckpt_hf(rest);
         return with_args(
             "ckpt", [](const Args& a, Loaded&, int r) { return ckpt(a, r); }, false)(rest, rank);
       }},
      {"keys",
       [](const std::vector<std::string>& rest, int rank) {
         // --markdown: the reference page docs/keys.md is (regression.docs.keys holds them equal).
         const bool markdown = rest.size() == 1 && rest[0] == "--markdown";
         if (!rest.empty() && !markdown) {
           const std::string near = nearest_word(rest[0], {"--markdown"});
           usage_error("keys", "takes no argument but --markdown, not " + quote_value(rest[0]) +
                                   (near.empty() ? std::string() : "; did you mean " + near + "?"));
         }
         auto l = load_strategies();
         if (rank == 0) std::cout << (markdown ? keys_markdown(l->schema) : l->schema.describe());
         return 0;
       }},
      {"check", with_args("check",
                          [](const Args& a, Loaded& l, int rank) {
                            need_positional(a, 1, "DECK");
                            return command_check(load_deck(l.schema, a.positional[0], a.sets), l.registry, rank);
                          })},
      {"run", with_args("run",
                        [](const Args& a, Loaded& l, int) {
                          check_injection();
                          need_positional(a, 1, "DECK");
                          return command_run(load_deck(l.schema, a.positional[0], a.sets), l.registry);
                        })},
      {"export", with_args("export",
                           [](const Args& a, Loaded& l, int) {
                             check_injection();
                             need_positional(a, 2, "DECK OUT.h5");
                             return command_export(load_deck(l.schema, a.positional[0], a.sets), l.registry,
                                                   a.positional[1]);
                           })},
  };
  return table;
}

int dispatch(int argc, char** argv, int rank) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    if (rank == 0) std::cout << kUsage;
    return args.empty() ? 2 : 0;
  }
  if (args[0] == "--version") {
    if (rank == 0) std::cout << "loom " << build::version << " (" << build::git_commit << ")\n";
    return 0;
  }
  const std::string command = args[0];
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  for (const Command& c : commands()) {
    if (command != c.name) continue;
    if (std::any_of(rest.begin(), rest.end(), [](const std::string& x) { return x == "--help" || x == "-h"; })) {
      if (rank == 0) std::cout << command_help(command);
      return 0;
    }
    return c.run(rest, rank);
  }
  std::vector<std::string> names = {"plot"};
  for (const Command& c : commands()) names.push_back(c.name);
  const std::string near = nearest_word(command, names);
  throw UsageError("loom: unknown command " + quote_value(command) +
                   (near.empty() ? "" : "; did you mean " + near + "?") + " (loom --help lists the commands)");
}

}  // namespace

// `loom plot ...`: the plotting script (matplotlib), installed beside the job scripts, run in this
// process's place (no MPI needed): P/share/loom/jobscripts/loom_plot.py, else the source tree's.
[[noreturn]] void exec_plot(int argc, char** argv) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  std::vector<fs::path> candidates;
  if (!ec) candidates.push_back(exe.parent_path() / ".." / "share" / "loom" / "jobscripts" / "loom_plot.py");
  candidates.push_back(fs::path(build::source_dir) / "jobscripts" / "loom_plot.py");
  const char* python = std::getenv("LOOM_PYTHON");
  const std::string interpreter =
      python && *python ? python : (fs::exists("/usr/bin/python3") ? "/usr/bin/python3" : "python3");
  for (const fs::path& script : candidates) {
    if (!fs::exists(script, ec)) continue;
    std::vector<std::string> words{interpreter, script.lexically_normal().string()};
    for (int i = 2; i < argc; ++i) words.push_back(argv[i]);
    std::vector<char*> cargv;
    for (auto& w : words) cargv.push_back(w.data());
    cargv.push_back(nullptr);
    execvp(cargv[0], cargv.data());
    write_stderr("loom plot: cannot run " + interpreter + " " + script.string() + ": " + std::strerror(errno) + "\n");
    std::exit(1);
  }
  write_stderr("loom plot: loom_plot.py not found (looked in " + candidates.front().string() + " and " +
               candidates.back().string() + ")\n");
  std::exit(1);
}

// LOOM_STATUS_FILE: world rank 0 writes the exit status there ("3\n"), for job scripts whose
// launcher does not pass it on: MPICH's mpiexec (hydra), signalled, often exits 0 though every rank
// exits 3 after saving its checkpoint. A job that MPI_Abort ends writes nothing; its launcher fails.
static void write_status_file(int rank, int status) {
  const char* path = std::getenv("LOOM_STATUS_FILE");
  if (rank != 0 || !path || !*path) return;
  if (FILE* f = std::fopen(path, "w")) {
    std::fprintf(f, "%d\n", status);
    if (std::fclose(f) != 0) write_stderr(std::string("loom: warning: cannot write LOOM_STATUS_FILE = ") + path + "\n");
  } else {
    write_stderr(std::string("loom: warning: cannot write LOOM_STATUS_FILE = ") + path + " (" + std::strerror(errno) +
                 ")\n");
  }
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "plot") exec_plot(argc, argv);
  select_wait_policy(argv);    // may re-execute this program with OMP_WAIT_POLICY=PASSIVE (shared cores)
  select_openblas_core(argv);  // may re-execute this program with a better OpenBLAS kernel set
  // A file-size limit (ulimit -f) must fail the write that crosses it (EFBIG, reported with the file's
  // name), not kill the process with SIGXFSZ.
  std::signal(SIGXFSZ, SIG_IGN);
  set_command_line(argc, argv);
  init_hdf5();
  // Any thread may call MPI: checkpoint.async writes from a thread of its own (refused where the
  // MPI provides less).
  int thread_level = MPI_THREAD_SINGLE;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &thread_level);
  (void)thread_level;  // asked again where it matters (MPI_Query_thread)
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  int status = 0;
  {
    Kokkos::ScopeGuard kokkos;
    try {
      status = dispatch(argc, argv, rank);
    } catch (const AgreedFailure& e) {
      // Every rank knows (the ranks agreed on it): said once, and nobody is left in a collective.
      if (rank == 0) write_stderr(std::string("loom: error: ") + e.what());
      status = 1;
    } catch (const ReportedError&) {
      status = 2;  // setup failed; the ranks agreed and the ones that found it said why
    } catch (const AlikeOnEveryRank& e) {
      // A deck or command line is read alike on every rank before anything else: report once.
      if (rank == 0) write_stderr("loom: error: " + std::string(e.what()) + "\n");
      status = 2;
    } catch (const std::exception& e) {
      // Anything else may have happened on this rank alone, while the others wait in a collective:
      // say which rank and why, then take the whole job down. Never a hang.
      const bool input = dynamic_cast<const InputError*>(&e) != nullptr;
      status = input ? 2 : 1;
      if (world > 1) abort_job(e.what(), status);
      write_stderr("loom: error: " + std::string(e.what()) + "\n");
    }
  }
  write_status_file(rank, status);
  if (checkpoint_file_left_open()) {
    // The ranks agreed on it and the reason is printed; HDF5's clean-up at MPI_Finalize or exit()
    // would crash on the file it could not close.
    std::cout.flush();
    std::fflush(nullptr);
    _exit(status);
  }
  MPI_Finalize();
  return status;
}
