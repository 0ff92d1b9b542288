// The CPU decode kernel: attention of a few query rows against a long key range, bound by the
// memory it streams. Each key row is read once for every query row that uses it (all the query
// heads of its GQA group, all the block's rows), bf16/fp16 rows are widened in registers, and the
// key range is split across the threads (split-KV), each split a partial merged in a fixed order.
#pragma once

#include <cstdint>

#include "kernels/cpu/attention_cpu.h"
#include "src/base/dtype.h"
#include "src/base/spec.h"

namespace dattn::cpu {

// Whether decode_forward, not attention_forward's tile GEMMs, takes a block of q_len query rows.
// Measured on one AMD EPYC (Zen 3) thread, context 32768, D = 128, H_kv = 8, GQA 1 and 8, fp32 and
// bf16: the decode kernel is ahead at every q_len from 1 (3x to 10x) to 128 (1.1x to 1.4x), as it
// reads each kv head's keys once for the whole group and widens a 16-bit chunk once; the tile
// kernel keeps the prefill-sized blocks.
inline constexpr int64_t kDecodeMaxQueryRows = 64;
inline bool decode_kernel_wins(int64_t q_len) {
  return q_len <= kDecodeMaxQueryRows;
}

// The instruction sets the kernel's loops are built for, best last; tests run every one the CPU
// has (isa <= decode_best_isa()). x86_64_v4_bf16 adds AVX512-BF16, whose dot products of bf16
// pairs compute a bf16 cache's scores (DecodeJob::q16).
enum class DecodeIsa { baseline, x86_64_v3, x86_64_v4, x86_64_v4_bf16 };
DecodeIsa decode_best_isa();
const char* decode_isa_name(DecodeIsa isa);  // "x86-64-v4+bf16", "x86-64-v4", "x86-64-v3", ...

// The sum of n floats, read once on isa's widest vectors (four accumulators, so that the adds'
// latency never limits the loads): the decode kernel's roofline, a STREAM-style read at the
// instruction set the kernel runs (the benchmarks' "Read bandwidth"). Built without those
// vectors the same loop ran at 0.77 of this one's rate (one thread of an Emerald Rapids VM,
// 11.8 against 15.3 GB/s), so that the kernel seemed to read faster than the machine could.
float read_sum(const float* p, int64_t n, DecodeIsa isa = decode_best_isa());

// attention_forward's contract (kernels/cpu/attention_cpu.h) for any block: attends blk's query
// rows to its key rows and merges the result into the running partial out/lse; rows that see no
// key are unchanged; a NaN or inf that the mask hides from a row never reaches it. Bit-identical
// from run to run at a fixed OpenMP thread count. Workspace O(rows x splits), never S_q x S_k.
void decode_forward(const AttentionBlock& blk, float* out, float* lse,
                    DecodeIsa isa = decode_best_isa());

// The generic decode over one batch entry, which decode_forward and the MLA decode share: rows
// query rows per kv head against keys [0, n_keys), for heads_kv kv heads. A key's score for a row
// is q1 . k1 + q2 . k2 (k2 may be absent: d2 = 0; MLA's RoPE part), its value v.
//   q [heads_kv, rows, d1 + d2] fp32, already multiplied by the softmax scale
//   k1, k2, v in `dtype`; element (key j, kv head h) of each at base + j * key_stride + h *
//   head_stride (elements)
// Row r sits at global position q_pos[r]; key j at k_pos0 + (j / k_pos_block) * k_pos_stride +
// j % k_pos_block; `mask` decides on those positions.
//   q16 (optional, bf16 caches): the same queries in bf16 before the scale, [heads_kv, rows, d1 +
//   d2], exact only where they came in as bf16; an instruction set with bf16 dot products then
//   computes the scores as (q16 . k) * q16_scale, fp32 products and sums, and q serves the rest.
struct DecodeJob {
  const float* q = nullptr;
  const bf16* q16 = nullptr;
  float q16_scale = 1.f;
  const int64_t* q_pos = nullptr;
  int64_t heads_kv = 1, rows = 0, d1 = 0, d2 = 0, dv = 0, n_keys = 0;
  DType dtype = DType::f32;
  const void *k1 = nullptr, *k2 = nullptr, *v = nullptr;
  int64_t k1_key = 0, k1_head = 0, k2_key = 0, k2_head = 0, v_key = 0, v_head = 0;
  int64_t k_pos0 = 0, k_pos_stride = 1, k_pos_block = 1;
  Mask mask;
  float softcap = 0.f;  // > 0: scores become softcap * tanh(s / softcap) before the softmax
};

// The partials of `jobs` (one per batch entry, all of one shape) over `splits` key splits:
// o [jobs, splits, heads_kv * rows, dv] and lse [jobs, splits, heads_kv * rows], each normalised
// (an empty one: o = 0, lse = -inf). Merged in split order they give the attention over all keys.
// Parallel (OpenMP) over jobs x splits. decode_splits() is the split count used at this thread
// count.
int64_t decode_splits(int64_t jobs, int64_t n_keys);
void decode_partials(const DecodeJob* jobs, int64_t n_jobs, int64_t splits, float* o, float* lse,
                     DecodeIsa isa = decode_best_isa());

}  // namespace dattn::cpu
