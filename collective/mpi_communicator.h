// The MPI backend of Communicator: host buffers, a private duplicate of the caller's
// communicator, MPI_ERRORS_RETURN so that every failure becomes a dattn::Error, and a watchdog:
// every collective and every wait runs under a deadline, past which the job is aborted.
#pragma once

#include <mpi.h>

#include "collective/communicator.h"
#include "src/base/error.h"

// Checks an MPI call's return code; on failure throws dattn::Error (ErrorKind::mpi) with the
// call, MPI's message and the location.
#define DATTN_MPI_CHECK(call)                                                     \
  do {                                                                            \
    int dattn_mpi_rc_ = (call);                                                   \
    if (dattn_mpi_rc_ != MPI_SUCCESS)                                             \
      DATTN_THROW_KIND(::dattn::ErrorKind::mpi, "MPI call failed: ", #call, ": ", \
                       ::dattn::mpi_error_string(dattn_mpi_rc_));                 \
  } while (0)

namespace dattn {

std::string mpi_error_string(int code);

// The watchdog's deadline when nobody sets one: generous, so that only a dead or stuck peer
// trips it, never a slow one (a rank may wait for a peer's whole ring step).
inline constexpr double kDefaultTimeoutS = 300;
// The exit code of a job the watchdog aborts (14, SIGALRM's number: a timer went off), apart
// from the 1 of ordinary errors.
inline constexpr int kWatchdogAbortCode = 14;

// The deadline in seconds for a requested one: requested_s > 0 wins; else the environment
// variable DATTN_TIMEOUT (seconds > 0; "inf" for no deadline); else kDefaultTimeoutS. Throws
// dattn::Error on a DATTN_TIMEOUT that is not such a number, or a negative or NaN requested_s.
double resolve_timeout(double requested_s);

class MpiCommunicator final : public Communicator {
 public:
  // Duplicates comm: dattn's messages never match the caller's. comm must stay valid while
  // this object lives; MPI must be initialised (with at least MPI_THREAD_FUNNELED). timeout_s:
  // the watchdog's deadline, resolved by resolve_timeout (0: DATTN_TIMEOUT or the default).
  // Sub-groups made by split() inherit it. Named after comm (MPI_Comm_get_name) until set_name.
  explicit MpiCommunicator(MPI_Comm comm, double timeout_s = 0);
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  MPI_Comm comm() const { return comm_; }
  double timeout_s() const { return timeout_s_; }  // the resolved deadline

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }

  RequestPtr isend(const void* buf, size_t bytes, int peer, int tag) override;
  RequestPtr irecv(void* buf, size_t bytes, int peer, int tag) override;
  void progress() override;
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
  struct Adopt {};
  // Takes ownership of an already private comm (a sub-group of this one).
  MpiCommunicator(MPI_Comm owned, double timeout_s, std::string name, Adopt);

  // Completes a started collective under the deadline; on expiry reports `op` and aborts.
  void complete(MPI_Request& request, const char* op, int root = -1) const;
  // The watchdog's line on stderr, then MPI_Abort of the whole job.
  [[noreturn]] void expire(const std::string& what, double waited_s,
                           const std::string& detail = "") const;
  int world_rank_of(int rank) const;  // rank in this group -> rank in MPI_COMM_WORLD

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  double timeout_s_ = kDefaultTimeoutS;
};

}  // namespace dattn
