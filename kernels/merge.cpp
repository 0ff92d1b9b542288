// Whole-tensor merges of partials (see merge.h for the rule), parallel over rows.
#include "kernels/merge.h"

#include "kernels/movement/movement.h"

namespace dattn {

// Both run the Thrust code of kernels/movement (OMP backend here), the code the GPU build runs
// on device memory; its merge functor follows merge_row step for step (tests/test_movement.cpp
// checks the bits).
void merge_partials(float* out_a, float* lse_a, const float* out_b, const float* lse_b,
                    int64_t batch, int64_t seq, int64_t heads, int64_t dv) {
  movement::host::merge_partials(out_a, lse_a, out_b, lse_b, batch, seq, heads, dv);
}

void clear_partial(float* out, float* lse, int64_t batch, int64_t seq, int64_t heads, int64_t dv) {
  movement::host::clear_partial(out, batch * seq * heads * dv, lse, batch * heads * seq);
}

}  // namespace dattn
