// dattn-kernel-bench: the single-process CPU attention kernel against the BLAS it is built on.
// Prints the BLAS's own sgemm FLOP/s, the kernel's attention FLOP/s on the same threads, their
// ratio (target >= 0.50), the backward's FLOP/s and ratio (target >= 0.35), and peak RSS against S
// to show the kernel's memory is linear in S.
#include <cblas.h>
#include <mpi.h>
#include <omp.h>
#include <sys/resource.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "collective/mpi_communicator.h"
#include "examples/bench_inputs.h"
#include "examples/report.h"
#include "examples/workloads.h"
#include "launch/options.h"
#include "launch/program.h"
#include "launch/progress.h"
#include "src/attention.h"
#include "src/base/error.h"
#include "src/models.h"

namespace {

namespace po = boost::program_options;
using dattn::DType;
using dattn::Tensor;
using dattn::bench::mix64;
using dattn::report::fixed;

// ================================================================== options

struct Options {
  int threads = 2;
  int64_t heads = 8;
  int64_t head_dim = 128;
  int64_t seq = 8192;
  std::string dtype_name = "fp32";
  DType dtype = DType::f32;
  int causal = 0;
  int iters = 3;
  int64_t gemm_n = 4096;
  std::string rss_seqs_text = "16384,65536";
  std::vector<int64_t> rss_seqs;
  std::string json;
  // --config, --dry-run (and --cp, --tp, --device, which must say one CPU process).
  dattn::LaunchOptions launch;
};

int world_rank() {
  int rank = 0;
  DATTN_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  return rank;
}

int world_size() {
  int size = 1;
  DATTN_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size));
  return size;
}

// "16384,65536" -> {16384, 65536}, sorted ascending (the peak RSS is a high-water mark).
std::vector<int64_t> parse_seq_list(const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    dattn::require_option(used == item.size() && v >= 1, "--rss-seqs", text,
                          "a comma-separated list of lengths >= 1");
    out.push_back(v);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Parses and validates the command line; nullopt when --help or --version was answered.
std::optional<Options> parse_options(int argc, char** argv) {
  Options o;
  bool help = false, version = false;
  po::options_description desc(
      "dattn-kernel-bench: CPU attention kernel (forward, backward) vs sgemm, and peak memory vs S "
      "(one process)\n"
      "options");
  // clang-format off
  desc.add_options()
    ("threads,T", po::value(&o.threads)->default_value(o.threads),
     "OpenMP threads for the kernel (and BLAS threads for the sgemm)")
    ("heads,H", po::value(&o.heads)->default_value(o.heads), "heads (heads_kv = heads)")
    ("head-dim,d", po::value(&o.head_dim)->default_value(o.head_dim), "head dimension D")
    ("seq,s", po::value(&o.seq)->default_value(o.seq), "sequence length of the kernel run")
    ("dtype,t", po::value(&o.dtype_name)->default_value(o.dtype_name),
     "storage dtype of the kernel run: fp32, bf16 or fp16")
    ("causal,c", po::value(&o.causal)->default_value(o.causal),
     "causal mask in the kernel run (0 or 1)")
    ("iters,n", po::value(&o.iters)->default_value(o.iters), "timed iterations (best is kept)")
    ("gemm-n", po::value(&o.gemm_n)->default_value(o.gemm_n), "sgemm size n (n x n x n)")
    ("rss-seqs", po::value(&o.rss_seqs_text)->default_value(o.rss_seqs_text),
     "sequence lengths of the peak-RSS runs (H=1, causal; empty: skip)")
    ("json,J", po::value(&o.json)->value_name("FILE"), "also write the results as JSON to FILE")
    ("help,h", po::bool_switch(&help), "print this help")
    ("version,V", po::bool_switch(&version), "print the version");
  // clang-format on
  dattn::add_launch_options(desc, o.launch);
  po::variables_map vm;
  dattn::parse_command_line(argc, argv, desc, vm);
  if (help) std::cout << desc << "\n";
  if (version) std::cout << "dattn-kernel-bench " << DATTN_VERSION << "\n";
  if (help || version) return std::nullopt;

  // One CPU process: the grid is cp 1 x tp 1 and the plan is for one rank. The ranks of a
  // several-rank job each run the whole benchmark alone, as before (nothing is shared).
  using dattn::detail::cat;
  const std::string why = "the kernel benchmark runs in one process";
  dattn::require_option(o.launch.cp == 0 || o.launch.cp == 1, "--cp", o.launch.cp, cat("1: ", why));
  dattn::require_option(o.launch.tp == 0 || o.launch.tp == 1, "--tp", o.launch.tp, cat("1: ", why));
  dattn::require_option(o.launch.world_size <= 1, "--world-size", o.launch.world_size,
                        cat("1: ", why, " (each rank of a job runs it alone)"));
  dattn::require_option(o.launch.device == "cpu", "--device", o.launch.device,
                        "cpu: the kernel benchmark times the CPU kernel against the BLAS's sgemm");
  // resolve_launch_options checks the rest (--device-id, --world-size without --dry-run) on
  // the job's grid, where every rank is a cp rank; this benchmark's own grid is 1 x 1.
  dattn::LaunchOptions job = o.launch;
  job.cp = job.tp = 0;
  dattn::resolve_launch_options(job, 1);
  o.launch.cp = o.launch.tp = o.launch.world = 1;
  o.launch.dev = job.dev;

  dattn::require_option(o.threads >= 1, "--threads", o.threads, ">= 1");
  dattn::require_option(o.heads >= 1, "--heads", o.heads, ">= 1");
  dattn::require_option(o.head_dim >= 1, "--head-dim", o.head_dim, ">= 1");
  dattn::require_option(o.seq >= 1, "--seq", o.seq, ">= 1");
  dattn::require_option(o.causal == 0 || o.causal == 1, "--causal", o.causal, "0 or 1");
  dattn::require_option(o.iters >= 1, "--iters", o.iters, ">= 1");
  dattn::require_option(o.gemm_n >= 1, "--gemm-n", o.gemm_n, ">= 1");
  try {
    o.dtype = dattn::parse_dtype(o.dtype_name);
  } catch (const dattn::Error&) {
    dattn::require_option(false, "--dtype", o.dtype_name, "fp32, bf16 or fp16");
  }
  o.rss_seqs = parse_seq_list(o.rss_seqs_text);
  return o;
}

// ================================================================== problems

// The kernel run's attention: H heads (heads_kv = heads), head_dim D, causal or not.
dattn::AttnSpec kernel_spec(const Options& o) {
  dattn::AttnSpec spec;
  spec.heads_q = spec.heads_kv = o.heads;
  spec.head_dim = o.head_dim;
  spec.mask = o.causal ? dattn::Mask::causal() : dattn::Mask::none();
  spec.validate();
  return spec;
}

// The peak-RSS runs' attention: one head, causal.
dattn::AttnSpec rss_spec(const Options& o) {
  dattn::AttnSpec spec;
  spec.heads_q = spec.heads_kv = 1;
  spec.head_dim = o.head_dim;
  spec.mask = dattn::Mask::causal();
  return spec;
}

std::string gemm_problem(const Options& o) {
  return dattn::detail::cat(o.gemm_n, "x", o.gemm_n, "x", o.gemm_n, " fp32");
}

double gemm_flops(int64_t n) {
  return 2.0 * double(n) * double(n) * double(n);
}

std::string attn_problem(const dattn::AttnSpec& spec, int64_t S, DType dtype) {
  return dattn::detail::cat("B=1 H=", spec.heads_q, " S=", S, " D=", spec.head_dim, " ",
                            dattn::dtype_name(dtype), " ", spec.mask.str());
}

// ================================================================== inputs and measurements

// A [1, S, H, D] tensor of uniform values in [-1, 1), seeded per tensor.
Tensor random_bshd(int64_t S, int64_t H, int64_t D, DType dtype, uint64_t seed) {
  Tensor t = Tensor::empty({1, S, H, D}, dtype);
  const int64_t n = t.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    t.set(i, float(mix64(seed * 0x100000000ull + uint64_t(i)) >> 40) * 0x1p-23f - 1.0f);
  }
  return t;
}

double peak_rss_mib() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return double(ru.ru_maxrss) / 1024.0;  // KiB on Linux
}

void progress(const std::string& what, double gflop) {
  if (gflop > 200) {
    std::fprintf(stdout, "# running %s (%.0f GFLOP) ...\n", what.c_str(), gflop);
    std::fflush(stdout);
  }
}

struct Timing {
  double best_ms = 0, gflops = 0;
};

// Square sgemm on T BLAS threads, best of iters. The kernel wants BLAS single-threaded (it
// runs BLAS inside its own OpenMP threads), so the thread count is put back to 1 afterwards.
Timing time_sgemm(int64_t n, int threads, int iters) {
  dattn::Progress progress(world_rank() == 0, dattn::detail::cat("kernel sgemm n=", n), iters);
  std::vector<float> a(size_t(n * n)), b(size_t(n * n)), c(size_t(n * n));
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = float(mix64(i) >> 40) * 0x1p-23f - 1.0f;
    b[i] = float(mix64(i + a.size()) >> 40) * 0x1p-23f - 1.0f;
  }
  openblas_set_num_threads(threads);
  double best = 1e300;
  for (int it = 0; it < iters; ++it) {
    const double t0 = MPI_Wtime();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(n), int(n), int(n), 1.0f, a.data(),
                int(n), b.data(), int(n), 0.0f, c.data(), int(n));
    best = std::min(best, MPI_Wtime() - t0);
    progress.step();
  }
  openblas_set_num_threads(1);
  return {best * 1e3, 2.0 * double(n) * double(n) * double(n) / best / 1e9};
}

// attention_local on the current OpenMP threads, best of iters.
Timing time_attention(const Options& o, const dattn::AttnSpec& spec) {
  const Tensor q = random_bshd(o.seq, spec.heads_q, spec.head_dim, o.dtype, 1);
  const Tensor k = random_bshd(o.seq, spec.heads_kv, spec.head_dim, o.dtype, 2);
  const Tensor v = random_bshd(o.seq, spec.heads_kv, spec.dim_v(), o.dtype, 3);
  dattn::Progress progress(world_rank() == 0, dattn::detail::cat("kernel attention seq=", o.seq),
                           o.iters);
  double best = 1e300;
  for (int it = 0; it < o.iters; ++it) {
    const double t0 = MPI_Wtime();
    (void)dattn::attention_local(q, k, v, spec);
    best = std::min(best, MPI_Wtime() - t0);
    progress.step();
  }
  return {best * 1e3, dattn::attention_flops(1, o.seq, o.seq, spec) / best / 1e9};
}

// attention_local_backward (delta and the kernel) after one forward, best of iters. Its FLOPs
// are 2.5x the forward's (the usual model: 5 GEMM-sized products against the forward's 2).
Timing time_backward(const Options& o, const dattn::AttnSpec& spec) {
  const Tensor q = random_bshd(o.seq, spec.heads_q, spec.head_dim, o.dtype, 1);
  const Tensor k = random_bshd(o.seq, spec.heads_kv, spec.head_dim, o.dtype, 2);
  const Tensor v = random_bshd(o.seq, spec.heads_kv, spec.dim_v(), o.dtype, 3);
  const Tensor dout = random_bshd(o.seq, spec.heads_q, spec.dim_v(), o.dtype, 4);
  const dattn::Partial fwd = dattn::attention_local(q, k, v, spec);
  dattn::Progress progress(world_rank() == 0, dattn::detail::cat("kernel backward seq=", o.seq),
                           o.iters);
  double best = 1e300;
  for (int it = 0; it < o.iters; ++it) {
    const double t0 = MPI_Wtime();
    (void)dattn::attention_local_backward(q, k, v, fwd, dout, spec);
    best = std::min(best, MPI_Wtime() - t0);
    progress.step();
  }
  return {best * 1e3, 2.5 * dattn::attention_flops(1, o.seq, o.seq, spec) / best / 1e9};
}

struct RssRow {
  int64_t seq = 0;
  double tensors_mib = 0, peak_mib = 0, time_ms = 0;
};

// One causal single-head run per S (ascending); the peak RSS after each, next to the bytes of
// q, k, v, out and lse for that S.
std::vector<RssRow> measure_rss(const Options& o) {
  std::vector<RssRow> rows;
  const dattn::AttnSpec spec = rss_spec(o);
  for (int64_t S : o.rss_seqs) {
    progress("peak-RSS run seq=" + std::to_string(S), dattn::attention_flops(1, S, S, spec) / 1e9);
    RssRow r;
    r.seq = S;
    const double t0 = MPI_Wtime();
    {
      const Tensor q = random_bshd(S, 1, o.head_dim, o.dtype, 11);
      const Tensor k = random_bshd(S, 1, o.head_dim, o.dtype, 12);
      const Tensor v = random_bshd(S, 1, o.head_dim, o.dtype, 13);
      const dattn::Partial res = dattn::attention_local(q, k, v, spec);
      r.tensors_mib =
          double(q.nbytes() + k.nbytes() + v.nbytes() + res.out.nbytes() + res.lse.nbytes()) /
          (1024.0 * 1024.0);
    }
    r.time_ms = (MPI_Wtime() - t0) * 1e3;
    r.peak_mib = peak_rss_mib();
    rows.push_back(r);
  }
  return rows;
}

// ================================================================== dry run

// --dry-run: what would be timed, in the order it runs (the peak-RSS runs first, as ru_maxrss is
// a high-water mark), with each problem's shape, FLOP and input bytes; nothing is computed or
// allocated. Printed by rank 0 only.
void print_plan(const Options& o) {
  using dattn::detail::cat;
  const double start = MPI_Wtime();
  const dattn::AttnSpec spec = kernel_spec(o), rss = rss_spec(o);
  const int job = world_size();
  const double es = double(dattn::dtype_size(o.dtype));
  const auto mib = [](double bytes) { return fixed(bytes / (1024.0 * 1024.0), 1); };
  std::printf("# dattn kernel plan (dry run, nothing computed), version %s\n", DATTN_VERSION);
  std::printf(
      "# one process: world 1 rank = cp 1 x tp 1, device cpu, OpenMP threads %d (the sgemm: BLAS "
      "threads %d)%s\n",
      o.threads, o.threads,
      job > 1 ? cat("; each of the job's ", job, " ranks would run it alone").c_str() : "");
  const dattn::report::Table t({{"section", "", 10},
                                {"problem", "", 34},
                                {"threads", "", 7},
                                {"runs", "", 5},
                                {"GFLOP", "(per run)", 11},
                                {"inputs", "(MiB)", 9}});
  t.print_heading(stdout);
  double total = 0;
  for (int64_t S : o.rss_seqs) {
    const double f = dattn::attention_flops(1, S, S, rss);
    total += f;
    t.print_row(stdout, {"(f) rss", attn_problem(rss, S, o.dtype), std::to_string(o.threads), "1",
                         fixed(f / 1e9, 3), mib(3.0 * double(S) * double(o.head_dim) * es)});
  }
  const double n = double(o.gemm_n), fg = gemm_flops(o.gemm_n);
  total += fg * o.iters;
  t.print_row(stdout, {"(a) blas", gemm_problem(o), std::to_string(o.threads),
                       std::to_string(o.iters), fixed(fg / 1e9, 3), mib(3.0 * n * n * 4)});
  const double fa = dattn::attention_flops(1, o.seq, o.seq, spec);
  total += fa * o.iters;
  t.print_row(stdout, {"(b) attn", attn_problem(spec, o.seq, o.dtype), std::to_string(o.threads),
                       std::to_string(o.iters), fixed(fa / 1e9, 3),
                       mib(double(o.seq) * double(o.heads) *
                           double(2 * spec.head_dim + spec.dim_v()) * es)});
  total += 2.5 * fa * o.iters;
  t.print_row(stdout, {"(d) bwd", attn_problem(spec, o.seq, o.dtype), std::to_string(o.threads),
                       std::to_string(o.iters), fixed(2.5 * fa / 1e9, 3),
                       mib(double(o.seq) * double(o.heads) *
                           double(2 * spec.head_dim + 2 * spec.dim_v()) * es)});
  std::printf(
      "# inputs = q, k, v (a: A, B, C; d: and dout); (a), (b), (d) report the best of their runs; "
      "%s GFLOP in all\n",
      fixed(total / 1e9, 3).c_str());
  std::printf("# planned 1 rank in %.3f s\n", MPI_Wtime() - start);
  std::fflush(stdout);
}

// ================================================================== main

int kernel_bench(int argc, char** argv) {
  const std::optional<Options> parsed = parse_options(argc, argv);
  if (!parsed) return 0;
  const Options& o = *parsed;
  if (o.launch.dry_run) {
    if (world_rank() == 0) print_plan(o);
    return 0;
  }
  omp_set_num_threads(o.threads);

  const dattn::AttnSpec spec = kernel_spec(o);

  const auto ranks = dattn::report::gather_rank_info(MPI_COMM_WORLD, "cpu", o.threads);
  const std::string config = dattn::detail::cat(
      "threads ", o.threads, " heads ", o.heads, " kv-heads ", o.heads, " head-dim ", o.head_dim,
      " seq ", o.seq, " dtype ", dattn::dtype_name(o.dtype), " mask ", spec.mask.str(), " iters ",
      o.iters, " (best of) gemm-n ", o.gemm_n, " rss-seqs ", o.rss_seqs_text);
  dattn::report::print_header(stdout, "dattn kernel benchmark", {config}, ranks);
  std::fflush(stdout);

  // ru_maxrss is a high-water mark: the small-footprint RSS runs go first, before the sgemm's
  // 3 n^2 floats and the kernel run's tensors raise it. They are printed last, as section (f).
  const double base_mib = peak_rss_mib();
  const std::vector<RssRow> rss = measure_rss(o);

  progress("sgemm n=" + std::to_string(o.gemm_n), gemm_flops(o.gemm_n) * o.iters / 1e9);
  const Timing gemm = time_sgemm(o.gemm_n, o.threads, o.iters);
  progress("attention seq=" + std::to_string(o.seq),
           dattn::attention_flops(1, o.seq, o.seq, spec) * o.iters / 1e9);
  const Timing attn = time_attention(o, spec);
  const double ratio = attn.gflops / gemm.gflops;
  const bool pass = ratio >= 0.50;
  progress("backward seq=" + std::to_string(o.seq),
           2.5 * dattn::attention_flops(1, o.seq, o.seq, spec) * o.iters / 1e9);
  const Timing bwd = time_backward(o, spec);
  const double bwd_ratio = bwd.gflops / gemm.gflops;
  const bool bwd_pass = bwd_ratio >= 0.35;

  // ---------------------------------------------------------------- (a)-(e) throughput
  const dattn::report::Table perf({{"section", "", 17},
                                   {"problem", "", 34},
                                   {"threads", "", 7},
                                   {"best", "(ms)", 11},
                                   {"GFLOP/s", "", 9}});
  perf.print_heading(stdout);
  const std::string gemm_shape = gemm_problem(o);
  const std::string attn_shape = attn_problem(spec, o.seq, o.dtype);
  perf.print_row(stdout, {"(a) blas", gemm_shape, std::to_string(o.threads), fixed(gemm.best_ms, 2),
                          fixed(gemm.gflops, 2)});
  perf.print_row(stdout, {"(b) attn", attn_shape, std::to_string(o.threads), fixed(attn.best_ms, 2),
                          fixed(attn.gflops, 2)});
  dattn::report::print_footer_line(
      stdout, "(c) kernel / sgemm",
      fixed(ratio, 3) + " (target >= 0.50) " + (pass ? "PASS" : "BELOW"));
  perf.print_row(stdout, {"(d) attn backward", attn_shape, std::to_string(o.threads),
                          fixed(bwd.best_ms, 2), fixed(bwd.gflops, 2)});
  dattn::report::print_footer_line(
      stdout, "(e) backward / sgemm",
      fixed(bwd_ratio, 3) + " (target >= 0.35) " + (bwd_pass ? "PASS" : "FAIL"));
  std::printf("# backward GFLOP/s count 2.5x the forward's FLOPs\n#\n");

  // ---------------------------------------------------------------- (f) memory
  const dattn::report::Table mem({{"seq", "(tokens)", 10},
                                  {"tensors", "(MiB)", 9},
                                  {"peak_rss", "(MiB)", 9},
                                  {"rss-base", "(MiB)", 9},
                                  {"growth", "(RSS/S)", 8},
                                  {"time", "(ms)", 10}});
  std::printf(
      "# (f) peak RSS (ru_maxrss) after one causal run, B=1 H=1 D=%lld %s; measured "
      "first, base %.1f MiB\n",
      static_cast<long long>(o.head_dim), dattn::dtype_name(o.dtype), base_mib);
  mem.print_heading(stdout);
  std::vector<std::string> jrss;
  for (size_t i = 0; i < rss.size(); ++i) {
    const RssRow& r = rss[i];
    // (growth of RSS above the base) / (growth of S) between consecutive rows: 1 is linear.
    double growth = 0;
    std::string growth_text = "-";
    if (i > 0 && rss[i - 1].peak_mib > base_mib) {
      growth = ((r.peak_mib - base_mib) / (rss[i - 1].peak_mib - base_mib)) /
               (double(r.seq) / double(rss[i - 1].seq));
      growth_text = fixed(growth, 2);
    }
    mem.print_row(stdout, {std::to_string(r.seq), fixed(r.tensors_mib, 1), fixed(r.peak_mib, 1),
                           fixed(r.peak_mib - base_mib, 1), growth_text, fixed(r.time_ms, 1)});
    dattn::report::JsonObject j;
    j.add("seq", r.seq)
        .add("tensors_mib", r.tensors_mib)
        .add("peak_rss_mib", r.peak_mib)
        .add("rss_above_base_mib", r.peak_mib - base_mib)
        .add_raw("growth_vs_s", i > 0 ? dattn::report::json_number(growth) : "null")
        .add("time_ms", r.time_ms);
    jrss.push_back(j.str());
  }
  std::printf(
      "# growth = ((peak - base) / previous (peak - base)) / (S / previous S): 1.00 is linear in "
      "S, 4.00 would be quadratic.\n");
  std::fflush(stdout);

  // Rank 0 only: the ranks of a several-rank job would all write the same file.
  if (!o.json.empty() && world_rank() == 0) {
    // The common row keys (report::result_row) first: one row per timed problem, seq = the
    // kernel run's S, time_ms = the best of --iters, nothing sent, no correctness check.
    const auto row = [&](const char* strategy, const Timing& t, const std::string& problem) {
      dattn::report::ResultRow c;
      c.workload = "kernel";
      c.strategy = strategy;
      c.layout = "";
      c.seq = o.seq;
      c.ranks = 1;
      c.time_ms = t.best_ms;
      c.tflops_per_rank = t.gflops / 1000;
      c.sent_mb_per_rank = 0;
      c.model_mb_per_rank = 0;
      c.wrong = -1;
      dattn::report::JsonObject j = dattn::report::result_row(c);
      j.add("problem", problem).add("threads", o.threads);
      return j;
    };
    const std::vector<std::string> jrows = {
        row("kernel", attn, attn_shape).add("gflops", attn.gflops).str(),
        row("kernel_backward", bwd, attn_shape).add("gflops", bwd.gflops).str(),
        row("sgemm", gemm, gemm_shape).add("n", o.gemm_n).add("gflops", gemm.gflops).str()};
    dattn::report::JsonObject cfg, g, a, bw, top;
    cfg.add("program", "dattn-kernel-bench")
        .add("version", DATTN_VERSION)
        .add("threads", o.threads)
        .add("heads", o.heads)
        .add("head_dim", o.head_dim)
        .add("seq", o.seq)
        .add("dtype", dattn::dtype_name(o.dtype))
        .add("mask", spec.mask.str())
        .add("iters", o.iters)
        .add("gemm_n", o.gemm_n);
    g.add("n", o.gemm_n).add("best_ms", gemm.best_ms).add("gflops", gemm.gflops);
    a.add("best_ms", attn.best_ms).add("gflops", attn.gflops);
    bw.add("best_ms", bwd.best_ms)
        .add("gflops", bwd.gflops)
        .add("ratio", bwd_ratio)
        .add("target", 0.35)
        .add("pass", bwd_pass);
    top.add_raw("config", cfg.str())
        .add_raw("rows", dattn::report::json_array(jrows))
        .add_raw("sgemm", g.str())
        .add_raw("attention", a.str())
        .add("ratio", ratio)
        .add("target", 0.50)
        .add("pass", pass)
        .add_raw("backward", bw.str())
        .add("rss_base_mib", base_mib)
        .add_raw("rss", dattn::report::json_array(jrss));
    dattn::report::write_text_file(o.json, top.str());
  }
  return 0;
}

}  // namespace

namespace dattn::bench {
int kernel_main(int argc, char** argv) {
  return kernel_bench(argc, argv);
}
}  // namespace dattn::bench
