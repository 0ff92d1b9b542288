// The schedules behind dattn::attention, one file each. They are called after validation and
// read as their schedule: which blocks meet where, and what moves between ranks.
#pragma once

#include "collective/communicator.h"
#include "src/attention.h"

namespace dattn {

// Ring attention forward (ring.cpp): K/V blocks rotate around comm's ranks.
Partial ring_attention_forward(Communicator& comm, const Tensor& q, const Tensor& k,
                               const Tensor& v, const AttnSpec& spec, const Layout& layout);

// Attends q's runs (held by q_rank) to a K/V block holding k_rank's runs, into res.
void attend_runs(const Tensor& q, const void* k, const void* v, int64_t k_rows,
                 const AttnSpec& spec, const Layout& layout, int q_rank, int k_rank, Partial& res);

// An empty partial for q: out = 0 [B, S, H_q, D_v], lse = -inf [B, H_q, S].
Partial empty_partial(const Tensor& q, const AttnSpec& spec);

}  // namespace dattn
