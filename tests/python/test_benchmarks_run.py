"""The benchmarks still run (each checks its results against eager torch before timing); their
timings are not asserted here."""

import os
import shutil
import subprocess
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


@pytest.mark.parametrize(
    "script, args, marker",
    [
        ("overhead.py", ["--quick"], "an inference op's parts"),
        ("zero_copy.py", ["--quick", "--max-size", "1M"], "/tc"),
        ("train_step.py", ["--quick", "--in-pytorch", "convolution"], "+in PyTorch ms"),
        ("onnx_train_step.py", ["--quick"], "ratio"),
        ("capture_time.py", ["--quick"], "largest phase"),
        ("apply_cost.py", ["--quick"], "Node owner"),
        ("dropout_step.py", ["--quick"], "torch RNG ms"),
        ("embedding_step.py", ["--quick"], "scatter_elements"),
        ("guard_cost.py", ["--quick"], "check/step"),
        ("varlen_train.py", ["--quick"], "steady ms"),
        ("distributed_step.py", ["--quick"], "FSDP   per block"),
        ("step_memory.py", ["--quick", "--models", "Block", "--variants", "eager,OrtModule"], "xpeak"),
        # (--by-library: its breakdown is checked to sum to callgrind's totals)
        pytest.param(
            "instructions.py",
            ["--quick", "--by-library"],
            "C/C++ runtime",
            marks=pytest.mark.skipif(
                shutil.which("valgrind") is None, reason="needs valgrind (callgrind), which this machine lacks"
            ),
        ),
        # (a Function that saves its input: OrtModule lends it the buffer, checked against eager)
        (
            "overhead.py",
            ["--quick", "--modes", "ortmodule", "--function", "saves", "--no-compile", "--ortmodule-ks", "1,4"],
            "calling SavesInput.apply",
        ),
    ],
)
def test_benchmark_runs(script, args, marker):
    proc = subprocess.run(
        [sys.executable, os.path.join(BENCHMARKS, script), *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert marker in proc.stdout
