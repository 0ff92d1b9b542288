// Single-process tests of the softmax row operations (kernels/cpu/vec_math.h) on every
// instruction set this CPU runs (portable, AVX2, AVX-512), against double-precision exp:
// row lengths around the vector widths, -inf entries (masked scores), very negative values.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kernels/cpu/vec_math.h"
#include "src/base/dtype.h"

namespace dattn::cpu {
namespace {

std::vector<VecIsa> runnable_isas() {
  std::vector<VecIsa> isas;
  for (VecIsa isa : {VecIsa::portable, VecIsa::avx2, VecIsa::avx512})
    if (int(isa) <= int(vec_math_best_isa())) isas.push_back(isa);
  return isas;
}

// Scores of length n: a spread of values in [-30, 5], every 7th masked (-inf), one at -200.
std::vector<float> scores(int64_t n) {
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    x[size_t(i)] = i % 7 == 3 ? -INFINITY : i == 5 ? -200.f : float((i * 37) % 71) * 0.5f - 30.f;
  return x;
}

TEST(VecMath, RowMaxOnEveryIsa) {
  for (VecIsa isa : runnable_isas()) {
    for (int64_t n : {0, 1, 7, 8, 9, 15, 16, 17, 33, 512}) {
      std::vector<float> x = scores(n);
      float expect = -INFINITY;
      for (float v : x)
        expect = std::fmax(expect, v);
      EXPECT_EQ(row_max(isa, x.data(), n), expect) << vec_isa_name(isa) << " n=" << n;
    }
    std::vector<float> masked(20, -INFINITY);
    EXPECT_EQ(row_max(isa, masked.data(), 20), -INFINITY) << vec_isa_name(isa);
  }
}

TEST(VecMath, ExpShiftSumOnEveryIsa) {
  for (VecIsa isa : runnable_isas()) {
    for (int64_t n : {1, 7, 8, 9, 15, 16, 17, 33, 512}) {
      std::vector<float> x = scores(n);
      const float m = row_max(VecIsa::portable, x.data(), n);
      std::vector<double> expect(static_cast<size_t>(n));
      double expect_sum = 0;
      for (int64_t i = 0; i < n; ++i)
        expect_sum += expect[size_t(i)] = std::exp(double(x[size_t(i)]) - double(m));
      const float sum = exp_shift_sum(isa, x.data(), n, m);
      for (int64_t i = 0; i < n; ++i) {
        const double e = expect[size_t(i)];
        if (e == 0 || e < 1e-37) {  // masked or below the range: exactly 0
          EXPECT_EQ(x[size_t(i)], 0.f) << vec_isa_name(isa) << " n=" << n << " i=" << i;
        } else {
          EXPECT_NEAR(x[size_t(i)], e, 4e-7 * e) << vec_isa_name(isa) << " n=" << n << " i=" << i;
        }
      }
      EXPECT_NEAR(sum, expect_sum, 1e-6 * expect_sum) << vec_isa_name(isa) << " n=" << n;
    }
  }
}

// P = hi + lo in bf16: hi is P rounded to nearest even, hi + lo within 2^-17 P (2^-126 for
// subnormal P), 0 stays 0 and a NaN stays NaN; every ISA gives the portable bits.
TEST(VecMath, SoftcapOnEveryIsa) {
  // cap * tanh(x / cap) within 3e-7 * cap (measured 2.1e-7; and tanh into t), -inf and NaN kept (t
  // = 0), +inf to the cap, tiny scores and the sign of -0 as tanh has them.
  for (VecIsa isa : runnable_isas()) {
    for (int64_t n : {1, 7, 8, 9, 15, 16, 17, 33, 512}) {
      for (float cap : {0.5f, 5.f, 50.f}) {
        std::vector<float> x = scores(n), t(size_t(n), 9.f);
        if (n > 9) x[9] = NAN, x[8] = INFINITY, x[4] = 1e-30f, x[2] = -0.f;
        const std::vector<float> in = x;
        softcap_row(isa, x.data(), n, cap, t.data());
        for (int64_t i = 0; i < n; ++i) {
          const float v = in[size_t(i)];
          const std::string at = std::string(vec_isa_name(isa)) + " n=" + std::to_string(n) +
                                 " cap=" + std::to_string(cap) + " i=" + std::to_string(i);
          if (std::isnan(v) || v == -INFINITY) {
            EXPECT_TRUE(std::isnan(v) ? std::isnan(x[size_t(i)]) : x[size_t(i)] == v) << at;
            EXPECT_EQ(t[size_t(i)], 0.f) << at;
            continue;
          }
          const double th = std::tanh(double(v) / cap);
          EXPECT_NEAR(t[size_t(i)], th, 3e-7) << at;
          EXPECT_NEAR(x[size_t(i)], cap * th, 3e-7 * cap) << at;
          EXPECT_LE(std::fabs(x[size_t(i)]), cap) << at;
        }
        std::vector<float> no_t = in;  // without t: the same scores
        softcap_row(isa, no_t.data(), n, cap);
        for (int64_t i = 0; i < n; ++i) {
          if (!std::isnan(in[size_t(i)])) {
            EXPECT_EQ(no_t[size_t(i)], x[size_t(i)]);
          }
        }
      }
    }
  }
}

TEST(VecMath, SplitBf16OnEveryIsa) {
  for (VecIsa isa : runnable_isas()) {
    for (int64_t n : {1, 15, 16, 17, 512}) {
      std::vector<float> x = scores(n);
      for (int64_t i = 0; i < n; ++i)  // probabilities: 0, tiny, near 1, 1
        x[size_t(i)] = i % 5 == 0 ? 0.f : std::exp(-std::fabs(x[size_t(i)]) * float(i % 7));
      x[size_t(n - 1)] = n > 1 ? 1.f : x[0];
      if (n > 3) x[2] = NAN;
      if (n > 16) x[3] = 1e-40f, x[4] = -3e-39f, x[6] = std::ldexp(1.f, -120) * 1.00390625f;
      // (denormals, and a normal value whose rest is denormal)
      const size_t len = static_cast<size_t>(n);
      std::vector<uint16_t> hi(len), lo(len), hi_p(len), lo_p(len);
      split_bf16(isa, x.data(), n, hi.data(), lo.data());
      split_bf16(VecIsa::portable, x.data(), n, hi_p.data(), lo_p.data());
      for (int64_t i = 0; i < n; ++i) {
        SCOPED_TRACE(testing::Message() << vec_isa_name(isa) << " n=" << n << " i=" << i);
        const size_t k = size_t(i);
        EXPECT_EQ(hi[k], hi_p[k]);
        EXPECT_EQ(lo[k], lo_p[k]);
        const double h = to_float(bf16{hi[k]}), l = to_float(bf16{lo[k]}), v = x[k];
        if (std::isnan(v)) {
          EXPECT_TRUE(std::isnan(h));
          continue;
        }
        if (std::fabs(v) >= std::ldexp(1.0, -126))
          EXPECT_EQ(to_bf16(x[k]).bits, hi[k]);  // the library's rounding
        else
          EXPECT_EQ(hi[k] & 0x7fff, 0) << "a denormal is taken as zero";
        // relative for normal values; below 2^-126 (P weights nothing there) absolute
        EXPECT_LE(std::fabs(h + l - v), std::ldexp(std::fabs(v), -17) + std::ldexp(1.0, -126));
      }
    }
  }
}

TEST(VecMath, BestIsaIsNamed) {
  EXPECT_STREQ(vec_math_isa(), vec_isa_name(vec_math_best_isa()));
}

}  // namespace
}  // namespace dattn::cpu
