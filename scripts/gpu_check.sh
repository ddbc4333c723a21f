#!/usr/bin/env bash
# The CUDA checks on a GPU machine, in one command and offline: installs onnxruntime-gpu from a
# wheel, builds ortbridge, runs tests/python/test_cuda.py, the CUDA benchmarks and examples/distributed.py on NCCL.
#
#   bash scripts/gpu_check.sh WHEEL_DIR
#
# WHEEL_DIR holds the onnxruntime-gpu wheel (1.27 or newer for torch's CUDA 13 builds), whole or
# split into onnxruntime_gpu-*.whl.part-aa, -ab, ... (joined here with cat, in name order;
# scripts/gpu_wheels.sh makes them on a machine with a registry), and
# optionally wheels of what the machine may lack, installed with
# `pip install --no-index --find-links WHEEL_DIR`: the build dependencies (scikit-build-core,
# pybind11, pathspec, packaging, ninja, cmake) and the test ones (pytest, onnx, onnxscript, onnx-ir).
#
# The machine: an NVIDIA GPU and driver, a CUDA 13 build of torch 2.9 or newer (whichever it has:
# the GPU machine's is 2.11 on Python 3.12), nvcc (torch's cpp_extension builds the example's
# kernels with it), Python 3.11+, a C++ compiler; no package registry needed. ortbridge's _C is
# built here, for this Python.
# The tree must bring ONNX Runtime's C headers, third_party/onnxruntime/include: git ignores
# third_party/, so copy that folder along with the checkout (e.g. carry it to the device machine);
# scripts/fetch_ort_headers.sh fills it on a machine with a network. The build is told where
# they are (-DORT_INCLUDE_DIR).
#
# Everything goes to a log folder, $OUT if set, else build/gpu_check: gpu_check.log (all of it) and
# one log per step. Exit status: non-zero when a step fails, a test fails, or a benchmark fails.
# About 3-5 minutes on an H200 host (the wheel's unpacking, ortbridge's build and the example's
# CUDA extension build take most of it; the extension is cached in build/torch_extensions).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if [ $# -ne 1 ] || [ ! -d "$1" ]; then
  echo "usage: bash scripts/gpu_check.sh WHEEL_DIR   (a folder with the onnxruntime-gpu wheel or its parts)" >&2
  exit 2
fi
WHEEL_DIR=$(cd "$1" && pwd)
LOG_DIR=${OUT:-build/gpu_check}
mkdir -p "$LOG_DIR"
LOG_DIR=$(cd "$LOG_DIR" && pwd)
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_ROOT_USER_ACTION=ignore

step() { echo; echo "== $* ($(date +%T), ${SECONDS}s)"; }
fail() { echo "gpu_check: ERROR: $*" >&2; exit 1; }

# pip install of the given distributions from WHEEL_DIR only.
offline_install() { "$PYTHON" -m pip install -q --no-index --find-links "$WHEEL_DIR" "$@"; }

# Each "module=distribution" importable, else installed from WHEEL_DIR (or a clear error).
need_modules() {
  local missing=() pair
  for pair in "$@"; do
    "$PYTHON" -c "import ${pair%%=*}" 2>/dev/null || missing+=("${pair#*=}")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "installing from WHEEL_DIR: ${missing[*]}"
  offline_install "${missing[@]}" || fail "missing Python packages: ${missing[*]} (put their wheels in WHEEL_DIR)"
}

main() {
  set -euo pipefail
  step "machine"
  command -v nvidia-smi >/dev/null || fail "nvidia-smi not found: no NVIDIA driver on this machine"
  nvidia-smi | tee "$LOG_DIR/nvidia-smi.txt"
  [ -d /usr/local/cuda/bin ] && export PATH="$PATH:/usr/local/cuda/bin"
  command -v nvcc >/dev/null || fail "nvcc not found (the example's CUDA extension needs it; set PATH or CUDA_HOME)"
  nvcc --version | tail -n 2
  "$PYTHON" - <<'EOF' || fail "torch sees no GPU: a CUDA build of torch and a working driver are needed"
import platform, sys
import torch
print(f"python {platform.python_version()}  torch {torch.__version__}  CUDA {torch.version.cuda}  "
      f"cuDNN {torch.backends.cudnn.version()}")
if not torch.cuda.is_available():
    sys.exit(1)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name} sm_{p.major}{p.minor} {p.total_memory / 2**30:.0f} GiB")
EOF

  step "onnxruntime-gpu wheel"
  shopt -s nullglob
  local whole=("$WHEEL_DIR"/onnxruntime_gpu-*.whl) parts=("$WHEEL_DIR"/onnxruntime_gpu-*.whl.part-*) wheel
  shopt -u nullglob
  if [ ${#whole[@]} -gt 0 ]; then
    wheel=${whole[${#whole[@]}-1]}
  elif [ ${#parts[@]} -gt 0 ]; then
    local name
    name=$(basename "${parts[0]%.part-*}")
    mkdir -p build/gpu_wheels
    wheel=build/gpu_wheels/$name
    echo "joining $(ls "$WHEEL_DIR/$name".part-* | wc -l) parts of $name"
    cat "$WHEEL_DIR/$name".part-* > "$wheel"  # (the glob is in name order: aa, ab, ...)
  else
    fail "no onnxruntime_gpu-*.whl or onnxruntime_gpu-*.whl.part-* in $WHEEL_DIR"
  fi
  "$PYTHON" -c "import sys, zipfile; sys.exit(not zipfile.is_zipfile(sys.argv[1]))" "$wheel" ||
    fail "$wheel is not a zip file (parts missing or out of order?)"
  ls -l "$wheel"
  # Into a folder of its own, first on PYTHONPATH: the CPU package `onnxruntime` installed on the
  # machine stays as it is (both install the module `onnxruntime`), and is shadowed here.
  rm -rf build/ort-gpu
  "$PYTHON" -m pip install -q --no-deps --no-index --target build/ort-gpu "$wheel"
  export PYTHONPATH="$PWD/build/ort-gpu${PYTHONPATH:+:$PYTHONPATH}"
  # torch's CUDA libraries (the nvidia-* wheels) on the loader's path too, for ORT's CUDA provider
  # library should it load one torch has not loaded (onnxruntime.preload_dlls looks there as well).
  local nvidia_libs
  nvidia_libs=$("$PYTHON" - <<'EOF'
import glob, importlib.util, os
spec = importlib.util.find_spec("nvidia")
roots = list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []
print(":".join(d for root in roots for d in sorted(glob.glob(os.path.join(root, "*", "lib"))) if os.path.isdir(d)))
EOF
)
  [ -n "$nvidia_libs" ] && export LD_LIBRARY_PATH="$nvidia_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  need_modules numpy=numpy onnx=onnx
  local ort_failed="onnxruntime-gpu does not run on this machine (see $LOG_DIR/onnxruntime_gpu.txt)"
  "$PYTHON" - <<'EOF' 2>&1 | tee "$LOG_DIR/onnxruntime_gpu.txt" || fail "$ort_failed"
import os, sys
import torch  # first, as ortbridge's users do: its CUDA libraries are then loaded for ORT to find
import onnxruntime as ort
from onnx import TensorProto, helper

print(f"onnxruntime {ort.__version__} ({ort.get_device()}) from {os.path.dirname(ort.__file__)}")
if "ort-gpu" not in ort.__file__:
    sys.exit("ERROR: python imports another onnxruntime than build/ort-gpu's")
if hasattr(ort, "preload_dlls"):
    ort.preload_dlls()  # CUDA, cuBLAS, cuDNN from torch's nvidia-* wheels where torch has not loaded them
print("available providers:", ort.get_available_providers())
if "CUDAExecutionProvider" not in ort.get_available_providers():
    sys.exit("ERROR: this onnxruntime has no CUDAExecutionProvider")
graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "check",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
options = ort.SessionOptions()
options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
try:
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CUDAExecutionProvider"])
except Exception as e:
    sys.exit(f"ERROR: no session on the CUDA execution provider: {e}")
print("a Relu session runs on:", session.get_providers())
import numpy as np
(y,) = session.run(None, {"x": np.array([-1, 0, 1, 2], np.float32)})
assert y.tolist() == [0, 0, 1, 2], y
# Where the CUDA libraries came from (torch's nvidia-* wheels, or the system's).
fields = (line.split() for line in open("/proc/self/maps"))
libs = sorted({f[5] for f in fields if len(f) > 5 and ".so" in f[5]})
wanted = ("libcudart", "libcublas", "libcudnn.so", "libcufft", "libcurand", "onnxruntime_providers")
for path in libs:
    if any(w in os.path.basename(path) for w in wanted):
        print("  loaded", path)
if session.get_providers()[0] != "CUDAExecutionProvider":
    sys.exit("ERROR: the session did not start on the CUDA execution provider")
EOF

  step "build ortbridge (editable, no build isolation)"
  # ORT's C headers: carried with the tree (git ignores third_party/), see the top of this file.
  local headers=$PWD/third_party/onnxruntime/include
  [ -f "$headers/onnxruntime_c_api.h" ] ||
    fail "ONNX Runtime's C headers are missing: copy third_party/onnxruntime/include along with the tree (scripts/fetch_ort_headers.sh fills it where there is a network)"
  need_modules scikit_build_core=scikit-build-core pybind11=pybind11 pathspec=pathspec packaging=packaging
  command -v ninja >/dev/null || need_modules ninja=ninja
  command -v cmake >/dev/null || need_modules cmake=cmake
  export ORT_INCLUDE_DIR="$headers" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
  "$PYTHON" -m pip install --no-deps --no-build-isolation --no-index -e . \
    --config-settings=cmake.define.ORT_INCLUDE_DIR="$headers" > "$LOG_DIR/build.log" 2>&1 ||
    { tail -n 60 "$LOG_DIR/build.log"; fail "the build failed (see $LOG_DIR/build.log)"; }
  tail -n 2 "$LOG_DIR/build.log"
  need_modules pytest=pytest onnxscript=onnxscript onnx_ir=onnx-ir
  "$PYTHON" -c "import torch, ortbridge, onnxruntime; print('ortbridge', ortbridge.library_path()); \
print('onnxruntime', onnxruntime.__version__, onnxruntime.__file__)"

  step "tests/python/test_cuda.py"
  export TORCH_EXTENSIONS_DIR="$PWD/build/torch_extensions" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
  local tests_rc=0 overhead_rc=0 zero_copy_rc=0
  timeout 300 "$PYTHON" -m pytest -q -p no:cacheprovider tests/python/test_cuda.py -rs --durations=10 2>&1 |
    tee "$LOG_DIR/test_cuda.log" || tests_rc=${PIPESTATUS[0]}

  step "benchmarks/overhead.py --device cuda"
  timeout 90 "$PYTHON" benchmarks/overhead.py --device cuda --repeats 5 --target 0.1 2>&1 |
    tee "$LOG_DIR/overhead_cuda.log" || overhead_rc=${PIPESTATUS[0]}

  step "benchmarks/zero_copy.py --device cuda"
  timeout 90 "$PYTHON" benchmarks/zero_copy.py --device cuda --repeats 5 --target 0.05 --large-repeats 5 2>&1 |
    tee "$LOG_DIR/zero_copy_cuda.log" || zero_copy_rc=${PIPESTATUS[0]}

  # NCCL and FSDP2's CUDA paths: one process (world size 1 still runs NCCL's collectives and
  # fully_shard's all-gather and reduce-scatter), the example's losses with OrtModule blocks against
  # eager blocks, step by step.
  step "examples/distributed.py under torchrun on NCCL: DDP and FSDP2, OrtModule against eager"
  local distributed_rc=0 engine variant
  for engine in ddp fsdp; do
    for variant in eager ortbridge; do
      timeout 180 "$PYTHON" -m torch.distributed.run --nproc-per-node 1 --standalone examples/distributed.py \
        $([ "$engine" = fsdp ] && echo --fsdp) $([ "$variant" = eager ] && echo --eager) \
        > "$LOG_DIR/distributed_${engine}_${variant}.log" 2>&1 || distributed_rc=1
      grep -E "^(nccl|gloo) on|^step" "$LOG_DIR/distributed_${engine}_${variant}.log" || distributed_rc=1
    done
    "$PYTHON" - "$LOG_DIR/distributed_${engine}_eager.log" "$LOG_DIR/distributed_${engine}_ortbridge.log" <<'PY' ||
import re, sys
eager, ours = ([float(x) for x in re.findall(r"step \d+: loss (\S+)", open(f).read())] for f in sys.argv[1:])
assert eager and len(eager) == len(ours), (eager, ours)
assert all(abs(a - b) <= 1e-3 * max(1.0, abs(a)) for a, b in zip(eager, ours)), (eager, ours)
print("losses equal to eager's:", ours)
PY
      distributed_rc=1
  done

  step "summary"
  echo "test_cuda.py: exit $tests_rc   overhead.py: exit $overhead_rc   zero_copy.py: exit $zero_copy_rc" \
    "  distributed: exit $distributed_rc   (logs: $LOG_DIR)"
  [ "$tests_rc" -eq 0 ] && [ "$overhead_rc" -eq 0 ] && [ "$zero_copy_rc" -eq 0 ] && [ "$distributed_rc" -eq 0 ]
}

set +e
main 2>&1 | tee "$LOG_DIR/gpu_check.log"
status=${PIPESTATUS[0]}
exit "$status"
