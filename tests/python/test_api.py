#!/usr/bin/env python3
"""The Python API beyond attention under mpiexec (1-4 ranks), against float64 references computed
here: KvCache and decode (tree, ring, allgather; GQA; a context not divisible by the ranks; appends
growing it; fp32, fp16, bf16), star attention (phase 1 against its blockwise rule, exact on one
block, not exact with several ranks; phase 2 exact and equal to tree decode), MLA decode (head
split and TPLA, no transform, Hadamard and PCA, against float64 MLA and TPLA), Runtime options
(threads, check_finite, tp for MLA, ulysses, bad values), no copies of C-contiguous inputs or of
results, and bad input raising dattn.InvalidArgumentError on every rank, naming the parameter.

Every rank builds the same global tensors from a fixed seed. A failure on any rank prints the
reason and aborts the job (no rank hangs). Exits 77 (skipped) when numpy or torch cannot be
imported.
  PYTHONPATH=build/python bash launch/mpirun.sh -n 4 /usr/bin/python3 tests/python/test_api.py
"""

import sys
import time
import traceback

try:
    import numpy as np
    import torch
except ImportError as e:  # before dattn: MPI is not started yet, so a plain exit is clean
    print(f"test_api: SKIPPED: {e} (needs numpy and torch, e.g. Debian's /usr/bin/python3)")
    sys.exit(77)

import dattn

RANK, P = dattn.rank(), dattn.world_size()
LAST = P - 1
torch.set_num_threads(1)

TOL = 2e-5  # fp32 accumulation against float64, relative to the largest reference value


# ---------------------------------------------------------------- float64 references

def attention_ref(q, k, v, q_pos, k_pos, causal=True, scale=None):
    """out [B, Sq, H, Dv] and lse [B, H, Sq] (float64) of q at positions q_pos against k, v at
    k_pos; GQA by repeating each K/V head over its group of query heads."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    scale = 1.0 / np.sqrt(q.shape[3]) if scale is None else scale
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        s = np.where(np.asarray(k_pos)[None, :] <= np.asarray(q_pos)[:, None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    lse = (m + np.log(np.exp(s - m).sum(axis=-1, keepdims=True)))[..., 0]
    out = np.einsum("bhqk,bkhd->bqhd", np.exp(s - lse[..., None]), v)
    return out, lse


def rel_err(got, ref):
    """max |got - ref| / max |ref| (ref float64)."""
    got = got.double().numpy() if isinstance(got, torch.Tensor) else np.asarray(got, np.float64)
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


def check_close(got, ref, what, tol=TOL):
    assert got.shape == ref.shape, f"rank {RANK}: {what}: shape {tuple(got.shape)} != {ref.shape}"
    e = rel_err(got, ref)
    assert e <= tol, f"rank {RANK}: {what}: relative error {e:.3e} > {tol}"
    return e


def f64(t):
    """A numpy float64 copy of an array or tensor (bf16 and fp16 values exactly)."""
    if isinstance(t, torch.Tensor):
        return t.double().numpy()
    return np.asarray(t, dtype=np.float64)


def contig(t):
    """A C-contiguous copy of an array or tensor slice."""
    return t.contiguous() if isinstance(t, torch.Tensor) else np.ascontiguousarray(t)


def randn(gen, *shape):
    return gen.standard_normal(shape).astype(np.float32)


def raises(fn, *words, cls=None):
    """fn() must raise dattn.InvalidArgumentError (or cls), a ValueError for the invalid kind,
    whose message contains every word."""
    cls = cls or dattn.InvalidArgumentError
    try:
        fn()
    except dattn.Error as e:
        assert isinstance(e, cls), f"rank {RANK}: {type(e).__name__} instead of {cls.__name__}: {e}"
        for w in words:
            assert w in str(e), f"rank {RANK}: the message should name {w!r}: {e}"
        return str(e)
    raise AssertionError(f"rank {RANK}: no {cls.__name__} naming {words}")


# ---------------------------------------------------------------- 1. KV cache and decode

def check_decode():
    """Every strategy, three dtypes and layouts/placements; a context of 7P + 1 tokens (not
    divisible by P > 1), then appends of 1, 3 and 2 tokens, a decode step after each with the
    appended tokens as queries (S_q > 1 is causal inside itself)."""
    B, H, Hkv, D, Dv = 2, 4, 2, 16, 8
    S0, appends = 7 * P + 1, (1, 3, 2)
    total = S0 + sum(appends)
    gen = np.random.default_rng(1)
    k_all, v_all = randn(gen, B, total, Hkv, D), randn(gen, B, total, Hkv, Dv)
    cases = [("float32", "contiguous", "round_robin", np.asarray),
             ("bfloat16", "zigzag", "last_rank", lambda a: torch.from_numpy(a).to(torch.bfloat16)),
             ("float16", "striped", "round_robin", lambda a: np.asarray(a, np.float16))]
    worst = 0.0
    for strategy in ("tree", "ring", "allgather"):
        for dtype, layout, placement, kind in cases:
            name = f"decode {strategy} {dtype} {layout} {placement}"
            k, v = kind(k_all), kind(v_all)
            pos = dattn.layout_positions(layout, S0, stripe_block=2)
            capacity = S0 // P + 1 + sum(appends)
            cache = dattn.KvCache(H, Hkv, D, B, dtype, capacity, placement, head_dim_v=Dv)
            cache.prefill(contig(k[:, pos]), contig(v[:, pos]), layout=layout, stripe_block=2)
            assert cache.length == S0 and cache.local_len == len(pos), name
            assert np.array_equal(cache.positions(), pos), name
            kref, vref = f64(k), f64(v)
            for step, n in enumerate(appends):
                at = cache.length
                cache.append(contig(k[:, at:at + n]), contig(v[:, at:at + n]))
                L = cache.length
                q = kind(randn(np.random.default_rng(100 + step), B, n, H, D))
                out, lse = dattn.decode(q, cache, strategy=strategy, return_lse=True)
                assert isinstance(out, torch.Tensor) == isinstance(q, torch.Tensor), name
                assert out.dtype in (np.float32, torch.float32), f"{name}: {out.dtype}"
                ref_out, ref_lse = attention_ref(f64(q), kref[:, :L], vref[:, :L],
                                                 np.arange(L - n, L), np.arange(L))
                worst = max(worst, check_close(out, ref_out, f"{name} step {step} out"),
                            check_close(lse, ref_lse, f"{name} step {step} lse"))
            # The cache's rows over the ranks: every position once; appended tokens where the
            # placement puts them.
            counts = np.zeros(total)
            counts[cache.positions()] += 1
            assert np.array_equal(dattn.allreduce_sum(counts), np.ones(total)), name
            appended = [p for p in cache.positions() if p >= S0]
            if placement == "round_robin":
                assert all((p - S0) % P == RANK for p in appended), (name, appended)
            else:
                assert appended == (list(range(S0, total)) if RANK == LAST else []), name
    # No room for one more token on some rank: every rank raises naming the capacity, and the
    # cache is unchanged.
    cache = dattn.KvCache(H, Hkv, D, B, "float32", 2, "last_rank", head_dim_v=Dv)
    cache.append(contig(k_all[:, :2]), contig(v_all[:, :2]))
    raises(lambda: cache.append(contig(k_all[:, 2:3]), contig(v_all[:, 2:3])), "capacity")
    assert cache.length == 2
    return worst


# ---------------------------------------------------------------- 2. star attention

def star_phase1_ref(q_rank, k_all, v_all, own, block, anchor):
    """Phase 1's rule for this rank's tokens `own`: each block of `block` tokens against
    [the context's first `anchor` tokens | the block] on global positions (block 0: against
    itself only), causal."""
    n, B, H, Dv = len(own), q_rank.shape[0], q_rank.shape[2], v_all.shape[3]
    out, lse = np.zeros((B, n, H, Dv)), np.full((B, H, n), -np.inf)
    for off in range(0, n, block):
        qpos = own[off:off + block]
        keys = list(range(min(anchor, len(k_all[0])))) if qpos[0] > 0 else []
        keys += list(qpos)
        o, l = attention_ref(q_rank[:, off:off + len(qpos)], k_all[:, keys], v_all[:, keys],
                             qpos, keys)
        out[:, off:off + len(qpos)], lse[:, :, off:off + len(qpos)] = o, l
    return out, lse


def check_star():
    B, H, Hkv, D, Dv = 1, 4, 2, 16, 16
    S, block, s_q = 50, 16, 3
    gen = np.random.default_rng(2)
    q_all, k_all, v_all = (randn(gen, B, S + s_q, h, d) for h, d in ((H, D), (Hkv, D), (Hkv, Dv)))
    own = dattn.layout_positions("blocks", S, block=block)
    qs, ks, vs = (np.ascontiguousarray(t[:, own]) for t in (q_all, k_all, v_all))
    worst = 0.0
    for anchor in (None, 0, block // 2):
        out, lse = dattn.star_prefill(qs, ks, vs, block, anchor=anchor, return_lse=True)
        a = block if anchor is None else anchor
        ref_out, ref_lse = star_phase1_ref(f64(qs), f64(k_all[:, :S]), f64(v_all[:, :S]),
                                           list(own), block, a)
        if len(own):
            worst = max(worst, check_close(out, ref_out, f"star phase 1 anchor {anchor} out"),
                        check_close(lse, ref_lse, f"star phase 1 anchor {anchor} lse"))
    # anchor=None is anchor=block, bit for bit.
    assert np.array_equal(dattn.star_prefill(qs, ks, vs, block),
                          dattn.star_prefill(qs, ks, vs, block, anchor=block))
    exact, _ = attention_ref(f64(qs), f64(k_all[:, :S]), f64(v_all[:, :S]), own, np.arange(S))
    if P == 1:  # one block of the whole context: exact causal attention
        whole = dattn.star_prefill(qs, ks, vs, S)
        worst = max(worst, check_close(whole, exact, "star phase 1, one block, vs exact"))
    else:  # the last rank's blocks, past the anchor's, miss the middle of the context
        approx = dattn.star_prefill(qs, ks, vs, block)
        assert RANK != LAST or rel_err(approx, exact) > 1e-3, \
            "star phase 1 on the last rank equals exact attention"

    # Phase 2: the phase-1 shards as a last_rank cache, the query's K/V appended; q is read on
    # the query rank only.
    cache = dattn.KvCache(H, Hkv, D, B, "float32", S + s_q, "last_rank", head_dim_v=Dv)
    cache.prefill(ks, vs, layout="blocks", block=block)
    cache.append(contig(k_all[:, S:]), contig(v_all[:, S:]))
    q = np.ascontiguousarray(q_all[:, S:])
    got = dattn.star_decode(q if RANK == LAST else np.zeros_like(q), cache, return_lse=True)
    tree = dattn.decode(q, cache, strategy="tree", return_lse=True)
    if RANK != LAST:
        assert got == (None, None), "star_decode returned a result off the query rank"
        return worst
    ref_out, ref_lse = attention_ref(f64(q), f64(k_all), f64(v_all), np.arange(S, S + s_q),
                                     np.arange(S + s_q))
    for g, t, r, what in zip(got, tree, (ref_out, ref_lse), ("out", "lse")):
        worst = max(worst, check_close(g, r, f"star phase 2 {what}"))
        assert np.abs(g - t).max() <= 1e-6 * (1 + np.abs(t).max()), f"star vs tree {what}"
    return worst


# ---------------------------------------------------------------- 3. MLA

MLA = dict(B=1, S=40, s_q=2, H=12, dn=16, dr=8, dc=32, dv=16)  # 12 heads: 1-4 ranks divide them


def mla_inputs():
    m = MLA
    gen = np.random.default_rng(3)
    t = dict(q_nope=randn(gen, m["B"], m["s_q"], m["H"], m["dn"]),
             q_pe=randn(gen, m["B"], m["s_q"], m["H"], m["dr"]),
             c_kv=randn(gen, m["B"], m["S"], m["dc"]), k_pe=randn(gen, m["B"], m["S"], m["dr"]),
             w_uk=randn(gen, m["H"], m["dn"], m["dc"]) / np.float32(np.sqrt(m["dc"])),
             w_uv=randn(gen, m["H"], m["dv"], m["dc"]) / np.float32(np.sqrt(m["dc"])))
    return t


def mla_scale():
    return float(np.float32(1.0 / np.sqrt(MLA["dn"] + MLA["dr"])))  # the library's fp32 value


def mla_rotation(kind, c_kv):
    """R (float64) of a latent transform: None, the normalised Sylvester-Hadamard matrix, or the
    covariance eigenvectors of the cache's latents by decreasing variance (rows)."""
    dc = MLA["dc"]
    if kind is None:
        return np.eye(dc)
    if kind == "hadamard":
        h = np.ones((1, 1))
        while h.shape[0] < dc:
            h = np.block([[h, h], [h, -h]])
        return h / np.sqrt(dc)
    x = f64(c_kv).reshape(-1, dc)
    w, vecs = np.linalg.eigh(np.cov(x, rowvar=False))
    return vecs[:, np.argsort(w)[::-1]].T


def tpla_ref(t, G, rope="replicated", scale_by_g=False, transform=None):
    """TPLA of G slices in float64 (G = 1: exact MLA), with the latent rotated by the transform:
    slice g's scores scale_g (q~[slice] . c[slice] + q_pe[rope slice] . k_pe[rope slice]),
    q~ = W_UK^T q_nope, its own softmax, z_g = p . c[slice], out = sum_g W_UV[:, slice] z_g."""
    R = mla_rotation(transform, t["c_kv"])
    c = f64(t["c_kv"]) @ R.T
    wuk, wuv = f64(t["w_uk"]) @ R.T, f64(t["w_uv"]) @ R.T
    qn, qp, kp = f64(t["q_nope"]), f64(t["q_pe"]), f64(t["k_pe"])
    S, s_q, dc, dr = MLA["S"], MLA["s_q"], MLA["dc"], MLA["dr"]
    qt = np.einsum("bqhd,hdc->bqhc", qn, wuk)
    q_pos, k_pos = np.arange(S - s_q, S), np.arange(S)
    vis = k_pos[None, :] <= q_pos[:, None]
    out = 0
    for g in range(G):
        l0, l1 = g * dc // G, (g + 1) * dc // G
        r0, r1 = (g * dr // G, (g + 1) * dr // G) if rope == "split" else (0, dr)
        s = (np.einsum("bqhc,bsc->bhqs", qt[..., l0:l1], c[..., l0:l1])
             + np.einsum("bqhr,bsr->bhqs", qp[..., r0:r1], kp[..., r0:r1]))
        s = np.where(vis, s * mla_scale() * (G if scale_by_g else 1), -np.inf)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        z = np.einsum("bhqs,bsc->bqhc", p, c[..., l0:l1])
        out = out + np.einsum("bqhc,hvc->bqhv", z, wuv[..., l0:l1])
    return out


def check_mla():
    t = mla_inputs()
    exact = tpla_ref(t, 1)
    worst = 0.0
    for transform in (None, "hadamard", "pca"):
        tol = TOL if transform is None else 1e-4  # the transform is applied in fp32
        out = dattn.mla_decode(**t, method="head_split", transform=transform)
        worst = max(worst, check_close(out, exact, f"mla head_split {transform}", tol))
    tpla_cases = [("replicated", False, None), ("split", True, None),
                  ("replicated", False, "hadamard"), ("split", False, "pca")]
    for rope, by_g, transform in tpla_cases:
        what = f"mla tpla rope {rope} logits x{'G' if by_g else '1'} {transform}"
        call = lambda: dattn.mla_decode(**t, method="tpla", rope=rope, scale_logits_by_g=by_g,
                                        transform=transform)
        if MLA["dc"] % P:  # d_c = 32 at 3 ranks: refused on every rank, naming the latent
            raises(call, "latent")
            continue
        ref = tpla_ref(t, P, rope, by_g, transform)
        tol = TOL if transform is None else 1e-4
        worst = max(worst, check_close(call(), ref, what, tol))
        if P > 1:
            assert rel_err(ref, exact) > 1e-3, f"{what}: TPLA should differ from MLA here"
    # An explicit calibration set, and torch tensors in (torch out).
    cal = np.ascontiguousarray(t["c_kv"].reshape(-1, MLA["dc"]))
    tt = {key: torch.from_numpy(a) for key, a in t.items()}
    out = dattn.mla_decode(**tt, transform="pca", calibration=cal)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    worst = max(worst, check_close(out, exact, "mla head_split pca, torch", 1e-4))
    return worst


# ---------------------------------------------------------------- 4. Runtime options

def check_runtime():
    rt = dattn.default_runtime()
    assert (rt.rank, rt.size, rt.cp_rank, rt.cp_size, rt.tp_size) == (RANK, P, RANK, P, 1), rt

    # threads: the runtime's, restored at each of its calls; results agree with the default.
    one = dattn.Runtime(threads=1, timeout_s=60)
    assert one.threads == 1 and one.cp_size == P, one
    B, H, Hkv, D = 1, 4, 2, 16
    gen = np.random.default_rng(4)
    k, v = randn(gen, B, 3 * P + 2, Hkv, D), randn(gen, B, 3 * P + 2, Hkv, D)
    pos = dattn.layout_positions("zigzag", k.shape[1], runtime=one)
    ks, vs = np.ascontiguousarray(k[:, pos]), np.ascontiguousarray(v[:, pos])
    q = randn(gen, B, 1, H, D)
    c1 = dattn.KvCache(H, Hkv, D, B, "float32", 8, runtime=one)
    c1.prefill(ks, vs, layout="zigzag")
    assert c1.runtime is one
    c0 = dattn.KvCache(H, Hkv, D, B, "float32", 8)
    c0.prefill(ks, vs, layout="zigzag")
    a, b = dattn.decode(q, c1), dattn.decode(q, c0)
    assert np.abs(a - b).max() <= 1e-6, "threads=1 changed the result"
    two = dattn.Runtime(threads=2)  # sets OpenMP's count (one per process) to 2
    assert two.threads == 2 and dattn._C.omp_max_threads() == 2
    dattn.decode(q, c1)  # runs on `one`, and restores its count
    assert dattn._C.omp_max_threads() == 1, dattn._C.omp_max_threads()

    # check_finite: a NaN on the last rank only raises on every rank, naming the tensor; without
    # the check it reaches the output (ring decode; tree decode turns a NaN query row into an
    # empty one: out 0, lse -inf).
    checked = dattn.Runtime(check_finite=True)
    assert checked.check_finite
    bad_q = q.copy()
    if RANK == LAST:
        bad_q[0, 0, 1, 3] = np.nan
    raises(lambda: dattn.decode(bad_q, c0, runtime=checked), "q", "nan")
    raises(lambda: dattn.attention(bad_q, ks[:, :1], vs[:, :1], runtime=checked), "q", "nan")
    unchecked = dattn.decode(bad_q, c0, strategy="ring")  # collective: every rank calls it
    assert RANK != LAST or np.isnan(unchecked).any(), "the NaN did not reach the output"

    # tp for MLA: the cp groups are P / tp ranks, and MLA's TPLA runs over them.
    t = mla_inputs()
    for tp in [d for d in range(1, P + 1) if P % d == 0]:
        rt = dattn.Runtime(tp=tp)
        G = P // tp
        assert (rt.tp_size, rt.cp_size, rt.tp_rank, rt.cp_rank) == (tp, G, RANK % tp, RANK // tp)
        if MLA["dc"] % G:
            raises(lambda: dattn.mla_decode(**t, method="tpla", runtime=rt), "latent")
        else:
            out = dattn.mla_decode(**t, method="tpla", runtime=rt)
            check_close(out, tpla_ref(t, G), f"mla tpla with tp {tp} (G = {G})")
        out = dattn.mla_decode(**t, method="head_split", runtime=rt)
        check_close(out, tpla_ref(t, 1), f"mla head_split with tp {tp}")

    # ulysses: the hybrid strategy takes the runtime's degree.
    if P % 2 == 0:
        u = dattn.Runtime(ulysses=2)
        assert u.ulysses == 2
        qa = randn(gen, B, 5, 2 * P, D)
        ka, va = randn(gen, B, 5, P, D), randn(gen, B, 5, P, D)
        ring = dattn.attention(qa, ka, va, causal=True)
        hybrid = dattn.attention(qa, ka, va, causal=True, strategy="hybrid", runtime=u)
        assert np.abs(hybrid - ring).max() <= 1e-5, "hybrid on Runtime(ulysses=2) != ring"
        raises(lambda: dattn.attention(qa, ka, va, strategy="hybrid", ulysses_degree=1,
                                       runtime=u), "ulysses_degree")

    # The default runtime takes a hybrid call's ulysses_degree; one it refuses leaves it usable.
    qa = randn(gen, B, 3, 2 * P, D)
    ka = randn(gen, B, 3, P, D)
    raises(lambda: dattn.attention(qa, ka, ka, strategy="hybrid", ulysses_degree=P + 1),
           "ulysses")
    assert dattn.attention(qa, ka, ka).shape == qa.shape

    # Bad options: every rank raises, naming the option.
    raises(lambda: dattn.Runtime(tp=0), "tp")
    raises(lambda: dattn.Runtime(tp=P + 1), "tp")
    raises(lambda: dattn.Runtime(ulysses=0), "ulysses")
    raises(lambda: dattn.Runtime(ulysses=P + 1), "ulysses")
    raises(lambda: dattn.Runtime(threads=-1), "threads")
    raises(lambda: dattn.Runtime(threads=2.5), "threads")
    raises(lambda: dattn.Runtime(timeout_s=-1), "timeout_s")
    raises(lambda: dattn.Runtime(timeout_s="soon"), "timeout_s")
    raises(lambda: dattn.Runtime(check_finite="yes"), "check_finite")
    raises(lambda: dattn.Runtime(device="gpu"), "device", "'gpu'")
    raises(lambda: dattn.Runtime(device=99), "device", "cuda:99")
    raises(lambda: dattn.Runtime(stream=-1), "stream")
    assert rt.device == "cpu" and rt.stream == 0, (rt.device, rt.stream)
    raises(lambda: dattn.Runtime(comm="world"), "comm")
    raises(lambda: dattn.decode(q, c0, runtime="default"), "runtime")


# ---------------------------------------------------------------- 5. copies and bad input

def check_copies_and_bad_input():
    # C-contiguous inputs are viewed, not copied; results are views of the library's storage.
    x = np.zeros((1, 2, 2, 4), np.float32)
    assert np.shares_memory(dattn._view(x, "q")[0], x)
    xt = torch.zeros(1, 2, 2, 4, dtype=torch.bfloat16)
    assert dattn._view(xt, "q")[0].ctypes.data == xt.data_ptr()
    assert np.shares_memory(dattn._view(x.transpose(0, 2, 1, 3), "q")[0], x)  # passed as is

    B, H, Hkv, D = 1, 4, 2, 16
    gen = np.random.default_rng(5)
    k, v = randn(gen, B, 2 * P, Hkv, D), randn(gen, B, 2 * P, Hkv, D)
    pos = dattn.layout_positions("contiguous", 2 * P)
    cache = dattn.KvCache(H, Hkv, D, B, "float32", 8)
    cache.prefill(np.ascontiguousarray(k[:, pos]), np.ascontiguousarray(v[:, pos]))
    q = randn(gen, B, 1, H, D)
    out = dattn.decode(q, cache)
    base = out.base.obj if isinstance(out.base, memoryview) else out.base
    assert not out.flags.owndata and isinstance(base, dattn._C.Buffer), type(base)

    def on(rank, bad, good):
        return bad if RANK == rank else good

    meta = torch.zeros(q.shape, device="meta")
    noncontig = np.ascontiguousarray(q.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    assert not noncontig.flags.c_contiguous
    # decode: each bad q on one rank only.
    raises(lambda: dattn.decode(on(LAST, q.astype(np.float64), q), cache), "q", "float64")
    raises(lambda: dattn.decode(on(0, q[:, :, :2].copy(), q), cache), "q heads")
    raises(lambda: dattn.decode(on(0, noncontig, q), cache), "q layout", "C-contiguous")
    raises(lambda: dattn.decode(on(LAST, meta, torch.from_numpy(q)), cache), "q", "meta")
    raises(lambda: dattn.decode(q, cache, strategy="star"), "strategy")
    # append and prefill: k, v against the cache.
    kn, vn = k[:, :1].copy(), v[:, :1].copy()
    raises(lambda: cache.append(on(0, kn.astype(np.float16), kn), vn), "k dtype")
    raises(lambda: cache.append(kn, on(LAST, v[:, :1, :1].copy(), vn)), "v shape")
    raises(lambda: cache.append(kn, on(0, vn.transpose(0, 1, 3, 2), vn)), "v layout")
    raises(lambda: cache.append(on(LAST, torch.zeros(kn.shape, device="meta"),
                                   torch.from_numpy(kn)), vn), "k", "meta")
    assert cache.length == 2 * P, "a refused append changed the cache"
    fresh = dattn.KvCache(H, Hkv, D, B, "float32", 8)
    short = np.ascontiguousarray(k[:, pos[:-1]]) if RANK == 0 else np.ascontiguousarray(k[:, pos])
    raises(lambda: fresh.prefill(short, np.ascontiguousarray(v[:, pos])), "v shape")
    raises(lambda: cache.prefill(np.ascontiguousarray(k[:, pos]),
                                 np.ascontiguousarray(v[:, pos])), "cache length")
    # KvCache arguments.
    raises(lambda: dattn.KvCache(3, 2, D, B, "float32", 8), "heads_q")
    raises(lambda: dattn.KvCache(H, Hkv, D, B, "int8", 8), "dtype")
    raises(lambda: dattn.KvCache(H, Hkv, D, B, "float32", 8, placement="first"), "placement")
    raises(lambda: dattn.KvCache(H, Hkv, D, B, "float32", on(0, -1, 8)), "capacity")
    raises(lambda: dattn.KvCache(H, Hkv, D, "one", "float32", 8), "batch")
    # star_prefill.
    qs = np.ascontiguousarray(randn(gen, B, 2 * P, H, D)[:, pos])
    ks, vs = np.ascontiguousarray(k[:, pos]), np.ascontiguousarray(v[:, pos])
    raises(lambda: dattn.star_prefill(qs, ks, vs, on(0, 0, 4)), "block")
    raises(lambda: dattn.star_prefill(on(0, qs[:, :, :, ::2], qs), ks, vs, 4), "q")
    raises(lambda: dattn.star_prefill(qs, ks, on(LAST, vs.astype(np.float64), vs), 4), "v")
    raises(lambda: dattn.star_decode(q, cache), "placement")  # not last_rank
    # mla_decode.
    t = mla_inputs()

    def mla(**bad):
        return lambda: dattn.mla_decode(**{**t, **bad})

    raises(mla(c_kv=on(0, t["c_kv"].astype(np.float16), t["c_kv"])), "c_kv")
    raises(mla(q_pe=on(LAST, t["q_pe"][..., :3].copy(), t["q_pe"])), "q_pe")
    raises(mla(w_uk=on(0, t["w_uk"].transpose(0, 2, 1).copy().transpose(0, 2, 1), t["w_uk"])),
           "w_uk layout")
    raises(mla(q_nope=on(LAST, torch.zeros(t["q_nope"].shape, device="meta"),
                         torch.from_numpy(t["q_nope"]))), "q_nope", "meta")
    raises(mla(method="rows"), "method")
    raises(mla(transform="fourier"), "transform")
    raises(mla(rope="half"), "rope")


# ---------------------------------------------------------------- main

def main():
    t0 = time.time()
    times = {}
    for name, fn in (("decode", check_decode), ("star", check_star), ("mla", check_mla),
                     ("runtime", check_runtime), ("errors", check_copies_and_bad_input)):
        t = time.time()
        worst = fn()
        times[name] = time.time() - t
        if worst is not None:
            worst = max(dattn.allreduce_sum(np.eye(P)[RANK] * worst))
            if RANK == 0:
                print(f"  {name}: worst relative error {worst:.2e}")
    if RANK == 0:
        print("test_api: " + ", ".join(f"{n} {s:.1f} s" for n, s in times.items()))
        print(f"test_api: all passed on {P} ranks in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # noqa: B902 - any failure on any rank ends the whole job
        sys.stderr.write(f"test_api: FAILED on rank {RANK} of {P}:\n{traceback.format_exc()}")
        sys.stderr.flush()
        dattn.abort(1)
