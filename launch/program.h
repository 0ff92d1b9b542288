// The main() wrapper every dattn program uses: MPI up and down, and the error policy:
// a usage error (bad option) is printed once by rank 0 and every rank exits 2; any other error
// is printed by each rank that hit it and the job is aborted, so that no rank hangs.
#pragma once

#include <boost/program_options.hpp>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "src/base/error.h"

namespace dattn {

// Thrown by option parsing: the same on every rank, so no abort is needed.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Parses argv against desc into vm, then the file of --config (when desc has that option and it
// was given) against the same desc: the command line wins over the file. Boost's errors (an
// unknown option or key, a bad value, a stray positional word) become a UsageError. The
// arguments `first`, when given, are stored before argv and win over it (the benchmark engine's
// --compare reruns set one option this way).
void parse_command_line(int argc, char** argv,
                        const boost::program_options::options_description& desc,
                        boost::program_options::variables_map& vm,
                        const std::vector<std::string>& first = {});

// Throws UsageError "invalid OPTION = VALUE: expected EXPECTED" unless ok.
template <typename T>
void require_option(bool ok, const char* option, const T& value, const std::string& expected) {
  if (!ok) throw UsageError(detail::cat("invalid ", option, " = ", value, ": expected ", expected));
}

// Initialises MPI (MPI_THREAD_FUNNELED), runs body, finalises MPI, and returns the exit code.
int run_program(int argc, char** argv, const std::function<int(int, char**)>& body);

// Host name of this process, for report headers.
std::string host_name();

}  // namespace dattn
