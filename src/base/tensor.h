// Tensor: a contiguous, row-major view of 1-4 dimensions with its dtype and device, owning its
// storage or wrapping the caller's. Attention tensors are bshd [batch, seq, heads, head_dim];
// lse is [batch, heads, seq].
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>

#include "src/base/dtype.h"

namespace dattn {

struct Device {
  enum class Kind : uint8_t { cpu, cuda };
  Kind kind = Kind::cpu;
  int index = 0;

  static Device cpu() { return {Kind::cpu, 0}; }
  static Device cuda(int index) { return {Kind::cuda, index}; }
  bool is_cpu() const { return kind == Kind::cpu; }
  bool operator==(const Device&) const = default;
  std::string str() const;
};

// Throws dattn::Error naming the device unless this build and machine can use it: the CPU
// always; cuda(i) in a CUDA build whose machine has a GPU i (the message gives CUDA's reason).
void check_device(Device device);

// The device whose memory holds p: cuda(i) for memory of GPU i (device or managed memory, as
// cudaPointerGetAttributes reports it), cpu for any other pointer (host memory, pinned or not;
// null) and for every pointer in a build without CUDA or on a machine CUDA cannot use. How the
// Python binding checks that an array handed over as device memory (__cuda_array_interface__)
// is that.
Device pointer_device(const void* p);

// This thread's current CUDA device (cudaGetDevice: the one a GPU Runtime made current, or 0);
// dattn::Error in a build without CUDA or where CUDA sees no device.
Device current_cuda_device();

class Tensor {
 public:
  static constexpr int kMaxDims = 4;

  Tensor() = default;
  // Allocates uninitialised storage: 64-byte aligned host memory, or with Device::cuda(i)
  // memory on GPU i (a CUDA build only, else dattn::Error naming the device). GPU memory comes
  // from CUDA's stream-ordered pool (cudaMallocAsync) where the device has one, allocated and
  // freed on the current stream (src/base/stream.h: a Runtime call's stream, else the legacy
  // default stream), so that stream must outlive the tensor. A caller that reads a device tensor
  // on another stream must make the allocating stream wait for that work (an event) before the
  // last copy of the tensor is released.
  static Tensor empty(std::initializer_list<int64_t> shape, DType dtype,
                      Device device = Device::cpu());
  static Tensor zeros(std::initializer_list<int64_t> shape, DType dtype,
                      Device device = Device::cpu());
  static Tensor full(std::initializer_list<int64_t> shape, DType dtype, float value);
  // Uninitialised, of t's shape and device, in `dtype`.
  static Tensor empty_like(const Tensor& t, DType dtype) {
    return allocate(t.ndim_, t.shape_, dtype, t.device_);
  }
  // Wraps memory the caller owns and keeps alive.
  static Tensor wrap(void* data, std::initializer_list<int64_t> shape, DType dtype,
                     Device device = Device::cpu());

  bool defined() const { return ndim_ > 0; }  // false for a default-constructed Tensor
  void* data() const { return data_; }
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data_);
  }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int dim() const { return ndim_; }
  int64_t size(int d) const { return shape_[d]; }
  const std::array<int64_t, kMaxDims>& shape() const { return shape_; }
  int64_t numel() const;
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype_); }
  std::string shape_str() const;  // "[1, 4096, 8, 128] bf16"

  // Element i (flat index) read as fp32, and written from fp32, whatever the dtype. Host tensors
  // only (a device tensor throws: copy it with to_device first).
  float get(int64_t i) const;
  void set(int64_t i, float value);

  // The rows [begin, begin + len) of dimension 1 (the sequence of a bshd tensor) as a new
  // contiguous tensor; a copy unless dimension 0 has size 1.
  Tensor seq_slice(int64_t begin, int64_t len) const;
  // A copy converted to another dtype (host only).
  Tensor to(DType dtype) const;
  // A copy on another device (host <-> GPU, GPU <-> GPU, host <-> host), same dtype and shape.
  Tensor to_device(Device device) const;

 private:
  // Allocates host storage for a tensor of the given rank and shape.
  static Tensor allocate(int ndim, const std::array<int64_t, kMaxDims>& shape, DType dtype,
                         Device device);

  std::shared_ptr<void> storage_;  // empty for wrapped memory
  void* data_ = nullptr;
  DType dtype_ = DType::f32;
  Device device_;
  int ndim_ = 0;
  std::array<int64_t, kMaxDims> shape_{};
};

// Untyped memory of at least `bytes` bytes on `device` (a 1-D fp32 tensor of ceil(bytes / 4)
// elements whose data() the caller uses as raw bytes). Strategies allocate their receive buffers
// with it on the device of their tensors, so that the same schedule code runs on host and GPU.
inline Tensor byte_buffer(size_t bytes, Device device) {
  return Tensor::empty({int64_t((bytes + 3) / 4)}, DType::f32, device);
}

}  // namespace dattn
