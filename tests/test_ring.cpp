// Multi-rank tests (1-4 ranks) of ring attention through dattn::attention: every rank's shard of
// out and lse against the float64 reference over the global tensors, the bytes the ring sends
// against closed forms and the byte model, and the layout's dispatch/undispatch round trip.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cpu/attention_cpu.h"
#include "kernels/cpu/reference.h"
#include "src/attention.h"
#include "src/base/error.h"
#include "src/layout.h"
#include "src/models.h"
#include "src/runtime.h"
#include "tests/mpi_support.h"
#include "tests/test_reference.h"

namespace dattn {
namespace {

using test::world_size;

// ---------------------------------------------------------------- cases

// How the global sequence length follows from the number of ranks P.
enum class SeqKind { divisible, uneven, fewer_than_ranks, one };

struct RingCase {
  std::string name;
  int64_t B = 1, Hq = 2, Hkv = 2, D = 64, Dv = 0;
  bool causal = false;
  DType dtype = DType::f32;
  SeqKind seq = SeqKind::divisible;
  int64_t per_rank = 16;  // tokens per rank when divisible
  std::string layout = "contiguous";
};

std::ostream& operator<<(std::ostream& os, const RingCase& c) {
  return os << c.name;
}

int64_t global_seq(const RingCase& c, int P) {
  switch (c.seq) {
    case SeqKind::divisible:
      return c.per_rank * P;
    case SeqKind::uneven:
      return 7 * P + 3;
    case SeqKind::fewer_than_ranks:
      return P > 1 ? P - 1 : 1;  // some ranks hold no token
    case SeqKind::one:
      return 1;
  }
  return 0;
}

std::vector<RingCase> ring_cases() {
  using K = SeqKind;
  // name, B, Hq, Hkv, D, Dv, causal, dtype, seq, per_rank
  return {
      {"noncausal_f32_D64", 1, 2, 2, 64, 0, false, DType::f32, K::divisible},
      {"causal_f32_D64", 1, 2, 2, 64, 0, true, DType::f32, K::divisible},
      {"causal_f32_D128_gqa4", 1, 4, 1, 128, 0, true, DType::f32, K::divisible},
      {"noncausal_bf16_D128_gqa4", 1, 4, 1, 128, 0, false, DType::bf16, K::divisible},
      {"causal_bf16_D128_gqa4_B2", 2, 8, 2, 128, 0, true, DType::bf16, K::divisible, 12},
      {"causal_bf16_D64_uneven", 1, 2, 2, 64, 0, true, DType::bf16, K::uneven},
      {"noncausal_f32_D128_gqa4_uneven", 1, 4, 1, 128, 0, false, DType::f32, K::uneven},
      {"causal_f32_D192_Dv128", 1, 2, 2, 192, 128, true, DType::f32, K::divisible, 8},
      {"noncausal_bf16_D192_Dv128_uneven", 1, 2, 1, 192, 128, false, DType::bf16, K::uneven},
      {"noncausal_f32_D64_Dv32_gqa4", 1, 4, 1, 64, 32, false, DType::f32, K::divisible},
      {"causal_f32_fewer_tokens_than_ranks", 1, 2, 2, 64, 0, true, DType::f32, K::fewer_than_ranks},
      {"noncausal_bf16_fewer_tokens_than_ranks", 2, 4, 1, 64, 0, false, DType::bf16,
       K::fewer_than_ranks},
      {"causal_f32_one_token", 1, 2, 1, 64, 0, true, DType::f32, K::one},
      {"causal_f32_B2_gqa4_uneven", 2, 4, 1, 64, 0, true, DType::f32, K::uneven},
      {"causal_f16_D80", 1, 2, 2, 80, 0, true, DType::f16, K::divisible, 9},
      {"noncausal_f16_D80_B2", 2, 2, 2, 80, 0, false, DType::f16, K::divisible, 9},
      // Shards longer than the kernel's tiles (kTileQ = 256, kTileK = 512).
      {"causal_bf16_long_shards", 1, 2, 1, 32, 0, true, DType::bf16, K::divisible,
       cpu::kTileQ + 24},
      {"noncausal_f32_long_shards", 1, 1, 1, 32, 0, false, DType::f32, K::divisible,
       cpu::kTileK + 8},
      // The same schedule under the zigzag and striped layouts (runs at other positions).
      {"zigzag_causal_f32_gqa4", 1, 4, 1, 64, 0, true, DType::f32, K::divisible, 16, "zigzag"},
      {"zigzag_causal_bf16_uneven", 2, 2, 2, 64, 0, true, DType::bf16, K::uneven, 16, "zigzag"},
      {"zigzag_noncausal_f32", 1, 2, 2, 64, 0, false, DType::f32, K::divisible, 16, "zigzag"},
      {"zigzag_causal_f32_long", 1, 2, 1, 32, 0, true, DType::f32, K::divisible, cpu::kTileQ + 24,
       "zigzag"},
      {"zigzag_causal_f32_fewer_tokens_than_ranks", 1, 2, 2, 64, 0, true, DType::f32,
       K::fewer_than_ranks, 16, "zigzag"},
      {"striped_causal_f32_gqa4", 1, 4, 1, 64, 0, true, DType::f32, K::divisible, 16, "striped"},
      {"striped_causal_bf16_uneven", 1, 2, 2, 80, 0, true, DType::bf16, K::uneven, 16, "striped"},
      {"striped_noncausal_f16_B2", 2, 2, 1, 64, 0, false, DType::f16, K::divisible, 16, "striped"},
      {"striped_causal_f32_long", 1, 2, 1, 32, 0, true, DType::f32, K::divisible, cpu::kTileQ + 24,
       "striped"},
  };
}

// The closed forms of the ring's send volume (see test_layout.cpp for the same, 1..8 ranks).
// Non-causal, S % P == 0, D_v == D: (P - 1) * 2 * B * (S/P) * H_kv * D * size.
uint64_t closed_form_noncausal(const RingCase& c, int64_t S, int P) {
  return uint64_t(P - 1) * 2 * uint64_t(c.B) * uint64_t(S / P) * uint64_t(c.Hkv) * uint64_t(c.D) *
         dtype_size(c.dtype);
}
// Causal, contiguous, S >= P: at step s (0..P-2) rank r forwards the block it holds, origin
// (r - s) mod P, iff s <= r <= P - 2 (some rank ahead, r+1..P-1, sees it).
uint64_t closed_form_causal(const RingCase& c, const Layout& layout, int r) {
  const int P = layout.ranks();
  const int64_t dv = c.Dv > 0 ? c.Dv : c.D;
  uint64_t bytes = 0;
  for (int s = 0; s <= P - 2; ++s) {
    if (s <= r && r <= P - 2) {
      const int origin = ((r - s) % P + P) % P;
      bytes += uint64_t(c.B * layout.local_len(origin) * c.Hkv * (c.D + dv)) * dtype_size(c.dtype);
    }
  }
  return bytes;
}

// ---------------------------------------------------------------- ring vs reference

class RingAttention : public testing::TestWithParam<RingCase> {};

TEST_P(RingAttention, MatchesReferenceAndByteModel) {
  const RingCase& c = GetParam();
  Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, {});
  const int P = rt.cp_size(), me = rt.cp_rank();
  ASSERT_EQ(P, world_size());
  const int64_t S = global_seq(c, P);
  Layout layout = Layout::make(c.layout, S, P);
  AttnSpec spec;
  spec.heads_q = c.Hq;
  spec.heads_kv = c.Hkv;
  spec.head_dim = c.D;
  spec.head_dim_v = c.Dv;
  spec.mask = c.causal ? Mask::causal() : Mask::none();
  const int64_t dv = spec.dim_v();

  // Every rank builds the same global tensors and takes its shard.
  Tensor qg = test::random_tensor({c.B, S, c.Hq, c.D}, c.dtype, 101);
  Tensor kg = test::random_tensor({c.B, S, c.Hkv, c.D}, c.dtype, 102);
  Tensor vg = test::random_tensor({c.B, S, c.Hkv, dv}, c.dtype, 103);
  Tensor q = layout.dispatch(qg, me), k = layout.dispatch(kg, me), v = layout.dispatch(vg, me);
  const int64_t Sl = layout.local_len(me);

  rt.cp().reset_counters();
  Partial res = attention(rt, q, k, v, spec, layout, Strategy::ring);
  const uint64_t sent = rt.cp().counters().bytes("send");

  ASSERT_EQ(res.out.dtype(), DType::f32);
  ASSERT_EQ(res.lse.dtype(), DType::f32);
  ASSERT_EQ(res.out.dim(), 4);
  ASSERT_EQ(res.lse.dim(), 3);
  EXPECT_EQ(res.out.size(0), c.B);
  EXPECT_EQ(res.out.size(1), Sl);
  EXPECT_EQ(res.out.size(2), c.Hq);
  EXPECT_EQ(res.out.size(3), dv);
  EXPECT_EQ(res.lse.size(0), c.B);
  EXPECT_EQ(res.lse.size(1), c.Hq);
  EXPECT_EQ(res.lse.size(2), Sl);

  auto ref = cpu::attention_reference(qg, kg, vg, spec);
  if (res.out.numel() == c.B * Sl * c.Hq * dv && res.lse.numel() == c.B * c.Hq * Sl) {
    EXPECT_TRUE(test::matches_reference(
        res.out.ptr<float>(), res.lse.ptr<float>(), c.B, Sl, c.Hq, dv, ref, S,
        [&](int64_t s) { return layout.global_position(me, s); }, test::tolerance_for(c.dtype)))
        << "rank " << me << " of " << P << ", S=" << S;
  }

  // Bytes sent: the model, and the closed forms where they apply.
  EXPECT_EQ(sent, ring_send_bytes(layout, spec, c.B, c.dtype, me))
      << "rank " << me << " of " << P << ", S=" << S;
  // Every rank holds S/P tokens when S divides by the layout's unit (P, or 2P chunks for zigzag).
  const int64_t unit = c.layout == "zigzag" ? 2 * P : P;
  if (!c.causal && S % unit == 0 && c.Dv == 0) {
    EXPECT_EQ(sent, closed_form_noncausal(c, S, P)) << "rank " << me << " of " << P;
  }
  // Zigzag and striped balance causal work: every block is seen by every later rank, so the
  // causal ring sends what the non-causal one does.
  if (c.causal && c.layout != "contiguous" && S % unit == 0 && S >= 2 * unit && c.Dv == 0) {
    EXPECT_EQ(sent, closed_form_noncausal(c, S, P)) << "rank " << me << " of " << P;
  }
  if (c.causal && c.layout == "contiguous" && S >= P) {
    EXPECT_EQ(sent, closed_form_causal(c, layout, me)) << "rank " << me << " of " << P;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, RingAttention, testing::ValuesIn(ring_cases()),
                         [](const testing::TestParamInfo<RingCase>& info) {
                           return info.param.name;
                         });

// The whole output gathered back with undispatch equals the reference on every rank.
TEST(RingAttentionGathered, UndispatchedOutputMatchesReference) {
  Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, {});
  const int P = rt.cp_size(), me = rt.cp_rank();
  const int64_t S = 5 * P + 2, B = 1, H = 4, Hkv = 2, D = 64;
  Layout layout = Layout::contiguous(S, P);
  AttnSpec spec;
  spec.heads_q = H;
  spec.heads_kv = Hkv;
  spec.head_dim = D;
  spec.mask = Mask::causal();
  Tensor qg = test::random_tensor({B, S, H, D}, DType::bf16, 201);
  Tensor kg = test::random_tensor({B, S, Hkv, D}, DType::bf16, 202);
  Tensor vg = test::random_tensor({B, S, Hkv, D}, DType::bf16, 203);
  Partial res = attention(rt, layout.dispatch(qg, me), layout.dispatch(kg, me),
                          layout.dispatch(vg, me), spec, layout, Strategy::ring);
  Tensor out = layout.undispatch(rt.cp(), res.out);
  ASSERT_EQ(out.size(1), S);
  // lse is [B, H, S]: gather it through a [B, S, H] transpose.
  Tensor lse_t = Tensor::empty({B, layout.local_len(me), H}, DType::f32);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t s = 0; s < layout.local_len(me); ++s)
      lse_t.set(s * H + h, res.lse.get(h * layout.local_len(me) + s));
  Tensor lse_g = layout.undispatch(rt.cp(), lse_t);
  std::vector<float> lse(size_t(H * S));
  for (int64_t h = 0; h < H; ++h)
    for (int64_t s = 0; s < S; ++s)
      lse[size_t(h * S + s)] = lse_g.get(s * H + h);
  auto ref = cpu::attention_reference(qg, kg, vg, spec);
  EXPECT_TRUE(test::matches_reference(out.ptr<float>(), lse.data(), B, S, H, D, ref,
                                      test::tolerance_for(DType::bf16)));
}

// ---------------------------------------------------------------- cp x tp grid

// With tp = 2 the ring runs over each cp group of P/2 ranks (tp fastest: ranks 2i and 2i+1
// are in different cp groups), both groups computing the same problem.
TEST(RingTensorParallel, RingOverCpGroups) {
  if (world_size() % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
  RuntimeOptions o;
  o.tp = 2;
  Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, o);
  const int cp = rt.cp_size(), me = rt.cp_rank();
  ASSERT_EQ(cp, world_size() / 2);
  EXPECT_EQ(rt.tp_size(), 2);
  EXPECT_EQ(me, rt.rank() / 2);
  const int64_t S = 6 * cp + 1, B = 1, H = 4, Hkv = 2, D = 64;
  Layout layout = Layout::contiguous(S, cp);
  AttnSpec spec;
  spec.heads_q = H;
  spec.heads_kv = Hkv;
  spec.head_dim = D;
  spec.mask = Mask::causal();
  Tensor qg = test::random_tensor({B, S, H, D}, DType::f32, 501);
  Tensor kg = test::random_tensor({B, S, Hkv, D}, DType::f32, 502);
  Tensor vg = test::random_tensor({B, S, Hkv, D}, DType::f32, 503);
  rt.cp().reset_counters();
  Partial res = attention(rt, layout.dispatch(qg, me), layout.dispatch(kg, me),
                          layout.dispatch(vg, me), spec, layout, Strategy::ring);
  EXPECT_EQ(rt.cp().counters().bytes("send"), ring_send_bytes(layout, spec, B, DType::f32, me));
  auto ref = cpu::attention_reference(qg, kg, vg, spec);
  EXPECT_TRUE(test::matches_reference(
      res.out.ptr<float>(), res.lse.ptr<float>(), B, layout.local_len(me), H, D, ref, S,
      [&](int64_t s) { return layout.global_position(me, s); }, test::tolerance_for(DType::f32)));
}

// ---------------------------------------------------------------- layout round trip

TEST(RingLayout, DispatchUndispatchRoundTrip) {
  Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, {});
  const int P = rt.cp_size(), me = rt.cp_rank();
  for (int64_t S : {int64_t(4 * P), int64_t(3 * P + 1), int64_t(1), int64_t(2 * P - 1)}) {
    for (DType dt : {DType::f32, DType::bf16, DType::f16})
      for (const char* kind : {"contiguous", "zigzag", "striped"}) {
        SCOPED_TRACE(testing::Message() << "S=" << S << " " << dtype_name(dt) << " " << kind);
        Layout layout = Layout::make(kind, S, P);
        Tensor g4 = test::random_tensor({2, S, 3, 5}, dt, 300 + uint64_t(S));
        Tensor s4 = layout.dispatch(g4, me);
        EXPECT_EQ(s4.size(1), layout.local_len(me));
        Tensor back = layout.undispatch(rt.cp(), s4);
        ASSERT_EQ(back.dim(), 4);
        ASSERT_EQ(back.nbytes(), g4.nbytes());
        EXPECT_EQ(back.dtype(), dt);
        EXPECT_EQ(std::memcmp(back.data(), g4.data(), g4.nbytes()), 0);
        Tensor g3 = test::random_tensor({1, S, 7}, dt, 400 + uint64_t(S));
        Tensor back3 = layout.undispatch(rt.cp(), layout.dispatch(g3, me));
        ASSERT_EQ(back3.dim(), 3);
        ASSERT_EQ(back3.nbytes(), g3.nbytes());
        EXPECT_EQ(std::memcmp(back3.data(), g3.data(), g3.nbytes()), 0);
      }
  }
}

// ---------------------------------------------------------------- runtime

TEST(RingRuntime, FromMpi) {
  Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD, {});
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  EXPECT_EQ(rt.rank(), r);
  EXPECT_EQ(rt.size(), world_size());
  EXPECT_EQ(rt.cp_size(), world_size());
  EXPECT_EQ(rt.cp_rank(), r);
  EXPECT_EQ(rt.tp_size(), 1);
  EXPECT_TRUE(rt.device().is_cpu());
  // Threads: OMP_NUM_THREADS when set (ctest sets 1), else the node's cores shared by its ranks.
  if (const char* env = std::getenv("OMP_NUM_THREADS")) {
    EXPECT_EQ(rt.threads(), std::atoi(env));
  } else {
    EXPECT_GE(rt.threads(), 1);
  }
  // The ranks on this host: all of them on one machine, a host's on tests/multinode's cluster.
  EXPECT_EQ(rt.node_ranks(), int(test::same_host_ranks().size()));
  EXPECT_EQ(parse_strategy("ring"), Strategy::ring);
  EXPECT_EQ(std::string(strategy_name(Strategy::ring)), "ring");
}

}  // namespace
}  // namespace dattn
