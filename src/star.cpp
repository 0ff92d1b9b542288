// Star attention's entry points (src/star.h): the checks of a call, agreed by all ranks before any
// data moves, then the schedule (src/strategies/star.cpp).
#include "src/star.h"

#include "src/base/error.h"
#include "src/check_finite.h"
#include "src/dispatch.h"
#include "src/strategies/strategies.h"
#include "src/validate.h"

namespace dattn {

Partial star_prefill(Runtime& rt, const Tensor& q, const Tensor& k, const Tensor& v,
                     const AttnSpec& spec, const Layout& layout, int64_t anchor) {
  StreamScope on_stream(rt.stream());  // all device work of this call on its stream
  Communicator& comm = rt.cp();
  const int P = comm.size(), me = comm.rank();
  uint64_t hash = attention_config_hash(spec, layout, Strategy::ring, q.dtype(), q.size(0));
  const Device dev = rt.device();
  agree_on_validation(comm, "star prefill", hash_mix(hash, uint64_t(anchor)), [&] {
    check_qkv(q, k, v, spec, &dev);
    check_attention_limits(dev, q.dtype(), spec, q.size(0), -1);
    DATTN_CHECK_ARG(layout.kind() == Layout::Kind::blocks, "layout", layout.str(),
                    "Layout::blocks(S, P, b) (star attention places whole blocks)");
    DATTN_CHECK_ARG(layout.ranks() == P, "layout ranks", layout.ranks(), P);
    DATTN_CHECK_ARG(anchor >= -1 && anchor <= layout.block(), "anchor", anchor,
                    detail::cat("0 to the block size (", layout.block(), "), or -1 for the block"));
    DATTN_CHECK_ARG(!spec.mask.documents && !spec.mask.slices, "mask", spec.mask.str(),
                    "a band mask (documents and slices are not supported by star attention)");
    DATTN_CHECK_ARG(q.size(1) == layout.local_len(me) && k.size(1) == q.size(1), "q seq", q.size(1),
                    detail::cat(layout.local_len(me), " (this rank's blocks)"));
    if (rt.check_finite()) {
      auto position = [&](int64_t row) { return layout.global_position(me, row); };
      check_finite_tensor(q, "q", position);
      check_finite_tensor(k, "k", position);
      check_finite_tensor(v, "v", position);
    }
  });
  Partial res = star_attention_prefill(comm, q, k, v, spec.without_sinks(), layout, anchor);
  if (spec.sinks) add_sinks(res, *spec.sinks);  // once, on the merged result
  return res;
}

Partial star_decode(Runtime& rt, const Tensor& q, const KvCache& cache) {
  StreamScope on_stream(rt.stream());  // all device work of this call on its stream
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
    check_attention_limits(dev, q.dtype(), spec, q.size(0), q.size(1));
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
  // The merged result lives on the query rank only (the others get an undefined Partial); the
  // sinks join it once.
  Partial res = star_attention_decode(comm, q, cache);
  if (spec.sinks) add_sinks(res, *spec.sinks);
  return res;
}

}  // namespace dattn
