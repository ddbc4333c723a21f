"""PythonOp in inference mode (training_mode=0) against eager PyTorch: dtypes, shapes, layouts,
constants, zero copy."""

import numpy as np
import onnxruntime as ort
import pytest
import torch
from conftest import NewStyle, T, model, python_op, session, value
from onnx import TensorProto as TP
from onnx import helper

import ortbridge
from ortbridge._kernel import runner


@ortbridge.register
class Triple(torch.autograd.Function):
    """Output 1 has the input's dtype; output 2 is an int64 scalar (mixed output types)."""

    @staticmethod
    def forward(ctx, x):
        y = ~x if x.dtype == torch.bool else x * 3
        return y, torch.tensor(x.numel())

    @staticmethod
    def backward(ctx, gy, gn):
        return gy * 3


def run_triple(x: np.ndarray, elem_type: int):
    rank = x.ndim
    node = python_op(Triple, [T("x", elem_type, rank)], [(elem_type, rank), (TP.INT64, 0)], out_names=["y", "n"])
    sess = session(model([node], [value("x", elem_type, list(x.shape))], [value("y", elem_type), value("n", TP.INT64)]))
    return sess.run(None, {"x": x})


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int64", "int32", "int8", "uint8", "bool"])
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3), (2, 0, 4), (3, 1, 2, 2)])
def test_dtype_and_shape_parity(dtype, shape):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 10).astype(dtype) if dtype != "bool" else rng.random(shape) > 0.5
    elem_type = {
        "float32": TP.FLOAT,
        "float64": TP.DOUBLE,
        "float16": TP.FLOAT16,
        "int64": TP.INT64,
        "int32": TP.INT32,
        "int8": TP.INT8,
        "uint8": TP.UINT8,
        "bool": TP.BOOL,
    }[dtype]
    y, n = run_triple(np.asarray(x), elem_type)
    ey, en = Triple.apply(torch.from_numpy(np.asarray(x)))
    assert y.dtype == np.asarray(x).dtype and y.shape == tuple(shape)
    np.testing.assert_array_equal(y, ey.numpy())
    assert n.shape == () and n.dtype == np.int64 and int(n) == int(en)


def test_bfloat16_crosses_unchanged():
    # numpy has no bfloat16: the graph casts float32 -> bfloat16 -> PythonOp -> float32.
    x = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    nodes = [
        helper.make_node("Cast", ["x"], ["xb"], to=TP.BFLOAT16),
        python_op(Triple, [T("xb", TP.BFLOAT16, 2)], [(TP.BFLOAT16, 2), (TP.INT64, 0)], out_names=["yb", "n"]),
        helper.make_node("Cast", ["yb"], ["y"], to=TP.FLOAT),
    ]
    sess = session(model(nodes, [value("x", TP.FLOAT, [3, 4])], [value("y")]))
    (y,) = sess.run(None, {"x": x})
    expected = Triple.apply(torch.from_numpy(x).to(torch.bfloat16))[0].float().numpy()
    np.testing.assert_array_equal(y, expected)


@ortbridge.register
class Transposed(torch.autograd.Function):
    """Returns non-contiguous views: the kernel copies them out in row-major order."""

    @staticmethod
    def forward(ctx, x):
        return x.t(), x[:, ::2], x.t()[1:4, :1].expand(3, 4)

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError


@pytest.mark.parametrize("shape", [(4, 6), (1024, 600)])  # (from 1 MiB torch copies the outputs)
def test_non_contiguous_outputs(shape):
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    node = python_op(Transposed, [T("x", TP.FLOAT, 2)], [(TP.FLOAT, 2)] * 3, out_names=["a", "b", "c"])
    sess = session(model([node], [value("x", TP.FLOAT, list(shape))], [value("a"), value("b"), value("c")]))
    got = sess.run(None, {"x": x})
    for g, e in zip(got, Transposed.apply(torch.from_numpy(x))):
        np.testing.assert_array_equal(g, e.contiguous().numpy())


def test_non_contiguous_feeds():
    # ORT takes a strided array as a contiguous copy; the Function sees the same values as eager.
    x = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2].T
    assert not x.flags.c_contiguous
    y, n = run_triple(x, TP.FLOAT)
    np.testing.assert_array_equal(y, Triple.apply(torch.from_numpy(x))[0].numpy())


@ortbridge.register
class Collect(torch.autograd.Function):
    """Returns x plus a checksum of every constant, and records their Python types."""

    seen = None

    @staticmethod
    def forward(ctx, a, x, b, c, d, e, f, g, h):
        Collect.seen = (a, b, c, d, e, f, g, h)
        return x + 1

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError


def test_constants_reach_the_function_with_their_types_and_full_precision():
    marker = object()
    constants = [0.1, True, 7, (1.5, -2.25e-300), (True, False), (3, -4, 2**40), "text", marker]
    args = [constants[0], T("x")] + constants[1:]
    node = python_op(Collect, args, [(TP.FLOAT, 1)], out_names=["y"])
    sess = session(model([node], [value("x", TP.FLOAT, [3])], [value("y")]))
    (y,) = sess.run(None, {"x": np.zeros(3, np.float32)})
    np.testing.assert_array_equal(y, np.ones(3, np.float32))
    assert Collect.seen == tuple(constants)
    assert [type(v) for v in Collect.seen] == [type(v) for v in constants]
    assert Collect.seen[0] == 0.1  # not 0.10000000149 (ORT's float32 attribute)
    assert Collect.seen[-1] is marker


@ortbridge.register
class RecordPointer(torch.autograd.Function):
    pointers = []

    @staticmethod
    def forward(ctx, x):
        RecordPointer.pointers.append(x.data_ptr())
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def test_function_sees_ort_input_buffer_without_copy():
    x = np.arange(1024, dtype=np.float32)
    node = python_op(RecordPointer, [T("x")], [(TP.FLOAT, 1)], out_names=["y"])
    sess = session(model([node], [value("x", TP.FLOAT, [1024])], [value("y")]))
    x_ort = ort.OrtValue.ortvalue_from_numpy(x)
    binding = sess.io_binding()
    binding.bind_ortvalue_input("x", x_ort)
    binding.bind_output("y")
    RecordPointer.pointers.clear()
    sess.run_with_iobinding(binding)
    assert RecordPointer.pointers == [x_ort.data_ptr()]
    np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], x * 2)


def test_output_feeds_other_ort_nodes():
    # The inferred output types let a PythonOp output feed any ONNX node.
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    nodes = [
        python_op(Triple, [T("x", TP.FLOAT, 2)], [(TP.FLOAT, 2), (TP.INT64, 0)], out_names=["y", "n"]),
        helper.make_node("Relu", ["y"], ["r"]),
        helper.make_node("Cast", ["n"], ["nf"], to=TP.FLOAT),
        helper.make_node("Mul", ["r", "nf"], ["out"]),
    ]
    sess = session(model(nodes, [value("x", TP.FLOAT, [2, 3])], [value("out")]))
    (out,) = sess.run(None, {"x": x})
    np.testing.assert_array_equal(out, np.maximum(x * 3, 0) * 6)


def test_inference_mode_runs_without_autograd_and_keeps_no_context():
    x = np.ones(3, np.float32)

    node = python_op(
        Triple, [T("x", TP.FLOAT, 1, requires_grad=True)], [(TP.FLOAT, 1), (TP.INT64, 0)], out_names=["y", "n"]
    )
    sess = session(model([node], [value("x", TP.FLOAT, [3])], [value("ctx", TP.INT64), value("y")]))
    for _ in range(3):
        ctx, y = sess.run(None, {"x": x})
        assert int(ctx) == 0
    assert ortbridge.context_pool_size() == 0


@ortbridge.register
class UsesContext(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        ctx.save_for_backward(x)
        ctx.mark_non_differentiable(x)
        assert ctx.needs_input_grad == (False, False)
        return x * k

    @staticmethod
    def backward(ctx, g):
        raise NotImplementedError


@pytest.mark.parametrize("func", [UsesContext, NewStyle])
def test_safe_run_mode_0_calls_forward_without_autograd(func):
    # ORT's opt-in fast path for inference: the same results without Function.apply.
    x = np.arange(4, dtype=np.float32)
    got = []
    for safe in (1, 0):
        node = python_op(func, [T("x"), 3.0], [(TP.FLOAT, 1)], out_names=["y"], safe_run_mode=safe)
        (y,) = session(model([node], [value("x", shape=[4])], [value("y")])).run(None, {"x": x})
        got.append(y)
    np.testing.assert_array_equal(got[0], x * 3)
    np.testing.assert_array_equal(got[1], got[0])


@ortbridge.register
class RecordsGradMode(torch.autograd.Function):
    """Returns a list (not a tuple): the kernel's direct call hands it to the runner's checks."""

    seen: list = []

    @staticmethod
    def forward(ctx, x, fail):
        RecordsGradMode.seen.append(torch.is_grad_enabled())
        if fail:
            raise ValueError("asked to fail")
        return [x + 1]

    @staticmethod
    def backward(ctx, g):
        return g, None


def test_kernel_calls_run_with_grad_mode_set_and_restored(monkeypatch):
    # On the CPU kernel's own path a call never reaches ForwardNode.run: the kernel calls the Function itself (what
    # run would do, with its Python left out) and goes on to the runner's checks only for
    # unusual results. With run disabled, such calls still work, inference and training alike,
    # and one whose constant is a list (each call gets a copy of it) does not.
    def no_run(self, capsules):
        raise AssertionError("ForwardNode.run was called")

    monkeypatch.setattr(runner.ForwardNode, "run", no_run)
    x = np.arange(3, dtype=np.float32)
    RecordsGradMode.seen.clear()
    # (grad mode outside the call is the other one: the kernel sets the call's and restores it)
    for training, outside in ((False, torch.enable_grad), (True, torch.no_grad)):
        for fail in (False, True):
            node = python_op(
                RecordsGradMode,
                [T("x", requires_grad=training), fail],
                [(TP.FLOAT, 1)],
                out_names=["y"],
                training=training,
            )
            sess = session(model([node], [value("x", shape=[3])], [value("y")]), device_path=False)
            with outside():
                if fail:
                    with pytest.raises(Exception, match="ValueError: asked to fail"):
                        sess.run(None, {"x": x})
                else:
                    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], x + 1)
                assert torch.is_grad_enabled() != training
    assert RecordsGradMode.seen == [False] * 4  # (Function.apply runs forward without grad mode, training or not)
    assert ortbridge.context_pool_size() == 0
    node = python_op(RecordsGradMode, [T("x"), []], [(TP.FLOAT, 1)], out_names=["y"])
    sess = session(model([node], [value("x", shape=[3])], [value("y")]), device_path=False)
    with pytest.raises(Exception, match="ForwardNode.run was called"):
        sess.run(None, {"x": x})


@ortbridge.register
class RunsASession(torch.autograd.Function):
    """Runs RunsASession.inner (a session of one training node) in its forward, recording grad
    mode before and after that run."""

    inner = None
    seen: list = []

    @staticmethod
    def forward(ctx, x):
        before = torch.is_grad_enabled()
        y, context_id = RunsASession.inner.run(["y", "ctx"], {"x": x.numpy()})
        ortbridge.release_context(int(context_id))
        RunsASession.seen.append((before, torch.is_grad_enabled()))
        return torch.from_numpy(y)

    @staticmethod
    def backward(ctx, g):
        return g


def test_grad_mode_is_kept_for_a_runs_next_kernel_and_restored_at_its_end():
    # A kernel of the session a run scope runs leaves the grad mode it set to the next kernel (an
    # inference graph switches once a run); the scope's end puts the caller's back. A session that
    # a Function runs inside that run gets its kernels' modes restored after each call, with a
    # run scope of its own (ortbridge's session) or without (onnxruntime's).
    x = np.arange(3, dtype=np.float32)
    inner = model(
        [
            python_op(
                Triple,
                [T("x", requires_grad=True)],
                [(TP.FLOAT, 1), (TP.INT64, 0)],
                out_names=["y", "n"],
                training=True,
            )
        ],
        [value("x", shape=[3])],
        [value("y"), value("ctx", TP.INT64)],
    )
    outer = session(
        model(
            [
                python_op(RunsASession, [T("x")], [(TP.FLOAT, 1)], out_names=["y"]),
                python_op(RunsASession, [T("y")], [(TP.FLOAT, 1)], out_names=["z"], ctx_name="ctx2", name="fw2"),
            ],
            [value("x", shape=[3])],
            [value("z")],
        )
    )
    for inner_session in (
        session(inner),
        ort.InferenceSession(inner, ortbridge.session_options(), providers=["CPUExecutionProvider"]),
    ):
        RunsASession.inner = inner_session
        RunsASession.seen.clear()
        for outside in (torch.enable_grad, torch.no_grad):
            with outside():
                np.testing.assert_array_equal(outer.run(None, {"x": x})[0], x * 9)
                assert torch.is_grad_enabled() == (outside is torch.enable_grad)
        # (the inner node, training, turns grad mode on; the Function's forward has it off)
        assert RunsASession.seen == [(False, False)] * 4
    assert ortbridge.context_pool_size() == 0
