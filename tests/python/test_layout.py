"""The package's import graph (docs/layout.md): no module imports another that imports it back,
directly or through others (imports inside functions count too), and no module reaches another
package's underscore names (`from .._kernel.runner import _lent_buffers`, `_C._begin_run` from training/):
what a package offers the others it names without an underscore."""

from __future__ import annotations

import ast
import pathlib

import ortbridge

PACKAGE = pathlib.Path(ortbridge.__file__).parent


def _modules() -> dict:
    """{dotted name: path} of every module of the package, and the compiled _C (no path)."""
    found = {"ortbridge._C": None}
    for path in PACKAGE.rglob("*.py"):
        parts = ("ortbridge", *path.relative_to(PACKAGE).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()
# The compiled half of the kernel side: its underscore names (_begin_saving, _lend_output, the apply
# routing) are for the kernel side's Python and the package's top level, never for tracing,
# the exporter or training, which use what those offer.
C_READERS = {"ortbridge", "ortbridge._kernel", "ortbridge._compat"}


def _package(module: str) -> str:
    path = MODULES[module]
    return module if path is not None and path.name == "__init__.py" else module.rsplit(".", 1)[0]


def _imports(module: str):
    """(imported module, name or None) for each name the module imports from the package: a
    submodule (its name), or a name from a module."""
    base = _package(module)
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                target = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                if f"{target}.{alias.name}" in MODULES:
                    yield f"{target}.{alias.name}", None, alias.asname or alias.name
                elif target in MODULES:
                    yield target, alias.name, None
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    yield alias.name, None, None


def _reaches(module: str, target: str) -> bool:
    """Whether `module` reading an underscore name of `target` crosses into another package's."""
    if target == "ortbridge._C":
        return _package(module) not in C_READERS
    return _package(module) != _package(target)


def _graph() -> tuple[dict, list]:
    """({module: modules it imports}, [reaches into another package's underscore names])."""
    edges, private = {}, []
    for module, path in MODULES.items():
        if path is None:
            continue
        aliases = {}
        for target, name, alias in _imports(module):
            if _package(target) == target and module.startswith(target + "."):
                continue  # (a package's own __init__, which runs before any of its modules)
            edges.setdefault(module, set()).add(target)
            if alias:
                aliases[alias] = target
            elif name and name.startswith("_") and _reaches(module, target):
                private.append(f"{module} imports {target}.{name}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                target = aliases[node.value.id]
                if node.attr.startswith("_") and not node.attr.startswith("__") and _reaches(module, target):
                    private.append(f"{module} reads {target}.{node.attr}")
    return edges, sorted(set(private))


def _cycle(edges: dict) -> list | None:
    """A cycle of imports, or None."""
    state, path = {}, []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for target in sorted(edges.get(module, ())):
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(edges):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_no_module_imports_one_that_imports_it_back():
    edges, _ = _graph()
    assert len(edges) > 20, "the graph lost its modules"
    cycle = _cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_reaches_another_packages_underscore_names():
    _, private = _graph()
    assert not private, "\n".join(private)


def test_the_checks_find_what_they_look_for():
    """(the analysis itself: a cycle and a private reach it must see)"""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    edges, _ = _graph()
    assert "ortbridge._kernel.runner" in edges["ortbridge.training.session"]
    assert _reaches("ortbridge.training.session", "ortbridge._C")
    assert _reaches("ortbridge._tracing.record", "ortbridge._kernel.runner")
    assert not _reaches("ortbridge._kernel.runner", "ortbridge._C")


def _node_attributes(cls_name: str) -> set:
    """The methods of a class of runner.py and of its bases there, and what their code sets on
    `self`."""
    classes = {
        n.name: n
        for n in ast.parse((PACKAGE / "_kernel" / "runner.py").read_text()).body
        if isinstance(n, ast.ClassDef)
    }
    found, todo = set(), [cls_name]
    while todo:
        node = classes[todo.pop()]
        todo += [b.id for b in node.bases if isinstance(b, ast.Name) and b.id in classes]
        for item in ast.walk(node):
            if isinstance(item, ast.FunctionDef):
                found.add(item.name)
            elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store):
                if isinstance(item.value, ast.Name) and item.value.id == "self":
                    found.add(item.attr)
    return found


def test_the_kernels_call_what_the_runner_declares():
    """One C++<->Python contract: the names csrc/runner_api.cc resolves are the ones
    ortbridge._kernel.runner declares, each of which it has (a module name) or both its node classes
    give their nodes."""
    from ortbridge import _C
    from ortbridge._kernel import runner

    names = _C._runner_names()
    assert sorted(names["module"]) == sorted(runner.KERNEL_NAMES)
    assert sorted(names["node"]) == sorted(runner.NODE_NAMES)
    assert sorted(names["direct_call"]) == sorted(runner.DirectCall._fields)
    missing = [n for n in runner.KERNEL_NAMES if not hasattr(runner, n)]
    missing += [
        f"{c}.{n}" for c in ("ForwardNode", "BackwardNode") for n in runner.NODE_NAMES if n not in _node_attributes(c)
    ]
    assert not missing, missing
