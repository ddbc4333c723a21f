"""Model files are untrusted input. Each test here is a model someone else could have written to
crash the process, write out of bounds, import code, or reach another session's contexts; each
must get a clean error naming the node (and the attribute), or run correctly."""

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from conftest import T, model, python_op, python_op_grad, session, value
from onnx import TensorProto as TP
from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidGraph, RuntimeException

import ortbridge

ORT_ERRORS = (Fail, InvalidGraph, RuntimeException)


def scaling(factor: int, name: str) -> type:
    """A registered Function multiplying by `factor`: two of them are two distinct Functions."""

    def forward(ctx, x):
        return x * factor

    def backward(ctx, g):
        return g * factor

    cls = type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})
    return ortbridge.register(cls, name=f"hostile.{name}")


Double = scaling(2, "Double")
Triple = scaling(3, "Triple")


@ortbridge.register(name="hostile.Transposed")
class Transposed(torch.autograd.Function):
    """Returns a transposed view of its input, which the node declares updated in place."""

    @staticmethod
    def forward(ctx, x):
        return x.t()

    @staticmethod
    def backward(ctx, g):
        return g.t()


def refused(model_bytes, *patterns):
    with pytest.raises(ORT_ERRORS) as info:
        session(model_bytes)
    message = str(info.value)
    for p in patterns:
        assert p in message, message
    return message


def forward_model(fw, x_type=TP.FLOAT, outputs=("y",), y_type=TP.FLOAT):
    return model([fw], [value("x", x_type, [3])], [value(o, y_type) for o in outputs])


# 1. Empty output names.


def test_training_forward_with_unnamed_context_output_is_refused():
    fw = python_op(Double, [T("x", requires_grad=True)], [(TP.FLOAT, 1)], out_names=["y"], ctx_name="", training=True)
    refused(forward_model(fw), "PythonOp node 'fw'", "output 0 has an empty name")


def test_inference_forward_may_leave_the_context_output_unnamed():
    fw = python_op(Double, [T("x")], [(TP.FLOAT, 1)], out_names=["y"], ctx_name="")
    (y,) = session(forward_model(fw)).run(None, {"x": np.ones(3, np.float32)})
    np.testing.assert_array_equal(y, np.full(3, 2, np.float32))


def test_unnamed_function_output_is_refused():
    fw = python_op(Double, [T("x")], [(TP.FLOAT, 1), (TP.FLOAT, 1)], out_names=["y", ""])
    refused(forward_model(fw), "PythonOp node 'fw'", "output 2 has an empty name")


def test_unnamed_wanted_gradient_is_refused():
    bw = python_op_grad(Double, "d", [("g", TP.FLOAT, 1)], [("gx", TP.FLOAT, 1)])
    bw.output[0] = ""  # still marked wanted in output_tensor_requires_grads
    m = model([bw], [value("ctx", TP.INT64, []), value("g", shape=[3])], [value("g")])
    refused(m, "PythonOpGrad node 'bw'", "output 0 has an empty name")


# 2. and 3. Writes sized by the graph's types, never only by the attributes.


def test_zero_gradient_in_another_type_than_the_forward_input_is_an_error():
    # No input requires a gradient, so the context is None and the gradient is written as zeros:
    # in the node's declared type (bool), not the forward input's (float64).
    fw = python_op(Double, [T("x", TP.DOUBLE)], [(TP.DOUBLE, 1)], out_names=["y"], training=True)
    bw = python_op_grad(Double, "d", [("g", TP.DOUBLE, 1)], [("gx", TP.BOOL, 1)])
    m = model(
        [fw, bw],
        [value("x", TP.DOUBLE, [1000]), value("g", TP.DOUBLE, [1000])],
        [value("y", TP.DOUBLE), value("gx", TP.BOOL)],
    )
    sess = session(m)
    with pytest.raises(ORT_ERRORS) as info:
        sess.run(None, {"x": np.ones(1000), "g": np.ones(1000)})
    assert "output_tensor_types entry 0 is bool, but forward input 0 was float64" in str(info.value)


def test_rank_beyond_the_bound_is_refused_before_shape_inference_can_use_it():
    # ORT ignores a failed shape inference and keeps the graph's declared type (bool here): the
    # Function's float32 output would be copied into a buffer a quarter its size.
    fw = python_op(Double, [T("x")], [(TP.FLOAT, 1)], out_names=["y"], output_tensor_ranks=[2**62])
    refused(
        forward_model(fw, y_type=TP.BOOL),
        "PythonOp node 'fw'",
        "'output_tensor_ranks'",
        "rank 4611686018427387904 is not valid",
    )


def test_graph_type_that_disagrees_with_the_attributes_is_refused_at_creation():
    bw = python_op_grad(Double, "d", [("g", TP.FLOAT, 1)], [("gx", TP.FLOAT, 1)])
    m = model([bw], [value("ctx", TP.INT64, []), value("g", TP.DOUBLE, [3])], [value("gx")])
    refused(
        m,
        "PythonOpGrad node 'bw'",
        "input 1 ('g') is float64 in the graph, but attribute 'input_tensor_types' says float32",
    )


# 4. Amplification.


def test_huge_rank_is_refused_at_once():
    fw = python_op(Double, [T("x")], [(TP.FLOAT, 1)], out_names=["y"], output_tensor_ranks=[10_000_000])
    refused(forward_model(fw), "PythonOp node 'fw'", "'output_tensor_ranks'", "rank 10000000 is not valid")


# 5. Literals name nothing outside a fixed table.


def test_dtype_literal_does_not_reach_torch_module_loading():
    script = textwrap.dedent("""
        import sys
        import numpy as np
        import torch
        from onnx import helper
        sys.path.insert(0, sys.argv[1])
        import ortbridge
        from conftest import model, value

        @ortbridge.register(name="hostile.Echo")
        class Echo(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, option):
                return x.clone()

        before = set(sys.modules)
        fw = helper.make_node("PythonOp", ["x"], ["ctx", "y"], domain="ortbridge", name="lit",
                              func_name="hostile.Echo", input_convention="dc", input_tensor_types=[1],
                              input_literals='[{"dtype":"_dynamo"}]', input_literal_positions=[1],
                              output_tensor_types=[1], output_tensor_ranks=[1])
        try:
            ortbridge.InferenceSession(model([fw], [value("x", shape=[3])], [value("y")]),
                                       providers=["CPUExecutionProvider"])
        except Exception as e:
            assert "unknown literal" in str(e), e
        else:
            raise AssertionError("the literal was accepted")
        print(sorted(m for m in set(sys.modules) - before if m.startswith("torch")))
    """)
    out = subprocess.run(
        [sys.executable, "-c", script, str(Path(__file__).parent)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize(
    "literal",
    ['{"device":"cuda:99999999999"}', '{"device":"cpu\\u0000"}', '{"dtype":"Tensor"}', '{"dtype":"float8_e4m3fnuz_x"}'],
)
def test_bad_dtype_and_device_literals_are_refused(literal):
    from ortbridge._format import literals

    with pytest.raises(ValueError, match="unknown literal"):
        literals.decode(f"[{literal}]", 1)


def test_dtype_and_device_literals_still_decode():
    from ortbridge._format import literals

    values = literals.decode('[{"dtype":"bfloat16"},{"dtype":"float8_e4m3fn"},{"device":"cuda:1"}]', 3)
    assert values == [torch.bfloat16, torch.float8_e4m3fn, torch.device("cuda:1")]


# 6. Context ids: unguessable, and only for the Function that made them.


def forward_session(func, name="fw"):
    fw = python_op(func, [T("x", requires_grad=True)], [(TP.FLOAT, 1)], out_names=["y"], training=True, name=name)
    return session(model([fw], [value("x", shape=[3])], [value("ctx", TP.INT64, []), value("y")]))


def backward_session(func):
    bw = python_op_grad(func, "d", [("g", TP.FLOAT, 1)], [("gx", TP.FLOAT, 1)])
    return session(model([bw], [value("ctx", TP.INT64, []), value("g", shape=[3])], [value("gx")]))


def test_context_ids_are_not_sequential():
    fw = forward_session(Double)
    ids = [int(fw.run(None, {"x": np.ones(3, np.float32)})[0]) for _ in range(50)]
    try:
        gaps = np.diff(sorted(ids))
        assert len(set(ids)) == 50 and gaps.min() > 2**20, ids
        assert max(ids).bit_length() > 56, ids  # drawn from 63 random bits
    finally:
        for i in ids:
            ortbridge.release_context(i)


def test_backward_of_another_function_cannot_take_a_context():
    x, g = np.ones(3, np.float32), np.ones(3, np.float32)
    ctx, _ = forward_session(Double).run(None, {"x": x})
    with pytest.raises(ORT_ERRORS, match="is not a live context of this Function"):
        backward_session(Triple).run(None, {"ctx": ctx, "g": g})
    assert ortbridge.context_pool_size() == 1  # the victim's context is untouched
    (gx,) = backward_session(Double).run(None, {"ctx": ctx, "g": g})
    np.testing.assert_array_equal(gx, np.full(3, 2, np.float32))


def test_pinned_object_keys_are_not_addresses():
    obj = object()
    key = ortbridge.pin_object(obj)
    assert key != id(obj) and ortbridge.pin_object(obj) == key


# 7. No context outlives every reference to its id.


def test_context_whose_id_goes_nowhere_is_released_after_the_run():
    fw = python_op(Double, [T("x", requires_grad=True)], [(TP.FLOAT, 1)], out_names=["y"], training=True)
    sess = session(model([fw], [value("x", shape=[3])], [value("y")]))  # "ctx": neither consumed nor output
    for _ in range(100):
        (y,) = sess.run(None, {"x": np.ones(3, np.float32)})
        assert ortbridge.context_pool_size() == 0
    np.testing.assert_array_equal(y, np.full(3, 2, np.float32))


def test_context_whose_id_is_returned_stays_until_its_backward():
    ctx, _ = forward_session(Double).run_with_ort_values(None, {"x": ortbridge_value(np.ones(3, np.float32))})
    assert ortbridge.context_pool_size() == 1
    backward_session(Double).run(None, {"ctx": ctx.numpy(), "g": np.ones(3, np.float32)})
    assert ortbridge.context_pool_size() == 0


def ortbridge_value(array):
    import onnxruntime as ort

    return ort.OrtValue.ortvalue_from_numpy(array)


# 8. A copy skipped only where the bytes are already in place.


def test_transposed_view_of_the_in_place_buffer_is_copied():
    fw = python_op(Transposed, [T("x", rank=2)], [(TP.FLOAT, 2)], out_names=["y"], tensor_reuse_map=[-1, 0])
    m = model([fw], [value("x", shape=[3, 3])], [value("y")])
    x = np.arange(9, dtype=np.float32).reshape(3, 3)
    (y,) = session(m).run(None, {"x": x})
    np.testing.assert_array_equal(y, x.T)


# 10. Error texts from bytes the model chose.


def test_non_utf8_function_name_is_refused_with_an_escaped_name():
    fw = python_op(Double, [T("x")], [(TP.FLOAT, 1)], out_names=["y"])
    fw.attribute[[a.name for a in fw.attribute].index("func_name")].s = b"bad\xff\x00name"
    message = refused(forward_model(fw), "PythonOp node 'fw'", "'func_name'", "bad\\xff\\x00name")
    assert "UnicodeDecodeError" not in message


def test_non_utf8_node_name_is_escaped_in_errors():
    fw = python_op(Double, [T("x")], [(TP.FLOAT, 1)], out_names=["y"], input_tensor_types=[TP.STRING])
    proto = onnx.load_from_string(forward_model(fw))
    proto.graph.node[0].name = "n\x01"  # a control character
    refused(proto.SerializeToString(), "PythonOp node 'n\\x01'", "'input_tensor_types'")
