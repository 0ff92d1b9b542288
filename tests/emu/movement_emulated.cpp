// movement::cuda (kernels/movement/movement.h) for the CPU emulation of CUDA (tests/emu): its
// "device" memory is host memory, so each function is movement::host's, done at once, and counts
// an operation on its stream (fake_runtime.h: StreamStats). Thrust's CUDA backend itself needs a
// GPU.
#include "kernels/movement/movement.h"
#include "tests/emu/fake_runtime.h"

namespace dattn::movement::cuda {

void gather_rows(void* dst, const void* src, const int64_t* idx, int64_t n, size_t row_bytes,
                 void* stream) {
  emu::record_stream_op(stream);
  host::gather_rows(dst, src, idx, n, row_bytes);
}
void scatter_rows(void* dst, const void* src, const int64_t* idx, int64_t n, size_t row_bytes,
                  void* stream) {
  emu::record_stream_op(stream);
  host::scatter_rows(dst, src, idx, n, row_bytes);
}
void pack_rows(void* buf, const void* src, int64_t outer, int64_t inner, size_t outer_stride,
               size_t inner_stride, size_t row_bytes, void* stream) {
  emu::record_stream_op(stream);
  host::pack_rows(buf, src, outer, inner, outer_stride, inner_stride, row_bytes);
}
void unpack_rows(void* dst, const void* buf, int64_t outer, int64_t inner, size_t outer_stride,
                 size_t inner_stride, size_t row_bytes, void* stream) {
  emu::record_stream_op(stream);
  host::unpack_rows(dst, buf, outer, inner, outer_stride, inner_stride, row_bytes);
}
void merge_partials(float* out_a, float* lse_a, const float* out_b, const float* lse_b,
                    int64_t batch, int64_t seq, int64_t heads, int64_t dv, void* stream) {
  emu::record_stream_op(stream);
  host::merge_partials(out_a, lse_a, out_b, lse_b, batch, seq, heads, dv);
}
void clear_partial(float* out, int64_t out_n, float* lse, int64_t lse_n, void* stream) {
  emu::record_stream_op(stream);
  host::clear_partial(out, out_n, lse, lse_n);
}
void add_floats(float* out, const float* a, const float* b, int64_t n, void* stream) {
  emu::record_stream_op(stream);
  host::add_floats(out, a, b, n);
}
void widen_16(float* out, const uint16_t* in, int64_t n, bool bf16, void* stream) {
  emu::record_stream_op(stream);
  host::widen_16(out, in, n, bf16);
}
void weigh_partial(float* packed, const float* out, const float* lse, const float* m, int64_t batch,
                   int64_t seq, int64_t heads, int64_t dv, void* stream) {
  emu::record_stream_op(stream);
  host::weigh_partial(packed, out, lse, m, batch, seq, heads, dv);
}
void unweigh_partial(float* out, float* lse, const float* packed, const float* m, int64_t batch,
                     int64_t seq, int64_t heads, int64_t dv, void* stream) {
  emu::record_stream_op(stream);
  host::unweigh_partial(out, lse, packed, m, batch, seq, heads, dv);
}
void add_sinks(float* out, float* lse, const float* sinks, int64_t batch, int64_t seq,
               int64_t heads, int64_t dv, void* stream) {
  emu::record_stream_op(stream);
  host::add_sinks(out, lse, sinks, batch, seq, heads, dv);
}

}  // namespace dattn::movement::cuda
