// dattn._C, the pybind11 extension under the Python package python/dattn: MPI set-up and
// tear-down, Runtimes (the module's default one over MPI_COMM_WORLD, and those made over any
// communicator), attention forward/backward (distributed and single-process), the sharded KV
// cache and decode, star attention, MLA/TPLA decode, layout positions and a few MPI helpers, on
// arrays that cross by the buffer protocol (host memory) or by __cuda_array_interface__ (GPU
// memory, DeviceArray). The package's __init__.py turns numpy arrays and torch tensors (CPU and
// CUDA) into those and back and adds autograd.
#include <mpi.h>
#include <omp.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <climits>
#include <iterator>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "collective/mpi_communicator.h"
#include "src/attention.h"
#include "src/base/error.h"
#include "src/base/stream.h"
#include "src/decode.h"
#include "src/mla.h"
#include "src/star.h"
#include "src/validate.h"

namespace py = pybind11;
using dattn::detail::cat;

namespace {

// ---------------------------------------------------------------- MPI and the Runtimes

bool mpi_active() {
  int initialised = 0, finalised = 0;
  MPI_Initialized(&initialised);
  MPI_Finalized(&finalised);
  return initialised && !finalised;
}

// A Runtime as the package holds it: dattn.Runtime objects, the caches made over it and the
// module's default runtime share one. finalize() releases every live one before MPI_Finalize
// (rt becomes null, and a later call says so). One still alive when MPI is gone (at process exit)
// is left to the exit: freeing its communicators would call MPI after MPI_Finalize.
struct RuntimeHandle {
  std::unique_ptr<dattn::Runtime> rt;
  ~RuntimeHandle() {
    if (!mpi_active()) (void)rt.release();
  }
};

struct ModuleState {
  bool initialised_mpi = false;               // this module called MPI_Init_thread, so it finalises
  std::shared_ptr<RuntimeHandle> default_rt;  // over MPI_COMM_WORLD, made on first use
  std::vector<std::weak_ptr<RuntimeHandle>> handles;  // every handle made, for finalize()
};

ModuleState& state() {
  static ModuleState s;
  return s;
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

std::shared_ptr<RuntimeHandle> new_handle(dattn::Runtime rt) {
  auto h = std::make_shared<RuntimeHandle>();
  h->rt = std::make_unique<dattn::Runtime>(std::move(rt));
  auto& live = state().handles;
  std::erase_if(live, [](const std::weak_ptr<RuntimeHandle>& w) { return w.expired(); });
  live.push_back(h);
  return h;
}

// The handle's Runtime for properties (no call runs on it).
dattn::Runtime& get(RuntimeHandle& h) {
  require_mpi();
  if (!h.rt) DATTN_THROW("this dattn.Runtime was released by dattn.finalize()");
  return *h.rt;
}

// The handle's Runtime for a call. Its thread count is set again first: OpenMP's is one per
// process, which the last Runtime made (or used) sets, so each call restores its own.
dattn::Runtime& use(RuntimeHandle& h) {
  dattn::Runtime& rt = get(h);
  omp_set_num_threads(rt.threads());
  return rt;
}

// The module's default runtime over MPI_COMM_WORLD (cp = every rank, Ulysses degree 1 until a
// hybrid call asks for another). Collective when it creates: every rank makes the same calls.
std::shared_ptr<RuntimeHandle> default_handle() {
  ModuleState& s = state();
  if (!s.default_rt) {
    require_mpi();
    s.default_rt = new_handle(dattn::Runtime::from_mpi(MPI_COMM_WORLD, {}));
  }
  return s.default_rt;
}

// The default runtime with Ulysses degree `ulysses`, recreated (collectively) when its degree
// differs; holders of the default handle see the new one. A degree that Runtime::from_mpi
// refuses leaves the old one in place.
dattn::Runtime& default_runtime(int ulysses) {
  std::shared_ptr<RuntimeHandle> h = default_handle();
  if (get(*h).ulysses_degree() != ulysses) {
    dattn::RuntimeOptions o;
    o.ulysses = ulysses;
    auto fresh = std::make_unique<dattn::Runtime>(dattn::Runtime::from_mpi(MPI_COMM_WORLD, o));
    h->rt = std::move(fresh);
  }
  return use(*h);
}

// `runtime=` of a call: a dattn.Runtime's handle, or None for the default one.
std::shared_ptr<RuntimeHandle> handle_of(const py::object& runtime) {
  if (runtime.is_none()) return default_handle();
  return runtime.cast<std::shared_ptr<RuntimeHandle>>();
}

// Releases every Runtime and, when this module initialised MPI, finalises it. Registered with
// atexit by the package; safe to call twice.
void finalize() {
  ModuleState& s = state();
  if (mpi_active())
    for (const auto& w : s.handles)
      if (auto h = w.lock()) h->rt.reset();
  if (s.initialised_mpi && mpi_active()) MPI_Finalize();
}

// ---------------------------------------------------------------- Python values

// Option values taken as Python objects and converted here, so that a bad one raises inside an
// agreed validation (every rank raises) with the parameter's name.
std::string repr_of(const py::handle& value) {
  return py::repr(value).cast<std::string>();
}

int64_t int_value(const py::handle& value, const char* name) {
  PyObject* index = PyNumber_Index(value.ptr());  // int, numpy integers; not float or str
  if (index == nullptr) {
    PyErr_Clear();
    DATTN_THROW("invalid ", name, " = ", repr_of(value), ": expected an integer");
  }
  const long long v = PyLong_AsLongLong(index);
  Py_DECREF(index);
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    DATTN_THROW("invalid ", name, " = ", repr_of(value), ": expected an integer within int64");
  }
  return int64_t(v);
}

// An integer for a configuration hash, before the agreed validation converts it: -1 for
// anything that is not one (that validation then names it).
int64_t hash_int(const py::handle& value) {
  try {
    return int_value(value, "");
  } catch (const dattn::Error&) {
    return -1;
  }
}

int int_option(const py::handle& value, const char* name) {
  const int64_t v = int_value(value, name);
  DATTN_CHECK_ARG(v >= INT_MIN && v <= INT_MAX, name, v, "a value within int");
  return int(v);
}

double float_option(const py::handle& value, const char* name) {
  const double v = PyFloat_AsDouble(value.ptr());  // float, int, numpy scalars
  if (v == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    DATTN_THROW("invalid ", name, " = ", repr_of(value), ": expected a number");
  }
  return v;
}

bool bool_option(const py::handle& value, const char* name) {
  if (PyBool_Check(value.ptr())) return value.ptr() == Py_True;
  const int64_t v = hash_int(value);  // 0 and 1 (and numpy's booleans) too
  DATTN_CHECK_ARG(v == 0 || v == 1, name, repr_of(value), "True or False");
  return v == 1;
}

// The communicator behind `comm=`: an MPI_Comm read at the address mpi4py gives
// (MPI._addressof), or MPI_COMM_WORLD for None. Local: a null handle means this rank is not in
// the group, so there is nobody to agree with.
MPI_Comm communicator(const py::object& comm_address) {
  if (comm_address.is_none()) return MPI_COMM_WORLD;
  const auto address = comm_address.cast<uintptr_t>();
  DATTN_CHECK_ARG(address != 0, "comm", "a null address", "an mpi4py.MPI.Comm");
  const MPI_Comm comm = *reinterpret_cast<const MPI_Comm*>(address);
  DATTN_CHECK_ARG(comm != MPI_COMM_NULL, "comm", "MPI.COMM_NULL (a null or freed communicator)",
                  "a valid intracommunicator");
  int inter = 0;
  DATTN_MPI_CHECK(MPI_Comm_test_inter(comm, &inter));
  DATTN_CHECK_ARG(!inter, "comm", "an intercommunicator", "an intracommunicator");
  return comm;
}

// This rank's index among the ranks of comm on its node: its GPU under device "cuda" (one GPU per
// rank, as mpirun and srun place them). Collective over comm.
int node_local_rank(MPI_Comm comm) {
  MPI_Comm node;
  DATTN_MPI_CHECK(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  int r = 0;
  MPI_Comm_rank(node, &r);
  MPI_Comm_free(&node);
  return r;
}

// device= of dattn.Runtime, as the package normalises it: "cpu", "cuda" (GPU node_local_rank) or
// "cuda:N".
dattn::Device parse_device(const std::string& name, int local_rank) {
  if (name == "cpu") return dattn::Device::cpu();
  if (name == "cuda") return dattn::Device::cuda(local_rank);
  if (name.rfind("cuda:", 0) == 0 && name.size() > 5 && name.size() < 10 &&
      name.find_first_not_of("0123456789", 5) == std::string::npos)
    return dattn::Device::cuda(std::stoi(name.substr(5)));
  DATTN_THROW("invalid device = '", name,
              "': expected 'cpu', 'cuda' (the GPU of this rank's index on its node) or 'cuda:N'");
}

// A CUDA stream given from Python (an integer handle, as torch.cuda.Stream.cuda_stream and
// __cuda_array_interface__'s "stream" carry it): 0 and 1 are the legacy default stream (torch's
// default stream is 0, the interface's is 1), 2 the per-thread default stream, anything else a
// cudaStream_t.
dattn::StreamHandle stream_handle(const py::handle& stream, const char* name) {
  const int64_t v = int_value(stream, name);
  DATTN_CHECK_ARG(v >= 0, name, v, "a CUDA stream handle (an integer >= 0) or None");
  return v <= 1 ? nullptr : reinterpret_cast<dattn::StreamHandle>(uintptr_t(v));
}

// A Runtime over `comm` with the options of dattn.Runtime. Collective over comm. The options are
// converted inside an agreement over comm (one more small allreduce on a duplicate), then
// Runtime::from_mpi checks their values (tp dividing the ranks, ulysses dividing cp, threads
// >= 0, timeout_s >= 0, the device there), on every rank, naming the option.
std::shared_ptr<RuntimeHandle> make_runtime(const py::object& comm_address, const py::object& tp,
                                            const py::object& ulysses, const py::object& threads,
                                            const py::object& check_finite,
                                            const py::object& timeout_s, const py::object& device,
                                            const py::object& stream) {
  require_mpi();
  const MPI_Comm comm = communicator(comm_address);
  const int local_rank = node_local_rank(comm);  // on every rank, whatever its device says
  dattn::RuntimeOptions o;
  {
    dattn::MpiCommunicator group(comm);
    dattn::agree_on_validation(group, "dattn.Runtime options", dattn::kHashSeed, [&] {
      o.tp = int_option(tp, "tp");
      o.ulysses = int_option(ulysses, "ulysses");
      o.threads = threads.is_none() ? 0 : int_option(threads, "threads");
      o.check_finite = bool_option(check_finite, "check_finite");
      o.timeout_s = timeout_s.is_none() ? 0.0 : float_option(timeout_s, "timeout_s");
      DATTN_CHECK_ARG(timeout_s.is_none() || o.timeout_s > 0, "timeout_s", repr_of(timeout_s),
                      "> 0 seconds (or None: DATTN_TIMEOUT, else 300)");
      o.device = parse_device(device.cast<std::string>(), local_rank);
      if (!stream.is_none()) o.stream = stream_handle(stream, "stream");
    });
  }
  return new_handle(dattn::Runtime::from_mpi(comm, o));
}

std::string mpi_library_version() {
  char version[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  DATTN_MPI_CHECK(MPI_Get_library_version(version, &len));
  return std::string(version, size_t(len));
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

// A host tensor of any dtype: float32 "f", float16 "e", bfloat16 as its patterns, uint16 "H".
Buffer host_buffer(dattn::Tensor t) {
  Buffer b;
  for (int d = 0; d < t.dim(); ++d)
    b.shape.push_back(t.size(d));
  b.format = t.dtype() == dattn::DType::f32 ? "f" : t.dtype() == dattn::DType::f16 ? "e" : "H";
  b.itemsize = py::ssize_t(dattn::dtype_size(t.dtype()));
  auto owner = std::make_shared<dattn::Tensor>(std::move(t));
  b.data = owner->data();
  b.owner = std::move(owner);
  return b;
}

// A result in host memory (results are fp32).
Buffer to_buffer(dattn::Tensor t) {
  if (t.dtype() != dattn::DType::f32)
    DATTN_THROW_KIND(dattn::ErrorKind::internal, "internal error: a result is not fp32");
  return host_buffer(std::move(t));
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

// A tensor in GPU memory (a result of a GPU Runtime's call, or dattn.to_device's copy) seen through
// __cuda_array_interface__ (version 3): torch.as_tensor(a, device="cuda"), CuPy or Numba view it
// without a copy and keep this object, and so the tensor, alive. `stream` is the stream the
// data was written on and is freed on (null: the legacy default stream); a consumer on another
// stream waits for it first, and makes it wait before it drops its last reference.
struct DeviceArray {
  std::shared_ptr<const dattn::Tensor> tensor;
  dattn::StreamHandle stream = nullptr;
};

// The interface's typestr of each dtype; bfloat16 (which it has no code for) as its 16-bit
// patterns, '<u2', as the package passes torch's bfloat16 tensors in.
const char* typestr(dattn::DType d) {
  return d == dattn::DType::f32 ? "<f4" : d == dattn::DType::f16 ? "<f2" : "<u2";
}

py::tuple shape_of(const dattn::Tensor& t) {
  py::tuple shape(size_t(t.dim()));
  for (int d = 0; d < t.dim(); ++d)
    shape[size_t(d)] = t.size(d);
  return shape;
}

py::dict cuda_array_interface(const DeviceArray& a) {
  py::dict d;
  d["shape"] = shape_of(*a.tensor);
  d["typestr"] = typestr(a.tensor->dtype());
  d["data"] = py::make_tuple(reinterpret_cast<uintptr_t>(a.tensor->data()), false);
  d["strides"] = py::none();  // C order
  d["version"] = 3;
  d["stream"] = a.stream == nullptr ? uintptr_t(1) : reinterpret_cast<uintptr_t>(a.stream);
  return d;
}

// A call's result as Python sees it: a Buffer in host memory, a DeviceArray in GPU memory
// (`stream`: the call's).
py::object result(dattn::Tensor t, dattn::StreamHandle stream) {
  if (t.device().is_cpu()) return py::cast(to_buffer(std::move(t)));
  if (t.dtype() != dattn::DType::f32)
    DATTN_THROW_KIND(dattn::ErrorKind::internal, "internal error: a result is not fp32");
  return py::cast(DeviceArray{std::make_shared<const dattn::Tensor>(std::move(t)), stream});
}

// A host copy of a device array, ordered after the work of its stream (the copy waits for it).
Buffer to_host(const DeviceArray& a) {
  dattn::StreamScope on_stream(a.stream);
  dattn::Tensor host;
  {
    py::gil_scoped_release release;
    host = a.tensor->to_device(dattn::Device::cpu());
  }
  return host_buffer(std::move(host));
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

// Whether an interface's strides (bytes; None: C order) are C order's (dimensions of size 1 do
// not matter).
bool c_contiguous(const std::vector<int64_t>& shape, const py::object& strides, int64_t itemsize) {
  if (strides.is_none()) return true;
  const auto st = strides.cast<std::vector<int64_t>>();
  if (st.size() != shape.size()) return false;
  int64_t stride = itemsize;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] > 1 && st[i] != stride) return false;
    stride *= shape[i];
  }
  return true;
}

// The dattn dtype of the package's dtype name for an array whose elements are `code` of
// `itemsize` bytes ('f' 4: fp32, 'e' or 'f' 2: fp16, 'h'/'H' or 'i'/'u' 2: bf16's patterns), or
// the error naming what it is.
dattn::DType element_dtype(const std::string& dtype, char code, int64_t itemsize, const char* name,
                           const std::string& format) {
  if (dtype == "fp32" && code == 'f' && itemsize == 4) return dattn::DType::f32;
  if (dtype == "fp16" && (code == 'e' || code == 'f') && itemsize == 2) return dattn::DType::f16;
  if (dtype == "bf16" && (code == 'h' || code == 'H' || code == 'i' || code == 'u') &&
      itemsize == 2)
    return dattn::DType::bf16;
  DATTN_THROW("invalid ", name, " element format = '", format, "' (", dtype,
              "): expected float32, float16 or bfloat16");
}

dattn::Tensor wrap(void* data, const std::vector<int64_t>& n, dattn::DType d, dattn::Device dev) {
  if (n.size() == 1) return dattn::Tensor::wrap(data, {n[0]}, d, dev);
  if (n.size() == 2) return dattn::Tensor::wrap(data, {n[0], n[1]}, d, dev);
  if (n.size() == 3) return dattn::Tensor::wrap(data, {n[0], n[1], n[2]}, d, dev);
  return dattn::Tensor::wrap(data, {n[0], n[1], n[2], n[3]}, d, dev);
}

// (array, dtype name) from the package: "fp32" (float32), "fp16" (float16) or "bf16" (the
// 16-bit patterns in a uint16/int16 array, as numpy has no bfloat16); anything else is the
// package's description of what it could not take ("dtype float64: expected ..."). The array is
// host memory through the buffer protocol, or GPU memory through __cuda_array_interface__
// (version >= 2, no mask: a torch CUDA tensor's view from the package, a dattn.DeviceArray,
// CuPy), whose pointer must be memory of a GPU (pointer_device; `empty_device` for an empty
// array's null one). A view, no copy: the package holds the object for the duration of the
// call. `dims` describes the ndim dimensions for the message ("[batch, seq, heads, head_dim]");
// ndim -1: any of 1 to 4.
dattn::Tensor as_tensor(const py::tuple& t, const char* name, int ndim, const char* dims,
                        dattn::Device empty_device = dattn::Device::cpu()) {
  if (t.size() != 2)
    DATTN_THROW_KIND(dattn::ErrorKind::internal, "internal error: ", name,
                     " is not an (array, dtype) pair");
  const std::string dtype = t[1].cast<std::string>();
  if (dtype != "fp32" && dtype != "fp16" && dtype != "bf16")  // what the package could not take
    DATTN_THROW("invalid ", name, ": ", dtype);
  std::vector<int64_t> shape;
  void* data = nullptr;
  dattn::DType d;
  dattn::Device device;
  bool dense = true;
  // Host memory first: a buffer is never asked for the interface (a failed attribute lookup
  // costs about a microsecond an array, at every call).
  const bool buffer = PyObject_CheckBuffer(t[0].ptr()) != 0;
  const py::object cai =
      buffer ? py::none() : py::getattr(t[0], "__cuda_array_interface__", py::none());
  if (!cai.is_none()) {
    const py::dict i = cai.cast<py::dict>();
    const std::string ts = i["typestr"].cast<std::string>();
    DATTN_CHECK_ARG(ts.size() == 3 && (ts[0] == '<' || ts[0] == '|'),
                    cat(name, " __cuda_array_interface__ typestr"), ts,
                    "'<f4', '<f2' or '<u2' (bfloat16's patterns)");
    d = element_dtype(dtype, ts[1], ts[2] - '0', name, ts);
    DATTN_CHECK_ARG(!i.contains("mask") || i["mask"].is_none(), cat(name, " mask"),
                    repr_of(i["mask"]), "None (dattn takes no masked arrays)");
    shape = i["shape"].cast<std::vector<int64_t>>();
    data = reinterpret_cast<void*>(i["data"].cast<py::tuple>()[0].cast<uintptr_t>());
    dense = c_contiguous(shape, i.contains("strides") ? py::object(i["strides"]) : py::none(),
                         int64_t(dattn::dtype_size(d)));
    device = data == nullptr ? empty_device : dattn::pointer_device(data);
    DATTN_CHECK_ARG(!device.is_cpu(), cat(name, " data"), repr_of(i["data"]),
                    "GPU memory (its __cuda_array_interface__ names memory no CUDA device holds)");
  } else {
    const py::buffer_info a = t[0].cast<py::buffer>().request();
    d = element_dtype(dtype, format_code(a.format), a.itemsize, name, a.format);
    shape.assign(a.shape.begin(), a.shape.end());
    data = a.ptr;
    dense = c_contiguous(a);
  }
  const int n = int(shape.size());
  if (ndim < 0)
    DATTN_CHECK_ARG(n >= 1 && n <= 4, cat(name, " ndim"), n, "1 to 4 dimensions");
  else
    DATTN_CHECK_ARG(n == ndim, cat(name, " ndim"), n, cat(ndim, " dimensions ", dims));
  DATTN_CHECK_ARG(dense, cat(name, " layout"), "not C-contiguous",
                  "a C-contiguous array (np.ascontiguousarray(x) or x.contiguous())");
  return wrap(data, shape, d, device);
}

dattn::Tensor as_bshd(const py::tuple& t, const char* name,
                      dattn::Device empty_device = dattn::Device::cpu()) {
  return as_tensor(t, name, 4, "[batch, seq, heads, head_dim]", empty_device);
}

// Dimension d of an (array, dtype) pair's array without raising (-1 where there is none): what
// goes into a configuration hash before the agreed validation has converted the array.
int64_t raw_dim(const py::tuple& t, size_t d) {
  if (t.size() != 2) return -1;
  const py::object shape = py::getattr(t[0], "shape", py::none());
  if (!py::isinstance<py::tuple>(shape)) return -1;
  const auto s = shape.cast<py::tuple>();
  return d < s.size() ? s[d].cast<int64_t>() : -1;
}

// ---------------------------------------------------------------- options

// The attention options the package passes (already normalised there).
struct Options {
  bool causal = false;
  double softmax_scale = 0;  // 0: 1/sqrt(head_dim)
  int64_t window_left = -1;  // -1 both: no window
  int64_t window_right = -1;
  std::vector<int64_t> cu_seqlens;          // empty: one document
  std::string layout = "contiguous";        // contiguous, zigzag, striped, varlen, blocks
  std::string strategy = "ring";            // ring, ulysses, hybrid
  int ulysses_degree = 0;                   // hybrid; 0: not given (a dattn.Runtime's own degree)
  int64_t stripe_block = 1;                 // striped
  int64_t block = 0;                        // blocks: tokens per block
  std::optional<std::vector<float>> sinks;  // attention sinks, one per query head
  double softcap = 0;                       // logit softcap; 0: off
  // A slice mask: (q_begin, q_end, k_begin, k_end, kind) each, kind a MaskSlice::Kind.
  std::optional<std::vector<std::vector<int64_t>>> slices;
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
    else if (k == "block")
      o.block = value.cast<int64_t>();
    else if (k == "sinks")
      o.sinks = value.cast<std::vector<float>>();
    else if (k == "softcap")
      o.softcap = value.cast<double>();
    else if (k == "slices")
      o.slices = value.cast<std::vector<std::vector<int64_t>>>();
    else
      DATTN_THROW_KIND(dattn::ErrorKind::internal, "internal error: unknown option '", k, "'");
  }
  return o;
}

dattn::Mask make_mask(const Options& o) {
  if (o.slices) {
    DATTN_CHECK_ARG(!o.causal && o.window_left < 0 && o.window_right < 0 && o.cu_seqlens.empty(),
                    "slices", cat(o.slices->size(), " slices"),
                    "slices alone (no causal, window or cu_seqlens: slices express them)");
    std::vector<dattn::MaskSlice> slices;
    for (const std::vector<int64_t>& e : *o.slices) {
      DATTN_ASSERT(e.size() == 5);  // the package passes 5 integers each
      slices.push_back({e[0], e[1], e[2], e[3], dattn::MaskSlice::Kind(uint8_t(e[4]))});
    }
    return dattn::Mask::from_slices(std::move(slices));
  }
  dattn::Mask mask;
  if (!o.cu_seqlens.empty())
    mask = dattn::Mask::document(o.cu_seqlens, o.causal);
  else
    mask = o.causal ? dattn::Mask::causal() : dattn::Mask::none();
  if (o.window_left >= 0 || o.window_right >= 0) {
    mask.left = o.window_left;
    mask.right = o.window_right;
  }
  return mask;
}

dattn::AttnSpec make_spec(const Options& o, int64_t heads_q, int64_t heads_kv, int64_t head_dim,
                          int64_t head_dim_v) {
  dattn::AttnSpec spec;
  spec.heads_q = heads_q;
  spec.heads_kv = heads_kv;
  spec.head_dim = head_dim;
  spec.head_dim_v = head_dim_v;
  DATTN_CHECK_ARG(o.softmax_scale >= 0, "softmax_scale", o.softmax_scale, "> 0 (or None)");
  spec.softmax_scale = float(o.softmax_scale);
  spec.mask = make_mask(o);
  if (o.sinks) spec.sinks = dattn::make_sinks(*o.sinks);
  spec.softcap = float(o.softcap);
  spec.validate();
  return spec;
}

// dq, dk, dv, and dsinks after them when the spec has sinks.
// On a GPU: device arrays written on `stream`; dsinks is host memory (src/partial.h).
py::tuple gradients_result(dattn::Gradients g, dattn::StreamHandle stream) {
  py::tuple t = py::make_tuple(result(std::move(g.dq), stream), result(std::move(g.dk), stream),
                               result(std::move(g.dv), stream));
  if (!g.dsinks.defined()) return t;
  return py::make_tuple(t[0], t[1], t[2], result(std::move(g.dsinks), stream));
}

dattn::AttnSpec make_spec(const Options& o, const dattn::Tensor& q, const dattn::Tensor& k,
                          const dattn::Tensor& v) {
  return make_spec(o, q.size(2), k.size(2), q.size(3), v.size(3));
}

dattn::Layout make_layout(const std::string& kind, int64_t global_seq, int ranks,
                          int64_t stripe_block, const std::vector<int64_t>& cu_seqlens,
                          int64_t block) {
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
  if (kind == "blocks") {
    DATTN_CHECK_ARG(block >= 1, "block", block, ">= 1 tokens per block for layout 'blocks'");
    return dattn::Layout::blocks(global_seq, ranks, block);
  }
  DATTN_THROW("invalid layout = '", kind,
              "': expected contiguous, zigzag, striped, varlen or blocks");
}

dattn::Layout make_layout(const Options& o, int64_t global_seq, int ranks) {
  return make_layout(o.layout, global_seq, ranks, o.stripe_block, o.cu_seqlens, o.block);
}

uint64_t hash_string(uint64_t h, const std::string& s) {
  for (char c : s)
    h = dattn::hash_mix(h, uint64_t(uint8_t(c)));
  return h;
}

// The global sequence of a sharded call: the sum over the cp ranks of their shard lengths.
int64_t global_length(dattn::Runtime& rt, int64_t local_len) {
  uint64_t local = uint64_t(local_len), global = 0;
  rt.cp().allreduce_u64(&local, &global, 1, dattn::ReduceOp::sum);
  return int64_t(global);
}

// What one distributed attention call needs: the runtime, tensors, spec, layout and strategy.
struct Distributed {
  std::shared_ptr<RuntimeHandle> handle;  // keeps rt alive for the call
  dattn::Runtime* rt = nullptr;
  dattn::Tensor q, k, v;
  dattn::AttnSpec spec;
  dattn::Layout layout;
  dattn::Strategy strategy = dattn::Strategy::ring;
};

// Checks and converts a distributed call's arguments so that the ranks agree: a bad argument on
// one rank raises the same dattn.InvalidArgumentError on every rank instead of leaving the others
// waiting. The global sequence is the sum of the ranks' shard lengths (one small allreduce); the
// attention call's own check then says which rank holds the wrong number of tokens. The layout
// is then made from what every rank has agreed on (the options, in the hash, and that sum), so
// it succeeds or fails alike everywhere without another agreement. `more` converts the
// backward's extra arguments inside the same agreement.
// runtime: a dattn.Runtime (hybrid runs with its Ulysses degree) or None: the default runtime,
// whose degree becomes ulysses_degree for a hybrid call (ring and Ulysses do not depend on it, so
// the checks run over the current one).
template <typename More>
Distributed distributed(const Options& o, const py::object& runtime, const py::tuple& q,
                        const py::tuple& k, const py::tuple& v, More&& more) {
  Distributed d;
  const bool given = !runtime.is_none();
  d.handle = handle_of(runtime);
  dattn::Runtime* rt = &use(*d.handle);
  uint64_t h = hash_string(hash_string(dattn::kHashSeed, o.layout), o.strategy);
  h = dattn::hash_mix(h, uint64_t(o.ulysses_degree));
  h = dattn::hash_mix(h, uint64_t(o.stripe_block));
  h = dattn::hash_mix(h, uint64_t(o.block));
  for (int64_t c : o.cu_seqlens)
    h = dattn::hash_mix(h, uint64_t(c));
  dattn::agree_on_validation(rt->cp(), "dattn.attention arguments", h, [&] {
    d.q = as_bshd(q, "q", rt->device());
    d.k = as_bshd(k, "k", rt->device());
    d.v = as_bshd(v, "v", rt->device());
    if (!given)  // the library would say "expected cpu"; say what to do about it
      DATTN_CHECK_ARG(d.q.device().is_cpu(), "q device", d.q.device().str(),
                      "cpu on the default runtime (for GPU tensors pass "
                      "runtime=dattn.Runtime(device=\"cuda\"))");
    d.strategy =
        dattn::parse_strategy(o.strategy);  // prefill schedules only: ring, ulysses, hybrid
    if (d.strategy == dattn::Strategy::hybrid && given)
      DATTN_CHECK_ARG(o.ulysses_degree == 0 || o.ulysses_degree == rt->ulysses_degree(),
                      "ulysses_degree", o.ulysses_degree,
                      cat(rt->ulysses_degree(), " (the runtime's ulysses) or None"));
    else if (d.strategy == dattn::Strategy::hybrid)
      DATTN_CHECK_ARG(o.ulysses_degree >= 1, "ulysses_degree", o.ulysses_degree, ">= 1");
    d.spec = make_spec(o, d.q, d.k, d.v);
    more();
  });
  const int64_t global = global_length(*rt, d.q.size(1));
  d.layout = make_layout(o, global, rt->cp_size());
  if (d.strategy == dattn::Strategy::hybrid && !given) rt = &default_runtime(o.ulysses_degree);
  d.rt = rt;
  return d;
}

py::tuple partial_result(dattn::Partial r, dattn::StreamHandle stream) {
  return py::make_tuple(result(std::move(r.out), stream), result(std::move(r.lse), stream));
}

// The stream of one call on a GPU Runtime: `stream` (the package passes the current stream of
// the torch CUDA tensors, or the "stream" of the arrays' __cuda_array_interface__) instead of
// the Runtime's own for this call; None: the Runtime's. Restored when the call ends. A CPU
// Runtime has no stream (its call then rejects the device arrays, naming them).
class CallStream {
 public:
  CallStream(dattn::Runtime& rt, const py::object& stream) : rt_(rt), previous_(rt.stream()) {
    if (!stream.is_none() && !rt.device().is_cpu()) rt.set_stream(stream_handle(stream, "stream"));
  }
  ~CallStream() { rt_.set_stream(previous_); }
  CallStream(const CallStream&) = delete;
  CallStream& operator=(const CallStream&) = delete;
  dattn::StreamHandle stream() const { return rt_.stream(); }

 private:
  dattn::Runtime& rt_;
  dattn::StreamHandle previous_;
};

// The stream of a local call (no Runtime): `stream`, else the current one (the legacy default).
dattn::StreamHandle local_stream(const py::object& stream) {
  return stream.is_none() ? dattn::current_stream() : stream_handle(stream, "stream");
}

// ---------------------------------------------------------------- attention

py::tuple attention_forward(const py::tuple& q, const py::tuple& k, const py::tuple& v,
                            const py::dict& options, const py::object& runtime,
                            const py::object& stream) {
  const Distributed d = distributed(options_from(options), runtime, q, k, v, [] {});
  const CallStream on(*d.rt, stream);
  dattn::Partial r;
  {
    py::gil_scoped_release release;
    r = dattn::attention(*d.rt, d.q, d.k, d.v, d.spec, d.layout, d.strategy);
  }
  return partial_result(std::move(r), on.stream());
}

py::tuple attention_backward(const py::tuple& q, const py::tuple& k, const py::tuple& v,
                             const py::tuple& out, const py::tuple& lse, const py::tuple& dout,
                             const py::dict& options, const py::object& runtime,
                             const py::object& stream) {
  dattn::Partial fwd;
  dattn::Tensor tdout;
  const dattn::Device dev = get(*handle_of(runtime)).device();
  const Distributed d = distributed(options_from(options), runtime, q, k, v, [&] {
    fwd.out = as_bshd(out, "out", dev);
    fwd.lse = as_tensor(lse, "lse", 3, "[batch, heads, seq]", dev);
    tdout = as_bshd(dout, "dout", dev);
  });
  const CallStream on(*d.rt, stream);
  dattn::Gradients g;
  {
    py::gil_scoped_release release;
    g = dattn::attention_backward(*d.rt, d.q, d.k, d.v, fwd, tdout, d.spec, d.layout, d.strategy);
  }
  return gradients_result(std::move(g), on.stream());
}

py::tuple attention_local_forward(const py::tuple& q, const py::tuple& k, const py::tuple& v,
                                  const py::dict& options, const py::object& stream) {
  const Options o = options_from(options);
  const dattn::Tensor tq = as_bshd(q, "q");
  const dattn::Tensor tk = as_bshd(k, "k", tq.device()), tv = as_bshd(v, "v", tq.device());
  const dattn::AttnSpec spec = make_spec(o, tq, tk, tv);
  const dattn::StreamScope on(local_stream(stream));
  dattn::Partial r;
  {
    py::gil_scoped_release release;
    r = dattn::attention_local(tq, tk, tv, spec);
  }
  return partial_result(std::move(r), dattn::current_stream());
}

py::tuple attention_local_backward(const py::tuple& q, const py::tuple& k, const py::tuple& v,
                                   const py::tuple& out, const py::tuple& lse,
                                   const py::tuple& dout, const py::dict& options,
                                   const py::object& stream) {
  const Options o = options_from(options);
  const dattn::Tensor tq = as_bshd(q, "q");
  const dattn::Device dev = tq.device();
  const dattn::Tensor tk = as_bshd(k, "k", dev), tv = as_bshd(v, "v", dev);
  const dattn::Partial fwd{as_bshd(out, "out", dev),
                           as_tensor(lse, "lse", 3, "[batch, heads, seq]", dev)};
  const dattn::Tensor tdout = as_bshd(dout, "dout", dev);
  const dattn::AttnSpec spec = make_spec(o, tq, tk, tv);
  const dattn::StreamScope on(local_stream(stream));
  dattn::Gradients g;
  {
    py::gil_scoped_release release;
    g = dattn::attention_local_backward(tq, tk, tv, fwd, tdout, spec);
  }
  return gradients_result(std::move(g), dattn::current_stream());
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
    d.q = as_bshd(q, "q");
    d.k = as_bshd(k, "k");
    d.v = as_bshd(v, "v");
    d.spec = make_spec(o, d.q, d.k, d.v);
  } else {
    d = distributed(o, py::none(), q, k, v, [] {});
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
                        int64_t stripe_block, const std::vector<int64_t>& cu_seqlens,
                        int64_t block) {
  DATTN_CHECK_ARG(world >= 1, "world", world, ">= 1");
  DATTN_CHECK_ARG(rank >= 0 && rank < world, "rank", rank, cat("0 to ", world - 1));
  const dattn::Layout l = make_layout(kind, global_seq, world, stripe_block, cu_seqlens, block);
  std::vector<int64_t> pos(size_t(l.local_len(rank)));
  for (const dattn::Run& run : l.runs(rank))
    for (int64_t i = 0; i < run.length; ++i)
      pos[size_t(run.local_begin + i)] = run.position(i);
  return to_buffer(std::move(pos));
}

// ---------------------------------------------------------------- the KV cache and decode

// A dattn::KvCache over a runtime's cp group (ranks and rank), with the runtime it was made for.
struct CacheHandle {
  std::shared_ptr<RuntimeHandle> runtime;
  std::unique_ptr<dattn::KvCache> cache;

  dattn::KvCache& get() const {
    if (!cache) DATTN_THROW_KIND(dattn::ErrorKind::internal, "internal error: an empty KvCache");
    return *cache;
  }
};

dattn::DType parse_dtype(const std::string& code, const char* name) {
  if (code == "fp32") return dattn::DType::f32;
  if (code == "fp16") return dattn::DType::f16;
  if (code == "bf16") return dattn::DType::bf16;
  DATTN_THROW("invalid ", name, " = ", code, ": expected float32, float16 or bfloat16");
}

const char* dtype_code(dattn::DType d) {
  return d == dattn::DType::f32 ? "fp32" : d == dattn::DType::f16 ? "fp16" : "bf16";
}

dattn::Placement parse_placement(const std::string& name) {
  if (name == "round_robin") return dattn::Placement::round_robin;
  if (name == "last_rank") return dattn::Placement::last_rank;
  DATTN_THROW("invalid placement = '", name, "': expected round_robin or last_rank");
}

// dattn.KvCache(...): the cache over the runtime's cp group, room for `capacity` tokens on this
// rank. Collective (the arguments are agreed: a bad one raises on every rank).
std::shared_ptr<CacheHandle> make_cache(const py::object& heads_q, const py::object& heads_kv,
                                        const py::object& head_dim, const py::object& head_dim_v,
                                        const py::object& batch, const std::string& dtype,
                                        const py::object& capacity, const std::string& placement,
                                        const py::dict& options, const py::object& runtime) {
  auto c = std::make_shared<CacheHandle>();
  c->runtime = handle_of(runtime);
  dattn::Runtime& rt = use(*c->runtime);
  const Options o = options_from(options);
  // Every rank must make its cache alike, capacity included (append checks every rank's share
  // against this rank's capacity).
  uint64_t h = hash_string(hash_string(dattn::kHashSeed, dtype), placement);
  for (const py::object* x : {&heads_q, &heads_kv, &head_dim, &head_dim_v, &batch, &capacity})
    h = dattn::hash_mix(h, uint64_t(hash_int(*x)));
  dattn::agree_on_validation(rt.cp(), "dattn.KvCache arguments", h, [&] {
    const int64_t hq = int_value(heads_q, "heads_q"), hkv = int_value(heads_kv, "heads_kv"),
                  d = int_value(head_dim, "head_dim");
    const int64_t dv = head_dim_v.is_none() ? 0 : int_value(head_dim_v, "head_dim_v");
    DATTN_CHECK_ARG(head_dim_v.is_none() || dv > 0, "head_dim_v", dv, "> 0 (or None: head_dim)");
    const dattn::AttnSpec spec = make_spec(o, hq, hkv, d, dv);
    c->cache = std::make_unique<dattn::KvCache>(
        rt.cp_size(), rt.cp_rank(), spec, int_value(batch, "batch"), parse_dtype(dtype, "dtype"),
        int_value(capacity, "capacity"), parse_placement(placement), rt.device());
  });
  return c;
}

// k and v against the cache: its dtype and [batch, rows, heads_kv, head_dim(_v)].
void check_cache_rows(const dattn::Tensor& k, const dattn::Tensor& v, const dattn::KvCache& c,
                      int64_t rows) {
  const dattn::AttnSpec& s = c.spec();
  for (auto [t, name, dim] : {std::tuple{&k, "k", s.head_dim}, std::tuple{&v, "v", s.dim_v()}}) {
    DATTN_CHECK_ARG(t->dtype() == c.dtype(), cat(name, " dtype"), dattn::dtype_name(t->dtype()),
                    cat(dattn::dtype_name(c.dtype()), " (the cache's dtype)"));
    DATTN_CHECK_ARG(t->size(0) == c.batch() && t->size(1) == rows && t->size(2) == s.heads_kv &&
                        t->size(3) == dim,
                    cat(name, " shape"), t->shape_str(),
                    cat("[", c.batch(), ", ", rows, ", ", s.heads_kv, ", ", dim, "]"));
  }
}

// KvCache.prefill: this rank's shard of the prompt under a layout of the ranks' summed lengths.
// Collective: two agreed validations and one allreduce, then the copy into the cache.
void cache_prefill(CacheHandle& c, const py::tuple& k, const py::tuple& v, const py::dict& options,
                   const py::object& stream) {
  dattn::Runtime& rt = use(*c.runtime);
  dattn::KvCache& cache = c.get();
  const Options o = options_from(options);
  dattn::Tensor tk, tv;
  const uint64_t h = hash_string(dattn::kHashSeed, o.layout);
  dattn::agree_on_validation(rt.cp(), "dattn.KvCache.prefill arguments", h, [&] {
    DATTN_CHECK_ARG(cache.length() == 0, "cache length", cache.length(),
                    "0 (prefill an empty cache only)");
    tk = as_bshd(k, "k");
    tv = as_bshd(v, "v");
    check_cache_rows(tk, tv, cache, tk.size(1));
  });
  const int64_t global = global_length(rt, tk.size(1));
  dattn::Layout layout;
  dattn::agree_on_validation(rt.cp(), "dattn.KvCache.prefill layout", h, [&] {
    layout = make_layout(o, global, rt.cp_size());
    const int64_t n = layout.local_len(rt.cp_rank());
    DATTN_CHECK_ARG(
        tk.size(1) == n, "k seq", tk.size(1),
        cat(n, " (this rank's share of ", global, " tokens under layout '", o.layout, "')"));
    DATTN_CHECK_ARG(n <= cache.capacity(), "capacity", cache.capacity(),
                    cat(">= ", n, " tokens (this rank's share of the prompt)"));
  });
  const CallStream on(rt, stream);
  const dattn::StreamScope scope(on.stream());  // KvCache copies on the current stream
  py::gil_scoped_release release;
  cache.prefill(tk, tv, layout);
}

// KvCache.append: n new tokens, the same on every rank. Collective: the arguments and n are
// agreed first, so that the caches stay alike on every rank; the capacity check (every rank
// knows every rank's share) then fails on every rank alike, before any rank stores a token.
void cache_append(CacheHandle& c, const py::tuple& k, const py::tuple& v,
                  const py::object& stream) {
  dattn::Runtime& rt = use(*c.runtime);
  dattn::KvCache& cache = c.get();
  dattn::Tensor tk, tv;
  const uint64_t h = dattn::hash_mix(dattn::kHashSeed, uint64_t(raw_dim(k, 1)));
  dattn::agree_on_validation(rt.cp(), "dattn.KvCache.append arguments", h, [&] {
    tk = as_bshd(k, "k");
    tv = as_bshd(v, "v");
    check_cache_rows(tk, tv, cache, tk.size(1));
  });
  const CallStream on(rt, stream);
  const dattn::StreamScope scope(on.stream());
  py::gil_scoped_release release;
  cache.append(tk, tv);
}

Buffer cache_positions(const CacheHandle& c) {
  const dattn::KvCache& cache = c.get();
  std::vector<int64_t> pos(size_t(cache.local_len()));
  for (int64_t row = 0; row < cache.local_len(); ++row)
    pos[size_t(row)] = cache.global_position(row);
  return to_buffer(std::move(pos));
}

std::shared_ptr<RuntimeHandle> call_runtime(const CacheHandle& c, const py::object& runtime) {
  return runtime.is_none() ? c.runtime : runtime.cast<std::shared_ptr<RuntimeHandle>>();
}

py::tuple decode_step(const py::tuple& q, const CacheHandle& c, const std::string& strategy,
                      const py::object& runtime, const py::object& stream) {
  const auto h = call_runtime(c, runtime);
  dattn::Runtime& rt = use(*h);
  dattn::Tensor tq;
  dattn::DecodeStrategy s = dattn::DecodeStrategy::tree;
  dattn::agree_on_validation(rt.cp(), "dattn.decode arguments",
                             hash_string(dattn::kHashSeed, strategy), [&] {
                               tq = as_bshd(q, "q");
                               s = dattn::parse_decode_strategy(strategy);
                             });
  const CallStream on(rt, stream);
  dattn::Partial r;
  {
    py::gil_scoped_release release;
    r = dattn::decode(rt, tq, c.get(), s);
  }
  return partial_result(std::move(r), on.stream());
}

// ---------------------------------------------------------------- star attention

py::tuple star_prefill(const py::tuple& q, const py::tuple& k, const py::tuple& v,
                       const py::dict& options, const py::object& block, const py::object& anchor,
                       const py::object& runtime, const py::object& stream) {
  const auto h = handle_of(runtime);
  dattn::Runtime& rt = use(*h);
  Options o = options_from(options);
  dattn::Tensor tq, tk, tv;
  dattn::AttnSpec spec;
  int64_t a = -1;
  dattn::agree_on_validation(rt.cp(), "dattn.star_prefill arguments", dattn::kHashSeed, [&] {
    o.block = int_value(block, "block");
    DATTN_CHECK_ARG(o.block >= 1, "block", o.block, ">= 1 tokens");
    a = anchor.is_none() ? -1 : int_value(anchor, "anchor");
    DATTN_CHECK_ARG(anchor.is_none() || a >= 0, "anchor", a,
                    ">= 0 tokens (or None: the block size)");
    tq = as_bshd(q, "q");
    tk = as_bshd(k, "k");
    tv = as_bshd(v, "v");
    spec = make_spec(o, tq, tk, tv);
  });
  const int64_t global = global_length(rt, tq.size(1));
  const dattn::Layout layout = dattn::Layout::blocks(global, rt.cp_size(), o.block);
  const CallStream on(rt, stream);
  dattn::Partial r;
  {
    py::gil_scoped_release release;
    r = dattn::star_prefill(rt, tq, tk, tv, spec, layout, a);
  }
  return partial_result(std::move(r), on.stream());
}

// The merged result on the query rank (the last cp rank); None on the others.
py::object star_decode(const py::tuple& q, const CacheHandle& c, const py::object& runtime,
                       const py::object& stream) {
  const auto h = call_runtime(c, runtime);
  dattn::Runtime& rt = use(*h);
  dattn::Tensor tq;
  dattn::agree_on_validation(rt.cp(), "dattn.star_decode arguments", dattn::kHashSeed,
                             [&] { tq = as_bshd(q, "q"); });
  const CallStream on(rt, stream);
  dattn::Partial r;
  {
    py::gil_scoped_release release;
    r = dattn::star_decode(rt, tq, c.get());
  }
  if (!r.out.defined()) return py::none();
  return partial_result(std::move(r), on.stream());
}

// ---------------------------------------------------------------- MLA

// t has `shape` (-1: any size); the message names the expected shape.
void check_shape(const dattn::Tensor& t, const char* name, std::initializer_list<int64_t> shape) {
  bool ok = t.dim() == int(shape.size());
  std::string want = "[";
  int d = 0;
  for (int64_t n : shape) {
    ok = ok && (n < 0 || t.size(d) == n);
    want += cat(d > 0 ? ", " : "", n < 0 ? std::string("any") : std::to_string(n));
    ++d;
  }
  DATTN_CHECK_ARG(ok, cat(name, " shape"), t.shape_str(), want + "]");
}

dattn::MlaParallel parse_mla_method(const std::string& name) {
  if (name == "head_split") return dattn::MlaParallel::head_split;
  if (name == "tpla") return dattn::MlaParallel::tpla;
  DATTN_THROW("invalid method = '", name, "': expected head_split or tpla");
}

dattn::LatentTransform parse_transform(const std::string& name) {
  if (name == "none") return dattn::LatentTransform::none;
  if (name == "hadamard") return dattn::LatentTransform::hadamard;
  if (name == "pca") return dattn::LatentTransform::pca;
  DATTN_THROW("invalid transform = '", name, "': expected None, hadamard or pca");
}

dattn::RopePlacement parse_rope(const std::string& name) {
  if (name == "replicated") return dattn::RopePlacement::replicated;
  if (name == "split") return dattn::RopePlacement::split;
  DATTN_THROW("invalid rope = '", name, "': expected replicated or split");
}

// dattn.mla_decode: the whole cache (the same on every rank) in, this rank's shard of it cut here
// (mla_shard_cache: a view for head_split, a copy of the slice's columns for TPLA), the transform
// (if any) folded into the weights and applied to the cache (copies), then the distributed
// decode. Every local step runs inside one agreed validation. Collective.
py::object mla_decode(const py::tuple& q_nope, const py::tuple& q_pe, const py::tuple& c_kv,
                      const py::tuple& k_pe, const py::tuple& w_uk, const py::tuple& w_uv,
                      const py::object& calibration, const py::dict& mla, const py::dict& options,
                      const py::object& runtime, const py::object& stream) {
  const auto h = handle_of(runtime);
  dattn::Runtime& rt = use(*h);
  const Options o = options_from(options);
  const auto method = mla["method"].cast<std::string>();
  const auto transform = mla["transform"].cast<std::string>();
  const auto rope = mla["rope"].cast<std::string>();
  const py::object q_pos0 = mla["q_pos0"], scale_by_g = mla["scale_logits_by_g"];
  uint64_t hash = hash_string(hash_string(hash_string(dattn::kHashSeed, method), transform), rope);
  dattn::MlaParallel parallel{};
  dattn::MlaConfig cfg;
  dattn::MlaWeights w;
  dattn::TplaOptions tpla;
  dattn::MlaCacheShard shard;
  dattn::Tensor qn, qp;
  int64_t pos0 = 0;
  const dattn::Mask mask = make_mask(o);
  dattn::agree_on_validation(rt.cp(), "dattn.mla_decode arguments", hash, [&] {
    parallel = parse_mla_method(method);
    tpla.rope = parse_rope(rope);
    tpla.scale_logits_by_g = bool_option(scale_by_g, "scale_logits_by_g");
    const dattn::LatentTransform kind = parse_transform(transform);
    qn = as_tensor(q_nope, "q_nope", 4, "[batch, S_q, heads, qk_nope]");
    qp = as_tensor(q_pe, "q_pe", 4, "[batch, S_q, heads, rope]");
    const dattn::Tensor c = as_tensor(c_kv, "c_kv", 3, "[batch, seq, latent]");
    const dattn::Tensor kp = as_tensor(k_pe, "k_pe", 3, "[batch, seq, rope]");
    w.w_uk = as_tensor(w_uk, "w_uk", 3, "[heads, qk_nope, latent]");
    w.w_uv = as_tensor(w_uv, "w_uv", 3, "[heads, v_head, latent]");
    for (auto [t, name] :
         std::initializer_list<std::pair<const dattn::Tensor*, const char*>>{{&qn, "q_nope"},
                                                                             {&qp, "q_pe"},
                                                                             {&c, "c_kv"},
                                                                             {&kp, "k_pe"},
                                                                             {&w.w_uk, "w_uk"},
                                                                             {&w.w_uv, "w_uv"}})
      DATTN_CHECK_ARG(t->dtype() == dattn::DType::f32, cat(name, " dtype"),
                      dattn::dtype_name(t->dtype()), "fp32 (MLA tensors are float32)");
    // The configuration is the weights' and the cache's; the queries must match it.
    cfg.heads = w.w_uk.size(0);
    cfg.qk_nope = w.w_uk.size(1);
    cfg.latent = w.w_uk.size(2);
    cfg.v_head = w.w_uv.size(1);
    cfg.rope = kp.size(2);
    const int64_t B = c.size(0), S = c.size(1), Sq = qn.size(1);
    check_shape(w.w_uv, "w_uv", {cfg.heads, -1, cfg.latent});
    check_shape(c, "c_kv", {-1, -1, cfg.latent});
    check_shape(kp, "k_pe", {B, S, -1});
    check_shape(qn, "q_nope", {B, -1, cfg.heads, cfg.qk_nope});
    check_shape(qp, "q_pe", {B, Sq, cfg.heads, cfg.rope});
    DATTN_CHECK_ARG(o.softmax_scale >= 0, "softmax_scale", o.softmax_scale, "> 0 (or None)");
    cfg.softmax_scale = float(o.softmax_scale);
    cfg.validate();
    mask.validate();
    DATTN_CHECK_ARG(!mask.documents, "mask", mask.str(), "a band mask (causal, window or none)");
    pos0 = q_pos0.is_none() ? S - Sq : int_value(q_pos0, "q_pos0");
    DATTN_CHECK_ARG(pos0 >= 0, "q_pos0", pos0,
                    ">= 0 (None: the queries are the cache's last S_q tokens)");
    dattn::Tensor cal;
    if (kind == dattn::LatentTransform::pca)
      cal = calibration.is_none()
                ? dattn::Tensor::wrap(c.data(), {c.size(0) * c.size(1), c.size(2)}, c.dtype())
                : as_tensor(calibration.cast<py::tuple>(), "calibration", 2, "[tokens, latent]");
    const dattn::MlaTransform t = dattn::make_latent_transform(kind, cfg.latent, cal);
    dattn::Tensor cache = c;
    if (kind != dattn::LatentTransform::none) {
      w = dattn::fold_transform(w, t);
      cache = dattn::apply_transform(t, c);
    }
    shard = dattn::mla_shard_cache(cfg, parallel, tpla, cache, kp, rt.cp_rank(), rt.cp_size());
  });
  const CallStream on(rt, stream);
  dattn::Tensor out;
  {
    py::gil_scoped_release release;
    out = dattn::mla_decode(rt, parallel, cfg, w, qn, qp, shard, pos0, tpla, mask);
  }
  return result(std::move(out), on.stream());
}

// Sums a C-contiguous float64 buffer over every rank of MPI_COMM_WORLD, in place, through the
// default runtime's communicator, so that its watchdog (RuntimeOptions::timeout_s) ends a job
// whose ranks stop meeting here, as in the library's own collectives. Its communicator has no
// float64 reduction, so each chunk is allgathered and summed here in rank order: the same
// result, bit for bit, on every rank, and memory for ranks x kChunk values at most.
void allreduce_sum(const py::buffer& buffer) {
  const py::buffer_info a = buffer.request(true);
  if (format_code(a.format) != 'd' || a.itemsize != 8 || !c_contiguous(a))
    DATTN_THROW_KIND(dattn::ErrorKind::internal,
                     "internal error: allreduce_sum takes a C-contiguous float64 array");
  dattn::Communicator& comm = get(*default_handle()).cp().control();
  double* data = static_cast<double*>(a.ptr);
  const size_t n = size_t(a.size), ranks = size_t(comm.size());
  constexpr size_t kChunk = size_t(1) << 16;
  std::vector<double> all(ranks * std::min(n, kChunk));
  py::gil_scoped_release release;
  for (size_t begin = 0; begin < n; begin += kChunk) {
    const size_t count = std::min(kChunk, n - begin);
    comm.allgather(data + begin, all.data(), count * sizeof(double));
    for (size_t i = 0; i < count; ++i) {
      double sum = 0;
      for (size_t r = 0; r < ranks; ++r)
        sum += all[r * count + i];
      data[begin + i] = sum;
    }
  }
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

#if DATTN_CUDA_EMULATION
// The module built on the CUDA emulation (tests/emu, build/python-emu) adds _C.emulation, the
// fake runtime's streams and their accounting (tests/emu/python_emulation.cpp).
void dattn_add_emulation(py::module_& m);
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "dattn's compiled core; use the dattn package, not this module.";
  py::class_<Buffer>(m, "Buffer", py::buffer_protocol(),
                     "A result's storage; np.asarray(b) views it without a copy.")
      .def_buffer(&buffer_info);
  py::class_<DeviceArray>(m, "DeviceArray",
                          "A tensor in GPU memory (see dattn.DeviceArray): "
                          "__cuda_array_interface__, shape, dtype, device, to_host().")
      .def_property_readonly("__cuda_array_interface__", &cuda_array_interface)
      .def_property_readonly("shape", [](const DeviceArray& a) { return shape_of(*a.tensor); })
      .def_property_readonly("dtype",
                             [](const DeviceArray& a) { return dtype_code(a.tensor->dtype()); })
      .def_property_readonly("device",
                             [](const DeviceArray& a) { return a.tensor->device().index; })
      .def("to_host",  // a numpy array over the copy (numpy's, not its C API: see Buffer)
           [](const DeviceArray& a) {
             return py::module_::import("numpy").attr("asarray")(to_host(a));
           })
      .def("__repr__", [](const DeviceArray& a) {
        return cat("dattn.DeviceArray(", a.tensor->shape_str(), " on ", a.tensor->device().str(),
                   ")");
      });
  // (array, dtype) in host memory -> a DeviceArray on GPU `device` (None: the current one): the
  // copy is complete when this returns (pageable host memory), in the legacy default stream's
  // order.
  m.def(
      "to_device",
      [](const py::tuple& t, const py::object& device) {
        const dattn::Tensor host = as_tensor(t, "x", -1, "");
        DATTN_CHECK_ARG(host.device().is_cpu(), "x", "a device array", "an array in host memory");
        const dattn::Device to = device.is_none()
                                     ? dattn::current_cuda_device()
                                     : dattn::Device::cuda(int_option(device, "device"));
        const dattn::StreamScope on(nullptr);
        return DeviceArray{std::make_shared<const dattn::Tensor>(host.to_device(to)), nullptr};
      },
      py::arg("x"), py::arg("device"));
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

  // The package's dattn.Runtime and dattn.KvCache hold these.
  py::class_<RuntimeHandle, std::shared_ptr<RuntimeHandle>>(m, "Runtime",
                                                            "A dattn::Runtime (see dattn.Runtime).")
      .def(py::init(&make_runtime), py::arg("comm_address"), py::arg("tp"), py::arg("ulysses"),
           py::arg("threads"), py::arg("check_finite"), py::arg("timeout_s"), py::arg("device"),
           py::arg("stream"))
      .def_property_readonly("rank", [](RuntimeHandle& h) { return get(h).rank(); })
      .def_property_readonly("size", [](RuntimeHandle& h) { return get(h).size(); })
      .def_property_readonly("cp_rank", [](RuntimeHandle& h) { return get(h).cp_rank(); })
      .def_property_readonly("cp_size", [](RuntimeHandle& h) { return get(h).cp_size(); })
      .def_property_readonly("tp_rank", [](RuntimeHandle& h) { return get(h).tp_rank(); })
      .def_property_readonly("tp_size", [](RuntimeHandle& h) { return get(h).tp_size(); })
      .def_property_readonly("ulysses", [](RuntimeHandle& h) { return get(h).ulysses_degree(); })
      .def_property_readonly("threads", [](RuntimeHandle& h) { return get(h).threads(); })
      .def_property_readonly("check_finite", [](RuntimeHandle& h) { return get(h).check_finite(); })
      .def_property_readonly("device", [](RuntimeHandle& h) { return get(h).device().str(); })
      .def_property_readonly(
          "stream", [](RuntimeHandle& h) { return reinterpret_cast<uintptr_t>(get(h).stream()); });
  m.def("default_runtime", &default_handle);
  m.def("omp_max_threads", &omp_get_max_threads,
        "OpenMP's thread count for this process's next parallel region (tests check that a "
        "call restores its runtime's).");
  m.def("mpi_library_version", &mpi_library_version);

  py::class_<CacheHandle, std::shared_ptr<CacheHandle>>(m, "KvCache",
                                                        "A dattn::KvCache (see dattn.KvCache).")
      .def(py::init(&make_cache), py::arg("heads_q"), py::arg("heads_kv"), py::arg("head_dim"),
           py::arg("head_dim_v"), py::arg("batch"), py::arg("dtype"), py::arg("capacity"),
           py::arg("placement"), py::arg("options"), py::arg("runtime"))
      .def("prefill", &cache_prefill, py::arg("k"), py::arg("v"), py::arg("options"),
           py::arg("stream") = py::none())
      .def("append", &cache_append, py::arg("k"), py::arg("v"), py::arg("stream") = py::none())
      .def("positions", &cache_positions)
      .def_property_readonly("runtime", [](const CacheHandle& c) { return c.runtime; })
      .def_property_readonly("length", [](const CacheHandle& c) { return c.get().length(); })
      .def_property_readonly("local_len", [](const CacheHandle& c) { return c.get().local_len(); })
      .def_property_readonly("capacity", [](const CacheHandle& c) { return c.get().capacity(); })
      .def_property_readonly("batch", [](const CacheHandle& c) { return c.get().batch(); })
      .def_property_readonly("dtype",
                             [](const CacheHandle& c) { return dtype_code(c.get().dtype()); })
      .def_property_readonly(
          "placement",
          [](const CacheHandle& c) { return dattn::placement_name(c.get().placement()); })
      .def_property_readonly("heads_q", [](const CacheHandle& c) { return c.get().spec().heads_q; })
      .def_property_readonly("heads_kv",
                             [](const CacheHandle& c) { return c.get().spec().heads_kv; })
      .def_property_readonly("head_dim",
                             [](const CacheHandle& c) { return c.get().spec().head_dim; })
      .def_property_readonly("head_dim_v",
                             [](const CacheHandle& c) { return c.get().spec().dim_v(); });

  m.def("finalize", &finalize, "Releases the Runtimes and finalises MPI if dattn initialised it.");
  m.def("rank", &world_rank, "This process's rank in MPI_COMM_WORLD.");
  m.def("world_size", &world_size, "The number of ranks in MPI_COMM_WORLD.");
  m.def(
      "barrier",
      [] {
        dattn::Communicator& comm = get(*default_handle()).cp().control();
        py::gil_scoped_release release;
        comm.barrier();  // the watchdog's deadline holds here too
      },
      "Waits for every rank.");
  m.def(
      "abort",
      [](int code) {
        if (mpi_active()) MPI_Abort(MPI_COMM_WORLD, code);
        std::exit(code);
      },
      py::arg("code") = 1, "Aborts every rank of the job with the exit code (MPI_Abort).");
  // runtime: None (the default runtime) or a dattn.Runtime's handle.
  // stream: None, or the CUDA stream of a call on device arrays (CallStream, local_stream).
  m.def("attention_forward", &attention_forward, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("options"), py::arg("runtime") = py::none(), py::arg("stream") = py::none());
  m.def("attention_backward", &attention_backward, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("out"), py::arg("lse"), py::arg("dout"), py::arg("options"),
        py::arg("runtime") = py::none(), py::arg("stream") = py::none());
  m.def("attention_local_forward", &attention_local_forward, py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("options"), py::arg("stream") = py::none());
  m.def("attention_local_backward", &attention_local_backward, py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("dout"), py::arg("options"),
        py::arg("stream") = py::none());
  m.def("layout_positions", &layout_positions, py::arg("kind"), py::arg("global_seq"),
        py::arg("rank"), py::arg("world"), py::arg("stripe_block"), py::arg("cu_seqlens"),
        py::arg("block") = 0);
  m.def("decode", &decode_step, py::arg("q"), py::arg("cache"), py::arg("strategy"),
        py::arg("runtime"), py::arg("stream") = py::none());
  m.def("star_prefill", &star_prefill, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("options"),
        py::arg("block"), py::arg("anchor"), py::arg("runtime"), py::arg("stream") = py::none());
  m.def("star_decode", &star_decode, py::arg("q"), py::arg("cache"), py::arg("runtime"),
        py::arg("stream") = py::none());
  m.def("mla_decode", &mla_decode, py::arg("q_nope"), py::arg("q_pe"), py::arg("c_kv"),
        py::arg("k_pe"), py::arg("w_uk"), py::arg("w_uv"), py::arg("calibration"), py::arg("mla"),
        py::arg("options"), py::arg("runtime"), py::arg("stream") = py::none());
  m.def("time_forward", &time_forward);
  m.def("allreduce_sum", &allreduce_sum);
#if DATTN_CUDA_EMULATION
  dattn_add_emulation(m);
#endif
}
