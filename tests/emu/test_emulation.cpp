// Tests of the CUDA emulation itself (cuda_emulation.h): tiny kernels written here, each breaking
// one rule the hardware enforces, fail as the emulation promises (a death with a message naming
// the site, or the launch error the runtime gives); and the parts that model the hardware's
// freedom (deferred cp.async, seeded schedules) behave as documented.
#include "tests/emu/cuda_emulation.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "src/base/cuda_check.h"
#include "src/base/error.h"
#include "tests/emu/fake_runtime.h"

namespace {

using dattn::cuda::detail::cp_async_16;
using dattn::cuda::detail::cp_async_commit;
using dattn::cuda::detail::cp_async_wait;
using dattn::cuda::detail::ldmatrix_x4;

// Device memory of the fake runtime, freed at the end of the scope.
struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t bytes) { EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess); }
  ~DeviceBuffer() { cudaFree(p); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

const cudaStream_t kStream = nullptr;

// ---------------------------------------------------------------- deaths

__global__ void mismatched_barriers(int* out) {
  if (threadIdx.x % 2 == 0) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}

TEST(EmulationDeath, SyncthreadsFromTwoSites) {
  DeviceBuffer out(64 * sizeof(int));
  EXPECT_DEATH(DATTN_LAUNCH(mismatched_barriers, 1, 64, 0, kStream, out.as<int>()),
               "__syncthreads at .*test_emulation.cpp:[0-9]+:[0-9]+ while other threads of the "
               "block wait at the __syncthreads at .*test_emulation.cpp:[0-9]+:[0-9]+.*"
               "kernel mismatched_barriers");
}

__global__ void mismatched_shuffles(float* out) {
  float v = float(threadIdx.x);
  if (threadIdx.x < 16)
    v = __shfl_xor_sync(0xffffffffu, v, 1);
  else
    v = __shfl_xor_sync(0xffffffffu, v, 2);
  out[threadIdx.x] = v;
}

TEST(EmulationDeath, WarpCollectiveFromTwoSites) {
  DeviceBuffer out(32 * sizeof(float));
  EXPECT_DEATH(DATTN_LAUNCH(mismatched_shuffles, 1, 32, 0, kStream, out.as<float>()),
               "__shfl_xor_sync at .*test_emulation.cpp:[0-9]+:[0-9]+ while other lanes of the "
               "warp wait at __shfl_xor_sync at .*test_emulation.cpp");
}

// Half a warp at a block barrier, the other half at a warp barrier: neither can complete.
__global__ void split_warp(int* out) {
  if (threadIdx.x < 16)
    __syncthreads();
  else
    __syncwarp();
  out[threadIdx.x] = 1;
}

TEST(EmulationDeath, BarriersThatCanNeverMeetAreADeadlock) {
  DeviceBuffer out(32 * sizeof(int));
  EXPECT_DEATH(DATTN_LAUNCH(split_warp, 1, 32, 0, kStream, out.as<int>()),
               "deadlock.*16 thread\\(s\\), the first 0, wait at __syncthreads at "
               ".*test_emulation.cpp.*16 thread\\(s\\), the first 16, wait at __syncwarp");
}

// Lanes 16..31 return before the shuffle that lane 0..15 read them in.
__global__ void shuffle_from_returned_lane(float* out) {
  if (threadIdx.x >= 16) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.f, 16);
}

TEST(EmulationDeath, ShuffleFromAReturnedLane) {
  DeviceBuffer out(32 * sizeof(float));
  EXPECT_DEATH(DATTN_LAUNCH(shuffle_from_returned_lane, 1, 32, 0, kStream, out.as<float>()),
               "__shfl_xor_sync at .*test_emulation.cpp:[0-9]+:[0-9]+ reads lane 16, which has "
               "returned");
}

__global__ void unwaited_copy(const unsigned char* src) {
  DATTN_DYNAMIC_SHARED(unsigned char, smem);
  cp_async_16(smem + 16 * threadIdx.x, src + 16 * threadIdx.x, true);
  cp_async_commit();
  if (threadIdx.x == 0) cp_async_wait<0>();  // the others return with their copy in flight
}

TEST(EmulationDeath, CopyLeftUnwaited) {
  DeviceBuffer src(64 * 16);
  EXPECT_DEATH(DATTN_LAUNCH(unwaited_copy, 1, 64, 64 * 16, kStream, src.as<unsigned char>()),
               "returned with 1 cp.async copies not waited for \\(1 committed, 0 not; the oldest "
               "issued at .*test_emulation.cpp:[0-9]+:[0-9]+\\).*thread 1 ");
}

__global__ void misaligned_copy(const unsigned char* src) {
  DATTN_DYNAMIC_SHARED(unsigned char, smem);
  cp_async_16(smem + 8, src, true);
  cp_async_commit();
  cp_async_wait<0>();
}

TEST(EmulationDeath, MisalignedCopy) {
  DeviceBuffer src(64);
  EXPECT_DEATH(DATTN_LAUNCH(misaligned_copy, 1, 32, 64, kStream, src.as<unsigned char>()),
               "cp.async at .*test_emulation.cpp:[0-9]+:[0-9]+: dst 0x[0-9a-f]+ is not 16-byte "
               "aligned; kernel misaligned_copy .*block \\(0,0,0\\), thread 0 ");
}

__global__ void copy_from(const unsigned char* src) {
  DATTN_DYNAMIC_SHARED(unsigned char, smem);
  cp_async_16(smem + 16 * threadIdx.x, src + 16 * threadIdx.x, true);
  cp_async_commit();
  cp_async_wait<0>();
}

TEST(EmulationDeath, CopyFromHostMemory) {
  alignas(16) static unsigned char host[32 * 16] = {};
  EXPECT_DEATH(DATTN_LAUNCH(copy_from, 1, 32, 32 * 16, kStream, host),
               "cp.async at .*test_emulation.cpp:[0-9]+:[0-9]+: src 0x[0-9a-f]+ \\(not in any live "
               "device allocation\\): its 16 bytes are not inside one device allocation");
}

TEST(EmulationDeath, CopyPastTheEndOfAnAllocation) {
  DeviceBuffer src(31 * 16);  // thread 31 reads past its end
  EXPECT_DEATH(DATTN_LAUNCH(copy_from, 1, 32, 32 * 16, kStream, src.as<unsigned char>()),
               "its 16 bytes are not inside one device allocation.*thread 31 ");
}

// Lane l gives the row address smem + 16 l: lanes 16.. are outside 256 bytes.
__global__ void ldmatrix_rows(uint32_t* out) {
  DATTN_DYNAMIC_SHARED(unsigned char, smem);
  uint32_t r[4];
  ldmatrix_x4(r, smem + 16 * threadIdx.x);
  out[threadIdx.x] = r[0];
}

TEST(EmulationDeath, LdmatrixOutsideSharedMemory) {
  DeviceBuffer out(32 * sizeof(uint32_t));
  EXPECT_DEATH(DATTN_LAUNCH(ldmatrix_rows, 1, 32, 256, kStream, out.as<uint32_t>()),
               "ldmatrix.x4 at .*test_emulation.cpp:[0-9]+:[0-9]+: row address 0x[0-9a-f]+ "
               "\\(shared offset 256\\): its 16 bytes are not inside the block's 256 bytes of "
               "dynamic shared memory.*thread 16 ");
}

// Thread 0 copies into row 0 and never waits before the warp reads it.
__global__ void ldmatrix_in_flight(const unsigned char* src, uint32_t* out) {
  DATTN_DYNAMIC_SHARED(unsigned char, smem);
  if (threadIdx.x == 0) {
    cp_async_16(smem, src, true);
    cp_async_commit();
  }
  uint32_t r[4];
  ldmatrix_x4(r, smem + 16 * threadIdx.x);
  out[threadIdx.x] = r[0];
  if (threadIdx.x == 0) cp_async_wait<0>();
}

TEST(EmulationDeath, LdmatrixOfACopyInFlight) {
  DeviceBuffer src(16), out(32 * sizeof(uint32_t));
  EXPECT_DEATH(DATTN_LAUNCH(ldmatrix_in_flight, 1, 32, 512, kStream, src.as<unsigned char>(),
                            out.as<uint32_t>()),
               "ldmatrix.x4 at .*: row address .* \\(shared offset 0\\) holds bytes that a "
               "cp.async of thread 0 still writes");
}

__global__ void write_past_shared(int* out) {
  DATTN_DYNAMIC_SHARED(int, smem);
  smem[threadIdx.x] = 1;  // 40 ints into 32 ints' worth
  out[threadIdx.x] = 1;
}

TEST(EmulationDeath, WritePastSharedMemory) {
  DeviceBuffer out(40 * sizeof(int));
  EXPECT_DEATH(DATTN_LAUNCH(write_past_shared, 1, 40, 32 * sizeof(int), kStream, out.as<int>()),
               "wrote at shared offset 128, outside its 128 bytes of dynamic shared memory");
}

// ---------------------------------------------------------------- refused launches

bool g_ran = false;
__global__ void sets_ran() {
  g_ran = true;
}
__global__ void sets_ran_raised() {
  g_ran = true;
}
__global__ void sets_ran_optin() {
  g_ran = true;
}

// The pending error's code and message (cleared).
std::pair<cudaError_t, std::string> last_error() {
  const cudaError_t e = cudaPeekAtLastError();
  const std::string message = cudaGetErrorString(e);
  EXPECT_EQ(cudaGetLastError(), e);
  return {e, message};
}

TEST(EmulationLaunch, SharedMemoryAbove48KiBWithoutTheAttribute) {
  g_ran = false;
  DATTN_LAUNCH(sets_ran, 1, 32, 64 * 1024, kStream);
  EXPECT_FALSE(g_ran);
  const auto [e, message] = last_error();
  EXPECT_EQ(e, cudaErrorInvalidValue);
  EXPECT_NE(message.find("65536 bytes of dynamic shared memory, above this kernel's limit of "
                         "49152 bytes"),
            std::string::npos)
      << message;
  // What the kernels' launchers do after each launch: a dattn::Error naming it.
  DATTN_LAUNCH(sets_ran, 1, 32, 64 * 1024, kStream);
  try {
    DATTN_CUDA_CHECK(cudaGetLastError());
    ADD_FAILURE() << "no throw";
  } catch (const dattn::Error& err) {
    const std::string what = err.what();
    EXPECT_NE(what.find("sets_ran"), std::string::npos) << what;
    EXPECT_NE(what.find("65536"), std::string::npos) << what;
    EXPECT_NE(what.find("49152"), std::string::npos) << what;
  }
  EXPECT_FALSE(g_ran);
}

TEST(EmulationLaunch, SharedMemoryAbove48KiBWithTheAttributeRuns) {
  ASSERT_EQ(cudaFuncSetAttribute(reinterpret_cast<const void*>(sets_ran_raised),
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024),
            cudaSuccess);
  g_ran = false;
  DATTN_LAUNCH(sets_ran_raised, 1, 32, 64 * 1024, kStream);
  EXPECT_TRUE(g_ran);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(EmulationLaunch, SharedMemoryAboveTheDeviceOptIn) {
  int dev = 0;
  ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
  ASSERT_EQ(cudaFuncSetAttribute(reinterpret_cast<const void*>(sets_ran_optin),
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, 128 * 1024),
            cudaSuccess);
  dattn::emu::set_max_shared_optin(dev, 99 * 1024);
  g_ran = false;
  DATTN_LAUNCH(sets_ran_optin, 1, 32, 128 * 1024, kStream);
  dattn::emu::set_max_shared_optin(dev, 0);
  EXPECT_FALSE(g_ran);
  const auto [e, message] = last_error();
  EXPECT_EQ(e, cudaErrorInvalidConfiguration);
  EXPECT_NE(message.find("131072 bytes of dynamic shared memory, above device"), std::string::npos)
      << message;
  EXPECT_NE(message.find("101376"), std::string::npos) << message;
}

TEST(EmulationLaunch, BlockAndGridLimits) {
  struct Case {
    dim3 grid, block;
    const char* names;
  };
  for (const Case& c :
       {Case{dim3(1), dim3(1025), "1025 threads per block"},
        Case{dim3(1), dim3(0), "0 threads per block"}, Case{dim3(0), dim3(32), "gridDim (0, 1, 1)"},
        Case{dim3(1, 65536), dim3(32), "gridDim (1, 65536, 1)"},
        Case{dim3(1, 1, 65536), dim3(32), "gridDim (1, 1, 65536)"},
        Case{dim3(0x80000000u), dim3(32), "gridDim (2147483648, 1, 1)"}}) {
    g_ran = false;
    DATTN_LAUNCH(sets_ran, c.grid, c.block, 0, kStream);
    EXPECT_FALSE(g_ran) << c.names;
    const auto [e, message] = last_error();
    EXPECT_EQ(e, cudaErrorInvalidConfiguration) << c.names;
    EXPECT_NE(message.find(c.names), std::string::npos) << message;
  }
  // At the limits: runs.
  for (const Case& c : {Case{dim3(1), dim3(1024), "1024 threads, 48 KiB"},
                        Case{dim3(1, 65535, 1), dim3(1), "gridDim.y 65535"},
                        Case{dim3(1, 1, 65535), dim3(1), "gridDim.z 65535"}}) {
    g_ran = false;
    DATTN_LAUNCH(sets_ran, c.grid, c.block, 48 * 1024, kStream);
    EXPECT_TRUE(g_ran) << c.names;
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << c.names;
  }
}

// ---------------------------------------------------------------- deferred cp.async

// Each thread copies 16 bytes (thread 1: zero-fill) in two groups and records shared memory
// before any wait, after wait<1> (the first group done) and after wait<0>.
__global__ void deferred_copy(const unsigned char* src, unsigned char* out) {
  DATTN_DYNAMIC_SHARED(unsigned char, smem);
  const int t = int(threadIdx.x);
  unsigned char* a = smem + 32 * t;
  unsigned char* b = a + 16;
  unsigned char* o = out + 80 * t;
  cp_async_16(a, src + 32 * t, t != 1);
  cp_async_commit();
  cp_async_16(b, src + 32 * t + 16, true);
  cp_async_commit();
  std::memcpy(o, a, 16);
  cp_async_wait<1>();
  std::memcpy(o + 16, a, 16);
  std::memcpy(o + 32, b, 16);
  cp_async_wait<0>();
  std::memcpy(o + 48, b, 16);
  o[64] = 1;
}

TEST(EmulationCopy, DestinationPoisonedUntilTheWait) {
  constexpr int kThreads = 4;
  std::vector<unsigned char> data(kThreads * 32);
  for (size_t i = 0; i < data.size(); ++i)
    data[i] = static_cast<unsigned char>(i + 1);
  DeviceBuffer src(data.size()), out(kThreads * 80);
  ASSERT_EQ(cudaMemcpy(src.p, data.data(), data.size(), cudaMemcpyHostToDevice), cudaSuccess);
  DATTN_LAUNCH(deferred_copy, 1, kThreads, kThreads * 32, kStream, src.as<unsigned char>(),
               out.as<unsigned char>());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<unsigned char> got(kThreads * 80);
  ASSERT_EQ(cudaMemcpy(got.data(), out.p, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  const std::vector<unsigned char> poison(16, 0xff), zeros(16, 0);
  for (int t = 0; t < kThreads; ++t) {
    const unsigned char* o = got.data() + 80 * t;
    const auto bytes = [](const unsigned char* p) { return std::vector<unsigned char>(p, p + 16); };
    const std::vector<unsigned char> first(data.begin() + 32 * t, data.begin() + 32 * t + 16);
    const std::vector<unsigned char> second(data.begin() + 32 * t + 16, data.begin() + 32 * t + 32);
    ASSERT_EQ(o[64], 1) << "thread " << t;
    EXPECT_EQ(bytes(o), poison) << "thread " << t << ": before any wait";
    EXPECT_EQ(bytes(o + 16), t == 1 ? zeros : first) << "thread " << t << ": after wait<1>";
    EXPECT_EQ(bytes(o + 32), poison) << "thread " << t << ": the newest group, after wait<1>";
    EXPECT_EQ(bytes(o + 48), second) << "thread " << t << ": after wait<0>";
  }
}

// ---------------------------------------------------------------- seeded schedules

// Each thread appends its index to a list, before and after a barrier, and thread 0 of each block
// its block index to another: the orders the schedule ran them in.
__global__ void append_order(int* counts, int* threads, int* blocks) {
  threads[counts[0]++] = int(threadIdx.x);
  __syncthreads();
  threads[counts[0]++] = int(threadIdx.x);
  if (threadIdx.x == 0) blocks[counts[1]++] = int(blockIdx.x);
}

struct Orders {
  std::vector<int> threads, blocks;
  bool operator==(const Orders&) const = default;
};

constexpr int kOrderThreads = 64, kOrderBlocks = 16;

Orders run_orders(uint64_t seed) {
  const uint64_t saved = dattn::emu::seed();
  dattn::emu::set_seed(seed);
  DeviceBuffer counts(2 * sizeof(int)), threads(2 * kOrderThreads * kOrderBlocks * sizeof(int)),
      blocks(kOrderBlocks * sizeof(int));
  EXPECT_EQ(cudaMemset(counts.p, 0, 2 * sizeof(int)), cudaSuccess);
  DATTN_LAUNCH(append_order, kOrderBlocks, kOrderThreads, 0, kStream, counts.as<int>(),
               threads.as<int>(), blocks.as<int>());
  dattn::emu::set_seed(saved);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  Orders o;
  o.threads.resize(2 * kOrderThreads * kOrderBlocks);
  o.blocks.resize(kOrderBlocks);
  EXPECT_EQ(cudaMemcpy(o.threads.data(), threads.p, o.threads.size() * sizeof(int),
                       cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(
      cudaMemcpy(o.blocks.data(), blocks.p, o.blocks.size() * sizeof(int), cudaMemcpyDeviceToHost),
      cudaSuccess);
  return o;
}

// Whether v is, run after run of n, a permutation of 0..n-1.
bool runs_of_permutations(const std::vector<int>& v, int n) {
  for (size_t r = 0; r < v.size(); r += size_t(n)) {
    std::vector<int> run(v.begin() + std::ptrdiff_t(r), v.begin() + std::ptrdiff_t(r) + n);
    std::sort(run.begin(), run.end());
    for (int i = 0; i < n; ++i)
      if (run[size_t(i)] != i) return false;
  }
  return true;
}

TEST(EmulationSchedule, SeedsChangeTheOrderOfThreadsAndBlocks) {
  const Orders in_order = run_orders(0), a = run_orders(1), a_again = run_orders(1),
               b = run_orders(2);
  std::vector<int> identity(kOrderThreads), block_identity(kOrderBlocks);
  std::iota(identity.begin(), identity.end(), 0);
  std::iota(block_identity.begin(), block_identity.end(), 0);
  // Seed 0: every round in thread order, blocks in order.
  EXPECT_EQ(std::vector<int>(in_order.threads.begin(), in_order.threads.begin() + kOrderThreads),
            identity);
  EXPECT_EQ(in_order.blocks, block_identity);
  for (const Orders* o : {&in_order, &a, &b}) {
    EXPECT_TRUE(runs_of_permutations(o->threads, kOrderThreads));
    EXPECT_TRUE(runs_of_permutations(o->blocks, kOrderBlocks));
  }
  EXPECT_EQ(a, a_again);  // the same seed, the same schedule
  EXPECT_NE(a.threads, b.threads);
  EXPECT_NE(a.blocks, b.blocks);
  EXPECT_NE(a.threads, in_order.threads);
  // Each round is shuffled anew: the two halves of a block differ.
  EXPECT_NE(
      std::vector<int>(a.threads.begin(), a.threads.begin() + kOrderThreads),
      std::vector<int>(a.threads.begin() + kOrderThreads, a.threads.begin() + 2 * kOrderThreads));
}

}  // namespace
