// The absorbed-MLA decode kernel, split-KV: the cache rows are split across enough CTAs to fill
// the GPU, each CTA streams its split once for a block of heads (a warp each, lanes over the
// latent), and a merge kernel combines the splits' states in a fixed order. Plain fp32 CUDA cores:
// decode is bound by the memory it reads, not by FLOPs. Around it, the small absorption (W_UK
// into the query) and projection (W_UV of z) kernels of mla_absorbed_decode.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include "kernels/cuda/launch.h"
#include "kernels/cuda/limits.h"
#include "kernels/cuda/mla_decode_cuda.h"
#include "src/base/cuda_check.h"
#include "src/base/error.h"

namespace dattn::cuda {

namespace {

constexpr int kWarps = 8;  // the decode kernel: a warp per head, kWarps heads per CTA
constexpr int kMaxLatentPerLane = int(kMaxMlaLatent / 32);  // a lane's latent columns, in registers
static_assert(kMaxLatentPerLane * 32 == kMaxMlaLatent, "the latent limit splits over 32 lanes");
constexpr int64_t kMaxLatent = kMaxMlaLatent;
constexpr int64_t kMaxRope = kMaxMlaRope;
constexpr int64_t kMinSplitRows = 64;   // cache rows a split gets at least
constexpr int64_t kSmemFloats = 12288;  // 48 KiB: what a kernel gets without an opt-in
constexpr int64_t kMaxTileRows = 16;

// The decode's shape on the device: splits of the cache rows, CTAs of kWarps heads, and the rows
// staged in shared memory at a time.
struct Split {
  int64_t splits = 1, split_len = 0, head_blocks = 1, tile = 1;
};

// One CTA per (split of the cache rows, block of kWarps heads, query, batch entry). The CTA stages
// its split's visible rows in shared memory, a tile at a time (each row read from memory once for
// all kWarps heads, coalesced); warp w runs the online softmax of head hb * kWarps + w over them,
// its lanes holding latent / 32 columns of the absorbed query and of z in registers. Writes the
// unnormalised state (z, max, sum) of each (row of q, split) for mla_merge_kernel.
__global__ void __launch_bounds__(kWarps * 32)
    mla_decode_kernel(const MlaDecodeBlock p, const Split sp, float* part_z, float* part_ml) {
  DATTN_DYNAMIC_SHARED(float, smem);
  const int64_t dc = p.latent, dr = p.rope, S = p.seq_kv;
  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int64_t split = blockIdx.x / sp.head_blocks, hb = blockIdx.x % sp.head_blocks;
  const int64_t s = blockIdx.y, b = blockIdx.z, h = hb * kWarps + warp;
  const bool active = h < p.heads;
  float* sqp = smem;              // [kWarps, dr] the warps' RoPE queries
  float* sc = sqp + kWarps * dr;  // [tile, dc] cache rows
  float* sk = sc + sp.tile * dc;  // [tile, dr] their RoPE keys
  const int64_t qrow = (b * p.seq_q + s) * p.heads + h;
  float qv[kMaxLatentPerLane], acc[kMaxLatentPerLane];
#pragma unroll
  for (int i = 0; i < kMaxLatentPerLane; ++i) {
    const int64_t c = lane + 32 * i;
    qv[i] = active && c < dc ? p.q_latent[qrow * dc + c] : 0.f;
    acc[i] = 0.f;
  }
  for (int64_t c = lane; c < dr; c += 32)
    sqp[warp * dr + c] = active ? p.q_pe[qrow * dr + c] : 0.f;

  // The visible rows [pos - left, pos + right] within [0, S), and of them this split's: the same
  // for every warp of the CTA, so that all of them meet at each barrier.
  const int64_t pos = p.q_pos0 + s;
  const int64_t j_lo = p.left < 0 ? 0 : max(int64_t(0), pos - p.left);
  const int64_t j_hi = p.right < 0 ? S - 1 : min(S - 1, pos + p.right);
  const int64_t first = max(j_lo, split * sp.split_len);
  const int64_t end = min(j_hi + 1, (split + 1) * sp.split_len);
  float m = -INFINITY, l = 0.f;
  for (int64_t t0 = first; t0 < end; t0 += sp.tile) {
    const int64_t nt = min(sp.tile, end - t0);
    __syncthreads();  // the previous tile is consumed (and, the first time, sqp is written)
    for (int64_t x = tid; x < nt * dc; x += kWarps * 32)
      sc[x] = p.c_kv[(b * S + t0) * dc + x];
    for (int64_t x = tid; x < nt * dr; x += kWarps * 32)
      sk[x] = p.k_pe[(b * S + t0) * dr + x];
    __syncthreads();
    if (!active) continue;
    for (int64_t r = 0; r < nt; ++r) {
      float cv[kMaxLatentPerLane], dot = 0.f;
#pragma unroll
      for (int i = 0; i < kMaxLatentPerLane; ++i) {
        const int64_t c = lane + 32 * i;
        cv[i] = c < dc ? sc[r * dc + c] : 0.f;
        dot += qv[i] * cv[i];
      }
      for (int64_t c = lane; c < dr; c += 32)
        dot += sqp[warp * dr + c] * sk[r * dr + c];
#pragma unroll
      for (int off = 16; off > 0; off /= 2)
        dot += __shfl_xor_sync(0xffffffffu, dot, off);
      const float score = p.scale * dot;
      const float m_new = fmaxf(m, score);
      const float alpha = expf(m - m_new);  // m = -inf (first row): 0
      const float pj = expf(score - m_new);
      l = l * alpha + pj;
#pragma unroll
      for (int i = 0; i < kMaxLatentPerLane; ++i)
        acc[i] = acc[i] * alpha + pj * cv[i];
      m = m_new;
    }
  }
  if (!active) return;
  const int64_t prow = qrow * sp.splits + split;
#pragma unroll
  for (int i = 0; i < kMaxLatentPerLane; ++i) {
    const int64_t c = lane + 32 * i;
    if (c < dc) part_z[prow * dc + c] = acc[i];
  }
  if (lane == 0) {
    part_ml[2 * prow] = m;
    part_ml[2 * prow + 1] = l;
  }
}

// The splits' states of one (head, query, batch) merged in split order (the log-sum-exp rule of
// kernels/merge.h; the same bits from run to run): z normalised, lse; no visible row: z = 0,
// lse = -inf.
__global__ void __launch_bounds__(kWarps * 32)
    mla_merge_kernel(const MlaDecodeBlock p, const Split sp, const float* part_z,
                     const float* part_ml, float* z, float* lse) {
  const int tid = int(threadIdx.x);
  const int64_t h = blockIdx.x, s = blockIdx.y, b = blockIdx.z, dc = p.latent;
  const int64_t qrow = (b * p.seq_q + s) * p.heads + h;
  const float* ml = part_ml + 2 * qrow * sp.splits;
  float mx = -INFINITY;
  for (int64_t k = 0; k < sp.splits; ++k)
    mx = fmaxf(mx, ml[2 * k]);
  float* zrow = z + qrow * dc;
  if (mx == -INFINITY) {
    for (int64_t c = tid; c < dc; c += kWarps * 32)
      zrow[c] = 0.f;
    if (tid == 0) lse[(b * p.heads + h) * p.seq_q + s] = -INFINITY;
    return;
  }
  float sum = 0.f;
  for (int64_t k = 0; k < sp.splits; ++k)
    sum += (ml[2 * k] == -INFINITY ? 0.f : expf(ml[2 * k] - mx)) * ml[2 * k + 1];
  const float inv = 1.f / sum;
  for (int64_t c = tid; c < dc; c += kWarps * 32) {
    float v = 0.f;
    for (int64_t k = 0; k < sp.splits; ++k)
      if (ml[2 * k] != -INFINITY)
        v += expf(ml[2 * k] - mx) * part_z[(qrow * sp.splits + k) * dc + c];
    zrow[c] = v * inv;
  }
  if (tid == 0) lse[(b * p.heads + h) * p.seq_q + s] = mx + logf(sum);
}

// Enough CTAs for about two per SM, each split at least kMinSplitRows rows; a tile as large as
// the shared memory holds beside the RoPE queries.
Split plan_split(const MlaDecodeBlock& blk) {
  Split sp;
  int device = 0, sms = 0;
  DATTN_CUDA_CHECK(cudaGetDevice(&device));
  DATTN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  sp.head_blocks = (blk.heads + kWarps - 1) / kWarps;
  const int64_t ctas = sp.head_blocks * blk.seq_q * blk.batch;
  const int64_t max_splits = std::max<int64_t>(1, (blk.seq_kv + kMinSplitRows - 1) / kMinSplitRows);
  sp.splits = std::clamp<int64_t>((2 * int64_t(sms) + ctas - 1) / ctas, 1, max_splits);
  sp.split_len = (blk.seq_kv + sp.splits - 1) / sp.splits;
  sp.tile = std::clamp<int64_t>((kSmemFloats - kWarps * blk.rope) / (blk.latent + blk.rope), 1,
                                kMaxTileRows);
  return sp;
}

constexpr int kThreads = 256;  // the absorption and projection kernels: 8 warps

// q~ [batch, seq_q, nh, nlat] = W_UK_h[:, lat0 ..]^T q_nope_h, and the slice's q_pe columns
// [batch, seq_q, nh, nrope]; one CTA per (head, query, batch). Thread c sums column c of W_UK_h
// over qk_nope: at each k the CTA reads a contiguous run of the row (coalesced).
__global__ void __launch_bounds__(kThreads)
    absorb_query_kernel(const MlaAbsorbedBlock p, float* q_lat, float* q_rope) {
  DATTN_DYNAMIC_SHARED(float, qn);  // [qk_nope] this head's q_nope
  const int tid = int(threadIdx.x);
  const int64_t i = blockIdx.x, s = blockIdx.y, b = blockIdx.z, h = p.h0 + i;
  const int64_t src = (b * p.seq_q + s) * p.heads_all + h;  // the row of q_nope and q_pe
  const int64_t dst = (b * p.seq_q + s) * p.nh + i;         // the row of q_lat and q_rope
  for (int64_t k = tid; k < p.qk_nope; k += kThreads)
    qn[k] = p.q_nope[src * p.qk_nope + k];
  __syncthreads();
  const float* w = p.w_uk + h * p.qk_nope * p.latent_all + p.lat0;
  for (int64_t c = tid; c < p.nlat; c += kThreads) {
    float acc = 0.f;
    for (int64_t k = 0; k < p.qk_nope; ++k)
      acc += w[k * p.latent_all + c] * qn[k];
    q_lat[dst * p.nlat + c] = acc;
  }
  for (int64_t r = tid; r < p.nrope; r += kThreads)
    q_rope[dst * p.nrope + r] = p.q_pe[src * p.rope_all + p.rope0 + r];
}

// out_h = W_UV_h[:, lat0 ..] z_h for one (head, query, batch): a warp per output column, its lanes
// over the latent, so that each row of W_UV is read coalesced; z in shared memory.
__global__ void __launch_bounds__(kThreads)
    apply_wuv_kernel(const MlaAbsorbedBlock p, const float* z, float* out, int64_t out_heads,
                     int64_t out_h0) {
  DATTN_DYNAMIC_SHARED(float, sz);  // [nlat]
  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int64_t i = blockIdx.x, s = blockIdx.y, b = blockIdx.z, h = p.h0 + i;
  const int64_t row = (b * p.seq_q + s) * p.nh + i;
  for (int64_t c = tid; c < p.nlat; c += kThreads)
    sz[c] = z[row * p.nlat + c];
  __syncthreads();
  float* o = out + ((b * p.seq_q + s) * out_heads + out_h0 + i) * p.v_head;
  for (int64_t c = warp; c < p.v_head; c += kThreads / 32) {
    const float* w = p.w_uv + (h * p.v_head + c) * p.latent_all + p.lat0;
    float acc = 0.f;
    for (int64_t k = lane; k < p.nlat; k += 32)
      acc += w[k] * sz[k];
#pragma unroll
    for (int off = 16; off > 0; off /= 2)
      acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) o[c] = acc;
  }
}

}  // namespace

void mla_absorbed_decode(const MlaAbsorbedBlock& p, float* out, int64_t out_heads, int64_t out_h0,
                         float* lse, cudaStream_t stream) {
  // Everything the three launches need, before any allocation (a throw must not leak scratch).
  DATTN_CHECK_ARG(p.batch >= 0 && p.batch <= kMaxGridYZ, "batch", p.batch,
                  dattn::detail::cat("0 to ", kMaxGridYZ));
  DATTN_CHECK_ARG(p.seq_q >= 0 && p.seq_q <= kMaxGridYZ, "seq_q", p.seq_q,
                  dattn::detail::cat("0 to ", kMaxGridYZ));
  DATTN_CHECK_ARG(p.seq_kv >= 0, "seq_kv", p.seq_kv, ">= 0");
  DATTN_CHECK_ARG(p.nh >= 0 && p.nh <= 0x7fffffff, "heads", p.nh, "0 to 2^31 - 1");
  DATTN_CHECK_ARG(p.h0 >= 0 && p.h0 + p.nh <= p.heads_all, "head slice",
                  dattn::detail::cat(p.h0, "+", p.nh),
                  dattn::detail::cat("within ", p.heads_all, " heads"));
  DATTN_CHECK_ARG(out_h0 >= 0 && out_h0 + p.nh <= out_heads, "out heads",
                  dattn::detail::cat(out_h0, "+", p.nh),
                  dattn::detail::cat("within ", out_heads, " heads"));
  DATTN_CHECK_ARG(
      p.qk_nope >= 1 && p.qk_nope <= kMaxMlaQkNope, "qk_nope", p.qk_nope,
      dattn::detail::cat("1 to ", kMaxMlaQkNope, " (the CUDA absorption kernel's shared memory)"));
  DATTN_CHECK_ARG(p.v_head >= 1, "v_head", p.v_head, ">= 1");
  DATTN_CHECK_ARG(p.nlat >= 1 && p.nlat <= kMaxLatent, "latent", p.nlat,
                  dattn::detail::cat("1 to ", kMaxLatent,
                                     " columns per rank (the CUDA MLA decode kernel's limit)"));
  DATTN_CHECK_ARG(p.lat0 >= 0 && p.lat0 + p.nlat <= p.latent_all, "latent slice",
                  dattn::detail::cat(p.lat0, "+", p.nlat),
                  dattn::detail::cat("within ", p.latent_all));
  DATTN_CHECK_ARG(p.nrope >= 0 && p.nrope <= kMaxRope, "rope", p.nrope,
                  dattn::detail::cat("0 to ", kMaxRope, " columns"));
  DATTN_CHECK_ARG(p.rope0 >= 0 && p.rope0 + p.nrope <= p.rope_all, "rope slice",
                  dattn::detail::cat(p.rope0, "+", p.nrope),
                  dattn::detail::cat("within ", p.rope_all));
  DATTN_CHECK_ARG(p.left >= -1 && p.right >= -1, "mask", dattn::detail::cat(p.left, "/", p.right),
                  "left and right >= 0 (or -1: unlimited)");
  DATTN_CHECK_ARG(p.q_pos0 >= 0, "q_pos0", p.q_pos0, ">= 0");
  DATTN_CHECK_ARG(std::isfinite(p.scale), "scale", p.scale, "a finite value");
  if (p.batch == 0 || p.seq_q == 0 || p.nh == 0) return;
  for (auto [ptr, name] : {std::pair{p.q_nope, "q_nope"},
                           {p.w_uk, "w_uk"},
                           {p.w_uv, "w_uv"},
                           {static_cast<const float*>(out), "out"}})
    DATTN_CHECK_ARG(ptr != nullptr, name, "null", "a device pointer");
  DATTN_CHECK_ARG(p.nrope == 0 || p.q_pe != nullptr, "q_pe", "null", "a device pointer");
  DATTN_CHECK_ARG(p.seq_kv == 0 || p.c_kv != nullptr, "c_kv", "null", "a device pointer");
  DATTN_CHECK_ARG(p.seq_kv == 0 || p.nrope == 0 || p.k_pe != nullptr, "k_pe", "null",
                  "a device pointer");

  // Scratch: q~ and z [rows, nlat], the q_pe columns [rows, nrope], and lse [rows] if the caller
  // wants none; stream-ordered, so nothing waits for the device here.
  const size_t rows = size_t(p.batch * p.seq_q * p.nh);
  const size_t floats = rows * size_t(2 * p.nlat + p.nrope) + (lse == nullptr ? rows : 0);
  float* ws = nullptr;
  DATTN_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&ws), floats * sizeof(float), stream));
  float* q_lat = ws;
  float* z = q_lat + rows * size_t(p.nlat);
  float* q_rope = z + rows * size_t(p.nlat);
  float* lse_out = lse != nullptr ? lse : q_rope + rows * size_t(p.nrope);

  const dim3 grid(unsigned(p.nh), unsigned(p.seq_q), unsigned(p.batch));
  DATTN_LAUNCH(absorb_query_kernel, grid, kThreads, size_t(p.qk_nope) * sizeof(float), stream, p,
               q_lat, q_rope);
  DATTN_CUDA_CHECK(cudaGetLastError());
  MlaDecodeBlock d;
  d.q_latent = q_lat;
  d.q_pe = q_rope;
  d.c_kv = p.c_kv;
  d.k_pe = p.k_pe;
  d.batch = p.batch;
  d.seq_q = p.seq_q;
  d.seq_kv = p.seq_kv;
  d.heads = p.nh;
  d.latent = p.nlat;
  d.rope = p.nrope;
  d.q_pos0 = p.q_pos0;
  d.scale = p.scale;
  d.left = p.left;
  d.right = p.right;
  mla_decode_forward(d, z, lse_out, stream);
  DATTN_LAUNCH(apply_wuv_kernel, grid, kThreads, size_t(p.nlat) * sizeof(float), stream, p, z, out,
               out_heads, out_h0);
  DATTN_CUDA_CHECK(cudaGetLastError());
  DATTN_CUDA_CHECK(cudaFreeAsync(ws, stream));
}

void mla_decode_forward(const MlaDecodeBlock& blk, float* z, float* lse, cudaStream_t stream) {
  DATTN_CHECK_ARG(blk.batch >= 0 && blk.batch <= kMaxGridYZ, "batch", blk.batch,
                  dattn::detail::cat("0 to ", kMaxGridYZ));
  DATTN_CHECK_ARG(blk.seq_q >= 0 && blk.seq_q <= kMaxGridYZ, "seq_q", blk.seq_q,
                  dattn::detail::cat("0 to ", kMaxGridYZ));
  DATTN_CHECK_ARG(blk.heads >= 0 && blk.heads <= 0x7fffffff, "heads", blk.heads, "0 to 2^31 - 1");
  DATTN_CHECK_ARG(blk.seq_kv >= 0, "seq_kv", blk.seq_kv, ">= 0");
  DATTN_CHECK_ARG(blk.latent >= 1 && blk.latent <= kMaxLatent, "latent", blk.latent,
                  dattn::detail::cat("1 to ", kMaxLatent, " (the CUDA MLA decode kernel's limit)"));
  DATTN_CHECK_ARG(blk.rope >= 0 && blk.rope <= kMaxRope, "rope", blk.rope,
                  dattn::detail::cat("0 to ", kMaxRope));
  DATTN_CHECK_ARG(blk.left >= -1, "left", blk.left, ">= 0 (or -1: unlimited)");
  DATTN_CHECK_ARG(blk.right >= -1, "right", blk.right, ">= 0 (or -1: unlimited)");
  DATTN_CHECK_ARG(blk.q_pos0 >= 0, "q_pos0", blk.q_pos0, ">= 0");
  DATTN_CHECK_ARG(std::isfinite(blk.scale), "scale", blk.scale, "a finite value");
  if (blk.batch == 0 || blk.seq_q == 0 || blk.heads == 0) return;
  DATTN_CHECK_ARG(blk.q_latent != nullptr, "q_latent", "null", "a device pointer");
  DATTN_CHECK_ARG(blk.rope == 0 || blk.q_pe != nullptr, "q_pe", "null", "a device pointer");
  DATTN_CHECK_ARG(blk.seq_kv == 0 || blk.c_kv != nullptr, "c_kv", "null", "a device pointer");
  DATTN_CHECK_ARG(blk.seq_kv == 0 || blk.rope == 0 || blk.k_pe != nullptr, "k_pe", "null",
                  "a device pointer");
  DATTN_CHECK_ARG(z != nullptr, "z", "null", "a device pointer");
  DATTN_CHECK_ARG(lse != nullptr, "lse", "null", "a device pointer");
  // Scratch: each (row of q, split)'s unnormalised z and its (max, sum); stream-ordered.
  const Split sp = plan_split(blk);
  const size_t parts = size_t(blk.batch * blk.seq_q * blk.heads * sp.splits);
  float* ws = nullptr;
  DATTN_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&ws),
                                   parts * size_t(blk.latent + 2) * sizeof(float), stream));
  float* part_z = ws;
  float* part_ml = ws + parts * size_t(blk.latent);
  // At most kWarps * 512 + tile * (latent + rope) <= kSmemFloats floats (plan_split's tile).
  const size_t smem = size_t(kWarps * blk.rope + sp.tile * (blk.latent + blk.rope)) * sizeof(float);
  const dim3 grid(unsigned(sp.splits * sp.head_blocks), unsigned(blk.seq_q), unsigned(blk.batch));
  DATTN_LAUNCH(mla_decode_kernel, grid, kWarps * 32, smem, stream, blk, sp, part_z, part_ml);
  DATTN_CUDA_CHECK(cudaGetLastError());
  const dim3 merge_grid(unsigned(blk.heads), unsigned(blk.seq_q), unsigned(blk.batch));
  DATTN_LAUNCH(mla_merge_kernel, merge_grid, kWarps * 32, 0, stream, blk, sp, part_z, part_ml, z,
               lse);
  DATTN_CUDA_CHECK(cudaGetLastError());
  DATTN_CUDA_CHECK(cudaFreeAsync(ws, stream));
}

}  // namespace dattn::cuda
