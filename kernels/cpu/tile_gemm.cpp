// The CPU kernels' tile GEMMs: OpenBLAS sgemm, or oneDNN's matmul primitive (brgemm kernels)
// where the build has oneDNN, and the measurement that decides whether bf16 tiles pay here. A
// oneDNN primitive is made for one shape (sizes, leading dimensions, transposes, dtype, alpha,
// accumulate): each thread keeps the ones it made, so that a kernel call (a few tile shapes,
// thousands of tiles) makes them once and then only executes. Primitives run with a user scratchpad
// owned by the thread: oneDNN's library scratchpad is shared between primitives and not safe when
// several threads execute at once.
#include "kernels/cpu/tile_gemm.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <vector>

#include "src/base/error.h"

#if DATTN_WITH_ONEDNN
#include <oneapi/dnnl/dnnl_version.h>
#include <oneapi/dnnl/dnnl.hpp>

#include <map>
#include <memory>
#include <tuple>
#endif

namespace dattn::cpu {

namespace {

// -1: no path forced; else the GemmPath.
std::atomic<int> g_forced{-1};

void blas_gemm(int64_t M, int64_t N, int64_t K, float alpha, const GemmOperand& A,
               const GemmOperand& B, bool accumulate, float* C, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, A.trans ? CblasTrans : CblasNoTrans,
              B.trans ? CblasTrans : CblasNoTrans, int(M), int(N), int(K), alpha,
              static_cast<const float*>(A.ptr), int(A.ld), static_cast<const float*>(B.ptr),
              int(B.ld), accumulate ? 1.f : 0.f, C, int(ldc));
}

#if DATTN_WITH_ONEDNN

using dnnl::memory;
using Dt = memory::data_type;

dnnl::engine& engine() {
  static dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  return eng;
}

// The memory descriptor of a rows x cols operand (strides for row-major, or transposed).
memory::desc operand_desc(int64_t rows, int64_t cols, Dt dt, int64_t ld, bool trans) {
  return memory::desc({rows, cols}, dt, trans ? memory::dims{1, ld} : memory::dims{ld, 1});
}

dnnl::matmul::primitive_desc make_pd(Dt dt, int64_t M, int64_t N, int64_t K, float alpha,
                                     const GemmOperand& A, const GemmOperand& B, bool accumulate,
                                     int64_t ldc) {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (alpha != 1.f) attr.set_output_scales(0, {alpha});
  if (accumulate) {
    dnnl::post_ops po;
    po.append_sum(1.f);
    attr.set_post_ops(po);
  }
  const dnnl::matmul::desc d(operand_desc(M, K, dt, A.ld, A.trans),
                             operand_desc(K, N, dt, B.ld, B.trans),
                             memory::desc({M, N}, Dt::f32, memory::dims{ldc, 1}));
  return dnnl::matmul::primitive_desc(d, attr, engine());
}

// The key of a primitive: everything make_pd reads.
using Shape = std::tuple<int, int64_t, int64_t, int64_t, uint32_t, int64_t, bool, int64_t, bool,
                         bool, int64_t>;

struct Made {
  dnnl::matmul prim;
  memory::desc a, b, c, scratch;
};

// A thread's primitives and its scratchpad.
struct ThreadGemms {
  std::map<Shape, Made> made;
  std::vector<char> scratch;
  std::vector<float> sum;  // alpha A B of a bf16 tile added to C (see onednn_gemm)
  std::unique_ptr<dnnl::stream> stream;
};

ThreadGemms& thread_gemms() {
  thread_local ThreadGemms t;
  if (!t.stream) t.stream = std::make_unique<dnnl::stream>(engine());
  return t;
}

constexpr size_t kMaxPrimitives = 256;  // per thread; past it the cache starts over

void onednn_gemm(DType dtype, int64_t M, int64_t N, int64_t K, float alpha, const GemmOperand& A,
                 const GemmOperand& B, bool accumulate, float* C, int64_t ldc) {
  const Dt dt = dtype == DType::bf16 ? Dt::bf16 : Dt::f32;
  if (dt == Dt::bf16 && accumulate && (alpha != 1.f || A.trans)) {
    // oneDNN 2.6 runs bf16 tiles that add to C with an output scale (or a linear post-op) or with
    // A transposed on its jit gemm or reference code, not on brgemm: on AMX-BF16 8x slower than
    // alpha op(A) B into a buffer and a pass adding it to C (Xeon family 6 model 167, 256x512x128
    // and 512x256x128).
    std::vector<float>& tmp = thread_gemms().sum;
    tmp.resize(size_t(M * N));
    onednn_gemm(dtype, M, N, K, alpha, A, B, false, tmp.data(), N);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j)
        C[i * ldc + j] += tmp[size_t(i * N + j)];
    return;
  }
  uint32_t alpha_bits;
  std::memcpy(&alpha_bits, &alpha, sizeof alpha);
  const Shape key{int(dt), M, N, K, alpha_bits, A.ld, A.trans, B.ld, B.trans, accumulate, ldc};
  ThreadGemms& t = thread_gemms();
  auto it = t.made.find(key);
  if (it == t.made.end()) {
    if (t.made.size() >= kMaxPrimitives) t.made.clear();
    // oneDNN sizes a primitive's work split for the threads it sees when it is made
    // (omp_get_max_threads) and keeps that split when it runs; a split K would change the order
    // of the sums with the thread count. Made for one thread, the tile runs on the calling
    // thread alone and its bits do not depend on how many threads the kernel has.
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    try {
      const auto pd = make_pd(dt, M, N, K, alpha, A, B, accumulate, ldc);
      it = t.made
               .emplace(key, Made{dnnl::matmul(pd), pd.src_desc(), pd.weights_desc(), pd.dst_desc(),
                                  pd.scratchpad_desc()})
               .first;
    } catch (...) {
      omp_set_num_threads(threads);
      throw;
    }
    omp_set_num_threads(threads);
  }
  const Made& m = it->second;
  if (t.scratch.size() < m.scratch.get_size()) t.scratch.resize(m.scratch.get_size());
  dnnl::engine& eng = engine();
  memory a(m.a, eng, const_cast<void*>(A.ptr)), b(m.b, eng, const_cast<void*>(B.ptr));
  memory c(m.c, eng, C), s(m.scratch, eng, t.scratch.data());
  m.prim.execute(
      *t.stream,
      {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}, {DNNL_ARG_SCRATCHPAD, s}});
}

// The implementation oneDNN picks for a typical tile of dtype ("brg:avx512_core_bf16"), or ""
// when it is not a brgemm kernel (oneDNN 2.6 has those for AVX-512 and up; elsewhere it picks a
// jit sgemm or its reference code, which OpenBLAS matches or beats). Probed once per dtype.
const std::string& onednn_impl(DType dtype) {
  static std::once_flag once[2];
  static std::string impl[2];
  const int i = dtype == DType::bf16 ? 1 : 0;
  std::call_once(once[i], [&] {
    try {
      const GemmOperand a{nullptr, 128}, b{nullptr, 128, true};
      const auto pd = make_pd(i ? Dt::bf16 : Dt::f32, 256, 512, 128, 0.5f, a, b, true, 512);
      const std::string name = pd.impl_info_str();
      if (name.rfind("brg", 0) == 0) impl[i] = name;
    } catch (const dnnl::error&) {
      // no implementation at all: impl stays empty
    }
  });
  return impl[i];
}

// The measured rate of oneDNN's bf16 tiles over its fp32 ones (see bf16_tile_speedup), once.
double measure_bf16_speedup() {
  constexpr int64_t M = 256, N = 512, K = 128;  // the forward's Q K^T tile
  constexpr int kReps = 6;
  const std::vector<float> a(size_t(M * K), 0.5f), b(size_t(N * K), 0.25f);
  const std::vector<uint16_t> a16(a.size(), 0x3f00), b16(b.size(), 0x3e80);  // the same values
  std::vector<float> c(size_t(M * N));
  double best[2] = {1e30, 1e30};
  for (int dt = 0; dt < 2; ++dt) {
    const GemmOperand A{dt ? static_cast<const void*>(a16.data()) : a.data(), K};
    const GemmOperand B{dt ? static_cast<const void*>(b16.data()) : b.data(), K, true};
    const DType dtype = dt ? DType::bf16 : DType::f32;
    onednn_gemm(dtype, M, N, K, 1.f, A, B, false, c.data(), N);  // makes the primitive
    for (int rep = 0; rep < kReps; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      onednn_gemm(dtype, M, N, K, 1.f, A, B, false, c.data(), N);
      best[dt] = std::min(
          best[dt], std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  return best[0] / best[1];
}

#endif  // DATTN_WITH_ONEDNN

}  // namespace

double bf16_tile_speedup() {
#if DATTN_WITH_ONEDNN
  static std::once_flag once;
  static double speedup = 0;
  std::call_once(once, [] {
    if (!onednn_impl(DType::bf16).empty() && !onednn_impl(DType::f32).empty()) {
      try {
        speedup = measure_bf16_speedup();
      } catch (const dnnl::error&) {
        speedup = 0;  // bf16 tiles that fail to run are never picked
      }
    }
  });
  return speedup;
#else
  return 0;
#endif
}

bool bf16_tiles_pay() {
  return bf16_tile_speedup() >= kBf16TilesPay;
}

bool gemm_path_runs(GemmPath p, DType dtype) {
  if (dtype == DType::f16) return false;  // widened to fp32 by the kernels
  if (p == GemmPath::blas) return dtype == DType::f32;
#if DATTN_WITH_ONEDNN
  return !onednn_impl(dtype).empty();
#else
  return false;
#endif
}

GemmPath gemm_path(DType dtype) {
  const int forced = g_forced.load(std::memory_order_relaxed);
  if (forced >= 0)
    return gemm_path_runs(GemmPath(forced), dtype) ? GemmPath(forced) : GemmPath::blas;
  if (dtype == DType::bf16 && !bf16_tiles_pay()) return GemmPath::blas;
  return gemm_path_runs(GemmPath::onednn, dtype) ? GemmPath::onednn : GemmPath::blas;
}

void set_gemm_path(GemmPath p) {
  g_forced.store(int(p), std::memory_order_relaxed);
}

void reset_gemm_path() {
  g_forced.store(-1, std::memory_order_relaxed);
}

void tile_gemm(GemmPath p, DType dtype, int64_t M, int64_t N, int64_t K, float alpha,
               const GemmOperand& A, const GemmOperand& B, bool accumulate, float* C, int64_t ldc) {
  if (p == GemmPath::blas) {
    if (dtype != DType::f32)
      DATTN_THROW_KIND(ErrorKind::internal, "tile_gemm: the blas path takes fp32 operands, not ",
                       dtype_name(dtype));
    blas_gemm(M, N, K, alpha, A, B, accumulate, C, ldc);
    return;
  }
#if DATTN_WITH_ONEDNN
  try {
    onednn_gemm(dtype, M, N, K, alpha, A, B, accumulate, C, ldc);
  } catch (const dnnl::error& e) {
    DATTN_THROW_KIND(ErrorKind::internal, "oneDNN matmul ", M, "x", N, "x", K, " ",
                     dtype_name(dtype), " failed: ", e.what(), " (status ", int(e.status), ")");
  }
#else
  DATTN_THROW_KIND(ErrorKind::internal, "tile_gemm: this build has no oneDNN");
#endif
}

std::string gemm_info(DType dtype) {
  if (gemm_path(dtype) == GemmPath::blas) return "OpenBLAS sgemm";
#if DATTN_WITH_ONEDNN
  return detail::cat("oneDNN ", DNNL_VERSION_MAJOR, ".", DNNL_VERSION_MINOR, ".",
                     DNNL_VERSION_PATCH, " ", onednn_impl(dtype));
#else
  return "OpenBLAS sgemm";
#endif
}

}  // namespace dattn::cpu
