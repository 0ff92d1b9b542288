// libFuzzer target: dattn-run's option parsing, as the prefill workload (`dattn-run prefill` and
// dattn-prefill-bench) does it. The input is text: the words before a line "%%" (split at
// whitespace and NUL) are the command line, the rest is the file of --config. parse_options
// either answers UsageError (or dattn::Error) or returns options from which the run's problems
// (spec and layout of each sequence length) and, for --dry-run, the plan are made without any
// other exception. Any other outcome (crash, other exception, sanitizer report, hang) is a
// finding.
//
// The workload's parser lives in an anonymous namespace of examples/prefill_bench.cpp, which is
// compiled into this target whole so that the fuzzer calls exactly what the program calls.
#include "examples/prefill_bench.cpp"

#include <mpi.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_util.h"

namespace {

std::string g_config_path;  // the file --config names, rewritten for every input

// Whether the problems of these options fit a quick check: the parser accepts sizes (ranks of a
// dry run, documents) whose layouts take memory and time in proportion.
bool small_enough(const Options& o) {
  const int64_t docs = o.doc_lens.empty() ? o.doc_count : int64_t(o.doc_lens.size());
  return o.launch.world <= 256 && docs <= 4096 && docs * o.cp() <= (1 << 16);
}

// Whether the dry-run plan is quick: its FLOP model visits every tile of every rank, about
// (S / 64)^2 of them for the longest S (a plan for S = 2^40 would not finish).
bool plan_small_enough(const Options& o) {
  return o.seq_end <= 8192 && o.launch.world <= 64;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  // The parsers run after MPI is up (run_program); a singleton MPI process is enough.
  int provided = 0;
  MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  dattn::set_error_rank(rank);
  char path[] = "/tmp/dattn-fuzz-cli-XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) dattn::fuzz::fail("mkstemp failed");
  close(fd);
  g_config_path = path;
  // At exit, before LeakSanitizer looks (its handler was registered first, so it runs last):
  // Open MPI frees what it can, and the config file goes.
  std::atexit([] {
    std::remove(g_config_path.c_str());
    MPI_Finalize();
  });
  // --help and the dry-run plan print; libFuzzer reports on stderr.
  std::cout.rdbuf(nullptr);
  if (!std::freopen("/dev/null", "w", stdout)) dattn::fuzz::fail("no /dev/null");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  std::string config;
  const size_t sep = text.find("%%");
  if (sep != std::string::npos) {
    config = text.substr(sep + 2);
    text.resize(sep);
  }
  // The config file first on the command line: a second --config from the input (or an
  // abbreviation of it) is then a usage error, so the fuzzer reads no other file.
  std::vector<std::string> words = {"dattn-prefill-bench", "--config", g_config_path};
  std::string word;
  for (char c : text) {
    if (c == '\0' || c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f') {
      if (!word.empty()) words.push_back(word);
      word.clear();
    } else {
      word += c;
    }
  }
  if (!word.empty()) words.push_back(word);
  if (words.size() > 64) return 0;
  {
    std::FILE* f = std::fopen(g_config_path.c_str(), "wb");
    if (!f) dattn::fuzz::fail("cannot write " + g_config_path);
    std::fwrite(config.data(), 1, config.size(), f);
    std::fclose(f);
  }
  std::vector<char*> argv;
  for (std::string& w : words)
    argv.push_back(w.data());
  argv.push_back(nullptr);

  try {
    const std::optional<Options> parsed = parse_options(int(words.size()), argv.data());
    if (!parsed || !small_enough(*parsed)) return 0;
    const Options& o = *parsed;
    const std::vector<int64_t> seqs = sequence_lengths(o);
    FUZZ_CHECK(!seqs.empty() && seqs.front() == o.seq_begin && seqs.back() <= o.seq_end,
               "sequence lengths from ", o.seq_begin, " to ", o.seq_end);
    for (int64_t S : {seqs.front(), seqs.back()}) {
      const Problem p = make_problem(o, S, o.cp());
      FUZZ_CHECK(p.layout.global_seq() == S && p.layout.ranks() == o.cp(), p.layout.str());
    }
    if (o.launch.dry_run && plan_small_enough(o)) print_plan(o);
  } catch (const dattn::UsageError&) {
  } catch (const dattn::Error& e) {
    dattn::fuzz::expect_argument_error(e);
  }
  return 0;
}
