// The CPU attention backward kernel. For each pair of a query tile and a key tile the mask does
// not hide: S = scale Q K^T and P = exp(S - lse) recomputed from the final lse, dP = dO V^T,
// dS = P (dP - delta), then dV += P^T dO, dK += scale dS^T Q, dQ += scale dS K, all tile GEMMs
// (kernels/cpu/tile_gemm.h): fp32 (16-bit inputs widened), or where the CPU multiplies bf16 at
// full speed and the inputs and dO are bf16, bf16 read in place with P and dS split into two
// bf16 terms each (as the forward splits P), so that the gradients keep fp32-level accuracy. Each
// output element is written by one thread, in one fixed order. NaN or inf where the mask hides it
// never reaches a gradient of a row or key that does not see it (see p_and_ds).
#include "kernels/cpu/attention_backward_cpu.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "kernels/cpu/finite.h"
#include "kernels/cpu/first_error.h"
#include "kernels/cpu/tile_gemm.h"
#include "kernels/cpu/tile_mask.h"
#include "kernels/cpu/vec_math.h"
#include "src/base/error.h"

namespace dattn::cpu {

namespace {

// Tile sizes of the backward: the forward's (see attention_cpu.h), measured best here too (fused
// schedule, S = 4096, H = 8, D = 128, fp32, 2 threads, best of runs, GFLOP/s at 2.5x the forward's
// FLOPs): 256 x 512 226, 512 x 512 215, 128 x 256 209, 256 x 256 206, 128 x 512 183; one thread,
// H = 1: 128, 124, 119, 126, 123.
constexpr int64_t kBwdTileQ = kTileQ;
constexpr int64_t kBwdTileK = kTileK;

// An fp32 tile: its first element and leading dimension; on the bf16 GEMM path also the same
// rows in the bf16 tensor itself (raw: null for a widened copy with rows zeroed).
struct Tile {
  const float* ptr = nullptr;
  int64_t ld = 0;
  const uint16_t* raw = nullptr;
  int64_t raw_ld = 0;
};

// Whether an operand tile holds NaN or inf, remembered while the same tile comes back (a key
// tile meets several query tiles and heads in a row, a query tile several key tiles): the tile
// (batch, head, tile index) and its rows that do, whose zeroed copy is in the tile's buffer.
struct TileCheck {
  int64_t b = -1, head = -1, tile = -1;
  std::vector<int64_t> bad;
};

// ---------------------------------------------------------------- workspace
// Per-thread tile buffers, allocated once per call: O(tile), independent of S.
struct Workspace {
  std::unique_ptr<float[], void (*)(void*)> mem{nullptr, std::free};
  float* q = nullptr;     // [kBwdTileQ, D]   converted queries (16-bit inputs only)
  float* dout = nullptr;  // [kBwdTileQ, Dv]  converted output gradients
  float* k = nullptr;     // [kBwdTileK, D]   converted keys
  float* v = nullptr;     // [kBwdTileK, Dv]  converted values
  float* p = nullptr;     // [kBwdTileQ, kBwdTileK] scores, then probabilities P
  float* ds = nullptr;    // [kBwdTileQ, kBwdTileK] dP, then dS
  float* t = nullptr;     // [kBwdTileQ, kBwdTileK] tanh(S / softcap), with a softcap
  // Q, dO and K tiles with their non-finite rows zeroed (rare), at the tiles' own leading
  // dimensions (the GEMM kernels' blocking, and so the bits of clean rows, depend on them), and
  // the same of the raw bf16 rows on the bf16 GEMM path. Sized when first needed.
  std::vector<float> qs, dos, ks;
  std::vector<uint16_t> qs16, dos16, ks16;
  // On the bf16 GEMM path, the raw rows of the Q, dO, K and V tiles copied dense (set_raw).
  std::vector<uint16_t> q16, dout16, k16, v16;
  TileMask tile_mask;       // the mask on a partially masked tile pair
  std::vector<char> empty;  // [kBwdTileQ] rows whose P is all zero in this tile pair
  // The bf16 GEMM path: P and dS of the pair as two bf16 terms each (vec_math.h's split_bf16),
  // made when a GEMM first needs them.
  std::vector<uint16_t> p_hi, p_lo, ds_hi, ds_lo;  // [kBwdTileQ, kBwdTileK]
  bool p_split = false, ds_split = false;
  // Set by p_and_ds for the tile pair at hand: the Q, dO and K operands of the dK, dV and dQ
  // GEMMs (the tiles, or copies in qs, dos, ks with their NaN/inf rows zeroed, in a partially
  // masked pair), those rows (null: none), and whether there are any.
  Tile q_use, dout_use, k_use;
  const std::vector<int64_t>*q_bad = nullptr, *dout_bad = nullptr, *k_bad = nullptr;
  bool dirty = false;
  TileCheck q_check, dout_check, k_check;  // the last tiles scanned

  Workspace(int64_t d, int64_t dv, const Mask& mask)
      : tile_mask(mask, kBwdTileK), empty(size_t(kBwdTileQ)) {
    const int64_t sizes[] = {kBwdTileQ * d,        kBwdTileQ * dv,        kBwdTileK * d,
                             kBwdTileK * dv,       kBwdTileQ * kBwdTileK, kBwdTileQ * kBwdTileK,
                             kBwdTileQ * kBwdTileK};
    int64_t total = 0;
    for (int64_t sz : sizes)
      total += (sz + 15) / 16 * 16;  // 64-byte aligned pieces
    mem.reset(static_cast<float*>(std::aligned_alloc(64, size_t(total) * sizeof(float))));
    if (!mem)
      DATTN_THROW_KIND(ErrorKind::out_of_memory,
                       "out of host memory allocating the attention backward workspace");
    float* ptr = mem.get();
    float** slots[] = {&q, &dout, &k, &v, &p, &ds, &t};
    for (int i = 0; i < 7; ++i) {
      *slots[i] = ptr;
      ptr += (sizes[i] + 15) / 16 * 16;
    }
  }
};

// Rows [row0, row0 + rows) of head h of a bshd tensor as an fp32 matrix with leading dimension
// *ld: the tensor itself for fp32 (no copy), else converted into buf.
const float* tile_f32(const void* base, DType dtype, int64_t b, int64_t seq, int64_t heads,
                      int64_t h, int64_t dim, int64_t row0, int64_t rows, float* buf, int64_t* ld) {
  const int64_t offset = ((b * seq + row0) * heads + h) * dim;
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

// Tile (b, head, tile) t itself when its rows x cols are all finite; else a copy in buf, at t's
// leading dimension, with the rows that hold NaN or inf zeroed, listed in c.bad, and on the bf16
// GEMM path (t.raw) the same copy of the raw rows in raw_buf, so that a pair's GEMMs have the
// same shapes and path whatever the values. Scans t only when c does not already hold this
// tile's answer (and the buffers its copies).
Tile sanitised(TileCheck& c, int64_t b, int64_t head, int64_t tile, Tile t, int64_t rows,
               int64_t cols, std::vector<float>& buf, std::vector<uint16_t>& raw_buf) {
  if (c.b != b || c.head != head || c.tile != tile) {
    c.b = b;
    c.head = head;
    c.tile = tile;
    c.bad.clear();
    if (!all_finite(t.ptr, rows, cols, t.ld)) {
      buf.resize(size_t(rows * t.ld));
      if (t.raw != nullptr) raw_buf.resize(size_t(rows * t.raw_ld));
      for (int64_t r = 0; r < rows; ++r) {
        const float* src = t.ptr + r * t.ld;
        float* dst = buf.data() + r * t.ld;
        const bool ok = all_finite(src, cols);
        if (ok) {
          std::copy(src, src + cols, dst);
        } else {
          std::fill(dst, dst + cols, 0.f);
          c.bad.push_back(r);
        }
        if (t.raw != nullptr) {
          const uint16_t* raw_src = t.raw + r * t.raw_ld;
          uint16_t* raw_dst = raw_buf.data() + r * t.raw_ld;
          if (ok)
            std::copy(raw_src, raw_src + cols, raw_dst);
          else
            std::fill(raw_dst, raw_dst + cols, uint16_t(0));
        }
      }
    }
  }
  if (c.bad.empty()) return t;
  return Tile{buf.data(), t.ld, t.raw != nullptr ? raw_buf.data() : nullptr, t.raw_ld};
}

// Whether column 0 of x[rows, cols] (leading dimension cols) is finite.
bool column0_finite(const float* x, int64_t rows, int64_t cols) {
  bool ok = true;
  for (int64_t r = 0; r < rows; ++r)
    ok &= all_finite(x + r * cols, 1);
  return ok;
}

// ---------------------------------------------------------------- one call's geometry
struct Problem {
  const AttentionBlock& blk;
  const void* dout;
  DType dout_dtype;
  const float* lse;
  const float* delta;
  int64_t B, Hq, Hkv, D, Dv, group, q_len, k_len, q_tiles, k_tiles;
  GemmPath path;  // of the fp32 tile GEMMs
  // bf16 inputs and output gradient on a CPU where bf16 tiles pay (bf16_tiles_pay): the GEMMs read
  // them in place (Tile::raw), and P and dS enter as two bf16 terms each, as in the forward.
  bool bf16_gemms;

  // C[M, N] = alpha A B (+ C when accumulate), fp32.
  void gemm(int64_t M, int64_t N, int64_t K, float alpha, const GemmOperand& A,
            const GemmOperand& B, bool accumulate, float* C, int64_t ldc) const {
    tile_gemm(path, DType::f32, M, N, K, alpha, A, B, accumulate, C, ldc);
  }
  // C = alpha A B^T (+ C) of two tiles: in bf16 where both have their raw rows, else fp32.
  void gemm_abt(int64_t M, int64_t N, int64_t K, float alpha, const Tile& A, const Tile& B,
                bool accumulate, float* C, int64_t ldc) const {
    if (A.raw != nullptr && B.raw != nullptr)
      tile_gemm(GemmPath::onednn, DType::bf16, M, N, K, alpha, {A.raw, A.raw_ld},
                {B.raw, B.raw_ld, true}, accumulate, C, ldc);
    else
      gemm(M, N, K, alpha, {A.ptr, A.ld}, {B.ptr, B.ld, true}, accumulate, C, ldc);
  }
  // C += alpha op(X) B, X fp32 [bq, bk] (leading dimension bk; op: transposed when trans). Where
  // B has its raw bf16 rows, X is split into hi + lo once (split) and both terms are multiplied
  // in bf16; else one fp32 GEMM.
  void gemm_x(int64_t M, int64_t N, int64_t K, float alpha, const float* X, int64_t bq, int64_t bk,
              bool trans, std::vector<uint16_t>& hi, std::vector<uint16_t>& lo, bool& split,
              const Tile& B, float* C, int64_t ldc) const {
    if (B.raw == nullptr) {
      gemm(M, N, K, alpha, {X, bk, trans}, {B.ptr, B.ld}, true, C, ldc);
      return;
    }
    if (!split) {
      hi.resize(size_t(kBwdTileQ * kBwdTileK));  // no-ops after the first pair
      lo.resize(size_t(kBwdTileQ * kBwdTileK));
      split_bf16(X, bq * bk, hi.data(), lo.data());
    }
    split = true;
    for (const uint16_t* term : {hi.data(), lo.data()})
      tile_gemm(GemmPath::onednn, DType::bf16, M, N, K, alpha, {term, bk, trans}, {B.raw, B.raw_ld},
                true, C, ldc);
  }
  // A tile's rows of the bf16 tensor, on the bf16 GEMM path: in place for one head, else copied
  // dense into buf (oneDNN runs bf16 tiles strided by the other heads on its jit gemm, several
  // times slower than its brgemm; see the forward's Tiles::rows).
  void set_raw(Tile& t, const void* base, int64_t b, int64_t seq, int64_t heads, int64_t h,
               int64_t dim, int64_t row0, int64_t rows, std::vector<uint16_t>& buf) const {
    if (!bf16_gemms) return;
    const uint16_t* src = static_cast<const uint16_t*>(base) + ((b * seq + row0) * heads + h) * dim;
    t.raw = src;
    t.raw_ld = dim;
    if (heads == 1) return;
    buf.resize(size_t(rows * dim));
    copy_dense(src, heads * dim, rows, dim, buf.data());
    t.raw = buf.data();
  }

  // An fp32 tile in place with rows strided by the other heads, copied dense into buf on the
  // oneDNN path: oneDNN runs its brgemm kernels only on dense operands (see the forward's
  // Tiles::rows).
  void dense(Tile& t, int64_t rows, int64_t dim, float* buf) const {
    if (path != GemmPath::onednn || t.ld == dim) return;
    copy_dense(t.ptr, t.ld, rows, dim, buf);
    t.ptr = buf;
    t.ld = dim;
  }

  int64_t q_pos(int64_t i) const { return blk.q_position(i); }  // i: row of the block
  int64_t k_pos(int64_t j) const { return blk.k_position(j); }
  // Query tile it: first block row and rows.
  int64_t q_row0(int64_t it) const { return it * kBwdTileQ; }
  int64_t q_rows(int64_t it) const { return std::min(kBwdTileQ, q_len - it * kBwdTileQ); }
  int64_t k_row0(int64_t jt) const { return jt * kBwdTileK; }
  int64_t k_rows(int64_t jt) const { return std::min(kBwdTileK, k_len - jt * kBwdTileK); }
  // How query tile it meets key tile jt under the mask.
  Mask::Cover cover(int64_t it, int64_t jt) const {
    const int64_t i0 = q_row0(it), i1 = i0 + q_rows(it) - 1;
    const int64_t j0 = k_row0(jt), j1 = j0 + k_rows(jt) - 1;
    return blk.mask.cover(std::min(q_pos(i0), q_pos(i1)), std::max(q_pos(i0), q_pos(i1)),
                          std::min(k_pos(j0), k_pos(j1)), std::max(k_pos(j0), k_pos(j1)));
  }

  Tile q_tile(Workspace& ws, int64_t b, int64_t h, int64_t it) const {
    Tile t;
    t.ptr = tile_f32(blk.q, blk.dtype, b, blk.seq_q, Hq, h, D, blk.q_begin + q_row0(it), q_rows(it),
                     ws.q, &t.ld);
    dense(t, q_rows(it), D, ws.q);
    set_raw(t, blk.q, b, blk.seq_q, Hq, h, D, blk.q_begin + q_row0(it), q_rows(it), ws.q16);
    return t;
  }
  Tile dout_tile(Workspace& ws, int64_t b, int64_t h, int64_t it) const {
    Tile t;
    t.ptr = tile_f32(dout, dout_dtype, b, blk.seq_q, Hq, h, Dv, blk.q_begin + q_row0(it),
                     q_rows(it), ws.dout, &t.ld);
    dense(t, q_rows(it), Dv, ws.dout);
    set_raw(t, dout, b, blk.seq_q, Hq, h, Dv, blk.q_begin + q_row0(it), q_rows(it), ws.dout16);
    return t;
  }
  Tile k_tile(Workspace& ws, int64_t b, int64_t hk, int64_t jt) const {
    Tile t;
    t.ptr = tile_f32(blk.k, blk.dtype, b, blk.seq_k, Hkv, hk, D, blk.k_begin + k_row0(jt),
                     k_rows(jt), ws.k, &t.ld);
    dense(t, k_rows(jt), D, ws.k);
    set_raw(t, blk.k, b, blk.seq_k, Hkv, hk, D, blk.k_begin + k_row0(jt), k_rows(jt), ws.k16);
    return t;
  }
  Tile v_tile(Workspace& ws, int64_t b, int64_t hk, int64_t jt) const {
    Tile t;
    t.ptr = tile_f32(blk.v, blk.dtype, b, blk.seq_k, Hkv, hk, Dv, blk.k_begin + k_row0(jt),
                     k_rows(jt), ws.v, &t.ld);
    dense(t, k_rows(jt), Dv, ws.v);
    set_raw(t, blk.v, b, blk.seq_k, Hkv, hk, Dv, blk.k_begin + k_row0(jt), k_rows(jt), ws.v16);
    return t;
  }

  // P and dS of query tile it of head h against key tile jt, into ws.p and ws.ds ([bq, bk],
  // leading dimension bk). Returns false when P is all zero (nothing to add): every row either
  // saw no key at all (lse = -inf) or is hidden from this tile by the mask. Every schedule calls
  // this with the same arguments for a tile pair, so P and dS are bitwise the same in all.
  //
  // Non-finite values where the mask hides them. P is exactly 0 at a hidden pair, but a GEMM
  // multiplies that 0 by whatever the other operand holds, and 0 * NaN = NaN would reach every
  // key (dK, dV) or query (dQ) of the tile. So: a row with P = 0 everywhere gets dS = 0 exactly
  // (its dout and delta may be garbage); in a partially masked pair every P = 0 pair gets
  // dS = 0 exactly (dP = dO V^T may be NaN there), a row whose lse is not finite gets its
  // hidden pairs' zeros back after the exp, and when Q, dO or K hold NaN or inf the dK, dV and
  // dQ GEMMs take copies with those rows zeroed (ws.q_use, ws.dout_use, ws.k_use), the pairs
  // that weigh such a row (P != 0) being added one by one after them (add_bad_rows_dk_dv,
  // query_update). Fully visible pairs need none of it: every row sees every key there.
  //
  // Finding NaN/inf in Q, K and dO costs bq + bk reads, not a scan of the tiles: a NaN or inf in
  // row i of Q makes all of row i of S = Q K^T NaN or inf (x * NaN, x * inf and 0 * inf are, and
  // so is any sum with them), one in row j of K all of column j; finite operands give a finite S
  // (an overflow would only take the slow path). So S's row 0 and column 0 tell whether Q and K
  // need scanning for their bad rows, and the column 0 of dP = dO V^T tells it of dO. Scanning
  // the tiles instead cost 1.6% of a causal backward (S = 4096, one thread; perf).
  bool p_and_ds(Workspace& ws, int64_t b, int64_t h, int64_t it, int64_t jt, Mask::Cover cover,
                Tile Q, Tile dO, Tile K, Tile V) const {
    const int64_t i0 = q_row0(it), bq = q_rows(it);
    const int64_t j0 = k_row0(jt), bk = k_rows(jt);
    const int64_t row0 = (b * Hq + h) * blk.seq_q + blk.q_begin + i0;  // into lse and delta
    const bool partial = cover == Mask::Cover::some;
    ws.q_use = Q;
    ws.dout_use = dO;
    ws.k_use = K;
    ws.q_bad = ws.dout_bad = ws.k_bad = nullptr;
    ws.dirty = false;
    ws.p_split = ws.ds_split = false;
    // S = scale * Q K^T [bq, bk], rounded like the forward's.
    gemm_abt(bq, bk, D, blk.scale, Q, K, false, ws.p, bk);
    if (partial && !(all_finite(ws.p, bk) && column0_finite(ws.p, bq, bk))) {  // Q or K: which rows
      ws.q_use = sanitised(ws.q_check, b, h, it, Q, bq, D, ws.qs, ws.qs16);
      ws.k_use = sanitised(ws.k_check, b, h / group, jt, K, bk, D, ws.ks, ws.ks16);
      if (!ws.q_check.bad.empty()) ws.q_bad = &ws.q_check.bad;
      if (!ws.k_check.bad.empty()) ws.k_bad = &ws.k_check.bad;
    }
    // The softcap, as the forward applies it (after the checks above, which read the raw S).
    if (blk.softcap > 0.f) softcap_row(ws.p, bq * bk, blk.softcap, ws.t);
    if (partial) {
      const int64_t q_a = q_pos(i0), q_b = q_pos(i0 + bq - 1);
      ws.tile_mask.prepare(std::min(q_a, q_b), std::max(q_a, q_b), bk,
                           [&](int64_t j) { return k_pos(j0 + j); });
    }
    bool any = false;
    for (int64_t i = 0; i < bq; ++i) {
      float* prow = ws.p + i * bk;
      const float l = lse[row0 + i];
      ws.empty[size_t(i)] = 1;
      if (l == -INFINITY) {  // the row saw no key: exp(S - lse) would be +inf or NaN
        std::fill(prow, prow + bk, 0.f);
        continue;
      }
      if (partial && !ws.tile_mask.hide(q_pos(i0 + i), prow, -INFINITY)) {
        std::fill(prow, prow + bk, 0.f);
        continue;
      }
      // P = exp(S - lse): S <= lse up to rounding, so no overflow; masked -inf gives exactly 0.
      (void)exp_shift_sum(prow, bk, l);
      if (partial && !std::isfinite(l))  // lse NaN: exp(-inf - NaN) is NaN, not 0
        (void)ws.tile_mask.hide(q_pos(i0 + i), prow, 0.f);
      ws.empty[size_t(i)] = 0;
      any = true;
    }
    if (!any) return false;
    // dP = dO V^T [bq, bk]
    gemm_abt(bq, bk, Dv, 1.f, dO, V, false, ws.ds, bk);
    if (partial && !column0_finite(ws.ds, bq, bk)) {  // dO holds NaN or inf (or V row 0): rows
      ws.dout_use = sanitised(ws.dout_check, b, h, it, dO, bq, Dv, ws.dos, ws.dos16);
      if (!ws.dout_check.bad.empty()) ws.dout_bad = &ws.dout_check.bad;
    }
    ws.dirty = ws.q_bad != nullptr || ws.dout_bad != nullptr || ws.k_bad != nullptr;
    // dS = P (dP - delta).
    for (int64_t i = 0; i < bq; ++i) {
      const float* prow = ws.p + i * bk;
      float* drow = ws.ds + i * bk;
      if (ws.empty[size_t(i)]) {
        std::fill(drow, drow + bk, 0.f);
        continue;
      }
      const float d = delta[row0 + i];
      if (partial) {
        // dS = 0 where P = +-0, as a mask on the bits: a float select compiles to branches here
        // (perf: the loop ran scalar, ~1% of a causal backward), the integer one vectorises.
        for (int64_t j = 0; j < bk; ++j) {
          const float ds = prow[j] * (drow[j] - d);
          uint32_t p_bits, ds_bits;
          std::memcpy(&p_bits, prow + j, sizeof(p_bits));
          std::memcpy(&ds_bits, &ds, sizeof(ds_bits));
          ds_bits &= (p_bits << 1) == 0 ? 0u : ~0u;
          std::memcpy(drow + j, &ds_bits, sizeof(ds_bits));
        }
      } else {
        for (int64_t j = 0; j < bk; ++j)
          drow[j] = prow[j] * (drow[j] - d);
      }
      // Through the softcap: d(cap tanh(s / cap)) / ds = 1 - tanh^2.
      if (blk.softcap > 0.f) {
        const float* trow = ws.t + i * bk;
        for (int64_t j = 0; j < bk; ++j)
          drow[j] *= 1.f - trow[j] * trow[j];
      }
    }
    return true;
  }

  // After the dV and dK GEMMs of a dirty pair: the pairs (P != 0) of the Q and dO rows that
  // ws.q_use and ws.dout_use zeroed, one by one, with the tiles' own values.
  void add_bad_rows_dk_dv(const Workspace& ws, int64_t bk, Tile Q, Tile dO, float* dk_t,
                          float* dv_t) const {
    if (ws.dout_bad != nullptr)
      for (int64_t i : *ws.dout_bad)
        for (int64_t j = 0; j < bk; ++j) {
          const float p = ws.p[i * bk + j];
          if (p == 0.f) continue;
          for (int64_t c = 0; c < Dv; ++c)
            dv_t[j * Hkv * Dv + c] += p * dO.ptr[i * dO.ld + c];
        }
    if (ws.q_bad != nullptr)
      for (int64_t i : *ws.q_bad)
        for (int64_t j = 0; j < bk; ++j) {
          if (ws.p[i * bk + j] == 0.f) continue;
          const float g = blk.scale * ws.ds[i * bk + j];
          for (int64_t c = 0; c < D; ++c)
            dk_t[j * Hkv * D + c] += g * Q.ptr[i * Q.ld + c];
        }
  }

  float* dq_at(float* dq, int64_t b, int64_t h, int64_t it) const {
    return dq + ((b * blk.seq_q + blk.q_begin + q_row0(it)) * Hq + h) * D;
  }
  float* dk_at(float* dk, int64_t b, int64_t hk, int64_t jt) const {
    return dk + ((b * blk.seq_k + blk.k_begin + k_row0(jt)) * Hkv + hk) * D;
  }
  float* dv_at(float* dv, int64_t b, int64_t hk, int64_t jt) const {
    return dv + ((b * blk.seq_k + blk.k_begin + k_row0(jt)) * Hkv + hk) * Dv;
  }

  // dk, dv of key tile jt of kv head hk: the query tiles in order, the group's query heads in
  // order inside each. With dq != nullptr also dq of those heads (the fused schedule, where this
  // task owns them): query tile it of head h receives key tile jt's part after jt - 1's.
  void key_tile(Workspace& ws, int64_t b, int64_t hk, int64_t jt, float* dq, float* dk,
                float* dv) const {
    const int64_t bk = k_rows(jt);
    const Tile K = k_tile(ws, b, hk, jt), V = v_tile(ws, b, hk, jt);
    float* dk_t = dk_at(dk, b, hk, jt);
    float* dv_t = dv_at(dv, b, hk, jt);
    for (int64_t it = 0; it < q_tiles; ++it) {
      const Mask::Cover cover = this->cover(it, jt);
      if (cover == Mask::Cover::none) continue;  // skipped, not computed and masked
      const int64_t bq = q_rows(it);
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        const Tile Q = q_tile(ws, b, h, it), dO = dout_tile(ws, b, h, it);
        if (!p_and_ds(ws, b, h, it, jt, cover, Q, dO, K, V)) continue;
        // dV += P^T dO [bk, Dv]
        gemm_x(bk, Dv, bq, 1.f, ws.p, bq, bk, true, ws.p_hi, ws.p_lo, ws.p_split, ws.dout_use, dv_t,
               Hkv * Dv);
        // dK += scale dS^T Q [bk, D]
        gemm_x(bk, D, bq, blk.scale, ws.ds, bq, bk, true, ws.ds_hi, ws.ds_lo, ws.ds_split, ws.q_use,
               dk_t, Hkv * D);
        if (ws.dirty) add_bad_rows_dk_dv(ws, bk, Q, dO, dk_t, dv_t);
        if (dq != nullptr) query_update(ws, b, h, it, jt, K, dq);
      }
    }
  }

  // dQ += scale dS K [bq, D] for query tile it of head h, key tile jt (dS in ws.ds, and the
  // operand p_and_ds chose in ws.k_use); in a dirty pair, then the pairs (P != 0) of the K rows
  // it zeroed, one by one, with the tile's own values.
  void query_update(Workspace& ws, int64_t b, int64_t h, int64_t it, int64_t jt, Tile K,
                    float* dq) const {
    const int64_t bq = q_rows(it), bk = k_rows(jt);
    float* dq_t = dq_at(dq, b, h, it);
    gemm_x(bq, D, bk, blk.scale, ws.ds, bq, bk, false, ws.ds_hi, ws.ds_lo, ws.ds_split, ws.k_use,
           dq_t, Hq * D);
    if (!ws.dirty) return;
    if (ws.k_bad != nullptr)
      for (int64_t j : *ws.k_bad)
        for (int64_t i = 0; i < bq; ++i) {
          if (ws.p[i * bk + j] == 0.f) continue;
          const float g = blk.scale * ws.ds[i * bk + j];
          for (int64_t c = 0; c < D; ++c)
            dq_t[i * Hq * D + c] += g * K.ptr[j * K.ld + c];
        }
  }

  // dq of query tile it of head h: the key tiles in order (the two-pass schedule's second pass).
  void query_tile(Workspace& ws, int64_t b, int64_t h, int64_t it, float* dq) const {
    const int64_t hk = h / group;
    const Tile Q = q_tile(ws, b, h, it), dO = dout_tile(ws, b, h, it);
    for (int64_t jt = 0; jt < k_tiles; ++jt) {
      const Mask::Cover cover = this->cover(it, jt);
      if (cover == Mask::Cover::none) continue;
      const Tile K = k_tile(ws, b, hk, jt), V = v_tile(ws, b, hk, jt);
      if (!p_and_ds(ws, b, h, it, jt, cover, Q, dO, K, V)) continue;
      query_update(ws, b, h, it, jt, K, dq);
    }
  }
};

// Whether the fused schedule keeps `threads` busy enough: it runs B * H_kv tasks of 5 tile GEMMs
// per tile pair, so with whole tasks per thread it takes 5 * ceil(tasks / threads) units of time,
// where two_pass (7 GEMMs, finely divided) takes about 7 * tasks / threads.
bool fused_is_faster(int64_t tasks, int64_t threads) {
  const int64_t rounds = (tasks + threads - 1) / threads;
  return 5 * threads * rounds <= 7 * tasks;
}

}  // namespace

// ---------------------------------------------------------------- the kernel
void attention_backward(const AttentionBlock& blk, const void* dout, const float* lse,
                        const float* delta, float* dq, float* dk, float* dv,
                        BackwardSchedule schedule) {
  attention_backward(blk, dout, blk.dtype, lse, delta, dq, dk, dv, schedule);
}

// Determinism: every element of dq, dk, dv is accumulated by exactly one task, in an order that
// depends only on the tiles (for dk, dv: query tiles, then the group's heads; for dq: key tiles),
// never on the thread count or timing. The schedules compute the same tile pairs with the same
// calls, so they agree bitwise too, and `automatic` may pick either by thread count.
//
// Measured (S = 4096, D = 128, fp32, 2 threads, GFLOP/s at 2.5x the forward's FLOPs):
//   H = 8, none:   fused 232, two_pass 162  (8 tasks keep both threads busy: fused wins 1.44x)
//   H = 8, causal: fused 205, two_pass 145
//   H = 1, none:   fused 130, two_pass 178  (one task leaves a thread idle: two_pass wins 1.37x)
// which is what fused_is_faster predicts. Not tried: per-thread dq buffers summed at the end (one
// pass of 5 GEMMs over key tiles): they need a whole dq per thread (O(S), not O(tile)) and their
// sum order depends on the thread count, which the fused/two-pass pair avoids at the same speed
// where B * H_kv >= threads, and at 7/5 of the GEMMs where it is not.
void attention_backward(const AttentionBlock& blk, const void* dout, DType dout_dtype,
                        const float* lse, const float* delta, float* dq, float* dk, float* dv,
                        BackwardSchedule schedule) {
  const int64_t B = blk.batch, Hq = blk.heads_q, Hkv = blk.heads_kv;
  const int64_t D = blk.head_dim, Dv = blk.head_dim_v;
  const int64_t q_len = blk.q_rows(), k_len = blk.k_rows();
  blk.check();
  if (B == 0 || q_len <= 0 || k_len <= 0) return;
  const Problem pr{blk,
                   dout,
                   dout_dtype,
                   lse,
                   delta,
                   B,
                   Hq,
                   Hkv,
                   D,
                   Dv,
                   Hq / Hkv,
                   q_len,
                   k_len,
                   (q_len + kBwdTileQ - 1) / kBwdTileQ,
                   (k_len + kBwdTileK - 1) / kBwdTileK,
                   gemm_path(DType::f32),
                   blk.dtype == DType::bf16 && dout_dtype == DType::bf16 &&
                       gemm_path(DType::bf16) == GemmPath::onednn};

  // Whole block hidden by the mask: nothing to do.
  if (blk.mask.cover(std::min(pr.q_pos(0), pr.q_pos(q_len - 1)),
                     std::max(pr.q_pos(0), pr.q_pos(q_len - 1)),
                     std::min(pr.k_pos(0), pr.k_pos(k_len - 1)),
                     std::max(pr.k_pos(0), pr.k_pos(k_len - 1))) == Mask::Cover::none)
    return;

  // Each thread runs single-threaded BLAS on its own tiles.
  openblas_set_num_threads(1);
  const int threads = omp_get_max_threads();
  if (schedule == BackwardSchedule::automatic)
    schedule =
        fused_is_faster(B * Hkv, threads) ? BackwardSchedule::fused : BackwardSchedule::two_pass;

  // Allocated before the parallel region, so that running out of memory is a dattn::Error and
  // not an exception escaping an OpenMP thread.
  std::vector<Workspace> workspaces;
  workspaces.reserve(size_t(threads));
  for (int t = 0; t < threads; ++t)
    workspaces.emplace_back(D, Dv, blk.mask);

  // A tile GEMM that fails (oneDNN) must not throw out of an OpenMP thread.
  FirstError error;
  if (schedule == BackwardSchedule::fused) {
#pragma omp parallel
    {
      Workspace& ws = workspaces[size_t(omp_get_thread_num())];
#pragma omp for collapse(2) schedule(dynamic, 1)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t hk = 0; hk < Hkv; ++hk)
          error.run([&] {
            for (int64_t jt = 0; jt < pr.k_tiles; ++jt)
              pr.key_tile(ws, b, hk, jt, dq, dk, dv);
          });
    }
    error.rethrow();
    return;
  }

#pragma omp parallel
  {
    Workspace& ws = workspaces[size_t(omp_get_thread_num())];
    // Pass 1: dk, dv. Key tile 0 comes first in each head: under a causal mask it has the most
    // query tiles, and dynamic scheduling fills in behind it. nowait: the passes write different
    // tensors, so a thread done with pass 1 starts on pass 2 while the others finish.
#pragma omp for collapse(3) schedule(dynamic, 1) nowait
    for (int64_t b = 0; b < B; ++b)
      for (int64_t hk = 0; hk < Hkv; ++hk)
        for (int64_t jt = 0; jt < pr.k_tiles; ++jt)
          error.run([&] { pr.key_tile(ws, b, hk, jt, nullptr, dk, dv); });
          // Pass 2: dq.
#pragma omp for collapse(3) schedule(dynamic, 1) nowait
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t it = 0; it < pr.q_tiles; ++it)
          error.run([&] { pr.query_tile(ws, b, h, it, dq); });
  }
  error.rethrow();
}

void attention_backward_delta(const void* dout, DType dtype, const float* out, int64_t batch,
                              int64_t seq, int64_t heads, int64_t head_dim_v, float* delta) {
  const int64_t Dv = head_dim_v;
  auto rows = [&](auto load) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t s = 0; s < seq; ++s) {
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t row = (b * seq + s) * heads + h;
          const float* o = out + row * Dv;
          double sum = 0;
          for (int64_t d = 0; d < Dv; ++d)
            sum += double(load(row * Dv + d)) * double(o[d]);
          delta[(b * heads + h) * seq + s] = float(sum);
        }
      }
    }
  };
  switch (dtype) {
    case DType::f32: {
      const float* g = static_cast<const float*>(dout);
      rows([g](int64_t i) { return g[i]; });
      return;
    }
    case DType::bf16: {
      const bf16* g = static_cast<const bf16*>(dout);
      rows([g](int64_t i) { return to_float(g[i]); });
      return;
    }
    case DType::f16: {
      const f16* g = static_cast<const f16*>(dout);
      rows([g](int64_t i) { return to_float(g[i]); });
      return;
    }
  }
}

}  // namespace dattn::cpu
