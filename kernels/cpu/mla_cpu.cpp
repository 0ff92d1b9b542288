// The CPU kernels of multi-head latent attention (kernels/cpu/mla_cpu.h): the decode step on the
// decode kernel (kernels/cpu/decode_cpu.h), OpenBLAS sgemm/sgemv for the absorption and the
// projections, LAPACK's dsyev for PCA.
#include "kernels/cpu/mla_cpu.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/decode_cpu.h"
#include "kernels/merge.h"
#include "src/base/error.h"

extern "C" void dsyev_(const char* jobz, const char* uplo, const int* n, double* a, const int* lda,
                       double* w, double* work, const int* lwork, int* info);

namespace dattn::cpu {

namespace {
// BLAS on every OpenMP thread for the duration of one call (the attention kernels run it on one).
struct AllBlasThreads {
  AllBlasThreads() { openblas_set_num_threads(omp_get_max_threads()); }
  ~AllBlasThreads() { openblas_set_num_threads(1); }
};
}  // namespace

void mla_absorbed_decode(const MlaAbsorbedBlock& p, const Mask& mask, float* out, int64_t out_heads,
                         int64_t out_h0, float* lse) {
  const int64_t B = p.batch, Sq = p.seq_q, H = p.heads_all, S = p.seq_kv;
  const int64_t dn = p.qk_nope, dc = p.latent_all, dr = p.rope_all, dv = p.v_head;
  const int64_t nh = p.nh, nlat = p.nlat, nrope = p.nrope;
  // Rows r = s * nh + i (query s, head i of the slice) of one decode job per batch entry: the
  // absorbed query [q~ | q_pe] times the scale, against keys [c_j | k_pe_j] and values c_j.
  const int64_t R = Sq * nh, dq = nlat + nrope;
  std::vector<float> q(size_t(B * R * dq));
  std::vector<int64_t> q_pos(static_cast<size_t>(R));
  {
    AllBlasThreads threads;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < Sq; ++s)
        for (int64_t i = 0; i < nh; ++i) {  // q~_h = W_UK_h[:, slice]^T q_nope_h
          const int64_t h = p.h0 + i, qrow = (b * Sq + s) * H + h;
          float* dst = q.data() + (b * R + s * nh + i) * dq;
          cblas_sgemv(CblasRowMajor, CblasTrans, int(dn), int(nlat), p.scale,
                      p.w_uk + h * dn * dc + p.lat0, int(dc), p.q_nope + qrow * dn, 1, 0.f, dst, 1);
          for (int64_t r = 0; r < nrope; ++r)
            dst[nlat + r] = p.scale * p.q_pe[qrow * dr + p.rope0 + r];
        }
  }
  for (int64_t r = 0; r < R; ++r)
    q_pos[size_t(r)] = p.q_pos0 + r / nh;
  std::vector<DecodeJob> jobs(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    DecodeJob& j = jobs[size_t(b)];
    j.q = q.data() + b * R * dq;
    j.q_pos = q_pos.data();
    j.rows = R, j.d1 = nlat, j.d2 = nrope, j.dv = nlat, j.n_keys = S;
    j.k1 = j.v = p.c_kv + b * S * nlat;
    j.k2 = p.k_pe + b * S * nrope;
    j.k1_key = j.v_key = nlat, j.k2_key = nrope;
    j.mask = mask;
  }
  // The splits' partials, merged in split order into z [B, R, nlat] (the softmax-weighted latent).
  const int64_t splits = decode_splits(B, S);
  std::vector<float> zs(size_t(B * splits * R * nlat)), ls(size_t(B * splits * R));
  decode_partials(jobs.data(), B, splits, zs.data(), ls.data());
  std::vector<float> z(size_t(B * R * nlat)), zl(size_t(B * R));
  clear_partial(z.data(), zl.data(), 1, B * R, 1, nlat);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t sp = 0; sp < splits; ++sp)
      for (int64_t r = 0; r < R; ++r) {
        const int64_t u = (b * splits + sp) * R + r;
        merge_row(z.data() + (b * R + r) * nlat, zl.data() + b * R + r, zs.data() + u * nlat,
                  ls[size_t(u)], nlat);
      }
  // out_h = W_UV_h[:, slice] z_h (z = 0 for a query that sees no row: out = 0, lse = -inf).
  AllBlasThreads threads;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < Sq; ++s)
      for (int64_t i = 0; i < nh; ++i) {
        const int64_t h = p.h0 + i, r = b * R + s * nh + i;
        float* o = out + ((b * Sq + s) * out_heads + out_h0 + i) * dv;
        cblas_sgemv(CblasRowMajor, CblasNoTrans, int(dv), int(nlat), 1.f,
                    p.w_uv + h * dv * dc + p.lat0, int(dc), z.data() + r * nlat, 1, 0.f, o, 1);
        if (lse != nullptr) lse[(b * nh + i) * Sq + s] = zl[size_t(r)];
      }
}

void mla_up_project(const float* c, int64_t tokens, int64_t latent, const float* w, int64_t heads,
                    int64_t dim, float* out, int64_t out_head_stride, int64_t out_row_stride) {
  AllBlasThreads threads;
  for (int64_t h = 0; h < heads; ++h)  // out_h = C W_h^T, all tokens at once
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(tokens), int(dim), int(latent), 1.f, c,
                int(latent), w + h * dim * latent, int(latent), 0.f, out + h * out_head_stride,
                int(out_row_stride));
}

void fwht(float* x, int64_t n) {
  for (int64_t len = 1; len < n; len <<= 1)
    for (int64_t i = 0; i < n; i += 2 * len)
      for (int64_t j = i; j < i + len; ++j) {
        const float a = x[j], b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
  const float norm = 1.0f / std::sqrt(float(n));
  for (int64_t i = 0; i < n; ++i)
    x[i] *= norm;
}

void pca_rotation(const float* x, int64_t N, int64_t d_c, float* r) {
  std::vector<double> mean(size_t(d_c), 0.0), cov(size_t(d_c * d_c), 0.0);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t a = 0; a < d_c; ++a)
      mean[size_t(a)] += x[i * d_c + a] / double(N);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t a = 0; a < d_c; ++a) {
      const double xa = x[i * d_c + a] - mean[size_t(a)];
      for (int64_t b = 0; b <= a; ++b)
        cov[size_t(a * d_c + b)] += xa * (x[i * d_c + b] - mean[size_t(b)]) / double(N - 1);
    }
  for (int64_t a = 0; a < d_c; ++a)
    for (int64_t b = 0; b < a; ++b)
      cov[size_t(b * d_c + a)] = cov[size_t(a * d_c + b)];
  const int n = int(d_c);
  int info = 0, lwork = -1;
  std::vector<double> eig(static_cast<size_t>(d_c));
  double query = 0;
  dsyev_("V", "U", &n, cov.data(), &n, eig.data(), &query, &lwork, &info);
  lwork = int(query);
  std::vector<double> work(size_t(std::max(lwork, 1)));
  dsyev_("V", "U", &n, cov.data(), &n, eig.data(), work.data(), &lwork, &info);
  if (info != 0) DATTN_THROW("LAPACK dsyev failed for the PCA transform: info = ", info);
  // Column k of the (column-major) result is the eigenvector of eig[k], ascending.
  for (int64_t i = 0; i < d_c; ++i)
    for (int64_t a = 0; a < d_c; ++a)
      r[size_t(i * d_c + a)] = float(cov[size_t((d_c - 1 - i) * d_c + a)]);
}

void rows_times_rt(const float* rows, int64_t n, int64_t d, const float* r, float* out) {
  AllBlasThreads threads;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n), int(d), int(d), 1.f, rows, int(d), r,
              int(d), 0.f, out, int(d));
}

}  // namespace dattn::cpu
