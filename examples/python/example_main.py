"""What the training examples (train_tiny.py, train_zigzag.py, hf_transformers.py) share: the loss
table of a distributed run against its reference, and the main guard that ends the whole MPI job
when any rank fails. Imported from the examples' own folder (Python puts it on sys.path).
"""

import sys
import traceback

import dattn


def compare_losses(losses, ref, tolerance):
    """Prints each step's loss beside the reference's and their relative difference; returns
    whether every step is within tolerance (relative) and the loss went down."""
    print(f"{'step':>4s}  {'loss (dattn fp32)':>18s}  {'loss (torch fp64)':>18s}  "
          f"{'|diff| / loss':>13s}")
    worst = 0.0
    for step, (a, b) in enumerate(zip(losses, ref), 1):
        rel = abs(a - b) / abs(b)
        worst = max(worst, rel)
        print(f"{step:4d}  {a:18.9f}  {b:18.9f}  {rel:13.2e}")
    ok = worst <= tolerance and losses[-1] < losses[0]
    print(f"max relative difference {worst:.2e} (tolerance {tolerance:.0e}); loss "
          f"{losses[0]:.6f} -> {losses[-1]:.6f}: {'OK' if ok else 'FAILED'}")
    return ok


def verdict(ok):
    """The exit code of every rank: 1 unless rank 0's ok (other ranks pass True). Collective."""
    return 1 if dattn.allreduce_sum(0.0 if ok else 1.0) > 0 else 0


def run(main, name):
    """sys.exit(main()); an exception on any rank prints its traceback and aborts the job, so that
    no rank waits for it in a collective. SystemExit (--help, a bad option: the same on every
    rank) passes through."""
    try:
        code = main()
    except SystemExit:
        raise
    except BaseException:  # noqa: B902 - a failure on any rank ends the whole job
        sys.stderr.write(f"{name}: FAILED on rank {dattn.rank()}:\n{traceback.format_exc()}")
        sys.stderr.flush()
        dattn.abort(1)
    sys.exit(code)
