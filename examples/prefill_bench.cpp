// The prefill workload (dattn-prefill-bench) on the benchmark engine: each rank generates its
// shard of q, k, v and times dattn::attention (ring, ulysses or hybrid; any layout and mask), or
// its backward, over a range of sequence lengths: one row per length, the bytes sent against
// attention_send_bytes, the model's load balance, and sampled rows against float64.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "examples/bench_device.h"
#include "examples/bench_inputs.h"
#include "examples/bench_problem.h"
#include "examples/bench_reference.h"
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

constexpr int64_t kSampleRows = 8;  // query rows per rank the check compares

class Prefill final : public Workload {
 public:
  // Every strategy runs on a GPU, forward and backward (the dtype checked in resolve).
  Defaults defaults() const override { return {.runs_on_cuda = true}; }

  void add_options(po::options_description& desc) override {
    // clang-format off
    desc.add_options()
      ("seq-begin,s", po::value(&seq_begin_)->default_value(seq_begin_),
       "first global sequence length")
      ("seq-end,e", po::value(&seq_end_)->value_name("arg (=seq-begin)"),
       "last global sequence length")
      ("seq-factor,f", po::value(&seq_factor_)->default_value(seq_factor_),
       "sequence lengths s, s*f, s*f^2, ... <= e")
      ("strategy,a", po::value(&strategy_name_)->default_value(strategy_name_),
       "ring, ulysses (Ulysses degree = the ranks) or hybrid (Ulysses in groups of -u, ring "
       "across)")
      ("ulysses-degree,u", po::value(&ulysses_arg_)->default_value(ulysses_arg_),
       "Ulysses degree U of --strategy hybrid (divides the ranks; a multiple or divisor of "
       "--kv-heads); node: the cp ranks on one node, so that Ulysses stays inside the nodes and "
       "the ring runs across them")
      ("backward,B", po::bool_switch(&backward_),
       "time attention_backward (after one forward; 2.5x its FLOPs, "
       "attention_backward_send_bytes); --check checks the forward")
      ("sinks", po::value(&sinks_)->default_value(sinks_),
       "1: attention sinks, one logit per query head (gpt-oss), joined to each result "
       "(--compare sinks=0,1 prints their cost)")
      ("softcap", po::value(&softcap_)->default_value(softcap_),
       "logit softcap (Gemma 2: 50): scores become softcap * tanh(s / softcap); 0: off "
       "(--compare softcap=0,50 prints its cost)");
    // clang-format on
    shape_.add_options(desc);
    problem_.add_options(desc);
  }

  void resolve(const po::variables_map& vm, const EngineOptions& e) override {
    e_ = e;
    require_option(sinks_ == 0 || sinks_ == 1, "--sinks", sinks_, "0 or 1");
    require_option(std::isfinite(softcap_) && softcap_ >= 0, "--softcap", softcap_,
                   "0 (off) or a finite positive cap");
    const int P = e.launch.cp, T = e.launch.tp;
    if (!vm.count("seq-end")) seq_end_ = seq_begin_;
    shape_.resolve(T);
    require_option(seq_begin_ >= 1, "--seq-begin", seq_begin_, ">= 1");
    require_option(seq_end_ >= seq_begin_, "--seq-end", seq_end_, ">= --seq-begin");
    require_option(seq_factor_ >= 2 || seq_end_ == seq_begin_, "--seq-factor", seq_factor_,
                   ">= 2 (or --seq-end equal to --seq-begin)");
    require_one_of("--strategy", strategy_name_, {"ring", "ulysses", "hybrid"});
    strategy_ = parse_strategy(strategy_name_);  // (tree and allgather: dattn-decode-bench)
    // The Ulysses degree, over the cp ranks of one tp slice (its heads).
    const int64_t G = shape_.kv_heads / T;
    const char* kv_what = T > 1 ? "--kv-heads / --tp" : "--kv-heads";
    const bool u_given = !vm["ulysses-degree"].defaulted();
    if (ulysses_arg_ == "node") {
      require_option(!e.launch.dry_run || e.launch.world_size == 0, "--ulysses-degree", "node",
                     "a number with --world-size (a plan has no nodes to count)");
      ulysses_ = std::max(1, node_ranks() / T);  // tp is the fastest rank index
    } else {
      const auto u = parse_int_list(ulysses_arg_);
      require_option(u && u->size() == 1 && (*u)[0] >= 1 && (*u)[0] <= INT32_MAX,
                     "--ulysses-degree", ulysses_arg_, ">= 1, or node");
      ulysses_ = int((*u)[0]);
    }
    if (strategy_ == Strategy::ring) {
      require_option(!u_given || ulysses_ == 1, "--ulysses-degree", ulysses_,
                     "1 with --strategy ring (it is the degree of --strategy hybrid)");
    } else if (strategy_ == Strategy::ulysses) {
      require_option(!u_given || ulysses_ == P, "--ulysses-degree", ulysses_,
                     cat("the number of ranks (", P, ") with --strategy ulysses, or no -u"));
      ulysses_ = P;
    } else {
      require_option(P % ulysses_ == 0, "--ulysses-degree", ulysses_,
                     cat("a divisor of the cp ranks (", P, ")"));
    }
    require_option(G % ulysses_ == 0 || ulysses_ % G == 0, kv_what, G,
                   cat("a multiple or a divisor of the Ulysses degree (", ulysses_,
                       ") with --strategy ", strategy_name_));
    require_option(
        shape_.heads / T % ulysses_ == 0, T > 1 ? "--heads / --tp" : "--heads", shape_.heads / T,
        cat("a multiple of the Ulysses degree (", ulysses_, ") with --strategy ", strategy_name_));

    problem_.resolve(vm, seq_begin_, seq_end_, e.comparing());
    require_option(e.launch.device != "cuda" || shape_.dtype != DType::f32, "--dtype",
                   shape_.dtype_name, "bf16 or fp16 with --device cuda (the CUDA kernel's types)");
    for (int64_t s = seq_begin_; s <= seq_end_; s *= seq_factor_) {
      seqs_.push_back(s);
      if (seq_factor_ < 2 || s > std::numeric_limits<int64_t>::max() / seq_factor_) break;
    }
    DATTN_ASSERT(!seqs_.empty() && seqs_.front() == seq_begin_ && seqs_.back() <= seq_end_);
  }

  RuntimeOptions runtime_options(const EngineOptions& e) const override {
    RuntimeOptions r = Workload::runtime_options(e);
    r.ulysses = strategy_ == Strategy::hybrid ? ulysses_ : 1;
    return r;
  }

  void config_json(report::Json& cfg) const override {
    cfg.update({{"strategy", strategy_name(strategy_)},
                {"ulysses_degree", ulysses_},
                {"layout", problem_.layout()},
                {"stripe_block", problem_.stripe_block()},
                {"documents", problem_.documents()},
                {"mask", problem_.mask_desc(seqs_.front())}});
    shape_.json(cfg);
    cfg["pass"] = backward_ ? "backward" : "forward";
    cfg["sinks"] = sinks_;
    cfg["softcap"] = softcap_;
  }

  std::vector<std::vector<report::Column>> tables(const Bench& b) const override {
    // clang-format off
    return {{{"seq", "(tokens)", 9}, {"local_seq", "(tokens)", 10}, {"time", "(ms)", 11},
             {"TFLOP/s", cat("(", b.per_unit(), ")"), 11}, {"imbal", "(max/mean)", 11},
             {"sent", "(MB/rank)", 11}, {"model", "(MB/rank)", 11}, {"#wrong", "", 7}}};
    // clang-format on
  }

  std::vector<Case> cases(const Bench& b) const override {
    std::vector<Case> out;
    for (int64_t S : seqs_)
      out.push_back({0, cat("prefill seq ", S), S});
    if (b.opts().comparing()) out.erase(out.begin(), out.end() - 1);
    return out;
  }

  std::vector<Row> run(Bench& b, const Case& c) override {
    Runtime& rt = b.rt();
    const int P = rt.cp_size(), r = rt.cp_rank(), t = rt.tp_rank();
    const Problem p = problem(c.index, P);
    const AttnSpec& spec = p.spec;
    const int64_t S = c.index, hq0 = t * spec.heads_q, hk0 = t * spec.heads_kv;
    const double flops = attention_flops(shape_.batch, S, S, spec) * (backward_ ? 2.5 : 1.0);
    const Device dev = rt.device();
    const auto shard = [&](TensorId id, int64_t heads, int64_t dim, int64_t h0) {
      return on_device(make_shard(id, p.layout, r, shape_.batch, heads, dim, shape_.dtype, h0),
                       dev);
    };
    const Tensor q = shard(kQ, spec.heads_q, spec.head_dim, hq0);
    const Tensor k = shard(kK, spec.heads_kv, spec.head_dim, hk0);
    const Tensor v = shard(kV, spec.heads_kv, spec.dim_v(), hk0);
    Partial res;  // with --backward: one forward, then its backward is what is timed
    Tensor dout;
    if (backward_) {
      dout = shard(kDout, spec.heads_q, spec.dim_v(), hq0);
      res = attention(rt, q, k, v, spec, p.layout, strategy_);
    }
    TimedCall call;
    call.call = [&] {
      if (backward_)
        (void)attention_backward(rt, q, k, v, res, dout, spec, p.layout, strategy_);
      else
        res = attention(rt, q, k, v, spec, p.layout, strategy_);
      synchronize(dev);
    };
    const uint64_t model =
        backward_ ? attention_backward_send_bytes(strategy_, p.layout, spec, shape_.batch,
                                                  shape_.dtype, ulysses_, r)
                  : attention_send_bytes(strategy_, p.layout, spec, shape_.batch, shape_.dtype,
                                         ulysses_, r);
    call.model_bytes = [&] { return model; };
    call.counted = [](const ByteCounters& n) {
      return n.bytes("send") + n.bytes("alltoall") + n.bytes("allreduce");  // d sinks' allreduce
    };
    const Timing tm = b.time(c.label, call);

    Row row;
    const char* pass = backward_ ? "backward" : "prefill";
    const double tflops = flops / P / (tm.mean_ms * 1e-3) / 1e12;
    row.result = {pass, strategy_name(strategy_), problem_.layout(), S, rt.size(), tm.mean_ms};
    row.result.tflops_per_rank = tflops;
    row.take_bytes(tm);
    const double imbal = flop_spread(p).imbalance;
    row.extra = {{"local_seq", p.layout.max_local_len()},
                 {"imbalance", imbal},
                 {"byte_mismatch_ranks", tm.byte_mismatches}};
    if (b.check()) {  // this rank's sample, reduced over every rank
      const DecodeCheck c = check_rows(to_host(res), p, r, t, b.per_gpu()).reduced();
      row.result.wrong = int64_t(c.wrong());
      row.extra.update({{"checked_elements", c.out.checked + c.lse.checked},
                        {"max_err_out", c.out.max_err},
                        {"max_err_lse", c.lse.max_err}});
      max_err_out_ = std::max(max_err_out_, c.out.max_err);
      max_err_lse_ = std::max(max_err_lse_, c.lse.max_err);
    }
    row.cells = {std::to_string(S),     std::to_string(p.layout.max_local_len()),
                 fixed(tm.mean_ms, 3),  fixed(tflops, 4),
                 fixed(imbal, 3),       fixed(tm.sent_mb, 3),
                 fixed(tm.model_mb, 3), wrong_cell(row)};
    return {row};
  }

  void finish(Bench& b, const std::vector<Row>&, report::Json& top) override {
    const int64_t S = seqs_.back();
    const bool masked = problem_.mask() != "none";
    std::string line =
        cat("load balance (max/mean per-rank FLOPs, model, seq ", S, ", ", problem_.mask_desc(S),
            ", ", strategy_name(strategy_), " U ", ulysses_, "):");
    if (masked) {
      report::Json& lb = top["load_balance"] = {{"seq", S}, {"mask", problem_.mask_desc(S)}};
      std::vector<std::string> kinds = {"contiguous", "zigzag", "striped"};
      if (problem_.documents() > 0) kinds.push_back("varlen");
      kinds.push_back("balanced");
      for (const std::string& kind : kinds) {
        const Problem p =
            problem_.make(shape_.spec(Mask::none()), S, b.rt().cp_size(), kind, problem_.mask(), 1);
        const double v = flop_spread(p).imbalance;
        lb[kind] = v;
        line += cat(" ", kind, kind == "striped" ? "(1) " : " ", fixed(v, 2));
      }
    }
    if (!b.root()) return;
    std::printf(
        "# Check: #wrong = elements over tolerance against float64 (%lld query rows per "
        "rank, out and lse) + byte model mismatches\n# time: max over ranks of the mean; "
        "TFLOP/s = attention_flops / P / time; imbal = max / mean of attention_rank_flops; "
        "sent = point-to-point + all-to-all (+ the d sinks allreduce) per rank, max over ranks "
        "(1 MB = 1e6 B)\n",
        static_cast<long long>(kSampleRows));
    if (b.check()) {
      const auto [out, lse] = tolerance(b.per_gpu());
      std::printf(
          "# Check: tolerance out %g + %g*|ref|, lse %g + %g*|ref|; measured max |err| out %s, "
          "lse %s\n",
          out.abs, out.rel, lse.abs, lse.rel, report::sci(max_err_out_, 2).c_str(),
          report::sci(max_err_lse_, 2).c_str());
    }
    if (masked) std::printf("# %s\n", line.c_str());
  }

  void plan(Plan& pl) const override {
    const int P = e_.launch.cp, T = e_.launch.tp;
    const int64_t Hl = shape_.heads / T, Gl = shape_.kv_heads / T, R = P / ulysses_;
    pl.grid(config_words(), ulysses_ == 1 ? ""
                                          : cat("; hybrid: ", R, " Ulysses group(s) of ", ulysses_,
                                                " consecutive cp ranks, ", ulysses_,
                                                " ring group(s) of ", R, " cp ranks"));
    for (int64_t S : seqs_) {
      const Problem p = problem(S, P);
      const Spread f = flop_spread(p), mb = spread(P, [&](int c) { return send_mb(p, c); });
      pl.line(cat("seq ", S, ", ", p.spec.mask.str(), ": ", fixed(f.sum / 1e9 * T / 1e3, 3),
                  " TFLOP in all (model, tiles computed), per rank max ", fixed(f.max / 1e9, 3),
                  " GFLOP, imbalance ", fixed(f.imbalance, 3), ", sent per rank max ",
                  fixed(mb.max, 3), " MB per forward"));
    }
    const Problem last = problem(seqs_.back(), P);
    const Layout& layout = last.layout;
    pl.line(cat("per rank, seq ", seqs_.back(), ":"));
    // clang-format off
    pl.table({{"rank", "", 6}, {"cp", "", 5}, {"tp", "", 4}, {"tokens", "(local)", 9},
              {"q_heads", "", 9}, {"kv_heads", "", 9}, {"GFLOP", "(model)", 11}, {"send", "(MB)", 10},
              {"global positions", "(runs)", 0}});
    // clang-format on
    pl.for_shown(P * T, [&](int w) {
      const int c = w / T, tp = w % T;
      pl.row({std::to_string(w), std::to_string(c), std::to_string(tp),
              std::to_string(layout.local_len(c)), report::index_range(tp * Hl, Hl),
              report::index_range(tp * Gl, Gl), fixed(rank_flops(last, c) / 1e9, 3),
              fixed(send_mb(last, c), 3), report::positions(layout.runs(c))});
    });
  }

 private:
  // With --sinks 1, sinks of -1 to 2 in the spec (the same on every tp rank).
  Problem problem(int64_t S, int P) const {
    Problem p = problem_.make(shape_.spec(Mask::none()), S, P);
    p.spec.softcap = float(softcap_);
    if (sinks_) {
      std::vector<float> s(static_cast<size_t>(p.spec.heads_q));
      for (size_t h = 0; h < s.size(); ++h)
        s[h] = -1.f + 0.5f * float(h % 7);
      p.spec.sinks = make_sinks(std::move(s));
    }
    return p;
  }

  // attention_rank_flops and the forward's MB sent of cp rank r; the FLOPs over every cp rank.
  double rank_flops(const Problem& p, int r) const {
    return attention_rank_flops(strategy_, p.layout, p.spec, shape_.batch, ulysses_, r);
  }
  double send_mb(const Problem& p, int r) const {
    return double(attention_send_bytes(strategy_, p.layout, p.spec, shape_.batch, shape_.dtype,
                                       ulysses_, r)) /
           1e6;
  }
  Spread flop_spread(const Problem& p) const {
    return spread(p.layout.ranks(), [&](int r) { return rank_flops(p, r); });
  }

  // The kernel computes in fp32 from the stored values the reference reads, so fp32 rounding
  // remains (~1e-7 out, ~1e-6 lse); |out| ~ 1e-2 at S = 4096, so the bounds reject out = 0.
  // The CUDA kernel rounds P to the storage dtype before O += P V: out bounds of a 16-bit
  // rounding (2^-8 bf16, 2^-10 fp16 relative).
  std::pair<Tolerance, Tolerance> tolerance(bool gpu) const {
    if (shape_.dtype == DType::f32) return {{1e-4, 1e-4}, {1e-4, 1e-4}};
    if (gpu)
      return {shape_.dtype == DType::bf16 ? Tolerance{1e-3, 1e-2} : Tolerance{3e-4, 3e-3},
              {2e-4, 2e-4}};
    return {{2e-4, 2e-3}, {2e-4, 2e-4}};
  }

  // kSampleRows local rows spread over the shard (first and last included) against a float64
  // attention over the keys their mask band can see (bench_reference.h); this rank's statistics.
  DecodeCheck check_rows(const Partial& res, const Problem& p, int rank, int tp_rank,
                         bool gpu) const {
    const int64_t len = p.layout.local_len(rank), S = p.layout.global_seq();
    const AttnSpec& spec = p.spec;
    const int64_t H = spec.heads_q, Dv = spec.dim_v(), n = std::min(kSampleRows, len);
    std::vector<int64_t> rows, pos;
    int64_t lo = S, hi = 0;
    for (int64_t j = 0; j < n; ++j) {
      rows.push_back(n == 1 ? 0 : j * (len - 1) / (n - 1));
      pos.push_back(p.layout.global_position(rank, rows.back()));
      lo = std::min(lo, pos.back()), hi = std::max(hi, pos.back());
    }
    if (n == 0) return {};
    const int64_t key_begin = spec.mask.left >= 0 ? std::max<int64_t>(0, lo - spec.mask.left) : 0;
    const int64_t key_end =  // hi + right + 1 could overflow for a huge right window
        spec.mask.right >= 0 ? hi + 1 + std::min(spec.mask.right, S - 1 - hi) : S;
    const RefShape shape{shape_.batch,        H,  spec.heads_kv,
                         spec.head_dim,       Dv, double(spec.scale()),
                         double(spec.softcap)};
    const auto row = [&](uint64_t id, int64_t b, int64_t ps, int64_t h, int64_t dim, float* out) {
      HashedRows(shape_.dtype)(id, b, ps, tp_rank * (id == kQ ? H : spec.heads_kv) + h, dim, out);
    };
    DecodeReference ref = merge_states(
        shape, n,
        softmax_states(shape, pos, key_begin, key_end, 0, 1, row,
                       [&](int64_t qp, int64_t kp) { return spec.mask.visible(qp, kp); }),
        1);
    if (spec.sinks)  // each row's normaliser gains exp(sink): lse' = log(e^lse + e^sink)
      for (int64_t i = 0; i < shape_.batch * H * n; ++i) {  // i = (b * H + h) * n + j
        const int64_t b = i / (H * n), h = i / n % H, j = i % n;
        double& l = ref.lse[size_t(i)];
        const double s = (*spec.sinks)[size_t(h)], m = std::max(l, s);
        const double lse = m + std::log(std::exp(l - m) + std::exp(s - m));
        for (int64_t d = 0; d < Dv; ++d)
          ref.out[size_t(((b * n + j) * H + h) * Dv + d)] *= std::exp(l - lse);
        l = lse;
      }
    const auto [tol_out, tol_lse] = tolerance(gpu);
    DecodeCheck c;
    c.compare(res, ref.out.data(), ref.lse.data(), H, 0, tol_out, tol_lse, &rows);
    return c;
  }

  Shape shape_{.dtype_name = "bf16"};
  int64_t seq_begin_ = 4096, seq_end_ = 0, seq_factor_ = 2;
  std::string strategy_name_ = "ring";
  int sinks_ = 0;
  double softcap_ = 0;
  ProblemOptions problem_;
  Strategy strategy_ = Strategy::ring;
  std::string ulysses_arg_ = "1";
  int ulysses_ = 1;
  std::vector<int64_t> seqs_;
  bool backward_ = false;
  EngineOptions e_;
  double max_err_out_ = 0, max_err_lse_ = 0;
};

}  // namespace

std::unique_ptr<Workload> make_prefill_workload() {
  return std::make_unique<Prefill>();
}

}  // namespace dattn::bench
