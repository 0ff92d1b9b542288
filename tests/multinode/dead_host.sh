#!/usr/bin/env bash
# A host that dies mid-ring (issue 19, item 6), on tests/multinode/cluster.sh's 2 hosts x 2 ranks:
# the prefill benchmark runs a long ring (watchdog deadline DATTN_TIMEOUT = 5 s), and 4 s in
#   kill: node1's ranks are killed (kill -9): mpiexec must end, non-zero, within the deadline;
#   link: node1's link goes down (ip link set eth0 down): every rank must be gone within the
#         deadline plus a grace for MPI_Abort (5 s), and a watchdog line must name the wait
#         (and the messages it waited for, where it was a point-to-point wait). (mpiexec itself then waits for node1's daemon over
#         the cut link, as TCP retries; the script ends it.)
#   bash tests/multinode/dead_host.sh kill|link     (exit 0: the case held; 77: no cluster here)
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bin=${DATTN_BUILD_DIR:-$(dirname "$(dirname "$here")")/build}/bin
case=${1:-}
[[ $case == kill || $case == link ]] || { echo "dead_host.sh: expected kill or link" >&2; exit 2; }
log=$(mktemp)
trap 'rm -f "$log" "$log".err.*' EXIT
deadline=5 cut_at=4 grace=5  # grace: for MPI_Abort to end the ranks after the watchdog
# Inside node0: the job in the background, the failure at cut_at, then the checks.
bash "$here/cluster.sh" -- bash -c '
  case=$1 bin=$2 deadline=$3 cut_at=$4 grace=$5
  # Each rank writes its stderr to a file of its own: a line forwarded through mpiexec can be
  # lost when the job is aborted, and node1'"'"'s cannot cross the cut link.
  export DATTN_TIMEOUT=$deadline DATTN_ERR=$6
  mpiexec -n 4 sh -c '"'"'exec "$0" "$@" 2>"$DATTN_ERR.err.$OMPI_COMM_WORLD_RANK"'"'"' \
    "$bin/dattn-prefill-bench" -s 4096 -n 100000 -k 0 &
  job=$!
  sleep "$cut_at"
  t0=$SECONDS
  if [[ $case == kill ]]; then
    ip netns pids "${DATTN_CLUSTER_PREFIX}h1" | while read -r p; do
      [[ $(cat /proc/$p/comm 2>/dev/null) == dattn-prefill-b* ]] && kill -9 "$p"
    done
  else
    ip -n "${DATTN_CLUSTER_PREFIX}h1" link set eth0 down
  fi
  echo "# node1: $case at $(date +%T)"
  limit=$((deadline + grace + 5))
  ranks_left() {
    local ns n=0
    for ns in "${DATTN_CLUSTER_PREFIX}h0" "${DATTN_CLUSTER_PREFIX}h1"; do
      for p in $(ip netns pids "$ns"); do
        [[ $(cat /proc/$p/comm 2>/dev/null) == dattn-prefill-b* ]] && n=$((n + 1))
      done
    done
    echo "$n"
  }
  while (( SECONDS - t0 < limit )); do
    if [[ $case == kill ]]; then kill -0 "$job" 2>/dev/null || break
    else (( $(ranks_left) == 0 )) && break; fi
    sleep 0.5
  done
  took=$((SECONDS - t0))
  if [[ $case == kill ]]; then
    if kill -0 "$job" 2>/dev/null; then echo "# FAIL: mpiexec still running ${took} s after the kill"; exit 1; fi
    wait "$job"; rc=$?
    (( rc != 0 )) || { echo "# FAIL: mpiexec exited 0 after node1 died"; exit 1; }
    echo "# mpiexec ended (exit $rc) ${took} s after the kill"
  else
    left=$(ranks_left)
    (( left == 0 )) || { echo "# FAIL: $left rank(s) still running ${took} s after the cut"; exit 1; }
    echo "# every rank ended ${took} s after the cut (deadline ${deadline} s + grace ${grace} s)"
    kill -9 "$job" 2>/dev/null
  fi
  exit 0
 ' dead_host "$case" "$bin" "$deadline" "$cut_at" "$grace" "$log" >"$log" 2>&1
rc=$?
cat "$log".err.* >>"$log" 2>/dev/null
grep -E '^# (node1|mpiexec|every|FAIL|cluster)|dattn watchdog' "$log"
((rc == 77)) && { tail -n 1 "$log"; exit 77; }
((rc == 0)) || { tail -n 30 "$log"; exit 1; }
if ! grep -q '^# dattn prefill benchmark' "$log"; then
  echo "# FAIL: the benchmark did not start"; tail -n 30 "$log"; exit 1
fi
# The line names the operation ("point-to-point wait on cp", "barrier on world": the cut can
# come in the benchmark's barrier between forwards) and, for messages, each pending one.
if [[ $case == link ]] && ! grep -qE 'dattn watchdog: .+ on .+ waited [0-9.]+ s' "$log"; then
  echo "# FAIL: no watchdog line naming the wait"; tail -n 30 "$log"; exit 1
fi
echo "# dead host ($case): PASS"
