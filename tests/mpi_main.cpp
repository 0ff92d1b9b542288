// main() of every multi-rank test binary (run under mpiexec by ctest): MPI up, GoogleTest on
// every rank with only rank 0 printing the full report and other ranks printing their failed
// assertions prefixed "[rank R]", and a failure on any rank failing the job on every rank.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <string>

#include "src/base/error.h"
#include "tests/mpi_support.h"

namespace {

// On ranks != 0: prints failed assertions (and the test they belong to) only.
class RankFailurePrinter : public testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}

  // The test's name is recorded at its start: UnitTest::current_test_info() would take the lock
  // that GoogleTest holds while it reports a part result (a self-deadlock).
  void OnTestStart(const testing::TestInfo& info) override {
    current_ = std::string(info.test_suite_name()) + "." + info.name();
  }
  void OnTestPartResult(const testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::printf("[rank %d] %s:%d: Failure in %s\n%s\n", rank_,
                result.file_name() ? result.file_name() : "?", result.line_number(),
                current_.c_str(), result.message());
    std::fflush(stdout);
  }
  void OnTestEnd(const testing::TestInfo& info) override {
    if (info.result()->Failed()) {
      std::printf("[rank %d] [  FAILED  ] %s.%s\n", rank_, info.test_suite_name(), info.name());
      std::fflush(stdout);
    }
  }

 private:
  int rank_;
  std::string current_;
};

// On every rank with more than one: a failed test aborts the job at once. The other ranks may
// already wait in a collective the failing rank will never join; aborting turns that hang
// (until ctest's timeout) into an immediate, non-zero exit.
class AbortOnFailure : public testing::EmptyTestEventListener {
 public:
  explicit AbortOnFailure(int rank) : rank_(rank) {}
  void OnTestEnd(const testing::TestInfo& info) override {
    if (!info.result()->Failed()) return;
    std::printf("[rank %d] %s.%s failed: aborting the job so that no rank hangs\n", rank_,
                info.test_suite_name(), info.name());
    std::fflush(stdout);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  dattn::set_error_rank(rank);

  testing::InitGoogleTest(&argc, argv);
  if (rank != 0) {
    testing::TestEventListeners& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size > 1) testing::UnitTest::GetInstance()->listeners().Append(new AbortOnFailure(rank));
  int local_failed = RUN_ALL_TESTS() != 0 ? 1 : 0;

  // A failure on any rank fails the test on every rank (ctest reads the exit codes).
  int any_failed = local_failed;
  MPI_Allreduce(&local_failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  dattn::test::release_world_runtimes();  // their communicators are freed before MPI_Finalize
  if (rank == 0 && any_failed && !local_failed)
    std::printf("[rank 0] some other rank failed (see the [rank R] lines above)\n");
  MPI_Finalize();
  return any_failed;
}
