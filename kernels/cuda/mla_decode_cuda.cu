// The absorbed-MLA decode kernel: one CTA per (head, query, batch); each warp runs an online
// softmax over every 8th visible cache row (lanes split the latent, so cache rows are read
// coalesced), then the CTA merges its warps' states. Plain fp32 CUDA cores: decode reads the
// whole cache once per head and is bound by memory, not by FLOPs.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/check.h"
#include "kernels/cuda/mla_decode_cuda.h"
#include "src/error.h"

namespace dattn::cuda {

namespace {

constexpr int kWarps = 8;
constexpr int kMaxLatentPerLane = 32;  // latent <= 32 * 32 = 1024, held in registers
constexpr int64_t kMaxLatent = 32 * kMaxLatentPerLane;
constexpr int64_t kMaxRope = 512;

__global__ void __launch_bounds__(kWarps * 32)
    mla_decode_kernel(const MlaDecodeBlock p, float* z, float* lse) {
  extern __shared__ float smem[];
  const int64_t dc = p.latent, dr = p.rope, S = p.seq_kv;
  float* sq = smem;              // [dc] this head's absorbed query
  float* sqp = sq + dc;          // [dr] its RoPE query
  float* sz = sqp + dr;          // [kWarps, dc] the warps' unnormalised z
  float* sm = sz + kWarps * dc;  // [kWarps] their row max
  float* sl = sm + kWarps;       // [kWarps] their row sum
  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int64_t h = blockIdx.x, s = blockIdx.y, b = blockIdx.z;
  const int64_t qrow = (b * p.seq_q + s) * p.heads + h;
  for (int64_t c = tid; c < dc; c += kWarps * 32)
    sq[c] = p.q_latent[qrow * dc + c];
  for (int64_t c = tid; c < dr; c += kWarps * 32)
    sqp[c] = p.q_pe[qrow * dr + c];
  __syncthreads();

  // The visible cache rows: [pos - left, pos + right] within [0, S).
  const int64_t pos = p.q_pos0 + s;
  const int64_t j_lo = p.left < 0 ? 0 : max(int64_t(0), pos - p.left);
  const int64_t j_hi = p.right < 0 ? S - 1 : min(S - 1, pos + p.right);

  float m = -INFINITY, l = 0.f, acc[kMaxLatentPerLane];
#pragma unroll
  for (int i = 0; i < kMaxLatentPerLane; ++i)
    acc[i] = 0.f;
  for (int64_t j = j_lo + warp; j <= j_hi; j += kWarps) {
    const float* crow = p.c_kv + (b * S + j) * dc;
    const float* krow = p.k_pe + (b * S + j) * dr;
    float cv[kMaxLatentPerLane], dot = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxLatentPerLane; ++i) {
      const int64_t c = lane + 32 * i;
      cv[i] = c < dc ? crow[c] : 0.f;
      if (c < dc) dot += sq[c] * cv[i];
    }
    for (int64_t c = lane; c < dr; c += 32)
      dot += sqp[c] * krow[c];
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
#pragma unroll
  for (int i = 0; i < kMaxLatentPerLane; ++i) {
    const int64_t c = lane + 32 * i;
    if (c < dc) sz[warp * dc + c] = acc[i];
  }
  if (lane == 0) {
    sm[warp] = m;
    sl[warp] = l;
  }
  __syncthreads();

  // Merge the warps' states (the log-sum-exp rule of kernels/merge.h).
  float mx = -INFINITY;
  for (int w = 0; w < kWarps; ++w)
    mx = fmaxf(mx, sm[w]);
  float* zrow = z + qrow * dc;
  if (mx == -INFINITY) {  // no visible cache row: the empty partial
    for (int64_t c = tid; c < dc; c += kWarps * 32)
      zrow[c] = 0.f;
    if (tid == 0) lse[(b * p.heads + h) * p.seq_q + s] = -INFINITY;
    return;
  }
  float wts[kWarps], sum = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    wts[w] = sm[w] == -INFINITY ? 0.f : expf(sm[w] - mx);
    sum += wts[w] * sl[w];
  }
  const float inv = 1.f / sum;
  for (int64_t c = tid; c < dc; c += kWarps * 32) {
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w)
      v += wts[w] * sz[w * dc + c];
    zrow[c] = v * inv;
  }
  if (tid == 0) lse[(b * p.heads + h) * p.seq_q + s] = mx + logf(sum);
}

}  // namespace

void mla_decode_forward(const MlaDecodeBlock& blk, float* z, float* lse, cudaStream_t stream) {
  DATTN_CHECK_ARG(blk.batch >= 0 && blk.batch <= 65535, "batch", blk.batch, "0 to 65535");
  DATTN_CHECK_ARG(blk.seq_q >= 0 && blk.seq_q <= 65535, "seq_q", blk.seq_q, "0 to 65535");
  DATTN_CHECK_ARG(blk.heads >= 0 && blk.heads <= 0x7fffffff, "heads", blk.heads, "0 to 2^31 - 1");
  DATTN_CHECK_ARG(blk.seq_kv >= 0, "seq_kv", blk.seq_kv, ">= 0");
  DATTN_CHECK_ARG(blk.latent >= 1 && blk.latent <= kMaxLatent, "latent", blk.latent,
                  "1 to 1024 (the CUDA MLA decode kernel's limit)");
  DATTN_CHECK_ARG(blk.rope >= 0 && blk.rope <= kMaxRope, "rope", blk.rope, "0 to 512");
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
  // At most (1024 * 9 + 512 + 16) floats = 39 KiB: under the 48 KiB that needs no opt-in.
  const size_t smem = size_t(blk.latent * (1 + kWarps) + blk.rope + 2 * kWarps) * sizeof(float);
  const dim3 grid(unsigned(blk.heads), unsigned(blk.seq_q), unsigned(blk.batch));
  mla_decode_kernel<<<grid, kWarps * 32, smem, stream>>>(blk, z, lse);
  DATTN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dattn::cuda
