// Single-process tests of the CPU attention kernel (dattn::cpu::attention_forward) and of
// dattn::attention_local against the float64 reference: shapes straddling the tiles, GQA, D_v != D,
// dtypes, offsets and strides, empty rows, sub-ranges and accumulation over key blocks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/attention_cpu.h"
#include "kernels/cpu/progress.h"
#include "kernels/cpu/reference.h"
#include "kernels/merge.h"
#include "src/attention.h"
#include "src/base/error.h"
#include "tests/test_reference.h"

namespace dattn {
namespace {

using test::matches_reference;
using test::random_tensor;
using test::tolerance_for;

// ---------------------------------------------------------------- one kernel problem

struct KernelCase {
  std::string name;
  int64_t B = 1, Sq = 0, Sk = 0, Hq = 1, Hkv = 1, D = 64, Dv = 0;
  bool causal = false;
  DType dtype = DType::f32;
  int64_t q_pos0 = 0, k_pos0 = 0;
  float scale = 0.f;     // 0: 1/sqrt(D)
  float q_stddev = 1.f;  // > 1 sharpens the softmax
};

std::ostream& operator<<(std::ostream& os, const KernelCase& c) {
  return os << c.name;
}

struct Problem {
  Tensor q, k, v;
  AttnSpec spec;
};

Problem make_problem(const KernelCase& c, uint64_t seed = 1) {
  Problem p;
  p.spec.heads_q = c.Hq;
  p.spec.heads_kv = c.Hkv;
  p.spec.head_dim = c.D;
  p.spec.head_dim_v = c.Dv;
  p.spec.softmax_scale = c.scale;
  p.spec.mask = c.causal ? Mask::causal() : Mask::none();
  const int64_t dv = p.spec.dim_v();
  p.q = random_tensor({c.B, c.Sq, c.Hq, c.D}, c.dtype, seed * 3 + 0, c.q_stddev);
  p.k = random_tensor({c.B, c.Sk, c.Hkv, c.D}, c.dtype, seed * 3 + 1);
  p.v = random_tensor({c.B, c.Sk, c.Hkv, dv}, c.dtype, seed * 3 + 2);
  return p;
}

cpu::AttentionBlock make_block(const Problem& p) {
  cpu::AttentionBlock blk;
  blk.q = p.q.data();
  blk.k = p.k.data();
  blk.v = p.v.data();
  blk.dtype = p.q.dtype();
  blk.batch = p.q.size(0);
  blk.seq_q = p.q.size(1);
  blk.seq_k = p.k.size(1);
  blk.heads_q = p.spec.heads_q;
  blk.heads_kv = p.spec.heads_kv;
  blk.head_dim = p.spec.head_dim;
  blk.head_dim_v = p.spec.dim_v();
  blk.scale = p.spec.scale();
  blk.mask = p.spec.mask;
  return blk;
}

// An empty partial for p's queries.
struct PartialBuf {
  std::vector<float> out, lse;
  PartialBuf(int64_t B, int64_t S, int64_t H, int64_t Dv)
      : out(size_t(B * S * H * Dv)), lse(size_t(B * H * S)) {
    clear_partial(out.data(), lse.data(), B, S, H, Dv);
  }
  explicit PartialBuf(const Problem& p)
      : PartialBuf(p.q.size(0), p.q.size(1), p.spec.heads_q, p.spec.dim_v()) {}
};

// Bitwise equality of two float arrays (NaN-safe, -0 != +0 would be a difference too).
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ---------------------------------------------------------------- the case table

std::vector<KernelCase> kernel_cases() {
  std::vector<KernelCase> cs;
  auto add = [&](KernelCase c) { cs.push_back(c); };
  // name, B, Sq, Sk, Hq, Hkv, D, Dv, causal, dtype, q_pos0, k_pos0, scale, q_stddev
  add({"S1_D64_causal_f32", 1, 1, 1, 1, 1, 64, 0, true, DType::f32});
  add({"S77_D80_gqa4_f32", 1, 77, 77, 4, 1, 80, 0, false, DType::f32});
  add({"S77_D80_gqa4_causal_bf16", 1, 77, 77, 4, 1, 80, 0, true, DType::bf16});
  add({"S300_D128_causal_f32", 1, 300, 300, 2, 2, 128, 0, true, DType::f32});
  add({"S300_D128_bf16", 1, 300, 300, 2, 2, 128, 0, false, DType::bf16});
  add({"S513_D64_gqa2_causal_bf16", 1, 513, 513, 2, 1, 64, 0, true, DType::bf16});
  add({"S513_D64_f32", 1, 513, 513, 1, 1, 64, 0, false, DType::f32});
  add({"S130_D256_gqa8_causal_bf16", 1, 130, 130, 8, 1, 256, 0, true, DType::bf16});
  add({"S129_D256_gqa4_f32", 1, 129, 129, 4, 1, 256, 0, false, DType::f32});
  add({"S200_D192_Dv128_causal_f32", 1, 200, 200, 2, 2, 192, 128, true, DType::f32});
  add({"S200_D192_Dv128_gqa2_bf16", 1, 200, 200, 2, 1, 192, 128, false, DType::bf16});
  add({"S257_D64_Dv32_causal_f16", 1, 257, 257, 2, 2, 64, 32, true, DType::f16});
  add({"S257_D128_f16", 1, 257, 257, 2, 2, 128, 0, false, DType::f16});
  add({"B2_S150_D64_gqa2_causal_f32", 2, 150, 150, 4, 2, 64, 0, true, DType::f32});
  add({"B3_S40_D80_bf16", 3, 40, 40, 2, 2, 80, 0, false, DType::bf16});
  // Queries later in the sequence than the first keys (a causal shard meeting earlier shards).
  add({"Sq100_at1000_Sk1100_causal_f32", 1, 100, 1100, 2, 1, 64, 0, true, DType::f32, 1000, 0});
  add({"Sq1_at599_Sk600_gqa8_causal_bf16", 1, 1, 600, 8, 1, 128, 0, true, DType::bf16, 599, 0});
  add({"Sq260_Sk33_noncausal_f32", 1, 260, 33, 2, 2, 64, 0, false, DType::f32, 0, 0});
  // Rows 0..149 see no key: out exactly 0, lse exactly -inf.
  add({"Sq300_Sk200_keys_from150_causal_f32", 1, 300, 200, 2, 1, 64, 0, true, DType::f32, 0, 150});
  add({"Sq130_Sk300_keys_from64_causal_bf16", 1, 130, 300, 2, 2, 80, 0, true, DType::bf16, 0, 64});
  // Keys entirely in the future: the whole partial stays empty.
  add({"keys_in_future_causal_f32", 1, 50, 60, 2, 2, 64, 0, true, DType::f32, 0, 100});
  add({"keys_in_future_causal_bf16", 1, 140, 270, 2, 1, 64, 0, true, DType::bf16, 1000, 1140});
  // An explicit scale and sharp scores (softmax dominated by a few keys; large lse).
  add({"S300_sharp_scale0p3_causal_f32", 1, 300, 300, 2, 2, 64, 0, true, DType::f32, 0, 0, 0.3f,
       4.f});
  add({"S300_sharp_bf16", 1, 300, 300, 2, 2, 128, 0, false, DType::bf16, 0, 0, 0.f, 3.f});
  // Exact tile multiples, and causal tile boundaries one position either side of "all visible".
  add({"S256_exact_tiles_causal_f32", 1, 256, 256, 1, 1, 64, 0, true, DType::f32});
  // Several query tiles (256) and key tiles (512), the last ones partial.
  add({"S1100_D64_causal_f32", 1, 1100, 1100, 1, 1, 64, 0, true, DType::f32});
  add({"S1100_D64_gqa4_bf16", 1, 1100, 1100, 4, 1, 64, 0, false, DType::bf16});
  add({"Sq128_at255_Sk512_causal_f32", 1, 128, 512, 2, 1, 64, 0, true, DType::f32, 255, 0});
  add({"Sq128_at254_Sk512_causal_f32", 1, 128, 512, 2, 1, 64, 0, true, DType::f32, 254, 0});
  add({"Sq129_at256_Sk513_causal_bf16", 1, 129, 513, 2, 2, 64, 0, true, DType::bf16, 256, 0});
  // Huge scores (|s| ~ 1e3): exp must never see them unshifted (no overflow, no NaN).
  add({"S260_huge_scores_causal_f32", 1, 260, 260, 2, 1, 64, 0, true, DType::f32, 0, 0, 0.f,
       100.f});
  add({"S140_huge_scores_bf16", 1, 140, 300, 2, 2, 64, 0, false, DType::bf16, 0, 0, 0.f, 100.f});
  return cs;
}

class KernelVsReference : public testing::TestWithParam<KernelCase> {};

TEST_P(KernelVsReference, AttentionForward) {
  const KernelCase& c = GetParam();
  Problem p = make_problem(c);
  cpu::AttentionBlock blk = make_block(p);
  blk.q_pos0 = c.q_pos0;
  blk.k_pos0 = c.k_pos0;
  PartialBuf part(p);
  cpu::attention_forward(blk, part.out.data(), part.lse.data());
  auto ref = cpu::attention_reference(p.q, p.k, p.v, p.spec, c.q_pos0, c.k_pos0);
  EXPECT_TRUE(matches_reference(part.out.data(), part.lse.data(), c.B, c.Sq, c.Hq, p.spec.dim_v(),
                                ref, tolerance_for(c.dtype)));
}

TEST_P(KernelVsReference, AttentionLocal) {
  const KernelCase& c = GetParam();
  Problem p = make_problem(c, 7);
  Partial r = attention_local(p.q, p.k, p.v, p.spec, c.q_pos0, c.k_pos0);
  const int64_t dv = p.spec.dim_v();
  ASSERT_EQ(r.out.dtype(), DType::f32);
  ASSERT_EQ(r.lse.dtype(), DType::f32);
  ASSERT_EQ(r.out.dim(), 4);
  ASSERT_EQ(r.lse.dim(), 3);
  EXPECT_EQ(r.out.size(0), c.B);
  EXPECT_EQ(r.out.size(1), c.Sq);
  EXPECT_EQ(r.out.size(2), c.Hq);
  EXPECT_EQ(r.out.size(3), dv);
  EXPECT_EQ(r.lse.size(0), c.B);
  EXPECT_EQ(r.lse.size(1), c.Hq);
  EXPECT_EQ(r.lse.size(2), c.Sq);
  auto ref = cpu::attention_reference(p.q, p.k, p.v, p.spec, c.q_pos0, c.k_pos0);
  EXPECT_TRUE(matches_reference(r.out.ptr<float>(), r.lse.ptr<float>(), c.B, c.Sq, c.Hq, dv, ref,
                                tolerance_for(c.dtype)));
}

INSTANTIATE_TEST_SUITE_P(Cases, KernelVsReference, testing::ValuesIn(kernel_cases()),
                         [](const testing::TestParamInfo<KernelCase>& info) {
                           return info.param.name;
                         });

// ---------------------------------------------------------------- bf16/fp16 error budget

// DESIGN: for bf16/fp16 the error is bounded by a small multiple of that of a plain same-dtype
// computation. The kernel reads the stored values exactly and accumulates in fp32, so it must do
// far better than merely storing the exact result in the dtype (the error of any plain bf16/fp16
// computation is at least that): here, 50x better.
TEST(KernelErrorBudget, FarBelowAPlainSameDtypeComputation) {
  for (DType dt : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dt));
    KernelCase c{"budget", 1, 200, 200, 4, 2, 128, 0, true, dt};
    Problem p = make_problem(c, 15);
    Partial r = attention_local(p.q, p.k, p.v, p.spec);
    auto ref = cpu::attention_reference(p.q, p.k, p.v, p.spec);
    double kernel_err = 0, plain_err = 0;
    for (size_t i = 0; i < ref.out.size(); ++i) {
      kernel_err = std::max(kernel_err, std::fabs(double(r.out.get(int64_t(i))) - ref.out[i]));
      const float f = float(ref.out[i]);
      const double stored = dt == DType::bf16 ? to_float(to_bf16(f)) : to_float(to_f16(f));
      plain_err = std::max(plain_err, std::fabs(stored - ref.out[i]));
    }
    if (test::print_errors())
      std::printf("[budget] %s kernel %.3g plain %.3g\n", dtype_name(dt), kernel_err, plain_err);
    EXPECT_GT(plain_err, 0.0);
    EXPECT_LT(kernel_err, plain_err / 50) << "kernel " << kernel_err << ", plain " << plain_err;
  }
}

// attention_local validates its tensors against the spec like attention() does.
TEST(AttentionLocal, RejectsBadShapes) {
  KernelCase c{"bad", 1, 10, 10, 4, 2, 64, 0, false, DType::f32};
  Problem p = make_problem(c, 16);
  auto throws_naming = [](auto&& f, const std::string& needle) -> testing::AssertionResult {
    try {
      f();
    } catch (const Error& e) {
      if (std::string(e.what()).find(needle) != std::string::npos)
        return testing::AssertionSuccess();
      return testing::AssertionFailure() << "what() lacks '" << needle << "': " << e.what();
    }
    return testing::AssertionFailure() << "did not throw";
  };
  Tensor k_bad = random_tensor({1, 10, 2, 32}, DType::f32, 1);
  EXPECT_TRUE(throws_naming([&] { attention_local(p.q, k_bad, p.v, p.spec); }, "head_dim"));
  AttnSpec s = p.spec;
  s.heads_kv = 3;
  EXPECT_TRUE(throws_naming([&] { attention_local(p.q, p.k, p.v, s); }, "heads_q"));
  Tensor v_bf = p.v.to(DType::bf16);
  EXPECT_TRUE(throws_naming([&] { attention_local(p.q, p.k, v_bf, p.spec); }, "dtype"));
}

// ---------------------------------------------------------------- the references agree

// The independent float64 attention of these tests agrees with the library's reference, so a
// bug in one would show.
TEST(Reference, MatchesIndependentFloat64) {
  KernelCase c{"ref", 2, 70, 90, 4, 2, 48, 40, true, DType::bf16, 0, 20};
  Problem p = make_problem(c, 11);
  auto a = cpu::attention_reference(p.q, p.k, p.v, p.spec, c.q_pos0, c.k_pos0);
  auto b = test::naive_reference(p.q, p.k, p.v, p.spec, test::positions(c.q_pos0, c.Sq),
                                 test::positions(c.k_pos0, c.Sk));
  ASSERT_EQ(a.out.size(), b.out.size());
  ASSERT_EQ(a.lse.size(), b.lse.size());
  for (size_t i = 0; i < a.out.size(); ++i)
    ASSERT_NEAR(a.out[i], b.out[i], 1e-12) << i;
  int empty = 0;
  for (size_t i = 0; i < a.lse.size(); ++i) {
    if (std::isinf(b.lse[i])) {
      ++empty;
      ASSERT_EQ(a.lse[i], b.lse[i]) << i;
    } else {
      ASSERT_NEAR(a.lse[i], b.lse[i], 1e-12) << i;
    }
  }
  EXPECT_GT(empty, 0);  // queries at 0..19 see no key (keys start at 20)
}

// ---------------------------------------------------------------- empty rows and blocks

// Causal, keys starting after the first queries: the rows before the first key are exactly empty
// (out == 0, lse == -inf, no NaN), the others match the reference.
TEST(KernelEmptyRows, RowsBeforeFirstKeyAreExactlyEmpty) {
  KernelCase c{"e", 1, 200, 150, 4, 2, 64, 0, true, DType::f32, 0, 90};
  Problem p = make_problem(c, 3);
  cpu::AttentionBlock blk = make_block(p);
  blk.k_pos0 = c.k_pos0;
  PartialBuf part(p);
  cpu::attention_forward(blk, part.out.data(), part.lse.data());
  for (int64_t h = 0; h < c.Hq; ++h) {
    for (int64_t s = 0; s < c.Sq; ++s) {
      const float l = part.lse[size_t(h * c.Sq + s)];
      if (s < c.k_pos0) {
        ASSERT_EQ(l, -INFINITY) << "h=" << h << " s=" << s;
        for (int64_t d = 0; d < c.D; ++d)
          ASSERT_EQ(part.out[size_t((s * c.Hq + h) * c.D + d)], 0.f) << "s=" << s << " d=" << d;
      } else {
        ASSERT_TRUE(std::isfinite(l)) << "h=" << h << " s=" << s << " lse=" << l;
      }
    }
  }
  auto ref = cpu::attention_reference(p.q, p.k, p.v, p.spec, 0, c.k_pos0);
  EXPECT_TRUE(matches_reference(part.out.data(), part.lse.data(), c.B, c.Sq, c.Hq, c.D, ref,
                                tolerance_for(c.dtype)));
}

// A block whose keys all lie in the queries' future leaves a non-empty partial bit-for-bit
// unchanged (and is skipped, not computed with a -inf mask that could produce NaN).
TEST(KernelEmptyRows, FutureKeysLeaveAPartialUnchanged) {
  KernelCase c{"f", 2, 150, 300, 4, 1, 64, 0, true, DType::bf16};
  Problem p = make_problem(c, 5);
  cpu::AttentionBlock blk = make_block(p);
  PartialBuf part(p);
  blk.k_len = 150;  // keys 0..149 at positions 0..149: every row sees some
  cpu::attention_forward(blk, part.out.data(), part.lse.data());
  const std::vector<float> out0 = part.out, lse0 = part.lse;
  blk.k_begin = 150;
  blk.k_len = -1;    // the rest
  blk.k_pos0 = 150;  // at positions 150.., all after every query (0..149)
  cpu::attention_forward(blk, part.out.data(), part.lse.data());
  EXPECT_TRUE(same_bits(part.out, out0));
  EXPECT_TRUE(same_bits(part.lse, lse0));
}

// Zero keys (k_len = 0, or a key tensor of length 0): nothing changes.
TEST(KernelEmptyRows, ZeroKeys) {
  KernelCase c{"z", 1, 20, 10, 2, 2, 64, 0, false, DType::f32};
  Problem p = make_problem(c, 6);
  cpu::AttentionBlock blk = make_block(p);
  PartialBuf part(p);
  blk.k_len = 0;
  cpu::attention_forward(blk, part.out.data(), part.lse.data());
  PartialBuf empty(p);
  EXPECT_TRUE(same_bits(part.out, empty.out));
  EXPECT_TRUE(same_bits(part.lse, empty.lse));

  Tensor k0 = Tensor::empty({1, 0, 2, 64}, DType::f32);
  Tensor v0 = Tensor::empty({1, 0, 2, 64}, DType::f32);
  Partial r = attention_local(p.q, k0, v0, p.spec);
  ASSERT_EQ(r.lse.numel(), 2 * 20);
  for (int64_t i = 0; i < r.lse.numel(); ++i)
    ASSERT_EQ(r.lse.get(i), -INFINITY) << i;
  for (int64_t i = 0; i < r.out.numel(); ++i)
    ASSERT_EQ(r.out.get(i), 0.f) << i;
}

// ---------------------------------------------------------------- accumulation

// Attending to the keys in two (or three) blocks into the same partial equals one pass over all
// keys, in either order.
TEST(KernelAccumulation, TwoKeyHalvesEqualOnePass) {
  for (bool causal : {false, true}) {
    for (bool reverse : {false, true}) {
      SCOPED_TRACE(testing::Message() << "causal=" << causal << " reverse=" << reverse);
      KernelCase c{"acc", 1, 300, 300, 4, 2, 80, 0, causal, DType::f32};
      Problem p = make_problem(c, 8);
      cpu::AttentionBlock blk = make_block(p);
      PartialBuf part(p);
      const int64_t half = 137;  // not a tile multiple
      auto run = [&](int64_t begin, int64_t len) {
        blk.k_begin = begin;
        blk.k_len = len;
        blk.k_pos0 = begin;
        cpu::attention_forward(blk, part.out.data(), part.lse.data());
      };
      if (!reverse) {
        run(0, half);
        run(half, -1);
      } else {
        run(half, c.Sk - half);
        run(0, half);
      }
      PartialBuf one(p);
      cpu::AttentionBlock all = make_block(p);
      cpu::attention_forward(all, one.out.data(), one.lse.data());
      auto ref = cpu::attention_reference(p.q, p.k, p.v, p.spec);
      EXPECT_TRUE(matches_reference(part.out.data(), part.lse.data(), 1, c.Sq, c.Hq, c.D, ref,
                                    tolerance_for(c.dtype)));
      EXPECT_TRUE(matches_reference(one.out.data(), one.lse.data(), 1, c.Sq, c.Hq, c.D, ref,
                                    tolerance_for(c.dtype)));
      // Two passes and one agree to fp32 rounding of the merge.
      for (size_t i = 0; i < one.lse.size(); ++i)
        ASSERT_NEAR(part.lse[i], one.lse[i], 1e-5 * (1 + std::fabs(one.lse[i]))) << i;
      for (size_t i = 0; i < one.out.size(); ++i)
        ASSERT_NEAR(part.out[i], one.out[i], 2e-5 * (1 + std::fabs(one.out[i]))) << i;
    }
  }
}

// The progress hook (kernels/cpu/progress.h): the calling thread calls it between its key tiles
// while a ProgressScope sets it, and not after; the result is the same bits as without it.
TEST(KernelProgressHook, CalledBetweenTilesOnTheCallingThread) {
  KernelCase c{"hook", 1, 600, 1500, 4, 2, 64, 0, true, DType::f32};  // 3 query x 3 key tiles
  Problem p = make_problem(c, 9);
  struct Count {
    std::thread::id caller = std::this_thread::get_id();
    int calls = 0, elsewhere = 0;
  } count;
  const cpu::ProgressHook hook{[](void* arg) {
                                 auto* n = static_cast<Count*>(arg);
                                 if (std::this_thread::get_id() == n->caller)
                                   ++n->calls;
                                 else
                                   ++n->elsewhere;
                               },
                               &count};
  PartialBuf with(p), without(p);
  {
    const cpu::ProgressScope scope(hook);
    cpu::attention_forward(make_block(p), with.out.data(), with.lse.data());
  }
  EXPECT_GE(count.calls, 1);
  EXPECT_EQ(count.elsewhere, 0);
  const int calls = count.calls;
  cpu::attention_forward(make_block(p), without.out.data(), without.lse.data());
  EXPECT_EQ(count.calls, calls);  // the scope ended: no hook
  EXPECT_EQ(std::memcmp(with.out.data(), without.out.data(), with.out.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(with.lse.data(), without.lse.data(), with.lse.size() * sizeof(float)), 0);
}

TEST(KernelAccumulation, ThreeUnevenBlocksCausalBf16) {
  KernelCase c{"acc3", 2, 260, 520, 2, 1, 64, 64, true, DType::bf16, 260, 0};
  Problem p = make_problem(c, 9);
  cpu::AttentionBlock blk = make_block(p);
  blk.q_pos0 = c.q_pos0;
  PartialBuf part(p);
  const int64_t cuts[] = {0, 1, 300, 520};
  for (int i : {2, 0, 1}) {
    blk.k_begin = cuts[i];
    blk.k_len = cuts[i + 1] - cuts[i];
    blk.k_pos0 = cuts[i];
    cpu::attention_forward(blk, part.out.data(), part.lse.data());
  }
  auto ref = cpu::attention_reference(p.q, p.k, p.v, p.spec, c.q_pos0, 0);
  EXPECT_TRUE(matches_reference(part.out.data(), part.lse.data(), c.B, c.Sq, c.Hq, c.D, ref,
                                tolerance_for(c.dtype)));
}

// ---------------------------------------------------------------- strides and sub-ranges

// Query and key rows at strided global positions (as in striped or zigzag layouts); the mask is
// evaluated on those positions.
TEST(KernelPositions, StridedPositions) {
  struct S {
    int64_t qp0, qs, kp0, ks;
  };
  for (S s : {S{1, 2, 0, 2}, S{0, 3, 1, 3}, S{500, 4, 2, 5}, S{7, 1, 0, 2}}) {
    SCOPED_TRACE(testing::Message()
                 << "q " << s.qp0 << "+i*" << s.qs << ", k " << s.kp0 << "+j*" << s.ks);
    KernelCase c{"stride", 1, 150, 280, 4, 2, 64, 0, true, DType::f32};
    Problem p = make_problem(c, 12);
    cpu::AttentionBlock blk = make_block(p);
    blk.q_pos0 = s.qp0;
    blk.q_pos_stride = s.qs;
    blk.k_pos0 = s.kp0;
    blk.k_pos_stride = s.ks;
    PartialBuf part(p);
    cpu::attention_forward(blk, part.out.data(), part.lse.data());
    auto ref = test::naive_reference(p.q, p.k, p.v, p.spec, test::positions(s.qp0, c.Sq, s.qs),
                                     test::positions(s.kp0, c.Sk, s.ks));
    EXPECT_TRUE(matches_reference(part.out.data(), part.lse.data(), c.B, c.Sq, c.Hq, c.D, ref,
                                  tolerance_for(c.dtype)));
  }
}

// A block over rows [q_begin, q_begin + q_len) x [k_begin, k_begin + k_len): those query rows
// match the reference over the sliced tensors; every other row of the partial is untouched.
TEST(KernelPositions, RowSubRanges) {
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    KernelCase c{"sub", 2, 160, 300, 4, 1, 64, 48, true, dt};
    Problem p = make_problem(c, 13);
    const int64_t qb = 5, ql = 140, kb = 7, kl = 270, qp0 = 300, kp0 = 100;
    cpu::AttentionBlock blk = make_block(p);
    blk.q_begin = qb;
    blk.q_len = ql;
    blk.k_begin = kb;
    blk.k_len = kl;
    blk.q_pos0 = qp0;
    blk.k_pos0 = kp0;
    const int64_t dv = 48;
    PartialBuf part(p);
    // Rows outside the block hold a sentinel partial that must survive bit for bit.
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t s = 0; s < c.Sq; ++s) {
        if (s >= qb && s < qb + ql) continue;
        for (int64_t h = 0; h < c.Hq; ++h) {
          part.lse[size_t((b * c.Hq + h) * c.Sq + s)] = 1.5f + float(s);
          for (int64_t d = 0; d < dv; ++d)
            part.out[size_t(((b * c.Sq + s) * c.Hq + h) * dv + d)] = float(d) - 0.25f;
        }
      }
    const std::vector<float> out0 = part.out, lse0 = part.lse;
    cpu::attention_forward(blk, part.out.data(), part.lse.data());

    auto ref =
        test::naive_reference(p.q.seq_slice(qb, ql), p.k.seq_slice(kb, kl), p.v.seq_slice(kb, kl),
                              p.spec, test::positions(qp0, ql), test::positions(kp0, kl));
    // Pull the block's rows out of the partial into their own [B, ql, ...] arrays.
    std::vector<float> out_blk(size_t(c.B * ql * c.Hq * dv)), lse_blk(size_t(c.B * c.Hq * ql));
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t i = 0; i < ql; ++i)
        for (int64_t h = 0; h < c.Hq; ++h) {
          lse_blk[size_t((b * c.Hq + h) * ql + i)] =
              part.lse[size_t((b * c.Hq + h) * c.Sq + qb + i)];
          for (int64_t d = 0; d < dv; ++d)
            out_blk[size_t(((b * ql + i) * c.Hq + h) * dv + d)] =
                part.out[size_t(((b * c.Sq + qb + i) * c.Hq + h) * dv + d)];
        }
    EXPECT_TRUE(matches_reference(out_blk.data(), lse_blk.data(), c.B, ql, c.Hq, dv, ref,
                                  tolerance_for(dt)));
    // Everything outside the block: unchanged.
    int64_t changed = 0;
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t s = 0; s < c.Sq; ++s) {
        if (s >= qb && s < qb + ql) continue;
        for (int64_t h = 0; h < c.Hq; ++h) {
          size_t l = size_t((b * c.Hq + h) * c.Sq + s);
          if (std::memcmp(&part.lse[l], &lse0[l], 4) != 0) ++changed;
          for (int64_t d = 0; d < dv; ++d) {
            size_t o = size_t(((b * c.Sq + s) * c.Hq + h) * dv + d);
            if (std::memcmp(&part.out[o], &out0[o], 4) != 0) ++changed;
          }
        }
      }
    EXPECT_EQ(changed, 0) << "values outside the block's query rows were written";
  }
}

// Several query tiles over a sub-range of the keys, with more than one kv head: the forward
// packs K and V once for the call where its tiles would copy or widen them per tile pair
// (attention_cpu.cpp). The same block run one query tile at a time (one tile: no pack) gives the
// same bits, and both match the reference.
TEST(KernelPositions, PackedKeysGiveTheSameBitsAsOneTileAtATime) {
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    for (bool causal : {false, true}) {
      SCOPED_TRACE(testing::Message() << dtype_name(dt) << " causal=" << causal);
      KernelCase c{"pack", 2, 600, 620, 4, 2, 64, 48, causal, dt};
      Problem p = make_problem(c, 21);
      const int64_t qb = 5, ql = 590, kb = 7, kl = 560, tile = cpu::kTileQ;
      cpu::AttentionBlock blk = make_block(p);
      blk.q_begin = qb, blk.q_len = ql, blk.k_begin = kb, blk.k_len = kl;
      blk.q_pos0 = 40, blk.k_pos0 = 0;  // causal: the first rows see part of the keys
      PartialBuf whole(p), tiles(p);
      cpu::attention_forward(blk, whole.out.data(), whole.lse.data());
      for (int64_t i0 = 0; i0 < ql; i0 += tile) {
        cpu::AttentionBlock one = blk;
        one.q_begin = qb + i0;
        one.q_len = std::min(tile, ql - i0);
        one.q_pos0 = blk.q_pos0 + i0;
        cpu::attention_forward(one, tiles.out.data(), tiles.lse.data());
      }
      EXPECT_TRUE(same_bits(whole.out, tiles.out));
      EXPECT_TRUE(same_bits(whole.lse, tiles.lse));

      auto ref =
          test::naive_reference(p.q.seq_slice(qb, ql), p.k.seq_slice(kb, kl), p.v.seq_slice(kb, kl),
                                p.spec, test::positions(40, ql), test::positions(0, kl));
      std::vector<float> out_blk(size_t(c.B * ql * c.Hq * c.Dv)), lse_blk(size_t(c.B * c.Hq * ql));
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t i = 0; i < ql; ++i)
          for (int64_t h = 0; h < c.Hq; ++h) {
            lse_blk[size_t((b * c.Hq + h) * ql + i)] =
                whole.lse[size_t((b * c.Hq + h) * c.Sq + qb + i)];
            for (int64_t d = 0; d < c.Dv; ++d)
              out_blk[size_t(((b * ql + i) * c.Hq + h) * c.Dv + d)] =
                  whole.out[size_t(((b * c.Sq + qb + i) * c.Hq + h) * c.Dv + d)];
          }
      EXPECT_TRUE(matches_reference(out_blk.data(), lse_blk.data(), c.B, ql, c.Hq, c.Dv, ref,
                                    tolerance_for(dt)));
    }
  }
}

// q_len / k_len < 0 mean "to the end"; zero-length blocks (q_len = 0, or k_begin = seq_k with
// k_len = -1) change nothing.
TEST(KernelPositions, ToTheEndAndZeroLength) {
  KernelCase c{"end", 1, 170, 280, 2, 1, 64, 0, true, DType::f32};
  Problem p = make_problem(c, 17);
  const int64_t qb = 30, kb = 20;
  cpu::AttentionBlock blk = make_block(p);
  blk.q_begin = qb;  // q_len = -1: rows 30..169 at positions 100..239
  blk.q_pos0 = 100;
  blk.k_begin = kb;  // k_len = -1: rows 20..279 at positions 0..259
  PartialBuf part(p);
  cpu::attention_forward(blk, part.out.data(), part.lse.data());
  auto ref = cpu::attention_reference(p.q.seq_slice(qb, c.Sq - qb), p.k.seq_slice(kb, c.Sk - kb),
                                      p.v.seq_slice(kb, c.Sk - kb), p.spec, 100, 0);
  // Rows before qb stay empty; rows from qb on match.
  for (int64_t h = 0; h < c.Hq; ++h)
    for (int64_t s = 0; s < qb; ++s)
      ASSERT_EQ(part.lse[size_t(h * c.Sq + s)], -INFINITY);
  std::vector<float> out(size_t((c.Sq - qb) * c.Hq * c.D)), lse(size_t(c.Hq * (c.Sq - qb)));
  std::memcpy(out.data(), part.out.data() + qb * c.Hq * c.D, out.size() * sizeof(float));
  for (int64_t h = 0; h < c.Hq; ++h)
    for (int64_t s = qb; s < c.Sq; ++s)
      lse[size_t(h * (c.Sq - qb) + s - qb)] = part.lse[size_t(h * c.Sq + s)];
  EXPECT_TRUE(matches_reference(out.data(), lse.data(), 1, c.Sq - qb, c.Hq, c.D, ref,
                                tolerance_for(c.dtype)));

  const std::vector<float> out0 = part.out, lse0 = part.lse;
  cpu::AttentionBlock none = make_block(p);
  none.q_len = 0;
  cpu::attention_forward(none, part.out.data(), part.lse.data());
  none = make_block(p);
  none.k_begin = c.Sk;
  cpu::attention_forward(none, part.out.data(), part.lse.data());
  EXPECT_TRUE(same_bits(part.out, out0));
  EXPECT_TRUE(same_bits(part.lse, lse0));
}

// The kernel merges into a partial that already holds keys from elsewhere: first the reference
// partial of the first keys (computed in float64, stored fp32), then the kernel on the rest.
TEST(KernelAccumulation, MergesIntoAnExistingPartial) {
  KernelCase c{"m", 1, 140, 400, 2, 2, 64, 0, true, DType::f32, 260, 0};
  Problem p = make_problem(c, 14);
  const int64_t split = 200;
  auto first = cpu::attention_reference(p.q, p.k.seq_slice(0, split), p.v.seq_slice(0, split),
                                        p.spec, c.q_pos0, 0);
  PartialBuf part(p);
  for (size_t i = 0; i < part.out.size(); ++i)
    part.out[i] = float(first.out[i]);
  for (size_t i = 0; i < part.lse.size(); ++i)
    part.lse[i] = float(first.lse[i]);
  cpu::AttentionBlock blk = make_block(p);
  blk.q_pos0 = c.q_pos0;
  blk.k_begin = split;
  blk.k_pos0 = split;
  cpu::attention_forward(blk, part.out.data(), part.lse.data());
  auto ref = cpu::attention_reference(p.q, p.k, p.v, p.spec, c.q_pos0, 0);
  EXPECT_TRUE(matches_reference(part.out.data(), part.lse.data(), 1, c.Sq, c.Hq, c.D, ref,
                                tolerance_for(c.dtype)));
}

}  // namespace
}  // namespace dattn
