"""The package's type information: py.typed, and _C.pyi naming exactly what the compiled
extension has (its functions, classes and their attributes)."""

from __future__ import annotations

import ast
import pathlib

import ortbridge
from ortbridge import _C

PACKAGE = pathlib.Path(ortbridge.__file__).parent


def _public(names) -> set:
    return {n for n in names if not (n.startswith("__") and n.endswith("__")) and n != "_pybind11_conduit_v1_"}


def test_the_package_says_it_is_typed():
    assert (PACKAGE / "py.typed").is_file()


def test_the_stub_names_what_the_extension_has():
    stub = ast.parse((PACKAGE / "_C.pyi").read_text())
    declared = {n.name: n for n in stub.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
    assert set(declared) == _public(dir(_C)), "_C.pyi and the extension name different things"
    for name, node in declared.items():
        if isinstance(node, ast.ClassDef):
            members = {n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
            assert members == _public(vars(getattr(_C, name))), f"_C.pyi's {name} and the extension's differ"
