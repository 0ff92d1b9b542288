// The cp group of the emulated library (dattn_emu): a Communicator with NCCL's semantics over
// MPI, so that a strategy that would hang, fault or corrupt data under NCCL fails here, named,
// instead of passing because MPI is kinder. See emu_nccl_communicator.cpp for the rules.
#pragma once

#include <mpi.h>

#include <memory>

#include "collective/communicator.h"

namespace dattn::emu {

// Over a duplicate of comm (collective over comm). device_memory_only: every data buffer must be
// device memory of the fake runtime (tests/emu/fake_runtime.h), as NCCL's must; false for a CPU
// Runtime of the emulated library, whose strategies then run on host memory under NCCL's
// matching and completion rules. timeout_s as MpiCommunicator's.
std::unique_ptr<Communicator> nccl_semantics_communicator(MPI_Comm comm, double timeout_s,
                                                          bool device_memory_only);

}  // namespace dattn::emu
