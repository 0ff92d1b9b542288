// Single-process tests of the masks beyond none/causal (sliding windows, documents, empty ones
// among them, slice masks): Mask::cover and Mask::visible against brute force, validation,
// str/hash, the FLOP model, and the CPU kernel (attention_local, attention_forward, block-strided
// positions) against the float64 references.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/cpu/attention_cpu.h"
#include "kernels/cpu/reference.h"
#include "kernels/merge.h"
#include "src/attention.h"
#include "src/base/error.h"
#include "src/base/spec.h"
#include "src/models.h"
#include "tests/test_reference.h"

namespace dattn {
namespace {

using test::empty_documents_cases;
using test::matches_reference;
using test::random_tensor;
using test::tolerance_for;
using test::without_empty_documents;

using test::throws_naming;

// ---------------------------------------------------------------- the masks under test

// A mask with a band and documents together (the struct allows it; the factories make one or
// the other).
Mask banded_documents(std::vector<int64_t> cu, int64_t left, int64_t right) {
  Mask m = Mask::document(std::move(cu), false);
  m.left = left;
  m.right = right;
  return m;
}

// Masks over positions 0 .. S-1 for the brute-force checks (documents end at S).
std::vector<Mask> masks_for(int64_t S) {
  std::vector<Mask> ms = {Mask::none(), Mask::causal()};
  for (int64_t l : {0, 1, 3, 7})
    for (int64_t r : {0, 2, -1})
      ms.push_back(Mask::window(l, r));
  ms.push_back(Mask::window(-1, 4));                                   // a right window only
  const std::vector<int64_t> cu = {0, 1, S / 3, S / 3 + 1, S - 2, S};  // with 1-token documents
  ms.push_back(Mask::document(cu, true));
  ms.push_back(Mask::document(cu, false));
  ms.push_back(Mask::document({0, S}, true));  // one document
  ms.push_back(Mask::document({0, S / 2, S}, false));
  ms.push_back(banded_documents(cu, 2, 0));
  ms.push_back(banded_documents({0, S / 2, S}, 3, 1));
  // Empty documents (repeated boundaries): at the start, several in a row, at the end.
  const std::vector<int64_t> empty = {0, 0, 1, S / 3, S / 3, S / 3, S - 2, S, S};
  ms.push_back(Mask::document(empty, true));
  ms.push_back(Mask::document(empty, false));
  ms.push_back(banded_documents(empty, 2, 1));
  // Slice masks: one slice of each kind (bi_causal with fewer keys than queries is empty), the
  // shared-prefix mask, and random lists.
  for (int kind = 0; kind < 4; ++kind) {
    ms.push_back(Mask::from_slices({{2, S - 3, 1, S - 1, MaskSlice::Kind(kind)}}));
    ms.push_back(Mask::from_slices({{1, S / 2, S / 3, S, MaskSlice::Kind(kind)},
                                    {S / 2, S, 0, S / 2 + 2, MaskSlice::Kind(3 - kind)}}));
  }
  ms.push_back(Mask::from_slices({{0, S, S / 2, S / 2 + 3, MaskSlice::Kind::bi_causal}}));
  ms.push_back(test::shared_prefix_mask(S / 4, {S / 4, S / 4 + 1, S / 2, S / 2, S}));
  std::mt19937_64 rng{uint64_t(S)};
  for (int i = 0; i < 6; ++i)
    ms.push_back(test::random_slices(rng, S));
  return ms;
}

// The definition of visibility written out: in the band, and in the same document (found by a
// linear scan of cu_seqlens: the last boundary at or below pos, which of repeated boundaries is
// the last, the start of the non-empty document that holds pos).
int64_t document_by_scan(const Mask& m, int64_t pos) {
  if (!m.documents) return 0;
  const auto& cu = *m.documents;
  int64_t d = 0;
  for (size_t i = 1; i < cu.size(); ++i)
    if (pos >= cu[i]) d = int64_t(i);
  return d;
}
bool visible_by_definition(const Mask& m, int64_t q, int64_t k) {
  if (m.slices) {  // in a slice's rectangle, and inside its kind's diagonals
    for (const MaskSlice& sl : *m.slices) {
      if (q < sl.q_begin || q >= sl.q_end || k < sl.k_begin || k >= sl.k_end) continue;
      const int64_t i = q - sl.q_begin, j = k - sl.k_begin;  // offsets in the rectangle
      const int64_t excess = (sl.k_end - sl.k_begin) - (sl.q_end - sl.q_begin);
      const bool below = j <= i + excess, above = j >= i;  // bottom-right, top-left diagonals
      switch (sl.kind) {
        case MaskSlice::Kind::full:
          return true;
        case MaskSlice::Kind::causal:
          return below;
        case MaskSlice::Kind::inv_causal:
          return above;
        case MaskSlice::Kind::bi_causal:
          return below && above;
      }
    }
    return false;
  }
  if (m.left >= 0 && k < q - m.left) return false;
  if (m.right >= 0 && k > q + m.right) return false;
  return document_by_scan(m, q) == document_by_scan(m, k);
}

// ---------------------------------------------------------------- visible and cover

TEST(MaskVisible, MatchesTheDefinition) {
  const int64_t S = 23;
  for (const Mask& m : masks_for(S)) {
    SCOPED_TRACE(m.str());
    for (int64_t q = 0; q < S; ++q)
      for (int64_t k = 0; k < S; ++k)
        ASSERT_EQ(m.visible(q, k), visible_by_definition(m, q, k)) << "q=" << q << " k=" << k;
  }
  // Named cases.
  EXPECT_TRUE(Mask::window(2).visible(5, 3));
  EXPECT_FALSE(Mask::window(2).visible(5, 2));
  EXPECT_FALSE(Mask::window(2).visible(5, 6));
  EXPECT_TRUE(Mask::window(2, 1).visible(5, 6));
  EXPECT_FALSE(Mask::window(2, 1).visible(5, 7));
  EXPECT_TRUE(Mask::window(0).visible(4, 4));
  EXPECT_FALSE(Mask::window(0).visible(4, 3));
  const Mask doc = Mask::document({0, 4, 5, 9}, true);
  EXPECT_TRUE(doc.visible(3, 0));
  EXPECT_FALSE(doc.visible(4, 3));  // the 1-token document [4, 5)
  EXPECT_TRUE(doc.visible(4, 4));
  EXPECT_FALSE(doc.visible(5, 4));
  EXPECT_FALSE(doc.visible(5, 6));  // causal inside the document
  EXPECT_TRUE(Mask::document({0, 4, 5, 9}, false).visible(5, 8));
  EXPECT_EQ(doc.document_of(0), 0);
  EXPECT_EQ(doc.document_of(4), 1);
  EXPECT_EQ(doc.document_of(8), 2);
}

// Empty documents change nothing: two positions are in the same document exactly when no
// boundary lies in (min, max] (a definition without document numbers), and every pair sees what
// it sees with the repeated boundaries removed.
TEST(MaskVisible, EmptyDocumentsAsIfRemoved) {
  const int64_t S = 23;
  for (const auto& [name, cu] : empty_documents_cases(S)) {
    for (const Mask& m :
         {Mask::document(cu, true), Mask::document(cu, false), banded_documents(cu, 3, 1)}) {
      SCOPED_TRACE(name + " " + m.str());
      ASSERT_NO_THROW(m.validate());
      const Mask without = without_empty_documents(m);
      for (int64_t q = 0; q < S; ++q) {
        for (int64_t k = 0; k < S; ++k) {
          bool same_document = true;
          for (int64_t c : cu)
            same_document = same_document && !(std::min(q, k) < c && c <= std::max(q, k));
          ASSERT_EQ(m.visible(q, k), m.in_band(q, k) && same_document) << "q=" << q << " k=" << k;
          ASSERT_EQ(m.visible(q, k), without.visible(q, k)) << "q=" << q << " k=" << k;
        }
      }
      for (int64_t ql = 0; ql < S; ql += 3)
        for (int64_t qh = ql; qh < S; qh += 2)
          for (int64_t kl = 0; kl < S; kl += 3)
            for (int64_t kh = kl; kh < S; kh += 2)
              ASSERT_EQ(m.cover(ql, qh, kl, kh), without.cover(ql, qh, kl, kh))
                  << "q [" << ql << ", " << qh << "] k [" << kl << ", " << kh << "]";
    }
  }
  // The document numbers count the empty ones: a position is in the last of equal boundaries'
  // documents.
  const Mask doc = Mask::document({0, 0, 4, 4, 4, 9, 9}, true);
  EXPECT_EQ(doc.document_of(0), 1);
  EXPECT_EQ(doc.document_of(3), 1);
  EXPECT_EQ(doc.document_of(4), 4);
  EXPECT_EQ(doc.document_of(8), 4);
  EXPECT_TRUE(doc.visible(3, 0));
  EXPECT_FALSE(doc.visible(4, 3));
  EXPECT_TRUE(doc.visible(8, 4));
  EXPECT_EQ(doc.str(), "document(6 docs, causal)");
}

// Checks cover on the block [q_lo, q_hi] x [k_lo, k_hi] against its pairs: never "none" when a
// pair is visible, never "all" when a pair is hidden.
testing::AssertionResult cover_is_sound(const Mask& m, int64_t q_lo, int64_t q_hi, int64_t k_lo,
                                        int64_t k_hi) {
  bool any_visible = false, any_hidden = false;
  for (int64_t q = q_lo; q <= q_hi; ++q)
    for (int64_t k = k_lo; k <= k_hi; ++k)
      (visible_by_definition(m, q, k) ? any_visible : any_hidden) = true;
  const Mask::Cover c = m.cover(q_lo, q_hi, k_lo, k_hi);
  if (any_visible && c == Mask::Cover::none)
    return testing::AssertionFailure() << "cover = none but a pair is visible";
  if (any_hidden && c == Mask::Cover::all)
    return testing::AssertionFailure() << "cover = all but a pair is hidden";
  if (m.slices && !any_visible && c != Mask::Cover::none)  // exact for slices: keys_seen
    return testing::AssertionFailure() << "cover != none but no pair is visible";
  return testing::AssertionSuccess();
}

TEST(MaskCover, ExhaustiveOverSmallBlocks) {
  const int64_t S = 13;
  for (const Mask& m : masks_for(S)) {
    SCOPED_TRACE(m.str());
    for (int64_t ql = 0; ql < S; ++ql)
      for (int64_t qh = ql; qh < S; ++qh)
        for (int64_t kl = 0; kl < S; ++kl)
          for (int64_t kh = kl; kh < S; ++kh)
            ASSERT_TRUE(cover_is_sound(m, ql, qh, kl, kh))
                << "q [" << ql << ", " << qh << "] k [" << kl << ", " << kh << "]";
  }
}

TEST(MaskCover, RandomBlocks) {
  const int64_t S = 97;
  std::mt19937_64 rng(42);
  std::uniform_int_distribution<int64_t> pos(0, S - 1);
  for (const Mask& m : masks_for(S)) {
    SCOPED_TRACE(m.str());
    for (int i = 0; i < 1500; ++i) {
      int64_t a = pos(rng), b = pos(rng), c = pos(rng), d = pos(rng);
      if (a > b) std::swap(a, b);
      if (c > d) std::swap(c, d);
      ASSERT_TRUE(cover_is_sound(m, a, b, c, d))
          << "q [" << a << ", " << b << "] k [" << c << ", " << d << "]";
    }
  }
  // An empty block is "none"; a block without masking is "all".
  EXPECT_EQ(Mask::none().cover(5, 4, 0, 3), Mask::Cover::none);
  EXPECT_EQ(Mask::window(3).cover(0, 3, 5, 4), Mask::Cover::none);
  EXPECT_EQ(Mask::none().cover(0, 9, 0, 9), Mask::Cover::all);
  EXPECT_EQ(Mask::causal().cover(10, 19, 0, 9), Mask::Cover::all);
  EXPECT_EQ(Mask::window(4).cover(10, 12, 8, 10), Mask::Cover::all);
  EXPECT_EQ(Mask::window(4).cover(10, 12, 0, 5), Mask::Cover::none);
  EXPECT_EQ(Mask::document({0, 10, 20}, false).cover(0, 9, 10, 19), Mask::Cover::none);
  EXPECT_EQ(Mask::document({0, 10, 20}, false).cover(10, 19, 12, 15), Mask::Cover::all);
}

// keys_seen and queries_seeing, the intervals cover() and the ring's models rest on, against
// the pairs of one slice counted one by one.
TEST(MaskSlices, SeenIntervalsMatchBruteForce) {
  const int64_t S = 19;
  for (int kind = 0; kind < 4; ++kind) {
    for (const MaskSlice sl : {MaskSlice{2, 13, 3, 17, MaskSlice::Kind(kind)},
                               MaskSlice{4, 9, 0, 19, MaskSlice::Kind(kind)},
                               MaskSlice{0, 12, 5, 9, MaskSlice::Kind(kind)},
                               MaskSlice{6, 6, 0, 8, MaskSlice::Kind(kind)}}) {
      SCOPED_TRACE(testing::Message()
                   << "slice q " << sl.q_begin << ":" << sl.q_end << " k " << sl.k_begin << ":"
                   << sl.k_end << " " << MaskSlice::kind_name(sl.kind));
      const Mask m = Mask::from_slices({sl});
      for (int64_t a = 0; a < S; ++a)
        for (int64_t b = a; b < S; ++b) {
          // Keys seen by queries [a, b] within keys [3, 15], and queries that see keys [a, b].
          int64_t klo = S, khi = -1, qlo = S, qhi = -1;
          for (int64_t q = 0; q < S; ++q)
            for (int64_t k = 0; k < S; ++k) {
              if (!visible_by_definition(m, q, k)) continue;
              if (q >= a && q <= b && k >= 3 && k <= 15)
                klo = std::min(klo, k), khi = std::max(khi, k);
              if (k >= a && k <= b) qlo = std::min(qlo, q), qhi = std::max(qhi, q);
            }
          int64_t lo = -7, hi = -7;
          ASSERT_EQ(sl.keys_seen(a, b, 3, 15, &lo, &hi), khi >= 0) << "queries " << a << ":" << b;
          if (khi >= 0) {
            ASSERT_EQ(std::make_pair(lo, hi), std::make_pair(klo, khi));
          }
          ASSERT_EQ(sl.queries_seeing(a, b, &lo, &hi), qhi >= 0) << "keys " << a << ":" << b;
          if (qhi >= 0) {
            ASSERT_EQ(std::make_pair(lo, hi), std::make_pair(qlo, qhi));
          }
        }
    }
  }
}

// ---------------------------------------------------------------- validation

TEST(MaskValidate, NamesTheBadField) {
  EXPECT_TRUE(throws_naming([] { Mask::window(-5).validate(); }, {"window left", "-5"}));
  EXPECT_TRUE(throws_naming([] { Mask::window(-2, -1).validate(); }, {"window left"}));
  EXPECT_TRUE(throws_naming([] { Mask::window(4, -3).validate(); }, {"window right", "-3"}));
  EXPECT_TRUE(throws_naming([] { Mask::document({1, 5, 9}, true).validate(); }, {"cu_seqlens"}));
  EXPECT_TRUE(throws_naming(
      [] {
        Mask::document({0, 0, 5, 4, 9}, true).validate();
      },
      {"cu_seqlens[3] = 4", ">= cu_seqlens[2] = 5", "non-decreasing"}));
  EXPECT_TRUE(throws_naming(
      [] {
        Mask::document({0, 6, 3}, false).validate();
      },
      {"cu_seqlens", "3"}));
  EXPECT_TRUE(throws_naming([] { Mask::document({0}, false).validate(); }, {"cu_seqlens"}));
  EXPECT_TRUE(throws_naming([] { Mask::document({}, true).validate(); }, {"cu_seqlens"}));
  // Through the spec as well.
  AttnSpec spec;
  spec.heads_q = 2;
  spec.heads_kv = 1;
  spec.head_dim = 32;
  spec.mask = Mask::window(-5);
  EXPECT_TRUE(throws_naming([&] { spec.validate(); }, {"window left"}));
  spec.mask = Mask::document({0, 4, 2}, true);
  EXPECT_TRUE(throws_naming([&] { spec.validate(); }, {"cu_seqlens"}));
  // Slices: out of range, overlapping (also when only partly), a bad kind, with a band or
  // documents; each error names the slice.
  using K = MaskSlice::Kind;
  EXPECT_TRUE(throws_naming(
      [] {
        Mask::from_slices({{-1, 4, 0, 4, K::full}}).validate();
      },
      {"slice q range", "q -1:4"}));
  EXPECT_TRUE(throws_naming(
      [] {
        Mask::from_slices({{0, 4, 6, 5, K::causal}}).validate();
      },
      {"slice k range", "k 6:5", "causal"}));
  EXPECT_TRUE(throws_naming(
      [] {
        Mask::from_slices({{0, 4, 0, 4, K(7)}}).validate();
      },
      {"slice kind", "7"}));
  EXPECT_TRUE(throws_naming(
      [] {
        Mask::from_slices({{0, 8, 0, 8, K::causal}, {4, 6, 7, 9, K::full}}).validate();
      },
      {"slices", "q 0:8, k 0:8", "q 4:6, k 7:9", "do not overlap"}));
  EXPECT_TRUE(throws_naming(
      [] {
        Mask::from_slices({{5, 9, 0, 3, K::full}, {0, 20, 2, 4, K::inv_causal}}).validate();
      },
      {"slices", "q 0:20, k 2:4", "q 5:9, k 0:3"}));
  EXPECT_TRUE(throws_naming(
      [] {
        Mask m = Mask::from_slices({{0, 4, 0, 4, K::full}});
        m.right = 0;
        m.validate();
      },
      {"mask", "slices alone"}));
  // Touching rectangles and empty ones inside others do not overlap.
  EXPECT_NO_THROW(Mask::from_slices({{0, 4, 0, 4, K::causal},
                                     {0, 4, 4, 8, K::full},
                                     {4, 8, 0, 8, K::bi_causal},
                                     {2, 2, 0, 8, K::full},
                                     {1, 3, 5, 5, K::full}})
                      .validate());
  // Valid masks pass.
  for (const Mask& m : masks_for(20))
    EXPECT_NO_THROW(m.validate()) << m.str();
  EXPECT_NO_THROW(Mask::window(0).validate());
  EXPECT_NO_THROW(Mask::document({0, 1}, true).validate());
  // Repeated boundaries are empty documents, anywhere.
  for (const std::vector<int64_t>& cu : std::vector<std::vector<int64_t>>{
           {0, 0, 9}, {0, 5, 5, 9}, {0, 5, 5, 5, 9}, {0, 9, 9}, {0, 0, 5, 5, 9, 9}})
    EXPECT_NO_THROW(Mask::document(cu, false).validate()) << testing::PrintToString(cu);
}

TEST(MaskNames, StrAndHashDistinguishMasks) {
  EXPECT_EQ(Mask::none().str(), "none");
  EXPECT_EQ(Mask::causal().str(), "causal");
  EXPECT_EQ(Mask::window(128).str(), "window(128,0)");
  EXPECT_EQ(Mask::window(128, 16).str(), "window(128,16)");
  EXPECT_EQ(Mask::document({0, 5, 9, 12}, true).str(), "document(3 docs, causal)");
  EXPECT_NE(Mask::document({0, 5, 9, 12}, false).str(), Mask::document({0, 5, 9, 12}, true).str());
  EXPECT_TRUE(Mask::window(-1, 0).is_causal());
  EXPECT_TRUE(Mask::window(-1, -1).is_none());
  EXPECT_FALSE(Mask::document({0, 4}, false).is_none());
  EXPECT_FALSE(Mask::document({0, 4}, true).is_causal());

  // Masks of different kinds or parameters: different str() and hash(), and !=.
  const std::vector<Mask> kinds = {
      Mask::none(),
      Mask::causal(),
      Mask::window(128),
      Mask::window(64),
      Mask::window(128, 16),
      Mask::window(128, -1),
      Mask::window(0),
      Mask::window(-1, 3),
      Mask::document({0, 5, 9, 12}, true),
      Mask::document({0, 5, 9, 12}, false),
      Mask::document({0, 12}, true),
      banded_documents({0, 5, 9, 12}, 4, 0),
      Mask::from_slices({{0, 12, 0, 12, MaskSlice::Kind::causal}}),
      Mask::from_slices({{0, 12, 0, 12, MaskSlice::Kind::inv_causal}}),
      Mask::from_slices({{0, 12, 0, 11, MaskSlice::Kind::causal}}),
      Mask::from_slices(
          {{0, 6, 0, 12, MaskSlice::Kind::full}, {6, 12, 0, 12, MaskSlice::Kind::full}}),
  };
  std::set<std::string> strs;
  std::set<uint64_t> hashes;
  for (const Mask& m : kinds) {
    EXPECT_TRUE(strs.insert(m.str()).second) << "str() repeats: " << m.str();
    EXPECT_TRUE(hashes.insert(m.hash()).second) << "hash() repeats: " << m.str();
    EXPECT_EQ(m, m);
    EXPECT_EQ(m.hash(), Mask(m).hash());
  }
  for (size_t i = 0; i < kinds.size(); ++i)
    for (size_t j = i + 1; j < kinds.size(); ++j)
      EXPECT_FALSE(kinds[i] == kinds[j]) << kinds[i].str() << " vs " << kinds[j].str();
  // Documents with other boundaries (same count): equal str() is allowed, but not hash() or ==.
  const Mask a = Mask::document({0, 5, 9, 12}, true), b = Mask::document({0, 4, 9, 12}, true);
  EXPECT_NE(a.hash(), b.hash());
  EXPECT_FALSE(a == b);
  EXPECT_EQ(a, Mask::document({0, 5, 9, 12}, true));
  EXPECT_EQ(a.hash(), Mask::document({0, 5, 9, 12}, true).hash());
}

// ---------------------------------------------------------------- FLOP model

// Visible (query, key) pairs with queries at 0 .. Sq-1 and keys at 0 .. Sk-1.
double visible_pairs(const Mask& m, int64_t Sq, int64_t Sk) {
  double n = 0;
  for (int64_t q = 0; q < Sq; ++q)
    for (int64_t k = 0; k < Sk; ++k)
      n += visible_by_definition(m, q, k) ? 1 : 0;
  return n;
}

TEST(MaskFlops, WindowAndDocumentCountVisiblePairs) {
  const int64_t B = 2, H = 3, D = 64, Dv = 32;
  AttnSpec spec;
  spec.heads_q = H;
  spec.heads_kv = 1;
  spec.head_dim = D;
  spec.head_dim_v = Dv;
  struct Case {
    Mask mask;
    int64_t Sq, Sk;
  };
  const std::vector<int64_t> cu = {0, 1, 17, 18, 40, 77};
  const std::vector<int64_t> empty = {0, 0, 1, 17, 17, 17, 18, 40, 77, 77};  // empty documents
  std::vector<Case> cases = {
      {Mask::window(0), 77, 77},
      {Mask::window(5), 77, 77},
      {Mask::window(5, 3), 77, 77},
      {Mask::window(200), 77, 77},
      {Mask::window(-1, 4), 77, 77},
      {Mask::window(10, -1), 77, 77},
      {Mask::window(6, 2), 30, 50},
      {Mask::window(6), 50, 30},
      {Mask::document(cu, true), 77, 77},
      {Mask::document(cu, false), 77, 77},
      {Mask::document({0, 77}, false), 77, 77},
      {banded_documents(cu, 4, 1), 77, 77},
      {Mask::document(empty, true), 77, 77},
      {Mask::document(empty, false), 77, 77},
      {banded_documents(empty, 4, 1), 77, 77},
      {Mask::document(empty, true), 50, 77},
      {test::shared_prefix_mask(20, {20, 21, 45, 45, 77}), 77, 77},
      {test::shared_prefix_mask(20, {20, 21, 45, 45, 77}), 50, 60},
  };
  std::mt19937_64 rng(5);
  for (int i = 0; i < 8; ++i)  // every kind, slices past Sq or Sk (the flops count 0 .. S - 1)
    cases.push_back({test::random_slices(rng, 77), i % 2 ? 77 : 40, i % 3 ? 77 : 55});
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << c.mask.str() << " Sq=" << c.Sq << " Sk=" << c.Sk);
    spec.mask = c.mask;
    const double expect = visible_pairs(c.mask, c.Sq, c.Sk) * 2.0 * double(D + Dv) * B * H;
    EXPECT_NEAR(attention_flops(B, c.Sq, c.Sk, spec), expect, 1e-9 * expect);
    AttnSpec without = spec;
    without.mask = without_empty_documents(c.mask);
    EXPECT_EQ(attention_flops(B, c.Sq, c.Sk, spec), attention_flops(B, c.Sq, c.Sk, without));
  }
}

// ---------------------------------------------------------------- the kernel under these masks

struct MaskedCase {
  std::string name;
  Mask mask;
  int64_t Sq = 600, Sk = 600, Hq = 1, Hkv = 1, D = 32;
  int64_t q_pos0 = 0, k_pos0 = 0;
};

std::ostream& operator<<(std::ostream& os, const MaskedCase& c) {
  return os << c.name;
}

std::vector<MaskedCase> masked_cases() {
  // Documents straddling the query tiles (256) and key tiles (512), 1-token documents included.
  const std::vector<int64_t> cu = {0, 1, 255, 258, 259, 511, 513, 600};
  std::mt19937_64 rng(600);
  return {
      {"window64", Mask::window(64)},
      {"window300", Mask::window(300)},
      {"window0", Mask::window(0)},
      {"window700_wider_than_seq", Mask::window(700)},
      {"window100_right30", Mask::window(100, 30)},
      {"window5_right300_gqa2", Mask::window(5, 300), 600, 600, 2, 1},
      {"right_window_only", Mask::window(-1, 40)},
      {"window200_queries_at300", Mask::window(200, 7), 140, 600, 2, 1, 32, 300, 0},
      {"window50_keys_from_250", Mask::window(50), 600, 300, 1, 1, 32, 0, 250},
      {"document_causal", Mask::document(cu, true)},
      {"document_noncausal", Mask::document(cu, false)},
      {"document_causal_gqa2_D64", Mask::document(cu, true), 600, 600, 2, 1, 64},
      {"one_document_noncausal", Mask::document({0, 600}, false)},
      {"document_window", banded_documents(cu, 40, 3)},
      {"document_queries_at256", Mask::document(cu, true), 300, 600, 1, 1, 32, 256, 0},
      {"slices_shared_prefix", test::shared_prefix_mask(100, {100, 101, 300, 520, 600})},
      {"slices_shared_prefix_gqa2_queries_at300",
       test::shared_prefix_mask(100, {100, 101, 300, 520, 600}), 300, 600, 2, 1, 32, 300, 0},
      {"slices_random", test::random_slices(rng, 600)},
      {"slices_random_gqa2", test::random_slices(rng, 600), 600, 600, 2, 1},
      {"slices_random_keys_from_250", test::random_slices(rng, 900), 600, 600, 1, 1, 32, 100, 250},
      {"slices_each_kind", Mask::from_slices({{0, 300, 0, 200, MaskSlice::Kind::full},
                                              {0, 300, 200, 600, MaskSlice::Kind::causal},
                                              {300, 600, 0, 400, MaskSlice::Kind::inv_causal},
                                              {300, 600, 400, 600, MaskSlice::Kind::bi_causal},
                                              {310, 590, 400, 400, MaskSlice::Kind::full}})},
  };
}

class MaskedKernel : public testing::TestWithParam<MaskedCase> {};

TEST_P(MaskedKernel, AttentionLocalAndForwardMatchReference) {
  const MaskedCase& c = GetParam();
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    AttnSpec spec;
    spec.heads_q = c.Hq;
    spec.heads_kv = c.Hkv;
    spec.head_dim = c.D;
    spec.mask = c.mask;
    Tensor q = random_tensor({1, c.Sq, c.Hq, c.D}, dt, 31);
    Tensor k = random_tensor({1, c.Sk, c.Hkv, c.D}, dt, 32);
    Tensor v = random_tensor({1, c.Sk, c.Hkv, c.D}, dt, 33);
    auto ref = cpu::attention_reference(q, k, v, spec, c.q_pos0, c.k_pos0);

    Partial r = attention_local(q, k, v, spec, c.q_pos0, c.k_pos0);
    EXPECT_TRUE(matches_reference(r.out.ptr<float>(), r.lse.ptr<float>(), 1, c.Sq, c.Hq, c.D, ref,
                                  tolerance_for(dt)))
        << "attention_local";

    cpu::AttentionBlock blk;
    blk.q = q.data();
    blk.k = k.data();
    blk.v = v.data();
    blk.dtype = dt;
    blk.batch = 1;
    blk.seq_q = c.Sq;
    blk.seq_k = c.Sk;
    blk.heads_q = c.Hq;
    blk.heads_kv = c.Hkv;
    blk.head_dim = c.D;
    blk.head_dim_v = c.D;
    blk.q_pos0 = c.q_pos0;
    blk.k_pos0 = c.k_pos0;
    blk.scale = spec.scale();
    blk.mask = c.mask;
    std::vector<float> out(size_t(c.Sq * c.Hq * c.D)), lse(size_t(c.Hq * c.Sq));
    clear_partial(out.data(), lse.data(), 1, c.Sq, c.Hq, c.D);
    cpu::attention_forward(blk, out.data(), lse.data());
    EXPECT_TRUE(
        matches_reference(out.data(), lse.data(), 1, c.Sq, c.Hq, c.D, ref, tolerance_for(dt)))
        << "attention_forward";
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, MaskedKernel, testing::ValuesIn(masked_cases()),
                         [](const testing::TestParamInfo<MaskedCase>& info) {
                           return info.param.name;
                         });

// Empty documents in the kernel: attention_local with repeated boundaries (at the start, in the
// middle, in a row, at the end; also on the query and key tile edges 256 and 512) against the
// float64 reference of the mask without them, and bit for bit what the call without them gives.
// Also with queries at an offset (a shard past the first documents). fp32 and bf16 alternate.
TEST(MaskedKernelEmptyDocuments, MatchReferenceAndTheCallWithoutThem) {
  const int64_t S = 600, H = 2, D = 32;
  std::vector<test::EmptyDocumentsCase> cases = empty_documents_cases(S);
  cases.push_back({"on_tile_edges", {0, 0, 1, 256, 256, 512, 512, 512, 600, 600}});
  int n = 0;
  for (const auto& [name, cu] : cases) {
    for (const Mask& m :
         {Mask::document(cu, true), Mask::document(cu, false), banded_documents(cu, 40, 3)}) {
      const DType dt = n++ % 2 == 0 ? DType::f32 : DType::bf16;
      for (int64_t q_pos0 : {int64_t(0), int64_t(300)}) {
        const int64_t Sq = S - q_pos0;
        SCOPED_TRACE(testing::Message() << name << " " << m.str() << " " << dtype_name(dt)
                                        << " queries at " << q_pos0);
        AttnSpec spec;
        spec.heads_q = H;
        spec.heads_kv = 1;
        spec.head_dim = D;
        spec.mask = m;
        AttnSpec without = spec;
        without.mask = without_empty_documents(m);
        Tensor q = random_tensor({1, Sq, H, D}, dt, 51);
        Tensor k = random_tensor({1, S, 1, D}, dt, 52);
        Tensor v = random_tensor({1, S, 1, D}, dt, 53);
        const auto ref = cpu::attention_reference(q, k, v, without, q_pos0, 0);
        const Partial r = attention_local(q, k, v, spec, q_pos0, 0);
        EXPECT_TRUE(matches_reference(r.out.ptr<float>(), r.lse.ptr<float>(), 1, Sq, H, D, ref,
                                      tolerance_for(dt)));
        const Partial w = attention_local(q, k, v, without, q_pos0, 0);
        EXPECT_EQ(std::memcmp(r.out.data(), w.out.data(), r.out.nbytes()), 0) << "out";
        EXPECT_EQ(std::memcmp(r.lse.data(), w.lse.data(), r.lse.nbytes()), 0) << "lse";
      }
    }
  }
}

// Query and key rows at block-strided positions (the striped layout with blocks > 1): row i at
// pos0 + (i / block) * stride + i % block. Against the independent reference on the explicit
// positions, under every kind of mask.
std::vector<int64_t> block_positions(int64_t pos0, int64_t n, int64_t block, int64_t stride) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    p[size_t(i)] = pos0 + (i / block) * stride + i % block;
  return p;
}

TEST(MaskedKernelPositions, BlockStridedPositions) {
  struct Geometry {
    int64_t q0, qblock, qstride, k0, kblock, kstride;
  };
  const int64_t Sq = 270, Sk = 530, Hq = 2, Hkv = 1, D = 32;  // past kTileQ, kTileK
  const std::vector<Geometry> geometries = {
      {0, 3, 12, 3, 3, 12},     // striped(block 3, P 4): rank 0's queries, rank 1's keys
      {6, 3, 9, 0, 3, 9},       // P = 3
      {16, 16, 32, 0, 16, 32},  // block 16, P = 2
      {1, 1, 4, 0, 5, 7},       // mixed geometries
  };
  const int64_t span = 4096;  // past every position above
  const std::vector<Mask> masks = {
      Mask::none(),
      Mask::causal(),
      Mask::window(20),
      Mask::window(40, 9),
      Mask::document({0, 1, 100, 101, 700, 1500, 1501, span}, true),
      Mask::document({0, 7, 250, 251, 1100, span}, false),
      Mask::document({0, 0, 1, 100, 100, 101, 700, 1500, 1500, 1501, span, span}, true),  // empty
  };
  // fp32 and bf16 alternate over the (geometry, mask) pairs.
  for (size_t gi = 0; gi < geometries.size(); ++gi) {
    for (size_t mi = 0; mi < masks.size(); ++mi) {
      const Geometry& g = geometries[gi];
      const Mask& m = masks[mi];
      const DType dt = (gi + mi) % 2 == 0 ? DType::f32 : DType::bf16;
      SCOPED_TRACE(testing::Message()
                   << "q " << g.q0 << " block " << g.qblock << " stride " << g.qstride << ", k "
                   << g.k0 << " block " << g.kblock << " stride " << g.kstride << ", " << m.str()
                   << ", " << dtype_name(dt));
      AttnSpec spec;
      spec.heads_q = Hq;
      spec.heads_kv = Hkv;
      spec.head_dim = D;
      spec.mask = m;
      Tensor q = random_tensor({1, Sq, Hq, D}, dt, 41);
      Tensor k = random_tensor({1, Sk, Hkv, D}, dt, 42);
      Tensor v = random_tensor({1, Sk, Hkv, D}, dt, 43);
      cpu::AttentionBlock blk;
      blk.q = q.data();
      blk.k = k.data();
      blk.v = v.data();
      blk.dtype = dt;
      blk.batch = 1;
      blk.seq_q = Sq;
      blk.seq_k = Sk;
      blk.heads_q = Hq;
      blk.heads_kv = Hkv;
      blk.head_dim = D;
      blk.head_dim_v = D;
      blk.q_pos0 = g.q0;
      blk.q_pos_block = g.qblock;
      blk.q_pos_stride = g.qstride;
      blk.k_pos0 = g.k0;
      blk.k_pos_block = g.kblock;
      blk.k_pos_stride = g.kstride;
      blk.scale = spec.scale();
      blk.mask = m;
      std::vector<float> out(size_t(Sq * Hq * D)), lse(size_t(Hq * Sq));
      clear_partial(out.data(), lse.data(), 1, Sq, Hq, D);
      cpu::attention_forward(blk, out.data(), lse.data());
      auto ref =
          test::naive_reference(q, k, v, spec, block_positions(g.q0, Sq, g.qblock, g.qstride),
                                block_positions(g.k0, Sk, g.kblock, g.kstride));
      EXPECT_TRUE(matches_reference(out.data(), lse.data(), 1, Sq, Hq, D, ref, tolerance_for(dt)));
    }
  }
}

}  // namespace
}  // namespace dattn
