// Single-process tests of the CPU decode kernel (dattn::cpu::decode_forward) against the float64
// reference, out and lse: few query rows (1, 2, 7, 16) against contexts that are multiples of no
// chunk or split (1, 31, 1000, 65537), GQA 1, 4, 8, D 64 to 256 and D != Dv, fp32/bf16/fp16 caches,
// masks and documents on global positions (strided too; empty documents among them), merging into
// a running partial, empty key ranges, hidden NaN, and bit-identical repeats; the MLA form (two
// key parts, V = the first).
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/decode_cpu.h"
#include "kernels/cpu/reference.h"
#include "kernels/merge.h"
#include "src/base/error.h"
#include "tests/test_reference.h"

namespace dattn {
namespace {

using test::matches_reference;
using test::naive_reference;
using test::random_tensor;
using test::tolerance_for;

struct DecodeCase {
  int64_t Sq = 1, ctx = 1, Hq = 1, Hkv = 1, D = 64, Dv = 64;
  DType dtype = DType::f32;
  Mask mask = Mask::causal();
  int64_t k_pos0 = 0, k_stride = 1, k_block = 1;  // key positions
  std::string str() const {
    return detail::cat("Sq ", Sq, " ctx ", ctx, " Hq ", Hq, " Hkv ", Hkv, " D ", D, " Dv ", Dv, " ",
                       dtype_name(dtype), " ", mask.str(), " keys at ", k_pos0, "+", k_stride, "/",
                       k_block);
  }
};

struct Problem {
  Tensor q, k, v;
  AttnSpec spec;
  std::vector<int64_t> q_pos, k_pos;
};

// Queries sit at the positions of the last Sq keys (a decode step's own tokens, causal among
// themselves), so chunks at the end are partially masked.
Problem make_problem(const DecodeCase& c, uint64_t seed) {
  Problem p;
  p.spec.heads_q = c.Hq;
  p.spec.heads_kv = c.Hkv;
  p.spec.head_dim = c.D;
  p.spec.head_dim_v = c.Dv;
  p.spec.mask = c.mask;
  p.q = random_tensor({1, c.Sq, c.Hq, c.D}, c.dtype, seed * 3, 2.f);
  p.k = random_tensor({1, c.ctx, c.Hkv, c.D}, c.dtype, seed * 3 + 1);
  p.v = random_tensor({1, c.ctx, c.Hkv, c.Dv}, c.dtype, seed * 3 + 2);
  for (int64_t j = 0; j < c.ctx; ++j)
    p.k_pos.push_back(c.k_pos0 + (j / c.k_block) * c.k_stride + j % c.k_block);
  const int64_t last = p.k_pos.back();
  for (int64_t i = 0; i < c.Sq; ++i)
    p.q_pos.push_back(last - (c.Sq - 1) + i);
  return p;
}

cpu::AttentionBlock make_block(const Problem& p, const DecodeCase& c) {
  cpu::AttentionBlock blk;
  blk.q = p.q.data();
  blk.k = p.k.data();
  blk.v = p.v.data();
  blk.dtype = c.dtype;
  blk.batch = 1;
  blk.seq_q = c.Sq;
  blk.seq_k = c.ctx;
  blk.heads_q = c.Hq;
  blk.heads_kv = c.Hkv;
  blk.head_dim = c.D;
  blk.head_dim_v = c.Dv;
  blk.scale = p.spec.scale();
  blk.mask = c.mask;
  blk.q_pos0 = p.q_pos[0];
  blk.k_pos0 = c.k_pos0;
  blk.k_pos_stride = c.k_stride;
  blk.k_pos_block = c.k_block;
  return blk;
}

struct PartialBuf {
  std::vector<float> out, lse;
  PartialBuf(int64_t S, int64_t H, int64_t Dv) : out(size_t(S * H * Dv)), lse(size_t(H * S)) {
    clear_partial(out.data(), lse.data(), 1, S, H, Dv);
  }
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

testing::AssertionResult decode_matches(const DecodeCase& c, uint64_t seed) {
  Problem p = make_problem(c, seed);
  PartialBuf part(c.Sq, c.Hq, c.Dv);
  cpu::decode_forward(make_block(p, c), part.out.data(), part.lse.data());
  auto ref = naive_reference(p.q, p.k, p.v, p.spec, p.q_pos, p.k_pos);
  return matches_reference(part.out.data(), part.lse.data(), 1, c.Sq, c.Hq, c.Dv, ref,
                           tolerance_for(c.dtype));
}

// Shapes from the lists, combined so that every value of each list meets several of the
// others; the reference's cost (Sq x ctx x Hq x D) is kept small for the longest context.
TEST(DecodeKernel, MatchesFloat64Reference) {
  const int64_t sqs[] = {1, 2, 7, 16};
  const int64_t groups[] = {1, 4, 8};
  const int64_t dims[][2] = {{64, 64}, {128, 128}, {256, 256}, {192, 128}, {64, 32}};
  const int64_t ctxs[] = {1, 31, 1000, 65537};  // and 4097
  const DType dtypes[] = {DType::f32, DType::bf16, DType::f16};
  int cases = 0;
  for (int i = 0; i < 40; ++i) {
    DecodeCase c;
    c.Sq = sqs[i % 4];
    const int64_t group = groups[(i / 4) % 3];
    c.Hkv = group == 8 ? 1 : 2;
    c.Hq = group * c.Hkv;
    c.D = dims[(i / 3) % 5][0];
    c.Dv = dims[(i / 3) % 5][1];
    c.ctx = ctxs[(i / 2) % 4];
    c.dtype = dtypes[i % 3];
    if (c.ctx == 65537 && (i / 8) % 4 != 0 && i != 23) c.ctx = 4097;  // 3 of 65537 keys, 3 dtypes
    if (c.ctx == 65537) c.Hq /= c.Hkv, c.Hkv = 1;
    if (c.ctx == 65537)
      c.Sq = 1, c.D = std::min<int64_t>(c.D, 64), c.Dv = std::min<int64_t>(c.Dv, 64);
    if (c.ctx < c.Sq) c.ctx = c.Sq;
    switch ((i / 5) % 4) {
      case 0:
        c.mask = Mask::causal();
        break;
      case 1:
        c.mask = Mask::window(std::max<int64_t>(1, c.ctx / 3));
        break;
      case 2:
        c.mask = c.ctx >= 31 ? Mask::document({0, c.ctx / 3, c.ctx - 5, c.ctx + 100}, true)
                             : Mask::causal();
        break;
      case 3:
        c.mask = Mask::none();
        break;
    }
    SCOPED_TRACE(c.str());
    EXPECT_TRUE(decode_matches(c, uint64_t(i) + 1));
    ++cases;
  }
  EXPECT_EQ(cases, 40);
}

// Head dims off the vector widths (16 lanes on AVX-512, 8 below, then element by element) on
// every instruction set this CPU has: each loop's tail meets the reference.
TEST(DecodeKernel, HeadDimsOffTheVectorWidths) {
  const int64_t dims[][2] = {{72, 40}, {100, 100}, {24, 8}, {5, 3}};
  int cases = 0;
  for (int isa = 0; isa <= int(cpu::decode_best_isa()); ++isa)
    for (const auto& d : dims)
      for (DType dt : {DType::f32, DType::bf16})
        for (int64_t sq : {1, 3}) {
          const DecodeCase c{sq, 1000, sq == 1 ? 4 : 8, 2, d[0], d[1], dt, Mask::causal()};
          SCOPED_TRACE(c.str() + " isa " + cpu::decode_isa_name(cpu::DecodeIsa(isa)));
          Problem p = make_problem(c, uint64_t(d[0] + sq));
          PartialBuf part(c.Sq, c.Hq, c.Dv);
          cpu::decode_forward(make_block(p, c), part.out.data(), part.lse.data(),
                              cpu::DecodeIsa(isa));
          auto ref = naive_reference(p.q, p.k, p.v, p.spec, p.q_pos, p.k_pos);
          EXPECT_TRUE(matches_reference(part.out.data(), part.lse.data(), 1, c.Sq, c.Hq, c.Dv, ref,
                                        tolerance_for(c.dtype)));
          ++cases;
        }
  EXPECT_EQ(cases, 16 * (int(cpu::decode_best_isa()) + 1));
}

// Blocks of many rows (up to the dispatch's limit, GQA 4: 256 rows per kv head) run the chunks'
// GEMMs, 16-bit chunks widened once; partially masked chunks add P V row by row.
TEST(DecodeKernel, ManyRowsRunTheGemmPath) {
  const Mask causal = Mask::causal(), docs = Mask::document({0, 700, 1480, 3000}, true);
  const Mask prefix = test::shared_prefix_mask(200, {200, 700, 1480, 3000});
  for (auto [dt, m] : {std::pair{DType::f32, causal},
                       {DType::bf16, docs},
                       {DType::f16, causal},
                       {DType::bf16, prefix}}) {
    DecodeCase c{cpu::kDecodeMaxQueryRows, 1500, 8, 2, 64, 48, dt, m};
    SCOPED_TRACE(c.str());
    EXPECT_TRUE(decode_matches(c, 41));
  }
}

// Keys at strided and blocked global positions (the striped and zigzag layouts' shards), under
// band, document and slice masks.
TEST(DecodeKernel, StridedKeyPositions) {
  struct S {
    int64_t pos0, stride, block;
  };
  for (S s : {S{0, 3, 1}, S{5, 8, 2}, S{100, 64, 16}}) {
    std::mt19937_64 rng(uint64_t(s.stride));
    for (Mask m :
         {Mask::causal(), Mask::window(200), Mask::document({0, 900, 2000, 9000}, true),
          test::shared_prefix_mask(300, {300, 301, 2000, 9000}), test::random_slices(rng, 9000)}) {
      DecodeCase c{7, 1500, 8, 2, 64, 64, DType::bf16, m, s.pos0, s.stride, s.block};
      SCOPED_TRACE(c.str());
      EXPECT_TRUE(decode_matches(c, 11));
    }
  }
}

// Empty documents (repeated cu_seqlens entries) among the keys and around the queries' document:
// out and lse match the reference of the boundaries without them and are, bit for bit, what the
// call without them gives; few rows and the GEMM path's many, contiguous and strided keys in turn.
TEST(DecodeKernel, EmptyDocumentsAsIfRemoved) {
  int n = 0;
  for (const auto& [name, cu] : test::empty_documents_cases(1200)) {
    for (int64_t Sq : {int64_t(3), cpu::kDecodeMaxQueryRows}) {
      const int64_t stride = n++ % 2 == 0 ? 1 : 3;
      DecodeCase c{Sq, 1200 / stride, 8, 2, 64, 32, DType::bf16, Mask::document(cu, true)};
      c.k_stride = stride;
      SCOPED_TRACE(name + " " + c.str());
      Problem p = make_problem(c, 23);
      PartialBuf part(c.Sq, c.Hq, c.Dv), cut(c.Sq, c.Hq, c.Dv);
      cpu::decode_forward(make_block(p, c), part.out.data(), part.lse.data());
      DecodeCase w = c;
      w.mask = test::without_empty_documents(c.mask);
      cpu::decode_forward(make_block(p, w), cut.out.data(), cut.lse.data());
      AttnSpec spec = p.spec;
      spec.mask = w.mask;
      const auto ref = naive_reference(p.q, p.k, p.v, spec, p.q_pos, p.k_pos);
      EXPECT_TRUE(matches_reference(part.out.data(), part.lse.data(), 1, c.Sq, c.Hq, c.Dv, ref,
                                    tolerance_for(c.dtype)));
      EXPECT_TRUE(same_bits(part.out, cut.out));
      EXPECT_TRUE(same_bits(part.lse, cut.lse));
    }
  }
}

// Two calls on the two halves of the keys merge into what one call over all of them gives (the
// reference), and rows outside the block stay as they were.
TEST(DecodeKernel, MergesIntoARunningPartial) {
  DecodeCase c{2, 3000, 8, 2, 128, 128, DType::f32, Mask::causal()};
  Problem p = make_problem(c, 5);
  PartialBuf part(c.Sq, c.Hq, c.Dv);
  cpu::AttentionBlock blk = make_block(p, c);
  blk.k_len = 1234;
  cpu::decode_forward(blk, part.out.data(), part.lse.data());
  blk.k_begin = 1234;
  blk.k_len = -1;
  blk.k_pos0 = 1234;
  cpu::decode_forward(blk, part.out.data(), part.lse.data());
  auto ref = naive_reference(p.q, p.k, p.v, p.spec, p.q_pos, p.k_pos);
  EXPECT_TRUE(matches_reference(part.out.data(), part.lse.data(), 1, c.Sq, c.Hq, c.Dv, ref,
                                tolerance_for(c.dtype)));

  // Query row 1 only: row 0 keeps its empty partial.
  PartialBuf one(c.Sq, c.Hq, c.Dv);
  blk = make_block(p, c);
  blk.q_begin = 1;
  blk.q_len = 1;
  blk.q_pos0 = p.q_pos[1];
  cpu::decode_forward(blk, one.out.data(), one.lse.data());
  for (int64_t h = 0; h < c.Hq; ++h) {
    EXPECT_EQ(one.lse[size_t(h * c.Sq)], -INFINITY);
    EXPECT_NEAR(one.lse[size_t(h * c.Sq + 1)], ref.lse[size_t(h * c.Sq + 1)], 1e-4);
  }
}

// No keys, or keys the mask hides entirely: the partial is unchanged, bit for bit.
TEST(DecodeKernel, EmptyKeyRangesLeaveThePartialUnchanged) {
  DecodeCase c{3, 700, 4, 1, 64, 64, DType::bf16, Mask::causal()};
  Problem p = make_problem(c, 9);
  PartialBuf part(c.Sq, c.Hq, c.Dv);
  cpu::AttentionBlock blk = make_block(p, c);
  cpu::decode_forward(blk, part.out.data(), part.lse.data());
  const std::vector<float> out0 = part.out, lse0 = part.lse;
  blk.k_len = 0;
  cpu::decode_forward(blk, part.out.data(), part.lse.data());
  blk.k_len = -1;
  blk.k_pos0 = p.q_pos.back() + 1;  // every key in the future
  cpu::decode_forward(blk, part.out.data(), part.lse.data());
  EXPECT_TRUE(same_bits(part.out, out0));
  EXPECT_TRUE(same_bits(part.lse, lse0));

  // A query that sees no key of a block whose other queries do: out 0, lse -inf.
  blk = make_block(p, c);
  blk.k_pos0 = p.q_pos[1];  // query row 0 sits before every key
  PartialBuf fresh(c.Sq, c.Hq, c.Dv);
  cpu::decode_forward(blk, fresh.out.data(), fresh.lse.data());
  for (int64_t h = 0; h < c.Hq; ++h) {
    EXPECT_EQ(fresh.lse[size_t(h * c.Sq)], -INFINITY);
    EXPECT_TRUE(std::isfinite(fresh.lse[size_t(h * c.Sq + 1)]));
    for (int64_t d = 0; d < c.Dv; ++d)
      EXPECT_EQ(fresh.out[size_t(h * c.Dv + d)], 0.f);
  }
}

// NaN and inf in K/V rows that no query sees (future tokens in the chunk of the last visible
// ones; another document) change nothing, bit for bit; a NaN a query does see reaches it.
TEST(DecodeKernel, HiddenNonFiniteRowsNeverReachTheOutput) {
  for (bool many_rows : {false, true}) {
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
      for (Mask m : {Mask::causal(), Mask::document({0, 40, 2000}, true)}) {
        DecodeCase c{2, 100, 4, 2, 64, 48, dt, m};
        if (many_rows) c.Hq = 32, c.Hkv = 2;  // 32 rows per kv head: the GEMM path
        Problem p = make_problem(c, 13);
        // Queries at 60, 61: keys 62.. are in their future; with documents, keys 0..39 are in
        // another document.
        p.q_pos = {60, 61};
        cpu::AttentionBlock blk = make_block(p, c);
        blk.q_pos0 = 60;
        PartialBuf clean(c.Sq, c.Hq, c.Dv);
        cpu::decode_forward(blk, clean.out.data(), clean.lse.data());
        const bool docs = bool(m.documents);
        const size_t es = dtype_size(dt);
        auto poison = [&](Tensor& t, int64_t row, int64_t dim, float value) {
          std::vector<float> vals(size_t(c.Hkv * dim), value);
          convert_from_f32(vals.data(),
                           static_cast<char*>(t.data()) + size_t(row * c.Hkv * dim) * es, dt,
                           vals.size());
        };
        for (int64_t j : {62, 63, 80, 99})
          poison(p.v, j, c.Dv, NAN), poison(p.k, j, c.D, INFINITY);
        if (docs)
          for (int64_t j : {0, 7, 39})
            poison(p.v, j, c.Dv, INFINITY), poison(p.k, j, c.D, NAN);
        PartialBuf dirty(c.Sq, c.Hq, c.Dv);
        cpu::decode_forward(blk, dirty.out.data(), dirty.lse.data());
        SCOPED_TRACE(c.str());
        EXPECT_TRUE(same_bits(dirty.out, clean.out));
        EXPECT_TRUE(same_bits(dirty.lse, clean.lse));
        // Key 61 is seen by query 61 only.
        poison(p.v, 61, c.Dv, NAN);
        PartialBuf seen(c.Sq, c.Hq, c.Dv);
        cpu::decode_forward(blk, seen.out.data(), seen.lse.data());
        for (int64_t h = 0; h < c.Hq; ++h) {
          EXPECT_TRUE(std::isnan(seen.out[size_t((1 * c.Hq + h) * c.Dv)]));
          EXPECT_EQ(seen.out[size_t((0 * c.Hq + h) * c.Dv)], clean.out[size_t(h * c.Dv)]);
        }
      }
    }
  }
}

// The 16-bit widening of value rows, exactly: one key (weight 1) gives out = its value row, so
// every bit pattern class (subnormals, the largest normal, zeros, inf, NaN) must come out as
// dattn::to_float converts it.
TEST(DecodeKernel, WidensEverySixteenBitValueExactly) {
  const uint16_t f16_bits[] = {0x0001, 0x03ff, 0x0400, 0x3c00, 0x7bff, 0x7c00, 0x7e00, 0x8000,
                               0x8001, 0xbc00, 0xfbff, 0xfc00, 0x3555, 0x0200, 0x1234, 0x4321};
  const uint16_t bf16_bits[] = {0x0001, 0x007f, 0x0080, 0x3f80, 0x7f7f, 0x7f80, 0x7fc0, 0x8000,
                                0x8001, 0xbf80, 0xff7f, 0xff80, 0x3eaa, 0x0040, 0x1234, 0x4321};
  for (DType dt : {DType::f16, DType::bf16}) {
    const uint16_t* bits = dt == DType::f16 ? f16_bits : bf16_bits;
    DecodeCase c{1, 1, 1, 1, 16, 40, dt, Mask::causal()};
    Problem p = make_problem(c, 3);
    for (int64_t i = 0; i < c.Dv; ++i)  // 16-blocks and a tail of 8
      std::memcpy(static_cast<char*>(p.v.data()) + 2 * i, &bits[i % 16], 2);
    PartialBuf part(c.Sq, c.Hq, c.Dv);
    cpu::decode_forward(make_block(p, c), part.out.data(), part.lse.data());
    for (int64_t i = 0; i < c.Dv; ++i) {
      const float want =
          dt == DType::f16 ? to_float(f16{bits[i % 16]}) : to_float(bf16{bits[i % 16]});
      SCOPED_TRACE(testing::Message()
                   << dtype_name(dt) << " element " << i << " bits 0x" << std::hex << bits[i % 16]);
      if (std::isnan(want))
        EXPECT_TRUE(std::isnan(part.out[size_t(i)]));
      else
        EXPECT_EQ(part.out[size_t(i)], want);  // -0 comes out +0: the sum starts at 0
    }
  }
}

// Split-KV: the same bits from run to run at a fixed thread count, with several splits.
TEST(DecodeKernel, BitIdenticalFromRunToRun) {
  omp_set_num_threads(2);
  DecodeCase c{1, 20000, 8, 2, 128, 128, DType::bf16, Mask::causal()};
  ASSERT_GT(cpu::decode_splits(1, c.ctx), 1);
  Problem p = make_problem(c, 17);
  PartialBuf a(c.Sq, c.Hq, c.Dv), b(c.Sq, c.Hq, c.Dv);
  cpu::decode_forward(make_block(p, c), a.out.data(), a.lse.data());
  cpu::decode_forward(make_block(p, c), b.out.data(), b.lse.data());
  EXPECT_TRUE(same_bits(a.out, b.out));
  EXPECT_TRUE(same_bits(a.lse, b.lse));
  EXPECT_TRUE(decode_matches(c, 17));
}

// Every instruction set this CPU runs (the loops are built once per set): fp32, bf16 and fp16
// against the reference, over chunk edges and GQA.
TEST(DecodeKernel, EveryInstructionSetTheCpuRuns) {
  for (int isa = 0; isa <= int(cpu::decode_best_isa()); ++isa) {
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
      DecodeCase c{5, 1001, 8, 2, 80, 72, dt, Mask::causal()};
      SCOPED_TRACE(testing::Message()
                   << cpu::decode_isa_name(cpu::DecodeIsa(isa)) << " " << c.str());
      Problem p = make_problem(c, 31);
      PartialBuf part(c.Sq, c.Hq, c.Dv);
      cpu::decode_forward(make_block(p, c), part.out.data(), part.lse.data(), cpu::DecodeIsa(isa));
      auto ref = naive_reference(p.q, p.k, p.v, p.spec, p.q_pos, p.k_pos);
      EXPECT_TRUE(matches_reference(part.out.data(), part.lse.data(), 1, c.Sq, c.Hq, c.Dv, ref,
                                    tolerance_for(c.dtype)));
    }
  }
}

// The two-part form MLA runs: score = q1 . k1 + q2 . k2, values v = k1 (shared latent cache),
// against an attention whose keys are [k1 | k2] and values k1.
TEST(DecodeKernel, TwoKeyPartsAsOneKey) {
  const int64_t rows = 5, n = 777, d1 = 96, d2 = 16;
  Tensor lat = random_tensor({1, n, 1, d1}, DType::f32, 21);
  Tensor rope = random_tensor({1, n, 1, d2}, DType::f32, 22);
  Tensor q = random_tensor({1, 1, rows, d1 + d2}, DType::f32, 23);
  Tensor k = Tensor::empty({1, n, 1, d1 + d2}, DType::f32);
  for (int64_t j = 0; j < n; ++j) {
    std::memcpy(k.ptr<float>() + j * (d1 + d2), lat.ptr<float>() + j * d1, d1 * sizeof(float));
    std::memcpy(k.ptr<float>() + j * (d1 + d2) + d1, rope.ptr<float>() + j * d2,
                d2 * sizeof(float));
  }
  AttnSpec spec;
  spec.heads_q = rows;
  spec.heads_kv = 1;
  spec.head_dim = d1 + d2;
  spec.head_dim_v = d1;
  spec.softmax_scale = 1.f;
  spec.mask = Mask::causal();
  std::vector<int64_t> qp = {600}, kp = test::positions(0, n);
  auto ref = naive_reference(q, k, lat, spec, qp, kp);

  std::vector<int64_t> row_pos(size_t(rows), 600);
  cpu::DecodeJob job;
  job.q = q.ptr<float>();
  job.q_pos = row_pos.data();
  job.rows = rows, job.d1 = d1, job.d2 = d2, job.dv = d1, job.n_keys = n;
  job.k1 = lat.data(), job.k2 = rope.data(), job.v = lat.data();
  job.k1_key = d1, job.k2_key = d2, job.v_key = d1;
  job.mask = Mask::causal();
  const int64_t splits = 3;
  std::vector<float> o(size_t(splits * rows * d1)), l(size_t(splits * rows));
  cpu::decode_partials(&job, 1, splits, o.data(), l.data());
  PartialBuf part(1, rows, d1);
  for (int64_t s = 0; s < splits; ++s)
    for (int64_t r = 0; r < rows; ++r)
      merge_row(part.out.data() + r * d1, part.lse.data() + r, o.data() + (s * rows + r) * d1,
                l[size_t(s * rows + r)], d1);
  EXPECT_TRUE(matches_reference(part.out.data(), part.lse.data(), 1, 1, rows, d1, ref,
                                tolerance_for(DType::f32)));
}

}  // namespace
}  // namespace dattn
