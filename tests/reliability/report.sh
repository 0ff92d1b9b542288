#!/usr/bin/env bash
# The reliability report: what dattn was made to survive, counted and printed as one table.
#   bad inputs (CLI)      a catalogue of bad options and impossible plans, every workload, at 3
#                         ranks (mla at 2; tests/launch/run_test.sh covers 2 and 4): each must exit
#                         non-zero on every rank within 60 s and print its named error
#                         ("invalid --OPTION = VALUE: expected ...") once;
#   bad inputs (library)  the multi-rank error tests (test_errors, the C API's error paths) at
#                         2-4 ranks: a bad value on one rank becomes a named error on every rank;
#   faults injected       tests/faults/fault_test.sh: a rank sleeping past the watchdog's
#                         deadline or killed with SIGKILL mid-ring; the job must end with a
#                         message within deadline + 30 s;
#   sanitizers, fuzzers   the status lines .ci/run's sanitizer and fuzzing sections wrote (files
#                         given by SANITIZER_STATUS and FUZZ_STATUS), or "not run".
# Exit 1 if any row failed.
#   bash tests/reliability/report.sh REPO BUILD_DIR
set -uo pipefail
repo=${1:?usage: report.sh REPO BUILD_DIR}
build=${2:?usage: report.sh REPO BUILD_DIR}
run=$build/bin/dattn-run
work=$(mktemp -d "${TMPDIR:-/tmp}/dattn-reliability.XXXXXX")
trap 'rm -rf "$work"' EXIT
export DATTN_BUILD_DIR=$build OMP_NUM_THREADS=1
# Open MPI as root on a small machine (PLATFORM.md), for the fault test's plain mpiexec too;
# a failed job ends without mpiexec's 1 s wait between SIGTERM and SIGKILL (tests/CMakeLists.txt).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_odls_base_sigkill_timeout=0
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader
export OMPI_MCA_btl_vader_single_copy_mechanism=none
rows=()
failed=0

row() { # CATEGORY TRIED HANDLED RESULT
  rows+=("$(printf '  %-22s %7s %8s  %s' "$1" "$2" "$3" "$4")")
  [[ $4 == PASS* || $4 == "not run"* ]] || failed=1
}

# ---------------------------------------------------------------- bad CLI inputs
# "RANKS|ARGS|the message's start": every workload's bad values, and plans the ranks cannot form
# (mla on 2 ranks: on 3 no latent split exists at all, so every mla run is refused for that).
catalogue=(
  "3|prefill -t fp64|invalid --dtype = fp64"
  "3|prefill -H 8 -G 3|invalid --kv-heads = 3"
  "3|prefill -d 0|invalid --head-dim = 0"
  "3|prefill -s 0|invalid --seq-begin = 0"
  "3|prefill -l diagonal|invalid --layout = diagonal"
  "3|prefill -l varlen|invalid --layout = varlen"
  "3|prefill --stripe-block 4|invalid --stripe-block = 4"
  "3|prefill --doc-lens 1,2 -s 10|invalid --doc-lens = 1,2"
  "3|prefill -m window -W -1|invalid --window = -1"
  "3|prefill -m sparse|invalid --mask = sparse"
  "3|prefill -a tree|invalid --strategy = tree"
  "3|prefill -a ring -u 2|invalid --ulysses-degree = 2"
  "3|prefill -n 0|invalid --iters = 0"
  "3|prefill -k 2|invalid --check = 2"
  "3|prefill -c 1|unrecognised option '-c'"
  "3|prefill --compare layout|invalid --compare = layout"
  "3|prefill --tp 5|invalid --cp x --tp"
  "3|prefill --cp 5|invalid --cp x --tp"
  "3|prefill --world-size 8|invalid --world-size = 8"
  "3|prefill --device tpu|invalid --device = tpu"
  "3|prefill --device-id 1|invalid --device-id = 1"
  "3|prefill --bogus|unrecognised option '--bogus'"
  "3|prefill --config /nonexistent.cfg|invalid --config = /nonexistent.cfg"
  "3|decode -x 0|invalid --context = 0"
  "3|decode -a tree,bogus|invalid --strategies = tree,bogus"
  "3|decode -p nowhere|invalid --placement = nowhere"
  "3|decode -H 8 -G 3|invalid --kv-heads = 3"
  "3|star --block 0|invalid --block = 0"
  "3|star --anchor -1|invalid --anchor = -1"
  "2|mla --latent 100|invalid --latent = 100"
  "2|mla --heads 0|invalid --heads = 0"
  "2|mla --cp 2|invalid --cp = 2"
  "3|kernel -s 0|invalid --seq = 0"
  "3|bogus|invalid WORKLOAD = bogus"
)
tried=0
rejected=0
: >"$work/cli.txt"
for entry in "${catalogue[@]}"; do
  IFS='|' read -r np args msg <<<"$entry"
  tried=$((tried + 1))
  rc=0
  # shellcheck disable=SC2086  # ARGS are words
  timeout 60 bash "$repo/launch/mpirun.sh" -n "$np" "$run" $args >"$work/out" 2>&1 || rc=$?
  n=$(grep -cF -- "$msg" "$work/out" || true)
  if ((rc != 0 && rc != 124)) && [[ $n == 1 ]]; then
    rejected=$((rejected + 1))
  else
    echo "np$np '$args': exit $rc, '$msg' printed $n times" >>"$work/cli.txt"
  fi
done
if ((rejected == tried)); then
  row "bad inputs (CLI)" "$tried" "$rejected" "PASS: every one named once, every rank exited non-zero"
else
  row "bad inputs (CLI)" "$tried" "$rejected" "FAIL (see below)"
fi

# ---------------------------------------------------------------- bad inputs in the library
lib_tests='^(errors|c_api|backward_dist)_np[234]$'
ctest --test-dir "$build" -R "$lib_tests" --timeout 300 >"$work/lib.txt" 2>&1
lib_total=$(grep -cE 'Test +#[0-9]+: ' "$work/lib.txt" || true)
lib_pass=$(grep -cE 'Test +#[0-9]+: .* Passed' "$work/lib.txt" || true)
cases=$("$build/tests/test_errors" --gtest_list_tests 2>/dev/null | grep -c '^  ' || true)
if ((lib_total > 0 && lib_pass == lib_total)); then
  row "bad inputs (library)" "$lib_total" "$lib_pass" \
    "PASS: $cases error cases (test_errors), the C API's and the backward's, at 2-4 ranks"
else
  row "bad inputs (library)" "$lib_total" "$lib_pass" "FAIL: $(grep -E 'Failed|Timeout' "$work/lib.txt" | head -3 | tr -s ' ')"
fi

# ---------------------------------------------------------------- injected faults
if [[ -x $build/tests/fault_inject ]]; then
  bash "$repo/tests/faults/fault_test.sh" "$build/tests/fault_inject" >"$work/faults.txt" 2>&1
  f_total=$(grep -cE '^fault .*(PASS|FAIL)$' "$work/faults.txt" || true)
  f_pass=$(grep -cE '^fault .*PASS$' "$work/faults.txt" || true)
  slowest=$(grep -oE 'ended in [0-9.]+ s' "$work/faults.txt" | awk '{print $3}' | sort -g | tail -1)
  if ((f_total > 0 && f_pass == f_total)); then
    row "faults injected" "$f_total" "$f_pass" "PASS: every job ended with a message, slowest ${slowest:-?} s (bound: deadline + 30 s); 0 hangs"
  else
    row "faults injected" "$f_total" "$f_pass" "FAIL (see below)"
  fi
else
  row "faults injected" 0 0 "FAIL: no fault_inject binary in $build/tests"
fi

# ---------------------------------------------------------------- sanitizers and fuzzers
for kind in SANITIZER FUZZ; do
  var=${kind}_STATUS
  name=$([[ $kind == SANITIZER ]] && echo "sanitizers (ASan+UBSan)" || echo "fuzzers (libFuzzer)")
  file=${!var:-}
  if [[ -n $file && -s $file ]]; then
    # The status file's first line: "TRIED HANDLED PASS|FAIL: text".
    read -r t h verdict <"$file"
    row "$name" "$t" "$h" "$verdict"
  else
    row "$name" - - "not run here (.ci/run runs them)"
  fi
done

# ---------------------------------------------------------------- the table
echo "# dattn reliability report ($(date -u +%Y-%m-%dT%H:%MZ), $(nproc --all) cores)"
printf '# %-22s %7s %8s  %s\n' "category" "tried" "handled" "result"
printf '%s\n' "${rows[@]}"
if [[ -s $work/cli.txt ]]; then echo "# CLI failures:"; sed 's/^/#   /' "$work/cli.txt"; fi
if ((failed)); then
  grep -E 'FAIL' "$work/faults.txt" 2>/dev/null | sed 's/^/#   /'
  echo "# reliability report: FAILED"
  exit 1
fi
echo "# reliability report: all passed"
