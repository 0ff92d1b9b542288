// What the fake CUDA runtime (fake_cudart.cpp) tells the rest of the emulation: which ranges are
// device memory (its cudaMalloc/cudaMallocAsync registry; freed memory leaves it at once), the
// error the next cudaGetLastError returns (a refused launch), and the emulated device's limits.
// The emulated kernels (cuda_emulation.h) and the NCCL-semantics communicator
// (emu_nccl_communicator.cpp) check their pointers against it, as the hardware and NCCL would
// fault on anything else.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <map>
#include <string>

namespace dattn::emu {

// Whether [p, p + bytes) lies inside one live device allocation (bytes == 0: p inside one or
// one past its end).
bool is_device_range(const void* p, size_t bytes);
// A line naming the allocation that holds p, or why none does, for error messages.
std::string describe_pointer(const void* p);

// Ranges an operation in flight still reads or writes (an NCCL transfer issued and not yet
// complete: emu_nccl_communicator.cpp). cudaFree/cudaFreeAsync of memory that overlaps one ends
// the process with `what` named: on hardware the pool could hand the memory out while the
// transfer still writes it (the legacy stream that frees is not ordered after NCCL's stream).
void hold(const void* p, size_t bytes, const std::string& what);
void release(const void* p);

// Stream accounting, so that a test can assert where the library's device work went and that the
// host never waited for the device. Every stream-ordered call (the Async copies and memsets,
// cudaMallocAsync/cudaFreeAsync, a kernel launch, movement::cuda's functions, the NCCL-semantics
// communicator's joins of the caller's stream, where NcclCommunicator records and waits for events)
// counts one operation on its stream; the legacy default stream is null (cudaStreamLegacy
// counts there). Host waits: per stream for cudaStreamSynchronize, and `device_waits` for the
// calls that wait for the whole device or the legacy stream (cudaMemcpy, cudaMemcpy2D,
// cudaMemset, cudaFree, cudaDeviceSynchronize).
struct StreamStats {
  std::map<const void*, long> ops;    // stream -> stream-ordered calls on it
  std::map<const void*, long> waits;  // stream -> cudaStreamSynchronize calls
  long device_waits = 0;
  long ops_on(const void* stream) const;
  long waits_on(const void* stream) const;
};
void record_stream_op(const void* stream);
StreamStats stream_stats();
void reset_stream_stats();

// Makes `error` the runtime's pending error (cudaGetLastError returns and clears it,
// cudaPeekAtLastError returns it) with `message` as its cudaGetErrorString.
void set_last_error(cudaError_t error, const std::string& message);

// A fault for tests: the next cudaGetLastError calls return cudaSuccess `after` times, then
// cudaErrorLaunchFailure once (as after a kernel that faulted), named as injected.
void inject_launch_failure(int after);

// The emulated device's opt-in limit on a block's dynamic shared memory
// (cudaDevAttrMaxSharedMemoryPerBlockOptin): an H100/H200's 227 KiB unless a test sets another
// (an sm_86/89 device's 99 KiB, say); 0 restores the default.
int max_shared_optin(int device);
void set_max_shared_optin(int device, int bytes);
// The dynamic shared memory a kernel may launch with: 48 KiB unless cudaFuncSetAttribute
// (cudaFuncAttributeMaxDynamicSharedMemorySize) raised it for that kernel.
int max_dynamic_shared(const void* kernel);

}  // namespace dattn::emu
