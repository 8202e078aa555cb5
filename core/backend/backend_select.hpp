#pragma once
// Which back end a run computes on (`run.backend = host | cuda | auto`), and the loader of the CUDA
// back end. The CUDA back end is its own library (libloom_cuda.so, built when LOOM_ENABLE_CUDA is
// on) opened with dlopen on first use, so that libloom_core and the driver never link CUDA: a
// CPU-only node runs `host` (and `auto`) without the CUDA libraries installed.
#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "core/backend/backend.hpp"

namespace loom {

// The entry points of libloom_cuda.so (extern "C", resolved by dlsym).
// LOOM_CUDA_ABI_VERSION: 4: the fused attention's Backend entries; 5: Backend::int8_*, axpy;
// 6: Backend::topk_*; 7: Backend::plan_workspace, ring_scratch_pools, topk_scratch_bytes;
// 8: loom_cuda_device_uuids; 9: Backend's operations from one list (core/backend/backend_ops.hpp),
// last in the vtable, the defaulted ones before them; 10: BackendFace first (the plugin face,
// LOOM_FACE_OPS), then the rest of Backend; 11: every operation's tensors typed BufferRefs;
// 12: residual_layernorm_forward; 13: loom_cuda_device_memory; 14: matmul_forward_gelu,
// gelu_bias_backward; 15: adamw_update_slices; 16: 16-bit outputs of the LayerNorm, GELU and fused
// attention forwards and of gelu_bias_backward, a 16-bit dout of matmul_backward; 17: a 16-bit dlogits
// of crossentropy_backward; 18: crossentropy_fused and crossentropy_finish_grad (the fused classifier);
// 19: Llama's rmsnorm_*, rope_gqa_*, swiglu_*; 20: ring attention (attention_ring_*, copy_rows,
// ring_attention_refusal) in the face; 21: mixture of experts' rows_gather, rows_scatter_add, rows_dot
// and expert_rows_refusal on the device.
#define LOOM_CUDA_ABI_VERSION 21
#define LOOM_CUDA_LIBRARY "libloom_cuda.so"
extern "C" {
// LOOM_CUDA_ABI_VERSION of the loom the library was built against.
typedef int (*loom_cuda_abi_fn)();
// The number of CUDA devices this process sees; 0 with the reason in `why` (at most `why_len`
// bytes, NUL-terminated) when there are none or the driver cannot be used.
typedef int (*loom_cuda_device_count_fn)(char* why, int why_len);
// The identities (16-byte UUIDs) of the devices this process sees, in the order of their ordinals:
// the first `max` written to `uuids` (16 bytes each); returns how many it sees, 0 where it sees none.
typedef int (*loom_cuda_device_uuids_fn)(unsigned char* uuids, int max);
// A new CUDA back end on device `device`; fp32 products in TF32 when `tf32` is 1, never when 0, and
// when 2 (run.tf32 = auto) only in a run whose matrix products are 16-bit (attention's, then);
// throws std::runtime_error when the device cannot be used.
typedef loom::Backend* (*loom_cuda_create_fn)(int device, int tf32);
// Device `device`'s free and total memory in bytes (cudaMemGetInfo, after loom_cuda_create opened
// it); 0 on success.
typedef int (*loom_cuda_device_memory_fn)(int device, std::size_t* free_bytes, std::size_t* total_bytes);
// run.tf32's value as loom_cuda_create takes it: "false" 0, "true" 1, "auto" 2.
int tf32_mode(const std::string& setting);
}

// The GPU a rank drives, one device per rank: the devices its node's ranks see are told apart by
// identity (their UUIDs, `seen[q]` for local rank q in the order of q's ordinals), and each rank, in
// local-rank order, takes the first device it sees that no rank before it took, or, where none is
// free, one that an earlier rank gives up for another it sees (a maximum matching); returned as the
// ordinal in `local_rank`'s own list. Where every rank sees every device, rank i drives device i; where
// the scheduler gives each rank its own (Slurm's --gpus-per-task=1 or --gpu-bind, or a per-rank
// CUDA_VISIBLE_DEVICES, each rank seeing one device as its ordinal 0), each drives that one. Throws
// InputError when local_rank sees no device, and, the same on every rank of the node, when some rank
// is left without one (fewer distinct devices than ranks, or too few that the ranks can each see).
// With `share` (run.share_gpu) a rank left without one drives ordinal (local rank mod the devices it
// sees) instead.
using DeviceIds = std::vector<std::string>;
int device_for_local_rank(int local_rank, const std::vector<DeviceIds>& seen, const std::string& why_none = "",
                          bool share = false);
// The same where every rank of the node sees the same `device_count` devices.
int device_for_local_rank(int local_rank, int ranks_per_node, int device_count, const std::string& why_none = "",
                          bool share = false);

// What a run asked for and what it got, for the banner and the report.
struct BackendChoice {
  std::string requested;                     // run.backend: host, cuda or auto
  std::string name;                          // host or cuda
  int device = -1;                           // the CUDA device of this rank (cuda only)
  double device_free = 0, device_total = 0;  // its memory in bytes once opened (cuda only; 0: unknown)
  std::string reason;                        // why auto chose what it chose
};

// The back end of this rank. `requested` is run.backend; `world` is split by node to find the rank's
// local index; `tf32` (run.tf32: auto, true, false) lets the cuda back end's fp32 products use TF32; `share_gpu`
// (run.share_gpu) lets several ranks of a node drive one GPU. host: the host back end with
// `threads` BLAS threads. fenced: make_fenced_backend. cuda: libloom_cuda.so from the plugin
// search path, device = the rank's index within its node; refused (InputError, exit 2) when loom
// was built without CUDA, the library cannot be loaded, no device is visible, or a node has fewer
// devices than ranks (unless shared). auto: cuda when a device is visible and usable for every rank
// of the node, else host (the banner says why). Several ranks: each back end makes its groups'
// communicators (Backend::make_communicator).
std::unique_ptr<Backend> make_backend(const std::string& requested, int threads, const std::string& tf32,
                                      bool share_gpu, MPI_Comm world, BackendChoice* choice);

// Whether this loom was built with the CUDA back end (LOOM_ENABLE_CUDA).
bool cuda_built();

}  // namespace loom
