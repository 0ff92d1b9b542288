// The dispatch layer: the one place that picks the CPU or the CUDA code for a call, by the device
// of its tensors. Schedules (src/strategies/) and entry points call these functions and never
// branch on the device themselves: the attention kernels over runs of rows (attend_runs,
// backward_runs), empty partials, the absorbed MLA decode step, the small copies and elementwise
// steps (packing, merges, the tree decode's weighting), and the check of the CUDA kernels' limits.
//
// GPU work goes on the current stream (src/base/stream.h: the Runtime's), where every kernel
// runs: the NCCL communicator's own stream waits for what that stream holds each time it issues
// (NcclCommunicator::follow_current_stream), and its waits make the current stream wait for the
// NCCL stream on the GPU (an event), so each kernel runs after the receive that filled its block
// and before any later NCCL call that overwrites that block or reads the result, with no event in
// the callers. Calls return once the GPU work is queued; only a copy to host memory waits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/mla_block.h"
#include "src/base/spec.h"
#include "src/base/tensor.h"
#include "src/layout.h"
#include "src/partial.h"

namespace dattn {

// dst[0, bytes) = src[0, bytes), both on `device` (no overlap). Host: memcpy.
void copy_bytes(void* dst, const void* src, size_t bytes, Device device);
// n floats at p = 0, and out = a + b elementwise (out may be a or b), on `device`.
void zero_floats(float* p, size_t n, Device device);
void add_floats(float* out, const float* a, const float* b, size_t n, Device device);
// t as fp32 on its own device: t itself when it is fp32, else a widened copy (exact).
Tensor as_f32(const Tensor& t);

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

// Joins attention sinks (AttnSpec::sinks, one per head of p) to a merged partial, in place, on
// its device: movement::{host,cuda}::add_sinks. An undefined p (a rank without the result) is
// left alone.
void add_sinks(Partial& p, const std::vector<float>& sinks);

// ------------------------------------------------------------------ kernels

// Attends q's rows q_runs (rows of q and their global positions) to the rows k_runs of a K/V
// block of k_rows rows per batch entry (bshd, q's dtype), merging into res. k, v and res live on
// q's device: the CPU kernel for host tensors, the CUDA kernel (asynchronous) for GPU ones.
void attend_runs(const Tensor& q, const std::vector<Run>& q_runs, const void* k, const void* v,
                 int64_t k_rows, const std::vector<Run>& k_runs, const AttnSpec& spec,
                 Partial& res);

// The backward of attend_runs: adds the gradients of q's rows q_runs against the K/V block's rows
// k_runs to dq [B, S_q, H_q, D] and to the block's dk [B, k_rows, H_kv, D], dv (fp32). dout is
// [B, S_q, H_q, D_v] in its own dtype; lse and delta fp32 [B, H_q, S_q]. Every pointer on q's
// device: the CPU kernel, or the CUDA one (kernels/cuda/attention_backward_cuda.h, asynchronous).
void backward_runs(const Tensor& q, const std::vector<Run>& q_runs, const void* k, const void* v,
                   int64_t k_rows, const std::vector<Run>& k_runs, const Tensor& dout,
                   const float* lse, const float* delta, const AttnSpec& spec, float* dq, float* dk,
                   float* dv);

// delta [B, H_q, S] fp32 = rowsum(dout * out) of the backward: dout [B, S, H_q, D_v] in any dtype,
// out fp32 of the same shape; on out's device.
Tensor backward_delta(const Tensor& dout, const Tensor& out);

// An empty partial for q, on q's device: out = 0 [B, S, H_q, D_v], lse = -inf [B, H_q, S].
Partial empty_partial(const Tensor& q, const AttnSpec& spec);
// Clears p (out = 0, lse = -inf) on its device.
void clear_partial(Partial& p);

// What the attention kernels of this process have done since the last reset_kernel_stats(): every
// attend_runs and mla_absorbed_decode call adds one call and the K/V bytes it streams at least
// once (attend_runs: the rows of its key runs x batch x heads_kv x (D + D_v) x the dtype's size,
// none when its query runs are empty; mla_absorbed_decode: the slice's latent and RoPE cache rows,
// batch x seq_kv x (nlat + nrope) x 4). A call on host tensors adds its wall time to seconds; one
// on GPU tensors only queues work and adds no time (seconds covers the host calls alone). The
// counters are atomic: calls from several threads are counted, a snapshot is not one instant.
struct KernelStats {
  double seconds = 0;
  uint64_t bytes = 0;
  uint64_t calls = 0;
};
KernelStats kernel_stats();
void reset_kernel_stats();

// The absorbed MLA decode step of one slice (kernels/mla_block.h) on `device`, every pointer
// there: the CPU kernel (kernels/cpu/mla_cpu.h, any mask) or the CUDA one (a band mask only).
void mla_absorbed_decode(Device device, const MlaAbsorbedBlock& blk, const Mask& mask, float* out,
                         int64_t out_heads, int64_t out_h0, float* lse);

// ------------------------------------------------------------------ kernel limits

// What the kernels run on `device` (for cuda, kernels/cuda/limits.h: bf16/fp16, head dims, grid
// limits, and the kernels' shared memory against the device's opt-in limit); nothing on the
// host. q_rows: the most query rows one block of the call holds, which decides the kernels (the
// decode kernel up to kMaxDecodeQueryRows, the forward above); -1: any (prefill). Throws
// dattn::Error naming the value; the entry points call them inside their agreed validation, so
// that every rank fails before data moves.
void check_attention_limits(Device device, DType dtype, const AttnSpec& spec, int64_t batch,
                            int64_t q_rows);
// The MLA decode step of one rank's slice: nlat latent and nrope RoPE columns, batch x seq_q
// queries, qk_nope, and the mask (a band on cuda).
void check_mla_limits(Device device, const Mask& mask, int64_t nlat, int64_t nrope, int64_t batch,
                      int64_t seq_q, int64_t qk_nope);

}  // namespace dattn
