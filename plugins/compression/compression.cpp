// The `compression` strategy plugin (libloom_compression.so): fewer bytes on the data-parallel wire.
// A deck asks for it with `compression.method = fp16 | bf16 | int8 | topk | powersgd` (no run.plugins
// line). It wraps the run's gradient reducer (data's all-reduce, or ZeRO's reduce-scatter where the
// method composes with it) and sees every bucket, its tensors and their shapes (DESIGN.md "The
// reducer chain and hooks"). The reducer produces the sum over the dp group, as the one it wraps
// does; the gradient sync divides by dp afterwards.
//
//   fp16, bf16  each bucket cast to 16 bits and reduced by the wrapped reducer in that type: the ring
//               adds the incoming 16-bit values in fp32 and rounds the partial sum back to 16 bits at
//               every step (core/comm/comm_mpi.cpp), then the result is cast back into the fp32 bucket
//               (PyTorch's fp16_compress_hook; the core's CastReducer). Half the bytes.
//   int8        error feedback added, then per chunk of compression.int8_chunk elements a step shared
//               by all ranks (one all-reduce max of the chunks' largest |x|) with floor(127/N) levels,
//               so that the int8 sum of N ranks cannot overflow; the int8 values are summed exactly by
//               the wrapped reducer (all-reduce or reduce-scatter), then scaled back. What rounding
//               dropped stays in the rank's residual for the next step.
//   topk        error feedback added, the compression.ratio largest |x| of each bucket kept, (index,
//               value) pairs all-gathered from every rank and added into a zeroed bucket in rank order
//               (the same sum on every rank); what was not sent stays in the residual. With
//               compression.warmup_steps = W the fraction kept falls from 1 at step 1 to the ratio at
//               step W + 1, exponentially (Deep Gradient Compression's sparsity warm-up); while it is
//               1/N or more, pairs would cost more than the sum, so the bucket (residual included) is
//               reduced whole by the wrapped reducer. compression.momentum_masking (AdamW without its
//               first moment) and compression.momentum_correction (the momentum accumulated here, per
//               rank, and masked where sent) are Deep Gradient Compression's momentum techniques adapted
//               to AdamW; compression.local_clip clips each rank's bucket before it is accumulated.
//   powersgd    Vogels et al. / PyTorch's powerSGD_hook: for each matrix of the bucket worth
//               compressing at rank r (compression.min_compression_rate), M = gradient + residual,
//               P = M Q (Q warm-started from the last step), all-reduce P, orthonormalise its columns,
//               Q = M^T P, all-reduce Q; the sum is approximated by P Q^T and each rank keeps
//               M - P Q^T / N as its residual. Vectors and matrices not worth it are all-reduced in
//               fp32, and so is every bucket for the first compression.start_step steps. The
//               vocabulary tables (wte, lm_head) are approximated at compression.embedding_rank
//               (unless set, 4 r where still worth it): their gradients are far from low-rank.
//
// Every method leaves every dp rank with the same sum, so every rank ends the step with the same
// parameters: a refresh-phase hook hashes them and compares over dp every step
// (compression_replicas_identical in the metrics).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <string>

#include "core/engine/checkpoint_part.hpp"
#include "core/comm/comm.hpp"
#include "core/base/error.hpp"
#include "core/comm/grid.hpp"
#include "core/engine/plugin.hpp"
#include "core/backend/tensor_hash.hpp"
#include "core/base/rng.hpp"
#include "plugins/compression/compress.hpp"

namespace loom {
namespace {

enum class Method { none, fp16, bf16, int8, topk, powersgd };

Method method_of(const std::string& m) {
  return m == "fp16"       ? Method::fp16
         : m == "bf16"     ? Method::bf16
         : m == "int8"     ? Method::int8
         : m == "topk"     ? Method::topk
         : m == "powersgd" ? Method::powersgd
                           : Method::none;
}

struct Config {
  Method method = Method::none;
  std::string method_name;
  double ratio = 0.01;
  int rank = 1;
  int embedding_rank = 0;  // powersgd: the vocabulary tables' rank (compression.embedding_rank; 0: rank_for)
  std::int64_t start_step = 1000;
  double min_rate = 2;
  std::int64_t chunk = 1024;
  bool error_feedback = true;
  bool warm_start = true;
  std::int64_t warmup_steps = 0;    // topk: sparsity warm-up
  bool momentum_correction = true;  // topk: the compressor's velocity, masked where sent (DGC)
  double momentum = 0.9;            // its factor: train.beta1
  double local_clip = 1;            // topk: each rank's bucket clipped before accumulation (DGC)
  std::uint64_t seed = 0;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// A request that runs `done` once, when the wrapped one (none: already complete) completes.
class ThenRequest final : public CommRequest {
 public:
  ThenRequest(CommRequestPtr inner, std::function<void()> done) : inner_(std::move(inner)), done_(std::move(done)) {}
  bool test() override {
    if (fired_) return true;
    if (inner_ && !inner_->test()) return false;
    fire();
    return true;
  }
  void wait() override {
    if (fired_) return;
    if (inner_) inner_->wait();
    fire();
  }

 private:
  void fire() {
    fired_ = true;
    if (done_) done_();
  }
  CommRequestPtr inner_;
  std::function<void()> done_;
  bool fired_ = false;
};

class CompressingReducer final : public Reducer, public CheckpointContributor {
 public:
  CompressingReducer(std::unique_ptr<Reducer> inner, const Config& cfg, Communicator& dp, BackendFace& be, GPT& model,
                     bool say)
      : cfg_(cfg), dp_(dp), be_(be), model_(model), say_(say) {
    // Every method runs on the back end (BackendFace::int8_*, topk_*, matmul, error feedback by copy,
    // residual_forward and axpy), where the gradients are, and keeps its state there; PowerSGD
    // orthogonalises its small P factors on the host (a copy of them there and back on a device).
    if (cfg.method == Method::fp16 || cfg.method == Method::bf16)
      inner_ =
          std::make_unique<CastReducer>(std::move(inner), be, cfg.method == Method::fp16 ? DType::f16 : DType::bf16);
    else
      inner_ = std::move(inner);
    // Error feedback keeps a residual per tensor this rank holds, which each bucket gathers and
    // scatters (the parts it holds: ZeRO-2/3 hand over pieces of tensors); PowerSGD a Q per matrix
    // it compresses. Both are made now, so that checkpoints list the same tensors from the start.
    feedback_ = cfg.error_feedback &&
                (cfg.method == Method::int8 || cfg.method == Method::topk || cfg.method == Method::powersgd);
    for (std::size_t i = 0; i < model.params().size(); ++i) {
      const ParamInfo& p = model.params()[i];
      if (p.expert) continue;  // an expert's under parallel.ep > 1: summed by the experts role, never here
      if (feedback_)
        residual_[static_cast<int>(i)] =
            be_.allocate("compression::residual." + p.name, DType::f32, p.numel(), Mem::comm);
      if (velocity_on()) {
        velocity_[static_cast<int>(i)] =
            be_.allocate("compression::velocity." + p.name, DType::f32, p.numel(), Mem::comm);  // zeroed, as residuals
      }
      if (cfg.method == Method::topk) clip_elements_ += p.numel();
      if (cfg.method == Method::powersgd && compressed(p)) {
        q_[static_cast<int>(i)] =
            be_.allocate("compression::powersgd_q." + p.name, DType::f32, p.local_shape()[1] * rank_of(p), Mem::comm);
        init_q(static_cast<int>(i), 0);
      }
    }
  }
  std::string name() const override {
    std::ostringstream s;
    s << cfg_.method_name;
    if (cfg_.method == Method::int8)
      s << " (chunks of " << cfg_.chunk << ", " << compress::int8_levels(dp_.size()) << " levels)";
    if (cfg_.method == Method::topk) {
      s << " (ratio " << cfg_.ratio
        << (cfg_.warmup_steps > 0 ? ", from 1 over " + std::to_string(cfg_.warmup_steps) + " steps" : std::string());
      if (velocity_on()) s << ", momentum correction " << cfg_.momentum;
      if (cfg_.local_clip > 0) s << ", local clipping at " << cfg_.local_clip;
      s << ")";
    }
    if (cfg_.method == Method::powersgd)
      s << " (rank " << cfg_.rank << ", vocabulary tables "
        << (vocabulary_rank() > 0 ? "rank " + std::to_string(vocabulary_rank()) : std::string("uncompressed"))
        << ", from step " << cfg_.start_step + 1 << ")";
    if (cfg_.method == Method::int8 || cfg_.method == Method::topk || cfg_.method == Method::powersgd)
      s << (cfg_.error_feedback ? ", error feedback" : ", no error feedback");
    return s.str() + " around " + inner_->name();
  }
  Reducer* inner() override { return inner_.get(); }

  void begin_step(std::int64_t step) {
    step_ = step;
    uncompressed_ = formula_ = seconds_ = 0;
    compressed_tensors_ = 0;
    at_start_ = dp_.stats();
  }
  // The bytes of the gradient collectives since the step began: all-reduces and reduce-scatters, and
  // top-k's all-gathers (ZeRO-3's parameter gathers in the same window are not gradient traffic; top-k
  // never runs with stage 3).
  void end_sync() {
    const CommStats& now = dp_.stats();
    auto sent = [&](CommOp op) {
      const int k = static_cast<int>(op);
      return static_cast<double>(now.bytes_sent[k] - at_start_.bytes_sent[k]);
    };
    sent_ = sent(CommOp::all_reduce) + sent(CommOp::reduce_scatter) +
            (cfg_.method == Method::topk ? sent(CommOp::all_gather) : 0.0);
  }
  void set_identical(double v) { identical_ = v; }
  // After the norm phase: a step that will not update (a non-finite loss or gradient, a loss-scale
  // overflow) has sent non-finite values on purpose (below) and left them in the residuals and Q:
  // start those afresh, the same on every rank, so that one bad step does not poison the rest.
  void after_norm(const StepState& st) {
    if (std::isfinite(st.sq_norm) && std::isfinite(st.loss) && st.skip_reason.empty() && !st.nonfinite) return;
    for (auto& [i, r] : residual_) be_.fill(r.ref(), 0.0);
    for (auto& [i, u] : velocity_) be_.fill(u.ref(), 0.0);
    for (auto& [k, s] : state_) {
      if (!s.residual.empty()) be_.fill(s.residual.ref(), 0.0);
      if (!s.velocity.empty()) be_.fill(s.velocity.ref(), 0.0);
    }
    for (auto& [i, q] : q_) init_q(i, 0);
    ++resets_;
  }

  CommRequestPtr reduce_async(const GradBucket& b) override {
    const double N = dp_.size(), n = static_cast<double>(b.data.count);
    // What the wrapped reducer moves in fp32: an all-reduce, or ZeRO's reduce-scatter.
    const double fp32_factor = b.rank_counts.empty() ? 2 * (N - 1) / N : (N - 1) / N;
    uncompressed_ += fp32_factor * 4 * n;
    const auto t0 = std::chrono::steady_clock::now();
    CommRequestPtr req;
    switch (cfg_.method) {
      case Method::fp16:
      case Method::bf16:
        formula_ += fp32_factor * 2 * n;
        req = inner_->reduce_async(b);
        break;
      case Method::int8:
        req = int8(b, fp32_factor);
        break;
      case Method::topk:
        req = topk(b, fp32_factor);
        break;
      case Method::powersgd:
        req = powersgd(b, fp32_factor);
        break;
      case Method::none:
        req = inner_->reduce_async(b);
        break;
    }
    seconds_ += seconds_since(t0);
    return req;
  }

  // `loom plan`: the cast methods and `none` are their inner reducer's. int8, top-k and PowerSGD add
  // the bucket's State, which stays from its first step (scratch that adds up over buckets), and their
  // own collectives; a blocking collective's ring scratch is counted with the bucket's own. PowerSGD
  // before compression.start_step is the plain inner reducer, whose scratch pool stays as well.
  BucketScratch plan_bucket(StepPlan& plan, const GradBucket& b, const std::string& what) const override {
    const std::string w = what + " (" + cfg_.method_name + ")";
    const int N = dp_.size();
    const std::int64_t n = b.data.count;
    // Error feedback's bucket-sized scratch: one shared by every bucket whose tensors are listed
    // (gather_residual: the largest such bucket's, added once by plan_step), else the bucket's own.
    const bool shared = feedback_ && has_residuals(b);
    const double residual = feedback_ && !shared ? 4.0 * static_cast<double>(n) : 0.0;  // State::residual
    const bool shared_velocity = velocity_on() && has_state(b, velocity_);              // and the velocity's, likewise
    const auto share = [&] {
      if (shared || shared_velocity) planned_shared_residual_ = std::max(planned_shared_residual_, n);
    };
    // Passes per element, by the code below (reads and writes, 4 bytes a float, 1 an int8): error
    // feedback gathers the residuals into the bucket's (8), adds them (12) and scatters them back
    // (8). (The replica hash is once a step: plan_step.)
    const double fb = feedback_ ? 28.0 : 0.0, elems = static_cast<double>(n);
    auto all_reduce = [&](const std::string& of, std::int64_t count) {
      plan.add_comm({dp_.name(), w + " " + of + " all-reduce",
                     ring_all_reduce_bytes(4.0 * static_cast<double>(count), N), 2.0 * (N - 1), false});
      return static_cast<double>(ring_all_reduce_scratch(count, N, sizeof(float)));
    };
    switch (cfg_.method) {
      case Method::int8: {
        const std::int64_t ch = compress::chunk_count(n, cfg_.chunk);
        plan.add_scratch(Mem::comm,
                         residual + 4.0 * static_cast<double>(ch + 1) + static_cast<double>(n));  // absmax, q
        share();
        const double maxima = all_reduce("chunk maxima", ch + 1);
        // finiteness (4) and chunk maxima (4) reads, quantising (read 4, int8 1, error 4), the
        // sum scaled back (int8 1, write 4): the back end's kernels
        plan.backend_bytes += elems * (fb + 4 + 4 + 9 + 5);
        GradBucket qb = b;
        qb.data = BufferRef(nullptr, DType::i8, n, b.data.space);
        BucketScratch s = inner_->plan_bucket(plan, qb, w + " int8 sum");
        s.blocking.push_back(maxima);  // dp_.all_reduce: complete before the sum starts
        return s;
      }
      case Method::topk: {
        BucketScratch dense;
        if (cfg_.warmup_steps > 0) {  // the warm-up's whole sums: their scratch stays, not their messages
          const std::size_t messages = plan.comm.size();
          dense = inner_->plan_bucket(plan, b, w);
          plan.comm.resize(messages);
        }
        // The send and receive buffers grow to the warm-up's largest k that travels as pairs.
        const double fp32_factor = b.rank_counts.empty() ? 2.0 * (N - 1) / N : (N - 1.0) / N;
        const std::int64_t k = compress::top_k_count(n, std::max(cfg_.ratio, largest_sparse_ratio(fp32_factor)));
        planned_topk_scratch_ = std::max(planned_topk_scratch_, be_.topk_scratch_bytes(n));  // the back end's, kept
        const double bytes = 8.0 * static_cast<double>(k);                                   // indices, values
        plan.add_scratch(Mem::comm, residual + bytes + bytes * N);                           // send, recv
        if (velocity_on() && !shared_velocity) plan.add_scratch(Mem::comm, 4.0 * static_cast<double>(n));
        share();
        plan.add_comm({dp_.name(), w + " all-gather", ring_all_gather_bytes(bytes * N, N), N - 1.0, false});
        // The back end's passes: the selection's reads of x (the host's finiteness, histogram,
        // members and write passes: 16; a device's three digit passes, count and write: 20, priced)
        // and its k pairs written; the unsent part kept (a copy, 8, and k entries cleared, with
        // feedback); the sum cleared (4) before each rank's k pairs are added (read 8, x 8).
        plan.backend_bytes +=
            elems * (fb + 20 + (feedback_ ? 8 : 0) + 4) + bytes * (feedback_ ? 2 : 1) + 2.0 * bytes * N;
        // Momentum correction: the velocity gathered (8), scaled (8), the gradient added (12), copied
        // into the bucket (8) and scattered back (8); local clipping: the norm (4) and the scaling (8).
        plan.backend_bytes += elems * ((velocity_on() ? 44 : 0) + (cfg_.local_clip > 0 ? 12 : 0));
        return dense;
      }
      case Method::powersgd: {
        BucketScratch s;
        if (cfg_.start_step > 0) {  // its scratch stays; its messages are not the steady state's
          const std::size_t messages = plan.comm.size();
          s = inner_->plan_bucket(plan, b, w);
          plan.comm.resize(messages);
        }
        const PowerSgdSplit split = powersgd_split(b);
        // Compressed matrices: P = M Q and Q = M^T P read M (8), M = P Q^T writes it (4), the residual
        // kept and made M - P Q^T / N (8 + 12, with feedback); the rest packed and unpacked (16): the
        // back end's. P orthogonalised on the host (Gram-Schmidt in double: each column read against
        // the earlier ones), on a device through a copy there and back.
        const double mats = elems - static_cast<double>(split.plain_total);
        const double p = static_cast<double>(split.p_total);
        plan.backend_bytes +=
            elems * fb + mats * (12 + (feedback_ ? 20 : 0)) + 16.0 * static_cast<double>(split.plain_total);
        for (const PowerSgdSplit::Mat& a : split.mats)
          plan.host_bytes += 8.0 * static_cast<double>(a.n * a.r) * (a.r + 1);
        plan.host_copy_bytes += 8.0 * p;
        plan.add_scratch(Mem::comm,
                         residual + 4.0 * static_cast<double>(split.plain_total + split.p_total + split.q_total));
        if (!split.mats.empty()) share();  // a bucket of plain tensors only never gathers its residuals
        // Each all-reduce completes before the next starts (dp_.all_reduce); the bucket's request is
        // complete when it returns.
        if (split.plain_total > 0) s.blocking.push_back(all_reduce("uncompressed tensors", split.plain_total));
        if (!split.mats.empty()) {
          s.blocking.push_back(all_reduce("P", split.p_total));
          s.blocking.push_back(all_reduce("Q", split.q_total));
        }
        return s;
      }
      default:
        return inner_->plan_bucket(plan, b, w);
    }
  }

  // `loom plan`: the replica hash of every step's refresh phase (replicas_identical), whatever the
  // method: it reads the parameters this rank holds whole, in order, through a host copy on a device,
  // and stops at the first the store keeps only in part.
  void plan_step(StepPlan& plan) const override {
    // After every bucket's plan_bucket (the planner's order): the shared error-feedback scratch.
    plan.add_scratch(Mem::comm, ((feedback_ ? 4.0 : 0.0) + (velocity_on() ? 4.0 : 0.0)) *
                                    static_cast<double>(planned_shared_residual_));
    planned_shared_residual_ = 0;
    plan.add_scratch(Mem::workspace, static_cast<double>(planned_topk_scratch_));
    planned_topk_scratch_ = 0;
    double bytes = 0;
    for (int i = 0; i < static_cast<int>(model_.params().size()); ++i) {
      const BufferRef p = model_.store().param(i);
      if (p.empty() && model_.params()[static_cast<std::size_t>(i)].numel() > 0) break;
      bytes += static_cast<double>(p.bytes());
    }
    plan.host_bytes += bytes;
    plan.host_copy_bytes += bytes;
  }

  std::vector<std::string> summary_lines(const std::map<std::string, double>& means) const override {
    if (!means.count("compression_ratio")) return {};
    const double identical = means.at("compression_replicas_identical");
    char line[1024];
    std::snprintf(line, sizeof line,
                  "compression: sent %s per step against the fp32 collective's %s (ratio %.4f; the method's\n"
                  "         formula %.4f), %.2f ms per step compressing; dp replicas identical after %s",
                  format_bytes(means.at("compression_bytes")).c_str(),
                  format_bytes(means.at("compression_uncompressed_bytes")).c_str(), means.at("compression_ratio"),
                  means.at("compression_formula_ratio"), 1e3 * means.at("compression_seconds"),
                  identical == 1  ? "every step"
                  : identical < 0 ? "(not checked: parameters kept in shares)"
                                  : "NOT every step");
    return {line};
  }

  std::vector<std::pair<std::string, double>> step_report() const override {
    return {{"compression_bytes", sent_},
            {"compression_uncompressed_bytes", uncompressed_},
            {"compression_ratio", uncompressed_ > 0 ? sent_ / uncompressed_ : 0.0},
            {"compression_formula_bytes", formula_},
            {"compression_formula_ratio", uncompressed_ > 0 ? formula_ / uncompressed_ : 0.0},
            {"compression_seconds", seconds_},
            {"compression_compressed_tensors", static_cast<double>(compressed_tensors_)},
            {"compression_replicas_identical", identical_},
            {"compression_state_resets", static_cast<double>(resets_)}};
  }

 private:
  // Per bucket (by what it holds: its first tensor and where in it, and its size, so that ZeRO-2/3's
  // pieces, given new indices every micro-batch, find theirs again): the method's scratch, and the
  // error feedback of a bucket whose tensors are not listed (kept from step to step: it is the
  // bucket's only copy).
  struct State {
    std::int64_t count = -1;
    TypedBuffer residual, absmax, q, send, recv, packed, velocity;
  };
  State& state(const GradBucket& b) {
    State& s =
        b.tensors.empty() ? state_[{-1 - b.index, 0}] : state_[{b.tensors.front().param, b.tensors.front().begin}];
    if (s.count != b.data.count) {
      s = State();
      s.count = b.data.count;
      if (feedback_ && !has_residuals(b))
        s.residual = be_.allocate("compression::bucket_residual", DType::f32, b.data.count, Mem::comm);
    }
    return s;
  }
  // This call's error feedback for bucket b, [n] floats (empty without feedback). A bucket whose
  // tensors are listed gathers the parts of the per-tensor residuals it holds into one scratch that
  // every bucket shares: each method reads it and writes the new residual before reduce_async returns
  // (int8 and top-k before they start their collective, PowerSGD's all-reduces block), and
  // keep_residual scatters it back, so no bucket needs it afterwards. A bucket without keeps its own.
  BufferRef gather_residual(const GradBucket& b, State& s) {
    if (!feedback_) return {};
    if (!has_residuals(b)) return s.residual.ref();
    return gather_state(b, residual_, shared_residual_, "compression::bucket_residual");
  }
  // Momentum correction's velocity for bucket b, the same way (a bucket without listed tensors keeps
  // its own, from zero).
  BufferRef gather_velocity(const GradBucket& b, State& s) {
    if (has_state(b, velocity_)) return gather_state(b, velocity_, shared_velocity_, "compression::bucket_velocity");
    if (s.velocity.empty()) {
      s.velocity = be_.allocate("compression::bucket_velocity", DType::f32, b.data.count, Mem::comm);
      be_.fill(s.velocity.ref(), 0.0);
    }
    return s.velocity.ref();
  }
  // The parts of per-tensor state `by` that bucket b holds, into `shared` (grown to the largest bucket).
  BufferRef gather_state(const GradBucket& b, std::map<int, TypedBuffer>& by, TypedBuffer& shared, const char* label) {
    const std::int64_t n = b.data.count;
    if (shared.count() < n) {
      shared = TypedBuffer();  // released first: the ledger's peak is the largest bucket's, as planned
      shared = be_.allocate(label, DType::f32, n, Mem::comm);
    }
    const BufferRef e = shared.ref().slice(0, n);
    std::int64_t covered = 0;
    for (const GradBucket::Tensor& t : b.tensors) covered += t.count;
    if (covered != n) be_.fill(e, 0.0);  // elements of no listed tensor: no state (zero), as a bucket's own
    for (const GradBucket::Tensor& t : b.tensors)
      be_.copy(e.slice(t.offset, t.count), by.at(t.param).ref().slice(t.begin, t.count), t.count);
    return e;
  }
  // After the method wrote the bucket's new residual into e: back into the per-tensor residuals.
  void keep_residual(const GradBucket& b, const BufferRef& e) {
    if (!e.empty() && has_residuals(b)) keep_state(b, residual_, e);
  }
  void keep_state(const GradBucket& b, std::map<int, TypedBuffer>& by, const BufferRef& e) {
    for (const GradBucket::Tensor& t : b.tensors)
      be_.copy(by.at(t.param).ref().slice(t.begin, t.count), e.slice(t.offset, t.count), t.count);
  }
  bool has_residuals(const GradBucket& b) const { return has_state(b, residual_); }
  bool has_state(const GradBucket& b, const std::map<int, TypedBuffer>& by) const {
    if (b.tensors.empty()) return false;
    for (const GradBucket::Tensor& t : b.tensors)
      if (!by.count(t.param) || t.begin + t.count > by.at(t.param).count()) return false;
    return true;
  }
  bool velocity_on() const { return cfg_.method == Method::topk && cfg_.momentum_correction; }
  void add_residual(const BufferRef& e, const BufferRef& x, std::int64_t n) {
    if (!e.empty()) be_.residual_forward(x, x, e, n);  // x += residual
  }
  bool compressed(const ParamInfo& p) const {
    return p.local_shape().size() == 2 &&
           compress::worth_compressing(p.local_shape()[0], p.local_shape()[1], rank_of(p), cfg_.min_rate);
  }
  // A matrix's PowerSGD rank. The vocabulary tables (the token table, tied to the output layer or not,
  // and an untied output layer) get their own: their gradient, the sum over every token of an outer
  // product with its row (and its softmax's row), is far from low-rank, and at the blocks' rank they
  // carried most of the loss PowerSGD cost (docs/parallel.md, "PowerSGD's vocabulary tables").
  int rank_of(const ParamInfo& p) const { return rank_for(p.name, p.local_shape()); }
  int rank_for(const std::string& name, const std::vector<std::int64_t>& shape) const {
    if (shape.size() != 2) return cfg_.rank;
    const std::int64_t n = shape[0], m = shape[1];
    int r = cfg_.rank;
    if (name == "wte.weight" || name == "lm_head.weight") {
      r = cfg_.embedding_rank;
      if (r == 0) {  // 4 x the blocks', lowered (not below theirs) to a rank still worth compressing
        r = 4 * cfg_.rank;
        while (r > cfg_.rank && !compress::worth_compressing(n, m, r, cfg_.min_rate)) --r;
      }
    }
    return static_cast<int>(std::min<std::int64_t>(r, std::min(n, m)));  // PyTorch's hook: min(n, m, rank)
  }
  // The token table's rank, 0 where it is not compressed (the untied output layer has its shape).
  int vocabulary_rank() const { return table_rank(0); }
  // The whole token table's rank at compression.rank `rank` (0: this run's rank_for), capped at
  // min(n, m); 0 where that is not worth compressing.
  int table_rank(int rank) const {
    for (const ParamInfo& p : model_.all_params())
      if (p.name == "wte.weight") {
        const std::int64_t n = p.shape()[0], m = p.shape()[1];
        const int r =
            rank > 0 ? static_cast<int>(std::min<std::int64_t>(rank, std::min(n, m))) : rank_for(p.name, p.shape());
        return compress::worth_compressing(n, m, r, cfg_.min_rate) ? r : 0;
      }
    return 0;
  }

  CommRequestPtr int8(const GradBucket& b, double fp32_factor) {
    const double N = dp_.size();
    const std::int64_t n = b.data.count, ch = compress::chunk_count(n, cfg_.chunk);
    const int levels = compress::int8_levels(dp_.size());
    State& s = state(b);
    const BufferRef x = b.data;
    const BufferRef e = gather_residual(b, s);
    add_residual(e, x, n);
    ensure_capacity(be_, s.absmax, "compression::int8_absmax", DType::f32, ch + 1, Mem::comm);
    ensure_capacity(be_, s.q, "compression::int8_values", DType::i8, n, Mem::comm);
    const BufferRef amax = s.absmax.ref().slice(0, ch + 1);
    // The chunk maxima, and one more element: 1 where this rank holds a NaN or an inf, so that every
    // rank learns of it.
    be_.int8_absmax(amax, x, n, cfg_.chunk);
    dp_.all_reduce(amax, ReduceOp::max);  // one step per chunk for every rank
    be_.int8_quantize(s.q.ref(), e, x, n, cfg_.chunk, amax, levels);
    keep_residual(b, e);
    formula_ += 2 * (N - 1) / N * 4 * static_cast<double>(ch + 1) + fp32_factor * static_cast<double>(n);
    GradBucket qb = b;
    qb.data = s.q.ref().slice(0, n);
    const BufferRef q = qb.data;
    const std::int64_t chunk = cfg_.chunk;
    BackendFace* be = &be_;
    // The exact int8 sum, scaled back. A non-finite value on any rank (the all-reduced flag) makes
    // the whole sum NaN on every rank: the step is then not finite everywhere (skipped, or an fp16
    // overflow), as it would be uncompressed.
    return std::make_unique<ThenRequest>(inner_->reduce_async(qb), [be, x, q, n, chunk, amax, levels] {
      be->int8_dequantize(x, q, n, chunk, amax, levels);
    });
  }

  // The fraction of a bucket top-k sends at `step` (from 0, as StepState counts): compression.ratio,
  // or during the sparsity warm-up ratio^(step / W), from 1 at the first step to the ratio at step W
  // (step W + 1 in the run's messages).
  double ratio_at(std::int64_t step) const {
    if (cfg_.warmup_steps <= 0 || step >= cfg_.warmup_steps) return cfg_.ratio;
    return std::pow(cfg_.ratio,
                    static_cast<double>(std::max<std::int64_t>(step, 0)) / static_cast<double>(cfg_.warmup_steps));
  }
  // Pairs cost 8k (N - 1) bytes a rank, the wrapped reducer's fp32 sum fp32_factor 4n (an
  // all-reduce's 2 (N - 1) / N, ZeRO's reduce-scatter's (N - 1) / N): from the fraction where pairs
  // cost as much (1/N, 1/2N) the sum is sent.
  bool dense_at(double ratio, double fp32_factor) const { return 8.0 * ratio * (dp_.size() - 1) >= 4.0 * fp32_factor; }
  // The warm-up's largest fraction that travels as pairs (0 without a warm-up).
  // The fraction falls with the step: the first sparse step, found by bisection (warmup_steps may be large).
  double largest_sparse_ratio(double fp32_factor) const {
    if (cfg_.warmup_steps <= 0) return 0;
    std::int64_t lo = 0, hi = cfg_.warmup_steps;  // ratio_at(warmup_steps) = ratio: sparse unless 1/N or more
    if (dense_at(ratio_at(hi), fp32_factor)) return 0;
    while (lo < hi) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      if (dense_at(ratio_at(mid), fp32_factor))
        lo = mid + 1;
      else
        hi = mid;
    }
    return ratio_at(lo);
  }

  CommRequestPtr topk(const GradBucket& b, double fp32_factor) {
    const int N = dp_.size();
    const double ratio = ratio_at(step_);
    const std::int64_t n = b.data.count, k = compress::top_k_count(n, ratio);
    State& s = state(b);
    const BufferRef x = b.data;
    if (cfg_.local_clip > 0) {  // DGC: each rank's share of the clipping threshold, before accumulating
      const double most = cfg_.local_clip * std::sqrt(static_cast<double>(n) /
                                                      static_cast<double>(std::max<std::int64_t>(clip_elements_, n)) /
                                                      static_cast<double>(N));
      const NormCheck c = be_.sq_norm_check({x});
      if (c.all_finite && c.sum_squares > most * most) be_.scale(x, most / std::sqrt(c.sum_squares));
    }
    // Momentum correction: u = momentum u + (1 - momentum) g, accumulated by the error feedback in
    // place of the gradient (AdamW, without its first moment, takes what arrives as its momentum).
    BufferRef u;
    if (velocity_on()) {
      u = gather_velocity(b, s);
      be_.scale(u, cfg_.momentum);
      be_.axpy(u, static_cast<float>(1.0 - cfg_.momentum), x, n);
      be_.copy(x, u, n);
    }
    const BufferRef e = gather_residual(b, s);
    add_residual(e, x, n);
    if (dense_at(ratio, fp32_factor)) {  // the warm-up's first steps: the whole bucket, residual included, is sent
      if (!e.empty()) {
        be_.fill(e, 0.0);
        keep_residual(b, e);
      }
      // Every element was sent, so every element's velocity is masked, as on the sparse path: the
      // warm-up's whole steps then send (1 - beta1) g, AdamW without momentum. Keeping the velocity
      // instead (momentum through the whole steps) measured worse: the GPL-3 deck of
      // bench/compression_learning.py, seeds 1 and 2, +4.0% and +4.2% against +3.0% and +3.3%.
      if (!u.empty()) {
        be_.fill(u, 0.0);
        if (has_state(b, velocity_)) keep_state(b, velocity_, u);
      }
      formula_ += fp32_factor * 4 * static_cast<double>(n);
      return inner_->reduce_async(b);
    }
    const std::int64_t bytes = 8 * k;  // k int32 indices, then k fp32 values
    ensure_capacity(be_, s.send, "compression::topk_send", DType::u8, bytes, Mem::comm);
    ensure_capacity(be_, s.recv, "compression::topk_recv", DType::u8, bytes * N, Mem::comm);
    const MemSpace space = be_.space();
    const BufferRef idx(reinterpret_cast<std::int32_t*>(s.send.data<std::uint8_t>()), k, space);
    const BufferRef val(reinterpret_cast<float*>(s.send.data<std::uint8_t>() + 4 * k), k, space);
    // NaN/inf has no order: the back end then sends NaNs, so that every rank's sum is non-finite
    // (see int8).
    be_.topk_select(idx, val, x, n, k);
    if (!e.empty()) {  // what is not sent stays for the next step
      be_.copy(e, x, n);
      be_.topk_clear(e, idx, k);
      keep_residual(b, e);
    }
    if (!u.empty()) {  // momentum-factor masking: the velocity of what was sent starts again
      be_.topk_clear(u, idx, k);
      if (has_state(b, velocity_)) keep_state(b, velocity_, u);
    }
    formula_ += static_cast<double>(N - 1) * static_cast<double>(bytes);
    std::uint8_t* recv = s.recv.data<std::uint8_t>();
    BackendFace* be = &be_;
    return std::make_unique<ThenRequest>(
        dp_.all_gather_async(s.send.ref().slice(0, bytes), s.recv.ref().slice(0, bytes * N)),
        [be, x, n, k, N, recv, space] {
          be->fill(x.slice(0, n), 0.0);
          for (int r = 0; r < N; ++r) {  // rank order: the same sum on every rank
            const std::uint8_t* at = recv + static_cast<std::int64_t>(r) * 8 * k;
            be->topk_scatter_add(x, BufferRef(reinterpret_cast<const std::int32_t*>(at), k, space),
                                 BufferRef(reinterpret_cast<const float*>(at + 4 * k), k, space), k);
          }
        });
  }

  // Q of a compressed matrix [m, r] from (seed, name, element), the same on every rank; without warm
  // start drawn afresh every step.
  void init_q(int param, std::int64_t step) {
    const ParamInfo& p = model_.params()[static_cast<std::size_t>(param)];
    TypedBuffer& q = q_.at(param);
    const std::uint64_t stream = rng::hash_name(p.name);
    const std::uint64_t salt = static_cast<std::uint64_t>(step) * 0x9e3779b97f4a7c15ULL;
    std::vector<float> d(static_cast<std::size_t>(q.count()));
    for (std::int64_t i = 0; i < q.count(); ++i)
      d[static_cast<std::size_t>(i)] =
          static_cast<float>(rng::normal(cfg_.seed ^ salt, stream, static_cast<std::uint64_t>(i)));
    be_.copy_from_host(q.ref(), d.data());
  }
  float* q_of(const GradBucket::Tensor& t) {
    if (!cfg_.warm_start) init_q(t.param, step_);
    return q_.at(t.param).data<float>();
  }

  // A bucket's whole matrices with a Q (compressed: P [n, r] and Q [m, r] at their offsets in the
  // packed P and Q buffers) and the rest (one packed fp32 all-reduce).
  struct PowerSgdSplit {
    struct Mat {
      const GradBucket::Tensor* t;
      std::int64_t n, m, p_at, q_at;
      int r;  // its rank (rank_of)
    };
    std::vector<Mat> mats;
    std::vector<const GradBucket::Tensor*> plain;
    std::int64_t p_total = 0, q_total = 0, plain_total = 0;
  };
  PowerSgdSplit powersgd_split(const GradBucket& b) const {
    PowerSgdSplit s;
    for (const GradBucket::Tensor& t : b.tensors) {
      const ParamInfo& p = model_.params()[static_cast<std::size_t>(t.param)];
      if (t.count == p.numel() && q_.count(t.param)) {
        const int r = rank_of(p);
        s.mats.push_back({&t, t.shape[0], t.shape[1], s.p_total, s.q_total, r});
        s.p_total += t.shape[0] * r;
        s.q_total += t.shape[1] * r;
      } else {
        s.plain.push_back(&t);
        s.plain_total += t.count;
      }
    }
    return s;
  }

  // Every compressed matrix's P [n, r] made orthonormal (compress::orthogonalize, in double on the
  // host): in place on the host, through one copy of the packed P there and back on a device.
  void orthogonalize_all(const std::vector<PowerSgdSplit::Mat>& mats, const BufferRef& P) {
    const bool device = P.space != MemSpace::host;
    if (device) {
      p_host_.resize(static_cast<std::size_t>(P.count));
      be_.copy_to_host(p_host_.data(), P);
    }
    float* h = device ? p_host_.data() : P.as<float>();
    for (const PowerSgdSplit::Mat& a : mats) compress::orthogonalize(h + a.p_at, static_cast<int>(a.n), a.r);
    if (device) be_.copy_from_host(P, p_host_.data());
  }

  CommRequestPtr powersgd(const GradBucket& b, double fp32_factor) {
    const double N = dp_.size();
    if (step_ < cfg_.start_step) {  // plain fp32 at first (PyTorch's start_powerSGD_iter)
      formula_ += fp32_factor * 4 * static_cast<double>(b.data.count);
      return inner_->reduce_async(b);
    }
    State& s = state(b);
    const BufferRef x = b.data;
    using Mat = PowerSgdSplit::Mat;
    const PowerSgdSplit split = powersgd_split(b);
    const std::vector<PowerSgdSplit::Mat>& mats = split.mats;
    const std::vector<const GradBucket::Tensor*>& plain = split.plain;
    const std::int64_t p_total = split.p_total, q_total = split.q_total, plain_total = split.plain_total;
    compressed_tensors_ += static_cast<std::int64_t>(mats.size());
    formula_ += 2 * (N - 1) / N * 4 * static_cast<double>(plain_total + p_total + q_total);
    // Vectors and matrices not worth compressing: one fp32 all-reduce of them packed together.
    if (plain_total > 0) {
      ensure_capacity(be_, s.packed, "compression::powersgd_plain", DType::f32, plain_total, Mem::comm);
      const BufferRef pk = s.packed.ref();
      std::int64_t at = 0;
      for (const auto* t : plain) {
        be_.copy(pk.slice(at, t->count), x.slice(t->offset, t->count), t->count);
        at += t->count;
      }
      dp_.all_reduce(pk.slice(0, plain_total), ReduceOp::sum);
      at = 0;
      for (const auto* t : plain) {
        be_.copy(x.slice(t->offset, t->count), pk.slice(at, t->count), t->count);
        at += t->count;
      }
    }
    if (mats.empty()) return std::make_unique<ThenRequest>(nullptr, nullptr);
    ensure_capacity(be_, s.send, "compression::powersgd_p", DType::f32, p_total, Mem::comm);
    ensure_capacity(be_, s.recv, "compression::powersgd_q", DType::f32, q_total, Mem::comm);
    const BufferRef P = s.send.ref().slice(0, p_total);
    const BufferRef Qs = s.recv.ref().slice(0, q_total);
    const BufferRef e = gather_residual(b, s);
    // The matrices, P, Q and the residuals are the back end's: each a slice of its buffer.
    const auto M_of = [&](const Mat& a) { return x.slice(a.t->offset, a.n * a.m); };
    const auto e_of = [&](const Mat& a) { return e.slice(a.t->offset, a.n * a.m); };
    const auto P_of = [&](const Mat& a) { return P.slice(a.p_at, a.n * a.r); };
    for (const Mat& a : mats) {  // M = g + e (kept in the residual buffer), P = M Q
      const BufferRef M = M_of(a);
      if (!e.empty()) be_.residual_forward(M, M, e_of(a), a.n * a.m);
      be_.matmul(P_of(a), M, BufferRef(q_of(*a.t), a.m * a.r, be_.space()), static_cast<int>(a.n), a.r,
                 static_cast<int>(a.m), false, false);
    }
    dp_.all_reduce(P, ReduceOp::sum);
    orthogonalize_all(mats, P);
    for (const Mat& a : mats)  // Q = M^T P
      be_.matmul(Qs.slice(a.q_at, a.m * a.r), M_of(a), P_of(a), static_cast<int>(a.m), a.r, static_cast<int>(a.n), true,
                 false);
    dp_.all_reduce(Qs, ReduceOp::sum);
    for (const Mat& a : mats) {  // the sum ~ P Q^T; residual = M - P Q^T / N
      const BufferRef M = M_of(a);
      const BufferRef q = q_.at(a.t->param).ref().slice(0, a.m * a.r);
      be_.copy(q, Qs.slice(a.q_at, a.m * a.r), a.m * a.r);  // warm start
      if (!e.empty()) be_.copy(e_of(a), M, a.n * a.m);
      be_.matmul(M, P_of(a), q, static_cast<int>(a.n), static_cast<int>(a.m), a.r, false, true);
      if (!e.empty()) be_.axpy(e_of(a), -1.0f / static_cast<float>(N), M, a.n * a.m);  // e = M - P Q^T / N
    }
    keep_residual(b, e);
    return std::make_unique<ThenRequest>(nullptr, nullptr);
  }

 public:
  // Checkpoints: each rank's residual of every tensor as row dp_rank of a [dp, n] dataset (the path
  // names dp: another dp size finds none and starts from zero), and PowerSGD's Q, equal over dp,
  // written by dp rank 0. Neither is required: a file without them leaves them as they are.
  std::string checkpoint_name() const override { return "compression (" + cfg_.method_name + ")"; }
  std::vector<CheckpointTensor> checkpoint_tensors() override {
    std::vector<CheckpointTensor> out;
    const std::int64_t N = dp_.size(), r = dp_.rank();
    const bool feedback = !residual_.empty();
    // With pipeline stages the last stage holds a shadow of wte whose gradient (the head's part)
    // differs from the first stage's (the embedding's): its state goes under "<name>#head".
    const bool shadow_wte = model_.stage().count > 1 && model_.config().tied();
    auto local = [&](const std::string& name, bool head) {
      const int i = model_.param_index(name);
      if (i < 0 || model_.params()[static_cast<std::size_t>(i)].shadow != head) return -1;
      return i;
    };
    auto add = [&](const ParamInfo& whole, const std::string& suffix, int i) {
      const std::int64_t n = whole.shard.full_numel();
      // Per rank, one row each: the error-feedback residual and momentum correction's velocity.
      auto rows = [&](const char* kind, const std::map<int, TypedBuffer>& by) {
        CheckpointTensor t;
        t.path = "/plugins/compression/" + std::string(kind) + "_dp" + std::to_string(N) + "/" + whole.name + suffix;
        t.shard = ShardDesc::make({N, n}, TpSplit::none, 1, 0);
        if (i >= 0 && by.count(i)) {
          t.shard = t.shard.cut(r * n, (r + 1) * n);
          t.data = by.at(i).ref();
          t.holds = true;
          t.primary_end = n;  // the rank's own row
        }
        t.required = false;
        out.push_back(std::move(t));
      };
      if (feedback) rows("residual", residual_);
      if (!velocity_.empty()) rows("velocity", velocity_);
      const int rank = rank_of(whole);
      if (cfg_.method == Method::powersgd && whole.shape().size() == 2 &&
          compress::worth_compressing(whole.shape()[0], whole.shape()[1], rank, cfg_.min_rate)) {
        CheckpointTensor t;
        t.path = "/plugins/compression/q_rank" + std::to_string(rank) + "/" + whole.name + suffix;
        t.shard = ShardDesc::make({whole.shape()[1], rank}, TpSplit::none, 1, 0);
        if (i >= 0 && q_.count(i)) {
          t.data = q_.at(i).ref();
          t.holds = true;
          if (r == 0) t.primary_end = t.data.count;
        }
        t.required = false;
        out.push_back(std::move(t));
      }
    };
    for (const ParamInfo& whole : model_.all_params()) {
      add(whole, "", local(whole.name, false));
      if (shadow_wte && whole.name == "wte.weight") add(whole, "#head", local(whole.name, true));
    }
    return out;
  }
  std::map<std::string, double> checkpoint_attributes() const override {
    std::map<std::string, double> a{{"compression_dp", static_cast<double>(dp_.size())}};
    if (cfg_.method == Method::powersgd) {
      a["compression_powersgd_rank"] = cfg_.rank;
      a["compression_powersgd_embedding_rank"] = vocabulary_rank();
    }
    return a;
  }
  void restore_attributes(const std::map<std::string, double>& found) override {
    const auto dp = found.find("compression_dp");
    // Q's datasets name their rank (q_rank<r>): at another compression.rank none is found and Q keeps
    // its initial draw, which a user who changed the rank on resume should be told.
    // Likewise the vocabulary tables' at another compression.embedding_rank (a checkpoint written before
    // that key held them at compression.rank).
    const auto q_rank = found.find("compression_powersgd_rank");
    const bool q_continues = q_rank == found.end() || static_cast<int>(q_rank->second) == cfg_.rank;
    if (say_ && !q_continues)
      std::printf(
          "  compression: the checkpoint's PowerSGD Q has compression.rank = %d: at compression.rank = %d "
          "Q starts from its initial draw\n",
          static_cast<int>(q_rank->second), cfg_.rank);
    bool tables_continue = true;
    if (q_rank != found.end() && cfg_.method == Method::powersgd && vocabulary_rank() > 0) {
      const auto e = found.find("compression_powersgd_embedding_rank");
      // A checkpoint written before compression.embedding_rank held the table at compression.rank.
      const int was = e != found.end() ? static_cast<int>(e->second) : table_rank(static_cast<int>(q_rank->second));
      tables_continue = was == vocabulary_rank();
      if (say_ && !tables_continue && was > 0)
        std::printf(
            "  compression: the checkpoint's PowerSGD Q of the vocabulary tables has rank %d: at rank %d "
            "(compression.embedding_rank) their Q starts from its initial draw\n",
            was, vocabulary_rank());
      else if (say_ && !tables_continue)
        std::printf(
            "  compression: the checkpoint holds no PowerSGD Q of the vocabulary tables (sent uncompressed): at "
            "rank %d (compression.embedding_rank) their Q starts from its initial draw\n",
            vocabulary_rank());
    }
    if (residual_.empty() || !say_) return;
    if (dp == found.end())
      std::printf(
          "  compression: the checkpoint holds no compression state: error-feedback residuals start from zero\n");
    else if (static_cast<int>(dp->second) != dp_.size())
      std::printf(
          "  compression: the checkpoint was written at %d data-parallel ranks (dp x cp): error-feedback residuals "
          "(one per rank) start from zero at %d%s%s\n",
          static_cast<int>(dp->second), dp_.size(), velocity_.empty() ? "" : ", and so do the velocities",
          cfg_.method == Method::powersgd && q_continues && tables_continue ? "; PowerSGD's Q continues" : "");
  }

 private:
  Config cfg_;
  std::unique_ptr<Reducer> inner_;
  Communicator& dp_;
  BackendFace& be_;
  std::vector<float> p_host_;  // PowerSGD's P on the host for its orthogonalisation, on a device back end
  GPT& model_;
  bool say_;  // this rank prints notes (world rank 0)
  std::map<std::pair<int, std::int64_t>, State>
      state_;                                         // by (first tensor, its begin); (-1 - index, 0) without tensors
  std::map<int, TypedBuffer> residual_, q_;           // by parameter index
  std::map<int, TypedBuffer> velocity_;               // momentum correction's, by parameter index
  std::int64_t clip_elements_ = 0;                    // local clipping: the elements the reducer sees
  TypedBuffer shared_residual_;                       // error feedback's bucket-sized scratch (gather_residual)
  TypedBuffer shared_velocity_;                       // momentum correction's (gather_velocity)
  mutable std::int64_t planned_shared_residual_ = 0;  // `loom plan`: its elements, the largest bucket's so far
  mutable std::int64_t planned_topk_scratch_ = 0;     // `loom plan`: the back end's selection scratch, likewise
  std::int64_t step_ = 0;
  CommStats at_start_;
  double sent_ = 0, uncompressed_ = 0, formula_ = 0, seconds_ = 0, identical_ = -1;
  std::int64_t compressed_tensors_ = 0, resets_ = 0;
  bool feedback_ = false;
};

// Whether every dp rank holds the same parameters: a hash of this rank's whole tensors compared over
// dp (the largest and the smallest agree). -1 when the store keeps some tensors only in part. Experts
// split over ep ranks (ParamInfo::expert) differ between dp ranks by design: not hashed.
double replicas_identical(GPT& model, Communicator& dp) {
  ParamStore& store = model.store();
  std::uint64_t h = 0xcbf29ce484222325ULL;
  std::vector<unsigned char> copy;
  for (int i = 0; i < static_cast<int>(model.params().size()); ++i) {
    if (model.params()[static_cast<std::size_t>(i)].expert) continue;
    const BufferRef p = store.param(i);
    if (p.empty() && model.params()[static_cast<std::size_t>(i)].numel() > 0) return -1;
    h = hash_tensor(model.backend(), p, copy, h);
  }
  double v[4] = {static_cast<double>(h >> 32), static_cast<double>(h & 0xffffffffULL), -static_cast<double>(h >> 32),
                 -static_cast<double>(h & 0xffffffffULL)};
  dp.all_reduce(BufferRef(v, 4), ReduceOp::max);
  return v[0] == -v[2] && v[1] == -v[3] ? 1.0 : 0.0;
}

// The keys that apply to each method; one set for another method is ignored, and the run says so.
const std::map<std::string, std::vector<std::string>>& method_keys() {
  static const std::map<std::string, std::vector<std::string>> keys = {
      {"compression.ratio", {"topk"}},
      {"compression.warmup_steps", {"topk"}},
      {"compression.momentum_masking", {"topk"}},
      {"compression.momentum_correction", {"topk"}},
      {"compression.local_clip", {"topk"}},
      {"compression.rank", {"powersgd"}},
      {"compression.embedding_rank", {"powersgd"}},
      {"compression.start_step", {"powersgd"}},
      {"compression.min_compression_rate", {"powersgd"}},
      {"compression.warm_start", {"powersgd"}},
      {"compression.int8_chunk", {"int8"}},
      {"compression.error_feedback", {"int8", "topk", "powersgd"}}};
  return keys;
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : sep) + x;
  return s;
}

// `loom plan`: where the gradients travel in fp32, bf16 compression halves the dp synchronisation's bytes.
PlanTerms compression_plan_terms() {
  PlanTerms t;
  t.levers = [](const std::string& bottleneck, const PlanPoint& p) -> std::vector<PlanLever> {
    if (bottleneck != "dp" || p.precision != "fp32") return {};  // the predicted operand type, not another's key
    return {{"bf16 gradient compression (compression.method = bf16), half the bytes", {"compression.method=bf16"}}};
  };
  return t;
}

void register_compression(void* p) {
  auto& info = *static_cast<StrategyInfo*>(p);
  info.keys.push_back(choice_key("compression.method", "none", {"none", "fp16", "bf16", "int8", "topk", "powersgd"},
                                 "data-parallel gradient compression: none, fp16/bf16 (cast, PyTorch's "
                                 "fp16_compress_hook), int8 (shared per-chunk steps, error feedback), topk (largest "
                                 "magnitudes, error feedback), powersgd (low-rank, error feedback)"));
  info.keys.push_back(float_key("compression.ratio", "0.01", 1e-6, 1,
                                "topk: the fraction of each bucket's elements sent (largest |gradient + residual|)"));
  info.keys.push_back(int_key("compression.warmup_steps", "0", 0, 1e12,
                              "topk: sparsity warm-up (Deep Gradient Compression's): the fraction sent falls "
                              "exponentially from all of each bucket at step 1 to compression.ratio at step "
                              "warmup_steps + 1; while it is 1/dp or more the bucket is summed whole (0: the ratio "
                              "from the start)"));
  info.keys.push_back(bool_key("compression.momentum_masking", "false",
                               "topk: AdamW without its first moment (beta1 = 0), so that an arrival (the sum of "
                               "many steps' gradients) moves its elements once, not again for the steps after it: "
                               "DGC's momentum-factor masking adapted to AdamW"));
  info.keys.push_back(bool_key("compression.momentum_correction", "true",
                               "topk: each rank accumulates the momentum, u = beta1 u + (1 - beta1) g (train.beta1), "
                               "in place of the gradient, and clears it where sent; AdamW then runs without its "
                               "first moment: DGC's momentum correction and masking adapted to AdamW"));
  info.keys.push_back(float_key("compression.local_clip", "1", 0, 1e12,
                                "topk: each rank's bucket clipped to L2 norm local_clip x sqrt(bucket share of the "
                                "elements / dp) before it is accumulated (DGC's local gradient clipping; 0: off)"));
  info.keys.push_back(int_key("compression.rank", "1", 1, 1024,
                              "powersgd: the rank of each matrix's approximation (PyTorch matrix_approximation_rank); "
                              "the vocabulary tables' is compression.embedding_rank"));
  info.keys.push_back(int_key("compression.embedding_rank", "0", 0, 1024,
                              "powersgd: the rank of the vocabulary tables (the token table and an untied output "
                              "layer), whose gradients are far from low-rank (0: 4 x compression.rank, lowered to "
                              "the largest rank still worth compressing, not below compression.rank; "
                              "compression.rank: as PyTorch's hook)"));
  info.keys.push_back(int_key("compression.start_step", "1000", 0, 1e12,
                              "powersgd: steps reduced in plain fp32 before compression starts (PyTorch "
                              "start_powerSGD_iter)"));
  info.keys.push_back(float_key("compression.min_compression_rate", "2", 0, 1e12,
                                "powersgd: a matrix n x m is compressed only if n m / ((n + m) rank) is at least this; "
                                "others go uncompressed (PyTorch min_compression_rate)"));
  info.keys.push_back(bool_key("compression.warm_start", "true",
                               "powersgd: start each step's power iteration from the last step's Q (PyTorch "
                               "warm_start)"));
  info.keys.push_back(
      int_key("compression.int8_chunk", "1024", 1, 1e12, "int8: elements that share one quantisation step"));
  info.keys.push_back(bool_key("compression.error_feedback", "true",
                               "int8, topk, powersgd: keep what compression dropped and add it to the next step's "
                               "gradient (PyTorch use_error_feedback)"));
  info.claims = {{Role::reducer, Claim::wraps, "data"}, {Role::phase_hooks, Claim::provides, ""}};
  info.requested_by = [](const Deck& deck, const Layout& layout) -> std::string {
    const std::string m = deck.get_string("compression.method");
    if (m == "none") return "";
    const std::string setting = "compression.method = " + m;
    if (layout.replicas() < 2)
      throw InputError(setting + " compresses the data-parallel gradient collective, and parallel.dp = " +
                       std::to_string(layout.dp) + " has none: set parallel.dp > 1, or compression.method = none" +
                       " (it runs over dp x cp)");
    const Method method = method_of(m);
    if ((method == Method::int8 || method == Method::topk || method == Method::powersgd) && layout.tp > 1)
      throw InputError(setting + " with parallel.tp = " + std::to_string(layout.tp) +
                       ": each tp rank's buckets hold "
                       "different shards, so " +
                       m +
                       " would drop or round a tp-replicated tensor (LayerNorm, biases) "
                       "differently on each tp rank and the replicas would drift apart; use fp16 or bf16 with "
                       "tensor parallelism, or parallel.tp = 1");
    if (method == Method::int8 && compress::int8_levels(layout.replicas()) < 1)
      throw InputError(setting + " at parallel.dp x parallel.cp = " + std::to_string(layout.replicas()) +
                       ": the int8 sum of that many "
                       "ranks cannot be held without overflow (at most 127 ranks); use fp16, bf16, topk or powersgd");
    return setting;
  };
  // What the other strategies of the run do to the gradient collective (RunTraits), against the method.
  // Top-k's momentum techniques take AdamW's first moment off (the session sets beta1 = 0 and says why).
  info.traits = [](const Deck& deck, RunTraits& traits) {
    if (deck.get_string("compression.method") != "topk") return;
    if (deck.get_bool("compression.momentum_correction"))
      traits.first_moment_off_by = "compression.momentum_correction = true";
    else if (deck.get_bool("compression.momentum_masking"))
      traits.first_moment_off_by = "compression.momentum_masking = true";
  };
  info.check = [](const LayoutContext& ctx) {
    const std::string m = ctx.deck.get_string("compression.method");
    const Method method = method_of(m);
    const std::string setting = "compression.method = " + m;
    const RunTraits& t = ctx.traits;
    if (!t.grads_scattered_by.empty() && (method == Method::topk || method == Method::powersgd))
      throw InputError(setting + " with " + t.grads_scattered_by + ": " + m +
                       " sums whole matrices or "
                       "(index, value) pairs, not the reduce-scatter of gradient pieces that ZeRO-2/3 runs every "
                       "micro-batch (DeepSpeed refuses the same); use zero.stage = 0 or 1, or fp16, bf16 or int8");
    // Top-k's momentum techniques turn AdamW's first moment off for every tensor, but the experts'
    // gradients (parallel.ep > 1) bypass compression: they would train without momentum.
    if (method == Method::topk && ctx.layout.ep > 1 && !t.first_moment_off_by.empty())
      throw InputError(setting + " with " + t.first_moment_off_by +
                       " and parallel.ep = " + std::to_string(ctx.layout.ep) +
                       ": AdamW's first moment goes off for every tensor, but the experts' gradients are summed by "
                       "the experts role, not compressed, so they would train without momentum; set "
                       "compression.momentum_correction = false and compression.momentum_masking = false, or "
                       "parallel.ep = 1");
    // Local clipping compares a rank's gradient with its threshold: under a loss scale it would compare
    // scaled gradients. A local_clip the deck sets is refused there; the default is switched off (said).
    if (method == Method::topk && !t.loss_scaled_by.empty() && !ctx.deck.is_default("compression.local_clip") &&
        ctx.deck.get_float("compression.local_clip") > 0)
      throw InputError(setting + " with compression.local_clip = " + ctx.deck.values().at("compression.local_clip") +
                       " and " + t.loss_scaled_by +
                       ": the gradients reach the compressor scaled, so the threshold would clip them by the "
                       "scale; set compression.local_clip = 0, or use bf16");
    const bool velocity = method == Method::topk && ctx.deck.get_bool("compression.momentum_correction");
    if (!t.dynamic_loss_scale_by.empty() && (ctx.deck.get_bool("compression.error_feedback") || velocity) &&
        (method == Method::int8 || method == Method::topk || method == Method::powersgd))
      throw InputError(setting + " keeps error-feedback residuals in the units of the gradient it compressed, and " +
                       t.dynamic_loss_scale_by +
                       " changes those units whenever the scale moves: "
                       "use bf16, a fixed precision.loss_scale, compression.error_feedback = false (and, for topk, "
                       "compression.momentum_correction = false, whose velocity is kept the same way), or "
                       "compression.method = fp16/bf16");
    if (!t.reduce_dtype_by.empty())
      throw InputError(setting + " and " + t.reduce_dtype_by +
                       " both change the gradient "
                       "collective: keep one (compression.method = fp16/bf16 is the same cast)");
  };
  info.plan = compression_plan_terms();
  info.create = [](StrategyContext& ctx, Roles& roles) {
    // A deck that sweeps the method keeps the other methods' keys: they are ignored, and said so.
    const std::string m = ctx.deck.get_string("compression.method");
    if (ctx.grid.world().rank() == 0)
      for (const auto& [key, methods] : method_keys())
        if (!ctx.deck.is_default(key) && std::find(methods.begin(), methods.end(), m) == methods.end())
          std::printf("  compression: %s = %s applies to compression.method = %s and is ignored with %s\n", key.c_str(),
                      ctx.deck.values().at(key).c_str(), join(methods, " | ").c_str(), m.c_str());
    Config cfg;
    cfg.method_name = ctx.deck.get_string("compression.method");
    cfg.method = method_of(cfg.method_name);
    cfg.ratio = ctx.deck.get_float("compression.ratio");
    cfg.rank = static_cast<int>(ctx.deck.get_int("compression.rank"));
    cfg.embedding_rank = static_cast<int>(ctx.deck.get_int("compression.embedding_rank"));
    cfg.start_step = ctx.deck.get_int("compression.start_step");
    cfg.min_rate = ctx.deck.get_float("compression.min_compression_rate");
    cfg.chunk = ctx.deck.get_int("compression.int8_chunk");
    cfg.error_feedback = ctx.deck.get_bool("compression.error_feedback");
    cfg.warm_start = ctx.deck.get_bool("compression.warm_start");
    cfg.warmup_steps = ctx.deck.get_int("compression.warmup_steps");
    cfg.momentum_correction = ctx.deck.get_bool("compression.momentum_correction");
    cfg.momentum = ctx.deck.get_float("train.beta1");
    cfg.local_clip = ctx.deck.get_float("compression.local_clip");
    // Under fp16 the gradients reach the compressor loss-scaled: the default clipping is off there (a
    // value the deck sets is refused by check).
    if (cfg.method == Method::topk && ctx.backend.precision().matmul == DType::f16 && cfg.local_clip > 0) {
      cfg.local_clip = 0;
      if (ctx.grid.world().rank() == 0)
        std::printf("  compression: local clipping is off under fp16 (the gradients reach it loss-scaled)\n");
    }
    cfg.seed = static_cast<std::uint64_t>(ctx.deck.get_int("train.seed"));
    auto made = std::make_shared<CompressingReducer*>(nullptr);
    Communicator& dp = ctx.grid.dp();
    BackendFace& be = ctx.backend;
    GPT& model = ctx.model;
    const bool say = ctx.grid.world().rank() == 0;
    roles.wrap_reducer = [made, cfg, &dp, &be, &model,
                          say](std::unique_ptr<Reducer> inner) -> std::unique_ptr<Reducer> {
      auto r = std::make_unique<CompressingReducer>(std::move(inner), cfg, dp, be, model, say);
      *made = r.get();
      return r;
    };
    roles.hooks.push_back({StepPhase::begin, "", [made](StepState& s) {
                             if (*made) (*made)->begin_step(s.step);
                           }});
    roles.hooks.push_back({StepPhase::grads_final, "", [made](StepState&) {
                             if (*made) (*made)->end_sync();
                           }});
    roles.hooks.push_back({StepPhase::norm, "", [made](StepState& s) {
                             if (*made) (*made)->after_norm(s);
                           }});
    roles.hooks.push_back({StepPhase::refresh, "", [made, &model, &dp](StepState&) {
                             if (*made) (*made)->set_identical(replicas_identical(model, dp));
                           }});
  };
}

}  // namespace
}  // namespace loom

extern "C" const loom_plugin_v1* loom_plugin_entry(void) {
  static const loom_plugin_v1 plugin = {LOOM_PLUGIN_ABI_VERSION, "compression", "0.1.0",
                                        "data-parallel gradient compression: fp16, bf16, int8, top-k, PowerSGD, with "
                                        "error feedback",
                                        loom::register_compression};
  return &plugin;
}
