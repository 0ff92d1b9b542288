// MpiCommunicator: each Communicator operation as the matching MPI call, with byte counting.
#include "collective/mpi_communicator.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <type_traits>

namespace dattn {

std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(buf, size_t(len));
}

namespace {

// Point-to-point messages larger than this go as several messages (MPI counts are int).
// Both sides split the same byte count the same way, and MPI keeps their order.
constexpr size_t kMaxMessage = size_t(1) << 30;

struct MpiRequest final : Request {
  std::vector<MPI_Request> reqs;
};

// Calls fn(offset, count) for each piece of a message of `bytes` (at least one, maybe empty).
template <typename Fn>
void for_each_piece(size_t bytes, Fn fn) {
  size_t off = 0;
  do {
    size_t n = std::min(kMaxMessage, bytes - off);
    fn(off, int(n));
    off += n;
  } while (off < bytes);
}

// 16-bit floats have no MPI type: they travel as MPI_UINT16_T and reduce through user ops
// that widen to fp32, add (or compare) and round back, as NCCL does for bf16/fp16.
template <typename T, ReduceOp Op>
void reduce16(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = to_float(a[i]), y = to_float(b[i]);
    const float r = Op == ReduceOp::sum   ? x + y
                    : Op == ReduceOp::max ? std::fmax(x, y)
                                          : std::fmin(x, y);
    if constexpr (std::is_same_v<T, bf16>)
      b[i] = to_bf16(r);
    else
      b[i] = to_f16(r);
  }
}

template <typename T>
MPI_Op op16(ReduceOp op) {
  // Created once, on first use (MPI is up by then); MPI_Finalize releases them.
  static MPI_Op ops[3] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
  static MPI_User_function* fns[3] = {reduce16<T, ReduceOp::sum>, reduce16<T, ReduceOp::max>,
                                      reduce16<T, ReduceOp::min>};
  const int i = int(op);
  if (ops[i] == MPI_OP_NULL) DATTN_MPI_CHECK(MPI_Op_create(fns[i], /*commute=*/1, &ops[i]));
  return ops[i];
}

MPI_Datatype mpi_type(DType t) {
  return t == DType::f32 ? MPI_FLOAT : MPI_UINT16_T;
}

MPI_Op mpi_op(ReduceOp op, DType t) {
  if (t == DType::bf16) return op16<bf16>(op);
  if (t == DType::f16) return op16<f16>(op);
  switch (op) {
    case ReduceOp::sum:
      return MPI_SUM;
    case ReduceOp::max:
      return MPI_MAX;
    case ReduceOp::min:
      return MPI_MIN;
  }
  return MPI_SUM;
}

MPI_Op mpi_op(ReduceOp op) {
  return mpi_op(op, DType::f32);
}

int as_int(size_t n, const char* what) {
  if (n > size_t(INT_MAX))
    DATTN_THROW("invalid ", what, " = ", n, ": expected at most ", INT_MAX,
                " (MPI counts are int) for this collective");
  return int(n);
}

}  // namespace

MpiCommunicator::MpiCommunicator(MPI_Comm comm) {
  DATTN_MPI_CHECK(MPI_Comm_dup(comm, &comm_));
  DATTN_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  DATTN_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  DATTN_MPI_CHECK(MPI_Comm_size(comm_, &size_));
}

MpiCommunicator::MpiCommunicator(MPI_Comm owned, Adopt) : comm_(owned) {
  DATTN_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  DATTN_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  DATTN_MPI_CHECK(MPI_Comm_size(comm_, &size_));
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (comm_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm_);
}

RequestPtr MpiCommunicator::isend(const void* buf, size_t bytes, int peer, int tag) {
  auto req = std::make_unique<MpiRequest>();
  const char* p = static_cast<const char*>(buf);
  for_each_piece(bytes, [&](size_t off, int n) {
    MPI_Request r;
    DATTN_MPI_CHECK(MPI_Isend(p + off, n, MPI_BYTE, peer, tag, comm_, &r));
    req->reqs.push_back(r);
  });
  counters_.add("send", bytes);
  return req;
}

RequestPtr MpiCommunicator::irecv(void* buf, size_t bytes, int peer, int tag) {
  auto req = std::make_unique<MpiRequest>();
  char* p = static_cast<char*>(buf);
  for_each_piece(bytes, [&](size_t off, int n) {
    MPI_Request r;
    DATTN_MPI_CHECK(MPI_Irecv(p + off, n, MPI_BYTE, peer, tag, comm_, &r));
    req->reqs.push_back(r);
  });
  return req;
}

void MpiCommunicator::wait(RequestPtr& request) {
  if (!request) return;
  auto* r = dynamic_cast<MpiRequest*>(request.get());
  DATTN_ASSERT(r != nullptr);
  DATTN_MPI_CHECK(MPI_Waitall(int(r->reqs.size()), r->reqs.data(), MPI_STATUSES_IGNORE));
  request.reset();
}

void MpiCommunicator::sendrecv(const void* send_buf, size_t send_bytes, int dest, void* recv_buf,
                               size_t recv_bytes, int src, int tag) {
  std::vector<RequestPtr> reqs;
  reqs.push_back(irecv(recv_buf, recv_bytes, src, tag));
  reqs.push_back(isend(send_buf, send_bytes, dest, tag));
  wait_all(reqs);
}

void MpiCommunicator::allreduce(const void* send, void* recv, size_t count, DType dtype,
                                ReduceOp op) {
  const void* s = send == recv ? MPI_IN_PLACE : send;
  DATTN_MPI_CHECK(
      MPI_Allreduce(s, recv, as_int(count, "count"), mpi_type(dtype), mpi_op(op, dtype), comm_));
  counters_.add("allreduce", count * dtype_size(dtype));
}

void MpiCommunicator::allreduce_u64(const uint64_t* send, uint64_t* recv, size_t count,
                                    ReduceOp op) {
  const void* s = send == recv ? MPI_IN_PLACE : send;
  DATTN_MPI_CHECK(MPI_Allreduce(s, recv, as_int(count, "count"), MPI_UINT64_T, mpi_op(op), comm_));
  counters_.add("control", count * sizeof(uint64_t));
}

void MpiCommunicator::reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                             int root) {
  const void* s = (send == recv && rank_ == root) ? MPI_IN_PLACE : send;
  DATTN_MPI_CHECK(
      MPI_Reduce(s, recv, as_int(count, "count"), mpi_type(dtype), mpi_op(op, dtype), root, comm_));
  counters_.add("reduce", count * dtype_size(dtype));
}

void MpiCommunicator::allgather(const void* send, void* recv, size_t bytes_per_rank) {
  int n = as_int(bytes_per_rank, "bytes_per_rank");
  DATTN_MPI_CHECK(MPI_Allgather(send, n, MPI_BYTE, recv, n, MPI_BYTE, comm_));
  counters_.add("allgather", bytes_per_rank);
}

void MpiCommunicator::allgatherv(const void* send, size_t send_bytes, void* recv,
                                 const std::vector<size_t>& recv_bytes) {
  DATTN_CHECK_ARG(recv_bytes.size() == size_t(size_), "recv_bytes size", recv_bytes.size(),
                  detail::cat(size_, " (one count per rank)"));
  DATTN_CHECK_ARG(recv_bytes[size_t(rank_)] == send_bytes, "send_bytes", send_bytes,
                  detail::cat(recv_bytes[size_t(rank_)], " (this rank's entry of recv_bytes)"));
  std::vector<int> counts(static_cast<size_t>(size_)), displs(static_cast<size_t>(size_));
  size_t off = 0;
  for (int r = 0; r < size_; ++r) {
    counts[size_t(r)] = as_int(recv_bytes[size_t(r)], "allgatherv count");
    displs[size_t(r)] = as_int(off, "allgatherv displacement");
    off += recv_bytes[size_t(r)];
  }
  DATTN_MPI_CHECK(MPI_Allgatherv(send, counts[size_t(rank_)], MPI_BYTE, recv, counts.data(),
                                 displs.data(), MPI_BYTE, comm_));
  counters_.add("allgather", send_bytes);
}

void MpiCommunicator::gather(const void* send, void* recv, size_t bytes_per_rank, int root) {
  const int n = as_int(bytes_per_rank, "bytes_per_rank");
  DATTN_MPI_CHECK(MPI_Gather(send, n, MPI_BYTE, recv, n, MPI_BYTE, root, comm_));
  counters_.add("gather", rank_ == root ? 0 : bytes_per_rank);
}

void MpiCommunicator::broadcast(void* buf, size_t bytes, int root) {
  DATTN_MPI_CHECK(MPI_Bcast(buf, as_int(bytes, "bytes"), MPI_BYTE, root, comm_));
  counters_.add("broadcast", rank_ == root ? bytes : 0);
}

void MpiCommunicator::alltoall(const void* send, void* recv, size_t bytes_per_rank) {
  int n = as_int(bytes_per_rank, "bytes_per_rank");
  DATTN_MPI_CHECK(MPI_Alltoall(send, n, MPI_BYTE, recv, n, MPI_BYTE, comm_));
  counters_.add("alltoall", size_t(size_ - 1) * bytes_per_rank);
}

void MpiCommunicator::alltoallv(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                                const std::vector<size_t>& recv_bytes) {
  DATTN_CHECK_ARG(send_bytes.size() == size_t(size_) && recv_bytes.size() == size_t(size_),
                  "alltoallv counts", detail::cat(send_bytes.size(), "/", recv_bytes.size()),
                  detail::cat(size_, " (one count per rank)"));
  std::vector<int> sc(static_cast<size_t>(size_)), sd(static_cast<size_t>(size_));
  std::vector<int> rc(static_cast<size_t>(size_)), rd(static_cast<size_t>(size_));
  size_t so = 0, ro = 0, sent = 0;
  for (int r = 0; r < size_; ++r) {
    sc[size_t(r)] = as_int(send_bytes[size_t(r)], "alltoallv count");
    sd[size_t(r)] = as_int(so, "alltoallv displacement");
    rc[size_t(r)] = as_int(recv_bytes[size_t(r)], "alltoallv count");
    rd[size_t(r)] = as_int(ro, "alltoallv displacement");
    so += send_bytes[size_t(r)];
    ro += recv_bytes[size_t(r)];
    if (r != rank_) sent += send_bytes[size_t(r)];
  }
  DATTN_MPI_CHECK(MPI_Alltoallv(send, sc.data(), sd.data(), MPI_BYTE, recv, rc.data(), rd.data(),
                                MPI_BYTE, comm_));
  counters_.add("alltoall", sent);
}

void MpiCommunicator::barrier() {
  DATTN_MPI_CHECK(MPI_Barrier(comm_));
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key) const {
  MPI_Comm sub;
  DATTN_MPI_CHECK(MPI_Comm_split(comm_, color, key, &sub));
  return std::unique_ptr<Communicator>(new MpiCommunicator(sub, Adopt{}));
}

std::unique_ptr<Communicator> MpiCommunicator::split_node() const {
  MPI_Comm sub;
  DATTN_MPI_CHECK(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &sub));
  return std::unique_ptr<Communicator>(new MpiCommunicator(sub, Adopt{}));
}

}  // namespace dattn
