// csrc/emu/stubs/cuda_runtime.h — the emulator's CUDA runtime subset (csrc/emu/cuda_emu.h).
#pragma once
#include "cuda_emu.h"
