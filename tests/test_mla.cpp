// Multi-rank tests (1-4 ranks) of MLA and TPLA (src/mla.h): the prefill form (mla_expand, then
// local and ring attention) and the absorbed decode form against an independent float64 MLA
// reference, head-split and TPLA decode, latent transforms, the byte models, and bad input.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "src/attention.h"
#include "src/base/error.h"
#include "src/layout.h"
#include "src/mla.h"
#include "src/runtime.h"
#include "tests/test_reference.h"

namespace dattn {
namespace {

using test::throws_naming;

using test::world_size;

// ---------------------------------------------------------------- problems

// Small configurations: 8 heads for the one-process forms, 12 for the distributed ones (1, 2, 3
// and 4 ranks divide 12); latent 64 and rope 16 divide by 2 and 4, not by 3.
MlaConfig small_config(int64_t heads = 8) {
  MlaConfig cfg;
  cfg.heads = heads;
  cfg.latent = 64;
  cfg.rope = 16;
  cfg.qk_nope = 32;
  cfg.v_head = 32;
  return cfg;
}

// The queries of S tokens and the cache of S tokens, the same on every rank.
struct MlaInputs {
  Tensor q_nope, q_pe;  // [B, S, H, qk_nope], [B, S, H, d_r]
  Tensor c_kv, k_pe;    // [B, S, d_c], [B, S, d_r]
};
MlaInputs make_inputs(const MlaConfig& cfg, int64_t B, int64_t S, uint64_t seed) {
  MlaInputs in;
  in.q_nope = test::random_tensor({B, S, cfg.heads, cfg.qk_nope}, DType::f32, seed);
  in.q_pe = test::random_tensor({B, S, cfg.heads, cfg.rope}, DType::f32, seed + 1);
  in.c_kv = test::random_tensor({B, S, cfg.latent}, DType::f32, seed + 2);
  in.k_pe = test::random_tensor({B, S, cfg.rope}, DType::f32, seed + 3);
  return in;
}

// The last n rows (dimension 1) of a tensor: the decode queries at the end of the context.
Tensor last_rows(const Tensor& t, int64_t n) {
  return t.seq_slice(t.size(1) - n, n);
}

std::vector<double> to_double(const Tensor& t) {
  std::vector<double> v(size_t(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i)
    v[size_t(i)] = t.get(i);
  return v;
}

// ---------------------------------------------------------------- float64 references

// The MLA scale as the fp32 value the library is handed (MlaConfig::scale() is a float): the
// float64 references use exactly that value, so that they agree with tpla_reference to ~1e-15.
double mla_scale(const MlaConfig& cfg) {
  return cfg.softmax_scale != 0.f ? double(cfg.softmax_scale)
                                  : double(float(1.0 / std::sqrt(double(cfg.qk_nope + cfg.rope))));
}

// Plain MLA, one head at a time: k_j = (W_UK_h c_j | k_pe_j), v_j = W_UV_h c_j, scores
// scale * q . k_j on the visible keys, softmax, out = sum p_j v_j. Queries at q_pos0 .., keys at
// 0 ... out [B, S_q, H, v_head], lse [B, H, S_q].
cpu::ReferenceResult mla_reference(const MlaConfig& cfg, const MlaWeights& w, const Tensor& q_nope,
                                   const Tensor& q_pe, const Tensor& c_kv, const Tensor& k_pe,
                                   int64_t q_pos0, const Mask& mask = Mask::causal()) {
  const int64_t B = q_nope.size(0), Sq = q_nope.size(1), S = c_kv.size(1), H = cfg.heads;
  const int64_t dn = cfg.qk_nope, dr = cfg.rope, dc = cfg.latent, dv = cfg.v_head;
  const double scale = mla_scale(cfg);
  const float* qn = q_nope.ptr<float>();
  const float* qp = q_pe.ptr<float>();
  const float* c = c_kv.ptr<float>();
  const float* kp = k_pe.ptr<float>();
  const float* wk = w.w_uk.ptr<float>();
  const float* wv = w.w_uv.ptr<float>();
  cpu::ReferenceResult r;
  r.out.assign(size_t(B * Sq * H * dv), 0.0);
  r.lse.assign(size_t(B * H * Sq), -std::numeric_limits<double>::infinity());
  std::vector<double> kn(static_cast<size_t>(S * dn)), vv(static_cast<size_t>(S * dv)),
      s(static_cast<size_t>(S));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t j = 0; j < S; ++j) {
        const float* cj = c + (b * S + j) * dc;
        for (int64_t d = 0; d < dn; ++d) {
          double acc = 0;
          for (int64_t e = 0; e < dc; ++e)
            acc += double(wk[(h * dn + d) * dc + e]) * cj[e];
          kn[size_t(j * dn + d)] = acc;
        }
        for (int64_t d = 0; d < dv; ++d) {
          double acc = 0;
          for (int64_t e = 0; e < dc; ++e)
            acc += double(wv[(h * dv + d) * dc + e]) * cj[e];
          vv[size_t(j * dv + d)] = acc;
        }
      }
      for (int64_t i = 0; i < Sq; ++i) {
        const float* qni = qn + ((b * Sq + i) * H + h) * dn;
        const float* qpi = qp + ((b * Sq + i) * H + h) * dr;
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < S; ++j) {
          if (!mask.visible(q_pos0 + i, j)) continue;
          double dot = 0;
          for (int64_t d = 0; d < dn; ++d)
            dot += qni[d] * kn[size_t(j * dn + d)];
          for (int64_t d = 0; d < dr; ++d)
            dot += double(qpi[d]) * kp[(b * S + j) * dr + d];
          s[size_t(j)] = scale * dot;
          m = std::max(m, s[size_t(j)]);
        }
        if (m == -std::numeric_limits<double>::infinity()) continue;  // sees no key
        double sum = 0;
        double* o = &r.out[size_t(((b * Sq + i) * H + h) * dv)];
        for (int64_t j = 0; j < S; ++j) {
          if (!mask.visible(q_pos0 + i, j)) continue;
          const double p = std::exp(s[size_t(j)] - m);
          sum += p;
          for (int64_t d = 0; d < dv; ++d)
            o[d] += p * vv[size_t(j * dv + d)];
        }
        for (int64_t d = 0; d < dv; ++d)
          o[d] /= sum;
        r.lse[size_t((b * H + h) * Sq + i)] = m + std::log(sum);
      }
    }
  return r;
}

// TPLA as src/mla.h states it, written independently of tpla_reference: slice g of G holds
// latent columns [g d_c/G, (g+1) d_c/G) and the rope columns (all when replicated, [g d_r/G, ..)
// when split); its scores are scale_g * (q~_h[slice] . c[slice] + q_pe[rope slice] .
// k_pe[rope slice]) with q~_h = W_UK_h^T q_nope_h and scale_g = scale (times G with
// scale_logits_by_g); z_g = softmax . c[slice]; out = sum_g W_UV_h[:, slice] z_g.
std::vector<double> tpla_independent(const MlaConfig& cfg, const MlaWeights& w,
                                     const Tensor& q_nope, const Tensor& q_pe, const Tensor& c_kv,
                                     const Tensor& k_pe, int64_t q_pos0, int G,
                                     const TplaOptions& opt) {
  const int64_t B = q_nope.size(0), Sq = q_nope.size(1), S = c_kv.size(1), H = cfg.heads;
  const int64_t dn = cfg.qk_nope, dr = cfg.rope, dc = cfg.latent, dv = cfg.v_head;
  const Mask mask = Mask::causal();
  const double scale = mla_scale(cfg) * (opt.scale_logits_by_g ? G : 1);
  const float* qn = q_nope.ptr<float>();
  const float* qp = q_pe.ptr<float>();
  const float* c = c_kv.ptr<float>();
  const float* kp = k_pe.ptr<float>();
  const float* wk = w.w_uk.ptr<float>();
  const float* wv = w.w_uv.ptr<float>();
  std::vector<double> out(static_cast<size_t>(B * Sq * H * dv), 0.0), qt(static_cast<size_t>(dc)),
      s(static_cast<size_t>(S)), z(static_cast<size_t>(dc));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Sq; ++i)
      for (int64_t h = 0; h < H; ++h) {
        const float* qni = qn + ((b * Sq + i) * H + h) * dn;
        const float* qpi = qp + ((b * Sq + i) * H + h) * dr;
        for (int64_t e = 0; e < dc; ++e) {
          double acc = 0;
          for (int64_t d = 0; d < dn; ++d)
            acc += double(wk[(h * dn + d) * dc + e]) * qni[d];
          qt[size_t(e)] = acc;
        }
        double* o = &out[size_t(((b * Sq + i) * H + h) * dv)];
        for (int g = 0; g < G; ++g) {
          const int64_t l0 = g * dc / G, l1 = (g + 1) * dc / G;
          const bool split = opt.rope == RopePlacement::split;
          const int64_t r0 = split ? g * dr / G : 0, r1 = split ? (g + 1) * dr / G : dr;
          double m = -std::numeric_limits<double>::infinity();
          for (int64_t j = 0; j < S; ++j) {
            if (!mask.visible(q_pos0 + i, j)) continue;
            double dot = 0;
            for (int64_t e = l0; e < l1; ++e)
              dot += qt[size_t(e)] * c[(b * S + j) * dc + e];
            for (int64_t e = r0; e < r1; ++e)
              dot += double(qpi[e]) * kp[(b * S + j) * dr + e];
            s[size_t(j)] = scale * dot;
            m = std::max(m, s[size_t(j)]);
          }
          if (m == -std::numeric_limits<double>::infinity()) continue;
          double sum = 0;
          std::fill(z.begin(), z.end(), 0.0);
          for (int64_t j = 0; j < S; ++j) {
            if (!mask.visible(q_pos0 + i, j)) continue;
            const double p = std::exp(s[size_t(j)] - m);
            sum += p;
            for (int64_t e = l0; e < l1; ++e)
              z[size_t(e)] += p * c[(b * S + j) * dc + e];
          }
          for (int64_t d = 0; d < dv; ++d) {
            double acc = 0;
            for (int64_t e = l0; e < l1; ++e)
              acc += double(wv[(h * dv + d) * dc + e]) * z[size_t(e)] / sum;
            o[d] += acc;
          }
        }
      }
  return out;
}

// ---------------------------------------------------------------- comparisons

// |got - ref| <= atol + rtol |ref| everywhere (equal infinities pass, NaN fails); the failure
// names the worst index.
testing::AssertionResult all_close(const float* got, const double* ref, size_t n, double atol,
                                   double rtol) {
  double worst = 0, worst_err = 0;
  size_t at = 0, bad = 0;
  for (size_t i = 0; i < n; ++i) {
    if (double(got[i]) == ref[i]) continue;  // also equal infinities, and atol = rtol = 0
    const double err = std::fabs(double(got[i]) - ref[i]);
    const double ratio = err / (atol + rtol * std::fabs(ref[i]));
    if (!(ratio <= 1.0)) ++bad;
    if (!(ratio <= worst)) {
      worst = std::isnan(ratio) ? std::numeric_limits<double>::infinity() : ratio;
      worst_err = err;
      at = i;
      if (std::isnan(ratio)) break;
    }
  }
  if (bad == 0) return testing::AssertionSuccess() << "max error/allowed " << worst;
  return testing::AssertionFailure()
         << bad << " of " << n << " values off; worst at " << at << ": got " << got[at]
         << ", expected " << ref[at] << " (error " << worst_err << ")";
}
testing::AssertionResult all_close(const Tensor& got, const std::vector<double>& ref, double atol,
                                   double rtol) {
  if (size_t(got.numel()) != ref.size())
    return testing::AssertionFailure()
           << "size " << got.numel() << " (" << got.shape_str() << "), expected " << ref.size();
  return all_close(got.ptr<float>(), ref.data(), ref.size(), atol, rtol);
}
testing::AssertionResult all_close(const Tensor& got, const Tensor& ref, double atol, double rtol) {
  return all_close(got, to_double(ref), atol, rtol);
}

// Whether t holds the same bits on every rank (every rank gets the same answer).
testing::AssertionResult same_on_all_ranks(const Tensor& t) {
  const int64_t n = t.numel();
  int64_t lo = n, hi = n;
  MPI_Allreduce(&n, &lo, 1, MPI_INT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&n, &hi, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
  if (lo != hi) return testing::AssertionFailure() << "sizes differ across ranks";
  std::vector<float> root(t.ptr<float>(), t.ptr<float>() + n);
  MPI_Bcast(root.data(), int(n), MPI_FLOAT, 0, MPI_COMM_WORLD);
  int differ = std::memcmp(root.data(), t.data(), size_t(n) * sizeof(float)) != 0 ? 1 : 0;
  int any = differ;
  MPI_Allreduce(&differ, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (any)
    return testing::AssertionFailure() << "some rank's output differs from rank 0's (this rank "
                                       << (differ ? "differs" : "matches") << ")";
  return testing::AssertionSuccess();
}

void expect_shape(const Tensor& t, std::vector<int64_t> shape, const char* what) {
  ASSERT_EQ(t.dim(), int(shape.size())) << what << " " << t.shape_str();
  for (size_t d = 0; d < shape.size(); ++d)
    EXPECT_EQ(t.size(int(d)), shape[d]) << what << " " << t.shape_str() << " dimension " << d;
  EXPECT_EQ(t.dtype(), DType::f32) << what;
}

// The partial as a "reference" for comparing two dattn results with matches_reference.
cpu::ReferenceResult as_reference(const Partial& p) {
  return {to_double(p.out), to_double(p.lse)};
}

// ---------------------------------------------------------------- 1. prefill and decode forms

// The float64 reference itself: with W_UK, W_UV given, MLA is ordinary attention over the
// expanded K and V, which test::naive_reference computes independently.
TEST(MlaReference, AgreesWithNaiveAttentionOverExpandedTensors) {
  const MlaConfig cfg = small_config();
  const MlaWeights w = MlaWeights::random(cfg, 11);
  const int64_t B = 1, S = 40, H = cfg.heads, D = cfg.qk_nope + cfg.rope;
  const MlaInputs in = make_inputs(cfg, B, S, 12);
  Tensor q = Tensor::empty({B, S, H, D}, DType::f32), k = Tensor::empty({B, S, H, D}, DType::f32);
  Tensor v = Tensor::empty({B, S, H, cfg.v_head}, DType::f32);
  for (int64_t j = 0; j < S; ++j)
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t d = 0; d < D; ++d) {
        const bool nope = d < cfg.qk_nope;
        q.set((j * H + h) * D + d, nope ? in.q_nope.get((j * H + h) * cfg.qk_nope + d)
                                        : in.q_pe.get((j * H + h) * cfg.rope + d - cfg.qk_nope));
        double kd = 0;
        if (nope)
          for (int64_t e = 0; e < cfg.latent; ++e)
            kd += double(w.w_uk.get((h * cfg.qk_nope + d) * cfg.latent + e)) *
                  in.c_kv.get(j * cfg.latent + e);
        else
          kd = in.k_pe.get(j * cfg.rope + d - cfg.qk_nope);
        k.set((j * H + h) * D + d, float(kd));
      }
      for (int64_t d = 0; d < cfg.v_head; ++d) {
        double vd = 0;
        for (int64_t e = 0; e < cfg.latent; ++e)
          vd += double(w.w_uv.get((h * cfg.v_head + d) * cfg.latent + e)) *
                in.c_kv.get(j * cfg.latent + e);
        v.set((j * H + h) * cfg.v_head + d, float(vd));
      }
    }
  AttnSpec spec;
  spec.heads_q = spec.heads_kv = H;
  spec.head_dim = D;
  spec.head_dim_v = cfg.v_head;
  spec.mask = Mask::causal();
  const auto naive =
      test::naive_reference(q, k, v, spec, test::positions(0, S), test::positions(0, S));
  const auto ref = mla_reference(cfg, w, in.q_nope, in.q_pe, in.c_kv, in.k_pe, 0);
  // k and v were rounded to fp32 above: agreement to fp32 rounding.
  for (size_t i = 0; i < ref.out.size(); ++i)
    ASSERT_NEAR(ref.out[i], naive.out[i], 1e-5) << "out " << i;
  for (size_t i = 0; i < ref.lse.size(); ++i)
    ASSERT_NEAR(ref.lse[i], naive.lse[i], 1e-5) << "lse " << i;
}

TEST(MlaPrefill, ExpandThenLocalAttentionMatchesReference) {
  const MlaConfig cfg = small_config();
  const MlaWeights w = MlaWeights::random(cfg, 21);
  expect_shape(w.w_uk, {cfg.heads, cfg.qk_nope, cfg.latent}, "w_uk");
  expect_shape(w.w_uv, {cfg.heads, cfg.v_head, cfg.latent}, "w_uv");
  EXPECT_NEAR(cfg.scale(), 1.0 / std::sqrt(48.0), 1e-7);  // 1/sqrt(qk_nope + rope)
  const int64_t B = 2, S = 150, H = cfg.heads, D = cfg.qk_nope + cfg.rope, dv = cfg.v_head;
  const MlaInputs in = make_inputs(cfg, B, S, 22);
  for (const Mask& mask : {Mask::causal(), Mask::window(37)}) {
    SCOPED_TRACE("mask " + mask.str());
    const MlaExpanded e = mla_expand(cfg, w, in.q_nope, in.q_pe, in.c_kv, in.k_pe, mask);
    expect_shape(e.q, {B, S, H, D}, "q");
    expect_shape(e.k, {B, S, H, D}, "k");
    expect_shape(e.v, {B, S, H, dv}, "v");
    EXPECT_EQ(e.spec.heads_q, H);
    EXPECT_EQ(e.spec.heads_kv, H);
    EXPECT_EQ(e.spec.head_dim, D);
    EXPECT_EQ(e.spec.dim_v(), dv);
    EXPECT_NEAR(e.spec.scale(), mla_scale(cfg), 1e-7);
    EXPECT_TRUE(e.spec.mask == mask);
    // q is (q_nope | q_pe) as is; k's rope part is k_pe, shared by every head.
    for (int64_t t = 0; t < B * S; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) {
          const float want = d < cfg.qk_nope
                                 ? in.q_nope.get((t * H + h) * cfg.qk_nope + d)
                                 : in.q_pe.get((t * H + h) * cfg.rope + d - cfg.qk_nope);
          ASSERT_EQ(e.q.get((t * H + h) * D + d), want) << "q token " << t << " head " << h;
          if (d >= cfg.qk_nope) {
            ASSERT_EQ(e.k.get((t * H + h) * D + d), in.k_pe.get(t * cfg.rope + d - cfg.qk_nope))
                << "k_pe token " << t << " head " << h;
          }
        }
    const Partial res = attention_local(e.q, e.k, e.v, e.spec);
    const auto ref = mla_reference(cfg, w, in.q_nope, in.q_pe, in.c_kv, in.k_pe, 0, mask);
    EXPECT_TRUE(test::matches_reference(res.out.ptr<float>(), res.lse.ptr<float>(), B, S, H, dv,
                                        ref, test::tolerance_for(DType::f32)));
  }
}

TEST(MlaDecodeLocal, MatchesReferenceAndPrefillForm) {
  const int64_t B = 2, S = 150;
  MlaConfig scaled = small_config();
  scaled.softmax_scale = 0.3f;
  for (const MlaConfig& cfg : {small_config(), scaled}) {
    const MlaWeights w = MlaWeights::random(cfg, 31);
    const int64_t H = cfg.heads, dv = cfg.v_head;
    const MlaInputs in = make_inputs(cfg, B, S, 32);
    for (const Mask& mask : {Mask::causal(), Mask::window(37)}) {
      const MlaExpanded e = mla_expand(cfg, w, in.q_nope, in.q_pe, in.c_kv, in.k_pe, mask);
      const Partial prefill = attention_local(e.q, e.k, e.v, e.spec);
      const auto prefill_ref = as_reference(prefill);
      for (int64_t sq : {1, 4}) {
        SCOPED_TRACE("scale " + std::to_string(cfg.softmax_scale) + " mask " + mask.str() +
                     " S_q " + std::to_string(sq));
        const int64_t pos0 = S - sq;
        const Tensor qn = last_rows(in.q_nope, sq), qp = last_rows(in.q_pe, sq);
        const Partial dec = mla_decode_local(cfg, w, qn, qp, in.c_kv, in.k_pe, pos0, mask);
        expect_shape(dec.out, {B, sq, H, dv}, "out");
        expect_shape(dec.lse, {B, H, sq}, "lse");
        const auto ref = mla_reference(cfg, w, qn, qp, in.c_kv, in.k_pe, pos0, mask);
        EXPECT_TRUE(test::matches_reference(dec.out.ptr<float>(), dec.lse.ptr<float>(), B, sq, H,
                                            dv, ref, test::tolerance_for(DType::f32)));
        // The two forms agree: decode rows are prefill rows pos0 ...
        EXPECT_TRUE(test::matches_reference(
            dec.out.ptr<float>(), dec.lse.ptr<float>(), B, sq, H, dv, prefill_ref, S,
            [&](int64_t s) { return pos0 + s; }, test::tolerance_for(DType::f32)))
            << "decode form vs prefill form";
      }
    }
  }
}

// The expanded tensors through ring attention on a zigzag layout (S not a multiple of 2P).
TEST(MlaPrefill, RingOnZigzagMatchesReference) {
  Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, {});
  const int P = rt.cp_size(), me = rt.cp_rank();
  ASSERT_EQ(P, world_size());
  const MlaConfig cfg = small_config();
  const MlaWeights w = MlaWeights::random(cfg, 41);
  const int64_t B = 2, S = 203, H = cfg.heads, dv = cfg.v_head;
  const MlaInputs in = make_inputs(cfg, B, S, 42);
  const MlaExpanded e = mla_expand(cfg, w, in.q_nope, in.q_pe, in.c_kv, in.k_pe);
  const Layout layout = Layout::zigzag(S, P);
  const Partial res = attention(rt, layout.dispatch(e.q, me), layout.dispatch(e.k, me),
                                layout.dispatch(e.v, me), e.spec, layout, Strategy::ring);
  const int64_t n = layout.local_len(me);
  expect_shape(res.out, {B, n, H, dv}, "out");
  expect_shape(res.lse, {B, H, n}, "lse");
  const auto ref = mla_reference(cfg, w, in.q_nope, in.q_pe, in.c_kv, in.k_pe, 0);
  EXPECT_TRUE(test::matches_reference(
      res.out.ptr<float>(), res.lse.ptr<float>(), B, n, H, dv, ref, S,
      [&](int64_t s) { return layout.global_position(me, s); }, test::tolerance_for(DType::f32)))
      << "rank " << me << " of " << P;
}

// ---------------------------------------------------------------- 2. head-split decode

TEST(MlaHeadSplit, EqualsLocalDecodeOnEveryRank) {
  Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, {});
  const int P = rt.cp_size(), me = rt.cp_rank();
  const MlaConfig cfg = small_config(12);
  const MlaWeights w = MlaWeights::random(cfg, 51);
  const int64_t B = 2, S = 180, H = cfg.heads;
  const MlaInputs in = make_inputs(cfg, B, S, 52);
  const MlaCacheShard shard =
      mla_shard_cache(cfg, MlaParallel::head_split, {}, in.c_kv, in.k_pe, me, P);
  EXPECT_EQ(shard.latent_begin, 0);
  EXPECT_EQ(shard.latent_len, cfg.latent);
  EXPECT_EQ(shard.rope_begin, 0);
  EXPECT_EQ(shard.rope_len, cfg.rope);
  expect_shape(shard.c_kv, {B, S, cfg.latent}, "shard c_kv");
  expect_shape(shard.k_pe, {B, S, cfg.rope}, "shard k_pe");
  EXPECT_TRUE(all_close(shard.c_kv, in.c_kv, 0, 0));
  EXPECT_TRUE(all_close(shard.k_pe, in.k_pe, 0, 0));
  for (int64_t sq : {1, 4}) {
    SCOPED_TRACE("rank " + std::to_string(me) + " of " + std::to_string(P) + ", S_q " +
                 std::to_string(sq));
    const Tensor qn = last_rows(in.q_nope, sq), qp = last_rows(in.q_pe, sq);
    const Tensor out = mla_decode(rt, MlaParallel::head_split, cfg, w, qn, qp, shard, S - sq);
    expect_shape(out, {B, sq, H, cfg.v_head}, "out");
    const Partial local = mla_decode_local(cfg, w, qn, qp, in.c_kv, in.k_pe, S - sq);
    EXPECT_TRUE(all_close(out, local.out, 1e-5, 1e-5));
    EXPECT_TRUE(same_on_all_ranks(out));
  }
}

// ---------------------------------------------------------------- 3. TPLA

const TplaOptions kTplaOptions[] = {{RopePlacement::replicated, false},
                                    {RopePlacement::replicated, true},
                                    {RopePlacement::split, false},
                                    {RopePlacement::split, true}};
std::string options_str(const TplaOptions& o) {
  return std::string(o.rope == RopePlacement::split ? "rope split" : "rope replicated") +
         (o.scale_logits_by_g ? ", logits x G" : ", logits x 1");
}

// tpla_reference against the independent TPLA above; with G = 1 it is exact MLA, and with G > 1
// it is not (the test would be vacuous otherwise).
TEST(TplaReference, MatchesIndependentRuleAndIsExactMlaAtOneSlice) {
  const MlaConfig cfg = small_config();
  const MlaWeights w = MlaWeights::random(cfg, 61);
  const int64_t B = 2, S = 120, sq = 4;
  const MlaInputs in = make_inputs(cfg, B, S, 62);
  const Tensor qn = last_rows(in.q_nope, sq), qp = last_rows(in.q_pe, sq);
  const auto exact = mla_reference(cfg, w, qn, qp, in.c_kv, in.k_pe, S - sq);
  for (const TplaOptions& opt : kTplaOptions) {
    for (int G : {1, 2, 4}) {
      SCOPED_TRACE(options_str(opt) + ", G " + std::to_string(G));
      const auto lib = tpla_reference(cfg, w, qn, qp, in.c_kv, in.k_pe, S - sq, G, opt);
      const auto mine = tpla_independent(cfg, w, qn, qp, in.c_kv, in.k_pe, S - sq, G, opt);
      ASSERT_EQ(lib.size(), mine.size());
      double max_vs_mine = 0, max_vs_exact = 0;
      for (size_t i = 0; i < lib.size(); ++i) {
        max_vs_mine = std::max(max_vs_mine, std::fabs(lib[i] - mine[i]));
        max_vs_exact = std::max(max_vs_exact, std::fabs(lib[i] - exact.out[i]));
      }
      EXPECT_LT(max_vs_mine, 1e-10);
      if (G == 1)
        EXPECT_LT(max_vs_exact, 1e-10) << "TPLA with one slice is exact MLA";
      else
        EXPECT_GT(max_vs_exact, 1e-3) << "TPLA with " << G << " slices should differ from MLA";
    }
  }
}

TEST(MlaTpla, EqualsTplaReferenceOnEveryRank) {
  Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, {});
  const int P = rt.cp_size(), me = rt.cp_rank();
  const MlaConfig cfg = small_config(12);
  const MlaWeights w = MlaWeights::random(cfg, 71);
  const int64_t B = 2, S = 180, H = cfg.heads;
  const MlaInputs in = make_inputs(cfg, B, S, 72);
  if (cfg.latent % P != 0) {
    // d_c = 64 at 3 ranks: both calls refuse, naming the latent, on every rank.
    for (const TplaOptions& opt : kTplaOptions) {
      EXPECT_TRUE(throws_naming(
          [&] { mla_shard_cache(cfg, MlaParallel::tpla, opt, in.c_kv, in.k_pe, me, P); },
          {"latent"}));
      MlaCacheShard shard;  // what a careless caller might pass: a floor-sized slice
      shard.latent_len = cfg.latent / P;
      shard.latent_begin = me * shard.latent_len;
      shard.c_kv = Tensor::zeros({B, S, shard.latent_len}, DType::f32);
      shard.k_pe = in.k_pe;
      shard.rope_len = cfg.rope;
      EXPECT_TRUE(throws_naming(
          [&] {
            mla_decode(rt, MlaParallel::tpla, cfg, w, last_rows(in.q_nope, 1),
                       last_rows(in.q_pe, 1), shard, S - 1, opt);
          },
          {"latent"}));
    }
    return;
  }
  for (const TplaOptions& opt : kTplaOptions) {
    const MlaCacheShard shard =
        mla_shard_cache(cfg, MlaParallel::tpla, opt, in.c_kv, in.k_pe, me, P);
    const int64_t ll = cfg.latent / P;
    const bool split = opt.rope == RopePlacement::split;
    const int64_t rl = split ? cfg.rope / P : cfg.rope, rb = split ? me * rl : 0;
    EXPECT_EQ(shard.latent_begin, me * ll);
    EXPECT_EQ(shard.latent_len, ll);
    EXPECT_EQ(shard.rope_begin, rb);
    EXPECT_EQ(shard.rope_len, rl);
    expect_shape(shard.c_kv, {B, S, ll}, "shard c_kv");
    expect_shape(shard.k_pe, {B, S, rl}, "shard k_pe");
    if (shard.c_kv.numel() == B * S * ll && shard.k_pe.numel() == B * S * rl) {
      bool columns_ok = true;
      for (int64_t t = 0; t < B * S && columns_ok; ++t) {
        for (int64_t e = 0; e < ll; ++e)
          columns_ok &= shard.c_kv.get(t * ll + e) == in.c_kv.get(t * cfg.latent + me * ll + e);
        for (int64_t e = 0; e < rl; ++e)
          columns_ok &= shard.k_pe.get(t * rl + e) == in.k_pe.get(t * cfg.rope + rb + e);
      }
      EXPECT_TRUE(columns_ok) << "the shard holds other columns than its slice";
    }
    for (int64_t sq : {1, 4}) {
      SCOPED_TRACE(options_str(opt) + ", rank " + std::to_string(me) + " of " + std::to_string(P) +
                   ", S_q " + std::to_string(sq));
      const Tensor qn = last_rows(in.q_nope, sq), qp = last_rows(in.q_pe, sq);
      const Tensor out = mla_decode(rt, MlaParallel::tpla, cfg, w, qn, qp, shard, S - sq, opt);
      expect_shape(out, {B, sq, H, cfg.v_head}, "out");
      const auto ref = tpla_reference(cfg, w, qn, qp, in.c_kv, in.k_pe, S - sq, P, opt);
      EXPECT_TRUE(all_close(out, ref, 1e-5, 1e-5));
      EXPECT_TRUE(same_on_all_ranks(out));
      if (P == 1) {  // one slice: exact MLA
        const Partial local = mla_decode_local(cfg, w, qn, qp, in.c_kv, in.k_pe, S - sq);
        EXPECT_TRUE(all_close(out, local.out, 1e-5, 1e-5));
      }
    }
  }
}

// ---------------------------------------------------------------- 4. transforms

// The normalised Sylvester-Hadamard matrix: H[i][j] = (-1)^popcount(i & j) / sqrt(n).
double hadamard_entry(int64_t i, int64_t j, int64_t n) {
  return (__builtin_popcountll(uint64_t(i & j)) % 2 ? -1.0 : 1.0) / std::sqrt(double(n));
}

TEST(MlaTransform, FwhtIsTheOrthogonalHadamardMatrix) {
  for (int64_t n : {1, 2, 8, 64}) {
    SCOPED_TRACE("n " + std::to_string(n));
    const Tensor x = test::random_tensor({n}, DType::f32, 81 + uint64_t(n));
    std::vector<float> y(x.ptr<float>(), x.ptr<float>() + n);
    fwht(y.data(), n);
    double norm_x = 0, norm_y = 0;
    for (int64_t i = 0; i < n; ++i) {
      double hx = 0;
      for (int64_t j = 0; j < n; ++j)
        hx += hadamard_entry(i, j, n) * x.get(j);
      EXPECT_NEAR(y[size_t(i)], hx, 1e-5) << "row " << i;
      norm_x += double(x.get(i)) * x.get(i);
      norm_y += double(y[size_t(i)]) * y[size_t(i)];
    }
    EXPECT_NEAR(std::sqrt(norm_y), std::sqrt(norm_x), 1e-5 * std::sqrt(norm_x));
    fwht(y.data(), n);  // H H = I
    for (int64_t i = 0; i < n; ++i)
      EXPECT_NEAR(y[size_t(i)], x.get(i), 1e-5) << "twice, row " << i;
  }
}

// R R^T = I within tol.
testing::AssertionResult orthonormal_rows(const MlaTransform& t, double tol) {
  const int64_t n = t.dim;
  if (t.r.size() != size_t(n * n))
    return testing::AssertionFailure() << "r has " << t.r.size() << " values for dim " << n;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double dot = 0;
      for (int64_t e = 0; e < n; ++e)
        dot += double(t.r[size_t(i * n + e)]) * t.r[size_t(j * n + e)];
      if (std::fabs(dot - (i == j ? 1.0 : 0.0)) > tol)
        return testing::AssertionFailure() << "row " << i << " . row " << j << " = " << dot;
    }
  return testing::AssertionSuccess();
}

TEST(MlaTransform, HadamardAndNone) {
  const int64_t n = 64;
  const MlaTransform none = make_latent_transform(LatentTransform::none, n);
  EXPECT_EQ(none.kind, LatentTransform::none);
  EXPECT_TRUE(none.r.empty());
  const MlaTransform t = make_latent_transform(LatentTransform::hadamard, n);
  EXPECT_EQ(t.kind, LatentTransform::hadamard);
  EXPECT_EQ(t.dim, n);
  EXPECT_TRUE(orthonormal_rows(t, 1e-5));
  ASSERT_EQ(t.r.size(), size_t(n * n));
  // R x is fwht(x): the matrix and the fast transform are the same Hadamard matrix.
  const Tensor x = test::random_tensor({n}, DType::f32, 91);
  std::vector<float> y(x.ptr<float>(), x.ptr<float>() + n);
  fwht(y.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    double rx = 0;
    for (int64_t e = 0; e < n; ++e)
      rx += double(t.r[size_t(i * n + e)]) * x.get(e);
    EXPECT_NEAR(rx, y[size_t(i)], 1e-5) << "row " << i;
  }
  EXPECT_TRUE(throws_naming([] { make_latent_transform(LatentTransform::hadamard, 48); },
                            {"latent", "48"}));
}

TEST(MlaTransform, PcaIsOrthonormalAndSortedByVariance) {
  const int64_t n = 64, N = 600;
  // Latents with one dominant direction u (std 4) and a second one u2 (std 2) over unit noise.
  const Tensor noise = test::random_tensor({N, n}, DType::f32, 101);
  const Tensor g = test::random_tensor({N, 2}, DType::f32, 102);
  const Tensor dirs = test::random_tensor({2, n}, DType::f32, 103);
  std::vector<double> u(static_cast<size_t>(n)), u2(static_cast<size_t>(n));
  double nu = 0, nu2 = 0;
  for (int64_t e = 0; e < n; ++e) {
    u[size_t(e)] = dirs.get(e);
    u2[size_t(e)] = dirs.get(n + e);
    nu += u[size_t(e)] * u[size_t(e)];
  }
  double uu2 = 0;  // u2 orthogonal to u
  for (int64_t e = 0; e < n; ++e)
    uu2 += u[size_t(e)] * u2[size_t(e)];
  for (int64_t e = 0; e < n; ++e)
    u2[size_t(e)] -= uu2 / nu * u[size_t(e)];
  for (int64_t e = 0; e < n; ++e)
    nu2 += u2[size_t(e)] * u2[size_t(e)];
  for (int64_t e = 0; e < n; ++e) {
    u[size_t(e)] /= std::sqrt(nu);
    u2[size_t(e)] /= std::sqrt(nu2);
  }
  Tensor cal = Tensor::empty({N, n}, DType::f32);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t e = 0; e < n; ++e)
      cal.set(i * n + e, float(noise.get(i * n + e) + 4.0 * g.get(2 * i) * u[size_t(e)] +
                               2.0 * g.get(2 * i + 1) * u2[size_t(e)]));

  const MlaTransform t = make_latent_transform(LatentTransform::pca, n, cal);
  EXPECT_EQ(t.kind, LatentTransform::pca);
  EXPECT_EQ(t.dim, n);
  ASSERT_TRUE(orthonormal_rows(t, 1e-4));
  // The (centred) variance of the calibration set along each row.
  std::vector<double> mean(size_t(n), 0.0), var(size_t(n), 0.0);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t e = 0; e < n; ++e)
      mean[size_t(e)] += cal.get(i * n + e) / double(N);
  for (int64_t r = 0; r < n; ++r) {
    double s2 = 0;
    for (int64_t i = 0; i < N; ++i) {
      double p = 0;
      for (int64_t e = 0; e < n; ++e)
        p += double(t.r[size_t(r * n + e)]) * (cal.get(i * n + e) - mean[size_t(e)]);
      s2 += p * p;
    }
    var[size_t(r)] = s2 / double(N);
  }
  for (int64_t r = 1; r < n; ++r) {
    EXPECT_GE(var[0], var[size_t(r)]) << "row 0 has less variance than row " << r;
    EXPECT_GE(var[size_t(r - 1)] * (1 + 1e-4), var[size_t(r)]) << "rows not by decreasing variance";
  }
  double d0 = 0, d1 = 0;
  for (int64_t e = 0; e < n; ++e) {
    d0 += t.r[size_t(e)] * u[size_t(e)];
    d1 += t.r[size_t(n + e)] * u2[size_t(e)];
  }
  EXPECT_GT(std::fabs(d0), 0.95) << "first component is not the dominant direction";
  EXPECT_GT(std::fabs(d1), 0.9) << "second component is not the second direction";

  EXPECT_TRUE(
      throws_naming([] { make_latent_transform(LatentTransform::pca, 64); }, {"calibration"}));
  EXPECT_TRUE(throws_naming(
      [] {
        make_latent_transform(LatentTransform::pca, 64, Tensor::zeros({10, 32}, DType::f32));
      },
      {"calibration"}));
}

// W' = W R^T and c' = R c: checked entry by entry, and MLA decode is unchanged.
TEST(MlaTransform, FoldingLeavesDecodeUnchanged) {
  const MlaConfig cfg = small_config();
  const MlaWeights w = MlaWeights::random(cfg, 111);
  const int64_t B = 2, S = 120, sq = 4, H = cfg.heads, dc = cfg.latent, dv = cfg.v_head;
  const MlaInputs in = make_inputs(cfg, B, S, 112);
  const Tensor qn = last_rows(in.q_nope, sq), qp = last_rows(in.q_pe, sq);
  const Partial base = mla_decode_local(cfg, w, qn, qp, in.c_kv, in.k_pe, S - sq);
  const Tensor cal = Tensor::wrap(in.c_kv.data(), {B * S, dc}, DType::f32);
  for (LatentTransform kind :
       {LatentTransform::none, LatentTransform::hadamard, LatentTransform::pca}) {
    SCOPED_TRACE(latent_transform_name(kind));
    const MlaTransform t = make_latent_transform(kind, dc, cal);
    const MlaWeights wf = fold_transform(w, t);
    const Tensor cf = apply_transform(t, in.c_kv);
    expect_shape(wf.w_uk, {H, cfg.qk_nope, dc}, "folded w_uk");
    expect_shape(wf.w_uv, {H, dv, dc}, "folded w_uv");
    expect_shape(cf, {B, S, dc}, "transformed c_kv");
    auto R = [&](int64_t i, int64_t e) {
      return kind == LatentTransform::none ? (i == e ? 1.0 : 0.0) : double(t.r[size_t(i * dc + e)]);
    };
    double err = 0;
    for (int64_t tok = 0; tok < B * S; tok += 7)
      for (int64_t i = 0; i < dc; ++i) {
        double want = 0;
        for (int64_t e = 0; e < dc; ++e)
          want += R(i, e) * in.c_kv.get(tok * dc + e);
        err = std::max(err, std::fabs(cf.get(tok * dc + i) - want));
      }
    EXPECT_LT(err, 1e-5) << "apply_transform is not R c";
    err = 0;
    for (int64_t row = 0; row < H * cfg.qk_nope; row += 5)
      for (int64_t i = 0; i < dc; ++i) {
        double want = 0;
        for (int64_t e = 0; e < dc; ++e)
          want += double(w.w_uk.get(row * dc + e)) * R(i, e);
        err = std::max(err, std::fabs(wf.w_uk.get(row * dc + i) - want));
      }
    EXPECT_LT(err, 1e-5) << "fold_transform(w_uk) is not W R^T";
    const Partial folded = mla_decode_local(cfg, wf, qn, qp, cf, in.k_pe, S - sq);
    EXPECT_TRUE(all_close(folded.out, base.out, 1e-4, 1e-4));
    EXPECT_TRUE(all_close(folded.lse, base.lse, 1e-4, 1e-4));
  }
}

// ---------------------------------------------------------------- 5. models

std::string counters_str(const ByteCounters& c) {
  std::string s;
  for (const auto& [name, e] : c.ops)
    s += name + "=" + std::to_string(e.bytes) + " (" + std::to_string(e.calls) + " calls) ";
  return s;
}

TEST(MlaModels, CacheBytesPerToken) {
  const MlaConfig cfg = small_config();
  const TplaOptions rep{RopePlacement::replicated, false}, split{RopePlacement::split, false};
  for (int G : {1, 2, 4}) {
    EXPECT_EQ(mla_cache_bytes_per_token(cfg, MlaParallel::head_split, {}, G), (64u + 16u) * 4u);
    EXPECT_EQ(mla_cache_bytes_per_token(cfg, MlaParallel::tpla, rep, G), (64u / G + 16u) * 4u);
    EXPECT_EQ(mla_cache_bytes_per_token(cfg, MlaParallel::tpla, split, G), (64u + 16u) / G * 4u);
  }
  const MlaConfig ds;  // DeepSeek-V2/V3: d_c 512, d_r 64
  const uint64_t hs = mla_cache_bytes_per_token(ds, MlaParallel::head_split, {}, 4);
  const uint64_t tp = mla_cache_bytes_per_token(ds, MlaParallel::tpla, rep, 4);
  EXPECT_EQ(hs, 576u * 4u);
  EXPECT_EQ(tp, (512u / 4u + 64u) * 4u);
  EXPECT_NEAR(double(tp) / double(hs), 1.0 / 3.0, 1e-3);
  EXPECT_EQ(mla_cache_bytes_per_token(ds, MlaParallel::tpla, split, 4), 576u);
}

TEST(MlaModels, DecodeSendBytesMatchCounted) {
  Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, {});
  const int P = rt.cp_size(), me = rt.cp_rank();
  const MlaConfig cfg = small_config(12);
  const MlaWeights w = MlaWeights::random(cfg, 121);
  const int64_t B = 2, S = 100;
  const MlaInputs in = make_inputs(cfg, B, S, 122);
  for (MlaParallel par : {MlaParallel::head_split, MlaParallel::tpla}) {
    if (par == MlaParallel::tpla && cfg.latent % P != 0) continue;  // refused (see MlaTpla)
    for (const TplaOptions& opt : kTplaOptions) {
      if (par == MlaParallel::head_split && opt.rope == RopePlacement::split) continue;
      const MlaCacheShard shard = mla_shard_cache(cfg, par, opt, in.c_kv, in.k_pe, me, P);
      for (int64_t sq : {1, 4}) {
        rt.reset_counters();
        mla_decode(rt, par, cfg, w, last_rows(in.q_nope, sq), last_rows(in.q_pe, sq), shard, S - sq,
                   opt);
        const ByteCounters counters = rt.counters();
        EXPECT_EQ(counters.data_bytes(), mla_decode_send_bytes(cfg, par, B, sq, P))
            << mla_parallel_name(par) << " " << options_str(opt) << " S_q " << sq << " rank " << me
            << " of " << P << ": " << counters_str(counters);
      }
    }
  }
}

// ---------------------------------------------------------------- 6. errors

TEST(MlaErrors, ConfigAndExpandShapes) {
  MlaConfig bad = small_config();
  bad.latent = 0;
  EXPECT_TRUE(throws_naming([&] { bad.validate(); }, {"latent"}));
  const MlaConfig cfg = small_config();
  const MlaWeights w = MlaWeights::random(cfg, 131);
  const int64_t B = 1, S = 10, H = cfg.heads;
  const MlaInputs in = make_inputs(cfg, B, S, 132);
  EXPECT_TRUE(
      throws_naming([&] { mla_expand(bad, w, in.q_nope, in.q_pe, in.c_kv, in.k_pe); }, {"latent"}));
  const Tensor qn_dim = Tensor::zeros({B, S, H, cfg.qk_nope + 1}, DType::f32);
  const Tensor qn_heads = Tensor::zeros({B, S, H + 1, cfg.qk_nope}, DType::f32);
  const Tensor qp_dim = Tensor::zeros({B, S, H, cfg.rope + 2}, DType::f32);
  const Tensor c_dim = Tensor::zeros({B, S, cfg.latent + 4}, DType::f32);
  const Tensor kp_dim = Tensor::zeros({B, S, cfg.rope - 1}, DType::f32);
  EXPECT_TRUE(
      throws_naming([&] { mla_expand(cfg, w, qn_dim, in.q_pe, in.c_kv, in.k_pe); }, {"q_nope"}));
  EXPECT_TRUE(
      throws_naming([&] { mla_expand(cfg, w, qn_heads, in.q_pe, in.c_kv, in.k_pe); }, {"q_nope"}));
  EXPECT_TRUE(
      throws_naming([&] { mla_expand(cfg, w, in.q_nope, qp_dim, in.c_kv, in.k_pe); }, {"q_pe"}));
  EXPECT_TRUE(
      throws_naming([&] { mla_expand(cfg, w, in.q_nope, in.q_pe, c_dim, in.k_pe); }, {"c_kv"}));
  EXPECT_TRUE(
      throws_naming([&] { mla_expand(cfg, w, in.q_nope, in.q_pe, in.c_kv, kp_dim); }, {"k_pe"}));
  MlaWeights w_bad = w;
  w_bad.w_uk = Tensor::zeros({H, cfg.qk_nope, cfg.latent + 1}, DType::f32);
  EXPECT_TRUE(throws_naming([&] { mla_expand(cfg, w_bad, in.q_nope, in.q_pe, in.c_kv, in.k_pe); },
                            {"w_uk"}));
  EXPECT_TRUE(throws_naming(
      [&] { mla_decode_local(cfg, w, last_rows(in.q_nope, 1), qp_dim, in.c_kv, in.k_pe, S - 1); },
      {"q_pe"}));
  // Shards are cut without communication: any rank count can be asked for.
  EXPECT_TRUE(throws_naming(
      [&] { mla_shard_cache(cfg, MlaParallel::tpla, {}, in.c_kv, in.k_pe, 0, 3); }, {"latent"}));
  MlaConfig c66 = cfg;  // latent divides by 3, rope 16 does not: only split rope refuses
  c66.latent = 66;
  const Tensor c66_kv = Tensor::zeros({B, S, 66}, DType::f32);
  EXPECT_NO_THROW(mla_shard_cache(c66, MlaParallel::tpla, {RopePlacement::replicated, false},
                                  c66_kv, in.k_pe, 1, 3));
  EXPECT_TRUE(throws_naming(
      [&] {
        mla_shard_cache(c66, MlaParallel::tpla, {RopePlacement::split, false}, c66_kv, in.k_pe, 1,
                        3);
      },
      {"rope"}));
}

// Collective refusals: every rank throws, naming the parameter (and nobody hangs).
TEST(MlaErrors, DistributedDecodeNotDivisible) {
  Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, {});
  const int P = rt.cp_size(), me = rt.cp_rank();
  if (P == 1) GTEST_SKIP() << "every configuration divides by one rank";
  const int64_t B = 1, S = 30;
  {
    const MlaConfig cfg = small_config(P == 3 ? 8 : 9);  // heads not divisible by P
    const MlaWeights w = MlaWeights::random(cfg, 141);
    const MlaInputs in = make_inputs(cfg, B, S, 142);
    MlaCacheShard shard;
    shard.c_kv = in.c_kv;
    shard.k_pe = in.k_pe;
    shard.latent_len = cfg.latent;
    shard.rope_len = cfg.rope;
    EXPECT_TRUE(throws_naming(
        [&] {
          mla_decode(rt, MlaParallel::head_split, cfg, w, last_rows(in.q_nope, 1),
                     last_rows(in.q_pe, 1), shard, S - 1);
        },
        {"heads"}))
        << "rank " << me << " of " << P;
  }
  {
    MlaConfig cfg = small_config(12);
    cfg.latent = P == 3 ? 64 : 66 + (P == 4 ? 0 : 1);  // 64 % 3, 66 % 4, 67 % 2: not divisible
    const MlaWeights w = MlaWeights::random(cfg, 143);
    const MlaInputs in = make_inputs(cfg, B, S, 144);
    EXPECT_TRUE(throws_naming(
        [&] { mla_shard_cache(cfg, MlaParallel::tpla, {}, in.c_kv, in.k_pe, me, P); }, {"latent"}));
    MlaCacheShard shard;
    shard.latent_len = cfg.latent / P;
    shard.latent_begin = me * shard.latent_len;
    shard.c_kv = Tensor::zeros({B, S, shard.latent_len}, DType::f32);
    shard.k_pe = in.k_pe;
    shard.rope_len = cfg.rope;
    EXPECT_TRUE(throws_naming(
        [&] {
          mla_decode(rt, MlaParallel::tpla, cfg, w, last_rows(in.q_nope, 1), last_rows(in.q_pe, 1),
                     shard, S - 1);
        },
        {"latent"}))
        << "rank " << me << " of " << P;
  }
  // The runtime still works after the refusals.
  const MlaConfig cfg = small_config(12);
  const MlaWeights w = MlaWeights::random(cfg, 145);
  const MlaInputs in = make_inputs(cfg, B, S, 146);
  const MlaCacheShard shard =
      mla_shard_cache(cfg, MlaParallel::head_split, {}, in.c_kv, in.k_pe, me, P);
  const Tensor out = mla_decode(rt, MlaParallel::head_split, cfg, w, last_rows(in.q_nope, 1),
                                last_rows(in.q_pe, 1), shard, S - 1);
  EXPECT_TRUE(same_on_all_ranks(out));
}

}  // namespace
}  // namespace dattn
