"""Every private API of torch and onnxruntime that the package uses goes through one module each
(ortbridge/_torch_private.py, ortbridge/_ort_private.py), where the branches per release are.
Private: a module path with a component that starts with an underscore (torch._C,
torch.utils._pytree, torch.onnx._internal, torch.autograd.function._is_setup_context_defined,
onnxruntime.capi._pybind_state), whether imported, reached as an attribute, or named in a string;
torch.ops.* (operators, whose names may start with one) is public."""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[2] / "python" / "ortbridge"
ROOTS = ("torch", "onnxruntime")
HOMES = {"torch": "_torch_private.py", "onnxruntime": "_ort_private.py"}
_IN_STRING = re.compile(r"\b(?:torch|onnxruntime)(?:\.\w+)+")


def _private(path: str) -> bool:
    parts = path.split(".")
    if parts[0] not in ROOTS or parts[:2] == ["torch", "ops"]:
        return False
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts[1:])


def _dotted(node: ast.AST, aliases: dict) -> str | None:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in aliases:
        return ".".join([aliases[node.id], *reversed(names)])
    return None


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, dotted path) of each private torch or onnxruntime API the source uses."""
    tree = ast.parse(source)
    aliases, uses = {}, []
    for node in ast.walk(tree):  # (imports first: a name may be used above its import in the text)
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ROOTS:
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                    uses.append((node.lineno, a.name))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] in ROOTS:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                uses.append((node.lineno, f"{node.module}.{a.name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            path = _dotted(node, aliases)
            if path:
                uses.append((node.lineno, path))
        elif isinstance(node, ast.Name) and node.id in aliases:
            uses.append((node.lineno, aliases[node.id]))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            base = _dotted(node.args[0], aliases) or (node.args[0].id if isinstance(node.args[0], ast.Name)
                                                       and node.args[0].id in aliases else None)
            if base:
                uses.append((node.lineno, f"{base}.{node.args[1].value}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            uses.extend((node.lineno, m) for m in _IN_STRING.findall(node.value))
    return sorted({u for u in uses if _private(u[1])})


def test_only_the_private_modules_use_private_apis():
    outside = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent == PACKAGE and path.name in HOMES.values():
            continue
        outside += [f"{path.relative_to(PACKAGE)}:{line}: {name}" for line, name in private_uses(path.read_text())]
    assert not outside, "private APIs used outside ortbridge/_torch_private.py and _ort_private.py:\n" + "\n".join(outside)


@pytest.mark.parametrize("root", ROOTS)
def test_each_private_module_uses_private_apis_of_its_library_only(root):
    source = (PACKAGE / HOMES[root]).read_text()
    names = [name for _, name in private_uses(source)]
    assert names, f"{HOMES[root]} uses no private API of {root}: then it should not exist"
    assert all(name.split(".")[0] == root for name in names), names


@pytest.mark.parametrize("source, expected", [
    ("import torch\nx = torch._C._autograd.f", ["torch._C", "torch._C._autograd", "torch._C._autograd.f"]),
    ("import torch.utils._pytree as pytree\npytree.tree_map", ["torch.utils._pytree", "torch.utils._pytree.tree_map"]),
    ("from torch._export.utils import _compiling_state_context as c\nc()",
     ["torch._export.utils._compiling_state_context"]),
    ("from torch.nn.modules.module import _IncompatibleKeys", ["torch.nn.modules.module._IncompatibleKeys"]),
    ("import torch\ngetattr(torch, '_C')", ["torch._C"]),
    ("import logging\nlogging.getLogger('torch.onnx._internal.exporter')", ["torch.onnx._internal.exporter"]),
    ("import onnxruntime as ort\nort.capi._pybind_state", ["onnxruntime.capi._pybind_state"]),
    ("import torch\ntorch.ops.aten._unsafe_view.default\ntorch.__version__\ntorch.nn.Module", []),
])
def test_the_check_finds_each_way_of_reaching_a_private_api(source, expected):
    assert sorted({name for _, name in private_uses(source)}) == sorted(expected)
