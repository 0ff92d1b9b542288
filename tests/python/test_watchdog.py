#!/usr/bin/env python3
"""The watchdog covers the Python module's own collectives: with DATTN_TIMEOUT=2, rank 0 enters
dattn.barrier() (or dattn.allreduce_sum, with the argument "allreduce") while rank 1 sleeps, and
the job must end with a "dattn watchdog:" line (ctest's pass condition) instead of hanging.
Exits 77 (skipped) on one rank.
  DATTN_TIMEOUT=2 PYTHONPATH=build/python bash launch/mpirun.sh -n 2 /usr/bin/python3 \\
      tests/python/test_watchdog.py allreduce
"""

import sys
import time

import numpy as np

import dattn

if dattn.world_size() < 2:
    print("test_watchdog: SKIPPED: needs 2 ranks or more")
    sys.exit(77)
collective = sys.argv[1] if len(sys.argv) > 1 else "barrier"
dattn.barrier()  # the default runtime exists on every rank before the wait begins
if dattn.rank() == 1:
    time.sleep(60)  # far past the deadline: the watchdog on rank 0 ends the job first
if collective == "allreduce":
    dattn.allreduce_sum(np.ones(3))
else:
    dattn.barrier()
print(f"test_watchdog: FAILED: {collective} returned on rank {dattn.rank()} past the deadline")
sys.exit(1)
