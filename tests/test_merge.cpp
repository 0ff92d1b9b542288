// Single-process tests of the partial merge (kernels/merge.h: merge_row, merge_partials,
// clear_partial) against the float64 reference, and of the storage dtype conversions
// (src/base/dtype.h: bf16/fp16 round to nearest even, inf, NaN, subnormals, names).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/reference.h"
#include "kernels/merge.h"
#include "src/base/dtype.h"
#include "src/base/error.h"
#include "tests/test_reference.h"

namespace dattn {
namespace {

using test::matches_reference;
using test::tolerance_for;

// ---------------------------------------------------------------- helpers

struct Halves {
  int64_t B = 2, Sq = 90, Sk = 160, Hq = 4, Hkv = 2, D = 64, Dv = 48;
  int64_t split = 70;  // keys [0, split) and [split, Sk)
  AttnSpec spec;
  Tensor q, k, v;
  // fp32 partials of each half (float64 reference, rounded), and the reference over all keys.
  std::vector<float> out_a, lse_a, out_b, lse_b;
  cpu::ReferenceResult all;

  Halves(bool causal, int64_t q_pos0, uint64_t seed) {
    spec.heads_q = Hq;
    spec.heads_kv = Hkv;
    spec.head_dim = D;
    spec.head_dim_v = Dv;
    spec.mask = causal ? Mask::causal() : Mask::none();
    q = test::random_tensor({B, Sq, Hq, D}, DType::f32, seed);
    k = test::random_tensor({B, Sk, Hkv, D}, DType::f32, seed + 1);
    v = test::random_tensor({B, Sk, Hkv, Dv}, DType::f32, seed + 2);
    auto a =
        cpu::attention_reference(q, k.seq_slice(0, split), v.seq_slice(0, split), spec, q_pos0, 0);
    auto b = cpu::attention_reference(q, k.seq_slice(split, Sk - split),
                                      v.seq_slice(split, Sk - split), spec, q_pos0, split);
    all = cpu::attention_reference(q, k, v, spec, q_pos0, 0);
    to_f32(a, out_a, lse_a);
    to_f32(b, out_b, lse_b);
  }
  static void to_f32(const cpu::ReferenceResult& r, std::vector<float>& out,
                     std::vector<float>& lse) {
    out.assign(r.out.begin(), r.out.end());
    lse.assign(r.lse.begin(), r.lse.end());
  }
};

// ---------------------------------------------------------------- merge of key halves

TEST(MergePartials, TwoKeyHalvesEqualReferenceOverAllKeys) {
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "none");
    // Causal with queries at 0..89: rows < 70 see only the first half, so the second half's
    // partial is empty there (identity on the right); every row sees key 0.
    Halves h(causal, 0, 21);
    for (bool b_into_a : {true, false}) {
      std::vector<float> out = b_into_a ? h.out_a : h.out_b, lse = b_into_a ? h.lse_a : h.lse_b;
      const auto& out2 = b_into_a ? h.out_b : h.out_a;
      const auto& lse2 = b_into_a ? h.lse_b : h.lse_a;
      merge_partials(out.data(), lse.data(), out2.data(), lse2.data(), h.B, h.Sq, h.Hq, h.Dv);
      EXPECT_TRUE(matches_reference(out.data(), lse.data(), h.B, h.Sq, h.Hq, h.Dv, h.all,
                                    tolerance_for(DType::f32)));
    }
  }
}

// Queries at 0..89 and keys split at 70 under a causal mask, but with the query block placed so
// that some rows see no key at all: both sides empty stays empty.
TEST(MergePartials, CausalWithEmptyRowsOnBothSides) {
  Halves h(true, 0, 22);
  // Shift: recompute with queries at -30.. so rows 0..29 see nothing in either half.
  auto a = cpu::attention_reference(h.q, h.k.seq_slice(0, h.split), h.v.seq_slice(0, h.split),
                                    h.spec, -30, 0);
  auto b = cpu::attention_reference(h.q, h.k.seq_slice(h.split, h.Sk - h.split),
                                    h.v.seq_slice(h.split, h.Sk - h.split), h.spec, -30, h.split);
  auto all = cpu::attention_reference(h.q, h.k, h.v, h.spec, -30, 0);
  std::vector<float> out_a, lse_a, out_b, lse_b;
  Halves::to_f32(a, out_a, lse_a);
  Halves::to_f32(b, out_b, lse_b);
  merge_partials(out_a.data(), lse_a.data(), out_b.data(), lse_b.data(), h.B, h.Sq, h.Hq, h.Dv);
  test::CompareStats st;
  EXPECT_TRUE(matches_reference(out_a.data(), lse_a.data(), h.B, h.Sq, h.Hq, h.Dv, all,
                                tolerance_for(DType::f32), &st));
  EXPECT_EQ(st.empty_rows, h.B * h.Hq * 30);
}

// ---------------------------------------------------------------- identity and empties

TEST(MergeRow, EmptyIsIdentityOnBothSides) {
  const int64_t dv = 5;
  const float o_full[dv] = {1.f, -2.f, 3.5f, 0.f, 7.f};
  const float lse_full = 2.25f;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // Right side empty (its out holds NaN garbage): the left is unchanged bit for bit.
  {
    float o[dv], l = lse_full;
    std::memcpy(o, o_full, sizeof o);
    const float garbage[dv] = {nan, nan, INFINITY, -INFINITY, 1e30f};
    merge_row(o, &l, garbage, -INFINITY, dv);
    EXPECT_EQ(std::memcmp(o, o_full, sizeof o), 0);
    EXPECT_EQ(l, lse_full);
  }
  // Left side empty (its out holds garbage too): the result is the right side exactly.
  {
    float o[dv] = {nan, nan, nan, nan, nan}, l = -INFINITY;
    merge_row(o, &l, o_full, lse_full, dv);
    EXPECT_EQ(std::memcmp(o, o_full, sizeof o), 0);
    EXPECT_EQ(l, lse_full);
  }
}

TEST(MergeRow, BothEmptyStaysEmptyEvenWithNaNGarbage) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  float o[3] = {0.f, 0.f, 0.f}, l = -INFINITY;
  const float garbage[3] = {nan, INFINITY, 5.f};
  merge_row(o, &l, garbage, -INFINITY, 3);
  EXPECT_EQ(l, -INFINITY);
  for (float x : o)
    EXPECT_EQ(x, 0.f);

  // Whole partials: clear_partial yields out 0 / lse -inf; merging an empty partial whose out
  // is NaN garbage leaves it so.
  const int64_t B = 2, S = 3, H = 2, Dv = 4;
  std::vector<float> out(size_t(B * S * H * Dv), 123.f), lse(size_t(B * H * S), 9.f);
  clear_partial(out.data(), lse.data(), B, S, H, Dv);
  for (float x : out)
    ASSERT_EQ(x, 0.f);
  for (float x : lse)
    ASSERT_EQ(x, -INFINITY);
  std::vector<float> out_b(out.size(), nan), lse_b(lse.size(), -INFINITY);
  merge_partials(out.data(), lse.data(), out_b.data(), lse_b.data(), B, S, H, Dv);
  for (float x : out)
    ASSERT_EQ(x, 0.f);
  for (float x : lse)
    ASSERT_EQ(x, -INFINITY);
}

// ---------------------------------------------------------------- range

// lse values far apart: the smaller side's weight underflows to 0, nothing overflows.
TEST(MergeRow, LargeLseDifferencesDoNotOverflow) {
  const float oa[2] = {1.f, 2.f}, ob[2] = {-3.f, 4.f};
  for (float big : {1e4f, 1e6f, 3e38f}) {
    SCOPED_TRACE(big);
    {  // b dominates
      float o[2] = {oa[0], oa[1]}, l = 0.f;
      merge_row(o, &l, ob, big, 2);
      EXPECT_EQ(l, big);
      EXPECT_EQ(o[0], ob[0]);
      EXPECT_EQ(o[1], ob[1]);
    }
    {  // a dominates
      float o[2] = {oa[0], oa[1]}, l = big;
      merge_row(o, &l, ob, 0.f, 2);
      EXPECT_EQ(l, big);
      EXPECT_EQ(o[0], oa[0]);
      EXPECT_EQ(o[1], oa[1]);
    }
    {  // very negative vs very positive
      float o[2] = {oa[0], oa[1]}, l = -big;
      merge_row(o, &l, ob, big, 2);
      EXPECT_EQ(l, big);
      EXPECT_EQ(o[0], ob[0]);
    }
  }
  // Both large and close: lse = m + log(1 + e^-1) exactly representable to fp32 rounding.
  float o[2] = {oa[0], oa[1]}, l = 1e4f;
  merge_row(o, &l, ob, 1e4f + 1.f, 2);
  const double w = 1.0 / (1.0 + std::exp(-1.0));               // weight of b
  EXPECT_NEAR(l, 1e4 + 1 + std::log1p(std::exp(-1.0)), 2e-3);  // ulp(1e4) ~ 1e-3
  EXPECT_NEAR(o[0], w * ob[0] + (1 - w) * oa[0], 1e-6);
  EXPECT_NEAR(o[1], w * ob[1] + (1 - w) * oa[1], 1e-6);
  EXPECT_TRUE(std::isfinite(l));
}

// ---------------------------------------------------------------- order independence

TEST(MergePartials, OrderIndependent) {
  // Three disjoint key blocks, merged in every order, agree with each other and the reference.
  const int64_t B = 1, Sq = 40, Sk = 120, H = 2, D = 32;
  AttnSpec spec;
  spec.heads_q = H;
  spec.heads_kv = H;
  spec.head_dim = D;
  spec.mask = Mask::causal();
  Tensor q = test::random_tensor({B, Sq, H, D}, DType::f32, 31, 2.f);
  Tensor k = test::random_tensor({B, Sk, H, D}, DType::f32, 32);
  Tensor v = test::random_tensor({B, Sk, H, D}, DType::f32, 33);
  const int64_t q_pos0 = 60;  // rows see 61..100 keys: block 3 (80..119) partly visible
  const int64_t cut[4] = {0, 30, 80, 120};
  std::vector<float> outs[3], lses[3];
  for (int i = 0; i < 3; ++i) {
    auto r =
        cpu::attention_reference(q, k.seq_slice(cut[i], cut[i + 1] - cut[i]),
                                 v.seq_slice(cut[i], cut[i + 1] - cut[i]), spec, q_pos0, cut[i]);
    Halves::to_f32(r, outs[i], lses[i]);
  }
  auto all = cpu::attention_reference(q, k, v, spec, q_pos0, 0);
  int perm[3] = {0, 1, 2};
  std::vector<float> first_out, first_lse;
  do {
    std::vector<float> out(outs[0].size()), lse(lses[0].size());
    clear_partial(out.data(), lse.data(), B, Sq, H, D);
    for (int i : perm)
      merge_partials(out.data(), lse.data(), outs[i].data(), lses[i].data(), B, Sq, H, D);
    SCOPED_TRACE(testing::Message() << perm[0] << perm[1] << perm[2]);
    EXPECT_TRUE(
        matches_reference(out.data(), lse.data(), B, Sq, H, D, all, tolerance_for(DType::f32)));
    if (first_out.empty()) {
      first_out = out;
      first_lse = lse;
    } else {
      for (size_t i = 0; i < out.size(); ++i)
        ASSERT_NEAR(out[i], first_out[i], 2e-6) << i;
      for (size_t i = 0; i < lse.size(); ++i)
        ASSERT_NEAR(lse[i], first_lse[i], 2e-6) << i;
    }
  } while (std::next_permutation(perm, perm + 3));
}

// ---------------------------------------------------------------- dtype conversions

float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

TEST(DType, Bf16RoundTripsEveryValue) {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const float f = to_float(bf16{uint16_t(b)});
    EXPECT_EQ(float_to_bits(f), b << 16) << b;
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(to_float(to_bf16(f)))) << b;
    } else {
      ASSERT_EQ(to_bf16(f).bits, b) << b;
    }
  }
}

// Every midpoint between neighbouring bf16 values rounds to the even one; one fp32 ulp either
// side rounds to the nearer one. Covers normals, subnormals and the overflow to inf.
TEST(DType, Bf16RoundsToNearestEven) {
  for (uint32_t b = 0; b < 0x7f80u; ++b) {  // positive finite bf16, b and b + 1 neighbours
    const uint32_t mid = (b << 16) | 0x8000u;
    const uint16_t even = (b & 1u) ? uint16_t(b + 1) : uint16_t(b);
    for (uint32_t sign : {0u, 0x80000000u}) {
      const uint16_t s16 = uint16_t(sign >> 16);
      ASSERT_EQ(to_bf16(bits_to_float(sign | mid)).bits, s16 | even) << std::hex << mid;
      ASSERT_EQ(to_bf16(bits_to_float(sign | (mid - 1))).bits, s16 | b) << std::hex << mid;
      ASSERT_EQ(to_bf16(bits_to_float(sign | (mid + 1))).bits, s16 | (b + 1)) << std::hex << mid;
    }
  }
  EXPECT_EQ(to_bf16(1.0f).bits, 0x3f80u);
  EXPECT_EQ(to_bf16(1.0f + 0x1.0p-8f).bits, 0x3f80u);                   // tie -> even (down)
  EXPECT_EQ(to_bf16(1.0f + 3 * 0x1.0p-8f).bits, 0x3f82u);               // tie -> even (up)
  EXPECT_EQ(to_bf16(std::numeric_limits<float>::max()).bits, 0x7f80u);  // rounds to inf
  EXPECT_EQ(to_bf16(INFINITY).bits, 0x7f80u);
  EXPECT_EQ(to_bf16(-INFINITY).bits, 0xff80u);
  EXPECT_EQ(to_bf16(-0.0f).bits, 0x8000u);
  EXPECT_EQ(to_bf16(0x1.0p-133f).bits, 0x0001u);  // smallest bf16 subnormal
  EXPECT_EQ(to_bf16(0x1.0p-134f).bits, 0x0000u);  // tie with 0 -> even (0)
  // NaN stays NaN (also a signalling NaN whose payload would otherwise round into inf).
  EXPECT_TRUE(std::isnan(to_float(to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(to_float(to_bf16(bits_to_float(0x7f800001u)))));
  EXPECT_TRUE(std::isnan(to_float(to_bf16(bits_to_float(0xffffffffu)))));
}

TEST(DType, F16RoundTripsEveryValue) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float f = to_float(f16{uint16_t(h)});
    if (((h >> 10) & 0x1fu) == 0x1fu && (h & 0x3ffu) != 0) {
      ASSERT_TRUE(std::isnan(f)) << h;
      ASSERT_TRUE(std::isnan(to_float(to_f16(f)))) << h;
    } else {
      ASSERT_EQ(to_f16(f).bits, h) << std::hex << h << " -> " << f;
    }
  }
  EXPECT_EQ(to_float(f16{0x3c00}), 1.0f);
  EXPECT_EQ(to_float(f16{0x7bff}), 65504.0f);
  EXPECT_EQ(to_float(f16{0x0001}), 0x1.0p-24f);
  EXPECT_EQ(to_float(f16{0x03ff}), 1023 * 0x1.0p-24f);
  EXPECT_EQ(to_float(f16{0x0400}), 0x1.0p-14f);
  EXPECT_EQ(to_float(f16{0x7c00}), INFINITY);
  EXPECT_EQ(to_float(f16{0xfc00}), -INFINITY);
  EXPECT_TRUE(std::signbit(to_float(f16{0x8000})));
  EXPECT_EQ(to_float(f16{0xc000}), -2.0f);
}

TEST(DType, F16RoundsToNearestEven) {
  // Consecutive positive fp16 values h, h + 1 (0 .. 0x7bff -> 0x7c00 = inf): the exact midpoint
  // (an fp32 value) rounds to the even one, one fp32 ulp off it to the nearer one.
  for (uint32_t h = 0; h < 0x7c00u; ++h) {
    const double lo = to_float(f16{uint16_t(h)});
    const double hi = h + 1 == 0x7c00u ? 65536.0 : double(to_float(f16{uint16_t(h + 1)}));
    const float mid = float((lo + hi) / 2);  // exact: needs 12 significant bits
    ASSERT_EQ(double(mid), (lo + hi) / 2);
    const uint16_t even = (h & 1u) ? uint16_t(h + 1) : uint16_t(h);
    for (uint16_t sign : {uint16_t(0), uint16_t(0x8000)}) {
      const float m = sign ? -mid : mid;
      ASSERT_EQ(to_f16(m).bits, sign | even) << std::hex << h;
      ASSERT_EQ(to_f16(std::nextafter(m, 0.f)).bits, sign | h) << std::hex << h;
      ASSERT_EQ(to_f16(std::nextafter(m, sign ? -INFINITY : INFINITY)).bits, sign | (h + 1))
          << std::hex << h;
    }
  }
  EXPECT_EQ(to_f16(65519.f).bits, 0x7bffu);
  EXPECT_EQ(to_f16(65520.f).bits, 0x7c00u);  // tie between 65504 and 65536 -> even (inf)
  EXPECT_EQ(to_f16(1e10f).bits, 0x7c00u);
  EXPECT_EQ(to_f16(-1e10f).bits, 0xfc00u);
  EXPECT_EQ(to_f16(INFINITY).bits, 0x7c00u);
  EXPECT_EQ(to_f16(-INFINITY).bits, 0xfc00u);
  EXPECT_EQ(to_f16(0x1.0p-25f).bits, 0x0000u);       // tie with 0 -> 0
  EXPECT_EQ(to_f16(0x1.000002p-25f).bits, 0x0001u);  // just above the tie
  EXPECT_EQ(to_f16(3 * 0x1.0p-25f).bits, 0x0002u);   // tie 1 | 2 -> 2
  EXPECT_EQ(to_f16(1e-30f).bits, 0x0000u);
  EXPECT_EQ(to_f16(-1e-30f).bits, 0x8000u);
  EXPECT_EQ(to_f16(1.0f + 0x1.0p-11f).bits, 0x3c00u);      // tie -> even (down)
  EXPECT_EQ(to_f16(1.0f + 3 * 0x1.0p-11f).bits, 0x3c02u);  // tie -> even (up)
  EXPECT_EQ(to_f16(0x1.ffcp-15f).bits, 0x0400u);  // largest subnormal tie rounds to the min normal
  EXPECT_TRUE(std::isnan(to_float(to_f16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(to_float(to_f16(bits_to_float(0x7f800001u)))));
}

TEST(DType, BulkConversionsAndTensorTo) {
  const std::vector<float> src = {0.f, 1.f, -1.5f, 3.14159f, 1e-6f, -65504.f, 1e5f, 0x1.0p-20f};
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dt));
    std::vector<uint8_t> buf(src.size() * dtype_size(dt));
    convert_from_f32(src.data(), buf.data(), dt, src.size());
    std::vector<float> back(src.size());
    convert_to_f32(buf.data(), dt, back.data(), src.size());
    for (size_t i = 0; i < src.size(); ++i) {
      float expect = dt == DType::f32    ? src[i]
                     : dt == DType::bf16 ? to_float(to_bf16(src[i]))
                                         : to_float(to_f16(src[i]));
      EXPECT_EQ(float_to_bits(back[i]), float_to_bits(expect)) << i;
    }
    Tensor t = Tensor::empty({2, int64_t(src.size()) / 2}, DType::f32);
    for (size_t i = 0; i < src.size(); ++i)
      t.set(int64_t(i), src[i]);
    Tensor c = t.to(dt);
    EXPECT_EQ(c.dtype(), dt);
    EXPECT_EQ(c.nbytes(), src.size() * dtype_size(dt));
    for (size_t i = 0; i < src.size(); ++i)
      EXPECT_EQ(c.get(int64_t(i)), back[i]) << i;
    Tensor r = c.to(DType::f32);
    for (size_t i = 0; i < src.size(); ++i)
      EXPECT_EQ(r.get(int64_t(i)), back[i]) << i;
  }
}

TEST(DType, NamesParseAndPrint) {
  EXPECT_EQ(parse_dtype("fp32"), DType::f32);
  EXPECT_EQ(parse_dtype("f32"), DType::f32);
  EXPECT_EQ(parse_dtype("float32"), DType::f32);
  EXPECT_EQ(parse_dtype("bf16"), DType::bf16);
  EXPECT_EQ(parse_dtype("bfloat16"), DType::bf16);
  EXPECT_EQ(parse_dtype("fp16"), DType::f16);
  EXPECT_EQ(parse_dtype("f16"), DType::f16);
  EXPECT_EQ(parse_dtype("float16"), DType::f16);
  for (DType dt : {DType::f32, DType::bf16, DType::f16})
    EXPECT_EQ(parse_dtype(dtype_name(dt)), dt);
  EXPECT_EQ(dtype_size(DType::f32), 4u);
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::f16), 2u);
  for (const char* bad : {"fp8", "", "BF16x", "int8"}) {
    try {
      parse_dtype(bad);
      ADD_FAILURE() << "parse_dtype(\"" << bad << "\") did not throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("dtype"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(std::string("'") + bad + "'"), std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
}  // namespace dattn

namespace dattn {
namespace {
// The bulk fp16 conversion (F16C where the CPU has it, 8 at a time) equals the scalar one for
// every one of the 65536 bit patterns (NaN stays NaN), also in the unaligned tail.
TEST(DtypeBulk, Fp16ToFp32MatchesScalarForEveryPattern) {
  std::vector<f16> all(65536 + 3);
  for (size_t i = 0; i < all.size(); ++i)
    all[i] = f16{uint16_t(i & 0xffffu)};
  std::vector<float> got(all.size());
  convert_to_f32(all.data(), DType::f16, got.data(), all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    const float want = to_float(all[i]);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got[i])) << i;
    } else {
      EXPECT_EQ(std::memcmp(&got[i], &want, 4), 0)
          << "pattern " << i << ": " << got[i] << " vs " << want;
    }
  }
}
}  // namespace
}  // namespace dattn
