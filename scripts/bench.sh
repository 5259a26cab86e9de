#!/usr/bin/env bash
# The side-by-side batch-norm benchmark from a fresh checkout: fbn against oneDNN, TensorFlow
# (oneDNN and Eigen kernels) and PyTorch, same machine, threads and shapes (bench/README.md).
#
#   scripts/bench.sh --quick            # a handful of shapes, few reps (about 2-3 minutes)
#   scripts/bench.sh                    # the full mode (ResNet-50 mb1/32/128 + GoogLeNet-v3)
#   scripts/bench.sh --libs fbn,onednn --passes fwd_infer --dtypes f32 --sets r50_mb32
#
# Every argument goes to bench/run_bench.py (--help lists them). Installs what it needs:
# scripts/setup.sh --with-tf (Debian packages, .venv with TensorFlow), matplotlib, Debian's
# python3-torch, and a CPU-runtime oneDNN. Builds Release into build-bench/ with -j2.
# Outputs: bench/results/<stamp>-<mode>/ (results.csv, cases.csv, summary.txt, bench.png).
#
# oneDNN: FBN_ONEDNN_ROOT=<prefix with include/oneapi/dnnl and lib/libdnnl.so> picks a build.
# Otherwise the venv's is used when it has a CPU runtime; the current PyPI release (onednn-devel)
# is a SYCL build that has no CPU engine here, so the newest CPU-runtime wheels on PyPI
# (onednn-cpu-gomp / onednn-devel-cpu-gomp, OpenMP) are unpacked into build-bench/_deps.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=build-bench
JOBS=${JOBS:-2}

echo "== dependencies"
scripts/setup.sh --with-tf
if ! .venv/bin/python -c "import matplotlib" 2>/dev/null; then
  .venv/bin/pip install -q matplotlib
fi
if ! /usr/bin/python3 -c "import torch" 2>/dev/null; then
  echo "== apt-get install python3-torch (PyTorch runs under /usr/bin/python3, never with TF)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-torch >/dev/null
fi

cpu_runtime_ok() {  # $1: a prefix; true when its oneDNN has a non-SYCL CPU runtime
  local cfg="$1/include/oneapi/dnnl/dnnl_config.h"
  [ -f "$cfg" ] && ls "$1"/lib/libdnnl.so* >/dev/null 2>&1 &&
    ! grep -Eq '^#define DNNL_CPU_RUNTIME DNNL_RUNTIME_(SYCL|NONE)' "$cfg"
}

ONEDNN_ROOT=${FBN_ONEDNN_ROOT:-}
if [ -z "$ONEDNN_ROOT" ]; then
  if cpu_runtime_ok .venv; then
    ONEDNN_ROOT=$PWD/.venv
  else
    ONEDNN_ROOT=$PWD/$BUILD/_deps/onednn-cpu-gomp
    if ! cpu_runtime_ok "$ONEDNN_ROOT"; then
      echo "== oneDNN: the venv has none with a CPU runtime; unpacking onednn-cpu-gomp from PyPI"
      wheels=$BUILD/_deps/wheels
      mkdir -p "$wheels" "$ONEDNN_ROOT"
      .venv/bin/pip download -q --no-deps -d "$wheels" onednn-cpu-gomp onednn-devel-cpu-gomp
      for w in "$wheels"/onednn_cpu_gomp-*.whl "$wheels"/onednn_devel_cpu_gomp-*.whl; do
        rm -rf "$wheels/x" && .venv/bin/python -m zipfile -e "$w" "$wheels/x"
        for d in "$wheels"/x/*.data/data; do cp -a "$d"/. "$ONEDNN_ROOT"/; done
      done
      rm -rf "$wheels/x"
    fi
  fi
fi
echo "== oneDNN for onednn_bench: $ONEDNN_ROOT"

echo "== configure + build ($BUILD, Release, -j$JOBS)"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFBN_BUILD_BENCHMARKS=ON \
  -DFBN_BUILD_TESTS=OFF -DFBN_BUILD_EXAMPLES=OFF -DFBN_BUILD_PYTHON=OFF \
  -DFBN_ONEDNN_ROOT="$ONEDNN_ROOT" >/dev/null
cmake --build "$BUILD" -j "$JOBS"

echo "== bench/run_bench.py $*"
exec .venv/bin/python bench/run_bench.py --build-dir "$BUILD" "$@"
