#!/usr/bin/env bash
# Runs CMD with the ASan + UBSan build of ortbridge._C (build/sanitized, gcc) imported in place
# of the installed one, e.g.
#   scripts/with_sanitizers.sh python3 -m pytest -q tests/python/test_inference.py
# A sanitizer finding aborts the process, so CMD fails (under pytest, pass --capture=sys: the
# report goes to file descriptor 2, which pytest's default capture swallows as the process aborts).
# Builds (or brings up to date) the module first; expects scripts/setup.sh to have run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build/sanitized
PYTHON=${PYTHON:-python3}
[ $# -gt 0 ] || { echo "usage: $0 CMD [ARGS...]" >&2; exit 2; }

# The interpreter itself, not a pyenv shim: its folder goes first on PATH, so that CMD's python3
# (and pytest, pip, ...) start it directly instead of through shell scripts under the runtime.
python_exe=$("$PYTHON" -c 'import sys; print(sys.executable)')
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" -DORTBRIDGE_SANITIZE=ON -DORTBRIDGE_BUILD_TESTS=ON \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPython_EXECUTABLE="$python_exe" \
    -Dpybind11_DIR="$("$python_exe" -m pybind11 --cmakedir)" >/dev/null
fi
if ! log=$(cmake --build "$build" --target _C --parallel 2 2>&1); then
  echo "$log" >&2
  exit 1
fi
cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$build/CMakeCache.txt")
if ! "$cxx" --version | grep -q 'Free Software Foundation'; then
  echo "$0: build/sanitized was configured with $cxx; this script preloads gcc's runtimes" >&2
  exit 1
fi
module=$build/_C$("$python_exe" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
[ -f "$module" ] || { echo "$0: $module was not built" >&2; exit 1; }
mkdir -p "$build/pyshim"
cmp -s "$root/scripts/sanitized_sitecustomize.py" "$build/pyshim/sitecustomize.py" ||
  cp "$root/scripts/sanitized_sitecustomize.py" "$build/pyshim/sitecustomize.py"

export ORTBRIDGE_SANITIZED_C=$module
export PYTHONPATH=$build/pyshim${PYTHONPATH:+:$PYTHONPATH}
export PATH=$(dirname "$python_exe"):$PATH
# python itself is not instrumented: the runtimes must be loaded before anything else.
export LD_PRELOAD=$("$cxx" -print-file-name=libasan.so):$("$cxx" -print-file-name=libubsan.so)${LD_PRELOAD:+:$LD_PRELOAD}
# CPython and torch keep memory until exit (no leak reports); Python objects through malloc, so
# ASan sees their bounds; a report aborts (non-zero exit), not only logs. The caller's options last.
export PYTHONMALLOC=malloc
export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1:print_summary=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:abort_on_error=1:suppressions=$root/scripts/ubsan_suppressions.txt${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}

# The finder order is the editable install's business: check that the sanitized module is the
# one imported, every time (cheap next to any run worth sanitizing).
loaded=$("$python_exe" -c 'import ortbridge._C as c; print(c.__file__)')
if [ "$loaded" != "$module" ]; then
  echo "$0: ortbridge._C was imported from $loaded, not from $module" >&2
  exit 1
fi
echo "with_sanitizers: ortbridge._C from $module" >&2
exec "$@"
