// Device-dispatching helpers: the small copies and elementwise steps that schedule code needs on
// whatever device its tensors live, each picking the host code (memcpy, movement::host) or the GPU
// code (cudaMemcpy, movement::cuda) by a Device. Strategy code calls these and never branches on
// the device itself (DESIGN.md "Backends"); this file and src/attention.cpp are where it happens.
//
// GPU work goes on the legacy default stream, as the attention kernels run (src/attention.cpp):
// the NCCL communicator orders its calls after that stream's queued work and completes them on
// the host, so the order kernel -> copy/weigh -> NCCL collective -> unweigh holds without events
// in the callers. Calls return once the GPU work is queued.
#pragma once

#include <cstddef>
#include <cstdint>

#include "src/base/spec.h"
#include "src/base/tensor.h"

namespace dattn {

// dst[0, bytes) = src[0, bytes), both on `device` (no overlap). Host: memcpy.
void copy_bytes(void* dst, const void* src, size_t bytes, Device device);

// Copies `rows` rows of every batch entry: src holds src_seq rows per entry (from src_row0 on),
// dst dst_seq rows per entry (written from dst_row0 on); a row is row_bytes bytes. Either side on
// the host or a GPU: host to host is a memcpy per entry; any GPU side one cudaMemcpy2D over the
// batch (cudaMemcpyDefault, so host <-> device where the caller gave host memory). rows == 0
// touches no pointer.
void copy_rows(void* dst, Device dst_device, int64_t dst_seq, int64_t dst_row0, const void* src,
               Device src_device, int64_t src_seq, int64_t src_row0, int64_t batch, int64_t rows,
               size_t row_bytes);

// movement::{host,cuda}::pack_rows and unpack_rows (kernels/movement/movement.h: a strided block
// of rows to and from a contiguous buffer) on `device`, every pointer there.
void pack_rows(Device device, void* buf, const void* src, int64_t outer, int64_t inner,
               size_t outer_stride, size_t inner_stride, size_t row_bytes);
void unpack_rows(Device device, void* dst, const void* buf, int64_t outer, int64_t inner,
                 size_t outer_stride, size_t inner_stride, size_t row_bytes);

// movement::{host,cuda}::merge_partials on `device`: (out_a, lse_a) <- their merge with
// (out_b, lse_b), the rule of kernels/merge.h for every row.
void merge_partials(Device device, float* out_a, float* lse_a, const float* out_b,
                    const float* lse_b, int64_t batch, int64_t seq, int64_t heads, int64_t dv);

// movement::{host,cuda}::weigh_partial and unweigh_partial (kernels/movement/movement.h: the
// tree decode's allreduce payload and its merge) on `device`, every pointer there.
void weigh_partial(Device device, float* packed, const float* out, const float* lse, const float* m,
                   int64_t batch, int64_t seq, int64_t heads, int64_t dv);
void unweigh_partial(Device device, float* out, float* lse, const float* packed, const float* m,
                     int64_t batch, int64_t seq, int64_t heads, int64_t dv);

// What the CUDA attention kernel runs (kernels/cuda): bf16/fp16 storage, head dims <= 256, batch
// and query heads within its grid. Throws dattn::Error naming the value; the entry points call it
// inside their agreed validation for cuda tensors, so that every rank fails before data moves.
void check_cuda_kernel_limits(DType dtype, const AttnSpec& spec, int64_t batch);

}  // namespace dattn
