// run_program: MPI initialisation and the error policy of every dattn executable.
#include "launch/program.h"

#include <mpi.h>
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <fstream>
#include <sstream>
#include <vector>

#include "src/base/error.h"

namespace dattn {

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}

namespace {
// Boost.Program_options (1.74) writes an error message by replacing each placeholder of its
// template (%value%, %canonical_option%, ...) with the user's text, again and again until none is
// left: text that contains its own placeholder (`-s %value%`, `--%canonical_option%`, a config
// line with %invalid_line%) never ends (found by tests/fuzz/fuzz_cli). So an error whose input
// holds a placeholder gets this message instead of Boost's what().
std::string error_message(const boost::program_options::error& e,
                          const std::vector<std::string>& input) {
  for (const std::string& text : input)
    for (const char* token : {"%value%", "%option%", "%original_token%", "%canonical_option%",
                              "%prefix%", "%invalid_line%"})
      if (text.find(token) != std::string::npos)
        return detail::cat("invalid option or value '", text, "': expected no Boost placeholder (",
                           token, ")");
  return e.what();
}
}  // namespace

void parse_command_line(int argc, char** argv,
                        const boost::program_options::options_description& desc,
                        boost::program_options::variables_map& vm,
                        const std::vector<std::string>& first) {
  namespace po = boost::program_options;
  try {
    if (!first.empty()) po::store(po::command_line_parser(first).options(desc).run(), vm);
    po::store(po::command_line_parser(argc, argv).options(desc).positional({}).run(), vm);
  } catch (const po::error& e) {
    throw UsageError(error_message(e, std::vector<std::string>(argv, argv + argc)));
  }
  // The config file second: Boost keeps the first value stored, so the command line wins.
  std::string config;
  if (desc.find_nothrow("config", false) && vm.count("config")) {
    const std::string file = vm["config"].as<std::string>();
    std::ifstream in(file);
    if (!in) throw UsageError("invalid --config = " + file + ": expected a readable file");
    std::ostringstream text;
    text << in.rdbuf();
    config = text.str();
    std::istringstream lines(config);
    try {
      po::store(po::parse_config_file(lines, desc), vm);
    } catch (const po::error& e) {
      throw UsageError("in --config " + file + ": " + error_message(e, {config}));
    }
  }
  try {
    po::notify(vm);
  } catch (const po::error& e) {
    std::vector<std::string> input(argv, argv + argc);
    input.push_back(config);
    throw UsageError(error_message(e, input));
  }
}

int run_program(int argc, char** argv, const std::function<int(int, char**)>& body) {
  int provided = 0;
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
    std::fprintf(stderr, "dattn: MPI_Init_thread failed\n");
    return 1;
  }
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  set_error_rank(rank);
  int code = 0;
  try {
    code = body(argc, argv);
  } catch (const UsageError& e) {
    // Every rank parsed the same options and failed the same way: one message, clean exit.
    if (rank == 0) std::fprintf(stderr, "%s\n(try --help)\n", e.what());
    MPI_Finalize();
    return 2;
  } catch (const std::exception& e) {
    // Other ranks may be waiting in a collective: print and take the whole job down.
    std::fprintf(stderr, "[rank %d] %s\n", rank, e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  }
  MPI_Finalize();
  return code;
}

}  // namespace dattn
