"""Concurrency: one session called from several Python threads, and a Function that itself
runs an ortbridge session (the kernel holds no lock while Python runs, so nesting works)."""

import threading

import numpy as np
import torch
from conftest import T, model, python_op, python_op_grad, session, value
from onnx import TensorProto as TP

import ortbridge


@ortbridge.register
class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x * k

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None


def scale_training_session():
    fw = python_op(Scale, [T("x", requires_grad=True), 3.0], [(TP.FLOAT, 1)], out_names=["y"], training=True)
    bw = python_op_grad(Scale, "dc", [("g", TP.FLOAT, 1)], [("gx", TP.FLOAT, 1)])
    return session(model([fw, bw], [value("x", shape=[None]), value("g", shape=[None])], [value("y"), value("gx")]))


def test_four_threads_share_one_session():
    sess = scale_training_session()
    errors = []

    def worker(seed):
        try:
            rng = np.random.default_rng(seed)
            for _ in range(200):
                x = rng.standard_normal(int(rng.integers(1, 64))).astype(np.float32)
                g = rng.standard_normal(x.shape).astype(np.float32)
                y, gx = sess.run(None, {"x": x, "g": g})
                np.testing.assert_array_equal(y, x * np.float32(3))
                np.testing.assert_array_equal(gx, g * np.float32(3))
        except Exception as e:  # reported below: an assertion in a thread would be lost
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert errors == []


_inner = {}


@ortbridge.register
class RunsInnerSession(torch.autograd.Function):
    """Its forward runs another ortbridge session, itself holding a PythonOp."""

    @staticmethod
    def forward(ctx, x):
        (y,) = _inner["session"].run(None, {"x": x.numpy()})
        return torch.from_numpy(y) + 1

    @staticmethod
    def backward(ctx, g):
        (gx,) = _inner["grad"].run(None, {"x": np.zeros(g.shape, np.float32), "g": g.numpy()})[1:]
        return torch.from_numpy(gx)


def test_function_that_runs_an_ortbridge_session_does_not_deadlock():
    inner = python_op(Scale, [T("x"), 2.0], [(TP.FLOAT, 1)], out_names=["y"])
    _inner["session"] = session(model([inner], [value("x", shape=[None])], [value("y")]))
    _inner["grad"] = scale_training_session()
    fw = python_op(RunsInnerSession, [T("x", requires_grad=True)], [(TP.FLOAT, 1)], out_names=["y"], training=True)
    bw = python_op_grad(RunsInnerSession, "d", [("g", TP.FLOAT, 1)], [("gx", TP.FLOAT, 1)])
    outer = session(model([fw, bw], [value("x", shape=[None]), value("g", shape=[None])], [value("y"), value("gx")]))
    result = {}
    t = threading.Thread(
        target=lambda: result.update(
            out=outer.run(None, {"x": np.arange(4, dtype=np.float32), "g": np.ones(4, np.float32)})
        )
    )
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "nested ortbridge sessions deadlocked"
    y, gx = result["out"]
    np.testing.assert_array_equal(y, np.arange(4, dtype=np.float32) * 2 + 1)
    np.testing.assert_array_equal(gx, np.full(4, 3, np.float32))
    _inner.clear()


def test_parallel_executor_runs_kernels_on_ort_threads():
    # ORT's parallel executor calls kernels from its own (non-Python) threads.
    import onnxruntime as ort

    nodes = [
        python_op(
            Scale,
            [T("x", requires_grad=True), float(k)],
            [(TP.FLOAT, 1)],
            out_names=[f"y{k}"],
            ctx_name=f"c{k}",
            name=f"fw{k}",
            training=True,
        )
        for k in (2, 5)
    ]
    nodes += [
        python_op_grad(Scale, "dc", [("g", TP.FLOAT, 1)], [(f"gx{k}", TP.FLOAT, 1)], ctx_name=f"c{k}", name=f"bw{k}")
        for k in (2, 5)
    ]
    so = ort.SessionOptions()
    so.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    so.inter_op_num_threads = 2
    sess = session(
        model(
            nodes, [value("x", shape=[None]), value("g", shape=[None])], [value(n) for n in ("y2", "y5", "gx2", "gx5")]
        ),
        sess_options=so,
    )
    x, g = np.arange(5, dtype=np.float32), np.ones(5, np.float32)
    for _ in range(50):
        y2, y5, gx2, gx5 = sess.run(None, {"x": x, "g": g})
        np.testing.assert_array_equal(y2, x * 2)
        np.testing.assert_array_equal(y5, x * 5)
        np.testing.assert_array_equal(gx2, g * 2)
        np.testing.assert_array_equal(gx5, g * 5)
