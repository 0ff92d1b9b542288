// The execution context of the library's GPU work: the CUDA stream that kernels, copies,
// stream-ordered allocations and frees, and the NCCL communicators' ordering use on this thread.
//
// The contract (README "GPU runtime"): a call of a GPU Runtime queues all its device work on the
// Runtime's stream (RuntimeOptions.stream: one the caller hands in, e.g. PyTorch's current
// stream; by default the legacy default stream) and returns without waiting for the device.
// Its inputs must be complete in that stream's order (written on it, or on another stream the
// caller made it wait for); its outputs are complete in that order too: work the caller queues
// on the stream after the call sees them, and another stream must wait for the stream first
// (an event). The NCCL communicators run on a stream of their own so that transfers overlap the
// kernels; the two are joined by events on the GPU, never by a host wait. Only results that come
// back in host memory wait for the stream (dsinks, the non-finite check's scan, a copy to the
// host), as a device-to-host copy must.
//
// The stream is thread-local state, made current for one scope by StreamScope: every entry point
// that takes a Runtime opens one with the Runtime's stream; attention_local and the Tensor calls
// use whatever scope the caller opened, the legacy default stream outside any.
#pragma once

namespace dattn {

// A cudaStream_t as the library's headers carry it (they compile without CUDA); null is the
// legacy default stream (stream 0).
using StreamHandle = void*;

// The stream of this thread's GPU work now.
StreamHandle current_stream();

// Makes `stream` current on this thread until the scope ends, then restores the previous one.
class StreamScope {
 public:
  explicit StreamScope(StreamHandle stream);
  ~StreamScope();
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  StreamHandle previous_;
};

}  // namespace dattn
