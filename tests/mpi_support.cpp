// Support for the multi-rank test binaries: the shared runtimes and the empty-document runs.
#include "tests/mpi_support.h"

#include <mpi.h>

#include <cstring>
#include <map>
#include <memory>
#include <utility>

#include "tests/test_reference.h"

namespace dattn::test {

namespace {
std::map<std::pair<int, bool>, std::unique_ptr<Runtime>>& world_runtimes() {
  static std::map<std::pair<int, bool>, std::unique_ptr<Runtime>> r;
  return r;
}
}  // namespace

std::vector<int> same_host_ranks() {
  char mine[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0, P = 1;
  MPI_Get_processor_name(mine, &len);
  MPI_Comm_size(MPI_COMM_WORLD, &P);
  std::vector<char> all(size_t(P) * MPI_MAX_PROCESSOR_NAME);
  MPI_Allgather(mine, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, all.data(), MPI_MAX_PROCESSOR_NAME,
                MPI_CHAR, MPI_COMM_WORLD);
  std::vector<int> out;
  for (int r = 0; r < P; ++r)
    if (std::strncmp(all.data() + size_t(r) * MPI_MAX_PROCESSOR_NAME, mine,
                     MPI_MAX_PROCESSOR_NAME) == 0)
      out.push_back(r);
  return out;
}

Runtime& world_runtime(int ulysses, bool check_finite) {
  auto& rt = world_runtimes()[{ulysses, check_finite}];
  if (!rt) {
    RuntimeOptions o;
    o.ulysses = ulysses;
    o.check_finite = check_finite;
    rt = std::make_unique<Runtime>(Runtime::from_mpi(MPI_COMM_WORLD, o));
  }
  return *rt;
}

void release_world_runtimes() {
  world_runtimes().clear();
}

std::vector<EmptyDocumentsRun> empty_documents_runs(int64_t S, int P) {
  std::vector<EmptyDocumentsRun> runs;
  int n = 0;
  for (const auto& [name, cu] : empty_documents_cases(S)) {
    for (bool causal : {true, false}) {
      EmptyDocumentsRun r{name, Mask::document(cu, causal), {}, DType::f32, {}, {}};
      r.cut = without_empty_documents(r.mask);
      r.dtype = n % 2 == 0 ? DType::f32 : DType::bf16;
      switch (n++ % 3) {
        case 0:
          r.layout = Layout::varlen(cu, P);
          r.layout_cut = Layout::varlen(*r.cut.documents, P);
          break;
        case 1:
          r.layout = r.layout_cut = Layout::zigzag(S, P);
          break;
        default:
          r.layout = r.layout_cut = Layout::contiguous(S, P);
      }
      runs.push_back(std::move(r));
    }
  }
  return runs;
}

std::vector<ScheduleRun> empty_documents_schedules(int P) {
  std::vector<ScheduleRun> s{{Strategy::ring, 1}, {Strategy::ulysses, 1}};
  if (P % 2 == 0) s.push_back({Strategy::hybrid, 2});
  return s;
}

}  // namespace dattn::test
