// Tensor allocation (host memory, or CUDA device memory in a CUDA build), copies between host
// and device, and element access and slicing on the host.
#include "src/base/tensor.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>

#include "src/base/error.h"
#include "src/base/stream.h"
#if DATTN_WITH_CUDA
#include "src/base/cuda_check.h"
#endif

namespace dattn {

std::string Device::str() const {
  return kind == Kind::cpu ? std::string("cpu") : "cuda:" + std::to_string(index);
}

namespace {
// Validates a shape list and returns it padded with ones.
std::array<int64_t, Tensor::kMaxDims> parse_shape(std::initializer_list<int64_t> shape, int& ndim) {
  DATTN_CHECK_ARG(shape.size() >= 1 && shape.size() <= Tensor::kMaxDims, "tensor rank",
                  shape.size(), "1 to 4 dimensions");
  std::array<int64_t, Tensor::kMaxDims> out;
  out.fill(1);
  ndim = 0;
  for (int64_t s : shape) {
    DATTN_CHECK_ARG(s >= 0, "tensor dimension", s, "a size >= 0");
    out[ndim++] = s;
  }
  return out;
}

#if DATTN_WITH_CUDA
// Makes `index` the current CUDA device for one scope and restores the previous one, so that an
// allocation on another device does not change the caller's current device.
class DeviceScope {
 public:
  explicit DeviceScope(int index) {
    DATTN_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != index) DATTN_CUDA_CHECK(cudaSetDevice(index));
  }
  ~DeviceScope() { cudaSetDevice(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

// Whether `device` has CUDA's stream-ordered memory pools (cudaMallocAsync); asked once per
// device. Without them, allocations fall back to cudaMalloc/cudaFree.
bool memory_pools(int device) {
  static std::mutex mutex;
  static std::map<int, bool> known;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = known.find(device);
  if (it != known.end()) return it->second;
  int supported = 0;
  DATTN_CUDA_CHECK(cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device));
  return known[device] = supported != 0;
}
#endif

// Throws unless the tensor lives in host memory (element access and host-side copies).
void check_host(const Tensor& t, const char* what) {
  DATTN_CHECK_ARG(t.device().is_cpu(), "tensor device", t.device().str(),
                  detail::cat("cpu for ", what, " (copy it with to_device(Device::cpu()))"));
}
}  // namespace

void check_device(Device device) {
  if (device.is_cpu()) return;
#if DATTN_WITH_CUDA
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess)
    DATTN_THROW("invalid device = ", device.str(),
                ": CUDA sees no device (cudaGetDeviceCount: ", cudaGetErrorName(err), ", ",
                cudaGetErrorString(err), ")");
  DATTN_CHECK_ARG(device.index >= 0 && device.index < count, "device", device.str(),
                  detail::cat("an index below the ", count, " CUDA devices of this machine"));
#else
  DATTN_THROW("invalid device = ", device.str(),
              ": this build has no CUDA backend (configure with the CUDA toolkit, "
              "DATTN_WITH_CUDA=ON)");
#endif
}

Device pointer_device(const void* p) {
#if DATTN_WITH_CUDA
  if (p == nullptr) return Device::cpu();
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();  // no usable CUDA here: no device memory either
    return Device::cpu();
  }
  if (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged)
    return Device::cuda(a.device);
#else
  (void)p;
#endif
  return Device::cpu();
}

Device current_cuda_device() {
#if DATTN_WITH_CUDA
  int index = 0;
  check_device(Device::cuda(0));  // names why CUDA cannot be used here
  DATTN_CUDA_CHECK(cudaGetDevice(&index));
  return Device::cuda(index);
#else
  check_device(Device::cuda(0));  // throws: no CUDA backend
  return Device::cpu();
#endif
}

Tensor Tensor::allocate(int ndim, const std::array<int64_t, kMaxDims>& shape, DType dtype,
                        Device device) {
  Tensor t;
  t.ndim_ = ndim;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.device_ = device;
  if (!device.is_cpu()) {
    check_device(device);
#if DATTN_WITH_CUDA
    DeviceScope scope(device.index);
    void* p = nullptr;
    // Never 0 bytes (a null pointer would read as "no storage"); at least 256-byte aligned.
    const size_t bytes = std::max<size_t>(256, t.nbytes());
    if (memory_pools(device.index)) {
      // Stream-ordered on the current stream (src/base/stream.h), where the kernels and copies
      // that use the buffer run: no device synchronisation per allocation and free (cudaFree
      // waits for the whole device), and the pool reuses memory from call to call. The free goes
      // on the same stream, in its order after the work queued there; the library joins its
      // NCCL stream back to it before a buffer a collective used is released (see
      // src/base/tensor.h for what that asks of the caller).
      cudaStream_t stream = static_cast<cudaStream_t>(current_stream());
      DATTN_CUDA_CHECK(cudaMallocAsync(&p, bytes, stream));
      t.storage_ = std::shared_ptr<void>(p, [index = device.index, stream](void* q) {
        // Never throws (a deleter): errors at exit, after CUDA's teardown, are ignored.
        int previous = index;
        cudaGetDevice(&previous);
        if (previous != index) cudaSetDevice(index);
        cudaFreeAsync(q, stream);
        if (previous != index) cudaSetDevice(previous);
      });
    } else {
      DATTN_CUDA_CHECK(cudaMalloc(&p, bytes));
      t.storage_ = std::shared_ptr<void>(p, [](void* q) { cudaFree(q); });
    }
    t.data_ = p;
    return t;
#endif
  }
  size_t bytes = std::max<size_t>(64, (t.nbytes() + 63) / 64 * 64);
  void* p = std::aligned_alloc(64, bytes);
  if (p == nullptr)
    DATTN_THROW_KIND(ErrorKind::out_of_memory, "out of host memory allocating ", t.shape_str());
  t.storage_ = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  t.data_ = p;
  return t;
}

Tensor Tensor::empty(std::initializer_list<int64_t> shape, DType dtype, Device device) {
  int ndim = 0;
  auto s = parse_shape(shape, ndim);
  return allocate(ndim, s, dtype, device);
}

Tensor Tensor::zeros(std::initializer_list<int64_t> shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  if (!device.is_cpu()) {
#if DATTN_WITH_CUDA
    DeviceScope scope(device.index);
    DATTN_CUDA_CHECK(
        cudaMemsetAsync(t.data_, 0, t.nbytes(), static_cast<cudaStream_t>(current_stream())));
#endif
    return t;
  }
  std::memset(t.data_, 0, t.nbytes());
  return t;
}

Tensor Tensor::to_device(Device device) const {
  Tensor out = allocate(ndim_, shape_, dtype_, device);
  if (device.is_cpu() && device_.is_cpu()) {
    std::memcpy(out.data_, data_, nbytes());
    return out;
  }
#if DATTN_WITH_CUDA
  // cudaMemcpyDefault: the driver tells host from device pointers (unified addressing), which
  // covers host->device, device->host and device->device (also between two GPUs). On the current
  // stream; only a copy to the host waits for it, since the host reads the result on return. (A
  // copy from pageable host memory has read it when cudaMemcpyAsync returns.)
  cudaStream_t stream = static_cast<cudaStream_t>(current_stream());
  DATTN_CUDA_CHECK(cudaMemcpyAsync(out.data_, data_, nbytes(), cudaMemcpyDefault, stream));
  if (device.is_cpu()) DATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
#endif
  return out;
}

Tensor Tensor::full(std::initializer_list<int64_t> shape, DType dtype, float value) {
  Tensor t = empty(shape, dtype);
  for (int64_t i = 0; i < t.numel(); ++i)
    t.set(i, value);
  return t;
}

Tensor Tensor::wrap(void* data, std::initializer_list<int64_t> shape, DType dtype, Device device) {
  Tensor t;
  t.shape_ = parse_shape(shape, t.ndim_);
  DATTN_CHECK_ARG(data != nullptr || t.numel() == 0, "data", "nullptr", "a valid pointer");
  t.dtype_ = dtype;
  t.device_ = device;
  t.data_ = data;
  return t;
}

int64_t Tensor::numel() const {
  if (ndim_ == 0) return 0;
  int64_t n = 1;
  for (int d = 0; d < ndim_; ++d)
    n *= shape_[d];
  return n;
}

std::string Tensor::shape_str() const {
  std::ostringstream os;
  os << "[";
  for (int d = 0; d < ndim_; ++d)
    os << (d ? ", " : "") << shape_[d];
  os << "] " << dtype_name(dtype_);
  return os.str();
}

float Tensor::get(int64_t i) const {
  check_host(*this, "element access");
  switch (dtype_) {
    case DType::f32:
      return static_cast<const float*>(data_)[i];
    case DType::bf16:
      return to_float(static_cast<const bf16*>(data_)[i]);
    case DType::f16:
      return to_float(static_cast<const f16*>(data_)[i]);
  }
  return 0.f;
}

void Tensor::set(int64_t i, float value) {
  check_host(*this, "element access");
  switch (dtype_) {
    case DType::f32:
      static_cast<float*>(data_)[i] = value;
      return;
    case DType::bf16:
      static_cast<bf16*>(data_)[i] = to_bf16(value);
      return;
    case DType::f16:
      static_cast<f16*>(data_)[i] = to_f16(value);
      return;
  }
}

Tensor Tensor::seq_slice(int64_t begin, int64_t len) const {
  DATTN_CHECK_ARG(ndim_ >= 2, "tensor rank", ndim_, ">= 2 for a sequence slice");
  DATTN_CHECK_ARG(begin >= 0 && len >= 0 && begin + len <= shape_[1], "sequence slice",
                  detail::cat("[", begin, ", ", begin + len, ")"),
                  detail::cat("a range inside [0, ", shape_[1], ")"));
  check_host(*this, "seq_slice");
  auto shape = shape_;
  shape[1] = len;
  Tensor out = allocate(ndim_, shape, dtype_, device_);
  int64_t row = 1;  // elements per sequence position
  for (int d = 2; d < ndim_; ++d)
    row *= shape_[d];
  size_t esz = dtype_size(dtype_);
  for (int64_t b = 0; b < shape_[0]; ++b) {
    const char* src = static_cast<const char*>(data_) + (b * shape_[1] + begin) * row * esz;
    char* dst = static_cast<char*>(out.data_) + b * len * row * esz;
    std::memcpy(dst, src, size_t(len * row) * esz);
  }
  return out;
}

Tensor Tensor::to(DType dtype) const {
  check_host(*this, "a dtype conversion");
  Tensor out = allocate(ndim_, shape_, dtype, device_);
  if (dtype == dtype_) {
    std::memcpy(out.data_, data_, nbytes());
  } else if (dtype == DType::f32) {
    convert_to_f32(data_, dtype_, out.ptr<float>(), size_t(numel()));
  } else {
    Tensor f = to(DType::f32);
    convert_from_f32(f.ptr<float>(), out.data_, dtype, size_t(numel()));
  }
  return out;
}

}  // namespace dattn
