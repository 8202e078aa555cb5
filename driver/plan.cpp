// `loom plan` (issue 16), the part built so far: the machine a plan is for. `--cluster FILE|PRESET`
// reads a cluster description (io/cluster.hpp) and `--show` prints it; `--calibrate` measures the
// machine it runs on (matrix-product rate per dtype with loom's own back end, MPI bandwidth and
// latency between ranks inside a node and between nodes) and writes such a file. The prediction of a
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
  const Link& in_node = intra.measured ? intra : inter;
  const Link& between = inter.measured ? inter : intra;
  c.intra_bytes_per_s = in_node.bytes_per_s;
  c.intra_latency_s = in_node.latency_s;
  c.inter_bytes_per_s = between.bytes_per_s;
  c.inter_latency_s = between.latency_s;
  c.source = std::string("loom plan --calibrate: matrix products of loom's host back end (768 x 768, best of 6, slowest "
                         "rank), memory = MemTotal / ranks per node, MPI ping-pong of 8 B and 16 MiB") +
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

int command_plan(const PlanOptions& o) {
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
  const ClusterSpec c = load_cluster(what, o.sets);
  if (rank == 0) std::cout << note << describe_cluster(c);
  return 0;
}

}  // namespace loom
