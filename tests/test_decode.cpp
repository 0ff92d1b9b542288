// Multi-rank tests (1-4 ranks) of decoding over a sequence-sharded KV cache: the cache's
// bookkeeping (prefill under every layout, appends under both placements, capacity), every decode
// strategy against the float64 reference at every step, the bytes sent against
// decode_send_bytes, the two-level tree over fake nodes, and bad input.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cpu/reference.h"
#include "src/attention.h"
#include "src/base/error.h"
#include "src/decode.h"
#include "src/layout.h"
#include "src/runtime.h"
#include "tests/mpi_support.h"
#include "tests/test_reference.h"

namespace dattn {
namespace {

using test::throws_naming;

using test::world_rank;
using test::world_size;

// ---------------------------------------------------------------- problems

// A decode problem: the spec (causal, GQA with H_q = 4 H_kv), batch and storage dtype.
struct Problem {
  int64_t B, Hq, Hkv, D, Dv;
  DType dtype;
  bool sinks = false;   // test::sinks_for(Hq), joined once to the merged result
  float softcap = 0.f;  // logit softcap
};
// fp32 with D_v = D and a logit softcap; bf16 with B = 2, D_v != D, attention sinks and a softcap.
const Problem kF32{1, 8, 2, 64, 64, DType::f32, false, 2.f};
const Problem kBF16{2, 8, 2, 32, 48, DType::bf16, true, 4.f};

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

enum class LayoutKind { contiguous, zigzag, striped };
const char* layout_name(LayoutKind k) {
  switch (k) {
    case LayoutKind::contiguous:
      return "contiguous";
    case LayoutKind::zigzag:
      return "zigzag";
    case LayoutKind::striped:
      return "striped";
  }
  return "?";
}
Layout make_layout(LayoutKind k, int64_t S, int P) {
  switch (k) {
    case LayoutKind::contiguous:
      return Layout::contiguous(S, P);
    case LayoutKind::zigzag:
      return Layout::zigzag(S, P);
    case LayoutKind::striped:
      return Layout::striped(S, P, 1);
  }
  return Layout();
}

// The whole context's K and V (prompt and every token decoded later), the same on every rank.
struct Context {
  Tensor k, v;
  Context(const Problem& pb, int64_t total, uint64_t seed) {
    k = test::random_tensor({pb.B, total, pb.Hkv, pb.D}, pb.dtype, seed);
    v = test::random_tensor({pb.B, total, pb.Hkv, pb.Dv}, pb.dtype, seed + 1);
  }
};

// A cache on this rank prefilled with the first `prefill` tokens of ctx under `layout`.
KvCache prefilled_cache(const Problem& pb, const Context& ctx, const Layout& layout, int P, int me,
                        int64_t capacity, Placement placement) {
  KvCache cache(P, me, make_spec(pb), pb.B, pb.dtype, capacity, placement);
  const int64_t S = layout.global_seq();
  cache.prefill(layout.dispatch(ctx.k.seq_slice(0, S), me),
                layout.dispatch(ctx.v.seq_slice(0, S), me), layout);
  return cache;
}

// Appends the next n tokens of ctx (positions length() .. length() + n - 1).
void append_next(KvCache& cache, const Context& ctx, int64_t n) {
  cache.append(ctx.k.seq_slice(cache.length(), n), ctx.v.seq_slice(cache.length(), n));
}

// ---------------------------------------------------------------- cache checks

// Row `row` of a bshd tensor [B, S, H, Dh] for batch b: H * Dh contiguous elements.
const char* row_ptr(const Tensor& t, int64_t b, int64_t row) {
  const size_t row_bytes = size_t(t.size(2) * t.size(3)) * dtype_size(t.dtype());
  return static_cast<const char*>(t.data()) + size_t(b * t.size(1) + row) * row_bytes;
}

// Checks the cache after prefill (under `layout`) and appends: lengths add up, every context
// position sits on exactly one rank, on the rank the layout or the placement says, and this rank's
// K/V rows hold exactly the context's values at those positions.
testing::AssertionResult cache_consistent(const KvCache& cache, const Context& ctx,
                                          const Layout& layout) {
  const int P = cache.ranks(), me = cache.rank();
  const int64_t len = cache.length(), S0 = layout.global_seq();
  std::vector<int> owner(size_t(len), -1);
  std::vector<int64_t> row_of(size_t(len), -1);  // on this rank
  int64_t sum = 0;
  for (int r = 0; r < P; ++r) {
    const int64_t lr = cache.local_len(r);
    if (lr < 0 || lr > cache.capacity())
      return testing::AssertionFailure()
             << "local_len(" << r << ") = " << lr << ", capacity " << cache.capacity();
    sum += lr;
    std::vector<char> row_used(size_t(lr), 0);
    int64_t run_rows = 0;
    for (const Run& run : cache.runs(r)) {
      run_rows += run.length;
      for (int64_t i = 0; i < run.length; ++i) {
        const int64_t row = run.local_begin + i, pos = run.position(i);
        if (row < 0 || row >= lr)
          return testing::AssertionFailure()
                 << "rank " << r << ": run row " << row << " outside [0, " << lr << ")";
        if (row_used[size_t(row)]++)
          return testing::AssertionFailure() << "rank " << r << ": row " << row << " used twice";
        if (pos < 0 || pos >= len)
          return testing::AssertionFailure()
                 << "rank " << r << ": position " << pos << " outside [0, " << len << ")";
        if (owner[size_t(pos)] >= 0)
          return testing::AssertionFailure()
                 << "position " << pos << " on rank " << owner[size_t(pos)] << " and on rank " << r;
        owner[size_t(pos)] = r;
        if (r == me) row_of[size_t(pos)] = row;
      }
    }
    if (run_rows != lr)
      return testing::AssertionFailure()
             << "rank " << r << ": runs hold " << run_rows << " rows, local_len " << lr;
  }
  if (sum != len)
    return testing::AssertionFailure() << "sum of local_len = " << sum << ", length " << len;
  if (cache.local_len() != cache.local_len(me))
    return testing::AssertionFailure() << "local_len() != local_len(rank())";

  // Who holds what: the prompt where the layout put it, decoded token t by the placement.
  std::vector<int> layout_owner(size_t(S0), -1);
  for (int r = 0; r < P; ++r)
    for (int64_t i = 0; i < layout.local_len(r); ++i)
      layout_owner[size_t(layout.global_position(r, i))] = r;
  for (int64_t pos = 0; pos < len; ++pos) {
    const int64_t t = pos - S0;  // among the appended tokens
    const int want = pos < S0                                      ? layout_owner[size_t(pos)]
                     : cache.placement() == Placement::round_robin ? int(t % P)
                                                                   : P - 1;
    if (owner[size_t(pos)] != want)
      return testing::AssertionFailure()
             << "position " << pos << (pos < S0 ? " (prompt)" : " (appended)") << " on rank "
             << owner[size_t(pos)] << ", expected rank " << want;
  }

  // This rank's rows, byte for byte.
  const Tensor &k = cache.k(), &v = cache.v();
  if (k.dtype() != cache.dtype() || v.dtype() != cache.dtype() || k.dim() != 4 || v.dim() != 4 ||
      k.size(0) != cache.batch() || v.size(0) != cache.batch() || k.size(1) < cache.local_len() ||
      v.size(1) < cache.local_len() || k.size(2) != ctx.k.size(2) || k.size(3) != ctx.k.size(3) ||
      v.size(2) != ctx.v.size(2) || v.size(3) != ctx.v.size(3))
    return testing::AssertionFailure() << "cache k " << k.shape_str() << ", v " << v.shape_str()
                                       << ", local_len " << cache.local_len();
  const size_t krow = size_t(k.size(2) * k.size(3)) * dtype_size(k.dtype());
  const size_t vrow = size_t(v.size(2) * v.size(3)) * dtype_size(v.dtype());
  for (int64_t pos = 0; pos < len; ++pos) {
    const int64_t row = row_of[size_t(pos)];
    if (row < 0) continue;
    for (int64_t b = 0; b < cache.batch(); ++b) {
      if (std::memcmp(row_ptr(k, b, row), row_ptr(ctx.k, b, pos), krow) != 0)
        return testing::AssertionFailure() << "rank " << me << ": K row " << row << " (batch " << b
                                           << ") does not hold position " << pos;
      if (std::memcmp(row_ptr(v, b, row), row_ptr(ctx.v, b, pos), vrow) != 0)
        return testing::AssertionFailure() << "rank " << me << ": V row " << row << " (batch " << b
                                           << ") does not hold position " << pos;
    }
  }
  return testing::AssertionSuccess();
}

// ---------------------------------------------------------------- 1. the cache

TEST(KvCacheTest, PrefillAndAppendPlaceEveryToken) {
  const int P = world_size(), me = world_rank();
  const int64_t S0 = 37;
  const int64_t steps[] = {1, 4, 1, 1, 4, 1, 4};
  int64_t total = S0;
  for (int64_t n : steps)
    total += n;
  for (const Problem& pb : {kF32, kBF16}) {
    const Context ctx(pb, total, 11);
    for (LayoutKind lk : {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped}) {
      for (Placement pl : {Placement::round_robin, Placement::last_rank}) {
        SCOPED_TRACE(testing::Message() << dtype_name(pb.dtype) << " " << layout_name(lk) << " "
                                        << placement_name(pl) << " rank " << me << " of " << P);
        const Layout layout = make_layout(lk, S0, P);
        KvCache cache = prefilled_cache(pb, ctx, layout, P, me, total, pl);
        EXPECT_EQ(cache.length(), S0);
        EXPECT_EQ(cache.placement(), pl);
        EXPECT_EQ(cache.capacity(), total);
        for (int r = 0; r < P; ++r)
          EXPECT_EQ(cache.local_len(r), layout.local_len(r)) << "rank " << r;
        ASSERT_TRUE(cache_consistent(cache, ctx, layout));
        for (int64_t n : steps) {
          const int64_t before = cache.length();
          append_next(cache, ctx, n);
          EXPECT_EQ(cache.length(), before + n);
          ASSERT_TRUE(cache_consistent(cache, ctx, layout)) << "after appending " << n;
        }
        EXPECT_EQ(cache.length(), total);
      }
    }
  }
}

// Only rank P-1 receives tokens (last_rank), so only its share can overflow: it throws naming the
// capacity, and no rank stores anything (lengths and runs unchanged everywhere). An append that
// exactly fills the rank succeeds.
TEST(KvCacheTest, CapacityOverflowStoresNothing) {
  const int P = world_size(), me = world_rank();
  const Problem pb = kF32;
  const int64_t S0 = 4 * P + 1;
  const Layout layout = Layout::contiguous(S0, P);
  const int64_t capacity = layout.max_local_len() + 3;
  const int64_t room = capacity - layout.local_len(P - 1);  // rank P-1 holds the fewest
  ASSERT_GE(room, 3);
  const Context ctx(pb, S0 + room + 2, 21);

  struct Snapshot {
    int64_t length;
    std::vector<int64_t> local;
  };
  auto snapshot = [&](const KvCache& c) {
    Snapshot s{c.length(), {}};
    for (int r = 0; r < P; ++r)
      s.local.push_back(c.local_len(r));
    return s;
  };
  // Appends n tokens expecting the overflow on rank P-1; other ranks may throw too (the same
  // error) but must not store.
  auto overflow = [&](KvCache& c, int64_t n) {
    const Snapshot before = snapshot(c);
    if (me == P - 1) {
      EXPECT_TRUE(throws_naming([&] { append_next(c, ctx, n); }, {"capacity"}))
          << "rank " << me << " appending " << n;
    } else {
      try {
        append_next(c, ctx, n);
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("capacity"), std::string::npos) << e.what();
      }
    }
    const Snapshot after = snapshot(c);
    EXPECT_EQ(after.length, before.length)
        << "rank " << me << ": an overflowing append of " << n << " tokens changed the length";
    EXPECT_EQ(after.local, before.local) << "rank " << me;
    EXPECT_TRUE(cache_consistent(c, ctx, layout)) << "rank " << me;
  };

  {  // Several tokens at once, one more than fits.
    KvCache c = prefilled_cache(pb, ctx, layout, P, me, capacity, Placement::last_rank);
    overflow(c, room + 1);
  }
  {  // Fill exactly, then one token more.
    KvCache c = prefilled_cache(pb, ctx, layout, P, me, capacity, Placement::last_rank);
    EXPECT_NO_THROW(append_next(c, ctx, room - 1));
    EXPECT_NO_THROW(append_next(c, ctx, 1));
    EXPECT_EQ(c.local_len(P - 1), capacity);
    EXPECT_TRUE(cache_consistent(c, ctx, layout));
    overflow(c, 1);
  }
}

// ---------------------------------------------------------------- 2. decode vs the reference

struct DecodeCase {
  DecodeStrategy strategy;
  bool bf16;
  LayoutKind layout;
  Placement placement;
  int64_t s_q;
};
std::string case_name(const DecodeCase& c) {
  return std::string(strategy_name(c.strategy)) + "_" + (c.bf16 ? "bf16" : "f32") + "_" +
         layout_name(c.layout) + "_" + placement_name(c.placement) + "_Sq" + std::to_string(c.s_q);
}
std::ostream& operator<<(std::ostream& os, const DecodeCase& c) {
  return os << case_name(c);
}
std::vector<DecodeCase> decode_cases() {
  std::vector<DecodeCase> cs;
  for (DecodeStrategy s : {DecodeStrategy::tree, DecodeStrategy::ring, DecodeStrategy::allgather})
    for (bool bf16 : {false, true})
      for (LayoutKind l : {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped})
        for (Placement pl : {Placement::round_robin, Placement::last_rank})
          for (int64_t s_q : {1, 4})
            cs.push_back({s, bf16, l, pl, s_q});
  return cs;
}

// Every rank holds the same bytes as rank 0 (decode results must not differ between ranks: each
// rank would otherwise sample its own token).
testing::AssertionResult same_on_every_rank(const Tensor& t) {
  std::vector<char> mine(t.nbytes()), root(t.nbytes());
  std::memcpy(mine.data(), t.data(), t.nbytes());
  root = mine;
  MPI_Bcast(root.data(), int(root.size()), MPI_BYTE, 0, MPI_COMM_WORLD);
  int differs = std::memcmp(mine.data(), root.data(), mine.size()) != 0 ? 1 : 0;
  int first = -1;
  if (differs) {
    const float* a = reinterpret_cast<const float*>(mine.data());
    const float* b = reinterpret_cast<const float*>(root.data());
    double worst = 0;
    for (size_t i = 0; i < mine.size() / 4; ++i) {
      if (std::memcmp(&a[i], &b[i], 4) == 0) continue;
      if (first < 0) first = int(i);
      worst = std::max(worst, std::fabs(double(a[i]) - double(b[i])));
    }
    return testing::AssertionFailure() << "rank " << world_rank() << " differs from rank 0 at "
                                       << "element " << first << ", max |diff| " << worst;
  }
  return testing::AssertionSuccess();
}

// One decode step checked: shapes, out and lse against the float64 reference of q (the last S_q
// positions) against the first length() tokens of ctx, and the same result on every rank.
void check_step(Runtime& rt, const KvCache& cache, const Context& ctx, const Problem& pb,
                int64_t s_q, DecodeStrategy strategy, uint64_t seed) {
  const int64_t len = cache.length();
  SCOPED_TRACE(testing::Message() << "length " << len << ", S_q " << s_q << ", rank "
                                  << rt.cp_rank() << " of " << rt.cp_size());
  const Tensor q = test::random_tensor({pb.B, s_q, pb.Hq, pb.D}, pb.dtype, seed);
  Partial res = decode(rt, q, cache, strategy);
  ASSERT_EQ(res.out.dtype(), DType::f32);
  ASSERT_EQ(res.lse.dtype(), DType::f32);
  ASSERT_EQ(res.out.dim(), 4);
  ASSERT_EQ(res.lse.dim(), 3);
  ASSERT_EQ(res.out.size(0), pb.B);
  ASSERT_EQ(res.out.size(1), s_q);
  ASSERT_EQ(res.out.size(2), pb.Hq);
  ASSERT_EQ(res.out.size(3), pb.Dv);
  ASSERT_EQ(res.lse.size(0), pb.B);
  ASSERT_EQ(res.lse.size(1), pb.Hq);
  ASSERT_EQ(res.lse.size(2), s_q);
  const auto ref = cpu::attention_reference(q, ctx.k.seq_slice(0, len), ctx.v.seq_slice(0, len),
                                            make_spec(pb), len - s_q, 0);
  EXPECT_TRUE(test::matches_reference(res.out.ptr<float>(), res.lse.ptr<float>(), pb.B, s_q, pb.Hq,
                                      pb.Dv, ref, test::tolerance_for(pb.dtype)));
  EXPECT_TRUE(same_on_every_rank(res.out)) << "out";
  EXPECT_TRUE(same_on_every_rank(res.lse)) << "lse";
}

class DecodeSteps : public testing::TestWithParam<DecodeCase> {
 protected:
  static Runtime& runtime() {
    if (!rt_) rt_ = std::make_unique<Runtime>(Runtime::from_mpi(MPI_COMM_WORLD, {}));
    return *rt_;
  }
  static void TearDownTestSuite() { rt_.reset(); }

 private:
  static std::unique_ptr<Runtime> rt_;
};
std::unique_ptr<Runtime> DecodeSteps::rt_;

// A 301-token prompt (divides by no rank count), then decode steps that append S_q tokens and
// query them: 5 steps of one token, or 3 steps of four.
TEST_P(DecodeSteps, EveryStepMatchesReference) {
  const DecodeCase& c = GetParam();
  const Problem pb = c.bf16 ? kBF16 : kF32;
  Runtime& rt = runtime();
  const int P = rt.cp_size(), me = rt.cp_rank();
  const int64_t S0 = 301, steps = c.s_q == 1 ? 5 : 3, total = S0 + steps * c.s_q;
  const Context ctx(pb, total, 31);
  const Layout layout = make_layout(c.layout, S0, P);
  KvCache cache = prefilled_cache(pb, ctx, layout, P, me, total, c.placement);
  for (int64_t step = 0; step < steps; ++step) {
    append_next(cache, ctx, c.s_q);
    check_step(rt, cache, ctx, pb, c.s_q, c.strategy, 100 + uint64_t(step));
    if (HasFailure()) return;
  }
  EXPECT_TRUE(cache_consistent(cache, ctx, layout));
}

INSTANTIATE_TEST_SUITE_P(Cases, DecodeSteps, testing::ValuesIn(decode_cases()),
                         [](const testing::TestParamInfo<DecodeCase>& info) {
                           return case_name(info.param);
                         });

// Contexts shorter than the rank count: some ranks hold no token (their partial is empty: lse
// -inf, which must not turn into NaN in the combination).
TEST(DecodeEmptyShards, ShortContexts) {
  const int P = world_size(), me = world_rank();
  Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, {});
  for (const Problem& pb : {kF32, kBF16}) {
    for (DecodeStrategy s :
         {DecodeStrategy::tree, DecodeStrategy::ring, DecodeStrategy::allgather}) {
      SCOPED_TRACE(testing::Message() << strategy_name(s) << " " << dtype_name(pb.dtype));
      const Context ctx(pb, 8, 41);
      {  // One prompt token on rank 0, decoded tokens on rank P-1: ranks 1 .. P-2 stay empty.
        const Layout layout = Layout::contiguous(1, P);
        KvCache cache = prefilled_cache(pb, ctx, layout, P, me, 8, Placement::last_rank);
        for (int r = 1; r < P; ++r)
          ASSERT_EQ(cache.local_len(r), 0) << "rank " << r;
        check_step(rt, cache, ctx, pb, 1, s, 200);  // the query at the prompt's only position
        for (int64_t step = 0; step < 3; ++step) {
          append_next(cache, ctx, 1);
          check_step(rt, cache, ctx, pb, 1, s, 201 + uint64_t(step));
        }
        if (P >= 3) {
          EXPECT_EQ(cache.local_len(1), 0);
        }
        EXPECT_TRUE(cache_consistent(cache, ctx, layout));
      }
      {  // Two prompt tokens striped (ranks 2, 3 empty at P = 4), S_q = 2, then appends.
        const Layout layout = Layout::striped(2, P, 1);
        KvCache cache = prefilled_cache(pb, ctx, layout, P, me, 8, Placement::round_robin);
        check_step(rt, cache, ctx, pb, 2, s, 210);
        append_next(cache, ctx, 1);
        check_step(rt, cache, ctx, pb, 1, s, 211);
        append_next(cache, ctx, 4);
        check_step(rt, cache, ctx, pb, 4, s, 212);
        EXPECT_TRUE(cache_consistent(cache, ctx, layout));
      }
    }
  }
}

// ---------------------------------------------------------------- 3. bytes

std::string counters_str(const ByteCounters& c) {
  std::string s;
  for (const auto& [name, e] : c.ops)
    s += name + "=" + std::to_string(e.bytes) + " (" + std::to_string(e.calls) + " calls) ";
  return s;
}

TEST(DecodeBytes, MatchModel) {
  const int P = world_size(), me = world_rank();
  Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, {});
  // One machine: the flat tree. On the test cluster's hosts (tests/multinode, the same ranks on
  // every host) the two-level one over the real nodes, whose model takes their size.
  const int node_size = rt.spans_nodes() ? int(test::same_host_ranks().size()) : 0;
  for (const Problem& pb : {kF32, kBF16}) {
    const int64_t total = 260;
    const Context ctx(pb, total, 51);
    for (int64_t s_q : {1, 4}) {
      // tree bytes for the two context lengths, to compare.
      std::vector<uint64_t> tree_bytes;
      for (int64_t S0 : {101, 203}) {
        const Layout layout = Layout::zigzag(S0, P);
        KvCache cache = prefilled_cache(pb, ctx, layout, P, me, total, Placement::round_robin);
        append_next(cache, ctx, s_q);
        const Tensor q = test::random_tensor({pb.B, s_q, pb.Hq, pb.D}, pb.dtype, 52);
        for (DecodeStrategy s :
             {DecodeStrategy::tree, DecodeStrategy::ring, DecodeStrategy::allgather}) {
          SCOPED_TRACE(testing::Message()
                       << strategy_name(s) << " " << dtype_name(pb.dtype) << " context "
                       << cache.length() << " S_q " << s_q << " rank " << me << " of " << P);
          rt.reset_counters();
          Partial res = decode(rt, q, cache, s);
          const ByteCounters counters = rt.counters();
          const uint64_t sent = counters.data_bytes();
          EXPECT_EQ(sent, decode_send_bytes(s, cache, s_q, node_size, me))
              << counters_str(counters);
          if (s == DecodeStrategy::tree) {
            tree_bytes.push_back(sent);
            // Flat tree: max-allreduce of lse, then sum-allreduce of the packed [out | sum w].
            const uint64_t closed =
                uint64_t(pb.B * pb.Hq * s_q) * 4 + uint64_t(pb.B * s_q * pb.Hq * (pb.Dv + 1)) * 4;
            if (P >= 2 && node_size == 0) {
              EXPECT_EQ(sent, closed) << counters_str(counters);
            }
          }
          if (P >= 2 && s != DecodeStrategy::tree) {
            EXPECT_GT(sent, 0u) << counters_str(counters);
          }
        }
      }
      ASSERT_EQ(tree_bytes.size(), 2u);
      EXPECT_EQ(tree_bytes[0], tree_bytes[1]) << "tree bytes grow with the context";
    }
  }
}

// ---------------------------------------------------------------- 4. two-level tree

// Fake nodes of node_size consecutive ranks: where they split the ranks, the tree reduces inside
// the nodes and across the leaders; the result equals the flat tree's and the bytes the model's.
TEST(DecodeTwoLevelTree, MatchesFlatTree) {
  const int P = world_size(), me = world_rank();
  Runtime flat = Runtime::from_mpi(MPI_COMM_WORLD, {});
  for (int node_size : {2, 3}) {
    SCOPED_TRACE(testing::Message() << "node_size " << node_size << " rank " << me << " of " << P);
    RuntimeOptions o;
    o.node_size = node_size;
    Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, o);
    if (node_size >= P) {
      EXPECT_FALSE(rt.spans_nodes());
      continue;
    }
    ASSERT_TRUE(rt.spans_nodes());
    EXPECT_EQ(rt.node().size(), std::min(node_size, P - (me / node_size) * node_size));
    for (const Problem& pb : {kF32, kBF16}) {
      const int64_t S0 = 157, total = S0 + 8;
      const Context ctx(pb, total, 61);
      const Layout layout = Layout::zigzag(S0, P);
      KvCache cache = prefilled_cache(pb, ctx, layout, P, me, total, Placement::round_robin);
      for (int64_t s_q : {1, 4}) {
        append_next(cache, ctx, s_q);
        const Tensor q = test::random_tensor({pb.B, s_q, pb.Hq, pb.D}, pb.dtype, 62);
        const Partial ref = decode(flat, q, cache, DecodeStrategy::tree);
        rt.reset_counters();
        const Partial two = decode(rt, q, cache, DecodeStrategy::tree);
        const ByteCounters counters = rt.counters();
        EXPECT_EQ(counters.data_bytes(),
                  decode_send_bytes(DecodeStrategy::tree, cache, s_q, node_size, me))
            << dtype_name(pb.dtype) << " S_q " << s_q << ": " << counters_str(counters);
        ASSERT_EQ(two.out.numel(), ref.out.numel());
        ASSERT_EQ(two.lse.numel(), ref.lse.numel());
        double worst = 0;
        for (const auto& [a, b] : {std::pair{&two.out, &ref.out}, {&two.lse, &ref.lse}})
          for (int64_t i = 0; i < a->numel(); ++i) {
            const double x = a->ptr<float>()[i], y = b->ptr<float>()[i];
            ASSERT_FALSE(std::isnan(x)) << "index " << i;
            worst = std::max(worst, std::fabs(x - y) / (1 + std::fabs(y)));
          }
        EXPECT_LE(worst, 1e-6) << dtype_name(pb.dtype) << " S_q " << s_q;
        EXPECT_TRUE(same_on_every_rank(two.out));
        EXPECT_TRUE(same_on_every_rank(two.lse));
        // And both against the reference.
        const auto r64 = cpu::attention_reference(q, ctx.k.seq_slice(0, cache.length()),
                                                  ctx.v.seq_slice(0, cache.length()), make_spec(pb),
                                                  cache.length() - s_q, 0);
        EXPECT_TRUE(test::matches_reference(two.out.ptr<float>(), two.lse.ptr<float>(), pb.B, s_q,
                                            pb.Hq, pb.Dv, r64, test::tolerance_for(pb.dtype)));
      }
    }
  }
}

// On real nodes (the test cluster's hosts, tests/multinode): the tree reduces inside each host
// and only the node leaders' allreduces cross hosts, each a flat tree's payload (the max of the
// lse, then the packed [out | sum w]); the result equals the flat tree's (one declared node).
TEST(DecodeTwoLevelTree, RealNodesCrossHostsOnlyBetweenLeaders) {
  const int P = world_size(), me = world_rank();
  Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, {});
  if (!rt.spans_nodes()) GTEST_SKIP() << "every rank on one node (run on tests/multinode's hosts)";
  const std::vector<int> host = test::same_host_ranks();
  ASSERT_EQ(rt.node().size(), int(host.size()));
  const bool leader = host.front() == me;
  EXPECT_EQ(rt.node().rank() == 0, leader);
  RuntimeOptions one_node;
  one_node.node_size = P;
  Runtime flat = Runtime::from_mpi(MPI_COMM_WORLD, one_node);
  ASSERT_FALSE(flat.spans_nodes());
  for (const Problem& pb : {kF32, kBF16}) {
    const int64_t S0 = 301, total = S0 + 8;
    const Context ctx(pb, total, 71);
    KvCache cache =
        prefilled_cache(pb, ctx, Layout::zigzag(S0, P), P, me, total, Placement::round_robin);
    for (int64_t s_q : {1, 4}) {
      SCOPED_TRACE(testing::Message() << dtype_name(pb.dtype) << " S_q " << s_q << " rank " << me
                                      << " of " << P << (leader ? " (leader)" : ""));
      append_next(cache, ctx, s_q);
      const Tensor q = test::random_tensor({pb.B, s_q, pb.Hq, pb.D}, pb.dtype, 72);
      const Partial ref = decode(flat, q, cache, DecodeStrategy::tree);
      rt.reset_counters();
      const Partial two = decode(rt, q, cache, DecodeStrategy::tree);
      const uint64_t across = rt.node_leaders().counters().data_bytes();
      const uint64_t payload =
          uint64_t(pb.B * pb.Hq * s_q) * 4 + uint64_t(pb.B * s_q * pb.Hq * (pb.Dv + 1)) * 4;
      EXPECT_EQ(across, leader ? payload : 0u) << counters_str(rt.counters());
      EXPECT_EQ(rt.counters().data_bytes(),
                decode_send_bytes(DecodeStrategy::tree, cache, s_q, int(host.size()), me));
      ASSERT_EQ(two.out.numel(), ref.out.numel());
      for (const auto& [a, b] : {std::pair{&two.out, &ref.out}, {&two.lse, &ref.lse}})
        for (int64_t i = 0; i < a->numel(); ++i) {
          const double x = a->ptr<float>()[i], y = b->ptr<float>()[i];
          ASSERT_LE(std::fabs(x - y), 1e-6 * (1 + std::fabs(y))) << "index " << i;
        }
    }
  }
}

// ---------------------------------------------------------------- 5. bad input

class DecodeErrors : public testing::Test {
 protected:
  void SetUp() override {
    rt = std::make_unique<Runtime>(Runtime::from_mpi(MPI_COMM_WORLD, {}));
    P = rt->cp_size();
    me = rt->cp_rank();
    ctx = std::make_unique<Context>(pb, kLen + 4, 71);
    cache = std::make_unique<KvCache>(prefilled_cache(pb, *ctx, Layout::contiguous(kLen, P), P, me,
                                                      kLen + 4, Placement::round_robin));
  }
  void TearDown() override {
    cache.reset();
    rt.reset();
  }
  Tensor q_of(int64_t s_q, int64_t heads, int64_t dim, DType dtype = DType::f32) const {
    return test::random_tensor({pb.B, s_q, heads, dim}, dtype, 72);
  }

  static constexpr int64_t kLen = 8;
  const Problem pb = kF32;
  std::unique_ptr<Runtime> rt;
  std::unique_ptr<Context> ctx;
  std::unique_ptr<KvCache> cache;
  int P = 1, me = 0;
};

TEST_F(DecodeErrors, ValidCallSucceeds) {
  Partial r = decode(*rt, q_of(1, pb.Hq, pb.D), *cache);
  EXPECT_EQ(r.out.size(1), 1);
}

TEST_F(DecodeErrors, WrongHeadDim) {
  EXPECT_TRUE(throws_naming([&] { decode(*rt, q_of(1, pb.Hq, pb.D / 2), *cache); },
                            {"head_dim", std::to_string(pb.D / 2)}));
}

TEST_F(DecodeErrors, WrongHeads) {
  EXPECT_TRUE(throws_naming([&] { decode(*rt, q_of(1, pb.Hq / 2, pb.D), *cache); },
                            {"heads", std::to_string(pb.Hq / 2)}));
}

TEST_F(DecodeErrors, MoreQueriesThanContext) {
  const int64_t s_q = kLen + 1;
  try {
    decode(*rt, q_of(s_q, pb.Hq, pb.D), *cache);
    ADD_FAILURE() << "S_q " << s_q << " > context " << kLen << " did not throw";
  } catch (const Error& e) {
    const std::string what = e.what();
    const bool names = what.find("seq") != std::string::npos ||
                       what.find("S_q") != std::string::npos ||
                       what.find("s_q") != std::string::npos;
    EXPECT_TRUE(names) << "does not name the query length: " << what;
    EXPECT_NE(what.find(std::to_string(s_q)), std::string::npos) << what;
  }
}

// A prefill strategy passed to decode (or a decode one to attention) does not compile; a value
// outside the enum (a cast integer) throws on every rank, naming the strategy.
TEST_F(DecodeErrors, PrefillStrategiesRejected) {
  using DecodeFn = Partial (*)(Runtime&, const Tensor&, const KvCache&, DecodeStrategy);
  using AttentionFn = Partial (*)(Runtime&, const Tensor&, const Tensor&, const Tensor&,
                                  const AttnSpec&, const Layout&, Strategy);
  static_assert(!std::is_invocable_v<DecodeFn, Runtime&, const Tensor&, const KvCache&, Strategy>);
  static_assert(
      !std::is_invocable_v<AttentionFn, Runtime&, const Tensor&, const Tensor&, const Tensor&,
                           const AttnSpec&, const Layout&, DecodeStrategy>);
  EXPECT_TRUE(throws_naming(
      [&] { decode(*rt, q_of(1, pb.Hq, pb.D), *cache, static_cast<DecodeStrategy>(7)); },
      {"strategy"}));
}

TEST_F(DecodeErrors, DtypeMismatch) {
  EXPECT_TRUE(
      throws_naming([&] { decode(*rt, q_of(1, pb.Hq, pb.D, DType::bf16), *cache); }, {"dtype"}));
}

// Bad input on one rank only: every rank throws (no rank waits in a collective), naming it.
TEST_F(DecodeErrors, BadOnOneRankThrowsEverywhere) {
  const int bad = P - 1;
  const Tensor q = me == bad ? q_of(1, pb.Hq, pb.D / 2) : q_of(1, pb.Hq, pb.D);
  EXPECT_TRUE(
      throws_naming([&] { decode(*rt, q, *cache); }, {"rank " + std::to_string(bad), "head_dim"}));
}

}  // namespace
}  // namespace dattn
