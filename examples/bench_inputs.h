// Deterministic benchmark inputs: every value comes from a hash of (tensor, batch, global
// position, head, dim), so each rank generates its own shard without the global tensor, the
// values do not depend on the rank count, and a float64 check can regenerate any row.
#pragma once

#include <cstdint>

#include "src/base/dtype.h"
#include "src/base/tensor.h"
#include "src/layout.h"

namespace dattn::bench {

inline uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The key of one row (one token, one head) of tensor `id`.
inline uint64_t row_key(uint64_t id, int64_t b, int64_t pos, int64_t h) {
  uint64_t x = mix64(id);
  x = mix64(x ^ uint64_t(b));
  x = mix64(x ^ uint64_t(pos));
  return mix64(x ^ uint64_t(h));
}

// x rounded to the storage dtype: the value the kernel reads.
inline float round_to(float x, DType dtype) {
  switch (dtype) {
    case DType::f32:
      return x;
    case DType::bf16:
      return to_float(to_bf16(x));
    case DType::f16:
      return to_float(to_f16(x));
  }
  return x;
}

// Uniform in [-1, 1) (24 random bits), rounded to the storage dtype.
inline float input_value(uint64_t row, int64_t d, DType dtype) {
  return round_to(float(mix64(row ^ (uint64_t(d) * 0xd1b54a32d192ed03ull)) >> 40) * 0x1p-23f - 1.0f,
                  dtype);
}

// One row of tensor `id` as stored: out[d] = input_value(row_key(id, b, pos, h), d, dtype), the
// row function of make_rows and of the float64 reference (bench_reference.h).
struct HashedRows {
  DType dtype;
  void operator()(uint64_t id, int64_t b, int64_t pos, int64_t h, int64_t dim, float* out) const {
    const uint64_t key = row_key(id, b, pos, h);
    for (int64_t d = 0; d < dim; ++d)
      out[d] = input_value(key, d, dtype);
  }
};

// [B, n, heads, dim] of tensor `id` in dtype: row i at global position pos(i), heads
// head0 .. head0 + heads - 1 of the global tensor (a tensor-parallel rank's slice), each written by
// rows(id, b, pos, h, dim, out) in fp32 (values already rounded to dtype, so the cast is exact).
template <typename Rows, typename Pos>
Tensor make_rows(const Rows& rows, uint64_t id, int64_t batch, int64_t n, const Pos& pos,
                 int64_t heads, int64_t head0, int64_t dim, DType dtype) {
  Tensor t = Tensor::empty({batch, n, heads, dim}, DType::f32);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < heads; ++h)
        rows(id, b, pos(i), head0 + h, dim, t.ptr<float>() + ((b * n + i) * heads + h) * dim);
  return dtype == DType::f32 ? t : t.to(dtype);
}

// This rank's shard [B, local_len, heads, dim] of tensor `id` under `layout`.
inline Tensor make_shard(uint64_t id, const Layout& layout, int rank, int64_t batch, int64_t heads,
                         int64_t dim, DType dtype, int64_t head0 = 0) {
  const auto pos = [&](int64_t i) { return layout.global_position(rank, i); };
  return make_rows(HashedRows{dtype}, id, batch, layout.local_len(rank), pos, heads, head0, dim,
                   dtype);
}

// The tokens at global positions pos0 .. pos0 + n - 1 of tensor `id` (a decode step's new tokens).
inline Tensor make_tokens(uint64_t id, int64_t pos0, int64_t n, int64_t batch, int64_t heads,
                          int64_t dim, DType dtype, int64_t head0 = 0) {
  const auto pos = [&](int64_t i) { return pos0 + i; };
  return make_rows(HashedRows{dtype}, id, batch, n, pos, heads, head0, dim, dtype);
}

}  // namespace dattn::bench
