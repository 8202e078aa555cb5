// The `context` strategy plugin (libloom_context.so): context parallelism. Asked for by
// parallel.cp > 1. Every sequence is cut into 2 x cp chunks and context rank i holds chunks i and
// 2cp-1-i (the core's split, core/model/context.hpp), so that each rank has the same share of the
// causal triangle. Everything but attention is per token and runs on the local tokens unchanged;
// attention runs as a ring (Liu et al., "Ring Attention"; Megatron-Core's context parallelism):
//
//   forward   each rank packs its keys and values into a block [B,Tl,2Cl] and passes blocks round the
//             cp ring, cp - 1 hops; at hop j it holds rank (i - j)'s block and merges its queries'
//             attention to it into a running output by the online softmax (attention_ring_forward),
//             while the next block is already in flight. Hop 0 (its own block) is causal; a block
//             from a lower rank is seen whole by every local query but only its first chunk (the
//             other one lies later in the sequence); a block from a higher rank is seen whole by the
//             second local chunk only. Each of those is half a block's work, so no rank idles.
//   backward  the blocks go round again, each hop's gradient of the block (dk, dv) travelling with
//             it and arriving home after cp hops; dq stays local.
//
// Gradients of the weights are summed over dp x cp (the grid's dp communicator: the data strategy
// is in the run whenever cp > 1) and each rank's loss is the mean over its tokens, so the mean over
// the group is the whole batch's. Bytes per rank per layer and micro-batch, with K = B Tl 2 Cl
// fp32 elements: forward (cp - 1) K x 4, backward (cp - 1) K x 4 for the blocks plus cp K x 4 for
// their gradients (a recomputed forward adds another forward's).
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/base/clock.hpp"
#include "core/base/error.hpp"
#include "core/engine/plan_terms.hpp"
#include "core/engine/plugin.hpp"
#include "core/model/context.hpp"

namespace loom {
namespace {

constexpr int kTagBlock = 310, kTagGrad = 311;

class RingContext final : public ContextSplit {
 public:
  explicit RingContext(Communicator& ring) : ring_(ring) {}
  std::string name() const override {
    return "ring attention over " + std::to_string(size()) + " context ranks (chunks i and 2cp-1-i)";
  }
  int size() const override { return ring_.size(); }
  int rank() const override { return ring_.rank(); }

  void prepare(BackendFace& be, int max_rows, int Tl, int Cl, int NHl, bool bf16, bool out16) override {
    const std::int64_t block = static_cast<std::int64_t>(max_rows) * Tl * 2 * Cl;
    for (int i = 0; i < 2; ++i) {
      kv_[i] = be.allocate("context::kv_block", DType::f32, block, Mem::comm);
      dkv_[i] = be.allocate("context::dkv_block", DType::f32, block, Mem::comm);
    }
    if (out16)  // an fp32 output is merged into in place
      out_ = be.allocate("context::out", DType::f32, static_cast<std::int64_t>(max_rows) * Tl * Cl, Mem::workspace);
    dsum_ = be.allocate("context::dsum", DType::f32, static_cast<std::int64_t>(max_rows) * NHl * Tl, Mem::workspace);
    bf16_ = bf16;
    block_bytes_ = static_cast<double>(Tl) * 2 * Cl * 4;  // a block's bytes per row
  }

  void attention_forward(BackendFace& be, const BufferRef& out, const BufferRef& lse, const BufferRef& qkv, int B,
                         int Tl, int Cl, int NHl) override {
    const std::int64_t N = static_cast<std::int64_t>(B) * Tl, NC = N * Cl;
    const BufferRef acc = out.type == DType::f32 ? out.slice(0, NC) : out_.ref().slice(0, NC);
    be.fill(acc, 0.0);
    be.fill(lse.slice(0, static_cast<std::int64_t>(B) * NHl * Tl), -1e30);
    pack(be, kv_[0].ref(), qkv, N, Cl);
    for (int j = 0; j < size(); ++j) {
      const BufferRef cur = block(kv_[j % 2], B, Tl, Cl), next = block(kv_[(j + 1) % 2], B, Tl, Cl);
      std::vector<CommRequestPtr> hop = j + 1 < size() ? pass(cur, next, kTagBlock) : std::vector<CommRequestPtr>{};
      const Hop h = hop_shape(j, Tl);
      const double t0 = now();
      be.attention_ring_forward(acc, lse, qkv, cur, B, Tl, Cl, NHl, h.q_begin, h.kv_rows, h.causal, bf16_);
      finish(hop, be, t0);
    }
    if (acc.data != out.data) be.cast(out.slice(0, NC), acc);
  }

  void attention_backward(BackendFace& be, const BufferRef& dqkv, const BufferRef& dout, const BufferRef& out,
                          const BufferRef& qkv, const BufferRef& lse, int B, int Tl, int Cl, int NHl) override {
    const std::int64_t N = static_cast<std::int64_t>(B) * Tl;
    be.fill(dqkv.slice(0, N * 3 * Cl), 0.0);
    pack(be, kv_[0].ref(), qkv, N, Cl);
    be.fill(block(dkv_[0], B, Tl, Cl), 0.0);
    for (int j = 0; j < size(); ++j) {
      const BufferRef cur = block(kv_[j % 2], B, Tl, Cl), next = block(kv_[(j + 1) % 2], B, Tl, Cl);
      const BufferRef dcur = block(dkv_[j % 2], B, Tl, Cl), dnext = block(dkv_[(j + 1) % 2], B, Tl, Cl);
      std::vector<CommRequestPtr> hop = j + 1 < size() ? pass(cur, next, kTagBlock) : std::vector<CommRequestPtr>{};
      const Hop h = hop_shape(j, Tl);
      const double t0 = now();
      be.attention_ring_backward(dqkv, dcur, dsum_.ref(), dout, out, qkv, cur, lse, B, Tl, Cl, NHl, h.q_begin,
                                 h.kv_rows, h.causal, bf16_);
      finish(hop, be, t0);
      // The block's gradient follows the block (it needs this hop's sum, so it is not overlapped):
      // after the last hop it reaches the block's owner.
      std::vector<CommRequestPtr> back = pass(dcur, dnext, kTagGrad);
      for (auto& r : back) r->wait();
    }
    // Home again after cp hops: this rank's own block's gradient, into dqkv's k and v columns.
    be.copy_rows(dqkv.slice(Cl, N * 3 * Cl - Cl), block(dkv_[size() % 2], B, Tl, Cl), N, 2 * Cl, 3 * Cl, 2 * Cl);
  }

  void begin_step() override { compute_s_ = 0; }
  std::vector<std::pair<std::string, double>> step_report() override {
    const CommStats& cs = ring_.stats();
    std::vector<std::pair<std::string, double>> r = {
        {"cp_ring_bytes", static_cast<double>(cs.total_bytes())},
        {"cp_wait_s", cs.total_wait()},
        {"cp_compute_s", compute_s_},
        {"cp_wait_share", cs.total_wait() + compute_s_ > 0 ? cs.total_wait() / (cs.total_wait() + compute_s_) : 0}};
    return r;
  }

  // Per layer and micro-batch: forward (cp - 1) blocks, backward (cp - 1) blocks and cp gradients.
  void plan_step(StepPlan& plan, int layers, int micro_batches, bool recompute) const override {
    const int n = size();
    const double block_bytes = block_bytes_ * plan.rows_per_micro;
    const double per = static_cast<double>(layers) * micro_batches;
    const double fwd = per * (recompute ? 2 : 1) * (n - 1);
    // The blocks travel while a hop computes (overlapped: the planner hides them behind the attention);
    // a block's gradient leaves only once its hop is done.
    plan.add_comm({"cp", "ring attention: key/value blocks", (fwd + per * (n - 1)) * block_bytes, fwd + per * (n - 1),
                   true, true});
    plan.add_comm({"cp", "ring attention: key/value gradients", per * n * block_bytes, per * n, false, true});
  }

 private:
  struct Hop {
    int q_begin = 0, kv_rows = 0;
    bool causal = false;
  };
  // What hop j's block (from rank i - j) means to this rank's queries (see the top of the file).
  Hop hop_shape(int j, int Tl) const {
    const int src = (rank() - j + size()) % size();
    if (j == 0) return {0, Tl, true};
    if (src < rank()) return {0, Tl / 2, false};  // its first chunk, seen by every local query
    return {Tl / 2, Tl, false};                   // all of it, seen by the second local chunk
  }
  static BufferRef block(const TypedBuffer& b, int B, int Tl, int Cl) {
    return b.ref().slice(0, static_cast<std::int64_t>(B) * Tl * 2 * Cl);
  }
  // k and v columns of qkv [N,3Cl] into a block [N,2Cl].
  static void pack(BackendFace& be, const BufferRef& dst, const BufferRef& qkv, std::int64_t N, int Cl) {
    be.copy_rows(dst, qkv.slice(Cl, N * 3 * Cl - Cl), N, 2 * Cl, 2 * Cl, 3 * Cl);
  }
  // One hop round the ring: `send` to the next rank, `recv` from the previous one.
  std::vector<CommRequestPtr> pass(const BufferRef& send, const BufferRef& recv, int tag) {
    const int n = size(), next = (rank() + 1) % n, prev = (rank() - 1 + n) % n;
    std::vector<CommRequestPtr> r;
    r.push_back(ring_.recv_async(recv, prev, tag));
    r.push_back(ring_.send_async(send, next, tag));
    return r;
  }
  // The hop's compute (since t0, finished on the device too) is done: what waiting remains is the ring's.
  void finish(std::vector<CommRequestPtr>& hop, BackendFace& be, double t0) {
    be.synchronize();
    compute_s_ += now() - t0;
    for (auto& r : hop) r->wait();
  }

  Communicator& ring_;
  TypedBuffer kv_[2], dkv_[2], out_, dsum_;
  bool bf16_ = false;
  double block_bytes_ = 0;
  double compute_s_ = 0;
};

void register_context(void* p) {
  auto& info = *static_cast<StrategyInfo*>(p);
  info.claims = {{Role::context, Claim::provides, ""}};
  info.make_context = [](PartitionContext& ctx) -> std::unique_ptr<ContextSplit> {
    return std::make_unique<RingContext>(ctx.grid.cp());
  };
  info.create = [](StrategyContext&, Roles&) {};
  // `loom plan`'s memo: what cp does for a long sequence (the search itself varies parallel.cp as a layout axis).
  info.plan.memo = [](const std::string& topic, const PlanPoint& p) -> std::string {
    if (topic != "split" || p.layout.cp < 2 || !p.deck) return "";
    const std::int64_t T = p.deck->get_int("model.seq_len"), n = p.layout.cp;
    return "- **Context parallelism over " + std::to_string(n) + " ranks** keeps " + std::to_string(T / n) +
           " of the " + std::to_string(T) + " tokens of every sequence on each rank (chunks i and 2cp-1-i): every " +
           "activation, attention's included, is 1/" + std::to_string(n) +
           " of one rank's. Attention runs as a ring whose key/value blocks travel while the block before them " +
           "computes (the plan's \"context parallel\" line says whether they hide); the weights' gradients are " +
           "summed over dp x cp.\n";
  };
}

}  // namespace
}  // namespace loom

extern "C" const loom_plugin_v1* loom_plugin_entry(void) {
  static const loom_plugin_v1 plugin = {LOOM_PLUGIN_ABI_VERSION, "context", "0.1.0",
                                        "context parallelism: sequences split over ranks, ring attention",
                                        loom::register_context};
  return &plugin;
}
