// The deck keys of the core: model, data, train, parallel, run.
#include <string>
#include <utility>
#include <vector>

#include "io/deck.hpp"
#include "io/threads.hpp"

namespace loom {

namespace {

bool starts_with(const std::string& s, const std::string& prefix) { return s.compare(0, prefix.size(), prefix) == 0; }

// synthetic, text:PATH or tokens:GLOB with a non-empty PATH/GLOB.
bool is_data_source(const std::string& v) {
  if (v == "synthetic") return true;
  if (starts_with(v, "text:")) return v.size() > 5;
  if (starts_with(v, "tokens:")) return v.size() > 7;
  return false;
}

std::string check_source(const std::string& v) {
  return is_data_source(v) ? "" : "synthetic, text:PATH or tokens:GLOB (PATH/GLOB not empty)";
}

std::string check_val_source(const std::string& v) {
  return v.empty() || is_data_source(v)
             ? ""
             : "empty (held-out split of data.source), synthetic, text:PATH or tokens:GLOB (PATH/GLOB not empty)";
}

}  // namespace

void add_core_keys(DeckSchema& schema) {
  // model
  schema.add(int_key("model.layers", "4", 1, 1024, "number of transformer blocks"));
  schema.add(int_key("model.d_model", "128", 1, 65536, "width of the residual stream (embedding size)"));
  schema.add(int_key("model.heads", "4", 1, 1024, "attention heads per block (must divide d_model)"));
  schema.add(int_key("model.seq_len", "64", 1, 1048576, "context length in tokens"));
  schema.add(int_key("model.vocab", "256", 2, 1048576, "vocabulary size (256 for text:PATH bytes)"));
  schema.add(choice_key("model.arch", "gpt2", {"gpt2", "llama"},
                        "the block: gpt2 (LayerNorm with biases, learned positions, GELU MLP, tied head) or llama "
                        "(RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, no biases, untied head "
                        "by default)"));
  schema.add(int_key("model.kv_heads", "0", 0, 1024,
                     "llama: key/value heads, dividing model.heads (grouped-query attention; 1 = multi-query; "
                     "0 = model.heads)"));
  schema.add(int_key("model.ffn_hidden", "0", 0, 1048576,
                     "llama: the SwiGLU MLP's width (0 = Llama's rounding of 8/3 d_model up to a multiple of "
                     "256; gpt2: 4 d_model)"));
  schema.add(float_key("model.norm_eps", "1e-5", 0, 1, "llama: RMSNorm's eps (gpt2's LayerNorm keeps 1e-5)"));
  schema.add(float_key("model.rope_theta", "10000", 1, 1e12, "llama: the rotary embeddings' base"));
  schema.add(choice_key("model.tie_embeddings", "auto", {"auto", "true", "false"},
                        "whether the output layer is the token table: auto = gpt2 true, llama false (lm_head)"));
  schema.add(int_key("model.experts", "0", 0, 4096,
                     "mixture of experts: this many expert MLPs and a router replace the MLP of every "
                     "model.moe_every-th block (0 = dense; gpt2 blocks)"));
  schema.add(int_key("model.moe_every", "1", 1, 1024,
                     "with model.experts: blocks l with (l + 1) % moe_every == 0 have experts (1 = every block, "
                     "2 = every other, as Switch and GShard)"));
  schema.add(int_key("model.experts_per_token", "2", 1, 64,
                     "with model.experts: the experts each token goes to (top-k of the router's softmax, their "
                     "probabilities renormalised over the k)"));
  schema.add(int_key("model.moe_ffn_hidden", "0", 0, 1048576,
                     "with model.experts: an expert MLP's width (0 = the dense MLP's, 4 x d_model); narrower, "
                     "finer experts (DeepSeekMoE's) keep a token's active parameters as experts multiply"));
  schema.add(float_key("model.expert_capacity", "0", 0, 1e6,
                       "with model.experts: capacity factor; an expert takes at most ceil(factor x seq_len x k / "
                       "experts) of a sequence's tokens (in token order: causal), the rest "
                       "dropped (they pass through the residual, counted); 0 = dropless"));
  schema.add(
      bool_key("model.recompute", "false", "recompute each block's activations in backward instead of keeping them"));
  schema.add(choice_key(
      "model.attention", "unfused", {"unfused", "flash", "cudnn", "auto"},
      "attention kernels: unfused (scores and probabilities [T,T] per head in memory, "
      "products with bf16 operands in a bf16 run on the host back end or under cp, else fp32), flash (fused, "
      "FlashAttention-2's tiling: saves "
      "each row's log-sum-exp instead of the probabilities and recomputes them in backward; "
      "q, k, v, probabilities and their gradients as bf16 operands, fp32 softmax and "
      "accumulation; head sizes 16, 32, 64, 128; the same arithmetic on the host and cuda "
      "back ends), cudnn (cuDNN's fused flash attention on a CUDA device: the same contract "
      "as flash, bf16 operands, its own kernels) or auto (cudnn where the device and shape "
      "allow, else flash on a device, else unfused; the banner says which and why)"));
  schema.add(string_key("model.init_from", "",
                        "start from these weights instead of a random initialisation: an llm.c model file "
                        "(.bin, as llm.c's train_gpt2.py writes; `loom ckpt llmc` writes one from a checkpoint), "
                        "or a folder of Hugging Face's GPT-2 or Llama files (config.json, model.safetensors; "
                        "`loom ckpt hf` writes one); its shape must be the deck's model.* "
                        "(checkpoint.resume, when it loads, wins)"));

  // data
  schema.add(string_key("data.source", "synthetic",
                        "training data: synthetic (Markov chain), text:PATH (bytes of a file) or "
                        "tokens:GLOB (llm.c shards: uint16, or uint32 version 2; `loom data prepare` writes them)",
                        check_source));
  schema.add(float_key("data.val_fraction", "0.1", 0.0, 0.9,
                       "share of the token stream held out for validation (text/tokens)"));
  schema.add(float_key("data.synthetic_noise", "0.1", 0.0, 1.0,
                       "probability a synthetic token is drawn uniformly instead of following the chain"));
  schema.add(string_key("data.val_source", "",
                        "optional separate validation source, same syntax as data.source; empty = "
                        "held-out split of data.source",
                        check_val_source));
  schema.add(string_key("data.tokenizer", "",
                        "SentencePiece .model of the data's tokens: model.vocab is checked against it before step 1 "
                        "and validation reports bits per byte; empty = the one a manifest.json beside the "
                        "tokens: shards names (`loom data prepare`), if any"));

  // train
  schema.add(int_key("train.steps", "100", 1, 1e12, "optimizer steps to run"));
  schema.add(int_key("train.batch", "8", 1, 1e9, "global batch in sequences (over all data-parallel ranks)"));
  schema.add(int_key("train.micro_batches", "1", 1, 1e6,
                     "micro-batches per step (gradient accumulation / pipeline micro-batches)"));
  schema.add(float_key("train.lr", "3e-4", 0, 10, "peak learning rate"));
  schema.add(float_key("train.lr_min", "0", 0, 10, "floor of the cosine schedule"));
  schema.add(choice_key("train.schedule", "cosine", {"constant", "cosine"}, "learning-rate schedule after warmup"));
  schema.add(int_key("train.warmup", "0", 0, 1e12, "steps of linear learning-rate warmup from 0"));
  schema.add(float_key("train.weight_decay", "0.1", 0, 10, "AdamW decoupled weight decay"));
  schema.add(float_key("train.beta1", "0.9", 0, 0.999999, "AdamW first-moment decay"));
  schema.add(float_key("train.beta2", "0.95", 0, 0.999999, "AdamW second-moment decay"));
  schema.add(float_key("train.eps", "1e-8", 0, 1, "AdamW epsilon"));
  schema.add(float_key("train.moe_aux_loss", "0.01", 0, 100,
                       "with model.experts: weight of each expert block's load-balancing loss (Switch/GShard's "
                       "E x sum_e f_e P_e, per sequence) in the objective; reported as moe_aux"));
  schema.add(float_key("train.moe_z_loss", "0.001", 0, 100,
                       "with model.experts: weight of each expert block's router z-loss (mean "
                       "logsumexp(logits)^2, ST-MoE) in the objective; reported as moe_z"));
  schema.add(float_key("train.grad_clip", "1.0", 0, 1e6, "clip the global gradient norm to this (0 = no clipping)"));
  schema.add(int_key("train.seed", "1337", 0, 9.2e18, "seed of initialization and data order"));
  schema.add(int_key("train.eval_every", "0", 0, 1e12, "steps between validation evaluations (0 = only at the end)"));
  schema.add(int_key("train.eval_batches", "4", 1, 1e6, "batches averaged per validation evaluation"));
  schema.add(int_key("train.log_every", "1", 1, 1e12, "steps between progress lines"));
  schema.add(choice_key("train.on_nonfinite", "stop", {"stop", "skip"},
                        "a step whose loss or gradient norm is nan/inf: stop (exit 1) or skip its update on every "
                        "rank and go on (counted; stops after train.max_skipped in a row)"));
  schema.add(int_key("train.max_skipped", "10", 1, 1e9,
                     "with train.on_nonfinite = skip: stop after this many skipped steps in a row"));
  schema.add(choice_key("train.on_spike", "none", {"none", "skip", "rollback", "stop"},
                        "a loss spike (the loss or the gradient norm more than train.spike_loss_z / "
                        "train.spike_norm_z standard deviations above the mean of the last train.spike_window "
                        "steps): none (not watched), skip its update, rollback (reload the last checkpoint and "
                        "skip the data from it to the spike), or stop (exit 1)"));
  schema.add(int_key("train.spike_window", "32", 4, 1e6,
                     "steps of loss and gradient norm the spike detector's mean and deviation are taken over "
                     "(it judges once the window is full; spikes are left out of it)"));
  schema.add(float_key("train.spike_loss_z", "6", 0, 1e6,
                       "a loss this many standard deviations above the window's mean is a spike (0 = the loss "
                       "is not watched)"));
  schema.add(float_key("train.spike_norm_z", "6", 0, 1e6,
                       "a gradient norm this many standard deviations above the window's mean is a spike (0 = "
                       "the norm is not watched)"));
  schema.add(int_key("train.spike_skip_batches", "0", 0, 1e9,
                     "with train.on_spike = rollback: global batches skipped after the spike's own (a bad "
                     "stretch of data), beyond those from the checkpoint to the spike"));
  schema.add(int_key("train.max_rollbacks", "3", 1, 1e6,
                     "with train.on_spike = rollback: stop after this many rollbacks with no checkpoint written "
                     "between them"));

  // parallel
  schema.add(int_key("parallel.dp", "1", 1, 1e6, "data-parallel degree"));
  schema.add(int_key("parallel.tp", "1", 1, 1e6, "tensor-parallel degree"));
  schema.add(int_key("parallel.pp", "1", 1, 1e6, "pipeline-parallel degree (stages)"));
  schema.add(
      int_key("parallel.cp", "1", 1, 1e6,
              "context-parallel degree: each rank holds seq_len / cp tokens of every sequence (ring attention)"));
  schema.add(int_key("parallel.ep", "1", 1, 1e6,
                     "expert-parallel degree (model.experts): the experts split over groups of ep data-parallel "
                     "ranks, tokens sent to their experts' ranks and back (all-to-all); ep divides parallel.dp"));

  // run
  schema.add(string_key("run.dir", "runs/loom", "directory for the run's outputs (metrics, checkpoints, report)"));
  schema.add(string_key("run.threads", "auto",
                        "BLAS threads per rank: a number, or auto (OMP_NUM_THREADS, else SLURM_CPUS_PER_TASK, else 1)",
                        check_threads_setting));
  schema.add(choice_key("run.backend", "host", {"host", "cuda", "auto", "fenced"},
                        "where the model computes: host (Kokkos + oneDNN/BLAS on the CPU), cuda (one GPU per rank, "
                        "the rank's index within its node; CUDA kernels + cuBLASLt; NCCL between GPUs), auto (cuda "
                        "when every rank of a node has a GPU, else host) or fenced (the host kernels on memory the "
                        "host cannot touch: checks without a GPU that a strategy reaches tensors only through the "
                        "back end)"));
  schema.add(bool_key("run.share_gpu", "false",
                      "cuda back end: several ranks of a node may drive one GPU (rank i of a node drives GPU i mod "
                      "the GPUs); their device buffers then travel through host copies and MPI, as NCCL refuses "
                      "two ranks on one GPU. For checking layouts on a one-GPU machine, not for speed"));
  schema.add(choice_key("run.tf32", "auto", {"auto", "true", "false"},
                        "cuda back end: whether fp32 matrix products may use TF32 tensor cores (10-bit mantissa "
                        "products, fp32 accumulation; as torch.backends.cuda.matmul.allow_tf32): true, false, or "
                        "auto (in a bf16/fp16 run, whose only fp32 products are attention's, which TF32 keeps more "
                        "exact than the 16-bit products the run asked for; not in an fp32 run)"));
  schema.add(choice_key("run.gemm", "auto", {"auto", "onednn", "blas"},
                        "matrix products of the host back end: auto (oneDNN when loom is built with it, else "
                        "BLAS), onednn (oneDNN matmul primitives, cached per shape) or blas (cblas_sgemm)"));
  schema.add(bool_key("run.overwrite", "false",
                      "a fresh run may replace an earlier run's checkpoints in checkpoint.dir (removed at start) "
                      "and its results in run.dir (metrics.jsonl, summary.json, report.json: moved to *.earlier); "
                      "otherwise such a run is refused"));
  schema.add(bool_key("run.tensorboard", "false",
                      "rank 0 also writes the metrics.jsonl rows as a TensorBoard event file in run.dir "
                      "(events.out.tfevents.<unix seconds>.<host>; a new file per run and per resume): "
                      "tensorboard --logdir <run.dir>"));
  schema.add(float_key("run.straggler_factor", "0", 0, 1e6,
                       "name a rank whose busy time per step (its step time less its waits at collectives) is "
                       "more than this many times the other ranks' median, with its host and the phase it is "
                       "slow in (0 = not watched; e.g. 1.5)"));
  schema.add(int_key("run.straggler_every", "10", 1, 1e9,
                     "with run.straggler_factor: steps between the ranks' exchanges of their step times"));
  schema.add(float_key("run.memory_limit", "0", 0, 1e9,
                       "GiB a rank may use, checked against the plan's prediction of each rank on this node before "
                       "the first allocation (0: the ranks on this node share its memory, the least of MemTotal and "
                       "the cgroup limits; a cuda or auto run is checked only when this is set)"));
  schema.add(float_key("run.peak_tflops", "0", 0, 1e6,
                       "peak TFLOP/s of one rank for the MFU figure (0: the back end's matrix-product rate, "
                       "measured at start-up)"));
  schema.add(
      float_key("run.comm_timeout", "300", 0, 1e7,
                "seconds a rank waits for a peer's message before it ends the job naming that peer (0: forever)"));
  schema.add(float_key("run.emulate_link_gbps", "0", 0, 1e6,
                       "benchmarks: emulate a slower network on one node: every rank's sends share a link of this "
                       "many Gbit/s (0: off, the real transport's speed)"));
  schema.add(float_key("run.emulate_link_latency_us", "0", 0, 1e7,
                       "benchmarks: with run.emulate_link_gbps, the latency added to every message, in microseconds"));
  schema.add(
      string_key("checkpoint.dir", "",
                 "where checkpoints are written (empty: <run.dir>/checkpoints); `latest` there names the newest"));
  schema.add(int_key("checkpoint.every", "0", 0, 1e12,
                     "save a checkpoint every this many steps (0: only at the end and on SIGTERM/SIGINT)"));
  schema.add(bool_key("checkpoint.at_end", "true",
                      "save a final checkpoint when training ends, if checkpointing is configured "
                      "(checkpoint.every, checkpoint.dir or checkpoint.resume given)"));
  schema.add(bool_key("checkpoint.async", "false",
                      "copy the step's state to host memory and write the checkpoint on a thread of its own "
                      "while training goes on (the next save, a stop signal and the end wait for it)"));
  schema.add(int_key("checkpoint.keep", "2", 1, 1e6,
                     "how many checkpoints to keep (older ones are deleted once a newer one is complete)"));
  schema.add(string_key("checkpoint.resume", "",
                        "start from this checkpoint file, `latest` in checkpoint.dir, or `auto` (latest if it "
                        "exists, else fresh: one job script for every job of a chain); empty: start fresh"));
  schema.add(
      string_key("run.plugins", "",
                 "extra strategy plugins to use, comma-separated (the layout adds data/tensor/pipeline itself)"));
}

}  // namespace loom
