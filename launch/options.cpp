// The shared launch options: the cp x tp grid, the device and the dry run.
#include "launch/options.h"

#include <mpi.h>

#include "collective/mpi_communicator.h"
#include "launch/program.h"
#include "src/base/error.h"

namespace dattn {

namespace po = boost::program_options;

void add_launch_options(po::options_description& desc, LaunchOptions& o) {
  po::options_description launch("launch options (shared by every workload)");
  // clang-format off
  launch.add_options()
    ("config", po::value(&o.config)->value_name("FILE"),
     "read options from FILE, one \"key = value\" per line (long names without --; '#' starts "
     "a comment); the command line wins over the file")
    ("cp", po::value(&o.cp)->value_name("arg (=ranks/tp)"),
     "context-parallel degree: ranks that share one sequence")
    ("tp", po::value(&o.tp)->value_name("arg (=workload's)"),
     "tensor-parallel degree: ranks that split the heads (tp is the fastest rank index)")
    ("device", po::value(&o.device)->default_value(o.device), "device kind: cpu or cuda")
    ("device-id", po::value(&o.device_id)->value_name("N"),
     "CUDA device of every rank (default: the rank's node-local rank)")
    ("dry-run", po::bool_switch(&o.dry_run),
     "print the plan (tokens and heads per rank, communicators, FLOP and byte model) and exit")
    ("world-size", po::value(&o.world_size)->value_name("N"),
     "with --dry-run: plan for N ranks instead of the job's");
  // clang-format on
  desc.add(launch);
}

std::string device_plan(const LaunchOptions& o) {
  if (o.device == "cpu") return "cpu on every rank";
  if (o.device_id >= 0) return detail::cat("cuda:", o.device_id, " on every rank");
  return "cuda:<node-local rank> (one GPU per rank)";
}

int node_local_rank() {
  MPI_Comm node = MPI_COMM_NULL;
  DATTN_MPI_CHECK(
      MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int rank = 0;
  DATTN_MPI_CHECK(MPI_Comm_rank(node, &rank));
  DATTN_MPI_CHECK(MPI_Comm_free(&node));
  return rank;
}

void resolve_launch_options(LaunchOptions& o, int default_tp) {
  using detail::cat;
  int job = 0;
  DATTN_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &job));
  require_option(o.world_size >= 0, "--world-size", o.world_size, ">= 1");
  require_option(o.world_size == 0 || o.dry_run, "--world-size", o.world_size,
                 "given only with --dry-run (a real run uses the job's ranks)");
  o.world = o.world_size > 0 ? o.world_size : job;
  require_option(o.tp >= 0, "--tp", o.tp, ">= 1");
  require_option(o.cp >= 0, "--cp", o.cp, ">= 1");
  if (o.tp == 0) o.tp = o.cp > 0 && o.world % o.cp == 0 ? o.world / o.cp : default_tp;
  if (o.cp == 0) o.cp = o.world / o.tp;
  require_option(int64_t(o.cp) * o.tp == o.world, "--cp x --tp", cat(o.cp, " x ", o.tp),
                 cat("a product equal to the number of ranks (", o.world, ")"));
  require_option(o.device == "cpu" || o.device == "cuda", "--device", o.device, "cpu or cuda");
  require_option(o.device_id >= -1, "--device-id", o.device_id, ">= 0");
  require_option(o.device_id == -1 || o.device == "cuda", "--device-id", o.device_id,
                 "given only with --device cuda");
  require_option(o.device == "cpu" || o.dry_run || o.runs_on_cuda, "--device", o.device,
                 "cpu: this workload has no CUDA path yet (--dry-run plans for cuda)");
  // Every rank takes part in the split, so that it stays collective whatever the options.
  const int local = node_local_rank();
  o.dev = o.device == "cpu" ? Device::cpu() : Device::cuda(o.device_id >= 0 ? o.device_id : local);
}

}  // namespace dattn
