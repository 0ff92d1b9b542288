#!/usr/bin/env bash
# Runs every libFuzzer target of a DATTN_FUZZ build for SECONDS, side by side, from the committed
# seeds (tests/fuzz/corpus/<target>/, read only: new inputs go to a scratch corpus), and prints one
# line per target:
#   fuzz cli: 123456 runs in 30 s, 0 crashes
# Exits non-zero when a target crashed (a sanitizer report, an uncaught exception, a failed
# check, a leak, a hang past 10 s or 2 GB): the input is kept under $FUZZ_ARTIFACTS (default
# BUILD_DIR/fuzz-artifacts) and the end of the target's log is printed. Builds nothing.
#   tests/fuzz/run_fuzzers.sh BUILD_DIR SECONDS
set -uo pipefail

if (($# != 2)); then
  echo "usage: $0 BUILD_DIR SECONDS" >&2
  exit 2
fi
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
build=$(cd "$1" && pwd) || exit 2
seconds=$2
artifacts=${FUZZ_ARTIFACTS:-$build/fuzz-artifacts}
mkdir -p "$artifacts"

# The sanitizers' options and suppressions, as for the test runs (written by CMake), and MPI for
# one process (fuzz_cli initialises MPI as a singleton): the tests' settings, shared memory only.
if [[ -f $build/sanitizer-env.sh ]]; then
  # shellcheck disable=SC1091
  . "$build/sanitizer-env.sh"
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_pml=ob1
export OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none OMP_NUM_THREADS=1
if [[ -f $build/dattn-env.sh ]]; then
  # shellcheck disable=SC1091
  . "$build/dattn-env.sh"  # OPENBLAS_CORETYPE where OpenBLAS does not know the CPU
fi

scratch=$(mktemp -d "${TMPDIR:-/tmp}/dattn-fuzz.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
# One target: fuzz it for SECONDS, then its line (and, on a crash, its inputs and log) into
# $scratch/TARGET.report; exit status non-zero on a crash.
fuzz_one() {
  local target=$1 exe=$build/fuzz/fuzz_$1 corpus=$scratch/$1 log=$artifacts/$1.log
  local report=$scratch/$1.report rc=0 runs secs crashes
  if [[ ! -x $exe ]]; then
    echo "fuzz $target: $exe not built" >"$report"
    return 1
  fi
  mkdir -p "$corpus"
  local opts=(-max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
              -artifact_prefix="$artifacts/$target-")
  [[ -f $here/$target.dict ]] && opts+=(-dict="$here/$target.dict")
  rm -f "$artifacts/$target"-{crash,leak,timeout,oom,slow-unit}-*
  "$exe" "${opts[@]}" "$corpus" "$here/corpus/$target" >"$log" 2>&1 || rc=$?
  runs=$(sed -n 's/^Done \([0-9]*\) runs in \([0-9]*\) second.*/\1/p' "$log" | tail -n 1)
  secs=$(sed -n 's/^Done \([0-9]*\) runs in \([0-9]*\) second.*/\2/p' "$log" | tail -n 1)
  crashes=$(find "$artifacts" -maxdepth 1 -name "$target-*" ! -name '*.log' | wc -l)
  if [[ -z $runs ]]; then  # stopped before its summary: a crash
    runs=$(grep -o '^#[0-9]*' "$log" | tail -n 1 | tr -d '#')
    secs=?
  fi
  echo "fuzz $target: ${runs:-0} runs in ${secs} s, $crashes crashes" >"$report"
  if ((rc != 0 || crashes > 0)); then
    {
      echo "  exit status $rc; input(s):"
      find "$artifacts" -maxdepth 1 -name "$target-*" ! -name '*.log' | sed 's/^/    /'
      echo "  end of $log:"
      tail -n 40 "$log" | sed 's/^/    /'
    } >>"$report"
    return 1
  fi
}

# The targets run side by side (each is one process; on 2 cores, 3 targets for SECONDS take
# SECONDS rather than 3 x SECONDS, each target with two thirds of a core).
targets=(cli layout spec)
pids=()
for target in "${targets[@]}"; do
  fuzz_one "$target" &
  pids+=($!)
done
failed=0
for i in "${!targets[@]}"; do
  wait "${pids[$i]}" || failed=1
  cat "$scratch/${targets[$i]}.report"
done
exit $failed
