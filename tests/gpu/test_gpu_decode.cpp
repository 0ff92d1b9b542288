// Multi-rank GPU tests (1-2 ranks, one GPU each) of decoding on cuda tensors: the tree, ring and
// allgather decodes through dattn::decode on a GPU Runtime (NCCL cp group, CUDA kernels, device KV
// cache) against the CPU backend's decode on the same ranks and inputs, against the float64
// reference, and with the exact bytes of decode_send_bytes; the two-level tree over declared
// nodes; a Runtime on the caller's stream; and what the GPU decode rejects (host tensors, fp32) on
// every rank.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cpu/reference.h"
#include "src/base/cuda_check.h"
#include "src/base/error.h"
#include "src/decode.h"
#include "tests/gpu/one_gpu_per_rank.h"
#include "tests/gpu/partials.h"
#include "tests/gpu/stream_stats.h"
#include "tests/gpu/suite_runtimes.h"
#include "tests/test_reference.h"

namespace dattn {
namespace {

using test::as_reference;  // tests/gpu/partials.h
using test::to_host;

using test::world_rank;

// One GPU per rank, or every rank skips together (tests/gpu/one_gpu_per_rank.h).
testing::Environment* const one_gpu_per_rank =
    testing::AddGlobalTestEnvironment(new test::OneGpuPerRank);

// ---------------------------------------------------------------- cases

// bf16, GQA (4 query heads per kv head), B = 2, a prompt that divides neither by the ranks nor by
// the zigzag chunks, and a window shorter than a shard.
constexpr int64_t kB = 2, kS0 = 203, kHq = 8, kHkv = 2, kD = 64;
constexpr DType kDtype = DType::bf16;

enum class MaskKind { causal, window };
const char* mask_name(MaskKind m) {
  return m == MaskKind::causal ? "causal" : "window";
}

AttnSpec make_spec(MaskKind m) {
  AttnSpec spec;
  spec.heads_q = kHq;
  spec.heads_kv = kHkv;
  spec.head_dim = kD;
  spec.mask = m == MaskKind::causal ? Mask::causal() : Mask::window(37, 5);
  // A logit softcap on every case; the window's also have attention sinks, joined on the device
  // after the merge.
  spec.softcap = 2.5f;
  if (m == MaskKind::window) spec.sinks = test::sinks_for(kHq);
  return spec;
}

// The CUDA kernel rounds P to bf16 before O += P V (tests/gpu/test_cuda_attention.cpp,
// gpu_tolerance): its error is of the order of a bf16 rounding of out; lse comes from fp32 scores.
const test::Tolerance kGpuTolerance = {1e-2, 1e-2, 1e-4, 1e-4};

struct GpuDecodeCase {
  MaskKind mask;
  int64_t s_q;
};
std::string case_name(const GpuDecodeCase& c) {
  return std::string(mask_name(c.mask)) + "_Sq" + std::to_string(c.s_q);
}
std::ostream& operator<<(std::ostream& os, const GpuDecodeCase& c) {
  return os << case_name(c);
}

// The whole context's K and V (prompt and every token appended later), the same on every rank.
struct Context {
  Tensor k, v;
  explicit Context(int64_t total, uint64_t seed) {
    k = test::random_tensor({kB, total, kHkv, kD}, kDtype, seed);
    v = test::random_tensor({kB, total, kHkv, kD}, kDtype, seed + 1);
  }
};

// A cache on `device` prefilled with the first kS0 tokens of ctx under `layout`; the shards are
// given on `shard_device` (a GPU cache takes host and device shards alike).
KvCache prefilled_cache(const AttnSpec& spec, const Context& ctx, const Layout& layout,
                        int64_t capacity, Device device, Device shard_device) {
  const int P = layout.ranks(), me = world_rank();
  KvCache cache(P, me, spec, kB, kDtype, capacity, Placement::round_robin, device);
  const Tensor k = layout.dispatch(ctx.k.seq_slice(0, kS0), me);
  const Tensor v = layout.dispatch(ctx.v.seq_slice(0, kS0), me);
  cache.prefill(k.to_device(shard_device), v.to_device(shard_device), layout);
  return cache;
}

// Appends the next n tokens of ctx (host tensors: copied up by a GPU cache).
void append_next(KvCache& cache, const Context& ctx, int64_t n) {
  cache.append(ctx.k.seq_slice(cache.length(), n), ctx.v.seq_slice(cache.length(), n));
}

// Whether the GPU cache holds the CPU cache's bytes in its filled rows (the cudaMemcpy2D of
// prefill and append against the CPU's memcpy).
testing::AssertionResult same_cache_rows(const KvCache& gpu, const KvCache& cpu) {
  if (gpu.local_len() != cpu.local_len())
    return testing::AssertionFailure() << "local_len " << gpu.local_len() << " on the GPU, "
                                       << cpu.local_len() << " on the CPU";
  for (auto [g, c, name] : {std::tuple{&gpu.k(), &cpu.k(), "k"}, {&gpu.v(), &cpu.v(), "v"}}) {
    const Tensor host = g->to_device(Device::cpu());
    const size_t row = size_t(host.size(2) * host.size(3)) * dtype_size(host.dtype());
    for (int64_t b = 0; b < kB; ++b) {
      const size_t off = size_t(b * host.size(1)) * row;
      if (std::memcmp(static_cast<const char*>(host.data()) + off,
                      static_cast<const char*>(c->data()) + off,
                      size_t(cpu.local_len()) * row) != 0)
        return testing::AssertionFailure() << "cache " << name << " batch " << b << " differs";
    }
  }
  return testing::AssertionSuccess();
}

// Every rank holds the same bytes as rank 0 (each rank would otherwise sample its own token).
testing::AssertionResult same_on_every_rank(const Tensor& host) {
  std::vector<char> mine(host.nbytes()), root;
  std::memcpy(mine.data(), host.data(), host.nbytes());
  root = mine;
  MPI_Bcast(root.data(), int(root.size()), MPI_BYTE, 0, MPI_COMM_WORLD);
  if (std::memcmp(mine.data(), root.data(), mine.size()) != 0)
    return testing::AssertionFailure() << "rank " << world_rank() << " differs from rank 0";
  return testing::AssertionSuccess();
}

// ---------------------------------------------------------------- the suite

class GpuDecode : public testing::TestWithParam<GpuDecodeCase> {
 protected:
  // GPU runtimes (flat, and with declared nodes of one rank) and a CPU one over the same ranks
  // (tests/gpu/suite_runtimes.h).
  static Runtime& gpu() { return test::suite_runtime("gpu", test::on_gpu()); }
  static Runtime& gpu_nodes() {
    RuntimeOptions o;
    o.node_size = 1;
    return test::suite_runtime("gpu nodes", test::on_gpu(o));
  }
  static Runtime& cpu() { return test::suite_runtime("cpu", {}); }
  static void TearDownTestSuite() { test::release_suite_runtimes(); }
};

// A zigzag-prefilled cache (device shards), then steps that append S_q host tokens and decode
// them with every strategy on the GPU and on the CPU backend: out and lse against both, the same
// on every rank, and the bytes exactly the model's and the CPU backend's.
TEST_P(GpuDecode, MatchesCpuBackendReferenceAndByteModel) {
  const GpuDecodeCase& c = GetParam();
  Runtime& g = gpu();
  Runtime& h = cpu();
  const int P = g.cp_size(), me = g.cp_rank();
  const Device dev = g.device();
  ASSERT_EQ(dev, Device::cuda(test::OneGpuPerRank::device()));
  ASSERT_EQ(g.cp().backend(), test::kGpuBackend);
  const AttnSpec spec = make_spec(c.mask);
  const int64_t steps = 3, total = kS0 + steps * c.s_q;
  const Context ctx(total, 811);
  const Layout layout = Layout::zigzag(kS0, P);
  KvCache gcache = prefilled_cache(spec, ctx, layout, total, dev, dev);
  KvCache hcache = prefilled_cache(spec, ctx, layout, total, Device::cpu(), Device::cpu());
  ASSERT_EQ(gcache.device(), dev);
  ASSERT_TRUE(same_cache_rows(gcache, hcache)) << "after prefill";

  for (int64_t step = 0; step < steps; ++step) {
    append_next(gcache, ctx, c.s_q);
    append_next(hcache, ctx, c.s_q);
    ASSERT_TRUE(same_cache_rows(gcache, hcache)) << "after append " << step;
    const int64_t len = gcache.length();
    const Tensor q = test::random_tensor({kB, c.s_q, kHq, kD}, kDtype, 900 + uint64_t(step));
    const cpu::ReferenceResult ref = cpu::attention_reference(
        q, ctx.k.seq_slice(0, len), ctx.v.seq_slice(0, len), spec, len - c.s_q, 0);
    for (DecodeStrategy s :
         {DecodeStrategy::tree, DecodeStrategy::ring, DecodeStrategy::allgather}) {
      const std::string where = "rank " + std::to_string(me) + " of " + std::to_string(P) + ", " +
                                strategy_name(s) + ", " + spec.mask.str() + ", S_q " +
                                std::to_string(c.s_q) + ", length " + std::to_string(len);
      g.reset_counters();
      const Partial res = decode(g, q.to_device(dev), gcache, s);
      DATTN_CUDA_CHECK(cudaDeviceSynchronize());
      const uint64_t sent = g.counters().data_bytes();
      ASSERT_EQ(res.out.device(), dev);
      ASSERT_EQ(res.lse.device(), dev);
      const Partial got = to_host(res);

      h.reset_counters();
      const Partial want = decode(h, q, hcache, s);
      const uint64_t sent_cpu = h.counters().data_bytes();

      EXPECT_TRUE(test::matches_reference(got.out.ptr<float>(), got.lse.ptr<float>(), kB, c.s_q,
                                          kHq, kD, ref, kGpuTolerance))
          << where;
      EXPECT_TRUE(test::matches_reference(got.out.ptr<float>(), got.lse.ptr<float>(), kB, c.s_q,
                                          kHq, kD, as_reference(want), kGpuTolerance))
          << where << " (GPU vs CPU backend)";
      EXPECT_TRUE(same_on_every_rank(got.out)) << where << " out";
      EXPECT_TRUE(same_on_every_rank(got.lse)) << where << " lse";
      EXPECT_EQ(sent, decode_send_bytes(s, gcache, c.s_q, 0, me)) << where;
      EXPECT_EQ(sent, sent_cpu) << where;
      if (HasFailure()) return;
    }
  }
}

// The two-level tree with declared nodes of one rank (reduce in the node, allreduce across the
// leaders, broadcast), over the node groups split from the NCCL cp group: the flat tree's result
// up to summation order, and the model's bytes. With one rank it is the flat tree.
TEST_P(GpuDecode, TwoLevelTreeMatchesFlatTree) {
  const GpuDecodeCase& c = GetParam();
  Runtime& g = gpu();
  Runtime& n = gpu_nodes();
  const int P = g.cp_size(), me = g.cp_rank();
  EXPECT_EQ(n.spans_nodes(), P > 1);
  const Device dev = g.device();
  const AttnSpec spec = make_spec(c.mask);
  const int64_t total = kS0 + c.s_q;
  const Context ctx(total, 821);
  const Layout layout = Layout::zigzag(kS0, P);
  KvCache cache = prefilled_cache(spec, ctx, layout, total, dev, Device::cpu());
  append_next(cache, ctx, c.s_q);
  const Tensor q = test::random_tensor({kB, c.s_q, kHq, kD}, kDtype, 822).to_device(dev);

  const Partial flat = to_host(decode(g, q, cache, DecodeStrategy::tree));
  n.reset_counters();
  const Partial res = decode(n, q, cache, DecodeStrategy::tree);
  DATTN_CUDA_CHECK(cudaDeviceSynchronize());
  const uint64_t sent = n.counters().data_bytes();
  const Partial two = to_host(res);
  EXPECT_TRUE(test::matches_reference(two.out.ptr<float>(), two.lse.ptr<float>(), kB, c.s_q, kHq,
                                      kD, as_reference(flat), {1e-5, 1e-5, 1e-5, 1e-5}))
      << "rank " << me << " of " << P;
  EXPECT_EQ(sent, decode_send_bytes(DecodeStrategy::tree, cache, c.s_q, 1, me))
      << "rank " << me << " of " << P;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, GpuDecode,
    testing::Values(GpuDecodeCase{MaskKind::causal, 1}, GpuDecodeCase{MaskKind::causal, 3},
                    GpuDecodeCase{MaskKind::window, 1}, GpuDecodeCase{MaskKind::window, 3}),
    [](const testing::TestParamInfo<GpuDecodeCase>& info) { return case_name(info.param); });

// What the GPU decode rejects, before any data moves and on every rank: a host q or a host cache
// on a GPU runtime, fp32; and the non-finite check copies device tensors to the host to scan
// them.
TEST_F(GpuDecode, RejectsWhatTheGpuPathDoesNotRun) {
  Runtime& g = gpu();
  const int P = g.cp_size(), me = g.cp_rank();
  const Device dev = g.device();
  const AttnSpec spec = make_spec(MaskKind::causal);
  const int64_t total = kS0 + 1;
  const Context ctx(total, 831);
  const Layout layout = Layout::contiguous(kS0, P);
  KvCache gcache = prefilled_cache(spec, ctx, layout, total, dev, Device::cpu());
  KvCache hcache = prefilled_cache(spec, ctx, layout, total, Device::cpu(), Device::cpu());
  append_next(gcache, ctx, 1);
  append_next(hcache, ctx, 1);
  const Tensor qh = test::random_tensor({kB, 1, kHq, kD}, kDtype, 832);
  const Tensor qd = qh.to_device(dev);

  EXPECT_TRUE(test::throws_naming([&] { (void)decode(g, qh, gcache, DecodeStrategy::tree); },
                                  {"q device", "cpu"}));
  EXPECT_TRUE(test::throws_naming([&] { (void)decode(g, qd, hcache, DecodeStrategy::tree); },
                                  {"cache device", "cpu"}));
  {
    KvCache c32(P, me, spec, kB, DType::f32, total, Placement::round_robin, dev);
    c32.prefill(layout.dispatch(ctx.k.seq_slice(0, kS0).to(DType::f32), me),
                layout.dispatch(ctx.v.seq_slice(0, kS0).to(DType::f32), me), layout);
    const Tensor q32 = qh.to(DType::f32).to_device(dev);
    EXPECT_TRUE(test::throws_naming([&] { (void)decode(g, q32, c32, DecodeStrategy::tree); },
                                    {"dtype", "fp32"}));
  }

  // The non-finite check on a device cache: a NaN in rank 0's cache, named on every rank.
  RuntimeOptions o;
  o.device = dev;
  o.check_finite = true;
  Runtime checked = Runtime::from_mpi(MPI_COMM_WORLD, o);
  {
    Context bad(total, 831);
    if (me == 0) bad.k.set(3, NAN);  // batch 0, position 0 (rank 0's first row), head 0, dim 3
    KvCache cache = prefilled_cache(spec, bad, layout, total, dev, Device::cpu());
    append_next(cache, bad, 1);
    EXPECT_TRUE(test::throws_naming([&] { (void)decode(checked, qd, cache, DecodeStrategy::tree); },
                                    {"invalid cache k = nan", "position 0"}));
  }
  // And the runtimes still work afterwards.
  const Partial res = decode(checked, qd, gcache, DecodeStrategy::tree);
  const Partial again = decode(g, qd, gcache, DecodeStrategy::tree);
  DATTN_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(res.out.device(), dev);
  EXPECT_EQ(again.lse.device(), dev);
}

// A Runtime on a stream of the caller's, its cache made, prefilled and appended to under
// StreamScope(rt.stream()) (src/decode.h): every decode strategy gives the default stream's result
// bit for bit once the stream is synchronised; in the emulation all the device work of the cache
// and the decodes went to that stream, none to the legacy default stream, with no host wait.
TEST_F(GpuDecode, RunsOnTheCallersStream) {
  cudaStream_t stream = nullptr;
  DATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  RuntimeOptions o = test::on_gpu();
  o.stream = stream;
  Runtime& g = gpu();
  auto on_stream = std::make_unique<Runtime>(Runtime::from_mpi(MPI_COMM_WORLD, o));
  Runtime& s = *on_stream;
  const int P = s.cp_size();
  const Device dev = s.device();
  const AttnSpec spec = make_spec(MaskKind::window);  // sinks and softcap too
  const int64_t s_q = 2, total = kS0 + s_q;
  const Context ctx(total, 831);
  const Layout layout = Layout::zigzag(kS0, P);
  const Tensor q = test::random_tensor({kB, s_q, kHq, kD}, kDtype, 832).to_device(dev);
  KvCache want_cache = prefilled_cache(spec, ctx, layout, total, dev, Device::cpu());
  append_next(want_cache, ctx, s_q);
  DATTN_CUDA_CHECK(cudaDeviceSynchronize());  // q and the reference cache: on the legacy stream
  {
    test::reset_stream_work();
    StreamScope scope(s.stream());
    KvCache cache = prefilled_cache(spec, ctx, layout, total, dev, Device::cpu());
    append_next(cache, ctx, s_q);
    std::vector<Partial> got;
    for (DecodeStrategy st :
         {DecodeStrategy::tree, DecodeStrategy::ring, DecodeStrategy::allgather})
      got.push_back(decode(s, q, cache, st));
    EXPECT_TRUE(test::only_on_stream(stream));
    DATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
    size_t i = 0;
    for (DecodeStrategy st :
         {DecodeStrategy::tree, DecodeStrategy::ring, DecodeStrategy::allgather}) {
      const Partial a = to_host(got[i++]);
      const Partial b = to_host(decode(g, q, want_cache, st));
      EXPECT_EQ(std::memcmp(a.out.data(), b.out.data(), b.out.nbytes()), 0) << strategy_name(st);
      EXPECT_EQ(std::memcmp(a.lse.data(), b.lse.data(), b.lse.nbytes()), 0) << strategy_name(st);
    }
    got.clear();
  }  // the cache and results freed on the stream, before it goes
  DATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  on_stream.reset();
  DATTN_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace dattn
