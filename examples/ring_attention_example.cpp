// The API in one small program: every rank builds the same global q, k, v, takes its shard,
// runs ring attention, gathers the output back, and checks it against one process computing
// the whole problem. Run: bash launch/mpirun.sh -n 3 build/bin/dattn-ring-example
#include <cmath>
#include <cstdio>

#include "launch/program.h"
#include "src/attention.h"

namespace {

// Deterministic values in [-1, 1), the same on every rank.
dattn::Tensor make_global(std::initializer_list<int64_t> shape, uint32_t seed) {
  dattn::Tensor t = dattn::Tensor::empty(shape, dattn::DType::bf16);
  uint32_t x = seed;
  for (int64_t i = 0; i < t.numel(); ++i) {
    x = x * 1664525u + 1013904223u;  // a plain LCG is enough for an example
    t.set(i, float(x >> 8) * 0x1p-23f - 1.0f);
  }
  return t;
}

int example(int, char**) {
  auto rt = dattn::Runtime::from_mpi(MPI_COMM_WORLD);
  dattn::AttnSpec spec{.heads_q = 8, .heads_kv = 2, .head_dim = 64, .mask = dattn::Mask::causal()};
  const int64_t B = 1, S = 1000;  // S need not divide by the ranks
  auto layout = dattn::Layout::contiguous(S, rt.cp_size());

  dattn::Tensor q_global = make_global({B, S, spec.heads_q, spec.head_dim}, 1);
  dattn::Tensor k_global = make_global({B, S, spec.heads_kv, spec.head_dim}, 2);
  dattn::Tensor v_global = make_global({B, S, spec.heads_kv, spec.head_dim}, 3);
  dattn::Tensor q = layout.dispatch(q_global, rt.cp_rank());
  dattn::Tensor k = layout.dispatch(k_global, rt.cp_rank());
  dattn::Tensor v = layout.dispatch(v_global, rt.cp_rank());

  dattn::Partial r = dattn::attention(rt, q, k, v, spec, layout, dattn::Strategy::ring);
  dattn::Tensor out = layout.undispatch(rt.cp(), r.out);  // [B, S, H_q, D], on every rank

  dattn::Partial whole = dattn::attention_local(q_global, k_global, v_global, spec);
  double max_diff = 0;
  for (int64_t i = 0; i < out.numel(); ++i)
    max_diff = std::fmax(max_diff, std::fabs(out.get(i) - whole.out.get(i)));
  if (rt.rank() == 0)
    std::printf("ring attention over %d ranks, S=%lld: max |out - single process| = %.3g\n",
                rt.cp_size(), static_cast<long long>(S), max_diff);
  return max_diff <= 1e-5 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  return dattn::run_program(argc, argv, example);
}
