#!/usr/bin/env bash
# The library's layers, checked over every tracked C, C++ and CUDA file: a quoted #include may
# name only a file of its own layer or of a layer below it (ctest: layering, label unit).
#   src/base          the base types (error, dtype, tensor, spec): includes only src/base
#   kernels/          CPU and CUDA kernels, data movement, the merge: kernels/ and src/base only
#   collective/       communicators: collective/ and src/base only
#   src/ (the rest)   layout, runtime, API, strategies, dispatch, models, C API: src/, kernels/,
#                     collective/ (never launch/, examples/, tests/, python/)
#   python/           the binding: python/, src/, kernels/, collective/
#   launch/           program support (main wrapper, launch options): launch/ and the library
#   examples/         the benchmark engine and workloads: examples/, launch/ and the library
#   launch/run.cpp, tests/: programs on top of everything
# An include without a folder names a file beside the includer. Usage: check_layers.sh [ROOT]
set -euo pipefail
cd "${1:-.}"

if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  files=$(git ls-files -- '*.h' '*.c' '*.cpp' '*.cu' '*.cuh' '*.inl')
else
  files=$(find src kernels collective python -type f \( -name '*.h' -o -name '*.c' -o \
          -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' -o -name '*.inl' \))
fi

# The folders a file of each layer may include from (prefixes of the included path).
allowed_for() {
  case "$1" in
    src/base/*) echo "src/base/" ;;
    kernels/*) echo "kernels/ src/base/" ;;
    collective/*) echo "collective/ src/base/" ;;
    src/*) echo "src/ kernels/ collective/" ;;
    python/*) echo "python/ src/ kernels/ collective/" ;;
    launch/run.cpp) echo "" ;;  # dattn-run: the program over every workload
    launch/*) echo "launch/ src/ kernels/ collective/" ;;
    examples/*) echo "examples/ launch/ src/ kernels/ collective/" ;;
    *) echo "" ;;  # tests/: programs on top of the library
  esac
}

bad=0
for f in $files; do
  allowed=$(allowed_for "$f")
  [ -n "$allowed" ] || continue
  while IFS= read -r inc; do
    [[ "$inc" == */* ]] || continue  # beside the includer
    ok=0
    for prefix in $allowed; do
      if [[ "$inc" == "$prefix"* ]]; then ok=1; break; fi
    done
    if [ "$ok" -eq 0 ]; then
      echo "layering: $f includes \"$inc\": a file of its layer may include only from: $allowed"
      bad=1
    fi
  done < <(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$f")
done
if [ "$bad" -ne 0 ]; then
  echo "layering: FAILED (the layers are described in README.md, \"Repository layout\")"
  exit 1
fi
echo "layering: every include runs downwards ($(echo "$files" | wc -w) files)"
