#!/usr/bin/env python3
"""dattn.from_comm under mpiexec (2-3 ranks) in a program that uses mpi4py: mpi4py imported
first (it initialises MPI; dattn must not again, nor finalise it at exit), a Runtime over
COMM_WORLD, then COMM_WORLD split in two groups that run independent attention and decode calls
at once, each checked against the float64 reference of its own group's sequence; a rank left out
of a split (MPI.UNDEFINED), MPI.COMM_NULL, a freed communicator and a non-communicator raise
dattn.InvalidArgumentError naming comm.

A failure on any rank prints the reason and aborts the job. Exits 77 (skipped) when numpy or
mpi4py cannot be imported (Debian: python3-mpi4py).
  PYTHONPATH=build/python bash launch/mpirun.sh -n 3 /usr/bin/python3 tests/python/test_from_comm.py
"""

import sys
import traceback

try:
    import numpy as np
    from mpi4py import MPI
except ImportError as e:  # nothing started MPI yet: a plain exit is clean
    print(f"test_from_comm: SKIPPED: {e} (needs numpy and mpi4py, e.g. Debian's python3-mpi4py)")
    sys.exit(77)

THREAD_LEVEL = MPI.Query_thread()  # mpi4py's, before dattn is imported

import dattn  # noqa: E402 - after mpi4py on purpose

WORLD = MPI.COMM_WORLD
RANK, P = WORLD.Get_rank(), WORLD.Get_size()


def attention_ref(q, k, v, q_pos, k_pos):
    """Causal attention in float64: out [B, Sq, H, Dv], lse [B, H, Sq]; GQA by repeating K/V."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[3])
    s = np.where(np.asarray(k_pos)[None, :] <= np.asarray(q_pos)[:, None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    lse = (m + np.log(np.exp(s - m).sum(axis=-1, keepdims=True)))[..., 0]
    return np.einsum("bhqk,bkhd->bqhd", np.exp(s - lse[..., None]), v), lse


def check_close(got, ref, what, tol=2e-5):
    e = float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())
    assert e <= tol, f"rank {RANK}: {what}: relative error {e:.3e} > {tol}"


def raises_naming_comm(fn):
    try:
        fn()
    except dattn.InvalidArgumentError as e:
        assert "comm" in str(e), f"rank {RANK}: the message should name comm: {e}"
        return
    raise AssertionError(f"rank {RANK}: no InvalidArgumentError naming comm")


def group_calls(rt, color):
    """Attention and a decode step of this group's own sequence over rt (its ranks), against
    the float64 reference of that sequence. The groups differ in seed and length."""
    B, H, Hkv, D = 1, 4, 2, 16
    S = 23 + 11 * color
    gen = np.random.default_rng(10 + color)
    q, k, v = (gen.standard_normal((B, S + 1, h, D)).astype(np.float32) for h in (H, Hkv, Hkv))
    pos = dattn.layout_positions("zigzag", S, runtime=rt)
    shard = [np.ascontiguousarray(t[:, pos]) for t in (q, k, v)]
    out, lse = dattn.attention(*shard, causal=True, layout="zigzag", return_lse=True, runtime=rt)
    ref_out, ref_lse = attention_ref(q[:, :S], k[:, :S], v[:, :S], np.arange(S), np.arange(S))
    check_close(out, ref_out[:, pos], f"group {color} attention out")
    check_close(lse, ref_lse[:, :, pos], f"group {color} attention lse")

    cache = dattn.KvCache(H, Hkv, D, B, "float32", S + 1, runtime=rt)
    cache.prefill(shard[1], shard[2], layout="zigzag")
    cache.append(np.ascontiguousarray(k[:, S:]), np.ascontiguousarray(v[:, S:]))
    qn = np.ascontiguousarray(q[:, S:])
    out, lse = dattn.decode(qn, cache, strategy="ring", return_lse=True)  # the cache's runtime
    ref_out, ref_lse = attention_ref(qn, k, v, [S], np.arange(S + 1))
    check_close(out, ref_out, f"group {color} decode out")
    check_close(lse, ref_lse, f"group {color} decode lse")


def main():
    assert MPI.Query_thread() == THREAD_LEVEL, "importing dattn changed MPI's thread level"

    rt = dattn.from_comm(WORLD, threads=1)
    assert (rt.rank, rt.size, rt.cp_size, rt.threads) == (RANK, P, P, 1), rt
    assert rt.comm is WORLD

    # Two groups (even and odd ranks), each a Runtime over its own communicator; their calls run
    # at the same time and never meet.
    color = RANK % 2
    sub = WORLD.Split(color, RANK)
    group = dattn.from_comm(sub)
    assert (group.size, group.rank) == (sub.Get_size(), sub.Get_rank()), group
    group_calls(group, color)
    # Bad options are agreed within the group only.
    try:
        dattn.from_comm(sub, tp=sub.Get_size() + 1)
        raise AssertionError("tp larger than the group was accepted")
    except dattn.InvalidArgumentError as e:
        assert "tp" in str(e), e

    # The last rank is left out of a split: it holds MPI.COMM_NULL and raises alone; the others
    # make their runtime without it.
    part = WORLD.Split(MPI.UNDEFINED if RANK == P - 1 else 0, RANK)
    if RANK == P - 1:
        assert part == MPI.COMM_NULL
        raises_naming_comm(lambda: dattn.from_comm(part))
    else:
        assert dattn.from_comm(part).size == P - 1
        part.Free()

    raises_naming_comm(lambda: dattn.from_comm(MPI.COMM_NULL))
    freed = WORLD.Dup()
    freed.Free()
    raises_naming_comm(lambda: dattn.from_comm(freed))
    raises_naming_comm(lambda: dattn.from_comm("MPI_COMM_WORLD"))

    # The default runtime (MPI_COMM_WORLD) still works beside them.
    x = np.ones((1, 1, 2, 8), np.float32)
    assert dattn.attention(x, x, x).shape == (1, 1, 2, 8)
    sub.Free()
    if RANK == 0:
        print(f"test_from_comm: all passed on {P} ranks (groups of "
              f"{', '.join(str(n) for n in sorted({(P + 1) // 2, P // 2}))} ranks)")


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # noqa: B902 - any failure on any rank ends the whole job
        sys.stderr.write(f"test_from_comm: FAILED on rank {RANK} of {P}:\n"
                         f"{traceback.format_exc()}")
        sys.stderr.flush()
        dattn.abort(1)
