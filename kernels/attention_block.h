// The block of work both attention kernels take (kernels/cpu on host memory, kernels/cuda on
// device memory): the tensors, their shapes, the rows used and their global positions, and the
// scale. Each kernel's AttentionBlock adds the mask in the form that kernel reads.
#pragma once

#include <cstdint>

#include "src/base/dtype.h"
#include "src/base/error.h"

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
  float softcap = 0.f;  // > 0: scores become softcap * tanh(score / softcap) (AttnSpec::softcap)

  // The block's row counts (q_len/k_len resolved) and the global position of its query row i and
  // key row j.
  int64_t q_rows() const { return q_len < 0 ? seq_q - q_begin : q_len; }
  int64_t k_rows() const { return k_len < 0 ? seq_k - k_begin : k_len; }
  int64_t q_position(int64_t i) const {
    return q_pos0 + (i / q_pos_block) * q_pos_stride + i % q_pos_block;
  }
  int64_t k_position(int64_t j) const {
    return k_pos0 + (j / k_pos_block) * k_pos_stride + j % k_pos_block;
  }
  // The shape invariants every kernel relies on (the entry points validated the user's values):
  // an internal error when one fails.
  void check() const {
    DATTN_ASSERT(heads_kv > 0 && heads_q % heads_kv == 0 && head_dim > 0 && head_dim_v > 0);
    DATTN_ASSERT(q_begin >= 0 && q_begin + q_rows() <= seq_q);
    DATTN_ASSERT(k_begin >= 0 && k_begin + k_rows() <= seq_k);
    DATTN_ASSERT(q_pos_block >= 1 && k_pos_block >= 1);
  }
};

}  // namespace dattn
