// Kernels that the build's ptxas checks (DATTN_WARNINGS in the top CMakeLists.txt) must reject,
// for tests/gpu/ptxas_tests.cmake: built with the library's CUDA flags, each must fail the build
// with a ptxas error naming it. Never linked into anything; one kernel per build, chosen by macro.

#if defined(DATTN_PTXAS_PROBE_spills)
// 64 floats live at once, with __launch_bounds__ allowing 32 registers a thread (1024 threads,
// 2 CTAs on a 64K-register multiprocessor): ptxas must spill.
__global__ void __launch_bounds__(1024, 2) probe_spills(float* out, const float* in) {
  float v[64];
#pragma unroll
  for (int i = 0; i < 64; ++i)
    v[i] = in[threadIdx.x * 64 + i] * 1.5f;
  float s = 0.f;
#pragma unroll
  for (int j = 1; j < 64; ++j) {
#pragma unroll
    for (int i = 0; i < 64; ++i)
      s += v[i] * v[(i + j) % 64];
  }
  out[threadIdx.x] = s;
}
#elif defined(DATTN_PTXAS_PROBE_local_array)
// An array indexed by values known only at run time: ptxas keeps it in local memory (a stack
// frame), with registers to spare, so no spill.
__global__ void probe_local_array(float* out, const int* idx) {
  float a[32];
#pragma unroll
  for (int i = 0; i < 32; ++i)
    a[i] = out[i] * out[i + threadIdx.x];
  a[idx[threadIdx.x] & 31] += 1.f;
  float s = 0.f;
  for (int i = 0; i < 32; ++i)
    s += a[(i * 7 + idx[i]) & 31];
  out[threadIdx.x] = s;
}
#else
#error "define DATTN_PTXAS_PROBE_spills or DATTN_PTXAS_PROBE_local_array"
#endif
