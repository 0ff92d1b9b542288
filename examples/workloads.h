// The workloads dattn-run runs: each benchmark's body as a function of (argc, argv), called
// after MPI is up (inside run_program). The benchmark executables and dattn-run share them, so
// `dattn-run prefill ARGS` and `dattn-prefill-bench ARGS` are the same run.
#pragma once

#include <string>
#include <vector>

namespace dattn::bench {

int prefill_main(int argc, char** argv);
int decode_main(int argc, char** argv);
int star_main(int argc, char** argv);
int mla_main(int argc, char** argv);
int kernel_main(int argc, char** argv);

struct Workload {
  const char* name;     // dattn-run's word: "prefill"
  const char* program;  // the benchmark executable: "dattn-prefill-bench"
  const char* summary;  // one line for dattn-run --help
  int (*main)(int argc, char** argv);
};

const std::vector<Workload>& workloads();
const Workload* find_workload(const std::string& name);  // nullptr when unknown

}  // namespace dattn::bench
