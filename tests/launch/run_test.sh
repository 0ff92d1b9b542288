#!/usr/bin/env bash
# The launcher's contract, end to end under mpiexec: dattn-run runs every workload; --help and
# --version answer; a bad option or an impossible plan prints one error (not one per rank) and
# every rank exits non-zero without hanging; --config takes the command line's keys and loses to
# it; --dry-run plans 1024 ranks without computing; --tp splits heads and stays correct (#wrong 0
# against float64, the check on by default); --doc-lens takes empty documents (0) and the run
# stays correct; -k 0 leaves #wrong N/A; --compare reruns the largest case per value and prints
# the ratio; --json rows carry the common keys; launch/mpirun.sh gives a lone rank all the cores.
#   bash tests/launch/run_test.sh REPO BIN_DIR
set -euo pipefail
repo=${1:?REPO}
bin=${2:?BIN_DIR}
run=$bin/dattn-run
work=$(mktemp -d "${TMPDIR:-/tmp}/dattn-run-test.XXXXXX")
trap 'rm -rf "$work"' EXIT
failures=0
checks=0

fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
pass() { echo "ok: $*"; }
mpi() { # mpi NP ARGS...: dattn-run under mpiexec, 60 s at most (a hang fails the check)
  local np=$1; shift
  timeout 60 bash "$repo/launch/mpirun.sh" -n "$np" "$run" "$@"
}

# expect_error NAME NP MESSAGE ARGS...: exits non-zero, and MESSAGE is printed exactly once.
expect_error() {
  local name=$1 np=$2 msg=$3; shift 3
  checks=$((checks + 1))
  local rc=0
  mpi "$np" "$@" >"$work/out" 2>&1 || rc=$?
  local n
  n=$(grep -cF -- "$msg" "$work/out" || true)
  if ((rc == 0)); then
    fail "$name: exit 0, expected an error"
  elif ((rc == 124)); then
    fail "$name: hung (timeout)"
  elif [[ $n != 1 ]]; then
    fail "$name: '$msg' printed $n times (expected once); output:"; sed 's/^/    /' "$work/out"
  else
    pass "$name (rc $rc, one message)"
  fi
}

# expect_ok NAME NP ARGS...: exits 0; output kept in $work/out.
expect_ok() {
  local name=$1 np=$2; shift 2
  checks=$((checks + 1))
  if mpi "$np" "$@" >"$work/out" 2>&1; then
    pass "$name"
    return 0
  fi
  fail "$name: non-zero exit; output:"; sed 's/^/    /' "$work/out"
  return 1
}

# data_rows FILE: the table rows (lines starting with a space).
data_rows() { grep '^ ' "$1" || true; }

# wrong_is_zero NAME FILE: every data row's last column (#wrong) is 0 and there is at least one.
wrong_is_zero() {
  checks=$((checks + 1))
  local rows bad
  rows=$(data_rows "$2" | wc -l)
  bad=$(data_rows "$2" | awk '$NF != "0"' | wc -l)
  if ((rows > 0 && bad == 0)); then pass "$1: $rows rows, #wrong 0"; else
    fail "$1: $rows rows, $bad with #wrong != 0"; sed 's/^/    /' "$2"; fi
}

# ---------------------------------------------------------------- help, version, workloads
checks=$((checks + 1))
if "$run" --help | grep -q '^  prefill' && "$run" --version | grep -q '^dattn-run '; then
  pass "--help lists the workloads, --version answers"
else fail "--help / --version"; fi
for w in prefill decode star mla kernel; do
  checks=$((checks + 1))
  if "$run" "$w" --help | grep -q -- '--dry-run'; then pass "$w --help shows the launch options"
  else fail "$w --help lacks the launch options"; fi
done

# ---------------------------------------------------------------- errors: once, every rank exits
expect_error "unknown workload" 3 "invalid WORKLOAD = bogus" bogus
expect_error "missing workload" 2 "missing WORKLOAD" 
expect_error "cp x tp not the world" 4 "invalid --cp x --tp = 1 x 3" prefill --tp 3
expect_error "cp x tp not the world (cp given)" 3 "invalid --cp x --tp = 2 x 1" prefill --cp 2
expect_error "heads not divisible by tp" 4 "invalid --kv-heads = 2: expected divisible by --tp (4)" \
  prefill --tp 4
expect_error "unknown layout" 3 "invalid --layout = diagonal" prefill -l diagonal
expect_error "layout the strategy cannot use" 2 "invalid --layout = varlen" prefill -l varlen
expect_error "ulysses kv heads per tp slice" 4 "invalid --kv-heads / --tp = 3" \
  prefill --tp 2 -a ulysses --heads 6 --kv-heads 6
expect_error "ulysses query heads per tp slice" 4 "invalid --heads / --tp = 3" \
  prefill --tp 2 -a ulysses --heads 6 --kv-heads 2
expect_error "world-size without dry-run" 2 "invalid --world-size = 8" prefill --world-size 8
expect_error "unknown device" 2 "invalid --device = tpu" prefill --device tpu
expect_error "negative document length" 2 "invalid --doc-lens = 30,-1,71" \
  prefill -s 100 -m document --doc-lens 30,-1,71
expect_error "unknown option" 2 "unrecognised option '--bogus'" decode --bogus 1
expect_error "-c is gone (-m says it)" 2 "unrecognised option '-c'" prefill -c 0
expect_error "bad --compare key" 2 "invalid --compare = bogus=1,2" prefill --compare bogus=1,2
expect_error "missing config file" 2 "invalid --config = $work/none.cfg" prefill --config "$work/none.cfg"
printf 'seq-begin = 1024\nnot-an-option = 1\n' >"$work/bad.cfg"
expect_error "unknown config key" 2 "unrecognised option 'not-an-option'" prefill --config "$work/bad.cfg"

# ---------------------------------------------------------------- dry run
if expect_ok "dry run, 1024 simulated ranks" 1 prefill --dry-run --world-size 1024 --tp 4 \
     -H 32 -G 8 -l zigzag -s 65536 -e 1048576 -f 4; then
  checks=$((checks + 1))
  rows=$(data_rows "$work/out" | wc -l)
  # The first and last 8 ranks, the 1008 between them summed up in one line.
  if ((rows == 16)) && grep -q '^#  \.\.\. 1008 ranks not shown' "$work/out" &&
     data_rows "$work/out" | awk '$1 == 1023 && $2 == 255 && $3 == 3 && $5 == "24-31"' | grep -q . &&
     grep -q '^# planned 1024 ranks in' "$work/out"; then
    pass "plan shows ranks 0-7 and 1016-1023 of 1024: $(grep '^# planned' "$work/out")"
  else fail "plan has $rows rank rows"; sed 's/^/    /' "$work/out"; fi
fi
# The plan shows what each rank holds: rank 5 of cp 4 x tp 2 is cp 2, tp 1, heads 4-7.
if expect_ok "dry run, cp 4 x tp 2" 1 prefill --dry-run --world-size 8 --tp 2 -l zigzag -s 4096; then
  checks=$((checks + 1))
  if data_rows "$work/out" | awk '$1 == 5 && $2 == 2 && $3 == 1 && $5 == "4-7" &&
       $NF == "2560-3071" && $(NF-1) == "1024-1535"' | grep -q .; then
    pass "rank 5: cp 2, tp 1, heads 4-7, tokens 1024-1535 2560-3071"
  else fail "rank 5's plan row"; sed 's/^/    /' "$work/out"; fi
fi

# ---------------------------------------------------------------- config file
printf '# prefill on 4 ranks\nseq-begin = 4096\nlayout = zigzag\ntp = 2\niters = 1\nwarmup = 0\ncheck = 1\n' \
  >"$work/run.cfg"
if expect_ok "config file, command line wins (-s 512)" 4 prefill --config "$work/run.cfg" -s 512; then
  checks=$((checks + 1))
  if grep -q 'cp 2 x tp 2' "$work/out" && grep -q 'layout zigzag' "$work/out" &&
     [[ $(data_rows "$work/out" | awk '{print $1}') == 512 ]]; then
    pass "config applied (zigzag, tp 2) and -s 512 won over seq-begin = 4096"
  else fail "config not applied as expected"; sed 's/^/    /' "$work/out"; fi
  wrong_is_zero "config run" "$work/out"
fi

# ---------------------------------------------------------------- real runs, every workload
for np in 1 3; do
  expect_ok "prefill on $np ranks, checked" "$np" prefill -s 300 -e 600 -n 1 -w 0 -k 1 \
    -l zigzag -J "$work/prefill$np.json" && wrong_is_zero "prefill np$np" "$work/out"
done
expect_ok "prefill, the check by default" 2 prefill -s 256 -n 1 -w 0 &&
  wrong_is_zero "prefill default check" "$work/out"
expect_ok "prefill with empty documents, checked" 3 prefill -s 100 -n 1 -w 0 -k 1 -m document \
  --doc-lens 0,30,0,0,50,20,0 -l varlen && wrong_is_zero "prefill empty documents" "$work/out"
if expect_ok "prefill -k 0" 2 prefill -s 256 -n 1 -w 0 -k 0; then
  checks=$((checks + 1))
  if [[ $(data_rows "$work/out" | awk '{print $NF}') == N/A ]]; then pass "-k 0: #wrong N/A"
  else fail "-k 0: #wrong not N/A"; sed 's/^/    /' "$work/out"; fi
fi
if expect_ok "prefill --compare" 2 prefill -s 128 -e 256 -n 1 -w 0 --check \
     --compare layout=contiguous,zigzag -J "$work/compare.json"; then
  checks=$((checks + 1))
  if grep -q '^# compare layout: zigzag/contiguous time ratio = ' "$work/out" &&
     grep -q '"compare": *{"key": *"layout"' "$work/compare.json"; then
    pass "--compare: $(grep '^# compare layout:' "$work/out")"
  else fail "--compare"; sed 's/^/    /' "$work/out"; fi
  wrong_is_zero "prefill --compare" "$work/out"
fi
expect_ok "prefill cp 2 x tp 2, checked" 4 prefill --tp 2 -s 512 -n 1 -w 0 -k 1 -a hybrid -u 2 \
  -G 4 && wrong_is_zero "prefill tp 2" "$work/out"
expect_ok "decode cp 2 x tp 2, checked" 4 decode --tp 2 -x 2048 -n 2 -w 0 -k 1 \
  -J "$work/decode.json" && wrong_is_zero "decode tp 2" "$work/out"
expect_ok "star on 3 ranks, checked" 3 star -s 1536 -n 1 -w 0 --steps 2 -k 1 \
  && grep -q 'Out of bounds values *: 0 OK' "$work/out" && pass "star: 0 wrong"
expect_ok "mla on 2 ranks (tp = all ranks), checked" 2 mla -x 1024 --heads 8 --latent 64 --rope 16 \
  --calibration 256 -n 2 -k 1 && grep -q 'Out of bounds values *: 0 OK' "$work/out" &&
  pass "mla: 0 wrong"
expect_error "mla with cp 2" 2 "invalid --cp = 2: expected 1" mla --cp 2
expect_ok "kernel dry run" 1 kernel --dry-run && grep -q '^# planned 1 rank' "$work/out" &&
  pass "kernel plan"
for w in decode star mla; do
  expect_ok "$w dry run, 1024 simulated ranks" 1 "$w" --dry-run --world-size 1024 \
    $([[ $w = mla ]] && echo "--heads 1024 --latent 1024 --rope 1024" || echo "-H 32 -G 8") &&
    grep -q '^# planned 1024 ranks in' "$work/out" && pass "$w: $(grep '^# planned' "$work/out")"
done

checks=$((checks + 1))
if /usr/bin/python3 - "$work/prefill3.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
keys = ["workload", "strategy", "layout", "seq", "ranks", "time_ms", "tflops_per_rank",
        "sent_mb_per_rank", "model_mb_per_rank", "wrong"]
assert len(rows) == 2, rows
for r in rows:
    assert list(r)[:len(keys)] == keys, list(r)
    assert r["workload"] == "prefill" and r["ranks"] == 3 and r["wrong"] == 0, r
PY
then pass "JSON rows carry the common keys"; else fail "JSON rows"; fi

# launch/mpirun.sh gives a lone rank every core (Open MPI alone would bind it to one, and a
# rank's OpenMP threads would share that core); a caller's --bind-to wins.
if (($(nproc) >= 2)); then
  checks=$((checks + 1))
  bash "$repo/launch/mpirun.sh" -n 1 --report-bindings true >"$work/out" 2>&1 || true
  if grep -q "not bound (or bound to all" "$work/out"; then pass "one rank: all cores"
  else fail "one rank bound to part of the cores: $(cat "$work/out")"; fi
  checks=$((checks + 1))
  bash "$repo/launch/mpirun.sh" -n 1 --bind-to core --report-bindings true >"$work/out" 2>&1 || true
  if grep -q "bound to socket" "$work/out"; then pass "--bind-to core wins"
  else fail "--bind-to core ignored: $(cat "$work/out")"; fi
fi

if ((failures > 0)); then
  echo "dattn-run test: $failures of $checks checks FAILED"
  exit 1
fi
echo "dattn-run test: all $checks checks passed"
