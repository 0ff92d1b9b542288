#!/usr/bin/env bash
# dattn's tree decode against a plain torch peer (examples/python/tree_decode_peer.py) on the same
# shard shape, one after the other under launch/mpirun.sh, and the ratio of their mean steps:
#   bash launch/decode_peer.sh RANKS [options]
#   bash launch/decode_peer.sh 2 -x 262144 -H 8 -G 8 -d 128      (the issue's target, fp32)
# The options (-x -b -H -G -d -n -w -T, each with its value) go to both programs; threads per rank
# default to OMP_NUM_THREADS, else 1. The binaries come from $DATTN_BUILD_DIR/bin (default build/bin), the
# peer runs on $PYTHON (default /usr/bin/python3). Exits 77 when that Python has no torch.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
bin=${DATTN_BUILD_DIR:-$root/build}/bin
python=${PYTHON:-/usr/bin/python3}
ranks=${1:?usage: decode_peer.sh RANKS [-x -b -H -G -d -n -w -T options]}
[[ $ranks =~ ^[1-9][0-9]*$ ]] || { echo "decode_peer.sh: invalid RANKS = $ranks" >&2; exit 2; }
shift
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

if ! "$python" -c 'import torch' 2>/dev/null; then
  echo "# decode_peer.sh: skipped, no torch for $python"
  exit 77
fi

bench_out=$(bash "$here/mpirun.sh" -n "$ranks" "$bin/dattn-decode-bench" -a tree "$@")
peer_out=$(bash "$here/mpirun.sh" -n "$ranks" "$python" "$root/examples/python/tree_decode_peer.py" "$@")
grep -E '^# (ranks|strategies|Read bandwidth|Kernel / read)|^ +tree ' <<<"$bench_out"
grep -v '^peer_mean_ms' <<<"$peer_out"
# The tree row's mean (its third column) and the peer's.
dattn_ms=$(awk '$1 == "tree" { print $3 }' <<<"$bench_out")
peer_ms=$(awk '$1 == "peer_mean_ms" { print $2 }' <<<"$peer_out")
[[ -n $dattn_ms && -n $peer_ms ]] || { echo "decode_peer.sh: no mean step in the output" >&2; exit 1; }

# The target: 2 ranks x 1 thread, context 262144, H = H_kv = 8, D = 128, B = 1 (fp32, the peer's).
declare -A opt=([-x]=65536 [-b]=1 [-H]=8 [-G]=2 [-d]=128 [-T]=$OMP_NUM_THREADS)
args=("$@")
for ((i = 0; i + 1 < ${#args[@]}; i += 2)); do opt[${args[i]}]=${args[i + 1]}; done
target=0
[[ "$ranks ${opt[-T]} ${opt[-x]} ${opt[-H]} ${opt[-G]} ${opt[-d]} ${opt[-b]}" == \
   "2 1 262144 8 8 128 1" ]] && target=1
awk -v d="$dattn_ms" -v p="$peer_ms" -v t="$target" 'BEGIN {
  r = p / d
  printf "# dattn tree %.3f ms, torch peer %.3f ms per step: peer/dattn %.2f", d, p, r
  printf " (target at 2 ranks x 1 thread, -x 262144 -H 8 -G 8 -d 128 fp32: >= 2"
  print t ? (r >= 2 ? "): met" : "): NOT met") : "; this run is not the target)"
}'
