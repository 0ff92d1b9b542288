// Runtime: the ranks, their communicators and the device one dattn call runs on.
// Built once per process from an MPI communicator; every API call takes it.
#pragma once

#include <mpi.h>

#include <memory>
#include <string>

#include "collective/communicator.h"
#include "src/base/stream.h"
#include "src/base/tensor.h"

namespace dattn {

struct RuntimeOptions {
  // cpu, or cuda(i): this rank's GPU (one per rank, usually its node-local rank; the index may
  // differ between ranks, the kind may not). With cuda, from_mpi makes GPU i current
  // (cudaSetDevice) and builds cp() and the groups split from it as NCCL communicators (device
  // buffers); world() stays MPI (host control data). Needs a build with CUDA and NCCL and a GPU
  // that CUDA sees: else dattn::Error naming `device`, on every rank.
  Device device = Device::cpu();
  int cp = 0;         // context-parallel degree; 0 means all ranks / tp
  int tp = 1;         // tensor-parallel degree (ranks form a cp x tp grid, tp fastest)
  int threads = 0;    // OpenMP threads per rank; 0: OMP_NUM_THREADS if set, else cores per rank
  int ulysses = 1;    // Ulysses degree U of the hybrid strategy: cp ranks form R x U groups
                      // (U consecutive cp ranks exchange heads, R = cp / U groups form a ring)
  int node_size = 0;  // cp ranks per node for topology-aware reductions; 0: the real nodes
                      // (MPI_Comm_split_type); a number declares fake nodes of that many
                      // consecutive cp ranks (to test multi-node paths on one machine)
  // Checking mode for non-finite inputs: the API entry points scan q, k, v (and dout) on each
  // rank for NaN/inf before any data moves and fail with a dattn::Error on every rank that names
  // the tensor, the rank, the position and the value (README "Numerics"). Off by default (the
  // fast mode: nothing is scanned). DATTN_CHECK_FINITE=1 in the environment turns it on as well;
  // either one is enough, and DATTN_CHECK_FINITE=0 or unset leaves this option as it is.
  bool check_finite = false;
  // The watchdog's deadline in seconds: a rank that waits longer than this in any collective or
  // point-to-point wait of dattn's communicators prints one "dattn watchdog:" line naming the
  // operation, the group and the peers, and aborts the job (exit code 14), so that a dead or
  // stuck rank ends the job instead of hanging it. Precedence: a value > 0 here wins; else the
  // environment variable DATTN_TIMEOUT (seconds > 0, "inf" for no deadline); else 300 s.
  // Not part of the configuration the ranks must agree on.
  double timeout_s = 0;
  // cuda only: the CUDA stream (a cudaStream_t, not owned) every call of this Runtime queues its
  // device work on, e.g. torch.cuda.current_stream().cuda_stream; null: the legacy default
  // stream. No call waits for the device (src/base/stream.h has the contract); set_stream
  // changes it between calls. Not part of the configuration the ranks must agree on.
  StreamHandle stream = nullptr;
};

// Whether DATTN_CHECK_FINITE=1 is set (the non-finite check of the entry points that take no
// Runtime, attention_local and attention_local_backward, and of every Runtime). Unset or 0:
// false; any other value throws dattn::Error naming the variable.
bool check_finite_env();

class Runtime {
 public:
  // Creates the runtime over comm (duplicated). Collective over comm. Throws dattn::Error on
  // every rank when cp * tp != size.
  static Runtime from_mpi(MPI_Comm comm, const RuntimeOptions& options = {});

  int rank() const { return world_->rank(); }
  int size() const { return world_->size(); }
  int cp_rank() const { return cp_->rank(); }
  int cp_size() const { return cp_->size(); }
  int tp_size() const { return tp_; }
  int tp_rank() const { return rank() % tp_; }  // which slice of the heads this rank holds
  int ulysses_degree() const { return ulysses_; }
  Communicator& world() { return *world_; }
  Communicator& cp() { return *cp_; }
  // The hybrid strategy's groups (ulysses_degree() > 1 only): the U ranks that exchange heads,
  // and the R ranks, one per group, that form the ring. Throws when ulysses_degree() == 1.
  Communicator& ulysses_group();
  Communicator& ring_group();
  // The cp ranks on this rank's node (real or declared by node_size), and the node leaders
  // (node rank 0 of every node; on other ranks a communicator they must not use).
  Communicator& node();
  Communicator& node_leaders();
  bool spans_nodes() const { return node_->size() < cp_->size(); }
  // Bytes this rank sent per operation over cp(), the hybrid groups and the node groups.
  ByteCounters counters() const;
  void reset_counters();
  Device device() const { return device_; }
  // The stream of this Runtime's calls (RuntimeOptions.stream), and a new one for the calls after
  // this (the caller orders the two: what the old stream holds that the new one reads).
  StreamHandle stream() const { return stream_; }
  void set_stream(StreamHandle stream) { stream_ = stream; }
  int threads() const { return threads_; }
  int node_ranks() const { return node_ranks_; }  // ranks sharing this node
  // Whether the non-finite check runs: RuntimeOptions.check_finite or DATTN_CHECK_FINITE=1
  // (read at each call). Throws dattn::Error naming the variable when it is neither 0 nor 1.
  bool check_finite() const { return check_finite_ || check_finite_env(); }

 private:
  Runtime() = default;
  std::unique_ptr<Communicator> world_;
  std::unique_ptr<Communicator> cp_;
  std::unique_ptr<Communicator> ulysses_group_, ring_group_;
  std::unique_ptr<Communicator> node_, node_leaders_;
  Device device_;
  StreamHandle stream_ = nullptr;
  int tp_ = 1;
  int ulysses_ = 1;
  int threads_ = 1;
  int node_ranks_ = 1;
  bool check_finite_ = false;
};

}  // namespace dattn
