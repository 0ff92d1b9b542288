// agree_on_validation: one allreduce of (failing rank, hash, ~hash), then on failure a
// broadcast of the failing rank's error (kind and message) or an allgather of the hashes.
#include "src/validate.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

#include "src/base/error.h"

namespace dattn {

void agree_on_validation(Communicator& group, const std::string& what, uint64_t config_hash,
                         const std::function<void()>& check) {
  // Flags, messages and hashes live in host memory: the group's control communicator carries
  // them (the group itself on MPI; its MPI twin on NCCL).
  Communicator& comm = group.control();
  constexpr uint64_t kNone = std::numeric_limits<uint64_t>::max();
  // The failing rank's error as it travels: its kind and message (cut to fit).
  struct Failure {
    uint64_t kind = uint64_t(ErrorKind::invalid_argument);
    char message[1024] = {};
  } failure;
  uint64_t local[3] = {kNone, config_hash, ~config_hash};
  auto fail = [&](ErrorKind kind, const std::string& message) {
    failure.kind = uint64_t(kind);
    std::strncpy(failure.message, message.c_str(), sizeof(failure.message) - 1);
    local[0] = uint64_t(comm.rank());
  };
  // Whatever the check throws is relayed, so that no rank goes on into a collective alone.
  try {
    check();
  } catch (const Error& e) {
    fail(e.kind(), e.message());
  } catch (const std::bad_alloc&) {
    fail(ErrorKind::out_of_memory, "out of memory while checking the arguments");
  } catch (const std::exception& e) {
    fail(ErrorKind::internal, detail::cat("internal error: ", e.what()));
  }
  // min over ranks of: failing rank, hash, ~hash. All hashes equal iff min(h) == ~min(~h).
  uint64_t global[3];
  comm.allreduce_u64(local, global, 3, ReduceOp::min);

  if (global[0] != kNone) {
    const int root = int(global[0]);
    comm.broadcast(&failure, sizeof(failure), root);
    failure.message[sizeof(failure.message) - 1] = '\0';
    const ErrorKind kind =
        failure.kind < uint64_t(kErrorKinds) ? ErrorKind(failure.kind) : ErrorKind::internal;
    DATTN_THROW_KIND(kind, "rank ", root, " rejected the ", what, ": ", failure.message);
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
