// The mask's rule on each element of a partially visible tile, as the CPU kernels (forward,
// backward, decode) apply it to a tile's scores: prepared once per tile of keys (their positions
// and documents, or the slices that meet the tile), then applied row by row. One per thread,
// built before the parallel region (it allocates).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "src/base/spec.h"

namespace dattn::cpu {

class TileMask {
 public:
  // For tiles of up to max_keys keys under `mask` (which must outlive it).
  TileMask(const Mask& mask, int64_t max_keys)
      : mask_(&mask), kpos_(size_t(max_keys)), kdoc_(mask.documents ? size_t(max_keys) : 0) {
    if (mask.slices) {
      slices_.reserve(mask.slices->size());
      ranges_.reserve(mask.slices->size());
    }
  }

  // The tile: n keys of one run, key j at position pos(j) (ascending in j), met by queries at
  // positions in [q_lo, q_hi].
  template <class Pos>
  void prepare(int64_t q_lo, int64_t q_hi, int64_t n, Pos pos) {
    n_ = n;
    for (int64_t j = 0; j < n; ++j)
      kpos_[size_t(j)] = pos(j);
    if (mask_->documents)
      for (int64_t j = 0; j < n; ++j)
        kdoc_[size_t(j)] = mask_->document_of(kpos_[size_t(j)]);
    if (mask_->slices) {  // the slices that show some key of the tile to some query of it
      slices_.clear();
      int64_t lo, hi;
      for (const MaskSlice& sl : *mask_->slices) {
        if (sl.q_begin > q_hi) break;  // sorted by q_begin
        if (sl.keys_seen(q_lo, q_hi, kpos_[0], kpos_[size_t(n - 1)], &lo, &hi))
          slices_.push_back(&sl);
      }
    }
  }

  // Sets row[j] = fill for each key j of the tile that the query at position qp does not see;
  // returns whether it sees any.
  bool hide(int64_t qp, float* row, float fill) {
    if (mask_->slices) return hide_slices(qp, row, fill);
    const int64_t qdoc = mask_->document_of(qp);
    bool any = false;
    for (int64_t j = 0; j < n_; ++j) {
      const int64_t kp = kpos_[size_t(j)];
      if (!mask_->in_band(qp, kp) || (mask_->documents && kdoc_[size_t(j)] != qdoc))
        row[j] = fill;
      else
        any = true;
    }
    return any;
  }

 private:
  // The keys a query sees in each slice form an interval; the slices that hold qp have disjoint
  // key ranges, so the tile's keys it sees are disjoint runs of j, and the rest is filled.
  bool hide_slices(int64_t qp, float* row, float fill) {
    ranges_.clear();
    const int64_t* k = kpos_.data();
    for (const MaskSlice* sl : slices_) {
      int64_t lo, hi;
      if (!sl->keys_seen(qp, qp, k[0], k[n_ - 1], &lo, &hi)) continue;
      const int64_t a = std::lower_bound(k, k + n_, lo) - k;
      const int64_t b = std::upper_bound(k, k + n_, hi) - k;
      if (a < b) ranges_.emplace_back(a, b);
    }
    std::sort(ranges_.begin(), ranges_.end());
    int64_t j = 0;
    for (const auto& [a, b] : ranges_) {
      std::fill(row + j, row + a, fill);
      j = b;
    }
    std::fill(row + j, row + n_, fill);
    return !ranges_.empty();
  }

  const Mask* mask_;
  int64_t n_ = 0;
  std::vector<int64_t> kpos_, kdoc_;
  std::vector<const MaskSlice*> slices_;
  std::vector<std::pair<int64_t, int64_t>> ranges_;
};

}  // namespace dattn::cpu
