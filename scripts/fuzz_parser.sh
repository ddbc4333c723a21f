#!/usr/bin/env bash
# Fuzzes the attribute parser (csrc/attributes.cc) with libFuzzer + ASan + UBSan:
#   scripts/fuzz_parser.sh [RUNS]      (default 10000000 executions; JOBS=2 for two processes)
# The corpus persists in build/fuzz-parser/corpus (seeded by the fuzzer itself); a finding is
# written to build/fuzz-parser/findings/ and fails the script. Replay one with
#   build/fuzz-parser/attributes_fuzzer build/fuzz-parser/findings/crash-...
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-10000000}
jobs=${JOBS:-1}
PYTHON=${PYTHON:-python3}

# clang and its libFuzzer/sanitizer runtimes, from Debian's packages.
need=()
command -v clang++-14 >/dev/null || need+=(clang-14)
dpkg -s libclang-rt-14-dev >/dev/null 2>&1 || need+=(libclang-rt-14-dev)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi

build=build/fuzz-parser
if [ ! -f "$build/CMakeCache.txt" ]; then
  CC=clang-14 CXX=clang++-14 cmake -S . -B "$build" -DORTBRIDGE_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DPython_EXECUTABLE="$(command -v "$PYTHON")" -Dpybind11_DIR="$($PYTHON -m pybind11 --cmakedir)" >/dev/null
fi
cmake --build "$build" --target attributes_fuzzer --parallel 2

mkdir -p "$build/corpus" "$build/findings"
[ -n "$(ls -A "$build/corpus")" ] || "$build/attributes_fuzzer" --write-seeds="$build/corpus"

# From inside the build folder: libFuzzer writes its job logs (fuzz-N.log) to the working folder.
cd "$build"
touch .fuzz-start
start=$SECONDS
args=(-max_len=4096 -print_final_stats=1 -artifact_prefix=findings/)
rc=0
if [ "$jobs" -gt 1 ]; then
  rm -f fuzz-*.log
  ./attributes_fuzzer "${args[@]}" -runs=$((runs / jobs)) -jobs="$jobs" -workers="$jobs" corpus || rc=$?
  grep -h -E '^(Done|stat::number_of_executed_units|stat::average_exec_per_sec)|ERROR|attributes_fuzzer:' fuzz-*.log || true
else
  ./attributes_fuzzer "${args[@]}" -runs="$runs" corpus || rc=$?
fi
echo "fuzz_parser: $runs runs requested, $((SECONDS - start)) s; corpus of $(ls corpus | wc -l) inputs"
found=$(find findings -type f -newer .fuzz-start)
if [ -n "$found" ]; then
  echo "fuzz_parser: findings (replay: $build/attributes_fuzzer FILE):"
  echo "$found" | sed "s|^|  $build/|"
  rc=1
fi
exit $rc
