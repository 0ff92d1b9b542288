// The attention entry points: validation agreed by all ranks, then the chosen schedule
// (src/strategies/), which reaches the kernels through the dispatch layer (src/dispatch.h).
#include "src/attention.h"

#include <cstring>
#include <initializer_list>
#include <tuple>
#include <utility>

#include "src/base/error.h"
#include "src/check_finite.h"
#include "src/dispatch.h"
#include "src/strategies/strategies.h"
#include "src/validate.h"

namespace dattn {

const char* strategy_name(Strategy s) {
  switch (s) {
    case Strategy::ring:
      return "ring";
    case Strategy::ulysses:
      return "ulysses";
    case Strategy::hybrid:
      return "hybrid";
  }
  return "?";
}

Strategy parse_strategy(const std::string& name) {
  if (name == "ring") return Strategy::ring;
  if (name == "ulysses") return Strategy::ulysses;
  if (name == "hybrid") return Strategy::hybrid;
  DATTN_THROW("invalid strategy = '", name,
              "': expected ring, ulysses or hybrid (tree, ring and allgather decode: "
              "parse_decode_strategy)");
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
  // The kernels' limits, caught here, agreed by every rank, before any data moves (the kernel's
  // own checks would fire mid-schedule, on one rank).
  check_attention_limits(q.device(), q.dtype(), spec, q.size(0), -1);
  DATTN_CHECK_ARG(
      strategy == Strategy::ring || strategy == Strategy::ulysses || strategy == Strategy::hybrid,
      "strategy", int(strategy), "ring, ulysses or hybrid");
  // U members split the kv heads, or U / H_kv members share each one (then each member's query
  // heads must all use that one: H_q a multiple of U).
  DATTN_CHECK_ARG(spec.heads_kv % U == 0 || U % spec.heads_kv == 0, "heads_kv", spec.heads_kv,
                  detail::cat("a multiple or a divisor of the Ulysses degree (", U,
                              ") for strategy ", strategy_name(strategy)));
  DATTN_CHECK_ARG(spec.heads_q % U == 0, "heads_q", spec.heads_q,
                  detail::cat("a multiple of the Ulysses degree (", U, ") for strategy ",
                              strategy_name(strategy)));
  DATTN_CHECK_ARG(layout.ranks() == comm.size(), "layout ranks", layout.ranks(),
                  detail::cat(comm.size(), " (the context-parallel ranks)"));
  DATTN_CHECK_ARG(layout.global_seq() > 0, "global_seq", layout.global_seq(), "> 0");
  if (spec.mask.documents)
    DATTN_CHECK_ARG(spec.mask.documents->back() == layout.global_seq(), "cu_seqlens back",
                    spec.mask.documents->back(),
                    detail::cat(layout.global_seq(), " (the layout's global_seq)"));
  if (spec.mask.slices)
    DATTN_CHECK_ARG(
        spec.mask.extent() <= layout.global_seq(), "slices", spec.mask.str(),
        detail::cat("slices inside the sequence (their largest end is ", spec.mask.extent(),
                    ", the layout's global_seq ", layout.global_seq(), ")"));
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
  StreamScope on_stream(rt.stream());  // all device work of this call on its stream
  Communicator& comm = rt.cp();
  const uint64_t hash = attention_config_hash(spec, layout, strategy, q.dtype(), q.size(0));
  const int U = ulysses_degree_of(rt, strategy);
  const Device device = rt.device();
  agree_on_validation(comm, "attention call", hash_mix(hash, uint64_t(U)), [&] {
    check_attention_call(comm, q, k, v, spec, layout, strategy, U, &device);
    if (rt.check_finite()) check_shards_finite(comm, layout, {{&q, "q"}, {&k, "k"}, {&v, "v"}});
  });
  // The schedules compute plain partials; the sinks join the merged result once.
  const AttnSpec plain = spec.without_sinks();
  Partial res = U == 1 ? ring_attention_forward(comm, q, k, v, plain, layout)
                : strategy == Strategy::ulysses
                    ? hybrid_attention_forward(comm, nullptr, q, k, v, plain, layout, comm.rank())
                    : hybrid_attention_forward(rt.ulysses_group(), &rt.ring_group(), q, k, v, plain,
                                               layout, comm.rank());
  if (spec.sinks) add_sinks(res, *spec.sinks);
  return res;
}

Partial attention_local(const Tensor& q, const Tensor& k, const Tensor& v, const AttnSpec& spec,
                        int64_t q_pos0, int64_t k_pos0) {
  const Device device = q.device();  // k and v must be on it too
  check_qkv(q, k, v, spec, &device);
  check_attention_limits(device, q.dtype(), spec, q.size(0), -1);
  if (check_finite_env())
    check_local_finite({{&q, "q", q_pos0}, {&k, "k", k_pos0}, {&v, "v", k_pos0}});
  const AttnSpec plain = spec.without_sinks();
  Partial res = empty_partial(q, plain);
  attend_runs(q, {Run{0, q_pos0, 1, q.size(1)}}, k.data(), v.data(), k.size(1),
              {Run{0, k_pos0, 1, k.size(1)}}, plain, res);
  if (spec.sinks) add_sinks(res, *spec.sinks);
  return res;
}

namespace {
// Checks the forward result and dout of a backward call against q and the spec: fwd.out
// [B, S_q, H_q, D_v] fp32, fwd.lse [B, H_q, S_q] fp32, dout [B, S_q, H_q, D_v] (any dtype), all on
// q's device.
void check_backward_inputs(const Tensor& q, const Partial& fwd, const Tensor& dout,
                           const AttnSpec& spec) {
  const int64_t B = q.size(0), S = q.size(1), H = spec.heads_q, Dv = spec.dim_v();
  auto check_shape = [&](const Tensor& t, const char* name, std::initializer_list<int64_t> want,
                         const char* layout) {
    DATTN_CHECK_ARG(t.defined() && t.dim() == int(want.size()), detail::cat(name, " rank"), t.dim(),
                    detail::cat(want.size(), " dimensions ", layout));
    DATTN_CHECK_ARG(t.device() == q.device(), detail::cat(name, " device"), t.device().str(),
                    detail::cat(q.device().str(), " (the device of q)"));
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

// The sinks' gradient of this rank's rows: with the sink's probability p = exp(sink - lse) in a
// row (lse the forward's, which counts the sink), d sink = -p * delta, delta = dout . out;
// summed over the rows (batch, positions) of each head, in float64, in row order. lse and delta
// [B, H, S] fp32.
std::vector<double> sinks_grad_rows(const std::vector<float>& sinks, const Tensor& lse,
                                    const Tensor& delta) {
  const int64_t B = lse.size(0), H = lse.size(1), S = lse.size(2);
  const float* l = lse.ptr<float>();
  const float* d = delta.ptr<float>();
  std::vector<double> g(size_t(H), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t s = 0; s < S; ++s) {
        const size_t i = size_t((b * H + h) * S + s);
        g[size_t(h)] -= std::exp(double(sinks[size_t(h)]) - double(l[i])) * double(d[i]);
      }
  return g;
}

Tensor as_f32_tensor(const std::vector<double>& x) {
  Tensor t = Tensor::empty({int64_t(x.size())}, DType::f32);
  for (size_t i = 0; i < x.size(); ++i)
    t.ptr<float>()[i] = float(x[i]);
  return t;
}
}  // namespace

Gradients attention_local_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                   const Partial& fwd, const Tensor& dout, const AttnSpec& spec,
                                   int64_t q_pos0, int64_t k_pos0) {
  const Device device = q.device();  // every tensor must be on it
  check_qkv(q, k, v, spec, &device);
  check_attention_limits(device, q.dtype(), spec, q.size(0), -1);
  check_backward_inputs(q, fwd, dout, spec);
  if (check_finite_env())
    check_local_finite(
        {{&q, "q", q_pos0}, {&k, "k", k_pos0}, {&v, "v", k_pos0}, {&dout, "dout", q_pos0}});
  const int64_t B = q.size(0), Sq = q.size(1), Sk = k.size(1);
  Gradients g{Tensor::zeros({B, Sq, spec.heads_q, spec.head_dim}, DType::f32, device),
              Tensor::zeros({B, Sk, spec.heads_kv, spec.head_dim}, DType::f32, device),
              Tensor::zeros({B, Sk, spec.heads_kv, spec.dim_v()}, DType::f32, device)};
  const Tensor delta = backward_delta(dout, fwd.out);
  // The probabilities come from fwd.lse, which counts the sinks: dq, dk and dv need nothing else.
  backward_runs(q, {Run{0, q_pos0, 1, Sq}}, k.data(), v.data(), Sk, {Run{0, k_pos0, 1, Sk}}, dout,
                fwd.lse.ptr<float>(), delta.ptr<float>(), spec.without_sinks(), g.dq.ptr<float>(),
                g.dk.ptr<float>(), g.dv.ptr<float>());
  if (spec.sinks) {  // a sum over rows in float64, on the host (src/partial.h: dsinks is host)
    const auto host = [](const Tensor& t) {
      return t.device().is_cpu() ? t : t.to_device(Device::cpu());
    };
    g.dsinks = as_f32_tensor(sinks_grad_rows(*spec.sinks, host(fwd.lse), host(delta)));
  }
  return g;
}

Gradients attention_backward(Runtime& rt, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Partial& fwd, const Tensor& dout, const AttnSpec& spec,
                             const Layout& layout, Strategy strategy) {
  StreamScope on_stream(rt.stream());  // all device work of this call on its stream
  Communicator& comm = rt.cp();
  const int U = ulysses_degree_of(rt, strategy);
  const uint64_t hash = attention_config_hash(spec, layout, strategy, q.dtype(), q.size(0));
  const Device device = rt.device();
  agree_on_validation(comm, "attention backward call", hash_mix(hash, uint64_t(U)), [&] {
    check_attention_call(comm, q, k, v, spec, layout, strategy, U, &device);
    check_backward_inputs(q, fwd, dout, spec);
    if (rt.check_finite())
      check_shards_finite(comm, layout, {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&dout, "dout"}});
  });
  // dout in fp32 once: the Ulysses and hybrid schedules move and read it as fp32 whatever the
  // storage dtype (as their byte model counts it). The ring never moves dout: on a GPU it stays in
  // its dtype, which the CUDA kernel reads.
  const Tensor dout32 = U == 1 && !device.is_cpu() ? dout : as_f32(dout);
  const Tensor delta = backward_delta(dout32, fwd.out);
  const float* lse = fwd.lse.ptr<float>();
  // The probabilities come from fwd.lse, which counts the sinks: the schedules need nothing else.
  const AttnSpec plain = spec.without_sinks();
  Gradients g =
      U == 1
          ? ring_attention_backward(comm, q, k, v, dout32, lse, delta.ptr<float>(), plain, layout)
      : strategy == Strategy::ulysses
          ? hybrid_attention_backward(comm, nullptr, q, k, v, dout32, lse, delta.ptr<float>(),
                                      plain, layout, comm.rank())
          : hybrid_attention_backward(rt.ulysses_group(), &rt.ring_group(), q, k, v, dout32, lse,
                                      delta.ptr<float>(), plain, layout, comm.rank());
  if (spec.sinks) {
    // Each rank's rows (summed on the host), then the sum over the cp ranks (every rank gets it)
    // in the cp group's memory: on a GPU Runtime through the device, NCCL moving device memory
    // only. dsinks comes back on the host (src/partial.h).
    const auto host = [](const Tensor& t) {
      return t.device().is_cpu() ? t : t.to_device(Device::cpu());
    };
    const std::vector<double> mine = sinks_grad_rows(*spec.sinks, host(fwd.lse), host(delta));
    const Tensor part = as_f32_tensor(mine);
    g.dsinks = part;
    if (comm.size() > 1) {
      const Tensor part_d = device.is_cpu() ? part : part.to_device(device);
      Tensor sum = Tensor::empty({int64_t(mine.size())}, DType::f32, device);
      comm.allreduce(part_d.data(), sum.data(), mine.size(), DType::f32, ReduceOp::sum);
      g.dsinks = host(sum);
    }
  }
  return g;
}

}  // namespace dattn
