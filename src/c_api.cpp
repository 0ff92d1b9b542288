// The C API of src/dattn.h over the C++ API: argument checks that name the C parameter, the
// conversion of C structs to Tensor/AttnSpec/Layout, and the boundary that turns every C++
// exception into a dattn_status plus a per-thread message.
#include "src/dattn.h"

#include <cstring>
#include <exception>
#include <iterator>
#include <new>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "src/attention.h"
#include "src/base/error.h"
#include "src/validate.h"

struct dattn_runtime {
  dattn::Runtime rt;
};

namespace {

using dattn::detail::cat;

// The message of this thread's last call ("" after a success).
thread_local std::string t_last_error;

// The status of each kind of dattn::Error, and the other way round (dattn_status_name).
constexpr std::pair<dattn::ErrorKind, dattn_status> kStatusOfKind[] = {
    {dattn::ErrorKind::invalid_argument, DATTN_ERROR_INVALID_ARGUMENT},
    {dattn::ErrorKind::mpi, DATTN_ERROR_MPI},
    {dattn::ErrorKind::cuda, DATTN_ERROR_CUDA},
    {dattn::ErrorKind::nccl, DATTN_ERROR_NCCL},
    {dattn::ErrorKind::out_of_memory, DATTN_ERROR_OUT_OF_MEMORY},
    {dattn::ErrorKind::timeout, DATTN_ERROR_TIMEOUT},
    {dattn::ErrorKind::internal, DATTN_ERROR_INTERNAL},
};
static_assert(std::size(kStatusOfKind) == dattn::kErrorKinds, "a status for every kind");

dattn_status status_of(dattn::ErrorKind kind) {
  for (const auto& [k, status] : kStatusOfKind)
    if (k == kind) return status;
  return DATTN_ERROR_INTERNAL;
}

// The integer a C caller stored in an enum field or passed as an enum argument. C lets any int
// through an enum type, but in C++ reading an enum object whose value lies outside its
// enumerators' range is undefined (UBSan: "load of value 7, which is not a valid value for type
// 'dattn_dtype'"), so the bytes are read as the underlying integer and checked as an int.
template <typename E>
int c_enum(const E& e) {
  std::underlying_type_t<E> v;
  std::memcpy(&v, &e, sizeof v);
  return int(v);
}

// Runs body; no exception leaves. Sets this thread's message and returns the status.
template <typename Body>
dattn_status guarded(const char* function, Body&& body) noexcept {
  try {
    t_last_error.clear();
    body();
    return DATTN_OK;
  } catch (const dattn::Error& e) {
    try {
      t_last_error = cat(function, ": ", e.what());
    } catch (...) {
    }
    return status_of(e.kind());
  } catch (const std::bad_alloc&) {
    try {
      t_last_error = cat(function, ": out of memory");
    } catch (...) {
    }
    return DATTN_ERROR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    try {
      t_last_error = cat(function, ": internal error: ", e.what());
    } catch (...) {
    }
    return DATTN_ERROR_INTERNAL;
  } catch (...) {
    try {
      t_last_error = cat(function, ": internal error: unknown exception");
    } catch (...) {
    }
    return DATTN_ERROR_INTERNAL;
  }
}

// Runs a collective call's argument checks so that all ranks agree: a failure on any rank fails
// the call on every rank with that rank's kind of error (before any data moves).
template <typename Check>
void agree(dattn::Runtime& rt, const char* what, Check&& check) {
  dattn::agree_on_validation(rt.cp(), what, dattn::kHashSeed, check);
}

std::vector<int64_t> copy_cu_seqlens(const int64_t* cu, int64_t n, const char* name) {
  DATTN_CHECK_ARG(cu != nullptr, cat(name, ".cu_seqlens"), "NULL", "an array of boundaries");
  DATTN_CHECK_ARG(n >= 2, cat(name, ".num_cu_seqlens"), n,
                  ">= 2 ([0, end of document 1, ..., total])");
  return std::vector<int64_t>(cu, cu + n);
}

dattn::Layout make_layout(const dattn_layout* l, int ranks) {
  DATTN_CHECK_ARG(l != nullptr, "layout", "NULL", "a dattn_layout");
  switch (c_enum(l->kind)) {
    case DATTN_LAYOUT_CONTIGUOUS:
      return dattn::Layout::contiguous(l->global_seq, ranks);
    case DATTN_LAYOUT_ZIGZAG:
      return dattn::Layout::zigzag(l->global_seq, ranks);
    case DATTN_LAYOUT_STRIPED:
      DATTN_CHECK_ARG(l->stripe_block >= 0, "layout.stripe_block", l->stripe_block,
                      ">= 1 token (0 means 1)");
      return dattn::Layout::striped(l->global_seq, ranks,
                                    l->stripe_block == 0 ? 1 : l->stripe_block);
    case DATTN_LAYOUT_VARLEN: {
      std::vector<int64_t> cu = copy_cu_seqlens(l->cu_seqlens, l->num_cu_seqlens, "layout");
      DATTN_CHECK_ARG(l->global_seq == 0 || l->global_seq == cu.back(), "layout.global_seq",
                      l->global_seq, cat("0 or cu_seqlens[", cu.size() - 1, "] = ", cu.back()));
      return dattn::Layout::varlen(std::move(cu), ranks);
    }
  }
  DATTN_THROW("invalid layout.kind = ", c_enum(l->kind),
              ": expected DATTN_LAYOUT_CONTIGUOUS (0), ZIGZAG (1), STRIPED (2) or VARLEN (3)");
}

dattn::AttnSpec make_spec(const dattn_spec* s) {
  DATTN_CHECK_ARG(s != nullptr, "spec", "NULL", "a dattn_spec");
  dattn::AttnSpec spec{.heads_q = s->heads_q,
                       .heads_kv = s->heads_kv,
                       .head_dim = s->head_dim,
                       .head_dim_v = s->head_dim_v,
                       .softmax_scale = s->softmax_scale,
                       .softcap = s->softcap};
  switch (c_enum(s->mask)) {
    case DATTN_MASK_NONE:
      spec.mask = dattn::Mask::none();
      break;
    case DATTN_MASK_CAUSAL:
      spec.mask = dattn::Mask::causal();
      break;
    case DATTN_MASK_WINDOW:
      DATTN_CHECK_ARG(s->window_left >= 0, "spec.window_left", s->window_left, ">= 0");
      DATTN_CHECK_ARG(s->window_right >= 0, "spec.window_right", s->window_right, ">= 0");
      spec.mask = dattn::Mask::window(s->window_left, s->window_right);
      break;
    case DATTN_MASK_DOCUMENT:
      spec.mask = dattn::Mask::document(copy_cu_seqlens(s->cu_seqlens, s->num_cu_seqlens, "spec"),
                                        s->document_causal != 0);
      break;
    case DATTN_MASK_SLICES: {
      DATTN_CHECK_ARG(s->slices != nullptr || s->num_slices == 0, "spec.slices", "NULL",
                      "num_slices x 5 values (q_begin, q_end, k_begin, k_end, kind)");
      DATTN_CHECK_ARG(s->num_slices >= 0, "spec.num_slices", s->num_slices, ">= 0");
      std::vector<dattn::MaskSlice> slices;
      for (int64_t i = 0; i < s->num_slices; ++i) {
        const int64_t* e = s->slices + 5 * i;
        DATTN_CHECK_ARG(e[4] >= 0 && e[4] <= 3, cat("spec.slices[", i, "] kind"), e[4],
                        "0 full, 1 causal, 2 inverse causal or 3 bi-causal");
        slices.push_back({e[0], e[1], e[2], e[3], dattn::MaskSlice::Kind(e[4])});
      }
      spec.mask = dattn::Mask::from_slices(std::move(slices));
      break;
    }
    default:
      DATTN_THROW("invalid spec.mask = ", c_enum(s->mask),
                  ": expected DATTN_MASK_NONE (0), CAUSAL (1), WINDOW (2), DOCUMENT (3) or "
                  "SLICES (4)");
  }
  if (s->sinks)
    spec.sinks = dattn::make_sinks(
        std::vector<float>(s->sinks, s->sinks + std::max<int64_t>(s->heads_q, 0)));
  spec.validate();
  return spec;
}

// s: the caller's dattn_strategy as an int (c_enum).
dattn::Strategy make_strategy(int s) {
  switch (s) {
    case DATTN_STRATEGY_RING:
      return dattn::Strategy::ring;
    case DATTN_STRATEGY_ULYSSES:
      return dattn::Strategy::ulysses;
    case DATTN_STRATEGY_HYBRID:
      return dattn::Strategy::hybrid;
  }
  DATTN_THROW("invalid strategy = ", s,
              ": expected DATTN_STRATEGY_RING (0), ULYSSES (1) or HYBRID (2)");
}

// A view of the caller's input; the library never writes through it.
dattn::Tensor make_input(const dattn_tensor* t, const char* name) {
  DATTN_CHECK_ARG(t != nullptr, name, "NULL", "a dattn_tensor");
  dattn::DType dtype;
  switch (c_enum(t->dtype)) {
    case DATTN_FP32:
      dtype = dattn::DType::f32;
      break;
    case DATTN_BF16:
      dtype = dattn::DType::bf16;
      break;
    case DATTN_FP16:
      dtype = dattn::DType::f16;
      break;
    default:
      DATTN_THROW("invalid ", name, ".dtype = ", c_enum(t->dtype),
                  ": expected DATTN_FP32 (0), DATTN_BF16 (1) or DATTN_FP16 (2)");
  }
  int64_t numel = 1;
  for (int d = 0; d < 4; ++d) {
    DATTN_CHECK_ARG(t->shape[d] >= 0, cat(name, ".shape[", d, "]"), t->shape[d], ">= 0");
    numel *= t->shape[d];
  }
  DATTN_CHECK_ARG(t->data != nullptr || numel == 0, cat(name, ".data"), "NULL",
                  cat("a pointer to ", numel, " elements"));
  return dattn::Tensor::wrap(const_cast<void*>(t->data),
                             {t->shape[0], t->shape[1], t->shape[2], t->shape[3]}, dtype);
}

void check_output(const dattn_buffer& b, int64_t numel, const char* name, const char* shape) {
  DATTN_CHECK_ARG(b.numel == numel, cat(name, ".numel"), b.numel, cat(numel, " (", shape, ")"));
  DATTN_CHECK_ARG(b.data != nullptr || numel == 0, cat(name, ".data"), "NULL",
                  cat("a pointer to ", numel, " floats"));
}

void copy_out(const dattn::Tensor& t, const dattn_buffer& b) {
  DATTN_ASSERT(t.dtype() == dattn::DType::f32 && t.numel() == b.numel);
  if (b.numel > 0) std::memcpy(b.data, t.data(), size_t(b.numel) * sizeof(float));
}

// Everything a forward or backward call needs, converted and checked.
struct Call {
  dattn::Tensor q, k, v;
  dattn::AttnSpec spec;
  dattn::Layout layout;
  dattn::Strategy strategy = dattn::Strategy::ring;
  int64_t B = 0, S = 0;  // batch and this rank's sequence length (from q)
};

Call make_call(dattn::Runtime& rt, const dattn_tensor* q, const dattn_tensor* k,
               const dattn_tensor* v, const dattn_spec* spec, const dattn_layout* layout,
               int strategy) {
  Call c;
  c.q = make_input(q, "q");
  c.k = make_input(k, "k");
  c.v = make_input(v, "v");
  c.spec = make_spec(spec);
  c.layout = make_layout(layout, rt.cp_size());
  c.strategy = make_strategy(strategy);
  c.B = q->shape[0];
  c.S = q->shape[1];
  return c;
}

dattn::Runtime& runtime_of(dattn_runtime* runtime) {
  DATTN_CHECK_ARG(runtime != nullptr, "runtime", "NULL", "a runtime from dattn_runtime_create");
  return runtime->rt;
}

}  // namespace

// ---------------------------------------------------------------- status and errors

extern "C" const char* dattn_last_error(void) {
  return t_last_error.c_str();
}

extern "C" const char* dattn_status_name(dattn_status status) {
  const int s = c_enum(status);
  if (s == DATTN_OK) return "ok";
  for (const auto& [kind, st] : kStatusOfKind)
    if (st == s) return dattn::error_kind_name(kind);
  return "unknown status";
}

// ---------------------------------------------------------------- runtime

extern "C" dattn_status dattn_runtime_create(MPI_Comm comm, const dattn_runtime_options* options,
                                             dattn_runtime** runtime) {
  return guarded("dattn_runtime_create", [&] {
    DATTN_CHECK_ARG(runtime != nullptr, "runtime", "NULL", "a dattn_runtime* to write to");
    *runtime = nullptr;
    DATTN_CHECK_ARG(comm != MPI_COMM_NULL, "comm", "MPI_COMM_NULL", "a communicator");
    dattn::RuntimeOptions o;
    if (options != nullptr) {
      // 0 means the default; a negative value is passed on for from_mpi to reject (collectively).
      o.tp = options->tp == 0 ? 1 : options->tp;
      o.ulysses = options->ulysses == 0 ? 1 : options->ulysses;
      o.threads = options->threads;
      DATTN_CHECK_ARG(options->check_finite == 0 || options->check_finite == 1,
                      "options.check_finite", options->check_finite, "0 or 1");
      DATTN_CHECK_ARG(options->timeout_s >= 0, "options.timeout_s", options->timeout_s,
                      "seconds >= 0 (0: the default)");
      o.check_finite = options->check_finite == 1;
      o.timeout_s = options->timeout_s;
    }
    *runtime = new dattn_runtime{dattn::Runtime::from_mpi(comm, o)};
  });
}

extern "C" dattn_status dattn_runtime_destroy(dattn_runtime* runtime) {
  return guarded("dattn_runtime_destroy", [&] { delete runtime; });
}

extern "C" dattn_status dattn_runtime_cp(const dattn_runtime* runtime, int* cp_rank, int* cp_size) {
  return guarded("dattn_runtime_cp", [&] {
    DATTN_CHECK_ARG(runtime != nullptr, "runtime", "NULL", "a runtime from dattn_runtime_create");
    if (cp_rank != nullptr) *cp_rank = runtime->rt.cp_rank();
    if (cp_size != nullptr) *cp_size = runtime->rt.cp_size();
  });
}

// ---------------------------------------------------------------- layouts

extern "C" dattn_status dattn_layout_shard_len(const dattn_layout* layout, int ranks, int rank,
                                               int64_t* shard_len) {
  return guarded("dattn_layout_shard_len", [&] {
    DATTN_CHECK_ARG(shard_len != nullptr, "shard_len", "NULL", "an int64_t to write to");
    DATTN_CHECK_ARG(ranks >= 1, "ranks", ranks, ">= 1");
    DATTN_CHECK_ARG(rank >= 0 && rank < ranks, "rank", rank, cat("0 to ", ranks - 1));
    *shard_len = make_layout(layout, ranks).local_len(rank);
  });
}

extern "C" dattn_status dattn_layout_positions(const dattn_layout* layout, int ranks, int rank,
                                               int64_t* positions, int64_t count) {
  return guarded("dattn_layout_positions", [&] {
    DATTN_CHECK_ARG(ranks >= 1, "ranks", ranks, ">= 1");
    DATTN_CHECK_ARG(rank >= 0 && rank < ranks, "rank", rank, cat("0 to ", ranks - 1));
    const dattn::Layout l = make_layout(layout, ranks);
    const int64_t len = l.local_len(rank);
    DATTN_CHECK_ARG(count == len, "count", count,
                    cat(len, " (the shard length of rank ", rank, ")"));
    DATTN_CHECK_ARG(positions != nullptr || len == 0, "positions", "NULL",
                    cat("an array of ", len, " int64_t"));
    for (const dattn::Run& run : l.runs(rank))
      for (int64_t i = 0; i < run.length; ++i)
        positions[run.local_begin + i] = run.position(i);
  });
}

// ---------------------------------------------------------------- attention

extern "C" dattn_status dattn_attention_forward(dattn_runtime* runtime, const dattn_tensor* q,
                                                const dattn_tensor* k, const dattn_tensor* v,
                                                const dattn_spec* spec, const dattn_layout* layout,
                                                dattn_strategy strategy, dattn_buffer out,
                                                dattn_buffer lse) {
  return guarded("dattn_attention_forward", [&] {
    dattn::Runtime& rt = runtime_of(runtime);
    std::optional<Call> c;
    agree(rt, "dattn_attention_forward arguments", [&] {
      c = make_call(rt, q, k, v, spec, layout, c_enum(strategy));
      check_output(out, c->B * c->S * c->spec.heads_q * c->spec.dim_v(), "out",
                   "batch x seq x heads_q x head_dim_v");
      check_output(lse, c->B * c->spec.heads_q * c->S, "lse", "batch x heads_q x seq");
    });
    dattn::Partial r = dattn::attention(rt, c->q, c->k, c->v, c->spec, c->layout, c->strategy);
    copy_out(r.out, out);
    copy_out(r.lse, lse);
  });
}

extern "C" dattn_status dattn_attention_backward(
    dattn_runtime* runtime, const dattn_tensor* q, const dattn_tensor* k, const dattn_tensor* v,
    const float* out, const float* lse, const dattn_tensor* dout, const dattn_spec* spec,
    const dattn_layout* layout, dattn_strategy strategy, dattn_buffer dq, dattn_buffer dk,
    dattn_buffer dv, dattn_buffer dsinks) {
  return guarded("dattn_attention_backward", [&] {
    dattn::Runtime& rt = runtime_of(runtime);
    std::optional<Call> c;
    dattn::Partial fwd;
    dattn::Tensor dout_t;
    agree(rt, "dattn_attention_backward arguments", [&] {
      c = make_call(rt, q, k, v, spec, layout, c_enum(strategy));
      const int64_t B = c->B, S = c->S, H = c->spec.heads_q, Dv = c->spec.dim_v();
      DATTN_CHECK_ARG(out != nullptr || B * S * H * Dv == 0, "out", "NULL",
                      cat("the forward's out (", B * S * H * Dv, " floats)"));
      DATTN_CHECK_ARG(lse != nullptr || B * H * S == 0, "lse", "NULL",
                      cat("the forward's lse (", B * H * S, " floats)"));
      fwd.out = dattn::Tensor::wrap(const_cast<float*>(out), {B, S, H, Dv}, dattn::DType::f32);
      fwd.lse = dattn::Tensor::wrap(const_cast<float*>(lse), {B, H, S}, dattn::DType::f32);
      dout_t = make_input(dout, "dout");
      check_output(dq, c->q.numel(), "dq", "the size of q");
      check_output(dk, c->k.numel(), "dk", "the size of k");
      check_output(dv, c->v.numel(), "dv", "the size of v");
      if (c->spec.sinks)
        check_output(dsinks, c->spec.heads_q, "dsinks", "heads_q (one per sink)");
      else
        DATTN_CHECK_ARG(dsinks.data == nullptr && dsinks.numel == 0, "dsinks",
                        cat(dsinks.numel, " floats"), "{NULL, 0} without spec.sinks");
    });
    dattn::Gradients g = dattn::attention_backward(rt, c->q, c->k, c->v, fwd, dout_t, c->spec,
                                                   c->layout, c->strategy);
    copy_out(g.dq, dq);
    copy_out(g.dk, dk);
    copy_out(g.dv, dv);
    if (g.dsinks.defined()) copy_out(g.dsinks, dsinks);
  });
}
