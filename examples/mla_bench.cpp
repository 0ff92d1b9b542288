// The MLA workload (src/mla.h) on the benchmark engine: one absorbed decode step over G ranks by
// head split and by TPLA (no, Hadamard or PCA transform); per method its cache and sent bytes
// against the models, the step latency and the error against exact MLA on three input kinds.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "examples/bench_device.h"
#include "examples/bench_inputs.h"
#include "examples/engine.h"
#include "examples/workloads.h"
#include "launch/program.h"
#include "src/mla.h"

namespace dattn::bench {
namespace {

using detail::cat;
using report::fixed;
using report::sci;

constexpr uint64_t kWeightSeed = 20250601;  // MlaWeights::random, the same on every rank
constexpr float kOutlierFactor = 20.f;      // an outlier channel's std, in the others' units
constexpr float kAlignFactor = 5.f;         // W_UK's outlier columns, for aligned queries
constexpr double kExactRelTol = 1e-4;       // head split (every row at G = 1) vs exact MLA
constexpr Tolerance kTol{1e-4, 1e-4};       // the check: each element vs its float64 rule
constexpr int64_t kCheckHeads = 2;          // the check's sample: a rank's first heads

// Inputs: bench_inputs.h's Gaussian tensors; a latent's outlier channels have std kOutlierFactor.
enum MlaInput : uint64_t { kQNope = 1, kQPe = 2, kCkv = 3, kKPe = 4, kCalibration = 5 };

// The input kinds: every latent channel of the same energy; a few outlier channels with
// isotropic queries (the outliers barely steer the logits); the same latents with W_UK's outlier
// columns kAlignFactor x larger, so that they dominate the logits (what the transforms are for).
struct Kind {
  const char *name, *key;  // key: the JSON row's
};
const Kind kKinds[] = {{"uniform energy", "uniform_energy"},
                       {"outlier channels", "outlier_channels"},
                       {"outlier channels, aligned queries", "outlier_channels_aligned_queries"}};
constexpr int kNumKinds = int(std::size(kKinds));

// The heads [h0, h0 + n) of [H, a, d_c] weights (views: w outlives them).
MlaWeights heads_of(const MlaWeights& w, int64_t h0, int64_t n) {
  const auto view = [&](const Tensor& t) {
    const int64_t a = t.size(1), dc = t.size(2);
    return Tensor::wrap(t.ptr<float>() + h0 * a * dc, {n, a, dc}, DType::f32);
  };
  return {view(w.w_uk), view(w.w_uv)};
}

struct Method {
  MlaParallel parallel;
  LatentTransform transform;
  TplaOptions opt;
  const char* label;
  bool tpla() const { return parallel == MlaParallel::tpla; }
  std::string rope() const {
    return !tpla() ? "whole" : opt.rope == RopePlacement::split ? "split" : "replicated";
  }
};

// The rows, in this order (the footer reads them by index).
using Lt = LatentTransform;
const Method kMethods[] = {
    {MlaParallel::head_split, Lt::none, {}, "head_split"},
    {MlaParallel::tpla, Lt::none, {}, "tpla none"},
    {MlaParallel::tpla, Lt::hadamard, {}, "tpla hadamard"},
    {MlaParallel::tpla, Lt::pca, {}, "tpla pca"},
    {MlaParallel::tpla, Lt::none, {RopePlacement::split}, "tpla none split-rope"},
    {MlaParallel::tpla, Lt::hadamard, {{}, true}, "tpla hadamard logit-scale-G"}};
enum : size_t { kHeadSplit, kNone, kHadamard, kPca, kSplitRope };

// The columns and cells a method's row shares with the plan's table.
const std::vector<report::Column> kMethodColumns = {
    {"method", "", 10}, {"transform", "", 9},        {"rope", "", 10},
    {"logits", "", 6},  {"cache", "(MiB/rank)", 10}, {"ratio", "", 6}};
std::vector<std::string> method_cells(const Method& m, uint64_t cache, double ratio) {
  return {
      mla_parallel_name(m.parallel),         latent_transform_name(m.transform),  m.rope(),
      m.opt.scale_logits_by_g ? "xG" : "x1", fixed(double(cache) / 1048576.0, 2), fixed(ratio, 3)};
}

// A method's output on one input kind: against exact MLA, and (the check) its float64 rule.
struct Accuracy {
  double rel_l2 = 0, max_abs = 0;  // ||out - exact|| / ||exact||, max |out - exact|
  CheckStats f64;
  report::Json json() const {
    report::Json j = {{"rel_l2", rel_l2}, {"max_abs", max_abs}};
    if (f64.checked > 0) j["f64_checked_elements"] = f64.checked, j["f64_wrong"] = f64.wrong;
    if (f64.checked > 0) j["f64_max_err"] = f64.max_err;
    return j;
  }
};

class Mla final : public Workload {
 public:
  Defaults defaults() const override {  // head split and TPLA run on GPU tensors too
    return {.iters_option = "steps,n",
            .iters_help = "timed decode steps per method",
            .runs_on_cuda = true};
  }

  void add_options(po::options_description& desc) override {
    const auto opt = [&](const char* name, int64_t& v, const char* help) {
      desc.add_options()(name, po::value(&v)->default_value(v), help);
    };
    opt("context,x", S_, "context length: latents in the cache");
    opt("batch,b", B_, "batch size B");
    opt("new-tokens,q", Sq_, "queries S_q per decode step (the cache's last S_q positions)");
    opt("heads", cfg_.heads, "query heads H");
    opt("latent", cfg_.latent, "latent dimension d_c (a power of two, for the Hadamard transform)");
    opt("rope", cfg_.rope, "decoupled RoPE dimension d_r");
    opt("qk-nope", cfg_.qk_nope, "per-head query/key dimension without RoPE");
    opt("v-head", cfg_.v_head, "per-head value dimension");
    opt("outliers", outliers_, "outlier latent channels (20x the std of the others)");
    opt("calibration", calibration_, "calibration tokens for the PCA transform (>= 2)");
  }

  void resolve(const po::variables_map& vm, const EngineOptions& e) override {
    e_ = e, G_ = e.launch.world;
    // The ranks split the heads (head_split) or the latent (TPLA): tp is every rank, cp 1.
    const std::string all = " (MLA decode splits heads or the latent over all ranks)";
    const int cp = vm.count("cp") ? vm["cp"].as<int>() : 0;
    const int tp = vm.count("tp") ? vm["tp"].as<int>() : 0;
    require_option(cp == 0 || cp == 1, "--cp", cp, "1" + all);
    require_option(tp == 0 || tp == G_, "--tp", tp, cat("the number of ranks, ", G_, all));
    require_option(S_ >= 1, "--context", S_, ">= 1");
    require_option(B_ >= 1, "--batch", B_, ">= 1");
    require_option(Sq_ >= 1 && Sq_ <= S_, "--new-tokens", Sq_, ">= 1 and <= --context");
    const int64_t H = cfg_.heads, dc = cfg_.latent, dr = cfg_.rope;
    const std::string by_g = cat(" divisible by the ranks (", G_, ")");
    require_option(H >= 1 && H % G_ == 0, "--heads", H, ">= 1 and" + by_g);
    require_option(dc >= 1 && (dc & (dc - 1)) == 0 && dc % G_ == 0, "--latent", dc,
                   "a power of two (Hadamard)" + by_g);
    require_option(dr >= 0 && dr % G_ == 0, "--rope", dr, ">= 0 and" + by_g);
    require_option(cfg_.qk_nope >= 1, "--qk-nope", cfg_.qk_nope, ">= 1");
    require_option(cfg_.v_head >= 1, "--v-head", cfg_.v_head, ">= 1");
    require_option(outliers_ >= 0 && outliers_ <= dc, "--outliers", outliers_, "0 .. --latent");
    require_option(calibration_ >= 2, "--calibration", calibration_, ">= 2");
    cfg_.validate();
    channels_ = hashed_channels(dc, outliers_);
  }

  // mla_decode runs over rt.cp(): the Runtime's grid is cp = every rank, tp = 1.
  RuntimeOptions runtime_options(const EngineOptions& e) const override {
    return {.device = e.launch.dev, .threads = e.threads};
  }

  std::vector<std::string> config_lines(Runtime& rt) const override {
    return {cat("ranks (G) ", G_, " (cp 1 x tp ", G_, ") threads/rank ", rt.threads(), " ",
                config_words())};
  }

  void config_json(report::Json& c) const override {
    c["context"] = S_, c["batch"] = B_, c["new_tokens"] = Sq_, c["q_pos0"] = S_ - Sq_;
    c["mask"] = "causal", c["steps"] = e_.iters, c["heads"] = cfg_.heads;
    c["latent"] = cfg_.latent, c["rope"] = cfg_.rope, c["qk_nope"] = cfg_.qk_nope;
    c["v_head"] = cfg_.v_head, c["softmax_scale"] = double(cfg_.scale());
    c["weight_seed"] = kWeightSeed, c["outliers"] = outliers_;
    c["outlier_std_factor"] = double(kOutlierFactor), c["outlier_channels"] = channels_;
    c["calibration"] = calibration_, c["check_heads_per_rank"] = kCheckHeads;
  }

  std::vector<std::vector<report::Column>> tables(const Bench&) const override {
    std::vector<report::Column> cols = kMethodColumns;
    cols.insert(cols.end(), {{"sent", "(KB/rank/step)", 14}, {"model", "(KB)", 9}});
    cols.insert(cols.end(), {{"mean", "(ms)", 9}, {"p50", "(ms)", 9}, {"kernel", "(GB/s)", 8}});
    for (const char* k : {"unif", "outl", "algn"})
      cols.insert(cols.end(), {{cat("err_", k), "(rel L2)", 9}, {cat("max_", k), "(abs)", 9}});
    cols.push_back({"#wrong", "", 6});
    return {cols};
  }

  std::vector<Case> cases(const Bench&) const override { return {{0, cat("mla context ", S_), 0}}; }
  std::vector<Row> run(Bench& b, const Case&) override;
  void finish(Bench& b, const std::vector<Row>& rows, report::Json& top) override;
  void plan(Plan& p) const override;

 private:
  uint64_t cache_bytes(const Method& m) const {  // the model's, per rank
    return mla_cache_bytes_per_token(cfg_, m.parallel, m.opt, G_) * uint64_t(S_ * B_);
  }
  double cache_ratio(const Method& m) const {
    return double(cache_bytes(m)) / double(cache_bytes(kMethods[kHeadSplit]));
  }
  uint64_t send_bytes(const Method& m) const {
    return mla_decode_send_bytes(cfg_, m.parallel, B_, Sq_, G_);
  }

  MlaConfig cfg_;
  int64_t S_ = 32768, B_ = 1, Sq_ = 1, outliers_ = 8, calibration_ = 2048;
  EngineOptions e_;
  int G_ = 1;
  std::vector<int64_t> channels_;                               // the outlier channels
  uint64_t exact_wrong_ = 0, cache_wrong_ = 0, f64_wrong_ = 0;  // totals
  double f64_max_ = 0;
};

std::vector<Row> Mla::run(Bench& b, const Case&) {
  const Device dev = b.rt().device();
  const int r = b.rt().cp_rank();
  const int64_t H = cfg_.heads, dn = cfg_.qk_nope, dc = cfg_.latent, dr = cfg_.rope;
  const int64_t dv = cfg_.v_head, pos0 = S_ - Sq_, h0 = r * H / G_, hn = (r + 1) * H / G_ - h0;
  const int64_t hs = std::min(hn, kCheckHeads);
  const auto q = [&](MlaInput id, int64_t first, int64_t n, int64_t dim) {  // heads first ..
    return gaussian_tensor({B_, Sq_, n, dim}, id, n, dim, pos0, first);
  };
  // Every head on the device (the decode), this rank's (exact MLA), their first hs (the check).
  const Tensor qn_d = on_device(q(kQNope, 0, H, dn), dev), qp_d = on_device(q(kQPe, 0, H, dr), dev);
  const Tensor qn_mine = q(kQNope, h0, hn, dn), qp_mine = q(kQPe, h0, hn, dr);
  const Tensor qn_smp = q(kQNope, h0, hs, dn), qp_smp = q(kQPe, h0, hs, dr);
  MlaConfig cfg_mine = cfg_, cfg_smp = cfg_;
  cfg_mine.heads = hn, cfg_smp.heads = hs;
  cfg_mine.softmax_scale = cfg_smp.softmax_scale = cfg_.scale();
  const MlaWeights w_random = MlaWeights::random(cfg_, kWeightSeed);
  const MlaTransform hadamard = make_latent_transform(LatentTransform::hadamard, dc);

  // A row per method, its cells and JSON keys in the order the kinds fill them: the first kind's
  // cache, bytes and timing, then each kind's accuracy; #wrong last.
  std::vector<Row> rows(std::size(kMethods));
  std::vector<uint64_t> exact_wrong(rows.size(), 0);  // kinds where a row is not exact MLA
  for (int k = 0; k < kNumKinds; ++k) {
    std::vector<float> stds(static_cast<size_t>(dc), 1.f);
    MlaWeights w = w_random;
    if (k == 2) w.w_uk = w_random.w_uk.to(DType::f32);  // a copy: its outlier columns scaled
    for (int64_t c : channels_) {
      if (k > 0) stds[size_t(c)] = kOutlierFactor;
      for (int64_t row = 0; k == 2 && row < H * dn; ++row)
        w.w_uk.ptr<float>()[row * dc + c] *= kAlignFactor;
    }
    b.note(cat(kKinds[k].name, ": the cache (", S_, " tokens, batch ", B_, "), exact MLA, the ",
               "transforms (PCA on ", calibration_, " latents), then each method ..."));
    const Tensor c_kv = gaussian_tensor({B_, S_, dc}, kCkv, 1, dc, 0, 0, &stds);
    const Tensor k_pe = gaussian_tensor({B_, S_, dr}, kKPe, 1, dr);
    const Tensor exact =
        mla_decode_local(cfg_mine, heads_of(w, h0, hn), qn_mine, qp_mine, c_kv, k_pe, pos0).out;
    const MlaTransform pca = make_latent_transform(
        LatentTransform::pca, dc,
        gaussian_tensor({calibration_, dc}, kCalibration, 1, dc, 0, 0, &stds));
    const MlaWeights w_hadamard = fold_transform(w, hadamard), w_pca = fold_transform(w, pca);
    const MlaTransform* transforms[] = {nullptr, &hadamard, &pca};
    const MlaWeights* weights[] = {&w, &w_hadamard, &w_pca};

    for (size_t i = 0; i < std::size(kMethods); ++i) {
      const Method& m = kMethods[i];
      const MlaTransform* t = transforms[int(m.transform)];  // by LatentTransform
      const MlaWeights& wm = *weights[int(m.transform)];
      MlaCacheShard shard;
      std::vector<double> f64;
      {  // the full transformed cache lives here only (a TPLA shard copies its columns)
        const Tensor c_t = t ? apply_transform(*t, c_kv) : c_kv;
        if (e_.check)  // TPLA's per-slice rule at G slices; exact MLA (one slice) for head split
          f64 = tpla_reference(cfg_smp, heads_of(wm, h0, hs), qn_smp, qp_smp, c_t, k_pe, pos0,
                               m.tpla() ? G_ : 1, m.opt);
        shard = mla_shard_cache(cfg_, m.parallel, m.opt, c_t, k_pe, r, G_);
      }
      const uint64_t held = allreduce_max(uint64_t(shard.c_kv.nbytes() + shard.k_pe.nbytes()));
      const MlaWeights wm_d{on_device(wm.w_uk, dev), on_device(wm.w_uv, dev)};
      shard.c_kv = on_device(shard.c_kv, dev), shard.k_pe = on_device(shard.k_pe, dev);
      Tensor out;
      TimedCall call;
      call.call = [&] {
        out = mla_decode(b.rt(), m.parallel, cfg_, wm_d, qn_d, qp_d, shard, pos0, m.opt);
        synchronize(dev);  // a GPU step ends when its kernels have run
      };
      call.model_bytes = [&] { return send_bytes(m); };
      call.unit = "steps";
      if (k > 0) call.warmup = 0, call.iters = 1;  // the other kinds: one step, bytes checked
      const Timing tm = b.time(cat("mla ", kKinds[k].name, ": ", m.label), call);
      if (!out.device().is_cpu()) out = out.to_device(Device::cpu());

      // This rank's heads of out against exact MLA, their first hs against the float64 rule.
      Accuracy a;
      RelL2 l2;
      for (int64_t row = 0; row < B_ * Sq_; ++row)
        for (int64_t j = 0; j < hn * dv; ++j) {
          const double got = out.ptr<float>()[(row * H + h0) * dv + j];
          const double ref = exact.ptr<float>()[row * hn * dv + j], diff = got - ref;
          l2.add(got, ref);
          a.max_abs = std::max(a.max_abs, std::isfinite(diff) ? std::abs(diff) : INFINITY);
          if (e_.check && j < hs * dv) a.f64.compare(got, f64[size_t(row * hs * dv + j)], kTol);
        }
      a.rel_l2 = l2.reduced(), a.max_abs = allreduce_max(a.max_abs), a.f64 = a.f64.reduced();
      f64_wrong_ += a.f64.wrong, f64_max_ = std::max(f64_max_, a.f64.max_err);
      if ((!m.tpla() || G_ == 1) && !(a.rel_l2 <= kExactRelTol)) exact_wrong[i] += 1;

      Row& row = rows[i];
      if (k == 0) {
        const uint64_t cache = cache_bytes(m);
        const double sent_kb = tm.sent_mb * 1e3, model_kb = tm.model_mb * 1e3;
        row.result = {"mla", m.label, "", S_, G_, tm.step_mean_ms};
        std::string& name = row.result.strategy;
        std::replace(name.begin(), name.end(), ' ', '-');  // "tpla-none-split-rope"
        row.result.wrong = held != cache, cache_wrong_ += held != cache;
        row.take_bytes(tm);
        row.cells = method_cells(m, cache, cache_ratio(m));
        row.cells.insert(row.cells.end(),
                         {fixed(sent_kb, 3), fixed(model_kb, 3), fixed(tm.step_mean_ms, 2),
                          fixed(tm.p50_ms, 2), kernel_cell(tm)});
        report::Json& x = row.extra;
        x["method"] = m.label, x["parallel"] = mla_parallel_name(m.parallel);
        x["transform"] = latent_transform_name(m.transform), x["rope"] = m.rope();
        x["scale_logits_by_g"] = m.opt.scale_logits_by_g, x["cache_bytes_per_rank_model"] = cache;
        x["cache_bytes_per_rank_held"] = held, x["cache_ratio_vs_head_split"] = cache_ratio(m);
        x["sent_kb_per_rank_per_step"] = sent_kb, x["model_kb_per_rank_per_step"] = model_kb;
        x["byte_mismatches"] = 0;  // every kind's steps: set below
        x["mean_ms"] = tm.step_mean_ms, x["p50_ms"] = tm.p50_ms, x["step_ms"] = tm.step_ms;
        if (tm.kernel_gbs >= 0) row.extra["kernel_gbs"] = tm.kernel_gbs;
      } else {
        row.byte_mismatches += tm.byte_mismatches;
      }
      row.result.wrong += int64_t(a.f64.wrong);
      row.cells.insert(row.cells.end(), {sci(a.rel_l2, 2), sci(a.max_abs, 2)});
      row.extra[kKinds[k].key] = a.json();
    }
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    Row& row = rows[i];
    row.result.wrong += int64_t(exact_wrong[i]);
    exact_wrong_ += exact_wrong[i];
    row.extra["byte_mismatches"] = row.byte_mismatches, row.extra["exact_wrong"] = exact_wrong[i];
    row.cells.push_back(wrong_cell(row));
  }
  return rows;
}

void Mla::finish(Bench& b, const std::vector<Row>& rows, report::Json& top) {
  if (b.root()) {
    report::print_footer_line("Cache model mismatches",
                              cat(cache_wrong_, " (shards that hold other than ",
                                  "mla_cache_bytes_per_token * context * batch)"));
    report::print_footer_line(
        "Not exact",
        cat(exact_wrong_, " (head_split", G_ == 1 ? " and every tpla row" : "",
            ", per input kind, over ", sci(kExactRelTol, 0), " relative L2 from exact MLA)"));
    if (e_.check)
      report::print_footer_line(
          "vs float64",
          cat(f64_wrong_, " wrong (", kCheckHeads, " heads per rank, within ", kTol.abs, " + ",
              kTol.rel, "*|ref| of its rule); max |err| ", sci(f64_max_, 2)));
  }
  const auto err = [&](size_t m, int k) {
    return rows[m].extra[kKinds[k].key]["rel_l2"].get<double>();
  };
  const double dc = double(cfg_.latent), dr = double(cfg_.rope);
  const double target = (dc / 4 + dr) / (dc + dr), ratio = cache_ratio(kMethods[kNone]);
  const double split = cache_ratio(kMethods[kSplitRope]);
  const bool cache_met = ratio <= target + 1e-12;
  b.note(cat("cache bytes per rank: tpla/head_split = ", fixed(ratio, 3),
             " (target <= 0.33 at G = 4: (", dc, "/4+", dr, ")/", dc + dr, " = ", fixed(target, 3),
             ")", verdict(G_ == 4, cache_met, " (this run is not G = 4)"), "; split rope ",
             fixed(split, 3)));
  report::Json& jcache = top["cache_target"];
  jcache["tpla_over_head_split"] = ratio, jcache["split_rope_over_head_split"] = split;
  jcache["target_at_4_ranks"] = target, jcache["this_run_is_target"] = G_ == 4;
  if (G_ == 4) jcache["met"] = cache_met;
  report::Json& jout = top["outlier_target"] = report::Json::object();
  for (int k : {1, 2}) {  // the outlier kinds' target: hadamard < none
    const bool met = err(kHadamard, k) < err(kNone, k);
    b.note(cat(k == 1 ? "outlier latents" : "outlier latents, aligned queries (outliers dominate",
               k == 1 ? "" : " the logits)", ": tpla rel err none ", sci(err(kNone, k), 1),
               ", hadamard ", sci(err(kHadamard, k), 1), " (target: hadamard < none)",
               verdict(G_ > 1, met, " (G = 1: every row is exact MLA)"), "; pca ",
               sci(err(kPca, k), 1)));
    const std::string p = k == 1 ? "" : "aligned_";
    jout[p + "tpla_none_rel_err"] = err(kNone, k);
    jout[p + "tpla_hadamard_rel_err"] = err(kHadamard, k);
    jout[p + "tpla_pca_rel_err"] = err(kPca, k);
    if (k == 1) jout["target"] = "hadamard < none";
    if (G_ > 1) jout[p + "met"] = met;
  }
  const report::ResultRow &hs = rows[kHeadSplit].result, &none = rows[kNone].result;
  const double latency = none.time_ms / hs.time_ms;  // the mean steps
  b.note(cat("tpla none / head_split latency ", fixed(latency, 2), " (mean), bytes/step ",
             hs.sent_mb_per_rank > 0 ? fixed(none.sent_mb_per_rank / hs.sent_mb_per_rank, 2)
                                     : "n/a (nothing sent)"));
  top["tpla_none_over_head_split_latency"] = latency, top["cache_mismatches"] = cache_wrong_;
  top["exact_wrong"] = exact_wrong_, top["f64_wrong"] = f64_wrong_;
  std::vector<std::pair<std::string, double>> kernels;  // the latent decode of each method
  for (size_t i = 0; i < std::size(kMethods); ++i)
    kernels.push_back({kMethods[i].label, rows[i].extra.value("kernel_gbs", -1.0)});
  roofline_footer(b, kernels, top);
}

// --dry-run: what each rank would hold and send, from the models and the library's slicing
// (mla_shard_cache on a cache of no tokens gives a rank's latent and RoPE columns).
void Mla::plan(Plan& p) const {
  p.line(cat("world ", G_, " ranks = cp 1 x tp ", G_, ": head_split splits the heads (an ",
             "allgather of them per step), tpla the latent (a sum-allreduce of the output); ",
             "device ", device_plan(p.opts().launch)));
  p.line(config_words());
  std::vector<report::Column> cols = kMethodColumns;
  cols.push_back({"model", "(KB/rank/step)", 14});
  p.table(cols);
  for (const Method& m : kMethods) {
    std::vector<std::string> cells = method_cells(m, cache_bytes(m), cache_ratio(m));
    cells.push_back(fixed(double(send_bytes(m)) / 1e3, 3));
    p.row(cells);
  }
  p.line("per rank: its heads under head_split, its latent and (split) RoPE columns under tpla");
  // clang-format off
  p.table({{"rank", "", 6}, {"heads", "(head_split)", 12}, {"latent", "(tpla)", 11},
           {"rope", "(split)", 11}});
  // clang-format on
  const Tensor no_c_kv = Tensor::empty({1, 0, cfg_.latent}, DType::f32);
  const Tensor no_k_pe = Tensor::empty({1, 0, cfg_.rope}, DType::f32);
  p.for_shown(G_, [&](int g) {
    const MlaCacheShard t =
        mla_shard_cache(cfg_, MlaParallel::tpla, kMethods[kSplitRope].opt, no_c_kv, no_k_pe, g, G_);
    p.row({std::to_string(g), report::index_range(g * cfg_.heads / G_, cfg_.heads / G_),
           report::index_range(t.latent_begin, t.latent_len),
           report::index_range(t.rope_begin, t.rope_len)});
  });
}

}  // namespace

std::unique_ptr<Workload> make_mla_workload() {
  return std::make_unique<Mla>();
}

}  // namespace dattn::bench
