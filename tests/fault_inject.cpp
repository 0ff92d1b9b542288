// fault_inject: a small MPI program in which one rank (rank 1) misbehaves on purpose, so that
// tests/faults/fault_test.sh can check that the watchdog (collective/mpi_communicator.cpp) or
// Open MPI ends the whole job within the deadline instead of letting it hang.
//   fault_inject MODE [--timeout S] [--sleep S]
// MODE: sleep-collective  rank 1 sleeps before an allreduce the others have entered
//       sleep-attention   rank 1 sleeps before dattn::attention (ring) the others have called
//       sleep-ring        rank 1 sleeps inside ring attention, between its sends and its wait
//       kill-ring         rank 1 raises SIGKILL there instead
//       ok-ring           no fault: ring attention completes (exit 0)
//       print-deadline    rank 0 prints "deadline D" (the runtime's resolved watchdog deadline)
// --timeout sets RuntimeOptions.timeout_s (0, the default: DATTN_TIMEOUT or 300 s); --sleep is
// how long rank 1 sleeps (default 600 s; a value under the deadline must not trip the watchdog).
#include <mpi.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "collective/mpi_communicator.h"
#include "src/attention.h"
#include "src/layout.h"
#include "src/runtime.h"
#include "src/strategies/strategies.h"

namespace {

using namespace dattn;

constexpr int kFaultyRank = 1;

// A Communicator that forwards everything to another one, except that on the faulty rank the
// first wait on point-to-point requests runs `fault` first: the ring's sends (and receives) of
// its first step are posted, its peers wait for them, and this rank does not drive them.
class FaultyComm final : public Communicator {
 public:
  FaultyComm(Communicator& inner, void (*fault)()) : in_(inner), fault_(fault) {}

  int rank() const override { return in_.rank(); }
  int size() const override { return in_.size(); }
  std::string backend() const override { return in_.backend(); }
  RequestPtr isend(const void* buf, size_t bytes, int peer, int tag) override {
    return in_.isend(buf, bytes, peer, tag);
  }
  RequestPtr irecv(void* buf, size_t bytes, int peer, int tag) override {
    return in_.irecv(buf, bytes, peer, tag);
  }
  void wait(RequestPtr& request) override { in_.wait(request); }
  void wait_all(std::vector<RequestPtr>& requests) override {
    if (fault_ != nullptr && !requests.empty() && in_.rank() == kFaultyRank) {
      auto fault = fault_;
      fault_ = nullptr;  // once
      fault();
    }
    in_.wait_all(requests);
  }
  void sendrecv(const void* send_buf, size_t send_bytes, int dest, void* recv_buf,
                size_t recv_bytes, int src, int tag) override {
    in_.sendrecv(send_buf, send_bytes, dest, recv_buf, recv_bytes, src, tag);
  }
  void allreduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) override {
    in_.allreduce(send, recv, count, dtype, op);
  }
  void allreduce_u64(const uint64_t* send, uint64_t* recv, size_t count, ReduceOp op) override {
    in_.allreduce_u64(send, recv, count, op);
  }
  void reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
              int root) override {
    in_.reduce(send, recv, count, dtype, op, root);
  }
  void allgather(const void* send, void* recv, size_t bytes_per_rank) override {
    in_.allgather(send, recv, bytes_per_rank);
  }
  void allgatherv(const void* send, size_t send_bytes, void* recv,
                  const std::vector<size_t>& recv_bytes) override {
    in_.allgatherv(send, send_bytes, recv, recv_bytes);
  }
  void gather(const void* send, void* recv, size_t bytes_per_rank, int root) override {
    in_.gather(send, recv, bytes_per_rank, root);
  }
  void broadcast(void* buf, size_t bytes, int root) override { in_.broadcast(buf, bytes, root); }
  void alltoall(const void* send, void* recv, size_t bytes_per_rank) override {
    in_.alltoall(send, recv, bytes_per_rank);
  }
  void alltoallv(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                 const std::vector<size_t>& recv_bytes) override {
    in_.alltoallv(send, send_bytes, recv, recv_bytes);
  }
  void barrier() override { in_.barrier(); }
  std::unique_ptr<Communicator> split(int color, int key) const override {
    return in_.split(color, key);
  }
  std::unique_ptr<Communicator> split_node() const override { return in_.split_node(); }

 private:
  Communicator& in_;
  void (*fault_)();
};

double g_sleep_s = 600;

void sleep_fault() {
  std::fprintf(stderr, "[rank %d] fault_inject: sleeping %g s\n", kFaultyRank, g_sleep_s);
  std::fflush(stderr);
  std::this_thread::sleep_for(std::chrono::duration<double>(g_sleep_s));
}

void kill_fault() {
  std::fprintf(stderr, "[rank %d] fault_inject: raising SIGKILL\n", kFaultyRank);
  std::fflush(stderr);
  std::raise(SIGKILL);
}

// Ring attention over comm with K/V blocks of 512 tokens x 2 heads x 64 (256 KiB in fp32):
// far above Open MPI's eager limit, so a block in flight needs its sender to make progress.
void ring_attention(Runtime& rt, Communicator& comm, bool public_api) {
  const int P = comm.size(), me = comm.rank();
  const int64_t local = 512, B = 1, H = 4, Hkv = 2, D = 64;
  Layout layout = Layout::contiguous(local * P, P);
  AttnSpec spec;
  spec.heads_q = H;
  spec.heads_kv = Hkv;
  spec.head_dim = D;
  spec.mask = Mask::none();
  const int64_t S = layout.local_len(me);
  Tensor q = Tensor::full({B, S, H, D}, DType::f32, 0.25f);
  Tensor k = Tensor::full({B, S, Hkv, D}, DType::f32, 0.5f);
  Tensor v = Tensor::full({B, S, Hkv, D}, DType::f32, 1.f);
  Partial res = public_api ? attention(rt, q, k, v, spec, layout, Strategy::ring)
                           : ring_attention_forward(comm, q, k, v, spec, layout);
  // Every row sees every key, whose values are all 1: out must be 1 everywhere.
  const float* out = res.out.ptr<float>();
  for (int64_t i = 0; i < res.out.numel(); ++i)
    if (out[i] < 0.999f || out[i] > 1.001f) DATTN_THROW("ring attention: out[", i, "] = ", out[i]);
}

int run(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: fault_inject MODE [--timeout S] [--sleep S]\n");
    return 2;
  }
  const std::string mode = argv[1];
  RuntimeOptions options;
  for (int i = 2; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--timeout") == 0)
      options.timeout_s = std::atof(argv[i + 1]);
    else if (std::strcmp(argv[i], "--sleep") == 0)
      g_sleep_s = std::atof(argv[i + 1]);
    else
      DATTN_THROW("unknown option ", argv[i]);
  }
  Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, options);
  const bool faulty = rt.cp_rank() == kFaultyRank;

  if (mode == "print-deadline") {
    if (rt.rank() == 0)
      std::printf("deadline %g\n", dynamic_cast<MpiCommunicator&>(rt.cp()).timeout_s());
  } else if (mode == "sleep-collective") {
    if (faulty) sleep_fault();
    float x = 1.f, sum = 0.f;
    rt.cp().allreduce(&x, &sum, 1, DType::f32, ReduceOp::sum);
  } else if (mode == "sleep-attention") {
    if (faulty) sleep_fault();
    ring_attention(rt, rt.cp(), /*public_api=*/true);
  } else if (mode == "sleep-ring" || mode == "kill-ring" || mode == "ok-ring") {
    FaultyComm comm(rt.cp(), mode == "sleep-ring"  ? sleep_fault
                             : mode == "kill-ring" ? kill_fault
                                                   : nullptr);
    ring_attention(rt, comm, /*public_api=*/false);
  } else {
    DATTN_THROW("unknown mode ", mode);
  }
  rt.cp().barrier();
  if (rt.rank() == 0) std::printf("fault_inject %s: completed\n", mode.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int code = 0;
  try {
    code = run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return code;
}
