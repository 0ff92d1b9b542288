#!/usr/bin/env bash
# Makes (or reuses) a venv of Debian's /usr/bin/python3 with the newest PyPI packages that users
# run dattn's Python binding with: torch (the CPU works; the wheel pulls ~3 GB of CUDA wheels),
# numpy 2, transformers (the Hugging Face recipe), mpi4py (dattn.from_comm), and scikit-build-core
# with pybind11 (`pip install .` of the repository). CI runs the Python tests a second time with it
# (cmake -DDATTN_PYPI_PYTHON=DIR/bin/python). Prints the interpreter's path on its last line.
#   bash launch/pypi_venv.sh [DIR]     (default: $DATTN_PYPI_VENV, else ~/.cache/dattn/pypi-venv)
# An existing venv whose packages all import is kept as it is (no network); delete DIR to refresh.
set -euo pipefail

venv=${1:-${DATTN_PYPI_VENV:-$HOME/.cache/dattn/pypi-venv}}
packages=(torch numpy transformers mpi4py scikit-build-core "pybind11>=2.12")
modules="torch, numpy, transformers, mpi4py, scikit_build_core, pybind11"

say() { echo "dattn pypi venv: $*" >&2; }

if [[ -x $venv/bin/python ]] && "$venv/bin/python" -c "import $modules" 2>/dev/null; then
  say "reusing $venv"
else
  start=$SECONDS
  say "creating $venv with ${packages[*]} (a few minutes: torch's wheels are ~3 GB)"
  [[ -x $venv/bin/python ]] || /usr/bin/python3 -m venv "$venv"
  log=$(mktemp "${TMPDIR:-/tmp}/dattn-pypi-venv.XXXXXX.log")
  # mpi4py builds from source against Open MPI (mpicc from libopenmpi-dev).
  if ! "$venv/bin/pip" install -q --disable-pip-version-check "${packages[@]}" >"$log" 2>&1; then
    say "pip failed; last lines of $log:"
    tail -n 30 "$log" >&2
    exit 1
  fi
  rm -f "$log"
  say "created in $((SECONDS - start)) s"
fi
"$venv/bin/python" - >&2 <<'EOF'
import numpy, torch, transformers, mpi4py, pybind11
print(f"dattn pypi venv: torch {torch.__version__}, numpy {numpy.__version__}, "
      f"transformers {transformers.__version__}, mpi4py {mpi4py.__version__}, "
      f"pybind11 {pybind11.__version__}")
EOF
echo "$venv/bin/python"
