#include "core/comm/grid.hpp"

#include <algorithm>
#include <map>
#include <sstream>

#include "core/base/error.hpp"

namespace loom {
std::string divisors(long n) {
  std::ostringstream s;
  bool first = true;
  for (long d = 1; d <= n; ++d)
    if (n % d == 0) {
      s << (first ? "" : ", ") << d;
      first = false;
    }
  return s.str();
}

namespace {

class PlannedCommunicator final : public Communicator {
 public:
  PlannedCommunicator(std::string name, int rank, int size) : name_(std::move(name)), rank_(rank), size_(size) {}
  const std::string& name() const override { return name_; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void progress() override {}
  void barrier() override { no(); }

 protected:
  CommRequestPtr start_all_reduce(BufferRef, ReduceOp) override { return no(); }
  CommRequestPtr start_reduce_scatter(BufferRef, BufferRef, const std::vector<std::int64_t>&, ReduceOp) override {
    return no();
  }
  CommRequestPtr start_all_gather(BufferRef, BufferRef, const std::vector<std::int64_t>&) override { return no(); }
  CommRequestPtr start_broadcast(BufferRef, int) override { return no(); }
  CommRequestPtr start_send(BufferRef, int, int) override { return no(); }
  CommRequestPtr start_recv(BufferRef, int, int) override { return no(); }

 private:
  [[noreturn]] CommRequestPtr no() const {
    throw std::logic_error("loom plan's " + name_ +
                           " communicator was asked to communicate: building a rank's roles "
                           "must not");
  }
  std::string name_;
  int rank_, size_;
};

}  // namespace

std::unique_ptr<ProcessGrid> ProcessGrid::planned(const Layout& layout, int rank, int per_node) {
  std::unique_ptr<ProcessGrid> g(new ProcessGrid());
  g->layout_ = layout;
  g->rank_ = rank;
  const Layout::Coords at = layout.coords_of(rank);
  g->tp_i_ = at.tp;
  g->dp_i_ = at.dp;
  g->pp_i_ = at.pp;
  g->cp_i_ = at.cp;
  g->world_ = std::make_unique<PlannedCommunicator>("world", rank, layout.ranks());
  g->tp_ = std::make_unique<PlannedCommunicator>("tp", g->tp_i_, layout.tp);
  g->dp_ = std::make_unique<PlannedCommunicator>("dp", g->replica_rank(), layout.replicas());
  g->pp_ = std::make_unique<PlannedCommunicator>("pp", g->pp_i_, layout.pp);
  g->cp_ = std::make_unique<PlannedCommunicator>("cp", g->cp_i_, layout.cp);
  g->ep_ = std::make_unique<PlannedCommunicator>("ep", g->ep_rank(), layout.ep);
  g->edp_ = std::make_unique<PlannedCommunicator>("edp", layout.ep > 1 ? g->edp_rank() : 0,
                                                  layout.ep > 1 ? layout.replicas() / layout.ep : 1);
  g->node_ = rank / std::max(per_node, 1);
  g->nodes_ = (layout.ranks() + std::max(per_node, 1) - 1) / std::max(per_node, 1);
  g->description_ = "planned grid: rank " + std::to_string(rank) + " of dp " + std::to_string(layout.dp) +
                    (layout.cp > 1 ? " x cp " + std::to_string(layout.cp) : "") + " x tp " + std::to_string(layout.tp) +
                    " x pp " + std::to_string(layout.pp) + "\n";
  return g;
}

ProcessGrid::ProcessGrid(MPI_Comm world, const Layout& layout, const CommFactory& make) : layout_(layout) {
  int size = 1;
  MPI_Comm_rank(world, &rank_);
  MPI_Comm_size(world, &size);
  const Layout::Coords at = layout.coords_of(rank_);
  tp_i_ = at.tp;
  dp_i_ = at.dp;
  pp_i_ = at.pp;
  cp_i_ = at.cp;
  const int replica = replica_rank(), replicas = layout.replicas();

  world_ = make(world, "world");
  MPI_Comm c;
  // tp group: same (pp, dp, cp), ordered by tp; dp (gradient) group: same (pp, tp), ordered by dp
  // then cp; pp group: same (dp, cp, tp); cp ring: same (pp, dp, tp), ordered by cp.
  MPI_Comm_split(world, pp_i_ * replicas + replica, tp_i_, &c);
  tp_ = make(c, "tp");
  MPI_Comm_free(&c);
  MPI_Comm_split(world, pp_i_ * layout.tp + tp_i_, replica, &c);
  dp_ = make(c, "dp");
  MPI_Comm_free(&c);
  MPI_Comm_split(world, replica * layout.tp + tp_i_, pp_i_, &c);
  pp_ = make(c, "pp");
  MPI_Comm_free(&c);
  MPI_Comm_split(world, (pp_i_ * layout.dp + dp_i_) * layout.tp + tp_i_, cp_i_, &c);
  cp_ = make(c, "cp");
  MPI_Comm_free(&c);
  // ep group: the same (pp, tp) and replica / ep, ordered by ep rank; edp: the same (pp, tp) and ep rank.
  // Without expert parallelism neither exists (stand-ins of one rank that refuse to communicate).
  if (layout.ep > 1) {
    const int groups = replicas / layout.ep;
    MPI_Comm_split(world, (pp_i_ * layout.tp + tp_i_) * groups + edp_rank(), ep_rank(), &c);
    ep_ = make(c, "ep");
    MPI_Comm_free(&c);
    MPI_Comm_split(world, (pp_i_ * layout.tp + tp_i_) * layout.ep + ep_rank(), edp_rank(), &c);
    edp_ = make(c, "edp");
    MPI_Comm_free(&c);
  } else {
    ep_ = std::make_unique<PlannedCommunicator>("ep", 0, 1);
    edp_ = std::make_unique<PlannedCommunicator>("edp", 0, 1);
  }

  // Node boundaries: ranks that share memory form a node, named by its lowest world rank.
  MPI_Comm local;
  MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local);
  int leader = rank_;
  MPI_Allreduce(MPI_IN_PLACE, &leader, 1, MPI_INT, MPI_MIN, local);
  MPI_Comm_free(&local);
  std::vector<int> leaders(size);
  MPI_Allgather(&leader, 1, MPI_INT, leaders.data(), 1, MPI_INT, world);
  std::map<int, int> node_index;
  for (int r = 0; r < size; ++r) node_index.emplace(leaders[r], 0);
  int k = 0;
  for (auto& [lead, idx] : node_index) idx = k++;
  nodes_ = k;
  node_ = node_index[leader];

  std::ostringstream d;
  const bool cp = layout.cp > 1;
  d << "process grid: " << size << " rank" << (size == 1 ? "" : "s") << " = dp " << layout.dp
    << (cp ? " x cp " + std::to_string(layout.cp) : "") << " x tp " << layout.tp << " x pp " << layout.pp << " on "
    << nodes_ << " node" << (nodes_ == 1 ? "" : "s")
    << (cp ? " (rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i)\n" : " (rank = (pp_i * dp + dp_i) * tp + tp_i)\n");
  for (int p = 0; p < layout.pp; ++p) {
    if (layout.pp > 1) d << "  stage pp " << p << ":\n";
    for (int q = 0; q < layout.dp; ++q)
      for (int x = 0; x < layout.cp; ++x) {
        d << "    dp " << q << (cp ? " cp " + std::to_string(x) : "") << ": ";
        for (int t = 0; t < layout.tp; ++t) {
          const int r = layout.rank_of(q, t, p, x);
          d << (t ? "  " : "") << "rank " << r << " [node " << node_index[leaders[r]] << "]";
        }
        d << "\n";
        const int first_node = node_index[leaders[layout.rank_of(q, 0, p, x)]];
        for (int t = 1; t < layout.tp; ++t)
          if (node_index[leaders[layout.rank_of(q, t, p, x)]] != first_node) {
            d << "    warning: the tp group of dp " << q << (cp ? ", cp " + std::to_string(x) : "")
              << (layout.pp > 1 ? ", pp " + std::to_string(p) : "")
              << " spans nodes: its all-reduces cross the network on every layer\n";
            break;
          }
      }
  }
  description_ = d.str();
}

}  // namespace loom
