// The float64 reference attention: every score computed, two passes per row (max, then sums).
#include "kernels/cpu/reference.h"

#include <cmath>
#include <limits>

#include "src/error.h"

namespace dattn::cpu {

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
  std::vector<double> s(static_cast<size_t>(Sk));
  std::vector<double> qrow(static_cast<size_t>(D));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / group;
      for (int64_t i = 0; i < Sq; ++i) {
        for (int64_t d = 0; d < D; ++d)
          qrow[d] = q.get(((b * Sq + i) * Hq + h) * D + d);
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < Sk; ++j) {
          if (!spec.mask.visible(q_pos0 + i, k_pos0 + j)) {
            s[j] = -std::numeric_limits<double>::infinity();
            continue;
          }
          double dot = 0;
          for (int64_t d = 0; d < D; ++d)
            dot += qrow[d] * k.get(((b * Sk + j) * Hkv + hk) * D + d);
          s[j] = dot * scale;
          m = std::max(m, s[j]);
        }
        if (m == -std::numeric_limits<double>::infinity()) continue;  // no visible key
        double sum = 0;
        double* o = r.out.data() + ((b * Sq + i) * Hq + h) * Dv;
        for (int64_t j = 0; j < Sk; ++j) {
          if (s[j] == -std::numeric_limits<double>::infinity()) continue;
          double p = std::exp(s[j] - m);
          sum += p;
          for (int64_t d = 0; d < Dv; ++d)
            o[d] += p * v.get(((b * Sk + j) * Hkv + hk) * Dv + d);
        }
        for (int64_t d = 0; d < Dv; ++d)
          o[d] /= sum;
        r.lse[size_t((b * Hq + h) * Sq + i)] = m + std::log(sum);
      }
    }
  }
  return r;
}

}  // namespace dattn::cpu
