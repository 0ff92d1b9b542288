// The CUDA attention backward's host interface: the CPU backward's block of work
// (kernels/cpu/attention_backward_cpu.h) on device pointers, with the forward's AttentionBlock
// (kernels/cuda/attention_cuda.h) for the rows, positions, mask and scale. Host-only header: g++
// and nvcc both include it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/attention_cuda.h"
#include "src/base/dtype.h"

namespace dattn::cuda {

// Accumulates the gradients of blk's attention into dq [batch, seq_q, heads_q, head_dim], dk
// [batch, seq_k, heads_kv, head_dim] and dv [batch, seq_k, heads_kv, head_dim_v], fp32 device
// arrays, +=; only the block's rows change. dout [batch, seq_q, heads_q, head_dim_v] is in
// dout_dtype (fp32, bf16 or fp16); lse and delta [batch, heads_q, seq_q] fp32 are the whole
// attention's (the final lse; delta from attention_backward_delta). The CPU kernel's semantics:
// P recomputed from lse, GQA's dk and dv summed over each group's heads (K and V never expanded),
// a row with lse = -inf contributes nothing, and a pair the mask hides is never multiplied (NaN
// or inf there reaches no gradient). Deterministic: every output element is written by one
// thread block, which adds its terms in a fixed order; no atomics, so that two calls give the
// same bits. Asynchronous on `stream`; every field is validated (dattn::Error naming the first
// bad one) before anything is launched.
//
// fp32 CUDA cores, two kernels: one per (8-key tile, kv head, batch) for dk and dv, one per
// (8-query tile, head, batch) for dq, both recomputing S and dP (flash-attention 2's two-pass
// split, without its tensor-core MMAs: the correctness-first kernel, not a fast one).
void attention_backward(const AttentionBlock& blk, const void* dout, DType dout_dtype,
                        const float* lse, const float* delta, float* dq, float* dk, float* dv,
                        cudaStream_t stream);

// delta[b, h, s] = sum_d dout[b, s, h, d] * out[b, s, h, d] (accumulated in double): dout in
// `dtype` (fp32, bf16 or fp16), out fp32 [batch, seq, heads, head_dim_v], delta fp32 [batch,
// heads, seq]; device arrays, asynchronous on `stream`.
void attention_backward_delta(const void* dout, DType dtype, const float* out, int64_t batch,
                              int64_t seq, int64_t heads, int64_t head_dim_v, float* delta,
                              cudaStream_t stream);

}  // namespace dattn::cuda
