// libFuzzer target: context-parallel layouts from fuzzed sizes and cu_seqlens (contiguous, zigzag,
// striped, varlen, blocks, and make() by name), then every accessor. A layout either throws
// dattn::Error or is consistent: runs fill each rank's local rows in order, every global position
// is held exactly once, global_position agrees with the runs, grouped() concatenates its
// members, any_visible() never misses a visible pair, and dispatch() takes the positions' rows.
#include <cstdint>
#include <string>
#include <vector>

#include "src/base/error.h"
#include "src/base/spec.h"
#include "src/base/tensor.h"
#include "src/layout.h"
#include "tests/fuzz/fuzz_input.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using dattn::Layout;
using dattn::Mask;
using dattn::Run;
using dattn::detail::cat;

// Whole-sequence checks (every position, dispatch) below this length; the rest run at any size.
constexpr int64_t kEnumerate = 1 << 14;

std::vector<int64_t> fuzz_cu_seqlens(dattn::fuzz::Input& in) {
  const int n = in.byte() % 18;
  std::vector<int64_t> cu;
  if (in.byte() % 4 == 0) {  // raw boundaries: mostly invalid
    for (int i = 0; i < n; ++i)
      cu.push_back(in.size());
    return cu;
  }
  cu.push_back(0);  // increasing from 0, possibly overflowing
  for (int i = 1; i < n; ++i)
    cu.push_back(cu.back() + (in.byte() % 2 ? in.byte() % 64 : in.size() % (int64_t(1) << 40)));
  return cu;
}

Mask fuzz_mask(dattn::fuzz::Input& in, const std::vector<int64_t>& cu) {
  switch (in.byte() % 4) {
    case 0:
      return Mask::none();
    case 1:
      return Mask::causal();
    case 2:
      return Mask::window(in.byte() % 32, in.byte() % 2 ? -1 : in.byte() % 8);
    default: {
      const Mask m = Mask::document(cu, in.byte() % 2);
      try {
        m.validate();
        return m;
      } catch (const dattn::Error&) {
        return Mask::causal();
      }
    }
  }
}

void check_layout(const Layout& l, int ranks, dattn::fuzz::Input& in, const Mask& mask) {
  const int64_t S = l.global_seq();
  FUZZ_CHECK(l.ranks() == ranks, l.str());
  FUZZ_CHECK(S >= 0, l.str());
  (void)l.str();
  (void)l.hash();

  // Runs: in local order, inside [0, S), positions increasing inside a run.
  int64_t total = 0, max_len = 0;
  for (int r = 0; r < ranks; ++r) {
    int64_t local = 0;
    for (const Run& run : l.runs(r)) {
      FUZZ_CHECK(run.local_begin == local, l.str(), " rank ", r);
      FUZZ_CHECK(run.length >= 0, l.str(), " rank ", r);
      FUZZ_CHECK(run.block >= 1 && run.stride >= run.block, l.str(), " rank ", r);
      if (run.length > 0) {
        FUZZ_CHECK(run.global_begin >= 0 && run.last_position() < S, l.str(), " rank ", r,
                   " run at ", run.global_begin, " last ", run.last_position());
        FUZZ_CHECK(l.global_position(r, local) == run.global_begin, l.str(), " rank ", r);
        FUZZ_CHECK(l.global_position(r, local + run.length - 1) == run.last_position(), l.str());
      }
      local += run.length;
      FUZZ_CHECK(local <= S, l.str(), " rank ", r, " holds more than the sequence");
    }
    FUZZ_CHECK(l.local_len(r) == local, l.str(), " rank ", r);
    total += local;
    max_len = std::max(max_len, local);
    FUZZ_CHECK(total <= S, l.str(), " ranks hold more tokens than the sequence");
  }
  FUZZ_CHECK(total == S, l.str(), " ranks hold ", total, " tokens");
  FUZZ_CHECK(l.max_local_len() == max_len, l.str());

  // Out-of-range arguments are errors.
  for (int bad : {-1, ranks}) {
    try {
      (void)l.runs(bad);
      FUZZ_CHECK(false, l.str(), " runs(", bad, ") did not throw");
    } catch (const dattn::Error& e) {
      dattn::fuzz::expect_argument_error(e);
    }
  }
  const int r0 = int(in.range(0, ranks - 1));
  for (int64_t bad : {int64_t(-1), l.local_len(r0)}) {
    try {
      (void)l.global_position(r0, bad);
      FUZZ_CHECK(false, l.str(), " global_position(", r0, ", ", bad, ") did not throw");
    } catch (const dattn::Error& e) {
      dattn::fuzz::expect_argument_error(e);
    }
  }

  // Grouped: a divisor of the ranks, or an error.
  const int group = int(in.range(0, ranks + 1));
  try {
    const Layout g = l.grouped(group);
    FUZZ_CHECK(group >= 1 && ranks % group == 0 && g.ranks() * group == ranks, l.str());
    // Group gi's runs are its members' runs, one member after the other.
    for (int gi = 0; gi < g.ranks(); ++gi) {
      const std::vector<Run>& runs = g.runs(gi);
      size_t next = 0;
      int64_t offset = 0;
      for (int m = 0; m < group; ++m) {
        const int r = gi * group + m;
        for (const Run& run : l.runs(r)) {
          FUZZ_CHECK(next < runs.size(), l.str(), " group ", gi, " lacks runs of rank ", r);
          const Run& got = runs[next++];
          FUZZ_CHECK(got.local_begin == offset + run.local_begin &&
                         got.global_begin == run.global_begin && got.stride == run.stride &&
                         got.length == run.length && got.block == run.block,
                     l.str(), " group ", gi, " run of rank ", r);
        }
        offset += l.local_len(r);
      }
      FUZZ_CHECK(next == runs.size() && g.local_len(gi) == offset, l.str(), " group ", gi);
    }
  } catch (const dattn::Error& e) {
    dattn::fuzz::expect_argument_error(e);
    FUZZ_CHECK(group < 1 || ranks % group != 0, l.str(), " grouped(", group, ") threw");
  }

  if (S > kEnumerate) return;
  // Every position exactly once.
  std::vector<int> owner(size_t(S), -1);
  for (int r = 0; r < ranks; ++r)
    for (int64_t i = 0; i < l.local_len(r); ++i) {
      const int64_t p = l.global_position(r, i);
      FUZZ_CHECK(p >= 0 && p < S, l.str(), " rank ", r, " row ", i, " at ", p);
      FUZZ_CHECK(owner[size_t(p)] == -1, l.str(), " position ", p, " on ranks ", owner[size_t(p)],
                 " and ", r);
      owner[size_t(p)] = r;
    }

  // any_visible is conservative: never false when a pair is visible (small cases only).
  if (S <= 256 && ranks <= 8) {
    for (int qr = 0; qr < ranks; ++qr)
      for (int kr = 0; kr < ranks; ++kr) {
        bool visible = false;
        for (int64_t i = 0; i < l.local_len(qr) && !visible; ++i)
          for (int64_t j = 0; j < l.local_len(kr) && !visible; ++j)
            visible = mask.visible(l.global_position(qr, i), l.global_position(kr, j));
        FUZZ_CHECK(!visible || l.any_visible(mask, qr, kr), l.str(), " mask ", mask.str(), " q", qr,
                   " k", kr);
      }
  }

  // dispatch: each rank's rows are the global rows at its positions.
  if (ranks <= 64) {
    dattn::Tensor global = dattn::Tensor::empty({1, S}, dattn::DType::f32);
    for (int64_t p = 0; p < S; ++p)
      global.ptr<float>()[p] = float(p);
    const int r = int(in.range(0, ranks - 1));
    const dattn::Tensor shard = l.dispatch(global, r);
    FUZZ_CHECK(shard.size(1) == l.local_len(r), l.str());
    for (int64_t i = 0; i < l.local_len(r); ++i)
      FUZZ_CHECK(shard.ptr<float>()[i] == float(l.global_position(r, i)), l.str(), " rank ", r);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dattn::fuzz::Input in(data, size);
  const uint8_t kind = in.byte() % 6;
  // Ranks: mostly few, sometimes none or negative (errors), at most 4096 (each rank costs a run
  // list and its checks: more ranks only slow the search down).
  const uint8_t rc = in.byte();
  const int ranks = rc % 4 == 0 ? int(in.range(-2, 4096)) : 1 + rc % 9;
  const int64_t S = in.size();
  const int64_t block = in.size();
  const std::vector<int64_t> cu = fuzz_cu_seqlens(in);
  const std::string name = kind == 5 ? in.text(12) : std::string();
  const Mask mask = fuzz_mask(in, cu);
  if (kind == 3 && ranks > 0 && int64_t(ranks) * int64_t(cu.size()) > (1 << 18)) return 0;
  Layout l;
  try {
    switch (kind) {
      case 0:
        l = Layout::contiguous(S, ranks);
        break;
      case 1:
        l = Layout::zigzag(S, ranks);
        break;
      case 2:
        l = Layout::striped(S, ranks, block);
        break;
      case 3:
        l = Layout::varlen(cu, ranks);
        break;
      case 4:
        l = Layout::blocks(S, ranks, block);
        break;
      default:
        l = Layout::make(name, S, ranks);
    }
  } catch (const dattn::Error& e) {
    dattn::fuzz::expect_argument_error(e);
    return 0;
  }
  FUZZ_CHECK(ranks >= 1, "a layout for ", ranks, " ranks");
  check_layout(l, ranks, in, mask);
  return 0;
}
