"""The declared minimum versions are the ones CI tests: scripts/setup.sh pins the torch floor,
scripts/test.sh runs the library suite on the onnxruntime floor, and CI's Python is the Python
floor. (RegisterCustomOps's refusal of older ORT is tested in tests/cpp/test_guarded.cc.)"""

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[2]


def minor(version: str) -> tuple:
    return tuple(int(p) for p in version.split(".")[:2])


def test_declared_minimums_are_the_versions_ci_tests():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    floors = dict(d.split(">=") for d in project["dependencies"] + extras["cpu"])
    torch_pin = re.search(r"TORCH_VERSION:-([0-9.]+)", (ROOT / "scripts" / "setup.sh").read_text()).group(1)
    ort_versions = re.search(r"ORT_COMPAT_VERSIONS-([0-9. ]+)\}", (ROOT / "scripts" / "test.sh").read_text()).group(1)
    assert minor(floors["torch"]) == minor(torch_pin)
    assert minor(floors["onnxruntime"]) == min(minor(v) for v in ort_versions.split())
    assert minor(project["requires-python"].removeprefix(">=")) == sys.version_info[:2]
