// The block of work both attention kernels take (kernels/cpu on host memory, kernels/cuda on
// device memory): the tensors, their shapes, the rows used and their global positions, and the
// scale. Each kernel's AttentionBlock adds the mask in the form that kernel reads.
#pragma once

#include <cstdint>

#include "src/base/dtype.h"

namespace dattn {

// Tensors are bshd and contiguous:
//   q [batch, seq_q, heads_q, head_dim], k [batch, seq_k, heads_kv, head_dim],
//   v [batch, seq_k, heads_kv, head_dim_v], all of one storage dtype.
// The block uses query rows [q_begin, q_begin + q_len) and key rows [k_begin, k_begin + k_len)
// (q_len/k_len < 0: to the end). Query row q_begin + i sits at global position
//   q_pos0 + (i / q_pos_block) * q_pos_stride + i % q_pos_block
// (blocks of q_pos_block consecutive positions, q_pos_stride apart; block 1 and stride 1: a
// contiguous run), key rows likewise; the mask is evaluated on those positions.
struct BlockOfWork {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  DType dtype = DType::f32;
  int64_t batch = 0, seq_q = 0, seq_k = 0;
  int64_t heads_q = 0, heads_kv = 0, head_dim = 0, head_dim_v = 0;
  int64_t q_begin = 0, q_len = -1, q_pos0 = 0, q_pos_stride = 1, q_pos_block = 1;
  int64_t k_begin = 0, k_len = -1, k_pos0 = 0, k_pos_stride = 1, k_pos_block = 1;
  float scale = 1.f;
};

}  // namespace dattn
