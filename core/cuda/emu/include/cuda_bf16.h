#pragma once
// The CUDA emulator's bf16 (core/cuda/emu/include/cuda_runtime.h): loom's own, bit for bit the device's.
#include "core/base/dtype.hpp"
using __nv_bfloat16 = loom::bf16;
