// Star attention: phase 1 (local causal attention behind the anchor) and phase 2 (the query
// rank's tokens attend to every rank's cache; partials merged at the query rank).
//
// The anchor's K/V are broadcast from the rank holding the context's first tokens rather than
// recomputed: dattn takes K and V, not the hidden states and projections that recomputation
// would need, and the broadcast is a * H_kv * (D + D_v) values per sequence, once.
// Phase 2 gathers the partials at the query rank and merges them there: each other rank sends
// its partial exactly once (B * S_q * H * (D_v + 1) floats), the least any scheme can send; a
// reduce would first need a max of lse on every rank (one more round) to rescale before summing.
// Both phases run unchanged on host and GPU tensors: buffers live on the Runtime's device and the
// copies and the merge go through src/dispatch.h.
#include "src/star.h"
#include "src/base/error.h"
#include "src/check_finite.h"
#include "src/dispatch.h"
#include "src/strategies/strategies.h"
#include "src/validate.h"

namespace dattn {

namespace {

int64_t anchor_len(const Layout& layout, int64_t anchor) {
  const int64_t a = anchor < 0 ? layout.block() : anchor;
  return std::min(a, layout.global_seq());  // a context shorter than the anchor is all anchor
}

// The cp rank that holds position 0 (the first rank with a block).
int anchor_root(const Layout& layout) {
  for (int r = 0; r < layout.ranks(); ++r)
    if (layout.local_len(r) > 0) return r;
  return 0;
}

}  // namespace

Partial star_prefill(Runtime& rt, const Tensor& q, const Tensor& k, const Tensor& v,
                     const AttnSpec& spec, const Layout& layout, int64_t anchor) {
  Communicator& comm = rt.cp();
  const int P = comm.size(), me = comm.rank();
  uint64_t hash = attention_config_hash(spec, layout, Strategy::ring, q.dtype(), q.size(0));
  const Device dev = rt.device();
  agree_on_validation(comm, "star prefill", hash_mix(hash, uint64_t(anchor)), [&] {
    check_qkv(q, k, v, spec, &dev);
    check_attention_limits(dev, q.dtype(), spec, q.size(0));
    DATTN_CHECK_ARG(layout.kind() == Layout::Kind::blocks, "layout", layout.str(),
                    "Layout::blocks(S, P, b) (star attention places whole blocks)");
    DATTN_CHECK_ARG(layout.ranks() == P, "layout ranks", layout.ranks(), P);
    DATTN_CHECK_ARG(anchor >= -1 && anchor <= layout.block(), "anchor", anchor,
                    detail::cat("0 to the block size (", layout.block(), "), or -1 for the block"));
    DATTN_CHECK_ARG(!spec.mask.documents, "mask", spec.mask.str(),
                    "a band mask (documents are not supported by star attention)");
    DATTN_CHECK_ARG(q.size(1) == layout.local_len(me) && k.size(1) == q.size(1), "q seq", q.size(1),
                    detail::cat(layout.local_len(me), " (this rank's blocks)"));
    if (rt.check_finite()) {
      auto position = [&](int64_t row) { return layout.global_position(me, row); };
      check_finite_tensor(q, "q", position);
      check_finite_tensor(k, "k", position);
      check_finite_tensor(v, "v", position);
    }
  });
  const int64_t B = q.size(0), a = anchor_len(layout, anchor), n = layout.local_len(me);
  const int root = anchor_root(layout);
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

Partial star_decode(Runtime& rt, const Tensor& q, const KvCache& cache) {
  Communicator& comm = rt.cp();
  const int P = comm.size(), me = comm.rank(), root = P - 1;
  const int64_t Sq = q.dim() == 4 ? q.size(1) : 0;
  const AttnSpec& spec = cache.spec();
  const Device dev = rt.device();
  uint64_t hash = hash_mix(cache.hash(), uint64_t(Sq));
  agree_on_validation(comm, "star decode step", hash, [&] {
    DATTN_CHECK_ARG(cache.placement() == Placement::last_rank, "placement",
                    placement_name(cache.placement()),
                    "last_rank (the query rank keeps the query and generated tokens)");
    DATTN_CHECK_ARG(cache.ranks() == P && cache.rank() == me, "cache rank",
                    detail::cat(cache.rank(), " of ", cache.ranks()),
                    detail::cat(me, " of ", P, " (this cp rank)"));
    DATTN_CHECK_ARG(q.dim() == 4, "q rank", q.dim(), "4 dimensions [batch, S_q, heads, head_dim]");
    DATTN_CHECK_ARG(q.device() == dev, "q device", q.device().str(),
                    detail::cat(dev.str(), " (the Runtime's device)"));
    DATTN_CHECK_ARG(cache.device() == dev, "cache device", cache.device().str(),
                    detail::cat(dev.str(), " (the Runtime's device)"));
    check_attention_limits(dev, q.dtype(), spec, q.size(0));
    DATTN_CHECK_ARG(q.dtype() == cache.dtype(), "q dtype", dtype_name(q.dtype()),
                    dtype_name(cache.dtype()));
    DATTN_CHECK_ARG(
        q.size(0) == cache.batch() && q.size(2) == spec.heads_q && q.size(3) == spec.head_dim,
        "q shape", q.shape_str(),
        detail::cat("[", cache.batch(), ", S_q, ", spec.heads_q, ", ", spec.head_dim, "]"));
    DATTN_CHECK_ARG(Sq >= 1 && Sq <= cache.length(), "S_q", Sq,
                    detail::cat("1 to the context length (", cache.length(), ")"));
    if (rt.check_finite()) {  // the query (on the query rank) and this rank's cache rows
      if (me == root)
        check_finite_tensor(q, "q", [&](int64_t row) { return cache.length() - Sq + row; });
      auto position = [&](int64_t row) { return cache.global_position(row); };
      check_finite_rows(cache.k(), "cache k", 0, cache.local_len(), position);
      check_finite_rows(cache.v(), "cache v", 0, cache.local_len(), position);
    }
  });
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

uint64_t star_prefill_send_bytes(const Layout& layout, const AttnSpec& spec, int64_t batch,
                                 DType dtype, int64_t anchor, int rank) {
  const int64_t a = anchor_len(layout, anchor);
  if (layout.ranks() == 1 || a == 0 || rank != anchor_root(layout)) return 0;
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
  const int64_t a = anchor_len(layout, anchor), b = layout.block();
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
