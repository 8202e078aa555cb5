#pragma once
// A fingerprint of tensors wherever they live: the replica checks of strategies (are the dp replicas'
// parameters, the tp ranks' replicated tensors, bit for bit the same?) hash with this and compare.
#include <cstdint>
#include <vector>

#include "core/backend/backend_face.hpp"
#include "core/base/rng.hpp"

namespace loom {

// rng::hash_bytes of `t`'s bytes continuing from h, read through a host copy (kept in `scratch`)
// where the tensor is on a device.
inline std::uint64_t hash_tensor(BackendFace& be, BufferRef t, std::vector<unsigned char>& scratch,
                                 std::uint64_t h = 0xcbf29ce484222325ULL) {
  const void* bytes = t.data;
  if (t.space != MemSpace::host && t.bytes() > 0) {
    scratch.resize(t.bytes());
    be.copy_to_host(scratch.data(), t);
    bytes = scratch.data();
  }
  return rng::hash_bytes(bytes, t.bytes(), h);
}

}  // namespace loom
