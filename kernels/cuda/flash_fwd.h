// The parameters of the CUDA flash-attention forward kernel and the declaration of its launcher,
// one explicit instantiation per (dtype, padded head_dim, padded head_dim_v) in its own .cu file
// (flash_fwd_<dtype>_d<D>[_dv<Dv>].cu); attention_cuda.cu dispatches to them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/attention_cuda.h"

namespace dattn::cuda::detail {

// Everything the kernel reads, validated by attention_forward (attention_cuda.cu): the block of
// work as the caller gave it (AttentionBlock: tensors bshd and contiguous, rows, positions, the
// mask by value), with q_len/k_len resolved (never < 0) and cu_seqlens null without documents;
// head_dim / head_dim_v are the real sizes (<= the instantiation's padded sizes; the padding is
// zero-filled in shared memory and never written out); plus the output and the derived values.
struct FlashParams : AttentionBlock {
  float* out = nullptr;    // [batch, seq_q, heads_q, head_dim_v] fp32, merged into
  float* lse = nullptr;    // [batch, heads_q, seq_q] fp32, merged into
  float scale_log2 = 0.f;  // softmax scale * log2(e): scores go through exp2
  bool vec_loads = false;  // 16-byte cp.async loads allowed (dims % 8 == 0, 16-byte aligned)
};

// Validates every field of blk and the output pointers (dattn::Error naming the first bad one) and
// fills *p from them; false when there is nothing to attend (no batch, query or key rows), which
// leaves the partial unchanged. The forward and the decode kernel (decode_cuda.cu) share it.
bool flash_params(const AttentionBlock& blk, float* out, float* lse, FlashParams* p);

// Launches the forward for one (element type, padded D, padded Dv) instantiation.
// T is __nv_bfloat16 or __half (declared, not defined, here so that g++ can include this file).
template <typename T, int kD, int kDv>
void launch_flash_fwd(const FlashParams& p, cudaStream_t stream);

}  // namespace dattn::cuda::detail
