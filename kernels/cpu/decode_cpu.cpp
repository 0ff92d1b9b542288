// The CPU decode kernel (kernels/cpu/decode_cpu.h). Each split walks its keys in chunks of
// kChunk: the scores of every row against the chunk's keys (each key row read once, widened in
// registers, dotted with four query rows at a time), the online-softmax update of each row, then
// O += P V with each value row read once. The loops are plain C++ vectorised by the compiler
// (one AVX512-BF16 instruction aside), built four times (x86-64-v4 with AVX512-BF16; x86-64-v4:
// AVX-512; v3: AVX2, FMA, F16C; the x86-64 baseline), the best the CPU runs picked at load time.
#include "kernels/cpu/decode_cpu.h"

// The 32-byte vector helpers below pass AVX-sized values, which GCC warns would change the ABI of
// the baseline build (GCC and clang alike); they are always inlined, so no call ever passes one.
#if defined(__GNUC__)  // GCC and clang
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

#include "kernels/cpu/finite.h"
#include "kernels/cpu/tile_mask.h"
#include "kernels/cpu/vec_math.h"
#include "kernels/merge.h"
#include "src/base/error.h"

namespace dattn::cpu {

namespace {

constexpr int64_t kChunk = 64;           // keys per softmax step
constexpr int64_t kMinSplitKeys = 1024;  // keys a split gets at least (its merge is not free)
// Rows from which the chunk's scores and O += P V run as sgemm: with many rows (MLA's heads share
// one latent cache; longer query blocks) the vector loops are bound by FLOPs, not by the memory
// they read, and a 16-bit chunk widened once serves all the rows.
constexpr int64_t kGemmRows = 16;
constexpr int64_t kGemmChunk = 512;  // keys per step there: the GEMMs pack the queries once a step

#define DATTN_DECODE_INLINE __attribute__((always_inline)) inline

// The storage types (src/base/dtype.h: the bits of bf16 and f16), widened to fp32 where they are
// loaded.
DATTN_DECODE_INLINE float widen(float x) {
  return x;
}
DATTN_DECODE_INLINE float widen(bf16 x) {
  return std::bit_cast<float>(uint32_t(x.bits) << 16);
}
// fp16 bits as fp32: the exponent and mantissa moved into place and rescaled by 2^112 (exact for
// normals and subnormals), inf and NaN given the all-ones exponent, the sign put back. Integer and
// fp32 arithmetic only (no F16C, no _Float16), so that every build and compiler has it.
DATTN_DECODE_INLINE float widen(f16 x) {
  const uint32_t h = x.bits, em = h & 0x7fffu;
  const float f = std::bit_cast<float>(em << 13) * 0x1p112f;
  const uint32_t bits = em >= 0x7c00u ? (em << 13) | 0x7f800000u : std::bit_cast<uint32_t>(f);
  return std::bit_cast<float>(bits | ((h & 0x8000u) << 16));
}

// Prefetches n elements from x on (every 64-byte line) into the outer caches (locality 1,
// prefetcht2 on x86). Into L1 (prefetcht0) each prefetch waits for one of the core's few L1 miss
// buffers: on an AMD EPYC Zen 4, 2 threads, context 262144, H_kv 2, 4 rows per kv head, the
// kernel streamed fp32 13.3 GB/s that way against 25.2 with prefetcht2 (bf16: 14.5 and 20.2),
// where prefetcht1 gave 23.5 / 17.2 and prefetchnta 16.9 / 13.5.
template <typename T>
DATTN_DECODE_INLINE void prefetch_rows(const T* x, int64_t n) {
  const char* b = reinterpret_cast<const char*>(x);
  for (int64_t off = 0; off < n * int64_t(sizeof(T)); off += 64)
    __builtin_prefetch(b + off, 0, 1);
}

// Eight fp32 lanes (GCC's vector extensions: one AVX register on x86-64-v3/v4, two SSE ones on
// the baseline), loaded from any storage type.
typedef float V8 __attribute__((vector_size(32)));
typedef uint16_t V8u16 __attribute__((vector_size(16)));
typedef uint32_t V8u32 __attribute__((vector_size(32)));
DATTN_DECODE_INLINE V8 load8(const float* x) {
  V8 v;
  std::memcpy(&v, x, sizeof(v));
  return v;
}
DATTN_DECODE_INLINE V8 load8(const bf16* x) {
  V8u16 h;
  std::memcpy(&h, x, sizeof(h));
  return reinterpret_cast<V8>(__builtin_convertvector(h, V8u32) << 16);
}
V8 half_to_float(V8u32 h);
DATTN_DECODE_INLINE V8 load8(const f16* x) {
  V8u16 h;
  std::memcpy(&h, x, sizeof(h));
  return half_to_float(__builtin_convertvector(h, V8u32));
}
DATTN_DECODE_INLINE void store8(float* x, V8 v) {
  std::memcpy(x, &v, sizeof(v));
}
DATTN_DECODE_INLINE float hsum(V8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// Sixteen fp32 lanes (one AVX-512 register), for the bf16 dot products.
typedef float V16 __attribute__((vector_size(64)));

// The lane sums of eight vectors at once, by a tree of shuffles and adds across them (about three
// instructions per sum, against eight for one hsum each: at four rows and two keys the sums
// cost as many instructions as the dot products did). Sum i lands in lane sum8_lane(i) (i's three
// bits reversed).
constexpr int sum8_lane(int i) {
  return ((i & 1) << 2) | (i & 2) | (i >> 2);
}
DATTN_DECODE_INLINE V8 sums8(const V8 (&a)[8]) {
  V8 z[4], w[2];
  for (int i = 0; i < 4; ++i)  // [a_2i: 4 lanes | a_2i+1: 4]
    z[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)  // [a_4i, a_4i+2, a_4i+1, a_4i+3]: 2 lanes each
    w[i] = __builtin_shufflevector(z[2 * i], z[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(z[2 * i], z[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(w[0], w[1], 0, 8, 2, 10, 4, 12, 6, 14) +
         __builtin_shufflevector(w[0], w[1], 1, 9, 3, 11, 5, 13, 7, 15);
}
DATTN_DECODE_INLINE V8 sums8(const V16 (&a)[8]) {
  V16 z[4], w[2];
  for (int i = 0; i < 4; ++i)  // [a_2i: 8 lanes | a_2i+1: 8]
    z[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19,
                                   20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26,
                                   27, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // [a_4i, a_4i+2, a_4i+1, a_4i+3]: 4 lanes each
    w[i] = __builtin_shufflevector(z[2 * i], z[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11,
                                   24, 25, 26, 27) +
           __builtin_shufflevector(z[2 * i], z[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14,
                                   15, 28, 29, 30, 31);
  // [a0, a4, a2, a6, a1, a5, a3, a7]: 2 lanes each, then their pairs added
  const V16 u = __builtin_shufflevector(w[0], w[1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12,
                                        13, 28, 29) +
                __builtin_shufflevector(w[0], w[1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14,
                                        15, 30, 31);
  return __builtin_shufflevector(u, u, 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(u, u, 1, 3, 5, 7, 9, 11, 13, 15);
}

// The NR x NK sums of acc (row r, key kk) plus tail, times scale, into s[r * lds + kk].
template <int NR, int NK, typename V>
DATTN_DECODE_INLINE void store_sums(const V (&acc)[NR][NK], const float (&tail)[NR][NK],
                                    float scale, float* s, int64_t lds, bool add) {
  float x[NR][NK];
  if constexpr (NR * NK == 8) {
    V a[8];
    for (int i = 0; i < 8; ++i)
      a[i] = acc[i / NK][i % NK];
    const V8 sum = sums8(a);
    for (int i = 0; i < 8; ++i)
      x[i / NK][i % NK] = sum[sum8_lane(i)];
  } else {
    for (int r = 0; r < NR; ++r)
      for (int kk = 0; kk < NK; ++kk) {
        if constexpr (sizeof(V) == sizeof(V8)) {
          x[r][kk] = hsum(acc[r][kk]);
        } else {
          const V a = acc[r][kk];
          x[r][kk] = hsum(__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
                          __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15));
        }
      }
  }
  for (int r = 0; r < NR; ++r)
    for (int kk = 0; kk < NK; ++kk) {
      const float v = (x[r][kk] + tail[r][kk]) * scale;
      float& dst = s[r * lds + kk];
      dst = add ? dst + v : v;
    }
}

// 16-bit values 16 at a time from one 32-byte load: each 32-bit word holds two, the even-indexed
// one in its low half. For bf16, (word << 16) gives the even ones and (word & 0xffff0000) the odd
// ones as fp32, two instructions for 16 values. The fp32 operands they meet are stored
// de-interleaved to match (perm16).
DATTN_DECODE_INLINE void load16_split(const bf16* x, V8* even, V8* odd) {
  V8u32 w;
  std::memcpy(&w, x, sizeof(w));
  *even = reinterpret_cast<V8>(w << 16);
  *odd = reinterpret_cast<V8>(w & 0xffff0000u);
}

// widen(f16) on eight lanes (the fp16 bits in the low 16 of each).
DATTN_DECODE_INLINE V8 half_to_float(V8u32 h) {
  const V8u32 em = h & 0x7fffu;
  const V8 f = reinterpret_cast<V8>(em << 13) * 0x1p112f;
  const V8u32 bits = em >= 0x7c00u ? (em << 13) | 0x7f800000u : reinterpret_cast<V8u32>(f);
  return reinterpret_cast<V8>(bits | ((h & 0x8000u) << 16));
}
DATTN_DECODE_INLINE void load16_split(const f16* x, V8* even, V8* odd) {
  V8u32 w;
  std::memcpy(&w, x, sizeof(w));
  *even = half_to_float(w & 0xffffu);
  *odd = half_to_float(w >> 16);
}

// x[0, n) with each whole block of 16 de-interleaved (even-indexed values first, then the odd;
// `inverse` undoes it); a tail shorter than 16 stays in place.
DATTN_DECODE_INLINE void perm16(float* x, int64_t n, bool inverse) {
  for (int64_t b = 0; b + 16 <= n; b += 16) {
    float t[16];
    for (int i = 0; i < 8; ++i) {
      if (inverse) {
        t[2 * i] = x[b + i];
        t[2 * i + 1] = x[b + 8 + i];
      } else {
        t[i] = x[b + 2 * i];
        t[8 + i] = x[b + 2 * i + 1];
      }
    }
    std::memcpy(x + b, t, sizeof(t));
  }
}

// Whether the loops below read T 16 at a time with load16_split (their fp32 side in perm16 order):
// the 16-bit types.
template <typename T>
inline constexpr bool kSplitLoads = !std::is_same_v<T, float>;

// s[r * lds + kk] (+)= q_r . k_kk for NR rows of q [NR, ldq] and NK keys (key kk at
// k + kk * kstride): NR x NK independent sums in registers, each key element loaded and widened
// once for the NR rows.
template <int NR, int NK, typename T>
DATTN_DECODE_INLINE void dot_block(const float* q, int64_t ldq, const T* k, int64_t kstride,
                                   int64_t d, float* s, int64_t lds, bool add) {
  V8 acc[NR][NK] = {};
  int64_t c = 0;
  if constexpr (kSplitLoads<T>) {
    for (; c + 16 <= d; c += 16) {
      V8 ke[NK], ko[NK];
#pragma GCC unroll 4
      for (int kk = 0; kk < NK; ++kk)
        load16_split(k + kk * kstride + c, &ke[kk], &ko[kk]);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        const V8 qe = load8(q + r * ldq + c), qo = load8(q + r * ldq + c + 8);
#pragma GCC unroll 4
        for (int kk = 0; kk < NK; ++kk) {  // two FMAs (a sum of products is a mul, FMA, add)
          acc[r][kk] += qe * ke[kk];
          acc[r][kk] += qo * ko[kk];
        }
      }
    }
  }
  for (; c + 8 <= d; c += 8) {
    V8 kv[NK];
#pragma GCC unroll 4
    for (int kk = 0; kk < NK; ++kk)
      kv[kk] = load8(k + kk * kstride + c);
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const V8 qv = load8(q + r * ldq + c);
#pragma GCC unroll 4
      for (int kk = 0; kk < NK; ++kk)
        acc[r][kk] += qv * kv[kk];
    }
  }
  float tail[NR][NK] = {};
  for (; c < d; ++c)
    for (int kk = 0; kk < NK; ++kk) {
      const float kc = widen(k[kk * kstride + c]);
      for (int r = 0; r < NR; ++r)
        tail[r][kk] += q[r * ldq + c] * kc;
    }
  store_sums<NR, NK>(acc, tail, 1.f, s, lds, add);
}

typedef uint16_t V32u16 __attribute__((vector_size(64)));

// acc[i] += a[2i] b[2i] + a[2i + 1] b[2i + 1] for bf16 a, b, in fp32 (AVX512-BF16's vdpbf16ps:
// the products of two bf16 are exact in fp32, and inputs and results below 2^-126 count as 0).
// Inline assembly because GCC's intrinsics cannot be inlined into these loops' templates, which
// have no instruction set of their own: they take the one of the run_split_* function they are
// inlined into, and only run_split_v4_bf16 runs this.
// (By value: an asm operand that is an array element keeps the whole array in memory.)
DATTN_DECODE_INLINE V16 dot_bf16_pairs(V16 acc, V32u16 a, V32u16 b) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// dot_block for bf16 queries and keys by bf16 dot products, 32 elements a step, the scores
// multiplied by `scale`. On an AMD EPYC Zen 4 (2 threads, context 262144, H_kv 2, 4 rows per kv
// head) a split took 7% less time than with the widening loops (median of 8 runs, 9.25 against
// 9.96 ms); CPUs with two 512-bit FMA units should gain more.
template <int NR, int NK>
DATTN_DECODE_INLINE void dot_block_bf16(const bf16* q, int64_t ldq, const bf16* k, int64_t kstride,
                                        int64_t d, float scale, float* s, int64_t lds, bool add) {
  V16 acc[NR][NK] = {};
  int64_t c = 0;
  for (; c + 32 <= d; c += 32) {
    V32u16 kv[NK];
#pragma GCC unroll 4
    for (int kk = 0; kk < NK; ++kk)
      std::memcpy(&kv[kk], k + kk * kstride + c, sizeof(V32u16));
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      V32u16 qv;
      std::memcpy(&qv, q + r * ldq + c, sizeof(qv));
#pragma GCC unroll 4
      for (int kk = 0; kk < NK; ++kk)
        acc[r][kk] = dot_bf16_pairs(acc[r][kk], qv, kv[kk]);
    }
  }
  float tail[NR][NK] = {};
  for (; c < d; ++c)
    for (int kk = 0; kk < NK; ++kk) {
      const float kc = widen(k[kk * kstride + c]);
      for (int r = 0; r < NR; ++r)
        tail[r][kk] += widen(q[r * ldq + c]) * kc;
    }
  store_sums<NR, NK>(acc, tail, scale, s, lds, add);
}

// dot_block for fp32 keys on 16 lanes (x86-64-v4: one AVX-512 register; the 8-lane loop there
// issues twice the loads and FMAs for the same bytes), the last d % 16 elements one by one.
// With pv_block16, on an Emerald Rapids VM (context 262144, H_kv 2, 4 rows per kv head, fp32):
// 2 threads streamed 0.83 of the read bandwidth against 0.73 on 8 lanes, and one thread over a
// cached context (16384 keys) 25.7 GB/s against 20.2.
template <int NR, int NK>
DATTN_DECODE_INLINE void dot_block16(const float* q, int64_t ldq, const float* k, int64_t kstride,
                                     int64_t d, float* s, int64_t lds, bool add) {
  V16 acc[NR][NK] = {};
  int64_t c = 0;
  for (; c + 16 <= d; c += 16) {
    V16 kv[NK];
#pragma GCC unroll 4
    for (int kk = 0; kk < NK; ++kk)
      std::memcpy(&kv[kk], k + kk * kstride + c, sizeof(V16));
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      V16 qv;
      std::memcpy(&qv, q + r * ldq + c, sizeof(qv));
#pragma GCC unroll 4
      for (int kk = 0; kk < NK; ++kk)
        acc[r][kk] += qv * kv[kk];
    }
  }
  float tail[NR][NK] = {};
  for (; c < d; ++c)
    for (int kk = 0; kk < NK; ++kk)
      for (int r = 0; r < NR; ++r)
        tail[r][kk] += q[r * ldq + c] * k[kk * kstride + c];
  store_sums<NR, NK>(acc, tail, 1.f, s, lds, add);
}

// dot_block (dot_block16 for fp32 keys where kWide) over all the rows of q [rows, ldq]: four
// at a time, then the rest.
template <int NR, int NK, bool kWide, typename T>
DATTN_DECODE_INLINE void score_block(const float* q, int64_t ldq, const T* k, int64_t kstride,
                                     int64_t d, float* s, int64_t lds, bool add) {
  if constexpr (kWide && std::is_same_v<T, float>)
    dot_block16<NR, NK>(q, ldq, k, kstride, d, s, lds, add);
  else
    dot_block<NR, NK>(q, ldq, k, kstride, d, s, lds, add);
}
template <int NK, bool kWide, typename T>
DATTN_DECODE_INLINE void score_rows(const float* q, int64_t ldq, int64_t rows, const T* k,
                                    int64_t kstride, int64_t d, float* s, int64_t lds, bool add) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4)
    score_block<4, NK, kWide>(q + r * ldq, ldq, k, kstride, d, s + r * lds, lds, add);
  switch (rows - r) {
    case 3:
      return score_block<3, NK, kWide>(q + r * ldq, ldq, k, kstride, d, s + r * lds, lds, add);
    case 2:
      return score_block<2, NK, kWide>(q + r * ldq, ldq, k, kstride, d, s + r * lds, lds, add);
    case 1:
      return score_block<1, NK, kWide>(q + r * ldq, ldq, k, kstride, d, s + r * lds, lds, add);
  }
}

// score_rows by bf16 dot products (dot_block_bf16).
template <int NK>
DATTN_DECODE_INLINE void score_rows_bf16(const bf16* q, int64_t ldq, int64_t rows, const bf16* k,
                                         int64_t kstride, int64_t d, float scale, float* s,
                                         int64_t lds, bool add) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4)
    dot_block_bf16<4, NK>(q + r * ldq, ldq, k, kstride, d, scale, s + r * lds, lds, add);
  switch (rows - r) {
    case 3:
      return dot_block_bf16<3, NK>(q + r * ldq, ldq, k, kstride, d, scale, s + r * lds, lds, add);
    case 2:
      return dot_block_bf16<2, NK>(q + r * ldq, ldq, k, kstride, d, scale, s + r * lds, lds, add);
    case 1:
      return dot_block_bf16<1, NK>(q + r * ldq, ldq, k, kstride, d, scale, s + r * lds, lds, add);
  }
}

// o [NR rows, ldo] columns [c, c + 8 NC) += sum over the n keys of p[r][jj] v_jj (p [NR, lds],
// value row jj at v + jj * vstride): the NR x NC accumulators stay in registers over the keys,
// so o is read and written once per chunk.
template <int NR, int NC, typename T>
DATTN_DECODE_INLINE void pv_block(const float* p, int64_t lds, int64_t n, const T* v,
                                  int64_t vstride, float* o, int64_t ldo) {
  V8 acc[NR][NC];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int cc = 0; cc < NC; ++cc)
      acc[r][cc] = load8(o + r * ldo + 8 * cc);
  for (int64_t jj = 0; jj < n; ++jj) {
    V8 vv[NC];
    if constexpr (kSplitLoads<T> && NC % 2 == 0) {
#pragma GCC unroll 4
      for (int cc = 0; cc < NC; cc += 2)
        load16_split(v + jj * vstride + 8 * cc, &vv[cc], &vv[cc + 1]);
    } else {
#pragma GCC unroll 4
      for (int cc = 0; cc < NC; ++cc)
        vv[cc] = load8(v + jj * vstride + 8 * cc);
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const float pr = p[r * lds + jj];
#pragma GCC unroll 4
      for (int cc = 0; cc < NC; ++cc)
        acc[r][cc] += pr * vv[cc];
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int cc = 0; cc < NC; ++cc)
      store8(o + r * ldo + 8 * cc, acc[r][cc]);
}

// O [NR, dv] += P [NR, n] V [n, dv] of a fully visible chunk: 32 columns at a time where the
// instruction set has 32 vector registers (kWide: x86-64-v4), then 16, then 8, then one by one;
// fp32 values there first 64 and 16 columns at a time in 16-lane registers (pv_block16).
// Measured on an AMD EPYC Zen 4, 2 threads, context 262144, H_kv 2, 4 rows per kv head, bf16:
// 32 columns streamed 26 GB/s against 20 with 16 on x86-64-v4, while on x86-64-v3 (16 registers)
// 32 columns spill and lost (21 against 24).
// pv_block for fp32 values in 16-lane registers: columns [0, 16 NC).
template <int NR, int NC>
DATTN_DECODE_INLINE void pv_block16(const float* p, int64_t lds, int64_t n, const float* v,
                                    int64_t vstride, float* o, int64_t ldo) {
  V16 acc[NR][NC];
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int cc = 0; cc < NC; ++cc)
      std::memcpy(&acc[r][cc], o + r * ldo + 16 * cc, sizeof(V16));
  for (int64_t jj = 0; jj < n; ++jj) {
    V16 vv[NC];
#pragma GCC unroll 4
    for (int cc = 0; cc < NC; ++cc)
      std::memcpy(&vv[cc], v + jj * vstride + 16 * cc, sizeof(V16));
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const float pr = p[r * lds + jj];
#pragma GCC unroll 4
      for (int cc = 0; cc < NC; ++cc)
        acc[r][cc] += pr * vv[cc];
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int cc = 0; cc < NC; ++cc)
      std::memcpy(o + r * ldo + 16 * cc, &acc[r][cc], sizeof(V16));
}

template <int NR, bool kWide, typename T>
DATTN_DECODE_INLINE void pv_rows(const float* p, int64_t lds, int64_t n, const T* v,
                                 int64_t vstride, int64_t dv, float* o, int64_t ldo) {
  int64_t c = 0;
  if constexpr (kWide && std::is_same_v<T, float>) {  // fp32 on AVX-512: 16 lanes a register
    for (; c + 64 <= dv; c += 64)
      pv_block16<NR, 4>(p, lds, n, v + c, vstride, o + c, ldo);
    for (; c + 16 <= dv; c += 16)
      pv_block16<NR, 1>(p, lds, n, v + c, vstride, o + c, ldo);
  }
  if constexpr (kWide)
    for (; c + 32 <= dv; c += 32)
      pv_block<NR, 4>(p, lds, n, v + c, vstride, o + c, ldo);
  for (; c + 16 <= dv; c += 16)
    pv_block<NR, 2>(p, lds, n, v + c, vstride, o + c, ldo);
  for (; c + 8 <= dv; c += 8)
    pv_block<NR, 1>(p, lds, n, v + c, vstride, o + c, ldo);
  for (; c < dv; ++c)
    for (int64_t jj = 0; jj < n; ++jj) {
      const float vc = widen(v[jj * vstride + c]);
      for (int r = 0; r < NR; ++r)
        o[r * ldo + c] += p[r * lds + jj] * vc;
    }
}

template <typename T>
DATTN_DECODE_INLINE void widen_row(const T* src, float* dst, int64_t n) {
  for (int64_t c = 0; c < n; ++c)
    dst[c] = widen(src[c]);
}

DATTN_DECODE_INLINE void axpy(float* o, float p, const float* v, int64_t n) {
  for (int64_t c = 0; c < n; ++c)
    o[c] += p * v[c];
}

// s [rows, n] (+)= q [rows, d] k^T for the n keys of k (rows ldk apart), and
// o [rows, dv] += p [rows, n] v for n value rows (ldv apart): sgemm, single-threaded here.
void gemm_abt(const float* q, int64_t ldq, int64_t rows, const float* k, int64_t ldk, int64_t n,
              int64_t d, float* s, int64_t lds, float beta) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(n), int(d), 1.f, q, int(ldq),
              k, int(ldk), beta, s, int(lds));
}
void gemm_ab(const float* p, int64_t ldp, int64_t rows, int64_t n, const float* v, int64_t ldv,
             int64_t dv, float* o) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(dv), int(n), 1.f, p,
              int(ldp), v, int(ldv), 1.f, o, int(dv));
}

// Per-thread buffers, sized for one job's shape before the parallel region.
struct Workspace {
  std::vector<float> s, m, l, vbuf, qperm;
  std::vector<float> wide;  // a GEMM chunk's rows widened (16-bit storage)
  TileMask tile_mask;       // the mask on a partially masked chunk of keys
  explicit Workspace(const DecodeJob& p)
      : s(size_t(p.heads_kv * p.rows * kGemmChunk)),
        m(size_t(p.heads_kv * p.rows)),
        l(size_t(p.heads_kv * p.rows)),
        vbuf(size_t(p.dv)),
        qperm(p.dtype != DType::f32 ? size_t(p.heads_kv * p.rows * (p.d1 + p.d2)) : 0),
        wide(p.rows >= kGemmRows && p.dtype != DType::f32
                 ? size_t(kGemmChunk * std::max({p.d1, p.d2, p.dv}))
                 : 0),
        tile_mask(p.mask, kGemmChunk) {}
};

// n rows of d values, `stride` elements apart, as an fp32 matrix with leading dimension *ld: the
// rows themselves for fp32, else widened into ws.wide (a GEMM's operand, reused by all its rows).
template <typename T>
DATTN_DECODE_INLINE const float* rows_f32(const T* rows, int64_t stride, int64_t n, int64_t d,
                                          Workspace& ws, int64_t* ld) {
  if constexpr (std::is_same_v<T, float>) {
    *ld = stride;
    return rows;
  } else {
    for (int64_t j = 0; j < n; ++j)
      widen_row(rows + j * stride, ws.wide.data() + j * d, d);
    *ld = d;
    return ws.wide.data();
  }
}

// The normalised partial of job p over its keys [j_begin, j_end): o [heads_kv * rows, dv],
// lse [heads_kv * rows]. The softmax update follows attention_forward's tile loop (the same rules
// for rows that see nothing and for NaN). kBf16Dot: the instruction set has bf16 dot products.
template <typename T, bool kWide, bool kBf16Dot>
DATTN_DECODE_INLINE void run_split(const DecodeJob& p, int64_t j_begin, int64_t j_end,
                                   Workspace& ws, float* o, float* lse) {
  const int64_t R = p.rows, HR = p.heads_kv * p.rows, dq = p.d1 + p.d2, dv = p.dv;
  const T* k1 = static_cast<const T*>(p.k1);
  const T* k2 = static_cast<const T*>(p.k2);
  const T* v = static_cast<const T*>(p.v);
  const Mask& mask = p.mask;
  auto k_pos = [&](int64_t j) {
    return p.k_pos0 + (j / p.k_pos_block) * p.k_pos_stride + j % p.k_pos_block;
  };
  std::fill(o, o + HR * dv, 0.f);
  // The vector loops' fp32 operands in perm16 order where they read T 16 at a time: the queries
  // (a copy, each key part on its own), and o until the end.
  const bool split_loads = kSplitLoads<T> && R < kGemmRows;
  // bf16 keys dotted with bf16 queries in pairs: no widening, half the instructions.
  const bool bf16_dot = kBf16Dot && std::is_same_v<T, bf16> && p.q16 != nullptr;
  const float* q = p.q;
  if (split_loads && !bf16_dot) {
    std::copy(p.q, p.q + HR * dq, ws.qperm.begin());
    for (int64_t t = 0; t < HR; ++t) {
      perm16(ws.qperm.data() + t * dq, p.d1, false);
      perm16(ws.qperm.data() + t * dq + p.d1, p.d2, false);
    }
    q = ws.qperm.data();
  }
  std::fill(ws.m.begin(), ws.m.end(), -INFINITY);
  std::fill(ws.l.begin(), ws.l.end(), 0.f);
  const auto [qlo_it, qhi_it] = std::minmax_element(p.q_pos, p.q_pos + R);
  const int64_t qlo = *qlo_it, qhi = *qhi_it;
  float* s = ws.s.data();
  const bool gemm = R >= kGemmRows;
  const int64_t chunk = gemm ? kGemmChunk : kChunk, lds = chunk;

  for (int64_t c0 = j_begin; c0 < j_end; c0 += chunk) {
    const int64_t n = std::min(chunk, j_end - c0);
    const Mask::Cover cover = mask.cover(qlo, qhi, std::min(k_pos(c0), k_pos(c0 + n - 1)),
                                         std::max(k_pos(c0), k_pos(c0 + n - 1)));
    if (cover == Mask::Cover::none) continue;
    const bool partial = cover == Mask::Cover::some;

    // Scores s[h * R + r][jj] of every row against the chunk's keys, key rows in memory order
    // (many fp32 rows: one GEMM per kv head and key part).
    if (gemm) {
      for (int64_t h = 0; h < p.heads_kv; ++h) {
        const float* qh = p.q + h * R * dq;
        float* sh = s + h * R * lds;
        int64_t ld;
        const float* kf = rows_f32(k1 + c0 * p.k1_key + h * p.k1_head, p.k1_key, n, p.d1, ws, &ld);
        gemm_abt(qh, dq, R, kf, ld, n, p.d1, sh, lds, 0.f);
        if (p.d2 > 0) {
          kf = rows_f32(k2 + c0 * p.k2_key + h * p.k2_head, p.k2_key, n, p.d2, ws, &ld);
          gemm_abt(qh + p.d1, dq, R, kf, ld, n, p.d2, sh, lds, 1.f);
        }
      }
    }
    for (int64_t jj = 0; jj < n && !gemm; jj += 2) {  // two keys at a time
      const int64_t j = c0 + jj;
      // Ask for this chunk's value rows and the next chunk's key rows while the scores are
      // computed, so that the loops below do not wait on memory.
      prefetch_rows(v + j * p.v_key, 2 * p.v_key);
      if (j + chunk + 2 <= j_end) prefetch_rows(k1 + (j + chunk) * p.k1_key, 2 * p.k1_key);
      for (int64_t h = 0; h < p.heads_kv; ++h) {
        const float* qh = q + h * R * dq;
        float* sh = s + h * R * lds + jj;
        const T* k1j = k1 + j * p.k1_key + h * p.k1_head;
        const T* k2j = k2 + j * p.k2_key + h * p.k2_head;
        if constexpr (kBf16Dot && std::is_same_v<T, bf16>) {
          if (bf16_dot) {
            const bf16* q16 = p.q16 + h * R * dq;
            const float sc = p.q16_scale;
            if (jj + 1 < n) {
              score_rows_bf16<2>(q16, dq, R, k1j, p.k1_key, p.d1, sc, sh, lds, false);
              if (p.d2 > 0)
                score_rows_bf16<2>(q16 + p.d1, dq, R, k2j, p.k2_key, p.d2, sc, sh, lds, true);
            } else {
              score_rows_bf16<1>(q16, dq, R, k1j, p.k1_key, p.d1, sc, sh, lds, false);
              if (p.d2 > 0)
                score_rows_bf16<1>(q16 + p.d1, dq, R, k2j, p.k2_key, p.d2, sc, sh, lds, true);
            }
            continue;
          }
        }
        if (jj + 1 < n) {
          score_rows<2, kWide>(qh, dq, R, k1j, p.k1_key, p.d1, sh, lds, false);
          if (p.d2 > 0) score_rows<2, kWide>(qh + p.d1, dq, R, k2j, p.k2_key, p.d2, sh, lds, true);
        } else {
          score_rows<1, kWide>(qh, dq, R, k1j, p.k1_key, p.d1, sh, lds, false);
          if (p.d2 > 0) score_rows<1, kWide>(qh + p.d1, dq, R, k2j, p.k2_key, p.d2, sh, lds, true);
        }
      }
    }
    if (partial) {  // hide what the mask hides, on global positions
      ws.tile_mask.prepare(qlo, qhi, n, [&](int64_t jj) { return k_pos(c0 + jj); });
      for (int64_t t = 0; t < HR; ++t)
        (void)ws.tile_mask.hide(p.q_pos[t % R], s + t * lds, -INFINITY);
    }

    // The online-softmax update of each row; P replaces the scores.
    bool any_row = false;
    for (int64_t t = 0; t < HR; ++t) {
      float* srow = s + t * lds;
      float& m = ws.m[size_t(t)];
      float& l = ws.l[size_t(t)];
      if (p.softcap > 0.f) softcap_row(srow, n, p.softcap);  // keeps the mask's -inf
      const float m_new = std::max(m, row_max(srow, n));
      if (m_new == -INFINITY) {  // sees nothing yet; NaN scores make the row NaN (as the tiles do)
        if (has_nan(srow, n)) m = l = NAN;
        std::fill(srow, srow + n, 0.f);
        continue;
      }
      any_row = true;
      const float row_sum = exp_shift_sum(srow, n, m_new);
      if (m_new != m) {
        const float alpha = m == -INFINITY ? 0.f : std::exp(m - m_new);
        l *= alpha;
        scale_row(o + t * dv, dv, alpha);
        m = m_new;
      }
      l += row_sum;
    }
    if (!any_row) continue;

    // O += P V, each value row read once. In a partially hidden chunk a zero weight adds nothing:
    // skipping it keeps a NaN or inf in a hidden value row out of the rows that do not see it
    // (so the GEMM, which would multiply it by zero, runs on fully visible chunks only).
    if (gemm && !partial) {
      for (int64_t h = 0; h < p.heads_kv; ++h) {
        int64_t ld;
        const float* vf = rows_f32(v + c0 * p.v_key + h * p.v_head, p.v_key, n, dv, ws, &ld);
        gemm_ab(s + h * R * lds, lds, R, n, vf, ld, dv, o + h * R * dv);
      }
      continue;
    }
    if (!partial) {  // four rows at a time, then the rest
      for (int64_t h = 0; h < p.heads_kv; ++h) {
        const T* vh = v + c0 * p.v_key + h * p.v_head;
        const float* ph = s + h * R * lds;
        float* oh = o + h * R * dv;
        int64_t r = 0;
        for (; r + 4 <= R; r += 4)
          pv_rows<4, kWide>(ph + r * lds, lds, n, vh, p.v_key, dv, oh + r * dv, dv);
        if (R - r == 3) pv_rows<3, kWide>(ph + r * lds, lds, n, vh, p.v_key, dv, oh + r * dv, dv);
        if (R - r == 2) pv_rows<2, kWide>(ph + r * lds, lds, n, vh, p.v_key, dv, oh + r * dv, dv);
        if (R - r == 1) pv_rows<1, kWide>(ph + r * lds, lds, n, vh, p.v_key, dv, oh + r * dv, dv);
      }
      continue;
    }
    for (int64_t jj = 0; jj < n; ++jj) {
      const int64_t j = c0 + jj;
      for (int64_t h = 0; h < p.heads_kv; ++h) {
        const T* vrow = v + j * p.v_key + h * p.v_head;
        const float* vf;
        if constexpr (std::is_same_v<T, float>) {
          vf = vrow;
        } else {
          widen_row(vrow, ws.vbuf.data(), dv);
          if (split_loads) perm16(ws.vbuf.data(), dv, false);
          vf = ws.vbuf.data();
        }
        for (int64_t r = 0; r < R; ++r) {
          const float pr = s[(h * R + r) * lds + jj];
          if (partial && pr == 0.f) continue;
          axpy(o + (h * R + r) * dv, pr, vf, dv);
        }
      }
    }
  }

  for (int64_t t = 0; t < HR; ++t) {
    const float l = ws.l[size_t(t)];
    float* orow = o + t * dv;
    if (l == 0.f) {  // saw no key: the empty partial
      std::fill(orow, orow + dv, 0.f);
      lse[t] = -INFINITY;
      continue;
    }
    scale_row(orow, dv, 1.f / l);
    if (split_loads) perm16(orow, dv, true);
    lse[t] = ws.m[size_t(t)] + std::log(l);
  }
}

// run_split for one dtype, the loops built for one instruction set (the attribute; wide: it has
// 32 vector registers; bf16_dot: AVX512-BF16).
#define DATTN_DECODE_RUN_SPLIT(name, wide, bf16_dot, attributes)                          \
  attributes void name(const DecodeJob& p, int64_t j_begin, int64_t j_end, Workspace& ws, \
                       float* o, float* lse) {                                            \
    switch (p.dtype) {                                                                    \
      case DType::f32:                                                                    \
        return run_split<float, wide, bf16_dot>(p, j_begin, j_end, ws, o, lse);           \
      case DType::bf16:                                                                   \
        return run_split<bf16, wide, bf16_dot>(p, j_begin, j_end, ws, o, lse);            \
      case DType::f16:                                                                    \
        return run_split<f16, wide, bf16_dot>(p, j_begin, j_end, ws, o, lse);             \
    }                                                                                     \
  }
DATTN_DECODE_RUN_SPLIT(run_split_baseline, false, false, )
#if defined(__x86_64__) && defined(__GNUC__)
DATTN_DECODE_RUN_SPLIT(run_split_v3, false, false, __attribute__((target("arch=x86-64-v3"))))
DATTN_DECODE_RUN_SPLIT(run_split_v4, true, false, __attribute__((target("arch=x86-64-v4"))))
DATTN_DECODE_RUN_SPLIT(run_split_v4_bf16, true, true,
                       __attribute__((target("arch=x86-64-v4,avx512bf16"))))
// The levels' defining features that both GCC's and clang's __builtin_cpu_supports name (the
// loops use nothing else of v3, F16C and MOVBE included).
const DecodeIsa kBestIsa =
    __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") &&
            __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2") &&
            __builtin_cpu_supports("avx512bf16")
        ? DecodeIsa::x86_64_v4_bf16
    : __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") &&
            __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2")
        ? DecodeIsa::x86_64_v4
    : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
            __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2")
        ? DecodeIsa::x86_64_v3
        : DecodeIsa::baseline;
#else
const DecodeIsa kBestIsa = DecodeIsa::baseline;
#endif

void run_split_on(DecodeIsa isa, const DecodeJob& p, int64_t j_begin, int64_t j_end, Workspace& ws,
                  float* o, float* lse) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (isa == DecodeIsa::x86_64_v4_bf16) return run_split_v4_bf16(p, j_begin, j_end, ws, o, lse);
  if (isa == DecodeIsa::x86_64_v4) return run_split_v4(p, j_begin, j_end, ws, o, lse);
  if (isa == DecodeIsa::x86_64_v3) return run_split_v3(p, j_begin, j_end, ws, o, lse);
#endif
  run_split_baseline(p, j_begin, j_end, ws, o, lse);
}

// read_sum, its loop built for one instruction set.
#define DATTN_READ_SUM(name, attributes)                   \
  attributes float name(const float* p, int64_t n) {       \
    V16 acc[4] = {};                                       \
    int64_t i = 0;                                         \
    for (; i + 64 <= n; i += 64)                           \
      for (int a = 0; a < 4; ++a) {                        \
        V16 x;                                             \
        std::memcpy(&x, p + i + 16 * a, sizeof x);         \
        acc[a] += x;                                       \
      }                                                    \
    float total = 0;                                       \
    for (; i < n; ++i)                                     \
      total += p[i];                                       \
    const V16 sum = (acc[0] + acc[1]) + (acc[2] + acc[3]); \
    for (int l = 0; l < 16; ++l)                           \
      total += sum[l];                                     \
    return total;                                          \
  }
DATTN_READ_SUM(read_sum_baseline, )
#if defined(__x86_64__) && defined(__GNUC__)
DATTN_READ_SUM(read_sum_v3, __attribute__((target("arch=x86-64-v3"))))
DATTN_READ_SUM(read_sum_v4, __attribute__((target("arch=x86-64-v4"))))
#endif

// A float buffer of n elements; running out of memory is a dattn::Error (not std::bad_alloc).
std::vector<float> buffer(size_t n, const char* what) {
  try {
    return std::vector<float>(n);
  } catch (const std::bad_alloc&) {
    DATTN_THROW_KIND(ErrorKind::out_of_memory, "out of host memory allocating the decode ", what,
                     " (", n, " floats)");
  }
}

}  // namespace

int64_t decode_splits(int64_t jobs, int64_t n_keys) {
  const int64_t threads = omp_get_max_threads();
  if (threads <= 1 || jobs <= 0) return 1;
  const int64_t wanted = (4 * threads + jobs - 1) / jobs;  // a few units per thread
  return std::clamp<int64_t>(wanted, 1, std::max<int64_t>(1, n_keys / kMinSplitKeys));
}

void decode_partials(const DecodeJob* jobs, int64_t n_jobs, int64_t splits, float* o, float* lse,
                     DecodeIsa isa) {
  if (n_jobs <= 0) return;
  DATTN_ASSERT(isa <= kBestIsa);
  const DecodeJob& p0 = jobs[0];
  const int64_t HR = p0.heads_kv * p0.rows, dv = p0.dv, n_keys = p0.n_keys;
  // Splits of whole chunks; trailing ones may be empty (their partial is the empty one).
  const int64_t per = ((n_keys + splits - 1) / splits + kChunk - 1) / kChunk * kChunk;
  std::vector<Workspace> workspaces;
  try {
    workspaces.reserve(size_t(omp_get_max_threads()));
    for (int t = 0; t < omp_get_max_threads(); ++t)
      workspaces.emplace_back(p0);
  } catch (const std::bad_alloc&) {
    DATTN_THROW_KIND(ErrorKind::out_of_memory,
                     "out of host memory allocating the decode workspace");
  }
  openblas_set_num_threads(1);  // each thread's GEMMs run on that thread
#pragma omp parallel
  {
    Workspace& ws = workspaces[size_t(omp_get_thread_num())];
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < n_jobs * splits; ++u) {
      const int64_t j0 = std::min(n_keys, (u % splits) * per), j1 = std::min(n_keys, j0 + per);
      run_split_on(isa, jobs[u / splits], j0, j1, ws, o + u * HR * dv, lse + u * HR);
    }
  }
}

DecodeIsa decode_best_isa() {
  return kBestIsa;
}

float read_sum(const float* p, int64_t n, DecodeIsa isa) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (isa >= DecodeIsa::x86_64_v4) return read_sum_v4(p, n);
  if (isa == DecodeIsa::x86_64_v3) return read_sum_v3(p, n);
#endif
  return read_sum_baseline(p, n);
}

const char* decode_isa_name(DecodeIsa isa) {
  switch (isa) {
    case DecodeIsa::x86_64_v4_bf16:
      return "x86-64-v4+bf16";
    case DecodeIsa::x86_64_v4:
      return "x86-64-v4";
    case DecodeIsa::x86_64_v3:
      return "x86-64-v3";
    case DecodeIsa::baseline:
      return "baseline";
  }
  return "?";
}

void decode_forward(const AttentionBlock& blk, float* out, float* lse, DecodeIsa isa) {
  const int64_t B = blk.batch, Hq = blk.heads_q, Hkv = blk.heads_kv;
  const int64_t D = blk.head_dim, Dv = blk.head_dim_v;
  const int64_t q_len = blk.q_rows(), k_len = blk.k_rows();
  blk.check();
  if (B == 0 || q_len <= 0 || k_len <= 0) return;
  auto q_pos = [&](int64_t i) { return blk.q_position(i); };
  auto k_pos = [&](int64_t j) { return blk.k_position(j); };
  if (blk.mask.cover(q_pos(0), q_pos(q_len - 1), k_pos(0), k_pos(k_len - 1)) == Mask::Cover::none)
    return;

  // Row r = i * group + g of kv head h is query row i of head h * group + g.
  const int64_t group = Hq / Hkv, R = q_len * group, HR = Hkv * R;
  std::vector<int64_t> qpos(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r)
    qpos[size_t(r)] = q_pos(r / group);
  // The queries as fp32 [B, Hkv, R, D], times the scale.
  std::vector<float> q = buffer(size_t(B * HR * D), "queries");
  // bf16 queries also as they came, unscaled, for the bf16 dot products (decode_cpu.h).
  std::vector<bf16> q16;
  if (blk.dtype == DType::bf16 && isa == DecodeIsa::x86_64_v4_bf16) q16.resize(size_t(B * HR * D));
  const size_t es = dtype_size(blk.dtype);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < q_len; ++i)
      for (int64_t h = 0; h < Hq; ++h) {
        float* dst = q.data() + ((b * Hkv + h / group) * R + i * group + h % group) * D;
        const char* src = static_cast<const char*>(blk.q) +
                          size_t(((b * blk.seq_q + blk.q_begin + i) * Hq + h) * D) * es;
        convert_to_f32(src, blk.dtype, dst, size_t(D));
        scale_row(dst, D, blk.scale);
        if (!q16.empty()) std::memcpy(q16.data() + (dst - q.data()), src, size_t(D) * sizeof(bf16));
      }

  std::vector<DecodeJob> jobs(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    DecodeJob& j = jobs[size_t(b)];
    j.q = q.data() + b * HR * D;
    if (!q16.empty()) j.q16 = q16.data() + b * HR * D, j.q16_scale = blk.scale;
    j.q_pos = qpos.data();
    j.softcap = blk.softcap;
    j.heads_kv = Hkv, j.rows = R, j.d1 = D, j.dv = Dv, j.n_keys = k_len;
    j.dtype = blk.dtype;
    const size_t row0 = size_t((b * blk.seq_k + blk.k_begin) * Hkv);
    j.k1 = static_cast<const char*>(blk.k) + row0 * size_t(D) * es;
    j.v = static_cast<const char*>(blk.v) + row0 * size_t(Dv) * es;
    j.k1_key = Hkv * D, j.k1_head = D, j.v_key = Hkv * Dv, j.v_head = Dv;
    j.k_pos0 = blk.k_pos0, j.k_pos_stride = blk.k_pos_stride, j.k_pos_block = blk.k_pos_block;
    j.mask = blk.mask;
  }
  const int64_t splits = decode_splits(B, k_len);
  std::vector<float> o = buffer(size_t(B * splits * HR * Dv), "partials");
  std::vector<float> l = buffer(size_t(B * splits * HR), "partials");
  decode_partials(jobs.data(), B, splits, o.data(), l.data(), isa);

  // Merge the splits, in split order, into the running partial.
  for (int64_t b = 0; b < B; ++b)
    for (int64_t sp = 0; sp < splits; ++sp)
      for (int64_t t = 0; t < HR; ++t) {
        const int64_t r = t % R, head = (t / R) * group + r % group;
        const int64_t row = blk.q_begin + r / group, u = (b * splits + sp) * HR + t;
        merge_row(out + ((b * blk.seq_q + row) * Hq + head) * Dv,
                  lse + (b * Hq + head) * blk.seq_q + row, o.data() + u * Dv, l[size_t(u)], Dv);
      }
}

}  // namespace dattn::cpu
