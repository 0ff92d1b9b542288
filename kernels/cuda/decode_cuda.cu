// decode_forward on CUDA: the split-KV (flash-decoding) kernel, one CTA per (key split, kv head,
// batch) streaming its keys once for all query rows and GQA heads on fp32 CUDA cores, and the
// kernel that merges the splits' partials in a fixed order into the running partial.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>

#include "kernels/cuda/decode_cuda.h"
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
using detail::kCoverAll;
using detail::kCoverNone;
using detail::row_position;

// ---------------------------------------------------------------- shapes
// 4 warps. Scores: lane j takes key j of a 32-key tile, warp w the rows w, w + 4, ..; values:
// thread t adds 8 columns (t % (Dv/8)) of the rows t / (Dv/8) + k ceil(rows / 4), up to 4 rows,
// so that a V chunk read from shared memory and widened serves as many rows as it can (the
// widening costs as much as the FMAs of one row).
constexpr int kThreads = 128, kWarps = kThreads / 32;
constexpr int kTileKeys = 32;
constexpr int kRows = int(kDecodeRowsPerCta);
constexpr int kRowsPerWarp = kRows / kWarps;
constexpr int kMaxRowsPerThread = kRows / (kThreads / int(kMaxHeadDim / 8));
constexpr int kLdP = kTileKeys + 1;  // P's rows padded: reads of different rows hit distinct banks
static_assert(kRowsPerWarp * kWarps == kRows &&
                  kMaxRowsPerThread * (kThreads / int(kMaxHeadDim / 8)) >= kRows,
              "every row has its threads in both phases");
// The split size: about kCtasPerSm CTAs per multiprocessor in all, each split at least
// kMinSplitKeys keys (each split's partial is written, read back and merged once per row).
constexpr int kCtasPerSm = 4;  // also the registers' bound: 4 CTAs fit on a multiprocessor
constexpr int64_t kMinSplitKeys = 256;
constexpr float kLn2 = 0.69314718055994531f;

// Everything the two kernels read: the validated block (FlashParams) and the split.
struct DecodeParams : FlashParams {
  float* part_o = nullptr;    // [splits, batch, heads_kv, rows, head_dim_v] the splits' partials
  float* part_lse = nullptr;  // [splits, batch, heads_kv, rows]; -inf: the split saw no key
  int64_t group = 1;          // heads_q / heads_kv
  int64_t rows = 0;        // q_len * group: row r is query r / group, head r % group of the group
  int64_t row_chunks = 1;  // CTAs per split: kRows rows each
  int64_t splits = 1;
  int64_t key_lo = 0, key_hi = 0;  // the key rows the band can show (block rows after k_begin)
  int64_t split_keys = 0;          // keys per split, a multiple of kTileKeys
  int64_t q_lo = 0, q_hi = 0;      // the lowest and highest query position
  int dp = 0, dvp = 0;             // head_dim and head_dim_v rounded up to 8
};

// Shared memory: the rows' positions and documents, the tile's rescale factors and P, the rows'
// queries (fp32), two K and two V tiles (16-bit, rows padded by 16 bytes: the 8 rows of a quarter
// warp's 16-byte reads fall in distinct banks). Every part starts 16-byte aligned.
size_t smem_bytes(int dp, int dvp) {
  return size_t(2 * kRows) * sizeof(int64_t) + size_t(kRows + kRows * kLdP) * sizeof(float) +
         size_t(kRows * dp) * sizeof(float) +
         size_t(2 * kTileKeys * (dp + 8 + dvp + 8)) * sizeof(uint16_t);
}

// ---------------------------------------------------------------- loads
// The 16-bit value in half `half` of reg, widened to fp32.
template <typename T>
__device__ __forceinline__ float widen(uint32_t reg, int half) {
#ifdef DATTN_CUDA_EMULATION
  return detail::emu_value<T>(reg, half);
#else
  const uint16_t bits = uint16_t(reg >> (16 * half));
  if constexpr (std::is_same_v<T, __half>)
    return __half2float(__ushort_as_half(bits));
  else
    return __uint_as_float(uint32_t(bits) << 16);
#endif
}

// 8 16-bit values (16 bytes of shared memory, one load) widened to fp32.
template <typename T>
__device__ __forceinline__ void widen8(const uint16_t* src, float (&f)[8]) {
  uint32_t w[4];
#ifdef DATTN_CUDA_EMULATION
  std::memcpy(w, src, 16);
#else
  const uint4 u = *reinterpret_cast<const uint4*>(src);
  w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w;
#endif
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = widen<T>(w[i], 0);
    f[2 * i + 1] = widen<T>(w[i], 1);
  }
}

// 8 floats of shared memory (two 16-byte loads).
__device__ __forceinline__ void load8(const float* src, float (&f)[8]) {
#ifdef DATTN_CUDA_EMULATION
  std::memcpy(f, src, 32);
#else
  const float4 a = reinterpret_cast<const float4*>(src)[0];
  const float4 b = reinterpret_cast<const float4*>(src)[1];
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
#endif
}

// kTileKeys rows of `cols` 16-bit values (a multiple of 8) into shared memory (row stride ld),
// zero-filled outside rows_valid x cols_valid (zeros add nothing to a dot product). vec: 16-byte
// cp.async chunks, each wholly valid or wholly padding (the real dims are multiples of 8 then);
// else 2-byte loads.
__device__ __forceinline__ void load_rows(uint16_t* dst, int ld, const uint16_t* src,
                                          int64_t src_ld, int64_t rows_valid, int64_t cols_valid,
                                          int cols, bool vec, int tid) {
  const int per_row = cols / 8;
  for (int c = tid; c < kTileKeys * per_row; c += kThreads) {
    const int r = c / per_row, col = (c % per_row) * 8;
    if (vec) {
      const bool ok = r < rows_valid && col < cols_valid;
      detail::cp_async_16(dst + r * ld + col, ok ? src + r * src_ld + col : src, ok);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const bool ok = r < rows_valid && col + e < cols_valid;
        dst[r * ld + col + e] = ok ? src[r * src_ld + col + e] : uint16_t(0);
      }
    }
  }
}

// ---------------------------------------------------------------- the split kernel
// One CTA: kRows rows (row chunk blockIdx.x % row_chunks) against the keys of split
// blockIdx.x / row_chunks, of kv head blockIdx.y, batch blockIdx.z. Tiles the mask hides from
// every query are skipped; a split with none visible writes empty partials and reads nothing.
template <typename T>
__global__ void __launch_bounds__(kThreads, kCtasPerSm) decode_split_kernel(const DecodeParams p) {
  DATTN_DYNAMIC_SHARED(int64_t, s_qpos);                      // [kRows] the rows' positions
  int64_t* s_qdoc = s_qpos + kRows;                           // [kRows] and documents
  float* s_alpha = reinterpret_cast<float*>(s_qdoc + kRows);  // [kRows] rescale; at the end 1/l
  float* s_p = s_alpha + kRows;                               // [kRows][kLdP] the tile's P
  float* s_q = s_p + kRows * kLdP;                            // [kRows][dp] the rows' queries
  const int ldk = p.dp + 8, ldv = p.dvp + 8;
  uint16_t* s_k = reinterpret_cast<uint16_t*>(s_q + kRows * p.dp);  // [2][kTileKeys][ldk]
  uint16_t* s_v = s_k + 2 * kTileKeys * ldk;                        // [2][kTileKeys][ldv]

  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int64_t chunk = int64_t(blockIdx.x) % p.row_chunks;
  const int64_t split = int64_t(blockIdx.x) / p.row_chunks;
  const int64_t hk = blockIdx.y, b = blockIdx.z;
  const int64_t r0 = chunk * kRows;
  const int nrows = int(min(int64_t(kRows), p.rows - r0));
  const int64_t part0 = ((split * p.batch + b) * p.heads_kv + hk) * p.rows + r0;
  const int64_t j_begin = p.key_lo + split * p.split_keys;
  const int64_t j_end = min(p.key_hi, j_begin + p.split_keys);
  const int64_t n_tiles = (j_end - j_begin + kTileKeys - 1) / kTileKeys;

  // The first tile at or after t that some query sees (n_tiles: none), and how it is covered.
  // Every thread computes the same: the loop below is uniform.
  auto next_visible = [&](int64_t t, int* how) -> int64_t {
    for (; t < n_tiles; ++t) {
      const int64_t j0 = j_begin + t * kTileKeys, j1 = min(j_end, j0 + kTileKeys) - 1;
      const int64_t a = row_position(j0, p.k_pos0, p.k_pos_stride, p.k_pos_block);
      const int64_t z = row_position(j1, p.k_pos0, p.k_pos_stride, p.k_pos_block);
      const int c = cover(p, p.q_lo, p.q_hi, min(a, z), max(a, z));
      if (c != kCoverNone) {
        *how = c;
        return t;
      }
    }
    return n_tiles;
  };
  int how = kCoverNone;
  int64_t t = next_visible(0, &how);
  if (t >= n_tiles) {
    if (tid < nrows) p.part_lse[part0 + tid] = -INFINITY;
    return;
  }

  const int64_t k_ld = p.heads_kv * p.head_dim, v_ld = p.heads_kv * p.head_dim_v;
  auto load_kv = [&](int64_t tile, int buf) {
    const int64_t j0 = j_begin + tile * kTileKeys;
    const int64_t valid = min(int64_t(kTileKeys), j_end - j0);
    const int64_t row0 = (b * p.seq_k + p.k_begin + j0) * p.heads_kv + hk;
    load_rows(s_k + buf * kTileKeys * ldk, ldk,
              static_cast<const uint16_t*>(p.k) + row0 * p.head_dim, k_ld, valid, p.head_dim, p.dp,
              p.vec_loads, tid);
    load_rows(s_v + buf * kTileKeys * ldv, ldv,
              static_cast<const uint16_t*>(p.v) + row0 * p.head_dim_v, v_ld, valid, p.head_dim_v,
              p.dvp, p.vec_loads, tid);
  };
  int buf = 0;
  load_kv(t, buf);
  detail::cp_async_commit();

  if (tid < nrows) {
    const int64_t i = (r0 + tid) / p.group;
    s_qpos[tid] = row_position(i, p.q_pos0, p.q_pos_stride, p.q_pos_block);
    s_qdoc[tid] = document_of(p, s_qpos[tid]);
  }
  for (int e = tid; e < kRows * p.dp; e += kThreads) {
    const int r = e / p.dp, c = e % p.dp;
    float x = 0.f;
    if (r < nrows && c < p.head_dim) {
      const int64_t row = r0 + r, i = row / p.group, h = hk * p.group + row % p.group;
      x = detail::to_float(static_cast<const T*>(
          p.q)[((b * p.seq_q + p.q_begin + i) * p.heads_q + h) * p.head_dim + c]);
    }
    s_q[e] = x;
  }

  // Scores: this lane's running max (log2 domain; the same in every lane) and share of the sum,
  // for the warp's rows warp + kWarps * k.
  float m[kRowsPerWarp], l[kRowsPerWarp];
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    m[k] = -INFINITY;
    l[k] = 0.f;
  }
  // Values: this thread's columns of its rows vrow0 + vstep * k (vstep <= kThreads / vchunks).
  const int vchunks = p.dvp / 8, vstep = (nrows + kMaxRowsPerThread - 1) / kMaxRowsPerThread;
  const int vcol = (tid % vchunks) * 8, vrow0 = tid / vchunks;
  float acc[kMaxRowsPerThread][8];
#pragma unroll
  for (int k = 0; k < kMaxRowsPerThread; ++k)
#pragma unroll
    for (int e = 0; e < 8; ++e)
      acc[k][e] = 0.f;

  while (t < n_tiles) {
    int next_how = kCoverNone;
    const int64_t tn = next_visible(t + 1, &next_how);
    // Prefetch the next visible tile into the other buffers (freed by the trailing barrier of
    // the previous iteration) while this one is computed.
    if (tn < n_tiles) {
      load_kv(tn, buf ^ 1);
      detail::cp_async_commit();
      detail::cp_async_wait<1>();
    } else {
      detail::cp_async_wait<0>();
    }
    __syncthreads();
    const int64_t j0 = j_begin + t * kTileKeys;
    // The mask only where the tile is not wholly visible (or holds fewer than kTileKeys keys).
    const bool masked = how != kCoverAll || j0 + kTileKeys > j_end;

    // ---- S = Q K^T for this lane's key, P = exp2(S - m), the online softmax per row
    const int64_t j = j0 + lane;
    const bool exists = j < j_end;
    int64_t kp = 0, kd = -1;
    if (masked) {
      kp = row_position(j, p.k_pos0, p.k_pos_stride, p.k_pos_block);
      kd = exists ? document_of(p, kp) : -1;
    }
    float s[kRowsPerWarp];
#pragma unroll
    for (int k = 0; k < kRowsPerWarp; ++k)
      s[k] = 0.f;
    const uint16_t* krow = s_k + (buf * kTileKeys + lane) * ldk;
    for (int c = 0; c < p.dp; c += 8) {
      float kf[8];
      widen8<T>(krow + c, kf);
#pragma unroll
      for (int k = 0; k < kRowsPerWarp; ++k) {
        if (warp + kWarps * k >= nrows) continue;
        float qf[8];
        load8(s_q + (warp + kWarps * k) * p.dp + c, qf);
#pragma unroll
        for (int e = 0; e < 8; ++e)
          s[k] += qf[e] * kf[e];
      }
    }
#pragma unroll
    for (int k = 0; k < kRowsPerWarp; ++k) {
      const int r = warp + kWarps * k;
      if (r >= nrows) continue;  // the same in the whole warp
      float x = log2_score(p, s[k]);
      // A hidden key's score is replaced, never used: a NaN in its K row goes nowhere.
      if (masked && !(exists && in_band(p, s_qpos[r], kp) && kd == s_qdoc[r])) x = -INFINITY;
      float mx = fmaxf(m[k], x);
#pragma unroll
      for (int off = 16; off > 0; off /= 2)
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      // A row that has seen nothing yet keeps m = -inf and is shifted by 0 (never -inf - -inf).
      const float shift = mx == -INFINITY ? 0.f : mx;
      const float alpha = exp2f(m[k] - shift), pk = exp2f(x - shift);
      m[k] = mx;
      l[k] = l[k] * alpha + pk;
      s_p[r * kLdP + lane] = pk;
      if (lane == 0) s_alpha[r] = alpha;
    }
    __syncthreads();

    // ---- O = alpha O + P V. In a partly hidden tile a hidden key's p is 0 and 0 * NaN = NaN:
    // keys with p = 0 are skipped there, so a NaN or inf in a hidden V row reaches no row.
    if (vrow0 < vstep) {
      const uint16_t* vt = s_v + buf * kTileKeys * ldv + vcol;
#pragma unroll
      for (int k = 0; k < kMaxRowsPerThread; ++k) {
        const int r = vrow0 + vstep * k;
        if (r >= nrows) continue;
        const float a = s_alpha[r];
#pragma unroll
        for (int e = 0; e < 8; ++e)
          acc[k][e] *= a;
      }
      for (int jj = 0; jj < kTileKeys; ++jj) {
        float vf[8];
        widen8<T>(vt + jj * ldv, vf);
#pragma unroll
        for (int k = 0; k < kMaxRowsPerThread; ++k) {
          const int r = vrow0 + vstep * k;
          if (r >= nrows) continue;
          const float pk = s_p[r * kLdP + jj];
          if (masked && pk == 0.f) continue;
#pragma unroll
          for (int e = 0; e < 8; ++e)
            acc[k][e] += pk * vf[e];
        }
      }
    }
    __syncthreads();  // every thread is done with these buffers and P before they are refilled
    t = tn;
    how = next_how;
    buf ^= 1;
  }

  // ---- the split's partial per row: lse (natural log) and O / l; -inf for a row that saw nothing
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int r = warp + kWarps * k;
    if (r >= nrows) continue;
    float sum = l[k];
#pragma unroll
    for (int off = 16; off > 0; off /= 2)
      sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (lane == 0) {
      const bool empty = sum == 0.f;
      p.part_lse[part0 + r] = empty ? -INFINITY : m[k] * kLn2 + logf(sum);
      s_alpha[r] = empty ? 0.f : 1.f / sum;
    }
  }
  __syncthreads();
  if (vrow0 < vstep) {
#pragma unroll
    for (int k = 0; k < kMaxRowsPerThread; ++k) {
      const int r = vrow0 + vstep * k;
      if (r >= nrows) continue;
      const float inv = s_alpha[r];
      float* dst = p.part_o + (part0 + r) * p.head_dim_v;
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (vcol + e < p.head_dim_v) dst[vcol + e] = acc[k][e] * inv;
    }
  }
}

// ---------------------------------------------------------------- the merge kernel
// max that keeps a NaN (fmaxf drops it): a row that saw a NaN must get one.
__device__ __forceinline__ float max_keep_nan(float a, float b) {
  return a != a ? a : (b != b ? b : fmaxf(a, b));
}

// One warp per row (batch, kv head, row of the group): the splits' partials combined in split
// order (kernels/merge.h's rule over all of them at once), then merged into out / lse.
__global__ void __launch_bounds__(kThreads) decode_merge_kernel(const DecodeParams p) {
  constexpr int kCols = int(kMaxHeadDim / 32);  // a lane's columns, lane + 32 c
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int64_t n = p.batch * p.heads_kv * p.rows;  // partial rows per split
  const int64_t row = int64_t(blockIdx.x) * kWarps + warp;
  if (row >= n) return;
  float mx = -INFINITY;
  for (int64_t s = lane; s < p.splits; s += 32)
    mx = max_keep_nan(mx, p.part_lse[s * n + row]);
#pragma unroll
  for (int off = 16; off > 0; off /= 2)
    mx = max_keep_nan(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if (mx == -INFINITY) return;  // no split saw a key: the running partial stays as it is

  float o[kCols], wsum = 0.f;
#pragma unroll
  for (int c = 0; c < kCols; ++c)
    o[c] = 0.f;
  for (int64_t s = 0; s < p.splits; ++s) {
    const float ls = p.part_lse[s * n + row];
    if (ls == -INFINITY) continue;  // its o was never written
    const float w = expf(ls - mx);
    wsum += w;
    const float* src = p.part_o + (s * n + row) * p.head_dim_v;
#pragma unroll
    for (int c = 0; c < kCols; ++c)
      if (lane + 32 * c < p.head_dim_v) o[c] += w * src[lane + 32 * c];
  }
  const float lse_b = mx + logf(wsum), inv = 1.f / wsum;

  const int64_t r = row % p.rows, hk = (row / p.rows) % p.heads_kv, b = row / p.rows / p.heads_kv;
  const int64_t i = p.q_begin + r / p.group, h = hk * p.group + r % p.group;
  float* lse_dst = p.lse + (b * p.heads_q + h) * p.seq_q + i;
  float* orow = p.out + ((b * p.seq_q + i) * p.heads_q + h) * p.head_dim_v;
  const float lse_old = *lse_dst;
  __syncwarp();  // every lane has read the old lse before lane 0 writes the new one
  const bool replace = lse_old == -INFINITY;  // an empty running partial: take this one
  float ca = 0.f, cb = inv, lse_new = lse_b;
  if (!replace) {
    const float m2 = fmaxf(lse_old, lse_b);
    const float wa = expf(lse_old - m2), wb = expf(lse_b - m2);
    ca = wa / (wa + wb);
    cb = wb / (wa + wb) * inv;
    lse_new = m2 + logf(wa + wb);
  }
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const int col = lane + 32 * c;
    if (col < p.head_dim_v) orow[col] = replace ? cb * o[c] : ca * orow[col] + cb * o[c];
  }
  if (lane == 0) *lse_dst = lse_new;
}

// ---------------------------------------------------------------- host side

// The current device's multiprocessors, asked once per device.
int64_t multiprocessors() {
  static std::mutex mutex;
  static std::vector<int> counts;
  int dev = 0;
  DATTN_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mutex);
  if (size_t(dev) >= counts.size()) counts.resize(size_t(dev) + 1, 0);
  if (counts[size_t(dev)] == 0) {
    int n = 0;
    DATTN_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    counts[size_t(dev)] = std::max(n, 1);
  }
  return counts[size_t(dev)];
}

// The block's key rows [*lo, *hi) that the band can show to queries at positions [q_lo, q_hi]
// when key j sits at k_pos0 + j * stride (stride >= 1, blocks of one); all of them otherwise.
// Documents are left to the kernel's tile skipping.
void band_keys(const DecodeParams& p, int64_t* lo, int64_t* hi) {
  *lo = 0;
  *hi = p.k_len;
  if (p.k_pos_block != 1 || p.k_pos_stride < 1) return;
  const int64_t st = p.k_pos_stride;
  int64_t bound = 0, d = 0;
  // The first key at or after q_lo - left.
  if (p.left >= 0 && !__builtin_sub_overflow(p.q_lo, p.left, &bound) && bound > p.k_pos0)
    *lo = __builtin_sub_overflow(bound, p.k_pos0, &d) ? p.k_len
                                                      : std::min(p.k_len, d / st + (d % st != 0));
  // The last key at or before q_hi + right.
  if (p.right >= 0 && !__builtin_add_overflow(p.q_hi, p.right, &bound)) {
    if (bound < p.k_pos0)
      *hi = 0;
    else if (!__builtin_sub_overflow(bound, p.k_pos0, &d) && d / st < p.k_len)
      *hi = d / st + 1;
  }
}

template <typename T>
void launch(const DecodeParams& p, cudaStream_t stream) {
  const size_t smem = smem_bytes(p.dp, p.dvp);
  auto split_kernel = decode_split_kernel<T>;
  // Above 48 KiB of dynamic shared memory a kernel must opt in (D > 128 only).
  DATTN_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(split_kernel),
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const dim3 grid(unsigned(p.splits * p.row_chunks), unsigned(p.heads_kv), unsigned(p.batch));
  DATTN_LAUNCH(split_kernel, grid, kThreads, smem, stream, p);
  DATTN_CUDA_CHECK(cudaGetLastError());
  const int64_t rows = p.batch * p.heads_kv * p.rows;
  DATTN_LAUNCH(decode_merge_kernel, unsigned((rows + kWarps - 1) / kWarps), kThreads, 0, stream, p);
  DATTN_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

size_t decode_shared_bytes(int64_t head_dim, int64_t head_dim_v) {
  return smem_bytes(int((head_dim + 7) / 8 * 8), int((head_dim_v + 7) / 8 * 8));
}

void decode_forward(const AttentionBlock& blk, float* out, float* lse, cudaStream_t stream) {
  // ---------------------------------------------------------------- validation (host, first)
  DecodeParams p;
  const bool work = detail::flash_params(blk, out, lse, &p);
  const int64_t q_len = blk.q_len < 0 ? blk.seq_q - blk.q_begin : blk.q_len;  // validated there
  DATTN_CHECK_ARG(q_len <= kMaxDecodeQueryRows, "q_len", q_len,
                  dattn::detail::cat("at most ", kMaxDecodeQueryRows,
                                     " (the CUDA decode kernel's limit; longer blocks run on "
                                     "attention_forward)"));
  if (!work) return;  // no batch, query or key rows: the partial stays as it is
  p.group = p.heads_q / p.heads_kv;
  p.rows = p.q_len * p.group;
  p.row_chunks = (p.rows + kRows - 1) / kRows;
  DATTN_CHECK_ARG((p.batch * p.heads_kv * p.rows + kWarps - 1) / kWarps <= 0x7fffffff,
                  "batch x heads_q x q_len", p.batch * p.heads_q * p.q_len,
                  dattn::detail::cat("at most ", int64_t(0x7fffffff) * kWarps,
                                     " (the CUDA decode merge kernel's grid)"));
  p.dp = int((p.head_dim + 7) / 8 * 8);
  p.dvp = int((p.head_dim_v + 7) / 8 * 8);

  // ---------------------------------------------------------------- the split
  p.q_lo = INT64_MAX;
  p.q_hi = INT64_MIN;
  for (int64_t i = 0; i < p.q_len; ++i) {
    const int64_t pos = p.q_pos0 + (i / p.q_pos_block) * p.q_pos_stride + i % p.q_pos_block;
    p.q_lo = std::min(p.q_lo, pos);
    p.q_hi = std::max(p.q_hi, pos);
  }
  band_keys(p, &p.key_lo, &p.key_hi);
  const int64_t keys = p.key_hi - p.key_lo;
  if (keys <= 0) return;  // the band hides every key: the partial stays as it is
  const int64_t others = p.batch * p.heads_kv * p.row_chunks;  // CTAs per split
  const int64_t wanted = (int64_t(kCtasPerSm) * multiprocessors() + others - 1) / others;
  const int64_t splits =
      std::max<int64_t>(1, std::min(wanted, (keys + kMinSplitKeys - 1) / kMinSplitKeys));
  p.split_keys = ((keys + splits - 1) / splits + kTileKeys - 1) / kTileKeys * kTileKeys;
  p.splits = (keys + p.split_keys - 1) / p.split_keys;

  // ---------------------------------------------------------------- launch
  // The splits' partials, stream-ordered: nothing waits for the device here.
  const size_t part_rows = size_t(p.splits * p.batch * p.heads_kv * p.rows);
  float* scratch = nullptr;
  DATTN_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&scratch),
                                   part_rows * size_t(p.head_dim_v + 1) * sizeof(float), stream));
  p.part_o = scratch;
  p.part_lse = scratch + part_rows * size_t(p.head_dim_v);
  if (p.dtype == DType::bf16)
    launch<__nv_bfloat16>(p, stream);
  else
    launch<__half>(p, stream);
  DATTN_CUDA_CHECK(cudaFreeAsync(scratch, stream));
}

}  // namespace dattn::cuda
