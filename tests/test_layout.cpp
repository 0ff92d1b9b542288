// Single-process tests of the contiguous layout (lengths, runs, positions, visibility, dispatch)
// and of the FLOP and ring byte models (src/models.h) against closed forms written here, for
// 1 to 8 ranks, including sequences that do not divide and ranks holding no token.
#include <gtest/gtest.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "src/error.h"
#include "src/layout.h"
#include "src/models.h"
#include "tests/test_reference.h"

namespace dattn {
namespace {

// Contiguous shard lengths written out: the first S % P ranks hold one token more.
int64_t expected_len(int64_t S, int P, int r) {
  return S / P + (r < S % P ? 1 : 0);
}
int64_t expected_begin(int64_t S, int P, int r) {
  int64_t b = 0;
  for (int i = 0; i < r; ++i)
    b += expected_len(S, P, i);
  return b;
}

const int64_t kSeqs[] = {0, 1, 2, 3, 5, 8, 13, 24, 31, 64, 100};

TEST(ContiguousLayout, LengthsRunsAndPositions) {
  for (int P = 1; P <= 8; ++P) {
    for (int64_t S : kSeqs) {
      SCOPED_TRACE(testing::Message() << "S=" << S << " P=" << P);
      Layout l = Layout::contiguous(S, P);
      EXPECT_EQ(l.kind(), Layout::Kind::contiguous);
      EXPECT_EQ(l.ranks(), P);
      EXPECT_EQ(l.global_seq(), S);
      int64_t total = 0, max_len = 0;
      for (int r = 0; r < P; ++r) {
        ASSERT_EQ(l.local_len(r), expected_len(S, P, r)) << "rank " << r;
        total += l.local_len(r);
        max_len = std::max(max_len, l.local_len(r));
        int64_t covered = 0;
        for (const dattn::Run& run : l.runs(r))
          covered += run.length;
        EXPECT_EQ(covered, l.local_len(r));
        for (int64_t i = 0; i < l.local_len(r); ++i)
          ASSERT_EQ(l.global_position(r, i), expected_begin(S, P, r) + i) << "rank " << r;
      }
      EXPECT_EQ(total, S);
      EXPECT_EQ(l.max_local_len(), max_len);
    }
  }
  EXPECT_EQ(Layout::contiguous(4096, 4).str(), "contiguous(S=4096, P=4)");
}

TEST(ContiguousLayout, HashSeparatesConfigurations) {
  EXPECT_EQ(Layout::contiguous(100, 4).hash(), Layout::contiguous(100, 4).hash());
  EXPECT_NE(Layout::contiguous(100, 4).hash(), Layout::contiguous(101, 4).hash());
  EXPECT_NE(Layout::contiguous(100, 4).hash(), Layout::contiguous(100, 3).hash());
}

TEST(ContiguousLayout, AnyVisible) {
  for (int P = 1; P <= 6; ++P) {
    for (int64_t S : kSeqs) {
      Layout l = Layout::contiguous(S, P);
      for (int qr = 0; qr < P; ++qr) {
        for (int kr = 0; kr < P; ++kr) {
          SCOPED_TRACE(testing::Message() << "S=" << S << " P=" << P << " q" << qr << " k" << kr);
          const bool both = l.local_len(qr) > 0 && l.local_len(kr) > 0;
          EXPECT_EQ(l.any_visible(Mask::none(), qr, kr), both);
          EXPECT_EQ(l.any_visible(Mask::causal(), qr, kr), both && kr <= qr);
        }
      }
    }
  }
}

TEST(ContiguousLayout, DispatchTakesTheRanksRows) {
  const int64_t B = 2, S = 11, H = 3, D = 4;
  for (DType dt : {DType::f32, DType::bf16}) {
    Tensor g = test::random_tensor({B, S, H, D}, dt, 5);
    for (int P : {1, 3, 4, 12}) {
      Layout l = Layout::contiguous(S, P);
      for (int r = 0; r < P; ++r) {
        Tensor s = l.dispatch(g, r);
        ASSERT_EQ(s.dim(), 4);
        ASSERT_EQ(s.size(0), B);
        ASSERT_EQ(s.size(1), l.local_len(r));
        ASSERT_EQ(s.size(2), H);
        ASSERT_EQ(s.size(3), D);
        EXPECT_EQ(s.dtype(), dt);
        for (int64_t b = 0; b < B; ++b)
          for (int64_t i = 0; i < s.size(1); ++i) {
            const int64_t gi = l.global_position(r, i);
            EXPECT_EQ(
                std::memcmp(
                    static_cast<char*>(s.data()) + (b * s.size(1) + i) * H * D * dtype_size(dt),
                    static_cast<char*>(g.data()) + (b * S + gi) * H * D * dtype_size(dt),
                    H * D * dtype_size(dt)),
                0)
                << "P=" << P << " r=" << r << " b=" << b << " i=" << i;
          }
      }
    }
  }
}

// A rank outside the layout is a dattn::Error naming the rank (DESIGN: library code throws
// dattn::Error), not a std::out_of_range from a container, wherever it is passed.
TEST(ContiguousLayout, RankOutOfRangeIsADattnError) {
  Layout l = Layout::contiguous(10, 2);
  auto check = [](auto&& f, const char* call) {
    try {
      f();
      ADD_FAILURE() << call << " did not throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("rank"), std::string::npos) << call << ": " << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << call << " threw a non-dattn exception: " << e.what();
    }
  };
  check([&] { l.local_len(2); }, "local_len(2)");
  check([&] { l.dispatch(Tensor::zeros({1, 10, 1, 1}, DType::f32), 2); }, "dispatch(g, 2)");
  check([&] { l.global_position(2, 0); }, "global_position(2, 0)");
  check([&] { l.global_position(-1, 0); }, "global_position(-1, 0)");
  check([&] { l.any_visible(Mask::causal(), 0, 3); }, "any_visible(causal, 0, 3)");
  check([&] { l.runs(2); }, "runs(2)");
}

// ---------------------------------------------------------------- ring byte model

// ring_forwards from first principles: the block of `origin` is sent on at `step` iff one of
// the ranks it has not reached yet, origin + step + 1 .. origin + P - 1, holds a query at a
// position that sees one of its keys.
bool forwards_brute_force(int64_t S, int P, const Mask& mask, int origin, int step) {
  if (step >= P - 1) return false;
  const int64_t kb = expected_begin(S, P, origin), kn = expected_len(S, P, origin);
  for (int a = step + 1; a <= P - 1; ++a) {
    const int r = (origin + a) % P;
    const int64_t qb = expected_begin(S, P, r), qn = expected_len(S, P, r);
    for (int64_t i = qb; i < qb + qn; ++i)
      for (int64_t j = kb; j < kb + kn; ++j)
        if (mask.visible(i, j)) return true;
  }
  return false;
}

// Every layout places each global token exactly once; zigzag holds chunks r and 2P-1-r of 2P
// equal chunks (lengths differ by at most one), striped holds r, r+P, ...
TEST(Layouts, EveryTokenOnceAndTheDocumentedPlaces) {
  for (int P : {1, 2, 3, 4, 7}) {
    for (int64_t S : {int64_t(0), int64_t(1), int64_t(P - 1), int64_t(2 * P), int64_t(37)}) {
      for (const char* kind : {"contiguous", "zigzag", "striped"}) {
        SCOPED_TRACE(testing::Message() << kind << " S=" << S << " P=" << P);
        const Layout l = Layout::make(kind, S, P);
        EXPECT_EQ(std::string(Layout::kind_name(l.kind())), kind);
        std::vector<int> seen(static_cast<size_t>(S), 0);
        int64_t total = 0;
        for (int r = 0; r < P; ++r) {
          total += l.local_len(r);
          for (int64_t i = 0; i < l.local_len(r); ++i) {
            const int64_t g = l.global_position(r, i);
            ASSERT_GE(g, 0);
            ASSERT_LT(g, S);
            seen[size_t(g)] += 1;
            if (std::string(kind) == "striped") {
              EXPECT_EQ(g % P, r);
            }
          }
        }
        EXPECT_EQ(total, S);
        for (int64_t g = 0; g < S; ++g)
          EXPECT_EQ(seen[size_t(g)], 1) << "token " << g;
      }
      const Layout z = Layout::zigzag(S, P);
      for (int r = 0; r < P; ++r) {
        const int64_t chunk = S / (2 * P);
        ASSERT_EQ(z.runs(r).size(), 2u);
        EXPECT_GE(z.runs(r)[0].length, chunk);
        EXPECT_LE(z.runs(r)[0].length, chunk + 1);
        if (S % (2 * P) == 0) {
          EXPECT_EQ(z.runs(r)[0].global_begin, r * chunk);
          EXPECT_EQ(z.runs(r)[1].global_begin, (2 * P - 1 - r) * chunk);
        }
      }
    }
  }
  EXPECT_THROW(Layout::make("diagonal", 8, 2), Error);
  EXPECT_NE(Layout::zigzag(8, 2).hash(), Layout::contiguous(8, 2).hash());
  EXPECT_NE(Layout::striped(8, 2).hash(), Layout::zigzag(8, 2).hash());
}

TEST(RingModel, ForwardsMatchesFirstPrinciples) {
  for (int P = 1; P <= 8; ++P)
    for (int64_t S : kSeqs)
      for (Mask m : {Mask::none(), Mask::causal()}) {
        Layout l = Layout::contiguous(S, P);
        for (int o = 0; o < P; ++o)
          for (int s = 0; s < P + 1; ++s)
            ASSERT_EQ(ring_forwards(l, m, o, s), forwards_brute_force(S, P, m, o, s))
                << "S=" << S << " P=" << P << " " << m.str() << " origin=" << o << " step=" << s;
      }
}

// The closed forms of the ring's send volume.
//   non-causal, S % P == 0, D_v == D: (P - 1) * 2 * B * (S/P) * H_kv * D * size
//   causal, contiguous, every rank non-empty (S >= P): at step s (0 .. P-2) rank r forwards the
//     block it holds, origin (r - s) mod P, iff s <= r <= P - 2.
uint64_t ring_bytes_noncausal_divisible(int64_t S, int P, int64_t B, int64_t Hkv, int64_t D,
                                        DType dt) {
  return uint64_t(P - 1) * 2 * uint64_t(B) * uint64_t(S / P) * uint64_t(Hkv) * uint64_t(D) *
         dtype_size(dt);
}
uint64_t ring_bytes_causal(int64_t S, int P, int r, int64_t B, int64_t Hkv, int64_t D, int64_t Dv,
                           DType dt) {
  uint64_t bytes = 0;
  for (int s = 0; s <= P - 2; ++s) {
    if (!(s <= r && r <= P - 2)) continue;
    const int origin = ((r - s) % P + P) % P;
    bytes += uint64_t(B * expected_len(S, P, origin) * Hkv * (D + Dv)) * dtype_size(dt);
  }
  return bytes;
}

TEST(RingModel, SendBytesMatchClosedForms) {
  for (int P = 1; P <= 8; ++P) {
    for (int64_t S : {int64_t(P) * 16, int64_t(P) * 7 + 3, int64_t(P), int64_t(P) + 1}) {
      for (DType dt : {DType::f32, DType::bf16}) {
        for (int64_t Dv : {int64_t(0), int64_t(96)}) {
          SCOPED_TRACE(testing::Message()
                       << "S=" << S << " P=" << P << " " << dtype_name(dt) << " Dv=" << Dv);
          AttnSpec spec;
          spec.heads_q = 8;
          spec.heads_kv = 2;
          spec.head_dim = 64;
          spec.head_dim_v = Dv;
          const int64_t B = 2, dv = spec.dim_v();
          Layout l = Layout::contiguous(S, P);
          for (int r = 0; r < P; ++r) {
            spec.mask = Mask::none();
            uint64_t nc = 0;  // every non-empty block makes P - 1 hops
            for (int s = 0; s <= P - 2; ++s)
              nc += uint64_t(B * expected_len(S, P, ((r - s) % P + P) % P) * 2 * (64 + dv)) *
                    dtype_size(dt);
            EXPECT_EQ(ring_send_bytes(l, spec, B, dt, r), nc) << "rank " << r;
            if (S % P == 0 && Dv == 0) {
              EXPECT_EQ(ring_send_bytes(l, spec, B, dt, r),
                        ring_bytes_noncausal_divisible(S, P, B, 2, 64, dt))
                  << "rank " << r;
            }
            spec.mask = Mask::causal();
            EXPECT_EQ(ring_send_bytes(l, spec, B, dt, r),
                      ring_bytes_causal(S, P, r, B, 2, 64, dv, dt))
                << "rank " << r;
          }
        }
      }
    }
  }
}

TEST(Models, AttentionFlops) {
  AttnSpec spec;
  spec.heads_q = 8;
  spec.heads_kv = 2;
  spec.head_dim = 128;
  EXPECT_DOUBLE_EQ(attention_flops(2, 1024, 1024, spec), 4.0 * 2 * 8 * 1024 * 1024 * 128);
  spec.mask = Mask::causal();
  EXPECT_DOUBLE_EQ(attention_flops(2, 1024, 1024, spec), 2.0 * 2 * 8 * 1024 * 1024 * 128);
  spec.mask = Mask::none();
  spec.head_dim = 192;
  spec.head_dim_v = 128;
  EXPECT_DOUBLE_EQ(attention_flops(1, 10, 30, spec), 2.0 * 8 * 10 * 30 * (192 + 128));
}

}  // namespace
}  // namespace dattn
