// GPU tests of the CUDA split-KV decode kernel: dattn::cuda::decode_forward against the float64
// reference (out and lse) over S_q = 1..16, GQA 1/4/8, D 64..256 and D != Dv, contexts that fill no
// tile or split, bf16 and fp16, masks and documents on global positions (empty documents too);
// merging into a running partial, empty key ranges, hidden NaN, run-to-run bits, validation, and
// the dispatch's rule.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/reference.h"
#include "kernels/cuda/attention_cuda.h"
#include "kernels/cuda/decode_cuda.h"
#include "kernels/cuda/device_buffer.h"
#include "src/base/cuda_check.h"
#include "src/base/error.h"
#include "tests/test_reference.h"

namespace dattn {
namespace {

using cuda::DeviceBuffer;

// ---------------------------------------------------------------- one decode problem

// Query row i at q_pos0 + i * q_stride, key row j at k_pos0 + j * k_stride.
struct DecodeCase {
  std::string name;
  int64_t B = 1, Sq = 1, Sk = 1, Hq = 1, Hkv = 1, D = 64, Dv = 0;
  Mask mask = Mask::none();
  int64_t q_pos0 = 0, q_stride = 1, k_pos0 = 0, k_stride = 1;
};

// The case's tensors on the host and the device, and a running partial (empty to begin with).
struct DecodeProblem {
  DecodeCase c;
  AttnSpec spec;
  Tensor q, k, v;
  std::unique_ptr<DeviceBuffer> dq, dk, dv, out, lse, cu;
  std::vector<float> h_out, h_lse;

  DecodeProblem(const DecodeCase& dc, DType dt, uint64_t seed = 1) : c(dc) {
    spec.heads_q = c.Hq;
    spec.heads_kv = c.Hkv;
    spec.head_dim = c.D;
    spec.head_dim_v = c.Dv;
    spec.mask = c.mask;
    q = test::random_tensor({c.B, c.Sq, c.Hq, c.D}, dt, seed * 3 + 0);
    k = test::random_tensor({c.B, c.Sk, c.Hkv, c.D}, dt, seed * 3 + 1);
    v = test::random_tensor({c.B, c.Sk, c.Hkv, spec.dim_v()}, dt, seed * 3 + 2);
    h_out.assign(size_t(c.B * c.Sq * c.Hq * spec.dim_v()), 0.f);
    h_lse.assign(size_t(c.B * c.Hq * c.Sq), -INFINITY);
    upload_inputs();
    out = std::make_unique<DeviceBuffer>(h_out.size() * 4);
    lse = std::make_unique<DeviceBuffer>(h_lse.size() * 4);
    if (spec.mask.documents)
      cu = std::make_unique<DeviceBuffer>(spec.mask.documents->data(),
                                          spec.mask.documents->size() * sizeof(int64_t));
    push();
  }
  // After a change to q, k or v on the host.
  void upload_inputs() {
    dq = std::make_unique<DeviceBuffer>(q.data(), q.nbytes());
    dk = std::make_unique<DeviceBuffer>(k.data(), k.nbytes());
    dv = std::make_unique<DeviceBuffer>(v.data(), v.nbytes());
  }
  cuda::AttentionBlock block() const {
    cuda::AttentionBlock b;
    b.q = dq->get();
    b.k = dk->get();
    b.v = dv->get();
    b.dtype = q.dtype();
    b.batch = c.B;
    b.seq_q = c.Sq;
    b.seq_k = c.Sk;
    b.heads_q = c.Hq;
    b.heads_kv = c.Hkv;
    b.head_dim = c.D;
    b.head_dim_v = spec.dim_v();
    b.scale = spec.scale();
    b.q_pos0 = c.q_pos0;
    b.q_pos_stride = c.q_stride;
    b.k_pos0 = c.k_pos0;
    b.k_pos_stride = c.k_stride;
    cuda::set_mask(b, spec.mask, cu ? cu->get<int64_t>() : nullptr);
    return b;
  }
  void push() {
    out->upload(h_out.data());
    lse->upload(h_lse.data());
  }
  void pull() {
    DATTN_CUDA_CHECK(cudaDeviceSynchronize());
    out->download(h_out.data());
    lse->download(h_lse.data());
  }
  void decode(const cuda::AttentionBlock& b) {
    cuda::decode_forward(b, out->get<float>(), lse->get<float>(), nullptr);
    pull();
  }
  cpu::ReferenceResult reference() const {
    return test::naive_reference(q, k, v, spec, test::positions(c.q_pos0, c.Sq, c.q_stride),
                                 test::positions(c.k_pos0, c.Sk, c.k_stride));
  }
  testing::AssertionResult matches(const cpu::ReferenceResult& ref) const;
};

// fp32 scores, softmax and accumulation from 16-bit inputs, as in the CPU kernel: its tolerances
// (the largest error measured over these cases, 65537 keys included, is about 1/100 of them).
test::Tolerance decode_tolerance(DType dt) {
  return test::tolerance_for(dt);
}

testing::AssertionResult DecodeProblem::matches(const cpu::ReferenceResult& ref) const {
  test::CompareStats st;
  auto r = test::matches_reference(h_out.data(), h_lse.data(), c.B, c.Sq, c.Hq, spec.dim_v(), ref,
                                   decode_tolerance(q.dtype()), &st);
  if (test::print_errors())
    std::printf("[err] %s %s out %.3g lse %.3g ratio %.3g empty rows %lld\n", c.name.c_str(),
                dtype_name(q.dtype()), st.max_out_err, st.max_lse_err, st.max_ratio,
                static_cast<long long>(st.empty_rows));
  return r;
}

// ---------------------------------------------------------------- the case table

std::vector<DecodeCase> decode_cases() {
  const Mask N = Mask::none(), C = Mask::causal();
  std::vector<DecodeCase> cs;
  // name, B, Sq, Sk, Hq, Hkv, D, Dv, mask, q_pos0, q_stride, k_pos0, k_stride
  cs.push_back({"Sq1_Sk1_D64", 1, 1, 1, 1, 1, 64, 0, C, 0});
  cs.push_back({"Sq1_Sk31_gqa8_D128_causal", 1, 1, 31, 8, 1, 128, 0, C, 31});
  cs.push_back({"Sq2_Sk1000_gqa4_D64", 1, 2, 1000, 8, 2, 64, 0, N});
  cs.push_back({"Sq7_Sk1000_gqa8_D256_causal", 1, 7, 1000, 8, 1, 256, 0, C, 995});
  cs.push_back({"Sq16_Sk1000_gqa8_D128_causal", 1, 16, 1000, 16, 2, 128, 0, C, 990});
  cs.push_back({"Sq16_Sk31_D256", 1, 16, 31, 2, 2, 256, 0, N});
  cs.push_back({"Sq1_Sk65537_gqa8_D128_causal", 1, 1, 65537, 8, 1, 128, 0, C, 65537});
  cs.push_back({"Sq1_Sk1000_gqa1_H8_D128_causal", 1, 1, 1000, 8, 8, 128, 0, C, 1000});
  cs.push_back({"Sq7_Sk1000_gqa4_D192_Dv128_causal", 1, 7, 1000, 4, 1, 192, 128, C, 1000});
  // Dims that are no multiple of 8: element loads instead of 16-byte ones.
  cs.push_back({"Sq2_Sk300_gqa2_D40_Dv24", 1, 2, 300, 4, 2, 40, 24, N});
  cs.push_back({"B2_Sq2_Sk1000_gqa2_D128_causal", 2, 2, 1000, 4, 2, 128, 0, C, 1000});
  // Windows: a sliding window far behind the keys' start (the split covers its band only), a
  // two-sided one around queries in the middle of the keys.
  cs.push_back(
      {"Sq1_Sk65537_gqa4_D64_window4096", 1, 1, 65537, 4, 1, 64, 0, Mask::window(4096, 0), 65536});
  cs.push_back(
      {"Sq7_Sk1000_gqa4_D64_window100_50", 1, 7, 1000, 4, 1, 64, 0, Mask::window(100, 50), 500});
  // Strided positions (queries every 3rd position, keys every 2nd).
  cs.push_back({"Sq7_Sk1000_gqa4_D128_strided_causal", 1, 7, 1000, 4, 1, 128, 0, C, 1990, 3, 0, 2});
  // Documents: the queries in the last one; queries spanning two, the second with no key (empty
  // rows: lse exactly -inf).
  cs.push_back({"Sq2_Sk1000_gqa4_D64_docs_causal", 1, 2, 1000, 4, 1, 64, 0,
                Mask::document({0, 300, 301, 777, 1100}, true), 1000});
  cs.push_back({"Sq7_Sk1000_gqa2_D64_docs_span", 1, 7, 1000, 2, 1, 64, 0,
                Mask::document({0, 400, 1003, 1010}, false), 1000});
  // Three batches, D = 96 (12 column chunks: the value phase's row groups do not divide the CTA),
  // documents on strided positions.
  cs.push_back({"B3_Sq5_Sk777_gqa2_D96_docs_strided", 3, 5, 777, 6, 3, 96, 0,
                Mask::document({0, 500, 1200, 2000}, true), 1500, 2, 0, 2});
  return cs;
}

struct Param {
  DecodeCase c;
  DType dt;
};

class CudaDecodeVsReference : public testing::TestWithParam<Param> {};

TEST_P(CudaDecodeVsReference, DecodeForward) {
  DecodeProblem p(GetParam().c, GetParam().dt);
  p.decode(p.block());
  EXPECT_TRUE(p.matches(p.reference()));
}

std::vector<Param> all_params() {
  std::vector<Param> ps;
  for (const DecodeCase& c : decode_cases())
    for (DType dt : {DType::bf16, DType::f16})
      ps.push_back({c, dt});
  return ps;
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaDecodeVsReference, testing::ValuesIn(all_params()),
                         [](const testing::TestParamInfo<Param>& info) {
                           return info.param.c.name + "_" +
                                  (info.param.dt == DType::bf16 ? "bf16" : "fp16");
                         });

// ---------------------------------------------------------------- empty documents

// Repeated cu_seqlens entries among the keys (empty documents at the start, in the middle, in a
// row, at the end): the decode matches the float64 reference of the boundaries without them and
// is, bit for bit, what the kernel gives without them. The queries sit in the last document and
// at its start, contiguous and strided keys, bf16 and fp16 in turn.
TEST(CudaDecodeEmptyDocuments, MatchReferenceAndTheCallWithoutThem) {
  int n = 0;
  for (const auto& [name, cu] : test::empty_documents_cases(1000)) {
    const DType dt = n % 2 == 0 ? DType::bf16 : DType::f16;
    const int64_t stride = n++ % 3 == 1 ? 2 : 1;
    for (int64_t q_pos0 : {int64_t(995), int64_t(498)}) {
      DecodeCase c{name,   1, 5, 1000 / stride, 4, 1, 64, 0, Mask::document(cu, true),
                   q_pos0, 1, 0, stride};
      DecodeCase w = c;
      w.mask = test::without_empty_documents(c.mask);
      SCOPED_TRACE(testing::Message() << name << " " << dtype_name(dt) << " queries at " << q_pos0
                                      << " keys every " << stride);
      DecodeProblem p(c, dt), pw(w, dt);
      p.decode(p.block());
      pw.decode(pw.block());
      EXPECT_TRUE(p.matches(pw.reference()));
      EXPECT_EQ(std::memcmp(p.h_out.data(), pw.h_out.data(), p.h_out.size() * sizeof(float)), 0)
          << "out differs from the call without empty documents";
      EXPECT_EQ(std::memcmp(p.h_lse.data(), pw.h_lse.data(), p.h_lse.size() * sizeof(float)), 0)
          << "lse differs from the call without empty documents";
    }
  }
}

// ---------------------------------------------------------------- merging and sub-ranges

// Three uneven key blocks merged in the order 2, 0, 1 into one partial = the reference over all
// keys. Then the same with the first block attended by the forward kernel, so that the two
// kernels' partials merge too: within the forward's bf16/fp16 tolerance (it rounds P to the input
// dtype; tests/gpu/test_cuda_attention.cpp).
TEST(CudaDecodeMerge, UnevenKeyBlocksIntoARunningPartial) {
  for (DType dt : {DType::bf16, DType::f16})
    for (bool forward_first : {false, true}) {
      SCOPED_TRACE(testing::Message() << dtype_name(dt) << " forward first " << forward_first);
      DecodeProblem p({"merge", 2, 3, 1000, 8, 2, 64, 0, Mask::causal(), 999}, dt, 4);
      const int64_t cuts[] = {0, 400, 401, 1000};
      for (int i : {2, 0, 1}) {
        cuda::AttentionBlock b = p.block();
        b.k_begin = cuts[i];
        b.k_len = cuts[i + 1] - cuts[i];
        b.k_pos0 = cuts[i];
        if (i == 2 && forward_first)
          cuda::attention_forward(b, p.out->get<float>(), p.lse->get<float>(), nullptr);
        else
          cuda::decode_forward(b, p.out->get<float>(), p.lse->get<float>(), nullptr);
      }
      p.pull();
      if (!forward_first) {
        EXPECT_TRUE(p.matches(p.reference()));
        continue;
      }
      const test::Tolerance forward_tol = dt == DType::bf16
                                              ? test::Tolerance{1e-2, 1e-2, 1e-4, 1e-4}
                                              : test::Tolerance{3e-3, 3e-3, 1e-4, 1e-4};
      EXPECT_TRUE(test::matches_reference(p.h_out.data(), p.h_lse.data(), p.c.B, p.c.Sq, p.c.Hq,
                                          p.spec.dim_v(), p.reference(), forward_tol));
    }
}

// Query rows [q_begin, q_begin + q_len) x keys [k_begin, k_begin + k_len): those rows match the
// reference over the sliced tensors; every other row keeps its (sentinel) partial bit for bit.
TEST(CudaDecodeMerge, RowSubRangesLeaveOtherRowsAlone) {
  DecodeProblem p({"sub", 2, 12, 700, 8, 2, 64, 48, Mask::causal()}, DType::bf16, 6);
  const int64_t qb = 3, ql = 5, kb = 7, kl = 650, qp0 = 800, kp0 = 100, dv = 48;
  for (int64_t b = 0; b < p.c.B; ++b)
    for (int64_t s = 0; s < p.c.Sq; ++s)
      for (int64_t h = 0; h < p.c.Hq; ++h) {
        if (s >= qb && s < qb + ql) continue;
        p.h_lse[size_t((b * p.c.Hq + h) * p.c.Sq + s)] = 1.5f + float(s);
        for (int64_t d = 0; d < dv; ++d)
          p.h_out[size_t(((b * p.c.Sq + s) * p.c.Hq + h) * dv + d)] = float(d) - 0.25f;
      }
  p.push();
  const std::vector<float> out0 = p.h_out, lse0 = p.h_lse;
  cuda::AttentionBlock b = p.block();
  b.q_begin = qb;
  b.q_len = ql;
  b.k_begin = kb;
  b.k_len = kl;
  b.q_pos0 = qp0;
  b.k_pos0 = kp0;
  p.decode(b);
  auto ref =
      test::naive_reference(p.q.seq_slice(qb, ql), p.k.seq_slice(kb, kl), p.v.seq_slice(kb, kl),
                            p.spec, test::positions(qp0, ql), test::positions(kp0, kl));
  int64_t changed = 0;
  std::vector<float> out_blk, lse_blk(size_t(p.c.B * p.c.Hq * ql));
  for (int64_t b2 = 0; b2 < p.c.B; ++b2)
    for (int64_t s = 0; s < p.c.Sq; ++s)
      for (int64_t h = 0; h < p.c.Hq; ++h) {
        const size_t l = size_t((b2 * p.c.Hq + h) * p.c.Sq + s);
        const size_t o = size_t(((b2 * p.c.Sq + s) * p.c.Hq + h) * dv);
        if (s >= qb && s < qb + ql) {
          lse_blk[size_t((b2 * p.c.Hq + h) * ql + s - qb)] = p.h_lse[l];
          continue;
        }
        if (std::memcmp(&p.h_lse[l], &lse0[l], 4) != 0) ++changed;
        if (std::memcmp(&p.h_out[o], &out0[o], size_t(dv) * 4) != 0) ++changed;
      }
  for (int64_t b2 = 0; b2 < p.c.B; ++b2)
    for (int64_t s = qb; s < qb + ql; ++s)
      for (int64_t h = 0; h < p.c.Hq; ++h)
        for (int64_t d = 0; d < dv; ++d)
          out_blk.push_back(p.h_out[size_t(((b2 * p.c.Sq + s) * p.c.Hq + h) * dv + d)]);
  EXPECT_EQ(changed, 0) << "values outside the block's query rows were written";
  EXPECT_TRUE(test::matches_reference(out_blk.data(), lse_blk.data(), p.c.B, ql, p.c.Hq, dv, ref,
                                      decode_tolerance(DType::bf16)));
}

// ---------------------------------------------------------------- empty key ranges

// No keys, keys all in the future (causal), a window that hides them all (nothing launched) and
// documents that hide them all (every split empty) leave a non-empty partial bit for bit unchanged.
TEST(CudaDecodeEmpty, HiddenOrNoKeysLeaveAPartialUnchanged) {
  DecodeProblem p({"empty", 1, 2, 600, 4, 2, 64, 0, Mask::causal(), 600}, DType::f16, 7);
  p.decode(p.block());
  const std::vector<float> out0 = p.h_out, lse0 = p.h_lse;
  for (float l : lse0)
    ASSERT_TRUE(std::isfinite(l));
  auto unchanged = [&](const char* what) {
    EXPECT_EQ(std::memcmp(p.h_out.data(), out0.data(), out0.size() * 4), 0) << what;
    EXPECT_EQ(std::memcmp(p.h_lse.data(), lse0.data(), lse0.size() * 4), 0) << what;
  };
  cuda::AttentionBlock b = p.block();
  b.k_len = 0;
  p.decode(b);
  unchanged("k_len = 0");
  b = p.block();
  b.k_pos0 = 700;  // after both queries
  p.decode(b);
  unchanged("keys in the future");
  b = p.block();
  b.left = 10;  // keys 0..599 at positions 0..599, queries at 600, 601: window of 10 from 590
  b.k_len = 580;
  p.decode(b);
  unchanged("window hides every key");
  const std::vector<int64_t> docs = {0, 600, 700};  // the queries' document holds no key
  DeviceBuffer cu(docs.data(), docs.size() * sizeof(int64_t));
  b = p.block();
  cuda::set_mask(b, Mask::document(docs, true), cu.get<int64_t>());
  p.decode(b);
  unchanged("another document");
}

// ---------------------------------------------------------------- non-finite inputs

// NaN and inf in K and V rows the mask hides from a row never reach it: it comes out bit for bit as
// with clean inputs, also in a partly visible tile, where its p is 0 and 0 * NaN would be NaN.
// Rows that see a bad row get non-finite values. Queries at positions 999 and 1000, keys 0..999.
TEST(CudaDecodeNonFinite, HiddenGarbageReachesOnlyTheRowsThatSeeIt) {
  struct Setup {
    const char* what;
    Mask mask;
    std::vector<int64_t> hidden;  // hidden from both queries
    int64_t first_only;           // seen by the first query only (-1: none)
  };
  // A window of 300: key 699 is in the first query's band only, keys before it in neither. Two
  // documents, the queries in the second (from 500): the 32-key tile 480..511 straddles the
  // boundary, and the split of keys 0..255 is wholly hidden.
  for (const Setup& su :
       {Setup{"window", Mask::window(300, 0), {20, 100, 698}, 699},
        Setup{"documents", Mask::document({0, 500, 2000}, true), {20, 100, 490, 495, 499}, -1}})
    for (DType dt : {DType::bf16, DType::f16}) {
      SCOPED_TRACE(testing::Message() << su.what << " " << dtype_name(dt));
      const DecodeCase c{"nan", 1, 2, 1000, 4, 1, 128, 0, su.mask, 999};
      DecodeProblem clean(c, dt, 9), dirty(c, dt, 9);
      auto spoil = [&](int64_t key, bool all_nan) {
        for (int64_t d = 0; d < c.D; ++d)  // the whole V row, or one inf; a NaN in K
          if (all_nan || d == 3) dirty.v.set(key * c.D + d, all_nan ? NAN : INFINITY);
        dirty.k.set(key * c.D + 5, NAN);
      };
      for (size_t i = 0; i < su.hidden.size(); ++i)
        spoil(su.hidden[i], i % 2 == 0);
      if (su.first_only >= 0) spoil(su.first_only, true);
      dirty.upload_inputs();
      clean.decode(clean.block());
      dirty.decode(dirty.block());
      EXPECT_TRUE(clean.matches(clean.reference()));
      // out [1, 2, 4, D], lse [1, 4, 2]: query s, head h.
      for (int64_t s = 0; s < c.Sq; ++s)
        for (int64_t h = 0; h < c.Hq; ++h) {
          const size_t o = size_t((s * c.Hq + h) * c.D), l = size_t(h * c.Sq + s);
          if (s == 0 && su.first_only >= 0) {
            bool any = false;
            for (int64_t d = 0; d < c.D; ++d)
              any = any || !std::isfinite(dirty.h_out[o + size_t(d)]);
            EXPECT_TRUE(any) << "query " << s << " head " << h << " sees a NaN row";
            continue;
          }
          EXPECT_EQ(std::memcmp(&clean.h_out[o], &dirty.h_out[o], size_t(c.D) * 4), 0)
              << "query " << s << " head " << h << " sees no bad row";
          EXPECT_EQ(std::memcmp(&clean.h_lse[l], &dirty.h_lse[l], 4), 0) << "query " << s;
        }
      // Key 800 is seen by both queries.
      spoil(800, true);
      dirty.upload_inputs();
      dirty.h_out.assign(dirty.h_out.size(), 0.f);
      dirty.h_lse.assign(dirty.h_lse.size(), -INFINITY);
      dirty.push();
      dirty.decode(dirty.block());
      for (int64_t row = 0; row < c.Sq * c.Hq; ++row) {
        bool any = false;
        for (int64_t d = 0; d < c.D; ++d)
          any = any || !std::isfinite(dirty.h_out[size_t(row * c.D + d)]);
        EXPECT_TRUE(any) << "row " << row << " sees a NaN value row";
      }
    }
}

// ---------------------------------------------------------------- determinism

// Many splits merged in a fixed order: two runs (fresh scratch each) give the same bits.
TEST(CudaDecodeDeterminism, TwoRunsAreBitIdentical) {
  DecodeProblem p({"bits", 1, 2, 20000, 4, 1, 64, 0, Mask::causal(), 20000}, DType::bf16, 10);
  p.decode(p.block());
  const std::vector<float> out0 = p.h_out, lse0 = p.h_lse;
  p.h_out.assign(p.h_out.size(), 0.f);
  p.h_lse.assign(p.h_lse.size(), -INFINITY);
  p.push();
  p.decode(p.block());
  EXPECT_EQ(std::memcmp(p.h_out.data(), out0.data(), out0.size() * 4), 0);
  EXPECT_EQ(std::memcmp(p.h_lse.data(), lse0.data(), lse0.size() * 4), 0);
  EXPECT_TRUE(p.matches(p.reference()));
}

// ---------------------------------------------------------------- validation and the rule

// Bad fields throw dattn::Error naming them, before anything is launched.
TEST(CudaDecodeValidation, BadFieldsThrowNamingThem) {
  DecodeProblem p({"bad", 1, 17, 10, 4, 2, 64, 0, Mask::none()}, DType::bf16, 11);
  // One query row, then the field spoiled.
  auto expect_throw = [&](void (*spoil)(cuda::AttentionBlock&), const std::string& field) {
    cuda::AttentionBlock b = p.block();
    b.q_len = 1;
    spoil(b);
    EXPECT_TRUE(test::throws_naming(
        [&] { cuda::decode_forward(b, p.out->get<float>(), p.lse->get<float>(), nullptr); },
        {field}));
  };
  using B = cuda::AttentionBlock;
  expect_throw([](B& b) { b.q_len = 17; }, "q_len");               // above kMaxDecodeQueryRows
  expect_throw([](B& b) { b.q_len = 17, b.k_len = 0; }, "q_len");  // also with nothing to do
  expect_throw([](B& b) { b.dtype = DType::f32; }, "dtype");
  expect_throw([](B& b) { b.head_dim = 300; }, "head_dim");
  expect_throw([](B& b) { b.head_dim_v = 257; }, "head_dim_v");
  expect_throw([](B& b) { b.heads_kv = 3; }, "heads_q");
  expect_throw([](B& b) { b.num_docs = 2; }, "cu_seqlens");
  expect_throw([](B& b) { b.k_pos_block = 0; }, "k_pos_block");
  expect_throw([](B& b) { b.scale = NAN; }, "scale");
  p.pull();
  for (float l : p.h_lse)
    ASSERT_EQ(l, -INFINITY) << "nothing was launched";
}

TEST(CudaDecodeRule, FewQueryRowsRunOnTheDecodeKernel) {
  EXPECT_FALSE(cuda::decode_kernel_fits(0));
  EXPECT_TRUE(cuda::decode_kernel_fits(1));
  EXPECT_TRUE(cuda::decode_kernel_fits(cuda::kMaxDecodeQueryRows));
  EXPECT_FALSE(cuda::decode_kernel_fits(cuda::kMaxDecodeQueryRows + 1));
}

}  // namespace
}  // namespace dattn
