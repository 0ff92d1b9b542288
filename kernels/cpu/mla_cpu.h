// The CPU kernels of multi-head latent attention (src/mla.h): the absorbed decode step of one
// slice (the decode kernel: one pass over the latent cache for all the slice's heads and queries),
// the up-projection of latents to per-head K/V, and the latent transforms' math (the fast
// Walsh-Hadamard transform, PCA through LAPACK's dsyev, and the product of rows with R^T). fp32
// host memory throughout; BLAS runs on all OpenMP threads.
#pragma once

#include <cstdint>

#include "kernels/mla_block.h"
#include "src/base/spec.h"

namespace dattn::cpu {

// The absorbed decode of one slice (kernels/mla_block.h): q~_h = W_UK_h[:, slice]^T q_nope_h,
// scores [nh, S] = scale (q~ C^T + q_pe K_pe^T) where `mask` (documents too; blk.left and
// blk.right are not read) lets query s see row j, softmax, z = P C, out_h = W_UV_h[:, slice] z_h;
// the cache is read once per call, split across the OpenMP threads (kernels/cpu/decode_cpu.h).
// Writes (not adds) out [batch, seq_q, out_heads, v_head] at heads out_h0 .. out_h0 + nh, and
// lse [batch, nh, seq_q] unless null; a query that sees no row gets out = 0, lse = -inf.
void mla_absorbed_decode(const MlaAbsorbedBlock& blk, const Mask& mask, float* out,
                         int64_t out_heads, int64_t out_h0, float* lse);

// out[t, h] = W_h c_t for `tokens` latents c [tokens, latent] and w [heads, dim, latent]:
// head h's dim values of token t start at out + t * out_row_stride + h * out_head_stride.
void mla_up_project(const float* c, int64_t tokens, int64_t latent, const float* w, int64_t heads,
                    int64_t dim, float* out, int64_t out_head_stride, int64_t out_row_stride);

// In-place fast Walsh-Hadamard transform of n = 2^k values, normalised (orthogonal): O(n log n).
void fwht(float* x, int64_t n);

// r [d, d] row-major: the eigenvectors of the covariance of x [n, d] (n >= 2) as rows, by
// decreasing eigenvalue. Throws dattn::Error when LAPACK's dsyev fails.
void pca_rotation(const float* x, int64_t n, int64_t d, float* r);

// out [n, d] = rows [n, d] R^T for r [d, d]: each row x becomes R x.
void rows_times_rt(const float* rows, int64_t n, int64_t d, const float* r, float* out);

}  // namespace dattn::cpu
