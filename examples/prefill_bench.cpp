// The prefill workload (dattn-prefill-bench) on the benchmark engine: each rank generates its
// shard of q, k, v and times dattn::attention (ring, ulysses or hybrid; any layout and mask), or
// its backward, over a range of sequence lengths: one row per length, the bytes sent against
// attention_send_bytes, the model's load balance, and sampled rows against float64.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "examples/bench_device.h"
#include "examples/bench_inputs.h"
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

enum TensorId : uint64_t { kQ = 1, kK = 2, kV = 3, kDout = 4 };
constexpr int64_t kSampleRows = 8;  // query rows per rank the check compares

struct Problem {
  AttnSpec spec;
  Layout layout;
};

class Prefill final : public Workload {
 public:
  const char* name() const override { return "prefill"; }
  const char* program() const override { return "dattn-prefill-bench"; }
  const char* summary() const override {
    return "distributed prefill: ring, ulysses or hybrid over any layout and mask";
  }
  const char* title() const override { return "dattn prefill benchmark"; }
  Defaults defaults() const override {
    Defaults d;
    d.runs_on_cuda = true;  // the forward of every strategy (checked in resolve)
    return d;
  }

  void add_options(po::options_description& desc) override {
    // clang-format off
    desc.add_options()
      ("batch,b", po::value(&batch_)->default_value(batch_), "batch size B")
      ("heads,H", po::value(&heads_)->default_value(heads_), "query heads H_q")
      ("kv-heads,G", po::value(&kv_heads_)->default_value(kv_heads_),
       "key/value heads H_kv (H_q must be a multiple)")
      ("head-dim,d", po::value(&head_dim_)->default_value(head_dim_), "head dimension D")
      ("seq-begin,s", po::value(&seq_begin_)->default_value(seq_begin_),
       "first global sequence length")
      ("seq-end,e", po::value(&seq_end_)->value_name("arg (=seq-begin)"),
       "last global sequence length")
      ("seq-factor,f", po::value(&seq_factor_)->default_value(seq_factor_),
       "sequence lengths s, s*f, s*f^2, ... <= e")
      ("dtype,t", po::value(&dtype_name_)->default_value(dtype_name_),
       "storage dtype: fp32, bf16 or fp16")
      ("strategy,a", po::value(&strategy_name_)->default_value(strategy_name_),
       "schedule: ring, ulysses (Ulysses degree = all ranks; --kv-heads divisible by the ranks) "
       "or hybrid (Ulysses inside groups of -u ranks, ring across them)")
      ("ulysses-degree,u", po::value(&ulysses_)->default_value(ulysses_),
       "Ulysses degree U of --strategy hybrid (divides the ranks and --kv-heads)")
      ("layout,l", po::value(&layout_)->default_value(layout_),
       "context-parallel layout: contiguous, zigzag, striped or varlen (zigzag per document; "
       "needs --doc-lens or --doc-count)")
      ("stripe-block", po::value(&stripe_block_)->default_value(stripe_block_),
       "tokens per block of --layout striped")
      ("mask,m", po::value(&mask_)->default_value(mask_),
       "mask: none, causal, window (needs -W), document (causal inside each document) or "
       "document-full (every token of its document); the documents need --doc-lens or "
       "--doc-count")
      ("window,W", po::value(&window_)->value_name("L[,R]"),
       "mask window: keys from q-L to q+R (R default 0)")
      ("doc-lens", po::value(&doc_lens_str_)->value_name("LIST"),
       "comma-separated document lengths summing to the sequence length (one length only)")
      ("doc-count", po::value(&doc_count_)->value_name("N"),
       "cut each sequence length into N documents of pseudo-random lengths (fixed seed)")
      ("backward,B", po::bool_switch(&backward_),
       "time the backward (attention_backward of one forward) instead of the forward: TFLOP/s "
       "count 2.5x the forward's FLOPs, bytes are checked against "
       "attention_backward_send_bytes, --check checks the forward");
    // clang-format on
  }

  void resolve(const po::variables_map& vm, const EngineOptions& e) override {
    e_ = e;
    const int P = e.launch.cp, T = e.launch.tp;
    // In a --compare rerun the varied option may leave another unused: that is no error there.
    const auto only_with = [&](bool ok, const char* option, const std::string& value,
                               const char* expected) {
      require_option(ok || e.comparing(), option, value, expected);
    };
    if (!vm.count("seq-end")) seq_end_ = seq_begin_;
    require_option(batch_ >= 1, "--batch", batch_, ">= 1");
    require_option(heads_ >= 1, "--heads", heads_, ">= 1");
    require_option(kv_heads_ >= 1 && heads_ % kv_heads_ == 0, "--kv-heads", kv_heads_,
                   cat(">= 1 and dividing --heads (", heads_, ")"));
    require_option(kv_heads_ % T == 0, "--kv-heads", kv_heads_,
                   cat("divisible by --tp (", T, "): tensor parallelism splits the heads"));
    require_option(head_dim_ >= 1, "--head-dim", head_dim_, ">= 1");
    require_option(seq_begin_ >= 1, "--seq-begin", seq_begin_, ">= 1");
    require_option(seq_end_ >= seq_begin_, "--seq-end", seq_end_, ">= --seq-begin");
    require_option(seq_factor_ >= 2 || seq_end_ == seq_begin_, "--seq-factor", seq_factor_,
                   ">= 2 (or --seq-end equal to --seq-begin)");
    try {
      dtype_ = parse_dtype(dtype_name_);
    } catch (const Error&) {
      require_option(false, "--dtype", dtype_name_, "fp32, bf16 or fp16");
    }
    try {
      strategy_ = parse_strategy(strategy_name_);
    } catch (const Error&) {
    }
    require_option(strategy_ == Strategy::ring || strategy_ == Strategy::ulysses ||
                       strategy_ == Strategy::hybrid,
                   "--strategy", strategy_name_,
                   "ring, ulysses or hybrid (tree and allgather decode: dattn-decode-bench)");
    // The Ulysses degree, over the cp ranks of one tp slice (its heads).
    const int64_t G = kv_heads_ / T;
    const char* kv_what = T > 1 ? "--kv-heads / --tp" : "--kv-heads";
    const bool u_given = !vm["ulysses-degree"].defaulted();
    require_option(ulysses_ >= 1, "--ulysses-degree", ulysses_, ">= 1");
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
    require_option(
        G % ulysses_ == 0, kv_what, G,
        cat("divisible by the Ulysses degree (", ulysses_, ") with --strategy ", strategy_name_));

    // Documents: --doc-lens or --doc-count, for the document masks and layout varlen.
    const bool lens_given = vm.count("doc-lens") > 0, count_given = vm.count("doc-count") > 0;
    require_option(!(lens_given && count_given), "--doc-count", doc_count_,
                   "not given together with --doc-lens");
    if (lens_given) {
      const auto lens = parse_int_list(doc_lens_str_);
      require_option(
          lens && std::all_of(lens->begin(), lens->end(), [](int64_t n) { return n >= 1; }),
          "--doc-lens", doc_lens_str_, "comma-separated lengths >= 1");
      int64_t sum = 0;  // saturated: lengths past the int64 range only have to read as too many
      for (int64_t n : *lens)
        sum = n > std::numeric_limits<int64_t>::max() - sum ? std::numeric_limits<int64_t>::max()
                                                            : sum + n;
      require_option(seq_end_ == seq_begin_, "--doc-lens", doc_lens_str_,
                     "one sequence length (--seq-end equal to --seq-begin); or use --doc-count");
      require_option(sum == seq_begin_, "--doc-lens", doc_lens_str_,
                     cat("lengths summing to --seq-begin (", seq_begin_, "), not ", sum));
      doc_lens_ = *lens;
    }
    if (count_given)
      require_option(doc_count_ >= 1 && doc_count_ <= seq_begin_, "--doc-count", doc_count_,
                     cat(">= 1 and <= --seq-begin (", seq_begin_, ")"));
    const bool docs = lens_given || count_given;

    require_option(layout_ == "contiguous" || layout_ == "zigzag" || layout_ == "striped" ||
                       layout_ == "varlen",
                   "--layout", layout_, "contiguous, zigzag, striped or varlen");
    require_option(stripe_block_ >= 1, "--stripe-block", stripe_block_, ">= 1");
    only_with(vm["stripe-block"].defaulted() || layout_ == "striped", "--stripe-block",
              std::to_string(stripe_block_), "given only with --layout striped");
    require_option(layout_ != "varlen" || docs, "--layout", layout_,
                   "--doc-lens or --doc-count with varlen (its document boundaries)");
    require_option(mask_ == "none" || mask_ == "causal" || mask_ == "window" ||
                       mask_ == "document" || mask_ == "document-full",
                   "--mask", mask_, "none, causal, window, document or document-full");
    if (mask_ == "window") {
      require_option(vm.count("window") > 0, "--mask", mask_, "-W/--window L[,R] with window");
      const auto lr = parse_int_list(window_);
      require_option(lr && (lr->size() == 1 || lr->size() == 2) &&
                         std::all_of(lr->begin(), lr->end(), [](int64_t n) { return n >= 0; }),
                     "--window", window_, "L or L,R with sizes >= 0");
      window_left_ = (*lr)[0];
      window_right_ = lr->size() == 2 ? (*lr)[1] : 0;
    } else {
      only_with(vm.count("window") == 0, "--window", window_, "given only with --mask window");
    }
    const bool doc_mask = mask_.rfind("document", 0) == 0;
    require_option(!doc_mask || docs, "--mask", mask_, "--doc-lens or --doc-count with it");
    only_with(!docs || doc_mask || layout_ == "varlen", lens_given ? "--doc-lens" : "--doc-count",
              lens_given ? doc_lens_str_ : std::to_string(doc_count_),
              "given only with a document mask or --layout varlen");
    if (e.launch.device == "cuda") {
      require_option(dtype_ != DType::f32, "--dtype", dtype_name_,
                     "bf16 or fp16 with --device cuda (the CUDA kernel's storage types)");
      require_option(!backward_, "--backward", "on", "off with --device cuda (a CPU-only pass)");
    }
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

  std::vector<std::string> config_lines(Runtime& rt) const override {
    return {cat("ranks ", rt.size(), " (cp ", rt.cp_size(), " x tp ", rt.tp_size(),
                ") threads/rank ", rt.threads(), " strategy ", strategy_name(strategy_), " U ",
                ulysses_, " layout ", layout_desc(), " mask ", mask_str(seqs_.front()), " dtype ",
                dtype_name(dtype_), " batch ", batch_, " heads ", heads_, " kv-heads ", kv_heads_,
                " head-dim ", head_dim_, " iters ", e_.iters, " warmup ", e_.warmup, " check ",
                e_.check, " pass ", backward_ ? "backward" : "forward")};
  }

  void config_json(report::JsonObject& cfg) const override {
    cfg.add("strategy", strategy_name(strategy_))
        .add("ulysses_degree", ulysses_)
        .add("layout", layout_)
        .add("stripe_block", stripe_block_)
        .add("documents", int64_t(doc_lens_.empty() ? doc_count_ : int64_t(doc_lens_.size())))
        .add("mask", mask_str(seqs_.front()))
        .add("dtype", dtype_name(dtype_))
        .add("batch", batch_)
        .add("heads", heads_)
        .add("kv_heads", kv_heads_)
        .add("head_dim", head_dim_)
        .add("pass", backward_ ? "backward" : "forward");
  }

  std::vector<std::vector<report::Column>> tables(const Bench& b) const override {
    return {{{"seq", "(tokens)", 9},
             {"local_seq", "(tokens)", 10},
             {"time", "(ms)", 11},
             {"TFLOP/s", cat("(", b.per_unit(), ")"), 11},
             {"imbal", "(max/mean)", 11},
             {"sent", "(MB/rank)", 11},
             {"model", "(MB/rank)", 11},
             {"#wrong", "", 7}}};
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
    const Problem p = problem(c.index, P, layout_, mask_);
    const AttnSpec& spec = p.spec;
    const int64_t S = c.index, hq0 = t * spec.heads_q, hk0 = t * spec.heads_kv;
    const double flops = attention_flops(batch_, S, S, spec) * (backward_ ? 2.5 : 1.0);
    if (flops / P / 1e9 * (e_.iters + e_.warmup) > 200)  // more than a few seconds
      b.note(cat("running seq=", S, " (", fixed(flops / P / 1e9, 0),
                 " GFLOP per rank per iteration) ..."));
    const Device dev = rt.device();
    const auto shard = [&](TensorId id, int64_t heads, int64_t dim, int64_t h0) {
      return on_device(make_shard(id, p.layout, r, batch_, heads, dim, dtype_, h0), dev);
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
        backward_
            ? attention_backward_send_bytes(strategy_, p.layout, spec, batch_, dtype_, ulysses_, r)
            : attention_send_bytes(strategy_, p.layout, spec, batch_, dtype_, ulysses_, r);
    call.model_bytes = [&] { return model; };
    call.counted = [](const ByteCounters& n) { return n.bytes("send") + n.bytes("alltoall"); };
    const Timing tm = b.time(c.label, call);

    Row row;
    row.result = {backward_ ? "backward" : "prefill",
                  strategy_name(strategy_),
                  layout_,
                  S,
                  rt.size(),
                  tm.mean_ms,
                  flops / P / (tm.mean_ms * 1e-3) / 1e12};
    row.take_bytes(tm);
    const double imbal = imbalance(p);
    row.extra.add("local_seq", p.layout.max_local_len())
        .add("imbalance", imbal)
        .add("byte_mismatch_ranks", int64_t(tm.byte_mismatches));
    if (b.check()) {
      const Partial host = dev.is_cpu() ? res
                                        : Partial{res.out.to_device(Device::cpu()),
                                                  res.lse.to_device(Device::cpu())};
      const auto [out, lse] = check_rows(host, p, r, t, b.per_gpu());
      const CheckStats o = out.reduced(), l = lse.reduced();
      row.result.wrong = int64_t(o.wrong + l.wrong);
      row.extra.add("checked_elements", int64_t(o.checked + l.checked))
          .add("max_err_out", o.max_err)
          .add("max_err_lse", l.max_err);
      max_err_out_ = std::max(max_err_out_, o.max_err);
      max_err_lse_ = std::max(max_err_lse_, l.max_err);
    }
    row.cells = {std::to_string(S),     std::to_string(p.layout.max_local_len()),
                 fixed(tm.mean_ms, 3),  fixed(row.result.tflops_per_rank, 4),
                 fixed(imbal, 3),       fixed(tm.sent_mb, 3),
                 fixed(tm.model_mb, 3), wrong_cell(row)};
    return {row};
  }

  void finish(Bench& b, const std::vector<Row>&, report::JsonObject& top) override {
    const int P = b.rt().cp_size();
    const int64_t S = seqs_.back();
    report::JsonObject lb;
    std::string line = cat("load balance (max/mean per-rank FLOPs, model, seq ", S, ", ",
                           mask_str(S), ", ", strategy_name(strategy_), " U ", ulysses_, "):");
    if (mask_ != "none") {
      lb.add("seq", S).add("mask", mask_str(S));
      std::vector<std::string> kinds = {"contiguous", "zigzag", "striped"};
      if (!doc_lens_.empty() || doc_count_ > 0) kinds.push_back("varlen");
      for (const std::string& kind : kinds) {
        const double v = imbalance(problem(S, P, kind, mask_, 1));
        line += cat(" ", kind, kind == "striped" ? "(1) " : " ", fixed(v, 2));
        lb.add(kind, v);
      }
      top.add_raw("load_balance", lb.str());
    }
    if (!b.root()) return;
    std::printf(
        "# Check: #wrong = elements over tolerance vs a float64 reference (-k 1, the default:\n"
        "#   %lld query rows per rank spread over its shard, against all global keys, every\n"
        "#   head, out and lse; N/A with -k 0) + (rank, call) pairs whose sent bytes differ from\n"
        "#   the byte model. time = max over ranks of the mean per-iteration wall time;\n"
        "#   TFLOP/s = attention_flops (the mask's visible pairs; x2.5 with --backward) / P / "
        "time;\n"
        "#   imbal = max / mean over cp ranks of attention_rank_flops (model); sent = point-to-\n"
        "#   point + all-to-all payload per rank per iteration, max over ranks (1 MB = 1e6 B);\n"
        "#   model = attention_send_bytes (attention_backward_send_bytes with --backward).\n",
        static_cast<long long>(kSampleRows));
    if (b.check()) {
      const auto [out, lse] = tolerance(b.per_gpu());
      std::printf(
          "# Check: tolerance out %g + %g*|ref|, lse %g + %g*|ref|; measured max |err| out %s, "
          "lse %s\n",
          out.abs, out.rel, lse.abs, lse.rel, report::sci(max_err_out_, 2).c_str(),
          report::sci(max_err_lse_, 2).c_str());
    }
    if (mask_ != "none") std::printf("# %s\n", line.c_str());
  }

  void plan(Plan& pl) const override {
    const int P = e_.launch.cp, T = e_.launch.tp;
    const int64_t Hl = heads_ / T, Gl = kv_heads_ / T;
    pl.line(cat("world ", e_.launch.world, " ranks = cp ", P, " x tp ", T,
                " (tp is the fastest rank index); strategy ", strategy_name(strategy_), " U ",
                ulysses_, "; layout ", layout_desc(), "; dtype ", dtype_name(dtype_), "; batch ",
                batch_, " heads ", heads_, " kv-heads ", kv_heads_, " head-dim ", head_dim_));
    pl.line(cat("communicators: ", T, " cp group(s) of ", P,
                " ranks (cp group t: world ranks t, t+", T, ", ...); ", T, " tp group(s) of ", P,
                " consecutive ranks",
                ulysses_ > 1 ? cat("; hybrid: ", P / ulysses_, " Ulysses group(s) of ", ulysses_,
                                   " consecutive cp ranks, ", ulysses_, " ring group(s) of ",
                                   P / ulysses_, " cp ranks")
                             : std::string()));
    pl.line(cat("device: ", device_plan(e_.launch)));
    std::vector<double> gflop(static_cast<size_t>(P)), mb(static_cast<size_t>(P));
    for (int64_t S : seqs_) {
      const Problem p = problem(S, P, layout_, mask_);
      double sum = 0, max = 0, max_mb = 0;
      for (int c = 0; c < P; ++c) {
        gflop[size_t(c)] =
            attention_rank_flops(strategy_, p.layout, p.spec, batch_, ulysses_, c) / 1e9;
        mb[size_t(c)] =
            double(attention_send_bytes(strategy_, p.layout, p.spec, batch_, dtype_, ulysses_, c)) /
            1e6;
        sum += gflop[size_t(c)], max = std::max(max, gflop[size_t(c)]);
        max_mb = std::max(max_mb, mb[size_t(c)]);
      }
      pl.line(cat("seq ", S, ", ", p.spec.mask.str(), ": ", fixed(sum * T / 1e3, 3),
                  " TFLOP in all (model, tiles computed), per rank max ", fixed(max, 3),
                  " GFLOP, imbalance ", fixed(sum > 0 ? max / (sum / P) : 1.0, 3),
                  ", sent per rank max ", fixed(max_mb, 3), " MB per forward"));
    }
    const Problem p = problem(seqs_.back(), P, layout_, mask_);
    pl.line(cat("per rank, seq ", seqs_.back(), ":"));
    pl.table({{"rank", "", 6},
              {"cp", "", 5},
              {"tp", "", 4},
              {"tokens", "(local)", 9},
              {"q_heads", "", 9},
              {"kv_heads", "", 9},
              {"GFLOP", "(model)", 11},
              {"send", "(MB)", 10},
              {"global positions", "(runs)", 0}});
    pl.for_shown(P * T, [&](int w) {
      const int c = w / T, tp = w % T;
      std::vector<std::string> descs;
      for (const Run& run : p.layout.runs(c))
        descs.push_back(report::run_desc(run));
      pl.row({std::to_string(w), std::to_string(c), std::to_string(tp),
              std::to_string(p.layout.local_len(c)), report::index_range(tp * Hl, Hl),
              report::index_range(tp * Gl, Gl), fixed(gflop[size_t(c)], 3), fixed(mb[size_t(c)], 3),
              report::join(descs, " ")});
    });
  }

 private:
  // Document boundaries [0, e1, ..., S]: the --doc-lens, or --doc-count documents of at least
  // one token each, the other S - N tokens spread in proportion to hashed weights in (0, 1].
  std::vector<int64_t> cu_seqlens(int64_t S) const {
    std::vector<int64_t> cu = {0};
    for (int64_t n : doc_lens_)
      cu.push_back(cu.back() + n);
    if (!doc_lens_.empty()) return cu;
    const int64_t N = doc_count_;
    std::vector<double> prefix(size_t(N) + 1, 0.0);
    for (int64_t d = 0; d < N; ++d)
      prefix[size_t(d) + 1] =
          prefix[size_t(d)] + double((mix64(0x5eedd0c5ull ^ uint64_t(d)) >> 11) + 1) * 0x1p-53;
    for (int64_t d = 1; d < N; ++d)
      cu.push_back(d + int64_t(double(S - N) * prefix[size_t(d)] / prefix[size_t(N)]));
    cu.push_back(S);
    return cu;
  }

  // The problem of length S on P ranks under a layout and a mask (-l and -m names).
  Problem problem(int64_t S, int P, const std::string& layout, const std::string& mask,
                  int64_t stripe_block = 0) const {
    Problem p;
    p.spec.heads_q = heads_ / e_.launch.tp;
    p.spec.heads_kv = kv_heads_ / e_.launch.tp;
    p.spec.head_dim = head_dim_;
    const std::vector<int64_t> cu =
        doc_lens_.empty() && doc_count_ == 0 ? std::vector<int64_t>{} : cu_seqlens(S);
    p.spec.mask = mask == "none"     ? Mask::none()
                  : mask == "causal" ? Mask::causal()
                  : mask == "window" ? Mask::window(window_left_, window_right_)
                                     : Mask::document(cu, mask == "document");
    p.spec.validate();
    p.layout = layout == "striped"
                   ? Layout::striped(S, P, stripe_block ? stripe_block : stripe_block_)
               : layout == "varlen" ? Layout::varlen(cu, P)
                                    : Layout::make(layout, S, P);
    DATTN_ASSERT(p.layout.global_seq() == S && p.layout.ranks() == P);
    return p;
  }

  std::string mask_str(int64_t S) const {
    return problem(S, 1, "contiguous", mask_).spec.mask.str();
  }

  // "striped(block 16)", "varlen(5 docs)", or the layout's name.
  std::string layout_desc() const {
    if (layout_ == "striped") return cat("striped(block ", stripe_block_, ")");
    if (layout_ == "varlen")
      return cat("varlen(", doc_lens_.empty() ? doc_count_ : int64_t(doc_lens_.size()), " docs)");
    return layout_;
  }

  // Max over mean of the cp ranks' attention_rank_flops (1: balanced).
  double imbalance(const Problem& p) const {
    double max = 0, sum = 0;
    for (int r = 0; r < p.layout.ranks(); ++r) {
      const double f = attention_rank_flops(strategy_, p.layout, p.spec, batch_, ulysses_, r);
      max = std::max(max, f), sum += f;
    }
    return sum > 0 ? max / (sum / p.layout.ranks()) : 1.0;
  }

  // The kernel computes in fp32 from the stored values the reference reads, so fp32 rounding
  // remains (~1e-7 out, ~1e-6 lse); |out| ~ 1e-2 at S = 4096, so the bounds reject out = 0.
  // The CUDA kernel rounds P to the storage dtype before O += P V: out bounds of a 16-bit
  // rounding (2^-8 bf16, 2^-10 fp16 relative).
  std::pair<Tolerance, Tolerance> tolerance(bool gpu) const {
    if (dtype_ == DType::f32) return {{1e-4, 1e-4}, {1e-4, 1e-4}};
    if (gpu)
      return {dtype_ == DType::bf16 ? Tolerance{1e-3, 1e-2} : Tolerance{3e-4, 3e-3}, {2e-4, 2e-4}};
    return {{2e-4, 2e-3}, {2e-4, 2e-4}};
  }

  // kSampleRows local rows spread over the shard (first and last included) against a float64
  // attention over the keys their mask band can see (bench_reference.h); (out, lse) statistics.
  std::pair<CheckStats, CheckStats> check_rows(const Partial& res, const Problem& p, int rank,
                                               int tp_rank, bool gpu) const {
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
    std::pair<CheckStats, CheckStats> st;
    if (n == 0) return st;
    const int64_t key_begin = spec.mask.left >= 0 ? std::max<int64_t>(0, lo - spec.mask.left) : 0;
    const int64_t key_end =  // hi + right + 1 could overflow for a huge right window
        spec.mask.right >= 0 ? hi + 1 + std::min(spec.mask.right, S - 1 - hi) : S;
    const RefShape shape{batch_, H, spec.heads_kv, spec.head_dim, Dv, double(spec.scale())};
    const auto row = [&](uint64_t id, int64_t b, int64_t ps, int64_t h, int64_t dim, float* out) {
      const uint64_t key = row_key(id, b, ps, tp_rank * (id == kQ ? H : spec.heads_kv) + h);
      for (int64_t d = 0; d < dim; ++d)
        out[d] = input_value(key, d, dtype_);
    };
    const DecodeReference ref = merge_states(
        shape, n,
        softmax_states(shape, pos, key_begin, key_end, 0, 1, kQ, kK, kV, row,
                       [&](int64_t qp, int64_t kp) { return spec.mask.visible(qp, kp); }),
        1);
    const auto [tol_out, tol_lse] = tolerance(gpu);
    const float* out = res.out.ptr<float>();
    const float* lse = res.lse.ptr<float>();
    for (int64_t b = 0; b < batch_; ++b)
      for (int64_t j = 0; j < n; ++j)
        for (int64_t h = 0; h < H; ++h) {
          const int64_t i = rows[size_t(j)];
          st.second.compare(lse[(b * H + h) * len + i], ref.lse[size_t((b * H + h) * n + j)],
                            tol_lse);
          for (int64_t d = 0; d < Dv; ++d)
            st.first.compare(out[((b * len + i) * H + h) * Dv + d],
                             ref.out[size_t(((b * n + j) * H + h) * Dv + d)], tol_out);
        }
    return st;
  }

  int64_t batch_ = 1, heads_ = 8, kv_heads_ = 2, head_dim_ = 128;
  int64_t seq_begin_ = 4096, seq_end_ = 0, seq_factor_ = 2;
  std::string dtype_name_ = "bf16", strategy_name_ = "ring", layout_ = "zigzag";
  std::string mask_ = "causal", window_, doc_lens_str_;
  DType dtype_ = DType::bf16;
  Strategy strategy_ = Strategy::ring;
  int ulysses_ = 1;
  int64_t stripe_block_ = 1, window_left_ = 0, window_right_ = 0, doc_count_ = 0;
  std::vector<int64_t> doc_lens_, seqs_;
  bool backward_ = false;
  EngineOptions e_;
  double max_err_out_ = 0, max_err_lse_ = 0;
};

}  // namespace

std::unique_ptr<Workload> make_prefill_workload() {
  return std::make_unique<Prefill>();
}

}  // namespace dattn::bench
