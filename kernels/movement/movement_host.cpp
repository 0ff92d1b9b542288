// movement::host: kernels/movement/movement_impl.inl compiled by the host compiler with Thrust's
// OMP backend (OpenMP threads over host memory). The CPU build and its tests run this; the GPU
// build compiles the same .inl again under nvcc (movement_cuda.cu).
//
// Thrust's OMP backend only works from a host compiler (nvcc rejects it), so this file must stay
// a .cpp. The device system is set to OMP before any Thrust header, so that nothing here pulls in
// the CUDA backend; the calls name thrust::omp::par explicitly anyway.
#ifndef THRUST_DEVICE_SYSTEM
#define THRUST_DEVICE_SYSTEM THRUST_DEVICE_SYSTEM_OMP
#endif

#include <thrust/execution_policy.h>
#include <thrust/fill.h>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/system/omp/execution_policy.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/movement/movement.h"

#define DATTN_MOVEMENT_HD

namespace dattn::movement::host {

using std::memcpy;

#include "kernels/movement/movement_impl.inl"

// One whole row per item: a memcpy per row, the rows spread over the OpenMP threads.
constexpr bool kWholeRows = true;

// Below this many bytes touched, the same functors run on the calling thread (thrust::seq): an
// OpenMP parallel region costs more than it saves there, and far more when the cores are shared
// (measured: the tree decode's 4096-row weighing took 0.2 ms in a plain loop and 8 ms through
// OMP with 2 threads on 2 busy cores).
constexpr size_t kParallelFrom = size_t(1) << 18;

template <class Body>
void on_host(size_t bytes, Body&& body) {
  if (bytes < kParallelFrom)
    body(thrust::seq);
  else
    body(thrust::omp::par);
}

void gather_rows(void* dst, const void* src, const int64_t* idx, int64_t n, size_t row_bytes) {
  on_host(size_t(n) * row_bytes, [&](const auto& policy) {
    gather_rows_with(policy, dst, src, idx, n, row_bytes, kWholeRows);
  });
}

void scatter_rows(void* dst, const void* src, const int64_t* idx, int64_t n, size_t row_bytes) {
  on_host(size_t(n) * row_bytes, [&](const auto& policy) {
    scatter_rows_with(policy, dst, src, idx, n, row_bytes, kWholeRows);
  });
}

void pack_rows(void* buf, const void* src, int64_t outer, int64_t inner, size_t outer_stride,
               size_t inner_stride, size_t row_bytes) {
  on_host(size_t(outer * inner) * row_bytes, [&](const auto& policy) {
    pack_rows_with(policy, buf, src, outer, inner, outer_stride, inner_stride, row_bytes,
                   kWholeRows);
  });
}

void unpack_rows(void* dst, const void* buf, int64_t outer, int64_t inner, size_t outer_stride,
                 size_t inner_stride, size_t row_bytes) {
  on_host(size_t(outer * inner) * row_bytes, [&](const auto& policy) {
    unpack_rows_with(policy, dst, buf, outer, inner, outer_stride, inner_stride, row_bytes,
                     kWholeRows);
  });
}

void merge_partials(float* out_a, float* lse_a, const float* out_b, const float* lse_b,
                    int64_t batch, int64_t seq, int64_t heads, int64_t dv) {
  on_host(size_t(batch * seq * heads * dv) * sizeof(float), [&](const auto& policy) {
    merge_partials_with(policy, out_a, lse_a, out_b, lse_b, batch, seq, heads, dv);
  });
}

void clear_partial(float* out, int64_t out_n, float* lse, int64_t lse_n) {
  on_host(size_t(out_n + lse_n) * sizeof(float),
          [&](const auto& policy) { clear_partial_with(policy, out, out_n, lse, lse_n); });
}

void add_floats(float* out, const float* a, const float* b, int64_t n) {
  on_host(size_t(n) * sizeof(float),
          [&](const auto& policy) { add_floats_with(policy, out, a, b, n); });
}

void widen_16(float* out, const uint16_t* in, int64_t n, bool bf16) {
  on_host(size_t(n) * 6, [&](const auto& policy) { widen_16_with(policy, out, in, n, bf16); });
}

void weigh_partial(float* packed, const float* out, const float* lse, const float* m, int64_t batch,
                   int64_t seq, int64_t heads, int64_t dv) {
  on_host(size_t(batch * seq * heads * dv) * sizeof(float), [&](const auto& policy) {
    weigh_partial_with(policy, packed, out, lse, m, batch, seq, heads, dv);
  });
}

void unweigh_partial(float* out, float* lse, const float* packed, const float* m, int64_t batch,
                     int64_t seq, int64_t heads, int64_t dv) {
  on_host(size_t(batch * seq * heads * dv) * sizeof(float), [&](const auto& policy) {
    unweigh_partial_with(policy, out, lse, packed, m, batch, seq, heads, dv);
  });
}

void add_sinks(float* out, float* lse, const float* sinks, int64_t batch, int64_t seq,
               int64_t heads, int64_t dv) {
  on_host(size_t(batch * seq * heads * dv) * sizeof(float), [&](const auto& policy) {
    add_sinks_with(policy, out, lse, sinks, batch, seq, heads, dv);
  });
}

}  // namespace dattn::movement::host
