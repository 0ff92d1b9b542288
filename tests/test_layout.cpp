// Single-process tests of the layouts (contiguous, zigzag, striped blocks, varlen, grouped:
// lengths, runs, positions, visibility, dispatch) and of the FLOP, byte and load-balance models
// (src/models.h) against closed forms written here, for 1 to 8 ranks, including sequences that do
// not divide and ranks holding no token.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "src/base/error.h"
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

// ---------------------------------------------------------------- striped blocks and varlen

// Checks that every global token of l sits on exactly one rank, at one local row, and that local
// lengths add up; returns the rank of every token.
std::vector<int> owners(const Layout& l) {
  const int64_t S = l.global_seq();
  std::vector<int> owner(static_cast<size_t>(S), -1);
  int64_t total = 0;
  for (int r = 0; r < l.ranks(); ++r) {
    int64_t covered = 0;
    for (const dattn::Run& run : l.runs(r))
      covered += run.length;
    EXPECT_EQ(covered, l.local_len(r)) << "rank " << r;
    total += l.local_len(r);
    for (int64_t i = 0; i < l.local_len(r); ++i) {
      const int64_t g = l.global_position(r, i);
      EXPECT_TRUE(g >= 0 && g < S) << "rank " << r << " row " << i << " at " << g;
      if (g < 0 || g >= S) continue;
      EXPECT_EQ(owner[size_t(g)], -1)
          << "token " << g << " on ranks " << owner[size_t(g)] << " and " << r;
      owner[size_t(g)] = r;
    }
  }
  EXPECT_EQ(total, S);
  for (int64_t g = 0; g < S; ++g)
    EXPECT_NE(owner[size_t(g)], -1) << "token " << g << " on no rank";
  return owner;
}

TEST(StripedLayout, BlocksRoundRobin) {
  for (int P : {1, 2, 3, 4, 5}) {
    for (int64_t block : {1, 3, 16}) {
      for (int64_t S : {int64_t(0), int64_t(1), int64_t(block * P), int64_t(block * P * 3 + 1),
                        int64_t(block * P * 2 - 1), int64_t(97), int64_t(200)}) {
        SCOPED_TRACE(testing::Message() << "S=" << S << " P=" << P << " block=" << block);
        const Layout l = Layout::striped(S, P, block);
        EXPECT_EQ(l.kind(), Layout::Kind::striped);
        EXPECT_EQ(l.global_seq(), S);
        const std::vector<int> owner = owners(l);
        for (int64_t g = 0; g < S; ++g)
          ASSERT_EQ(owner[size_t(g)], int((g / block) % P)) << "token " << g;
        // Each rank's tokens in increasing order (what the kernel's position rule gives).
        for (int r = 0; r < P; ++r)
          for (int64_t i = 1; i < l.local_len(r); ++i)
            ASSERT_LT(l.global_position(r, i - 1), l.global_position(r, i)) << "rank " << r;
      }
    }
  }
  EXPECT_NE(Layout::striped(64, 4, 1).hash(), Layout::striped(64, 4, 3).hash());
  EXPECT_NE(Layout::striped(64, 4, 3).str(), Layout::striped(64, 4, 16).str());
  EXPECT_THROW(Layout::striped(64, 4, 0), Error);
}

// Whole blocks of b tokens placed contiguously: rank r holds blocks [r nb / P, (r + 1) nb / P) of
// the nb = ceil(S / b) blocks (the last may be partial), so every rank's first position is a
// multiple of b, ranks hold consecutive ranges in rank order, every token sits on one rank, and
// with more ranks than blocks some ranks hold nothing.
TEST(BlocksLayout, WholeBlocksContiguous) {
  for (int P : {1, 2, 3, 4, 5, 8}) {
    for (int64_t block : {1, 3, 16}) {
      for (int64_t S :
           {int64_t(0), int64_t(1), int64_t(block - 1), int64_t(block), int64_t(block * P),
            int64_t(block * P + 1), int64_t(block * 3 - 1), int64_t(97), int64_t(301)}) {
        SCOPED_TRACE(testing::Message() << "S=" << S << " P=" << P << " block=" << block);
        const Layout l = Layout::blocks(S, P, block);
        EXPECT_EQ(l.kind(), Layout::Kind::blocks);
        EXPECT_EQ(std::string(Layout::kind_name(l.kind())), "blocks");
        EXPECT_EQ(l.global_seq(), S);
        EXPECT_EQ(l.ranks(), P);
        EXPECT_EQ(l.block(), block);
        const std::vector<int> owner = owners(l);  // every token exactly once
        const int64_t nb = (S + block - 1) / block;
        int64_t next = 0;  // where the next rank's range must begin
        int holders = 0;
        for (int r = 0; r < P; ++r) {
          const int64_t first_block = r * nb / P, end_block = (r + 1) * nb / P;
          const int64_t expect_len =
              std::min(S, end_block * block) - std::min(S, first_block * block);
          ASSERT_EQ(l.local_len(r), expect_len) << "rank " << r;
          if (expect_len == 0) continue;
          holders += 1;
          const int64_t first = l.global_position(r, 0);
          EXPECT_EQ(first % block, 0) << "rank " << r << " starts inside a block at " << first;
          EXPECT_EQ(first, first_block * block) << "rank " << r;
          EXPECT_EQ(first, next) << "rank " << r << " does not continue rank " << r - 1;
          for (int64_t i = 0; i < l.local_len(r); ++i)
            ASSERT_EQ(l.global_position(r, i), first + i) << "rank " << r << " row " << i;
          // Whole blocks: the range ends at a block boundary or at the end of the context.
          const int64_t end = first + l.local_len(r);
          EXPECT_TRUE(end % block == 0 || end == S) << "rank " << r << " ends at " << end;
          next = end;
        }
        EXPECT_EQ(next, S);
        EXPECT_EQ(holders, int(std::min<int64_t>(nb, P)));
        if (nb < P) {  // more ranks than blocks: some hold nothing, nothing breaks
          int empty = 0;
          for (int r = 0; r < P; ++r)
            empty += l.local_len(r) == 0 ? 1 : 0;
          EXPECT_EQ(empty, P - int(nb));
        }
        // Dispatch takes each rank's rows.
        if (S > 0) {
          Tensor g = Tensor::empty({1, S, 1, 1}, DType::f32);
          for (int64_t i = 0; i < S; ++i)
            g.set(i, float(i));
          for (int r = 0; r < P; ++r) {
            const Tensor shard = l.dispatch(g, r);
            ASSERT_EQ(shard.size(1), l.local_len(r));
            for (int64_t i = 0; i < shard.size(1); ++i)
              ASSERT_EQ(shard.get(i), float(l.global_position(r, i)));
          }
        }
      }
    }
  }
  // The block size is part of the layout's identity.
  EXPECT_NE(Layout::blocks(64, 4, 8).hash(), Layout::blocks(64, 4, 16).hash());
  EXPECT_NE(Layout::blocks(64, 4, 16).hash(), Layout::contiguous(64, 4).hash());
  EXPECT_NE(Layout::blocks(64, 4, 16).hash(), Layout::striped(64, 4, 16).hash());
  EXPECT_NE(Layout::blocks(64, 4, 8).str(), Layout::blocks(64, 4, 16).str());
  for (int64_t bad : {int64_t(0), int64_t(-1)})
    EXPECT_TRUE(
        test::throws_naming([&] { Layout::blocks(64, 4, bad); }, {"block", std::to_string(bad)}));
}

// The zigzag chunking rule for one document: 2P chunks, the first len % 2P one token longer.
int64_t chunk_begin(int64_t begin, int64_t len, int P, int c) {
  const int64_t base = len / (2 * P), extra = len % (2 * P);
  return begin + c * base + std::min<int64_t>(c, extra);
}

TEST(VarlenLayout, DocumentChunksRAnd2PMinus1MinusR) {
  const std::vector<std::vector<int64_t>> cus = {
      {0, 64},                               // one document
      {0, 1, 2, 3},                          // 1-token documents only
      {0, 5, 6, 40, 41, 100},                // 1-token documents between longer ones
      {0, 3, 10, 13, 50},                    // documents shorter than 2P
      {0, 17, 34, 35, 99, 128, 129},         // uneven lengths
      {0, 0, 5, 5, 5, 6, 40, 40, 100, 100},  // empty documents (repeated boundaries)
  };
  for (int P : {1, 2, 3, 4, 6}) {
    for (const auto& cu : cus) {
      SCOPED_TRACE(testing::Message()
                   << "P=" << P << " docs=" << cu.size() - 1 << " S=" << cu.back());
      const Layout l = Layout::varlen(cu, P);
      EXPECT_EQ(l.kind(), Layout::Kind::varlen);
      EXPECT_EQ(l.global_seq(), cu.back());
      EXPECT_EQ(l.ranks(), P);
      const std::vector<int> owner = owners(l);
      for (size_t d = 0; d + 1 < cu.size(); ++d) {
        const int64_t begin = cu[d], len = cu[d + 1] - cu[d];
        for (int c = 0; c < 2 * P; ++c) {
          const int expect = c < P ? c : 2 * P - 1 - c;
          for (int64_t g = chunk_begin(begin, len, P, c); g < chunk_begin(begin, len, P, c + 1);
               ++g)
            ASSERT_EQ(owner[size_t(g)], expect)
                << "document " << d << " chunk " << c << " token " << g;
        }
      }
      // A document mask on the same boundaries: ranks see each other only through documents.
      const Mask m = Mask::document(cu, false);
      for (int qr = 0; qr < P; ++qr)
        for (int kr = 0; kr < P; ++kr) {
          bool any = false;
          for (int64_t i = 0; i < l.local_len(qr) && !any; ++i)
            for (int64_t j = 0; j < l.local_len(kr) && !any; ++j)
              any = m.visible(l.global_position(qr, i), l.global_position(kr, j));
          if (any) {
            EXPECT_TRUE(l.any_visible(m, qr, kr)) << "q" << qr << " k" << kr;
          }
        }
    }
  }
  EXPECT_NE(Layout::varlen({0, 5, 10}, 2).hash(), Layout::varlen({0, 4, 10}, 2).hash());
  EXPECT_NE(Layout::varlen({0, 10}, 2).hash(), Layout::zigzag(10, 2).hash());
}

TEST(VarlenLayout, BadCuSeqlensIsADattnErrorNamingCuSeqlens) {
  for (const std::vector<int64_t>& cu :
       std::vector<std::vector<int64_t>>{{1, 5, 9}, {0, 5, 4, 9}, {0, 7, 3}, {0}, {}}) {
    try {
      Layout::varlen(cu, 2);
      ADD_FAILURE() << "varlen with " << cu.size() << " bad cu_seqlens did not throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("cu_seqlens"), std::string::npos) << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "threw a non-dattn exception: " << e.what();
    }
  }
}

// Empty documents (repeated boundaries) hold no token: the runs are those of the boundaries
// without them, no run is empty, and only the printed document count differs.
TEST(VarlenLayout, EmptyDocumentsAddNoRuns) {
  for (int P : {1, 2, 3, 4}) {
    for (const auto& [name, cu] : test::empty_documents_cases(50)) {
      SCOPED_TRACE(testing::Message() << "P=" << P << " " << name);
      const Layout l = Layout::varlen(cu, P);
      const Layout w = Layout::varlen(test::without_empty_documents(cu), P);
      EXPECT_EQ(l.global_seq(), 50);
      EXPECT_EQ(l.max_local_len(), w.max_local_len());
      for (int r = 0; r < P; ++r) {
        ASSERT_EQ(l.runs(r).size(), w.runs(r).size()) << "rank " << r;
        for (size_t i = 0; i < l.runs(r).size(); ++i) {
          const dattn::Run &a = l.runs(r)[i], &b = w.runs(r)[i];
          EXPECT_GT(a.length, 0) << "rank " << r << " run " << i;
          EXPECT_TRUE(a.local_begin == b.local_begin && a.global_begin == b.global_begin &&
                      a.stride == b.stride && a.length == b.length && a.block == b.block)
              << "rank " << r << " run " << i;
        }
      }
      EXPECT_NE(l.str().find("docs=" + std::to_string(cu.size() - 1)), std::string::npos)
          << l.str();
    }
  }
}

// ---------------------------------------------------------------- grouped layouts (hybrid)

TEST(GroupedLayout, GroupsConcatenateTheirRanksRuns) {
  std::vector<Layout> layouts;
  for (int P : {1, 2, 4, 6}) {
    for (int64_t S : {int64_t(0), int64_t(1), int64_t(3 * P + 1), int64_t(8 * P), int64_t(50)}) {
      layouts.push_back(Layout::contiguous(S, P));
      layouts.push_back(Layout::zigzag(S, P));
      layouts.push_back(Layout::striped(S, P, 1));
      layouts.push_back(Layout::striped(S, P, 3));
    }
    layouts.push_back(Layout::varlen({0, 1, 9, 10, 37}, P));
  }
  for (const Layout& l : layouts) {
    const int P = l.ranks();
    for (int U = 1; U <= P; ++U) {
      if (P % U != 0) continue;
      SCOPED_TRACE(testing::Message() << l.str() << " U=" << U);
      const Layout g = l.grouped(U);
      ASSERT_EQ(g.ranks(), P / U);
      EXPECT_EQ(g.global_seq(), l.global_seq());
      for (int grp = 0; grp < P / U; ++grp) {
        std::vector<dattn::Run> expect;
        int64_t offset = 0, len = 0;
        for (int r = grp * U; r < grp * U + U; ++r) {
          for (dattn::Run run : l.runs(r)) {
            run.local_begin += offset;
            expect.push_back(run);
          }
          // Positions preserved: member r's row i is the group's row offset + i.
          for (int64_t i = 0; i < l.local_len(r); ++i)
            ASSERT_EQ(g.global_position(grp, offset + i), l.global_position(r, i))
                << "group " << grp << " member " << r << " row " << i;
          offset += l.local_len(r);
          len += l.local_len(r);
        }
        EXPECT_EQ(g.local_len(grp), len) << "group " << grp;
        const auto& got = g.runs(grp);
        ASSERT_EQ(got.size(), expect.size()) << "group " << grp;
        for (size_t i = 0; i < got.size(); ++i) {
          EXPECT_EQ(got[i].local_begin, expect[i].local_begin) << "group " << grp << " run " << i;
          EXPECT_EQ(got[i].global_begin, expect[i].global_begin) << "group " << grp << " run " << i;
          EXPECT_EQ(got[i].stride, expect[i].stride) << "group " << grp << " run " << i;
          EXPECT_EQ(got[i].block, expect[i].block) << "group " << grp << " run " << i;
          EXPECT_EQ(got[i].length, expect[i].length) << "group " << grp << " run " << i;
        }
      }
    }
  }
  // A group size that does not divide the ranks is an error.
  EXPECT_THROW(Layout::contiguous(16, 4).grouped(3), Error);
  EXPECT_THROW(Layout::contiguous(16, 4).grouped(0), Error);
}

// ---------------------------------------------------------------- FLOP model per rank

double max_over_mean(const std::vector<double>& f) {
  const double mean = std::accumulate(f.begin(), f.end(), 0.0) / double(f.size());
  return *std::max_element(f.begin(), f.end()) / mean;
}

// Causal attention at P = 4: zigzag and striped spread the work evenly, contiguous does not (the
// last rank computes about 7/4 of the mean).
TEST(LoadBalanceModel, CausalZigzagAndStripedBalanceContiguousDoesNot) {
  const int P = 4;
  const int64_t S = 16384, B = 1;
  AttnSpec spec;
  spec.heads_q = 8;
  spec.heads_kv = 8;
  spec.head_dim = 128;
  spec.mask = Mask::causal();
  for (const char* kind : {"contiguous", "zigzag", "striped"}) {
    SCOPED_TRACE(kind);
    const Layout l = Layout::make(kind, S, P);
    std::vector<double> f;
    for (int r = 0; r < P; ++r)
      f.push_back(attention_rank_flops(Strategy::ring, l, spec, B, 1, r));
    for (int r = 0; r < P; ++r)
      EXPECT_GT(f[size_t(r)], 0) << "rank " << r;
    // Whole tiles: at least the exact causal work, at most the non-causal work.
    const double sum = std::accumulate(f.begin(), f.end(), 0.0);
    AttnSpec full = spec;
    full.mask = Mask::none();
    EXPECT_GE(sum, attention_flops(B, S, S, spec) * (double(S + 1) / double(S)) * (1 - 1e-12));
    EXPECT_LE(sum, attention_flops(B, S, S, full) * (1 + 1e-12));
    const double balance = max_over_mean(f);
    if (std::string(kind) == "contiguous") {
      EXPECT_GT(balance, 1.5);
    } else {
      EXPECT_LE(balance, 1.05);
    }
    // Ulysses: every rank attends the whole sequence for H / P heads, the same work everywhere.
    std::vector<double> u;
    for (int r = 0; r < P; ++r)
      u.push_back(attention_rank_flops(Strategy::ulysses, l, spec, B, P, r));
    EXPECT_NEAR(max_over_mean(u), 1.0, 1e-9);
  }
}

// 32 documents of random lengths after a shared prefix of S / 8 (test::shared_prefix_mask).
Mask random_shared_prefix(int64_t S, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t prefix = S / 8;
  std::vector<int64_t> cu = {prefix, S};
  for (int d = 1; d < 32; ++d)
    cu.push_back(prefix + int64_t(rng() % uint64_t(S - prefix)));
  std::sort(cu.begin(), cu.end());
  return test::shared_prefix_mask(prefix, cu);
}

// Layout::balanced: every token once, floor or ceil of chunks / P chunks per rank in position
// order, one run per chunk; on random 32-document shared-prefix masks at 4 ranks its max/mean
// rank FLOPs is at most 1.05, no worse than zigzag's and better than contiguous's.
TEST(BalancedLayout, ChunksDealtByTheirWork) {
  AttnSpec spec;
  spec.heads_q = 8;
  spec.heads_kv = 2;
  spec.head_dim = 128;
  const int64_t S = 16384, chunk = 256, n = S / chunk;
  for (uint64_t seed = 1; seed <= 5; ++seed) {
    spec.mask = random_shared_prefix(S, seed);
    for (int P : {1, 2, 3, 4}) {
      SCOPED_TRACE(testing::Message() << "seed " << seed << " P=" << P);
      const Layout l = Layout::balanced(spec.mask, S, P, chunk);
      EXPECT_EQ(l.kind(), Layout::Kind::balanced);
      EXPECT_EQ(l.str(), "balanced(S=16384, P=" + std::to_string(P) + ", chunk=256)");
      owners(l);
      for (int r = 0; r < P; ++r) {
        const std::vector<dattn::Run>& runs = l.runs(r);
        EXPECT_TRUE(int64_t(runs.size()) == n / P || int64_t(runs.size()) == n / P + 1);
        for (size_t i = 0; i < runs.size(); ++i) {
          EXPECT_EQ(runs[i].length, chunk);
          EXPECT_EQ(runs[i].global_begin % chunk, 0);
          if (i > 0) {
            EXPECT_GT(runs[i].global_begin, runs[i - 1].global_begin);
          }
        }
      }
      if (P != 4) continue;
      std::vector<double> f;
      for (int r = 0; r < P; ++r)
        f.push_back(attention_rank_flops(Strategy::ring, l, spec, 1, 1, r));
      std::vector<double> z, c;
      for (int r = 0; r < P; ++r) {
        z.push_back(attention_rank_flops(Strategy::ring, Layout::zigzag(S, P), spec, 1, 1, r));
        c.push_back(attention_rank_flops(Strategy::ring, Layout::contiguous(S, P), spec, 1, 1, r));
      }
      EXPECT_LE(max_over_mean(f), 1.05);
      EXPECT_LE(max_over_mean(f), max_over_mean(z));
      EXPECT_LT(max_over_mean(f), max_over_mean(c));
      // The dealing depends on the mask, and the hash follows it.
      EXPECT_NE(l.hash(), Layout::balanced(Mask::causal(), S, P, chunk).hash());
    }
  }
  // A partial last chunk, more ranks than chunks, and a bad chunk.
  const Layout l = Layout::balanced(Mask::causal(), 1000, 3, 300);
  owners(l);
  EXPECT_EQ(l.local_len(0) + l.local_len(1) + l.local_len(2), 1000);
  owners(Layout::balanced(Mask::none(), 700, 8, 300));
  EXPECT_TRUE(test::throws_naming([] { Layout::balanced(Mask::causal(), 100, 2, 0); }, {"chunk"}));
  EXPECT_TRUE(test::throws_naming([] { Layout::balanced(Mask::causal(), 10000, 2, 2); },
                                  {"chunk", "at least global_seq / 4096 = 3"}));
}

// Without a mask nothing is skipped: the ranks' FLOPs add up to the whole problem's, for every
// strategy.
TEST(LoadBalanceModel, NoMaskRankFlopsSumToTheTotal) {
  AttnSpec spec;
  spec.heads_q = 8;
  spec.heads_kv = 4;
  spec.head_dim = 64;
  spec.head_dim_v = 32;
  const int64_t B = 2, S = 3000;
  for (int P : {1, 2, 4}) {
    for (const char* kind : {"contiguous", "zigzag", "striped"}) {
      const Layout l = Layout::make(kind, S, P);
      struct SU {
        Strategy s;
        int u;
      };
      std::vector<SU> sus = {{Strategy::ring, 1}, {Strategy::ulysses, P}};
      if (P % 2 == 0) sus.push_back({Strategy::hybrid, 2});
      for (const SU& su : sus) {
        SCOPED_TRACE(testing::Message()
                     << kind << " P=" << P << " " << strategy_name(su.s) << " U=" << su.u);
        double sum = 0;
        for (int r = 0; r < P; ++r)
          sum += attention_rank_flops(su.s, l, spec, B, su.u, r);
        EXPECT_NEAR(sum, attention_flops(B, S, S, spec), 1e-9 * attention_flops(B, S, S, spec));
      }
    }
  }
}

}  // namespace
}  // namespace dattn
