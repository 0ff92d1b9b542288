// GPU tests of the CUDA attention backward (kernels/cuda/attention_backward_cuda.h): dq, dk, dv
// against the float64 reference backward over the bf16/fp16 cases of the CPU backward's table
// (tests/test_backward.cpp; masks, GQA, D != Dv, offsets, batches, rows that see no key, a
// softcap), delta against its float64 sum, bit-identical repeated calls, strided and blocked
// query/key runs that sum to the whole, NaN where the mask hides it, and validation.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/reference.h"
#include "kernels/cuda/attention_backward_cuda.h"
#include "kernels/cuda/device_buffer.h"
#include "src/base/cuda_check.h"
#include "src/base/error.h"
#include "tests/test_reference.h"

namespace dattn {
namespace {

using cuda::DeviceBuffer;
using test::random_tensor;

struct BwdCase {
  std::string name;
  int64_t B = 1, Sq = 0, Sk = 0, Hq = 1, Hkv = 1, D = 64, Dv = 0;
  Mask mask;
  DType dtype = DType::bf16;
  int64_t q_pos0 = 0, k_pos0 = 0;
  float q_stddev = 1.f;
  float softcap = 0.f;
};

std::ostream& operator<<(std::ostream& os, const BwdCase& c) {
  return os << c.name;
}

// The CPU backward's bf16/fp16 cases (its fp32 ones, whose shapes these cover, in bf16), sized
// alike; the emulation runs them in a few seconds.
std::vector<BwdCase> bwd_cases() {
  const Mask none = Mask::none(), causal = Mask::causal();
  const DType bf = DType::bf16, h = DType::f16;
  std::vector<BwdCase> cs;
  auto add = [&](BwdCase c) { cs.push_back(c); };
  // name, B, Sq, Sk, Hq, Hkv, D, Dv, mask, dtype, q_pos0, k_pos0, q_stddev, softcap
  add({"S1_D128_gqa4_none_bf16", 1, 1, 1, 4, 1, 128, 0, none, bf});
  add({"S77_D128_gqa4_causal_bf16", 1, 77, 77, 4, 1, 128, 0, causal, bf});
  add({"S77_D192_Dv128_window_f16", 1, 77, 77, 2, 2, 192, 128, Mask::window(20), h});
  add({"S300_D128_gqa2_window_f16", 1, 300, 300, 2, 1, 128, 0, Mask::window(100), h});
  add({"S300_D192_Dv128_gqa2_causal_bf16", 1, 300, 300, 2, 1, 192, 128, causal, bf});
  add({"S300_D64_document_bf16", 1, 300, 300, 2, 1, 64, 0, Mask::document({0, 1, 120, 300}, false),
       bf});
  add({"S513_D64_gqa4_none_bf16", 1, 513, 513, 4, 1, 64, 0, none, bf});
  add({"S513_D64_causal_f16", 1, 513, 513, 2, 1, 64, 0, causal, h});
  add({"S513_D192_Dv128_document_causal_bf16", 1, 513, 513, 2, 2, 192, 128,
       Mask::document({0, 100, 350, 513}, true), bf});
  add({"S1100_D64_document_bf16", 1, 1100, 1100, 1, 1, 64, 0,
       Mask::document({0, 256, 700, 1100}, false), bf});
  add({"B2_S150_D64_gqa2_causal_f16", 2, 150, 150, 4, 2, 64, 0, causal, h});
  add({"B3_S40_D128_Dv64_none_bf16", 3, 40, 40, 2, 2, 128, 64, none, bf});
  add({"S130_D256_gqa2_causal_bf16", 1, 130, 130, 2, 1, 256, 0, causal, bf});
  add({"S90_D33_Dv17_causal_f16", 1, 90, 90, 2, 2, 33, 17, causal, h});
  add({"Sq100_at1000_Sk1100_causal_bf16", 1, 100, 1100, 2, 1, 64, 0, causal, bf, 1000, 0});
  add({"Sq300_at0_Sk200_at150_causal_bf16", 1, 300, 200, 2, 1, 64, 0, causal, bf, 0, 150});
  add({"Sq300_at500_Sk513_window64_f16", 1, 300, 513, 2, 2, 64, 0, Mask::window(64), h, 500, 0});
  add({"Sq260_Sk33_none_f16", 1, 260, 33, 2, 2, 64, 0, none, h});
  add({"S300_sharp_causal_bf16", 1, 300, 300, 2, 2, 64, 0, causal, bf, 0, 0, 4.f});
  add({"S200_softcap5_causal_bf16", 1, 200, 200, 2, 1, 64, 0, causal, bf, 0, 0, 3.f, 5.f});
  add({"keys_in_future_causal_bf16", 1, 140, 270, 2, 1, 64, 0, causal, bf, 1000, 1140});
  return cs;
}

struct Problem {
  Tensor q, k, v, dout;
  AttnSpec spec;
  std::vector<float> out, lse;  // the float64 forward, rounded to fp32
};

Problem make_problem(const BwdCase& c, uint64_t seed = 1) {
  Problem p;
  p.spec.heads_q = c.Hq;
  p.spec.heads_kv = c.Hkv;
  p.spec.head_dim = c.D;
  p.spec.head_dim_v = c.Dv;
  p.spec.mask = c.mask;
  p.spec.softcap = c.softcap;
  const int64_t dv = p.spec.dim_v();
  p.q = random_tensor({c.B, c.Sq, c.Hq, c.D}, c.dtype, seed * 4 + 0, c.q_stddev);
  p.k = random_tensor({c.B, c.Sk, c.Hkv, c.D}, c.dtype, seed * 4 + 1);
  p.v = random_tensor({c.B, c.Sk, c.Hkv, dv}, c.dtype, seed * 4 + 2);
  p.dout = random_tensor({c.B, c.Sq, c.Hq, dv}, c.dtype, seed * 4 + 3);
  const cpu::ReferenceResult ref =
      cpu::attention_reference(p.q, p.k, p.v, p.spec, c.q_pos0, c.k_pos0);
  p.out.assign(ref.out.begin(), ref.out.end());
  p.lse.assign(ref.lse.begin(), ref.lse.end());
  return p;
}

// The problem on the device, zero gradients, delta from the CUDA delta kernel.
struct GpuBackward {
  const Problem& p;
  DeviceBuffer q, k, v, dout, out, lse, delta, dq, dk, dv;
  std::unique_ptr<DeviceBuffer> cu;

  explicit GpuBackward(const Problem& pr)
      : p(pr),
        q(pr.q.data(), pr.q.nbytes()),
        k(pr.k.data(), pr.k.nbytes()),
        v(pr.v.data(), pr.v.nbytes()),
        dout(pr.dout.data(), pr.dout.nbytes()),
        out(pr.out.data(), pr.out.size() * 4),
        lse(pr.lse.data(), pr.lse.size() * 4),
        delta(pr.lse.size() * 4),
        dq(size_t(pr.q.numel()) * 4),
        dk(size_t(pr.k.numel()) * 4),
        dv(size_t(pr.v.numel()) * 4) {
    if (pr.spec.mask.documents)
      cu = std::make_unique<DeviceBuffer>(pr.spec.mask.documents->data(),
                                          pr.spec.mask.documents->size() * sizeof(int64_t));
    cuda::attention_backward_delta(dout.get(), pr.dout.dtype(), out.get<float>(), pr.q.size(0),
                                   pr.q.size(1), pr.spec.heads_q, pr.spec.dim_v(),
                                   delta.get<float>(), nullptr);
    zero();
  }
  void zero() {
    for (DeviceBuffer* b : {&dq, &dk, &dv})
      DATTN_CUDA_CHECK(cudaMemset(b->get(), 0, b->bytes()));
  }
  cuda::AttentionBlock block(int64_t q_pos0, int64_t k_pos0) const {
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
    b.softcap = p.spec.softcap;
    b.q_pos0 = q_pos0;
    b.k_pos0 = k_pos0;
    cuda::set_mask(b, p.spec.mask, cu ? cu->get<int64_t>() : nullptr);
    return b;
  }
  void run(const cuda::AttentionBlock& b) {
    cuda::attention_backward(b, dout.get(), p.dout.dtype(), lse.get<float>(), delta.get<float>(),
                             dq.get<float>(), dk.get<float>(), dv.get<float>(), nullptr);
  }
  struct Host {
    std::vector<float> dq, dk, dv;
  };
  Host download() const {
    DATTN_CUDA_CHECK(cudaDeviceSynchronize());
    Host h{std::vector<float>(dq.bytes() / 4), std::vector<float>(dk.bytes() / 4),
           std::vector<float>(dv.bytes() / 4)};
    dq.download(h.dq.data());
    dk.download(h.dk.data());
    dv.download(h.dv.data());
    return h;
  }
};

// The CPU backward's bound (test_backward.cpp): max |err| <= 1e-4 max |ref| + 1e-5 over the tensor;
// NaN or inf anywhere fails. This kernel is fp32 throughout, as that one is.
testing::AssertionResult grad_matches(const char* name, const std::vector<float>& got,
                                      const std::vector<double>& ref) {
  double max_ref = 0, max_err = 0;
  size_t worst = 0;
  for (double r : ref)
    max_ref = std::max(max_ref, std::fabs(r));
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i]))
      return testing::AssertionFailure() << name << "[" << i << "] = " << got[i];
    const double err = std::fabs(double(got[i]) - ref[i]);
    if (err > max_err) max_err = err, worst = i;
  }
  const double allow = 1e-4 * max_ref + 1e-5;
  if (test::print_errors())
    std::printf("[errors] %s max|err| %.3g max|ref| %.3g\n", name, max_err, max_ref);
  if (max_err > allow)
    return testing::AssertionFailure()
           << name << ": max |err| " << max_err << " at [" << worst << "] (got " << got[worst]
           << ", expected " << ref[worst] << ") > " << allow;
  return testing::AssertionSuccess();
}

testing::AssertionResult grads_match(const GpuBackward::Host& g, const cpu::ReferenceGrads& ref) {
  testing::AssertionResult r = grad_matches("dq", g.dq, ref.dq);
  if (r) r = grad_matches("dk", g.dk, ref.dk);
  if (r) r = grad_matches("dv", g.dv, ref.dv);
  return r;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

class CudaBackward : public testing::TestWithParam<BwdCase> {};

// Against float64; a query row that sees no key has dq exactly 0, a key no query sees dk and dv
// exactly 0; a second call into zeroed gradients gives the same bits.
TEST_P(CudaBackward, MatchesFloat64ReferenceAndRepeatsBitwise) {
  const BwdCase& c = GetParam();
  const Problem p = make_problem(c);
  GpuBackward g(p);
  g.run(g.block(c.q_pos0, c.k_pos0));
  const GpuBackward::Host first = g.download();
  const cpu::ReferenceGrads ref =
      cpu::attention_backward_reference(p.q, p.k, p.v, p.dout, p.spec, c.q_pos0, c.k_pos0);
  EXPECT_TRUE(grads_match(first, ref));
  const int64_t dv = p.spec.dim_v();
  for (int64_t i = 0; i < c.Sq; ++i) {
    bool sees = false;
    for (int64_t j = 0; j < c.Sk && !sees; ++j)
      sees = c.mask.visible(c.q_pos0 + i, c.k_pos0 + j);
    for (int64_t b = 0; b < c.B && !sees; ++b)
      for (int64_t e = 0; e < c.Hq * c.D; ++e)
        ASSERT_EQ(first.dq[size_t((b * c.Sq + i) * c.Hq * c.D + e)], 0.f) << "query row " << i;
  }
  for (int64_t j = 0; j < c.Sk; ++j) {
    bool seen = false;
    for (int64_t i = 0; i < c.Sq && !seen; ++i)
      seen = c.mask.visible(c.q_pos0 + i, c.k_pos0 + j);
    for (int64_t b = 0; b < c.B && !seen; ++b) {
      for (int64_t e = 0; e < c.Hkv * c.D; ++e)
        ASSERT_EQ(first.dk[size_t((b * c.Sk + j) * c.Hkv * c.D + e)], 0.f) << "key row " << j;
      for (int64_t e = 0; e < c.Hkv * dv; ++e)
        ASSERT_EQ(first.dv[size_t((b * c.Sk + j) * c.Hkv * dv + e)], 0.f) << "key row " << j;
    }
  }
  g.zero();
  g.run(g.block(c.q_pos0, c.k_pos0));
  const GpuBackward::Host second = g.download();
  EXPECT_TRUE(same_bits(first.dq, second.dq) && same_bits(first.dk, second.dk) &&
              same_bits(first.dv, second.dv))
      << "two calls differ";
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaBackward, testing::ValuesIn(bwd_cases()),
                         [](const testing::TestParamInfo<BwdCase>& info) {
                           return info.param.name;
                         });

// delta = rowsum(dout * out) against its float64 sum of the same fp32/bf16 values.
TEST(CudaBackwardDelta, RowSumOfDoutTimesOut) {
  const BwdCase c{"", 2, 37, 37, 3, 1, 64, 48, Mask::causal(), DType::f16};
  const Problem p = make_problem(c);
  GpuBackward g(p);
  std::vector<float> got(p.lse.size());
  DATTN_CUDA_CHECK(cudaDeviceSynchronize());
  g.delta.download(got.data());
  const int64_t Dv = 48;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.Hq; ++h)
      for (int64_t s = 0; s < c.Sq; ++s) {
        double want = 0;
        for (int64_t d = 0; d < Dv; ++d) {
          const int64_t at = ((b * c.Sq + s) * c.Hq + h) * Dv + d;
          want += double(p.dout.get(at)) * double(p.out[size_t(at)]);
        }
        ASSERT_NEAR(got[size_t((b * c.Hq + h) * c.Sq + s)], want, 1e-6 * std::fabs(want) + 1e-7)
            << "b " << b << " h " << h << " s " << s;
      }
}

// Query and key rows in runs, as the ring and the layouts hand them over: the rows of the
// tensors hold the positions in blocks of `block` every 2 * block (the first half the even
// blocks, the second the odd ones; block 1 is the striped layout), each half of the queries
// against each half of the keys accumulating into the same gradients, which must be the whole
// attention's (the reference's, rows permuted back).
TEST(CudaBackwardRuns, StridedAndBlockedRunsSumToTheWhole) {
  for (int64_t block : {1, 4}) {
    SCOPED_TRACE("block " + std::to_string(block));
    const int64_t S = 96, H = 2, D = 64;
    const BwdCase c{"", 1, S, S, H, 1, D, 0, Mask::causal(), DType::bf16};
    const Problem whole = make_problem(c);
    // Row r of the permuted tensors holds position perm[r].
    std::vector<int64_t> perm;
    for (int64_t half : {0, 1})
      for (int64_t b0 = half * block; b0 < S; b0 += 2 * block)
        for (int64_t e = 0; e < block; ++e)
          perm.push_back(b0 + e);
    const auto permute = [&](const Tensor& t) {
      Tensor out = Tensor::empty({1, S, t.size(2), t.size(3)}, t.dtype());
      const int64_t row = t.size(2) * t.size(3) * int64_t(dtype_size(t.dtype()));
      for (int64_t r = 0; r < S; ++r)
        std::memcpy(static_cast<char*>(out.data()) + r * row,
                    static_cast<const char*>(t.data()) + perm[size_t(r)] * row, size_t(row));
      return out;
    };
    Problem p = whole;
    p.q = permute(whole.q), p.k = permute(whole.k), p.v = permute(whole.v);
    p.dout = permute(whole.dout);
    for (int64_t r = 0; r < S; ++r)
      for (int64_t h = 0; h < H; ++h) {
        p.lse[size_t(h * S + r)] = whole.lse[size_t(h * S + perm[size_t(r)])];
        for (int64_t d = 0; d < D; ++d)
          p.out[size_t((r * H + h) * D + d)] = whole.out[size_t((perm[size_t(r)] * H + h) * D + d)];
      }
    GpuBackward g(p);
    for (int64_t qh : {0, 1})
      for (int64_t kh : {0, 1}) {
        cuda::AttentionBlock b = g.block(qh * block, kh * block);
        b.q_begin = qh * S / 2, b.q_len = S / 2;
        b.k_begin = kh * S / 2, b.k_len = S / 2;
        b.q_pos_block = b.k_pos_block = block;
        b.q_pos_stride = b.k_pos_stride = 2 * block;
        g.run(b);
      }
    const GpuBackward::Host got = g.download();
    const cpu::ReferenceGrads ref =
        cpu::attention_backward_reference(whole.q, whole.k, whole.v, whole.dout, whole.spec);
    GpuBackward::Host back{std::vector<float>(got.dq.size()), std::vector<float>(got.dk.size()),
                           std::vector<float>(got.dv.size())};
    for (int64_t r = 0; r < S; ++r) {
      const size_t at = size_t(perm[size_t(r)]);
      std::copy_n(got.dq.begin() + r * H * D, H * D, back.dq.begin() + int64_t(at) * H * D);
      std::copy_n(got.dk.begin() + r * D, D, back.dk.begin() + int64_t(at) * D);
      std::copy_n(got.dv.begin() + r * D, D, back.dv.begin() + int64_t(at) * D);
    }
    EXPECT_TRUE(grads_match(back, ref));
  }
}

// NaN and inf in the rows of the second document (q, k, v, dout, hence its out, lse and delta)
// reach no gradient of the first: those are, bit for bit, the gradients without them.
TEST(CudaBackwardNonFinite, HiddenNanReachesNoOtherDocument) {
  const int64_t S = 80, split = 45, H = 2, D = 64;
  const BwdCase c{"", 1, S, S, H, 1, D, 0, Mask::document({0, split, S}, true), DType::bf16};
  const Problem clean = make_problem(c);
  Problem dirty = clean;
  dirty.q = clean.q.to(DType::bf16), dirty.k = clean.k.to(DType::bf16);
  dirty.v = clean.v.to(DType::bf16), dirty.dout = clean.dout.to(DType::bf16);
  for (int64_t r : {split, split + 7, S - 1}) {
    dirty.q.set(r * H * D + 3, NAN);
    dirty.k.set(r * D + 5, INFINITY);
    dirty.v.set(r * D + 1, NAN);
    dirty.dout.set(r * H * D + D + 2, -INFINITY);
    for (int64_t h = 0; h < H; ++h)
      dirty.lse[size_t(h * S + r)] = NAN;
  }
  GpuBackward a(clean), b(dirty);
  a.run(a.block(0, 0));
  b.run(b.block(0, 0));
  const GpuBackward::Host ga = a.download(), gb = b.download();
  const auto first = [&](const std::vector<float>& x, int64_t heads) {
    return std::vector<float>(x.begin(), x.begin() + split * heads * D);
  };
  EXPECT_TRUE(same_bits(first(ga.dq, H), first(gb.dq, H))) << "dq";
  EXPECT_TRUE(same_bits(first(ga.dk, 1), first(gb.dk, 1))) << "dk";
  EXPECT_TRUE(same_bits(first(ga.dv, 1), first(gb.dv, 1))) << "dv";
}

// Bad arguments are named before anything is launched.
TEST(CudaBackwardErrors, NamesTheBadArgument) {
  const BwdCase c{"", 1, 16, 16, 2, 1, 64, 0, Mask::causal(), DType::bf16};
  const Problem p = make_problem(c);
  GpuBackward g(p);
  const auto message = [&](cuda::AttentionBlock b, const void* dout, DType dt, float* dq) {
    try {
      cuda::attention_backward(b, dout, dt, g.lse.get<float>(), g.delta.get<float>(), dq,
                               g.dk.get<float>(), g.dv.get<float>(), nullptr);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const cuda::AttentionBlock ok = g.block(0, 0);
  EXPECT_NE(message(ok, nullptr, DType::bf16, g.dq.get<float>()).find("dout"), std::string::npos);
  EXPECT_NE(message(ok, g.dout.get(), DType::bf16, nullptr).find("dq"), std::string::npos);
  cuda::AttentionBlock bad = ok;
  bad.head_dim = 300;
  EXPECT_NE(message(bad, g.dout.get(), DType::bf16, g.dq.get<float>()).find("head_dim"),
            std::string::npos);
  bad = ok;
  bad.dtype = DType::f32;
  EXPECT_NE(message(bad, g.dout.get(), DType::bf16, g.dq.get<float>()).find("dtype"),
            std::string::npos);
  bad = ok;
  bad.q_len = 17;
  EXPECT_NE(message(bad, g.dout.get(), DType::bf16, g.dq.get<float>()).find("q_len"),
            std::string::npos);
  // An empty block adds nothing and needs no pointers.
  bad = ok;
  bad.q_len = 0;
  EXPECT_EQ(message(bad, nullptr, DType::bf16, nullptr), "no error");
}

}  // namespace
}  // namespace dattn
