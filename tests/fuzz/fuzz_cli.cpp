// libFuzzer target: dattn-run's option parsing, as the prefill workload (`dattn-run prefill` and
// dattn-prefill-bench) does it on the benchmark engine. The input is text: the words before a
// line "%%" (split at whitespace and NUL) are the command line, the rest is the file of
// --config. parse_workload either answers UsageError (or dattn::Error) or returns a workload
// whose plan (the spec and layout of every sequence length, each asserted to have the length and
// the ranks asked for, and the models of every rank) is made without any other exception. Any
// other outcome (crash, other exception, internal assertion, sanitizer report, hang) is a
// finding.
#include <mpi.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "examples/workloads.h"
#include "launch/program.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

std::string g_config_path;  // the file --config names, rewritten for every input

// Whether the plan of these options fits a quick check: the parser accepts sizes (ranks of a
// dry run, sequence lengths and the documents in them) whose layouts and models take memory and
// time in proportion.
bool small_enough(const dattn::bench::ParsedWorkload& p) {
  const auto& vm = p.vm;
  const int64_t seq =
      vm.count("seq-end") ? vm["seq-end"].as<int64_t>() : vm["seq-begin"].as<int64_t>();
  return p.options.launch.world <= 64 && seq <= 8192;
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
    const auto parsed = dattn::bench::parse_workload(*dattn::bench::find_workload("prefill"),
                                                     int(words.size()), argv.data());
    if (!parsed || !small_enough(*parsed)) return 0;
    dattn::bench::Plan plan(parsed->options);
    parsed->workload->plan(plan);
  } catch (const dattn::UsageError&) {
  } catch (const dattn::Error& e) {
    dattn::fuzz::expect_argument_error(e);
  }
  return 0;
}
