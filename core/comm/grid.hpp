#pragma once
// The process grid (DESIGN.md): world = dp x cp x tp x pp, tp fastest, then cp, then dp, then pp
// (Megatron-Core's order):
//   rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i
// so a tensor-parallel group is a set of neighbouring ranks and lands inside one node under the
// usual block placement, and a context-parallel ring is the next closest. The world is split once
// into the tp, cp, dp and pp communicators. The dp communicator is the gradient group: the dp x cp
// ranks that hold the same weights (context-parallel ranks see other tokens of the same rows, so
// their gradients are summed as data-parallel ranks' are); data rows are split by dp_rank() alone.
#include <mpi.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/comm/comm.hpp"

namespace loom {

struct Layout {
  int dp = 1, tp = 1, pp = 1, cp = 1;
  // Expert parallelism: the gradient group's replicas in groups of ep consecutive ones, each holding
  // 1/ep of the experts (not an axis of the world: ep divides dp).
  int ep = 1;
  int ranks() const { return dp * cp * tp * pp; }
  // The ranks that hold the same weights and sum their gradients: dp x cp.
  int replicas() const { return dp * cp; }
  int rank_of(int dp_i, int tp_i, int pp_i, int cp_i = 0) const { return ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i; }
  // A rank's place in each group: the inverse of rank_of, the one place the order is decoded.
  struct Coords {
    int dp = 0, tp = 0, pp = 0, cp = 0;
  };
  // "dp 2 x tp 2 x pp 1", with " x cp N" after dp where cp > 1.
  std::string describe() const {
    return "dp " + std::to_string(dp) + (cp > 1 ? " x cp " + std::to_string(cp) : "") + " x tp " + std::to_string(tp) +
           " x pp " + std::to_string(pp);
  }
  Coords coords_of(int rank) const {
    return {(rank / (tp * cp)) % dp, rank % tp, rank / (tp * cp * dp), (rank / tp) % cp};
  }
};

// "1, 2, 4, 8": the divisors of n, for messages that say which sizes would work.
std::string divisors(long n);

// Makes the communicator of one group (every rank of `comm` calls it): the back end's
// (Backend::make_communicator), MPI by default.
using CommFactory = std::function<std::unique_ptr<Communicator>(MPI_Comm comm, const std::string& name)>;

class ProcessGrid {
 public:
  // Collective over `world`. The layout must already have passed check_layout.
  ProcessGrid(MPI_Comm world, const Layout& layout, const CommFactory& make = make_mpi_communicator);
  // `loom plan`'s grid: rank `rank` of `layout` with `per_node` ranks per node, no MPI; its
  // communicators answer name, size and rank, and throw if asked to communicate.
  static std::unique_ptr<ProcessGrid> planned(const Layout& layout, int rank, int per_node);
  const Layout& layout() const { return layout_; }
  int rank() const { return rank_; }
  int dp_rank() const { return dp_i_; }
  int tp_rank() const { return tp_i_; }
  int pp_rank() const { return pp_i_; }
  int cp_rank() const { return cp_i_; }
  // This rank's place in the gradient group (dp()): dp_rank() * cp + cp_rank().
  int replica_rank() const { return dp_i_ * layout_.cp + cp_i_; }
  // Expert parallelism: this rank's place in its ep group (replica_rank() % ep), whose ranks hold
  // different experts and exchange tokens, and in its expert-data group (the replicas with the same
  // ep rank, replica_rank() / ep), whose ranks hold the same experts and sum their gradients.
  int ep_rank() const { return replica_rank() % layout_.ep; }
  int edp_rank() const { return replica_rank() / layout_.ep; }
  int node() const { return node_; }  // index of this rank's node (shared-memory domain)
  int nodes() const { return nodes_; }
  Communicator& world() { return *world_; }
  Communicator& dp() { return *dp_; }
  Communicator& tp() { return *tp_; }
  Communicator& pp() { return *pp_; }
  Communicator& cp() { return *cp_; }    // the context-parallel ring, ordered by cp_rank()
  Communicator& ep() { return *ep_; }    // the expert-parallel group, ordered by ep_rank()
  Communicator& edp() { return *edp_; }  // the ranks holding the same experts, ordered by edp_rank()
  // (ep and edp are made only when layout().ep > 1; otherwise one-rank stand-ins that refuse to communicate)
  std::vector<Communicator*> groups() { return {dp_.get(), tp_.get(), pp_.get(), cp_.get(), ep_.get(), edp_.get()}; }
  // The grid as text (every rank's coordinates and node), with a warning line for each tp group
  // that spans nodes. Same on every rank.
  const std::string& describe() const { return description_; }

 private:
  ProcessGrid() = default;
  Layout layout_;
  int rank_ = 0, dp_i_ = 0, tp_i_ = 0, pp_i_ = 0, cp_i_ = 0, node_ = 0, nodes_ = 1;
  std::unique_ptr<Communicator> world_, dp_, tp_, pp_, cp_, ep_, edp_;
  std::string description_;
};

}  // namespace loom
