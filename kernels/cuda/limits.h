// What the CUDA kernels run, stated once: storage dtypes, head dims, grid limits, the decode
// kernel's query rows and the MLA decode kernel's per-rank columns. The kernels validate their
// arguments against these values, and the dispatch layer (src/dispatch.h) checks a call against
// them before any data moves. Host-only and CUDA-free: the host compiler includes it in every
// build.
#pragma once

#include <cstdint>
#include <string>

#include "src/base/dtype.h"
#include "src/base/error.h"

namespace dattn::cuda {

// The attention forward (attention_cuda.h): head_dim and head_dim_v up to the largest
// instantiation (smaller ones pad up to the next); batch and heads_q are the grid's z and y.
inline constexpr int64_t kMaxHeadDim = 256;
inline constexpr int64_t kMaxGridYZ = 65535;  // CUDA's limit on gridDim.y and gridDim.z
inline bool attention_dtype_supported(DType d) {
  return d == DType::bf16 || d == DType::f16;
}

// The split-KV decode (decode_cuda.h): at most this many query rows per block (each of its CTAs
// holds kDecodeRowsPerCta rows of query x head of a GQA group, fp32, in shared memory and
// registers); head dims as the forward's. The dispatch runs it for every block of 1 to
// kMaxDecodeQueryRows query rows (decode_kernel_fits), the forward for longer ones.
inline constexpr int64_t kMaxDecodeQueryRows = 16;
inline constexpr int64_t kDecodeRowsPerCta = 16;
inline bool decode_kernel_fits(int64_t q_len) {
  return q_len >= 1 && q_len <= kMaxDecodeQueryRows;
}

// The MLA decode (mla_decode_cuda.h): each lane of a warp holds latent / 32 columns in registers,
// the RoPE part of the query sits in shared memory, so does the absorption kernel's q_nope; batch
// and seq_q are the grid's z and y.
inline constexpr int64_t kMaxMlaLatent = 1024;
inline constexpr int64_t kMaxMlaRope = 512;
inline constexpr int64_t kMaxMlaQkNope = 8192;

// The attention forward's limits on a call's dtype, spec dims, batch and query heads.
inline void check_attention_limits(DType dtype, int64_t head_dim, int64_t head_dim_v, int64_t batch,
                                   int64_t heads_q) {
  DATTN_CHECK_ARG(attention_dtype_supported(dtype), "dtype", dtype_name(dtype),
                  "bf16 or fp16 on cuda tensors (the CUDA kernel's types)");
  DATTN_CHECK_ARG(
      head_dim <= kMaxHeadDim, "head_dim", head_dim,
      dattn::detail::cat("at most ", kMaxHeadDim, " on cuda tensors (the CUDA kernel's limit)"));
  DATTN_CHECK_ARG(
      head_dim_v <= kMaxHeadDim, "head_dim_v", head_dim_v,
      dattn::detail::cat("at most ", kMaxHeadDim, " on cuda tensors (the CUDA kernel's limit)"));
  DATTN_CHECK_ARG(
      batch <= kMaxGridYZ, "batch", batch,
      dattn::detail::cat("at most ", kMaxGridYZ, " on cuda tensors (the CUDA kernel's grid)"));
  DATTN_CHECK_ARG(
      heads_q <= kMaxGridYZ, "heads_q", heads_q,
      dattn::detail::cat("at most ", kMaxGridYZ, " on cuda tensors (the CUDA kernel's grid)"));
}

// The MLA decode's limits on one rank's slice: nlat latent and nrope RoPE columns, batch x seq_q
// queries, qk_nope; `documents`: whether the mask has documents (the kernel takes a band only).
inline void check_mla_limits(bool documents, const std::string& mask, int64_t nlat, int64_t nrope,
                             int64_t batch, int64_t seq_q, int64_t qk_nope) {
  DATTN_CHECK_ARG(!documents, "mask", mask,
                  "a band mask on cuda tensors (the CUDA MLA kernel has no documents)");
  DATTN_CHECK_ARG(
      nlat <= kMaxMlaLatent, "latent", nlat,
      dattn::detail::cat("at most ", kMaxMlaLatent,
                         " columns per rank on cuda tensors (the CUDA MLA kernel's limit)"));
  DATTN_CHECK_ARG(
      nrope <= kMaxMlaRope, "rope", nrope,
      dattn::detail::cat("at most ", kMaxMlaRope,
                         " columns per rank on cuda tensors (the CUDA MLA kernel's limit)"));
  DATTN_CHECK_ARG(batch <= kMaxGridYZ && seq_q <= kMaxGridYZ, "q_nope shape",
                  dattn::detail::cat("[", batch, ", ", seq_q, ", ...]"),
                  dattn::detail::cat("batch and S_q at most ", kMaxGridYZ, " on cuda tensors"));
  DATTN_CHECK_ARG(qk_nope <= kMaxMlaQkNope, "qk_nope", qk_nope,
                  dattn::detail::cat("at most ", kMaxMlaQkNope, " on cuda tensors"));
}

}  // namespace dattn::cuda
