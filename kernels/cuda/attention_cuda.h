// The CUDA attention kernel's host interface: the same block of work as the CPU kernel
// (kernels/cpu/attention_cpu.h), on device pointers, merged into a running partial on the device.
// Host-only header: g++ and nvcc both include it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/attention_block.h"
#include "src/base/dtype.h"
#include "src/base/spec.h"

namespace dattn::cuda {

// One block of work (kernels/attention_block.h), its tensors on the device, all bf16 or all
// fp16 (the default dtype here is bf16), and its mask by value, as a kernel reads it: a query at
// position q sees a key at position k when k is in [q - left, q + right] (-1: no limit on that
// side) and, when cu_seqlens is given, both lie in the same document. cu_seqlens is a DEVICE
// array of num_docs + 1 non-decreasing int64 boundaries (as Mask::document's), or null for one
// document. set_mask fills these four fields from a Mask.
struct AttentionBlock : BlockOfWork {
  AttentionBlock() { dtype = DType::bf16; }
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

// The dynamic shared memory per block the forward runs (head_dim, head_dim_v) with, and the
// split-KV decode kernel (decode_cuda.h), whatever the 16-bit dtype. Both are above 48 KiB for
// most dims: they opt in, up to the device's cudaDevAttrMaxSharedMemoryPerBlockOptin (227 KiB on
// sm_90, 163 KiB on sm_80, 99 KiB on sm_86/89).
size_t attention_shared_bytes(int64_t head_dim, int64_t head_dim_v);
size_t decode_shared_bytes(int64_t head_dim, int64_t head_dim_v);

// The padded (head_dim, head_dim_v) instantiation a problem runs on, e.g. "bf16 d128" or
// "fp16 d192 dv128" (reports and tests).
std::string kernel_variant(DType dtype, int64_t head_dim, int64_t head_dim_v);

}  // namespace dattn::cuda
