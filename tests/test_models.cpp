// The closed-form FLOP and byte models (src/models.h) against direct counts written here: the
// kernel tiles walked one by one, the ring's hops found by ring_forwards step by step, the
// visible pairs counted per query; on random small problems of every layout, mask and strategy,
// plus the large case the models exist for (S = 2^30 on 1024 ranks) and sizes that overflow.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/attention_cpu.h"
#include "src/base/error.h"
#include "src/layout.h"
#include "src/models.h"
#include "tests/test_reference.h"

namespace dattn {
namespace {

// ---------------------------------------------------------------- direct counts

// Visible (query, key) pairs of positions 0.. on both sides, one query at a time.
double pairs_flops(int64_t batch, int64_t seq_q, int64_t seq_k, const AttnSpec& spec) {
  double f = 2.0 * double(batch) * double(spec.heads_q) * double(seq_q) * double(seq_k) *
             double(spec.head_dim + spec.dim_v());
  if (spec.mask.is_none()) return f;
  if (spec.mask.is_causal()) return f / 2;
  double pairs = 0;
  if (spec.mask.slices) {  // row i of a slice: keys from k_begin + i (lower) to k_end - 1 - its
                           // distance from the last row (upper)
    for (const MaskSlice& sl : *spec.mask.slices)
      for (int64_t q = sl.q_begin; q < std::min(sl.q_end, seq_q); ++q) {
        const int64_t lo = sl.k_begin + (sl.lower() ? q - sl.q_begin : 0);
        const int64_t hi = std::min(sl.k_end - 1 - (sl.upper() ? sl.q_end - 1 - q : 0), seq_k - 1);
        if (hi >= lo) pairs += double(hi - lo + 1);
      }
    return f / (double(seq_q) * double(seq_k)) * pairs;
  }
  for (int64_t q = 0; q < seq_q; ++q) {
    int64_t lo = spec.mask.left < 0 ? 0 : std::max<int64_t>(0, q - spec.mask.left);
    int64_t hi = spec.mask.right < 0 ? seq_k - 1 : q + std::min(spec.mask.right, seq_k - 1 - q);
    if (spec.mask.documents) {
      const auto& cu = *spec.mask.documents;
      const int64_t d = spec.mask.document_of(q);
      if (d < 0 || size_t(d) + 1 >= cu.size()) continue;
      lo = std::max(lo, cu[size_t(d)]);
      hi = std::min(hi, cu[size_t(d) + 1] - 1);
    }
    if (hi >= lo) pairs += double(hi - lo + 1);
  }
  return f / (double(seq_q) * double(seq_k)) * pairs;
}

// One Ulysses member's heads (the models do not read the scale).
AttnSpec member_spec(AttnSpec spec, int U) {
  spec.heads_q /= U;
  spec.heads_kv = U > spec.heads_kv ? 1 : spec.heads_kv / U;  // one shared kv head past H_kv
  return spec;
}

// Every kTileQ x kTileK tile of every pair of runs that Mask::cover does not hide.
double walked_rank_flops(Strategy strategy, const Layout& layout, const AttnSpec& spec,
                         int64_t batch, int ulysses, int rank) {
  const int U = strategy == Strategy::ring ? 1 : ulysses;
  const Layout l = U == 1 ? layout : layout.grouped(U);
  const AttnSpec sub = member_spec(spec, U);
  const int me = rank / U, P = l.ranks();
  const double per_score = 2.0 * double(sub.head_dim + sub.dim_v()) * double(sub.heads_q * batch);
  double flops = 0;
  for (int origin = 0; origin < P; ++origin) {
    if (!l.any_visible(spec.mask, me, origin)) continue;
    for (const Run& qr : l.runs(me)) {
      for (const Run& kr : l.runs(origin)) {
        for (int64_t i0 = 0; i0 < qr.length; i0 += cpu::kTileQ) {
          const int64_t bq = std::min(cpu::kTileQ, qr.length - i0);
          const int64_t q_lo = qr.position(i0), q_hi = qr.position(i0 + bq - 1);
          for (int64_t j0 = 0; j0 < kr.length; j0 += cpu::kTileK) {
            const int64_t bk = std::min(cpu::kTileK, kr.length - j0);
            if (spec.mask.cover(q_lo, q_hi, kr.position(j0), kr.position(j0 + bk - 1)) !=
                Mask::Cover::none)
              flops += per_score * double(bq * bk);
          }
        }
      }
    }
  }
  return flops;
}

uint64_t stepped_ring_bytes(const Layout& layout, const AttnSpec& spec, int64_t batch, DType dtype,
                            int rank) {
  const int P = layout.ranks();
  const uint64_t row =
      uint64_t(spec.heads_kv) * uint64_t(spec.head_dim + spec.dim_v()) * dtype_size(dtype);
  uint64_t bytes = 0;
  for (int s = 0; s + 1 < P; ++s) {
    const int origin = ((rank - s) % P + P) % P;
    if (ring_forwards(layout, spec.mask, origin, s))
      bytes += uint64_t(batch) * uint64_t(layout.local_len(origin)) * row;
  }
  return bytes;
}

uint64_t stepped_ring_backward_bytes(const Layout& layout, const AttnSpec& spec, int64_t batch,
                                     DType dtype, int rank) {
  const int P = layout.ranks();
  const uint64_t grad_row =
      uint64_t(spec.heads_kv) * uint64_t(spec.head_dim + spec.dim_v()) * sizeof(float);
  uint64_t bytes = stepped_ring_bytes(layout, spec, batch, dtype, rank);
  for (int origin = 0; origin < P; ++origin) {
    const uint64_t block = uint64_t(batch) * uint64_t(layout.local_len(origin)) * grad_row;
    int last = 0;
    while (ring_forwards(layout, spec.mask, origin, last))
      ++last;
    for (int s = 0; s < last; ++s)
      if ((origin + s) % P == rank) bytes += block;
    if (last > 0 && (origin + last) % P == rank) bytes += block;
  }
  return bytes;
}

// ---------------------------------------------------------------- random problems

struct Problem {
  Layout layout;
  AttnSpec spec;
  int64_t batch = 1;
  Strategy strategy = Strategy::ring;
  int ulysses = 1;
  std::string name;
};

// Documents over S tokens; in a third of the draws some boundaries repeat (empty documents, also
// at the start and the end).
std::vector<int64_t> random_documents(std::mt19937_64& rng, int64_t S) {
  std::vector<int64_t> cu = {0};
  const int64_t docs = int64_t(rng() % 6) + 1;
  for (int64_t d = 1; d < docs && cu.back() + 1 < S; ++d)
    cu.push_back(cu.back() + 1 + int64_t(rng() % uint64_t(S - cu.back() - 1)));
  if (S > cu.back()) cu.push_back(S);
  if (cu.size() < 2) cu.push_back(1);
  if (rng() % 3 == 0)
    for (int n = int(rng() % 4) + 1; n > 0; --n) {
      const size_t i = size_t(rng() % cu.size());
      cu.insert(cu.begin() + std::ptrdiff_t(i), cu[i]);
    }
  return cu;
}

Problem random_problem(std::mt19937_64& rng) {
  Problem p;
  const int P = int(rng() % 8) + 1;
  const int64_t scale[] = {8, 64, 1000, 5000, 30000, 120000};
  int64_t S = int64_t(rng() % uint64_t(scale[rng() % 6]));
  const int64_t blocks[] = {1, 2, 3, 7, 64, 100, 256, 300, 512, 1000, 1536};
  std::vector<int64_t> docs = random_documents(rng, std::max<int64_t>(S, 1));
  switch (rng() % 5) {
    case 0:
      p.layout = Layout::contiguous(S, P);
      break;
    case 1:
      p.layout = Layout::zigzag(S, P);
      break;
    case 2:
      p.layout = Layout::striped(S, P, blocks[rng() % 11]);
      break;
    case 3:
      p.layout = Layout::varlen(docs, P);
      S = docs.back();
      break;
    default:
      p.layout = Layout::blocks(S, P, blocks[rng() % 11]);
  }
  if (rng() % 4 == 0) docs = random_documents(rng, std::max<int64_t>(S + int64_t(rng() % 3), 1));
  const int64_t windows[] = {-1,  0,   1,   5,    100,  255,
                             256, 300, 700, 1000, 5000, std::numeric_limits<int64_t>::max()};
  switch (rng() % 7) {
    case 0:
      p.spec.mask = Mask::none();
      break;
    case 1:
      p.spec.mask = Mask::causal();
      break;
    case 2:
      p.spec.mask = Mask::window(windows[1 + rng() % 11], rng() % 2 ? 0 : windows[rng() % 12]);
      break;
    case 3:
      p.spec.mask = Mask::window(-1, windows[1 + rng() % 11]);
      break;
    case 4:
      p.spec.mask = Mask::document(docs, rng() % 2 == 0);
      break;
    case 5:  // a window inside documents
      p.spec.mask = Mask::document(docs, false);
      p.spec.mask.left = windows[rng() % 12];
      p.spec.mask.right = windows[rng() % 12];
      break;
    default:
      p.spec.mask = test::random_slices(rng, S);
  }
  if (rng() % 6 == 0) {  // chunks dealt by their work under the mask (at most 64 of them)
    const int64_t chunks[] = {1, 64, 256, 300, 1000, 4096};
    p.layout = Layout::balanced(p.spec.mask, S, P, std::max(chunks[rng() % 6], S / 64 + 1));
  }
  p.spec.heads_kv = int64_t(1) << (rng() % 3);
  p.spec.heads_q = p.spec.heads_kv * int64_t(1 + rng() % 3) * 8;
  p.spec.head_dim = rng() % 2 ? 64 : 128;
  p.spec.head_dim_v = rng() % 3 == 0 ? 32 : 0;
  p.batch = int64_t(1 + rng() % 3);
  std::vector<int> divisors;
  for (int u = 1; u <= P; ++u)
    if (P % u == 0 && p.spec.heads_q % u == 0 &&
        (p.spec.heads_kv % u == 0 || u % p.spec.heads_kv == 0))
      divisors.push_back(u);
  p.ulysses = divisors[rng() % divisors.size()];
  p.strategy = p.ulysses == 1   ? Strategy::ring
               : p.ulysses == P ? Strategy::ulysses
                                : Strategy::hybrid;
  p.name = testing::PrintToString(p.layout.str()) + " " + p.spec.str() +
           " B=" + std::to_string(p.batch) + " " + strategy_name(p.strategy) +
           " U=" + std::to_string(p.ulysses);
  return p;
}

// Equal, or both NaN (no tokens: 0 / 0).
bool same(double a, double b) {
  return a == b || (std::isnan(a) && std::isnan(b));
}

TEST(ClosedFormModels, EqualTheDirectCountsOnRandomProblems) {
  std::mt19937_64 rng(20);
  for (int n = 0; n < 1500; ++n) {
    const Problem p = random_problem(rng);
    SCOPED_TRACE(p.name);
    const int P = p.layout.ranks();
    const int64_t S = p.layout.global_seq();
    ASSERT_PRED2(same, attention_flops(p.batch, S, S, p.spec), pairs_flops(p.batch, S, S, p.spec));
    ASSERT_PRED2(same, attention_flops(p.batch, S / 3 + 1, S, p.spec),
                 pairs_flops(p.batch, S / 3 + 1, S, p.spec));
    for (int r = 0; r < P; ++r) {
      ASSERT_EQ(attention_rank_flops(p.strategy, p.layout, p.spec, p.batch, p.ulysses, r),
                walked_rank_flops(p.strategy, p.layout, p.spec, p.batch, p.ulysses, r))
          << "rank " << r;
      ASSERT_EQ(ring_send_bytes(p.layout, p.spec, p.batch, DType::bf16, r),
                stepped_ring_bytes(p.layout, p.spec, p.batch, DType::bf16, r))
          << "rank " << r;
      ASSERT_EQ(ring_backward_send_bytes(p.layout, p.spec, p.batch, DType::f32, r),
                stepped_ring_backward_bytes(p.layout, p.spec, p.batch, DType::f32, r))
          << "rank " << r;
      if (p.ulysses > 1 && P / p.ulysses > 1) {
        // The ring over the groups inside the hybrid's byte models.
        const Layout g = p.layout.grouped(p.ulysses);
        const AttnSpec sub = member_spec(p.spec, p.ulysses);
        const int gr = r / p.ulysses;
        ASSERT_EQ(ring_send_bytes(g, sub, p.batch, DType::f16, gr),
                  stepped_ring_bytes(g, sub, p.batch, DType::f16, gr));
        ASSERT_EQ(ring_backward_send_bytes(g, sub, p.batch, DType::f16, gr),
                  stepped_ring_backward_bytes(g, sub, p.batch, DType::f16, gr));
      }
    }
  }
}

// Windows and documents with many tiles per run: the classes of striped blocks that do not
// divide the tiles, documents cutting tiles, windows ending inside tiles.
TEST(ClosedFormModels, EqualTheTileWalkOnLongRuns) {
  AttnSpec spec;
  spec.heads_q = 4;
  spec.heads_kv = 2;
  spec.head_dim = 64;
  const int64_t S = 200003;
  const std::vector<int64_t> cu = {0, 1, 7000, 70001, 70002, 150000, S};
  const std::vector<int64_t> empty = {0, 0, 1, 7000, 7000, 70001, 70002, 70002, 150000, S, S};
  std::vector<Mask> masks = {
      Mask::causal(),           Mask::window(3000),        Mask::window(257, 1300),
      Mask::document(cu, true), Mask::document(cu, false), Mask::document(empty, true)};
  masks.push_back(Mask::document(cu, true));
  masks.back().left = 20000;
  masks.push_back(test::shared_prefix_mask(7000, {7000, 7001, 70001, 150000, S}));
  std::mt19937_64 rng(7);
  masks.push_back(test::random_slices(rng, S));
  for (int P : {2, 3}) {
    for (const Layout& l :
         {Layout::zigzag(S, P), Layout::striped(S, P, 1), Layout::striped(S, P, 96),
          Layout::striped(S, P, 1000), Layout::varlen(cu, P), Layout::blocks(S, P, 777),
          Layout::balanced(masks[masks.size() - 2], S, P, 4096)}) {
      for (const Mask& m : masks) {
        spec.mask = m;
        SCOPED_TRACE(l.str() + " " + m.str());
        for (int r = 0; r < P; ++r)
          ASSERT_EQ(attention_rank_flops(Strategy::ring, l, spec, 1, 1, r),
                    walked_rank_flops(Strategy::ring, l, spec, 1, 1, r))
              << "rank " << r;
      }
    }
  }
}

// Empty documents (repeated boundaries) change no figure: every model gives, for every rank, what
// it gives for the boundaries without them, under varlen (on the same boundaries), zigzag and
// contiguous, with document masks causal, full and with a window.
TEST(ClosedFormModels, EmptyDocumentsAsIfRemoved) {
  const int64_t S = 61, B = 2;
  AttnSpec spec;
  spec.heads_q = 8;
  spec.heads_kv = 4;
  spec.head_dim = 64;
  spec.head_dim_v = 32;
  for (int P : {1, 2, 3, 4}) {
    for (const auto& [name, cu] : test::empty_documents_cases(S)) {
      const std::vector<int64_t> cut = test::without_empty_documents(cu);
      Mask windowed = Mask::document(cu, true);
      windowed.left = 9;
      for (const Mask& m : {Mask::document(cu, true), Mask::document(cu, false), windowed}) {
        for (const char* kind : {"varlen", "zigzag", "contiguous"}) {
          const bool varlen = std::string(kind) == "varlen";
          const Layout l = varlen ? Layout::varlen(cu, P) : Layout::make(kind, S, P);
          const Layout lw = varlen ? Layout::varlen(cut, P) : l;
          AttnSpec s = spec, w = spec;
          s.mask = m;
          w.mask = test::without_empty_documents(m);
          SCOPED_TRACE(name + " " + l.str() + " " + m.str());
          EXPECT_EQ(attention_flops(B, S, S, s), attention_flops(B, S, S, w));
          for (int r = 0; r < P; ++r) {
            EXPECT_EQ(ring_send_bytes(l, s, B, DType::bf16, r),
                      ring_send_bytes(lw, w, B, DType::bf16, r));
            EXPECT_EQ(ring_backward_send_bytes(l, s, B, DType::bf16, r),
                      ring_backward_send_bytes(lw, w, B, DType::bf16, r));
            for (int step = 0; step < P; ++step)
              EXPECT_EQ(ring_forwards(l, s.mask, r, step), ring_forwards(lw, w.mask, r, step));
            for (int U = 1; U <= P; ++U) {
              if (P % U != 0 || spec.heads_q % U != 0 ||
                  (spec.heads_kv % U != 0 && U % spec.heads_kv != 0))
                continue;
              const Strategy st = U == 1   ? Strategy::ring
                                  : U == P ? Strategy::ulysses
                                           : Strategy::hybrid;
              EXPECT_EQ(attention_rank_flops(st, l, s, B, U, r),
                        attention_rank_flops(st, lw, w, B, U, r));
              EXPECT_EQ(attention_send_bytes(st, l, s, B, DType::f16, U, r),
                        attention_send_bytes(st, lw, w, B, DType::f16, U, r));
              EXPECT_EQ(attention_backward_send_bytes(st, l, s, B, DType::f16, U, r),
                        attention_backward_send_bytes(st, lw, w, B, DType::f16, U, r));
            }
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------- the large case

// Every rank's figures for S = 2^30 on 1024 ranks, as a dry run prints them: it finishes (ctest's
// timeout bounds it; the time is printed), and the figures are what the problem says.
TEST(ClosedFormModels, OneBillionTokensOn1024Ranks) {
  const int64_t S = int64_t(1) << 30;
  const int P = 1024;
  AttnSpec spec;
  spec.heads_q = 32;
  spec.heads_kv = 8;
  spec.head_dim = 128;
  const auto start = std::chrono::steady_clock::now();
  for (const char* kind : {"zigzag", "contiguous", "striped"}) {
    const Layout l = Layout::make(kind, S, P);
    for (const Mask& m : {Mask::causal(), Mask::none(), Mask::window(65536)}) {
      spec.mask = m;
      SCOPED_TRACE(l.str() + " " + m.str());
      double sum = 0, max = 0;
      uint64_t bytes = 0;
      for (int r = 0; r < P; ++r) {
        const double f = attention_rank_flops(Strategy::ring, l, spec, 1, 1, r);
        sum += f;
        max = std::max(max, f);
        bytes += ring_send_bytes(l, spec, 1, DType::bf16, r);
      }
      const double whole = attention_flops(1, S, S, spec);
      EXPECT_GE(sum, whole * (1 - 1e-12));
      if (m.is_none()) {
        EXPECT_NEAR(sum, whole, 1e-12 * whole);
        EXPECT_EQ(bytes, uint64_t(P) * uint64_t(P - 1) * uint64_t(S / P) * 8 * 256 * 2);
      }
      if (m.is_causal() && std::string(kind) != "contiguous") {
        EXPECT_LT(max / (sum / P), 1.01);
      }
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("9 problems x 1024 ranks of rank FLOPs and ring bytes: %.3f s\n", seconds);
}

// ---------------------------------------------------------------- overflow

void expect_error_naming(const std::function<void()>& f, const std::string& name) {
  try {
    f();
    ADD_FAILURE() << "no dattn::Error naming " << name;
  } catch (const Error& e) {
    EXPECT_NE(e.message().find(name), std::string::npos) << e.message();
  }
}

TEST(ClosedFormModels, ByteCountsPast64BitsAreErrorsNamingTheirFactors) {
  AttnSpec spec;
  spec.heads_q = 8;
  spec.heads_kv = 8;
  spec.head_dim = 128;
  const Layout l = Layout::contiguous(int64_t(1) << 40, 4);
  const int64_t big = int64_t(1) << 40;
  expect_error_naming([&] { ring_send_bytes(l, spec, big, DType::f32, 0); }, "batch * local_len");
  expect_error_naming([&] { ring_backward_send_bytes(l, spec, big, DType::f32, 0); }, "batch");
  expect_error_naming(
      [&] { attention_send_bytes(Strategy::ulysses, l, spec, big, DType::f32, 4, 0); },
      "batch * local_len");
  expect_error_naming(
      [&] { attention_backward_send_bytes(Strategy::hybrid, l, spec, big, DType::f32, 2, 0); },
      "batch");
  expect_error_naming([&] { ring_send_bytes(l, spec, -1, DType::f32, 0); }, "batch");
  AttnSpec wide = spec;
  wide.heads_kv = int64_t(1) << 62;
  expect_error_naming([&] { ring_send_bytes(l, wide, 1, DType::f32, 0); }, "heads_kv");
  // Just below the limit the count is exact.
  EXPECT_EQ(ring_send_bytes(Layout::contiguous(int64_t(1) << 40, 2), spec, 1 << 10, DType::f32, 0),
            (uint64_t(1) << 39) * (uint64_t(1) << 10) * 8 * 256 * 4);
}

// Sequences and windows near the int64 limit: positions plus windows do not wrap.
TEST(ClosedFormModels, SequencesNearTheInt64LimitDoNotWrap) {
  AttnSpec spec;
  spec.heads_q = 1;
  spec.heads_kv = 1;
  spec.head_dim = 1;
  const int64_t S = std::numeric_limits<int64_t>::max() / 2;
  const Layout l = Layout::contiguous(S, 2);
  const double none = attention_rank_flops(Strategy::ring, l, spec, 1, 1, 0);
  EXPECT_NEAR(none, 2.0 * 2 * double(S / 2 + 1) * double(S), 1e-12 * none);
  spec.mask =
      Mask::window(std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(attention_rank_flops(Strategy::ring, l, spec, 1, 1, 0), none);
  spec.mask = Mask::causal();
  const double causal0 = attention_rank_flops(Strategy::ring, l, spec, 1, 1, 0);
  EXPECT_GT(causal0, 0);
  EXPECT_LT(causal0, none * 0.51);
  EXPECT_EQ(ring_send_bytes(l, spec, 1, DType::bf16, 0), uint64_t(S / 2 + 1) * 4);
  expect_error_naming([&] { ring_send_bytes(l, spec, 1, DType::f32, 0); }, "batch * local_len");
}

}  // namespace
}  // namespace dattn
