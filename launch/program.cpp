// run_program: MPI initialisation and the error policy of every dattn executable.
#include "launch/program.h"

#include <mpi.h>
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <fstream>

#include "src/error.h"

namespace dattn {

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}

void parse_command_line(int argc, char** argv,
                        const boost::program_options::options_description& desc,
                        boost::program_options::variables_map& vm) {
  namespace po = boost::program_options;
  try {
    po::store(po::command_line_parser(argc, argv).options(desc).positional({}).run(), vm);
  } catch (const po::error& e) {
    throw UsageError(e.what());
  }
  // The config file second: Boost keeps the first value stored, so the command line wins.
  if (desc.find_nothrow("config", false) && vm.count("config")) {
    const std::string file = vm["config"].as<std::string>();
    std::ifstream in(file);
    if (!in) throw UsageError("invalid --config = " + file + ": expected a readable file");
    try {
      po::store(po::parse_config_file(in, desc), vm);
    } catch (const po::error& e) {
      throw UsageError("in --config " + file + ": " + e.what());
    }
  }
  try {
    po::notify(vm);
  } catch (const po::error& e) {
    throw UsageError(e.what());
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
