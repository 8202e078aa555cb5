// `loom run`: the training loop, its per-step lines, metrics.jsonl, summary and report.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <iostream>
#include <nlohmann/json.hpp>

#include "core/backend/blas_core.hpp"
#include "core/base/clock.hpp"
#include "core/base/error.hpp"
#include "core/comm/fault.hpp"
#include "driver/checkpointing.hpp"
#include "driver/commands.hpp"
#include "driver/health.hpp"
#include "driver/run_dir.hpp"
#include "driver/session.hpp"
#include "io/report.hpp"

namespace loom {
namespace {


nlohmann::json memory_json(const std::array<std::size_t, kMemCategories>& bytes, std::size_t total) {
  nlohmann::json m;
  for (int i = 0; i < kMemCategories; ++i) m[mem_name(static_cast<Mem>(i))] = bytes[i];
  m["total"] = total;
  return m;
}

std::string memory_line(const std::array<std::size_t, kMemCategories>& bytes, std::size_t total) {
  std::string s = format_bytes(static_cast<double>(total)) + " (";
  const char* shortname[kMemCategories] = {"par", "grad", "opt", "master", "act", "comm", "work"};
  bool first = true;
  for (int i = 0; i < kMemCategories; ++i) {
    if (bytes[i] == 0) continue;
    s += (first ? "" : " ") + std::string(shortname[i]) + " " + format_bytes(static_cast<double>(bytes[i]));
    first = false;
  }
  return s + ")";
}

// Sums of the roles' per-step report values, for their means over a run.
struct ReportMeans {
  std::map<std::string, double> sum;
  std::int64_t steps = 0;
  void add(const std::vector<std::pair<std::string, double>>& values) {
    for (const auto& [k, v] : values) sum[k] += v;
    ++steps;
  }
  std::map<std::string, double> means() const {
    std::map<std::string, double> m;
    for (const auto& [k, v] : sum) m[k] = v / static_cast<double>(steps);
    return m;
  }
};

// "2026-11-22T04:37:56Z"
std::string utc_timestamp() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

// "42 s", "3m07s", "2h05m"
std::string duration_text(double seconds) {
  char buf[32];
  const long long s = static_cast<long long>(seconds + 0.5);
  if (s < 100) std::snprintf(buf, sizeof buf, "%lld s", s);
  else if (s < 3600) std::snprintf(buf, sizeof buf, "%lldm%02llds", s / 60, s % 60);
  else std::snprintf(buf, sizeof buf, "%lldh%02lldm", s / 3600, s / 60 % 60);
  return buf;
}

// This rank's matrix-product rate in FLOP/s on a square product (512, 4096 on a GPU), the best of 8
// after two warm-up products:
// the peak the MFU figure is measured against when run.peak_tflops is not given.
double measured_matmul_flops(Backend& be) {
  // A GPU needs a larger product than a CPU core to approach its rate.
  const int n = be.space() == MemSpace::host ? 512 : 4096;
  const std::int64_t nn = static_cast<std::int64_t>(n) * n;
  {
    TypedBuffer a = be.allocate("run.matmul_rate_a", DType::f32, nn, Mem::workspace);
    TypedBuffer b = be.allocate("run.matmul_rate_b", DType::f32, nn, Mem::workspace);
    TypedBuffer c = be.allocate("run.matmul_rate_c", DType::f32, nn, Mem::workspace);
    be.fill(a.ref(), 0.5);
    be.fill(b.ref(), 0.25);
    double best = 1e30;
    for (int rep = 0; rep < 10; ++rep) {
      be.synchronize();
      const double t0 = now();
      be.matmul_forward(c.data<float>(), a.data<float>(), b.data<float>(), nullptr, n, n, n);
      be.synchronize();
      if (rep >= 2) best = std::min(best, now() - t0);
    }
    be.release_scratch();  // the 16-bit operand copies of these large products
    return 2.0 * n * n * n / best;
  }
}

}  // namespace

int command_run(const Deck& deck, const StrategyRegistry& registry) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const double t_start = now();
  Session s(deck, registry);
  const bool io = rank == 0;
  Checkpointing checkpoints(s);
  // One run at a time per directory: rank 0 locks run.dir (and checkpoint.dir when it lies
  // elsewhere) before anything is written there. A run refused before it wrote anything leaves the
  // directories as they were (a directory it created for the lock is removed again).
  std::unique_ptr<DirLock> run_lock, checkpoint_lock;
  bool writing = false;
  struct Abandon {
    std::unique_ptr<DirLock>*a, *b;
    const bool* writing;
    ~Abandon() {
      if (*writing) return;
      if (*b) (*b)->abandon();
      if (*a) (*a)->abandon();
    }
  } abandon{&run_lock, &checkpoint_lock, &writing};
  run_agreed([&] {
    if (!io) return;
    run_lock = std::make_unique<DirLock>(s.run_dir, "run.dir");
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::path run_abs = fs::weakly_canonical(s.run_dir, ec), ckpt_abs = fs::weakly_canonical(checkpoints.dir(), ec);
    if (ckpt_abs.parent_path() != run_abs) checkpoint_lock = std::make_unique<DirLock>(checkpoints.dir(), "checkpoint.dir");
  });
  if (io) std::cout << s.banner() << std::flush;
  checkpoints.prepare();
  const std::int64_t start_step = checkpoints.resume();
  const std::string metrics_path = s.run_dir + "/metrics.jsonl";
  MetricsFile metrics;
  if (io) {
    if (checkpoints.resuming()) {
      const int aside = metrics.resume(metrics_path, start_step);
      if (aside > 0)
        std::cout << "metrics: " << aside << " row(s) past step " << start_step << " from the earlier run moved to "
                  << metrics_path << ".superseded; " << metrics_path << " continues from step " << start_step + 1
                  << std::endl;
    } else {
      metrics.start(metrics_path);
    }
  }
  writing = true;
  const double tokens_per_step = static_cast<double>(s.global_batch) * s.model_cfg.seq_len;
  const double flops_per_token = s.model->flops_per_token();
  const int world = s.layout.ranks();
  // MFU is measured against every rank's peak: run.peak_tflops, or the matrix-product rate each rank
  // measures now (all ranks at once, as they will train).
  double peak_flops = deck.get_float("run.peak_tflops") * 1e12;
  const std::string peak_source = peak_flops > 0 ? "run.peak_tflops" : "measured matrix-product rate";
  if (peak_flops <= 0) peak_flops = measured_matmul_flops(*s.backend);
  s.grid->world().all_reduce(&peak_flops, 1);
  if (io)
    std::printf("  MFU     : against %.3f TFLOP/s (%s, summed over %d rank%s)\n", peak_flops / 1e12,
                peak_source.c_str(), world, world == 1 ? "" : "s");
  if (io && link_gbit_per_s() > 0)
    std::printf("  link    : EMULATED, %g Gbit/s per rank, %g us per message (run.emulate_link_gbps): every send "
                "waits its turn on it\n", link_gbit_per_s(), 1e6 * link_latency_s());
  const double t_init = now() - t_start;

  double train_time = 0, steady_time = 0, eval_time = 0, last_loss = NAN, last_loss_scale = 1;
  std::int64_t steady_steps = 0;
  PhaseTimes phase_sum;
  std::array<std::size_t, kMemCategories> peak_bytes{};
  std::size_t peak_total = 0;
  std::optional<double> last_val;

  auto evaluate = [&]() {
    const double t0 = now();
    const double v = s.engine->evaluate(s.eval_batches, s.val_batches);
    eval_time += now() - t0;
    last_val = v;
    return v;
  };

  // Communication, per group (dp, tp, pp): counted by the communicators, read after every step.
  auto groups = s.grid->groups();
  std::vector<double> group_bytes_total(groups.size(), 0.0), group_wait_total(groups.size(), 0.0);
  double wait_total = 0;
  // Every value the roles report per step (measured vs textbook volumes, bubbles, ...), summed over
  // the steady steps (all steps if there is only one) for the summary.
  ReportMeans report_steady, report_all;
  const bool skip_nonfinite = deck.get_string("train.on_nonfinite") == "skip";
  const bool loss_scaled = s.backend->precision().matmul == DType::f16;  // the step line shows the scale
  const std::int64_t max_skipped = deck.get_int("train.max_skipped");
  std::int64_t skipped_total = 0, skipped_in_row = 0;
  std::string failure;  // why the run failed (the same on every rank); empty while it goes well
  bool interrupted = false;
  const double t_loop = now();

  std::int64_t steps_run = 0;
  for (std::int64_t step = start_step; step < s.steps; ++step) {
    for (auto* g : groups) g->reset_stats();
    const StepStats st = s.engine->train_step(step, s.train_batches);
    nlohmann::json comm = nlohmann::json::object();
    double step_wait = 0;
    for (std::size_t gi = 0; gi < groups.size(); ++gi) {
      const CommStats& cs = groups[gi]->stats();
      if (groups[gi]->size() == 1) continue;
      nlohmann::json by_op = nlohmann::json::object();
      for (int op = 0; op < kCommOps; ++op)
        if (cs.calls[op]) by_op[comm_op_name(static_cast<CommOp>(op))] = {{"bytes", cs.bytes_sent[op]}, {"wait_ms", cs.wait_s[op] * 1e3}, {"calls", cs.calls[op]}};
      comm[groups[gi]->name()] = {{"bytes_sent", cs.total_bytes()}, {"wait_ms", cs.total_wait() * 1e3}, {"ops", by_op}};
      group_bytes_total[gi] += static_cast<double>(cs.total_bytes());
      group_wait_total[gi] += cs.total_wait();
      step_wait += cs.total_wait();
    }
    wait_total += step_wait;
    // The slowest and the fastest rank's step time (a straggler shows): a metrics-only reduction,
    // through the world communicator so that a stalled rank is caught here too. It only sums: every
    // rank puts its time at its own index.
    double t_min = st.seconds, t_max = st.seconds;
    if (world > 1) {
      std::vector<double> step_times(world, 0.0);
      step_times[s.grid->rank()] = st.seconds;
      s.grid->world().all_reduce(step_times.data(), world);
      t_min = *std::min_element(step_times.begin(), step_times.end());
      t_max = *std::max_element(step_times.begin(), step_times.end());
    }
    auto report_values = s.engine->grad_sync().step_report();
    for (auto& kv : s.model->partition().step_report()) report_values.push_back(kv);
    for (auto& kv : s.engine->schedule().step_report()) report_values.push_back(kv);
    report_all.add(report_values);
    if (step > start_step) report_steady.add(report_values);  // steady steps, like the throughput
    train_time += st.seconds;
    ++steps_run;
    if (step > start_step) {  // the first step pays for first-touch allocation: not steady state
      steady_time += st.seconds;
      ++steady_steps;
    }
    phase_sum.data += st.times.data;
    phase_sum.forward += st.times.forward;
    phase_sum.backward += st.times.backward;
    phase_sum.sync += st.times.sync;
    phase_sum.optimizer += st.times.optimizer;
    for (int i = 0; i < kMemCategories; ++i) peak_bytes[i] = std::max(peak_bytes[i], st.peak_bytes[i]);
    peak_total = std::max(peak_total, st.peak_total);
    last_loss = st.loss;
    last_loss_scale = st.loss_scale;

    // A non-finite loss or gradient norm (the same on every rank): the engine applied no update.
    std::string nonfinite_note;
    if (st.nonfinite) {
      ++skipped_total;
      ++skipped_in_row;
      const auto bad = find_nonfinite(*s.grid, *s.model, {gradients(*s.model)});  // collective
      char what[160];
      std::snprintf(what, sizeof what, "step %lld: loss %g, gradient norm %g: not finite",
                    static_cast<long long>(step + 1), st.loss, st.grad_norm);
      nonfinite_note = std::string(what) + (bad ? "; first non-finite: " + bad->describe() : "");
      // Gradient sync spreads a NaN to every replica; the ranks whose own loss was not finite are
      // where it came from (pipeline stages other than the last compute no loss).
      std::vector<double> own(static_cast<std::size_t>(world), 0.0);
      own[s.grid->rank()] = std::isfinite(st.local_loss) ? 0.0 : 1.0;
      s.grid->world().all_reduce(own.data(), world);
      std::string origin;
      for (int r = 0; r < world; ++r)
        if (own[r] > 0) origin += (origin.empty() ? "" : ", ") + std::to_string(r);
      if (!origin.empty()) nonfinite_note += "; the loss was not finite on rank(s) " + origin;
      if (!skip_nonfinite)
        failure = nonfinite_note + "; stopped without applying it (train.on_nonfinite = stop; lower train.lr, or "
                                   "set train.on_nonfinite = skip to drop such steps)";
      else if (skipped_in_row > max_skipped)
        failure = nonfinite_note + "; " + std::to_string(skipped_in_row) +
                  " steps in a row were not finite (train.max_skipped = " + std::to_string(max_skipped) + "): stopping";
      else if (io)
        std::cout << "loom: warning: " << nonfinite_note << "; update skipped (train.on_nonfinite = skip; "
                  << skipped_in_row << " in a row, " << skipped_total << " in all)" << std::endl;
    } else if (!st.failure.empty()) {
      ++skipped_total;
      failure = st.failure;
    } else if (!st.skip_reason.empty()) {
      // A phase hook skipped the update on purpose (a loss-scale overflow): counted as a skipped step
      // (step = optimizer_steps + skipped_steps), never a failure.
      ++skipped_total;
      skipped_in_row = 0;
    } else {
      skipped_in_row = 0;
    }

    const bool last = step + 1 == s.steps;
    std::optional<double> val;
    nlohmann::json saved = nlohmann::json::object();
    bool stop = false;
    if (failure.empty()) {
      if (s.val_data && ((s.eval_every > 0 && (step + 1) % s.eval_every == 0) || last)) val = evaluate();
      try {
        stop = checkpoints.after_step(step + 1, saved);  // collective
        if (last && !stop) checkpoints.at_end(step + 1, saved);
      } catch (const AgreedFailure& e) {
        failure = e.what();
      }
    }
    interrupted = stop;
    const bool end = !failure.empty() || stop;
    if (!io) {
      if (end) break;
      continue;
    }
    const bool log = step % s.log_every == 0 || last || val || end || !saved.empty() || st.nonfinite ||
                     !st.skip_reason.empty();
    if (!log) continue;
    const double tps = tokens_per_step / st.seconds;
    const double tflops = tps * flops_per_token / 1e12;
    const double mfu = tps * flops_per_token / peak_flops;
    const double elapsed = now() - t_start;
    const double eta = (now() - t_loop) / static_cast<double>(steps_run) * static_cast<double>(s.steps - step - 1);
    char line[512];
    std::snprintf(line, sizeof line,
                  "step %6lld/%lld | loss %.4f | lr %.3e | norm %.3f | %8.0f tok/s | %.4f TFLOP/s | MFU %.1f%% | %7.1f ms | mem %s",
                  static_cast<long long>(step + 1), static_cast<long long>(s.steps), st.loss, st.lr, st.grad_norm, tps,
                  tflops, 100.0 * mfu, st.seconds * 1e3, memory_line(st.peak_bytes, st.peak_total).c_str());
    std::cout << line;
    if (world > 1) {
      double bytes = 0;
      for (auto* g : groups) bytes += g->size() > 1 ? static_cast<double>(g->stats().total_bytes()) : 0.0;
      std::printf(" | comm %s, wait %.0f%% | step min/max %.1f/%.1f ms", format_bytes(bytes).c_str(),
                  100.0 * step_wait / st.seconds, t_min * 1e3, t_max * 1e3);
    }
    std::printf("%s", s.engine->schedule().step_line(report_values).c_str());
    if (val) std::printf(" | val %.4f", *val);
    if (st.nonfinite) std::printf(" | update skipped");
    if (!st.skip_reason.empty()) std::printf(" | update skipped: %s", st.skip_reason.c_str());
    if (loss_scaled) std::printf(" | scale %g, %lld skipped", st.loss_scale, static_cast<long long>(skipped_total));
    std::printf(" | %s in, ETA %s", duration_text(elapsed).c_str(), duration_text(eta).c_str());
    std::cout << std::endl;
    nlohmann::json rec = {{"step", step + 1},
                          {"loss", st.loss},
                          {"lr", st.lr},
                          {"grad_norm", st.grad_norm},
                          {"clip_coef", st.clip_coef},
                          {"loss_scale", st.loss_scale},
                          {"skipped_steps", skipped_total},
                          {"tokens_per_s", tps},
                          {"tflops", tflops},
                          {"mfu", mfu},
                          {"step_ms", st.seconds * 1e3},
                          {"elapsed_s", elapsed},
                          {"eta_s", eta},
                          {"time", utc_timestamp()},
                          {"times_ms",
                           {{"data", st.times.data * 1e3},
                            {"forward", st.times.forward * 1e3},
                            {"backward", st.times.backward * 1e3},
                            {"sync", st.times.sync * 1e3},
                            {"optimizer", st.times.optimizer * 1e3}}},
                          {"mem_peak_bytes", memory_json(st.peak_bytes, st.peak_total)},
                          {"comm", comm},
                          {"comm_wait_share", step_wait / st.seconds},
                          {"step_ms_min", t_min * 1e3},
                          {"step_ms_max", t_max * 1e3}};
    for (const auto& [k, v] : report_values) rec[k] = v;
    if (val) rec["val_loss"] = *val;
    if (st.nonfinite) rec["skipped"] = true;
    if (!st.skip_reason.empty()) {
      rec["skipped"] = true;
      rec["skip_reason"] = st.skip_reason;
    }
    for (const auto& [k, v] : saved.items()) rec[k] = v;
    metrics.write(rec);
    if (end) break;
  }

  // A run that trained to the end must end with finite weights and a finite validation loss.
  if (failure.empty() && !interrupted) {
    if (const auto bad = find_nonfinite(*s.grid, *s.model, {parameters(*s.model)}))
      failure = "training ended with non-finite weights: " + bad->describe();
    else if (last_val && !std::isfinite(*last_val))
      failure = "training ended with a non-finite validation loss (" + std::to_string(*last_val) + ")";
  }
  const std::string status = !failure.empty() ? "failed" : interrupted ? "interrupted" : "finished";
  const int exit_status = !failure.empty() ? 1 : interrupted ? kExitInterrupted : 0;
  if (!failure.empty() && io) write_stderr("loom: error: " + failure);
  // Every rank's ledger peaks, for summary.json (`loom plan` is checked against them rank by rank).
  std::vector<double> mine(peak_bytes.begin(), peak_bytes.end()), all_peaks;
  mine.push_back(static_cast<double>(peak_total));
  // And its collectives' scratch pools: reserved from the step plan, and what they needed.
  Communicator::ScratchUse pools;
  std::vector<Communicator*> comms = s.grid->groups();
  comms.push_back(&s.grid->world());
  for (const Communicator* c : comms) {
    pools.reserved += c->scratch_use().reserved;
    pools.needed += c->scratch_use().needed;
  }
  mine.push_back(static_cast<double>(pools.reserved));
  mine.push_back(static_cast<double>(pools.needed));
  if (io) all_peaks.resize(mine.size() * static_cast<std::size_t>(world));
  MPI_Gather(mine.data(), static_cast<int>(mine.size()), MPI_DOUBLE, all_peaks.data(), static_cast<int>(mine.size()),
             MPI_DOUBLE, 0, MPI_COMM_WORLD);
  if (!io) return exit_status;

  std::map<std::string, double> report_means = (report_steady.steps ? report_steady : report_all).means();
  const double mean_step = steady_steps > 0 ? steady_time / steady_steps : train_time / std::max<std::int64_t>(1, steps_run);
  const double tps = tokens_per_step / mean_step;
  const std::int64_t per_step_divisor = std::max<std::int64_t>(1, steps_run);
  std::int64_t model_params = 0;
  for (const ParamInfo& p : s.model->all_params()) {
    std::int64_t n = 1;
    for (auto d : p.shape) n *= d;
    model_params += n;
  }
  nlohmann::json summary = {{"status", status},
                            {"exit_status", exit_status},
                            {"steps", s.steps},
                            {"start_step", start_step},
                            {"steps_run", steps_run},
                            {"skipped_steps", skipped_total},
                            {"checkpoint", checkpoints.summary()},
                            {"time_s", now() - t_start},
                            {"train_time_s", train_time},
                            {"eval_time_s", eval_time},
                            {"tokens_per_s", tps},
                            {"model_flops_per_token", flops_per_token},
                            {"tflops", tps * flops_per_token / 1e12},
                            {"mfu", tps * flops_per_token / peak_flops},
                            {"peak_tflops", peak_flops / 1e12},
                            {"peak_source", peak_source},
                            {"final_loss", last_loss},
                            {"parameters", model_params},
                            {"parameters_rank0", s.model->num_params()},
                            {"mem_peak_bytes", memory_json(peak_bytes, peak_total)},
                            {"ranks", world},
                            {"layout", {{"dp", s.layout.dp}, {"tp", s.layout.tp}, {"pp", s.layout.pp}}},
                            {"comm_wait_share", train_time > 0 ? wait_total / train_time : 0.0}};
  nlohmann::json by_rank = nlohmann::json::array(), pools_by_rank = nlohmann::json::array();
  for (int r = 0; r < world; ++r) {
    std::array<std::size_t, kMemCategories> b{};
    const double* at = all_peaks.data() + static_cast<std::size_t>(r) * mine.size();
    for (int i = 0; i < kMemCategories; ++i) b[static_cast<std::size_t>(i)] = static_cast<std::size_t>(at[i]);
    by_rank.push_back(memory_json(b, static_cast<std::size_t>(at[kMemCategories])));
    pools_by_rank.push_back({{"reserved", static_cast<std::int64_t>(at[kMemCategories + 1])},
                             {"needed", static_cast<std::int64_t>(at[kMemCategories + 2])}});
  }
  summary["mem_peak_bytes_by_rank"] = by_rank;
  summary["comm_scratch_bytes_by_rank"] = pools_by_rank;
  if (!failure.empty()) summary["error"] = failure;
  if (interrupted) summary["stop_signal"] = Checkpointing::stop_signal();
  {
    nlohmann::json comm = nlohmann::json::object();
    for (std::size_t gi = 0; gi < groups.size(); ++gi)
      if (groups[gi]->size() > 1)
        comm[groups[gi]->name()] = {{"bytes_sent_per_step", group_bytes_total[gi] / per_step_divisor},
                                    {"wait_s", group_wait_total[gi]}};
    summary["comm"] = comm;
    for (const auto& [k, v] : report_means) summary[k] = v;
  }
  // Mixed precision: the model state per rank against the textbook's 2P + 2P + 12P (ZeRO: the
  // paper's K = 12 split over the dp ranks by stage), P the parameters this rank holds.
  nlohmann::json precision_summary = nlohmann::json::object();
  if (s.backend->precision().matmul != DType::f32) {
    const double P = static_cast<double>(s.model->num_params()), N = s.layout.dp;
    const int stage = report_means.count("zero_stage") ? static_cast<int>(report_means["zero_stage"]) : 0;
    const double textbook = stage == 3 ? 16 * P / N : stage == 2 ? 2 * P + 14 * P / N : stage == 1 ? 4 * P + 12 * P / N : 16 * P;
    const char* formula = stage == 3 ? "16P/N" : stage == 2 ? "2P + (2P + 12P)/N" : stage == 1 ? "2P + 2P + 12P/N" : "2P + 2P + 12P";
    precision_summary = {{"dtype", dtype_name(s.backend->precision().matmul)},
                         {"state_bytes", peak_bytes[static_cast<int>(Mem::params)] + peak_bytes[static_cast<int>(Mem::master)] +
                                             peak_bytes[static_cast<int>(Mem::grads)] + peak_bytes[static_cast<int>(Mem::optimizer)]},
                         {"compute_copy_bytes", peak_bytes[static_cast<int>(Mem::params)]},
                         {"master_bytes", peak_bytes[static_cast<int>(Mem::master)]},
                         {"textbook_bytes", textbook},
                         {"textbook_formula", formula},
                         {"workspace_peak_bytes", peak_bytes[static_cast<int>(Mem::workspace)]}};
    if (loss_scaled) precision_summary["loss_scale_final"] = last_loss_scale;
    summary["precision"] = precision_summary;
  }
  if (last_val) summary["final_val_loss"] = *last_val;
  if (auto best = s.train_data->best_loss()) summary["best_possible_loss"] = *best;
  write_json_atomic(s.run_dir + "/summary.json", summary);

  nlohmann::json params, from_command_line = nlohmann::json::object();
  for (const auto& [k, v] : deck.values()) {
    params[k] = v;
    if (deck.origin(k) == "--set") from_command_line[k] = v;
  }
  nlohmann::json report = {{"deck", deck.path()},
                           {"command_line", command_line()},
                           {"set_on_command_line", from_command_line},
                           {"parameters", params},
                           {"resolved_deck", deck.resolved_text()},
                           {"platform", platform_info()},
                           {"build", build_info()},
                           {"backend", s.backend->description()},
                           {"openblas_core_note", openblas_core_note()},
                           {"gemm", gemm::describe()},
                           {"gemm_impls_used", gemm::impls_used()},
                           {"timings_s",
                            {{"total", now() - t_start},
                             {"init", t_init},
                             {"train", train_time},
                             {"eval", eval_time},
                             {"data", phase_sum.data},
                             {"forward", phase_sum.forward},
                             {"backward", phase_sum.backward},
                             {"sync", phase_sum.sync},
                             {"optimizer", phase_sum.optimizer}}},
                           {"summary", summary}};
  write_json_atomic(s.run_dir + "/report.json", report);

  std::printf("\nsummary: %s: %lld steps (%lld .. %lld) in %.1f s | final loss %.4f", status.c_str(),
              static_cast<long long>(steps_run), static_cast<long long>(start_step + 1),
              static_cast<long long>(start_step + steps_run), train_time, last_loss);
  if (last_val) std::printf(" | val loss %.4f", *last_val);
  if (auto best = s.train_data->best_loss()) std::printf(" | best possible %.4f", *best);
  std::printf("\n         %lld parameters (%lld on rank 0)", static_cast<long long>(model_params),
              static_cast<long long>(s.model->num_params()));
  if (skipped_total) std::printf(" | %lld step(s) skipped (not finite, or a loss-scale overflow)", static_cast<long long>(skipped_total));
  std::printf("\n         %.0f tokens/s | %.4f TFLOP/s (%.3g model FLOPs/token) | MFU %.1f%% of %.3f TFLOP/s (%s) | steady step %.1f ms\n",
              tps, tps * flops_per_token / 1e12, flops_per_token, 100.0 * tps * flops_per_token / peak_flops,
              peak_flops / 1e12, peak_source.c_str(), mean_step * 1e3);
  std::printf("         time: forward %.1f s, backward %.1f s, optimizer %.1f s, data %.2f s, eval %.1f s\n",
              phase_sum.forward, phase_sum.backward, phase_sum.optimizer, phase_sum.data, eval_time);
  std::printf("         peak memory per rank: %s\n", memory_line(peak_bytes, peak_total).c_str());
  std::printf("         gemm: %s\n", gemm::describe().c_str());
  for (std::size_t gi = 0; gi < groups.size(); ++gi)
    if (groups[gi]->size() > 1)
      std::printf("         comm %s (%d ranks): %s sent per rank per step, %.2f s waiting (%.1f%% of training)\n",
                  groups[gi]->name().c_str(), groups[gi]->size(),
                  format_bytes(group_bytes_total[gi] / per_step_divisor).c_str(), group_wait_total[gi],
                  100.0 * group_wait_total[gi] / train_time);
  // Each role's own lines (data parallelism, ZeRO, compression through the gradient sync and its
  // reducers), then precision's, then the schedule's (a pipeline's bubble).
  for (const std::string& line : s.engine->grad_sync().summary_lines(report_means))
    std::printf("         %s\n", line.c_str());
  std::string scale_note;
  if (precision_summary.contains("loss_scale_final")) {
    char note[160];
    std::snprintf(note, sizeof note, "; fp16 loss scale of the last step %g, %lld step(s) skipped on overflow",
                  precision_summary["loss_scale_final"].get<double>(), static_cast<long long>(skipped_total));
    scale_note = note;
  }
  if (precision_summary.contains("dtype"))
    std::printf("         precision %s: model state per rank %s = 16-bit weight copies %s + fp32 master weights %s\n"
                "         + gradients (fp32) %s + AdamW %s, against the textbook's mixed precision %s = %s (16-bit\n"
                "         weights and gradients, fp32 masters and moments): loom keeps fp32 gradients (accumulated over\n"
                "         micro-batches in fp32) and 16-bit copies of the matrix weights only (LayerNorm, biases and\n"
                "         positions are used in fp32); operand workspace peak %s%s\n",
                precision_summary["dtype"].get<std::string>().c_str(), format_bytes(precision_summary["state_bytes"]).c_str(),
                format_bytes(peak_bytes[static_cast<int>(Mem::params)]).c_str(),
                format_bytes(peak_bytes[static_cast<int>(Mem::master)]).c_str(),
                format_bytes(peak_bytes[static_cast<int>(Mem::grads)]).c_str(),
                format_bytes(peak_bytes[static_cast<int>(Mem::optimizer)]).c_str(),
                precision_summary["textbook_formula"].get<std::string>().c_str(),
                format_bytes(precision_summary["textbook_bytes"]).c_str(),
                format_bytes(peak_bytes[static_cast<int>(Mem::workspace)]).c_str(),
                scale_note.c_str());
  for (const std::string& line : s.engine->schedule().summary_lines(report_means))
    std::printf("         %s\n", line.c_str());
  if (interrupted)
    std::printf("         interrupted by signal %d after a checkpoint: exit status %d; continue with --set "
                "checkpoint.resume=auto\n", Checkpointing::stop_signal(), kExitInterrupted);
  std::printf("         wrote %s/{metrics.jsonl,summary.json,report.json}\n", s.run_dir.c_str());
  std::fflush(stdout);
  return exit_status;
}

}  // namespace loom
