#!/usr/bin/env bash
# The main job: trains a small network with fbn's batch normalization on scikit-learn's handwritten
# digits and infers with the moving statistics, in Python (the installed fbn package) and in C++
# (the layer API). Installs what it needs (scripts/setup.sh), then builds fbn twice: the Python
# package (pip install .) and the C++ example (build/demo). Writes build/digits.csv (the dataset
# for the C++ program) and build/train_digits.png (the training curves).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "== pip install . (builds fbn and its Python package; a few minutes the first time)"
.venv/bin/pip install -q --no-build-isolation .
echo "== building the C++ example (examples/train_digits.cc)"
cmake -S . -B build/demo -G Ninja -DCMAKE_BUILD_TYPE=Release -DFBN_BUILD_TESTS=OFF \
  -DFBN_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build build/demo --target fbn_example_train_digits >build/demo/example-build.log ||
  { cat build/demo/example-build.log; exit 1; }
echo
echo "== Python: examples/train_digits.py"
# Run from the repository root, so `import fbn` is the installed package (python/ is not on the
# path: Python puts the script's own directory, examples/, first).
.venv/bin/python examples/train_digits.py --export-csv build/digits.csv \
  --plot build/train_digits.png
echo
echo "== C++: examples/train_digits.cc (the same network through the C++ layer API)"
build/demo/examples/fbn_example_train_digits build/digits.csv
