// The CUDA attention forward: a flash-attention-2 style kernel of our own (one CTA per query
// tile x head x batch, online softmax in fp32, tensor-core MMA, K/V tiles double-buffered in
// shared memory with cp.async). Included by the flash_fwd_*.cu instantiation files, and by
// decode_cuda.cu for the position, mask and load helpers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cuda/flash_fwd.h"
#include "kernels/cuda/launch.h"
#include "src/base/cuda_check.h"

namespace dattn::cuda::detail {

// ---------------------------------------------------------------- PTX wrappers
// Tensor cores through inline PTX mma.sync.m16n8k16 rather than nvcuda::wmma: wmma hides its
// fragment layout, and flash attention needs it (the S = Q K^T accumulator is reused, converted to
// 16 bits, as the A operand of O += P V without a trip through shared memory). The layouts used
// below are those of the PTX ISA ("Matrix Fragments for mma.m16n8k16"), with lane = 4 * g + t:
//   A (16x16, row): reg0 (g, 2t..2t+1), reg1 (g+8, 2t..), reg2 (g, 8+2t..), reg3 (g+8, 8+2t..)
//   B (16x8, col):  reg0 (k = 2t..2t+1, n = g), reg1 (k = 8+2t.., n = g)
//   C (16x8, f32):  c0, c1 (g, 2t..2t+1), c2, c3 (g+8, 2t..2t+1)
// In every 16-bit pair the lower index sits in the low half of the register.
// The CPU emulation (tests/emu/cuda_emulation.h) defines mma_16816, ldmatrix_x4[_trans] and the
// cp.async wrappers from these same definitions instead.
#ifndef DATTN_CUDA_EMULATION

template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

#endif  // DATTN_CUDA_EMULATION

// Two floats rounded (nearest even) into one register of two 16-bit values, lo in the low half.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t r;  // memcpy, not a pointer cast: the register's bits without breaking aliasing rules
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 h = __floats2half2_rn(lo, hi);
    memcpy(&r, &h, sizeof r);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    memcpy(&r, &h, sizeof r);
  }
  return r;
}

#ifndef DATTN_CUDA_EMULATION
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 16-bit matrices: lanes 8i..8i+7 give the row addresses of matrix i; register i of
// lane l receives matrix i's (row l/4, cols 2(l%4)..+1), or with .trans its (rows 2(l%4)..+1,
// col l/4), i.e. the fragment of the transposed matrix.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}

// 16 bytes global -> shared, asynchronously; src_bytes = 0 writes 16 zero bytes (and reads none).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}
#endif  // DATTN_CUDA_EMULATION

// A raw score q . k as the softmax takes it: scaled, capped (FlashParams::softcap_in), in log2
// units. A NaN stays NaN; masking replaces hidden scores after this.
__device__ __forceinline__ float log2_score(const FlashParams& p, float s) {
  return p.softcap > 0.f ? p.softcap_log2 * tanhf(s * p.softcap_in) : s * p.scale_log2;
}

// ---------------------------------------------------------------- positions and the mask
// The same rules as the CPU kernel (Mask::in_band, Mask::document_of, Mask::cover in
// src/base/spec.h).

__device__ __forceinline__ int64_t row_position(int64_t i, int64_t pos0, int64_t stride,
                                                int64_t block) {
  if (block == 1) return pos0 + i * stride;  // contiguous and striped runs: no 64-bit division
  return pos0 + (i / block) * stride + i % block;
}

// The document holding pos: (number of cu_seqlens entries <= pos) - 1, as upper_bound - 1; of
// equal entries (empty documents) that is the last, the document pos is in.
__device__ __forceinline__ int64_t document_of(const FlashParams& p, int64_t pos) {
  if (p.cu_seqlens == nullptr || p.num_docs <= 0) return 0;
  int64_t lo = 0, n = p.num_docs + 1;
  while (n > 0) {
    const int64_t half = n / 2;
    if (p.cu_seqlens[lo + half] <= pos) {
      lo += half + 1;
      n -= half + 1;
    } else {
      n = half;
    }
  }
  return lo - 1;
}

__device__ __forceinline__ bool in_band(const FlashParams& p, int64_t q, int64_t k) {
  return (p.left < 0 || q - k <= p.left) && (p.right < 0 || k - q <= p.right);
}

enum : int { kCoverNone = 0, kCoverSome = 1, kCoverAll = 2 };

__device__ __forceinline__ int cover(const FlashParams& p, int64_t q_lo, int64_t q_hi, int64_t k_lo,
                                     int64_t k_hi) {
  if (q_hi < q_lo || k_hi < k_lo) return kCoverNone;
  if (p.right >= 0 && k_lo - q_hi > p.right) return kCoverNone;
  if (p.left >= 0 && q_lo - k_hi > p.left) return kCoverNone;
  bool all = (p.right < 0 || k_hi - q_lo <= p.right) && (p.left < 0 || q_hi - k_lo <= p.left);
  if (p.cu_seqlens != nullptr && p.num_docs > 0) {
    const int64_t dq_lo = document_of(p, q_lo), dq_hi = document_of(p, q_hi);
    const int64_t dk_lo = document_of(p, k_lo), dk_hi = document_of(p, k_hi);
    if (dk_hi < dq_lo || dq_hi < dk_lo) return kCoverNone;
    all = all && dq_lo == dq_hi && dk_lo == dk_hi && dq_lo == dk_lo;
  }
  return all ? kCoverAll : kCoverSome;
}

// ---------------------------------------------------------------- tile loads
// kRows x kCols 16-bit values into shared memory (row stride ld), zero-filled outside
// rows_valid x cols_valid: the padding of a partial tile and of a padded head dim is exact zeros,
// so it adds nothing to a dot product. vec: 16-byte cp.async chunks (every chunk is wholly valid
// or wholly padding, as the real dims are multiples of 8); else plain 2-byte loads.
template <int kRows, int kCols, int kThreads>
__device__ __forceinline__ void load_tile(uint16_t* dst, int ld, const uint16_t* src,
                                          int64_t src_ld, int64_t rows_valid, int64_t cols_valid,
                                          bool vec, int tid) {
  constexpr int kChunksPerRow = kCols / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
  if (vec) {
    // A fixed trip count (every thread the same), so that the loop unrolls fully.
    constexpr int kIters = (kChunks + kThreads - 1) / kThreads;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int c = tid + it * kThreads;
      if (kChunks % kThreads != 0 && c >= kChunks) break;
      const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
      const bool ok = r < rows_valid && col < cols_valid;
      cp_async_16(dst + r * ld + col, ok ? src + r * src_ld + col : src, ok);
    }
  } else {
    for (int c = tid; c < kChunks; c += kThreads) {
      const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const bool ok = r < rows_valid && col + e < cols_valid;
        dst[r * ld + col + e] = ok ? src[r * src_ld + col + e] : uint16_t(0);
      }
    }
  }
}

// ---------------------------------------------------------------- the kernel
// Tile shapes and shared memory: FlashTiles and flash_smem_bytes (flash_fwd.h).

// ---------------------------------------------------------------- non-finite V rows
// In a partially visible tile a row's P is 0 for the keys its mask hides, and 0 * NaN = NaN: a
// NaN or inf in such a key's V row would reach rows that never see it. The CPU kernel rules that
// out (kernels/cpu: add_pv_sanitised), and so does this one, the same way: such V rows are zeroed
// in shared memory before O += P V, and their exact contribution p * v (v read again from global
// memory) is added afterwards to the rows whose p is not 0. Only partially visible tiles are
// scanned (in a wholly visible one every row sees every key, so a NaN is theirs), and the slow
// path runs only when a row is bad.

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  if constexpr (std::is_same_v<T, __half>)
    return __half2float(x);
  else
    return __bfloat162float(x);
}

// Sets bit r of *mask for every row r of the kRows x kCols tile (row stride ld) that holds a
// NaN or inf (all exponent bits set). Every thread scans its share; the caller synchronises.
template <typename T, int kRows, int kCols, int kThreads>
__device__ __forceinline__ void mark_non_finite_rows(const uint16_t* tile, int ld,
                                                     unsigned long long* mask, int tid) {
  constexpr uint16_t kExp = std::is_same_v<T, __half> ? 0x7c00 : 0x7f80;
  constexpr int kChunksPerRow = kCols / 8;
  for (int c = tid; c < kRows * kChunksPerRow; c += kThreads) {
    const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
    bool bad = false;
#pragma unroll
    for (int e = 0; e < 8; ++e)
      bad = bad || (tile[r * ld + col + e] & kExp) == kExp;
    if (bad) atomicOr(mask, 1ull << r);
  }
}

template <typename T, int kD, int kDv>
__global__ void __launch_bounds__(FlashTiles<kD>::kWarps * 32, 1)
    flash_fwd_kernel(const FlashParams p) {
  static_assert(kD % 32 == 0 && kDv % 32 == 0 && kD <= 256 && kDv <= 256, "padded dims");
  using Tiles = FlashTiles<kD>;
  constexpr int kWarps = Tiles::kWarps, kThreads = 32 * kWarps;
  constexpr int kBlockM = Tiles::kBlockM, kBlockN = Tiles::kBlockN;
  constexpr int kLdQK = kD + 8, kLdV = kDv + 8;  // shared row strides (elements)
  constexpr bool kQInRegs = kD <= 128;
  constexpr int kNT = kBlockN / 8;  // 8-column tiles of S per warp
  constexpr int kOT = kDv / 8;      // 8-column tiles of O per warp
  constexpr int kKS = kD / 16;      // 16-deep steps of Q K^T
  constexpr float kLn2 = 0.69314718055994531f;

  DATTN_DYNAMIC_SHARED(uint16_t, sQ);
  uint16_t* sK = sQ + kBlockM * kLdQK;      // two buffers of kBlockN x kLdQK
  uint16_t* sV = sK + 2 * kBlockN * kLdQK;  // two buffers of kBlockN x kLdV
  // The V tile's non-finite rows (one bit per key row: kBlockN <= 64), 16-byte aligned.
  unsigned long long* bad_rows = reinterpret_cast<unsigned long long*>(sV + 2 * kBlockN * kLdV);
  float* p_bad = reinterpret_cast<float*>(bad_rows + 2);  // [kWarps][16][kBlockN]
  static_assert(kBlockN <= 64, "one bit per key row of a tile");

  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int g = lane >> 2, tq = lane & 3;   // MMA group and thread-in-group
  const int mi = lane >> 3, mr = lane & 7;  // ldmatrix: this lane's matrix and row in it
  // The last query tiles first: under a causal mask they see the most keys, and starting them
  // first keeps the tail of the grid short.
  const int64_t qt = int64_t(gridDim.x) - 1 - int64_t(blockIdx.x);
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const int64_t hk = h / (p.heads_q / p.heads_kv);  // GQA: the kv head this query head reads
  const int64_t i0 = qt * kBlockM;                  // block row of the tile's first query
  const int64_t bq = min(int64_t(kBlockM), p.q_len - i0);
  const int64_t q_first = row_position(i0, p.q_pos0, p.q_pos_stride, p.q_pos_block);
  const int64_t q_last = row_position(i0 + bq - 1, p.q_pos0, p.q_pos_stride, p.q_pos_block);
  const int64_t q_lo = min(q_first, q_last), q_hi = max(q_first, q_last);
  const int64_t n_tiles = (p.k_len + kBlockN - 1) / kBlockN;

  // The first key tile at or after t that the mask does not hide entirely (n_tiles: none), and
  // how it is covered. Every thread computes the same, so the loop below is uniform.
  auto next_visible = [&](int64_t t, int* how) -> int64_t {
    for (; t < n_tiles; ++t) {
      const int64_t j0 = t * kBlockN, bk = min(int64_t(kBlockN), p.k_len - j0);
      const int64_t k_first = row_position(j0, p.k_pos0, p.k_pos_stride, p.k_pos_block);
      const int64_t k_last = row_position(j0 + bk - 1, p.k_pos0, p.k_pos_stride, p.k_pos_block);
      const int c = cover(p, q_lo, q_hi, min(k_first, k_last), max(k_first, k_last));
      if (c != kCoverNone) {
        *how = c;
        return t;
      }
    }
    return n_tiles;
  };

  int how = kCoverNone;
  int64_t t = next_visible(0, &how);
  if (t >= n_tiles) return;  // no key of the block is visible to this tile: partial unchanged

  const uint16_t* q_src = static_cast<const uint16_t*>(p.q) +
                          ((b * p.seq_q + p.q_begin + i0) * p.heads_q + h) * p.head_dim;
  const int64_t k_ld = p.heads_kv * p.head_dim, v_ld = p.heads_kv * p.head_dim_v;
  auto load_kv = [&](int64_t tile, int buf) {
    const int64_t row0 = b * p.seq_k + p.k_begin + tile * kBlockN;
    const int64_t rows = min(int64_t(kBlockN), p.k_len - tile * kBlockN);
    load_tile<kBlockN, kD, kThreads>(
        sK + buf * kBlockN * kLdQK, kLdQK,
        static_cast<const uint16_t*>(p.k) + (row0 * p.heads_kv + hk) * p.head_dim, k_ld, rows,
        p.head_dim, p.vec_loads, tid);
    load_tile<kBlockN, kDv, kThreads>(
        sV + buf * kBlockN * kLdV, kLdV,
        static_cast<const uint16_t*>(p.v) + (row0 * p.heads_kv + hk) * p.head_dim_v, v_ld, rows,
        p.head_dim_v, p.vec_loads, tid);
  };
  load_tile<kBlockM, kD, kThreads>(sQ, kLdQK, q_src, p.heads_q * p.head_dim, bq, p.head_dim,
                                   p.vec_loads, tid);
  load_kv(t, 0);
  cp_async_commit();

  // This lane's two query rows (g and g + 8 of the warp's 16): positions and documents.
  const int row0 = warp * 16 + g;
  int64_t qpos[2], qdoc[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    qpos[r] = row_position(i0 + row0 + 8 * r, p.q_pos0, p.q_pos_stride, p.q_pos_block);
    qdoc[r] = document_of(p, qpos[r]);
  }

  // Online-softmax state, in log2 units (scores are pre-multiplied by scale * log2 e): the row
  // max m, this lane's share of the row sum l (summed over the quad at the end), and O.
  float o[kOT][4];
#pragma unroll
  for (int i = 0; i < kOT; ++i)
    o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  [[maybe_unused]] uint32_t qf[kQInRegs ? kKS : 1][4];

  int buf = 0;
  [[maybe_unused]] bool first = true;
  while (t < n_tiles) {
    // Cleared for this tile: every thread read the last tile's mask before the trailing barrier.
    if (tid == 0) *bad_rows = 0;
    int next_how = kCoverNone;
    const int64_t tn = next_visible(t + 1, &next_how);
    // Prefetch the next visible tile into the other buffer (freed by the trailing barrier of
    // the previous iteration) while this one is computed.
    if (tn < n_tiles) {
      load_kv(tn, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if constexpr (kQInRegs) {
      if (first) {
#pragma unroll
        for (int ks = 0; ks < kKS; ++ks)
          ldmatrix_x4(qf[ks],
                      sQ + (warp * 16 + (mi & 1) * 8 + mr) * kLdQK + ks * 16 + (mi >> 1) * 8);
      }
    }
    first = false;
    const uint16_t* k_s = sK + buf * kBlockN * kLdQK;
    uint16_t* v_s = sV + buf * kBlockN * kLdV;
    // Partially visible tile: V rows holding NaN or inf are zeroed here (see above).
    unsigned long long bad = 0;
    if (how != kCoverAll) {
      mark_non_finite_rows<T, kBlockN, kDv, kThreads>(v_s, kLdV, bad_rows, tid);
      __syncthreads();
      bad = *bad_rows;  // the same in every thread: the branch below is uniform
      if (bad != 0) {
        for (int c = tid; c < kBlockN * (kDv / 8); c += kThreads) {
          const int r = c / (kDv / 8), col = (c % (kDv / 8)) * 8;
          if ((bad >> r) & 1)
#pragma unroll
            for (int e = 0; e < 8; ++e)
              v_s[r * kLdV + col + e] = 0;
        }
        __syncthreads();
      }
    }

    // S = Q K^T for the warp's 16 rows x kBlockN keys (fp32 accumulators).
    float s[kNT][4];
#pragma unroll
    for (int i = 0; i < kNT; ++i)
      s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < kKS; ++ks) {
      uint32_t a[4];
      if constexpr (kQInRegs) {
        a[0] = qf[ks][0];
        a[1] = qf[ks][1];
        a[2] = qf[ks][2];
        a[3] = qf[ks][3];
      } else {
        ldmatrix_x4(a, sQ + (warp * 16 + (mi & 1) * 8 + mr) * kLdQK + ks * 16 + (mi >> 1) * 8);
      }
#pragma unroll
      for (int np = 0; np < kBlockN / 16; ++np) {
        // Keys np*16 .. +15: matrices (keys +0, dims +0), (+0, +8), (+8, +0), (+8, +8) are the
        // B fragments (reg0, reg1) of key tiles 2np and 2np+1.
        uint32_t kb[4];
        ldmatrix_x4(kb, k_s + (np * 16 + (mi >> 1) * 8 + mr) * kLdQK + ks * 16 + (mi & 1) * 8);
        mma_16816<T>(s[2 * np], a, kb[0], kb[1]);
        mma_16816<T>(s[2 * np + 1], a, kb[2], kb[3]);
      }
    }
#pragma unroll
    for (int i = 0; i < kNT; ++i) {
      s[i][0] = log2_score(p, s[i][0]);
      s[i][1] = log2_score(p, s[i][1]);
      s[i][2] = log2_score(p, s[i][2]);
      s[i][3] = log2_score(p, s[i][3]);
    }

    // The mask, only where the tile is not wholly visible: partially covered tiles, and the last
    // tile's zero-filled key rows past k_len.
    const int64_t j0 = t * kBlockN;
    if (how != kCoverAll || j0 + kBlockN > p.k_len) {
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t j = j0 + nt * 8 + tq * 2 + e;
          const bool exists = j < p.k_len;
          const int64_t kp = row_position(j, p.k_pos0, p.k_pos_stride, p.k_pos_block);
          const int64_t kd = exists ? document_of(p, kp) : -1;
#pragma unroll
          for (int r = 0; r < 2; ++r)
            if (!(exists && in_band(p, qpos[r], kp) && kd == qdoc[r])) s[nt][2 * r + e] = -INFINITY;
        }
      }
    }

    // Online softmax: the new row max over the quad, rescale the state to it, P = exp2(S - m).
    // A row that has seen nothing yet keeps m = -inf; it is shifted by 0 instead (exp2(-inf) = 0
    // everywhere), never by -inf (-inf - -inf = NaN).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = m[r];
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
        mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float shift = mx == -INFINITY ? 0.f : mx;
      const float alpha = exp2f(m[r] - shift);
      m[r] = mx;
      l[r] *= alpha;
#pragma unroll
      for (int ot = 0; ot < kOT; ++ot) {
        o[ot][2 * r] *= alpha;
        o[ot][2 * r + 1] *= alpha;
      }
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        s[nt][2 * r] = exp2f(s[nt][2 * r] - shift);
        s[nt][2 * r + 1] = exp2f(s[nt][2 * r + 1] - shift);
        l[r] += s[nt][2 * r] + s[nt][2 * r + 1];
      }
    }

    if (bad != 0) {
      // The zeroed rows' own contributions, p * v, to this lane's rows g and g + 8 where p != 0.
      // Every lane puts its p of the bad keys in the warp's shared rows (register indices known
      // at compile time: a run-time index would put s in local memory for the whole kernel),
      // then adds p * v (v from global memory) to its own columns, one bad key at a time.
      float* p_w = p_bad + warp * 16 * kBlockN;  // this warp's 16 rows x kBlockN keys
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = nt * 8 + tq * 2 + e;
          if ((bad >> j) & 1) {
            p_w[g * kBlockN + j] = s[nt][e];
            p_w[(g + 8) * kBlockN + j] = s[nt][2 + e];
          }
        }
      __syncwarp();
      const T* v_glob = static_cast<const T*>(p.v) +
                        ((b * p.seq_k + p.k_begin + t * kBlockN) * p.heads_kv + hk) * p.head_dim_v;
      for (int j = 0; j < kBlockN; ++j) {
        if (!((bad >> j) & 1)) continue;
        const float p0 = p_w[g * kBlockN + j], p1 = p_w[(g + 8) * kBlockN + j];
        if (p0 == 0.f && p1 == 0.f) continue;
        const T* vrow = v_glob + int64_t(j) * p.heads_kv * p.head_dim_v;
#pragma unroll
        for (int ot = 0; ot < kOT; ++ot)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int col = ot * 8 + tq * 2 + c;
            if (col >= p.head_dim_v) continue;
            const float v = to_float(vrow[col]);
            if (p0 != 0.f) o[ot][c] += p0 * v;
            if (p1 != 0.f) o[ot][2 + c] += p1 * v;
          }
      }
    }

    // O += P V. The accumulators of key tiles 2kk and 2kk+1 are, element for element, the A
    // fragment of the 16 keys kk*16 .. +15 (see the layouts above). Hidden K rows cannot bring a
    // NaN (their scores are overwritten with -inf above), hidden non-finite V rows were zeroed
    // above, and rows past k_len are zero-filled.
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t a[4];
      a[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
      a[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
      a[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int np = 0; np < kDv / 16; ++np) {
        // Matrices (keys +0, cols +0), (+8, +0), (+0, +8), (+8, +8), transposed on load: the B
        // fragments (reg0, reg1) of output column tiles 2np and 2np+1.
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, v_s + (kk * 16 + (mi & 1) * 8 + mr) * kLdV + np * 16 + (mi >> 1) * 8);
        mma_16816<T>(o[2 * np], a, vb[0], vb[1]);
        mma_16816<T>(o[2 * np + 1], a, vb[2], vb[3]);
      }
    }
    __syncthreads();  // every warp is done with this buffer before it is refilled
    t = tn;
    how = next_how;
    buf ^= 1;
  }

  // Normalise and merge into the running partial (kernels/merge.h, merge_row). The quad's four
  // lanes hold a row's columns; all read the old lse before lane 0 of the quad writes the new.
  float lsum[2], lse_old[2];
  bool write[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = l[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    lsum[r] = sum;
    const int64_t i = i0 + row0 + 8 * r;
    write[r] = i < p.q_len && !(sum == 0.f);  // a row that saw no key: identity of the merge
    lse_old[r] = write[r] ? p.lse[(b * p.heads_q + h) * p.seq_q + p.q_begin + i] : 0.f;
  }
  __syncwarp();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!write[r]) continue;
    const int64_t i = p.q_begin + i0 + row0 + 8 * r;
    const float inv = 1.f / lsum[r];
    const float lse_b = m[r] * kLn2 + logf(lsum[r]);
    float* orow = p.out + ((b * p.seq_q + i) * p.heads_q + h) * p.head_dim_v;
    const bool replace = lse_old[r] == -INFINITY;  // empty running partial: take this one
    float ca = 0.f, cb = inv, lse_new = lse_b;
    if (!replace) {
      const float mx = fmaxf(lse_old[r], lse_b);
      const float wa = expf(lse_old[r] - mx), wb = expf(lse_b - mx);
      const float sum = wa + wb;
      ca = wa / sum;
      cb = wb / sum * inv;
      lse_new = mx + logf(sum);
    }
#pragma unroll
    for (int ot = 0; ot < kOT; ++ot) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = ot * 8 + tq * 2 + e;
        if (col < p.head_dim_v) {
          const float ob = o[ot][2 * r + e];
          orow[col] = replace ? cb * ob : ca * orow[col] + cb * ob;
        }
      }
    }
    if (tq == 0) p.lse[(b * p.heads_q + h) * p.seq_q + i] = lse_new;
  }
}

// ---------------------------------------------------------------- the launcher
template <typename T, int kD, int kDv>
void launch_flash_fwd(const FlashParams& p, cudaStream_t stream) {
  using Tiles = FlashTiles<kD>;
  constexpr size_t kSmem = flash_smem_bytes<kD, kDv>();
  auto kernel = flash_fwd_kernel<T, kD, kDv>;
  // Above 48 KiB of dynamic shared memory a kernel must opt in (per device; cheap to repeat).
  DATTN_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem)));
  const int64_t q_tiles = (p.q_len + Tiles::kBlockM - 1) / Tiles::kBlockM;
  const dim3 grid(unsigned(q_tiles), unsigned(p.heads_q), unsigned(p.batch));
  DATTN_LAUNCH(kernel, grid, Tiles::kWarps * 32, kSmem, stream, p);
  DATTN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dattn::cuda::detail
