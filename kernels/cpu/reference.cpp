// The float64 reference attention: every score computed, two passes per row (max, then sums);
// and its backward, row by row from the same probabilities.
#include "kernels/cpu/reference.h"

#include <cmath>
#include <limits>

#include "src/base/error.h"

namespace dattn::cpu {

std::vector<double> as_doubles(const Tensor& t) {
  std::vector<double> x(size_t(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i)
    x[size_t(i)] = t.get(i);
  return x;
}

ReferenceResult attention_reference(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const AttnSpec& spec, int64_t q_pos0, int64_t k_pos0) {
  const int64_t B = q.size(0), Sq = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t Sk = k.size(1), Hkv = k.size(2), Dv = v.size(3);
  DATTN_ASSERT(Hkv > 0 && Hq % Hkv == 0 && k.size(3) == D && v.size(1) == Sk);
  const int64_t group = Hq / Hkv;
  const double scale = spec.scale();
  ReferenceResult r;
  r.out.assign(size_t(B * Sq * Hq * Dv), 0.0);
  r.lse.assign(size_t(B * Hq * Sq), -std::numeric_limits<double>::infinity());
  const std::vector<double> qd = as_doubles(q), kd = as_doubles(k), vd = as_doubles(v);
  std::vector<double> s(static_cast<size_t>(Sk));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / group;
      for (int64_t i = 0; i < Sq; ++i) {
        const double* qrow = qd.data() + ((b * Sq + i) * Hq + h) * D;
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < Sk; ++j) {
          if (!spec.mask.visible(q_pos0 + i, k_pos0 + j)) {
            s[j] = -std::numeric_limits<double>::infinity();
            continue;
          }
          const double* krow = kd.data() + ((b * Sk + j) * Hkv + hk) * D;
          double dot = 0;
          for (int64_t d = 0; d < D; ++d)
            dot += qrow[d] * krow[d];
          s[j] = dot * scale;
          if (spec.softcap > 0.f) s[j] = spec.softcap * std::tanh(s[j] / spec.softcap);
          m = std::max(m, s[j]);
        }
        // A sink: one more logit in the normaliser, with no value (a row of no key: lse = sink).
        const double sink = spec.sinks ? double((*spec.sinks)[size_t(h)])
                                       : -std::numeric_limits<double>::infinity();
        m = std::max(m, sink);
        if (m == -std::numeric_limits<double>::infinity()) continue;  // no visible key
        double sum = std::exp(sink - m);
        double* o = r.out.data() + ((b * Sq + i) * Hq + h) * Dv;
        for (int64_t j = 0; j < Sk; ++j) {
          if (s[j] == -std::numeric_limits<double>::infinity()) continue;
          double p = std::exp(s[j] - m);
          sum += p;
          const double* vrow = vd.data() + ((b * Sk + j) * Hkv + hk) * Dv;
          for (int64_t d = 0; d < Dv; ++d)
            o[d] += p * vrow[d];
        }
        for (int64_t d = 0; d < Dv; ++d)
          o[d] /= sum;
        r.lse[size_t((b * Hq + h) * Sq + i)] = m + std::log(sum);
      }
    }
  }
  return r;
}

ReferenceGrads attention_backward_reference(const Tensor& q, const Tensor& k, const Tensor& v,
                                            const Tensor& dout, const AttnSpec& spec,
                                            int64_t q_pos0, int64_t k_pos0) {
  const int64_t B = q.size(0), Sq = q.size(1), Hq = q.size(2), D = q.size(3);
  const int64_t Sk = k.size(1), Hkv = k.size(2), Dv = v.size(3);
  DATTN_ASSERT(Hkv > 0 && Hq % Hkv == 0 && k.size(3) == D && v.size(1) == Sk);
  DATTN_ASSERT(dout.size(0) == B && dout.size(1) == Sq && dout.size(2) == Hq && dout.size(3) == Dv);
  const int64_t group = Hq / Hkv;
  const double scale = spec.scale();
  const double ninf = -std::numeric_limits<double>::infinity();
  ReferenceGrads g;
  g.dq.assign(size_t(B * Sq * Hq * D), 0.0);
  g.dk.assign(size_t(B * Sk * Hkv * D), 0.0);
  g.dv.assign(size_t(B * Sk * Hkv * Dv), 0.0);
  if (spec.sinks) g.dsinks.assign(size_t(Hq), 0.0);
  const std::vector<double> qd = as_doubles(q), kd = as_doubles(k), vd = as_doubles(v),
                            gd = as_doubles(dout);
  std::vector<double> p(static_cast<size_t>(Sk)), dp(static_cast<size_t>(Sk));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / group;
      auto qv = [&](int64_t i, int64_t d) { return qd[size_t(((b * Sq + i) * Hq + h) * D + d)]; };
      auto kv = [&](int64_t j, int64_t d) { return kd[size_t(((b * Sk + j) * Hkv + hk) * D + d)]; };
      auto vv = [&](int64_t j, int64_t d) {
        return vd[size_t(((b * Sk + j) * Hkv + hk) * Dv + d)];
      };
      auto gv = [&](int64_t i, int64_t d) { return gd[size_t(((b * Sq + i) * Hq + h) * Dv + d)]; };
      for (int64_t i = 0; i < Sq; ++i) {
        // P: the softmax of the row's visible scores (p = 0 for a hidden key).
        double m = ninf;
        for (int64_t j = 0; j < Sk; ++j) {
          p[j] = ninf;
          if (!spec.mask.visible(q_pos0 + i, k_pos0 + j)) continue;
          double dot = 0;
          for (int64_t d = 0; d < D; ++d)
            dot += qv(i, d) * kv(j, d);
          p[j] = dot * scale;
          if (spec.softcap > 0.f) p[j] = spec.softcap * std::tanh(p[j] / spec.softcap);
          m = std::max(m, p[j]);
        }
        const double sink = spec.sinks ? double((*spec.sinks)[size_t(h)]) : ninf;
        m = std::max(m, sink);
        if (m == ninf) continue;  // no visible key: out = 0 whatever q, k, v are
        double sum = std::exp(sink - m);
        for (int64_t j = 0; j < Sk; ++j) {
          p[j] = p[j] == ninf ? 0.0 : std::exp(p[j] - m);
          sum += p[j];
        }
        // dP = dO V^T, delta = sum_j P dP (= dO . out), dS = P (dP - delta).
        double delta = 0;
        for (int64_t j = 0; j < Sk; ++j) {
          p[j] /= sum;
          dp[j] = 0;
          if (p[j] == 0.0) continue;
          for (int64_t d = 0; d < Dv; ++d)
            dp[j] += gv(i, d) * vv(j, d);
          delta += p[j] * dp[j];
        }
        // The sink's logit enters only the normaliser: d sink = -p_sink * delta.
        if (spec.sinks) g.dsinks[size_t(h)] -= std::exp(sink - m) / sum * delta;
        double* dq = g.dq.data() + ((b * Sq + i) * Hq + h) * D;
        for (int64_t j = 0; j < Sk; ++j) {
          if (p[j] == 0.0) continue;
          double ds = p[j] * (dp[j] - delta);
          if (spec.softcap > 0.f) {  // through cap * tanh(s / cap): 1 - tanh^2
            double dot = 0;
            for (int64_t d = 0; d < D; ++d)
              dot += qv(i, d) * kv(j, d);
            const double t = std::tanh(dot * scale / spec.softcap);
            ds *= 1.0 - t * t;
          }
          double* dk = g.dk.data() + ((b * Sk + j) * Hkv + hk) * D;
          double* dv = g.dv.data() + ((b * Sk + j) * Hkv + hk) * Dv;
          for (int64_t d = 0; d < D; ++d) {
            dq[d] += scale * ds * kv(j, d);
            dk[d] += scale * ds * qv(i, d);
          }
          for (int64_t d = 0; d < Dv; ++d)
            dv[d] += p[j] * gv(i, d);
        }
      }
    }
  }
  return g;
}

}  // namespace dattn::cpu
