// movement::cuda: kernels/movement/movement_impl.inl compiled by nvcc with Thrust's CUDA backend
// (device memory, ordered on the caller's stream). The CPU tests exercise the same .inl through
// movement::host (movement_host.cpp); tests/gpu/test_cuda_movement.cpp compares the two.
//
// par_nosync: the calls return once queued, like a kernel launch; the caller synchronises the
// stream when it needs the result (Thrust's plain par would wait after every call).
#include <cuda_runtime_api.h>
#include <thrust/fill.h>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/system/cuda/execution_policy.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/movement/movement.h"

#define DATTN_MOVEMENT_HD __host__ __device__

namespace dattn::movement::cuda {

#include "kernels/movement/movement_impl.inl"

namespace {
// One word per item: neighbouring threads copy neighbouring words of a row.
constexpr bool kWholeRows = false;

auto on(void* stream) {
  return thrust::cuda::par_nosync.on(static_cast<cudaStream_t>(stream));
}
}  // namespace

void gather_rows(void* dst, const void* src, const int64_t* idx, int64_t n, size_t row_bytes,
                 void* stream) {
  gather_rows_with(on(stream), dst, src, idx, n, row_bytes, kWholeRows);
}

void scatter_rows(void* dst, const void* src, const int64_t* idx, int64_t n, size_t row_bytes,
                  void* stream) {
  scatter_rows_with(on(stream), dst, src, idx, n, row_bytes, kWholeRows);
}

void pack_rows(void* buf, const void* src, int64_t outer, int64_t inner, size_t outer_stride,
               size_t inner_stride, size_t row_bytes, void* stream) {
  pack_rows_with(on(stream), buf, src, outer, inner, outer_stride, inner_stride, row_bytes,
                 kWholeRows);
}

void unpack_rows(void* dst, const void* buf, int64_t outer, int64_t inner, size_t outer_stride,
                 size_t inner_stride, size_t row_bytes, void* stream) {
  unpack_rows_with(on(stream), dst, buf, outer, inner, outer_stride, inner_stride, row_bytes,
                   kWholeRows);
}

void merge_partials(float* out_a, float* lse_a, const float* out_b, const float* lse_b,
                    int64_t batch, int64_t seq, int64_t heads, int64_t dv, void* stream) {
  merge_partials_with(on(stream), out_a, lse_a, out_b, lse_b, batch, seq, heads, dv);
}

void clear_partial(float* out, int64_t out_n, float* lse, int64_t lse_n, void* stream) {
  clear_partial_with(on(stream), out, out_n, lse, lse_n);
}

void add_floats(float* out, const float* a, const float* b, int64_t n, void* stream) {
  add_floats_with(on(stream), out, a, b, n);
}

void widen_16(float* out, const uint16_t* in, int64_t n, bool bf16, void* stream) {
  widen_16_with(on(stream), out, in, n, bf16);
}

void weigh_partial(float* packed, const float* out, const float* lse, const float* m, int64_t batch,
                   int64_t seq, int64_t heads, int64_t dv, void* stream) {
  weigh_partial_with(on(stream), packed, out, lse, m, batch, seq, heads, dv);
}

void unweigh_partial(float* out, float* lse, const float* packed, const float* m, int64_t batch,
                     int64_t seq, int64_t heads, int64_t dv, void* stream) {
  unweigh_partial_with(on(stream), out, lse, packed, m, batch, seq, heads, dv);
}

void add_sinks(float* out, float* lse, const float* sinks, int64_t batch, int64_t seq,
               int64_t heads, int64_t dv, void* stream) {
  add_sinks_with(on(stream), out, lse, sinks, batch, seq, heads, dv);
}

}  // namespace dattn::movement::cuda
