// The float64 check of a decode step shared by the benchmarks: the exact attention of the S_q
// new queries (positions length - S_q .. length - 1) against every key 0 .. length - 1, causal on
// global positions, with rows regenerated from the benchmark's deterministic inputs in chunks.
// Collective over MPI_COMM_WORLD: rank r takes the chunks r, r + P, ..., keeping an online
// softmax state (max m, sum l, weighted sum acc) per query row and head; the states are
// allgathered and merged in float64, so O(chunk) memory and 1/P of the work per rank.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "collective/mpi_communicator.h"

namespace dattn::bench {

struct DecodeReference {
  std::vector<double> out;  // [B, S_q, H, D]
  std::vector<double> lse;  // [B, H, S_q]
};

struct DecodeShape {
  int64_t batch, new_tokens, heads, kv_heads, head_dim;  // D_v = head_dim, scale 1/sqrt(D)
};

// row(id, b, pos, h, dim, out) writes the `dim` stored values of one row of tensor `id`
// (q_id, k_id or v_id) at batch b, global position pos, head h.
template <typename RowFn>
DecodeReference decode_reference(const DecodeShape& o, int64_t length, uint64_t q_id, uint64_t k_id,
                                 uint64_t v_id, const RowFn& row) {
  int P = 1, r = 0;
  DATTN_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &P));
  DATTN_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &r));
  const int64_t B = o.batch, Sq = o.new_tokens, H = o.heads, G = o.kv_heads, D = o.head_dim;
  const int64_t Dv = D, group = H / G;
  const double scale = double(1.0f / std::sqrt(float(D)));  // AttnSpec::scale()
  const int64_t pos0 = length - Sq;
  const int64_t rows = Sq * H;   // per batch, row index j * H + h
  const int64_t state = Dv + 2;  // m, l, acc[Dv]
  constexpr int64_t kChunk = 256;
  std::vector<double> mine(size_t(B * rows * state), 0.0);

  for (int64_t b = 0; b < B; ++b) {
    std::vector<double> qv(size_t(rows * D));
    {
      std::vector<float> vals(static_cast<size_t>(D));
      for (int64_t j = 0; j < Sq; ++j)
        for (int64_t h = 0; h < H; ++h) {
          row(q_id, b, pos0 + j, h, D, vals.data());
          std::copy(vals.begin(), vals.end(), qv.begin() + (j * H + h) * D);
        }
    }
    std::vector<double> m(size_t(rows), -INFINITY), l(size_t(rows), 0.0),
        acc(size_t(rows * Dv), 0.0);
    std::vector<double> kc(size_t(kChunk * G * D)), vc(size_t(kChunk * G * Dv));
    const int64_t chunks = (length + kChunk - 1) / kChunk;
    for (int64_t chunk = r; chunk < chunks; chunk += P) {
      const int64_t k0 = chunk * kChunk, kn = std::min(kChunk, length - k0);
#pragma omp parallel for schedule(static)
      for (int64_t c = 0; c < kn; ++c) {
        std::vector<float> vals(static_cast<size_t>(std::max(D, Dv)));
        for (int64_t g = 0; g < G; ++g) {
          row(k_id, b, k0 + c, g, D, vals.data());
          std::copy_n(vals.begin(), D, kc.begin() + (c * G + g) * D);
          row(v_id, b, k0 + c, g, Dv, vals.data());
          std::copy_n(vals.begin(), Dv, vc.begin() + (c * G + g) * Dv);
        }
      }
#pragma omp parallel for schedule(dynamic, 1)
      for (int64_t jh = 0; jh < rows; ++jh) {
        const int64_t qpos = pos0 + jh / H, g = (jh % H) / group;
        const double* q = &qv[size_t(jh * D)];
        double s[kChunk];
        double chunk_max = -INFINITY;
        for (int64_t c = 0; c < kn; ++c) {
          if (k0 + c > qpos) {  // causal
            s[c] = -INFINITY;
            continue;
          }
          const double* kr = &kc[size_t((c * G + g) * D)];
          double dot = 0;
          for (int64_t d = 0; d < D; ++d)
            dot += q[d] * kr[d];
          s[c] = dot * scale;
          chunk_max = std::max(chunk_max, s[c]);
        }
        if (chunk_max == -INFINITY) continue;
        double& mj = m[size_t(jh)];
        double* a = &acc[size_t(jh * Dv)];
        if (chunk_max > mj) {
          const double f = std::exp(mj - chunk_max);  // 0 on the first visible chunk
          l[size_t(jh)] *= f;
          for (int64_t d = 0; d < Dv; ++d)
            a[d] *= f;
          mj = chunk_max;
        }
        for (int64_t c = 0; c < kn; ++c) {
          if (s[c] == -INFINITY) continue;
          const double w = std::exp(s[c] - mj);
          l[size_t(jh)] += w;
          const double* vr = &vc[size_t((c * G + g) * Dv)];
          for (int64_t d = 0; d < Dv; ++d)
            a[d] += w * vr[d];
        }
      }
    }
    for (int64_t jh = 0; jh < rows; ++jh) {
      double* st = &mine[size_t((b * rows + jh) * state)];
      st[0] = m[size_t(jh)];
      st[1] = l[size_t(jh)];
      std::copy_n(&acc[size_t(jh * Dv)], Dv, st + 2);
    }
  }

  // Merge the ranks' states (MPI_COMM_WORLD directly: not counted in the runtime's bytes).
  const size_t n = mine.size();
  std::vector<double> all(n * size_t(P));
  DATTN_MPI_CHECK(MPI_Allgather(mine.data(), int(n), MPI_DOUBLE, all.data(), int(n), MPI_DOUBLE,
                                MPI_COMM_WORLD));
  DecodeReference ref;
  ref.out.assign(size_t(B * Sq * H * Dv), 0.0);
  ref.lse.assign(size_t(B * H * Sq), -INFINITY);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t jh = 0; jh < rows; ++jh) {
      const int64_t j = jh / H, h = jh % H;
      double m = -INFINITY;
      for (int p = 0; p < P; ++p)
        m = std::max(m, all[size_t(p) * n + size_t((b * rows + jh) * state)]);
      if (m == -INFINITY) continue;  // no visible key (cannot happen: a query sees itself)
      double l = 0;
      std::vector<double> acc(size_t(Dv), 0.0);
      for (int p = 0; p < P; ++p) {
        const double* st = &all[size_t(p) * n + size_t((b * rows + jh) * state)];
        if (st[0] == -INFINITY) continue;
        const double f = std::exp(st[0] - m);
        l += st[1] * f;
        for (int64_t d = 0; d < Dv; ++d)
          acc[size_t(d)] += st[2 + d] * f;
      }
      ref.lse[size_t((b * H + h) * Sq + j)] = m + std::log(l);
      for (int64_t d = 0; d < Dv; ++d)
        ref.out[size_t(((b * Sq + j) * H + h) * Dv + d)] = acc[size_t(d)] / l;
    }
  return ref;
}

}  // namespace dattn::bench
