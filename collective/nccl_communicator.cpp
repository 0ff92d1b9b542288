// NcclCommunicator: bootstrap over MPI (unique id broadcast, non-blocking ncclCommInitRankConfig
// under the deadline), each Communicator operation as NCCL calls on one stream joined to the
// caller's stream by events, with byte counting as MpiCommunicator counts, the watchdog's poll
// loop at every host wait (init, split, enqueue) and its thread over the completion events.
#include "collective/nccl_communicator.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <mutex>
#include <numeric>
#include <thread>
#include <tuple>
#include <utility>

#include "collective/nccl_check.h"
#include "src/base/cuda_check.h"
#include "src/base/stream.h"

namespace dattn {

namespace {

struct NcclRequest final : Request {
  // What the watchdog names when the wait on this request does not complete.
  const void* owner = nullptr;
  bool send = false;
  int peer = 0;
  int tag = 0;
  size_t bytes = 0;
};

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32:
      return ncclFloat32;
    case DType::bf16:
      return ncclBfloat16;
    case DType::f16:
      return ncclFloat16;
  }
  DATTN_THROW("invalid dtype = ", int(t), ": expected f32, bf16 or f16");
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::max:
      return ncclMax;
    case ReduceOp::min:
      return ncclMin;
  }
  DATTN_THROW("invalid reduce op = ", int(op), ": expected sum, max or min");
}

const char* at(const void* base, size_t offset) {
  return static_cast<const char*>(base) + offset;
}
char* at(void* base, size_t offset) {
  return static_cast<char*>(base) + offset;
}

// ncclGroupStart/End as a scope: should a call inside the group throw, the group is still
// closed, so that the next NCCL call is not swallowed into a group nobody ends.
class NcclGroup {
 public:
  NcclGroup() { DATTN_NCCL_CHECK(ncclGroupStart()); }
  ~NcclGroup() {
    if (open_) ncclGroupEnd();
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;
  void end() {
    open_ = false;
    DATTN_NCCL_CHECK_ASYNC(ncclGroupEnd());
  }

 private:
  bool open_ = true;
};

// ---------------------------------------------------------------- the watchdog's poll loop
// Why poll instead of cudaStreamSynchronize / cudaEventSynchronize: those take no deadline, and a
// NCCL kernel whose peer is dead or never joined spins on the GPU forever, so the host would wait
// until the batch system's wall time, with no word of which operation or peer. NCCL's own
// answer to this is the same loop: query, check ncclCommGetAsyncError, and ncclCommAbort on
// trouble (NCCL user guide, "Fault tolerance"). The host waits of this file (init, split, a
// call's enqueue) poll here; the transfers themselves are watched by the Watchdog thread below,
// since no call waits for them on the host. Pacing as in the MPI backend, simpler: spin
// (yield between queries) for the first millisecond, where short collectives end, then sleep
// 1/64 of the time waited (20 us to 1 ms), so a rank waiting for a slow peer gives its core back
// and loses at most ~2% (or 1 ms) of its wait. A query is a driver call of about a microsecond;
// there is no MPI progress to drive here, so the MPI backend's busy detection is not needed.
constexpr double kSpinS = 1e-3;

using Clock = std::chrono::steady_clock;

// Calls done() until it returns true (then true) or deadline_s has passed (then false);
// waited_s says how long it waited either way.
template <typename Done>
bool poll(Done&& done, double deadline_s, double& waited_s) {
  waited_s = 0;
  if (done()) return true;
  const Clock::time_point start = Clock::now();
  for (;;) {
    if (done()) {
      waited_s = std::chrono::duration<double>(Clock::now() - start).count();
      return true;
    }
    const double waited = std::chrono::duration<double>(Clock::now() - start).count();
    waited_s = waited;
    if (waited > deadline_s) return false;
    if (waited < kSpinS)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(
          std::chrono::duration<double>(std::clamp(waited / 64, 20e-6, 1e-3)));
  }
}

// NCCL's async state of comm: ncclSuccess, ncclInProgress, or an error.
ncclResult_t async_state(ncclComm_t comm) {
  ncclResult_t state = ncclSuccess;
  const ncclResult_t rc = ncclCommGetAsyncError(comm, &state);
  return rc == ncclSuccess ? state : rc;
}

std::string nccl_error_text(ncclResult_t rc) {
  return detail::cat(ncclGetErrorString(rc), " (", int(rc), "): ", ncclGetLastError(nullptr));
}

std::vector<int> world_ranks_of(MPI_Comm comm) {
  int n = 0;
  DATTN_MPI_CHECK(MPI_Comm_size(comm, &n));
  std::vector<int> in(size_t(n), 0), out(size_t(n), MPI_UNDEFINED);
  std::iota(in.begin(), in.end(), 0);
  MPI_Group group, world;
  DATTN_MPI_CHECK(MPI_Comm_group(comm, &group));
  DATTN_MPI_CHECK(MPI_Comm_group(MPI_COMM_WORLD, &world));
  DATTN_MPI_CHECK(MPI_Group_translate_ranks(group, n, in.data(), world, out.data()));
  MPI_Group_free(&world);
  MPI_Group_free(&group);
  for (int i = 0; i < n; ++i)
    if (out[size_t(i)] == MPI_UNDEFINED) out[size_t(i)] = i;
  return out;
}

std::string peers_text(const std::vector<int>& world_ranks) {
  std::string s = "peers: world ranks ";
  const size_t shown = std::min<size_t>(world_ranks.size(), 16);
  for (size_t i = 0; i < shown; ++i)
    s += detail::cat(i ? ", " : "", world_ranks[i]);
  if (shown < world_ranks.size()) s += detail::cat(", ... (", world_ranks.size(), " in all)");
  return s;
}

// The watchdog's line, then ncclCommAbort, so that the kernels stop and NCCL's proxy threads do
// not keep the process alive. Why end the job instead of throwing: the expired operation is still
// enqueued (its buffers in NCCL's hands, its kernel maybe spinning), the peers are stuck in
// theirs, and a caller that caught an Error would go on and leave them waiting. One fprintf: one
// line, not interleaved with the other ranks' lines.
void watchdog_line(ncclComm_t comm, int world_rank, const std::string& what,
                   const std::string& group, int size, double timeout_s, const std::string& reason,
                   double waited_s, const std::string& peers) {
  std::fprintf(stderr,
               "[rank %d] dattn watchdog: %s on %s (%d ranks, nccl) waited %.1f s (deadline %g s): "
               "%s; %s; aborting the job\n",
               world_rank, what.c_str(), group.c_str(), size, waited_s, timeout_s, reason.c_str(),
               peers.c_str());
  std::fflush(stderr);
  if (comm != nullptr) ncclCommAbort(comm);
}

// The watchdog's end of the job from the thread that called MPI: MPI_Abort ends every rank.
[[noreturn]] void watchdog_abort(ncclComm_t comm, const std::string& what, const std::string& group,
                                 int size, double timeout_s, const std::string& reason,
                                 double waited_s, const std::string& peers) {
  int world_rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  watchdog_line(comm, world_rank, what, group, size, timeout_s, reason, waited_s, peers);
  MPI_Abort(MPI_COMM_WORLD, kWatchdogAbortCode);
  std::_Exit(kWatchdogAbortCode);  // MPI_Abort does not return; should it, end this rank
}

const char* kDeadlineReason =
    "not complete at the deadline; a peer is dead or stuck, or slower than the deadline "
    "(RuntimeOptions.timeout_s, DATTN_TIMEOUT)";

// Every rank of control learns whether any rank failed a step; all throw if one did (the failing
// ranks their own error, the others one naming the step, of the failed rank's kind), so that no
// rank goes on into a collective the failed one will never join. Host control data: over MPI,
// under its deadline.
void agree(MpiCommunicator& control, const std::exception_ptr& mine, const char* step) {
  uint64_t failed = 0;  // 1 + this rank's ErrorKind, 0 if it did not fail
  if (mine) {
    try {
      std::rethrow_exception(mine);
    } catch (const Error& e) {
      failed = 1 + uint64_t(e.kind());
    } catch (...) {
      failed = 1 + uint64_t(ErrorKind::internal);
    }
  }
  uint64_t any = 0;
  control.allreduce_u64(&failed, &any, 1, ReduceOp::max);
  if (mine) std::rethrow_exception(mine);
  if (any != 0)
    DATTN_THROW_KIND(ErrorKind(any - 1), "NcclCommunicator: ", step, " failed on another rank of ",
                     control.name(), " (that rank's error says why)");
}

// The CUDA objects of a communicator under construction, released unless handed on.
struct CudaSetup {
  int device = -1;
  cudaStream_t stream = nullptr;
  bool owns_stream = false;
  cudaEvent_t ready = nullptr;
  ~CudaSetup() {
    if (ready != nullptr) cudaEventDestroy(ready);
    if (owns_stream && stream != nullptr) cudaStreamDestroy(stream);
  }
};

}  // namespace

// ---------------------------------------------------------------- the watchdog's thread
// complete() hands it each operation's completion event (recorded on the NCCL stream); the thread
// watches the oldest one until it is done, under the deadline counted from when the operation
// could start (it was handed over and the one before it was done: the stream runs them in
// order), and checks NCCL's async state meanwhile. An operation past the deadline, or an NCCL
// error, ends the job from here: the watchdog's line, ncclCommAbort, then _Exit(14) (the launcher
// ends the other ranks; MPI_Abort is not ours to call from this thread, MPI being
// MPI_THREAD_FUNNELED). A CUDA error on an event (a bad kernel) is the caller's bug and shows at
// its next CUDA call: the thread drops that operation. Pacing: sleep 1/64 of the time waited (20
// us to 1 ms): a few microseconds of driver calls per millisecond, and the host thread that
// issues the work never waits. Done events go back to a spare list for the next operations.
struct NcclCommunicator::Watchdog {
  struct Entry {
    cudaEvent_t event;
    std::string op, group, peers;  // what the line names (no peers: all of the group)
    Clock::time_point queued;
  };

  Watchdog(ncclComm_t comm, int world_rank, int size, double timeout_s, int device,
           std::string all_peers)
      : comm(comm),
        world_rank(world_rank),
        size(size),
        timeout_s(timeout_s),
        device(device),
        all_peers(std::move(all_peers)) {}

  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stop = true;
    }
    wake.notify_all();
    if (thread.joinable()) thread.join();
    // An event still recorded but not done is released by CUDA once it completes.
    for (const Entry& e : queue)
      cudaEventDestroy(e.event);
    for (cudaEvent_t e : spare)
      cudaEventDestroy(e);
  }

  // An event for the next operation: a spare one, else a new one (on the calling thread).
  cudaEvent_t take_event() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (!spare.empty()) {
        cudaEvent_t e = spare.back();
        spare.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    DATTN_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }

  void give_back(cudaEvent_t e) {
    std::lock_guard<std::mutex> lock(mutex);
    spare.push_back(e);
  }

  // Watches `event` (recorded already); starts the thread at the first operation.
  void watch(cudaEvent_t event, const char* op, const std::string& group,
             const std::string& peers) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      queue.push_back({event, op, group, peers, Clock::now()});
      if (!thread.joinable()) thread = std::thread([this] { run(); });
    }
    wake.notify_one();
  }

  void run() {
    cudaSetDevice(device);  // the events are this device's; a failure shows in the queries
    Clock::time_point last_done = Clock::now();
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
      wake.wait(lock, [&] { return stop || !queue.empty(); });
      if (stop) return;
      // Only this thread pops, and push_back keeps references to a deque's elements valid.
      const Entry& e = queue.front();
      const Clock::time_point start = std::max(e.queued, last_done);
      lock.unlock();
      for (;;) {
        const cudaError_t q = cudaEventQuery(e.event);
        if (q != cudaErrorNotReady) break;  // done, or a CUDA error (dropped, see above)
        const double waited = std::chrono::duration<double>(Clock::now() - start).count();
        const ncclResult_t state = async_state(comm);
        if (state != ncclSuccess && state != ncclInProgress)
          fail(e, "NCCL reported an asynchronous error: " + nccl_error_text(state), waited);
        if (waited > timeout_s) fail(e, kDeadlineReason, waited);
        if (stop.load()) return;
        std::this_thread::sleep_for(
            std::chrono::duration<double>(std::clamp(waited / 64, 20e-6, 1e-3)));
      }
      last_done = Clock::now();
      lock.lock();
      spare.push_back(queue.front().event);
      queue.pop_front();
    }
  }

  [[noreturn]] void fail(const Entry& e, const std::string& reason, double waited_s) const {
    watchdog_line(comm, world_rank, e.op, e.group, size, timeout_s, reason, waited_s,
                  e.peers.empty() ? all_peers : e.peers);
    std::_Exit(kWatchdogAbortCode);
  }

  const ncclComm_t comm;
  const int world_rank, size;
  const double timeout_s;
  const int device;
  const std::string all_peers;  // "peers: world ranks ..." of the group
  std::mutex mutex;             // guards queue, spare and thread
  std::condition_variable wake;
  std::deque<Entry> queue;  // handed over, not yet seen done; oldest first
  std::vector<cudaEvent_t> spare;
  std::atomic<bool> stop{false};
  std::thread thread;
};

// ---------------------------------------------------------------- creation and release

std::unique_ptr<NcclCommunicator> NcclCommunicator::from_mpi(MPI_Comm comm, double timeout_s,
                                                             cudaStream_t stream) {
  // The control communicator first: it carries the agreement on every later step, so that a
  // failure on one rank (no device, no driver) becomes an Error on all of them instead of a hang.
  auto control = std::make_unique<MpiCommunicator>(comm, timeout_s);
  return create(std::move(control), stream, nullptr, 0, 0);
}

std::unique_ptr<NcclCommunicator> NcclCommunicator::create(std::unique_ptr<MpiCommunicator> control,
                                                           cudaStream_t stream,
                                                           const NcclCommunicator* parent,
                                                           int color, int key) {
  const double timeout_s = control->timeout_s();
  const int rank = control->rank(), size = control->size();
  // Who must agree on each step: every rank that takes part in the NCCL call, i.e. the parent's
  // ranks for a split (ncclCommSplit is collective over the parent), else this group's.
  MpiCommunicator& everyone = parent != nullptr ? *parent->control_ : *control;

  // 1. Local CUDA objects. The stream is a non-blocking one, so that a kernel on the caller's
  // stream runs while our transfers do (a blocking stream would serialise them with every kernel on
  // the legacy default stream); work on the caller's stream is ordered before each NCCL call by the
  // event `ready` (follow_current_stream).
  CudaSetup cuda;
  std::exception_ptr error;
  try {
    DATTN_CUDA_CHECK(cudaGetDevice(&cuda.device));
    if (stream != nullptr) {
      cuda.stream = stream;
    } else {
      DATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&cuda.stream, cudaStreamNonBlocking));
      cuda.owns_stream = true;
    }
    DATTN_CUDA_CHECK(cudaEventCreateWithFlags(&cuda.ready, cudaEventDisableTiming));
  } catch (const Error&) {
    error = std::current_exception();
  }
  agree(everyone, error, "CUDA setup");

  // 2. The NCCL communicator, non-blocking (config.blocking = 0): init and split return at once
  // and we poll their state under the deadline; a blocking init would wait for a dead peer (or
  // one that never calls it) forever. Every later call on the communicator may then return
  // ncclInProgress, which settle() waits out.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const char* what = parent ? "ncclCommSplit" : "ncclCommInitRankConfig";
  try {
    if (parent == nullptr) {
      // Rank 0 makes the unique id; whether that worked travels with it (a failure there must
      // not leave the others waiting in init).
      struct {
        uint64_t ok;
        ncclUniqueId id;
      } boot{};
      std::exception_ptr id_error;
      if (rank == 0) {
        try {
          DATTN_NCCL_CHECK(ncclGetUniqueId(&boot.id));
          boot.ok = 1;
        } catch (const Error&) {
          id_error = std::current_exception();
        }
      }
      control->broadcast(&boot, sizeof boot, 0);  // DATTN_MPI_CHECK'ed, under the deadline
      if (id_error) std::rethrow_exception(id_error);
      if (boot.ok == 0)
        DATTN_THROW_KIND(ErrorKind::nccl, "NcclCommunicator: ncclGetUniqueId failed on rank 0");
      DATTN_NCCL_CHECK_ASYNC(ncclCommInitRankConfig(&comm, size, boot.id, rank, &config));
    } else {
      DATTN_NCCL_CHECK_ASYNC(ncclCommSplit(parent->comm_, color, key, &comm, &config));
    }
    double waited = 0;
    ncclResult_t state = ncclInProgress;
    const bool settled = poll(
        [&] {
          state = async_state(comm);
          // A split is also pending on the parent until it is done.
          if (state == ncclSuccess && parent != nullptr) state = async_state(parent->comm_);
          return state != ncclInProgress;
        },
        timeout_s, waited);
    if (!settled)
      watchdog_abort(comm, what, control->name(), size, timeout_s, kDeadlineReason, waited,
                     peers_text(world_ranks_of(control->comm())));
    if (state != ncclSuccess)
      DATTN_THROW_KIND(ErrorKind::nccl, "NCCL call failed: ", what, " (", size,
                       " ranks): ", nccl_error_text(state));
  } catch (const Error&) {
    error = std::current_exception();
    if (comm != nullptr) ncclCommAbort(comm);
    comm = nullptr;
  }
  try {
    agree(everyone, error, what);
  } catch (...) {
    if (comm != nullptr) ncclCommAbort(comm);  // it worked here, but not everywhere
    throw;
  }

  auto out = std::unique_ptr<NcclCommunicator>(new NcclCommunicator(
      std::move(control), comm, cuda.stream, cuda.owns_stream, cuda.ready, cuda.device));
  cuda.owns_stream = false;  // handed on
  cuda.ready = nullptr;
  return out;
}

NcclCommunicator::NcclCommunicator(std::unique_ptr<MpiCommunicator> control, ncclComm_t comm,
                                   cudaStream_t stream, bool owns_stream, cudaEvent_t ready,
                                   int device)
    : control_(std::move(control)),
      device_(device),
      stream_(stream),
      owns_stream_(owns_stream),
      ready_(ready),
      comm_(comm),
      rank_(control_->rank()),
      size_(control_->size()),
      timeout_s_(control_->timeout_s()),
      world_ranks_(world_ranks_of(control_->comm())),
      watchdog_(std::make_unique<Watchdog>(comm, world_ranks_[size_t(rank_)], size_, timeout_s_,
                                           device, peers_text(world_ranks_))) {
  name_ = control_->name();
}

// The watchdog's thread first (it uses the NCCL communicator), then in reverse order of creation:
// the NCCL communicator, the event, the stream, then (as the first member) the control
// communicator. Operations still pending (posted, never waited) are dropped. Finalize under the
// deadline: it flushes what NCCL still holds; should it fail or not finish (a dead peer), abort
// instead, so that a destructor never hangs or throws.
NcclCommunicator::~NcclCommunicator() {
  watchdog_.reset();
  if (comm_ != nullptr) {
    const ncclResult_t rc = ncclCommFinalize(comm_);
    bool clean = rc == ncclSuccess || rc == ncclInProgress;
    if (clean) {
      double waited = 0;
      ncclResult_t state = ncclInProgress;
      clean = poll(
                  [&] {
                    state = async_state(comm_);
                    return state != ncclInProgress;
                  },
                  timeout_s_, waited) &&
              state == ncclSuccess;
    }
    if (clean)
      ncclCommDestroy(comm_);
    else
      ncclCommAbort(comm_);
    comm_ = nullptr;
  }
  if (ready_ != nullptr) cudaEventDestroy(ready_);
  if (owns_stream_ && stream_ != nullptr) cudaStreamDestroy(stream_);
}

// ---------------------------------------------------------------- the watchdog

void NcclCommunicator::expire(const std::string& what, const std::string& reason, double waited_s,
                              const std::string& peers) const {
  watchdog_abort(comm_, what, name_, size_, timeout_s_, reason, waited_s, peers);
}

std::string NcclCommunicator::all_peers() const {
  return peers_text(world_ranks_);
}

void NcclCommunicator::settle(const char* op) const {
  double waited = 0;
  ncclResult_t state = ncclInProgress;
  const bool settled = poll(
      [&] {
        state = async_state(comm_);
        return state != ncclInProgress;
      },
      timeout_s_, waited);
  if (!settled) expire(op, kDeadlineReason, waited, all_peers());
  if (state != ncclSuccess)
    expire(op, "NCCL reported an error: " + nccl_error_text(state), waited, all_peers());
}

// One event after everything on the NCCL stream: the caller's stream waits for it on the GPU, and
// the watchdog's thread watches it under the deadline.
void NcclCommunicator::complete(const char* op, const std::string& peers) {
  cudaEvent_t done = watchdog_->take_event();
  const cudaError_t recorded = cudaEventRecord(done, stream_);
  if (recorded != cudaSuccess) {
    watchdog_->give_back(done);
    DATTN_CUDA_CHECK(recorded);
  }
  const cudaError_t joined =
      cudaStreamWaitEvent(static_cast<cudaStream_t>(current_stream()), done, 0);
  watchdog_->watch(done, op, name_, peers);
  DATTN_CUDA_CHECK(joined);
}

void NcclCommunicator::check_rank(int r, const char* what) const {
  DATTN_CHECK_ARG(r >= 0 && r < size_, what, r, detail::cat("a rank in [0, ", size_, ")"));
}

// ---------------------------------------------------------------- point-to-point

RequestPtr NcclCommunicator::isend(const void* buf, size_t bytes, int peer, int tag) {
  check_rank(peer, "isend peer");
  // NCCL reads the buffer and never writes it: the const_cast only lets one list hold both kinds.
  pending_.push_back({true, const_cast<void*>(buf), bytes, peer, tag});
  auto req = std::make_unique<NcclRequest>();
  req->owner = this;
  req->send = true;
  req->peer = peer;
  req->tag = tag;
  req->bytes = bytes;
  counters_.add("send", bytes);
  return req;
}

RequestPtr NcclCommunicator::irecv(void* buf, size_t bytes, int peer, int tag) {
  check_rank(peer, "irecv peer");
  pending_.push_back({false, buf, bytes, peer, tag});
  auto req = std::make_unique<NcclRequest>();
  req->owner = this;
  req->peer = peer;
  req->tag = tag;
  req->bytes = bytes;
  return req;
}

// One group for all pending operations: NCCL progresses a group's sends and receives together,
// so a ring step (send to next, receive from prev on every rank) cannot deadlock, which separate
// ncclSend/ncclRecv calls would (each blocks its stream until its peer's matching call runs).
// The batch is issued in nccl_issue_order (collective/p2p_batch.h): by peer, then tag.
void NcclCommunicator::flush() {
  follow_current_stream();
  if (pending_.empty()) return;
  std::vector<P2pOp> ops;
  ops.swap(pending_);
  NcclGroup group;
  for (const P2pOp& op : nccl_issue_order(std::move(ops))) {
    if (op.send)
      DATTN_NCCL_CHECK_ASYNC(ncclSend(op.buf, op.bytes, ncclUint8, op.peer, comm_, stream_));
    else
      DATTN_NCCL_CHECK_ASYNC(ncclRecv(op.buf, op.bytes, ncclUint8, op.peer, comm_, stream_));
  }
  group.end();
  settle("point-to-point (group of pending sends and receives)");
}

// The stream waits (on the GPU, not the host) for what the caller's stream holds now: the kernels
// and copies that wrote the buffers about to be sent, and those still reading a buffer about to
// be received into. Later work on the caller's stream is not waited for: a kernel queued after
// start() overlaps the transfers.
void NcclCommunicator::follow_current_stream() {
  DATTN_CUDA_CHECK(cudaEventRecord(ready_, static_cast<cudaStream_t>(current_stream())));
  DATTN_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
}

void NcclCommunicator::start() {
  flush();
}

void NcclCommunicator::wait(RequestPtr& request) {
  if (!request) return;
  std::vector<RequestPtr> one;
  one.push_back(std::move(request));
  wait_all(one);
}

// Everything on the stream completes in order, so one event after the flushed group completes
// every request at once (in the caller's stream order): the requests only name the peers for the
// watchdog's line.
void NcclCommunicator::wait_all(std::vector<RequestPtr>& requests) {
  std::string pending;
  for (const auto& request : requests) {
    if (!request) continue;
    const auto* r = dynamic_cast<const NcclRequest*>(request.get());
    DATTN_ASSERT(r != nullptr && r->owner == this);
    pending += detail::cat(pending.empty() ? "pending: " : ", ", r->send ? "send to" : "recv from",
                           " world rank ", world_ranks_[size_t(r->peer)], " (tag ", r->tag, ", ",
                           r->bytes, " B)");
  }
  flush();
  complete("point-to-point wait", pending);
  requests.clear();
}

void NcclCommunicator::sendrecv(const void* send_buf, size_t send_bytes, int dest, void* recv_buf,
                                size_t recv_bytes, int src, int tag) {
  std::vector<RequestPtr> reqs;
  reqs.push_back(irecv(recv_buf, recv_bytes, src, tag));
  reqs.push_back(isend(send_buf, send_bytes, dest, tag));
  wait_all(reqs);
}

// ---------------------------------------------------------------- collectives
// Each: pending point-to-point first (its own group, ahead on the stream), the NCCL call (settled:
// a non-blocking communicator may return before it is enqueued), then completion (the caller's
// stream joined, the watchdog's deadline), then the count, as MpiCommunicator counts. Zero-sized
// calls skip NCCL (the sizes are the same on every rank, so every rank skips) but count a call, as
// MPI does.

void NcclCommunicator::allreduce(const void* send, void* recv, size_t count, DType dtype,
                                 ReduceOp op) {
  flush();
  if (count > 0) {
    // send == recv is NCCL's in-place form as it is.
    DATTN_NCCL_CHECK_ASYNC(
        ncclAllReduce(send, recv, count, nccl_type(dtype), nccl_op(op), comm_, stream_));
    settle("allreduce");
  }
  complete("allreduce");
  counters_.add("allreduce", count * dtype_size(dtype));
}

// Control data is host memory (flags, hashes): over MPI, without a device round trip. Named as
// this group so the MPI watchdog's line names the group the caller knows.
void NcclCommunicator::allreduce_u64(const uint64_t* send, uint64_t* recv, size_t count,
                                     ReduceOp op) {
  control_->set_name(name_);
  control_->allreduce_u64(send, recv, count, op);
  counters_.add("control", count * sizeof(uint64_t));
}

void NcclCommunicator::reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                              int root) {
  check_rank(root, "reduce root");
  flush();
  if (count > 0) {
    DATTN_NCCL_CHECK_ASYNC(
        ncclReduce(send, recv, count, nccl_type(dtype), nccl_op(op), root, comm_, stream_));
    settle("reduce");
  }
  complete("reduce");
  counters_.add("reduce", count * dtype_size(dtype));
}

void NcclCommunicator::allgather(const void* send, void* recv, size_t bytes_per_rank) {
  flush();
  if (bytes_per_rank > 0) {
    DATTN_NCCL_CHECK_ASYNC(ncclAllGather(send, recv, bytes_per_rank, ncclUint8, comm_, stream_));
    settle("allgather");
  }
  complete("allgather");
  counters_.add("allgather", bytes_per_rank);
}

// One ncclBroadcast per rank (rank r the root of its block), in one group. Chosen over grouped
// send/recv: a broadcast moves each block along NCCL's ring or tree pipeline, so every rank's
// link carries about the total once, as ncclAllGather does; with send/recv each rank pushes its
// own block size()-1 times over its own link, and a rank with a large block becomes the
// bottleneck. NCCL's user guide shows this same grouped-broadcast pattern for uneven gathers.
// Empty blocks are skipped (every rank knows every size).
void NcclCommunicator::allgatherv(const void* send, size_t send_bytes, void* recv,
                                  const std::vector<size_t>& recv_bytes) {
  DATTN_CHECK_ARG(recv_bytes.size() == size_t(size_), "recv_bytes size", recv_bytes.size(),
                  detail::cat(size_, " (one count per rank)"));
  DATTN_CHECK_ARG(recv_bytes[size_t(rank_)] == send_bytes, "send_bytes", send_bytes,
                  detail::cat(recv_bytes[size_t(rank_)], " (this rank's entry of recv_bytes)"));
  flush();
  NcclGroup group;
  size_t off = 0;
  for (int r = 0; r < size_; ++r) {
    const size_t n = recv_bytes[size_t(r)];
    if (n > 0) {
      // The send buffer matters on the root only; elsewhere the block's place in recv stands in.
      const void* src = r == rank_ ? send : at(recv, off);
      DATTN_NCCL_CHECK_ASYNC(ncclBroadcast(src, at(recv, off), n, ncclUint8, r, comm_, stream_));
    }
    off += n;
  }
  group.end();
  settle("allgatherv");
  complete("allgatherv");
  counters_.add("allgather", send_bytes);
}

// Grouped send/recv: the root receives every other rank's block in place, and copies its own
// block on the stream (NCCL has no self-message here to pay for). Non-roots never touch recv.
void NcclCommunicator::gather(const void* send, void* recv, size_t bytes_per_rank, int root) {
  check_rank(root, "gather root");
  flush();
  const size_t n = bytes_per_rank;
  if (n > 0) {
    if (rank_ == root && send != at(recv, size_t(root) * n))
      DATTN_CUDA_CHECK(
          cudaMemcpyAsync(at(recv, size_t(root) * n), send, n, cudaMemcpyDefault, stream_));
    if (size_ > 1) {
      NcclGroup group;
      if (rank_ == root) {
        for (int r = 0; r < size_; ++r)
          if (r != root)
            DATTN_NCCL_CHECK_ASYNC(
                ncclRecv(at(recv, size_t(r) * n), n, ncclUint8, r, comm_, stream_));
      } else {
        DATTN_NCCL_CHECK_ASYNC(ncclSend(send, n, ncclUint8, root, comm_, stream_));
      }
      group.end();
      settle("gather");
    }
  }
  complete("gather",
           detail::cat("root world rank ", world_ranks_[size_t(root)], "; ", all_peers()));
  counters_.add("gather", rank_ == root ? 0 : bytes_per_rank);
}

Communicator& NcclCommunicator::control() {
  return *control_;
}

void NcclCommunicator::broadcast(void* buf, size_t bytes, int root) {
  check_rank(root, "broadcast root");
  flush();
  if (bytes > 0) {
    DATTN_NCCL_CHECK_ASYNC(ncclBroadcast(buf, buf, bytes, ncclUint8, root, comm_, stream_));
    settle("broadcast");
  }
  complete("broadcast",
           detail::cat("root world rank ", world_ranks_[size_t(root)], "; ", all_peers()));
  counters_.add("broadcast", rank_ == root ? bytes : 0);
}

void NcclCommunicator::alltoall(const void* send, void* recv, size_t bytes_per_rank) {
  std::vector<size_t> sizes(size_t(size_), bytes_per_rank);
  alltoallv(send, sizes, recv, sizes);
}

// Grouped send/recv, one pair per other rank (NCCL's own ncclAlltoAll is the same loop); the
// block a rank keeps is a copy on the stream. Not in place: the sends would read blocks the
// receives overwrite.
void NcclCommunicator::alltoallv(const void* send, const std::vector<size_t>& send_bytes,
                                 void* recv, const std::vector<size_t>& recv_bytes) {
  DATTN_CHECK_ARG(send_bytes.size() == size_t(size_) && recv_bytes.size() == size_t(size_),
                  "alltoallv counts", detail::cat(send_bytes.size(), "/", recv_bytes.size()),
                  detail::cat(size_, " (one count per rank)"));
  DATTN_CHECK_ARG(
      send_bytes[size_t(rank_)] == recv_bytes[size_t(rank_)], "alltoallv own block",
      detail::cat(send_bytes[size_t(rank_)], " B sent, ", recv_bytes[size_t(rank_)], " B received"),
      "the same size on both sides");
  std::vector<size_t> send_off(static_cast<size_t>(size_)), recv_off(static_cast<size_t>(size_));
  size_t so = 0, ro = 0, sent = 0, moved = 0;
  for (int r = 0; r < size_; ++r) {
    send_off[size_t(r)] = so;
    recv_off[size_t(r)] = ro;
    so += send_bytes[size_t(r)];
    ro += recv_bytes[size_t(r)];
    if (r != rank_) sent += send_bytes[size_t(r)];
    if (r != rank_) moved += send_bytes[size_t(r)] + recv_bytes[size_t(r)];
  }
  DATTN_CHECK_ARG(send != recv || so + ro == 0, "alltoallv recv", "the send buffer",
                  "a separate buffer (all-to-all is not in place)");
  flush();
  const size_t own = send_bytes[size_t(rank_)];
  if (own > 0)
    DATTN_CUDA_CHECK(cudaMemcpyAsync(at(recv, recv_off[size_t(rank_)]),
                                     at(send, send_off[size_t(rank_)]), own, cudaMemcpyDefault,
                                     stream_));
  if (moved > 0) {
    NcclGroup group;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      if (send_bytes[size_t(r)] > 0)
        DATTN_NCCL_CHECK_ASYNC(ncclSend(at(send, send_off[size_t(r)]), send_bytes[size_t(r)],
                                        ncclUint8, r, comm_, stream_));
      if (recv_bytes[size_t(r)] > 0)
        DATTN_NCCL_CHECK_ASYNC(ncclRecv(at(recv, recv_off[size_t(r)]), recv_bytes[size_t(r)],
                                        ncclUint8, r, comm_, stream_));
    }
    group.end();
    settle("alltoall");
  }
  complete("alltoall");
  counters_.add("alltoall", sent);
}

// A host-side barrier over MPI: it orders host code only (the device work queued before it may
// still run); pending (unwaited) sends and receives stay pending (see the header).
void NcclCommunicator::barrier() {
  control_->set_name(name_);
  control_->barrier();
}

// ---------------------------------------------------------------- sub-groups
// The control communicator splits first (MPI's split starts with a barrier under the deadline,
// so a missing rank is caught there); then ncclCommSplit over the parent with the same color and
// key, non-blocking and polled like init. The new group gets its own stream.

std::unique_ptr<Communicator> NcclCommunicator::split(int color, int key) const {
  DATTN_CHECK_ARG(color >= 0, "split color", color, ">= 0 (NCCL's colors are non-negative)");
  control_->set_name(name_);
  std::unique_ptr<Communicator> sub = control_->split(color, key);
  auto* mpi = dynamic_cast<MpiCommunicator*>(sub.get());
  DATTN_ASSERT(mpi != nullptr);
  sub.release();
  auto out = create(std::unique_ptr<MpiCommunicator>(mpi), nullptr, this, color, key);
  out->set_name(name_ + " (split)");
  return out;
}

// MPI says which ranks share the node (MPI_Comm_split_type SHARED); the node's color for NCCL is
// the lowest rank of this group on that node, agreed over the node's MPI communicator. Key:
// this rank, so the node group keeps this group's order, as MpiCommunicator::split_node does.
std::unique_ptr<Communicator> NcclCommunicator::split_node() const {
  control_->set_name(name_);
  std::unique_ptr<Communicator> sub = control_->split_node();
  auto* mpi = dynamic_cast<MpiCommunicator*>(sub.get());
  DATTN_ASSERT(mpi != nullptr);
  sub.release();
  std::unique_ptr<MpiCommunicator> node(mpi);
  const uint64_t mine = uint64_t(rank_);
  uint64_t lowest = 0;
  node->allreduce_u64(&mine, &lowest, 1, ReduceOp::min);
  node->reset_counters();
  auto out = create(std::move(node), nullptr, this, int(lowest), rank_);
  out->set_name(name_ + " (node)");
  return out;
}

}  // namespace dattn
