#pragma once
// What a role contributes to a checkpoint (DESIGN.md "Checkpoints"): named logical tensors, each a
// dataset of its full shape of which every rank writes the elements it is the primary owner of, and
// scalar attributes. The model's parameters and the optimizer's state are contributed the same way;
// a strategy's role object (a compression reducer's error-feedback residual, PowerSGD's Q, a loss
// scaler) implements CheckpointContributor too, and the run finds it among its roles.
#include <map>
#include <string>
#include <vector>

#include "core/base/dtype.hpp"
#include "core/base/shard.hpp"

namespace loom {

struct CheckpointTensor {
  std::string path;    // dataset path in the file: "/plugins/compression/residual/wte.weight"
  ShardDesc shard;     // the full shape, and which elements `data` holds on this rank
  BufferRef data;      // this rank's elements (fp32), in the shard's local order; empty when it holds none
  bool holds = false;  // this rank holds elements of it (and reads all of them on load)
  // The elements [primary_begin, primary_end) of `data` this rank is the one owner of: it writes
  // them (and counts them in the tensor's checksum). Empty: a replica, or nothing held.
  std::int64_t primary_begin = 0, primary_end = 0;
  bool required = true;  // a file without it is refused (false: left as it is, e.g. state a run adds)
};

class CheckpointContributor {
 public:
  virtual ~CheckpointContributor() = default;
  // For messages: "compression reducer".
  virtual std::string checkpoint_name() const = 0;
  // The same paths in the same order on every rank (HDF5 creates datasets collectively).
  virtual std::vector<CheckpointTensor> checkpoint_tensors() = 0;
  // Scalar attributes of the file's root, the same value on every rank: name -> value.
  virtual std::map<std::string, double> checkpoint_attributes() const { return {}; }
  // After loading the tensors: the attributes the file has among those this contributor names.
  virtual void restore_attributes(const std::map<std::string, double>& /*found*/) {}
};

}  // namespace loom
