// Whole-tensor merges of partials (see merge.h for the rule), parallel over rows.
#include "kernels/merge.h"

#include <cstring>

namespace dattn {

void merge_partials(float* out_a, float* lse_a, const float* out_b, const float* lse_b,
                    int64_t batch, int64_t seq, int64_t heads, int64_t dv) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t s = 0; s < seq; ++s) {
      for (int64_t h = 0; h < heads; ++h) {
        int64_t row = (b * seq + s) * heads + h;  // bshd row of out
        int64_t l = (b * heads + h) * seq + s;    // bhs index of lse
        merge_row(out_a + row * dv, lse_a + l, out_b + row * dv, lse_b[l], dv);
      }
    }
  }
}

void clear_partial(float* out, float* lse, int64_t batch, int64_t seq, int64_t heads, int64_t dv) {
  std::memset(out, 0, sizeof(float) * size_t(batch * seq * heads * dv));
  for (int64_t i = 0; i < batch * heads * seq; ++i)
    lse[i] = -INFINITY;
}

}  // namespace dattn
