// attention_forward on CUDA: validates the block on the host, then dispatches at compile time
// over (dtype, padded head_dim, padded head_dim_v) to one of the flash_fwd_*.cu instantiations.
// Nothing is launched unless every field is valid.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "kernels/cuda/attention_cuda.h"
#include "kernels/cuda/flash_fwd.h"
#include "kernels/cuda/limits.h"
#include "src/base/cuda_check.h"
#include "src/base/error.h"

namespace dattn::cuda {

namespace {

// The instantiated padded dims. A head_dim between two of them runs on the next one up with
// zero-filled padding (exact: zeros add nothing to a dot product and are never written out).
// 160 and 224 are left out to keep the build short: they pad to 192 and 256.
int64_t padded_dim(int64_t d) {
  static_assert(kMaxHeadDim == 256, "the largest instantiation below is kMaxHeadDim");
  for (int64_t p : {32, 64, 96, 128, 192, 256})
    if (d <= p) return p;
  return 0;
}

struct Variant {
  int d = 0, dv = 0;
};

// Square instantiations for D == Dv (and for D != Dv, padded to the larger of the two), plus
// (192, 128) for MLA prefill (qk_nope + rope = 192, v_head = 128), which would otherwise pay for
// 64 padded V columns.
Variant pick_variant(int64_t head_dim, int64_t head_dim_v) {
  const int64_t pd = padded_dim(head_dim), pv = padded_dim(head_dim_v);
  if (pd == 192 && pv <= 128) return {192, 128};
  const int64_t p = pd > pv ? pd : pv;
  return {int(p), int(p)};
}

template <typename T>
void dispatch(const detail::FlashParams& p, Variant v, cudaStream_t stream) {
  using detail::launch_flash_fwd;
  if (v.d == 192 && v.dv == 128) return launch_flash_fwd<T, 192, 128>(p, stream);
  switch (v.d) {
    case 32:
      return launch_flash_fwd<T, 32, 32>(p, stream);
    case 64:
      return launch_flash_fwd<T, 64, 64>(p, stream);
    case 96:
      return launch_flash_fwd<T, 96, 96>(p, stream);
    case 128:
      return launch_flash_fwd<T, 128, 128>(p, stream);
    case 192:
      return launch_flash_fwd<T, 192, 192>(p, stream);
    case 256:
      return launch_flash_fwd<T, 256, 256>(p, stream);
    default:
      DATTN_THROW_KIND(ErrorKind::internal,
                       "internal error: no CUDA attention instantiation for head_dim ", v.d);
  }
}

bool aligned16(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
}

}  // namespace

void set_mask(AttentionBlock& blk, const Mask& mask, const int64_t* device_cu_seqlens) {
  blk.left = mask.left;
  blk.right = mask.right;
  if (mask.documents) {
    DATTN_CHECK_ARG(device_cu_seqlens != nullptr, "cu_seqlens", "null",
                    "a device copy of the mask's document boundaries");
    DATTN_CHECK_ARG(!mask.documents->empty(), "cu_seqlens", "empty", ">= 1 boundary");
    blk.cu_seqlens = device_cu_seqlens;
    blk.num_docs = int64_t(mask.documents->size()) - 1;
  } else {
    blk.cu_seqlens = nullptr;
    blk.num_docs = 0;
  }
}

size_t attention_shared_bytes(int64_t head_dim, int64_t head_dim_v) {
  using detail::flash_smem_bytes;
  const Variant v = pick_variant(head_dim, head_dim_v);
  if (v.d == 192 && v.dv == 128) return flash_smem_bytes<192, 128>();
  switch (v.d) {
    case 32:
      return flash_smem_bytes<32, 32>();
    case 64:
      return flash_smem_bytes<64, 64>();
    case 96:
      return flash_smem_bytes<96, 96>();
    case 128:
      return flash_smem_bytes<128, 128>();
    case 192:
      return flash_smem_bytes<192, 192>();
    default:
      return flash_smem_bytes<256, 256>();
  }
}

std::string kernel_variant(DType dtype, int64_t head_dim, int64_t head_dim_v) {
  const Variant v = pick_variant(head_dim, head_dim_v);
  std::string s = dattn::detail::cat(dtype == DType::f16 ? "fp16" : "bf16", " d", v.d);
  if (v.dv != v.d) s += dattn::detail::cat(" dv", v.dv);
  return s;
}

bool detail::flash_params(const AttentionBlock& blk, float* out, float* lse, FlashParams* p) {
  DATTN_CHECK_ARG(attention_dtype_supported(blk.dtype), "dtype", dtype_name(blk.dtype),
                  "bf16 or fp16 (the CUDA kernel's storage types)");
  DATTN_CHECK_ARG(blk.batch >= 0 && blk.batch <= kMaxGridYZ, "batch", blk.batch,
                  dattn::detail::cat("0 to ", kMaxGridYZ));
  DATTN_CHECK_ARG(blk.heads_kv > 0, "heads_kv", blk.heads_kv, "> 0");
  DATTN_CHECK_ARG(blk.heads_q > 0 && blk.heads_q <= kMaxGridYZ, "heads_q", blk.heads_q,
                  dattn::detail::cat("1 to ", kMaxGridYZ));
  DATTN_CHECK_ARG(blk.heads_q % blk.heads_kv == 0, "heads_q", blk.heads_q,
                  dattn::detail::cat("a multiple of heads_kv (", blk.heads_kv, ")"));
  DATTN_CHECK_ARG(blk.head_dim > 0 && blk.head_dim <= kMaxHeadDim, "head_dim", blk.head_dim,
                  dattn::detail::cat("1 to ", kMaxHeadDim, " (the CUDA kernel's limit)"));
  DATTN_CHECK_ARG(blk.head_dim_v > 0 && blk.head_dim_v <= kMaxHeadDim, "head_dim_v", blk.head_dim_v,
                  dattn::detail::cat("1 to ", kMaxHeadDim, " (the CUDA kernel's limit)"));
  DATTN_CHECK_ARG(blk.seq_q >= 0, "seq_q", blk.seq_q, ">= 0");
  DATTN_CHECK_ARG(blk.seq_k >= 0, "seq_k", blk.seq_k, ">= 0");
  DATTN_CHECK_ARG(blk.q_begin >= 0 && blk.q_begin <= blk.seq_q, "q_begin", blk.q_begin,
                  dattn::detail::cat("0 to seq_q (", blk.seq_q, ")"));
  DATTN_CHECK_ARG(blk.k_begin >= 0 && blk.k_begin <= blk.seq_k, "k_begin", blk.k_begin,
                  dattn::detail::cat("0 to seq_k (", blk.seq_k, ")"));
  const int64_t q_len = blk.q_len < 0 ? blk.seq_q - blk.q_begin : blk.q_len;
  const int64_t k_len = blk.k_len < 0 ? blk.seq_k - blk.k_begin : blk.k_len;
  DATTN_CHECK_ARG(blk.q_begin + q_len <= blk.seq_q, "q_len", blk.q_len,
                  dattn::detail::cat("at most seq_q - q_begin (", blk.seq_q - blk.q_begin, ")"));
  DATTN_CHECK_ARG(blk.k_begin + k_len <= blk.seq_k, "k_len", blk.k_len,
                  dattn::detail::cat("at most seq_k - k_begin (", blk.seq_k - blk.k_begin, ")"));
  DATTN_CHECK_ARG(blk.q_pos_block >= 1, "q_pos_block", blk.q_pos_block, ">= 1");
  DATTN_CHECK_ARG(blk.k_pos_block >= 1, "k_pos_block", blk.k_pos_block, ">= 1");
  DATTN_CHECK_ARG(blk.q_pos_stride >= 0, "q_pos_stride", blk.q_pos_stride, ">= 0");
  DATTN_CHECK_ARG(blk.k_pos_stride >= 0, "k_pos_stride", blk.k_pos_stride, ">= 0");
  DATTN_CHECK_ARG(blk.left >= -1, "left", blk.left, ">= 0 (or -1: unlimited)");
  DATTN_CHECK_ARG(blk.right >= -1, "right", blk.right, ">= 0 (or -1: unlimited)");
  DATTN_CHECK_ARG(blk.num_docs >= 0, "num_docs", blk.num_docs, ">= 0");
  DATTN_CHECK_ARG(
      blk.num_docs == 0 || blk.cu_seqlens != nullptr, "cu_seqlens", "null",
      dattn::detail::cat("a device array of num_docs + 1 (", blk.num_docs + 1, ") entries"));
  DATTN_CHECK_ARG(std::isfinite(blk.scale), "scale", blk.scale, "a finite value");
  if (blk.batch == 0 || q_len <= 0 || k_len <= 0) return false;  // nothing to attend: unchanged
  DATTN_CHECK_ARG(blk.q != nullptr, "q", "null", "a device pointer");
  DATTN_CHECK_ARG(blk.k != nullptr, "k", "null", "a device pointer");
  DATTN_CHECK_ARG(blk.v != nullptr, "v", "null", "a device pointer");
  DATTN_CHECK_ARG(out != nullptr, "out", "null", "a device pointer");
  DATTN_CHECK_ARG(lse != nullptr, "lse", "null", "a device pointer");
  static_cast<AttentionBlock&>(*p) = blk;
  p->q_len = q_len;
  p->k_len = k_len;
  p->cu_seqlens = blk.num_docs > 0 ? blk.cu_seqlens : nullptr;
  p->out = out;
  p->lse = lse;
  p->scale_log2 = float(double(blk.scale) * 1.4426950408889634);  // exp(x) = exp2(x log2 e)
  DATTN_CHECK_ARG(std::isfinite(blk.softcap) && blk.softcap >= 0.f, "softcap", blk.softcap,
                  "0 (off) or a finite positive cap");
  if (blk.softcap > 0.f) {
    p->softcap_in = float(double(blk.scale) / double(blk.softcap));
    p->softcap_log2 = float(double(blk.softcap) * 1.4426950408889634);
  }
  // 16-byte cp.async needs every row start 16-byte aligned: dims multiples of 8 elements and
  // aligned bases (cudaMalloc's are). Otherwise the kernel loads element by element.
  p->vec_loads = blk.head_dim % 8 == 0 && blk.head_dim_v % 8 == 0 && aligned16(blk.q) &&
                 aligned16(blk.k) && aligned16(blk.v);
  return true;
}

void attention_forward(const AttentionBlock& blk, float* out, float* lse, cudaStream_t stream) {
  detail::FlashParams p;  // validated first: nothing is launched unless every field is valid
  if (!detail::flash_params(blk, out, lse, &p)) return;
  const int64_t q_tiles = (p.q_len + 63) / 64;  // the smaller CTA tile (64 rows, D > 128)
  DATTN_CHECK_ARG(q_tiles <= 0x7fffffff, "q_len", p.q_len, "fewer than 2^31 query tiles");
  const Variant v = pick_variant(blk.head_dim, blk.head_dim_v);
  if (blk.dtype == DType::bf16)
    dispatch<__nv_bfloat16>(p, v, stream);
  else
    dispatch<__half>(p, v, stream);
}

}  // namespace dattn::cuda
