#!/usr/bin/env bash
# Sets everything up on a fresh Debian/Ubuntu machine with Python 3.11+, then runs the main job
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
$PYTHON -m pip install -q --no-build-isolation -e ".[cpu,test]"
# Test-only: timm (tests/python/test_real_models.py), with --no-deps. timm imports torchvision when
# imported; the registry's torchvision for torch 2.13 (0.28.0) is a CUDA build whose C extension
# does not load against CPU torch, after which its import fails ("operator torchvision::nms does
# not exist"; 0.17.2 and 0.22.1 fail the same way). 0.16.2's import works without its C extension
# (a warning), and timm needs only its Python part; --no-deps, as it asks for torch 2.1.2. Their
# other requirements are in the test extra.
$PYTHON -m pip install -q --no-deps "timm==1.0.31" "torchvision==0.16.2"

# The main job: export, run in ORT, train a few steps with OrtModule; each compared with eager PyTorch.
(cd examples && $PYTHON quickstart.py)
