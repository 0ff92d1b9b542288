#!/usr/bin/env bash
# The GPU backend's check on a machine with a GPU (the device tool's H200, or any CUDA machine):
# configure and build for sm_90, run every GPU test for real (DATTN_GPU_TESTS_REQUIRED=1: "no GPU"
# is a failure here, not a skip), run dattn-cuda-kernel-bench (our forward against cuBLAS's bf16
# GEMM, and the split-KV decode's bandwidth at context 262144 against the device's copy
# bandwidth, each in the same run) and, where a python3 with torch is there, torch's SDPA on the
# same inputs; write a summary and JSON under $OUT. Sized to finish within 8 minutes on a 16-core
# machine.
#
# MPI, Boost and a BLAS may be absent there (a bare GPU image): then CMake builds the core only
# (DATTN_CORE_ONLY: tensors, reference, data movement, CUDA kernels, GPU tests, the kernel
# benchmark). GoogleTest comes from the system or from .carry/googletest, copied there from this
# machine's /usr/src/googletest before the call. From the development machine:
#   echo /.carry/ >> .git/info/exclude; mkdir -p .carry; cp -r /usr/src/googletest .carry/
#   device run: command "bash tests/gpu/device_check.sh", carry [".carry"], timeout_s 600
# Environment: OUT (results folder; default build-device/out), DATTN_DEVICE_BUILD (build folder),
# DATTN_CUDA_ARCH (default 90), DATTN_DEVICE_SEQ (benchmark sequence length, default 16384),
# DATTN_DEVICE_CMAKE_ARGS (more configure options, split at spaces; e.g. -DDATTN_CORE_ONLY=ON to
# rehearse the bare-machine build on a machine that has MPI).
# Exit 0 only when the build, every GPU test and the benchmark succeeded.
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${DATTN_DEVICE_BUILD:-$repo/build-device}
out=${OUT:-$build/out}
mkdir -p "$out" "$build"
summary=$out/summary.txt
: >"$summary"
start=$SECONDS
say() { echo "device check: $*" | tee -a "$summary"; }
failed=()
log=$out/log.txt  # every step's whole output, one after the other
: >"$log"
budget=470        # seconds for the whole check (8 minutes, less a margin)
# Runs a step with a time limit (its own, cut to what is left of the budget), its output appended
# to $log and its last lines printed.
step() {
  local name=$1 limit=$2
  shift 2
  local t=$SECONDS rc=0 left=$((budget - (SECONDS - start)))
  ((limit < left)) || limit=$left
  if ((limit < 10)); then say "$name: not run, the 8-minute budget is spent"; return 124; fi
  echo "======== $name: $*" >>"$log"
  timeout --kill-after=5 "$limit" "$@" > >(tee "$out/.step" >>"$log") 2>&1 || rc=$?
  sleep 0.2  # let tee finish
  tail -n 25 "$out/.step"
  rm -f "$out/.step"
  say "$name: exit $rc in $((SECONDS - t)) s"
  return $rc
}

# ---------------------------------------------------------------- the machine
say "start $(date -u +%FT%TZ) on $(hostname)"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader |
    sed 's/^/device check: gpu: /' | tee -a "$summary"
else
  say "nvidia-smi not found"
fi
say "nvcc: $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || echo 'not found')"
say "cmake: $(cmake --version | head -n 1)"
say "mpi: $(command -v mpiexec >/dev/null && mpiexec --version 2>&1 | head -n 1 || echo 'absent (core-only build)')"
python=$(command -v python3 || true)
# Where an MPI and NCCL could come from on a bare image (for the multi-rank GPU tests, which need
# the MPI build): mpi4py's compiler wrapper, the linker's cache, the NCCL wheel.
say "probe: mpi4py mpicc: $("$python" -c 'import mpi4py; print(mpi4py.get_config().get("mpicc"))' \
  2>/dev/null || echo none); libmpi in ld cache: $(ldconfig -p 2>/dev/null | grep -c 'libmpi\.so');\
 nccl wheel: $("$python" -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' \
  2>/dev/null || echo none)"

# ---------------------------------------------------------------- configure and build
args=(-S "$repo" -B "$build" -DCMAKE_BUILD_TYPE=Release
      "-DCMAKE_CUDA_ARCHITECTURES=${DATTN_CUDA_ARCH:-90}" -DDATTN_BUILD_PYTHON=OFF)
command -v ninja >/dev/null && args+=(-G Ninja)
read -r -a more <<<"${DATTN_DEVICE_CMAKE_ARGS:-}"
args+=("${more[@]}")
if [[ -d $repo/.carry/googletest ]]; then args+=("-DDATTN_GTEST_SOURCE=$repo/.carry/googletest"); fi
# Only the GPU targets: the CPU suite runs in CI, not here.
targets=(test_cuda_attention test_cuda_movement test_device_tensor test_nccl test_gpu_attention
         test_gpu_decode test_gpu_star test_gpu_mla
         dattn-cuda-kernel-bench dattn-prefill-bench dattn-decode-bench)
build_ok=1
if step configure 90 cmake "${args[@]}"; then
  have=()
  for t in "${targets[@]}"; do
    cmake --build "$build" --target help 2>/dev/null | grep -qw -- "$t" && have+=("$t")
  done
  say "targets: ${have[*]}"
  step build 300 cmake --build "$build" -j"$(nproc)" --target "${have[@]}" ||
    build_ok=0
else
  build_ok=0
fi
((build_ok)) || failed+=(build)

# ---------------------------------------------------------------- GPU tests
if ((build_ok)); then
  export DATTN_GPU_TESTS_REQUIRED=1
  step "gpu tests" 150 ctest --test-dir "$build" -L gpu --output-on-failure --timeout 120 \
    --output-junit "$out/tests.xml" || failed+=(tests)
  grep -E "tests passed|tests failed|\*\*\*|SKIPPED" "$log" | sed 's/^/device check: /' |
    tee -a "$summary"
fi

# ---------------------------------------------------------------- benchmarks
seq=${DATTN_DEVICE_SEQ:-16384}
bench=$build/bin/dattn-cuda-kernel-bench
if ((build_ok)) && [[ -x $bench ]]; then
  step "kernel bench" 120 "$bench" -s "$seq" -H 16 -d 128 -x 262144 \
    --json "$out/kernel_bench.json" ||
    failed+=(bench)
  sed -n '/^======== kernel bench/,$p' "$log" | grep -E "^ |^# " |
    sed 's/^/device check: bench: /' | tee -a "$summary"
fi
# The prefill benchmark on one GPU (the MPI build only: ring attention through the runtime, NCCL
# between ranks, here one rank), with its float64 check.
prefill=$build/bin/dattn-prefill-bench
if ((build_ok)) && [[ -x $prefill ]]; then
  step "prefill bench" 90 "$prefill" --device cuda -t bf16 -H 16 -G 16 -d 128 -s 4096 -e 16384 \
    -f 2 -n 5 -k 1 --json "$out/prefill.json" || failed+=(prefill)
fi
decode=$build/bin/dattn-decode-bench
if ((build_ok)) && [[ -x $decode ]]; then
  step "decode bench" 60 "$decode" --device cuda -a tree -t bf16 -k 1 || failed+=(decode)
fi
if [[ -n $python ]]; then
  step "torch sdpa" 60 "$python" "$repo/tests/gpu/sdpa_bench.py" -s "$seq" -H 16 -d 128 \
    --json "$out/sdpa.json" || say "torch sdpa: not measured (see log.txt)"
  if [[ -f $out/kernel_bench.json && -f $out/sdpa.json ]]; then
    "$python" - "$out/kernel_bench.json" "$out/sdpa.json" <<'PY' | tee -a "$summary"
import json, sys
ours = json.load(open(sys.argv[1]))["rows"]
sdpa = json.load(open(sys.argv[2]))["rows"]
for s in sdpa:
    for o in ours:
        if o.get("name", "").startswith("dattn") and bool(o.get("causal")) == s["causal"] \
                and o.get("seq") == s["seq"]:
            print(f"device check: ratio to torch sdpa, causal {int(s['causal'])}: "
                  f"{o['tflops'] / s['tflops']:.3f} ({o['tflops']:.1f} vs {s['tflops']:.1f} TFLOP/s)")
PY
  fi
fi

# ---------------------------------------------------------------- summary
verdict=PASS
((${#failed[@]})) && verdict="FAIL: ${failed[*]}"
say "total $((SECONDS - start)) s: $verdict"
if [[ -n $python ]]; then
  "$python" - "$summary" "$out/summary.json" <<'PY'
import json, sys
lines = [l.rstrip("\n") for l in open(sys.argv[1])]
json.dump({"lines": lines, "verdict": lines[-1].split(": ", 2)[-1] if lines else ""},
          open(sys.argv[2], "w"), indent=1)
PY
fi
((${#failed[@]} == 0))
