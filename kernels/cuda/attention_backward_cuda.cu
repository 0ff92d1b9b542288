// attention_backward and attention_backward_delta on CUDA. For each pair of an 8-query tile and an
// 8-key tile the mask does not hide, S = scale Q K^T and dP = dO V^T are recomputed (threads 0-63
// one score each, 64-127 one dP each), P = exp(S - lse) and dS = P (dP - delta) (through the
// softcap's derivative), then: the dK/dV kernel (one CTA per key tile, kv head, batch) adds
// dV += P^T dO and dK += scale dS^T Q over every query tile of the group's heads in order; the
// dQ kernel (one CTA per query tile, head, batch) adds dQ += scale dS K over the key tiles in
// order. Each thread owns fixed output elements, so the sums run in one order: deterministic.
#include "kernels/cuda/attention_backward_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/flash_fwd.cuh"
#include "kernels/cuda/limits.h"
#include "src/base/cuda_check.h"
#include "src/base/error.h"

namespace dattn::cuda {

namespace {

using detail::cover;
using detail::document_of;
using detail::FlashParams;
using detail::in_band;
using detail::kCoverNone;
using detail::row_position;

constexpr int kTile = 8;               // query rows and key rows of a tile
constexpr int kPairs = kTile * kTile;  // the (query, key) pairs of a tile pair
constexpr int kThreads = 2 * kPairs;   // a thread per score, a thread per dP
constexpr int kMaxAcc = kTile * int(kMaxHeadDim) / kThreads;  // accumulators per thread
static_assert(kTile * kMaxHeadDim % kThreads == 0);

// The validated block (FlashParams: rows resolved, the mask, the scale and softcap) and the
// backward's own arrays. lse is FlashParams::lse (read only here).
struct BwdParams : FlashParams {
  const void* dout = nullptr;
  DType dout_dtype = DType::f32;
  const float* delta = nullptr;
  float *dq = nullptr, *dk = nullptr, *dv = nullptr;
};

__device__ __forceinline__ float load(const void* base, DType dtype, int64_t i) {
  if (dtype == DType::f32) return static_cast<const float*>(base)[i];
  if (dtype == DType::f16) return __half2float(static_cast<const __half*>(base)[i]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
}

__device__ __forceinline__ bool visible(const FlashParams& p, int64_t q, int64_t k) {
  return in_band(p, q, k) && document_of(p, q) == document_of(p, k);
}

// Shared memory: Q and dO of a query tile, K and V of a key tile (fp32, rows beyond the block
// zero), P and dS of the pair, the query rows' lse and delta, the rows' positions.
struct Smem {
  float *q, *dout, *k, *v, *p, *ds, *lse, *delta;
  int64_t *qpos, *kpos;
};
size_t smem_bytes(int64_t d, int64_t dv) {
  return size_t(2 * kTile * (d + dv) + 2 * kPairs + 2 * kTile) * sizeof(float) +
         2 * kTile * sizeof(int64_t);
}
__device__ __forceinline__ Smem carve(float* base, int64_t d, int64_t dv) {
  Smem s;
  s.q = base;
  s.dout = s.q + kTile * d;
  s.k = s.dout + kTile * dv;
  s.v = s.k + kTile * d;
  s.p = s.v + kTile * dv;
  s.ds = s.p + kPairs;
  s.lse = s.ds + kPairs;
  s.delta = s.lse + kTile;
  // An even number of floats precede (2 kTile (d + dv) + 2 kPairs + 2 kTile): 8-byte aligned.
  s.qpos = reinterpret_cast<int64_t*>(s.delta + kTile);
  s.kpos = s.qpos + kTile;
  return s;
}

// Rows row0 .. row0 + n - 1 of head h of a [batch, seq, heads, dim] array into dst [kTile][dim]
// (zeros beyond n). Every thread takes a share; the caller synchronises.
__device__ __forceinline__ void load_rows(float* dst, const void* src, DType dtype, int64_t b,
                                          int64_t seq, int64_t heads, int64_t h, int64_t dim,
                                          int64_t row0, int64_t n) {
  for (int64_t e = threadIdx.x; e < kTile * dim; e += kThreads) {
    const int64_t r = e / dim, c = e % dim;
    dst[e] = r < n ? load(src, dtype, ((b * seq + row0 + r) * heads + h) * dim + c) : 0.f;
  }
}

// The query tile i0 (nq rows) of head h: Q, dO, positions, lse and delta.
__device__ __forceinline__ void load_query_tile(const BwdParams& p, const Smem& s, int64_t b,
                                                int64_t h, int64_t i0, int64_t nq) {
  const int64_t row0 = p.q_begin + i0;
  load_rows(s.q, p.q, p.dtype, b, p.seq_q, p.heads_q, h, p.head_dim, row0, nq);
  load_rows(s.dout, p.dout, p.dout_dtype, b, p.seq_q, p.heads_q, h, p.head_dim_v, row0, nq);
  const int t = threadIdx.x;
  if (t < kTile) {
    const int64_t at = (b * p.heads_q + h) * p.seq_q + row0 + t;  // into lse and delta
    s.lse[t] = t < nq ? p.lse[at] : -INFINITY;
    s.delta[t] = t < nq ? p.delta[at] : 0.f;
    s.qpos[t] = row_position(i0 + t, p.q_pos0, p.q_pos_stride, p.q_pos_block);
  }
}

// The key tile j0 (nk rows) of kv head hk: K, V and positions.
__device__ __forceinline__ void load_key_tile(const BwdParams& p, const Smem& s, int64_t b,
                                              int64_t hk, int64_t j0, int64_t nk) {
  const int64_t row0 = p.k_begin + j0;
  load_rows(s.k, p.k, p.dtype, b, p.seq_k, p.heads_kv, hk, p.head_dim, row0, nk);
  load_rows(s.v, p.v, p.dtype, b, p.seq_k, p.heads_kv, hk, p.head_dim_v, row0, nk);
  const int t = threadIdx.x;
  if (t < kTile) s.kpos[t] = row_position(j0 + t, p.k_pos0, p.k_pos_stride, p.k_pos_block);
}

// The positions of tile rows x0 .. x0 + n - 1 (n >= 1) span [lo, hi]: computed by every thread
// alike (from the parameters, not shared memory), so that a tile the mask hides is skipped by all.
__device__ __forceinline__ void tile_span(int64_t x0, int64_t n, int64_t pos0, int64_t stride,
                                          int64_t block, int64_t* lo, int64_t* hi) {
  *lo = *hi = row_position(x0, pos0, stride, block);
  for (int64_t i = 1; i < n; ++i) {
    const int64_t pos = row_position(x0 + i, pos0, stride, block);
    *lo = pos < *lo ? pos : *lo;
    *hi = pos > *hi ? pos : *hi;
  }
}

// P and dS [kTile][kTile] of the tiles in s (nq query rows, nk key rows): 0 for a pair beyond the
// tiles, hidden by the mask or of a row that saw no key (lse = -inf), so that the sums below skip
// it (P == 0) and never multiply what it hides. Ends synchronised.
__device__ __forceinline__ void tile_pairs(const BwdParams& p, const Smem& s, int64_t nq,
                                           int64_t nk) {
  const int t = threadIdx.x, pair = t % kPairs, r = pair / kTile, j = pair % kTile;
  float dot = 0.f;
  if (t < kPairs) {
    for (int64_t c = 0; c < p.head_dim; ++c)
      dot += s.q[r * p.head_dim + c] * s.k[j * p.head_dim + c];
  } else {
    for (int64_t c = 0; c < p.head_dim_v; ++c)
      dot += s.dout[r * p.head_dim_v + c] * s.v[j * p.head_dim_v + c];
    s.ds[pair] = dot;  // dP, until the score's thread reads it
  }
  __syncthreads();
  if (t < kPairs) {
    float pr = 0.f, ds = 0.f;
    const float l = s.lse[r];
    if (r < nq && j < nk && l != -INFINITY && visible(p, s.qpos[r], s.kpos[j])) {
      float score = dot * p.scale, slope = 1.f;
      if (p.softcap > 0.f) {  // the forward's cap * tanh(score / cap), and its derivative
        const float th = tanhf(score / p.softcap);
        score = p.softcap * th;
        slope = 1.f - th * th;
      }
      pr = expf(score - l);  // score <= lse up to rounding: no overflow
      ds = pr == 0.f ? 0.f : pr * (s.ds[pair] - s.delta[r]) * slope;
    }
    s.p[pair] = pr;
    s.ds[pair] = ds;
  }
  __syncthreads();
}

// (kThreads, 1): without the minimum of one CTA per SM, ptxas holds this kernel to 80 registers on
// sm_80 and spills a few bytes (a spill fails the build).
__global__ void __launch_bounds__(kThreads, 1) bwd_dkdv_kernel(const BwdParams p) {
  DATTN_DYNAMIC_SHARED(float, smem);
  const Smem s = carve(smem, p.head_dim, p.head_dim_v);
  const int D = int(p.head_dim), Dv = int(p.head_dim_v);  // <= kMaxHeadDim
  const int64_t b = blockIdx.z, hk = blockIdx.y, j0 = int64_t(blockIdx.x) * kTile;
  const int64_t nk = p.k_len - j0 < kTile ? p.k_len - j0 : kTile;
  int64_t k_lo, k_hi;
  tile_span(j0, nk, p.k_pos0, p.k_pos_stride, p.k_pos_block, &k_lo, &k_hi);
  load_key_tile(p, s, b, hk, j0, nk);
  float acc_k[kMaxAcc] = {}, acc_v[kMaxAcc] = {};
  const int64_t group = p.heads_q / p.heads_kv;
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    for (int64_t i0 = 0; i0 < p.q_len; i0 += kTile) {
      const int64_t nq = p.q_len - i0 < kTile ? p.q_len - i0 : kTile;
      int64_t q_lo, q_hi;
      tile_span(i0, nq, p.q_pos0, p.q_pos_stride, p.q_pos_block, &q_lo, &q_hi);
      if (cover(p, q_lo, q_hi, k_lo, k_hi) == kCoverNone) continue;  // the same for every thread
      load_query_tile(p, s, b, h, i0, nq);
      __syncthreads();
      tile_pairs(p, s, nq, nk);
#pragma unroll
      for (int a = 0; a < kMaxAcc; ++a) {
        const int e = int(threadIdx.x) + a * kThreads;  // dK element (j, c)
        if (e < kTile * D) {
          const int j = e / D, c = e % D;
          for (int r = 0; r < kTile; ++r)
            if (s.p[r * kTile + j] != 0.f)
              acc_k[a] += p.scale * s.ds[r * kTile + j] * s.q[r * D + c];
        }
      }
#pragma unroll
      for (int a = 0; a < kMaxAcc; ++a) {
        const int e = int(threadIdx.x) + a * kThreads;  // dV element (j, c)
        if (e < kTile * Dv) {
          const int j = e / Dv, c = e % Dv;
          for (int r = 0; r < kTile; ++r) {
            const float pr = s.p[r * kTile + j];
            if (pr != 0.f) acc_v[a] += pr * s.dout[r * Dv + c];
          }
        }
      }
      __syncthreads();  // before the next query tile replaces Q, dO, P and dS
    }
  }
  const int64_t row = b * p.seq_k + p.k_begin + j0;  // the tile's first key row
#pragma unroll
  for (int a = 0; a < kMaxAcc; ++a) {
    const int e = int(threadIdx.x) + a * kThreads;
    if (e < nk * D) p.dk[((row + e / D) * p.heads_kv + hk) * D + e % D] += acc_k[a];
    if (e < nk * Dv) p.dv[((row + e / Dv) * p.heads_kv + hk) * Dv + e % Dv] += acc_v[a];
  }
}

__global__ void __launch_bounds__(kThreads) bwd_dq_kernel(const BwdParams p) {
  DATTN_DYNAMIC_SHARED(float, smem);
  const Smem s = carve(smem, p.head_dim, p.head_dim_v);
  const int D = int(p.head_dim);  // <= kMaxHeadDim
  const int64_t b = blockIdx.z, h = blockIdx.y, i0 = int64_t(blockIdx.x) * kTile;
  const int64_t hk = h / (p.heads_q / p.heads_kv);
  const int64_t nq = p.q_len - i0 < kTile ? p.q_len - i0 : kTile;
  int64_t q_lo, q_hi;
  tile_span(i0, nq, p.q_pos0, p.q_pos_stride, p.q_pos_block, &q_lo, &q_hi);
  load_query_tile(p, s, b, h, i0, nq);
  float acc[kMaxAcc] = {};
  for (int64_t j0 = 0; j0 < p.k_len; j0 += kTile) {
    const int64_t nk = p.k_len - j0 < kTile ? p.k_len - j0 : kTile;
    int64_t k_lo, k_hi;
    tile_span(j0, nk, p.k_pos0, p.k_pos_stride, p.k_pos_block, &k_lo, &k_hi);
    if (cover(p, q_lo, q_hi, k_lo, k_hi) == kCoverNone) continue;  // the same for every thread
    load_key_tile(p, s, b, hk, j0, nk);
    __syncthreads();
    tile_pairs(p, s, nq, nk);
#pragma unroll
    for (int a = 0; a < kMaxAcc; ++a) {
      const int e = int(threadIdx.x) + a * kThreads;  // dQ element (r, c)
      if (e < kTile * D) {
        const int r = e / D, c = e % D;
        for (int j = 0; j < kTile; ++j)
          if (s.p[r * kTile + j] != 0.f) acc[a] += p.scale * s.ds[r * kTile + j] * s.k[j * D + c];
      }
    }
    __syncthreads();  // before the next key tile replaces K, V, P and dS
  }
#pragma unroll
  for (int a = 0; a < kMaxAcc; ++a) {
    const int64_t e = threadIdx.x + int64_t(a) * kThreads;
    if (e < nq * D)
      p.dq[((b * p.seq_q + p.q_begin + i0 + e / D) * p.heads_q + h) * D + e % D] += acc[a];
  }
}

__global__ void __launch_bounds__(kThreads)
    bwd_delta_kernel(const void* dout, DType dtype, const float* out, int64_t seq, int64_t heads,
                     int64_t dim_v, int64_t rows, float* delta) {
  const int64_t n = int64_t(blockIdx.x) * kThreads + threadIdx.x;  // (b, h, s) of delta
  if (n >= rows) return;
  const int64_t s = n % seq, h = n / seq % heads, b = n / seq / heads;
  const int64_t at = ((b * seq + s) * heads + h) * dim_v;
  double sum = 0;
  for (int64_t d = 0; d < dim_v; ++d)
    sum += double(load(dout, dtype, at + d)) * double(out[at + d]);
  delta[n] = float(sum);
}

bool dout_dtype_supported(DType t) {
  return t == DType::f32 || t == DType::bf16 || t == DType::f16;
}

}  // namespace

void attention_backward(const AttentionBlock& blk, const void* dout, DType dout_dtype,
                        const float* lse, const float* delta, float* dq, float* dk, float* dv,
                        cudaStream_t stream) {
  DATTN_CHECK_ARG(dout_dtype_supported(dout_dtype), "dout dtype", dtype_name(dout_dtype),
                  "fp32, bf16 or fp16");
  if (blk.batch > 0 && blk.q_rows() > 0 && blk.k_rows() > 0) {  // else nothing to add
    DATTN_CHECK_ARG(dout != nullptr, "dout", "null", "a device pointer");
    DATTN_CHECK_ARG(lse != nullptr, "lse", "null", "a device pointer");
    DATTN_CHECK_ARG(delta != nullptr, "delta", "null", "a device pointer");
    DATTN_CHECK_ARG(dq != nullptr, "dq", "null", "a device pointer");
    DATTN_CHECK_ARG(dk != nullptr, "dk", "null", "a device pointer");
    DATTN_CHECK_ARG(dv != nullptr, "dv", "null", "a device pointer");
  }
  BwdParams p;  // the forward's validation of the block (lse is read, never written, here)
  if (!detail::flash_params(blk, dq, const_cast<float*>(lse), &p)) return;
  DATTN_CHECK_ARG((p.q_len + kTile - 1) / kTile <= 0x7fffffff, "q_len", p.q_len,
                  "fewer than 2^31 tiles of 8 rows");
  DATTN_CHECK_ARG((p.k_len + kTile - 1) / kTile <= 0x7fffffff, "k_len", p.k_len,
                  "fewer than 2^31 tiles of 8 rows");
  p.dout = dout;
  p.dout_dtype = dout_dtype;
  p.delta = delta;
  p.dq = dq, p.dk = dk, p.dv = dv;
  const size_t smem = smem_bytes(p.head_dim, p.head_dim_v);  // under 48 KiB: no opt-in
  const dim3 kv_grid(unsigned((p.k_len + kTile - 1) / kTile), unsigned(p.heads_kv),
                     unsigned(p.batch));
  DATTN_LAUNCH(bwd_dkdv_kernel, kv_grid, kThreads, smem, stream, p);
  DATTN_CUDA_CHECK(cudaGetLastError());
  const dim3 q_grid(unsigned((p.q_len + kTile - 1) / kTile), unsigned(p.heads_q),
                    unsigned(p.batch));
  DATTN_LAUNCH(bwd_dq_kernel, q_grid, kThreads, smem, stream, p);
  DATTN_CUDA_CHECK(cudaGetLastError());
}

void attention_backward_delta(const void* dout, DType dtype, const float* out, int64_t batch,
                              int64_t seq, int64_t heads, int64_t head_dim_v, float* delta,
                              cudaStream_t stream) {
  DATTN_CHECK_ARG(dout_dtype_supported(dtype), "dout dtype", dtype_name(dtype),
                  "fp32, bf16 or fp16");
  DATTN_CHECK_ARG(batch >= 0, "batch", batch, ">= 0");
  DATTN_CHECK_ARG(seq >= 0, "seq", seq, ">= 0");
  DATTN_CHECK_ARG(heads >= 0, "heads", heads, ">= 0");
  DATTN_CHECK_ARG(head_dim_v >= 0, "head_dim_v", head_dim_v, ">= 0");
  const int64_t rows = batch * heads * seq;
  if (rows == 0) return;
  DATTN_CHECK_ARG(dout != nullptr, "dout", "null", "a device pointer");
  DATTN_CHECK_ARG(out != nullptr, "out", "null", "a device pointer");
  DATTN_CHECK_ARG(delta != nullptr, "delta", "null", "a device pointer");
  const int64_t blocks = (rows + kThreads - 1) / kThreads;
  DATTN_CHECK_ARG(blocks <= 0x7fffffff, "batch x heads x seq", rows, "fewer than 2^38 rows");
  DATTN_LAUNCH(bwd_delta_kernel, unsigned(blocks), kThreads, 0, stream, dout, dtype, out, seq,
               heads, head_dim_v, rows, delta);
  DATTN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dattn::cuda
