#pragma once
// OpenBLAS built with DYNAMIC_ARCH picks its kernels from the CPU's model id. On virtual machines
// that report a generic model ("Intel Xeon Processor") it falls back to its SSE3 "Prescott" kernels
// and runs sgemm 3-6x below the hardware's speed, even when the CPU advertises AVX2 or AVX-512.
// Before anything else starts, loom checks for that case and, if the user has not chosen a core with
// OPENBLAS_CORETYPE, re-executes itself with the core that the CPU's feature flags support. The test
// programs apply the same rule, so that they check the kernels loom runs with.
namespace loom {
// Returns only if no re-exec was needed (or it failed); `note` receives what was decided.
void select_openblas_core(char** argv);
// What select_openblas_core decided, for the banner and report ("" when nothing was done).
const char* openblas_core_note();
}  // namespace loom
