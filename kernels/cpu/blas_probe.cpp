// Configure-time probe (run by CMake's try_run): prints the OPENBLAS_CORETYPE setting this
// machine needs, or nothing. OpenBLAS 0.3.21 does not recognise recent Xeons (e.g. family 6
// model 207) and falls back to its generic Prescott (SSE3) kernels, ~5x slower than the
// SkylakeX kernels the CPU can run. An explicit OPENBLAS_CORETYPE is left alone.
#include <cblas.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

int main() {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return 0;
  const char* core = openblas_get_corename();
  const bool generic = core == nullptr || std::strcmp(core, "Prescott") == 0 ||
                       std::strcmp(core, "Core2") == 0 || std::strcmp(core, "Nehalem") == 0;
  if (!generic) return 0;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    std::printf("SkylakeX");
  else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    std::printf("Haswell");
  return 0;
}
