"""dattn's attention as torch custom operators, so that torch.compile captures it in a graph.

With torch >= 2.4 importing dattn registers four operators through torch.library:

    torch.ops.dattn.attention(q, k, v, causal, softmax_scale, window_left, window_right,
                              cu_seqlens, layout, strategy, ulysses_degree, stripe_block)
        -> (out [B, S, H, Dv] float32, lse [B, H, S] float32)       distributed over the ranks
    torch.ops.dattn.attention_backward(q, k, v, out, lse, dout, <the same options>)
        -> (dq, dk, dv) float32
    torch.ops.dattn.attention_local(q, k, v, <the same options>)    one process, no ranks
    torch.ops.dattn.attention_local_backward(q, k, v, out, lse, dout, <the same options>)

The options are the extension's, flattened into types a schema holds: softmax_scale 0.0 means
1/sqrt(head_dim), window_left = window_right = -1 no window, cu_seqlens [] one document. Each
operator has a fake implementation (the shapes and dtypes of its results), and each forward an
autograd formula calling its backward operator, so a model calling dattn.attention compiles with
torch.compile(fullgraph=True) without a graph break, and torch.library.opcheck passes.
dattn.attention and dattn.attention_local route torch tensors here when REGISTERED is True; with
an older torch (Debian's 1.13 has no torch.library.custom_op) nothing is registered and they keep
their torch.autograd.Function.

The operators are collectives like dattn.attention: every rank calls them in the same order. A
compiled graph holds them as opaque calls, and every rank compiles the same program, so the ranks
still make the same calls. Under torch.compile the options are checked once, when the graph is
traced: they must be Python values (cu_seqlens a list, not a tensor), and a bad one raises torch's
compile error carrying dattn's message.

    PYTHONPATH=build/python bash launch/mpirun.sh -n 2 /work/venv/bin/python \\
        tests/python/test_torch_compile.py
"""

from typing import List, Tuple

try:
    import torch
except ImportError:  # numpy-only use of dattn
    torch = None

from . import _C


def _torch_at_least(major, minor):
    try:
        parts = torch.__version__.split("+")[0].split(".")
        return (int(parts[0]), int(parts[1])) >= (major, minor)
    except (AttributeError, IndexError, ValueError):
        return False


# custom_op, register_fake and register_autograd all arrived in torch 2.4.
REGISTERED = torch is not None and _torch_at_least(2, 4) and hasattr(torch.library, "custom_op")

# The option names, in the operators' argument order, after the tensors.
OPTION_NAMES = ("causal", "softmax_scale", "window_left", "window_right", "cu_seqlens", "layout",
                "strategy", "ulysses_degree", "stripe_block")


def op_options(options):
    """The operators' option arguments (a tuple in OPTION_NAMES order) from the options dict that
    dattn's _options() builds; what the dict leaves out gets the extension's default."""
    o = options
    return (bool(o.get("causal", False)), float(o.get("softmax_scale", 0.0)),
            int(o.get("window_left", -1)), int(o.get("window_right", -1)),
            [int(c) for c in o.get("cu_seqlens", [])], str(o.get("layout", "contiguous")),
            str(o.get("strategy", "ring")), int(o.get("ulysses_degree", 0)),
            int(o.get("stripe_block", 1)))


def _extension_options(args):
    return dict(zip(OPTION_NAMES, args))


def applies(q, k, v):
    """Whether dattn's call on (q, k, v) goes through the operators: all three are torch tensors
    and this torch registered them (mixed arguments go the other way, which rejects them)."""
    return (REGISTERED and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
            and isinstance(v, torch.Tensor))


def _op_options(*args):
    """op_options of dattn's _options(*args): checked and flattened once per call site under
    torch.compile (marked constant below, so dynamo neither traces its numpy nor breaks the
    graph; the options must then be Python values, not tensors)."""
    from . import _options
    return op_options(_options(*args))


def attention(local, q, k, v, return_lse, *args):
    """dattn.attention (local=False) or dattn.attention_local (local=True) on torch tensors
    through the operator, differentiable in q, k and v; args are _options()'s."""
    op = torch.ops.dattn.attention_local if local else torch.ops.dattn.attention
    out, lse = op(q, k, v, *_op_options(*args))
    return (out, lse) if return_lse else out


if REGISTERED:
    from . import _as_array, _stream_of, _tensor  # noqa: E402 - the package's conversion

    torch.compiler.assume_constant_result(_op_options)

    Tensor = torch.Tensor

    def _define(name, forward_fn, backward_fn):
        """Registers dattn::<name> (out, lse) and dattn::<name>_backward (dq, dk, dv) over the
        extension's forward_fn and backward_fn, with fake implementations and autograd."""

        @torch.library.custom_op(f"dattn::{name}", mutates_args=())
        def forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float,
                    window_left: int, window_right: int, cu_seqlens: List[int], layout: str,
                    strategy: str, ulysses_degree: int, stripe_block: int) -> Tuple[Tensor, Tensor]:
            opts = _extension_options((causal, softmax_scale, window_left, window_right,
                                       cu_seqlens, layout, strategy, ulysses_degree,
                                       stripe_block))
            out, lse = forward_fn(_as_array(q, "q"), _as_array(k, "k"), _as_array(v, "v"), opts,
                                  stream=_stream_of(q))
            return _tensor(out), _tensor(lse)

        @forward.register_fake
        def _(q, k, v, *options):
            B, S, H = q.shape[0], q.shape[1], q.shape[2]
            return (q.new_empty((B, S, H, v.shape[3]), dtype=torch.float32),
                    q.new_empty((B, H, S), dtype=torch.float32))

        @torch.library.custom_op(f"dattn::{name}_backward", mutates_args=())
        def backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
                     causal: bool, softmax_scale: float, window_left: int, window_right: int,
                     cu_seqlens: List[int], layout: str, strategy: str, ulysses_degree: int,
                     stripe_block: int) -> Tuple[Tensor, Tensor, Tensor]:
            opts = _extension_options((causal, softmax_scale, window_left, window_right,
                                       cu_seqlens, layout, strategy, ulysses_degree,
                                       stripe_block))
            grads = backward_fn(_as_array(q, "q"), _as_array(k, "k"), _as_array(v, "v"),
                                _as_array(out, "out"), _as_array(lse, "lse"),
                                _as_array(dout, "dout"), opts, stream=_stream_of(q))
            return tuple(_tensor(g) for g in grads)

        @backward.register_fake
        def _(q, k, v, out, lse, dout, *options):
            return tuple(torch.empty_like(t, dtype=torch.float32,
                                          memory_format=torch.contiguous_format)
                         for t in (q, k, v))

        def setup_context(ctx, inputs, output):
            q, k, v = inputs[:3]
            out, lse = output
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.options = inputs[3:]
            ctx.mark_non_differentiable(lse)

        def autograd_backward(ctx, dout, dlse):
            # lse is not differentiable; a graph that does not use out passes no gradient.
            q, k, v, out, lse = ctx.saved_tensors
            if dout is None:
                dout = torch.zeros_like(out)
            dq, dk, dv = backward(q, k, v, out, lse, dout.contiguous(), *ctx.options)
            return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)) + (None,) * len(ctx.options)

        forward.register_autograd(autograd_backward, setup_context=setup_context)
        return forward, backward

    attention_op, attention_backward_op = _define(
        "attention", _C.attention_forward, _C.attention_backward)
    attention_local_op, attention_local_backward_op = _define(
        "attention_local", _C.attention_local_forward, _C.attention_local_backward)
