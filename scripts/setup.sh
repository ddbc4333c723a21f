#!/usr/bin/env bash
# Sets everything up on a fresh Debian/Ubuntu machine with Python 3.9+, then runs the main job
# (examples/quickstart.py). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# Build tools and GoogleTest, from Debian's packages (skipped when already there).
need=()
for pkg in cmake g++ libgtest-dev; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
# Python's C headers, when the interpreter in use does not ship them (Debian's own python3).
$PYTHON -c 'import os, sysconfig; exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' ||
  need+=(python3-dev)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi

# ONNX Runtime's C headers into third_party/ (download only).
bash scripts/fetch_ort_headers.sh

# torch first, pinned: an open range with no torch installed would pull a multi-GB CUDA build.
$PYTHON -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
$PYTHON -m pip install -q scikit-build-core pybind11 ninja
$PYTHON -m pip install -q --no-build-isolation -e ".[test]"

# The main job: export, run in ORT, train a few steps with OrtModule; each compared with eager PyTorch.
(cd examples && $PYTHON quickstart.py)
