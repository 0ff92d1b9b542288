// A Communicator with NCCL's semantics, for the CUDA emulation (tests/emu): the rules the real
// backend (collective/nccl_communicator.cpp) lives under on hardware, enforced over MPI so that
// a bug that MPI's tags and buffering would hide fails a test here, with a line that names it.
//
//  - Point-to-point operations are recorded and issued in batches exactly where NcclCommunicator
//    issues them (start, wait, wait_all, a collective), in its order (nccl_issue_order). NCCL has
//    no tags: a peer's sends match that peer's receives in issue order. Here every message goes
//    with one tag over a private duplicate, and MPI's non-overtaking rule then matches the same
//    pairs NCCL would.
//  - A send completes only when its receive matched (MPI_Issend): NCCL completes a group only when
//    all of its operations have. A wait completes everything issued so far (NCCL's stream order,
//    as NcclCommunicator's wait does). Operations that never match end the job at the deadline
//    with the unmatched operations listed: on hardware, a hang.
//  - Sizes must be equal: a receive that got more or fewer bytes than it posted fails, named.
//  - Data arrives only at completion: a receive lands in a staging buffer and is copied out when
//    the wait completes; the receive buffer holds 0xff bytes until then. A send buffer must not
//    change while in flight (checked by a hash at completion). Buffers in flight are held in the
//    fake runtime, whose cudaFree fails on them.
//  - With device_memory_only, every data buffer must lie in the fake runtime's device memory, as
//    NCCL's must (NCCL does not check: on hardware, an illegal-address fault). Control data
//    (allreduce_u64, barrier, control()) is host memory over MPI, as NcclCommunicator's is.
// Collectives run as MPI's once the point-to-point operations before them completed (they queue
// behind them on NCCL's stream), with the same byte counts.
#include "tests/emu/emu_nccl_communicator.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "collective/mpi_communicator.h"
#include "collective/p2p_batch.h"
#include "src/base/error.h"
#include "src/base/stream.h"
#include "tests/emu/fake_runtime.h"

namespace dattn::emu {
namespace {

constexpr int kTag = 0;  // every message: NCCL has no tags

struct EmuRequest final : Request {};

uint64_t fnv1a(const void* p, size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i)
    h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

class EmuNcclCommunicator final : public Communicator {
 public:
  EmuNcclCommunicator(std::unique_ptr<MpiCommunicator> mpi, bool device_memory_only)
      : mpi_(std::move(mpi)), device_only_(device_memory_only) {
    DATTN_MPI_CHECK(MPI_Comm_dup(mpi_->comm(), &p2p_));
    DATTN_MPI_CHECK(MPI_Comm_set_errhandler(p2p_, MPI_ERRORS_RETURN));
    name_ = "cp";
  }
  ~EmuNcclCommunicator() override {
    if (!issued_.empty() || !pending_.empty())
      die(detail::cat(
          "communicator destroyed with ", issued_.size() + pending_.size(),
          " point-to-point operations not waited for: ", describe(/*unfinished_only=*/false)));
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&p2p_);
  }

  int rank() const override { return mpi_->rank(); }
  int size() const override { return mpi_->size(); }
  std::string backend() const override { return "nccl"; }
  Communicator& control() override { return *mpi_; }

  RequestPtr isend(const void* buf, size_t bytes, int peer, int tag) override {
    check_peer(peer, "isend peer");
    check_buffer(buf, bytes, "isend");
    pending_.push_back({true, const_cast<void*>(buf), bytes, peer, tag});
    counters_.add("send", bytes);
    return std::make_unique<EmuRequest>();
  }
  RequestPtr irecv(void* buf, size_t bytes, int peer, int tag) override {
    check_peer(peer, "irecv peer");
    check_buffer(buf, bytes, "irecv");
    pending_.push_back({false, buf, bytes, peer, tag});
    return std::make_unique<EmuRequest>();
  }
  void start() override { flush(); }
  void wait(RequestPtr& request) override {
    if (!request) return;
    flush();
    complete("point-to-point wait");
    request.reset();
  }
  void wait_all(std::vector<RequestPtr>& requests) override {
    flush();
    complete("point-to-point wait");
    requests.clear();
  }
  void sendrecv(const void* send_buf, size_t send_bytes, int dest, void* recv_buf,
                size_t recv_bytes, int src, int tag) override {
    std::vector<RequestPtr> reqs;
    reqs.push_back(irecv(recv_buf, recv_bytes, src, tag));
    reqs.push_back(isend(send_buf, send_bytes, dest, tag));
    wait_all(reqs);
  }

  void allreduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) override {
    const size_t n = count * dtype_size(dtype);
    collective("allreduce", {{send, n}, {recv, n}},
               [&] { mpi_->allreduce(send, recv, count, dtype, op); });
  }
  void allreduce_u64(const uint64_t* send, uint64_t* recv, size_t count, ReduceOp op) override {
    // Control data, host memory, over MPI (NcclCommunicator's control path).
    counted([&] { mpi_->allreduce_u64(send, recv, count, op); });
  }
  void reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
              int root) override {
    const size_t n = count * dtype_size(dtype);
    collective("reduce", {{send, n}, {rank() == root ? recv : nullptr, n}},
               [&] { mpi_->reduce(send, recv, count, dtype, op, root); });
  }
  void allgather(const void* send, void* recv, size_t bytes_per_rank) override {
    collective("allgather", {{send, bytes_per_rank}, {recv, bytes_per_rank * size_t(size())}},
               [&] { mpi_->allgather(send, recv, bytes_per_rank); });
  }
  void allgatherv(const void* send, size_t send_bytes, void* recv,
                  const std::vector<size_t>& recv_bytes) override {
    size_t total = 0;
    for (size_t b : recv_bytes)
      total += b;
    collective("allgatherv", {{send, send_bytes}, {recv, total}},
               [&] { mpi_->allgatherv(send, send_bytes, recv, recv_bytes); });
  }
  void gather(const void* send, void* recv, size_t bytes_per_rank, int root) override {
    collective("gather",
               {{send, bytes_per_rank},
                {rank() == root ? recv : nullptr, bytes_per_rank * size_t(size())}},
               [&] { mpi_->gather(send, recv, bytes_per_rank, root); });
  }
  void broadcast(void* buf, size_t bytes, int root) override {
    collective("broadcast", {{buf, bytes}}, [&] { mpi_->broadcast(buf, bytes, root); });
  }
  void alltoall(const void* send, void* recv, size_t bytes_per_rank) override {
    const size_t n = bytes_per_rank * size_t(size());
    collective("alltoall", {{send, n}, {recv, n}},
               [&] { mpi_->alltoall(send, recv, bytes_per_rank); });
  }
  void alltoallv(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                 const std::vector<size_t>& recv_bytes) override {
    size_t s = 0, r = 0;
    for (size_t b : send_bytes)
      s += b;
    for (size_t b : recv_bytes)
      r += b;
    collective("alltoallv", {{send, s}, {recv, r}},
               [&] { mpi_->alltoallv(send, send_bytes, recv, recv_bytes); });
  }
  // A host-side barrier over MPI that issues nothing, as NcclCommunicator's.
  void barrier() override {
    counted([&] { mpi_->barrier(); });
  }

  std::unique_ptr<Communicator> split(int color, int key) const override {
    return wrap(mpi_->split(color, key));
  }
  std::unique_ptr<Communicator> split_node() const override { return wrap(mpi_->split_node()); }

 private:
  struct Issued {
    P2pOp op;
    MPI_Request request = MPI_REQUEST_NULL;
    std::vector<unsigned char> staging;  // a receive's bytes until completion
    uint64_t hash = 0;                   // a send buffer's at issue
    uint64_t batch = 0;
  };
  struct Span {
    const void* p;
    size_t bytes;
  };

  std::unique_ptr<Communicator> wrap(std::unique_ptr<Communicator> sub) const {
    auto* raw = dynamic_cast<MpiCommunicator*>(sub.get());
    DATTN_ASSERT(raw != nullptr);
    sub.release();
    return std::make_unique<EmuNcclCommunicator>(std::unique_ptr<MpiCommunicator>(raw),
                                                 device_only_);
  }

  [[noreturn]] void die(const std::string& what) const {
    int world_rank = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    std::fprintf(stderr, "[rank %d] emulated NCCL (%s, %d ranks): %s\n", world_rank, name_.c_str(),
                 size(), what.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, kWatchdogAbortCode);
    std::_Exit(kWatchdogAbortCode);
  }

  void check_peer(int peer, const char* what) const {
    DATTN_CHECK_ARG(peer >= 0 && peer < size(), what, peer,
                    detail::cat("a rank of this group (0..", size() - 1, ")"));
  }
  // NCCL dereferences whatever it is given on the device; host memory there is a fault.
  void check_buffer(const void* p, size_t bytes, const char* op) const {
    if (!device_only_ || bytes == 0 || p == nullptr) return;
    if (!is_device_range(p, bytes))
      die(detail::cat(op, " of ", bytes, " bytes at ", describe_pointer(p),
                      ": NCCL moves device memory only (on hardware: an illegal-address fault)"));
  }

  // The byte counts MPI's operation made, added to this communicator's.
  template <typename F>
  void counted(F&& f) {
    const ByteCounters before = mpi_->counters();
    f();
    for (const auto& [name, e] : mpi_->counters().ops) {
      auto it = before.ops.find(name);
      const uint64_t calls = e.calls - (it == before.ops.end() ? 0 : it->second.calls);
      const uint64_t bytes = e.bytes - (it == before.ops.end() ? 0 : it->second.bytes);
      if (calls == 0) continue;
      auto& mine = counters_.ops[name];
      mine.calls += calls;
      mine.bytes += bytes;
    }
  }
  template <typename F>
  void collective(const char* op, std::initializer_list<Span> spans, F&& f) {
    for (const Span& s : spans)
      check_buffer(s.p, s.bytes, op);
    flush();
    complete(op);
    counted(f);
  }

  // Issues the pending operations as one batch, in the real backend's order. The real backend
  // records an event on the caller's stream first (follow_current_stream): counted there.
  void flush() {
    record_stream_op(current_stream());
    if (pending_.empty()) return;
    std::vector<P2pOp> ops;
    ops.swap(pending_);
    ++batches_;
    for (const P2pOp& op : nccl_issue_order(std::move(ops))) {
      Issued& x = issued_.emplace_back();
      x.op = op;
      x.batch = batches_;
      const std::string what = detail::cat("an NCCL ", op.send ? "send to" : "receive from",
                                           " rank ", op.peer, " (", op.bytes, " bytes)");
      if (op.send) {
        x.hash = fnv1a(op.buf, op.bytes);
        DATTN_MPI_CHECK(
            MPI_Issend(op.buf, int(op.bytes), MPI_BYTE, op.peer, kTag, p2p_, &x.request));
      } else {
        x.staging.resize(op.bytes);
        std::memset(op.buf, 0xff, op.bytes);  // undefined until the transfer completes
        DATTN_MPI_CHECK(
            MPI_Irecv(x.staging.data(), int(op.bytes), MPI_BYTE, op.peer, kTag, p2p_, &x.request));
      }
      if (device_only_) hold(op.buf, op.bytes, what);
    }
  }

  std::string describe(bool unfinished_only) const {
    std::string s;
    for (const Issued& x : issued_) {
      if (unfinished_only && x.request == MPI_REQUEST_NULL) continue;
      s += detail::cat(s.empty() ? "" : "; ", x.op.send ? "send to" : "recv from", " rank ",
                       x.op.peer, " (tag ", x.op.tag, ", ", x.op.bytes, " B, batch ", x.batch, ")");
    }
    for (const P2pOp& op : pending_)
      s += detail::cat(s.empty() ? "" : "; ", op.send ? "send to" : "recv from", " rank ", op.peer,
                       " (tag ", op.tag, ", ", op.bytes, " B, not issued)");
    return s;
  }

  // Completes every issued operation under the deadline, checks sizes and send buffers, and
  // delivers the received bytes.
  void complete(const char* op) {
    record_stream_op(current_stream());  // the real backend's join of the caller's stream
    if (issued_.empty()) return;
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    std::vector<MPI_Request> reqs;
    for (const Issued& x : issued_)
      reqs.push_back(x.request);
    std::vector<MPI_Status> status(reqs.size());
    for (;;) {
      int done = 0;
      const int rc = MPI_Testall(int(reqs.size()), reqs.data(), &done, status.data());
      if (rc == MPI_ERR_IN_STATUS) {
        for (size_t i = 0; i < reqs.size(); ++i)
          if (status[i].MPI_ERROR != MPI_SUCCESS && status[i].MPI_ERROR != MPI_ERR_PENDING)
            die(detail::cat(op, ": ", issued_[i].op.send ? "send to" : "receive from", " rank ",
                            issued_[i].op.peer, " of ", issued_[i].op.bytes, " bytes failed (",
                            mpi_error_string(status[i].MPI_ERROR),
                            "): the matching operation has another size (NCCL requires equal "
                            "sizes; on hardware a hang or corrupt data)"));
        die(detail::cat(op, ": MPI_Testall failed with no request in error"));
      }
      DATTN_MPI_CHECK(rc);
      if (done) break;
      const double waited = std::chrono::duration<double>(Clock::now() - start).count();
      if (waited > mpi_->timeout_s()) {
        for (size_t i = 0; i < reqs.size(); ++i)
          issued_[i].request = reqs[i];
        die(detail::cat(op, ": the operations issued never all matched in ", waited,
                        " s (NCCL completes a group only when each of its operations met its "
                        "peer's, a peer's in issue order, tags ignored; on hardware this hangs); "
                        "unmatched: ",
                        describe(/*unfinished_only=*/true)));
      }
      if (waited > 1e-3) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    for (size_t i = 0; i < issued_.size(); ++i) {
      Issued& x = issued_[i];
      if (!x.op.send) {
        int count = 0;
        MPI_Get_count(&status[i], MPI_BYTE, &count);
        if (size_t(count) != x.op.bytes)
          die(detail::cat(op, ": a receive from rank ", x.op.peer, " posted for ", x.op.bytes,
                          " bytes (tag ", x.op.tag, ") matched a send of ", count,
                          " bytes (NCCL requires equal sizes; on hardware a hang or corrupt "
                          "data)"));
        std::memcpy(x.op.buf, x.staging.data(), x.op.bytes);
      } else if (fnv1a(x.op.buf, x.op.bytes) != x.hash) {
        die(detail::cat(op, ": the buffer of a send to rank ", x.op.peer, " (", x.op.bytes,
                        " bytes, tag ", x.op.tag,
                        ") changed while the send was in flight (NCCL reads it until completion)"));
      }
      if (device_only_) release(x.op.buf);
    }
    issued_.clear();
  }

  std::unique_ptr<MpiCommunicator> mpi_;  // collectives and control data
  MPI_Comm p2p_ = MPI_COMM_NULL;          // point-to-point, one tag
  bool device_only_ = false;
  std::vector<P2pOp> pending_;  // posted, not issued
  std::vector<Issued> issued_;  // issued, not completed
  uint64_t batches_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> nccl_semantics_communicator(MPI_Comm comm, double timeout_s,
                                                          bool device_memory_only) {
  return std::make_unique<EmuNcclCommunicator>(std::make_unique<MpiCommunicator>(comm, timeout_s),
                                               device_memory_only);
}

}  // namespace dattn::emu
