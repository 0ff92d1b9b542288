#!/usr/bin/env bash
# Ring attention's overlap over TCP: 2 hosts x 1 rank (tests/multinode/cluster.sh), a causal
# prefill forward (dattn-prefill-bench -a ring -l zigzag, 2 heads, 2 kv heads, D 128, bf16, 1
# thread), on an unshaped link and on one shaped to RATE (tc tbf), with the kernel's progress
# hook (the ring's messages move between its tiles) and without it (DATTN_RING_PROGRESS=0):
#   bash tests/multinode/ring_overlap.sh [-s SEQ] [-r RATE] [-n ITERS]   (default -s 4096 -r 1gbit)
# At P = 2 the forward is two steps of about equal compute, and only the first sends (one hop of
# the rank's K/V). It prints the forward's compute C (the unshaped run: there the hop takes about
# 1% of it), the hop's transfer T (measured: the shaped forward without the hook less C; and its
# bytes at RATE, which TCP under tbf does not quite reach), the shaped forward with the hook W and
# without it N, and
# W / max(C, C/2 + T): the step that sends takes max(C/2, T) when the two overlap, C/2 + T when not.
# Exits 77 where cluster.sh cannot make the hosts.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bin=${DATTN_BUILD_DIR:-$(dirname "$(dirname "$here")")/build}/bin
seq=4096 rate=1gbit iters=10
while (($#)); do
  case $1 in
    -s) seq=$2 ;; -r) rate=$2 ;; -n) iters=$2 ;;
    *) echo "ring_overlap.sh: unknown option $1 (expected -s -r -n, each with a value)" >&2; exit 2 ;;
  esac
  shift 2
done
[[ $rate =~ ^([0-9]+)(k|m|g)bit$ ]] || { echo "ring_overlap.sh: -r $rate: expected e.g. 500mbit, 1gbit" >&2; exit 2; }
case ${BASH_REMATCH[2]} in k) bps=$((BASH_REMATCH[1] * 1000)) ;; m) bps=$((BASH_REMATCH[1] * 1000000)) ;;
  g) bps=$((BASH_REMATCH[1] * 1000000000)) ;; esac

# One forward's time (ms) and the bytes a rank sent (MB), from the benchmark's row.
run() {  # run PROGRESS [cluster options]
  local progress=$1 out rc=0
  shift
  out=$(DATTN_RING_PROGRESS=$progress bash "$here/cluster.sh" --slots 1 "$@" -- \
          mpiexec -n 2 "$bin/dattn-prefill-bench" -s "$seq" -a ring -l zigzag -H 2 -G 2 -t bf16 \
          -T 1 -n "$iters" -k 0 2>&1) || rc=$?
  ((rc == 77)) && { echo "$out" | tail -n 1; exit 77; }
  ((rc == 0)) || { echo "$out" | tail -n 20; exit "$rc"; }
  echo "$out" | awk -v s="$seq" '$1 == s && NF >= 7 { print $3, $6 }'
}
read -r c sent < <(run 1)
read -r w _ < <(run 1 --rate "$rate")
read -r n _ < <(run 0 --rate "$rate")
awk -v c="$c" -v w="$w" -v n="$n" -v mb="$sent" -v bps="$bps" -v rate="$rate" -v s="$seq" 'BEGIN {
  tm = mb * 8e6 / bps * 1e3                     # the hop at the shaped rate, ms
  t = n - c                                     # the hop as TCP moved it: N = C + T
  ideal = (c / 2 > t ? c : c / 2 + t)           # max(C, C/2 + T)
  printf "# ring overlap, 2 hosts x 1 rank, seq %d, link %s, one hop of %.3f MB a rank\n", s, rate, mb
  printf "# compute C (unshaped)            : %9.3f ms a forward (%.3f a step)\n", c, c / 2
  printf "# transfer T (measured: N - C)    : %9.3f ms (its bytes at the rate: %.3f ms)\n", t, tm
  printf "# with the progress hook W        : %9.3f ms = %.3f x max(C, C/2 + T) (target <= 1.15, floor 1.3)\n", w, w / ideal
  printf "# without it N                    : %9.3f ms = %.3f x max(C, C/2 + T)\n", n, n / ideal
  printf "# overlap gain N / W              : %9.3f\n", n / w
}'
