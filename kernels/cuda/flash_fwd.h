// The parameters of the CUDA flash-attention forward kernel and the declaration of its launcher,
// one explicit instantiation per (dtype, padded head_dim, padded head_dim_v) in its own .cu file
// (flash_fwd_<dtype>_d<D>[_dv<Dv>].cu); attention_cuda.cu dispatches to them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/attention_cuda.h"

namespace dattn::cuda::detail {

// Everything the kernel reads, validated by attention_forward (attention_cuda.cu): the block of
// work as the caller gave it (AttentionBlock: tensors bshd and contiguous, rows, positions, the
// mask by value), with q_len/k_len resolved (never < 0) and cu_seqlens null without documents;
// head_dim / head_dim_v are the real sizes (<= the instantiation's padded sizes; the padding is
// zero-filled in shared memory and never written out); plus the output and the derived values.
struct FlashParams : AttentionBlock {
  float* out = nullptr;    // [batch, seq_q, heads_q, head_dim_v] fp32, merged into
  float* lse = nullptr;    // [batch, heads_q, seq_q] fp32, merged into
  float scale_log2 = 0.f;  // softmax scale * log2(e): scores go through exp2
  // With a softcap (blk.softcap > 0): a score s becomes softcap_log2 * tanh(s * softcap_in), the
  // capped scaled score in log2 units (softcap_in = scale / softcap, softcap_log2 = softcap *
  // log2(e)).
  float softcap_in = 0.f, softcap_log2 = 0.f;
  bool vec_loads = false;  // 16-byte cp.async loads allowed (dims % 8 == 0, 16-byte aligned)
};

// Validates every field of blk and the output pointers (dattn::Error naming the first bad one) and
// fills *p from them; false when there is nothing to attend (no batch, query or key rows), which
// leaves the partial unchanged. The forward and the decode kernel (decode_cuda.cu) share it.
bool flash_params(const AttentionBlock& blk, float* out, float* lse, FlashParams* p);

// Tile shapes: each warp owns 16 query rows (one MMA row block) for the whole pass, so the CTA's
// warps share every K/V tile and never exchange softmax state. D <= 128: 8 warps (128 query
// rows) and 64-key tiles, Q kept in registers; D > 128: 4 warps and 32-key tiles, Q re-read from
// shared memory (O alone takes Dv/2 registers per lane), which keeps shared memory under the
// 163 KiB an sm_80 block may use (not under sm_86/89's 99 KiB: attention_shared_bytes, checked
// against the device before a call runs). Shared rows are padded by 8 elements (16 bytes): the 8
// row addresses of every ldmatrix phase then fall in distinct banks for every padded D used here.
template <int kD>
struct FlashTiles {
  static constexpr int kWarps = kD <= 128 ? 8 : 4;
  static constexpr int kBlockM = 16 * kWarps;
  static constexpr int kBlockN = kD <= 128 ? 64 : 32;
};

// Q, two K and two V buffers; then 16 bytes for the mask of the V tile's non-finite rows, and
// each warp's P of those rows (16 x kBlockN fp32), for the kernel's slow path (flash_fwd.cuh).
// 134 KiB at most (D = 128): one CTA per SM, as the registers allow anyway.
template <int kD, int kDv>
constexpr size_t flash_smem_bytes() {
  using Tiles = FlashTiles<kD>;
  return size_t(Tiles::kBlockM * (kD + 8) + 2 * Tiles::kBlockN * (kD + 8) +
                2 * Tiles::kBlockN * (kDv + 8)) *
             sizeof(uint16_t) +
         16 + size_t(Tiles::kWarps * 16 * Tiles::kBlockN) * sizeof(float);
}

// Launches the forward for one (element type, padded D, padded Dv) instantiation.
// T is __nv_bfloat16 or __half (declared, not defined, here so that g++ can include this file).
template <typename T, int kD, int kDv>
void launch_flash_fwd(const FlashParams& p, cudaStream_t stream);

}  // namespace dattn::cuda::detail
