// Softmax row operations (and the bf16 split of P): portable C++, AVX2 and AVX-512 versions,
// one chosen at load time.
// Measured on a Sapphire-Rapids-class core: GCC does not vectorise the portable max and
// exp-sum reductions (they stay scalar, ~40% of kernel time); the AVX-512 path makes them a
// few percent of the tile GEMMs.
#include "kernels/cpu/vec_math.h"

// GCC 12's AVX-512 headers start some intrinsics from _mm512_undefined_ps(), which its own
// -Wuninitialized then flags at every use; the values are never read.
// GCC only: clang has no -Wmaybe-uninitialized (and calls the pragma unknown under -Werror).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <cmath>
#include <cstring>

namespace dattn::cpu {

namespace {

// exp(x) for x <= 0 by range reduction x = n ln2 + f, |f| <= ln2/2, a degree-6 polynomial for
// exp(f) and 2^n; x < -87 (so also -inf) gives exactly 0. About 2 ulp.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpLow = -87.0f;
constexpr float kC[7] = {1.f, 1.f, 0.5f, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720};

float exp_nonpositive(float x) {
  if (!(x >= kExpLow)) return 0.f;
  const float n = std::nearbyint(x * kLog2e);
  const float f = x - n * kLn2Hi - n * kLn2Lo;
  float p = kC[6];
  for (int i = 5; i >= 0; --i)
    p = p * f + kC[i];
  return std::ldexp(p, int(n));
}

float row_max_portable(const float* x, int64_t n) {
  float m = -INFINITY;
  for (int64_t i = 0; i < n; ++i)
    m = x[i] > m ? x[i] : m;
  return m;
}

float exp_shift_sum_portable(float* x, int64_t n, float m) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i)
    s += x[i] = exp_nonpositive(x[i] - m);
  return s;
}

// Logit softcap: cap * tanh(x / cap), with tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2|y|)
// <= 1 (exp_nonpositive's domain; |error| about 1e-7 absolute in tanh, so cap * 1e-7 in the
// score). -inf (a masked score) and NaN stay as they are. t: tanh(x / cap), or null.
void softcap_portable(float* x, int64_t n, float cap, float* t) {
  for (int64_t i = 0; i < n; ++i) {
    if (!(x[i] > -INFINITY)) {
      if (t) t[i] = 0.f;
      continue;
    }
    const float y = x[i] / cap, e = exp_nonpositive(-2.f * std::fabs(y));
    const float th = std::copysign((1.f - e) / (1.f + e), y);
    if (t) t[i] = th;
    x[i] = cap * th;
  }
}

// x = hi + lo: hi is x rounded to bf16 (to nearest even), lo the rest rounded. For finite x and
// quiet NaNs (a NaN stays NaN); the integer rounding would turn a signalling NaN into inf.
uint16_t round_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// round_bf16 with denormal inputs taken as zero (their sign kept), as AVX512-BF16's VCVTNEPS2BF16
// takes them (it ignores MXCSR): every ISA's split gives the same bits.
uint16_t round_bf16_daz(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0) return uint16_t((u >> 16) & 0x8000u);
  return round_bf16(f);
}

void split_bf16_portable(const float* x, int64_t n, uint16_t* hi, uint16_t* lo) {
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t h = round_bf16_daz(x[i]);
    const uint32_t hb = uint32_t(h) << 16;
    float hf;
    std::memcpy(&hf, &hb, 4);
    hi[i] = h;
    lo[i] = round_bf16_daz(x[i] - hf);
  }
}

#if defined(__x86_64__)
// split_bf16 on AVX512-BF16: VCVTNEPS2BF16 rounds 16 lanes to nearest even in one instruction.
// Row by row on a 256 x 512 tile, one Xeon family 6 model 167 core: 13-15 us, against 23 for the
// same rounding in AVX-512F integer operations.
__attribute__((target("avx512f,avx512bf16"))) void split_bf16_avx512bf16(const float* x, int64_t n,
                                                                         uint16_t* hi,
                                                                         uint16_t* lo) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
    const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    const __m256i l = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_sub_ps(v, hf)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i), h);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i), l);
  }
  split_bf16_portable(x + i, n - i, hi + i, lo + i);
}

__attribute__((target("avx512f"))) __m512 exp512(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpLow), _CMP_GE_OQ);
  const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(kExpLow));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), xc);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), f);
  __m512 p = _mm512_set1_ps(kC[6]);
  for (int i = 5; i >= 0; --i)
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC[i]));
  return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n));
}

__attribute__((target("avx512f"))) float row_max_avx512(const float* x, int64_t n) {
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  __m512 m = ninf;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    m = _mm512_max_ps(m, _mm512_mask_loadu_ps(ninf, k, x + i));
  }
  return _mm512_reduce_max_ps(m);
}

__attribute__((target("avx512f"))) float exp_shift_sum_avx512(float* x, int64_t n, float m) {
  const __m512 vm = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), vm));
    _mm512_mask_storeu_ps(x + i, k, e);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, e));
  }
  return _mm512_reduce_add_ps(acc);
}

// tanh(y) = 1 - 2 / (1 + e), e = exp(2y) = 2^t with t = x * 2 log2(e) / cap: 2^t by range
// reduction (t = n + g, |g| <= 1/2, degree-6 polynomial in g ln 2, scalef), 1 / (1 + e) by rcp14
// and one Newton step; t clamped to 64 (tanh 1 to float precision, and +inf stays finite there).
// About 17 vector operations a lane group (0.32 ns a score on an AMD EPYC Zen 4 core, about what
// exp_shift_sum costs), against 25 with exp512 and a divide; about 2e-7 absolute in tanh.
__attribute__((target("avx512f"))) void softcap_avx512(float* x, int64_t n, float cap, float* t) {
  const __m512 k = _mm512_set1_ps(2.f * kLog2e / cap), ln2 = _mm512_set1_ps(0.693147180559945f);
  const __m512 vcap = _mm512_set1_ps(cap), two_cap = _mm512_set1_ps(2.f * cap);
  const __m512 one = _mm512_set1_ps(1.f), two = _mm512_set1_ps(2.f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    const __mmask16 live = _mm512_mask_cmp_ps_mask(m, v, _mm512_set1_ps(-INFINITY), _CMP_GT_OQ);
    const __m512 tt = _mm512_min_ps(_mm512_mul_ps(v, k), _mm512_set1_ps(64.f));  // +inf: 2^64
    const __m512 nn = _mm512_roundscale_ps(tt, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(tt, nn), ln2);
    __m512 p = _mm512_set1_ps(kC[6]);
    for (int c = 5; c >= 0; --c)
      p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kC[c]));
    const __m512 den = _mm512_add_ps(one, _mm512_scalef_ps(p, nn));
    __m512 r = _mm512_rcp14_ps(den);
    r = _mm512_mul_ps(r, _mm512_fnmadd_ps(den, r, two));
    _mm512_mask_storeu_ps(x + i, live, _mm512_fnmadd_ps(two_cap, r, vcap));  // cap (1 - 2r)
    if (t)
      _mm512_mask_storeu_ps(t + i, m, _mm512_maskz_mov_ps(live, _mm512_fnmadd_ps(two, r, one)));
  }
}

// AVX2 + FMA: 8 lanes, no masked loads (the tail goes to the portable loop) and no scalef
// (2^n built from the exponent bits; n >= -126 here, so 2^n is a normal float).
__attribute__((target("avx2,fma"))) __m256 exp256(__m256 x) {
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(kExpLow), _CMP_GE_OQ);
  const __m256 xc = _mm256_max_ps(x, _mm256_set1_ps(kExpLow));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), xc);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), f);
  __m256 p = _mm256_set1_ps(kC[6]);
  for (int i = 5; i >= 0; --i)
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kC[i]));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(keep, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

__attribute__((target("avx2,fma"))) float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

__attribute__((target("avx2,fma"))) float row_max_avx2(const float* x, int64_t n) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return std::fmax(_mm_cvtss_f32(h), row_max_portable(x + i, n - i));
}

__attribute__((target("avx2,fma"))) float exp_shift_sum_avx2(float* x, int64_t n, float m) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  return hsum256(acc) + exp_shift_sum_portable(x + i, n - i, m);
}

__attribute__((target("avx2,fma"))) void softcap_avx2(float* x, int64_t n, float cap, float* t) {
  const __m256 inv = _mm256_set1_ps(1.f / cap), vcap = _mm256_set1_ps(cap);
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 live = _mm256_cmp_ps(v, _mm256_set1_ps(-INFINITY), _CMP_GT_OQ);
    const __m256 y = _mm256_mul_ps(v, inv);
    const __m256 e = exp256(_mm256_mul_ps(_mm256_set1_ps(-2.f), _mm256_andnot_ps(sign, y)));
    __m256 th = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    th = _mm256_or_ps(th, _mm256_and_ps(sign, y));
    _mm256_storeu_ps(x + i, _mm256_blendv_ps(v, _mm256_mul_ps(vcap, th), live));
    if (t) _mm256_storeu_ps(t + i, _mm256_and_ps(live, th));
  }
  softcap_portable(x + i, n - i, cap, t ? t + i : nullptr);
}

const VecIsa kIsa = __builtin_cpu_supports("avx512f") ? VecIsa::avx512
                    : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
                        ? VecIsa::avx2
                        : VecIsa::portable;
#else
const VecIsa kIsa = VecIsa::portable;
#endif

}  // namespace

VecIsa vec_math_best_isa() {
  return kIsa;
}

const char* vec_isa_name(VecIsa isa) {
  switch (isa) {
    case VecIsa::avx512:
      return "avx512";
    case VecIsa::avx2:
      return "avx2";
    case VecIsa::portable:
      return "portable";
  }
  return "?";
}

const char* vec_math_isa() {
  return vec_isa_name(kIsa);
}

float row_max(VecIsa isa, const float* x, int64_t n) {
#if defined(__x86_64__)
  if (isa == VecIsa::avx512) return row_max_avx512(x, n);
  if (isa == VecIsa::avx2) return row_max_avx2(x, n);
#endif
  (void)isa;
  return row_max_portable(x, n);
}

float exp_shift_sum(VecIsa isa, float* x, int64_t n, float m) {
#if defined(__x86_64__)
  if (isa == VecIsa::avx512) return exp_shift_sum_avx512(x, n, m);
  if (isa == VecIsa::avx2) return exp_shift_sum_avx2(x, n, m);
#endif
  (void)isa;
  return exp_shift_sum_portable(x, n, m);
}

void split_bf16(VecIsa isa, const float* x, int64_t n, uint16_t* hi, uint16_t* lo) {
#if defined(__x86_64__)
  static const bool bf16 = __builtin_cpu_supports("avx512bf16");
  if (isa == VecIsa::avx512 && bf16) return split_bf16_avx512bf16(x, n, hi, lo);
#endif
  (void)isa;
  split_bf16_portable(x, n, hi, lo);
}

float row_max(const float* x, int64_t n) {
  return row_max(kIsa, x, n);
}
void split_bf16(const float* x, int64_t n, uint16_t* hi, uint16_t* lo) {
  split_bf16(kIsa, x, n, hi, lo);
}
float exp_shift_sum(float* x, int64_t n, float m) {
  return exp_shift_sum(kIsa, x, n, m);
}

void softcap_row(VecIsa isa, float* x, int64_t n, float cap, float* t) {
#if defined(__x86_64__)
  if (isa == VecIsa::avx512) return softcap_avx512(x, n, cap, t);
  if (isa == VecIsa::avx2) return softcap_avx2(x, n, cap, t);
#endif
  (void)isa;
  softcap_portable(x, n, cap, t);
}
void softcap_row(float* x, int64_t n, float cap, float* t) {
  softcap_row(kIsa, x, n, cap, t);
}

void scale_row(float* x, int64_t n, float c) {
  for (int64_t i = 0; i < n; ++i)
    x[i] *= c;
}

}  // namespace dattn::cpu
