// Host views of partials for the GPU strategy tests: a device partial copied to the host, and a
// partial's values as a ReferenceResult, so that a GPU result can be compared with the CPU
// backend's through the same matches_reference as the float64 reference.
#pragma once

#include "kernels/cpu/reference.h"
#include "src/attention.h"

namespace dattn::test {

inline Partial to_host(const Partial& p) {
  return {p.out.to_device(Device::cpu()), p.lse.to_device(Device::cpu())};
}

inline cpu::ReferenceResult as_reference(const Partial& p) {
  cpu::ReferenceResult r;
  r.out.assign(p.out.ptr<float>(), p.out.ptr<float>() + p.out.numel());
  r.lse.assign(p.lse.ptr<float>(), p.lse.ptr<float>() + p.lse.numel());
  return r;
}

}  // namespace dattn::test
