// The main() wrapper every dattn program uses: MPI up and down, and the error policy:
// a usage error (bad option) is printed once by rank 0 and every rank exits 2; any other error
// is printed by each rank that hit it and the job is aborted, so that no rank hangs.
#pragma once

#include <functional>
#include <stdexcept>
#include <string>

namespace dattn {

// Thrown by option parsing: the same on every rank, so no abort is needed.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Initialises MPI (MPI_THREAD_FUNNELED), runs body, finalises MPI, and returns the exit code.
int run_program(int argc, char** argv, const std::function<int(int, char**)>& body);

// Host name of this process, for report headers.
std::string host_name();

}  // namespace dattn
