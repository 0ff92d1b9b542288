// Non-finite inputs in one process (attention_local, its backward, the CPU kernels): NaN and inf
// where the mask hides them never change the results of the rows and keys that do not see them
// (bit for bit, fp32 and bf16, forward and both backward schedules, tiles straddled); rows that
// see no key give out = 0, lse = -inf, dq = 0 whatever their q and dout hold; a NaN a row does
// see still reaches it; and the optional check (DATTN_CHECK_FINITE=1) names the tensor, the
// position and the value.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cpu/attention_backward_cpu.h"
#include "kernels/cpu/attention_cpu.h"
#include "src/attention.h"
#include "src/base/error.h"
#include "tests/test_nonfinite.h"
#include "tests/test_reference.h"

namespace dattn {
namespace {

using test::CleanSets;
using test::ScopedEnv;

// ---------------------------------------------------------------- problems

// 1100 queries and keys: 5 query tiles and 3 key tiles of the kernels (256 x 512), so garbage
// and clean tokens share partially masked tiles. GQA (2 query heads per kv head), D_v != D.
constexpr int64_t kS = 1100, kB = 1, kHq = 2, kHkv = 1, kD = 32, kDv = 24;

struct Scenario {
  std::string name;
  Mask mask;
  int64_t q_pos0 = 0, k_pos0 = 0;
  std::vector<std::pair<int64_t, int64_t>> bad;  // garbage position ranges [lo, hi)
};

std::vector<Scenario> scenarios() {
  const std::vector<int64_t> cu = {0, 200, 530, 800, 1100};
  return {
      // A whole document of garbage: the other documents' rows and keys must not notice.
      {"doc_causal", Mask::document(cu, true), 0, 0, {{200, 530}}},
      {"doc", Mask::document(cu, false), 0, 0, {{200, 530}}},
      // Garbage outside the windows of the rows [500, 700).
      {"window", Mask::window(40), 0, 0, {{0, 500}, {700, 1100}}},
      {"window_two_sided", Mask::window(30, 20), 0, 0, {{0, 500}, {700, 1100}}},
      // Keys after the positions of the queries [0, 600).
      {"causal", Mask::causal(), 0, 0, {{600, 1100}}},
      // Queries 0..299 see no key (keys start at 300): garbage in their q and dout.
      {"rows_see_nothing", Mask::causal(), 0, 300, {{0, 300}}},
  };
}

std::vector<char> bad_positions(const Scenario& sc) {
  std::vector<char> bad(size_t(kS + 300), 0);
  for (auto [lo, hi] : sc.bad)
    for (int64_t p = lo; p < hi; ++p)
      bad[size_t(p)] = 1;
  return bad;
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

struct Inputs {
  Tensor q, k, v, dout;
};
Inputs random_inputs(DType dtype) {
  return {test::random_tensor({kB, kS, kHq, kD}, dtype, 11),
          test::random_tensor({kB, kS, kHkv, kD}, dtype, 12),
          test::random_tensor({kB, kS, kHkv, kDv}, dtype, 13),
          test::random_tensor({kB, kS, kHq, kDv}, dtype, 14)};
}
Inputs copy(const Inputs& in) {
  return {in.q.to(in.q.dtype()), in.k.to(in.k.dtype()), in.v.to(in.v.dtype()),
          in.dout.to(in.dout.dtype())};
}

// Forward, delta, and the backward kernel with one schedule.
struct Results {
  Partial fwd;
  Gradients grad;
};
Results run(const Inputs& in, const AttnSpec& spec, int64_t q_pos0, int64_t k_pos0,
            cpu::BackwardSchedule schedule) {
  Results r;
  r.fwd = attention_local(in.q, in.k, in.v, spec, q_pos0, k_pos0);
  const int64_t S = in.q.size(1), Sk = in.k.size(1);
  Tensor delta = Tensor::empty({kB, kHq, S}, DType::f32);
  cpu::attention_backward_delta(in.dout.data(), in.dout.dtype(), r.fwd.out.ptr<float>(), kB, S, kHq,
                                kDv, delta.ptr<float>());
  r.grad = {Tensor::zeros({kB, S, kHq, kD}, DType::f32),
            Tensor::zeros({kB, Sk, kHkv, kD}, DType::f32),
            Tensor::zeros({kB, Sk, kHkv, kDv}, DType::f32)};
  cpu::AttentionBlock blk;
  blk.q = in.q.data();
  blk.k = in.k.data();
  blk.v = in.v.data();
  blk.dtype = in.q.dtype();
  blk.batch = kB;
  blk.seq_q = S;
  blk.seq_k = Sk;
  blk.heads_q = kHq;
  blk.heads_kv = kHkv;
  blk.head_dim = kD;
  blk.head_dim_v = kDv;
  blk.scale = spec.scale();
  blk.mask = spec.mask;
  blk.q_pos0 = q_pos0;
  blk.k_pos0 = k_pos0;
  cpu::attention_backward(blk, in.dout.data(), r.fwd.lse.ptr<float>(), delta.ptr<float>(),
                          r.grad.dq.ptr<float>(), r.grad.dk.ptr<float>(), r.grad.dv.ptr<float>(),
                          schedule);
  return r;
}

// Bitwise equal, or NaN in both places (the schedules compute the same operations in the same
// order, garbage included).
testing::AssertionResult same_tensor(const char* what, const Tensor& a, const Tensor& b) {
  const float* x = a.ptr<float>();
  const float* y = b.ptr<float>();
  for (int64_t i = 0; i < a.numel(); ++i)
    if (!test::same_bits(x[i], y[i]) && !(std::isnan(x[i]) && std::isnan(y[i])))
      return testing::AssertionFailure()
             << what << " differs at " << i << ": " << x[i] << " vs " << y[i];
  return testing::AssertionSuccess();
}

// ---------------------------------------------------------------- hidden garbage

struct Case {
  int scenario;
  DType dtype;
};
std::string case_name(const testing::TestParamInfo<Case>& info) {
  return scenarios()[size_t(info.param.scenario)].name + "_" + dtype_name(info.param.dtype);
}

class HiddenGarbage : public testing::TestWithParam<Case> {};

// The run with garbage in the scenario's tokens (q, k, v and dout alike) against the run with
// ordinary values there: the clean rows' out, lse and dq and the clean keys' dk and dv are
// bitwise equal and finite, under both backward schedules, which also agree with each other.
TEST_P(HiddenGarbage, CleanResultsAreBitIdentical) {
  ScopedEnv env("DATTN_CHECK_FINITE", nullptr);  // garbage is the point here
  const Scenario sc = scenarios()[size_t(GetParam().scenario)];
  const DType dtype = GetParam().dtype;
  const AttnSpec spec = make_spec(sc.mask);
  const std::vector<char> bad = bad_positions(sc);
  auto q_pos = [&](int64_t row) { return sc.q_pos0 + row; };
  auto k_pos = [&](int64_t row) { return sc.k_pos0 + row; };
  const CleanSets clean = test::clean_sets(sc.mask, test::positions(sc.q_pos0, kS),
                                           test::positions(sc.k_pos0, kS), bad);

  const Inputs ordinary = random_inputs(dtype);
  Inputs garbage = copy(ordinary);
  test::poison_rows(garbage.q, bad, q_pos);
  test::poison_rows(garbage.dout, bad, q_pos);
  test::poison_rows(garbage.k, bad, k_pos);
  test::poison_rows(garbage.v, bad, k_pos);

  for (auto schedule : {cpu::BackwardSchedule::fused, cpu::BackwardSchedule::two_pass}) {
    SCOPED_TRACE(schedule == cpu::BackwardSchedule::fused ? "fused" : "two_pass");
    const Results want = run(ordinary, spec, sc.q_pos0, sc.k_pos0, schedule);
    const Results got = run(garbage, spec, sc.q_pos0, sc.k_pos0, schedule);
    int64_t rows = 0, keys = 0;
    EXPECT_TRUE(
        test::same_clean_rows("out", got.fwd.out, want.fwd.out, 1, clean.query, q_pos, &rows));
    EXPECT_TRUE(test::same_clean_rows("lse", got.fwd.lse, want.fwd.lse, 2, clean.query, q_pos));
    EXPECT_TRUE(test::same_clean_rows("dq", got.grad.dq, want.grad.dq, 1, clean.query, q_pos));
    EXPECT_TRUE(test::same_clean_rows("dk", got.grad.dk, want.grad.dk, 1, clean.key, k_pos, &keys));
    EXPECT_TRUE(test::same_clean_rows("dv", got.grad.dv, want.grad.dv, 1, clean.key, k_pos));
    EXPECT_GE(rows, 100) << "too few clean rows to compare";
    if (sc.name != "causal") {
      EXPECT_GE(keys, 100) << "too few clean keys to compare";
    }
  }
  // The schedules agree bitwise on everything, garbage included.
  const Results fused = run(garbage, spec, sc.q_pos0, sc.k_pos0, cpu::BackwardSchedule::fused);
  const Results two = run(garbage, spec, sc.q_pos0, sc.k_pos0, cpu::BackwardSchedule::two_pass);
  EXPECT_TRUE(same_tensor("dq", fused.grad.dq, two.grad.dq));
  EXPECT_TRUE(same_tensor("dk", fused.grad.dk, two.grad.dk));
  EXPECT_TRUE(same_tensor("dv", fused.grad.dv, two.grad.dv));
}

std::vector<Case> cases() {
  std::vector<Case> cs;
  for (int s = 0; s < int(scenarios().size()); ++s)
    for (DType t : {DType::f32, DType::bf16})
      cs.push_back({s, t});
  return cs;
}
INSTANTIATE_TEST_SUITE_P(Scenarios, HiddenGarbage, testing::ValuesIn(cases()), case_name);

// Queries that see no key (keys start at 300, causal): out = 0, lse = -inf, dq = 0 exactly,
// although their q and dout are NaN and inf; the API's backward too.
TEST(RowsThatSeeNothing, GiveEmptyResultsWhateverTheirInputs) {
  ScopedEnv env("DATTN_CHECK_FINITE", nullptr);  // garbage is the point here
  for (DType dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const AttnSpec spec = make_spec(Mask::causal());
    Inputs in = random_inputs(dtype);
    std::vector<char> bad(size_t(kS), 0);
    for (int64_t p = 0; p < 300; ++p)
      bad[size_t(p)] = 1;
    auto pos = [](int64_t row) { return row; };
    test::poison_rows(in.q, bad, pos);
    test::poison_rows(in.dout, bad, pos);
    const Partial fwd = attention_local(in.q, in.k, in.v, spec, 0, 300);
    const Gradients g = attention_local_backward(in.q, in.k, in.v, fwd, in.dout, spec, 0, 300);
    for (int64_t s = 0; s < 300; ++s)
      for (int64_t h = 0; h < kHq; ++h) {
        ASSERT_EQ(fwd.lse.ptr<float>()[h * kS + s], -INFINITY) << "row " << s;
        for (int64_t d = 0; d < kDv; ++d)
          ASSERT_EQ(fwd.out.ptr<float>()[(s * kHq + h) * kDv + d], 0.f) << "row " << s;
        for (int64_t d = 0; d < kD; ++d)
          ASSERT_EQ(g.dq.ptr<float>()[(s * kHq + h) * kD + d], 0.f) << "row " << s;
      }
    for (const Tensor* t : {&fwd.out, &fwd.lse, &g.dq, &g.dk, &g.dv})
      for (int64_t i = 0; i < t->numel(); ++i)
        ASSERT_FALSE(std::isnan(t->ptr<float>()[i])) << i;
  }
}

// ---------------------------------------------------------------- visible garbage propagates

// Garbage the mask shows to a row still reaches it: NaN in V of document 1 makes every out row
// of document 1 NaN (each sees at least its own key), and NaN in dout of document 1 makes every
// dv of document 1 NaN (each key is seen by its own query) — through the kernels' zeroed-copy
// paths, as those tiles are partially masked. The other documents stay bit-identical.
TEST(VisibleGarbage, ReachesTheRowsThatSeeIt) {
  ScopedEnv env("DATTN_CHECK_FINITE", nullptr);  // garbage is the point here
  const std::vector<int64_t> cu = {0, 200, 530, 800, 1100};
  const AttnSpec spec = make_spec(Mask::document(cu, true));
  std::vector<char> bad(size_t(kS), 0);
  for (int64_t p = 200; p < 530; ++p)
    bad[size_t(p)] = 1;
  auto pos = [](int64_t row) { return row; };
  std::vector<char> others(size_t(kS), 1);
  for (int64_t p = 200; p < 530; ++p)
    others[size_t(p)] = 0;
  for (DType dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const Inputs ordinary = random_inputs(dtype);
    Inputs garbage = copy(ordinary);
    for (int64_t s = 200; s < 530; ++s)
      for (int64_t e = 0; e < kHkv * kDv; ++e)
        garbage.v.set(s * kHkv * kDv + e, NAN);
    for (int64_t s = 200; s < 530; ++s)
      for (int64_t e = 0; e < kHq * kDv; ++e)
        garbage.dout.set(s * kHq * kDv + e, NAN);
    for (auto schedule : {cpu::BackwardSchedule::fused, cpu::BackwardSchedule::two_pass}) {
      const Results want = run(ordinary, spec, 0, 0, schedule);
      const Results got = run(garbage, spec, 0, 0, schedule);
      for (int64_t s = 200; s < 530; ++s) {
        for (int64_t e = 0; e < kHq * kDv; ++e)
          ASSERT_TRUE(std::isnan(got.fwd.out.ptr<float>()[s * kHq * kDv + e])) << "out row " << s;
        for (int64_t e = 0; e < kHkv * kDv; ++e)
          ASSERT_TRUE(std::isnan(got.grad.dv.ptr<float>()[s * kHkv * kDv + e])) << "dv row " << s;
      }
      EXPECT_TRUE(test::same_clean_rows("out", got.fwd.out, want.fwd.out, 1, others, pos));
      EXPECT_TRUE(test::same_clean_rows("dq", got.grad.dq, want.grad.dq, 1, others, pos));
      EXPECT_TRUE(test::same_clean_rows("dk", got.grad.dk, want.grad.dk, 1, others, pos));
      EXPECT_TRUE(test::same_clean_rows("dv", got.grad.dv, want.grad.dv, 1, others, pos));
    }
  }
}

// ---------------------------------------------------------------- the optional check

// A small problem with one non-finite value placed by the test.
struct Small {
  Tensor q, k, v, dout;
  AttnSpec spec;
};
Small small_problem() {
  Small p{test::random_tensor({2, 9, 2, 4}, DType::f32, 21),
          test::random_tensor({2, 9, 1, 4}, DType::f32, 22),
          test::random_tensor({2, 9, 1, 4}, DType::f32, 23),
          test::random_tensor({2, 9, 2, 4}, DType::f32, 24),
          {}};
  p.spec.heads_q = 2;
  p.spec.heads_kv = 1;
  p.spec.head_dim = 4;
  p.spec.mask = Mask::causal();
  return p;
}

TEST(CheckFinite, OffByDefault) {
  ScopedEnv env("DATTN_CHECK_FINITE", nullptr);
  Small p = small_problem();
  p.q.set(((1 * 9 + 5) * 2 + 1) * 4 + 3, NAN);
  p.dout.set(0, INFINITY);
  Partial fwd;
  ASSERT_NO_THROW(fwd = attention_local(p.q, p.k, p.v, p.spec, 10, 10));
  ASSERT_NO_THROW(attention_local_backward(p.q, p.k, p.v, fwd, p.dout, p.spec, 10, 10));
  // The NaN stays in its own row: the other rows are finite.
  EXPECT_TRUE(std::isnan(fwd.out.ptr<float>()[((1 * 9 + 5) * 2 + 1) * 4]));
  EXPECT_TRUE(std::isfinite(fwd.out.ptr<float>()[((1 * 9 + 4) * 2 + 1) * 4]));
  ScopedEnv zero("DATTN_CHECK_FINITE", "0");
  EXPECT_NO_THROW(attention_local(p.q, p.k, p.v, p.spec, 10, 10));
}

TEST(CheckFinite, NamesTensorPositionAndValue) {
  ScopedEnv env("DATTN_CHECK_FINITE", "1");
  {
    Small p = small_problem();
    p.q.set(((1 * 9 + 5) * 2 + 1) * 4 + 3, NAN);  // batch 1, row 5, head 1, dim 3
    EXPECT_TRUE(test::throws_naming([&] { attention_local(p.q, p.k, p.v, p.spec, 10, 10); },
                                    {"invalid q = nan", "batch 1", "position 15", "local row 5",
                                     "head 1", "dim 3", "DATTN_CHECK_FINITE"}));
  }
  {
    Small p = small_problem();
    p.k.set((0 * 9 + 2) * 4 + 1, -INFINITY);
    p.k.set((1 * 9 + 0) * 4 + 0, NAN);  // later in memory: the first one is named
    EXPECT_TRUE(
        test::throws_naming([&] { attention_local(p.q, p.k, p.v, p.spec, 0, 7); },
                            {"invalid k = -inf", "batch 0", "position 9", "head 0", "dim 1"}));
  }
  {
    Small p = small_problem();
    p.v.set((1 * 9 + 8) * 4 + 2, INFINITY);
    EXPECT_TRUE(test::throws_naming([&] { attention_local(p.q, p.k, p.v, p.spec); },
                                    {"invalid v = inf", "batch 1", "position 8", "dim 2"}));
  }
  {
    Small p = small_problem();
    const Partial fwd = attention_local(p.q, p.k, p.v, p.spec);
    p.dout.set(((0 * 9 + 3) * 2 + 0) * 4 + 0, NAN);
    EXPECT_TRUE(test::throws_naming(
        [&] { attention_local_backward(p.q, p.k, p.v, fwd, p.dout, p.spec, 100, 100); },
        {"invalid dout = nan", "position 103", "head 0", "dim 0"}));
  }
  {  // bf16 and fp16 storage: their own exponent bits
    for (DType t : {DType::bf16, DType::f16}) {
      Small p = small_problem();
      p.q = p.q.to(t);
      p.k = p.k.to(t);
      p.v = p.v.to(t);
      p.k.set((1 * 9 + 4) * 4 + 2, INFINITY);
      EXPECT_TRUE(test::throws_naming([&] { attention_local(p.q, p.k, p.v, p.spec); },
                                      {"invalid k = inf", "batch 1", "position 4", "dim 2"}))
          << dtype_name(t);
    }
  }
  {  // finite inputs pass, the largest finite values included
    Small p = small_problem();
    p.q.set(0, 3.0e38f);
    p.k.set(0, -3.0e38f);
    EXPECT_NO_THROW(attention_local(p.q, p.k, p.v, p.spec));
  }
}

TEST(CheckFinite, BadEnvironmentValueIsNamed) {
  ScopedEnv env("DATTN_CHECK_FINITE", "yes");
  Small p = small_problem();
  EXPECT_TRUE(test::throws_naming([&] { attention_local(p.q, p.k, p.v, p.spec); },
                                  {"DATTN_CHECK_FINITE", "yes", "0 or 1"}));
}

}  // namespace
}  // namespace dattn
