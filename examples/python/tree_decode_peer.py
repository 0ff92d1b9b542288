#!/usr/bin/env python3
"""A plain torch peer of dattn's tree decode: each rank holds a contiguous shard of a context's
K/V cache [B, H_kv, n, D] and attends one new query per head to it with an einsum and a softmax;
the ranks merge by an allreduce of the row max and one of the weighted sums and denominators
(torch.distributed, gloo). Prints the mean step time, the slowest rank's per step.

    bash launch/mpirun.sh -n 2 /usr/bin/python3 examples/python/tree_decode_peer.py -x 262144 -H 8 -G 8

Its options are dattn-decode-bench's (-x -b -H -G -d -n -w -T, the same defaults).
launch/decode_peer.sh runs it next to dattn-decode-bench -a tree and prints their ratio. With
--check, rank 0 rebuilds every shard (each from a seed of its rank) and compares the merged output
with a softmax over the whole context in float64. Exits 77 when torch is missing.
"""

import argparse
import os
import sys
import time

try:
    import torch
    import torch.distributed as dist
except ImportError:
    print("# tree_decode_peer: skipped, no torch for", sys.executable)
    sys.exit(77)


def shard(rank, ranks, n_ctx, B, H, G, D):
    """q [B, G, H/G, D] (the same on every rank) and this rank's K, V [B, G, n, D], fp32."""
    n = n_ctx // ranks + (rank < n_ctx % ranks)
    gen = torch.Generator().manual_seed(1000 + rank)
    k = torch.randn(B, G, n, D, generator=gen)
    v = torch.randn(B, G, n, D, generator=gen)
    q = torch.randn(B, G, H // G, D, generator=torch.Generator().manual_seed(1))
    return q, k, v


def tree_decode(q, k, v, ranks):
    """softmax(q K^T / sqrt(D)) V over every rank's keys: [B, G, H/G, D]."""
    s = torch.einsum("bgrd,bgnd->bgrn", q, k) * q.shape[-1] ** -0.5
    m = s.amax(dim=-1)
    if ranks > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
    e = torch.exp(s - m.unsqueeze(-1))
    sums = torch.cat([torch.einsum("bgrn,bgnd->bgrd", e, v), e.sum(-1, keepdim=True)], dim=-1)
    if ranks > 1:
        dist.all_reduce(sums)
    return sums[..., :-1] / sums[..., -1:]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # dattn-decode-bench's names and defaults, so that one command line fits both
    ap.add_argument("-x", "--context", type=int, default=65536)
    ap.add_argument("-b", "--batch", type=int, default=1)
    ap.add_argument("-H", "--heads", type=int, default=8)
    ap.add_argument("-G", "--kv-heads", type=int, default=2)
    ap.add_argument("-d", "--head-dim", type=int, default=128)
    ap.add_argument("-n", "--steps", type=int, default=20)
    ap.add_argument("-w", "--warmup", type=int, default=2)
    ap.add_argument("-T", "--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 1)),
                    help="torch threads per rank (default OMP_NUM_THREADS, else 1)")
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    if a.heads % a.kv_heads or a.context < 1 or a.steps < 1:
        ap.error("--heads must be a multiple of --kv-heads; --context and --steps >= 1")
    torch.set_num_threads(a.threads)
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
    ranks = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1")))
    if ranks > 1:  # a file store in the job's own session folder: no port to agree on
        store = os.environ.get("OMPI_MCA_orte_jobfam_session_dir", "/tmp") + "/tree_decode_peer"
        dist.init_process_group("gloo", init_method="file://" + store, rank=rank,
                                world_size=ranks)
    q, k, v = shard(rank, ranks, a.context, a.batch, a.heads, a.kv_heads, a.head_dim)
    times = []
    for step in range(a.warmup + a.steps):
        if ranks > 1:
            dist.barrier()
        t0 = time.perf_counter()
        out = tree_decode(q, k, v, ranks)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        if ranks > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if step >= a.warmup:
            times.append(t.item() * 1e3)
    bad = 0
    if a.check and rank == 0:
        parts = [[t.double() for t in shard(r, ranks, a.context, a.batch, a.heads, a.kv_heads,
                                            a.head_dim)] for r in range(ranks)]
        k_all = torch.cat([p[1] for p in parts], dim=2)
        v_all = torch.cat([p[2] for p in parts], dim=2)
        s = torch.einsum("bgrd,bgnd->bgrn", parts[0][0], k_all) * a.head_dim ** -0.5
        ref = torch.einsum("bgrn,bgnd->bgrd", torch.softmax(s, dim=-1), v_all)
        err = (out.double() - ref).abs().max().item()
        bad = int(not err <= 1e-4)
        print(f"# check: max |out - float64| {err:.2e} ({'OK' if not bad else 'FAILED'})")
    if rank == 0:
        times.sort()
        mean = sum(times) / len(times)
        print(f"# torch tree decode peer: {ranks} ranks x {a.threads} threads, context "
              f"{a.context}, B {a.batch} H {a.heads} H_kv {a.kv_heads} D {a.head_dim} fp32, "
              f"{a.steps} steps: mean {mean:.3f} ms, p50 {times[len(times) // 2]:.3f} ms "
              f"(torch {torch.__version__})")
        print(f"peer_mean_ms {mean:.3f}")
    if ranks > 1:
        dist.destroy_process_group()
    return bad


if __name__ == "__main__":
    sys.exit(main())
