// The check of the GPU tests that run a Runtime on a stream of the caller's: in the CUDA
// emulation, the fake runtime's accounting (tests/emu/fake_runtime.h) since
// reset_stream_work() says that the device work went to that stream only (none to the legacy
// default stream) and that the host never waited for the device. On hardware there is no such
// accounting: both calls do nothing and the check passes (the tests' bitwise comparisons remain).
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#if DATTN_CUDA_EMULATION
#include "tests/emu/fake_runtime.h"
#endif

namespace dattn::test {

inline void reset_stream_work() {
#if DATTN_CUDA_EMULATION
  emu::reset_stream_stats();
#endif
}

inline testing::AssertionResult only_on_stream(cudaStream_t stream) {
#if DATTN_CUDA_EMULATION
  const emu::StreamStats s = emu::stream_stats();
  if (s.ops_on(stream) == 0)
    return testing::AssertionFailure() << "no device operation on the stream";
  if (s.ops_on(nullptr) != 0)
    return testing::AssertionFailure()
           << s.ops_on(nullptr) << " device operations on the legacy default stream";
  if (s.device_waits != 0)
    return testing::AssertionFailure()
           << s.device_waits << " synchronous CUDA calls (the host waited for the device)";
  if (s.waits_on(stream) != 0)
    return testing::AssertionFailure() << s.waits_on(stream) << " host waits for the stream";
#else
  (void)stream;
#endif
  return testing::AssertionSuccess();
}

}  // namespace dattn::test
