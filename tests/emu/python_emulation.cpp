// _C.emulation of the Python module built on the CUDA emulation (build/python-emu): the fake
// runtime's streams and their accounting (fake_runtime.h), so that tests/python/
// test_cuda_tensors.py can hand a call a stream and assert which stream its work went to and
// that the host never waited, and tell the fake runtime's device memory from host memory.
#include <cuda_runtime_api.h>
#include <pybind11/pybind11.h>

#include <cstdint>

#include "src/base/error.h"
#include "tests/emu/fake_runtime.h"

namespace py = pybind11;

void dattn_add_emulation(py::module_& m) {
  py::module_ e = m.def_submodule("emulation", "The CUDA emulation's streams (tests only).");
  e.def("stream_create", [] {
    cudaStream_t s = nullptr;
    if (cudaStreamCreate(&s) != cudaSuccess) DATTN_THROW("cudaStreamCreate failed");
    return reinterpret_cast<uintptr_t>(s);
  });
  e.def("ops_on", [](uintptr_t s) {
    return dattn::emu::stream_stats().ops_on(reinterpret_cast<const void*>(s));
  });
  e.def("waits_on", [](uintptr_t s) {
    return dattn::emu::stream_stats().waits_on(reinterpret_cast<const void*>(s));
  });
  e.def("device_waits", [] { return dattn::emu::stream_stats().device_waits; });
  e.def("is_device_memory", [](uintptr_t p) {
    return dattn::emu::is_device_range(reinterpret_cast<const void*>(p), 1);
  });
}
