// The merge of partial attention results: the stable log-sum-exp rule every strategy uses.
//
// A partial over a set of keys is (o, lse): o the softmax-weighted mean of the values (fp32),
// lse = log(sum_j exp(s_j)) over the scaled scores s_j. Two partials over disjoint key sets
// combine exactly:
//   m = max(lse_a, lse_b); w_a = exp(lse_a - m); w_b = exp(lse_b - m)
//   lse = m + log(w_a + w_b);  o = (w_a o_a + w_b o_b) / (w_a + w_b)
// An empty partial (no visible key) is o = 0, lse = -inf and is the identity of the merge;
// two empty partials merge to an empty one. lse is never +inf, so m is never +inf and the
// differences above are never inf - inf. Never write this as lse_a + log(1 + exp(lse_b - lse_a)):
// the exp overflows when lse_b >> lse_a.
#pragma once

#include <cmath>
#include <cstdint>

namespace dattn {

// Merges the partial (o_b, lse_b) into (o_a, lse_a); both rows hold dv values. An empty side
// contributes nothing, whatever its o holds (padding may hold garbage, even NaN).
inline void merge_row(float* o_a, float* lse_a, const float* o_b, float lse_b, int64_t dv) {
  if (lse_b == -INFINITY) return;
  if (*lse_a == -INFINITY) {
    for (int64_t d = 0; d < dv; ++d)
      o_a[d] = o_b[d];
    *lse_a = lse_b;
    return;
  }
  float m = std::fmax(*lse_a, lse_b);
  float w_a = std::exp(*lse_a - m);
  float w_b = std::exp(lse_b - m);
  float sum = w_a + w_b;
  float c_a = w_a / sum, c_b = w_b / sum;
  for (int64_t d = 0; d < dv; ++d)
    o_a[d] = c_a * o_a[d] + c_b * o_b[d];
  *lse_a = m + std::log(sum);
}

// Merges whole partials: out [batch, seq, heads, dv] fp32 (bshd), lse [batch, heads, seq] fp32.
// (out_a, lse_a) is updated in place.
void merge_partials(float* out_a, float* lse_a, const float* out_b, const float* lse_b,
                    int64_t batch, int64_t seq, int64_t heads, int64_t dv);

// Sets a partial to empty: out = 0, lse = -inf.
void clear_partial(float* out, float* lse, int64_t batch, int64_t seq, int64_t heads, int64_t dv);

}  // namespace dattn
