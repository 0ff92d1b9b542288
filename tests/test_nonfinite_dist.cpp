// Non-finite inputs across ranks (1-4): NaN and inf where the mask hides them change no bit of
// the results of the rows and keys that do not see them, forward and backward, fp32 and bf16,
// ring, Ulysses and hybrid, under every layout; decoding never reads a cache's unused capacity
// nor keys outside the window; and the optional check (RuntimeOptions.check_finite,
// DATTN_CHECK_FINITE=1) makes every rank throw, naming the tensor, the rank and the position, in
// attention, its backward, decode, star attention (both phases) and MLA decode.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "src/attention.h"
#include "src/base/error.h"
#include "src/decode.h"
#include "src/layout.h"
#include "src/mla.h"
#include "src/runtime.h"
#include "src/star.h"
#include "tests/mpi_support.h"
#include "tests/test_nonfinite.h"
#include "tests/test_reference.h"

namespace dattn {
namespace {

using test::CleanSets;
using test::ScopedEnv;
using test::world_rank;
using test::world_size;

// ---------------------------------------------------------------- cases

// S = 96 tokens, B = 2, GQA 24/12 heads (12 divides by every cp size and Ulysses degree), D_v != D.
constexpr int64_t kS = 96, kB = 2, kHq = 24, kHkv = 12, kD = 16, kDv = 8;
const std::vector<int64_t> kDocs = {0, 30, 31, 70, 96};

struct Scenario {
  const char* name;
  Mask mask;
  std::vector<std::pair<int64_t, int64_t>> bad;  // garbage position ranges [lo, hi)
};
std::vector<Scenario> scenarios() {
  return {
      // A whole document of garbage; the 1-token document beside it.
      {"doc_causal", Mask::document(kDocs, true), {{31, 70}}},
      {"doc", Mask::document(kDocs, false), {{31, 70}}},
      // Garbage outside the windows of the rows [40, 70).
      {"window", Mask::window(5), {{0, 40}, {70, kS}}},
      {"window_two_sided", Mask::window(7, 3), {{0, 40}, {70, kS}}},
      // Keys after the positions of the queries [0, 50).
      {"causal", Mask::causal(), {{50, kS}}},
  };
}

enum class LayoutKind { contiguous, zigzag, striped3, varlen };
const char* layout_name(LayoutKind k) {
  switch (k) {
    case LayoutKind::contiguous:
      return "contiguous";
    case LayoutKind::zigzag:
      return "zigzag";
    case LayoutKind::striped3:
      return "striped3";
    case LayoutKind::varlen:
      return "varlen";
  }
  return "?";
}
Layout make_layout(LayoutKind k, int P) {
  switch (k) {
    case LayoutKind::contiguous:
      return Layout::contiguous(kS, P);
    case LayoutKind::zigzag:
      return Layout::zigzag(kS, P);
    case LayoutKind::striped3:
      return Layout::striped(kS, P, 3);
    case LayoutKind::varlen:
      return Layout::varlen(kDocs, P);
  }
  return Layout();
}

// ring (U = 1), ulysses (U = P), hybrid with U = 2.
struct Case {
  Strategy strategy;
  int ulysses;  // the runtime's Ulysses degree (hybrid); 0: P
  LayoutKind layout;
  int scenario;
  DType dtype;
};
std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(strategy_name(c.strategy)) + "_" + layout_name(c.layout) + "_" +
         scenarios()[size_t(c.scenario)].name + "_" + dtype_name(c.dtype);
}
std::vector<Case> cases() {
  std::vector<Case> cs;
  for (auto [strategy, U] :
       {std::pair{Strategy::ring, 1}, {Strategy::ulysses, 0}, {Strategy::hybrid, 2}})
    for (LayoutKind l :
         {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped3, LayoutKind::varlen})
      for (int s = 0; s < int(scenarios().size()); ++s)
        for (DType t : {DType::f32, DType::bf16})
          cs.push_back({strategy, U, l, s, t});
  return cs;
}

AttnSpec make_spec(const Mask& mask) {
  AttnSpec spec;
  spec.heads_q = kHq;
  spec.heads_kv = kHkv;
  spec.head_dim = kD;
  spec.head_dim_v = kDv;
  spec.mask = mask;
  return spec;
}

// The global inputs, the same on every rank.
struct Inputs {
  Tensor q, k, v, dout;
};
// Made once per dtype; each call returns a fresh copy, which the tests may poison.
Inputs global_inputs(DType dtype) {
  static std::map<DType, Inputs> made;
  auto it = made.find(dtype);
  if (it == made.end())
    it = made.emplace(dtype, Inputs{test::random_tensor({kB, kS, kHq, kD}, dtype, 31),
                                    test::random_tensor({kB, kS, kHkv, kD}, dtype, 32),
                                    test::random_tensor({kB, kS, kHkv, kDv}, dtype, 33),
                                    test::random_tensor({kB, kS, kHq, kDv}, dtype, 34)})
             .first;
  const Inputs& in = it->second;
  return {in.q.to(dtype), in.k.to(dtype), in.v.to(dtype), in.dout.to(dtype)};
}

struct Results {
  Partial fwd;
  Gradients grad;
};
Results run(Runtime& rt, const Inputs& global, const AttnSpec& spec, const Layout& layout,
            Strategy strategy) {
  const int me = rt.cp_rank();
  const Tensor q = layout.dispatch(global.q, me), k = layout.dispatch(global.k, me);
  const Tensor v = layout.dispatch(global.v, me), dout = layout.dispatch(global.dout, me);
  Results r;
  r.fwd = attention(rt, q, k, v, spec, layout, strategy);
  r.grad = attention_backward(rt, q, k, v, r.fwd, dout, spec, layout, strategy);
  return r;
}

int64_t sum_over_ranks(int64_t x) {
  int64_t total = 0;
  MPI_Allreduce(&x, &total, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  return total;
}

// ---------------------------------------------------------------- hidden garbage

class HiddenGarbage : public testing::TestWithParam<Case> {};

TEST_P(HiddenGarbage, CleanResultsAreBitIdentical) {
  ScopedEnv env("DATTN_CHECK_FINITE", nullptr);  // garbage is the point here
  const Case& c = GetParam();
  const int P = world_size(), me = world_rank();
  const int U = c.ulysses == 0 ? P : c.ulysses;
  if (P % U != 0) GTEST_SKIP() << "Ulysses degree " << U << " does not divide " << P << " ranks";
  const Scenario sc = scenarios()[size_t(c.scenario)];
  const AttnSpec spec = make_spec(sc.mask);
  const Layout layout = make_layout(c.layout, P);
  Runtime& rt = test::world_runtime(U);

  std::vector<char> bad(size_t(kS), 0);
  for (auto [lo, hi] : sc.bad)
    for (int64_t p = lo; p < hi; ++p)
      bad[size_t(p)] = 1;
  const std::vector<int64_t> all = test::positions(0, kS);
  const CleanSets clean = test::clean_sets(sc.mask, all, all, bad);

  const Inputs ordinary = global_inputs(c.dtype);
  Inputs garbage = global_inputs(c.dtype);
  auto identity = [](int64_t row) { return row; };
  for (Tensor* t : {&garbage.q, &garbage.k, &garbage.v, &garbage.dout})
    test::poison_rows(*t, bad, identity);

  const Results want = run(rt, ordinary, spec, layout, c.strategy);
  const Results got = run(rt, garbage, spec, layout, c.strategy);
  auto pos = [&](int64_t row) { return layout.global_position(me, row); };
  int64_t rows = 0, keys = 0;
  EXPECT_TRUE(test::same_clean_rows("out", got.fwd.out, want.fwd.out, 1, clean.query, pos, &rows));
  EXPECT_TRUE(test::same_clean_rows("lse", got.fwd.lse, want.fwd.lse, 2, clean.query, pos));
  EXPECT_TRUE(test::same_clean_rows("dq", got.grad.dq, want.grad.dq, 1, clean.query, pos));
  EXPECT_TRUE(test::same_clean_rows("dk", got.grad.dk, want.grad.dk, 1, clean.key, pos, &keys));
  EXPECT_TRUE(test::same_clean_rows("dv", got.grad.dv, want.grad.dv, 1, clean.key, pos));
  rows = sum_over_ranks(rows);
  keys = sum_over_ranks(keys);
  EXPECT_GE(rows, 20) << "too few clean rows to compare";
  if (std::string(sc.name) != "causal") {
    EXPECT_GE(keys, 10) << "too few clean keys to compare";
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, HiddenGarbage, testing::ValuesIn(cases()), case_name);

// ---------------------------------------------------------------- the optional check

// A NaN in q on the last rank only (batch 1, its local row 3, head 5, dim 7): with the check on,
// every rank throws, naming q, that rank, the global position and the value; forward and
// backward (inf in dout on rank 0), ring and Ulysses.
TEST(CheckFinite, NanOnOneRankFailsEveryRank) {
  ScopedEnv env("DATTN_CHECK_FINITE", nullptr);
  const int P = world_size(), me = world_rank();
  const Layout layout = Layout::zigzag(kS, P);
  const AttnSpec spec = make_spec(Mask::causal());
  const Inputs in = global_inputs(DType::f32);
  for (Strategy strategy : {Strategy::ring, Strategy::ulysses}) {
    SCOPED_TRACE(strategy_name(strategy));
    Runtime& rt = test::world_runtime(strategy == Strategy::ulysses ? P : 1, true);
    Tensor q = layout.dispatch(in.q, me), k = layout.dispatch(in.k, me);
    Tensor v = layout.dispatch(in.v, me), dout = layout.dispatch(in.dout, me);
    const Partial fwd = attention(rt, q, k, v, spec, layout, strategy);  // all finite: passes
    const int64_t pos = layout.global_position(P - 1, 3);
    const int64_t at = ((1 * layout.local_len(me) + 3) * kHq + 5) * kD + 7;  // batch 1, row 3
    const float q_old = q.get(at);
    if (me == P - 1) q.set(at, NAN);
    EXPECT_TRUE(test::throws_naming(
        [&] { attention(rt, q, k, v, spec, layout, strategy); },
        {"rank " + std::to_string(P - 1) + " rejected the attention call", "invalid q = nan",
         "batch 1", "position " + std::to_string(pos) + " ", "local row 3", "head 5", "dim 7"}));
    EXPECT_TRUE(test::throws_naming(
        [&] { attention_backward(rt, q, k, v, fwd, dout, spec, layout, strategy); },
        {"rank " + std::to_string(P - 1) + " rejected the attention backward call",
         "invalid q = nan"}));
    if (me == P - 1) q.set(at, q_old);
    if (me == 0) dout.set(((0 * layout.local_len(0) + 0) * kHq + 2) * kDv + 1, INFINITY);
    EXPECT_TRUE(test::throws_naming(
        [&] { attention_backward(rt, q, k, v, fwd, dout, spec, layout, strategy); },
        {"rank 0 rejected the attention backward call", "invalid dout = inf", "batch 0",
         "position " + std::to_string(layout.global_position(0, 0)) + " ", "head 2", "dim 1"}));
  }
}

// Off by default: the same NaN passes (no check runs), and stays in its own row.
TEST(CheckFinite, OffByDefault) {
  ScopedEnv env("DATTN_CHECK_FINITE", nullptr);
  const int P = world_size(), me = world_rank();
  const Layout layout = Layout::contiguous(kS, P);
  const AttnSpec spec = make_spec(Mask::causal());
  Inputs in = global_inputs(DType::f32);
  in.q.set(((0 * kS + 10) * kHq + 0) * kD + 0, NAN);
  Runtime& rt = test::world_runtime(1);
  EXPECT_FALSE(rt.check_finite());
  Results r;
  ASSERT_NO_THROW(r = run(rt, in, spec, layout, Strategy::ring));
  for (int64_t row = 0; row < layout.local_len(me); ++row) {
    const float x = r.fwd.out.get((0 * layout.local_len(me) + row) * kHq * kDv);
    EXPECT_EQ(std::isnan(x), layout.global_position(me, row) == 10) << "row " << row;
  }
}

// DATTN_CHECK_FINITE=1 turns the check on for a runtime built without it; any other value than
// 0 or 1, even on one rank, is an error on every rank naming the variable.
TEST(CheckFinite, EnvironmentVariable) {
  const int P = world_size(), me = world_rank();
  const Layout layout = Layout::striped(kS, P, 3);
  const AttnSpec spec = make_spec(Mask::window(5));
  Inputs in = global_inputs(DType::bf16);
  in.k.set(((1 * kS + 40) * kHkv + 11) * kD + 15, -INFINITY);
  Runtime& rt = test::world_runtime(1);
  const int owner = int((40 / 3) % P);
  {
    ScopedEnv env("DATTN_CHECK_FINITE", "1");
    EXPECT_TRUE(rt.check_finite());
    EXPECT_TRUE(
        test::throws_naming([&] { run(rt, in, spec, layout, Strategy::ring); },
                            {"rank " + std::to_string(owner) + " rejected", "invalid k = -inf",
                             "batch 1", "position 40 ", "head 11", "dim 15"}));
  }
  {
    ScopedEnv env("DATTN_CHECK_FINITE", me == P - 1 ? "on" : "0");
    EXPECT_TRUE(test::throws_naming(
        [&] { run(rt, in, spec, layout, Strategy::ring); },
        {"rank " + std::to_string(P - 1) + " rejected", "DATTN_CHECK_FINITE = 'on'", "0 or 1"}));
  }
}

// ---------------------------------------------------------------- decoding

// A cache of the S-token context under zigzag, with `spare` unused rows of capacity, and two
// appended tokens.
struct DecodeSetup {
  AttnSpec spec;
  Layout layout;
  Tensor ctx_k, ctx_v, q;
};
DecodeSetup decode_setup(const Mask& mask, DType dtype) {
  const int P = world_size();
  DecodeSetup d{make_spec(mask), Layout::zigzag(kS, P),
                test::random_tensor({kB, kS + 2, kHkv, kD}, dtype, 41),
                test::random_tensor({kB, kS + 2, kHkv, kDv}, dtype, 42),
                test::random_tensor({kB, 2, kHq, kD}, dtype, 43)};
  return d;
}
KvCache make_cache(const DecodeSetup& d, const Tensor& ctx_k, const Tensor& ctx_v, int64_t spare) {
  const int P = world_size(), me = world_rank();
  KvCache cache(P, me, d.spec, kB, ctx_k.dtype(), d.layout.max_local_len() + 2 + spare);
  cache.prefill(d.layout.dispatch(ctx_k.seq_slice(0, kS), me),
                d.layout.dispatch(ctx_v.seq_slice(0, kS), me), d.layout);
  cache.append(ctx_k.seq_slice(kS, 2), ctx_v.seq_slice(kS, 2));
  return cache;
}

bool same_partial(const Partial& a, const Partial& b) {
  for (auto [x, y] : {std::pair{&a.out, &b.out}, {&a.lse, &b.lse}})
    for (int64_t i = 0; i < x->numel(); ++i)
      if (!std::isfinite(x->ptr<float>()[i]) ||
          !test::same_bits(x->ptr<float>()[i], y->ptr<float>()[i]))
        return false;
  return true;
}

// NaN in every unused row of the caches' capacity, and (window mask) in the keys no new query
// sees: every strategy returns the bits of a cache with ordinary values there.
TEST(DecodeGarbage, UnusedCapacityAndHiddenKeysAreNeverRead) {
  ScopedEnv env("DATTN_CHECK_FINITE", nullptr);
  for (DType dtype : {DType::f32, DType::bf16})
    for (const Mask& mask : {Mask::causal(), Mask::window(8)}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + mask.str());
      const DecodeSetup d = decode_setup(mask, dtype);
      const KvCache ordinary = make_cache(d, d.ctx_k, d.ctx_v, 16);
      Tensor k = d.ctx_k.to(dtype), v = d.ctx_v.to(dtype);
      if (!mask.is_causal()) {  // keys before position S + 2 - 2 - 8 are hidden from both queries
        std::vector<char> bad(size_t(kS + 2), 0);
        for (int64_t p = 0; p < kS - 8; ++p)
          bad[size_t(p)] = 1;
        test::poison_rows(k, bad, [](int64_t row) { return row; });
        test::poison_rows(v, bad, [](int64_t row) { return row; });
      }
      const KvCache garbage = make_cache(d, k, v, 16);
      for (const Tensor* t : {&garbage.k(), &garbage.v()}) {
        Tensor shared = *t;  // the cache's storage
        const int64_t row = shared.size(1) * shared.size(2) * shared.size(3);
        const int64_t used = garbage.local_len() * shared.size(2) * shared.size(3);
        for (int64_t b = 0; b < kB; ++b)
          for (int64_t e = used; e < row; ++e)
            shared.set(b * row + e, test::garbage_value(e));
      }
      for (DecodeStrategy s :
           {DecodeStrategy::tree, DecodeStrategy::ring, DecodeStrategy::allgather}) {
        Runtime& rt = test::world_runtime(1);
        const Partial want = decode(rt, d.q, ordinary, s);
        const Partial got = decode(rt, d.q, garbage, s);
        EXPECT_TRUE(same_partial(got, want)) << strategy_name(s);
      }
    }
}

// A NaN in one query row, with the check off: every strategy returns that row as NaN (out and
// lse; it sees keys, so it must not read as empty) and every other row as with a clean query.
TEST(DecodeNonFinite, NanQueryRowIsNanInEveryStrategy) {
  ScopedEnv env("DATTN_CHECK_FINITE", nullptr);
  const DecodeSetup d = decode_setup(Mask::causal(), DType::f32);
  const KvCache cache = make_cache(d, d.ctx_k, d.ctx_v, 0);
  Tensor q = d.q.to(DType::f32);
  const int64_t b = kB - 1, s = 1, h = kHq - 1;  // the poisoned row: its first element
  q.set(((b * 2 + s) * kHq + h) * kD, std::nanf(""));
  for (DecodeStrategy st :
       {DecodeStrategy::tree, DecodeStrategy::ring, DecodeStrategy::allgather}) {
    SCOPED_TRACE(strategy_name(st));
    Runtime& rt = test::world_runtime(1);
    const Partial clean = decode(rt, d.q, cache, st), got = decode(rt, q, cache, st);
    for (int64_t bi = 0; bi < kB; ++bi)
      for (int64_t si = 0; si < 2; ++si)
        for (int64_t hi = 0; hi < kHq; ++hi) {
          const bool poisoned = bi == b && si == s && hi == h;
          const float lse_got = got.lse.ptr<float>()[(bi * kHq + hi) * 2 + si];
          const float lse_want = clean.lse.ptr<float>()[(bi * kHq + hi) * 2 + si];
          EXPECT_TRUE(poisoned ? std::isnan(lse_got) : test::same_bits(lse_got, lse_want))
              << "lse of batch " << bi << " query " << si << " head " << hi << ": " << lse_got;
          for (int64_t e = 0; e < kDv; ++e) {
            const int64_t i = ((bi * 2 + si) * kHq + hi) * kDv + e;
            const float o = got.out.ptr<float>()[i];
            EXPECT_TRUE(poisoned ? std::isnan(o) : test::same_bits(o, clean.out.ptr<float>()[i]))
                << "out of batch " << bi << " query " << si << " head " << hi << ": " << o;
          }
        }
  }
}

// The check in decode: q, and each rank's filled cache rows (not its unused capacity).
TEST(DecodeGarbage, CheckNamesCacheAndQ) {
  ScopedEnv env("DATTN_CHECK_FINITE", nullptr);
  const int P = world_size(), me = world_rank();
  const DecodeSetup d = decode_setup(Mask::causal(), DType::f32);
  Runtime& rt = test::world_runtime(1, true);
  const KvCache cache = make_cache(d, d.ctx_k, d.ctx_v, 4);
  {  // unused capacity holds NaN: not checked, not read
    Tensor k = cache.k();
    k.set(k.numel() - 1, NAN);
    EXPECT_NO_THROW(decode(rt, d.q, cache, DecodeStrategy::tree));
  }
  {  // a NaN in the last rank's cache row 2
    Tensor v = cache.v();
    const int64_t pos = d.layout.global_position(P - 1, 2);
    if (me == P - 1) v.set(((0 * cache.capacity() + 2) * kHkv + 4) * kDv + 6, NAN);
    EXPECT_TRUE(test::throws_naming(
        [&] { decode(rt, d.q, cache, DecodeStrategy::ring); },
        {"rank " + std::to_string(P - 1) + " rejected the decode step", "invalid cache v = nan",
         "position " + std::to_string(pos) + " ", "head 4", "dim 6"}));
    if (me == P - 1) v.set(((0 * cache.capacity() + 2) * kHkv + 4) * kDv + 6, 0.f);
  }
  {  // q, the same on every rank: the lowest rank is named; q sits at positions S, S + 1
    Tensor q = d.q.to(DType::f32);
    q.set(((1 * 2 + 1) * kHq + 3) * kD + 0, INFINITY);
    EXPECT_TRUE(
        test::throws_naming([&] { decode(rt, q, cache, DecodeStrategy::allgather); },
                            {"rank 0 rejected the decode step", "invalid q = inf", "batch 1",
                             "position " + std::to_string(kS + 1) + " ", "head 3"}));
  }
}

// ---------------------------------------------------------------- star attention and MLA

// The check in star attention's two phases: phase 1's q/k/v shards at their block positions,
// phase 2's query (on the query rank) and cache rows.
TEST(CheckFinite, StarPrefillAndDecode) {
  ScopedEnv env("DATTN_CHECK_FINITE", nullptr);
  const int P = world_size(), me = world_rank(), last = P - 1;
  const AttnSpec spec = make_spec(Mask::causal());
  const Layout layout = Layout::blocks(kS, P, 8);
  const Inputs in = global_inputs(DType::f32);
  Runtime& rt = test::world_runtime(1, true);
  Tensor q = layout.dispatch(in.q, me), k = layout.dispatch(in.k, me);
  const Tensor v = layout.dispatch(in.v, me);
  EXPECT_NO_THROW(star_prefill(rt, q, k, v, spec, layout));
  // A NaN in k on the last rank that holds tokens (its local row 1, head 2, dim 3).
  int holder = P - 1;
  while (layout.local_len(holder) < 2)
    --holder;
  const int64_t at = ((0 * layout.local_len(me) + 1) * kHkv + 2) * kD + 3;
  if (me == holder) k.set(at, NAN);
  EXPECT_TRUE(test::throws_naming(
      [&] { star_prefill(rt, q, k, v, spec, layout); },
      {"rank " + std::to_string(holder) + " rejected the star prefill", "invalid k = nan",
       "position " + std::to_string(layout.global_position(holder, 1)) + " ", "head 2", "dim 3"}));
  if (me == holder) k.set(at, 0.f);

  KvCache cache(P, me, spec, kB, DType::f32, layout.max_local_len() + 1, Placement::last_rank);
  cache.prefill(layout.dispatch(in.k, me), layout.dispatch(in.v, me), layout);
  Tensor qd = test::random_tensor({kB, 1, kHq, kD}, DType::f32, 77);
  cache.append(test::random_tensor({kB, 1, kHkv, kD}, DType::f32, 78),
               test::random_tensor({kB, 1, kHkv, kDv}, DType::f32, 79));
  EXPECT_NO_THROW(star_decode(rt, qd, cache));
  // Only the query rank's q is read, and checked: inf elsewhere passes.
  if (me != last) qd.set(5, INFINITY);
  EXPECT_NO_THROW(star_decode(rt, qd, cache));
  if (me == last) qd.set(((1 * 1 + 0) * kHq + 4) * kD + 2, INFINITY);
  EXPECT_TRUE(test::throws_naming(
      [&] { star_decode(rt, qd, cache); },
      {"rank " + std::to_string(last) + " rejected the star decode", "invalid q = inf", "batch 1",
       "position " + std::to_string(kS) + " ", "head 4", "dim 2"}));
}

// The check in MLA decode: the queries and the cache shard (a [B, S, C] tensor: named by column).
TEST(CheckFinite, MlaDecode) {
  ScopedEnv env("DATTN_CHECK_FINITE", nullptr);
  const int P = world_size(), me = world_rank();
  MlaConfig cfg;
  cfg.heads = 12;
  cfg.latent = 64;
  cfg.rope = 16;
  cfg.qk_nope = 32;
  cfg.v_head = 32;
  const MlaWeights w = MlaWeights::random(cfg, 5);
  const int64_t B = 1, S = 40, Sq = 2;
  const Tensor c_kv = test::random_tensor({B, S, cfg.latent}, DType::f32, 6);
  const Tensor k_pe = test::random_tensor({B, S, cfg.rope}, DType::f32, 7);
  Tensor q_nope = test::random_tensor({B, Sq, cfg.heads, cfg.qk_nope}, DType::f32, 8);
  const Tensor q_pe = test::random_tensor({B, Sq, cfg.heads, cfg.rope}, DType::f32, 9);
  Runtime& rt = test::world_runtime(1, true);
  const MlaCacheShard shard = mla_shard_cache(cfg, MlaParallel::head_split, {}, c_kv, k_pe, me, P);
  EXPECT_NO_THROW(mla_decode(rt, MlaParallel::head_split, cfg, w, q_nope, q_pe, shard, S - Sq));
  Tensor bad_cache = shard.c_kv.to(DType::f32);
  if (me == P - 1) bad_cache.set(7 * cfg.latent + 9, NAN);  // token 7, column 9
  MlaCacheShard bad = shard;
  bad.c_kv = bad_cache;
  EXPECT_TRUE(test::throws_naming(
      [&] { mla_decode(rt, MlaParallel::head_split, cfg, w, q_nope, q_pe, bad, S - Sq); },
      {"rank " + std::to_string(P - 1) + " rejected the MLA decode step",
       "invalid cache c_kv = nan", "position 7 ", "column 9"}));
  q_nope.set(((0 * Sq + 1) * cfg.heads + 3) * cfg.qk_nope + 4, -INFINITY);
  EXPECT_TRUE(test::throws_naming(
      [&] { mla_decode(rt, MlaParallel::head_split, cfg, w, q_nope, q_pe, shard, S - Sq); },
      {"rank 0 rejected the MLA decode step", "invalid q_nope = -inf",
       "position " + std::to_string(S - 1) + " ", "head 3", "dim 4"}));
}

}  // namespace
}  // namespace dattn
