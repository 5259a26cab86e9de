#!/usr/bin/env bash
# Runs every fbn test from a fresh checkout: format check, Release build with warnings as errors
# and the C++ tests, the same tests under AddressSanitizer+UndefinedBehaviorSanitizer (clang),
# then `pip install .` and the Python suites (including the conformance tests against the real
# TensorFlow), the MPI tests, and last the hardening runs of scripts/fuzz.sh: the fuzz smoke
# (libFuzzer harnesses under ASan+UBSan: saved regressions replayed, then FUZZ_SECONDS, default
# 20, of fuzzing per harness) and every C++ test under ThreadSanitizer.
# Usage: scripts/test.sh [--fast]   (--fast skips the sanitizer, fuzzing and TSan steps)
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
[ "${1:-}" = "--fast" ] && fast=1
jobs=$(nproc)
# Each step's header shows the seconds since the start.
step() { echo "== [${SECONDS}s] $*"; }

scripts/setup.sh --with-tf
PY=$PWD/.venv/bin/python

step "format check (clang-format-14)"
git ls-files '*.h' '*.cc' '*.cpp' | xargs clang-format-14 --dry-run -Werror

step "Release build (g++, -Werror) and C++ tests"
cmake -S . -B build/release -G Ninja -DCMAKE_BUILD_TYPE=Release -DFBN_WERROR=ON \
  -DFBN_BUILD_TESTS=ON -DFBN_BUILD_BENCHMARKS=ON -DFBN_BUILD_EXAMPLES=ON \
  -DFBN_BUILD_PYTHON=ON -DPython_EXECUTABLE="$PY" >/dev/null
cmake --build build/release -j "$jobs"
ctest --test-dir build/release --output-on-failure -j "$jobs"

if ((!fast)); then
  step "AddressSanitizer + UndefinedBehaviorSanitizer build (clang) and C++ tests"
  CC=clang-14 CXX=clang++-14 cmake -S . -B build/asan -G Ninja -DCMAKE_BUILD_TYPE=Debug \
    -DFBN_WERROR=ON -DFBN_SANITIZE="address;undefined" -DFBN_BUILD_TESTS=ON \
    -DFBN_BUILD_BENCHMARKS=OFF -DFBN_BUILD_EXAMPLES=OFF >/dev/null
  cmake --build build/asan -j "$jobs"
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build/asan --output-on-failure -j "$jobs" -E 'consumer|bench'
fi

step "pip install . and the Python tests"
.venv/bin/pip install -q --no-build-isolation .
# Run from tests/ so that the installed package, not the source tree, is imported.
(cd tests/python && "$PY" -m pytest -q -p no:cacheprovider .)

step "MPI: synchronized batch normalization (mpirun -np 2 and -np 3)"
scripts/test_mpi.sh

if ((!fast)); then
  # Last, so that a new fuzzing finding does not hide the deterministic suites' results.
  step "fuzz smoke: libFuzzer harnesses (ASan+UBSan), regressions, ${FUZZ_SECONDS:-20}s per harness"
  CC=clang-14 CXX=clang++-14 FUZZ_SECONDS=${FUZZ_SECONDS:-20} FUZZ_BUILD_DIR=build/fuzz \
    BUILD_JOBS=$jobs scripts/fuzz.sh smoke
  step "ThreadSanitizer: concurrency stress tests and every C++ test"
  CC=clang-14 CXX=clang++-14 TSAN_BUILD_DIR=build/tsan BUILD_JOBS=$jobs scripts/fuzz.sh tsan
fi
step "all tests passed"
