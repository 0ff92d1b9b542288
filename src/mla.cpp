// MLA and TPLA: validation, the prefill expansion, the absorbed decode of one slice (its kernels,
// CPU and CUDA, picked by src/dispatch.h), the latent transforms (their math in
// kernels/cpu/mla_cpu.h, on host tensors) and the distributed decode schedule (head split:
// allgather of heads; TPLA: per-slice softmax, sum-allreduce of the outputs), which runs unchanged
// on host and GPU tensors.
#include "src/mla.h"

#include <cmath>
#include <cstring>

#include "kernels/cpu/mla_cpu.h"
#include "src/base/error.h"
#include "src/check_finite.h"
#include "src/dispatch.h"
#include "src/validate.h"

namespace dattn {

// ================================================================== config and weights

float MlaConfig::scale() const {
  return softmax_scale != 0.f ? softmax_scale : 1.0f / std::sqrt(float(qk_nope + rope));
}

void MlaConfig::validate() const {
  DATTN_CHECK_ARG(heads > 0, "heads", heads, "> 0");
  DATTN_CHECK_ARG(latent > 0, "latent", latent, "> 0 (d_c)");
  DATTN_CHECK_ARG(rope >= 0, "rope", rope, ">= 0 (d_r)");
  DATTN_CHECK_ARG(qk_nope > 0, "qk_nope", qk_nope, "> 0");
  DATTN_CHECK_ARG(v_head > 0, "v_head", v_head, "> 0");
  DATTN_CHECK_ARG(std::isfinite(softmax_scale) && softmax_scale >= 0.f, "softmax_scale",
                  softmax_scale, "0 (1/sqrt(qk_nope + rope)) or a finite positive value");
}

namespace {
uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
// Gaussian values from a hash of (seed, index): reproducible whatever the thread count.
void fill_gaussian(Tensor& t, uint64_t seed, float stddev) {
  float* p = t.ptr<float>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    const double u1 = (double(mix64(seed ^ uint64_t(2 * i)) >> 11) + 0.5) * 0x1.0p-53;
    const double u2 = (double(mix64(seed ^ uint64_t(2 * i + 1)) >> 11) + 0.5) * 0x1.0p-53;
    p[i] = float(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2)) * stddev;
  }
}

// t is fp32 of `shape` (-1: any size) on `device` (the host, but for mla_decode on a GPU Runtime).
void check_f32(const Tensor& t, const char* name, std::initializer_list<int64_t> shape,
               const Device& device = Device::cpu()) {
  std::string want = "[";
  for (int64_t s : shape)
    want += (want.size() > 1 ? ", " : "") + std::to_string(s);
  want += "] fp32";
  bool ok = t.dtype() == DType::f32 && t.dim() == int(shape.size());
  int d = 0;
  for (int64_t s : shape) {
    ok = ok && (s < 0 || t.size(d) == s);  // s < 0: any size
    ++d;
  }
  DATTN_CHECK_ARG(ok, name, t.defined() ? t.shape_str() : std::string("undefined"),
                  want + " (-1: any)");
  DATTN_CHECK_ARG(t.device() == device, detail::cat(name, " device"), t.device().str(),
                  device.is_cpu() ? std::string("cpu (this entry point runs on host tensors)")
                                  : detail::cat(device.str(), " (the Runtime's device)"));
}
}  // namespace

MlaWeights MlaWeights::random(const MlaConfig& cfg, uint64_t seed) {
  cfg.validate();
  MlaWeights w{Tensor::empty({cfg.heads, cfg.qk_nope, cfg.latent}, DType::f32),
               Tensor::empty({cfg.heads, cfg.v_head, cfg.latent}, DType::f32)};
  const float sd = 1.0f / std::sqrt(float(cfg.latent));
  fill_gaussian(w.w_uk, mix64(seed * 2 + 1), sd);
  fill_gaussian(w.w_uv, mix64(seed * 2 + 2), sd);
  return w;
}

// ================================================================== prefill form

MlaExpanded mla_expand(const MlaConfig& cfg, const MlaWeights& w, const Tensor& q_nope,
                       const Tensor& q_pe, const Tensor& c_kv, const Tensor& k_pe,
                       const Mask& mask) {
  cfg.validate();
  const int64_t H = cfg.heads, dc = cfg.latent, dr = cfg.rope, dn = cfg.qk_nope, dv = cfg.v_head;
  check_f32(c_kv, "c_kv", {-1, -1, dc});
  const int64_t B = c_kv.size(0), S = c_kv.size(1);
  check_f32(k_pe, "k_pe", {B, S, dr});
  check_f32(q_nope, "q_nope", {B, -1, H, dn});
  check_f32(q_pe, "q_pe", {B, q_nope.size(1), H, dr});
  check_f32(w.w_uk, "w_uk", {H, dn, dc});
  check_f32(w.w_uv, "w_uv", {H, dv, dc});
  const int64_t Sq = q_nope.size(1), dqk = dn + dr;
  MlaExpanded e{Tensor::empty({B, Sq, H, dqk}, DType::f32),
                Tensor::empty({B, S, H, dqk}, DType::f32), Tensor::empty({B, S, H, dv}, DType::f32),
                AttnSpec{}};
  // K_nope_h = W_UK_h c and V_h = W_UV_h c for every token, into K's first dn columns and V.
  cpu::mla_up_project(c_kv.ptr<float>(), B * S, dc, w.w_uk.ptr<float>(), H, dn, e.k.ptr<float>(),
                      dqk, H * dqk);
  cpu::mla_up_project(c_kv.ptr<float>(), B * S, dc, w.w_uv.ptr<float>(), H, dv, e.v.ptr<float>(),
                      dv, H * dv);
  for (int64_t t = 0; t < B * S; ++t)
    for (int64_t h = 0; h < H; ++h)
      std::memcpy(e.k.ptr<float>() + (t * H + h) * dqk + dn, k_pe.ptr<float>() + t * dr,
                  size_t(dr) * 4);
  for (int64_t t = 0; t < B * Sq; ++t)
    for (int64_t h = 0; h < H; ++h) {
      std::memcpy(e.q.ptr<float>() + (t * H + h) * dqk, q_nope.ptr<float>() + (t * H + h) * dn,
                  size_t(dn) * 4);
      std::memcpy(e.q.ptr<float>() + (t * H + h) * dqk + dn, q_pe.ptr<float>() + (t * H + h) * dr,
                  size_t(dr) * 4);
    }
  e.spec.heads_q = e.spec.heads_kv = H;
  e.spec.head_dim = dqk;
  e.spec.head_dim_v = dv;
  e.spec.softmax_scale = cfg.scale();
  e.spec.mask = mask;
  return e;
}

// ================================================================== absorbed decode

namespace {

// What one absorbed decode computes: heads [h0, h0 + nh) against the latent columns
// [lat0, lat0 + nlat) held in c (its own columns 0 .. nlat) and the rope columns
// [rope0, rope0 + nrope) held in kpe; the logits are multiplied by `mult`. out receives
// W_UV_h[:, lat0 ..] z_h for its nh heads at head offset out_h0 of out_heads; lse (optional)
// [B, nh, S_q] gets the slice's log-sum-exp.
struct Slice {
  int64_t h0, nh, lat0, nlat, rope0, nrope;
  float mult = 1.f;
};

// The absorbed decode of slice sl against its cache columns c [B, S, nlat] and kpe [B, S, nrope],
// on the tensors' device (src/dispatch.h). out receives W_UV_h[:, slice] z_h for the slice's heads
// at head offset out_h0 of out_heads; lse (optional) [B, nh, S_q] the slice's log-sum-exp.
void absorbed_decode(const MlaConfig& cfg, const MlaWeights& w, const Tensor& q_nope,
                     const Tensor& q_pe, const Tensor& c, const Tensor& kpe, int64_t q_pos0,
                     const Mask& mask, const Slice& sl, float* out, int64_t out_heads,
                     int64_t out_h0, float* lse) {
  DATTN_ASSERT(c.size(2) == sl.nlat && kpe.size(2) == sl.nrope);
  MlaAbsorbedBlock p;
  p.q_nope = q_nope.ptr<float>();
  p.q_pe = q_pe.ptr<float>();
  p.w_uk = w.w_uk.ptr<float>();
  p.w_uv = w.w_uv.ptr<float>();
  p.c_kv = c.ptr<float>();
  p.k_pe = kpe.ptr<float>();
  p.batch = q_nope.size(0);
  p.seq_q = q_nope.size(1);
  p.seq_kv = c.size(1);
  p.heads_all = cfg.heads;
  p.qk_nope = cfg.qk_nope;
  p.rope_all = cfg.rope;
  p.latent_all = cfg.latent;
  p.v_head = cfg.v_head;
  p.h0 = sl.h0;
  p.nh = sl.nh;
  p.lat0 = sl.lat0;
  p.nlat = sl.nlat;
  p.rope0 = sl.rope0;
  p.nrope = sl.nrope;
  p.q_pos0 = q_pos0;
  p.scale = cfg.scale() * sl.mult;
  p.left = mask.left;
  p.right = mask.right;
  mla_absorbed_decode(q_nope.device(), p, mask, out, out_heads, out_h0, lse);
}

void check_decode_inputs(const MlaConfig& cfg, const MlaWeights& w, const Tensor& q_nope,
                         const Tensor& q_pe, const Device& device = Device::cpu()) {
  cfg.validate();
  check_f32(q_nope, "q_nope", {-1, -1, cfg.heads, cfg.qk_nope}, device);
  check_f32(q_pe, "q_pe", {q_nope.size(0), q_nope.size(1), cfg.heads, cfg.rope}, device);
  check_f32(w.w_uk, "w_uk", {cfg.heads, cfg.qk_nope, cfg.latent}, device);
  check_f32(w.w_uv, "w_uv", {cfg.heads, cfg.v_head, cfg.latent}, device);
}

}  // namespace

Partial mla_decode_local(const MlaConfig& cfg, const MlaWeights& w, const Tensor& q_nope,
                         const Tensor& q_pe, const Tensor& c_kv, const Tensor& k_pe, int64_t q_pos0,
                         const Mask& mask) {
  check_decode_inputs(cfg, w, q_nope, q_pe);
  check_f32(c_kv, "c_kv", {q_nope.size(0), -1, cfg.latent});
  check_f32(k_pe, "k_pe", {q_nope.size(0), c_kv.size(1), cfg.rope});
  const int64_t B = q_nope.size(0), Sq = q_nope.size(1);
  Partial r{Tensor::zeros({B, Sq, cfg.heads, cfg.v_head}, DType::f32),
            Tensor::empty({B, cfg.heads, Sq}, DType::f32)};
  absorbed_decode(cfg, w, q_nope, q_pe, c_kv, k_pe, q_pos0, mask,
                  Slice{0, cfg.heads, 0, cfg.latent, 0, cfg.rope}, r.out.ptr<float>(), cfg.heads, 0,
                  r.lse.ptr<float>());
  return r;
}

// ================================================================== transforms

const char* latent_transform_name(LatentTransform t) {
  return t == LatentTransform::none ? "none" : t == LatentTransform::hadamard ? "hadamard" : "pca";
}

void fwht(float* x, int64_t n) {
  DATTN_CHECK_ARG(n > 0 && (n & (n - 1)) == 0, "fwht size", n, "a power of two");
  cpu::fwht(x, n);
}

MlaTransform make_latent_transform(LatentTransform kind, int64_t d_c, const Tensor& calibration) {
  MlaTransform t{kind, d_c, {}};
  if (kind == LatentTransform::none) return t;
  t.r.assign(size_t(d_c * d_c), 0.f);
  if (kind == LatentTransform::hadamard) {
    DATTN_CHECK_ARG(d_c > 0 && (d_c & (d_c - 1)) == 0, "latent", d_c,
                    "a power of two for the Hadamard transform");
    for (int64_t i = 0; i < d_c; ++i) {  // H is symmetric: row i = H e_i
      float* row = t.r.data() + i * d_c;
      row[i] = 1.f;
      fwht(row, d_c);
    }
    return t;
  }
  // PCA: eigenvectors of the calibration latents' covariance, by decreasing variance.
  check_f32(calibration, "calibration", {-1, d_c});
  const int64_t N = calibration.size(0);
  DATTN_CHECK_ARG(N >= 2, "calibration tokens", N, ">= 2");
  cpu::pca_rotation(calibration.ptr<float>(), N, d_c, t.r.data());
  return t;
}

namespace {
// rows [n, d] times R^T: each row x becomes R x.
Tensor rows_times_rt(const Tensor& rows, int64_t n, int64_t d, const std::vector<float>& r,
                     std::initializer_list<int64_t> shape) {
  Tensor out = Tensor::empty(shape, DType::f32);
  cpu::rows_times_rt(rows.ptr<float>(), n, d, r.data(), out.ptr<float>());
  return out;
}
}  // namespace

MlaWeights fold_transform(const MlaWeights& w, const MlaTransform& t) {
  if (t.kind == LatentTransform::none) return {w.w_uk.to(DType::f32), w.w_uv.to(DType::f32)};
  const int64_t H = w.w_uk.size(0), dn = w.w_uk.size(1), dv = w.w_uv.size(1), dc = t.dim;
  DATTN_CHECK_ARG(w.w_uk.size(2) == dc, "w_uk latent", w.w_uk.size(2), dc);
  return {rows_times_rt(w.w_uk, H * dn, dc, t.r, {H, dn, dc}),
          rows_times_rt(w.w_uv, H * dv, dc, t.r, {H, dv, dc})};
}

Tensor apply_transform(const MlaTransform& t, const Tensor& c_kv) {
  if (t.kind == LatentTransform::none) return c_kv.to(DType::f32);
  check_f32(c_kv, "c_kv", {-1, -1, t.dim});
  return rows_times_rt(c_kv, c_kv.size(0) * c_kv.size(1), t.dim, t.r,
                       {c_kv.size(0), c_kv.size(1), t.dim});
}

// ================================================================== distributed decode

const char* mla_parallel_name(MlaParallel p) {
  return p == MlaParallel::head_split ? "head_split" : "tpla";
}

namespace {
// The latent and rope columns rank g of G holds.
Slice tpla_slice(const MlaConfig& cfg, const TplaOptions& opt, int g, int G) {
  Slice s{0, cfg.heads, g * cfg.latent / G, cfg.latent / G, 0, cfg.rope};
  if (opt.rope == RopePlacement::split) {
    s.rope0 = g * cfg.rope / G;
    s.nrope = cfg.rope / G;
  }
  s.mult = opt.scale_logits_by_g ? float(G) : 1.f;
  return s;
}

void check_parallel(const MlaConfig& cfg, MlaParallel parallel, const TplaOptions& opt, int G) {
  cfg.validate();
  if (parallel == MlaParallel::head_split) {
    DATTN_CHECK_ARG(cfg.heads % G == 0, "heads", cfg.heads,
                    detail::cat("divisible by the ranks (", G, ") for head-split parallelism"));
  } else {
    DATTN_CHECK_ARG(cfg.latent % G == 0, "latent", cfg.latent,
                    detail::cat("divisible by the ranks (", G, ") for TPLA"));
    if (opt.rope == RopePlacement::split)
      DATTN_CHECK_ARG(cfg.rope % G == 0, "rope", cfg.rope,
                      detail::cat("divisible by the ranks (", G, ") for a split RoPE part"));
  }
}

Tensor columns(const Tensor& t, int64_t begin, int64_t len) {
  const int64_t B = t.size(0), S = t.size(1), d = t.size(2);
  Tensor out = Tensor::empty({B, S, len}, DType::f32);
  for (int64_t i = 0; i < B * S; ++i)
    std::memcpy(out.ptr<float>() + i * len, t.ptr<float>() + i * d + begin, size_t(len) * 4);
  return out;
}
}  // namespace

MlaCacheShard mla_shard_cache(const MlaConfig& cfg, MlaParallel parallel, const TplaOptions& opt,
                              const Tensor& c_kv, const Tensor& k_pe, int rank, int ranks) {
  check_parallel(cfg, parallel, opt, ranks);
  check_f32(c_kv, "c_kv", {-1, -1, cfg.latent});
  check_f32(k_pe, "k_pe", {c_kv.size(0), c_kv.size(1), cfg.rope});
  if (parallel == MlaParallel::head_split) return {c_kv, k_pe, 0, cfg.latent, 0, cfg.rope};
  const Slice s = tpla_slice(cfg, opt, rank, ranks);
  MlaCacheShard sh{columns(c_kv, s.lat0, s.nlat), k_pe, s.lat0, s.nlat, 0, cfg.rope};
  if (opt.rope == RopePlacement::split) {
    sh.k_pe = columns(k_pe, s.rope0, s.nrope);
    sh.rope_begin = s.rope0;
    sh.rope_len = s.nrope;
  }
  return sh;
}

Tensor mla_decode(Runtime& rt, MlaParallel parallel, const MlaConfig& cfg, const MlaWeights& w,
                  const Tensor& q_nope, const Tensor& q_pe, const MlaCacheShard& shard,
                  int64_t q_pos0, const TplaOptions& opt, const Mask& mask) {
  StreamScope on_stream(rt.stream());  // all device work of this call on its stream
  Communicator& comm = rt.cp();
  const int G = comm.size(), g = comm.rank();
  uint64_t h = kHashSeed;
  for (int64_t x : {cfg.heads, cfg.latent, cfg.rope, cfg.qk_nope, cfg.v_head, int64_t(parallel),
                    int64_t(opt.rope), int64_t(opt.scale_logits_by_g), q_pos0,
                    q_nope.dim() == 4 ? q_nope.size(1) : int64_t(0)})
    h = hash_mix(h, uint64_t(x));
  const Device dev = rt.device();
  agree_on_validation(comm, "MLA decode step", h, [&] {
    check_parallel(cfg, parallel, opt, G);
    check_decode_inputs(cfg, w, q_nope, q_pe, dev);
    const Slice s = parallel == MlaParallel::tpla ? tpla_slice(cfg, opt, g, G)
                                                  : Slice{0, cfg.heads, 0, cfg.latent, 0, cfg.rope};
    DATTN_CHECK_ARG(shard.latent_begin == s.lat0 && shard.latent_len == s.nlat &&
                        shard.c_kv.dim() == 3 && shard.c_kv.size(2) == s.nlat,
                    "cache shard latent", detail::cat(shard.latent_begin, "+", shard.latent_len),
                    detail::cat(s.lat0, "+", s.nlat, " (this rank's slice)"));
    check_f32(shard.c_kv, "cache c_kv", {q_nope.size(0), -1, s.nlat}, dev);
    DATTN_CHECK_ARG(
        shard.rope_begin == s.rope0 && shard.rope_len == s.nrope, "cache shard rope",
        detail::cat(shard.rope_begin, "+", shard.rope_len),
        detail::cat(s.rope0, "+", s.nrope, " (this rank's RoPE columns under the ",
                    opt.rope == RopePlacement::split ? "split" : "replicated", " placement)"));
    check_f32(shard.k_pe, "cache k_pe", {q_nope.size(0), shard.c_kv.size(1), s.nrope}, dev);
    check_mla_limits(dev, mask, s.nlat, s.nrope, q_nope.size(0), q_nope.size(1), cfg.qk_nope);
    if (rt.check_finite()) {  // the queries at q_pos0.., the cache's tokens at 0..
      auto query = [&](int64_t row) { return q_pos0 + row; };
      auto token = [](int64_t row) { return row; };
      check_finite_tensor(q_nope, "q_nope", query);
      check_finite_tensor(q_pe, "q_pe", query);
      check_finite_tensor(shard.c_kv, "cache c_kv", token);
      check_finite_tensor(shard.k_pe, "cache k_pe", token);
    }
  });
  const int64_t B = q_nope.size(0), Sq = q_nope.size(1), H = cfg.heads, dv = cfg.v_head;
  if (parallel == MlaParallel::tpla) {
    Tensor out = Tensor::zeros({B, Sq, H, dv}, DType::f32, dev);
    absorbed_decode(cfg, w, q_nope, q_pe, shard.c_kv, shard.k_pe, q_pos0, mask,
                    tpla_slice(cfg, opt, g, G), out.ptr<float>(), H, 0, nullptr);
    if (G > 1)
      comm.allreduce(out.data(), out.data(), size_t(out.numel()), DType::f32, ReduceOp::sum);
    return out;
  }
  // Head split: my heads, then every rank's heads to every rank.
  const int64_t hg = H / G;
  Tensor mine = Tensor::zeros({B, Sq, hg, dv}, DType::f32, dev);
  absorbed_decode(cfg, w, q_nope, q_pe, shard.c_kv, shard.k_pe, q_pos0, mask,
                  Slice{g * hg, hg, 0, cfg.latent, 0, cfg.rope}, mine.ptr<float>(), hg, 0, nullptr);
  if (G == 1) return mine;
  const Tensor all = byte_buffer(mine.nbytes() * size_t(G), dev);
  comm.allgather(mine.data(), all.data(), mine.nbytes());
  // Rank r's [B * S_q, hg, dv] block goes to heads r * hg ..: per token, G rows of hg * dv.
  Tensor out = Tensor::empty({B, Sq, H, dv}, DType::f32, dev);
  for (int r = 0; r < G; ++r)
    copy_rows(out.data(), dev, G, r, all.ptr<float>() + size_t(r) * size_t(mine.numel()), dev, 1, 0,
              B * Sq, 1, size_t(hg * dv) * sizeof(float));
  return out;
}

uint64_t mla_cache_bytes_per_token(const MlaConfig& cfg, MlaParallel parallel,
                                   const TplaOptions& opt, int ranks) {
  if (parallel == MlaParallel::head_split) return uint64_t(cfg.latent + cfg.rope) * 4;
  if (opt.rope == RopePlacement::split) return uint64_t((cfg.latent + cfg.rope) / ranks) * 4;
  return uint64_t(cfg.latent / ranks + cfg.rope) * 4;
}

uint64_t mla_decode_send_bytes(const MlaConfig& cfg, MlaParallel parallel, int64_t batch,
                               int64_t s_q, int ranks) {
  if (ranks == 1) return 0;
  const uint64_t rows = uint64_t(batch * s_q);
  if (parallel == MlaParallel::head_split)  // allgather: this rank's heads
    return rows * uint64_t(cfg.heads / ranks * cfg.v_head) * 4;
  return rows * uint64_t(cfg.heads * cfg.v_head) * 4;  // sum-allreduce of the whole output
}

std::vector<double> tpla_reference(const MlaConfig& cfg, const MlaWeights& w, const Tensor& q_nope,
                                   const Tensor& q_pe, const Tensor& c_kv, const Tensor& k_pe,
                                   int64_t q_pos0, int ranks, const TplaOptions& opt,
                                   const Mask& mask) {
  check_parallel(cfg, MlaParallel::tpla, opt, ranks);
  check_decode_inputs(cfg, w, q_nope, q_pe);
  const int64_t B = q_nope.size(0), Sq = q_nope.size(1), S = c_kv.size(1), H = cfg.heads;
  const int64_t dn = cfg.qk_nope, dc = cfg.latent, dr = cfg.rope, dv = cfg.v_head;
  const double scale = cfg.scale();
  std::vector<double> out(size_t(B * Sq * H * dv), 0.0);
  const float *wk = w.w_uk.ptr<float>(), *wv = w.w_uv.ptr<float>();
  const float *qn = q_nope.ptr<float>(), *qpe = q_pe.ptr<float>();
  const float *c = c_kv.ptr<float>(), *kp = k_pe.ptr<float>();
  for (int g = 0; g < ranks; ++g) {
    const Slice sl = tpla_slice(cfg, opt, g, ranks);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < Sq; ++s)
        for (int64_t h = 0; h < H; ++h) {
          const int64_t row = (b * Sq + s) * H + h;
          std::vector<double> qt(size_t(sl.nlat), 0.0), sc(static_cast<size_t>(S)),
              z(size_t(sl.nlat), 0.0);
          for (int64_t a = 0; a < sl.nlat; ++a)
            for (int64_t k = 0; k < dn; ++k)
              qt[size_t(a)] += double(wk[(h * dn + k) * dc + sl.lat0 + a]) * qn[row * dn + k];
          double m = -INFINITY;
          for (int64_t j = 0; j < S; ++j) {
            if (!mask.visible(q_pos0 + s, j)) {
              sc[size_t(j)] = -INFINITY;
              continue;
            }
            double dot = 0;
            for (int64_t a = 0; a < sl.nlat; ++a)
              dot += qt[size_t(a)] * c[(b * S + j) * dc + sl.lat0 + a];
            for (int64_t r = 0; r < sl.nrope; ++r)
              dot += double(qpe[row * dr + sl.rope0 + r]) * kp[(b * S + j) * dr + sl.rope0 + r];
            sc[size_t(j)] = dot * scale * sl.mult;
            m = std::max(m, sc[size_t(j)]);
          }
          if (m == -INFINITY) continue;
          double sum = 0;
          for (int64_t j = 0; j < S; ++j) {
            if (sc[size_t(j)] == -INFINITY) continue;
            const double p = std::exp(sc[size_t(j)] - m);
            sum += p;
            for (int64_t a = 0; a < sl.nlat; ++a)
              z[size_t(a)] += p * c[(b * S + j) * dc + sl.lat0 + a];
          }
          for (int64_t d = 0; d < dv; ++d) {
            double o = 0;
            for (int64_t a = 0; a < sl.nlat; ++a)
              o += double(wv[(h * dv + d) * dc + sl.lat0 + a]) * z[size_t(a)] / sum;
            out[size_t(row * dv + d)] += o;
          }
        }
  }
  return out;
}

}  // namespace dattn
