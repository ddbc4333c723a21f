"""Functions that write into their input. A node declares it (tensor_reuse_map): where nothing
else reads that value ORT gives the output the input's buffer and nothing is copied; elsewhere
the Function updates a copy in the output's buffer. An undeclared in-place write into ORT's
buffer is refused with a clear error."""

import numpy as np
import pytest
import torch
from conftest import T, model, python_op, session, value
from onnx import TensorProto as TP
from onnx import helper
from onnxruntime.capi.onnxruntime_pybind11_state import RuntimeException

import ortbridge


@ortbridge.register
class DoubleInPlace(torch.autograd.Function):
    returns_input = True

    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        if not DoubleInPlace.returns_input:
            return x.clone()
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2


@pytest.fixture
def double():
    yield DoubleInPlace
    DoubleInPlace.returns_input = True


def relu_double_neg(reuse=True):
    # Relu makes the PythonOp input an intermediate value with no other reader.
    extra = {"tensor_reuse_map": [-1, 0]} if reuse else {}
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        python_op(DoubleInPlace, [T("r")], [(TP.FLOAT, 1)], out_names=["y"], **extra),
        helper.make_node("Neg", ["y"], ["z"]),
    ]
    return session(model(nodes, [value("x", shape=[8])], [value("z")]))


def test_in_place_output_is_not_copied(double):
    sess = relu_double_neg()
    x = np.arange(8, dtype=np.float32)
    before = ortbridge._C.skipped_output_copies()
    (z,) = sess.run(None, {"x": x})
    np.testing.assert_array_equal(z, -2 * x)
    assert ortbridge._C.skipped_output_copies() == before + 1


def test_undeclared_in_place_write_is_refused(double):
    sess = relu_double_neg(reuse=False)  # no declared reuse: the output has a buffer of its own
    with pytest.raises(RuntimeException, match=r"modified input 0 in place, but the node does not declare it"):
        sess.run(None, {"x": np.ones(8, np.float32)})
    (z,) = relu_double_neg().run(None, {"x": np.ones(8, np.float32)})  # and the good case still runs
    np.testing.assert_array_equal(z, np.full(8, -2, np.float32))


@pytest.mark.parametrize("size", [8, 1 << 19])  # (from 1 MiB torch makes the copy)
def test_declared_in_place_write_on_a_buffer_ort_keeps_works_on_a_copy(double, size):
    # A graph input, and a value another node reads too: ORT keeps those buffers, so the
    # Function updates a copy of its input in the output's buffer.
    node = python_op(DoubleInPlace, [T("x")], [(TP.FLOAT, 1)], out_names=["y"], tensor_reuse_map=[-1, 0])
    shared = helper.make_node("Neg", ["x"], ["n"])
    sess = session(model([node, shared], [value("x", shape=[size])], [value("y"), value("n")]))
    x = np.arange(size, dtype=np.float32)
    y, n = sess.run(None, {"x": x})
    np.testing.assert_array_equal(y, 2 * np.arange(size))
    np.testing.assert_array_equal(n, -np.arange(size))  # Neg saw the input as it was
    np.testing.assert_array_equal(x, np.arange(size))  # and the caller's array is untouched


def test_in_place_write_without_returning_the_input_is_refused(double):
    double.returns_input = False
    with pytest.raises(RuntimeException, match="modified input 0 in place without returning it"):
        relu_double_neg().run(None, {"x": np.ones(8, np.float32)})


@ortbridge.register
class FreshAndView(torch.autograd.Function):
    """Output 1 is new, output 2 views input 0: when output 1 takes input 0's buffer, output 2
    must be copied out first."""

    @staticmethod
    def forward(ctx, x):
        return x * 10, x.view_as(x)

    @staticmethod
    def backward(ctx, a, b):
        return a * 10 + b


@pytest.mark.parametrize("size", [4, 1 << 19])
def test_outputs_are_written_so_that_a_reused_buffer_is_read_first(size):
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        python_op(FreshAndView, [T("r")], [(TP.FLOAT, 1)] * 2, out_names=["a", "b"], tensor_reuse_map=[-1, 0, -1]),
        helper.make_node("Neg", ["a"], ["na"]),
        helper.make_node("Neg", ["b"], ["nb"]),
    ]
    sess = session(model(nodes, [value("x", shape=[size])], [value("na"), value("nb")]))
    x = np.arange(size, dtype=np.float32)
    na, nb = sess.run(None, {"x": x})
    np.testing.assert_array_equal(na, -10 * x)
    np.testing.assert_array_equal(nb, -x)


@ortbridge.register
class Reshaped(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view(2, -1)

    @staticmethod
    def backward(ctx, g):
        return g.reshape(-1)


def test_reuse_map_naming_an_input_of_another_rank_falls_back_to_declared_rank():
    # ORTModule graphs map views of inputs too; their shapes differ from the input's.
    node = python_op(Reshaped, [T("r")], [(TP.FLOAT, 2)], out_names=["y"], tensor_reuse_map=[-1, 0])
    nodes = [helper.make_node("Relu", ["x"], ["r"]), node, helper.make_node("Neg", ["y"], ["z"])]
    sess = session(model(nodes, [value("x", shape=[6])], [value("z"), value("y")]))
    assert [len(o.shape) for o in sess.get_outputs()] == [2, 2]  # not the input's [6]
    z, y = sess.run(None, {"x": np.arange(6, dtype=np.float32)})
    np.testing.assert_array_equal(z, -np.arange(6, dtype=np.float32).reshape(2, 3))
