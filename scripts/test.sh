#!/usr/bin/env bash
# Runs every test: the C++ suite (GoogleTest through ctest), then the Python suite (pytest).
# Expects scripts/setup.sh to have run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

build=build/cpp-tests
cmake -S . -B "$build" -G Ninja -DORTBRIDGE_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPython_EXECUTABLE="$(command -v "$PYTHON")" -Dpybind11_DIR="$($PYTHON -m pybind11 --cmakedir)" >/dev/null
cmake --build "$build" --parallel
(cd "$build" && ctest --output-on-failure)

$PYTHON -m pytest -q tests/python "$@"
