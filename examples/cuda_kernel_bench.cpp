// dattn-cuda-kernel-bench: the CUDA attention forward (kernels/cuda) against cuBLAS's bf16 GEMM
// on one GPU: cuBLAS TFLOP/s, the kernel's TFLOP/s causal and not, their ratio against the
// target (0.40), and a #wrong column from a small check against the float64 CPU reference.
// Needs neither MPI nor Boost (a bare GPU machine's core-only build has it); exits 77 without GPU.
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

constexpr double kTarget = 0.40;  // kernel TFLOP/s / cuBLAS bf16 GEMM TFLOP/s

// ================================================================== options
// getopt_long rather than Boost.Program_options, which a bare GPU machine's core-only build does
// not have.

struct Options {
  int64_t seq = 16384, heads = 16, head_dim = 128, iters = 10, warmup = 3, gemm_n = 8192;
  int64_t check_seq = 300;
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
  return {{"seq", 's', &o.seq, 1, kMax, "sequence length S"},
          {"heads", 'H', &o.heads, 1, kMax, "heads (heads_kv = heads)"},
          {"head-dim", 'd', &o.head_dim, 1, 256, "head dimension D = D_v, 1 to 256"},
          {"iters", 'n', &o.iters, 1, INT32_MAX, "timed iterations"},
          {"warmup", 'w', &o.warmup, 0, INT32_MAX, "untimed warm-up iterations"},
          {"gemm-n", 'g', &o.gemm_n, 16, kMax, "cuBLAS GEMM size n (n x n x n)"},
          {"check-seq", 'c', &o.check_seq, 1, kMax,
           "S of the correctness check vs the float64 reference"}};
}

void print_help() {
  Options d;
  std::printf(
      "dattn-cuda-kernel-bench: the CUDA attention forward (bf16, B=1) vs cuBLAS bf16 GEMM\n"
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

// The built-in check: S = check_seq, H = 2 query heads on 1 kv head (GQA), D = head_dim, bf16,
// against the float64 reference. Elements (out and lse) over the tolerance of
// tests/gpu/test_cuda_attention.cpp's bf16 check are counted as wrong.
int64_t check_attention(const Options& o, bool causal) {
  const int64_t S = o.check_seq, Hq = 2, Hkv = 1, D = o.head_dim;
  const dattn::AttnSpec spec{.heads_q = Hq,
                             .heads_kv = Hkv,
                             .head_dim = D,
                             .mask = causal ? dattn::Mask::causal() : dattn::Mask::none()};
  dattn::Tensor q = dattn::Tensor::empty({1, S, Hq, D}, DType::bf16);
  dattn::Tensor k = dattn::Tensor::empty({1, S, Hkv, D}, DType::bf16);
  dattn::Tensor v = dattn::Tensor::empty({1, S, Hkv, D}, DType::bf16);
  for (auto [t, seed, scale] : {std::tuple{&q, 21, 2.f}, {&k, 22, 2.f}, {&v, 23, 1.f}})
    for (int64_t i = 0; i < t->numel(); ++i)
      t->set(i, scale * uniform(uint64_t(seed), uint64_t(i)));
  DeviceBuffer dq(q.nbytes()), dk(k.nbytes()), dv(v.nbytes());
  dq.upload(q.data());
  dk.upload(k.data());
  dv.upload(v.data());
  std::vector<float> h_out(size_t(S * Hq * D), 0.f), h_lse(size_t(Hq * S), -INFINITY);
  DeviceBuffer out(h_out.size() * 4), lse(h_lse.size() * 4);
  out.upload(h_out.data());
  lse.upload(h_lse.data());
  dattn::cuda::attention_forward(block(dq.get(), dk.get(), dv.get(), S, Hq, Hkv, D, causal),
                                 out.get<float>(), lse.get<float>(), nullptr);
  DATTN_CUDA_CHECK(cudaDeviceSynchronize());
  out.download(h_out.data());
  lse.download(h_lse.data());
  const dattn::cpu::ReferenceResult ref = dattn::cpu::attention_reference(q, k, v, spec);
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

  // ---------------------------------------------------------------- header
  std::printf("# dattn CUDA kernel benchmark, version %s\n", DATTN_VERSION);
  std::printf("# %s\n", dattn::detail::cat(
                            "seq ", o.seq, " heads ", o.heads, " kv-heads ", o.heads, " head-dim ",
                            o.head_dim, " dtype bf16 batch 1 iters ", o.iters, " warmup ", o.warmup,
                            " gemm-n ", o.gemm_n, " check-seq ", o.check_seq, " kernel ",
                            dattn::cuda::kernel_variant(DType::bf16, o.head_dim, o.head_dim))
                            .c_str());
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

  // ---------------------------------------------------------------- table and footer
  std::printf("# %-14s %-36s %10s %10s %9s %7s\n", "section", "problem", "best", "mean", "TFLOP/s",
              "#wrong");
  std::printf("# %-14s %-36s %10s %10s %9s %7s\n", "", "", "(ms)", "(ms)", "", "");
  for (const Row& r : rows)
    print_row(r);
  const double ratio_causal = rows[1].tflops / rows[0].tflops;
  const double ratio_full = rows[2].tflops / rows[0].tflops;
  const int64_t wrong = rows[1].wrong + rows[2].wrong;
  const bool pass = ratio_causal >= kTarget && ratio_full >= kTarget;
  std::printf(
      "# FLOPs: attention 4 B H S^2 D (halved for causal); GEMM 2 n^3; TFLOP/s from best\n");
  std::printf("# %-26s: %s (target >= %.2f) %s\n", "(d) causal / cuBLAS",
              fixed(ratio_causal, 3).c_str(), kTarget, ratio_causal >= kTarget ? "PASS" : "FAIL");
  std::printf("# %-26s: %s (target >= %.2f) %s\n", "(e) noncausal / cuBLAS",
              fixed(ratio_full, 3).c_str(), kTarget, ratio_full >= kTarget ? "PASS" : "FAIL");
  std::printf("# %-26s: %lld elements over tolerance (S=%lld check vs float64) %s\n",
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
    text += "], \"ratio_causal\": " + fixed(ratio_causal, 6) +
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
