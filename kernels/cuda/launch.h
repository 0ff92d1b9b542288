// Kernel launches and dynamic shared memory behind two macros, so that the kernels' .cu files
// also compile as C++ against the CPU emulation of CUDA (tests/emu/cuda_emulation.h, which
// defines DATTN_CUDA_EMULATION and its own versions of both): every CI run then executes the
// kernels' logic, although no CI machine has a GPU.
#pragma once

#ifndef DATTN_CUDA_EMULATION
// kernel<<<grid, block, smem_bytes, stream>>>(args...)
#define DATTN_LAUNCH(kernel, grid, block, smem_bytes, stream, ...) \
  kernel<<<(grid), (block), (smem_bytes), (stream)>>>(__VA_ARGS__)
// The kernel's dynamic shared memory, 16-byte aligned, as `type* name`.
#define DATTN_DYNAMIC_SHARED(type, name)                      \
  extern __shared__ __align__(16) unsigned char name##_raw[]; \
  type* name = reinterpret_cast<type*>(name##_raw)
#endif
