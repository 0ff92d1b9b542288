// A CPU emulation of the CUDA features our kernels use (kernels/cuda), so that every CI run
// executes their logic although no CI machine has a GPU: fragment layouts, masks, the online
// softmax and the merge. Included first (-include) by the emulated build of the kernels' .cu
// files (tests/emu/CMakeLists.txt), which then compile as plain C++. It is meant to be as strict
// as the hardware: where a kernel would fault, hang or read garbage on a GPU, it fails here,
// naming the kernel, the call site in the kernel's source, the block, the thread and the address
// (emu::fail: a message on stderr, then abort).
//
// Each CUDA thread of a block is a fiber on one host thread, run until it reaches a
// synchronisation point: __syncthreads, or a warp-collective instruction. The fibers are
// Boost.Context's (a switch saves a few registers, with no system call, unlike ucontext's
// swapcontext, which saves the signal mask), on stacks the launch allocates once. The warp
// collectives are emulated from their PTX ISA definitions ("Matrix Fragments for
// mma.m16n8k16", "ldmatrix", "shfl.sync"): each lane puts its operands in a slot, the warp
// meets, and each lane computes its own results from every lane's slots.
//
// What it checks:
//  - Launches (DATTN_LAUNCH), as the runtime does: a block of 0 or more than 1024 threads, a grid
//    dimension of 0, grid.x above 2^31 - 1 or grid.y/z above 65535 are refused with
//    cudaErrorInvalidConfiguration; dynamic shared memory above the device's opt-in limit
//    (cudaDevAttrMaxSharedMemoryPerBlockOptin) too, and above the kernel's own limit (48 KiB
//    unless cudaFuncSetAttribute raised it) with cudaErrorInvalidValue, which is what the driver
//    returns then. A refused kernel does not run; the error, with a message naming the limit and
//    the value, is what the next cudaGetLastError returns (fake_runtime.h).
//  - cp.async is asynchronous: cp_async_16 records the copy in its thread's open group and fills
//    the destination with 0xff bytes (NaN in 16 and 32 bits); cp_async_wait<N> does the copies of
//    all but the newest N committed groups (reading the source then is one legal schedule), the
//    zero-filling ones writing their 16 zero bytes then, as the hardware does. A thread that
//    returns with copies not waited for fails; so do an ldmatrix of bytes a copy in flight still
//    writes, and two copies in flight to the same 16 bytes. Both addresses must be 16-byte
//    aligned, the destination inside the block's dynamic shared memory, and a valid source inside
//    one live device allocation of the fake runtime.
//  - ldmatrix: each lane's row address 16-byte aligned, its 16 bytes inside the dynamic shared
//    memory. A write up to 64 bytes past either end of the dynamic shared memory (into guard
//    bytes) fails when the block ends.
//  - Barriers: every __syncthreads is reached by all live threads of the block from the same call
//    site, and every warp collective (shfl, mma, ldmatrix, __syncwarp) by all live lanes of the
//    warp from the same site (the site: a std::source_location default argument, evaluated at
//    the caller). Threads that returned count as arrived at __syncthreads and __syncwarp, as on
//    the hardware since Volta; but mma and ldmatrix need all 32 lanes, and a shuffle must not
//    read a lane that has returned. Threads that all wait and can never meet (a barrier one
//    thread skips) fail as a deadlock, naming where each waits.
//  - Schedules: DATTN_EMU_SEED (unset or 0: every round resumes the runnable threads in order,
//    the blocks in order) makes the order in which the runnable fibers are resumed between sync
//    points a seeded pseudo-random permutation each round, and the block order a seeded one, so
//    that a kernel whose result depends on the order of its threads differs between seeds.
// Dynamic shared memory starts as 0xff bytes, so that a read of an element no thread wrote shows
// in the results.
//
// What it cannot find: data races on plain loads and stores as such (a fiber runs to its next
// sync point alone, one legal schedule of many; seeds try other orders of the fibers, but
// threads never interleave between sync points, so a race or a missing barrier shows only where
// it changes a result under some order), plain reads of bytes a cp.async still writes (they see
// the poison, which shows only if it reaches the results), out-of-bounds plain accesses to
// global memory, reads past the end of shared memory and writes further past it than the guard
// bytes (the kernels' raw pointers are not checked), bank conflicts, registers,
// __launch_bounds__ (ignored), timing, and the tensor cores' internal accumulation order (fp32
// sums in k order here). Only 1-D blocks and full-warp masks are emulated; anything else fails
// as not emulated.
#pragma once

#define DATTN_CUDA_EMULATION 1

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <boost/context/fiber.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <source_location>
#include <string>
#include <type_traits>
#include <vector>

#include "fake_runtime.h"

// The CUDA keywords the kernels use, as nothing (or their C++ meaning) on the host.
#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __forceinline__
#define __forceinline__ inline
#undef __launch_bounds__
#define __launch_bounds__(...)

namespace dattn::emu {

// ---------------------------------------------------------------- sites and the schedule

inline bool same_site(const std::source_location& a, const std::source_location& b) {
  return a.line() == b.line() && a.column() == b.column() &&
         (a.file_name() == b.file_name() || std::strcmp(a.file_name(), b.file_name()) == 0);
}
inline std::string site_name(const std::source_location& s) {
  return std::string(s.file_name()) + ":" + std::to_string(s.line()) + ":" +
         std::to_string(s.column());
}
inline std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "cuda emulation: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

// Fails with `message` (a std::string expression, built only then) unless cond holds. The
// message is built in a cold function of its own (fail_with), so that the checks on the
// emulation's hot paths cost a comparison and leave those paths small enough to inline.
template <typename Message>
[[noreturn, gnu::cold, gnu::noinline]] void fail_with(const Message& message) {
  fail(message());
}
#define DATTN_EMU_CHECK(cond, message)                               \
  do {                                                               \
    if (!(cond)) ::dattn::emu::fail_with([&] { return (message); }); \
  } while (0)

// The seed of the schedule (DATTN_EMU_SEED; 0: in order) and its pseudo-random state
// (splitmix64), advanced by every seeded launch: a program that launches the same kernels gets
// the same schedules again.
struct Schedule {
  uint64_t seed = 0, state = 0;
};
inline Schedule& schedule() {
  static Schedule s = [] {
    Schedule r;
    const char* e = std::getenv("DATTN_EMU_SEED");
    if (e != nullptr && *e != '\0') {
      char* end = nullptr;
      r.seed = std::strtoull(e, &end, 0);
      if (*end != '\0') fail(std::string("DATTN_EMU_SEED=") + e + ": not an unsigned integer");
    }
    r.state = r.seed;
    return r;
  }();
  return s;
}
inline uint64_t seed() {
  return schedule().seed;
}
// For tests of the emulation: another seed from here on (0: in order), its sequence restarted.
inline void set_seed(uint64_t s) {
  schedule() = Schedule{s, s};
}
inline uint64_t random_u64() {
  uint64_t z = (schedule().state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// ---------------------------------------------------------------- the block being run

// A cp.async issued and not yet complete.
struct AsyncCopy {
  unsigned char* dst;
  const void* src;
  bool valid;
  std::source_location site;
};

enum Waiting : uint8_t { kRunnable, kAtBlockBarrier, kAtWarpBarrier };

struct Fiber {
  boost::context::fiber self;  // this thread, while suspended
  std::unique_ptr<char[]> stack;
  bool done = false;
  Waiting waiting = kRunnable;  // at a barrier: until its generation is past wait_generation
  uint64_t wait_generation = 0;
  const char* wait_what = nullptr;  // where it waits, for a deadlock's message
  std::source_location wait_site;
  uint64_t collectives = 0;        // warp collectives this lane has entered (their slot parity)
  std::vector<AsyncCopy> copies;   // oldest first
  std::vector<size_t> group_ends;  // committed groups, oldest first: the end of each in copies
};

struct Warp {
  int alive = 0, arrived = 0;
  uint64_t generation = 0;
  const char* what = nullptr;  // the collective the arrived lanes wait at, and its site
  std::source_location site;
  uint32_t lanes[2] = {};        // [parity] the lanes that entered that collective
  uint32_t slot[2][32][8] = {};  // [parity][lane][payload words]
};

struct Block {
  const char* kernel = "";
  std::source_location launched;
  dim3 grid, block, index;
  int threads = 0, alive = 0, current = 0;
  int arrived = 0;  // at __syncthreads, whose site the first arrival sets
  uint64_t generation = 0;
  std::source_location site;
  std::vector<unsigned char> smem;  // guard bytes, the dynamic shared memory, guard bytes
  unsigned char* shared = nullptr;  // the dynamic shared memory, 16-byte aligned
  size_t shared_bytes = 0;
  std::vector<uint16_t> in_flight;  // per 16 bytes of it: 1 + the thread whose cp.async writes them
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  boost::context::fiber scheduler;  // the launch loop, while a thread runs
  const std::function<void()>* body = nullptr;
};

inline Block*& block() {
  static Block* b = nullptr;
  return b;
}

inline int thread_rank() {
  return block()->current;
}

// The kernel, the block and the thread running, for messages.
inline std::string here() {
  const Block& b = *block();
  const int t = b.current;
  std::string s = "kernel " + std::string(b.kernel) + " (launched in " +
                  b.launched.function_name() + " at " + site_name(b.launched) + "), block (" +
                  std::to_string(b.index.x) + "," + std::to_string(b.index.y) + "," +
                  std::to_string(b.index.z) + "), thread " + std::to_string(t) + " (warp " +
                  std::to_string(t / 32) + ", lane " + std::to_string(t % 32) + ")";
  if (seed() != 0) s += ", DATTN_EMU_SEED=" + std::to_string(seed());
  return s;
}

// Back to the scheduler; returns when this fiber is resumed.
inline void yield() {
  Block& b = *block();
  b.scheduler = std::move(b.scheduler).resume();
}

// __syncthreads: all live threads of the block, from one site. A thread that has returned counts
// as arrived, as on the hardware.
inline void block_barrier(const std::source_location& site) {
  Block& b = *block();
  if (b.arrived == 0) b.site = site;
  DATTN_EMU_CHECK(same_site(b.site, site),
                  "__syncthreads at " + site_name(site) + " while other threads of the block " +
                      "wait at the __syncthreads at " + site_name(b.site) +
                      ": every live thread must reach the same one; " + here());
  const uint64_t gen = b.generation;
  if (++b.arrived == b.alive) {
    b.arrived = 0;
    ++b.generation;
    return;
  }
  Fiber& f = b.fibers[size_t(b.current)];
  f.waiting = kAtBlockBarrier;
  f.wait_generation = gen;
  f.wait_what = "__syncthreads";
  f.wait_site = site;
  while (b.generation == gen)
    yield();
  f.waiting = kRunnable;
}

// What a warp collective sees once its warp has met: every lane's slot ([lane][word]) and the
// lanes that entered it.
struct Met {
  const uint32_t (*slot)[8];
  uint32_t lanes;
};

// A warp collective `what` at `site`: this lane's n payload words into its slot, the live lanes
// of the warp meet (all from the same site). Two slot sets alternate: a lane can be at most one
// collective ahead of another (the next one waits for all), so a slot is never overwritten while
// a lane still reads it.
inline Met exchange(const char* what, const std::source_location& site, const uint32_t* words,
                    int n) {
  Block& b = *block();
  Fiber& f = b.fibers[size_t(b.current)];
  Warp& w = b.warps[size_t(b.current / 32)];
  const int parity = int(f.collectives++ & 1), lane = b.current % 32;
  if (w.arrived == 0) {
    w.what = what;
    w.site = site;
    w.lanes[parity] = 0;
  }
  DATTN_EMU_CHECK(same_site(w.site, site),
                  std::string(what) + " at " + site_name(site) +
                      " while other lanes of the warp wait at " + w.what + " at " +
                      site_name(w.site) +
                      ": every live lane must reach the same warp collective; " + here());
  w.lanes[parity] |= 1u << lane;
  if (n > 0) std::memcpy(w.slot[parity][lane], words, size_t(n) * sizeof(uint32_t));
  const uint64_t gen = w.generation;
  if (++w.arrived == w.alive) {
    w.arrived = 0;
    ++w.generation;
  } else {
    f.waiting = kAtWarpBarrier;
    f.wait_generation = gen;
    f.wait_what = what;
    f.wait_site = site;
    while (w.generation == gen)
      yield();
    f.waiting = kRunnable;
  }
  return {w.slot[parity], w.lanes[parity]};
}

// The lanes a warp collective missed, as "3,4,31".
inline std::string missing_lanes(uint32_t lanes) {
  std::string s;
  for (int l = 0; l < 32; ++l) {
    if ((lanes >> l) & 1) continue;
    if (!s.empty()) s += ",";
    s += std::to_string(l);
  }
  return s;
}
// mma.sync and ldmatrix are .aligned: every lane of the warp executes them.
inline void need_full_warp(const Met& m, const char* what, const std::source_location& site) {
  DATTN_EMU_CHECK(m.lanes == 0xffffffffu, std::string(what) + " at " + site_name(site) +
                                              " needs all 32 lanes of the warp; lanes " +
                                              missing_lanes(m.lanes) +
                                              " have returned or do not exist; " + here());
}

// The mask and width the emulation knows: the full warp.
inline void need_full_mask(unsigned mask, int width, const char* what,
                           const std::source_location& site) {
  DATTN_EMU_CHECK(mask == 0xffffffffu && width == 32,
                  std::string(what) + " at " + site_name(site) + " with mask " +
                      std::to_string(mask) + ", width " + std::to_string(width) +
                      ": only full-warp masks and width 32 are emulated; " + here());
}

inline void check_shared_16(const void* p, const char* what, const char* role,
                            const std::source_location& site) {
  const Block& b = *block();
  const uintptr_t a = reinterpret_cast<uintptr_t>(p), base = reinterpret_cast<uintptr_t>(b.shared);
  DATTN_EMU_CHECK(a % 16 == 0, std::string(what) + " at " + site_name(site) + ": " + role + " " +
                                   hex(p) + " is not 16-byte aligned; " + here());
  DATTN_EMU_CHECK(a >= base && a - base <= b.shared_bytes && b.shared_bytes - (a - base) >= 16,
                  std::string(what) + " at " + site_name(site) + ": " + role + " " + hex(p) +
                      " (shared offset " + std::to_string(int64_t(a - base)) +
                      "): its 16 bytes are not inside the block's " +
                      std::to_string(b.shared_bytes) + " bytes of dynamic shared memory; " +
                      here());
}

// The copies of this thread's oldest committed groups, all but the newest `keep`.
inline void complete_copies(size_t keep) {
  Block& b = *block();
  Fiber& f = b.fibers[size_t(b.current)];
  if (f.group_ends.size() <= keep) return;
  const size_t groups = f.group_ends.size() - keep, end = f.group_ends[groups - 1];
  for (size_t i = 0; i < end; ++i) {
    const AsyncCopy& c = f.copies[i];
    if (c.valid)
      std::memcpy(c.dst, c.src, 16);
    else
      std::memset(c.dst, 0, 16);
    b.in_flight[size_t(c.dst - b.shared) / 16] = 0;
  }
  f.copies.erase(f.copies.begin(), f.copies.begin() + std::ptrdiff_t(end));
  f.group_ends.erase(f.group_ends.begin(), f.group_ends.begin() + std::ptrdiff_t(groups));
  for (size_t& e : f.group_ends)
    e -= end;
}

inline void fiber_main() {
  Block& b = *block();
  (*b.body)();
  Fiber& f = b.fibers[size_t(b.current)];
  if (!f.copies.empty()) {
    const size_t committed = f.group_ends.empty() ? 0 : f.group_ends.back();
    fail("the thread returned with " + std::to_string(f.copies.size()) +
         " cp.async copies not waited for (" + std::to_string(committed) + " committed, " +
         std::to_string(f.copies.size() - committed) + " not; the oldest issued at " +
         site_name(f.copies.front().site) + "): cp.async.wait_group them before returning; " +
         here());
  }
  f.done = true;
  b.alive -= 1;
  Warp& w = b.warps[size_t(b.current / 32)];
  w.alive -= 1;
  // Those waiting for this thread at a barrier now wait for one fewer.
  if (b.arrived > 0 && b.arrived == b.alive) {
    b.arrived = 0;
    ++b.generation;
  }
  if (w.arrived > 0 && w.arrived == w.alive) {
    w.arrived = 0;
    ++w.generation;
  }
}

// Gives a fiber the stack its thread owns for the whole launch, so that starting a block's
// threads allocates nothing (Boost.Context's StackAllocator concept).
struct ThreadStack {
  char* base;
  size_t size;
  boost::context::stack_context allocate() {
    boost::context::stack_context s;
    s.size = size;
    s.sp = base + size;  // stacks grow down from the top
    return s;
  }
  void deallocate(boost::context::stack_context&) noexcept {}
};

// A fiber that runs its thread once resumed, then returns to the scheduler for good.
inline void start_fiber(Fiber& f, size_t stack_bytes) {
  f.self = boost::context::fiber(std::allocator_arg, ThreadStack{f.stack.get(), stack_bytes},
                                 [](boost::context::fiber&& scheduler) {
                                   block()->scheduler = std::move(scheduler);
                                   fiber_main();
                                   return std::move(block()->scheduler);
                                 });
}
inline void resume_fiber(Block& b, int t) {
  b.current = t;
  Fiber& f = b.fibers[size_t(t)];
  f.self = std::move(f.self).resume();
}

inline bool runnable(const Block& b, int t) {
  const Fiber& f = b.fibers[size_t(t)];
  if (f.done) return false;
  if (f.waiting == kAtBlockBarrier) return b.generation != f.wait_generation;
  if (f.waiting == kAtWarpBarrier) return b.warps[size_t(t / 32)].generation != f.wait_generation;
  return true;
}

// Every live thread waits at a barrier that cannot complete: where each waits.
[[noreturn]] inline void deadlock(Block& b) {
  std::map<std::string, std::pair<int, int>> sites;  // "what at site" -> (threads, first thread)
  for (int t = 0; t < b.threads; ++t) {
    const Fiber& f = b.fibers[size_t(t)];
    if (f.done) continue;
    auto [it, fresh] =
        sites.try_emplace(std::string(f.wait_what) + " at " + site_name(f.wait_site), 0, t);
    it->second.first += 1;
    (void)fresh;
  }
  std::string what;
  for (const auto& [where, n] : sites)
    what += "\n  " + std::to_string(n.first) + " thread(s), the first " + std::to_string(n.second) +
            ", wait at " + where;
  b.current = sites.begin()->second.second;
  fail(
      "deadlock: the live threads wait at barriers that can never complete (a barrier or warp "
      "collective that some live thread does not reach):" +
      what + "\n  " + here());
}

// The guard bytes around the dynamic shared memory (a write past either end changes them).
constexpr size_t kGuardBytes = 64;
constexpr unsigned char kGuardByte = 0xa5;

inline void check_guards(const Block& b) {
  const unsigned char* const begin = b.smem.data();
  const unsigned char* const end = begin + b.smem.size();
  const unsigned char* const top = b.shared + b.shared_bytes;
  for (const unsigned char* p = begin; p < end; ++p) {
    if (p == b.shared) p = top;  // skip the shared memory itself
    if (p == end) break;
    if (*p != kGuardByte)
      fail("a thread of the block wrote at shared offset " + std::to_string(p - b.shared) +
           ", outside its " + std::to_string(b.shared_bytes) +
           " bytes of dynamic shared memory; kernel " + b.kernel + " (launched at " +
           site_name(b.launched) + "), block (" + std::to_string(b.index.x) + "," +
           std::to_string(b.index.y) + "," + std::to_string(b.index.z) + ")");
  }
}

// Runs one block: its threads from their start until all have returned. Each round resumes every
// runnable thread once, in order (or in a seeded order); a round that can resume none is a
// deadlock.
inline void run_block(Block& b, size_t stack_bytes, std::vector<int>& order) {
  const int n = b.threads;
  std::fill(b.smem.begin(), b.smem.end(), kGuardByte);
  std::memset(b.shared, 0xff, b.shared_bytes);
  std::fill(b.in_flight.begin(), b.in_flight.end(), uint16_t(0));
  b.alive = n;
  b.arrived = 0;
  b.warps.assign(size_t((n + 31) / 32), Warp{});
  for (int w = 0; w < (n + 31) / 32; ++w)
    b.warps[size_t(w)].alive = std::min(32, n - 32 * w);
  for (int t = 0; t < n; ++t) {
    Fiber& f = b.fibers[size_t(t)];
    f.done = false;
    f.waiting = kRunnable;
    f.collectives = 0;
    f.copies.clear();
    f.group_ends.clear();
    start_fiber(f, stack_bytes);
  }
  const bool shuffle = seed() != 0;
  while (b.alive > 0) {
    if (shuffle)
      for (int i = n - 1; i > 0; --i)
        std::swap(order[size_t(i)], order[size_t(random_u64() % uint64_t(i + 1))]);
    bool ran = false;
    for (int i = 0; i < n; ++i) {
      const int t = shuffle ? order[size_t(i)] : i;
      if (!runnable(b, t)) continue;
      ran = true;
      resume_fiber(b, t);
    }
    if (!ran) deadlock(b);
  }
  check_guards(b);
}

// Runs body as every thread of every block of the grid, one block after the other (blocks
// never talk to each other: the order is free), smem_bytes of dynamic shared memory per block;
// or refuses the launch as the runtime would (the error for the next cudaGetLastError) and runs
// nothing.
inline void launch(const char* name, std::source_location launched, const void* kernel, dim3 grid,
                   dim3 threads, size_t smem_bytes, const std::function<void()>& body) {
  const auto refuse = [&](cudaError_t error, const std::string& why) {
    set_last_error(error, "launch of " + std::string(name) + " at " + site_name(launched) + ": " +
                              why + " (emulated launch)");
  };
  const auto dims = [](const char* what, dim3 d) {
    return std::string(what) + " (" + std::to_string(d.x) + ", " + std::to_string(d.y) + ", " +
           std::to_string(d.z) + ")";
  };
  const uint64_t n64 = uint64_t(threads.x) * threads.y * threads.z;
  if (n64 == 0 || n64 > 1024 || threads.x > 1024 || threads.y > 1024 || threads.z > 64)
    return refuse(cudaErrorInvalidConfiguration,
                  dims("blockDim", threads) + ": " + std::to_string(n64) +
                      " threads per block, where 1 to 1024 are allowed (x, y at most 1024, z at "
                      "most 64; cudaDevAttrMaxThreadsPerBlock)");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 ||
      grid.z > 65535)
    return refuse(cudaErrorInvalidConfiguration,
                  dims("gridDim", grid) + ": each dimension must be at least 1, x at most " +
                      "2147483647, y and z at most 65535");
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) device = 0;
  const int optin = max_shared_optin(device), limit = max_dynamic_shared(kernel);
  // The runtime's documentation: more shared memory than the device supports is an invalid
  // configuration. Above the kernel's own limit the driver answers CUDA_ERROR_INVALID_VALUE.
  if (smem_bytes > size_t(optin))
    return refuse(cudaErrorInvalidConfiguration,
                  std::to_string(smem_bytes) + " bytes of dynamic shared memory, above device " +
                      std::to_string(device) + "'s limit of " + std::to_string(optin) +
                      " bytes per block (cudaDevAttrMaxSharedMemoryPerBlockOptin)");
  if (smem_bytes > size_t(limit))
    return refuse(cudaErrorInvalidValue,
                  std::to_string(smem_bytes) +
                      " bytes of dynamic shared memory, above this kernel's limit of " +
                      std::to_string(limit) +
                      " bytes (48 KiB unless cudaFuncSetAttribute("
                      "cudaFuncAttributeMaxDynamicSharedMemorySize) raises it)");
  if (threads.y != 1 || threads.z != 1)
    fail("launch of " + std::string(name) + " at " + site_name(launched) + ": " +
         dims("blockDim", threads) + ": only 1-D blocks are emulated");

  constexpr size_t kStack = 256 * 1024;
  const int n = int(threads.x);
  Block b;
  b.kernel = name;
  b.launched = launched;
  b.grid = grid;
  b.block = threads;
  b.threads = n;
  b.body = &body;
  b.fibers.resize(size_t(n));
  for (Fiber& f : b.fibers)
    f.stack.reset(new char[kStack]);
  b.smem.resize(kGuardBytes + 16 + smem_bytes + kGuardBytes);
  const uintptr_t p = reinterpret_cast<uintptr_t>(b.smem.data()) + kGuardBytes;
  b.shared = b.smem.data() + ((p + 15) / 16 * 16 - reinterpret_cast<uintptr_t>(b.smem.data()));
  b.shared_bytes = smem_bytes;
  b.in_flight.resize(smem_bytes / 16 + 1);
  std::vector<int> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);

  // The blocks in order, or in a seeded one: block i runs as block (mul i + add) mod total,
  // a permutation of the grid when mul is coprime with total.
  const uint64_t total = uint64_t(grid.x) * grid.y * grid.z;
  uint64_t mul = 1, add = 0;
  if (seed() != 0 && total > 1) {
    add = random_u64() % total;
    do
      mul = 1 + random_u64() % (total - 1);
    while (std::gcd(mul, total) != 1);
  }
  Block* saved = block();
  block() = &b;
  for (uint64_t i = 0; i < total; ++i) {
    const uint64_t k = uint64_t((unsigned __int128)(mul)*i % total + add) % total;
    b.index =
        dim3(unsigned(k % grid.x), unsigned(k / grid.x % grid.y), unsigned(k / grid.x / grid.y));
    run_block(b, kStack, order);
  }
  block() = saved;
}

inline unsigned char* dynamic_shared() {
  return block()->shared;
}

inline dim3 thread_index() {
  return dim3(unsigned(thread_rank()), 0, 0);
}
inline dim3 block_index() {
  return block()->index;
}
inline dim3 grid_dim() {
  return block()->grid;
}
inline dim3 block_dim() {
  return block()->block;
}

}  // namespace dattn::emu

// ---------------------------------------------------------------- what kernels call

#define threadIdx (::dattn::emu::thread_index())
#define blockIdx (::dattn::emu::block_index())
#define gridDim (::dattn::emu::grid_dim())
#define blockDim (::dattn::emu::block_dim())

// kernel: a __global__ function or a variable holding one (its address is what
// cudaFuncSetAttribute raised the shared-memory limit of).
// The launch counts an operation on its stream (fake_runtime.h: StreamStats).
#define DATTN_LAUNCH(kernel, grid, block, smem_bytes, stream, ...)                      \
  (::dattn::emu::record_stream_op(static_cast<const void*>(stream)),                    \
   ::dattn::emu::launch(#kernel, std::source_location::current(),                       \
                        reinterpret_cast<const void*>(kernel), dim3(grid), dim3(block), \
                        (smem_bytes), [&] { kernel(__VA_ARGS__); }))
#define DATTN_DYNAMIC_SHARED(type, name) \
  type* name = reinterpret_cast<type*>(::dattn::emu::dynamic_shared())

inline void __syncthreads(std::source_location site = std::source_location::current()) {
  ::dattn::emu::block_barrier(site);
}
inline void __syncwarp(unsigned mask = 0xffffffffu,
                       std::source_location site = std::source_location::current()) {
  ::dattn::emu::need_full_mask(mask, 32, "__syncwarp", site);
  (void)::dattn::emu::exchange("__syncwarp", site, nullptr, 0);
}

namespace dattn::emu {
// shfl.sync: the value of lane src (a lane outside the warp: this lane's own, as the hardware
// gives), which must have entered this shuffle.
inline float shuffle(const char* what, float v, int src, const std::source_location& site) {
  uint32_t w;
  std::memcpy(&w, &v, 4);
  const Met m = exchange(what, site, &w, 1);
  const int lane = thread_rank() % 32;
  if (src < 0 || src >= 32) src = lane;
  DATTN_EMU_CHECK((m.lanes >> src) & 1,
                  std::string(what) + " at " + site_name(site) + " reads lane " +
                      std::to_string(src) +
                      ", which has returned or does not exist (an undefined value); " + here());
  float r;
  std::memcpy(&r, &m.slot[src][0], 4);
  return r;
}
}  // namespace dattn::emu

// shfl.sync.bfly: the value of lane (this lane ^ lane_mask).
inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask, int width = 32,
                             std::source_location site = std::source_location::current()) {
  ::dattn::emu::need_full_mask(mask, width, "__shfl_xor_sync", site);
  return ::dattn::emu::shuffle("__shfl_xor_sync", v, (::dattn::emu::thread_rank() % 32) ^ lane_mask,
                               site);
}
// shfl.sync.idx: the value of lane src_lane.
inline float __shfl_sync(unsigned mask, float v, int src_lane, int width = 32,
                         std::source_location site = std::source_location::current()) {
  ::dattn::emu::need_full_mask(mask, width, "__shfl_sync", site);
  return ::dattn::emu::shuffle("__shfl_sync", v, src_lane & 31, site);
}
// Fibers never run at the same time: a read-modify-write is atomic.
inline unsigned long long atomicOr(unsigned long long* address, unsigned long long value) {
  const unsigned long long old = *address;
  *address = old | value;
  return old;
}
// The device-side min and max of 64-bit integers the kernels call unqualified.
inline int64_t min(int64_t a, int64_t b) {
  return a < b ? a : b;
}
inline int64_t max(int64_t a, int64_t b) {
  return a > b ? a : b;
}

namespace dattn::cuda::detail {

// The PTX wrappers of kernels/cuda/flash_fwd.cuh, emulated from the same fragment definitions
// (lane = 4 g + t):
//   A (16x16, row): reg0 (g, 2t..2t+1), reg1 (g+8, 2t..), reg2 (g, 8+2t..), reg3 (g+8, 8+2t..)
//   B (16x8, col):  reg0 (k = 2t..2t+1, n = g), reg1 (k = 8+2t.., n = g)
//   C (16x8, f32):  c0, c1 (g, 2t..2t+1), c2, c3 (g+8, 2t..2t+1)
// with the lower index of every 16-bit pair in the low half of its register. Each takes the site
// of its caller (the kernel's line) as a defaulted last argument, for the checks' messages.

// The fp16 -> fp32 conversion of cuda_fp16.h, looked up: its host version works bit by bit.
inline float half_value(uint16_t bits) {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    for (uint32_t i = 0; i < 65536; ++i) {
      __half_raw raw;
      raw.x = uint16_t(i);
      t[i] = __half2float(__half(raw));
    }
    return t;
  }();
  return table[bits];
}

template <typename T>
inline float emu_value(uint32_t reg, int half) {
  const uint16_t bits = uint16_t(reg >> (16 * half));
  if constexpr (std::is_same_v<T, __half>) {
    return half_value(bits);
  } else {
    const uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
}

// This lane's rows g and g + 8 of A and columns 2t and 2t + 1 of B, converted once; each of its
// four results is then summed in k order, as one lane of the instruction would.
template <typename T>
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                      std::source_location site = std::source_location::current()) {
  const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
  const ::dattn::emu::Met m = ::dattn::emu::exchange("mma.sync.m16n8k16", site, mine, 6);
  ::dattn::emu::need_full_warp(m, "mma.sync.m16n8k16", site);
  const auto s = m.slot;
  const int lane = ::dattn::emu::thread_rank() % 32, g = lane >> 2, t = lane & 3;
  float rows[2][16], cols[2][16];
  for (int k = 0; k < 16; ++k) {
    const int a_lane = 4 * g + (k % 8) / 2, hi = k >= 8 ? 1 : 0;
    for (int h = 0; h < 2; ++h) {
      rows[h][k] = emu_value<T>(s[a_lane][h + 2 * hi], k & 1);
      cols[h][k] = emu_value<T>(s[4 * (2 * t + h) + (k % 8) / 2][4 + hi], k & 1);
    }
  }
  float sum[4] = {0.f, 0.f, 0.f, 0.f};  // (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)
  for (int k = 0; k < 16; ++k)
    for (int i = 0; i < 4; ++i)
      sum[i] += rows[i / 2][k] * cols[i % 2][k];
  for (int i = 0; i < 4; ++i)
    d[i] += sum[i];
}

// ldmatrix .x4: lanes 8i..8i+7 give the row addresses of 8x8 matrix i; register i of lane l gets
// matrix i's (row l/4, cols 2(l%4), 2(l%4)+1), or with .trans (rows 2(l%4), 2(l%4)+1, col l/4).
// Each lane's row: 16 aligned bytes of the dynamic shared memory that no cp.async still writes.
inline void emu_ldmatrix(uint32_t (&r)[4], const void* p, bool trans,
                         const std::source_location& site) {
  namespace emu = ::dattn::emu;
  const char* what = trans ? "ldmatrix.x4.trans" : "ldmatrix.x4";
  emu::check_shared_16(p, what, "row address", site);
  const emu::Block& blk = *emu::block();
  const size_t chunk = size_t(static_cast<const unsigned char*>(p) - blk.shared) / 16;
  DATTN_EMU_CHECK(
      blk.in_flight[chunk] == 0,
      std::string(what) + " at " + emu::site_name(site) + ": row address " + emu::hex(p) +
          " (shared offset " + std::to_string(chunk * 16) + ") holds bytes that a cp.async of " +
          "thread " + std::to_string(blk.in_flight[chunk] - 1) +
          " still writes (not waited for, or no barrier after the wait); " + emu::here());
  uint32_t words[2];
  std::memcpy(words, &p, sizeof p);
  const emu::Met m = emu::exchange(what, site, words, 2);
  emu::need_full_warp(m, what, site);
  const int lane = emu::thread_rank() % 32;
  auto row = [&](int matrix, int j) {
    const uint16_t* q;
    std::memcpy(&q, m.slot[8 * matrix + j], sizeof q);
    return q;
  };
  for (int i = 0; i < 4; ++i) {
    uint16_t lo, hi;
    if (!trans) {
      lo = row(i, lane / 4)[2 * (lane % 4)];
      hi = row(i, lane / 4)[2 * (lane % 4) + 1];
    } else {
      lo = row(i, 2 * (lane % 4))[lane / 4];
      hi = row(i, 2 * (lane % 4) + 1)[lane / 4];
    }
    r[i] = uint32_t(lo) | (uint32_t(hi) << 16);
  }
}
inline void ldmatrix_x4(uint32_t (&r)[4], const void* p,
                        std::source_location site = std::source_location::current()) {
  emu_ldmatrix(r, p, false, site);
}
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p,
                              std::source_location site = std::source_location::current()) {
  emu_ldmatrix(r, p, true, site);
}

// cp.async 16 bytes (16 zero bytes when not valid), deferred: recorded in this thread's open
// group, the destination poisoned until a cp_async_wait completes it.
inline void cp_async_16(void* dst, const void* src, bool valid,
                        std::source_location site = std::source_location::current()) {
  namespace emu = ::dattn::emu;
  emu::check_shared_16(dst, "cp.async", "dst", site);
  DATTN_EMU_CHECK(reinterpret_cast<uintptr_t>(src) % 16 == 0,
                  "cp.async at " + emu::site_name(site) + ": src " + emu::hex(src) +
                      " is not 16-byte aligned; " + emu::here());
  DATTN_EMU_CHECK(!valid || emu::is_device_range(src, 16),
                  "cp.async at " + emu::site_name(site) + ": src " + emu::describe_pointer(src) +
                      ": its 16 bytes are not inside one device allocation; " + emu::here());
  emu::Block& b = *emu::block();
  unsigned char* d = static_cast<unsigned char*>(dst);
  uint16_t& owner = b.in_flight[size_t(d - b.shared) / 16];
  DATTN_EMU_CHECK(owner == 0, "cp.async at " + emu::site_name(site) + ": dst " + emu::hex(dst) +
                                  " (shared offset " + std::to_string(d - b.shared) +
                                  ") is the destination of a cp.async of thread " +
                                  std::to_string(owner - 1) +
                                  " still in flight (two asynchronous writes of the same bytes); " +
                                  emu::here());
  owner = uint16_t(b.current + 1);
  std::memset(d, 0xff, 16);
  b.fibers[size_t(b.current)].copies.push_back({d, src, valid, site});
}
inline void cp_async_commit() {
  ::dattn::emu::Block& b = *::dattn::emu::block();
  ::dattn::emu::Fiber& f = b.fibers[size_t(b.current)];
  f.group_ends.push_back(f.copies.size());
}
template <int kPending>
inline void cp_async_wait() {
  static_assert(kPending >= 0, "cp.async.wait_group takes a count of groups");
  ::dattn::emu::complete_copies(size_t(kPending));
}

}  // namespace dattn::cuda::detail
