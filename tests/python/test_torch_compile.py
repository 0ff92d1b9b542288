#!/usr/bin/env python3
"""dattn's torch custom operators (python/dattn/torch_ops.py) under mpiexec (1-2 ranks): a tiny
attention module calling dattn.attention compiles with torch.compile(fullgraph=True) into one
graph (inductor), and its out and gradients equal the eager call's and a float64 single-process
reference; the options (window, striped layout, softmax_scale, cu_seqlens, return_lse,
attention_local) travel as operator arguments through a compiled graph; torch.library.opcheck
passes on the four operators.

Every rank builds the same weights and data from fixed seeds and takes its zigzag shard. A failure
on any rank prints the reason and aborts the job (no rank hangs). Exits 77 (skipped) when torch
is missing or older than 2.4 (no torch.library.custom_op; dattn then keeps its
torch.autograd.Function, which tests/python/test_gradients.py covers).
  PYTHONPATH=build/python bash launch/mpirun.sh -n 2 /work/venv/bin/python \\
      tests/python/test_torch_compile.py
TORCHINDUCTOR_CACHE_DIR (ctest sets ~/.cache/dattn/torchinductor) keeps inductor's compiled
kernels between runs: a first run compiles for about 30 s, later ones take a few seconds.
"""

import os
import sys
import time
import traceback

# One inductor compile thread per rank: a worker pool per rank would oversubscribe the cores and
# takes seconds to start and stop.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

try:
    import torch
except ImportError as e:  # before dattn: MPI is not started yet, so a plain exit is clean
    print(f"test_torch_compile: SKIPPED: {e} (needs torch >= 2.4)")
    sys.exit(77)

import dattn

RANK, P = dattn.rank(), dattn.world_size()

if not dattn.torch_ops.REGISTERED:
    if RANK == 0:
        print(f"test_torch_compile: SKIPPED: torch {torch.__version__} has no "
              "torch.library.custom_op (needs torch >= 2.4); dattn keeps its autograd.Function")
    sys.exit(77)

import torch._dynamo.testing  # noqa: E402 - after the version check

torch.set_num_threads(1)

# Relative to the largest reference value of each result.
TOL_REFERENCE = 2e-5  # fp32 dattn (eager or compiled) vs float64 single process
TOL_COMPILED = 1e-6   # compiled vs eager, both fp32: inductor may fuse the projections


def rel_err(got, ref):
    """max |got - ref| / max |ref|"""
    return float((got.double() - ref.double()).abs().max() / max(ref.abs().max().item(), 1e-30))


def all_max(x):
    """The max of x over the ranks."""
    slots = [0.0] * P
    slots[RANK] = x
    return max(dattn.allreduce_sum(torch.tensor(slots, dtype=torch.float64)).tolist())


# ---------------------------------------------------------------- a tiny module

class TinyAttention(torch.nn.Module):
    """x [B, n, E] -> causal GQA attention over the ranks' zigzag shards -> [B, n, E]."""

    def __init__(self, E, H, Hkv, D, attend):
        super().__init__()
        self.H, self.Hkv, self.D, self.attend = H, Hkv, D, attend
        self.wq = torch.nn.Linear(E, H * D, bias=False)
        self.wk = torch.nn.Linear(E, Hkv * D, bias=False)
        self.wv = torch.nn.Linear(E, Hkv * D, bias=False)
        self.wo = torch.nn.Linear(H * D, E, bias=False)

    def forward(self, x):
        B, n, _ = x.shape
        q = self.wq(x).view(B, n, self.H, self.D)
        k = self.wk(x).view(B, n, self.Hkv, self.D)
        v = self.wv(x).view(B, n, self.Hkv, self.D)
        return self.wo(self.attend(q, k, v).reshape(B, n, self.H * self.D))


def dattn_zigzag(q, k, v):
    return dattn.attention(q, k, v, causal=True, layout="zigzag")


def torch_causal(q, k, v):
    """Plain softmax attention of the whole sequence, GQA by repeating K/V heads."""
    S, D, g = q.shape[1], q.shape[3], q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / D ** 0.5
    s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v)


def run_module(model, call, x, dy):
    """out and the gradients (model's weights, all-reduced, and this rank's x) of
    sum(call(x) * dy), call being the model or its compiled form."""
    x = x.clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    out = call(x)
    (out * dy).sum().backward()
    grads = {name: dattn.allreduce_sum(p.grad) for name, p in model.named_parameters()}
    grads["x"] = x.grad
    return out.detach(), grads


def check_module():
    """Eager, compiled (fullgraph, one graph) and float64 reference of TinyAttention."""
    B, S, E, H, Hkv, D = 2, 50, 32, 4, 2, 16  # S = 50: zigzag shards of unequal length
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, S, E, generator=gen, dtype=torch.float64)
    dy = torch.randn(B, S, E, generator=gen, dtype=torch.float64)
    pos = torch.from_numpy(dattn.layout_positions("zigzag", S))
    xs, dys = x[:, pos].float(), dy[:, pos].float()

    torch.manual_seed(0)
    model = TinyAttention(E, H, Hkv, D, dattn_zigzag)
    ref_model = TinyAttention(E, H, Hkv, D, torch_causal).double()
    ref_model.load_state_dict(model.state_dict())

    out_e, grads_e = run_module(model, model, xs, dys)

    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    t0 = time.time()
    out_c, grads_c = run_module(model, compiled, xs, dys)
    seconds = time.time() - t0
    assert counter.frame_count == 1, f"{counter.frame_count} graphs (expected 1, no graph break)"

    x64 = x.clone().requires_grad_()
    out_r = ref_model(x64)
    (out_r * dy).sum().backward()
    grads_r = {name: p.grad for name, p in ref_model.named_parameters()}
    grads_r["x"] = x64.grad[:, pos]
    out_r = out_r.detach()[:, pos]

    errs = {"compiled vs eager": {"out": rel_err(out_c, out_e)},
            "eager vs float64": {"out": rel_err(out_e, out_r)},
            "compiled vs float64": {"out": rel_err(out_c, out_r)}}
    for name in grads_r:
        errs["compiled vs eager"][name] = rel_err(grads_c[name], grads_e[name])
        errs["eager vs float64"][name] = rel_err(grads_e[name], grads_r[name])
        errs["compiled vs float64"][name] = rel_err(grads_c[name], grads_r[name])
    for what, tol in (("compiled vs eager", TOL_COMPILED), ("eager vs float64", TOL_REFERENCE),
                      ("compiled vs float64", TOL_REFERENCE)):
        worst = {key: all_max(e) for key, e in errs[what].items()}
        if RANK == 0:
            print(f"  {what:20s} (tolerance {tol:.0e}): "
                  + ", ".join(f"{key} {e:.1e}" for key, e in worst.items()))
        bad = {key: e for key, e in worst.items() if not e <= tol}
        assert not bad, f"{what}: relative error above {tol}: {bad}"
    if RANK == 0:
        print(f"  TinyAttention B={B} S={S} E={E} heads={H}/{Hkv} D={D}: one graph "
              f"({counter.op_count} ops), compiled and run in {seconds:.1f} s")


# ---------------------------------------------------------------- options through a graph

def check_options():
    """Other options as operator arguments in a compiled graph: its results are those of the
    same eager calls, bit for bit (aot_eager runs the same operators)."""
    B, S, H, Hkv, D = 1, 40, 4, 2, 16
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, S, h, D, generator=gen) for h in (H, Hkv, Hkv))
    pos = torch.from_numpy(dattn.layout_positions("striped", S, stripe_block=2))
    shards = [t[:, pos].contiguous() for t in (q, k, v)]
    cu = [0, 7, 25, 40]

    def f(q, k, v, qa, ka, va):
        o1, l1 = dattn.attention(q, k, v, window=(5, 2), layout="striped", stripe_block=2,
                                 softmax_scale=0.3, return_lse=True)
        o2, l2 = dattn.attention_local(qa, ka, va, causal=True, cu_seqlens=cu, return_lse=True)
        return (o1 ** 2).sum() + (o2 ** 2).sum(), l1, l2

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in shards + [q, k, v]]
        loss, l1, l2 = fn(*leaves)
        loss.backward()
        return [loss.detach(), l1, l2] + [t.grad for t in leaves]

    eager = run(f)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = run(torch.compile(f, fullgraph=True, backend=counter))
    assert counter.frame_count == 1, f"{counter.frame_count} graphs (expected 1)"
    names = ["loss", "lse", "lse local", "dq", "dk", "dv", "dq local", "dk local", "dv local"]
    for name, a, b in zip(names, eager, compiled):
        assert torch.equal(a, b), f"options graph: {name} differs compiled ({rel_err(b, a):.1e})"
    if RANK == 0:
        print("  window (5, 2), striped block 2, softmax_scale 0.3, attention_local with "
              "cu_seqlens: one graph, bit-identical to eager")


# ---------------------------------------------------------------- opcheck

def check_opcheck():
    """torch.library.opcheck (schema, fake tensors, autograd registration, AOT dispatch) on the
    forward and backward operators, distributed and local, fp32 and bf16."""
    from dattn.torch_ops import op_options

    B, S, H, Hkv, D = 1, 24, 4, 2, 8
    gen = torch.Generator().manual_seed(3)
    full = [torch.randn(B, S, h, D, generator=gen) for h in (H, Hkv, Hkv)]
    pos = torch.from_numpy(dattn.layout_positions("zigzag", S))
    zig = op_options({"causal": True, "layout": "zigzag"})
    loc = op_options({"causal": True, "window_left": 6, "window_right": 0})
    ops = torch.ops.dattn
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        shards = [t[:, pos].to(dtype).contiguous().requires_grad_() for t in full]
        whole = [t.to(dtype).requires_grad_() for t in full]
        cases.append((ops.attention.default, (*shards, *zig)))
        cases.append((ops.attention_local.default, (*whole, *loc)))
        with torch.no_grad():
            out, lse = ops.attention(*shards, *zig)
            outl, lsel = ops.attention_local(*whole, *loc)
        sd = [t.detach() for t in shards]
        wd = [t.detach() for t in whole]
        cases.append((ops.attention_backward.default, (*sd, out, lse, torch.randn_like(out), *zig)))
        cases.append((ops.attention_local_backward.default,
                      (*wd, outl, lsel, torch.randn_like(outl), *loc)))
    for op, args in cases:
        torch.library.opcheck(op, args)
    if RANK == 0:
        print(f"  torch.library.opcheck: {len(cases)} cases passed (4 operators, fp32 and bf16)")


def main():
    t0 = time.time()
    if RANK == 0:
        print(f"test_torch_compile on {P} ranks, torch {torch.__version__}:")
    check_module()
    check_options()
    check_opcheck()
    if RANK == 0:
        print(f"test_torch_compile: all passed on {P} ranks in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # noqa: B902 - any failure on any rank ends the whole job
        sys.stderr.write(f"test_torch_compile: FAILED on rank {RANK} of {P}:\n"
                         f"{traceback.format_exc()}")
        sys.stderr.flush()
        dattn.abort(1)
