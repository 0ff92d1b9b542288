// FLOP and byte models (see models.h).
#include "src/models.h"

namespace dattn {

double attention_flops(int64_t batch, int64_t seq_q, int64_t seq_k, const AttnSpec& spec) {
  double f = 2.0 * double(batch) * double(spec.heads_q) * double(seq_q) * double(seq_k) *
             double(spec.head_dim + spec.dim_v());
  return spec.mask.kind == Mask::Kind::causal ? f / 2 : f;
}

bool ring_forwards(const Layout& layout, const Mask& mask, int origin, int step) {
  const int P = layout.ranks();
  if (step >= P - 1) return false;  // the last step sends nothing
  // The block is at rank origin + step; it would next reach origin + step + 1, ... origin - 1.
  for (int k = step + 1; k <= P - 1; ++k)
    if (layout.any_visible(mask, (origin + k) % P, origin)) return true;
  return false;
}

uint64_t ring_send_bytes(const Layout& layout, const AttnSpec& spec, int64_t batch, DType dtype,
                         int rank) {
  const int P = layout.ranks();
  const uint64_t row = uint64_t(spec.heads_kv) * uint64_t(spec.head_dim + spec.dim_v()) *
                       dtype_size(dtype);  // one token of K and V
  uint64_t bytes = 0;
  for (int s = 0; s + 1 < P; ++s) {
    const int origin = ((rank - s) % P + P) % P;
    if (ring_forwards(layout, spec.mask, origin, s))
      bytes += uint64_t(batch) * uint64_t(layout.local_len(origin)) * row;
  }
  return bytes;
}

}  // namespace dattn
