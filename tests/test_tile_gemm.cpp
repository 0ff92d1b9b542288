// The CPU kernels' tile GEMMs (kernels/cpu/tile_gemm.h) on every path this build and CPU run,
// against a float64 product: both transposes, leading dimensions wider than the rows, alpha,
// accumulation, fp32 and bf16 operands, edge shapes. A path that does not run here reports
// SKIPPED with the reason.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/tile_gemm.h"
#include "src/base/dtype.h"
#include "src/base/error.h"

namespace dattn {
namespace {

using cpu::GemmPath;

struct GemmCase {
  int64_t M, N, K;
  bool trans_a, trans_b, accumulate;
  float alpha;
};

// A rows x cols operand stored with leading dimension ld (>= its stored row length), values
// exact in bf16 so that both dtypes multiply the same numbers.
struct Operand {
  int64_t rows, cols, ld;
  bool trans;
  std::vector<float> f32;
  std::vector<uint16_t> b16;
  Operand(int64_t r, int64_t c, bool t, std::mt19937& rng) : rows(r), cols(c), trans(t) {
    const int64_t stored_rows = t ? c : r, stored_cols = t ? r : c;
    ld = stored_cols + 3;
    f32.assign(size_t(stored_rows * ld), NAN);  // the padding must never be read
    b16.assign(f32.size(), 0x7fc0);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (int64_t i = 0; i < stored_rows; ++i)
      for (int64_t j = 0; j < stored_cols; ++j) {
        const bf16 v = to_bf16(u(rng));
        f32[size_t(i * ld + j)] = to_float(v);
        b16[size_t(i * ld + j)] = v.bits;
      }
  }
  double at(int64_t i, int64_t j) const {  // element (i, j) of the rows x cols matrix
    return trans ? f32[size_t(j * ld + i)] : f32[size_t(i * ld + j)];
  }
  cpu::GemmOperand op(DType dt) const {
    return {dt == DType::bf16 ? static_cast<const void*>(b16.data()) : f32.data(), ld, trans};
  }
};

void check_path(GemmPath p, DType dt) {
  std::mt19937 rng(7);
  const GemmCase cases[] = {
      {1, 1, 1, false, false, false, 1.f},      {256, 512, 128, false, true, false, 0.088f},
      {256, 128, 512, false, false, true, 1.f}, {37, 53, 29, true, false, true, 0.5f},
      {512, 128, 256, true, false, true, 1.f},  {3, 200, 7, false, true, true, -2.f}};
  for (const GemmCase& c : cases) {
    SCOPED_TRACE(testing::Message() << c.M << "x" << c.N << "x" << c.K << " ta " << c.trans_a
                                    << " tb " << c.trans_b << " acc " << c.accumulate);
    const Operand A(c.M, c.K, c.trans_a, rng), B(c.K, c.N, c.trans_b, rng);
    const int64_t ldc = c.N + 5;
    std::vector<float> C(size_t(c.M * ldc));
    for (float& x : C)
      x = std::uniform_real_distribution<float>(-1.f, 1.f)(rng);
    const std::vector<float> C0 = C;
    cpu::tile_gemm(p, dt, c.M, c.N, c.K, c.alpha, A.op(dt), B.op(dt), c.accumulate, C.data(), ldc);
    for (int64_t i = 0; i < c.M; ++i)
      for (int64_t j = 0; j < ldc; ++j) {
        const size_t at = size_t(i * ldc + j);
        if (j >= c.N) {  // outside C's columns: untouched
          ASSERT_EQ(C[at], C0[at]) << "wrote past column N at (" << i << ", " << j << ")";
          continue;
        }
        double ref = 0, mag = 0;
        for (int64_t k = 0; k < c.K; ++k) {
          ref += A.at(i, k) * B.at(k, j);
          mag += std::fabs(A.at(i, k) * B.at(k, j));
        }
        ref = c.alpha * ref + (c.accumulate ? C0[at] : 0.0);
        // fp32 accumulation: a few ulp of the sum of magnitudes
        const double tol = 1e-6 * (std::fabs(c.alpha) * mag + std::fabs(C0[at])) + 1e-30;
        ASSERT_NEAR(C[at], ref, tol) << "at (" << i << ", " << j << ")";
      }
  }
}

TEST(TileGemm, BlasFp32) {
  ASSERT_TRUE(cpu::gemm_path_runs(GemmPath::blas, DType::f32));
  check_path(GemmPath::blas, DType::f32);
}

TEST(TileGemm, OnednnFp32) {
  if (!cpu::gemm_path_runs(GemmPath::onednn, DType::f32))
    GTEST_SKIP() << "no oneDNN brgemm fp32 kernel here (no oneDNN in this build, or no AVX-512)";
  check_path(GemmPath::onednn, DType::f32);
}

TEST(TileGemm, OnednnBf16) {
  if (!cpu::gemm_path_runs(GemmPath::onednn, DType::bf16))
    GTEST_SKIP() << "no oneDNN brgemm bf16 kernel here (no oneDNN in this build, or neither "
                    "AVX512-BF16 nor AMX-BF16)";
  check_path(GemmPath::onednn, DType::bf16);
}

// The dispatch: the fastest path that runs (bf16 tiles only where they measure faster than
// widening), forced paths where they run and blas elsewhere, never a path for fp16 operands
// (the kernels widen them).
TEST(TileGemm, Dispatch) {
  const bool onednn_f32 = cpu::gemm_path_runs(GemmPath::onednn, DType::f32);
  const bool onednn_bf16 = cpu::gemm_path_runs(GemmPath::onednn, DType::bf16);
  EXPECT_FALSE(cpu::gemm_path_runs(GemmPath::blas, DType::bf16));
  EXPECT_FALSE(cpu::gemm_path_runs(GemmPath::onednn, DType::f16));
  EXPECT_EQ(cpu::gemm_path(DType::f32), onednn_f32 ? GemmPath::onednn : GemmPath::blas);
  const double speedup = cpu::bf16_tile_speedup();
  EXPECT_EQ(speedup > 0, onednn_bf16 && onednn_f32) << speedup;
  EXPECT_EQ(cpu::bf16_tiles_pay(), speedup >= cpu::kBf16TilesPay);
  EXPECT_EQ(cpu::gemm_path(DType::bf16),
            onednn_bf16 && cpu::bf16_tiles_pay() ? GemmPath::onednn : GemmPath::blas);
  if (onednn_bf16) {  // forced, the bf16 tiles run wherever they can (the tests force each path)
    cpu::set_gemm_path(GemmPath::onednn);
    EXPECT_EQ(cpu::gemm_path(DType::bf16), GemmPath::onednn);
  }
  cpu::set_gemm_path(GemmPath::blas);
  EXPECT_EQ(cpu::gemm_path(DType::f32), GemmPath::blas);
  EXPECT_EQ(cpu::gemm_path(DType::bf16), GemmPath::blas);
  cpu::reset_gemm_path();
  EXPECT_NE(cpu::gemm_info(DType::f32).find(onednn_f32 ? "oneDNN" : "OpenBLAS"), std::string::npos)
      << cpu::gemm_info(DType::f32);
}

// A bad call names what is wrong.
TEST(TileGemm, BlasRejectsBf16) {
  const float x = 1.f;
  float c = 0;
  EXPECT_THROW(
      cpu::tile_gemm(GemmPath::blas, DType::bf16, 1, 1, 1, 1.f, {&x, 1}, {&x, 1}, false, &c, 1),
      Error);
}

}  // namespace
}  // namespace dattn
