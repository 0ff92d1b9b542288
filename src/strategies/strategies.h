// The schedules behind dattn::attention, attention_backward, decode and star, one file each.
// They are called after validation and read as their schedule: which blocks meet where, and what
// moves between ranks. They reach the kernels, copies and merges through the dispatch layer
// (src/dispatch.h), which picks the CPU or the CUDA code by the tensors' device.
#pragma once

#include "collective/communicator.h"
#include "src/base/spec.h"
#include "src/base/tensor.h"
#include "src/decode.h"
#include "src/dispatch.h"
#include "src/layout.h"
#include "src/partial.h"
#include "src/runtime.h"

namespace dattn {

// Ring attention forward (ring.cpp): K/V blocks rotate around comm's ranks.
Partial ring_attention_forward(Communicator& comm, const Tensor& q, const Tensor& k,
                               const Tensor& v, const AttnSpec& spec, const Layout& layout);

// Ulysses / hybrid attention (hybrid.cpp): an all-to-all inside `group` (U ranks, consecutive
// cp ranks; cp_rank is this rank's), then attention of the group's sequence with H/U heads,
// locally (ring == nullptr or of size 1) or by ring attention over `ring` (one rank per group),
// then the all-to-all back. heads_q and heads_kv must divide by U.
Partial hybrid_attention_forward(Communicator& group, Communicator* ring, const Tensor& q,
                                 const Tensor& k, const Tensor& v, const AttnSpec& spec,
                                 const Layout& layout, int cp_rank);

// Ring attention backward (ring_backward.cpp): K/V blocks travel as in the forward, each with
// its dK|dV accumulator; the last holder sends it home. lse and delta (= rowsum(dout * out)) are
// this rank's [B, H_q, S_local] fp32; dout is fp32.
Gradients ring_attention_backward(Communicator& comm, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& dout, const float* lse,
                                  const float* delta, const AttnSpec& spec, const Layout& layout);

// Ulysses / hybrid backward (hybrid.cpp): the forward's all-to-alls transposed.
Gradients hybrid_attention_backward(Communicator& group, Communicator* ring, const Tensor& q,
                                    const Tensor& k, const Tensor& v, const Tensor& dout,
                                    const float* lse, const float* delta, const AttnSpec& spec,
                                    const Layout& layout, int cp_rank);

// ------------------------------------------------------------------ decode (decode.cpp)
// One step of dattn::decode after validation: q [B, S_q, H_q, D] at the positions q_runs, the
// same on every rank; every rank returns the whole result.

// Tree: this rank's partial against its shard, then a max-allreduce of lse and a sum-allreduce of
// [w * out | w] (two levels when rt.spans_nodes()).
Partial tree_decode(Runtime& rt, const Tensor& q, const std::vector<Run>& q_runs,
                    const KvCache& cache);
// Ring (pass-KV): the shards rotate around comm's ranks; partials merged in rank order.
Partial ring_decode(Communicator& comm, const Tensor& q, const std::vector<Run>& q_runs,
                    const KvCache& cache);
// Allgather: every rank gathers every shard, then attends to all of them.
Partial allgather_decode(Communicator& comm, const Tensor& q, const std::vector<Run>& q_runs,
                         const KvCache& cache);

// ------------------------------------------------------------------ star (star.cpp)

// Phase 1 of star_prefill (src/star.h): the anchor broadcast from the rank that holds it, then
// every block of this rank attends to [anchor | itself], causally.
Partial star_attention_prefill(Communicator& comm, const Tensor& q, const Tensor& k,
                               const Tensor& v, const AttnSpec& spec, const Layout& layout,
                               int64_t anchor);
// One phase-2 step of star_decode: the query broadcast from the query rank (the last), every
// rank's partial against its cache, gathered and merged at the query rank (the others return an
// empty Partial).
Partial star_attention_decode(Communicator& comm, const Tensor& q, const KvCache& cache);

}  // namespace dattn
