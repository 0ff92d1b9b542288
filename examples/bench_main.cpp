// main() of every benchmark executable: the workload named by DATTN_WORKLOAD (set per target
// by CMake) on the engine, under run_program's MPI setup and error policy.
#include "examples/workloads.h"
#include "launch/program.h"

int main(int argc, char** argv) {
  return dattn::run_program(argc, argv, [](int argc, char** argv) {
    return dattn::bench::run_workload(*dattn::bench::find_workload(DATTN_WORKLOAD), argc, argv);
  });
}
