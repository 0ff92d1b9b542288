// The CPU kernels of multi-head latent attention (kernels/cpu/mla_cpu.h): OpenBLAS sgemm/sgemv for
// the decode step and the projections, LAPACK's dsyev for PCA.
#include "kernels/cpu/mla_cpu.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/vec_math.h"
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
  const float alpha = p.scale;
  std::vector<float> qt(size_t(nh * nlat)), qp(size_t(nh * std::max<int64_t>(nrope, 1)));
  std::vector<float> sc(size_t(nh * std::max<int64_t>(S, 1))), z(size_t(nh * nlat));
  std::vector<float> m(static_cast<size_t>(nh)), l(static_cast<size_t>(nh));
  AllBlasThreads threads;
  for (int64_t b = 0; b < B; ++b) {
    const float* cb = p.c_kv + b * S * nlat;
    const float* kb = p.k_pe + b * S * nrope;
    for (int64_t s = 0; s < Sq; ++s) {
      const int64_t pos = p.q_pos0 + s;
      for (int64_t i = 0; i < nh; ++i) {  // q~_h = W_UK_h[:, slice]^T q_nope_h
        const int64_t h = p.h0 + i;
        cblas_sgemv(CblasRowMajor, CblasTrans, int(dn), int(nlat), 1.f,
                    p.w_uk + h * dn * dc + p.lat0, int(dc), p.q_nope + ((b * Sq + s) * H + h) * dn,
                    1, 0.f, qt.data() + i * nlat, 1);
        for (int64_t r = 0; r < nrope; ++r)
          qp[size_t(i * nrope + r)] = p.q_pe[((b * Sq + s) * H + h) * dr + p.rope0 + r];
      }
      // scores [nh, S] = alpha (q~ C^T + q_pe K_pe^T)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(nh), int(S), int(nlat), alpha,
                  qt.data(), int(nlat), cb, int(nlat), 0.f, sc.data(), int(S));
      if (nrope > 0)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(nh), int(S), int(nrope), alpha,
                    qp.data(), int(nrope), kb, int(nrope), 1.f, sc.data(), int(S));
      for (int64_t j = 0; j < S; ++j)
        if (!mask.visible(pos, j))
          for (int64_t i = 0; i < nh; ++i)
            sc[size_t(i * S + j)] = -INFINITY;
      for (int64_t i = 0; i < nh; ++i) {
        float* row = sc.data() + i * S;
        m[size_t(i)] = row_max(row, S);
        if (m[size_t(i)] == -INFINITY) {
          std::fill(row, row + S, 0.f);
          l[size_t(i)] = 0.f;
        } else {
          l[size_t(i)] = exp_shift_sum(row, S, m[size_t(i)]);
        }
      }
      // z [nh, nlat] = P C, then out_h = W_UV_h[:, slice] z_h / l_h
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(nh), int(nlat), int(S), 1.f,
                  sc.data(), int(S), cb, int(nlat), 0.f, z.data(), int(nlat));
      for (int64_t i = 0; i < nh; ++i) {
        const int64_t h = p.h0 + i;
        float* o = out + ((b * Sq + s) * out_heads + out_h0 + i) * dv;
        const float inv = l[size_t(i)] > 0.f ? 1.f / l[size_t(i)] : 0.f;
        cblas_sgemv(CblasRowMajor, CblasNoTrans, int(dv), int(nlat), inv,
                    p.w_uv + h * dv * dc + p.lat0, int(dc), z.data() + i * nlat, 1, 0.f, o, 1);
        if (lse != nullptr)
          lse[(b * nh + i) * Sq + s] =
              l[size_t(i)] > 0.f ? m[size_t(i)] + std::log(l[size_t(i)]) : -INFINITY;
      }
    }
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
