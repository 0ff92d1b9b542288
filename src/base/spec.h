// The attention spec (heads, head dims, softmax scale, mask) and the mask's rule on global
// token positions. A mask is always evaluated on global positions, so it is the same whichever
// rank holds a token.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace dattn {

// One rectangle of a slice mask (MagiAttention's AttnSlice): the queries at global positions
// [q_begin, q_end) against the keys [k_begin, k_end). Inside it, query q sees key k when
//   full:        always
//   causal:      k - k_end <= q - q_end      (bottom-right aligned: the last query sees all keys)
//   inv_causal:  k - k_begin >= q - q_begin  (top-left aligned: the first query sees all keys)
//   bi_causal:   both (a band k_len - q_len + 1 keys wide; nothing when k_len < q_len)
// Every rule is an interval of keys per query whose ends never move back as q grows, so the keys
// any query range sees, and the queries any key range is seen by, are intervals too (below).
struct MaskSlice {
  enum class Kind : uint8_t { full = 0, causal = 1, inv_causal = 2, bi_causal = 3 };
  int64_t q_begin = 0, q_end = 0, k_begin = 0, k_end = 0;
  Kind kind = Kind::full;

  bool upper() const { return kind == Kind::causal || kind == Kind::bi_causal; }
  bool lower() const { return kind == Kind::inv_causal || kind == Kind::bi_causal; }
  // Whether no pair is visible (empty ranges, or a bi_causal slice with fewer keys than queries).
  bool empty() const {
    return q_end <= q_begin || k_end <= k_begin ||
           (kind == Kind::bi_causal && k_end - k_begin < q_end - q_begin);
  }
  bool visible(int64_t q, int64_t k) const {
    return q >= q_begin && q < q_end && k >= k_begin && k < k_end &&
           (!upper() || k - k_end <= q - q_end) && (!lower() || k - k_begin >= q - q_begin);
  }
  // The keys [*lo, *hi] (inclusive) that some query in [q_lo, q_hi] sees, clipped to [k_lo,
  // k_hi]; false when there is none. The first query that sees a key is the first with
  // q - q_end >= k_begin - k_end (upper), the last the last with q - q_begin <= k_end - 1 -
  // k_begin (lower); between them the keys seen run from the first query's lowest to the last
  // query's highest.
  bool keys_seen(int64_t q_lo, int64_t q_hi, int64_t k_lo, int64_t k_hi, int64_t* lo,
                 int64_t* hi) const {
    if (empty()) return false;
    // Sums are written so that none passes INT64_MAX: a - q_begin < k_end - k_begin below.
    const int64_t k_len = k_end - k_begin;
    int64_t a = std::max(q_lo, q_begin), b = std::min(q_hi, q_end - 1);
    if (upper()) a = std::max(a, q_end - k_len);
    if (lower() && b - q_begin >= k_len) b = q_begin + (k_len - 1);
    if (a > b) return false;
    *lo = std::max(k_lo, lower() ? k_begin + (a - q_begin) : k_begin);
    *hi = std::min(k_hi, upper() ? k_end + (b - q_end) : k_end - 1);
    return *lo <= *hi;
  }
  // The queries [*lo, *hi] that see some key in [k_lo, k_hi]; false when there is none.
  bool queries_seeing(int64_t k_lo, int64_t k_hi, int64_t* lo, int64_t* hi) const {
    if (empty()) return false;
    const int64_t c = std::max(k_lo, k_begin), d = std::min(k_hi, k_end - 1);
    if (c > d) return false;
    *lo = upper() ? std::max(q_begin, q_end + (c - k_end)) : q_begin;
    *hi = lower() && d - k_begin < q_end - 1 - q_begin ? q_begin + (d - k_begin) : q_end - 1;
    return *lo <= *hi;
  }
  // Whether every query in [q_lo, q_hi] sees every key in [k_lo, k_hi] (a non-empty box).
  bool covers(int64_t q_lo, int64_t q_hi, int64_t k_lo, int64_t k_hi) const {
    return q_lo >= q_begin && q_hi < q_end && k_lo >= k_begin && k_hi < k_end &&
           (!upper() || k_hi - k_end <= q_lo - q_end) &&
           (!lower() || k_lo - k_begin >= q_hi - q_begin);
  }
  static const char* kind_name(Kind kind);
  bool operator==(const MaskSlice& o) const = default;
};

// Which keys a query sees, on global positions. A key k is visible to a query q when it lies in
// the band [q - left, q + right] (-1: no limit on that side) and, with documents, in q's document.
//   none: left = right = -1          causal: right = 0
//   sliding window w: left = w, right = 0 (or a right window too)
//   documents (varlen, packed sequences): boundaries cu_seqlens = [0, e1, e2, ..., S],
//   non-decreasing (a repeated entry is an empty document), with or without causal inside each
//   document.
struct Mask {
  int64_t left = -1;
  int64_t right = -1;
  // cu_seqlens, shared (masks are copied into every kernel call); null: one document.
  std::shared_ptr<const std::vector<int64_t>> documents;
  // The slices, sorted by (q_begin, k_begin), shared like documents; null: no slice mask.
  std::shared_ptr<const std::vector<MaskSlice>> slices;

  static Mask none() { return {}; }
  static Mask causal() { return {-1, 0, nullptr, nullptr}; }
  // Keys from q - left to q + right (right = 0: causal sliding window). Sizes are validated by
  // AttnSpec::validate (a negative window is an error).
  static Mask window(int64_t left, int64_t right = 0) { return {left, right, nullptr, nullptr}; }
  // Documents packed in one sequence: a token sees only its own document (causally or not).
  static Mask document(std::vector<int64_t> cu_seqlens, bool causal);
  // A slice mask: the slices in any order (validate() checks them: in range, not overlapping).
  static Mask from_slices(std::vector<MaskSlice> slices);

  bool is_none() const { return left < 0 && right < 0 && !documents && !slices; }
  bool is_causal() const { return left < 0 && right == 0 && !documents && !slices; }
  bool operator==(const Mask& o) const;
  // "none", "causal", "window(128,0)", "document(3 docs, causal)", "slices(1: [0,8)x[0,8) causal)"
  // (up to 4 slices in full), "slices(65)"
  std::string str() const;
  uint64_t hash() const;
  // Throws dattn::Error naming the bad field (negative sizes, cu_seqlens not starting at 0 or
  // decreasing, a slice out of range or overlapping another, slices with a band or documents).
  void validate() const;
  // The largest position the mask names plus one (cu_seqlens back, the slices' largest end), for
  // the entry points' check against the layout's global_seq; 0 for a band.
  int64_t extent() const;

  // The document holding position pos (0 without documents): the last d with cu_seqlens[d] <=
  // pos, so of equal boundaries (empty documents) the last one, the document pos is in.
  int64_t document_of(int64_t pos) const {
    if (!documents) return 0;
    const auto& cu = *documents;
    return int64_t(std::upper_bound(cu.begin(), cu.end(), pos) - cu.begin()) - 1;
  }
  // Whether query position q sees key position k (given their documents). Positions are >= 0,
  // so their differences cannot overflow (q + right could, for a window wider than the int64
  // range left above q).
  bool in_band(int64_t q, int64_t k) const {
    return (left < 0 || q - k <= left) && (right < 0 || k - q <= right);
  }
  bool visible(int64_t q, int64_t k) const {
    if (slices) {
      for (const MaskSlice& sl : *slices) {
        if (sl.q_begin > q) break;  // sorted by q_begin
        if (sl.visible(q, k)) return true;
      }
      return false;
    }
    return in_band(q, k) && document_of(q) == document_of(k);
  }

  // How a block of queries with positions in [q_lo, q_hi] meets a block of keys with positions
  // in [k_lo, k_hi] (inclusive): none visible (skip), all visible (no masking), or some (mask
  // per element). Conservative: "some" may turn out to hide everything.
  enum class Cover : uint8_t { none, some, all };
  Cover cover(int64_t q_lo, int64_t q_hi, int64_t k_lo, int64_t k_hi) const {
    if (q_hi < q_lo || k_hi < k_lo) return Cover::none;  // an empty block
    if (slices) return slices_cover(q_lo, q_hi, k_lo, k_hi);
    if (right >= 0 && k_lo - q_hi > right) return Cover::none;  // differences: see in_band
    if (left >= 0 && q_lo - k_hi > left) return Cover::none;
    bool all = (right < 0 || k_hi - q_lo <= right) && (left < 0 || q_hi - k_lo <= left);
    if (documents) {
      const int64_t dq_lo = document_of(q_lo), dq_hi = document_of(q_hi);
      const int64_t dk_lo = document_of(k_lo), dk_hi = document_of(k_hi);
      if (dk_hi < dq_lo || dq_hi < dk_lo) return Cover::none;
      all = all && dq_lo == dq_hi && dk_lo == dk_hi && dq_lo == dk_lo;
    }
    return all ? Cover::all : Cover::some;
  }

 private:
  void validate_slices() const;
  // cover() of a slice mask: none when no slice shows a key of the block to a query of it
  // (exact, MaskSlice::keys_seen), all when one slice shows every pair (several slices that
  // together show them all give some: conservative).
  Cover slices_cover(int64_t q_lo, int64_t q_hi, int64_t k_lo, int64_t k_hi) const {
    bool any = false;
    for (const MaskSlice& sl : *slices) {
      if (sl.q_begin > q_hi) break;  // sorted by q_begin
      int64_t lo, hi;
      if (!sl.keys_seen(q_lo, q_hi, k_lo, k_hi, &lo, &hi)) continue;
      if (sl.covers(q_lo, q_hi, k_lo, k_hi)) return Cover::all;
      any = true;
    }
    return any ? Cover::some : Cover::none;
  }
};

struct AttnSpec {
  int64_t heads_q = 0;
  int64_t heads_kv = 0;       // heads_q must be a multiple (GQA/MQA); K/V carry heads_kv heads
  int64_t head_dim = 0;       // of Q and K
  int64_t head_dim_v = 0;     // of V and out; 0 means head_dim
  float softmax_scale = 0.f;  // 0 means 1/sqrt(head_dim)
  Mask mask = Mask::none();
  // Logit softcap (Gemma 2): > 0: each scaled score s becomes softcap * tanh(s / softcap) before
  // the mask and the softmax (the kernels apply it; the backward multiplies dS by 1 - tanh^2);
  // 0: off. Finite.
  float softcap = 0.f;
  // Attention sinks (gpt-oss): one learned logit per query head, heads_q finite values, that joins
  // every row's softmax as an extra key with no value: a row's normaliser gains exp(sink), so
  // lse = log(sum_j exp(s_j) + exp(sink)) and out = sum_j exp(s_j - lse) v_j (a row that sees no
  // key: out = 0, lse = sink). Null: none. The entry points apply them once, to the merged
  // result (src/dispatch.h, add_sinks), never inside a kernel or a schedule's partials; shared,
  // like documents.
  std::shared_ptr<const std::vector<float>> sinks = nullptr;

  int64_t dim_v() const { return head_dim_v > 0 ? head_dim_v : head_dim; }
  float scale() const {
    return softmax_scale != 0.f ? softmax_scale : 1.0f / std::sqrt(float(head_dim));
  }
  // Throws dattn::Error naming the first bad field.
  void validate() const;
  std::string str() const;
  // The spec without its sinks: what the schedules and kernels get (they compute plain partials).
  AttnSpec without_sinks() const {
    AttnSpec s = *this;
    s.sinks.reset();
    return s;
  }
  // The sinks' values mixed into a hash (seed unchanged without sinks), so that ranks agree on
  // them.
  uint64_t sinks_hash(uint64_t seed) const;
};

// sinks as a spec's shared values.
inline std::shared_ptr<const std::vector<float>> make_sinks(std::vector<float> sinks) {
  return std::make_shared<const std::vector<float>>(std::move(sinks));
}

}  // namespace dattn
