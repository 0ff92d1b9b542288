// libFuzzer target: attention-spec validation. An AttnSpec and its Mask from fuzzed fields
// (heads, head dims, softmax scale as raw bits, window sides, cu_seqlens, slices); validate()
// either throws dattn::Error or the spec is usable: str/hash/scale work, and on fuzzed global
// positions (anywhere in [0, INT64_MAX]) visible() follows its definition and cover() is sound
// (never "none" when a pair of the block is visible, never "all" when one is hidden).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "src/base/error.h"
#include "src/base/spec.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using dattn::AttnSpec;
using dattn::Mask;

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

// The document of pos by a linear scan (cu_seqlens validated: non-decreasing from 0).
int64_t document_by_scan(const Mask& m, int64_t pos) {
  if (!m.documents) return 0;
  int64_t d = 0;
  for (size_t i = 1; i < m.documents->size(); ++i)
    if (pos >= (*m.documents)[i]) d = int64_t(i);
  return d;
}

// Visibility written out without overflow: k within [q - left, q + right] on non-negative
// positions, and the same document.
bool visible_by_definition(const Mask& m, int64_t q, int64_t k) {
  if (m.slices) {  // in a rectangle, on the right side of its kind's diagonals (offsets i, j)
    for (const dattn::MaskSlice& sl : *m.slices) {
      if (q < sl.q_begin || q >= sl.q_end || k < sl.k_begin || k >= sl.k_end) continue;
      const int64_t i = q - sl.q_begin, j = k - sl.k_begin;
      const int64_t excess = (sl.k_end - sl.k_begin) - (sl.q_end - sl.q_begin);
      const bool below = j - i <= excess, above = j >= i;
      return (!sl.upper() || below) && (!sl.lower() || above);
    }
    return false;
  }
  if (m.left >= 0 && k < q && q - k > m.left) return false;
  if (m.right >= 0 && k > q && k - q > m.right) return false;
  return document_by_scan(m, q) == document_by_scan(m, k);
}

// A position: anywhere, or near a fuzzed anchor (a document boundary, a slice's edge, 0, or
// INT64_MAX).
int64_t position(dattn::fuzz::Input& in, const Mask& m) {
  const uint8_t c = in.byte();
  int64_t anchor = 0;
  if (c % 4 == 1) anchor = kMax;
  if (c % 4 == 2 && m.documents) anchor = (*m.documents)[size_t(c / 4) % m.documents->size()];
  if (c % 4 == 2 && m.slices && !m.slices->empty()) {
    const dattn::MaskSlice& sl = (*m.slices)[size_t(c / 16) % m.slices->size()];
    const int64_t edges[] = {sl.q_begin, sl.q_end, sl.k_begin, sl.k_end};
    anchor = edges[(c / 4) % 4];
  }
  if (c % 4 == 3) return int64_t(in.raw<uint64_t>() & uint64_t(kMax));
  const int64_t delta = int64_t(in.byte() % 64) - 32;
  if (delta > 0 && anchor > kMax - delta) return kMax;
  return std::max<int64_t>(0, anchor + delta);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dattn::fuzz::Input in(data, size);
  AttnSpec spec;
  spec.heads_q = in.size();
  spec.heads_kv = in.size();
  spec.head_dim = in.size();
  spec.head_dim_v = in.size();
  spec.softmax_scale = in.raw<float>();
  const uint8_t kind = in.byte();
  const int64_t left = in.size(), right = in.size();
  switch (kind % 6) {
    case 0:
      spec.mask = Mask::none();
      break;
    case 1:
      spec.mask = Mask::causal();
      break;
    case 2:
      spec.mask = Mask::window(left, right);
      break;
    case 5: {  // slices: fuzzed ranges (some out of order, overlapping or near INT64_MAX), kinds
      std::vector<dattn::MaskSlice> slices;
      auto end_after = [&](int64_t begin) {  // any value, or a short range from begin
        const int64_t n = in.byte() % 40;
        return in.byte() % 2 ? in.size() : begin > kMax - n ? kMax : begin + n;
      };
      for (int n = in.byte() % 6; n > 0; --n) {
        dattn::MaskSlice sl;
        sl.q_begin = in.size();
        sl.q_end = end_after(sl.q_begin);
        sl.k_begin = in.size();
        sl.k_end = end_after(sl.k_begin);
        sl.kind = dattn::MaskSlice::Kind(in.byte() % 5);  // 4: invalid
        slices.push_back(sl);
      }
      spec.mask = Mask::from_slices(std::move(slices));
      break;
    }
    default: {
      // Boundaries: increasing steps from the previous one, or any value (mostly invalid).
      std::vector<int64_t> cu;
      for (int n = in.byte() % 12; n > 0; --n) {
        const int64_t prev = cu.empty() ? 0 : cu.back(), step = cu.empty() ? 0 : in.byte() % 16;
        cu.push_back(in.byte() % 2 || prev > kMax - step ? in.size() : prev + step);
      }
      spec.mask = Mask::document(std::move(cu), in.byte() % 2);
      if (kind % 6 == 4) {  // documents with a window as well
        spec.mask.left = left;
        spec.mask.right = right;
      }
    }
  }
  try {
    spec.validate();
  } catch (const dattn::Error& e) {
    dattn::fuzz::expect_argument_error(e);
    return 0;
  }
  const Mask& m = spec.mask;
  FUZZ_CHECK(spec.heads_q % spec.heads_kv == 0, spec.str());
  FUZZ_CHECK(spec.dim_v() >= 1 && spec.dim_v() <= 256, spec.str());
  FUZZ_CHECK(std::isfinite(spec.scale()) && spec.scale() > 0.f, spec.str());
  FUZZ_CHECK(m == m && m.hash() == Mask(m).hash(), m.str());
  FUZZ_CHECK(!m.is_causal() || (m.left < 0 && m.right == 0 && !m.documents && !m.slices), m.str());
  FUZZ_CHECK(!m.is_none() || (m.left < 0 && m.right < 0 && !m.documents && !m.slices), m.str());

  // Single pairs, from the fuzzed positions.
  for (int i = 0; i < 8 && !in.empty(); ++i) {
    const int64_t q = position(in, m), k = position(in, m);
    FUZZ_CHECK(m.visible(q, k) == visible_by_definition(m, q, k), m.str(), " q ", q, " k ", k);
    const int64_t d = m.document_of(q);
    FUZZ_CHECK(d >= 0 && d == document_by_scan(m, q), m.str(), " document_of(", q, ") = ", d);
  }

  // Blocks of up to 16 x 16 positions: cover is sound.
  for (int i = 0; i < 4 && !in.empty(); ++i) {
    const int64_t q_lo = position(in, m), k_lo = position(in, m);
    const int64_t q_n = in.byte() % 17, k_n = in.byte() % 17;  // 0: an empty block
    const int64_t q_hi = q_lo > kMax - q_n ? kMax : q_lo + q_n - 1;
    const int64_t k_hi = k_lo > kMax - k_n ? kMax : k_lo + k_n - 1;
    bool any_visible = false, any_hidden = false;
    for (int64_t q = q_lo; q <= q_hi; ++q) {
      for (int64_t k = k_lo; k <= k_hi; ++k) {
        (visible_by_definition(m, q, k) ? any_visible : any_hidden) = true;
        if (k == kMax) break;
      }
      if (q == kMax) break;
    }
    const Mask::Cover c = m.cover(q_lo, q_hi, k_lo, k_hi);
    FUZZ_CHECK(!(any_visible && c == Mask::Cover::none), m.str(),
               " cover none, a pair visible: q [", q_lo, ", ", q_hi, "] k [", k_lo, ", ", k_hi,
               "]");
    FUZZ_CHECK(!(any_hidden && c == Mask::Cover::all), m.str(), " cover all, a pair hidden: q [",
               q_lo, ", ", q_hi, "] k [", k_lo, ", ", k_hi, "]");
    FUZZ_CHECK(!(m.slices && !any_visible && c != Mask::Cover::none), m.str(),
               " slices: cover not none, no pair visible: q [", q_lo, ", ", q_hi, "] k [", k_lo,
               ", ", k_hi, "]");
  }
  (void)spec.str();
  return 0;
}
