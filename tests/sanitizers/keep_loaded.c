/* Preloaded into the sanitizer test runs (tests/sanitizers/CMakeLists.txt): dlclose() that
   unloads nothing. Open MPI 4.1 unloads its plugins (mca_*.so) in MPI_Finalize, before
   LeakSanitizer looks at the heap at exit; the plugins' globals then no longer count as roots
   (thousands of false leaks) and their code addresses no longer symbolize, so no suppression can
   name them. Open MPI 4.1 has no setting that keeps them loaded (5.0 has
   mca_base_component_disable_dlclose). Nothing in dattn calls dlclose. */
#include <stddef.h>

int dlclose(void* handle) {
  (void)handle;
  return 0;
}
