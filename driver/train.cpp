// `loom run`: the training loop, its per-step lines, metrics.jsonl, summary and report.
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <iostream>
#include <nlohmann/json.hpp>

#include "core/blas_core.hpp"
#include "driver/checkpointing.hpp"
#include "driver/commands.hpp"
#include "driver/session.hpp"
#include "io/report.hpp"

namespace loom {
namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

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

std::optional<double> value_of(const std::vector<std::pair<std::string, double>>& values, const std::string& key) {
  for (const auto& [k, v] : values)
    if (k == key) return v;
  return std::nullopt;
}

}  // namespace

int command_run(const Deck& deck, const StrategyRegistry& registry) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const double t_start = now();
  Session s(deck, registry);
  const bool io = rank == 0;
  JsonLines metrics;
  if (io) {
    make_run_dir(s.run_dir);
    metrics.open(s.run_dir + "/metrics.jsonl");
    std::cout << s.banner() << std::flush;
  }
  Checkpointing checkpoints(s);
  const std::int64_t start_step = checkpoints.resume();
  const double tokens_per_step = static_cast<double>(s.global_batch) * s.model_cfg.seq_len;
  const double flops_per_token = s.model->flops_per_token();
  const double t_init = now() - t_start;

  double train_time = 0, steady_time = 0, eval_time = 0, last_loss = NAN;
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
  const int world = s.layout.ranks();

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
    // The slowest and the fastest rank's step time (a straggler shows): a metrics-only reduction.
    double t_min = st.seconds, t_max = st.seconds;
    if (world > 1) {
      MPI_Allreduce(MPI_IN_PLACE, &t_min, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
      MPI_Allreduce(MPI_IN_PLACE, &t_max, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    }
    auto report_values = s.engine->grad_sync().step_report();
    for (auto& kv : s.model->partition().step_report()) report_values.push_back(kv);
    for (auto& kv : s.engine->schedule().step_report()) report_values.push_back(kv);
    report_all.add(report_values);
    if (step > start_step) report_steady.add(report_values);  // steady steps, like the throughput
    const auto bubble = value_of(report_values, "pp_bubble");
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
    if (!std::isfinite(st.loss)) {
      if (io) std::cerr << "loom: rank 0: loss is " << st.loss << " at step " << step << "; stopping (lower train.lr?)\n";
      return 1;
    }

    const bool last = step + 1 == s.steps;
    std::optional<double> val;
    if (s.val_data && ((s.eval_every > 0 && (step + 1) % s.eval_every == 0) || last)) val = evaluate();
    nlohmann::json saved = nlohmann::json::object();
    const bool stop = checkpoints.after_step(step + 1, saved);  // collective
    if (!io) {
      if (stop) break;
      continue;
    }
    const bool log = step % s.log_every == 0 || last || val || stop || !saved.empty();
    if (!log) continue;
    const double tps = tokens_per_step / st.seconds;
    const double tflops = tps * flops_per_token / 1e12;
    char line[512];
    std::snprintf(line, sizeof line,
                  "step %6lld/%lld | loss %.4f | lr %.3e | norm %.3f | %8.0f tok/s | %.4f TFLOP/s | %7.1f ms | mem %s",
                  static_cast<long long>(step + 1), static_cast<long long>(s.steps), st.loss, st.lr, st.grad_norm, tps,
                  tflops, st.seconds * 1e3, memory_line(st.peak_bytes, st.peak_total).c_str());
    std::cout << line;
    if (world > 1) {
      double bytes = 0;
      for (auto* g : groups) bytes += g->size() > 1 ? static_cast<double>(g->stats().total_bytes()) : 0.0;
      std::printf(" | comm %s, wait %.0f%% | step min/max %.1f/%.1f ms", format_bytes(bytes).c_str(),
                  100.0 * step_wait / st.seconds, t_min * 1e3, t_max * 1e3);
    }
    if (bubble)
      std::printf(" | bubble %.2f (textbook %.2f)", *bubble, value_of(report_values, "pp_bubble_textbook").value_or(0.0));
    if (val) std::printf(" | val %.4f", *val);
    std::cout << std::endl;
    nlohmann::json rec = {{"step", step + 1},
                          {"loss", st.loss},
                          {"lr", st.lr},
                          {"grad_norm", st.grad_norm},
                          {"clip_coef", st.clip_coef},
                          {"tokens_per_s", tps},
                          {"tflops", tflops},
                          {"step_ms", st.seconds * 1e3},
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
    for (const auto& [k, v] : saved.items()) rec[k] = v;
    metrics.write(rec);
    if (stop) break;
  }

  if (!io) return 0;
  std::map<std::string, double> report_means = (report_steady.steps ? report_steady : report_all).means();
  const double mean_step = steady_steps > 0 ? steady_time / steady_steps : train_time / std::max<std::int64_t>(1, steps_run);
  const double tps = tokens_per_step / mean_step;
  nlohmann::json summary = {{"steps", s.steps},
                            {"start_step", start_step},
                            {"steps_run", steps_run},
                            {"checkpoint", checkpoints.summary()},
                            {"time_s", now() - t_start},
                            {"train_time_s", train_time},
                            {"eval_time_s", eval_time},
                            {"tokens_per_s", tps},
                            {"model_flops_per_token", flops_per_token},
                            {"tflops", tps * flops_per_token / 1e12},
                            {"final_loss", last_loss},
                            {"parameters", s.model->num_params()},
                            {"mem_peak_bytes", memory_json(peak_bytes, peak_total)},
                            {"ranks", world},
                            {"layout", {{"dp", s.layout.dp}, {"tp", s.layout.tp}, {"pp", s.layout.pp}}},
                            {"comm_wait_share", train_time > 0 ? wait_total / train_time : 0.0}};
  {
    nlohmann::json comm = nlohmann::json::object();
    for (std::size_t gi = 0; gi < groups.size(); ++gi)
      if (groups[gi]->size() > 1)
        comm[groups[gi]->name()] = {{"bytes_sent_per_step", group_bytes_total[gi] / s.steps},
                                    {"wait_s", group_wait_total[gi]}};
    summary["comm"] = comm;
    for (const auto& [k, v] : report_means) summary[k] = v;
  }
  if (last_val) summary["final_val_loss"] = *last_val;
  if (auto best = s.train_data->best_loss()) summary["best_possible_loss"] = *best;
  write_json(s.run_dir + "/summary.json", summary);

  nlohmann::json params;
  for (const auto& [k, v] : deck.values()) params[k] = v;
  nlohmann::json report = {{"deck", deck.path()},
                           {"parameters", params},
                           {"resolved_deck", deck.resolved_text()},
                           {"platform", platform_info()},
                           {"build", build_info()},
                           {"backend", s.backend->description()},
                           {"openblas_core_note", openblas_core_note()},
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
  write_json(s.run_dir + "/report.json", report);

  std::printf("\nsummary: %lld steps (%lld .. %lld) in %.1f s | final loss %.4f", static_cast<long long>(steps_run),
              static_cast<long long>(start_step + 1), static_cast<long long>(start_step + steps_run), train_time,
              last_loss);
  if (last_val) std::printf(" | val loss %.4f", *last_val);
  if (auto best = s.train_data->best_loss()) std::printf(" | best possible %.4f", *best);
  std::printf("\n         %.0f tokens/s | %.4f TFLOP/s (%.3g model FLOPs/token) | steady step %.1f ms\n", tps,
              tps * flops_per_token / 1e12, flops_per_token, mean_step * 1e3);
  std::printf("         time: forward %.1f s, backward %.1f s, optimizer %.1f s, data %.2f s, eval %.1f s\n",
              phase_sum.forward, phase_sum.backward, phase_sum.optimizer, phase_sum.data, eval_time);
  std::printf("         peak memory per rank: %s\n", memory_line(peak_bytes, peak_total).c_str());
  for (std::size_t gi = 0; gi < groups.size(); ++gi)
    if (groups[gi]->size() > 1)
      std::printf("         comm %s (%d ranks): %s sent per rank per step, %.2f s waiting (%.1f%% of training)\n",
                  groups[gi]->name().c_str(), groups[gi]->size(),
                  format_bytes(group_bytes_total[gi] / s.steps).c_str(), group_wait_total[gi],
                  100.0 * group_wait_total[gi] / train_time);
  if (report_means.count("dp_allreduce_ratio"))
    std::printf("         dp all-reduce: measured bytes / ring 2(N-1)/N*M = %.4f\n", report_means["dp_allreduce_ratio"]);
  if (report_means.count("pp_bubble"))
    std::printf("         pipeline bubble: measured %.3f (mean over stages and steady steps); the schedule replayed\n"
                "         with the measured op times and free communication %.3f; textbook (p-1)/(vm+p-1) %.3f\n",
                report_means["pp_bubble"], report_means["pp_bubble_expected"], report_means["pp_bubble_textbook"]);
  std::printf("         wrote %s/{metrics.jsonl,summary.json,report.json}\n", s.run_dir.c_str());
  return 0;
}

}  // namespace loom
