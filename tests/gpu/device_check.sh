#!/usr/bin/env bash
# The GPU backend's check on a machine with a GPU (the device tool's H200, or any CUDA machine):
# configure and build for sm_90, run every GPU test for real (DATTN_GPU_TESTS_REQUIRED=1: "no GPU"
# is a failure here, not a skip), run dattn-cuda-kernel-bench (our forward against cuBLAS's bf16
# GEMM, the backward against the forward, and the split-KV decode's bandwidth at context 262144 against the device's copy
# bandwidth, each in the same run) and, where a python3 with torch is there, torch's SDPA on the
# same inputs; the Python binding's test of torch CUDA tensors where a CUDA torch imports; run the
# kernel tests under compute-sanitizer (memcheck, synccheck, initcheck,
# racecheck; a few small cases each); write a summary and JSON under $OUT. Sized to finish within
# 8 minutes on a 16-core machine.
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
# Exit 0 only when the build, every GPU test, the benchmark and each compute-sanitizer run
# succeeded (the sanitizer runs count as passed where compute-sanitizer is absent or does not
# support the device, which the summary says).
#
# The time: 470 s in all ($budget). Each step's limit is a cap against a hang, cut by step() to
# what is left of the budget, so the limits add up to more than it (870 s, as before the
# sanitizer steps) and a slow early step costs the last steps first. The caps: configure 60 (was
# 90), build 300, GPU tests 120 (was 150; ctest gives each test 120), kernel bench 90 (was 120),
# prefill bench 60 (was 90), decode bench 45 (was 60), torch sdpa 45 (was 60), then the sanitizer
# steps, 150 in all: memcheck 40, synccheck 25, initcheck 25, racecheck 60 (the slowest last, so
# that a short budget cuts it rather than the others). The benchmark caps were cut to make room
# for them; none of these times has been measured on the H200 yet: read them from the summary
# (each step's "exit N in S s") and set the caps from them.
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
      "-DCMAKE_CUDA_ARCHITECTURES=${DATTN_CUDA_ARCH:-90}")
command -v ninja >/dev/null && args+=(-G Ninja)
read -r -a more <<<"${DATTN_DEVICE_CMAKE_ARGS:-}"
args+=("${more[@]}")
if [[ -d $repo/.carry/googletest ]]; then args+=("-DDATTN_GTEST_SOURCE=$repo/.carry/googletest"); fi
# Only the GPU targets: the CPU suite runs in CI, not here.
targets=(test_cuda_attention test_cuda_movement test_device_tensor test_nccl test_gpu_attention
         test_gpu_decode test_gpu_star test_gpu_mla
         dattn-cuda-kernel-bench dattn-prefill-bench dattn-decode-bench dattn_python)
build_ok=1
if step configure 60 cmake "${args[@]}"; then
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
  # NCCL_CHECK_POINTERS=1 for the multi-rank tests (mpiexec passes it on to its ranks): NCCL then
  # checks on every call that the buffers it is given are device memory, and fails the call
  # (ncclInvalidArgument, which the test reports) where a host pointer or a buffer of another
  # device slipped through, instead of faulting or reading garbage. It costs a pointer query per
  # call, nothing beside the tests' NCCL setup. The single-process tests do not use NCCL.
  step "gpu tests" 120 env NCCL_CHECK_POINTERS=1 ctest --test-dir "$build" -L gpu \
    --output-on-failure --timeout 120 --output-junit "$out/tests.xml" || failed+=(tests)
  grep -E "tests passed|tests failed|\*\*\*|SKIPPED" "$log" | sed 's/^/device check: /' |
    tee -a "$summary"
fi

# ---------------------------------------------------------------- benchmarks
seq=${DATTN_DEVICE_SEQ:-16384}
bench=$build/bin/dattn-cuda-kernel-bench
if ((build_ok)) && [[ -x $bench ]]; then
  step "kernel bench" 90 "$bench" -s "$seq" -H 16 -d 128 -x 262144 \
    --json "$out/kernel_bench.json" ||
    failed+=(bench)
  sed -n '/^======== kernel bench/,$p' "$log" | grep -E "^ |^# " |
    sed 's/^/device check: bench: /' | tee -a "$summary"
fi
# The prefill benchmark on one GPU (the MPI build only: ring attention through the runtime, NCCL
# between ranks, here one rank), with its float64 check.
prefill=$build/bin/dattn-prefill-bench
if ((build_ok)) && [[ -x $prefill ]]; then
  step "prefill bench" 60 "$prefill" --device cuda -t bf16 -H 16 -G 16 -d 128 -s 4096 -e 16384 \
    -f 2 -n 5 -k 1 --json "$out/prefill.json" || failed+=(prefill)
fi
# Its backward (ring over NCCL, the CUDA backward kernel), shorter: the first backward kernel is
# the correctness-first one.
if ((build_ok)) && [[ -x $prefill ]]; then
  step "prefill backward bench" 60 "$prefill" --device cuda -t bf16 -H 16 -G 16 -d 128 -s 4096 \
    -n 3 -B -k 1 --json "$out/prefill_backward.json" || failed+=(prefill-backward)
fi
decode=$build/bin/dattn-decode-bench
if ((build_ok)) && [[ -x $decode ]]; then
  step "decode bench" 45 "$decode" --device cuda -a tree -t bf16 -k 1 || failed+=(decode)
fi
if [[ -n $python ]]; then
  step "torch sdpa" 45 "$python" "$repo/tests/gpu/sdpa_bench.py" -s "$seq" -H 16 -d 128 \
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

# ---------------------------------------------------------------- Python on the GPU
# The Python binding's GPU path on torch's own CUDA tensors (tests/python/test_cuda_tensors.py,
# one rank: autograd through CUDA tensors against float64 and the CPU path, DeviceArray, bad
# input), where the MPI build made the module (python3 headers and pybind11 there) and a torch
# with CUDA imports; exit 77 (no CUDA torch) is a skip.
if ((build_ok)) && [[ -n $python && -d $build/python/dattn ]]; then
  step "python cuda tensors" 40 env PYTHONPATH="$build/python" "$python" \
    "$repo/tests/python/test_cuda_tensors.py"
  case $? in
    0) ;;
    77) say "python cuda tensors: skipped (no torch with CUDA, or numpy, for $python)" ;;
    *) failed+=(python) ;;
  esac
else
  say "python cuda tensors: not run (no Python module built)"
fi

# ---------------------------------------------------------------- compute-sanitizer
# The kernel tests (test_cuda_attention: the forward, the split-KV decode and its merge, the MLA
# decode, the backward) under each of compute-sanitizer's tools, one step each: memcheck (out-of-bounds and
# misaligned accesses, device faults), synccheck (barriers that not every thread reaches),
# initcheck (reads of device memory never written, copies to the host included) and racecheck
# (shared-memory hazards). The tools make a kernel 10-100 times slower (racecheck most) and
# instrument each kernel at its first launch, so each runs a few small cases picked for what it
# checks: one case of each flash instantiation the tests reach (D 64 to 256, D != Dv), partial
# tiles, element loads (odd D), windows, documents, rows with no key, the decode kernel on 1 and
# 1000 keys, the MLA decode. --error-exitcode 1: without it the tool exits 0 after reporting
# errors; a failing test fails the step too. No --leak-check: the kernels allocate their scratch
# from the stream-ordered pool (cudaMallocAsync), which keeps freed memory, so a leak report
# would not be about our code.
sanitizer=$(command -v compute-sanitizer || true)
if [[ -z $sanitizer && -x /usr/local/cuda/bin/compute-sanitizer ]]; then
  sanitizer=/usr/local/cuda/bin/compute-sanitizer
fi
kernel_tests=$build/tests/gpu/test_cuda_attention
fwd=Cases/CudaKernelVsReference.AttentionForward
dec=Cases/CudaDecodeVsReference.DecodeForward
bwd=Cases/CudaBackward.MatchesFloat64ReferenceAndRepeatsBitwise
declare -A cases
cases[memcheck]="$fwd/S1_D64_causal_bf16:$fwd/S77_D80_gqa4_causal_bf16:$fwd/S300_D128_causal_fp16"
cases[memcheck]+=":$fwd/S130_D256_gqa8_causal_bf16:$fwd/S150_D160_causal_bf16"
cases[memcheck]+=":$fwd/S200_D192_Dv128_causal_bf16:$fwd/S90_D33_Dv17_causal_bf16"
cases[memcheck]+=":$fwd/Sq260_Sk33_noncausal_bf16:$fwd/S300_window37_20_D64_bf16"
cases[memcheck]+=":$fwd/S300_docs_causal_D64_bf16:$dec/Sq1_Sk1_D64_bf16"
cases[memcheck]+=":$dec/Sq2_Sk300_gqa2_D40_Dv24_bf16:$dec/Sq7_Sk1000_gqa4_D192_Dv128_causal_fp16"
cases[memcheck]+=":$dec/Sq7_Sk1000_gqa2_D64_docs_span_bf16:CudaKernelEmptyRows.*:CudaDecodeMerge.*"
cases[memcheck]+=":CudaMlaDecode.*:$bwd/S90_D33_Dv17_causal_f16:$bwd/S130_D256_gqa2_causal_bf16"
cases[memcheck]+=":$bwd/Sq300_at0_Sk200_at150_causal_bf16:CudaBackwardRuns.*:CudaBackwardNonFinite.*"
cases[synccheck]="$fwd/S77_D80_gqa4_causal_bf16:$fwd/keys_in_future_causal_bf16"
cases[synccheck]+=":$fwd/S130_D256_gqa8_causal_bf16:$fwd/S300_docs_causal_D64_bf16"
cases[synccheck]+=":$dec/Sq1_Sk1_D64_bf16:$dec/Sq7_Sk1000_gqa2_D64_docs_span_bf16"
cases[synccheck]+=":CudaMlaDecode.MatchesFloat64Reference:$bwd/S77_D128_gqa4_causal_bf16"
cases[synccheck]+=":$bwd/keys_in_future_causal_bf16"
cases[initcheck]="$fwd/S77_D80_gqa4_bf16:$fwd/S90_D33_Dv17_causal_bf16"
cases[initcheck]+=":$fwd/S200_D192_Dv128_gqa2_bf16:$dec/Sq2_Sk300_gqa2_D40_Dv24_bf16"
cases[initcheck]+=":CudaDecodeMerge.*:CudaMlaDecode.MatchesFloat64Reference"
cases[initcheck]+=":$bwd/S90_D33_Dv17_causal_f16:CudaBackwardDelta.*"
cases[racecheck]="$fwd/S300_D128_causal_bf16:$fwd/S130_D256_gqa8_causal_bf16"
cases[racecheck]+=":$fwd/S90_D33_Dv17_causal_fp16:$dec/Sq16_Sk1000_gqa8_D128_causal_bf16"
cases[racecheck]+=":$dec/Sq2_Sk300_gqa2_D40_Dv24_bf16:CudaMlaDecode.MatchesFloat64Reference"
cases[racecheck]+=":$bwd/S77_D192_Dv128_window_f16"
declare -A limit=([memcheck]=40 [synccheck]=25 [initcheck]=25 [racecheck]=60)
if ! ((build_ok)) || [[ ! -x $kernel_tests ]]; then
  say "compute-sanitizer: not run (no kernel tests built)"
elif [[ -z $sanitizer ]]; then
  say "compute-sanitizer: not found: the kernel tests ran without it (skipped, not failed)"
else
  say "compute-sanitizer: $("$sanitizer" --version 2>/dev/null | grep -io -m 1 'version [0-9.]*' || echo '?')"
  for tool in memcheck synccheck initcheck racecheck; do
    name="sanitizer $tool"
    step "$name" "${limit[$tool]}" "$sanitizer" --tool "$tool" --error-exitcode 1 \
      --print-limit 20 "$kernel_tests" --gtest_filter="${cases[$tool]}"
    rc=$?
    lines=$(sed -n "/^======== $name: /,/^======== /p" "$log")
    # Where the tool cannot work on this machine (seen on a gVisor GPU machine: "Device not
    # supported", then error 999), no run here can say anything: skip, and say so.
    if grep -q "Device not supported" <<<"$lines"; then
      say "compute-sanitizer: does not support this device here: the sanitizer runs are skipped"
      break
    fi
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|\[  (PASSED|FAILED)  \]" <<<"$lines" |
      sed "s/^/device check: $tool: /" | tee -a "$summary"
    ((rc == 0)) || failed+=("$tool")
  done
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
