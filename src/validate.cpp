// agree_on_validation: one allreduce of (failing rank, hash, ~hash), then on failure a
// broadcast of the failing rank's message or an allgather of the hashes.
#include "src/validate.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "src/base/error.h"

namespace dattn {

void agree_on_validation(Communicator& group, const std::string& what, uint64_t config_hash,
                         const std::function<void()>& check) {
  // Flags, messages and hashes live in host memory: the group's control communicator carries
  // them (the group itself on MPI; its MPI twin on NCCL).
  Communicator& comm = group.control();
  constexpr uint64_t kNone = std::numeric_limits<uint64_t>::max();
  std::string message;
  uint64_t local[3] = {kNone, config_hash, ~config_hash};
  try {
    check();
  } catch (const Error& e) {
    message = e.message();
    local[0] = uint64_t(comm.rank());
  }
  // min over ranks of: failing rank, hash, ~hash. All hashes equal iff min(h) == ~min(~h).
  uint64_t global[3];
  comm.allreduce_u64(local, global, 3, ReduceOp::min);

  if (global[0] != kNone) {
    const int root = int(global[0]);
    char buf[1024] = {};
    if (comm.rank() == root) std::strncpy(buf, message.c_str(), sizeof(buf) - 1);
    comm.broadcast(buf, sizeof(buf), root);
    DATTN_THROW("rank ", root, " rejected the ", what, ": ", buf);
  }
  if (global[1] != ~global[2]) {
    std::vector<uint64_t> hashes(size_t(comm.size()));
    comm.allgather(&config_hash, hashes.data(), sizeof(uint64_t));
    std::string differ;
    for (int r = 1; r < comm.size(); ++r)
      if (hashes[size_t(r)] != hashes[0])
        differ += (differ.empty() ? "" : ", ") + std::to_string(r);
    DATTN_THROW("invalid ", what, ": the configuration differs between ranks (ranks ", differ,
                " differ from rank 0): every rank must pass the same spec, layout, strategy,",
                " batch and dtype");
  }
}

}  // namespace dattn
