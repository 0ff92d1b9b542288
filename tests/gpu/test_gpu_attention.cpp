// Multi-rank GPU tests (1-2 ranks, one GPU each) of the library on cuda tensors: ring, Ulysses and
// hybrid attention through dattn::attention on a GPU Runtime (NCCL cp group and its splits, CUDA
// kernels), against the CPU backend on the same inputs and ranks and against the float64
// reference, with exact byte counts.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/reference.h"
#include "src/attention.h"
#include "src/base/cuda_check.h"
#include "src/base/error.h"
#include "src/models.h"
#include "tests/gpu/one_gpu_per_rank.h"
#include "tests/gpu/partials.h"
#include "tests/gpu/stream_stats.h"
#include "tests/gpu/suite_runtimes.h"
#include "tests/test_reference.h"
#if DATTN_CUDA_EMULATION
#include "tests/emu/fake_runtime.h"
#endif

namespace dattn {
namespace {

using test::as_reference;  // tests/gpu/partials.h
using test::to_host;

using test::world_rank;
using test::world_size;

// One GPU per rank, or every rank skips together (tests/gpu/one_gpu_per_rank.h).
testing::Environment* const one_gpu_per_rank =
    testing::AddGlobalTestEnvironment(new test::OneGpuPerRank);

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

AttnSpec make_spec(MaskKind m, bool sinks = false, float softcap = 0.f) {
  AttnSpec spec;
  if (sinks) spec.sinks = test::sinks_for(kHq);
  spec.softcap = softcap;
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

// max |got - want| <= rel * max |want| + abs over a gradient (host fp32 tensors, or float64
// values); NaN or inf fails.
testing::AssertionResult grad_close(const char* name, const Tensor& got,
                                    const std::vector<double>& want, double rel, double abs) {
  double max_want = 0, max_err = 0;
  for (double w : want)
    max_want = std::max(max_want, std::fabs(w));
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = got.get(int64_t(i));
    if (!std::isfinite(g)) return testing::AssertionFailure() << name << "[" << i << "] = " << g;
    max_err = std::max(max_err, std::fabs(g - want[i]));
  }
  if (max_err <= rel * max_want + abs) return testing::AssertionSuccess();
  return testing::AssertionFailure() << name << ": max |err| " << max_err << " > " << rel
                                     << " * max |want| " << max_want << " + " << abs;
}
std::vector<double> values(const Tensor& t) {
  std::vector<double> v(size_t(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i)
    v[size_t(i)] = t.get(i);
  return v;
}

struct GpuAttentionCase {
  Strategy strategy;
  LayoutKind layout;
  MaskKind mask;
  bool sinks = false;   // attention sinks, joined on the device (movement::cuda::add_sinks)
  float softcap = 0.f;  // logit softcap, in the kernels
};
std::string case_name(const GpuAttentionCase& c) {
  return std::string(strategy_name(c.strategy)) + "_" + layout_name(c.layout) + "_" +
         mask_name(c.mask) + (c.sinks ? "_sinks" : "") + (c.softcap > 0.f ? "_softcap" : "");
}
std::ostream& operator<<(std::ostream& os, const GpuAttentionCase& c) {
  return os << case_name(c);
}

// ---------------------------------------------------------------- the suite

class GpuAttention : public testing::TestWithParam<GpuAttentionCase> {
 protected:
  // A GPU runtime and a CPU one over the same ranks (tests/gpu/suite_runtimes.h). Hybrid groups
  // of 2 where the ranks divide by 2 (ring and ulysses ignore them); one group per rank
  // otherwise, so that hybrid is the ring.
  static RuntimeOptions with_groups(RuntimeOptions o = {}) {
    o.ulysses = test::world_size() % 2 == 0 ? 2 : 1;
    return o;
  }
  static Runtime& gpu() { return test::suite_runtime("gpu", test::on_gpu(with_groups())); }
  static Runtime& cpu() { return test::suite_runtime("cpu", with_groups()); }
  static void TearDownTestSuite() { test::release_suite_runtimes(); }
};

TEST_P(GpuAttention, MatchesCpuBackendReferenceAndByteModel) {
  const GpuAttentionCase& c = GetParam();
  Runtime& g = gpu();
  Runtime& h = cpu();
  const int P = g.cp_size(), me = g.cp_rank();
  ASSERT_EQ(g.device(), Device::cuda(test::OneGpuPerRank::device()));
  ASSERT_EQ(g.cp().backend(), test::kGpuBackend);
  const Layout layout = make_layout(c.layout, P);
  const AttnSpec spec = make_spec(c.mask, c.sinks, c.softcap);
  const int64_t Sl = layout.local_len(me);
  // The Ulysses degree of the strategy (src/attention.cpp, ulysses_degree_of).
  const int U = c.strategy == Strategy::ring      ? 1
                : c.strategy == Strategy::ulysses ? P
                                                  : g.ulysses_degree();

  // The same global tensors on every rank; each rank takes its shard on the host, then the GPU.
  const Tensor q = test::random_tensor({kB, kS, kHq, kD}, kDtype, 701);
  const Tensor k = test::random_tensor({kB, kS, kHkv, kD}, kDtype, 702);
  const Tensor v = test::random_tensor({kB, kS, kHkv, kD}, kDtype, 703);
  const Tensor qh = layout.dispatch(q, me), kh = layout.dispatch(k, me),
               vh = layout.dispatch(v, me);
  const Device dev = g.device();
  const Tensor qd = qh.to_device(dev), kd = kh.to_device(dev), vd = vh.to_device(dev);

  g.reset_counters();
  const Partial res = attention(g, qd, kd, vd, spec, layout, c.strategy);
  DATTN_CUDA_CHECK(cudaDeviceSynchronize());
  const ByteCounters counted = g.counters();
  ASSERT_EQ(res.out.device(), dev);
  ASSERT_EQ(res.lse.device(), dev);
  const Partial got = to_host(res);

  h.reset_counters();
  const Partial want = attention(h, qh, kh, vh, spec, layout, c.strategy);
  const ByteCounters counted_cpu = h.counters();

  const std::string where = "rank " + std::to_string(me) + " of " + std::to_string(P) + ", " +
                            strategy_name(c.strategy) + " U " + std::to_string(U) + ", " +
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
  EXPECT_EQ(sent, attention_send_bytes(c.strategy, layout, spec, kB, kDtype, U, me)) << where;
  EXPECT_EQ(counted.bytes("send"), counted_cpu.bytes("send")) << where;
  EXPECT_EQ(counted.bytes("alltoall"), counted_cpu.bytes("alltoall")) << where;
  if (U == 1) {
    EXPECT_EQ(counted.bytes("alltoall"), 0u) << where;  // the ring sends blocks only
  }
  if (U == P && P > 1) {
    EXPECT_EQ(counted.bytes("send"), 0u) << where;  // no ring of groups
  }

  // The backward on device buffers over the GPU Runtime's groups, from the CPU backend's forward
  // (the same partial on both sides, so that the two differ by their kernels only): against the
  // CPU backend's backward within the CPU backward test's bound of float64 (both kernels are
  // fp32), and exactly its bytes and the model's.
  const Tensor dout = test::random_tensor({kB, kS, kHq, kD}, kDtype, 704);
  const Tensor douth = layout.dispatch(dout, me), doutd = douth.to_device(dev);
  const Partial want_d{want.out.to_device(dev), want.lse.to_device(dev)};
  g.reset_counters();
  const Gradients gd = attention_backward(g, qd, kd, vd, want_d, doutd, spec, layout, c.strategy);
  DATTN_CUDA_CHECK(cudaDeviceSynchronize());
  const ByteCounters counted_b = g.counters();
  h.reset_counters();
  const Gradients gh = attention_backward(h, qh, kh, vh, want, douth, spec, layout, c.strategy);
  const ByteCounters counted_b_cpu = h.counters();
  ASSERT_EQ(gd.dq.device(), dev);
  ASSERT_EQ(gd.dk.device(), dev);
  ASSERT_EQ(gd.dv.device(), dev);
  const Device host = Device::cpu();
  EXPECT_TRUE(grad_close("dq", gd.dq.to_device(host), values(gh.dq), 1e-4, 1e-5)) << where;
  EXPECT_TRUE(grad_close("dk", gd.dk.to_device(host), values(gh.dk), 1e-4, 1e-5)) << where;
  EXPECT_TRUE(grad_close("dv", gd.dv.to_device(host), values(gh.dv), 1e-4, 1e-5)) << where;
  if (c.sinks) {
    ASSERT_TRUE(gd.dsinks.defined() && gd.dsinks.device().is_cpu());
    EXPECT_TRUE(grad_close("dsinks", gd.dsinks, values(gh.dsinks), 1e-5, 1e-6)) << where;
  }
  const uint64_t sent_b =
      counted_b.bytes("send") + counted_b.bytes("alltoall") + counted_b.bytes("allreduce");
  EXPECT_EQ(sent_b, attention_backward_send_bytes(c.strategy, layout, spec, kB, kDtype, U, me))
      << where;
  for (const char* op : {"send", "alltoall", "allreduce"})
    EXPECT_EQ(counted_b.bytes(op), counted_b_cpu.bytes(op)) << where << ", " << op;
}

// Every layout and mask for the ring; Ulysses and hybrid (whose all-to-alls see the layout only
// through the shard lengths) on every mask with the zigzag layout and the uneven contiguous one.
std::vector<GpuAttentionCase> gpu_attention_cases() {
  std::vector<GpuAttentionCase> cs;
  for (LayoutKind l : {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped})
    for (MaskKind m : {MaskKind::none, MaskKind::causal, MaskKind::window})
      cs.push_back({Strategy::ring, l, m});
  for (Strategy s : {Strategy::ulysses, Strategy::hybrid})
    for (LayoutKind l : {LayoutKind::contiguous, LayoutKind::zigzag})
      for (MaskKind m : {MaskKind::none, MaskKind::causal, MaskKind::window})
        cs.push_back({s, l, m});
  for (Strategy s : {Strategy::ring, Strategy::ulysses, Strategy::hybrid})
    cs.push_back({s, LayoutKind::zigzag, MaskKind::window, true, 3.f});
  cs.push_back({Strategy::ring, LayoutKind::contiguous, MaskKind::causal, false, 1.5f});
  return cs;
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuAttention, testing::ValuesIn(gpu_attention_cases()),
                         [](const testing::TestParamInfo<GpuAttentionCase>& info) {
                           return case_name(info.param);
                         });

// What the GPU path rejects, before any data moves and on every rank: host tensors on a GPU
// runtime (forward and backward), fp32; and the non-finite check copies device tensors to the
// host.
TEST_F(GpuAttention, RejectsWhatTheGpuPathDoesNotRun) {
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

  const Partial fwd = attention(g, qd, kd, vd, spec, layout, Strategy::ulysses);
  // The backward with host tensors on a GPU Runtime (its schedules would hand host buffers to
  // NCCL: on hardware a fault on one rank, a hang on the others).
  const Partial fwd_host = to_host(fwd);
  for (Strategy s : {Strategy::ring, Strategy::ulysses})
    EXPECT_TRUE(test::throws_naming(
        [&] { (void)attention_backward(g, qh, kh, vh, fwd_host, fwd_host.out, spec, layout, s); },
        {"q device", "the Runtime's device"}));
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

// attention_local and attention_local_backward on device tensors (one process, no Runtime): the
// CUDA forward against the float64 reference; the CUDA backward from the CPU forward's partial
// against the CPU backward from the same partial (both fp32 kernels, within the CPU backward
// test's bound of float64); and end to end, the device's backward from the device's forward
// against the float64 gradients, within the forward's bf16/fp16 rounding of out (delta is
// rowsum(dout * out); measured at most 4.5e-4 of max |grad| for dq and dk, 1e-6 for dv, which
// delta does not enter). With sinks, dsinks (on the host) too.
TEST_F(GpuAttention, LocalForwardAndBackwardOnDeviceTensors) {
  const Device dev = gpu().device();
  struct Local {
    const char* name;
    Mask mask;
    DType dtype;
    bool sinks;
    int64_t q_pos0;
  };
  const Local cases[] = {
      {"causal", Mask::causal(), DType::bf16, false, 60},
      {"documents", Mask::document({0, 30, 30, 100, 150}, true), DType::f16, false, 0},
      {"window, sinks", Mask::window(40), DType::bf16, true, 60}};
  for (const Local& c : cases) {
    SCOPED_TRACE(c.name);
    AttnSpec spec = make_spec(MaskKind::none);
    spec.mask = c.mask;
    if (c.sinks) spec.sinks = test::sinks_for(spec.heads_q);
    const int64_t B = 2, Sq = 90, Sk = 150, Dv = spec.dim_v();
    const Tensor q = test::random_tensor({B, Sq, spec.heads_q, kD}, c.dtype, 21);
    const Tensor k = test::random_tensor({B, Sk, spec.heads_kv, kD}, c.dtype, 22);
    const Tensor v = test::random_tensor({B, Sk, spec.heads_kv, Dv}, c.dtype, 23);
    const Tensor dout = test::random_tensor({B, Sq, spec.heads_q, Dv}, c.dtype, 24);
    const Tensor qd = q.to_device(dev), kd = k.to_device(dev), vd = v.to_device(dev);
    const Tensor doutd = dout.to_device(dev);

    const Partial fd = attention_local(qd, kd, vd, spec, c.q_pos0);
    ASSERT_EQ(fd.out.device(), dev);
    const Partial fdh = to_host(fd);
    const cpu::ReferenceResult ref = cpu::attention_reference(q, k, v, spec, c.q_pos0);
    EXPECT_TRUE(test::matches_reference(fdh.out.ptr<float>(), fdh.lse.ptr<float>(), B, Sq,
                                        spec.heads_q, Dv, ref, kGpuTolerance));

    const Partial fh = attention_local(q, k, v, spec, c.q_pos0);
    const Gradients gh = attention_local_backward(q, k, v, fh, dout, spec, c.q_pos0);
    const Partial fh_d{fh.out.to_device(dev), fh.lse.to_device(dev)};
    const Gradients gd = attention_local_backward(qd, kd, vd, fh_d, doutd, spec, c.q_pos0);
    ASSERT_EQ(gd.dq.device(), dev);
    ASSERT_EQ(gd.dk.device(), dev);
    ASSERT_EQ(gd.dv.device(), dev);
    EXPECT_TRUE(grad_close("dq", gd.dq.to_device(Device::cpu()), values(gh.dq), 1e-4, 1e-5));
    EXPECT_TRUE(grad_close("dk", gd.dk.to_device(Device::cpu()), values(gh.dk), 1e-4, 1e-5));
    EXPECT_TRUE(grad_close("dv", gd.dv.to_device(Device::cpu()), values(gh.dv), 1e-4, 1e-5));
    if (c.sinks) {
      ASSERT_TRUE(gd.dsinks.defined());
      EXPECT_TRUE(gd.dsinks.device().is_cpu());
      EXPECT_TRUE(grad_close("dsinks", gd.dsinks, values(gh.dsinks), 1e-5, 1e-6));
    }

    const Gradients ge = attention_local_backward(qd, kd, vd, fd, doutd, spec, c.q_pos0);
    const cpu::ReferenceGrads want =
        cpu::attention_backward_reference(q, k, v, dout, spec, c.q_pos0);
    EXPECT_TRUE(grad_close("dq end to end", ge.dq.to_device(Device::cpu()), want.dq, 3e-3, 1e-5));
    EXPECT_TRUE(grad_close("dk end to end", ge.dk.to_device(Device::cpu()), want.dk, 3e-3, 1e-5));
    EXPECT_TRUE(grad_close("dv end to end", ge.dv.to_device(Device::cpu()), want.dv, 3e-3, 1e-5));
    if (c.sinks) {
      EXPECT_TRUE(grad_close("dsinks end to end", ge.dsinks, want.dsinks, 3e-3, 1e-5));
    }
  }
  // Tensors on two devices are named before anything runs.
  const AttnSpec spec = make_spec(MaskKind::causal);
  const Tensor q = test::random_tensor({1, 16, spec.heads_q, kD}, kDtype, 31);
  const Tensor k = test::random_tensor({1, 16, spec.heads_kv, kD}, kDtype, 32);
  const Partial fd = attention_local(q.to_device(dev), k.to_device(dev), k.to_device(dev), spec);
  EXPECT_TRUE(test::throws_naming(
      [&] { (void)attention_local(q.to_device(dev), k, k.to_device(dev), spec); }, {"k device"}));
  EXPECT_TRUE(test::throws_naming(
      [&] {
        (void)attention_local_backward(q.to_device(dev), k.to_device(dev), k.to_device(dev), fd,
                                       test::random_tensor({1, 16, spec.heads_q, kD}, kDtype, 33),
                                       spec);
      },
      {"dout device"}));
}

// dispatch and undispatch on device tensors over a GPU Runtime's cp group: the shard and the
// gathered tensor stay on the device, the bytes exact (undispatch moves them over the host control
// path, since NCCL moves device memory only).
TEST_F(GpuAttention, DispatchAndUndispatchDeviceTensors) {
  Runtime& g = gpu();
  const int P = g.cp_size(), me = g.cp_rank();
  const Device dev = g.device();
  for (const Layout& layout : {Layout::zigzag(kS, P), Layout::striped(kS, P, 4)}) {
    const Tensor q = test::random_tensor({kB, kS, kHq, kD}, kDtype, 801);
    const Tensor shard = layout.dispatch(q.to_device(dev), me);
    ASSERT_EQ(shard.device(), dev);
    const Tensor back = layout.undispatch(g.cp(), shard);
    ASSERT_EQ(back.device(), dev);
    const Tensor host = back.to_device(Device::cpu());
    ASSERT_EQ(host.nbytes(), q.nbytes());
    EXPECT_EQ(std::memcmp(host.data(), q.data(), q.nbytes()), 0) << layout.str();
    const Tensor want = layout.dispatch(q, me).to_device(Device::cpu());
    EXPECT_EQ(std::memcmp(shard.to_device(Device::cpu()).data(), want.data(), want.nbytes()), 0)
        << layout.str();
  }
}

// A Runtime on a stream of the caller's (RuntimeOptions.stream, as PyTorch's current stream is
// handed in): forward and backward, ring and Ulysses, give the default-stream Runtime's results
// bit for bit once the caller synchronises its stream; in the emulation, every device operation
// of the calls went to that stream (none to the legacy default stream) and the host never waited
// for the device. A CPU Runtime refuses a stream, naming it.
TEST_F(GpuAttention, RunsOnTheCallersStream) {
  cudaStream_t stream = nullptr;
  DATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  RuntimeOptions o = test::on_gpu(with_groups());
  o.stream = stream;
  Runtime& g = gpu();
  auto on_stream = std::make_unique<Runtime>(Runtime::from_mpi(MPI_COMM_WORLD, o));
  Runtime& s = *on_stream;
  ASSERT_EQ(s.stream(), static_cast<StreamHandle>(stream));
  const int P = s.cp_size(), me = s.cp_rank();
  const Layout layout = Layout::zigzag(kS, P);
  const AttnSpec spec = make_spec(MaskKind::causal);
  const Device dev = s.device();
  const Tensor qd =
      layout.dispatch(test::random_tensor({kB, kS, kHq, kD}, kDtype, 1001), me).to_device(dev);
  const Tensor kd =
      layout.dispatch(test::random_tensor({kB, kS, kHkv, kD}, kDtype, 1002), me).to_device(dev);
  const Tensor vd =
      layout.dispatch(test::random_tensor({kB, kS, kHkv, kD}, kDtype, 1003), me).to_device(dev);
  const Tensor doutd =
      layout.dispatch(test::random_tensor({kB, kS, kHq, kD}, kDtype, 1004), me).to_device(dev);
  DATTN_CUDA_CHECK(cudaDeviceSynchronize());  // the inputs were written on the legacy stream

  for (Strategy strategy : {Strategy::ring, Strategy::ulysses}) {
    SCOPED_TRACE(strategy_name(strategy));
    test::reset_stream_work();
    const Partial fwd = attention(s, qd, kd, vd, spec, layout, strategy);
    const Gradients grads = attention_backward(s, qd, kd, vd, fwd, doutd, spec, layout, strategy);
    EXPECT_TRUE(test::only_on_stream(stream));
    DATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
    const Partial want = attention(g, qd, kd, vd, spec, layout, strategy);
    const Gradients want_grads =
        attention_backward(g, qd, kd, vd, want, doutd, spec, layout, strategy);
    DATTN_CUDA_CHECK(cudaDeviceSynchronize());
    const auto same = [](const char* name, const Tensor& got, const Tensor& want_t) {
      const Tensor a = got.to_device(Device::cpu()), b = want_t.to_device(Device::cpu());
      EXPECT_EQ(a.nbytes(), b.nbytes()) << name;
      EXPECT_EQ(std::memcmp(a.data(), b.data(), std::min(a.nbytes(), b.nbytes())), 0) << name;
    };
    same("out", fwd.out, want.out);
    same("lse", fwd.lse, want.lse);
    same("dq", grads.dq, want_grads.dq);
    same("dk", grads.dk, want_grads.dk);
    same("dv", grads.dv, want_grads.dv);
  }

  RuntimeOptions cpu_options;
  cpu_options.stream = stream;
  EXPECT_TRUE(test::throws_naming([&] { (void)Runtime::from_mpi(MPI_COMM_WORLD, cpu_options); },
                                  {"stream", "cpu Runtime"}));
  DATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  on_stream.reset();  // before its stream
  DATTN_CUDA_CHECK(cudaStreamDestroy(stream));
}

#if DATTN_CUDA_EMULATION
// A kernel that fails while a ring step's transfers are in flight (injected: the first launch
// check of the call fails on every rank): every rank gets the error, the transfers complete before
// their buffers are freed (the emulated runtime ends the process on a free of memory a transfer
// still uses), and the runtime works afterwards.
TEST_F(GpuAttention, KernelFailureWithTransfersInFlight) {
  Runtime& g = gpu();
  const int P = g.cp_size(), me = g.cp_rank();
  const Layout layout = Layout::zigzag(kS, P);
  const AttnSpec spec = make_spec(MaskKind::causal);
  const Device dev = g.device();
  const Tensor q = test::random_tensor({kB, kS, kHq, kD}, kDtype, 901);
  const Tensor k = test::random_tensor({kB, kS, kHkv, kD}, kDtype, 902);
  const Tensor v = test::random_tensor({kB, kS, kHkv, kD}, kDtype, 903);
  const Tensor qd = layout.dispatch(q, me).to_device(dev),
               kd = layout.dispatch(k, me).to_device(dev),
               vd = layout.dispatch(v, me).to_device(dev);
  emu::inject_launch_failure(0);
  EXPECT_TRUE(
      test::throws_naming([&] { (void)attention(g, qd, kd, vd, spec, layout, Strategy::ring); },
                          {"cudaErrorLaunchFailure", "injected"}));
  const Partial got = to_host(attention(g, qd, kd, vd, spec, layout, Strategy::ring));
  const cpu::ReferenceResult ref = cpu::attention_reference(q, k, v, spec);
  EXPECT_TRUE(test::matches_reference(
      got.out.ptr<float>(), got.lse.ptr<float>(), kB, layout.local_len(me), kHq, kD, ref, kS,
      [&](int64_t s) { return layout.global_position(me, s); }, kGpuTolerance));
}

// A device whose opt-in shared memory per block is an sm_86/89's 99 KiB: the forward at head_dim
// 128 (134 KiB) fails validation on every rank, naming head_dim and the limit, before any data
// moves; head_dim 64 (86 KiB) runs.
TEST_F(GpuAttention, SharedMemoryAboveTheDeviceLimitIsNamed) {
  Runtime& g = gpu();
  const int P = g.cp_size(), me = g.cp_rank();
  const Device dev = g.device();
  const Layout layout = Layout::contiguous(96 * P, P);
  emu::set_max_shared_optin(dev.index, 99 * 1024);
  for (int64_t d : {128, 64}) {
    AttnSpec spec = make_spec(MaskKind::causal);
    spec.head_dim = d;
    const Tensor q = test::random_tensor({1, 96, kHq, d}, kDtype, 11).to_device(dev);
    const Tensor k = test::random_tensor({1, 96, kHkv, d}, kDtype, 12).to_device(dev);
    const Tensor v = test::random_tensor({1, 96, kHkv, d}, kDtype, 13).to_device(dev);
    if (d == 128) {
      EXPECT_TRUE(
          test::throws_naming([&] { (void)attention(g, q, k, v, spec, layout, Strategy::ring); },
                              {"head_dim", "128", "attention forward kernel", "137232 bytes",
                               "101376", "cudaDevAttrMaxSharedMemoryPerBlockOptin"}));
    } else {
      EXPECT_NO_THROW((void)attention(g, q, k, v, spec, layout, Strategy::ring));
    }
  }
  emu::set_max_shared_optin(dev.index, 0);
  (void)me;
}
#endif

}  // namespace
}  // namespace dattn
