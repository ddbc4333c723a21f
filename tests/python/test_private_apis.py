"""Every private API of torch and onnxruntime that the package uses goes through one module each
(ortbridge/_compat/torch_private.py, ortbridge/_compat/ort_private.py), where the branches per release are.
Two checks of every other module's source:
- a module path with a component that starts with an underscore (torch._C, torch.utils._pytree,
  torch.onnx._internal, torch.autograd.function._is_setup_context_defined,
  onnxruntime.capi._pybind_state), imported, read as an attribute of an imported name, named in
  getattr or hasattr, or in a string; torch.ops.* (operators, whose names may start with one) is
  public;
- an attribute with a leading underscore read off an object (session._sess, ctx._materialize_...)
  that the package does not define itself (a function, class, name, argument, attribute of
  self or cls, or a function of _C), but for OBJECT_ATTRIBUTES_ALLOWED and operators (aten.*).
What it cannot see: a private name reached through a variable holding a module (m = torch;
m._C), or through vars() and __dict__."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PACKAGE = ROOT / "python" / "ortbridge"
# Private attributes of tensors and operators that every supported release has and that per-call
# paths read (a function call more each time would cost): allowed anywhere.
OBJECT_ATTRIBUTES_ALLOWED = {"_version", "_is_view", "_schema", "_overloadname"}
ROOTS = ("torch", "onnxruntime")
HOMES = {"torch": "_compat/torch_private.py", "onnxruntime": "_compat/ort_private.py"}
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
        elif (
            isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] in ROOTS
        ):
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
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            base = _dotted(node.args[0], aliases) or (
                node.args[0].id if isinstance(node.args[0], ast.Name) and node.args[0].id in aliases else None
            )
            if base:
                uses.append((node.lineno, f"{base}.{node.args[1].value}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            uses.extend((node.lineno, m) for m in _IN_STRING.findall(node.value))
    return sorted({u for u in uses if _private(u[1])})


def own_names(sources: list[str]) -> set[str]:
    """The names the package defines itself, and the functions of its _C module."""
    names = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                names.add(node.attr)
    for cc in (ROOT / "csrc").glob("*.cc"):
        names.update(re.findall(r'm\.def\(\s*"(\w+)"', cc.read_text()))
    return names


def private_attributes(source: str, own: set[str]) -> list[tuple[int, str]]:
    """(line, attribute) of each private attribute the source reads off an object it does not own."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and node.attr not in own
            and node.attr not in OBJECT_ATTRIBUTES_ALLOWED
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "aten"))
            and not ast.unparse(node.value).startswith("torch.ops.")
        ):  # (operators: public)
            found.append((node.lineno, node.attr))
    return found


def _outside_the_private_modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if str(p.relative_to(PACKAGE)) not in HOMES.values()]


def test_no_other_module_reads_private_attributes_of_objects():
    files = _outside_the_private_modules()
    own = own_names([p.read_text() for p in PACKAGE.rglob("*.py")])
    found = [
        f"{p.relative_to(PACKAGE)}:{line}: .{name}"
        for p in files
        for line, name in private_attributes(p.read_text(), own)
    ]
    assert not found, "private attributes read outside ortbridge/_compat/:\n" + "\n".join(found)


def test_the_attribute_check_finds_what_the_package_does_not_define():
    source = (
        "def f(session, ctx, t):\n    return session._sess, ctx._materialize_non_diff_grads, t._version, self._x, "
        "aten._unsafe_view, torch.ops.aten._to_copy"
    )
    assert private_attributes(source, own={"_x"}) == [(2, "_sess"), (2, "_materialize_non_diff_grads")]


def test_only_the_private_modules_use_private_apis():
    outside = []
    for path in _outside_the_private_modules():
        outside += [f"{path.relative_to(PACKAGE)}:{line}: {name}" for line, name in private_uses(path.read_text())]
    assert not outside, "private APIs used outside ortbridge/_compat/:\n" + "\n".join(outside)


@pytest.mark.parametrize("root", ROOTS)
def test_each_private_module_uses_private_apis_of_its_library_only(root):
    source = (PACKAGE / HOMES[root]).read_text()
    names = [name for _, name in private_uses(source)]
    assert names, f"{HOMES[root]} uses no private API of {root}: then it should not exist"
    assert all(name.split(".")[0] == root for name in names), names


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import torch\nx = torch._C._autograd.f", ["torch._C", "torch._C._autograd", "torch._C._autograd.f"]),
        (
            "import torch.utils._pytree as pytree\npytree.tree_map",
            ["torch.utils._pytree", "torch.utils._pytree.tree_map"],
        ),
        (
            "from torch._export.utils import _compiling_state_context as c\nc()",
            ["torch._export.utils._compiling_state_context"],
        ),
        ("from torch.nn.modules.module import _IncompatibleKeys", ["torch.nn.modules.module._IncompatibleKeys"]),
        ("import torch\ngetattr(torch, '_C')", ["torch._C"]),
        ("import logging\nlogging.getLogger('torch.onnx._internal.exporter')", ["torch.onnx._internal.exporter"]),
        ("import onnxruntime as ort\nort.capi._pybind_state", ["onnxruntime.capi._pybind_state"]),
        ("import torch\ntorch.ops.aten._unsafe_view.default\ntorch.__version__\ntorch.nn.Module", []),
    ],
)
def test_the_check_finds_each_way_of_reaching_a_private_api(source, expected):
    assert sorted({name for _, name in private_uses(source)}) == sorted(expected)
