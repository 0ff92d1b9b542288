#!/usr/bin/env python3
"""dattn's Python binding under mpiexec (1-4 ranks): out, lse and dq, dk, dv of this rank's shard
against float64 torch autograd of the full sequence, for every strategy x layout x mask with GQA
and head_dim 64/128 (sinks, softcap and slice masks too); bf16 gradient error no worse distributed than in one process; bit-identical
repeated backward calls; errors raised as dattn.InvalidArgumentError (a ValueError) on every
rank, and the classes of the other kinds of error.

Every rank builds the same global tensors from a fixed seed and compares its shard (picked with
dattn.layout_positions). A failure on any rank prints the reason and aborts the job (no rank
hangs). Exits 77 (skipped) when numpy or torch cannot be imported.
  PYTHONPATH=build/python bash launch/mpirun.sh -n 4 /usr/bin/python3 tests/python/test_gradients.py
With --installed, it also checks that dattn was imported from a site-packages (pip install .).
"""

import sys
import time
import traceback

try:
    import numpy as np
    import torch
except ImportError as e:  # before dattn: MPI is not started yet, so a plain exit is clean
    print(f"test_gradients: SKIPPED: {e} (needs numpy and torch, e.g. Debian's /usr/bin/python3)")
    sys.exit(77)

import dattn

RANK, P = dattn.rank(), dattn.world_size()
torch.set_num_threads(1)

# fp32 against float64: errors relative to the largest reference value of each result.
TOL_FP32 = 2e-5


# ---------------------------------------------------------------- the float64 reference

BANDS = {"none": {}, "causal": {"causal": True}, "window": {"window": (9, 3)},
         "document": {"causal": True}}


def visible(S, mask, cu):
    """[S, S] bool: query i sees key j. cu: document boundaries, or None for one document."""
    i = torch.arange(S)[:, None]
    j = torch.arange(S)[None, :]
    vis = torch.ones(S, S, dtype=torch.bool)
    if BANDS[mask].get("causal"):
        vis &= j <= i
    if "window" in BANDS[mask]:
        left, right = BANDS[mask]["window"]
        vis &= (j >= i - left) & (j <= i + right)
    if cu is not None:
        doc = torch.bucketize(torch.arange(S), torch.tensor(cu[1:]), right=True)
        vis &= doc[:, None] == doc[None, :]
    return vis


def reference(q, k, v, vis, scale, sinks=None, softcap=0.0):
    """out [B,S,H,Dv] and lse [B,H,S] of float64 tensors, differentiable by torch autograd. sinks
    [H]: one more logit per row, with no value (it joins the normaliser only); softcap > 0: the
    scores become softcap * tanh(s / softcap)."""
    g = q.shape[2] // k.shape[2]
    kx, vx = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kx) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~vis, float("-inf"))
    if sinks is None:
        lse = torch.logsumexp(s, dim=-1)
    else:
        col = sinks[None, :, None, None].expand(s.shape[0], -1, s.shape[2], 1)
        lse = torch.logsumexp(torch.cat([s, col], dim=-1), dim=-1)
    # A row that sees no key (lse -inf, no sink) gets out 0 and no gradient, as dattn's.
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - finite[..., None]), vx)
    return out, lse


def rel_err(got, ref):
    """max |got - ref| / max |ref|"""
    got, ref = got.detach().double(), ref.detach()
    return float((got - ref).abs().max() / max(ref.abs().max().item(), 1e-30))


def all_max(x):
    """The max of x over the ranks."""
    slots = np.zeros(P)
    slots[RANK] = x
    return float(dattn.allreduce_sum(slots).max())


def make_inputs(seed, B, S, H, Hkv, D):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, h, D, generator=gen, dtype=torch.float64) for h in (H, Hkv, Hkv, H)]


# ---------------------------------------------------------------- one configuration

def run_config(idx, strategy, layout, mask, B, S, H, Hkv, D, stripe_block=1, ulysses=None):
    """Forward and backward of one configuration against the float64 reference; returns the
    configuration's name and its relative errors on this rank."""
    # Four documents, one of a single token; every other configuration adds empty documents
    # (repeated boundaries, as padded packed batches have) at the start, inside and at the end.
    # A varlen layout shards by documents, and a token then sees only its own document: the
    # mask's band applies inside documents.
    cu = [0, S // 5, S // 2, S // 2 + 1, S]
    if idx % 2:
        cu = [0, 0, S // 5, S // 5, S // 5, S // 2, S // 2 + 1, S, S]
    docs = cu if layout == "varlen" or mask == "document" else None
    q, k, v, dout = make_inputs(1000 + idx, B, S, H, Hkv, D)
    scale = 1.0 / D ** 0.5

    q64, k64, v64 = (t.clone().requires_grad_() for t in (q, k, v))
    out_ref, lse_ref = reference(q64, k64, v64, visible(S, mask, docs), scale)
    (out_ref * dout).sum().backward()

    pos = torch.from_numpy(dattn.layout_positions(layout, S, stripe_block=stripe_block,
                                                  cu_seqlens=docs))
    kw = dict(BANDS[mask], layout=layout, strategy=strategy, stripe_block=stripe_block,
              ulysses_degree=ulysses, cu_seqlens=docs)

    def shard(t):
        return t[:, pos].float().contiguous().requires_grad_()

    qs, ks, vs = shard(q), shard(k), shard(v)
    out, lse = dattn.attention(qs, ks, vs, return_lse=True, **kw)
    (out.double() * dout[:, pos]).sum().backward()

    name = (f"{strategy:7s} {layout:10s} {mask:8s} B={B} S={S} H={H}/{Hkv} D={D}"
            + (f" block={stripe_block}" if layout == "striped" else ""))
    errs = {
        "out": rel_err(out, out_ref.detach()[:, pos]),
        "lse": rel_err(lse, lse_ref.detach()[:, :, pos]),
        "dq": rel_err(qs.grad, q64.grad[:, pos]),
        "dk": rel_err(ks.grad, k64.grad[:, pos]),
        "dv": rel_err(vs.grad, v64.grad[:, pos]),
    }
    bad = {key: e for key, e in errs.items() if not e <= TOL_FP32}
    assert not bad, f"rank {RANK}: {name}: relative error above {TOL_FP32}: {bad}"

    # Determinism: the backward twice more, outside autograd: bit-identical to autograd's.
    for _ in range(2):
        again = dattn.attention_backward(qs.detach(), ks.detach(), vs.detach(), out.detach(), lse,
                                         dout[:, pos].float(), **kw)
        for got, want, what in zip(again, (qs.grad, ks.grad, vs.grad), ("dq", "dk", "dv")):
            assert torch.equal(got, want), f"rank {RANK}: {name}: a repeated backward changed {what}"
    return name, errs


def check_sinks():
    """Attention sinks (sinks=, a torch tensor that requires grad) and the logit softcap
    (softcap=): out, lse, dq, dk, dv and d sinks against float64 autograd for each strategy on
    zigzag (causal with sinks and a softcap, a window narrower than some rows' history with sinks
    alone, and no mask with the softcap alone), attention_local, the numpy backward's fourth
    result, a decode step from a KvCache with both, and a sinks tensor of the wrong length and a
    negative softcap, rejected on every rank."""
    B, S, H, Hkv, D = 2, 23, 2 * P, P, 16
    q, k, v, dout = make_inputs(77, B, S, H, Hkv, D)
    sinks = torch.tensor([0.5, -1.0, 6.0, 1.5, -2.0, 0.0, 3.0, 1.0][:H], dtype=torch.float64)
    scale = 1.0 / D ** 0.5
    pos = torch.from_numpy(dattn.layout_positions("zigzag", S))
    for strategy in ("ring", "ulysses", "hybrid"):
        for mask, with_sinks, cap in (("causal", True, 1.5), ("window", True, 0.0),
                                      ("none", False, 2.0)):
            q64, k64, v64, s64 = (t.clone().requires_grad_() for t in (q, k, v, sinks))
            out_ref, lse_ref = reference(q64, k64, v64, visible(S, mask, None), scale,
                                         s64 if with_sinks else None, cap)
            (out_ref * dout).sum().backward()
            if not with_sinks:
                s64.grad = torch.zeros_like(sinks)
            qs, ks, vs = (t[:, pos].float().contiguous().requires_grad_() for t in (q, k, v))
            ss = sinks.float().requires_grad_()
            kw = dict(BANDS[mask], layout="zigzag", strategy=strategy, softcap=cap,
                      ulysses_degree=1 if strategy == "hybrid" else None)
            out, lse = dattn.attention(qs, ks, vs, return_lse=True,
                                       sinks=ss if with_sinks else None, **kw)
            (out.double() * dout[:, pos]).sum().backward()
            errs = {"out": rel_err(out, out_ref.detach()[:, pos]),
                    "lse": rel_err(lse, lse_ref.detach()[:, :, pos]),
                    "dq": rel_err(qs.grad, q64.grad[:, pos]),
                    "dk": rel_err(ks.grad, k64.grad[:, pos]),
                    "dv": rel_err(vs.grad, v64.grad[:, pos]),
                    "dsinks": rel_err(ss.grad, s64.grad) if with_sinks else 0.0}
            bad = {key: e for key, e in errs.items() if not e <= TOL_FP32}
            assert not bad, (f"rank {RANK}: sinks {with_sinks} softcap {cap} {strategy} {mask}: "
                             f"errors above {TOL_FP32}: {bad}")
            assert with_sinks or ss.grad is None, f"rank {RANK}: a gradient for unused sinks"
            # The numpy backward: dsinks as a fourth result (with sinks), the same as autograd's.
            grads = dattn.attention_backward(qs.detach().numpy(), ks.detach().numpy(),
                                             vs.detach().numpy(), out.detach().numpy(),
                                             lse.numpy(), dout[:, pos].float().numpy(),
                                             sinks=sinks.numpy() if with_sinks else None, **kw)
            assert len(grads) == (4 if with_sinks else 3), f"rank {RANK}: {len(grads)} results"
            assert np.array_equal(grads[0], qs.grad.numpy()), f"rank {RANK}: numpy dq differs"
            if with_sinks:
                assert np.array_equal(grads[3], ss.grad.numpy()), \
                    f"rank {RANK}: {strategy} {mask}: numpy dsinks {grads[3]} vs {ss.grad}"
    # attention_local: one process, the whole sequence.
    q64, k64, v64, s64 = (t.clone().requires_grad_() for t in (q, k, v, sinks))
    out_ref, _ = reference(q64, k64, v64, visible(S, "causal", None), scale, s64)
    (out_ref * dout).sum().backward()
    ql, kl, vl = (t.float().requires_grad_() for t in (q, k, v))
    sl = sinks.float().requires_grad_()
    out = dattn.attention_local(ql, kl, vl, causal=True, sinks=sl)
    (out.double() * dout).sum().backward()
    for got, ref, what in ((out, out_ref, "out"), (ql.grad, q64.grad, "dq"),
                           (sl.grad, s64.grad, "dsinks")):
        assert rel_err(got, ref) <= TOL_FP32, f"rank {RANK}: local sinks {what}: {rel_err(got, ref)}"
    # A decode step: the cache's sinks join the merged result of every strategy.
    cache = dattn.KvCache(H, Hkv, D, B, "fp32", S, sinks=sinks.numpy(), softcap=2.5)
    kz = torch.from_numpy(dattn.layout_positions("contiguous", S))
    cache.prefill(k[:, kz].float().contiguous(), v[:, kz].float().contiguous())
    qd = q[:, S - 1:].float().contiguous()
    vis = visible(S, "causal", None)[S - 1:]
    out_ref, lse_ref = reference(q[:, S - 1:], k, v, vis, scale, sinks, 2.5)
    for strategy in ("tree", "ring", "allgather"):
        out, lse = dattn.decode(qd, cache, strategy=strategy, return_lse=True)
        assert rel_err(out, out_ref) <= TOL_FP32 and rel_err(lse, lse_ref) <= TOL_FP32, \
            f"rank {RANK}: decode {strategy} with sinks: {rel_err(out, out_ref)}, {rel_err(lse, lse_ref)}"
    # The wrong number of sinks: InvalidArgumentError naming them, on every rank.
    try:
        dattn.attention(qs.detach(), ks.detach(), vs.detach(), causal=True, layout="zigzag",
                        sinks=[1.0] * (H + 1))
        raise AssertionError(f"rank {RANK}: {H + 1} sinks for {H} heads were accepted")
    except dattn.InvalidArgumentError as e:
        assert "sinks" in str(e), f"rank {RANK}: {e}"
    try:
        dattn.attention(qs.detach(), ks.detach(), vs.detach(), layout="zigzag", softcap=-1.0)
        raise AssertionError(f"rank {RANK}: softcap -1 was accepted")
    except dattn.InvalidArgumentError as e:
        assert "softcap" in str(e), f"rank {RANK}: {e}"
    if RANK == 0:
        print(f"test_gradients: sinks and softcap (ring, ulysses, hybrid, local, decode) within "
              f"{TOL_FP32}")


def slice_visible(S, slices):
    """[S, S] bool of a slice mask, from the kinds' definitions: inside the rectangle, a causal
    slice's query at offset i sees key offsets up to i + (k_len - q_len), an inv_causal one from
    i on, a bi_causal one both."""
    vis = torch.zeros(S, S, dtype=torch.bool)
    for q0, q1, k0, k1, kind in slices:
        i = torch.arange(q1 - q0)[:, None]
        j = torch.arange(k1 - k0)[None, :]
        block = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
        if kind in ("causal", "bi_causal"):
            block &= j <= i + (k1 - k0) - (q1 - q0)
        if kind in ("inv_causal", "bi_causal"):
            block &= j >= i
        vis[q0:q1, k0:k1] |= block
    return vis


def check_slices():
    """Slice masks (slices=): a shared prefix with documents after it, plus inverse- and
    bi-causal slices, queries that see nothing and an empty slice: out, lse, dq, dk, dv against
    float64 autograd for each strategy on zigzag and striped, attention_local, and overlapping
    slices or a bad kind rejected on every rank."""
    B, S, H, Hkv, D = 1, 41, 2 * P, P, 16
    q, k, v, dout = make_inputs(91, B, S, H, Hkv, D)
    scale = 1.0 / D ** 0.5
    slices = [(0, 8, 0, 8, "causal"),                              # the prefix
              (8, 20, 0, 8, "full"), (8, 20, 8, 20, "causal"),     # document 1 sees the prefix
              (20, 33, 0, 8, "full"), (20, 33, 20, 33, "causal"),  # document 2
              (33, 37, 20, 41, "inv_causal"), (37, 40, 30, 41, "bi_causal"),
              (20, 20, 0, 41, "full")]                             # 40: sees nothing; empty
    vis = slice_visible(S, slices)
    q64, k64, v64 = (t.clone().requires_grad_() for t in (q, k, v))
    out_ref, lse_ref = reference(q64, k64, v64, vis, scale)
    (out_ref * dout).sum().backward()
    out_ref = out_ref.detach()
    for layout in ("zigzag", "striped"):
        pos = torch.from_numpy(dattn.layout_positions(layout, S))
        for strategy in ("ring", "ulysses", "hybrid"):
            qs, ks, vs = (t[:, pos].float().contiguous().requires_grad_() for t in (q, k, v))
            out, lse = dattn.attention(qs, ks, vs, return_lse=True, layout=layout,
                                       strategy=strategy, slices=slices,
                                       ulysses_degree=1 if strategy == "hybrid" else None)
            (out.double() * dout[:, pos]).sum().backward()
            seen = vis[pos].any(dim=1)
            assert torch.equal(torch.isinf(lse[0, 0]), ~seen), f"rank {RANK}: lse -inf rows"
            errs = {"out": rel_err(out, out_ref[:, pos]),
                    "lse": rel_err(lse[..., seen], lse_ref.detach()[:, :, pos][..., seen]),
                    "dq": rel_err(qs.grad, q64.grad[:, pos]),
                    "dk": rel_err(ks.grad, k64.grad[:, pos]),
                    "dv": rel_err(vs.grad, v64.grad[:, pos])}
            bad = {key: e for key, e in errs.items() if not e <= TOL_FP32}
            assert not bad, f"rank {RANK}: slices {strategy} {layout}: above {TOL_FP32}: {bad}"
    out = dattn.attention_local(q.float(), k.float(), v.float(), slices=slices)
    assert rel_err(out, out_ref) <= TOL_FP32, f"rank {RANK}: local slices {rel_err(out, out_ref)}"
    pos = torch.from_numpy(dattn.layout_positions("zigzag", S))
    qs, ks, vs = (t[:, pos].float().contiguous() for t in (q, k, v))
    for bad_slices, needle in (([(0, 8, 0, 8, "causal"), (4, 9, 7, 9, "full")], "overlap"),
                               ([(0, 8, 0, 8, "diagonal")], "slice kind"),
                               ([(0, 8, 0, S + 1, "full")], "slices")):
        try:
            dattn.attention(qs, ks, vs, layout="zigzag", slices=bad_slices)
            raise AssertionError(f"rank {RANK}: slices {bad_slices} were accepted")
        except dattn.InvalidArgumentError as e:
            assert needle in str(e), f"rank {RANK}: {e}"
    if RANK == 0:
        print(f"test_gradients: slice masks (ring, ulysses, hybrid; zigzag, striped; local) "
              f"within {TOL_FP32}")


def configurations():
    """strategy x layout x mask, with head counts each strategy can take (Ulysses: H_kv a
    multiple of the ranks; hybrid: Ulysses groups of 2 on an even number of ranks), and GQA 4/2,
    MQA 4/1, MHA, head_dim 64 and 128, S from 37 to 130 spread over them."""
    strategies = ["ring", "ulysses"] + (["hybrid"] if P % 2 == 0 else [])
    sizes = [37, 64, 101, 130]
    ring_heads = [(4, 2), (4, 1), (2, 2)]
    idx = 0
    for strategy in strategies:
        for layout in ("contiguous", "zigzag", "striped", "varlen"):
            for mask in ("none", "causal", "window", "document"):
                S = sizes[idx % len(sizes)]
                D = 128 if idx % 3 == 2 else 64
                if strategy == "ring":
                    H, Hkv = ring_heads[idx % len(ring_heads)]
                elif strategy == "ulysses":
                    H, Hkv = 2 * P, P
                else:
                    H, Hkv = 4, 2
                yield dict(idx=idx, strategy=strategy, layout=layout, mask=mask,
                           B=1 + idx % 2, S=S, H=H, Hkv=Hkv, D=D,
                           stripe_block=1 + 2 * (idx % 2), ulysses=2 if strategy == "hybrid" else None)
                idx += 1


# ---------------------------------------------------------------- bf16: error vs ring size

def check_bf16():
    """bf16 inputs: the gradients' error against float64 (of the same bf16 values) is no larger
    distributed over P ranks than in one process (attention_local) by more than a small factor.
    A schedule that rounds partial gradients to bf16 between ring steps fails this by orders of
    magnitude."""
    B, S, H, Hkv, D = 1, 128, 4, 2, 64
    q, k, v, dout = make_inputs(7, B, S, H, Hkv, D)
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    q64, k64, v64 = (t.double().requires_grad_() for t in (qb, kb, vb))
    out_ref, _ = reference(q64, k64, v64, visible(S, "causal", None), 1.0 / D ** 0.5)
    (out_ref * dout).sum().backward()
    refs = (q64.grad, k64.grad, v64.grad)

    # One process: the same kernels over the whole sequence.
    out1, lse1 = dattn.attention_local(qb, kb, vb, causal=True, return_lse=True)
    grads1 = dattn.attention_local_backward(qb, kb, vb, out1, lse1, dout.float(), causal=True)
    err1 = [rel_err(g, r) for g, r in zip(grads1, refs)]

    # P ranks, ring over a zigzag layout, through autograd (bf16 inputs get fp32 gradients
    # rounded to bf16 there, so compare attention_backward's fp32 gradients instead).
    pos = torch.from_numpy(dattn.layout_positions("zigzag", S))
    shards = [t[:, pos].contiguous() for t in (qb, kb, vb)]
    out, lse = dattn.attention(*shards, causal=True, layout="zigzag", return_lse=True)
    grads = dattn.attention_backward(*shards, out, lse, dout[:, pos].float(), causal=True,
                                     layout="zigzag")
    errP = [all_max((g.double() - r[:, pos]).abs().max().item()) / r.abs().max().item()
            for g, r in zip(grads, refs)]
    for what, e1, eP in zip(("dq", "dk", "dv"), err1, errP):
        if RANK == 0:
            print(f"  bf16 {what}: relative error 1 process {e1:.3e}, {P} ranks {eP:.3e}")
        assert eP <= 1.5 * e1 + 1e-6, (
            f"bf16 {what}: error on {P} ranks ({eP:.3e}) > 1.5 x error in one process ({e1:.3e})")

    # Autograd on bf16 leaves: gradients come back in bf16, equal to the rounded fp32 ones.
    leaves = [s.clone().requires_grad_() for s in shards]
    o = dattn.attention(*leaves, causal=True, layout="zigzag")
    (o * dout[:, pos].float()).sum().backward()
    for leaf, g in zip(leaves, grads):
        assert leaf.grad.dtype == torch.bfloat16 and torch.equal(leaf.grad, g.to(torch.bfloat16))


# ---------------------------------------------------------------- API details and errors

def check_api():
    S, H, Hkv, D = 50, 4, 2, 64
    q, k, v, _ = make_inputs(11, 1, S, H, Hkv, D)
    pos = dattn.layout_positions("contiguous", S)
    qn, kn, vn = (t[:, pos].float().numpy() for t in (q, k, v))
    # numpy in, numpy out; float16 numpy too.
    out = dattn.attention(qn, kn, vn, causal=True)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (1, len(pos), H, D)
    out16 = dattn.attention(qn.astype(np.float16), kn.astype(np.float16), vn.astype(np.float16),
                            causal=True)
    assert isinstance(out16, np.ndarray) and np.abs(out16 - out).max() < 1e-2
    # torch without grad: a plain tensor.
    ot = dattn.attention(*(torch.from_numpy(a) for a in (qn, kn, vn)), causal=True)
    assert isinstance(ot, torch.Tensor) and not ot.requires_grad and np.array_equal(ot.numpy(), out)
    # Positions cover the sequence once over the ranks.
    for kind in ("contiguous", "zigzag", "striped"):
        allpos = np.concatenate([dattn.layout_positions(kind, 37, r, P, stripe_block=2)
                                 for r in range(P)])
        assert sorted(allpos.tolist()) == list(range(37)), kind
    assert dattn.allreduce_sum(1.5) == 1.5 * P

    # Errors: dattn.InvalidArgumentError, also a ValueError, with the library's message, on every
    # rank, and no hang.
    def raises(fn, word):
        try:
            fn()
        except ValueError as e:
            assert word in str(e), f"the message should name {word!r}: {e}"
            assert isinstance(e, dattn.InvalidArgumentError), f"{type(e)}: {e}"
            assert isinstance(e, dattn.Error) and e.kind == "invalid argument", f"{e.kind}: {e}"
            return
        raise AssertionError(f"no ValueError naming {word!r}")

    # One class per kind of error, under dattn.Error and the builtin a caller expects.
    for cls, builtin, kind in [(dattn.InvalidArgumentError, ValueError, "invalid argument"),
                               (dattn.OutOfMemoryError, MemoryError, "out of memory"),
                               (dattn.TimeoutError, TimeoutError, "timeout"),
                               (dattn.MPIError, RuntimeError, "MPI error"),
                               (dattn.CUDAError, RuntimeError, "CUDA error"),
                               (dattn.NCCLError, RuntimeError, "NCCL error"),
                               (dattn.InternalError, RuntimeError, "internal error")]:
        assert issubclass(cls, dattn.Error) and issubclass(cls, builtin), cls
        assert cls.kind == kind and cls.__module__ == "dattn", (cls, cls.kind, cls.__module__)
        assert str(cls("message")) == "message", cls

    raises(lambda: dattn.attention(qn[:, :, :3], kn, vn), "heads_q")
    raises(lambda: dattn.attention(qn, kn, vn, layout="diagonal"), "layout")
    raises(lambda: dattn.attention(qn, kn, vn, strategy="hybrid"), "ulysses_degree")
    raises(lambda: dattn.attention(qn, kn, vn, strategy="star"), "strategy")
    # A bad dtype on the last rank only: every rank raises.
    raises(lambda: dattn.attention(qn.astype(np.float64) if RANK == P - 1 else qn, kn, vn),
           "dtype float64")
    if P > 1:
        # The wrong shard length on rank 0 only: every rank raises.
        short = (lambda a: a[:, :-1]) if RANK == 0 else (lambda a: a)
        raises(lambda: dattn.attention(short(qn), short(kn), short(vn)), "seq")
    # Still usable afterwards.
    assert np.array_equal(dattn.attention(qn, kn, vn, causal=True), out)


# ---------------------------------------------------------------- main

def main():
    t0 = time.time()
    if RANK == 0:
        print(f"test_gradients: dattn from {dattn.__file__}, torch {torch.__version__}, "
              f"numpy {np.__version__}")
    # --installed: the package must be a pip-installed one (CI's check of `pip install .`).
    if "--installed" in sys.argv[1:] and "site-packages" not in dattn.__file__:
        raise AssertionError(f"--installed, but dattn comes from {dattn.__file__}")
    worst = {}
    n = 0
    for cfg in configurations():
        name, errs = run_config(**cfg)
        n += 1
        for key, e in errs.items():
            e = all_max(e)
            if e >= worst.get(key, (-1, ""))[0]:
                worst[key] = (e, name)
    if RANK == 0:
        print(f"test_gradients on {P} ranks: {n} configurations, fp32 within {TOL_FP32} "
              "(relative to max |ref|), repeated backward bit-identical; worst:")
        for key, (e, name) in worst.items():
            print(f"  {key:3s} {e:.2e}  ({name})")
    check_bf16()
    check_api()
    check_sinks()
    check_slices()
    if RANK == 0:
        print(f"test_gradients: all passed on {P} ranks in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # noqa: B902 - any failure on any rank ends the whole job
        sys.stderr.write(f"test_gradients: FAILED on rank {RANK} of {P}:\n{traceback.format_exc()}")
        sys.stderr.flush()
        dattn.abort(1)
