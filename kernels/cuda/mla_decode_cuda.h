// The absorbed-MLA decode step on CUDA (the math of kernels/cpu/mla_cpu.h): scores against the
// shared latent cache, softmax, and the softmax-weighted latent z per head (mla_decode_forward);
// and the whole step of one rank's slice with the absorption of W_UK into the query before it and
// W_UV applied to z after it (mla_absorbed_decode, what mla_decode runs on GPU tensors).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/mla_block.h"

namespace dattn::cuda {

// All tensors fp32, contiguous, on the device:
//   q_latent [batch, seq_q, heads, latent]  q~_h = W_UK_h^T q_nope_h (absorbed by the caller)
//   q_pe     [batch, seq_q, heads, rope]
//   c_kv     [batch, seq_kv, latent]         the latent cache, shared by all heads
//   k_pe     [batch, seq_kv, rope]           the decoupled RoPE keys, shared by all heads
// Query s sits at position q_pos0 + s, cache row j at position j; query q sees key k when k is in
// [q - left, q + right] (-1: no limit; the default is causal).
struct MlaDecodeBlock {
  const float* q_latent = nullptr;
  const float* q_pe = nullptr;
  const float* c_kv = nullptr;
  const float* k_pe = nullptr;
  int64_t batch = 0, seq_q = 0, seq_kv = 0, heads = 0, latent = 0, rope = 0;
  int64_t q_pos0 = 0;
  float scale = 1.f;  // the MLA softmax scale (MlaConfig::scale())
  int64_t left = -1, right = 0;
};

// scores_h[j] = scale * (q~_h . c_j + q_pe_h . k_pe_j) over the visible j; writes (not merges)
// z [batch, seq_q, heads, latent] = softmax(scores_h) . c and lse [batch, heads, seq_q] (natural
// log-sum-exp of the scores); a query that sees no cache row gets z = 0, lse = -inf. latent and
// rope within kernels/cuda/limits.h. The cache rows are split across CTAs (split-KV), each row
// read once per block of heads, and the splits merged in a fixed order (the same bits from run to
// run); the splits' states are stream-ordered scratch. Validated before launch (dattn::Error
// naming the field); asynchronous on `stream`.
void mla_decode_forward(const MlaDecodeBlock& blk, float* z, float* lse, cudaStream_t stream);

// The whole absorbed decode of one rank's slice (kernels/mla_block.h) on the device, in three
// steps on `stream`: q~_h = W_UK_h[:, slice]^T q_nope_h (and the slice's q_pe columns), the
// decode kernel above, out_h = W_UV_h[:, slice] z_h. Writes (not adds) out [batch, seq_q,
// out_heads, v_head] at heads out_h0 .. out_h0 + nh, and lse [batch, nh, seq_q] unless null; a
// query that sees no cache row gets out = 0, lse = -inf. Its scratch (the absorbed queries and z)
// is stream-ordered (cudaMallocAsync). Validated before launch (dattn::Error naming the field).
void mla_absorbed_decode(const MlaAbsorbedBlock& blk, float* out, int64_t out_heads, int64_t out_h0,
                         float* lse, cudaStream_t stream);

}  // namespace dattn::cuda
