// Device-dispatching helpers (src/device_ops.h): host code for host memory, the CUDA runtime and
// movement::cuda for GPU memory, on the legacy default stream where the attention kernels run.
#include "src/device_ops.h"

#include <cstring>

#include "kernels/movement/movement.h"
#include "src/base/error.h"
#if DATTN_WITH_CUDA
#include "src/base/cuda_check.h"
#endif

namespace dattn {

#if !DATTN_WITH_CUDA
namespace {
// The error of a GPU pointer in a build without the CUDA backend (such tensors cannot be made
// there, so this names a caller's bug rather than a user's choice).
[[noreturn]] void no_cuda(Device device) {
  DATTN_THROW("invalid device = ", device.str(), ": this build has no CUDA backend");
}
}  // namespace
#endif

void copy_bytes(void* dst, const void* src, size_t bytes, Device device) {
  if (bytes == 0) return;  // an empty buffer may have no data (memcpy takes no null)
  if (device.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return;
  }
#if DATTN_WITH_CUDA
  // Stream-ordered with the kernel that wrote src and the NCCL call that reads dst (header).
  DATTN_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, nullptr));
#else
  no_cuda(device);
#endif
}

void copy_rows(void* dst, Device dst_device, int64_t dst_seq, int64_t dst_row0, const void* src,
               Device src_device, int64_t src_seq, int64_t src_row0, int64_t batch, int64_t rows,
               size_t row_bytes) {
  if (rows == 0 || batch == 0) return;  // an empty shard's tensors may have no data
  char* d = static_cast<char*>(dst) + size_t(dst_row0) * row_bytes;
  const char* s = static_cast<const char*>(src) + size_t(src_row0) * row_bytes;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    for (int64_t b = 0; b < batch; ++b)
      std::memcpy(d + size_t(b * dst_seq) * row_bytes, s + size_t(b * src_seq) * row_bytes,
                  size_t(rows) * row_bytes);
    return;
  }
#if DATTN_WITH_CUDA
  // One 2-D copy: `batch` blocks of rows * row_bytes contiguous bytes, at pitches of a batch
  // entry on each side. cudaMemcpyDefault: unified addressing tells host from device pointers.
  // Synchronous for pageable host memory, and on the legacy default stream (the kernels'), so a
  // decode step queued after it sees the rows. cudaMemcpy2D takes pitches below 2^31 bytes only
  // (cudaDevAttrMaxPitch); a batch entry of a long cache may be larger: one copy per entry then.
  const size_t dst_pitch = size_t(dst_seq) * row_bytes, src_pitch = size_t(src_seq) * row_bytes;
  const size_t width = size_t(rows) * row_bytes;
  constexpr size_t kMaxPitch = (size_t(1) << 31) - 1;
  if (batch == 1 || dst_pitch > kMaxPitch || src_pitch > kMaxPitch) {
    for (int64_t b = 0; b < batch; ++b)
      DATTN_CUDA_CHECK(cudaMemcpy(d + size_t(b) * dst_pitch, s + size_t(b) * src_pitch, width,
                                  cudaMemcpyDefault));
    return;
  }
  DATTN_CUDA_CHECK(
      cudaMemcpy2D(d, dst_pitch, s, src_pitch, width, size_t(batch), cudaMemcpyDefault));
#else
  no_cuda(dst_device.is_cpu() ? src_device : dst_device);
#endif
}

void pack_rows(Device device, void* buf, const void* src, int64_t outer, int64_t inner,
               size_t outer_stride, size_t inner_stride, size_t row_bytes) {
  if (device.is_cpu()) {
    movement::host::pack_rows(buf, src, outer, inner, outer_stride, inner_stride, row_bytes);
    return;
  }
#if DATTN_WITH_CUDA
  movement::cuda::pack_rows(buf, src, outer, inner, outer_stride, inner_stride, row_bytes, nullptr);
#else
  no_cuda(device);
#endif
}

void unpack_rows(Device device, void* dst, const void* buf, int64_t outer, int64_t inner,
                 size_t outer_stride, size_t inner_stride, size_t row_bytes) {
  if (device.is_cpu()) {
    movement::host::unpack_rows(dst, buf, outer, inner, outer_stride, inner_stride, row_bytes);
    return;
  }
#if DATTN_WITH_CUDA
  movement::cuda::unpack_rows(dst, buf, outer, inner, outer_stride, inner_stride, row_bytes,
                              nullptr);
#else
  no_cuda(device);
#endif
}

void merge_partials(Device device, float* out_a, float* lse_a, const float* out_b,
                    const float* lse_b, int64_t batch, int64_t seq, int64_t heads, int64_t dv) {
  if (device.is_cpu()) {
    movement::host::merge_partials(out_a, lse_a, out_b, lse_b, batch, seq, heads, dv);
    return;
  }
#if DATTN_WITH_CUDA
  movement::cuda::merge_partials(out_a, lse_a, out_b, lse_b, batch, seq, heads, dv, nullptr);
#else
  no_cuda(device);
#endif
}

void weigh_partial(Device device, float* packed, const float* out, const float* lse, const float* m,
                   int64_t batch, int64_t seq, int64_t heads, int64_t dv) {
  if (device.is_cpu()) {
    movement::host::weigh_partial(packed, out, lse, m, batch, seq, heads, dv);
    return;
  }
#if DATTN_WITH_CUDA
  movement::cuda::weigh_partial(packed, out, lse, m, batch, seq, heads, dv, nullptr);
#else
  no_cuda(device);
#endif
}

void unweigh_partial(Device device, float* out, float* lse, const float* packed, const float* m,
                     int64_t batch, int64_t seq, int64_t heads, int64_t dv) {
  if (device.is_cpu()) {
    movement::host::unweigh_partial(out, lse, packed, m, batch, seq, heads, dv);
    return;
  }
#if DATTN_WITH_CUDA
  movement::cuda::unweigh_partial(out, lse, packed, m, batch, seq, heads, dv, nullptr);
#else
  no_cuda(device);
#endif
}

void check_cuda_kernel_limits(DType dtype, const AttnSpec& spec, int64_t batch) {
  DATTN_CHECK_ARG(dtype == DType::bf16 || dtype == DType::f16, "dtype", dtype_name(dtype),
                  "bf16 or fp16 on cuda tensors (the CUDA kernel's types)");
  DATTN_CHECK_ARG(spec.head_dim <= 256, "head_dim", spec.head_dim,
                  "at most 256 on cuda tensors (the CUDA kernel's limit)");
  DATTN_CHECK_ARG(spec.dim_v() <= 256, "head_dim_v", spec.dim_v(),
                  "at most 256 on cuda tensors (the CUDA kernel's limit)");
  DATTN_CHECK_ARG(batch <= 65535, "batch", batch,
                  "at most 65535 on cuda tensors (the CUDA kernel's grid)");
  DATTN_CHECK_ARG(spec.heads_q <= 65535, "heads_q", spec.heads_q,
                  "at most 65535 on cuda tensors (the CUDA kernel's grid)");
}

}  // namespace dattn
