// Row operations of the CPU kernel's softmax: max, exp-and-sum, scale. AVX-512 or AVX2 versions
// are picked at run time where the CPU has them; the portable version is plain C++.
#pragma once

#include <cstdint>

namespace dattn::cpu {

// The instruction sets the row operations exist for, best last.
enum class VecIsa { portable, avx2, avx512 };
// The best one this CPU runs (what the kernel uses).
VecIsa vec_math_best_isa();
const char* vec_isa_name(VecIsa isa);

// Maximum of x[0..n) (-inf for an empty or all -inf row).
float row_max(const float* x, int64_t n);
// x[i] = exp(x[i] - m) in place (x[i] = -inf gives exactly 0); returns the sum. m is finite.
float exp_shift_sum(float* x, int64_t n, float m);
// x[i] *= c.
void scale_row(float* x, int64_t n, float c);
// Logit softcap in place: x[i] = cap * tanh(x[i] / cap) (cap > 0), -inf (a masked score) and NaN
// unchanged; with t, t[i] = tanh(x[i] / cap) (0 where x[i] was kept), the backward's derivative
// 1 - t^2. About 2e-7 absolute in tanh.
void softcap_row(float* x, int64_t n, float cap, float* t = nullptr);
// x[i] = hi[i] + lo[i] in bf16 bits: hi[i] is x[i] rounded to bf16 (to nearest even), lo[i] the
// rest rounded, so hi + lo is within 2^-17 |x[i]| (2^-126 below the normal range: a denormal x
// or rest counts as zero, as AVX512-BF16's conversion takes it). x finite or quiet NaN (NaN stays
// NaN). Every ISA gives the same bits.
void split_bf16(const float* x, int64_t n, uint16_t* hi, uint16_t* lo);
// Which implementation runs here: vec_isa_name(vec_math_best_isa()).
const char* vec_math_isa();

// The same operations on an explicit instruction set, which must be <= vec_math_best_isa():
// tests compare every path the CPU can run.
float row_max(VecIsa isa, const float* x, int64_t n);
float exp_shift_sum(VecIsa isa, float* x, int64_t n, float m);
// avx512: AVX512-BF16's conversions where the CPU has them, else (and on AVX2) portable.
void split_bf16(VecIsa isa, const float* x, int64_t n, uint16_t* hi, uint16_t* lo);
void softcap_row(VecIsa isa, float* x, int64_t n, float cap, float* t = nullptr);

}  // namespace dattn::cpu
