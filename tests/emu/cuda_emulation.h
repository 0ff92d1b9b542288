// A CPU emulation of the CUDA features our kernels use (kernels/cuda), so that every CI run
// executes their logic although no CI machine has a GPU: fragment layouts, masks, the online
// softmax and the merge. Included first (-include) by the emulated build of the kernels' .cu
// files (tests/emu/CMakeLists.txt), which then compile as plain C++.
//
// Each CUDA thread of a block is a fiber on one host thread, run round-robin until it reaches a
// synchronisation point: __syncthreads, or a warp-collective instruction. The fibers are
// Boost.Context's (a switch saves a few registers, with no system call, unlike ucontext's
// swapcontext, which saves the signal mask), on stacks the launch allocates once. The warp
// collectives are emulated from their PTX ISA definitions ("Matrix Fragments for
// mma.m16n8k16", "ldmatrix", "shfl.sync"): each lane puts its operands in a slot, the warp
// meets, and each lane computes its own results from every lane's slots. cp.async is a plain
// copy. Dynamic shared memory starts as 0xff bytes (NaN in 16 and 32 bits), so that a read of
// an element no thread wrote shows in the results.
//
// What it cannot find: data races and missing barriers (a fiber runs to its next sync point
// alone, one legal schedule of many), timing, and the tensor cores' internal accumulation order
// (fp32 sums in k order here).
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
#include <memory>
#include <type_traits>
#include <vector>

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

// ---------------------------------------------------------------- the block being run

struct Fiber {
  boost::context::fiber self;  // this thread, while suspended
  std::unique_ptr<char[]> stack;
  bool done = false;
  uint64_t collectives = 0;  // warp collectives this lane has entered (their slot parity)
};

struct Warp {
  int alive = 0, arrived = 0;
  uint64_t generation = 0;
  uint32_t slot[2][32][8] = {};  // [parity][lane][payload words]
};

struct Block {
  dim3 grid, block, index;
  int threads = 0, alive = 0, current = 0;
  int arrived = 0;  // at __syncthreads
  uint64_t generation = 0;
  std::vector<unsigned char> smem;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  boost::context::fiber scheduler;  // the launch loop, while a thread runs
  const std::function<void()>* body = nullptr;
};

inline Block*& block() {
  static Block* b = nullptr;
  return b;
}

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "cuda emulation: %s\n", what);
  std::abort();
}

// Back to the scheduler; returns when this fiber is resumed.
inline void yield() {
  Block& b = *block();
  b.scheduler = std::move(b.scheduler).resume();
}

inline int thread_rank() {
  return block()->current;
}

// The barrier of all live threads of the block (__syncthreads) or of a warp (a collective).
// A thread that has returned counts as arrived, as on the hardware.
inline void block_barrier() {
  Block& b = *block();
  const uint64_t gen = b.generation;
  if (++b.arrived == b.alive) {
    b.arrived = 0;
    ++b.generation;
    return;
  }
  while (b.generation == gen)
    yield();
}

inline Warp& my_warp() {
  return block()->warps[size_t(thread_rank() / 32)];
}

inline void warp_barrier() {
  Warp& w = my_warp();
  const uint64_t gen = w.generation;
  if (++w.arrived == w.alive) {
    w.arrived = 0;
    ++w.generation;
    return;
  }
  while (w.generation == gen)
    yield();
}

// A warp collective: this lane's n payload words into its slot, the warp meets, and the
// returned array is every lane's slot of this collective ([lane][word]). Two slot sets
// alternate: a lane can be at most one collective ahead of another (the next barrier waits for
// all), so a slot is never overwritten while a lane still reads it.
inline const uint32_t (*exchange(const uint32_t* words, int n))[8] {
  Block& b = *block();
  Fiber& f = b.fibers[size_t(b.current)];
  Warp& w = my_warp();
  const int parity = int(f.collectives++ & 1), lane = thread_rank() % 32;
  std::memcpy(w.slot[parity][lane], words, size_t(n) * sizeof(uint32_t));
  warp_barrier();
  return w.slot[parity];
}

inline void fiber_main() {
  Block& b = *block();
  (*b.body)();
  Fiber& f = b.fibers[size_t(b.current)];
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

// Runs body as every thread of every block of the grid, one block after the other (blocks
// never talk to each other: the order is free). smem_bytes of dynamic shared memory per block.
inline void launch(dim3 grid, dim3 threads, size_t smem_bytes, const std::function<void()>& body) {
  constexpr size_t kStack = 256 * 1024;
  const int n = int(threads.x * threads.y * threads.z);
  if (threads.y != 1 || threads.z != 1) fail("only 1-D blocks are emulated");
  Block b;
  b.grid = grid;
  b.block = threads;
  b.threads = n;
  b.body = &body;
  b.fibers.resize(size_t(n));
  for (Fiber& f : b.fibers)
    f.stack.reset(new char[kStack]);
  Block* saved = block();
  block() = &b;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        b.index = dim3(x, y, z);
        b.smem.assign(smem_bytes + 16, 0xff);
        b.alive = n;
        b.arrived = 0;
        b.warps.assign(size_t((n + 31) / 32), Warp{});
        for (int w = 0; w < (n + 31) / 32; ++w)
          b.warps[size_t(w)].alive = std::min(32, n - 32 * w);
        for (int t = 0; t < n; ++t) {
          Fiber& f = b.fibers[size_t(t)];
          f.done = false;
          f.collectives = 0;
          start_fiber(f, kStack);
        }
        while (b.alive > 0) {
          bool ran = false;
          for (int t = 0; t < n; ++t) {
            if (b.fibers[size_t(t)].done) continue;
            ran = true;
            resume_fiber(b, t);
          }
          if (!ran) break;
        }
      }
  block() = saved;
}

inline unsigned char* dynamic_shared() {
  // 16-byte aligned, as the hardware's dynamic shared memory.
  const uintptr_t p = reinterpret_cast<uintptr_t>(block()->smem.data());
  return reinterpret_cast<unsigned char*>((p + 15) / 16 * 16);
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

#define DATTN_LAUNCH(kernel, grid, block, smem_bytes, stream, ...) \
  ((void)(stream),                                                 \
   ::dattn::emu::launch(dim3(grid), dim3(block), (smem_bytes), [&] { kernel(__VA_ARGS__); }))
#define DATTN_DYNAMIC_SHARED(type, name) \
  type* name = reinterpret_cast<type*>(::dattn::emu::dynamic_shared())

inline void __syncthreads() {
  ::dattn::emu::block_barrier();
}
inline void __syncwarp(unsigned = 0xffffffffu) {
  ::dattn::emu::warp_barrier();
}
// shfl.sync.bfly: the value of lane (this lane ^ lane_mask). Full warps only, as used.
inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
  uint32_t w;
  std::memcpy(&w, &v, 4);
  const auto slots = ::dattn::emu::exchange(&w, 1);
  float r;
  std::memcpy(&r, &slots[(::dattn::emu::thread_rank() % 32) ^ lane_mask][0], 4);
  return r;
}
// shfl.sync.idx: the value of lane src_lane. Full warps only, as used.
inline float __shfl_sync(unsigned, float v, int src_lane) {
  uint32_t w;
  std::memcpy(&w, &v, 4);
  const auto slots = ::dattn::emu::exchange(&w, 1);
  float r;
  std::memcpy(&r, &slots[src_lane & 31][0], 4);
  return r;
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
// with the lower index of every 16-bit pair in the low half of its register.

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
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
  const auto s = ::dattn::emu::exchange(mine, 6);
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
inline void emu_ldmatrix(uint32_t (&r)[4], const void* p, bool trans) {
  uint32_t words[2];
  std::memcpy(words, &p, sizeof p);
  const auto s = ::dattn::emu::exchange(words, 2);
  const int lane = ::dattn::emu::thread_rank() % 32;
  auto row = [&](int matrix, int j) {
    const uint16_t* q;
    std::memcpy(&q, s[8 * matrix + j], sizeof q);
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
inline void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  emu_ldmatrix(r, p, false);
}
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  emu_ldmatrix(r, p, true);
}

// cp.async 16 bytes (zero-filled when not valid), done at once; commit and wait have nothing to do.
inline void cp_async_16(void* dst, const void* src, bool valid) {
  if (valid)
    std::memcpy(dst, src, 16);
  else
    std::memset(dst, 0, 16);
}
inline void cp_async_commit() {}
template <int kPending>
inline void cp_async_wait() {}

}  // namespace dattn::cuda::detail
