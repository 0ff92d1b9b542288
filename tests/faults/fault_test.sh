#!/usr/bin/env bash
# Fault tests of the watchdog: one rank of tests/fault_inject sleeps past the deadline or kills
# itself, at 2, 3 and 4 ranks, and the whole job must end, non-zero, within the deadline + 30 s,
# with the watchdog's line (or Open MPI's "exited on signal 9"). Controls: no fault, and a rank
# slower than the deadline allows must both complete; the deadline's precedence (option >
# DATTN_TIMEOUT > 300 s) and a bad DATTN_TIMEOUT. Each mpiexec runs under `timeout`, so a hang
# fails the test instead of blocking it. One line per case; exit 1 if any case failed.
#   bash tests/faults/fault_test.sh BUILD/tests/fault_inject [MPIEXEC]
set -uo pipefail

bin=${1:?usage: fault_test.sh FAULT_INJECT_BINARY [MPIEXEC]}
mpiexec=${2:-mpiexec}
deadline=3  # seconds: short, so that the whole test takes about a minute
slack=30    # the job must end within deadline + slack
failed=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT

now() { date +%s.%N; }

# case NAME NP EXPECT PATTERN [VAR=VALUE ...] -- ARGS...
#   EXPECT: "abort" (non-zero exit within the bound, PATTERN in the output, and not before the
#   deadline when sleeping) or "ok" (exit 0, no watchdog line). Extra VAR=VALUE go to the
#   environment of mpiexec; ARGS to fault_inject.
run_case() {
  local name=$1 np=$2 expect=$3 pattern=$4
  shift 4
  local envs=()
  while [[ $1 != -- ]]; do envs+=("$1"); shift; done
  shift
  local t0 t1 rc limit=$((deadline + slack + 10))
  t0=$(now)
  env "${envs[@]}" timeout -k 5 $limit "$mpiexec" -n "$np" "$bin" "$@" >"$log" 2>&1
  rc=$?
  t1=$(now)
  local took match verdict=PASS why=""
  took=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  match=$(grep -m1 -oE "$pattern" "$log")
  if [[ $expect == abort ]]; then
    if ((rc == 0)); then
      verdict=FAIL why=" (exit 0, expected non-zero)"
    # Not by exit code: mpiexec itself exits 137 when a rank died of SIGKILL.
    elif awk -v t="$took" -v l=$limit 'BEGIN { exit !(t >= l) }'; then
      verdict=FAIL why=" (hung: killed by timeout after $limit s)"
    elif awk -v t="$took" -v d=$((deadline + slack)) 'BEGIN { exit !(t > d) }'; then
      verdict=FAIL why=" (over the bound)"
    elif [[ -z $match ]]; then
      verdict=FAIL why=" (no line matching: $pattern)"
    elif [[ $name == sleep-* ]] && awk -v t="$took" -v d=$deadline 'BEGIN { exit !(t < d) }'; then
      verdict=FAIL why=" (ended before the deadline)"
    fi
    echo "fault $name np$np: ended in $took s (deadline $deadline s + $slack s) with \"$match\" exit $rc $verdict$why"
  else
    if ((rc != 0)); then
      verdict=FAIL why=" (exit $rc)"
    elif grep -q "dattn watchdog" "$log"; then
      verdict=FAIL why=" (the watchdog fired)"
    elif [[ -n $pattern && -z $match ]]; then
      verdict=FAIL why=" (no line matching: $pattern)"
    fi
    echo "fault $name np$np: completed in $took s${match:+ with \"$match\"} exit $rc $verdict$why"
  fi
  if [[ $verdict != PASS ]]; then
    failed=1
    sed 's/^/    | /' "$log" | tail -n 30
  fi
}

wd="dattn watchdog: [^;]*deadline $deadline s\)"
for np in 2 3 4; do
  # A rank sleeps before a collective the others are in: they stop at the deadline (given by
  # DATTN_TIMEOUT here).
  run_case sleep-collective "$np" abort "dattn watchdog: allreduce on cp[^;]*\)" \
    DATTN_TIMEOUT=$deadline -- sleep-collective
  # ... before a dattn::attention call: the others wait in its validation (an allreduce).
  run_case sleep-attention "$np" abort "dattn watchdog: allreduce \(control\)[^;]*\)" \
    DATTN_TIMEOUT=$deadline -- sleep-attention
  # ... inside ring attention, between its sends and its wait. The deadline comes from the option
  # (RuntimeOptions.timeout_s), which wins over DATTN_TIMEOUT.
  run_case sleep-ring "$np" abort "dattn watchdog: point-to-point wait[^;]*\)" \
    DATTN_TIMEOUT=100 -- sleep-ring --timeout $deadline
  # A rank dies there (SIGKILL): Open MPI or the survivors' watchdog ends the job.
  run_case kill-ring "$np" abort "exited on signal 9|$wd" \
    DATTN_TIMEOUT=$deadline -- kill-ring
done

# Controls: no fault; a rank 1 s late (under the deadline) must not trip the watchdog.
run_case ok-ring 3 ok "fault_inject ok-ring: completed" DATTN_TIMEOUT=$deadline -- ok-ring
run_case slow-ring 3 ok "fault_inject sleep-ring: completed" DATTN_TIMEOUT=$deadline -- \
  sleep-ring --sleep 1

# The deadline: 300 s by default, DATTN_TIMEOUT over that, RuntimeOptions.timeout_s over both;
# a bad DATTN_TIMEOUT is an error that names it.
run_case deadline-default 1 ok "deadline 300" -u DATTN_TIMEOUT -- print-deadline
run_case deadline-env 1 ok "deadline 7" DATTN_TIMEOUT=7 -- print-deadline
run_case deadline-option 1 ok "deadline 2.5" DATTN_TIMEOUT=7 -- print-deadline --timeout 2.5
run_case deadline-bad-env 1 abort "invalid DATTN_TIMEOUT = \"soon\"" DATTN_TIMEOUT=soon -- \
  print-deadline

exit $failed
