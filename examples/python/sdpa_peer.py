#!/usr/bin/env python3
"""The peer a CPU user compares dattn's attention kernel with: torch's
scaled_dot_product_attention on [B=1, S, H, D] bshd tensors (transposed views, as a model passes
them), uniform inputs in [-1, 1) like dattn-kernel-bench's. Prints the best forward time and the
best forward + backward time over --iters runs, after one warm-up each:

    peer_fwd_ms 812.3
    peer_fwdbwd_ms 2904.1

    /work/venv/bin/python examples/python/sdpa_peer.py -s 8192 -H 8 -d 128 -t bf16 -m causal -T 2

launch/prefill_peer.sh runs it beside dattn-kernel-bench and prints their ratios. Exits 77 when
torch is missing or older than 2.1 (no SDPA CPU flash kernel).
"""

import argparse
import sys
import time

try:
    import torch
except ImportError:
    print("# sdpa_peer: skipped, no torch for", sys.executable)
    sys.exit(77)
if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 1):
    print("# sdpa_peer: skipped, torch", torch.__version__, "is older than 2.1")
    sys.exit(77)


def best_ms(f, iters):
    f()
    best = float("inf")
    for _ in range(iters):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-s", "--seq", type=int, default=8192)
    ap.add_argument("-H", "--heads", type=int, default=8)
    ap.add_argument("-d", "--head-dim", type=int, default=128)
    ap.add_argument("-t", "--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    ap.add_argument("-m", "--mask", choices=["none", "causal"], default="none")
    ap.add_argument("-T", "--threads", type=int, default=2)
    ap.add_argument("-n", "--iters", type=int, default=3)
    a = ap.parse_args()
    for name in ("seq", "heads", "head_dim", "threads", "iters"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    torch.set_num_threads(a.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.rand(1, a.seq, a.heads, a.head_dim, generator=gen).mul_(2).sub_(1).to(dtype)
               for _ in range(3))
    causal = a.mask == "causal"

    def forward(q, k, v):  # bshd in, bshd out
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        return o.transpose(1, 2)

    with torch.no_grad():
        fwd = best_ms(lambda: forward(q, k, v), a.iters)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.rand_like(q)

    def fwd_bwd():
        forward(qg, kg, vg).backward(dout)
        qg.grad = kg.grad = vg.grad = None

    both = best_ms(fwd_bwd, a.iters)
    print(f"# torch {torch.__version__}, {a.threads} threads, cpu capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    print(f"peer_fwd_ms {fwd:.3f}")
    print(f"peer_fwdbwd_ms {both:.3f}")


if __name__ == "__main__":
    main()
