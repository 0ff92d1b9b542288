// The Communicator interface every strategy talks to, and its per-operation byte counters.
// Buffers are opaque pointers: a backend decides where they live (MPI: host memory; NCCL:
// device memory), so nothing here assumes host memory. Collectives know nothing of attention.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "src/base/dtype.h"

namespace dattn {

enum class ReduceOp : uint8_t { sum, max, min };

// Bytes this rank sent, per operation name ("send", "allreduce", ...). For a collective the
// count is the payload this rank contributes (see each method), not the backend's algorithm
// traffic, so that tests can state a strategy's model exactly.
struct ByteCounters {
  struct Entry {
    uint64_t calls = 0;
    uint64_t bytes = 0;
  };
  std::map<std::string, Entry> ops;

  void add(const std::string& op, uint64_t bytes) {
    auto& e = ops[op];
    e.calls += 1;
    e.bytes += bytes;
  }
  uint64_t bytes(const std::string& op) const {
    auto it = ops.find(op);
    return it == ops.end() ? 0 : it->second.bytes;
  }
  // The data a strategy moved: every operation but "control" (validation's flags and hashes).
  uint64_t data_bytes() const { return total_bytes() - bytes("control"); }
  uint64_t total_bytes() const {
    uint64_t t = 0;
    for (const auto& [name, e] : ops)
      t += e.bytes;
    return t;
  }
};

// A pending non-blocking operation; complete it with Communicator::wait.
class Request {
 public:
  virtual ~Request() = default;
};
using RequestPtr = std::unique_ptr<Request>;

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The backend's name for headers and errors: "mpi", "nccl".
  virtual std::string backend() const = 0;
  // The communicator for host-memory control data over the same ranks in the same order
  // (validation flags, error messages, configuration hashes: agree_on_validation): this one for a
  // host-buffer backend (MPI); NCCL's MPI twin, since NCCL moves device memory only.
  virtual Communicator& control() { return *this; }
  // What this group is, for messages ("cp", "node", ...): the watchdog's line names it. Set by
  // whoever creates the group (Runtime); a backend picks a default.
  const std::string& name() const { return name_; }
  void set_name(std::string name) { name_ = std::move(name); }

  // Point-to-point. Counted as "send": bytes.
  virtual RequestPtr isend(const void* buf, size_t bytes, int peer, int tag) = 0;
  virtual RequestPtr irecv(void* buf, size_t bytes, int peer, int tag) = 0;
  // Starts the operations posted so far where a backend defers them (NCCL issues them in one
  // group: see NcclCommunicator), so that they overlap the work the caller queues next; MPI's
  // started at isend/irecv already. The requests stay pending until wait.
  virtual void start() {}
  // Moves the pending operations along without waiting (MPI: one MPI_Iprobe, which runs Open
  // MPI's progress engine: its TCP transport sends and receives only inside MPI calls). The ring
  // calls it from inside the kernel, between tiles (kernels/cpu/progress.h). No-op elsewhere.
  virtual void progress() {}
  virtual void wait(RequestPtr& request) = 0;  // completes and releases; null is a no-op
  // Completes and releases every request (nulls are skipped), then clears the vector. A backend
  // may wait on them together (MPI: one deadline for all, see MpiCommunicator).
  virtual void wait_all(std::vector<RequestPtr>& requests) {
    for (auto& r : requests)
      wait(r);
    requests.clear();
  }
  // Counted as "send": send_bytes.
  virtual void sendrecv(const void* send_buf, size_t send_bytes, int dest, void* recv_buf,
                        size_t recv_bytes, int src, int tag) = 0;

  // Collectives. send == recv means in place where the method allows it.
  // "allreduce": count * dtype_size.
  virtual void allreduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) = 0;
  // Integer allreduce for control data (flags, hashes, validation); counted as "control", apart
  // from the data a strategy moves, so that byte models need not count validation.
  virtual void allreduce_u64(const uint64_t* send, uint64_t* recv, size_t count, ReduceOp op) = 0;
  // "reduce": count * dtype_size on every rank (the root's contribution included).
  virtual void reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                      int root) = 0;
  // recv holds size() blocks of bytes_per_rank; "allgather": bytes_per_rank.
  virtual void allgather(const void* send, void* recv, size_t bytes_per_rank) = 0;
  // Variable sizes: recv_bytes[r] from rank r, placed back to back; "allgather": own bytes.
  virtual void allgatherv(const void* send, size_t send_bytes, void* recv,
                          const std::vector<size_t>& recv_bytes) = 0;
  // recv (significant on the root only) holds size() blocks of bytes_per_rank, block r from rank
  // r; "gather": bytes_per_rank on every rank but the root (whose own block is not sent).
  virtual void gather(const void* send, void* recv, size_t bytes_per_rank, int root) = 0;
  // "broadcast": bytes on the root, 0 elsewhere.
  virtual void broadcast(void* buf, size_t bytes, int root) = 0;
  // send holds size() blocks of bytes_per_rank, block r for rank r;
  // "alltoall": (size() - 1) * bytes_per_rank (the block a rank keeps is not sent).
  virtual void alltoall(const void* send, void* recv, size_t bytes_per_rank) = 0;
  // Variable sizes: send_bytes[r] to rank r, recv_bytes[r] from rank r, each side back to back
  // in rank order; "alltoall": the bytes sent to the other ranks.
  virtual void alltoallv(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                         const std::vector<size_t>& recv_bytes) = 0;
  virtual void barrier() = 0;

  // Sub-groups: ranks with the same color form a new communicator, ordered by key.
  virtual std::unique_ptr<Communicator> split(int color, int key) const = 0;
  // The ranks that share this node (MPI_Comm_split_type SHARED), ordered by rank.
  virtual std::unique_ptr<Communicator> split_node() const = 0;

  const ByteCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = {}; }

 protected:
  ByteCounters counters_;
  std::string name_;
};

// The requests a schedule has in flight, completed on every way out of the scope that posted
// them. Why: a step posts its transfers, starts them and runs a kernel before it waits; if the
// kernel (an allocation, a launch error) throws, unwinding frees the step's buffers while the
// transfers still read or write them (a GPU's memory pool may even hand them out again, since the
// stream that frees is not ordered after NCCL's), and the peers wait forever for the other half.
// Declared after the buffers it covers, its destructor completes the transfers first (under the
// communicator's deadline); a failure there ends the process, since nothing safe is left to do.
class InFlight {
 public:
  explicit InFlight(Communicator& comm) : comm_(comm) {}
  ~InFlight() {
    if (requests_.empty()) return;
    try {
      comm_.wait_all(requests_);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "dattn: %s, while completing the transfers in flight; aborting\n",
                   e.what());
      std::abort();
    }
  }
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;

  void add(RequestPtr request) { requests_.push_back(std::move(request)); }
  void wait() { comm_.wait_all(requests_); }  // completes every request added so far
  bool empty() const { return requests_.empty(); }

 private:
  Communicator& comm_;
  std::vector<RequestPtr> requests_;
};

}  // namespace dattn
