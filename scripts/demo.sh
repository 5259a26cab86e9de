#!/usr/bin/env bash
# The main job: builds fbn, installs the Python package into the project venv and runs the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/pip install -q --no-build-isolation .
cmake -S . -B build/release -G Ninja -DCMAKE_BUILD_TYPE=Release -DFBN_BUILD_TESTS=OFF \
  -DFBN_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build build/release --target fbn_example_fused_ops
echo "== C++ example (examples/fused_ops.cc)"
build/release/examples/fbn_example_fused_ops
echo "== Python example (examples/ops_demo.py)"
.venv/bin/python examples/ops_demo.py
