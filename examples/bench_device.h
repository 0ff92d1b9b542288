// The benchmarks' device handling, shared by the prefill and decode benchmarks (--device cuda):
// inputs generated on the host and copied to the runtime's device once, and the wait that ends a
// timed call on a GPU.
#pragma once

#include "src/attention.h"
#include "src/base/tensor.h"
#if DATTN_WITH_CUDA
#include "src/base/cuda_check.h"
#endif

namespace dattn::bench {

// t on `device`: a host tensor is returned as it is for the CPU, else copied there once.
inline Tensor on_device(Tensor t, Device device) {
  return device.is_cpu() ? t : t.to_device(device);
}

// A result on the host (the float64 checks read it there): p itself on the CPU, else a copy.
inline Partial to_host(const Partial& p) {
  if (p.out.device().is_cpu()) return p;
  return {p.out.to_device(Device::cpu()), p.lse.to_device(Device::cpu())};
}

// Waits for the device's queued work: the API returns once a GPU's kernels and collectives are
// queued (on the Runtime's stream, and NCCL's joined to it), so a timed call ends here. Nothing to
// wait for on the CPU.
inline void synchronize(Device device) {
  if (device.is_cpu()) return;
#if DATTN_WITH_CUDA
  DATTN_CUDA_CHECK(cudaDeviceSynchronize());
#endif
}

}  // namespace dattn::bench
