// FLOP and byte models (see models.h).
#include "src/models.h"

#include <algorithm>

namespace dattn {

double attention_flops(int64_t batch, int64_t seq_q, int64_t seq_k, const AttnSpec& spec) {
  double f = 2.0 * double(batch) * double(spec.heads_q) * double(seq_q) * double(seq_k) *
             double(spec.head_dim + spec.dim_v());
  if (spec.mask.is_none()) return f;
  if (spec.mask.is_causal()) return f / 2;  // the usual model (exact: (S + 1) / 2S)
  // Other masks: count the visible (query, key) pairs of positions 0.. on both sides.
  double pairs = 0;
  for (int64_t q = 0; q < seq_q; ++q) {
    int64_t lo = spec.mask.left < 0 ? 0 : std::max<int64_t>(0, q - spec.mask.left);
    int64_t hi =
        spec.mask.right < 0 ? seq_k - 1 : std::min<int64_t>(seq_k - 1, q + spec.mask.right);
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
