"""dattn: distributed attention over MPI ranks, from Python.

Run under MPI (``mpirun -n 4 python3 train.py``); each process passes its own shard of the
sequence. Importing dattn initialises MPI (MPI_THREAD_FUNNELED) unless the program already did,
and finalises it at exit.

    import dattn
    pos = dattn.layout_positions("zigzag", S)        # the global tokens this rank holds
    out = dattn.attention(q[:, pos], k[:, pos], v[:, pos], causal=True, layout="zigzag")
    out.sum().backward()                              # torch tensors: q.grad, k.grad, v.grad

Tensors are bshd ([batch, seq, heads, head_dim]) numpy arrays (float32, float16) or CPU torch
tensors (float32, bfloat16, float16). Results are float32, numpy for numpy inputs and torch for
torch inputs.

Errors raise a subclass of dattn.Error with the library's message (it names the parameter and the
rank) and its kind as e.kind; each also derives from the builtin a caller expects:
InvalidArgumentError (ValueError), OutOfMemoryError (MemoryError), TimeoutError (TimeoutError),
MPIError, CUDAError, NCCLError and InternalError (RuntimeError). A bad tensor on one rank raises
the same class on every rank.
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
    "layout_positions", "rank", "world_size", "allreduce_sum", "barrier", "abort", "finalize",
    "Error", "InvalidArgumentError", "OutOfMemoryError", "MPIError", "CUDAError", "NCCLError",
    "InternalError",
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



# ---------------------------------------------------------------- arrays in and out

def _is_torch(x):
    return torch is not None and isinstance(x, torch.Tensor)


def _as_array(x, name):
    """(array, dtype name) for the extension: a C-contiguous numpy view of x (no copy where x
    already is one); bfloat16 goes as its 16-bit patterns. What dattn cannot take goes as an empty
    array with a description instead, for the extension to reject on every rank at once."""
    if _is_torch(x):
        if x.device.type != "cpu":
            return (_NOTHING, f"a tensor on {x.device} (expected cpu)")
        x = x.detach().contiguous()
        if x.dtype == torch.float32:
            return (x.numpy(), "fp32")
        if x.dtype == torch.bfloat16:
            return (x.view(torch.int16).numpy(), "bf16")
        if x.dtype == torch.float16:
            return (x.numpy(), "fp16")
        return (_NOTHING, f"dtype {x.dtype}")
    a = np.asarray(x)
    if a.dtype == np.float32:
        return (np.ascontiguousarray(a), "fp32")
    if a.dtype == np.float16:
        return (np.ascontiguousarray(a), "fp16")
    return (_NOTHING, f"dtype {a.dtype} (convert with .astype(np.float32))")


_NOTHING = np.zeros((0, 0, 0, 0), dtype=np.float32)


def _options(causal, softmax_scale, window, cu_seqlens, layout="contiguous", strategy="ring",
             ulysses_degree=None, stripe_block=1):
    """The options dict the extension takes: the mask as window sizes and document boundaries."""
    o = {"causal": bool(causal), "layout": str(layout), "strategy": str(strategy),
         "stripe_block": int(stripe_block)}
    if softmax_scale is not None:
        if not softmax_scale > 0:
            raise InvalidArgumentError(
                f"invalid softmax_scale = {softmax_scale}: expected > 0 (or None)")
        o["softmax_scale"] = float(softmax_scale)
    if window is not None:
        # window=w: the w keys before each query and the query (causal sliding window);
        # window=(left, right): keys from q - left to q + right. -1 on a side: no limit.
        left, right = (window, 0) if np.ndim(window) == 0 else tuple(window)
        left, right = int(left), int(right)
        if causal and right != 0:
            raise InvalidArgumentError(
                f"invalid window = {window}: causal=True needs a right window of 0")
        o["window_left"], o["window_right"] = left, right
    if cu_seqlens is not None:
        o["cu_seqlens"] = [int(c) for c in np.asarray(cu_seqlens).reshape(-1)]
    if layout == "varlen" and cu_seqlens is None:
        raise InvalidArgumentError("invalid cu_seqlens = None: expected document boundaries "
                                   "[0, e1, ..., S] for layout 'varlen'")
    if strategy == "hybrid":
        if ulysses_degree is None:
            raise InvalidArgumentError("invalid ulysses_degree = None: expected the Ulysses "
                                       "group size (a divisor of the ranks) for strategy 'hybrid'")
        o["ulysses_degree"] = int(ulysses_degree)
    return o


def _array(buffer):
    """A numpy array over a result's storage (the extension's Buffer), without a copy."""
    return np.asarray(buffer)


def _tensor(buffer):
    """A torch tensor over a result's storage, without a copy."""
    return torch.from_numpy(np.asarray(buffer))


def _result(buffers, like_torch):
    return tuple(_tensor(b) if like_torch else _array(b) for b in buffers)


# ---------------------------------------------------------------- autograd

class _Call:
    """One configured attention call (distributed or local): forward and backward on torch
    tensors."""

    def __init__(self, forward, backward, options):
        self.forward_fn, self.backward_fn, self.options = forward, backward, options

    def forward(self, q, k, v):
        out, lse = self.forward_fn(_as_array(q, "q"), _as_array(k, "k"), _as_array(v, "v"),
                                   self.options)
        return _tensor(out), _tensor(lse)

    def backward(self, q, k, v, out, lse, dout):
        dq, dk, dv = self.backward_fn(_as_array(q, "q"), _as_array(k, "k"), _as_array(v, "v"),
                                      _as_array(out, "out"), _as_array(lse, "lse"),
                                      _as_array(dout, "dout"), self.options)
        return _tensor(dq), _tensor(dk), _tensor(dv)


if torch is not None:
    class _AttentionFunction(torch.autograd.Function):
        """out, lse = attention(q, k, v); backward gives dq, dk, dv (in the inputs' dtypes).
        lse is not differentiable. Under MPI every rank must call backward, as the forward."""

        @staticmethod
        def forward(ctx, q, k, v, call):
            out, lse = call.forward(q, k, v)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.call = call
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, dlse):
            q, k, v, out, lse = ctx.saved_tensors
            if dout is None:
                dout = torch.zeros_like(out)
            dq, dk, dv = ctx.call.backward(q, k, v, out, lse, dout)
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _run(forward, backward, q, k, v, options, return_lse):
    if _is_torch(q) or _is_torch(k) or _is_torch(v):
        if not (_is_torch(q) and _is_torch(k) and _is_torch(v)):
            raise InvalidArgumentError(
                "invalid q, k, v: expected all torch tensors or all numpy arrays")
        call = _Call(forward, backward, options)
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            out, lse = _AttentionFunction.apply(q, k, v, call)
        else:
            out, lse = call.forward(q, k, v)
    else:
        out, lse = _result(forward(_as_array(q, "q"), _as_array(k, "k"), _as_array(v, "v"),
                                   options), False)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------- the API

def attention(q, k, v, causal=False, softmax_scale=None, layout="contiguous", strategy="ring",
              window=None, cu_seqlens=None, return_lse=False, ulysses_degree=None,
              stripe_block=1):
    """Distributed attention of this rank's shards q [B, S_r, H, D], k and v [B, S_r, H_kv, D(v)]
    under `layout` ("contiguous", "zigzag", "striped" with `stripe_block`, "varlen" with
    `cu_seqlens`). The global sequence is the sum of the ranks' shard lengths. Collective: every
    rank calls it with the same arguments.

    Mask: causal; window=w (the w keys before each query, with causal) or (left, right);
    cu_seqlens=[0, e1, ..., S] (documents: a token sees its own document, causally when causal).
    strategy: "ring", "ulysses" (H_kv divisible by the ranks) or "hybrid" (Ulysses groups of
    `ulysses_degree` ranks, ring across them). Returns out [B, S_r, H, Dv] float32 and, with
    return_lse, lse [B, H, S_r] (natural log). Torch inputs that require grad get gradients
    through the distributed backward."""
    if _torch_ops.applies(q, k, v):
        return _torch_ops.attention(False, q, k, v, return_lse, causal, softmax_scale, window,
                                    cu_seqlens, layout, strategy, ulysses_degree, stripe_block)
    options = _options(causal, softmax_scale, window, cu_seqlens, layout, strategy,
                       ulysses_degree, stripe_block)
    return _run(_C.attention_forward, _C.attention_backward, q, k, v, options, return_lse)


def attention_backward(q, k, v, out, lse, dout, causal=False, softmax_scale=None,
                       layout="contiguous", strategy="ring", window=None, cu_seqlens=None,
                       ulysses_degree=None, stripe_block=1):
    """The distributed backward without autograd: dq, dk, dv (float32, the shapes of q, k, v) for
    the attention call with these arguments that returned out and lse, and dout, the gradient of
    out. Collective, like attention()."""
    options = _options(causal, softmax_scale, window, cu_seqlens, layout, strategy,
                       ulysses_degree, stripe_block)
    like_torch = _is_torch(q)
    res = _C.attention_backward(_as_array(q, "q"), _as_array(k, "k"), _as_array(v, "v"),
                                _as_array(out, "out"), _as_array(lse, "lse"),
                                _as_array(dout, "dout"), options)
    return _result(res, like_torch)


def attention_local(q, k, v, causal=False, softmax_scale=None, window=None, cu_seqlens=None,
                    return_lse=False):
    """Attention of this process alone over whole tensors (no communication, the same kernels):
    the single-process counterpart of attention(), with autograd for torch tensors."""
    if _torch_ops.applies(q, k, v):
        return _torch_ops.attention(True, q, k, v, return_lse, causal, softmax_scale, window,
                                    cu_seqlens)
    options = _options(causal, softmax_scale, window, cu_seqlens)
    return _run(_C.attention_local_forward, _C.attention_local_backward, q, k, v, options,
                return_lse)


def attention_local_backward(q, k, v, out, lse, dout, causal=False, softmax_scale=None,
                             window=None, cu_seqlens=None):
    """The backward of attention_local without autograd: dq, dk, dv (float32)."""
    options = _options(causal, softmax_scale, window, cu_seqlens)
    like_torch = _is_torch(q)
    res = _C.attention_local_backward(_as_array(q, "q"), _as_array(k, "k"), _as_array(v, "v"),
                                      _as_array(out, "out"), _as_array(lse, "lse"),
                                      _as_array(dout, "dout"), options)
    return _result(res, like_torch)


def layout_positions(kind, global_seq, rank=None, world=None, stripe_block=1, cu_seqlens=None):
    """The global positions (int64 numpy array, in local order) of the tokens `rank` (default:
    this rank) of `world` ranks (default: all) holds under a layout: contiguous, zigzag, striped
    (blocks of stripe_block tokens) or varlen (cu_seqlens; global_seq must be cu_seqlens[-1]).
    Shard a global tensor x [B, S, ...] with x[:, layout_positions(...)]."""
    cu = [] if cu_seqlens is None else [int(c) for c in np.asarray(cu_seqlens).reshape(-1)]
    return _array(_C.layout_positions(str(kind), int(global_seq),
                                      _C.rank() if rank is None else int(rank),
                                      _C.world_size() if world is None else int(world),
                                      int(stripe_block), cu))


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
