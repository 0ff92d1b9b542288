// The tile GEMMs of the CPU attention kernels, on the calling thread: C = alpha op(A) op(B)
// (+ C), A and B fp32 or bf16, C fp32, row-major with leading dimensions. Two paths:
//   blas    OpenBLAS's sgemm (fp32 operands only): every build, every CPU;
//   onednn  oneDNN's matmul primitive, whose brgemm kernels run fp32 on AVX-512 and bf16 on
//           AVX512-BF16 or AMX-BF16 (2x the fp32 rate per instruction on the first, more on the
//           second), accumulating in fp32. Built where CMake finds oneDNN (Debian's libdnnl-dev;
//           DATTN_WITH_ONEDNN), used where this CPU has a brgemm kernel for the dtype (bf16:
//           and where it measures faster than widening, bf16_tiles_pay).
// Measured on one core, 256x512x128 and 256x128x512 tiles: AMD EPYC Zen 4, OpenBLAS sgemm 95-98
// GFLOP/s, oneDNN fp32 110-113, oneDNN bf16 213-216; Intel Xeon family 6 model 207 (Emerald
// Rapids, AVX512-BF16, AMX not exposed to the VM), oneDNN fp32 191-195, bf16 88-94: there
// VDPBF16PS does no more multiply-adds a cycle than two fp32 FMA ports, and bf16 tiles lose;
// Intel Xeon family 6 model 167 (AMX-BF16 exposed), OpenBLAS 162-170, oneDNN fp32 172-200, bf16
// 680-1360 on dense operands (see tile_gemm.cpp for the shapes that leave brgemm).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "src/base/dtype.h"

namespace dattn::cpu {

enum class GemmPath { blas, onednn };

// Whether this build and CPU run dtype's operands (f32 or bf16) on path p at its full speed:
// blas for f32 only; onednn when built with it and oneDNN picks a brgemm kernel here for the
// dtype (probed once; AVX-512 and up).
bool gemm_path_runs(GemmPath p, DType dtype);

// oneDNN's bf16 tile rate over its fp32 one on this CPU (a 256x512x128 tile, one thread, best
// of 6 runs each, measured once: a few ms); 0 where either does not run.
double bf16_tile_speedup();
// The kernels' bf16 path runs three bf16 tile GEMMs (Q K^T, P_hi V, P_lo V) where the widened
// one runs two fp32 ones: bf16 tiles pay where bf16_tile_speedup() >= kBf16TilesPay. The
// CPUs measured sit far either side (Zen 4 1.9, AMX 3.3-3.7, Emerald Rapids without AMX 0.46), so
// noise does not flip the choice.
inline constexpr double kBf16TilesPay = 1.5;
bool bf16_tiles_pay();

// The path the kernels use for dtype's operands: the fastest that runs (onednn, then blas; for
// bf16, onednn only where bf16_tiles_pay), or under set_gemm_path the forced path where it runs
// the dtype and blas where not. For bf16 and fp16, blas means "widen to fp32, then
// gemm_path(f32)".
GemmPath gemm_path(DType dtype);
// Forces the path (tests run each in turn). Not thread-safe against running kernels.
void set_gemm_path(GemmPath p);
void reset_gemm_path();

// One operand: rows x cols of dtype at ptr with leading dimension ld, transposed when trans
// (then ptr holds the cols x rows matrix).
struct GemmOperand {
  const void* ptr;
  int64_t ld;
  bool trans = false;
};

// C[M, N] = alpha * A[M, K] B[K, N] (+ C when accumulate) on path p (which must run dtype).
// Throws dattn::Error when oneDNN fails: a caller inside an OpenMP region catches it there and
// rethrows after the region.
void tile_gemm(GemmPath p, DType dtype, int64_t M, int64_t N, int64_t K, float alpha,
               const GemmOperand& A, const GemmOperand& B, bool accumulate, float* C, int64_t ldc);

// rows x cols elements from src (leading dimension ld) into dst, dense (leading dimension cols):
// oneDNN's brgemm kernels take only dense operands (tile_gemm.cpp), and a head's rows in a bshd
// tensor are strided by the other heads.
template <class T>
void copy_dense(const T* src, int64_t ld, int64_t rows, int64_t cols, T* dst) {
  for (int64_t r = 0; r < rows; ++r)
    std::copy(src + r * ld, src + r * ld + cols, dst + r * cols);
}

// "oneDNN 2.6.3 brg:avx512_core_bf16" for the header lines: the implementation dtype's tiles run
// on, or "OpenBLAS sgemm".
std::string gemm_info(DType dtype);

}  // namespace dattn::cpu
