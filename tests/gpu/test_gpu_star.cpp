// Multi-rank GPU tests (1-2 ranks, one GPU each) of star attention on cuda tensors: phase 1
// (star_prefill) and phase-2 steps (star_decode over a device KV cache) on a GPU Runtime (NCCL cp
// group, CUDA kernels) against the CPU backend on the same ranks and inputs, with the exact bytes
// of the star byte models; and the device checks of star_decode, on every rank.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "src/base/cuda_check.h"
#include "src/base/error.h"
#include "src/decode.h"
#include "src/star.h"
#include "tests/gpu/one_gpu_per_rank.h"
#include "tests/gpu/partials.h"
#include "tests/gpu/suite_runtimes.h"
#include "tests/test_reference.h"

namespace dattn {
namespace {

using test::as_reference;  // tests/gpu/partials.h
using test::to_host;

// One GPU per rank, or every rank skips together (tests/gpu/one_gpu_per_rank.h).
testing::Environment* const one_gpu_per_rank =
    testing::AddGlobalTestEnvironment(new test::OneGpuPerRank);

// bf16, GQA (4 query heads per kv head), B = 2, causal; a context that is not a whole number of
// blocks, and blocks that do not divide evenly among the ranks.
constexpr int64_t kB = 2, kS0 = 203, kBlock = 48, kHq = 8, kHkv = 2, kD = 64;
constexpr DType kDtype = DType::bf16;

AttnSpec make_spec() {
  AttnSpec spec;
  spec.heads_q = kHq;
  spec.heads_kv = kHkv;
  spec.head_dim = kD;
  spec.mask = Mask::causal();
  return spec;
}

// As tests/gpu/test_gpu_attention.cpp: the order of a bf16 rounding of out, fp32 lse.
const test::Tolerance kGpuTolerance = {1e-2, 1e-2, 1e-4, 1e-4};

// A GPU runtime and a CPU one over the same ranks (tests/gpu/suite_runtimes.h).
class GpuStar : public testing::Test {
 protected:
  static Runtime& gpu() { return test::suite_runtime("gpu", test::on_gpu()); }
  static Runtime& cpu() { return test::suite_runtime("cpu", {}); }
  static void TearDownTestSuite() { test::release_suite_runtimes(); }
};

// Phase 1 with the default anchor (a block), a short one and none: out and lse against the CPU
// backend, and the anchor broadcast's bytes against the model on both.
TEST_F(GpuStar, PrefillMatchesCpuBackendAndByteModel) {
  Runtime& g = gpu();
  Runtime& h = cpu();
  const int P = g.cp_size(), me = g.cp_rank();
  ASSERT_EQ(g.cp().backend(), test::kGpuBackend);
  const Device dev = g.device();
  const AttnSpec spec = make_spec();
  const Layout layout = Layout::blocks(kS0, P, kBlock);
  const Tensor q = layout.dispatch(test::random_tensor({kB, kS0, kHq, kD}, kDtype, 41), me);
  const Tensor k = layout.dispatch(test::random_tensor({kB, kS0, kHkv, kD}, kDtype, 42), me);
  const Tensor v = layout.dispatch(test::random_tensor({kB, kS0, kHkv, kD}, kDtype, 43), me);
  const Tensor qd = q.to_device(dev), kd = k.to_device(dev), vd = v.to_device(dev);
  for (int64_t anchor : {int64_t(-1), int64_t(17), int64_t(0)}) {
    const std::string where = "rank " + std::to_string(me) + " of " + std::to_string(P) +
                              ", anchor " + std::to_string(anchor);
    g.reset_counters();
    const Partial res = star_prefill(g, qd, kd, vd, spec, layout, anchor);
    DATTN_CUDA_CHECK(cudaDeviceSynchronize());
    const uint64_t sent = g.counters().data_bytes();
    ASSERT_EQ(res.out.device(), dev) << where;
    const Partial got = to_host(res);
    h.reset_counters();
    const Partial want = star_prefill(h, q, k, v, spec, layout, anchor);
    EXPECT_TRUE(test::matches_reference(got.out.ptr<float>(), got.lse.ptr<float>(), kB,
                                        layout.local_len(me), kHq, kD, as_reference(want),
                                        kGpuTolerance))
        << where << " (GPU vs CPU backend)";
    EXPECT_EQ(sent, star_prefill_send_bytes(layout, spec, kB, kDtype, anchor, me)) << where;
    EXPECT_EQ(sent, h.counters().data_bytes()) << where;
  }
}

// Phase 2: a device cache prefilled from phase 1's shards, then steps of 1 and 3 query tokens
// (the query rank's q read only there): the query rank's result against the CPU backend's, the
// other ranks' empty, and the bytes of the model.
TEST_F(GpuStar, DecodeStepsMatchCpuBackendAndByteModel) {
  Runtime& g = gpu();
  Runtime& h = cpu();
  const int P = g.cp_size(), me = g.cp_rank(), last = P - 1;
  const Device dev = g.device();
  const AttnSpec spec = make_spec();
  const Layout layout = Layout::blocks(kS0, P, kBlock);
  for (int64_t s_q : {int64_t(1), int64_t(3)}) {
    const int64_t steps = 3, total = kS0 + steps * s_q;
    const Tensor ks = test::random_tensor({kB, total, kHkv, kD}, kDtype, 51);
    const Tensor vs = test::random_tensor({kB, total, kHkv, kD}, kDtype, 52);
    KvCache gcache(P, me, spec, kB, kDtype, total, Placement::last_rank, dev);
    KvCache hcache(P, me, spec, kB, kDtype, total, Placement::last_rank);
    const Tensor k0 = layout.dispatch(ks.seq_slice(0, kS0), me);
    const Tensor v0 = layout.dispatch(vs.seq_slice(0, kS0), me);
    gcache.prefill(k0.to_device(dev), v0.to_device(dev), layout);
    hcache.prefill(k0, v0, layout);
    for (int64_t step = 0; step < steps; ++step) {
      const int64_t at = gcache.length();
      gcache.append(ks.seq_slice(at, s_q), vs.seq_slice(at, s_q));
      hcache.append(ks.seq_slice(at, s_q), vs.seq_slice(at, s_q));
      const std::string where = "rank " + std::to_string(me) + " of " + std::to_string(P) +
                                ", S_q " + std::to_string(s_q) + ", length " +
                                std::to_string(gcache.length());
      const Tensor q = test::random_tensor({kB, s_q, kHq, kD}, kDtype, 60 + uint64_t(step));
      // Only the query rank's q is read: the others pass another tensor of the same shape.
      const Tensor q_arg = me == last ? q : test::random_tensor({kB, s_q, kHq, kD}, kDtype, 999);
      g.reset_counters();
      const Partial res = star_decode(g, q_arg.to_device(dev), gcache);
      DATTN_CUDA_CHECK(cudaDeviceSynchronize());
      const uint64_t sent = g.counters().data_bytes();
      h.reset_counters();
      const Partial want = star_decode(h, q_arg, hcache);
      EXPECT_EQ(sent, star_decode_send_bytes(gcache, s_q, me)) << where;
      EXPECT_EQ(sent, h.counters().data_bytes()) << where;
      if (me != last) {
        EXPECT_FALSE(res.out.defined())
            << where << ": a rank other than the query rank got a result";
        continue;
      }
      ASSERT_EQ(res.out.device(), dev) << where;
      const Partial got = to_host(res);
      EXPECT_TRUE(test::matches_reference(got.out.ptr<float>(), got.lse.ptr<float>(), kB, s_q, kHq,
                                          kD, as_reference(want), kGpuTolerance))
          << where << " (GPU vs CPU backend)";
    }
  }
}

// What star rejects on a GPU runtime, before any data moves and on every rank: host tensors, a
// host cache, fp32.
TEST_F(GpuStar, RejectsHostTensorsAndFp32) {
  Runtime& g = gpu();
  const int P = g.cp_size(), me = g.cp_rank();
  const Device dev = g.device();
  const AttnSpec spec = make_spec();
  const Layout layout = Layout::blocks(kS0, P, kBlock);
  const int64_t n = layout.local_len(me);
  const Tensor q = test::random_tensor({kB, n, kHq, kD}, kDtype, 71);
  const Tensor k = test::random_tensor({kB, n, kHkv, kD}, kDtype, 72);
  const Tensor v = test::random_tensor({kB, n, kHkv, kD}, kDtype, 73);
  EXPECT_TRUE(test::throws_naming([&] { (void)star_prefill(g, q, k, v, spec, layout); },
                                  {"q device", "cpu"}));
  const Tensor q32 = q.to(DType::f32).to_device(dev), k32 = k.to(DType::f32).to_device(dev),
               v32 = v.to(DType::f32).to_device(dev);
  EXPECT_TRUE(test::throws_naming([&] { (void)star_prefill(g, q32, k32, v32, spec, layout); },
                                  {"dtype", "fp32"}));

  KvCache hcache(P, me, spec, kB, kDtype, kS0 + 1, Placement::last_rank);
  hcache.prefill(k, v, layout);
  const Tensor one_k = test::random_tensor({kB, 1, kHkv, kD}, kDtype, 74);
  hcache.append(one_k, one_k);
  const Tensor qd = test::random_tensor({kB, 1, kHq, kD}, kDtype, 75).to_device(dev);
  EXPECT_TRUE(
      test::throws_naming([&] { (void)star_decode(g, qd, hcache); }, {"cache device", "cpu"}));
}

}  // namespace
}  // namespace dattn
