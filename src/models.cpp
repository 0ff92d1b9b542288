// FLOP and byte models (see models.h).
#include "src/models.h"

#include <algorithm>

#include "kernels/cpu/attention_cpu.h"

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
    // q + min(right, ...), not min(..., q + right): a window of right near INT64_MAX overflows.
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

uint64_t ring_backward_send_bytes(const Layout& layout, const AttnSpec& spec, int64_t batch,
                                  DType dtype, int rank) {
  const int P = layout.ranks();
  const uint64_t grad_row = uint64_t(spec.heads_kv) * uint64_t(spec.head_dim + spec.dim_v()) *
                            sizeof(float);  // one token of dK and dV
  uint64_t bytes = ring_send_bytes(layout, spec, batch, dtype, rank);
  for (int origin = 0; origin < P; ++origin) {
    const uint64_t block = uint64_t(batch) * uint64_t(layout.local_len(origin)) * grad_row;
    int last = 0;  // the block is held by origin + s for s = 0 .. last
    while (ring_forwards(layout, spec.mask, origin, last))
      ++last;
    // The accumulator travels every hop the block makes, then goes home from its last holder.
    for (int s = 0; s < last; ++s)
      if ((origin + s) % P == rank) bytes += block;
    if (last > 0 && (origin + last) % P == rank) bytes += block;
  }
  return bytes;
}

namespace {
// The spec of one Ulysses member: H/U heads, the same scale.
AttnSpec heads_of_member(const AttnSpec& spec, int U) {
  AttnSpec sub = spec;
  sub.heads_q = spec.heads_q / U;
  sub.heads_kv = spec.heads_kv / U;
  sub.softmax_scale = spec.scale();
  return sub;
}
}  // namespace

uint64_t attention_send_bytes(Strategy strategy, const Layout& layout, const AttnSpec& spec,
                              int64_t batch, DType dtype, int ulysses, int rank) {
  const int U = strategy == Strategy::ring ? 1 : ulysses;
  if (U == 1) return ring_send_bytes(layout, spec, batch, dtype, rank);
  const AttnSpec sub = heads_of_member(spec, U);
  const int first = rank - rank % U;
  const uint64_t esz = dtype_size(dtype), B = uint64_t(batch);
  const uint64_t in_row = uint64_t(sub.heads_q * sub.head_dim + sub.heads_kv * sub.head_dim +
                                   sub.heads_kv * sub.dim_v()) *
                          esz;                                                         // Q, K, V
  const uint64_t out_row = uint64_t(sub.heads_q * (sub.dim_v() + 1)) * sizeof(float);  // out, lse
  uint64_t bytes = 0;
  for (int j = first; j < first + U; ++j) {
    if (j == rank) continue;
    bytes += B * uint64_t(layout.local_len(rank)) * in_row;  // my rows of j's heads
    bytes += B * uint64_t(layout.local_len(j)) * out_row;    // j's rows of my heads, back
  }
  if (layout.ranks() / U > 1)
    bytes += ring_send_bytes(layout.grouped(U), sub, batch, dtype, rank / U);
  return bytes;
}

double attention_rank_flops(Strategy strategy, const Layout& layout, const AttnSpec& spec,
                            int64_t batch, int ulysses, int rank) {
  const int U = strategy == Strategy::ring ? 1 : ulysses;
  const Layout l = U == 1 ? layout : layout.grouped(U);
  const AttnSpec sub = heads_of_member(spec, U);
  const int me = rank / U, P = l.ranks();
  // Per computed tile: S = QK^T and O += PV over kTileQ x kTileK scores, every query head.
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

uint64_t attention_backward_send_bytes(Strategy strategy, const Layout& layout,
                                       const AttnSpec& spec, int64_t batch, DType dtype,
                                       int ulysses, int rank) {
  const int U = strategy == Strategy::ring ? 1 : ulysses;
  if (U == 1) return ring_backward_send_bytes(layout, spec, batch, dtype, rank);
  const AttnSpec sub = heads_of_member(spec, U);
  const int first = rank - rank % U;
  const uint64_t esz = dtype_size(dtype), f = sizeof(float), B = uint64_t(batch);
  const uint64_t hq = uint64_t(sub.heads_q), hkv = uint64_t(sub.heads_kv);
  const uint64_t D = uint64_t(sub.head_dim), Dv = uint64_t(sub.dim_v());
  // Q, K, V in the storage dtype; dout, lse and delta in fp32; dq, dk, dv back in fp32.
  const uint64_t in_row = (hq * D + hkv * D + hkv * Dv) * esz + (hq * Dv + 2 * hq) * f;
  const uint64_t out_row = (hq * D + hkv * D + hkv * Dv) * f;
  uint64_t bytes = 0;
  for (int j = first; j < first + U; ++j) {
    if (j == rank) continue;
    bytes += B * uint64_t(layout.local_len(rank)) * in_row;  // my rows of j's heads
    bytes += B * uint64_t(layout.local_len(j)) * out_row;    // j's rows of my heads, back
  }
  if (layout.ranks() / U > 1)
    bytes += ring_backward_send_bytes(layout.grouped(U), sub, batch, dtype, rank / U);
  return bytes;
}

// ================================================================== star attention

int64_t star_anchor_len(const Layout& layout, int64_t anchor) {
  const int64_t a = anchor < 0 ? layout.block() : anchor;
  return std::min(a, layout.global_seq());  // a context shorter than the anchor is all anchor
}

int star_anchor_root(const Layout& layout) {
  for (int r = 0; r < layout.ranks(); ++r)
    if (layout.local_len(r) > 0) return r;
  return 0;
}

uint64_t star_prefill_send_bytes(const Layout& layout, const AttnSpec& spec, int64_t batch,
                                 DType dtype, int64_t anchor, int rank) {
  const int64_t a = star_anchor_len(layout, anchor);
  if (layout.ranks() == 1 || a == 0 || rank != star_anchor_root(layout)) return 0;
  return uint64_t(batch * a * spec.heads_kv * (spec.head_dim + spec.dim_v())) * dtype_size(dtype);
}

uint64_t star_decode_send_bytes(const KvCache& cache, int64_t s_q, int rank) {
  const int P = cache.ranks();
  if (P == 1) return 0;
  const AttnSpec& spec = cache.spec();
  const uint64_t rows = uint64_t(cache.batch() * s_q * spec.heads_q);
  if (rank == P - 1)  // the query broadcast
    return rows * uint64_t(spec.head_dim) * dtype_size(cache.dtype());
  return rows * uint64_t(spec.dim_v() + 1) * sizeof(float);  // this rank's partial, gathered
}

double star_prefill_flops(const Layout& layout, const AttnSpec& spec, int64_t batch, int64_t anchor,
                          int rank) {
  const int64_t a = star_anchor_len(layout, anchor), b = layout.block();
  const Mask& m = spec.mask;
  // Visible keys of the query at p among positions [lo, hi] under the band.
  auto count = [&](int64_t p, int64_t lo, int64_t hi) {
    lo = m.left < 0 ? lo : std::max(lo, p - m.left);
    hi = m.right < 0 ? hi : p + std::min(m.right, hi - p);  // not p + right: it may overflow
    return double(std::max<int64_t>(0, hi - lo + 1));
  };
  double pairs = 0;
  for (const Run& run : layout.runs(rank)) {
    for (int64_t off = 0; off < run.length; off += b) {
      const int64_t first = run.global_begin + off;
      const int64_t last = first + std::min(b, run.length - off) - 1;
      for (int64_t p = first; p <= last; ++p) {
        pairs += count(p, first, last);                       // the block itself
        if (first > 0 && a > 0) pairs += count(p, 0, a - 1);  // the anchor
      }
    }
  }
  return pairs * 2.0 * double(spec.head_dim + spec.dim_v()) * double(spec.heads_q * batch);
}

}  // namespace dattn
