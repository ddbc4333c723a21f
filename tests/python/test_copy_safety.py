"""copy.copy, copy.deepcopy and pickle of ortbridge's objects: each works or raises TypeError, and
none corrupts memory. (A deepcopy of a captured graph copied its fake tensors and, in their fake
mode, torch's StorageWeakRefs, whose __del__ frees a weak reference that the copy shared: the
process died at exit, "corrupted double-linked list". pickle protocols 0 and 1 of a pybind11
object without __reduce__ abort the process: std::terminate.) Copies run in child processes, as
a corrupted heap shows only at exit."""

from __future__ import annotations

import copy
import gc
import json
import os
import pickle
import subprocess
import sys
import textwrap

import torch

import ortbridge

WAYS = ["copy", "deepcopy", *(f"pickle{p}" for p in range(pickle.HIGHEST_PROTOCOL + 1))]
REFUSED = "cannot be copied or pickled"

# The child's helpers: a module calling a Function, run forward and backward, and `attempt`,
# which prints the outcome of each way of copying an object.
PRELUDE = """
    import copy, gc, json, pickle, sys
    import torch, ortbridge
    from ortbridge import _C
    from ortbridge._kernel import runner

    @ortbridge.register(name="test_copy_safety.Scale")
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, k):
            ctx.save_for_backward(x)
            return x * k

        @staticmethod
        def backward(ctx, g):
            return g * 2, None

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return Scale.apply(self.lin(x), 2.0).sum()

    WAYS = {"copy": copy.copy, "deepcopy": copy.deepcopy,
            **{f"pickle{p}": (lambda p: lambda x: pickle.loads(pickle.dumps(x, protocol=p)))(p)
               for p in range(pickle.HIGHEST_PROTOCOL + 1)}}

    def attempt(objects: dict) -> None:
        outcomes = {}
        for name, obj in objects.items():
            for way, f in WAYS.items():
                sys.stderr.write(f"{name} {way}\\n")  # (the last one names the culprit of a crash)
                try:
                    f(obj)
                    outcomes[f"{name} {way}"] = "ok"
                except Exception as e:
                    outcomes[f"{name} {way}"] = f"{type(e).__name__}: {e}"
        print(json.dumps(outcomes), flush=True)
"""


def _child(body: str) -> dict:
    """Runs PRELUDE + body in a fresh interpreter, which must exit with 0; its outcomes."""
    code = textwrap.dedent(PRELUDE) + textwrap.dedent(body)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=os.path.dirname(__file__)
    )
    assert proc.returncode == 0, f"exit code {proc.returncode}; stderr ends:\n{proc.stderr[-3000:]}"
    assert "corrupted" not in proc.stderr and "Sanitizer" not in proc.stderr, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_deepcopy_of_a_module_that_ran_exits_cleanly():
    outcomes = _child("""
        o = ortbridge.OrtModule(torch.nn.Linear(4, 4)); o(torch.randn(2, 4))
        attempt({"OrtModule": o})
    """)
    assert all(v == "ok" or v.startswith("TypeError") for v in outcomes.values()), outcomes


def test_capture_internals_refuse_copies():
    outcomes = _child("""
        o = ortbridge.OrtModule(Net())
        x = torch.randn(3, 4)
        o(x).backward()
        with torch.no_grad():
            o(x)  # (an inference capture too)
        captures = [c for cs in o._captures.values() for c in cs]
        objects = {}
        for k, c in enumerate(captures):
            objects[f"Capture {k}"] = c
            objects[f"Step {k}"] = c.step
            for j, s in enumerate(c.sessions):
                objects[f"GraphSession {k}.{j}"] = s
                objects[f"OnnxGraph {k}.{j}"] = s.graph
                objects[f"InferenceSession {k}.{j}"] = s.session
                objects[f"_Binding {k}.{j}"] = s._bindings[0]
        objects["ForwardNode"] = next(n for n in gc.get_objects() if type(n) is runner.ForwardNode)
        objects["BackwardNode"] = next(n for n in gc.get_objects() if type(n) is runner.BackwardNode)
        attempt({name: obj for name, obj in objects.items() if obj is not None})
        o(x).backward()  # (still runs)
    """)
    for key, outcome in outcomes.items():
        kind = key.split()[0]
        if kind in ("GraphSession", "OnnxGraph", "Step", "InferenceSession", "_Binding"):
            # (ONNX Runtime sessions and traced graphs of this process: the copy is refused before
            # any part of them is copied)
            assert outcome.startswith("TypeError") and REFUSED in outcome, (key, outcome)
        else:  # (Capture: refused by what it holds, or a shallow copy; the nodes hold plain values)
            assert outcome == "ok" or outcome.startswith("TypeError"), (key, outcome)
    assert any(k.startswith("Step") for k in outcomes)


def test_c_types_refuse_copies_and_bare_construction():
    outcomes = _child("""
        sys.path.insert(0, ".")
        from onnx import TensorProto as TP
        from conftest import T, model, python_op, python_op_grad, session, value

        layouts = []

        class Keeping(runner.BackwardNode):  # (the kernel hands its node a copy of its layout)
            def __init__(self, layout, *args):
                layouts.append(layout)
                super().__init__(layout, *args)

        runner.BackwardNode = Keeping
        fw = python_op(Scale, [T("x", requires_grad=True), 3.0], [(TP.FLOAT, 1)], out_names=["y"], training=True)
        bw = python_op_grad(Scale, "dc", [("gy", TP.FLOAT, 1)], [("gx", TP.FLOAT, 1)])
        session(model([fw, bw], [value("x", shape=[2]), value("gy", shape=[2])], [value("y"), value("gx")]))
        forward = _C.parse_forward({"training_mode": 1}, {"func_name": "f", "input_convention": "dc"},
                                   {"input_tensor_types": [1], "input_int_scalars": [3],
                                    "input_int_scalar_positions": [1], "output_tensor_types": [1],
                                    "output_tensor_ranks": [1]}, {}, 1, 2)
        objects = {"ForwardLayout": forward, "Constant": forward.constants[0], "BackwardLayout": layouts[0],
                   "KernelDescription": _C._kernels()[0], "Constant.Kind": _C.Constant.Kind.INT}
        attempt(objects)
        kind = _C.Constant.Kind.FLOAT_TUPLE  # (a value: copies are equal)
        assert all(pickle.loads(pickle.dumps(kind, protocol=p)) == kind for p in range(pickle.HIGHEST_PROTOCOL + 1))
        for cls in (_C.ForwardLayout, _C.BackwardLayout, _C.Constant, _C.KernelDescription):
            for how, make in (("__new__", lambda: cls.__new__(cls)), ("call", cls),
                              ("base __new__", lambda: cls.__mro__[1].__new__(cls))):
                try:
                    make()
                    print(cls.__name__, how, "made a bare object", file=sys.stderr)
                    sys.exit(3)
                except TypeError:
                    pass
    """)
    for key, outcome in outcomes.items():
        if key.startswith("Constant.Kind"):
            assert outcome == "ok", (key, outcome)
        else:
            assert outcome.startswith("TypeError") and REFUSED in outcome, (key, outcome)


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        return x * k

    @staticmethod
    def backward(ctx, g):
        return g * 2, None


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return _Scale.apply(self.lin(x), 2.0).sum()


def test_context_id_tensors_copy_without_a_second_release():
    """A step's tensor of context ids owns their contexts: a deep copy or an unpickled one holds
    the ids only, a shallow copy shares the original's memory."""
    o = ortbridge.OrtModule(_Net())
    x = torch.randn(3, 4)
    o(x).backward()
    capture = next(c for cs in o._captures.values() for c in cs)
    outputs = capture.step.forward_graph([*capture.params, x])
    ids = next(t for t in outputs if isinstance(t, torch.Tensor) and t.dtype == torch.int64)
    assert ortbridge.context_pool_size() == ids.numel() > 0
    copies = [copy.deepcopy(ids), pickle.loads(pickle.dumps(ids))]
    shallow = copy.copy(ids)
    assert all(torch.equal(c, ids) for c in (*copies, shallow))
    del outputs, ids
    assert ortbridge.context_pool_size() > 0  # (the shallow copy holds them)
    del shallow
    gc.collect()  # (torch 2.9's copies of the tensor leave a reference cycle to it, which holds that memory)
    assert ortbridge.context_pool_size() == 0  # (released once, with the memory that owns them)
    assert all(c.numel() > 0 for c in copies)
