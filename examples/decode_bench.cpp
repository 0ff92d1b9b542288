// The decode workload (examples/engine.h): each rank prefills its shard of a context into a
// KvCache, then each strategy (tree, ring, allgather) decodes S_q new tokens per step, a row each:
// latency, bytes against decode_send_bytes, extra memory, one more step checked against float64.
#include <algorithm>
#include <map>
#include <optional>
#include <utility>

#include "examples/bench_device.h"
#include "examples/bench_inputs.h"
#include "examples/bench_reference.h"
#include "examples/engine.h"
#include "launch/program.h"
#include "src/attention.h"
#include "src/base/error.h"
#include "src/decode.h"
#include "src/layout.h"
#include "src/models.h"

namespace dattn::bench {
namespace {

using detail::cat;
using report::fixed;

// The strategy's extra memory per rank by model, in bytes: tree keeps the partial and the packed
// buffer of the allreduces (B * S_q * H * (D_v + 1) fp32, twice); ring two receive buffers of
// the largest shard's K and V (none on one rank); allgather the whole context's K and V.
double extra_bytes_model(DecodeStrategy s, const KvCache& cache, int64_t s_q) {
  const AttnSpec& spec = cache.spec();
  if (s == DecodeStrategy::tree)
    return double(cache.batch() * s_q * spec.heads_q * (spec.dim_v() + 1) * 8);
  int64_t tokens = s == DecodeStrategy::ring ? 0 : cache.length();
  for (int r = 0; s == DecodeStrategy::ring && cache.ranks() > 1 && r < cache.ranks(); ++r)
    tokens = std::max(tokens, 2 * cache.local_len(r));
  return double(cache.batch() * tokens * spec.heads_kv * (spec.head_dim + spec.dim_v()) *
                dtype_size(cache.dtype()));
}

class DecodeWorkload final : public Workload {
 public:
  Defaults defaults() const override {  // --device cuda runs every strategy (resolve: the dtype)
    Defaults d{"steps,n", "timed decode steps per strategy", 20, 2};
    d.runs_on_cuda = true;
    return d;
  }

  void add_options(po::options_description& desc) override {
    auto add = [&](const char* name, auto* value, const char* help) {
      desc.add_options()(name, po::value(value)->default_value(*value), help);
    };
    add("context,x", &context_, "context length: tokens prefilled into the cache before decoding");
    add("new-tokens,q", &new_tokens_, "new tokens S_q per step (queries, and K/V appended)");
    add("strategies,a", &strategies_str_,
        "comma-separated decode strategies: tree, ring, allgather (always run in that order)");
    add("placement,p", &placement_name_, "who stores each decoded token: round_robin, last_rank");
    add("layout,l", &layout_, "layout of the prefilled context: contiguous, zigzag or striped");
    add("node-size", &node_size_,
        "ranks per node for the tree: 0 = the real nodes; N = fake nodes of N consecutive ranks");
    shape_.add_options(desc);
  }

  void resolve(const po::variables_map&, const EngineOptions& e) override {
    e_ = e;
    require_option(context_ >= 1, "--context", context_, ">= 1");
    shape_.resolve(e.launch.tp);
    require_option(new_tokens_ >= 1, "--new-tokens", new_tokens_, ">= 1");
    require_option(node_size_ >= 0, "--node-size", node_size_, ">= 0");
    require_one_of("--layout", layout_, {"contiguous", "zigzag", "striped"});
    require_one_of("--placement", placement_name_, {"round_robin", "last_rank"});
    placement_ = placement_name_ == "last_rank" ? Placement::last_rank : Placement::round_robin;
    // In the order of least extra memory first (peak RSS only grows); as many found as given.
    const std::string list = cat(",", strategies_str_, ",");
    for (DecodeStrategy s : {DecodeStrategy::tree, DecodeStrategy::ring, DecodeStrategy::allgather})
      if (list.find(cat(",", strategy_name(s), ",")) != std::string::npos) strategies_.push_back(s);
    require_option(strategies_.size() + 1 == size_t(std::count(list.begin(), list.end(), ',')),
                   "--strategies", strategies_str_,
                   "a comma-separated list of tree, ring and allgather, each at most once");
    for (DecodeStrategy s : strategies_)
      names_ += cat(names_.empty() ? "" : ",", strategy_name(s));
    require_option(e.launch.device != "cuda" || shape_.dtype != DType::f32, "--dtype",
                   shape_.dtype_name,
                   "bf16 or fp16 with --device cuda (the CUDA kernel's storage types)");
  }

  RuntimeOptions runtime_options(const EngineOptions& e) const override {
    RuntimeOptions r = Workload::runtime_options(e);
    r.node_size = node_size_;
    return r;
  }

  std::vector<std::string> config_lines(Runtime& rt) const override {
    return {cat("ranks ", rt.size(), " (cp ", rt.cp_size(), " x tp ", rt.tp_size(),
                ") threads/rank ", rt.threads(), " tree ",
                rt.spans_nodes() ? cat("two-level (nodes of ", rt.node().size(), " ranks)")
                                 : "flat (one node)"),
            settings()};
  }

  void config_json(report::Json& cfg) const override {
    cfg.update({{"strategies", names_},
                {"context", context_},
                {"layout", layout_},
                {"placement", placement_name(placement_)},
                {"mask", "causal"}});
    shape_.json(cfg);
    cfg.update({{"new_tokens", new_tokens_},
                {"node_size", node_size_},
                {"model_node_size", model_nodes_},
                {"two_level_tree", two_level_}});
  }

  // A GPU's table adds TFLOP/s (a CPU rank's decode is bound by memory and messages).
  std::vector<std::vector<report::Column>> tables(const Bench& b) const override {
    std::vector<report::Column> cols = {
        {"strategy", "", 10},    {"context", "(tokens)", 9}, {"mean", "(ms)", 10},
        {"p50", "(ms)", 10},     {"p99", "(ms)", 10},        {"sent", "(KB/rank/step)", 14},
        {"model", "(KB)", 11},   {"extra", "(MiB)", 10},     {"rss", "(MiB)", 9},
        {"kernel", "(GB/s)", 8}, {"#wrong", "", 7}};
    if (b.per_gpu()) cols.insert(cols.begin() + 5, {"TFLOP/s", "(per GPU)", 11});
    return {cols};
  }

  // One case per strategy; a --compare rerun times the first one.
  std::vector<Case> cases(const Bench& b) const override {
    std::vector<Case> out;
    for (size_t i = 0; i < (b.opts().comparing() ? 1 : strategies_.size()); ++i)
      out.push_back({0, cat("decode ", strategy_name(strategies_[i])), int64_t(i)});
    return out;
  }

  std::vector<Row> run(Bench& b, const Case& c) override {
    Runtime& rt = b.rt();
    const DecodeStrategy strategy = strategies_[size_t(c.index)];
    const char* name = strategy_name(strategy);
    const int P = rt.cp_size(), r = rt.cp_rank();
    const AttnSpec spec = shape_.spec();
    const int64_t H = spec.heads_q, G = spec.heads_kv, D = shape_.head_dim;  // D_v = D
    const int64_t hq0 = rt.tp_rank() * H, hk0 = rt.tp_rank() * G, Sq = new_tokens_,
                  B = shape_.batch;
    const Layout layout = Layout::make(layout_, context_, P);
    model_nodes_ = node_size_ > 0 ? node_size_ : rt.spans_nodes() ? rt.node().size() : 0;
    two_level_ = rt.spans_nodes();
    if (b.check() && !ref_) {  // of the checked step, the last one, the same for every strategy
      b.note(cat("check: float64 reference of the last step over all ", final_length(), " keys"));
      // The CUDA kernel rounds P to the dtype before O += P V (its out bound is a 16-bit
      // rounding of out), its lse from fp32 scores.
      const bool bf16 = shape_.dtype == DType::bf16, gpu = b.per_gpu();
      tol_out_ = !gpu ? kDecodeTol : bf16 ? Tolerance{1e-3, 1e-2} : Tolerance{3e-4, 3e-3};
      tol_lse_ = !gpu ? kDecodeTol : Tolerance{2e-4, 2e-4};
      ref_ = decode_reference(shape_, Sq, final_length(), shape_.dtype);
    }

    // A fresh cache on the runtime's device (a GPU cache copies the host-generated rows up).
    const Device dev = rt.device();
    KvCache cache(P, r, spec, B, shape_.dtype, layout.max_local_len() + steps_total() * Sq,
                  placement_, dev);
    b.note(cat(name, ": prefilling ", context_, " tokens, ", e_.warmup, " warm-up + ", e_.iters,
               " timed", b.check() ? " + 1 checked" : "", " steps of ", Sq, " new tokens ..."));
    cache.prefill(make_shard(kK, layout, r, B, G, D, shape_.dtype, hk0),
                  make_shard(kV, layout, r, B, G, D, shape_.dtype, hk0), layout);

    // A step appends the new tokens' K/V and makes q, then times dattn::decode (on a GPU, until
    // its queued work has run); every step's bytes (the checked one's too) are the model's.
    Tensor q;
    Partial res;
    TimedCall step;
    step.prepare = [&](int) {
      const int64_t pos0 = cache.length();
      cache.append(make_tokens(kK, pos0, Sq, B, G, D, shape_.dtype, hk0),
                   make_tokens(kV, pos0, Sq, B, G, D, shape_.dtype, hk0));
      q = on_device(make_tokens(kQ, pos0, Sq, B, H, D, shape_.dtype, hq0), dev);
    };
    step.call = [&] {
      res = decode(rt, q, cache, strategy);
      synchronize(dev);
    };
    step.model_bytes = [&] { return decode_send_bytes(strategy, cache, Sq, model_nodes_, r); };
    step.unit = "steps";
    const Timing t = b.time(c.label, step);
    Row row;
    const double flops = step_flops() / P / (t.step_mean_ms * 1e-3) / 1e12;
    // #wrong is never N/A: every step's bytes are checked (and with -k, the elements).
    row.result = {"decode", name, layout_, context_, rt.size(), t.step_mean_ms, flops, 0, 0, 0};
    row.take_bytes(t);
    if (b.check()) {
      step.warmup = 0, step.iters = 1;
      row.byte_mismatches += b.time(c.label + " checked", step).byte_mismatches;
    }
    const double extra = extra_bytes_model(strategy, cache, Sq) / (1024.0 * 1024.0);
    const double rss = allreduce_max(peak_rss_mib());
    row.extra = {{"final_length", cache.length()},
                 {"p50_ms", t.p50_ms},
                 {"p99_ms", t.p99_ms},
                 {"extra_mib_model", extra},
                 {"rss_mib", rss},
                 {"byte_mismatches", row.byte_mismatches}};
    if (b.check()) {  // on the host: this rank's heads against the reference, then the first run
      Partial got = res;
      if (!dev.is_cpu()) got = {res.out.to_device(Device::cpu()), res.lse.to_device(Device::cpu())};
      DecodeCheck vs, same;
      vs.compare(got, ref_->out.data(), ref_->lse.data(), shape_.heads, rt.tp_rank() * H, tol_out_,
                 tol_lse_);
      vs = vs.reduced();
      row.extra["checked_elements"] = vs.out.checked + vs.lse.checked;
      record(row, vs_ref_, vs, "wrong_vs_float64", "err");
      if (first_) {
        same.compare(got, first_->out.ptr<float>(), first_->lse.ptr<float>(), H, 0, kSameTol,
                     kSameTol);
        record(row, vs_first_, same.reduced(), "wrong_vs_first_strategy", "diff");
      }
      if (!first_) first_ = got;
    }
    const auto f3 = [](double v) { return fixed(v, 3); };
    if (t.kernel_gbs >= 0) row.extra["kernel_gbs"] = t.kernel_gbs;
    row.cells = {name,          std::to_string(context_), f3(t.step_mean_ms),   f3(t.p50_ms),
                 f3(t.p99_ms),  f3(t.sent_mb * 1e3),      f3(t.model_mb * 1e3), f3(extra),
                 fixed(rss, 1), kernel_cell(t),           wrong_cell(row)};
    if (b.per_gpu()) row.cells.insert(row.cells.begin() + 5, f3(flops));
    timing_[strategy] = t;
    return {row};
  }

  void finish(Bench& b, const std::vector<Row>&, report::Json& top) override {
    if (b.root() && b.check()) {  // the check's totals over the strategies, with their bounds
      report::print_footer_line(
          "vs float64", cat(vs_ref_.line("err"), " (within out ", tol_out_.abs, " + ", tol_out_.rel,
                            "*|ref|, lse ", tol_lse_.abs, " + ", tol_lse_.rel, "*|ref|, ",
                            final_length(), " keys)"));
      if (vs_first_.out.checked > 0)
        report::print_footer_line("strategies agree",
                                  cat(vs_first_.line("diff"), " (within ", kSameTol.abs, " + ",
                                      kSameTol.rel, "*|first strategy|)"));
    }
    // tree against ring (the target) and allgather: times faster (mean, p50) and fewer bytes.
    std::optional<bool> met;  // set when tree and ring both ran
    for (DecodeStrategy other : {DecodeStrategy::ring, DecodeStrategy::allgather}) {
      if (!timing_.count(DecodeStrategy::tree) || !timing_.count(other)) continue;
      const Timing &t = timing_[DecodeStrategy::tree], &o = timing_[other];
      const double mean = o.step_mean_ms / t.step_mean_ms, p50 = o.p50_ms / t.p50_ms;
      const double bytes = o.sent_mb / t.sent_mb;  // 0/0 on one rank: nan, printed n/a
      b.note(cat("tree vs ", strategy_name(other), ": latency ", fixed(mean, 1),
                 "x faster (mean; p50 ", fixed(p50, 1), "x), bytes ",
                 o.sent_mb > 0 ? cat(fixed(bytes, 1), "x fewer") : "n/a (nothing sent)"));
      top[cat("tree_vs_", strategy_name(other))] = {
          {"latency_mean", mean}, {"latency_p50", p50}, {"bytes", bytes}};
      if (other == DecodeStrategy::ring) met = mean >= 8 && bytes >= 100;
    }
    const bool target = b.rt().cp_size() == 4 && b.rt().tp_size() == 1 && context_ == 262144 &&
                        shape_.dtype == DType::f32 && shape_.heads == 8 && shape_.kv_heads == 2 &&
                        shape_.head_dim == 128 && new_tokens_ == 1 && shape_.batch == 1;
    b.note(
        cat("target: 4 ranks, context 262144, fp32, H=8, H_kv=2, D=128, S_q=1: tree >= 8x "
            "faster than ring, >= 100x fewer bytes",
            !target ? " (this run is not the target configuration)"
            : !met  ? " (this run has not both tree and ring)"
            : *met  ? ": met"
                    : ": NOT met"));
    top["target"] = {{"ranks", 4},
                     {"context", 262144},
                     {"latency_ratio_vs_ring", 8.0},
                     {"bytes_ratio_vs_ring", 100.0},
                     {"this_run_is_target", target}};
    if (target && met) top["target"]["met"] = *met;

    // The roofline: each strategy's local kernel against the read bandwidth; the target is on
    // the lowest of them.
    std::vector<std::pair<std::string, double>> kernels;
    for (const auto& [s, t] : timing_)
      kernels.push_back({strategy_name(s), t.kernel_gbs});
    const std::vector<double> ratios = roofline_footer(b, kernels, top);
    const double low = *std::min_element(ratios.begin(), ratios.end());
    const bool roof_target = b.rt().size() == 1 && b.rt().threads() == 2 && context_ == 262144 &&
                             shape_.dtype != DType::f16 && shape_.heads == 8 &&
                             shape_.kv_heads == 2 && shape_.head_dim == 128 && new_tokens_ == 1 &&
                             shape_.batch == 1;
    b.note(cat("target: 1 rank x 2 threads, context 262144, fp32 or bf16, H=8, H_kv=2, D=128, ",
               "S_q=1: every kernel >= 0.80 of the read bandwidth (floor 0.60)",
               !roof_target ? " (this run is not the target configuration)"
               : low < 0    ? " (no kernel time on this device)"
               : low >= 0.8 ? ": met"
               : low >= 0.6 ? ": NOT met (above the floor)"
                            : ": NOT met (below the floor)"));
    report::Json& jr = top["roofline_target"] = {
        {"ranks", 1},   {"threads", 2}, {"context", 262144},
        {"ratio", 0.8}, {"floor", 0.6}, {"this_run_is_target", roof_target}};
    if (roof_target && low >= 0) jr["met"] = low >= 0.8, jr["above_floor"] = low >= 0.6;
  }

  // Every rank's context and decoded tokens, heads and model bytes per step for each strategy, from
  // rank 0's cache (allocated, never filled; it holds every rank's runs) after the run's appends.
  // --node-size 0 means the job's real nodes, unknown before it runs: the plan takes one node.
  void plan(Plan& p) const override {
    const int W = e_.launch.world, P = e_.launch.cp, T = e_.launch.tp, n = node_size_;
    const int64_t Hl = shape_.heads / T, Gl = shape_.kv_heads / T, Sq = new_tokens_,
                  B = shape_.batch;
    const AttnSpec spec = shape_.spec();
    const Layout layout = Layout::make(layout_, context_, P);
    p.grid(settings(), cat("; tree ", n > 0 && n < P ? cat("two-level, nodes of ", n) : "flat",
                           "; ", fixed(step_flops() / P / 1e9, 6), " GFLOP per rank per step"));
    KvCache cache(P, 0, spec, B, shape_.dtype, layout.max_local_len() + steps_total() * Sq,
                  placement_);
    const Tensor kv =
        Tensor::empty({B, layout.local_len(0), Gl, shape_.head_dim}, shape_.dtype);  // D_v = D
    const Tensor kv_new = Tensor::zeros({B, Sq, Gl, shape_.head_dim}, shape_.dtype);
    cache.prefill(kv, kv, layout);
    std::map<int, std::vector<double>> kb;  // cp rank of a shown rank: KB per step per strategy
    for (int rank : Plan::shown(W))
      kb[rank / T].assign(strategies_.size(), 0.0);
    for (int64_t step = 0; step < steps_total(); ++step) {
      cache.append(kv_new, kv_new);
      for (auto& [c, v] : kb)
        for (size_t i = 0; i < v.size() && step >= e_.warmup && step < e_.warmup + e_.iters; ++i)
          v[i] += double(decode_send_bytes(strategies_[i], cache, Sq, n, c)) / e_.iters / 1e3;
    }
    std::vector<report::Column> cols = {{"rank", "", 6}, {"cp", "", 5}, {"tp", "", 4}};
    for (const char* name : {"context", "decoded"})
      cols.push_back({name, "(tokens)", 9});
    cols.insert(cols.end(), {{"q_heads", "", 9}, {"kv_heads", "", 9}});
    for (DecodeStrategy s : strategies_)
      cols.push_back({strategy_name(s), "(KB/step)", 12});
    cols.push_back({"positions", "(context runs, then decoded)", 0});
    p.line(cat("per rank: context (", layout_, " layout) and decoded tokens (", steps_total(),
               " steps, ", placement_name(placement_), "), model bytes per timed step (1e3 B):"));
    p.table(cols);
    p.for_shown(W, [&](int rank) {
      const int c = rank / T, tp = rank % T;
      std::vector<std::string> cells;
      for (int64_t v : {int64_t(rank), int64_t(c), int64_t(tp), layout.local_len(c),
                        cache.local_len(c) - layout.local_len(c)})
        cells.push_back(std::to_string(v));
      cells.push_back(report::index_range(tp * Hl, Hl));
      cells.push_back(report::index_range(tp * Gl, Gl));
      for (double v : kb.at(c))
        cells.push_back(fixed(v, 3));
      cells.push_back(report::positions(cache.runs(c)));
      p.row(cells);
    });
  }

 private:
  // The run's settings, as the header and the plan print them.
  std::string settings() const {
    return cat("strategies ", names_, " context ", context_, " layout ", layout_, " placement ",
               placement_name(placement_), " mask causal ", shape_.words(), " new-tokens ",
               new_tokens_, " steps ", e_.iters, " warmup ", e_.warmup, " check ", e_.check,
               " node-size ", node_size_);
  }
  // Decode steps per strategy: warm-up, timed, and the checked one.
  int64_t steps_total() const { return e_.warmup + e_.iters + (e_.check ? 1 : 0); }
  // Tokens in the cache after the last step: the checked step's keys.
  int64_t final_length() const { return context_ + steps_total() * new_tokens_; }
  // The attention FLOPs of one decode step by model, for one tp rank's heads: the S_q new queries
  // against the prefilled context, every key visible; the new tokens among themselves left out.
  double step_flops() const {
    return attention_flops(shape_.batch, new_tokens_, context_, shape_.spec(Mask::none()));
  }
  // A comparison's #wrong into the row and its JSON keys; its statistics into the run's total.
  void record(Row& row, DecodeCheck& sum, const DecodeCheck& e, const char* key, const char* err) {
    sum.add(e);
    row.result.wrong += int64_t(e.wrong());
    row.extra.update({{key, e.wrong()},
                      {cat("max_", err, "_out"), e.out.max_err},
                      {cat("max_", err, "_lse"), e.lse.max_err}});
  }

  int64_t context_ = 65536, new_tokens_ = 1;
  Shape shape_;
  std::string strategies_str_ = "tree,ring,allgather";
  std::string placement_name_ = "round_robin", layout_ = "contiguous";
  int node_size_ = 0;
  Placement placement_ = Placement::round_robin;
  std::vector<DecodeStrategy> strategies_;
  std::string names_;  // strategies_ as "tree,ring"
  EngineOptions e_;
  // What the run found: the model's node size, the check's reference, bounds, first result and
  // totals, and each strategy's timing (for the ratios).
  int model_nodes_ = 0;
  bool two_level_ = false;
  std::optional<DecodeReference> ref_;
  std::optional<Partial> first_;
  DecodeCheck vs_ref_, vs_first_;
  Tolerance tol_out_, tol_lse_;
  std::map<DecodeStrategy, Timing> timing_;
};

}  // namespace

std::unique_ptr<Workload> make_decode_workload() {
  return std::make_unique<DecodeWorkload>();
}

}  // namespace dattn::bench
