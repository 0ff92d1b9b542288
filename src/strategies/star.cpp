// Star attention's schedules (src/star.h), called after validation: phase 1 (local causal
// attention behind the anchor) and phase 2 (the query rank's tokens attend to every rank's cache;
// partials merged at the query rank).
//
// The anchor's K/V are broadcast from the rank holding the context's first tokens rather than
// recomputed: dattn takes K and V, not the hidden states and projections that recomputation
// would need, and the broadcast is a * H_kv * (D + D_v) values per sequence, once.
// Phase 2 gathers the partials at the query rank and merges them there: each other rank sends
// its partial exactly once (B * S_q * H * (D_v + 1) floats), the least any scheme can send; a
// reduce would first need a max of lse on every rank (one more round) to rescale before summing.
// Both phases run unchanged on host and GPU tensors: buffers live on the Runtime's device and the
// copies and the merge go through src/dispatch.h.
#include <algorithm>

#include "src/models.h"
#include "src/strategies/strategies.h"

namespace dattn {

Partial star_attention_prefill(Communicator& comm, const Tensor& q, const Tensor& k,
                               const Tensor& v, const AttnSpec& spec, const Layout& layout,
                               int64_t anchor) {
  const int P = comm.size(), me = comm.rank();
  const Device dev = q.device();
  const int64_t B = q.size(0), a = star_anchor_len(layout, anchor), n = layout.local_len(me);
  const int root = star_anchor_root(layout);
  Partial res = empty_partial(q, spec);

  // The anchor: the first a tokens' K/V, from the rank that holds them to every other.
  const size_t kr = size_t(spec.heads_kv * spec.head_dim) * dtype_size(q.dtype());
  const size_t vr = size_t(spec.heads_kv * spec.dim_v()) * dtype_size(q.dtype());
  const size_t anchor_bytes = size_t(B * a) * (kr + vr);
  const Tensor anchor_buf = byte_buffer(anchor_bytes, dev);
  char* anchor_kv = static_cast<char*>(anchor_buf.data());
  if (a > 0) {
    if (me == root) {  // [B, a] rows of K, then of V, from the first a of each batch entry's n
      copy_rows(anchor_kv, dev, a, 0, k.data(), dev, n, 0, B, a, kr);
      copy_rows(anchor_kv + size_t(B * a) * kr, dev, a, 0, v.data(), dev, n, 0, B, a, vr);
    }
    if (P > 1) comm.broadcast(anchor_kv, anchor_bytes, root);
  }
  // Every block on its own: [anchor | block], causal on global positions. Block 0 holds the
  // anchor itself and attends to itself only. The anchor's K/V are the broadcast copy (the
  // holder packed its own), so every rank reads them from the same place.
  const int64_t b = layout.block();
  for (const Run& run : layout.runs(me)) {
    for (int64_t off = 0; off < run.length; off += b) {
      const Run block{run.local_begin + off, run.global_begin + off, 1,
                      std::min(b, run.length - off)};
      if (block.global_begin > 0 && a > 0)
        attend_runs(q, {block}, anchor_kv, anchor_kv + size_t(B * a) * kr, a, {Run{0, 0, 1, a}},
                    spec, res);
      attend_runs(q, {block}, k.data(), v.data(), n, {block}, spec, res);
    }
  }
  return res;
}

Partial star_attention_decode(Communicator& comm, const Tensor& q, const KvCache& cache) {
  const int P = comm.size(), me = comm.rank(), root = P - 1;
  const int64_t Sq = q.size(1);
  const AttnSpec& spec = cache.spec();
  const Device dev = q.device();
  const int64_t B = q.size(0), H = spec.heads_q, Dv = spec.dim_v();

  // 1. The query, from the query rank to every rank.
  Tensor qb = Tensor::empty({B, Sq, H, spec.head_dim}, q.dtype(), dev);  // every rank may overwrite
  copy_bytes(qb.data(), q.data(), qb.nbytes(), dev);
  if (P > 1) comm.broadcast(qb.data(), qb.nbytes(), root);
  // 2. Every rank's partial against its cache.
  Partial part = empty_partial(qb, spec);
  attend_runs(qb, {Run{0, cache.length() - Sq, 1, Sq}}, cache.k().data(), cache.v().data(),
              cache.capacity(), cache.runs(me), spec, part);
  if (P == 1) return part;
  // 3. Gathered at the query rank as [out | lse] and merged there in rank order.
  const size_t out_n = size_t(part.out.numel()), lse_n = size_t(part.lse.numel());
  const size_t mine_n = out_n + lse_n, f = sizeof(float);
  Tensor mine = byte_buffer(mine_n * f, dev);
  copy_bytes(mine.ptr<float>(), part.out.data(), out_n * f, dev);
  copy_bytes(mine.ptr<float>() + out_n, part.lse.data(), lse_n * f, dev);
  const Tensor all = byte_buffer(me == root ? mine_n * size_t(P) * f : 0, dev);
  comm.gather(mine.data(), all.data(), mine_n * f, root);
  if (me != root) return Partial{};
  Partial res = empty_partial(qb, spec);
  for (int r = 0; r < P; ++r) {
    const float* p = all.ptr<float>() + size_t(r) * mine_n;
    merge_partials(dev, res.out.ptr<float>(), res.lse.ptr<float>(), p, p + out_n, B, Sq, H, Dv);
  }
  return res;
}

}  // namespace dattn
