// AttnSpec validation and printing.
#include "src/base/spec.h"

#include <cmath>
#include <cstring>

#include "src/base/error.h"

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
  DATTN_CHECK_ARG(std::isfinite(softcap) && softcap >= 0.f, "softcap", softcap,
                  "0 (off) or a finite positive cap (scores become cap * tanh(s / cap))");
  mask.validate();
  if (sinks) {
    DATTN_CHECK_ARG(int64_t(sinks->size()) == heads_q, "sinks size", sinks->size(),
                    detail::cat(heads_q, " (one per query head, heads_q)"));
    for (size_t h = 0; h < sinks->size(); ++h)
      DATTN_CHECK_ARG(std::isfinite((*sinks)[h]), detail::cat("sinks[", h, "]"), (*sinks)[h],
                      "a finite value");
  }
}

uint64_t AttnSpec::sinks_hash(uint64_t h) const {
  if (!sinks) return h;
  auto mix = [&h](uint64_t x) {
    h ^= x;
    h *= 1099511628211ull;
  };
  mix(sinks->size() + 1);
  for (float x : *sinks) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    mix(bits);
  }
  return h;
}

Mask Mask::document(std::vector<int64_t> cu_seqlens, bool causal) {
  Mask m;
  m.right = causal ? 0 : -1;
  m.documents = std::make_shared<const std::vector<int64_t>>(std::move(cu_seqlens));
  return m;
}

bool Mask::operator==(const Mask& o) const {
  if (left != o.left || right != o.right || bool(documents) != bool(o.documents)) return false;
  return !documents || *documents == *o.documents;
}

std::string Mask::str() const {
  if (is_none()) return "none";
  if (is_causal()) return "causal";
  std::string band = left < 0 && right < 0    ? ""
                     : left < 0 && right == 0 ? "causal"
                                              : detail::cat("window(", left, ",", right, ")");
  if (!documents) return band;
  return detail::cat("document(", documents->size() - 1, " docs", band.empty() ? "" : ", ", band,
                     ")");
}

uint64_t Mask::hash() const {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t x) {
    h ^= x;
    h *= 1099511628211ull;
  };
  mix(uint64_t(left));
  mix(uint64_t(right));
  if (documents)
    for (int64_t e : *documents)
      mix(uint64_t(e));
  return h;
}

void Mask::validate() const {
  DATTN_CHECK_ARG(left >= -1, "window left", left, ">= 0 (or -1: unlimited)");
  DATTN_CHECK_ARG(right >= -1, "window right", right, ">= 0 (or -1: unlimited)");
  if (!documents) return;
  const auto& cu = *documents;
  DATTN_CHECK_ARG(cu.size() >= 2, "cu_seqlens size", cu.size(),
                  ">= 2 ([0, end of document 1, ..., total])");
  DATTN_CHECK_ARG(cu[0] == 0, "cu_seqlens[0]", cu[0], "0");
  // A repeated entry is a document of no tokens (a padding slot of a packed batch). Nothing
  // needs them removed: document_of(pos) is the last boundary at or below pos, which among equal
  // boundaries is the last, so a position always lands in the non-empty document that holds it,
  // and document numbers are only compared (equal, before, after), which empty documents do not
  // change. Keeping them keeps the caller's numbering in messages and str().
  for (size_t i = 1; i < cu.size(); ++i)
    DATTN_CHECK_ARG(cu[i] >= cu[i - 1], detail::cat("cu_seqlens[", i, "]"), cu[i],
                    detail::cat(">= cu_seqlens[", i - 1, "] = ", cu[i - 1],
                                " (non-decreasing; a repeated entry is an empty document)"));
}

std::string AttnSpec::str() const {
  return detail::cat("heads_q=", heads_q, " heads_kv=", heads_kv, " head_dim=", head_dim,
                     " head_dim_v=", dim_v(), " scale=", scale(), " mask=", mask.str(),
                     softcap > 0.f ? detail::cat(" softcap=", softcap) : "", sinks ? " sinks" : "");
}

}  // namespace dattn
