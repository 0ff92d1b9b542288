// The float64 reference: plain attention over whole tensors in one process, the yardstick for
// every test and for the benchmarks' --check, and its backward. Slow and simple on purpose.
#pragma once

#include <cstdint>
#include <vector>

#include "src/base/spec.h"
#include "src/base/tensor.h"

namespace dattn::cpu {

// A host tensor's stored values as doubles, in element order: the references read them once
// (a Tensor::get per access took 98% of a reference's time under ASan).
std::vector<double> as_doubles(const Tensor& t);

// With spec.softcap, each scaled score s is softcap * tanh(s / softcap); with spec.sinks, each
// row's softmax counts its head's sink (AttnSpec::sinks).
struct ReferenceResult {
  std::vector<double> out;  // [B, S_q, H_q, D_v]
  std::vector<double> lse;  // [B, H_q, S_q]; -inf for a row that sees no key (out row = 0), or
                            // its sink
};

// q [B, S_q, H_q, D], k [B, S_k, H_kv, D], v [B, S_k, H_kv, D_v] of any storage dtype (read as
// the stored values); q at global positions q_pos0.., k at k_pos0...
ReferenceResult attention_reference(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const AttnSpec& spec, int64_t q_pos0 = 0, int64_t k_pos0 = 0);

struct ReferenceGrads {
  std::vector<double> dq;      // [B, S_q, H_q, D]
  std::vector<double> dk;      // [B, S_k, H_kv, D]; GQA: summed over the query heads of each group
  std::vector<double> dv;      // [B, S_k, H_kv, D_v]
  std::vector<double> dsinks;  // [H_q] with spec.sinks (summed over batch and rows), else empty
};

// The gradients of sum(dout * out) for out = attention_reference(q, k, v, spec, q_pos0, k_pos0),
// dout [B, S_q, H_q, D_v] of any storage dtype (read as the stored values). Every probability is
// recomputed in float64 from the scores; a row that sees no key contributes nothing.
ReferenceGrads attention_backward_reference(const Tensor& q, const Tensor& k, const Tensor& v,
                                            const Tensor& dout, const AttnSpec& spec,
                                            int64_t q_pos0 = 0, int64_t k_pos0 = 0);

}  // namespace dattn::cpu
