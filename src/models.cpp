// FLOP and byte models (see models.h). The per-rank models count in closed form: a run's kernel
// tiles fall into a few classes whose first and last positions advance by one step, a mask's
// visible tiles between two classes are a floor sum, and the ring's hops come from one sweep over
// the runs, so a model costs O(runs) per pair of ranks, not O(tiles).
#include "src/models.h"

#include <algorithm>
#include <array>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels/cpu/attention_cpu.h"
#include "src/base/error.h"

namespace dattn {

namespace {

// Tile and score counts, and positions plus windows, which leave int64 near its limits.
__extension__ typedef __int128 Wide;

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
constexpr Wide kInf = Wide(kMax) * 4;  // beyond every position plus any window

// Sum over m in [0, n) of floor((a * m + b) / c), for a, b >= 0 and c > 0, by Euclid's reduction:
// O(log c) steps.
Wide floor_sum(Wide n, Wide a, Wide b, Wide c) {
  Wide sum = 0;
  while (n > 0) {
    if (a >= c) {
      sum += n * (n - 1) / 2 * (a / c);
      a %= c;
    }
    if (b >= c) {
      sum += n * (b / c);
      b %= c;
    }
    const Wide y = a * n + b;
    if (y < c) break;
    n = y / c;
    b = y % c;
    std::swap(a, c);
  }
  return sum;
}

// The first m in [from, to) with base + m * step >= target (step >= 0), or `to`.
int64_t first_reaching(int64_t from, int64_t to, Wide base, int64_t step, Wide target) {
  if (base + Wide(from) * step >= target) return from;
  if (step == 0) return to;
  const Wide m = (target - base + step - 1) / step;
  return int64_t(std::min<Wide>(m, to));
}

// Kernel tiles of a run whose positions advance by one step: tile m (m < count) spans positions
// lo + m * step .. hi + m * step and holds `rows` rows.
struct TileClass {
  int64_t lo, hi, step, count, rows;
};

// A run's tiles of `tile` rows as classes: one per residue of the tile index modulo the period
// after which a tile starts at the same offset in a block of the run (1 unless the run's blocks
// are longer than a token and do not divide the tile), and the last, partial tile on its own.
void tile_classes(const Run& run, int64_t tile, std::vector<TileClass>& out) {
  out.clear();
  const int64_t full = run.length / tile, rest = run.length % tile;
  const bool linear = run.block == 1 || run.length <= run.block || run.stride == run.block;
  const int64_t period = linear ? 1 : run.block / std::gcd(run.block, tile);
  for (int64_t c = 0; c < std::min(period, full); ++c) {
    const int64_t first = c * tile, count = (full - c + period - 1) / period;
    const int64_t step = count > 1 ? run.position(first + period * tile) - run.position(first) : 0;
    out.push_back({run.position(first), run.position(first + tile - 1), step, count, tile});
  }
  if (rest > 0) out.push_back({run.position(full * tile), run.last_position(), 0, 1, rest});
}

// Sum over m in [0, n) of how many tiles of a class have their edge (first or last position,
// `edge` + j * step for j < count) at or below x + m * dx (dx >= 0).
Wide tiles_at_or_below(int64_t n, Wide x, int64_t dx, int64_t edge, int64_t step, int64_t count) {
  if (count == 1) step = 1;
  const Wide y = x - edge;                  // tile j counts while j * step <= y + m * dx
  const Wide top = Wide(count - 1) * step;  // from there on, every tile counts
  const int64_t m0 = first_reaching(0, n, y, dx, 0), m1 = first_reaching(m0, n, y, dx, top);
  return Wide(n - m1) * count + (m1 - m0) + floor_sum(m1 - m0, dx, y + Wide(m0) * dx, step);
}

// Calls fn(m_begin, m_end, x, dx) on pieces of a query class: on tiles m_begin .. m_end - 1 the
// last key position that a tile's last query may see (window right, end of its document) is
// x + (m - m_begin) * dx; kInf without a limit.
template <class Fn>
void last_key_seen(const TileClass& q, const Mask& mask, Fn fn) {
  if (!mask.documents) {
    if (mask.right < 0) return fn(0, q.count, kInf, 0);
    return fn(0, q.count, Wide(q.hi) + mask.right, q.step);
  }
  const auto& cu = *mask.documents;
  for (int64_t m = 0; m < q.count;) {
    const Wide hi = Wide(q.hi) + Wide(m) * q.step;
    const size_t d = size_t(mask.document_of(int64_t(hi)));
    const Wide end = d + 1 < cu.size() ? Wide(cu[d + 1]) : kInf;  // past the document
    const int64_t m_end = first_reaching(m, q.count, q.hi, q.step, end);
    if (mask.right < 0) {
      fn(m, m_end, end - 1, 0);
    } else {
      const int64_t cross = first_reaching(m, m_end, Wide(q.hi) + mask.right, q.step, end - 1);
      if (cross > m) fn(m, cross, hi + mask.right, q.step);
      if (m_end > cross) fn(cross, m_end, end - 1, 0);
    }
    m = m_end;
  }
}

// As last_key_seen, for the last key position before the first one a tile's first query may see
// (window left, start of its document); -kInf without a limit.
template <class Fn>
void last_key_before(const TileClass& q, const Mask& mask, Fn fn) {
  if (!mask.documents) {
    if (mask.left < 0) return fn(0, q.count, -kInf, 0);
    return fn(0, q.count, Wide(q.lo) - mask.left - 1, q.step);
  }
  const auto& cu = *mask.documents;
  for (int64_t m = 0; m < q.count;) {
    const Wide lo = Wide(q.lo) + Wide(m) * q.step;
    const size_t d = size_t(mask.document_of(int64_t(lo)));
    const Wide start = cu[d], next = d + 1 < cu.size() ? Wide(cu[d + 1]) : kInf;
    const int64_t m_end = first_reaching(m, q.count, q.lo, q.step, next);
    if (mask.left < 0) {
      fn(m, m_end, start - 1, 0);
    } else {
      const int64_t cross = first_reaching(m, m_end, Wide(q.lo) - mask.left, q.step, start);
      if (cross > m) fn(m, cross, start - 1, 0);
      if (m_end > cross) fn(cross, m_end, lo + Wide(cross - m) * q.step - mask.left - 1, q.step);
    }
    m = m_end;
  }
}

// visible_scores under a slice mask: per query tile, each slice's keys seen by the tile
// (MaskSlice::keys_seen, an interval) meet a range of key tiles (their first and last positions
// rise with the tile index: two binary searches); the union of those ranges is what
// Mask::cover finds visible, tile by tile.
Wide slice_visible_scores(const Run& qr, const Run& kr, const Mask& mask, int64_t tq, int64_t tk) {
  const int64_t k_tiles = (kr.length + tk - 1) / tk;
  auto first_pos = [&](int64_t t) { return kr.position(t * tk); };
  auto last_pos = [&](int64_t t) { return kr.position(std::min((t + 1) * tk, kr.length) - 1); };
  auto first_tile = [&](auto pos, int64_t x) {  // the first tile t with pos(t) >= x, or k_tiles
    int64_t lo = 0, hi = k_tiles;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (pos(mid) >= x)
        hi = mid;
      else
        lo = mid + 1;
    }
    return lo;
  };
  std::vector<std::pair<int64_t, int64_t>> ranges;  // key tiles [a, b) that some slice shows
  Wide scores = 0;
  for (int64_t i0 = 0; i0 < qr.length; i0 += tq) {
    const int64_t rows = std::min(tq, qr.length - i0);
    const int64_t q_lo = qr.position(i0), q_hi = qr.position(i0 + rows - 1);
    ranges.clear();
    for (const MaskSlice& sl : *mask.slices) {
      if (sl.q_begin > q_hi) break;  // sorted by q_begin
      int64_t lo, hi;
      if (!sl.keys_seen(q_lo, q_hi, kr.global_begin, kr.last_position(), &lo, &hi)) continue;
      const int64_t a = first_tile(last_pos, lo), b = first_tile(first_pos, hi + 1);
      if (a < b) ranges.emplace_back(a, b);
    }
    std::sort(ranges.begin(), ranges.end());
    int64_t done = 0;  // key tiles before it are counted
    Wide keys = 0;
    for (auto [a, b] : ranges) {
      a = std::max(a, done);
      if (a >= b) continue;
      keys += std::min(b * tk, kr.length) - a * tk;
      done = b;
    }
    scores += keys * rows;
  }
  return scores;
}

// The (query, key) pairs a slice shows among queries [0, nq) and keys [0, nk): the keys of query
// q run from L(q) to U(q), each rising by 0 or 1 per query, so the row counts are linear on the
// two pieces either side of where U(q) reaches nk - 1 and their sums are arithmetic series.
Wide slice_pairs(const MaskSlice& sl, int64_t nq, int64_t nk) {
  if (sl.empty()) return 0;
  const int64_t a = sl.q_begin, b = std::min(sl.q_end, nq) - 1, kc = std::min(sl.k_end, nk) - 1;
  if (a > b || kc < sl.k_begin) return 0;
  // Sum over q in [x, y] of max(0, c + s (q - x)), s in {-1, 0, 1}.
  auto series = [](Wide x, Wide y, Wide c, int s) -> Wide {
    if (y < x) return 0;
    const Wide n = y - x + 1;
    auto range = [](Wide lo, Wide hi) { return hi < lo ? Wide(0) : (lo + hi) * (hi - lo + 1) / 2; };
    if (s == 0) return c > 0 ? n * c : 0;
    if (s > 0) return range(std::max<Wide>(c, 1), c + n - 1);
    return range(std::max<Wide>(c - n + 1, 1), c);
  };
  const int up = sl.upper() ? 1 : 0, low = sl.lower() ? 1 : 0;
  auto L = [&](Wide q) { return low ? q - sl.q_begin + sl.k_begin : Wide(sl.k_begin); };
  auto U = [&](Wide q) { return up ? q - sl.q_end + sl.k_end : Wide(sl.k_end - 1); };
  // Up to q1 the rows end at U(q) <= kc, after it at kc.
  Wide q1;
  if (up)
    q1 = std::min<Wide>(b, Wide(kc) + sl.q_end - sl.k_end);
  else
    q1 = sl.k_end - 1 <= kc ? Wide(b) : Wide(a) - 1;
  Wide n = 0;
  if (q1 >= a) n += series(a, q1, U(a) - L(a) + 1, up - low);
  const Wide from = std::max<Wide>(q1 + 1, a);
  n += series(from, b, Wide(kc) - L(from) + 1, -low);
  return n;
}

// The scores (query, key pairs) in the tq x tk tiles of a query run and a key run that the mask
// does not hide entirely (Mask::cover on the tiles' first and last positions): the work the CPU
// kernel does for them. A tile pair is visible when the key tile's first position is at most the
// last key the query tile sees and its last position is not before the first; the second set of
// key tiles lies inside the first, so the count is their difference.
Wide visible_scores(const Run& qr, const Run& kr, const Mask& mask, int64_t tq, int64_t tk,
                    std::vector<TileClass>& qc, std::vector<TileClass>& kc) {
  if (qr.length == 0 || kr.length == 0) return 0;
  switch (mask.cover(qr.global_begin, qr.last_position(), kr.global_begin, kr.last_position())) {
    case Mask::Cover::none:
      return 0;
    case Mask::Cover::all:
      return Wide(qr.length) * kr.length;
    case Mask::Cover::some:
      break;
  }
  if (mask.slices) return slice_visible_scores(qr, kr, mask, tq, tk);
  tile_classes(qr, tq, qc);
  tile_classes(kr, tk, kc);
  Wide scores = 0;
  for (const TileClass& q : qc) {
    Wide keys = 0;  // sum over the class's tiles of the rows of the key tiles they see
    last_key_seen(q, mask, [&](int64_t m0, int64_t m1, Wide x, int64_t dx) {
      for (const TileClass& k : kc)
        keys += k.rows * tiles_at_or_below(m1 - m0, x, dx, k.lo, k.step, k.count);
    });
    last_key_before(q, mask, [&](int64_t m0, int64_t m1, Wide x, int64_t dx) {
      for (const TileClass& k : kc)
        keys -= k.rows * tiles_at_or_below(m1 - m0, x, dx, k.hi, k.step, k.count);
    });
    scores += keys * q.rows;
  }
  return scores;
}

// For every rank o, how many ring steps its block is sent on: the largest k in 1 .. P-1 such that
// rank (o + k) % P holds a query that sees one of its keys (Layout::any_visible), or 0; so
// ring_forwards(layout, mask, o, s) is s < hops[o]. A query run meets a key run's range of
// seeing queries [a, b] when it ends at or after a and starts at or before b: one sweep over the
// key runs by b, inserting the query runs that start by b into a segment tree over ranks that
// holds each rank's latest run end, finds the last rank before o (else after o) that sees o.
std::vector<int> ring_hops(const Layout& layout, const Mask& mask) {
  const int P = layout.ranks();
  std::vector<int> hops(size_t(P), 0);
  struct Range {
    int64_t lo, hi;
    int rank;
  };
  std::vector<Range> queries, seers;  // query runs; the queries that may see each key run
  queries.reserve(size_t(P) * layout.runs(0).size());
  seers.reserve(queries.capacity());
  for (int r = 0; r < P; ++r) {
    for (const Run& run : layout.runs(r)) {
      if (run.length == 0) continue;
      const int64_t lo = run.global_begin, hi = run.last_position();
      queries.push_back({lo, hi, r});
      if (mask.slices) {  // the queries that see the run, slice by slice
        for (const MaskSlice& sl : *mask.slices) {
          int64_t a, b;
          if (sl.queries_seeing(lo, hi, &a, &b)) seers.push_back({a, b, r});
        }
        continue;
      }
      int64_t a = mask.right < 0 ? 0 : std::max<int64_t>(0, lo - mask.right);
      int64_t b = mask.left < 0 || mask.left > kMax - hi ? kMax : hi + mask.left;
      if (mask.documents) {
        const auto& cu = *mask.documents;
        a = std::max(a, cu[size_t(mask.document_of(lo))]);
        const size_t d = size_t(mask.document_of(hi));
        if (d + 1 < cu.size()) b = std::min(b, cu[d + 1] - 1);
      }
      seers.push_back({a, b, r});
    }
  }
  // Sorted only where the order matters: without a left window or documents every query run is
  // inserted before the first key run is looked at.
  auto by_lo = [](const Range& x, const Range& y) { return x.lo < y.lo; };
  auto by_hi = [](const Range& x, const Range& y) { return x.hi < y.hi; };
  if (!std::is_sorted(seers.begin(), seers.end(), by_hi))
    std::sort(seers.begin(), seers.end(), by_hi);
  if (!seers.empty() && std::max_element(queries.begin(), queries.end(), by_lo)->lo > seers[0].hi)
    std::sort(queries.begin(), queries.end(), by_lo);
  int n = 1;
  while (n < P)
    n *= 2;
  std::vector<int64_t> tree(size_t(2 * n), -1);  // node i: max of nodes 2i, 2i+1; leaves from n
  auto last_leaf = [&](int i, int64_t a) {       // under node i, whose value is >= a
    while (i < n)
      i = tree[size_t(2 * i + 1)] >= a ? 2 * i + 1 : 2 * i;
    return i - n;
  };
  // The last rank below e, or the last at or after b, whose latest run end is >= a; or -1.
  auto last_before = [&](int e, int64_t a) {
    for (int l = n, r = n + e; l < r; l /= 2, r /= 2)  // the prefix's nodes, right to left
      if (r % 2 == 1 && tree[size_t(--r)] >= a) return last_leaf(r, a);
    return -1;
  };
  auto last_from = [&](int b, int64_t a) {
    int nodes[32], k = 0;  // the suffix's nodes, left to right
    for (int l = n + b, r = 2 * n; l < r; l /= 2, r /= 2)
      if (l % 2 == 1) nodes[k++] = l++;
    while (k > 0)
      if (tree[size_t(nodes[--k])] >= a) return last_leaf(nodes[k], a);
    return -1;
  };
  size_t next = 0;
  for (const Range& s : seers) {
    for (; next < queries.size() && queries[next].lo <= s.hi; ++next)
      for (int i = n + queries[next].rank; i >= 1 && tree[size_t(i)] < queries[next].hi; i /= 2)
        tree[size_t(i)] = queries[next].hi;
    const int o = s.rank;
    int q = last_before(o, s.lo);
    if (q < 0) q = last_from(o + 1, s.lo);
    if (q >= 0) hops[size_t(o)] = std::max(hops[size_t(o)], (q - o + P) % P);
  }
  return hops;
}

// a * b and a + b for the byte models, or a dattn::Error naming what overflows 64 bits.
uint64_t mul(uint64_t a, uint64_t b, const char* what) {
  uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r))
    DATTN_THROW("invalid ", what, " = ", a, " * ", b, ": expected a byte count below 2^64");
  return r;
}
uint64_t add(uint64_t a, uint64_t b, const char* what) {
  uint64_t r = 0;
  if (__builtin_add_overflow(a, b, &r))
    DATTN_THROW("invalid ", what, " = ", a, " + ", b, ": expected a byte count below 2^64");
  return r;
}

// Bytes of one token of K and V (H_kv heads) in `size`-byte elements.
uint64_t kv_row_bytes(const AttnSpec& spec, uint64_t size) {
  DATTN_CHECK_ARG(spec.heads_kv >= 0 && spec.head_dim >= 0 && spec.dim_v() >= 0,
                  "heads_kv, head_dim, head_dim_v",
                  detail::cat(spec.heads_kv, ", ", spec.head_dim, ", ", spec.dim_v()), ">= 0");
  const char* what = "heads_kv * (head_dim + head_dim_v) * dtype size";
  return mul(mul(uint64_t(spec.heads_kv),
                 add(uint64_t(spec.head_dim), uint64_t(spec.dim_v()), what), what),
             size, what);
}

// The bytes of the blocks `rank` forwards along the ring, given every block's hops.
uint64_t ring_send_bytes(const Layout& layout, const AttnSpec& spec, int64_t batch, DType dtype,
                         int rank, const std::vector<int>& hops) {
  DATTN_CHECK_ARG(batch >= 0, "batch", batch, ">= 0");
  const int P = layout.ranks();
  const uint64_t row = kv_row_bytes(spec, dtype_size(dtype));
  const char* what = "batch * local_len * heads_kv * (head_dim + head_dim_v) * dtype size";
  uint64_t bytes = 0;
  for (int s = 0; s + 1 < P; ++s) {
    const int origin = ((rank - s) % P + P) % P;
    if (s < hops[size_t(origin)])
      bytes =
          add(bytes, mul(mul(uint64_t(batch), uint64_t(layout.local_len(origin)), what), row, what),
              "ring send bytes");
  }
  return bytes;
}

}  // namespace

double attention_flops(int64_t batch, int64_t seq_q, int64_t seq_k, const AttnSpec& spec) {
  double f = 2.0 * double(batch) * double(spec.heads_q) * double(seq_q) * double(seq_k) *
             double(spec.head_dim + spec.dim_v());
  if (spec.mask.is_none()) return f;
  if (spec.mask.is_causal()) return f / 2;  // the usual model (exact: (S + 1) / 2S)
  if (spec.mask.slices) {                   // slices do not overlap: their pairs add up
    Wide pairs = 0;
    for (const MaskSlice& sl : *spec.mask.slices)
      pairs += slice_pairs(sl, seq_q, seq_k);
    return f / (double(seq_q) * double(seq_k)) * double(pairs);
  }
  // Other masks: count the visible (query, key) pairs of positions 0.. on both sides (tiles of
  // one position), queries and keys past the last document boundary seeing nothing.
  int64_t nq = seq_q, nk = seq_k;
  if (spec.mask.documents) {
    nq = std::min(nq, spec.mask.documents->back());
    nk = std::min(nk, spec.mask.documents->back());
  }
  std::vector<TileClass> qc, kc;
  const Wide pairs =
      visible_scores(Run{0, 0, 1, std::max<int64_t>(nq, 0)}, Run{0, 0, 1, std::max<int64_t>(nk, 0)},
                     spec.mask, 1, 1, qc, kc);
  return f / (double(seq_q) * double(seq_k)) * double(pairs);
}

bool ring_forwards(const Layout& layout, const Mask& mask, int origin, int step) {
  const int P = layout.ranks();
  if (step >= P - 1) return false;  // the last step sends nothing
  // The block is at rank origin + step; it would next reach origin + step + 1, ... origin - 1.
  for (int k = step + 1; k <= P - 1; ++k)
    if (layout.any_visible(mask, (origin + k) % P, origin)) return true;
  return false;
}

uint64_t ring_send_bytes(const Layout& layout, const AttnSpec& spec, int64_t batch, DType dtype,
                         int rank) {
  return ring_send_bytes(layout, spec, batch, dtype, rank, ring_hops(layout, spec.mask));
}

uint64_t ring_backward_send_bytes(const Layout& layout, const AttnSpec& spec, int64_t batch,
                                  DType dtype, int rank) {
  const int P = layout.ranks();
  const std::vector<int> hops = ring_hops(layout, spec.mask);
  const uint64_t grad_row = kv_row_bytes(spec, sizeof(float));  // one token of dK and dV
  const char* what = "batch * local_len * heads_kv * (head_dim + head_dim_v) * 4";
  uint64_t bytes = ring_send_bytes(layout, spec, batch, dtype, rank, hops);
  for (int origin = 0; origin < P; ++origin) {
    // The block is held by origin + s for s = 0 .. last; its accumulator travels every hop the
    // block makes, then goes home from its last holder.
    const int last = hops[size_t(origin)], s = ((rank - origin) % P + P) % P;
    if (last > 0 && s <= last)
      bytes =
          add(bytes,
              mul(mul(uint64_t(batch), uint64_t(layout.local_len(origin)), what), grad_row, what),
              "ring backward send bytes");
  }
  return bytes;
}

int ulysses_kv_share(const AttnSpec& spec, int U) {
  return U > spec.heads_kv ? U / int(spec.heads_kv) : 1;
}

AttnSpec ulysses_member_spec(const AttnSpec& spec, int U) {
  AttnSpec sub = spec;
  sub.heads_q = spec.heads_q / U;
  sub.heads_kv = spec.heads_kv / (U / ulysses_kv_share(spec, U));
  sub.softmax_scale = spec.scale();
  return sub;
}

namespace {

// The bytes the Ulysses all-to-alls of `rank` send to the other members of its group: its rows of
// their heads (in_row bytes a token), and their rows of its heads back (out_row bytes a token).
uint64_t ulysses_send_bytes(const Layout& layout, int64_t batch, int U, int rank, uint64_t in_row,
                            uint64_t out_row) {
  DATTN_CHECK_ARG(batch >= 0, "batch", batch, ">= 0");
  const char* what = "batch * local_len * bytes per token of the Ulysses all-to-all";
  const int first = rank - rank % U;
  const uint64_t B = uint64_t(batch);
  uint64_t bytes = 0;
  for (int j = first; j < first + U; ++j) {
    if (j == rank) continue;
    bytes = add(bytes, mul(mul(B, uint64_t(layout.local_len(rank)), what), in_row, what), what);
    bytes = add(bytes, mul(mul(B, uint64_t(layout.local_len(j)), what), out_row, what), what);
  }
  return bytes;
}

// sum of heads[i] * dims[i] * size[i], checked: the bytes of one token over several tensors.
uint64_t token_bytes(std::initializer_list<std::array<int64_t, 3>> parts) {
  const char* what = "heads * head_dim * dtype size of a token";
  uint64_t bytes = 0;
  for (const auto& [heads, dim, size] : parts) {
    DATTN_CHECK_ARG(heads >= 0 && dim >= 0, "heads, head_dim", detail::cat(heads, ", ", dim),
                    ">= 0");
    bytes = add(bytes, mul(mul(uint64_t(heads), uint64_t(dim), what), uint64_t(size), what), what);
  }
  return bytes;
}
}  // namespace

uint64_t attention_send_bytes(Strategy strategy, const Layout& layout, const AttnSpec& spec,
                              int64_t batch, DType dtype, int ulysses, int rank) {
  const int U = strategy == Strategy::ring ? 1 : ulysses;
  if (U == 1) return ring_send_bytes(layout, spec, batch, dtype, rank);
  const AttnSpec sub = ulysses_member_spec(spec, U);
  const int64_t esz = int64_t(dtype_size(dtype)), f = sizeof(float);
  const uint64_t in_row = token_bytes({{sub.heads_q, sub.head_dim, esz},
                                       {sub.heads_kv, sub.head_dim, esz},
                                       {sub.heads_kv, sub.dim_v(), esz}});  // Q, K, V
  const uint64_t out_row = token_bytes({{sub.heads_q, sub.dim_v(), f}, {sub.heads_q, 1, f}});
  uint64_t bytes = ulysses_send_bytes(layout, batch, U, rank, in_row, out_row);
  if (layout.ranks() / U > 1)
    bytes = add(bytes, ring_send_bytes(layout.grouped(U), sub, batch, dtype, rank / U),
                "attention send bytes");
  return bytes;
}

double kernel_scores(const Run& q_run, const Run& k_run, const Mask& mask) {
  std::vector<TileClass> qc, kc;
  return double(visible_scores(q_run, k_run, mask, cpu::kTileQ, cpu::kTileK, qc, kc));
}

double attention_rank_flops(Strategy strategy, const Layout& layout, const AttnSpec& spec,
                            int64_t batch, int ulysses, int rank) {
  const int U = strategy == Strategy::ring ? 1 : ulysses;
  const Layout groups = U == 1 ? Layout() : layout.grouped(U);
  const Layout& l = U == 1 ? layout : groups;
  const AttnSpec sub = ulysses_member_spec(spec, U);
  const int me = rank / U, P = l.ranks();
  // Per computed tile: S = QK^T and O += PV over kTileQ x kTileK scores, every query head.
  const double per_score =
      2.0 * double(sub.head_dim + sub.dim_v()) * (double(sub.heads_q) * double(batch));
  std::vector<TileClass> qc, kc;
  Wide scores = 0;
  for (int origin = 0; origin < P; ++origin)
    for (const Run& qr : l.runs(me))
      for (const Run& kr : l.runs(origin))
        scores += visible_scores(qr, kr, spec.mask, cpu::kTileQ, cpu::kTileK, qc, kc);
  return per_score * double(scores);
}

uint64_t attention_backward_send_bytes(Strategy strategy, const Layout& layout,
                                       const AttnSpec& spec, int64_t batch, DType dtype,
                                       int ulysses, int rank) {
  const int U = strategy == Strategy::ring ? 1 : ulysses;
  // With sinks, their gradient's sum-allreduce over the cp ranks (heads_q fp32).
  const uint64_t sinks = spec.sinks && layout.ranks() > 1 ? uint64_t(spec.heads_q) * 4 : 0;
  if (U == 1)
    return add(ring_backward_send_bytes(layout, spec, batch, dtype, rank), sinks,
               "attention backward send bytes");
  const AttnSpec sub = ulysses_member_spec(spec, U);
  const int64_t esz = int64_t(dtype_size(dtype)), f = sizeof(float);
  const int64_t hq = sub.heads_q, hkv = sub.heads_kv, D = sub.head_dim, Dv = sub.dim_v();
  // Q, K, V in the storage dtype; dout, lse and delta in fp32; dq, dk, dv back in fp32.
  const uint64_t in_row =
      token_bytes({{hq, D, esz}, {hkv, D, esz}, {hkv, Dv, esz}, {hq, Dv, f}, {hq, 2, f}});
  const uint64_t out_row = token_bytes({{hq, D, f}, {hkv, D, f}, {hkv, Dv, f}});
  uint64_t bytes = ulysses_send_bytes(layout, batch, U, rank, in_row, out_row);
  if (layout.ranks() / U > 1)
    bytes = add(bytes, ring_backward_send_bytes(layout.grouped(U), sub, batch, dtype, rank / U),
                "attention backward send bytes");
  return add(bytes, sinks, "attention backward send bytes");
}

// ================================================================== star attention

int64_t star_anchor_len(const Layout& layout, int64_t anchor) {
  const int64_t a = anchor < 0 ? layout.block() : anchor;
  return std::min(a, layout.global_seq());  // a context shorter than the anchor is all anchor
}

int star_anchor_root(const Layout& layout) {
  for (int r = 0; r < layout.ranks(); ++r)
    if (layout.local_len(r) > 0) return r;
  return 0;
}

uint64_t star_prefill_send_bytes(const Layout& layout, const AttnSpec& spec, int64_t batch,
                                 DType dtype, int64_t anchor, int rank) {
  const int64_t a = star_anchor_len(layout, anchor);
  if (layout.ranks() == 1 || a == 0 || rank != star_anchor_root(layout)) return 0;
  return uint64_t(batch * a * spec.heads_kv * (spec.head_dim + spec.dim_v())) * dtype_size(dtype);
}

uint64_t star_decode_send_bytes(const KvCache& cache, int64_t s_q, int rank) {
  const int P = cache.ranks();
  if (P == 1) return 0;
  const AttnSpec& spec = cache.spec();
  const uint64_t rows = uint64_t(cache.batch() * s_q * spec.heads_q);
  if (rank == P - 1)  // the query broadcast
    return rows * uint64_t(spec.head_dim) * dtype_size(cache.dtype());
  return rows * uint64_t(spec.dim_v() + 1) * sizeof(float);  // this rank's partial, gathered
}

double star_prefill_flops(const Layout& layout, const AttnSpec& spec, int64_t batch, int64_t anchor,
                          int rank) {
  const int64_t a = star_anchor_len(layout, anchor), b = layout.block();
  const Mask& m = spec.mask;
  // Visible keys of the query at p among positions [lo, hi] under the band.
  auto count = [&](int64_t p, int64_t lo, int64_t hi) {
    lo = m.left < 0 ? lo : std::max(lo, p - m.left);
    hi = m.right < 0 ? hi : p + std::min(m.right, hi - p);  // not p + right: it may overflow
    return double(std::max<int64_t>(0, hi - lo + 1));
  };
  double pairs = 0;
  for (const Run& run : layout.runs(rank)) {
    for (int64_t off = 0; off < run.length; off += b) {
      const int64_t first = run.global_begin + off;
      const int64_t last = first + std::min(b, run.length - off) - 1;
      for (int64_t p = first; p <= last; ++p) {
        pairs += count(p, first, last);                       // the block itself
        if (first > 0 && a > 0) pairs += count(p, 0, a - 1);  // the anchor
      }
    }
  }
  return pairs * 2.0 * double(spec.head_dim + spec.dim_v()) * double(spec.heads_q * batch);
}

}  // namespace dattn
