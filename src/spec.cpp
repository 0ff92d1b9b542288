// AttnSpec validation and printing.
#include "src/spec.h"

#include <cmath>

#include "src/error.h"

namespace dattn {

void AttnSpec::validate() const {
  DATTN_CHECK_ARG(heads_q > 0, "heads_q", heads_q, "> 0");
  DATTN_CHECK_ARG(heads_kv > 0, "heads_kv", heads_kv, "> 0");
  DATTN_CHECK_ARG(heads_q % heads_kv == 0, "heads_q", heads_q,
                  detail::cat("a multiple of heads_kv (", heads_kv, ")"));
  DATTN_CHECK_ARG(head_dim > 0 && head_dim <= 256, "head_dim", head_dim, "1 to 256");
  DATTN_CHECK_ARG(head_dim_v >= 0 && head_dim_v <= 256, "head_dim_v", head_dim_v,
                  "0 (same as head_dim) or 1 to 256");
  DATTN_CHECK_ARG(std::isfinite(softmax_scale) && softmax_scale >= 0.f, "softmax_scale",
                  softmax_scale, "0 (meaning 1/sqrt(head_dim)) or a finite positive value");
  DATTN_CHECK_ARG(mask.kind == Mask::Kind::none || mask.kind == Mask::Kind::causal, "mask",
                  int(mask.kind), "none or causal");
}

std::string AttnSpec::str() const {
  return detail::cat("heads_q=", heads_q, " heads_kv=", heads_kv, " head_dim=", head_dim,
                     " head_dim_v=", dim_v(), " scale=", scale(), " mask=", mask.str());
}

}  // namespace dattn
