// Multi-rank tests (1-4 ranks) of star attention (src/star.h): phase 1 against a float64
// reference of blockwise attention with the anchor prefix (exact causal attention on one rank),
// phase 2 decode steps against the float64 reference and against the tree decode, causality
// inside multi-token queries, the bytes sent against the byte models, the FLOP model against the
// exact count of visible pairs, and bad input.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/reference.h"
#include "src/attention.h"
#include "src/base/error.h"
#include "src/decode.h"
#include "src/layout.h"
#include "src/models.h"
#include "src/runtime.h"
#include "src/star.h"
#include "tests/test_reference.h"

namespace dattn {
namespace {

using test::throws_naming;

using test::world_rank;
using test::world_size;

// ---------------------------------------------------------------- problems

// The spec (causal, GQA with H_q = 2 H_kv), batch and storage dtype.
struct Problem {
  int64_t B, Hq, Hkv, D, Dv;
  DType dtype;
  bool sinks = false;   // test::sinks_for(Hq), joined once to the merged result
  float softcap = 0.f;  // logit softcap
};
// fp32 with D_v = D and a logit softcap; bf16 with B = 2, D_v != D, attention sinks and a softcap.
const Problem kF32{1, 4, 2, 32, 32, DType::f32, false, 2.f};
const Problem kBF16{2, 4, 2, 32, 48, DType::bf16, true, 4.f};

AttnSpec make_spec(const Problem& pb) {
  AttnSpec spec;
  spec.heads_q = pb.Hq;
  spec.heads_kv = pb.Hkv;
  spec.head_dim = pb.D;
  spec.head_dim_v = pb.Dv;
  spec.mask = Mask::causal();
  if (pb.sinks) spec.sinks = test::sinks_for(pb.Hq);
  spec.softcap = pb.softcap;
  return spec;
}

// Global Q, K, V of `len` tokens, the same on every rank.
struct Context {
  Tensor q, k, v;
  Context(const Problem& pb, int64_t len, uint64_t seed) {
    q = test::random_tensor({pb.B, len, pb.Hq, pb.D}, pb.dtype, seed);
    k = test::random_tensor({pb.B, len, pb.Hkv, pb.D}, pb.dtype, seed + 1);
    v = test::random_tensor({pb.B, len, pb.Hkv, pb.Dv}, pb.dtype, seed + 2);
  }
};

// The rows `pos` (dimension 1) of a bshd tensor, in that order, as a new tensor.
Tensor take_rows(const Tensor& t, const std::vector<int64_t>& pos) {
  const int64_t B = t.size(0), S = t.size(1), n = int64_t(pos.size());
  Tensor out = Tensor::empty({B, n, t.size(2), t.size(3)}, t.dtype());
  const size_t row = size_t(t.size(2) * t.size(3)) * dtype_size(t.dtype());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(static_cast<char*>(out.data()) + size_t(b * n + i) * row,
                  static_cast<const char*>(t.data()) + size_t(b * S + pos[size_t(i)]) * row, row);
  return out;
}

// The global positions of `rank`'s tokens under `layout`, in local order.
std::vector<int64_t> rank_positions(const Layout& layout, int rank) {
  std::vector<int64_t> p;
  for (int64_t i = 0; i < layout.local_len(rank); ++i)
    p.push_back(layout.global_position(rank, i));
  return p;
}

// The anchor's length: the context's first a tokens (a = b for -1), never more than the context.
int64_t anchor_len(const Layout& layout, int64_t anchor) {
  const int64_t a = anchor < 0 ? layout.block() : anchor;
  return std::min(a, layout.global_seq());
}

// Phase 1's float64 reference for one rank: every block of b tokens on its own, its queries
// against [anchor | the block] on global positions (block 0: against itself only), assembled
// into the rank's out [B, n, H_q, D_v] and lse [B, H_q, n].
cpu::ReferenceResult phase1_reference(const Layout& layout, int rank, int64_t anchor,
                                      const Tensor& q, const Tensor& k_global,
                                      const Tensor& v_global, const AttnSpec& spec) {
  const std::vector<int64_t> own = rank_positions(layout, rank);
  const int64_t n = int64_t(own.size()), B = q.size(0), H = spec.heads_q, Dv = spec.dim_v();
  const int64_t a = anchor_len(layout, anchor), b = layout.block();
  cpu::ReferenceResult all;
  all.out.assign(size_t(B * n * H * Dv), 0.0);
  all.lse.assign(size_t(B * H * n), -INFINITY);
  for (int64_t off = 0; off < n; off += b) {
    const int64_t len = std::min(b, n - off);
    const std::vector<int64_t> qpos(own.begin() + off, own.begin() + off + len);
    std::vector<int64_t> keys;
    if (qpos.front() > 0) keys = test::positions(0, a);
    keys.insert(keys.end(), qpos.begin(), qpos.end());
    const auto r = test::naive_reference(q.seq_slice(off, len), take_rows(k_global, keys),
                                         take_rows(v_global, keys), spec, qpos, keys);
    for (int64_t bb = 0; bb < B; ++bb)
      for (int64_t i = 0; i < len; ++i)
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t d = 0; d < Dv; ++d)
            all.out[size_t(((bb * n + off + i) * H + h) * Dv + d)] =
                r.out[size_t(((bb * len + i) * H + h) * Dv + d)];
          all.lse[size_t((bb * H + h) * n + off + i)] = r.lse[size_t((bb * H + h) * len + i)];
        }
  }
  return all;
}

std::string counters_str(const ByteCounters& c) {
  std::string s;
  for (const auto& [name, e] : c.ops)
    s += name + "=" + std::to_string(e.bytes) + " (" + std::to_string(e.calls) + " calls) ";
  return s;
}

// Checks a result's shapes: out [B, n, H_q, D_v] and lse [B, H_q, n], fp32.
testing::AssertionResult has_shape(const Partial& res, const Problem& pb, int64_t n) {
  const Tensor &o = res.out, &l = res.lse;
  if (o.dtype() != DType::f32 || l.dtype() != DType::f32)
    return testing::AssertionFailure() << "out " << o.shape_str() << ", lse " << l.shape_str();
  if (o.dim() != 4 || o.size(0) != pb.B || o.size(1) != n || o.size(2) != pb.Hq ||
      o.size(3) != pb.Dv)
    return testing::AssertionFailure() << "out " << o.shape_str() << ", expected [" << pb.B << ", "
                                       << n << ", " << pb.Hq << ", " << pb.Dv << "]";
  if (l.dim() != 3 || l.size(0) != pb.B || l.size(1) != pb.Hq || l.size(2) != n)
    return testing::AssertionFailure() << "lse " << l.shape_str() << ", expected [" << pb.B << ", "
                                       << pb.Hq << ", " << n << "]";
  return testing::AssertionSuccess();
}

// An empty Partial (default-constructed tensors, not defined): what star_decode returns on every
// rank but the query rank.
testing::AssertionResult is_empty(const Partial& res) {
  if (res.out.defined() || res.lse.defined() || res.out.numel() != 0 || res.lse.numel() != 0)
    return testing::AssertionFailure()
           << "out " << res.out.shape_str() << ", lse " << res.lse.shape_str();
  return testing::AssertionSuccess();
}

// Largest |a - b| / (1 + |b|) over two fp32 tensors of the same size.
double max_rel_diff(const Tensor& a, const Tensor& b) {
  double worst = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.ptr<float>()[i], y = b.ptr<float>()[i];
    if (std::isinf(x) && std::isinf(y) && (x > 0) == (y > 0)) continue;
    if (std::isnan(x) || std::isnan(y)) return INFINITY;
    worst = std::max(worst, std::fabs(x - y) / (1 + std::fabs(y)));
  }
  return worst;
}

// ---------------------------------------------------------------- 1. phase 1

struct PrefillCase {
  int64_t S, block;
};
// S not a multiple of b; ranks with one block (50/16 at P = 4) or several (301/32); more ranks
// than blocks (20/16 at P >= 3: rank 0 holds nothing, rank 1 the anchor); one partial block
// shorter than the anchor (7/16); blocks of one token (13/1).
const PrefillCase kPrefillCases[] = {{301, 32}, {50, 16}, {100, 24}, {20, 16}, {7, 16}, {13, 1}};

std::vector<int64_t> anchors_for(int64_t block) {
  std::vector<int64_t> a = {0, -1};
  if (block / 2 > 0) a.push_back(block / 2);
  return a;
}

TEST(StarPrefill, MatchesBlockwiseReference) {
  const int P = world_size(), me = world_rank();
  Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, {});
  for (const Problem& pb : {kF32, kBF16}) {
    const AttnSpec spec = make_spec(pb);
    const test::Tolerance tol = test::tolerance_for(pb.dtype);
    for (const PrefillCase& c : kPrefillCases) {
      const Context ctx(pb, c.S, 11 + uint64_t(c.S));
      const Layout layout = Layout::blocks(c.S, P, c.block);
      const std::vector<int64_t> own = rank_positions(layout, me);
      const int64_t n = int64_t(own.size());
      const Tensor q = layout.dispatch(ctx.q, me), k = layout.dispatch(ctx.k, me),
                   v = layout.dispatch(ctx.v, me);
      for (int64_t anchor : anchors_for(c.block)) {
        SCOPED_TRACE(testing::Message()
                     << dtype_name(pb.dtype) << " S " << c.S << " block " << c.block << " anchor "
                     << anchor << " rank " << me << " of " << P << " (" << n << " tokens)");
        const Partial res = star_prefill(rt, q, k, v, spec, layout, anchor);
        ASSERT_TRUE(has_shape(res, pb, n));
        if (n == 0) continue;  // nothing to compare; the call must only not break
        const int64_t first = own.front();
        // Own tokens are contiguous: the reference over them takes one start position.
        ASSERT_EQ(own.back(), first + n - 1);

        // The rule: every block against [anchor | the block] on global positions.
        const auto ref = phase1_reference(layout, me, anchor, q, ctx.k, ctx.v, spec);
        EXPECT_TRUE(test::matches_reference(res.out.ptr<float>(), res.lse.ptr<float>(), pb.B, n,
                                            pb.Hq, pb.Dv, ref, tol));

        // One block holding everything: exact causal attention of the whole context.
        if (P == 1 && c.block >= c.S) {
          const auto exact = cpu::attention_reference(ctx.q, ctx.k, ctx.v, spec, 0, 0);
          EXPECT_TRUE(test::matches_reference(res.out.ptr<float>(), res.lse.ptr<float>(), pb.B, n,
                                              pb.Hq, pb.Dv, exact, tol))
              << "against exact causal attention";
        }
      }
      // anchor = -1 means anchor = b: the same result, bit for bit.
      {
        const Partial dflt = star_prefill(rt, q, k, v, spec, layout, -1);
        const Partial explicit_b = star_prefill(rt, q, k, v, spec, layout, c.block);
        ASSERT_EQ(dflt.out.nbytes(), explicit_b.out.nbytes());
        ASSERT_EQ(dflt.lse.nbytes(), explicit_b.lse.nbytes());
        EXPECT_EQ(std::memcmp(dflt.out.data(), explicit_b.out.data(), dflt.out.nbytes()), 0)
            << "anchor -1 and anchor " << c.block << " differ (S " << c.S << ")";
        EXPECT_EQ(std::memcmp(dflt.lse.data(), explicit_b.lse.data(), dflt.lse.nbytes()), 0);
      }
    }
  }
}

// With several ranks, phase 1 is an approximation: a rank past the anchor's block misses the
// middle of the context. The test above would pass for exact attention too if the reference were
// wrong the same way; this checks that the last rank's result really differs from exact causal
// attention when it does not hold everything.
TEST(StarPrefill, DiffersFromExactAttentionWithSeveralRanks) {
  const int P = world_size(), me = world_rank();
  Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, {});
  const Problem pb = kF32;
  const AttnSpec spec = make_spec(pb);
  const int64_t S = 200, block = 16;
  const Context ctx(pb, S, 21);
  const Layout layout = Layout::blocks(S, P, block);
  const Partial res = star_prefill(rt, layout.dispatch(ctx.q, me), layout.dispatch(ctx.k, me),
                                   layout.dispatch(ctx.v, me), spec, layout);
  const int64_t n = layout.local_len(me);
  ASSERT_TRUE(has_shape(res, pb, n));
  if (P == 1 || me == 0) return;
  const int64_t first = layout.global_position(me, 0);
  const auto exact =
      cpu::attention_reference(layout.dispatch(ctx.q, me), ctx.k, ctx.v, spec, first, 0);
  EXPECT_FALSE(test::matches_reference(res.out.ptr<float>(), res.lse.ptr<float>(), pb.B, n, pb.Hq,
                                       pb.Dv, exact, test::tolerance_for(pb.dtype)))
      << "rank " << me << " sees the whole context before it";
}

// ---------------------------------------------------------------- 2. phase 2

struct DecodeCase {
  int64_t S0, block, s_q, steps;
};
// Several blocks per rank; more ranks than blocks (rank 0 and others empty at P >= 3).
const DecodeCase kDecodeCases[] = {
    {157, 32, 1, 3}, {157, 32, 4, 2}, {20, 16, 1, 2}, {20, 16, 4, 2}};

TEST(StarDecode, StepsMatchReferenceAndTree) {
  const int P = world_size(), me = world_rank();
  const int last = P - 1;
  Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, {});
  for (const Problem& pb : {kF32, kBF16}) {
    const AttnSpec spec = make_spec(pb);
    for (const DecodeCase& c : kDecodeCases) {
      const int64_t total = c.S0 + c.steps * c.s_q;
      const Context ctx(pb, total, 31 + uint64_t(c.S0));
      const Layout layout = Layout::blocks(c.S0, P, c.block);
      const Tensor k_shard = layout.dispatch(ctx.k.seq_slice(0, c.S0), me);
      const Tensor v_shard = layout.dispatch(ctx.v.seq_slice(0, c.S0), me);
      // Phase 1 on the context; its K/V shards become the cache.
      const Partial p1 = star_prefill(rt, layout.dispatch(ctx.q.seq_slice(0, c.S0), me), k_shard,
                                      v_shard, spec, layout);
      ASSERT_TRUE(has_shape(p1, pb, layout.local_len(me)));
      KvCache cache(P, me, spec, pb.B, pb.dtype, total, Placement::last_rank);
      cache.prefill(k_shard, v_shard, layout);
      KvCache tree_cache(P, me, spec, pb.B, pb.dtype, total, Placement::last_rank);
      tree_cache.prefill(k_shard, v_shard, layout);

      for (int64_t step = 0; step < c.steps; ++step) {
        const int64_t at = cache.length();
        cache.append(ctx.k.seq_slice(at, c.s_q), ctx.v.seq_slice(at, c.s_q));
        tree_cache.append(ctx.k.seq_slice(at, c.s_q), ctx.v.seq_slice(at, c.s_q));
        const int64_t len = cache.length();
        SCOPED_TRACE(testing::Message()
                     << dtype_name(pb.dtype) << " S0 " << c.S0 << " block " << c.block << " S_q "
                     << c.s_q << " length " << len << " rank " << me << " of " << P);
        const Tensor q = test::random_tensor({pb.B, c.s_q, pb.Hq, pb.D}, pb.dtype, 100 + step);
        // Only the query rank's q is read: the others pass another tensor of the same shape.
        const Tensor q_arg =
            me == last ? q : test::random_tensor({pb.B, c.s_q, pb.Hq, pb.D}, pb.dtype, 999);
        const Partial res = star_decode(rt, q_arg, cache);
        const Partial tree = decode(rt, q, tree_cache, DecodeStrategy::tree);
        if (me != last) {
          EXPECT_TRUE(is_empty(res)) << "a rank other than the query rank got a result";
          continue;
        }
        ASSERT_TRUE(has_shape(res, pb, c.s_q));
        const auto ref = cpu::attention_reference(q, ctx.k.seq_slice(0, len),
                                                  ctx.v.seq_slice(0, len), spec, len - c.s_q, 0);
        EXPECT_TRUE(test::matches_reference(res.out.ptr<float>(), res.lse.ptr<float>(), pb.B, c.s_q,
                                            pb.Hq, pb.Dv, ref, test::tolerance_for(pb.dtype)));
        ASSERT_TRUE(has_shape(tree, pb, c.s_q));
        EXPECT_LE(max_rel_diff(res.out, tree.out), 1e-6) << "out vs decode(tree)";
        EXPECT_LE(max_rel_diff(res.lse, tree.lse), 1e-6) << "lse vs decode(tree)";
      }
    }
  }
}

// A multi-token query is causal within itself: query row s (position length - S_q + s) does not
// see the appended tokens after it. Changing the last appended token's K/V changes the last row
// only.
TEST(StarDecode, MultiTokenQueryIsCausal) {
  const int P = world_size(), me = world_rank();
  const int last = P - 1;
  Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, {});
  for (const Problem& pb : {kF32, kBF16}) {
    SCOPED_TRACE(testing::Message() << dtype_name(pb.dtype) << " rank " << me << " of " << P);
    const AttnSpec spec = make_spec(pb);
    const int64_t S0 = 90, block = 16, s_q = 4, total = S0 + s_q;
    const Context ctx(pb, total, 41);
    const Layout layout = Layout::blocks(S0, P, block);
    const Tensor k_shard = layout.dispatch(ctx.k.seq_slice(0, S0), me);
    const Tensor v_shard = layout.dispatch(ctx.v.seq_slice(0, S0), me);
    // The same appended tokens, but the last one's K/V replaced.
    // (take_rows copies; seq_slice may return a view of ctx when B = 1.)
    const std::vector<int64_t> appended = test::positions(S0, s_q);
    const Tensor k_new = take_rows(ctx.k, appended), v_new = take_rows(ctx.v, appended);
    Tensor k_alt = take_rows(ctx.k, appended), v_alt = take_rows(ctx.v, appended);
    {
      const Tensor k_other = test::random_tensor({pb.B, s_q, pb.Hkv, pb.D}, pb.dtype, 42, 3.f);
      const Tensor v_other = test::random_tensor({pb.B, s_q, pb.Hkv, pb.Dv}, pb.dtype, 43, 3.f);
      for (const auto& [dst, src] : {std::pair{&k_alt, &k_other}, {&v_alt, &v_other}}) {
        const int64_t row = dst->size(2) * dst->size(3);
        for (int64_t b = 0; b < pb.B; ++b)
          for (int64_t i = 0; i < row; ++i) {
            const int64_t at = (b * s_q + s_q - 1) * row + i;
            dst->set(at, src->get(at));
          }
      }
    }
    KvCache cache(P, me, spec, pb.B, pb.dtype, total, Placement::last_rank);
    cache.prefill(k_shard, v_shard, layout);
    cache.append(k_new, v_new);
    KvCache alt(P, me, spec, pb.B, pb.dtype, total, Placement::last_rank);
    alt.prefill(k_shard, v_shard, layout);
    alt.append(k_alt, v_alt);

    const Tensor q = test::random_tensor({pb.B, s_q, pb.Hq, pb.D}, pb.dtype, 44);
    const Partial a = star_decode(rt, q, cache);
    const Partial b = star_decode(rt, q, alt);
    if (me != last) {
      EXPECT_TRUE(is_empty(a));
      EXPECT_TRUE(is_empty(b));
      continue;
    }
    ASSERT_TRUE(has_shape(a, pb, s_q));
    ASSERT_TRUE(has_shape(b, pb, s_q));
    const auto ref = cpu::attention_reference(q, ctx.k, ctx.v, spec, total - s_q, 0);
    EXPECT_TRUE(test::matches_reference(a.out.ptr<float>(), a.lse.ptr<float>(), pb.B, s_q, pb.Hq,
                                        pb.Dv, ref, test::tolerance_for(pb.dtype)));
    // Per query row: the largest change of out and lse between the two caches.
    std::vector<double> change(size_t(s_q), 0);
    for (int64_t bb = 0; bb < pb.B; ++bb)
      for (int64_t s = 0; s < s_q; ++s)
        for (int64_t h = 0; h < pb.Hq; ++h) {
          const int64_t l = (bb * pb.Hq + h) * s_q + s;
          change[size_t(s)] = std::max<double>(
              change[size_t(s)], std::fabs(a.lse.ptr<float>()[l] - b.lse.ptr<float>()[l]));
          for (int64_t d = 0; d < pb.Dv; ++d) {
            const int64_t o = ((bb * s_q + s) * pb.Hq + h) * pb.Dv + d;
            change[size_t(s)] = std::max<double>(
                change[size_t(s)], std::fabs(a.out.ptr<float>()[o] - b.out.ptr<float>()[o]));
          }
        }
    for (int64_t s = 0; s + 1 < s_q; ++s)
      EXPECT_LE(change[size_t(s)], 1e-6)
          << "query row " << s << " changed with the K/V of the later token " << total - 1;
    EXPECT_GT(change[size_t(s_q - 1)], 1e-3) << "the last query row does not see its own token";
  }
}

// ---------------------------------------------------------------- 3. bytes

TEST(StarBytes, PrefillAndDecodeMatchModels) {
  const int P = world_size(), me = world_rank();
  const int last = P - 1;
  Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, {});
  for (const Problem& pb : {kF32, kBF16}) {
    const AttnSpec spec = make_spec(pb);
    const uint64_t es = dtype_size(pb.dtype);
    for (const PrefillCase& c : {PrefillCase{157, 32}, PrefillCase{50, 16}, PrefillCase{20, 16}}) {
      const int64_t s_q_max = 4, total = c.S + 1 + s_q_max;
      const Context ctx(pb, total, 51 + uint64_t(c.S));
      const Layout layout = Layout::blocks(c.S, P, c.block);
      const Tensor k_shard = layout.dispatch(ctx.k.seq_slice(0, c.S), me);
      const Tensor v_shard = layout.dispatch(ctx.v.seq_slice(0, c.S), me);
      const Tensor q_shard = layout.dispatch(ctx.q.seq_slice(0, c.S), me);
      int holders = 0;  // ranks holding tokens
      for (int r = 0; r < P; ++r)
        holders += layout.local_len(r) > 0 ? 1 : 0;
      for (int64_t anchor : anchors_for(c.block)) {
        SCOPED_TRACE(testing::Message()
                     << dtype_name(pb.dtype) << " S " << c.S << " block " << c.block << " anchor "
                     << anchor << " rank " << me << " of " << P);
        rt.reset_counters();
        star_prefill(rt, q_shard, k_shard, v_shard, spec, layout, anchor);
        const ByteCounters counters = rt.counters();
        EXPECT_EQ(counters.data_bytes(),
                  star_prefill_send_bytes(layout, spec, pb.B, pb.dtype, anchor, me))
            << counters_str(counters);
        // The model over all ranks: one broadcast of the anchor's K/V (H_kv heads), when another
        // rank holds tokens to prefix with it.
        uint64_t sum = 0;
        for (int r = 0; r < P; ++r)
          sum += star_prefill_send_bytes(layout, spec, pb.B, pb.dtype, anchor, r);
        if (holders >= 2) {
          const uint64_t a = uint64_t(anchor_len(layout, anchor));
          EXPECT_EQ(sum, uint64_t(pb.B) * a * uint64_t(pb.Hkv * (pb.D + pb.Dv)) * es);
        }
        if (P == 1) {
          EXPECT_EQ(sum, 0u);
        }
      }

      // Phase 2: every step's bytes, S_q = 1 then 4.
      KvCache cache(P, me, spec, pb.B, pb.dtype, total, Placement::last_rank);
      cache.prefill(k_shard, v_shard, layout);
      for (int64_t s_q : {int64_t(1), s_q_max}) {
        SCOPED_TRACE(testing::Message() << dtype_name(pb.dtype) << " S " << c.S << " S_q " << s_q
                                        << " rank " << me << " of " << P);
        const int64_t at = cache.length();
        cache.append(ctx.k.seq_slice(at, s_q), ctx.v.seq_slice(at, s_q));
        const Tensor q = test::random_tensor({pb.B, s_q, pb.Hq, pb.D}, pb.dtype, 52);
        rt.reset_counters();
        star_decode(rt, q, cache);
        const ByteCounters counters = rt.counters();
        const uint64_t sent = counters.data_bytes();
        EXPECT_EQ(sent, star_decode_send_bytes(cache, s_q, me)) << counters_str(counters);
        // The query broadcast from the query rank (storage dtype), then every other rank's fp32
        // partial (out and lse) gathered there.
        const uint64_t q_bytes = uint64_t(pb.B * s_q * pb.Hq * pb.D) * es;
        const uint64_t partial_bytes = uint64_t(pb.B * s_q * pb.Hq * (pb.Dv + 1)) * 4;
        const uint64_t closed = P == 1 ? 0 : me == last ? q_bytes : partial_bytes;
        EXPECT_EQ(star_decode_send_bytes(cache, s_q, me), closed);
      }
    }
  }
}

// ---------------------------------------------------------------- 4. bad input

class StarErrors : public testing::Test {
 protected:
  void SetUp() override {
    rt = std::make_unique<Runtime>(Runtime::from_mpi(MPI_COMM_WORLD, {}));
    P = rt->cp_size();
    me = rt->cp_rank();
    ctx = std::make_unique<Context>(pb, kLen + 4, 71);
    layout = Layout::blocks(kLen, P, kBlock);
    q = layout.dispatch(ctx->q.seq_slice(0, kLen), me);
    k = layout.dispatch(ctx->k.seq_slice(0, kLen), me);
    v = layout.dispatch(ctx->v.seq_slice(0, kLen), me);
  }
  void TearDown() override { rt.reset(); }
  // A cache of the context under the blocks layout, with one token appended.
  KvCache cache_of(Placement placement) const {
    KvCache c(P, me, spec, pb.B, pb.dtype, kLen + 4, placement);
    c.prefill(k, v, layout);
    c.append(ctx->k.seq_slice(kLen, 1), ctx->v.seq_slice(kLen, 1));
    return c;
  }

  static constexpr int64_t kLen = 40, kBlock = 8;
  const Problem pb = kF32;
  const AttnSpec spec = make_spec(kF32);
  std::unique_ptr<Runtime> rt;
  std::unique_ptr<Context> ctx;
  Layout layout;
  Tensor q, k, v;
  int P = 1, me = 0;
};

TEST_F(StarErrors, ValidCallsSucceed) {
  const Partial r = star_prefill(*rt, q, k, v, spec, layout, 0);
  EXPECT_TRUE(has_shape(r, pb, layout.local_len(me)));
  const Partial r2 = star_prefill(*rt, q, k, v, spec, layout, kBlock);
  EXPECT_TRUE(has_shape(r2, pb, layout.local_len(me)));
  const KvCache cache = cache_of(Placement::last_rank);
  const Partial d =
      star_decode(*rt, test::random_tensor({pb.B, 1, pb.Hq, pb.D}, pb.dtype, 1), cache);
  if (me == P - 1) {
    EXPECT_TRUE(has_shape(d, pb, 1));
  } else {
    EXPECT_TRUE(is_empty(d));
  }
}

TEST_F(StarErrors, BlockBelowOne) {
  for (int64_t block : {int64_t(0), int64_t(-3)})
    EXPECT_TRUE(
        throws_naming([&] { Layout::blocks(kLen, P, block); }, {"block", std::to_string(block)}));
}

TEST_F(StarErrors, AnchorOutOfRange) {
  for (int64_t anchor : {kBlock + 1, int64_t(-2), int64_t(1000)})
    EXPECT_TRUE(throws_naming([&] { star_prefill(*rt, q, k, v, spec, layout, anchor); },
                              {"anchor", std::to_string(anchor)}));
}

TEST_F(StarErrors, NotABlocksLayout) {
  for (const Layout& other : {Layout::contiguous(kLen, P), Layout::striped(kLen, P, kBlock)}) {
    const Tensor q2 = other.dispatch(ctx->q.seq_slice(0, kLen), me);
    const Tensor k2 = other.dispatch(ctx->k.seq_slice(0, kLen), me);
    const Tensor v2 = other.dispatch(ctx->v.seq_slice(0, kLen), me);
    EXPECT_TRUE(throws_naming([&] { star_prefill(*rt, q2, k2, v2, spec, other, -1); }, {"layout"}))
        << other.str();
  }
}

TEST_F(StarErrors, WrongQueryShape) {
  const int64_t n = layout.local_len(me);
  const Tensor bad_dim = test::random_tensor({pb.B, n, pb.Hq, pb.D / 2}, pb.dtype, 2);
  EXPECT_TRUE(throws_naming([&] { star_prefill(*rt, bad_dim, k, v, spec, layout); },
                            {"head_dim", std::to_string(pb.D / 2)}));
  const Tensor bad_heads = test::random_tensor({pb.B, n, pb.Hq / 2, pb.D}, pb.dtype, 3);
  EXPECT_TRUE(throws_naming([&] { star_prefill(*rt, bad_heads, k, v, spec, layout); },
                            {"heads", std::to_string(pb.Hq / 2)}));
  const Tensor bad_seq = test::random_tensor({pb.B, n + 1, pb.Hq, pb.D}, pb.dtype, 4);
  // Every rank is wrong with its own length; the error every rank gets names rank 0's.
  EXPECT_TRUE(throws_naming([&] { star_prefill(*rt, bad_seq, k, v, spec, layout); },
                            {"q seq", std::to_string(layout.local_len(0) + 1)}));

  const KvCache cache = cache_of(Placement::last_rank);
  const Tensor dq = test::random_tensor({pb.B, 1, pb.Hq, pb.D / 2}, pb.dtype, 5);
  // star_decode names q's whole shape: "q shape = [1, 1, 4, 16] f32".
  EXPECT_TRUE(
      throws_naming([&] { star_decode(*rt, dq, cache); }, {"q shape", std::to_string(pb.D / 2)}));
  const Tensor dq3 = test::random_tensor({pb.B, 1, pb.Hq * pb.D}, pb.dtype, 6);
  EXPECT_TRUE(throws_naming([&] { star_decode(*rt, dq3, cache); }, {"q rank", "3"}));
}

// Bad input on one rank only: every rank throws, naming that rank (no rank waits in a collective).
TEST_F(StarErrors, BadOnOneRankThrowsEverywhere) {
  const int bad = P - 1;
  const int64_t n = layout.local_len(me);
  const Tensor q1 = me == bad ? test::random_tensor({pb.B, n, pb.Hq, pb.D / 2}, pb.dtype, 6) : q;
  EXPECT_TRUE(throws_naming([&] { star_prefill(*rt, q1, k, v, spec, layout); },
                            {"rank " + std::to_string(bad), "head_dim"}));
}

TEST_F(StarErrors, DecodeNeedsLastRankPlacement) {
  const KvCache cache = cache_of(Placement::round_robin);
  const Tensor dq = test::random_tensor({pb.B, 1, pb.Hq, pb.D}, pb.dtype, 7);
  EXPECT_TRUE(throws_naming([&] { star_decode(*rt, dq, cache); }, {"placement"}));
}

// ---------------------------------------------------------------- 5. FLOP model

// Phase-1 FLOPs of a rank written out: 2 (D + D_v) B H_q per visible (query, key) pair; each of
// its blocks (m tokens) causally, m (m + 1) / 2 pairs, plus m a anchor pairs unless it is block 0.
double star_flops_closed(const Layout& layout, const AttnSpec& spec, int64_t B, int64_t anchor,
                         int r) {
  const int64_t n = layout.local_len(r), b = layout.block();
  if (n == 0) return 0;
  const int64_t first = layout.global_position(r, 0);
  double pairs = 0;
  for (int64_t off = 0; off < n; off += b) {
    const double m = double(std::min(b, n - off));
    pairs += m * (m + 1) / 2 + (first + off == 0 ? 0.0 : m * double(anchor_len(layout, anchor)));
  }
  return 2.0 * double(spec.head_dim + spec.dim_v()) * double(B * spec.heads_q) * pairs;
}

TEST(StarFlops, ExactVisiblePairs) {
  for (const Problem& pb : {kF32, kBF16}) {
    const AttnSpec spec = make_spec(pb);
    for (int64_t S : {int64_t(1), int64_t(7), int64_t(50), int64_t(301)}) {
      // One rank, one block: exact causal attention, S (S + 1) / 2 pairs. attention_flops uses
      // the halved model (S^2 / 2 pairs), which leaves out half the diagonal: S / 2 pairs.
      const Layout one = Layout::blocks(S, 1, std::max<int64_t>(S, 1));
      const double per_pair = 2.0 * double(pb.D + pb.Dv) * double(pb.B * pb.Hq);
      const double exact = per_pair * double(S) * double(S + 1) / 2;
      EXPECT_DOUBLE_EQ(star_prefill_flops(one, spec, pb.B, 0, 0), exact) << "S " << S;
      EXPECT_DOUBLE_EQ(star_prefill_flops(one, spec, pb.B, -1, 0), exact) << "S " << S;
      EXPECT_DOUBLE_EQ(exact - attention_flops(pb.B, S, S, spec), per_pair * double(S) / 2)
          << "S " << S;
      for (int P : {1, 2, 3, 4, 7}) {
        for (int64_t block : {int64_t(1), int64_t(16), int64_t(24)}) {
          const Layout l = Layout::blocks(S, P, block);
          for (int64_t anchor : anchors_for(block)) {
            double sum = 0;
            for (int r = 0; r < P; ++r) {
              const double f = star_prefill_flops(l, spec, pb.B, anchor, r);
              EXPECT_DOUBLE_EQ(f, star_flops_closed(l, spec, pb.B, anchor, r))
                  << l.str() << " anchor " << anchor << " rank " << r;
              sum += f;
            }
            if (anchor == 0) {  // blockwise-local work never exceeds exact attention's
              EXPECT_LE(sum, exact * (1 + 1e-12)) << l.str();
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace dattn
