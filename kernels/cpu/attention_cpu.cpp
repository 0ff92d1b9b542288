// The CPU attention kernel: for each (batch, query head, query tile) an online-softmax pass
// over the key tiles, with S = Q K^T and O += P V as BLAS sgemm calls on the tiles, then one
// merge of the tile's partial into the running partial (kernels/merge.h). NaN or inf where the
// mask hides it never reaches a row that does not see it (see add_pv_sanitised).
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
#include "kernels/cpu/vec_math.h"
#include "kernels/merge.h"
#include "src/base/error.h"

namespace dattn::cpu {

namespace {

// ---------------------------------------------------------------- workspace
// Per-thread tile buffers, allocated once per kernel call: O(tile), independent of S.
struct Workspace {
  std::unique_ptr<float[], void (*)(void*)> mem{nullptr, std::free};
  float* q = nullptr;               // [kTileQ, D]   converted queries (16-bit inputs only)
  float* k = nullptr;               // [kTileK, D]   converted keys
  float* v = nullptr;               // [kTileK, Dv]  converted values
  float* vs = nullptr;              // [kTileK, Dv]  values with non-finite rows zeroed (rare)
  float* s = nullptr;               // [kTileQ, kTileK] scores, then probabilities
  float* o = nullptr;               // [kTileQ, Dv]  unnormalised output accumulator
  float* o_saved = nullptr;         // [kTileQ, Dv]  o before a partially masked tile's O += P V
  float* m = nullptr;               // [kTileQ]      running row max
  float* l = nullptr;               // [kTileQ]      running row sum
  std::vector<int64_t> kpos, kdoc;  // [kTileK] key positions and documents of a masked tile
  std::vector<int64_t> bad;         // rows of V holding NaN or inf (add_pv_sanitised)

  Workspace(int64_t d, int64_t dv) : kpos(size_t(kTileK)), kdoc(size_t(kTileK)) {
    int64_t sizes[] = {kTileQ * d,  kTileK * d,  kTileK * dv, kTileK * dv, kTileQ * kTileK,
                       kTileQ * dv, kTileQ * dv, kTileQ,      kTileQ};
    int64_t total = 0;
    for (int64_t sz : sizes)
      total += (sz + 15) / 16 * 16;  // 64-byte aligned pieces
    mem.reset(static_cast<float*>(std::aligned_alloc(64, size_t(total) * sizeof(float))));
    if (!mem)
      DATTN_THROW_KIND(ErrorKind::out_of_memory,
                       "out of host memory allocating the attention workspace");
    float* p = mem.get();
    float** slots[] = {&q, &k, &v, &vs, &s, &o, &o_saved, &m, &l};
    for (int i = 0; i < 9; ++i) {
      *slots[i] = p;
      p += (sizes[i] + 15) / 16 * 16;
    }
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

// O[bq, Dv] += P[bq, bk] V[bk, Dv] for a partially masked tile whose V has rows holding NaN or
// inf. A plain GEMM would multiply the exact zeros of P (masked pairs, rows that see nothing
// here) by them, and 0 * NaN = NaN would reach rows that never see that key. So the GEMM runs
// on a copy of V with those rows zeroed, and the pairs that do weigh a bad row (P != 0, or NaN)
// add it afterwards, so that a NaN or inf a row does see still reaches it. The clean rows' sums
// are the GEMM's over the same P, bit for bit what they are when those rows hold finite values.
void add_pv_sanitised(const float* P, int64_t bq, int64_t bk, const float* V, int64_t ldv,
                      int64_t Dv, Workspace& ws) {
  ws.bad.clear();
  for (int64_t j = 0; j < bk; ++j) {
    const float* row = V + j * ldv;
    float* dst = ws.vs + j * Dv;
    if (all_finite(row, Dv)) {
      std::copy(row, row + Dv, dst);
    } else {
      std::fill(dst, dst + Dv, 0.f);
      ws.bad.push_back(j);
    }
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(bq), int(Dv), int(bk), 1.f, P, int(bk),
              ws.vs, int(Dv), 1.f, ws.o, int(Dv));
  for (int64_t j : ws.bad)
    for (int64_t i = 0; i < bq; ++i) {
      const float p = P[i * bk + j];
      if (p == 0.f) continue;
      for (int64_t c = 0; c < Dv; ++c)
        ws.o[i * Dv + c] += p * V[j * ldv + c];
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

  // Each thread runs single-threaded BLAS on its own tiles.
  openblas_set_num_threads(1);

  // Workspaces are allocated here, before the parallel region, so that running out of memory
  // is a dattn::Error and not an exception escaping an OpenMP thread (std::terminate).
  std::vector<Workspace> workspaces;
  workspaces.reserve(size_t(omp_get_max_threads()));
  for (int t = 0; t < omp_get_max_threads(); ++t)
    workspaces.emplace_back(D, Dv);

#pragma omp parallel
  {
    Workspace& ws = workspaces[size_t(omp_get_thread_num())];
#pragma omp for collapse(3) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < Hq; ++h) {
        for (int64_t qt = 0; qt < q_tiles; ++qt) {
          const int64_t hk = h / group;
          const int64_t i0 = qt * kTileQ;  // block row of the tile's first query
          const int64_t bq = std::min(kTileQ, q_len - i0);
          int64_t ldq;
          const float* Q =
              tile_f32(blk.q, blk.dtype, b, blk.seq_q, Hq, h, D, blk.q_begin + i0, bq, ws.q, &ldq);
          std::fill(ws.m, ws.m + bq, -INFINITY);
          std::fill(ws.l, ws.l + bq, 0.f);
          std::fill(ws.o, ws.o + bq * Dv, 0.f);
          const int64_t qlo = std::min(q_pos(i0), q_pos(i0 + bq - 1));
          const int64_t qhi = std::max(q_pos(i0), q_pos(i0 + bq - 1));

          for (int64_t j0 = 0; j0 < k_len; j0 += kTileK) {
            const int64_t bk = std::min(kTileK, k_len - j0);
            const int64_t klo = std::min(k_pos(j0), k_pos(j0 + bk - 1));
            const int64_t khi = std::max(k_pos(j0), k_pos(j0 + bk - 1));
            const Mask::Cover cover = mask.cover(qlo, qhi, klo, khi);
            if (cover == Mask::Cover::none) continue;  // skipped, not computed and masked
            int64_t ldk, ldv;
            const float* K = tile_f32(blk.k, blk.dtype, b, blk.seq_k, Hkv, hk, D, blk.k_begin + j0,
                                      bk, ws.k, &ldk);
            const float* V = tile_f32(blk.v, blk.dtype, b, blk.seq_k, Hkv, hk, Dv, blk.k_begin + j0,
                                      bk, ws.v, &ldv);
            // S = scale * Q K^T  [bq, bk]
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(bq), int(bk), int(D),
                        blk.scale, Q, int(ldq), K, int(ldk), 0.f, ws.s, int(bk));
            if (cover == Mask::Cover::some) {  // the tile's key positions and documents, once
              for (int64_t j = 0; j < bk; ++j) {
                ws.kpos[size_t(j)] = k_pos(j0 + j);
                ws.kdoc[size_t(j)] = mask.document_of(ws.kpos[size_t(j)]);
              }
            }
            bool any_row = false;
            for (int64_t i = 0; i < bq; ++i) {
              float* srow = ws.s + i * bk;
              if (cover == Mask::Cover::some) {
                const int64_t qp = q_pos(i0 + i), qdoc = mask.document_of(qp);
                for (int64_t j = 0; j < bk; ++j)
                  if (!mask.in_band(qp, ws.kpos[size_t(j)]) || ws.kdoc[size_t(j)] != qdoc)
                    srow[j] = -INFINITY;
              }
              const float m_new = std::max(ws.m[i], row_max(srow, bk));
              if (m_new == -INFINITY) {  // row sees nothing yet: P row = 0, state unchanged
                // ... unless its scores are NaN (NaN or inf in its q or in a key it sees: hidden
                // keys are -inf by now), which max() passes over: the row's state becomes NaN,
                // so that its out and lse are NaN, not those of a row that sees nothing.
                if (has_nan(srow, bk)) ws.m[i] = ws.l[i] = NAN;
                std::fill(srow, srow + bk, 0.f);
                continue;
              }
              any_row = true;
              const float row_sum = exp_shift_sum(srow, bk, m_new);
              if (m_new != ws.m[i]) {  // rescale the running state to the new max
                const float alpha = ws.m[i] == -INFINITY ? 0.f : std::exp(ws.m[i] - m_new);
                ws.l[i] *= alpha;
                scale_row(ws.o + i * Dv, Dv, alpha);
                ws.m[i] = m_new;
              }
              ws.l[i] += row_sum;
            }
            if (!any_row) continue;
            // O += P V  [bq, Dv]. A partially masked tile whose V holds NaN or inf takes the slow
            // path (add_pv_sanitised). Finding out costs a copy of O, not a scan of V: a NaN or
            // inf in column c of V makes column c of O NaN or inf in every row (P is finite, and
            // 0 * NaN, 0 * inf are NaN), so O's row 0 after the GEMM tells, and O is restored
            // from the copy. The copy reads O, hot in cache; scanning V, which the GEMM has not
            // read yet, cost 2% of a causal forward (S = 4096, one thread; perf). Fully visible
            // tiles need neither: every row sees every key there, so a NaN is theirs.
            const bool partial = cover == Mask::Cover::some;
            if (partial) std::copy(ws.o, ws.o + bq * Dv, ws.o_saved);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(bq), int(Dv), int(bk), 1.f,
                        ws.s, int(bk), V, int(ldv), 1.f, ws.o, int(Dv));
            if (partial && !all_finite(ws.o, Dv)) {
              std::copy(ws.o_saved, ws.o_saved + bq * Dv, ws.o);
              add_pv_sanitised(ws.s, bq, bk, V, ldv, Dv, ws);
            }
          }

          // Normalise the tile's partial and merge it into the running partial.
          for (int64_t i = 0; i < bq; ++i) {
            if (ws.l[i] == 0.f) continue;  // saw no key: empty partial, identity of the merge
            float* orow = ws.o + i * Dv;
            scale_row(orow, Dv, 1.f / ws.l[i]);
            const int64_t row = blk.q_begin + i0 + i;
            merge_row(out + ((b * blk.seq_q + row) * Hq + h) * Dv,
                      lse + (b * Hq + h) * blk.seq_q + row, orow, ws.m[i] + std::log(ws.l[i]), Dv);
          }
        }
      }
    }
  }
}

std::string cpu_kernel_info() {
  const char* core = openblas_get_corename();
  std::string info =
      detail::cat("blas OpenBLAS core ", core ? core : "?", ", softmax ", vec_math_isa(),
                  ", tiles ", kTileQ, "x", kTileK, ", decode ", decode_isa_name(decode_best_isa()));
  if (core != nullptr && std::strcmp(core, "Prescott") == 0)
    info += " (WARNING: generic BLAS kernels; set OPENBLAS_CORETYPE, see launch/mpirun.sh)";
  return info;
}

}  // namespace dattn::cpu
