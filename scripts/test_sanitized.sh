#!/usr/bin/env bash
# The C++ tests and the library's Python tests against the ASan + UBSan build (build/sanitized,
# scripts/with_sanitizers.sh); a sanitizer finding fails the run. Extra arguments go to pytest.
# The model suites (test_real_models.py, test_layers.py: third-party models, no kernel code of
# their own) are left out, and so is test_fuzz.py, whose children set up their own environment.
# Expects scripts/setup.sh to have run.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHON=${PYTHON:-python3}
build=build/sanitized
suppressions=$PWD/scripts/ubsan_suppressions.txt
start=$SECONDS

scripts/with_sanitizers.sh true  # configures, builds the module and checks that it is the one imported
cmake --build "$build" --parallel 2

# The plain C++ tests link the runtimes themselves; leak checking stays on for them.
(cd "$build" && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:abort_on_error=1:suppressions=$suppressions \
  ctest --output-on-failure -LE python)
# The tests that embed Python load torch and the module, as python does: through the wrapper.
(cd "$build" && ../../scripts/with_sanitizers.sh ctest --output-on-failure -L python)

scripts/with_sanitizers.sh "$PYTHON" -m pytest -q -p no:cacheprovider tests/python \
  --ignore=tests/python/test_real_models.py --ignore=tests/python/test_layers.py \
  --ignore=tests/python/test_fuzz.py "$@"

echo "test_sanitized: passed in $((SECONDS - start)) s"
