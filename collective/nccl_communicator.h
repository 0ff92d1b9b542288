// The NCCL backend of Communicator: device buffers, every NCCL call stream-ordered on one CUDA
// stream and joined to the caller's stream by events (no host wait), bootstrapped over MPI, with
// an MPI side channel for host control data, and the same watchdog contract as the MPI backend
// (a deadline on every operation, then abort, exit 14), kept by a thread that watches the events.
#pragma once

#include <cuda_runtime_api.h>
#include <mpi.h>
#include <nccl.h>

#include <memory>
#include <string>
#include <vector>

#include "collective/communicator.h"
#include "collective/mpi_communicator.h"
#include "collective/p2p_batch.h"

namespace dattn {

// Semantics, where they differ from MpiCommunicator:
// - Buffers of isend/irecv/sendrecv and of every collective except allreduce_u64 are DEVICE
//   pointers on the device that was current at creation. Completion is in the order of the
//   caller's stream (src/base/stream.h: current_stream(), the Runtime's), not on the host: work
//   queued there before an operation is issued is ordered before it (an event the NCCL stream
//   waits for: follow_current_stream), and when a collective or a wait returns, the caller's
//   stream has been made to wait for it (another event), so a kernel or copy queued there next
//   sees the result and may reuse the buffers. The host never waits for the device here. The
//   NCCL stream is non-blocking, so a kernel queued after start() overlaps the transfers. Work on
//   other streams needs the caller's events.
// - The watchdog: each completion event is watched by a thread of the communicator under the
//   deadline, counted from when the operation could start (it was queued and the one before it
//   was done); an operation not done by then, or an asynchronous NCCL error, prints the
//   watchdog's line, aborts the NCCL communicator and ends the process with exit code 14 (the
//   launcher ends the job). The thread never calls MPI (MPI runs MPI_THREAD_FUNNELED).
// - Point-to-point: NCCL has no tags, and a send and its matching receive must be issued inside
//   one ncclGroupStart/End or the pair can deadlock. So isend/irecv only record the operation;
//   the pending operations are issued together, in one group, when start() or wait/wait_all is
//   called (any request) or a collective starts; the wait then joins the caller's stream to
//   them, under the watchdog's deadline.
//   Matching: between two ranks, the k-th send of a tag matches the k-th receive of that tag
//   *within one batch* (the operations posted between two waits); across batches the order of
//   posting decides. Strategies post each step's receives and sends, then wait: that holds. A
//   receive's size must equal the matching send's (NCCL has no truncation or probe). barrier()
//   does not issue pending operations (it is a host-side MPI barrier; issuing p2p there could
//   wait for a peer that is itself in the barrier), and orders host code only: device work
//   queued before it may still be running.
// - allreduce_u64 (control data: validation flags and hashes, in host memory) and barrier go
//   over a private MPI communicator, so the library's host-memory control path works unchanged
//   on a GPU run; control data never needs a device copy.
class NcclCommunicator final : public Communicator {
 public:
  // Collective over comm. The caller has selected the device (cudaSetDevice) already. timeout_s:
  // the watchdog's deadline, resolved by resolve_timeout (0: DATTN_TIMEOUT or 300 s); sub-groups
  // inherit it. stream: the stream every NCCL call of this communicator runs on (not owned); null:
  // create and own one. A CUDA or NCCL failure on any rank (no GPU, no driver) throws
  // dattn::Error on every rank; a peer that never joins trips the watchdog instead of hanging.
  static std::unique_ptr<NcclCommunicator> from_mpi(MPI_Comm comm, double timeout_s = 0,
                                                    cudaStream_t stream = nullptr);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  cudaStream_t stream() const { return stream_; }
  ncclComm_t nccl_comm() const { return comm_; }
  int device() const { return device_; }
  double timeout_s() const { return timeout_s_; }
  // The MPI communicator of the control path (same ranks, same order).
  MPI_Comm control_comm() const { return control_->comm(); }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }
  // Host control data goes over the MPI communicator this one was bootstrapped from.
  Communicator& control() override;

  // Tags are accepted and ignored but for ordering within a batch (see above).
  RequestPtr isend(const void* buf, size_t bytes, int peer, int tag) override;
  RequestPtr irecv(void* buf, size_t bytes, int peer, int tag) override;
  // Issues the posted sends and receives now (one group), so that they run while the caller queues
  // its kernels; wait/wait_all then completes them.
  void start() override;
  void wait(RequestPtr& request) override;
  void wait_all(std::vector<RequestPtr>& requests) override;
  void sendrecv(const void* send_buf, size_t send_bytes, int dest, void* recv_buf,
                size_t recv_bytes, int src, int tag) override;

  void allreduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) override;
  void allreduce_u64(const uint64_t* send, uint64_t* recv, size_t count, ReduceOp op) override;
  void reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
              int root) override;
  void allgather(const void* send, void* recv, size_t bytes_per_rank) override;
  void allgatherv(const void* send, size_t send_bytes, void* recv,
                  const std::vector<size_t>& recv_bytes) override;
  void gather(const void* send, void* recv, size_t bytes_per_rank, int root) override;
  void broadcast(void* buf, size_t bytes, int root) override;
  void alltoall(const void* send, void* recv, size_t bytes_per_rank) override;
  void alltoallv(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                 const std::vector<size_t>& recv_bytes) override;
  void barrier() override;

  std::unique_ptr<Communicator> split(int color, int key) const override;
  std::unique_ptr<Communicator> split_node() const override;

 private:
  // Takes ownership of control, comm (already initialised) and, if owns_stream, stream.
  NcclCommunicator(std::unique_ptr<MpiCommunicator> control, ncclComm_t comm, cudaStream_t stream,
                   bool owns_stream, cudaEvent_t ready, int device);
  // Builds a communicator from a control comm: CUDA setup, unique id over control, init.
  static std::unique_ptr<NcclCommunicator> create(std::unique_ptr<MpiCommunicator> control,
                                                  cudaStream_t stream,
                                                  const NcclCommunicator* parent, int color,
                                                  int key);

  // Issues the pending point-to-point operations in one group, after follow_current_stream().
  void flush();
  // Makes the NCCL stream wait (on the GPU) for the work queued on the caller's stream so far.
  void follow_current_stream();
  // Waits until the communicator leaves ncclInProgress (a call on a non-blocking communicator
  // returned before NCCL finished setting it up); an error or the deadline ends the job.
  void settle(const char* op) const;
  // Makes the caller's stream wait (on the GPU) for everything enqueued on the NCCL stream so far,
  // and hands the completion to the watchdog: `op` and `peers` (empty: the whole group) are what
  // its line names.
  void complete(const char* op, const std::string& peers = "");
  // The watchdog's line on stderr, then ncclCommAbort and MPI_Abort(14).
  [[noreturn]] void expire(const std::string& what, const std::string& reason, double waited_s,
                           const std::string& peers) const;
  std::string all_peers() const;  // "peers: world ranks a, b, ..." of this group
  void check_rank(int r, const char* what) const;

  struct Watchdog;  // the thread that watches the completion events (nccl_communicator.cpp)

  std::unique_ptr<MpiCommunicator> control_;  // declared first: released last
  int device_ = -1;
  cudaStream_t stream_ = nullptr;
  bool owns_stream_ = false;
  cudaEvent_t ready_ = nullptr;  // recorded on the caller's stream at each issue
  ncclComm_t comm_ = nullptr;
  int rank_ = 0;
  int size_ = 1;
  double timeout_s_ = kDefaultTimeoutS;
  std::vector<int> world_ranks_;        // rank in this group -> rank in MPI_COMM_WORLD
  std::vector<P2pOp> pending_;          // posted, not yet issued
  std::unique_ptr<Watchdog> watchdog_;  // started at the first completion; stopped first
};

}  // namespace dattn
