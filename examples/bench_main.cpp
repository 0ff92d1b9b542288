// main() of every benchmark executable: the workload named by DATTN_WORKLOAD (set per target
// by CMake) under run_program's MPI setup and error policy.
#include "examples/workloads.h"
#include "launch/program.h"

int main(int argc, char** argv) {
  return dattn::run_program(argc, argv, dattn::bench::find_workload(DATTN_WORKLOAD)->main);
}
