// MpiCommunicator: each Communicator operation as the matching non-blocking MPI call, with
// byte counting, completed by the watchdog's poll loop (a deadline on every wait on a peer).
#include "collective/mpi_communicator.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <thread>
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
  std::vector<MPI_Request> reqs;  // one per piece of the message
  // What the watchdog names when this request is still pending at the deadline.
  bool send = false;
  int peer = 0;
  int tag = 0;
  size_t bytes = 0;
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

// ---------------------------------------------------------------- the watchdog's poll loop
// Why non-blocking + poll: a blocking MPI call (MPI_Waitall, MPI_Allreduce) takes no deadline,
// and Open MPI ends a job only when a process exits. A peer that hangs (a deadlock, a rank stuck
// in a loop or a driver, a rank that skipped a collective) leaves the others blocked until the
// batch system's wall time runs out, with no word of which operation or peer. So every
// operation starts in its non-blocking MPI-3 form and completes here, in MPI_Testall calls,
// which drive MPI's progress as the blocking wait would.
//
// Pacing. A finished operation costs one MPI_Testall and no clock read. A pending one spins
// (tests back to back) for its first millisecond and for a millisecond after every test that
// moved data; otherwise it sleeps between tests, for 1/64 of the time waited (20 us to 1 ms),
// so a rank that waits for a slow or dead peer gives its core back and loses at most ~2% of
// its wait (or 1 ms) to the sleep. "Moved data": a test that took over 3 us, or over 10 us
// for the first one after a sleep (cache-cold). Measured here: an idle test takes 0.04 us warm,
// 1.4 us cold (p99 6 us); one that copies 32 KiB fragments (shared memory without single-copy)
// 2-5 us warm and more, and a sleeper's first test finds the fragments that queued meanwhile.
// The steady clock is read once per test (a vDSO read on Linux, not a syscall); the time
// between two reads is a test's duration. On a transport whose idle test takes longer than
// that, every test looks busy and the loop never sleeps: the blocking wait's behaviour.
// Why spin again after data moved, rather than sleep whenever the first millisecond has passed:
// large transfers need both sides testing; with both asleep between tests a 64 MiB sendrecv 5 ms
// late is 4-6x slower than with MPI's blocking calls, a 64 MiB allreduce 4x. With this rule both
// are as fast as the blocking calls or faster (on a loaded 2-core machine), and a rank that waits
// 3 s for a late peer uses 0.12-0.15 s of CPU instead of the 2-2.7 s of a blocking wait.

constexpr double kSpinS = 1e-3;           // spin this long at the start and after data moved
constexpr double kBusyTestS = 3e-6;       // a test that took longer moved data...
constexpr double kBusyColdTestS = 10e-6;  // ... or this, for the first test after a sleep

// MPI_Testall until all n requests are complete (true) or deadline_s has passed (false, and
// waited_s says how long it waited).
bool poll(int n, MPI_Request* reqs, double deadline_s, double& waited_s) {
  int done = 0;
  DATTN_MPI_CHECK(MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE));
  if (done) return true;
  using Clock = std::chrono::steady_clock;
  auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  const Clock::time_point start = Clock::now();
  Clock::time_point before = start, last_busy = start;  // before: when this test began
  bool cold = false;                                    // the first test after a sleep
  for (;;) {
    DATTN_MPI_CHECK(MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE));
    if (done) return true;
    const Clock::time_point now = Clock::now();
    if (seconds(now - before) > (cold ? kBusyColdTestS : kBusyTestS)) last_busy = now;
    const double waited = seconds(now - start);
    if (waited > deadline_s) {
      waited_s = waited;
      return false;
    }
    before = now;
    cold = seconds(now - last_busy) >= kSpinS;
    if (cold) {
      std::this_thread::sleep_for(
          std::chrono::duration<double>(std::clamp(waited / 64, 20e-6, 1e-3)));
      before = Clock::now();
    }
  }
}

}  // namespace

double resolve_timeout(double requested_s) {
  DATTN_CHECK_ARG(requested_s >= 0, "timeout_s", requested_s,
                  ">= 0 seconds (0: DATTN_TIMEOUT or the default)");
  if (requested_s > 0) return requested_s;
  const char* env = std::getenv("DATTN_TIMEOUT");
  if (env == nullptr || *env == '\0') return kDefaultTimeoutS;
  char* end = nullptr;
  const double v = std::strtod(env, &end);
  if (end == env || *end != '\0' || !(v > 0))
    DATTN_THROW("invalid DATTN_TIMEOUT = \"", env,
                "\": expected a number of seconds > 0 (inf: no deadline)");
  return v;
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm, double timeout_s)
    : timeout_s_(resolve_timeout(timeout_s)) {
  // rank and size first, from comm: the watchdog's line needs them while the dup is pending.
  DATTN_MPI_CHECK(MPI_Comm_rank(comm, &rank_));
  DATTN_MPI_CHECK(MPI_Comm_size(comm, &size_));
  char buf[MPI_MAX_OBJECT_NAME] = {};
  int len = 0;
  DATTN_MPI_CHECK(MPI_Comm_get_name(comm, buf, &len));
  name_ = len > 0 ? std::string(buf, size_t(len)) : "MPI communicator";
  // The dup is collective too: MPI_Comm_idup, under the deadline like every other operation.
  MPI_Request r;
  DATTN_MPI_CHECK(MPI_Comm_idup(comm, &comm_, &r));
  complete(r, "communicator duplication");
  DATTN_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
}

MpiCommunicator::MpiCommunicator(MPI_Comm owned, double timeout_s, std::string name, Adopt)
    : comm_(owned), timeout_s_(timeout_s) {
  name_ = std::move(name);
  DATTN_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  DATTN_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  DATTN_MPI_CHECK(MPI_Comm_size(comm_, &size_));
}

void MpiCommunicator::complete(MPI_Request& request, const char* op, int root) const {
  double waited = 0;
  if (poll(1, &request, timeout_s_, waited)) return;
  expire(root < 0 ? std::string(op) : detail::cat(op, " (root rank ", world_rank_of(root), ")"),
         waited);
}

// The one place the library ends the job instead of throwing: the expired operation is still
// posted (its buffers in MPI's hands), the peers are stuck in theirs, and a caller that caught an
// Error (the C API, Python) would go on and leave them waiting. Ending the job is the point.
void MpiCommunicator::expire(const std::string& what, double waited_s,
                             const std::string& detail) const {
  int world_rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  // One fprintf: one line, not interleaved with the other ranks' lines.
  std::fprintf(stderr,
               "[rank %d] dattn watchdog: %s on %s (%d ranks) waited %.1f s (deadline %g s)%s; "
               "a peer is dead or stuck, or slower than the deadline (RuntimeOptions.timeout_s, "
               "DATTN_TIMEOUT); aborting the job\n",
               world_rank, what.c_str(), name_.c_str(), size_, waited_s, timeout_s_,
               detail.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, kWatchdogAbortCode);
  std::_Exit(kWatchdogAbortCode);  // MPI_Abort does not return; should it, end this rank
}

int MpiCommunicator::world_rank_of(int rank) const {
  MPI_Group group, world;
  int out = MPI_UNDEFINED;
  if (MPI_Comm_group(comm_, &group) != MPI_SUCCESS) return rank;
  if (MPI_Comm_group(MPI_COMM_WORLD, &world) == MPI_SUCCESS) {
    MPI_Group_translate_ranks(group, 1, &rank, world, &out);
    MPI_Group_free(&world);
  }
  MPI_Group_free(&group);
  return out == MPI_UNDEFINED ? rank : out;
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (comm_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm_);
}

RequestPtr MpiCommunicator::isend(const void* buf, size_t bytes, int peer, int tag) {
  auto req = std::make_unique<MpiRequest>();
  req->send = true;
  req->peer = peer;
  req->tag = tag;
  req->bytes = bytes;
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
  req->peer = peer;
  req->tag = tag;
  req->bytes = bytes;
  char* p = static_cast<char*>(buf);
  for_each_piece(bytes, [&](size_t off, int n) {
    MPI_Request r;
    DATTN_MPI_CHECK(MPI_Irecv(p + off, n, MPI_BYTE, peer, tag, comm_, &r));
    req->reqs.push_back(r);
  });
  return req;
}

void MpiCommunicator::progress() {
  int flag = 0;
  DATTN_MPI_CHECK(MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm_, &flag, MPI_STATUS_IGNORE));
}

void MpiCommunicator::wait(RequestPtr& request) {
  if (!request) return;
  std::vector<RequestPtr> one;
  one.push_back(std::move(request));
  wait_all(one);
}

// All the requests under one deadline (a ring step's sends and receives complete in any order).
void MpiCommunicator::wait_all(std::vector<RequestPtr>& requests) {
  std::vector<MPI_Request> handles;
  for (const auto& request : requests) {
    if (!request) continue;
    auto* r = dynamic_cast<MpiRequest*>(request.get());
    DATTN_ASSERT(r != nullptr);
    handles.insert(handles.end(), r->reqs.begin(), r->reqs.end());
  }
  double waited = 0;
  if (!poll(int(handles.size()), handles.data(), timeout_s_, waited)) {
    // MPI_Testall left every handle as it was: ask each which pieces are still open.
    std::string pending;
    size_t i = 0;
    for (const auto& request : requests) {
      if (!request) continue;
      const auto& r = static_cast<const MpiRequest&>(*request);
      bool open = false;
      for (size_t p = 0; p < r.reqs.size(); ++p, ++i) {
        int flag = 1;
        MPI_Request_get_status(handles[i], &flag, MPI_STATUS_IGNORE);
        open = open || !flag;
      }
      if (!open) continue;
      pending +=
          detail::cat(pending.empty() ? "; pending: " : ", ", r.send ? "send to" : "recv from",
                      " rank ", world_rank_of(r.peer), " (tag ", r.tag, ", ", r.bytes, " B)");
    }
    expire("point-to-point wait", waited, pending);
  }
  // Complete: the handles were released (the copies in the requests are stale; nothing reads them).
  requests.clear();
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
  MPI_Request r;
  DATTN_MPI_CHECK(MPI_Iallreduce(s, recv, as_int(count, "count"), mpi_type(dtype),
                                 mpi_op(op, dtype), comm_, &r));
  complete(r, "allreduce");
  counters_.add("allreduce", count * dtype_size(dtype));
}

void MpiCommunicator::allreduce_u64(const uint64_t* send, uint64_t* recv, size_t count,
                                    ReduceOp op) {
  const void* s = send == recv ? MPI_IN_PLACE : send;
  MPI_Request r;
  DATTN_MPI_CHECK(
      MPI_Iallreduce(s, recv, as_int(count, "count"), MPI_UINT64_T, mpi_op(op), comm_, &r));
  complete(r, "allreduce (control)");
  counters_.add("control", count * sizeof(uint64_t));
}

void MpiCommunicator::reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                             int root) {
  const void* s = (send == recv && rank_ == root) ? MPI_IN_PLACE : send;
  MPI_Request r;
  DATTN_MPI_CHECK(MPI_Ireduce(s, recv, as_int(count, "count"), mpi_type(dtype), mpi_op(op, dtype),
                              root, comm_, &r));
  complete(r, "reduce", root);
  counters_.add("reduce", count * dtype_size(dtype));
}

void MpiCommunicator::allgather(const void* send, void* recv, size_t bytes_per_rank) {
  int n = as_int(bytes_per_rank, "bytes_per_rank");
  MPI_Request r;
  DATTN_MPI_CHECK(MPI_Iallgather(send, n, MPI_BYTE, recv, n, MPI_BYTE, comm_, &r));
  complete(r, "allgather");
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
  MPI_Request r;
  DATTN_MPI_CHECK(MPI_Iallgatherv(send, counts[size_t(rank_)], MPI_BYTE, recv, counts.data(),
                                  displs.data(), MPI_BYTE, comm_, &r));
  complete(r, "allgatherv");
  counters_.add("allgather", send_bytes);
}

void MpiCommunicator::gather(const void* send, void* recv, size_t bytes_per_rank, int root) {
  const int n = as_int(bytes_per_rank, "bytes_per_rank");
  MPI_Request r;
  DATTN_MPI_CHECK(MPI_Igather(send, n, MPI_BYTE, recv, n, MPI_BYTE, root, comm_, &r));
  complete(r, "gather", root);
  counters_.add("gather", rank_ == root ? 0 : bytes_per_rank);
}

void MpiCommunicator::broadcast(void* buf, size_t bytes, int root) {
  MPI_Request r;
  DATTN_MPI_CHECK(MPI_Ibcast(buf, as_int(bytes, "bytes"), MPI_BYTE, root, comm_, &r));
  complete(r, "broadcast", root);
  counters_.add("broadcast", rank_ == root ? bytes : 0);
}

void MpiCommunicator::alltoall(const void* send, void* recv, size_t bytes_per_rank) {
  int n = as_int(bytes_per_rank, "bytes_per_rank");
  MPI_Request r;
  DATTN_MPI_CHECK(MPI_Ialltoall(send, n, MPI_BYTE, recv, n, MPI_BYTE, comm_, &r));
  complete(r, "alltoall");
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
  MPI_Request r;
  DATTN_MPI_CHECK(MPI_Ialltoallv(send, sc.data(), sd.data(), MPI_BYTE, recv, rc.data(), rd.data(),
                                 MPI_BYTE, comm_, &r));
  complete(r, "alltoallv");
  counters_.add("alltoall", sent);
}

void MpiCommunicator::barrier() {
  MPI_Request r;
  DATTN_MPI_CHECK(MPI_Ibarrier(comm_, &r));
  complete(r, "barrier");
}

// MPI has no non-blocking split: a barrier under the deadline comes first, so that a missing
// rank is caught there, and every rank then enters MPI_Comm_split together.
std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key) const {
  MPI_Request r;
  DATTN_MPI_CHECK(MPI_Ibarrier(comm_, &r));
  complete(r, "split");
  MPI_Comm sub;
  DATTN_MPI_CHECK(MPI_Comm_split(comm_, color, key, &sub));
  return std::unique_ptr<Communicator>(
      new MpiCommunicator(sub, timeout_s_, name_ + " (split)", Adopt{}));
}

std::unique_ptr<Communicator> MpiCommunicator::split_node() const {
  MPI_Request r;
  DATTN_MPI_CHECK(MPI_Ibarrier(comm_, &r));
  complete(r, "split (node)");
  MPI_Comm sub;
  DATTN_MPI_CHECK(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &sub));
  return std::unique_ptr<Communicator>(
      new MpiCommunicator(sub, timeout_s_, name_ + " (node)", Adopt{}));
}

}  // namespace dattn
