#!/usr/bin/env bash
# A real Slurm cluster in CI: starts a one-node Slurm (slurmctld + slurmd + munged) on localhost in
# a private temporary folder, submits slurm/dattn-cpu.sbatch with 2 and with 4 tasks (the second
# overcommitted), and checks that both jobs complete with correct results (every row's #wrong 0,
# "Out of bounds values : 0 OK"). The cluster is shut down by process id on every exit path.
#   bash tests/slurm/slurm_test.sh REPO_ROOT DATTN_RUN      (ctest: the slurm_cluster test)
# Needs root on Debian (installs slurmctld slurmd slurm-client munge when missing and runs the
# daemons without systemd); elsewhere it exits 77 (skipped). Exit 0: pass, anything else: fail.
# Environment: DATTN_SLURM_TIMEOUT (seconds for cluster start plus jobs, default 100),
# DATTN_SLURM_KEEP=1 keeps the temporary folder (configuration, logs, job outputs),
# DATTN_SLURM_SBATCH_ARGS adds sbatch options to both jobs (split at spaces).
# DATTN_SLURM_HOSTS=N (N >= 2, inside tests/multinode/cluster.sh --hosts N): one slurmd per
# namespace host (NodeName node0..node{N-1} at 10.213.0.1..N), slurmctld on node0, and one job
# instead of two: the unedited sbatch script with -N N, 2 tasks a node, its ranks on every host.
set -euo pipefail

t_start=$EPOCHREALTIME
say() { echo "slurm test: $*"; }
skip() { echo "slurm test: SKIPPED: $*"; exit 77; }
fail() { echo "slurm test: FAIL: $*" >&2; exit 1; }
# Seconds since $1 (an EPOCHREALTIME), with one decimal.
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }

(($# == 2)) || { echo "usage: $0 REPO_ROOT DATTN_RUN" >&2; exit 2; }
repo=$(cd "$1" && pwd)
run=$2
[[ $run = /* ]] || run=$PWD/$run
script=$repo/slurm/dattn-cpu.sbatch
[[ -f $script ]] || fail "no $script"
[[ -x $run ]] || fail "no executable dattn-run at $run"

((EUID == 0)) || skip "needs root (starts slurmctld, slurmd and munged without systemd)"
if ! command -v dpkg-query >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1; then
  skip "not Debian (no dpkg-query/apt-get) to install Slurm from"
fi

# ---------------------------------------------------------------- packages
t_phase=$EPOCHREALTIME
packages=(slurmctld slurmd slurm-client munge)
missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ $status = "install ok installed" ]] || missing+=("$p")
done
if ((${#missing[@]})); then
  say "installing ${missing[*]}"
  log=$(mktemp "${TMPDIR:-/tmp}/dattn-slurm-apt.XXXXXX.log")
  if ! { apt-get update -q &&
         DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
       } >"$log" 2>&1 </dev/null; then
    tail -n 40 "$log" >&2
    fail "apt-get install ${missing[*]} failed (log: $log)"
  fi
  rm -f "$log"
fi
for tool in munged slurmctld slurmd sbatch squeue sinfo scontrol scancel setpriv; do
  command -v "$tool" >/dev/null 2>&1 || fail "$tool not found after installing ${packages[*]}"
done
id munge >/dev/null 2>&1 || fail "no munge user (the munge package creates it)"
t_packages=$(since "$t_phase")
say "packages: $t_packages s"

# The limit on cluster start plus jobs (package installs not counted).
timeout_s=${DATTN_SLURM_TIMEOUT:-100}
deadline=$((SECONDS + timeout_s))

# ---------------------------------------------------------------- private folder and cleanup
# In /tmp rather than $TMPDIR: munged runs as the munge user and must reach its folder below, and
# the socket's path must stay short.
dir=$(mktemp -d /tmp/dattn-slurm.XXXXXX)
chmod 755 "$dir"
conf=$dir/slurm.conf
export SLURM_CONF=$conf
munged_pid='' ctld_pid='' slurmd_pid=''  # slurmd_pid: one per host, space-separated
hosts=${DATTN_SLURM_HOSTS:-1}
if ((hosts > 1)); then
  [[ -n ${DATTN_CLUSTER_PREFIX:-} ]] ||
    fail "DATTN_SLURM_HOSTS=$hosts needs the hosts of tests/multinode/cluster.sh (run inside it)"
fi
status_ok=0

# Processes of this cluster other than the daemons (slurmstepd, job scripts, ranks) all carry
# SLURM_CONF=$conf in their environment, as the daemons pass theirs on; found here by that mark.
cluster_pids() {
  local f pid
  for f in /proc/[0-9]*/environ; do
    pid=${f#/proc/}; pid=${pid%/environ}
    [[ $pid = "$$" || $pid = "$BASHPID" || $pid = "$munged_pid" ]] && continue
    if tr '\0' '\n' 2>/dev/null <"$f" | grep -qxF "SLURM_CONF=$conf"; then echo "$pid"; fi
  done
}

# Waits up to $1 seconds for the processes $2... to end (children of this shell are reaped).
wait_gone() {
  local limit=$((SECONDS + $1)) pid alive
  shift
  while :; do
    alive=0
    for pid in "$@"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    ((alive)) || return 0
    ((SECONDS < limit)) || return 1
    sleep 0.1
  done
}

stop_pid() {  # TERM, then KILL after 5 s; reaps it when it is our child
  local pid=$1
  [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || true
  wait_gone 5 "$pid" || kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

print_diagnostics() {
  local f
  if [[ -n $ctld_pid ]] && kill -0 "$ctld_pid" 2>/dev/null; then
    echo "---------------- squeue / sinfo" >&2
    timeout 10 squeue -a -o '%i %j %T %r %D %C' 2>&1 | head -20 >&2
    timeout 10 sinfo -N -o '%N %T %c %E' 2>&1 | head -5 >&2
  fi
  for f in "$dir/slurmctld.log" "$dir"/slurmd*.log "$dir/munge/munged.log"; do
    [[ -f $f ]] || continue
    echo "---------------- last lines of $f" >&2
    tail -n 25 "$f" >&2
  done
  for f in "$dir"/*.out; do
    [[ -f $f ]] || continue
    echo "---------------- $f" >&2
    tail -n 40 "$f" >&2
  done
}

cleanup() {
  local rc=$? t=$EPOCHREALTIME pids=()
  trap - EXIT INT TERM HUP
  set +e
  ((rc == 0 && status_ok)) || print_diagnostics
  if [[ -n $ctld_pid ]] && kill -0 "$ctld_pid" 2>/dev/null; then
    # Jobs still there (a failure or timeout): cancel them, then stop both daemons.
    if [[ -n $(squeue -h -o %i 2>/dev/null) ]]; then
      scancel --quiet --full --user=root 2>/dev/null
      local limit=$((SECONDS + 5))
      while [[ -n $(squeue -h -o %i 2>/dev/null) ]] && ((SECONDS < limit)); do sleep 0.2; done
    fi
    scontrol shutdown >/dev/null 2>&1
  fi
  wait_gone 10 $slurmd_pid $ctld_pid
  for p in $slurmd_pid; do stop_pid "$p"; done
  stop_pid "$ctld_pid"
  # Leftovers of jobs (slurmstepd outlives slurmd): by process id, TERM then KILL.
  mapfile -t pids < <(cluster_pids)
  if ((${#pids[@]})); then
    say "stopping leftover processes:"
    ps -o pid=,ppid=,args= -p "$(IFS=,; echo "${pids[*]}")" 2>/dev/null | sed 's/^/  /'
    kill -TERM "${pids[@]}" 2>/dev/null
    wait_gone 3 "${pids[@]}" || kill -KILL "${pids[@]}" 2>/dev/null
  fi
  stop_pid "$munged_pid"
  if [[ ${DATTN_SLURM_KEEP:-0} = 1 ]]; then say "kept $dir"; else rm -rf "$dir"; fi
  say "shutdown: $(since "$t") s"
  say "$(since "$t_start") s (target < 120 s)"
  if ((rc == 0)); then say PASS; else say "FAIL (exit $rc)" >&2; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

# ---------------------------------------------------------------- start the cluster
t_phase=$EPOCHREALTIME

# Two free TCP ports (slurmctld, slurmd), so that another Slurm on this machine does not collide.
# They come from below the kernel's ephemeral range (ip_local_port_range): a port there can be the
# local end of any outgoing connection at any moment, which makes slurmctld's bind fail with
# "Address already in use" although nothing listens on it. A port counts as used when any socket
# in /proc/net/tcp{,6} has it as its local port, in any state.
used_ports() {
  local f _sl addr _rest
  for f in /proc/net/tcp /proc/net/tcp6; do
    [[ -r $f ]] || continue
    while read -r _sl addr _rest; do
      [[ $addr = *:* ]] && echo $((16#${addr##*:}))
    done < <(tail -n +2 "$f")
  done
}
pick_ports() {
  local low=32768 used base i
  read -r low _ </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || true
  ((low > 12000)) || low=32768
  used=" $(used_ports | tr '\n' ' ') "
  for ((i = 0; i < 200; i++)); do
    base=$((10000 + RANDOM % (low - 10002)))
    [[ $used = *" $base "* || $used = *" $((base + 1)) "* ]] && continue
    ctld_port=$base slurmd_port=$((base + 1))
    return 0
  done
  fail "no two free TCP ports below $low"
}

# munge: its own key and socket in the private folder, owned by the munge user.
mkdir -p "$dir/munge" "$dir/state" "$dir/spool" "$dir/tmp"
head -c 1024 /dev/urandom >"$dir/munge/munge.key"
chown -R munge:munge "$dir/munge"
chmod 755 "$dir/munge"  # clients (root here, but also job users) need to reach the socket
chmod 400 "$dir/munge/munge.key"
setpriv --reuid=munge --regid=munge --init-groups -- \
  munged --foreground --socket="$dir/munge/munge.socket.2" --key-file="$dir/munge/munge.key" \
         --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" \
         --seed-file="$dir/munge/munged.seed" </dev/null >"$dir/munged.stdout" 2>&1 &
munged_pid=$!
until [[ -S $dir/munge/munge.socket.2 ]]; do
  kill -0 "$munged_pid" 2>/dev/null || { cat "$dir/munged.stdout" >&2; fail "munged exited"; }
  ((SECONDS < deadline)) || fail "munged did not create its socket"
  sleep 0.05
done

ncpu=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc obeys those
# One node on localhost, or the cluster's hosts (each sees this machine's CPUs); the slurmd files
# carry the node's name (%n) where there are several.
if ((hosts > 1)); then
  ctld_host="node0(10.213.0.1)" node_names="node[0-$((hosts - 1))]" node_addrs="10.213.0.[1-$hosts]"
  node_suffix=-%n
  for ((i = 0; i < hosts; i++)); do mkdir -p "$dir/spool-node$i"; done
else
  ctld_host=localhost node_names=localhost node_addrs=127.0.0.1 node_suffix=""
fi
mem_mb=$(awk '/^MemTotal:/ { printf "%d", $2 / 1024 * 0.9 }' /proc/meminfo)
write_conf() {
  cat >"$conf" <<EOF
# One-node Slurm of tests/slurm/slurm_test.sh (temporary).
ClusterName=dattntest
SlurmctldHost=$ctld_host
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket.2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool$node_suffix
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd$node_suffix.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd$node_suffix.log
# The PMIx plugin makes its per-step folders (spmix_appdir_UID_JOB.STEP) under TmpFS; job ids
# restart at 1 in every new cluster, so folders left in /tmp by a killed step would make the next
# run's steps fail ("File exists").
TmpFS=$dir/tmp
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=pmix
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
# Schedule batch jobs at once (the default may hold them up to 3 s).
SchedulerParameters=batch_sched_delay=0
NodeName=$node_names NodeAddr=$node_addrs Sockets=1 CoresPerSocket=$ncpu ThreadsPerCore=1 RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$node_names Default=YES MaxTime=INFINITE State=UP
EOF
}

# Starts both daemons and waits until the node is idle. Returns 3 when a daemon could not bind its
# port (taken between pick_ports and the bind), so the caller can retry on other ports.
start_daemons() {
  local f
  rm -f "$dir"/slurmctld.stdout "$dir"/slurmd.stdout "$dir"/state/*
  slurmctld -D -i -f "$conf" </dev/null >"$dir/slurmctld.stdout" 2>&1 &
  ctld_pid=$!
  if ((hosts > 1)); then
    slurmd_pid=""
    # Each in its host: its network, its hostname, and a TmpFS of its own (the PMIx plugin makes
    # the same step folders there on every node: a mount namespace binds tmp-node<i> over it).
    # nsenter, not ip netns exec, which mounts a /sys of its own without the cgroup file systems
    # that slurmd's cgroup plugin reads.
    for ((i = 0; i < hosts; i++)); do
      mkdir -p "$dir/tmp-node$i"
      nsenter --net="/run/netns/${DATTN_CLUSTER_PREFIX}h$i" unshare --uts --mount sh -c \
        "hostname node$i && mount --bind '$dir/tmp-node$i' '$dir/tmp' && exec slurmd -D -N node$i -f '$conf'" \
        </dev/null >>"$dir/slurmd.stdout" 2>&1 &
      slurmd_pid+="$! "
    done
  else
    slurmd -D -N localhost -f "$conf" </dev/null >"$dir/slurmd.stdout" 2>&1 &
    slurmd_pid=$!
  fi
  until [[ $(sinfo -h -o '%t %D' 2>/dev/null) = "idle $hosts" ]]; do
    for f in slurmctld $slurmd_pid; do
      local pid=$ctld_pid
      [[ $f != slurmctld ]] && pid=$f f=slurmd
      kill -0 "$pid" 2>/dev/null && continue
      if grep -q "Address already in use" "$dir/$f.stdout"; then
        say "$f: port $ctld_port/$slurmd_port taken, retrying on others"
        for p in $slurmd_pid; do stop_pid "$p"; done; stop_pid "$ctld_pid"
        ctld_pid='' slurmd_pid=''
        return 3
      fi
      cat "$dir/$f.stdout" >&2
      fail "$f exited"
    done
    ((SECONDS < deadline)) || fail "the node did not become idle within ${timeout_s} s"
    sleep 0.1
  done
}

for attempt in 1 2 3 4 5; do
  pick_ports
  write_conf
  rc=0
  start_daemons || rc=$?
  ((rc == 0)) && break
  ((attempt < 5)) || fail "slurmctld or slurmd could not bind a port in 5 attempts"
done
t_cluster=$(since "$t_phase")
say "cluster up on ports $ctld_port/$slurmd_port, $ncpu CPUs: $t_cluster s"

# ---------------------------------------------------------------- jobs
t_phase=$EPOCHREALTIME
# The batch script must bring its own MPI settings: none of the caller's reach it.
for v in $(compgen -e); do
  case $v in OMPI_*|PMIX_*|OMP_NUM_THREADS) unset "$v" ;; esac
done
export DATTN_RUN=$run
workload=(prefill -s 1024 -e 2048 -n 1 -w 0 -k 1)
declare -A job_of  # tasks -> job id
tasks=(2 4)
((hosts > 1)) && tasks=($((2 * hosts)))
for n in "${tasks[@]}"; do
  extra=()
  ((n > ncpu)) && extra=(--overcommit)
  ((hosts > 1)) && extra=(--nodes="$hosts" --ntasks-per-node=2)
  read -r -a more <<<"${DATTN_SLURM_SBATCH_ARGS:-}"
  id=$(cd "$dir" && sbatch --parsable --job-name="dattn-np$n" --ntasks="$n" "${extra[@]}" "${more[@]}" \
         --time=5 --output="$dir/%x-%j.out" "$script" "${workload[@]}") ||
    fail "sbatch with $n tasks failed"
  job_of[$n]=${id%%;*}
  say "submitted job ${job_of[$n]}: $n tasks ${extra[*]}"
done

# Wait until no job is pending or running (squeue lists only those by default).
while :; do
  queued=$(squeue -h -o %i) || fail "squeue failed"
  [[ -n $queued ]] || break
  ((SECONDS < deadline)) || fail "jobs still queued or running after ${timeout_s} s"
  sleep 0.2
done
say "jobs done: $(since "$t_phase") s"

# ---------------------------------------------------------------- check
errors=0
for n in "${tasks[@]}"; do
  j=${job_of[$n]}
  info=$(scontrol -o show job "$j") || fail "scontrol show job $j failed"
  state=$(sed -n 's/.* JobState=\([^ ]*\).*/\1/p' <<<"$info")
  exit_code=$(sed -n 's/.* ExitCode=\([^ ]*\).*/\1/p' <<<"$info")
  out=$dir/dattn-np$n-$j.out
  problems=()
  [[ $state = COMPLETED && $exit_code = 0:0 ]] || problems+=("state $state, exit code $exit_code")
  if [[ ! -f $out ]]; then
    problems+=("no output file $out")
  else
    # Data rows start with a space; the last column is #wrong, which must read 0 in every row.
    rows=$(awk '/^ / { n++ } END { print n + 0 }' "$out")
    wrong=$(awk '/^ / && $NF != "0" { n++ } END { print n + 0 }' "$out")
    grep -Eq '^#.* #wrong *$' "$out" || problems+=("no table header ending in #wrong")
    ((rows == 2)) || problems+=("$rows data rows instead of 2 (seq 1024 and 2048)")
    ((wrong == 0)) || problems+=("$wrong rows whose #wrong is not 0")
    # The footer pads its labels: "# Out of bounds values  : 0 OK".
    grep -Eq '^# Out of bounds values +: 0 OK' "$out" || problems+=("no 'Out of bounds values : 0 OK'")
    # One MPI job of n ranks (not n singletons, as when the PMIx wire-up fails).
    grep -q "^# ranks $n (" "$out" || problems+=("not one MPI job of $n ranks")
    # Across the hosts: the job had them all, and its ranks ran on every one.
    if ((hosts > 1)); then
      grep -q "^# nodes    : $hosts " "$out" || problems+=("not a job of $hosts nodes")
      for ((i = 0; i < hosts; i++)); do
        grep -Eq "^# +Rank +[0-9]+ .* on +node$i " "$out" || problems+=("no rank on node$i")
      done
    fi
  fi
  if ((${#problems[@]})); then
    errors=$((errors + 1))
    echo "slurm test: job $j ($n tasks): FAILED: $(IFS=';'; echo "${problems[*]}")" >&2
  else
    say "job $j ($n tasks): COMPLETED, $rows rows, #wrong all 0, out of bounds 0"
  fi
done
((errors == 0)) || fail "$errors of ${#tasks[@]} jobs failed"
status_ok=1
say "phases: packages $t_packages s, cluster start $t_cluster s, jobs and checks $(since "$t_phase") s"
