#!/usr/bin/env bash
# Prepares WHEEL_DIR for scripts/gpu_check.sh, on a machine with a package registry: the
# onnxruntime-gpu wheel for the GPU machine's Python, split into parts small enough to carry one
# per call to a machine that takes a limited size per transfer (joined there in name order).
#
#   bash scripts/gpu_wheels.sh [WHEEL_DIR [PYTHON_VERSION]]     defaults: .whl 3.12
#
# Set ORT_GPU_VERSION to pick the release (1.27 or newer for torch's CUDA 13 builds) and PART_SIZE
# (split's -b; 48M by default, which with the tree stays under 64 MiB). Anything else gpu_check.sh
# finds missing there goes into WHEEL_DIR the same way:
#   pip download --no-deps --only-binary=:all: --python-version ... -d WHEEL_DIR NAME==VERSION
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl} python_version=${2:-3.12}
version=${ORT_GPU_VERSION:-1.31.1}
mkdir -p "$dest"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
  "${platforms[@]}" -d "$tmp" "onnxruntime-gpu==$version"
wheel=$(ls "$tmp"/onnxruntime_gpu-*.whl)
name=$(basename "$wheel")
rm -f "$dest/$name".part-*
split -b "${PART_SIZE:-48M}" "$wheel" "$dest/$name.part-"
ls -l "$dest/$name".part-*
echo "carry each part in its own call (gpu_check.sh joins them): ${dest}/${name}.part-*"
