// Multi-head latent attention (MLA, DeepSeek-V2/V3) and tensor-parallel latent attention (TPLA).
// The cache holds one latent per token, [c_kv (d_c) | k_pe (d_r)], shared by all heads. Prefill
// up-projects it to per-head K and V and runs ordinary attention (any strategy, any layout);
// decode absorbs the up-projections into the query (scores = q~ . c + q_pe . k_pe with
// q~_h = W_UK_h^T q_nope_h; z_h = softmax . c; o_h = W_UV_h z_h). Distributed decode: head-split
// tensor parallelism (each rank H/G heads, the whole cache) or TPLA (each rank a 1/G slice of the
// latent and of every absorbed query; per-slice softmax; outputs summed) — an approximation of
// MLA that an orthogonal transform of the latent (Hadamard, PCA) folded into W_UK and W_UV makes
// closer at no decode cost. All MLA tensors are fp32. mla_decode runs on the Runtime's device
// (on cuda: band masks, and the latent and RoPE columns of kernels/cuda/limits.h); everything
// else here takes host tensors.
#pragma once

#include <cstdint>
#include <vector>

#include "src/attention.h"
#include "src/runtime.h"

namespace dattn {

struct MlaConfig {
  int64_t heads = 128;
  int64_t latent = 512;   // d_c
  int64_t rope = 64;      // d_r, the decoupled RoPE part (k_pe shared by all heads)
  int64_t qk_nope = 128;  // per-head query/key dimension without RoPE
  int64_t v_head = 128;
  float softmax_scale = 0.f;  // 0: 1/sqrt(qk_nope + rope)
  float scale() const;
  void validate() const;  // throws dattn::Error naming the field
};

// The caller's up-projections, fp32: k_nope_h = W_UK_h c with w_uk [H, qk_nope, d_c], and
// v_h = W_UV_h c with w_uv [H, v_head, d_c].
struct MlaWeights {
  Tensor w_uk, w_uv;
  // Gaussian with std 1/sqrt(d_c), reproducible from the seed (tests, benchmarks).
  static MlaWeights random(const MlaConfig& cfg, uint64_t seed);
};

// ---------------------------------------------------------------- prefill form
// Per-head tensors for ordinary attention: q [B, S, H, qk_nope + d_r] (q_nope | q_pe),
// k [B, S, H, qk_nope + d_r] (W_UK_h c | k_pe), v [B, S, H, v_head], and the spec to run them
// with (head_dim qk_nope + d_r, head_dim_v v_head, the MLA scale, `mask`).
// q_nope [B, S, H, qk_nope], q_pe [B, S, H, d_r], c_kv [B, S, d_c], k_pe [B, S, d_r].
struct MlaExpanded {
  Tensor q, k, v;
  AttnSpec spec;
};
MlaExpanded mla_expand(const MlaConfig& cfg, const MlaWeights& w, const Tensor& q_nope,
                       const Tensor& q_pe, const Tensor& c_kv, const Tensor& k_pe,
                       const Mask& mask = Mask::causal());

// ---------------------------------------------------------------- decode form
// Absorbed MLA in one process: the S_q queries (q_nope [B, S_q, H, qk_nope], q_pe
// [B, S_q, H, d_r]) at global positions q_pos0 .. against the cache c_kv [B, S, d_c],
// k_pe [B, S, d_r] at positions 0 .. S-1. Returns out [B, S_q, H, v_head] and lse [B, H, S_q].
Partial mla_decode_local(const MlaConfig& cfg, const MlaWeights& w, const Tensor& q_nope,
                         const Tensor& q_pe, const Tensor& c_kv, const Tensor& k_pe, int64_t q_pos0,
                         const Mask& mask = Mask::causal());

// ---------------------------------------------------------------- transforms
// An orthogonal d_c x d_c matrix R applied to the latent before slicing: c' = R c. Folding it
// into the weights (W' = W R^T) leaves MLA exactly unchanged, since W' c' = W c.
enum class LatentTransform : uint8_t { none = 0, hadamard = 1, pca = 2 };
const char* latent_transform_name(LatentTransform t);
struct MlaTransform {
  LatentTransform kind = LatentTransform::none;
  int64_t dim = 0;
  std::vector<float> r;  // row-major [dim, dim]; empty for none
};
// none; hadamard (d_c a power of two; the normalised Walsh-Hadamard matrix); pca (eigenvectors
// of the covariance of `calibration` latents [N, d_c], by decreasing variance, via LAPACK).
MlaTransform make_latent_transform(LatentTransform kind, int64_t d_c,
                                   const Tensor& calibration = Tensor());
// In-place fast Walsh-Hadamard transform of n = 2^k values, normalised (orthogonal): O(n log n).
void fwht(float* x, int64_t n);
MlaWeights fold_transform(const MlaWeights& w, const MlaTransform& t);  // W R^T
Tensor apply_transform(const MlaTransform& t, const Tensor& c_kv);      // R c per token

// ---------------------------------------------------------------- distributed decode
enum class MlaParallel : uint8_t { head_split = 0, tpla = 1 };
const char* mla_parallel_name(MlaParallel p);
// TPLA: how the RoPE part is held (replicated: every rank adds the full q_pe . k_pe to its slice's
// scores; split: each rank holds d_r / G of it) and the logit scale of a slice's scores (1: the
// MLA scale as is; G: multiplied by G, since a slice carries about 1/G of each dot product).
enum class RopePlacement : uint8_t { replicated = 0, split = 1 };
struct TplaOptions {
  RopePlacement rope = RopePlacement::replicated;
  bool scale_logits_by_g = false;
};

// What a rank of G holds of the cache: c_kv [B, S, latent_len] (columns latent_begin ..) and
// k_pe [B, S, rope_len] (columns rope_begin ..). head_split: everything.
struct MlaCacheShard {
  Tensor c_kv, k_pe;
  int64_t latent_begin = 0, latent_len = 0, rope_begin = 0, rope_len = 0;
};
MlaCacheShard mla_shard_cache(const MlaConfig& cfg, MlaParallel parallel, const TplaOptions& opt,
                              const Tensor& c_kv, const Tensor& k_pe, int rank, int ranks);

// One decode step over rt.cp()'s G ranks. q_nope/q_pe are the same on every rank. head_split:
// rank g computes heads [g H/G, (g+1) H/G) against the whole cache, then an allgather gives
// every rank all heads. tpla: each rank attends its latent slice, out_g = W_UV[:, :, slice] z_g,
// then a sum-allreduce. Returns out [B, S_q, H, v_head] on every rank (fp32). Collective.
Tensor mla_decode(Runtime& rt, MlaParallel parallel, const MlaConfig& cfg, const MlaWeights& w,
                  const Tensor& q_nope, const Tensor& q_pe, const MlaCacheShard& shard,
                  int64_t q_pos0, const TplaOptions& opt = {}, const Mask& mask = Mask::causal());

// Models: cache bytes a rank holds per token (fp32), and bytes a rank sends per decode step.
uint64_t mla_cache_bytes_per_token(const MlaConfig& cfg, MlaParallel parallel,
                                   const TplaOptions& opt, int ranks);
uint64_t mla_decode_send_bytes(const MlaConfig& cfg, MlaParallel parallel, int64_t batch,
                               int64_t s_q, int ranks);

// The float64 reference of TPLA's per-slice rule in one process (G slices, the same options):
// what mla_decode(tpla) must equal; with G = 1 it is exact MLA.
std::vector<double> tpla_reference(const MlaConfig& cfg, const MlaWeights& w, const Tensor& q_nope,
                                   const Tensor& q_pe, const Tensor& c_kv, const Tensor& k_pe,
                                   int64_t q_pos0, int ranks, const TplaOptions& opt,
                                   const Mask& mask = Mask::causal());

}  // namespace dattn
