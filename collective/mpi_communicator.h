// The MPI backend of Communicator: host buffers, a private duplicate of the caller's
// communicator, MPI_ERRORS_RETURN so that every failure becomes a dattn::Error.
#pragma once

#include <mpi.h>

#include "collective/communicator.h"
#include "src/error.h"

// Checks an MPI call's return code; on failure throws dattn::Error with the call, MPI's
// message and the location.
#define DATTN_MPI_CHECK(call)                                                                  \
  do {                                                                                         \
    int dattn_mpi_rc_ = (call);                                                                \
    if (dattn_mpi_rc_ != MPI_SUCCESS)                                                          \
      DATTN_THROW("MPI call failed: ", #call, ": ", ::dattn::mpi_error_string(dattn_mpi_rc_)); \
  } while (0)

namespace dattn {

std::string mpi_error_string(int code);

class MpiCommunicator final : public Communicator {
 public:
  // Duplicates comm: dattn's messages never match the caller's. comm must stay valid while
  // this object lives; MPI must be initialised (with at least MPI_THREAD_FUNNELED).
  explicit MpiCommunicator(MPI_Comm comm);
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  MPI_Comm comm() const { return comm_; }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }

  RequestPtr isend(const void* buf, size_t bytes, int peer, int tag) override;
  RequestPtr irecv(void* buf, size_t bytes, int peer, int tag) override;
  void wait(RequestPtr& request) override;
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
  MpiCommunicator(MPI_Comm owned, Adopt);  // takes ownership of an already private comm

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace dattn
