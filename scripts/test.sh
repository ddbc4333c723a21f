#!/usr/bin/env bash
# Runs every test: the C++ suite (GoogleTest through ctest), then the Python suite (pytest) on the
# installed torch, and the compatibility suite on the oldest and newest torch releases (with the
# kernels' suites on the oldest ONNX Runtime release), each in a virtual environment of its own
# (made on the first run: about 5 GB and a few minutes each). Expects scripts/setup.sh to have run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# Formatting and lint first (pyproject.toml's [tool.ruff], .clang-format): a change they would make
# fails here (`ruff format . && ruff check --fix .`, `clang-format -i <files>` apply them).
$PYTHON -m ruff format --check --quiet .
$PYTHON -m ruff check --quiet .
$PYTHON -c 'import sys, clang_format; sys.argv[0] = "clang-format"; clang_format.clang_format()' \
  --dry-run -Werror csrc/*.cc csrc/*.h tests/cpp/*.cc tests/fuzz/*.cc
# The docs site (mkdocs.yml), warnings as errors: broken links and anchors, API entries that do not
# resolve. (tests/python/test_docs.py runs its examples.)
$PYTHON -m mkdocs build --strict --quiet

build=build/cpp-tests
cmake -S . -B "$build" -DORTBRIDGE_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPython_EXECUTABLE="$(command -v "$PYTHON")" -Dpybind11_DIR="$($PYTHON -m pybind11 --cmakedir)" >/dev/null
cmake --build "$build" --parallel 2
(cd "$build" && ctest --output-on-failure)

# The Python suites run on every core (pytest-xdist; ORTBRIDGE_TEST_WORKERS sets how many workers):
# each test in a worker process of its own session, a module's tests spread over the workers
# (--dist loadgroup: those of test_wheel.py share one, and its wheel).
parallel=(-n "${ORTBRIDGE_TEST_WORKERS:-auto}" --dist loadgroup)

# The library's tests; then, in processes of their own, the real-model and per-layer suites (over a
# hundred captures of third-party models: the memory test measures ortbridge's growth per step,
# which the heap they leave behind blurs).
models="tests/python/test_real_models.py tests/python/test_layers.py"
without_models="--ignore=tests/python/test_real_models.py --ignore=tests/python/test_layers.py"
echo "== the Python suites (${SECONDS} s in)"
$PYTHON -m pytest -q "${parallel[@]}" tests/python $without_models "$@"
# The kernel suites again with the CPU kernels on the CUDA kernels' code path (torch writes every
# output, inside a stream scope): what the CUDA execution provider runs, on machines without a GPU.
ORTBRIDGE_TEST_KERNEL_PATH=device $PYTHON -m pytest -q -p no:cacheprovider tests/python/test_inference.py \
  tests/python/test_training_graph.py tests/python/test_inplace.py tests/python/test_errors.py \
  tests/python/test_hostile_models.py tests/python/test_threads.py "$@"
echo "== the model suites (${SECONDS} s in)"
$PYTHON -m pytest -q "${parallel[@]}" $models "$@"

# The suites of what ONNX Runtime runs (kernels, export, training) and the audit of ONNX Runtime's
# own kernels (docs/ort_kernels.md), for the oldest ONNX Runtime release the library supports (run
# below, in the oldest torch's environment) and for any release ORT_COMPAT_VERSIONS names (e.g.
# 1.20.1, whose wheel is built with C++ library assertions on), in the main environment. The rest
# runs once, above: the model suites (no kernel code of their own), the benchmarks' checks, the
# wheel's and OnnxModule's tests, and the graph fuzzer (on 1.19 a hostile node with fewer outputs
# than its attributes trips ORT's own unchecked index in custom-op shape inference: an assertion
# abort inside ORT; 1.20 checks it, so that guarantee starts at 1.20).
kernel_suites="tests/python/test_inference.py tests/python/test_training_graph.py tests/python/test_inplace.py
  tests/python/test_errors.py tests/python/test_hostile_models.py tests/python/test_threads.py
  tests/python/test_lifecycle.py tests/python/test_registry.py tests/python/test_convert.py
  tests/python/test_device_path.py tests/python/test_export.py tests/python/test_training.py
  tests/python/test_capture.py tests/python/test_kernel_styles.py tests/python/test_linalg_checks.py
  tests/python/test_onnxruntime_tools.py tests/python/test_ort_kernel_audit.py"
for version in ${ORT_COMPAT_VERSIONS-}; do
  target=build/onnxruntime-$version
  [ -d "$target/onnxruntime" ] || $PYTHON -m pip install -q --no-deps --target "$target" "onnxruntime==$version"
  echo "== onnxruntime $version (${SECONDS} s in)"
  PYTHONPATH="$target" $PYTHON -m pytest -q -p no:cacheprovider "${parallel[@]}" $kernel_suites "$@"
done

# OnnxModule's other gradient path: onnxruntime-training's own gradient builder (1.19.2, the last
# release; it provides the onnxruntime package, so it goes into a folder of its own).
target=build/onnxruntime-training-1.19.2
[ -d "$target/onnxruntime" ] ||
  $PYTHON -m pip install -q --no-deps --target "$target" "onnxruntime-training-cpu==1.19.2"
echo "== onnxruntime-training 1.19.2 (${SECONDS} s in)"
PYTHONPATH="$target" $PYTHON -m pytest -q -p no:cacheprovider tests/python/test_onnx_module.py "$@"

# The compatibility suite on other torch releases, each in a virtual environment of its own
# (scripts/compat_env.sh: registry wheels): the oldest supported, with the oldest ONNX Runtime
# (and the kernels' suites above), and the newest, with the newest; the main run has 2.13. With
# the main run they cover each Python the package supports. What differs between releases:
# kernels, both export paths, OrtModule and torch.compile training (a CNN, a transformer block,
# Hugging Face models, checkpointing), what a training script changes between calls (dtypes,
# autocast, modes, hooks, copies, functional_call), bfloat16, random operators, OnnxModule, where
# torch's private APIs are reached, custom operators (torch.library, C++), linalg's error checks,
# ONNX Runtime's tools, backward graphs in stages, the nodes of kernels on the deny list that each
# release's exporter would write (conftest.py checks, in every run, that the kernel audit covers
# every kind of node). TORCH_COMPAT names other cells (TORCH:PYTHON[:ONNXRUNTIME], e.g. 2.11.0:3.12,
# the GPU machine's), COMPAT_MODELS=1 adds the model suites (timm and Hugging Face models,
# bfloat16 and float16, DDP and FSDP2) to each.
compat_suites="tests/python/test_inference.py tests/python/test_training_graph.py tests/python/test_inplace.py
  tests/python/test_errors.py tests/python/test_export.py tests/python/test_training.py
  tests/python/test_capture.py tests/python/test_model_changes.py tests/python/test_randomness.py
  tests/python/test_copy_safety.py tests/python/test_onnx_module.py tests/python/test_private_apis.py
  tests/python/test_kernel_styles.py tests/python/test_linalg_checks.py tests/python/test_onnxruntime_tools.py
  tests/python/test_backward_stages.py tests/python/test_unsafe_kernels.py tests/python/test_ecosystem.py"
model_suites="tests/python/test_real_models.py tests/python/test_mixed_precision.py tests/python/test_distributed.py"
for cell in ${TORCH_COMPAT-2.9.1:3.12:1.19.2 2.15.0:3.13}; do
  IFS=: read -r torch_version python_version ort_version <<<"$cell"
  echo "== torch $torch_version on Python $python_version${ort_version:+, onnxruntime $ort_version} (${SECONDS} s in)"
  python=$(bash scripts/compat_env.sh "$torch_version" "$python_version" $ort_version | tail -n 1)
  (cd examples && "../$python" quickstart.py >/dev/null)
  # (with an ONNX Runtime release pinned, the kernels' suites too; each file once)
  suites=$(printf '%s\n' $compat_suites ${ort_version:+$kernel_suites} ${COMPAT_MODELS:+$model_suites} | awk '!seen[$0]++')
  "$python" -m pytest -q -p no:cacheprovider "${parallel[@]}" $suites "$@"
done
echo "== all passed in ${SECONDS} s"
