// What the fuzzers of tests/fuzz found, one test each, in the normal suite (the inputs themselves
// replay from corpus/<target>/regression-* as fuzz_replay_<target>). Positions, sizes and windows
// near the int64 limit, and option text that Boost.Program_options cannot report. Run as one
// MPI process: the prefill workload's parser (the engine's, as fuzz_cli calls it) needs MPI.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "examples/workloads.h"
#include "launch/program.h"
#include "src/base/spec.h"
#include "src/layout.h"
#include "src/models.h"
#include "src/star.h"

namespace {

using dattn::AttnSpec;
using dattn::Mask;
using dattn::UsageError;

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

// ---------------------------------------------------------------- masks (fuzz_spec)

// visible() and cover() computed q + right (and q - left): a window whose right side reaches
// past INT64_MAX - q overflowed (UBSan), e.g. -W 0,9223372036854775807 on any query after 0.
TEST(FuzzRegressions, WindowReachingPastTheInt64Limit) {
  const Mask found = Mask::window(2147483647, 2147483448);  // fuzz_spec's input
  EXPECT_TRUE(found.visible(kMax - 32, kMax - 1));
  EXPECT_FALSE(found.visible(kMax - 32, 0));
  const Mask wide = Mask::window(0, kMax);  // keys from q on, all of them
  EXPECT_TRUE(wide.visible(5, kMax - 1));
  EXPECT_TRUE(wide.visible(kMax, kMax));
  EXPECT_FALSE(wide.visible(5, 4));
  EXPECT_EQ(wide.cover(kMax - 40, kMax - 33, kMax - 8, kMax), Mask::Cover::all);
  EXPECT_EQ(wide.cover(10, 20, 0, 9), Mask::Cover::none);
  EXPECT_EQ(Mask::window(kMax, kMax).cover(0, 10, kMax - 10, kMax), Mask::Cover::all);
  EXPECT_EQ(Mask::window(kMax, 0).cover(kMax - 5, kMax, 0, 3), Mask::Cover::all);
  // The FLOP models of the same window: as wide as the sequence, whatever its nominal size.
  AttnSpec spec{.heads_q = 2, .heads_kv = 1, .head_dim = 8, .mask = Mask::window(0, kMax)};
  AttnSpec same = spec;
  same.mask = Mask::window(0, 100);
  EXPECT_EQ(dattn::attention_flops(1, 100, 100, spec), dattn::attention_flops(1, 100, 100, same));
  const dattn::Layout blocks = dattn::Layout::blocks(64, 2, 16);
  for (int r = 0; r < 2; ++r)
    EXPECT_EQ(dattn::star_prefill_flops(blocks, spec, 1, 16, r),
              dattn::star_prefill_flops(blocks, same, 1, 16, r));
}

// ---------------------------------------------------------------- layouts (fuzz_layout)

// The tokens the ranks of l hold, checking that every run lies inside [0, S).
int64_t total_tokens(const dattn::Layout& l) {
  int64_t total = 0;
  for (int r = 0; r < l.ranks(); ++r) {
    total += l.local_len(r);
    for (const dattn::Run& run : l.runs(r))
      if (run.length > 0) {
        EXPECT_GE(run.global_begin, 0);
        EXPECT_LT(run.last_position(), l.global_seq());
      }
  }
  return total;
}

// striped computed (S + block - 1) / block, r * block, ranks * block and mine * block: each
// overflowed for sizes near the int64 limit (fuzz_layout: striped(1, 3, INT64_MAX)).
TEST(FuzzRegressions, StripedNearTheInt64Limit) {
  const dattn::Layout found = dattn::Layout::striped(1, 3, kMax);
  EXPECT_EQ(found.local_len(0), 1);
  EXPECT_EQ(found.global_position(0, 0), 0);
  EXPECT_EQ(found.local_len(1) + found.local_len(2), 0);
  const dattn::Layout huge = dattn::Layout::striped(kMax, 2, 2);  // 2^62 blocks, the last of 1
  EXPECT_EQ(huge.local_len(0), int64_t(1) << 62);
  EXPECT_EQ(huge.local_len(1), (int64_t(1) << 62) - 1);
  EXPECT_EQ(huge.global_position(1, huge.local_len(1) - 1), kMax - 1);
  EXPECT_EQ(huge.global_position(0, huge.local_len(0) - 1), kMax - 2);
  EXPECT_EQ(total_tokens(huge), kMax);
  EXPECT_EQ(total_tokens(dattn::Layout::striped(kMax - 3, 7, kMax / 3)), kMax - 3);
}

// blocks computed r * nb / P with r * nb past the int64 limit (found beside striped's).
TEST(FuzzRegressions, BlocksNearTheInt64Limit) {
  const dattn::Layout l = dattn::Layout::blocks(kMax, 3, 1);
  EXPECT_EQ(total_tokens(l), kMax);
  EXPECT_EQ(l.global_position(1, 0), l.local_len(0));  // contiguous, in rank order
  EXPECT_EQ(l.global_position(2, 0), l.local_len(0) + l.local_len(1));
  EXPECT_EQ(total_tokens(dattn::Layout::blocks(kMax, 5, kMax / 2)), kMax);
}

// ---------------------------------------------------------------- options (fuzz_cli)

// Parses argv with a small description of an int64 option and a --config file; true when it
// throws UsageError (what() is called, as run_program does).
bool usage_error(std::vector<std::string> words, const std::string& config = "") {
  namespace po = boost::program_options;
  int64_t seq = 0;
  std::string file;
  po::options_description desc("test");
  desc.add_options()("seq-begin,s", po::value(&seq), "")("config", po::value(&file), "");
  std::string path;
  if (!config.empty()) {
    char name[] = "/tmp/dattn-fuzz-regression-XXXXXX";
    const int fd = mkstemp(name);
    EXPECT_EQ(write(fd, config.data(), config.size()), ssize_t(config.size()));
    close(fd);
    path = name;
    words.push_back("--config");
    words.push_back(path);
  }
  std::vector<char*> argv;
  for (std::string& w : words)
    argv.push_back(w.data());
  po::variables_map vm;
  bool thrown = false;
  try {
    dattn::parse_command_line(int(argv.size()), argv.data(), desc, vm);
  } catch (const UsageError& e) {
    thrown = std::string(e.what()).size() > 0;
  }
  if (!path.empty()) std::remove(path.c_str());
  return thrown;
}

// Boost builds its messages by replacing %value% (and the like) with the user's text until none
// is left, so `-s %value%` never returned (fuzz_cli: a hang). Such input now gets dattn's message.
TEST(FuzzRegressions, BoostPlaceholdersInTheInputAreUsageErrors) {
  EXPECT_TRUE(usage_error({"prog", "-s", "%value%'"}));  // the input fuzz_cli found
  EXPECT_TRUE(usage_error({"prog", "--%canonical_option%"}));
  EXPECT_TRUE(usage_error({"prog", "--seq-begin=%value%"}));
  EXPECT_TRUE(usage_error({"prog"}, "%invalid_line%\n"));
  EXPECT_TRUE(usage_error({"prog"}, "seq-begin = %value%\n"));
  EXPECT_TRUE(usage_error({"prog", "-s", "12x"}));  // an ordinary bad value: Boost's message
  EXPECT_FALSE(usage_error({"prog", "-s", "12"}));
}

// The prefill workload's parser, as dattn-run calls it.
void expect_prefill_usage_error(std::vector<std::string> words, const std::string& expected) {
  words.insert(words.begin(), "dattn-prefill-bench");
  std::vector<char*> argv;
  for (std::string& w : words)
    argv.push_back(w.data());
  try {
    dattn::bench::parse_workload(*dattn::bench::find_workload("prefill"), int(argv.size()),
                                 argv.data());
    ADD_FAILURE() << "no UsageError; expected one naming " << expected;
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
  }
}

// --doc-lens summed its lengths in int64 and overflowed; the sum now saturates.
TEST(FuzzRegressions, DocLensSummingPastTheInt64Limit) {
  expect_prefill_usage_error(
      {"--doc-lens", "9223372036854775807,9223372036854775807", "-m", "document", "-s", "5"},
      "not 9223372036854775807");
}

// --cp x --tp was checked as an int product, which overflowed for 65536 x 65536.
TEST(FuzzRegressions, CpTimesTpPastTheIntLimit) {
  expect_prefill_usage_error(
      {"--dry-run", "--world-size", "65536", "--cp", "65536", "--tp", "65536"}, "--cp x --tp");
}

}  // namespace
