// core/cuda/expert_rows.cu compiled by the host compiler for the emulated device (libloom_cuda_emu.so):
// its kernels run through the CUDA emulator, its launches queue on the emulated runtime.
#include "core/cuda/expert_rows.cu"
