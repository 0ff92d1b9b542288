// The block of work both absorbed-MLA decode kernels take (kernels/cpu/mla_cpu.h on host memory,
// kernels/cuda/mla_decode_cuda.h on device memory): one rank's slice of heads, latent columns and
// RoPE columns, its tensors and shapes, the query positions and the logit scale.
#pragma once

#include <cstdint>

namespace dattn {

// The step of one slice: heads h0 .. h0 + nh, latent columns lat0 .. lat0 + nlat, RoPE columns
// rope0 .. rope0 + nrope. All fp32, contiguous, on the kernel's device:
//   q_nope [batch, seq_q, heads_all, qk_nope], q_pe [batch, seq_q, heads_all, rope_all]
//   w_uk [heads_all, qk_nope, latent_all], w_uv [heads_all, v_head, latent_all]
//   c_kv [batch, seq_kv, nlat] and k_pe [batch, seq_kv, nrope]: the slice's cache columns
// Query s sits at position q_pos0 + s, cache row j at position j.
struct MlaAbsorbedBlock {
  const float* q_nope = nullptr;
  const float* q_pe = nullptr;
  const float* w_uk = nullptr;
  const float* w_uv = nullptr;
  const float* c_kv = nullptr;
  const float* k_pe = nullptr;
  int64_t batch = 0, seq_q = 0, seq_kv = 0;
  int64_t heads_all = 0, qk_nope = 0, rope_all = 0, latent_all = 0, v_head = 0;
  int64_t h0 = 0, nh = 0, lat0 = 0, nlat = 0, rope0 = 0, nrope = 0;
  int64_t q_pos0 = 0;
  float scale = 1.f;  // the slice's logit scale (the MLA scale, times G for scaled TPLA)
  // The band of the mask (the CUDA kernel's form): query q sees key k when k is in
  // [q - left, q + right] (-1: no limit).
  int64_t left = -1, right = 0;
};

}  // namespace dattn
