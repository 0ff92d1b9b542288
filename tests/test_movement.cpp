// Tests of kernels/movement on its host backend (Thrust OMP, the .inl the GPU build compiles under
// nvcc): every operation against the plain loop it replaced, with the edge cases (no rows, rows of
// odd byte sizes and misaligned pointers, -inf and NaN in the merge, in place), bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/merge.h"
#include "kernels/movement/movement.h"
#include "src/base/dtype.h"
#include "tests/test_reference.h"

namespace dattn {
namespace {

using test::random_bytes;

namespace mv = movement::host;

// ---------------------------------------------------------------- helpers

std::vector<int64_t> permutation(int64_t n, uint32_t seed) {
  std::vector<int64_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  std::shuffle(idx.begin(), idx.end(), std::mt19937(seed));
  return idx;
}

// Row sizes that cover every word width the copy picks (16, 8, 4, 2, 1 bytes) and odd ones.
const size_t kRowBytes[] = {1, 2, 3, 4, 6, 8, 12, 16, 24, 40, 100, 256, 258, 1000};

// ---------------------------------------------------------------- gather / scatter

// widen_16 on every 16-bit pattern, bf16 and fp16: the value dtype.h's conversion gives (fp16's
// subnormals, infinities and both zeros included), bit for bit; a NaN stays a NaN of its sign.
TEST(Movement, Widen16IsExactOnEveryPattern) {
  std::vector<uint16_t> in(65536);
  std::iota(in.begin(), in.end(), uint16_t(0));
  for (bool bf16 : {true, false}) {
    std::vector<float> out(in.size());
    movement::host::widen_16(out.data(), in.data(), int64_t(in.size()), bf16);
    for (size_t i = 0; i < in.size(); ++i) {
      const float want = bf16 ? to_float(dattn::bf16{in[i]}) : to_float(dattn::f16{in[i]});
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(out[i])) << (bf16 ? "bf16 " : "fp16 ") << std::hex << in[i];
        ASSERT_EQ(std::signbit(out[i]), std::signbit(want)) << std::hex << in[i];
        continue;
      }
      uint32_t a, b;
      std::memcpy(&a, &out[i], 4);
      std::memcpy(&b, &want, 4);
      ASSERT_EQ(a, b) << (bf16 ? "bf16 " : "fp16 ") << std::hex << in[i] << ": " << out[i] << " vs "
                      << want;
    }
  }
}

TEST(Movement, GatherAndScatterMatchLoops) {
  for (size_t rb : kRowBytes) {
    for (int64_t n : {0, 1, 7, 300}) {
      // The source holds 2n + 1 rows; idx picks n of them in random order. Offsets 0 and 1 into
      // the buffers: aligned and misaligned pointers.
      for (size_t shift : {size_t(0), size_t(1)}) {
        const int64_t src_rows = 2 * n + 1;
        const auto src_store = random_bytes(size_t(src_rows) * rb + shift, uint32_t(rb * 7 + n));
        std::vector<int64_t> idx = permutation(src_rows, uint32_t(n));
        idx.resize(size_t(n));
        const unsigned char* src = src_store.data() + shift;

        std::vector<unsigned char> got(size_t(n) * rb + shift, 0xAB), want = got;
        mv::gather_rows(got.data() + shift, src, idx.data(), n, rb);
        for (int64_t i = 0; i < n; ++i)
          std::memcpy(want.data() + shift + size_t(i) * rb, src + size_t(idx[size_t(i)]) * rb, rb);
        EXPECT_EQ(got, want) << "gather rb=" << rb << " n=" << n << " shift=" << shift;

        std::vector<unsigned char> sgot(size_t(src_rows) * rb + shift, 0xCD), swant = sgot;
        mv::scatter_rows(sgot.data() + shift, src, idx.data(), n, rb);
        for (int64_t i = 0; i < n; ++i)
          std::memcpy(swant.data() + shift + size_t(idx[size_t(i)]) * rb, src + size_t(i) * rb, rb);
        EXPECT_EQ(sgot, swant) << "scatter rb=" << rb << " n=" << n << " shift=" << shift;
      }
    }
  }
}

TEST(Movement, NoRowsTouchesNothing) {
  // Zero rows (or zero-byte rows): null pointers are fine and nothing is read or written.
  mv::gather_rows(nullptr, nullptr, nullptr, 0, 16);
  mv::scatter_rows(nullptr, nullptr, nullptr, 0, 16);
  mv::gather_rows(nullptr, nullptr, nullptr, 5, 0);
  mv::pack_rows(nullptr, nullptr, 0, 3, 64, 16, 16);
  mv::pack_rows(nullptr, nullptr, 3, 0, 64, 16, 16);
  mv::unpack_rows(nullptr, nullptr, 0, 0, 0, 0, 4);
  mv::merge_partials(nullptr, nullptr, nullptr, nullptr, 0, 4, 4, 8);
  mv::merge_partials(nullptr, nullptr, nullptr, nullptr, 2, 0, 4, 8);
  mv::clear_partial(nullptr, 0, nullptr, 0);
  mv::weigh_partial(nullptr, nullptr, nullptr, nullptr, 1, 0, 2, 3);
  mv::unweigh_partial(nullptr, nullptr, nullptr, nullptr, 0, 1, 2, 3);
  SUCCEED();
}

// ---------------------------------------------------------------- pack / unpack

TEST(Movement, PackAndUnpackMatchLoops) {
  // The shapes of hybrid.cpp's exchange: a [B, seq, all_heads, dim] tensor of esz-byte elements
  // and the block [B, rows, heads, dim] at row0 / head0, plus odd sizes.
  struct Case {
    int64_t B, seq, all_heads, row0, rows, head0, heads, dim;
    size_t esz;
  };
  const Case cases[] = {{2, 9, 4, 0, 9, 2, 2, 8, 2}, {3, 7, 6, 2, 4, 1, 3, 5, 4},
                        {1, 5, 3, 1, 3, 0, 3, 3, 1}, {2, 4, 4, 4, 0, 0, 2, 8, 2},
                        {0, 4, 4, 0, 4, 0, 2, 8, 2}, {2, 33, 8, 5, 17, 4, 4, 64, 2},
                        {1, 6, 2, 0, 6, 1, 1, 1, 4}};
  for (const Case& c : cases) {
    const size_t row_stride = size_t(c.all_heads * c.dim) * c.esz;
    const size_t chunk = size_t(c.heads * c.dim) * c.esz;
    const size_t tensor_bytes = size_t(c.B * c.seq) * row_stride;
    auto tensor = random_bytes(tensor_bytes + 1, uint32_t(c.seq * 31 + c.dim));
    const size_t base = size_t(c.row0 * c.all_heads + c.head0) * size_t(c.dim) * c.esz;

    std::vector<unsigned char> got(size_t(c.B * c.rows) * chunk + 1, 0x11), want = got;
    mv::pack_rows(got.data(), tensor.data() + base, c.B, c.rows, size_t(c.seq) * row_stride,
                  row_stride, chunk);
    size_t off = 0;
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t s = 0; s < c.rows; ++s, off += chunk)
        std::memcpy(want.data() + off, tensor.data() + base + size_t(b * c.seq + s) * row_stride,
                    chunk);
    EXPECT_EQ(got, want) << "pack B=" << c.B << " rows=" << c.rows << " dim=" << c.dim;

    // Unpack a fresh buffer into the tensor and compare with the loop doing the same.
    const auto buf = random_bytes(got.size(), 99);
    auto t_got = tensor, t_want = tensor;
    mv::unpack_rows(t_got.data() + base, buf.data(), c.B, c.rows, size_t(c.seq) * row_stride,
                    row_stride, chunk);
    off = 0;
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t s = 0; s < c.rows; ++s, off += chunk)
        std::memcpy(t_want.data() + base + size_t(b * c.seq + s) * row_stride, buf.data() + off,
                    chunk);
    EXPECT_EQ(t_got, t_want) << "unpack B=" << c.B << " rows=" << c.rows << " dim=" << c.dim;
  }
}

// ---------------------------------------------------------------- partials

// A partial [B, S, H, Dv] / [B, H, S] with every kind of lse: finite (spread wide, so that the
// weights underflow in both directions), -inf (empty; its out is NaN or garbage, which must not
// leak), and rows equal between the sides.
struct Partials {
  int64_t B, S, H, Dv;
  std::vector<float> out_a, lse_a, out_b, lse_b;

  Partials(int64_t b, int64_t s, int64_t h, int64_t dv, uint32_t seed) : B(b), S(s), H(h), Dv(dv) {
    std::mt19937 gen(seed);
    std::uniform_real_distribution<float> val(-3.f, 3.f), lse(-100.f, 100.f);
    const size_t n_out = size_t(B * S * H * Dv), n_lse = size_t(B * H * S);
    for (auto* o : {&out_a, &out_b}) {
      o->resize(n_out);
      for (float& x : *o)
        x = val(gen);
    }
    for (auto* l : {&lse_a, &lse_b}) {
      l->resize(n_lse);
      for (float& x : *l)
        x = lse(gen);
    }
    for (size_t l = 0; l < n_lse; ++l) {
      switch (gen() % 6) {
        case 0:
          lse_a[l] = -INFINITY;
          break;
        case 1:
          lse_b[l] = -INFINITY;
          break;
        case 2:
          lse_a[l] = lse_b[l] = -INFINITY;
          break;
        case 3:
          lse_a[l] = lse_b[l];
          break;
        default:
          break;
      }
    }
    // Empty rows hold NaN in out: the merge must not let it through.
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t hh = 0; hh < H; ++hh) {
          const size_t l = size_t((b * H + hh) * S + s), row = size_t((b * S + s) * H + hh);
          for (int64_t d = 0; d < Dv; ++d) {
            if (lse_a[l] == -INFINITY) out_a[row * size_t(Dv) + size_t(d)] = NAN;
            if (lse_b[l] == -INFINITY) out_b[row * size_t(Dv) + size_t(d)] = NAN;
          }
        }
  }
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// merge_row (kernels/merge.h) over every row: the rule the Thrust functor must reproduce.
void merge_by_rows(Partials& p, const float* out_b, const float* lse_b) {
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t s = 0; s < p.S; ++s)
      for (int64_t h = 0; h < p.H; ++h) {
        const int64_t row = (b * p.S + s) * p.H + h, l = (b * p.H + h) * p.S + s;
        merge_row(p.out_a.data() + row * p.Dv, p.lse_a.data() + l, out_b + row * p.Dv, lse_b[l],
                  p.Dv);
      }
}

TEST(Movement, MergeIsMergeRowBitForBit) {
  for (auto [B, S, H, Dv] : {std::tuple{2, 37, 3, 48}, std::tuple{1, 1, 1, 1},
                             std::tuple{3, 5, 8, 7}, std::tuple{1, 200, 2, 128}}) {
    Partials got(B, S, H, Dv, uint32_t(S * 13 + Dv)), want = got;
    mv::merge_partials(got.out_a.data(), got.lse_a.data(), got.out_b.data(), got.lse_b.data(), B, S,
                       H, Dv);
    merge_by_rows(want, want.out_b.data(), want.lse_b.data());
    EXPECT_TRUE(same_bits(got.out_a, want.out_a)) << B << "x" << S << "x" << H << "x" << Dv;
    EXPECT_TRUE(same_bits(got.lse_a, want.lse_a)) << B << "x" << S << "x" << H << "x" << Dv;
    // The library's merge_partials (kernels/merge.cpp) is this same code.
    Partials lib(B, S, H, Dv, uint32_t(S * 13 + Dv));
    merge_partials(lib.out_a.data(), lib.lse_a.data(), lib.out_b.data(), lib.lse_b.data(), B, S, H,
                   Dv);
    EXPECT_TRUE(same_bits(lib.out_a, want.out_a));
    EXPECT_TRUE(same_bits(lib.lse_a, want.lse_a));
  }
}

TEST(Movement, MergeEdgeRows) {
  // One row each: the -inf cases spelled out, and no NaN from an empty side.
  const float nan = NAN, inf = INFINITY;
  struct Row {
    float o_a, lse_a, o_b, lse_b, o, lse;
  };
  const Row rows[] = {
      {nan, -inf, nan, -inf, nan, -inf},  // both empty: a stays empty (its out untouched)
      {nan, -inf, 2.f, 1.f, 2.f, 1.f},    // a empty: takes b
      {3.f, 1.f, nan, -inf, 3.f, 1.f},    // b empty: a unchanged
      {1.f, 0.f, 3.f, 0.f, 2.f, std::log(2.f)},
  };
  for (const Row& r : rows) {
    float o = r.o_a, lse = r.lse_a;
    mv::merge_partials(&o, &lse, &r.o_b, &r.lse_b, 1, 1, 1, 1);
    EXPECT_EQ(lse, r.lse);
    if (std::isnan(r.o))
      EXPECT_TRUE(std::isnan(o));
    else
      EXPECT_FLOAT_EQ(o, r.o);
  }
}

TEST(Movement, MergeInPlaceWithItself) {
  // out_b and lse_b may be out_a and lse_a: every row reads its b side before writing a.
  Partials got(2, 9, 3, 5, 7), want = got;
  mv::merge_partials(got.out_a.data(), got.lse_a.data(), got.out_a.data(), got.lse_a.data(), 2, 9,
                     3, 5);
  merge_by_rows(want, want.out_a.data(), want.lse_a.data());
  EXPECT_TRUE(same_bits(got.out_a, want.out_a));
  EXPECT_TRUE(same_bits(got.lse_a, want.lse_a));
}

TEST(Movement, ClearPartial) {
  for (int64_t n : {0, 1, 5, 1000}) {
    std::vector<float> out(size_t(n * 3) + 1, 7.f), lse(size_t(n) + 1, 7.f);
    mv::clear_partial(out.data(), n * 3, lse.data(), n);
    for (int64_t i = 0; i < n * 3; ++i)
      ASSERT_EQ(out[size_t(i)], 0.f);
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(lse[size_t(i)], -INFINITY);
    EXPECT_EQ(out.back(), 7.f);  // nothing past the end
    EXPECT_EQ(lse.back(), 7.f);
    EXPECT_FALSE(std::signbit(out[0]));  // +0, as memset wrote
  }
}

TEST(Movement, WeighAndUnweighMatchLoops) {
  // The tree decode's loops (src/decode.cpp before it called these), with m the max of two sides.
  for (auto [B, S, H, Dv] :
       {std::tuple{2, 3, 4, 16}, std::tuple{1, 1, 1, 1}, std::tuple{3, 2, 5, 7}}) {
    Partials p(B, S, H, Dv, uint32_t(B * 100 + Dv));
    const float* out = p.out_a.data();
    const float* lse = p.lse_a.data();
    std::vector<float> m(p.lse_a.size());
    for (size_t l = 0; l < m.size(); ++l)
      m[l] = std::fmax(p.lse_a[l], p.lse_b[l]);
    const size_t n_packed = size_t(B * S * H * (Dv + 1));
    std::vector<float> got(n_packed, 5.f), want(n_packed, 5.f);
    mv::weigh_partial(got.data(), out, lse, m.data(), B, S, H, Dv);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t h = 0; h < H; ++h) {
          const int64_t l = (b * H + h) * S + s, row = (b * S + s) * H + h;
          const float w = lse[l] == -INFINITY ? 0.f : std::exp(lse[l] - m[size_t(l)]);
          float* q = want.data() + row * (Dv + 1);
          for (int64_t d = 0; d < Dv; ++d)
            q[d] = w == 0.f ? 0.f : w * out[row * Dv + d];
          q[Dv] = w;
        }
    EXPECT_TRUE(same_bits(got, want));

    // Unweigh a "summed" payload: the weighed one, with some rows' weights zeroed (all empty).
    for (size_t r = 0; r < n_packed / size_t(Dv + 1); r += 3)
      want[r * size_t(Dv + 1) + size_t(Dv)] = 0.f;
    std::vector<float> o_got(p.out_a.size(), 9.f), l_got(p.lse_a.size(), 9.f);
    std::vector<float> o_want = o_got, l_want = l_got;
    mv::unweigh_partial(o_got.data(), l_got.data(), want.data(), m.data(), B, S, H, Dv);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t h = 0; h < H; ++h) {
          const int64_t l = (b * H + h) * S + s, row = (b * S + s) * H + h;
          const float* q = want.data() + row * (Dv + 1);
          const float den = q[Dv];
          for (int64_t d = 0; d < Dv; ++d)
            o_want[size_t(row * Dv + d)] = den > 0.f ? q[d] / den : 0.f;
          l_want[size_t(l)] = den > 0.f ? m[size_t(l)] + std::log(den) : -INFINITY;
        }
    EXPECT_TRUE(same_bits(o_got, o_want));
    EXPECT_TRUE(same_bits(l_got, l_want));
  }
}

TEST(Movement, AddSinksMatchesFloat64) {
  // lse' = log(exp(lse) + exp(sink)), out *= exp(lse - lse'); empty rows (lse = -inf, out
  // possibly NaN in Partials) get out = 0, lse' = sink. Sinks from far below to far above lse.
  const int64_t B = 2, S = 3, H = 5, Dv = 7;
  Partials p(B, S, H, Dv, 42);
  const std::vector<float> sinks = {-200.f, -3.f, 0.5f, 40.f, 150.f};
  std::vector<float> out = p.out_a, lse = p.lse_a;
  mv::add_sinks(out.data(), lse.data(), sinks.data(), B, S, H, Dv);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t l = (b * H + h) * S + s, row = (b * S + s) * H + h;
        const double la = p.lse_a[size_t(l)], sk = sinks[size_t(h)], m = std::max(la, sk);
        const double want_lse = m + std::log(std::exp(la - m) + std::exp(sk - m));
        EXPECT_NEAR(lse[size_t(l)], want_lse, 1e-5 * std::max(1.0, std::abs(want_lse))) << l;
        for (int64_t d = 0; d < Dv; ++d) {
          const size_t i = size_t(row * Dv + d);
          const double want = la == -INFINITY ? 0.0 : p.out_a[i] * std::exp(la - want_lse);
          EXPECT_NEAR(out[i], want, 1e-5 * std::max(1.0, std::abs(want))) << row << " " << d;
        }
      }
}

}  // namespace
}  // namespace dattn
