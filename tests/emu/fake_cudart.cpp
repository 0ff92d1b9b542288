// The CUDA runtime calls of the emulated tests (tests/emu), on host memory, as strict as the
// hardware where a bug would show there: "device" memory is host memory that a registry knows
// (fake_runtime.h), so that copies of the wrong kind, copies past an allocation and memsets of
// host memory fail with the error the real runtime gives, named; freed memory is poisoned (0xfd)
// and held back a while before it is reused, so that a late reader sees garbage and a late
// writer (a transfer still in flight) is caught by the registry. Eight devices that are always
// there (one per rank of the multi-rank tests, as on a GPU node); stream-ordered calls are done
// at once. Linked instead of libcudart, so that the kernels' own host code (validation,
// dispatch, scratch allocation) runs unchanged against the emulation. Streams are handles that
// count the calls queued on them (fake_runtime.h: StreamStats), so that a test can assert which
// stream the work went to and that the host never waited.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>

#include "tests/emu/fake_runtime.h"

namespace {
constexpr int kDevices = 8;
constexpr int kDefaultSharedOptin = 227 * 1024;   // sm_90's opt-in limit per block
constexpr int kDefaultDynamicShared = 48 * 1024;  // without cudaFuncSetAttribute
constexpr size_t kQuarantineBytes = size_t(256) << 20;
int current_device = 0;

struct Allocation {
  size_t bytes = 0;
  int device = 0;
  uint64_t id = 0;
};

struct State {
  std::mutex mutex;
  std::map<uintptr_t, Allocation> live;  // base -> allocation
  std::deque<std::pair<void*, size_t>> quarantine;
  size_t quarantined = 0;
  uint64_t next_id = 1;
  int optin[kDevices] = {};
  std::map<const void*, int> dynamic_shared;                      // kernel -> raised limit
  std::multimap<uintptr_t, std::pair<size_t, std::string>> held;  // base -> (bytes, what)
  int inject_after = -1;  // inject_launch_failure: checks to pass first; -1: none
  cudaError_t last_error = cudaSuccess;
  std::string message;                      // of the last error set with a message...
  cudaError_t message_error = cudaSuccess;  // ... which was this one
  dattn::emu::StreamStats streams;
  std::map<uintptr_t, bool> live_streams;  // cudaStreamCreate's handles
  uintptr_t next_stream = 0x1000;
};
State& state() {
  static State s;
  return s;
}

// The allocation holding [p, p + bytes), or null. Callers hold the mutex.
const Allocation* find(const void* p, size_t bytes, uintptr_t* base = nullptr) {
  auto& live = state().live;
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = live.upper_bound(a);
  if (it == live.begin()) return nullptr;
  --it;
  const size_t end = it->second.bytes;
  if (a - it->first > end || bytes > end - (a - it->first)) return nullptr;
  if (base != nullptr) *base = it->first;
  return &it->second;
}

cudaError_t fail(cudaError_t error, const std::string& message) {
  dattn::emu::set_last_error(error, message);
  return error;
}

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

// The legacy default stream's key (null) for cudaStreamLegacy; other handles as they are.
const void* stream_key(const void* stream) {
  return stream == static_cast<const void*>(cudaStreamLegacy) ? nullptr : stream;
}
void count_op(cudaStream_t stream) {
  dattn::emu::record_stream_op(stream);
}
void count_device_wait() {
  std::lock_guard lock(state().mutex);
  ++state().streams.device_waits;
}

bool device_range(const void* p, size_t bytes) {
  return dattn::emu::is_device_range(p, bytes);
}
bool inside_device(const void* p) {
  std::lock_guard lock(state().mutex);
  return find(p, 0) != nullptr;
}
const char* kind_name(cudaMemcpyKind kind) {
  switch (kind) {
    case cudaMemcpyHostToHost:
      return "cudaMemcpyHostToHost";
    case cudaMemcpyHostToDevice:
      return "cudaMemcpyHostToDevice";
    case cudaMemcpyDeviceToHost:
      return "cudaMemcpyDeviceToHost";
    case cudaMemcpyDeviceToDevice:
      return "cudaMemcpyDeviceToDevice";
    default:
      return "cudaMemcpyDefault";
  }
}

// The real runtime's rule (the CUDA Runtime API, cudaMemcpy): pointers must match the kind
// (cudaMemcpyDefault infers it); a device side must lie inside one allocation.
cudaError_t check_copy(const char* call, void* dst, const void* src, size_t bytes,
                       cudaMemcpyKind kind) {
  if (bytes == 0) return cudaSuccess;
  const bool dst_dev = inside_device(dst), src_dev = inside_device(src);
  bool want_dst = dst_dev, want_src = src_dev;
  if (kind == cudaMemcpyHostToDevice) want_dst = true, want_src = false;
  if (kind == cudaMemcpyDeviceToHost) want_dst = false, want_src = true;
  if (kind == cudaMemcpyDeviceToDevice) want_dst = want_src = true;
  if (kind == cudaMemcpyHostToHost) want_dst = want_src = false;
  const auto side = [&](const char* name, const void* p, bool dev, bool want) -> std::string {
    if (dev != want)
      return std::string(name) + " " + hex(p) +
             (want ? " is not device memory" : " is device memory");
    if (want && !device_range(p, bytes))
      return std::string(name) + " " + dattn::emu::describe_pointer(p) + ": " +
             std::to_string(bytes) + " bytes run past its end";
    return "";
  };
  std::string why = side("dst", dst, dst_dev, want_dst);
  if (why.empty()) why = side("src", src, src_dev, want_src);
  if (why.empty()) return cudaSuccess;
  return fail(cudaErrorInvalidValue, std::string(call) + " (" + kind_name(kind) + ", " +
                                         std::to_string(bytes) + " bytes): " + why +
                                         " (emulated runtime)");
}
}  // namespace

namespace dattn::emu {

bool is_device_range(const void* p, size_t bytes) {
  std::lock_guard lock(state().mutex);
  return find(p, bytes) != nullptr;
}

std::string describe_pointer(const void* p) {
  std::lock_guard lock(state().mutex);
  uintptr_t base = 0;
  const Allocation* a = find(p, 0, &base);
  if (a == nullptr) return hex(p) + " (not in any live device allocation)";
  return hex(p) + " (offset " + std::to_string(reinterpret_cast<uintptr_t>(p) - base) +
         " of device allocation #" + std::to_string(a->id) + ", " + std::to_string(a->bytes) +
         " bytes on device " + std::to_string(a->device) + ")";
}

void hold(const void* p, size_t bytes, const std::string& what) {
  std::lock_guard lock(state().mutex);
  state().held.emplace(reinterpret_cast<uintptr_t>(p), std::make_pair(bytes, what));
}
void release(const void* p) {
  std::lock_guard lock(state().mutex);
  auto it = state().held.find(reinterpret_cast<uintptr_t>(p));
  if (it != state().held.end()) state().held.erase(it);
}

long StreamStats::ops_on(const void* stream) const {
  const auto it = ops.find(stream_key(stream));
  return it == ops.end() ? 0 : it->second;
}
long StreamStats::waits_on(const void* stream) const {
  const auto it = waits.find(stream_key(stream));
  return it == waits.end() ? 0 : it->second;
}
void record_stream_op(const void* stream) {
  std::lock_guard lock(state().mutex);
  ++state().streams.ops[stream_key(stream)];
}
StreamStats stream_stats() {
  std::lock_guard lock(state().mutex);
  return state().streams;
}
void reset_stream_stats() {
  std::lock_guard lock(state().mutex);
  state().streams = StreamStats{};
}

void set_last_error(cudaError_t error, const std::string& message) {
  std::lock_guard lock(state().mutex);
  state().last_error = error;
  state().message = message;
  state().message_error = error;
}

void inject_launch_failure(int after) {
  std::lock_guard lock(state().mutex);
  state().inject_after = after;
}

int max_shared_optin(int device) {
  std::lock_guard lock(state().mutex);
  const int v = device >= 0 && device < kDevices ? state().optin[device] : 0;
  return v > 0 ? v : kDefaultSharedOptin;
}
void set_max_shared_optin(int device, int bytes) {
  std::lock_guard lock(state().mutex);
  if (device >= 0 && device < kDevices) state().optin[device] = bytes;
}

int max_dynamic_shared(const void* kernel) {
  std::lock_guard lock(state().mutex);
  auto it = state().dynamic_shared.find(kernel);
  return it == state().dynamic_shared.end() ? kDefaultDynamicShared : it->second;
}

}  // namespace dattn::emu

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  // 256-byte aligned, as cudaMalloc's; a zero-byte request still gets a distinct pointer.
  const size_t rounded = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
  *ptr = std::aligned_alloc(256, rounded);
  if (*ptr == nullptr)
    return fail(cudaErrorMemoryAllocation, "out of host memory (emulated runtime)");
  std::memset(*ptr, 0xff, rounded);  // uninitialised device memory: NaN in 16 and 32 bits
  std::lock_guard lock(state().mutex);
  state().live[reinterpret_cast<uintptr_t>(*ptr)] = {bytes, current_device, state().next_id++};
  return cudaSuccess;
}
cudaError_t cudaMallocAsync(void** ptr, size_t bytes, cudaStream_t stream) {
  count_op(stream);
  return cudaMalloc(ptr, bytes);
}
namespace {
cudaError_t free_now(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  State& s = state();
  std::lock_guard lock(s.mutex);
  auto it = s.live.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == s.live.end()) {
    s.last_error = cudaErrorInvalidValue;
    s.message =
        "cudaFree(" + hex(ptr) + "): not the start of a live device allocation (emulated runtime)";
    s.message_error = cudaErrorInvalidValue;
    return cudaErrorInvalidValue;
  }
  const size_t bytes = std::max<size_t>(it->second.bytes, 1);
  const auto base = reinterpret_cast<uintptr_t>(ptr);
  for (const auto& [at, held] : s.held)
    if (at < base + bytes && base < at + std::max<size_t>(held.first, 1)) {
      std::fprintf(stderr,
                   "cuda emulation: cudaFree(%p) (allocation #%llu, %zu bytes) while %s is in "
                   "flight in it: on hardware the memory pool may hand it out while the "
                   "transfer still uses it\n",
                   ptr, static_cast<unsigned long long>(it->second.id), bytes, held.second.c_str());
      std::abort();
    }
  s.live.erase(it);
  std::memset(ptr, 0xfd, bytes);
  s.quarantine.emplace_back(ptr, bytes);
  s.quarantined += bytes;
  while (s.quarantined > kQuarantineBytes && s.quarantine.size() > 1) {
    s.quarantined -= s.quarantine.front().second;
    std::free(s.quarantine.front().first);
    s.quarantine.pop_front();
  }
  return cudaSuccess;
}
cudaError_t copy_now(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (const cudaError_t e = check_copy("cudaMemcpy", dst, src, bytes, kind)) return e;
  if (bytes > 0) std::memmove(dst, src, bytes);
  return cudaSuccess;
}
cudaError_t copy_2d_now(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                        size_t height, cudaMemcpyKind kind) {
  if (height == 0 || width == 0) return cudaSuccess;
  if (width > dpitch || width > spitch)
    return fail(cudaErrorInvalidPitchValue, "cudaMemcpy2D: width above a pitch (emulated runtime)");
  // The whole span of each side: (height - 1) pitches and one row.
  if (const cudaError_t e = check_copy("cudaMemcpy2D", dst, src, 0, kind)) return e;
  const size_t dspan = (height - 1) * dpitch + width, sspan = (height - 1) * spitch + width;
  if ((inside_device(dst) && !device_range(dst, dspan)) ||
      (inside_device(src) && !device_range(src, sspan)))
    return fail(cudaErrorInvalidValue,
                "cudaMemcpy2D: rows run past a device allocation (emulated runtime)");
  for (size_t r = 0; r < height; ++r)
    std::memmove(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch,
                 width);
  return cudaSuccess;
}
cudaError_t set_now(void* ptr, int value, size_t bytes) {
  if (bytes == 0) return cudaSuccess;
  if (!device_range(ptr, bytes))
    return fail(cudaErrorInvalidValue, "cudaMemset(" + std::to_string(bytes) +
                                           " bytes): " + dattn::emu::describe_pointer(ptr) +
                                           " is not that much device memory (emulated runtime)");
  std::memset(ptr, value, bytes);
  return cudaSuccess;
}
}  // namespace

// The synchronous calls wait for the device (cudaFree: for the whole device); the Async ones
// count an operation on their stream. Both are done at once.
cudaError_t cudaFree(void* ptr) {
  count_device_wait();
  return free_now(ptr);
}
cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream) {
  count_op(stream);
  return free_now(ptr);
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  count_device_wait();
  return copy_now(dst, src, bytes, kind);
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  count_op(stream);
  return copy_now(dst, src, bytes, kind);
}
cudaError_t cudaMemcpy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                         size_t height, cudaMemcpyKind kind) {
  count_device_wait();
  return copy_2d_now(dst, dpitch, src, spitch, width, height, kind);
}
cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch,
                              size_t width, size_t height, cudaMemcpyKind kind,
                              cudaStream_t stream) {
  count_op(stream);
  return copy_2d_now(dst, dpitch, src, spitch, width, height, kind);
}
cudaError_t cudaMemset(void* ptr, int value, size_t bytes) {
  count_device_wait();
  return set_now(ptr, value, bytes);
}
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream) {
  count_op(stream);
  return set_now(ptr, value, bytes);
}
// Streams: distinct handles, known until destroyed; the flags do not matter here (everything is
// done at once).
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int) {
  std::lock_guard lock(state().mutex);
  const uintptr_t h = state().next_stream++;
  state().live_streams[h] = true;
  *stream = reinterpret_cast<cudaStream_t>(h);
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  std::lock_guard lock(state().mutex);
  if (state().live_streams.erase(reinterpret_cast<uintptr_t>(stream)) == 0) {
    state().last_error = cudaErrorInvalidResourceHandle;
    return cudaErrorInvalidResourceHandle;
  }
  return cudaSuccess;
}
// Device memory for the registry's allocations, else unregistered host memory (CUDA 11's
// answer for a pointer it does not know, with cudaSuccess).
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* ptr) {
  std::lock_guard lock(state().mutex);
  *attributes = cudaPointerAttributes{};
  attributes->type = cudaMemoryTypeUnregistered;
  attributes->device = -1;
  if (const Allocation* a = find(ptr, 1)) {
    attributes->type = cudaMemoryTypeDevice;
    attributes->device = a->device;
    attributes->devicePointer = const_cast<void*>(ptr);
  } else {
    attributes->hostPointer = const_cast<void*>(ptr);
  }
  return cudaSuccess;
}
cudaError_t cudaGetDeviceCount(int* count) {
  *count = kDevices;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = current_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= kDevices) return cudaErrorInvalidDevice;
  current_device = device;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device < 0 || device >= kDevices) return cudaErrorInvalidDevice;
  // Memory pools (cudaMallocAsync), a few SMs, so that kernels that size their grid by the SM
  // count split their work as on a GPU, and the shared-memory limits of the device.
  switch (attr) {
    case cudaDevAttrMemoryPoolsSupported:
      *value = 1;
      break;
    case cudaDevAttrMultiProcessorCount:
      *value = 4;
      break;
    case cudaDevAttrMaxSharedMemoryPerBlock:
      *value = kDefaultDynamicShared;
      break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = dattn::emu::max_shared_optin(device);
      break;
    case cudaDevAttrMaxThreadsPerBlock:
      *value = 1024;
      break;
    case cudaDevAttrComputeCapabilityMajor:
      *value = 9;
      break;
    case cudaDevAttrComputeCapabilityMinor:
      *value = 0;
      break;
    default:
      *value = 0;
  }
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  count_device_wait();
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  std::lock_guard lock(state().mutex);
  ++state().streams.waits[stream_key(stream)];
  return cudaSuccess;
}
cudaError_t cudaGetLastError() {
  std::lock_guard lock(state().mutex);
  State& s = state();
  if (s.inject_after == 0) {
    s.inject_after = -1;
    s.message = "unspecified launch failure (injected by a test: inject_launch_failure)";
    s.message_error = cudaErrorLaunchFailure;
    return cudaErrorLaunchFailure;
  }
  if (s.inject_after > 0) --s.inject_after;
  const cudaError_t e = state().last_error;
  state().last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() {
  std::lock_guard lock(state().mutex);
  return state().last_error;
}
cudaError_t cudaFuncSetAttribute(const void* kernel, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaSuccess;
  const int limit = dattn::emu::max_shared_optin(current_device);
  if (value < 0 || value > limit)
    return fail(cudaErrorInvalidValue,
                "cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize, " +
                    std::to_string(value) + "): above the device's opt-in limit of " +
                    std::to_string(limit) + " bytes (emulated runtime)");
  std::lock_guard lock(state().mutex);
  state().dynamic_shared[kernel] = value;
  return cudaSuccess;
}
const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorInvalidPitchValue:
      return "cudaErrorInvalidPitchValue";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    default:
      return "cudaError (emulated runtime)";
  }
}
const char* cudaGetErrorString(cudaError_t error) {
  if (error == cudaSuccess) return "no error";
  // The message of the last error set with one, when it is this error; thread-local, so that the
  // pointer stays valid while the caller formats it.
  thread_local std::string copy;
  std::lock_guard lock(state().mutex);
  copy = state().message_error == error && !state().message.empty() ? state().message
                                                                    : "error (emulated runtime)";
  return copy.c_str();
}
