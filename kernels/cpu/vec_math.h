// Row operations of the CPU kernel's softmax: max, exp-and-sum, scale. AVX-512 or AVX2 versions
// are picked at run time where the CPU has them; the portable version is plain C++.
#pragma once

#include <cstdint>

namespace dattn::cpu {

// Maximum of x[0..n) (-inf for an empty or all -inf row).
float row_max(const float* x, int64_t n);
// x[i] = exp(x[i] - m) in place (x[i] = -inf gives exactly 0); returns the sum. m is finite.
float exp_shift_sum(float* x, int64_t n, float m);
// x[i] *= c.
void scale_row(float* x, int64_t n, float c);
// Which implementation runs here: "avx512", "avx2" or "portable".
const char* vec_math_isa();

}  // namespace dattn::cpu
