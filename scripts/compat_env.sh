#!/usr/bin/env bash
# A virtual environment for the compatibility suite: another torch release, on another Python.
#
#   bash scripts/compat_env.sh TORCH PYTHON [ONNXRUNTIME]     e.g. 2.15.0 3.13, or 2.9.1 3.12 1.19.2
#
# Made once in build/compat/torch-TORCH-pyPYTHON[-ortONNXRUNTIME] (ignored by git; 5-6 GB, torch's registry wheels are
# CUDA builds with their NVIDIA libraries, which run on the CPU); pip's cache keeps the downloads for
# the next fresh clone. Each call (re)builds ortbridge into it, editable, so that it runs the
# checkout's code. Prints the environment's python on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 2 ] || [ $# -eq 3 ] ||
  { echo "usage: bash scripts/compat_env.sh TORCH_VERSION PYTHON_VERSION [ONNXRUNTIME_VERSION]" >&2; exit 2; }
torch_version=$1 python_version=$2 ort_version=${3-}
env=build/compat/torch-$torch_version-py$python_version${ort_version:+-ort$ort_version}
# (onnxruntime held at its pin too, where one is given; else the newest)
pins=("torch==$torch_version" ${ort_version:+"onnxruntime==$ort_version"})
# The machine's pip configuration may cap torch at the releases on its disk: an empty constraints
# file lifts that cap here (every install below is pinned, or satisfied by what is installed).
export PIP_CONSTRAINT=/dev/null

# The interpreter: pythonX.Y on the PATH, else pyenv's.
find_python() {
  local candidate
  if candidate=$(command -v "python$python_version") && "$candidate" -c '' 2>/dev/null; then
    echo "$candidate"; return
  fi
  if command -v pyenv >/dev/null; then
    local version
    version=$(pyenv versions --bare | grep -E "^$python_version(\.[0-9]+)?$" | tail -n 1) || true
    [ -n "$version" ] && { echo "$(pyenv prefix "$version")/bin/python$python_version"; return; }
  fi
  echo "Python $python_version not found (neither python$python_version on the PATH nor a pyenv version)" >&2
  return 1
}

if [ ! -x "$env/bin/python" ] || [ ! -f "$env/.complete" ]; then
  rm -rf "$env"
  "$(find_python)" -m venv "$env"
  pip=("$env/bin/python" -m pip install -qq)
  # torch first, pinned, with its own torchvision (the test-only timm imports it; beside a CUDA
  # build of torch the registry's build loads).
  "${pip[@]}" "torch==$torch_version" torchvision
  "${pip[@]}" scikit-build-core pybind11 ninja
  "${pip[@]}" --no-deps "timm==1.0.31"  # (as scripts/setup.sh installs it)
  touch "$env/.complete"
fi
# ortbridge with its dependencies, torch (and onnxruntime) held at their pins; the build is incremental.
"$env/bin/python" -m pip install -qq --no-build-isolation -e ".[cpu,test]" "${pins[@]}"
"$env/bin/python" -c "import torch; assert torch.__version__.split('+')[0] == '$torch_version', torch.__version__"
[ -z "$ort_version" ] ||
  "$env/bin/python" -c "import onnxruntime as o; assert o.__version__ == '$ort_version', o.__version__"
echo "$env/bin/python"
