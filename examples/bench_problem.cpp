// The prefill workload's problem options (see bench_problem.h).
#include "examples/bench_problem.h"

#include <algorithm>
#include <limits>

#include "examples/bench_inputs.h"
#include "examples/engine.h"
#include "launch/program.h"
#include "src/base/error.h"

namespace dattn::bench {

using detail::cat;
namespace po = boost::program_options;

void ProblemOptions::add_options(po::options_description& desc) {
  // clang-format off
  desc.add_options()
      ("layout,l", po::value(&layout_)->default_value(layout_),
       "contiguous, zigzag, striped, varlen (zigzag per document; needs documents) or balanced "
       "(chunks dealt to ranks by their work under the mask)")
      ("chunk", po::value(&chunk_)->value_name("N"),
       "tokens per chunk of --layout balanced (default: a multiple of 256 near S / 16P)")
      ("stripe-block", po::value(&stripe_block_)->default_value(stripe_block_),
       "tokens per block of --layout striped")
      ("mask,m", po::value(&mask_)->default_value(mask_),
       "none, causal, window (needs -W), document (causal in each document), document-full "
       "(all of its document) or shared-prefix (a causal prefix, then documents that see all of "
       "it and themselves causally: a slice mask); documents: --doc-lens or --doc-count")
      ("prefix", po::value(&prefix_)->value_name("N"),
       "tokens of the shared prefix of --mask shared-prefix (default S / 8); the documents "
       "cut the rest")
      ("window,W", po::value(&window_)->value_name("L[,R]"),
       "mask window: keys from q-L to q+R (R default 0)")
      ("doc-lens", po::value(&doc_lens_str_)->value_name("LIST"),
       "comma-separated document lengths (0: an empty document) summing to the sequence length "
       "(one length only)")
      ("doc-count", po::value(&doc_count_)->value_name("N"),
       "cut each sequence length into N documents of pseudo-random lengths (fixed seed)");
  // clang-format on
}

void ProblemOptions::resolve(const po::variables_map& vm, int64_t seq_begin, int64_t seq_end,
                             bool lenient) {
  const auto only_with = [&](bool ok, const char* option, const std::string& value,
                             const char* expected) {
    require_option(ok || lenient, option, value, expected);
  };
  // Documents: --doc-lens or --doc-count, for the document masks and layout varlen.
  const bool lens_given = vm.count("doc-lens") > 0, count_given = vm.count("doc-count") > 0;
  require_option(!(lens_given && count_given), "--doc-count", doc_count_,
                 "not given together with --doc-lens");
  if (lens_given) {
    // A length 0 is an empty document (a padding slot of a packed batch), as the library takes
    // it: a repeated cu_seqlens entry.
    const auto lens = parse_int_list(doc_lens_str_);
    require_option(
        lens && std::all_of(lens->begin(), lens->end(), [](int64_t n) { return n >= 0; }),
        "--doc-lens", doc_lens_str_, "comma-separated lengths >= 0 (0: an empty document)");
    int64_t sum = 0;  // saturated: lengths past the int64 range only have to read as too many
    for (int64_t n : *lens)
      sum = n > std::numeric_limits<int64_t>::max() - sum ? std::numeric_limits<int64_t>::max()
                                                          : sum + n;
    require_option(seq_end == seq_begin, "--doc-lens", doc_lens_str_,
                   "one sequence length (--seq-end equal to --seq-begin); or use --doc-count");
    const int64_t prefix = mask_ == "shared-prefix" ? prefix_len(seq_begin) : 0;
    require_option(sum == seq_begin - prefix, "--doc-lens", doc_lens_str_,
                   cat("lengths summing to --seq-begin (", seq_begin, ")",
                       prefix ? cat(" less the prefix (", prefix, ")") : "", ", not ", sum));
    doc_lens_ = *lens;
  }
  if (count_given) {
    const int64_t room = seq_begin - (mask_ == "shared-prefix" ? prefix_len(seq_begin) : 0);
    require_option(doc_count_ >= 1 && doc_count_ <= room, "--doc-count", doc_count_,
                   cat(">= 1 and <= the tokens it cuts (", room, ")"));
  }
  const bool docs = lens_given || count_given;

  require_one_of("--layout", layout_, {"contiguous", "zigzag", "striped", "varlen", "balanced"});
  only_with(chunk_ == 0 || layout_ == "balanced", "--chunk", std::to_string(chunk_),
            "given only with --layout balanced");
  require_option(vm.count("chunk") == 0 || chunk_ >= 1, "--chunk", chunk_, ">= 1");
  require_option(stripe_block_ >= 1, "--stripe-block", stripe_block_, ">= 1");
  only_with(vm["stripe-block"].defaulted() || layout_ == "striped", "--stripe-block",
            std::to_string(stripe_block_), "given only with --layout striped");
  require_option(layout_ != "varlen" || docs, "--layout", layout_,
                 "--doc-lens or --doc-count with varlen (its document boundaries)");
  require_one_of("--mask", mask_,
                 {"none", "causal", "window", "document", "document-full", "shared-prefix"});
  only_with(prefix_ < 0 || mask_ == "shared-prefix", "--prefix", std::to_string(prefix_),
            "given only with --mask shared-prefix");
  if (mask_ == "shared-prefix")
    require_option(prefix_ < 0 || prefix_ < seq_begin, "--prefix", prefix_,
                   cat(">= 0 and below --seq-begin (", seq_begin, ")"));
  if (mask_ == "window") {
    require_option(vm.count("window") > 0, "--mask", mask_, "-W/--window L[,R] with window");
    const auto lr = parse_int_list(window_);
    require_option(lr && (lr->size() == 1 || lr->size() == 2) &&
                       std::all_of(lr->begin(), lr->end(), [](int64_t n) { return n >= 0; }),
                   "--window", window_, "L or L,R with sizes >= 0");
    window_left_ = (*lr)[0];
    window_right_ = lr->size() == 2 ? (*lr)[1] : 0;
  } else {
    only_with(vm.count("window") == 0, "--window", window_, "given only with --mask window");
  }
  const bool doc_mask = mask_.rfind("document", 0) == 0 || mask_ == "shared-prefix";
  require_option(!doc_mask || docs, "--mask", mask_, "--doc-lens or --doc-count with it");
  only_with(!docs || doc_mask || layout_ == "varlen", lens_given ? "--doc-lens" : "--doc-count",
            lens_given ? doc_lens_str_ : std::to_string(doc_count_),
            "given only with a document mask or --layout varlen");
}

int64_t ProblemOptions::prefix_len(int64_t S) const {
  return prefix_ >= 0 ? std::min(prefix_, S) : S / 8;
}

std::vector<int64_t> ProblemOptions::cu_seqlens(int64_t S) const {
  std::vector<int64_t> cu = {0};
  for (int64_t n : doc_lens_)
    cu.push_back(cu.back() + n);
  if (!doc_lens_.empty()) return cu;
  const int64_t N = doc_count_;
  std::vector<double> prefix(size_t(N) + 1, 0.0);
  for (int64_t d = 0; d < N; ++d)
    prefix[size_t(d) + 1] =
        prefix[size_t(d)] + double((mix64(0x5eedd0c5ull ^ uint64_t(d)) >> 11) + 1) * 0x1p-53;
  for (int64_t d = 1; d < N; ++d)
    cu.push_back(d + int64_t(double(S - N) * prefix[size_t(d)] / prefix[size_t(N)]));
  cu.push_back(S);
  return cu;
}

Problem ProblemOptions::make(const AttnSpec& heads, int64_t S, int P, const std::string& layout,
                             const std::string& mask, int64_t stripe_block) const {
  Problem p{heads, Layout()};
  const bool shared = mask == "shared-prefix";
  const int64_t prefix = shared ? prefix_len(S) : 0;
  std::vector<int64_t> cu = documents() == 0 ? std::vector<int64_t>{} : cu_seqlens(S - prefix);
  if (shared) {
    // The prefix sees itself causally; every document after it sees it whole, and itself
    // causally.
    std::vector<MaskSlice> slices = {{0, prefix, 0, prefix, MaskSlice::Kind::causal}};
    for (size_t d = 0; d + 1 < cu.size(); ++d) {
      const int64_t a = prefix + cu[d], b = prefix + cu[d + 1];
      slices.push_back({a, b, 0, prefix, MaskSlice::Kind::full});
      slices.push_back({a, b, a, b, MaskSlice::Kind::causal});
    }
    p.spec.mask = Mask::from_slices(std::move(slices));
    cu.insert(cu.begin(), 0);  // the prefix is the first document of --layout varlen
    for (size_t d = 1; d < cu.size(); ++d)
      cu[d] += prefix;
  } else {
    p.spec.mask = mask == "none"     ? Mask::none()
                  : mask == "causal" ? Mask::causal()
                  : mask == "window" ? Mask::window(window_left_, window_right_)
                                     : Mask::document(cu, mask == "document");
  }
  p.spec.validate();
  // Chunks for balanced: a multiple of 256 (the CPU kernel's query tile) near S / 16P.
  const int64_t chunk =
      chunk_ > 0 ? chunk_ : std::max<int64_t>(256, (S / (16 * P) + 128) / 256 * 256);
  p.layout = layout == "striped"
                 ? Layout::striped(S, P, stripe_block ? stripe_block : stripe_block_)
             : layout == "varlen"   ? Layout::varlen(cu, P)
             : layout == "balanced" ? Layout::balanced(p.spec.mask, S, P, chunk)
                                    : Layout::make(layout, S, P);
  DATTN_ASSERT(p.layout.global_seq() == S && p.layout.ranks() == P);
  return p;
}

std::string ProblemOptions::mask_desc(int64_t S) const {
  AttnSpec heads;
  heads.heads_q = heads.heads_kv = heads.head_dim = 1;
  return make(heads, S, 1, "contiguous", mask_).spec.mask.str();
}

}  // namespace dattn::bench
