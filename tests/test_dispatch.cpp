// Tests of the dispatch layer (src/dispatch.h) on the host: the path every CPU run
// takes (the KV cache's row copies, the tree decode's copy and weighting), against the plain
// loops and movement::host calls they stand for, bit for bit. The GPU path runs in
// tests/gpu/test_gpu_{attention,decode,star}.cpp.
#include "src/dispatch.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/movement/movement.h"
#include "tests/test_reference.h"

namespace dattn {
namespace {

using test::random_bytes;

// copy_rows between host buffers: every batch entry's rows land at dst_row0.. and nothing else
// changes, for row sizes that are not multiples of a word.
TEST(DispatchHost, CopyRowsMovesExactlyTheRows) {
  const Device cpu = Device::cpu();
  for (size_t row : {size_t(1), size_t(6), size_t(96), size_t(258)}) {
    const int64_t batch = 3, src_seq = 7, dst_seq = 11, rows = 4, src_row0 = 2, dst_row0 = 5;
    const auto src = random_bytes(size_t(batch * src_seq) * row, 1);
    auto dst = random_bytes(size_t(batch * dst_seq) * row, 2);
    auto want = dst;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t i = 0; i < rows; ++i)
        std::memcpy(want.data() + size_t(b * dst_seq + dst_row0 + i) * row,
                    src.data() + size_t(b * src_seq + src_row0 + i) * row, row);
    copy_rows(dst.data(), cpu, dst_seq, dst_row0, src.data(), cpu, src_seq, src_row0, batch, rows,
              row);
    EXPECT_EQ(dst, want) << "row " << row;
  }
  // No rows (or no batch): no pointer is touched, null is fine.
  EXPECT_NO_THROW(copy_rows(nullptr, cpu, 0, 0, nullptr, cpu, 0, 0, 2, 0, 16));
  EXPECT_NO_THROW(copy_rows(nullptr, cpu, 4, 0, nullptr, cpu, 4, 0, 0, 4, 16));
}

TEST(DispatchHost, CopyBytes) {
  const auto src = random_bytes(1001, 3);
  std::vector<unsigned char> dst(src.size(), 0);
  copy_bytes(dst.data(), src.data(), src.size(), Device::cpu());
  EXPECT_EQ(dst, src);
  EXPECT_NO_THROW(copy_bytes(nullptr, nullptr, 0, Device::cpu()));
}

// weigh_partial / unweigh_partial on the host are movement::host's, bit for bit, with an empty
// row (lse = -inf) among them; the round trip of one rank's partial gives it back.
TEST(DispatchHost, WeighAndUnweighAreMovementHost) {
  const int64_t B = 2, S = 3, H = 4, Dv = 5;
  const size_t rows = size_t(B * H * S), n_out = size_t(B * S * H * Dv);
  std::mt19937 gen(7);
  std::normal_distribution<float> nd;
  std::vector<float> out(n_out), lse(rows);
  for (auto& x : out)
    x = nd(gen);
  for (auto& x : lse)
    x = nd(gen);
  lse[2] = -std::numeric_limits<float>::infinity();
  for (int64_t d = 0; d < Dv; ++d)  // the empty row's out is 0: (b 0, h 0, s 2)
    out[size_t((2 * H + 0) * Dv + d)] = 0;
  std::vector<float> m = lse;
  m[2] = 0.5f;  // another rank saw keys for this row
  const size_t packed_n = size_t(B * S * H * (Dv + 1));
  std::vector<float> got(packed_n), want(packed_n);
  weigh_partial(Device::cpu(), got.data(), out.data(), lse.data(), m.data(), B, S, H, Dv);
  movement::host::weigh_partial(want.data(), out.data(), lse.data(), m.data(), B, S, H, Dv);
  ASSERT_EQ(std::memcmp(got.data(), want.data(), packed_n * 4), 0);

  std::vector<float> out_a(n_out), lse_a(rows), out_b(n_out), lse_b(rows);
  unweigh_partial(Device::cpu(), out_a.data(), lse_a.data(), got.data(), m.data(), B, S, H, Dv);
  movement::host::unweigh_partial(out_b.data(), lse_b.data(), want.data(), m.data(), B, S, H, Dv);
  EXPECT_EQ(std::memcmp(out_a.data(), out_b.data(), n_out * 4), 0);
  EXPECT_EQ(std::memcmp(lse_a.data(), lse_b.data(), rows * 4), 0);
  // One rank's partial, weighed against its own max, comes back (up to exp/log rounding).
  for (size_t i = 0; i < rows; ++i) {
    if (i == 2) continue;
    EXPECT_NEAR(lse_a[i], lse[i], 1e-5) << i;
  }
}

// pack_rows / unpack_rows on the host (the Ulysses all-to-all's packing): the strided rows in
// order, and back, bit for bit; a block of no rows touches nothing.
TEST(DispatchHost, PackAndUnpackRows) {
  const int64_t outer = 3, inner = 4;
  const size_t row = 10, inner_stride = 26, outer_stride = 4 * inner_stride + 7;
  const auto src = random_bytes(size_t(outer) * outer_stride, 4);
  std::vector<unsigned char> buf(size_t(outer * inner) * row), want(buf.size());
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < inner; ++i)
      std::memcpy(want.data() + size_t(o * inner + i) * row,
                  src.data() + size_t(o) * outer_stride + size_t(i) * inner_stride, row);
  pack_rows(Device::cpu(), buf.data(), src.data(), outer, inner, outer_stride, inner_stride, row);
  EXPECT_EQ(buf, want);
  auto dst = random_bytes(src.size(), 5);
  auto dst_want = dst;
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < inner; ++i)
      std::memcpy(dst_want.data() + size_t(o) * outer_stride + size_t(i) * inner_stride,
                  buf.data() + size_t(o * inner + i) * row, row);
  unpack_rows(Device::cpu(), dst.data(), buf.data(), outer, inner, outer_stride, inner_stride, row);
  EXPECT_EQ(dst, dst_want);
  EXPECT_NO_THROW(pack_rows(Device::cpu(), nullptr, nullptr, 0, inner, 0, 0, row));
  EXPECT_NO_THROW(unpack_rows(Device::cpu(), nullptr, nullptr, outer, 0, 0, 0, row));
}

// merge_partials on the host is movement::host's, bit for bit, with an empty row on each side.
TEST(DispatchHost, MergePartialsIsMovementHost) {
  const int64_t B = 2, S = 3, H = 2, Dv = 5;
  const size_t rows = size_t(B * H * S), n_out = size_t(B * S * H * Dv);
  std::mt19937 gen(9);
  std::normal_distribution<float> nd;
  std::vector<float> out_a(n_out), lse_a(rows), out_b(n_out), lse_b(rows);
  for (auto* v : {&out_a, &lse_a, &out_b, &lse_b})
    for (auto& x : *v)
      x = nd(gen);
  lse_a[1] = -std::numeric_limits<float>::infinity();
  lse_b[4] = -std::numeric_limits<float>::infinity();
  std::vector<float> got_out = out_a, got_lse = lse_a, want_out = out_a, want_lse = lse_a;
  merge_partials(Device::cpu(), got_out.data(), got_lse.data(), out_b.data(), lse_b.data(), B, S, H,
                 Dv);
  movement::host::merge_partials(want_out.data(), want_lse.data(), out_b.data(), lse_b.data(), B, S,
                                 H, Dv);
  EXPECT_EQ(std::memcmp(got_out.data(), want_out.data(), n_out * 4), 0);
  EXPECT_EQ(std::memcmp(got_lse.data(), want_lse.data(), rows * 4), 0);
  EXPECT_NE(std::memcmp(got_lse.data(), lse_a.data(), rows * 4), 0);  // it did merge
}

// kernel_stats: attend_runs adds the rows of its key runs x batch x heads_kv x (D + D_v) x the
// dtype's size (a call with no query rows adds none), mla_absorbed_decode the slice's latent and
// RoPE rows x batch x 4; every call is counted, host calls with their time.
TEST(DispatchHost, KernelStatsCountTheStreamedBytes) {
  const int64_t B = 2, S = 3, Hq = 4, Hkv = 2, D = 16, Dv = 8, k_rows = 20;
  AttnSpec spec;
  spec.heads_q = Hq, spec.heads_kv = Hkv, spec.head_dim = D, spec.head_dim_v = Dv;
  const Tensor q = Tensor::zeros({B, S, Hq, D}, DType::bf16);
  const Tensor k = Tensor::zeros({B, k_rows, Hkv, D}, DType::bf16);
  const Tensor v = Tensor::zeros({B, k_rows, Hkv, Dv}, DType::bf16);
  const std::vector<dattn::Run> q_runs = {{0, 100, 1, S, 1}};
  const std::vector<dattn::Run> k_runs = {{0, 0, 1, 5, 1}, {9, 9, 1, 7, 1}};
  Partial res = empty_partial(q, spec);
  reset_kernel_stats();
  attend_runs(q, q_runs, k.data(), v.data(), k_rows, k_runs, spec, res);
  KernelStats st = kernel_stats();
  EXPECT_EQ(st.calls, 1u);
  EXPECT_EQ(st.bytes, uint64_t((5 + 7) * B * Hkv * (D + Dv) * 2));
  EXPECT_GT(st.seconds, 0.0);
  attend_runs(q, {}, k.data(), v.data(), k_rows, k_runs, spec, res);
  EXPECT_EQ(kernel_stats().calls, 2u);
  EXPECT_EQ(kernel_stats().bytes, st.bytes);

  MlaAbsorbedBlock blk;
  const std::vector<float> q_nope(2 * 4), q_pe(2 * 2), w_uk(2 * 4 * 8), w_uv(2 * 4 * 8);
  const std::vector<float> c_kv(10 * 8), k_pe(10 * 2);
  blk.q_nope = q_nope.data(), blk.q_pe = q_pe.data(), blk.w_uk = w_uk.data();
  blk.w_uv = w_uv.data(), blk.c_kv = c_kv.data(), blk.k_pe = k_pe.data();
  blk.batch = 1, blk.seq_q = 1, blk.seq_kv = 10, blk.heads_all = 2, blk.qk_nope = 4;
  blk.rope_all = 2, blk.latent_all = 8, blk.v_head = 4, blk.nh = 2, blk.nlat = 8, blk.nrope = 2;
  blk.q_pos0 = 9;
  std::vector<float> out(2 * 4), lse(2);
  reset_kernel_stats();
  mla_absorbed_decode(Device::cpu(), blk, Mask::causal(), out.data(), 2, 0, lse.data());
  st = kernel_stats();
  EXPECT_EQ(st.calls, 1u);
  EXPECT_EQ(st.bytes, uint64_t(10 * (8 + 2) * 4));
  EXPECT_GT(st.seconds, 0.0);
  reset_kernel_stats();
  st = kernel_stats();
  EXPECT_EQ(st.calls, 0u);
  EXPECT_EQ(st.bytes, 0u);
  EXPECT_EQ(st.seconds, 0.0);
}

TEST(DispatchHost, CudaKernelLimitsNameTheValue) {
  AttnSpec spec;
  spec.heads_q = 8;
  spec.heads_kv = 2;
  spec.head_dim = 128;
  // The static limits come first, so these fail the same way with or without a GPU; a valid
  // call then asks the device for its shared-memory limit (the emulated GPU tests run that).
  EXPECT_TRUE(
      test::throws_naming([&] { check_attention_limits(Device::cuda(0), DType::f32, spec, 4, -1); },
                          {"dtype", "fp32", "bf16 or fp16"}));
  spec.head_dim = 512;
  EXPECT_TRUE(
      test::throws_naming([&] { check_attention_limits(Device::cuda(0), DType::f16, spec, 4, -1); },
                          {"head_dim", "512", "at most 256"}));
  spec.head_dim = 128;
  EXPECT_TRUE(test::throws_naming(
      [&] { check_attention_limits(Device::cuda(0), DType::f16, spec, 70000, -1); },
      {"batch", "70000"}));
}

TEST(DispatchHost, MlaKernelLimitsNameTheValue) {
  const Device gpu = Device::cuda(0);
  EXPECT_NO_THROW(check_mla_limits(gpu, Mask::causal(), 512, 64, 4, 1, 128));
  EXPECT_NO_THROW(check_mla_limits(Device::cpu(), Mask::causal(), 4096, 1024, 4, 1, 128));
  EXPECT_TRUE(test::throws_naming(
      [&] { check_mla_limits(gpu, Mask::causal(), 2048, 64, 4, 1, 128); }, {"latent", "2048"}));
  EXPECT_TRUE(test::throws_naming(
      [&] { check_mla_limits(gpu, Mask::causal(), 512, 1024, 4, 1, 128); }, {"rope", "1024"}));
  EXPECT_TRUE(test::throws_naming(
      [&] { check_mla_limits(gpu, Mask::causal(), 512, 64, 4, 1, 9000); }, {"qk_nope", "9000"}));
  EXPECT_TRUE(test::throws_naming(
      [&] {
        check_mla_limits(gpu, Mask::document({0, 4, 8}, true), 512, 64, 4, 1, 128);
      },
      {"mask"}));
  AttnSpec spec;
  EXPECT_NO_THROW(check_attention_limits(Device::cpu(), DType::f32, spec, 70000, -1));
}

}  // namespace
}  // namespace dattn
