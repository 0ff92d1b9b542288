// Softmax row operations: portable C++ and an AVX-512 version chosen once at run time.
// Measured on a Sapphire-Rapids-class core: GCC does not vectorise the portable max and
// exp-sum reductions (they stay scalar, ~40% of kernel time); the AVX-512 path makes them a
// few percent of the tile GEMMs.
#include "kernels/cpu/vec_math.h"

// GCC 12's AVX-512 headers start some intrinsics from _mm512_undefined_ps(), which its own
// -Wuninitialized then flags at every use; the values are never read.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
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

#if defined(__x86_64__)
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

const bool kHaveAvx512 = __builtin_cpu_supports("avx512f");
#else
const bool kHaveAvx512 = false;
#endif

}  // namespace

float row_max(const float* x, int64_t n) {
#if defined(__x86_64__)
  if (kHaveAvx512) return row_max_avx512(x, n);
#endif
  return row_max_portable(x, n);
}

float exp_shift_sum(float* x, int64_t n, float m) {
#if defined(__x86_64__)
  if (kHaveAvx512) return exp_shift_sum_avx512(x, n, m);
#endif
  return exp_shift_sum_portable(x, n, m);
}

void scale_row(float* x, int64_t n, float c) {
  for (int64_t i = 0; i < n; ++i)
    x[i] *= c;
}

const char* vec_math_isa() {
  return kHaveAvx512 ? "avx512" : "portable";
}

}  // namespace dattn::cpu
