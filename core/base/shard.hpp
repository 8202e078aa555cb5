#pragma once
// The shard descriptor (DESIGN.md "Shards and ownership"): which elements of a full
// logical tensor this rank holds, composed from the tensor-parallel split and any further range a
// strategy cuts (ZeRO cuts the flattened tp shard into dp ranges). Initialisation draws element i
// by global_index(i); the checksum hashes (global index, value); the checkpoint selects boxes();
// ownership for norms and checkpoints is decided per shard by the parameter store.
//
// Local elements are numbered 0..numel()-1 in the order they sit in memory. For every split loom
// uses, the global index grows with the local index, so the union of boxes() traversed in row-major
// order is exactly the local order (what an HDF5 hyperslab selection needs).
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace loom {

// How the tp group splits a parameter (its rows or columns in torch.nn.Linear's [out, in] layout).
enum class TpSplit {
  none,      // replicated on every tp rank
  rows,      // output rows split (column-parallel linear, vocabulary-parallel embedding)
  cols,      // input columns split (row-parallel linear)
  qkv_rows,  // the fused qkv projection: each of q, k, v split by heads
};
const char* tp_split_name(TpSplit s);

struct ShardDesc {
  std::vector<std::int64_t> shape;     // full logical shape
  std::vector<std::int64_t> tp_shape;  // this tp rank's piece of it (= shape when not split)
  TpSplit split = TpSplit::none;
  int tp = 1, tp_rank = 0;
  std::int64_t begin = 0, end = -1;  // the range of the flattened tp piece held (-1: to its end)

  // A tensor of `shape`, split `split` over a tp group of `tp` ranks, piece `tp_rank`.
  static ShardDesc make(std::vector<std::int64_t> shape, TpSplit split, int tp, int tp_rank);
  std::int64_t full_numel() const;
  std::int64_t tp_numel() const;
  std::int64_t numel() const { return range_end() - begin; }
  std::int64_t range_end() const { return end < 0 ? tp_numel() : end; }
  bool whole() const { return split == TpSplit::none && begin == 0 && range_end() == full_numel(); }
  // The same tp piece cut further to elements [b, e) of what this shard holds (relative to it).
  ShardDesc cut(std::int64_t b, std::int64_t e) const;
  // Flat index into the full tensor of local element i (0 <= i < numel()).
  std::int64_t global_index(std::int64_t i) const;
  // Maximal runs of local elements that are consecutive in the full tensor, in local order:
  // fn(local_first, global_first, count).
  void for_each_run(const std::function<void(std::int64_t, std::int64_t, std::int64_t)>& fn) const;
  // The held elements as boxes of the full shape (start, count per dimension), in row-major file
  // order; consecutive rows of equal column extent are merged, so a tp split is one to three boxes.
  struct Box {
    std::vector<std::int64_t> start, count;
  };
  std::vector<Box> boxes() const;
  std::string describe() const;  // "rows 1/2 of [256,64], elements [0, 8192)"
};

}  // namespace loom
