// The float64 reference attention the benchmarks check against: query rows at given global
// positions against the keys of [key_begin, key_end) under a visibility rule, with the rows of
// q, k and v regenerated from the benchmark's deterministic inputs chunk by chunk (O(chunk)
// memory). softmax_states keeps an online softmax state (max m, sum l, weighted sum acc) per
// query row and head; merge_states combines the states of several ranks (each took some of the
// chunks) into out and lse. decode_reference is the check of a decode step built on them, and
// DecodeCheck compares a result with a reference (or with another result).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "collective/mpi_communicator.h"
#include "examples/bench_inputs.h"
#include "examples/engine.h"
#include "src/attention.h"

namespace dattn::bench {

// The decode checks' bounds on the CPU (decode, star): against float64, with inputs rounded to the
// storage dtype on both sides (the kernel computes in fp32 whatever the dtype); two exact results
// over the same cached K/V (strategies, star against tree) differ only in merge order.
constexpr Tolerance kDecodeTol{1e-4, 1e-4}, kSameTol{1e-5, 1e-5};

struct DecodeReference {
  std::vector<double> out;  // [B, R, H, D_v] (R query rows; a decode step's R = S_q)
  std::vector<double> lse;  // [B, H, R]; -inf for a row that sees no key
};

// The heads and dims of a reference: H query heads over G key/value heads.
struct RefShape {
  int64_t batch, heads, kv_heads, head_dim, dim_v;
  double scale;        // AttnSpec::scale()
  double softcap = 0;  // AttnSpec::softcap: > 0, scores become softcap * tanh(s / softcap)
};

constexpr int64_t kRefChunk = 256;  // keys per chunk

// The states [B][R * H][D_v + 2] (m, l, acc; row index j * H + h) of the query rows at global
// positions pos[j] over the keys of chunks first, first + step, ... of [key_begin, key_end).
// row(id, b, pos, h, dim, out) writes the `dim` stored values of one row of tensor id (kQ, kK or
// kV); visible(q_pos, k_pos) is the mask.
template <typename RowFn, typename VisibleFn>
std::vector<double> softmax_states(const RefShape& s, const std::vector<int64_t>& pos,
                                   int64_t key_begin, int64_t key_end, int64_t first, int64_t step,
                                   const RowFn& row, const VisibleFn& visible) {
  const int64_t R = int64_t(pos.size()), H = s.heads, G = s.kv_heads, D = s.head_dim;
  const int64_t Dv = s.dim_v, group = H / G, rows = R * H, state = Dv + 2;
  std::vector<double> out(size_t(s.batch * rows * state), 0.0);
  for (int64_t b = 0; b < s.batch; ++b) {
    std::vector<double> qv(size_t(rows * D));
    std::vector<float> vals(size_t(std::max(D, Dv)));
    for (int64_t jh = 0; jh < rows; ++jh) {
      row(kQ, b, pos[size_t(jh / H)], jh % H, D, vals.data());
      std::copy_n(vals.begin(), D, qv.begin() + jh * D);
    }
    std::vector<double> m(size_t(rows), -INFINITY), l(size_t(rows), 0.0),
        acc(size_t(rows * Dv), 0.0);
    std::vector<double> kc(size_t(kRefChunk * G * D)), vc(size_t(kRefChunk * G * Dv));
    const int64_t chunks = (key_end - key_begin + kRefChunk - 1) / kRefChunk;
    for (int64_t chunk = first; chunk < chunks; chunk += step) {
      const int64_t k0 = key_begin + chunk * kRefChunk, kn = std::min(kRefChunk, key_end - k0);
#pragma omp parallel for schedule(static)
      for (int64_t c = 0; c < kn; ++c) {
        std::vector<float> kv(size_t(std::max(D, Dv)));
        for (int64_t g = 0; g < G; ++g) {
          row(kK, b, k0 + c, g, D, kv.data());
          std::copy_n(kv.begin(), D, kc.begin() + (c * G + g) * D);
          row(kV, b, k0 + c, g, Dv, kv.data());
          std::copy_n(kv.begin(), Dv, vc.begin() + (c * G + g) * Dv);
        }
      }
#pragma omp parallel for schedule(dynamic, 1)
      for (int64_t jh = 0; jh < rows; ++jh) {
        const int64_t qpos = pos[size_t(jh / H)], g = (jh % H) / group;
        const double* q = &qv[size_t(jh * D)];
        double sc[kRefChunk];
        double chunk_max = -INFINITY;
        for (int64_t c = 0; c < kn; ++c) {
          if (!visible(qpos, k0 + c)) {
            sc[c] = -INFINITY;
            continue;
          }
          const double* kr = &kc[size_t((c * G + g) * D)];
          double dot = 0;
          for (int64_t d = 0; d < D; ++d)
            dot += q[d] * kr[d];
          sc[c] = dot * s.scale;
          if (s.softcap > 0) sc[c] = s.softcap * std::tanh(sc[c] / s.softcap);
          chunk_max = std::max(chunk_max, sc[c]);
        }
        if (chunk_max == -INFINITY) continue;  // no visible key in this chunk
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
          if (sc[c] == -INFINITY) continue;
          const double w = std::exp(sc[c] - mj);
          l[size_t(jh)] += w;
          const double* vr = &vc[size_t((c * G + g) * Dv)];
          for (int64_t d = 0; d < Dv; ++d)
            a[d] += w * vr[d];
        }
      }
    }
    for (int64_t jh = 0; jh < rows; ++jh) {
      double* st = &out[size_t((b * rows + jh) * state)];
      st[0] = m[size_t(jh)];
      st[1] = l[size_t(jh)];
      std::copy_n(&acc[size_t(jh * Dv)], Dv, st + 2);
    }
  }
  return out;
}

// out and lse of R query rows from P states arrays of softmax_states, one after the other in
// `all` (P = 1: one rank's states over every chunk).
inline DecodeReference merge_states(const RefShape& s, int64_t R, const std::vector<double>& all,
                                    int P) {
  const int64_t B = s.batch, H = s.heads, Dv = s.dim_v, rows = R * H, state = Dv + 2;
  const size_t n = all.size() / size_t(P);
  DecodeReference ref;
  ref.out.assign(size_t(B * R * H * Dv), 0.0);
  ref.lse.assign(size_t(B * H * R), -INFINITY);
  std::vector<double> acc(static_cast<size_t>(Dv));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t jh = 0; jh < rows; ++jh) {
      const int64_t j = jh / H, h = jh % H;
      const size_t at = size_t((b * rows + jh) * state);
      double m = -INFINITY;
      for (int p = 0; p < P; ++p)
        m = std::max(m, all[size_t(p) * n + at]);
      if (m == -INFINITY) continue;  // no visible key
      double l = 0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int p = 0; p < P; ++p) {
        const double* st = &all[size_t(p) * n + at];
        if (st[0] == -INFINITY) continue;
        const double f = std::exp(st[0] - m);
        l += st[1] * f;
        for (int64_t d = 0; d < Dv; ++d)
          acc[size_t(d)] += st[2 + d] * f;
      }
      ref.lse[size_t((b * H + h) * R + j)] = m + std::log(l);
      for (int64_t d = 0; d < Dv; ++d)
        ref.out[size_t(((b * R + j) * H + h) * Dv + d)] = acc[size_t(d)] / l;
    }
  return ref;
}

// The float64 check of a decode step: the S_q new queries (positions length - S_q .. length - 1)
// against every key 0 .. length - 1, causal on global positions, over every head of `shape`
// (D_v = D, scale 1/sqrt(D)). Collective over MPI_COMM_WORLD: rank r takes the chunks r, r + P,
// ...; the states are allgathered (not counted in the runtime's bytes) and merged, so 1/P of the
// work per rank.
inline DecodeReference decode_reference(const Shape& o, int64_t new_tokens, int64_t length,
                                        const HashedRows& row) {
  int P = 1, r = 0;
  DATTN_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &P));
  DATTN_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &r));
  const RefShape s{o.batch,    o.heads,    o.kv_heads,
                   o.head_dim, o.head_dim, double(1.0f / std::sqrt(float(o.head_dim)))};
  std::vector<int64_t> pos;
  for (int64_t j = 0; j < new_tokens; ++j)
    pos.push_back(length - new_tokens + j);
  const std::vector<double> mine =
      softmax_states(s, pos, 0, length, r, P, row, [](int64_t q, int64_t k) { return k <= q; });
  std::vector<double> all(mine.size() * size_t(P));
  DATTN_MPI_CHECK(MPI_Allgather(mine.data(), int(mine.size()), MPI_DOUBLE, all.data(),
                                int(mine.size()), MPI_DOUBLE, MPI_COMM_WORLD));
  return merge_states(s, new_tokens, all, P);
}

// A result checked element by element, out and lse apart: the rows rows[j] (all of them, in order,
// when rows is null) of got (out [B, L, Hl, D_v], lse [B, Hl, L]) against rows j of arrays of
// that layout with Hr heads, got's heads being their h0 .. h0 + Hl - 1 (a tensor-parallel rank's
// slice of a DecodeReference, or another result).
struct DecodeCheck {
  CheckStats out, lse;
  uint64_t wrong() const { return out.wrong + lse.wrong; }
  // "N wrong; max |what| out X, lse Y", a footer line's value.
  std::string line(const char* what) const {
    return detail::cat(wrong(), " wrong; max |", what, "| out ", report::sci(out.max_err, 2),
                       ", lse ", report::sci(lse.max_err, 2));
  }
  template <typename T>
  void compare(const Partial& got, const T* ref_out, const T* ref_lse, int64_t Hr, int64_t h0,
               const Tolerance& tol_out, const Tolerance& tol_lse,
               const std::vector<int64_t>* rows = nullptr) {
    const int64_t B = got.lse.size(0), Hl = got.lse.size(1), L = got.lse.size(2);
    const int64_t D = got.out.size(3), R = rows ? int64_t(rows->size()) : L;
    const float *o = got.out.ptr<float>(), *l = got.lse.ptr<float>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < Hl; ++h)
        for (int64_t j = 0; j < R; ++j) {
          const int64_t i = rows ? (*rows)[size_t(j)] : j;
          lse.compare(l[(b * Hl + h) * L + i], ref_lse[(b * Hr + h0 + h) * R + j], tol_lse);
          for (int64_t d = 0; d < D; ++d)
            out.compare(o[((b * L + i) * Hl + h) * D + d],
                        ref_out[((b * R + j) * Hr + h0 + h) * D + d], tol_out);
        }
  }
  // {"checked", "wrong", "max_err_out", "max_err_lse"}.
  report::Json json() const {
    return {{"checked", out.checked + lse.checked},
            {"wrong", wrong()},
            {"max_err_out", out.max_err},
            {"max_err_lse", lse.max_err}};
  }
  // Summed (errors: maxed) over every rank of MPI_COMM_WORLD. Collective.
  DecodeCheck reduced() const { return {out.reduced(), lse.reduced()}; }
  // other's counts added, the larger errors kept.
  void add(const DecodeCheck& other) {
    for (auto [a, b] : {std::pair{&out, &other.out}, std::pair{&lse, &other.lse}})
      *a = {a->checked + b->checked, a->wrong + b->wrong, std::max(a->max_err, b->max_err)};
  }
};

}  // namespace dattn::bench
