// Decoding over a sequence-sharded KV cache: the cache (each rank holds part of the context and
// grows as tokens are decoded) and the decode step, whose strategies are tree (Tree Attention:
// each rank's partial against its shard, combined by two fixed-size allreduces), ring (K/V
// shards rotate) and allgather (every rank gathers the whole cache).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "src/attention.h"
#include "src/layout.h"
#include "src/runtime.h"

namespace dattn {

// The decode schedules (src/strategies/decode.cpp): tree (two fixed-size allreduces of the
// ranks' partials), ring (K/V shards rotate) and allgather (every rank gathers the whole cache).
// A type of their own: the prefill schedules are Strategy (src/attention.h).
enum class DecodeStrategy : uint8_t { tree = 0, ring = 1, allgather = 2 };
const char* strategy_name(DecodeStrategy s);
DecodeStrategy parse_decode_strategy(const std::string& name);  // throws dattn::Error naming it

// Which rank stores a decoded token: round_robin spreads new tokens over the ranks (token t of
// the decoded ones on rank t % P) to keep shards balanced; last_rank puts them all on the last.
enum class Placement : uint8_t { round_robin = 0, last_rank = 1 };
const char* placement_name(Placement p);

class KvCache {
 public:
  // Room for `capacity` tokens on this rank: K [B, capacity, H_kv, D], V [B, capacity, H_kv, D_v]
  // of `dtype`, in `device` memory (the Runtime's device: a GPU runtime decodes a cache on its
  // GPU). Not collective; every rank must construct it alike (checked by decode()).
  KvCache(int ranks, int rank, const AttnSpec& spec, int64_t batch, DType dtype, int64_t capacity,
          Placement placement = Placement::round_robin, Device device = Device::cpu());

  // Stores this rank's shard of the prompt's K/V ([B, layout.local_len(rank), H_kv, D]); the
  // context is then layout.global_seq() tokens at the layout's positions. Once, before appends.
  // prefill and append take host or device tensors whatever the cache's device (a GPU cache
  // allocates and copies on the current stream, src/base/stream.h: a decode step queued later
  // there sees the rows, and the caller's host tensors may be reused or freed on return). With a
  // Runtime on a stream of its own, construct, prefill and append under
  // StreamScope(rt.stream()).
  void prefill(const Tensor& k_shard, const Tensor& v_shard, const Layout& layout);
  // Appends n tokens at global positions length() .. length() + n - 1. k_new [B, n, H_kv, D] and
  // v_new are the same on every rank (only the ranks that keep a token read it: with last_rank,
  // the others may pass any tensor of that shape); each rank keeps the tokens the placement gives
  // it. Throws dattn::Error naming the capacity when any rank's share does not fit, on every rank
  // and before any rank stores a token (every rank knows every rank's share).
  void append(const Tensor& k_new, const Tensor& v_new);

  int64_t length() const { return length_; }  // tokens in the whole context
  int64_t local_len() const { return local_len(rank_); }
  int64_t local_len(int rank) const;
  // Where a rank's tokens sit: rows of its buffers and their global positions.
  const std::vector<Run>& runs(int rank) const { return runs_.at(size_t(rank)); }
  // The global position of this rank's buffer row `row` (-1 for a row past local_len()).
  int64_t global_position(int64_t row) const;
  const Tensor& k() const { return k_; }  // rows [0, local_len()) are valid
  const Tensor& v() const { return v_; }
  const AttnSpec& spec() const { return spec_; }
  int64_t batch() const { return batch_; }
  DType dtype() const { return dtype_; }
  int64_t capacity() const { return capacity_; }
  Placement placement() const { return placement_; }
  Device device() const { return k_.device(); }
  size_t k_row_bytes() const;  // bytes of one token's K (H_kv * D values) in one batch entry
  size_t v_row_bytes() const;  // and of its V
  int ranks() const { return ranks_; }
  int rank() const { return rank_; }
  uint64_t hash() const;  // spec, batch, dtype, placement, length: must match across ranks

 private:
  int ranks_, rank_;
  AttnSpec spec_;
  int64_t batch_, capacity_;
  DType dtype_;
  Placement placement_;
  int64_t length_ = 0, prefill_len_ = 0, appended_ = 0;
  std::vector<std::vector<Run>> runs_;  // per rank: its prompt runs, then one appended run
  std::vector<size_t> prompt_runs_;     // per rank: how many of its runs hold prompt tokens
  Tensor k_, v_;
};

// One decode step: q [B, S_q, H_q, D], the same on every rank, at global positions
// length() - S_q .. length() - 1 (append the new tokens' K/V first, so they see themselves).
// Collective over rt.cp(). Every rank returns the same whole result: out [B, S_q, H_q, D_v] and
// lse [B, H_q, S_q], fp32. strategy: tree (two-level when rt.spans_nodes()), ring or allgather.
// q and the cache are on rt.device(), and so is the result. On a GPU runtime every strategy runs
// on bf16/fp16 within the CUDA kernel's limits (kernels/cuda/limits.h; anything else throws on
// every rank before data moves); the result is complete in the order of the Runtime's stream,
// as dattn::attention's.
// A cache's unused capacity is never read. With the non-finite check on (RuntimeOptions.
// check_finite or DATTN_CHECK_FINITE=1), q and this rank's filled cache rows are scanned during
// the agreed validation; a NaN or inf throws on every rank naming "q", "cache k" or "cache v",
// the rank, the batch, global position, head, dim and value (device tensors are copied to the
// host to be scanned).
Partial decode(Runtime& rt, const Tensor& q, const KvCache& cache,
               DecodeStrategy strategy = DecodeStrategy::tree);

// Bytes `rank` sends in one decode step (validation excluded): tree sends fixed-size partials
// ([B, H, S_q] lse and [B, S_q, H, D_v + 1] packed floats), independent of the context; ring
// forwards K/V shards; allgather contributes its whole shard. node_size as in RuntimeOptions
// (0 or >= ranks: one node, the flat tree).
uint64_t decode_send_bytes(DecodeStrategy strategy, const KvCache& cache, int64_t s_q,
                           int node_size, int rank);

}  // namespace dattn
