// DATTN_CUDA_CHECK: the checking macro for every CUDA runtime call (host code only), in the base
// layer because tensors, kernels and the NCCL communicator all use it. A failure throws
// dattn::Error naming the call, CUDA's error name and text, and file:line, like DATTN_MPI_CHECK;
// its kind is out_of_memory for cudaErrorMemoryAllocation (a cudaMalloc that did not fit), else
// cuda.
#pragma once

#include <cuda_runtime_api.h>

#include "src/base/error.h"

#define DATTN_CUDA_CHECK(call)                                                                     \
  do {                                                                                             \
    const cudaError_t dattn_cuda_err_ = (call);                                                    \
    if (dattn_cuda_err_ != cudaSuccess)                                                            \
      DATTN_THROW_KIND(dattn_cuda_err_ == cudaErrorMemoryAllocation                                \
                           ? ::dattn::ErrorKind::out_of_memory                                     \
                           : ::dattn::ErrorKind::cuda,                                             \
                       "CUDA call failed: ", #call, ": ", cudaGetErrorName(dattn_cuda_err_), " (", \
                       int(dattn_cuda_err_), "): ", cudaGetErrorString(dattn_cuda_err_));          \
  } while (0)
