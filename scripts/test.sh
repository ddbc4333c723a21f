#!/usr/bin/env bash
# Runs every test: the C++ suite (GoogleTest through ctest), then the Python suite (pytest).
# Expects scripts/setup.sh to have run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

build=build/cpp-tests
cmake -S . -B "$build" -DORTBRIDGE_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPython_EXECUTABLE="$(command -v "$PYTHON")" -Dpybind11_DIR="$($PYTHON -m pybind11 --cmakedir)" >/dev/null
cmake --build "$build" --parallel 2
(cd "$build" && ctest --output-on-failure)

# The library's tests; then, in a process of their own, the real-model and per-layer suites (over a
# hundred captures of third-party models: the memory test measures ortbridge's growth per step,
# which the heap they leave behind blurs).
models="tests/python/test_real_models.py tests/python/test_layers.py"
without_models="--ignore=tests/python/test_real_models.py --ignore=tests/python/test_layers.py"
$PYTHON -m pytest -q tests/python $without_models "$@"
# The kernel suites again with the CPU kernels on the CUDA kernels' code path (torch writes every
# output, inside a stream scope): what the CUDA execution provider runs, on machines without a GPU.
ORTBRIDGE_TEST_KERNEL_PATH=device $PYTHON -m pytest -q -p no:cacheprovider tests/python/test_inference.py \
  tests/python/test_training_graph.py tests/python/test_inplace.py tests/python/test_errors.py \
  tests/python/test_hostile_models.py tests/python/test_threads.py "$@"
$PYTHON -m pytest -q $models "$@"

# The library's tests again on the oldest ONNX Runtime releases the library supports (1.19.2 is the
# last onnxruntime-training; 1.20.1's wheel is built with C++ library assertions on). The model
# suites (no kernel code of their own) run once, above, and so do the wheel's and OnnxModule's tests
# and the graph fuzzer: on 1.19 a
# hostile node with fewer outputs than its attributes trips ORT's own unchecked index in custom-op
# shape inference (an assertion abort inside ORT; 1.20 checks it), so its guarantee starts at 1.20.
for version in ${ORT_COMPAT_VERSIONS-1.19.2 1.20.1}; do
  target=build/onnxruntime-$version
  [ -d "$target/onnxruntime" ] || $PYTHON -m pip install -q --no-deps --target "$target" "onnxruntime==$version"
  echo "== onnxruntime $version"
  PYTHONPATH="$target" $PYTHON -m pytest -q -p no:cacheprovider tests/python $without_models \
    --ignore=tests/python/test_fuzz.py --ignore=tests/python/test_wheel.py --ignore=tests/python/test_onnx_module.py "$@"
done

# OnnxModule's other gradient path: onnxruntime-training's own gradient builder (1.19.2, the last
# release; it provides the onnxruntime package, so it goes into a folder of its own).
target=build/onnxruntime-training-1.19.2
[ -d "$target/onnxruntime" ] ||
  $PYTHON -m pip install -q --no-deps --target "$target" "onnxruntime-training-cpu==1.19.2"
echo "== onnxruntime-training 1.19.2"
PYTHONPATH="$target" $PYTHON -m pytest -q -p no:cacheprovider tests/python/test_onnx_module.py "$@"
