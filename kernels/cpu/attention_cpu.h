// The CPU attention kernel: blockwise online-softmax attention (the flash-attention algorithm)
// of a block of queries against a block of keys, merged into a running partial.
// It knows nothing of ranks: a strategy calls it once per (query block, key block) pair.
#pragma once

#include <cstdint>
#include <string>

#include "src/dtype.h"
#include "src/spec.h"

namespace dattn::cpu {

// One block of work. Tensors are bshd and contiguous:
//   q [batch, seq_q, heads_q, head_dim], k [batch, seq_k, heads_kv, head_dim],
//   v [batch, seq_k, heads_kv, head_dim_v], all of one storage dtype.
// The block uses query rows [q_begin, q_begin + q_len) and key rows [k_begin, k_begin + k_len)
// (q_len/k_len < 0: to the end). Query row q_begin + i sits at global position
//   q_pos0 + (i / q_pos_block) * q_pos_stride + i % q_pos_block
// (blocks of q_pos_block consecutive positions, q_pos_stride apart; block 1 and stride 1: a
// contiguous run), key rows likewise; the mask is evaluated on those positions.
struct AttentionBlock {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  DType dtype = DType::f32;
  int64_t batch = 0, seq_q = 0, seq_k = 0;
  int64_t heads_q = 0, heads_kv = 0, head_dim = 0, head_dim_v = 0;
  int64_t q_begin = 0, q_len = -1, q_pos0 = 0, q_pos_stride = 1, q_pos_block = 1;
  int64_t k_begin = 0, k_len = -1, k_pos0 = 0, k_pos_stride = 1, k_pos_block = 1;
  float scale = 1.f;
  Mask mask;
};

// Attends blk's query rows to its key rows and merges the result into the running partial
// out [batch, seq_q, heads_q, head_dim_v] fp32 and lse [batch, heads_q, seq_q] fp32 (the whole
// q tensor's rows; only the block's rows change)
// (start from clear_partial). Key tiles that the mask hides entirely are skipped, never
// computed; rows that see no key leave the partial unchanged (an empty partial stays out = 0,
// lse = -inf). Workspace is O(tile) per thread; S_q x S_k is never materialised.
// Parallel (OpenMP) over batch x head x query tile; BLAS runs single-threaded inside.
void attention_forward(const AttentionBlock& blk, float* out, float* lse);

// One line for report headers: the BLAS, its kernel core, the softmax ISA and the tiles, with a
// warning when OpenBLAS runs its generic kernels (set OPENBLAS_CORETYPE, see CMakeLists.txt).
std::string cpu_kernel_info();

// Query and key tile sizes (rows), exposed for tests that want shapes straddling tiles.
// 256 x 512 measured best of {64,128,256} x {256,512} for the sgemm tiles at D = 64 and 128
// (single thread, OpenBLAS SkylakeX kernels): larger tiles amortise OpenBLAS's operand packing.
inline constexpr int64_t kTileQ = 256;
inline constexpr int64_t kTileK = 512;

}  // namespace dattn::cpu
