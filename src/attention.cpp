// The attention entry points: validation agreed by all ranks, then the chosen schedule.
// Also the helpers every schedule shares: an empty partial, and attending q's runs to a block.
// These helpers are the one place that picks the CPU or the CUDA kernels, by the tensors' device
// (src/device_ops.h does the same for copies and elementwise steps): strategy code calls them and
// never branches on the device itself.
#include "src/attention.h"

#include <cstring>
#include <initializer_list>
#include <tuple>
#include <type_traits>
#include <utility>

#include "kernels/cpu/attention_backward_cpu.h"
#include "kernels/cpu/attention_cpu.h"
#include "kernels/merge.h"
#include "src/base/error.h"
#include "src/check_finite.h"
#include "src/device_ops.h"
#include "src/strategies/strategies.h"
#include "src/validate.h"
#if DATTN_WITH_CUDA
#include "kernels/cuda/attention_cuda.h"
#include "kernels/movement/movement.h"
#include "src/base/cuda_check.h"
#endif

namespace dattn {

const char* strategy_name(Strategy s) {
  switch (s) {
    case Strategy::ring:
      return "ring";
    case Strategy::ulysses:
      return "ulysses";
    case Strategy::hybrid:
      return "hybrid";
    case Strategy::tree:
      return "tree";
    case Strategy::allgather:
      return "allgather";
  }
  return "?";
}

Strategy parse_strategy(const std::string& name) {
  if (name == "ring") return Strategy::ring;
  if (name == "ulysses") return Strategy::ulysses;
  if (name == "hybrid") return Strategy::hybrid;
  if (name == "tree") return Strategy::tree;
  if (name == "allgather") return Strategy::allgather;
  DATTN_THROW("invalid strategy = '", name, "': expected ring, ulysses, hybrid, tree or allgather");
}

void clear_partial(Partial& p) {
  if (p.out.device().is_cpu()) {
    clear_partial(p.out.ptr<float>(), p.lse.ptr<float>(), p.out.size(0), p.out.size(1),
                  p.out.size(2), p.out.size(3));
    return;
  }
#if DATTN_WITH_CUDA
  // The legacy default stream, as the kernels (see attend_runs_cuda).
  movement::cuda::clear_partial(p.out.ptr<float>(), p.out.numel(), p.lse.ptr<float>(),
                                p.lse.numel(), nullptr);
#else
  DATTN_THROW("invalid partial device = ", p.out.device().str(),
              ": this build has no CUDA backend");
#endif
}

Partial empty_partial(const Tensor& q, const AttnSpec& spec) {
  const int64_t B = q.size(0), S = q.size(1);
  Partial p{Tensor::empty({B, S, spec.heads_q, spec.dim_v()}, DType::f32, q.device()),
            Tensor::empty({B, spec.heads_q, S}, DType::f32, q.device())};
  clear_partial(p);
  return p;
}

namespace {
// The kernel arguments shared by every block of one call (cpu:: or cuda::AttentionBlock, both a
// BlockOfWork): tensors, shapes, scale, and the CPU block's mask (the GPU's is set by the caller:
// its documents live in device memory).
template <typename Block>
Block make_block(const Tensor& q, const void* k, const void* v, int64_t k_rows,
                 const AttnSpec& spec) {
  Block blk;
  blk.q = q.data();
  blk.k = k;
  blk.v = v;
  blk.dtype = q.dtype();
  blk.batch = q.size(0);
  blk.seq_q = q.size(1);
  blk.seq_k = k_rows;
  blk.heads_q = spec.heads_q;
  blk.heads_kv = spec.heads_kv;
  blk.head_dim = spec.head_dim;
  blk.head_dim_v = spec.dim_v();
  blk.scale = spec.scale();
  if constexpr (std::is_same_v<Block, cpu::AttentionBlock>) blk.mask = spec.mask;
  return blk;
}

// Points blk at the query run qr and the key run kr (rows and global positions).
void set_runs(BlockOfWork& blk, const Run& qr, const Run& kr) {
  blk.q_begin = qr.local_begin;
  blk.q_len = qr.length;
  blk.q_pos0 = qr.global_begin;
  blk.q_pos_stride = qr.stride;
  blk.q_pos_block = qr.block;
  blk.k_begin = kr.local_begin;
  blk.k_len = kr.length;
  blk.k_pos0 = kr.global_begin;
  blk.k_pos_stride = kr.stride;
  blk.k_pos_block = kr.block;
}

#if DATTN_WITH_CUDA
// attend_runs on a GPU. The kernels run on the legacy default stream (stream 0), on purpose: the
// NCCL communicator's own (non-blocking) stream waits for what stream 0 holds each time it issues
// (NcclCommunicator::follow_default_stream), and its waits complete on the host; so each kernel
// runs after the receive that filled its K/V block (waited for) and before any later NCCL call
// that overwrites that block or reads the partial, with no event in the strategies. A kernel
// queued after Communicator::start() overlaps the messages of its own step (ring.cpp).
void attend_runs_cuda(const Tensor& q, const std::vector<Run>& q_runs, const void* k, const void* v,
                      int64_t k_rows, const std::vector<Run>& k_runs, const AttnSpec& spec,
                      Partial& res) {
  auto blk = make_block<cuda::AttentionBlock>(q, k, v, k_rows, spec);
  // The kernel reads document boundaries from device memory: one copy per call.
  Tensor cu_seqlens;
  if (spec.mask.documents) {
    const std::vector<int64_t>& docs = *spec.mask.documents;
    cu_seqlens = byte_buffer(docs.size() * sizeof(int64_t), q.device());
    DATTN_CUDA_CHECK(cudaMemcpy(cu_seqlens.data(), docs.data(), docs.size() * sizeof(int64_t),
                                cudaMemcpyHostToDevice));
  }
  cuda::set_mask(blk, spec.mask, static_cast<const int64_t*>(cu_seqlens.data()));
  for (const Run& qr : q_runs) {
    for (const Run& kr : k_runs) {
      set_runs(blk, qr, kr);
      cuda::attention_forward(blk, res.out.ptr<float>(), res.lse.ptr<float>(), nullptr);
    }
  }
  // The kernels read cu_seqlens until they finish; its storage is freed on return, in the order
  // of the default stream where they run (src/base/tensor.h): after them, without a host wait.
}
#endif
}  // namespace

void attend_runs(const Tensor& q, const std::vector<Run>& q_runs, const void* k, const void* v,
                 int64_t k_rows, const std::vector<Run>& k_runs, const AttnSpec& spec,
                 Partial& res) {
  if (!q.device().is_cpu()) {
#if DATTN_WITH_CUDA
    attend_runs_cuda(q, q_runs, k, v, k_rows, k_runs, spec, res);
    return;
#else
    DATTN_THROW("invalid q device = ", q.device().str(), ": this build has no CUDA backend");
#endif
  }
  auto blk = make_block<cpu::AttentionBlock>(q, k, v, k_rows, spec);
  for (const Run& qr : q_runs) {
    for (const Run& kr : k_runs) {
      set_runs(blk, qr, kr);
      cpu::attention_forward(blk, res.out.ptr<float>(), res.lse.ptr<float>());
    }
  }
}

void backward_runs(const Tensor& q, const std::vector<Run>& q_runs, const void* k, const void* v,
                   int64_t k_rows, const std::vector<Run>& k_runs, const Tensor& dout,
                   const float* lse, const float* delta, const AttnSpec& spec, float* dq, float* dk,
                   float* dv) {
  auto blk = make_block<cpu::AttentionBlock>(q, k, v, k_rows, spec);
  for (const Run& qr : q_runs) {
    for (const Run& kr : k_runs) {
      set_runs(blk, qr, kr);
      cpu::attention_backward(blk, dout.data(), dout.dtype(), lse, delta, dq, dk, dv);
    }
  }
}

// Shape and dtype checks of q, k, v against the spec (local: each rank checks its own).
void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, const AttnSpec& spec,
               const Device* device) {
  spec.validate();
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}}) {
    DATTN_CHECK_ARG(t->dim() == 4, detail::cat(name, " rank"), t->dim(),
                    "4 dimensions [batch, seq, heads, head_dim]");
    if (device == nullptr)
      DATTN_CHECK_ARG(t->device().is_cpu(), detail::cat(name, " device"), t->device().str(),
                      "cpu (this entry point has no CUDA path yet)");
    else
      DATTN_CHECK_ARG(t->device() == *device, detail::cat(name, " device"), t->device().str(),
                      detail::cat(device->str(), " (the Runtime's device)"));
    DATTN_CHECK_ARG(t->dtype() == q.dtype(), detail::cat(name, " dtype"), dtype_name(t->dtype()),
                    detail::cat(dtype_name(q.dtype()), " (the dtype of q)"));
    DATTN_CHECK_ARG(t->size(0) == q.size(0), detail::cat(name, " batch"), t->size(0),
                    detail::cat(q.size(0), " (the batch of q)"));
    DATTN_CHECK_ARG(t->data() != nullptr || t->numel() == 0, detail::cat(name, " data"), "nullptr",
                    "a valid pointer");
  }
  DATTN_CHECK_ARG(q.size(0) > 0, "batch", q.size(0), "> 0");
  DATTN_CHECK_ARG(q.size(2) == spec.heads_q, "q heads", q.size(2),
                  detail::cat(spec.heads_q, " (spec.heads_q)"));
  DATTN_CHECK_ARG(q.size(3) == spec.head_dim, "q head_dim", q.size(3),
                  detail::cat(spec.head_dim, " (spec.head_dim)"));
  DATTN_CHECK_ARG(k.size(2) == spec.heads_kv, "k heads", k.size(2),
                  detail::cat(spec.heads_kv, " (spec.heads_kv)"));
  DATTN_CHECK_ARG(k.size(3) == spec.head_dim, "k head_dim", k.size(3),
                  detail::cat(spec.head_dim, " (spec.head_dim)"));
  DATTN_CHECK_ARG(v.size(2) == spec.heads_kv, "v heads", v.size(2),
                  detail::cat(spec.heads_kv, " (spec.heads_kv)"));
  DATTN_CHECK_ARG(v.size(3) == spec.dim_v(), "v head_dim", v.size(3),
                  detail::cat(spec.dim_v(), " (spec.head_dim_v)"));
  DATTN_CHECK_ARG(v.size(1) == k.size(1), "v seq", v.size(1),
                  detail::cat(k.size(1), " (the seq of k)"));
}

uint64_t attention_config_hash(const AttnSpec& spec, const Layout& layout, Strategy strategy,
                               DType dtype, int64_t batch) {
  uint32_t scale_bits;
  float scale = spec.scale();
  std::memcpy(&scale_bits, &scale, 4);
  uint64_t h = kHashSeed;
  for (uint64_t x : {uint64_t(spec.heads_q), uint64_t(spec.heads_kv), uint64_t(spec.head_dim),
                     uint64_t(spec.dim_v()), uint64_t(scale_bits), spec.mask.hash(), layout.hash(),
                     uint64_t(strategy), uint64_t(dtype), uint64_t(batch)})
    h = hash_mix(h, x);
  return h;
}

namespace {
// The Ulysses degree of a call: ring 1, ulysses every cp rank, hybrid the runtime's groups.
int ulysses_degree_of(Runtime& rt, Strategy strategy) {
  return strategy == Strategy::ring      ? 1
         : strategy == Strategy::ulysses ? rt.cp().size()
                                         : rt.ulysses_degree();
}

// The checks of one distributed call on this rank (forward and backward alike). device: the
// Runtime's device, where the call runs on it (the forward); null: host tensors only.
void check_attention_call(Communicator& comm, const Tensor& q, const Tensor& k, const Tensor& v,
                          const AttnSpec& spec, const Layout& layout, Strategy strategy, int U,
                          const Device* device) {
  check_qkv(q, k, v, spec, device);
  // The CUDA kernel's limits, caught here, agreed by every rank, before any data moves (the
  // kernel's own checks would fire mid-schedule, on one rank).
  if (!q.device().is_cpu()) check_cuda_kernel_limits(q.dtype(), spec, q.size(0));
  DATTN_CHECK_ARG(
      strategy == Strategy::ring || strategy == Strategy::ulysses || strategy == Strategy::hybrid,
      "strategy", strategy_name(strategy),
      "ring, ulysses or hybrid for attention (tree and allgather are decode "
      "strategies: dattn::decode)");
  DATTN_CHECK_ARG(spec.heads_kv % U == 0, "heads_kv", spec.heads_kv,
                  detail::cat("a multiple of the Ulysses degree (", U, ") for strategy ",
                              strategy_name(strategy)));
  DATTN_CHECK_ARG(layout.ranks() == comm.size(), "layout ranks", layout.ranks(),
                  detail::cat(comm.size(), " (the context-parallel ranks)"));
  DATTN_CHECK_ARG(layout.global_seq() > 0, "global_seq", layout.global_seq(), "> 0");
  if (spec.mask.documents)
    DATTN_CHECK_ARG(spec.mask.documents->back() == layout.global_seq(), "cu_seqlens back",
                    spec.mask.documents->back(),
                    detail::cat(layout.global_seq(), " (the layout's global_seq)"));
  const int64_t local = layout.local_len(comm.rank());
  DATTN_CHECK_ARG(q.size(1) == local, "q seq", q.size(1),
                  detail::cat(local, " (this rank's length under ", layout.str(), ")"));
  DATTN_CHECK_ARG(k.size(1) == local, "k seq", k.size(1),
                  detail::cat(local, " (this rank's length under ", layout.str(), ")"));
}

// The non-finite check of this rank's shards (after the shape checks), positions from the layout.
void check_shards_finite(Communicator& comm, const Layout& layout,
                         std::initializer_list<std::pair<const Tensor*, const char*>> tensors) {
  const int rank = comm.rank();
  for (auto [t, name] : tensors)
    check_finite_tensor(*t, name, [&](int64_t row) { return layout.global_position(rank, row); });
}

// The same for attention_local's whole tensors, at positions pos0 + row.
void check_local_finite(std::initializer_list<std::tuple<const Tensor*, const char*, int64_t>> ts) {
  for (auto [t, name, pos0] : ts)  // an init-capture: clang 14 cannot capture a binding
    check_finite_tensor(*t, name, [p = pos0](int64_t row) { return p + row; });
}
}  // namespace

Partial attention(Runtime& rt, const Tensor& q, const Tensor& k, const Tensor& v,
                  const AttnSpec& spec, const Layout& layout, Strategy strategy) {
  Communicator& comm = rt.cp();
  const uint64_t hash = attention_config_hash(spec, layout, strategy, q.dtype(), q.size(0));
  const int U = ulysses_degree_of(rt, strategy);
  const Device device = rt.device();
  agree_on_validation(comm, "attention call", hash_mix(hash, uint64_t(U)), [&] {
    check_attention_call(comm, q, k, v, spec, layout, strategy, U, &device);
    if (rt.check_finite()) check_shards_finite(comm, layout, {{&q, "q"}, {&k, "k"}, {&v, "v"}});
  });
  if (U == 1) return ring_attention_forward(comm, q, k, v, spec, layout);
  if (strategy == Strategy::ulysses)
    return hybrid_attention_forward(comm, nullptr, q, k, v, spec, layout, comm.rank());
  return hybrid_attention_forward(rt.ulysses_group(), &rt.ring_group(), q, k, v, spec, layout,
                                  comm.rank());
}

Partial attention_local(const Tensor& q, const Tensor& k, const Tensor& v, const AttnSpec& spec,
                        int64_t q_pos0, int64_t k_pos0) {
  check_qkv(q, k, v, spec);
  if (check_finite_env())
    check_local_finite({{&q, "q", q_pos0}, {&k, "k", k_pos0}, {&v, "v", k_pos0}});
  Partial res = empty_partial(q, spec);
  auto blk = make_block<cpu::AttentionBlock>(q, k.data(), v.data(), k.size(1), spec);
  blk.q_pos0 = q_pos0;
  blk.k_pos0 = k_pos0;
  cpu::attention_forward(blk, res.out.ptr<float>(), res.lse.ptr<float>());
  return res;
}

namespace {
// Checks the forward result and dout of a backward call against q and the spec: fwd.out
// [B, S_q, H_q, D_v] fp32, fwd.lse [B, H_q, S_q] fp32, dout [B, S_q, H_q, D_v] (any dtype).
void check_backward_inputs(const Tensor& q, const Partial& fwd, const Tensor& dout,
                           const AttnSpec& spec) {
  const int64_t B = q.size(0), S = q.size(1), H = spec.heads_q, Dv = spec.dim_v();
  auto check_shape = [](const Tensor& t, const char* name, std::initializer_list<int64_t> want,
                        const char* layout) {
    DATTN_CHECK_ARG(t.defined() && t.dim() == int(want.size()), detail::cat(name, " rank"), t.dim(),
                    detail::cat(want.size(), " dimensions ", layout));
    DATTN_CHECK_ARG(t.device().is_cpu(), detail::cat(name, " device"), t.device().str(),
                    "cpu (the backward has no CUDA path yet)");
    int d = 0;
    for (int64_t n : want) {
      DATTN_CHECK_ARG(t.size(d) == n, detail::cat(name, " shape"), t.shape_str(),
                      detail::cat("size ", n, " in dimension ", d, " of ", layout));
      ++d;
    }
    DATTN_CHECK_ARG(t.data() != nullptr || t.numel() == 0, detail::cat(name, " data"), "nullptr",
                    "a valid pointer");
  };
  check_shape(dout, "dout", {B, S, H, Dv}, "[batch, seq_q, heads_q, head_dim_v]");
  check_shape(fwd.out, "fwd.out", {B, S, H, Dv}, "[batch, seq_q, heads_q, head_dim_v]");
  check_shape(fwd.lse, "fwd.lse", {B, H, S}, "[batch, heads_q, seq_q]");
  DATTN_CHECK_ARG(fwd.out.dtype() == DType::f32, "fwd.out dtype", dtype_name(fwd.out.dtype()),
                  "fp32 (attention's output)");
  DATTN_CHECK_ARG(fwd.lse.dtype() == DType::f32, "fwd.lse dtype", dtype_name(fwd.lse.dtype()),
                  "fp32 (attention's lse)");
}
}  // namespace

Gradients attention_local_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                   const Partial& fwd, const Tensor& dout, const AttnSpec& spec,
                                   int64_t q_pos0, int64_t k_pos0) {
  check_qkv(q, k, v, spec);
  check_backward_inputs(q, fwd, dout, spec);
  if (check_finite_env())
    check_local_finite(
        {{&q, "q", q_pos0}, {&k, "k", k_pos0}, {&v, "v", k_pos0}, {&dout, "dout", q_pos0}});
  const int64_t B = q.size(0), Sq = q.size(1), Sk = k.size(1);
  Gradients g{Tensor::zeros({B, Sq, spec.heads_q, spec.head_dim}, DType::f32),
              Tensor::zeros({B, Sk, spec.heads_kv, spec.head_dim}, DType::f32),
              Tensor::zeros({B, Sk, spec.heads_kv, spec.dim_v()}, DType::f32)};
  Tensor delta = Tensor::empty({B, spec.heads_q, Sq}, DType::f32);
  cpu::attention_backward_delta(dout.data(), dout.dtype(), fwd.out.ptr<float>(), B, Sq,
                                spec.heads_q, spec.dim_v(), delta.ptr<float>());
  auto blk = make_block<cpu::AttentionBlock>(q, k.data(), v.data(), Sk, spec);
  blk.q_pos0 = q_pos0;
  blk.k_pos0 = k_pos0;
  cpu::attention_backward(blk, dout.data(), dout.dtype(), fwd.lse.ptr<float>(), delta.ptr<float>(),
                          g.dq.ptr<float>(), g.dk.ptr<float>(), g.dv.ptr<float>());
  return g;
}

Gradients attention_backward(Runtime& rt, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Partial& fwd, const Tensor& dout, const AttnSpec& spec,
                             const Layout& layout, Strategy strategy) {
  Communicator& comm = rt.cp();
  const int U = ulysses_degree_of(rt, strategy);
  const uint64_t hash = attention_config_hash(spec, layout, strategy, q.dtype(), q.size(0));
  agree_on_validation(comm, "attention backward call", hash_mix(hash, uint64_t(U)), [&] {
    check_attention_call(comm, q, k, v, spec, layout, strategy, U, nullptr);
    check_backward_inputs(q, fwd, dout, spec);
    if (rt.check_finite())
      check_shards_finite(comm, layout, {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&dout, "dout"}});
  });
  // dout in fp32 once: the schedules move and read it as fp32 whatever the storage dtype.
  const Tensor dout32 = dout.dtype() == DType::f32 ? dout : dout.to(DType::f32);
  const int64_t B = q.size(0), S = q.size(1);
  Tensor delta = Tensor::empty({B, spec.heads_q, S}, DType::f32);
  cpu::attention_backward_delta(dout32.data(), DType::f32, fwd.out.ptr<float>(), B, S, spec.heads_q,
                                spec.dim_v(), delta.ptr<float>());
  const float* lse = fwd.lse.ptr<float>();
  if (U == 1)
    return ring_attention_backward(comm, q, k, v, dout32, lse, delta.ptr<float>(), spec, layout);
  if (strategy == Strategy::ulysses)
    return hybrid_attention_backward(comm, nullptr, q, k, v, dout32, lse, delta.ptr<float>(), spec,
                                     layout, comm.rank());
  return hybrid_attention_backward(rt.ulysses_group(), &rt.ring_group(), q, k, v, dout32, lse,
                                   delta.ptr<float>(), spec, layout, comm.rank());
}

}  // namespace dattn
