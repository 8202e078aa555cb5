#pragma once
// The process grid (DESIGN.md): world = dp x tp x pp, tp fastest, then dp, then pp:
//   rank = (pp_i * dp + dp_i) * tp + tp_i
// so a tensor-parallel group is a set of neighbouring ranks and lands inside one node under the
// usual block placement. The world is split once into the tp, dp and pp communicators.
#include <mpi.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/comm/comm.hpp"

namespace loom {

struct Layout {
  int dp = 1, tp = 1, pp = 1;
  int ranks() const { return dp * tp * pp; }
  int rank_of(int dp_i, int tp_i, int pp_i) const { return (pp_i * dp + dp_i) * tp + tp_i; }
  // A rank's place in each group: the inverse of rank_of, the one place the order is decoded.
  struct Coords {
    int dp = 0, tp = 0, pp = 0;
  };
  Coords coords_of(int rank) const { return {(rank / tp) % dp, rank % tp, rank / (tp * dp)}; }
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
  int node() const { return node_; }  // index of this rank's node (shared-memory domain)
  int nodes() const { return nodes_; }
  Communicator& world() { return *world_; }
  Communicator& dp() { return *dp_; }
  Communicator& tp() { return *tp_; }
  Communicator& pp() { return *pp_; }
  std::vector<Communicator*> groups() { return {dp_.get(), tp_.get(), pp_.get()}; }
  // The grid as text (every rank's coordinates and node), with a warning line for each tp group
  // that spans nodes. Same on every rank.
  const std::string& describe() const { return description_; }

 private:
  ProcessGrid() = default;
  Layout layout_;
  int rank_ = 0, dp_i_ = 0, tp_i_ = 0, pp_i_ = 0, node_ = 0, nodes_ = 1;
  std::unique_ptr<Communicator> world_, dp_, tp_, pp_;
  std::string description_;
};

}  // namespace loom
