// Multi-rank tests (1-4 ranks) of the distributed backward (dattn::attention_backward): every
// strategy (ring, ulysses, hybrid U = 2) under every layout and mask (random slice masks and the
// balanced layout among them), each rank's dq, dk, dv
// against the float64 reference gradients of the global tensors, the bytes sent against
// attention_backward_send_bytes, bit-identical repeated calls, gradient error that does not grow
// with the ranks, a bad argument on one rank becoming an error on every rank, and document masks
// with empty documents against the same calls without them.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

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

using test::world_rank;
using test::world_size;

enum class Schedule { ring, ulysses, hybrid_u2 };
const char* schedule_name(Schedule s) {
  return s == Schedule::ring ? "ring" : s == Schedule::ulysses ? "ulysses" : "hybridU2";
}
enum class LayoutKind { contiguous, zigzag, striped, varlen, balanced };
const char* layout_name(LayoutKind k) {
  switch (k) {
    case LayoutKind::contiguous:
      return "contiguous";
    case LayoutKind::zigzag:
      return "zigzag";
    case LayoutKind::striped:
      return "striped";
    case LayoutKind::varlen:
      return "varlen";
    case LayoutKind::balanced:
      return "balanced5";
  }
  return "?";
}
enum class MaskKind { none, causal, window, document_causal, slices };
const char* mask_name(MaskKind m) {
  switch (m) {
    case MaskKind::none:
      return "none";
    case MaskKind::causal:
      return "causal";
    case MaskKind::window:
      return "window7r3";
    case MaskKind::document_causal:
      return "doc_causal";
    case MaskKind::slices:
      return "slices";
  }
  return "?";
}

// S = 48 in fp32 (divides by 1..4 and the zigzag chunks), S = 61 in bf16 with B = 2 and
// D_v != D (divides by nothing); GQA 4:1 and 2:1; S = 29 with one kv head (MQA): every Ulysses
// degree past H_kv, the members' dk and dv of their shared head summed. S = 61 and 29 have
// attention sinks: d sinks too, summed over every rank's rows. S = 48 has a logit softcap alone,
// S = 61 with the sinks.
struct Problem {
  int64_t S, B, Hq, Hkv, D, Dv;
  DType dtype;
  std::vector<int64_t> cu_seqlens;
  bool sinks = false;
  float softcap = 0.f;
};
const Problem kProblems[] = {
    {48, 1, 16, 4, 16, 16, DType::f32, {0, 1, 13, 14, 30, 48}, false, 1.5f},
    {61, 2, 8, 4, 32, 16, DType::bf16, {0, 1, 20, 21, 24, 45, 61}, true, 3.f},
    {29, 1, 12, 1, 16, 16, DType::f32, {0, 1, 9, 10, 29}, true},
};

struct Case {
  Schedule schedule;
  LayoutKind layout;
  MaskKind mask;
  int problem;
};
std::string case_name(const Case& c) {
  return std::string(schedule_name(c.schedule)) + "_" + layout_name(c.layout) + "_" +
         mask_name(c.mask) + "_S" + std::to_string(kProblems[c.problem].S);
}
std::ostream& operator<<(std::ostream& os, const Case& c) {
  return os << case_name(c);
}

std::vector<Case> cases() {
  std::vector<Case> cs;
  for (int p = 0; p < int(std::size(kProblems)); ++p)
    for (Schedule s : {Schedule::ring, Schedule::ulysses, Schedule::hybrid_u2}) {
      for (LayoutKind l :
           {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped, LayoutKind::varlen})
        for (MaskKind m : {MaskKind::none, MaskKind::causal, MaskKind::window,
                           MaskKind::document_causal, MaskKind::slices})
          cs.push_back({s, l, m, p});
      for (MaskKind m : {MaskKind::causal, MaskKind::slices})
        cs.push_back({s, LayoutKind::balanced, m, p});
    }
  return cs;
}

Mask make_mask(MaskKind m, const Problem& pb) {
  switch (m) {
    case MaskKind::none:
      return Mask::none();
    case MaskKind::causal:
      return Mask::causal();
    case MaskKind::window:
      return Mask::window(7, 3);
    case MaskKind::document_causal:
      return Mask::document(pb.cu_seqlens, true);
    case MaskKind::slices: {  // random slices (test::random_slices), the same on every rank
      std::mt19937_64 rng(uint64_t(pb.S) * 5 + 3);
      return test::random_slices(rng, pb.S);
    }
  }
  return Mask::none();
}
Layout make_layout(LayoutKind k, const Problem& pb, int P, const Mask& mask) {
  switch (k) {
    case LayoutKind::contiguous:
      return Layout::contiguous(pb.S, P);
    case LayoutKind::zigzag:
      return Layout::zigzag(pb.S, P);
    case LayoutKind::striped:
      return Layout::striped(pb.S, P, 3);
    case LayoutKind::varlen:
      return Layout::varlen(pb.cu_seqlens, P);
    case LayoutKind::balanced:
      return Layout::balanced(mask, pb.S, P, 5);
  }
  return Layout();
}
AttnSpec make_spec(const Problem& pb, const Mask& mask) {
  AttnSpec spec;
  spec.heads_q = pb.Hq;
  spec.heads_kv = pb.Hkv;
  spec.head_dim = pb.D;
  spec.head_dim_v = pb.Dv;
  spec.mask = mask;
  if (pb.sinks) spec.sinks = test::sinks_for(pb.Hq);
  spec.softcap = pb.softcap;
  return spec;
}

// max |got - ref| over this rank's rows of one gradient, and max |ref| over all of them: the
// gradient's error relative to its scale. got is [B, Sl, H, d] fp32, ref [B, S, H, d] double.
struct GradError {
  double max_err = 0, max_ref = 0;
  bool finite = true;
  double relative() const { return max_ref > 0 ? max_err / max_ref : max_err; }
};
GradError compare_rows(const Tensor& got, const std::vector<double>& ref, const Layout& layout,
                       int me, int64_t B, int64_t S, int64_t H, int64_t d) {
  GradError e;
  for (double x : ref)
    e.max_ref = std::max(e.max_ref, std::abs(x));
  const int64_t Sl = layout.local_len(me);
  const float* g = got.ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < Sl; ++s) {
      const int64_t gs = layout.global_position(me, s);
      for (int64_t i = 0; i < H * d; ++i) {
        const double x = g[(b * Sl + s) * H * d + i];
        e.finite = e.finite && std::isfinite(x);
        e.max_err = std::max(e.max_err, std::abs(x - ref[size_t((b * S + gs) * H * d + i)]));
      }
    }
  return e;
}

// Gradients accumulate in fp32 from inputs the reference reads exactly; measured relative errors
// here are ~1e-7 (fp32) and ~2e-7 (bf16 storage); 5e-5 keeps a wide margin for any rank count.
constexpr double kGradTol = 5e-5;

class Backward : public testing::TestWithParam<Case> {
 protected:
  static Runtime& runtime(int ulysses) { return test::world_runtime(ulysses); }
  struct Global {
    Tensor q, k, v, dout;
    cpu::ReferenceGrads ref;
  };
  static const Global& global(int problem, MaskKind mask) {
    auto& g = globals_[{problem, int(mask)}];
    if (!g) {
      const Problem& pb = kProblems[problem];
      g = std::make_unique<Global>();
      g->q = test::random_tensor({pb.B, pb.S, pb.Hq, pb.D}, pb.dtype, 701);
      g->k = test::random_tensor({pb.B, pb.S, pb.Hkv, pb.D}, pb.dtype, 702);
      g->v = test::random_tensor({pb.B, pb.S, pb.Hkv, pb.Dv}, pb.dtype, 703);
      g->dout = test::random_tensor({pb.B, pb.S, pb.Hq, pb.Dv}, DType::f32, 704);
      g->ref = cpu::attention_backward_reference(g->q, g->k, g->v, g->dout,
                                                 make_spec(pb, make_mask(mask, pb)));
    }
    return *g;
  }
  static void TearDownTestSuite() { globals_.clear(); }

 private:
  static std::map<std::pair<int, int>, std::unique_ptr<Global>> globals_;
};
std::map<std::pair<int, int>, std::unique_ptr<Backward::Global>> Backward::globals_;

TEST_P(Backward, MatchesReferenceAndByteModel) {
  const Case& c = GetParam();
  const Problem& pb = kProblems[c.problem];
  const int P = world_size();
  const int U = c.schedule == Schedule::hybrid_u2 ? 2 : 1;
  if (P % U != 0) GTEST_SKIP() << "Ulysses degree " << U << " does not divide " << P << " ranks";
  const Strategy strategy = c.schedule == Schedule::ring      ? Strategy::ring
                            : c.schedule == Schedule::ulysses ? Strategy::ulysses
                                                              : Strategy::hybrid;
  const int heads_u = strategy == Strategy::ulysses ? P : U;
  if (pb.Hkv % heads_u != 0 && heads_u % pb.Hkv != 0)
    GTEST_SKIP() << "H_kv " << pb.Hkv << " neither divides nor is a multiple of U = " << heads_u;
  Runtime& rt = runtime(U);
  const int me = rt.cp_rank();
  const AttnSpec spec = make_spec(pb, make_mask(c.mask, pb));
  const Layout layout = make_layout(c.layout, pb, P, spec.mask);
  const Global& g = global(c.problem, c.mask);
  const std::string where = "rank " + std::to_string(me) + " of " + std::to_string(P) + ", " +
                            layout.str() + ", " + spec.mask.str();

  const Tensor q = layout.dispatch(g.q, me), k = layout.dispatch(g.k, me),
               v = layout.dispatch(g.v, me), dout = layout.dispatch(g.dout, me);
  const Partial fwd = attention(rt, q, k, v, spec, layout, strategy);
  rt.reset_counters();
  const Gradients grads = attention_backward(rt, q, k, v, fwd, dout, spec, layout, strategy);
  const ByteCounters counters = rt.counters();

  for (const auto& [got, ref, H, d, name] :
       {std::tuple{&grads.dq, &g.ref.dq, pb.Hq, pb.D, "dq"},
        std::tuple{&grads.dk, &g.ref.dk, pb.Hkv, pb.D, "dk"},
        std::tuple{&grads.dv, &g.ref.dv, pb.Hkv, pb.Dv, "dv"}}) {
    ASSERT_EQ(got->dtype(), DType::f32) << name;
    ASSERT_EQ(got->size(1), layout.local_len(me)) << name;
    const GradError e = compare_rows(*got, *ref, layout, me, pb.B, pb.S, H, d);
    EXPECT_TRUE(e.finite) << name << " has NaN/inf, " << where;
    EXPECT_LE(e.max_err, kGradTol * e.max_ref + 1e-7)
        << name << ": max |err| " << e.max_err << " vs max |ref| " << e.max_ref << ", " << where;
    if (test::print_errors())
      std::printf("%s %s rel err %.3g\n", case_name(c).c_str(), name, e.relative());
  }
  // d sinks: every rank holds the sum over all rows.
  ASSERT_EQ(grads.dsinks.defined(), pb.sinks) << where;
  if (pb.sinks) {
    ASSERT_EQ(grads.dsinks.numel(), pb.Hq);
    double max_ref = 0, max_err = 0;
    for (int64_t h = 0; h < pb.Hq; ++h) {
      const double ref = g.ref.dsinks[size_t(h)];
      max_ref = std::max(max_ref, std::abs(ref));
      max_err = std::max(max_err, std::abs(double(grads.dsinks.ptr<float>()[h]) - ref));
    }
    EXPECT_GT(max_ref, 0.0);
    EXPECT_LE(max_err, kGradTol * max_ref + 1e-7)
        << "dsinks: max |err| " << max_err << " vs max |ref| " << max_ref << ", " << where;
  }

  // Bytes: exactly the model (point-to-point, all-to-all and the allreduce of d sinks; the rest
  // is validation's control).
  const uint64_t sent =
      counters.bytes("send") + counters.bytes("alltoall") + counters.bytes("allreduce");
  const int model_u = strategy == Strategy::ring ? 1 : strategy == Strategy::ulysses ? P : U;
  EXPECT_EQ(sent,
            attention_backward_send_bytes(strategy, layout, spec, pb.B, pb.dtype, model_u, me))
      << where << ": send " << counters.bytes("send") << " + alltoall "
      << counters.bytes("alltoall");
  EXPECT_EQ(counters.data_bytes(), sent) << where;

  // Deterministic: a second call gives the same bits.
  const Gradients again = attention_backward(rt, q, k, v, fwd, dout, spec, layout, strategy);
  for (const auto& [a, b, name] :
       {std::tuple{&grads.dq, &again.dq, "dq"}, std::tuple{&grads.dk, &again.dk, "dk"},
        std::tuple{&grads.dv, &again.dv, "dv"}, std::tuple{&grads.dsinks, &again.dsinks, "dsinks"}})
    if (a->numel() > 0) {  // memcmp of null pointers (no sinks) is undefined, even of 0 bytes
      EXPECT_EQ(std::memcmp(a->data(), b->data(), a->nbytes()), 0) << name << " differs, " << where;
    }
}

INSTANTIATE_TEST_SUITE_P(Cases, Backward, testing::ValuesIn(cases()),
                         [](const testing::TestParamInfo<Case>& info) {
                           return case_name(info.param);
                         });

// Document masks whose cu_seqlens repeat entries (empty documents at the start, in the middle, in
// a row, at the end), under varlen on the same boundaries, zigzag and contiguous in turn
// (test::empty_documents_runs), for the ring, Ulysses and the hybrid (U = 2 where it divides P):
// each rank's dq, dk, dv against the float64 reference gradients of the boundaries without the
// repeats, bit for bit those of the call without them, with the bytes the model predicts. fp32 and
// bf16 in turn.
TEST(BackwardEmptyDocuments, MatchReferenceAndTheCallWithoutThem) {
  const int P = world_size();
  const Problem pb{61, 1, 24, 12, 32, 16, DType::f32, {}};
  for (const test::EmptyDocumentsRun& run : test::empty_documents_runs(pb.S, P)) {
    const auto& [name, mask, cut, dt, layout, layout_cut] = run;
    const AttnSpec spec = make_spec(pb, mask), spec_cut = make_spec(pb, cut);
    const Tensor qg = test::random_tensor({pb.B, pb.S, pb.Hq, pb.D}, dt, 711);
    const Tensor kg = test::random_tensor({pb.B, pb.S, pb.Hkv, pb.D}, dt, 712);
    const Tensor vg = test::random_tensor({pb.B, pb.S, pb.Hkv, pb.Dv}, dt, 713);
    const Tensor dg = test::random_tensor({pb.B, pb.S, pb.Hq, pb.Dv}, DType::f32, 714);
    const cpu::ReferenceGrads ref = cpu::attention_backward_reference(qg, kg, vg, dg, spec_cut);
    for (const test::ScheduleRun& sc : test::empty_documents_schedules(P)) {
      Runtime& rt = test::world_runtime(sc.ulysses);
      const int me = rt.cp_rank();
      const std::string where = name + " " + mask.str() + " " + dtype_name(dt) + " " +
                                layout.str() + " " + strategy_name(sc.strategy) +
                                " U=" + std::to_string(sc.ulysses) + ", rank " + std::to_string(me);
      const Tensor q = layout.dispatch(qg, me), k = layout.dispatch(kg, me),
                   v = layout.dispatch(vg, me), dout = layout.dispatch(dg, me);
      const Partial fwd = attention(rt, q, k, v, spec, layout, sc.strategy);
      rt.reset_counters();
      const Gradients g = attention_backward(rt, q, k, v, fwd, dout, spec, layout, sc.strategy);
      const uint64_t sent = rt.counters().bytes("send") + rt.counters().bytes("alltoall");
      const Partial fwd_cut = attention(rt, q, k, v, spec_cut, layout_cut, sc.strategy);
      const Gradients gc =
          attention_backward(rt, q, k, v, fwd_cut, dout, spec_cut, layout_cut, sc.strategy);
      for (const auto& [got, cut_got, r, H, d, what] :
           {std::tuple{&g.dq, &gc.dq, &ref.dq, pb.Hq, pb.D, "dq"},
            std::tuple{&g.dk, &gc.dk, &ref.dk, pb.Hkv, pb.D, "dk"},
            std::tuple{&g.dv, &gc.dv, &ref.dv, pb.Hkv, pb.Dv, "dv"}}) {
        const GradError e = compare_rows(*got, *r, layout, me, pb.B, pb.S, H, d);
        EXPECT_TRUE(e.finite) << what << " has NaN/inf, " << where;
        EXPECT_LE(e.max_err, kGradTol * e.max_ref + 1e-7)
            << what << ": max |err| " << e.max_err << " vs max |ref| " << e.max_ref << ", "
            << where;
        EXPECT_EQ(std::memcmp(got->data(), cut_got->data(), got->nbytes()), 0)
            << what << " differs from the call without empty documents, " << where;
      }
      const int model_u = sc.strategy == Strategy::ulysses ? P : sc.ulysses;
      const uint64_t model =
          attention_backward_send_bytes(sc.strategy, layout, spec, pb.B, dt, model_u, me);
      EXPECT_EQ(sent, model) << where;
      EXPECT_EQ(model, attention_backward_send_bytes(sc.strategy, layout_cut, spec_cut, pb.B, dt,
                                                     model_u, me))
          << where;
    }
  }
}

// Ring backward sends, per rank, the forward's K/V hops plus dK|dV (fp32) along the same hops and
// home: with no mask every block makes P - 1 hops and one more to get home, so each rank sends
// (P - 1) K/V blocks and P accumulators (or nothing on one rank).
TEST(BackwardBytes, RingClosedFormWithoutMask) {
  const int P = world_size();
  const int64_t S = 64 * P, B = 1, G = 2, D = 16;
  AttnSpec spec;
  spec.heads_q = 4;
  spec.heads_kv = G;
  spec.head_dim = D;
  const Layout layout = Layout::zigzag(S, P);
  const uint64_t block = uint64_t(B * (S / P) * G * 2 * D);
  for (int r = 0; r < P; ++r)
    EXPECT_EQ(ring_backward_send_bytes(layout, spec, B, DType::bf16, r),
              P == 1 ? 0 : uint64_t(P - 1) * block * 2 + uint64_t(P) * block * 4)
        << "rank " << r;
}

// The bf16 gradient error of a ring over P ranks is that of one process (the issue other ring
// implementations have: error growing with the ring, from partial gradients kept in 16 bits).
TEST(BackwardAccuracy, Bf16ErrorDoesNotGrowWithRanks) {
  const int P = world_size();
  const int64_t S = 256, B = 1, H = 4, G = 2, D = 64;
  AttnSpec spec;
  spec.heads_q = H;
  spec.heads_kv = G;
  spec.head_dim = D;
  spec.mask = Mask::causal();
  const Tensor q = test::random_tensor({B, S, H, D}, DType::bf16, 801);
  const Tensor k = test::random_tensor({B, S, G, D}, DType::bf16, 802);
  const Tensor v = test::random_tensor({B, S, G, D}, DType::bf16, 803);
  const Tensor dout = test::random_tensor({B, S, H, D}, DType::bf16, 804);
  const cpu::ReferenceGrads ref = cpu::attention_backward_reference(q, k, v, dout, spec);

  // One process.
  const Partial fwd1 = attention_local(q, k, v, spec);
  const Gradients g1 = attention_local_backward(q, k, v, fwd1, dout, spec);
  const Layout whole = Layout::contiguous(S, 1);
  // P ranks, zigzag ring.
  Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD);
  const Layout layout = Layout::zigzag(S, P);
  const int me = rt.cp_rank();
  const Tensor ql = layout.dispatch(q, me), kl = layout.dispatch(k, me),
               vl = layout.dispatch(v, me), dl = layout.dispatch(dout, me);
  const Partial fwd = attention(rt, ql, kl, vl, spec, layout);
  const Gradients gp = attention_backward(rt, ql, kl, vl, fwd, dl, spec, layout);
  for (const auto& [one, many, r, Hh, name] :
       {std::tuple{&g1.dq, &gp.dq, &ref.dq, H, "dq"}, std::tuple{&g1.dk, &gp.dk, &ref.dk, G, "dk"},
        std::tuple{&g1.dv, &gp.dv, &ref.dv, G, "dv"}}) {
    const double e1 = compare_rows(*one, *r, whole, 0, B, S, Hh, D).relative();
    double ep = compare_rows(*many, *r, layout, me, B, S, Hh, D).relative();
    MPI_Allreduce(MPI_IN_PLACE, &ep, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    EXPECT_LE(ep, 1.5 * e1 + 1e-7)
        << name << ": " << P << " ranks " << ep << " vs 1 process " << e1;
    if (test::print_errors() && world_rank() == 0)
      std::printf("bf16 %s: 1 process %.3g, %d ranks %.3g\n", name, e1, P, ep);
  }
}

// dout of the wrong shape on the last rank only: every rank throws, naming dout and that rank.
TEST(BackwardErrors, BadDoutOnOneRankFailsEveryRank) {
  const int P = world_size();
  const int64_t S = 8 * P;
  AttnSpec spec;
  spec.heads_q = 2;
  spec.heads_kv = 1;
  spec.head_dim = 8;
  Runtime rt = Runtime::from_mpi(MPI_COMM_WORLD);
  const Layout layout = Layout::contiguous(S, P);
  const int me = rt.cp_rank();
  const Tensor q = test::random_tensor({1, 8, 2, 8}, DType::f32, 1);
  const Tensor k = test::random_tensor({1, 8, 1, 8}, DType::f32, 2);
  const Tensor v = test::random_tensor({1, 8, 1, 8}, DType::f32, 3);
  const Partial fwd = attention(rt, q, k, v, spec, layout);
  const Tensor dout = test::random_tensor({1, 8, 2, me == P - 1 ? 4 : 8}, DType::f32, 4);
  EXPECT_TRUE(test::throws_naming([&] { attention_backward(rt, q, k, v, fwd, dout, spec, layout); },
                                  {"dout", "rank " + std::to_string(P - 1)}));
}

}  // namespace
}  // namespace dattn
