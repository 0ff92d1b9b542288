// Context-parallel layouts: which global tokens each rank holds, and the dispatch/undispatch
// of global tensors. A rank's shard is a list of runs of tokens at evenly spaced global
// positions, which is what the kernel takes, so every strategy works under every layout.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "src/base/spec.h"
#include "src/base/tensor.h"

namespace dattn {

class Communicator;

// `length` tokens stored at local rows [local_begin, local_begin + length). Their global
// positions come in blocks of `block` consecutive positions, `stride` apart: local row
// local_begin + i is at global_begin + (i / block) * stride + i % block (block 1, stride 1: a
// contiguous range; block 1, stride P: every P-th token).
struct Run {
  int64_t local_begin = 0;
  int64_t global_begin = 0;
  int64_t stride = 1;
  int64_t length = 0;
  int64_t block = 1;

  int64_t position(int64_t i) const { return global_begin + (i / block) * stride + i % block; }
  int64_t last_position() const { return position(length - 1); }
};

class Layout {
 public:
  enum class Kind : uint8_t {
    contiguous = 0,
    zigzag = 1,
    striped = 2,
    varlen = 3,
    blocks = 4,
    balanced = 5
  };

  Layout() = default;  // an empty layout (no tokens, one rank); assign a real one before use

  // Rank r holds one contiguous range. When global_seq does not divide by ranks, the first
  // global_seq % ranks ranks hold one token more: no padding, nothing truncated, and every
  // strategy handles shards of different lengths.
  static Layout contiguous(int64_t global_seq, int ranks);
  // The sequence cut into 2P chunks; rank r holds chunks r and 2P-1-r, so that under a causal
  // mask every rank has the same work. Chunk lengths differ by at most one token (the first
  // global_seq % 2P chunks hold one more).
  static Layout zigzag(int64_t global_seq, int ranks);
  // Round-robin blocks of `block` tokens: rank r holds blocks r, r + P, r + 2P, ... (block 1:
  // positions r, r + P, ...). The last block may be partial.
  static Layout striped(int64_t global_seq, int ranks, int64_t block = 1);
  // Documents packed in one sequence, boundaries cu_seqlens = [0, e1, ..., S]: each document is
  // cut into 2P chunks and rank r holds chunks r and 2P-1-r of every document (zigzag per
  // document), so that causal work inside documents is balanced; an empty document (a repeated
  // entry) holds no token and adds no run. Use with Mask::document.
  static Layout varlen(std::vector<int64_t> cu_seqlens, int ranks);
  // Whole blocks of `block` tokens (the last may be partial), placed contiguously: rank r holds
  // blocks [r * nb / P, (r + 1) * nb / P) of the nb blocks. Star attention's layout.
  static Layout blocks(int64_t global_seq, int ranks, int64_t block);
  // Chunks of `chunk` tokens (the last may be partial) dealt to ranks so that the most work any
  // rank has under `mask` is least: each chunk's work is its kernel tiles against every chunk
  // (kernel_scores, src/models.h), and the chunks go, the most work first, to the rank with the
  // least so far among those that still have room (every rank gets floor or ceil of chunks / P).
  // A rank holds its chunks in position order, one run each (runs are not merged: the kernel's
  // tiles start at each run, so the work of a rank is the sum of its chunks'). For slice and
  // document masks whose work is uneven along the sequence. At most 4096 chunks.
  static Layout balanced(const Mask& mask, int64_t global_seq, int ranks, int64_t chunk);
  int64_t block() const { return block_; }  // striped, blocks, balanced (the chunk)
  // The layout of a kind by name: "contiguous", "zigzag" or "striped" (blocks of one token);
  // throws dattn::Error.
  static Layout make(const std::string& kind, int64_t global_seq, int ranks);
  static const char* kind_name(Kind kind);

  Kind kind() const { return kind_; }
  int ranks() const { return ranks_; }
  int64_t global_seq() const { return global_seq_; }
  int64_t local_len(int rank) const;
  int64_t max_local_len() const;
  const std::vector<Run>& runs(int rank) const;
  int64_t global_position(int rank, int64_t local_index) const;

  // The layout of groups of `group_size` consecutive ranks (hybrid strategy): group g holds the
  // runs of ranks g*U .. g*U+U-1, one after the other (what an all-to-all inside the group
  // gathers). ranks() must divide by group_size.
  Layout grouped(int group_size) const;

  // Whether any query held by q_rank sees any key held by k_rank under the mask.
  bool any_visible(const Mask& mask, int q_rank, int k_rank) const;

  // This rank's shard of a global bshd tensor [B, global_seq, H, D] that the caller holds, on the
  // global tensor's device.
  Tensor dispatch(const Tensor& global, int rank) const;
  // Gathers every rank's bshd shard [B, local_len, H, D] into the global tensor, on every rank,
  // on the shard's device. The data goes over comm.control(), host memory (comm itself for MPI,
  // the MPI side channel of an NCCL communicator), so any Runtime's rt.cp() will do.
  Tensor undispatch(Communicator& comm, const Tensor& shard) const;

  std::string str() const;  // "zigzag(S=4096, P=4)"
  uint64_t hash() const;

 private:
  // Checks the arguments every layout shares and sets them; runs_ gets one empty list per rank.
  Layout(Kind kind, int64_t global_seq, int ranks);

  Kind kind_ = Kind::contiguous;
  int ranks_ = 1;
  int64_t global_seq_ = 0;
  std::vector<std::vector<Run>> runs_ = {{}};
  int64_t block_ = 1;                                      // striped
  std::shared_ptr<const std::vector<int64_t>> documents_;  // varlen
};

}  // namespace dattn
