#!/usr/bin/env bash
# A long run of the graph fuzzer (tests/fuzz): malformed PythonOp/PythonOpGrad models through
# ortbridge.InferenceSession, in child processes.
#   bash scripts/fuzz.sh [CASES] [SEED]      (default 100000 cases and a random seed, printed)
# Results go to build/fuzz/seed-SEED/ (summary.json, results.jsonl, each finding as
# <class>-SEED-INDEX.onnx + .json); replay one case with
#   python3 -m tests.fuzz.campaign --seed SEED --start INDEX --cases 1 --out build/fuzz/replay
# The environment is passed on, so `scripts/with_sanitizers.sh bash scripts/fuzz.sh` runs the
# children under AddressSanitizer. FUZZ_JOBS (default 1, at most the cores to spare),
# FUZZ_TIMEOUT (seconds per case, default 20) and FUZZ_PARSER_RUNS (for scripts/fuzz_parser.sh,
# run afterwards when present; FUZZ_PARSER=0 skips it) tune it. Exits non-zero if either fuzzer
# found something.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
cases=${1:-100000}
seed=${2:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}
out=build/fuzz/seed-$seed
echo "fuzz.sh: seed $seed, $cases cases, results in $out" >&2

status=0
"$PYTHON" -m tests.fuzz.campaign --seed "$seed" --cases "$cases" --batch 1000 --jobs "${FUZZ_JOBS:-1}" \
  --timeout "${FUZZ_TIMEOUT:-20}" --out "$out" || status=$?

if [ -f scripts/fuzz_parser.sh ] && [ "${FUZZ_PARSER:-1}" != 0 ]; then
  echo "fuzz.sh: the attribute parser, scripts/fuzz_parser.sh" >&2
  bash scripts/fuzz_parser.sh ${FUZZ_PARSER_RUNS:+"$FUZZ_PARSER_RUNS"} || status=1
fi
echo "fuzz.sh: seed $seed done (exit $status)" >&2
exit $status
