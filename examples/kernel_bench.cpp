// The kernel workload (dattn-kernel-bench) on the benchmark engine: the single-process CPU
// attention kernel against the BLAS it is built on. Peak RSS against S first (the kernel's
// memory is linear in S; ru_maxrss only grows), then the BLAS's sgemm FLOP/s, the kernel's
// attention FLOP/s on the same threads, their ratio (target >= 0.85 for fp32, floor 0.80), and
// the backward's FLOP/s and ratio (target >= 0.35).
#include <cblas.h>
#include <mpi.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "collective/mpi_communicator.h"
#include "examples/bench_inputs.h"
#include "examples/engine.h"
#include "examples/workloads.h"
#include "launch/program.h"
#include "src/attention.h"
#include "src/base/error.h"
#include "src/models.h"

namespace dattn::bench {
namespace {

using detail::cat;
using report::fixed;

enum Section : int64_t { kRss, kGemm, kAttention, kBackward };

// A [1, S, H, D] tensor of uniform values in [-1, 1), seeded per tensor.
Tensor random_bshd(int64_t S, int64_t H, int64_t D, DType dtype, uint64_t seed) {
  Tensor t = Tensor::empty({1, S, H, D}, dtype);
  const int64_t n = t.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i)
    t.set(i, uniform(seed * 0x100000000ull + uint64_t(i)));
  return t;
}

double mib(double bytes) {
  return bytes / (1024.0 * 1024.0);
}

class Kernel final : public Workload {
 public:
  Defaults defaults() const override {
    return {.iters_help = "timed iterations (best is kept)",
            .iters = 3,
            .warmup = -1,
            .threads = 2,
            .min_threads = 1,
            .has_check = false,
            .one_process = true};
  }

  void add_options(po::options_description& desc) override {
    // clang-format off
    desc.add_options()
      ("heads,H", po::value(&heads_)->default_value(heads_), "heads (heads_kv = heads)")
      ("head-dim,d", po::value(&head_dim_)->default_value(head_dim_), "head dimension D")
      ("seq,s", po::value(&seq_)->default_value(seq_), "sequence length of the kernel run")
      ("dtype,t", po::value(&dtype_name_)->default_value(dtype_name_),
       "storage dtype of the kernel run: fp32, bf16 or fp16")
      ("mask,m", po::value(&mask_)->default_value(mask_), "mask of the kernel run: none or causal")
      ("gemm-n", po::value(&gemm_n_)->default_value(gemm_n_), "sgemm size n (n x n x n)")
      ("rss-seqs", po::value(&rss_text_)->default_value(rss_text_),
       "sequence lengths of the peak-RSS runs (H=1, causal; empty: skip)");
    // clang-format on
  }

  void resolve(const po::variables_map&, const EngineOptions& e) override {
    e_ = e;
    base_mib_ = peak_rss_mib();
    require_option(heads_ >= 1, "--heads", heads_, ">= 1");
    require_option(head_dim_ >= 1, "--head-dim", head_dim_, ">= 1");
    require_option(seq_ >= 1, "--seq", seq_, ">= 1");
    require_option(mask_ == "none" || mask_ == "causal", "--mask", mask_, "none or causal");
    require_option(gemm_n_ >= 1, "--gemm-n", gemm_n_, ">= 1");
    dtype_ = dtype_option(dtype_name_);
    const auto seqs = rss_text_.empty() ? std::vector<int64_t>{} : parse_int_list(rss_text_);
    require_option(
        seqs && std::all_of(seqs->begin(), seqs->end(), [](int64_t s) { return s >= 1; }),
        "--rss-seqs", rss_text_, "a comma-separated list of lengths >= 1");
    rss_seqs_ = *seqs;
    std::sort(rss_seqs_.begin(), rss_seqs_.end());  // the peak RSS is a high-water mark
    spec_.heads_q = spec_.heads_kv = heads_;
    spec_.head_dim = rss_spec_.head_dim = head_dim_;
    spec_.mask = mask_ == "causal" ? Mask::causal() : Mask::none();
    spec_.validate();
    rss_spec_.heads_q = rss_spec_.heads_kv = 1;
    rss_spec_.mask = Mask::causal();
  }

  std::vector<std::string> config_lines(Runtime&) const override {
    return {cat("threads ", e_.threads, " heads ", heads_, " kv-heads ", heads_, " head-dim ",
                head_dim_, " seq ", seq_, " dtype ", dtype_name(dtype_), " mask ", mask_, " iters ",
                e_.iters, " (best of) gemm-n ", gemm_n_, " rss-seqs ", rss_text_)};
  }

  void config_json(report::Json& cfg) const override {
    cfg.update({{"heads", heads_},
                {"head_dim", head_dim_},
                {"seq", seq_},
                {"dtype", dtype_name(dtype_)},
                {"mask", spec_.mask.str()},
                {"gemm_n", gemm_n_}});
  }

  std::vector<std::vector<report::Column>> tables(const Bench&) const override {
    // clang-format off
    return {{{"seq", "(tokens)", 10}, {"tensors", "(MiB)", 9}, {"peak_rss", "(MiB)", 9},
             {"rss-base", "(MiB)", 9}, {"growth", "(RSS/S)", 8}, {"time", "(ms)", 10}},
             {{"section", "", 17}, {"problem", "", 34}, {"threads", "", 7}, {"best", "(ms)", 11},
             {"GFLOP/s", "", 9}}};
    // clang-format on
  }

  std::vector<Case> cases(const Bench& b) const override {
    std::vector<Case> out;
    if (!b.opts().comparing() && !rss_seqs_.empty()) out.push_back({0, "peak-RSS runs", kRss});
    out.push_back({1, cat("kernel sgemm n=", gemm_n_), kGemm});
    out.push_back({1, cat("kernel attention seq=", seq_), kAttention});
    out.push_back({1, cat("kernel backward seq=", seq_), kBackward});
    if (b.opts().comparing()) out.erase(out.begin());  // the attention run, then the backward
    return out;
  }

  std::vector<Row> run(Bench& b, const Case& c) override {
    omp_set_num_threads(e_.threads);
    if (c.index == kRss) return rss_rows(b);
    const double f = attention_flops(1, seq_, seq_, spec_);
    const double gflop = c.index == kGemm
                             ? 2.0 * double(gemm_n_) * double(gemm_n_) * double(gemm_n_)
                         : c.index == kAttention ? f
                                                 : 2.5 * f;
    if (gflop * e_.iters / 1e9 > 200)
      b.note(cat("running ", c.label, " (", fixed(gflop * e_.iters / 1e9, 0), " GFLOP) ..."));
    TimedCall call;
    call.warmup = 0;
    Tensor q, k, v, dout;
    Partial fwd;
    std::vector<float> ga, gb, gc;
    const int n = int(gemm_n_);
    if (c.index == kGemm) {
      // BLAS threads for the sgemm only: the kernel runs BLAS inside its own OpenMP threads.
      ga.resize(size_t(gemm_n_ * gemm_n_)), gb.resize(ga.size()), gc.resize(ga.size());
      for (size_t i = 0; i < ga.size(); ++i) {
        ga[i] = uniform(i);
        gb[i] = uniform(i + ga.size());
      }
      openblas_set_num_threads(e_.threads);
      call.call = [&] {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, ga.data(), n,
                    gb.data(), n, 0.0f, gc.data(), n);
      };
    } else {
      q = random_bshd(seq_, heads_, head_dim_, dtype_, 1);
      k = random_bshd(seq_, heads_, head_dim_, dtype_, 2);
      v = random_bshd(seq_, heads_, spec_.dim_v(), dtype_, 3);
      if (c.index == kBackward) {
        dout = random_bshd(seq_, heads_, spec_.dim_v(), dtype_, 4);
        fwd = attention_local(q, k, v, spec_);
      }
      call.call = [&] {
        if (c.index == kBackward)
          (void)attention_local_backward(q, k, v, fwd, dout, spec_);
        else
          (void)attention_local(q, k, v, spec_);
      };
    }
    const Timing t = b.time(c.label, call);
    openblas_set_num_threads(1);
    const double gflops = gflop / (t.best_ms * 1e-3) / 1e9;
    gflops_[c.index] = gflops;
    const char* strategy = c.index == kGemm        ? "sgemm"
                           : c.index == kAttention ? "kernel"
                                                   : "kernel_backward";
    const std::string problem = c.index == kGemm ? gemm_problem() : attn_problem(spec_, seq_);
    Row row;
    row.result = {"kernel", strategy, "", seq_, 1, t.best_ms, gflops / 1000, 0, 0};
    row.extra = {{"problem", problem}, {"threads", e_.threads}, {"gflops", gflops}};
    if (c.index == kGemm) row.extra["n"] = gemm_n_;
    const char* section = c.index == kGemm        ? "(a) blas"
                          : c.index == kAttention ? "(b) attn"
                                                  : "(d) attn backward";
    row.cells = {section, problem, std::to_string(e_.threads), fixed(t.best_ms, 2),
                 fixed(gflops, 2)};
    return {row};
  }

  void finish(Bench& b, const std::vector<Row>&, report::Json& top) override {
    const double ratio = gflops_[kAttention] / gflops_[kGemm];
    const double bwd_ratio = gflops_[kBackward] / gflops_[kGemm];
    // The forward's target is issue 16's, for fp32 (16-bit runs have other limits: the bf16 rate
    // of the matrix units, or widening).
    const double target = 0.85, floor = 0.80;
    const bool pass = ratio >= target, bwd_pass = bwd_ratio >= 0.35;
    const char* verdict = pass             ? "PASS"
                          : ratio >= floor ? "BELOW target, above the floor 0.80"
                                           : "BELOW the floor 0.80";
    if (b.root()) {
      report::print_footer_line("(c) kernel / sgemm",
                                fixed(ratio, 3) + " (fp32 target >= 0.85) " +
                                    (dtype_ == DType::f32 ? verdict : "(not an fp32 run)"));
      report::print_footer_line("(e) backward / sgemm", fixed(bwd_ratio, 3) + " (target >= 0.35) " +
                                                            (bwd_pass ? "PASS" : "FAIL"));
      std::printf(
          "# backward GFLOP/s count 2.5x the forward's FLOPs; best = the fastest of --iters\n"
          "# (f) peak RSS (ru_maxrss) after one causal run, B=1 H=1 D=%lld %s, measured first "
          "(base %.1f MiB); growth = ((peak - base) / previous (peak - base)) / (S / previous "
          "S): 1.00 is linear in S, 4.00 would be quadratic.\n",
          static_cast<long long>(head_dim_), dtype_name(dtype_), base_mib_);
      std::fflush(stdout);
    }
    top.update({{"ratio", ratio},
                {"target", target},
                {"pass", pass},
                {"backward", {{"ratio", bwd_ratio}, {"target", 0.35}, {"pass", bwd_pass}}},
                {"rss_base_mib", base_mib_},
                {"rss", rss_json_}});
  }

  void plan(Plan& p) const override {
    const double es = double(dtype_size(dtype_));
    int job = 1;
    DATTN_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &job));
    p.line(cat("one process: world 1 rank = cp 1 x tp 1, device cpu, OpenMP threads ", e_.threads,
               " (the sgemm: BLAS threads ", e_.threads, ")",
               job > 1 ? cat("; each of the job's ", job, " ranks would run it alone") : ""));
    // clang-format off
    p.table({{"section", "", 10}, {"problem", "", 34}, {"threads", "", 7}, {"runs", "", 5},
             {"GFLOP", "(per run)", 11}, {"inputs", "(MiB)", 9}});
    // clang-format on
    const std::string T = std::to_string(e_.threads), runs = std::to_string(e_.iters);
    double total = 0;
    for (int64_t S : rss_seqs_) {
      const double f = attention_flops(1, S, S, rss_spec_);
      total += f;
      p.row({"(f) rss", attn_problem(rss_spec_, S), T, "1", fixed(f / 1e9, 3),
             fixed(mib(3.0 * double(S) * double(head_dim_) * es), 1)});
    }
    const double n = double(gemm_n_), fg = 2.0 * n * n * n;
    const double fa = attention_flops(1, seq_, seq_, spec_);
    const double qkv = double(seq_) * double(heads_) * es;
    total += (fg + 3.5 * fa) * e_.iters;
    p.row(
        {"(a) blas", gemm_problem(), T, runs, fixed(fg / 1e9, 3), fixed(mib(3.0 * n * n * 4), 1)});
    p.row({"(b) attn", attn_problem(spec_, seq_), T, runs, fixed(fa / 1e9, 3),
           fixed(mib(qkv * double(2 * head_dim_ + spec_.dim_v())), 1)});
    p.row({"(d) bwd", attn_problem(spec_, seq_), T, runs, fixed(2.5 * fa / 1e9, 3),
           fixed(mib(qkv * double(2 * head_dim_ + 2 * spec_.dim_v())), 1)});
    p.line(
        cat("inputs = q, k, v (a: A, B, C; d: and dout); (a), (b), (d) report the best of their "
            "runs; ",
            fixed(total / 1e9, 3), " GFLOP in all"));
  }

 private:
  std::string gemm_problem() const { return cat(gemm_n_, "x", gemm_n_, "x", gemm_n_, " fp32"); }
  std::string attn_problem(const AttnSpec& spec, int64_t S) const {
    return cat("B=1 H=", spec.heads_q, " S=", S, " D=", spec.head_dim, " ", dtype_name(dtype_), " ",
               spec.mask.str());
  }

  // One causal single-head run per S (ascending): the peak RSS after each, next to the bytes of
  // q, k, v, out and lse for that S.
  std::vector<Row> rss_rows(Bench& b) {
    std::vector<Row> rows;
    double prev_seq = 0, prev_peak = 0;
    for (int64_t S : rss_seqs_) {
      const double gflop = attention_flops(1, S, S, rss_spec_) / 1e9;
      if (gflop > 200)
        b.note(cat("running peak-RSS run seq=", S, " (", fixed(gflop, 0), " GFLOP) ..."));
      const double t0 = MPI_Wtime();
      double tensors = 0;
      {
        const Tensor q = random_bshd(S, 1, head_dim_, dtype_, 11);
        const Tensor k = random_bshd(S, 1, head_dim_, dtype_, 12);
        const Tensor v = random_bshd(S, 1, head_dim_, dtype_, 13);
        const Partial res = attention_local(q, k, v, rss_spec_);
        tensors =
            mib(double(q.nbytes() + k.nbytes() + v.nbytes() + res.out.nbytes() + res.lse.nbytes()));
      }
      const double ms = (MPI_Wtime() - t0) * 1e3, peak = peak_rss_mib();
      // (growth of RSS above the base) / (growth of S) against the previous row: 1 is linear.
      const bool has_growth = prev_seq > 0 && prev_peak > base_mib_;
      const double growth =
          has_growth ? (peak - base_mib_) / (prev_peak - base_mib_) / (double(S) / prev_seq) : 0;
      Row r;
      r.in_json = false;
      r.cells = {std::to_string(S),
                 fixed(tensors, 1),
                 fixed(peak, 1),
                 fixed(peak - base_mib_, 1),
                 has_growth ? fixed(growth, 2) : "-",
                 fixed(ms, 1)};
      rss_json_.push_back({{"seq", S},
                           {"tensors_mib", tensors},
                           {"peak_rss_mib", peak},
                           {"rss_above_base_mib", peak - base_mib_},
                           {"growth_vs_s", prev_seq > 0 ? report::Json(growth) : report::Json()},
                           {"time_ms", ms}});
      rows.push_back(r);
      prev_seq = double(S), prev_peak = peak;
    }
    return rows;
  }

  int64_t heads_ = 8, head_dim_ = 128, seq_ = 8192, gemm_n_ = 4096;
  std::string dtype_name_ = "fp32", mask_ = "none", rss_text_ = "16384,65536";
  DType dtype_ = DType::f32;
  std::vector<int64_t> rss_seqs_;
  AttnSpec spec_, rss_spec_;
  EngineOptions e_;
  double gflops_[4] = {0, 0, 0, 0}, base_mib_ = 0;
  report::Json rss_json_ = report::Json::array();
};

}  // namespace

std::unique_ptr<Workload> make_kernel_workload() {
  return std::make_unique<Kernel>();
}

}  // namespace dattn::bench
