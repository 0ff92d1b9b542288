#!/usr/bin/env python3
"""The Python binding's overhead per call: dattn.attention and dattn.attention_local on a tiny
problem (default S=64 per rank) against the library's own forward on the same arguments, called
in a C++ loop through the same Runtime (dattn._C.time_forward). The difference is what the
binding adds: argument conversion, the ranks' agreement on the arguments, wrapping the results.
Prints one line per input kind and call, and the target (< 50 us overhead per call).

    PYTHONPATH=build/python bash launch/mpirun.sh -n 1 /usr/bin/python3 examples/python/binding_overhead.py

Collective: every rank runs the same calls; rank 0 prints the slowest rank's figures.
"""

import argparse
import sys
import time

import numpy as np

import dattn
from dattn import _C

TARGET_US = 50.0


def per_call(fn, iters):
    """Seconds per call of fn(), the slowest rank's, after a warm-up."""
    for _ in range(max(1, iters // 10)):
        fn()
    dattn.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return slowest((time.perf_counter() - start) / iters)


def slowest(seconds):
    """The largest of each rank's value (collective)."""
    return float(dattn.allreduce_sum(np.eye(dattn.world_size())[dattn.rank()] * seconds).max())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-s", "--seq", type=int, default=64, help="tokens per rank")
    p.add_argument("-H", "--heads", type=int, default=2)
    p.add_argument("-d", "--head-dim", type=int, default=64)
    p.add_argument("-n", "--iters", type=int, default=500, help="calls per measurement")
    p.add_argument("-r", "--rounds", type=int, default=5, help="measurements (the best counts)")
    a = p.parse_args()
    if min(a.iters, a.rounds, a.seq, a.heads, a.head_dim) < 1:
        p.error("--seq, --heads, --head-dim, --iters and --rounds must be >= 1")

    rng = np.random.default_rng(dattn.rank())
    q, k, v = (rng.standard_normal((1, a.seq, a.heads, a.head_dim), dtype=np.float32)
               for _ in range(3))
    inputs = [("numpy", (q, k, v))]
    try:
        import torch
        inputs.append(("torch", tuple(torch.from_numpy(x) for x in (q, k, v))))
    except ImportError:
        pass

    opts = dattn._options(False, None, None, None)
    args = [dattn._as_array(x, n) for x, n in zip((q, k, v), "qkv")]

    # Python and C++ measured alternately, the best of --rounds each: a shared machine's noise
    # only ever adds time.
    worst = 0.0
    rows = []
    for kind, (tq, tk, tv) in inputs:
        for name, local, fn in (("attention", False, lambda: dattn.attention(tq, tk, tv)),
                                ("attention_local", True,
                                 lambda: dattn.attention_local(tq, tk, tv))):
            py = cpp = float("inf")
            for _ in range(a.rounds):
                cpp = min(cpp, slowest(_C.time_forward(*args, opts, a.iters, local)))
                py = min(py, per_call(fn, a.iters))
            overhead = (py - cpp) * 1e6
            worst = max(worst, overhead)
            rows.append(f"{kind:>6} {name:>16} {py * 1e6:10.1f} {cpp * 1e6:10.1f} "
                        f"{overhead:12.1f}")
    if dattn.rank() == 0:
        print(f"# dattn binding overhead: {dattn.world_size()} rank(s), S={a.seq} per rank, "
              f"H={a.heads}, D={a.head_dim}, fp32, best of {a.rounds} x {a.iters} calls, numpy "
              f"{np.__version__}" + (f", torch {torch.__version__}" if len(inputs) > 1 else ""))
        print(f"# {'input':>4} {'call':>16} {'python us':>10} {'c++ us':>10} {'overhead us':>12}")
        print("\n".join(rows))
        verdict = "met" if worst < TARGET_US else "not met"
        print(f"# largest overhead {worst:.1f} us per call (target < {TARGET_US:.0f} us): {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
