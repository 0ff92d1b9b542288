// Multi-rank GPU tests (1-2 ranks, one GPU each) of the library on cuda tensors: ring attention
// through dattn::attention on a GPU Runtime (NCCL cp group, CUDA kernels), against the CPU
// backend on the same inputs and ranks and against the float64 reference, with exact byte counts.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/reference.h"
#include "kernels/cuda/check.h"
#include "src/attention.h"
#include "src/error.h"
#include "src/models.h"
#include "tests/test_reference.h"

namespace dattn {
namespace {

using test::world_rank;
using test::world_size;

// ---------------------------------------------------------------- one GPU per rank, or skip
// As tests/gpu/test_nccl.cpp decides: every rank checks that CUDA sees a device for each rank on
// its node, and the ranks agree before anyone decides, so that all skip (exit 77, rank 0 prints
// the reason) or all run. DATTN_GPU_TESTS_REQUIRED=1 turns "no usable GPU at all" into a failure,
// but not "fewer devices than ranks" (a one-GPU machine running gpu_ring_np2 is not broken).
int g_device = 0;  // this rank's GPU: its node-local rank

class OneGpuPerRank : public testing::Environment {
 public:
  void SetUp() override {
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    int local_rank = 0, local_size = 1;
    MPI_Comm_rank(node, &local_rank);
    MPI_Comm_size(node, &local_size);
    MPI_Comm_free(&node);
    const int rank = world_rank(), size = world_size();
    g_device = local_rank;

    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    char reason[256] = {};
    if (err != cudaSuccess)
      std::snprintf(reason, sizeof reason, "no usable GPU: cudaGetDeviceCount returned %d (%s: %s)",
                    int(err), cudaGetErrorName(err), cudaGetErrorString(err));
    else if (count < local_size)
      std::snprintf(reason, sizeof reason,
                    "CUDA sees %d device(s), but %d ranks run on this node (one device per rank)",
                    count, local_size);
    else if (cudaSetDevice(local_rank) != cudaSuccess)
      std::snprintf(reason, sizeof reason, "cudaSetDevice(%d) failed", local_rank);
    std::vector<char> reasons(rank == 0 ? sizeof reason * size_t(size) : 1);
    MPI_Gather(reason, sizeof reason, MPI_CHAR, reasons.data(), sizeof reason, MPI_CHAR, 0,
               MPI_COMM_WORLD);
    // [0]: this rank can run; [1]: this rank has no usable GPU at all.
    int mine[2] = {reason[0] == '\0' ? 1 : 0, (err != cudaSuccess || count == 0) ? 1 : 0};
    int all[2] = {0, 0};
    MPI_Allreduce(&mine[0], &all[0], 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(&mine[1], &all[1], 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (all[0]) return;

    const char* required = std::getenv("DATTN_GPU_TESTS_REQUIRED");
    const bool must = all[1] && required != nullptr && std::strcmp(required, "1") == 0;
    if (rank == 0) {
      for (int r = 0; r < size; ++r) {
        const char* why = reasons.data() + sizeof reason * size_t(r);
        if (*why == '\0') continue;
        std::printf("%s: rank %d: %s\n", must ? "FAILED" : "SKIPPED", r, why);
        break;
      }
      std::fflush(stdout);
    }
    // Together, past every collective: no rank is left waiting.
    MPI_Finalize();
    std::exit(must ? 1 : 77);
  }
};

testing::Environment* const one_gpu_per_rank = testing::AddGlobalTestEnvironment(new OneGpuPerRank);

// ---------------------------------------------------------------- cases

enum class LayoutKind { contiguous, zigzag, striped };
enum class MaskKind { none, causal, window };

const char* layout_name(LayoutKind l) {
  return l == LayoutKind::contiguous ? "contiguous"
         : l == LayoutKind::zigzag   ? "zigzag"
                                     : "striped";
}
const char* mask_name(MaskKind m) {
  return m == MaskKind::none ? "none" : m == MaskKind::causal ? "causal" : "window";
}

// bf16, GQA (4 query heads per kv head), B = 2, a length that divides neither by the ranks nor
// by the zigzag chunks (padding and uneven shards), and a window shorter than a shard.
constexpr int64_t kB = 2, kS = 203, kHq = 8, kHkv = 2, kD = 64;
constexpr DType kDtype = DType::bf16;

AttnSpec make_spec(MaskKind m) {
  AttnSpec spec;
  spec.heads_q = kHq;
  spec.heads_kv = kHkv;
  spec.head_dim = kD;
  spec.mask = m == MaskKind::none     ? Mask::none()
              : m == MaskKind::causal ? Mask::causal()
                                      : Mask::window(37, 5);
  return spec;
}

Layout make_layout(LayoutKind l, int P) {
  switch (l) {
    case LayoutKind::contiguous:
      return Layout::contiguous(kS, P);
    case LayoutKind::zigzag:
      return Layout::zigzag(kS, P);
    case LayoutKind::striped:
      return Layout::striped(kS, P, 4);
  }
  return Layout();
}

// The CUDA kernel rounds P to bf16 before O += P V (tests/gpu/test_cuda_attention.cpp,
// gpu_tolerance): its error is of the order of a bf16 rounding of out; lse comes from fp32 scores.
const test::Tolerance kGpuTolerance = {1e-2, 1e-2, 1e-4, 1e-4};

struct GpuRingCase {
  LayoutKind layout;
  MaskKind mask;
};
std::string case_name(const GpuRingCase& c) {
  return std::string(layout_name(c.layout)) + "_" + mask_name(c.mask);
}
std::ostream& operator<<(std::ostream& os, const GpuRingCase& c) {
  return os << case_name(c);
}

// A partial's values as a "reference" (float64), to compare the GPU result with the CPU one.
cpu::ReferenceResult as_reference(const Partial& p) {
  cpu::ReferenceResult r;
  r.out.assign(p.out.ptr<float>(), p.out.ptr<float>() + p.out.numel());
  r.lse.assign(p.lse.ptr<float>(), p.lse.ptr<float>() + p.lse.numel());
  return r;
}

Partial to_host(const Partial& p) {
  return {p.out.to_device(Device::cpu()), p.lse.to_device(Device::cpu())};
}

// ---------------------------------------------------------------- the suite

class GpuRing : public testing::TestWithParam<GpuRingCase> {
 protected:
  // A GPU runtime and a CPU one over the same ranks, kept for the suite (NCCL setup is slow) and
  // released before MPI_Finalize.
  static Runtime& gpu() {
    if (!gpu_) {
      RuntimeOptions o;
      o.device = Device::cuda(g_device);
      gpu_ = std::make_unique<Runtime>(Runtime::from_mpi(MPI_COMM_WORLD, o));
    }
    return *gpu_;
  }
  static Runtime& cpu() {
    if (!cpu_) cpu_ = std::make_unique<Runtime>(Runtime::from_mpi(MPI_COMM_WORLD, {}));
    return *cpu_;
  }
  static void TearDownTestSuite() {
    gpu_.reset();
    cpu_.reset();
  }

 private:
  static std::unique_ptr<Runtime> gpu_, cpu_;
};
std::unique_ptr<Runtime> GpuRing::gpu_, GpuRing::cpu_;

TEST_P(GpuRing, MatchesCpuBackendReferenceAndByteModel) {
  const GpuRingCase& c = GetParam();
  Runtime& g = gpu();
  Runtime& h = cpu();
  const int P = g.cp_size(), me = g.cp_rank();
  ASSERT_EQ(g.device(), Device::cuda(g_device));
  ASSERT_EQ(g.cp().backend(), "nccl");
  const Layout layout = make_layout(c.layout, P);
  const AttnSpec spec = make_spec(c.mask);
  const int64_t Sl = layout.local_len(me);

  // The same global tensors on every rank; each rank takes its shard on the host, then the GPU.
  const Tensor q = test::random_tensor({kB, kS, kHq, kD}, kDtype, 701);
  const Tensor k = test::random_tensor({kB, kS, kHkv, kD}, kDtype, 702);
  const Tensor v = test::random_tensor({kB, kS, kHkv, kD}, kDtype, 703);
  const Tensor qh = layout.dispatch(q, me), kh = layout.dispatch(k, me),
               vh = layout.dispatch(v, me);
  const Device dev = g.device();
  const Tensor qd = qh.to_device(dev), kd = kh.to_device(dev), vd = vh.to_device(dev);

  g.reset_counters();
  const Partial res = attention(g, qd, kd, vd, spec, layout, Strategy::ring);
  DATTN_CUDA_CHECK(cudaDeviceSynchronize());
  const ByteCounters counted = g.counters();
  ASSERT_EQ(res.out.device(), dev);
  ASSERT_EQ(res.lse.device(), dev);
  const Partial got = to_host(res);

  h.reset_counters();
  const Partial want = attention(h, qh, kh, vh, spec, layout, Strategy::ring);
  const ByteCounters counted_cpu = h.counters();

  const std::string where = "rank " + std::to_string(me) + " of " + std::to_string(P) + ", " +
                            layout.str() + ", " + spec.mask.str();
  // Against the float64 reference of the whole sequence.
  const cpu::ReferenceResult ref = cpu::attention_reference(q, k, v, spec);
  EXPECT_TRUE(test::matches_reference(
      got.out.ptr<float>(), got.lse.ptr<float>(), kB, Sl, kHq, kD, ref, kS,
      [&](int64_t s) { return layout.global_position(me, s); }, kGpuTolerance))
      << where;
  // Against the CPU backend on the same shards (empty rows must agree exactly).
  EXPECT_TRUE(test::matches_reference(got.out.ptr<float>(), got.lse.ptr<float>(), kB, Sl, kHq, kD,
                                      as_reference(want), kGpuTolerance))
      << where << " (GPU vs CPU backend)";

  // Bytes: exactly the model, as on the CPU, and the same as the CPU backend sent.
  const uint64_t sent = counted.bytes("send") + counted.bytes("alltoall");
  EXPECT_EQ(sent, attention_send_bytes(Strategy::ring, layout, spec, kB, kDtype, 1, me)) << where;
  EXPECT_EQ(sent, counted_cpu.bytes("send") + counted_cpu.bytes("alltoall")) << where;
  EXPECT_EQ(counted.bytes("alltoall"), 0u) << where;
}

std::vector<GpuRingCase> gpu_ring_cases() {
  std::vector<GpuRingCase> cs;
  for (LayoutKind l : {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped})
    for (MaskKind m : {MaskKind::none, MaskKind::causal, MaskKind::window})
      cs.push_back({l, m});
  return cs;
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuRing, testing::ValuesIn(gpu_ring_cases()),
                         [](const testing::TestParamInfo<GpuRingCase>& info) {
                           return case_name(info.param);
                         });

// What the GPU path rejects, before any data moves and on every rank: another strategy, host
// tensors on a GPU runtime, fp32; and the non-finite check copies device tensors to the host.
TEST_F(GpuRing, RejectsWhatTheGpuPathDoesNotRun) {
  Runtime& g = gpu();
  const int P = g.cp_size(), me = g.cp_rank();
  const Layout layout = Layout::contiguous(64 * P, P);
  AttnSpec spec = make_spec(MaskKind::causal);
  spec.heads_kv = kHkv * P;  // divisible for ulysses, so that only the device rule is violated
  spec.heads_q = kHq * P;
  const Tensor qh = test::random_tensor({1, 64, spec.heads_q, kD}, kDtype, 11);
  const Tensor kh = test::random_tensor({1, 64, spec.heads_kv, kD}, kDtype, 12);
  const Tensor vh = test::random_tensor({1, 64, spec.heads_kv, kD}, kDtype, 13);
  const Device dev = g.device();
  const Tensor qd = qh.to_device(dev), kd = kh.to_device(dev), vd = vh.to_device(dev);

  EXPECT_TRUE(
      test::throws_naming([&] { (void)attention(g, qd, kd, vd, spec, layout, Strategy::ulysses); },
                          {"strategy", "ulysses", "not supported yet"}));
  EXPECT_TRUE(test::throws_naming(
      [&] { (void)attention(g, qh, kd, vd, spec, layout, Strategy::ring); }, {"q device", "cpu"}));
  const Tensor q32 = qh.to(DType::f32).to_device(dev), k32 = kh.to(DType::f32).to_device(dev),
               v32 = vh.to(DType::f32).to_device(dev);
  EXPECT_TRUE(test::throws_naming(
      [&] { (void)attention(g, q32, k32, v32, spec, layout, Strategy::ring); }, {"dtype", "fp32"}));

  // The non-finite check on device tensors: a NaN in rank 0's k, named on every rank.
  RuntimeOptions o;
  o.device = dev;
  o.check_finite = true;
  Runtime checked = Runtime::from_mpi(MPI_COMM_WORLD, o);
  Tensor kbad = kh;
  if (me == 0) {
    kbad = kh.to(kDtype);  // a copy
    kbad.set(5 * spec.heads_kv * kD + 3, NAN);
  }
  const Tensor kbad_d = kbad.to_device(dev);
  EXPECT_TRUE(test::throws_naming(
      [&] { (void)attention(checked, qd, kbad_d, vd, spec, layout, Strategy::ring); },
      {"invalid k", "position 5"}));
  // And the runtime still works afterwards.
  const Partial res = attention(checked, qd, kd, vd, spec, layout, Strategy::ring);
  DATTN_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(res.out.device(), dev);
}

}  // namespace
}  // namespace dattn
