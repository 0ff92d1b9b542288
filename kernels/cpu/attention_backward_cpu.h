// The CPU attention backward kernel: gradients dq, dk, dv of one block of queries against one
// block of keys, probabilities recomputed tile by tile from the final lse (flash-attention 2's
// backward), and the delta = rowsum(dout * out) it needs. Deterministic: no atomics.
#pragma once

#include <cstdint>

#include "kernels/cpu/attention_cpu.h"
#include "src/base/dtype.h"

namespace dattn::cpu {

// How the work is split among the OpenMP threads. Every schedule performs the same floating-point
// operations in the same order on every output element, so they give bit-identical results
// (test_backward checks it); they differ only in speed.
//   fused:    one task per (batch, kv head) computes dk, dv and dq of its heads in one sweep
//             (5 tile GEMMs per tile pair) — parallel only over batch x kv heads.
//   two_pass: tasks per (batch, kv head, key tile) for dk, dv, then per (batch, query head, query
//             tile) for dq (7 tile GEMMs per tile pair: S and dP are computed twice) — enough
//             tasks for any thread count.
//   automatic: fused when batch x kv heads keep the threads about as busy as two_pass would.
enum class BackwardSchedule : uint8_t { automatic, fused, two_pass };

// Accumulates the gradients of blk's attention (same rows, positions, mask and scale as
// attention_forward) into dq [batch, seq_q, heads_q, head_dim], dk [batch, seq_k, heads_kv,
// head_dim] and dv [batch, seq_k, heads_kv, head_dim_v], all fp32, +=; only the block's rows
// change. dout [batch, seq_q, heads_q, head_dim_v] is in blk.dtype. lse and delta
// [batch, heads_q, seq_q] fp32 are those of the whole attention the block is part of (the final
// lse, not the block's), delta from attention_backward_delta. With GQA dk and dv sum over the
// query heads of each group. Tiles the mask hides entirely are skipped; a row with lse = -inf
// (it saw no key) contributes nothing. Workspace O(tile) per thread; S_q x S_k never exists.
void attention_backward(const AttentionBlock& blk, const void* dout, const float* lse,
                        const float* delta, float* dq, float* dk, float* dv,
                        BackwardSchedule schedule = BackwardSchedule::automatic);
// The same with dout in its own storage dtype (e.g. fp32 gradients of bf16 q, k, v).
void attention_backward(const AttentionBlock& blk, const void* dout, DType dout_dtype,
                        const float* lse, const float* delta, float* dq, float* dk, float* dv,
                        BackwardSchedule schedule = BackwardSchedule::automatic);

// delta[b, h, s] = sum_d dout[b, s, h, d] * out[b, s, h, d] (accumulated in double): dout in
// `dtype`, out fp32 [batch, seq, heads, head_dim_v], delta fp32 [batch, heads, seq].
void attention_backward_delta(const void* dout, DType dtype, const float* out, int64_t batch,
                              int64_t seq, int64_t heads, int64_t head_dim_v, float* delta);

}  // namespace dattn::cpu
