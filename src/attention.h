// The public attention API: one entry point per workload over the same Runtime.
//   dattn::Partial r = dattn::attention(rt, q, k, v, spec, layout, dattn::Strategy::ring);
// q, k, v are this rank's shards (bshd) under `layout`; the result is this rank's shard of
// out [B, S_local, H_q, D_v] and lse [B, H_q, S_local], both fp32.
#pragma once

#include <string>

#include "src/base/spec.h"
#include "src/base/tensor.h"
#include "src/layout.h"
#include "src/partial.h"
#include "src/runtime.h"

namespace dattn {

// The prefill schedules of attention, attention_backward and the models (src/models.h). ring: K/V
// blocks rotate around the cp ranks. ulysses: all-to-all from sequence shards to head shards
// (needs heads_kv divisible by the cp ranks), local attention, all-to-all back. hybrid: Ulysses
// inside groups of rt.ulysses_degree() ranks, ring across the groups (USP). The decode schedules
// are another type, DecodeStrategy (src/decode.h).
enum class Strategy : uint8_t { ring = 0, ulysses = 1, hybrid = 2 };
const char* strategy_name(Strategy s);
Strategy parse_strategy(const std::string& name);  // throws dattn::Error naming the value

// Distributed attention forward. Collective over rt.cp(): every rank calls it with the same
// spec, layout, strategy, batch and dtype. Bad input throws dattn::Error on every rank (the
// ranks agree on validation before any data moves), naming the parameter and the rank.
//
// Devices: q, k and v must be on rt.device(), and the result is there too. On a GPU runtime
// (RuntimeOptions.device cuda) every strategy runs on bf16/fp16 within the CUDA kernel's limits
// (kernels/cuda/limits.h; anything else throws on every rank before any data moves); the result
// is complete in the order of the Runtime's stream (RuntimeOptions.stream, by default the legacy
// default stream: a copy or kernel queued there after the call sees it; other streams wait for
// it first, src/base/stream.h), and the call returns without waiting for the device. The
// non-finite check copies device tensors to the host to scan them (a host wait).
//
// Non-finite inputs (README "Numerics"): NaN or inf where the mask hides it changes no result: a
// row's out, lse (and dq) depend only on its own q (and dout) and the keys it sees, a key's dk
// and dv only on the queries that see it; a row that sees no key has out = 0, lse = -inf, dq = 0
// whatever its q holds. With RuntimeOptions.check_finite or DATTN_CHECK_FINITE=1 (off by default)
// each rank scans its q, k, v (and dout in the backward) inside that validation, and a NaN or inf
// throws on every rank, naming the tensor, the rank, the batch, global position, head and dim of
// the first one, and its value.
Partial attention(Runtime& rt, const Tensor& q, const Tensor& k, const Tensor& v,
                  const AttnSpec& spec, const Layout& layout, Strategy strategy = Strategy::ring);

// Attention of one process over whole tensors (no communication), on the device that holds them
// (host tensors: the CPU kernel; cuda tensors, bf16/fp16 and band or document masks: the CUDA
// kernel, asynchronous on the current stream of src/base/stream.h): q at global positions q_pos0..,
// k/v at k_pos0... It takes no Runtime: DATTN_CHECK_FINITE=1 turns on its check of q, k, v (and
// dout, attention_local_backward) for NaN and inf.
Partial attention_local(const Tensor& q, const Tensor& k, const Tensor& v, const AttnSpec& spec,
                        int64_t q_pos0 = 0, int64_t k_pos0 = 0);

// ------------------------------------------------------------------ backward
// (Partial and Gradients: src/partial.h.)

// Distributed attention backward. Collective over rt.cp(), with the arguments of the attention()
// call that returned `fwd` (this rank's out and lse) and dout, the gradient of this rank's out
// ([B, S_local, H_q, D_v], any storage dtype). Probabilities are recomputed blockwise from lse;
// nothing of size S x S is stored. Gradients accumulate in fp32 in a fixed order, so repeated
// calls give bit-identical results. The tensors on the Runtime's device (else every rank throws
// before any data moves): on a GPU Runtime every schedule runs on device buffers over its NCCL
// groups with the CUDA backward kernel. The gradients come back on that device, dsinks on the
// host.
Gradients attention_backward(Runtime& rt, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Partial& fwd, const Tensor& dout, const AttnSpec& spec,
                             const Layout& layout, Strategy strategy = Strategy::ring);

// The backward of attention_local: one process, whole tensors, the same positions, on their device
// (fwd and dout there too; the gradients, fp32, come back there).
Gradients attention_local_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                   const Partial& fwd, const Tensor& dout, const AttnSpec& spec,
                                   int64_t q_pos0 = 0, int64_t k_pos0 = 0);

}  // namespace dattn
