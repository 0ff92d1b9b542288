// The attention spec (heads, head dims, softmax scale, mask) and the mask's rule on global
// token positions. A mask is always evaluated on global positions, so it is the same whichever
// rank holds a token.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

namespace dattn {

struct Mask {
  enum class Kind : uint8_t { none = 0, causal = 1 };
  Kind kind = Kind::none;

  static Mask none() { return {Kind::none}; }
  static Mask causal() { return {Kind::causal}; }
  bool operator==(const Mask&) const = default;
  std::string str() const { return kind == Kind::causal ? "causal" : "none"; }

  // Whether query position q sees key position k.
  bool visible(int64_t q, int64_t k) const { return kind == Kind::none || k <= q; }

  // How a block of queries [q_lo, q_hi] meets a block of keys [k_lo, k_hi] (inclusive ranges):
  // none visible (skip), all visible (no masking needed), or some (mask per element).
  enum class Cover : uint8_t { none, some, all };
  Cover cover(int64_t q_lo, int64_t q_hi, int64_t k_lo, int64_t k_hi) const {
    if (q_hi < q_lo || k_hi < k_lo) return Cover::none;  // an empty block
    if (kind == Kind::none) return Cover::all;
    if (k_lo > q_hi) return Cover::none;
    if (k_hi <= q_lo) return Cover::all;
    return Cover::some;
  }
};

struct AttnSpec {
  int64_t heads_q = 0;
  int64_t heads_kv = 0;       // heads_q must be a multiple (GQA/MQA); K/V carry heads_kv heads
  int64_t head_dim = 0;       // of Q and K
  int64_t head_dim_v = 0;     // of V and out; 0 means head_dim
  float softmax_scale = 0.f;  // 0 means 1/sqrt(head_dim)
  Mask mask = Mask::none();

  int64_t dim_v() const { return head_dim_v > 0 ? head_dim_v : head_dim; }
  float scale() const {
    return softmax_scale != 0.f ? softmax_scale : 1.0f / std::sqrt(float(head_dim));
  }
  // Throws dattn::Error naming the first bad field.
  void validate() const;
  std::string str() const;
};

}  // namespace dattn
