"""Bad input gets a clear error and loses nothing: after each failure the same session runs
again correctly and no autograd context is left behind (checked by conftest.no_context_left)."""

import re

import numpy as np
import onnxruntime as ort
import pytest
import torch
from conftest import DEVICE_PATH, T, model, python_op, python_op_grad, session, value
from onnx import TensorProto as TP
from onnxruntime.capi.onnxruntime_pybind11_state import Fail, RuntimeException

import ortbridge

ORT_ERRORS = (Fail, RuntimeException)


@ortbridge.register
class Faulty(torch.autograd.Function):
    """Misbehaves in forward or backward as `Faulty.mode` says."""

    mode = None

    @staticmethod
    def forward(ctx, x):
        m = Faulty.mode
        if m == "raise":
            raise ValueError("forward exploded")
        if m == "count":
            return x * 2, x
        if m == "dtype":
            return (x * 2).double()
        if m == "rank":
            return (x * 2).reshape(1, -1)
        if m == "type":
            return "not a tensor"
        if m == "device":
            return torch.empty(x.shape, device="meta")
        if m == "sparse":
            return (x * 2).to_sparse()
        return x * 2

    @staticmethod
    def backward(ctx, g):
        m = Faulty.mode
        if m == "bw_raise":
            raise KeyError("backward exploded")
        if m == "bw_count":  # (extra trailing Nones would be accepted, as torch accepts them)
            return g * 2, g
        if m == "bw_shape":
            return g[:1] * 2
        if m == "bw_double":
            return (g * 2).double()
        if m == "bw_long":
            return (g * 2).long()
        if m == "bw_type":
            return (2.0,)
        if m == "bw_sparse":
            return (g * 2).to_sparse()
        return g * 2


@pytest.fixture
def faulty():
    yield Faulty
    Faulty.mode = None


def train_session():
    fw = python_op(Faulty, [T("x", requires_grad=True)], [(TP.FLOAT, 1)], out_names=["y"], training=True)
    bw = python_op_grad(Faulty, "d", [("g", TP.FLOAT, 1)], [("gx", TP.FLOAT, 1)])
    return session(model([fw, bw], [value("x", shape=[3]), value("g", shape=[3])], [value("y"), value("gx")]))


def run_good(sess):
    Faulty.mode = None
    x = np.arange(3, dtype=np.float32)
    y, gx = sess.run(None, {"x": x, "g": np.ones(3, np.float32)})
    np.testing.assert_array_equal(y, x * 2)
    np.testing.assert_array_equal(gx, np.full(3, 2, np.float32))
    assert ortbridge.context_pool_size() == 0


FORWARD_ERRORS = {
    "raise": r"ValueError: forward exploded",
    "count": r"returned 2 outputs, but the node declares 1",
    "dtype": r"output 1 is float64, but the node declares float32",
    "rank": r"output 1 has rank 2, but the node declares rank 1",
    "type": r"forward returned str; expected a tensor or a tuple of tensors",
    "device": r"output 0 is on meta, but this kernel runs on the CPU",
    "sparse": r"output 0 is a torch.sparse_coo tensor; ONNX Runtime takes dense tensors only \(return t.to_dense\(\)\)",
}
BACKWARD_ERRORS = {
    "bw_raise": r"KeyError: 'backward exploded'",
    "bw_count": r"backward returned 2 values, but forward takes 1 arguments",
    "bw_shape": r"gradient output 0 has shape \(1,\), but the forward input had shape \(3,\)",
    "bw_type": r"backward value 0 is float; expected a torch.Tensor",
    "bw_sparse": r"backward value 0 is a torch.sparse_coo tensor; ONNX Runtime takes dense tensors only",
}


@pytest.mark.parametrize("mode", list(FORWARD_ERRORS) + list(BACKWARD_ERRORS))
def test_function_error_is_reported_and_session_recovers(faulty, mode):
    sess = train_session()
    run_good(sess)
    faulty.mode = mode
    with pytest.raises(ORT_ERRORS) as info:
        sess.run(None, {"x": np.arange(3, dtype=np.float32), "g": np.ones(3, np.float32)})
    message = str(info.value)
    assert re.search((FORWARD_ERRORS | BACKWARD_ERRORS)[mode], message), message
    kind = "PythonOpGrad node 'bw'" if mode.startswith("bw_") else "PythonOp node 'fw'"
    assert f"ortbridge {kind} (function 'test_errors.Faulty')" in message
    assert ortbridge.context_pool_size() == 0
    run_good(sess)


@pytest.mark.parametrize("mode", ["bw_double", "bw_long"])
def test_a_gradient_of_another_dtype_is_cast_to_the_inputs_as_autograd_casts_it(faulty, mode):
    """Eager's autograd casts what backward returns to its input's dtype (float64 or int64 for a
    float32 input: float32), and so does the kernel, on its direct call and the runner's."""
    sess = train_session()
    faulty.mode = mode
    y, gx = sess.run(None, {"x": np.arange(3, dtype=np.float32), "g": np.ones(3, np.float32)})
    assert gx.dtype == np.float32
    np.testing.assert_array_equal(gx, np.full(3, 2, np.float32))
    assert ortbridge.context_pool_size() == 0


def test_python_exception_carries_the_traceback(faulty):
    sess = train_session()
    faulty.mode = "raise"
    with pytest.raises(ORT_ERRORS) as info:
        sess.run(None, {"x": np.ones(3, np.float32), "g": np.ones(3, np.float32)})
    message = str(info.value)
    assert "Traceback (most recent call last)" in message
    assert 'raise ValueError("forward exploded")' in message and "test_errors.py" in message
    run_good(sess)


@pytest.mark.parametrize("mode", list(FORWARD_ERRORS))
def test_inference_call_errors_as_a_training_call_does(faulty, mode):
    # The kernel makes an inference call itself, not through the runner's Python: the same
    # errors, the traceback included (with no Python frame above the call), and the session recovers.
    fw = python_op(Faulty, [T("x")], [(TP.FLOAT, 1)], out_names=["y"])
    sess = session(model([fw], [value("x", shape=[3])], [value("y")]))
    x = np.arange(3, dtype=np.float32)
    faulty.mode = mode
    with pytest.raises(ORT_ERRORS) as info:
        sess.run(None, {"x": x})
    message = str(info.value)
    assert re.search(FORWARD_ERRORS[mode], message), message
    assert "ortbridge PythonOp node 'fw' (function 'test_errors.Faulty')" in message
    if mode == "raise":
        assert "Traceback (most recent call last)" in message
        assert 'raise ValueError("forward exploded")' in message and "test_errors.py" in message
    faulty.mode = None
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], x * 2)


def lent_output(output: int, shape) -> torch.Tensor | None:
    """ONNX Runtime's buffer for the calling node's output `output`, or None where none is lent."""
    capsule = ortbridge._C._lend_output(output, list(shape))
    return None if capsule is None else torch.utils.dlpack.from_dlpack(capsule)


@ortbridge.register
class IntoLentOutput(torch.autograd.Function):
    """Writes x * 2 into the buffer ONNX Runtime lends its output, asked for as `request` says
    ((output, shape); by default its own output and x's shape)."""

    request = None

    @staticmethod
    def forward(ctx, x):
        output, shape = IntoLentOutput.request or (0, x.shape)
        return torch.mul(x, 2, out=lent_output(output, shape))

    @staticmethod
    def backward(ctx, g):
        return g * 2


LENDING_ERRORS = {
    (1, (3,)): r"IndexError: output 1 of a node with 1 outputs",
    (0, (1, 3)): r"ValueError: output 0 cannot have shape \(1, 3\): the node declares rank 1",
    (0, (-1,)): r"ValueError: output 0 cannot have shape \(-1,\): a size is negative",
}


def test_output_buffers_lent_to_python_are_written_without_a_copy_and_checked():
    x = np.arange(3, dtype=np.float32)
    node = python_op(IntoLentOutput, [T("x")], [(TP.FLOAT, 1)], out_names=["y"])
    sess = session(model([node], [value("x", shape=[3])], [value("y")]))
    copies = ortbridge._C.skipped_output_copies()
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], x * 2)
    # (the device path, the CUDA kernels' code, lends nothing: its outputs are copied)
    assert ortbridge._C.skipped_output_copies() == copies + (0 if DEVICE_PATH else 1)
    # Nothing is lent outside a kernel call, nor to a training call (which could save the buffer).
    assert ortbridge._C._lend_output(0, [3]) is None
    train = python_op(IntoLentOutput, [T("x", requires_grad=True)], [(TP.FLOAT, 1)], out_names=["y"], training=True)
    y, ctx = session(model([train], [value("x", shape=[3])], [value("y"), value("ctx", TP.INT64, [])])).run(
        None, {"x": x}
    )
    np.testing.assert_array_equal(y, x * 2)
    assert ortbridge._C.skipped_output_copies() == copies + (0 if DEVICE_PATH else 1)
    ortbridge.release_context(int(ctx))
    # A request the node cannot serve is an error naming it; the session recovers.
    try:
        for request, error in LENDING_ERRORS.items():
            IntoLentOutput.request = request
            if DEVICE_PATH:  # (nothing asked, nothing lent)
                np.testing.assert_array_equal(sess.run(None, {"x": x})[0], x * 2)
                continue
            with pytest.raises(ORT_ERRORS, match=error):
                sess.run(None, {"x": x})
    finally:
        IntoLentOutput.request = None
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], x * 2)


@ortbridge.register
class ReturnsLentAsAnother(torch.autograd.Function):
    """Writes 2 x into the buffer lent for its output 1 and returns it as output 0."""

    @staticmethod
    def forward(ctx, x):
        return torch.mul(x, 2, out=lent_output(1, x.shape)), x + 100

    @staticmethod
    def backward(ctx, g0, g1):
        return g0 * 2 + g1


@ortbridge.register
class LendsAroundASession(torch.autograd.Function):
    """Writes 10 x into its lent output, then runs `inner` on x (a session of its own)."""

    inner = None

    @staticmethod
    def forward(ctx, x):
        out = torch.mul(x, 10, out=lent_output(0, x.shape))
        y, context_id = LendsAroundASession.inner.run(None, {"x": x.numpy()})
        np.testing.assert_array_equal(y, x.numpy() * 2)
        ortbridge.release_context(int(context_id))
        return out

    @staticmethod
    def backward(ctx, g):
        return g * 10


def test_a_lent_buffer_serves_only_its_own_output_and_its_own_call():
    x = np.arange(3, dtype=np.float32)
    # Returned as another output, the buffer would be overwritten by its own output's copy.
    node = python_op(ReturnsLentAsAnother, [T("x")], [(TP.FLOAT, 1)] * 2, out_names=["y0", "y1"])
    sess = session(model([node], [value("x", shape=[3])], [value("y0"), value("y1")]))
    if DEVICE_PATH:  # (nothing lent: both outputs are the Function's own tensors, copied)
        y0, y1 = sess.run(None, {"x": x})
        np.testing.assert_array_equal(y0, x * 2), np.testing.assert_array_equal(y1, x + 100)
    else:
        with pytest.raises(
            ORT_ERRORS,
            match=r"output 1 is in the buffer lent for output 2: return a lent buffer "
            r"as its own output",
        ):
            sess.run(None, {"x": x})
    # A call nested in a lending one (here a training call, which lends nothing) gets none of the
    # outer call's buffers: the outer output keeps what was written into it.
    inner = python_op(IntoLentOutput, [T("x", requires_grad=True)], [(TP.FLOAT, 1)], out_names=["y"], training=True)
    LendsAroundASession.inner = session(
        model([inner], [value("x", shape=[3])], [value("y"), value("ctx", TP.INT64, [])])
    )
    try:
        outer = python_op(LendsAroundASession, [T("x")], [(TP.FLOAT, 1)], out_names=["z"])
        z = session(model([outer], [value("x", shape=[3])], [value("z")])).run(None, {"x": x})[0]
    finally:
        LendsAroundASession.inner = None
    np.testing.assert_array_equal(z, x * 10)
    assert ortbridge.context_pool_size() == 0


def grad_only_session():
    bw = python_op_grad(Faulty, "d", [("g", TP.FLOAT, 1)], [("gx", TP.FLOAT, 1)])
    return session(model([bw], [value("ctx", TP.INT64, []), value("g", shape=[3])], [value("gx")]))


@pytest.mark.parametrize("context_id", [0, 12345, -1])
def test_unknown_context_id(context_id):
    sess = grad_only_session()
    with pytest.raises(ORT_ERRORS, match=f"context id {context_id} is not a live context"):
        sess.run(None, {"ctx": np.asarray(context_id, np.int64), "g": np.ones(3, np.float32)})
    # The same session still serves a real context.
    fw = session(
        model(
            [python_op(Faulty, [T("x", requires_grad=True)], [(TP.FLOAT, 1)], out_names=["y"], training=True)],
            [value("x", shape=[3])],
            [value("ctx", TP.INT64), value("y")],
        )
    )
    ctx, _ = fw.run(None, {"x": np.ones(3, np.float32)})
    (gx,) = sess.run(None, {"ctx": ctx, "g": np.ones(3, np.float32)})
    np.testing.assert_array_equal(gx, np.full(3, 2, np.float32))


def test_context_id_of_wrong_type():
    bw = python_op_grad(Faulty, "d", [("g", TP.FLOAT, 1)], [("gx", TP.FLOAT, 1)])
    with pytest.raises(
        ORT_ERRORS,
        match=re.escape(
            "node 'bw' (function 'test_errors.Faulty'): input 0 ('ctx') is "
            "float32 in the graph, but the node format (a context id) says int64"
        ),
    ):
        session(model([bw], [value("ctx", TP.FLOAT, [2]), value("g", shape=[3])], [value("gx")]))


def test_input_type_differs_from_declared_type():
    node = python_op(Faulty, [T("x", TP.DOUBLE)], [(TP.FLOAT, 1)], out_names=["y"])
    with pytest.raises(
        ORT_ERRORS,
        match=re.escape(
            "node 'fw' (function 'test_errors.Faulty'): input 0 ('x') is "
            "float32 in the graph, but attribute 'input_tensor_types' says float64"
        ),
    ):
        session(model([node], [value("x", TP.FLOAT, [3])], [value("y")]))


def test_input_rank_differs_from_declared_rank():
    node = python_op(Faulty, [T("x", TP.FLOAT, 2)], [(TP.FLOAT, 1)], out_names=["y"])
    sess = session(model([node], [value("x", TP.FLOAT, [3])], [value("y")]))
    with pytest.raises(ORT_ERRORS, match="input 0 has rank 1, but the node declares rank 2"):
        sess.run(None, {"x": np.ones(3, np.float32)})


def test_unregistered_function_is_refused_at_session_creation():
    node = python_op("mypkg.NotRegistered", [T("x")], [(TP.FLOAT, 1)], out_names=["y"], name="mystery")
    with pytest.raises(ortbridge.UnknownFunctionError) as info:  # (ortbridge's class, not ORT's text of it)
        session(model([node], [value("x", TP.FLOAT, [3])], [value("y")]))
    message = str(info.value)
    assert "PythonOp node 'mystery'" in message
    assert "calls Function 'mypkg.NotRegistered', and no Function is registered under that name" in message
    assert "test_errors.Faulty" in message  # the registered names are listed
    assert "ortbridge.register(YourFunction, name='mypkg.NotRegistered')" in message  # and what to do


def test_a_function_registered_under_another_module_is_named_with_the_registration_that_fits():
    """A file exported from a script names __main__.Faulty; where the class is registered under
    the module it lives in, the error says so and how to register it under the file's name."""
    node = python_op("__main__.Faulty", [T("x")], [(TP.FLOAT, 1)], out_names=["y"], name="moved")
    with pytest.raises(ortbridge.UnknownFunctionError) as info:
        session(model([node], [value("x", TP.FLOAT, [3])], [value("y")]))
    message = str(info.value)
    assert f"{Faulty.__module__}.Faulty is registered as '{Faulty.__module__}.Faulty'" in message
    assert "ortbridge.register(Faulty, name='__main__.Faulty')" in message


MALFORMED = {
    "func_name": dict(func_name=""),
    "input_convention": dict(input_convention="dx"),
    "input_tensor_types": dict(input_tensor_types=[1, 1]),
    "output_tensor_ranks": dict(output_tensor_ranks=[-2]),
    "input_requires_grads": dict(input_requires_grads=[2]),
    "training_mode": dict(training_mode=3),
    "safe_run_mode": dict(safe_run_mode=0, training_mode=1),
    "input_int_scalar_positions": dict(input_int_scalars=[1], input_int_scalar_positions=[0]),
    "tensor_reuse_map": dict(tensor_reuse_map=[-1, 5]),
    "ordering_inputs": dict(ordering_inputs=2),
    "output_tensor_dims": dict(output_tensor_dims=[-9]),  # (dim 7 of the inputs: x has one)
}


@pytest.mark.parametrize("attribute", list(MALFORMED))
def test_malformed_attributes_are_refused_naming_node_and_attribute(attribute):
    node = python_op(Faulty, [T("x")], [(TP.FLOAT, 1)], out_names=["y"], name="broken", **MALFORMED[attribute])
    with pytest.raises(ORT_ERRORS) as info:
        session(model([node], [value("x", TP.FLOAT, [3])], [value("y")]))
    message = str(info.value)
    assert "node 'broken'" in message and f"attribute '{attribute}'" in message, message


def test_missing_required_attribute():
    node = python_op(Faulty, [T("x")], [(TP.FLOAT, 1)], out_names=["y"], name="broken")
    del node.attribute[[a.name for a in node.attribute].index("input_tensor_types")]
    with pytest.raises(ORT_ERRORS, match="node 'broken'.*attribute 'input_tensor_types': required"):
        session(model([node], [value("x", TP.FLOAT, [3])], [value("y")]))


def _faulty_with_constant(name: str, **attributes):
    """A PythonOp node calling Faulty with the tensor x and one constant given by `attributes`."""
    from onnx import helper

    return helper.make_node(
        "PythonOp",
        ["x"],
        ["ctx", "y"],
        domain="ortbridge",
        name=name,
        func_name="test_errors.Faulty",
        input_convention="dc",
        input_tensor_types=[1],
        output_tensor_types=[1],
        output_tensor_ranks=[1],
        **attributes,
    )


def test_unknown_pointer_constant_is_refused():
    node = _faulty_with_constant("ptr", input_pointer_scalars=[0x7FFF12345678], input_pointer_scalar_positions=[1])
    with pytest.raises(ORT_ERRORS, match="object key 140733498807928, which no ortbridge.pin_object call made"):
        session(model([node], [value("x", TP.FLOAT, [3])], [value("y")]))


@pytest.mark.parametrize(
    "text, error",
    [
        ("[1, 2]", "holds 2 values, but input_literal_positions names 1"),
        ('{"tuple": [1]}', "holds tuple"),
        ("[1", "not a valid literal list"),
        ('[{"call": "os.system"}]', "unknown literal"),
        ('[{"dtype": "Tensor"}]', "unknown literal"),
        ("[" * 100000 + "]" * 100000, "not a valid literal list"),
    ],
    ids=["count", "not-a-list", "syntax", "unknown-tag", "not-a-dtype", "deep-nesting"],
)
def test_malformed_literals_are_refused_at_session_creation(text, error):
    node = _faulty_with_constant("lit", input_literals=text, input_literal_positions=[1])
    with pytest.raises(ORT_ERRORS, match=f"(?s)node 'lit'.*{re.escape(error)}"):
        session(model([node], [value("x", TP.FLOAT, [3])], [value("y")]))


def test_failed_run_releases_the_contexts_it_created(faulty):
    # The forward keeps a context, then a later node fails before the backward could use it.
    fw = python_op(Faulty, [T("x", requires_grad=True)], [(TP.FLOAT, 1)], out_names=["y"], training=True)
    later = python_op(Faulty, [T("y")], [(TP.FLOAT, 1)], out_names=["z"], ctx_name="c2", name="later")
    bw = python_op_grad(Faulty, "d", [("z", TP.FLOAT, 1)], [("gx", TP.FLOAT, 1)])  # runs after `later`
    sess = session(model([fw, later, bw], [value("x", shape=[3])], [value("gx"), value("ctx", TP.INT64)]))
    feed = {"x": np.ones(3, np.float32)}
    original = Faulty.forward

    def forward(ctx, x):  # fails in the second node only
        if x.requires_grad or not fail:
            return x * 2
        raise ValueError("later node failed")

    fail = True

    try:
        Faulty.forward = staticmethod(forward)
        with pytest.raises(ORT_ERRORS, match="later node failed"):
            sess.run(None, feed)
        assert ortbridge.context_pool_size() == 0
        with pytest.raises(ORT_ERRORS, match="later node failed"):
            sess.run_with_ort_values(None, {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in feed.items()})
        assert ortbridge.context_pool_size() == 0
        fail = False
        gx, ctx = sess.run(None, feed)  # the forward's context was consumed by the backward
        np.testing.assert_array_equal(gx, np.full(3, 8, np.float32))  # backward: 2 * z, z = 2 * (2 * x)
    finally:
        Faulty.forward = original
