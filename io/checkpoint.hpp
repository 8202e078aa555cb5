#pragma once
// Sharded parallel HDF5 checkpoints (DESIGN.md "Checkpoints"). One file per checkpoint, written in
// parallel through MPI-IO: every parameter and optimizer-state tensor is one dataset of its
// full logical shape under a group named for its role (/params, /optimizer/m, /optimizer/v); each
// rank writes only its hyperslab, and a replicated tensor is written by one owner. Attributes carry
// the format version, the step, the resolved deck, the layout, the generator and data-loader state
// and the loss scale. Because the files hold logical tensors, a run restarts on any layout.
#include <mpi.h>

#include <cstdint>
#include <map>
#include <string>

#include <vector>

#include "core/engine/checkpoint_part.hpp"
#include "core/model/gpt.hpp"
#include "core/comm/grid.hpp"
#include "core/model/optimizer.hpp"

namespace loom {

inline constexpr std::int64_t kCheckpointFormatVersion = 1;

struct CheckpointState {
  std::int64_t step = 0;             // steps completed; training resumes at this step (0-based)
  std::int64_t optimizer_steps = 0;  // AdamW updates taken
  std::int64_t skipped_steps = 0;    // steps whose update was skipped (non-finite); step = optimizer_steps + skipped
  GPTConfig model;                   // the model's shape (attributes model_layers, ...)
  std::uint64_t seed = 0;            // the counter-based generators' state is (seed, step)
  double loss_scale = 1.0;
  std::int64_t data_step = -1;  // the global batch step `step` draws (data_next_step; -1 on save: = step)
  std::string deck;             // the resolved deck text of the run that wrote it
  Layout layout;                // the layout that wrote it
};

// Collective over the grid's world. Writes `path` + ".tmp", closes it (every rank's data flushed),
// then rank 0 renames it to `path`; a crash before the rename leaves any earlier file untouched.
// A write that fails on any rank (no space, quota, file size limit, I/O error) removes the .tmp and
// throws AgreedFailure on every rank, naming the file, the rank and the system's reason.
// `parts`: the run's other roles that keep state (CheckpointContributor), written after the
// parameters and the optimizer state.
void save_checkpoint(const std::string& path, ProcessGrid& grid, GPT& model, Optimizer& optimizer,
                     const CheckpointState& state, const std::vector<CheckpointContributor*>& parts = {});

// What a checkpoint file holds, taken from the run at one step: its tensors and the contributed
// attributes. checkpoint_image views the live state (a device tensor is staged through `backend`
// as it is written); checkpoint_snapshot copies the elements this rank writes to host memory, so
// that training may go on while another thread writes them (checkpoint.async).
struct CheckpointImage {
  std::vector<CheckpointTensor> tensors;
  std::map<std::string, double> attributes;
  GPTConfig model;
  int n_params = 0;
  BackendFace* backend = nullptr;
  std::vector<std::vector<float>> copies;  // a snapshot's host copies, which `tensors` point into
};
CheckpointImage checkpoint_image(GPT& model, Optimizer& optimizer, const std::vector<CheckpointContributor*>& parts);
CheckpointImage checkpoint_snapshot(GPT& model, Optimizer& optimizer, const std::vector<CheckpointContributor*>& parts);
// Collective over every rank of `comm`: writes `path`.tmp, closes it and renames it (rank 0 of comm);
// returns this rank's failure ("" when none). Callers agree on it (save_checkpoint does).
std::string write_checkpoint_image(const std::string& path, MPI_Comm comm, const CheckpointImage& image,
                                   const CheckpointState& state);
// The same, with the ranks agreeing over `comm` itself (MPI only: for a writer thread on a duplicate of
// the world): "" on every rank, or on every rank the failure, each failing rank having printed its
// reason, and the .tmp removed.
std::string write_checkpoint_agreed(const std::string& path, MPI_Comm comm, const CheckpointImage& image,
                                    const CheckpointState& state);
// Whether any rank of `comm` failed (`local_failure` non-empty): "" or "<consequence>: it failed on K
// of N rank(s), first on rank R" on every rank; each failing rank prints its own reason.
std::string agree_over(MPI_Comm comm, const std::string& local_failure, const std::string& consequence);

// Collective. Every rank reads its own hyperslabs (and the replicated tensors whole). Throws
// InputError naming the file and the mismatch: not HDF5 / truncated / corrupt, another format
// version, a model shape (model.* keys) other than the deck's, a step that disagrees with the
// optimizer's step count, a tensor missing, of another shape, not matching its checksum or holding
// non-finite values.
CheckpointState load_checkpoint(const std::string& path, ProcessGrid& grid, GPT& model, Optimizer& optimizer,
                                const std::vector<CheckpointContributor*>& parts = {});

// section.key -> value of a resolved deck's text (the `deck` attribute), comments dropped.
std::map<std::string, std::string> resolved_deck_values(const std::string& text);

// Called first thing in main: HDF5 reports errors through loom's messages only, and registers no
// atexit clean-up (see io/checkpoint.cpp).
void init_hdf5();

// True on every rank once a failed checkpoint write left HDF5 holding a file it could not close: the
// process must then end without MPI_Finalize (which would make HDF5 close it again, and crash).
bool checkpoint_file_left_open();

// One process, no collective: the step, deck and model shape a checkpoint records (to build the model
// that load_checkpoint then fills, as `loom sample` and `loom ckpt llmc` do).
CheckpointState checkpoint_header(const std::string& path);

// The model.* keys whose values differ between a checkpoint's model and a deck's ("model.heads = 4 in
// the checkpoint, 2 in this deck; ..."), empty when none: a checkpoint continues only its own model.
std::string model_mismatches(const GPTConfig& in_checkpoint, const GPTConfig& deck);

// The checkpoint file a `latest` pointer at `path` names (one line, ckpt-*.h5, in its directory), or
// "" when `path` is not such a pointer: resume and `ckpt verify` say what to give instead of "corrupt".
std::string latest_pointer_target(const std::string& path);

// `loom ckpt info`: step, layout, deck, and every tensor with its shape and dtype (one process).
std::string checkpoint_info(const std::string& path);

// `loom ckpt verify`: what one process finds reading a whole checkpoint file, no collective.
struct CheckpointVerdict {
  std::int64_t step = -1;               // -1: its metadata could not be read
  Layout layout;                        // the layout that wrote it
  std::int64_t tensors = 0, bytes = 0;  // datasets read whole, and their values' bytes
  std::vector<std::string> problems;    // each naming the tensor or attribute; empty: intact
};
// The checks of load_checkpoint, on every tensor at once instead of stopping at the first: the
// metadata and the model shape, every parameter and optimizer tensor of that model present with its
// shape, and every dataset in the file (the plugins' too) matching its checksum and finite.
CheckpointVerdict verify_checkpoint(const std::string& path);

}  // namespace loom
