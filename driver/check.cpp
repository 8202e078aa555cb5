// loom check DECK: everything a run of the deck would refuse before training, found without
// launching the job: the deck, the layout for as many ranks as it needs, the data files, the thread
// count, the weights to start from (model.init_from), the checkpoint directory and the checkpoint to
// resume from. Nothing is created (a probe file in each directory the run writes in is made and
// removed at once).
#include <fcntl.h>
#include <mpi.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "core/base/error.hpp"
#include "driver/checkpointing.hpp"
#include "driver/commands.hpp"
#include "driver/memory_check.hpp"
#include "driver/run_dir.hpp"
#include "driver/session.hpp"
#include "io/util.hpp"
#include "io/checkpoint.hpp"
#include "io/llmc.hpp"
#include "io/threads.hpp"

namespace loom {
namespace {

namespace fs = std::filesystem;

// Whether the run could create files in directory p: a probe file made and removed at once. Not
// access(2): for root it says yes to directories no file can be made in (/proc, a read-only mount).
// errno is left as the failed creation set it.
bool writable_directory(const fs::path& p) {
  std::string probe = (p / ".loom-check-probe-XXXXXX").string();  // a name of its own on every rank
  const int fd = ::mkstemp(probe.data());
  if (fd < 0) return false;
  ::close(fd);
  ::unlink(probe.c_str());
  return true;
}

// A directory the run writes in (checkpoint.dir, run.dir) exists as a writable directory, or its
// nearest existing ancestor is one, so that the run can create it. `named` says which deck key (and
// default) gave `dir`.
void check_writable_dir(const std::string& dir, const std::string& named) {
  std::error_code ec;
  const fs::path path(dir);
  if (fs::exists(path, ec)) {
    if (!fs::is_directory(path, ec)) throw InputError(named + ": '" + dir + "' exists and is not a directory");
    if (!writable_directory(path))
      throw InputError(named + ": the directory '" + dir + "' is not writable (" + std::strerror(errno) + ")");
    return;
  }
  fs::path ancestor = path.parent_path();
  while (!ancestor.empty() && !fs::exists(ancestor, ec)) ancestor = ancestor.parent_path();
  if (ancestor.empty()) ancestor = ".";
  if (!fs::is_directory(ancestor, ec))
    throw InputError(named + ": '" + dir + "' cannot be created: '" + ancestor.string() + "' is not a directory");
  if (!writable_directory(ancestor))
    throw InputError(named + ": '" + dir + "' cannot be created: '" + ancestor.string() + "' is not writable (" +
                     std::strerror(errno) + ")");
}

// checkpoint.resume names a readable checkpoint of the deck's model: a file, or the one `latest` in
// `dir` names. With `auto` a missing `latest` means a fresh start; a `latest` that is there must name
// a checkpoint. A fresh start over checkpoints or an earlier run's results is refused as the run
// refuses it.
void check_resume(const std::string& resume, const std::string& dir, const std::string& run_dir, const GPTConfig& model,
                  bool overwrite) {
  const auto fresh = [&] {
    refuse_fresh_over_checkpoints(dir, resume, overwrite);
    refuse_fresh_over_results(run_dir, overwrite || resume == "auto");  // as the run (results_may_move)
  };
  if (resume.empty()) return fresh();
  std::string file = resume;
  std::string named = "checkpoint.resume = " + resume;
  if (resume == "latest" || resume == "auto") {
    const std::string pointer = dir + "/latest";
    std::string name;
    try {
      name = read_latest_name(dir);  // a regular file naming a file of dir
    } catch (const InputError& e) {
      throw InputError(named + ": " + e.what());
    }
    if (name.empty()) {
      if (resume == "auto") return fresh();
      throw InputError("checkpoint.resume = latest, but '" + pointer +
                       "' does not exist (no checkpoint was completed in checkpoint.dir = " + dir + ")");
    }
    file = dir + "/" + name;
    named += " ('" + pointer + "' names " + name + ")";
  }
  std::string mismatches;
  try {
    checkpoint_info(file);
    mismatches = model_mismatches(checkpoint_header(file).model, model);
  } catch (const InputError& e) {
    throw InputError(named + ": " + e.what());
  }
  if (!mismatches.empty())
    throw InputError(named + ": checkpoint '" + file + "' holds another model: " + mismatches +
                     " (a checkpoint continues only the model it holds)");
}

}  // namespace

int command_check(const Deck& deck, const StrategyRegistry& registry, int rank) {
  // The layout as the job that runs the deck would see it (as many ranks as it needs).
  const LayoutPlan plan = plan_layout(deck, registry, -1);
  check_training_keys(deck);  // as the run refuses them (Session::setup_local)
  open_deck_data(deck, plan.model);
  if (!deck.get_string("model.init_from").empty()) read_init_from(deck.get_string("model.init_from"), plan.model);
  gemm_impl_from_deck(deck);
  const ThreadCount threads = resolve_threads(deck.get_string("run.threads"), std::getenv("OMP_NUM_THREADS"),
                                              std::getenv("SLURM_CPUS_PER_TASK"));
  std::string dir = deck.get_string("checkpoint.dir");
  std::string named = "checkpoint.dir = " + dir;
  if (dir.empty()) {
    dir = deck.get_string("run.dir") + "/checkpoints";
    named = "checkpoint.dir (default <run.dir>/checkpoints = " + dir + ")";
  }
  check_writable_dir(deck.get_string("run.dir"), "run.dir = " + deck.get_string("run.dir"));
  check_writable_dir(dir, named);
  refuse_if_held(deck.get_string("run.dir"), "run.dir");  // a running job holds it: the run would be refused
  refuse_if_held(dir, "checkpoint.dir");
  check_resume(deck.get_string("checkpoint.resume"), dir, deck.get_string("run.dir"), plan.model,
               deck.get_bool("run.overwrite"));
  // As `loom run` would place the job here: the ranks of this check on this node, or, checked by one
  // process, every rank of the layout (as `mpirun -n N` on this machine places them).
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  std::vector<int> on_node = ranks_on_this_node();
  if (world == 1)
    for (int r = 1; r < plan.layout.ranks(); ++r) on_node.push_back(r);
  MemoryVerdict memory;
  run_agreed([&] {
    memory = memory_verdict(deck, registry, on_node);
    throw_if_out_of_memory(deck, registry, memory);
  });
  if (rank == 0)
    std::cout << deck.resolved_text() << "# deck OK: " << deck.path() << " (layout " << plan.layout.describe() << " = "
              << plan.layout.ranks() << " ranks; " << threads.threads << " BLAS thread"
              << (threads.threads == 1 ? "" : "s") << " per rank; checkpoints in " << dir << ")\n# " << memory.text
              << "\n";
  return 0;
}

}  // namespace loom
