// DATTN_NCCL_CHECK: the checking macro for every NCCL call. A failure throws dattn::Error naming
// the call, NCCL's error string and NCCL's last error message (which says what went wrong,
// where ncclGetErrorString only names the class), and file:line, like DATTN_CUDA_CHECK; its kind
// is ErrorKind::nccl.
#pragma once

#include <nccl.h>

#include "src/base/error.h"

#define DATTN_NCCL_CHECK(call)                                                          \
  do {                                                                                  \
    const ncclResult_t dattn_nccl_rc_ = (call);                                         \
    if (dattn_nccl_rc_ != ncclSuccess)                                                  \
      DATTN_THROW_KIND(::dattn::ErrorKind::nccl, "NCCL call failed: ", #call, ": ",     \
                       ::ncclGetErrorString(dattn_nccl_rc_), " (", int(dattn_nccl_rc_), \
                       "): ", ::ncclGetLastError(nullptr));                             \
  } while (0)

// The same for calls on a non-blocking communicator (config.blocking = 0), where ncclInProgress
// means "enqueued, still being set up": not an error; the caller then polls
// ncclCommGetAsyncError until the communicator leaves that state (NcclCommunicator::settle).
#define DATTN_NCCL_CHECK_ASYNC(call)                                                    \
  do {                                                                                  \
    const ncclResult_t dattn_nccl_rc_ = (call);                                         \
    if (dattn_nccl_rc_ != ncclSuccess && dattn_nccl_rc_ != ncclInProgress)              \
      DATTN_THROW_KIND(::dattn::ErrorKind::nccl, "NCCL call failed: ", #call, ": ",     \
                       ::ncclGetErrorString(dattn_nccl_rc_), " (", int(dattn_nccl_rc_), \
                       "): ", ::ncclGetLastError(nullptr));                             \
  } while (0)
