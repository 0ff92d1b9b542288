// The results of an attention call: a partial (out and lse, what kernels, merges and schedules
// pass around) and the gradients of the backward.
#pragma once

#include "src/base/tensor.h"

namespace dattn {

// A partial attention result: out fp32 bshd, lse fp32 [B, H, S] (natural log; -inf for a row
// that saw no key, whose out is 0).
struct Partial {
  Tensor out;
  Tensor lse;
};

// The gradients of one attention call with respect to its inputs, this rank's shards, fp32
// whatever the storage dtype: dq like q [B, S_local, H_q, D], dk like k, dv like v. For GQA, dk
// and dv sum over the query heads of each group. dsinks [H_q] fp32 (host) when the spec has
// sinks, summed over every row of every cp rank (the same on each); undefined without.
struct Gradients {
  Tensor dq, dk, dv;
  Tensor dsinks = Tensor{};
};

}  // namespace dattn
