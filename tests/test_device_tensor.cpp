// Device tensors in a CUDA build, on whatever machine runs the test: without a GPU, allocating on
// Device::cuda must fail with a dattn::Error naming the device and CUDA's reason (never crash);
// with one, host -> device -> host copies must return the same bytes and zeros() must be zero.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>

#include "src/base/error.h"
#include "src/base/tensor.h"
#include "tests/test_reference.h"

namespace dattn {
namespace {

bool have_gpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

TEST(DeviceTensor, AllocationMatchesTheMachine) {
  if (have_gpu()) {
    Tensor t = Tensor::empty({2, 3, 4, 8}, DType::bf16, Device::cuda(0));
    EXPECT_EQ(t.device(), Device::cuda(0));
    EXPECT_NE(t.data(), nullptr);
  } else {
    EXPECT_TRUE(test::throws_naming(
        [] {
          (void)Tensor::empty({2, 3, 4, 8}, DType::bf16, Device::cuda(0));
        },
        {"device = cuda:0", "CUDA sees no device", "cudaGetDeviceCount"}));
  }
}

TEST(DeviceTensor, RoundTripKeepsTheBytes) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU: the round trip needs one (see AllocationMatches...)";
  Tensor h = test::random_tensor({2, 33, 3, 16}, DType::bf16, 7);
  Tensor d = h.to_device(Device::cuda(0));
  Tensor back = d.to_device(Device::cpu());
  ASSERT_EQ(back.nbytes(), h.nbytes());
  EXPECT_EQ(std::memcmp(back.data(), h.data(), h.nbytes()), 0);
  Tensor z = Tensor::zeros({5, 7}, DType::f32, Device::cuda(0)).to_device(Device::cpu());
  for (int64_t i = 0; i < z.numel(); ++i)
    EXPECT_EQ(z.get(i), 0.f);
}

TEST(DeviceTensor, HostOnlyOperationsRejectDeviceTensors) {
  // A wrapped pointer is never dereferenced by the checks, so this runs without a GPU too.
  float dummy[4] = {};
  Tensor d = Tensor::wrap(dummy, {4}, DType::f32, Device::cuda(0));
  EXPECT_TRUE(test::throws_naming([&] { (void)d.get(0); }, {"tensor device", "cuda:0"}));
  EXPECT_TRUE(test::throws_naming([&] { d.set(0, 1.f); }, {"tensor device", "cuda:0"}));
  EXPECT_TRUE(test::throws_naming([&] { (void)d.to(DType::bf16); }, {"tensor device"}));
}

}  // namespace
}  // namespace dattn
