// The CPU attention kernel: for each (batch, query head, query tile) an online-softmax pass
// over the key tiles, with S = Q K^T and O += P V as tile GEMMs (kernels/cpu/tile_gemm.h), then
// one merge of the tile's partial into the running partial (kernels/merge.h). NaN or inf where
// the mask hides it never reaches a row that does not see it (see add_pv_sanitised).
//
// Operands: fp32 tensors are read in place; bf16 ones too where bf16 tiles pay (AVX512-BF16 or
// AMX measured faster than widening: gemm_path(bf16) is onednn), else they and fp16 are widened
// to fp32 tile by tile. On the bf16 path P is split into two bf16 terms, P = P_hi + P_lo (P_hi is
// P rounded to bf16, P_lo the rest rounded), and O += P_hi V + P_lo V: P keeps 16 bits instead
// of 8, so the result is as accurate as the widened path's (within 2^-17 of P per term; a
// single bf16 P would cost 2^-9, as much as storing the output in bf16), for two bf16 GEMMs at
// the cost of one fp32 one, while S = Q K^T runs at the full bf16 rate.
#include "kernels/cpu/attention_cpu.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "kernels/cpu/decode_cpu.h"
#include "kernels/cpu/finite.h"
#include "kernels/cpu/first_error.h"
#include "kernels/cpu/progress.h"
#include "kernels/cpu/tile_gemm.h"
#include "kernels/cpu/tile_mask.h"
#include "kernels/cpu/vec_math.h"
#include "kernels/merge.h"
#include "src/base/error.h"

namespace dattn::cpu {

namespace {

// ---------------------------------------------------------------- workspace
// Per-thread tile buffers, allocated once per kernel call: O(tile), independent of S.
struct Workspace {
  std::unique_ptr<float[], void (*)(void*)> mem{nullptr, std::free};
  float* q = nullptr;        // [kTileQ, D]   converted queries (16-bit inputs only)
  float* k = nullptr;        // [kTileK, D]   converted keys
  float* v = nullptr;        // [kTileK, Dv]  converted values
  float* s = nullptr;        // [kTileQ, kTileK] scores, then probabilities
  float* o = nullptr;        // [kTileQ, Dv]  unnormalised output accumulator
  float* o_saved = nullptr;  // [kTileQ, Dv]  o before a partially masked tile's O += P V
  float* m = nullptr;        // [kTileQ]      running row max
  float* l = nullptr;        // [kTileQ]      running row sum
  uint16_t* p_hi = nullptr;  // [kTileQ, kTileK] bf16 P rounded (bf16 path)
  uint16_t* p_lo = nullptr;  // [kTileQ, kTileK] bf16 P - P_hi rounded (bf16 path)
  TileMask tile_mask;        // the mask on a partially masked tile
  std::vector<int64_t> bad;  // rows of V holding NaN or inf (add_pv_sanitised)
  // V with those rows zeroed (rare), at V's own leading dimension (the GEMM kernels' blocking,
  // and so the bits of the clean rows, depend on it). Sized when first needed.
  std::vector<char> vs;

  Workspace(int64_t d, int64_t dv, const Mask& mask) : tile_mask(mask, kTileK) {
    // In floats (p_hi and p_lo take half a float an element), each piece 64-byte aligned.
    const int64_t sizes[] = {kTileQ * d,          kTileK * d,         kTileK * dv, kTileQ * kTileK,
                             kTileQ * dv,         kTileQ * dv,        kTileQ,      kTileQ,
                             kTileQ * kTileK / 2, kTileQ * kTileK / 2};
    int64_t total = 0;
    for (int64_t sz : sizes)
      total += (sz + 15) / 16 * 16;
    mem.reset(static_cast<float*>(std::aligned_alloc(64, size_t(total) * sizeof(float))));
    if (!mem)
      DATTN_THROW_KIND(ErrorKind::out_of_memory,
                       "out of host memory allocating the attention workspace");
    float* pieces[10];
    float* p = mem.get();
    for (int i = 0; i < 10; ++i) {
      pieces[i] = p;
      p += (sizes[i] + 15) / 16 * 16;
    }
    q = pieces[0], k = pieces[1], v = pieces[2], s = pieces[3], o = pieces[4];
    o_saved = pieces[5], m = pieces[6], l = pieces[7];
    p_hi = reinterpret_cast<uint16_t*>(pieces[8]);
    p_lo = reinterpret_cast<uint16_t*>(pieces[9]);
  }
};

// Rows [row0, row0 + rows) of head h of a bshd tensor as an fp32 matrix with leading
// dimension *ld: the tensor itself for fp32 (no copy), else converted into buf.
const float* tile_f32(const void* base, DType dtype, int64_t b, int64_t seq, int64_t heads,
                      int64_t h, int64_t dim, int64_t row0, int64_t rows, float* buf, int64_t* ld) {
  int64_t offset = ((b * seq + row0) * heads + h) * dim;
  if (dtype == DType::f32) {
    *ld = heads * dim;
    return static_cast<const float*>(base) + offset;
  }
  const char* src = static_cast<const char*>(base) + offset * 2;
  for (int64_t r = 0; r < rows; ++r)
    convert_to_f32(src + r * heads * dim * 2, dtype, buf + r * dim, size_t(dim));
  *ld = dim;
  return buf;
}

// The tile GEMMs of one kernel call: the path and the operands' dtype (bf16 read in place, or
// fp32: fp32 tensors in place, 16-bit ones widened).
struct Tiles {
  DType op;
  GemmPath path;
  explicit Tiles(DType dtype)
      : op(dtype == DType::bf16 && gemm_path(DType::bf16) == GemmPath::onednn ? DType::bf16
                                                                              : DType::f32),
        path(gemm_path(op)) {}
  size_t elem() const { return op == DType::bf16 ? 2 : 4; }

  // Rows [row0, row0 + rows) of head h of a bshd tensor as an operand of dtype op: in place, or
  // widened into buf.
  GemmOperand rows(const void* base, DType dtype, int64_t b, int64_t seq, int64_t heads, int64_t h,
                   int64_t dim, int64_t row0, int64_t rows, float* buf) const {
    if (op == DType::bf16) {
      // Dense, as below: on rows strided by the other heads oneDNN 2.6 runs bf16 tiles on its jit
      // gemm, not on brgemm. Measured on one Xeon family 6 model 167 core (AMX-BF16), S = 2048
      // causal: Q K^T tiles (256x512x128) 0.52 ms strided against 0.07 ms dense.
      const uint16_t* src =
          static_cast<const uint16_t*>(base) + ((b * seq + row0) * heads + h) * dim;
      if (heads == 1) return {src, dim};
      uint16_t* dst = reinterpret_cast<uint16_t*>(buf);
      copy_dense(src, heads * dim, rows, dim, dst);
      return {dst, dim};
    }
    int64_t ld;
    const float* p = tile_f32(base, dtype, b, seq, heads, h, dim, row0, rows, buf, &ld);
    if (path == GemmPath::onednn && ld != dim) {
      // oneDNN runs its brgemm kernels only on dense operands; on rows strided by the other
      // heads it falls back to its jit sgemm. Measured on one Zen 4 core, 256x512x128 fp32 with
      // B transposed: 104 GFLOP/s dense, 81 strided; P V (256x128x512): 108 against 95. The
      // copy (the query tile once for all key tiles, K and V once a pair) costs a few percent.
      copy_dense(p, ld, rows, dim, buf);
      return {buf, dim};
    }
    return {p, ld};
  }

  // Whether rows() of a tensor of dtype with this many heads copies (or widens) into buf, not
  // reading the tensor in place.
  bool copies(DType dtype, int64_t heads) const {
    if (op == DType::bf16) return heads > 1;
    return dtype != DType::f32 || (path == GemmPath::onednn && heads > 1);
  }

  // o[bq, Dv] += P[bq, bk] V[bk, Dv]: P is fp32 in ws.s, and on the bf16 path also split into
  // ws.p_hi + ws.p_lo (split_row).
  void add_pv(Workspace& ws, int64_t bq, int64_t bk, const GemmOperand& V, int64_t Dv,
              float* o) const {
    if (op == DType::f32) {
      tile_gemm(path, op, bq, Dv, bk, 1.f, {ws.s, bk}, V, true, o, Dv);
      return;
    }
    tile_gemm(path, op, bq, Dv, bk, 1.f, {ws.p_hi, bk}, V, true, o, Dv);
    tile_gemm(path, op, bq, Dv, bk, 1.f, {ws.p_lo, bk}, V, true, o, Dv);
  }
  // X from its row r on (an operand's rows are its first index).
  GemmOperand from_row(const GemmOperand& X, int64_t r) const {
    return {static_cast<const char*>(X.ptr) + size_t(r * X.ld) * elem(), X.ld, X.trans};
  }
  // On the bf16 path, row i of P (ws.s, bk wide) into ws.p_hi and ws.p_lo, while it is in cache.
  void split_row(Workspace& ws, int64_t i, int64_t bk) const {
    if (op == DType::bf16) split_bf16(ws.s + i * bk, bk, ws.p_hi + i * bk, ws.p_lo + i * bk);
  }
};

// Keys are left out of a partially visible tile in steps of this many, and its query rows are
// taken this many at a time (see the kernel).
constexpr int64_t kTrimStep = 64;
constexpr int64_t kSubRows = 64;
// The most memory the forward takes to pack K and V once per call (see attention_forward): 8192
// keys of 8 kv heads at D = 128 in fp32 are 64 MiB.
constexpr size_t kMaxPackBytes = size_t(256) << 20;

// Whether hidden(j) for every j in [a, b).
template <class Hidden>
bool all_hidden(const Hidden& hidden, int64_t a, int64_t b) {
  for (int64_t j = a; j < b; ++j)
    if (!hidden(j)) return false;
  return true;
}

// Whether row r of a bshd operand of dtype op (cols values) is all finite.
bool row_finite(const Tiles& t, const GemmOperand& V, int64_t r, int64_t cols) {
  if (t.op == DType::f32) return all_finite(static_cast<const float*>(V.ptr) + r * V.ld, cols);
  const uint16_t* row = static_cast<const uint16_t*>(V.ptr) + r * V.ld;
  for (int64_t c = 0; c < cols; ++c)
    if (is_non_finite(row, DType::bf16, c)) return false;
  return true;
}

float value_at(const Tiles& t, const GemmOperand& V, int64_t r, int64_t c) {
  if (t.op == DType::f32) return static_cast<const float*>(V.ptr)[r * V.ld + c];
  return to_float(bf16{static_cast<const uint16_t*>(V.ptr)[r * V.ld + c]});
}

// O[bq, Dv] += P[bq, bk] V[bk, Dv] for a partially masked tile whose V has rows holding NaN or
// inf. A plain GEMM would multiply the exact zeros of P (masked pairs, rows that see nothing
// here) by them, and 0 * NaN = NaN would reach rows that never see that key. So the GEMM runs
// on a copy of V with those rows zeroed, and the pairs that do weigh a bad row (P != 0, or NaN)
// add it afterwards, so that a NaN or inf a row does see still reaches it. The clean rows' sums
// are the same GEMMs' over the same P, bit for bit what they are when those rows hold finite
// values.
void add_pv_sanitised(const Tiles& t, Workspace& ws, int64_t bq, int64_t bk, const GemmOperand& V,
                      int64_t Dv, float* o) {
  ws.bad.clear();
  const size_t row_bytes = size_t(Dv) * t.elem(), ld_bytes = size_t(V.ld) * t.elem();
  ws.vs.resize(size_t(bk) * ld_bytes);
  for (int64_t j = 0; j < bk; ++j) {
    char* dst = ws.vs.data() + size_t(j) * ld_bytes;
    if (row_finite(t, V, j, Dv)) {
      std::memcpy(dst, static_cast<const char*>(V.ptr) + size_t(j) * ld_bytes, row_bytes);
    } else {
      std::memset(dst, 0, row_bytes);
      ws.bad.push_back(j);
    }
  }
  t.add_pv(ws, bq, bk, {ws.vs.data(), V.ld}, Dv, o);
  for (int64_t j : ws.bad)
    for (int64_t i = 0; i < bq; ++i) {
      const float p = ws.s[i * bk + j];
      if (p == 0.f) continue;
      for (int64_t c = 0; c < Dv; ++c)
        o[i * Dv + c] += p * value_at(t, V, j, c);
    }
}

}  // namespace

// ---------------------------------------------------------------- the kernel
void attention_forward(const AttentionBlock& blk, float* out, float* lse) {
  const int64_t B = blk.batch, Hq = blk.heads_q, Hkv = blk.heads_kv;
  const int64_t D = blk.head_dim, Dv = blk.head_dim_v;
  const int64_t q_len = blk.q_rows(), k_len = blk.k_rows();
  blk.check();
  if (B == 0 || q_len <= 0 || k_len <= 0) return;
  const int64_t group = Hq / Hkv;
  const int64_t q_tiles = (q_len + kTileQ - 1) / kTileQ;
  const Mask mask = blk.mask;
  auto q_pos = [&](int64_t i) { return blk.q_position(i); };  // i: row of the block
  auto k_pos = [&](int64_t j) { return blk.k_position(j); };

  // Whole block hidden by the mask: nothing to do (ring steps in the future land here).
  if (mask.cover(q_pos(0), q_pos(q_len - 1), k_pos(0), k_pos(k_len - 1)) == Mask::Cover::none)
    return;

  const Tiles tiles(blk.dtype);
  // Called by the calling thread (OpenMP's master, thread 0) after each of its key tiles.
  const ProgressHook progress = progress_hook();
  // Each thread runs single-threaded BLAS on its own tiles.
  openblas_set_num_threads(1);

  // Workspaces are allocated here, before the parallel region, so that running out of memory
  // is a dattn::Error and not an exception escaping an OpenMP thread (std::terminate).
  std::vector<Workspace> workspaces;
  workspaces.reserve(size_t(omp_get_max_threads()));
  for (int t = 0; t < omp_get_max_threads(); ++t)
    workspaces.emplace_back(D, Dv, mask);

  // K and V as the tiles read them (dense rows of each kv head, in the operands' dtype), made
  // once here where rows() would copy or widen them for every (query tile, key tile) pair: a key
  // tile meets every query tile. The same values at the same leading dimension, so the same bits.
  // Measured on one Xeon family 6 model 167 core, S = 8192 H = 8 causal bf16 (AMX tiles): the
  // per-pair copies take 12% of the forward (perf).
  // Not past kMaxPackBytes (long sequences on one rank): there each tile pair copies its K and V.
  FirstError error;
  const int64_t k_panel = k_len * D, v_panel = k_len * Dv;  // elements per (batch, kv head)
  const size_t bytes = size_t(B * Hkv * (k_panel + v_panel)) * tiles.elem();
  const bool pack = q_tiles > 1 && tiles.copies(blk.dtype, Hkv) && bytes <= kMaxPackBytes;
  std::unique_ptr<char[], void (*)(void*)> packed{nullptr, std::free};
  if (pack) {
    packed.reset(static_cast<char*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)));
    if (!packed)
      DATTN_THROW_KIND(ErrorKind::out_of_memory, "out of host memory packing K and V (",
                       bytes >> 20, " MiB)");
  }
  // The packed rows of kv head hk from block row j0 on: K's panels, then V's.
  auto packed_k = [&](int64_t b, int64_t hk, int64_t j0) {
    return packed.get() + size_t((b * Hkv + hk) * k_panel + j0 * D) * tiles.elem();
  };
  auto packed_v = [&](int64_t b, int64_t hk, int64_t j0) {
    return packed.get() +
           size_t(B * Hkv * k_panel + (b * Hkv + hk) * v_panel + j0 * Dv) * tiles.elem();
  };
  if (pack) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t hk = 0; hk < Hkv; ++hk)
        error.run([&] {
          tiles.rows(blk.k, blk.dtype, b, blk.seq_k, Hkv, hk, D, blk.k_begin, k_len,
                     reinterpret_cast<float*>(packed_k(b, hk, 0)));
          tiles.rows(blk.v, blk.dtype, b, blk.seq_k, Hkv, hk, Dv, blk.k_begin, k_len,
                     reinterpret_cast<float*>(packed_v(b, hk, 0)));
        });
    error.rethrow();
  }

  // One (batch, head, query tile): its online softmax over the key tiles, then its merge.
  auto run_tile = [&](Workspace& ws, int64_t b, int64_t h, int64_t qt) {
    const int64_t hk = h / group;
    const int64_t i0 = qt * kTileQ;  // block row of the tile's first query
    const int64_t bq = std::min(kTileQ, q_len - i0);
    const GemmOperand Q =
        tiles.rows(blk.q, blk.dtype, b, blk.seq_q, Hq, h, D, blk.q_begin + i0, bq, ws.q);
    std::fill(ws.m, ws.m + bq, -INFINITY);
    std::fill(ws.l, ws.l + bq, 0.f);
    std::fill(ws.o, ws.o + bq * Dv, 0.f);
    const int64_t qlo = std::min(q_pos(i0), q_pos(i0 + bq - 1));
    const int64_t qhi = std::max(q_pos(i0), q_pos(i0 + bq - 1));

    // Rows [r0, r0 + nr) of the query tile against keys [j0, j0 + bk) (K and V from key j0):
    // S = scale Q K^T, the mask where cover is some, the online softmax, O += P V.
    auto key_block = [&](int64_t r0, int64_t nr, int64_t j0, int64_t bk, Mask::Cover cover,
                         const GemmOperand& K, const GemmOperand& V) {
      float *m = ws.m + r0, *l = ws.l + r0, *o = ws.o + r0 * Dv;
      tile_gemm(tiles.path, tiles.op, nr, bk, D, blk.scale, tiles.from_row(Q, r0),
                {K.ptr, K.ld, true}, false, ws.s, bk);
      if (cover == Mask::Cover::some)  // the keys' positions and documents, once
        ws.tile_mask.prepare(std::min(q_pos(i0 + r0), q_pos(i0 + r0 + nr - 1)),
                             std::max(q_pos(i0 + r0), q_pos(i0 + r0 + nr - 1)), bk,
                             [&](int64_t j) { return k_pos(j0 + j); });
      bool any_row = false;
      for (int64_t i = 0; i < nr; ++i) {
        float* srow = ws.s + i * bk;
        // The softcap row by row, while the row is in L1 for the max and exp that follow.
        if (blk.softcap > 0.f) softcap_row(srow, bk, blk.softcap);
        if (cover == Mask::Cover::some)
          (void)ws.tile_mask.hide(q_pos(i0 + r0 + i), srow, -INFINITY);
        const float m_new = std::max(m[i], row_max(srow, bk));
        if (m_new == -INFINITY) {  // row sees nothing yet: P row = 0, state unchanged
          // ... unless its scores are NaN (NaN or inf in its q or in a key it sees: hidden
          // keys are -inf by now), which max() passes over: the row's state becomes NaN,
          // so that its out and lse are NaN, not those of a row that sees nothing.
          if (has_nan(srow, bk)) m[i] = l[i] = NAN;
          std::fill(srow, srow + bk, 0.f);
          tiles.split_row(ws, i, bk);
          continue;
        }
        any_row = true;
        const float row_sum = exp_shift_sum(srow, bk, m_new);
        if (m_new != m[i]) {  // rescale the running state to the new max
          const float alpha = m[i] == -INFINITY ? 0.f : std::exp(m[i] - m_new);
          l[i] *= alpha;
          scale_row(o + i * Dv, Dv, alpha);
          m[i] = m_new;
        }
        l[i] += row_sum;
        tiles.split_row(ws, i, bk);
      }
      if (!any_row) return;
      // O += P V  [nr, Dv]. A partially masked block whose V holds NaN or inf takes the slow
      // path (add_pv_sanitised). Finding out costs a copy of O, not a scan of V: a NaN or
      // inf in column c of V makes column c of O NaN or inf in every row (P is finite, and
      // 0 * NaN, 0 * inf are NaN), so O's first row after the GEMM tells, and O is restored
      // from the copy. The copy reads O, hot in cache; scanning V, which the GEMM has not
      // read yet, cost 2% of a causal forward (S = 4096, one thread; perf). Fully visible
      // blocks need neither: every row sees every key there, so a NaN is theirs.
      const bool partial = cover == Mask::Cover::some;
      if (partial) std::copy(o, o + nr * Dv, ws.o_saved);
      tiles.add_pv(ws, nr, bk, V, Dv, o);
      if (partial && !all_finite(o, Dv)) {
        std::copy(ws.o_saved, ws.o_saved + nr * Dv, o);
        add_pv_sanitised(tiles, ws, nr, bk, V, Dv, o);
      }
    };
    // The keys of [j0, j0 + bk) that queries at [lo, hi] may see: the tile less the keys at its
    // ends that none of them sees (the far side of a causal diagonal or window edge), left out
    // in steps of kTrimStep so that the GEMM shapes stay few. Returns the kept [a, e) of [0, bk).
    auto trim = [&](int64_t lo, int64_t hi, int64_t j0, int64_t bk) {
      const auto hidden = [&](int64_t j) {
        return mask.cover(lo, hi, k_pos(j), k_pos(j)) == Mask::Cover::none;
      };
      int64_t a = 0, e = bk;
      while (e - a >= kTrimStep && all_hidden(hidden, j0 + e - kTrimStep, j0 + e))
        e -= kTrimStep;
      while (e - a >= kTrimStep && all_hidden(hidden, j0 + a, j0 + a + kTrimStep))
        a += kTrimStep;
      return std::pair{a, e};
    };
    auto cover_of = [&](int64_t lo, int64_t hi, int64_t j0, int64_t bk) {
      return mask.cover(lo, hi, std::min(k_pos(j0), k_pos(j0 + bk - 1)),
                        std::max(k_pos(j0), k_pos(j0 + bk - 1)));
    };

    for (int64_t tile0 = 0; tile0 < k_len; tile0 += kTileK) {
      int64_t j0 = tile0, bk = std::min(kTileK, k_len - tile0);
      Mask::Cover cover = cover_of(qlo, qhi, j0, bk);
      if (cover == Mask::Cover::none) continue;  // skipped, not computed and masked
      if (cover == Mask::Cover::some) {
        // On a causal mask the 256-row query tiles see half of a 512-key tile.
        const auto [a, e] = trim(qlo, qhi, j0, bk);
        if (a == e) continue;
        j0 += a, bk = e - a;
        cover = cover_of(qlo, qhi, j0, bk);
      }
      if (progress.fn != nullptr && omp_get_thread_num() == 0) progress();
      const GemmOperand K =
          pack ? GemmOperand{packed_k(b, hk, j0), D}
               : tiles.rows(blk.k, blk.dtype, b, blk.seq_k, Hkv, hk, D, blk.k_begin + j0, bk, ws.k);
      const GemmOperand V = pack ? GemmOperand{packed_v(b, hk, j0), Dv}
                                 : tiles.rows(blk.v, blk.dtype, b, blk.seq_k, Hkv, hk, Dv,
                                              blk.k_begin + j0, bk, ws.v);
      if (cover == Mask::Cover::all || bq <= kSubRows) {
        key_block(0, bq, j0, bk, cover, K, V);
        continue;
      }
      // A partially visible tile in blocks of kSubRows query rows, each on the keys it may see:
      // on a causal diagonal the rows see a staircase, and a whole-tile GEMM would compute the
      // 256 x 256 triangle above it (3% of a causal forward at S = 8192).
      for (int64_t r0 = 0; r0 < bq; r0 += kSubRows) {
        const int64_t nr = std::min(kSubRows, bq - r0);
        const int64_t lo = std::min(q_pos(i0 + r0), q_pos(i0 + r0 + nr - 1));
        const int64_t hi = std::max(q_pos(i0 + r0), q_pos(i0 + r0 + nr - 1));
        const auto [a, e] = trim(lo, hi, j0, bk);
        if (a == e) continue;
        const Mask::Cover c = cover_of(lo, hi, j0 + a, e - a);
        if (c != Mask::Cover::none)
          key_block(r0, nr, j0 + a, e - a, c, tiles.from_row(K, a), tiles.from_row(V, a));
      }
    }

    // Normalise the tile's partial and merge it into the running partial.
    for (int64_t i = 0; i < bq; ++i) {
      if (ws.l[i] == 0.f) continue;  // saw no key: empty partial, identity of the merge
      float* orow = ws.o + i * Dv;
      scale_row(orow, Dv, 1.f / ws.l[i]);
      const int64_t row = blk.q_begin + i0 + i;
      merge_row(out + ((b * blk.seq_q + row) * Hq + h) * Dv, lse + (b * Hq + h) * blk.seq_q + row,
                orow, ws.m[i] + std::log(ws.l[i]), Dv);
    }
  };

  // A tile GEMM that fails (oneDNN) must not throw out of an OpenMP thread.
#pragma omp parallel
  {
    Workspace& ws = workspaces[size_t(omp_get_thread_num())];
#pragma omp for collapse(3) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t qt = 0; qt < q_tiles; ++qt)
          error.run([&] { run_tile(ws, b, h, qt); });
  }
  error.rethrow();
}

std::string cpu_kernel_info() {
  const char* core = openblas_get_corename();
  std::string info = detail::cat(
      "blas OpenBLAS core ", core ? core : "?", ", tiles ", kTileQ, "x", kTileK, " fp32 on ",
      gemm_info(DType::f32), ", bf16 on ",
      gemm_path(DType::bf16) == GemmPath::onednn ? gemm_info(DType::bf16)
      : gemm_path_runs(GemmPath::onednn, DType::bf16)
          ? detail::cat("fp32 (widened: oneDNN's bf16 tiles run at ",
                        std::lround(bf16_tile_speedup() * 100), "% of its fp32 rate here)")
          : std::string("fp32 (widened)"),
      ", softmax ", vec_math_isa(), ", decode ", decode_isa_name(decode_best_isa()));
  if (core != nullptr && std::strcmp(core, "Prescott") == 0)
    info += " (WARNING: generic BLAS kernels; set OPENBLAS_CORETYPE, see launch/mpirun.sh)";
  return info;
}

}  // namespace dattn::cpu
