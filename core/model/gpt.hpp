#pragma once
// The GPT-2 model: parameters with stable global names, their initialisation from
// (seed, name, element index), and the forward and backward passes of a micro-batch on a Backend.
//
// Shape letters: B micro-batch rows, T sequence length, C d_model, NH heads, V vocabulary,
// L layers, N = B*T rows of a flattened activation, Nl rows on this rank (N/tp with sequence
// parallelism), Ls layers on this pipeline stage.
#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/base/buffer.hpp"
#include "core/model/param_store.hpp"
#include "core/model/context.hpp"
#include "core/model/experts.hpp"
#include "core/model/moe.hpp"
#include "core/model/partition.hpp"

namespace loom {

struct GPTConfig {
  // model.arch: GPT-2's block (LayerNorm with biases, learned positions, GELU MLP, tied head) or
  // Llama's (RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, no biases).
  enum class Arch { gpt2, llama };
  Arch arch = Arch::gpt2;
  int layers = 4;          // L
  int d_model = 128;       // C
  int heads = 4;           // NH
  int seq_len = 64;        // T (also the number of learned positions)
  int vocab = 256;         // V
  bool recompute = false;  // keep only each block's input; recompute its activations in backward
  // Llama's keys (GPT-2 takes only their GPT-2 values): kv heads (0: heads), the MLP's width F (0: 4C
  // for GPT-2, Llama's rounding of 8C/3 up to a multiple of 256), RMSNorm's eps, the rotary base, and
  // whether the head is the token table (-1: GPT-2 yes, Llama no).
  int kv_heads = 0;
  int ffn_hidden = 0;
  float norm_eps = 1e-5f;
  float rope_theta = 10000.0f;
  int tie_embeddings = -1;
  bool llama() const { return arch == Arch::llama; }
  int kv() const { return kv_heads > 0 ? kv_heads : heads; }
  int ffn() const {
    if (ffn_hidden > 0) return ffn_hidden;
    if (!llama()) return 4 * d_model;
    return (8 * d_model / 3 + 255) / 256 * 256;
  }
  bool tied() const { return tie_embeddings < 0 ? !llama() : tie_embeddings != 0; }
  // Mixture of experts (core/model/moe.hpp): model.experts E expert MLPs and a router replace the MLP of
  // every model.moe_every-th block (0 experts: dense); each token goes to model.experts_per_token of them;
  // model.expert_capacity is the capacity factor (0: dropless); the objective adds train.moe_aux_loss x
  // the load-balancing loss and train.moe_z_loss x the router z-loss of each such block.
  // model.moe_ffn_hidden: an expert MLP's width (0: the dense MLP's; narrower experts, as DeepSeekMoE's
  // fine-grained ones, keep a token's active parameters while the experts multiply).
  int experts = 0, moe_every = 1, experts_per_token = 2, moe_ffn_hidden = 0;
  double expert_capacity = 0, moe_aux_loss = 0.01, moe_z_loss = 0.001;
  bool moe_layer(int l) const { return experts > 0 && (l + 1) % moe_every == 0; }
  int moe_layers() const { return experts > 0 ? layers / moe_every : 0; }
  int top_k() const { return experts > 0 ? experts_per_token : 1; }
  int expert_ffn() const { return moe_ffn_hidden > 0 ? moe_ffn_hidden : ffn(); }
  int head_size() const { return d_model / heads; }
  static const char* arch_name(Arch a) { return a == Arch::llama ? "llama" : "gpt2"; }
  // model.attention = flash or cudnn: fused attention, which saves each row's log-sum-exp instead of
  // the [T,T] probabilities and rounds its operands to bf16; `attention_engine` says whose kernels
  // (loom's: Backend::attention_forward_flash; cuDNN's: attention_forward_cudnn).
  bool flash_attention = false;
  enum class AttentionEngine { loom, cudnn };
  AttentionEngine attention_engine = AttentionEngine::loom;
  // model.attention as the deck says it: "unfused", "flash", "cudnn", or "auto" (resolved by
  // GPT::resolve_attention into the two fields above once the back end is known).
  std::string attention = "unfused";
  // Throws InputError naming the deck keys when the shape is inconsistent.
  void validate() const;
  // model.arch and Llama's keys from their deck text (a key absent or empty: its default); InputError
  // naming the key for a value that is not one.
  void read_architecture(const std::map<std::string, std::string>& deck_values);
  // The same keys as a deck writes them (what a checkpoint records and compares).
  std::map<std::string, std::string> architecture_values() const;
  // Sets attention, flash_attention and attention_engine for model.attention = `kind`.
  void set_attention(const std::string& kind);
  // Forward FLOPs per token of one block (matrix products 24 C^2, attention 4 T C) and of the head
  // (the tied projection 2 C V; ln_f and the embedding lookup cost next to nothing): what pipeline
  // stages are balanced by and their schedule replayed with (the head of GPT-2 124M is ~4.5 blocks).
  // Llama: q and the output projection 2 C^2, k and v 2 C KV hs, the SwiGLU MLP's three 3 C F.
  double block_matmul_weights() const {
    const double C = d_model, F = ffn();
    if (!llama()) return 12.0 * C * C;
    return 2.0 * C * C + 2.0 * C * kv() * head_size() + 3.0 * C * F;
  }
  double block_flops() const { return 2.0 * block_matmul_weights() + 4.0 * seq_len * d_model; }
  // The matrix weights of every block a token passes through: a block with experts counts its router
  // and the k experts the token reaches (`active`) or all E of them; a dense block its MLP.
  double blocks_matmul_weights(bool active = true) const {
    const double C = d_model, attention = block_matmul_weights() - 8.0 * C * C;  // GPT-2: experts refuse llama
    const double expert_blocks = moe_layers(), dense = layers - expert_blocks;
    const double per_expert = 2.0 * C * expert_ffn(), n = active ? top_k() : experts;
    return dense * block_matmul_weights() + expert_blocks * (attention + experts * C + n * per_expert);
  }
  double head_flops() const { return 2.0 * d_model * vocab; }
  // Model FLOPs per trained token (GPT::flops_per_token): with experts, those a token's k experts do
  // (`active`) or what all E would.
  double flops_per_token(bool active = true) const {
    const double matmul_weights = blocks_matmul_weights(active) + static_cast<double>(vocab) * d_model;
    return 6.0 * matmul_weights + 12.0 * layers * static_cast<double>(seq_len) * d_model;
  }
  // Parameters of one expert (fc and proj with their biases) and of the whole model's experts.
  double expert_params() const { return 2.0 * d_model * expert_ffn() + expert_ffn() + d_model; }
  double head_in_blocks() const { return head_flops() / block_flops(); }
};

// Which part of the model this rank holds (the layer half of the partition role, filled by the
// `pipeline` strategy). Default: the whole model, one micro-batch of activations.
struct Stage {
  // A run of consecutive blocks [first_layer, end_layer) and how many micro-batches' activations it
  // holds at once. One chunk per virtual stage (interleaved pipelines hold several), in model order.
  struct Chunk {
    int first_layer = 0, end_layer = 0, activation_slots = 1;
  };
  int index = 0, count = 1;                         // this stage of `count`
  std::vector<Chunk> chunks;                        // empty: every block, one slot
  bool first() const { return index == 0; }         // chunk 0 holds the embeddings (wte, wpe)
  bool last() const { return index == count - 1; }  // the last chunk holds ln_f, the tied head and the loss
};

class GPT {
 public:
  // Declares this rank's tensors and units to the parameter store (which allocates them), and
  // allocates for each chunk of its stage the activations of that chunk's activation_slots
  // micro-batches of up to `max_rows` rows. `partition` decides the tp shards (default: whole),
  // `stage` the layers (default: all), `store` where parameters and gradients live (default: a flat
  // store the model owns); `dp`, `dp_rank` place this rank in its gradient group (ownership: the dp x
  // cp ranks holding the same weights); `context` which tokens of each sequence it holds (default:
  // all; core/model/context.hpp), so that every activation below has seq_len / cp tokens a row.
  GPT(const GPTConfig& cfg, Backend& backend, int max_rows, Partition* partition = nullptr, const Stage& stage = {},
      ParamStore* store = nullptr, int dp = 1, int dp_rank = 0, ContextSplit* context = nullptr,
      ExpertSplit* experts = nullptr);
  // InputError naming model.attention when `backend` cannot run the configured attention (the
  // constructor checks it; a session checks it first, agreed over its ranks).
  static void check_attention(const GPTConfig& cfg, const Backend& backend);
  // model.attention = auto: the kind `backend` runs fastest for cfg's shape (cudnn where it takes the
  // shape, else flash on a device, else unfused), set into cfg; returns why, for the banner. Other
  // kinds are left as they are (and "" returned).
  static std::string resolve_attention(GPTConfig& cfg, const Backend& backend);
  Partition& partition() { return *part_; }
  const Partition& partition() const { return *part_; }
  ParamStore& store() { return *store_; }
  const ParamStore& store() const { return *store_; }
  // The units this rank holds ("embeddings", "blocks.<l>", "head"), each listing its tensors.
  const std::vector<Unit>& units() const { return units_; }

  const GPTConfig& config() const { return cfg_; }
  const Stage& stage() const { return stage_; }
  // This rank's parameters (its stage's, in its tp shard), in forward order.
  const std::vector<ParamInfo>& params() const { return params_; }
  // Every parameter of the whole model, whichever stage holds it (offset and numel: -1 and 0 when
  // not held here); the checkpoint writes them all.
  const std::vector<ParamInfo>& all_params() const { return all_params_; }
  const ParamInfo& param(const std::string& name) const;       // throws std::out_of_range
  const ParamInfo* find_param(const std::string& name) const;  // null when this rank does not hold it
  int param_index(const std::string& name) const;              // index into params(), -1 when not held
  std::int64_t num_params() const { return num_params_; }
  // Tensor i of params(), through the store (see ParamStore::param/grad).
  BufferRef param_ref(int i) { return store_->param(i); }
  BufferRef grad_ref(int i) { return store_->grad(i); }
  int max_rows() const { return max_rows_; }

  // GPT-2 initialisation: normal(0, 0.02), residual projections scaled by 1/sqrt(2L), LayerNorm
  // weights 1, biases 0; element i of parameter p is drawn from (seed, name of p, i).
  void init_weights(std::uint64_t seed);
  // Weights from elsewhere (an llm.c model file): `whole(name)` gives tensor `name` whole, row-major
  // in its full shape (rows past it, e.g. more learned positions than seq_len, are not read). Each
  // rank takes exactly its own elements, as init_weights draws them.
  void load_weights(const std::function<const float*(const std::string& name)>& whole);

  // Forward pass on B rows of T tokens; returns the mean cross-entropy over the B*T targets.
  // (The whole model only: one stage.) targets = null: no loss (returns 0), the logits are kept.
  // With `dloss` (training: the backward's argument known now) the classifier's gradient is made with
  // the loss, in one pass that stores no probabilities (the fused classifier); backward must then be
  // given the same dloss.
  double forward(const std::int32_t* inputs, const std::int32_t* targets, int B,
                 std::optional<float> dloss = std::nullopt);  // [B,T], [B,T]
  // Backward pass of the last forward, accumulating parameter gradients. `dloss` is the derivative
  // of the training objective with respect to this forward's mean loss (1/micro_batches when the
  // step averages over micro-batches).
  void backward(float dloss);
  // The logits of the last forward of the whole model (slot 0): [B*T, V/tp], fp32. Only after a
  // forward with targets = null (no loss, no backward): with targets the cross-entropy overwrites
  // the logits with the probabilities, and this throws.
  const float* logits() const;
  // The back end the model computes on (where its tensors live).
  BackendFace& backend() const { return be_; }

  // The activation memory a rank allocates for `stage` (default: every layer, one slot), in the
  // constructor's own terms: the tables are carved by the same functions. Floats are fp32 slots (a
  // 16-bit saved tensor takes half of its elements' floats); token_ints int32 (inputs and targets).
  struct ActivationSizes {
    std::int64_t residual_floats = 0, block_floats = 0, head_floats = 0, scratch_floats = 0, token_ints = 0;
    std::int64_t block_table_floats = 0, head_table_floats = 0;  // one block's, one slot's head
    std::vector<std::int64_t> residual_first, block_first;       // per chunk: its first residual / block table
    std::int64_t activation_bytes() const {
      return 4 * (residual_floats + block_floats + head_floats + scratch_floats);
    }
    std::int64_t workspace_bytes() const { return 4 * token_ints; }
  };
  static ActivationSizes activation_sizes(const GPTConfig& cfg, int tp, bool sp, const Stage& stage, int max_rows,
                                          DType mm16, int cp = 1, int ep = 1);
  // Tokens of each sequence this rank holds (seq_len / cp) and the context role.
  int local_tokens() const { return T_; }
  ContextSplit& context() { return *ctx_; }
  // Which experts this rank holds and how tokens reach them (core/model/experts.hpp).
  ExpertSplit& experts() { return *ep_; }
  const ExpertSplit& experts() const { return *ep_; }

  // Mixture of experts: what the training forwards since the last reset routed (evaluation's are not
  // counted), summed over this rank's blocks with experts and micro-batches.
  struct MoeStats {
    std::vector<double> routed;           // [layers * experts]: assignments routed to each expert of each layer
    double dropped = 0, assignments = 0;  // over capacity; all
    double aux = 0, z = 0, calls = 0;     // the auxiliary losses summed over calls (block and micro-batch)
  };
  const MoeStats& moe_stats() const { return moe_stats_; }
  void reset_moe_stats();

  // The same for chunk `chunk` of a pipeline stage, on the activations of slot `slot` (one
  // in-flight micro-batch). inputs [B,T] (chunk 0 of the first stage), x_in [Nl,C] the previous
  // chunk's output (elsewhere), targets [B,T] (the last chunk of the last stage). Returns the mean
  // loss on the model's last chunk, 0 elsewhere.
  double forward_stage(int slot, const std::int32_t* inputs, const float* x_in, const std::int32_t* targets, int B,
                       int chunk = 0, std::optional<float> dloss = std::nullopt);
  const float* stage_output(int slot, int chunk = 0) const;  // [Nl,C] the chunk's last block's output
  std::int64_t stage_boundary_floats(int B) const;           // Nl*C of a micro-batch of B rows
  // dout [Nl,C]: gradient of stage_output (not on the model's last chunk). Returns the gradient of
  // x_in [Nl,C] (valid until the next backward), or null on the model's first chunk.
  const float* backward_stage(int slot, float dloss, const float* dout, int chunk = 0);
  bool holds_embeddings(int chunk) const { return stage_.first() && chunk == 0; }
  bool holds_head(int chunk) const { return stage_.last() && chunk == static_cast<int>(stage_.chunks.size()) - 1; }
  void zero_grad();
  // Called during backward each time the gradients of a unit's tensors (units()[unit].params) are
  // complete for this micro-batch, in backward order: the head, the blocks from last to first, then
  // the embeddings. Gradient sync uses it to start communication early.
  void set_grad_ready_hook(std::function<void(int unit)> hook) { grad_ready_ = std::move(hook); }
  // Called after every block's forward and backward: a strategy with messages in flight advances
  // them there (MPI moves a large message only while one of its ends is inside an MPI call).
  void set_progress_hook(std::function<void()> hook) { progress_ = std::move(hook); }

  // Model FLOPs per trained token (forward + backward = 3 x forward) of the whole model, whatever
  // the layout: 6 x (weights in matrix products, the tied head included) + 12 x L x T x C for
  // attention (PaLM's convention).
  double flops_per_token() const;
  // `loom plan`: what a micro-batch's step takes beyond the tables the constructor allocated (the back
  // end's operand workspace for the products in the order they run, the partition's scratch) and the
  // bytes the partition moves (core/comm/step_plan.hpp).
  void plan_step(StepPlan& plan) const;

 private:
  // Every element this rank holds, tensor by tensor: write(p, w, begin, end) fills w[0, end - begin)
  // with elements [begin, end) of p's shard (whole tensors, and ZeRO-3's owned slices); then the
  // store's copies are marked stale.
  void write_held(const std::function<void(const ParamInfo&, float*, std::int64_t, std::int64_t)>& write);
  struct BlockParams {  // the tensors of the store's unit view (parameters or their gradients)
    BufferRef ln1w, ln1b, qkvw, qkvb, projw, projb, ln2w, ln2b, fcw, fcb, fcprojw, fcprojb;
    // The matrix products' weight operands: the store's 16-bit compute copies, else the fp32 weights.
    BufferRef mqkvw, mprojw, mfcw, mfcprojw;
  };
  struct LlamaParams {  // Llama's block: the same, its own tensors
    BufferRef ln1w, qw, kw, vw, projw, ln2w, gatew, upw, downw;
    BufferRef mqw, mkw, mvw, mprojw, mgatew, mupw, mdownw;
  };
  // What one block saves for its backward. The inputs of matrix products (ln1, atty, ln2, fch_gelu)
  // are saved in the products' 16-bit type under mixed precision (ln1 and ln2 only without sequence
  // parallelism, whose [Nl,C] pieces are gathered in fp32 before each product), else in fp32.
  // Shapes are those of a micro-batch of max_rows rows; a call on B rows uses each tensor's first part.
  struct BlockActs {
    BufferRef ln1;                 // [Nl,C]
    BufferRef ln1_mean, ln1_rstd;  // [Nl], [Nl]
    BufferRef qkv;                 // [N,3Cl]
    BufferRef att;                 // [B,NHl,T,T] softmax probabilities (unfused attention; else empty)
    BufferRef lse;                 // [B,NHl,T]   row log-sum-exp of the scaled scores (flash; else empty)
    BufferRef atty;                // [N,Cl]
    BufferRef xmid;                // [Nl,C]  residual after attention
    BufferRef ln2;                 // [Nl,C]
    BufferRef ln2_mean, ln2_rstd;  // [Nl], [Nl]
    BufferRef fch;                 // [N,Fl]  (Llama: the gate)
    BufferRef fcu;                 // [N,Fl]  Llama: the up projection (else empty)
    BufferRef fch_gelu;            // [N,Fl]  (Llama: silu(gate) * up)
    // With experts fch and fch_gelu are [N*k,Fl], the experts' rows one after the other, and:
    BufferRef moe_y;                // [N*k,C] each expert row's output (this rank's partial sum under tp)
    BufferRef moe_rows, moe_gates;  // [N*k] int32 the token of each expert row, fp32 its gate
    // Expert parallelism (ep > 1): the rows this rank's experts received, expert by expert (fch and
    // fch_gelu then hold theirs), and the order between the exchange's (source-major) and theirs.
    BufferRef moe_x;              // [R,C] R: Geometry::expert_rows()
    BufferRef moe_perm, moe_inv;  // [R] int32: expert-major row j is received row perm[j]; inv the inverse
    std::int64_t floats;          // the whole table, in floats
  };
  struct Scratch {                            // not saved across kernels: forward temporaries and backward gradients
    BufferRef full, partial, local;           // [N,C], [N,C], [Nl,C]
    BufferRef dres, dlocal, dfull, dpartial;  // [Nl,C] x2, [N,C] x2
    BufferRef dqkv, datty, dfch, dfch_gelu;   // [N,3Cl], [N,Cl], [N,Fl], [N,Fl]
    BufferRef datt, dsum;                     // [T,T] unfused; [B,NHl,T] flash: rowsum(dout * out)
    BufferRef pos, dpos;                      // [T,C] context parallel: this rank's position rows, their gradient
    BufferRef q, k, v;  // Llama: [N,Cl], [N,KVl*hs] x2: the products' q, k, v, then their gradients
    BufferRef dfcu;     // Llama: [N,Fl] the up product's dout (dfch: the gate's)
    // Experts: an expert's gathered input (any type) and output gradient [N,C]; the router's logits
    // (then their gradient) [N,E]; the gates' gradient [N*k].
    BufferRef moe_x, moe_dy, router, dgate;
    BufferRef moe_send, moe_recv;  // ep > 1: the exchange's rows [max(N*k, R), C]
    std::int64_t floats;
  };
  struct Head {
    BufferRef lnf;                 // [Nl,C] (16-bit like ln1 under mixed precision)
    BufferRef lnf_mean, lnf_rstd;  // [Nl], [Nl]
    BufferRef dlogits;             // [N,Vl] the slot's: fp32, or 16-bit under mixed precision
    BufferRef losses;              // [N]
    BufferRef logits, probs;       // [N,Vl], probs = logits (overwritten in place): dlogits itself in fp32,
                                   // under mixed precision one fp32 table for every slot (GPT::head)
    std::int64_t floats;
  };
  // What sizes the activation tables: the model, the tp split, the rows of a micro-batch, the
  // products' operand type.
  struct Geometry {
    GPTConfig cfg;
    int tp = 1;
    bool sp = false;
    int max_rows = 1;
    DType mm16 = DType::f32;
    MemSpace space = MemSpace::host;  // where the tables live (the back end's space)
    int cp = 1;                       // context ranks: each holds T() = seq_len / cp tokens of a sequence
    int ep = 1;                       // expert-parallel ranks: each holds experts / ep of a block's
    std::int64_t T() const { return cfg.seq_len / cp; }
    // The rows a rank's experts can receive in a block: k of each of the group's N tokens, no more than
    // every token once per expert, nor (with a capacity) the capacity of each sequence.
    std::int64_t expert_rows() const;
    // The most rows one expert can take.
    std::int64_t rows_per_expert() const;
  };
  // Each activation table carved from `base` (null: only sized; `floats` says how much it takes).
  static BlockActs carve_block(const Geometry& g, float* base);
  static Scratch carve_scratch(const Geometry& g, float* base);
  static Head carve_head(const Geometry& g, float* base);
  static std::int64_t head_logits_floats(const Geometry& g);
  // The block's tensors from the store's view of its unit.
  // Layer l's tensors in `view` (its unit's), found by their handles.
  BlockParams block_params(const ParamStore::UnitView& view, int l, bool grads) const;
  LlamaParams llama_params(const ParamStore::UnitView& view, int l, bool grads) const;
  void attention(const BlockActs& a, const Scratch& s, int B, int T, int Cl, int NHl);
  void attention_backward(const BlockActs& a, const Scratch& s, int B, int T, int Cl, int NHl);
  void llama_block_forward(int chunk, int slot, int layer, int B, int next_unit);
  // A block's experts (core/model/moe.cpp): forward from the block's ln2 to the partial sum of the
  // experts' outputs in s.partial (the caller reduces it), backward from dy [N,C] to ln2's partial
  // gradient in s.dpartial.
  void moe_forward(const ParamStore::UnitView& view, const BlockActs& a, const Scratch& s, int chunk, int slot, int l,
                   int N, bool recompute);
  void moe_backward(const ParamStore::UnitView& view, const BlockActs& a, const Scratch& s, const BufferRef& dy,
                    int chunk, int slot, int l, int N);
  void moe_dispatch(MoeRouting& r, const BlockActs& a, const Scratch& s, const BufferRef& in);
  void moe_return(const MoeRouting& r, const BlockActs& a, const Scratch& s, const BufferRef& rows,
                  const BufferRef& out, int C);
  std::vector<std::int64_t> send_rows(const MoeRouting& r) const;  // to each ep rank (ep > 1)
  std::vector<std::int64_t> recv_rows(const MoeRouting& r) const;  // from each ep rank
  // The local experts' MLPs on rows x [R,C] expert by expert (`rows[e]` of them, from the block's
  // saved tables at their offset), forward into y [R,C] (fp32), or backward from dy [R,C] into dx [R,C].
  void experts_forward(const ParamStore::UnitView& view, const BlockActs& a, int l, const std::vector<int>& begin,
                       const BufferRef& x, const BufferRef& y);
  void experts_backward(const ParamStore::UnitView& view, const BlockActs& a, const Scratch& s, int l,
                        const std::vector<int>& begin, const BufferRef& x, const BufferRef& dy, const BufferRef& dx);
  std::size_t routing_index(int chunk, int slot, int layer) const;
  void llama_block_backward(int chunk, int slot, int layer, int B, int next_unit);
  // This rank's kv heads (Llama): KV/tp of them from kv_head0 when tp divides KV, else all KV (replicated).
  int kv_local() const;
  int kv_head0() const;
  // Tensor `param`'s operand in a matrix product: its 16-bit compute copy when the store has one.
  BufferRef matmul_operand(const ParamStore::UnitView& view, int param) const;
  // A saved activation as a product's operand, gathered to all N rows (Partition::to_full) when the
  // saved piece has Nl; a 16-bit piece is never gathered (saved so only without sequence parallelism).
  BufferRef input_of(const BufferRef& saved, const BufferRef& full, int N, int C);
  const BufferRef& tensor(const ParamStore::UnitView& view, int param) const {
    return view.params[static_cast<std::size_t>(pos_in_unit_[static_cast<std::size_t>(param)])];
  }
  const BufferRef& tensor_grad(const ParamStore::UnitView& view, int param) const {
    return view.grads[static_cast<std::size_t>(pos_in_unit_[static_cast<std::size_t>(param)])];
  }
  // A pointer from outside (a pipeline neighbour's activations): n fp32 elements of this back end's memory.
  BufferRef here(const float* p, std::int64_t n) const { return BufferRef(p, n, be_.space()); }
  // The unit holding the tied wte on this rank: the embeddings on the first stage, else the head.
  int wte_unit() const { return params_[static_cast<std::size_t>(wte_)].unit; }
  // The unit holding the head's weight (the tied wte, or lm_head).
  int head_weight_unit() const { return params_[static_cast<std::size_t>(head_w_)].unit; }
  BlockActs block_acts(int chunk, int slot, int layer) const;
  Scratch scratch() const;
  Head head(int slot) const;
  // block `layer`'s input in slot `slot` of chunk `chunk`, [Nl,C]; at the chunk's end_layer, its output
  BufferRef residual(int chunk, int slot, int layer) const;
  void block_forward(int chunk, int slot, int layer, int B, bool recompute = false);
  void block_backward(int chunk, int slot, int layer,
                      int B);  // gradient of the block's output in, of its input out: scratch().dres
  void check_slot(int chunk, int slot, const char* what) const;

  GPTConfig cfg_;
  Backend& be_;
  Partition default_partition_;
  ContextSplit default_context_;
  ContextSplit* ctx_ = &default_context_;
  ExpertSplit default_experts_;
  ExpertSplit* ep_ = &default_experts_;
  int T_ = 0;  // local tokens of a sequence
  Partition* part_;
  int tp_ = 1, tp_rank_ = 0;
  bool sp_ = false;
  int vocab_begin_ = 0, vocab_local_ = 0;  // this rank's rows of the token table
  int max_rows_;
  DType mm16_ = DType::f32;  // the matrix products' operand type (Precision::matmul)
  Stage stage_;
  std::vector<int> layer_pos_;  // per layer of the model: its position among this rank's, or -1
  // Handles: indices into params_ (-1: not on this rank) and units_.
  int wte_ = -1, wpe_ = -1, lnfw_ = -1, lnfb_ = -1;
  int head_w_ = -1;  // the head's weight: wte_ when tied, else lm_head.weight
  int emb_unit_ = -1, head_unit_ = -1;
  std::vector<int> block_unit_;  // per layer of the model, -1 when not on this rank
  // per layer: its tensors' handles, in BlockParams order (-1: none), then the router's and each expert's
  // fc.weight, fc.bias, proj.weight, proj.bias (core/model/moe.cpp)
  std::vector<std::vector<int>> block_tensors_;
  std::vector<int> pos_in_unit_;  // per tensor: its position in its unit
  std::vector<Unit> units_;
  FlatParamStore own_store_;
  ParamStore* store_ = nullptr;
  std::vector<std::int64_t> residual0_, acts0_;  // per chunk: its first residual / block-activation index
  std::vector<std::vector<int>> slot_rows_;      // per chunk and slot: rows of the forward held (0: free)
  std::vector<std::vector<bool>>
      slot_scored_;                // per chunk and slot: that forward had targets (a loss to differentiate)
  std::vector<float> slot_dloss_;  // per slot of the last chunk: the fused classifier's dloss (NaN: not fused)
  int probs_slot_ = -1;            // under mixed precision: the slot whose probabilities the shared logits hold
  std::vector<ParamInfo> params_, all_params_;
  std::int64_t num_params_ = 0;
  // activations
  Geometry geom_;
  std::int64_t block_act_floats_ = 0;
  std::int64_t head_floats_ = 0;
  TypedBuffer residual_buf_;  // per chunk [slots, Lc+1, Nl, C]
  TypedBuffer block_buf_;     // per chunk [slots x Lc], or 1 (recompute); block_act_floats_ each
  // model's last chunk, per slot: lnf [Nl,C], lnf_mean/rstd [Nl], dlogits [N,Vl] (fp32 = logits = probs,
  // or 16-bit), losses [N]; then, under mixed precision, once: the fp32 logits [N,Vl] (the fused
  // classifier reads them within the forward that wrote them)
  TypedBuffer head_buf_;
  std::int64_t head_logits_at_ = 0;  // where in head_buf_ the shared fp32 logits are (mixed precision)
  TypedBuffer scratch_buf_;          // forward tmp and backward gradients of activations
  TypedBuffer tokens_buf_;           // int32 [max slots, 2, N] inputs (chunk 0's slots), targets (last chunk's)
  std::vector<MoeRouting> routing_;  // per chunk, slot and layer: the last forward's routing
  MoeStats moe_stats_;
  bool training_forward_ = false;  // the forward running was given dloss (its routing is counted)
  float backward_dloss_ = 0;       // the backward running's dloss (the experts' auxiliary losses' scale)
  std::function<void(int)> grad_ready_;
  std::function<void()> progress_;
};

}  // namespace loom
