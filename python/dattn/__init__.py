"""dattn: distributed attention over MPI ranks, from Python.

Run under MPI (``mpirun -n 4 python3 train.py``); each process passes its own shard of the
sequence. Importing dattn initialises MPI (MPI_THREAD_FUNNELED) unless the program (or mpi4py)
already did, and finalises it at exit only if it initialised it.

    import dattn
    pos = dattn.layout_positions("zigzag", S)        # the global tokens this rank holds
    out = dattn.attention(q[:, pos], k[:, pos], v[:, pos], causal=True, layout="zigzag")
    out.sum().backward()                              # torch tensors: q.grad, k.grad, v.grad

    cache = dattn.KvCache(heads_q=8, heads_kv=2, head_dim=64, batch=1, dtype="bfloat16",
                          capacity=4096)               # this rank's room, in tokens
    cache.prefill(k_shard, v_shard)                  # this rank's shard of the prompt
    cache.append(k_new, v_new)                       # the new token's K/V, the same everywhere
    out = dattn.decode(q_new, cache, strategy="tree")   # the whole result on every rank

The whole C++ API, named like it: attention (and its backward), KvCache and decode (tree, ring,
allgather), star_prefill / star_decode (star attention), mla_decode (head split or TPLA, with a
Hadamard or PCA transform of the latent), and Runtime (or from_comm, over an mpi4py
communicator) for the options of dattn::RuntimeOptions. Every distributed call takes
``runtime=``; without it the module's default runtime over MPI_COMM_WORLD runs it.

Tensors are numpy arrays (float32, float16), torch tensors (float32, bfloat16, float16) or, in
GPU memory, objects with __cuda_array_interface__ (a dattn.DeviceArray, CuPy); attention tensors
are bshd ([batch, seq, heads, head_dim]). Results are float32, numpy for numpy inputs and torch
for torch inputs, over the library's own storage (no copy); in GPU memory they are torch CUDA
tensors for torch inputs, else dattn.DeviceArray. An input that is C-contiguous is read where it
lies (no copy); attention, attention_local and their backward calls copy a non-contiguous one,
every other call refuses it (InvalidArgumentError naming it).

GPUs: a Runtime(device="cuda") runs its calls on this rank's GPU, over NCCL, on torch CUDA
tensors (or other device arrays) without a copy. A call runs on the current torch stream of its
tensors (torch.cuda.current_stream()), or on the "stream" their __cuda_array_interface__
names, else on the Runtime's stream=; it returns once the work is queued (no call waits for the
GPU). Its results are complete in that stream's order and are freed on it: a consumer on
another stream waits for it first (an event) and, like torch's record_stream, keeps a result
alive until that stream is past its use.

Errors raise a subclass of dattn.Error with the library's message (it names the parameter and the
rank) and its kind as e.kind; each also derives from the builtin a caller expects:
InvalidArgumentError (ValueError), OutOfMemoryError (MemoryError), TimeoutError (TimeoutError),
MPIError, CUDAError, NCCLError and InternalError (RuntimeError). A bad argument on one rank
raises the same class on every rank of the call's group; nothing hangs.
"""

import atexit

import numpy as np

# torch before the extension: both need libnccl.so.2 and libcudart (the extension through the
# library's CUDA backend), and a process loads one library of each name. PyPI's torch needs its
# own, newer NCCL (ncclCommResume is missing from the toolkit's), so its copies must be the ones
# loaded; NCCL and the CUDA runtime keep their ABI within a major version, so ours work with them.
try:
    import torch
except ImportError:  # numpy-only use
    torch = None

from . import _C  # noqa: E402 - after torch, see above

# TimeoutError is left out of __all__: a star import would hide the builtin of that name.
__all__ = [
    "attention", "attention_backward", "attention_local", "attention_local_backward",
    "Runtime", "from_comm", "default_runtime", "KvCache", "decode", "star_prefill", "star_decode",
    "mla_decode", "layout_positions", "rank", "world_size", "allreduce_sum", "barrier", "abort",
    "to_device", "DeviceArray",
    "finalize", "Error", "InvalidArgumentError", "OutOfMemoryError", "MPIError", "CUDAError",
    "NCCLError", "InternalError",
]

atexit.register(_C.finalize)

rank = _C.rank
world_size = _C.world_size
barrier = _C.barrier
abort = _C.abort
finalize = _C.finalize

Error = _C.Error
InvalidArgumentError = _C.InvalidArgumentError
OutOfMemoryError = _C.OutOfMemoryError
TimeoutError = _C.TimeoutError  # noqa: A001 - dattn.TimeoutError derives from the builtin
MPIError = _C.MPIError
CUDAError = _C.CUDAError
NCCLError = _C.NCCLError
InternalError = _C.InternalError

# A tensor in GPU memory made by dattn (a result on a GPU, or to_device's copy): its
# __cuda_array_interface__ (version 3; bfloat16 as '<u2' patterns), shape, dtype ("fp32",
# "fp16", "bf16"), device (the GPU's index) and to_host() (a numpy copy, once its stream is done).
DeviceArray = _C.DeviceArray


# ---------------------------------------------------------------- arrays in and out

def _is_torch(x):
    return torch is not None and isinstance(x, torch.Tensor)


class _TorchCuda:
    """What dattn asks of torch about CUDA tensors, in one place: whether a tensor is one, the
    device array the extension reads it through, the stream a call on it runs on, and a result
    as a torch tensor. (The emulated tests, tests/python/test_cuda_tensors.py, replace this with
    the CUDA emulation's counterpart, as no torch tensor is a CUDA tensor there.)"""

    @staticmethod
    def is_device(x):
        return x.is_cuda

    @staticmethod
    def view(x, typestr):
        return _CudaView(x, typestr)

    @staticmethod
    def stream(x):
        return torch.cuda.current_stream(x.device).cuda_stream

    @staticmethod
    def tensor(a):
        """A torch CUDA tensor over a DeviceArray (no copy; it keeps the array alive)."""
        return torch.as_tensor(a, device=torch.device("cuda", a.device))


_torch_cuda = _TorchCuda


class _CudaView:
    """A torch CUDA tensor as the extension reads GPU memory: __cuda_array_interface__ over its
    storage (zero copy), with bfloat16 as its 16-bit patterns ('<u2', which torch's own interface
    refuses). Holds the tensor for the duration of the call."""

    def __init__(self, x, typestr):
        self.tensor = x
        self.shape = tuple(x.shape)
        self.__cuda_array_interface__ = {"shape": self.shape, "typestr": typestr,
                                         "data": (x.data_ptr(), False), "strides": None,
                                         "version": 3}


_TYPESTRS = {"<f4": "fp32", "<f2": "fp16", "<u2": "bf16", "<i2": "bf16"}


def _device_array(x):
    """Whether x is GPU memory for the extension: a torch CUDA tensor, or an object with
    __cuda_array_interface__ (a dattn.DeviceArray, CuPy, Numba)."""
    if _is_torch(x):
        return _torch_cuda.is_device(x)
    return hasattr(x, "__cuda_array_interface__")


def _stream_of(x):
    """The stream a call on x runs on: torch's current stream for a CUDA tensor, the "stream" of
    another device array's interface (None there: the Runtime's), None for host memory."""
    if not _device_array(x):
        return None
    if _is_torch(x):
        return _torch_cuda.stream(x)
    return x.__cuda_array_interface__.get("stream")


def _as_array(x, name, copy=True):
    """(array, dtype name) for the extension: a numpy view of x; bfloat16 goes as its 16-bit
    patterns. A C-contiguous x is never copied; a non-contiguous one is copied with copy=True and
    otherwise passed as it is, for the extension to reject naming it. What dattn cannot take goes
    as an empty array with a description instead, for the extension to reject on every rank at
    once."""
    if _is_torch(x) and _torch_cuda.is_device(x):
        x = x.detach()
        if copy:
            x = x.contiguous()
        codes = {torch.float32: ("<f4", "fp32"), torch.bfloat16: ("<u2", "bf16"),
                 torch.float16: ("<f2", "fp16")}
        if x.dtype not in codes:
            return (_NOTHING, f"dtype {x.dtype}: expected float32, bfloat16 or float16")
        typestr, code = codes[x.dtype]
        return (_torch_cuda.view(x, typestr), code)
    if _is_torch(x):
        if x.device.type != "cpu":
            return (_NOTHING, f"a tensor on device {x.device}: expected a CPU or CUDA tensor")
        x = x.detach()
        if copy:
            x = x.contiguous()
        if x.dtype == torch.float32:
            return (x.numpy(), "fp32")
        if x.dtype == torch.bfloat16:
            return (x.view(torch.int16).numpy(), "bf16")
        if x.dtype == torch.float16:
            return (x.numpy(), "fp16")
        return (_NOTHING, f"dtype {x.dtype}: expected float32, bfloat16 or float16")
    if hasattr(x, "__cuda_array_interface__"):  # read as it is: the extension checks the rest
        typestr = x.__cuda_array_interface__.get("typestr")
        code = x.dtype if isinstance(x, DeviceArray) else _TYPESTRS.get(typestr)
        if code is None:
            return (_NOTHING, f"__cuda_array_interface__ typestr {typestr!r}: expected '<f4' "
                              "(float32), '<f2' (float16) or '<u2' (bfloat16's patterns)")
        return (x, code)
    a = np.asarray(x)
    if a.dtype == np.float32 or a.dtype == np.float16:
        return (np.ascontiguousarray(a) if copy else a, "fp32" if a.dtype == np.float32 else "fp16")
    return (_NOTHING, f"dtype {a.dtype}: expected float32, float16 or bfloat16 "
                      "(convert with .astype(np.float32))")


def _view(x, name):
    """_as_array without a copy: a non-contiguous x is refused (by the extension, on every
    rank)."""
    return _as_array(x, name, copy=False)


_NOTHING = np.zeros((0, 0, 0, 0), dtype=np.float32)


def _mask(o, causal, window):
    """The mask's entries of an options dict: causal, and window=w (the w keys before each query
    and the query: a causal sliding window) or window=(left, right) (keys from q - left to
    q + right; -1 on a side: no limit)."""
    o["causal"] = bool(causal)
    if window is not None:
        left, right = (window, 0) if np.ndim(window) == 0 else tuple(window)
        left, right = int(left), int(right)
        if causal and right != 0:
            raise InvalidArgumentError(
                f"invalid window = {window}: causal=True needs a right window of 0")
        o["window_left"], o["window_right"] = left, right
    return o


def _sinks(o, sinks, softcap=None):
    """Attention sinks and the logit softcap into an options dict: sinks (a torch tensor, numpy
    array or sequence of heads_q logits, one per query head) as the floats the extension takes;
    None: none. softcap: a float (0 or None: off). The extension checks the count, that each sink
    is finite and that softcap is >= 0."""
    if softcap is not None:
        o["softcap"] = float(softcap)
    if sinks is not None:
        if _is_torch(sinks):
            sinks = sinks.detach().to("cpu", torch.float32).numpy()
        a = np.asarray(sinks, dtype=np.float64)
        if a.ndim != 1:
            raise InvalidArgumentError(
                f"invalid sinks shape = {a.shape}: expected [heads_q] (one logit per query head)")
        o["sinks"] = [float(x) for x in a]
    return o


_SLICE_KINDS = {"full": 0, "causal": 1, "inv_causal": 2, "bi_causal": 3}


def _slices(o, slices):
    """A slice mask into an options dict: slices, a sequence of (q_begin, q_end, k_begin, k_end,
    kind) in global positions, kind "full", "causal" (bottom-right aligned), "inv_causal" or
    "bi_causal"; None: no slice mask. The extension checks ranges and overlaps."""
    if slices is None:
        return o
    entries = []
    for s in slices:
        try:
            q0, q1, k0, k1, kind = s
            entry = [int(q0), int(q1), int(k0), int(k1)]
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"invalid slices entry = {s!r}: expected (q_begin, q_end, "
                                       "k_begin, k_end, kind)") from None
        if kind not in _SLICE_KINDS:
            raise InvalidArgumentError(f"invalid slice kind = {kind!r}: expected 'full', "
                                       "'causal', 'inv_causal' or 'bi_causal'")
        entries.append(entry + [_SLICE_KINDS[kind]])
    o["slices"] = entries
    return o


def _scale(o, softmax_scale):
    if softmax_scale is not None:
        if not softmax_scale > 0:
            raise InvalidArgumentError(
                f"invalid softmax_scale = {softmax_scale}: expected > 0 (or None)")
        o["softmax_scale"] = float(softmax_scale)
    return o


def _layout(o, layout, stripe_block, cu_seqlens, block=None):
    """The layout's entries of an options dict."""
    o["layout"], o["stripe_block"] = str(layout), int(stripe_block)
    if cu_seqlens is not None:
        o["cu_seqlens"] = [int(c) for c in np.asarray(cu_seqlens).reshape(-1)]
    if layout == "varlen" and cu_seqlens is None:
        raise InvalidArgumentError("invalid cu_seqlens = None: expected document boundaries "
                                   "[0, e1, ..., S] for layout 'varlen'")
    if block is not None:
        o["block"] = int(block)
    return o


def _options(causal, softmax_scale, window, cu_seqlens, layout="contiguous", strategy="ring",
             ulysses_degree=None, stripe_block=1, runtime=None, sinks=None, softcap=None,
             slices=None):
    """The options dict the extension takes: the mask as window sizes and document boundaries,
    or slices. hybrid needs ulysses_degree on the default runtime; a dattn.Runtime brings its own."""
    o = _sinks(_scale(_mask({"strategy": str(strategy)}, causal, window), softmax_scale), sinks,
               softcap)
    _slices(o, slices)
    _layout(o, layout, stripe_block, cu_seqlens)
    if strategy == "hybrid":
        if ulysses_degree is None and runtime is None:
            raise InvalidArgumentError("invalid ulysses_degree = None: expected the Ulysses "
                                       "group size (a divisor of the ranks) for strategy 'hybrid'")
        o["ulysses_degree"] = 0 if ulysses_degree is None else int(ulysses_degree)
    return o


def _array(buffer):
    """A numpy array over a result's storage (the extension's Buffer), without a copy; a result in
    GPU memory stays a DeviceArray."""
    return buffer if isinstance(buffer, DeviceArray) else np.asarray(buffer)


def _tensor(buffer):
    """A torch tensor over a result's storage (host or GPU memory), without a copy."""
    if isinstance(buffer, DeviceArray):
        return _torch_cuda.tensor(buffer)
    return torch.from_numpy(np.asarray(buffer))


def to_device(x, device=None):
    """A copy of x (a numpy array or CPU torch tensor: float32, float16, bfloat16) on GPU
    `device` (an index; None: the current CUDA device, which making a Runtime(device="cuda")
    sets to its GPU) as a dattn.DeviceArray, for calls on a GPU Runtime from programs without a
    GPU array library. Complete when it returns."""
    return _C.to_device(_as_array(x, "x"), device)


def _result(buffers, like_torch):
    return tuple(_tensor(b) if like_torch else _array(b) for b in buffers)


def _out(buffers, like_torch, return_lse):
    """(out, lse) or out, of the input's kind."""
    out, lse = _result(buffers, like_torch)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------- runtimes

def _comm_address(comm):
    """The address of the MPI_Comm inside an mpi4py communicator, for the extension to read.

    MPI._addressof(comm), not MPI._handleof(comm): the address of the handle works for any MPI
    (Open MPI's MPI_Comm is a pointer, MPICH's an int), since the extension reads an MPI_Comm
    from it; the handle's integer value would have to be cast back to MPI_Comm, which is only
    right where MPI_Comm is a pointer or an int of that width. Both need mpi4py to run on the
    MPI library dattn was built with, which is checked here."""
    if comm is None:
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        MPI = None
    if MPI is None or not isinstance(comm, MPI.Comm):
        raise InvalidArgumentError(f"invalid comm = {comm!r}: expected an mpi4py.MPI.Comm "
                                   "(or None: MPI_COMM_WORLD)")
    theirs, ours = MPI.Get_library_version().strip(), _C.mpi_library_version().strip()
    if theirs != ours:
        raise InvalidArgumentError(f"invalid comm: mpi4py runs on '{theirs}', dattn on "
                                   f"'{ours}': expected mpi4py built for dattn's MPI library")
    return MPI._addressof(comm)


class Runtime:
    """The ranks and options every distributed call runs with (dattn::Runtime): the ranks of
    `comm` (an mpi4py communicator; None: MPI_COMM_WORLD) form a cp x tp grid, tp fastest, and a
    call runs over this rank's cp group (the cp_size ranks with its tp_rank).

    tp: tensor-parallel degree, a divisor of the ranks (cp = ranks / tp). ulysses: the Ulysses
    degree U of strategy "hybrid" (a divisor of cp). threads: OpenMP threads per rank (None:
    OMP_NUM_THREADS if set, else the node's cores / its ranks); set again at every call on this
    runtime, as OpenMP's count is one per process. check_finite: scan every call's inputs for
    NaN/inf and raise InvalidArgumentError naming the first one (DATTN_CHECK_FINITE=1 turns it on
    as well). timeout_s: the watchdog's deadline in seconds for any wait (None: DATTN_TIMEOUT,
    else 300); past it the job is aborted with a message (exit code 14).

    device: "cpu" (None), "cuda" (the GPU whose index is this rank's among the ranks of its node:
    one GPU per rank, as mpirun and srun place them), "cuda:N", an int N or a torch.device; a
    GPU runtime's groups are NCCL communicators and its calls take tensors in that GPU's memory.
    stream: its calls' CUDA stream when their tensors name none (a torch.cuda.Stream or a
    cudaStream_t as an int; None: the legacy default stream); a call on torch CUDA tensors runs
    on torch's current stream instead.

    Collective over comm. A bad option raises InvalidArgumentError naming it on every rank of
    comm. Attributes: rank, size (in comm), cp_rank, cp_size, tp_rank, tp_size, ulysses, threads,
    check_finite, device ("cpu", "cuda:N"), stream (an int; 0: the legacy default), comm.
    dattn.finalize() releases every Runtime."""

    def __init__(self, tp=1, ulysses=1, threads=None, check_finite=False, timeout_s=None,
                 comm=None, device=None, stream=None):
        self._c = _C.Runtime(_comm_address(comm), tp, ulysses, threads, check_finite, timeout_s,
                             _device_name(device), _stream_value(stream))
        self.comm = comm

    @classmethod
    def _wrap(cls, handle, comm=None):
        rt = cls.__new__(cls)
        rt._c, rt.comm = handle, comm
        return rt

    rank = property(lambda self: self._c.rank)
    size = property(lambda self: self._c.size)
    cp_rank = property(lambda self: self._c.cp_rank)
    cp_size = property(lambda self: self._c.cp_size)
    tp_rank = property(lambda self: self._c.tp_rank)
    tp_size = property(lambda self: self._c.tp_size)
    ulysses = property(lambda self: self._c.ulysses)
    threads = property(lambda self: self._c.threads)
    check_finite = property(lambda self: self._c.check_finite)
    device = property(lambda self: self._c.device)
    stream = property(lambda self: self._c.stream)

    def __repr__(self):
        return (f"dattn.Runtime(rank {self.rank} of {self.size}: cp {self.cp_rank} of "
                f"{self.cp_size}, tp {self.tp_rank} of {self.tp_size}, ulysses {self.ulysses}, "
                f"threads {self.threads}, check_finite {self.check_finite}, "
                f"device {self.device})")


def _device_name(device):
    """Runtime's device= as the extension takes it: "cpu", "cuda" or "cuda:N"; what is none of
    these goes as it is written, for the extension to reject on every rank."""
    if device is None:
        return "cpu"
    if isinstance(device, int) and not isinstance(device, bool):
        return f"cuda:{device}"
    return str(device)  # a str, or a torch.device ("cuda:1", "cuda", "cpu")


def _stream_value(stream):
    """Runtime's stream= as an integer handle (a torch.cuda.Stream's cuda_stream), or None."""
    return getattr(stream, "cuda_stream", stream)


def from_comm(comm, **options):
    """A dattn.Runtime over an mpi4py communicator (mpi4py.MPI.Comm), for programs that already
    use mpi4py: Runtime(comm=comm, **options). Collective over comm; the runtime works on its
    own duplicate of comm. MPI.COMM_NULL (a rank outside a split's groups, or a freed
    communicator) raises InvalidArgumentError naming comm."""
    return Runtime(comm=comm, **options)


def default_runtime():
    """The module's default Runtime over MPI_COMM_WORLD (cp = every rank, default options), the
    one calls without runtime= use. Its Ulysses degree follows the last attention call with
    strategy "hybrid" and ulysses_degree. Collective the first time."""
    return Runtime._wrap(_C.default_runtime())


def _handle(runtime):
    """The extension's handle of runtime= (None: the default runtime)."""
    if runtime is None:
        return None
    if not isinstance(runtime, Runtime):
        raise InvalidArgumentError(f"invalid runtime = {runtime!r}: expected a dattn.Runtime "
                                   "(or None: the default runtime)")
    return runtime._c


# ---------------------------------------------------------------- autograd

class _Call:
    """One configured attention call (distributed or local): forward and backward on torch
    tensors. runtime: the extension's handle for a distributed call (None: the default runtime,
    and what a local call takes)."""

    def __init__(self, forward, backward, options, runtime=None):
        self.forward_fn, self.backward_fn, self.options = forward, backward, options
        self.extra = () if runtime is None else (runtime,)

    def forward(self, q, k, v):
        out, lse = self.forward_fn(_as_array(q, "q"), _as_array(k, "k"), _as_array(v, "v"),
                                   self.options, *self.extra, stream=_stream_of(q))
        return _tensor(out), _tensor(lse)

    def backward(self, q, k, v, out, lse, dout):
        """dq, dk, dv, and dsinks (float32 [heads_q]) with sinks, else None."""
        grads = self.backward_fn(_as_array(q, "q"), _as_array(k, "k"), _as_array(v, "v"),
                                 _as_array(out, "out"), _as_array(lse, "lse"),
                                 _as_array(dout, "dout"), self.options, *self.extra,
                                 stream=_stream_of(q))
        return tuple(_tensor(g) for g in grads) + (None,) * (4 - len(grads))


if torch is not None:
    class _AttentionFunction(torch.autograd.Function):
        """out, lse = attention(q, k, v) (with the call's sinks, whose values came from the
        tensor `sinks`, or None); backward gives dq, dk, dv (in the inputs' dtypes) and d sinks.
        lse is not differentiable. Under MPI every rank must call backward, as the forward."""

        @staticmethod
        def forward(ctx, q, k, v, sinks, call):
            out, lse = call.forward(q, k, v)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.call = call
            ctx.sinks_like = sinks
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, dlse):
            q, k, v, out, lse = ctx.saved_tensors
            if dout is None:
                dout = torch.zeros_like(out)
            dq, dk, dv, dsinks = ctx.call.backward(q, k, v, out, lse, dout)
            s = ctx.sinks_like
            if dsinks is not None and s is not None:
                dsinks = dsinks.to(s.dtype).to(s.device)
            else:
                dsinks = None
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None


def _run(call, q, k, v, return_lse, sinks=None):
    if _is_torch(q) or _is_torch(k) or _is_torch(v):
        if not (_is_torch(q) and _is_torch(k) and _is_torch(v)):
            raise InvalidArgumentError(
                "invalid q, k, v: expected all torch tensors or all numpy arrays")
        s = sinks if _is_torch(sinks) else None
        needs_grad = q.requires_grad or k.requires_grad or v.requires_grad
        if torch.is_grad_enabled() and (needs_grad or (s is not None and s.requires_grad)):
            out, lse = _AttentionFunction.apply(q, k, v, s, call)
        else:
            out, lse = call.forward(q, k, v)
    else:
        out, lse = _result(call.forward_fn(_as_array(q, "q"), _as_array(k, "k"),
                                           _as_array(v, "v"), call.options, *call.extra,
                                           stream=_stream_of(q)), False)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------- attention

def attention(q, k, v, causal=False, softmax_scale=None, layout="contiguous", strategy="ring",
              window=None, cu_seqlens=None, return_lse=False, ulysses_degree=None,
              stripe_block=1, runtime=None, sinks=None, softcap=None, slices=None):
    """Distributed attention of this rank's shards q [B, S_r, H, D], k and v [B, S_r, H_kv, D(v)]
    under `layout` ("contiguous", "zigzag", "striped" with `stripe_block`, "varlen" with
    `cu_seqlens`). The global sequence is the sum of the ranks' shard lengths. Collective over
    the runtime's cp group: every rank calls it with the same arguments.

    Mask: causal; window=w (the w keys before each query, with causal) or (left, right);
    cu_seqlens=[0, e1, ..., S] (documents: a token sees its own document, causally when causal).
    strategy: "ring", "ulysses" (H_kv divisible by the ranks) or "hybrid" (Ulysses groups of
    `ulysses_degree` ranks, ring across them; with runtime=, the runtime's ulysses). Returns out
    [B, S_r, H, Dv] float32 and, with return_lse, lse [B, H, S_r] (natural log). Torch inputs
    that require grad get gradients through the distributed backward. A non-contiguous input is
    copied.

    sinks: attention sinks (gpt-oss), one learned logit per query head ([H] torch tensor, numpy
    array or list), each joining its rows' softmax as a key with no value; lse counts them (a
    row that sees no key: out 0, lse the sink). A torch sinks tensor that requires grad gets its
    gradient (summed over every rank's rows). softcap: the logit softcap (Gemma 2): each scaled
    score s becomes softcap * tanh(s / softcap) before the mask and softmax (None or 0: off).
    slices: a slice mask (MagiAttention's AttnSlice) instead of causal/window/cu_seqlens: a list
    of (q_begin, q_end, k_begin, k_end, kind) rectangles of global positions that do not
    overlap, kind "full", "causal" (bottom-right aligned: the last query sees every key),
    "inv_causal" (top-left aligned) or "bi_causal" (both); a pair in no slice is hidden.

    Calls with sinks, a softcap or slices go through a torch.autograd.Function, not the
    torch.library operator (torch.compile breaks the graph there)."""
    if (runtime is None and sinks is None and not softcap and slices is None
            and _torch_ops.applies(q, k, v)):
        return _torch_ops.attention(False, q, k, v, return_lse, causal, softmax_scale, window,
                                    cu_seqlens, layout, strategy, ulysses_degree, stripe_block)
    options = _options(causal, softmax_scale, window, cu_seqlens, layout, strategy,
                       ulysses_degree, stripe_block, runtime, sinks, softcap, slices)
    call = _Call(_C.attention_forward, _C.attention_backward, options, _handle(runtime))
    return _run(call, q, k, v, return_lse, sinks)


def attention_backward(q, k, v, out, lse, dout, causal=False, softmax_scale=None,
                       layout="contiguous", strategy="ring", window=None, cu_seqlens=None,
                       ulysses_degree=None, stripe_block=1, runtime=None, sinks=None,
                       softcap=None, slices=None):
    """The distributed backward without autograd: dq, dk, dv (float32, the shapes of q, k, v) for
    the attention call with these arguments that returned out and lse, and dout, the gradient of
    out; with sinks, dsinks [H] float32 after them (summed over every rank's rows). Collective,
    like attention()."""
    options = _options(causal, softmax_scale, window, cu_seqlens, layout, strategy,
                       ulysses_degree, stripe_block, runtime, sinks, softcap, slices)
    like_torch = _is_torch(q)
    res = _C.attention_backward(_as_array(q, "q"), _as_array(k, "k"), _as_array(v, "v"),
                                _as_array(out, "out"), _as_array(lse, "lse"),
                                _as_array(dout, "dout"), options, _handle(runtime),
                                stream=_stream_of(q))
    return _result(res, like_torch)


def attention_local(q, k, v, causal=False, softmax_scale=None, window=None, cu_seqlens=None,
                    return_lse=False, sinks=None, softcap=None, slices=None):
    """Attention of this process alone over whole tensors (no communication, the same kernels):
    the single-process counterpart of attention(), with autograd for torch tensors (and sinks,
    and softcap and slices, as attention's; slices in positions from 0 on both sides)."""
    if sinks is None and not softcap and slices is None and _torch_ops.applies(q, k, v):
        return _torch_ops.attention(True, q, k, v, return_lse, causal, softmax_scale, window,
                                    cu_seqlens)
    options = _options(causal, softmax_scale, window, cu_seqlens, sinks=sinks, softcap=softcap,
                       slices=slices)
    call = _Call(_C.attention_local_forward, _C.attention_local_backward, options)
    return _run(call, q, k, v, return_lse, sinks)


def attention_local_backward(q, k, v, out, lse, dout, causal=False, softmax_scale=None,
                             window=None, cu_seqlens=None, sinks=None, softcap=None,
                             slices=None):
    """The backward of attention_local without autograd: dq, dk, dv (float32), and dsinks with
    sinks."""
    options = _options(causal, softmax_scale, window, cu_seqlens, sinks=sinks, softcap=softcap,
                       slices=slices)
    like_torch = _is_torch(q)
    res = _C.attention_local_backward(_as_array(q, "q"), _as_array(k, "k"), _as_array(v, "v"),
                                      _as_array(out, "out"), _as_array(lse, "lse"),
                                      _as_array(dout, "dout"), options, stream=_stream_of(q))
    return _result(res, like_torch)


# ---------------------------------------------------------------- KV cache and decode

_DTYPES = {"float32": "fp32", "fp32": "fp32", "float": "fp32", "float16": "fp16", "fp16": "fp16",
           "half": "fp16", "bfloat16": "bf16", "bf16": "bf16"}


def _dtype_code(dtype):
    """"fp32", "fp16" or "bf16" for a dtype given as a name, a numpy dtype or a torch dtype; else
    a description for the extension to reject."""
    if torch is not None and isinstance(dtype, torch.dtype):
        name = str(dtype).replace("torch.", "")
    elif isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = repr(dtype)
    return _DTYPES.get(name, repr(name))


_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


class KvCache:
    """The KV cache of decoding, sharded over the ranks of the runtime's cp group
    (dattn::KvCache): this rank holds room for `capacity` tokens, K [batch, capacity, heads_kv,
    head_dim] and V [batch, capacity, heads_kv, head_dim_v] of `dtype` ("float32", "float16",
    "bfloat16", or a numpy/torch dtype), for queries of heads_q heads (a multiple of heads_kv:
    GQA/MQA).

    prefill() stores each rank's shard of the prompt (its tokens under a layout); append() adds
    new tokens, which `placement` spreads over the ranks: "round_robin" (token t of the appended
    ones on rank t % P) or "last_rank" (all on the last, as star_decode needs). positions()
    says which global positions this rank's rows hold. The mask (causal by default, window=,
    softmax_scale) is the decode's: a query at position p sees the tokens the mask lets it;
    sinks (heads_q logits, as attention's) join each decode step's merged result once; softcap
    caps the scores as attention's.

    Collective, like prefill() and append(): every rank of the cp group makes the same calls
    (a bad argument raises on every rank). Attributes: length (tokens in the whole context),
    local_len (on this rank), capacity, batch, dtype, placement, heads_q, heads_kv, head_dim,
    head_dim_v, runtime."""

    def __init__(self, heads_q, heads_kv, head_dim, batch, dtype, capacity,
                 placement="round_robin", head_dim_v=None, causal=True, window=None,
                 softmax_scale=None, runtime=None, sinks=None, softcap=None):
        options = _sinks(_scale(_mask({}, causal, window), softmax_scale), sinks, softcap)
        self._c = _C.KvCache(heads_q, heads_kv, head_dim, head_dim_v, batch, _dtype_code(dtype),
                             capacity, str(placement), options, _handle(runtime))
        self.runtime = runtime if runtime is not None else default_runtime()

    def prefill(self, k, v, layout="contiguous", stripe_block=1, cu_seqlens=None, block=None):
        """Stores this rank's shard of the prompt, k [B, n, H_kv, D] and v [B, n, H_kv, Dv] (the
        cache's dtype), where n is this rank's share under `layout` (as attention's;
        "blocks" with `block` tokens per block is star attention's) of the prompt, whose length
        is the sum of the ranks' n. Once, on an empty cache. Collective. Copies the rows into the
        cache; k and v must be C-contiguous."""
        options = _layout({}, layout, stripe_block, cu_seqlens, block)
        self._c.prefill(_view(k, "k"), _view(v, "v"), options, stream=_stream_of(k))

    def append(self, k, v):
        """Appends n tokens at global positions length .. length + n - 1: k [B, n, H_kv, D] and
        v [B, n, H_kv, Dv] (the cache's dtype, C-contiguous), the same on every rank; each rank
        keeps the tokens the placement gives it (with "last_rank" the others may pass any
        tensors of that shape). Raises InvalidArgumentError naming the capacity on every rank,
        storing nothing, when any rank's share does not fit. Collective."""
        self._c.append(_view(k, "k"), _view(v, "v"), stream=_stream_of(k))

    def positions(self):
        """The global positions (int64 numpy array) of this rank's cache rows, in row order."""
        return _array(self._c.positions())

    length = property(lambda self: self._c.length)
    local_len = property(lambda self: self._c.local_len)
    capacity = property(lambda self: self._c.capacity)
    batch = property(lambda self: self._c.batch)
    dtype = property(lambda self: _DTYPE_NAMES[self._c.dtype])
    placement = property(lambda self: self._c.placement)
    heads_q = property(lambda self: self._c.heads_q)
    heads_kv = property(lambda self: self._c.heads_kv)
    head_dim = property(lambda self: self._c.head_dim)
    head_dim_v = property(lambda self: self._c.head_dim_v)

    def __repr__(self):
        return (f"dattn.KvCache({self.length} tokens, {self.local_len} of them here, capacity "
                f"{self.capacity}, {self.dtype}, {self.placement})")


def _cache_handle(cache):
    if not isinstance(cache, KvCache):
        raise InvalidArgumentError(f"invalid cache = {cache!r}: expected a dattn.KvCache")
    return cache._c


def decode(q, cache, strategy="tree", return_lse=False, runtime=None):
    """One decode step (dattn::decode): q [B, S_q, H_q, D] (the cache's dtype, C-contiguous), the
    same on every rank, at global positions cache.length - S_q .. cache.length - 1 (append the
    new tokens' K/V first, so that they see themselves), against the whole sharded cache.
    strategy: "tree" (every rank's partial against its shard, combined by two fixed-size
    allreduces; two-level across nodes), "ring" (K/V shards rotate) or "allgather" (every rank
    gathers the whole cache). Collective over the cache's runtime (or `runtime`). Every rank
    returns the same whole result: out [B, S_q, H_q, Dv] float32 and, with return_lse,
    lse [B, H_q, S_q]."""
    res = _C.decode(_view(q, "q"), _cache_handle(cache), str(strategy), _handle(runtime),
                    stream=_stream_of(q))
    return _out(res, _is_torch(q), return_lse)


# ---------------------------------------------------------------- star attention

def star_prefill(q, k, v, block, anchor=None, causal=True, softmax_scale=None, window=None,
                 return_lse=False, runtime=None, sinks=None, softcap=None):
    """Star attention's phase 1 (dattn::star_prefill): the context cut into blocks of `block`
    tokens, each attending to itself (causally by default) behind the anchor, the context's
    first `anchor` tokens (None: `block`; 0: no anchor); block 0 attends to itself alone. q, k,
    v are this rank's shard under the "blocks" layout (layout_positions("blocks", S,
    block=block)): whole blocks, placed contiguously, of a context whose length is the sum of
    the ranks' shard lengths. An approximation with several ranks (a block does not see the
    middle of the context before it); exact causal attention when one block holds the whole
    context. Collective: one broadcast of the anchor's K/V. Returns this rank's out
    [B, S_r, H, Dv] float32 (and lse [B, H, S_r] with return_lse). Inputs must be
    C-contiguous. sinks and softcap: as attention's (no gradient here)."""
    options = _sinks(_scale(_mask({}, causal, window), softmax_scale), sinks, softcap)
    res = _C.star_prefill(_view(q, "q"), _view(k, "k"), _view(v, "v"), options, block, anchor,
                          _handle(runtime), stream=_stream_of(q))
    return _out(res, _is_torch(q), return_lse)


def star_decode(q, cache, return_lse=False, runtime=None):
    """Star attention's phase 2, one step (dattn::star_decode): the query tokens q
    [B, S_q, H_q, D] at global positions cache.length - S_q .. attend to every rank's cache.
    cache: placement "last_rank", prefilled from phase 1's K/V shards (layout "blocks", the same
    block) and the query tokens' K/V appended. q is read on the query rank (the last cp rank)
    only; the others pass any tensor of that shape. Collective. Returns out [B, S_q, H_q, Dv]
    float32 (and lse) on the query rank, exact over the cache; None on the other ranks."""
    res = _C.star_decode(_view(q, "q"), _cache_handle(cache), _handle(runtime),
                         stream=_stream_of(q))
    if res is None:
        return (None, None) if return_lse else None
    return _out(res, _is_torch(q), return_lse)


# ---------------------------------------------------------------- MLA

def mla_decode(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, method="head_split", transform=None,
               calibration=None, rope="replicated", scale_logits_by_g=False, q_pos0=None,
               causal=True, window=None, softmax_scale=None, runtime=None):
    """One decode step of multi-head latent attention (dattn::mla_decode) over the G ranks of the
    runtime's cp group. All tensors float32 and C-contiguous, the same on every rank: the queries
    q_nope [B, S_q, H, qk_nope] and q_pe [B, S_q, H, d_r] at global positions q_pos0 .. (None:
    the cache's last S_q tokens), the latent cache c_kv [B, S, d_c] and k_pe [B, S, d_r] at
    positions 0 .. S-1, the up-projections w_uk [H, qk_nope, d_c] and w_uv [H, v_head, d_c].

    method: "head_split" (rank g computes H/G heads against the whole cache, then an allgather;
    exact MLA) or "tpla" (each rank attends a 1/G slice of the latent, with its own softmax, and
    the outputs are summed: an approximation of MLA, exact for G = 1). rope ("replicated" or
    "split": each rank d_r/G of it) and scale_logits_by_g (multiply a slice's logits by G) are
    TPLA's options. transform: None, "hadamard" (d_c a power of two) or "pca" (the eigenvectors
    of the covariance of `calibration` latents [N, d_c], default the cache's own): an orthogonal
    R folded into the weights (W R^T) and applied to the cache (R c), which leaves MLA unchanged
    and brings TPLA closer to it. Mask: causal (default) or window=; softmax_scale (None:
    1/sqrt(qk_nope + d_r)).

    Collective. Returns out [B, S_q, H, v_head] float32 on every rank. The cache is read in place
    for head_split without a transform; TPLA copies this rank's columns of it, and a transform
    copies the weights and the cache (per call: hold transformed tensors yourself to decode many
    steps)."""
    options = _scale(_mask({}, causal, window), softmax_scale)
    mla = {"method": str(method), "transform": "none" if transform is None else str(transform),
           "rope": str(rope), "scale_logits_by_g": scale_logits_by_g, "q_pos0": q_pos0}
    cal = None if calibration is None else _view(calibration, "calibration")
    res = _C.mla_decode(_view(q_nope, "q_nope"), _view(q_pe, "q_pe"), _view(c_kv, "c_kv"),
                        _view(k_pe, "k_pe"), _view(w_uk, "w_uk"), _view(w_uv, "w_uv"), cal, mla,
                        options, _handle(runtime), stream=_stream_of(q_nope))
    return _tensor(res) if _is_torch(q_nope) else _array(res)


# ---------------------------------------------------------------- layouts and helpers

def layout_positions(kind, global_seq, rank=None, world=None, stripe_block=1, cu_seqlens=None,
                     block=None, runtime=None):
    """The global positions (int64 numpy array, in local order) of the tokens `rank` of `world`
    ranks holds under a layout: contiguous, zigzag, striped (blocks of stripe_block tokens),
    varlen (cu_seqlens; global_seq must be cu_seqlens[-1]) or blocks (whole blocks of `block`
    tokens, contiguously: star attention's). rank and world default to this rank's cp rank and
    the cp size of `runtime` (None: of the default runtime, i.e. every rank). Shard a global
    tensor x [B, S, ...] with x[:, layout_positions(...)]. Not collective."""
    cu = [] if cu_seqlens is None else [int(c) for c in np.asarray(cu_seqlens).reshape(-1)]
    if rank is None or world is None:
        if runtime is None:
            here, ranks = _C.rank(), _C.world_size()
        else:
            here, ranks = runtime.cp_rank, runtime.cp_size
        rank = here if rank is None else rank
        world = ranks if world is None else world
    return _array(_C.layout_positions(str(kind), int(global_seq), int(rank), int(world),
                                      int(stripe_block), cu, 0 if block is None else int(block)))


def allreduce_sum(x):
    """The sum of x over every rank (collective), computed in float64: a number gives a float, a
    numpy array an array of its dtype, a torch tensor a detached tensor of its dtype."""
    if _is_torch(x):
        a = np.ascontiguousarray(x.detach().cpu().to(torch.float64).numpy()).copy()
        _C.allreduce_sum(a)
        return torch.from_numpy(a).to(x.dtype)
    if isinstance(x, np.ndarray):
        a = np.ascontiguousarray(x, dtype=np.float64).copy()
        _C.allreduce_sum(a)
        return a.astype(x.dtype) if np.issubdtype(x.dtype, np.floating) else a
    a = np.array([float(x)], dtype=np.float64)
    _C.allreduce_sum(a)
    return float(a[0])


# torch custom operators (torch >= 2.4) behind attention() and attention_local(); last, as
# torch_ops uses the conversions above.
from . import torch_ops as _torch_ops  # noqa: E402
