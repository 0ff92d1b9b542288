// dattn-prefill-bench: the long-context prefill benchmark, nccl-tests style. Each rank generates
// its own shard of q, k, v, times dattn::attention (ring, ulysses or hybrid; any layout and mask)
// over a range of sequence lengths, checks the bytes it sent against attention_send_bytes, reports
// the model's load balance and, with --check, compares sampled rows against float64.
#include <mpi.h>
#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "collective/mpi_communicator.h"
#include "examples/bench_device.h"
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
using dattn::Layout;
using dattn::Tensor;
using dattn::bench::input_value;
using dattn::bench::make_shard;
using dattn::bench::mix64;
using dattn::bench::on_device;
using dattn::bench::row_key;
using dattn::bench::synchronize;

// ================================================================== options

struct Options {
  int64_t batch = 1;
  int64_t heads = 8;
  int64_t kv_heads = 2;
  int64_t head_dim = 128;
  int64_t seq_begin = 4096;
  int64_t seq_end = 0;  // 0: seq_begin
  int64_t seq_factor = 2;
  std::string dtype_name = "bf16";
  DType dtype = DType::bf16;
  std::string strategy_name = "ring";
  dattn::Strategy strategy = dattn::Strategy::ring;
  int ulysses = 1;  // the Ulysses degree U of the models: ring 1, ulysses P, hybrid -u
  std::string layout = "contiguous";
  int64_t stripe_block = 1;
  std::string mask = "causal";  // none, causal, window or document
  int causal = -1;              // -c as given (-1: not given)
  bool doc_causal = true;       // causal inside documents (mask document)
  std::string window;           // -W as given
  int64_t window_left = 0, window_right = 0;
  std::string doc_lens_str;       // --doc-lens as given
  std::vector<int64_t> doc_lens;  // document lengths (--doc-lens), or empty
  int64_t doc_count = 0;          // --doc-count, or 0
  int iters = 5;
  int warmup = 1;
  int check = 0;
  int threads = 0;
  std::string json;
  bool scaling = false;
  bool backward = false;  // time attention_backward instead of the forward
  bool compare_layouts = false;
  bool compare_unmasked = false;
  dattn::LaunchOptions launch;  // --cp, --tp, --device, --dry-run, --config

  int cp() const { return launch.cp; }
  int tp() const { return launch.tp; }
  int64_t local_heads() const { return heads / launch.tp; }  // query heads of one tp rank
  int64_t local_kv_heads() const { return kv_heads / launch.tp; }
  bool has_documents() const { return !doc_lens.empty() || doc_count > 0; }
};

// Whether this run's Runtime is on a GPU (--device cuda). Each rank drives one GPU: throughput
// reads "per GPU" there, and the check allows for the CUDA kernel's rounding (tolerance_for).
bool g_per_gpu = false;

int world_rank() {
  int rank = 0;
  DATTN_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  return rank;
}

// A whole decimal integer, or nullopt.
std::optional<int64_t> parse_int(const std::string& s) {
  if (s.empty()) return std::nullopt;
  size_t used = 0;
  try {
    const long long v = std::stoll(s, &used, 10);
    if (used != s.size()) return std::nullopt;
    return int64_t(v);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// "a,b,c" -> the integers, or nullopt when any item is not one.
std::optional<std::vector<int64_t>> parse_int_list(const std::string& s) {
  std::vector<int64_t> out;
  size_t begin = 0;
  while (true) {
    const size_t comma = s.find(',', begin);
    const auto v = parse_int(s.substr(begin, comma == std::string::npos ? comma : comma - begin));
    if (!v) return std::nullopt;
    out.push_back(*v);
    if (comma == std::string::npos) return out;
    begin = comma + 1;
  }
}

// Parses and validates the command line; nullopt when --help or --version was answered.
// Every rank parses the same arguments, so a UsageError is thrown on every rank alike.
std::optional<Options> parse_options(int argc, char** argv) {
  Options o;
  bool help = false, version = false;
  po::options_description desc(
      "dattn-prefill-bench: distributed attention prefill benchmark\n"
      "usage: mpiexec -n P dattn-prefill-bench [options]\noptions");
  // clang-format off
  desc.add_options()
    ("batch,b", po::value(&o.batch)->default_value(o.batch), "batch size B")
    ("heads,H", po::value(&o.heads)->default_value(o.heads), "query heads H_q")
    ("kv-heads,G", po::value(&o.kv_heads)->default_value(o.kv_heads),
     "key/value heads H_kv (H_q must be a multiple)")
    ("head-dim,d", po::value(&o.head_dim)->default_value(o.head_dim), "head dimension D")
    ("seq-begin,s", po::value(&o.seq_begin)->default_value(o.seq_begin),
     "first global sequence length")
    ("seq-end,e", po::value(&o.seq_end)->value_name("arg (=seq-begin)"),
     "last global sequence length")
    ("seq-factor,f", po::value(&o.seq_factor)->default_value(o.seq_factor),
     "sequence lengths s, s*f, s*f^2, ... <= e")
    ("dtype,t", po::value(&o.dtype_name)->default_value(o.dtype_name),
     "storage dtype: fp32, bf16 or fp16")
    ("strategy,a", po::value(&o.strategy_name)->default_value(o.strategy_name),
     "schedule: ring, ulysses (Ulysses degree = all ranks; --kv-heads divisible by the ranks) "
     "or hybrid (Ulysses inside groups of -u ranks, ring across them)")
    ("ulysses-degree,u", po::value(&o.ulysses)->default_value(o.ulysses),
     "Ulysses degree U of --strategy hybrid (divides the ranks and --kv-heads)")
    ("layout,l", po::value(&o.layout)->default_value(o.layout),
     "context-parallel layout: contiguous, zigzag, striped or varlen (zigzag per document; "
     "needs --doc-lens or --doc-count)")
    ("stripe-block", po::value(&o.stripe_block)->default_value(o.stripe_block),
     "tokens per block of --layout striped")
    ("mask,m", po::value(&o.mask)->value_name("arg (=causal)"),
     "mask: none, causal, window (needs -W) or document (needs --doc-lens or --doc-count)")
    ("causal,c", po::value(&o.causal)->value_name("0|1"),
     "shorthand for the mask: 0 = none, 1 = causal; with -m document, causal inside the "
     "documents (default 1); an error if it disagrees with -m")
    ("window,W", po::value(&o.window)->value_name("L[,R]"),
     "mask window: keys from q-L to q+R (R default 0)")
    ("doc-lens", po::value(&o.doc_lens_str)->value_name("LIST"),
     "comma-separated document lengths summing to the sequence length (one length only)")
    ("doc-count", po::value(&o.doc_count)->value_name("N"),
     "cut each sequence length into N documents of pseudo-random lengths (fixed seed)")
    ("iters,n", po::value(&o.iters)->default_value(o.iters), "timed iterations")
    ("warmup,w", po::value(&o.warmup)->default_value(o.warmup), "untimed warm-up iterations")
    ("check,k", po::value(&o.check)->default_value(o.check),
     "compare sampled rows against the float64 reference (0 or 1)")
    ("threads,T", po::value(&o.threads)->default_value(o.threads),
     "OpenMP threads per rank (0: OMP_NUM_THREADS, else cores per rank)")
    ("json,J", po::value(&o.json)->value_name("FILE"), "also write the rows as JSON to FILE")
    ("backward,B", po::bool_switch(&o.backward),
     "time the backward (attention_backward of one forward) instead of the forward: TFLOP/s "
     "count 2.5x the forward's FLOPs, bytes are checked against attention_backward_send_bytes, "
     "--check checks the forward, --scaling times attention_local_backward")
    ("scaling", po::bool_switch(&o.scaling),
     "after the table, time 1 rank x P*T threads on the largest seq (parallel efficiency)")
    ("compare-layouts", po::bool_switch(&o.compare_layouts),
     "after the table, time the largest seq under layouts contiguous and zigzag")
    ("compare-unmasked", po::bool_switch(&o.compare_unmasked),
     "after the table, time the largest seq with mask none (the mask's time ratio)")
    ("help,h", po::bool_switch(&help), "print this help")
    ("version,V", po::bool_switch(&version), "print the version");
  // clang-format on
  dattn::add_launch_options(desc, o.launch);
  po::variables_map vm;
  dattn::parse_command_line(argc, argv, desc, vm);
  if (help || version) {
    if (world_rank() == 0) {
      if (help) std::cout << desc << "\n";
      if (version) std::cout << "dattn-prefill-bench " << DATTN_VERSION << "\n";
    }
    return std::nullopt;
  }

  using dattn::require_option;
  using dattn::detail::cat;
  o.launch.runs_on_cuda = true;  // the forward of every strategy (checked below)
  dattn::resolve_launch_options(o.launch, 1);
  if (!vm.count("seq-end")) o.seq_end = o.seq_begin;
  require_option(o.batch >= 1, "--batch", o.batch, ">= 1");
  require_option(o.heads >= 1, "--heads", o.heads, ">= 1");
  require_option(o.kv_heads >= 1 && o.heads % o.kv_heads == 0, "--kv-heads", o.kv_heads,
                 cat(">= 1 and dividing --heads (", o.heads, ")"));
  require_option(o.kv_heads % o.tp() == 0, "--kv-heads", o.kv_heads,
                 cat("divisible by --tp (", o.tp(), "): tensor parallelism splits the heads"));
  require_option(o.head_dim >= 1, "--head-dim", o.head_dim, ">= 1");
  require_option(o.seq_begin >= 1, "--seq-begin", o.seq_begin, ">= 1");
  require_option(o.seq_end >= o.seq_begin, "--seq-end", o.seq_end, ">= --seq-begin");
  require_option(o.seq_factor >= 2 || o.seq_end == o.seq_begin, "--seq-factor", o.seq_factor,
                 ">= 2 (or --seq-end equal to --seq-begin)");
  require_option(o.iters >= 1, "--iters", o.iters, ">= 1");
  require_option(o.warmup >= 0, "--warmup", o.warmup, ">= 0");
  require_option(o.check == 0 || o.check == 1, "--check", o.check, "0 or 1");
  require_option(o.threads >= 0, "--threads", o.threads, ">= 0");
  try {
    o.dtype = dattn::parse_dtype(o.dtype_name);
  } catch (const dattn::Error&) {
    require_option(false, "--dtype", o.dtype_name, "fp32, bf16 or fp16");
  }

  // Strategy and Ulysses degree, over the cp ranks of one tp slice (its heads).
  try {
    o.strategy = dattn::parse_strategy(o.strategy_name);
  } catch (const dattn::Error&) {
    require_option(false, "--strategy", o.strategy_name, "ring, ulysses or hybrid");
  }
  const int P = o.cp();
  const int64_t G = o.local_kv_heads();
  const char* kv_what = o.tp() > 1 ? "--kv-heads / --tp" : "--kv-heads";
  const bool u_given = !vm["ulysses-degree"].defaulted();
  require_option(o.ulysses >= 1, "--ulysses-degree", o.ulysses, ">= 1");
  switch (o.strategy) {
    case dattn::Strategy::ring:
      require_option(!u_given || o.ulysses == 1, "--ulysses-degree", o.ulysses,
                     "1 with --strategy ring (it is the degree of --strategy hybrid)");
      o.ulysses = 1;
      break;
    case dattn::Strategy::ulysses:
      require_option(!u_given || o.ulysses == P, "--ulysses-degree", o.ulysses,
                     cat("the number of ranks (", P, ") with --strategy ulysses, or no -u"));
      o.ulysses = P;
      require_option(G % P == 0, kv_what, G,
                     cat("divisible by the cp ranks (", P, ") with --strategy ulysses"));
      break;
    case dattn::Strategy::hybrid:
      require_option(P % o.ulysses == 0, "--ulysses-degree", o.ulysses,
                     cat("a divisor of the cp ranks (", P, ")"));
      require_option(G % o.ulysses == 0, kv_what, G,
                     cat("divisible by --ulysses-degree (", o.ulysses, ") with --strategy hybrid"));
      break;
    case dattn::Strategy::tree:
    case dattn::Strategy::allgather:
      require_option(false, "--strategy", o.strategy_name,
                     "ring, ulysses or hybrid (tree and allgather decode: dattn-decode-bench)");
      break;
  }

  // Documents: --doc-lens or --doc-count, for mask document and layout varlen.
  const bool lens_given = vm.count("doc-lens") > 0, count_given = vm.count("doc-count") > 0;
  require_option(!(lens_given && count_given), "--doc-count", o.doc_count,
                 "not given together with --doc-lens");
  if (lens_given) {
    const auto lens = parse_int_list(o.doc_lens_str);
    require_option(
        lens && std::all_of(lens->begin(), lens->end(), [](int64_t n) { return n >= 1; }),
        "--doc-lens", o.doc_lens_str, "comma-separated lengths >= 1");
    int64_t sum = 0;  // saturated: lengths past the int64 range only have to read as too many
    for (int64_t n : *lens)
      sum = n > std::numeric_limits<int64_t>::max() - sum ? std::numeric_limits<int64_t>::max()
                                                          : sum + n;
    require_option(o.seq_end == o.seq_begin, "--doc-lens", o.doc_lens_str,
                   "one sequence length (--seq-end equal to --seq-begin); or use --doc-count");
    require_option(sum == o.seq_begin, "--doc-lens", o.doc_lens_str,
                   cat("lengths summing to --seq-begin (", o.seq_begin, "), not ", sum));
    o.doc_lens = *lens;
  }
  if (count_given) {
    require_option(o.doc_count >= 1 && o.doc_count <= o.seq_begin, "--doc-count", o.doc_count,
                   cat(">= 1 and <= --seq-begin (", o.seq_begin, ")"));
  }

  // Layout.
  require_option(o.layout == "contiguous" || o.layout == "zigzag" || o.layout == "striped" ||
                     o.layout == "varlen",
                 "--layout", o.layout, "contiguous, zigzag, striped or varlen");
  require_option(o.stripe_block >= 1, "--stripe-block", o.stripe_block, ">= 1");
  require_option(vm["stripe-block"].defaulted() || o.layout == "striped", "--stripe-block",
                 o.stripe_block, "given only with --layout striped");
  require_option(o.layout != "varlen" || o.has_documents(), "--layout", o.layout,
                 "--doc-lens or --doc-count with varlen (its document boundaries)");

  // Mask: -m, or -c as its shorthand.
  const bool mask_given = vm.count("mask") > 0, causal_given = vm.count("causal") > 0;
  require_option(!causal_given || o.causal == 0 || o.causal == 1, "--causal", o.causal, "0 or 1");
  if (!mask_given) o.mask = causal_given && o.causal == 0 ? "none" : "causal";
  require_option(
      o.mask == "none" || o.mask == "causal" || o.mask == "window" || o.mask == "document",
      "--mask", o.mask, "none, causal, window or document");
  if (o.mask == "window") {
    require_option(vm.count("window") > 0, "--mask", o.mask, "-W/--window L[,R] with window");
    const auto lr = parse_int_list(o.window);
    require_option(lr && (lr->size() == 1 || lr->size() == 2) &&
                       std::all_of(lr->begin(), lr->end(), [](int64_t n) { return n >= 0; }),
                   "--window", o.window, "L or L,R with sizes >= 0");
    o.window_left = (*lr)[0];
    o.window_right = lr->size() == 2 ? (*lr)[1] : 0;
  } else {
    require_option(vm.count("window") == 0, "--window", o.window, "given only with --mask window");
  }
  if (causal_given && mask_given) {
    // -c says whether a query sees keys after it; documents take it as their causality.
    const bool agrees = o.mask == "none"     ? o.causal == 0
                        : o.mask == "causal" ? o.causal == 1
                        : o.mask == "window" ? o.causal == (o.window_right == 0 ? 1 : 0)
                                             : true;
    require_option(agrees, "--causal", o.causal,
                   cat("agreeing with --mask ", o.mask,
                       o.mask == "window" ? " (-c 1: a window with R = 0; -c 0: R > 0)" : ""));
  }
  o.doc_causal = !causal_given || o.causal == 1;
  require_option(o.mask != "document" || o.has_documents(), "--mask", o.mask,
                 "--doc-lens or --doc-count with document");
  require_option(!o.has_documents() || o.mask == "document" || o.layout == "varlen",
                 lens_given ? "--doc-lens" : "--doc-count",
                 lens_given ? o.doc_lens_str : std::to_string(o.doc_count),
                 "given only with --mask document or --layout varlen");
  require_option(!o.compare_unmasked || o.mask != "none", "--compare-unmasked", "on",
                 "a mask other than none");
  require_option(!o.scaling || o.tp() == 1, "--scaling", "on", "--tp 1 (it times one rank alone)");
  // What runs on a GPU: every strategy's forward on bf16/fp16 tensors. Whether this build and
  // machine have a GPU is the Runtime's check (every rank reports it).
  if (o.launch.device == "cuda") {
    require_option(o.dtype != DType::f32, "--dtype", o.dtype_name,
                   "bf16 or fp16 with --device cuda (the CUDA kernel's storage types)");
    require_option(!o.backward, "--backward", "on", "off with --device cuda (a CPU-only pass)");
    require_option(!o.scaling, "--scaling", "on", "off with --device cuda (it times CPU threads)");
  }
  return o;
}

// The global sequence lengths s, s*f, ... <= e.
std::vector<int64_t> sequence_lengths(const Options& o) {
  std::vector<int64_t> out;
  for (int64_t s = o.seq_begin; s <= o.seq_end; s *= o.seq_factor) {
    out.push_back(s);
    if (o.seq_factor < 2 || s > std::numeric_limits<int64_t>::max() / o.seq_factor) break;
  }
  return out;
}

// ================================================================== inputs

// Inputs come from a hash of (tensor, batch, global position, head, dim): every rank generates
// its own shard, the values do not depend on the rank count, and the float64 check regenerates
// any key row without holding the global tensors (S may be far larger than one rank's memory).
enum TensorId : uint64_t { kQ = 1, kK = 2, kV = 3, kDout = 4 };

// FLOPs of one timed call: the forward's, or 2.5x them for the backward (its five GEMMs against
// the forward's two, the usual model).
double pass_flops(const Options& o, int64_t S, const dattn::AttnSpec& spec) {
  return dattn::attention_flops(o.batch, S, S, spec) * (o.backward ? 2.5 : 1.0);
}

// ================================================================== float64 check

struct Tolerance {
  double out_abs, out_rel, lse_abs, lse_rel;
};

// The kernel reads the same stored values as the reference and computes in fp32 whatever the
// storage dtype, so only fp32 rounding remains (measured max |err|: ~1e-7 for out, ~1e-6 for lse,
// S <= 16384, fp32 and bf16 alike). Outputs are means of many values in [-1, 1), so |out| is
// ~1e-2 at S = 4096 and shrinks with S: the brief's first bf16 bound (2e-2 absolute) would
// accept out = 0. bf16/fp16 keep a 2x margin over fp32 for backends that round P to 16 bits.
//
// The CUDA kernel (--device cuda) rounds P to the storage dtype before O += P V, as flash attention
// does: its out error is of the order of a 16-bit rounding of out (2^-8 bf16, 2^-10 fp16
// relative; tests/gpu/test_cuda_attention.cpp), hence its own out bounds. They still reject
// out = 0 (|out| ~ 1e-2 at S = 4096). lse comes from fp32 scores on the GPU as well.
Tolerance tolerance_for(DType dtype) {
  if (dtype == DType::f32) return {1e-4, 1e-4, 1e-4, 1e-4};
  if (g_per_gpu)
    return dtype == DType::bf16 ? Tolerance{1e-3, 1e-2, 2e-4, 2e-4}
                                : Tolerance{3e-4, 3e-3, 2e-4, 2e-4};
  return {2e-4, 2e-3, 2e-4, 2e-4};
}

struct CheckStats {
  uint64_t checked = 0;  // elements compared (out and lse)
  uint64_t wrong = 0;    // elements over tolerance
  double max_err_out = 0, max_err_lse = 0;
};

// Up to 32 local query rows spread evenly over the shard, the first and the last included.
std::vector<int64_t> sample_rows(int64_t len) {
  const int64_t n = std::min<int64_t>(32, len);
  std::vector<int64_t> rows;
  for (int64_t j = 0; j < n; ++j)
    rows.push_back(n == 1 ? 0 : j * (len - 1) / (n - 1));
  return rows;
}

// Compares the sampled rows of this rank's result with an exact float64 attention of those rows
// against ALL global keys, regenerated chunk by chunk (O(rows * S * H * D) work, O(chunk) memory).
// Online softmax in float64 over key chunks; the mask is evaluated on global positions.
// tp_rank selects the heads (spec holds one tp rank's heads).
CheckStats check_sampled_rows(const dattn::Partial& res, const Layout& layout, int rank,
                              int tp_rank, const dattn::AttnSpec& spec, int64_t batch,
                              DType dtype) {
  const int64_t len = layout.local_len(rank), S = layout.global_seq();
  const int64_t H = spec.heads_q, G = spec.heads_kv, D = spec.head_dim, Dv = spec.dim_v();
  const int64_t group = H / G;
  const double scale = double(spec.scale());
  const Tolerance tol = tolerance_for(dtype);
  const std::vector<int64_t> rows = sample_rows(len);
  const int64_t R = int64_t(rows.size());
  CheckStats stats;
  if (R == 0) return stats;

  std::vector<int64_t> pos(size_t(R), 0);
  int64_t min_pos = S, max_pos = 0;
  for (int64_t j = 0; j < R; ++j) {
    pos[size_t(j)] = layout.global_position(rank, rows[size_t(j)]);
    min_pos = std::min(min_pos, pos[size_t(j)]);
    max_pos = std::max(max_pos, pos[size_t(j)]);
  }
  // Keys outside the band of every sampled query are invisible: no need to visit them.
  const int64_t key_begin =
      spec.mask.left >= 0 ? std::max<int64_t>(0, min_pos - spec.mask.left) : 0;
  const int64_t key_end =  // max_pos + right + 1 could overflow for a huge right window
      spec.mask.right >= 0 ? max_pos + 1 + std::min(spec.mask.right, S - 1 - max_pos) : S;
  constexpr int64_t kChunk = 256;
  const float* out = res.out.ptr<float>();
  const float* lse = res.lse.ptr<float>();

  for (int64_t b = 0; b < batch; ++b) {
    // Query rows and the running state (max m, sum l, weighted sum acc) per (row, head).
    std::vector<double> qv(size_t(R * H * D)), m(size_t(R * H), -INFINITY), l(size_t(R * H), 0.0),
        acc(size_t(R * H * Dv), 0.0);
    for (int64_t j = 0; j < R; ++j)
      for (int64_t h = 0; h < H; ++h) {
        const uint64_t row = row_key(kQ, b, pos[size_t(j)], tp_rank * H + h);
        for (int64_t d = 0; d < D; ++d)
          qv[size_t((j * H + h) * D + d)] = input_value(row, d, dtype);
      }
    std::vector<double> kc(size_t(kChunk * G * D)), vc(size_t(kChunk * G * Dv));
    for (int64_t k0 = key_begin; k0 < key_end; k0 += kChunk) {
      const int64_t kn = std::min(kChunk, key_end - k0);
#pragma omp parallel for schedule(static)
      for (int64_t c = 0; c < kn; ++c)
        for (int64_t g = 0; g < G; ++g) {
          const uint64_t krow = row_key(kK, b, k0 + c, tp_rank * G + g),
                         vrow = row_key(kV, b, k0 + c, tp_rank * G + g);
          for (int64_t d = 0; d < D; ++d)
            kc[size_t((c * G + g) * D + d)] = input_value(krow, d, dtype);
          for (int64_t d = 0; d < Dv; ++d)
            vc[size_t((c * G + g) * Dv + d)] = input_value(vrow, d, dtype);
        }
#pragma omp parallel for schedule(dynamic, 1)
      for (int64_t jh = 0; jh < R * H; ++jh) {
        const int64_t j = jh / H, h = jh % H, g = h / group;
        const double* q = &qv[size_t(jh * D)];
        double s[kChunk];
        double chunk_max = -INFINITY;
        for (int64_t c = 0; c < kn; ++c) {
          if (!spec.mask.visible(pos[size_t(j)], k0 + c)) {
            s[c] = -INFINITY;
            continue;
          }
          const double* kr = &kc[size_t((c * G + g) * D)];
          double dot = 0;
          for (int64_t d = 0; d < D; ++d)
            dot += q[d] * kr[d];
          s[c] = dot * scale;
          chunk_max = std::max(chunk_max, s[c]);
        }
        if (chunk_max == -INFINITY) continue;  // no visible key in this chunk
        double& mj = m[size_t(jh)];
        double* a = &acc[size_t(jh * Dv)];
        if (chunk_max > mj) {
          const double r = std::exp(mj - chunk_max);  // exp(-inf) = 0 on the first visible chunk
          l[size_t(jh)] *= r;
          for (int64_t d = 0; d < Dv; ++d)
            a[d] *= r;
          mj = chunk_max;
        }
        for (int64_t c = 0; c < kn; ++c) {
          if (s[c] == -INFINITY) continue;
          const double w = std::exp(s[c] - mj);
          l[size_t(jh)] += w;
          const double* vr = &vc[size_t((c * G + g) * Dv)];
          for (int64_t d = 0; d < Dv; ++d)
            a[d] += w * vr[d];
        }
      }
    }
    // Compare out (all Dv values, all heads) and lse of the sampled rows.
    for (int64_t j = 0; j < R; ++j) {
      const int64_t i = rows[size_t(j)];
      for (int64_t h = 0; h < H; ++h) {
        const int64_t jh = j * H + h;
        const bool empty = l[size_t(jh)] == 0.0;
        const double ref_lse = empty ? -INFINITY : m[size_t(jh)] + std::log(l[size_t(jh)]);
        const double got_lse = lse[(b * H + h) * len + i];
        stats.checked += 1;
        if (empty || !std::isfinite(got_lse)) {
          if (!(empty && got_lse == -INFINITY)) stats.wrong += 1;
        } else {
          const double err = std::abs(got_lse - ref_lse);
          stats.max_err_lse = std::max(stats.max_err_lse, err);
          if (!(err <= tol.lse_abs + tol.lse_rel * std::abs(ref_lse))) stats.wrong += 1;
        }
        for (int64_t d = 0; d < Dv; ++d) {
          const double ref = empty ? 0.0 : acc[size_t(jh * Dv + d)] / l[size_t(jh)];
          const double got = out[((b * len + i) * H + h) * Dv + d];
          const double err = std::abs(got - ref);
          stats.checked += 1;
          if (std::isfinite(err)) stats.max_err_out = std::max(stats.max_err_out, err);
          if (!(err <= tol.out_abs + tol.out_rel * std::abs(ref))) stats.wrong += 1;
        }
      }
    }
  }
  return stats;
}

// ================================================================== problems

// Document boundaries cu_seqlens = [0, e1, ..., S] for one sequence length: the --doc-lens, or
// --doc-count documents whose lengths (>= 1 token each) come from a hash with a fixed seed.
std::vector<int64_t> cu_seqlens_for(const Options& o, int64_t S) {
  std::vector<int64_t> cu = {0};
  if (!o.doc_lens.empty()) {
    for (int64_t n : o.doc_lens)
      cu.push_back(cu.back() + n);
    DATTN_ASSERT(cu.back() == S);
    return cu;
  }
  // One token each, and the other S - N spread in proportion to weights in (0, 1].
  const int64_t N = o.doc_count;
  std::vector<double> prefix(size_t(N) + 1, 0.0);
  for (int64_t d = 0; d < N; ++d) {
    const double w = double((mix64(0x5eedd0c5ull ^ uint64_t(d)) >> 11) + 1) * 0x1p-53;
    prefix[size_t(d) + 1] = prefix[size_t(d)] + w;
  }
  const int64_t extra = S - N;
  for (int64_t d = 1; d < N; ++d)
    cu.push_back(d + int64_t(double(extra) * prefix[size_t(d)] / prefix[size_t(N)]));
  cu.push_back(S);
  return cu;
}

// One problem: the spec (its mask) and the layout for one sequence length.
struct Problem {
  dattn::AttnSpec spec;
  Layout layout;
};

// The problem of length S on P ranks under layout `layout` ("striped" with --stripe-block) and
// mask `mask` (a -m name), the rest from the options.
Problem make_problem(const Options& o, int64_t S, int P, const std::string& layout,
                     const std::string& mask, int64_t stripe_block) {
  Problem p;
  p.spec.heads_q = o.local_heads();
  p.spec.heads_kv = o.local_kv_heads();
  p.spec.head_dim = o.head_dim;
  std::vector<int64_t> cu;
  if (o.has_documents()) cu = cu_seqlens_for(o, S);
  if (mask == "none") {
    p.spec.mask = dattn::Mask::none();
  } else if (mask == "causal") {
    p.spec.mask = dattn::Mask::causal();
  } else if (mask == "window") {
    p.spec.mask = dattn::Mask::window(o.window_left, o.window_right);
  } else {
    p.spec.mask = dattn::Mask::document(cu, o.doc_causal);
  }
  p.spec.validate();
  if (layout == "striped") {
    p.layout = Layout::striped(S, P, stripe_block);
  } else if (layout == "varlen") {
    p.layout = Layout::varlen(cu, P);
  } else {
    p.layout = Layout::make(layout, S, P);
  }
  return p;
}

Problem make_problem(const Options& o, int64_t S, int P) {
  return make_problem(o, S, P, o.layout, o.mask, o.stripe_block);
}

// The layout as the header names it: "striped(block 16)", "varlen(5 docs)".
std::string layout_desc(const Options& o) {
  if (o.layout == "striped") return dattn::detail::cat("striped(block ", o.stripe_block, ")");
  if (o.layout == "varlen") {
    return o.doc_lens.empty() ? dattn::detail::cat("varlen(", o.doc_count, " docs)")
                              : dattn::detail::cat("varlen(", o.doc_lens.size(), " docs)");
  }
  return o.layout;
}

// The load balance of a problem under the model: max over cp ranks of attention_rank_flops
// divided by its mean (1: balanced). Deterministic, so one rank computes it for all.
double model_imbalance(const Options& o, const Problem& p) {
  const int P = p.layout.ranks();
  double max = 0, sum = 0;
  for (int r = 0; r < P; ++r) {
    const double f =
        dattn::attention_rank_flops(o.strategy, p.layout, p.spec, o.batch, o.ulysses, r);
    max = std::max(max, f);
    sum += f;
  }
  return sum > 0 ? max / (sum / P) : 1.0;
}

// ================================================================== measurement

struct Row {
  int64_t seq = 0, local_seq = 0;
  double time_ms = 0, tflops_per_rank = 0, sent_mb_per_rank = 0, model_mb_per_rank = 0;
  double imbalance = 0;              // model max/mean per-rank FLOPs (rank 0 only)
  uint64_t byte_mismatch_ranks = 0;  // ranks whose counted bytes differ from the model
  bool checked = false;
  CheckStats check;  // summed (wrong, checked) and maxed (errors) over ranks
  uint64_t wrong() const { return byte_mismatch_ranks + (checked ? check.wrong : 0); }
};

double allreduce_max(double v) {
  DATTN_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
  return v;
}

uint64_t allreduce_u64(dattn::Runtime& rt, uint64_t v, dattn::ReduceOp op) {
  uint64_t out = 0;
  rt.world().allreduce_u64(&v, &out, 1, op);
  return out;
}

// Runs one problem: generate the shard, warm up, time, count bytes, check.
// `what` names the run in progress lines.
Row run_size(dattn::Runtime& rt, const Options& o, const Problem& p, const std::string& what) {
  const int P = rt.cp_size(), r = rt.cp_rank();
  const Layout& layout = p.layout;
  const dattn::AttnSpec& spec = p.spec;
  const int64_t S = layout.global_seq();
  Row row;
  row.seq = S;
  row.local_seq = layout.max_local_len();
  if (rt.rank() == 0) row.imbalance = model_imbalance(o, p);

  // This tp rank's heads of the global tensors.
  const int t = rt.tp_rank();
  const int64_t hq0 = t * spec.heads_q, hk0 = t * spec.heads_kv;
  const dattn::Device dev = rt.device();
  const Tensor q =
      on_device(make_shard(kQ, layout, r, o.batch, spec.heads_q, spec.head_dim, o.dtype, hq0), dev);
  const Tensor k = on_device(
      make_shard(kK, layout, r, o.batch, spec.heads_kv, spec.head_dim, o.dtype, hk0), dev);
  const Tensor v =
      on_device(make_shard(kV, layout, r, o.batch, spec.heads_kv, spec.dim_v(), o.dtype, hk0), dev);

  // With --backward: one forward, then the backward of it is what runs and is timed.
  dattn::Partial res;
  Tensor dout;
  if (o.backward) {
    dout = make_shard(kDout, layout, r, o.batch, spec.heads_q, spec.dim_v(), o.dtype, hq0);
    res = dattn::attention(rt, q, k, v, spec, layout, o.strategy);
  }
  auto call = [&] {
    if (o.backward)
      (void)dattn::attention_backward(rt, q, k, v, res, dout, spec, layout, o.strategy);
    else
      res = dattn::attention(rt, q, k, v, spec, layout, o.strategy);
    synchronize(dev);
  };
  dattn::Progress progress(rt.rank() == 0, what, o.warmup + o.iters);
  for (int w = 0; w < o.warmup; ++w) {
    call();
    progress.step();
  }
  rt.reset_counters();
  double seconds = 0;
  for (int it = 0; it < o.iters; ++it) {
    rt.world().barrier();
    const double t0 = MPI_Wtime();
    call();
    seconds += MPI_Wtime() - t0;
    progress.step();
  }
  const double mean_s = allreduce_max(seconds / o.iters);
  row.time_ms = mean_s * 1e3;
  row.tflops_per_rank = pass_flops(o, S, spec) / P / mean_s / 1e12;

  // Bytes: point-to-point and all-to-all payload counted by the communicators (cp and the hybrid
  // groups), against the model.
  const dattn::ByteCounters counted = rt.counters();
  const uint64_t sent = counted.bytes("send") + counted.bytes("alltoall");
  const uint64_t model = o.backward ? dattn::attention_backward_send_bytes(
                                          o.strategy, layout, spec, o.batch, o.dtype, o.ulysses, r)
                                    : dattn::attention_send_bytes(o.strategy, layout, spec, o.batch,
                                                                  o.dtype, o.ulysses, r);
  const bool mismatch = sent != model * uint64_t(o.iters);
  row.sent_mb_per_rank = double(allreduce_u64(rt, sent, dattn::ReduceOp::max)) / o.iters / 1e6;
  row.model_mb_per_rank = double(allreduce_u64(rt, model, dattn::ReduceOp::max)) / 1e6;
  row.byte_mismatch_ranks = allreduce_u64(rt, mismatch ? 1 : 0, dattn::ReduceOp::sum);

  if (o.check) {
    // The float64 check reads the result on the host.
    const dattn::Partial host = dev.is_cpu()
                                    ? res
                                    : dattn::Partial{res.out.to_device(dattn::Device::cpu()),
                                                     res.lse.to_device(dattn::Device::cpu())};
    CheckStats c = check_sampled_rows(host, layout, r, t, spec, o.batch, o.dtype);
    row.checked = true;
    row.check.checked = allreduce_u64(rt, c.checked, dattn::ReduceOp::sum);
    row.check.wrong = allreduce_u64(rt, c.wrong, dattn::ReduceOp::sum);
    row.check.max_err_out = allreduce_max(c.max_err_out);
    row.check.max_err_lse = allreduce_max(c.max_err_lse);
  }
  return row;
}

// The parallel efficiency the issues ask of the forward ring (0.85) and of its backward (0.8).
double scaling_target(const Options& o) {
  return o.backward ? 0.80 : 0.85;
}

struct Scaling {
  int64_t seq = 0;
  int threads_t1 = 0;
  double t1_ms = 0, tp_ms = 0, efficiency = 0;
  int rank0_cpus = 0;  // CPUs rank 0's threads could run on during the T1 runs
};

// The union of the affinity masks of the ranks on this node. Collective over rt.world().
// mpiexec binds each rank to its own core(s) by default (Open MPI: to a core for P <= 2), so
// rank 0 alone would run its P*T threads on its own core only; T1 must use the cores that the
// P ranks used for TP.
cpu_set_t node_cpu_union(dattn::Runtime& rt) {
  cpu_set_t mine;
  CPU_ZERO(&mine);
  if (sched_getaffinity(0, sizeof(mine), &mine) != 0) DATTN_THROW("sched_getaffinity failed");
  const auto node = rt.world().split_node();
  std::vector<cpu_set_t> all(size_t(node->size()));
  node->allgather(&mine, all.data(), sizeof(cpu_set_t));
  cpu_set_t u;
  CPU_ZERO(&u);
  for (const cpu_set_t& a : all)
    CPU_OR(&u, &u, &a);
  return u;
}

// Rank 0 alone computes the whole problem with attention_local on P*T threads allowed on the
// node's CPUs (mean over the same iterations, after the same warm-up) while the other ranks
// sleep in an MPI_Ibarrier poll, leaving their cores to it. Collective over the world; fills
// t1_ms and rank0_cpus on rank 0.
void time_single_rank(dattn::Runtime& rt, const Options& o, const dattn::AttnSpec& spec,
                      Scaling& s) {
  const cpu_set_t cpus = node_cpu_union(rt);
  DATTN_MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
  MPI_Request done = MPI_REQUEST_NULL;
  if (rt.rank() == 0) {
    const int saved_threads = omp_get_max_threads(), threads = s.threads_t1;
    omp_set_num_threads(threads);
    // Widen every team thread's affinity, then put each one back afterwards.
    std::vector<cpu_set_t> saved_masks(static_cast<size_t>(threads));
#pragma omp parallel num_threads(threads)
    {
      cpu_set_t& m = saved_masks[size_t(omp_get_thread_num())];
      CPU_ZERO(&m);
      sched_getaffinity(0, sizeof(m), &m);
      sched_setaffinity(0, sizeof(cpus), &cpus);
    }
    s.rank0_cpus = CPU_COUNT(&cpus);
    {
      const Layout whole = Layout::contiguous(s.seq, 1);
      const Tensor q = make_shard(kQ, whole, 0, o.batch, spec.heads_q, spec.head_dim, o.dtype);
      const Tensor k = make_shard(kK, whole, 0, o.batch, spec.heads_kv, spec.head_dim, o.dtype);
      const Tensor v = make_shard(kV, whole, 0, o.batch, spec.heads_kv, spec.dim_v(), o.dtype);
      const Tensor dout =
          o.backward ? make_shard(kDout, whole, 0, o.batch, spec.heads_q, spec.dim_v(), o.dtype)
                     : Tensor();
      const dattn::Partial fwd =
          o.backward ? dattn::attention_local(q, k, v, spec) : dattn::Partial();
      auto call = [&] {
        if (o.backward)
          (void)dattn::attention_local_backward(q, k, v, fwd, dout, spec);
        else
          (void)dattn::attention_local(q, k, v, spec);
      };
      for (int w = 0; w < o.warmup; ++w)
        call();
      double seconds = 0;
      for (int it = 0; it < o.iters; ++it) {
        const double t0 = MPI_Wtime();
        call();
        seconds += MPI_Wtime() - t0;
      }
      s.t1_ms = seconds / o.iters * 1e3;
    }
#pragma omp parallel num_threads(threads)
    {
      const cpu_set_t& m = saved_masks[size_t(omp_get_thread_num())];
      sched_setaffinity(0, sizeof(m), &m);
    }
    omp_set_num_threads(saved_threads);
    DATTN_MPI_CHECK(MPI_Ibarrier(MPI_COMM_WORLD, &done));
    DATTN_MPI_CHECK(MPI_Wait(&done, MPI_STATUS_IGNORE));
  } else {
    // A blocking MPI wait spins a core; poll gently instead.
    DATTN_MPI_CHECK(MPI_Ibarrier(MPI_COMM_WORLD, &done));
    int flag = 0;
    while (!flag) {
      DATTN_MPI_CHECK(MPI_Test(&done, &flag, MPI_STATUS_IGNORE));
      if (!flag) usleep(1000);
    }
  }
  s.efficiency = s.t1_ms / s.tp_ms;
}

// ================================================================== report

const dattn::report::Table& table() {
  static const dattn::report::Table t({{"seq", "(tokens)", 9},
                                       {"local_seq", "(tokens)", 10},
                                       {"time", "(ms)", 11},
                                       {"TFLOP/s", g_per_gpu ? "(per GPU)" : "(per rank)", 11},
                                       {"imbal", "(max/mean)", 11},
                                       {"sent", "(MB/rank)", 11},
                                       {"model", "(MB/rank)", 11},
                                       {"#wrong", "", 7}});
  return t;
}

void print_row(const Row& r) {
  using dattn::report::fixed;
  const std::string wrong =
      r.checked || r.byte_mismatch_ranks > 0 ? std::to_string(r.wrong()) : "N/A";
  table().print_row(
      stdout, {std::to_string(r.seq), std::to_string(r.local_seq), fixed(r.time_ms, 3),
               fixed(r.tflops_per_rank, 4), fixed(r.imbalance, 3), fixed(r.sent_mb_per_rank, 3),
               fixed(r.model_mb_per_rank, 3), wrong});
  std::fflush(stdout);
}

std::string row_json(const Options& o, int ranks, const Row& r) {
  dattn::report::ResultRow c;
  c.workload = o.backward ? "backward" : "prefill";
  c.strategy = dattn::strategy_name(o.strategy);
  c.layout = o.layout;
  c.seq = r.seq;
  c.ranks = ranks;
  c.time_ms = r.time_ms;
  c.tflops_per_rank = r.tflops_per_rank;
  c.sent_mb_per_rank = r.sent_mb_per_rank;
  c.model_mb_per_rank = r.model_mb_per_rank;
  c.wrong = r.checked || r.byte_mismatch_ranks > 0 ? int64_t(r.wrong()) : -1;
  dattn::report::JsonObject j = dattn::report::result_row(c);
  j.add("local_seq", r.local_seq)
      .add("imbalance", r.imbalance)
      .add("byte_mismatch_ranks", int64_t(r.byte_mismatch_ranks));
  if (r.checked) {
    j.add("checked_elements", int64_t(r.check.checked))
        .add("max_err_out", r.check.max_err_out)
        .add("max_err_lse", r.check.max_err_lse);
  }
  return j.str();
}

// The model's load balance of the run's mask at one length under each layout (root only).
struct LoadBalance {
  int64_t seq = 0;
  std::string mask;
  std::vector<std::pair<std::string, double>> layouts;  // name, max/mean
};

LoadBalance load_balance(const Options& o, int64_t S, int P) {
  LoadBalance lb;
  lb.seq = S;
  std::vector<std::string> kinds = {"contiguous", "zigzag", "striped"};
  if (o.has_documents()) kinds.push_back("varlen");
  for (const std::string& kind : kinds) {
    const Problem p = make_problem(o, S, P, kind, o.mask, 1);
    lb.mask = p.spec.mask.str();
    lb.layouts.emplace_back(kind, model_imbalance(o, p));
  }
  return lb;
}

// --compare-layouts and --compare-unmasked: the largest length rerun under other settings.
struct Comparison {
  int64_t seq = 0;
  std::string a_name, b_name;  // b / a is the ratio reported
  double a_ms = 0, b_ms = 0;
  double target = 0;
  uint64_t wrong = 0;  // of the extra runs
  double ratio() const { return b_ms / a_ms; }
};

// ================================================================== dry run

// --dry-run: the plan of every rank for the largest length (tokens, heads, device, FLOP and byte
// model) and a summary line per length; nothing is computed. Printed by rank 0 only; needs no
// Runtime, so --world-size can plan for more ranks than the job has.
void print_plan(const Options& o) {
  using dattn::detail::cat;
  const double start = MPI_Wtime();
  using dattn::report::fixed;
  const int W = o.launch.world, P = o.cp(), T = o.tp();
  const int64_t Hl = o.local_heads(), Gl = o.local_kv_heads();
  const std::vector<int64_t> seqs = sequence_lengths(o);
  std::printf("# dattn prefill plan (dry run, nothing computed), version %s\n", DATTN_VERSION);
  std::printf(
      "# world %d ranks = cp %d x tp %d (tp is the fastest rank index); strategy %s U %d; "
      "layout %s; dtype %s; batch %lld heads %lld kv-heads %lld head-dim %lld\n",
      W, P, T, dattn::strategy_name(o.strategy), o.ulysses, layout_desc(o).c_str(),
      dattn::dtype_name(o.dtype), static_cast<long long>(o.batch), static_cast<long long>(o.heads),
      static_cast<long long>(o.kv_heads), static_cast<long long>(o.head_dim));
  std::printf(
      "# communicators: %d cp group(s) of %d ranks (cp group t: world ranks t, t+%d, ...); "
      "%d tp group(s) of %d consecutive ranks%s\n",
      T, P, T, P, T,
      o.ulysses > 1 ? cat("; hybrid: ", P / o.ulysses, " Ulysses group(s) of ", o.ulysses,
                          " consecutive cp ranks, ", o.ulysses, " ring group(s) of ", P / o.ulysses,
                          " cp ranks")
                          .c_str()
                    : "");
  std::printf("# device: %s\n", dattn::device_plan(o.launch).c_str());
  for (int64_t S : seqs) {
    const Problem p = make_problem(o, S, P);
    double sum = 0, max = 0;
    uint64_t max_bytes = 0;
    for (int c = 0; c < P; ++c) {
      const double f =
          dattn::attention_rank_flops(o.strategy, p.layout, p.spec, o.batch, o.ulysses, c);
      sum += f;
      max = std::max(max, f);
      max_bytes = std::max(max_bytes, dattn::attention_send_bytes(o.strategy, p.layout, p.spec,
                                                                  o.batch, o.dtype, o.ulysses, c));
    }
    std::printf(
        "# seq %lld, %s: %.3f TFLOP in all (model, tiles computed), per rank max %.3f "
        "GFLOP, imbalance %.3f, sent per rank max %.3f MB per forward\n",
        static_cast<long long>(S), p.spec.mask.str().c_str(), sum * T / 1e12, max / 1e9,
        sum > 0 ? max / (sum / P) : 1.0, double(max_bytes) / 1e6);
  }
  const int64_t S = seqs.back();
  const Problem p = make_problem(o, S, P);
  const dattn::report::Table t({{"rank", "", 6},
                                {"cp", "", 5},
                                {"tp", "", 4},
                                {"tokens", "(local)", 9},
                                {"q_heads", "", 9},
                                {"kv_heads", "", 9},
                                {"GFLOP", "(model)", 11},
                                {"send", "(MB)", 10},
                                {"global positions", "(runs)", 0}});
  std::printf("# per rank, seq %lld:\n", static_cast<long long>(S));
  t.print_heading(stdout);
  for (int c = 0; c < P; ++c) {
    const double f =
        dattn::attention_rank_flops(o.strategy, p.layout, p.spec, o.batch, o.ulysses, c) / 1e9;
    const double mb = double(dattn::attention_send_bytes(o.strategy, p.layout, p.spec, o.batch,
                                                         o.dtype, o.ulysses, c)) /
                      1e6;
    std::vector<std::string> descs;
    for (const dattn::Run& run : p.layout.runs(c))
      descs.push_back(dattn::report::run_desc(run));
    const std::string runs = dattn::report::join(descs, " ");
    for (int tp = 0; tp < T; ++tp) {
      t.print_row(stdout,
                  {std::to_string(c * T + tp), std::to_string(c), std::to_string(tp),
                   std::to_string(p.layout.local_len(c)), dattn::report::index_range(tp * Hl, Hl),
                   dattn::report::index_range(tp * Gl, Gl), fixed(f, 3), fixed(mb, 3), runs});
    }
  }
  std::printf("# planned %d ranks in %.3f s\n", W, MPI_Wtime() - start);
  std::fflush(stdout);
}

// ================================================================== main

int prefill_bench(int argc, char** argv) {
  const std::optional<Options> parsed = parse_options(argc, argv);
  if (!parsed) return 0;
  const Options& o = *parsed;
  using dattn::detail::cat;
  if (o.launch.dry_run) {
    if (world_rank() == 0) print_plan(o);
    return 0;
  }

  dattn::RuntimeOptions ropts;
  ropts.cp = o.cp();
  ropts.tp = o.tp();
  ropts.device = o.launch.dev;
  ropts.threads = o.threads;
  ropts.ulysses = o.strategy == dattn::Strategy::hybrid ? o.ulysses : 1;
  dattn::Runtime rt = dattn::Runtime::from_mpi(MPI_COMM_WORLD, ropts);
  g_per_gpu = !rt.device().is_cpu();
  const int P = rt.cp_size(), T = rt.threads();
  const bool root = rt.rank() == 0;
  const std::vector<int64_t> seqs = sequence_lengths(o);
  const int64_t S_max = seqs.back();
  const Problem first = make_problem(o, seqs.front(), P);

  const auto ranks = dattn::report::gather_rank_info(MPI_COMM_WORLD, rt.device().str(), T);
  const std::string config = cat(
      "ranks ", rt.size(), " (cp ", P, " x tp ", rt.tp_size(), ") threads/rank ", T, " strategy ",
      dattn::strategy_name(o.strategy), " U ", o.ulysses, " layout ", layout_desc(o), " mask ",
      first.spec.mask.str(), " dtype ", dattn::dtype_name(o.dtype), " batch ", o.batch, " heads ",
      o.heads, " kv-heads ", o.kv_heads, " head-dim ", o.head_dim, " iters ", o.iters, " warmup ",
      o.warmup, " check ", o.check, " pass ", o.backward ? "backward" : "forward");
  if (root) {
    dattn::report::print_header(stdout, "dattn prefill benchmark", {config}, ranks);
    if (o.strategy == dattn::Strategy::ulysses)
      std::printf("# ulysses: the Ulysses degree is the number of cp ranks, U = %d\n", P);
    table().print_heading(stdout);
    std::fflush(stdout);
  }

  std::vector<Row> rows;
  for (int64_t S : seqs) {
    const Problem p = make_problem(o, S, P);
    const double gflop_rank = pass_flops(o, S, p.spec) / P / 1e9;
    if (root && gflop_rank * (o.iters + o.warmup) > 200) {  // more than a few seconds
      std::fprintf(stdout, "# running seq=%lld (%.0f GFLOP per rank per iteration) ...\n",
                   static_cast<long long>(S), gflop_rank);
      std::fflush(stdout);
    }
    rows.push_back(run_size(rt, o, p, cat("prefill seq ", S)));
    if (root) print_row(rows.back());
  }

  std::optional<Comparison> layouts_cmp, unmasked_cmp;
  if (o.compare_layouts) {
    Comparison c;
    c.seq = S_max;
    c.a_name = "contiguous";
    c.b_name = "zigzag";
    c.target = 0.75;
    if (root) {
      std::printf("# compare-layouts: seq %lld under layouts contiguous and zigzag ...\n",
                  static_cast<long long>(S_max));
      std::fflush(stdout);
    }
    const Row a = run_size(rt, o, make_problem(o, S_max, P, "contiguous", o.mask, 1),
                           "compare-layouts contiguous");
    const Row b =
        run_size(rt, o, make_problem(o, S_max, P, "zigzag", o.mask, 1), "compare-layouts zigzag");
    c.a_ms = a.time_ms;
    c.b_ms = b.time_ms;
    c.wrong = a.wrong() + b.wrong();
    layouts_cmp = c;
  }
  if (o.compare_unmasked) {
    Comparison c;
    c.seq = S_max;
    c.a_name = "none";
    c.b_name = o.mask;
    c.target = 0.25;
    if (root) {
      std::printf("# compare-unmasked: seq %lld with mask none ...\n",
                  static_cast<long long>(S_max));
      std::fflush(stdout);
    }
    const Row a = run_size(rt, o, make_problem(o, S_max, P, o.layout, "none", o.stripe_block),
                           "compare-unmasked");
    c.a_ms = a.time_ms;
    c.b_ms = rows.back().time_ms;  // the table's row of the largest length
    c.wrong = a.wrong();
    unmasked_cmp = c;
  }

  std::optional<Scaling> scaling;
  if (o.scaling) {
    Scaling s;
    s.seq = S_max;
    s.threads_t1 = P * T;
    s.tp_ms = rows.back().time_ms;
    if (root) {
      std::fprintf(stdout, "# scaling: rank 0 alone, seq=%lld on %d threads ...\n",
                   static_cast<long long>(s.seq), s.threads_t1);
      std::fflush(stdout);
    }
    time_single_rank(rt, o, make_problem(o, S_max, P).spec, s);
    scaling = s;
  }

  // ---------------------------------------------------------------- footer
  uint64_t wrong = 0, byte_mismatch = 0;
  double tflops = 0, max_err_out = 0, max_err_lse = 0;
  for (const Row& r : rows) {
    wrong += r.wrong();
    byte_mismatch += r.byte_mismatch_ranks;
    tflops += r.tflops_per_rank / double(rows.size());
    max_err_out = std::max(max_err_out, r.check.max_err_out);
    max_err_lse = std::max(max_err_lse, r.check.max_err_lse);
  }
  for (const auto* c : {&layouts_cmp, &unmasked_cmp})
    if (*c) wrong += (*c)->wrong;
  if (root) {
    using dattn::report::fixed;
    using dattn::report::print_footer_line;
    using dattn::report::sci;
    const Tolerance tol = tolerance_for(o.dtype);
    print_footer_line(stdout, "Out of bounds values",
                      std::to_string(wrong) + (wrong == 0 ? " OK" : " FAILED"));
    print_footer_line(stdout, g_per_gpu ? "Avg TFLOP/s per GPU" : "Avg TFLOP/s per rank",
                      fixed(tflops, 4));
    print_footer_line(stdout, "Byte model mismatches",
                      std::to_string(byte_mismatch) +
                          " (ranks x sizes whose counted bytes differ from the byte model)");
    std::printf(
        "# Check: #wrong = elements over tolerance vs a float64 reference (with --check 1:\n"
        "#   up to 32 sampled query rows per rank against all global keys, every head, out and\n"
        "#   lse; N/A without it) + one per rank whose sent bytes differ from the byte model.\n"
        "# Check: time = max over ranks of the mean per-iteration wall time; TFLOP/s per rank =\n"
        "#   attention_flops (the mask's visible pairs; x2.5 with --backward) / P / time;\n"
        "#   imbal = max / mean over cp\n"
        "#   ranks of dattn::attention_rank_flops (the tiles each rank computes, model);\n"
        "#   sent = point-to-point + all-to-all payload per rank per iteration, max over ranks\n"
        "#   (1 MB = 1e6 B); model = dattn::attention_send_bytes (with --backward\n"
        "#   attention_backward_send_bytes), max over ranks.\n");
    if (o.check) {
      std::printf(
          "# Check: tolerance out %g + %g*|ref|, lse %g + %g*|ref|; measured max |err| "
          "out %s, lse %s\n",
          tol.out_abs, tol.out_rel, tol.lse_abs, tol.lse_rel, sci(max_err_out, 2).c_str(),
          sci(max_err_lse, 2).c_str());
    }
    std::optional<LoadBalance> lb;
    if (o.mask != "none") {
      lb = load_balance(o, S_max, P);
      std::string line =
          cat("# load balance (max/mean per-rank FLOPs, model, seq ", lb->seq, ", ", lb->mask, ", ",
              dattn::strategy_name(o.strategy), " U ", o.ulysses, "):");
      for (const auto& [name, v] : lb->layouts)
        line += cat(" ", name, name == "striped" ? "(1) " : " ", fixed(v, 2));
      std::printf("%s\n", line.c_str());
    }
    if (layouts_cmp) {
      const Comparison& c = *layouts_cmp;
      std::printf(
          "# layouts: contiguous %.3f ms, zigzag %.3f ms, zigzag/contiguous = %.2f (target <= "
          "0.75 for causal on 2 ranks)\n",
          c.a_ms, c.b_ms, c.ratio());
    }
    if (unmasked_cmp) {
      const Comparison& c = *unmasked_cmp;
      std::printf("# unmasked: seq %lld, %s %.3f ms, none %.3f ms\n", static_cast<long long>(c.seq),
                  first.spec.mask.str().c_str(), c.b_ms, c.a_ms);
      std::printf("# %s/none time ratio = %.2f%s\n", o.mask.c_str(), c.ratio(),
                  o.mask == "window" ? " (target <= 0.25 for w = S/16)" : "");
    }
    if (scaling) {
      const Scaling& s = *scaling;
      std::printf(
          "# scaling: seq %lld, T1 (1 rank x %d threads) = %.3f ms, TP (%d ranks x %d threads) = "
          "%.3f ms, parallel efficiency T1/TP = %.2f (target >= %.2f%s)\n",
          static_cast<long long>(s.seq), s.threads_t1, s.t1_ms, P, T, s.tp_ms, s.efficiency,
          scaling_target(o), o.backward ? ", backward" : "");
      std::printf(
          "# scaling: T1 and TP are means over %d iterations after %d warm-up; T1 ran on the %d "
          "cpu(s) of the node's ranks (union of their affinity) while the other ranks slept\n",
          o.iters, o.warmup, s.rank0_cpus);
      if (s.rank0_cpus < s.threads_t1) {
        std::printf("# scaling: WARNING: %d threads on %d cpu(s): T1 is oversubscribed\n",
                    s.threads_t1, s.rank0_cpus);
      }
    }
    std::fflush(stdout);

    if (!o.json.empty()) {
      dattn::report::JsonObject cfg;
      cfg.add("program", "dattn-prefill-bench")
          .add("version", DATTN_VERSION)
          .add("ranks", rt.size())
          .add("threads_per_rank", T)
          .add("strategy", dattn::strategy_name(o.strategy))
          .add("ulysses_degree", o.ulysses)
          .add("layout", o.layout)
          .add("stripe_block", o.stripe_block)
          .add("documents", o.has_documents()
                                ? int64_t(o.doc_lens.empty() ? o.doc_count : o.doc_lens.size())
                                : int64_t(0))
          .add("mask", first.spec.mask.str())
          .add("dtype", dattn::dtype_name(o.dtype))
          .add("batch", o.batch)
          .add("heads", o.heads)
          .add("kv_heads", o.kv_heads)
          .add("head_dim", o.head_dim)
          .add("iters", o.iters)
          .add("warmup", o.warmup)
          .add("check", o.check == 1)
          .add("pass", o.backward ? "backward" : "forward")
          .add("with_cuda", bool(DATTN_WITH_CUDA))
          .add("with_nccl", bool(DATTN_WITH_NCCL));
      if (g_per_gpu) cfg.add("device", "cuda");  // one GPU per rank: per-rank figures are per GPU
      std::vector<std::string> jrows;
      for (const Row& r : rows)
        jrows.push_back(row_json(o, rt.size(), r));
      dattn::report::JsonObject top;
      top.add_raw("config", cfg.str())
          .add_raw("rows", dattn::report::json_array(jrows))
          .add("wrong", int64_t(wrong))
          .add("avg_tflops_per_rank", tflops);
      if (lb) {
        dattn::report::JsonObject jl;
        jl.add("seq", lb->seq).add("mask", lb->mask);
        for (const auto& [name, v] : lb->layouts)
          jl.add(name, v);
        top.add_raw("load_balance", jl.str());
      }
      if (layouts_cmp) {
        const Comparison& c = *layouts_cmp;
        dattn::report::JsonObject jc;
        jc.add("seq", c.seq)
            .add("mask", o.mask)
            .add("contiguous_ms", c.a_ms)
            .add("zigzag_ms", c.b_ms)
            .add("ratio", c.ratio())
            .add("target", c.target)
            .add("wrong", int64_t(c.wrong));
        top.add_raw("compare_layouts", jc.str());
      }
      if (unmasked_cmp) {
        const Comparison& c = *unmasked_cmp;
        dattn::report::JsonObject jc;
        jc.add("seq", c.seq)
            .add("mask", o.mask)
            .add("masked_ms", c.b_ms)
            .add("none_ms", c.a_ms)
            .add("ratio", c.ratio())
            .add("target", c.target)
            .add("wrong", int64_t(c.wrong));
        top.add_raw("compare_unmasked", jc.str());
      }
      if (scaling) {
        dattn::report::JsonObject js;
        js.add("seq", scaling->seq)
            .add("t1_threads", scaling->threads_t1)
            .add("t1_ms", scaling->t1_ms)
            .add("tp_ranks", P)
            .add("tp_threads_per_rank", T)
            .add("tp_ms", scaling->tp_ms)
            .add("efficiency", scaling->efficiency)
            .add("target", scaling_target(o))
            .add("statistic", "mean")
            .add("rank0_cpus", scaling->rank0_cpus);
        top.add_raw("scaling", js.str());
      }
      dattn::report::write_text_file(o.json, top.str());
    }
  }
  return wrong > 0 ? 1 : 0;
}

}  // namespace

namespace dattn::bench {
int prefill_main(int argc, char** argv) {
  return prefill_bench(argc, argv);
}
}  // namespace dattn::bench
