"""The benchmarks still run (each checks its results against eager torch before timing); their
timings are not asserted here."""

import os
import subprocess
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


@pytest.mark.parametrize("script, args", [("overhead.py", ["--quick"]),
                                          ("zero_copy.py", ["--quick", "--max-size", "1M"]),
                                          ("train_step.py", ["--quick"]),
                                          ("onnx_train_step.py", ["--quick"])])
def test_benchmark_runs(script, args):
    proc = subprocess.run([sys.executable, os.path.join(BENCHMARKS, script), *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ratio" in proc.stdout or "/tc" in proc.stdout
