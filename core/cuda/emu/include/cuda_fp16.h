#pragma once
// The CUDA emulator's fp16 (core/cuda/emu/include/cuda_runtime.h): loom's own, bit for bit the device's.
#include "core/base/dtype.hpp"
using __half = loom::f16;
