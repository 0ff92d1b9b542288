// dattn._C, the pybind11 extension under the Python package python/dattn: MPI set-up and
// tear-down, one lazily created Runtime per process, attention forward/backward (distributed
// and single-process) on numpy arrays, layout positions and a few MPI helpers. The package's
// __init__.py turns torch tensors into these arrays and back and adds autograd.
#include <mpi.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <climits>
#include <iterator>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "collective/mpi_communicator.h"
#include "src/attention.h"
#include "src/base/error.h"
#include "src/validate.h"

namespace py = pybind11;
using dattn::detail::cat;

namespace {

// ---------------------------------------------------------------- MPI and the Runtime

bool mpi_active();

struct ModuleState {
  bool initialised_mpi = false;  // this module called MPI_Init_thread, so it finalises
  std::unique_ptr<dattn::Runtime> rt;
  int rt_ulysses = 0;

  // At process exit without finalize() (or after someone else finalised MPI), freeing the
  // Runtime's communicators would call MPI after MPI_Finalize: leave them to the exit instead.
  ~ModuleState() {
    if (!mpi_active()) (void)rt.release();
  }
};

ModuleState& state() {
  static ModuleState s;
  return s;
}

bool mpi_active() {
  int initialised = 0, finalised = 0;
  MPI_Initialized(&initialised);
  MPI_Finalized(&finalised);
  return initialised && !finalised;
}

// MPI with MPI_THREAD_FUNNELED (only the thread that imported dattn calls MPI; the GIL release
// around compute does not change threads), unless the program or mpi4py already set it up.
void init_mpi() {
  int initialised = 0;
  MPI_Initialized(&initialised);
  if (initialised) return;
  int provided = 0;
  DATTN_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided));
  state().initialised_mpi = true;
}

void require_mpi() {
  if (!mpi_active()) DATTN_THROW("MPI is finalised: dattn cannot be used after dattn.finalize()");
}

int world_rank() {
  require_mpi();
  int r = 0;
  DATTN_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &r));
  return r;
}

int world_size() {
  require_mpi();
  int n = 0;
  DATTN_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &n));
  return n;
}

// The process's Runtime over MPI_COMM_WORLD (cp = every rank), recreated when the Ulysses degree
// changes. Collective when it creates: every rank makes the same calls.
dattn::Runtime& runtime(int ulysses) {
  require_mpi();
  ModuleState& s = state();
  if (!s.rt || s.rt_ulysses != ulysses) {
    s.rt.reset();
    dattn::RuntimeOptions o;
    o.ulysses = ulysses;
    s.rt = std::make_unique<dattn::Runtime>(dattn::Runtime::from_mpi(MPI_COMM_WORLD, o));
    s.rt_ulysses = ulysses;
  }
  return *s.rt;
}

// Releases the Runtime and, when this module initialised MPI, finalises it. Registered with
// atexit by the package; safe to call twice.
void finalize() {
  ModuleState& s = state();
  if (mpi_active()) s.rt.reset();
  if (s.initialised_mpi && mpi_active()) MPI_Finalize();
}

// ---------------------------------------------------------------- buffers <-> tensors
//
// Arrays cross the boundary by Python's buffer protocol, not numpy's C API: the extension then
// does not depend on the numpy it was built against (numpy 2 changed the C structs that
// pybind11 < 2.12 reads), so one build serves Debian's numpy 1.24 and PyPI's numpy 2.x, and the
// package turns buffers into numpy arrays or torch tensors without copying.

// A result's storage (a tensor, or int64 values) seen through the buffer protocol: the package
// wraps it with np.asarray (no copy), which keeps this object, and so the storage, alive.
struct Buffer {
  std::shared_ptr<const void> owner;
  void* data = nullptr;
  std::string format;  // struct-module format: "f" float32, "q" int64
  py::ssize_t itemsize = 0;
  std::vector<py::ssize_t> shape;
};

Buffer to_buffer(dattn::Tensor t) {
  if (t.dtype() != dattn::DType::f32)
    DATTN_THROW_KIND(dattn::ErrorKind::internal, "internal error: a result is not fp32");
  Buffer b;
  for (int d = 0; d < t.dim(); ++d)
    b.shape.push_back(t.size(d));
  auto owner = std::make_shared<dattn::Tensor>(std::move(t));
  b.data = owner->data();
  b.owner = std::move(owner);
  b.format = py::format_descriptor<float>::format();
  b.itemsize = sizeof(float);
  return b;
}

Buffer to_buffer(std::vector<int64_t> v) {
  Buffer b;
  b.shape = {py::ssize_t(v.size())};
  auto owner = std::make_shared<std::vector<int64_t>>(std::move(v));
  b.data = owner->data();
  b.owner = std::move(owner);
  b.format = py::format_descriptor<int64_t>::format();
  b.itemsize = sizeof(int64_t);
  return b;
}

py::buffer_info buffer_info(Buffer& b) {
  std::vector<py::ssize_t> strides(b.shape.size());
  py::ssize_t stride = b.itemsize;
  for (size_t d = b.shape.size(); d-- > 0;) {
    strides[d] = stride;
    stride *= b.shape[d];
  }
  return py::buffer_info(b.data, b.itemsize, b.format, py::ssize_t(b.shape.size()), b.shape,
                         strides);
}

// The element type a buffer's struct-module format names ("f", "<f", "=e", ...), or 0.
char format_code(const std::string& format) {
  if (format.size() == 1) return format[0];
  if (format.size() == 2 && (format[0] == '<' || format[0] == '=' || format[0] == '@'))
    return format[1];
  return 0;
}

// Whether a buffer's elements are dense in C order (strides of dimensions of size 1 do not matter).
bool c_contiguous(const py::buffer_info& a) {
  py::ssize_t stride = a.itemsize;
  for (py::ssize_t i = a.ndim; i-- > 0;) {
    if (a.shape[size_t(i)] > 1 && a.strides[size_t(i)] != stride) return false;
    stride *= a.shape[size_t(i)];
  }
  return true;
}

// (buffer, dtype name) from the package: "fp32" (float32), "fp16" (float16) or "bf16" (the
// 16-bit patterns in a uint16/int16 buffer, as numpy has no bfloat16). A view, no copy: the
// package holds the object for the duration of the call.
dattn::Tensor as_tensor(const py::tuple& t, const char* name, int ndim = 4) {
  if (t.size() != 2)
    DATTN_THROW_KIND(dattn::ErrorKind::internal, "internal error: ", name,
                     " is not an (array, dtype) pair");
  const std::string dtype = t[1].cast<std::string>();
  if (dtype != "fp32" && dtype != "fp16" && dtype != "bf16")  // what the package could not take
    DATTN_THROW("invalid ", name, ": ", dtype, ": expected float32, float16 or bfloat16");
  const py::buffer_info a = t[0].cast<py::buffer>().request();
  const char code = format_code(a.format);
  dattn::DType d;
  if (dtype == "fp32" && code == 'f' && a.itemsize == 4) {
    d = dattn::DType::f32;
  } else if (dtype == "fp16" && code == 'e' && a.itemsize == 2) {
    d = dattn::DType::f16;
  } else if (dtype == "bf16" && (code == 'h' || code == 'H') && a.itemsize == 2) {
    d = dattn::DType::bf16;
  } else {
    DATTN_THROW("invalid ", name, " element format = '", a.format, "' (", dtype,
                "): expected float32, float16 or bfloat16");
  }
  DATTN_CHECK_ARG(a.ndim == ndim, cat(name, " ndim"), a.ndim,
                  ndim == 4 ? "4 dimensions [batch, seq, heads, head_dim]" : cat(ndim));
  DATTN_CHECK_ARG(c_contiguous(a), cat(name, " layout"), "not C-contiguous",
                  "a C-contiguous array");
  if (ndim == 3) return dattn::Tensor::wrap(a.ptr, {a.shape[0], a.shape[1], a.shape[2]}, d);
  return dattn::Tensor::wrap(a.ptr, {a.shape[0], a.shape[1], a.shape[2], a.shape[3]}, d);
}

// ---------------------------------------------------------------- options

// The attention options the package passes (already normalised there).
struct Options {
  bool causal = false;
  double softmax_scale = 0;  // 0: 1/sqrt(head_dim)
  int64_t window_left = -1;  // -1 both: no window
  int64_t window_right = -1;
  std::vector<int64_t> cu_seqlens;    // empty: one document
  std::string layout = "contiguous";  // contiguous, zigzag, striped, varlen
  std::string strategy = "ring";      // ring, ulysses, hybrid
  int ulysses_degree = 1;             // hybrid
  int64_t stripe_block = 1;           // striped
};

Options options_from(const py::dict& d) {
  Options o;
  for (auto [key, value] : d) {
    const std::string k = key.cast<std::string>();
    if (k == "causal")
      o.causal = value.cast<bool>();
    else if (k == "softmax_scale")
      o.softmax_scale = value.cast<double>();
    else if (k == "window_left")
      o.window_left = value.cast<int64_t>();
    else if (k == "window_right")
      o.window_right = value.cast<int64_t>();
    else if (k == "cu_seqlens")
      o.cu_seqlens = value.cast<std::vector<int64_t>>();
    else if (k == "layout")
      o.layout = value.cast<std::string>();
    else if (k == "strategy")
      o.strategy = value.cast<std::string>();
    else if (k == "ulysses_degree")
      o.ulysses_degree = value.cast<int>();
    else if (k == "stripe_block")
      o.stripe_block = value.cast<int64_t>();
    else
      DATTN_THROW_KIND(dattn::ErrorKind::internal, "internal error: unknown option '", k, "'");
  }
  return o;
}

dattn::AttnSpec make_spec(const Options& o, const dattn::Tensor& q, const dattn::Tensor& k,
                          const dattn::Tensor& v) {
  dattn::AttnSpec spec;
  spec.heads_q = q.size(2);
  spec.heads_kv = k.size(2);
  spec.head_dim = q.size(3);
  spec.head_dim_v = v.size(3);
  DATTN_CHECK_ARG(o.softmax_scale >= 0, "softmax_scale", o.softmax_scale, "> 0 (or None)");
  spec.softmax_scale = float(o.softmax_scale);
  if (!o.cu_seqlens.empty())
    spec.mask = dattn::Mask::document(o.cu_seqlens, o.causal);
  else
    spec.mask = o.causal ? dattn::Mask::causal() : dattn::Mask::none();
  if (o.window_left >= 0 || o.window_right >= 0) {
    spec.mask.left = o.window_left;
    spec.mask.right = o.window_right;
  }
  spec.validate();
  return spec;
}

dattn::Layout make_layout(const std::string& kind, int64_t global_seq, int ranks,
                          int64_t stripe_block, const std::vector<int64_t>& cu_seqlens) {
  if (kind == "contiguous") return dattn::Layout::contiguous(global_seq, ranks);
  if (kind == "zigzag") return dattn::Layout::zigzag(global_seq, ranks);
  if (kind == "striped") return dattn::Layout::striped(global_seq, ranks, stripe_block);
  if (kind == "varlen") {
    DATTN_CHECK_ARG(!cu_seqlens.empty(), "cu_seqlens", "None",
                    "document boundaries [0, e1, ..., S] for layout 'varlen'");
    DATTN_CHECK_ARG(global_seq < 0 || global_seq == cu_seqlens.back(), "global_seq", global_seq,
                    cat(cu_seqlens.back(), " (cu_seqlens[-1]) for layout 'varlen'"));
    return dattn::Layout::varlen(cu_seqlens, ranks);
  }
  DATTN_THROW("invalid layout = '", kind, "': expected contiguous, zigzag, striped or varlen");
}

// What one distributed call needs: the runtime, tensors, spec, layout and strategy.
struct Distributed {
  dattn::Runtime* rt = nullptr;
  dattn::Tensor q, k, v;
  dattn::AttnSpec spec;
  dattn::Layout layout;
  dattn::Strategy strategy = dattn::Strategy::ring;
};

uint64_t hash_string(uint64_t h, const std::string& s) {
  for (char c : s)
    h = dattn::hash_mix(h, uint64_t(uint8_t(c)));
  return h;
}

// Checks and converts a distributed call's arguments so that the ranks agree: a bad argument on
// one rank raises the same dattn.InvalidArgumentError on every rank instead of leaving the others
// waiting. The global sequence is the sum of the ranks' shard lengths (one small allreduce); the
// attention call's own check then says which rank holds the wrong number of tokens. The layout
// is then made from what every rank has agreed on (the options, in the hash, and that sum), so
// it succeeds or fails alike everywhere without another agreement. `more` converts the
// backward's extra arguments inside the same agreement.
template <typename More>
Distributed distributed(const Options& o, const py::tuple& q, const py::tuple& k,
                        const py::tuple& v, More&& more) {
  // The runtime the checks run over: the current one (ring and Ulysses do not depend on its
  // Ulysses degree), else a new one of degree 1. Every rank holds the same one.
  ModuleState& s = state();
  dattn::Runtime* rt = &runtime(s.rt ? s.rt_ulysses : 1);
  Distributed d;
  uint64_t h = hash_string(hash_string(dattn::kHashSeed, o.layout), o.strategy);
  h = dattn::hash_mix(h, uint64_t(o.ulysses_degree));
  h = dattn::hash_mix(h, uint64_t(o.stripe_block));
  for (int64_t c : o.cu_seqlens)
    h = dattn::hash_mix(h, uint64_t(c));
  dattn::agree_on_validation(rt->cp(), "dattn.attention arguments", h, [&] {
    d.q = as_tensor(q, "q");
    d.k = as_tensor(k, "k");
    d.v = as_tensor(v, "v");
    d.strategy =
        dattn::parse_strategy(o.strategy);  // prefill schedules only: ring, ulysses, hybrid
    DATTN_CHECK_ARG(o.ulysses_degree >= 1, "ulysses_degree", o.ulysses_degree, ">= 1");
    d.spec = make_spec(o, d.q, d.k, d.v);
    more();
  });
  uint64_t local = uint64_t(d.q.size(1)), global = 0;
  rt->cp().allreduce_u64(&local, &global, 1, dattn::ReduceOp::sum);
  d.layout = make_layout(o.layout, int64_t(global), rt->cp_size(), o.stripe_block, o.cu_seqlens);
  if (d.strategy == dattn::Strategy::hybrid) rt = &runtime(o.ulysses_degree);
  d.rt = rt;
  return d;
}

// ---------------------------------------------------------------- entry points

py::tuple attention_forward(const py::tuple& q, const py::tuple& k, const py::tuple& v,
                            const py::dict& options) {
  const Distributed d = distributed(options_from(options), q, k, v, [] {});
  dattn::Partial r;
  {
    py::gil_scoped_release release;
    r = dattn::attention(*d.rt, d.q, d.k, d.v, d.spec, d.layout, d.strategy);
  }
  return py::make_tuple(to_buffer(std::move(r.out)), to_buffer(std::move(r.lse)));
}

py::tuple attention_backward(const py::tuple& q, const py::tuple& k, const py::tuple& v,
                             const py::tuple& out, const py::tuple& lse, const py::tuple& dout,
                             const py::dict& options) {
  dattn::Partial fwd;
  dattn::Tensor tdout;
  const Distributed d = distributed(options_from(options), q, k, v, [&] {
    fwd.out = as_tensor(out, "out");
    fwd.lse = as_tensor(lse, "lse", 3);
    tdout = as_tensor(dout, "dout");
  });
  dattn::Gradients g;
  {
    py::gil_scoped_release release;
    g = dattn::attention_backward(*d.rt, d.q, d.k, d.v, fwd, tdout, d.spec, d.layout, d.strategy);
  }
  return py::make_tuple(to_buffer(std::move(g.dq)), to_buffer(std::move(g.dk)),
                        to_buffer(std::move(g.dv)));
}

py::tuple attention_local_forward(const py::tuple& q, const py::tuple& k, const py::tuple& v,
                                  const py::dict& options) {
  const Options o = options_from(options);
  dattn::Tensor tq = as_tensor(q, "q"), tk = as_tensor(k, "k"), tv = as_tensor(v, "v");
  const dattn::AttnSpec spec = make_spec(o, tq, tk, tv);
  dattn::Partial r;
  {
    py::gil_scoped_release release;
    r = dattn::attention_local(tq, tk, tv, spec);
  }
  return py::make_tuple(to_buffer(std::move(r.out)), to_buffer(std::move(r.lse)));
}

py::tuple attention_local_backward(const py::tuple& q, const py::tuple& k, const py::tuple& v,
                                   const py::tuple& out, const py::tuple& lse,
                                   const py::tuple& dout, const py::dict& options) {
  const Options o = options_from(options);
  dattn::Tensor tq = as_tensor(q, "q"), tk = as_tensor(k, "k"), tv = as_tensor(v, "v");
  dattn::Partial fwd{as_tensor(out, "out"), as_tensor(lse, "lse", 3)};
  dattn::Tensor tdout = as_tensor(dout, "dout");
  const dattn::AttnSpec spec = make_spec(o, tq, tk, tv);
  dattn::Gradients g;
  {
    py::gil_scoped_release release;
    g = dattn::attention_local_backward(tq, tk, tv, fwd, tdout, spec);
  }
  return py::make_tuple(to_buffer(std::move(g.dq)), to_buffer(std::move(g.dk)),
                        to_buffer(std::move(g.dv)));
}

// The C++ side of the binding-overhead benchmark (examples/python/binding_overhead.py): seconds per
// call of the library's forward on these arguments, converted once and called `iters` times in a
// loop with no Python in it (distributed: dattn::attention through the module's Runtime; local:
// dattn::attention_local). The benchmark subtracts it from the per-call time of dattn.attention.
double time_forward(const py::tuple& q, const py::tuple& k, const py::tuple& v,
                    const py::dict& options, int iters, bool local) {
  DATTN_CHECK_ARG(iters >= 1, "iters", iters, ">= 1");
  const Options o = options_from(options);
  Distributed d;
  if (local) {
    d.q = as_tensor(q, "q");
    d.k = as_tensor(k, "k");
    d.v = as_tensor(v, "v");
    d.spec = make_spec(o, d.q, d.k, d.v);
  } else {
    d = distributed(o, q, k, v, [] {});
  }
  py::gil_scoped_release release;
  const double start = MPI_Wtime();
  for (int i = 0; i < iters; ++i) {
    if (local)
      (void)dattn::attention_local(d.q, d.k, d.v, d.spec);
    else
      (void)dattn::attention(*d.rt, d.q, d.k, d.v, d.spec, d.layout, d.strategy);
  }
  return (MPI_Wtime() - start) / iters;
}

Buffer layout_positions(const std::string& kind, int64_t global_seq, int rank, int world,
                        int64_t stripe_block, const std::vector<int64_t>& cu_seqlens) {
  DATTN_CHECK_ARG(world >= 1, "world", world, ">= 1");
  DATTN_CHECK_ARG(rank >= 0 && rank < world, "rank", rank, cat("0 to ", world - 1));
  const dattn::Layout l = make_layout(kind, global_seq, world, stripe_block, cu_seqlens);
  std::vector<int64_t> pos(size_t(l.local_len(rank)));
  for (const dattn::Run& run : l.runs(rank))
    for (int64_t i = 0; i < run.length; ++i)
      pos[size_t(run.local_begin + i)] = run.position(i);
  return to_buffer(std::move(pos));
}

// Sums a C-contiguous float64 buffer over every rank, in place.
void allreduce_sum(const py::buffer& buffer) {
  require_mpi();
  const py::buffer_info a = buffer.request(true);
  if (format_code(a.format) != 'd' || a.itemsize != 8 || !c_contiguous(a))
    DATTN_THROW_KIND(dattn::ErrorKind::internal,
                     "internal error: allreduce_sum takes a C-contiguous float64 array");
  DATTN_CHECK_ARG(a.size <= INT_MAX, "allreduce_sum size", a.size, cat("<= ", INT_MAX));
  py::gil_scoped_release release;
  DATTN_MPI_CHECK(
      MPI_Allreduce(MPI_IN_PLACE, a.ptr, int(a.size), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
}

// ---------------------------------------------------------------- exceptions

// The Python class of each dattn::ErrorKind, made by add_error_classes; held for the process.
PyObject* g_error_class[dattn::kErrorKinds] = {};

// dattn.Error, the base of every error the library raises, and one subclass per ErrorKind that
// also derives from the builtin exception a Python caller expects (`except ValueError` catches a
// bad argument, `except MemoryError` an allocation that failed); each class's `kind` is the
// kind's name ("invalid argument", "out of memory", ...).
void add_error_classes(py::module_& m) {
  PyObject* base = PyErr_NewExceptionWithDoc(
      "dattn.Error", "An error from dattn; e.kind names its kind, str(e) says what and where.",
      PyExc_Exception, nullptr);
  if (base == nullptr) throw py::error_already_set();
  m.attr("Error") = py::reinterpret_steal<py::object>(base);
  const struct {
    dattn::ErrorKind kind;
    const char* name;
    PyObject* builtin;
  } classes[] = {
      {dattn::ErrorKind::invalid_argument, "InvalidArgumentError", PyExc_ValueError},
      {dattn::ErrorKind::mpi, "MPIError", PyExc_RuntimeError},
      {dattn::ErrorKind::cuda, "CUDAError", PyExc_RuntimeError},
      {dattn::ErrorKind::nccl, "NCCLError", PyExc_RuntimeError},
      {dattn::ErrorKind::out_of_memory, "OutOfMemoryError", PyExc_MemoryError},
      {dattn::ErrorKind::timeout, "TimeoutError", PyExc_TimeoutError},
      {dattn::ErrorKind::internal, "InternalError", PyExc_RuntimeError},
  };
  static_assert(std::size(classes) == dattn::kErrorKinds, "a class for every kind");
  for (const auto& c : classes) {
    const py::tuple bases = py::make_tuple(m.attr("Error"), py::handle(c.builtin));
    py::dict attrs;
    attrs["kind"] = dattn::error_kind_name(c.kind);
    PyObject* cls = PyErr_NewException(cat("dattn.", c.name).c_str(), bases.ptr(), attrs.ptr());
    if (cls == nullptr) throw py::error_already_set();
    g_error_class[int(c.kind)] = cls;
    m.attr(c.name) = py::handle(cls);
  }
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "dattn's compiled core; use the dattn package, not this module.";
  py::class_<Buffer>(m, "Buffer", py::buffer_protocol(),
                     "A result's storage; np.asarray(b) views it without a copy.")
      .def_buffer(&buffer_info);
  add_error_classes(m);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const dattn::Error& e) {
      PyErr_SetString(g_error_class[int(e.kind())], e.what());
    } catch (const std::bad_alloc&) {
      PyErr_SetString(g_error_class[int(dattn::ErrorKind::out_of_memory)], "out of memory");
    }
  });
  init_mpi();
  dattn::set_error_rank(world_rank());

  m.def("finalize", &finalize, "Releases the Runtime and finalises MPI if dattn initialised it.");
  m.def("rank", &world_rank, "This process's rank in MPI_COMM_WORLD.");
  m.def("world_size", &world_size, "The number of ranks in MPI_COMM_WORLD.");
  m.def(
      "barrier",
      [] {
        require_mpi();
        py::gil_scoped_release release;
        DATTN_MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
      },
      "Waits for every rank.");
  m.def(
      "abort",
      [](int code) {
        if (mpi_active()) MPI_Abort(MPI_COMM_WORLD, code);
        std::exit(code);
      },
      py::arg("code") = 1, "Aborts every rank of the job with the exit code (MPI_Abort).");
  m.def("attention_forward", &attention_forward);
  m.def("attention_backward", &attention_backward);
  m.def("attention_local_forward", &attention_local_forward);
  m.def("attention_local_backward", &attention_local_backward);
  m.def("layout_positions", &layout_positions);
  m.def("time_forward", &time_forward);
  m.def("allreduce_sum", &allreduce_sum);
}
