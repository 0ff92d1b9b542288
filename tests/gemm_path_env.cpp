// Runs a kernel test binary on one tile-GEMM path (kernels/cpu/tile_gemm.h), the one named by
// DATTN_TEST_GEMM_PATH (blas or onednn; unset: the default dispatch). ctest registers such a
// binary once per path (tests/CMakeLists.txt, dattn_add_gemm_path_test); on a machine or build
// without the path every test of that run reports SKIPPED with the reason, never passed.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "kernels/cpu/tile_gemm.h"

namespace dattn {
namespace {

class GemmPathEnvironment : public testing::Environment {
 public:
  void SetUp() override {
    const char* env = std::getenv("DATTN_TEST_GEMM_PATH");
    if (env == nullptr || env[0] == '\0') return;
    const std::string name = env;
    if (name != "blas" && name != "onednn") {
      FAIL() << "DATTN_TEST_GEMM_PATH = '" << name << "': expected blas or onednn";
    }
    const cpu::GemmPath p = name == "blas" ? cpu::GemmPath::blas : cpu::GemmPath::onednn;
    if (!cpu::gemm_path_runs(p, DType::f32))
      GTEST_SKIP() << "the " << name
                   << " tile-GEMM path does not run here (no oneDNN in this build, or no brgemm "
                      "kernel for this CPU)";
    cpu::set_gemm_path(p);
  }
  void TearDown() override { cpu::reset_gemm_path(); }
};

const testing::Environment* const kEnvironment =
    testing::AddGlobalTestEnvironment(new GemmPathEnvironment);

}  // namespace
}  // namespace dattn
