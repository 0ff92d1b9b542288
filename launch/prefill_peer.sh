#!/usr/bin/env bash
# dattn's CPU attention kernel against torch's scaled_dot_product_attention (examples/python/
# sdpa_peer.py) on the same shapes and threads, for fp32 and bf16, without and with a causal mask:
# for each, dattn-kernel-bench (the sgemm rate, the forward, the backward) and then the peer, and
# one table of GFLOP/s and ratios (torch time / dattn time; > 1: dattn is faster):
#   bash launch/prefill_peer.sh [-s S] [-H H] [-d D] [-T THREADS] [-n ITERS]
#   bash launch/prefill_peer.sh                  (the issue's shape: S 8192, H 8, D 128, 2 threads)
# The binaries come from $DATTN_BUILD_DIR/bin (default build/bin); the peer runs on $PYTHON
# (default python3: a venv with torch >= 2.1 from PyPI works). Exits 77 when that has no torch.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
bin=${DATTN_BUILD_DIR:-$root/build}/bin
python=${PYTHON:-python3}
S=8192 H=8 D=128 T=2 N=3
while (($#)); do
  case $1 in
    -s) S=$2 ;; -H) H=$2 ;; -d) D=$2 ;; -T) T=$2 ;; -n) N=$2 ;;
    *) echo "prefill_peer.sh: unknown option $1 (expected -s -H -d -T -n, each with a value)" >&2
       exit 2 ;;
  esac
  shift 2
done
for v in "$S" "$H" "$D" "$T" "$N"; do
  [[ $v =~ ^[1-9][0-9]*$ ]] || { echo "prefill_peer.sh: invalid value $v" >&2; exit 2; }
done
if ! "$python" -c 'import torch' 2>/dev/null; then
  echo "# prefill_peer.sh: skipped, no torch for $python"
  exit 77
fi
export OMP_NUM_THREADS=$T

echo "# CPU: $(lscpu | sed -n 's/^Model name: *//p'), flags:$(grep -o -w 'avx2\|avx512f\|avx512_bf16\|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')"
echo "# B=1 H=$H D=$D S=$S, $T threads; GFLOP/s at 4 S^2 H D (half with causal) forward, 2.5x that backward"
printf '# %-5s %-6s %9s %9s %8s %9s %9s %8s %12s\n' dtype mask torch_fwd dattn_fwd fwd_x \
  torch_f+b dattn_f+b f+b_x fwd/sgemm
for dtype in fp32 bf16; do
  for mask in none causal; do
    out=$(bash "$here/mpirun.sh" -n 1 "$bin/dattn-kernel-bench" -s "$S" -H "$H" -d "$D" -T "$T" \
            -n "$N" -t "$dtype" -m "$mask" --rss-seqs "")
    [[ $out == *"cpu kernel:"* && $dtype == fp32 && $mask == none ]] &&
      grep -o 'cpu kernel:.*' <<<"$out" | sed 's/^/# /'
    peer=$("$python" "$root/examples/python/sdpa_peer.py" -s "$S" -H "$H" -d "$D" -t "$dtype" \
             -m "$mask" -T "$T" -n "$N")
    [[ $dtype == fp32 && $mask == none ]] && grep '^# torch' <<<"$peer"
    # The rows' best time is the second last field, GFLOP/s the last.
    sgemm=$(awk '$1 == "(a)" { print $NF }' <<<"$out")
    fwd_ms=$(awk '$1 == "(b)" { print $(NF - 1) }' <<<"$out")
    bwd_ms=$(awk '$2 == "attn" && $3 == "backward" { print $(NF - 1) }' <<<"$out")
    peer_fwd=$(awk '$1 == "peer_fwd_ms" { print $2 }' <<<"$peer")
    peer_both=$(awk '$1 == "peer_fwdbwd_ms" { print $2 }' <<<"$peer")
    [[ -n $sgemm && -n $fwd_ms && -n $bwd_ms && -n $peer_fwd && -n $peer_both ]] ||
      { echo "prefill_peer.sh: a figure is missing from the outputs" >&2; echo "$out$peer" >&2; exit 1; }
    awk -v dt="$dtype" -v m="$mask" -v S="$S" -v H="$H" -v D="$D" -v sg="$sgemm" -v f="$fwd_ms" \
        -v b="$bwd_ms" -v pf="$peer_fwd" -v pb="$peer_both" 'BEGIN {
      gf = 4 * S * S * H * D * (m == "causal" ? 0.5 : 1) / 1e6  # MFLOP: GFLOP/s from ms
      printf "  %-5s %-6s %9.1f %9.1f %7.2fx %9.1f %9.1f %7.2fx %12.3f\n", dt, m, gf / pf, gf / f,
        pf / f, 3.5 * gf / pb, 3.5 * gf / (f + b), pb / (f + b), gf / f / sg
    }'
  done
done
echo "# targets (issue 16): fwd_x >= 1.10 (floor 1.00); f+b_x >= 1.2 fp32 (floor 1.0), >= 4 bf16; fp32 fwd/sgemm >= 0.85 (floor 0.80)"
