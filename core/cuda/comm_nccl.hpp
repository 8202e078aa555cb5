#pragma once
// The NCCL communicator of the cuda back end (core/cuda/comm_nccl.cpp): device buffers through NCCL
// (opened with dlopen when first needed), host buffers through the MPI communicator it wraps.
#include <cuda_runtime.h>
#include <mpi.h>

#include <memory>
#include <string>

#include "core/comm/comm.hpp"

namespace loom {

// A communicator over `comm` named `name`; its NCCL operations start after the work queued so far on
// `compute` (the back end's stream). Collective over `comm`: every rank calls it. Throws
// std::runtime_error (on every rank alike) when a rank cannot load NCCL.
std::unique_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, const std::string& name, cudaStream_t compute);

// "NCCL 2.28.3", or why NCCL cannot be loaded here.
std::string nccl_description();

}  // namespace loom
