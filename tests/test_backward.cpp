// Tests of the attention backward on one process: the CPU kernel (dattn::cpu::attention_backward)
// and dattn::attention_local_backward against the float64 reference backward (itself checked
// against finite differences of the float64 forward), over shapes straddling the tiles, GQA,
// D_v != D, every mask, offsets, dtypes; empty rows; bitwise determinism; block accumulation;
// empty documents (repeated cu_seqlens entries).
#include <gtest/gtest.h>

#include <omp.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/cpu/attention_backward_cpu.h"
#include "kernels/cpu/attention_cpu.h"
#include "kernels/cpu/reference.h"
#include "kernels/merge.h"
#include "src/attention.h"
#include "src/base/error.h"
#include "tests/test_reference.h"

namespace dattn {
namespace {

using test::random_tensor;

// ---------------------------------------------------------------- one backward problem

struct BackwardCase {
  std::string name;
  int64_t B = 1, Sq = 0, Sk = 0, Hq = 1, Hkv = 1, D = 64, Dv = 0;
  Mask mask;
  DType dtype = DType::f32;
  int64_t q_pos0 = 0, k_pos0 = 0;
  float q_stddev = 1.f;  // > 1 sharpens the softmax
};

std::ostream& operator<<(std::ostream& os, const BackwardCase& c) {
  return os << c.name;
}

struct Problem {
  Tensor q, k, v, dout;
  AttnSpec spec;
};

Problem make_problem(const BackwardCase& c, uint64_t seed = 1) {
  Problem p;
  p.spec.heads_q = c.Hq;
  p.spec.heads_kv = c.Hkv;
  p.spec.head_dim = c.D;
  p.spec.head_dim_v = c.Dv;
  p.spec.mask = c.mask;
  const int64_t dv = p.spec.dim_v();
  p.q = random_tensor({c.B, c.Sq, c.Hq, c.D}, c.dtype, seed * 4 + 0, c.q_stddev);
  p.k = random_tensor({c.B, c.Sk, c.Hkv, c.D}, c.dtype, seed * 4 + 1);
  p.v = random_tensor({c.B, c.Sk, c.Hkv, dv}, c.dtype, seed * 4 + 2);
  p.dout = random_tensor({c.B, c.Sq, c.Hq, dv}, c.dtype, seed * 4 + 3);
  return p;
}

cpu::AttentionBlock make_block(const Problem& p) {
  cpu::AttentionBlock blk;
  blk.q = p.q.data();
  blk.k = p.k.data();
  blk.v = p.v.data();
  blk.dtype = p.q.dtype();
  blk.batch = p.q.size(0);
  blk.seq_q = p.q.size(1);
  blk.seq_k = p.k.size(1);
  blk.heads_q = p.spec.heads_q;
  blk.heads_kv = p.spec.heads_kv;
  blk.head_dim = p.spec.head_dim;
  blk.head_dim_v = p.spec.dim_v();
  blk.scale = p.spec.scale();
  blk.mask = p.spec.mask;
  return blk;
}

// The kernel's inputs besides q, k, v, dout: the forward's lse and delta = rowsum(dout * out).
struct ForwardState {
  Partial fwd;
  std::vector<float> delta;
};

ForwardState forward_state(const Problem& p, int64_t q_pos0, int64_t k_pos0) {
  ForwardState st{attention_local(p.q, p.k, p.v, p.spec, q_pos0, k_pos0), {}};
  const int64_t B = p.q.size(0), S = p.q.size(1);
  st.delta.resize(size_t(B * p.spec.heads_q * S));
  cpu::attention_backward_delta(p.dout.data(), p.dout.dtype(), st.fwd.out.ptr<float>(), B, S,
                                p.spec.heads_q, p.spec.dim_v(), st.delta.data());
  return st;
}

// fp32 gradient buffers, zero.
struct Grads {
  std::vector<float> dq, dk, dv;
  explicit Grads(const Problem& p)
      : dq(size_t(p.q.numel())), dk(size_t(p.k.numel())), dv(size_t(p.v.numel())) {}
};

// The kernel over the whole tensors.
Grads kernel_backward(const Problem& p, const ForwardState& st, int64_t q_pos0, int64_t k_pos0,
                      cpu::BackwardSchedule schedule = cpu::BackwardSchedule::automatic) {
  cpu::AttentionBlock blk = make_block(p);
  blk.q_pos0 = q_pos0;
  blk.k_pos0 = k_pos0;
  Grads g(p);
  cpu::attention_backward(blk, p.dout.data(), st.fwd.lse.ptr<float>(), st.delta.data(), g.dq.data(),
                          g.dk.data(), g.dv.data(), schedule);
  return g;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}
bool same_bits(const Grads& a, const Grads& b) {
  return same_bits(a.dq, b.dq) && same_bits(a.dk, b.dk) && same_bits(a.dv, b.dv);
}

// ---------------------------------------------------------------- comparison

// Tolerance, relative to the gradient's scale: max |err| <= kRtol * max |ref| + kAtol over the
// whole tensor. The reference reads the same stored values as the kernel (bf16/fp16 inputs as
// rounded), so with every dtype the only error is the kernel's fp32 arithmetic (and that of its
// forward's out and lse), and bf16/fp16 need no looser bound. Measured (DATTN_TEST_PRINT_ERRORS=1)
// over every case below: max |err| / max |ref| at most 1.14e-6 (dk of S300_sharp_causal_f32,
// |err| 1.2e-5 against max |ref| 10.6; S300_D64_document_f32 and S77_D192_Dv128_window_f16 1.1e-6),
// typically 2e-7 to 8e-7, alike for fp32, bf16 and fp16; 3e-7 absolute where the exact gradient is
// 0 (S = 1: dS = P (dP - delta) vanishes). So the bound uses at most 3% of its allowance. A kernel
// that dropped a tile, a group head or the delta term misses by orders of magnitude more.
constexpr double kRtol = 1e-4, kAtol = 1e-5;

struct GradStats {
  double max_err = 0, max_ref = 0;
};

// got (fp32) against ref (float64), elementwise; NaN or inf anywhere fails.
testing::AssertionResult grad_matches(const char* name, const float* got,
                                      const std::vector<double>& ref, GradStats* stats = nullptr) {
  GradStats st;
  for (double r : ref)
    st.max_ref = std::max(st.max_ref, std::fabs(r));
  size_t worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i]))
      return testing::AssertionFailure()
             << name << "[" << i << "] = " << got[i] << ", expected " << ref[i];
    const double err = std::fabs(double(got[i]) - ref[i]);
    if (err > st.max_err) {
      st.max_err = err;
      worst = i;
    }
  }
  if (stats != nullptr) *stats = st;
  const double allow = kRtol * st.max_ref + kAtol;
  if (test::print_errors())
    std::printf("[errors] %s max|err| %.3g max|ref| %.3g rel %.3g used %.3g\n", name, st.max_err,
                st.max_ref, st.max_ref > 0 ? st.max_err / st.max_ref : 0.0, st.max_err / allow);
  if (st.max_err > allow)
    return testing::AssertionFailure()
           << name << ": max |err| " << st.max_err << " at [" << worst << "] (got " << got[worst]
           << ", expected " << ref[worst] << ") > " << allow << " = " << kRtol << " * max |ref| "
           << st.max_ref << " + " << kAtol;
  return testing::AssertionSuccess();
}

testing::AssertionResult grads_match(const float* dq, const float* dk, const float* dv,
                                     const cpu::ReferenceGrads& ref) {
  testing::AssertionResult r = grad_matches("dq", dq, ref.dq);
  if (!r) return r;
  r = grad_matches("dk", dk, ref.dk);
  if (!r) return r;
  return grad_matches("dv", dv, ref.dv);
}

// ---------------------------------------------------------------- the case table

std::vector<BackwardCase> backward_cases() {
  const Mask none = Mask::none(), causal = Mask::causal();
  std::vector<BackwardCase> cs;
  auto add = [&](BackwardCase c) { cs.push_back(c); };
  // name, B, Sq, Sk, Hq, Hkv, D, Dv, mask, dtype, q_pos0, k_pos0, q_stddev
  add({"S1_D64_causal_f32", 1, 1, 1, 1, 1, 64, 0, causal, DType::f32});
  add({"S1_D128_gqa4_none_bf16", 1, 1, 1, 4, 1, 128, 0, none, DType::bf16});
  add({"S77_D64_gqa2_none_f32", 1, 77, 77, 2, 1, 64, 0, none, DType::f32});
  add({"S77_D128_gqa4_causal_bf16", 1, 77, 77, 4, 1, 128, 0, causal, DType::bf16});
  add({"S77_D192_Dv128_window_f16", 1, 77, 77, 2, 2, 192, 128, Mask::window(20), DType::f16});
  add({"S300_D64_causal_f32", 1, 300, 300, 2, 2, 64, 0, causal, DType::f32});
  add({"S300_D128_gqa2_window_f16", 1, 300, 300, 2, 1, 128, 0, Mask::window(100), DType::f16});
  add({"S300_D192_Dv128_gqa2_causal_bf16", 1, 300, 300, 2, 1, 192, 128, causal, DType::bf16});
  add({"S300_D64_document_f32", 1, 300, 300, 2, 1, 64, 0, Mask::document({0, 1, 120, 300}, false),
       DType::f32});
  add({"S513_D64_gqa4_none_bf16", 1, 513, 513, 4, 1, 64, 0, none, DType::bf16});
  add({"S513_D128_causal_f32", 1, 513, 513, 1, 1, 128, 0, causal, DType::f32});
  add({"S513_D192_Dv128_document_causal_f32", 1, 513, 513, 2, 2, 192, 128,
       Mask::document({0, 100, 350, 513}, true), DType::f32});
  add({"S513_D64_causal_f16", 1, 513, 513, 2, 1, 64, 0, causal, DType::f16});
  add({"S1100_D64_gqa2_causal_f32", 1, 1100, 1100, 2, 1, 64, 0, causal, DType::f32});
  add({"S1100_D64_document_bf16", 1, 1100, 1100, 1, 1, 64, 0,
       Mask::document({0, 256, 700, 1100}, false), DType::bf16});
  add({"S1100_D128_window300_f32", 1, 1100, 1100, 1, 1, 128, 0, Mask::window(300), DType::f32});
  add({"B2_S150_D64_gqa2_causal_f16", 2, 150, 150, 4, 2, 64, 0, causal, DType::f16});
  add({"B3_S40_D128_Dv64_none_bf16", 3, 40, 40, 2, 2, 128, 64, none, DType::bf16});
  // A query block attending to earlier keys (a causal shard meeting an earlier shard), and keys
  // starting after the first queries (rows 0..149 see no key).
  add({"Sq100_at1000_Sk1100_causal_f32", 1, 100, 1100, 2, 1, 64, 0, causal, DType::f32, 1000, 0});
  add({"Sq300_at0_Sk200_at150_causal_bf16", 1, 300, 200, 2, 1, 64, 0, causal, DType::bf16, 0, 150});
  // Window + offsets: query at 500 + i sees keys [436 + i, 500 + i] of 0..512, so rows from
  // i = 77 on see none; keys 0..435 are seen by no query.
  add({"Sq300_at500_Sk513_window64_f32", 1, 300, 513, 2, 2, 64, 0, Mask::window(64), DType::f32,
       500, 0});
  add({"Sq260_Sk33_none_f16", 1, 260, 33, 2, 2, 64, 0, none, DType::f16});
  // Sharp softmax (scores ~ 4x larger): P dominated by a few keys.
  add({"S300_sharp_causal_f32", 1, 300, 300, 2, 2, 64, 0, causal, DType::f32, 0, 0, 4.f});
  // Every key in the queries' future: everything hidden, all gradients exactly 0.
  add({"keys_in_future_causal_bf16", 1, 140, 270, 2, 1, 64, 0, causal, DType::bf16, 1000, 1140});
  return cs;
}

class BackwardVsReference : public testing::TestWithParam<BackwardCase> {};

// The public entry point (forward, delta, kernel) against the float64 reference; rows that see no
// key have dq exactly 0 and keys no query sees have dk, dv exactly 0.
TEST_P(BackwardVsReference, AttentionLocalBackward) {
  const BackwardCase& c = GetParam();
  Problem p = make_problem(c);
  const Partial fwd = attention_local(p.q, p.k, p.v, p.spec, c.q_pos0, c.k_pos0);
  const Gradients g =
      attention_local_backward(p.q, p.k, p.v, fwd, p.dout, p.spec, c.q_pos0, c.k_pos0);
  ASSERT_EQ(g.dq.dtype(), DType::f32);
  ASSERT_EQ(g.dk.dtype(), DType::f32);
  ASSERT_EQ(g.dv.dtype(), DType::f32);
  ASSERT_EQ(g.dq.shape(), (std::array<int64_t, 4>{c.B, c.Sq, c.Hq, c.D}));
  ASSERT_EQ(g.dk.shape(), (std::array<int64_t, 4>{c.B, c.Sk, c.Hkv, c.D}));
  ASSERT_EQ(g.dv.shape(), (std::array<int64_t, 4>{c.B, c.Sk, c.Hkv, p.spec.dim_v()}));
  const auto ref =
      cpu::attention_backward_reference(p.q, p.k, p.v, p.dout, p.spec, c.q_pos0, c.k_pos0);
  EXPECT_TRUE(grads_match(g.dq.ptr<float>(), g.dk.ptr<float>(), g.dv.ptr<float>(), ref));
  // Exactly zero (and not merely small) for a query row that sees no key and a key no query sees.
  const int64_t dv = p.spec.dim_v();
  for (int64_t i = 0; i < c.Sq; ++i) {
    bool sees = false;
    for (int64_t j = 0; j < c.Sk && !sees; ++j)
      sees = c.mask.visible(c.q_pos0 + i, c.k_pos0 + j);
    for (int64_t b = 0; b < c.B && !sees; ++b)
      for (int64_t e = 0; e < c.Hq * c.D; ++e)
        ASSERT_EQ(g.dq.get((b * c.Sq + i) * c.Hq * c.D + e), 0.f) << "query row " << i;
  }
  for (int64_t j = 0; j < c.Sk; ++j) {
    bool seen = false;
    for (int64_t i = 0; i < c.Sq && !seen; ++i)
      seen = c.mask.visible(c.q_pos0 + i, c.k_pos0 + j);
    for (int64_t b = 0; b < c.B && !seen; ++b) {
      for (int64_t e = 0; e < c.Hkv * c.D; ++e)
        ASSERT_EQ(g.dk.get((b * c.Sk + j) * c.Hkv * c.D + e), 0.f) << "key row " << j;
      for (int64_t e = 0; e < c.Hkv * dv; ++e)
        ASSERT_EQ(g.dv.get((b * c.Sk + j) * c.Hkv * dv + e), 0.f) << "key row " << j;
    }
  }
}

// Every schedule, and every thread count, gives the same bits; so does a second call.
TEST_P(BackwardVsReference, SchedulesAndThreadCountsAgreeBitwise) {
  const BackwardCase& c = GetParam();
  Problem p = make_problem(c, 2);
  const ForwardState st = forward_state(p, c.q_pos0, c.k_pos0);
  const Grads fused = kernel_backward(p, st, c.q_pos0, c.k_pos0, cpu::BackwardSchedule::fused);
  const Grads two = kernel_backward(p, st, c.q_pos0, c.k_pos0, cpu::BackwardSchedule::two_pass);
  EXPECT_TRUE(same_bits(fused, two)) << "fused and two_pass differ";
  const int threads = omp_get_max_threads();
  for (int t : {1, 2, 3}) {
    omp_set_num_threads(t);
    const Grads a = kernel_backward(p, st, c.q_pos0, c.k_pos0);
    EXPECT_TRUE(same_bits(a, fused)) << "automatic on " << t << " threads differs from fused";
  }
  omp_set_num_threads(threads);
}

INSTANTIATE_TEST_SUITE_P(Cases, BackwardVsReference, testing::ValuesIn(backward_cases()),
                         [](const testing::TestParamInfo<BackwardCase>& info) {
                           return info.param.name;
                         });

// ---------------------------------------------------------------- empty documents

// Repeated cu_seqlens entries (empty documents at the start, in the middle, in a row, at the
// end): the gradients match the float64 reference of the boundaries without them and are, bit
// for bit, those of the call without them. Also with queries at an offset; fp32, bf16 and fp16
// in turn.
TEST(BackwardEmptyDocuments, MatchReferenceAndTheCallWithoutThem) {
  const DType dtypes[] = {DType::f32, DType::bf16, DType::f16};
  int n = 0;
  for (const auto& [name, cu] : test::empty_documents_cases(300)) {
    for (bool causal : {true, false}) {
      const int64_t q_pos0 = n % 2 == 0 ? 0 : 120;
      const Mask mask = Mask::document(cu, causal);
      BackwardCase c{name, 1, 300 - q_pos0, 300, 4, 2, 64, 32, mask, dtypes[n++ % 3], q_pos0, 0};
      SCOPED_TRACE(testing::Message() << name << " " << mask.str() << " " << dtype_name(c.dtype)
                                      << " queries at " << q_pos0);
      Problem p = make_problem(c, 17);
      Problem w = p;
      w.spec.mask = test::without_empty_documents(mask);
      const Partial fwd = attention_local(p.q, p.k, p.v, p.spec, q_pos0, 0);
      const Gradients g = attention_local_backward(p.q, p.k, p.v, fwd, p.dout, p.spec, q_pos0, 0);
      const auto ref = cpu::attention_backward_reference(w.q, w.k, w.v, w.dout, w.spec, q_pos0, 0);
      EXPECT_TRUE(grads_match(g.dq.ptr<float>(), g.dk.ptr<float>(), g.dv.ptr<float>(), ref));
      const Partial fwd_w = attention_local(w.q, w.k, w.v, w.spec, q_pos0, 0);
      const Gradients gw =
          attention_local_backward(w.q, w.k, w.v, fwd_w, w.dout, w.spec, q_pos0, 0);
      for (auto [x, y, what] : {std::tuple{&fwd.out, &fwd_w.out, "out"},
                                {&fwd.lse, &fwd_w.lse, "lse"},
                                {&g.dq, &gw.dq, "dq"},
                                {&g.dk, &gw.dk, "dk"},
                                {&g.dv, &gw.dv, "dv"}})
        EXPECT_EQ(std::memcmp(x->data(), y->data(), x->nbytes()), 0) << what;
    }
  }
}

// ---------------------------------------------------------------- the reference itself

// The float64 reference backward against central differences of the float64 forward
// (attention_reference) of L = sum(dout * out), in a tiny case with GQA, D_v != D, a causal mask
// and offsets (row 0 sees no key). Inputs are multiples of 2^-14 and the step is 2^-12, so x +- h
// is exact in fp32 storage; the truncation error is O(h^2) ~ 1e-7.
TEST(ReferenceBackward, MatchesFiniteDifferences) {
  BackwardCase c{"fd", 1, 5, 6, 4, 2, 3, 2, Mask::causal(), DType::f32, 2, 3};
  Problem p = make_problem(c, 21);
  for (Tensor* t : {&p.q, &p.k, &p.v, &p.dout})
    for (int64_t i = 0; i < t->numel(); ++i)
      t->set(i, std::ldexp(std::nearbyint(std::ldexp(t->get(i), 14)), -14));
  auto loss = [&] {
    const auto r = cpu::attention_reference(p.q, p.k, p.v, p.spec, c.q_pos0, c.k_pos0);
    double l = 0;
    for (size_t i = 0; i < r.out.size(); ++i)
      l += double(p.dout.get(int64_t(i))) * r.out[i];
    return l;
  };
  const auto ref =
      cpu::attention_backward_reference(p.q, p.k, p.v, p.dout, p.spec, c.q_pos0, c.k_pos0);
  const double h = std::ldexp(1.0, -12);
  double max_err = 0;
  int nonzero = 0;
  for (auto [t, g, name] :
       {std::tuple{&p.q, &ref.dq, "dq"}, {&p.k, &ref.dk, "dk"}, {&p.v, &ref.dv, "dv"}}) {
    ASSERT_EQ(size_t(t->numel()), g->size());
    for (int64_t i = 0; i < t->numel(); ++i) {
      const float x = t->get(i);
      t->set(i, float(x + h));
      const double up = loss();
      t->set(i, float(x - h));
      const double down = loss();
      t->set(i, x);
      const double fd = (up - down) / (2 * h);
      max_err = std::max(max_err, std::fabs(fd - (*g)[size_t(i)]));
      nonzero += (*g)[size_t(i)] != 0.0;
      ASSERT_NEAR((*g)[size_t(i)], fd, 1e-6) << name << "[" << i << "]";
    }
  }
  if (test::print_errors()) std::printf("[errors] finite differences: max |err| %.3g\n", max_err);
  EXPECT_GT(nonzero, 40);  // the check is not vacuous
  // Query position 2 sees no key (keys start at 3): its dq row is exactly 0.
  for (int64_t h2 = 0; h2 < c.Hq; ++h2)
    for (int64_t d = 0; d < c.D; ++d)
      EXPECT_EQ(ref.dq[size_t(h2 * c.D + d)], 0.0);
}

// ---------------------------------------------------------------- delta

TEST(BackwardDelta, RowSumOfDoutTimesOut) {
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dt));
    const int64_t B = 2, S = 37, H = 3, Dv = 40;
    const Tensor dout = random_tensor({B, S, H, Dv}, dt, 31);
    const Tensor out = random_tensor({B, S, H, Dv}, DType::f32, 32);
    std::vector<float> delta(size_t(B * H * S), NAN);
    cpu::attention_backward_delta(dout.data(), dt, out.ptr<float>(), B, S, H, Dv, delta.data());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t h = 0; h < H; ++h) {
          double want = 0;
          for (int64_t d = 0; d < Dv; ++d) {
            const int64_t i = ((b * S + s) * H + h) * Dv + d;
            want += double(dout.get(i)) * double(out.get(i));
          }
          ASSERT_NEAR(delta[size_t((b * H + h) * S + s)], want, 1e-6 * (1 + std::fabs(want)));
        }
  }
}

// ---------------------------------------------------------------- determinism

// Two calls of the public entry point give the same bits (no atomics, fixed order).
TEST(BackwardDeterminism, TwoCallsBitIdentical) {
  BackwardCase c{"det", 2, 700, 700, 4, 2, 64, 0, Mask::causal(), DType::bf16};
  Problem p = make_problem(c, 5);
  const Partial fwd = attention_local(p.q, p.k, p.v, p.spec);
  const Gradients a = attention_local_backward(p.q, p.k, p.v, fwd, p.dout, p.spec);
  const Gradients b = attention_local_backward(p.q, p.k, p.v, fwd, p.dout, p.spec);
  for (auto [x, y] : {std::pair{&a.dq, &b.dq}, {&a.dk, &b.dk}, {&a.dv, &b.dv}})
    EXPECT_EQ(std::memcmp(x->data(), y->data(), x->nbytes()), 0);
}

// ---------------------------------------------------------------- accumulation over blocks

// Rows of a bshd tensor (dimension 1), in the given order.
Tensor take_rows(const Tensor& t, const std::vector<int64_t>& rows) {
  const int64_t B = t.size(0), S = t.size(1), inner = t.size(2) * t.size(3);
  const int64_t n = int64_t(rows.size());
  Tensor r = Tensor::empty({B, n, t.size(2), t.size(3)}, t.dtype());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t e = 0; e < inner; ++e)
        r.set((b * n + i) * inner + e, t.get((b * S + rows[size_t(i)]) * inner + e));
  return r;
}

// The way a distributed backward calls the kernel: the queries in two interleaved halves at
// strided positions (blocks of 3 positions, 6 apart: rows 0,1,2,6,7,8,... and 3,4,5,9,10,11,...),
// each against the keys in two blocks, dk and dv accumulating over the four calls, with the lse
// and delta of the whole attention. Together they give the whole attention's gradients.
TEST(BackwardAccumulation, StridedQueryHalvesAndKeyBlocksSumToTheWhole) {
  for (Mask mask : {Mask::causal(), Mask::window(150), Mask::document({0, 200, 410, 600}, true)}) {
    SCOPED_TRACE(mask.str());
    BackwardCase c{"acc", 1, 600, 600, 4, 2, 64, 0, mask, DType::bf16};
    Problem p = make_problem(c, 9);
    const ForwardState st = forward_state(p, 0, 0);
    const auto ref = cpu::attention_backward_reference(p.q, p.k, p.v, p.dout, p.spec);
    std::vector<float> dk(size_t(p.k.numel())), dv(size_t(p.v.numel()));
    std::vector<float> dq(size_t(p.q.numel()));  // the halves' rows scattered back
    const int64_t inner_q = c.Hq * c.D;
    for (int64_t half : {1, 0}) {
      std::vector<int64_t> rows;
      for (int64_t i = 0; i < c.Sq; ++i)
        if ((i / 3) % 2 == half) rows.push_back(i);
      const int64_t n = int64_t(rows.size());
      Problem ph = p;
      ph.q = take_rows(p.q, rows);
      ph.dout = take_rows(p.dout, rows);
      std::vector<float> lse(size_t(c.Hq * n)), delta(size_t(c.Hq * n));
      for (int64_t h = 0; h < c.Hq; ++h)
        for (int64_t i = 0; i < n; ++i) {
          lse[size_t(h * n + i)] = st.fwd.lse.get(h * c.Sq + rows[size_t(i)]);
          delta[size_t(h * n + i)] = st.delta[size_t(h * c.Sq + rows[size_t(i)])];
        }
      std::vector<float> dq_half(size_t(ph.q.numel()));
      cpu::AttentionBlock blk = make_block(ph);
      blk.q_pos0 = 3 * half;
      blk.q_pos_block = 3;
      blk.q_pos_stride = 6;
      for (auto [begin, len] : {std::pair<int64_t, int64_t>{350, 250}, {0, 350}}) {
        blk.k_begin = begin;
        blk.k_len = len;
        blk.k_pos0 = begin;
        cpu::attention_backward(blk, ph.dout.data(), lse.data(), delta.data(), dq_half.data(),
                                dk.data(), dv.data());
      }
      for (int64_t i = 0; i < n; ++i)
        std::copy_n(dq_half.data() + i * inner_q, inner_q, dq.data() + rows[size_t(i)] * inner_q);
    }
    EXPECT_TRUE(grads_match(dq.data(), dk.data(), dv.data(), ref));
  }
}

// ---------------------------------------------------------------- the API's checks

TEST(AttentionLocalBackward, Fp32DoutOfBf16Inputs) {
  BackwardCase c{"mixed", 1, 300, 300, 4, 2, 64, 0, Mask::causal(), DType::bf16};
  Problem p = make_problem(c, 13);
  p.dout = random_tensor({1, 300, 4, 64}, DType::f32, 99);  // not representable in bf16
  const Partial fwd = attention_local(p.q, p.k, p.v, p.spec);
  const Gradients g = attention_local_backward(p.q, p.k, p.v, fwd, p.dout, p.spec);
  const auto ref = cpu::attention_backward_reference(p.q, p.k, p.v, p.dout, p.spec);
  EXPECT_TRUE(grads_match(g.dq.ptr<float>(), g.dk.ptr<float>(), g.dv.ptr<float>(), ref));
}

TEST(AttentionLocalBackward, RejectsBadInputsNamingThem) {
  BackwardCase c{"bad", 1, 10, 12, 4, 2, 64, 32, Mask::none(), DType::f32};
  Problem p = make_problem(c, 14);
  const Partial fwd = attention_local(p.q, p.k, p.v, p.spec);
  using test::throws_naming;
  auto call = [&](const Tensor& dout, const Partial& f) {
    return [&p, dout, f] { attention_local_backward(p.q, p.k, p.v, f, dout, p.spec); };
  };
  const Tensor dout_dv = random_tensor({1, 10, 4, 64}, DType::f32, 1);  // D instead of D_v
  EXPECT_TRUE(throws_naming(call(dout_dv, fwd), {"dout shape", "head_dim_v"}));
  const Tensor dout_rank = random_tensor({10, 4, 32}, DType::f32, 1);
  EXPECT_TRUE(throws_naming(call(dout_rank, fwd), {"dout rank"}));
  Partial bad_lse{fwd.out, random_tensor({1, 10, 4}, DType::f32, 2)};  // [B, S, H]: transposed
  EXPECT_TRUE(throws_naming(call(p.dout, bad_lse), {"fwd.lse shape"}));
  Partial bad_out{fwd.out.to(DType::bf16), fwd.lse};
  EXPECT_TRUE(throws_naming(call(p.dout, bad_out), {"fwd.out dtype"}));
  Partial no_out{Tensor(), fwd.lse};
  EXPECT_TRUE(throws_naming(call(p.dout, no_out), {"fwd.out rank"}));
  const Tensor k_bad = random_tensor({1, 12, 2, 32}, DType::f32, 3);
  EXPECT_TRUE(throws_naming([&] { attention_local_backward(p.q, k_bad, p.v, fwd, p.dout, p.spec); },
                            {"k head_dim"}));
}

}  // namespace
}  // namespace dattn
