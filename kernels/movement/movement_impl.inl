// The one implementation of kernels/movement/movement.h, written against Thrust and included
// twice: by movement_host.cpp (g++/clang, OMP backend) and by movement_cuda.cu (nvcc, CUDA
// backend), each inside its own namespace (host, cuda) and after defining DATTN_MOVEMENT_HD.
//
// Every operation is a thrust::for_each_n over a counting iterator with a functor marked
// DATTN_MOVEMENT_HD (__host__ __device__ under nvcc; lambdas would not compile there). The
// including file provides the execution policy and, for the row copies, the grain: the host copies
// one whole row per item (a memcpy per row, as the loops this replaces did, with the rows spread
// over the OpenMP threads); the GPU copies one machine word per item, so that neighbouring
// threads touch neighbouring words (coalesced) whatever the row size.
// No include guard and no namespace: this file is meant to be included exactly so.

// ---------------------------------------------------------------- row copies

// Where row i lives. Contiguous: base + i * row_bytes. Indexed: base + idx[i] * row_bytes.
// Strided (an outer x inner block): base + (i / inner) * outer_stride + (i % inner) * inner_stride.
struct ContiguousRows {
  size_t row_bytes;
  DATTN_MOVEMENT_HD size_t offset(int64_t i) const { return size_t(i) * row_bytes; }
};
struct IndexedRows {
  const int64_t* idx;
  size_t row_bytes;
  DATTN_MOVEMENT_HD size_t offset(int64_t i) const { return size_t(idx[i]) * row_bytes; }
};
struct StridedRows {
  int64_t inner;
  size_t outer_stride, inner_stride;
  DATTN_MOVEMENT_HD size_t offset(int64_t i) const {
    return size_t(i / inner) * outer_stride + size_t(i % inner) * inner_stride;
  }
};

// Item k copies `words` Words of row k / items_per_row, at word (k % items_per_row) * words.
// The grain is the caller's: one item per row (items_per_row = 1, words = the row) or one per word
// (words = 1). Word is a type as wide as every pointer, stride and row size allows, so that a copy
// of one word is a single aligned load and store.
template <class Word, class DstRows, class SrcRows>
struct CopyRows {
  char* dst;
  const char* src;
  DstRows dst_rows;
  SrcRows src_rows;
  int64_t items_per_row, words;

  DATTN_MOVEMENT_HD void operator()(int64_t k) const {
    const int64_t row = k / items_per_row;
    const size_t at = size_t((k % items_per_row) * words) * sizeof(Word);
    Word* d = reinterpret_cast<Word*>(dst + dst_rows.offset(row) + at);
    const Word* s = reinterpret_cast<const Word*>(src + src_rows.offset(row) + at);
    if (words == 1)
      *d = *s;
    else
      memcpy(d, s, size_t(words) * sizeof(Word));
  }
};

// A 16-byte word (one vector load/store on the GPU) without CUDA's uint4.
struct alignas(16) Word16 {
  uint64_t lo, hi;
};

// Copies n rows of row_bytes bytes from src to dst, rows placed by dst_rows and src_rows.
// `alignment` is the OR of every pointer, stride and row size involved: its lowest set bit bounds
// the word. whole_rows: one item per row (host), else one per word (GPU).
template <class Policy, class DstRows, class SrcRows>
void copy_rows(const Policy& policy, void* dst, DstRows dst_rows, const void* src, SrcRows src_rows,
               int64_t n, size_t row_bytes, size_t alignment, bool whole_rows) {
  if (n <= 0 || row_bytes == 0) return;  // nothing to touch: pointers may be null
  alignment |= row_bytes;
  auto run = [&](auto word) {
    using Word = decltype(word);
    const int64_t row_words = int64_t(row_bytes / sizeof(Word));
    const int64_t items_per_row = whole_rows ? 1 : row_words;
    CopyRows<Word, DstRows, SrcRows> f{
        static_cast<char*>(dst), static_cast<const char*>(src), dst_rows, src_rows,
        items_per_row,           whole_rows ? row_words : 1};
    thrust::for_each_n(policy, thrust::counting_iterator<int64_t>(0), n * items_per_row, f);
  };
  if (alignment % 16 == 0)
    run(Word16{});
  else if (alignment % 8 == 0)
    run(uint64_t{});
  else if (alignment % 4 == 0)
    run(uint32_t{});
  else if (alignment % 2 == 0)
    run(uint16_t{});
  else
    run(uint8_t{});
}

inline size_t address_bits(const void* p) {
  return size_t(reinterpret_cast<uintptr_t>(p));
}

template <class Policy>
void gather_rows_with(const Policy& policy, void* dst, const void* src, const int64_t* idx,
                      int64_t n, size_t row_bytes, bool whole_rows) {
  copy_rows(policy, dst, ContiguousRows{row_bytes}, src, IndexedRows{idx, row_bytes}, n, row_bytes,
            address_bits(dst) | address_bits(src), whole_rows);
}

template <class Policy>
void scatter_rows_with(const Policy& policy, void* dst, const void* src, const int64_t* idx,
                       int64_t n, size_t row_bytes, bool whole_rows) {
  copy_rows(policy, dst, IndexedRows{idx, row_bytes}, src, ContiguousRows{row_bytes}, n, row_bytes,
            address_bits(dst) | address_bits(src), whole_rows);
}

template <class Policy>
void pack_rows_with(const Policy& policy, void* buf, const void* src, int64_t outer, int64_t inner,
                    size_t outer_stride, size_t inner_stride, size_t row_bytes, bool whole_rows) {
  if (inner <= 0) return;
  copy_rows(policy, buf, ContiguousRows{row_bytes}, src,
            StridedRows{inner, outer_stride, inner_stride}, outer * inner, row_bytes,
            address_bits(buf) | address_bits(src) | outer_stride | inner_stride, whole_rows);
}

template <class Policy>
void unpack_rows_with(const Policy& policy, void* dst, const void* buf, int64_t outer,
                      int64_t inner, size_t outer_stride, size_t inner_stride, size_t row_bytes,
                      bool whole_rows) {
  if (inner <= 0) return;
  copy_rows(policy, dst, StridedRows{inner, outer_stride, inner_stride}, buf,
            ContiguousRows{row_bytes}, outer * inner, row_bytes,
            address_bits(dst) | address_bits(buf) | outer_stride | inner_stride, whole_rows);
}

// ---------------------------------------------------------------- partials

// Row r of a bshd tensor [batch, seq, heads, ...] -> its index in a [batch, heads, seq] lse.
struct LseIndex {
  int64_t seq, heads;
  DATTN_MOVEMENT_HD int64_t operator()(int64_t row) const {
    const int64_t h = row % heads, bs = row / heads;
    return ((bs / seq) * heads + h) * seq + bs % seq;
  }
};

// merge_row of kernels/merge.h, step for step (expf/fmaxf/logf are what std::exp/fmax/log call
// for float, and they exist in device code), so that the host results are merge_row's bits.
// merge_row itself cannot be called here: it is not a device function.
struct MergeRows {
  float* out_a;
  float* lse_a;
  const float* out_b;
  const float* lse_b;
  LseIndex lse_index;
  int64_t dv;

  DATTN_MOVEMENT_HD void operator()(int64_t row) const {
    const int64_t l = lse_index(row);
    float* o_a = out_a + row * dv;
    const float* o_b = out_b + row * dv;
    const float lb = lse_b[l];
    if (lb == -INFINITY) return;  // an empty side contributes nothing, even NaN in its out
    const float la = lse_a[l];
    if (la == -INFINITY) {
      for (int64_t d = 0; d < dv; ++d)
        o_a[d] = o_b[d];
      lse_a[l] = lb;
      return;
    }
    const float m = fmaxf(la, lb);
    const float w_a = expf(la - m);
    const float w_b = expf(lb - m);
    const float sum = w_a + w_b;
    const float c_a = w_a / sum, c_b = w_b / sum;
    for (int64_t d = 0; d < dv; ++d)
      o_a[d] = c_a * o_a[d] + c_b * o_b[d];
    lse_a[l] = m + logf(sum);
  }
};

// Row r of the tree decode's payload: [w * out | w] with w = exp(lse - m), 0 for an empty row.
struct WeighRows {
  float* packed;
  const float* out;
  const float* lse;
  const float* m;
  LseIndex lse_index;
  int64_t dv;

  DATTN_MOVEMENT_HD void operator()(int64_t row) const {
    const int64_t l = lse_index(row);
    const float w = lse[l] == -INFINITY ? 0.f : expf(lse[l] - m[l]);
    float* p = packed + row * (dv + 1);
    const float* o = out + row * dv;
    const int64_t n = dv;
    if (w == 0.f) {
      for (int64_t d = 0; d < n; ++d)
        p[d] = 0.f;
    } else {
      for (int64_t d = 0; d < n; ++d)
        p[d] = w * o[d];
    }
    p[n] = w;
  }
};

// The summed payload back to a partial: out = sum(w out) / sum(w), lse = m + log(sum(w)).
struct UnweighRows {
  float* out;
  float* lse;
  const float* packed;
  const float* m;
  LseIndex lse_index;
  int64_t dv;

  DATTN_MOVEMENT_HD void operator()(int64_t row) const {
    const int64_t l = lse_index(row);
    const float* p = packed + row * (dv + 1);
    // den == 0 only when every shard is empty. A NaN den (a NaN score on some rank) must not
    // read as empty: it goes through the division, so the row is NaN as in the other schedules.
    const float den = p[dv];
    const bool empty = den == 0.f;
    for (int64_t d = 0; d < dv; ++d)
      out[row * dv + d] = empty ? 0.f : p[d] / den;
    lse[l] = empty ? -INFINITY : m[l] + logf(den);
  }
};

// A sink logit joined to each row: lse' = max + log(exp(lse - max) + exp(s - max)), the
// merge rule of kernels/merge.h with a valueless partial (out 0, lse s); expf(-inf) = 0 covers a
// row that saw no key.
struct SinkRows {
  float* out;
  float* lse;
  const float* sinks;
  LseIndex lse_index;
  int64_t dv;

  DATTN_MOVEMENT_HD void operator()(int64_t row) const {
    const int64_t l = lse_index(row);
    const float la = lse[l], s = sinks[row % lse_index.heads];
    const float m = fmaxf(la, s);
    const float w_a = expf(la - m), sum = w_a + expf(s - m);
    const float c = w_a / sum;
    for (int64_t d = 0; d < dv; ++d)
      out[row * dv + d] = la == -INFINITY ? 0.f : c * out[row * dv + d];
    lse[l] = m + logf(sum);
  }
};

// One functor over the batch * seq * heads rows of a partial.
template <class Policy, class F>
void for_each_row(const Policy& policy, int64_t batch, int64_t seq, int64_t heads, F f) {
  const int64_t rows = batch * seq * heads;
  if (rows <= 0) return;
  thrust::for_each_n(policy, thrust::counting_iterator<int64_t>(0), rows, f);
}

template <class Policy>
void merge_partials_with(const Policy& policy, float* out_a, float* lse_a, const float* out_b,
                         const float* lse_b, int64_t batch, int64_t seq, int64_t heads,
                         int64_t dv) {
  for_each_row(policy, batch, seq, heads,
               MergeRows{out_a, lse_a, out_b, lse_b, LseIndex{seq, heads}, dv});
}

// Element i <- a constant. The constant is the functor's type, not a member, so that the host
// compiler can turn each thread's share into a memset (thrust::fill_n(0.f) measured 1.5x slower
// than the memset it replaced).
struct StoreZero {
  float* out;
  DATTN_MOVEMENT_HD void operator()(int64_t i) const { out[i] = 0.f; }
};
struct StoreMinusInf {
  float* lse;
  DATTN_MOVEMENT_HD void operator()(int64_t i) const { lse[i] = -INFINITY; }
};

template <class Policy>
void clear_partial_with(const Policy& policy, float* out, int64_t out_n, float* lse,
                        int64_t lse_n) {
  if (out_n > 0)
    thrust::for_each_n(policy, thrust::counting_iterator<int64_t>(0), out_n, StoreZero{out});
  if (lse_n > 0)
    thrust::for_each_n(policy, thrust::counting_iterator<int64_t>(0), lse_n, StoreMinusInf{lse});
}

struct AddFloats {
  float* out;
  const float *a, *b;
  DATTN_MOVEMENT_HD void operator()(int64_t i) const { out[i] = a[i] + b[i]; }
};

template <class Policy>
void add_floats_with(const Policy& policy, float* out, const float* a, const float* b, int64_t n) {
  if (n > 0)
    thrust::for_each_n(policy, thrust::counting_iterator<int64_t>(0), n, AddFloats{out, a, b});
}

// The value of a 16-bit float's bits: bf16 is fp32's top half; fp16 is rebiased (exponent 15 to
// 127), its subnormals normalised, its infinities and NaNs kept.
DATTN_MOVEMENT_HD inline float widen_bits(uint16_t h, bool bf16) {
  uint32_t bits = uint32_t(h) << 16;
  if (!bf16) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1fu) {
      bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
      bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
      bits = sign;
    } else {  // man * 2^-24: shift its leading one to bit 10, k shifts, exponent 113 - k
      uint32_t e = 113;
      while ((man & 0x400u) == 0) {
        man <<= 1;
        --e;
      }
      bits = sign | (e << 23) | ((man & 0x3ffu) << 13);
    }
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

struct Widen16 {
  float* out;
  const uint16_t* in;
  bool bf16;
  DATTN_MOVEMENT_HD void operator()(int64_t i) const { out[i] = widen_bits(in[i], bf16); }
};

template <class Policy>
void widen_16_with(const Policy& policy, float* out, const uint16_t* in, int64_t n, bool bf16) {
  if (n > 0) thrust::for_each_n(policy, thrust::counting_iterator<int64_t>(0), n, Widen16{out, in, bf16});
}

template <class Policy>
void weigh_partial_with(const Policy& policy, float* packed, const float* out, const float* lse,
                        const float* m, int64_t batch, int64_t seq, int64_t heads, int64_t dv) {
  for_each_row(policy, batch, seq, heads, WeighRows{packed, out, lse, m, LseIndex{seq, heads}, dv});
}

template <class Policy>
void unweigh_partial_with(const Policy& policy, float* out, float* lse, const float* packed,
                          const float* m, int64_t batch, int64_t seq, int64_t heads, int64_t dv) {
  for_each_row(policy, batch, seq, heads,
               UnweighRows{out, lse, packed, m, LseIndex{seq, heads}, dv});
}

template <class Policy>
void add_sinks_with(const Policy& policy, float* out, float* lse, const float* sinks, int64_t batch,
                    int64_t seq, int64_t heads, int64_t dv) {
  for_each_row(policy, batch, seq, heads, SinkRows{out, lse, sinks, LseIndex{seq, heads}, dv});
}
