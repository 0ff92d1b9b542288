// The attention problem of the prefill workload's options: the mask (-m, -W, --prefix), the layout
// (-l, --stripe-block, --chunk) and the documents (--doc-lens, --doc-count) checked together, and
// the spec and layout of one sequence length from them.
#pragma once

#include <boost/program_options.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "src/base/spec.h"
#include "src/layout.h"

namespace dattn::bench {

struct Problem {
  AttnSpec spec;
  Layout layout;
};

class ProblemOptions {
 public:
  void add_options(boost::program_options::options_description& desc);
  // Checks the options for the lengths seq_begin .. seq_end (--doc-lens: one length); throws
  // UsageError. lenient (a --compare rerun): an option the run leaves unused is no error.
  void resolve(const boost::program_options::variables_map& vm, int64_t seq_begin, int64_t seq_end,
               bool lenient);
  // The problem of length S on P ranks, heads and dims from `heads`, under a layout and a mask
  // (-l and -m names; stripe_block 0: --stripe-block).
  Problem make(const AttnSpec& heads, int64_t S, int P, const std::string& layout,
               const std::string& mask, int64_t stripe_block = 0) const;
  Problem make(const AttnSpec& heads, int64_t S, int P) const {
    return make(heads, S, P, layout_, mask_);
  }
  const std::string& layout() const { return layout_; }
  const std::string& mask() const { return mask_; }
  int64_t stripe_block() const { return stripe_block_; }
  int64_t documents() const { return doc_lens_.empty() ? doc_count_ : int64_t(doc_lens_.size()); }
  std::string mask_desc(int64_t S) const;  // the mask at length S: "document(3 docs, causal)"

 private:
  // Document boundaries over S tokens (--doc-lens, or --doc-count pseudo-random lengths).
  std::vector<int64_t> cu_seqlens(int64_t S) const;
  int64_t prefix_len(int64_t S) const;  // --mask shared-prefix: --prefix, or S / 8
  std::string layout_ = "zigzag", mask_ = "causal", window_, doc_lens_str_;
  int64_t stripe_block_ = 1, window_left_ = 0, window_right_ = 0, doc_count_ = 0;
  int64_t chunk_ = 0, prefix_ = -1;  // 0, -1: not given
  std::vector<int64_t> doc_lens_;
};

}  // namespace dattn::bench
