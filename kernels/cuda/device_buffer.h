// DeviceBuffer: an owning, untyped block of GPU memory with host copies in and out, for the GPU
// tests and benchmarks that drive the kernels on raw pointers (the library's own code holds
// device memory in dattn::Tensor). Host code only; every CUDA call is checked.
#pragma once

#include <algorithm>
#include <cstddef>

#include "src/base/cuda_check.h"

namespace dattn::cuda {

class DeviceBuffer {
 public:
  // cudaMalloc of at least one byte, so that an empty buffer still has a distinct pointer.
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    DATTN_CUDA_CHECK(cudaMalloc(&ptr_, std::max<size_t>(bytes, 1)));
  }
  DeviceBuffer(const void* host, size_t bytes) : DeviceBuffer(bytes) { upload(host); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Copies bytes() bytes from / to host memory (synchronous).
  void upload(const void* host) {
    if (bytes_ > 0) DATTN_CUDA_CHECK(cudaMemcpy(ptr_, host, bytes_, cudaMemcpyHostToDevice));
  }
  void download(void* host) const {
    if (bytes_ > 0) DATTN_CUDA_CHECK(cudaMemcpy(host, ptr_, bytes_, cudaMemcpyDeviceToHost));
  }
  template <typename T = void>
  T* get() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace dattn::cuda
