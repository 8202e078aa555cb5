// The `tensor` strategy plugin (libloom_tensor.so): Megatron-style tensor parallelism, filling the
// partition role. Attention heads and the MLP's inner dimension are split over the tp group: qkv
// and the first MLP projection column-parallel, the attention output and second MLP projections
// row-parallel, so a block needs one all-reduce forward and one backward for attention and again for
// the MLP. The token embedding is vocabulary-parallel (each rank holds vocab/tp rows) and the
// cross-entropy is computed vocabulary-parallel without gathering the logits. LayerNorms stay
// replicated. With tensor.sequence_parallel the residual stream and LayerNorms are split by rows
// (tokens), and each all-reduce becomes a reduce-scatter / all-gather pair.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/comm/comm.hpp"
#include "core/base/error.hpp"
#include "core/comm/fault.hpp"
#include "core/model/gpt.hpp"
#include "core/engine/plugin.hpp"
#include "core/backend/tensor_hash.hpp"

namespace loom {
namespace {

class TensorPartition final : public Partition {
 public:
  TensorPartition(Communicator& tp, BackendFace& backend, bool sequence_parallel)
      : tp_(tp), be_(backend), sp_(sequence_parallel) {}

  std::string name() const override {
    return "tensor parallel over tp " + std::to_string(tp_.size()) + " (heads, MLP width, vocabulary split" +
           (sp_ ? "; sequence parallel)" : ")");
  }
  int size() const override { return tp_.size(); }
  int rank() const override { return tp_.rank(); }
  bool sequence_parallel() const override { return sp_; }

  BufferRef to_full(const BufferRef& local, const BufferRef& full, std::int64_t rows, int C) override {
    if (!sp_) return local;
    const std::int64_t n = rows / tp_.size() * C;
    tp_.all_gather(local.slice(0, n), full.slice(0, n * tp_.size()));
    return full;
  }
  BufferRef reduce_partial(const BufferRef& partial, const BufferRef& local, std::int64_t rows, int C) override {
    if (!sp_) {
      tp_.all_reduce(partial.slice(0, rows * C));
      return partial;
    }
    const std::int64_t n = rows / tp_.size() * C;
    tp_.reduce_scatter(partial.slice(0, n * tp_.size()), local.slice(0, n));
    return local;
  }
  BufferRef grad_to_full(const BufferRef& dlocal, const BufferRef& dfull, std::int64_t rows, int C) override {
    return to_full(dlocal, dfull, rows, C);  // the backward of a reduce-scatter is an all-gather
  }
  void sum_over_group(const BufferRef& x) override { tp_.all_reduce(x); }
  BufferRef reduce_partial_grad(const BufferRef& dpartial, const BufferRef& dlocal, std::int64_t rows, int C) override {
    // The partition sees no step number: it counts steps by finish_grads, and the first backward
    // collective after one is the step's first micro-batch (evaluation runs no backward).
    if (!step_started_) {
      step_started_ = true;
      if (inject_fault("plugin", steps_done_))
        throw std::runtime_error("tensor plugin: injected fault at step " + std::to_string(steps_done_) +
                                 " (LOOM_INJECT_FAULT)");
    }
    return reduce_partial(dpartial, dlocal, rows, C);  // the backward of an all-gather is a reduce-scatter
  }

  // Vocabulary-parallel softmax cross-entropy: the row maxima (a max all-reduce), the sums of
  // exponentials and the target logits (sum all-reduces) travel over the group, N values each; the
  // [N, V] logits never do. The passes between are the back end's; its backward, the default
  // partition's (BackendFace::crossentropy_backward with this rank's vocab_begin).
  void crossentropy_forward(BackendFace&, const BufferRef& losses, const BufferRef& probs, const BufferRef& logits,
                            const BufferRef& targets, int N, int Vl, int vocab_begin) override {
    const Sums r = row_sums(probs, logits, targets, N, Vl, vocab_begin);
    be_.crossentropy_finish(losses, probs, r.sum_exp, r.row_max, r.target_logit, N, Vl);
  }
  // The fused classifier: the same reductions, then the loss and its gradient in one pass from the
  // logits (the partial pass writes no exponentials).
  void crossentropy_fused(BackendFace&, const BufferRef& losses, const BufferRef& dlogits, const BufferRef& logits,
                          const BufferRef& targets, float dloss, int N, int Vl, int vocab_begin) override {
    const Sums r = row_sums({}, logits, targets, N, Vl, vocab_begin);
    be_.crossentropy_finish_grad(losses, dlogits, logits, r.sum_exp, r.row_max, r.target_logit, targets, dloss, N, Vl,
                                 vocab_begin);
  }

  // With sequence parallelism each rank's LayerNorm and row-parallel bias gradients cover only its
  // rows: sum them over the group (packed into one all-reduce). Then check the claim that replicated
  // tensors are the same on every rank: a hash of every replicated parameter and gradient must
  // agree across the group (reported in the step's metrics as tp_replicas_identical).
  void finish_grads(GPT& model) override {
    ++steps_done_;
    step_started_ = false;
    const auto& params = model.params();
    // The slices this rank updates: whole tensors, or with ZeRO its dp share of them, the same
    // elements on every tp rank (their layouts match).
    ParamStore& store = model.store();
    const auto& owned = store.owned();
    // (Also without sequence parallelism where tp does not divide Llama's kv heads: their whole k and v
    // weights' gradients are each rank's query heads' share, marked sp_partial by the model.)
    std::int64_t total = 0;
    for (const OwnedSlice& o : owned)
      if (params[static_cast<std::size_t>(o.param)].sp_partial) total += o.size();
    if (total > 0) {
      ensure_capacity(be_, pack_buf_, "TensorPartition::sp_grad_pack", DType::f32, total, Mem::comm);
      const BufferRef pack = pack_buf_.ref();
      std::int64_t at = 0;
      for (const OwnedSlice& o : owned)
        if (params[static_cast<std::size_t>(o.param)].sp_partial) {
          be_.copy(pack.slice(at, o.size()), store.owned_grad(o), o.size());
          at += o.size();
        }
      tp_.all_reduce(pack_buf_.ref().slice(0, total));
      at = 0;
      for (const OwnedSlice& o : owned)
        if (params[static_cast<std::size_t>(o.param)].sp_partial) {
          be_.copy(store.owned_grad(o), pack.slice(at, o.size()), o.size());
          at += o.size();
        }
    }
    std::uint64_t h = 0xcbf29ce484222325ULL;
    for (const OwnedSlice& o : owned) {
      const ParamInfo& p = params[static_cast<std::size_t>(o.param)];
      if (p.shadow || p.split() != TpSplit::none) continue;
      for (const BufferRef ref : {store.owned_param(o), store.owned_grad(o)}) {
        h = hash_tensor(be_, ref.slice(0, o.size()), hash_copy_, h);
      }
    }
    // Two floats carry 48 bits of the hash exactly (24 bits each, within a float's mantissa).
    const float mine[2] = {static_cast<float>(h >> 40), static_cast<float>((h >> 16) & 0xffffff)};
    std::vector<float> all(2 * tp_.size());
    tp_.all_gather(mine, all.data(), 2);
    identical_ = 1.0;
    for (int q = 0; q < tp_.size(); ++q)
      if (all[2 * q] != mine[0] || all[2 * q + 1] != mine[1]) identical_ = 0.0;
  }

  std::vector<std::pair<std::string, double>> step_report() const override {
    return {{"tp_replicas_identical", identical_}};
  }

  // `loom plan`: the cross-entropy's scratch (crossentropy_forward) and the sequence-parallel pack
  // (finish_grads), the ring scratch of the activation collectives, and their bytes: per block and
  // micro-batch two in forward (attention and MLP outputs) and two in backward (their inputs'
  // gradients), again in a recomputed forward; the head's input gradient; the embedding's partial
  // sums; the cross-entropy's three [N] collectives.
  void plan_step(StepPlan& plan, const GPT& model) const override {
    const int n = tp_.size();
    if (n == 1) return;
    const double N = static_cast<double>(model.max_rows()) * model.local_tokens(), C = model.config().d_model;
    const std::int64_t NC = static_cast<std::int64_t>(N * C);
    const double m = plan.micro_batches;
    int layers = 0;
    for (const Stage::Chunk& c : model.stage().chunks) layers += c.end_layer - c.first_layer;
    const double per_layer = 4.0 + (model.config().recompute ? 2.0 : 0.0);
    // The first stage's vocabulary-parallel embedding sums its partial outputs once per forward.
    const double ops =
        m * (layers * per_layer + (model.stage().last() ? 1.0 : 0.0) + (model.stage().first() ? 1.0 : 0.0));
    std::vector<double> scratch;
    if (!sp_) {
      scratch.push_back(static_cast<double>(ring_all_reduce_scratch(NC, n, sizeof(float))));
      plan.add_comm({tp_.name(), "activation all-reduces", ops * ring_all_reduce_bytes(N * C * 4.0, n),
                     ops * 2.0 * (n - 1), false, true});
    } else {
      scratch.push_back(static_cast<double>(ring_reduce_scatter_scratch(NC / n, n, sizeof(float), false)));
      const double gathers = ops + m * (model.stage().last() ? 1.0 : 0.0);  // the head's lnf gather
      plan.add_comm({tp_.name(), "sequence-parallel all-gathers and reduce-scatters",
                     (ops + gathers) * ring_all_gather_bytes(N * C * 4.0, n), (ops + gathers) * (n - 1), false, true});
    }
    std::int64_t partial = 0;  // finish_grads' sum of the gradients each rank holds only a share of
    for (const OwnedSlice& o : model.store().owned())
      if (model.params()[static_cast<std::size_t>(o.param)].sp_partial) partial += o.size();
    if (partial > 0) {
      plan.add_scratch(Mem::comm, static_cast<double>(partial) * sizeof(float));
      scratch.push_back(static_cast<double>(ring_all_reduce_scratch(partial, n, sizeof(float))));
      plan.add_comm({tp_.name(), sp_ ? "sequence-parallel gradient sum" : "replicated kv heads' gradient sum",
                     ring_all_reduce_bytes(partial * 4.0, n), 2.0 * (n - 1), false});
    }
    if (model.stage().last()) {
      plan.add_scratch(Mem::comm, N * 4.0 + 2 * N * 8.0);
      scratch.push_back(static_cast<double>(ring_all_reduce_scratch(static_cast<std::int64_t>(N), n, sizeof(double))));
      plan.add_comm({tp_.name(), "vocabulary-parallel cross-entropy",
                     m * (ring_all_reduce_bytes(N * 4.0, n) + 2 * ring_all_reduce_bytes(N * 8.0, n)), m * 6.0 * (n - 1),
                     false, true});
    }
    int expert_layers = 0;  // each block with experts sums its N*k gate gradients once per backward
    for (const Stage::Chunk& c : model.stage().chunks)
      for (int l = c.first_layer; l < c.end_layer; ++l) expert_layers += model.config().moe_layer(l) ? 1 : 0;
    if (expert_layers > 0) {
      const std::int64_t gates = static_cast<std::int64_t>(N) * model.config().top_k();
      scratch.push_back(static_cast<double>(ring_all_reduce_scratch(gates, n, sizeof(float))));
      plan.add_comm({tp_.name(), "experts' gate-gradient sums",
                     m * expert_layers * ring_all_reduce_bytes(gates * 4.0, n), m * expert_layers * 2.0 * (n - 1),
                     false, true});
    }
    for (double s : scratch) plan.ring_scratch(tp_.name(), {s});  // one at a time
    // The replica hash of finish_grads: each replicated parameter and gradient hashed (read, 4 bytes
    // a float), on a device back end from a host copy.
    double replicated = 0;
    for (const OwnedSlice& o : model.store().owned()) {
      const ParamInfo& p = model.params()[static_cast<std::size_t>(o.param)];
      if (!p.shadow && p.split() == TpSplit::none) replicated += static_cast<double>(o.size());
    }
    plan.host_bytes += 2 * 4.0 * replicated;
    plan.host_copy_bytes += 2 * 4.0 * replicated;
  }

 private:
  // The row maxima, sums of exponentials and target logits over the group, N values each (probs, when
  // given, gets this rank's exponentials).
  struct Sums {
    BufferRef row_max, sum_exp, target_logit;
  };
  Sums row_sums(const BufferRef& probs, const BufferRef& logits, const BufferRef& targets, int N, int Vl,
                int vocab_begin) {
    // Scratch through the back end and the ledger (communication buffers), grown to the largest N.
    ensure_capacity(be_, row_max_buf_, "TensorPartition::row_max", DType::f32, N, Mem::comm);
    ensure_capacity(be_, sum_exp_buf_, "TensorPartition::sum_exp", DType::f64, N, Mem::comm);
    ensure_capacity(be_, target_logit_buf_, "TensorPartition::target_logit", DType::f64, N, Mem::comm);
    const Sums r{row_max_buf_.ref().slice(0, N), sum_exp_buf_.ref().slice(0, N), target_logit_buf_.ref().slice(0, N)};
    be_.crossentropy_row_max(r.row_max, logits, N, Vl);
    tp_.all_reduce(r.row_max, ReduceOp::max);
    be_.crossentropy_partial(probs, r.sum_exp, r.target_logit, logits, r.row_max, targets, N, Vl, vocab_begin);
    tp_.all_reduce(r.sum_exp);
    tp_.all_reduce(r.target_logit);
    return r;
  }

  Communicator& tp_;
  BackendFace& be_;
  bool sp_;
  TypedBuffer row_max_buf_, pack_buf_, sum_exp_buf_, target_logit_buf_;
  std::vector<unsigned char> hash_copy_;  // host copy of a replicated tensor, for the replica hash
  double identical_ = 1.0;
  std::int64_t steps_done_ = 0;  // steps of this run, for LOOM_INJECT_FAULT
  bool step_started_ = false;
};

// `loom plan`: sequence parallelism, a tensor-parallel option, searched where tp > 1 (with tp = 1 the
// deck's own value stays).
PlanTerms tensor_plan_terms() {
  PlanTerms t;
  PlanDimension d("tensor.sequence_parallel", "sequence parallelism", "sp", 4, "sequence_parallel",
                  PlanDimension::Json::boolean, "false", 50, 40);
  d.values = [](const PlanPoint& p) -> std::vector<std::string> {
    if (p.layout.tp < 2) return {};
    return {"false", "true"};
  };
  d.describe = [](const std::string& v) { return v == "true" ? std::string("sequence parallel") : std::string(); };
  d.what_if = [](const PlanPoint& p) -> std::vector<std::pair<std::string, std::string>> {
    if (p.layout.tp < 2) return {};
    const bool sp = p.setting("tensor.sequence_parallel") == "true";
    return {{sp ? "no sequence parallelism" : "sequence parallelism", sp ? "false" : "true"}};
  };
  t.dimensions.push_back(d);
  return t;
}

void register_tensor(void* p) {
  auto& info = *static_cast<StrategyInfo*>(p);
  info.keys.push_back(bool_key("tensor.sequence_parallel", "false",
                               "tensor parallel: split LayerNorm and the residual stream by tokens; all-reduces "
                               "become reduce-scatter/all-gather pairs"));
  info.check = [](const LayoutContext& ctx) {
    // heads, d_model and vocab divisibility is the core's layout check; sequence parallelism also
    // splits the rows of every micro-batch.
    const long rows = static_cast<long>(ctx.rows_per_micro) * ctx.model.seq_len / ctx.layout.cp;
    if (ctx.deck.get_bool("tensor.sequence_parallel") && rows % ctx.layout.tp != 0)
      throw InputError("tensor.sequence_parallel = true splits the " + std::to_string(rows) +
                       " tokens of a micro-batch on a rank (micro-batch rows x model.seq_len / parallel.cp) over "
                       "parallel.tp = " +
                       std::to_string(ctx.layout.tp) +
                       ", which does not divide them; tp sizes that do: " + divisors(rows));
  };
  info.claims = {{Role::partition, Claim::provides, ""}};
  info.make_partition = [](PartitionContext& ctx) -> std::unique_ptr<Partition> {
    return std::make_unique<TensorPartition>(ctx.grid.tp(), ctx.backend, ctx.deck.get_bool("tensor.sequence_parallel"));
  };
  info.plan = tensor_plan_terms();
  info.create = [](StrategyContext&, Roles&) {};
}

}  // namespace
}  // namespace loom

extern "C" const loom_plugin_v1* loom_plugin_entry(void) {
  static const loom_plugin_v1 plugin = {
      LOOM_PLUGIN_ABI_VERSION, "tensor", "0.1.0",
      "tensor parallelism (Megatron): column/row-parallel linears, "
      "vocabulary-parallel embedding and cross-entropy, optional sequence parallelism",
      loom::register_tensor};
  return &plugin;
}
