// The CPU attention kernel: blockwise online-softmax attention (the flash-attention algorithm)
// of a block of queries against a block of keys, merged into a running partial.
// It knows nothing of ranks: a strategy calls it once per (query block, key block) pair.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/attention_block.h"
#include "src/base/dtype.h"
#include "src/base/spec.h"

namespace dattn::cpu {

// One block of work (kernels/attention_block.h: tensors, shapes, rows and their global
// positions, scale) and its mask, evaluated on those positions.
struct AttentionBlock : BlockOfWork {
  Mask mask;
};

// Attends blk's query rows to its key rows and merges the result into the running partial
// out [batch, seq_q, heads_q, head_dim_v] fp32 and lse [batch, heads_q, seq_q] fp32 (the whole
// q tensor's rows; only the block's rows change)
// (start from clear_partial). Key tiles that the mask hides entirely are skipped, never
// computed; rows that see no key leave the partial unchanged (an empty partial stays out = 0,
// lse = -inf). Workspace is O(tile) per thread, plus one copy of K and V (dense per head, up to
// 256 MiB) where the tiles would otherwise copy them per tile pair; S_q x S_k is never
// materialised. Parallel (OpenMP) over batch x head x query tile; BLAS runs single-threaded inside.
void attention_forward(const AttentionBlock& blk, float* out, float* lse);

// One line for report headers: the BLAS, its kernel core, the softmax ISA, the tiles and the decode
// kernel's ISA, with a warning when OpenBLAS runs its generic kernels (set OPENBLAS_CORETYPE, see
// CMakeLists.txt).
std::string cpu_kernel_info();

// Query and key tile sizes (rows), exposed for tests that want shapes straddling tiles.
// 256 x 512 measured best of {64,128,256} x {256,512} for the sgemm tiles at D = 64 and 128
// (single thread, OpenBLAS SkylakeX kernels): larger tiles amortise OpenBLAS's operand packing.
inline constexpr int64_t kTileQ = 256;
inline constexpr int64_t kTileK = 512;

}  // namespace dattn::cpu
