"""The registry is the only way a func_name resolves: a model cannot name arbitrary code."""

import re
import sys

import numpy as np
import onnx
import pytest
import torch
from conftest import T, model, python_op, session, value
from onnx import TensorProto as TP

import ortbridge


class Base(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x + 1

    @staticmethod
    def backward(ctx, g):
        return g


class Derived(Base):  # an indirect subclass of Function (ORTModule rejected these)
    @staticmethod
    def forward(ctx, x):
        return x + 2


def run_one(func_name, x=None, from_ortmodule=False):
    x = np.zeros(2, np.float32) if x is None else x
    node = python_op(func_name, [T("x")], [(TP.FLOAT, 1)], out_names=["y"])
    graph = model([node], [value("x", shape=[2])], [value("y")])
    if from_ortmodule:  # the same node as ORTModule writes it, converted
        proto = onnx.load_from_string(graph)
        proto.graph.node[0].domain = "com.microsoft"
        proto.opset_import[1].domain = "com.microsoft"
        graph = ortbridge.convert_from_ortmodule(proto).SerializeToString()
    return session(graph).run(None, {"x": x})[0]


def test_register_forms_and_names():
    try:
        assert ortbridge.register(Derived) is Derived
        np.testing.assert_array_equal(run_one("test_registry.Derived"), [2, 2])

        @ortbridge.register(name="custom.name")
        class Local(Base):
            pass

        assert "custom.name" in ortbridge.registered_names()
        np.testing.assert_array_equal(run_one("custom.name"), [1, 1])
        ortbridge.unregister("custom.name")
        assert "custom.name" not in ortbridge.registered_names()
    finally:
        ortbridge.unregister(Derived)


def test_same_class_name_in_different_scopes_resolves_by_qualified_name():
    def make():
        class Base(torch.autograd.Function):  # same __name__ as the module-level Base
            @staticmethod
            def forward(ctx, x):
                return x + 10

            @staticmethod
            def backward(ctx, g):
                return g

        return Base

    local = ortbridge.register(make())
    ortbridge.register(Base)
    try:
        assert ortbridge.registry.registered_name(local).endswith("make.<locals>.Base")
        np.testing.assert_array_equal(run_one(ortbridge.registry.registered_name(local)), [10, 10])
        np.testing.assert_array_equal(run_one("test_registry.Base"), [1, 1])
    finally:
        ortbridge.unregister(local), ortbridge.unregister(Base)


def test_a_scripts_function_rerun_as_mp_main_has_its_main_name():
    """multiprocessing's spawn (a DataLoader worker) runs the script again as __mp_main__: its
    Functions are the script's, which the script's models name __main__.X."""

    class Scripted(Derived):
        pass

    Scripted.__module__, Scripted.__qualname__ = "__mp_main__", "Scripted"
    ortbridge.register(Scripted)
    try:
        assert ortbridge.registry.registered_name(Scripted) == "__main__.Scripted"
        np.testing.assert_array_equal(run_one("__main__.Scripted"), [2, 2])
    finally:
        ortbridge.unregister(Scripted)


def test_register_rejects_what_is_not_a_function():
    with pytest.raises(TypeError, match="expects a torch.autograd.Function subclass"):
        ortbridge.register(torch.nn.Linear)
    with pytest.raises(TypeError):
        ortbridge.register(print)


SIDE_EFFECT_MODULE = "ortbridge_test_side_effect"


@pytest.mark.parametrize("from_ortmodule", [False, True], ids=["ortbridge-graph", "converted-ortmodule-graph"])
@pytest.mark.parametrize(
    "func_name",
    ["os.system", "builtins.eval", "subprocess.Popen", f"{SIDE_EFFECT_MODULE}.Payload", "torch.autograd.Function"],
)
def test_unregistered_names_are_refused_and_nothing_is_imported(func_name, from_ortmodule, tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / f"{SIDE_EFFECT_MODULE}.py").write_text(
        f"open({str(marker)!r}, 'w').write('side effect')\n"
        "import torch\nclass Payload(torch.autograd.Function):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    modules_before = set(sys.modules)
    with pytest.raises(
        ortbridge.UnknownFunctionError, match=f"calls Function '{re.escape(func_name)}', and no Function is registered"
    ):
        run_one(func_name, from_ortmodule=from_ortmodule)
    assert not marker.exists(), "the model made a module import"
    assert SIDE_EFFECT_MODULE not in sys.modules
    assert set(sys.modules) - modules_before == set()
