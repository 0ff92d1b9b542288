// Multi-rank tests (1-4 ranks) of every strategy (ring, ulysses, hybrid with U = 1, 2, P) under
// every layout and mask: each rank's out and lse against the float64 reference on the global
// tensors, and the bytes sent (point-to-point plus all-to-all) against the byte model (slice
// masks, random and shared-prefix, and the balanced layout among them); and
// document masks with empty documents against the same calls without them.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/reference.h"
#include "src/attention.h"
#include "src/base/error.h"
#include "src/layout.h"
#include "src/models.h"
#include "src/runtime.h"
#include "tests/mpi_support.h"
#include "tests/test_reference.h"

namespace dattn {
namespace {

using test::world_size;

// ---------------------------------------------------------------- cases

// How the strategy runs: which Strategy, and the Ulysses degree of the runtime (hybrid).
enum class Schedule { ring, ulysses, hybrid_u1, hybrid_u2, hybrid_all };
const char* schedule_name(Schedule s) {
  switch (s) {
    case Schedule::ring:
      return "ring";
    case Schedule::ulysses:
      return "ulysses";
    case Schedule::hybrid_u1:
      return "hybridU1";
    case Schedule::hybrid_u2:
      return "hybridU2";
    case Schedule::hybrid_all:
      return "hybridUP";
  }
  return "?";
}
Strategy strategy_of(Schedule s) {
  return s == Schedule::ring      ? Strategy::ring
         : s == Schedule::ulysses ? Strategy::ulysses
                                  : Strategy::hybrid;
}
// The runtime's Ulysses degree (RuntimeOptions.ulysses) for a schedule on P ranks.
int runtime_ulysses(Schedule s, int P) {
  switch (s) {
    case Schedule::hybrid_u2:
      return 2;
    case Schedule::hybrid_all:
      return P;
    default:
      return 1;
  }
}

enum class LayoutKind { contiguous, zigzag, striped1, striped3, varlen, balanced };
const char* layout_name(LayoutKind k) {
  switch (k) {
    case LayoutKind::contiguous:
      return "contiguous";
    case LayoutKind::zigzag:
      return "zigzag";
    case LayoutKind::striped1:
      return "striped1";
    case LayoutKind::striped3:
      return "striped3";
    case LayoutKind::varlen:
      return "varlen";
    case LayoutKind::balanced:
      return "balanced5";
  }
  return "?";
}

enum class MaskKind {
  none,
  causal,
  window,
  window_right,
  document_causal,
  document,
  slices,
  shared_prefix
};
const char* mask_name(MaskKind m) {
  switch (m) {
    case MaskKind::none:
      return "none";
    case MaskKind::causal:
      return "causal";
    case MaskKind::window:
      return "window5";
    case MaskKind::window_right:
      return "window7r3";
    case MaskKind::document_causal:
      return "doc_causal";
    case MaskKind::document:
      return "doc";
    case MaskKind::slices:
      return "slices";
    case MaskKind::shared_prefix:
      return "shared_prefix";
  }
  return "?";
}

// Three problem sizes: S = 48 (divides by 1..4 and by the zigzag chunks 2P) in fp32, S = 61
// (divides by nothing) in bf16 with B = 2 and D_v != D, and S = 7 in fp16 (fewer tokens than the
// zigzag chunks: some runs, and under striped(3) at P = 4 a whole rank, hold no token). H_kv = 12
// divides by every cp size and Ulysses degree here; H_q = 4 H_kv (GQA). S = 29 has one kv head
// (MQA), so every Ulysses degree U > 1 is past H_kv (U = 2, 3, 4 H_kv: the members share it), and
// S = 20 two, shared by U = 4 (2 H_kv), split by U = 2, and refused by U = 3 (test_errors).
// S = 61, 29 and 20 have attention sinks (test::sinks_for: some far above the scores, so that the
// sink dominates their rows), joined once to the merged result whatever the schedule. S = 48
// has a logit softcap alone, S = 61 and 20 with the sinks (caps of about the scores' spread, where
// tanh bends them most).
struct Problem {
  int64_t S, B, Hq, Hkv, D, Dv;
  DType dtype;
  std::vector<int64_t> cu_seqlens;  // documents (1-token ones, and ones shorter than 2P)
  bool sinks = false;
  float softcap = 0.f;
};
const Problem kProblems[] = {
    {48, 1, 48, 12, 16, 16, DType::f32, {0, 1, 13, 14, 30, 48}, false, 1.5f},
    {61, 2, 48, 12, 32, 16, DType::bf16, {0, 1, 20, 21, 24, 45, 61}, true, 3.f},
    {7, 1, 48, 12, 16, 16, DType::f16, {0, 1, 2, 7}},
    {29, 1, 12, 1, 16, 16, DType::f32, {0, 1, 9, 10, 29}, true},
    {20, 2, 8, 2, 16, 8, DType::bf16, {0, 7, 8, 20}, true, 2.f},
};

// The kv heads one Ulysses member holds: H_kv / U, or the one it shares past H_kv.
int64_t member_kv_heads(const Problem& pb, int U) {
  return U > pb.Hkv ? 1 : pb.Hkv / U;
}

struct StrategyCase {
  Schedule schedule;
  LayoutKind layout;
  MaskKind mask;
  int problem;  // index into kProblems
};

std::string case_name(const StrategyCase& c) {
  return std::string(schedule_name(c.schedule)) + "_" + layout_name(c.layout) + "_" +
         mask_name(c.mask) + "_S" + std::to_string(kProblems[c.problem].S);
}
std::ostream& operator<<(std::ostream& os, const StrategyCase& c) {
  return os << case_name(c);
}

std::vector<StrategyCase> strategy_cases() {
  std::vector<StrategyCase> cs;
  for (int p = 0; p < int(std::size(kProblems)); ++p)
    for (Schedule s : {Schedule::ring, Schedule::ulysses, Schedule::hybrid_u1, Schedule::hybrid_u2,
                       Schedule::hybrid_all}) {
      for (LayoutKind l : {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped1,
                           LayoutKind::striped3, LayoutKind::varlen})
        for (MaskKind m : {MaskKind::none, MaskKind::causal, MaskKind::window,
                           MaskKind::window_right, MaskKind::document_causal, MaskKind::document,
                           MaskKind::slices, MaskKind::shared_prefix})
          cs.push_back({s, l, m, p});
      // The balanced layout under the masks whose work is uneven along the sequence.
      for (MaskKind m :
           {MaskKind::causal, MaskKind::document_causal, MaskKind::slices, MaskKind::shared_prefix})
        cs.push_back({s, LayoutKind::balanced, m, p});
    }
  return cs;
}

Mask make_mask(MaskKind m, const Problem& pb) {
  switch (m) {
    case MaskKind::none:
      return Mask::none();
    case MaskKind::causal:
      return Mask::causal();
    case MaskKind::window:
      return Mask::window(5);
    case MaskKind::window_right:
      return Mask::window(7, 3);
    case MaskKind::document_causal:
      return Mask::document(pb.cu_seqlens, true);
    case MaskKind::document:
      return Mask::document(pb.cu_seqlens, false);
    case MaskKind::slices: {  // random slices (test::random_slices), the same on every rank
      std::mt19937_64 rng(uint64_t(pb.S) * 7 + 1);
      return test::random_slices(rng, pb.S);
    }
    case MaskKind::shared_prefix: {  // a prefix of S / 4, a 1-token document, two more
      const int64_t a = pb.S / 4;
      return test::shared_prefix_mask(a, {a, a + 1, (a + 1 + pb.S) / 2, pb.S});
    }
  }
  return Mask::none();
}

Layout make_layout(LayoutKind k, const Problem& pb, int P, const Mask& mask) {
  switch (k) {
    case LayoutKind::contiguous:
      return Layout::contiguous(pb.S, P);
    case LayoutKind::zigzag:
      return Layout::zigzag(pb.S, P);
    case LayoutKind::striped1:
      return Layout::striped(pb.S, P, 1);
    case LayoutKind::striped3:
      return Layout::striped(pb.S, P, 3);
    case LayoutKind::varlen:
      return Layout::varlen(pb.cu_seqlens, P);
    case LayoutKind::balanced:  // chunks of 5: a partial last one, and ranks with no chunk at S = 7
      return Layout::balanced(mask, pb.S, P, 5);
  }
  return Layout();
}

AttnSpec make_spec(const Problem& pb, const Mask& mask) {
  AttnSpec spec;
  spec.heads_q = pb.Hq;
  spec.heads_kv = pb.Hkv;
  spec.head_dim = pb.D;
  spec.head_dim_v = pb.Dv;
  spec.mask = mask;
  if (pb.sinks) spec.sinks = test::sinks_for(pb.Hq);
  spec.softcap = pb.softcap;
  return spec;
}

// Ulysses' send volume written out (U = P): every rank sends each other rank its rows of that
// rank's heads of Q, K and V (storage dtype), and on the way back that rank's rows of its own
// heads of out and lse (fp32).
uint64_t ulysses_closed_form(const Problem& pb, const Layout& layout, int me) {
  const int P = layout.ranks();
  const uint64_t size = dtype_size(pb.dtype);
  const uint64_t mine = uint64_t(pb.B * layout.local_len(me));
  uint64_t bytes = uint64_t(P - 1) * mine *
                   uint64_t((pb.Hq / P) * pb.D + member_kv_heads(pb, P) * (pb.D + pb.Dv)) * size;
  for (int o = 0; o < P; ++o)
    if (o != me)
      bytes += uint64_t(pb.B * layout.local_len(o)) * uint64_t(pb.Hq / P) * uint64_t(pb.Dv + 1) * 4;
  return bytes;
}

// ---------------------------------------------------------------- strategy vs reference

class StrategyAttention : public testing::TestWithParam<StrategyCase> {
 protected:
  // One runtime per Ulysses degree and one reference per (problem, mask), kept for the whole
  // suite (building them is the slow part) and released before MPI_Finalize.
  static Runtime& runtime(int ulysses) { return test::world_runtime(ulysses); }
  struct Global {
    Tensor q, k, v;
    cpu::ReferenceResult ref;
  };
  static const Global& global(int problem, MaskKind mask) {
    auto& g = globals_[{problem, int(mask)}];
    if (!g) {
      const Problem& pb = kProblems[problem];
      g = std::make_unique<Global>();
      g->q = test::random_tensor({pb.B, pb.S, pb.Hq, pb.D}, pb.dtype, 601);
      g->k = test::random_tensor({pb.B, pb.S, pb.Hkv, pb.D}, pb.dtype, 602);
      g->v = test::random_tensor({pb.B, pb.S, pb.Hkv, pb.Dv}, pb.dtype, 603);
      g->ref = cpu::attention_reference(g->q, g->k, g->v, make_spec(pb, make_mask(mask, pb)));
    }
    return *g;
  }
  static void TearDownTestSuite() { globals_.clear(); }

 private:
  static std::map<std::pair<int, int>, std::unique_ptr<Global>> globals_;
};
std::map<std::pair<int, int>, std::unique_ptr<StrategyAttention::Global>>
    StrategyAttention::globals_;

TEST_P(StrategyAttention, MatchesReferenceAndByteModel) {
  const StrategyCase& c = GetParam();
  const Problem& pb = kProblems[c.problem];
  const int P = world_size();
  const int U = runtime_ulysses(c.schedule, P);
  if (P % U != 0) GTEST_SKIP() << "Ulysses degree " << U << " does not divide " << P << " ranks";
  const int heads_u = strategy_of(c.schedule) == Strategy::ulysses ? P : U;
  if (pb.Hkv % heads_u != 0 && heads_u % pb.Hkv != 0)
    GTEST_SKIP() << "H_kv " << pb.Hkv << " neither divides nor is a multiple of U = " << heads_u;
  Runtime& rt = runtime(U);
  ASSERT_EQ(rt.cp_size(), P);
  ASSERT_EQ(rt.ulysses_degree(), U);
  const int me = rt.cp_rank();
  const Strategy strategy = strategy_of(c.schedule);
  const AttnSpec spec = make_spec(pb, make_mask(c.mask, pb));
  const Layout layout = make_layout(c.layout, pb, P, spec.mask);
  const Global& g = global(c.problem, c.mask);
  const int64_t Sl = layout.local_len(me);

  Tensor q = layout.dispatch(g.q, me), k = layout.dispatch(g.k, me), v = layout.dispatch(g.v, me);
  rt.reset_counters();
  Partial res = attention(rt, q, k, v, spec, layout, strategy);
  const ByteCounters counters = rt.counters();
  const uint64_t sent = counters.bytes("send") + counters.bytes("alltoall");

  ASSERT_EQ(res.out.dtype(), DType::f32);
  ASSERT_EQ(res.lse.dtype(), DType::f32);
  ASSERT_EQ(res.out.dim(), 4);
  ASSERT_EQ(res.lse.dim(), 3);
  ASSERT_EQ(res.out.size(0), pb.B);
  ASSERT_EQ(res.out.size(1), Sl);
  ASSERT_EQ(res.out.size(2), pb.Hq);
  ASSERT_EQ(res.out.size(3), pb.Dv);
  ASSERT_EQ(res.lse.size(0), pb.B);
  ASSERT_EQ(res.lse.size(1), pb.Hq);
  ASSERT_EQ(res.lse.size(2), Sl);
  EXPECT_TRUE(test::matches_reference(
      res.out.ptr<float>(), res.lse.ptr<float>(), pb.B, Sl, pb.Hq, pb.Dv, g.ref, pb.S,
      [&](int64_t s) { return layout.global_position(me, s); }, test::tolerance_for(pb.dtype)))
      << "rank " << me << " of " << P << ", " << layout.str() << ", " << spec.mask.str();

  // Bytes: the model, with U = 1 for ring, P for ulysses, the runtime's for hybrid.
  const int model_u = strategy == Strategy::ring      ? 1
                      : strategy == Strategy::ulysses ? P
                                                      : rt.ulysses_degree();
  EXPECT_EQ(sent, attention_send_bytes(strategy, layout, spec, pb.B, pb.dtype, model_u, me))
      << "rank " << me << " of " << P << ", " << layout.str() << ", " << spec.mask.str()
      << ": send " << counters.bytes("send") << " + alltoall " << counters.bytes("alltoall");
  // Nothing else moves but validation's control data (a u64 allreduce, counted as "control").
  EXPECT_EQ(counters.total_bytes() - sent,
            counters.bytes("control") + counters.bytes("broadcast") + counters.bytes("allgather"))
      << "rank " << me;

  // Closed forms where every rank holds S/P tokens.
  bool even = true;
  for (int r = 0; r < P; ++r)
    even = even && layout.local_len(r) == pb.S / P && pb.S % P == 0;
  if (strategy == Strategy::ring) {
    EXPECT_EQ(counters.bytes("alltoall"), 0u);
    EXPECT_EQ(sent, ring_send_bytes(layout, spec, pb.B, pb.dtype, me)) << "rank " << me;
    if (c.mask == MaskKind::none && even && pb.D == pb.Dv) {
      EXPECT_EQ(sent, uint64_t(P - 1) * 2 * uint64_t(pb.B) * uint64_t(pb.S / P) * uint64_t(pb.Hkv) *
                          uint64_t(pb.D) * dtype_size(pb.dtype))
          << "rank " << me << " of " << P;
    }
  }
  if (strategy == Strategy::ulysses) {
    EXPECT_EQ(counters.bytes("send"), 0u);
    EXPECT_EQ(sent, ulysses_closed_form(pb, layout, me)) << "rank " << me << " of " << P;
  }
  // The hybrid's extremes are the pure strategies: U = 1 moves what the ring moves, U = P what
  // Ulysses moves.
  if (strategy == Strategy::hybrid && U == 1) {
    EXPECT_EQ(sent, ring_send_bytes(layout, spec, pb.B, pb.dtype, me)) << "rank " << me;
  }
  if (strategy == Strategy::hybrid && U == P) {
    EXPECT_EQ(sent, ulysses_closed_form(pb, layout, me)) << "rank " << me;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, StrategyAttention, testing::ValuesIn(strategy_cases()),
                         [](const testing::TestParamInfo<StrategyCase>& info) {
                           return case_name(info.param);
                         });

// ---------------------------------------------------------------- empty documents

// Document masks whose cu_seqlens repeat entries (empty documents at the start, in the middle, in
// a row, at the end), under varlen on the same boundaries, zigzag and contiguous in turn
// (test::empty_documents_runs), for the ring, Ulysses and the hybrid (U = 2 where it divides P):
// each rank's out and lse against the float64 reference of the boundaries without the repeats, bit
// for bit what the call without them gives, and the same bytes, which the byte model predicts. S =
// 61 divides by no rank count; fp32 and bf16 in turn.
TEST(EmptyDocuments, MatchReferenceAndTheCallWithoutThem) {
  const int P = world_size();
  const Problem pb{61, 1, 24, 12, 32, 16, DType::f32, {}};
  for (const test::EmptyDocumentsRun& run : test::empty_documents_runs(pb.S, P)) {
    const auto& [name, mask, cut, dt, layout, layout_cut] = run;
    const AttnSpec spec = make_spec(pb, mask), spec_cut = make_spec(pb, cut);
    const Tensor qg = test::random_tensor({pb.B, pb.S, pb.Hq, pb.D}, dt, 611);
    const Tensor kg = test::random_tensor({pb.B, pb.S, pb.Hkv, pb.D}, dt, 612);
    const Tensor vg = test::random_tensor({pb.B, pb.S, pb.Hkv, pb.Dv}, dt, 613);
    const auto ref = cpu::attention_reference(qg, kg, vg, spec_cut);
    for (const test::ScheduleRun& sc : test::empty_documents_schedules(P)) {
      Runtime& rt = test::world_runtime(sc.ulysses);
      const int me = rt.cp_rank();
      SCOPED_TRACE(testing::Message()
                   << name << " " << mask.str() << " " << dtype_name(dt) << " " << layout.str()
                   << " " << strategy_name(sc.strategy) << " U=" << sc.ulysses << ", rank " << me);
      const Tensor q = layout.dispatch(qg, me), k = layout.dispatch(kg, me),
                   v = layout.dispatch(vg, me);
      rt.reset_counters();
      const Partial res = attention(rt, q, k, v, spec, layout, sc.strategy);
      const uint64_t sent = rt.counters().bytes("send") + rt.counters().bytes("alltoall");
      const Partial res_cut = attention(rt, q, k, v, spec_cut, layout_cut, sc.strategy);
      const int64_t Sl = layout.local_len(me);
      EXPECT_TRUE(test::matches_reference(
          res.out.ptr<float>(), res.lse.ptr<float>(), pb.B, Sl, pb.Hq, pb.Dv, ref, pb.S,
          [&](int64_t i) { return layout.global_position(me, i); }, test::tolerance_for(dt)));
      EXPECT_EQ(std::memcmp(res.out.data(), res_cut.out.data(), res.out.nbytes()), 0) << "out";
      EXPECT_EQ(std::memcmp(res.lse.data(), res_cut.lse.data(), res.lse.nbytes()), 0) << "lse";
      const int model_u = sc.strategy == Strategy::ulysses ? P : sc.ulysses;
      const uint64_t model = attention_send_bytes(sc.strategy, layout, spec, pb.B, dt, model_u, me);
      EXPECT_EQ(sent, model);
      EXPECT_EQ(model,
                attention_send_bytes(sc.strategy, layout_cut, spec_cut, pb.B, dt, model_u, me));
    }
  }
}

// ---------------------------------------------------------------- a window the ring skips

// A sliding window shorter than a shard under the contiguous layout: a K/V block is seen by the
// next rank only, so the ring forwards it once instead of P - 1 times. The model says each rank
// sends less than the non-causal amount, and the counters agree.
TEST(RingWindow, SkipsStepsAWindowDoesNotNeed) {
  const int P = world_size();
  if (P != 4) GTEST_SKIP() << "needs 4 ranks";
  Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, {});
  const int me = rt.cp_rank();
  const int64_t S = 64, B = 1, Hq = 4, Hkv = 2, D = 32;  // 16 tokens per rank
  const Layout layout = Layout::contiguous(S, P);
  AttnSpec spec;
  spec.heads_q = Hq;
  spec.heads_kv = Hkv;
  spec.head_dim = D;
  spec.mask = Mask::window(6);
  AttnSpec full = spec;
  full.mask = Mask::none();
  const uint64_t noncausal = uint64_t(P - 1) * 2 * B * (S / P) * Hkv * D * dtype_size(DType::f32);
  ASSERT_EQ(ring_send_bytes(layout, full, B, DType::f32, me), noncausal);
  const uint64_t model = attention_send_bytes(Strategy::ring, layout, spec, B, DType::f32, 1, me);
  EXPECT_LT(model, noncausal) << "rank " << me;
  EXPECT_EQ(model, ring_send_bytes(layout, spec, B, DType::f32, me)) << "rank " << me;
  // Rank r's own block is seen by rank r + 1 only (one hop); rank 3's by nobody ahead.
  const uint64_t one_block = 2 * B * (S / P) * Hkv * D * dtype_size(DType::f32);
  EXPECT_EQ(model, me == P - 1 ? 0u : one_block) << "rank " << me;

  Tensor qg = test::random_tensor({B, S, Hq, D}, DType::f32, 701);
  Tensor kg = test::random_tensor({B, S, Hkv, D}, DType::f32, 702);
  Tensor vg = test::random_tensor({B, S, Hkv, D}, DType::f32, 703);
  rt.reset_counters();
  Partial res = attention(rt, layout.dispatch(qg, me), layout.dispatch(kg, me),
                          layout.dispatch(vg, me), spec, layout, Strategy::ring);
  EXPECT_EQ(rt.counters().bytes("send") + rt.counters().bytes("alltoall"), model) << "rank " << me;
  auto ref = cpu::attention_reference(qg, kg, vg, spec);
  EXPECT_TRUE(test::matches_reference(
      res.out.ptr<float>(), res.lse.ptr<float>(), B, layout.local_len(me), Hq, D, ref, S,
      [&](int64_t s) { return layout.global_position(me, s); }, test::tolerance_for(DType::f32)));
}

// ---------------------------------------------------------------- the hybrid's groups

TEST(HybridRuntime, GroupsAndCounters) {
  const int P = world_size();
  for (int U = 1; U <= P; ++U) {
    if (P % U != 0) continue;
    SCOPED_TRACE(testing::Message() << "U=" << U);
    RuntimeOptions o;
    o.ulysses = U;
    Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, o);
    EXPECT_EQ(rt.ulysses_degree(), U);
    const int me = rt.cp_rank();
    if (U > 1) {
      // U consecutive cp ranks exchange heads; one rank per group forms the ring.
      EXPECT_EQ(rt.ulysses_group().size(), U);
      EXPECT_EQ(rt.ulysses_group().rank(), me % U);
      EXPECT_EQ(rt.ring_group().size(), P / U);
      EXPECT_EQ(rt.ring_group().rank(), me / U);
    } else {
      EXPECT_THROW(rt.ulysses_group(), Error);
    }
    // counters() merges cp and the groups; reset_counters() clears them all.
    int64_t x = 1, y = 0;
    rt.cp().sendrecv(&x, 8, (me + 1) % P, &y, 8, (me - 1 + P) % P, 5);
    uint64_t expect = 8;
    if (U > 1) {
      Communicator& ug = rt.ulysses_group();
      const int ur = ug.rank();
      ug.sendrecv(&x, 8, (ur + 1) % U, &y, 8, (ur - 1 + U) % U, 6);
      expect += 8;
      Communicator& rg = rt.ring_group();
      const int rr = rg.rank(), R = rg.size();
      rg.sendrecv(&x, 8, (rr + 1) % R, &y, 8, (rr - 1 + R) % R, 7);
      expect += 8;
    }
    EXPECT_EQ(rt.counters().bytes("send"), expect);
    rt.reset_counters();
    EXPECT_EQ(rt.counters().total_bytes(), 0u);
    EXPECT_EQ(rt.cp().counters().total_bytes(), 0u);
  }
}

// ---------------------------------------------------------------- cp x tp grid

// With tp = 2 the Ulysses groups and the ring of groups live inside each cp group (tp fastest:
// ranks 2i and 2i+1 are in different cp groups), both cp groups computing the same problem.
TEST(HybridTensorParallel, GroupsInsideCpGroups) {
  if (world_size() % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
  const int cp = world_size() / 2;
  const Problem& pb = kProblems[1];
  for (int U = 1; U <= cp; ++U) {
    if (cp % U != 0) continue;
    SCOPED_TRACE(testing::Message() << "cp=" << cp << " U=" << U);
    RuntimeOptions o;
    o.tp = 2;
    o.ulysses = U;
    Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, o);
    ASSERT_EQ(rt.cp_size(), cp);
    const int me = rt.cp_rank();
    EXPECT_EQ(me, rt.rank() / 2);
    const Layout layout = Layout::zigzag(pb.S, cp);
    const AttnSpec spec = make_spec(pb, Mask::causal());
    Tensor qg = test::random_tensor({pb.B, pb.S, pb.Hq, pb.D}, pb.dtype, 801);
    Tensor kg = test::random_tensor({pb.B, pb.S, pb.Hkv, pb.D}, pb.dtype, 802);
    Tensor vg = test::random_tensor({pb.B, pb.S, pb.Hkv, pb.Dv}, pb.dtype, 803);
    auto ref = cpu::attention_reference(qg, kg, vg, spec);
    for (Strategy s : {Strategy::ulysses, Strategy::hybrid}) {
      SCOPED_TRACE(strategy_name(s));
      rt.reset_counters();
      Partial res = attention(rt, layout.dispatch(qg, me), layout.dispatch(kg, me),
                              layout.dispatch(vg, me), spec, layout, s);
      const int u = s == Strategy::ulysses ? cp : U;
      EXPECT_EQ(rt.counters().bytes("send") + rt.counters().bytes("alltoall"),
                attention_send_bytes(s, layout, spec, pb.B, pb.dtype, u, me))
          << "rank " << rt.rank();
      EXPECT_TRUE(test::matches_reference(
          res.out.ptr<float>(), res.lse.ptr<float>(), pb.B, layout.local_len(me), pb.Hq, pb.Dv, ref,
          pb.S, [&](int64_t i) { return layout.global_position(me, i); },
          test::tolerance_for(pb.dtype)))
          << "rank " << rt.rank();
    }
  }
}

}  // namespace
}  // namespace dattn
