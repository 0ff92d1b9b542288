#!/usr/bin/env python3
# torch's scaled_dot_product_attention on the same inputs as dattn-cuda-kernel-bench's forward
# (bf16, bshd shapes B x S x H x D, causal and not), timed with CUDA events: the yardstick that
# tests/gpu/device_check.sh prints our kernel's ratio against. Needs a python3 with torch and a GPU;
# exits 77 (skipped) otherwise.
#   python3 tests/gpu/sdpa_bench.py [-s 16384] [-H 16] [-d 128] [-b 1] [-n 10] [--json FILE]
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-s", "--seq", type=int, default=16384)
    ap.add_argument("-H", "--heads", type=int, default=16)
    ap.add_argument("-d", "--head-dim", type=int, default=128)
    ap.add_argument("-b", "--batch", type=int, default=1)
    ap.add_argument("-n", "--iters", type=int, default=10)
    ap.add_argument("-w", "--warmup", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        print(f"SKIPPED: no torch ({e})")
        return 77
    if not torch.cuda.is_available() or not hasattr(F, "scaled_dot_product_attention"):
        print("SKIPPED: torch sees no GPU or has no scaled_dot_product_attention")
        return 77

    torch.manual_seed(0)
    dev = torch.device("cuda")
    # bshd like dattn, viewed as bhsd for torch (a transpose view: SDPA takes strided inputs).
    q, k, v = (torch.randn(a.batch, a.seq, a.heads, a.head_dim, device=dev, dtype=torch.bfloat16)
               .transpose(1, 2) for _ in range(3))
    rows = []
    print(f"# torch {torch.__version__} on {torch.cuda.get_device_name(0)}; "
          f"B={a.batch} H={a.heads} S={a.seq} D={a.head_dim} bf16")
    print(f"# {'causal':>6} {'time_ms':>10} {'TFLOP/s':>10}")
    for causal in (False, True):
        for _ in range(a.warmup):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(a.iters):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        stop.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(stop) / a.iters
        flops = 4.0 * a.batch * a.heads * a.seq * a.seq * a.head_dim * (0.5 if causal else 1.0)
        tflops = flops / (ms * 1e-3) / 1e12
        print(f"  {int(causal):>6} {ms:>10.3f} {tflops:>10.1f}")
        rows.append({"name": "torch_sdpa", "dtype": "bf16", "causal": causal, "seq": a.seq,
                     "heads": a.heads, "head_dim": a.head_dim, "batch": a.batch,
                     "time_ms": ms, "tflops": tflops, "torch": torch.__version__})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
