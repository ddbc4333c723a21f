"""Helpers shared by the Python tests: hand-built PythonOp / PythonOpGrad graphs, a check that no
test leaves an autograd context behind, and one that the ONNX Runtime kernel audit covers every kind
of node the tests' graphs contain."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from ort_kernel_cases import audited_kinds, kind

import ortbridge
from ortbridge import registry
from ortbridge._compat import ort_private
from ortbridge._tracing import kernels

OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("ortbridge", 1)]
# IOBinding takes bfloat16 buffers, as an ONNX element type, from onnxruntime 1.20 (the package
# says so where a bfloat16 graph input meets an older release).
BINDS_BFLOAT16 = ort_private.RELEASE >= (1, 20)
needs_bfloat16_binding = pytest.mark.skipif(
    not BINDS_BFLOAT16, reason=f"bfloat16 graph inputs need onnxruntime 1.20 or later; this is {ort.__version__}"
)


@dataclass
class T:
    """A tensor argument of a PythonOp node: graph value name, ONNX element type, rank."""

    name: str
    elem_type: int = TensorProto.FLOAT
    rank: int = 1
    requires_grad: bool = False


def _f64_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def python_op(
    func,
    args: list,
    outputs: list,
    *,
    out_names: list,
    ctx_name: str = "ctx",
    training: bool = False,
    name: str = "fw",
    **extra,
) -> onnx.NodeProto:
    """A PythonOp calling `func.apply(*args)`; tensors are T(...), anything else a constant.
    `outputs` lists (elem_type, rank) per Function output."""
    convention, tensors, requires = "", [], []
    attrs: dict = {}

    def add(key, value):
        attrs.setdefault(key, []).append(value)

    for position, a in enumerate(args):
        if isinstance(a, T):
            convention += "d"
            tensors.append(a)
            requires.append(int(a.requires_grad))
            continue
        convention += "c"
        requires.append(0)
        if isinstance(a, bool):
            add("input_bool_scalars", int(a)), add("input_bool_scalar_positions", position)
        elif isinstance(a, int):
            add("input_int_scalars", a), add("input_int_scalar_positions", position)
        elif isinstance(a, float):
            add("input_float_scalars", a), add("input_float_scalar_positions", position)
            add("input_float_scalars_f64", _f64_bits(a))
        elif isinstance(a, tuple):
            kind = "bool" if isinstance(a[0], bool) else "int" if isinstance(a[0], int) else "float"
            attrs.setdefault(f"input_{kind}_tuple_begins", []).append(len(attrs.get(f"input_{kind}_tuples", [])))
            for v in a:
                add(f"input_{kind}_tuples", int(v) if kind != "float" else v)
                if kind == "float":
                    add("input_float_tuples_f64", _f64_bits(v))
            add(f"input_{kind}_tuple_positions", position)
        else:
            add("input_pointer_scalars", registry.pin_object(a)), add("input_pointer_scalar_positions", position)
    attrs.update(
        func_name=func if isinstance(func, str) else registry.registered_name(func),
        input_convention=convention,
        input_tensor_types=[t.elem_type for t in tensors],
        input_tensor_ranks=[t.rank for t in tensors],
        input_requires_grads=requires,
        output_tensor_types=[o[0] for o in outputs],
        output_tensor_ranks=[o[1] for o in outputs],
        training_mode=int(training),
    )
    attrs.update(extra)
    return helper.make_node(
        "PythonOp", [t.name for t in tensors], [ctx_name, *out_names], domain="ortbridge", name=name, **attrs
    )


def python_op_grad(
    func, convention: str, grad_inputs: list, grad_outputs: list, *, ctx_name: str = "ctx", name: str = "bw", **extra
) -> onnx.NodeProto:
    """A PythonOpGrad. grad_inputs: (value name or None if absent, elem_type, rank) per forward
    output; grad_outputs: (value name or None if not wanted, elem_type, rank) per forward tensor."""
    attrs = dict(
        func_name=func if isinstance(func, str) else registry.registered_name(func),
        output_convention=convention,
        input_tensor_types=[g[1] for g in grad_inputs],
        input_tensor_ranks=[g[2] for g in grad_inputs],
        input_tensor_present=[int(g[0] is not None) for g in grad_inputs],
        output_tensor_types=[g[1] for g in grad_outputs],
        output_tensor_ranks=[g[2] for g in grad_outputs],
        output_tensor_requires_grads=[int(g[0] is not None) for g in grad_outputs],
    )
    attrs.update(extra)
    return helper.make_node(
        "PythonOpGrad",
        [ctx_name] + [g[0] for g in grad_inputs if g[0] is not None],
        [g[0] or "" for g in grad_outputs],
        domain="ortbridge",
        name=name,
        **attrs,
    )


def value(name: str, elem_type: int = TensorProto.FLOAT, shape=None):
    return helper.make_tensor_value_info(name, elem_type, shape)


def model(nodes: list, inputs: list, outputs: list) -> bytes:
    graph = helper.make_graph(nodes, "test", inputs, outputs)
    # IR version 8 (opset 17's) so that older ONNX Runtime releases load the test models too.
    return helper.make_model(graph, opset_imports=OPSETS, ir_version=8).SerializeToString()


# ORTBRIDGE_TEST_KERNEL_PATH=device: sessions made here run the CPU kernels on the CUDA kernels'
# code path (ortbridge.runtime.CPU_KERNELS_VIA_TORCH). scripts/test.sh runs the kernel suites so
# too, which covers that path on machines without a GPU.
DEVICE_PATH = os.environ.get("ORTBRIDGE_TEST_KERNEL_PATH") == "device"


def session(
    model_bytes: bytes, sess_options: ort.SessionOptions | None = None, *, device_path: bool = DEVICE_PATH, **kwargs
) -> ortbridge.InferenceSession:
    if device_path:
        sess_options = sess_options or ort.SessionOptions()
        sess_options.add_session_config_entry(ortbridge.runtime.CPU_KERNELS_VIA_TORCH, "1")
    return ortbridge.InferenceSession(model_bytes, sess_options, providers=["CPUExecutionProvider"], **kwargs)


@ortbridge.register
class NewStyle(torch.autograd.Function):
    """forward without ctx plus setup_context, with a default argument (torch's apply wrapper
    binds it, so ortbridge must go through that wrapper)."""

    @staticmethod
    def forward(x, scale=3.0):
        return x * scale

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.scale = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


@pytest.fixture(autouse=True)
def no_context_left():
    """Every test must leave the context pool as it found it: empty."""
    assert ortbridge.context_pool_size() == 0
    yield
    assert ortbridge.context_pool_size() == 0, "a test leaked autograd contexts"


# Every graph the package makes passes kernels.unsafe_nodes (the deny list's check), which records
# here the kinds of ONNX node it sees (ort_kernel_cases.kind), each with the first test that made
# one. At the end of the session each must have a case in ort_kernel_cases.py, which the kernel
# audit (test_ort_kernel_audit.py) runs in ONNX Runtime on several threads against PyTorch.
_GRAPH_NODE_KINDS: dict[str, str] = {}


def pytest_configure(config):
    check = kernels.unsafe_nodes

    def unsafe_nodes(model, *args, **kwargs):
        for node in kernels.nodes_of(model):
            if node.domain in ("", "ai.onnx"):
                _GRAPH_NODE_KINDS.setdefault(kind(node), os.environ.get("PYTEST_CURRENT_TEST", "?"))
        return check(model, *args, **kwargs)

    kernels.unsafe_nodes = unsafe_nodes


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """(pytest-xdist's controller: the kinds a worker's tests saw; none from a worker that crashed,
    whose crash fails the run)"""
    for k, test in getattr(node, "workeroutput", {}).get("graph_node_kinds", {}).items():
        _GRAPH_NODE_KINDS.setdefault(k, test)


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workeroutput"):  # (a pytest-xdist worker: the controller checks them all)
        session.config.workeroutput["graph_node_kinds"] = _GRAPH_NODE_KINDS
        return
    missing = {k: test for k, test in _GRAPH_NODE_KINDS.items() if k not in audited_kinds()}
    if missing:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        for k, test in sorted(missing.items()):
            reporter.write_line(f"kernel audit: no case in ort_kernel_cases.py for {k} (a graph of {test})", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
