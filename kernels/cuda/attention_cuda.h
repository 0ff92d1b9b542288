// The CUDA attention kernel's host interface: the same block of work as the CPU kernel
// (kernels/cpu/attention_cpu.h), on device pointers, merged into a running partial on the device.
// Host-only header: g++ and nvcc both include it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "src/dtype.h"
#include "src/spec.h"

namespace dattn::cuda {

// One block of work, with the fields and meaning of cpu::AttentionBlock (see there): tensors are
// bshd, contiguous, on the device:
//   q [batch, seq_q, heads_q, head_dim], k [batch, seq_k, heads_kv, head_dim],
//   v [batch, seq_k, heads_kv, head_dim_v], all bf16 or all fp16.
// Query row q_begin + i sits at global position q_pos0 + (i / q_pos_block) * q_pos_stride +
// i % q_pos_block, key rows likewise. The mask is given by value, as a kernel reads it:
// a query at position q sees a key at position k when k is in [q - left, q + right] (-1: no limit
// on that side) and, when cu_seqlens is given, both lie in the same document. cu_seqlens is a
// DEVICE array of num_docs + 1 increasing int64 boundaries (as Mask::document's), or null for one
// document. set_mask fills these four fields from a Mask.
struct AttentionBlock {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  DType dtype = DType::bf16;
  int64_t batch = 0, seq_q = 0, seq_k = 0;
  int64_t heads_q = 0, heads_kv = 0, head_dim = 0, head_dim_v = 0;
  int64_t q_begin = 0, q_len = -1, q_pos0 = 0, q_pos_stride = 1, q_pos_block = 1;
  int64_t k_begin = 0, k_len = -1, k_pos0 = 0, k_pos_stride = 1, k_pos_block = 1;
  float scale = 1.f;
  int64_t left = -1, right = -1;
  const int64_t* cu_seqlens = nullptr;  // device pointer, num_docs + 1 entries; null: none
  int64_t num_docs = 0;
};

// Copies mask's band into blk; with documents, blk.cu_seqlens = device_cu_seqlens, which must
// hold a device copy of *mask.documents (the caller uploads it once and keeps it alive while the
// kernel runs), and num_docs = documents->size() - 1. Throws dattn::Error naming cu_seqlens when
// the mask has documents and device_cu_seqlens is null.
void set_mask(AttentionBlock& blk, const Mask& mask, const int64_t* device_cu_seqlens = nullptr);

// Attends blk's query rows to its key rows on `stream` and merges the result into the running
// partial out [batch, seq_q, heads_q, head_dim_v] fp32 and lse [batch, heads_q, seq_q] fp32
// (device pointers; start from out = 0, lse = -inf). Exactly the CPU kernel's semantics: only
// the block's query rows change; key tiles the mask hides entirely are skipped; a row that sees
// no key leaves its partial unchanged; lse is never +inf. GQA: query head h reads kv head
// h / (heads_q / heads_kv); K and V are never expanded. head_dim and head_dim_v are at most 256
// (any value; the kernel pads to its instantiations). Asynchronous: returns after the launch.
// Every field is validated before anything is launched: a bad one throws dattn::Error naming it.
void attention_forward(const AttentionBlock& blk, float* out, float* lse, cudaStream_t stream);

// The padded (head_dim, head_dim_v) instantiation a problem runs on, e.g. "bf16 d128" or
// "fp16 d192 dv128" (reports and tests).
std::string kernel_variant(DType dtype, int64_t head_dim, int64_t head_dim_v);

}  // namespace dattn::cuda
