// Support for the multi-rank test binaries (linked with their main(), tests/mpi_main.cpp): the
// runtimes over MPI_COMM_WORLD they share, and the runs and schedules of the distributed
// empty-document tests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "src/attention.h"
#include "src/base/dtype.h"
#include "src/base/spec.h"
#include "src/layout.h"
#include "src/runtime.h"

namespace dattn::test {

// One Runtime over MPI_COMM_WORLD per (Ulysses degree, check_finite), made on first use and kept
// for the whole program (making one is collective: every rank must ask for it in the same order).
Runtime& world_runtime(int ulysses, bool check_finite = false);
// Frees them (main() does, before MPI_Finalize).
void release_world_runtimes();

// The world ranks on this rank's host, in rank order, found by hostname (MPI_Get_processor_name
// allgathered): what the node split must find, on one machine or on the test cluster's hosts
// (tests/multinode). Collective over MPI_COMM_WORLD.
std::vector<int> same_host_ranks();

// The runs of the distributed empty-document tests over P ranks: each case of
// empty_documents_cases(S), causal and not, with fp32 and bf16 and the layouts varlen (on the
// case's boundaries), zigzag and contiguous in turn, so that each (mask, layout) and (dtype,
// layout) pair comes twice and each case runs under two layouts; and the schedules, each with
// its runtime's Ulysses degree: ring, Ulysses and the hybrid with U = 2 where 2 divides P.
struct EmptyDocumentsRun {
  std::string name;
  Mask mask, cut;  // cut: the same documents without the repeated boundaries
  DType dtype;
  Layout layout, layout_cut;  // layout_cut: the layout for cut (varlen's differs)
};
std::vector<EmptyDocumentsRun> empty_documents_runs(int64_t S, int P);
struct ScheduleRun {
  Strategy strategy;
  int ulysses;  // the runtime's degree; the byte models' is P for Ulysses
};
std::vector<ScheduleRun> empty_documents_schedules(int P);

}  // namespace dattn::test
