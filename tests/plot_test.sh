#!/usr/bin/env bash
# ctest plot_charts: launch/plot.py draws the charts of real benchmark JSON.
#   bash tests/plot_test.sh REPO BIN_DIR
# Runs three small 2-rank prefill benchmarks (ring, ring zigzag, ulysses) and 2-rank decode runs
# (tree, ring, allgather) at three contexts with dattn-run from BIN_DIR, runs plot.py on them all
# and checks that every chart is a PNG of a sane size; then checks that plot.py fails, naming the
# file, on bad input.
# Exit status: 0 pass, 1 fail, 77 skipped (/usr/bin/python3 has no matplotlib).
set -euo pipefail

if (($# != 2)); then
  echo "usage: $0 REPO BIN_DIR" >&2
  exit 2
fi
repo=$1
bin_dir=$2
python=/usr/bin/python3
plot=$repo/launch/plot.py

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

if ! "$python" -c 'import matplotlib' 2>/dev/null; then
  echo "SKIP: $python cannot import matplotlib (on Debian: apt-get install python3-matplotlib)"
  exit 77
fi
[[ -x $bin_dir/dattn-run ]] || fail "$bin_dir/dattn-run is not built"
[[ -f $plot ]] || fail "$plot is missing"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# ---------------------------------------------------------------- benchmark JSON
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# launch/mpirun.sh reads the build's dattn-env.sh; BIN_DIR is the build folder's bin/.
export DATTN_BUILD_DIR=${DATTN_BUILD_DIR:-$(cd "$bin_dir/.." && pwd)}

prefill() {  # NAME ARGS...: 2-rank prefill, 256..1024 tokens, one timed iteration
  local name=$1
  shift
  if ! bash "$repo/launch/mpirun.sh" -n 2 "$bin_dir/dattn-run" prefill \
      -s 256 -e 1024 -n 1 -w 0 "$@" -J "$tmp/$name.json" >"$tmp/$name.log" 2>&1; then
    cat "$tmp/$name.log" >&2
    fail "dattn-run prefill $* failed"
  fi
}
prefill ring -a ring -l contiguous
prefill ring_zigzag -a ring -l zigzag
prefill ulysses -a ulysses -G 2

decode() {  # CONTEXT: 2-rank decode of tree, ring and allgather, two timed steps
  if ! bash "$repo/launch/mpirun.sh" -n 2 "$bin_dir/dattn-run" decode -x "$1" -n 2 -w 0 \
      -J "$tmp/decode$1.json" >"$tmp/decode$1.log" 2>&1; then
    cat "$tmp/decode$1.log" >&2
    fail "dattn-run decode -x $1 failed"
  fi
}
for context in 1024 2048 4096; do decode $context; done

# ---------------------------------------------------------------- charts
files=("$tmp/ring.json" "$tmp/ring_zigzag.json" "$tmp/ulysses.json" "$tmp/decode1024.json"
       "$tmp/decode2048.json" "$tmp/decode4096.json")
out=$tmp/charts
if ! "$python" "$plot" -o "$out" --title "plot_test" "${files[@]}" >"$tmp/plot.out" 2>&1; then
  cat "$tmp/plot.out" >&2
  fail "plot.py failed on ${files[*]}"
fi
cat "$tmp/plot.out"

# What plot.py says it wrote: 3 prefill series x 3 seqs, 3 decode strategies x 3 contexts.
for line in "prefill_time.png (3 series, 9 points)" "prefill_tflops.png (3 series, 9 points)" \
            "decode_latency.png (3 series, 9 points)" "bytes_per_rank.png (6 series, 18 points)"; do
  grep -qF "wrote $out/$line" "$tmp/plot.out" || fail "plot.py did not print 'wrote $out/$line'"
done

# Each PNG: over 5 KB, the PNG signature, an IHDR chunk first, width and height >= 300 px.
for name in prefill_time prefill_tflops decode_latency bytes_per_rank; do
  "$python" - "$out/$name.png" <<'EOF' || fail "$out/$name.png is not a sane PNG"
import os, struct, sys
path = sys.argv[1]
if not os.path.isfile(path):
    sys.exit(f"{path}: missing")
size = os.path.getsize(path)
with open(path, "rb") as f:
    head = f.read(24)
if size <= 5 * 1024:
    sys.exit(f"{path}: only {size} bytes")
if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
    sys.exit(f"{path}: no PNG signature and IHDR chunk")
width, height = struct.unpack(">II", head[16:24])
if not (300 <= width <= 10000 and 300 <= height <= 10000):
    sys.exit(f"{path}: {width}x{height} px")
print(f"ok {path}: {size} bytes, {width}x{height} px")
EOF
done

# ---------------------------------------------------------------- duplicated points
# The same file twice: every point is duplicated; plot.py keeps the last and says so.
if ! "$python" "$plot" -o "$tmp/dup" "$tmp/ring.json" "$tmp/ring.json" >"$tmp/dup.out" 2>&1; then
  cat "$tmp/dup.out" >&2
  fail "plot.py failed on a duplicated file"
fi
grep -q "keeping the last" "$tmp/dup.out" || fail "plot.py did not note the duplicated points"
grep -qF "prefill_time.png (1 series, 3 points)" "$tmp/dup.out" ||
  fail "plot.py did not keep one point per (series, seq)"

# ---------------------------------------------------------------- bad input
expect_failure() {  # WHAT FILE: plot.py on FILE exits non-zero and names FILE
  local what=$1 file=$2 rc=0
  "$python" "$plot" -o "$tmp/bad" "$tmp/ring.json" "$file" >"$tmp/bad.out" 2>&1 || rc=$?
  ((rc != 0)) || fail "plot.py exited 0 on $what"
  grep -qF "$file" "$tmp/bad.out" || { cat "$tmp/bad.out" >&2; fail "message on $what lacks $file"; }
  [[ ! -e $tmp/bad ]] || fail "plot.py wrote charts despite $what"
  echo "ok plot.py on $what: exit $rc, $(head -n 1 "$tmp/bad.out")"
}
echo '{"config": {}}' >"$tmp/no_rows.json"
echo 'not json' >"$tmp/not_json.json"
echo '{"rows": [{"workload": "prefill", "strategy": "ring", "layout": "", "seq": 256}]}' \
  >"$tmp/short_row.json"
expect_failure "a missing file" "$tmp/missing.json"
expect_failure "a JSON without rows" "$tmp/no_rows.json"
expect_failure "a file that is not JSON" "$tmp/not_json.json"
expect_failure "a row without time_ms" "$tmp/short_row.json"

echo "PASS"
