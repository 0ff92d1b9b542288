// Multi-rank GPU tests (1-2 ranks, one GPU each) of the distributed MLA decode on cuda tensors:
// mla_decode's head split and TPLA (RoPE replicated or split, logits scaled or not, causal and
// window masks) on a GPU Runtime (NCCL, the CUDA absorption, decode and projection kernels)
// against the CPU backend on the same ranks and inputs, with the bytes of mla_decode_send_bytes;
// and what the GPU path refuses, on every rank.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <memory>
#include <string>

#include "src/base/cuda_check.h"
#include "src/base/error.h"
#include "src/mla.h"
#include "tests/gpu/one_gpu_per_rank.h"
#include "tests/gpu/suite_runtimes.h"
#include "tests/test_reference.h"

namespace dattn {
namespace {

// One GPU per rank, or every rank skips together (tests/gpu/one_gpu_per_rank.h).
testing::Environment* const one_gpu_per_rank =
    testing::AddGlobalTestEnvironment(new test::OneGpuPerRank);

// Small enough to check every element, divisible by 2 ranks everywhere it must be.
MlaConfig make_config() {
  MlaConfig cfg;
  cfg.heads = 4;
  cfg.latent = 64;
  cfg.rope = 16;
  cfg.qk_nope = 32;
  cfg.v_head = 24;
  return cfg;
}
constexpr int64_t kB = 2, kS = 37;

// fp32 on both sides, summed in other orders: a few ulps of the values' scale.
testing::AssertionResult close(const Tensor& got, const Tensor& want) {
  if (got.numel() != want.numel())
    return testing::AssertionFailure() << got.shape_str() << " vs " << want.shape_str();
  for (int64_t i = 0; i < got.numel(); ++i) {
    const float a = got.ptr<float>()[i], b = want.ptr<float>()[i];
    if (!(std::fabs(a - b) <= 1e-4f + 1e-4f * std::fabs(b)))
      return testing::AssertionFailure()
             << "element " << i << ": " << a << " on the GPU, " << b << " on the CPU";
  }
  return testing::AssertionSuccess();
}

// The weights (on the host and on the GPU) and the whole cache, the same on every rank.
struct Inputs {
  MlaConfig cfg = make_config();
  MlaWeights w, wd;
  Tensor c_kv, k_pe;
  explicit Inputs(Device dev) {
    w = MlaWeights::random(cfg, 5);
    wd = {w.w_uk.to_device(dev), w.w_uv.to_device(dev)};
    c_kv = test::random_tensor({kB, kS, cfg.latent}, DType::f32, 6);
    k_pe = test::random_tensor({kB, kS, cfg.rope}, DType::f32, 7);
  }
};

MlaCacheShard on_device(const MlaCacheShard& s, Device dev) {
  MlaCacheShard d = s;
  d.c_kv = s.c_kv.to_device(dev);
  d.k_pe = s.k_pe.to_device(dev);
  return d;
}

// A GPU runtime and a CPU one over the same ranks (tests/gpu/suite_runtimes.h).
class GpuMla : public testing::Test {
 protected:
  static Runtime& gpu() { return test::suite_runtime("gpu", test::on_gpu()); }
  static Runtime& cpu() { return test::suite_runtime("cpu", {}); }
  static void TearDownTestSuite() { test::release_suite_runtimes(); }
};

TEST_F(GpuMla, DecodeMatchesCpuBackendAndByteModel) {
  Runtime& g = gpu();
  Runtime& h = cpu();
  const int P = g.cp_size(), me = g.cp_rank();
  ASSERT_EQ(g.cp().backend(), test::kGpuBackend);
  const Device dev = g.device();
  const Inputs in(dev);
  const MlaConfig& cfg = in.cfg;
  const MlaWeights &w = in.w, &wd = in.wd;
  const Tensor &c_kv = in.c_kv, &k_pe = in.k_pe;

  struct Case {
    MlaParallel parallel;
    TplaOptions opt;
    Mask mask;
  };
  const Case cases[] = {
      {MlaParallel::head_split, {}, Mask::causal()},
      {MlaParallel::head_split, {}, Mask::window(9, 0)},
      {MlaParallel::tpla, {RopePlacement::replicated, false}, Mask::causal()},
      {MlaParallel::tpla, {RopePlacement::split, true}, Mask::causal()},
      {MlaParallel::tpla, {RopePlacement::split, false}, Mask::window(5, 0)},
  };
  for (const Case& c : cases) {
    const MlaCacheShard shard = mla_shard_cache(cfg, c.parallel, c.opt, c_kv, k_pe, me, P);
    const MlaCacheShard shard_d = on_device(shard, dev);
    for (int64_t s_q : {int64_t(1), int64_t(3)}) {
      const std::string where =
          "rank " + std::to_string(me) + " of " + std::to_string(P) + ", " +
          mla_parallel_name(c.parallel) +
          (c.opt.rope == RopePlacement::split ? " rope split" : " rope replicated") +
          (c.opt.scale_logits_by_g ? " scaled" : "") + ", " + c.mask.str() + ", S_q " +
          std::to_string(s_q);
      const Tensor qn = test::random_tensor({kB, s_q, cfg.heads, cfg.qk_nope}, DType::f32, 8);
      const Tensor qp = test::random_tensor({kB, s_q, cfg.heads, cfg.rope}, DType::f32, 9);
      g.reset_counters();
      const Tensor out = mla_decode(g, c.parallel, cfg, wd, qn.to_device(dev), qp.to_device(dev),
                                    shard_d, kS - s_q, c.opt, c.mask);
      DATTN_CUDA_CHECK(cudaDeviceSynchronize());
      const uint64_t sent = g.counters().data_bytes();
      ASSERT_EQ(out.device(), dev) << where;
      h.reset_counters();
      const Tensor want = mla_decode(h, c.parallel, cfg, w, qn, qp, shard, kS - s_q, c.opt, c.mask);
      EXPECT_TRUE(close(out.to_device(Device::cpu()), want)) << where;
      EXPECT_EQ(sent, mla_decode_send_bytes(cfg, c.parallel, kB, s_q, P)) << where;
      EXPECT_EQ(sent, h.counters().data_bytes()) << where;
    }
  }
}

// What the GPU path refuses, before any data moves and on every rank: host tensors on a GPU
// runtime (queries, weights, cache), and document masks; the runtime works afterwards.
TEST_F(GpuMla, RejectsHostTensorsAndDocuments) {
  Runtime& g = gpu();
  const int P = g.cp_size(), me = g.cp_rank();
  const Device dev = g.device();
  const Inputs in(dev);
  const MlaConfig& cfg = in.cfg;
  const MlaWeights &w = in.w, &wd = in.wd;
  const Tensor &c_kv = in.c_kv, &k_pe = in.k_pe;
  const MlaCacheShard shard = mla_shard_cache(cfg, MlaParallel::tpla, {}, c_kv, k_pe, me, P);
  const MlaCacheShard shard_d = on_device(shard, dev);
  const Tensor qn = test::random_tensor({kB, 1, cfg.heads, cfg.qk_nope}, DType::f32, 8);
  const Tensor qp = test::random_tensor({kB, 1, cfg.heads, cfg.rope}, DType::f32, 9);
  const Tensor qn_d = qn.to_device(dev), qp_d = qp.to_device(dev);
  auto run = [&](const MlaWeights& ww, const Tensor& a, const Tensor& b, const MlaCacheShard& s,
                 const Mask& mask) {
    (void)mla_decode(g, MlaParallel::tpla, cfg, ww, a, b, s, kS - 1, {}, mask);
  };
  EXPECT_TRUE(test::throws_naming([&] { run(wd, qn, qp_d, shard_d, Mask::causal()); },
                                  {"q_nope device", "cpu"}));
  EXPECT_TRUE(test::throws_naming([&] { run(w, qn_d, qp_d, shard_d, Mask::causal()); },
                                  {"w_uk device", "cpu"}));
  EXPECT_TRUE(test::throws_naming([&] { run(wd, qn_d, qp_d, shard, Mask::causal()); },
                                  {"cache c_kv device", "cpu"}));
  EXPECT_TRUE(test::throws_naming(
      [&] {
        run(wd, qn_d, qp_d, shard_d, Mask::document({0, 20, kS}, true));
      },
      {"mask", "documents"}));
  EXPECT_NO_THROW(run(wd, qn_d, qp_d, shard_d, Mask::causal()));
  DATTN_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace dattn
