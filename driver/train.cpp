// `loom run`: the training loop, its per-step lines, metrics.jsonl, summary and report.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <iostream>
#include <nlohmann/json.hpp>

#include "core/backend/blas_core.hpp"
#include "core/backend/wait_policy.hpp"
#include "core/base/clock.hpp"
#include "core/base/error.hpp"
#include "core/comm/fault.hpp"
#include "driver/checkpointing.hpp"
#include "driver/commands.hpp"
#include "driver/health.hpp"
#include "driver/run_dir.hpp"
#include "driver/session.hpp"
#include "driver/spikes.hpp"
#include "driver/experts_report.hpp"
#include "driver/stragglers.hpp"
#include "io/report.hpp"
#include "io/tensorboard.hpp"

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
  if (s < 100)
    std::snprintf(buf, sizeof buf, "%lld s", s);
  else if (s < 3600)
    std::snprintf(buf, sizeof buf, "%lldm%02llds", s / 60, s % 60);
  else
    std::snprintf(buf, sizeof buf, "%lldh%02lldm", s / 3600, s / 60 % 60);
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
      be.matmul_forward(c.ref(), a.ref(), b.ref(), {}, n, n, n);
      be.synchronize();
      if (rep >= 2) best = std::min(best, now() - t0);
    }
    be.release_scratch();  // the 16-bit operand copies of these large products
    return 2.0 * n * n * n / best;
  }
}

// What a run adds up over its steps, for the summary and the report.
struct RunTotals {
  double train_time = 0, steady_time = 0, eval_time = 0, wait_total = 0;
  double last_loss = NAN, last_loss_scale = 1;
  std::int64_t steps_run = 0, steady_steps = 0, skipped_total = 0, skipped_in_row = 0;
  std::int64_t redone = 0;  // steps run again after rollbacks (train.on_spike)
  PhaseTimes phase_sum;
  std::array<std::size_t, kMemCategories> peak_bytes{};
  std::size_t peak_total = 0;
  std::optional<double> last_val;
  std::vector<double> group_bytes, group_wait;  // per group, summed over the steps
  // Every value the roles report per step (measured vs textbook volumes, bubbles, ...), summed over
  // the steady steps (all steps if there is only one) for the summary.
  ReportMeans report_steady, report_all;

  // `steady`: not the run's first step, which pays for first-touch allocation.
  void add(const StepStats& st, const std::vector<std::pair<std::string, double>>& report, bool steady) {
    report_all.add(report);
    train_time += st.seconds;
    ++steps_run;
    if (steady) {
      report_steady.add(report);
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
  }
  std::map<std::string, double> report_means() const {
    return (report_steady.steps ? report_steady : report_all).means();
  }
  double mean_step() const {
    return steady_steps > 0 ? steady_time / steady_steps : train_time / std::max<std::int64_t>(1, steps_run);
  }
};

// One step's communication per group (counted by the communicators), and the slowest and fastest
// rank's step time.
struct StepComm {
  nlohmann::json by_group = nlohmann::json::object();
  double wait = 0, bytes = 0, t_min = 0, t_max = 0;
};

// The mixed-precision textbook's model state per rank, 2P (16-bit weights) + 2P (16-bit gradients)
// + 12P (fp32 master weights and AdamW's moments), the parts the ranks split divided by N
// (GradSync::state_sharding: ZeRO's stages), with the formula as the summary prints it.
std::pair<double, std::string> textbook_state(double P, const StateSharding& sh) {
  const double N = sh.ranks;
  const double bytes = 2 * P / (sh.weights ? N : 1) + 2 * P / (sh.grads ? N : 1) + 12 * P / (sh.optimizer ? N : 1);
  if (sh.weights && sh.grads && sh.optimizer) return {bytes, "16P/N"};
  std::string whole, split;
  int n_split = 0;
  for (const auto& [term, by] :
       {std::pair<const char*, bool>{"2P", sh.weights}, {"2P", sh.grads}, {"12P", sh.optimizer}}) {
    std::string& to = by ? split : whole;
    to += (to.empty() ? "" : " + ") + std::string(term);
    n_split += by ? 1 : 0;
  }
  if (n_split == 0) return {bytes, whole};
  return {bytes, whole + " + " + (n_split > 1 ? "(" + split + ")/N" : split + "/N")};
}

// `loom run`: one run of a deck, from the locks on its directories to summary.json.
class TrainingRun {
 public:
  TrainingRun(const Deck& deck, const StrategyRegistry& registry)
      : deck_(deck),
        s_(deck, registry),
        checkpoints_(s_),
        io_(s_.grid->rank() == 0),
        world_(s_.layout.ranks()),
        groups_(s_.grid->groups()) {}
  // A run refused before it wrote anything leaves the directories as they were (a directory it
  // created for the lock is removed again).
  ~TrainingRun() {
    if (writing_) return;
    if (checkpoint_lock_) checkpoint_lock_->abandon();
    if (run_lock_) run_lock_->abandon();
  }
  int run();

 private:
  void lock_directories();
  void open_metrics();
  void open_tensorboard();
  void measure_peak();
  StepComm read_comm(const StepStats& st);
  std::vector<std::pair<std::string, double>> role_reports();
  std::int64_t whole_model_params() const;
  void watch_spikes();
  void judge_step(std::int64_t step, const StepStats& st);
  void judge_spike(std::int64_t step);
  std::int64_t roll_back(std::int64_t step);
  bool after_step(std::int64_t step, std::optional<double>& val, nlohmann::json& saved);
  void log_step(std::int64_t step, const StepStats& st, const StepComm& comm,
                const std::vector<std::pair<std::string, double>>& report, const std::optional<double>& val,
                const nlohmann::json& saved);
  void check_the_end();
  // Bits per byte of a validation loss (nats/token): byte and subword models compared.
  double bits_per_byte(double loss) const { return loss * s_.val_tokens_per_byte / std::log(2.0); }
  std::vector<double> gather_rank_peaks();
  nlohmann::json summary_json(const std::vector<double>& all_peaks, const std::map<std::string, double>& means);
  void write_report(const nlohmann::json& summary);
  void print_summary(const nlohmann::json& summary, const std::map<std::string, double>& means);
  // A fresh run may move an earlier run's results aside: asked for (run.overwrite), or a job of a chain
  // (checkpoint.resume = auto) that found nothing to continue, as a requeued first job does.
  bool results_may_move() const {
    return deck_.get_bool("run.overwrite") || deck_.get_string("checkpoint.resume") == "auto";
  }
  std::string status() const { return !failure_.empty() ? "failed" : interrupted_ ? "interrupted" : "finished"; }
  int exit_status() const { return !failure_.empty() ? 1 : interrupted_ ? kExitInterrupted : 0; }

  const double t_start_ = now();  // before the session is set up: its time is the run's init
  const Deck& deck_;
  Session s_;
  Checkpointing checkpoints_;
  const bool io_;
  const int world_;
  std::vector<Communicator*> groups_;
  // One run at a time per directory: rank 0 locks run.dir (and checkpoint.dir when it lies
  // elsewhere) before anything is written there.
  std::unique_ptr<DirLock> run_lock_, checkpoint_lock_;
  bool writing_ = false;
  MetricsFile metrics_;
  TensorBoardWriter tensorboard_;  // run.tensorboard: the metrics rows again, as TensorBoard reads them
  std::int64_t start_step_ = 0;
  double t_init_ = 0, t_loop_ = 0;
  double tokens_per_step_ = 0, flops_per_token_ = 0, peak_flops_ = 0;
  std::string peak_source_;
  RunTotals totals_;
  std::string failure_;         // why the run failed (the same on every rank); empty while it goes well
  std::string nonfinite_note_;  // the last step's, when its loss or gradient norm was not finite
  bool interrupted_ = false;
  // train.on_spike: the detector, the verdict of this step when it was a spike (set by the detector's
  // norm-phase hook), every spike as the summary lists it, and the rollbacks since a checkpoint.
  std::string on_spike_ = "none";
  std::unique_ptr<SpikeDetector> spike_detector_;
  std::optional<SpikeVerdict> spike_;
  nlohmann::json spikes_ = nlohmann::json::array();
  std::int64_t rollbacks_ = 0, rollbacks_in_row_ = 0, rolled_back_from_ = -1;
  bool rollback_pending_ = false;
  nlohmann::json carried_ = nlohmann::json::object();  // for the next metrics row (the same on every rank)
  std::unique_ptr<StragglerWatch> stragglers_;         // run.straggler_factor
  double step_wall_ = 0;  // the last step's time with its evaluation and checkpoint (metrics wall_ms)
  ExpertsStep experts_;   // the last step's routing (model.experts)
  nlohmann::json last_load_ = nlohmann::json::array();
};

// The spike detector judges each step between the gradient norm and the update (a norm-phase hook,
// on every rank alike): a spike's update is not applied, whatever train.on_spike does next.
void TrainingRun::watch_spikes() {
  on_spike_ = deck_.get_string("train.on_spike");
  if (on_spike_ == "none") return;
  spike_detector_ =
      std::make_unique<SpikeDetector>(static_cast<int>(deck_.get_int("train.spike_window")),
                                      deck_.get_float("train.spike_loss_z"), deck_.get_float("train.spike_norm_z"));
  s_.engine->add_first_hook({StepPhase::norm, "train.on_spike", [this](StepState& st) {
                               spike_.reset();
                               if (!st.skip_reason.empty() || st.nonfinite) return;
                               const double norm = std::sqrt(st.sq_norm);
                               SpikeVerdict v = spike_detector_->judge(st.loss, norm);
                               // The values are the same on every rank; the ranks agree all the same, since a
                               // rank that alone rolled back would leave the others waiting.
                               if (world_ > 1) v.spike = s_.grid->world().sum(v.spike ? 1.0 : 0.0) > 0;
                               if (!v.spike) return spike_detector_->admit(st.loss, norm);
                               spike_ = v;
                               st.skip_reason = "loss spike";
                             }});
}

void TrainingRun::lock_directories() {
  run_agreed([&] {
    if (!io_) return;
    refuse_if_held(s_.run_dir, "run.dir");  // before DirLock creates it: a refused run leaves nothing
    run_lock_ = std::make_unique<DirLock>(s_.run_dir, "run.dir");
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::path run_abs = fs::weakly_canonical(s_.run_dir, ec),
                   ckpt_abs = fs::weakly_canonical(checkpoints_.dir(), ec);
    // Compared by canonical path: run.dir = X with checkpoint.dir = X is one directory, locked once.
    // A checkpoint.dir directly in run.dir is covered by its lock, unless another run locked it as its
    // own checkpoint.dir; any other is locked too, and may not lie inside another running loom's
    // directory (the two would share one `latest` and one keep rotation).
    refuse_if_held(s_.run_dir, "run.dir", run_abs.string());  // not inside another running loom's directory
    refuse_if_held(checkpoints_.dir(), "checkpoint.dir", run_abs.string());
    if (ckpt_abs != run_abs && ckpt_abs.parent_path() != run_abs)
      checkpoint_lock_ = std::make_unique<DirLock>(checkpoints_.dir(), "checkpoint.dir");
  });
}

void TrainingRun::open_metrics() {
  if (!io_) return;
  const std::string path = s_.run_dir + "/metrics.jsonl";
  if (!checkpoints_.resuming()) {
    const auto moved = move_results_aside(s_.run_dir);  // only when results_may_move() (refused before)
    if (!moved.empty())
      std::cout << (deck_.get_bool("run.overwrite") ? "run.overwrite = true"
                                                    : "checkpoint.resume = auto found no checkpoint to continue")
                << ": moved the earlier run's results in " << s_.run_dir << " aside to *.earlier (" << moved.size()
                << " file(s))" << std::endl;
    metrics_.start(path);
  } else if (const int aside = metrics_.resume(path, start_step_); aside > 0) {
    std::cout << "metrics: " << aside << " row(s) past step " << start_step_ << " from the earlier run moved to "
              << path << ".superseded; " << path << " continues from step " << start_step_ + 1 << std::endl;
  }
  open_tensorboard();
}

// run.tensorboard: a new event file for each run and each resume, beside metrics.jsonl; TensorBoard
// reads every file of run.dir as one run.
void TrainingRun::open_tensorboard() {
  if (!io_ || !deck_.get_bool("run.tensorboard")) return;
  tensorboard_.open(s_.run_dir, start_step_ + 1);
  std::cout << "  events  : " << tensorboard_.path() << " (run.tensorboard; tensorboard --logdir " << s_.run_dir << ")"
            << std::endl;
}

// MFU is measured against every rank's peak: run.peak_tflops, or the matrix-product rate each rank
// measures now (all ranks at once, as they will train).
void TrainingRun::measure_peak() {
  peak_flops_ = deck_.get_float("run.peak_tflops") * 1e12;
  peak_source_ = peak_flops_ > 0 ? "run.peak_tflops" : "measured matrix-product rate";
  if (peak_flops_ <= 0) peak_flops_ = measured_matmul_flops(*s_.backend);
  s_.grid->world().all_reduce(&peak_flops_, 1);
  if (io_)
    std::printf("  MFU     : against %.3f TFLOP/s (%s, summed over %d rank%s)\n", peak_flops_ / 1e12,
                peak_source_.c_str(), world_, world_ == 1 ? "" : "s");
  if (io_ && link_gbit_per_s() > 0)
    std::printf(
        "  link    : EMULATED, %g Gbit/s per rank, %g us per message (run.emulate_link_gbps): every send "
        "waits its turn on it\n",
        link_gbit_per_s(), 1e6 * link_latency_s());
}

// What the roles report of the last step (gradient sync, partition, context, schedule), in that order,
// then the experts' routing (the model's).
std::vector<std::pair<std::string, double>> TrainingRun::role_reports() {
  auto report = s_.engine->grad_sync().step_report();
  for (auto& kv : s_.model->partition().step_report()) report.push_back(kv);
  for (auto& kv : s_.model->context().step_report()) report.push_back(kv);
  for (auto& kv : s_.model->experts().step_report()) report.push_back(kv);
  for (auto& kv : s_.engine->schedule().step_report()) report.push_back(kv);
  experts_ = gather_experts_step(s_.grid->world(), *s_.model);  // collective, with experts
  if (experts_.on()) last_load_ = experts_.load;
  for (auto& kv : experts_.scalars) report.push_back(kv);
  return report;
}

std::int64_t TrainingRun::whole_model_params() const {
  std::int64_t total = 0;
  for (const ParamInfo& p : s_.model->all_params()) {
    std::int64_t n = 1;
    for (auto d : p.shape()) n *= d;
    total += n;
  }
  return total;
}

StepComm TrainingRun::read_comm(const StepStats& st) {
  StepComm c;
  for (std::size_t gi = 0; gi < groups_.size(); ++gi) {
    const CommStats& cs = groups_[gi]->stats();
    if (groups_[gi]->size() == 1) continue;
    nlohmann::json by_op = nlohmann::json::object();
    for (int op = 0; op < kCommOps; ++op)
      if (cs.calls[op])
        by_op[comm_op_name(static_cast<CommOp>(op))] = {
            {"bytes", cs.bytes_sent[op]}, {"wait_ms", cs.wait_s[op] * 1e3}, {"calls", cs.calls[op]}};
    c.by_group[groups_[gi]->name()] = {
        {"bytes_sent", cs.total_bytes()}, {"wait_ms", cs.total_wait() * 1e3}, {"ops", by_op}};
    totals_.group_bytes[gi] += static_cast<double>(cs.total_bytes());
    totals_.group_wait[gi] += cs.total_wait();
    c.wait += cs.total_wait();
    c.bytes += static_cast<double>(cs.total_bytes());
  }
  totals_.wait_total += c.wait;
  // The slowest and the fastest rank's step time (a straggler shows): a metrics-only reduction,
  // through the world communicator so that a stalled rank is caught here too. It only sums: every
  // rank puts its time at its own index.
  c.t_min = c.t_max = st.seconds;
  if (world_ > 1) {
    std::vector<double> step_times(world_, 0.0);
    step_times[s_.grid->rank()] = st.seconds;
    s_.grid->world().all_reduce(step_times.data(), world_);
    c.t_min = *std::min_element(step_times.begin(), step_times.end());
    c.t_max = *std::max_element(step_times.begin(), step_times.end());
  }
  return c;
}

// Counts a skipped update, and sets failure_ when the run must stop (train.on_nonfinite,
// train.max_skipped, a strategy's failure).
void TrainingRun::judge_step(std::int64_t step, const StepStats& st) {
  nonfinite_note_.clear();
  if (st.nonfinite) {  // the loss or the gradient norm (the same on every rank): no update applied
    ++totals_.skipped_total;
    ++totals_.skipped_in_row;
    const auto bad = find_nonfinite(*s_.grid, *s_.model, {gradients(*s_.model)});  // collective
    char what[160];
    std::snprintf(what, sizeof what, "step %lld: loss %g, gradient norm %g: not finite",
                  static_cast<long long>(step + 1), st.loss, st.grad_norm);
    nonfinite_note_ = std::string(what) + (bad ? "; first non-finite: " + bad->describe() : "");
    // Gradient sync spreads a NaN to every replica; the ranks whose own loss was not finite are
    // where it came from (pipeline stages other than the last compute no loss).
    std::vector<double> own(static_cast<std::size_t>(world_), 0.0);
    own[s_.grid->rank()] = std::isfinite(st.local_loss) ? 0.0 : 1.0;
    s_.grid->world().all_reduce(own.data(), world_);
    std::string origin;
    for (int r = 0; r < world_; ++r)
      if (own[r] > 0) origin += (origin.empty() ? "" : ", ") + std::to_string(r);
    if (!origin.empty()) nonfinite_note_ += "; the loss was not finite on rank(s) " + origin;
    const std::int64_t max_skipped = deck_.get_int("train.max_skipped");
    if (deck_.get_string("train.on_nonfinite") != "skip")
      failure_ = nonfinite_note_ +
                 "; stopped without applying it (train.on_nonfinite = stop; lower train.lr, or "
                 "set train.on_nonfinite = skip to drop such steps)";
    else if (totals_.skipped_in_row > max_skipped)
      failure_ = nonfinite_note_ + "; " + std::to_string(totals_.skipped_in_row) +
                 " steps in a row were not finite (train.max_skipped = " + std::to_string(max_skipped) + "): stopping";
    else if (io_)
      std::cout << "loom: warning: " << nonfinite_note_ << "; update skipped (train.on_nonfinite = skip; "
                << totals_.skipped_in_row << " in a row, " << totals_.skipped_total << " in all)" << std::endl;
  } else if (!st.failure.empty()) {
    ++totals_.skipped_total;
    failure_ = st.failure;
  } else if (spike_) {
    ++totals_.skipped_total;  // its update was not applied
    judge_spike(step);
  } else if (!st.skip_reason.empty()) {
    // A phase hook skipped the update on purpose (a loss-scale overflow): counted as a skipped step
    // (step = optimizer_steps + skipped_steps), never a failure.
    ++totals_.skipped_total;
    totals_.skipped_in_row = 0;
  } else {
    totals_.skipped_in_row = 0;
  }
}

// A loss spike at `step` (its update not applied): recorded, and skipped, stopped at, or rolled back
// after the step is logged (train.on_spike).
void TrainingRun::judge_spike(std::int64_t step) {
  const SpikeVerdict& v = *spike_;
  spikes_.push_back({{"step", step + 1},
                     {"batch", step + s_.data_offset + 1},
                     {"loss", v.loss},
                     {"loss_z", v.loss_z},
                     {"grad_norm", v.norm},
                     {"norm_z", v.norm_z},
                     {"window", v.window},
                     {"action", on_spike_}});
  const std::string what = "loss spike at step " + std::to_string(step + 1) + ": " + v.describe();
  const std::int64_t max_rollbacks = deck_.get_int("train.max_rollbacks");
  if (on_spike_ == "stop") {
    failure_ = what +
               "; stopped without applying its update (train.on_spike = stop; continue from the last "
               "checkpoint with checkpoint.resume = auto, or set train.on_spike = rollback)";
  } else if (on_spike_ == "skip") {
    totals_.skipped_in_row = 0;
    if (io_) std::cout << "loom: warning: " << what << "; update skipped (train.on_spike = skip)" << std::endl;
  } else if (!checkpoints_.can_roll_back()) {
    spikes_.back()["action"] = "skip";
    if (io_)
      std::cout << "loom: warning: " << what << "; no checkpoint to roll back to yet: update skipped instead"
                << std::endl;
  } else if (rollbacks_in_row_ >= max_rollbacks) {
    failure_ = what + "; " + std::to_string(rollbacks_in_row_) +
               " rollback(s) with no checkpoint written since (train.max_rollbacks = " + std::to_string(max_rollbacks) +
               "): stopping";
  } else {
    rollback_pending_ = true;
  }
}

// Rolls back after the spike at `step` (collective): reloads the last checkpoint and moves the data
// past the spike's batch (and train.spike_skip_batches more), so that the batches from the checkpoint
// to the spike are never trained on again. Returns the step to go on from.
std::int64_t TrainingRun::roll_back(std::int64_t step) {
  rollback_pending_ = false;
  nlohmann::json& rec = spikes_.back();
  const std::int64_t spike_batch = step + s_.data_offset;               // 0-based, as the next ones below
  const auto [at, path] = checkpoints_.roll_back(step + 1, &carried_);  // sets data_offset to the checkpoint's
  const std::int64_t first_skipped = at + s_.data_offset;
  const std::int64_t next_batch = spike_batch + 1 + deck_.get_int("train.spike_skip_batches");
  s_.data_offset = next_batch - at;
  ++rollbacks_;
  ++rollbacks_in_row_;
  rolled_back_from_ = step + 1;
  totals_.redone += step + 1 - at;
  rec["rolled_back_to"] = at;
  rec["checkpoint"] = path;
  rec["batches_skipped"] = {first_skipped + 1, next_batch};  // 1-based, inclusive, as steps are counted
  if (io_) {
    std::cout << "loom: warning: loss spike at step " << step + 1 << ": rolled back to step " << at << " (" << path
              << "); global batches " << first_skipped + 1 << ".." << next_batch << " are skipped, step " << at + 1
              << " draws batch " << next_batch + 1 << " (rollback " << rollbacks_in_row_
              << " since the last checkpoint, train.max_rollbacks = " << deck_.get_int("train.max_rollbacks") << ")"
              << std::endl;
    metrics_.resume(s_.run_dir + "/metrics.jsonl", at);           // the undone steps' rows go to .superseded
    if (tensorboard_.is_open()) tensorboard_.restart_at(at + 1);  // TensorBoard drops the undone steps
  }
  return at;
}

// Evaluation and checkpoints after a step that went well (collective); true when a stop signal asks
// the run to end here.
bool TrainingRun::after_step(std::int64_t step, std::optional<double>& val, nlohmann::json& saved) {
  if (!failure_.empty()) return false;
  const bool last = step + 1 == s_.steps;
  if (s_.val_data && ((s_.eval_every > 0 && (step + 1) % s_.eval_every == 0) || last)) {
    const double t0 = now();
    val = totals_.last_val = s_.engine->evaluate(s_.eval_batches, s_.val_batches);
    totals_.eval_time += now() - t0;
  }
  try {
    const bool stop = checkpoints_.after_step(step + 1, saved);  // collective
    if (last && !stop) checkpoints_.at_end(step + 1, saved);
    return stop;
  } catch (const AgreedFailure& e) {
    failure_ = e.what();
    return false;
  }
}

// The step line on stdout and its row of metrics.jsonl (rank 0).
void TrainingRun::log_step(std::int64_t step, const StepStats& st, const StepComm& comm,
                           const std::vector<std::pair<std::string, double>>& report, const std::optional<double>& val,
                           const nlohmann::json& saved) {
  const double tps = tokens_per_step_ / st.seconds;
  const double tflops = tps * flops_per_token_ / 1e12;
  const double mfu = tps * flops_per_token_ / peak_flops_;
  const double elapsed = now() - t_start_;
  const double eta =
      (now() - t_loop_) / static_cast<double>(totals_.steps_run) * static_cast<double>(s_.steps - step - 1);
  // A norm that is not finite is a skipped step (a loss-scale overflow, or train.on_nonfinite = skip):
  // said in words, not as -nan.
  char norm[48];
  if (std::isfinite(st.grad_norm))
    std::snprintf(norm, sizeof norm, "%.3f", st.grad_norm);
  else
    std::snprintf(norm, sizeof norm, "%s", st.skip_reason.empty() ? "not finite" : "overflow: skipped");
  char line[560];
  std::snprintf(
      line, sizeof line,
      "step %6lld/%lld | loss %.4f | lr %.3e | norm %s | %8.0f tok/s | %.4f TFLOP/s | MFU %.1f%% | %7.1f ms | mem %s",
      static_cast<long long>(step + 1), static_cast<long long>(s_.steps), st.loss, st.lr, norm, tps, tflops,
      100.0 * mfu, st.seconds * 1e3, memory_line(st.peak_bytes, st.peak_total).c_str());
  std::cout << line;
  if (world_ > 1)
    std::printf(" | comm %s, wait %.0f%% | step min/max %.1f/%.1f ms", format_bytes(comm.bytes).c_str(),
                100.0 * comm.wait / st.seconds, comm.t_min * 1e3, comm.t_max * 1e3);
  std::printf("%s", s_.engine->schedule().step_line(report).c_str());
  std::printf("%s", experts_step_line(experts_).c_str());
  if (val) std::printf(" | val %.4f", *val);
  if (val && s_.val_tokens_per_byte > 0) std::printf(" (%.4f bits/byte)", bits_per_byte(*val));
  if (st.nonfinite) std::printf(" | update skipped");
  if (!st.skip_reason.empty()) std::printf(" | update skipped: %s", st.skip_reason.c_str());
  if (spike_) std::printf(" (z %.1f / %.1f)", spike_->loss_z, spike_->norm_z);
  if (s_.backend->precision().matmul == DType::f16)  // a loss-scaled run shows the scale
    std::printf(" | scale %g, %lld skipped", st.loss_scale, static_cast<long long>(totals_.skipped_total));
  std::printf(" | %s in, ETA %s", duration_text(elapsed).c_str(), duration_text(eta).c_str());
  std::cout << std::endl;
  nlohmann::json rec = {{"step", step + 1},
                        {"loss", st.loss},
                        {"lr", st.lr},
                        {"grad_norm", st.grad_norm},
                        {"clip_coef", st.clip_coef},
                        {"loss_scale", st.loss_scale},
                        {"skipped_steps", totals_.skipped_total},
                        {"tokens_per_s", tps},
                        {"tflops", tflops},
                        {"mfu", mfu},
                        {"step_ms", st.seconds * 1e3},
                        {"batch", step + s_.data_offset + 1},
                        {"wall_ms", step_wall_ * 1e3},
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
                        {"comm", comm.by_group},
                        {"comm_wait_share", comm.wait / st.seconds},
                        {"step_ms_min", comm.t_min * 1e3},
                        {"step_ms_max", comm.t_max * 1e3}};
  for (const auto& [k, v] : report) rec[k] = v;
  if (experts_.on()) rec["moe_load"] = experts_.load;
  if (val) {
    rec["val_loss"] = *val;
    rec["val_ppl"] = std::exp(*val);
    if (s_.val_tokens_per_byte > 0) rec["val_bpb"] = bits_per_byte(*val);
  }
  if (st.nonfinite) rec["skipped"] = true;
  if (!st.skip_reason.empty()) {
    rec["skipped"] = true;
    rec["skip_reason"] = st.skip_reason;
  }
  for (const auto& [k, v] : saved.items()) rec[k] = v;
  if (spike_) rec["spike"] = spikes_.back();
  if (rolled_back_from_ >= 0) rec["rolled_back_from"] = rolled_back_from_;
  metrics_.write(rec);
  if (tensorboard_.is_open()) tensorboard_.write_row(step + 1, rec);
}

// A run that trained to the end must end with finite weights and a finite validation loss.
void TrainingRun::check_the_end() {
  if (!failure_.empty() || interrupted_) return;
  if (const auto bad = find_nonfinite(*s_.grid, *s_.model, {parameters(*s_.model)}))
    failure_ = "training ended with non-finite weights: " + bad->describe();
  else if (totals_.last_val && !std::isfinite(*totals_.last_val))
    failure_ = "training ended with a non-finite validation loss (" + std::to_string(*totals_.last_val) + ")";
}

// Every rank's ledger peaks (`loom plan` is checked against them rank by rank), then its collectives'
// scratch pools, reserved from the step plan and needed: kMemCategories + 3 values per rank, on every
// rank (through the world communicator, which run.comm_timeout watches).
std::vector<double> TrainingRun::gather_rank_peaks() {
  std::vector<double> mine(totals_.peak_bytes.begin(), totals_.peak_bytes.end());
  mine.push_back(static_cast<double>(totals_.peak_total));
  Communicator::ScratchUse pools;
  std::vector<Communicator*> comms = groups_;
  comms.push_back(&s_.grid->world());
  for (const Communicator* c : comms) {
    pools.reserved += c->scratch_use().reserved;
    pools.needed += c->scratch_use().needed;
  }
  mine.push_back(static_cast<double>(pools.reserved));
  mine.push_back(static_cast<double>(pools.needed));
  std::vector<double> all(mine.size() * static_cast<std::size_t>(world_));
  s_.grid->world().all_gather(BufferRef(mine.data(), static_cast<std::int64_t>(mine.size())),
                              BufferRef(all.data(), static_cast<std::int64_t>(all.size())));
  return all;
}

nlohmann::json TrainingRun::summary_json(const std::vector<double>& all_peaks,
                                         const std::map<std::string, double>& means) {
  const RunTotals& t = totals_;
  const double tps = tokens_per_step_ / t.mean_step();
  const std::int64_t model_params = whole_model_params();
  nlohmann::json summary = {
      {"status", status()},
      {"exit_status", exit_status()},
      {"steps", s_.steps},
      {"start_step", start_step_},
      {"steps_run", t.steps_run},
      {"skipped_steps", t.skipped_total},
      {"checkpoint", checkpoints_.summary()},
      {"time_s", now() - t_start_},
      {"train_time_s", t.train_time},
      {"eval_time_s", t.eval_time},
      {"tokens_per_s", tps},
      {"model_flops_per_token", flops_per_token_},
      {"tflops", tps * flops_per_token_ / 1e12},
      {"mfu", tps * flops_per_token_ / peak_flops_},
      {"peak_tflops", peak_flops_ / 1e12},
      {"peak_source", peak_source_},
      {"final_loss", t.last_loss},
      {"parameters", model_params},
      {"parameters_rank0", s_.model->num_params()},
      {"mem_peak_bytes", memory_json(t.peak_bytes, t.peak_total)},
      {"ranks", world_},
      {"layout", {{"dp", s_.layout.dp}, {"tp", s_.layout.tp}, {"pp", s_.layout.pp}, {"cp", s_.layout.cp}}},
      {"comm_wait_share", t.train_time > 0 ? t.wait_total / t.train_time : 0.0}};
  nlohmann::json by_rank = nlohmann::json::array(), pools_by_rank = nlohmann::json::array();
  const std::size_t per_rank = kMemCategories + 3;
  for (int r = 0; r < world_; ++r) {
    std::array<std::size_t, kMemCategories> b{};
    const double* at = all_peaks.data() + static_cast<std::size_t>(r) * per_rank;
    for (int i = 0; i < kMemCategories; ++i) b[static_cast<std::size_t>(i)] = static_cast<std::size_t>(at[i]);
    by_rank.push_back(memory_json(b, static_cast<std::size_t>(at[kMemCategories])));
    pools_by_rank.push_back({{"reserved", static_cast<std::int64_t>(at[kMemCategories + 1])},
                             {"needed", static_cast<std::int64_t>(at[kMemCategories + 2])}});
  }
  summary["mem_peak_bytes_by_rank"] = by_rank;
  summary["comm_scratch_bytes_by_rank"] = pools_by_rank;
  if (!failure_.empty()) summary["error"] = failure_;
  if (on_spike_ != "none") {
    summary["spikes"] = spikes_;
    summary["rollbacks"] = rollbacks_;
    summary["steps_redone"] = totals_.redone;
  }
  if (stragglers_->on()) summary["stragglers"] = stragglers_->summary();
  if (interrupted_) summary["stop_signal"] = Checkpointing::stop_signal();
  nlohmann::json comm = nlohmann::json::object();
  for (std::size_t gi = 0; gi < groups_.size(); ++gi)
    if (groups_[gi]->size() > 1)
      comm[groups_[gi]->name()] = {{"bytes_sent_per_step", t.group_bytes[gi] / std::max<std::int64_t>(1, t.steps_run)},
                                   {"wait_s", t.group_wait[gi]}};
  summary["comm"] = comm;
  for (const auto& [k, v] : means) summary[k] = v;
  if (s_.backend->precision().matmul != DType::f32) {
    const auto& pb = t.peak_bytes;
    const auto at = [&](Mem m) { return pb[static_cast<int>(m)]; };
    const auto [textbook, formula] =
        textbook_state(static_cast<double>(s_.model->num_params()), s_.engine->grad_sync().state_sharding());
    nlohmann::json precision = {
        {"dtype", dtype_name(s_.backend->precision().matmul)},
        {"state_bytes", at(Mem::params) + at(Mem::master) + at(Mem::grads) + at(Mem::optimizer)},
        {"compute_copy_bytes", at(Mem::params)},
        {"master_bytes", at(Mem::master)},
        {"textbook_bytes", textbook},
        {"textbook_formula", formula},
        {"workspace_peak_bytes", at(Mem::workspace)}};
    if (s_.backend->precision().matmul == DType::f16) precision["loss_scale_final"] = t.last_loss_scale;
    summary["precision"] = precision;
  }
  if (t.last_val) summary["final_val_loss"] = *t.last_val;
  if (!last_load_.empty()) summary["moe_load_last"] = last_load_;
  if (t.last_val && s_.val_tokens_per_byte > 0) summary["final_val_bpb"] = bits_per_byte(*t.last_val);
  if (auto best = s_.train_data->best_loss()) summary["best_possible_loss"] = *best;
  return summary;
}

void TrainingRun::write_report(const nlohmann::json& summary) {
  nlohmann::json params, from_command_line = nlohmann::json::object();
  for (const auto& [k, v] : deck_.values()) {
    params[k] = v;
    if (deck_.origin(k) == "--set") from_command_line[k] = v;
  }
  const PhaseTimes& ph = totals_.phase_sum;
  nlohmann::json report = {{"deck", deck_.path()},
                           {"command_line", command_line()},
                           {"set_on_command_line", from_command_line},
                           {"parameters", params},
                           {"resolved_deck", deck_.resolved_text()},
                           {"platform", platform_info()},
                           {"build", build_info()},
                           {"backend", s_.backend->description()},
                           {"openblas_core_note", openblas_core_note()},
                           {"wait_policy_note", wait_policy_note()},
                           {"omp_wait_policy", std::getenv("OMP_WAIT_POLICY") ? std::getenv("OMP_WAIT_POLICY") : ""},
                           {"gemm", gemm::describe()},
                           {"gemm_impls_used", gemm::impls_used()},
                           {"timings_s",
                            {{"total", now() - t_start_},
                             {"init", t_init_},
                             {"train", totals_.train_time},
                             {"eval", totals_.eval_time},
                             {"data", ph.data},
                             {"forward", ph.forward},
                             {"backward", ph.backward},
                             {"sync", ph.sync},
                             {"optimizer", ph.optimizer}}},
                           {"summary", summary}};
  write_json_atomic(s_.run_dir + "/report.json", report);
}

void TrainingRun::print_summary(const nlohmann::json& summary, const std::map<std::string, double>& means) {
  const RunTotals& t = totals_;
  const double tps = tokens_per_step_ / t.mean_step();
  std::printf("\nsummary: %s: %lld steps (%lld .. %lld%s) in %.1f s | final loss %.4f", status().c_str(),
              static_cast<long long>(t.steps_run), static_cast<long long>(start_step_ + 1),
              static_cast<long long>(start_step_ + t.steps_run - t.redone),
              t.redone ? (", " + std::to_string(t.redone) + " of them again after rollbacks").c_str() : "",
              t.train_time, t.last_loss);
  if (t.last_val) std::printf(" | val loss %.4f", *t.last_val);
  if (t.last_val && s_.val_tokens_per_byte > 0) std::printf(" (%.4f bits/byte)", bits_per_byte(*t.last_val));
  if (auto best = s_.train_data->best_loss()) std::printf(" | best possible %.4f", *best);
  std::printf("\n         %lld parameters (%lld on rank 0)",
              static_cast<long long>(summary["parameters"].get<std::int64_t>()),
              static_cast<long long>(s_.model->num_params()));
  if (t.skipped_total)
    std::printf(" | %lld step(s) skipped (not finite, a loss-scale overflow or a loss spike)",
                static_cast<long long>(t.skipped_total));
  if (!spikes_.empty())
    std::printf("\n         %zu loss spike(s) (train.on_spike = %s), %lld rollback(s)", spikes_.size(),
                on_spike_.c_str(), static_cast<long long>(rollbacks_));
  std::printf(
      "\n         %.0f tokens/s | %.4f TFLOP/s (%.3g model FLOPs/token) | MFU %.1f%% of %.3f TFLOP/s (%s) | steady "
      "step %.1f ms\n",
      tps, tps * flops_per_token_ / 1e12, flops_per_token_, 100.0 * tps * flops_per_token_ / peak_flops_,
      peak_flops_ / 1e12, peak_source_.c_str(), t.mean_step() * 1e3);
  std::printf("         time: forward %.1f s, backward %.1f s, optimizer %.1f s, data %.2f s, eval %.1f s\n",
              t.phase_sum.forward, t.phase_sum.backward, t.phase_sum.optimizer, t.phase_sum.data, t.eval_time);
  std::printf("         peak memory per rank: %s\n", memory_line(t.peak_bytes, t.peak_total).c_str());
  std::printf("         gemm: %s\n", gemm::describe().c_str());
  for (std::size_t gi = 0; gi < groups_.size(); ++gi)
    if (groups_[gi]->size() > 1)
      std::printf("         comm %s (%d ranks): %s sent per rank per step, %.2f s waiting (%.1f%% of training)\n",
                  groups_[gi]->name().c_str(), groups_[gi]->size(),
                  format_bytes(t.group_bytes[gi] / std::max<std::int64_t>(1, t.steps_run)).c_str(), t.group_wait[gi],
                  100.0 * t.group_wait[gi] / t.train_time);
  // Each role's own lines (data parallelism, ZeRO, compression through the gradient sync and its
  // reducers), then precision's, then the schedule's (a pipeline's bubble).
  for (const std::string& line : s_.engine->grad_sync().summary_lines(means))
    std::printf("         %s\n", line.c_str());
  if (summary.contains("precision")) {
    const nlohmann::json& p = summary["precision"];
    std::string scale_note;
    if (p.contains("loss_scale_final")) {
      char note[160];
      std::snprintf(note, sizeof note, "; fp16 loss scale of the last step %g, %lld step(s) skipped on overflow",
                    p["loss_scale_final"].get<double>(), static_cast<long long>(t.skipped_total));
      scale_note = note;
    }
    const auto at = [&](Mem m) { return format_bytes(t.peak_bytes[static_cast<int>(m)]); };
    std::printf(
        "         precision %s: model state per rank %s = 16-bit weight copies %s + fp32 master weights %s\n"
        "         + gradients (fp32) %s + AdamW %s, against the textbook's mixed precision %s = %s (16-bit\n"
        "         weights and gradients, fp32 masters and moments): loom keeps fp32 gradients (accumulated over\n"
        "         micro-batches in fp32) and 16-bit copies of the matrix weights only (LayerNorm, biases and\n"
        "         positions are used in fp32); operand workspace peak %s%s\n",
        p["dtype"].get<std::string>().c_str(), format_bytes(p["state_bytes"]).c_str(), at(Mem::params).c_str(),
        at(Mem::master).c_str(), at(Mem::grads).c_str(), at(Mem::optimizer).c_str(),
        p["textbook_formula"].get<std::string>().c_str(), format_bytes(p["textbook_bytes"]).c_str(),
        at(Mem::workspace).c_str(), scale_note.c_str());
  }
  for (const std::string& line : s_.engine->schedule().summary_lines(means)) std::printf("         %s\n", line.c_str());
  for (const std::string& line :
       experts_summary_lines(s_.model->config(), s_.model->experts(), means, last_load_, t.mean_step()))
    std::printf("         %s\n", line.c_str());
  if (stragglers_->on())
    for (const auto& r : stragglers_->summary())
      std::printf(
          "         slow rank %d (host %s): up to %.2fx the others' busy time, in %s, in %d window(s) of %lld steps\n",
          r["rank"].get<int>(), r["host"].get<std::string>().c_str(), r["factor"].get<double>(),
          r["phase"].get<std::string>().c_str(), r["windows"].get<int>(),
          static_cast<long long>(deck_.get_int("run.straggler_every")));
  if (interrupted_)
    std::printf(
        "         interrupted by signal %d after a checkpoint: exit status %d; continue with --set "
        "checkpoint.resume=auto\n",
        Checkpointing::stop_signal(), kExitInterrupted);
  std::printf("         wrote %s/{metrics.jsonl,summary.json,report.json}\n", s_.run_dir.c_str());
  std::fflush(stdout);
}

int TrainingRun::run() {
  lock_directories();
  if (io_) std::cout << s_.banner() << std::flush;
  checkpoints_.prepare();
  run_agreed([&] {  // before anything is written: a refused run leaves the earlier results as they were
    if (io_ && !checkpoints_.resuming()) refuse_fresh_over_results(s_.run_dir, results_may_move());
  });
  start_step_ = checkpoints_.resume();
  open_metrics();
  writing_ = true;
  tokens_per_step_ = static_cast<double>(s_.global_batch) * s_.model_cfg.seq_len;
  flops_per_token_ = s_.model->flops_per_token();
  measure_peak();
  t_init_ = now() - t_start_;
  totals_.group_bytes.assign(groups_.size(), 0.0);
  totals_.group_wait.assign(groups_.size(), 0.0);
  watch_spikes();
  stragglers_ = std::make_unique<StragglerWatch>(s_.grid->world(), deck_.get_float("run.straggler_factor"),
                                                 deck_.get_int("run.straggler_every"), s_.grid->pp_rank());
  if (io_ && !stragglers_->idle_reason().empty())
    std::cout << "loom: note: run.straggler_factor = " << deck_.values().at("run.straggler_factor") << ": "
              << stragglers_->idle_reason() << std::endl;
  t_loop_ = now();
  for (std::int64_t step = start_step_; step < s_.steps; ++step) {
    const double t_step = now();
    for (auto* g : groups_) g->reset_stats();
    s_.model->context().begin_step();
    s_.model->experts().begin_step();
    const StepStats st = s_.engine->train_step(step, s_.train_batches);
    const StepComm comm = read_comm(st);
    stragglers_->add(st, comm.wait);
    const nlohmann::json slow = stragglers_->check(step + 1);  // collective, every run.straggler_every steps
    if (io_)
      for (const auto& s : slow) std::cout << "loom: warning: slow rank: " << StragglerWatch::describe(s) << std::endl;
    const auto report = role_reports();
    totals_.add(st, report, step > start_step_);
    judge_step(step, st);
    std::optional<double> val;
    nlohmann::json saved = nlohmann::json::object();
    if (!rollback_pending_) interrupted_ = after_step(step, val, saved);  // a step about to be undone saves nothing
    for (const auto& [k, v] : carried_.items()) saved[k] = v;             // a write a rollback waited for
    carried_ = nlohmann::json::object();
    if (saved.contains("checkpoint")) rollbacks_in_row_ = 0;
    if (!slow.empty()) saved["stragglers"] = slow;
    const bool end = !failure_.empty() || interrupted_;
    const bool log = step % s_.log_every == 0 || step + 1 == s_.steps || val || end || !saved.empty() || st.nonfinite ||
                     !st.skip_reason.empty() || rolled_back_from_ >= 0;
    step_wall_ = now() - t_step;  // with its evaluation and its checkpoint's time
    if (log)
      saved["batch_digest"] = s_.batch_digest();  // collective: `log` is the same on every rank
    else
      s_.forget_rows();
    if (io_ && log) log_step(step, st, comm, report, val, saved);
    rolled_back_from_ = -1;  // on every rank: `log` must stay the same everywhere
    if (end) break;
    if (rollback_pending_) {
      try {
        step = roll_back(step) - 1;       // the loop's ++ goes on from the checkpoint's step
      } catch (const AgreedFailure& e) {  // the write in flight of the checkpoint to return to failed
        failure_ = e.what();
        break;
      }
    }
  }
  try {
    checkpoints_.wait_for_write();  // checkpoint.async: the last write in flight
  } catch (const AgreedFailure& e) {
    if (failure_.empty()) failure_ = e.what();
  }
  check_the_end();
  if (!failure_.empty() && io_) write_stderr("loom: error: " + failure_);
  const std::vector<double> all_peaks = gather_rank_peaks();
  if (!io_) return exit_status();
  const std::map<std::string, double> means = totals_.report_means();
  const nlohmann::json summary = summary_json(all_peaks, means);
  write_json_atomic(s_.run_dir + "/summary.json", summary);
  write_report(summary);
  print_summary(summary, means);
  return exit_status();
}

}  // namespace

int command_run(const Deck& deck, const StrategyRegistry& registry) {
  TrainingRun run(deck, registry);
  return run.run();
}

}  // namespace loom
