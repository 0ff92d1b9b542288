// The options every dattn workload shares (dattn-run and the benchmarks alike): the config file,
// the cp x tp grid, the device, and the dry run. Each workload adds them to its own
// options_description, so `--config FILE` takes the same keys as the command line.
#pragma once

#include <boost/program_options.hpp>
#include <string>

#include "src/base/tensor.h"

namespace dattn {

struct LaunchOptions {
  // As given.
  std::string config;          // --config FILE: "key = value" lines, the long option names
  int cp = 0;                  // --cp: context-parallel degree (0: ranks / tp)
  int tp = 0;                  // --tp: tensor-parallel degree (0: the workload's default)
  std::string device = "cpu";  // --device cpu|cuda
  int device_id = -1;          // --device-id: CUDA device of this rank (-1: node-local rank)
  bool dry_run = false;        // --dry-run: print the plan, compute nothing
  int world_size = 0;          // --world-size: plan for this many ranks (with --dry-run only)
  // Set by a workload before resolve_launch_options when it runs on --device cuda (the prefill
  // benchmark's ring); the others accept cuda only with --dry-run.
  bool runs_on_cuda = false;

  // Resolved by resolve_launch_options.
  int world = 1;  // ranks in the job (or --world-size)
  Device dev;     // this rank's device
};

// Adds --config, --cp, --tp, --device, --device-id, --dry-run and --world-size to desc.
void add_launch_options(boost::program_options::options_description& desc, LaunchOptions& o);

// Checks the launch options and resolves the grid: world = the job's ranks (or --world-size),
// tp = the given value or default_tp, cp = world / tp unless given; throws UsageError (same on
// every rank) when cp x tp is not the world, --world-size comes without --dry-run, or the device
// is unknown (or cuda for a workload without runs_on_cuda). Whether the build and the machine
// have a GPU is the Runtime's check (Runtime::from_mpi), agreed by every rank. A CUDA rank's device
// is --device-id, else its node-local rank (one GPU per rank, as the Slurm scripts launch it).
// Collective over MPI_COMM_WORLD (the node-local rank).
void resolve_launch_options(LaunchOptions& o, int default_tp);

// The device rule as a dry-run plan states it: "cpu on every rank", "cuda:<node-local rank>
// (one GPU per rank)" or "cuda:N on every rank".
std::string device_plan(const LaunchOptions& o);

// The node-local rank of this process among the job's ranks (MPI_Comm_split_type SHARED).
int node_local_rank();

}  // namespace dattn
