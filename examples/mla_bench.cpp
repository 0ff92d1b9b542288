// dattn-mla-bench: multi-head latent attention decode (src/mla.h), nccl-tests style. One decode
// step of absorbed MLA over a cache of `context` latents, distributed over the G ranks two ways:
// head split (each rank H/G heads, the whole cache) and TPLA (each rank a 1/G slice of the
// latent, per-slice softmax, outputs summed), the latter with no transform, a Hadamard transform
// and a PCA transform folded into the weights, and with its two options (RoPE part split, logits
// scaled by G). Per method: the cache bytes a rank holds, the bytes it sends per step against
// the model, the step latency (max over ranks), and the error of the output against exact MLA on
// two kinds of latents (every channel of the same energy; a few outlier channels at 20x).
#include <mpi.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <numeric>
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
#include "src/base/error.h"
#include "src/mla.h"

namespace {

namespace po = boost::program_options;
using dattn::LatentTransform;
using dattn::MlaConfig;
using dattn::MlaParallel;
using dattn::MlaTransform;
using dattn::MlaWeights;
using dattn::RopePlacement;
using dattn::Tensor;
using dattn::TplaOptions;
using dattn::bench::mix64;
using dattn::bench::row_key;

// The weights' seed (MlaWeights::random), the same on every rank.
constexpr uint64_t kWeightSeed = 20250601;
// The std of an outlier latent channel, in units of the others'.
constexpr float kOutlierFactor = 20.f;
// head_split (and, at G = 1, every TPLA row) must equal exact MLA within this relative L2 error.
constexpr double kExactRelTol = 1e-4;
// With --check, every element of a method's output against the float64 reference of its own rule
// (tpla_reference at G slices; exact MLA for head_split).
constexpr double kTolAbs = 1e-4, kTolRel = 1e-4;

// ================================================================== options

struct Options {
  int64_t context = 32768;
  int64_t batch = 1;
  int64_t new_tokens = 1;  // S_q per step
  int steps = 5;
  int warmup = 1;
  int64_t heads = 128;
  int64_t latent = 512;
  int64_t rope = 64;
  int64_t qk_nope = 128;
  int64_t v_head = 128;
  int64_t outliers = 8;
  int64_t calibration = 2048;
  int check = 0;
  int threads = 0;
  std::string json;
  // --cp, --tp, --device, --dry-run, --config. The ranks split the heads (head_split) or the
  // latent (TPLA): that is the tensor-parallel degree, so tp = all ranks and cp = 1.
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

// Parses and validates the command line; nullopt when --help or --version was answered.
// Every rank parses the same arguments, so a UsageError is thrown on every rank alike.
std::optional<Options> parse_options(int argc, char** argv) {
  Options o;
  bool help = false, version = false;
  po::options_description desc(
      "dattn-mla-bench: MLA decode over G ranks, head split against TPLA (no transform, "
      "Hadamard, PCA): cache bytes, bytes sent, step latency and error against exact MLA\n"
      "usage: mpiexec -n G dattn-mla-bench [options]\noptions");
  // clang-format off
  desc.add_options()
    ("context,x", po::value(&o.context)->default_value(o.context),
     "context length: latents in the cache")
    ("batch,b", po::value(&o.batch)->default_value(o.batch), "batch size B")
    ("new-tokens,q", po::value(&o.new_tokens)->default_value(o.new_tokens),
     "queries S_q per decode step (the cache's last S_q positions)")
    ("steps,n", po::value(&o.steps)->default_value(o.steps), "timed decode steps per method")
    ("warmup,w", po::value(&o.warmup)->default_value(o.warmup),
     "untimed warm-up decode steps per method")
    ("heads", po::value(&o.heads)->default_value(o.heads), "query heads H")
    ("latent", po::value(&o.latent)->default_value(o.latent),
     "latent dimension d_c (a power of two, for the Hadamard transform)")
    ("rope", po::value(&o.rope)->default_value(o.rope), "decoupled RoPE dimension d_r")
    ("qk-nope", po::value(&o.qk_nope)->default_value(o.qk_nope),
     "per-head query/key dimension without RoPE")
    ("v-head", po::value(&o.v_head)->default_value(o.v_head), "per-head value dimension")
    ("outliers", po::value(&o.outliers)->default_value(o.outliers),
     "outlier latent channels (20x the std of the others) of the second input kind")
    ("calibration", po::value(&o.calibration)->default_value(o.calibration),
     "calibration tokens for the PCA transform (>= 2)")
    ("check,k", po::value(&o.check)->default_value(o.check),
     "also compare every method's output with the float64 reference of its own rule (0 or 1)")
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
      if (version) std::cout << "dattn-mla-bench " << DATTN_VERSION << "\n";
    }
    return std::nullopt;
  }

  using dattn::require_option;
  using dattn::detail::cat;
  // MLA decode has no context parallelism: every rank holds (a slice of) the whole cache. Checked
  // before resolving, so that --cp 3 on 4 ranks says this rather than "cp x tp != ranks".
  const char* why = "MLA decode splits heads or the latent over all ranks (--tp)";
  require_option(o.launch.cp == 0 || o.launch.cp == 1, "--cp", o.launch.cp, cat("1: ", why));
  // tp defaults to every rank of the plan: the job's, or --world-size's with --dry-run (resolve
  // rejects --world-size without --dry-run).
  o.launch.runs_on_cuda = true;  // the head split and TPLA decode run on GPU tensors too
  dattn::resolve_launch_options(o.launch,
                                o.launch.world_size > 0 ? o.launch.world_size : world_size());
  const int G = o.launch.world;
  require_option(o.launch.tp == G && o.launch.cp == 1, "--tp", o.launch.tp,
                 cat("the number of ranks (", G, "): ", why));
  require_option(o.context >= 1, "--context", o.context, ">= 1");
  require_option(o.batch >= 1, "--batch", o.batch, ">= 1");
  require_option(o.new_tokens >= 1 && o.new_tokens <= o.context, "--new-tokens", o.new_tokens,
                 cat(">= 1 and <= --context (", o.context, ")"));
  require_option(o.steps >= 1, "--steps", o.steps, ">= 1");
  require_option(o.warmup >= 0, "--warmup", o.warmup, ">= 0");
  require_option(o.heads >= 1 && o.heads % G == 0, "--heads", o.heads,
                 cat(">= 1 and divisible by the ranks (", G, ") for head split"));
  require_option(o.latent >= 1 && (o.latent & (o.latent - 1)) == 0 && o.latent % G == 0, "--latent",
                 o.latent,
                 cat("a power of two (Hadamard) divisible by the ranks (", G, ") for TPLA"));
  require_option(o.rope >= 0 && o.rope % G == 0, "--rope", o.rope,
                 cat(">= 0 and divisible by the ranks (", G, ") for the split RoPE row"));
  require_option(o.qk_nope >= 1, "--qk-nope", o.qk_nope, ">= 1");
  require_option(o.v_head >= 1, "--v-head", o.v_head, ">= 1");
  require_option(o.outliers >= 0 && o.outliers <= o.latent, "--outliers", o.outliers,
                 cat(">= 0 and <= --latent (", o.latent, ")"));
  require_option(o.calibration >= 2, "--calibration", o.calibration, ">= 2");
  require_option(o.check == 0 || o.check == 1, "--check", o.check, "0 or 1");
  require_option(o.threads >= 0, "--threads", o.threads, ">= 0");
  return o;
}

// ================================================================== inputs

// Inputs come from a hash of (tensor, batch, position, head, dim), as in the other benchmarks:
// the same on every rank and for every rank count. Every value is Gaussian with std 1, except the
// latents of the "outlier channels" kind, whose outlier channels have std 20.
enum TensorId : uint64_t { kQNope = 1, kQPe = 2, kCkv = 3, kKPe = 4, kCalibration = 5 };

// Standard normal (Box-Muller on two 32-bit halves of one hash).
inline float gaussian(uint64_t row, int64_t d) {
  const uint64_t x = mix64(row ^ (uint64_t(d) * 0xd1b54a32d192ed03ull));
  const double u1 = (double(x >> 32) + 0.5) * 0x1p-32;
  const double u2 = double(x & 0xffffffffull) * 0x1p-32;
  return float(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

// Fills t (fp32, contiguous [B, S, heads, dim] whatever its declared shape) with the rows of
// tensor `id` at positions pos0 ..; channel d scaled by std[d] when std is given.
void fill(Tensor& t, TensorId id, int64_t B, int64_t S, int64_t heads, int64_t dim, int64_t pos0,
          const std::vector<float>* std = nullptr) {
  float* p = t.ptr<float>();
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < heads; ++h) {
        const uint64_t key = row_key(id, b, pos0 + s, h);
        float* row = p + ((b * S + s) * heads + h) * dim;
        for (int64_t d = 0; d < dim; ++d)
          row[d] = gaussian(key, d) * (std ? (*std)[size_t(d)] : 1.f);
      }
}

// `n` distinct latent channels, chosen by a fixed hash (partial Fisher-Yates), sorted.
std::vector<int64_t> outlier_channels(int64_t d_c, int64_t n) {
  std::vector<int64_t> idx(static_cast<size_t>(d_c));
  std::iota(idx.begin(), idx.end(), int64_t(0));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t j = i + int64_t(mix64(0x0a71e55ull ^ uint64_t(i)) % uint64_t(d_c - i));
    std::swap(idx[size_t(i)], idx[size_t(j)]);
  }
  idx.resize(static_cast<size_t>(n));
  std::sort(idx.begin(), idx.end());
  return idx;
}

// The input kinds: latents with every channel of the same energy; latents with a few outlier
// channels and isotropic queries (the outliers barely steer the logits); and the same latents
// with queries whose absorbed weights are kAlignFactor x larger on the outlier channels, so that
// the outlier channels dominate the logits (the case the transforms exist for).
enum class Kind : int { uniform = 0, outliers = 1, aligned = 2 };
constexpr int kKinds = 3;
constexpr float kAlignFactor = 5.f;
const char* kind_name(Kind k) {
  return k == Kind::uniform    ? "uniform energy"
         : k == Kind::outliers ? "outlier channels"
                               : "outlier channels, aligned queries";
}

// The weights of a kind: for `aligned`, W_UK's columns of the outlier channels scaled up.
MlaWeights kind_weights(Kind k, const MlaWeights& w, const std::vector<int64_t>& outliers) {
  if (k != Kind::aligned) return w;
  MlaWeights a{w.w_uk.to(dattn::DType::f32), w.w_uv};
  const int64_t rows = a.w_uk.size(0) * a.w_uk.size(1), dc = a.w_uk.size(2);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c : outliers)
      a.w_uk.ptr<float>()[r * dc + c] *= kAlignFactor;
  return a;
}

std::vector<float> channel_std(Kind k, int64_t d_c, const std::vector<int64_t>& outliers) {
  std::vector<float> s(static_cast<size_t>(d_c), 1.f);
  if (k != Kind::uniform)
    for (int64_t c : outliers)
      s[size_t(c)] = kOutlierFactor;
  return s;
}

// The heads [h0, h0 + n) of a [B, S, H, D] tensor.
Tensor slice_heads(const Tensor& t, int64_t h0, int64_t n) {
  const int64_t B = t.size(0), S = t.size(1), H = t.size(2), D = t.size(3);
  Tensor out = Tensor::empty({B, S, n, D}, dattn::DType::f32);
  for (int64_t i = 0; i < B * S; ++i)
    std::memcpy(out.ptr<float>() + i * n * D, t.ptr<float>() + (i * H + h0) * D,
                size_t(n * D) * sizeof(float));
  return out;
}

// The heads [h0, h0 + n) of [H, a, d_c] weights.
Tensor slice_weight(const Tensor& w, int64_t h0, int64_t n) {
  const int64_t a = w.size(1), dc = w.size(2);
  Tensor out = Tensor::empty({n, a, dc}, dattn::DType::f32);
  std::memcpy(out.ptr<float>(), w.ptr<float>() + h0 * a * dc, size_t(n * a * dc) * sizeof(float));
  return out;
}

MlaWeights slice_weights(const MlaWeights& w, int64_t h0, int64_t n) {
  return MlaWeights{slice_weight(w.w_uk, h0, n), slice_weight(w.w_uv, h0, n)};
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

// ================================================================== accuracy

// With --check: elements of out against a float64 reference.
struct CheckStats {
  uint64_t checked = 0, wrong = 0;
  double max_err = 0;
};

// A method's output on one input kind against exact MLA (and, with --check, against float64).
struct Accuracy {
  bool measured = false;
  double rel_l2 = 0;   // ||out - exact|| / ||exact||, all elements
  double max_abs = 0;  // max |out - exact|
  bool checked = false;
  CheckStats f64;
};

// This rank's heads [h0, h0 + hn) of out [B, S_q, H, v] against `mine` [B, S_q, hn, v] (the
// same heads of exact MLA); the sums over every rank's heads.
void compare_exact(const Tensor& out, const Tensor& mine, int64_t h0, int64_t hn, Accuracy& acc) {
  const int64_t B = out.size(0), Sq = out.size(1), H = out.size(2), dv = out.size(3);
  double s[2] = {0, 0}, max_abs = 0;
  for (int64_t t = 0; t < B * Sq; ++t)
    for (int64_t i = 0; i < hn; ++i)
      for (int64_t d = 0; d < dv; ++d) {
        const double got = out.ptr<float>()[(t * H + h0 + i) * dv + d];
        const double ref = mine.ptr<float>()[(t * hn + i) * dv + d];
        const double diff = got - ref;
        s[0] += diff * diff;
        s[1] += ref * ref;
        max_abs = std::max(max_abs, std::isfinite(diff) ? std::abs(diff) : INFINITY);
      }
  DATTN_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, s, 2, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
  acc.measured = true;
  acc.rel_l2 = s[1] > 0 ? std::sqrt(s[0] / s[1]) : std::sqrt(s[0]);
  acc.max_abs = allreduce_max(max_abs);
}

// This rank's heads of out against its float64 reference ref [B, S_q, hn, v]: every element
// within kTolAbs + kTolRel * |ref|.
void compare_f64(const Tensor& out, const std::vector<double>& ref, int64_t h0, int64_t hn,
                 Accuracy& acc) {
  const int64_t B = out.size(0), Sq = out.size(1), H = out.size(2), dv = out.size(3);
  CheckStats c;
  for (int64_t t = 0; t < B * Sq; ++t)
    for (int64_t i = 0; i < hn; ++i)
      for (int64_t d = 0; d < dv; ++d) {
        const double got = out.ptr<float>()[(t * H + h0 + i) * dv + d];
        const double r = ref[size_t((t * hn + i) * dv + d)];
        const double err = std::abs(got - r);
        c.checked += 1;
        if (std::isfinite(err)) c.max_err = std::max(c.max_err, err);
        if (!(err <= kTolAbs + kTolRel * std::abs(r))) c.wrong += 1;
      }
  acc.checked = true;
  acc.f64.checked = allreduce_u64(c.checked, MPI_SUM);
  acc.f64.wrong = allreduce_u64(c.wrong, MPI_SUM);
  acc.f64.max_err = allreduce_max(c.max_err);
}

// ================================================================== methods

struct Method {
  MlaParallel parallel = MlaParallel::head_split;
  LatentTransform transform = LatentTransform::none;
  TplaOptions opt;
  bool tpla() const { return parallel == MlaParallel::tpla; }
  std::string rope_name() const {
    return !tpla() ? "whole" : opt.rope == RopePlacement::split ? "split" : "replicated";
  }
  std::string logits_name() const { return tpla() && opt.scale_logits_by_g ? "xG" : "x1"; }
  std::string label() const {
    std::string s = dattn::mla_parallel_name(parallel);
    if (!tpla()) return s;
    s += std::string(" ") + dattn::latent_transform_name(transform);
    if (opt.rope == RopePlacement::split) s += " split-rope";
    if (opt.scale_logits_by_g) s += " logit-scale-G";
    return s;
  }
};

std::vector<Method> methods() {
  std::vector<Method> m(6);
  m[0].parallel = MlaParallel::head_split;
  for (int i = 1; i < 6; ++i)
    m[size_t(i)].parallel = MlaParallel::tpla;
  m[1].transform = LatentTransform::none;
  m[2].transform = LatentTransform::hadamard;
  m[3].transform = LatentTransform::pca;
  m[4].transform = LatentTransform::none;  // split RoPE
  m[4].opt.rope = RopePlacement::split;
  m[5].transform = LatentTransform::hadamard;  // logits scaled by G
  m[5].opt.scale_logits_by_g = true;
  return m;
}

struct Row {
  Method method;
  uint64_t cache_model_bytes = 0;  // per rank, mla_cache_bytes_per_token * context * batch
  uint64_t cache_held_bytes = 0;   // what the shard holds, max over ranks
  double cache_ratio = 0;          // model bytes / head_split's
  std::vector<double> times;       // per timed step, max over ranks (s)
  double mean_ms = 0, p50_ms = 0;
  double sent_kb = 0, model_kb = 0;  // per rank per timed step, max over ranks (1 KB = 1e3 B)
  uint64_t byte_mismatches = 0;      // (rank, call) pairs off the model
  Accuracy acc[kKinds];
  uint64_t exact_wrong = 0;  // input kinds where a row that must be exact is not
  uint64_t cache_wrong() const { return cache_held_bytes != cache_model_bytes ? 1 : 0; }
  uint64_t wrong() const {
    uint64_t w = byte_mismatches + exact_wrong + cache_wrong();
    for (const Accuracy& a : acc)
      w += a.f64.wrong;
    return w;
  }
};

// What is needed to run the methods on one input kind.
struct Problem {
  const Options* o = nullptr;
  MlaConfig cfg;
  int64_t pos0 = 0;         // the queries' first position
  Tensor q_nope, q_pe;      // on the host (the references)
  Tensor q_nope_d, q_pe_d;  // on the Runtime's device (the decode)
  int64_t h0 = 0, hn = 0;   // this rank's heads of the reference
};

// Runs `calls` decode steps of one method over its shard (the first `warmup` untimed; timed
// steps only when `timed`), counting every call's bytes against the model. Returns the last
// step's output, on the host. `what` names the run in progress lines (rank 0, long runs only).
// w and shard are on the Runtime's device.
Tensor run_steps(dattn::Runtime& rt, const Problem& pb, const Method& m, const MlaWeights& w,
                 const dattn::MlaCacheShard& shard, int calls, int warmup, bool timed, Row& row,
                 const std::string& what) {
  const int G = rt.cp_size();
  const uint64_t model =
      dattn::mla_decode_send_bytes(pb.cfg, m.parallel, pb.o->batch, pb.o->new_tokens, G);
  dattn::Progress progress(rt.rank() == 0, what, calls, "steps");
  std::vector<double> times;
  uint64_t sent_sum = 0, mismatches = 0;
  Tensor out;
  for (int it = 0; it < calls; ++it) {
    rt.reset_counters();
    rt.world().barrier();
    const double t0 = MPI_Wtime();
    out =
        dattn::mla_decode(rt, m.parallel, pb.cfg, w, pb.q_nope_d, pb.q_pe_d, shard, pb.pos0, m.opt);
    dattn::bench::synchronize(rt.device());  // a GPU step ends when its kernels have run
    const double t = MPI_Wtime() - t0;
    const uint64_t sent = rt.counters().data_bytes();
    if (sent != model) mismatches += 1;
    if (timed && it >= warmup) {
      times.push_back(t);
      sent_sum += sent;
    }
    progress.step();
  }
  row.byte_mismatches += allreduce_u64(mismatches, MPI_SUM);
  if (timed) {
    DATTN_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, times.data(), int(times.size()), MPI_DOUBLE,
                                  MPI_MAX, MPI_COMM_WORLD));
    row.times = times;
    double total = 0;
    for (double t : times)
      total += t;
    std::sort(times.begin(), times.end());
    row.mean_ms = total / double(times.size()) * 1e3;
    row.p50_ms = percentile(times, 50) * 1e3;
    row.sent_kb = double(allreduce_u64(sent_sum, MPI_MAX)) / double(times.size()) / 1e3;
    row.model_kb = double(allreduce_u64(model, MPI_MAX)) / 1e3;
  }
  return out.device().is_cpu() ? out : out.to_device(dattn::Device::cpu());
}

// ================================================================== report

const dattn::report::Table& table() {
  static const dattn::report::Table t({{"method", "", 10},
                                       {"transform", "", 9},
                                       {"rope", "", 10},
                                       {"logits", "", 6},
                                       {"cache", "(MiB/rank)", 10},
                                       {"ratio", "", 6},
                                       {"sent", "(KB/rank/step)", 14},
                                       {"model", "(KB)", 9},
                                       {"mean", "(ms)", 9},
                                       {"p50", "(ms)", 9},
                                       {"err_unif", "(rel L2)", 9},
                                       {"max_unif", "(abs)", 9},
                                       {"err_outl", "(rel L2)", 9},
                                       {"max_outl", "(abs)", 9},
                                       {"err_algn", "(rel L2)", 9},
                                       {"max_algn", "(abs)", 9},
                                       {"#wrong", "", 6}});
  return t;
}

void print_row(const Row& r) {
  using dattn::report::fixed;
  using dattn::report::sci;
  const Method& m = r.method;
  table().print_row(
      stdout,
      {dattn::mla_parallel_name(m.parallel), dattn::latent_transform_name(m.transform),
       m.rope_name(), m.logits_name(), fixed(double(r.cache_model_bytes) / (1024.0 * 1024.0), 2),
       fixed(r.cache_ratio, 3), fixed(r.sent_kb, 3), fixed(r.model_kb, 3), fixed(r.mean_ms, 2),
       fixed(r.p50_ms, 2), sci(r.acc[0].rel_l2, 2), sci(r.acc[0].max_abs, 2),
       sci(r.acc[1].rel_l2, 2), sci(r.acc[1].max_abs, 2), sci(r.acc[2].rel_l2, 2),
       sci(r.acc[2].max_abs, 2), std::to_string(r.wrong())});
}

std::string accuracy_json(const Accuracy& a) {
  dattn::report::JsonObject j;
  j.add("rel_l2", a.rel_l2).add("max_abs", a.max_abs);
  if (a.checked) {
    j.add("f64_checked_elements", int64_t(a.f64.checked))
        .add("f64_wrong", int64_t(a.f64.wrong))
        .add("f64_max_err", a.f64.max_err);
  }
  return j.str();
}

// The method as a strategy name for the common row keys: "head_split", "tpla-none",
// "tpla-hadamard", "tpla-none-split-rope", ... (its label, words joined by '-').
std::string strategy_name(const Method& m) {
  std::string s = m.label();
  std::replace(s.begin(), s.end(), ' ', '-');
  return s;
}

// The common row keys (report::result_row) first, then the benchmark's own.
std::string row_json(const Options& o, int ranks, const Row& r) {
  dattn::report::ResultRow c;
  c.workload = "mla";
  c.strategy = strategy_name(r.method);
  c.layout = "";
  c.seq = o.context;
  c.ranks = ranks;
  c.time_ms = r.mean_ms;   // the mean step latency, max over ranks
  c.tflops_per_rank = -1;  // no FLOP model for MLA decode
  c.sent_mb_per_rank = r.sent_kb / 1e3;
  c.model_mb_per_rank = r.model_kb / 1e3;
  c.wrong = int64_t(r.wrong());
  dattn::report::JsonObject j = dattn::report::result_row(c);
  std::vector<std::string> times;
  for (double t : r.times)
    times.push_back(dattn::report::json_number(t * 1e3));
  j.add("method", r.method.label())
      .add("parallel", dattn::mla_parallel_name(r.method.parallel))
      .add("transform", dattn::latent_transform_name(r.method.transform))
      .add("rope", r.method.rope_name())
      .add("scale_logits_by_g", r.method.tpla() && r.method.opt.scale_logits_by_g)
      .add("cache_bytes_per_rank_model", int64_t(r.cache_model_bytes))
      .add("cache_bytes_per_rank_held", int64_t(r.cache_held_bytes))
      .add("cache_ratio_vs_head_split", r.cache_ratio)
      .add("sent_kb_per_rank_per_step", r.sent_kb)
      .add("model_kb_per_rank_per_step", r.model_kb)
      .add("byte_mismatches", int64_t(r.byte_mismatches))
      .add("mean_ms", r.mean_ms)
      .add("p50_ms", r.p50_ms)
      .add_raw("step_ms", dattn::report::json_array(times))
      .add_raw("uniform_energy", accuracy_json(r.acc[0]))
      .add_raw("outlier_channels", accuracy_json(r.acc[1]))
      .add_raw("outlier_channels_aligned_queries", accuracy_json(r.acc[2]))
      .add("exact_wrong", int64_t(r.exact_wrong));
  return j.str();
}

// ================================================================== dry run

// --dry-run: what each rank would hold and send, from the library's slicing (mla_shard_cache on
// a cache of no tokens gives a rank's latent and RoPE columns) and its models
// (mla_cache_bytes_per_token, mla_decode_send_bytes); nothing is computed. Printed by rank 0
// only; needs no Runtime, so --world-size can plan for more ranks than the job has.
void print_plan(const Options& o) {
  using dattn::detail::cat;
  using dattn::report::fixed;
  const double start = MPI_Wtime();
  const auto mib = [](uint64_t bytes) { return fixed(double(bytes) / (1024.0 * 1024.0), 2); };
  const auto kb = [](uint64_t bytes) { return fixed(double(bytes) / 1e3, 3); };
  const int G = o.launch.world;
  MlaConfig cfg;
  cfg.heads = o.heads;
  cfg.latent = o.latent;
  cfg.rope = o.rope;
  cfg.qk_nope = o.qk_nope;
  cfg.v_head = o.v_head;
  cfg.validate();
  const int64_t B = o.batch, S = o.context, Sq = o.new_tokens;
  const uint64_t tokens = uint64_t(S * B);

  std::printf("# dattn MLA decode plan (dry run, nothing computed), version %s\n", DATTN_VERSION);
  std::printf(
      "# world %d ranks = cp 1 x tp %d (the ranks split the heads: head_split, or the latent: "
      "tpla); context %lld batch %lld new-tokens %lld (queries at positions %lld .., causal); "
      "heads %lld latent %lld rope %lld qk-nope %lld v-head %lld; fp32\n",
      G, G, static_cast<long long>(S), static_cast<long long>(B), static_cast<long long>(Sq),
      static_cast<long long>(S - Sq), static_cast<long long>(o.heads),
      static_cast<long long>(o.latent), static_cast<long long>(o.rope),
      static_cast<long long>(o.qk_nope), static_cast<long long>(o.v_head));
  std::printf(
      "# communicators: one group of all %d ranks; per step head_split allgathers every rank's "
      "heads of the output, tpla sum-allreduces the whole output%s\n",
      G, G == 1 ? " (one rank: nothing is sent)" : "");
  std::printf("# device: %s\n", dattn::device_plan(o.launch).c_str());
  const std::vector<Method> ms = methods();
  std::printf(
      "# would run: %zu methods, each %d warm-up + %d timed steps on the uniform-energy latents "
      "and 1 step on each of %d more input kinds; PCA calibrated on %lld tokens per kind; "
      "check %d\n",
      ms.size(), o.warmup, o.steps, kKinds - 1, static_cast<long long>(o.calibration), o.check);

  // Per method: the models' cache bytes a rank holds and bytes it sends per step.
  const dattn::report::Table mt({{"method", "", 10},
                                 {"transform", "", 9},
                                 {"rope", "", 10},
                                 {"logits", "", 6},
                                 {"cache", "(MiB/rank)", 10},
                                 {"ratio", "", 6},
                                 {"model", "(KB/rank/step)", 14}});
  std::printf("# per method (the same on every rank):\n");
  mt.print_heading(stdout);
  const uint64_t head_split_cache =
      dattn::mla_cache_bytes_per_token(cfg, MlaParallel::head_split, TplaOptions{}, G) * tokens;
  for (const Method& m : ms) {
    const uint64_t cache = dattn::mla_cache_bytes_per_token(cfg, m.parallel, m.opt, G) * tokens;
    const uint64_t send = dattn::mla_decode_send_bytes(cfg, m.parallel, B, Sq, G);
    mt.print_row(stdout,
                 {dattn::mla_parallel_name(m.parallel), dattn::latent_transform_name(m.transform),
                  m.rope_name(), m.logits_name(), mib(cache),
                  fixed(double(cache) / double(head_split_cache), 3), kb(send)});
  }

  // Per rank: its heads under head_split, its latent (and split RoPE) columns under tpla.
  TplaOptions split;
  split.rope = RopePlacement::split;
  const Tensor no_c_kv = Tensor::empty({1, 0, cfg.latent}, dattn::DType::f32);
  const Tensor no_k_pe = Tensor::empty({1, 0, cfg.rope}, dattn::DType::f32);
  const uint64_t tpla_cache =
      dattn::mla_cache_bytes_per_token(cfg, MlaParallel::tpla, TplaOptions{}, G) * tokens;
  const uint64_t split_cache =
      dattn::mla_cache_bytes_per_token(cfg, MlaParallel::tpla, split, G) * tokens;
  const uint64_t head_split_send =
      dattn::mla_decode_send_bytes(cfg, MlaParallel::head_split, B, Sq, G);
  const uint64_t tpla_send = dattn::mla_decode_send_bytes(cfg, MlaParallel::tpla, B, Sq, G);
  const dattn::report::Table ranks({{"rank", "", 6},
                                    {"heads", "(head_split)", 12},
                                    {"latent", "(tpla)", 11},
                                    {"rope", "(split)", 11},
                                    {"cache_hs", "(MiB)", 10},
                                    {"cache_tpla", "(MiB)", 10},
                                    {"cache_split", "(MiB)", 11},
                                    {"send_hs", "(KB/step)", 10},
                                    {"send_tpla", "(KB/step)", 10}});
  std::printf("# per rank (tpla's RoPE part: every column on every rank unless split):\n");
  ranks.print_heading(stdout);
  for (int g = 0; g < G; ++g) {
    const int64_t h0 = g * o.heads / G, hn = (g + 1) * o.heads / G - h0;
    const dattn::MlaCacheShard t =
        dattn::mla_shard_cache(cfg, MlaParallel::tpla, split, no_c_kv, no_k_pe, g, G);
    ranks.print_row(stdout,
                    {std::to_string(g), dattn::report::index_range(h0, hn),
                     dattn::report::index_range(t.latent_begin, t.latent_len),
                     dattn::report::index_range(t.rope_begin, t.rope_len), mib(head_split_cache),
                     mib(tpla_cache), mib(split_cache), kb(head_split_send), kb(tpla_send)});
  }
  std::printf("# planned %d ranks in %.3f s\n", G, MPI_Wtime() - start);
  std::fflush(stdout);
}

// ================================================================== main

int mla_bench(int argc, char** argv) {
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

  // mla_decode runs over rt.cp() (src/mla.cpp), so the Runtime keeps its default grid, cp = all
  // ranks and tp = 1, exactly as before; the launch options' cp 1 x tp G (the ranks split heads
  // or the latent) only validates the options and names the grid in the plan.
  dattn::RuntimeOptions ropts;
  ropts.device = o.launch.dev;
  ropts.threads = o.threads;
  dattn::Runtime rt = dattn::Runtime::from_mpi(MPI_COMM_WORLD, ropts);
  const int G = rt.cp_size(), r = rt.cp_rank(), T = rt.threads();
  const bool root = rt.rank() == 0;
  auto progress = [&](const std::string& line) {
    if (root) {
      std::printf("# %s\n", line.c_str());
      std::fflush(stdout);
    }
  };

  Problem pb;
  pb.o = &o;
  pb.cfg.heads = o.heads;
  pb.cfg.latent = o.latent;
  pb.cfg.rope = o.rope;
  pb.cfg.qk_nope = o.qk_nope;
  pb.cfg.v_head = o.v_head;
  pb.cfg.validate();
  const MlaConfig& cfg = pb.cfg;
  const int64_t B = o.batch, S = o.context, Sq = o.new_tokens, H = o.heads, dc = o.latent,
                dr = o.rope;
  pb.pos0 = S - Sq;
  pb.h0 = r * H / G;
  pb.hn = (r + 1) * H / G - pb.h0;
  const std::vector<int64_t> outliers = outlier_channels(dc, o.outliers);

  std::string channels;
  for (int64_t c : outliers)
    channels += cat(channels.empty() ? "" : ",", c);
  const auto ranks = dattn::report::gather_rank_info(MPI_COMM_WORLD, rt.device().str(), T);
  const std::vector<std::string> config = {
      cat("ranks (G) ", rt.size(), " (cp 1 x tp ", G, ") threads/rank ", T, " context ", S,
          " batch ", B, " new-tokens ", Sq, " (queries at positions ", pb.pos0,
          " .., causal) steps ", o.steps, " warmup ", o.warmup, " check ", o.check),
      cat("MLA heads ", H, " latent ", dc, " rope ", dr, " qk-nope ", o.qk_nope, " v-head ",
          o.v_head, " softmax scale ", cfg.scale(), " fp32; weights MlaWeights::random(seed ",
          kWeightSeed, ")"),
      cat("inputs: q_nope, q_pe, k_pe ~ N(0, 1); c_kv ~ N(0, 1) per channel (uniform energy) or "
          "with ",
          o.outliers, " outlier channels at ", kOutlierFactor, "x std (outlier channels",
          outliers.empty() ? std::string() : cat(": ", channels), "), the latter also with W_UK x",
          kAlignFactor, " on those channels (aligned queries: the outliers dominate the logits)"),
      cat("PCA calibrated per kind on ", o.calibration,
          " other tokens of that kind; reference: exact MLA (mla_decode_local on the "
          "untransformed cache, heads split over the ranks)")};
  if (root) {
    dattn::report::print_header(stdout, "dattn MLA decode benchmark", config, ranks);
    std::fflush(stdout);
  }

  // ---------------------------------------------------------------- the same on both kinds
  const MlaWeights w_random = MlaWeights::random(cfg, kWeightSeed);
  pb.q_nope = Tensor::empty({B, Sq, H, o.qk_nope}, dattn::DType::f32);
  pb.q_pe = Tensor::empty({B, Sq, H, dr}, dattn::DType::f32);
  fill(pb.q_nope, kQNope, B, Sq, H, o.qk_nope, pb.pos0);
  fill(pb.q_pe, kQPe, B, Sq, H, dr, pb.pos0);
  const dattn::Device dev = rt.device();
  pb.q_nope_d = dattn::bench::on_device(pb.q_nope, dev);
  pb.q_pe_d = dattn::bench::on_device(pb.q_pe, dev);
  const Tensor q_nope_mine = slice_heads(pb.q_nope, pb.h0, pb.hn);
  const Tensor q_pe_mine = slice_heads(pb.q_pe, pb.h0, pb.hn);
  MlaConfig cfg_mine = cfg;  // this rank's heads, for the references
  cfg_mine.heads = pb.hn;
  cfg_mine.softmax_scale = cfg.scale();
  const MlaTransform hadamard = dattn::make_latent_transform(LatentTransform::hadamard, dc);

  std::vector<Row> rows;
  for (const Method& m : methods()) {
    Row row;
    row.method = m;
    row.cache_model_bytes =
        dattn::mla_cache_bytes_per_token(cfg, m.parallel, m.opt, G) * uint64_t(S * B);
    rows.push_back(row);
  }
  for (Row& row : rows)
    row.cache_ratio = double(row.cache_model_bytes) / double(rows.front().cache_model_bytes);

  for (int k = 0; k < kKinds; ++k) {
    const Kind kind = Kind(k);
    const std::vector<float> stds = channel_std(kind, dc, outliers);
    const MlaWeights w = kind_weights(kind, w_random, outliers);
    progress(cat(kind_name(kind), ": folding the Hadamard transform into the weights ..."));
    const MlaWeights w_hadamard = dattn::fold_transform(w, hadamard);
    progress(cat(kind_name(kind), ": generating the cache (", S, " tokens, batch ", B, ") and ",
                 o.calibration, " calibration latents ..."));
    Tensor c_kv = Tensor::empty({B, S, dc}, dattn::DType::f32);
    Tensor k_pe = Tensor::empty({B, S, dr}, dattn::DType::f32);
    fill(c_kv, kCkv, B, S, 1, dc, 0, &stds);
    fill(k_pe, kKPe, B, S, 1, dr, 0);
    Tensor calibration = Tensor::empty({o.calibration, dc}, dattn::DType::f32);
    fill(calibration, kCalibration, 1, o.calibration, 1, dc, 0, &stds);

    progress(
        cat(kind_name(kind), ": exact MLA (mla_decode_local, ", pb.hn, " heads per rank) ..."));
    const Tensor exact = dattn::mla_decode_local(cfg_mine, slice_weights(w, pb.h0, pb.hn),
                                                 q_nope_mine, q_pe_mine, c_kv, k_pe, pb.pos0)
                             .out;

    progress(cat(kind_name(kind), ": PCA transform (calibration ", o.calibration,
                 " tokens) and its folded weights ..."));
    const MlaTransform pca = dattn::make_latent_transform(LatentTransform::pca, dc, calibration);
    calibration = Tensor();
    const MlaWeights w_pca = dattn::fold_transform(w, pca);

    for (Row& row : rows) {
      const Method& m = row.method;
      const bool timed = kind == Kind::uniform;
      const int calls = timed ? o.warmup + o.steps : 1;
      progress(cat(kind_name(kind), ": ", m.label(),
                   timed ? cat(", ", o.warmup, " warm-up + ", o.steps, " timed steps ...")
                         : std::string(", 1 step ...")));
      const MlaTransform* t = m.transform == LatentTransform::hadamard ? &hadamard
                              : m.transform == LatentTransform::pca    ? &pca
                                                                       : nullptr;
      const MlaWeights& wm = m.transform == LatentTransform::hadamard ? w_hadamard
                             : m.transform == LatentTransform::pca    ? w_pca
                                                                      : w;
      dattn::MlaCacheShard shard;
      std::vector<double> f64;
      {
        const Tensor c_t = t ? dattn::apply_transform(*t, c_kv) : c_kv;
        if (o.check) {
          // The float64 rule of this method on this rank's heads: TPLA's per-slice rule at G
          // slices; exact MLA (one slice) for head split.
          TplaOptions opt = m.tpla() ? m.opt : TplaOptions{};
          f64 = dattn::tpla_reference(cfg_mine, slice_weights(wm, pb.h0, pb.hn), q_nope_mine,
                                      q_pe_mine, c_t, k_pe, pb.pos0, m.tpla() ? G : 1, opt);
        }
        shard = dattn::mla_shard_cache(cfg, m.parallel, m.opt, c_t, k_pe, r, G);
      }  // the full transformed cache goes here (a TPLA shard holds copies of its columns)
      row.cache_held_bytes =
          allreduce_u64(uint64_t(shard.c_kv.nbytes() + shard.k_pe.nbytes()), MPI_MAX);
      const MlaWeights wm_d{dattn::bench::on_device(wm.w_uk, dev),
                            dattn::bench::on_device(wm.w_uv, dev)};
      dattn::MlaCacheShard shard_d = shard;
      shard_d.c_kv = dattn::bench::on_device(shard.c_kv, dev);
      shard_d.k_pe = dattn::bench::on_device(shard.k_pe, dev);
      const Tensor out = run_steps(rt, pb, m, wm_d, shard_d, calls, o.warmup, timed, row,
                                   cat("mla ", kind_name(kind), ": ", m.label()));
      compare_exact(out, exact, pb.h0, pb.hn, row.acc[k]);
      if (o.check) compare_f64(out, f64, pb.h0, pb.hn, row.acc[k]);
      if ((!m.tpla() || G == 1) && !(row.acc[k].rel_l2 <= kExactRelTol)) row.exact_wrong += 1;
    }
  }

  // ---------------------------------------------------------------- table
  if (root) {
    std::printf(
        "# MLA decode over %d ranks, context %lld: one row per method; err = the output "
        "against exact MLA\n",
        G, static_cast<long long>(S));
    table().print_heading(stdout);
    for (const Row& row : rows)
      print_row(row);
    std::fflush(stdout);
  }

  // ---------------------------------------------------------------- footer
  uint64_t wrong = 0, byte_mismatches = 0, exact_wrong = 0, cache_wrong = 0, f64_wrong = 0;
  double f64_max_err = 0;
  for (const Row& row : rows) {
    wrong += row.wrong();
    byte_mismatches += row.byte_mismatches;
    exact_wrong += row.exact_wrong;
    cache_wrong += row.cache_wrong();
    for (const Accuracy& a : row.acc) {
      f64_wrong += a.f64.wrong;
      f64_max_err = std::max(f64_max_err, a.f64.max_err);
    }
  }
  const Row& head_split = rows[0];
  const Row& tpla_none = rows[1];
  const Row& tpla_hadamard = rows[2];
  const Row& tpla_pca = rows[3];
  const double cache_ratio = tpla_none.cache_ratio;
  const double cache_target = (double(dc) / 4 + double(dr)) / double(dc + dr);
  const bool cache_target_run = G == 4;
  const bool cache_met = cache_ratio <= cache_target + 1e-12;
  const double outl_none = tpla_none.acc[1].rel_l2, outl_hadamard = tpla_hadamard.acc[1].rel_l2;
  const bool outlier_met = outl_hadamard < outl_none;
  const double algn_none = tpla_none.acc[2].rel_l2, algn_hadamard = tpla_hadamard.acc[2].rel_l2;
  const bool aligned_met = algn_hadamard < algn_none;

  if (root) {
    using dattn::report::print_footer_line;
    print_footer_line(stdout, "Out of bounds values",
                      std::to_string(wrong) + (wrong == 0 ? " OK" : " FAILED"));
    print_footer_line(stdout, "Byte model mismatches",
                      cat(byte_mismatches,
                          " ((rank, step) pairs whose counted bytes differ from "
                          "mla_decode_send_bytes)"));
    print_footer_line(stdout, "Cache model mismatches",
                      cat(cache_wrong,
                          " (methods whose shard holds other than mla_cache_bytes_per_token * "
                          "context * batch)"));
    print_footer_line(
        stdout, "Not exact",
        cat(exact_wrong, " (head_split", G == 1 ? " and every tpla row" : "",
            ", per input kind, over ", sci(kExactRelTol, 0), " relative L2 from exact MLA)"));
    std::printf(
        "# Check: cache = mla_cache_bytes_per_token * context * batch per rank (ratio: over\n"
        "#   head_split's); the shard each rank holds (c_kv + k_pe, max over ranks) must equal "
        "it.\n"
        "# Check: latency = per step, the max over ranks of the wall time of dattn::mla_decode\n"
        "#   (after a barrier), over %d timed steps after %d warm-up, on the uniform-energy\n"
        "#   latents; p50 is nearest-rank. sent = bytes the communicators counted (every op but\n"
        "#   \"control\", the validation) per rank per timed step, max over ranks (1 KB = 1e3 B);\n"
        "#   every step of every rank (and the outlier kind's step) must equal\n"
        "#   mla_decode_send_bytes, else #wrong.\n"
        "# Check: err = ||out - exact|| / ||exact|| and max |out - exact| over all of out, where\n"
        "#   exact = mla_decode_local on the full untransformed cache (one per input kind); the\n"
        "#   transforms are folded into the weights (fold_transform) and applied to the cache\n"
        "#   (apply_transform) before sharding. head_split%s must be within %g\n"
        "#   relative L2, else #wrong.\n",
        o.steps, o.warmup, G == 1 ? " and, at G = 1, every tpla row" : "", kExactRelTol);
    if (o.check) {
      std::printf(
          "# Check: with -k 1 every element of every method's output on both kinds against the\n"
          "#   float64 reference of its own rule (tpla_reference at G slices; exact MLA for\n"
          "#   head_split) within %g + %g*|ref|; in #wrong.\n",
          kTolAbs, kTolRel);
      print_footer_line(stdout, "vs float64",
                        cat(f64_wrong, " wrong; max |err| ", sci(f64_max_err, 2)));
    }
    std::printf(
        "# cache bytes per rank: tpla/head_split = %s (target <= 0.33 at G = 4: "
        "(%lld/4+%lld)/%lld = %s)%s; split rope %s\n",
        fixed(cache_ratio, 3).c_str(), static_cast<long long>(dc), static_cast<long long>(dr),
        static_cast<long long>(dc + dr), fixed(cache_target, 3).c_str(),
        !cache_target_run ? " (this run is not G = 4)"
        : cache_met       ? ": met"
                          : ": NOT met",
        fixed(rows[4].cache_ratio, 3).c_str());
    std::printf(
        "# outlier latents: tpla rel err none %s, hadamard %s (target: hadamard < none)%s; "
        "pca %s\n",
        sci(outl_none, 1).c_str(), sci(outl_hadamard, 1).c_str(),
        G == 1        ? " (G = 1: every row is exact MLA)"
        : outlier_met ? ": met"
                      : ": NOT met",
        sci(tpla_pca.acc[1].rel_l2, 1).c_str());
    std::printf(
        "# outlier latents, aligned queries (outliers dominate the logits): tpla rel err none "
        "%s, hadamard %s (target: hadamard < none)%s; pca %s\n",
        sci(algn_none, 1).c_str(), sci(algn_hadamard, 1).c_str(),
        G == 1        ? " (G = 1: every row is exact MLA)"
        : aligned_met ? ": met"
                      : ": NOT met",
        sci(tpla_pca.acc[2].rel_l2, 1).c_str());
    std::printf(
        "# uniform latents: tpla rel err none %s, hadamard %s, pca %s; split rope %s, "
        "hadamard logit-scale-G %s (outliers: %s, %s)\n",
        sci(tpla_none.acc[0].rel_l2, 1).c_str(), sci(tpla_hadamard.acc[0].rel_l2, 1).c_str(),
        sci(tpla_pca.acc[0].rel_l2, 1).c_str(), sci(rows[4].acc[0].rel_l2, 1).c_str(),
        sci(rows[5].acc[0].rel_l2, 1).c_str(), sci(rows[4].acc[1].rel_l2, 1).c_str(),
        sci(rows[5].acc[1].rel_l2, 1).c_str());
    std::string times;
    for (const Row& row : rows)
      times += cat(times.empty() ? "" : ", ", row.method.label(), " ", fixed(row.mean_ms, 2), "/",
                   fixed(row.p50_ms, 2));
    std::printf("# step latency mean/p50 (ms, max over ranks): %s\n", times.c_str());
    std::printf("# tpla none / head_split latency %s (mean), bytes/step %s\n",
                fixed(tpla_none.mean_ms / head_split.mean_ms, 2).c_str(),
                head_split.sent_kb > 0 ? fixed(tpla_none.sent_kb / head_split.sent_kb, 2).c_str()
                                       : "n/a (nothing sent)");
    std::fflush(stdout);

    if (!o.json.empty()) {
      std::vector<std::string> jchannels;
      for (int64_t c : outliers)
        jchannels.push_back(std::to_string(c));
      dattn::report::JsonObject jc;
      jc.add("program", "dattn-mla-bench")
          .add("version", DATTN_VERSION)
          .add("ranks", rt.size())
          .add("threads_per_rank", T)
          .add("context", S)
          .add("batch", B)
          .add("new_tokens", Sq)
          .add("q_pos0", pb.pos0)
          .add("mask", "causal")
          .add("steps", o.steps)
          .add("warmup", o.warmup)
          .add("heads", H)
          .add("latent", dc)
          .add("rope", dr)
          .add("qk_nope", o.qk_nope)
          .add("v_head", o.v_head)
          .add("softmax_scale", double(cfg.scale()))
          .add("weight_seed", int64_t(kWeightSeed))
          .add("outliers", o.outliers)
          .add("outlier_std_factor", double(kOutlierFactor))
          .add_raw("outlier_channels", dattn::report::json_array(jchannels))
          .add("calibration", o.calibration)
          .add("check", o.check == 1)
          .add("with_cuda", bool(DATTN_WITH_CUDA))
          .add("with_nccl", bool(DATTN_WITH_NCCL));
      std::vector<std::string> jrows;
      for (const Row& row : rows)
        jrows.push_back(row_json(o, rt.size(), row));
      dattn::report::JsonObject jcache;
      jcache.add("tpla_over_head_split", cache_ratio)
          .add("split_rope_over_head_split", rows[4].cache_ratio)
          .add("target_at_4_ranks", cache_target)
          .add("this_run_is_target", cache_target_run);
      if (cache_target_run) jcache.add("met", cache_met);
      dattn::report::JsonObject jout;
      jout.add("tpla_none_rel_err", outl_none)
          .add("tpla_hadamard_rel_err", outl_hadamard)
          .add("tpla_pca_rel_err", tpla_pca.acc[1].rel_l2)
          .add("target", "hadamard < none");
      if (G > 1) jout.add("met", outlier_met);
      jout.add("aligned_tpla_none_rel_err", algn_none)
          .add("aligned_tpla_hadamard_rel_err", algn_hadamard)
          .add("aligned_tpla_pca_rel_err", tpla_pca.acc[2].rel_l2);
      if (G > 1) jout.add("aligned_met", aligned_met);
      dattn::report::JsonObject top;
      top.add_raw("config", jc.str())
          .add_raw("rows", dattn::report::json_array(jrows))
          .add_raw("cache_target", jcache.str())
          .add_raw("outlier_target", jout.str())
          .add("tpla_none_over_head_split_latency", tpla_none.mean_ms / head_split.mean_ms)
          .add("byte_mismatches", int64_t(byte_mismatches))
          .add("cache_mismatches", int64_t(cache_wrong))
          .add("exact_wrong", int64_t(exact_wrong))
          .add("f64_wrong", int64_t(f64_wrong))
          .add("wrong", int64_t(wrong));
      dattn::report::write_text_file(o.json, top.str());
    }
  }
  return wrong > 0 ? 1 : 0;
}

}  // namespace

namespace dattn::bench {
int mla_main(int argc, char** argv) {
  return mla_bench(argc, argv);
}
}  // namespace dattn::bench
