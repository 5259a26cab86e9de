#!/usr/bin/env bash
# Installs what fbn's build, tests and examples need on a fresh Debian 12 machine, idempotently:
# Debian packages (compilers, CMake, Highway, GoogleTest, Google Benchmark) and a project venv
# (.venv) with the Python dependencies. Usage: scripts/setup.sh [--with-tf]
set -euo pipefail
cd "$(dirname "$0")/.."

with_tf=0
for arg in "$@"; do
  case "$arg" in
    --with-tf) with_tf=1 ;;
    *) echo "setup.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done

apt_packages=(cmake ninja-build g++ clang-14 libclang-rt-14-dev clang-format-14 libhwy-dev
              libgtest-dev libgmock-dev libbenchmark-dev python3-venv python3-dev
              libopenmpi-dev openmpi-bin)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "== apt-get install ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  "$PY" -m venv .venv
fi
pip_packages=(numpy ml_dtypes pytest "nanobind>=2.0" "scikit-build-core>=0.10" matplotlib scikit-learn
              mpi4py)
((with_tf)) && pip_packages+=(tensorflow-cpu)
if ! .venv/bin/python -c "import numpy, ml_dtypes, pytest, nanobind, scikit_build_core, matplotlib, sklearn, mpi4py" 2>/dev/null ||
   { ((with_tf)) && ! .venv/bin/python -c "import tensorflow, tf_keras" 2>/dev/null; }; then
  echo "== pip install ${pip_packages[*]}"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q "${pip_packages[@]}"
  # tf.compat.v1.layers lives in tf-keras; --no-deps because it asks for the full `tensorflow`
  # package, which tensorflow-cpu already provides.
  if ((with_tf)); then .venv/bin/pip install -q --no-deps "tf-keras~=2.21.0"; fi
fi
