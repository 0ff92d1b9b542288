// Data movement that is not attention math: row permutations (layout dispatch/undispatch), strided
// packing of collective buffers, and the elementwise merge/clear/weighting of partials. Declared
// twice: movement::host (Thrust OMP backend, host pointers) and movement::cuda (Thrust CUDA
// backend, device pointers, stream-ordered). Both are compiled from movement_impl.inl.
//
// Raw pointers and sizes only, and no CUDA header: the .cu includes nothing of the library but
// this, and g++ code includes it freely. Byte sizes and offsets are size_t/int64_t; a call with
// zero rows touches no pointer (null is fine then). Source and destination must not overlap,
// except where a function says it works in place.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dattn::movement {

// The movement operations with their meaning; each appears once per backend below.
//
// gather_rows:  dst row i = src row idx[i], for i < n (rows of row_bytes bytes, any size).
// scatter_rows: dst row idx[i] = src row i, for i < n (idx without repeats).
//   idx holds row numbers (not byte offsets); for movement::cuda it is in device memory.
//
// pack_rows:   buf (contiguous, outer * inner rows) <- the rows of a strided block: row (o, i)
//              at src + o * outer_stride + i * inner_stride bytes.
// unpack_rows: the reverse: row (o, i) of dst <- buf row o * inner + i.
//
// merge_partials: (out_a, lse_a) <- merge with (out_b, lse_b), the rule of kernels/merge.h
//   (merge_row) applied to every row: out [batch, seq, heads, dv] fp32 bshd, lse [batch, heads,
//   seq] fp32. An empty side (lse = -inf) contributes nothing, whatever its out holds.
// clear_partial: out[0, out_n) = 0, lse[0, lse_n) = -inf.
//
// weigh_partial: the tree decode's allreduce payload, packed [batch, seq, heads, dv + 1]: row r
//   = [w * out_r | w], w = exp(lse - m) (w = 0 and all zeros for an empty row, lse = -inf), with
//   m the allreduced max of lse ([batch, heads, seq] like lse).
// unweigh_partial: out = packed / w and lse = m + log(w) per row (out = 0, lse = -inf where the
//   summed w is 0): the merge of all ranks' partials after the sum-allreduce.
//
// add_floats: out[i] = a[i] + b[i] for i < n (fp32; out may be a or b): the ring backward's
//   running dK|dV sum.
// widen_16: out[i] = the value of the 16-bit float in[i] (bf16 when bf16, else IEEE fp16), exact
//   (subnormals, infinities and NaN included), for i < n.
//
// add_sinks: attention sinks joined to a merged partial, in place: per row, with s = sinks[h] (h
//   the row's head; sinks [heads] fp32, on the same memory as out), lse' = log(exp(lse) + exp(s))
//   and out *= exp(lse - lse') (a row that saw no key: out = 0, lse' = s).

// Host memory, Thrust's OMP backend: OpenMP threads (OMP_NUM_THREADS); returns when done.
namespace host {
void gather_rows(void* dst, const void* src, const int64_t* idx, int64_t n, size_t row_bytes);
void scatter_rows(void* dst, const void* src, const int64_t* idx, int64_t n, size_t row_bytes);
void pack_rows(void* buf, const void* src, int64_t outer, int64_t inner, size_t outer_stride,
               size_t inner_stride, size_t row_bytes);
void unpack_rows(void* dst, const void* buf, int64_t outer, int64_t inner, size_t outer_stride,
                 size_t inner_stride, size_t row_bytes);
void merge_partials(float* out_a, float* lse_a, const float* out_b, const float* lse_b,
                    int64_t batch, int64_t seq, int64_t heads, int64_t dv);
void clear_partial(float* out, int64_t out_n, float* lse, int64_t lse_n);
void weigh_partial(float* packed, const float* out, const float* lse, const float* m, int64_t batch,
                   int64_t seq, int64_t heads, int64_t dv);
void unweigh_partial(float* out, float* lse, const float* packed, const float* m, int64_t batch,
                     int64_t seq, int64_t heads, int64_t dv);
void add_sinks(float* out, float* lse, const float* sinks, int64_t batch, int64_t seq,
               int64_t heads, int64_t dv);
void add_floats(float* out, const float* a, const float* b, int64_t n);
void widen_16(float* out, const uint16_t* in, int64_t n, bool bf16);
}  // namespace host

// Device memory, Thrust's CUDA backend, ordered on `stream` (a cudaStream_t; nullptr: the
// legacy default stream); returns once the work is queued. Only in builds with DATTN_WITH_CUDA.
namespace cuda {
void gather_rows(void* dst, const void* src, const int64_t* idx, int64_t n, size_t row_bytes,
                 void* stream);
void scatter_rows(void* dst, const void* src, const int64_t* idx, int64_t n, size_t row_bytes,
                  void* stream);
void pack_rows(void* buf, const void* src, int64_t outer, int64_t inner, size_t outer_stride,
               size_t inner_stride, size_t row_bytes, void* stream);
void unpack_rows(void* dst, const void* buf, int64_t outer, int64_t inner, size_t outer_stride,
                 size_t inner_stride, size_t row_bytes, void* stream);
void merge_partials(float* out_a, float* lse_a, const float* out_b, const float* lse_b,
                    int64_t batch, int64_t seq, int64_t heads, int64_t dv, void* stream);
void clear_partial(float* out, int64_t out_n, float* lse, int64_t lse_n, void* stream);
void weigh_partial(float* packed, const float* out, const float* lse, const float* m, int64_t batch,
                   int64_t seq, int64_t heads, int64_t dv, void* stream);
void unweigh_partial(float* out, float* lse, const float* packed, const float* m, int64_t batch,
                     int64_t seq, int64_t heads, int64_t dv, void* stream);
void add_sinks(float* out, float* lse, const float* sinks, int64_t batch, int64_t seq,
               int64_t heads, int64_t dv, void* stream);
void add_floats(float* out, const float* a, const float* b, int64_t n, void* stream);
void widen_16(float* out, const uint16_t* in, int64_t n, bool bf16, void* stream);
}  // namespace cuda

}  // namespace dattn::movement
