#!/usr/bin/env bash
# Synchronized batch normalization over MPI: builds fbn with -DFBN_WITH_MPI=ON (library, fbn::mpi,
# the Python extension) in build/mpi, then runs the MPI GoogleTest binary under mpirun with 2 and
# 3 processes (ctest -L mpi) and the Python test (mpi4py) plainly and under mpirun with 2 and 3
# processes. Installs Open MPI and mpi4py first if they are missing. Every mpirun is bounded by a
# timeout, so a hang fails the run. Takes well under a minute after the build.
# Usage: scripts/test_mpi.sh [--bench]   (--bench also prints the synchronization overhead table)
set -euo pipefail
cd "$(dirname "$0")/.."
bench=0
[ "${1:-}" = "--bench" ] && bench=1
jobs=${FBN_JOBS:-$(nproc)}

if ! command -v mpirun >/dev/null 2>&1 || ! dpkg -s libopenmpi-dev >/dev/null 2>&1; then
  echo "== apt-get install libopenmpi-dev openmpi-bin"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libopenmpi-dev openmpi-bin >/dev/null
fi
[ -x .venv/bin/python ] || scripts/setup.sh
PY=$PWD/.venv/bin/python
if ! "$PY" -c "import mpi4py" 2>/dev/null; then
  echo "== pip install mpi4py"
  .venv/bin/pip install -q mpi4py
fi

# Open MPI: allow root (CI containers), more processes than cores, and let a waiting rank yield
# its core to the others. Other MPI implementations ignore these variables.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_mpi_yield_when_idle=1

echo "== build with FBN_WITH_MPI=ON (build/mpi)"
cmake -S . -B build/mpi -G Ninja -DCMAKE_BUILD_TYPE=Release -DFBN_WERROR=ON -DFBN_WITH_MPI=ON \
  -DFBN_BUILD_PYTHON=ON -DPython_EXECUTABLE="$PY" -DFBN_BUILD_BENCHMARKS=OFF \
  -DFBN_BUILD_EXAMPLES=OFF >/dev/null
cmake --build build/mpi -j "$jobs" --target fbn_mpi_sync_test fbn_synchronized_test \
  fbn_mpi_sync_bench _fbn

echo "== C++: synchronized layer and ops, ranks as threads and under mpirun -np 2 / -np 3"
ctest --test-dir build/mpi --output-on-failure -R '^(Ranks/)?Sync|^fbn_mpi_sync'

echo "== Python: tests/python/test_layer_synchronized.py with 1, 2 and 3 processes"
export PYTHONPATH=$PWD/build/mpi/python
"$PY" -m pytest -q -p no:cacheprovider tests/python/test_layer_synchronized.py
for np in 2 3; do
  timeout 300 mpirun -np "$np" "$PY" -m pytest -q -p no:cacheprovider --color=no \
    tests/python/test_layer_synchronized.py
done

if ((bench)); then
  echo "== synchronization overhead (mpirun -np 2, one thread per rank)"
  timeout 600 mpirun -np 2 build/mpi/tests/mpi/fbn_mpi_sync_bench --iters 60
fi
