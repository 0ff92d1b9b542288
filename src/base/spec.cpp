// AttnSpec validation and printing.
#include "src/base/spec.h"

#include <algorithm>
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

Mask Mask::from_slices(std::vector<MaskSlice> slices) {
  std::sort(slices.begin(), slices.end(), [](const MaskSlice& a, const MaskSlice& b) {
    return a.q_begin != b.q_begin ? a.q_begin < b.q_begin : a.k_begin < b.k_begin;
  });
  Mask m;
  m.slices = std::make_shared<const std::vector<MaskSlice>>(std::move(slices));
  return m;
}

const char* MaskSlice::kind_name(Kind kind) {
  switch (kind) {
    case Kind::full:
      return "full";
    case Kind::causal:
      return "causal";
    case Kind::inv_causal:
      return "inv_causal";
    case Kind::bi_causal:
      return "bi_causal";
  }
  return "?";
}

bool Mask::operator==(const Mask& o) const {
  if (left != o.left || right != o.right || bool(documents) != bool(o.documents) ||
      bool(slices) != bool(o.slices))
    return false;
  return (!documents || *documents == *o.documents) && (!slices || *slices == *o.slices);
}

int64_t Mask::extent() const {
  int64_t e = documents ? documents->back() : 0;
  if (slices)
    for (const MaskSlice& sl : *slices)
      e = std::max({e, sl.q_end, sl.k_end});
  return e;
}

std::string Mask::str() const {
  if (is_none()) return "none";
  if (is_causal()) return "causal";
  if (slices) {  // a few slices in full, many by their count
    std::string out = detail::cat("slices(", slices->size());
    if (slices->size() <= 4)
      for (size_t i = 0; i < slices->size(); ++i) {
        const MaskSlice& sl = (*slices)[i];
        out += detail::cat(i == 0 ? ": " : ", ", "[", sl.q_begin, ",", sl.q_end, ")x[", sl.k_begin,
                           ",", sl.k_end, ") ", MaskSlice::kind_name(sl.kind));
      }
    return out + ")";
  }
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
  if (slices) {
    mix(slices->size() + 1);
    for (const MaskSlice& sl : *slices)
      for (int64_t x : {sl.q_begin, sl.q_end, sl.k_begin, sl.k_end, int64_t(sl.kind)})
        mix(uint64_t(x));
  }
  return h;
}

void Mask::validate() const {
  DATTN_CHECK_ARG(left >= -1, "window left", left, ">= 0 (or -1: unlimited)");
  DATTN_CHECK_ARG(right >= -1, "window right", right, ">= 0 (or -1: unlimited)");
  if (slices) validate_slices();
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

void Mask::validate_slices() const {
  DATTN_CHECK_ARG(left < 0 && right < 0 && !documents, "mask", str(),
                  "slices alone (a slice mask takes no window or documents: slices express them)");
  const std::vector<MaskSlice>& sl = *slices;
  auto name = [&](size_t i) {
    return detail::cat("slice (q ", sl[i].q_begin, ":", sl[i].q_end, ", k ", sl[i].k_begin, ":",
                       sl[i].k_end, ", ", MaskSlice::kind_name(sl[i].kind), ")");
  };
  for (size_t i = 0; i < sl.size(); ++i) {
    DATTN_CHECK_ARG(sl[i].q_begin >= 0 && sl[i].q_begin <= sl[i].q_end, "slice q range", name(i),
                    "0 <= q_begin <= q_end");
    DATTN_CHECK_ARG(sl[i].k_begin >= 0 && sl[i].k_begin <= sl[i].k_end, "slice k range", name(i),
                    "0 <= k_begin <= k_end");
    DATTN_CHECK_ARG(int(sl[i].kind) <= int(MaskSlice::Kind::bi_causal), "slice kind",
                    int(sl[i].kind), "full, causal, inv_causal or bi_causal");
  }
  // No two rectangles share a (query, key) pair (zero-area ones hold none). Sorted by q_begin, the
  // slices a slice can meet follow it until one starts at or after its q_end.
  for (size_t i = 0; i < sl.size(); ++i) {
    if (sl[i].q_end == sl[i].q_begin || sl[i].k_end == sl[i].k_begin) continue;
    for (size_t j = i + 1; j < sl.size() && sl[j].q_begin < sl[i].q_end; ++j) {
      const bool meet = sl[j].q_end > sl[j].q_begin && sl[j].k_end > sl[j].k_begin &&
                        sl[j].k_begin < sl[i].k_end && sl[i].k_begin < sl[j].k_end;
      DATTN_CHECK_ARG(!meet, "slices", detail::cat(name(i), " and ", name(j)),
                      "slices that do not overlap (each (query, key) pair in one slice at most)");
    }
  }
}

std::string AttnSpec::str() const {
  return detail::cat("heads_q=", heads_q, " heads_kv=", heads_kv, " head_dim=", head_dim,
                     " head_dim_v=", dim_v(), " scale=", scale(), " mask=", mask.str(),
                     softcap > 0.f ? detail::cat(" softcap=", softcap) : "", sinks ? " sinks" : "");
}

}  // namespace dattn
