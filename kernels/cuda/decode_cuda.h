// The CUDA split-KV decode kernel's host interface: attention_forward's block of work and
// semantics (attention_cuda.h) for blocks of few query rows, the case of a decode step and of star
// attention's phase 2. Host-only header: g++ and nvcc both include it.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/cuda/attention_cuda.h"
#include "kernels/cuda/limits.h"

namespace dattn::cuda {

// Attends blk's query rows (at most kMaxDecodeQueryRows, kernels/cuda/limits.h) to its key rows
// on `stream` and merges the result into the running partial out / lse, with exactly
// attention_forward's semantics and validation (the same fields, named the same way, plus q_len
// against the limit above): only the block's query rows change, a row that sees no key keeps its
// partial, lse is never +inf, GQA reads kv head h / (heads_q / heads_kv) without expanding K/V, a
// NaN or inf in a K or V row reaches exactly the rows whose mask shows it.
//
// Flash-decoding: the key rows the band can show are split into chunks sized to fill the GPU
// (about four CTAs per multiprocessor, at least 256 keys each); the CTA of (chunk, kv head,
// batch) streams its chunk once (16-byte cp.async where the head dims are multiples of 8 and the
// tensors 16-byte aligned, element loads otherwise) for every query row and every query head of
// its GQA group, up to kDecodeRowsPerCta such rows (more: one CTA per kDecodeRowsPerCta of them),
// with fp32 scores and accumulation and an online softmax, skipping tiles the mask hides. Each
// writes one partial per row to scratch allocated on `stream` (cudaMallocAsync); a second kernel
// merges each row's partials in chunk order (the same bits on every run) into out / lse.
// Asynchronous: returns after the launches.
void decode_forward(const AttentionBlock& blk, float* out, float* lse, cudaStream_t stream);

}  // namespace dattn::cuda
