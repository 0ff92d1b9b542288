// The CUDA runtime calls of the emulated tests (tests/emu), on host memory: "device" memory is
// host memory, copies are memcpy, eight devices that are always there (one per rank of the
// multi-rank tests, as on a GPU node), and the stream-ordered calls are done at once. Linked
// instead of libcudart, so that the kernels' own host code (validation, dispatch, scratch
// allocation) runs unchanged against the emulation.
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>

namespace {
constexpr int kDevices = 8;
int current_device = 0;

void* allocate(size_t bytes) {
  return std::aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
}
}  // namespace

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  *ptr = allocate(bytes);
  return *ptr != nullptr ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaMallocAsync(void** ptr, size_t bytes, cudaStream_t) {
  return cudaMalloc(ptr, bytes);
}
cudaError_t cudaFree(void* ptr) {
  std::free(ptr);
  return cudaSuccess;
}
cudaError_t cudaFreeAsync(void* ptr, cudaStream_t) {
  return cudaFree(ptr);
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {
  if (bytes > 0) std::memmove(dst, src, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t) {
  return cudaMemcpy(dst, src, bytes, kind);
}
cudaError_t cudaMemcpy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                         size_t height, cudaMemcpyKind) {
  for (size_t r = 0; r < height; ++r)
    std::memmove(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch,
                 width);
  return cudaSuccess;
}
cudaError_t cudaMemset(void* ptr, int value, size_t bytes) {
  if (bytes > 0) std::memset(ptr, value, bytes);
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
  // Memory pools (cudaMallocAsync) and a few SMs, so that kernels that size their grid by the
  // SM count split their work as on a GPU.
  *value = attr == cudaDevAttrMemoryPoolsSupported  ? 1
           : attr == cudaDevAttrMultiProcessorCount ? 4
                                                    : 0;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) {
  return cudaSuccess;
}
cudaError_t cudaGetLastError() {
  return cudaSuccess;
}
cudaError_t cudaPeekAtLastError() {
  return cudaSuccess;
}
cudaError_t cudaFuncSetAttribute(const void*, cudaFuncAttribute, int) {
  return cudaSuccess;
}
const char* cudaGetErrorName(cudaError_t error) {
  return error == cudaSuccess ? "cudaSuccess" : "cudaError (emulated runtime)";
}
const char* cudaGetErrorString(cudaError_t error) {
  return error == cudaSuccess ? "no error" : "error (emulated runtime)";
}
