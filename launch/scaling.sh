#!/usr/bin/env bash
# Parallel efficiency of the prefill benchmark: T1 = 1 rank on P*T threads (unbound, so that its
# threads may use the cores of all P ranks) against TP = P ranks of T threads each, on the same
# problem; efficiency T1/TP at the largest sequence length (target >= 0.85, the backward >= 0.80).
#   bash launch/scaling.sh [-n P] [-T T] [dattn-prefill-bench options]
# -n P ranks (default 2), -T T threads per rank (default 1); the other options go to both runs
# (DATTN_BIN: the directory of dattn-prefill-bench, default build/bin).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${DATTN_BIN:-$here/../build/bin}
P=2
T=1
while (($# > 0)); do
  case $1 in
    -n) P=$2; shift 2 ;;
    -T) T=$2; shift 2 ;;
    *) break ;;
  esac
done
work=$(mktemp -d "${TMPDIR:-/tmp}/dattn-scaling.XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "# scaling: T1, 1 rank x $((P * T)) threads ..."
bash "$here/mpirun.sh" -n 1 --bind-to none "$bin/dattn-prefill-bench" -T $((P * T)) "$@" \
  -J "$work/t1.json"
echo "# scaling: TP, $P ranks x $T threads ..."
bash "$here/mpirun.sh" -n "$P" "$bin/dattn-prefill-bench" -T "$T" "$@" -J "$work/tp.json"
"${PYTHON:-python3}" - "$work/t1.json" "$work/tp.json" "$P" "$T" <<'PY'
import json, sys
t1, tp = (json.load(open(f)) for f in sys.argv[1:3])
P, T = int(sys.argv[3]), int(sys.argv[4])
a, b = t1["rows"][-1], tp["rows"][-1]
backward = tp["config"]["pass"] == "backward"
target = 0.80 if backward else 0.85
eff = a["time_ms"] / b["time_ms"]
print(f"# scaling: seq {b['seq']}, T1 (1 rank x {P * T} threads) = {a['time_ms']:.3f} ms, "
      f"TP ({P} ranks x {T} threads) = {b['time_ms']:.3f} ms, parallel efficiency T1/TP = "
      f"{eff:.2f} (target >= {target:.2f}{', backward' if backward else ''})")
sys.exit(0 if t1["wrong"] == 0 and tp["wrong"] == 0 else 1)
PY
