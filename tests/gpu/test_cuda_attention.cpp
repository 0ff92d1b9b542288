// GPU tests of the CUDA kernels: dattn::cuda::attention_forward against the float64 reference
// over the CPU kernel's case table (bf16 and fp16 inputs; masks: causal, windows, documents;
// GQA, D != Dv, offsets, strided positions), empty documents, merging, empty rows, validation; and
// dattn::cuda::mla_decode_forward against a float64 absorbed-MLA decode computed here.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/reference.h"
#include "kernels/cuda/attention_cuda.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/mla_decode_cuda.h"
#include "src/base/cuda_check.h"
#include "src/base/error.h"
#include "tests/test_reference.h"

namespace dattn {
namespace {

using cuda::DeviceBuffer;  // kernels/cuda/device_buffer.h

using test::matches_reference;
using test::random_tensor;

// ---------------------------------------------------------------- one kernel problem

enum class MaskKind { none, causal, window, document };

struct GpuCase {
  std::string name;
  int64_t B = 1, Sq = 0, Sk = 0, Hq = 1, Hkv = 1, D = 64, Dv = 0;
  MaskKind mask = MaskKind::none;
  int64_t q_pos0 = 0, k_pos0 = 0;
  float scale = 0.f;              // 0: 1/sqrt(D)
  float q_stddev = 1.f;           // > 1 sharpens the softmax
  int64_t left = -1, right = -1;  // window(left, right)
  std::vector<int64_t> cu = {};   // documents
  bool doc_causal = true;
};

struct Problem {
  Tensor q, k, v;
  AttnSpec spec;
};

Problem make_problem(const GpuCase& c, DType dt, uint64_t seed = 1) {
  Problem p;
  p.spec.heads_q = c.Hq;
  p.spec.heads_kv = c.Hkv;
  p.spec.head_dim = c.D;
  p.spec.head_dim_v = c.Dv;
  p.spec.softmax_scale = c.scale;
  switch (c.mask) {
    case MaskKind::none:
      p.spec.mask = Mask::none();
      break;
    case MaskKind::causal:
      p.spec.mask = Mask::causal();
      break;
    case MaskKind::window:
      p.spec.mask = Mask::window(c.left, c.right);
      break;
    case MaskKind::document:
      p.spec.mask = Mask::document(c.cu, c.doc_causal);
      break;
  }
  const int64_t dv = p.spec.dim_v();
  p.q = random_tensor({c.B, c.Sq, c.Hq, c.D}, dt, seed * 3 + 0, c.q_stddev);
  p.k = random_tensor({c.B, c.Sk, c.Hkv, c.D}, dt, seed * 3 + 1);
  p.v = random_tensor({c.B, c.Sk, c.Hkv, dv}, dt, seed * 3 + 2);
  return p;
}

// The problem's tensors and a running partial on the device.
struct GpuProblem {
  const Problem& p;
  DeviceBuffer q, k, v, out, lse;
  std::unique_ptr<DeviceBuffer> cu;
  std::vector<float> h_out, h_lse;  // host copies of the partial

  explicit GpuProblem(const Problem& pr)
      : p(pr),
        q(pr.q.data(), pr.q.nbytes()),
        k(pr.k.data(), pr.k.nbytes()),
        v(pr.v.data(), pr.v.nbytes()),
        out(size_t(pr.q.size(0) * pr.q.size(1) * pr.spec.heads_q * pr.spec.dim_v()) * 4),
        lse(size_t(pr.q.size(0) * pr.spec.heads_q * pr.q.size(1)) * 4),
        h_out(size_t(pr.q.size(0) * pr.q.size(1) * pr.spec.heads_q * pr.spec.dim_v()), 0.f),
        h_lse(size_t(pr.q.size(0) * pr.spec.heads_q * pr.q.size(1)), -INFINITY) {
    if (pr.spec.mask.documents)
      cu = std::make_unique<DeviceBuffer>(pr.spec.mask.documents->data(),
                                          pr.spec.mask.documents->size() * sizeof(int64_t));
    push();
  }
  // The whole problem as one block (callers change rows and positions).
  cuda::AttentionBlock block() const {
    cuda::AttentionBlock b;
    b.q = q.get();
    b.k = k.get();
    b.v = v.get();
    b.dtype = p.q.dtype();
    b.batch = p.q.size(0);
    b.seq_q = p.q.size(1);
    b.seq_k = p.k.size(1);
    b.heads_q = p.spec.heads_q;
    b.heads_kv = p.spec.heads_kv;
    b.head_dim = p.spec.head_dim;
    b.head_dim_v = p.spec.dim_v();
    b.scale = p.spec.scale();
    cuda::set_mask(b, p.spec.mask, cu ? cu->get<int64_t>() : nullptr);
    return b;
  }
  void push() {
    out.upload(h_out.data());
    lse.upload(h_lse.data());
  }
  void forward(const cuda::AttentionBlock& b) {
    cuda::attention_forward(b, out.get<float>(), lse.get<float>(), nullptr);
    DATTN_CUDA_CHECK(cudaDeviceSynchronize());
    out.download(h_out.data());
    lse.download(h_lse.data());
  }
};

// The GPU kernel rounds P to the input dtype before O += P V (the tensor cores take 16-bit
// operands), as flash attention does; every other step is fp32. Its error is thus of the order of
// a bf16/fp16 rounding of the output, far above the CPU kernel's (fp32 throughout), so these
// tolerances are set from that rounding (2^-8 bf16, 2^-10 fp16 relative); KernelErrorBudget
// below bounds the error by that of a plain same-dtype computation. lse comes from fp32 scores.
test::Tolerance gpu_tolerance(DType dt) {
  if (dt == DType::bf16) return {1e-2, 1e-2, 1e-4, 1e-4};
  return {3e-3, 3e-3, 1e-4, 1e-4};
}

// ---------------------------------------------------------------- the case table

// test_kernel.cpp's kernel_cases (each run in bf16 and fp16), plus windows and documents.
std::vector<GpuCase> gpu_cases() {
  std::vector<GpuCase> cs;
  const MaskKind N = MaskKind::none, C = MaskKind::causal;
  auto add = [&](GpuCase c) { cs.push_back(c); };
  // name, B, Sq, Sk, Hq, Hkv, D, Dv, mask, q_pos0, k_pos0, scale, q_stddev
  add({"S1_D64_causal", 1, 1, 1, 1, 1, 64, 0, C});
  add({"S77_D80_gqa4", 1, 77, 77, 4, 1, 80, 0, N});
  add({"S77_D80_gqa4_causal", 1, 77, 77, 4, 1, 80, 0, C});
  add({"S300_D128_causal", 1, 300, 300, 2, 2, 128, 0, C});
  add({"S300_D128", 1, 300, 300, 2, 2, 128, 0, N});
  add({"S513_D64_gqa2_causal", 1, 513, 513, 2, 1, 64, 0, C});
  add({"S513_D64", 1, 513, 513, 1, 1, 64, 0, N});
  add({"S130_D256_gqa8_causal", 1, 130, 130, 8, 1, 256, 0, C});
  add({"S129_D256_gqa4", 1, 129, 129, 4, 1, 256, 0, N});
  add({"S200_D192_Dv128_causal", 1, 200, 200, 2, 2, 192, 128, C});
  add({"S200_D192_Dv128_gqa2", 1, 200, 200, 2, 1, 192, 128, N});
  add({"S257_D64_Dv32_causal", 1, 257, 257, 2, 2, 64, 32, C});
  add({"S257_D128", 1, 257, 257, 2, 2, 128, 0, N});
  add({"B2_S150_D64_gqa2_causal", 2, 150, 150, 4, 2, 64, 0, C});
  add({"B3_S40_D80", 3, 40, 40, 2, 2, 80, 0, N});
  add({"Sq100_at1000_Sk1100_causal", 1, 100, 1100, 2, 1, 64, 0, C, 1000, 0});
  add({"Sq1_at599_Sk600_gqa8_causal", 1, 1, 600, 8, 1, 128, 0, C, 599, 0});
  add({"Sq260_Sk33_noncausal", 1, 260, 33, 2, 2, 64, 0, N, 0, 0});
  add({"Sq300_Sk200_keys_from150_causal", 1, 300, 200, 2, 1, 64, 0, C, 0, 150});
  add({"Sq130_Sk300_keys_from64_causal", 1, 130, 300, 2, 2, 80, 0, C, 0, 64});
  add({"keys_in_future_causal", 1, 50, 60, 2, 2, 64, 0, C, 0, 100});
  add({"keys_in_future_causal_b", 1, 140, 270, 2, 1, 64, 0, C, 1000, 1140});
  add({"S300_sharp_scale0p3_causal", 1, 300, 300, 2, 2, 64, 0, C, 0, 0, 0.3f, 4.f});
  add({"S300_sharp", 1, 300, 300, 2, 2, 128, 0, N, 0, 0, 0.f, 3.f});
  add({"S256_exact_tiles_causal", 1, 256, 256, 1, 1, 64, 0, C});
  add({"S1100_D64_causal", 1, 1100, 1100, 1, 1, 64, 0, C});
  add({"S1100_D64_gqa4", 1, 1100, 1100, 4, 1, 64, 0, N});
  add({"Sq128_at255_Sk512_causal", 1, 128, 512, 2, 1, 64, 0, C, 255, 0});
  add({"Sq128_at254_Sk512_causal", 1, 128, 512, 2, 1, 64, 0, C, 254, 0});
  add({"Sq129_at256_Sk513_causal", 1, 129, 513, 2, 2, 64, 0, C, 256, 0});
  add({"S260_huge_scores_causal", 1, 260, 260, 2, 1, 64, 0, C, 0, 0, 0.f, 100.f});
  add({"S140_huge_scores", 1, 140, 300, 2, 2, 64, 0, N, 0, 0, 0.f, 100.f});
  // Padded head dims of the generic path: 40 -> 64, 100 -> 128, 160 -> 192, 33 (odd: element
  // loads, no cp.async) -> 64, D != Dv of the square instantiations.
  add({"S150_D40_causal", 1, 150, 150, 2, 1, 40, 0, C});
  add({"S150_D100_gqa2", 1, 150, 150, 2, 1, 100, 0, N});
  add({"S150_D160_causal", 1, 150, 150, 2, 2, 160, 0, C});
  add({"S90_D33_Dv17_causal", 1, 90, 90, 2, 2, 33, 17, C});
  add({"S150_D48_Dv96", 1, 150, 150, 2, 1, 48, 96, N});
  // Windows (causal sliding, two-sided) straddling the 64- and 32-key tiles.
  GpuCase w{"S400_window100_D128", 1, 400, 400, 4, 2, 128, 0, MaskKind::window};
  w.left = 100;
  w.right = 0;
  add(w);
  w = {"S300_window37_20_D64", 1, 300, 300, 2, 2, 64, 0, MaskKind::window};
  w.left = 37;
  w.right = 20;
  add(w);
  w = {"S200_window50_D256", 1, 200, 200, 2, 1, 256, 0, MaskKind::window, 0, 0};
  w.left = 50;
  w.right = 0;
  add(w);
  // Documents (varlen packing), causal and not, one of length 1, boundaries inside tiles.
  GpuCase d{"S300_docs_causal_D64", 1, 300, 300, 4, 2, 64, 0, MaskKind::document};
  d.cu = {0, 50, 170, 171, 300};
  add(d);
  d.name = "S300_docs_noncausal_D80";
  d.D = 80;
  d.doc_causal = false;
  add(d);
  d = {"S260_docs_causal_D192_Dv128", 1, 260, 260, 2, 1, 192, 128, MaskKind::document};
  d.cu = {0, 31, 32, 200, 260};
  add(d);
  return cs;
}

struct Param {
  GpuCase c;
  DType dt;
};

class CudaKernelVsReference : public testing::TestWithParam<Param> {};

TEST_P(CudaKernelVsReference, AttentionForward) {
  const GpuCase& c = GetParam().c;
  const DType dt = GetParam().dt;
  SCOPED_TRACE(cuda::kernel_variant(dt, c.D, c.Dv ? c.Dv : c.D));
  Problem p = make_problem(c, dt);
  GpuProblem g(p);
  cuda::AttentionBlock blk = g.block();
  blk.q_pos0 = c.q_pos0;
  blk.k_pos0 = c.k_pos0;
  g.forward(blk);
  auto ref = cpu::attention_reference(p.q, p.k, p.v, p.spec, c.q_pos0, c.k_pos0);
  test::CompareStats st;
  EXPECT_TRUE(matches_reference(g.h_out.data(), g.h_lse.data(), c.B, c.Sq, c.Hq, p.spec.dim_v(),
                                ref, gpu_tolerance(dt), &st));
  if (test::print_errors())
    std::printf("[err] %s %s out %.3g lse %.3g ratio %.3g\n", c.name.c_str(), dtype_name(dt),
                st.max_out_err, st.max_lse_err, st.max_ratio);
}

std::vector<Param> all_params() {
  std::vector<Param> ps;
  for (const GpuCase& c : gpu_cases())
    for (DType dt : {DType::bf16, DType::f16})
      ps.push_back({c, dt});
  return ps;
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaKernelVsReference, testing::ValuesIn(all_params()),
                         [](const testing::TestParamInfo<Param>& info) {
                           return info.param.c.name + "_" +
                                  (info.param.dt == DType::bf16 ? "bf16" : "fp16");
                         });

// ---------------------------------------------------------------- empty documents

// Repeated cu_seqlens entries (empty documents at the start, in the middle, in a row, at the
// end): the forward matches the float64 reference of the boundaries without them and is, bit for
// bit, what the kernel gives without them (the device's binary search lands on the last of equal
// boundaries). Causal and not, queries at 0 and at an offset, bf16 and fp16 in turn.
TEST(CudaKernelEmptyDocuments, MatchReferenceAndTheCallWithoutThem) {
  int n = 0;
  for (const auto& [name, cu] : test::empty_documents_cases(260)) {
    for (bool causal : {true, false}) {
      const DType dt = n % 2 == 0 ? DType::bf16 : DType::f16;
      const int64_t q_pos0 = n++ % 3 == 2 ? 100 : 0;
      GpuCase c{name, 1, 260 - q_pos0, 260, 4, 2, 64, 0, MaskKind::document, q_pos0, 0};
      c.cu = cu;
      c.doc_causal = causal;
      GpuCase w = c;
      w.cu = test::without_empty_documents(cu);
      SCOPED_TRACE(testing::Message() << name << (causal ? " causal " : " full ") << dtype_name(dt)
                                      << " queries at " << q_pos0);
      const Problem p = make_problem(c, dt), pw = make_problem(w, dt);
      GpuProblem g(p), gw(pw);
      cuda::AttentionBlock blk = g.block(), blk_w = gw.block();
      blk.q_pos0 = blk_w.q_pos0 = q_pos0;
      g.forward(blk);
      gw.forward(blk_w);
      const auto ref = cpu::attention_reference(pw.q, pw.k, pw.v, pw.spec, q_pos0, 0);
      EXPECT_TRUE(matches_reference(g.h_out.data(), g.h_lse.data(), c.B, c.Sq, c.Hq, p.spec.dim_v(),
                                    ref, gpu_tolerance(dt)));
      EXPECT_EQ(std::memcmp(g.h_out.data(), gw.h_out.data(), g.h_out.size() * sizeof(float)), 0)
          << "out differs from the call without empty documents";
      EXPECT_EQ(std::memcmp(g.h_lse.data(), gw.h_lse.data(), g.h_lse.size() * sizeof(float)), 0)
          << "lse differs from the call without empty documents";
    }
  }
}

// ---------------------------------------------------------------- error budget

// DESIGN: the bf16/fp16 error is bounded by a small multiple of that of a plain same-dtype
// computation (here: storing the exact result in the dtype); measured in the style of
// test_kernel.cpp's KernelErrorBudget.
TEST(CudaKernelErrorBudget, WithinAPlainSameDtypeComputation) {
  for (DType dt : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dt));
    GpuCase c{"budget", 1, 200, 200, 4, 2, 128, 0, MaskKind::causal};
    Problem p = make_problem(c, dt, 15);
    GpuProblem g(p);
    g.forward(g.block());
    auto ref = cpu::attention_reference(p.q, p.k, p.v, p.spec);
    double kernel_err = 0, plain_err = 0;
    for (size_t i = 0; i < ref.out.size(); ++i) {
      kernel_err = std::max(kernel_err, std::fabs(double(g.h_out[i]) - ref.out[i]));
      const float f = float(ref.out[i]);
      const double stored = dt == DType::bf16 ? to_float(to_bf16(f)) : to_float(to_f16(f));
      plain_err = std::max(plain_err, std::fabs(stored - ref.out[i]));
    }
    if (test::print_errors())
      std::printf("[budget] %s kernel %.3g plain %.3g\n", dtype_name(dt), kernel_err, plain_err);
    EXPECT_GT(plain_err, 0.0);
    EXPECT_LT(kernel_err, 3 * plain_err) << "kernel " << kernel_err << ", plain " << plain_err;
  }
}

// ---------------------------------------------------------------- merging and empty rows

// Two key halves into one partial (either order) = one pass over all keys = the reference.
TEST(CudaKernelAccumulation, TwoKeyHalvesEqualOnePass) {
  for (MaskKind mk : {MaskKind::none, MaskKind::causal}) {
    for (bool reverse : {false, true}) {
      SCOPED_TRACE(testing::Message()
                   << "causal=" << (mk == MaskKind::causal) << " reverse=" << reverse);
      GpuCase c{"acc", 1, 300, 300, 4, 2, 80, 0, mk};
      Problem p = make_problem(c, DType::bf16, 8);
      GpuProblem g(p);
      const int64_t half = 137;  // not a tile multiple
      auto run = [&](int64_t begin, int64_t len) {
        cuda::AttentionBlock blk = g.block();
        blk.k_begin = begin;
        blk.k_len = len;
        blk.k_pos0 = begin;
        g.forward(blk);
      };
      if (!reverse) {
        run(0, half);
        run(half, -1);
      } else {
        run(half, c.Sk - half);
        run(0, half);
      }
      const std::vector<float> two_out = g.h_out, two_lse = g.h_lse;
      GpuProblem one(p);
      one.forward(one.block());
      auto ref = cpu::attention_reference(p.q, p.k, p.v, p.spec);
      const auto tol = gpu_tolerance(DType::bf16);
      EXPECT_TRUE(matches_reference(two_out.data(), two_lse.data(), 1, c.Sq, c.Hq, c.D, ref, tol));
      EXPECT_TRUE(
          matches_reference(one.h_out.data(), one.h_lse.data(), 1, c.Sq, c.Hq, c.D, ref, tol));
      // lse comes from fp32 scores in both: the merge's rounding only.
      for (size_t i = 0; i < two_lse.size(); ++i)
        ASSERT_NEAR(two_lse[i], one.h_lse[i], 1e-5 * (1 + std::fabs(one.h_lse[i]))) << i;
    }
  }
}

TEST(CudaKernelAccumulation, ThreeUnevenBlocksCausalFp16) {
  GpuCase c{"acc3", 2, 260, 520, 2, 1, 64, 64, MaskKind::causal, 260, 0};
  Problem p = make_problem(c, DType::f16, 9);
  GpuProblem g(p);
  const int64_t cuts[] = {0, 1, 300, 520};
  for (int i : {2, 0, 1}) {
    cuda::AttentionBlock blk = g.block();
    blk.q_pos0 = c.q_pos0;
    blk.k_begin = cuts[i];
    blk.k_len = cuts[i + 1] - cuts[i];
    blk.k_pos0 = cuts[i];
    g.forward(blk);
  }
  auto ref = cpu::attention_reference(p.q, p.k, p.v, p.spec, c.q_pos0, 0);
  EXPECT_TRUE(matches_reference(g.h_out.data(), g.h_lse.data(), c.B, c.Sq, c.Hq, c.D, ref,
                                gpu_tolerance(DType::f16)));
}

// Causal, keys starting after the first queries: rows before the first key stay exactly empty.
TEST(CudaKernelEmptyRows, RowsBeforeFirstKeyAreExactlyEmpty) {
  GpuCase c{"e", 1, 200, 150, 4, 2, 64, 0, MaskKind::causal, 0, 90};
  Problem p = make_problem(c, DType::bf16, 3);
  GpuProblem g(p);
  cuda::AttentionBlock blk = g.block();
  blk.k_pos0 = c.k_pos0;
  g.forward(blk);
  for (int64_t h = 0; h < c.Hq; ++h)
    for (int64_t s = 0; s < c.Sq; ++s) {
      const float l = g.h_lse[size_t(h * c.Sq + s)];
      if (s < c.k_pos0) {
        ASSERT_EQ(l, -INFINITY) << "h=" << h << " s=" << s;
        for (int64_t d = 0; d < c.D; ++d)
          ASSERT_EQ(g.h_out[size_t((s * c.Hq + h) * c.D + d)], 0.f) << "s=" << s << " d=" << d;
      } else {
        ASSERT_TRUE(std::isfinite(l)) << "h=" << h << " s=" << s << " lse=" << l;
      }
    }
  auto ref = cpu::attention_reference(p.q, p.k, p.v, p.spec, 0, c.k_pos0);
  EXPECT_TRUE(matches_reference(g.h_out.data(), g.h_lse.data(), c.B, c.Sq, c.Hq, c.D, ref,
                                gpu_tolerance(DType::bf16)));
}

// Keys all in the queries' future leave a non-empty partial bit for bit unchanged; so do zero
// keys (k_len = 0) and zero queries.
TEST(CudaKernelEmptyRows, FutureAndZeroKeysLeaveAPartialUnchanged) {
  GpuCase c{"f", 2, 150, 300, 4, 1, 64, 0, MaskKind::causal};
  Problem p = make_problem(c, DType::f16, 5);
  GpuProblem g(p);
  cuda::AttentionBlock blk = g.block();
  blk.k_len = 150;
  g.forward(blk);
  const std::vector<float> out0 = g.h_out, lse0 = g.h_lse;
  blk.k_begin = 150;
  blk.k_len = -1;
  blk.k_pos0 = 150;
  g.forward(blk);
  EXPECT_EQ(std::memcmp(g.h_out.data(), out0.data(), out0.size() * 4), 0);
  EXPECT_EQ(std::memcmp(g.h_lse.data(), lse0.data(), lse0.size() * 4), 0);
  blk = g.block();
  blk.k_len = 0;
  g.forward(blk);
  blk = g.block();
  blk.q_len = 0;
  g.forward(blk);
  EXPECT_EQ(std::memcmp(g.h_out.data(), out0.data(), out0.size() * 4), 0);
  EXPECT_EQ(std::memcmp(g.h_lse.data(), lse0.data(), lse0.size() * 4), 0);
}

// ---------------------------------------------------------------- positions and sub-ranges

// Rows at strided positions, and in blocks of consecutive positions (q_pos_block > 1).
TEST(CudaKernelPositions, StridedAndBlockedPositions) {
  struct S {
    int64_t qp0, qs, qb, kp0, ks, kb;
  };
  for (S s : {S{1, 2, 1, 0, 2, 1}, S{500, 4, 1, 2, 5, 1}, S{7, 1, 1, 0, 2, 1},
              S{0, 64, 16, 0, 64, 16}, S{16, 96, 24, 0, 48, 24}}) {
    SCOPED_TRACE(testing::Message() << "q " << s.qp0 << " stride " << s.qs << " block " << s.qb
                                    << ", k " << s.kp0 << " stride " << s.ks << " block " << s.kb);
    GpuCase c{"stride", 1, 150, 280, 4, 2, 64, 0, MaskKind::causal};
    Problem p = make_problem(c, DType::bf16, 12);
    GpuProblem g(p);
    cuda::AttentionBlock blk = g.block();
    blk.q_pos0 = s.qp0;
    blk.q_pos_stride = s.qs;
    blk.q_pos_block = s.qb;
    blk.k_pos0 = s.kp0;
    blk.k_pos_stride = s.ks;
    blk.k_pos_block = s.kb;
    g.forward(blk);
    auto positions = [](int64_t p0, int64_t n, int64_t stride, int64_t block) {
      std::vector<int64_t> v(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i)
        v[size_t(i)] = p0 + (i / block) * stride + i % block;
      return v;
    };
    auto ref = test::naive_reference(p.q, p.k, p.v, p.spec, positions(s.qp0, c.Sq, s.qs, s.qb),
                                     positions(s.kp0, c.Sk, s.ks, s.kb));
    EXPECT_TRUE(matches_reference(g.h_out.data(), g.h_lse.data(), c.B, c.Sq, c.Hq, c.D, ref,
                                  gpu_tolerance(DType::bf16)));
  }
}

// Rows [q_begin, q_begin + q_len) x keys [k_begin, k_begin + k_len): those rows match the
// reference over the sliced tensors; every other row keeps its (sentinel) partial bit for bit.
TEST(CudaKernelPositions, RowSubRanges) {
  for (DType dt : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dt));
    GpuCase c{"sub", 2, 160, 300, 4, 1, 64, 48, MaskKind::causal};
    Problem p = make_problem(c, dt, 13);
    const int64_t qb = 5, ql = 140, kb = 7, kl = 270, qp0 = 300, kp0 = 100, dv = 48;
    GpuProblem g(p);
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t s = 0; s < c.Sq; ++s) {
        if (s >= qb && s < qb + ql) continue;
        for (int64_t h = 0; h < c.Hq; ++h) {
          g.h_lse[size_t((b * c.Hq + h) * c.Sq + s)] = 1.5f + float(s);
          for (int64_t d = 0; d < dv; ++d)
            g.h_out[size_t(((b * c.Sq + s) * c.Hq + h) * dv + d)] = float(d) - 0.25f;
        }
      }
    g.push();
    const std::vector<float> out0 = g.h_out, lse0 = g.h_lse;
    cuda::AttentionBlock blk = g.block();
    blk.q_begin = qb;
    blk.q_len = ql;
    blk.k_begin = kb;
    blk.k_len = kl;
    blk.q_pos0 = qp0;
    blk.k_pos0 = kp0;
    g.forward(blk);
    auto ref =
        test::naive_reference(p.q.seq_slice(qb, ql), p.k.seq_slice(kb, kl), p.v.seq_slice(kb, kl),
                              p.spec, test::positions(qp0, ql), test::positions(kp0, kl));
    std::vector<float> out_blk(size_t(c.B * ql * c.Hq * dv)), lse_blk(size_t(c.B * c.Hq * ql));
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t i = 0; i < ql; ++i)
        for (int64_t h = 0; h < c.Hq; ++h) {
          lse_blk[size_t((b * c.Hq + h) * ql + i)] =
              g.h_lse[size_t((b * c.Hq + h) * c.Sq + qb + i)];
          for (int64_t d = 0; d < dv; ++d)
            out_blk[size_t(((b * ql + i) * c.Hq + h) * dv + d)] =
                g.h_out[size_t(((b * c.Sq + qb + i) * c.Hq + h) * dv + d)];
        }
    EXPECT_TRUE(matches_reference(out_blk.data(), lse_blk.data(), c.B, ql, c.Hq, dv, ref,
                                  gpu_tolerance(dt)));
    int64_t changed = 0;
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t s = 0; s < c.Sq; ++s) {
        if (s >= qb && s < qb + ql) continue;
        for (int64_t h = 0; h < c.Hq; ++h) {
          const size_t l = size_t((b * c.Hq + h) * c.Sq + s);
          if (std::memcmp(&g.h_lse[l], &lse0[l], 4) != 0) ++changed;
          for (int64_t d = 0; d < dv; ++d) {
            const size_t o = size_t(((b * c.Sq + s) * c.Hq + h) * dv + d);
            if (std::memcmp(&g.h_out[o], &out0[o], 4) != 0) ++changed;
          }
        }
      }
    EXPECT_EQ(changed, 0) << "values outside the block's query rows were written";
  }
}

// ---------------------------------------------------------------- validation

// Bad fields throw dattn::Error naming them, before anything is launched.
TEST(CudaKernelValidation, BadFieldsThrowNamingThem) {
  GpuCase c{"bad", 1, 10, 10, 4, 2, 64, 0, MaskKind::none};
  Problem p = make_problem(c, DType::bf16, 16);
  GpuProblem g(p);
  auto expect_throw = [&](cuda::AttentionBlock blk, const std::string& field) {
    EXPECT_TRUE(test::throws_naming(
        [&] { cuda::attention_forward(blk, g.out.get<float>(), g.lse.get<float>(), nullptr); },
        {field}));
  };
  cuda::AttentionBlock blk = g.block();
  blk.dtype = DType::f32;
  expect_throw(blk, "dtype");
  blk = g.block();
  blk.head_dim = 300;
  expect_throw(blk, "head_dim");
  blk = g.block();
  blk.head_dim_v = 257;
  expect_throw(blk, "head_dim_v");
  blk = g.block();
  blk.heads_kv = 3;
  expect_throw(blk, "heads_q");
  blk = g.block();
  blk.q_len = 11;
  expect_throw(blk, "q_len");
  blk = g.block();
  blk.num_docs = 2;
  expect_throw(blk, "cu_seqlens");
  blk = g.block();
  blk.k_pos_block = 0;
  expect_throw(blk, "k_pos_block");
  // Nothing was launched or written (the download below syncs; a zero-key block is a no-op).
  blk = g.block();
  blk.k_len = 0;
  g.forward(blk);
  for (float l : g.h_lse)
    ASSERT_EQ(l, -INFINITY);
}

// ---------------------------------------------------------------- non-finite inputs

// NaN and inf in K and V where the mask hides them from a row never reach that row: it comes out
// bit for bit as with clean inputs (the CPU kernel's rule, kernels/cpu: add_pv_sanitised), also
// inside a partially visible tile, where the row's P is 0 for the bad key and 0 * NaN would be
// NaN. Rows that see a bad key get non-finite values. Causal, so row i sees keys 0 .. i.
TEST(CudaKernelNonFinite, HiddenGarbageReachesOnlyTheRowsThatSeeIt) {
  const int64_t first_bad = 97;
  for (DType dt : {DType::bf16, DType::f16})
    for (GpuCase c : {GpuCase{"D64", 2, 150, 150, 2, 1, 64, 0, MaskKind::causal},
                      GpuCase{"D128_gqa2", 1, 200, 200, 4, 2, 128, 0, MaskKind::causal},
                      GpuCase{"D192_Dv128", 1, 150, 150, 2, 1, 192, 128, MaskKind::causal}}) {
      SCOPED_TRACE(testing::Message() << c.name << " " << dtype_name(dt));
      const Problem clean = make_problem(c, dt, 5);
      Problem dirty = clean;
      dirty.k = clean.k.to(dt);  // copies
      dirty.v = clean.v.to(dt);
      const int64_t Hkv = c.Hkv, D = c.D, Dv = clean.spec.dim_v();
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t h = 0; h < Hkv; ++h) {
          for (int64_t d = 0; d < Dv; ++d)  // a whole V row NaN, one inf, a NaN in K
            dirty.v.set(((b * c.Sk + first_bad) * Hkv + h) * Dv + d, NAN);
          dirty.v.set(((b * c.Sk + first_bad + 1) * Hkv + h) * Dv + 3, INFINITY);
          dirty.k.set(((b * c.Sk + first_bad + 33) * Hkv + h) * D + 5, NAN);
        }
      GpuProblem g_clean(clean), g_dirty(dirty);
      g_clean.forward(g_clean.block());
      g_dirty.forward(g_dirty.block());
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t h = 0; h < c.Hq; ++h)
          for (int64_t i = 0; i < c.Sq; ++i) {
            const size_t o = size_t(((b * c.Sq + i) * c.Hq + h) * Dv);
            const size_t l = size_t((b * c.Hq + h) * c.Sq + i);
            if (i < first_bad) {
              ASSERT_EQ(std::memcmp(&g_clean.h_out[o], &g_dirty.h_out[o], size_t(Dv) * 4), 0)
                  << "row " << i << " head " << h << " does not see the bad keys";
              ASSERT_EQ(std::memcmp(&g_clean.h_lse[l], &g_dirty.h_lse[l], 4), 0) << "row " << i;
            } else {
              bool any = false;
              for (int64_t d = 0; d < Dv; ++d)
                any = any || !std::isfinite(g_dirty.h_out[o + size_t(d)]);
              ASSERT_TRUE(any) << "row " << i << " head " << h << " sees a NaN value row";
            }
          }
    }
}

// ---------------------------------------------------------------- MLA decode

struct MlaCase {
  int64_t B, Sq, S, H, dc, dr, q_pos0, left, right;
};

// z_h = softmax(scale (q~_h . c + q_pe_h . k_pe)) . c and its lse, in float64.
void mla_reference(const MlaCase& m, float scale, const float* ql, const float* qp, const float* c,
                   const float* kp, std::vector<double>& z, std::vector<double>& lse) {
  z.assign(size_t(m.B * m.Sq * m.H * m.dc), 0.0);
  lse.assign(size_t(m.B * m.H * m.Sq), -std::numeric_limits<double>::infinity());
  std::vector<double> sc(size_t(m.S));
  for (int64_t b = 0; b < m.B; ++b)
    for (int64_t s = 0; s < m.Sq; ++s)
      for (int64_t h = 0; h < m.H; ++h) {
        const int64_t pos = m.q_pos0 + s, row = (b * m.Sq + s) * m.H + h;
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < m.S; ++j) {
          const bool vis = (m.left < 0 || pos - j <= m.left) && (m.right < 0 || j - pos <= m.right);
          if (!vis) {
            sc[size_t(j)] = -std::numeric_limits<double>::infinity();
            continue;
          }
          double d = 0;
          for (int64_t a = 0; a < m.dc; ++a)
            d += double(ql[row * m.dc + a]) * c[(b * m.S + j) * m.dc + a];
          for (int64_t a = 0; a < m.dr; ++a)
            d += double(qp[row * m.dr + a]) * kp[(b * m.S + j) * m.dr + a];
          sc[size_t(j)] = double(scale) * d;
          mx = std::max(mx, sc[size_t(j)]);
        }
        if (mx == -std::numeric_limits<double>::infinity()) continue;
        double sum = 0;
        for (int64_t j = 0; j < m.S; ++j) {
          if (sc[size_t(j)] == -std::numeric_limits<double>::infinity()) continue;
          const double w = std::exp(sc[size_t(j)] - mx);
          sum += w;
          for (int64_t a = 0; a < m.dc; ++a)
            z[size_t(row * m.dc + a)] += w * c[(b * m.S + j) * m.dc + a];
        }
        for (int64_t a = 0; a < m.dc; ++a)
          z[size_t(row * m.dc + a)] /= sum;
        lse[size_t((b * m.H + h) * m.Sq + s)] = mx + std::log(sum);
      }
}

TEST(CudaMlaDecode, MatchesFloat64Reference) {
  // B, Sq, S, H, d_c, d_r, q_pos0, left, right
  for (MlaCase m : {MlaCase{2, 3, 300, 4, 512, 64, 297, -1, 0},   // decode at the cache's end
                    MlaCase{1, 2, 70, 3, 96, 0, 10, -1, 0},       // rows 11.. of the cache hidden
                    MlaCase{1, 1, 129, 2, 1024, 32, 128, 40, 0},  // a sliding window
                    MlaCase{1, 2, 0, 2, 64, 16, 0, -1, 0},        // empty cache: empty rows
                    // Two blocks of heads, the cache in several splits (the emulation has 4 SMs).
                    MlaCase{1, 1, 1000, 12, 256, 64, 999, -1, 0}}) {
    SCOPED_TRACE(testing::Message() << "S=" << m.S << " H=" << m.H << " dc=" << m.dc
                                    << " dr=" << m.dr << " q_pos0=" << m.q_pos0);
    const float scale = 1.f / std::sqrt(float(128 + m.dr));
    Tensor ql = random_tensor({m.B, m.Sq, m.H, m.dc}, DType::f32, 21, 0.3f);
    Tensor qp = random_tensor({m.B, m.Sq, m.H, std::max<int64_t>(m.dr, 1)}, DType::f32, 22);
    Tensor c = random_tensor({m.B, std::max<int64_t>(m.S, 1), m.dc}, DType::f32, 23);
    Tensor kp =
        random_tensor({m.B, std::max<int64_t>(m.S, 1), std::max<int64_t>(m.dr, 1)}, DType::f32, 24);
    DeviceBuffer d_ql(ql.data(), ql.nbytes()), d_qp(qp.data(), qp.nbytes()),
        d_c(c.data(), c.nbytes()), d_kp(kp.data(), kp.nbytes());
    const size_t nz = size_t(m.B * m.Sq * m.H * m.dc), nl = size_t(m.B * m.H * m.Sq);
    DeviceBuffer d_z(nz * 4), d_lse(nl * 4);
    cuda::MlaDecodeBlock blk;
    blk.q_latent = d_ql.get<float>();
    blk.q_pe = d_qp.get<float>();
    blk.c_kv = d_c.get<float>();
    blk.k_pe = d_kp.get<float>();
    blk.batch = m.B;
    blk.seq_q = m.Sq;
    blk.seq_kv = m.S;
    blk.heads = m.H;
    blk.latent = m.dc;
    blk.rope = m.dr;
    blk.q_pos0 = m.q_pos0;
    blk.scale = scale;
    blk.left = m.left;
    blk.right = m.right;
    cuda::mla_decode_forward(blk, d_z.get<float>(), d_lse.get<float>(), nullptr);
    DATTN_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> z(nz), lse(nl);
    d_z.download(z.data());
    d_lse.download(lse.data());
    // Split-KV merges in a fixed order: a second call gives the same bits.
    cuda::mla_decode_forward(blk, d_z.get<float>(), d_lse.get<float>(), nullptr);
    DATTN_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> z2(nz), lse2(nl);
    d_z.download(z2.data());
    d_lse.download(lse2.data());
    EXPECT_EQ(std::memcmp(z.data(), z2.data(), nz * 4), 0);
    EXPECT_EQ(std::memcmp(lse.data(), lse2.data(), nl * 4), 0);
    // k_pe/q_pe were allocated with width max(dr, 1); with dr = 0 the kernel reads neither.
    std::vector<double> rz, rl;
    mla_reference(m, scale, ql.ptr<float>(), qp.ptr<float>(), c.ptr<float>(), kp.ptr<float>(), rz,
                  rl);
    for (size_t i = 0; i < nl; ++i) {
      if (std::isinf(rl[i])) {
        ASSERT_EQ(lse[i], -INFINITY) << i;
      } else {
        ASSERT_NEAR(lse[i], rl[i], 1e-4 * (1 + std::fabs(rl[i]))) << i;
      }
    }
    for (size_t i = 0; i < nz; ++i)
      ASSERT_NEAR(z[i], rz[i], 2e-5 + 1e-4 * std::fabs(rz[i])) << i;
  }
}

// The whole absorbed step of one rank's slice (mla_absorbed_decode): q~ = W_UK_h[:, slice]^T
// q_nope_h and the slice's q_pe columns, then the latent decode, then out = W_UV_h[:, slice] z_h,
// against the same steps in float64 (mla_reference for the middle one); written at heads out_h0..
// of a wider output, the other heads untouched.
TEST(CudaMlaDecode, AbsorbedSliceMatchesFloat64Reference) {
  struct Slice {
    int64_t h0, nh, lat0, nlat, rope0, nrope, out_heads, out_h0;
  };
  const int64_t B = 2, Sq = 2, S = 90, H = 4, dn = 48, dc = 128, dr = 32, dv = 40;
  const int64_t q_pos0 = S - Sq;
  Tensor qn = random_tensor({B, Sq, H, dn}, DType::f32, 31);
  Tensor qp = random_tensor({B, Sq, H, dr}, DType::f32, 32);
  Tensor wuk = random_tensor({H, dn, dc}, DType::f32, 33, 0.1f);
  Tensor wuv = random_tensor({H, dv, dc}, DType::f32, 34, 0.1f);
  Tensor c_all = random_tensor({B, S, dc}, DType::f32, 35);
  Tensor kp_all = random_tensor({B, S, dr}, DType::f32, 36);
  DeviceBuffer d_qn(qn.data(), qn.nbytes()), d_qp(qp.data(), qp.nbytes()),
      d_wuk(wuk.data(), wuk.nbytes()), d_wuv(wuv.data(), wuv.nbytes());
  // Head split (2 of 4 heads, every column), TPLA (every head, a latent and RoPE slice), and one
  // slice with no RoPE columns.
  for (Slice sl : {Slice{2, 2, 0, dc, 0, dr, 2, 0}, Slice{0, H, 32, 64, 16, 16, H, 0},
                   Slice{1, 2, 64, 64, 0, 0, 5, 2}}) {
    SCOPED_TRACE(testing::Message() << "heads " << sl.h0 << "+" << sl.nh << " latent " << sl.lat0
                                    << "+" << sl.nlat << " rope " << sl.rope0 << "+" << sl.nrope);
    // The slice's cache columns, as a rank holds them.
    std::vector<float> c(size_t(B * S * sl.nlat)),
        kp(size_t(B * S * std::max<int64_t>(sl.nrope, 1)));
    for (int64_t t = 0; t < B * S; ++t) {
      for (int64_t a = 0; a < sl.nlat; ++a)
        c[size_t(t * sl.nlat + a)] = c_all.ptr<float>()[t * dc + sl.lat0 + a];
      for (int64_t a = 0; a < sl.nrope; ++a)
        kp[size_t(t * sl.nrope + a)] = kp_all.ptr<float>()[t * dr + sl.rope0 + a];
    }
    DeviceBuffer d_c(c.data(), c.size() * 4), d_kp(kp.data(), kp.size() * 4);
    const size_t n_out = size_t(B * Sq * sl.out_heads * dv), n_lse = size_t(B * sl.nh * Sq);
    std::vector<float> out(n_out, 7.f);  // heads outside the slice must keep this
    DeviceBuffer d_out(out.data(), n_out * 4), d_lse(n_lse * 4);
    const float scale = 1.f / std::sqrt(float(dn + dr));
    MlaAbsorbedBlock p;
    p.q_nope = d_qn.get<float>();
    p.q_pe = d_qp.get<float>();
    p.w_uk = d_wuk.get<float>();
    p.w_uv = d_wuv.get<float>();
    p.c_kv = d_c.get<float>();
    p.k_pe = d_kp.get<float>();
    p.batch = B;
    p.seq_q = Sq;
    p.seq_kv = S;
    p.heads_all = H;
    p.qk_nope = dn;
    p.rope_all = dr;
    p.latent_all = dc;
    p.v_head = dv;
    p.h0 = sl.h0;
    p.nh = sl.nh;
    p.lat0 = sl.lat0;
    p.nlat = sl.nlat;
    p.rope0 = sl.rope0;
    p.nrope = sl.nrope;
    p.q_pos0 = q_pos0;
    p.scale = scale;
    cuda::mla_absorbed_decode(p, d_out.get<float>(), sl.out_heads, sl.out_h0, d_lse.get<float>(),
                              nullptr);
    DATTN_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> lse(n_lse);
    d_out.download(out.data());
    d_lse.download(lse.data());

    // float64: the absorbed queries and the slice's q_pe, the latent decode, the projection.
    const MlaCase m{B, Sq, S, sl.nh, sl.nlat, sl.nrope, q_pos0, -1, 0};
    std::vector<float> ql(size_t(B * Sq * sl.nh * sl.nlat)),
        qr(size_t(B * Sq * sl.nh * std::max<int64_t>(sl.nrope, 1)));
    for (int64_t t = 0; t < B * Sq; ++t)
      for (int64_t i = 0; i < sl.nh; ++i) {
        const int64_t h = sl.h0 + i;
        for (int64_t a = 0; a < sl.nlat; ++a) {
          double acc = 0;
          for (int64_t k = 0; k < dn; ++k)
            acc += double(wuk.ptr<float>()[(h * dn + k) * dc + sl.lat0 + a]) *
                   qn.ptr<float>()[(t * H + h) * dn + k];
          ql[size_t((t * sl.nh + i) * sl.nlat + a)] = float(acc);
        }
        for (int64_t r = 0; r < sl.nrope; ++r)
          qr[size_t((t * sl.nh + i) * sl.nrope + r)] =
              qp.ptr<float>()[(t * H + h) * dr + sl.rope0 + r];
      }
    std::vector<double> rz, rl;
    mla_reference(m, scale, ql.data(), qr.data(), c.data(), kp.data(), rz, rl);
    for (size_t i = 0; i < n_lse; ++i)
      ASSERT_NEAR(lse[i], rl[i], 1e-4 * (1 + std::fabs(rl[i]))) << "lse " << i;
    for (int64_t t = 0; t < B * Sq; ++t)
      for (int64_t oh = 0; oh < sl.out_heads; ++oh)
        for (int64_t col = 0; col < dv; ++col) {
          const float got = out[size_t((t * sl.out_heads + oh) * dv + col)];
          const int64_t i = oh - sl.out_h0;
          if (i < 0 || i >= sl.nh) {
            ASSERT_EQ(got, 7.f) << "head " << oh << " outside the slice was written";
            continue;
          }
          double want = 0;
          for (int64_t a = 0; a < sl.nlat; ++a)
            want += double(wuv.ptr<float>()[((sl.h0 + i) * dv + col) * dc + sl.lat0 + a]) *
                    rz[size_t((t * sl.nh + i) * sl.nlat + a)];
          ASSERT_NEAR(got, want, 1e-4 + 1e-4 * std::fabs(want))
              << "token " << t << " head " << oh << " col " << col;
        }
  }
}

TEST(CudaMlaDecode, BadFieldsThrowNamingThem) {
  cuda::MlaDecodeBlock blk;
  blk.batch = 1;
  blk.seq_q = 1;
  blk.heads = 1;
  blk.latent = 2048;
  EXPECT_TRUE(test::throws_naming([&] { cuda::mla_decode_forward(blk, nullptr, nullptr, nullptr); },
                                  {"latent"}));
  blk.latent = 64;
  blk.rope = 1000;
  EXPECT_TRUE(test::throws_naming([&] { cuda::mla_decode_forward(blk, nullptr, nullptr, nullptr); },
                                  {"rope"}));
}

}  // namespace
}  // namespace dattn
