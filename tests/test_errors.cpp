// Multi-rank tests (1-4 ranks) of error handling: bad input to dattn::attention throws a
// dattn::Error of kind invalid_argument on every rank (no rank hangs), whose what() names the
// parameter, the mismatch or the rank at fault (masks, Ulysses/hybrid head splits included); the
// errors of layouts, the runtime (its Ulysses degree), and dtype/strategy names; and the other
// kinds (MPI, CUDA, NCCL, out of memory, timeout, internal), set where thrown and relayed to
// every rank by agreed validation.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <functional>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/reference.h"
#include "src/attention.h"
#include "src/base/error.h"
#include "src/layout.h"
#include "src/runtime.h"
#include "src/validate.h"
#include "tests/test_reference.h"

#if DATTN_WITH_CUDA
#include "src/base/cuda_check.h"
#endif
#if DATTN_WITH_NCCL
#include "collective/nccl_check.h"
#endif

namespace dattn {
namespace {

// Runs f, which must throw a dattn::Error of `kind` whose what() contains every needle, on every
// rank the same kind. Collective over MPI_COMM_WORLD: every rank calls it.
template <typename F>
testing::AssertionResult throws_kind(F&& f, ErrorKind kind,
                                     const std::vector<std::string>& needles = {}) {
  int got = -1;  // this rank's kind, -1 for none
  testing::AssertionResult named = test::throws_naming(
      [&] {
        try {
          f();
        } catch (const Error& e) {
          got = int(e.kind());
          throw;
        }
      },
      needles);
  int lo = 0, hi = 0;
  MPI_Allreduce(&got, &lo, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&got, &hi, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (!named) return named;
  if (got != int(kind))
    return testing::AssertionFailure()
           << "kind " << error_kind_name(ErrorKind(got)) << ", expected " << error_kind_name(kind)
           << ": " << named.message();
  if (lo != hi)
    return testing::AssertionFailure()
           << "the ranks threw different kinds (" << lo << " to " << hi << "): " << named.message();
  return named;
}

// A bad argument: invalid_argument on every rank, naming every needle.
template <typename F>
testing::AssertionResult rejects(F&& f, const std::vector<std::string>& needles) {
  return throws_kind(std::forward<F>(f), ErrorKind::invalid_argument, needles);
}

// A valid problem for this rank: spec, contiguous layout over the world, and shards.
struct Call {
  AttnSpec spec;
  Layout layout;
  Tensor q, k, v;
  int64_t B = 1, S = 0;
  DType dtype = DType::f32;

  Call(int P, int me, int64_t per_rank = 4, DType dt = DType::f32, int64_t batch = 1)
      : B(batch), dtype(dt) {
    spec.heads_q = 4;
    spec.heads_kv = 2;
    spec.head_dim = 32;
    spec.mask = Mask::causal();
    S = per_rank * P;
    layout = Layout::contiguous(S, P);
    make_tensors(me);
  }
  void make_tensors(int me, int64_t q_seq = -1, int64_t k_seq = -1) {
    const int64_t l = layout.local_len(me);
    q = test::random_tensor({B, q_seq >= 0 ? q_seq : l, spec.heads_q, spec.head_dim}, dtype, 1);
    k = test::random_tensor({B, k_seq >= 0 ? k_seq : l, spec.heads_kv, spec.head_dim}, dtype, 2);
    v = test::random_tensor({B, k_seq >= 0 ? k_seq : l, spec.heads_kv, spec.dim_v()}, dtype, 3);
  }
};

class AttentionErrors : public testing::Test {
 protected:
  void SetUp() override {
    rt = std::make_unique<Runtime>(Runtime::from_mpi(MPI_COMM_WORLD, {}));
    P = rt->cp_size();
    me = rt->cp_rank();
  }
  void TearDown() override { rt.reset(); }
  Partial run(const Call& c) { return attention(*rt, c.q, c.k, c.v, c.spec, c.layout); }
  Partial run(const Call& c, const AttnSpec& spec) {
    return attention(*rt, c.q, c.k, c.v, spec, c.layout);
  }
  std::string rank_str(int r) const { return "rank " + std::to_string(r); }

  std::unique_ptr<Runtime> rt;
  int P = 1, me = 0;
};

// ---------------------------------------------------------------- bad input on every rank

TEST_F(AttentionErrors, ValidCallSucceeds) {
  Call c(P, me);
  Partial r = run(c);
  EXPECT_EQ(r.out.size(1), c.layout.local_len(me));
}

TEST_F(AttentionErrors, BatchMismatchBetweenQAndK) {
  Call c(P, me);
  c.k = test::random_tensor({2, c.layout.local_len(me), 2, 32}, DType::f32, 5);
  c.v = test::random_tensor({2, c.layout.local_len(me), 2, 32}, DType::f32, 6);
  EXPECT_TRUE(rejects([&] { run(c); }, {"batch"}));
}

TEST_F(AttentionErrors, HeadDimMismatchBetweenQAndK) {
  Call c(P, me);
  c.k = test::random_tensor({1, c.layout.local_len(me), 2, 16}, DType::f32, 5);
  EXPECT_TRUE(rejects([&] { run(c); }, {"head_dim", "16"}));
}

TEST_F(AttentionErrors, VHeadDimNotSpecHeadDimV) {
  Call c(P, me);
  c.spec.head_dim_v = 24;  // v still has 32
  EXPECT_TRUE(rejects([&] { run(c); }, {"head_dim"}));
}

TEST_F(AttentionErrors, HeadsQNotAMultipleOfHeadsKv) {
  Call c(P, me);
  c.spec.heads_q = 6;
  c.spec.heads_kv = 4;
  c.q = test::random_tensor({1, c.layout.local_len(me), 6, 32}, DType::f32, 5);
  c.k = test::random_tensor({1, c.layout.local_len(me), 4, 32}, DType::f32, 6);
  c.v = test::random_tensor({1, c.layout.local_len(me), 4, 32}, DType::f32, 7);
  EXPECT_TRUE(rejects([&] { run(c); }, {"heads_q", "multiple"}));
}

TEST_F(AttentionErrors, BadSinksAndSoftcap) {
  Call c(P, me);
  for (float cap : {-1.f, NAN, INFINITY}) {
    AttnSpec s = c.spec;
    s.softcap = cap;
    EXPECT_TRUE(rejects([&] { run(c, s); }, {"softcap"})) << cap;
  }
  {
    // A softcap that differs between ranks: every rank refuses the call.
    AttnSpec s = c.spec;
    s.softcap = me == 0 ? 30.f : 50.f;
    if (P > 1) {
      EXPECT_THROW(run(c, s), Error);
    }
  }
  {
    AttnSpec s = c.spec;
    s.sinks = make_sinks({0.5f, 1.f, 2.f});  // 4 query heads
    EXPECT_TRUE(rejects([&] { run(c, s); }, {"sinks size", "3", "heads_q"}));
  }
  {
    AttnSpec s = c.spec;
    s.sinks = make_sinks({0.5f, 1.f, NAN, 2.f});
    EXPECT_TRUE(rejects([&] { run(c, s); }, {"sinks[2]", "finite"}));
  }
  {
    AttnSpec s = c.spec;
    s.sinks = make_sinks({0.5f, 1.f, -INFINITY, 2.f});
    EXPECT_TRUE(rejects([&] { run(c, s); }, {"sinks[2]", "finite"}));
  }
  {
    // Sinks that differ between ranks: every rank refuses the call.
    AttnSpec s = c.spec;
    s.sinks = make_sinks({0.5f, 1.f, me == P - 1 ? 3.f : 2.f, 2.f});
    if (P > 1) {
      EXPECT_THROW(run(c, s), Error);
    }
  }
  {
    AttnSpec s = c.spec;
    s.sinks = make_sinks({0.5f, 1.f, 2.f, 3.f});
    EXPECT_NO_THROW(run(c, s));
  }
}

// Slice masks: overlapping, out of range (negative, or past the sequence), with a window, and
// slices that differ between ranks: named errors on every rank; a valid list runs.
TEST_F(AttentionErrors, BadSlices) {
  Call c(P, me);
  using K = MaskSlice::Kind;
  const int64_t S = c.S;
  auto with = [&](Mask m) {
    AttnSpec s = c.spec;
    s.mask = std::move(m);
    return s;
  };
  EXPECT_TRUE(rejects(
      [&] {
        run(c, with(Mask::from_slices({{0, S, 0, S, K::causal}, {1, 2, 0, 1, K::full}})));
      },
      {"slices", "do not overlap"}));
  EXPECT_TRUE(rejects(
      [&] {
        run(c, with(Mask::from_slices({{0, S, -2, S, K::full}})));
      },
      {"slice k range", "k -2:"}));
  EXPECT_TRUE(rejects(
      [&] {
        run(c, with(Mask::from_slices({{0, S + 1, 0, S, K::full}})));
      },
      {"slices", "largest end is " + std::to_string(S + 1), "global_seq"}));
  {
    Mask m = Mask::from_slices({{0, S, 0, S, K::full}});
    m.left = 3;
    EXPECT_TRUE(rejects([&] { run(c, with(m)); }, {"mask", "slices alone"}));
  }
  if (P > 1) {  // a different list on one rank
    const int64_t end = me == P - 1 ? S - 1 : S;
    EXPECT_THROW(run(c, with(Mask::from_slices({{0, S, 0, end, K::causal}}))), Error);
  }
  EXPECT_NO_THROW(run(c, with(Mask::from_slices(
                             {{0, S / 2, 0, S / 2, K::causal}, {S / 2, S, 0, S, K::bi_causal}}))));
}

TEST_F(AttentionErrors, TensorHeadsNotTheSpecs) {
  Call c(P, me);
  c.q = test::random_tensor({1, c.layout.local_len(me), 2, 32}, DType::f32, 5);  // spec: 4
  EXPECT_TRUE(rejects([&] { run(c); }, {"heads"}));
}

TEST_F(AttentionErrors, ZeroOrNegativeSizes) {
  Call c(P, me);
  {
    AttnSpec s = c.spec;
    s.heads_q = 0;
    EXPECT_TRUE(rejects([&] { run(c, s); }, {"heads_q"}));
  }
  {
    AttnSpec s = c.spec;
    s.heads_kv = 0;
    EXPECT_TRUE(rejects([&] { run(c, s); }, {"heads_kv"}));
  }
  {
    AttnSpec s = c.spec;
    s.heads_kv = -2;
    EXPECT_TRUE(rejects([&] { run(c, s); }, {"heads_kv"}));
  }
  {
    AttnSpec s = c.spec;
    s.head_dim = 0;
    EXPECT_TRUE(rejects([&] { run(c, s); }, {"head_dim"}));
  }
  {
    AttnSpec s = c.spec;
    s.head_dim = -32;
    EXPECT_TRUE(rejects([&] { run(c, s); }, {"head_dim"}));
  }
  {
    AttnSpec s = c.spec;
    s.head_dim_v = -1;
    EXPECT_TRUE(rejects([&] { run(c, s); }, {"head_dim_v"}));
  }
  {
    AttnSpec s = c.spec;
    s.head_dim = 512;  // beyond the kernels' 256
    EXPECT_TRUE(rejects([&] { run(c, s); }, {"head_dim"}));
  }
  // A batch of 0 is rejected too.
  Call z(P, me, 4, DType::f32, 0);
  EXPECT_TRUE(rejects([&] { run(z); }, {"batch"}));
}

// spec.h: softmax_scale 0 means 1/sqrt(head_dim); a negative or non-finite scale is rejected.
TEST_F(AttentionErrors, SoftmaxScale) {
  Call c(P, me);
  for (float bad : {-0.5f, std::nanf(""), INFINITY}) {
    AttnSpec s = c.spec;
    s.softmax_scale = bad;
    EXPECT_TRUE(rejects([&] { run(c, s); }, {"softmax_scale"})) << bad;
  }
}

TEST_F(AttentionErrors, LocalSeqNotTheLayoutsLocalLen) {
  Call c(P, me);
  const int64_t l = c.layout.local_len(me);
  c.make_tensors(me, l + 1, l + 1);
  EXPECT_TRUE(rejects([&] { run(c); }, {"seq", std::to_string(l + 1)}));
  c.make_tensors(me, l, l + 2);  // q right, k/v wrong
  EXPECT_TRUE(rejects([&] { run(c); }, {"seq"}));
  c.make_tensors(me);
  c.v = test::random_tensor({1, l + 3, 2, 32}, DType::f32, 9);  // v's seq differs from k's
  EXPECT_TRUE(rejects([&] { run(c); }, {"seq"}));
}

TEST_F(AttentionErrors, DtypeOfKDiffersFromQ) {
  Call c(P, me);
  c.k = c.k.to(DType::bf16);
  EXPECT_TRUE(rejects([&] { run(c); }, {"dtype", "bf16"}));
  Call d(P, me, 4, DType::f16);
  d.v = d.v.to(DType::f32);
  EXPECT_TRUE(rejects([&] { run(d); }, {"dtype"}));
}

TEST_F(AttentionErrors, UndefinedOrWrongRankTensor) {
  Call c(P, me);
  c.v = Tensor();
  EXPECT_TRUE(rejects([&] { run(c); }, {"v"}));
  Call d(P, me);
  d.q = test::random_tensor({d.layout.local_len(me), 4, 32}, DType::f32, 4);  // 3-D
  EXPECT_TRUE(rejects([&] { run(d); }, {"q"}));
}

TEST_F(AttentionErrors, LayoutForADifferentNumberOfRanks) {
  Call c(P, me);
  c.layout = Layout::contiguous(c.S, P + 1);
  c.make_tensors(me);
  EXPECT_TRUE(rejects([&] { run(c); }, {"ranks", std::to_string(P + 1)}));
}

// ---------------------------------------------------------------- a configuration that differs

// Rank 1 (only) passes a different configuration: every rank throws, naming the mismatch.
TEST_F(AttentionErrors, ConfigurationDiffersBetweenRanks) {
  if (P < 2) GTEST_SKIP() << "needs 2 ranks";
  const std::vector<std::string> differ = {"differ"};
  {
    Call c(P, me);
    if (me == 1) c.spec.mask = Mask::none();
    EXPECT_TRUE(rejects([&] { run(c); }, differ)) << "mask";
  }
  {
    Call c(P, me);
    if (me == 1) c.spec.softmax_scale = 0.25f;
    EXPECT_TRUE(rejects([&] { run(c); }, differ)) << "softmax scale";
  }
  {
    Call c(P, me);
    if (me == 1) {  // a different global seq, with shards that fit rank 1's own layout
      c.layout = Layout::contiguous(c.S + P, P);
      c.make_tensors(me);
    }
    EXPECT_TRUE(rejects([&] { run(c); }, differ)) << "layout";
  }
  {
    Call c(P, me, 4, DType::f32, me == 1 ? 2 : 1);  // batch
    EXPECT_TRUE(rejects([&] { run(c); }, differ)) << "batch";
  }
  {
    Call c(P, me, 4, me == 1 ? DType::bf16 : DType::f32);  // dtype
    EXPECT_TRUE(rejects([&] { run(c); }, differ)) << "dtype";
  }
  {
    Call c(P, me);
    if (me == 1) {  // heads_kv differs (still a valid spec on rank 1)
      c.spec.heads_kv = 4;
      c.make_tensors(me);
    }
    EXPECT_TRUE(rejects([&] { run(c); }, differ)) << "heads_kv";
  }
  // The message names the rank that differs from rank 0.
  {
    Call c(P, me);
    if (me == P - 1) c.spec.mask = Mask::none();
    EXPECT_TRUE(rejects([&] { run(c); }, {"differ", std::to_string(P - 1)}));
  }
}

// Only the last rank passes a bad value: every rank throws, and the message names that rank.
TEST_F(AttentionErrors, BadValueOnOneRankOnly) {
  const int bad = P - 1;
  {
    Call c(P, me);
    if (me == bad) c.k = test::random_tensor({1, c.layout.local_len(me), 2, 16}, DType::f32, 5);
    EXPECT_TRUE(rejects([&] { run(c); }, {rank_str(bad), "head_dim"}));
  }
  {
    Call c(P, me);
    if (me == bad) c.make_tensors(me, c.layout.local_len(me) + 1, c.layout.local_len(me) + 1);
    EXPECT_TRUE(rejects([&] { run(c); }, {rank_str(bad), "seq"}));
  }
  {
    Call c(P, me);
    if (me == bad) c.v = c.v.to(DType::bf16);
    EXPECT_TRUE(rejects([&] { run(c); }, {rank_str(bad), "dtype"}));
  }
  if (P >= 2) {  // rank 0 is fine, rank 1 is bad: the message on rank 0 names rank 1
    Call c(P, me);
    if (me == 1) c.q = test::random_tensor({1, c.layout.local_len(me), 2, 32}, DType::f32, 5);
    EXPECT_TRUE(rejects([&] { run(c); }, {rank_str(1), "heads"}));
  }
}

// After every kind of rejected call the ranks are still in step: a valid call works and is right.
TEST_F(AttentionErrors, ValidCallAfterErrorsIsCorrect) {
  Call bad(P, me);
  if (me == P - 1) bad.spec.heads_q = 3;
  EXPECT_THROW(run(bad), Error);
  Call c(P, me, 5, DType::bf16);
  EXPECT_NO_THROW(run(c));
  Tensor qg = test::random_tensor({1, c.S, 4, 32}, DType::bf16, 11);
  Tensor kg = test::random_tensor({1, c.S, 2, 32}, DType::bf16, 12);
  Tensor vg = test::random_tensor({1, c.S, 2, 32}, DType::bf16, 13);
  Partial r2 = attention(*rt, c.layout.dispatch(qg, me), c.layout.dispatch(kg, me),
                         c.layout.dispatch(vg, me), c.spec, c.layout);
  auto ref = cpu::attention_reference(qg, kg, vg, c.spec);
  EXPECT_TRUE(test::matches_reference(
      r2.out.ptr<float>(), r2.lse.ptr<float>(), 1, c.layout.local_len(me), 4, 32, ref, c.S,
      [&](int64_t s) { return c.layout.global_position(me, s); },
      test::tolerance_for(DType::bf16)));
}

// what() reads "dattn error on rank R (file.cpp:123): <message>".
TEST_F(AttentionErrors, MessageFormat) {
  Call c(P, me);
  c.spec.heads_q = 0;
  try {
    run(c);
    ADD_FAILURE() << "did not throw";
  } catch (const Error& e) {
    const std::string what = e.what(), prefix = "dattn error on " + rank_str(me) + " (";
    EXPECT_EQ(what.rfind(prefix, 0), 0u) << what;
    EXPECT_NE(what.find(".cpp:"), std::string::npos) << what;
    EXPECT_NE(what.find(e.message()), std::string::npos) << what;
    EXPECT_NE(e.message().find("heads_q"), std::string::npos) << e.message();
    EXPECT_EQ(e.kind(), ErrorKind::invalid_argument) << error_kind_name(e.kind());
  }
}

// ---------------------------------------------------------------- runtime, layout, names

TEST(RuntimeErrors, CpTimesTpNotTheNumberOfRanks) {
  int P = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &P);
  RuntimeOptions o;
  o.cp = P + 1;
  EXPECT_TRUE(rejects([&] { Runtime::from_mpi(MPI_COMM_WORLD, o); }, {"cp"}));
  RuntimeOptions t;
  t.tp = 0;
  EXPECT_TRUE(rejects([&] { Runtime::from_mpi(MPI_COMM_WORLD, t); }, {"tp"}));
  RuntimeOptions g;  // no machine has this GPU (and a CPU-only build has none at all)
  g.device = Device::cuda(1 << 20);
  EXPECT_TRUE(rejects([&] { Runtime::from_mpi(MPI_COMM_WORLD, g); }, {"device"}));
  // Options that differ between ranks, or that are bad on one rank only: every rank throws.
  int me = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  if (P >= 2) {
    RuntimeOptions d;
    if (me == 1) {  // valid on its own, differs from rank 0
      d.tp = P;
      d.cp = 1;
    }
    EXPECT_TRUE(rejects([&] { Runtime::from_mpi(MPI_COMM_WORLD, d); }, {"differ"}));
  }
  RuntimeOptions last;
  if (me == P - 1) last.cp = P + 1;
  EXPECT_TRUE(rejects([&] { Runtime::from_mpi(MPI_COMM_WORLD, last); },
                      {"rank " + std::to_string(P - 1), "cp"}));
  // And a valid runtime can still be built afterwards.
  Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, {});
  EXPECT_EQ(rt.size(), P);
}

TEST(LayoutErrors, BadRanksOrSeq) {
  EXPECT_TRUE(rejects([] { Layout::contiguous(16, 0); }, {"ranks", "0"}));
  EXPECT_TRUE(rejects([] { Layout::contiguous(16, -3); }, {"ranks", "-3"}));
  EXPECT_TRUE(rejects([] { Layout::contiguous(-1, 2); }, {"global_seq", "-1"}));
  Layout l = Layout::contiguous(10, 2);
  EXPECT_TRUE(rejects([&] { l.local_len(2); }, {"rank"}));
  EXPECT_TRUE(rejects([&] { l.global_position(0, 5); }, {"local_index"}));
  Tensor wrong = Tensor::zeros({1, 11, 1, 1}, DType::f32);
  EXPECT_TRUE(rejects([&] { l.dispatch(wrong, 0); }, {"sequence length", "11"}));
}

TEST(NameErrors, ParseDtypeAndStrategy) {
  EXPECT_TRUE(rejects([] { parse_dtype("fp8"); }, {"dtype", "fp8"}));
  EXPECT_TRUE(rejects([] { parse_dtype(""); }, {"dtype"}));
  EXPECT_TRUE(rejects([] { parse_strategy("trees"); }, {"strategy", "trees"}));
  EXPECT_TRUE(rejects([] { parse_strategy("Ring "); }, {"strategy", "Ring "}));
}

// ---------------------------------------------------------------- masks, Ulysses and hybrid

TEST_F(AttentionErrors, NegativeWindowNamesWindowLeft) {
  Call c(P, me);
  c.spec.mask = Mask::window(-5);
  EXPECT_TRUE(rejects([&] { run(c); }, {"window left", "-5"}));
  c.spec.mask = Mask::window(4, -7);
  EXPECT_TRUE(rejects([&] { run(c); }, {"window right", "-7"}));
}

TEST_F(AttentionErrors, DocumentsNotEndingAtGlobalSeq) {
  Call c(P, me);  // S = 4 P
  c.spec.mask = Mask::document({0, 3, c.S - 1}, true);
  EXPECT_TRUE(rejects([&] { run(c); }, {"cu_seqlens"}));
  c.spec.mask = Mask::document({0, 3, c.S + 2}, false);
  EXPECT_TRUE(rejects([&] { run(c); }, {"cu_seqlens"}));
  c.spec.mask = Mask::document({0, 3, 2, c.S}, true);  // decreasing
  EXPECT_TRUE(rejects([&] { run(c); }, {"cu_seqlens[2]", "non-decreasing"}));
  // Ending at S is valid, under the ring and Ulysses (12 K/V heads divide by 1 to 4 ranks), and
  // so are empty documents (repeated boundaries), also after the last token.
  c.spec.heads_kv = 12;
  c.spec.heads_q = 12;
  c.make_tensors(me);
  for (const std::vector<int64_t>& cu :
       std::vector<std::vector<int64_t>>{{0, 3, c.S}, {0, 0, 3, 3, c.S}, {0, 3, c.S, c.S}}) {
    c.spec.mask = Mask::document(cu, true);
    for (Strategy s : {Strategy::ring, Strategy::ulysses}) {
      Partial r = attention(*rt, c.q, c.k, c.v, c.spec, c.layout, s);
      EXPECT_EQ(r.out.size(1), c.layout.local_len(me)) << strategy_name(s);
    }
  }
}

// Ulysses splits the K/V heads over the cp ranks, or shares each over P / heads_kv of them:
// heads_kv must be a multiple or a divisor of P, and heads_q a multiple of P.
TEST_F(AttentionErrors, UlyssesHeadsKvNotDivisibleByCpRanks) {
  if (P < 2) GTEST_SKIP() << "every heads_kv divides by 1 rank";
  Call c(P, me);
  for (int64_t hkv = 1; hkv <= 6; ++hkv) {
    if (hkv % P == 0 || P % hkv == 0) continue;
    c.spec.heads_kv = hkv;
    c.spec.heads_q = 2 * hkv;
    c.make_tensors(me);
    EXPECT_TRUE(rejects([&] { attention(*rt, c.q, c.k, c.v, c.spec, c.layout, Strategy::ulysses); },
                        {"heads_kv"}))
        << "heads_kv = " << hkv << " on " << P << " ranks";
  }
  c.spec.heads_kv = P + 1;  // never a multiple of P
  c.spec.heads_q = 2 * (P + 1);
  c.make_tensors(me);
  // The same problem runs under the ring, and under Ulysses with heads_kv = P.
  EXPECT_NO_THROW(attention(*rt, c.q, c.k, c.v, c.spec, c.layout, Strategy::ring));
  c.spec.heads_kv = P;
  c.spec.heads_q = 2 * P;
  c.make_tensors(me);
  EXPECT_NO_THROW(attention(*rt, c.q, c.k, c.v, c.spec, c.layout, Strategy::ulysses));
  // One kv head shared by all P ranks: heads_q must still split over them.
  c.spec.heads_kv = 1;
  c.spec.heads_q = P + 1;
  c.make_tensors(me);
  EXPECT_TRUE(rejects([&] { attention(*rt, c.q, c.k, c.v, c.spec, c.layout, Strategy::ulysses); },
                      {"heads_q"}));
  c.spec.heads_q = P;
  c.make_tensors(me);
  EXPECT_NO_THROW(attention(*rt, c.q, c.k, c.v, c.spec, c.layout, Strategy::ulysses));
}

// The hybrid's Ulysses groups split heads_kv over U ranks.
TEST(HybridErrors, HeadsKvNotDivisibleByUlyssesDegree) {
  int P = 1, me = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &P);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  if (P % 2 != 0) GTEST_SKIP() << "needs an even number of ranks (U = 2)";
  RuntimeOptions o;
  o.ulysses = 2;
  Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, o);
  Call c(P, me);
  c.spec.heads_kv = 3;
  c.spec.heads_q = 6;
  c.make_tensors(me);
  EXPECT_TRUE(rejects([&] { attention(rt, c.q, c.k, c.v, c.spec, c.layout, Strategy::hybrid); },
                      {"heads_kv"}));
  c.spec.heads_kv = 2;
  c.spec.heads_q = 4;
  c.make_tensors(me);
  EXPECT_NO_THROW(attention(rt, c.q, c.k, c.v, c.spec, c.layout, Strategy::hybrid));
}

// RuntimeOptions.ulysses must divide the cp ranks: every rank throws, naming it.
TEST(RuntimeErrors, UlyssesDegreeNotDividingCp) {
  int P = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &P);
  for (int u : {P + 1, 0, -2}) {
    RuntimeOptions o;
    o.ulysses = u;
    EXPECT_TRUE(rejects([&] { Runtime::from_mpi(MPI_COMM_WORLD, o); }, {"ulysses"}))
        << "ulysses = " << u;
  }
  if (P == 4) {
    RuntimeOptions o;
    o.ulysses = 3;
    EXPECT_TRUE(rejects([&] { Runtime::from_mpi(MPI_COMM_WORLD, o); }, {"ulysses", "3"}));
  }
  // Every divisor works.
  for (int u = 1; u <= P; ++u) {
    if (P % u != 0) continue;
    RuntimeOptions o;
    o.ulysses = u;
    Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, o);
    EXPECT_EQ(rt.ulysses_degree(), u);
  }
}

TEST(NameErrors, ParseEveryStrategy) {
  for (Strategy s : {Strategy::ring, Strategy::ulysses, Strategy::hybrid}) {
    EXPECT_EQ(parse_strategy(strategy_name(s)), s) << strategy_name(s);
  }
  EXPECT_EQ(parse_strategy("ulysses"), Strategy::ulysses);
  EXPECT_EQ(parse_strategy("hybrid"), Strategy::hybrid);
  EXPECT_EQ(std::string(strategy_name(Strategy::ulysses)), "ulysses");
  EXPECT_EQ(std::string(strategy_name(Strategy::hybrid)), "hybrid");
  EXPECT_TRUE(rejects([] { parse_strategy("usp"); }, {"strategy", "usp"}));
}

// ---------------------------------------------------------------- error kinds

TEST(ErrorKinds, NamesAndMacros) {
  std::vector<std::string> names;
  for (int k = 0; k < kErrorKinds; ++k) {
    const std::string name = error_kind_name(ErrorKind(k));
    EXPECT_NE(name, "unknown error") << k;
    for (const std::string& other : names)
      EXPECT_NE(name, other);
    names.push_back(name);
  }
  EXPECT_STREQ(error_kind_name(ErrorKind::invalid_argument), "invalid argument");
  EXPECT_STREQ(error_kind_name(ErrorKind::out_of_memory), "out of memory");
  EXPECT_STREQ(error_kind_name(ErrorKind(kErrorKinds)), "unknown error");
  EXPECT_TRUE(throws_kind([] { DATTN_THROW("plain"); }, ErrorKind::invalid_argument, {"plain"}));
  EXPECT_TRUE(throws_kind([] { DATTN_CHECK_ARG(false, "x", 1, "2"); }, ErrorKind::invalid_argument,
                          {"invalid x = 1: expected 2"}));
  const int two = 2;
  EXPECT_TRUE(throws_kind([&] { DATTN_ASSERT(two == 3); }, ErrorKind::internal,
                          {"internal error", "two == 3"}));
  EXPECT_TRUE(throws_kind([] { DATTN_THROW_KIND(ErrorKind::timeout, "waited ", 2, " s"); },
                          ErrorKind::timeout, {"waited 2 s"}));
}

// An MPI call that fails (a send to a rank the communicator does not have) is an MPI error.
TEST_F(AttentionErrors, MpiFailureIsAnMpiError) {
  int x = 0;
  const auto send = [&] {
    RequestPtr r = rt->cp().isend(&x, sizeof x, P + 3, 1);
    rt->cp().wait(r);
  };
  EXPECT_TRUE(throws_kind(send, ErrorKind::mpi, {"MPI call failed", "MPI_Isend"}));
}

#if DATTN_WITH_CUDA
// A failed CUDA call is a CUDA error, except a failed allocation: out of memory.
TEST(ErrorKinds, CudaCheck) {
  EXPECT_TRUE(throws_kind([] { DATTN_CUDA_CHECK(cudaErrorInvalidValue); }, ErrorKind::cuda,
                          {"CUDA call failed", "cudaErrorInvalidValue"}));
  EXPECT_TRUE(throws_kind([] { DATTN_CUDA_CHECK(cudaErrorMemoryAllocation); },
                          ErrorKind::out_of_memory, {"cudaErrorMemoryAllocation"}));
}

// A device tensor of twice the GPU's memory is out of memory.
TEST(ErrorKinds, DeviceOutOfMemory) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) GTEST_SKIP() << "needs a GPU";
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  const int64_t floats = int64_t(prop.totalGlobalMem / 2);  // 4 bytes each: twice the memory
  EXPECT_TRUE(throws_kind([&] { Tensor::empty({floats}, DType::f32, Device::cuda(0)); },
                          ErrorKind::out_of_memory, {"cudaErrorMemoryAllocation"}));
}
#endif

#if DATTN_WITH_NCCL
TEST(ErrorKinds, NcclCheck) {
  EXPECT_TRUE(throws_kind([] { DATTN_NCCL_CHECK(ncclInvalidArgument); }, ErrorKind::nccl,
                          {"NCCL call failed", "ncclInvalidArgument"}));
}
#endif

// A host tensor beyond the address space (256 TiB) is out of memory, and so is the same
// allocation in an agreed validation on the last rank only: every rank throws that kind.
TEST_F(AttentionErrors, HostOutOfMemory) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer reports an allocation this large instead of failing it";
#endif
  const auto huge = [] { Tensor::empty({int64_t(1) << 46}, DType::f32); };
  EXPECT_TRUE(throws_kind(huge, ErrorKind::out_of_memory, {"out of host memory"}));
  EXPECT_TRUE(throws_kind(
      [&] {
        agree_on_validation(rt->cp(), "test call", kHashSeed, [&] {
          if (me == P - 1) huge();
        });
      },
      ErrorKind::out_of_memory,
      {rank_str(P - 1) + " rejected the test call", "out of host memory"}));
}

// The kind of the failing rank's error travels with its message: whatever kind the last rank
// throws in an agreed validation, every rank throws that kind, naming that rank. std::bad_alloc
// there is out of memory, any other exception internal.
TEST_F(AttentionErrors, EveryRankThrowsTheFailingRanksKind) {
  const auto on_last_rank = [&](const std::function<void()>& fail) {
    return [&, fail] {
      agree_on_validation(rt->cp(), "test call", kHashSeed, [&] {
        if (me == P - 1) fail();
      });
    };
  };
  const std::string who = rank_str(P - 1) + " rejected the test call";
  for (int k = 0; k < kErrorKinds; ++k) {
    const ErrorKind kind = ErrorKind(k);
    EXPECT_TRUE(throws_kind(on_last_rank([&] { DATTN_THROW_KIND(kind, "failed here"); }), kind,
                            {who, "failed here"}))
        << error_kind_name(kind);
  }
  EXPECT_TRUE(throws_kind(on_last_rank([] { throw std::bad_alloc(); }), ErrorKind::out_of_memory,
                          {who, "out of memory"}));
  EXPECT_TRUE(throws_kind(on_last_rank([] { throw std::logic_error("odd state"); }),
                          ErrorKind::internal, {who, "internal error", "odd state"}));
  // And the ranks are still in step.
  Call c(P, me);
  EXPECT_NO_THROW(run(c));
}

}  // namespace
}  // namespace dattn
