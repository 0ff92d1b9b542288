// FLOP and byte models: what a workload should cost, written down so benchmarks can report
// throughput from them and tests can assert that a strategy moves exactly what its model says.
// Each costs O(runs) per pair of ranks (closed forms, not tile walks); a byte count beyond 64 bits
// throws dattn::Error naming its factors.
#pragma once

#include <cstdint>

#include "src/attention.h"
#include "src/base/dtype.h"
#include "src/base/spec.h"
#include "src/decode.h"
#include "src/layout.h"

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

// The heads of one member of a Ulysses group of U ranks: H_q / U query heads and H_kv / U
// key/value heads, or, where U is a multiple of H_kv, one key/value head that U / H_kv members
// share (ulysses_kv_share: member j holds kv head j / share). The same softmax scale.
AttnSpec ulysses_member_spec(const AttnSpec& spec, int U);
int ulysses_kv_share(const AttnSpec& spec, int U);

// Bytes `rank` (a cp rank) sends in one attention call of `strategy`, point-to-point and
// all-to-all together (validation's small allreduce excluded). `ulysses` is the Ulysses degree U:
// ring 1, ulysses the number of cp ranks, hybrid the runtime's. Ulysses sends each other member
// of its group its rows of the other members' heads (Q, K, V in the storage dtype) and, on the
// way back, their rows of its heads (out and lse, fp32); hybrid adds the ring over the groups
// with H / U heads. With U > H_kv each member gets its one kv head (ulysses_member_spec), so
// each K/V head travels to the U / H_kv members that use it, never expanded to H_q heads.
uint64_t attention_send_bytes(Strategy strategy, const Layout& layout, const AttnSpec& spec,
                              int64_t batch, DType dtype, int ulysses, int rank);

// FLOPs `rank` computes in one attention call of `strategy`, counting only the kernel tiles
// (kTileQ x kTileK) that the mask does not hide entirely, as the kernel skips them. Its max over
// ranks divided by its mean is the load balance of a layout.
double attention_rank_flops(Strategy strategy, const Layout& layout, const AttnSpec& spec,
                            int64_t batch, int ulysses, int rank);

// The (query, key) scores of the kTileQ x kTileK kernel tiles of q_run against k_run that the
// mask does not hide entirely: one kernel call's work, which attention_rank_flops sums over a
// rank's run pairs (and Layout::balanced over a chunk's).
double kernel_scores(const Run& q_run, const Run& k_run, const Mask& mask);

// Bytes `rank` sends in ring attention backward (src/strategies/ring_backward.cpp): the forward's
// K/V hops, plus a block's dK|dV accumulator (fp32, H_kv * (D + D_v) per token) on each of those
// hops, plus the finished accumulator from the block's last holder straight to its owner.
uint64_t ring_backward_send_bytes(const Layout& layout, const AttnSpec& spec, int64_t batch,
                                  DType dtype, int rank);

// Bytes `rank` sends in one attention_backward call of `strategy` (as attention_send_bytes):
// Ulysses / hybrid send Q, K, V (storage dtype) with dout, lse and delta (fp32) to the other
// members of the group, get dq, dk, dv (fp32) back, and hybrid adds the ring backward over the
// groups. With sinks (more than one rank) the allreduce of their gradient adds heads_q x 4.
uint64_t attention_backward_send_bytes(Strategy strategy, const Layout& layout,
                                       const AttnSpec& spec, int64_t batch, DType dtype,
                                       int ulysses, int rank);

// Whether, at ring step `step`, the block that started on rank `origin` must be sent on to the
// next rank: some rank it has still to reach holds a query that sees it. The ring schedules'
// rule; the byte models count the same hops for every block at once.
bool ring_forwards(const Layout& layout, const Mask& mask, int origin, int step);

// ------------------------------------------------------------------ star attention (src/star.h)

// The anchor of a star_prefill call: its length (anchor -1: the block; at most the context), and
// the cp rank that holds it (the first with a block).
int64_t star_anchor_len(const Layout& layout, int64_t anchor);
int star_anchor_root(const Layout& layout);

// Bytes `rank` sends: phase 1 (the anchor broadcast, root only) and one phase-2 step (the query
// broadcast from the query rank, then every other rank's partial gathered there).
uint64_t star_prefill_send_bytes(const Layout& layout, const AttnSpec& spec, int64_t batch,
                                 DType dtype, int64_t anchor, int rank);
uint64_t star_decode_send_bytes(const KvCache& cache, int64_t s_q, int rank);

// Phase-1 FLOPs of `rank` (exact visible pairs: each of its blocks causally, plus every token
// of a block but the first against the anchor).
double star_prefill_flops(const Layout& layout, const AttnSpec& spec, int64_t batch, int64_t anchor,
                          int rank);

}  // namespace dattn
