// dattn-star-bench: star attention (src/star.h), nccl-tests style. Phase 1 (the context
// encoding, an approximation) is timed against exact ring attention on the zigzag layout, with
// the bytes each rank sent against the models and the FLOP model's ratio; its accuracy is
// measured against the exact result, with and without an attention sink, with and without the
// anchor; phase 2 (exact decode steps, the query on the last rank) is timed against tree decode
// over a cache built the same way and, with --check, compared with it and with float64.
// Ranks form a cp x tp grid: tensor parallelism splits the heads, each tp slice runs star over
// its cp ranks; --dry-run prints every rank's block, heads, FLOPs and bytes without computing.
#include <mpi.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "collective/mpi_communicator.h"
#include "examples/bench_inputs.h"
#include "examples/bench_reference.h"
#include "examples/report.h"
#include "examples/workloads.h"
#include "launch/options.h"
#include "launch/program.h"
#include "launch/progress.h"
#include "src/attention.h"
#include "src/base/error.h"
#include "src/decode.h"
#include "src/layout.h"
#include "src/models.h"
#include "src/star.h"

namespace {

namespace po = boost::program_options;
using dattn::DType;
using dattn::Layout;
using dattn::Strategy;
using dattn::Tensor;
using dattn::bench::mix64;
using dattn::bench::row_key;

// The accuracy part runs exact attention (ring) over the whole context: above this length it
// runs at this length instead, with the block and the anchor scaled alike.
constexpr int64_t kAccuracyMaxSeq = 16384;
// Tokens that carry the attention sink (the context's first ones).
constexpr int64_t kSinkTokens = 4;

// ================================================================== options

struct Options {
  int64_t seq = 32768;
  int64_t block = 0;    // 0: seq / 16 (at least 1)
  int64_t anchor = -1;  // -1: block; 0: off
  int64_t batch = 1;
  int64_t heads = 8;
  int64_t kv_heads = 2;
  int64_t head_dim = 128;
  std::string dtype_name = "fp32";
  DType dtype = DType::f32;
  int64_t new_tokens = 1;  // S_q per decode step
  int steps = 5;
  int iters = 3;
  int warmup = 1;
  double sink = 4.0;
  int check = 0;
  int threads = 0;
  std::string json;
  dattn::LaunchOptions launch;  // --cp, --tp, --device, --dry-run, --config

  int cp() const { return launch.cp; }
  int tp() const { return launch.tp; }
  int64_t local_heads() const { return heads / launch.tp; }  // query heads of one tp rank
  int64_t local_kv_heads() const { return kv_heads / launch.tp; }
};

int world_rank() {
  int rank = 0;
  DATTN_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  return rank;
}

// Parses and validates the command line; nullopt when --help or --version was answered.
// Every rank parses the same arguments, so a UsageError is thrown on every rank alike.
std::optional<Options> parse_options(int argc, char** argv) {
  Options o;
  bool help = false, version = false;
  po::options_description desc(
      "dattn-star-bench: star attention, phase 1 (context encoding) against ring attention and "
      "its accuracy, phase 2 (decode) against tree decode\n"
      "usage: mpiexec -n P dattn-star-bench [options]\noptions");
  // clang-format off
  desc.add_options()
    ("seq,s", po::value(&o.seq)->default_value(o.seq), "context length S")
    ("block", po::value(&o.block)->value_name("arg (=S/16)"),
     "tokens per block b of the blocks layout (rank r holds blocks r*nb/P .. (r+1)*nb/P - 1)")
    ("anchor", po::value(&o.anchor)->value_name("arg (=block)"),
     "anchor a: the context's first tokens that prefix every rank's (0 .. block; 0 = off)")
    ("batch,b", po::value(&o.batch)->default_value(o.batch), "batch size B")
    ("heads,H", po::value(&o.heads)->default_value(o.heads), "query heads H_q")
    ("kv-heads,G", po::value(&o.kv_heads)->default_value(o.kv_heads),
     "key/value heads H_kv (H_q must be a multiple)")
    ("head-dim,d", po::value(&o.head_dim)->default_value(o.head_dim), "head dimension D")
    ("dtype,t", po::value(&o.dtype_name)->default_value(o.dtype_name),
     "storage dtype: fp32, bf16 or fp16")
    ("new-tokens,q", po::value(&o.new_tokens)->default_value(o.new_tokens),
     "tokens S_q per decode step (queries, and K/V appended to the cache)")
    ("steps", po::value(&o.steps)->default_value(o.steps), "decode steps (phase 2)")
    ("iters,n", po::value(&o.iters)->default_value(o.iters),
     "timed iterations of phase 1 and of ring attention")
    ("warmup,w", po::value(&o.warmup)->default_value(o.warmup),
     "untimed warm-up iterations of phase 1 and of ring attention")
    ("sink", po::value(&o.sink)->default_value(o.sink),
     "attention sink strength s: the first 4 keys and every query get s times a fixed direction "
     "(the sink keys' logits rise by about s^2); 0 = no sink")
    ("check,k", po::value(&o.check)->default_value(o.check),
     "compare every decode step of star with tree decode and with float64 (0 or 1)")
    ("threads,T", po::value(&o.threads)->default_value(o.threads),
     "OpenMP threads per rank (0: OMP_NUM_THREADS, else cores per rank)")
    ("json,J", po::value(&o.json)->value_name("FILE"), "also write the results as JSON to FILE")
    ("help,h", po::bool_switch(&help), "print this help")
    ("version,V", po::bool_switch(&version), "print the version");
  // clang-format on
  dattn::add_launch_options(desc, o.launch);
  po::variables_map vm;
  dattn::parse_command_line(argc, argv, desc, vm);
  if (help || version) {
    if (world_rank() == 0) {
      if (help) std::cout << desc << "\n";
      if (version) std::cout << "dattn-star-bench " << DATTN_VERSION << "\n";
    }
    return std::nullopt;
  }

  using dattn::require_option;
  using dattn::detail::cat;
  dattn::resolve_launch_options(o.launch, 1);
  require_option(o.seq >= 1, "--seq", o.seq, ">= 1");
  if (!vm.count("block")) o.block = std::max<int64_t>(1, o.seq / 16);
  require_option(o.block >= 1 && o.block <= o.seq, "--block", o.block,
                 cat(">= 1 and <= --seq (", o.seq, ")"));
  if (!vm.count("anchor")) o.anchor = o.block;
  require_option(o.anchor >= 0 && o.anchor <= o.block, "--anchor", o.anchor,
                 cat(">= 0 and <= --block (", o.block, ")"));
  require_option(o.batch >= 1, "--batch", o.batch, ">= 1");
  require_option(o.heads >= 1, "--heads", o.heads, ">= 1");
  require_option(o.kv_heads >= 1 && o.heads % o.kv_heads == 0, "--kv-heads", o.kv_heads,
                 cat(">= 1 and dividing --heads (", o.heads, ")"));
  require_option(o.kv_heads % o.tp() == 0, "--kv-heads", o.kv_heads,
                 cat("divisible by --tp (", o.tp(), "): tensor parallelism splits the heads"));
  require_option(o.head_dim >= 1, "--head-dim", o.head_dim, ">= 1");
  require_option(o.new_tokens >= 1, "--new-tokens", o.new_tokens, ">= 1");
  require_option(o.steps >= 1, "--steps", o.steps, ">= 1");
  require_option(o.iters >= 1, "--iters", o.iters, ">= 1");
  require_option(o.warmup >= 0, "--warmup", o.warmup, ">= 0");
  require_option(std::isfinite(o.sink) && o.sink >= 0, "--sink", o.sink, ">= 0");
  require_option(o.check == 0 || o.check == 1, "--check", o.check, "0 or 1");
  require_option(o.threads >= 0, "--threads", o.threads, ">= 0");
  try {
    o.dtype = dattn::parse_dtype(o.dtype_name);
  } catch (const dattn::Error&) {
    require_option(false, "--dtype", o.dtype_name, "fp32, bf16 or fp16");
  }
  return o;
}

// ================================================================== inputs

// Inputs come from a hash of (tensor, batch, global position, head, dim), as in the other
// benchmarks: every rank generates its own shard, the values do not depend on the rank count or
// the layout, and the float64 check regenerates any row. The attention sink adds `sink` times a
// fixed direction u (entries +-D^(-1/4), so |u|^2 = sqrt(D) = 1/scale) to the keys of the first
// kSinkTokens positions and to every query: a sink key's logit rises by sink^2 (16 at the
// default 4) plus terms of order sink / D^(1/4), so the first tokens take most of every row's
// attention, as in trained models.
enum TensorId : uint64_t { kQ = 1, kK = 2, kV = 3 };

// Uniform in [-1, 1) (24 random bits).
inline float raw_value(uint64_t row, int64_t d) {
  return float(mix64(row ^ (uint64_t(d) * 0xd1b54a32d192ed03ull)) >> 40) * 0x1p-23f - 1.0f;
}

// x rounded to the storage dtype: the value the kernel reads.
inline float round_to(float x, DType dtype) {
  switch (dtype) {
    case DType::f32:
      return x;
    case DType::bf16:
      return dattn::to_float(dattn::to_bf16(x));
    case DType::f16:
      return dattn::to_float(dattn::to_f16(x));
  }
  return x;
}

class Inputs {
 public:
  Inputs(DType dtype, double sink, int64_t head_dim) : dtype_(dtype), sink_(float(sink)) {
    const float mag = float(std::pow(double(head_dim), -0.25));
    dir_.resize(size_t(head_dim));
    for (int64_t d = 0; d < head_dim; ++d)
      dir_[size_t(d)] = (mix64(0x51a4d1e5ull ^ uint64_t(d)) & 1) ? mag : -mag;
  }
  DType dtype() const { return dtype_; }
  double sink() const { return sink_; }

  // The `dim` values of one row, rounded to the dtype.
  void row(TensorId id, int64_t b, int64_t pos, int64_t h, int64_t dim, float* out) const {
    const uint64_t key = row_key(id, b, pos, h);
    const bool sunk = sink_ != 0.f && (id == kQ || (id == kK && pos < kSinkTokens));
    for (int64_t d = 0; d < dim; ++d) {
      float x = raw_value(key, d);
      if (sunk) x += sink_ * dir_[size_t(d)];
      out[d] = round_to(x, dtype_);
    }
  }

 private:
  DType dtype_;
  float sink_;
  std::vector<float> dir_;  // u, [D]
};

// This rank's shard [B, local_len, heads, dim] of tensor `id` under `layout`: the heads
// head0 .. head0 + heads - 1 of the global tensor (a tensor-parallel rank's slice).
Tensor make_shard(const Inputs& in, TensorId id, const Layout& layout, int rank, int64_t batch,
                  int64_t heads, int64_t dim, int64_t head0) {
  const int64_t len = layout.local_len(rank);
  Tensor t = Tensor::empty({batch, len, heads, dim}, in.dtype());
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < len; ++i) {
      const int64_t pos = layout.global_position(rank, i);
      std::vector<float> vals(static_cast<size_t>(dim));
      for (int64_t h = 0; h < heads; ++h) {
        in.row(id, b, pos, head0 + h, dim, vals.data());
        const int64_t base = ((b * len + i) * heads + h) * dim;
        for (int64_t d = 0; d < dim; ++d)
          t.set(base + d, vals[size_t(d)]);
      }
    }
  }
  return t;
}

// Tokens at global positions pos0 .. pos0 + n - 1 of tensor `id`: [B, n, heads, dim], the same
// on every rank of a tp slice (the new tokens' K/V and the queries of one decode step); the
// heads head0 .. head0 + heads - 1 of the global tensor.
Tensor make_tokens(const Inputs& in, TensorId id, int64_t pos0, int64_t n, int64_t batch,
                   int64_t heads, int64_t dim, int64_t head0) {
  Tensor t = Tensor::empty({batch, n, heads, dim}, in.dtype());
  std::vector<float> vals(static_cast<size_t>(dim));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < heads; ++h) {
        in.row(id, b, pos0 + i, head0 + h, dim, vals.data());
        const int64_t base = ((b * n + i) * heads + h) * dim;
        for (int64_t d = 0; d < dim; ++d)
          t.set(base + d, vals[size_t(d)]);
      }
  return t;
}

// ================================================================== small helpers

double allreduce_max(double v) {
  DATTN_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD));
  return v;
}

uint64_t allreduce_u64(uint64_t v, MPI_Op op) {
  DATTN_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_UINT64_T, op, MPI_COMM_WORLD));
  return v;
}

// Nearest-rank percentile of sorted values.
double percentile(const std::vector<double>& sorted, double p) {
  const size_t n = sorted.size();
  size_t k = size_t(std::ceil(p / 100.0 * double(n)));
  k = std::clamp<size_t>(k, 1, n);
  return sorted[k - 1];
}

// The spec of every part: causal, one tp rank's share of the heads, dims from the options.
dattn::AttnSpec make_spec(const Options& o) {
  dattn::AttnSpec spec;
  spec.heads_q = o.local_heads();
  spec.heads_kv = o.local_kv_heads();
  spec.head_dim = o.head_dim;
  spec.mask = dattn::Mask::causal();
  spec.validate();
  return spec;
}

// ================================================================== phase 1: timing

struct TimedRow {
  std::string name;                  // "star", "ring"
  std::string layout;                // "blocks(b=.., a=..)", "zigzag"
  std::string layout_kind;           // "blocks", "zigzag"
  double time_ms = 0;                // mean over the timed iterations of the slowest rank's mean
  double sent_mb = 0, model_mb = 0;  // per rank per call, max over ranks (1 MB = 1e6 B)
  double gflop_max = 0;              // the FLOP model's max over ranks
  double imbalance = 0;              // its max / mean
  uint64_t byte_mismatches = 0;      // (rank, call) pairs whose counted bytes differ from the model
  double tflops_per_rank = 0;        // the problem's FLOPs / cp / time (see main)
};

// Runs `call` warmup + iters times (each after a barrier), counting the bytes of every call
// against `model` (this rank's model bytes of one call). `what` names it in progress lines.
void time_calls(dattn::Runtime& rt, const Options& o, const std::function<void()>& call,
                uint64_t model, TimedRow& row, const std::string& what) {
  double seconds = 0;
  uint64_t sent_sum = 0, mismatches = 0;
  dattn::Progress progress(rt.rank() == 0, what, o.warmup + o.iters);
  for (int it = 0; it < o.warmup + o.iters; ++it) {
    const bool timed = it >= o.warmup;
    rt.reset_counters();
    rt.world().barrier();
    const double t0 = MPI_Wtime();
    call();
    const double t = MPI_Wtime() - t0;
    const uint64_t sent = rt.counters().data_bytes();
    if (sent != model) mismatches += 1;
    if (timed) {
      seconds += t;
      sent_sum += sent;
    }
    progress.step();
  }
  row.time_ms = allreduce_max(seconds / o.iters) * 1e3;
  row.sent_mb = double(allreduce_u64(sent_sum, MPI_MAX)) / o.iters / 1e6;
  row.model_mb = double(allreduce_u64(model, MPI_MAX)) / 1e6;
  row.byte_mismatches = allreduce_u64(mismatches, MPI_SUM);
}

// max and max/mean over the ranks of a per-rank FLOP model; returns the sum.
double flop_model(int P, const std::function<double(int)>& flops, TimedRow& row) {
  double max = 0, sum = 0;
  for (int r = 0; r < P; ++r) {
    const double f = flops(r);
    max = std::max(max, f);
    sum += f;
  }
  row.gflop_max = max / 1e9;
  row.imbalance = sum > 0 ? max / (sum / P) : 1.0;
  return sum;
}

// ================================================================== phase 1: accuracy

// Star's phase 1 against the exact result, over every local row of every rank.
struct AccRow {
  double sink = 0;
  int64_t anchor = 0;
  double rel_err_out = 0;    // ||o_star - o_exact||_2 / ||o_exact||_2, all rows
  double lse_mean_abs = 0;   // mean |lse_star - lse_exact|, all rows and heads
  double rank0_rel_err = 0;  // the same over block 0's rows (exact by design)
  double rank0_lse_max = 0;  // max |lse diff| over block 0's rows
  uint64_t byte_mismatches = 0;
  bool rank0_exact = true;
  uint64_t wrong() const { return byte_mismatches + (rank0_exact ? 0 : 1); }
};

// Block 0's rows must equal exact attention up to fp32 rounding (they see all their keys).
constexpr double kRank0RelTol = 1e-5, kRank0LseTol = 1e-4;

// first_rows: how many of this rank's first rows form block 0 (0 on the other ranks).
AccRow compare_phase1(const dattn::Partial& star, const dattn::Partial& exact, int64_t first_rows) {
  // Sums over this rank: squared diff, squared ref (out), |lse diff| and count; block 0's rows
  // alone: squared diff, squared ref.
  const int64_t n = exact.out.size(1), hd = exact.out.size(2) * exact.out.size(3);
  double s[6] = {0, 0, 0, 0, 0, 0};
  double lse_max0 = 0;
  const float *so = star.out.ptr<float>(), *eo = exact.out.ptr<float>();
  const int64_t no = exact.out.numel();
  for (int64_t i = 0; i < no; ++i) {
    const double d = double(so[i]) - double(eo[i]);
    s[0] += d * d;
    s[1] += double(eo[i]) * double(eo[i]);
    if ((i / hd) % n < first_rows) {
      s[4] += d * d;
      s[5] += double(eo[i]) * double(eo[i]);
    }
  }
  const float *sl = star.lse.ptr<float>(), *el = exact.lse.ptr<float>();
  const int64_t nl = exact.lse.numel();
  for (int64_t i = 0; i < nl; ++i) {
    const double d = sl[i] == el[i] ? 0.0 : std::abs(double(sl[i]) - double(el[i]));
    s[2] += d;
    s[3] += 1;
    if (i % n < first_rows) lse_max0 = std::max(lse_max0, std::isfinite(d) ? d : INFINITY);
  }
  DATTN_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, s, 6, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
  AccRow a;
  a.rel_err_out = s[1] > 0 ? std::sqrt(s[0] / s[1]) : std::sqrt(s[0]);
  a.lse_mean_abs = s[3] > 0 ? s[2] / s[3] : 0;
  a.rank0_rel_err = s[5] > 0 ? std::sqrt(s[4] / s[5]) : std::sqrt(s[4]);
  a.rank0_lse_max = allreduce_max(lse_max0);
  a.rank0_exact = a.rank0_rel_err <= kRank0RelTol && a.rank0_lse_max <= kRank0LseTol;
  return a;
}

// For every sink setting (--sink, then 0) the exact result (ring attention over the blocks
// layout), then star's phase 1 with the anchor and without.
std::vector<AccRow> run_accuracy(dattn::Runtime& rt, const Options& o, const dattn::AttnSpec& spec,
                                 int64_t S, int64_t block, int64_t anchor) {
  const int P = rt.cp_size(), r = rt.cp_rank();
  const bool root = rt.rank() == 0;
  const Layout layout = Layout::blocks(S, P, block);
  const int64_t B = o.batch, H = spec.heads_q, G = spec.heads_kv, D = spec.head_dim;
  const int64_t Dv = spec.dim_v();
  const int64_t hq0 = rt.tp_rank() * H, hk0 = rt.tp_rank() * G;  // this tp rank's heads
  std::vector<double> sinks = {o.sink};
  if (o.sink != 0) sinks.push_back(0.0);
  std::vector<int64_t> anchors = {anchor};
  if (anchor != 0) anchors.push_back(0);
  std::vector<AccRow> rows;
  dattn::Progress progress(root, "star accuracy", int64_t(sinks.size() * (1 + anchors.size())),
                           "calls");
  for (double sink : sinks) {
    const Inputs in(o.dtype, sink, D);
    const Tensor q = make_shard(in, kQ, layout, r, B, H, D, hq0);
    const Tensor k = make_shard(in, kK, layout, r, B, G, D, hk0);
    const Tensor v = make_shard(in, kV, layout, r, B, G, Dv, hk0);
    if (root) {
      std::printf("# accuracy: %s, exact attention (ring over %s) ...\n",
                  sink != 0 ? dattn::detail::cat("sink ", sink).c_str() : "no sink",
                  layout.str().c_str());
      std::fflush(stdout);
    }
    const dattn::Partial exact = dattn::attention(rt, q, k, v, spec, layout, Strategy::ring);
    progress.step();
    for (int64_t a : anchors) {
      rt.reset_counters();
      const dattn::Partial star = dattn::star_prefill(rt, q, k, v, spec, layout, a);
      const uint64_t sent = rt.counters().data_bytes();
      const uint64_t model = dattn::star_prefill_send_bytes(layout, spec, B, o.dtype, a, r);
      const bool block0 = layout.local_len(r) > 0 && layout.global_position(r, 0) == 0;
      AccRow row = compare_phase1(star, exact, block0 ? std::min(block, layout.local_len(r)) : 0);
      row.sink = sink;
      row.anchor = a;
      row.byte_mismatches = allreduce_u64(sent != model ? 1 : 0, MPI_SUM);
      rows.push_back(row);
      progress.step();
    }
  }
  return rows;
}

// ================================================================== phase 2

// The inputs are rounded to the storage dtype before both sides and the kernel computes in fp32
// whatever the dtype, so one bound serves every dtype (as in dattn-decode-bench).
constexpr double kTolAbs = 1e-4, kTolRel = 1e-4;
// star_decode and tree decode are both exact over the same cached K/V: only the merge order
// differs.
constexpr double kSameAbs = 1e-5, kSameRel = 1e-5;

// out [B, S_q, H, D_v] and lse [B, H, S_q] in float64.
using Reference = dattn::bench::DecodeReference;

// The float64 check of a decode step (examples/bench_reference.h) over these inputs, for tp rank
// tp_rank's heads: computed over all H = --heads heads (collective over every rank), then cut.
Reference reference_decode(const Options& o, const Inputs& in, int64_t length, int tp_rank) {
  const Reference all = dattn::bench::decode_reference(
      {o.batch, o.new_tokens, o.heads, o.kv_heads, o.head_dim}, length, kQ, kK, kV,
      [&](uint64_t id, int64_t b, int64_t pos, int64_t h, int64_t dim, float* out) {
        in.row(TensorId(id), b, pos, h, dim, out);
      });
  const int64_t B = o.batch, Sq = o.new_tokens, H = o.heads, Hl = o.local_heads();
  const int64_t Dv = o.head_dim, h0 = tp_rank * Hl;
  if (Hl == H) return all;
  Reference mine;
  mine.out.reserve(size_t(B * Sq * Hl * Dv));
  mine.lse.reserve(size_t(B * Hl * Sq));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < Sq; ++j) {
      const auto first = all.out.begin() + ((b * Sq + j) * H + h0) * Dv;
      mine.out.insert(mine.out.end(), first, first + Hl * Dv);
    }
  for (int64_t b = 0; b < B; ++b) {
    const auto first = all.lse.begin() + (b * H + h0) * Sq;
    mine.lse.insert(mine.lse.end(), first, first + Hl * Sq);
  }
  return mine;
}

struct CheckStats {
  uint64_t checked = 0;  // elements compared (out and lse)
  uint64_t wrong = 0;    // elements over tolerance
  double max_err_out = 0, max_err_lse = 0;
};

// |got - ref| <= abs + rel * |ref|, with -inf lse (and its zero out) matched exactly.
void compare(double got, double ref, double abs, double rel, double& max_err, CheckStats& s) {
  s.checked += 1;
  if (std::isinf(ref) || std::isinf(got)) {
    if (got != ref) s.wrong += 1;
    return;
  }
  const double err = std::abs(got - ref);
  if (std::isfinite(err)) max_err = std::max(max_err, err);
  if (!(err <= abs + rel * std::abs(ref))) s.wrong += 1;
}

// Every element of a decode result against another (abs, rel) or the float64 reference.
void compare_result(const dattn::Partial& got, const std::vector<double>& ref_out,
                    const std::vector<double>& ref_lse, double abs, double rel, CheckStats& s) {
  if (size_t(got.out.numel()) != ref_out.size() || size_t(got.lse.numel()) != ref_lse.size()) {
    s.checked += ref_out.size() + ref_lse.size();
    s.wrong += ref_out.size() + ref_lse.size();
    return;
  }
  const float* out = got.out.ptr<float>();
  const float* lse = got.lse.ptr<float>();
  for (size_t i = 0; i < ref_out.size(); ++i)
    compare(out[i], ref_out[i], abs, rel, s.max_err_out, s);
  for (size_t i = 0; i < ref_lse.size(); ++i)
    compare(lse[i], ref_lse[i], abs, rel, s.max_err_lse, s);
}

std::vector<double> as_doubles(const Tensor& t) {
  const float* p = t.ptr<float>();
  return std::vector<double>(p, p + t.numel());
}

struct DecodeRow {
  std::string name;                  // "star", "tree"
  double mean_ms = 0, p50_ms = 0;    // per-step latency, the slowest rank's
  double sent_kb = 0, model_kb = 0;  // per rank per step, max over ranks (1 KB = 1e3 B)
  double tflops_per_rank = 0;        // step_flops / cp / mean latency
  uint64_t byte_mismatches = 0;      // (rank, step) pairs off the model
  uint64_t wrong_check = 0;          // elements off (star: vs tree and float64; tree: float64)
  uint64_t wrong() const { return byte_mismatches + wrong_check; }
};

// The attention FLOPs of one phase-2 step by model, for the heads of `spec` (one tp rank's): the
// S_q new queries against the `context` tokens, every key visible (the context precedes them);
// the new tokens' keys among themselves are left out.
double step_flops(const Options& o, dattn::AttnSpec spec, int64_t context) {
  spec.mask = dattn::Mask::none();
  return dattn::attention_flops(o.batch, o.new_tokens, context, spec);
}

struct Phase2 {
  DecodeRow star, tree;
  int64_t context = 0, final_length = 0;
  bool checked = false;
  CheckStats star_vs_tree, star_vs_ref, tree_vs_ref;  // summed over steps (last rank)
};

// One decode step's timing and bytes.
struct StepAcc {
  std::vector<double> times;
  uint64_t sent_sum = 0, model_sum = 0, mismatches = 0;
};

void finish_row(const Options& o, StepAcc& acc, DecodeRow& row) {
  DATTN_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, acc.times.data(), int(acc.times.size()), MPI_DOUBLE,
                                MPI_MAX, MPI_COMM_WORLD));
  double total = 0;
  for (double t : acc.times)
    total += t;
  std::sort(acc.times.begin(), acc.times.end());
  row.mean_ms = total / double(acc.times.size()) * 1e3;
  row.p50_ms = percentile(acc.times, 50) * 1e3;
  row.sent_kb = double(allreduce_u64(acc.sent_sum, MPI_MAX)) / o.steps / 1e3;
  row.model_kb = double(allreduce_u64(acc.model_sum, MPI_MAX)) / o.steps / 1e3;
  row.byte_mismatches = allreduce_u64(acc.mismatches, MPI_SUM);
}

Phase2 run_phase2(dattn::Runtime& rt, const Options& o, const dattn::AttnSpec& spec,
                  const Layout& layout, const Inputs& in) {
  const int P = rt.cp_size(), r = rt.cp_rank();
  const bool root = rt.rank() == 0, query_rank = r == P - 1;
  const int64_t Sq = o.new_tokens, B = o.batch;
  const int64_t H = spec.heads_q, G = spec.heads_kv, D = spec.head_dim, Dv = spec.dim_v();
  const int64_t hq0 = rt.tp_rank() * H, hk0 = rt.tp_rank() * G;  // this tp rank's heads
  const int node_size = rt.spans_nodes() ? rt.node().size() : 0;
  Phase2 res;
  res.star.name = "star";
  res.tree.name = "tree";
  res.context = layout.global_seq();
  res.checked = o.check == 1;

  if (root) {
    std::printf("# phase 2: prefilling two caches (last_rank placement) with the %s shards ...\n",
                layout.str().c_str());
    std::fflush(stdout);
  }
  const int64_t capacity = layout.max_local_len() + int64_t(o.steps) * Sq;
  dattn::KvCache star_cache(P, r, spec, B, o.dtype, capacity, dattn::Placement::last_rank);
  dattn::KvCache tree_cache(P, r, spec, B, o.dtype, capacity, dattn::Placement::last_rank);
  {
    const Tensor k = make_shard(in, kK, layout, r, B, G, D, hk0);
    const Tensor v = make_shard(in, kV, layout, r, B, G, Dv, hk0);
    star_cache.prefill(k, v, layout);
    tree_cache.prefill(k, v, layout);
  }
  if (root) {
    std::printf("# phase 2: %d decode steps of %lld token(s), star_decode then tree decode%s ...\n",
                o.steps, static_cast<long long>(Sq),
                o.check ? ", each checked against the other and float64" : "");
    std::fflush(stdout);
  }

  StepAcc star_acc, tree_acc;
  dattn::Progress progress(root, "star phase 2", o.steps, "steps");
  for (int step = 0; step < o.steps; ++step) {
    const int64_t pos0 = star_cache.length();
    {
      const Tensor k_new = make_tokens(in, kK, pos0, Sq, B, G, D, hk0);
      const Tensor v_new = make_tokens(in, kV, pos0, Sq, B, G, Dv, hk0);
      star_cache.append(k_new, v_new);
      tree_cache.append(k_new, v_new);
    }
    const Tensor q = make_tokens(in, kQ, pos0, Sq, B, H, D, hq0);

    rt.reset_counters();
    rt.world().barrier();
    double t0 = MPI_Wtime();
    const dattn::Partial star = dattn::star_decode(rt, q, star_cache);
    star_acc.times.push_back(MPI_Wtime() - t0);
    uint64_t sent = rt.counters().data_bytes();
    uint64_t model = dattn::star_decode_send_bytes(star_cache, Sq, r);
    star_acc.sent_sum += sent;
    star_acc.model_sum += model;
    if (sent != model) star_acc.mismatches += 1;

    rt.reset_counters();
    rt.world().barrier();
    t0 = MPI_Wtime();
    const dattn::Partial tree = dattn::decode(rt, q, tree_cache, Strategy::tree);
    tree_acc.times.push_back(MPI_Wtime() - t0);
    sent = rt.counters().data_bytes();
    model = dattn::decode_send_bytes(Strategy::tree, tree_cache, Sq, node_size, r);
    tree_acc.sent_sum += sent;
    tree_acc.model_sum += model;
    if (sent != model) tree_acc.mismatches += 1;

    if (o.check) {
      const Reference ref = reference_decode(o, in, star_cache.length(), rt.tp_rank());
      if (query_rank) {
        compare_result(star, as_doubles(tree.out), as_doubles(tree.lse), kSameAbs, kSameRel,
                       res.star_vs_tree);
        compare_result(star, ref.out, ref.lse, kTolAbs, kTolRel, res.star_vs_ref);
        compare_result(tree, ref.out, ref.lse, kTolAbs, kTolRel, res.tree_vs_ref);
      }
    }
    progress.step();
  }
  res.final_length = star_cache.length();
  finish_row(o, star_acc, res.star);
  finish_row(o, tree_acc, res.tree);
  for (DecodeRow* d : {&res.star, &res.tree})
    d->tflops_per_rank = step_flops(o, spec, res.context) / P / (d->mean_ms * 1e-3) / 1e12;
  for (CheckStats* c : {&res.star_vs_tree, &res.star_vs_ref, &res.tree_vs_ref}) {
    c->checked = allreduce_u64(c->checked, MPI_SUM);
    c->wrong = allreduce_u64(c->wrong, MPI_SUM);
    c->max_err_out = allreduce_max(c->max_err_out);
    c->max_err_lse = allreduce_max(c->max_err_lse);
  }
  res.star.wrong_check = res.star_vs_tree.wrong + res.star_vs_ref.wrong;
  res.tree.wrong_check = res.tree_vs_ref.wrong;
  return res;
}

// ================================================================== report

const dattn::report::Table& phase1_table() {
  static const dattn::report::Table t({{"strategy", "", 9},
                                       {"layout", "", 24},
                                       {"time", "(ms)", 11},
                                       {"sent", "(MB/rank)", 10},
                                       {"model", "(MB)", 10},
                                       {"flops max", "(GFLOP/rank)", 13},
                                       {"imbal", "", 6},
                                       {"#wrong", "", 7}});
  return t;
}

const dattn::report::Table& accuracy_table() {
  static const dattn::report::Table t({{"inputs", "", 10},
                                       {"anchor", "(tokens)", 9},
                                       {"rel_err(out)", "(all rows)", 13},
                                       {"rel_err(lse)", "(mean abs)", 13},
                                       {"block 0", "(rel_err out)", 14},
                                       {"#wrong", "", 7}});
  return t;
}

const dattn::report::Table& phase2_table() {
  static const dattn::report::Table t({{"strategy", "", 9},
                                       {"context", "(tokens)", 9},
                                       {"mean", "(ms)", 10},
                                       {"p50", "(ms)", 10},
                                       {"sent", "(KB/rank/step)", 14},
                                       {"model", "(KB)", 10},
                                       {"#wrong", "", 7}});
  return t;
}

std::string sink_name(double sink) {
  return sink != 0 ? dattn::detail::cat("sink ", dattn::report::fixed(sink, 1)) : "no sink";
}

// Phase 1 (star_prefill, ring attention) and phase 2 (star_decode, tree decode) rows: the common
// row keys (report::ResultRow: seq = S, the context of phase 2 too; time_ms = one phase-1 call, or
// phase 2's mean step latency; MB per rank per call or step), then "phase" and the row's own.
std::string timed_json(const Options& o, int ranks, const TimedRow& r) {
  dattn::report::ResultRow c;
  c.workload = "star";
  c.strategy = r.name;
  c.layout = r.layout_kind;
  c.seq = o.seq;
  c.ranks = ranks;
  c.time_ms = r.time_ms;
  c.tflops_per_rank = r.tflops_per_rank;
  c.sent_mb_per_rank = r.sent_mb;
  c.model_mb_per_rank = r.model_mb;
  c.wrong = int64_t(r.byte_mismatches);
  dattn::report::JsonObject j = dattn::report::result_row(c);
  j.add("phase", 1)
      .add("model_gflop_max", r.gflop_max)
      .add("imbalance", r.imbalance)
      .add("byte_mismatches", int64_t(r.byte_mismatches));
  return j.str();
}

std::string accuracy_json(const AccRow& a) {
  dattn::report::JsonObject j;
  j.add("sink", a.sink)
      .add("anchor", a.anchor)
      .add("rel_err_out", a.rel_err_out)
      .add("lse_mean_abs_err", a.lse_mean_abs)
      .add("rank0_rel_err_out", a.rank0_rel_err)
      .add("rank0_lse_max_abs_err", a.rank0_lse_max)
      .add("rank0_exact", a.rank0_exact)
      .add("byte_mismatches", int64_t(a.byte_mismatches))
      .add("wrong", int64_t(a.wrong()));
  return j.str();
}

std::string decode_json(int ranks, const Phase2& p2, const DecodeRow& r) {
  dattn::report::ResultRow c;
  c.workload = "star";
  // "star_decode", not "star": a series is (workload, strategy, layout, ranks) for the plotting
  // script, and phase 1's star row has the same layout.
  c.strategy = r.name == "star" ? "star_decode" : r.name;
  c.layout = "blocks";  // both caches hold the phase-1 blocks
  c.seq = p2.context;
  c.ranks = ranks;
  c.time_ms = r.mean_ms;
  c.tflops_per_rank = r.tflops_per_rank;
  c.sent_mb_per_rank = r.sent_kb / 1e3;
  c.model_mb_per_rank = r.model_kb / 1e3;
  c.wrong = int64_t(r.wrong());
  dattn::report::JsonObject j = dattn::report::result_row(c);
  j.add("phase", 2)
      .add("p50_ms", r.p50_ms)
      .add("byte_mismatches", int64_t(r.byte_mismatches))
      .add("wrong_check", int64_t(r.wrong_check));
  return j.str();
}

std::string check_json(const CheckStats& c) {
  dattn::report::JsonObject j;
  j.add("checked", int64_t(c.checked))
      .add("wrong", int64_t(c.wrong))
      .add("max_err_out", c.max_err_out)
      .add("max_err_lse", c.max_err_lse);
  return j.str();
}

// ================================================================== dry run

// --dry-run: every rank's block of the context (Layout::blocks), whether it holds the anchor,
// its heads, its phase-1 FLOPs and bytes (star_prefill_flops, star_prefill_send_bytes) and its
// bytes per phase-2 step (star_decode_send_bytes, with tree decode's decode_send_bytes beside
// it); nothing is computed. Printed by rank 0 only; needs no Runtime, so --world-size can plan
// for more ranks than the job has.
void print_plan(const Options& o) {
  using dattn::detail::cat;
  using dattn::report::fixed;
  const double start = MPI_Wtime();
  const int W = o.launch.world, P = o.cp(), T = o.tp();
  const int64_t Hl = o.local_heads(), Gl = o.local_kv_heads(), S = o.seq, B = o.batch;
  const int64_t Sq = o.new_tokens;
  const dattn::AttnSpec spec = make_spec(o);
  const Layout blocks = Layout::blocks(S, P, o.block);
  // Phase 2's byte models read the cache's ranks, heads, batch and dtype, not its tokens: an
  // empty cache serves.
  const dattn::KvCache cache(P, 0, spec, B, o.dtype, 0, dattn::Placement::last_rank);

  std::printf("# dattn star plan (dry run, nothing computed), version %s\n", DATTN_VERSION);
  std::printf(
      "# world %d ranks = cp %d x tp %d (tp is the fastest rank index); seq %lld block %lld "
      "anchor %lld; mask causal dtype %s; batch %lld heads %lld kv-heads %lld head-dim %lld; "
      "iters %d warmup %d new-tokens %lld steps %d\n",
      W, P, T, static_cast<long long>(S), static_cast<long long>(o.block),
      static_cast<long long>(o.anchor), dattn::dtype_name(o.dtype), static_cast<long long>(B),
      static_cast<long long>(o.heads), static_cast<long long>(o.kv_heads),
      static_cast<long long>(o.head_dim), o.iters, o.warmup, static_cast<long long>(Sq), o.steps);
  std::printf(
      "# communicators: %d cp group(s) of %d ranks (cp group t: world ranks t, t+%d, ...); "
      "%d tp group(s) of %d consecutive ranks; phase 2's query rank: cp rank %d of each cp "
      "group\n",
      T, P, T, P, T, P - 1);
  std::printf("# device: %s\n", dattn::device_plan(o.launch).c_str());
  std::vector<double> flops(static_cast<size_t>(P));
  double sum = 0, max = 0;
  uint64_t anchor_bytes = 0;
  for (int c = 0; c < P; ++c) {
    flops[size_t(c)] = dattn::star_prefill_flops(blocks, spec, B, o.anchor, c);
    sum += flops[size_t(c)];
    max = std::max(max, flops[size_t(c)]);
    anchor_bytes = std::max(anchor_bytes,
                            dattn::star_prefill_send_bytes(blocks, spec, B, o.dtype, o.anchor, c));
  }
  std::printf(
      "# phase 1, star_prefill over %s: %.3f TFLOP in all (model: exact visible pairs), per rank "
      "max %.3f GFLOP, imbalance %.3f; the anchor's K/V sent once, %.3f MB per tp slice\n",
      blocks.str().c_str(), sum * T / 1e12, max / 1e9, sum > 0 ? max / (sum / P) : 1.0,
      double(anchor_bytes) / 1e6);
  std::printf(
      "# phase 2: %d steps of %lld token(s), both caches last_rank placement (the decoded tokens "
      "go to cp rank %d); tree bytes for the flat tree (the plan assumes one node)\n",
      o.steps, static_cast<long long>(Sq), P - 1);
  const dattn::report::Table t({{"rank", "", 6},
                                {"cp", "", 5},
                                {"tp", "", 4},
                                {"tokens", "(local)", 9},
                                {"blocks", "", 7},
                                {"anchor", "", 7},
                                {"q_heads", "", 9},
                                {"kv_heads", "", 9},
                                {"phase 1", "(GFLOP)", 11},
                                {"phase 1", "(send MB)", 10},
                                {"star", "(KB/step)", 10},
                                {"tree", "(KB/step)", 10},
                                {"global positions", "(runs)", 0}});
  std::printf("# per rank (anchor: holds = it holds the context's first tokens and sends them):\n");
  t.print_heading(stdout);
  for (int c = 0; c < P; ++c) {
    const int64_t len = blocks.local_len(c);
    std::vector<std::string> descs;
    bool anchor = false;
    for (const dattn::Run& run : blocks.runs(c)) {
      if (run.length == 0) continue;
      descs.push_back(dattn::report::run_desc(run));
      anchor = anchor || (run.global_begin == 0 && o.anchor > 0);
    }
    const double mb =
        double(dattn::star_prefill_send_bytes(blocks, spec, B, o.dtype, o.anchor, c)) / 1e6;
    const double star_kb = double(dattn::star_decode_send_bytes(cache, Sq, c)) / 1e3;
    const double tree_kb = double(dattn::decode_send_bytes(Strategy::tree, cache, Sq, 0, c)) / 1e3;
    std::vector<std::string> cells = {"",
                                      std::to_string(c),
                                      "",
                                      std::to_string(len),
                                      std::to_string((len + o.block - 1) / o.block),
                                      anchor ? "holds" : "-",
                                      "",
                                      "",
                                      fixed(flops[size_t(c)] / 1e9, 3),
                                      fixed(mb, 3),
                                      fixed(star_kb, 3),
                                      fixed(tree_kb, 3),
                                      descs.empty() ? "-" : dattn::report::join(descs, " ")};
    for (int tp = 0; tp < T; ++tp) {
      cells[0] = std::to_string(c * T + tp);
      cells[2] = std::to_string(tp);
      cells[6] = dattn::report::index_range(tp * Hl, Hl);
      cells[7] = dattn::report::index_range(tp * Gl, Gl);
      t.print_row(stdout, cells);
    }
  }
  std::printf("# planned %d ranks in %.3f s\n", W, MPI_Wtime() - start);
  std::fflush(stdout);
}

// ================================================================== main

int star_bench(int argc, char** argv) {
  const std::optional<Options> parsed = parse_options(argc, argv);
  if (!parsed) return 0;
  const Options& o = *parsed;
  using dattn::detail::cat;
  using dattn::report::fixed;
  using dattn::report::sci;
  if (o.launch.dry_run) {
    if (world_rank() == 0) print_plan(o);
    return 0;
  }

  dattn::RuntimeOptions ropts;
  ropts.cp = o.cp();
  ropts.tp = o.tp();
  ropts.device = o.launch.dev;
  ropts.threads = o.threads;
  dattn::Runtime rt = dattn::Runtime::from_mpi(MPI_COMM_WORLD, ropts);
  const int P = rt.cp_size(), r = rt.cp_rank(), T = rt.threads();
  const bool root = rt.rank() == 0;
  const dattn::AttnSpec spec = make_spec(o);
  // H and G: this tp rank's heads, hq0 and hk0 the first of them among the global heads.
  const int64_t S = o.seq, B = o.batch, H = spec.heads_q, G = spec.heads_kv, D = o.head_dim;
  const int64_t Dv = spec.dim_v(), hq0 = rt.tp_rank() * H, hk0 = rt.tp_rank() * G;
  const Layout blocks = Layout::blocks(S, P, o.block);
  const Layout zigzag = Layout::zigzag(S, P);

  // The accuracy part's problem: the same, or at kAccuracyMaxSeq with the block and the anchor
  // scaled alike (an anchor stays >= 1 token, and a = b stays a = b).
  const bool acc_scaled = S > kAccuracyMaxSeq;
  const int64_t acc_S = acc_scaled ? kAccuracyMaxSeq : S;
  const int64_t acc_block = acc_scaled ? std::max<int64_t>(1, o.block * acc_S / S) : o.block;
  const int64_t acc_anchor =
      !acc_scaled || o.anchor == 0
          ? o.anchor
          : std::clamp<int64_t>(o.anchor == o.block ? acc_block : o.anchor * acc_S / S, 1,
                                acc_block);

  const auto ranks = dattn::report::gather_rank_info(MPI_COMM_WORLD, rt.device().str(), T);
  const std::vector<std::string> config = {
      cat("ranks ", rt.size(), " (cp ", P, " x tp ", rt.tp_size(), ") threads/rank ", T, " seq ", S,
          " block ", o.block, " anchor ", o.anchor, " mask causal dtype ",
          dattn::dtype_name(o.dtype), " sink ", o.sink),
      cat("batch ", B, " heads ", o.heads, " kv-heads ", o.kv_heads, " head-dim ", D, " iters ",
          o.iters, " warmup ", o.warmup, " new-tokens ", o.new_tokens, " steps ", o.steps,
          " check ", o.check),
      cat("phase 1: star_prefill over ", blocks.str(), " vs ring attention over ", zigzag.str(),
          "; accuracy at seq ", acc_S, " block ", acc_block, " anchor ", acc_anchor,
          acc_scaled ? cat(" (scaled from seq ", S, ": above ", kAccuracyMaxSeq, ")")
                     : std::string())};
  if (root) {
    dattn::report::print_header(stdout, "dattn star attention benchmark", config, ranks);
    std::fflush(stdout);
  }

  // ---------------------------------------------------------------- phase 1: timing
  const Inputs inputs(o.dtype, o.sink, D);
  TimedRow star_row, ring_row;
  star_row.name = "star";
  star_row.layout = cat("blocks(b=", o.block, ",a=", o.anchor, ")");
  star_row.layout_kind = Layout::kind_name(blocks.kind());
  ring_row.name = "ring";
  ring_row.layout = "zigzag";
  ring_row.layout_kind = Layout::kind_name(zigzag.kind());
  {
    if (root) {
      std::printf("# phase 1: star_prefill, %d warm-up + %d timed ...\n", o.warmup, o.iters);
      std::fflush(stdout);
    }
    const Tensor q = make_shard(inputs, kQ, blocks, r, B, H, D, hq0);
    const Tensor k = make_shard(inputs, kK, blocks, r, B, G, D, hk0);
    const Tensor v = make_shard(inputs, kV, blocks, r, B, G, Dv, hk0);
    time_calls(
        rt, o, [&] { (void)dattn::star_prefill(rt, q, k, v, spec, blocks, o.anchor); },
        dattn::star_prefill_send_bytes(blocks, spec, B, o.dtype, o.anchor, r), star_row,
        "star phase 1 star_prefill");
    const double flops = flop_model(
        P, [&](int rank) { return dattn::star_prefill_flops(blocks, spec, B, o.anchor, rank); },
        star_row);
    // TFLOP/s per rank: the FLOPs of star's own (approximate) problem, its exact visible pairs.
    star_row.tflops_per_rank = flops / P / (star_row.time_ms * 1e-3) / 1e12;
  }
  {
    if (root) {
      std::printf("# phase 1: ring attention (zigzag), %d warm-up + %d timed ...\n", o.warmup,
                  o.iters);
      std::fflush(stdout);
    }
    const Tensor q = make_shard(inputs, kQ, zigzag, r, B, H, D, hq0);
    const Tensor k = make_shard(inputs, kK, zigzag, r, B, G, D, hk0);
    const Tensor v = make_shard(inputs, kV, zigzag, r, B, G, Dv, hk0);
    time_calls(
        rt, o, [&] { (void)dattn::attention(rt, q, k, v, spec, zigzag, Strategy::ring); },
        dattn::attention_send_bytes(Strategy::ring, zigzag, spec, B, o.dtype, 1, r), ring_row,
        "star phase 1 ring attention");
    flop_model(
        P,
        [&](int rank) {
          return dattn::attention_rank_flops(Strategy::ring, zigzag, spec, B, 1, rank);
        },
        ring_row);
    // As the prefill workload reports it: the causal attention model over all S tokens.
    ring_row.tflops_per_rank =
        dattn::attention_flops(B, S, S, spec) / P / (ring_row.time_ms * 1e-3) / 1e12;
  }
  const double measured = ring_row.time_ms / star_row.time_ms;
  const double model_ratio = ring_row.gflop_max / star_row.gflop_max;
  if (root) {
    phase1_table().print_heading(stdout);
    for (const TimedRow* t : {&star_row, &ring_row})
      phase1_table().print_row(
          stdout,
          {t->name, t->layout, fixed(t->time_ms, 2), fixed(t->sent_mb, 3), fixed(t->model_mb, 3),
           fixed(t->gflop_max, 1), fixed(t->imbalance, 2), std::to_string(t->byte_mismatches)});
    std::fflush(stdout);
  }

  // ---------------------------------------------------------------- phase 1: accuracy
  const std::vector<AccRow> acc = run_accuracy(rt, o, spec, acc_S, acc_block, acc_anchor);
  if (root) {
    std::printf("# accuracy of phase 1 at seq %lld, block %lld%s: star vs exact (ring)\n",
                static_cast<long long>(acc_S), static_cast<long long>(acc_block),
                acc_scaled ? cat(" (scaled from seq ", S, " block ", o.block, ")").c_str() : "");
    accuracy_table().print_heading(stdout);
    for (const AccRow& a : acc)
      accuracy_table().print_row(
          stdout, {sink_name(a.sink), std::to_string(a.anchor), sci(a.rel_err_out, 3),
                   sci(a.lse_mean_abs, 3), sci(a.rank0_rel_err, 2), std::to_string(a.wrong())});
    std::fflush(stdout);
  }

  // ---------------------------------------------------------------- phase 2
  const Phase2 p2 = run_phase2(rt, o, spec, blocks, inputs);
  if (root) {
    phase2_table().print_heading(stdout);
    for (const DecodeRow* d : {&p2.star, &p2.tree})
      phase2_table().print_row(
          stdout, {d->name, std::to_string(p2.context), fixed(d->mean_ms, 3), fixed(d->p50_ms, 3),
                   fixed(d->sent_kb, 3), fixed(d->model_kb, 3), std::to_string(d->wrong())});
    std::fflush(stdout);
  }

  // ---------------------------------------------------------------- footer
  uint64_t acc_wrong = 0;
  for (const AccRow& a : acc)
    acc_wrong += a.wrong();
  const uint64_t wrong = star_row.byte_mismatches + ring_row.byte_mismatches + acc_wrong +
                         p2.star.wrong() + p2.tree.wrong();
  const bool target_config =
      P == 4 && rt.tp_size() == 1 && S == 32768 && o.block == S / 16 && o.anchor == o.block;
  if (root) {
    using dattn::report::print_footer_line;
    print_footer_line(stdout, "Out of bounds values",
                      std::to_string(wrong) + (wrong == 0 ? " OK" : " FAILED"));
    std::printf(
        "# Check: phase 1 time = the slowest rank's mean over %d timed calls (after %d warm-up),\n"
        "#   each after a barrier. sent = bytes the communicators counted (every op but\n"
        "#   \"control\", the validation) per rank per call, max over ranks (1 MB = 1e6 B); every\n"
        "#   call of every rank must equal the model (star_prefill_send_bytes, "
        "attention_send_bytes)\n"
        "#   or it counts in #wrong. flops max = the FLOP model's max over ranks (star: exact\n"
        "#   visible pairs, star_prefill_flops; ring: visible kernel tiles, "
        "attention_rank_flops);\n"
        "#   imbal = its max / mean.\n"
        "# Check: accuracy = star's phase 1 against exact causal attention (ring over the same\n"
        "#   blocks layout), all rows of all ranks: ||o_star - o_exact|| / ||o_exact|| and the "
        "mean\n"
        "#   |lse diff|; sink s adds s * u (|u|^2 = sqrt(D)) to the first %lld keys and every "
        "query.\n"
        "#   block 0's rows (no prefix, all their keys) must be exact: rel_err <= %g and |lse "
        "diff|\n"
        "#   <= %g, else #wrong; so must star_prefill's bytes.\n"
        "# Check: phase 2 latency = per step, the slowest rank's time of star_decode / "
        "decode(tree)\n"
        "#   after a barrier, %d steps; both caches use last_rank placement; bytes per step "
        "against\n"
        "#   star_decode_send_bytes / decode_send_bytes (every step, else #wrong).\n",
        o.iters, o.warmup, static_cast<long long>(kSinkTokens), kRank0RelTol, kRank0LseTol,
        o.steps);
    if (o.check) {
      std::printf(
          "# Check: with -k 1 every step's result on the query rank (the last): star against tree\n"
          "#   within %g + %g*|tree|, both against float64 attention over all cached keys within\n"
          "#   %g + %g*|ref|; in #wrong.\n",
          kSameAbs, kSameRel, kTolAbs, kTolRel);
      print_footer_line(
          stdout, "star vs tree",
          cat(p2.star_vs_tree.wrong, " wrong; max |diff| out ", sci(p2.star_vs_tree.max_err_out, 2),
              ", lse ", sci(p2.star_vs_tree.max_err_lse, 2)));
      print_footer_line(
          stdout, "star vs float64",
          cat(p2.star_vs_ref.wrong, " wrong; max |err| out ", sci(p2.star_vs_ref.max_err_out, 2),
              ", lse ", sci(p2.star_vs_ref.max_err_lse, 2)));
      print_footer_line(
          stdout, "tree vs float64",
          cat(p2.tree_vs_ref.wrong, " wrong; max |err| out ", sci(p2.tree_vs_ref.max_err_out, 2),
              ", lse ", sci(p2.tree_vs_ref.max_err_lse, 2)));
    }
    std::printf(
        "# phase 1: star %s ms, ring (zigzag) %s ms, measured %s faster, model %s (target >= 4x "
        "at 4 ranks, S=32768, b=S/16, a=b)%s\n",
        fixed(star_row.time_ms, 2).c_str(), fixed(ring_row.time_ms, 2).c_str(),
        fixed(measured, 2).c_str(), fixed(model_ratio, 2).c_str(),
        target_config ? (measured >= 4 ? ": met" : ": NOT met")
                      : " (this run is not the target configuration)");
    std::printf("# phase 1 bytes: star %s MB/rank (max), ring %s MB/rank (max)\n",
                fixed(star_row.sent_mb, 3).c_str(), fixed(ring_row.sent_mb, 3).c_str());
    std::printf(
        "# phase 2: star_decode %s ms/step (p50 %s), tree %s ms/step (p50 %s): star/tree "
        "%s; bytes/step star %s KB, tree %s KB\n",
        fixed(p2.star.mean_ms, 3).c_str(), fixed(p2.star.p50_ms, 3).c_str(),
        fixed(p2.tree.mean_ms, 3).c_str(), fixed(p2.tree.p50_ms, 3).c_str(),
        fixed(p2.star.mean_ms / p2.tree.mean_ms, 2).c_str(), fixed(p2.star.sent_kb, 3).c_str(),
        fixed(p2.tree.sent_kb, 3).c_str());
    std::fflush(stdout);

    if (!o.json.empty()) {
      dattn::report::JsonObject cfg;
      cfg.add("program", "dattn-star-bench")
          .add("version", DATTN_VERSION)
          .add("ranks", rt.size())
          .add("threads_per_rank", T)
          .add("seq", S)
          .add("block", o.block)
          .add("anchor", o.anchor)
          .add("mask", "causal")
          .add("dtype", dattn::dtype_name(o.dtype))
          .add("batch", B)
          .add("heads", o.heads)
          .add("kv_heads", o.kv_heads)
          .add("head_dim", D)
          .add("iters", o.iters)
          .add("warmup", o.warmup)
          .add("new_tokens", o.new_tokens)
          .add("steps", o.steps)
          .add("sink", o.sink)
          .add("check", o.check == 1)
          .add("with_cuda", bool(DATTN_WITH_CUDA))
          .add("with_nccl", bool(DATTN_WITH_NCCL));
      dattn::report::JsonObject p1;
      p1.add("measured_speedup", measured).add("model_flop_ratio", model_ratio);
      std::vector<std::string> jacc;
      for (const AccRow& a : acc)
        jacc.push_back(accuracy_json(a));
      dattn::report::JsonObject ja;
      ja.add("seq", acc_S)
          .add("block", acc_block)
          .add("anchor", acc_anchor)
          .add("scaled", acc_scaled)
          .add_raw("rows", dattn::report::json_array(jacc));
      dattn::report::JsonObject j2;
      j2.add("context", p2.context)
          .add("final_length", p2.final_length)
          .add("star_over_tree_latency", p2.star.mean_ms / p2.tree.mean_ms);
      if (p2.checked) {
        j2.add_raw("star_vs_tree", check_json(p2.star_vs_tree))
            .add_raw("star_vs_float64", check_json(p2.star_vs_ref))
            .add_raw("tree_vs_float64", check_json(p2.tree_vs_ref));
      }
      dattn::report::JsonObject jt;
      jt.add("ranks", 4)
          .add("seq", int64_t(32768))
          .add("phase1_speedup", 4.0)
          .add("this_run_is_target", target_config);
      if (target_config) jt.add("met", measured >= 4);
      dattn::report::JsonObject top;
      // The rows of both phases (the common keys, then "phase"); the sections below keep the
      // phases' summaries and the accuracy rows.
      const std::vector<std::string> rows = {
          timed_json(o, rt.size(), star_row), timed_json(o, rt.size(), ring_row),
          decode_json(rt.size(), p2, p2.star), decode_json(rt.size(), p2, p2.tree)};
      top.add_raw("config", cfg.str())
          .add_raw("rows", dattn::report::json_array(rows))
          .add_raw("phase1", p1.str())
          .add_raw("accuracy", ja.str())
          .add_raw("phase2", j2.str())
          .add_raw("target", jt.str())
          .add("wrong", int64_t(wrong));
      dattn::report::write_text_file(o.json, top.str());
    }
  }
  return wrong > 0 ? 1 : 0;
}

}  // namespace

namespace dattn::bench {
int star_main(int argc, char** argv) {
  return star_bench(argc, argv);
}
}  // namespace dattn::bench
