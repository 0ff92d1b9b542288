// Deterministic benchmark inputs: every value comes from a hash of (tensor, batch, global
// position, head, dim), so each rank generates its own shard without the global tensor, the
// values do not depend on the rank count, and a float64 check can regenerate any row.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <numeric>
#include <vector>

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

// Uniform in [-1, 1): 24 random bits of the hash of x.
inline float uniform(uint64_t x) {
  return float(mix64(x) >> 40) * 0x1p-23f - 1.0f;
}

// Uniform in [-1, 1), rounded to the storage dtype.
inline float input_value(uint64_t row, int64_t d, DType dtype) {
  return round_to(uniform(row ^ (uint64_t(d) * 0xd1b54a32d192ed03ull)), dtype);
}

// The inputs of every workload but mla: q, k, v and the backward's dout.
enum TensorId : uint64_t { kQ = 1, kK = 2, kV = 3, kDout = 4 };
constexpr int64_t kSinkTokens = 4;  // the context's first tokens, which carry star's sink

// One row of tensor `id` as stored: out[d] = input_value(row_key(id, b, pos, h), d, dtype), the
// row function of make_rows and of the float64 reference (bench_reference.h). With an attention
// sink (star): the values plus `sink` times a fixed direction u (entries +-D^(-1/4), |u|^2 =
// 1/scale) on every query and the first kSinkTokens keys, before the rounding to the dtype: those
// keys' logits rise by about sink^2 and take most of every row's attention, as in trained models.
struct HashedRows {
  HashedRows(DType d, float s = 0.f) : dtype(d), sink(s) {}
  DType dtype;
  float sink;
  void operator()(uint64_t id, int64_t b, int64_t pos, int64_t h, int64_t dim, float* out) const {
    const uint64_t key = row_key(id, b, pos, h);
    const bool sunk = sink != 0.f && (id == kQ || (id == kK && pos < kSinkTokens));
    const float u = sunk ? sink * float(std::pow(double(dim), -0.25)) : 0.f;  // sink * |u_d|
    for (int64_t d = 0; d < dim; ++d)
      out[d] = !sunk ? input_value(key, d, dtype)
                     : round_to(input_value(key, d, DType::f32) +
                                    ((mix64(0x51a4d1e5ull ^ uint64_t(d)) & 1) ? u : -u),
                                dtype);
  }
};

// [B, n, heads, dim] of tensor `id` in rows.dtype: row i at global position pos(i), heads
// head0 .. head0 + heads - 1 of the global tensor (a tensor-parallel rank's slice), each written by
// rows in fp32 (values already rounded to the dtype, so the cast is exact).
template <typename Pos>
Tensor make_rows(const HashedRows& rows, uint64_t id, int64_t batch, int64_t n, const Pos& pos,
                 int64_t heads, int64_t head0, int64_t dim) {
  Tensor t = Tensor::empty({batch, n, heads, dim}, DType::f32);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < heads; ++h)
        rows(id, b, pos(i), head0 + h, dim, t.ptr<float>() + ((b * n + i) * heads + h) * dim);
  return rows.dtype == DType::f32 ? t : t.to(rows.dtype);
}

// This rank's shard [B, local_len, heads, dim] of tensor `id` under `layout`.
inline Tensor make_shard(uint64_t id, const Layout& layout, int rank, int64_t batch, int64_t heads,
                         int64_t dim, const HashedRows& rows, int64_t head0 = 0) {
  const auto pos = [&](int64_t i) { return layout.global_position(rank, i); };
  return make_rows(rows, id, batch, layout.local_len(rank), pos, heads, head0, dim);
}

// The tokens at global positions pos0 .. pos0 + n - 1 of tensor `id` (a decode step's new tokens).
inline Tensor make_tokens(uint64_t id, int64_t pos0, int64_t n, int64_t batch, int64_t heads,
                          int64_t dim, const HashedRows& rows, int64_t head0 = 0) {
  const auto pos = [&](int64_t i) { return pos0 + i; };
  return make_rows(rows, id, batch, n, pos, heads, head0, dim);
}

// Gaussian inputs (mla): std 1 from the hash of the row and d (Box-Muller on the two halves of
// one hash), the same on every rank and for every rank count.
inline float gaussian(uint64_t row, int64_t d) {
  const uint64_t x = mix64(row ^ (uint64_t(d) * 0xd1b54a32d192ed03ull));
  const double u1 = (double(x >> 32) + 0.5) * 0x1p-32, u2 = double(x & 0xffffffffull) * 0x1p-32;
  return float(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

// Gaussian tensor `id` in `shape` (fp32, contiguous [B, S, heads, dim] whatever the shape; a 2-D
// shape is [S, dim] of batch 1): heads h0 .. at positions pos0 ..; channel d times std[d] when
// given.
inline Tensor gaussian_tensor(std::initializer_list<int64_t> shape, uint64_t id, int64_t heads,
                              int64_t dim, int64_t pos0 = 0, int64_t h0 = 0,
                              const std::vector<float>* std = nullptr) {
  Tensor t = Tensor::empty(shape, DType::f32);
  const bool batched = shape.size() > 2;
  const int64_t B = batched ? shape.begin()[0] : 1, S = shape.begin()[batched ? 1 : 0];
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < heads; ++h) {
        const uint64_t key = row_key(id, b, pos0 + s, h0 + h);
        float* row = t.ptr<float>() + ((b * S + s) * heads + h) * dim;
        for (int64_t d = 0; d < dim; ++d)
          row[d] = gaussian(key, d) * (std ? (*std)[size_t(d)] : 1.f);
      }
  return t;
}

// `n` distinct channels of 0 .. d - 1 chosen by a fixed hash (partial Fisher-Yates), sorted: mla's
// outlier channels.
inline std::vector<int64_t> hashed_channels(int64_t d, int64_t n) {
  std::vector<int64_t> idx(static_cast<size_t>(d));
  std::iota(idx.begin(), idx.end(), int64_t(0));
  for (int64_t i = 0; i < n; ++i)
    std::swap(idx[size_t(i)],
              idx[size_t(i + int64_t(mix64(0x0a71e55ull ^ uint64_t(i)) % uint64_t(d - i)))]);
  idx.resize(static_cast<size_t>(n));
  std::sort(idx.begin(), idx.end());
  return idx;
}

}  // namespace dattn::bench
