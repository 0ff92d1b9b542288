// FLOP and byte models: what a workload should cost, written down so benchmarks can report
// throughput from them and tests can assert that a strategy moves exactly what its model says.
#pragma once

#include <cstdint>

#include "src/dtype.h"
#include "src/layout.h"
#include "src/spec.h"

namespace dattn {

// Forward attention FLOPs of the whole problem: 2 * B * H_q * S_q * S_k * (D_qk + D_v)
// (= 4 * B * H * S_q * S_k * D when D_v = D), halved for causal.
double attention_flops(int64_t batch, int64_t seq_q, int64_t seq_k, const AttnSpec& spec);

// Bytes `rank` sends in ring attention: every K/V block it forwards, H_kv heads each. A block
// travels along the ring only while a rank ahead still has a query that sees it, so for
// non-causal attention each rank sends (P - 1) blocks, (P-1) * 2 * B * (S/P) * H_kv * D * size
// when S divides and D_v = D, and fewer under a causal mask.
uint64_t ring_send_bytes(const Layout& layout, const AttnSpec& spec, int64_t batch, DType dtype,
                         int rank);

// Whether, at ring step `step`, the block that started on rank `origin` must be sent on to the
// next rank: some rank it has still to reach holds a query that sees it. Shared by the ring
// schedule and its byte model.
bool ring_forwards(const Layout& layout, const Mask& mask, int origin, int step);

}  // namespace dattn
