// The multi-rank GPU tests' entry check: one GPU per rank, or every rank skips together.
// Every rank checks that CUDA sees a device for each rank on its node and selects its own (the
// node-local rank); the ranks agree over MPI before anyone decides, so that all skip (exit 77,
// rank 0 prints the reason) or all run: a rank that skipped alone would leave the others waiting
// in their first collective. DATTN_GPU_TESTS_REQUIRED=1 (the device check script) turns "no
// usable GPU" (no driver, no device) into a failure, but not "fewer devices than ranks": NCCL
// cannot put two ranks on one device, and a one-GPU machine running an np2 test is not broken.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace dattn::test {

// The cp group's backend on a GPU Runtime: NCCL (on the CPU emulation of CUDA, tests/emu, its
// NCCL-semantics communicator, which names itself the same).
inline constexpr const char* kGpuBackend = "nccl";

class OneGpuPerRank : public testing::Environment {
 public:
  // skip_check: when it returns true the check is not made (a test mode that runs without GPUs).
  explicit OneGpuPerRank(bool (*skip_check)() = nullptr) : skip_check_(skip_check) {}
  // This rank's GPU: its node-local rank (valid once SetUp has run).
  static int device() { return device_; }

  void SetUp() override {
    if (skip_check_ != nullptr && skip_check_()) return;
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    int local_rank = 0, local_size = 1, rank = 0, size = 1;
    MPI_Comm_rank(node, &local_rank);
    MPI_Comm_size(node, &local_size);
    MPI_Comm_free(&node);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    device_ = local_rank;

    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    char reason[256] = {};
    if (err != cudaSuccess)
      std::snprintf(reason, sizeof reason, "no usable GPU: cudaGetDeviceCount returned %d (%s: %s)",
                    int(err), cudaGetErrorName(err), cudaGetErrorString(err));
    else if (count < local_size)
      std::snprintf(reason, sizeof reason,
                    "CUDA sees %d device(s), but %d ranks run on this node (one device per rank)",
                    count, local_size);
    else if (cudaSetDevice(local_rank) != cudaSuccess)
      std::snprintf(reason, sizeof reason, "cudaSetDevice(%d) failed", local_rank);
    // Rank 0 names the first rank's reason (all ranks agree on whether there is one).
    std::vector<char> reasons(rank == 0 ? sizeof reason * size_t(size) : 1);
    MPI_Gather(reason, sizeof reason, MPI_CHAR, reasons.data(), sizeof reason, MPI_CHAR, 0,
               MPI_COMM_WORLD);
    // [0]: this rank can run; [1]: this rank has no usable GPU at all.
    int mine[2] = {reason[0] == '\0' ? 1 : 0, (err != cudaSuccess || count == 0) ? 1 : 0};
    int all[2] = {0, 0};
    MPI_Allreduce(&mine[0], &all[0], 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(&mine[1], &all[1], 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (all[0]) return;

    const char* required = std::getenv("DATTN_GPU_TESTS_REQUIRED");
    const bool must = all[1] && required != nullptr && std::strcmp(required, "1") == 0;
    if (rank == 0) {
      for (int r = 0; r < size; ++r) {
        const char* why = reasons.data() + sizeof reason * size_t(r);
        if (*why == '\0') continue;
        std::printf("%s: rank %d: %s\n", must ? "FAILED" : "SKIPPED", r, why);
        break;
      }
      std::fflush(stdout);
    }
    // Together, past every collective: no rank is left waiting.
    MPI_Finalize();
    std::exit(must ? 1 : 77);
  }

 private:
  bool (*skip_check_)();
  static inline int device_ = 0;
};

}  // namespace dattn::test
