// The point-to-point batch of the NCCL backend: the sends and receives posted between two
// issue points and the order NCCL receives them in. Shared by NcclCommunicator and the
// NCCL-semantics communicator of the CUDA emulation (tests/emu), so that the emulation matches
// messages exactly as the real backend issues them.
#pragma once

#include <algorithm>
#include <cstddef>
#include <tuple>
#include <vector>

namespace dattn {

struct P2pOp {
  bool send = false;
  void* buf = nullptr;  // const for a send: one list holds both kinds
  size_t bytes = 0;
  int peer = 0;
  int tag = 0;
};

// NCCL matches a peer's sends with that peer's receives in issue order and has no tags. Issuing
// each peer's sends, and each peer's receives, ordered by tag (stable: equal tags keep posting
// order) makes both sides of a pair issue matching messages in the same order even where they
// posted them differently, as MPI's tag matching would pair them, within one batch. Across
// batches the order of issue decides. Zero-byte operations are dropped on both sides (sizes must
// match, so both drop them).
inline std::vector<P2pOp> nccl_issue_order(std::vector<P2pOp> ops) {
  std::stable_sort(ops.begin(), ops.end(), [](const P2pOp& a, const P2pOp& b) {
    return std::tie(a.peer, a.send, a.tag) < std::tie(b.peer, b.send, b.tag);
  });
  ops.erase(std::remove_if(ops.begin(), ops.end(), [](const P2pOp& op) { return op.bytes == 0; }),
            ops.end());
  return ops;
}

}  // namespace dattn
