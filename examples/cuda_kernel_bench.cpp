// dattn-cuda-kernel-bench: the CUDA attention forward (kernels/cuda) against cuBLAS's bf16 GEMM
// on one GPU: cuBLAS TFLOP/s, the kernel's TFLOP/s causal and not, their ratio against the
// target (0.40); and the split-KV decode kernel's bandwidth (K/V bytes streamed / time) against
// the device's copy bandwidth measured in the same run (target 0.70). A #wrong column comes from
// small checks against the float64 CPU reference. Needs neither MPI nor Boost (a bare GPU
// machine's core-only build has it); exits 77 without GPU.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <getopt.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/reference.h"
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

#define BENCH_CUBLAS_CHECK(call)                                              \
  do {                                                                        \
    const cublasStatus_t st_ = (call);                                        \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                         \
      DATTN_THROW("cuBLAS call failed: ", #call, ": status ", int(st_), " (", \
                  cublasGetStatusString(st_), ")");                           \
  } while (0)

constexpr double kTarget = 0.40;        // kernel TFLOP/s / cuBLAS bf16 GEMM TFLOP/s
constexpr double kDecodeTarget = 0.70;  // decode GB/s / device copy GB/s
constexpr int64_t kDecodeHeads = 8;     // the decode rows' query heads, on 1, 2 and 8 kv heads
constexpr int64_t kDecodeKvHeads[] = {1, 2, 8};

// ================================================================== options
// getopt_long rather than Boost.Program_options, which a bare GPU machine's core-only build does
// not have.

struct Options {
  int64_t seq = 16384, heads = 16, head_dim = 128, iters = 10, warmup = 3, gemm_n = 8192;
  int64_t check_seq = 300, context = 262144;
  std::string json;
};

// An integer option: -flag N / --name N, in [min, max].
struct IntOption {
  const char* name;
  char flag;
  int64_t* value;
  int64_t min, max;
  const char* help;
};

std::vector<IntOption> int_options(Options& o) {
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
      {"context", 'x', &o.context, 0, kMax, "decode rows' context (H=8, H_kv 1, 2, 8; 0: none)"}};
}

void print_help() {
  Options d;
  std::printf(
      "dattn-cuda-kernel-bench: the CUDA attention forward (bf16, B=1) vs cuBLAS bf16 GEMM,\n"
      "and the decode kernel's bandwidth vs the device's copy bandwidth\n"
      "options\n");
  for (const IntOption& i : int_options(d))
    std::printf("  -%c, %-14s %s (default %lld)\n", i.flag,
                ("--" + std::string(i.name) + " N").c_str(), i.help,
                static_cast<long long>(*i.value));
  std::printf(
      "  -J, --json FILE    also write the rows as JSON to FILE\n"
      "  -h, --help         print this help\n"
      "  -V, --version      print the version\n");
}

int64_t parse_int(const IntOption& opt, const std::string& text) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || text.empty() || v < opt.min || v > opt.max)
    DATTN_THROW("invalid --", opt.name, " = '", text, "': expected an integer >= ", opt.min,
                opt.max < INT32_MAX ? " and <= " + std::to_string(opt.max) : "");
  return v;
}

// Returns false when --help or --version was answered. getopt_long (the C library's) gives the
// short and long forms, "--opt v" and "--opt=v", and unambiguous prefixes.
bool parse_options(int argc, char** argv, Options& o) {
  const std::vector<IntOption> ints = int_options(o);
  std::vector<option> longs;
  std::string shorts = ":J:hV";
  for (const IntOption& i : ints) {
    longs.push_back({i.name, required_argument, nullptr, i.flag});
    shorts += {i.flag, ':'};
  }
  longs.push_back({"json", required_argument, nullptr, 'J'});
  longs.push_back({"help", no_argument, nullptr, 'h'});
  longs.push_back({"version", no_argument, nullptr, 'V'});
  longs.push_back({nullptr, 0, nullptr, 0});
  opterr = 0;  // errors are thrown below, naming the option
  optind = 1;
  int c = 0, at = 1;
  while ((c = getopt_long(argc, argv, shorts.c_str(), longs.data(), nullptr)) != -1) {
    const std::string arg = at < argc ? argv[at] : "";
    at = optind;
    const auto i =
        std::find_if(ints.begin(), ints.end(), [&](const IntOption& x) { return x.flag == c; });
    if (i != ints.end()) {
      *i->value = parse_int(*i, optarg);
    } else if (c == 'h' || c == 'V') {
      if (c == 'h')
        print_help();
      else
        std::printf("dattn-cuda-kernel-bench %s\n", DATTN_VERSION);
      return false;
    } else if (c == 'J') {
      o.json = optarg;
    } else if (c == ':') {
      DATTN_THROW("option ", arg, " needs a value");
    } else {
      DATTN_THROW("unknown option '", arg, "' (see --help)");
    }
  }
  if (optind < argc) DATTN_THROW("unexpected argument '", argv[optind], "' (see --help)");
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
Timing time_it(int warmup, int iters, F&& run) {
  for (int i = 0; i < warmup; ++i)
    run();
  cudaEvent_t start, stop;
  DATTN_CUDA_CHECK(cudaEventCreate(&start));
  DATTN_CUDA_CHECK(cudaEventCreate(&stop));
  double best = 1e300, total = 0;
  for (int i = 0; i < iters; ++i) {
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
  return {best, total / iters};
}

// ================================================================== measurements

double time_cublas(const Options& o, Timing* t) {
  const int64_t n = o.gemm_n;
  const size_t elems = size_t(n * n);
  DeviceBuffer a(elems * 2), b(elems * 2), c(elems * 2);
  a.upload(random_bf16(elems, 1).data());
  b.upload(random_bf16(elems, 2).data());
  cublasHandle_t handle;
  BENCH_CUBLAS_CHECK(cublasCreate(&handle));
  const float alpha = 1.f, beta = 0.f;
  *t = time_it(int(o.warmup), int(o.iters), [&] {
    BENCH_CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, int(n), int(n), int(n),
                                    &alpha, a.get(), CUDA_R_16BF, int(n), b.get(), CUDA_R_16BF,
                                    int(n), &beta, c.get(), CUDA_R_16BF, int(n), CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT));
  });
  BENCH_CUBLAS_CHECK(cublasDestroy(handle));
  return 2.0 * double(n) * double(n) * double(n) / (t->best_ms * 1e-3) / 1e12;
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

double attention_flops(const Options& o, bool causal) {
  const double f = 4.0 * double(o.heads) * double(o.seq) * double(o.seq) * double(o.head_dim);
  return causal ? f / 2 : f;
}

// The forward on [1, S, H, D] bf16 q, k, v (heads_kv = H), best and mean of the iterations.
// Every iteration merges into the same partial (reset once): the same work as a fresh one.
double time_attention(const Options& o, bool causal, Timing* t) {
  const size_t elems = size_t(o.seq * o.heads * o.head_dim);
  DeviceBuffer q(elems * 2), k(elems * 2), v(elems * 2);
  DeviceBuffer out(elems * 4), lse(size_t(o.heads * o.seq) * 4);
  q.upload(random_bf16(elems, 11).data());
  k.upload(random_bf16(elems, 12).data());
  v.upload(random_bf16(elems, 13).data());
  DATTN_CUDA_CHECK(cudaMemset(out.get(), 0, elems * 4));
  lse.upload(std::vector<float>(size_t(o.heads * o.seq), -INFINITY).data());
  const dattn::cuda::AttentionBlock blk =
      block(q.get(), k.get(), v.get(), o.seq, o.heads, o.heads, o.head_dim, causal);
  *t = time_it(int(o.warmup), int(o.iters), [&] {
    dattn::cuda::attention_forward(blk, out.get<float>(), lse.get<float>(), nullptr);
  });
  return attention_flops(o, causal) / (t->best_ms * 1e-3) / 1e12;
}

// Elements of a [1, S, Hq, D] partial (out and lse) that differ from the float64 reference by more
// than tests/gpu/test_cuda_attention.cpp's bf16 tolerance of the forward.
int64_t count_wrong(const std::vector<float>& h_out, const std::vector<float>& h_lse,
                    const dattn::cpu::ReferenceResult& ref, int64_t S, int64_t Hq, int64_t D) {
  int64_t wrong = 0;
  for (int64_t h = 0; h < Hq; ++h)
    for (int64_t s = 0; s < S; ++s) {
      const double rl = ref.lse[size_t(h * S + s)], gl = h_lse[size_t(h * S + s)];
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

// A check of one kernel: Sq queries at positions Sk.. (after the keys, causal: each sees every
// key) on Sk keys, Hq query heads on Hkv kv heads, D = head_dim, bf16, against the float64
// reference; `attend` runs the kernel on the block and the device partial (out, lse).
template <typename Attend>
int64_t check_kernel(const Options& o, int64_t Sq, int64_t Sk, int64_t q_pos0, int64_t Hq,
                     int64_t Hkv, bool causal, Attend&& attend) {
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
  DeviceBuffer dq(q.nbytes()), dk(k.nbytes()), dv(v.nbytes());
  dq.upload(q.data());
  dk.upload(k.data());
  dv.upload(v.data());
  std::vector<float> h_out(size_t(Sq * Hq * D), 0.f), h_lse(size_t(Hq * Sq), -INFINITY);
  DeviceBuffer out(h_out.size() * 4), lse(h_lse.size() * 4);
  out.upload(h_out.data());
  lse.upload(h_lse.data());
  dattn::cuda::AttentionBlock blk = block(dq.get(), dk.get(), dv.get(), Sk, Hq, Hkv, D, causal);
  blk.seq_q = Sq;
  blk.q_pos0 = q_pos0;
  attend(blk, out.get<float>(), lse.get<float>());
  DATTN_CUDA_CHECK(cudaDeviceSynchronize());
  out.download(h_out.data());
  lse.download(h_lse.data());
  return count_wrong(h_out, h_lse, dattn::cpu::attention_reference(q, k, v, spec, q_pos0, 0), Sq,
                     Hq, D);
}

// The forward's check: S = check_seq, H = 2 query heads on 1 kv head (GQA).
int64_t check_attention(const Options& o, bool causal) {
  return check_kernel(o, o.check_seq, o.check_seq, 0, 2, 1, causal,
                      [](const dattn::cuda::AttentionBlock& b, float* out, float* lse) {
                        dattn::cuda::attention_forward(b, out, lse, nullptr);
                      });
}

// The decode kernel's check: one query after 5003 keys (several splits, a partial last tile),
// kDecodeHeads query heads on hkv kv heads.
int64_t check_decode(const Options& o, int64_t hkv) {
  return check_kernel(o, 1, 5003, 5003, kDecodeHeads, hkv, true,
                      [](const dattn::cuda::AttentionBlock& b, float* out, float* lse) {
                        dattn::cuda::decode_forward(b, out, lse, nullptr);
                      });
}

// The device's copy bandwidth: cudaMemcpy device to device of 1 GiB; read and write bytes
// counted (2 GiB per copy), GB/s from the best iteration.
double copy_bandwidth(const Options& o, Timing* t) {
  const size_t bytes = size_t(1) << 30;
  DeviceBuffer src(bytes), dst(bytes);
  DATTN_CUDA_CHECK(cudaMemset(src.get(), 0x3c, bytes));
  *t = time_it(int(o.warmup), int(o.iters), [&] {
    DATTN_CUDA_CHECK(cudaMemcpy(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice));
  });
  return 2.0 * double(bytes) / (t->best_ms * 1e-3) / 1e9;
}

// One decode step per iteration: a query after `context` keys of bf16 K and V [1, context, hkv,
// D] (causal: it sees them all), merged into one partial. The cache's values are a constant
// (cudaMemset; the kernel's time does not depend on them; check_decode checks the numbers). GB/s:
// the K and V bytes streamed, from the best iteration.
double time_decode(const Options& o, int64_t hkv, Timing* t) {
  const int64_t D = o.head_dim;
  const size_t kv_bytes = size_t(o.context * hkv * D) * 2;
  DeviceBuffer q(size_t(kDecodeHeads * D) * 2), k(kv_bytes), v(kv_bytes);
  DeviceBuffer out(size_t(kDecodeHeads * D) * 4), lse(size_t(kDecodeHeads) * 4);
  q.upload(random_bf16(size_t(kDecodeHeads * D), 31).data());
  DATTN_CUDA_CHECK(cudaMemset(k.get(), 0x3c, kv_bytes));
  DATTN_CUDA_CHECK(cudaMemset(v.get(), 0x3c, kv_bytes));
  DATTN_CUDA_CHECK(cudaMemset(out.get(), 0, out.bytes()));
  lse.upload(std::vector<float>(size_t(kDecodeHeads), -INFINITY).data());
  dattn::cuda::AttentionBlock blk =
      block(q.get(), k.get(), v.get(), o.context, kDecodeHeads, hkv, D, true);
  blk.seq_q = 1;
  blk.q_pos0 = o.context;
  *t = time_it(int(o.warmup), int(o.iters), [&] {
    dattn::cuda::decode_forward(blk, out.get<float>(), lse.get<float>(), nullptr);
  });
  return 2.0 * double(kv_bytes) / (t->best_ms * 1e-3) / 1e9;
}

// ================================================================== report

std::string fixed(double v, int precision) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", precision, v);
  return buf;
}

struct Row {
  std::string name, problem;
  std::string json_name;  // device_check.sh pairs rows named dattn* with torch's SDPA rows
  bool causal = false;
  int64_t seq = 0;
  Timing t;
  double tflops = 0;
  int64_t wrong = -1;  // < 0: no check
};

void print_row(const Row& r) {
  std::printf(" %-14s %-36s %10s %10s %9s %7s\n", r.name.c_str(), r.problem.c_str(),
              fixed(r.t.best_ms, 3).c_str(), fixed(r.t.mean_ms, 3).c_str(),
              fixed(r.tflops, 1).c_str(), r.wrong < 0 ? "-" : std::to_string(r.wrong).c_str());
}

std::string json_row(const Row& r, const Options& o, bool gemm) {
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "{\"name\": \"%s\", \"dtype\": \"bf16\", \"causal\": %s, \"seq\": %lld, "
                "\"heads\": %lld, \"head_dim\": %lld, \"time_ms\": %.6g, \"mean_ms\": %.6g, "
                "\"tflops\": %.6g, \"wrong\": %lld}",
                r.json_name.c_str(), r.causal ? "true" : "false",
                static_cast<long long>(gemm ? o.gemm_n : o.seq),
                static_cast<long long>(gemm ? 1 : o.heads),
                static_cast<long long>(gemm ? o.gemm_n : o.head_dim), r.t.best_ms, r.t.mean_ms,
                r.tflops, static_cast<long long>(r.wrong));
  return buf;
}

// A decode row: one step on heads_kv kv heads.
struct DecodeRow {
  int64_t heads_kv = 0;
  Timing t;
  double gbps = 0, ratio = 0;  // ratio: to the copy bandwidth
  int64_t wrong = 0;
};

std::string json_decode_row(const DecodeRow& d, const Options& o) {
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "{\"name\": \"decode_hkv%lld\", \"dtype\": \"bf16\", \"context\": %lld, "
                "\"heads\": %lld, \"heads_kv\": %lld, \"head_dim\": %lld, \"seq_q\": 1, "
                "\"time_ms\": %.6g, \"mean_ms\": %.6g, \"gbps\": %.6g, \"ratio\": %.6g, "
                "\"wrong\": %lld}",
                static_cast<long long>(d.heads_kv), static_cast<long long>(o.context),
                static_cast<long long>(kDecodeHeads), static_cast<long long>(d.heads_kv),
                static_cast<long long>(o.head_dim), d.t.best_ms, d.t.mean_ms, d.gbps, d.ratio,
                static_cast<long long>(d.wrong));
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
              dattn::detail::cat("seq ", o.seq, " heads ", o.heads, " kv-heads ", o.heads,
                                 " head-dim ", o.head_dim, " dtype bf16 batch 1 iters ", o.iters,
                                 " warmup ", o.warmup, " gemm-n ", o.gemm_n, " check-seq ",
                                 o.check_seq, " context ", o.context, " kernel ",
                                 dattn::cuda::kernel_variant(DType::bf16, o.head_dim, o.head_dim))
                  .c_str());
  std::printf("# memory pool: release threshold UINT64_MAX (freed memory kept between calls)\n");
  std::printf("# DATTN_WITH_CUDA=%d DATTN_WITH_NCCL=%d\n#\n# Using devices\n", DATTN_WITH_CUDA,
              DATTN_WITH_NCCL);
  std::printf("#  Rank  0 Pid %6d on %10s device cuda:%d %s (sm_%d%d, %d SMs, %.0f GiB)\n#\n",
              int(getpid()), host, dev, prop.name, prop.major, prop.minor, prop.multiProcessorCount,
              double(prop.totalGlobalMem) / (1u << 30));
  std::fflush(stdout);

  // ---------------------------------------------------------------- measurements
  std::vector<Row> rows;
  Row g;
  g.name = "(a) cublas";
  g.json_name = "cublas_gemm_bf16";
  g.problem = std::to_string(o.gemm_n) + "^3 bf16 GEMM, fp32 compute";
  g.seq = o.gemm_n;
  g.tflops = time_cublas(o, &g.t);
  rows.push_back(g);
  for (bool causal : {true, false}) {
    Row r;
    r.name = causal ? "(b) causal" : "(c) noncausal";
    r.json_name = causal ? "dattn_forward_causal" : "dattn_forward_noncausal";
    r.problem = "B=1 H=" + std::to_string(o.heads) + " S=" + std::to_string(o.seq) +
                " D=" + std::to_string(o.head_dim) + (causal ? " causal" : " none");
    r.causal = causal;
    r.seq = o.seq;
    r.wrong = check_attention(o, causal);
    r.tflops = time_attention(o, causal, &r.t);
    rows.push_back(r);
  }
  // Decode: the device's copy bandwidth, then one row per kv head count.
  std::vector<DecodeRow> decode_rows;
  Timing copy_t;
  const double copy_gbps = o.context > 0 ? copy_bandwidth(o, &copy_t) : 0;
  for (int64_t hkv : kDecodeKvHeads) {
    if (o.context == 0) break;
    DecodeRow d;
    d.heads_kv = hkv;
    d.wrong = check_decode(o, hkv);
    d.gbps = time_decode(o, hkv, &d.t);
    d.ratio = d.gbps / copy_gbps;
    decode_rows.push_back(d);
  }

  // ---------------------------------------------------------------- table and footer
  std::printf("# %-14s %-36s %10s %10s %9s %7s\n", "section", "problem", "best", "mean", "TFLOP/s",
              "#wrong");
  std::printf("# %-14s %-36s %10s %10s %9s %7s\n", "", "", "(ms)", "(ms)", "", "");
  for (const Row& r : rows)
    print_row(r);
  double decode_ratio = decode_rows.empty() ? 0 : 1e300;  // the lowest over the rows
  int64_t wrong = rows[1].wrong + rows[2].wrong;
  if (o.context > 0) {
    std::printf("#\n# %-14s %-36s %10s %10s %9s %7s %7s\n", "section", "problem", "best", "mean",
                "GB/s", "ratio", "#wrong");
    std::printf("# %-14s %-36s %10s %10s %9s %7s %7s\n", "", "", "(ms)", "(ms)", "", "to (g)", "");
    std::printf(" %-14s %-36s %10s %10s %9s %7s %7s\n", "(g) copy",
                "1 GiB cudaMemcpy D2D, read + write", fixed(copy_t.best_ms, 3).c_str(),
                fixed(copy_t.mean_ms, 3).c_str(), fixed(copy_gbps, 1).c_str(), "-", "-");
    char section = 'h';
    for (const DecodeRow& d : decode_rows) {
      const std::string name = std::string("(") + section++ + ") decode";
      const std::string problem =
          dattn::detail::cat("H=", kDecodeHeads, " H_kv=", d.heads_kv, " S_k=", o.context,
                             " D=", o.head_dim, " S_q=1");
      std::printf(" %-14s %-36s %10s %10s %9s %7s %7lld\n", name.c_str(), problem.c_str(),
                  fixed(d.t.best_ms, 3).c_str(), fixed(d.t.mean_ms, 3).c_str(),
                  fixed(d.gbps, 1).c_str(), fixed(d.ratio, 3).c_str(),
                  static_cast<long long>(d.wrong));
      decode_ratio = std::min(decode_ratio, d.ratio);
      wrong += d.wrong;
    }
  }
  const double ratio_causal = rows[1].tflops / rows[0].tflops;
  const double ratio_full = rows[2].tflops / rows[0].tflops;
  const bool decode_pass = o.context == 0 || decode_ratio >= kDecodeTarget;
  const bool pass = ratio_causal >= kTarget && ratio_full >= kTarget && decode_pass;
  std::printf(
      "# FLOPs: attention 4 B H S^2 D (halved for causal); GEMM 2 n^3; TFLOP/s from best\n");
  std::printf("# %-26s: %s (target >= %.2f) %s\n", "(d) causal / cuBLAS",
              fixed(ratio_causal, 3).c_str(), kTarget, ratio_causal >= kTarget ? "PASS" : "FAIL");
  std::printf("# %-26s: %s (target >= %.2f) %s\n", "(e) noncausal / cuBLAS",
              fixed(ratio_full, 3).c_str(), kTarget, ratio_full >= kTarget ? "PASS" : "FAIL");
  if (o.context > 0) {
    std::printf(
        "# decode bytes: K + V of the cache (2 S_k H_kv D bf16) per step; GB/s from best\n");
    std::printf("# %-26s: %s (lowest over H_kv; target >= %.2f) %s\n", "(k) decode / copy",
                fixed(decode_ratio, 3).c_str(), kDecodeTarget, decode_pass ? "PASS" : "FAIL");
  }
  std::printf(
      "# %-26s: %lld elements over tolerance (forward S=%lld, decode S_k=5003 checks vs "
      "float64) %s\n",
      "(f) correctness", static_cast<long long>(wrong), static_cast<long long>(o.check_seq),
      wrong == 0 ? "PASS" : "FAIL");
  std::printf("# %-26s: %s\n", "summary", pass && wrong == 0 ? "PASS" : "FAIL");
  std::fflush(stdout);

  if (!o.json.empty()) {
    std::string text = "{\"program\": \"dattn-cuda-kernel-bench\", \"version\": \"";
    text += DATTN_VERSION;
    text += "\", \"device\": \"" + std::string(prop.name) + "\", \"rows\": [";
    for (size_t i = 0; i < rows.size(); ++i)
      text += (i ? ", " : "") + json_row(rows[i], o, i == 0);
    text += "], \"decode_rows\": [";
    for (size_t i = 0; i < decode_rows.size(); ++i)
      text += (i ? ", " : "") + json_decode_row(decode_rows[i], o);
    text += "], \"copy_gbps\": " + fixed(copy_gbps, 3) +
            ", \"decode_ratio\": " + fixed(decode_ratio, 6) +
            ", \"decode_target\": " + fixed(kDecodeTarget, 2);
    text += ", \"ratio_causal\": " + fixed(ratio_causal, 6) +
            ", \"ratio_noncausal\": " + fixed(ratio_full, 6) +
            ", \"target\": " + fixed(kTarget, 2) + ", \"wrong\": " + std::to_string(wrong) +
            ", \"pass\": " + (pass && wrong == 0 ? "true" : "false") + "}\n";
    std::ofstream f(o.json);
    f << text;
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
