#!/usr/bin/env bash
# A thin wrapper around Open MPI's mpiexec for small single machines (laptops, CI, containers):
# it sets the few environment variables such a machine needs, then runs `mpiexec "$@"`.
#   bash launch/mpirun.sh -n 4 build/bin/dattn-prefill-bench -s 4096 -e 16384
# Every variable set here is only a default: a value already in the environment wins. Across
# hosts, name them (--hostfile FILE of "HOST slots=N" lines, or --host): the slots, binding and
# transports are then yours (e.g. OMPI_MCA_btl=self,vader,tcp; README "Across several hosts").
set -euo pipefail

# ---------------------------------------------------------------- read the mpiexec arguments
# The number of ranks asked for (-n/-np/--np/-c, summed over ':'-separated app contexts) and
# whether hosts are named (then the job may span nodes). Parsing stops at each program name, so
# that the program's own options (dattn-prefill-bench has its own -n) are not taken for mpiexec's.
ranks=0
hosts_named=0
placed=0
in_program=0
args=("$@")
i=0
while ((i < ${#args[@]})); do
  a=${args[i]}
  if ((in_program)); then
    [[ $a = ":" ]] && in_program=0
    i=$((i + 1)); continue
  fi
  case $a in
    -n|-np|--n|--np|-c)
      v=${args[i + 1]:-0}; [[ $v =~ ^[0-9]+$ ]] && ranks=$((ranks + v)); i=$((i + 2)); continue ;;
    --n=*|--np=*|-np=*|-n=*)
      v=${a#*=}; [[ $v =~ ^[0-9]+$ ]] && ranks=$((ranks + v)) ;;
    -H|-host|--host|-hostfile|--hostfile|-machinefile|--machinefile|--default-hostfile)
      hosts_named=1; i=$((i + 2)); continue ;;
    --host=*|--hostfile=*|--machinefile=*|--default-hostfile=*)
      hosts_named=1 ;;
    # Placement named by the caller: left to them.
    --map-by|-map-by|--bind-to|-bind-to|--cpu-set|--cpu-list|--rankfile|-rf)
      placed=1; i=$((i + 2)); continue ;;
    --map-by=*|--bind-to=*|--cpu-set=*|--cpu-list=*|--rankfile=*)
      placed=1 ;;
    # Options that take one value (so the value is not taken for the program's name).
    -x|--map-by|-map-by|--bind-to|-bind-to|--rank-by|-rank-by|-wdir|--wdir|-wd|--wd|--prefix| \
    --output-filename|-output-filename|--npernode|-npernode|--npersocket|-npersocket|-N| \
    --timeout|--path|--preload-files|--cpu-set|--cpu-list|--app|--personality|--launch-agent)
      i=$((i + 2)); continue ;;
    # Options that take two values.
    --mca|-mca|--gmca|-gmca|-tune|--tune)
      i=$((i + 3)); continue ;;
    -*) ;;
    *) in_program=1 ;;
  esac
  i=$((i + 1))
done

# Cores: the smaller of the CPUs this process may use and the physical cores, since Open MPI
# counts one slot per core (not per hardware thread) by default.
cores=$(nproc 2>/dev/null || echo 1)
if command -v lscpu >/dev/null 2>&1; then
  phys=$(lscpu -p=socket,core 2>/dev/null | grep -v '^#' | sort -u | wc -l)
  ((phys > 0 && phys < cores)) && cores=$phys
fi

# One node unless hosts are named or a batch system gave us several.
single_node=1
if ((hosts_named)) || [[ ${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}} != 1 ]] ||
   [[ -n ${PBS_NODEFILE:-} || -n ${OMPI_MCA_orte_default_hostfile:-} ]]; then
  single_node=0
fi

# ---------------------------------------------------------------- environment
# Open MPI refuses to start as root ("mpirun has detected an attempt to run as root") unless
# both of these are set; containers and CI runners usually run as root.
if ((EUID == 0)); then
  export OMPI_ALLOW_RUN_AS_ROOT=${OMPI_ALLOW_RUN_AS_ROOT:-1}
  export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}
fi

# More ranks than cores fails with "not enough slots" unless oversubscription is allowed.
# Oversubscribed ranks share cores; Open MPI then also stops binding them to cores. (Across
# several nodes the slots are the hosts' business, so this is left alone there.)
if ((single_node && ranks > cores)); then
  export OMPI_MCA_rmaps_base_oversubscribe=${OMPI_MCA_rmaps_base_oversubscribe:-1}
fi

# Open MPI binds each of up to two ranks to one core by default, so a rank's OpenMP threads
# (-T 2, OMP_NUM_THREADS) would all share that core. On one node with fewer ranks than cores,
# give each rank an equal share of the cores instead (--map-by slot:PE=N binds it to N cores).
placement=()
if ((single_node && !placed && ranks > 0 && ranks < cores)); then
  placement=(--map-by "slot:PE=$((cores / ranks))")
fi

# On one node, use shared memory only: the ob1 point-to-point layer over the self (a rank to
# itself) and vader (shared memory) transports. This keeps Open MPI from probing UCX, InfiniBand
# or TCP, which warns or fails on machines and containers without those networks (e.g. "unable to
# find network interfaces"). vader's default single-copy mechanism (CMA, process_vm_readv) needs
# ptrace permission between ranks, which containers often deny; "none" copies through the shared
# segment instead, which works everywhere.
if ((single_node)) && [[ -z ${OMPI_MCA_btl+set} ]]; then
  export OMPI_MCA_pml=${OMPI_MCA_pml:-ob1}
  export OMPI_MCA_btl=self,vader
  export OMPI_MCA_btl_vader_single_copy_mechanism=${OMPI_MCA_btl_vader_single_copy_mechanism:-none}
fi

# What the build found this machine needs (build/dattn-env.sh, written by CMake): today only
# OPENBLAS_CORETYPE where OpenBLAS does not recognise the CPU and would run its generic kernels.
env_file=${DATTN_BUILD_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/build}/dattn-env.sh
# shellcheck source=/dev/null
[[ -f $env_file ]] && source "$env_file"

exec mpiexec "${placement[@]}" "$@"
