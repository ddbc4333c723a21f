"""The CUDA kernels' code path, run on the CPU (ortbridge.runtime.CPU_KERNELS_VIA_TORCH): the
stream scope around the Function, and torch writing every output buffer. The CUDA tests proper
(tests/python/test_cuda.py) need a GPU; scripts/test.sh also runs the kernel suites on this path."""

import numpy as np
import onnxruntime as ort
import pytest
import torch
from conftest import T, model, python_op, python_op_grad, session, value
from onnx import TensorProto as TP

import ortbridge
from ortbridge import _C
from ortbridge._kernel import runner


def test_both_execution_providers_are_registered_and_the_context_id_is_read_on_the_host():
    kernels = {(k.op, k.provider, k.via_torch): k.input_memory for k in _C._kernels()}
    assert kernels[("PythonOp", "CPUExecutionProvider", False)] == ["default", "default"]
    assert kernels[("PythonOpGrad", "CPUExecutionProvider", False)] == ["default", "default"]
    assert kernels[("PythonOp", "CUDAExecutionProvider", False)] == ["default", "default"]
    # A custom op's outputs live on its device; PythonOpGrad asks ORT for the id in host memory.
    assert kernels[("PythonOpGrad", "CUDAExecutionProvider", False)] == ["cpu", "default"]
    assert kernels[("PythonOpGrad", "CPUExecutionProvider", True)] == ["cpu", "default"]


@ortbridge.register
class Recorded(torch.autograd.Function):
    """x * 2 and x.sum(); records what each call saw of torch's stream state."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        Recorded.seen.append(("forward", _Log.depth))
        return x * 2, x.sum()

    @staticmethod
    def backward(ctx, gy, gs):
        Recorded.seen.append(("backward", _Log.depth))
        return gy * 2 + gs


class _Log:
    """Wraps the runner node's device work, logging each call in order."""

    depth = 0  # open stream scopes

    def __init__(self, monkeypatch):
        self.calls = []
        node = runner._Node
        use, restore, copy_into, fill = node.use_stream, node.restore_stream, node.copy_into, node.fill

        def use_stream(node_self, stream):
            self.calls.append(("use_stream", stream))
            _Log.depth += 1
            return use(node_self, stream)

        def restore_stream(previous):
            self.calls.append(("restore_stream",))
            _Log.depth -= 1
            restore(previous)

        def logged(name, inner):
            def call(*args):
                assert _Log.depth == 1, f"{name} outside the stream scope"
                self.calls.append((name,))
                inner(*args)

            return staticmethod(call)

        monkeypatch.setattr(node, "use_stream", use_stream)
        monkeypatch.setattr(node, "restore_stream", staticmethod(restore_stream))
        monkeypatch.setattr(node, "copy_into", logged("copy_into", copy_into))
        monkeypatch.setattr(node, "fill", logged("fill", fill))


def training_model(present=(True, True)) -> bytes:
    fw = python_op(
        Recorded, [T("x", requires_grad=True)], [(TP.FLOAT, 1), (TP.FLOAT, 0)], out_names=["y", "s"], training=True
    )
    bw = python_op_grad(
        Recorded,
        "d",
        [("gy" if present[0] else None, TP.FLOAT, 1), ("gs" if present[1] else None, TP.FLOAT, 0)],
        [("gx", TP.FLOAT, 1)],
    )
    grads = [value(n, shape=s) for n, s, p in (("gy", [None], present[0]), ("gs", [], present[1])) if p]
    return model([fw, bw], [value("x", shape=[None]), *grads], [value("y"), value("s"), value("gx")])


def test_sessions_may_leave_the_cuda_kernels_out():
    node = python_op(Recorded, [T("x")], [(TP.FLOAT, 1), (TP.FLOAT, 0)], out_names=["y", "s"])
    options = ortbridge.session_options(cuda_kernels=False)
    assert options.get_session_config_entry(ortbridge.runtime.CPU_KERNELS_ONLY) == "1"
    sess = ortbridge.InferenceSession(
        model([node], [value("x", shape=[None])], [value("y"), value("s")]), options, providers=["CPUExecutionProvider"]
    )
    y, _ = sess.run(None, {"x": np.ones(2, dtype=np.float32)})
    np.testing.assert_array_equal(y, [2, 2])
    with pytest.raises(ValueError, match="registered with the CUDA ones"):
        ortbridge.session_options(ortbridge.session_options(), cuda_kernels=False)


def test_torch_writes_every_output_inside_the_stream_scope(monkeypatch):
    log = _Log(monkeypatch)
    Recorded.seen.clear()
    sess = session(training_model(), device_path=True)
    x, gy = np.arange(4, dtype=np.float32), np.ones(4, dtype=np.float32)
    y, s, gx = sess.run(None, {"x": x, "gy": gy, "gs": np.asarray(3.0, dtype=np.float32)})
    np.testing.assert_array_equal(y, x * 2)
    assert s == x.sum()
    np.testing.assert_array_equal(gx, gy * 2 + 3)
    # On the CPU execution provider ORT has no compute stream: the kernel passes 0.
    assert log.calls == [
        ("use_stream", 0),
        ("copy_into",),
        ("copy_into",),
        ("fill",),
        ("restore_stream",),
        ("use_stream", 0),
        ("copy_into",),
        ("restore_stream",),
    ]
    assert Recorded.seen == [("forward", 1), ("backward", 1)]


def test_absent_gradient_is_zeros_made_on_the_device_and_unwanted_output_filled(monkeypatch):
    log = _Log(monkeypatch)
    sess = session(training_model(present=(True, False)), device_path=True)
    x = np.arange(3, dtype=np.float32)
    (gx,) = sess.run(["gx"], {"x": x, "gy": np.ones(3, dtype=np.float32)})
    np.testing.assert_array_equal(gx, np.full(3, 2, dtype=np.float32))
    assert ("fill",) in log.calls


def test_an_error_in_the_function_restores_the_stream(monkeypatch):
    log = _Log(monkeypatch)

    @ortbridge.register(name="test_device_path.Fails")
    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            raise ValueError("boom")

    try:
        node = python_op(Fails, [T("x")], [(TP.FLOAT, 1)], out_names=["y"])
        sess = session(model([node], [value("x", shape=[None])], [value("y")]), device_path=True)
        with pytest.raises(Exception, match="boom"):
            sess.run(None, {"x": np.ones(2, dtype=np.float32)})
        assert log.calls == [("use_stream", 0), ("restore_stream",)]
    finally:
        ortbridge.unregister(Fails)


def test_a_strided_output_overlapping_its_buffer_is_copied_through_a_clone():
    node = runner._Node("cpu")
    buffer = torch.arange(6, dtype=torch.float32)
    source = buffer.view(2, 3).t()  # (3, 2), strided, over the same memory
    expected = source.contiguous()
    destination = torch.utils.dlpack.to_dlpack(buffer.view(3, 2))
    node.copy_into(destination, torch.utils.dlpack.to_dlpack(source), True)
    torch.testing.assert_close(buffer.view(3, 2), expected)


def test_use_stream_off_cuda_is_a_no_op():
    node = runner._Node("cpu")
    assert node.use_stream(0) is None
    node.restore_stream(None)


def test_a_function_returning_another_device_is_refused():
    error = pytest.raises(
        RuntimeError, runner._export_tensor, torch.ones(1), "f.forward output", 0, torch.device("cuda:1")
    )
    assert "is on cpu, but this kernel runs on cuda:1 (the CUDA execution provider)" in str(error.value)


# The training graphs' device logic (training/onnx_graph.py, devices.py), with fake CUDA tensors.


def _graph_with_inputs(*devices, context_id_on_cpu: bool = False) -> list:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ortbridge.training import onnx_graph as g

    fx = torch.fx.Graph()
    with FakeTensorMode():
        placeholders = []
        for k, device in enumerate(devices):
            p = fx.placeholder(f"x{k}")
            p.meta["val"] = torch.empty(2, device=device)
            placeholders.append(p)
        if context_id_on_cpu:  # as a backward graph takes a context id: input 0 of python_op_grad
            ctx = fx.placeholder("ctx")
            ctx.meta["val"] = torch.empty((), dtype=torch.int64)
            fx.call_function(g._PYTHON_OP_GRAD, (ctx, [placeholders[0]], 0))
            placeholders.append(ctx)
    return placeholders


def test_a_graph_runs_on_the_one_device_of_its_inputs():
    from ortbridge.training.onnx_graph import device_of

    assert device_of(_graph_with_inputs("cpu", "cpu")) == torch.device("cpu")
    assert device_of(_graph_with_inputs("cuda:1", "cuda:1")) == torch.device("cuda:1")
    assert device_of(_graph_with_inputs("cuda:0", context_id_on_cpu=True)) == torch.device("cuda:0")
    with pytest.raises(NotImplementedError, match="tensors are on cpu and cuda:0; ortbridge runs a graph on one"):
        device_of(_graph_with_inputs("cuda:0", "cpu"))
    with pytest.raises(NotImplementedError, match="on meta; ortbridge runs graphs on the CPU and on CUDA"):
        device_of(_graph_with_inputs("meta"))


def test_a_cuda_graph_needs_onnxruntime_gpu(monkeypatch):
    from ortbridge.training import devices as g

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.raises(
        RuntimeError, match=r"on cuda:0, but this onnxruntime has no CUDAExecutionProvider: .*ortbridge\[gpu\]"
    ):
        g.execution_providers(None, torch.device("cuda:0"))


def test_a_cuda_graph_runs_on_ortbridges_stream_with_the_users_provider_options(monkeypatch):
    from ortbridge.training import devices as g

    class Stream:
        cuda_stream = 1234

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(g, "cuda_stream", lambda device: Stream)
    ours = {"device_id": "1", "has_user_compute_stream": "1", "user_compute_stream": "1234"}
    assert g.execution_providers(None, torch.device("cuda:1")) == [
        ("CUDAExecutionProvider", ours),
        ("CPUExecutionProvider", {}),
    ]
    given = ["CPUExecutionProvider", ("CUDAExecutionProvider", {"arena_extend_strategy": "kSameAsRequested"})]
    assert g.execution_providers(given, torch.device("cuda:1")) == [
        ("CUDAExecutionProvider", {"arena_extend_strategy": "kSameAsRequested", **ours}),
        ("CPUExecutionProvider", {}),
    ]
    assert g.execution_providers(None, torch.device("cpu")) == ["CPUExecutionProvider"]
