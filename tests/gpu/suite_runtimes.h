// The runtimes of the GPU strategy tests: made on first use over MPI_COMM_WORLD and kept for the
// test suite (NCCL setup is slow), one per name; release_suite_runtimes() in TearDownTestSuite
// frees them before MPI_Finalize.
#pragma once

#include <mpi.h>

#include <map>
#include <memory>
#include <string>

#include "src/runtime.h"
#include "tests/gpu/one_gpu_per_rank.h"

namespace dattn::test {

// options on this rank's GPU (the node-local rank's, tests/gpu/one_gpu_per_rank.h).
inline RuntimeOptions on_gpu(RuntimeOptions options = {}) {
  options.device = Device::cuda(OneGpuPerRank::device());
  return options;
}

inline std::map<std::string, std::unique_ptr<Runtime>>& suite_runtimes() {
  static std::map<std::string, std::unique_ptr<Runtime>> runtimes;
  return runtimes;
}

// The runtime called `name`, made with `options` the first time (collective: every rank asks for
// the same names in the same order).
inline Runtime& suite_runtime(const std::string& name, const RuntimeOptions& options) {
  std::unique_ptr<Runtime>& rt = suite_runtimes()[name];
  if (!rt) rt = std::make_unique<Runtime>(Runtime::from_mpi(MPI_COMM_WORLD, options));
  return *rt;
}

inline void release_suite_runtimes() {
  suite_runtimes().clear();
}

}  // namespace dattn::test
