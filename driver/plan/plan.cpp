// `loom plan`: the machine a plan is for. `--cluster FILE|PRESET` reads a cluster
// description (driver/plan/cost_model.hpp) and `--show` prints it; `--calibrate` measures the machine it runs on
// with loom's own back end (the matrix products' rate per dtype and fixed cost per call, attention's
// rate and fixed cost per sequence and head, a block's element-wise kernels, the optimizer's pass, each
// counted by the functions of driver/plan/cost_model.hpp that the prediction counts with) and MPI (bandwidth and
// latency between ranks inside a node and between nodes), and writes such a file.
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iterator>
#include <fstream>
#include <iostream>
#include <sstream>
#include <vector>

#include "core/backend/backend.hpp"
#include "core/base/clock.hpp"
#include "core/comm/comm.hpp"
#include "core/base/error.hpp"
#include "driver/memory_check.hpp"
#include "driver/commands.hpp"
#include "driver/plan/cost_model.hpp"

namespace loom {
namespace {

// A buffer of `n` values of `type` of the back end, filled with small values (varied, so LayerNorm's
// rows have a spread and GELU is not evaluated at one point).
TypedBuffer small_values(Backend& be, const std::string& label, std::int64_t n, DType type = DType::f32) {
  TypedBuffer f = be.allocate(label, DType::f32, n, Mem::workspace);
  std::vector<float> host(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = 0.01f * static_cast<float>(static_cast<int>(i % 97) - 48);
  be.copy_from_host(f.ref(), host.data());
  if (type == DType::f32) return f;
  TypedBuffer t = be.allocate(label, type, n, Mem::workspace);
  be.cast(t.ref(), f.ref());
  return t;
}

// The best time of `f` over `reps` calls after `warm` warm-up calls.
template <class F>
double best_seconds(Backend& be, int reps, F&& f, int warm = 2) {
  double best = 1e30;
  for (int rep = 0; rep < reps + warm; ++rep) {
    be.synchronize();
    const double t0 = now();
    f();
    be.synchronize();
    if (rep >= warm) best = std::min(best, now() - t0);
  }
  return best;
}

// Seconds of one matrix-product call beyond its FLOPs (the library's dispatch; a device's launch):
// [8, 8] x [8, 8] products, whose 1024 FLOPs take a nanosecond or so, in batches of 200, the best batch.
double matmul_call_seconds() {
  auto be = make_host_backend(1);
  constexpr int n = 8, calls = 200;
  TypedBuffer a = small_values(*be, "plan::calibrate.call_a", n * n);
  TypedBuffer w = small_values(*be, "plan::calibrate.call_w", n * n);
  TypedBuffer c = be->allocate("plan::calibrate.call_c", DType::f32, n * n, Mem::workspace);
  const double t = best_seconds(*be, 10, [&] {
    for (int i = 0; i < calls; ++i) be->matmul_forward(c.ref(), a.ref(), w.ref(), {}, n, n, n);
  });
  be->release_scratch();
  return t / calls;
}

// Seconds of the back end's matrix products with `dtype` operands (fp32 accumulation) as a step runs
// them: the products of kLayers transformer blocks `C` wide (block_counts, driver/plan/cost_model.hpp) at N token
// rows, forward layer by layer and backward in reverse through matmul_forward/_backward, the weights
// of `dtype` (a 16-bit run's compute copies), the activations fp32 and each layer's its own (so that,
// as in a step, a product's operands were last touched a while before): the best of 3 passes. Of those, kLayers *
// (block_counts' GEMMs) x matmul_call_us are the calls' fixed cost, the rest what the FLOPs run at (block_matmul_rate).
constexpr int kLayers = 2;
double block_matmul_seconds(DType dtype, int N, int C) {
  auto be = make_host_backend(1);
  Precision p;
  p.matmul = dtype;
  be->set_precision(p);
  // Per layer, the four products (input width, output width) of block_counts.
  const int shape[4][2] = {{C, 3 * C}, {C, C}, {C, 4 * C}, {4 * C, C}};
  struct Product {
    TypedBuffer in, w, out, din, dw;
    int c = 0, oc = 0;
  };
  std::vector<Product> layers;
  for (int l = 0; l < kLayers; ++l)
    for (const auto& s : shape) {
      Product q;
      q.c = s[0];
      q.oc = s[1];
      const std::string tag = "plan::calibrate.mm" + std::to_string(layers.size());
      q.in = small_values(*be, tag + ".in", static_cast<std::int64_t>(N) * q.c);
      q.w = small_values(*be, tag + ".w", static_cast<std::int64_t>(q.oc) * q.c, dtype);
      q.out = be->allocate(tag + ".out", DType::f32, static_cast<std::int64_t>(N) * q.oc, Mem::workspace);
      q.din = be->allocate(tag + ".din", DType::f32, static_cast<std::int64_t>(N) * q.c, Mem::workspace);
      q.dw = be->allocate(tag + ".dw", DType::f32, static_cast<std::int64_t>(q.oc) * q.c, Mem::workspace);
      layers.push_back(std::move(q));
    }
  const double t = best_seconds(
      *be, 3,
      [&] {
        for (Product& q : layers) be->matmul_forward(q.out.ref(), q.in.ref(), q.w.ref(), {}, N, q.c, q.oc);
        for (auto it = layers.rbegin(); it != layers.rend(); ++it)
          be->matmul_backward(it->din.ref(), it->dw.ref(), {}, it->out.ref(), it->in.ref(), it->w.ref(), N, it->c,
                              it->oc);
      },
      1);
  be->release_scratch();
  return t;
}
double block_matmul_rate(double seconds, int N, int C, double call_s) {
  const BlockCounts b = block_counts(N, N, C, 1);
  const double gemms = kLayers * (b.gemms_fwd + b.gemms_bwd);
  return kLayers * (b.matmul_flops_fwd + b.matmul_flops_bwd) / std::max(seconds - gemms * call_s, 0.5 * seconds);
}

// The widths the products are measured at, and the token rows of each (1024 up to 128 wide, then
// fewer, to keep the wide ones short: the rate depends on the width, hardly on the rows).
constexpr int kWidths[] = {64, 128, 256, 512};
int rows_at(int width) { return width <= 128 ? 1024 : 1024 * 128 / width; }

// The attention's rate and its fixed cost per sequence and head: the back end's attention forward +
// backward (fp32) timed at two shapes, B=16, T=32, C=64, 4 heads (the fixed cost dominates) and B=4,
// T=256, C=256, 4 heads (the FLOPs dominate), best of 5 each (`ts`, `tl`), and t = B * heads * head_s +
// attention_flops / rate solved for both (driver/plan/cost_model.hpp counts the FLOPs, for the prediction too).
// The same for the fused attention (model.attention = flash: head sizes 16 and 64, which it takes),
// counted with the same FLOPs.
struct AttentionRate {
  double flops_per_s = 0, head_s = 0;
};
double attention_seconds(int B, int T, int C, int NH, bool flash) {
  auto be = make_host_backend(1);
  const std::int64_t bt = static_cast<std::int64_t>(B) * T;
  // The unfused kernels' [B, NH, T, T] probabilities and their gradients; the fused one's lse and dsum [B, NH, T].
  const std::int64_t saved_n = static_cast<std::int64_t>(B) * NH * T * (flash ? 1 : T);
  TypedBuffer qkv = small_values(*be, "plan::calibrate.qkv", bt * 3 * C);
  TypedBuffer dout = small_values(*be, "plan::calibrate.dout", bt * C);
  TypedBuffer out = be->allocate("plan::calibrate.out", DType::f32, bt * C, Mem::workspace);
  TypedBuffer saved = be->allocate("plan::calibrate.att", DType::f32, saved_n, Mem::workspace);
  TypedBuffer dqkv = be->allocate("plan::calibrate.dqkv", DType::f32, bt * 3 * C, Mem::workspace);
  TypedBuffer dsaved = be->allocate("plan::calibrate.datt", DType::f32, saved_n, Mem::workspace);
  const double t = best_seconds(*be, 5, [&] {
    if (flash) {
      be->attention_forward_flash(out.ref(), saved.ref(), qkv.ref(), B, T, C, NH);
      be->attention_backward_flash(dqkv.ref(), dsaved.ref(), dout.ref(), out.ref(), qkv.ref(), saved.ref(), B, T, C,
                                   NH);
    } else {
      be->attention_forward(out.ref(), saved.ref(), qkv.ref(), B, T, C, NH);
      be->attention_backward(dqkv.ref(), dsaved.ref(), dout.ref(), qkv.ref(), saved.ref(), B, T, C, NH);
    }
  });
  be->release_scratch();
  return t;
}
constexpr int Bs = 16, Ts = 32, Cs = 64, Bl = 4, Tl = 256, Cl = 256, NH = 4;
AttentionRate attention_rate(double ts, double tl) {
  const double hs = double(Bs) * NH, hl = double(Bl) * NH;
  const double fs = attention_flops(Bs, Ts, Cs), fl = attention_flops(Bl, Tl, Cl);
  AttentionRate r;
  const double denom = tl - ts * hl / hs;
  r.flops_per_s = denom > 0 ? (fl - fs * hl / hs) / denom : fl / tl;
  r.head_s = std::max(0.0, (ts - fs / r.flops_per_s) / hs);
  if (r.head_s == 0) r.flops_per_s = fl / tl;
  return r;
}

// A block's element-wise kernels as GPT runs them (block_counts: LayerNorm twice, the residual add
// twice, GELU over [N, 4C] forward; the LayerNorms', GELU's backward and the residual branch's two
// copies) over N rows of C, fp32, on the host back end.
class BlockKernels {
 public:
  BlockKernels(int N, int C) : N_(N), C_(C), be_(make_host_backend(1)) {
    const std::int64_t n = static_cast<std::int64_t>(N) * C;
    x_ = small_values(*be_, "plan::calibrate.x", n);
    dy_ = small_values(*be_, "plan::calibrate.dy", n);
    y_ = be_->allocate("plan::calibrate.y", DType::f32, n, Mem::workspace);
    y2_ = be_->allocate("plan::calibrate.y2", DType::f32, n, Mem::workspace);
    dx_ = be_->allocate("plan::calibrate.dx", DType::f32, n, Mem::workspace);
    h_ = small_values(*be_, "plan::calibrate.h", 4 * n);
    hg_ = be_->allocate("plan::calibrate.hg", DType::f32, 4 * n, Mem::workspace);
    dh_ = small_values(*be_, "plan::calibrate.dh", 4 * n);
    dhg_ = be_->allocate("plan::calibrate.dhg", DType::f32, 4 * n, Mem::workspace);
    w_ = small_values(*be_, "plan::calibrate.ln_w", C);
    b_ = small_values(*be_, "plan::calibrate.ln_b", C);
    dw_ = be_->allocate("plan::calibrate.ln_dw", DType::f32, C, Mem::workspace);
    db_ = be_->allocate("plan::calibrate.ln_db", DType::f32, C, Mem::workspace);
    mean_ = be_->allocate("plan::calibrate.mean", DType::f32, N, Mem::workspace);
    rstd_ = be_->allocate("plan::calibrate.rstd", DType::f32, N, Mem::workspace);
  }
  ~BlockKernels() { be_->release_scratch(); }
  Backend& backend() { return *be_; }
  // The bytes block_counts counts for one run().
  double bytes() const {
    const BlockCounts bc = block_counts(N_, N_, C_, 1);
    return bc.elementwise_bytes_fwd + bc.elementwise_bytes_bwd;
  }
  void run() {
    const std::int64_t n = static_cast<std::int64_t>(N_) * C_;
    layernorm_forward();
    be_->residual_forward(y2_.ref(), x_.ref(), dy_.ref(), n);
    layernorm_forward();
    be_->gelu_forward(hg_.ref(), h_.ref(), 4 * n);
    be_->residual_forward(y2_.ref(), x_.ref(), dy_.ref(), n);
    be_->gelu_backward(dhg_.ref(), h_.ref(), dh_.ref(), 4 * n);
    be_->copy(y2_.ref(), dy_.ref(), n);
    layernorm_backward();
    be_->copy(y2_.ref(), dy_.ref(), n);
    layernorm_backward();
  }

 private:
  void layernorm_forward() {
    be_->layernorm_forward(y_.ref(), mean_.ref(), rstd_.ref(), x_.ref(), w_.ref(), b_.ref(), N_, C_);
  }
  void layernorm_backward() {
    be_->layernorm_backward(dx_.ref(), dw_.ref(), db_.ref(), dy_.ref(), x_.ref(), w_.ref(), mean_.ref(), rstd_.ref(),
                            N_, C_);
  }
  int N_, C_;
  std::unique_ptr<Backend> be_;
  TypedBuffer x_, dy_, y_, y2_, dx_, h_, hg_, dh_, dhg_, w_, b_, dw_, db_, mean_, rstd_;
};

// Bytes per second of a block's element-wise kernels (BlockKernels) at N = 8192 rows, C = 256: the
// bytes block_counts counts over the best time of the whole sequence (of 4), so the kernels weigh as
// they do in a block.
double memory_rate() {
  BlockKernels k(8192, 256);
  return k.bytes() / best_seconds(k.backend(), 4, [&] { k.run(); });
}

// Bytes per second of the optimizer's pass as the engine runs it (optimizer_bytes, driver/plan/cost_model.hpp):
// the gradients zeroed, their squared norm, the clip's scale and AdamW over 4M parameters (64 MiB of
// weights, gradients and moments, more than a cache holds, as a model's are); best of 4.
double optimizer_rate() {
  auto be = make_host_backend(1);
  constexpr std::int64_t n = 4 << 20;
  TypedBuffer p = small_values(*be, "plan::calibrate.p", n);
  TypedBuffer g = small_values(*be, "plan::calibrate.g", n);
  TypedBuffer m = small_values(*be, "plan::calibrate.m", n);
  TypedBuffer v = small_values(*be, "plan::calibrate.v", n);
  be->scale(v.ref(), 0.0);  // the second moment starts non-negative
  const double t = best_seconds(*be, 4, [&] {
    be->fill(g.ref(), 0.0);
    be->sq_norm_check({g.ref()});
    be->scale(g.ref(), 0.5);
    be->adamw_update(p.ref(), m.ref(), v.ref(), g.ref(), n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 10);
  });
  be->release_scratch();
  return optimizer_bytes(static_cast<double>(n), static_cast<double>(n)) / t;
}

// Round trips of `bytes` between the two ranks of `pair` through loom's own communicator (its
// messages and its waits, which poll and yield as a step's do), halved: all `reps` of them.
std::vector<double> one_way_seconds(Communicator& pair, std::size_t bytes, int reps) {
  std::vector<float> buf(std::max<std::size_t>(1, bytes / sizeof(float)));
  const std::int64_t n = static_cast<std::int64_t>(buf.size());
  const int peer = 1 - pair.rank();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const double t0 = now();
    if (pair.rank() == 0) {
      pair.send_async(buf.data(), n, peer, 7)->wait();
      pair.recv_async(buf.data(), n, peer, 7)->wait();
    } else {
      pair.recv_async(buf.data(), n, peer, 7)->wait();
      pair.send_async(buf.data(), n, peer, 7)->wait();
    }
    t.push_back((now() - t0) / 2);
  }
  return t;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Link {
  double bytes_per_s = 0, latency_s = 0;
  bool measured = false;
};

// Between ranks a and b (every rank calls it; -1: no such pair), through loom's communicator while
// the other ranks wait in one of its collectives: the latency the median one way of 8-byte messages,
// the bandwidth from 1 MiB messages (a gradient bucket, a small model's activations; larger ones
// leave the caches), their best one way less the best 8-byte one, and less at most half of it: on a
// loaded machine the 8-byte times can come near the 1 MiB ones, and the difference alone then gave
// bandwidths of 1e6 GB/s, which the cluster file written from them refused.
Link measure_link(Communicator& world, int a, int b) {
  Link l;
  const int rank = world.rank();
  const bool in_pair = a >= 0 && b >= 0 && (rank == a || rank == b);
  MPI_Comm pair_comm;
  MPI_Comm_split(MPI_COMM_WORLD, in_pair ? 0 : 1, rank == a ? 0 : 1, &pair_comm);
  {
    std::unique_ptr<Communicator> pair = make_mpi_communicator(pair_comm, "link");
    if (in_pair) {
      one_way_seconds(*pair, 8, 20);  // warm-up
      const std::vector<double> small = one_way_seconds(*pair, 8, 200);
      l.latency_s = median(small);
      const std::size_t big = 1u << 20;
      one_way_seconds(*pair, big, 2);
      const std::vector<double> t = one_way_seconds(*pair, big, 20);
      const double best = *std::min_element(t.begin(), t.end());
      const double transfer = std::max(best - *std::min_element(small.begin(), small.end()), 0.5 * best);
      l.bytes_per_s = static_cast<double>(big) / std::max(transfer, 1e-9);
    }
  }
  MPI_Comm_free(&pair_comm);
  double v[2] = {in_pair && rank == a ? l.bytes_per_s : 0.0, in_pair && rank == a ? l.latency_s : 0.0};
  world.all_reduce_async(BufferRef(v, 2))->wait();  // the others wait here, polling and yielding
  l.bytes_per_s = v[0];
  l.latency_s = v[1];
  l.measured = a >= 0 && b >= 0;
  return l;
}

// The share of its compute a rank waits for the slowest rank when all of them synchronise between
// kernels, as a tensor-parallel or pipeline step does (ClusterSpec::sync_wait_share): in pairs of
// consecutive ranks (a group of 2, placed as tensor-parallel groups are; every pair at once), every
// rank runs kSegments segments of a block's element-wise kernels (BlockKernels at 512 x 256, about
// 1 ms here), once with an 8-byte all-reduce of its pair through loom's communicator after each
// segment, once with the all-reduces alone and once with the segments alone; the first less the other
// two, over the segments' time, is the share (each paired rank's, their mean). Ranks that run the same
// kernels in the same time wait for nobody (0); shared cores or a virtual machine's neighbours make
// them differ. The median of 5 (this measures the machine's variability, which the best of several
// would hide), floored at 0. 0 on one rank.
double sync_wait_share(Communicator& world) {
  if (world.size() < 2) return 0.0;
  constexpr int kSegments = 40, kRounds = 5;
  const int rank = world.rank();
  const bool paired = rank / 2 * 2 + 1 < world.size();  // an odd world's last rank has no partner
  const int pairs = world.size() / 2;
  BlockKernels k(512, 256);
  MPI_Comm pair_comm;
  MPI_Comm_split(MPI_COMM_WORLD, rank / 2, rank, &pair_comm);
  std::unique_ptr<Communicator> pair = make_mpi_communicator(pair_comm, "pair");
  double v[1] = {0};
  const auto all_reduce = [&] {
    if (paired) pair->all_reduce_async(BufferRef(v, 1))->wait();
  };
  // Every rank starts together, waiting in loom's communicator (which yields, as a step's waits do;
  // MPI_Barrier would spin on a core another rank needs).
  const auto start_together = [&] {
    double z[1] = {0};
    world.all_reduce_async(BufferRef(z, 1))->wait();
  };
  const auto timed = [&](bool compute, bool sync) {
    start_together();
    const double t0 = now();
    for (int i = 0; i < kSegments; ++i) {
      if (compute) k.run();
      if (sync) all_reduce();
    }
    return now() - t0;
  };
  timed(true, true);  // warm-up
  std::vector<double> shares;
  for (int r = 0; r < kRounds; ++r) {
    // The three timings in turn, in alternating order, so that the machine's drift cancels; each
    // round's share signed (noise either way), floored at 0 only once, after the median.
    double both = 0, messages = 0, segments = 0;
    if (r % 2 == 0) {
      both = timed(true, true);
      messages = timed(false, true);
      segments = timed(true, false);
    } else {
      segments = timed(true, false);
      messages = timed(false, true);
      both = timed(true, true);
    }
    double share[1] = {paired ? (both - messages - segments) / segments / (2 * pairs) : 0.0};
    world.all_reduce_async(BufferRef(share, 1))->wait();
    shares.push_back(share[0]);
  }
  pair.reset();
  MPI_Comm_free(&pair_comm);
  return std::max(0.0, median(shares));
}

// `sets`: cluster.*/network.* figures given with --set, which replace what is measured (and say so in
// the source): on one rank, which has no link to measure, the four network figures must be given. A
// bad --set key or value is refused before anything is measured. Each alone: rules between keys (a
// fixed cost with its rate) apply to the file written, where the measured figures join them.
void check_calibration_sets(int world, const std::vector<std::string>& sets) {
  const auto given = [&](const std::string& key) {
    return std::any_of(sets.begin(), sets.end(), [&](const std::string& s) { return s.rfind(key + "=", 0) == 0; });
  };
  std::string missing;
  for (const char* key : {"network.intra_node_gbs", "network.intra_node_latency_us", "network.inter_node_gbs",
                          "network.inter_node_latency_us"})
    if (!given(key)) missing += std::string(missing.empty() ? "" : ", ") + key;
  if (world < 2 && !missing.empty())
    throw InputError(
        "loom plan --calibrate measures the links between ranks: launch it on 2 ranks or more, one "
        "per device it stands for (mpiexec -n 2 loom plan --calibrate; across 2 nodes for the "
        "links between nodes), or on 1 rank with the four network.* figures given by --set (not given: " +
        missing + ")");
  if (!sets.empty()) {
    DeckSchema schema;
    add_cluster_keys(schema);
    check_cluster_values(parse_deck(schema, cluster_preset_text("h100-sxm"), "loom plan --calibrate --set", sets),
                         "loom plan --calibrate --set");
  }
}

// The nodes (shared-memory domains) of the ranks, and the peers whose links are measured: rank 0 and
// another rank of its node (same), rank 0 and the first rank of another node (other); -1 where none.
struct NodeMap {
  int nodes = 1, per_node = 1, same = -1, other = -1;
};
NodeMap map_nodes(int rank, int world) {
  MPI_Comm local;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local);
  int leader = rank;  // every rank learns each rank's node leader
  MPI_Bcast(&leader, 1, MPI_INT, 0, local);
  MPI_Comm_free(&local);
  std::vector<int> leaders(static_cast<std::size_t>(world));
  MPI_Allgather(&leader, 1, MPI_INT, leaders.data(), 1, MPI_INT, MPI_COMM_WORLD);
  std::vector<int> distinct(leaders);
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  NodeMap m;
  m.nodes = static_cast<int>(distinct.size());
  m.per_node = 0;
  for (int l : distinct)
    m.per_node = std::max<int>(m.per_node, static_cast<int>(std::count(leaders.begin(), leaders.end(), l)));
  for (int r = 1; r < world; ++r) {
    if (leaders[static_cast<std::size_t>(r)] == leaders[0] && m.same < 0) m.same = r;
    if (leaders[static_cast<std::size_t>(r)] != leaders[0] && m.other < 0) m.other = r;
  }
  return m;
}

// What every rank measures of its compute, reduced to the slowest rank's figures.
struct ComputeFigures {
  double peak[3] = {};             // fp32, bf16, fp16 matrix-product peaks (FLOP/s)
  MatmulEfficiency efficiency[3];  // their shares of the peak by width
  double costs[3] = {};            // a product call's, an attention head's, a fused attention head's fixed cost (s)
  double kernels[4] = {};          // attention FLOP/s, memory B/s, optimizer B/s, fused attention FLOP/s
};
ComputeFigures measure_compute() {
  // Every rank computes at once, as in training; the slowest rank is what a step waits for (the
  // largest fixed costs, the smallest rates).
  // The short measurements (a product call's fixed cost, attention at its two shapes) are taken at
  // the start, after the products and at the end, the best of each kept: a machine's speed drifts
  // (other work, a virtual machine's neighbours) over the seconds calibration takes.
  // call, attention small, attention large, fused attention small, fused attention large (seconds)
  double fixed[5] = {1e30, 1e30, 1e30, 1e30, 1e30};
  const auto sample_fixed = [&] {
    fixed[0] = std::min(fixed[0], matmul_call_seconds());
    fixed[1] = std::min(fixed[1], attention_seconds(Bs, Ts, Cs, NH, false));
    fixed[2] = std::min(fixed[2], attention_seconds(Bl, Tl, Cl, NH, false));
    fixed[3] = std::min(fixed[3], attention_seconds(Bs, Ts, Cs, NH, true));
    fixed[4] = std::min(fixed[4], attention_seconds(Bl, Tl, Cl, NH, true));
  };
  sample_fixed();
  constexpr int kW = static_cast<int>(std::size(kWidths));
  const DType dtypes[3] = {DType::f32, DType::bf16, DType::f16};
  double block_s[3][kW];
  for (int d = 0; d < 3; ++d)
    for (int w = 0; w < kW; ++w) block_s[d][w] = block_matmul_seconds(dtypes[d], rows_at(kWidths[w]), kWidths[w]);
  sample_fixed();
  ComputeFigures f;
  f.kernels[1] = memory_rate();
  f.kernels[2] = optimizer_rate();
  sample_fixed();
  const AttentionRate att = attention_rate(fixed[1], fixed[2]), flash = attention_rate(fixed[3], fixed[4]);
  f.kernels[0] = att.flops_per_s;
  f.kernels[3] = flash.flops_per_s;
  f.costs[0] = fixed[0], f.costs[1] = att.head_s, f.costs[2] = flash.head_s;
  MPI_Allreduce(MPI_IN_PLACE, f.costs, 3, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  double rates[3][kW];
  for (int d = 0; d < 3; ++d)
    for (int w = 0; w < kW; ++w)
      rates[d][w] = block_matmul_rate(block_s[d][w], rows_at(kWidths[w]), kWidths[w], f.costs[0]);
  MPI_Allreduce(MPI_IN_PLACE, &rates[0][0], 3 * kW, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
  // Per dtype the peak is the best width's rate, the others a share of it.
  for (int d = 0; d < 3; ++d) {
    f.peak[d] = *std::max_element(rates[d], rates[d] + kW);
    for (int w = 0; w < kW; ++w) f.efficiency[d].points.push_back({double(kWidths[w]), rates[d][w] / f.peak[d]});
  }
  MPI_Allreduce(MPI_IN_PLACE, f.kernels, 4, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
  return f;
}

// How a calibrated description was measured, for its `source`.
std::string calibration_source(int world, const Link& intra, const Link& inter, const std::vector<std::string>& sets) {
  std::string source =
      std::string(
          "loom plan --calibrate, loom's host back end (BLAS on 1 thread), all ranks at once, slowest "
          "rank: matrix products as 2 transformer blocks run them forward and backward at widths 64, "
          "128 (1024 rows), 256 (512 rows), 512 (256 rows) (best of 3), less matmul_call_us per GEMM "
          "(8 x 8 products, best batch of 200), the peak the best width's rate; "
          "attention forward + backward at B=16, T=32, C=64 and B=4, T=256, C=256, 4 heads (best of "
          "5 each; 12 B T^2 C FLOPs, B x heads fixed costs), the fused attention (model.attention = "
          "flash) likewise; the call's and attention's short "
          "measurements taken at the start, middle and end, the best kept; memory_gbs from a block's element-wise "
          "kernels (LayerNorm, GELU, residual adds and copies) at 8192 x 256 fp32 (best of 4); "
          "optimizer_gbs from gradient zeroing, norm, clip and AdamW over 4M parameters (best of 4); "
          "bytes and FLOPs as loom plan counts them; memory = MemTotal / ranks per node; links "
          "by ping-pong through loom's communicator while the other ranks wait in it: latency the "
          "median one way of 8 B, bandwidth from the best of 1 MiB; sync_wait_share from 40 segments of a "
          "block's element-wise kernels at 512 x 256 with an all-reduce of each pair of consecutive "
          "ranks after each (every pair at once), against "
          "the segments and the all-reduces alone (each rank's extra time over its segments' time, the "
          "mean over ranks, the median of 5); host_gbs the optimizer's figure (the strategies' host "
          "passes stream over memory as its pass does); host_link_gbs 0 (the devices are the host)") +
      (world < 2        ? ""
       : intra.measured ? ""
                        : "; no two ranks shared a node: inside-node figures are the between-node ones") +
      (world < 2        ? ""
       : inter.measured ? ""
                        : "; one node: between-node figures are the inside-node ones (not measured)");
  if (!sets.empty()) {
    source += "; given, not measured:";
    for (const std::string& s : sets) source += " " + s;
  }
  return source;
}

ClusterSpec calibrated_spec(int world, const NodeMap& nodes, const ComputeFigures& f, const Link& intra,
                            const Link& inter, double sync_share) {
  ClusterSpec c;
  char host[256] = "this machine";
  gethostname(host, sizeof host);
  c.name = std::string(host) + " (calibrated: " + std::to_string(world) + " ranks on " + std::to_string(nodes.nodes) +
           " node(s))";
  c.nodes = nodes.nodes;
  c.devices_per_node = nodes.per_node;
  c.device_memory_bytes = meminfo_total() / nodes.per_node;
  c.peak_flops_fp32 = f.peak[0];
  c.peak_flops_bf16 = f.peak[1];
  c.peak_flops_fp16 = f.peak[2];
  c.efficiency_fp32 = f.efficiency[0];
  c.efficiency_bf16 = f.efficiency[1];
  c.efficiency_fp16 = f.efficiency[2];
  c.matmul_call_s = f.costs[0];
  c.attention_flops = f.kernels[0];
  c.attention_head_s = f.costs[1];
  c.flash_attention_flops = f.kernels[3];
  c.flash_attention_head_s = f.costs[2];
  c.memory_bytes_per_s = f.kernels[1];
  c.optimizer_bytes_per_s = f.kernels[2];
  c.sync_wait_share = sync_share;
  c.host_bytes_per_s = f.kernels[2];  // the host back end's strategies' passes stream as its optimizer's does
  c.host_link_bytes_per_s = 0;        // its devices are the host's cores: nothing is copied
  const Link& in_node = intra.measured ? intra : inter;
  const Link& between = inter.measured ? inter : intra;
  c.intra_bytes_per_s = in_node.bytes_per_s;
  c.intra_latency_s = in_node.latency_s;
  c.inter_bytes_per_s = between.bytes_per_s;
  c.inter_latency_s = between.latency_s;
  if (world < 2) c.intra_bytes_per_s = c.inter_bytes_per_s = 1e9;  // not measured: the --set figures replace them
  return c;
}

// Writes `c` to out_path (through a .tmp file, renamed into place), the --set figures in place of the
// measured ones, and prints what the file holds.
void write_calibration(ClusterSpec c, const std::string& out_path, const std::vector<std::string>& sets) {
  std::error_code ec;
  const std::filesystem::path out(out_path);
  if (out.has_parent_path()) std::filesystem::create_directories(out.parent_path(), ec);
  const auto write = [&](const ClusterSpec& spec) {
    std::ofstream f(out_path + ".tmp");
    f << "# loom cluster description, written by `loom plan --calibrate`; read with `loom plan --cluster " << out_path
      << " --show`\n"
      << cluster_text(spec);
    if (!f) throw InputError("cannot write " + quote_path(out_path) + " (folder not writable, or disk full)");
  };
  write(c);
  if (!sets.empty()) {  // the --set figures in place of the measured ones, refused as a file's would be
    try {
      const std::string name = c.name, source = c.source;
      c = load_cluster(out_path + ".tmp", sets);
      c.name = name;
      c.source = source;
    } catch (...) {
      std::filesystem::remove(out_path + ".tmp", ec);
      throw;
    }
    write(c);
  }
  std::filesystem::rename(out_path + ".tmp", out_path, ec);
  if (ec) throw InputError("cannot write " + quote_path(out_path) + ": " + ec.message());
  {  // print what the file holds (its figures as rounded in it), as `--cluster FILE --show` will
    const std::string name = c.name, source = c.source;
    c = load_cluster(out_path);
    c.name = name;
    c.source = source;
  }
  c.origin = out_path;
  std::cout << describe_cluster(c) << "wrote " << out_path << "\n";
}

int calibrate(const std::string& out_path, const std::vector<std::string>& sets) {
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  check_calibration_sets(world, sets);
  const NodeMap nodes = map_nodes(rank, world);
  const ComputeFigures figures = measure_compute();
  std::unique_ptr<Communicator> world_comm = make_mpi_communicator(MPI_COMM_WORLD, "world");
  const Link intra = measure_link(*world_comm, nodes.same >= 0 ? 0 : -1, nodes.same);
  const Link inter = measure_link(*world_comm, nodes.other >= 0 ? 0 : -1, nodes.other);
  const double sync_share = sync_wait_share(*world_comm);
  if (rank != 0) return 0;
  ClusterSpec c = calibrated_spec(world, nodes, figures, intra, inter, sync_share);
  c.source = calibration_source(world, intra, inter, sets);
  write_calibration(c, out_path, sets);
  return 0;
}

}  // namespace

int command_plan(const PlanOptions& options, const StrategyRegistry& registry, const DeckSchema& schema) {
  // --set: the cluster's sections to the cluster description, the rest to the deck.
  PlanOptions o = options;
  std::vector<std::string> cluster_sets;
  o.sets.clear();
  for (const std::string& s : options.sets)
    (s.rfind("cluster.", 0) == 0 || s.rfind("network.", 0) == 0 ? cluster_sets : o.sets).push_back(s);
  if (o.deck.empty() && !o.sets.empty())
    throw InputError("--set " + o.sets.front() + ": without a DECK, loom plan takes only cluster.* and network.* keys");
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (o.cluster_keys) {
    DeckSchema schema;
    add_cluster_keys(schema);
    if (rank == 0) std::cout << schema.describe();
    return 0;
  }
  if (o.calibrate) return calibrate(o.output.empty() ? calibration_path() : o.output, cluster_sets);
  std::string what = o.cluster;
  std::string note;
  if (what.empty()) {
    what = default_cluster_file();
    if (what.empty()) {
      what = "h100-sxm";
      note =
          "loom plan: NOTE: priced on the preset h100-sxm, not on this machine: there is no --cluster and no "
          "calibration file " +
          calibration_path() +
          ". `loom plan --calibrate` measures this machine; "
          "--cluster FILE|PRESET names another.\n";
    }
  }
  const ClusterSpec c = load_cluster(what, cluster_sets);
  if (!o.deck.empty() && !o.show) {
    if (rank == 0) (o.json ? std::cerr : std::cout) << note;  // JSON on stdout stays JSON
    return command_plan_deck(o, registry, schema, c);
  }
  if (rank == 0) std::cout << note << describe_cluster(c);
  return 0;
}

}  // namespace loom
