// Runtime construction: communicators for the cp x tp grid, node-local rank count, threads.
#include "src/runtime.h"

#include <omp.h>

#include <cstdlib>
#include <cstring>
#include <thread>

#include "collective/mpi_communicator.h"
#include "src/base/error.h"
#include "src/validate.h"
#if DATTN_WITH_CUDA
#include "src/base/cuda_check.h"
#endif
#if DATTN_WITH_NCCL
#include "collective/nccl_communicator.h"
#endif

namespace dattn {

#if DATTN_CUDA_EMULATION
namespace emu {
// The emulation's communicator with NCCL's semantics (tests/emu/emu_nccl_communicator.h), linked
// into the emulated library only; declared here, since the library never includes tests/.
std::unique_ptr<Communicator> nccl_semantics_communicator(MPI_Comm comm, double timeout_s,
                                                          bool device_memory_only);
}  // namespace emu
#endif

namespace {
// Makes options.device this process's current CUDA device (a GPU runtime: kernels launch and
// NCCL communicators are created on the current device). Throws dattn::Error naming `device`
// where the build has no CUDA backend with NCCL, or CUDA does not see that device.
void select_device(const Device& device) {
  if (device.is_cpu()) return;
#if DATTN_WITH_CUDA && (DATTN_WITH_NCCL || DATTN_CUDA_EMULATION)
  check_device(device);
  DATTN_CUDA_CHECK(cudaSetDevice(device.index));
#else
  DATTN_CHECK_ARG(false, "device", device.str(),
                  "cpu: this build has no GPU backend (it needs the CUDA toolkit and NCCL: "
                  "DATTN_WITH_CUDA and DATTN_WITH_NCCL)");
#endif
}

// The cp group's communicator over the MPI communicator `cp`: MPI (host buffers) on the CPU,
// NCCL (device buffers, bootstrapped over MPI) on a GPU. Collective over cp. Null: keep cp.
std::unique_ptr<Communicator> cp_communicator(Communicator& cp, const Device& device,
                                              double timeout_s) {
#if DATTN_CUDA_EMULATION
  // The CPU emulation of CUDA (tests/emu): a communicator with NCCL's matching, completion and
  // pointer rules over MPI, on every Runtime of the emulated library (a CPU one moves host
  // memory under NCCL's rules), so that what NCCL would not run fails there.
  return emu::nccl_semantics_communicator(static_cast<MpiCommunicator&>(cp).comm(), timeout_s,
                                          !device.is_cpu());
#elif DATTN_WITH_NCCL
  if (device.is_cpu()) return nullptr;  // the caller keeps the MPI one
  return NcclCommunicator::from_mpi(static_cast<MpiCommunicator&>(cp).comm(), timeout_s);
#else
  (void)cp;
  (void)timeout_s;
  if (device.is_cpu()) return nullptr;
  DATTN_THROW("invalid device = ", device.str(), ": this build has no NCCL");
#endif
}
}  // namespace

Runtime Runtime::from_mpi(MPI_Comm comm, const RuntimeOptions& options) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) DATTN_THROW("MPI is not initialised: call MPI_Init before Runtime::from_mpi");
  Runtime rt;
  // A bad timeout_s is reported below by the agreed validation, on every rank; until then the
  // default deadline applies.
  const bool timeout_ok = options.timeout_s >= 0;
  rt.world_ = std::make_unique<MpiCommunicator>(comm, timeout_ok ? options.timeout_s : 0.0);
  rt.world_->set_name("world");
  set_error_rank(rt.world_->rank());
  const int P = rt.world_->size();

  // The device's kind must match on every rank, its index need not (one GPU per rank: the
  // node-local rank).
  uint64_t h = kHashSeed;
  for (int64_t x : {int64_t(options.device.kind), int64_t(options.cp), int64_t(options.tp),
                    int64_t(options.ulysses), int64_t(options.node_size)})
    h = hash_mix(h, uint64_t(x));
  agree_on_validation(*rt.world_, "runtime options", h, [&] {
    select_device(options.device);
    DATTN_CHECK_ARG(options.tp >= 1, "tp", options.tp, ">= 1");
    DATTN_CHECK_ARG(options.cp >= 0, "cp", options.cp, ">= 0 (0: all ranks / tp)");
    const int cp = options.cp == 0 ? P / options.tp : options.cp;
    DATTN_CHECK_ARG(cp * options.tp == P, "cp x tp", detail::cat(cp, " x ", options.tp),
                    detail::cat("the number of ranks (", P, ")"));
    DATTN_CHECK_ARG(options.threads >= 0, "threads", options.threads, ">= 0 (0: automatic)");
    DATTN_CHECK_ARG(timeout_ok, "timeout_s", options.timeout_s,
                    ">= 0 seconds (0: DATTN_TIMEOUT, else 300)");
    DATTN_CHECK_ARG(options.node_size >= 0, "node_size", options.node_size,
                    ">= 0 (0: the real nodes)");
    DATTN_CHECK_ARG(options.stream == nullptr || !options.device.is_cpu(), "stream",
                    "a CUDA stream", "null on a cpu Runtime (a stream orders GPU work only)");
    DATTN_CHECK_ARG(options.ulysses >= 1 && cp % options.ulysses == 0, "ulysses", options.ulysses,
                    detail::cat("a divisor of the cp degree (", cp, ")"));
  });
  rt.device_ = options.device;
  rt.stream_ = options.stream;
  rt.tp_ = options.tp;
  // Ranks with the same tp index form a cp group; tp is the fastest-varying index.
  rt.cp_ = rt.world_->split(rt.world_->rank() % rt.tp_, rt.world_->rank() / rt.tp_);
  // On a GPU the cp group and every group split from it below are NCCL communicators (device
  // buffers); world() stays MPI: it carries host control data only (validation, barriers).
  if (auto nccl = cp_communicator(*rt.cp_, rt.device_, timeout_ok ? options.timeout_s : 0.0))
    rt.cp_ = std::move(nccl);
  rt.cp_->set_name("cp");
  rt.node_ranks_ = rt.world_->split_node()->size();
  // Nodes: the cp ranks that share a node (or a declared fake node), and the node leaders.
  {
    const int c = rt.cp_->rank();
    rt.node_ =
        options.node_size > 0 ? rt.cp_->split(c / options.node_size, c) : rt.cp_->split_node();
    rt.node_leaders_ = rt.cp_->split(rt.node_->rank() == 0 ? 0 : 1, c);
    rt.node_->set_name("node");
    rt.node_leaders_->set_name("node leaders");
  }
  // Hybrid groups: U consecutive cp ranks exchange heads; rank u of every group forms a ring.
  rt.ulysses_ = options.ulysses;
  if (rt.ulysses_ > 1) {
    const int c = rt.cp_->rank(), U = rt.ulysses_;
    rt.ulysses_group_ = rt.cp_->split(c / U, c % U);
    rt.ring_group_ = rt.cp_->split(c % U, c / U);
    rt.ulysses_group_->set_name("ulysses group");
    rt.ring_group_->set_name("ring group");
  }

  // Threads: explicit, else OMP_NUM_THREADS, else the node's cores shared among its ranks
  // (OpenMP's default of every core per rank oversubscribes the node P-fold).
  if (options.threads > 0) {
    rt.threads_ = options.threads;
  } else if (std::getenv("OMP_NUM_THREADS") != nullptr) {
    rt.threads_ = omp_get_max_threads();
  } else {
    const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
    rt.threads_ = std::max(1, cores / rt.node_ranks_);
  }
  omp_set_num_threads(rt.threads_);
  rt.check_finite_ = options.check_finite;
  return rt;
}

bool check_finite_env() {
  const char* value = std::getenv("DATTN_CHECK_FINITE");
  if (value == nullptr || std::strcmp(value, "") == 0 || std::strcmp(value, "0") == 0) return false;
  if (std::strcmp(value, "1") == 0) return true;
  DATTN_THROW("invalid DATTN_CHECK_FINITE = '", value, "': expected 0 or 1 (or unset)");
}

Communicator& Runtime::ulysses_group() {
  if (!ulysses_group_) DATTN_THROW("the runtime has no Ulysses groups: RuntimeOptions.ulysses = 1");
  return *ulysses_group_;
}

Communicator& Runtime::ring_group() {
  if (!ring_group_) DATTN_THROW("the runtime has no Ulysses groups: RuntimeOptions.ulysses = 1");
  return *ring_group_;
}

Communicator& Runtime::node() {
  return *node_;
}
Communicator& Runtime::node_leaders() {
  return *node_leaders_;
}

ByteCounters Runtime::counters() const {
  ByteCounters all = cp_->counters();
  for (const auto* c :
       {ulysses_group_.get(), ring_group_.get(), node_.get(), node_leaders_.get()}) {
    if (c == nullptr) continue;
    for (const auto& [op, e] : c->counters().ops) {
      all.ops[op].calls += e.calls;
      all.ops[op].bytes += e.bytes;
    }
  }
  return all;
}

void Runtime::reset_counters() {
  cp_->reset_counters();
  if (ulysses_group_) ulysses_group_->reset_counters();
  if (ring_group_) ring_group_->reset_counters();
  node_->reset_counters();
  node_leaders_->reset_counters();
}

}  // namespace dattn
