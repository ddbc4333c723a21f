"""OrtModule under DistributedDataParallel and FSDP2, 2 processes with gloo, each case against the
eager model under the same engine (distributed_train.py); the torchrun example; Hugging Face's
Trainer with a wrapped model."""

import pathlib
import re
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import distributed_train  # noqa: E402


@pytest.fixture(scope="module")
def results() -> dict:
    """{case: {rank: what the case printed}}: every case in one pair of processes."""
    run = subprocess.run(
        [sys.executable, "distributed_train.py"], cwd=HERE, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr[-4000:]
    found = {}
    for case, rank, line in re.findall(r"^case (\S+) rank (\d): (.*)$", run.stdout, re.M):
        found.setdefault(case, {})[int(rank)] = line
    return found


@pytest.mark.parametrize("case", list(distributed_train.CASES))
def test_trains_as_eager_under_the_same_engine(results, case):
    assert sorted(results.get(case, {})) == [0, 1], results
    for rank, line in results[case].items():
        difference = re.fullmatch(r"max difference (\S+)", line)
        assert difference, f"rank {rank}: {line}"
        # (bfloat16 parameters under the mixed-precision policy: eager's own rounding)
        assert float(difference.group(1)) < (1e-2 if "mixed" in case else 1e-5), f"rank {rank}: {line}"


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_the_example_runs_under_torchrun(engine):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--standalone",
            "examples/distributed.py",
            *(["--fsdp"] if engine == "fsdp" else []),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"step \d: loss (\S+)", run.stdout)]
    assert len(losses) == 5 and losses[-1] < losses[0], run.stdout
