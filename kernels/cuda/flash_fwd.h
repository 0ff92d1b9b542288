// The parameters of the CUDA flash-attention forward kernel and the declaration of its launcher,
// one explicit instantiation per (dtype, padded head_dim, padded head_dim_v) in its own .cu file
// (flash_fwd_<dtype>_d<D>[_dv<Dv>].cu); attention_cuda.cu dispatches to them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace dattn::cuda::detail {

// Everything the kernel reads, validated by attention_forward (attention_cuda.cu). Tensors are
// bshd and contiguous; head_dim / head_dim_v are the real sizes (<= the instantiation's padded
// sizes; the padding is zero-filled in shared memory and never written out).
struct FlashParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  float* out = nullptr;  // [batch, seq_q, heads_q, head_dim_v] fp32, merged into
  float* lse = nullptr;  // [batch, heads_q, seq_q] fp32, merged into
  int64_t batch = 0, seq_q = 0, seq_k = 0;
  int64_t heads_q = 0, heads_kv = 0, head_dim = 0, head_dim_v = 0;
  int64_t q_begin = 0, q_len = 0, q_pos0 = 0, q_pos_stride = 1, q_pos_block = 1;
  int64_t k_begin = 0, k_len = 0, k_pos0 = 0, k_pos_stride = 1, k_pos_block = 1;
  int64_t left = -1, right = -1;        // the band [q - left, q + right]; -1: unlimited
  const int64_t* cu_seqlens = nullptr;  // device, num_docs + 1 entries; null: one document
  int64_t num_docs = 0;
  float scale_log2 = 0.f;  // softmax scale * log2(e): scores go through exp2
  bool vec_loads = false;  // 16-byte cp.async loads allowed (dims % 8 == 0, 16-byte aligned)
};

// Launches the forward for one (element type, padded D, padded Dv) instantiation.
// T is __nv_bfloat16 or __half (declared, not defined, here so that g++ can include this file).
template <typename T, int kD, int kDv>
void launch_flash_fwd(const FlashParams& p, cudaStream_t stream);

}  // namespace dattn::cuda::detail
