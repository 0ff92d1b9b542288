// The schedules behind dattn::attention, one file each. They are called after validation and
// read as their schedule: which blocks meet where, and what moves between ranks.
#pragma once

#include "collective/communicator.h"
#include "src/attention.h"

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

// The backward of attend_runs: adds the gradients of q's rows q_runs against the K/V block's rows
// k_runs to dq [B, S_q, H_q, D] and to the block's dk [B, k_rows, H_kv, D], dv (fp32). dout is
// fp32 [B, S_q, H_q, D_v]; lse and delta fp32 [B, H_q, S_q].
void backward_runs(const Tensor& q, const std::vector<Run>& q_runs, const void* k, const void* v,
                   int64_t k_rows, const std::vector<Run>& k_runs, const Tensor& dout,
                   const float* lse, const float* delta, const AttnSpec& spec, float* dq, float* dk,
                   float* dv);

// Attends q's rows q_runs (rows of q and their global positions) to the rows k_runs of a K/V
// block of k_rows rows per batch entry (bshd, q's dtype), merging into res. k, v and res live on
// q's device: the CPU kernel for host tensors, the CUDA kernel (legacy default stream,
// asynchronous) for GPU ones.
void attend_runs(const Tensor& q, const std::vector<Run>& q_runs, const void* k, const void* v,
                 int64_t k_rows, const std::vector<Run>& k_runs, const AttnSpec& spec,
                 Partial& res);

// Shape, dtype and spec checks of this rank's q, k, v (throws dattn::Error naming the field).
// device: the device they must all be on (the Runtime's); null: the host (an entry point
// without a CUDA path).
void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, const AttnSpec& spec,
               const Device* device = nullptr);
// The hash of what must match on every rank of an attention call.
uint64_t attention_config_hash(const AttnSpec& spec, const Layout& layout, Strategy strategy,
                               DType dtype, int64_t batch);

// An empty partial for q, on q's device: out = 0 [B, S, H_q, D_v], lse = -inf [B, H_q, S].
Partial empty_partial(const Tensor& q, const AttnSpec& spec);
// Clears p (out = 0, lse = -inf) on its device (on a GPU: on the legacy default stream, as the
// kernels run).
void clear_partial(Partial& p);

}  // namespace dattn
