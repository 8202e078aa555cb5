// `loom plan` (issue 16), the part built so far: the machine a plan is for. `--cluster FILE|PRESET`
// reads a cluster description (io/cluster.hpp) and `--show` prints it; `--calibrate` measures the
// machine it runs on (matrix-product rate per dtype, attention rate and memory bandwidth with loom's
// own back end, MPI bandwidth and latency between ranks inside a node and between nodes) and writes such a file. The prediction of a
// deck's memory and step time is not built yet.
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <vector>

#include "core/backend.hpp"
#include "core/error.hpp"
#include "driver/commands.hpp"
#include "io/cluster.hpp"

namespace loom {
namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// FLOP/s of the back end's matrix product with `dtype` operands (fp32 accumulation), best of a few
// [n, n] x [n, n] products: what a training step's products run on this machine.
double matmul_rate(DType dtype) {
  auto be = make_host_backend(1);
  Precision p;
  p.matmul = dtype;
  be->set_precision(p);
  constexpr int n = 768;
  TypedBuffer a = be->allocate("plan::calibrate.a", dtype, static_cast<std::int64_t>(n) * n, Mem::workspace);
  TypedBuffer w = be->allocate("plan::calibrate.w", dtype, static_cast<std::int64_t>(n) * n, Mem::workspace);
  TypedBuffer c = be->allocate("plan::calibrate.c", DType::f32, static_cast<std::int64_t>(n) * n, Mem::workspace);
  double best = 1e30;
  for (int rep = 0; rep < 8; ++rep) {
    const double t0 = now();
    be->matmul_forward(c.data<float>(), a.ref(), w.ref(), nullptr, n, n, n);
    if (rep >= 2) best = std::min(best, now() - t0);
  }
  be->release_scratch();
  return 2.0 * n * n * n / best;
}

// A buffer of `n` fp32 values of the back end, filled with small values (varied, so LayerNorm's rows
// have a spread and GELU is not evaluated at one point).
TypedBuffer small_values(Backend& be, const std::string& label, std::int64_t n) {
  TypedBuffer b = be.allocate(label, DType::f32, n, Mem::workspace);
  std::vector<float> host(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = 0.01f * static_cast<float>(static_cast<int>(i % 97) - 48);
  be.copy_from_host(b.ref(), host.data());
  return b;
}

// The best time of `f` over `reps` calls after 2 warm-up calls.
template <class F>
double best_seconds(Backend& be, int reps, F&& f) {
  double best = 1e30;
  for (int rep = 0; rep < reps + 2; ++rep) {
    be.synchronize();
    const double t0 = now();
    f();
    be.synchronize();
    if (rep >= 2) best = std::min(best, now() - t0);
  }
  return best;
}

// FLOP/s of the back end's attention (forward + backward, fp32) at B=4, T=256, C=256, NH=4, its FLOPs
// counted by attention_flops (io/cluster.hpp), which the prediction counts with.
double attention_rate() {
  auto be = make_host_backend(1);
  constexpr int B = 4, T = 256, C = 256, NH = 4;
  const std::int64_t bt = static_cast<std::int64_t>(B) * T, att_n = static_cast<std::int64_t>(B) * NH * T * T;
  TypedBuffer qkv = small_values(*be, "plan::calibrate.qkv", bt * 3 * C);
  TypedBuffer dout = small_values(*be, "plan::calibrate.dout", bt * C);
  TypedBuffer out = be->allocate("plan::calibrate.out", DType::f32, bt * C, Mem::workspace);
  TypedBuffer att = be->allocate("plan::calibrate.att", DType::f32, att_n, Mem::workspace);
  TypedBuffer dqkv = be->allocate("plan::calibrate.dqkv", DType::f32, bt * 3 * C, Mem::workspace);
  TypedBuffer datt = be->allocate("plan::calibrate.datt", DType::f32, att_n, Mem::workspace);
  const double fwd = best_seconds(*be, 5, [&] {
    be->attention_forward(out.data<float>(), att.data<float>(), qkv.data<float>(), B, T, C, NH);
  });
  const double bwd = best_seconds(*be, 5, [&] {
    be->attention_backward(dqkv.data<float>(), datt.data<float>(), dout.data<float>(), qkv.data<float>(),
                           att.data<float>(), B, T, C, NH);
  });
  be->release_scratch();
  return attention_flops(B, T, C) / (fwd + bwd);
}

// Bytes per second of the back end's element-wise kernels (LayerNorm forward and backward, GELU
// forward and backward, the residual add) over 65536 rows x 256, their bytes counted by KernelBytes
// (io/cluster.hpp), which the prediction counts with: all the bytes over all the best times.
double memory_rate() {
  auto be = make_host_backend(1);
  constexpr int N = 65536, C = 256;
  const std::int64_t n = static_cast<std::int64_t>(N) * C;
  TypedBuffer x = small_values(*be, "plan::calibrate.x", n);
  TypedBuffer dy = small_values(*be, "plan::calibrate.dy", n);
  TypedBuffer y = be->allocate("plan::calibrate.y", DType::f32, n, Mem::workspace);
  TypedBuffer dx = be->allocate("plan::calibrate.dx", DType::f32, n, Mem::workspace);
  TypedBuffer w = small_values(*be, "plan::calibrate.ln_w", C);
  TypedBuffer b = small_values(*be, "plan::calibrate.ln_b", C);
  TypedBuffer dw = be->allocate("plan::calibrate.ln_dw", DType::f32, C, Mem::workspace);
  TypedBuffer db = be->allocate("plan::calibrate.ln_db", DType::f32, C, Mem::workspace);
  TypedBuffer mean = be->allocate("plan::calibrate.mean", DType::f32, N, Mem::workspace);
  TypedBuffer rstd = be->allocate("plan::calibrate.rstd", DType::f32, N, Mem::workspace);
  constexpr int reps = 4;
  double bytes = 0, seconds = 0;
  const auto add = [&](double per_element, double t) {
    bytes += per_element * static_cast<double>(n);
    seconds += t;
  };
  add(KernelBytes::layernorm_fwd, best_seconds(*be, reps, [&] {
        be->layernorm_forward(y.data<float>(), mean.data<float>(), rstd.data<float>(), x.data<float>(), w.data<float>(),
                              b.data<float>(), N, C);
      }));
  add(KernelBytes::layernorm_bwd, best_seconds(*be, reps, [&] {
        be->layernorm_backward(dx.data<float>(), dw.data<float>(), db.data<float>(), dy.data<float>(), x.data<float>(),
                               w.data<float>(), mean.data<float>(), rstd.data<float>(), N, C);
      }));
  add(KernelBytes::gelu_fwd, best_seconds(*be, reps, [&] { be->gelu_forward(y.data<float>(), x.data<float>(), n); }));
  add(KernelBytes::gelu_bwd, best_seconds(*be, reps, [&] {
        be->gelu_backward(dx.data<float>(), x.data<float>(), dy.data<float>(), n);
      }));
  add(KernelBytes::residual, best_seconds(*be, reps, [&] {
        be->residual_forward(y.data<float>(), x.data<float>(), dy.data<float>(), n);
      }));
  be->release_scratch();
  return bytes / seconds;
}

// Half the best round trip of `bytes` between this rank and `peer` (the other side echoes).
double one_way_seconds(int peer, bool first, std::size_t bytes, int reps) {
  std::vector<char> buf(bytes ? bytes : 1);
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const double t0 = now();
    if (first) {
      MPI_Send(buf.data(), static_cast<int>(bytes), MPI_BYTE, peer, 7, MPI_COMM_WORLD);
      MPI_Recv(buf.data(), static_cast<int>(bytes), MPI_BYTE, peer, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    } else {
      MPI_Recv(buf.data(), static_cast<int>(bytes), MPI_BYTE, peer, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      MPI_Send(buf.data(), static_cast<int>(bytes), MPI_BYTE, peer, 7, MPI_COMM_WORLD);
    }
    best = std::min(best, (now() - t0) / 2);
  }
  return best;
}

struct Link {
  double bytes_per_s = 0, latency_s = 0;
  bool measured = false;
};

// Latency from 8-byte messages, bandwidth from 16 MiB ones (less the latency), between ranks a and b;
// every rank calls it (the others wait at the barrier).
Link measure_link(int rank, int a, int b) {
  Link l;
  if (a >= 0 && b >= 0 && (rank == a || rank == b)) {
    const int peer = rank == a ? b : a;
    const bool first = rank == a;
    one_way_seconds(peer, first, 8, 20);  // warm-up
    l.latency_s = one_way_seconds(peer, first, 8, 200);
    const std::size_t big = 16u << 20;
    const double t = one_way_seconds(peer, first, big, 6);
    l.bytes_per_s = static_cast<double>(big) / std::max(t - l.latency_s, 1e-9);
    l.measured = true;
  }
  double v[2] = {l.bytes_per_s, l.latency_s};
  MPI_Bcast(v, 2, MPI_DOUBLE, a >= 0 ? a : 0, MPI_COMM_WORLD);
  l.bytes_per_s = v[0];
  l.latency_s = v[1];
  l.measured = a >= 0 && b >= 0;
  return l;
}

double mem_total_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  double kib = 0;
  while (in >> key) {
    if (key == "MemTotal:") {
      in >> kib;
      break;
    }
    std::getline(in, key);
  }
  return kib * 1024.0;
}

int calibrate(const std::string& out_path) {
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world < 2)
    throw InputError("loom plan --calibrate measures the links between ranks: launch it on 2 ranks or more, one "
                     "per device it stands for (mpiexec -n 2 loom plan --calibrate; across 2 nodes for the "
                     "links between nodes)");
  // Nodes: the shared-memory domains; every rank learns each rank's node leader.
  MPI_Comm local;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local);
  int local_rank = 0, local_size = 1;
  MPI_Comm_rank(local, &local_rank);
  MPI_Comm_size(local, &local_size);
  int leader = rank;
  MPI_Bcast(&leader, 1, MPI_INT, 0, local);
  MPI_Comm_free(&local);
  std::vector<int> leaders(static_cast<std::size_t>(world));
  MPI_Allgather(&leader, 1, MPI_INT, leaders.data(), 1, MPI_INT, MPI_COMM_WORLD);
  std::vector<int> distinct(leaders);
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  int per_node = 0;
  for (int l : distinct) per_node = std::max<int>(per_node, static_cast<int>(std::count(leaders.begin(), leaders.end(), l)));
  // Peers: rank 0 and another rank of its node; rank 0 and the first rank of another node.
  int same = -1, other = -1;
  for (int r = 1; r < world; ++r) {
    if (leaders[static_cast<std::size_t>(r)] == leaders[0] && same < 0) same = r;
    if (leaders[static_cast<std::size_t>(r)] != leaders[0] && other < 0) other = r;
  }
  // Every rank multiplies at once, as in training; the slowest rank is what a step waits for.
  double rates[3] = {matmul_rate(DType::f32), matmul_rate(DType::bf16), matmul_rate(DType::f16)};
  MPI_Allreduce(MPI_IN_PLACE, rates, 3, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
  double kernels[2] = {attention_rate(), memory_rate()};
  MPI_Allreduce(MPI_IN_PLACE, kernels, 2, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
  const Link intra = measure_link(rank, same >= 0 ? 0 : -1, same);
  const Link inter = measure_link(rank, other >= 0 ? 0 : -1, other);
  if (rank != 0) return 0;

  ClusterSpec c;
  char host[256] = "this machine";
  gethostname(host, sizeof host);
  c.name = std::string(host) + " (calibrated: " + std::to_string(world) + " ranks on " + std::to_string(distinct.size()) +
           " node(s))";
  c.nodes = static_cast<int>(distinct.size());
  c.devices_per_node = per_node;
  c.device_memory_bytes = mem_total_bytes() / per_node;
  c.peak_flops_fp32 = rates[0];
  c.peak_flops_bf16 = rates[1];
  c.peak_flops_fp16 = rates[2];
  c.attention_flops = kernels[0];
  c.memory_bytes_per_s = kernels[1];
  const Link& in_node = intra.measured ? intra : inter;
  const Link& between = inter.measured ? inter : intra;
  c.intra_bytes_per_s = in_node.bytes_per_s;
  c.intra_latency_s = in_node.latency_s;
  c.inter_bytes_per_s = between.bytes_per_s;
  c.inter_latency_s = between.latency_s;
  c.source = std::string("loom plan --calibrate, loom's host back end (BLAS on 1 thread), all ranks at once, slowest "
                         "rank: matrix products 768 x 768 (best of 6); attention forward + backward at B=4, T=256, "
                         "C=256, 4 heads (best of 5, 12 B T^2 C FLOPs); memory_gbs from LayerNorm, GELU (forward "
                         "and backward) and residual add over 65536 x 256 fp32 (best of 4, bytes as loom plan counts "
                         "them); memory = MemTotal / ranks per node; MPI ping-pong of 8 B and 16 MiB") +
             (intra.measured ? "" : "; no two ranks shared a node: inside-node figures are the between-node ones") +
             (inter.measured ? "" : "; one node: between-node figures are the inside-node ones (not measured)");
  std::error_code ec;
  const std::filesystem::path out(out_path);
  if (out.has_parent_path()) std::filesystem::create_directories(out.parent_path(), ec);
  {
    std::ofstream f(out_path + ".tmp");
    f << "# loom cluster description, written by `loom plan --calibrate`; read with `loom plan --cluster "
      << out_path << " --show`\n"
      << cluster_text(c);
    if (!f) throw InputError("cannot write " + quote_path(out_path) + " (folder not writable, or disk full)");
  }
  std::filesystem::rename(out_path + ".tmp", out_path, ec);
  if (ec) throw InputError("cannot write " + quote_path(out_path) + ": " + ec.message());
  c.origin = out_path;
  std::cout << describe_cluster(c) << "wrote " << out_path << "\n";
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
  if (o.calibrate) return calibrate(o.output.empty() ? calibration_path() : o.output);
  std::string what = o.cluster;
  std::string note;
  if (what.empty()) {
    what = default_cluster_file();
    if (what.empty()) {
      what = "h100-sxm";
      note = "(no --cluster and no calibration file " + calibration_path() + ": preset h100-sxm; `loom plan --calibrate` "
             "measures this machine)\n";
    }
  }
  const ClusterSpec c = load_cluster(what, cluster_sets);
  if (!o.deck.empty() && !o.show) {
    if (rank == 0 && !o.json) std::cout << note;
    return command_plan_deck(o, registry, schema, c);
  }
  if (rank == 0) std::cout << note << describe_cluster(c);
  return 0;
}

}  // namespace loom
