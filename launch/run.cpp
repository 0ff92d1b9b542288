// dattn-run: one program for every workload. `dattn-run WORKLOAD [options]` runs the workload
// (prefill, decode, star, mla, kernel) with its options, the shared launch options (--config,
// --cp, --tp, --device, --dry-run) included; `dattn-run WORKLOAD --help` lists them.
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "examples/workloads.h"
#include "launch/program.h"

namespace {

void print_usage(std::FILE* f) {
  std::fprintf(f,
               "dattn-run %s: distributed attention, one program for every workload\n"
               "usage: mpiexec -n P dattn-run WORKLOAD [options]\n"
               "       dattn-run WORKLOAD --help   (the workload's options)\n"
               "workloads:\n",
               DATTN_VERSION);
  for (const auto& w : dattn::bench::workloads())
    std::fprintf(f, "  %-8s %s (also as %s)\n", w.name, w.summary, w.program);
}

// argv[1] is the workload; it runs with argv[1..] so that its argv[0] names it.
int run(int argc, char** argv) {
  const std::string word = argc > 1 ? argv[1] : "";
  if (word == "--help" || word == "-h" || word == "--version" || word == "-V") {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank == 0) {
      if (word == "--version" || word == "-V")
        std::printf("dattn-run %s\n", DATTN_VERSION);
      else
        print_usage(stdout);
    }
    return 0;
  }
  const dattn::bench::WorkloadEntry* w = dattn::bench::find_workload(word);
  if (!w) {
    std::string names;
    for (const auto& x : dattn::bench::workloads())
      names += std::string(names.empty() ? "" : ", ") + x.name;
    throw dattn::UsageError(word.empty()
                                ? "missing WORKLOAD: expected one of " + names
                                : "invalid WORKLOAD = " + word + ": expected one of " + names);
  }
  return dattn::bench::run_workload(*w, argc - 1, argv + 1);
}

}  // namespace

int main(int argc, char** argv) {
  return dattn::run_program(argc, argv, run);
}
