// Star attention (two-phase long-context inference). Phase 1 encodes the context with no
// exchange of context: the context is cut into blocks of b tokens, and every block attends to
// itself causally, prefixed by the anchor (the context's first a tokens, sent once from the rank
// that holds them); each rank keeps its blocks' K/V as its cache. Phase 2 lets the
// query and generated tokens, which live on the query rank (the last), attend to every cache:
// the query is broadcast, every rank computes its partial, and the partials are merged at the
// query rank. Phase 1 is an approximation (no rank sees the middle of the context before it);
// phase 2 is exact over the cached K/V. Both phases run on the Runtime's device (tensors and cache
// there; on cuda bf16/fp16 within kernels/cuda/limits.h).
#pragma once

#include <cstdint>

#include "src/attention.h"
#include "src/decode.h"
#include "src/layout.h"
#include "src/models.h"
#include "src/runtime.h"

namespace dattn {

// Phase 1. q, k, v are this rank's shard under `layout`, which must be Layout::blocks(S, P, b).
// anchor: how many of the context's first tokens prefix every block (0 .. b; -1: b); block 0
// holds them and attends to itself alone. Every block is independent of the others, also on
// the same rank (so with b >= S it is exact causal attention). Returns this rank's out and
// lse. Collective over rt.cp(): one broadcast of the anchor's K/V from the rank that holds them
// (src/strategies/star.cpp says why not recomputation). Bad block or anchor sizes throw
// dattn::Error on every rank.
Partial star_prefill(Runtime& rt, const Tensor& q, const Tensor& k, const Tensor& v,
                     const AttnSpec& spec, const Layout& layout, int64_t anchor = -1);

// Phase 2, one step. cache: prefilled from the phase-1 shards (the same layout) with
// Placement::last_rank, and the query tokens' K/V appended (only the query rank reads them), so
// that generated tokens see everything. q [B, S_q, H_q, D] is read on the query rank only, at
// global positions length() - S_q ..; the others pass any tensor of that shape. Returns the
// merged result on the query rank; the other ranks return an empty Partial. Collective.
Partial star_decode(Runtime& rt, const Tensor& q, const KvCache& cache);

// The byte and FLOP models of both phases (star_prefill_send_bytes, star_decode_send_bytes,
// star_prefill_flops) are in src/models.h.

}  // namespace dattn
