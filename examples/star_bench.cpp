// The star workload (src/star.h) on the benchmark engine: phase 1 (the context encoding, an
// approximation) timed against exact ring attention on the zigzag layout, and its accuracy with
// and without an attention sink and the anchor; phase 2 (exact decode steps) against tree decode.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "examples/bench_inputs.h"
#include "examples/bench_reference.h"
#include "examples/engine.h"
#include "launch/program.h"
#include "src/attention.h"
#include "src/decode.h"
#include "src/models.h"
#include "src/star.h"

namespace dattn::bench {
namespace {

using detail::cat;
using report::fixed;
using report::sci;

// The accuracy part's exact attention (ring) runs over at most this many tokens (above: the
// block and the anchor scaled alike).
constexpr int64_t kAccuracyMaxSeq = 16384;
// Block 0's rows see all their keys: exact attention up to fp32 rounding.
constexpr double kRank0RelTol = 1e-5, kRank0LseTol = 1e-4;

// star's phase 1 against the exact result over every row of every rank, as an accuracy row;
// first_rows: how many of this rank's first rows form block 0 (0 on the other ranks).
Row accuracy_row(const Partial& star, const Partial& exact, int64_t first_rows, double sink,
                 int64_t anchor, uint64_t byte_mismatches) {
  const int64_t n = exact.out.size(1), hd = exact.out.size(2) * exact.out.size(3);
  RelL2 all, first;  // out over every row; over block 0's
  const float *so = star.out.ptr<float>(), *eo = exact.out.ptr<float>();
  for (int64_t i = 0; i < exact.out.numel(); ++i) {
    all.add(so[i], eo[i]);
    if ((i / hd) % n < first_rows) first.add(so[i], eo[i]);
  }
  double lse_sum = 0, lse0 = 0;  // the sum of |lse diff|; its max over block 0's rows
  const float *sl = star.lse.ptr<float>(), *el = exact.lse.ptr<float>();
  for (int64_t i = 0; i < exact.lse.numel(); ++i) {
    const double d = sl[i] == el[i] ? 0.0 : std::abs(double(sl[i]) - double(el[i]));
    lse_sum += d;
    if (i % n < first_rows) lse0 = std::max(lse0, std::isfinite(d) ? d : INFINITY);
  }
  const double count = double(allreduce_sum(uint64_t(exact.lse.numel())));
  const double err = all.reduced(), err0 = first.reduced(), lse = allreduce_sum(lse_sum) / count;
  lse0 = allreduce_max(lse0);
  const bool exact0 = err0 <= kRank0RelTol && lse0 <= kRank0LseTol;
  Row row;
  row.in_json = false;  // finish writes these rows into the JSON's "accuracy"
  row.byte_checked = true, row.byte_mismatches = byte_mismatches;
  row.result.wrong = exact0 ? 0 : 1;
  row.extra = {{"sink", sink},
               {"anchor", anchor},
               {"rel_err_out", err},
               {"lse_mean_abs_err", lse},
               {"rank0_rel_err_out", err0},
               {"rank0_lse_max_abs_err", lse0},
               {"rank0_exact", exact0},
               {"byte_mismatches", byte_mismatches},
               {"wrong", row.wrong()}};
  const std::string inputs = sink != 0 ? cat("sink ", fixed(sink, 1)) : "no sink";
  row.cells = {inputs,      std::to_string(anchor), sci(err, 3),
               sci(lse, 3), sci(err0, 2),           wrong_cell(row)};
  return row;
}

class StarWorkload final : public Workload {
 public:
  Defaults defaults() const override {
    return {.iters_help = "timed iterations of phase 1 and of ring attention", .iters = 3};
  }

  void add_options(po::options_description& desc) override {
    const auto opt = [&](const char* name, auto& v, const char* help) {
      desc.add_options()(name, po::value(&v)->default_value(v), help);
    };
    opt("seq,s", seq_, "context length S");
    desc.add_options()("block", po::value(&block_)->value_name("arg (=S/16)"),
                       "tokens per block b of the blocks layout");
    desc.add_options()("anchor", po::value(&anchor_)->value_name("arg (=block)"),
                       "anchor a: the first tokens every rank sees (0 .. block; 0 = off)");
    opt("new-tokens,q", new_tokens_, "tokens S_q per decode step");
    opt("steps", steps_, "decode steps (phase 2)");
    opt("sink", sink_, "attention sink strength s (the first 4 keys and every query; 0 = no sink)");
    shape_.add_options(desc);
  }

  void resolve(const po::variables_map& vm, const EngineOptions& e) override {
    require_option(seq_ >= 1, "--seq", seq_, ">= 1");
    shape_.resolve(e.launch.tp);
    require_option(new_tokens_ >= 1, "--new-tokens", new_tokens_, ">= 1");
    require_option(steps_ >= 1, "--steps", steps_, ">= 1");
    if (!vm.count("block")) block_ = std::max<int64_t>(1, seq_ / 16);
    require_option(block_ >= 1 && block_ <= seq_, "--block", block_,
                   cat(">= 1 and <= --seq (", seq_, ")"));
    if (!vm.count("anchor")) anchor_ = block_;
    require_option(anchor_ >= 0 && anchor_ <= block_, "--anchor", anchor_,
                   cat(">= 0 and <= --block (", block_, ")"));
    require_option(std::isfinite(sink_) && sink_ >= 0, "--sink", sink_, ">= 0");
    spec_ = shape_.spec();
    spec_.validate();
    // The accuracy part's problem: an anchor stays >= 1 token, and a = b stays a = b.
    acc_seq_ = std::min(seq_, kAccuracyMaxSeq);
    acc_block_ = scaled() ? std::max<int64_t>(1, block_ * acc_seq_ / seq_) : block_;
    acc_anchor_ = anchor_ == block_ ? acc_block_ : anchor_;
    if (scaled() && anchor_ != 0 && anchor_ != block_)
      acc_anchor_ = std::clamp<int64_t>(anchor_ * acc_seq_ / seq_, 1, acc_block_);
  }

  void config_json(report::Json& cfg) const override {
    cfg.update({{"seq", seq_}, {"block", block_}, {"anchor", anchor_}, {"mask", "causal"}});
    shape_.json(cfg);
    cfg.update({{"new_tokens", new_tokens_}, {"steps", steps_}, {"sink", sink_}});
  }

  std::vector<std::vector<report::Column>> tables(const Bench&) const override {
    // clang-format off
    return {{{"strategy", "", 9}, {"layout", "", 24}, {"time", "(ms)", 11}, {"sent", "(MB/rank)", 10},
             {"model", "(MB)", 10}, {"flops max", "(GFLOP/rank)", 13}, {"imbal", "", 6},
             {"#wrong", "", 7}},
            {{"inputs", "", 10}, {"anchor", "(tokens)", 9}, {"rel_err(out)", "(all rows)", 13},
             {"rel_err(lse)", "(mean abs)", 13}, {"block 0", "(rel_err out)", 14}, {"#wrong", "", 7}},
            {{"strategy", "", 9}, {"context", "(tokens)", 9}, {"mean", "(ms)", 10}, {"p50", "(ms)", 10},
             {"sent", "(KB/rank/step)", 14}, {"model", "(KB)", 10}, {"#wrong", "", 7}}};
    // clang-format on
  }

  // Phase 1 of star and of ring (table 0), the accuracy (1), phase 2 (2); a --compare rerun
  // times star's phase 1 alone.
  std::vector<Case> cases(const Bench& b) const override {
    std::vector<Case> all = {{0, cat("star phase 1 star_prefill seq ", seq_), 0},
                             {0, "star phase 1 ring attention", 1},
                             {1, "star accuracy", 2},
                             {2, "star phase 2", 3}};
    if (b.opts().comparing()) all.resize(1);
    return all;
  }
  std::vector<Row> run(Bench& b, const Case& c) override {
    if (c.index <= 1) return {run_phase1(b, c.index == 0)};
    return c.index == 2 ? run_accuracy(b) : run_phase2(b);
  }
  void finish(Bench& b, const std::vector<Row>& rows, report::Json& top) override;
  void plan(Plan& p) const override;

 private:
  bool scaled() const { return seq_ > kAccuracyMaxSeq; }
  // This tp rank's slice [B, n, heads, D] of tensor id: its shard under l, or (no l) the
  // decode step's tokens at positions pos0 ..
  Tensor make(const HashedRows& in, TensorId id, const Runtime& rt, const Layout* l,
              int64_t pos0 = 0) const {
    const int64_t heads = id == kQ ? spec_.heads_q : spec_.heads_kv, h0 = rt.tp_rank() * heads;
    return l ? make_shard(id, *l, rt.cp_rank(), shape_.batch, heads, shape_.head_dim, in, h0)
             : make_tokens(id, pos0, new_tokens_, shape_.batch, heads, shape_.head_dim, in, h0);
  }
  // A row of phase 1 or 2: the common keys (TFLOP/s per rank from `flops`), t's bytes.
  Row timed_row(const Runtime& rt, int phase, const char* strategy, const char* layout,
                double time_ms, double flops, uint64_t wrong, const Timing& t) const {
    Row row;
    row.result = {"star", strategy, layout, seq_, rt.size(), time_ms};
    row.result.tflops_per_rank = flops / rt.cp_size() / (time_ms * 1e-3) / 1e12;
    row.result.wrong = int64_t(wrong);
    row.take_bytes(t);
    row.extra = {{"phase", phase}, {"byte_mismatches", t.byte_mismatches}};
    return row;
  }
  Row run_phase1(Bench& b, bool star);
  std::vector<Row> run_accuracy(Bench& b);
  std::vector<Row> run_phase2(Bench& b);

  int64_t seq_ = 32768, block_ = 0, anchor_ = -1, new_tokens_ = 1;
  Shape shape_;
  int steps_ = 5;
  double sink_ = 4.0;
  AttnSpec spec_;  // causal, one tp rank's heads
  int64_t acc_seq_ = 0, acc_block_ = 0, acc_anchor_ = 0;
  DecodeCheck vs_tree_, vs_ref_[2];  // phase 2's checks: star vs tree; star and tree vs float64
};

Row StarWorkload::run_phase1(Bench& b, bool star) {
  Runtime& rt = b.rt();
  const int P = rt.cp_size(), r = rt.cp_rank();
  const Layout l = star ? Layout::blocks(seq_, P, block_) : Layout::zigzag(seq_, P);
  const HashedRows in(shape_.dtype, float(sink_));
  const Tensor q = make(in, kQ, rt, &l), k = make(in, kK, rt, &l), v = make(in, kV, rt, &l);
  TimedCall call;
  call.call = [&] {
    (void)(star ? star_prefill(rt, q, k, v, spec_, l, anchor_)
                : attention(rt, q, k, v, spec_, l, Strategy::ring));
  };
  call.model_bytes = [&] {
    return star ? star_prefill_send_bytes(l, spec_, shape_.batch, shape_.dtype, anchor_, r)
                : attention_send_bytes(Strategy::ring, l, spec_, shape_.batch, shape_.dtype, 1, r);
  };
  const Timing t = b.time(star ? "star phase 1 star_prefill" : "star phase 1 ring attention", call);
  const auto [max, sum, imbalance] = spread(P, [&](int rank) {
    return star ? star_prefill_flops(l, spec_, shape_.batch, anchor_, rank)
                : attention_rank_flops(Strategy::ring, l, spec_, shape_.batch, 1, rank);
  });
  // TFLOP/s per rank of star's own (approximate) problem, its exact visible pairs; ring's as the
  // prefill workload reports it, the causal attention model over all S tokens.
  const double total = star ? sum : attention_flops(shape_.batch, seq_, seq_, spec_);
  Row row =
      timed_row(rt, 1, star ? "star" : "ring", Layout::kind_name(l.kind()), t.mean_ms, total, 0, t);
  row.extra.update({{"model_gflop_max", max / 1e9}, {"imbalance", imbalance}});
  row.cells = {
      row.result.strategy,  star ? cat("blocks(b=", block_, ",a=", anchor_, ")") : "zigzag",
      fixed(t.mean_ms, 2),  fixed(t.sent_mb, 3),
      fixed(t.model_mb, 3), fixed(max / 1e9, 1),
      fixed(imbalance, 2),  wrong_cell(row)};
  return row;
}

// For each sink setting (--sink, then 0) the exact result (ring over the blocks layout), then
// star's phase 1 with the anchor and without.
std::vector<Row> StarWorkload::run_accuracy(Bench& b) {
  Runtime& rt = b.rt();
  const int r = rt.cp_rank();
  const Layout l = Layout::blocks(acc_seq_, rt.cp_size(), acc_block_);
  const int64_t block0 =  // how many of this rank's rows are block 0's
      l.local_len(r) > 0 && l.global_position(r, 0) == 0 ? std::min(acc_block_, l.local_len(r)) : 0;
  b.note(cat("accuracy of phase 1 at seq ", acc_seq_, ", block ", acc_block_, ", anchor ",
             acc_anchor_, scaled() ? cat(" (scaled from seq ", seq_, " block ", block_, ")") : "",
             ": star vs exact (ring over ", l.str(), ") ..."));
  std::vector<Row> rows;
  for (double sink : sink_ != 0 ? std::vector<double>{sink_, 0.0} : std::vector<double>{0.0}) {
    const HashedRows in(shape_.dtype, float(sink));
    const Tensor q = make(in, kQ, rt, &l), k = make(in, kK, rt, &l), v = make(in, kV, rt, &l);
    const Partial exact = attention(rt, q, k, v, spec_, l, Strategy::ring);
    for (int64_t a :
         acc_anchor_ != 0 ? std::vector<int64_t>{acc_anchor_, 0} : std::vector<int64_t>{0}) {
      rt.reset_counters();
      const Partial star = star_prefill(rt, q, k, v, spec_, l, a);
      const bool off = rt.counters().data_bytes() !=
                       star_prefill_send_bytes(l, spec_, shape_.batch, shape_.dtype, a, r);
      rows.push_back(accuracy_row(star, exact, block0, sink, a, allreduce_sum(uint64_t(off))));
    }
  }
  return rows;
}

// A cache (last_rank placement) per strategy, prefilled with the blocks shards; each step appends
// S_q tokens' K/V to one and decodes their queries: every star_decode step, then every tree step;
// with the check, each step of both against float64 and star against tree, on the query rank.
std::vector<Row> StarWorkload::run_phase2(Bench& b) {
  Runtime& rt = b.rt();
  const int P = rt.cp_size(), r = rt.cp_rank();
  const Layout l = Layout::blocks(seq_, P, block_);
  const HashedRows in(shape_.dtype, float(sink_));
  const Tensor k = make(in, kK, rt, &l), v = make(in, kV, rt, &l);
  std::vector<Partial> res[2];
  Timing t[2];
  for (int i = 0; i < 2; ++i) {
    KvCache cache(P, r, spec_, shape_.batch, shape_.dtype, l.max_local_len() + steps_ * new_tokens_,
                  Placement::last_rank);
    cache.prefill(k, v, l);
    Tensor q;
    TimedCall call;
    call.warmup = 0, call.iters = steps_, call.unit = "steps";
    call.prepare = [&](int) {
      const int64_t pos0 = cache.length();
      cache.append(make(in, kK, rt, nullptr, pos0), make(in, kV, rt, nullptr, pos0));
      q = make(in, kQ, rt, nullptr, pos0);
    };
    call.call = [&] {
      res[i].push_back(i == 0 ? star_decode(rt, q, cache)
                              : decode(rt, q, cache, DecodeStrategy::tree));
    };
    const int nodes = rt.spans_nodes() ? rt.node().size() : 0;  // tree decode's model
    call.model_bytes = [&] {
      return i == 0 ? star_decode_send_bytes(cache, new_tokens_, r)
                    : decode_send_bytes(DecodeStrategy::tree, cache, new_tokens_, nodes, r);
    };
    t[i] = b.time(i == 0 ? "star phase 2 star_decode" : "star phase 2 tree decode", call);
  }
  for (int s = 0; b.check() && s < steps_; ++s) {
    const DecodeReference ref =
        decode_reference(shape_, new_tokens_, seq_ + (s + 1) * new_tokens_, in);
    if (r != P - 1) continue;  // the query rank holds the results
    const Partial& tree = res[1][size_t(s)];
    vs_tree_.compare(res[0][size_t(s)], tree.out.ptr<float>(), tree.lse.ptr<float>(), spec_.heads_q,
                     0, kSameTol, kSameTol);
    for (int i = 0; i < 2; ++i)
      vs_ref_[i].compare(res[i][size_t(s)], ref.out.data(), ref.lse.data(), shape_.heads,
                         rt.tp_rank() * spec_.heads_q, kDecodeTol, kDecodeTol);
  }
  for (DecodeCheck* c : {&vs_tree_, &vs_ref_[0], &vs_ref_[1]})
    *c = c->reduced();
  // A step's queries see every key of the context.
  const double flops = attention_flops(shape_.batch, new_tokens_, seq_, shape_.spec(Mask::none()));
  std::vector<Row> rows;
  for (int i = 0; i < 2; ++i) {
    const uint64_t wrong = i == 0 ? vs_tree_.wrong() + vs_ref_[0].wrong() : vs_ref_[1].wrong();
    // "star_decode": a plotted series is (workload, strategy, layout, ranks), and phase 1's star
    // row has the same layout.
    Row& row = rows.emplace_back(timed_row(rt, 2, i == 0 ? "star_decode" : "tree", "blocks",
                                           t[i].step_mean_ms, flops, wrong, t[i]));
    row.extra.update({{"p50_ms", t[i].p50_ms}, {"wrong_check", wrong}});
    row.cells = {
        i == 0 ? "star" : "tree", std::to_string(seq_),         fixed(t[i].step_mean_ms, 3),
        fixed(t[i].p50_ms, 3),    fixed(t[i].sent_mb * 1e3, 3), fixed(t[i].model_mb * 1e3, 3),
        wrong_cell(row)};
  }
  return rows;
}

void StarWorkload::finish(Bench& b, const std::vector<Row>& rows, report::Json& top) {
  const double star = rows[0].result.time_ms, ring = rows[1].result.time_ms;
  const double star2 = rows[rows.size() - 2].result.time_ms, tree = rows.back().result.time_ms;
  const double measured = ring / star, model = rows[1].extra["model_gflop_max"].get<double>() /
                                               rows[0].extra["model_gflop_max"].get<double>();
  const bool target = b.rt().cp_size() == 4 && b.rt().tp_size() == 1 && seq_ == 32768 &&
                      block_ == seq_ / 16 && anchor_ == block_;
  b.note(cat("Check: each call's bytes = its model; block 0's rows of phase 1 = exact attention ",
             "(rel_err <= ", kRank0RelTol, ", |lse diff| <= ", kRank0LseTol, ")"));
  if (b.check() && b.root()) {
    b.note(cat("Check: each decode step on the query rank: star vs tree within ", kSameTol.abs,
               " + ", kSameTol.rel, "*|tree|, both vs float64 within ", kDecodeTol.abs, " + ",
               kDecodeTol.rel, "*|ref|"));
    report::print_footer_line("star vs tree", vs_tree_.line("diff"));
    report::print_footer_line("star vs float64", vs_ref_[0].line("err"));
    report::print_footer_line("tree vs float64", vs_ref_[1].line("err"));
  }
  b.note(cat("phase 1: star ", fixed(star, 2), " ms, ring (zigzag) ", fixed(ring, 2),
             " ms, measured ", fixed(measured, 2), " faster, model ", fixed(model, 2),
             " (target >= 4x at 4 ranks, S=32768, b=S/16, a=b)",
             verdict(target, measured >= 4, " (not the target configuration)")));
  b.note(cat("phase 2: star_decode ", fixed(star2, 3), " ms/step, tree ", fixed(tree, 3),
             " ms/step: star/tree ", fixed(star2 / tree, 2)));
  top["phase1"] = {{"measured_speedup", measured}, {"model_flop_ratio", model}};
  top["accuracy"] = {
      {"seq", acc_seq_}, {"block", acc_block_}, {"anchor", acc_anchor_}, {"scaled", scaled()}};
  for (const Row& r : rows)
    if (!r.in_json) top["accuracy"]["rows"].push_back(r.extra);
  report::Json& p2 = top["phase2"] = {{"context", seq_},
                                      {"final_length", seq_ + steps_ * new_tokens_},
                                      {"star_over_tree_latency", star2 / tree}};
  if (b.check())
    p2.update({{"star_vs_tree", vs_tree_.json()},
               {"star_vs_float64", vs_ref_[0].json()},
               {"tree_vs_float64", vs_ref_[1].json()}});
  top["target"] = {
      {"ranks", 4}, {"seq", 32768}, {"phase1_speedup", 4.0}, {"this_run_is_target", target}};
  if (target) top["target"]["met"] = measured >= 4;
}

// --dry-run: every rank's block of the context, whether it holds the anchor, its heads, its
// phase-1 FLOPs and bytes and its bytes per phase-2 step (tree decode's beside star's); phase
// 2's byte models read the cache's ranks, heads, batch and dtype: an empty cache serves.
void StarWorkload::plan(Plan& p) const {
  const int W = p.opts().launch.world, P = p.opts().launch.cp, T = p.opts().launch.tp;
  const int64_t Hl = spec_.heads_q, Gl = spec_.heads_kv;
  const Layout l = Layout::blocks(seq_, P, block_);
  const KvCache cache(P, 0, spec_, shape_.batch, shape_.dtype, 0, Placement::last_rank);
  const auto flops = [&](int c) { return star_prefill_flops(l, spec_, shape_.batch, anchor_, c); };
  const auto mb = [&](int c) {
    return double(star_prefill_send_bytes(l, spec_, shape_.batch, shape_.dtype, anchor_, c)) / 1e6;
  };
  const auto [max, sum, imbalance] = spread(P, flops);
  p.grid(config_words(), cat("; phase 2's query rank: cp rank ", P - 1, " of each cp group"));
  p.line(cat("phase 1, star_prefill over ", l.str(), ": ", fixed(sum * T / 1e12, 3),
             " TFLOP in all (exact visible pairs), per rank max ", fixed(max / 1e9, 3),
             " GFLOP, imbalance ", fixed(imbalance, 3), "; the anchor's K/V sent once, max ",
             fixed(spread(P, mb).max, 3), " MB per tp slice"));
  p.line(cat("phase 2: ", steps_, " steps of ", new_tokens_,
             " token(s), both caches last_rank placement; tree bytes for one node"));
  p.line("per rank (anchor: holds = it holds the context's first tokens and sends them):");
  // clang-format off
  p.table({{"rank", "", 6}, {"cp", "", 5}, {"tp", "", 4}, {"tokens", "(local)", 9}, {"blocks", "", 7},
           {"anchor", "", 7}, {"q_heads", "", 9}, {"kv_heads", "", 9}, {"phase 1", "(GFLOP)", 11},
           {"phase 1", "(send MB)", 10}, {"star", "(KB/step)", 10}, {"tree", "(KB/step)", 10},
           {"global positions", "(runs)", 0}});
  // clang-format on
  p.for_shown(W, [&](int w) {
    const int c = w / T, t = w % T;
    const int64_t len = l.local_len(c);
    p.row(
        {std::to_string(w), std::to_string(c), std::to_string(t), std::to_string(len),
         std::to_string((len + block_ - 1) / block_),
         anchor_ > 0 && len > 0 && l.global_position(c, 0) == 0 ? "holds" : "-",
         report::index_range(t * Hl, Hl), report::index_range(t * Gl, Gl), fixed(flops(c) / 1e9, 3),
         fixed(mb(c), 3), fixed(double(star_decode_send_bytes(cache, new_tokens_, c)) / 1e3, 3),
         fixed(double(decode_send_bytes(DecodeStrategy::tree, cache, new_tokens_, 0, c)) / 1e3, 3),
         report::positions(l.runs(c))});
  });
}

}  // namespace

std::unique_ptr<Workload> make_star_workload() {
  return std::make_unique<StarWorkload>();
}

}  // namespace dattn::bench
