"""The declared supported ranges are the ones CI tests: the torch floor is the oldest release the
compatibility suite runs (scripts/test.sh), the Python floor the oldest Python CI runs, the
onnxruntime floor the oldest release the kernels' suites run on, and the docs' test matrix (docs/building.md)
names exactly the cells CI runs. (RegisterCustomOps's refusal of older ORT is tested in
tests/cpp/test_guarded.cc; a torch older than the floor is refused at import: test_capture.py.)"""

import re
import tomllib
from pathlib import Path

from ortbridge._compat import torch_private

ROOT = Path(__file__).parents[2]


def minor(version: str) -> tuple:
    return tuple(int(p) for p in version.split(".")[:2])


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _ci_cells() -> list[tuple[str, str, str | None]]:
    """(torch, Python, onnxruntime or None: the newest) of each CI run: setup.sh's pin on CI's
    Python, then test.sh's compatibility cells."""
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    setup_sh = (ROOT / "scripts" / "setup.sh").read_text()
    main = (re.search(r"TORCH_VERSION:-([0-9.]+)", setup_sh).group(1), "3.11", None)
    cells = re.search(r"TORCH_COMPAT-([0-9.: ]+)\}", test_sh).group(1).split()
    return [main, *((*c.split(":")[:2], (c.split(":")[2:] or [None])[0]) for c in cells)]


def test_declared_minimums_are_the_versions_ci_tests():
    project = _project()
    extras = project["optional-dependencies"]
    floors = dict(d.split(">=") for d in project["dependencies"] + extras["cpu"])
    cells = _ci_cells()
    assert minor(floors["torch"]) == min(minor(t) for t, _, _ in cells)
    assert minor(floors["torch"]) == torch_private.OLDEST
    assert minor(floors["onnxruntime"]) == min(minor(v) for _, _, v in cells if v)
    assert minor(project["requires-python"].removeprefix(">=")) == min(minor(p) for _, p, _ in cells)


def test_ci_runs_the_newest_python_the_package_declares():
    classifiers = [c for c in _project().get("classifiers", []) if c.startswith("Programming Language :: Python :: 3.")]
    declared = sorted(minor(c.rsplit(" ", 1)[1]) for c in classifiers)
    assert declared, "pyproject.toml declares no Python versions (classifiers)"
    assert declared == sorted({minor(p) for _, p, _ in _ci_cells()})


def test_readme_matrix_is_what_ci_runs():
    readme = (ROOT / "docs" / "building.md").read_text()
    table = readme[readme.index("<!-- test matrix -->") : readme.index("<!-- /test matrix -->")]
    rows = {
        (m.group(1), m.group(2), m.group(3))
        for m in re.finditer(r"^\| (2\.\d+\.\d+) \| 3\.(\d+) \| (\d+\.\d+\.\d+|newest)\b", table, re.M)
    }
    assert rows == {(t, p.split(".")[1], v or "newest") for t, p, v in _ci_cells()}
