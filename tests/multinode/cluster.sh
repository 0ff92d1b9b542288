#!/usr/bin/env bash
# A test cluster on this machine: N hosts, each a network namespace with its own address
# (10.213.0.i+1/24 on a veth, the veths joined by a bridge in a switch namespace of their own)
# and its own hostname (node0, node1, ...: every process started there runs in a UTS namespace
# that names it). Open MPI runs across them over TCP, shared memory inside one host: COMMAND runs
# on node0 with OMPI_MCA_* set so that a plain `mpiexec -n P prog` fills the hosts' slots in order
# (ranks 0..S-1 on node0, the next S on node1, ...) and starts each host's ranks through
# netns_agent.sh (the launch agent, in place of ssh).
#   bash tests/multinode/cluster.sh [--hosts N] [--slots S] [--rate R] [--delay D] -- COMMAND...
# --hosts 2, --slots 2 (ranks per host) by default; --rate (e.g. 10gbit, 1gbit: tc tbf) and
# --delay (e.g. 20us: tc netem, which some kernels lack) shape what every host sends (on its eth0),
# so each direction of a link once. The namespaces are new, so the
# machine's own network is untouched and the hosts reach nothing but each other; a trap removes
# them on any exit, with every process still inside. Exits with COMMAND's status, or 77 with the
# reason where namespaces cannot be made (not root, no iproute2 or unshare).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
hosts=2 slots=2 rate="" delay=""
while (($#)); do
  case $1 in
    --hosts) hosts=$2; shift 2 ;;
    --slots) slots=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --delay) delay=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "cluster.sh: unknown option $1 (expected --hosts --slots --rate --delay, then -- COMMAND)" >&2
       exit 2 ;;
  esac
done
(($#)) || { echo "cluster.sh: no COMMAND after --" >&2; exit 2; }
[[ $hosts =~ ^[1-9][0-9]?$ && $hosts -le 250 ]] || { echo "cluster.sh: invalid --hosts $hosts (1 to 250)" >&2; exit 2; }
[[ $slots =~ ^[1-9][0-9]*$ ]] || { echo "cluster.sh: invalid --slots $slots" >&2; exit 2; }

skip() { echo "cluster.sh: skipped, $*"; exit 77; }
((EUID == 0)) || skip "network namespaces need root (this is uid $EUID)"
command -v ip >/dev/null || skip "no ip (iproute2)"
command -v unshare >/dev/null && command -v nsenter >/dev/null || skip "no unshare or nsenter (util-linux)"
if [[ -n $rate$delay ]]; then command -v tc >/dev/null || skip "no tc (iproute2) for --rate/--delay"; fi
if [[ -n $rate ]]; then
  [[ $rate =~ ^([1-9][0-9]*)(k|m|g)bit$ ]] ||
    { echo "cluster.sh: invalid --rate $rate (expected e.g. 500mbit, 1gbit, 10gbit)" >&2; exit 2; }
  declare -A unit=([k]=1000 [m]=1000000 [g]=1000000000)
  burst=$((BASH_REMATCH[1] * unit[${BASH_REMATCH[2]}] / 8 / 1000))
  ((burst >= 16384)) || burst=16384
fi

# Names unique to this run, so that clusters of tests running at once do not meet.
prefix=dattn$$x
export DATTN_CLUSTER_PREFIX=$prefix
state=$(mktemp -d "${TMPDIR:-/tmp}/dattn-cluster.XXXXXX")
made=()
teardown() {
  local ns
  for ns in "${made[@]}"; do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
  done
  for ns in "${made[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
  rm -rf "$state"
}
trap teardown EXIT
trap 'exit 143' TERM INT

sw=${prefix}sw
ip netns add "$sw" 2>/dev/null || skip "ip netns add failed (no CAP_SYS_ADMIN / CAP_NET_ADMIN here?)"
made+=("$sw")
ip -n "$sw" link set lo up
ip -n "$sw" link add br0 type bridge
ip -n "$sw" link set br0 up
: >"$state/hostfile"
for ((i = 0; i < hosts; ++i)); do
  ns=${prefix}h$i
  ip netns add "$ns"
  made+=("$ns")
  ip -n "$ns" link set lo up  # Open MPI fails where loopback is down
  ip -n "$ns" link add eth0 type veth peer name p$i netns "$sw"
  ip -n "$sw" link set "p$i" master br0
  ip -n "$sw" link set "p$i" up
  ip -n "$ns" addr add "10.213.0.$((i + 1))/24" dev eth0
  ip -n "$ns" link set eth0 up
  # What host i sends: a token bucket for the rate (sch_tbf); a delay needs netem (sch_netem),
  # with the rate then netem's own. Kernels without the module refuse: skip, saying so.
  if [[ -n $delay ]]; then
    ip netns exec "$ns" tc qdisc add dev eth0 root netem delay "$delay" ${rate:+rate "$rate"} ||
      skip "tc netem (--delay) is not in this kernel (no sch_netem)"
  elif [[ -n $rate ]]; then
    # The bucket holds 1 ms of the rate (at least 16 KiB): a larger one lets the start of each
    # message through unshaped.
    ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$rate" burst "$burst" latency 100ms ||
      skip "tc tbf (--rate) is not in this kernel (no sch_tbf)"
  fi
  echo "10.213.0.$((i + 1)) slots=$slots" >>"$state/hostfile"
done
echo "# cluster: $hosts hosts (node0-node$((hosts - 1)), 10.213.0.1-$hosts), $slots slots each${rate:+, rate $rate}${delay:+, delay $delay}"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_orte_default_hostfile=$state/hostfile
export OMPI_MCA_plm_rsh_agent=$here/netns_agent.sh
export OMPI_MCA_oob_tcp_if_include=10.213.0.0/24 OMPI_MCA_btl_tcp_if_include=10.213.0.0/24
export OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader,tcp OMPI_MCA_btl_vader_single_copy_mechanism=none
# Every host is this machine's cores: binding each host's ranks to "its" cores would pile them
# onto the same ones.
export OMPI_MCA_hwloc_base_binding_policy=none
# A rank waiting in MPI yields its core (as in tests/CMakeLists.txt's environment): the hosts'
# 4 ranks share 2 cores, and TCP's busy polling starved the ones with work (multinode_strategies
# 11.1 s -> 2.8 s, the ten multinode binaries 85 s -> 20 s on AMD EPYC Zen 4, 2 cores).
export OMPI_MCA_rmaps_base_oversubscribe=0 OMPI_MCA_mpi_yield_when_idle=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export DATTN_CLUSTER_HOSTS=$hosts DATTN_CLUSTER_SLOTS=$slots
# What the build found this machine needs (OPENBLAS_CORETYPE where OpenBLAS does not know the
# CPU), as launch/mpirun.sh reads it.
env_file=${DATTN_BUILD_DIR:-$(dirname "$(dirname "$here")")/build}/dattn-env.sh
# shellcheck source=/dev/null
[[ -f $env_file ]] && source "$env_file"
rc=0
# nsenter enters the network namespace alone; ip netns exec would also mount a /sys of its own,
# without the cgroup file systems (slurmd needs them: tests/slurm/slurm_test.sh).
nsenter --net="/run/netns/${prefix}h0" unshare --uts bash -c 'hostname node0 && exec "$@"' cluster \
  "$@" || rc=$?
exit "$rc"
