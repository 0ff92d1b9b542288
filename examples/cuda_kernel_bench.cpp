// dattn-cuda-kernel-bench: the CUDA attention forward (kernels/cuda) against cuBLAS's bf16 GEMM
// on one GPU: cuBLAS TFLOP/s, the kernel's TFLOP/s causal and not, their ratio against the
// target (0.40); the backward's TFLOP/s against the forward's (target 0.5, reported, not part of
// the summary while the backward is the correctness-first kernel); and the split-KV decode
// kernel's bandwidth (K/V bytes streamed / time) against
// the device's copy bandwidth measured in the same run (target 0.70). A #wrong column comes from
// small checks against the float64 CPU reference. Needs neither MPI nor Boost (a bare GPU
// machine's core-only build has it); exits 77 without GPU.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/reference.h"
#include "kernels/cuda/attention_backward_cuda.h"
#include "kernels/cuda/attention_cuda.h"
#include "kernels/cuda/decode_cuda.h"
#include "kernels/cuda/device_buffer.h"
#include "src/base/cuda_check.h"
#include "src/base/dtype.h"
#include "src/base/error.h"
#include "src/base/spec.h"
#include "src/base/tensor.h"

namespace {

using dattn::DType;
using dattn::cuda::DeviceBuffer;
using dattn::detail::cat;

#define BENCH_CUBLAS_CHECK(call)                                              \
  do {                                                                        \
    const cublasStatus_t st_ = (call);                                        \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                         \
      DATTN_THROW("cuBLAS call failed: ", #call, ": status ", int(st_), " (", \
                  cublasGetStatusString(st_), ")");                           \
  } while (0)

constexpr double kTarget = 0.40;         // kernel TFLOP/s / cuBLAS bf16 GEMM TFLOP/s
constexpr double kDecodeTarget = 0.70;   // decode GB/s / device copy GB/s
constexpr double kBackwardTarget = 0.5;  // backward TFLOP/s / the forward's (causal)
constexpr int64_t kDecodeHeads = 8;      // the decode rows' query heads, on 1, 2 and 8 kv heads
constexpr int64_t kDecodeKvHeads[] = {1, 2, 8};

// ================================================================== options
// A table and a plain loop rather than Boost.Program_options, which a bare GPU machine's
// core-only build does not have. Each option: -fN, -f N, --name N or --name=N.

struct Options {
  int64_t seq = 16384, heads = 16, head_dim = 128, iters = 10, warmup = 3, gemm_n = 8192;
  int64_t check_seq = 300, context = 262144;
  int64_t backward_seq = 4096;  // the backward row's S, shorter: the first backward is slow
  std::string json;
};

struct Option {
  const char* name;
  char flag;
  int64_t* value;  // an integer in [min, max]; null: the text itself, into *text
  int64_t min, max;
  const char* help;
  std::string* text = nullptr;
};

std::vector<Option> option_table(Options& o) {
  constexpr int64_t kMax = INT64_MAX;
  return {
      {"seq", 's', &o.seq, 1, kMax, "sequence length S"},
      {"heads", 'H', &o.heads, 1, kMax, "heads (heads_kv = heads)"},
      {"head-dim", 'd', &o.head_dim, 1, 256, "head dimension D = D_v, 1 to 256"},
      {"iters", 'n', &o.iters, 1, INT32_MAX, "timed iterations"},
      {"warmup", 'w', &o.warmup, 0, INT32_MAX, "untimed warm-up iterations"},
      {"gemm-n", 'g', &o.gemm_n, 16, kMax, "cuBLAS GEMM size n (n x n x n)"},
      {"check-seq", 'c', &o.check_seq, 1, kMax,
       "S of the correctness check vs the float64 reference"},
      {"context", 'x', &o.context, 0, kMax, "decode rows' context (H=8, H_kv 1, 2, 8; 0: none)"},
      {"backward-seq", 'b', &o.backward_seq, 0, kMax, "S of the backward row (0: none)"},
      {"json", 'J', nullptr, 0, 0, "also write the rows as JSON to FILE", &o.json}};
}

// Returns false when --help or --version was answered.
bool parse_options(int argc, char** argv, Options& o) {
  const std::vector<Option> table = option_table(o);
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i], value;  // value: given in the same word (-s16384, --seq=16384)
    const bool long_form = arg.rfind("--", 0) == 0;
    const size_t eq = long_form ? arg.find('=') : arg.size() > 2 && arg[0] == '-' ? 2 : arg.npos;
    if (eq != arg.npos) value = arg.substr(eq + long_form), arg.resize(eq);
    if (arg == "-h" || arg == "--help" || arg == "-V" || arg == "--version") {
      if (arg == "-V" || arg == "--version") {
        std::printf("dattn-cuda-kernel-bench %s\n", DATTN_VERSION);
        return false;
      }
      std::printf(
          "dattn-cuda-kernel-bench: the CUDA attention forward (bf16, B=1) vs cuBLAS bf16 GEMM,\n"
          "and the decode kernel's bandwidth vs the device's copy bandwidth\noptions\n");
      for (const Option& t : table)
        std::printf("  -%c, %-14s %s%s\n", t.flag,
                    cat("--", t.name, t.value ? " N" : " FILE").c_str(), t.help,
                    t.value ? cat(" (default ", *t.value, ")").c_str() : "");
      std::printf("  -h, --help         print this help\n  -V, --version      print the version\n");
      return false;
    }
    const auto t = std::find_if(table.begin(), table.end(), [&](const Option& t) {
      return arg == cat("--", t.name) || arg == cat("-", t.flag);
    });
    if (t == table.end()) DATTN_THROW("unknown option '", argv[i], "' (see --help)");
    if (eq == arg.npos) {
      if (i + 1 == argc) DATTN_THROW("option ", arg, " needs a value");
      value = argv[++i];
    }
    if (!t->value) {
      *t->text = value;
      continue;
    }
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(value, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != value.size() || value.empty() || v < t->min || v > t->max)
      DATTN_THROW("invalid --", t->name, " = '", value, "': expected an integer >= ", t->min,
                  t->max < INT32_MAX ? " and <= " + std::to_string(t->max) : "");
    *t->value = v;
  }
  return true;
}

// ================================================================== helpers

// Uniform values in [-1, 1), a pure function of (seed, i).
float uniform(uint64_t seed, uint64_t i) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + i + 1;
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return float(x >> 40) * 0x1p-23f - 1.0f;
}

std::vector<uint16_t> random_bf16(size_t n, uint64_t seed) {
  std::vector<uint16_t> h(n);
  for (size_t i = 0; i < n; ++i)
    h[i] = dattn::to_bf16(uniform(seed, i)).bits;
  return h;
}

// CUDA events around each timed iteration after the warm-up: the best and the mean (ms).
struct Timing {
  double best_ms = 0, mean_ms = 0;
};

template <typename F>
Timing time_it(const Options& o, F&& run) {
  for (int i = 0; i < int(o.warmup); ++i)
    run();
  cudaEvent_t start, stop;
  DATTN_CUDA_CHECK(cudaEventCreate(&start));
  DATTN_CUDA_CHECK(cudaEventCreate(&stop));
  double best = 1e300, total = 0;
  for (int i = 0; i < int(o.iters); ++i) {
    DATTN_CUDA_CHECK(cudaEventRecord(start));
    run();
    DATTN_CUDA_CHECK(cudaEventRecord(stop));
    DATTN_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    DATTN_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    best = std::min(best, double(ms));
    total += ms;
  }
  DATTN_CUDA_CHECK(cudaEventDestroy(stop));
  DATTN_CUDA_CHECK(cudaEventDestroy(start));
  return {best, total / double(o.iters)};
}

// ================================================================== measurements

Timing time_cublas(const Options& o) {
  const int n = int(o.gemm_n);
  const size_t elems = size_t(o.gemm_n * o.gemm_n);
  DeviceBuffer a(random_bf16(elems, 1).data(), elems * 2),
      b(random_bf16(elems, 2).data(), elems * 2);
  DeviceBuffer c(elems * 2);
  cublasHandle_t handle;
  BENCH_CUBLAS_CHECK(cublasCreate(&handle));
  const float alpha = 1.f, beta = 0.f;
  const Timing t = time_it(o, [&] {
    BENCH_CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a.get(),
                                    CUDA_R_16BF, n, b.get(), CUDA_R_16BF, n, &beta, c.get(),
                                    CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  });
  BENCH_CUBLAS_CHECK(cublasDestroy(handle));
  return t;
}

// The forward's block over [1, S, H_q or H_kv, D] bf16 q, k, v, D_v = D, scale 1/sqrt(D).
dattn::cuda::AttentionBlock block(const void* q, const void* k, const void* v, int64_t S,
                                  int64_t Hq, int64_t Hkv, int64_t D, bool causal) {
  dattn::cuda::AttentionBlock blk;
  blk.q = q, blk.k = k, blk.v = v;
  blk.dtype = DType::bf16;
  blk.batch = 1;
  blk.seq_q = blk.seq_k = S;
  blk.heads_q = Hq, blk.heads_kv = Hkv;
  blk.head_dim = blk.head_dim_v = D;
  blk.scale = 1.f / std::sqrt(float(D));
  dattn::cuda::set_mask(blk, causal ? dattn::Mask::causal() : dattn::Mask::none());
  return blk;
}

// The forward on [1, S, H, D] bf16 q, k, v (heads_kv = H), best and mean of the iterations.
// Every iteration merges into the same partial (reset once): the same work as a fresh one.
Timing time_attention(const Options& o, bool causal) {
  const size_t elems = size_t(o.seq * o.heads * o.head_dim);
  DeviceBuffer q(random_bf16(elems, 11).data(), elems * 2);
  DeviceBuffer k(random_bf16(elems, 12).data(), elems * 2);
  DeviceBuffer v(random_bf16(elems, 13).data(), elems * 2);
  const std::vector<float> lse0(size_t(o.heads * o.seq), -INFINITY);
  DeviceBuffer out(elems * 4), lse(lse0.data(), lse0.size() * 4);
  DATTN_CUDA_CHECK(cudaMemset(out.get(), 0, elems * 4));
  const dattn::cuda::AttentionBlock blk =
      block(q.get(), k.get(), v.get(), o.seq, o.heads, o.heads, o.head_dim, causal);
  return time_it(
      o, [&] { dattn::cuda::attention_forward(blk, out.get<float>(), lse.get<float>(), nullptr); });
}

// The backward on the same problem, causal or not: delta, then dq, dk and dv (accumulated into
// the same buffers each iteration: the same work as fresh ones), from one forward's out and lse.
Timing time_backward(const Options& o, bool causal) {
  const int64_t S = o.backward_seq;
  const size_t elems = size_t(S * o.heads * o.head_dim);
  DeviceBuffer q(random_bf16(elems, 11).data(), elems * 2);
  DeviceBuffer k(random_bf16(elems, 12).data(), elems * 2);
  DeviceBuffer v(random_bf16(elems, 13).data(), elems * 2);
  DeviceBuffer dout(random_bf16(elems, 14).data(), elems * 2);
  const std::vector<float> lse0(size_t(o.heads * S), -INFINITY);
  DeviceBuffer out(elems * 4), lse(lse0.data(), lse0.size() * 4), delta(lse0.size() * 4);
  DeviceBuffer dq(elems * 4), dk(elems * 4), dv(elems * 4);
  for (DeviceBuffer* b : {&out, &dq, &dk, &dv})
    DATTN_CUDA_CHECK(cudaMemset(b->get(), 0, b->bytes()));
  const dattn::cuda::AttentionBlock blk =
      block(q.get(), k.get(), v.get(), S, o.heads, o.heads, o.head_dim, causal);
  dattn::cuda::attention_forward(blk, out.get<float>(), lse.get<float>(), nullptr);
  return time_it(o, [&] {
    dattn::cuda::attention_backward_delta(dout.get(), DType::bf16, out.get<float>(), 1, S, o.heads,
                                          o.head_dim, delta.get<float>(), nullptr);
    dattn::cuda::attention_backward(blk, dout.get(), DType::bf16, lse.get<float>(),
                                    delta.get<float>(), dq.get<float>(), dk.get<float>(),
                                    dv.get<float>(), nullptr);
  });
}

// A check of one kernel: Sq queries at positions q_pos0.. on Sk keys, Hq query heads on Hkv kv
// heads, D = head_dim, bf16, against the float64 reference: the elements of out and lse over
// tests/gpu/test_cuda_attention.cpp's bf16 tolerance of the forward. decode: the split-KV decode
// kernel, else the forward.
int64_t check_kernel(const Options& o, int64_t Sq, int64_t Sk, int64_t q_pos0, int64_t Hq,
                     int64_t Hkv, bool causal, bool decode) {
  const int64_t D = o.head_dim;
  const dattn::AttnSpec spec{.heads_q = Hq,
                             .heads_kv = Hkv,
                             .head_dim = D,
                             .mask = causal ? dattn::Mask::causal() : dattn::Mask::none()};
  dattn::Tensor q = dattn::Tensor::empty({1, Sq, Hq, D}, DType::bf16);
  dattn::Tensor k = dattn::Tensor::empty({1, Sk, Hkv, D}, DType::bf16);
  dattn::Tensor v = dattn::Tensor::empty({1, Sk, Hkv, D}, DType::bf16);
  for (auto [t, seed, scale] : {std::tuple{&q, 21, 2.f}, {&k, 22, 2.f}, {&v, 23, 1.f}})
    for (int64_t i = 0; i < t->numel(); ++i)
      t->set(i, scale * uniform(uint64_t(seed), uint64_t(i)));
  DeviceBuffer dq(q.data(), q.nbytes()), dk(k.data(), k.nbytes()), dv(v.data(), v.nbytes());
  std::vector<float> h_out(size_t(Sq * Hq * D), 0.f), h_lse(size_t(Hq * Sq), -INFINITY);
  DeviceBuffer out(h_out.data(), h_out.size() * 4), lse(h_lse.data(), h_lse.size() * 4);
  dattn::cuda::AttentionBlock blk = block(dq.get(), dk.get(), dv.get(), Sk, Hq, Hkv, D, causal);
  blk.seq_q = Sq;
  blk.q_pos0 = q_pos0;
  (decode ? dattn::cuda::decode_forward : dattn::cuda::attention_forward)(
      blk, out.get<float>(), lse.get<float>(), nullptr);
  DATTN_CUDA_CHECK(cudaDeviceSynchronize());
  out.download(h_out.data());
  lse.download(h_lse.data());
  const dattn::cpu::ReferenceResult ref = dattn::cpu::attention_reference(q, k, v, spec, q_pos0, 0);
  int64_t wrong = 0;
  for (int64_t h = 0; h < Hq; ++h)
    for (int64_t s = 0; s < Sq; ++s) {
      const double rl = ref.lse[size_t(h * Sq + s)], gl = h_lse[size_t(h * Sq + s)];
      if (!(std::fabs(gl - rl) <= 1e-4 + 1e-4 * std::fabs(rl))) ++wrong;
      const double grow = 1 + std::fabs(rl) / 16;
      for (int64_t d = 0; d < D; ++d) {
        const size_t i = size_t((s * Hq + h) * D + d);
        const double r = ref.out[i];
        if (!(std::fabs(double(h_out[i]) - r) <= (1e-2 + 1e-2 * std::fabs(r)) * grow)) ++wrong;
      }
    }
  return wrong;
}

// The device's copy bandwidth: cudaMemcpy device to device of 1 GiB; read and write bytes
// counted (2 GiB per copy), GB/s from the best iteration.
Timing time_copy(const Options& o) {
  const size_t bytes = size_t(1) << 30;
  DeviceBuffer src(bytes), dst(bytes);
  DATTN_CUDA_CHECK(cudaMemset(src.get(), 0x3c, bytes));
  return time_it(o, [&] {
    DATTN_CUDA_CHECK(cudaMemcpy(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice));
  });
}

// One decode step per iteration: a query after `context` keys of bf16 K and V [1, context, hkv,
// D] (causal: it sees them all), merged into one partial. The cache's values are a constant
// (cudaMemset; the kernel's time does not depend on them; check_kernel checks the numbers).
Timing time_decode(const Options& o, int64_t hkv) {
  const int64_t D = o.head_dim;
  const size_t kv_bytes = size_t(o.context * hkv * D) * 2;
  DeviceBuffer q(random_bf16(size_t(kDecodeHeads * D), 31).data(), size_t(kDecodeHeads * D) * 2);
  DeviceBuffer k(kv_bytes), v(kv_bytes), out(size_t(kDecodeHeads * D) * 4);
  const std::vector<float> lse0(size_t(kDecodeHeads), -INFINITY);
  DeviceBuffer lse(lse0.data(), lse0.size() * 4);
  DATTN_CUDA_CHECK(cudaMemset(k.get(), 0x3c, kv_bytes));
  DATTN_CUDA_CHECK(cudaMemset(v.get(), 0x3c, kv_bytes));
  DATTN_CUDA_CHECK(cudaMemset(out.get(), 0, out.bytes()));
  dattn::cuda::AttentionBlock blk =
      block(q.get(), k.get(), v.get(), o.context, kDecodeHeads, hkv, D, true);
  blk.seq_q = 1;
  blk.q_pos0 = o.context;
  return time_it(
      o, [&] { dattn::cuda::decode_forward(blk, out.get<float>(), lse.get<float>(), nullptr); });
}

// ================================================================== report

std::string fixed(double v, int precision) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", precision, v);
  return buf;
}

// One line of a table, '#' (heading) or ' ' (a row) first: section, problem, best, mean, rate,
// then the decode table's ratio, then #wrong.
void print_line(char lead, const std::vector<std::string>& c) {
  std::printf("%c %-14s %-36s %10s %10s %9s", lead, c[0].c_str(), c[1].c_str(), c[2].c_str(),
              c[3].c_str(), c[4].c_str());
  for (size_t i = 5; i < c.size(); ++i)
    std::printf(" %7s", c[i].c_str());
  std::printf("\n");
}

// A row of either table and its JSON.
struct Row {
  Row(std::string s, std::string p) : section(std::move(s)), problem(std::move(p)) {}
  std::string section, problem;
  Timing t;
  double rate = 0;     // TFLOP/s (forward table) or GB/s (decode table), from the best time
  double ratio = -1;   // the decode rows': rate / the copy bandwidth; < 0: none
  int64_t wrong = -1;  // < 0: no check
  std::string json;    // device_check.sh pairs rows named dattn* with torch's SDPA rows
  std::vector<std::string> cells(bool decode_table) const {
    std::vector<std::string> c = {section, problem, fixed(t.best_ms, 3), fixed(t.mean_ms, 3),
                                  fixed(rate, 1)};
    if (decode_table) c.push_back(ratio < 0 ? "-" : fixed(ratio, 3));
    c.push_back(wrong < 0 ? "-" : std::to_string(wrong));
    return c;
  }
};

std::string json_row(const char* name, bool causal, int64_t seq, int64_t heads, int64_t head_dim,
                     const Row& r) {
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "{\"name\": \"%s\", \"dtype\": \"bf16\", \"causal\": %s, \"seq\": %lld, "
                "\"heads\": %lld, \"head_dim\": %lld, \"time_ms\": %.6g, \"mean_ms\": %.6g, "
                "\"tflops\": %.6g, \"wrong\": %lld}",
                name, causal ? "true" : "false", static_cast<long long>(seq),
                static_cast<long long>(heads), static_cast<long long>(head_dim), r.t.best_ms,
                r.t.mean_ms, r.rate, static_cast<long long>(r.wrong));
  return buf;
}

std::string json_decode_row(const Options& o, int64_t hkv, const Row& r) {
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "{\"name\": \"decode_hkv%lld\", \"dtype\": \"bf16\", \"context\": %lld, "
                "\"heads\": %lld, \"heads_kv\": %lld, \"head_dim\": %lld, \"seq_q\": 1, "
                "\"time_ms\": %.6g, \"mean_ms\": %.6g, \"gbps\": %.6g, \"ratio\": %.6g, "
                "\"wrong\": %lld}",
                static_cast<long long>(hkv), static_cast<long long>(o.context),
                static_cast<long long>(kDecodeHeads), static_cast<long long>(hkv),
                static_cast<long long>(o.head_dim), r.t.best_ms, r.t.mean_ms, r.rate, r.ratio,
                static_cast<long long>(r.wrong));
  return buf;
}

int run(int argc, char** argv) {
  Options o;
  if (!parse_options(argc, argv, o)) return 0;

  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    std::printf("dattn-cuda-kernel-bench: SKIPPED: no usable GPU (cudaGetDeviceCount: %s)\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
    return 77;
  }
  int dev = 0;
  DATTN_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  DATTN_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  char host[256] = "?";
  gethostname(host, sizeof host - 1);
  // The decode kernel's scratch comes from the device's stream-ordered pool on every call. By
  // default the pool hands freed memory back to the driver at every synchronisation (release
  // threshold 0), and each timed iteration synchronises: the next call would map memory again.
  // A decode loop keeps its memory; so does this benchmark.
  cudaMemPool_t pool;
  DATTN_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
  uint64_t keep = UINT64_MAX;
  DATTN_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));

  // ---------------------------------------------------------------- header
  std::printf("# dattn CUDA kernel benchmark, version %s\n", DATTN_VERSION);
  std::printf("# %s\n",
              cat("seq ", o.seq, " heads ", o.heads, " kv-heads ", o.heads, " head-dim ",
                  o.head_dim, " dtype bf16 batch 1 iters ", o.iters, " warmup ", o.warmup,
                  " gemm-n ", o.gemm_n, " check-seq ", o.check_seq, " context ", o.context,
                  " kernel ", dattn::cuda::kernel_variant(DType::bf16, o.head_dim, o.head_dim))
                  .c_str());
  std::printf("# memory pool: release threshold UINT64_MAX (freed memory kept between calls)\n");
  std::printf("# DATTN_WITH_CUDA=%d DATTN_WITH_NCCL=%d\n#\n# Using devices\n", DATTN_WITH_CUDA,
              DATTN_WITH_NCCL);
  std::printf("#  Rank  0 Pid %6d on %10s device cuda:%d %s (sm_%d%d, %d SMs, %.0f GiB)\n#\n",
              int(getpid()), host, dev, prop.name, prop.major, prop.minor, prop.multiProcessorCount,
              double(prop.totalGlobalMem) / (1u << 30));
  std::fflush(stdout);

  // ---------------------------------------------------------------- measurements
  // (a) cuBLAS, (b) and (c) the forward causal and not: TFLOP/s from the best time.
  std::vector<Row> rows;
  const double n = double(o.gemm_n);
  Row& g = rows.emplace_back("(a) cublas", cat(o.gemm_n, "^3 bf16 GEMM, fp32 compute"));
  g.t = time_cublas(o);
  g.rate = 2.0 * n * n * n / (g.t.best_ms * 1e-3) / 1e12;
  g.json = json_row("cublas_gemm_bf16", false, o.gemm_n, 1, o.gemm_n, g);
  for (bool causal : {true, false}) {
    Row& r = rows.emplace_back(
        causal ? "(b) causal" : "(c) noncausal",
        cat("B=1 H=", o.heads, " S=", o.seq, " D=", o.head_dim, causal ? " causal" : " none"));
    // The forward's check: S = check_seq, H = 2 query heads on 1 kv head (GQA).
    r.wrong = check_kernel(o, o.check_seq, o.check_seq, 0, 2, 1, causal, false);
    r.t = time_attention(o, causal);
    const double flops = 4.0 * double(o.heads) * double(o.seq) * double(o.seq) * double(o.head_dim);
    r.rate = (causal ? flops / 2 : flops) / (r.t.best_ms * 1e-3) / 1e12;
    r.json = json_row(causal ? "dattn_forward_causal" : "dattn_forward_noncausal", causal, o.seq,
                      o.heads, o.head_dim, r);
  }
  // (l) the backward, causal, at S = backward_seq: 2.5x the forward's FLOPs (five S^2 D products
  // to its two), as flash attention counts them, against the forward's rate (b).
  double ratio_backward = -1;
  if (o.backward_seq > 0) {
    const int64_t S = o.backward_seq;
    Row& r = rows.emplace_back("(l) backward",
                               cat("B=1 H=", o.heads, " S=", S, " D=", o.head_dim, " causal"));
    r.t = time_backward(o, true);
    const double flops = 2.5 * 2.0 * double(o.heads) * double(S) * double(S) * double(o.head_dim);
    r.rate = flops / (r.t.best_ms * 1e-3) / 1e12;
    r.json = json_row("backward_causal", true, S, o.heads, o.head_dim, r);
    ratio_backward = r.rate / rows[1].rate;
  }
  // Decode: (g) the device's copy bandwidth, then one row per kv head count: GB/s of the K and V
  // bytes streamed per step, against (g).
  std::vector<Row> decode_rows;
  double decode_ratio = 0;  // the lowest over the rows
  if (o.context > 0) {
    Row& c = decode_rows.emplace_back("(g) copy", "1 GiB cudaMemcpy D2D, read + write");
    c.t = time_copy(o);
    c.rate = 2.0 * double(size_t(1) << 30) / (c.t.best_ms * 1e-3) / 1e9;
    decode_ratio = 1e300;
    char section = 'h';
    for (int64_t hkv : kDecodeKvHeads) {
      Row& d = decode_rows.emplace_back(
          cat("(", section++, ") decode"),
          cat("H=", kDecodeHeads, " H_kv=", hkv, " S_k=", o.context, " D=", o.head_dim, " S_q=1"));
      // One query after 5003 keys: several splits, a partial last tile.
      d.wrong = check_kernel(o, 1, 5003, 5003, kDecodeHeads, hkv, true, true);
      d.t = time_decode(o, hkv);
      d.rate = 2.0 * double(o.context * hkv * o.head_dim * 2) / (d.t.best_ms * 1e-3) / 1e9;
      d.ratio = d.rate / decode_rows.front().rate;
      d.json = json_decode_row(o, hkv, d);
      decode_ratio = std::min(decode_ratio, d.ratio);
    }
  }

  // ---------------------------------------------------------------- table and footer
  print_line('#', {"section", "problem", "best", "mean", "TFLOP/s", "#wrong"});
  print_line('#', {"", "", "(ms)", "(ms)", "", ""});
  for (const Row& r : rows)
    print_line(' ', r.cells(false));
  int64_t wrong = rows[1].wrong + rows[2].wrong;
  if (o.context > 0) {
    std::printf("#\n");
    print_line('#', {"section", "problem", "best", "mean", "GB/s", "ratio", "#wrong"});
    print_line('#', {"", "", "(ms)", "(ms)", "", "to (g)", ""});
    for (const Row& d : decode_rows) {
      print_line(' ', d.cells(true));
      wrong += std::max<int64_t>(d.wrong, 0);
    }
  }
  const double ratio_causal = rows[1].rate / rows[0].rate;
  const double ratio_full = rows[2].rate / rows[0].rate;
  const bool decode_pass = o.context == 0 || decode_ratio >= kDecodeTarget;
  const bool pass = ratio_causal >= kTarget && ratio_full >= kTarget && decode_pass;
  const auto verdict = [](const char* label, double v, double target, const char* note) {
    std::printf("# %-26s: %s (%starget >= %.2f) %s\n", label, fixed(v, 3).c_str(), note, target,
                v >= target ? "PASS" : "FAIL");
  };
  std::printf(
      "# FLOPs: attention 4 B H S^2 D (halved for causal); GEMM 2 n^3; TFLOP/s from best\n");
  verdict("(d) causal / cuBLAS", ratio_causal, kTarget, "");
  verdict("(e) noncausal / cuBLAS", ratio_full, kTarget, "");
  if (ratio_backward >= 0) verdict("(m) backward / forward", ratio_backward, kBackwardTarget, "");
  if (o.context > 0) {
    std::printf(
        "# decode bytes: K + V of the cache (2 S_k H_kv D bf16) per step; GB/s from best\n");
    verdict("(k) decode / copy", decode_ratio, kDecodeTarget, "lowest over H_kv; ");
  }
  std::printf(
      "# %-26s: %lld elements over tolerance (forward S=%lld, decode S_k=5003 checks vs "
      "float64) %s\n",
      "(f) correctness", static_cast<long long>(wrong), static_cast<long long>(o.check_seq),
      wrong == 0 ? "PASS" : "FAIL");
  std::printf("# %-26s: %s\n", "summary", pass && wrong == 0 ? "PASS" : "FAIL");
  std::fflush(stdout);

  if (!o.json.empty()) {
    const auto list = [](const std::vector<Row>& rs) {
      std::string s;
      for (const Row& r : rs)
        if (!r.json.empty()) s += (s.empty() ? "" : ", ") + r.json;
      return "[" + s + "]";
    };
    const double copy_gbps = decode_rows.empty() ? 0 : decode_rows.front().rate;
    std::ofstream f(o.json);
    f << "{\"program\": \"dattn-cuda-kernel-bench\", \"version\": \"" << DATTN_VERSION
      << "\", \"device\": \"" << prop.name << "\", \"rows\": " << list(rows)
      << ", \"decode_rows\": " << list(decode_rows) << ", \"copy_gbps\": " << fixed(copy_gbps, 3)
      << ", \"decode_ratio\": " << fixed(decode_ratio, 6)
      << ", \"decode_target\": " << fixed(kDecodeTarget, 2)
      << ", \"ratio_causal\": " << fixed(ratio_causal, 6)
      << ", \"ratio_noncausal\": " << fixed(ratio_full, 6) << ", \"target\": " << fixed(kTarget, 2)
      << ", \"ratio_backward_over_forward\": " << fixed(ratio_backward, 6)
      << ", \"backward_target\": " << fixed(kBackwardTarget, 2) << ", \"wrong\": " << wrong
      << ", \"pass\": " << (pass && wrong == 0 ? "true" : "false") << "}\n";
    if (!f) DATTN_THROW("cannot write --json file '", o.json, "'");
  }
  return wrong == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dattn-cuda-kernel-bench: error: %s\n", e.what());
    return 1;
  }
}
